"""Every C extension under AddressSanitizer and UndefinedBehaviorSanitizer:
the host tests that run the C, again, on a build of it with
``-fsanitize=address,undefined`` (``tools.sanitize``, cached under
build/sanitize/ by a hash of the C and its builders). Any finding fails
the test with the sanitizer's report; so does any failing test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import sanitize

#: the whole run's limit: its tests take ~2 minutes on 2 cores, and each
#: has its own limits; this only stops a hang
TIMEOUT = 1200.0


def _run(args: list[str]) -> sanitize.Outcome:
    try:
        return sanitize.run(["-q", "-p", "no:cacheprovider", *args], timeout=TIMEOUT)
    except sanitize.SanitizeError as e:  # (never a skip: the job would pass unseen)
        pytest.fail(str(e))


def test_the_c_is_clean_under_asan_and_ubsan() -> None:
    outcome = _run(sanitize.c_tests())
    assert outcome.ok, outcome.describe()
    # (the tests ran the sanitized build, not the in-tree one)
    assert "aioublk._uring" in outcome.loaded(), outcome.describe()


def test_a_finding_fails_the_run_with_its_report(tmp_path: Path) -> None:
    """ASan's own check of a memory access, through the runtime the run
    preloads: memory poisoned as freed memory is, then read."""
    test = tmp_path / "test_poisoned.py"
    test.write_text(
        "import ctypes\n\n"
        "def test_read_poisoned():\n"
        "    asan = ctypes.CDLL(None)\n"
        "    buf = ctypes.create_string_buffer(64)\n"
        "    asan.__asan_poison_memory_region(buf, ctypes.c_size_t(64))\n"
        "    ctypes.string_at(buf, 64)\n")
    outcome = _run([str(test)])
    assert not outcome.ok
    assert outcome.report is not None and "use-after-poison" in outcome.report, \
        outcome.describe()
    assert "killed by SIGABRT during " in outcome.describe()
    assert "test_poisoned.py::test_read_poisoned" in outcome.describe()


def test_a_failing_test_fails_the_run(tmp_path: Path) -> None:
    test = tmp_path / "test_fails.py"
    test.write_text("def test_fails():\n    assert 1 == 2\n")
    outcome = _run([str(test)])
    assert not outcome.ok and outcome.report is None
    assert outcome.returncode == 1
    assert "pytest exited with status 1" in outcome.describe()


def test_a_ubsan_report_is_found_after_the_progress_dots() -> None:
    """UBSan writes its line where the output is, often after pytest's dots."""
    outcome = sanitize.Outcome(-6, "....../src/x.c:12:3: runtime error: shift exponent 32 is "
                                   "too large for 32-bit type 'unsigned int'\n"
                                   "    #0 0x7f00 in f /src/x.c:12\n")
    assert outcome.report is not None
    assert outcome.report.startswith("/src/x.c:12:3: runtime error: shift exponent 32")


def test_the_c_tests_are_where_the_list_says() -> None:
    """The list names test files by path: a file moved or renamed is noticed
    here, not by a sanitized run that quietly tests less."""
    paths = [Path(p) for p in sanitize.c_tests()]
    assert all(p.is_file() for p in paths), [str(p) for p in paths if not p.is_file()]
    assert len(paths) == len(sanitize.C_TESTS) + len(list(sanitize.ROOT.glob(sanitize.NBD_TESTS)))
    assert list(sanitize.ROOT.glob(sanitize.NBD_TESTS)), sanitize.NBD_TESTS
    assert sanitize.SELF_TEST.is_file()
