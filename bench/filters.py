"""Filter stacks over loop beside plain loop, in one guest run (issue #27).

    python -m bench.filters [--runtime 5] [--rounds 3] [--quick]

Each stack is ``python -m aioublk add -t loop FILE -q 1`` with its
``--filter`` flags, over one 1 GiB backing file in guest RAM (``/tmp``,
allocated up front), beside the same device without filters (**plain**):

- **placement**: ``offset:offset=1M`` and ``truncate:size=512M``, filters
  that transform the loop's map, so C still serves every read and write,
  and **protect**: ``protect:ranges=1000M-1001M`` (beyond what fio touches),
  whose map is an extent table with those granules read-only: the goal is
  >= 0.95 of plain for both;
- one Python filter at a time, set so it changes nothing but the path:
  ``delay`` (no delays), ``error:rate=0``, ``rate`` (no limits),
  ``log:file=...`` (a JSON line per request, to guest RAM) and ``cow``
  (in memory): each takes every request through a coroutine, so its cost
  per request is ``1 / IOPS - 1 / plain IOPS`` (µs, paired by round).

fio io_uring, O_DIRECT, on the first 512 MiB: 4k randread at iodepth 1 and 64
and 4k randwrite at iodepth 64, ``--runtime`` seconds after 1 s ramp. The
devices run in turn, the order reversed every other round; ratios are paired
within the round. The guest writes JSON; the host turns it into
``bench/results/filters.md``, ``.json`` and ``.png``. Absolute numbers under
emulation mean little: the ratios are the result. ``--quick`` is a smoke
test (one round, 2 s runs, two stacks).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import (
    Data,
    fmt,
    footer,
    grouped_bars,
    guest_main,
    median,
    paired_ratios,
    record,
    run,
    spread,
    swapped,
    table,
)
from bench.modes import _add, _backing_file, _fio

PLAIN, PLACEMENT = "plain", "placement"
#: stack name -> --filter values ({log} is a path in the guest)
STACKS: dict[str, list[str]] = {
    PLAIN: [],
    PLACEMENT: ["offset:offset=1M", "truncate:size=512M"],
    "protect": ["protect:ranges=1000M-1001M"],
    "delay": ["delay:read=0"],
    "error": ["error:rate=0"],
    "rate": ["rate:iops=0"],
    "log": ["log:file={log}"],
    "cow": ["cow"],
}
QUICK_STACKS = (PLAIN, PLACEMENT, "log")
KEEP_C = (PLACEMENT, "protect")  # the stacks the goal is about
WORKLOADS = ["4k randread qd1", "4k randread qd64", "4k randwrite qd64"]
GOAL = 0.95
SPAN = ["--size=512M"]  # inside every stack's device


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every device."""
    backing = _backing_file()
    work = tempfile.mkdtemp()
    cmd = [sys.executable, "-m", "aioublk"]
    runs: list[dict[str, Any]] = []
    data: Data = {"cpus": os.cpu_count(), "kernel": os.uname().release, "runtime": runtime,
                  "rounds": 1 if quick else rounds, "quick": quick, "backing": backing,
                  "stacks": STACKS, "runs": runs, "complete": False}
    start = time.monotonic()
    names = list(QUICK_STACKS if quick else STACKS)
    for rnd in range(1, int(data["rounds"]) + 1):
        for name in swapped(names, rnd - 1):
            log = os.path.join(work, f"{name}.log")
            flags = [a for f in STACKS[name] for a in ("--filter", f.format(log=log))]
            dev_id, err = _add(cmd, ["-t", "loop", str(backing["path"]), "-q", "1", *flags])
            for w in WORKLOADS:
                iops, werr = (_fio(f"/dev/ublkb{dev_id}", w, runtime, SPAN) if dev_id
                              else (None, err))
                record(runs, start, rnd, f"{name:9} {w:17}", iops, werr, stack=name,
                       workload=w)
            if dev_id:
                run([*cmd, "del", "-n", dev_id], timeout=120)
            if os.path.exists(log):
                os.unlink(log)
            out.write_text(json.dumps(data))
    data["complete"] = True
    data["elapsed_s"] = time.monotonic() - start
    out.write_text(json.dumps(data))


def _ratio(runs: list[dict[str, Any]], stack: str, w: str) -> list[float]:
    return paired_ratios(runs, {"stack": stack, "workload": w}, {"stack": PLAIN, "workload": w})


def _cost_us(runs: list[dict[str, Any]], stack: str, w: str) -> float | None:
    """Median over rounds of 1/IOPS - 1/plain IOPS, in µs: the time a request
    spends in the filter's path (at qd1, its latency added)."""
    by_round: dict[int, dict[str, float]] = {}
    for x in runs:
        if x["workload"] == w and x["stack"] in (stack, PLAIN) and x.get("iops"):
            by_round.setdefault(int(x["round"]), {})[x["stack"]] = float(x["iops"])
    costs = [1e6 / r[stack] - 1e6 / r[PLAIN] for r in by_round.values()
             if stack in r and PLAIN in r]
    return statistics.median(costs) if costs else None


def report(data: Mapping[str, Any], command: str) -> str:
    runs = data["runs"]
    stacks = list(dict.fromkeys(x["stack"] for x in runs))
    lines = [
        "# Filter stacks over loop (issue #27)",
        "",
        f"One guest run: QEMU TCG software emulation (no KVM), {data['cpus']} CPUs, Linux "
        f"{data['kernel']}. `aioublk add -t loop FILE -q 1` over a 1 GiB file in guest RAM "
        f"(`{data['backing']['fs']}`), with each stack's filters, beside the same device "
        "without (**plain**). fio io_uring, O_DIRECT, on the first 512 MiB, "
        f"{data['runtime']} s per workload after 1 s ramp; {data['rounds']} round(s), the "
        "order reversed every other round. **stack / plain** is paired within each round "
        "(median, min – max); **µs / request** is `1/IOPS - 1/plain IOPS` per round "
        "(median): at qd1 the latency a filter adds, at qd64 the worker time it costs.",
        "",
        *table(["stack", "filters"], "ll",
               ([s, " ".join(f"`--filter {f}`" for f in data["stacks"][s]) or "none"]
                for s in stacks)),
        "",
    ]
    if data.get("quick"):
        lines += ["**Smoke run (`--quick`)**: not a measurement.", ""]
    if not data.get("complete"):
        lines += ["**Incomplete**: the guest run stopped early.", ""]
    head = ["stack"] + [f"{w} {what}" for w in WORKLOADS for what in ("IOPS", "/ plain")]
    lines += table(head, "l" + "r" * (len(head) - 1), (
        [s, *(cell for w in WORKLOADS for cell in (
            fmt(median(runs, stack=s, workload=w)), spread(_ratio(runs, s, w))
            if s != PLAIN else ""))] for s in stacks))
    python = [s for s in stacks if s != PLAIN and s not in KEEP_C]
    if python:
        lines += ["", "## What a Python filter costs per request", "",
                  *table(["stack", *(f"{w} µs / request" for w in WORKLOADS)],
                         "l" + "r" * len(WORKLOADS),
                         ([s, *(fmt(_cost_us(runs, s, w), ",.0f") for w in WORKLOADS)]
                          for s in python))]
    kept = [s for s in KEEP_C if s in stacks]
    if kept:
        worst = [statistics.median(r) for s in kept for w in WORKLOADS
                 if (r := _ratio(runs, s, w))]
        value = min(worst) if worst else None
        lines += ["", "## Goal", "",
                  f"Filters that keep the C data plane ({', '.join(kept)}) over loop, the "
                  f"lowest paired ratio of their rows: **{fmt(value, '.2f')}** (goal >= "
                  f"{GOAL}: {'met' if value is not None and value >= GOAL else 'not met'})."]
    if data.get("elapsed_s"):
        lines += ["", f"The guest part took {float(data['elapsed_s']) / 60:.0f} min."]
    errors = {f"{x['stack']} {x['workload']}": str(x["error"]) for x in runs if x.get("error")}
    return "\n".join(lines + footer(errors, "stack, workload", "filters.png", command))


def plot(data: Mapping[str, Any], path: Path) -> None:
    runs = data["runs"]
    stacks = [s for s in dict.fromkeys(x["stack"] for x in runs) if s != PLAIN]
    values = {(w, s): (statistics.median(r) if (r := _ratio(runs, s, w)) else None)
              for w in WORKLOADS for s in stacks}
    grouped_bars(path, WORKLOADS, stacks, values, "IOPS / plain loop, paired by round",
                 f"Filter stacks over loop / plain loop\nQEMU TCG, {data['cpus']} CPUs, "
                 f"Linux {data['kernel']}, {data['rounds']} round(s)",
                 lines=((1.0, "black", "-"), (GOAL, "grey", ":")))


def _timeout(rounds: int, quick: bool, runtime: int) -> float:
    stacks = len(QUICK_STACKS if quick else STACKS)
    return 600 + (1 if quick else rounds) * stacks * (120 + len(WORKLOADS) * (runtime + 60))


def main(argv: list[str] | None = None) -> int:
    return guest_main("filters", __doc__, argv, rounds=3, quick="one round, 2 s runs, three "
                      "stacks", inner=inner, report=report, plot=plot, timeout=_timeout)


if __name__ == "__main__":
    sys.exit(main())
