"""How long an ``aioublk`` command takes to start, beside ``python3 -c pass`` and kublk.

    python -m bench.startup [--rounds 5] [--runs 20] [--quick] [--kublk PATH | --no-kublk]

Scripts poll ``list`` and udev runs ``aioublk udev owner`` for every ublk node, so a
command's start-up is its cost. Each row is a whole process, started the way a user
starts it (the venv's ``aioublk`` script), timed wall-clock from ``fork`` to exit:

- ``python3 -c pass``: this venv's interpreter doing nothing, the floor;
- ``aioublk --version``, ``list``, ``features``, ``del -a``, ``udev owner ublkb0``;
- ``kublk list`` (the kernel's C server; built from Debian sid's linux-source by
  ``tools.kublk`` unless ``--kublk PATH`` or ``--no-kublk``).

On a host without ublk_drv the ublk commands stop at opening ``/dev/ublk-control``
(one line, exit 1), after everything they import and their parser: what is timed is
start-up, which is what this measures. Every round runs each command ``--runs`` times,
commands interleaved, their order swapped every round; a row's figure is its median,
its ratio to ``python3 -c pass`` is paired within each round (the median over rounds,
with their range). ``modules`` is how many modules the command imported
(``-X importtime``), in this environment (an editable install's finder adds its own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Data,
    fmt,
    load,
    median,
    paired_ratios,
    parser,
    publish,
    ratio_bars,
    spread,
    swapped,
    table,
)

NAME = "startup"
FLOOR = "python3 -c pass"
#: the issue's goal: ``aioublk --version`` within 3x of the floor
VERSION_GOAL = 3.0
MODULES_GOAL = 90


def commands(kublk: str | None) -> dict[str, list[str]]:
    script = str(Path(sys.executable).with_name("aioublk"))
    if not os.path.exists(script):
        script = shutil.which("aioublk") or script
    rows = {FLOOR: [sys.executable, "-c", "pass"]}
    for args in (["--version"], ["list"], ["features"], ["del", "-a"],
                 ["udev", "owner", "ublkb0"]):
        rows["aioublk " + " ".join(args)] = [script, *args]
    if kublk:
        rows["kublk list"] = [kublk, "list"]
    return rows


def once(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def modules(cmd: list[str]) -> int | None:
    """Modules the command imports, counted by ``-X importtime`` (None for kublk)."""
    if not cmd[0].endswith(("python", "python3", "aioublk")) and cmd[0] != sys.executable:
        return None
    argv = cmd if cmd[0] == sys.executable else [sys.executable, *cmd]
    p = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, check=False)
    return sum(1 for line in p.stderr.splitlines() if line.startswith("import time:")) - 1


def measure(rows: dict[str, list[str]], rounds: int, runs: int) -> Data:
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    for rnd in range(rounds):
        for cmd in rows.values():
            once(cmd)  # warm the page cache for this command
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(runs):
            for name in swapped(list(rows), rnd):
                times[name].append(once(rows[name]))
        for name, ts in times.items():
            records.append({"round": rnd, "row": name, "ms": statistics.median(ts) * 1000})
        print(f"[{time.monotonic() - start:4.0f} s] round {rnd + 1}/{rounds}: " + ", ".join(
            f"{n} {statistics.median(ts) * 1000:.1f} ms" for n, ts in times.items()),
            flush=True)
    return {"records": records, "rows": list(rows),
            "modules": {name: modules(cmd) for name, cmd in rows.items()},
            "rounds": rounds, "runs": runs, "python": sys.version.split()[0],
            "command": " ".join(["python", "-m", "bench.startup", *sys.argv[1:]])}


def slowdowns(data: Data, row: str) -> list[float]:
    """Per round, ``row``'s median over the floor's (how many times slower)."""
    return paired_ratios(data["records"], {"row": row}, {"row": FLOOR}, value="ms")


def report(data: Data) -> str:
    rows = []
    for name in data["rows"]:
        r = slowdowns(data, name)
        mods = data["modules"].get(name)
        rows.append((f"`{name}`", fmt(median(data["records"], "ms", row=name), ".1f"),
                     spread(r) if name != FLOOR else "1", fmt(mods, "d")))
    version = slowdowns(data, "aioublk --version")
    v = statistics.median(version) if version else None
    lst = data["modules"].get("aioublk list")
    lines = [
        "# Start-up: aioublk's commands beside `python3 -c pass` and kublk", "",
        f"One run on the host, Python {data['python']}: {data['rounds']} rounds of "
        f"{data['runs']} runs of each command, interleaved, order swapped every round. "
        "Time: the median wall-clock time of a whole process; x floor: that over "
        "`python3 -c pass`'s, paired per round (median, min – max); modules: what it "
        "imported (`-X importtime`; this environment's editable install adds its finder's "
        "dozens to every row, the floor's included).", "",
        *table(["command", "time (ms)", "x floor", "modules"], "lrrr", rows), "",
        f"Goals: `aioublk --version` within {VERSION_GOAL:g}x of the floor: "
        f"{fmt(v, '.2f')}x ({'met' if v is not None and v <= VERSION_GOAL else 'not met'}); "
        f"`list` importing at most {MODULES_GOAL} modules: {fmt(lst, 'd')} here "
        "(`tests/cli/test_startup.py` counts them without site's and the editable "
        "finder's, and holds the limit).", "",
        "On this host there is no ublk_drv: each ublk command stops at opening "
        "`/dev/ublk-control`, after its imports and parser; kublk the same.", "",
        f"Chart: `{NAME}.png`. Reproduce: `{data['command']}` from the repository root.", "",
    ]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    bars = [(name, statistics.median(r) if (r := slowdowns(data, name)) else None, None)
            for name in data["rows"] if name != FLOOR]
    ratio_bars(path, bars, "times python3 -c pass (lower is better)",
               f"Start-up over an interpreter doing nothing (goal for --version: "
               f"{VERSION_GOAL:g}x)")


def main(argv: list[str] | None = None) -> int:
    ap: argparse.ArgumentParser = parser(__doc__, rounds=5, quick="1 round of 3 runs",
                                         inner=None)
    ap.add_argument("--runs", type=int, default=20, help="runs of each command per round")
    ap.add_argument("--kublk", help="kublk binary (default: built by tools.kublk)")
    ap.add_argument("--no-kublk", action="store_true", help="no kublk row")
    ns = ap.parse_args(argv)
    if ns.report:
        data = load(ns.report)
        return publish(NAME, data, report(data), plot, out=ns.out)
    kublk = ns.kublk
    if not kublk and not ns.no_kublk:
        from tools.kublk import ensure_kublk

        kublk = str(ensure_kublk())
    rounds, runs = (1, 3) if ns.quick else (ns.rounds, ns.runs)
    data = measure(commands(kublk), rounds, runs)
    data["quick"] = ns.quick
    return publish(NAME, data, report(data), plot, out=ns.out)


if __name__ == "__main__":
    sys.exit(main())
