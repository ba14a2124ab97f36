"""Which Python the venv should use: the per-request Python cost under each interpreter.

    python -m bench.interpreters [--rounds 7] [--quick] [--python NAME=PATH ...]

The same in-process workloads run under every candidate interpreter: Debian's
``/usr/bin/python3.X`` and pyenv's builds (``$(pyenv root)/versions/3.1*``), 3.11 and
later, or the ``--python`` ones. Each gets its own venv under
``${AIOUBLK_CACHE:-~/.cache/aioublk}/interp-venvs/NAME`` with this package installed
from a copy of the tracked files (not editable: the checkout's own extension stays
as it is; the dependencies come from the package index); a venv is rebuilt only when
the interpreter or the sources it was built from change (the first run compiles the
extension once per interpreter, a minute or two each).

Workloads, 4 KiB reads with DEPTH (64) requests in flight, the next one started as soon
as one completes, on a uvloop loop with one ``Ring`` set up as a ublk queue's
(``queue_ring_flags()``, the queue's sizes):

- ``ring task``: every request a task (``loop.create_task``) that awaits
  ``ring.read(fd, buf, off)`` and then starts the next request's task, as the queue
  spawns the coroutine path.
- ``ring task eager``: the same with ``asyncio.eager_task_factory`` (Python 3.12+):
  a task runs at once, up to its first suspension, instead of one loop turn later.
- ``ring task eager_start``: the same with ``loop.create_task(coro, eager_start=True)``
  and no factory (Python 3.13+, where uvloop passes ``eager_start`` on to the task).
- ``ring start``: the task-free path, ``Ring.start_read`` with a completion callback
  made once per slot (as the queue's drivers keep theirs).
- ``qcow2 task``, ``qcow2 task eager``, ``qcow2 task eager_start``, ``qcow2 start``:
  the same four through
  ``Qcow2Image`` (``read`` / ``start_read``, the coroutine path where the latter
  declines) on a fully preallocated qcow2 image, buffered, at the offsets
  ``bench.qcow2_host`` uses (``i * STEP % size``).

The files live in /var/tmp (``--dir``) and stay in the page cache: on ext4 io_uring
completes such a read at submit, in the calling thread, so a run's CPU time is its
Python and its syscalls. (Not /dev/shm: io_uring hands tmpfs reads to its io-wq
worker threads, which run beside the loop on the other core and count in its CPU
time.) The main figure is requests per second of the process's CPU time, which a
busy neighbour disturbs far less than wall-clock time (also recorded).

A fresh process per run (interpreter x workload x round), a short warm-up in each
before the timing; the interpreters take turns within every workload and round, in
an order that rotates each round (the machine is shared: medians, not means). The
ratios are against the baseline, by default what ``python3`` runs here (what
``scripts/setup`` used before it chose), each the median over rounds of the ratio of
the two runs of the same round. Writes ``bench/results/interpreters.md`` and
``.json``; ``--report JSON`` rewrites the former from the latter.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from bench.common import ROOT, grouped_bars, load, median, parser, publish
from bench.common import paired as paired_runs

CACHE = Path(os.environ.get("AIOUBLK_CACHE", Path.home() / ".cache" / "aioublk"))
DEPTH = 64
BUFSIZE = 4096
RING_FILE = 64 << 20
QCOW2_SIZE = 256 << 20
STEP = 7919 * BUFSIZE  # as bench.qcow2_host: every request in another cluster and L2 table
# name -> (backend, mode, requests)
WORKLOADS: dict[str, tuple[str, str, int]] = {
    "ring task": ("ring", "task", 100_000),
    "ring task eager": ("ring", "eager", 100_000),
    "ring task eager_start": ("ring", "eager_start", 100_000),
    "ring start": ("ring", "start", 200_000),
    "qcow2 task": ("qcow2", "task", 50_000),
    "qcow2 task eager": ("qcow2", "eager", 50_000),
    "qcow2 task eager_start": ("qcow2", "eager_start", 50_000),
    "qcow2 start": ("qcow2", "start", 100_000),
}
QUICK_DIVISOR = 10
WARMUP = 3_000

# -- in the child: one workload under one interpreter --------------------------------

Read = Callable[[int, memoryview], Awaitable[object]]
Start = Callable[[int, memoryview, Any], bool]  # done: (res) for qcow2, (res, flags) ring


async def _drive(backend: str, mode: str, path: str, count: int) -> dict[str, Any]:
    from aioublk.ring import Ring, queue_ring_flags

    loop = asyncio.get_running_loop()
    factory = await _set_eager(loop) if mode == "eager" else None
    ring = Ring(max(2 * DEPTH, 64), cq_entries=max(8 * DEPTH, 256), flags=queue_ring_flags(),
                bind_thread=True)
    closers: list[Callable[[], Awaitable[None]]] = []
    try:
        if backend == "ring":
            fd = os.open(path, os.O_RDONLY)
            size = os.fstat(fd).st_size

            async def read(offset: int, buf: memoryview) -> object:
                return await ring.read(fd, buf, offset)

            def start(offset: int, buf: memoryview, done: Any) -> bool:
                ring.start_read(fd, buf, offset, done)
                return True

            async def close_fd() -> None:
                os.close(fd)
            closers.append(close_fd)
        else:
            from aioublk.qcow2 import Qcow2Image

            img = Qcow2Image.open(path, read_only=True, direct=False)
            closers.append(img.close)
            size = img.size
            read, start = img.read, img.start_read
        run = _callbacks if mode == "start" else _tasks
        spawn = _eager_start(loop) if mode == "eager_start" else loop.create_task
        await run(read, start, size, WARMUP, spawn)
        t0, c0 = time.perf_counter(), time.process_time()
        await run(read, start, size, count, spawn)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        for close in closers:
            await close()
    finally:
        ring.close()
    return {"seconds": seconds, "ops": count / seconds, "cpu_seconds": cpu,
            "cpu_ops": count / cpu,
            **({"factory": factory} if factory else {})}


def _eager_task(loop: asyncio.AbstractEventLoop, coro: Any, *, name: str | None = None,
                context: Any = None, eager_start: bool | None = None) -> asyncio.Task[Any]:
    """An eager task factory that takes the ``eager_start`` uvloop passes on 3.13+."""
    return asyncio.Task(coro, loop=loop, name=name, context=context,  # type: ignore[call-arg,unused-ignore]
                        eager_start=True)


async def _set_eager(loop: asyncio.AbstractEventLoop) -> str:
    """Make every new task eager: ``asyncio.eager_task_factory`` if the loop can
    call it, else ``_eager_task``. Returns which, and why."""
    async def probe() -> int:
        return 1

    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
    coro = probe()
    try:
        task = loop.create_task(coro)
    except TypeError as e:
        coro.close()
        loop.set_task_factory(_eager_task)
        task = loop.create_task(probe())
        how = f"own factory (asyncio.eager_task_factory: TypeError: {e})"
    else:
        how = "asyncio.eager_task_factory"
    if not task.done():  # an eager task that never suspends is done at once
        raise RuntimeError(f"{how}: the task did not run eagerly")
    return how


def _eager_start(loop: asyncio.AbstractEventLoop) -> Callable[[Any], object]:
    """``create_task(coro, eager_start=True)``: an eager task asked of create_task
    itself, no factory (uvloop passes it on to asyncio.Task on Python 3.13+)."""
    spawn = functools.partial(cast(Any, loop).create_task, eager_start=True)

    async def probe() -> int:
        return 1

    if not spawn(probe()).done():
        raise RuntimeError("create_task(eager_start=True) made a task that did not run at once")
    return spawn


class _Requests:
    """A run's requests: COUNT offsets handed out in order, DEPTH in flight, and the
    future that ends the run."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.left = count
        self.nxt = 0
        self.inflight = DEPTH
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def next(self) -> int:
        """The next request's offset; -1 when none is left (one lane fewer in flight)."""
        if self.left > 0:
            self.left -= 1
            offset = self.nxt
            self.nxt = (offset + STEP) % self.size
            return offset
        self.inflight -= 1
        if not self.inflight and not self.finished.done():
            self.finished.set_result(None)
        return -1

    def fail(self, e: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(e)


async def _tasks(read: Read, _start: Start, size: int, count: int, spawn: Any) -> None:
    """A task per request; a finished request starts the next one's task."""
    reqs = _Requests(size, count)

    async def request(offset: int, buf: memoryview) -> None:
        try:
            await read(offset, buf)
        except BaseException as e:
            reqs.fail(e)
            raise
        issue(buf)

    def issue(buf: memoryview) -> None:
        offset = reqs.next()
        if offset >= 0:
            spawn(request(offset, buf))

    for _ in range(DEPTH):
        issue(memoryview(mmap.mmap(-1, BUFSIZE)))
    await reqs.finished


async def _callbacks(read: Read, start: Start, size: int, count: int, _spawn: Any) -> None:
    """Task-free: ``start`` with a completion callback made once per slot; a task
    (the coroutine path) only where ``start`` declines."""
    loop = asyncio.get_running_loop()
    reqs = _Requests(size, count)
    bufs = [memoryview(mmap.mmap(-1, BUFSIZE)) for _ in range(DEPTH)]

    def issue(slot: int) -> None:
        offset = reqs.next()
        if offset >= 0 and not start(offset, bufs[slot], dones[slot]):
            loop.create_task(slow(offset, slot))

    def answered(slot: int, res: int, _flags: int = 0) -> None:
        if res < 0:
            reqs.fail(OSError(-res, os.strerror(-res)))
            return
        issue(slot)

    async def slow(offset: int, slot: int) -> None:
        await read(offset, bufs[slot])
        answered(slot, BUFSIZE)

    dones = [functools.partial(answered, s) for s in range(DEPTH)]
    for s in range(DEPTH):
        issue(s)
    await reqs.finished


def child_main(backend: str, mode: str, path: str, count: int) -> None:
    import uvloop

    import aioublk

    here = str(Path(aioublk.__file__).resolve())
    if not here.startswith(str(Path(sys.prefix).resolve())):
        raise SystemExit(f"aioublk imported from {here}, not from the venv {sys.prefix}")
    result = uvloop.run(_drive(backend, mode, path, count))
    print(json.dumps(result))


# -- the interpreters ------------------------------------------------------------------


def _sh(cmd: list[str], timeout: float = 60) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          check=True, stdin=subprocess.DEVNULL).stdout


INFO = """
import json, sys, sysconfig
v = sysconfig.get_config_var
args = v('CONFIG_ARGS') or ''
print(json.dumps({'version': sys.version.split()[0], 'executable': sys.executable,
    'config_args': args, 'py_cflags': v('PY_CFLAGS'), 'opt': v('OPT'),
    'enable_optimizations': '--enable-optimizations' in args,
    'with_lto': '--with-lto' in args, 'shared': bool(v('Py_ENABLE_SHARED'))}))
"""


def describe(python: str) -> dict[str, Any]:
    """Version and build configuration of an interpreter (sysconfig, ldd, dpkg)."""
    info: dict[str, Any] = json.loads(_sh([python, "-c", INFO]))
    exe = os.path.realpath(info["executable"])
    info["executable"] = exe
    try:
        info["libpython_linked"] = "libpython" in _sh(["ldd", exe])
    except (OSError, subprocess.SubprocessError):
        info["libpython_linked"] = None
    try:
        info["dpkg"] = _sh(["dpkg", "-S", exe]).split(":")[0]
    except (OSError, subprocess.SubprocessError):
        info["dpkg"] = None
    return info


def candidates() -> dict[str, str]:
    """Debian's and pyenv's interpreters of Python 3.11 or later: name -> path."""
    found: dict[str, str] = {}
    for p in sorted(Path("/usr/bin").glob("python3.[0-9]*")):
        if re.fullmatch(r"python3\.(1[1-9]|[2-9]\d)", p.name):
            found[f"debian-{p.name[6:]}"] = str(p)
    try:
        pyenv = Path(_sh(["pyenv", "root"]).strip())
    except (OSError, subprocess.SubprocessError):
        pyenv = Path.home() / ".pyenv"
    for d in sorted((pyenv / "versions").glob("3.*")):
        if re.fullmatch(r"3\.(1[1-9]|[2-9]\d)\.\d+", d.name) and (d / "bin/python3").exists():
            found[f"pyenv-{d.name}"] = str(d / "bin/python3")
    return found


def _tracked_files() -> list[str]:
    out = _sh(["git", "-C", str(ROOT), "ls-files", "-z", "pyproject.toml", "setup.py",
               "README.md", "LICENSE*", "aioublk"])
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def venv_for(name: str, python: str) -> Path:
    """A venv of `python` with this package installed, rebuilt when stale."""
    venv = CACHE / "interp-venvs" / name
    files = _tracked_files()
    h = hashlib.sha256(os.path.realpath(python).encode() + _sh([python, "-V"]).encode())
    for f in files:
        h.update(f.encode() + b"\0" + (ROOT / f).read_bytes())
    stamp = venv / ".aioublk-install"
    if stamp.exists() and stamp.read_text() == h.hexdigest():
        return venv
    print(f"{name}: building {venv} (pip install of a copy of the checkout)", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _sh([python, "-m", "venv", str(venv)], timeout=300)
    with tempfile.TemporaryDirectory(prefix="aioublk-src.") as src:
        for f in files:
            (Path(src) / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, Path(src) / f)
        _sh([str(venv / "bin/python"), "-m", "pip", "install", "-q", src], timeout=1200)
    stamp.write_text(h.hexdigest())
    return venv


def versions_in(venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) "
            "for p in ('uvloop', 'cffi')}))")
    return json.loads(_sh([str(venv / "bin/python"), "-c", code]))  # type: ignore[no-any-return]


# -- host side ------------------------------------------------------------------------


def _make_files(folder: str) -> dict[str, str]:
    ring_file = os.path.join(folder, "data")
    with open(ring_file, "wb") as f:
        block = bytes(range(256)) * (BUFSIZE // 256)
        for _ in range(RING_FILE // BUFSIZE):
            f.write(block)
    image = os.path.join(folder, "bench.qcow2")
    _sh(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=full", image,
         str(QCOW2_SIZE)], timeout=300)
    return {"ring": ring_file, "qcow2": image}


def run_one(venv: Path, backend: str, mode: str, path: str, count: int) -> dict[str, Any]:
    cmd = [str(venv / "bin/python"), str(Path(__file__).resolve()), "--child", backend, mode,
           path, str(count)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL, cwd="/")
    if p.returncode != 0:
        msg = (p.stderr.strip() or p.stdout.strip()).splitlines()
        return {"error": f"exit {p.returncode}: {' | '.join(msg[-3:])}"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    except (ValueError, IndexError) as e:
        return {"error": f"unreadable output: {e!r}: {p.stdout[-200:]!r}"}


def _eager_ok(mode: str, version: str) -> bool:
    """Eager tasks need Python 3.12; uvloop passes ``eager_start`` on from 3.13."""
    need = {"eager": (3, 12), "eager_start": (3, 13)}.get(mode, (0, 0))
    return tuple(int(x) for x in version.split(".")[:2]) >= need


def run(pythons: dict[str, str], baseline: str, rounds: int, quick: bool,
        where: str) -> dict[str, Any]:
    interps: dict[str, dict[str, Any]] = {}
    venvs: dict[str, Path] = {}
    for name, python in pythons.items():
        interps[name] = describe(python)
        venvs[name] = venv_for(name, python)
        interps[name].update(versions_in(venvs[name]))
    release = os.uname().release
    data: dict[str, Any] = {"kernel": release, "cpus": os.cpu_count(), "depth": DEPTH,
                            "bufsize": BUFSIZE, "rounds": rounds, "quick": quick,
                            "baseline": baseline, "interpreters": interps, "runs": []}
    names = list(pythons)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=where, prefix="aioublk-interp.") as folder:
        files = _make_files(folder)
        fstype = _sh(["findmnt", "-no", "FSTYPE", "-T", folder]).strip()
        data["files"] = {"dir": where, "fs": fstype}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for workload, (backend, mode, count) in WORKLOADS.items():
                if quick:
                    count //= QUICK_DIVISOR
                for name in order:
                    if not _eager_ok(mode, interps[name]["version"]):
                        continue
                    res = run_one(venvs[name], backend, mode, files[backend], count)
                    data["runs"].append({"round": r + 1, "workload": workload,
                                         "python": name, "count": count, **res})
                    shown = (f"{res['ops']:,.0f} ops/s, {res['cpu_ops']:,.0f} per CPU s"
                             if "ops" in res
                             else f"ERROR {res['error']}")
                    print(f"[{time.monotonic() - start:4.0f} s] round {r + 1}: {workload:16} "
                          f"{name:14} {shown}", flush=True)
    data["seconds"] = round(time.monotonic() - start)
    return data


def medians(data: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
    """python -> workload -> median of `key` (cpu_ops or ops)."""
    out: dict[str, dict[str, float]] = {}
    for name in data["interpreters"]:
        for workload in WORKLOADS:
            value = median(data["runs"], key, python=name, workload=workload)
            if value is not None:
                out.setdefault(name, {})[workload] = value
    return out


def paired(data: dict[str, Any], key: str, a: tuple[str, str],
           b: tuple[str, str]) -> float | None:
    """The median over rounds of a / b, each (python, workload), both from the same
    round: runs close in time share the machine's load of the moment."""
    return paired_runs(data["runs"], {"python": a[0], "workload": a[1]},
                       {"python": b[0], "workload": b[1]}, key)


def _build(info: dict[str, Any]) -> str:
    """What the build flags say, in a few words."""
    parts = []
    if info["enable_optimizations"]:
        parts.append("PGO (--enable-optimizations)")
    if info["with_lto"]:
        parts.append("LTO (--with-lto)")
    if info.get("dpkg"):
        parts.append(f"Debian's {info['dpkg']}: PGO + LTO (not in sysconfig, see below)")
    if not info["enable_optimizations"] and not info["with_lto"] and not info.get("dpkg"):
        parts.append("no PGO, no LTO")
    opt = re.findall(r"-O\d", info["py_cflags"] or "")
    parts.append(opt[-1] if opt else "no -O")
    parts.append("libpython.so" if info["libpython_linked"] else "static libpython")
    return ", ".join(parts)


def _table(data: dict[str, Any], key: str, build: bool) -> list[str]:
    interps: dict[str, dict[str, Any]] = data["interpreters"]
    base = data["baseline"]
    med = medians(data, key)
    lines = ["| interpreter | " + ("build | " if build else "") + " | ".join(WORKLOADS) + " |",
             "| --- |" + (" --- |" if build else "") + " ---: |" * len(WORKLOADS)]
    for name, info in interps.items():
        cells = []
        for w in WORKLOADS:
            v = med.get(name, {}).get(w)
            ratio = paired(data, key, (name, w), (base, w))
            cells.append("—" if v is None else f"{v:,.0f}" if ratio is None
                         else f"{v:,.0f} ({ratio:.2f})")
        lines.append(f"| {name} ({info['version']}) | " + (f"{_build(info)} | " if build else "")
                     + " | ".join(cells) + " |")
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """Requests per CPU second under each interpreter over the baseline's, per
    workload the baseline ran too (paired within rounds; 1: as fast)."""
    names = list(data["interpreters"])
    done = dict.fromkeys(str(x["workload"]) for x in data["runs"])
    values = {(w, n): paired(data, "cpu_ops", (n, w), (data["baseline"], w))
              for w in done for n in names}
    shown = [w for w in done if any(values[(w, n)] is not None for n in names)]
    grouped_bars(path, shown, names, values, f"per CPU second / {data['baseline']}",
                 "Which interpreter: the per-request Python cost", per_group=1.6,
                 fontsize=7)


def report(data: dict[str, Any], command: str) -> str:
    interps: dict[str, dict[str, Any]] = data["interpreters"]
    base = data["baseline"]
    lines = [
        "# Which interpreter: the per-request Python cost",
        "",
        f"On the host: {data['cpus']} CPUs (shared), Linux {data['kernel']}. In process, "
        f"one uvloop loop and one `Ring` set up as a ublk queue's, {data['depth']} reads of "
        f"{data['bufsize']} bytes in flight, the next started as one completes, from "
        f"files in the page cache on {data['files']['fs']} (the ring paths: a plain file; "
        "qcow2: a `preallocation=full` image, opened buffered), so a read completes at "
        "submit in the loop's thread. **task**: a task per request (`loop.create_task`, awaiting "
        "`ring.read` / `Qcow2Image.read`); **eager**: the same with "
        "`asyncio.eager_task_factory` set as the loop's task factory (3.12+; where uvloop "
        "cannot call it, a factory of ours that does the same, named below); "
        "**eager_start**: `loop.create_task(coro, eager_start=True)`, no factory (3.13+); "
        "**start**: the task-free `start_read` with a completion callback.",
        "",
        f"Median of {data['rounds']} round(s), a fresh process per run, the interpreters "
        f"alternating within each workload. Ratio: against `{base}` (what `python3` runs "
        "here, which `scripts/setup` used before it chose), the median over rounds of "
        f"the two runs' ratio in the same round. Run took {data['seconds']} s.",
        "",
        "The main table counts requests per second of the process's CPU time (user + "
        "system, `time.process_time()`: the Python and the syscalls of one thread): on a "
        "shared machine wall-clock rates (the second table) swing with the neighbours' "
        "load, CPU time much less.",
    ]
    if data["quick"]:
        lines += ["", f"**Smoke run (`--quick`)**: counts divided by {QUICK_DIVISOR}; not a "
                      "measurement."]
    lines += ["", "Requests per CPU second (ratio):", ""]
    lines += _table(data, "cpu_ops", True)
    lines += ["", "Requests per wall-clock second (ratio):", ""]
    lines += _table(data, "ops", False)
    lines += ["", "Eager tasks against plain tasks, same interpreter (per CPU second, median "
                  "of the same round's ratios); **eager**: the task factory named, "
                  "**eager_start**: `create_task(coro, eager_start=True)`:", ""]
    for name in interps:
        gains = [f"{b} {kind} {g:.2f}" for b in ("ring", "qcow2") for kind in ("eager",
                                                                              "eager_start")
                 if (g := paired(data, "cpu_ops", (name, f"{b} task {kind}"),
                                 (name, f"{b} task"))) is not None]
        how = dict.fromkeys(str(x["factory"]) for x in data["runs"]
                            if x["python"] == name and x.get("factory"))
        if gains:
            lines.append(f"- {name}: " + ", ".join(gains) + f"; factory: {'; '.join(how)}")
    errors = dict.fromkeys(f"{x['python']} {x['workload']}: `{x['error']}`"
                           for x in data["runs"] if x.get("error"))
    if errors:
        lines += ["", "## Failed runs", ""] + [f"- {e}" for e in errors]
    lines += ["", "## Build configuration", "",
              "| interpreter | executable | uvloop | cffi | `CONFIG_ARGS` | `PY_CFLAGS` |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, info in interps.items():
        lines.append(f"| {name} | `{info['executable']}` | {info.get('uvloop')} | "
                     f"{info.get('cffi')} | `{info['config_args'] or '—'}` | "
                     f"`{(info['py_cflags'] or '').strip()}` |")
    lines += ["", "Debian builds its python3.X with PGO and LTO from its own rules "
                  "(`make profile-opt` and LTO flags kept out of `_sysconfigdata`, see the "
                  "package's changelog), so `CONFIG_ARGS` does not show them; its "
                  "interpreter binary has libpython linked in statically."]
    lines += ["", f"Reproduce: `{command}` from the repository root.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=None, rounds_help="default 7 (1 with --quick)",
                quick=f"counts / {QUICK_DIVISOR}, 1 round", inner=None)
    ap.add_argument("--python", action="append", default=[], metavar="NAME=PATH",
                    help="interpreters to compare (default: Debian's and pyenv's, 3.11+)")
    ap.add_argument("--baseline", default=None,
                    help="the name ratios are against (default: the one python3 runs)")
    ap.add_argument("--dir", default="/var/tmp",
                    help="where the data files go (default /var/tmp; see the doc)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        backend, mode, path, count = ns.child
        child_main(backend, mode, path, int(count))
        return 0
    if ns.report:
        data = load(ns.report)
        return publish("interpreters", data, report(data, data["command"]), plot, out=ns.out)
    pythons = dict(p.split("=", 1) for p in ns.python) if ns.python else candidates()
    baseline = ns.baseline
    if baseline is None:
        default = os.path.realpath(_sh(["python3", "-c", "import sys; print(sys.executable)"])
                                   .strip())
        baseline = next((n for n, p in pythons.items() if os.path.realpath(p) == default),
                        next(iter(pythons)))
    rounds = ns.rounds or (1 if ns.quick else 7)
    data = run(pythons, baseline, rounds, ns.quick, ns.dir)
    command = ".venv/bin/python -m bench.interpreters" + (" --quick" if ns.quick else "")
    if ns.rounds:
        command += f" --rounds {rounds}"
    if ns.dir != "/var/tmp":
        command += f" --dir {ns.dir}"
    data["command"] = command
    return publish("interpreters", data, report(data, command), plot, out=ns.out,
                   ok=not any(x.get("error") for x in data["runs"]))


if __name__ == "__main__":
    sys.exit(main())
