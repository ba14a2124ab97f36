"""A target with no map, today beside the last commit before the data plane, in one guest run.

    python -m bench.nomap [--runtime 5] [--rounds 3] [--baseline REV]

Issue #12 moved mapped requests to C and rebuilt the queue layer; a target
that offers no map (every request a coroutine) must be no slower than before.
This runs one such target, the RAM disk of ``examples/ramdisk.py`` (reads and
writes copy between the request's buffer and a ``bytearray``), served by
``Device(target, queues=1, depth=128)`` from two trees:

- **today**: this checkout;
- **before**: ``--baseline`` (default ``2169c59``, the last commit before the
  data plane work), cloned into ``~/.cache/aioublk/baseline-REV`` and set up
  with its own ``scripts/setup`` (its own .venv and C extension).

fio io_uring, O_DIRECT: 4k randread and randwrite at iodepth 64 and 4k
randread at iodepth 1. The two servers alternate per round, the order
swapping every round; the table gives medians and today / before. Writes
``bench/results/nomap.md`` and ``.json``. Absolute numbers under emulation
mean little: the ratio is the result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    fmt,
    load,
    median,
    parser,
    publish,
    ratio,
    ratio_bars,
    run_guest,
    swapped,
    table,
)
from bench.modes import _fio

BASELINE = "2169c59"
WORKLOADS = ["4k randread qd64", "4k randwrite qd64", "4k randread qd1"]
TREES = ("before", "today")

# The server each tree runs: examples/ramdisk.py's target on one queue.
SERVER = """
import asyncio
from aioublk import Device, Geometry, Target

class RamDisk(Target):
    name = "ramdisk"

    def __init__(self, size):
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)

    async def read(self, offset, buf):
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset, buf, fua=False):
        self.data[offset:offset + len(buf)] = buf

async def main():
    async with Device(RamDisk(256 << 20), queues=1, depth=128) as dev:
        print(dev.path, flush=True)
        await dev.wait()

try:
    asyncio.run(main())
except KeyboardInterrupt:
    pass
"""


def _serve(python: str) -> tuple[subprocess.Popen[str], str]:
    """Start a server; (process, /dev/ublkbN)."""
    p = subprocess.Popen([python, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                         cwd="/")
    assert p.stdout is not None
    path = ""
    for _ in range(20):  # (the baseline's library logs to stdout too)
        path = p.stdout.readline().strip()
        if path.startswith("/dev/ublkb") or not path:
            break
    if not path.startswith("/dev/ublkb"):
        p.kill()
        raise RuntimeError(f"{python}: the server printed {path!r}, not a device")
    threading.Thread(target=p.stdout.read, daemon=True).start()  # never a full pipe
    for _ in range(50):
        if os.path.exists(path):
            break
        time.sleep(0.1)
    return p, path


def _stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def inner(pythons: dict[str, str], runtime: int, rounds: int, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every server."""
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {"cpus": os.cpu_count(), "runtime": runtime, "rounds": rounds,
                               "kernel": os.uname().release, "runs": runs, "complete": False}
    for r in range(rounds):
        for tree in swapped(TREES, r):
            p, path = _serve(pythons[tree])
            try:
                for w in WORKLOADS:
                    iops, err = _fio(path, w, runtime, [])
                    runs.append({"round": r + 1, "server": tree, "workload": w, "iops": iops,
                                 "error": err})
                    print(f"round {r + 1}: {tree:6} {w:17} "
                          f"{f'{iops:,.0f} IOPS' if iops is not None else err}", flush=True)
            finally:
                _stop(p)
            out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def baseline_tree(rev: str) -> Path:
    """The baseline's checkout with its .venv, made once."""
    tree = Path.home() / ".cache" / "aioublk" / f"baseline-{rev}"
    if not (tree / ".venv" / "bin" / "python").exists():
        if tree.exists():
            subprocess.run(["rm", "-rf", str(tree)], check=True)
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(tree)], check=True)
        subprocess.run(["git", "-C", str(tree), "checkout", "-q", rev], check=True)
        print(f"setting up the baseline {rev} in {tree}", flush=True)
        subprocess.run([str(tree / "scripts" / "setup")], cwd=tree, check=True)
    return tree


def _interpreter(python: Path | str) -> str:
    out = subprocess.run([str(python), "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return f"{os.path.realpath(python)} {out}"


def report(data: dict[str, object], baseline: str, command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    interpreters = data.get("interpreters") or {}
    assert isinstance(interpreters, dict)
    lines = [
        "# A target with no map: today vs before the data plane",
        "",
        f"One guest run: QEMU TCG software emulation (no KVM), {data['cpus']} CPUs, Linux "
        f"{data['kernel']}. The RAM disk of `examples/ramdisk.py` (a coroutine target "
        "without a map: every request is a coroutine), `Device(target, queues=1, "
        f"depth=128)`, served by this tree (**today**) and by `{baseline}` (**before**, the "
        "last commit before the data plane work, with its own .venv). fio io_uring, "
        f"O_DIRECT, {data['runtime']} s per workload after 1 s ramp; median of "
        f"{data['rounds']} round(s), the order swapping every round. Under emulation the "
        "absolute IOPS mean little: **the ratio is the result** (the goal: >= 1, within "
        "noise).",
        "",
        *[f"- {tree}: Python {interpreters[tree]} (what that tree's `scripts/setup` "
          "picked)" for tree in TREES if tree in interpreters],
        "",
    ]
    cells = []
    for w in WORKLOADS:
        b, t = (median(runs, server=s, workload=w) for s in TREES)
        cells.append([w, fmt(b), fmt(t), fmt(ratio(t, b), ".2f")])
    lines += table(["workload", "before IOPS", "today IOPS", "today / before"], "lrrr", cells)
    errors = [f"- {x['server']} {x['workload']}: `{x['error']}`" for x in runs if x["error"]]
    if errors:
        lines += ["", "## Errors", "", *errors]
    return "\n".join([*lines, "", f"Reproduce: `{command}` from the repository root.", ""])


def plot(data: dict[str, Any], path: Path) -> None:
    """Today's IOPS over before's, per workload (the goal: 1)."""
    runs = data["runs"]
    ratio_bars(path, [(w, ratio(median(runs, server="today", workload=w),
                                median(runs, server="before", workload=w)), 1.0)
                      for w in WORKLOADS],
               "today / before IOPS", "A target with no map: today over before the data plane")


def command(data: dict[str, Any]) -> str:
    """The command a report names: the run's own, else the one its settings give."""
    baseline = data.get("baseline", BASELINE)
    return str(data.get("command") or (
        f".venv/bin/python -m bench.nomap --runtime {data['runtime']} --rounds "
        f"{data['rounds']}" + (f" --baseline {baseline}" if baseline != BASELINE else "")))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=3, inner=("BEFORE", "TODAY", "OUT"))
    ap.add_argument("--runtime", type=int, default=5, help="seconds per fio run (default 5)")
    ap.add_argument("--baseline", default=BASELINE)
    ns = ap.parse_args(argv)
    if ns.inner:
        before, today, out = ns.inner
        inner({"before": before, "today": today}, ns.runtime, ns.rounds, Path(out))
        return 0
    code = 0
    if ns.report:
        data = load(ns.report)
    else:
        before = baseline_tree(ns.baseline) / ".venv" / "bin" / "python"
        interpreters = {"before": _interpreter(before), "today": _interpreter(sys.executable)}
        timeout = ns.rounds * len(TREES) * (len(WORKLOADS) * (ns.runtime + 20) + 120) + 300
        code, got = run_guest("bench.nomap", ["--runtime", str(ns.runtime), "--rounds",
                                              str(ns.rounds)], timeout, cpus=4, kublk=False,
                              inner=[str(before), sys.executable], here=False)
        if got is None:
            return 1
        data = got
        data["interpreters"] = interpreters
        if ns.baseline != BASELINE:
            data["baseline"] = ns.baseline
    return publish("nomap", data, report(data, data.get("baseline", BASELINE), command(data)),
                   plot, code=code, out=ns.out, ok=bool(data.get("complete")))


if __name__ == "__main__":
    sys.exit(main())
