"""Run a fuzz target: ``python -m tests.fuzz.run TARGET [options]`` from the
repository root, TARGET one of header, image, snapshots, config, nbd_uri
(Python, atheris) or nbd_wire, extents, batch (C, libFuzzer: built first,
see tests/fuzz/cbuild.py).

Bounded (the default; what tests/fuzz/test_fuzz.py runs): ``--runs N --seed S``
over the kept corpus (``corpus/TARGET``), new inputs in a scratch directory
that is thrown away. Long (``--minutes M``): fuzz for M minutes from the
kept corpus, then merge what grew into it (``-merge=1``: only inputs that
add coverage, at most the target's MAX_LEN bytes each).

Each libFuzzer run is a child process (atheris.Fuzz ends its process) with
its address space limited (``--mem-mb``: RLIMIT_AS for Python, so a runaway
allocation is a MemoryError, a finding; libFuzzer's RSS and malloc limits
for C) and a time limit per input (``--timeout``: a hang is a finding). A
finding's input is written to ``--artifacts`` (a scratch directory unless
given) and the run exits non-zero. Options
starting with one dash are passed to libFuzzer (``-dict=...``, say).

The summary line: ``TARGET: N execs in T s, cov C ft F, corpus K files (B
bytes), findings: none`` (or the artifact's path).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.fuzz import cbuild

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
PY_TARGETS = ("header", "image", "snapshots", "config", "nbd_uri")
TARGETS = (*PY_TARGETS, *cbuild.TARGETS)
#: the code each target measures coverage in (modules and their submodules)
INSTRUMENT = {"header": ["aioublk.qcow2.format"], "snapshots": ["aioublk.qcow2.format"],
              "config": ["aioublk.frontend.config", "aioublk.queue.options", "tomllib"],
              "image": ["aioublk.qcow2"], "nbd_uri": ["aioublk.targets.nbd", "urllib.parse"]}
#: the longest input each target gets (libFuzzer -max_len): an image's
#: seeds are up to 81 KiB (extended L2 needs 16 KiB clusters)
MAX_LEN = {"header": 1 << 16, "snapshots": 1 << 16, "config": 1 << 14, "image": 1 << 17,
           "nbd_uri": 1 << 12, "nbd_wire": 1 << 12, "extents": 1 << 12, "batch": 1 << 12}
#: per-input time limits (seconds): the image target does real I/O
TIMEOUTS = {"image": 20}
DEFAULT_TIMEOUT = 10


def corpus(target: str) -> Path:
    return HERE / "corpus" / target


def _inner(target: str, mem_mb: int, args: list[str]) -> None:
    """The child: instrument the target's code (``INSTRUMENT``) and hand the
    process to libFuzzer."""
    limit = mem_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import atheris

    module = importlib.import_module(f"tests.fuzz.fuzz_{target}")
    _instrument(atheris, INSTRUMENT[target])
    # argv[0] is what libFuzzer runs for a merge's child: this command again
    me = f"{sys.executable} -m tests.fuzz.run --inner {target} --mem-mb {mem_mb}"
    atheris.Setup([me, *args], module.one_input)
    atheris.Fuzz()


def _instrument(atheris: Any, names: list[str]) -> None:
    """Instrument, in place, the functions and methods defined in the modules
    ``names`` and their submodules. (atheris.instrument_imports would do it at
    import, but its import hook slows every import of aioublk's: seconds.)"""
    seen: set[int] = set()  # (a class may hold itself: urllib.parse's results do)

    def walk(obj: Any, module: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for v in list(vars(obj).values()):
            f = v.__func__ if isinstance(v, staticmethod | classmethod) else v
            if isinstance(f, property):
                for g in (f.fget, f.fset, f.fdel):
                    if inspect.isfunction(g):
                        atheris.instrument_func(g)
            elif inspect.isfunction(f) and f.__module__ == module:
                atheris.instrument_func(f)
            elif inspect.isclass(f) and f.__module__ == module:
                walk(f, module)

    for name, module in list(sys.modules.items()):
        if any(name == n or name.startswith(n + ".") for n in names):
            walk(module, name)


def _libfuzzer(target: str, mem_mb: int, args: list[str], deadline: float) -> tuple[int, str]:
    if target in cbuild.TARGETS:
        cmd = [str(cbuild.build(target)), f"-malloc_limit_mb={mem_mb}", *args]
        env = {**os.environ, **cbuild.ENV}
    else:
        cmd = [sys.executable, "-m", "tests.fuzz.run", "--inner", target, "--mem-mb",
               str(mem_mb), *args]
        env = None
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=deadline,
                           errors="replace", env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        return -1, f"{out}\nthe fuzzer ran past its deadline of {deadline:.0f} s\n"
    return p.returncode, p.stdout + p.stderr


def _stats(log: str) -> str:
    """execs, coverage and features from libFuzzer's last status line."""
    execs = re.findall(r"^#(\d+)\s", log, re.M)
    cov = re.findall(r"\bcov: (\d+) ft: (\d+)", log)
    done = re.search(r"Done (\d+) runs in (\d+) second", log)
    n = done[1] if done else (execs[-1] if execs else "?")
    secs = f" in {done[2]} s" if done else ""
    c, f = cov[-1] if cov else ("?", "?")
    return f"{n} execs{secs}, cov {c} ft {f}"


def _size(d: Path) -> tuple[int, int]:
    files = [p for p in d.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--runs", type=int, default=2000, help="inputs to run (bounded run)")
    ap.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed")
    ap.add_argument("--max-time", type=int, default=20,
                    help="bounded run: stop after this many seconds anyway")
    ap.add_argument("--minutes", type=float, help="long run: fuzz this long, then merge")
    ap.add_argument("--timeout", type=int, help="seconds one input may take")
    ap.add_argument("--mem-mb", type=int, default=2048, help="address space limit (MiB)")
    ap.add_argument("--artifacts", type=Path, help="where a finding's input goes")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ns, extra = ap.parse_known_args(argv)
    if ns.inner:
        _inner(ns.target, ns.mem_mb, extra)
        return 0  # not reached: libFuzzer exits
    unknown = [a for a in extra if not a.startswith("-") or a.startswith("--")]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.target in cbuild.TARGETS:
        try:
            cbuild.build(ns.target)
        except cbuild.BuildError as e:
            print(f"{ns.target}: {e}", file=sys.stderr)
            return 2
    max_len = MAX_LEN[ns.target]
    timeout = ns.timeout or TIMEOUTS.get(ns.target, DEFAULT_TIMEOUT)
    kept = corpus(ns.target)
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{ns.target}-") as tmp:
        work = Path(tmp) / "new"
        work.mkdir()
        artifacts = ns.artifacts or Path(tmp) / "artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        common = [f"-seed={ns.seed}", f"-timeout={timeout}", f"-max_len={max_len}",
                  f"-rss_limit_mb={ns.mem_mb}", f"-artifact_prefix={artifacts}/",
                  "-print_final_stats=1", *extra]
        if ns.minutes:
            secs = int(ns.minutes * 60)
            args = [*common, f"-max_total_time={secs}", str(work), str(kept)]
            deadline = secs + 120.0
        else:
            args = [*common, f"-runs={ns.runs}", f"-max_total_time={ns.max_time}", str(work),
                    str(kept)]
            deadline = ns.max_time + 60.0
        start = time.monotonic()
        rc, log = _libfuzzer(ns.target, ns.mem_mb, args, deadline)
        found = sorted(p for p in artifacts.iterdir()) if artifacts.exists() else []
        if rc != 0 or found:
            sys.stderr.write(log[-6000:])
            shown = ", ".join(str(p) for p in found) or f"exit status {rc}"
            print(f"{ns.target}: {_stats(log)}: FINDING: {shown}")
            if found and not ns.artifacts:  # keep it past the scratch directory
                keep = Path(tempfile.mkdtemp(prefix=f"fuzz-{ns.target}-finding-"))
                for p in found:
                    shutil.copy(p, keep)
                print(f"{ns.target}: the input is kept in {keep}")
            return 1
        stats = _stats(log)
        if ns.minutes:
            grown = len(list(work.iterdir()))
            mrc, mlog = _libfuzzer(ns.target, ns.mem_mb,
                                   [*common, "-merge=1", str(kept), str(work)], 1800.0)
            if mrc != 0:
                sys.stderr.write(mlog[-6000:])
                print(f"{ns.target}: the merge failed (exit status {mrc})")
                return 1
            added = re.search(r"MERGE-OUTER: (\d+) new files", mlog)
            stats += (f", {grown} new inputs, {added[1] if added else '?'} merged into "
                      f"{kept.relative_to(ROOT)}")
        n, nbytes = _size(kept)
        print(f"{ns.target}: {stats} ({time.monotonic() - start:.0f} s wall), corpus {n} "
              f"files ({nbytes} bytes), findings: none")
        return 0


if __name__ == "__main__":
    sys.exit(main())
