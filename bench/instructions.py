"""The work each I/O costs: guest instructions per request, aioublk beside kublk.

    python -m bench.instructions [--runtime 3] [--rounds 3] [--quick]

Under TCG emulation IOPS move by 10-20% between two runs of the same
server, more at queue depth 1, where a request's time is mostly vCPUs
waking each other. That hides differences of a few percent. The
instructions the guest executes per request repeat far better, so this
bench counts them.

A QEMU TCG plugin (``bench/tcg_count.c``, built here with ``cc``) counts
every translated block's executions. The guest asks for the counts at the
start and end of a window in the middle of a fio run, and reads the
requests the block layer completed in that window from
``/sys/block/ublkbN/stat``. Each instruction is put in one of three parts
by its address:

- **kernel**: all of the guest kernel's work (fio's submissions, ublk_drv,
  io_uring, the server's syscalls, interrupts, idle);
- **server**: the server process's user space (for aioublk: its C data
  plane, liburing, Python);
- **rest**: all other user space, which is fio.

The rows are kublk per-I/O, kublk ``-b`` (batch I/O), aioublk (its
default: batch I/O where the driver has it) and aioublk ``--no-batch``, on
null and loop devices (1 queue, depth 128) and null with 2 queues. They
alternate device by device, and the first of them swaps every round. A
row's ratio is aioublk's total instructions per I/O over kublk's, paired
by round. It is taken against kublk's best (fewest instructions) setting
of that round, and mode against mode. Below 1.0, aioublk does less work
per request.

Fewer instructions is not more IOPS: TCG's cost per instruction varies
(memory access, atomics, interrupts), and at queue depth 1 waiting
dominates. What this shows is whether a gap in IOPS comes from work
aioublk does.

The guest only writes JSON; the host turns it into
``bench/results/instructions.md``, ``.json`` and ``.png``. TCG only (the
plugin needs it). ``--quick`` is a smoke test of this script.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import (
    ROOT,
    Data,
    against_best,
    errors_section,
    fmt,
    grouped_bars,
    load,
    median,
    notes,
    paired_ratios,
    parser,
    publish,
    run,
    run_guest,
    setup_line,
    spread,
    swapped,
    table,
)
from bench.modes import _add, _backing_file

PLUGIN_SOURCE = ROOT / "bench" / "tcg_count.c"
KERNEL_BASE = 1 << 63  # x86-64: the kernel's half of the address space
ENTER = "__x64_sys_io_uring_enter"


class Setting(NamedTuple):
    server: str  # kublk or aioublk
    flags: list[str]


SETTINGS = {
    "kublk": Setting("kublk", []),
    "kublk -b": Setting("kublk", ["-b"]),
    "aioublk": Setting("aioublk", []),
    "aioublk --no-batch": Setting("aioublk", ["--no-batch"]),
}
#: which of kublk's settings aioublk's each is the same mode as
SAME_MODE = {"aioublk": "kublk -b", "aioublk --no-batch": "kublk"}


class Device(NamedTuple):
    target: str
    queues: int
    workloads: list[str]


WORKLOADS = {
    "4k randread qd1": ["--rw=randread", "--bs=4k", "--iodepth=1"],
    "4k randread qd64": ["--rw=randread", "--bs=4k", "--iodepth=64"],
    "4k randwrite qd64": ["--rw=randwrite", "--bs=4k", "--iodepth=64"],
}
DEVICES = {
    "null": Device("null", 1, list(WORKLOADS)),
    "loop": Device("loop", 1, list(WORKLOADS)),
    "null -q 2": Device("null", 2, ["4k randread qd64"]),
}
QUICK = {"null": ["4k randread qd64"]}
WARMUP = 1.0  # seconds of fio before the window opens
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
#: with symbols, the kernel functions a window keeps: those of at least this many
#: instructions per I/O (a fixed count of the busiest would make the cut move from window
#: to window, and a function under it look like 0 in one round and not in another)
FUNCTION_FLOOR = 5.0
#: kernel functions whose calls a window counts, with symbols: a switch of task, and of
#: address space (under TCG the latter empties the vCPU's software TLB)
CALLS = ("__schedule", "switch_mm_irqs_off")


# -- the plugin, on the host --------------------------------------------------------------


def build_plugin() -> Path:
    """The plugin built from its source, cached by the source's hash."""
    source = PLUGIN_SOURCE.read_bytes()
    cache = Path.home() / ".cache" / "aioublk" / "tcg_count"
    built = cache / f"tcg_count-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if built.exists():
        return built
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) to build bench/tcg_count.c: apt install gcc")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = built.with_suffix(".tmp")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Werror",
                    "-o", str(tmp), str(PLUGIN_SOURCE), "-lpthread"], check=True)
    tmp.replace(built)
    return built


# -- in the guest -------------------------------------------------------------------------


class Window:
    """Asks the plugin (through the shared folder) for what ran since its last answer."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.n = 0

    def take(self, timeout: float = 120) -> Path:
        out = self.folder / f"{self.n}.out"
        (self.folder / f"{self.n}.req").touch()
        self.n += 1
        deadline = time.monotonic() + timeout
        while not out.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"the TCG plugin did not answer in {timeout:.0f} s: "
                                 "was the guest started with it (bench.instructions does)?")
            time.sleep(0.01)
        return out


def _completed(block: str) -> int:
    """Requests the block layer completed on ``block`` (ublkb0, nbd0): reads plus writes."""
    fields = Path(f"/sys/block/{block}/stat").read_text().split()
    return int(fields[0]) + int(fields[4])


def _exec_maps(pid: int) -> list[tuple[int, int, str]]:
    """The process's executable mappings: (start, end, file), sorted."""
    maps = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "x" in parts[1]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            maps.append((start, end, parts[5] if len(parts) > 5 else "[anon]"))
    return sorted(maps)


def _kernel_symbol(name: str) -> int | None:
    for line in Path("/proc/kallsyms").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == name:
            return int(parts[0], 16) or None
    return None


class KernelSymbols:
    """The guest kernel's functions by address, to name where kernel instructions ran."""

    def __init__(self, kallsyms: Path = Path("/proc/kallsyms")) -> None:
        funcs = []
        for line in kallsyms.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] in "tTwW":
                funcs.append((int(parts[0], 16), parts[2]))
        funcs.sort()
        self.starts = [a for a, _ in funcs]
        self.names = [n for _, n in funcs]

    def locate(self, addr: int) -> tuple[str, bool]:
        """The function ``addr`` is in, and whether it is the function's first
        instruction (a block starting there is a call)."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return (self.names[i], self.starts[i] == addr) if i >= 0 else ("?", False)


def split(counts: Path, maps: list[tuple[int, int, str]], enter: int | None,
          symbols: KernelSymbols | None = None) -> dict[str, Any]:
    """One window's instructions by part, the server's by file, io_uring_enter calls,
    and with ``symbols`` the kernel's by function and the calls of each function in
    CALLS."""
    starts = [m[0] for m in maps]
    parts: Counter[str] = Counter()
    files: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    enters = 0
    for line in counts.read_text().splitlines():
        addr_s, insns_s, runs_s = line.split()
        addr, runs = int(addr_s, 16), int(runs_s)
        insns = int(insns_s) * runs
        if addr >= KERNEL_BASE:
            parts["kernel"] += insns
            enters += runs if addr == enter else 0
            if symbols is not None:
                name, entry = symbols.locate(addr)
                functions[name] += insns
                if entry and name in CALLS:
                    calls[name] += runs
            continue
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < maps[i][1]:
            parts["server"] += insns
            files[os.path.basename(maps[i][2])] += insns
        else:
            parts["rest"] += insns
    return {**{k: parts[k] for k in ("kernel", "server", "rest")},
            "server_files": dict(files.most_common(8)), "enters": enters,
            "functions": dict(functions), "calls": dict(calls)}


def _server_pid(cmd: list[str], dev_id: str) -> int:
    """The pid serving the device, from the kublk-style ``list -n`` line."""
    out, err = run([*cmd, "list", "-n", dev_id], timeout=60)
    try:
        return int(out.split("daemon pid ")[1].split()[0])
    except (IndexError, ValueError):
        raise RuntimeError(f"list -n {dev_id} gave no daemon pid: {err or out.strip()!r}") \
            from None


def measure(window: Window, block: str, pid: int | None, workload: str, runtime: int,
            fio_extra: list[str], enter: int | None,
            symbols: KernelSymbols | None = None) -> dict[str, Any]:
    """fio on /dev/BLOCK for WARMUP + runtime + 1 s; the window is the runtime in its
    middle. ``pid``: the server process (None: no server, its part stays 0)."""
    fio = subprocess.Popen(
        ["fio", "--name=w", f"--filename=/dev/{block}", "--ioengine=io_uring",
         "--direct=1", "--thread", *WORKLOADS[workload], *fio_extra, "--time_based",
         f"--runtime={runtime + WARMUP + 1:.0f}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(WARMUP)

        def mark() -> tuple[Path, float]:
            before = _completed(block)
            got = window.take()
            return got, (before + _completed(block)) / 2

        _, start = mark()
        opened = time.monotonic()
        time.sleep(runtime)
        counts, end = mark()
        seconds = time.monotonic() - opened
        maps = _exec_maps(pid) if pid is not None else []
    finally:
        _, err = fio.communicate(timeout=runtime + 300)
    if fio.returncode != 0:
        raise RuntimeError(f"fio exited {fio.returncode}: {err.strip()[-300:]}")
    ios = end - start
    if ios <= 0:
        raise RuntimeError("no request completed in the window")
    got = split(counts, maps, enter, symbols)
    return {"ios": ios, "iops": ios / seconds,
            "per_io": {k: got[k] / ios for k in ("kernel", "server", "rest")},
            "server_files": {k: v / ios for k, v in got["server_files"].items()},
            "enters": got["enters"] / ios,
            **({"functions": {k: v / ios for k, v in got["functions"].items()
                              if v / ios >= FUNCTION_FLOOR},
                "calls": {k: v / ios for k, v in got["calls"].items()}}
               if symbols is not None else {})}


def _no_huge_pages() -> bool:
    """Stop khugepaged's collapses, which clear 2 MiB at a time whenever they come and
    land in whichever window is open; True if THP is now off."""
    try:
        Path(THP).write_text("never")
    except OSError:
        return False
    return "[never]" in Path(THP).read_text()


def inner(kublk: str, folder: Path, runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every device so a crash keeps what was done."""
    commands = {"kublk": [kublk], "aioublk": [sys.executable, "-m", "aioublk"]}
    devices = {d: QUICK[d] for d in QUICK} if quick else \
        {d: DEVICES[d].workloads for d in DEVICES}
    release, _ = run(["uname", "-r"], timeout=10)
    data: Data = {"kernel": release.strip(), "cpus": os.cpu_count(),
                  "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime,
                  "rounds": rounds, "quick": quick, "complete": False, "runs": [],
                  "thp_off": _no_huge_pages()}
    backing = _backing_file() if "loop" in devices else None
    if backing:
        data["backing"] = backing
    enter = _kernel_symbol(ENTER)
    window = Window(folder)
    start = time.monotonic()

    def save() -> None:
        out.write_text(json.dumps(data))

    for r in range(1, rounds + 1):
        for name, workloads in devices.items():
            dev = DEVICES[name]
            for label in swapped(list(SETTINGS), r - 1):
                setting = SETTINGS[label]
                add = ["-t", dev.target, "-q", str(dev.queues), "-d", "128", *setting.flags,
                       *([str(backing["path"])] if dev.target == "loop" and backing else [])]
                jobs = [f"--numjobs={dev.queues}"] if dev.queues > 1 else []
                dev_id, err = _add(commands[setting.server], add)
                pid = None
                if dev_id is not None:
                    try:
                        pid = _server_pid(commands[setting.server], dev_id)
                    except RuntimeError as e:
                        err = str(e)
                try:
                    for w in workloads:
                        rec: dict[str, Any] = {"round": r, "device": name, "workload": w,
                                               "server": label, "error": err}
                        if dev_id is None or pid is None:
                            data["runs"].append(rec)
                            continue
                        try:
                            rec |= measure(window, f"ublkb{dev_id}", pid, w, runtime, jobs, enter)
                            rec["total"] = sum(rec["per_io"].values())
                            shown = (f"{rec['total']:,.0f} instructions per I/O "
                                     f"({rec['per_io']['server']:,.0f} in the server)")
                        except RuntimeError as e:
                            rec["error"] = shown = str(e)
                        data["runs"].append(rec)
                        print(f"[{time.monotonic() - start:4.0f} s] round {r}: {name} {w} "
                              f"{label}: {shown}", flush=True)
                finally:
                    if dev_id is not None:
                        run([*commands[setting.server], "del", "-n", dev_id], timeout=180)
                save()
    data["complete"] = True
    save()


# -- the report ---------------------------------------------------------------------------

KUBLK_SETTINGS = {k: k for k, s in SETTINGS.items() if s.server == "kublk"}


def _fewest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """against_best picks the most; here fewer is better: invert, so it picks the fewest."""
    return [{**x, "iops": 1 / x["total"]} if x.get("total") else {**x, "iops": None}
            for x in records]


def part_medians(runs: list[dict[str, Any]], **match: object) -> dict[str, float | None]:
    """Each part's instructions per I/O (kernel, server, rest), the median over the
    runs ``match`` picks (bench.nbd_instructions's too)."""
    return {p: median([{"v": x["per_io"][p], **x} for x in runs if x.get("per_io")],
                      "v", **match) for p in ("kernel", "server", "rest")}


def rows(data: Data) -> list[dict[str, Any]]:
    runs = data["runs"]
    keys = list(dict.fromkeys((x["device"], x["workload"]) for x in runs))
    out = []
    for device, workload in keys:
        key = {"device": device, "workload": workload}
        best = against_best(_fewest(runs), "aioublk", KUBLK_SETTINGS, **key)
        row: dict[str, Any] = {**key, "kublk_best": best.settings,
                               "vs_best": [1 / x for x in best.ratios], "settings": {}}
        for label in SETTINGS:
            per = part_medians(runs, server=label, **key)
            row["settings"][label] = {
                "total": median(runs, "total", server=label, **key), **per,
                "enters": median(runs, "enters", server=label, **key)}
        row["same_mode"] = {ours: paired_ratios(runs, {**key, "server": ours},
                                                {**key, "server": peer}, "total")
                            for ours, peer in SAME_MODE.items()}
        out.append(row)
    return out


def report(data: Data, command: str) -> str:
    lines = [
        "# Instructions per I/O: aioublk vs kublk",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. fio with "
        f"io_uring, O_DIRECT; each window is {data['runtime']} s in the middle of a fio "
        f"run; median of {data['rounds']} round(s). A QEMU TCG plugin counts the "
        "instructions the whole guest executed in the window; they are divided by the "
        "requests the block layer completed in it. Servers alternate device by device, "
        "the first swapping every round. **Fewer is less work**: a ratio below 1.0 "
        "means aioublk's requests cost fewer instructions than kublk's.",
        "",
        "**kernel** is all the guest kernel's work (fio's, ublk_drv's, the server's "
        "syscalls, interrupts); **server** is the server's user space; **rest** is the "
        "other user space (fio). **aioublk / kublk's fewest** pairs each round's aioublk "
        "(default: batch I/O) with kublk's setting of fewer instructions in that round; "
        "**same mode** pairs aioublk with kublk `-b` and aioublk `--no-batch` with kublk "
        "per-I/O. Ratios are the median of the rounds' own (min – max).",
    ]
    if data.get("thp_off"):
        lines += ["", "Transparent huge pages were off in the guest: khugepaged's background "
                      "page clearing otherwise lands in whichever window is open."]
    lines += notes(data, "null, 4k randread qd64, one round")
    table_rows = rows(data)
    lines += ["", *table(
        ["device", "workload", "aioublk / kublk's fewest", "kublk's fewest",
         "aioublk / kublk -b", "aioublk --no-batch / kublk"], "llrlrr",
        ([r["device"], r["workload"], spread(r["vs_best"]), r["kublk_best"],
          spread(r["same_mode"]["aioublk"]), spread(r["same_mode"]["aioublk --no-batch"])]
         for r in table_rows))]
    lines += ["", "## Where the instructions go", "",
              "Instructions per I/O (medians over the rounds), and io_uring_enter calls per "
              "I/O (all processes).", ""]
    cells = []
    for r in table_rows:
        for label, s in r["settings"].items():
            cells.append([r["device"], r["workload"], label, fmt(s["total"]), fmt(s["kernel"]),
                          fmt(s["server"]), fmt(s["rest"]), fmt(s["enters"], ".2f")])
    lines += table(["device", "workload", "server", "total", "kernel", "server", "rest",
                    "enters"], "lllrrrrr", cells)
    files: dict[str, Counter[str]] = {}
    for x in data["runs"]:
        if x.get("server_files"):
            files.setdefault(x["server"], Counter()).update(x["server_files"])
    if files:
        n = Counter(x["server"] for x in data["runs"] if x.get("server_files"))
        lines += ["", "The server's user-space instructions per I/O by file, averaged over "
                      "every row:", ""]
        for label, c in files.items():
            parts = ", ".join(f"{f} {v / n[label]:,.0f}" for f, v in c.most_common(4))
            lines.append(f"- {label}: {parts}")
    errors = {f"{x['server']} {x['device']}": str(x["error"])
              for x in data["runs"] if x.get("error")}
    lines += errors_section(errors, "server/device")
    lines += ["", f"Chart: `instructions.png`. Reproduce: `{command}` from the repository "
                  "root (boots the guest under TCG with the plugin; builds kublk from "
                  "Debian sid's linux-source).", ""]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    table_rows = rows(data)
    groups = [f"{r['device']}\n{r['workload']}" for r in table_rows]
    series = ["aioublk / kublk's fewest", "aioublk / kublk -b", "aioublk --no-batch / kublk"]
    values: dict[tuple[str, str], float | None] = {}
    for g, r in zip(groups, table_rows, strict=True):
        for s, ratios in zip(series, (r["vs_best"], r["same_mode"]["aioublk"],
                                      r["same_mode"]["aioublk --no-batch"]), strict=True):
            values[(g, s)] = statistics.median(ratios) if ratios else None
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(path, groups, series, values,
                 "guest instructions per I/O, aioublk / kublk (paired by round)",
                 f"instructions per I/O, aioublk / kublk (below 1: less work)\n{where}, "
                 f"{data['cpus']} CPUs, Linux {data['kernel']}, median of {data['rounds']} "
                 "round(s)", lines=[(1.0, "black", "-")], height=5.0, per_group=1.6,
                 fontsize=9, legend={"ncol": 3, "loc": "upper center",
                                     "bbox_to_anchor": (0.5, -0.15)})


def _timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous: an aioublk add takes seconds under TCG, a busy host more."""
    runs = 4 if quick else sum(len(d.workloads) for d in DEVICES.values()) * len(SETTINGS)
    adds = 4 if quick else len(DEVICES) * len(SETTINGS)
    return 900 + rounds * (adds * 120 + runs * (runtime + WARMUP + 60))


def counting_main(name: str, ap: argparse.ArgumentParser, argv: list[str] | None,
                  report: Callable[[Data, str], str], plot: Callable[[Data, Path], None],
                  inner: Callable[[list[str], int, int, bool], None],
                  timeout: Callable[[int, int, bool], float], kublk: bool) -> int:
    """main() of a bench that counts instructions (this one, bench.nbd_instructions):
    ``--report``, the guest's side (``inner(ns.inner, runtime, rounds, quick)``), or the
    guest run under TCG with the plugin, whose shared folder is the first of --inner's
    arguments after KUBLK (with `kublk`)."""
    ns = ap.parse_args(argv)
    runtime = ns.runtime or (2 if ns.quick else 3)
    rounds = 1 if ns.quick and ns.rounds == 3 else ns.rounds
    if ns.report:
        saved = load(ns.report)
        return publish(name, saved, report(saved, str(saved["command"])), plot, out=ns.out)
    if ns.inner:
        inner(ns.inner, runtime, rounds, ns.quick)
        return 0
    plugin = build_plugin()
    options = [f"--runtime={runtime}", f"--rounds={rounds}", *(["--quick"] if ns.quick else [])]
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as folder:
        code, data = run_guest(f"bench.{name}", options, timeout(runtime, rounds, ns.quick),
                               kublk=kublk, inner=[folder], here=False, shared=[Path(folder)],
                               accel="tcg", qemu_opts=["-plugin", f"{plugin},dir={folder}"])
    if data is None:
        return 1
    data["command"] = " ".join([".venv/bin/python", "-m", f"bench.{name}", *options])
    return publish(name, data, report(data, data["command"]), plot, code, ns.out)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=3, rounds=3, quick="null, 4k randread qd64, one round",
                inner=("KUBLK", "FOLDER", "OUT"))
    return counting_main(
        "instructions", ap, argv, report, plot,
        lambda args, runtime, rounds, quick: inner(args[0], Path(args[1]), runtime, rounds,
                                                   quick, Path(args[2])),
        _timeout, kublk=True)


if __name__ == "__main__":
    sys.exit(main())
