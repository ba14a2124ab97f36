"""The work each NBD request costs: guest instructions per I/O, -t nbd beside nbd.ko.

    python -m bench.nbd_instructions [--runtime 3] [--rounds 3] [--quick]

bench.nbd compares IOPS with the kernel's own NBD client on the same
server. Over a unix socket aioublk is below nbd.ko there, and under TCG
IOPS alone cannot say why. This bench counts, with bench.instructions'
TCG plugin, the instructions the whole guest executes per request with
each client, on the same qemu-storage-daemon export over a unix socket
(a 1 GiB raw file in tmpfs, filled with data), and names the kernel
functions where the two clients' requests differ most.

- **kernel**: all of the guest kernel's work (fio's submissions, nbd.ko
  or ublk_drv, the sockets, qemu-storage-daemon's syscalls);
- **server**: aioublk's user space (nbd.ko has none);
- **rest**: all other user space (fio, qemu-storage-daemon).

Clients: ``aioublk add -t nbd URI -q 1 -d 128`` and nbd.ko through
``nbd-client`` (depth 128, one connection), scheduler ``none`` on both.
Who goes first swaps every round; ratios are paired by round.

The guest only writes JSON; the host turns it into
``bench/results/nbd_instructions.md``, ``.json`` and ``.png``. TCG only
(the plugin needs it). ``--quick`` is a smoke test of this script.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Data,
    errors_section,
    fmt,
    grouped_bars,
    median,
    notes,
    paired_ratios,
    parser,
    run,
    setup_line,
    spread,
    swapped,
    table,
)
from bench.instructions import (
    CALLS,
    ENTER,
    FUNCTION_FLOOR,
    KernelSymbols,
    Window,
    _kernel_symbol,
    _no_huge_pages,
    counting_main,
    measure,
    part_medians,
)
from bench.modes import BACKING_SIZE
from bench.nbd import (
    KernelClient,
    _export,
    _fill,
    _no_scheduler,
    _start_daemon,
    attach_client,
    stop_daemon,
)
from bench.qcow2 import AioublkServer, _image_folder

CLIENTS = ("nbd.ko", "aioublk")
WORKLOADS = ["4k randread qd64", "4k randwrite qd64"]
QUICK = ["4k randread qd64"]
SHOWN = 8  # kernel functions listed each way per workload


def inner(folder: Path, runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every client so a crash keeps what was done."""
    workloads = QUICK if quick else WORKLOADS
    release, _ = run(["uname", "-r"], timeout=10)
    qsd, _ = run(["qemu-storage-daemon", "--version"], timeout=30)
    run(["modprobe", "nbd"], timeout=60)
    storage = _image_folder(BACKING_SIZE)
    disk = os.path.join(str(storage["path"]), "disk.raw")
    data: Data = {"kernel": release.strip(), "cpus": os.cpu_count(),
                  "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime,
                  "rounds": rounds, "quick": quick, "storage": storage,
                  "qemu_storage_daemon": qsd.splitlines()[0] if qsd else None,
                  "kernel_client": KernelClient().tool, "complete": False, "runs": [],
                  "thp_off": _no_huge_pages()}
    data["fill_error"] = _fill(disk)
    enter = _kernel_symbol(ENTER)
    symbols = KernelSymbols()
    window = Window(folder)
    exp = _export("unix", str(storage["path"]))
    start = time.monotonic()
    for r in range(1, rounds + 1):
        for client in swapped(CLIENTS, r - 1):
            proc, err = _start_daemon("unix", exp, disk)
            side, block = None, None
            if proc is not None:
                side, (dev, err) = attach_client(client == "nbd.ko", exp)
                block = os.path.basename(dev) if dev else None
            try:
                for w in workloads:
                    rec: dict[str, Any] = {"round": r, "workload": w, "server": client,
                                           "error": err}
                    if block is not None:
                        try:
                            _no_scheduler(f"/dev/{block}")
                            pid = None
                            if isinstance(side, AioublkServer):
                                if side.pid is None:
                                    raise RuntimeError("list --json gave no daemon pid: its "
                                                       "user space would count as fio's")
                                pid = side.pid
                            rec |= measure(window, block, pid, w, runtime, [], enter, symbols)
                            rec["total"] = sum(rec["per_io"].values())
                            shown = f"{rec['total']:,.0f} instructions per I/O"
                        except RuntimeError as e:
                            rec["error"] = shown = str(e)
                    else:
                        shown = f"ERROR {err}"
                    data["runs"].append(rec)
                    print(f"[{time.monotonic() - start:4.0f} s] round {r}: {w} {client}: "
                          f"{shown}", flush=True)
            finally:
                if block is not None and side is not None:
                    err = side.detach()
                    if err:
                        print(f"  detaching {client} failed: {err}", flush=True)
                if proc is not None:
                    stop_daemon(proc)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


# -- the report ---------------------------------------------------------------------------


def _functions(runs: list[dict[str, Any]], client: str, workload: str) -> dict[str, float]:
    """Each kernel function's instructions per I/O, the median over the rounds (a
    function under FUNCTION_FLOOR in a round counts 0 there): a round something
    else ran in moves a mean, not a median."""
    got = [x["functions"] for x in runs
           if x.get("functions") and x["server"] == client and x["workload"] == workload]
    names = {k for f in got for k in f}
    return {k: statistics.median(f.get(k, 0.0) for f in got) for k in names}


def rows(data: Data) -> list[dict[str, Any]]:
    runs = data["runs"]
    out = []
    for w in dict.fromkeys(x["workload"] for x in runs):
        row: dict[str, Any] = {"workload": w, "clients": {}}
        for c in CLIENTS:
            per = part_medians(runs, server=c, workload=w)
            calls = {f: median([{"v": x["calls"].get(f, 0), **x} for x in runs
                                if x.get("calls") is not None], "v", server=c, workload=w)
                     for f in CALLS}
            row["clients"][c] = {"total": median(runs, "total", server=c, workload=w),
                                 "iops": median(runs, "iops", server=c, workload=w),
                                 "enters": median(runs, "enters", server=c, workload=w),
                                 "calls": calls, **per}
        row["ratio"] = paired_ratios(runs, {"server": "aioublk", "workload": w},
                                     {"server": "nbd.ko", "workload": w}, "total")
        row["iops_ratio"] = paired_ratios(runs, {"server": "aioublk", "workload": w},
                                          {"server": "nbd.ko", "workload": w})
        ours, peer = (_functions(runs, c, w) for c in ("aioublk", "nbd.ko"))
        diff = {k: ours.get(k, 0.0) - peer.get(k, 0.0) for k in set(ours) | set(peer)}
        ranked = sorted(diff, key=lambda k: diff[k])
        row["more"] = [(k, peer.get(k, 0.0), ours.get(k, 0.0)) for k in ranked[::-1][:SHOWN]
                       if diff[k] > 0]
        row["less"] = [(k, peer.get(k, 0.0), ours.get(k, 0.0)) for k in ranked[:SHOWN]
                       if diff[k] < 0]
        out.append(row)
    return out


def report(data: Data, command: str) -> str:
    tool = data.get("kernel_client")
    lines = [
        "# Instructions per NBD request: -t nbd vs nbd.ko",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. "
        f"{data.get('qemu_storage_daemon') or 'qemu-storage-daemon'} exports a 1 GiB raw "
        f"file in `{data['storage']['path']}` ({data['storage']['fs']}), filled with data, "
        f"over a unix socket. Clients: `aioublk add -t nbd URI -q 1 -d 128`, and nbd.ko "
        f"through `{tool}` (depth 128, one connection); scheduler `none`. fio with "
        f"io_uring, O_DIRECT; each window is {data['runtime']} s in the middle of a fio run; "
        f"{data['rounds']} round(s), who goes first swapping every round. A QEMU TCG plugin "
        "counts the instructions the whole guest executed in the window; they are divided "
        "by the requests the block layer completed in it. **Fewer is less work.**",
        "",
        "**kernel** is all the guest kernel's work; **server** is aioublk's user space "
        "(nbd.ko has none); **rest** is the other user space (fio and "
        "qemu-storage-daemon). Ratios are aioublk / nbd.ko, the median of the rounds' own "
        "(min – max); the IOPS are the windows' (instruction counting slows the guest).",
    ]
    if data.get("thp_off"):
        lines += ["", "Transparent huge pages were off in the guest (khugepaged's page "
                      "clearing otherwise lands in whichever window is open)."]
    if data.get("fill_error"):
        lines += ["", f"Filling the export failed: {data['fill_error']}"]
    lines += notes(data, "4k randread qd64, one round")
    table_rows = rows(data)
    lines += ["", *table(
        ["workload", "instructions / I/O", "IOPS"], "lrr",
        ([r["workload"], spread(r["ratio"]), spread(r["iops_ratio"])] for r in table_rows))]
    lines += ["", "## Where the instructions go", "",
              "Instructions per I/O (medians over the rounds), io_uring_enter calls per I/O "
              "(all processes) and the windows' IOPS.", ""]
    lines += table(["workload", "client", "total", "kernel", "server", "rest", "enters",
                    "IOPS"], "llrrrrrr",
                   ([r["workload"], c, fmt(s["total"]), fmt(s["kernel"]), fmt(s["server"]),
                     fmt(s["rest"]), fmt(s["enters"], ".2f"), fmt(s["iops"])]
                    for r in table_rows for c, s in r["clients"].items()))
    lines += ["", "Calls per I/O: `__schedule` is a switch of task; `switch_mm_irqs_off` a "
                  "switch of address space (another process's page tables). Under TCG the "
                  "latter empties the vCPU's software TLB, so what runs after it pays for "
                  "refilling it: that costs time, not instructions.", ""]
    lines += table(["workload", "client", *(f"`{f}`" for f in CALLS)], "llrr",
                   ([r["workload"], c, *(fmt(s["calls"][f], ".2f") for f in CALLS)]
                    for r in table_rows for c, s in r["clients"].items()))
    lines += ["", "## The kernel functions that differ most", "",
              "Instructions per I/O in each kernel function (the median over the rounds; "
              f"under {FUNCTION_FLOOR:g} in a round counts as 0 there), where aioublk's "
              "requests run the most more, and the most fewer, than nbd.ko's. "
              "`rep_movs_alternative` is the kernel's copy to and from user memory: TCG "
              "runs its `rep movsb` one byte per iteration, and counts each.", ""]
    for r in table_rows:
        cells = [[r["workload"], way, name, fmt(peer), fmt(ours), f"{ours - peer:+,.0f}"]
                 for way, fs in (("more", r["more"]), ("fewer", r["less"]))
                 for name, peer, ours in fs]
        lines += table(["workload", "aioublk runs", "function", "nbd.ko", "aioublk", "difference"],
                       "lllrrr", cells) + [""]
    errors: dict[str, str] = {}
    for x in data["runs"]:
        if x.get("error"):
            errors.setdefault(f"{x['server']} {x['workload']}", str(x["error"]))
    lines += errors_section(errors, "client/workload")
    lines += ["", f"Chart: `nbd_instructions.png`. Reproduce: `{command}` from the repository "
              "root (boots the guest under TCG with the plugin).", ""]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    table_rows = rows(data)
    work, speed = "instructions per I/O (above 1: more work)", "IOPS (below 1: slower)"
    values = {(r["workload"], s): statistics.median(v) if v else None
              for r in table_rows for s, v in ((work, r["ratio"]), (speed, r["iops_ratio"]))}
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(path, [r["workload"] for r in table_rows], [work, speed], values,
                 "aioublk -t nbd / nbd.ko (paired by round)",
                 f"NBD over a unix socket, with the TCG plugin counting\n{where}, "
                 f"{data['cpus']} CPUs, Linux {data['kernel']}, median of {data['rounds']} "
                 "round(s)")


def _timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous: filling the export and an aioublk add take minutes under TCG."""
    runs = len(QUICK if quick else WORKLOADS) * len(CLIENTS) * rounds
    return 1200 + rounds * len(CLIENTS) * 180 + runs * (runtime + 60)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=3, rounds=3, quick="4k randread qd64, one round",
                inner=("FOLDER", "OUT"))
    return counting_main(
        "nbd_instructions", ap, argv, report, plot,
        lambda args, runtime, rounds, quick: inner(Path(args[0]), runtime, rounds, quick,
                                                   Path(args[1])),
        _timeout, kublk=False)


if __name__ == "__main__":
    sys.exit(main())
