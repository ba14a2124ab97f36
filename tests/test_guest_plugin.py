"""The guest harness's rule (host, no kernel): a `guest` test that skips
fails, because a skipped kernel test hides a broken harness or driver.

Each case runs pytest on a tiny test file in a subprocess, with our plugin
and `/dev/ublk-control` made to look present (so the tests run here, as they
do inside the guest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

CONFTEST = """
from pathlib import Path
from xml.etree import ElementTree
from aioublk.testing import pytest_plugin
pytest_plugin.UBLK_CONTROL = Path("/")  # "the driver is here": run guest tests in place
"""

TESTS = '''
import pytest

guest = pytest.mark.guest


@pytest.fixture
def needs_something():
    pytest.skip("no fio")


@guest
def test_skip_in_call():
    pytest.skip("no zstd")


@guest
@pytest.mark.skipif(True, reason="kernel too old")
def test_skipif_marker():
    pass


@guest
def test_skip_in_fixture(needs_something):
    pass


@guest
def test_importorskip():
    pytest.importorskip("no_such_module_here")


@guest
def test_passes():
    pass


@guest
@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail():
    assert False


def test_host_skip_stays_a_skip():
    pytest.skip("not a guest test")
'''


def run_pytest(tmp_path: Path) -> tuple[dict[str, str], str]:
    """Outcome of each test (node name -> passed/failed/error/skipped/xfailed)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aioublk.testing.pytest_plugin",
         "-p", "no:cacheprovider", "--strict-markers", "-rA", f"--junitxml={report}",
         str(tmp_path / "test_tiny.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [c for c in case if c.tag in ("failure", "error", "skipped")]
        kind = kinds[0].tag if kinds else "passed"
        if kind == "skipped" and kinds[0].get("type") == "pytest.xfail":
            kind = "xfailed"
        outcomes[case.get("name", "")] = kind
    return outcomes, p.stdout


def test_a_guest_test_that_skips_fails(tmp_path: Path) -> None:
    out, stdout = run_pytest(tmp_path)
    assert out == {
        "test_skip_in_call": "failure",
        "test_skipif_marker": "error",
        "test_skip_in_fixture": "error",
        "test_importorskip": "failure",
        "test_passes": "passed",
        "test_xfail": "xfailed",
        "test_host_skip_stays_a_skip": "skipped",
    }, stdout
    assert "a guest test must not skip" in stdout and "no zstd" in stdout, stdout
