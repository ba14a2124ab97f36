"""aioublk beside kublk on the numbers issues #12 and #25 set for the data plane, in one guest run.

    python -m bench.dataplane [--runtime 5] [--rounds 1] [--quick] [--cpus 4]
                              [--aioublk-args '...']

Each row pairs the kernel's C server kublk in its better setting of the
round, batch I/O (``-b``) or per-I/O commands (no flag), with aioublk in
its better one, its defaults (no mode flags: it picks batch I/O itself
when the driver has it) or ``--no-batch``, on the same kind of device
(depth 128), with fio io_uring O_DIRECT as in ``bench.modes``; the report
gives aioublk's defaults against kublk's better setting beside it. Issue
#25's goal is >= 1.0x on every row:

1. null, 1 queue: 4k randread and randwrite at iodepth 64, 4k randread at
   iodepth 1;
2. loop over a 1 GiB file in the guest's RAM, 1 queue: 4k randread and
   randwrite at iodepth 64, 4k randread at iodepth 1;
3. null with 2 and 4 queues, one fio job per queue (``--numjobs=Q
   --group_reporting``), 4k randread at iodepth 64 (at the same count);
   the 1-queue row above gives the baseline of the scaling table;
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

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from bench.common import (
    against_best,
    fmt,
    footer,
    load,
    median,
    met,
    notes,
    parser,
    publish,
    ratio,
    ratio_bars,
    record,
    run,
    run_guest,
    setup_line,
    swapped,
    table,
)
from bench.modes import RAMP, SERVERS, _backing_file, _device_runs


class Device(NamedTuple):
    """One device per server: its add flags besides -t/-q/-d and the workloads run on it."""

    target: str
    queues: int
    kublk: list[str]
    aioublk: list[str]
    workloads: list[str]
    per_io: bool = False  # each server runs it with per-I/O commands too: its better counts


QD64_READ, QD64_WRITE, QD1_READ, SEQ_READ = (
    "4k randread qd64", "4k randwrite qd64", "4k randread qd1", "128k read qd16")
DEVICES: dict[str, Device] = {  # in the order the guest adds them
    "null": Device("null", 1, ["-b"], [], [QD64_READ, QD64_WRITE, QD1_READ], per_io=True),
    "loop": Device("loop", 1, ["-b"], [], [QD64_READ, QD64_WRITE, QD1_READ, SEQ_READ],
                   per_io=True),
    "loop -z": Device("loop", 1, ["-b", "-z"], ["-z"], [SEQ_READ]),
    "loop --auto_zc": Device("loop", 1, ["-b", "--auto_zc"], ["--auto_zc"], [SEQ_READ]),
    "null -q 2": Device("null", 2, ["-b"], [], [QD64_READ], per_io=True),
    "null -q 4": Device("null", 4, ["-b"], [], [QD64_READ], per_io=True),
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


GOALS = [  # issue #25: every row at least kublk's better setting
    Goal("null, 1 queue, 4k randread qd64", "null", QD64_READ, 1.0),
    Goal("null, 1 queue, 4k randwrite qd64", "null", QD64_WRITE, 1.0),
    Goal("null, 1 queue, 4k randread qd1", "null", QD1_READ, 1.0),
    Goal("loop, 1 queue, 4k randread qd64", "loop", QD64_READ, 1.0),
    Goal("loop, 1 queue, 4k randwrite qd64", "loop", QD64_WRITE, 1.0),
    Goal("loop, 1 queue, 4k randread qd1", "loop", QD1_READ, 1.0),
    Goal("null, 2 queues, 2 jobs, 4k randread qd64", "null -q 2", QD64_READ, 1.0),
    Goal("null, 4 queues, 4 jobs, 4k randread qd64", "null -q 4", QD64_READ, 1.0),
]
PER_IO = "kublk per-io"  # the server field of kublk's runs without -b
NO_BATCH = "aioublk --no-batch"  # and of aioublk's with per-I/O commands
KUBLK_SETTINGS = {"kublk": "-b", PER_IO: "per-io"}
AIOUBLK_SETTINGS = {"aioublk": "default", NO_BATCH: "--no-batch"}
SCALING = ["null", "null -q 2", "null -q 4"]  # all run QD64_READ, one fio job per queue
ZC_MODES = {"copy": "loop", "-z": "loop -z", "--auto_zc": "loop --auto_zc"}
ZC_TARGET = 1.0  # zero copy / copy, aioublk, SEQ_READ on loop


def _servers(dev: Device) -> list[str]:
    """The server names (as recorded) that run on ``dev`` each round."""
    return [*SERVERS, *([PER_IO, NO_BATCH] if dev.per_io else [])]


def _fio_jobs(queues: int) -> list[str]:
    return [f"--numjobs={queues}", "--group_reporting"] if queues > 1 else []


def inner(kublk: str, runtime: int, rounds: int, quick: bool, aioublk_args: list[str],
          out: Path) -> None:
    """Runs in the guest; rewrites `out` after every device so a crash keeps what was done."""
    servers = {"kublk": [kublk], "aioublk": [sys.executable, "-m", "aioublk"]}
    plan = QUICK if quick else {name: d.workloads for name, d in DEVICES.items()}
    start = time.monotonic()
    release, _ = run(["uname", "-r"], timeout=10)
    features, _ = run([*servers["aioublk"], "features"], timeout=120)
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
            for server in swapped(_servers(dev), r):
                flags = {"kublk": dev.kublk, PER_IO: [s for s in dev.kublk if s != "-b"],
                         "aioublk": [*dev.aioublk, *aioublk_args],
                         NO_BATCH: [*dev.aioublk, "--no-batch", *aioublk_args]}[server]
                add_args = ["-t", dev.target, "-q", str(dev.queues), "-d", "128", *flags, *files]
                binary = servers["kublk" if server in KUBLK_SETTINGS else "aioublk"]
                for w, iops, err in _device_runs(binary, add_args, workloads, runtime,
                                                 _fio_jobs(dev.queues)):
                    record(runs, start, r + 1, f"{name:14} {w:17} {server:12}", iops, err,
                           device=name, workload=w, server=server)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def _ran(runs: list[dict[str, object]], device: str, workload: str) -> bool:
    return any(x["device"] == device and x["workload"] == workload for x in runs)


class GoalRow(NamedTuple):
    label: str
    kublk: float | None  # median over the rounds of kublk's better setting's IOPS
    aioublk: float | None  # and of aioublk's
    ratio: float | None  # of the medians
    paired: float | None  # the median of each round's aioublk's better / kublk's better
    target: float
    setting: str  # which kublk setting was the better one, round by round
    aioublk_setting: str  # and which of aioublk's
    defaults: float | None  # paired, aioublk's defaults against kublk's better setting


def goal_rows(data: dict[str, object]) -> list[GoalRow]:
    """The issue's numbers that this run measured (all but in a --quick run)."""
    runs = data["runs"]
    assert isinstance(runs, list)
    out = []
    for g in GOALS:
        if not _ran(runs, g.device, g.workload):
            continue
        key = {"device": g.device, "workload": g.workload}
        b = against_best(runs, AIOUBLK_SETTINGS, KUBLK_SETTINGS, **key)
        d = against_best(runs, "aioublk", KUBLK_SETTINGS, **key)
        out.append(GoalRow(g.label, b.peer, b.ours, ratio(b.ours, b.peer),
                           statistics.median(b.ratios) if b.ratios else None, g.target,
                           b.settings, b.our_settings,
                           statistics.median(d.ratios) if d.ratios else None))
    return out


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
    copy = {s: median(runs, server=s, device=ZC_MODES["copy"], workload=SEQ_READ)
            for s in SERVERS}
    out = []
    for mode, dev in ZC_MODES.items():
        if _ran(runs, dev, SEQ_READ):
            k, a = (median(runs, server=s, device=dev, workload=SEQ_READ) for s in SERVERS)
            out.append(ZcRow(mode, k, a, ratio(k, copy["kublk"]), ratio(a, copy["aioublk"])))
    return out


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    batch = "it has" if data.get("batch_io") else "it lacks"
    extra = data.get("aioublk_args")
    lines = [
        "# aioublk vs kublk: the data plane's numbers (issues #12 and #25)",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. fio with io_uring, "
        f"O_DIRECT, {data['runtime']} s per workload after {data['ramp']} s ramp; median of "
        f"{data['rounds']} round(s). Every device has depth 128; kublk runs with `-b` (batch "
        "I/O), aioublk with its defaults (no mode flags: batch I/O when the driver has "
        f"UBLK_F_BATCH_IO, and {batch})"
        + (f" plus `{shlex.join(extra)}`" if isinstance(extra, list) and extra else "")
        + "; on the goal table's devices (not the zero-copy ones) each also runs with "
        "per-I/O commands (kublk without `-b`, aioublk `--no-batch`). Copy mode unless "
        "stated. The servers alternate device by device, kublk first in odd rounds and "
        "aioublk first in even ones. Under emulation the absolute IOPS mean little: **the "
        "ratios are the result**. qcow2 vs qemu-nbd is `bench.qcow2`'s.",
    ]
    lines += notes(data, "four devices, a workload or two each, one round")
    cpus = data["cpus"]
    if isinstance(cpus, int) and cpus < max(d.queues for d in DEVICES.values()):
        lines += ["", f"**Only {cpus} CPUs**: the driver gives a device no more queues than "
                      "CPUs, so the rows with more queues ran with fewer."]
    lines += ["", "IOPS are medians over the rounds. **aioublk / kublk** divides those "
              "medians; **paired** is the median over the rounds of each round's own "
              "aioublk / kublk (both ran in that round, a device or two apart), which "
              "drift between rounds does not move: the target is judged on it. Where the "
              "servers also ran with per-I/O commands, each one's better setting of each "
              "round is the one compared, and **kublk setting** and **aioublk setting** "
              "name each that won a round; **paired, aioublk defaults** pairs aioublk's "
              "defaults with kublk's better setting.", "",
              *table(["row", "kublk setting", "aioublk setting", "kublk IOPS", "aioublk IOPS",
                      "aioublk / kublk", "paired", "paired, aioublk defaults", "target",
                      "met"], "lllrrrrrrl",
                     ([r.label, r.setting, r.aioublk_setting, fmt(r.kublk), fmt(r.aioublk),
                       fmt(r.ratio, ".2f"), fmt(r.paired, ".2f"), fmt(r.defaults, ".2f"),
                       f"≥ {r.target}", met(r.paired, r.target)]
                      for r in goal_rows(data)))]
    scaling = [name for name in SCALING if any(x["device"] == name for x in runs)]
    if scaling:
        base = {s: median(runs, server=s, device=SCALING[0], workload=QD64_READ)
                for s in SERVERS}
        cells = []
        for name in scaling:
            k, a = (median(runs, server=s, device=name, workload=QD64_READ) for s in SERVERS)
            cells.append([DEVICES[name].queues, fmt(k), fmt(a), fmt(ratio(a, k), ".2f"),
                          fmt(ratio(k, base["kublk"]), ".2f"),
                          fmt(ratio(a, base["aioublk"]), ".2f")])
        lines += ["", "## Queue scaling", "",
                  "null, 4k randread iodepth 64, one fio job per queue (`--numjobs=Q "
                  "--group_reporting`: IOPS of all jobs together); batch I/O on both sides: "
                  "kublk `-b` and aioublk's defaults.", "",
                  *table(["queues", "kublk IOPS", "aioublk IOPS", "aioublk / kublk",
                          "kublk vs 1 queue", "aioublk vs 1 queue"], "rrrrrr", cells)]
    zc = zc_rows(data)
    if zc:
        lines += ["", "## Zero copy vs copy: loop, 128k sequential read iodepth 16", "",
                  "Each server's zero-copy mode against its own copy mode; the target is "
                  f"aioublk's zc / copy ≥ {ZC_TARGET}. kublk runs `-b` plus the mode's flag, "
                  "for reference.", "",
                  *table(["mode", "kublk IOPS", "aioublk IOPS", "aioublk / kublk",
                          "kublk mode / copy", "aioublk mode / copy", "met"], "lrrrrrl",
                         ([r.mode, fmt(r.kublk), fmt(r.aioublk),
                           fmt(ratio(r.aioublk, r.kublk), ".2f"), fmt(r.kublk_vs_copy, ".2f"),
                           fmt(r.aioublk_vs_copy, ".2f"),
                           met(r.aioublk_vs_copy, ZC_TARGET) if r.mode != "copy" else "—"]
                          for r in zc))]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(f"{x['server']} `{x['device']}`", str(x["error"]))
    return "\n".join(lines + footer(errors, "server/device", "dataplane.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    """One bar per number with its target drawn across it: green met, red not."""
    bars: list[tuple[str, float | None, float | None]] = [
        (r.label, r.paired, r.target) for r in goal_rows(data)]
    split = len(bars)
    bars += [(f"loop, 128k read qd16, aioublk {r.mode} / copy", r.aioublk_vs_copy, ZC_TARGET)
             for r in zc_rows(data) if r.mode != "copy"]
    where = "QEMU TCG" if data["guest"] else "host"
    ratio_bars(path, bars, "ratio (black line: target)",
               f"aioublk / kublk IOPS, paired by round (aioublk zc / copy for the last "
               f"bars)\n{where}, {data['cpus']} CPUs, Linux {data['kernel']}, median of "
               f"{data['rounds']} round(s)", height=5.5, split=split)


def _guest_timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous (a busy host makes TCG very slow), but a hung guest must not hold the
    machine forever: 150 s per aioublk device, 30 s per kublk one, fio runs with slack."""
    plan = QUICK if quick else {name: d.workloads for name, d in DEVICES.items()}
    devices = sum(len(_servers(DEVICES[name])) for name in plan)
    fio_runs = sum(len(_servers(DEVICES[name])) * len(w) for name, w in plan.items())
    return 600 + rounds * (devices * 90 + fio_runs * (runtime + RAMP + 30))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=1,
                quick="4 devices, a workload or two each, 2 s runs")
    ap.add_argument("--cpus", type=int, default=4,
                    help="guest vCPUs (default 4: the driver caps queues at the CPU count)")
    ap.add_argument("--aioublk-args", default="",
                    help="more flags for every aioublk add, e.g. --aioublk-args='--nthreads 2'")
    ns = ap.parse_args(argv)
    runtime = ns.runtime or (2 if ns.quick else 5)
    if ns.report:
        saved = load(ns.report)
        command = saved.get("command") or (".venv/bin/python -m bench.dataplane --runtime "
                                           f"{saved['runtime']} --rounds {saved['rounds']}")
        return publish("dataplane", saved, report(saved, command), plot, out=ns.out)
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
    data["command"] = command
    return publish("dataplane", data, report(data, command), plot, code, ns.out)


if __name__ == "__main__":
    sys.exit(main())
