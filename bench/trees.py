"""This checkout's aioublk against another checkout's, row by row, in one guest run.

    python -m bench.trees --baseline DIR [--runtime 3] [--rounds 3] [--quick] [--cpus 2]

A change meant to keep behaviour and speed (a refactoring, a move) is judged
here: the same rows served by aioublk from DIR (**old**: an older checkout
with its C extensions built, run as ``PYTHONPATH=DIR python -P -m aioublk``)
and from this checkout (**new**, the same way), in the same guest boot,
under the same interpreter. Each round serves every row once with each tree,
the order swapping every round; new / old is paired within each round, so
drift over the run cancels out. The rows are a few of ``bench.dataplane``'s
and ``bench.qcow2``'s, with their servers and fio runs:

- data plane (C serves every request): null and loop (a 1 GiB file in guest
  RAM), 1 queue, depth 128, aioublk's defaults; 4k randread at iodepth 1 and
  64, 4k randwrite at iodepth 64;
- qcow2 (``add -t qcow2 -q 1``), a fresh 512 MiB image in guest RAM per
  tree and round: allocating 4k randwrite at iodepth 64 over the EMPTY
  image (the round's first tree runs for ``--runtime``, the other does
  exactly as many writes), the sequential 1 MiB fill, then allocated 4k
  randread at iodepth 1 and 64 (C); 4k randread at iodepth 64 over a raw
  backing file (BACKING: every read through Python), with each tree's C
  share from ``list --stats``.

The guest only writes JSON; the host turns it into ``bench/results/trees.md``,
``.json`` and ``trees.png`` (matplotlib: ``pip install -e .[bench]``). The
ratios of two identical trees show the noise: a difference within their
spread is no difference. ``--quick`` is a smoke test of this script.
"""

from __future__ import annotations

import compileall
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import (
    ROOT,
    fmt,
    load,
    median,
    notes,
    paired_ratios,
    parser,
    publish,
    pyplot,
    record,
    run,
    run_guest,
    setup_line,
    spread,
    swapped,
    table,
)
from bench.dataplane import DEVICES, QD1_READ, QD64_READ, QD64_WRITE
from bench.modes import RAMP, _backing_file, _device_runs
from bench.qcow2 import (
    _R,
    _W,
    COUNT_CAP,
    MIN_FILL_RATE,
    RANDREAD,
    RANDWRITE,
    STEPS,
    AioublkServer,
    Guest,
    Step,
    _image_folder,
)

TREES = ("old", "new")  # the round's first tree: old in odd rounds
MiB = 1 << 20
IMAGE_SIZE = 512 * MiB
QUICK_IMAGE_SIZE = 64 * MiB
FILL = next(s for s in STEPS if s.how == "fill")
# data plane rows: bench.dataplane's device -> the workloads run on it
DATAPLANE = {"null": [QD1_READ, QD64_READ, QD64_WRITE], "loop": [QD1_READ, QD64_READ, QD64_WRITE]}
QCOW2 = {  # qcow2 rows: bench.qcow2's image kind -> its steps, in order
    "empty": [Step(RANDWRITE, 64, _W, "count"), FILL, Step(RANDREAD, 1, _R, "time"),
              Step(RANDREAD, 64, _R, "time")],
    "backing": [Step(RANDREAD, 64, _R, "time")],
}
QUICK_DATAPLANE = {"null": [QD64_READ]}
QUICK_QCOW2 = {"empty": [Step(RANDWRITE, 64, _W, "count"), FILL, Step(RANDREAD, 64, _R, "time")]}


def python(tree: Path | str) -> list[str]:
    """The interpreter running `tree`'s aioublk: that folder first on the path,
    nothing from the working folder (``-P``) nor another PYTHONPATH."""
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-P"]


def aioublk(tree: Path | str) -> list[str]:
    return [*python(tree), "-m", "aioublk"]


# -- guest side ---------------------------------------------------------------------


def inner(baseline: str, runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every fio run so a crash keeps what was done."""
    cmds = {"old": aioublk(baseline), "new": aioublk(ROOT)}
    size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    release, _ = run(["uname", "-r"], timeout=10)
    data: dict[str, Any] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "image_size": size, "complete": False,
        "runs": [], "devices": [],
    }
    data["backing"] = _backing_file()
    folder = _image_folder(size)
    data["storage"] = folder
    guest = Guest(data, out, runtime, size)
    servers = {}
    for tree in TREES:
        servers[tree] = AioublkServer()
        servers[tree].cmd, servers[tree].name = cmds[tree], tree
    for r in range(1, rounds + 1):
        for name, workloads in (QUICK_DATAPLANE if quick else DATAPLANE).items():
            dev = DEVICES[name]
            files = [str(data["backing"]["path"])] if dev.target == "loop" else []
            for tree in swapped(TREES, r - 1):
                add = ["-t", dev.target, "-q", str(dev.queues), "-d", "128", *dev.aioublk,
                       *files]
                for w, iops, err in _device_runs(cmds[tree], add, workloads, runtime, []):
                    record(data["runs"], guest.start, r, f"{name:5} {w:17} {tree}", iops, err,
                           device=name, workload=w, server=tree)
                guest.save()
        for kind, steps in (QUICK_QCOW2 if quick else QCOW2).items():
            counts: dict[str, int] = {}  # the round's first tree's allocating write count
            for tree in swapped(TREES, r - 1):
                guest.device(servers[tree], r, kind, steps, counts, str(folder["path"]))
    data["complete"] = True
    data["elapsed_s"] = time.monotonic() - guest.start
    guest.save()


# -- host side ----------------------------------------------------------------------


def label(x: Mapping[str, Any]) -> str:
    """The row a run belongs to: a data plane device and workload, or a qcow2 image
    kind and step."""
    if "device" in x:
        return f"{x['device']}, {x['workload']}"
    return f"qcow2 {x['kind']}, {x['workload']} qd{x['qd']}"


class Row(NamedTuple):
    label: str
    old: float | None  # median IOPS over the rounds
    new: float | None
    ratios: list[float]  # each round's new / old, in round order
    c_share: dict[str, float | None]  # tree -> median share of requests C served (qcow2)
    cpu: dict[str, float | None]  # tree -> median server CPU µs per I/O (qcow2)


def rows(data: Mapping[str, Any]) -> list[Row]:
    """Every row the run measured, in the order it ran them, paired by round."""
    out = []
    for name in dict.fromkeys(label(x) for x in data["runs"]):
        mine = [x for x in data["runs"] if label(x) == name]
        out.append(Row(name, median(mine, server="old"), median(mine, server="new"),
                       paired_ratios(mine, {"server": "new"}, {"server": "old"}),
                       {t: median(mine, "c_share", server=t) for t in TREES},
                       {t: median(mine, "cpu_us_per_io", server=t) for t in TREES}))
    return out


def _mid(ratios: Sequence[float]) -> float | None:
    return statistics.median(ratios) if ratios else None


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def report(data: Mapping[str, Any], command: str) -> str:
    trees = data.get("trees") or {}
    table_rows = rows(data)
    lines = [
        "# aioublk: this checkout (new) against another (old)", "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. fio io_uring, "
        f"O_DIRECT, {data['runtime']} s per time-based run after {data['ramp']} s ramp; "
        f"{data['rounds']} round(s), old first in odd rounds, new first in even ones. Rows "
        "from `bench.dataplane` (null and loop, 1 queue, depth 128, aioublk's defaults) and "
        f"`bench.qcow2` (a fresh {data['image_size'] // MiB} MiB image per tree and round: "
        "allocating writes on the empty one, the later tree repeating the first one's "
        "count; allocated reads after the fill; reads of a raw backing file through "
        "Python). **new / old** is the median of each round's own ratio (min – max over "
        "the rounds): the spread is the noise. For qcow2, the share of requests C served "
        "and the server's CPU time per I/O (its threads' but io_uring's workers', from "
        "`/proc/PID/task/*/schedstat`), medians over the rounds.", "",
        *(f"- {t}: `{trees[t]['path']}` at {trees[t]['commit']}"
          + (" with uncommitted changes" if trees[t].get("dirty") else "")
          for t in TREES if t in trees),
    ]
    lines += load_note(data.get("host_load"))
    lines += notes(data, "a row or two of each kind, one round")
    lines += ["", *table(
        ["row", "old IOPS", "new IOPS", "new / old", "C share old", "C share new",
         "CPU µs / I/O old", "CPU µs / I/O new"], "lrrrrrrr",
        ([r.label, fmt(r.old), fmt(r.new), spread(r.ratios), fmt(r.c_share["old"], ".3f"),
          fmt(r.c_share["new"], ".3f"), fmt(r.cpu["old"], ".1f"), fmt(r.cpu["new"], ".1f")]
         for r in table_rows))]
    medians = [_mid(r.ratios) for r in table_rows]
    overall = geomean([m for m in medians if m])
    lines += ["", f"All rows, geometric mean of new / old: {fmt(overall, '.3f')}."]
    errors: dict[str, str] = {}
    for x in data["runs"]:
        if x.get("error"):
            errors.setdefault(f"{x['server']} {label(x)}", str(x["error"]))
    for d in data.get("devices", []):
        check = d.get("check")
        if isinstance(check, str):  # qemu-img check's error (a list: its clean output)
            errors.setdefault(f"{d['server']} qcow2 {d['kind']} check", check)
    if errors:
        lines += ["", "## Errors", "", *(f"- {k}: `{e}`" for k, e in errors.items())]
    return "\n".join([*lines, "", f"Chart: `trees.png`. Reproduce: `{command}` from the "
                      "repository root (boots the guest when the host has no ublk_drv).", ""])


def plot(data: dict[str, Any], path: Path) -> None:
    """new / old per row: the median bar, the rounds' min and max as its whisker."""
    plt = pyplot()
    table_rows = [r for r in rows(data) if r.ratios]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(table_rows) + 2), 5.0))
    xs = range(len(table_rows))
    mid = [_mid(r.ratios) or 0 for r in table_rows]
    ax.bar(xs, mid, 0.6, color="tab:blue", alpha=0.8)
    ax.errorbar(xs, mid, fmt="none", ecolor="black", capsize=4,
                yerr=[[m - min(r.ratios) for m, r in zip(mid, table_rows, strict=True)],
                      [max(r.ratios) - m for m, r in zip(mid, table_rows, strict=True)]])
    for x, m in zip(xs, mid, strict=True):
        ax.annotate(f"{m:.2f}", (x, 0.05), ha="center", fontsize=8, color="white")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(list(xs), [r.label for r in table_rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, max([1.2, *(max(r.ratios) + 0.1 for r in table_rows)]))
    ax.set_ylabel("new / old IOPS, paired by round (whiskers: min, max)")
    where = "QEMU TCG" if data["guest"] else "host"
    ax.set_title(f"aioublk, this checkout / another\n{where}, {data['cpus']} CPUs, Linux "
                 f"{data['kernel']}, {data['rounds']} round(s)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def describe(tree: Path) -> dict[str, Any]:
    """A tree's path, commit and whether it has changes; SystemExit unless its
    aioublk, extensions built, is what its command imports."""
    tree = tree.resolve()
    if not list((tree / "aioublk").glob("_uring*.so")):
        raise SystemExit(f"{tree}: no aioublk/_uring*.so (build its C extensions first)")
    got = subprocess.run([*python(tree), "-c", "import aioublk; print(aioublk.__file__)"],
                         capture_output=True, text=True, check=False)
    if got.stdout.strip() != str(tree / "aioublk" / "__init__.py"):
        raise SystemExit(f"{tree}: its command imports aioublk from {got.stdout.strip()!r} "
                         f"{got.stderr.strip()}")
    git = ["git", "-C", str(tree)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return {"path": str(tree), "commit": commit or "?", "dirty": bool(dirty)}


class HostLoad:
    """The host's 1-minute load average, sampled every `every` seconds while a
    guest runs: under emulation other work on the host moves the IOPS more
    than most changes do."""

    def __init__(self, every: float = 30.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> HostLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, Any]:
        return {"cpus": os.cpu_count(), "median": statistics.median(self.samples),
                "max": max(self.samples), "samples": len(self.samples)}


def load_note(host: Mapping[str, Any] | None) -> list[str]:
    """The report's paragraph on the host's load during the run."""
    if not host:
        return []
    line = (f"The host's load average during the run: median {host['median']:.1f}, at most "
            f"{host['max']:.1f}, on {host['cpus']} CPUs.")
    if host["max"] > host["cpus"]:
        line += (" **Busy host**: other work took the emulated CPUs' time now and then, "
                 "and moves single rounds far more than a change would; judge only rows "
                 "whose whole spread leaves 1, or run again on a quiet host.")
    return ["", line]


def guest_options(runtime: int, rounds: int, quick: bool) -> list[str]:
    return [f"--runtime={runtime}", f"--rounds={rounds}", *(["--quick"] if quick else [])]


def guest_timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous (a busy host makes TCG very slow), but finite: 150 s an add, the fill
    at the slowest rate, a count run at its cap."""
    dataplane = QUICK_DATAPLANE if quick else DATAPLANE
    qcow2 = QUICK_QCOW2 if quick else QCOW2
    size = (QUICK_IMAGE_SIZE if quick else IMAGE_SIZE) / MiB
    fio = [runtime + RAMP + 40 for w in dataplane.values() for _ in w] + [
        size / MIN_FILL_RATE + 60 if s.how == "fill" else
        runtime * COUNT_CAP + 40 if s.how == "count" else runtime + RAMP + 60
        for steps in qcow2.values() for s in steps]
    per_tree = 150 * (len(dataplane) + len(qcow2)) + sum(fio)
    return 600 + rounds * len(TREES) * per_tree


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=3, rounds=3, quick="a row or two of each kind, one round, "
                "2 s runs", inner=("BASELINE", "OUT"))
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="the checkout to compare against (old), its C extensions built")
    ap.add_argument("--cpus", type=int, default=2, help="guest vCPUs (default 2)")
    ap.add_argument("--timeout", type=float, metavar="SECONDS",
                    help="stop the guest after this long (default: from the plan, generous)")
    ns = ap.parse_args(argv)
    runtime = ns.runtime or (2 if ns.quick else 3)
    rounds = 1 if ns.quick and ns.rounds == 3 else ns.rounds
    if ns.report:
        saved = load(ns.report)
        return publish("trees", saved, report(saved, saved["command"]), plot, out=ns.out)
    if ns.inner:
        inner(ns.inner[0], runtime, rounds, ns.quick, Path(ns.inner[1]))
        return 0
    if ns.baseline is None:
        ap.error("--baseline DIR is needed (or --report JSON)")
    trees = {"old": describe(ns.baseline), "new": describe(ROOT)}
    compileall.compile_dir(Path(trees["old"]["path"]) / "aioublk", quiet=1)  # as the guest's
    options = guest_options(runtime, rounds, ns.quick)
    with HostLoad() as host:
        code, data = run_guest("bench.trees", options,
                               ns.timeout or guest_timeout(runtime, rounds, ns.quick),
                               cpus=ns.cpus, kublk=False, inner=[trees["old"]["path"]])
    if data is None:
        return 1
    data["trees"], data["host_load"] = trees, host.summary()
    data["command"] = shlex.join([".venv/bin/python", "-m", "bench.trees", "--baseline",
                                  str(ns.baseline), *options,
                                  *([f"--cpus={ns.cpus}"] if ns.cpus != 2 else [])])
    return publish("trees", data, report(data, data["command"]), plot, code, ns.out,
                   ok=bool(data.get("complete")))


if __name__ == "__main__":
    sys.exit(main())
