"""mypy (strict) and ruff are part of the test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff() -> None:
    p = _run("ruff", "check", "--output-format", "concise", "aioublk", "tests", "bench", "docs",
             "examples", "tools")
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_strict() -> None:
    p = _run("mypy", "--cache-dir", "/tmp/aioublk-mypy-cache")
    assert p.returncode == 0, p.stdout + p.stderr
