"""A block device whose logic is Python: aioublk beside nbdkit's Python plugin, in one
guest run (issue #28).

    python -m bench.nbdkit [--runtime 5] [--rounds 3] [--quick]

The same RAM disk written twice, each the way its framework asks: a 256 MiB
``bytearray`` that reads slice out of and writes slice into.

1. **aioublk**: ``examples/ramdisk.py``'s coroutine target (no map: every request
   a coroutine), ``Device(target, queues=1, depth=128)``, as ``bench.nomap`` serves it;
2. **nbdkit**: the same code as an nbdkit Python plugin (``API_VERSION = 2``,
   ``pread``/``pwrite``) on a unix socket, attached to nbd.ko with ``nbd-client``
   (one connection, depth 128). Its best thread model per round: ``parallel``
   (nbdkit's threads, the GIL between their callbacks) and ``serialize_requests``.

fio io_uring O_DIRECT on each device, scheduler ``none``: 4k randread and randwrite at
iodepth 64, 4k randread at iodepth 1, 128k sequential read at iodepth 16. Who goes
first swaps every round; the result is aioublk / nbdkit paired by round. Needs
``nbdkit-plugin-python`` and ``nbd-client`` (apt) on the host, whose root the guest
boots from.

The guest only writes JSON; the host turns it into ``bench/results/nbdkit.md``,
``.json`` and ``nbdkit.png``. Absolute numbers under software emulation mean
little; the ratios are the result. ``--quick``: 4k randread only, 2 s runs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from bench.common import (
    against_best,
    fmt,
    footer,
    guest_main,
    notes,
    ratio,
    ratio_bars,
    record,
    run,
    setup_line,
    spread,
    swapped,
    table,
)
from bench.modes import RAMP, _fio
from bench.nbd import Export, KernelClient, _no_scheduler, start_listening, stop_daemon
from bench.nomap import _serve, _stop

SIZE = 256 << 20  # as bench.nomap's server
WORKLOADS = ["4k randread qd64", "4k randwrite qd64", "4k randread qd1", "128k read qd16"]
QUICK = ["4k randread qd64"]
THREAD_MODELS = ("parallel", "serialize_requests")
SERVERS = ("nbdkit", "aioublk")

#: the RAM disk as an nbdkit Python plugin: the same slicing as examples/ramdisk.py
PLUGIN = f"""\
import nbdkit

API_VERSION = 2
disk = bytearray({SIZE})
model = nbdkit.THREAD_MODEL_PARALLEL


def config(key, value):
    global model
    if key != "threads":
        raise RuntimeError(f"unknown parameter {{key}}")
    model = {{"parallel": nbdkit.THREAD_MODEL_PARALLEL,
              "serialize_requests": nbdkit.THREAD_MODEL_SERIALIZE_REQUESTS}}[value]


def thread_model():
    return model


def open(readonly):
    return 1


def get_size(h):
    return len(disk)


def pread(h, buf, offset, flags):
    buf[:] = disk[offset:offset + len(buf)]


def pwrite(h, buf, offset, flags):
    disk[offset:offset + len(buf)] = buf
"""


def _nbdkit_runs(folder: str, threads: str, workloads: list[str],
                 runtime: int) -> list[tuple[str, float | None, str | None]]:
    """nbdkit serving the plugin with thread model ``threads``, nbd.ko on it, each
    workload, then both gone."""
    sock = os.path.join(folder, "nbdkit.sock")
    Path(sock).unlink(missing_ok=True)  # (nbdkit leaves it when stopped)
    exp = Export(f"nbd+unix:///?socket={sock}", ["-unix", sock], sock, socket.AF_UNIX)
    proc, err = start_listening(["nbdkit", "-f", "-U", sock, "python",
                                 os.path.join(folder, "ramdisk_plugin.py"),
                                 f"threads={threads}"], exp, Path(folder) / "nbdkit.log")
    if proc is None:
        return [(w, None, err) for w in workloads]
    try:
        client = KernelClient()
        dev, err = client.attach_export(exp)
        if dev is None:
            return [(w, None, err) for w in workloads]
        try:
            _no_scheduler(dev)
            return [(w, *_fio(dev, w, runtime, [])) for w in workloads]
        finally:
            if (err := client.detach()) is not None:
                print(f"  nbd-client -d {dev} failed: {err}", flush=True)
    finally:
        stop_daemon(proc)


def _aioublk_runs(workloads: list[str], runtime: int) -> list[tuple[str, float | None, str | None]]:
    p, dev = _serve(sys.executable)
    try:
        _no_scheduler(dev)
        return [(w, *_fio(dev, w, runtime, [])) for w in workloads]
    finally:
        _stop(p)


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every server so a crash keeps what was done."""
    workloads = QUICK if quick else WORKLOADS
    start = time.monotonic()
    folder = tempfile.mkdtemp(prefix="nbdkit.")
    Path(folder, "ramdisk_plugin.py").write_text(PLUGIN)
    version, _ = run(["nbdkit", "--version"], timeout=60)
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {
        "kernel": os.uname().release, "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "nbdkit": version.strip() or None,
        "nbd_client": shutil.which("nbd-client"), "python": sys.version.split()[0],
        "complete": False, "runs": runs,
    }
    for r in range(rounds):
        for server in swapped(SERVERS, r):
            sides = ([(f"nbdkit {t}", t) for t in THREAD_MODELS] if server == "nbdkit"
                     else [("aioublk", None)])
            for name, threads in sides:
                done = (_nbdkit_runs(folder, threads, workloads, runtime)
                        if threads is not None else _aioublk_runs(workloads, runtime))
                for w, iops, e in done:
                    record(runs, start, r + 1, f"{w:17} {name:27}", iops, e, workload=w,
                           server=name)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


class Row(NamedTuple):
    workload: str
    nbdkit: float | None  # the median over rounds of nbdkit's best thread model
    aioublk: float | None
    paired: list[float]  # each round's aioublk / nbdkit's best
    settings: str  # the thread models that were nbdkit's best


def rows(data: dict[str, object]) -> list[Row]:
    runs = data["runs"]
    assert isinstance(runs, list)
    out = []
    for w in WORKLOADS:
        b = against_best(runs, "aioublk", {f"nbdkit {t}": t for t in THREAD_MODELS},
                         workload=w)
        if b.peer is not None or b.ours is not None:
            out.append(Row(w, b.peer, b.ours, b.ratios, b.settings))
    return out


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    lines = [
        "# A Python RAM disk: aioublk vs nbdkit's Python plugin", "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}, Python "
        f"{data['python']}. The same 256 MiB `bytearray` RAM disk written for each: "
        "`examples/ramdisk.py`'s coroutine target (no map, so every request runs in "
        "Python), `Device(target, queues=1, depth=128)`; and an nbdkit Python plugin "
        f"(`pread`/`pwrite` slicing the same way) under {data.get('nbdkit') or 'nbdkit'} "
        "on a unix socket, attached to nbd.ko by `nbd-client` (one connection, depth "
        "128), with its better thread model of `parallel` and `serialize_requests` in "
        f"each round. fio io_uring, O_DIRECT, scheduler `none`, {data['runtime']} s per "
        f"workload after {data['ramp']} s ramp; {data['rounds']} round(s), who goes first "
        "swapping every round. Under emulation the absolute IOPS mean little: **the ratios "
        "are the result**.",
    ]
    lines += notes(data, "4k randread only, 2 s runs")
    lines += ["", "IOPS are medians over the rounds (nbdkit's: of its better setting in "
              "each round). **paired** is the median of each round's aioublk / nbdkit, "
              "with the lowest and highest round.", "",
              *table(["workload", "nbdkit IOPS", "aioublk IOPS", "aioublk / nbdkit",
                      "paired (min – max)", "nbdkit's better"], "lrrrrl",
                     ([r.workload, fmt(r.nbdkit), fmt(r.aioublk),
                       fmt(ratio(r.aioublk, r.nbdkit), ".2f"), spread(r.paired), r.settings]
                      for r in rows(data)))]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"{x['server']} {x['workload']}", str(x["error"]))
    return "\n".join(lines + footer(errors, "server and workload", "nbdkit.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    ratio_bars(path, [(r.workload, statistics.median(r.paired) if r.paired else None, 1.0)
                      for r in rows(data)],
               "aioublk / nbdkit IOPS, paired by round",
               f"A Python RAM disk: aioublk vs nbdkit's Python plugin + nbd.ko\n"
               f"Linux {data['kernel']}, {data['rounds']} round(s)")


def main(argv: list[str] | None = None) -> int:
    def timeout(rounds: int, quick: bool, runtime: int) -> float:
        fio_runs = rounds * (1 + len(THREAD_MODELS)) * (len(QUICK) if quick else len(WORKLOADS))
        return 1200 + rounds * 3 * 120 + fio_runs * (runtime + RAMP + 30)

    return guest_main("nbdkit", __doc__, argv, rounds=3, quick="4k randread only, 2 s runs",
                      inner=inner, report=report, plot=plot, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
