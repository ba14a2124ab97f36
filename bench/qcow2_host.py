"""aioublk's qcow2 engine without ublk beside ``qemu-img bench``, on the host.

    python -m bench.qcow2_host [--rounds 3] [--quick] [--dir DIR]

The image is a 1 GiB qcow2 (64 KiB clusters) created with ``qemu-img create
-f qcow2 -o preallocation=full``: every cluster allocated and its data written
(zeros), so neither side allocates anything. Workloads: 4 KiB reads and
writes at depth 64 and 1.

- qemu-img: ``qemu-img bench -f qcow2 -t none -i AIO -c COUNT -d DEPTH -s 4096
  [-w] -S STEP IMAGE`` for AIO in io_uring, native and threads; the table
  compares against the fastest of the three.
- aioublk: ``Qcow2Image`` driven in process (a fresh Python process per run,
  like a fresh qemu-img): one ``Ring`` bound to a uvloop loop (sized and set
  up as a ublk queue's ring), DEPTH requests in flight, the next offset taken
  as soon as one completes; two ways: ``start`` (the task-free
  ``start_read``/``start_write`` the ublk target uses first) and ``await``
  (the coroutine API). Offsets are qemu-img bench's exactly: the
  i-th request goes to ``(i * STEP) % image_size`` in submission order, COUNT
  requests in all, writes of zeros (qemu-img bench's default pattern).

STEP defaults to 7919 * 4096 bytes (a prime number of 4 KiB blocks, about
31 MiB): consecutive requests land in different clusters and L2 tables, and
COUNT requests never touch a block twice. Both sides are timed from the first
submission to the last completion (image open and the final close/flush are
outside the timing, as in qemu-img bench). The runs alternate (qemu-img then
aioublk, per workload, per round) and the table gives medians. Writes
``bench/results/qcow2_host.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import mmap
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import fmt as _fmt
from bench.common import grouped_bars, load, median, parser, publish
from bench.common import run as _sh  # (stdout, error or None); a failed step never ends a run

IMAGE_SIZE = 1 << 30
BUFSIZE = 4096
STEP = 7919 * BUFSIZE
AIO_MODES = ("io_uring", "native", "threads")
# name -> (write, depth, count)
WORKLOADS: dict[str, tuple[bool, int, int]] = {
    "4k read qd64": (False, 64, 200_000),
    "4k read qd1": (False, 1, 20_000),
    "4k write qd64": (True, 64, 200_000),
    "4k write qd1": (True, 1, 20_000),
}
QUICK_DIVISOR = 10
# How the in-process driver calls the engine, both on a ring with a ublk queue's setup
# flags: "start" is the task-free path the ublk target uses first (start_read/start_write
# with a completion callback, the coroutine API where they decline), "await" the
# coroutine API alone (one coroutine per request, as a library user writes it).
RINGS = ("start", "await")
O_DIRECT = 0o40000  # x86-64


# -- the in-process driver ------------------------------------------------------------


def _open_flags(path: str) -> list[int]:
    """The open flags of this process's descriptors on `path` (from /proc/self/fdinfo)."""
    real = os.path.realpath(path)
    flags = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != real:
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                for line in f:
                    if line.startswith("flags:"):
                        flags.append(int(line.split()[1], 8))
        except OSError:
            continue
    return flags


async def _drive(path: str, write: bool, depth: int, count: int, step: int,
                 bufsize: int, ring_kind: str) -> dict[str, object]:
    from aioublk.qcow2 import Qcow2Image
    from aioublk.ring import Ring, queue_ring_flags

    # Sized like a ublk queue's ring (ring.queue_ring_flags) for a queue of this depth.
    flags = queue_ring_flags()
    ring = Ring(max(2 * depth, 64), cq_entries=max(8 * depth, 256), flags=flags,
                bind_thread=True)
    try:
        img = Qcow2Image.open(path, read_only=not write)
        open_flags = _open_flags(path)
        size = img.size
        nxt = 0  # qemu-img bench: offset += step; offset %= image_size (QEMU 7.2)
        left = count

        async def worker() -> None:
            nonlocal nxt, left
            buf = memoryview(mmap.mmap(-1, bufsize))  # page aligned, zeros
            while left > 0:
                left -= 1
                offset = nxt
                nxt = (nxt + step) % size
                if write:
                    await img.write(offset, buf)
                else:
                    await img.read(offset, buf)

        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        free = [memoryview(mmap.mmap(-1, bufsize)) for _ in range(min(depth, count))]
        inflight = 0

        def issue() -> None:
            nonlocal nxt, left, inflight
            while left > 0 and free:
                left -= 1
                offset = nxt
                nxt = (nxt + step) % size
                buf = free.pop()
                inflight += 1
                done = functools.partial(answered, buf)
                if not (img.start_write if write else img.start_read)(offset, buf, done):
                    loop.create_task(slow(offset, buf, done))
            if left == 0 and inflight == 0 and not finished.done():
                finished.set_result(None)

        def answered(buf: memoryview, res: int) -> None:
            nonlocal inflight
            if res < 0:
                finished.set_exception(OSError(-res, os.strerror(-res)))
                return
            inflight -= 1
            free.append(buf)
            issue()

        async def slow(offset: int, buf: memoryview, done: Any) -> None:
            await (img.write(offset, buf) if write else img.read(offset, buf))
            done(len(buf))

        t0 = time.perf_counter()
        if ring_kind == "start":
            issue()
            await finished
        else:
            await asyncio.gather(*(worker() for _ in range(min(depth, count))))
        seconds = time.perf_counter() - t0
        await img.close()
    finally:
        ring.close()
    return {"seconds": seconds, "ring_flags": flags, "fds": len(open_flags),
            "o_direct": bool(open_flags) and all(f & O_DIRECT for f in open_flags)}


def driver_main(path: str, write: bool, depth: int, count: int, step: int,
                bufsize: int, ring_kind: str) -> None:
    import uvloop

    result = uvloop.run(_drive(path, write, depth, count, step, bufsize, ring_kind))
    print(json.dumps(result))


# -- host side ------------------------------------------------------------------------


def _engine(ring_kind: str) -> str:
    return f"aioublk {ring_kind}"





def qemu_img_bench(image: str, aio: str, write: bool, depth: int, count: int,
                   step: int) -> dict[str, object]:
    cmd = ["qemu-img", "bench", "-f", "qcow2", "-t", "none", "-i", aio, "-c", str(count),
           "-d", str(depth), "-s", str(BUFSIZE), *(["-w"] if write else []), "-S", str(step),
           image]
    out, err = _sh(cmd, timeout=600)
    if err:
        return {"error": f"qemu-img bench {err}"}
    m = re.search(r"Run completed in ([0-9.]+) seconds", out)
    if not m:
        return {"error": f"qemu-img bench printed no time: {out.strip()!r}"}
    seconds = float(m.group(1))
    return {"seconds": seconds, "iops": count / seconds if seconds else None}


def engine_bench(image: str, write: bool, depth: int, count: int, step: int,
                 ring_kind: str) -> dict[str, object]:
    cmd = [sys.executable, "-m", "bench.qcow2_host", "--driver", image, str(int(write)),
           str(depth), str(count), str(step), str(BUFSIZE), ring_kind]
    out, err = _sh(cmd, timeout=900)
    if err:
        return {"error": f"driver {err}"}
    try:
        r = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        return {"error": f"driver output unreadable: {e!r}: {out[-300:]!r}"}
    r["iops"] = count / r["seconds"] if r["seconds"] else None
    return dict(r)


def run(folder: str, rounds: int, quick: bool, size: int, step: int) -> dict[str, Any]:
    image = os.path.join(folder, "bench.qcow2")
    _, err = _sh(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=full",
                  image, str(size)], timeout=600)
    if err:
        raise SystemExit(f"qemu-img create failed: {err}")
    version, _ = _sh(["qemu-img", "--version"], timeout=30)
    fstype, _ = _sh(["findmnt", "-no", "FSTYPE", "-T", image], timeout=10)
    release, _ = _sh(["uname", "-r"], timeout=10)
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(), "qemu_img": version.splitlines()[0],
        "image": {"path": image, "fs": fstype.strip(), "size": size,
                  "create": "qemu-img create -f qcow2 -o preallocation=full"},
        "step": step, "bufsize": BUFSIZE, "rounds": rounds, "quick": quick, "runs": [],
    }
    runs = data["runs"]
    assert isinstance(runs, list)
    start = time.monotonic()
    for r in range(rounds):
        for name, (write, depth, count) in WORKLOADS.items():
            if quick:
                count //= QUICK_DIVISOR
            results = [(f"qemu-img {aio}", qemu_img_bench(image, aio, write, depth, count, step))
                       for aio in AIO_MODES]
            results += [(_engine(k), engine_bench(image, write, depth, count, step, k))
                        for k in RINGS]
            for who, res in results:
                runs.append({"round": r + 1, "workload": name, "count": count, "depth": depth,
                             "write": write, "who": who, **res})
                shown = (f"{res['iops']:,.0f} IOPS ({res['seconds']:.3f} s)"
                         if res.get("iops") else f"ERROR {res.get('error')}")
                print(f"[{time.monotonic() - start:4.0f} s] round {r + 1}: {name:14} "
                      f"{who:17} {shown}", flush=True)
    os.unlink(image)
    return data


def rows(data: dict[str, object]) -> list[dict[str, object]]:
    runs = data["runs"]
    assert isinstance(runs, list)
    table = []
    for workload in dict.fromkeys(str(x["workload"]) for x in runs):
        qemu = {aio: median(runs, who=f"qemu-img {aio}", workload=workload)
                for aio in AIO_MODES}
        best = max((a for a in AIO_MODES if qemu[a]), key=lambda a: qemu[a] or 0, default=None)
        q = qemu[best] if best else None
        count = next(x["count"] for x in runs if x["workload"] == workload)
        row: dict[str, object] = {"workload": workload, "count": count, "qemu": qemu,
                                  "best": best}
        for k in RINGS:
            engine = median(runs, who=_engine(k), workload=workload)
            row[k] = engine
            row[f"{k}_ratio"] = engine / q if engine and q else None
        table.append(row)
    return table


def plot(data: dict[str, object], path: Path) -> None:
    """Each workload's engine IOPS over the fastest qemu-img bench setting's,
    for both ways of calling it (goal: 1)."""
    table = rows(data)
    groups = [str(r["workload"]) for r in table]
    values = {(str(r["workload"]), k): r[f"{k}_ratio"] for r in table for k in RINGS}
    grouped_bars(path, groups, list(RINGS), values,  # type: ignore[arg-type]
                 "aioublk / best qemu-img IOPS", "qcow2 engine without ublk vs qemu-img bench")


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    image = data["image"]
    assert isinstance(runs, list) and isinstance(image, dict)
    o_direct = {x.get("o_direct") for x in runs if "o_direct" in x}
    engine_cache = ("O_DIRECT" if o_direct == {True} else "buffered (no O_DIRECT)"
                    if o_direct == {False} else "mixed/unknown")
    lines = [
        "# qcow2 engine without ublk vs qemu-img bench",
        "",
        f"On the host: {data['cpus']} CPUs, Linux {data['kernel']}, {data['qemu_img']}. "
        f"Image: {int(image['size']) >> 20} MiB qcow2, 64 KiB clusters, `{image['create']}` "
        f"(every cluster allocated, zeros written), on {image['fs']}. Requests of "
        f"{data['bufsize']} bytes at offsets `(i * {data['step']}) % size` "
        f"(step {int(data['step']) // int(data['bufsize'])} blocks of 4 KiB), the same "  # type: ignore[call-overload]
        "COUNT and depth on both sides.",
        "",
        "- qemu-img: `qemu-img bench -f qcow2 -t none -i AIO -c COUNT -d DEPTH -s 4096 [-w] "
        f"-S {data['step']}`, AIO = io_uring, native, threads; the ratio is against the "
        "fastest.",
        "- aioublk: `aioublk.qcow2.Qcow2Image` in process, one `Ring` on a uvloop loop, "
        f"DEPTH coroutines keeping DEPTH requests in flight; the engine's files were opened "
        f"{engine_cache}; the ring has a ublk queue's setup flags. Two ways to call it: "
        "**start** is the task-free path the ublk target takes first (`start_read`/"
        "`start_write` with a completion callback; the coroutine API where they decline), "
        "**await** the coroutine API alone (one coroutine per request).",
        "",
        f"Median of {data['rounds']} round(s); a fresh process per run on both sides; the "
        "timing excludes open and the final close/flush on both sides.",
    ]
    if data.get("quick"):
        lines += ["", f"**Smoke run (`--quick`)**: COUNT divided by {QUICK_DIVISOR}; not a "
                      "measurement."]
    lines += ["", "| workload | COUNT | " + " | ".join(f"qemu-img {a} IOPS" for a in AIO_MODES)
              + "".join(f" | aioublk {k} IOPS | ratio" for k in RINGS) + " |",
              "| --- | ---: |" + " ---: |" * (len(AIO_MODES) + 2 * len(RINGS))]
    for r in rows(data):
        qemu = r["qemu"]
        assert isinstance(qemu, dict)
        lines.append(f"| {r['workload']} | {r['count']:,} | "
                     + " | ".join(_fmt(qemu[a]) + (" *" if a == r["best"] else "")
                                  for a in AIO_MODES)
                     + "".join(f" | {_fmt(r[k])} | {_fmt(r[f'{k}_ratio'], '.2f')}"  # type: ignore[arg-type]
                               for k in RINGS) + " |")
    lines += ["", "`*` the fastest qemu-img setting of the row; ratio: aioublk / that "
                  "setting."]
    errors = dict.fromkeys(f"{x['who']} {x['workload']}: `{x['error']}`"
                           for x in runs if x.get("error"))
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    lines += ["", f"Reproduce: `{command}` from the repository root.", ""]
    return "\n".join(lines)


def command(data: dict[str, Any]) -> str:
    """The command a report names: the run's own, else the default one."""
    return str(data.get("command") or ".venv/bin/python -m bench.qcow2_host"
               + (" --quick" if data.get("quick") else ""))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=None, rounds_help="default 3 (1 with --quick)",
                quick=f"COUNT / {QUICK_DIVISOR}, 1 round", inner=None)
    ap.add_argument("--dir", default=None,
                    help="folder for the 1 GiB image (default: a temporary folder in /var/tmp)")
    ap.add_argument("--step", type=int, default=STEP, help=f"bytes (default {STEP})")
    ap.add_argument("--driver", nargs=7, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.driver:
        path, write, depth, count, step, bufsize, ring_kind = ns.driver
        driver_main(path, write == "1", int(depth), int(count), int(step), int(bufsize),
                    ring_kind)
        return 0
    if ns.report:
        data = load(ns.report)
        return publish("qcow2_host", data, report(data, command(data)), plot, out=ns.out)
    rounds = ns.rounds or (1 if ns.quick else 3)
    with tempfile.TemporaryDirectory(dir=ns.dir or "/var/tmp", prefix="qcow2bench.") as folder:
        data = run(folder, rounds, ns.quick, IMAGE_SIZE, ns.step)
    data["command"] = (command(data) + (f" --rounds {rounds}" if ns.rounds else "")
                       + (f" --step {ns.step}" if ns.step != STEP else ""))
    return publish("qcow2_host", data, report(data, command(data)), plot, out=ns.out,
                   ok=not any(x.get("error") for x in data["runs"]))


if __name__ == "__main__":
    sys.exit(main())
