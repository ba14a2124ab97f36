"""aioublk beside kublk on the numbers issue #12 sets for the data plane, in one guest run.

    python -m bench.dataplane [--runtime 5] [--rounds 1] [--quick] [--cpus 4]
                              [--aioublk-args '...']

Each row pairs the kernel's C server kublk with batch I/O (``-b``) and aioublk
with its defaults (no mode flags: it picks batch I/O itself when the driver
has it), on the same kind of device (depth 128), with fio
io_uring O_DIRECT as in ``bench.modes``:

1. null, 1 queue: 4k randread and randwrite at iodepth 64 (target >= 0.9x
   kublk), 4k randread at iodepth 1 (>= 0.6x);
2. loop over a 1 GiB file in the guest's RAM, 1 queue: 4k randread and
   randwrite at iodepth 64 (>= 0.8x);
3. null with 2 and 4 queues, one fio job per queue (``--numjobs=Q
   --group_reporting``), 4k randread at iodepth 64 (>= 0.8x at the same
   count); the 1-queue row above gives the baseline of the scaling table;
4. loop, 128k sequential read at iodepth 16, aioublk in copy mode (its
   default), ``-z`` and ``--auto_zc``, kublk ``-b`` in each for reference: the
   zero-copy modes must be no slower than copy mode (zc / copy >= 1).

Each device is added once and runs all its workloads: an aioublk ``add`` +
``del`` costs over a minute under emulation. The guest has 4 vCPUs by
default because the driver gives a device no more queues than the CPUs.
qcow2 (the remaining number of the issue) is ``bench.qcow2``'s.

The guest only writes JSON; the host turns it into
``bench/results/dataplane.md``, ``.json`` and ``dataplane.png``
(matplotlib: ``pip install -e .[bench]``). Absolute numbers under software
emulation mean little; the ratios are the result. ``--quick`` is a smoke
test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from bench.modes import (
    RAMP,
    SERVERS,
    _backing_file,
    _device_runs,
    _fmt,
    _footer,
    _median,
    _notes,
    _run,
    publish,
    run_guest,
)


class Device(NamedTuple):
    """One device per server: its add flags besides -t/-q/-d and the workloads run on it."""

    target: str
    queues: int
    kublk: list[str]
    aioublk: list[str]
    workloads: list[str]


QD64_READ, QD64_WRITE, QD1_READ, SEQ_READ = (
    "4k randread qd64", "4k randwrite qd64", "4k randread qd1", "128k read qd16")
DEVICES: dict[str, Device] = {  # in the order the guest adds them
    "null": Device("null", 1, ["-b"], [], [QD64_READ, QD64_WRITE, QD1_READ]),
    "loop": Device("loop", 1, ["-b"], [], [QD64_READ, QD64_WRITE, SEQ_READ]),
    "loop -z": Device("loop", 1, ["-b", "-z"], ["-z"], [SEQ_READ]),
    "loop --auto_zc": Device("loop", 1, ["-b", "--auto_zc"], ["--auto_zc"], [SEQ_READ]),
    "null -q 2": Device("null", 2, ["-b"], [], [QD64_READ]),
    "null -q 4": Device("null", 4, ["-b"], [], [QD64_READ]),
}
# --quick: a few of each kind (1 queue, loop, zero copy, several queues), one workload or two
QUICK: dict[str, list[str]] = {
    "null": [QD64_READ], "loop": [QD64_READ, SEQ_READ], "loop -z": [SEQ_READ],
    "null -q 4": [QD64_READ],
}


class Goal(NamedTuple):
    label: str
    device: str
    workload: str
    target: float  # aioublk / kublk at least


GOALS = [
    Goal("null, 1 queue, 4k randread qd64", "null", QD64_READ, 0.9),
    Goal("null, 1 queue, 4k randwrite qd64", "null", QD64_WRITE, 0.9),
    Goal("null, 1 queue, 4k randread qd1", "null", QD1_READ, 0.6),
    Goal("loop, 1 queue, 4k randread qd64", "loop", QD64_READ, 0.8),
    Goal("loop, 1 queue, 4k randwrite qd64", "loop", QD64_WRITE, 0.8),
    Goal("null, 2 queues, 2 jobs, 4k randread qd64", "null -q 2", QD64_READ, 0.8),
    Goal("null, 4 queues, 4 jobs, 4k randread qd64", "null -q 4", QD64_READ, 0.8),
]
SCALING = ["null", "null -q 2", "null -q 4"]  # all run QD64_READ, one fio job per queue
ZC_MODES = {"copy": "loop", "-z": "loop -z", "--auto_zc": "loop --auto_zc"}
ZC_TARGET = 1.0  # zero copy / copy, aioublk, SEQ_READ on loop


def _fio_jobs(queues: int) -> list[str]:
    return [f"--numjobs={queues}", "--group_reporting"] if queues > 1 else []


def inner(kublk: str, runtime: int, rounds: int, quick: bool, aioublk_args: list[str],
          out: Path) -> None:
    """Runs in the guest; rewrites `out` after every device so a crash keeps what was done."""
    servers = {"kublk": [kublk], "aioublk": [sys.executable, "-m", "aioublk"]}
    plan = QUICK if quick else {name: d.workloads for name, d in DEVICES.items()}
    start = time.monotonic()
    release, _ = _run(["uname", "-r"], timeout=10)
    features, _ = _run([*servers["aioublk"], "features"], timeout=120)
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "aioublk_args": aioublk_args,
        "batch_io": "BATCH_IO" in features, "complete": False, "runs": runs,
    }
    backing = _backing_file()
    data["backing"] = backing
    print(f"loop backing file: {backing}; driver has batch I/O: {data['batch_io']}", flush=True)
    for r in range(rounds):
        for name, workloads in plan.items():
            dev = DEVICES[name]
            files = [str(backing["path"])] if dev.target == "loop" else []
            # who goes first swaps every round: drift over the run (the host's
            # load, the guest's page cache) then does not favour one side
            for server in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                flags = dev.kublk if server == "kublk" else [*dev.aioublk, *aioublk_args]
                add_args = ["-t", dev.target, "-q", str(dev.queues), "-d", "128", *flags, *files]
                for w, iops, err in _device_runs(servers[server], add_args, workloads, runtime,
                                                 _fio_jobs(dev.queues)):
                    runs.append({"round": r + 1, "device": name, "workload": w,
                                 "server": server, "iops": iops, "error": err})
                    shown = f"{iops:,.0f} IOPS" if iops is not None else f"ERROR {err}"
                    print(f"[{time.monotonic() - start:4.0f} s] round {r + 1}: {name:14} "
                          f"{w:17} {server:7} {shown}", flush=True)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _met(ratio: float | None, target: float) -> str:
    return "—" if ratio is None else ("yes" if ratio >= target else "no")


def _ran(runs: list[dict[str, object]], device: str, workload: str) -> bool:
    return any(x["device"] == device and x["workload"] == workload for x in runs)


class GoalRow(NamedTuple):
    label: str
    kublk: float | None  # median IOPS
    aioublk: float | None
    ratio: float | None  # of the medians
    paired: float | None  # the median of each round's aioublk / kublk
    target: float


def _paired(runs: list[dict[str, object]], device: str, workload: str,
            num: str = "aioublk", den: str = "kublk") -> float | None:
    """The median over rounds of num / den (servers) within a round: both sides
    ran minutes apart there, so drift between rounds (the host's load moved
    kublk's loop reads from 10.7k to 16.2k IOPS in one run) cancels out."""
    by_round: dict[object, dict[object, float]] = {}
    for x in runs:
        if x["device"] == device and x["workload"] == workload and x["iops"] is not None:
            by_round.setdefault(x["round"], {})[x["server"]] = float(x["iops"])  # type: ignore[arg-type]
    ratios = [r[num] / r[den] for r in by_round.values() if r.get(den) and num in r]
    return statistics.median(ratios) if ratios else None


def goal_rows(data: dict[str, object]) -> list[GoalRow]:
    """The issue's numbers that this run measured (all but in a --quick run)."""
    runs = data["runs"]
    assert isinstance(runs, list)
    table = []
    for g in GOALS:
        if _ran(runs, g.device, g.workload):
            k = _median(runs, "kublk", device=g.device, workload=g.workload)
            a = _median(runs, "aioublk", device=g.device, workload=g.workload)
            table.append(GoalRow(g.label, k, a, _ratio(a, k),
                                 _paired(runs, g.device, g.workload), g.target))
    return table


class ZcRow(NamedTuple):
    mode: str
    kublk: float | None  # median IOPS
    aioublk: float | None
    kublk_vs_copy: float | None  # the server's IOPS in this mode / in copy mode
    aioublk_vs_copy: float | None


def zc_rows(data: dict[str, object]) -> list[ZcRow]:
    """Loop 128k reads in each copy mode that this run measured."""
    runs = data["runs"]
    assert isinstance(runs, list)
    copy = {s: _median(runs, s, device=ZC_MODES["copy"], workload=SEQ_READ) for s in SERVERS}
    table = []
    for mode, dev in ZC_MODES.items():
        if _ran(runs, dev, SEQ_READ):
            k, a = (_median(runs, s, device=dev, workload=SEQ_READ) for s in SERVERS)
            table.append(ZcRow(mode, k, a, _ratio(k, copy["kublk"]), _ratio(a, copy["aioublk"])))
    return table


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    setup = ("One guest run: QEMU TCG software emulation (no KVM), 4 GiB RAM" if data["guest"]
             else "One run on the host")
    batch = "it has" if data.get("batch_io") else "it lacks"
    extra = data.get("aioublk_args")
    lines = [
        "# aioublk vs kublk: the data plane's numbers (issue #12)",
        "",
        f"{setup}, {data['cpus']} CPUs, Linux {data['kernel']}. fio with io_uring, O_DIRECT, "
        f"{data['runtime']} s per workload after {data['ramp']} s ramp; median of "
        f"{data['rounds']} round(s). Every device has depth 128; kublk runs with `-b` (batch "
        "I/O), aioublk with its defaults (no mode flags: batch I/O when the driver has "
        f"UBLK_F_BATCH_IO, and {batch})"
        + (f" plus `{shlex.join(extra)}`" if isinstance(extra, list) and extra else "")
        + "; copy mode unless stated. kublk and aioublk alternate device by device, kublk "
        "first in odd rounds and aioublk first in even ones. Under emulation the absolute "
        "IOPS mean little: **the ratios are the result**. qcow2 vs qemu-nbd is "
        "`bench.qcow2`'s.",
    ]
    lines += _notes(data, "four devices, a workload or two each, one round")
    cpus = data["cpus"]
    if isinstance(cpus, int) and cpus < max(d.queues for d in DEVICES.values()):
        lines += ["", f"**Only {cpus} CPUs**: the driver gives a device no more queues than "
                      "CPUs, so the rows with more queues ran with fewer."]
    lines += ["", "IOPS are medians over the rounds. **aioublk / kublk** divides those "
              "medians; **paired** is the median over the rounds of each round's own "
              "aioublk / kublk (the two ran back to back), which drift between rounds does "
              "not move: the target is judged on it.",
              "", "| row | kublk IOPS | aioublk IOPS | aioublk / kublk | paired | target | met |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.label} | {_fmt(r.kublk)} | {_fmt(r.aioublk)} | {_fmt(r.ratio, '.2f')} "
              f"| {_fmt(r.paired, '.2f')} | ≥ {r.target} | {_met(r.paired, r.target)} |"
              for r in goal_rows(data)]
    scaling = [name for name in SCALING if any(x["device"] == name for x in runs)]
    if scaling:
        base = {s: _median(runs, s, device=SCALING[0], workload=QD64_READ) for s in SERVERS}
        lines += ["", "## Queue scaling", "",
                  "null, 4k randread iodepth 64, one fio job per queue (`--numjobs=Q "
                  "--group_reporting`: IOPS of all jobs together).", "",
                  "| queues | kublk IOPS | aioublk IOPS | aioublk / kublk | kublk vs 1 queue "
                  "| aioublk vs 1 queue |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name in scaling:
            k, a = (_median(runs, s, device=name, workload=QD64_READ) for s in SERVERS)
            lines.append(f"| {DEVICES[name].queues} | {_fmt(k)} | {_fmt(a)} "
                         f"| {_fmt(_ratio(a, k), '.2f')} "
                         f"| {_fmt(_ratio(k, base['kublk']), '.2f')} "
                         f"| {_fmt(_ratio(a, base['aioublk']), '.2f')} |")
    zc = zc_rows(data)
    if zc:
        lines += ["", "## Zero copy vs copy: loop, 128k sequential read iodepth 16", "",
                  "Each server's zero-copy mode against its own copy mode; the target is "
                  f"aioublk's zc / copy ≥ {ZC_TARGET}. kublk runs `-b` plus the mode's flag, "
                  "for reference.", "",
                  "| mode | kublk IOPS | aioublk IOPS | aioublk / kublk | kublk mode / copy "
                  "| aioublk mode / copy | met |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r.mode} | {_fmt(r.kublk)} | {_fmt(r.aioublk)} "
                  f"| {_fmt(_ratio(r.aioublk, r.kublk), '.2f')} "
                  f"| {_fmt(r.kublk_vs_copy, '.2f')} | {_fmt(r.aioublk_vs_copy, '.2f')} "
                  f"| {_met(r.aioublk_vs_copy, ZC_TARGET) if r.mode != 'copy' else '—'} |"
                  for r in zc]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"{x['server']} `{x['device']}`", str(x["error"]))
    return "\n".join(lines + _footer(errors, "server/device", "dataplane.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    """One bar per number with its target drawn across it: green met, red not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(r.label, r.paired, r.target) for r in goal_rows(data)]
    split = len(bars)
    bars += [(f"loop, 128k read qd16, aioublk {r.mode} / copy", r.aioublk_vs_copy, ZC_TARGET)
             for r in zc_rows(data) if r.mode != "copy"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(bars) + 2), 5.5))
    top = 1.2
    for i, (_, value, target) in enumerate(bars):
        ok = value is not None and value >= target
        ax.bar(i, value or 0, 0.6, color="tab:green" if ok else "tab:red", alpha=0.8)
        ax.hlines(target, i - 0.4, i + 0.4, color="black", linewidth=2)
        ax.annotate("n/a" if value is None else f"{value:.2f}", (i, value or 0),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
        top = max(top, (value or 0) + 0.2)
    if 0 < split < len(bars):
        ax.axvline(split - 0.5, color="grey", linewidth=1, linestyle=":")
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylim(0, top)
    ax.set_ylabel("ratio (black line: target)")
    where = "QEMU TCG" if data["guest"] else "host"
    ax.set_title(f"aioublk / kublk IOPS, paired by round (aioublk zc / copy for the last "
                 f"bars)\n{where}, {data['cpus']} CPUs, Linux {data['kernel']}, median of "
                 f"{data['rounds']} round(s)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _guest_timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous (a busy host makes TCG very slow), but a hung guest must not hold the
    machine forever: 150 s per aioublk device, 30 s per kublk one, fio runs with slack."""
    plan = QUICK if quick else {name: d.workloads for name, d in DEVICES.items()}
    fio_runs = 2 * sum(len(w) for w in plan.values())
    return 600 + rounds * (len(plan) * 180 + fio_runs * (runtime + RAMP + 30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", type=int, default=None, help="seconds per fio run (default 5)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 devices, a workload or two each, 2 s runs")
    ap.add_argument("--cpus", type=int, default=4,
                    help="guest vCPUs (default 4: the driver caps queues at the CPU count)")
    ap.add_argument("--aioublk-args", default="",
                    help="more flags for every aioublk add, e.g. --aioublk-args='--nthreads 2'")
    ap.add_argument("--report", metavar="JSON",
                    help="only write the report again from a run's results/dataplane.json")
    ap.add_argument("--inner", nargs=2, metavar=("KUBLK", "OUT"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    runtime = ns.runtime or (2 if ns.quick else 5)
    if ns.report:
        data = json.loads(Path(ns.report).read_text())
        command = (".venv/bin/python -m bench.dataplane --runtime "
                   f"{data['runtime']} --rounds {data['rounds']}")
        return publish("dataplane", data, report(data, command), plot, 0)
    if ns.inner:
        inner(ns.inner[0], runtime, ns.rounds, ns.quick, shlex.split(ns.aioublk_args),
              Path(ns.inner[1]))
        return 0
    options = [f"--runtime={runtime}", f"--rounds={ns.rounds}",
               *(["--quick"] if ns.quick else []),
               *([f"--aioublk-args={ns.aioublk_args}"] if ns.aioublk_args else [])]
    code, data = run_guest("bench.dataplane", options,
                           _guest_timeout(runtime, ns.rounds, ns.quick), cpus=ns.cpus)
    if data is None:
        return 1
    command = shlex.join([".venv/bin/python", "-m", "bench.dataplane", *options[2:]])
    if ns.runtime or ns.rounds != 1:
        command += f" --runtime {runtime} --rounds {ns.rounds}"
    if ns.cpus != 4:
        command += f" --cpus {ns.cpus}"
    return publish("dataplane", data, report(data, command), plot, code)


if __name__ == "__main__":
    sys.exit(main())
