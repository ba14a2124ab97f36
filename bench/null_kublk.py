"""aioublk's null target beside the kernel's C server kublk, in one guest run.

    python -m bench.null_kublk [--runtime 10] [--rounds 2]

Each round runs fio 4k random read at iodepth 64 (io_uring, O_DIRECT) against
a null device of kublk, then of aioublk (1 queue, depth 128, per-I/O path),
and the table reports the median IOPS of each and their ratio. Absolute
numbers under software emulation mean little; the ratio is the result.
Writes ``bench/results/null_kublk.md`` and ``.json``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import load, parser, publish, ratio_bars, run_guest, table


def _sh(cmd: list[str], timeout: float = 120) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p.stdout


def _fio_iops(dev: str, runtime: int, cwd: str) -> float:
    out = _sh(["fio", "--name=r", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
               "--rw=randread", "--bs=4k", "--iodepth=64", "--time_based",
               f"--runtime={runtime}", "--ramp_time=2", "--output-format=json"],
              timeout=runtime + 60)
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["read"]["iops"])


def inner(kublk: str, runtime: int, rounds: int, out: Path) -> None:
    """Runs in the guest."""
    servers = {
        "kublk": [kublk],
        "aioublk": [sys.executable, "-m", "aioublk"],
    }
    iops: dict[str, list[float]] = {name: [] for name in servers}
    work = tempfile.mkdtemp()
    for r in range(rounds):
        for name, cmd in servers.items():
            listing = _sh([*cmd, "add", "-t", "null", "-q", "1", "-d", "128"])
            dev_id = listing.split("dev id ")[1].split(":")[0]
            time.sleep(0.5)
            try:
                value = _fio_iops(f"/dev/ublkb{dev_id}", runtime, work)
            finally:
                _sh([*cmd, "del", "-n", dev_id])
            iops[name].append(value)
            print(f"round {r + 1}: {name} null 4k randread qd64: {value:,.0f} IOPS", flush=True)
    release = _sh(["uname", "-r"]).strip()
    out.write_text(json.dumps({"kernel": release, "runtime": runtime, "iops": iops}))


def report(data: dict[str, object]) -> str:
    iops = data["iops"]
    assert isinstance(iops, dict)
    a = statistics.median(iops["aioublk"])
    k = statistics.median(iops["kublk"])
    return "\n".join([
        "# null target: aioublk vs kublk",
        "",
        f"One guest run (QEMU TCG, 2 vCPUs, Linux {data['kernel']}); fio 4k randread, "
        f"iodepth 64, io_uring, O_DIRECT, {data['runtime']} s per run after 2 s ramp; "
        "1 queue, depth 128, per-I/O FETCH/COMMIT path, copy mode. Median of "
        f"{len(iops['aioublk'])} alternating rounds.",
        "",
        *table(["server", "IOPS (median)", "runs", "aioublk / kublk"], "lrlr",
               [["kublk (C)", f"{k:,.0f}", ", ".join(f"{v:,.0f}" for v in iops["kublk"]), ""],
                ["aioublk", f"{a:,.0f}", ", ".join(f"{v:,.0f}" for v in iops["aioublk"]),
                 f"{a / k:.2f}"]]),
        "",
        "Reproduce: `python -m bench.null_kublk` (boots the guest when the host has no "
        "ublk_drv; builds kublk from Debian sid's linux-source).",
        "",
    ])


def plot(data: dict[str, object], path: Path) -> None:
    """aioublk's IOPS over kublk's, per round and of the medians."""
    iops = data["iops"]
    assert isinstance(iops, dict)
    per_round = [(f"round {i + 1}", a / k, None)
                 for i, (a, k) in enumerate(zip(iops["aioublk"], iops["kublk"], strict=True))]
    medians = statistics.median(iops["aioublk"]) / statistics.median(iops["kublk"])
    ratio_bars(path, [*per_round, ("medians", medians, 1.0)], "aioublk / kublk IOPS",
               "null target, 4k randread qd64: aioublk over kublk")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=10, rounds=2)
    ns = ap.parse_args(argv)
    runtime = ns.runtime or 10
    if ns.report:
        saved = load(ns.report)
        return publish("null_kublk", saved, report(saved), plot, out=ns.out)
    if ns.inner:
        inner(ns.inner[0], runtime, ns.rounds, Path(ns.inner[1]))
        return 0
    code, data = run_guest("bench.null_kublk", ["--runtime", str(runtime), "--rounds",
                                                str(ns.rounds)], timeout=40 * 60.0)
    if data is None:
        return 1
    return publish("null_kublk", data, report(data), plot, code=code, out=ns.out)


if __name__ == "__main__":
    sys.exit(main())
