"""What the light commands import: ``list``, ``del``, ``features`` and
``udev owner`` (polled by scripts, run by udev for every ublk node) start
without asyncio, uvloop or structlog, within the issue's 90 modules.

Counted in a child started with ``-S`` and the package on ``PYTHONPATH``:
no site module and no editable install's finder (which imports pathlib,
urllib and re for every command of a development checkout), so the count
is the interpreter's own modules plus what the command imports, as in an
installed aioublk."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import aioublk

ROOT = Path(aioublk.__file__).resolve().parent.parent
LIMIT = 90
HEAVY = ("asyncio", "uvloop", "structlog", "logging", "dataclasses", "pathlib", "shutil",
         "aioublk.ring", "aioublk.device", "aioublk.frontend.cli")

CHILD = """
import sys
sys.argv = ["aioublk", *sys.argv[1:]]
from aioublk.__main__ import entry
try:
    entry()
finally:
    sys.stderr.write("\\nMODULES " + " ".join(sorted(sys.modules)) + "\\n")
"""


def imported(*args: str) -> list[str]:
    # (cffi's backend lives in site-packages, which -S leaves off the path)
    path = os.pathsep.join([str(ROOT), sysconfig.get_paths()["platlib"]])
    p = subprocess.run([sys.executable, "-S", "-c", CHILD, *args], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": path}, timeout=60,
                       stdin=subprocess.DEVNULL)
    line = p.stderr.rsplit("\nMODULES ", 1)[-1]
    return line.split()


@pytest.mark.parametrize("args", [["list"], ["list", "--json"], ["del", "-a"], ["features"],
                                  ["udev", "owner", "ublkb0"]], ids=" ".join)
def test_a_light_command_imports_no_loop_and_at_most_90_modules(args: list[str]) -> None:
    mods = imported(*args)
    assert "aioublk.frontend.ctl" in mods  # (it ran)
    assert [m for m in mods if m.split(".")[0] in HEAVY or m in HEAVY] == []
    assert len(mods) <= LIMIT, f"{len(mods)} modules: {' '.join(mods)}"


def test_version_imports_only_the_package_root() -> None:
    mods = imported("--version")
    assert [m for m in mods if m.startswith("aioublk")] == ["aioublk", "aioublk.__main__",
                                                           "aioublk._lazy", "aioublk._version"]
