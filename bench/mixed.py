"""Issue #25's mixed test: are Python's requests delayed by C's wait?

    python -m bench.mixed [--runtime 5] [--rounds 3] [--quick] [--cpus 2]

One device, one queue (depth 128), so one worker thread serves both halves:
its target (``Mixed`` below, ``examples/ramdisk.py``'s RAM disk with a map)
maps the first half as known zeros in an ``ExtentTable``, which C serves from
fetch to commit without entering Python (null-like: it fills the buffer),
and leaves the second half without a map, so each of its requests is a
coroutine ``read``. fio io_uring O_DIRECT, in one fio run:

- **A**: 4k randread qd64 on the mapped half, at full rate (C's requests);
- **B**: 4k randread qd1 on the Python half: its completion latency
  percentiles (p50, p99, p99.9, max) are the result.

and, for reference, B's job alone on the mapped half (**C qd1**): what a
request costs when Python never sees it, the floor under B's latency.

Settings: B **alone**, B **with A** and **C qd1**, each under C's own wait (C sleeps in
io_uring_enter for the worker's uvloop loop, ``aioublk.dataplane.cwait``) and
under the **older** wait (C polls for a slice inside each reap; the server
runs with ``AIOUBLK_OWN_WAIT=0``). The two waits are two ``aioublk serve``
processes, both started once (a start takes half a minute or more under TCG) and measured in
turn; per round the wait that goes first swaps, and so does the order of
the loads within each. The idle server's CPU time during each run is recorded, to
show it stayed out of the way. What counts is B's p99 with A / B's p99
alone, paired within each round, under C's wait beside the older one.

The guest only writes JSON; the host turns it into
``bench/results/mixed.md``, ``.json`` and ``.png``. ``--quick`` (one round,
2 s runs) is a smoke test of this script.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aioublk import Extents, ExtentTable, Map
from bench.common import (
    Data,
    errors_section,
    fmt,
    grouped_bars,
    median,
    notes,
    paired_ratios,
    parser,
    record,
    run,
    serve_main,
    setup_line,
    spread,
    swapped,
    table,
)
from bench.metrics_cost import Server
from bench.modes import RAMP
from bench.qcow2 import _dev_ios, _tasks_cpu, cpu_fields
from examples.ramdisk import RamDisk

NAME = "mixed"
SIZE = 256 << 20  # the device; the first half mapped (C), the second Python's
HALF = SIZE // 2
GRANULE = 4096
DEV_BASE = 50  # the own wait's device id; the older wait's is DEV_BASE + 1
#: wait -> the serve process's environment
WAITS: dict[str, dict[str, str]] = {"own": {}, "older": {"AIOUBLK_OWN_WAIT": "0"}}
#: B alone, B with A (at full rate, and capped at A_CAP IOPS: C busy but the
#: worker's CPU not saturated, so what is left of B's delay is the wait's),
#: and B's job on the mapped half (C's qd1 latency, the floor)
A_CAP = 1000
LOADS = ("alone", "with A", f"with A {A_CAP}", "C qd1")
WITH_A = LOADS[1:3]
PERCENTILES = {"p50": "50.000000", "p99": "99.000000", "p99.9": "99.900000"}
STATS_WAIT = 30.0  # s for serve's once-a-second publish of the counters (list is slow under TCG)


class Mixed(RamDisk):
    """A RAM disk whose first half is mapped as zeros for the C data plane;
    the second half has no map, so its requests reach ``read`` as coroutines."""

    name = "mixed"

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.table = ExtentTable(GRANULE)
        self.table.insert_zero(0, size // 2)  # its bytes are zeros in `data` too

    def map(self) -> Map:
        return Extents(self.table)

    def close(self) -> None:
        self.table.close()


# -- the guest side -----------------------------------------------------------------------


def config(dev_id: int) -> str:
    return (f'[[devices]]\ntarget = "bench.mixed:Mixed"\nid = {dev_id}\nqueues = 1\n'
            f"depth = 128\n[devices.options]\nsize = {SIZE}\n")


def order(round_index: int) -> list[tuple[str, str]]:
    """(wait, load) in one round's order: the first wait swaps every round, and so
    does the order of the loads within each wait."""
    return [(w, load) for w in swapped(tuple(WAITS), round_index)
            for load in swapped(LOADS, round_index)]


def fio_args(dev: str, runtime: int, load: str) -> list[str]:
    a = ["--name=A", "--offset=0", f"--size={HALF}", "--iodepth=64"]
    b = ["--name=B", f"--offset={0 if load == 'C qd1' else HALF}", f"--size={HALF}",
         "--iodepth=1"]
    if load == LOADS[2]:
        a.append(f"--rate_iops={A_CAP}")
    with_a = load in WITH_A
    return ["fio", f"--filename={dev}", "--ioengine=io_uring", "--direct=1", "--rw=randread",
            "--bs=4k", "--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}",
            "--percentile_list=50:99:99.9", "--output-format=json", *(a if with_a else []), *b]


def parse(out: str) -> dict[str, Any]:
    """B's latency (µs) and IOPS, A's IOPS, from fio's JSON."""
    jobs = {j["jobname"]: j["read"] for j in json.loads(out[out.index("{"):])["jobs"]}
    b = jobs["B"]
    clat = b["clat_ns"]
    got: dict[str, Any] = {f"b_{k}": float(clat["percentile"][v]) / 1000
                           for k, v in PERCENTILES.items()}
    got |= {"b_max": float(clat["max"]) / 1000, "b_mean": float(clat["mean"]) / 1000,
            "b_ios": int(b["total_ios"]), "a_iops": float(jobs["A"]["iops"]) if "A" in jobs
            else None}
    return {"iops": float(b["iops"]), **got}


def counters(dev_id: int, since: float) -> dict[str, float]:
    """The queue's data plane counters from a publish made after `since`
    (``time.time()``); empty if none came."""
    deadline = time.monotonic() + STATS_WAIT
    while time.monotonic() < deadline:
        out, err = run([sys.executable, "-m", "aioublk", "list", "-n", str(dev_id), "--stats",
                        "--json"], 120)
        try:
            dev = json.loads(out)[0]
            if not err and dev["stats"] is not None and dev["stats_time"] > since:
                return {k: float(sum(r.get(k, 0) for r in dev["stats"]))
                        for k in ("c_served", "py_handed", "wakes", "poll_timeouts")}
        except (ValueError, KeyError, IndexError, TypeError):
            pass
        time.sleep(0.3)
    return {}


def _measure(server: Server, other: Server, dev_id: int, runtime: int, load: str,
             before: Mapping[str, float]) -> tuple[dict[str, Any], dict[str, float]]:
    """One fio run: B's latency, A's IOPS, the server's CPU per I/O and the
    counters' deltas, the idle server's CPU; and the counters after it."""
    dev = f"/dev/ublkb{dev_id}"
    cpu, idle, ios = _tasks_cpu(server.p.pid), _tasks_cpu(other.p.pid), _dev_ios(dev)
    out, err = run(fio_args(dev, runtime, load), timeout=runtime + RAMP + 120)
    done, idle_after, cpu_after = _dev_ios(dev), _tasks_cpu(other.p.pid), _tasks_cpu(server.p.pid)
    got: dict[str, Any] = {"error": f"fio {err}" if err else None}
    if not err:
        try:
            got |= parse(out)
        except (ValueError, KeyError, IndexError) as e:
            got["error"] = f"fio output unreadable: {e!r}"
    got |= cpu_fields(cpu, cpu_after, None if ios is None or done is None else done - ios)
    got["idle_server_cpu_ms"] = sum(ns - idle.get(t, (c, 0))[1]
                                    for t, (c, ns) in idle_after.items()) / 1e6
    after = counters(dev_id, time.time())
    if before and after:
        got |= {k: after[k] - before[k] for k in after}
    return got, after


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every fio run."""
    start = time.monotonic()
    runs: list[dict[str, Any]] = []
    data: Data = {
        "kernel": os.uname().release, "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "size": SIZE, "startup_s": {}, "complete": False,
        "runs": runs,
    }
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory() as folder:
        try:
            for i, (wait, env) in enumerate(WAITS.items()):
                t0 = time.monotonic()
                servers[wait] = Server(config(DEV_BASE + i), folder, 1, env, wait)
                data["startup_s"][wait] = round(time.monotonic() - t0, 1)
                print(f"  serve ({wait} wait) started in {time.monotonic() - t0:.0f} s",
                      flush=True)
            last = {w: counters(DEV_BASE + i, 0) for i, w in enumerate(WAITS)}
            for r in range(rounds):
                for wait, load_ in order(r):
                    i = list(WAITS).index(wait)
                    other = servers[list(WAITS)[1 - i]]
                    got, last[wait] = _measure(servers[wait], other, DEV_BASE + i, runtime,
                                               load_, last[wait])
                    iops, err = got.pop("iops", None), got.pop("error")
                    record(runs, start, r + 1, f"{wait:5} wait, B {load_:6}", iops, err,
                           wait=wait, load=load_, **got)
                    if iops is not None:
                        print(f"      B p50 {got['b_p50']:.0f} p99 {got['b_p99']:.0f} "
                              f"p99.9 {got['b_p99.9']:.0f} max {got['b_max']:.0f} µs; "
                              f"A {fmt(got['a_iops'])} IOPS", flush=True)
                    out.write_text(json.dumps(data))
        except RuntimeError as e:
            data["error"] = str(e)
        finally:
            for s in servers.values():
                s.stop()
    data["complete"] = "error" not in data
    out.write_text(json.dumps(data))


# -- the report ---------------------------------------------------------------------------


STATS = ("b_p50", "b_p99", "b_p99.9", "b_max")


def ratios(data: Mapping[str, Any], wait: str, stat: str, load: str = "with A") -> list[float]:
    """Each round's B `stat` with A (`load`) / alone, under `wait`."""
    return paired_ratios(data["runs"], {"wait": wait, "load": load},
                         {"wait": wait, "load": "alone"}, stat)


def report(data: Mapping[str, Any], command: str) -> str:
    runs = data["runs"]
    mib = data["size"] >> 20
    lines = [
        "# Mixed test: Python's requests beside C at full rate (issue #25)",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. One device "
        f"({mib} MiB, 1 queue, depth 128: one worker thread serves it all) of `Mixed` "
        f"(`bench/mixed.py`): its first {mib // 2} MiB mapped as zeros in an `ExtentTable`, "
        "served by C from fetch to commit; the rest without a map, each request a "
        "coroutine `read` (`examples/ramdisk.py`'s). One fio run (io_uring, O_DIRECT, "
        f"{data['runtime']} s after {data['ramp']} s ramp) of **A**, 4k randread qd64 on "
        "the mapped half (C's), and **B**, 4k randread qd1 on the Python half (its "
        "completion latency, fio's clat); **alone**: B without A; **C qd1**: B's job on the "
        "mapped half, alone (a request Python never sees: the floor). **own** wait: C sleeps "
        "in io_uring_enter for the worker's loop; **older**: C polls for a slice in each "
        "reap (`AIOUBLK_OWN_WAIT=0`). Each wait is its own serve process, both up for the "
        f"whole run (started in {', '.join(f'{v:.0f} s' for v in data['startup_s'].values())}); "
        f"{data['rounds']} round(s), the first wait and the first load swapping every round.",
    ]
    lines += notes(data, "one round, 2 s runs")
    lines += ["", "Medians over the rounds. Latencies in µs (B's job's completion latency). C "
              "served / Python / poll timeouts: the queue's data plane counters over the run "
              "(ramp included; a poll timeout is the older wait's slice in a reap running "
              "out, so the own wait has none); fio's percentiles are its histogram bins' "
              "upper bounds, so p99.9 may pass max a little; CPU µs/I/O: the serving "
              "process's threads per request the device completed; idle server: CPU ms the "
              "other serve process spent meanwhile.", "",
              *table(["wait", "load", "p50", "p99", "p99.9", "max", "B IOPS", "A IOPS",
                      "C served", "Python", "poll timeouts", "CPU µs/I/O", "idle server ms"],
                     "llrrrrrrrrrrr",
                     ([w, side, *(fmt(median(runs, s, wait=w, load=side), ",.0f")
                                  for s in STATS),
                       fmt(median(runs, wait=w, load=side)),
                       fmt(median(runs, "a_iops", wait=w, load=side)),
                       fmt(median(runs, "c_served", wait=w, load=side)),
                       fmt(median(runs, "py_handed", wait=w, load=side)),
                       fmt(median(runs, "poll_timeouts", wait=w, load=side)),
                       fmt(median(runs, "cpu_us_per_io", wait=w, load=side), ".1f"),
                       fmt(median(runs, "idle_server_cpu_ms", wait=w, load=side), ".1f")]
                      for w in WAITS for side in LOADS))]
    lines += ["", "B's latency with A / alone, paired within each round: median (min–max "
              "over rounds). Under the own wait it should be no worse than under the "
              f"older one: the wait C owns must not delay Python's requests. With A capped "
              f"at {A_CAP} IOPS the worker has CPU to spare, so what remains of B's delay "
              "there is the wait's (at full rate B also queues behind C's CPU work).", "",
              *table(["wait", "A", *(s.removeprefix("b_") for s in STATS)], "llrrrr",
                     ([w, load.removeprefix("with A").strip() or "full rate",
                       *(spread(ratios(data, w, s, load)) for s in STATS)]
                      for load in WITH_A for w in WAITS))]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"{x['wait']} {x['load']}", str(x["error"]))
    if data.get("error"):
        errors["serve"] = str(data["error"])
    return "\n".join(lines + errors_section(errors, "wait/load") + [
        "", f"Chart: `{NAME}.png`. Reproduce: `{command}` from the repository root (boots "
        "the guest when the host has no ublk_drv).", ""])


def plot(data: Mapping[str, Any], path: Path) -> None:
    """B's p50, p99, p99.9 (ms) per setting."""
    groups = [s.removeprefix("b_") for s in STATS[:3]]
    series = [f"{w} wait, {side}" for w in WAITS for side in LOADS]
    values = {}
    for w in WAITS:
        for side in LOADS:
            for s, g in zip(STATS[:3], groups, strict=True):
                v = median(data["runs"], s, wait=w, load=side)
                values[(g, f"{w} wait, {side}")] = None if v is None else v / 1000
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(path, groups, series, values, "B's completion latency, ms (median of rounds)",
                 f"Mixed test, the qd1 job (B, or C qd1 on the mapped half): {where}, "
                 f"{data['cpus']} CPUs, {data['rounds']} round(s)", lines=())


def _guest_timeout(rounds: int, runtime: int) -> float:
    """Generous (TCG on a busy host is slow), but bounded: 300 s per serve process,
    each fio run with 60 s of slack."""
    return 900 + len(WAITS) * 300 + rounds * len(WAITS) * len(LOADS) * (runtime + RAMP + 60)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=3, quick="one round, 2 s runs", inner=("OUT",))
    ap.add_argument("--cpus", type=int, default=2,
                    help="guest vCPUs (default 2: fio's two jobs and the worker share them)")
    ns = ap.parse_args(argv)
    return serve_main(NAME, ns, 2, [],
                      lambda runtime, rounds: inner(runtime, rounds, ns.quick, Path(ns.inner[0])),
                      report, plot, _guest_timeout)


if __name__ == "__main__":
    sys.exit(main())
