"""Under CI a skipped host test fails (the rule is in tests/conftest.py): a missing
tool must never turn a run green that tested nothing of what needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parents[1] / "conftest.py").read_text()
TESTS = """
import shutil
import pytest


@pytest.mark.skipif(shutil.which("no-such-tool-here") is None, reason="needs no-such-tool-here")
def test_needs_a_tool():
    pass


def test_skips_in_its_body():
    pytest.skip("no certtool")


@pytest.mark.xfail(reason="a known gap", strict=True)
def test_expected_to_fail():
    assert False
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_skip_fails_under_ci_only(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                    ci: str) -> None:
    pytester.makeconftest(CONFTEST.replace('pytest_plugins = ["pytester"]', "pass  #"))
    pytester.makepyfile(test_tools=TESTS)
    monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    if ci:
        result.assert_outcomes(failed=1, errors=1, xfailed=1)  # a skipif mark skips in setup
        result.stdout.fnmatch_lines(["*skipped under CI*needs no-such-tool-here*",
                                     "*skipped under CI*no certtool*"])
    else:
        result.assert_outcomes(skipped=2, xfailed=1)
