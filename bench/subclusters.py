"""Allocating 4 KiB writes over a backing file, with and without extended L2
(subclusters): aioublk's qcow2 engine beside ``qemu-img bench``, on the host.

    python -m bench.subclusters [--rounds 3] [--quick]

Issue #26: subclusters exist to save the copy-on-write of a first write to
a cluster over a backing file (a 4 KiB write into a 64 KiB cluster copies
nothing with them, 60 KiB without). Each run gets a fresh overlay (64 KiB
clusters, ``extended_l2=on`` or ``off``) over one 1 GiB raw backing file
full of data (in the page cache after the first run), and writes COUNT
4 KiB blocks at qemu-img bench's offsets, ``(i * STEP) % size`` with STEP
7919 blocks: nearly every write is the first to its cluster.

- qemu-img: ``qemu-img bench -f qcow2 -t none -i AIO -w -c COUNT -d DEPTH
  -s 4096 -S STEP`` for AIO in io_uring, native, threads; each row is judged
  against the fastest of them in that round;
- aioublk: ``Qcow2Image`` in a fresh process, the task-free path a ublk
  queue takes (``bench.qcow2_host``'s driver), then a flush.

Rounds alternate the two sides' order; ratios are paired per round, then
the median. Writes ``bench/results/subclusters.md``, ``.json``, ``.png``.
Host only: the guest's qemu-nbd comparison (``bench.qcow2``) has no
subcluster row yet.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Data,
    fmt,
    grouped_bars,
    load,
    median,
    paired,
    parser,
    publish,
    swapped,
    table,
)
from bench.common import run as _sh
from bench.qcow2_host import AIO_MODES, STEP, engine_bench, qemu_img_bench

SIZE = 1 << 30
CLUSTER = 64 << 10
#: name -> (depth, count)
WORKLOADS = {"4k alloc randwrite qd64": (64, 12_000), "4k alloc randwrite qd1": (1, 3_000)}
LAYOUTS = ("extended_l2=on", "extended_l2=off")
QUICK_DIVISOR = 10


def _overlay(folder: str, layout: str) -> str:
    top = os.path.join(folder, "top.qcow2")
    if os.path.exists(top):
        os.unlink(top)
    _, err = _sh(["qemu-img", "create", "-q", "-f", "qcow2", "-o",
                  f"{layout},cluster_size={CLUSTER}", "-b", "base.raw", "-F", "raw", top],
                 timeout=60)
    if err:
        raise SystemExit(f"qemu-img create failed: {err}")
    return top


def run(folder: str, rounds: int, quick: bool) -> Data:
    base = Path(folder) / "base.raw"
    rnd = random.Random(1)
    with open(base, "wb") as f:
        for _ in range(SIZE >> 24):
            f.write(rnd.randbytes(1 << 24))
    version, _ = _sh(["qemu-img", "--version"], timeout=30)
    release, _ = _sh(["uname", "-r"], timeout=10)
    data: Data = {"kernel": release.strip(), "cpus": os.cpu_count(),
                  "qemu_img": version.splitlines()[0], "size": SIZE, "cluster": CLUSTER,
                  "step": STEP, "rounds": rounds, "quick": quick, "runs": []}
    runs: list[dict[str, Any]] = data["runs"]
    start = time.monotonic()
    for r in range(rounds):
        for name, (depth, count) in WORKLOADS.items():
            count //= QUICK_DIVISOR if quick else 1
            for layout in LAYOUTS:
                sides = [("qemu-img", aio) for aio in AIO_MODES] + [("aioublk", "start")]
                for who, how in swapped(sides, r):
                    top = _overlay(folder, layout)
                    res = (qemu_img_bench(top, how, True, depth, count, STEP) if who == "qemu-img"
                           else engine_bench(top, True, depth, count, STEP, how))
                    runs.append({"round": r + 1, "workload": name, "layout": layout,
                                 "who": f"{who} {how}", "count": count, **res})
                    shown = (f"{res['iops']:,.0f} IOPS" if res.get("iops")
                             else f"ERROR {res.get('error')}")
                    print(f"[{time.monotonic() - start:4.0f} s] round {r + 1}: {name} "
                          f"{layout} {who} {how}: {shown}", flush=True)
    return data


def _best_qemu(runs: list[dict[str, Any]], workload: str, layout: str) -> list[dict[str, Any]]:
    """qemu-img's best setting of each round, as records named ``qemu-img best``."""
    out = []
    for r in sorted({x["round"] for x in runs}):
        mine = [x for x in runs if x["round"] == r and x["workload"] == workload
                and x["layout"] == layout and x["who"].startswith("qemu-img")
                and x.get("iops")]
        if mine:
            best = max(mine, key=lambda x: x["iops"])
            out.append({**best, "who": "qemu-img best", "setting": best["who"]})
    return out


def rows(data: Data) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = data["runs"]
    out: list[dict[str, Any]] = []
    for workload in WORKLOADS:
        for layout in LAYOUTS:
            recs = runs + _best_qemu(runs, workload, layout)
            match: dict[str, object] = {"workload": workload, "layout": layout}
            out.append({
                **match,
                "aioublk": median(recs, **match, who="aioublk start"),
                "qemu": median(recs, **match, who="qemu-img best"),
                "ratio": paired(recs, {**match, "who": "aioublk start"},
                                {**match, "who": "qemu-img best"}),
            })
        on, off = out[-2], out[-1]
        for who in ("aioublk", "qemu"):
            on[f"{who}_gain"] = on[who] / off[who] if on[who] and off[who] else None
    return out


def report(data: Data, command: str) -> str:
    lines = ["# Subclusters: allocating 4 KiB writes over a backing file", "",
             f"On the host: {data['cpus']} CPUs, Linux {data['kernel']}, {data['qemu_img']}. "
             f"A fresh overlay per run ({data['cluster'] >> 10} KiB clusters) over a "
             f"{data['size'] >> 30} GiB raw backing file of random data; 4 KiB writes of "
             f"zeros at `(i * {data['step']}) % size`: nearly each the first to its cluster. "
             "qemu-img: `qemu-img bench -w -t none`, its best AIO setting of each round; "
             "aioublk: `Qcow2Image` in process on a ublk queue's ring, then a flush.",
             "", f"Median of {data['rounds']} round(s); ratio paired per round, the sides' "
             "order swapped each round."]
    if data.get("quick"):
        lines += ["", f"**Smoke run (`--quick`)**: COUNT / {QUICK_DIVISOR}; not a measurement."]
    lines += [""]
    lines += table(["workload", "layout", "aioublk IOPS", "qemu-img IOPS", "aioublk / qemu-img",
                    "aioublk on / off", "qemu-img on / off"], "llrrrrr",
                   [(r["workload"], r["layout"], fmt(r["aioublk"]), fmt(r["qemu"]),
                     fmt(r["ratio"], ".2f"), fmt(r.get("aioublk_gain"), ".2f"),
                     fmt(r.get("qemu_gain"), ".2f")) for r in rows(data)])
    lines += ["", "*on / off*: the same side's IOPS with extended L2 over without: what "
              "subclusters save.", ""]
    errors = {f"{x['who']} {x['workload']} {x['layout']}": x["error"]
              for x in data["runs"] if x.get("error")}
    if errors:
        lines += ["## Errors", ""] + [f"- {k}: `{v}`" for k, v in errors.items()] + [""]
    lines += [f"Chart: `bench/results/subclusters.png`. Reproduce: `{command}` from the "
              "repository root.", ""]
    return "\n".join(lines)


def plot(data: Data, path: Path) -> None:
    rs = rows(data)
    groups = [f"{r['workload'].split()[-1]} {r['layout'].split('=')[1]}" for r in rs]
    values = {(g, "aioublk / qemu-img"): r["ratio"] for g, r in zip(groups, rs, strict=True)}
    grouped_bars(path, groups, ["aioublk / qemu-img"], values, "ratio",
                 "allocating 4k writes over a backing file: extended_l2 on and off")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=None, rounds_help="default 3 (1 with --quick)",
                quick=f"COUNT / {QUICK_DIVISOR}, 1 round", inner=None)
    ns = ap.parse_args(argv)
    if ns.report:
        data = load(ns.report)
        return publish("subclusters", data, report(data, str(data["command"])), plot,
                       out=ns.out)
    rounds = ns.rounds or (1 if ns.quick else 3)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="subclusters.") as folder:
        data = run(folder, rounds, ns.quick)
    data["command"] = ".venv/bin/python -m bench.subclusters" + \
        (" --quick" if ns.quick else "") + (f" --rounds {rounds}" if ns.rounds else "")
    return publish("subclusters", data, report(data, data["command"]), plot, out=ns.out,
                   ok=not any(x.get("error") for x in data["runs"]))


if __name__ == "__main__":
    sys.exit(main())
