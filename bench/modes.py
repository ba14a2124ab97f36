"""aioublk beside kublk across I/O modes, targets and workloads, in one guest run.

    python -m bench.modes [--runtime 5] [--rounds 3] [--quick]

For the null and loop targets and each mode (per-I/O, batch, batch with
auto buffer registration, batch with zero copy) each server adds one device
(1 queue, depth 128) and fio runs five workloads on it (4k random read and
write at iodepth 1 and 64, 128k sequential read at iodepth 16; io_uring,
O_DIRECT). kublk and aioublk alternate for every target/mode, the first of
them swapping every round, so that drift in the emulated guest hits both; a
row's **paired** ratio is the median of each round's own aioublk / kublk. A
second part compares 1 and 2 queues (batch mode, null target, two fio jobs).
A server that cannot add a device in some mode gets its error recorded and
the run goes on.

The guest only writes JSON; the host turns it into ``bench/results/modes.md``
and ``modes.png`` (matplotlib: ``pip install -e .[bench]``). Absolute numbers
under software emulation mean little; the aioublk/kublk ratio is the result.
``--quick`` is a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    fmt,
    footer,
    grouped_bars,
    load,
    median,
    notes,
    paired,
    paired_ratios,
    parser,
    publish,
    ratio,
    run,
    run_guest,
    setup_line,
    spread,
    swapped,
    table,
)

SERVERS = ("kublk", "aioublk")
TARGETS = ("null", "loop")
# Mode flags per server: aioublk picks batch by itself unless told, kublk is per-I/O by default.
MODES: dict[str, dict[str, list[str]]] = {
    "per-io": {"kublk": [], "aioublk": ["--no-batch"]},
    "batch": {"kublk": ["-b"], "aioublk": ["-b"]},
    "batch+auto_zc": {"kublk": ["-b", "--auto_zc"], "aioublk": ["-b", "--auto_zc"]},
    "batch+z": {"kublk": ["-b", "-z"], "aioublk": ["-b", "-z"]},
}
# name -> (fio arguments, which side of fio's job report holds the IOPS)
WORKLOADS: dict[str, tuple[list[str], str]] = {
    "4k randread qd1": (["--rw=randread", "--bs=4k", "--iodepth=1"], "read"),
    "4k randread qd64": (["--rw=randread", "--bs=4k", "--iodepth=64"], "read"),
    "4k randwrite qd1": (["--rw=randwrite", "--bs=4k", "--iodepth=1"], "write"),
    "4k randwrite qd64": (["--rw=randwrite", "--bs=4k", "--iodepth=64"], "write"),
    "128k read qd16": (["--rw=read", "--bs=128k", "--iodepth=16"], "read"),
}
#: workloads other benchmarks run that bench.modes does not
MORE_WORKLOADS: dict[str, tuple[list[str], str]] = {
    "128k write qd16": (["--rw=write", "--bs=128k", "--iodepth=16"], "write"),
}
SCALING_WORKLOAD = "4k randread qd64"
SCALING_FIO = ["--numjobs=2", "--group_reporting"]
RAMP = 1
BACKING_SIZE = 1 << 30


def _fio(dev: str, workload: str, runtime: int,
         extra: list[str]) -> tuple[float | None, str | None]:
    args, side = WORKLOADS[workload] if workload in WORKLOADS else MORE_WORKLOADS[workload]
    out, err = run(["fio", "--name=w", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
                     *args, *extra, "--time_based", f"--runtime={runtime}",
                     f"--ramp_time={RAMP}", "--output-format=json"],
                    timeout=runtime + RAMP + 120)
    if err:
        return None, f"fio {err}"
    try:
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return float(job[side]["iops"]), None
    except (ValueError, KeyError, IndexError) as e:
        return None, f"fio output unreadable: {e!r}"


def _backing_file() -> dict[str, object]:
    """A 1 GiB guest-RAM file, preferring a folder that accepts O_DIRECT.

    kublk opens its loop file with O_DIRECT and fails where that is refused;
    aioublk falls back to buffered I/O. The file is allocated up front so
    that reads hit real pages, not holes, whichever server goes first.
    """
    folders = [f for f in ("/tmp", "/dev/shm") if os.access(f, os.W_OK)]
    if not folders:
        raise SystemExit("no writable folder for the loop target's backing file")
    for folder in folders:
        path = os.path.join(tempfile.mkdtemp(dir=folder), "loop.img")
        with open(path, "wb") as f:
            f.truncate(BACKING_SIZE)
            try:
                os.posix_fallocate(f.fileno(), 0, BACKING_SIZE)
            except OSError:
                pass  # a sparse file still works, only less evenly for the first reader
        try:
            os.close(os.open(path, os.O_RDWR | os.O_DIRECT))
            o_direct = True
        except OSError:
            o_direct = False
        if o_direct or folder == folders[-1]:  # else try the next folder
            fstype, _ = run(["stat", "-f", "-c", "%T", path], timeout=10)
            return {"path": path, "fs": fstype.strip(), "o_direct": o_direct}
        os.unlink(path)
    raise AssertionError("unreachable")


def _add(cmd: list[str], args: list[str]) -> tuple[str | None, str | None]:
    """(device id, None) or (None, error)."""
    out, err = run([*cmd, "add", *args], timeout=120)
    if err:
        return None, f"add {err}"
    if "dev id " not in out:
        return None, f"add printed no device id: {out.strip()!r}"
    dev_id = out.split("dev id ")[1].split(":")[0]
    node = f"/dev/ublkb{dev_id}"
    for _ in range(50):  # devtmpfs creates the node shortly after START_DEV
        if os.path.exists(node):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    return dev_id, None


def _device_runs(cmd: list[str], add_args: list[str], workloads: list[str], runtime: int,
                 fio_extra: list[str]) -> list[tuple[str, float | None, str | None]]:
    """Add one device, run each workload on it, delete it; log how long each step took."""
    t0 = time.monotonic()
    dev_id, err = _add(cmd, add_args)
    if dev_id is None:
        return [(w, None, err) for w in workloads]
    t1 = time.monotonic()
    runs = []
    try:
        for w in workloads:
            iops, err = _fio(f"/dev/ublkb{dev_id}", w, runtime, fio_extra)
            runs.append((w, iops, err))
    finally:
        t2 = time.monotonic()
        _, del_err = run([*cmd, "del", "-n", dev_id], timeout=120)
        if del_err:
            print(f"  del -n {dev_id} failed: {del_err}", flush=True)
        print(f"  {os.path.basename(cmd[-1])} {' '.join(add_args)}: add {t1 - t0:.1f} s, "
              f"fio {t2 - t1:.1f} s, del {time.monotonic() - t2:.1f} s", flush=True)
    return runs


def inner(kublk: str, runtime: int, rounds: int, quick: bool, out: Path) -> None:
    """Runs in the guest; rewrites `out` after every device so a crash keeps what was done."""
    servers = {"kublk": [kublk], "aioublk": [sys.executable, "-m", "aioublk"]}
    targets = ["null"] if quick else list(TARGETS)
    modes = ["per-io", "batch"] if quick else list(MODES)
    workloads = ["4k randread qd64"] if quick else list(WORKLOADS)
    start = time.monotonic()  # elapsed time in the log shows where a long run spends it
    release, _ = run(["uname", "-r"], timeout=10)
    data: dict[str, object] = {
        "kernel": release.strip(), "cpus": os.cpu_count(),
        "guest": os.environ.get("AIOUBLK_IN_GUEST") == "1", "runtime": runtime, "ramp": RAMP,
        "rounds": rounds, "quick": quick, "complete": False, "runs": [], "scaling": [],
    }
    backing = _backing_file() if "loop" in targets else None
    if backing:
        data["backing"] = backing
        print(f"loop backing file: {backing}", flush=True)
    runs, scaling = data["runs"], data["scaling"]
    assert isinstance(runs, list) and isinstance(scaling, list)

    def save() -> None:
        out.write_text(json.dumps(data))

    def log(what: str, iops: float | None, err: str | None) -> None:
        saved = f"{iops:,.0f} IOPS" if iops is not None else f"ERROR {err}"
        print(f"[{time.monotonic() - start:4.0f} s] {what} {saved}", flush=True)

    for r in range(rounds):
        for target in targets:
            files = [str(backing["path"])] if backing and target == "loop" else []
            for mode in modes:
                for server in swapped(SERVERS, r):
                    add_args = ["-t", target, "-q", "1", "-d", "128", *MODES[mode][server], *files]
                    for w, iops, err in _device_runs(servers[server], add_args, workloads,
                                                     runtime, []):
                        runs.append({"round": r + 1, "target": target, "mode": mode,
                                     "workload": w, "server": server, "iops": iops,
                                     "error": err})
                        log(f"round {r + 1}: {target:4} {mode:13} {w:17} {server:7}", iops, err)
                    save()
        for queues in ([] if quick else [1, 2]):
            for server in swapped(SERVERS, r):
                add_args = ["-t", "null", "-q", str(queues), "-d", "128", "-b"]
                for w, iops, err in _device_runs(servers[server], add_args, [SCALING_WORKLOAD],
                                                 runtime, SCALING_FIO):
                    scaling.append({"round": r + 1, "queues": queues, "workload": w,
                                    "server": server, "iops": iops, "error": err})
                    log(f"round {r + 1}: null -q {queues} batch numjobs 2 {server:7}", iops, err)
                save()
    data["complete"] = True
    save()


def _keys(records: list[dict[str, object]], *fields: str) -> list[tuple[object, ...]]:
    """Distinct field tuples in first-seen order (the order the guest ran them)."""
    return list(dict.fromkeys(tuple(x[f] for f in fields) for x in records))


def rows(data: dict[str, object]) -> list[dict[str, Any]]:
    """One row per (target, mode, workload): median IOPS of each server, the ratio of
    those medians and the paired ratio (the median of each round's own, and the
    cell that shows their range)."""
    runs = data["runs"]
    assert isinstance(runs, list)
    out = []
    for target, mode, workload in _keys(runs, "target", "mode", "workload"):
        key = {"target": target, "mode": mode, "workload": workload}
        k = median(runs, server="kublk", **key)
        a = median(runs, server="aioublk", **key)
        pairs = paired_ratios(runs, {**key, "server": "aioublk"}, {**key, "server": "kublk"})
        out.append({**key, "kublk": k, "aioublk": a, "ratio": ratio(a, k),
                    "paired": statistics.median(pairs) if pairs else None,
                    "spread": spread(pairs)})
    return out


def report(data: dict[str, object], command: str) -> str:
    runs, scaling = data["runs"], data["scaling"]
    assert isinstance(runs, list) and isinstance(scaling, list)
    lines = [
        "# aioublk vs kublk across modes, targets and workloads",
        "",
        f"{setup_line(data)}, {data['cpus']} CPUs, Linux {data['kernel']}. fio with io_uring, "
        f"O_DIRECT, {data['runtime']} s per workload after {data['ramp']} s ramp; median "
        f"of {data['rounds']} round(s). Each device has 1 queue of depth 128 unless stated; "
        "kublk and aioublk alternate device by device, kublk first in odd rounds and "
        "aioublk first in even ones; copy mode unless the mode says otherwise. Under "
        "emulation the absolute IOPS mean little: **the aioublk/kublk ratios are the "
        "result**.",
        "",
        "IOPS are medians over the rounds. **aioublk / kublk** divides those medians; "
        "**paired** is the median over the rounds of each round's own aioublk / kublk "
        "(the two ran back to back), which drift between rounds does not move, and "
        "the range of those. Each row compares the two servers in the same "
        "mode; `bench.dataplane` compares aioublk's defaults with kublk's better mode.",
    ]
    lines += notes(data, "null target, two modes, one workload, one round")
    lines += ["", *table(
        ["target", "mode", "workload", "kublk IOPS", "aioublk IOPS", "aioublk / kublk",
         "paired (min – max)"],
        "lllrrrr",
        ([r["target"], r["mode"], r["workload"], fmt(r["kublk"]), fmt(r["aioublk"]),
          fmt(r["ratio"], ".2f"), r["spread"]]
         for r in rows(data)))]
    if scaling:
        lines += ["", "## Queue scaling", "",
                  "null target, batch mode (`-b`), depth 128; fio 4k randread iodepth 64 with "
                  "`--numjobs=2 --group_reporting` (IOPS of both jobs together).", ""]
        cells = []
        for (queues,) in _keys(scaling, "queues"):
            k = median(scaling, server="kublk", queues=queues)
            a = median(scaling, server="aioublk", queues=queues)
            key = {"queues": queues}
            cells.append([queues, fmt(k), fmt(a), fmt(ratio(a, k), ".2f"),
                          fmt(paired(scaling, {**key, "server": "aioublk"},
                                     {**key, "server": "kublk"}), ".2f")])
        lines += table(["queues", "kublk IOPS", "aioublk IOPS", "aioublk / kublk", "paired"],
                       "rrrrr", cells)
    errors: dict[str, str] = {}
    for x in [*runs, *scaling]:
        if x["error"]:
            where = (x["server"], x.get("target", "null"), x.get("mode", f"-q {x.get('queues')}"))
            errors.setdefault(" ".join(map(str, where)), str(x["error"]))
    return "\n".join(lines + footer(errors, "server/target/mode", "modes.png", command))


def plot(data: dict[str, object], path: Path) -> None:
    """Grouped bars of the ratio: one group per workload, one bar per target+mode."""
    table = rows(data)
    series = list(dict.fromkeys(f"{r['target']} {r['mode']}" for r in table))
    where = "QEMU TCG" if data["guest"] else "host"
    grouped_bars(
        path, list(dict.fromkeys(str(r["workload"]) for r in table)), series,
        {(str(r["workload"]), f"{r['target']} {r['mode']}"): r["paired"]
         for r in table},
        "aioublk IOPS / kublk IOPS, paired by round",
        f"aioublk / kublk IOPS\n{where}, {data['cpus']} CPUs, Linux {data['kernel']}, "
        f"median of {data['rounds']} round(s)",
        lines=[(1.0, "black", "-"), (0.5, "grey", "--")], height=5.5, per_group=2.2,
        fontsize=10, legend={"ncol": 4, "loc": "upper center", "bbox_to_anchor": (0.5, -0.08)})


def _guest_timeout(runtime: int, rounds: int, quick: bool) -> float:
    """Generous: a busy host makes TCG very slow (an aioublk add+del took ~60 s in a
    smoke run), but a hung guest must not hold the machine forever."""
    devices = 4 if quick else len(TARGETS) * len(MODES) * 2 + 4
    fio_runs = 4 if quick else len(TARGETS) * len(MODES) * 2 * len(WORKLOADS) + 4
    return 600 + rounds * (devices * 120 + fio_runs * (runtime + RAMP + 30))


def command(data: dict[str, object]) -> str:
    """The command a report names: the run's own, else the default one."""
    return str(data.get("command") or ".venv/bin/python -m bench.modes"
               + (" --quick" if data.get("quick") else ""))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, runtime=5, rounds=None, rounds_help="default 3",
                quick="null target, per-io and batch, 4k randread qd64, 1 round of 2 s")
    ns = ap.parse_args(argv)
    if ns.report:
        saved = load(ns.report)
        return publish("modes", saved, report(saved, command(saved)), plot, out=ns.out)
    runtime = ns.runtime or (2 if ns.quick else 5)
    rounds = ns.rounds or (1 if ns.quick else 3)
    if ns.inner:
        inner(ns.inner[0], runtime, rounds, ns.quick, Path(ns.inner[1]))
        return 0
    argv = ["--runtime", str(runtime), "--rounds", str(rounds), *(["--quick"] if ns.quick else [])]
    code, data = run_guest("bench.modes", argv, _guest_timeout(runtime, rounds, ns.quick))
    if data is None:
        return 1
    data["command"] = command(data) + (f" --runtime {runtime} --rounds {rounds}"
                                       if ns.runtime or ns.rounds else "")
    return publish("modes", data, report(data, command(data)), plot, code, ns.out)


if __name__ == "__main__":
    sys.exit(main())
