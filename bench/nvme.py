"""The nvme target (io_uring passthrough) beside the loop target on the block path, in one
guest run (issue #15).

    python -m bench.nvme [--runtime 5] [--rounds 1] [--quick]

On the guest's emulated NVMe namespace (``aioublk.testing.guest`` gives every boot
one: /dev/nvme0n1, its generic char device /dev/ng0n1) four ways of doing the same
I/O, fio 4k randread and randwrite at iodepth 64:

1. ``aioublk add -t nvme /dev/ng0n1``: ublk, then NVMe passthrough commands;
2. ``aioublk add -t loop /dev/nvme0n1``: ublk, then the block layer;
3. fio straight on /dev/ng0n1 with ``ioengine=io_uring_cmd``: passthrough's ceiling;
4. fio straight on /dev/nvme0n1 with ``ioengine=io_uring``: the block path's.

Both aioublk devices have 1 queue of depth 128 and are added once per round for
both workloads; their order swaps every round. The namespace is written in full
first, so reads hit data, not holes. The issue's goal: nvme / loop ≥ 1.1.

The guest only writes JSON; the host turns it into ``bench/results/nvme.md``,
``.json`` and ``nvme.png`` (matplotlib: ``pip install -e .[bench]``). Absolute
numbers under software emulation mean little; the ratios are the result.
``--quick`` (one workload, 2 s runs) is a smoke test of this script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from bench.common import (
    fmt,
    footer,
    guest_main,
    median,
    met,
    notes,
    ratio,
    ratio_bars,
    record,
    run,
    swapped,
    table,
)
from bench.modes import RAMP, _device_runs, _fio

NG, BLOCK = "/dev/ng0n1", "/dev/nvme0n1"
READ, WRITE = "4k randread qd64", "4k randwrite qd64"


class Way(NamedTuple):
    """One way to reach the namespace: an aioublk device (its add flags) or fio alone."""

    label: str
    add: list[str]        # aioublk add flags besides -q/-d; empty: fio on `path` directly
    path: str = ""
    fio: tuple[str, ...] = ()  # fio flags after the common ones (they override them)


WAYS: dict[str, Way] = {
    "nvme": Way("aioublk -t nvme (passthrough)", ["-t", "nvme", NG]),
    "loop": Way("aioublk -t loop (block path)", ["-t", "loop", BLOCK]),
    "ng": Way("fio io_uring_cmd on /dev/ng0n1", [], NG,
              ("--ioengine=io_uring_cmd", "--cmd_type=nvme", "--direct=0")),
    "block": Way("fio io_uring on /dev/nvme0n1", [], BLOCK),
}


class Ratio(NamedTuple):
    label: str
    num: str
    den: str
    target: float | None


RATIOS = [
    Ratio("nvme / loop (the goal)", "nvme", "loop", 1.1),
    Ratio("nvme / its ceiling (fio on ng0n1)", "nvme", "ng", None),
    Ratio("loop / its ceiling (fio on nvme0n1)", "loop", "block", None),
    Ratio("passthrough / block path, fio alone", "ng", "block", None),
]


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every way so a crash keeps what was done."""
    aioublk = [sys.executable, "-m", "aioublk"]
    workloads = [READ] if quick else [READ, WRITE]
    start = time.monotonic()
    release, _ = run(["uname", "-r"], timeout=10)
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "complete": False, "runs": runs,
    }
    _, err = run(["fio", "--name=fill", f"--filename={BLOCK}", "--rw=write", "--bs=1M",
                   "--direct=1", "--ioengine=io_uring", "--iodepth=8"], timeout=1800)
    print(f"namespace filled: {err or 'ok'}", flush=True)
    for r in range(rounds):
        for name in swapped(list(WAYS), r):
            way = WAYS[name]
            if way.add:
                done = _device_runs(aioublk, [*way.add, "-q", "1", "-d", "128"], workloads,
                                    runtime, [])
            else:
                done = [(w, *_fio(way.path, w, runtime, list(way.fio))) for w in workloads]
            for w, iops, e in done:
                record(runs, start, r + 1, f"{name:6} {w:17}", iops, e,
                       device=name, workload=w, server=name)
            out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def ratios(data: dict[str, object]) -> list[tuple[Ratio, str, float | None]]:
    """Each ratio of medians, per workload the run measured."""
    runs = data["runs"]
    assert isinstance(runs, list)
    out = []
    for w in (READ, WRITE):
        for r in RATIOS:
            a, b = (median(runs, server=n, workload=w) for n in (r.num, r.den))
            if a is not None or b is not None:
                out.append((r, w, ratio(a, b)))
    return out


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    setup = ("One guest run: QEMU, emulated NVMe controller over a sparse file on the host"
             if data["guest"] else "One run on the host")
    lines = [
        "# -t nvme (io_uring passthrough) vs -t loop on the block path (issue #15)", "",
        f"{setup}, {data['cpus']} CPUs, Linux {data['kernel']}. fio O_DIRECT, "
        f"{data['runtime']} s per workload after {data['ramp']} s ramp; median of "
        f"{data['rounds']} round(s). aioublk devices: 1 queue, depth 128, copy mode. Under "
        "emulation the absolute IOPS mean little: **the ratios are the result**.",
    ]
    lines += notes(data, "4k randread only, one round")
    lines += ["", *table(["way", READ, WRITE], "lrr",
                         ([way.label, *(fmt(median(runs, server=name, workload=w))
                                        for w in (READ, WRITE))]
                          for name, way in WAYS.items()))]
    lines += ["", *table(["ratio", "workload", "value", "target", "met"], "llrrl",
                         ([r.label, w, fmt(value, ".2f"), f"≥ {r.target}" if r.target else "—",
                           "—" if r.target is None else met(value, r.target)]
                          for r, w, value in ratios(data)))]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"`{x['device']}`", str(x["error"]))
    return "\n".join(lines + footer(errors, "way", "nvme.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    """One bar per ratio, the goal drawn across its bar."""
    ratio_bars(path, [(f"{r.label}\n{w}", value, r.target) for r, w, value in ratios(data)],
               "IOPS ratio (black line: goal)",
               f"-t nvme vs -t loop and their ceilings, Linux {data['kernel']}", labels=7)


def main(argv: list[str] | None = None) -> int:
    def timeout(rounds: int, quick: bool, runtime: int) -> float:
        fio_runs = rounds * len(WAYS) * (1 if quick else 2)
        return 1800 + rounds * 400 + fio_runs * (runtime + RAMP + 30)

    return guest_main("nvme", __doc__, argv, rounds=1, quick="randread, 2 s runs",
                      inner=inner, report=report, plot=plot, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
