"""-t rbd beside rbd-nbd, on the same Ceph cluster, in one guest run (issue #14).

    python -m bench.rbd [--runtime 5] [--rounds 2] [--quick]

A throwaway one-node cluster (``tools.ceph``: one monitor, one memstore
OSD on 127.0.0.1, so the image lives in the guest's RAM) holds a 512 MiB image,
written in full first so reads are not of absent objects. Two librbd clients of
it, one at a time (each takes the image's exclusive lock), scheduler ``none``:

1. ``aioublk add -t rbd rbd/bench -q 1 -d 128``: ublk, then librbd's asynchronous
   calls on the queue's loop;
2. ``rbd-nbd map rbd/bench``: librbd in rbd-nbd's threads, served to nbd.ko over a
   socket pair (Ceph's own userspace block device).

fio io_uring O_DIRECT: bench.nbd's workloads (4k randread and randwrite at iodepth
64, 128k sequential read and write at iodepth 16). Who goes first swaps every
round; the goal is aioublk / rbd-nbd ≥ 1 on the paired ratio. The guest only
writes JSON; the host writes ``bench/results/rbd.md``, ``.json`` and ``rbd.png``.
``--quick`` (4k randread, 2 s runs) is a smoke test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.common import footer, guest_main, notes, record, run, setup_line, swapped
from bench.modes import RAMP
from bench.nbd import (
    QUICK,
    WORKLOADS,
    Row,
    plot_ratios,
    ratio_table,
    rows,
    workload_runs,
)
from bench.qcow2 import AioublkServer

IMAGE, IMAGE_MIB = "rbd/bench", 512
CLIENTS = ("rbd-nbd", "aioublk")
DEVICE = "rbd"  # the one "transport" of bench.nbd's rows


class RbdNbd:
    """``rbd-nbd map`` of the image, unmapped by ``detach``."""

    def __init__(self, conf: str) -> None:
        self.conf = conf
        self.dev: str | None = None

    def attach(self, image: str) -> tuple[str | None, str | None]:
        out, err = run(["rbd-nbd", "map", "-c", self.conf, image], timeout=300)
        if err:
            return None, f"rbd-nbd map {err}"
        self.dev = out.strip().splitlines()[-1]
        return self.dev, None

    def detach(self) -> str | None:
        assert self.dev is not None
        _, err = run(["rbd-nbd", "unmap", "-c", self.conf, self.dev], timeout=120)
        self.dev = None
        return err


def _client_runs(client: str, conf: str, workloads: list[str],
                 runtime: int) -> list[tuple[str, float | None, str | None]]:
    """Attach one client to the image, run each workload on it, detach."""
    side: RbdNbd | AioublkServer = (
        RbdNbd(conf) if client == "rbd-nbd"
        else AioublkServer("rbd", ["--rbd-conf", conf, "-d", "128"]))
    return workload_runs(client, side, side.attach(IMAGE), workloads, runtime)


def inner(runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every client so a crash keeps what was done."""
    from tools.ceph import Cluster

    workloads = QUICK["workloads"] if quick else WORKLOADS
    start = time.monotonic()
    release, _ = run(["uname", "-r"], timeout=10)
    version, _ = run(["rbd", "--version"], timeout=30)
    run(["modprobe", "nbd"], timeout=60)
    runs: list[dict[str, object]] = []
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "ceph": version.strip(), "complete": False,
        "runs": runs,
    }
    with Cluster(memstore_bytes=(IMAGE_MIB + 512) << 20) as cluster:
        data["cluster_start_seconds"] = round(cluster.startup_seconds, 1)
        cluster.rbd("create", "--size", f"{IMAGE_MIB}M", IMAGE)
        cluster.rbd("bench", "--io-type", "write", "--io-size", "4M", "--io-pattern", "seq",
                    "--io-total", f"{IMAGE_MIB}M", IMAGE, timeout=1800)
        print(f"cluster up in {data['cluster_start_seconds']} s, {IMAGE} written", flush=True)
        for r in range(rounds):
            for client in swapped(CLIENTS, r):
                for w, iops, e in _client_runs(client, cluster.conf, workloads, runtime):
                    record(runs, start, r + 1, f"{w:17} {client:7}", iops, e,
                           device=DEVICE, workload=w, server=client)
                out.write_text(json.dumps(data))
    data["complete"] = True
    out.write_text(json.dumps(data))


def _rows(data: dict[str, object]) -> list[Row]:
    return rows(data, (DEVICE,), CLIENTS)


def report(data: dict[str, object], command: str) -> str:
    runs = data["runs"]
    assert isinstance(runs, list)
    lines = [
        "# -t rbd vs rbd-nbd, same Ceph cluster (issue #14)", "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}, {data['ceph']}. "
        "A one-node "
        f"cluster (one monitor, one memstore OSD, up in {data.get('cluster_start_seconds')} "
        f"s) holds `{IMAGE}`, {IMAGE_MIB} MiB written in full. Clients, one at a time: "
        "`aioublk add -t rbd rbd/bench -q 1 -d 128`, and `rbd-nbd map` (librbd in its "
        "threads, nbd.ko over a socket pair). Scheduler `none` on both. fio with io_uring, "
        f"O_DIRECT, {data['runtime']} s per workload after {data['ramp']} s ramp; median of "
        f"{data['rounds']} round(s), rbd-nbd first in odd rounds. Under emulation the "
        "absolute IOPS mean little: **the ratios are the result**.",
    ]
    lines += notes(data, "4k randread, one round")
    lines += ["", "IOPS are medians over the rounds; **paired** is the median of each "
              "round's own ratio: the goal is judged on it.", "",
              *ratio_table(_rows(data), "cluster", "rbd-nbd")]
    errors: dict[str, str] = {}
    for x in runs:
        if x["error"]:
            errors.setdefault(str(x["server"]), str(x["error"]))
    return "\n".join(lines + footer(errors, "client", "rbd.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    plot_ratios(_rows(data), path, "aioublk / rbd-nbd IOPS, paired by round (line: goal)",
                f"-t rbd vs rbd-nbd, one-node memstore cluster\nLinux {data['kernel']}, "
                f"median of {data['rounds']} round(s)")


def main(argv: list[str] | None = None) -> int:
    def timeout(rounds: int, quick: bool, runtime: int) -> float:
        attaches = rounds * len(CLIENTS)
        fio_runs = attaches * (1 if quick else len(WORKLOADS))
        return 1800 + attaches * 180 + fio_runs * (runtime + RAMP + 30)

    return guest_main("rbd", __doc__, argv, rounds=2, quick="4k randread, 2 s runs",
                      inner=inner, report=report, plot=plot, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
