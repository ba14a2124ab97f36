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

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.modes import RESULTS, _fio, _fmt, _median

BASELINE = "2169c59"
WORKLOADS = ["4k randread qd64", "4k randwrite qd64", "4k randread qd1"]
TREES = ("before", "today")
REPO = Path(__file__).resolve().parents[1]

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
        for tree in TREES if r % 2 == 0 else TREES[::-1]:
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
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(tree)], check=True)
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
        "| workload | before IOPS | today IOPS | today / before |",
        "| --- | ---: | ---: | ---: |",
    ]
    for w in WORKLOADS:
        b, t = (_median(runs, s, workload=w) for s in TREES)
        lines.append(f"| {w} | {_fmt(b)} | {_fmt(t)} | "
                     f"{_fmt(t / b if t is not None and b else None, '.2f')} |")
    errors = [f"- {x['server']} {x['workload']}: `{x['error']}`" for x in runs if x["error"]]
    if errors:
        lines += ["", "## Errors", "", *errors]
    return "\n".join([*lines, "", f"Reproduce: `{command}` from the repository root.", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--report", metavar="JSON",
                    help="only write the report again from a run's results/nomap.json")
    ap.add_argument("--inner", nargs=3, metavar=("BEFORE", "TODAY", "OUT"),
                    help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.inner:
        before, today, out = ns.inner
        inner({"before": before, "today": today}, ns.runtime, ns.rounds, Path(out))
        return 0
    from aioublk.testing.guest import run_in_guest

    before = baseline_tree(ns.baseline) / ".venv" / "bin" / "python"
    interpreters = {"before": _interpreter(before), "today": _interpreter(sys.executable)}
    if ns.report:
        data = json.loads(Path(ns.report).read_text())
        data["interpreters"] = interpreters
        return _publish(data, ns, 0)
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as rw:
        out = Path(rw) / "result.json"
        argv = [sys.executable, "-m", "bench.nomap", "--runtime", str(ns.runtime),
                "--rounds", str(ns.rounds), "--inner", str(before), sys.executable, str(out)]
        timeout = ns.rounds * len(TREES) * (len(WORKLOADS) * (ns.runtime + 20) + 120) + 300
        code = run_in_guest(argv, [rw], memory="4G", cpus=4, timeout=timeout, cwd=REPO)
        if not out.exists():
            print(f"benchmark failed (exit {code}), no results", file=sys.stderr)
            return 1
        data = json.loads(out.read_text())
    data["interpreters"] = interpreters
    return _publish(data, ns, code)


def _publish(data: dict[str, object], ns: argparse.Namespace, code: int) -> int:
    command = (f".venv/bin/python -m bench.nomap --runtime {data['runtime']} --rounds "
               f"{data['rounds']}" + (f" --baseline {ns.baseline}" if ns.baseline != BASELINE
                                      else ""))
    text = report(data, ns.baseline, command)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "nomap.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "nomap.md").write_text(text)
    print(text)
    return 0 if code == 0 and data.get("complete") else 1


if __name__ == "__main__":
    sys.exit(main())
