"""The fuzz targets of tests/fuzz: what they found, kept as regression
inputs (``corpus/TARGET/regress-*``, run here in-process), and short
fixed-seed runs of each target over its kept corpus (the C ones built
with clang first: tests/fuzz/cbuild.py)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from aioublk.frontend import config
from tests.fuzz import cbuild
from tests.support.qcow2_util import missing_tool

FUZZ = Path(__file__).parents[1] / "fuzz"
#: (a C target's run in its bounded run below: they are in its corpus)
REGRESSIONS = sorted(p for p in FUZZ.glob("corpus/*/regress-*")
                     if p.parent.name not in cbuild.TARGETS)


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_regression_input(path: Path) -> None:
    """An input a fuzz run once failed on: now a one-line error or a result."""
    target = importlib.import_module(f"tests.fuzz.fuzz_{path.parent.name}")
    target.one_input(path.read_bytes())


def config_error(tmp_path: Path, data: bytes) -> str:
    p = tmp_path / "serve.toml"
    p.write_bytes(data)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(p))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert msg.startswith(f"{p}: "), msg
    return msg


def test_config_not_utf8(tmp_path: Path) -> None:
    msg = config_error(tmp_path, b'[[devices]]\ntarget = "null\xff"\n')
    assert "UTF-8" in msg, msg


def test_config_integer_too_long(tmp_path: Path) -> None:
    msg = config_error(tmp_path, b"[[devices]]\nid = " + b"9" * 5000 + b"\n")
    assert "invalid TOML" in msg, msg


def test_config_nested_too_deeply(tmp_path: Path) -> None:
    msg = config_error(tmp_path, b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n")
    assert "nested too deeply" in msg, msg


#: a bounded run of each target: inputs to run (a few seconds' worth; the
#: time cap below stops a slow machine's run early, the seed keeps it reproducible)
BOUNDED = {"header": 20000, "snapshots": 20000, "config": 1000, "image": 300,
           "nbd_uri": 20000}
MAX_TIME = 8  # seconds of fuzzing per target


#: the C targets (libFuzzer with ASan and UBSan; built first, up to a minute)
C_BOUNDED = {"nbd_wire": 20000, "extents": 20000, "batch": 20000}


def bounded_run(target: str, runs: int, artifacts: Path, slack: float) -> None:
    cmd = [sys.executable, "-m", "tests.fuzz.run", target, "--runs", str(runs),
           "--seed", "1", "--max-time", str(MAX_TIME), "--artifacts", str(artifacts)]
    p = subprocess.run(cmd, cwd=FUZZ.parent.parent, capture_output=True, text=True,
                       timeout=MAX_TIME + slack)
    assert p.returncode == 0, f"{p.stdout}{p.stderr[-6000:]}"
    assert "findings: none" in p.stdout, p.stdout


@pytest.mark.parametrize("target", BOUNDED)
def test_fuzz_bounded(target: str, tmp_path: Path) -> None:
    """A fixed-seed run over the kept corpus: no input may raise anything
    but the target's one-line errors, hang or exhaust memory."""
    if importlib.util.find_spec("atheris") is None:
        missing_tool("atheris (pip install -e '.[test]')")
    bounded_run(target, BOUNDED[target], tmp_path, 120)


@pytest.mark.parametrize("target", C_BOUNDED)
def test_fuzz_c_bounded(target: str, tmp_path: Path) -> None:
    """A fixed-seed run of a C target over its kept corpus: no sanitizer
    report, no broken invariant of its harness, no hang. Without clang the
    run says to run scripts/setup, and fails."""
    bounded_run(target, C_BOUNDED[target], tmp_path, 300)
