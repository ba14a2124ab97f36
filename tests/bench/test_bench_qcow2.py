"""bench/qcow2.py's analysis on synthetic results (no guest): the servers'
order swaps every round, each row picks its own qemu-nbd AIO setting, ratios
are paired within the round, and the goals come from those paired values."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench import qcow2
from bench.qcow2 import AIOUBLK, IN_PLACE, NULL, RANDREAD, RANDWRITE

IO_URING, NATIVE = "qemu-nbd io_uring", "qemu-nbd native"


def run(rnd: int, server: str, kind: str, workload: str, qd: int, iops: float,
        queues: int = 1, **extra: object) -> dict[str, Any]:
    return {"round": rnd, "server": server, "kind": kind, "workload": workload, "qd": qd,
            "queues": queues, "iops": iops, "error": None, "connections": queues, **extra}


def data(runs: list[dict[str, Any]], rounds: int = 3) -> dict[str, Any]:
    return {"format": qcow2.FORMAT, "kernel": "7.0", "cpus": 4, "guest": True, "runtime": 5,
            "ramp": 1, "rounds": rounds, "rows": "goals", "quick": False,
            "image_size": 2 << 30, "storage": {"path": "/dev/shm/x", "fs": "tmpfs"},
            "qemu_nbd": "qemu-nbd 7.2", "fio": "fio-3.33", "complete": True, "runs": runs,
            "devices": []}


def row(d: dict[str, Any], key: qcow2.Key) -> qcow2.Row:
    [r] = [r for r in qcow2.rows(d) if r.key == key]
    return r


def test_the_servers_order_swaps_every_round() -> None:
    order = ["nbd io_uring", "aioublk", "nbd native"]
    assert qcow2.round_order(order, 1) == order
    assert qcow2.round_order(order, 2) == order[::-1]
    assert qcow2.round_order(order, 3) == order


def test_each_row_takes_the_aio_setting_with_the_higher_median() -> None:
    """io_uring wins the reads' median though native wins one round; native
    wins the writes: each row is paired against its own best."""
    runs = []
    for rnd, (uring_r, native_r, uring_w, native_w) in enumerate(
            [(100, 90, 50, 60), (100, 200, 50, 70), (110, 95, 55, 65)], 1):
        runs += [run(rnd, IO_URING, "empty", RANDREAD, 64, uring_r),
                 run(rnd, NATIVE, "empty", RANDREAD, 64, native_r),
                 run(rnd, AIOUBLK, "empty", RANDREAD, 64, 200),
                 run(rnd, IO_URING, "empty", RANDWRITE, 64, uring_w),
                 run(rnd, NATIVE, "empty", RANDWRITE, 64, native_w),
                 run(rnd, AIOUBLK, "empty", RANDWRITE, 64, 130)]
    d = data(runs)
    reads, writes = row(d, ("empty", RANDREAD, 64, 1)), row(d, ("empty", RANDWRITE, 64, 1))
    assert reads.best == IO_URING and reads.nbd == {IO_URING: 100, NATIVE: 95}
    assert reads.ratios == [2.0, 2.0, 200 / 110]  # round 2 against io_uring too
    assert writes.best == NATIVE and writes.ratios == [130 / 60, 130 / 70, 2.0]
    assert writes.connections == 1


def test_the_ratio_is_the_median_of_the_rounds_own_ratios() -> None:
    """A slow round slows both servers: paired over the rounds, the ratio
    stays what each round says (the ratio of the medians would not)."""
    runs = []
    for rnd, (nbd, mine) in enumerate([(100, 300), (50, 150), (100, 200)], 1):
        runs += [run(rnd, IO_URING, "empty", RANDREAD, 1, nbd),
                 run(rnd, AIOUBLK, "empty", RANDREAD, 1, mine)]
    runs.append(run(4, AIOUBLK, "empty", RANDREAD, 1, 1000))  # no qemu-nbd that round
    r = row(data(runs, rounds=4), ("empty", RANDREAD, 1, 1))
    assert r.ratios == [3.0, 3.0, 2.0] and r.paired == 3.0
    assert r.aioublk == 250 and r.nbd[IO_URING] == 100  # medians: 2.5, not 3
    text = qcow2.report(data(runs, rounds=4), "cmd")
    assert "| empty | 4k randread qd1 | 100 | io_uring | 1 | 250 | 3.00 | 2.00 – 3.00 |" in text


def goal_runs(scale: float) -> list[dict[str, Any]]:
    """Two rounds of every goal row: aioublk `scale` times qemu-nbd on the
    qd64 rows, 1.2x at qd1; 2 queues 1.6x one; the null target 3x aioublk's
    allocating writes."""
    runs = []
    for rnd in (1, 2):
        for kind, w, qd in [("empty", RANDWRITE, 64), ("empty", RANDREAD, 64),
                            ("empty", IN_PLACE, 64), ("prealloc", RANDREAD, 64),
                            ("prealloc", RANDWRITE, 64), ("empty", RANDREAD, 1),
                            ("empty", RANDWRITE, 1), ("prealloc", RANDREAD, 1),
                            ("prealloc", RANDWRITE, 1)]:
            nbd = 100.0 * rnd
            runs += [run(rnd, IO_URING, kind, w, qd, nbd),
                     run(rnd, AIOUBLK, kind, w, qd, nbd * (scale if qd == 64 else 1.2))]
        for w in (RANDREAD, IN_PLACE):
            runs.append(run(rnd, AIOUBLK, "empty", w, 64, 100.0 * rnd * scale * 1.6,
                            queues=2))
        runs.append(run(rnd, NULL, NULL, RANDWRITE, 64, 300.0 * rnd * scale))
    return runs


@pytest.mark.parametrize("scale,met", [(3.5, True), (2.5, False)])
def test_goals_come_from_the_paired_values(scale: float, met: bool) -> None:
    got = {g.label: g for g in qcow2.goals(data(goal_runs(scale), rounds=2))}
    assert len(got) == 10
    geo = got["geomean: empty image, qd64: allocating randwrite, randread and in-place "
              "randwrite after the fill"]
    assert math.isclose(geo.value or 0, scale) and (geo.value >= geo.target) == met  # type: ignore[operator]
    assert math.isclose(got["prealloc image, 4k randread qd64"].value or 0, scale)
    for kind in ("empty", "prealloc"):
        for w in (RANDREAD, RANDWRITE):
            assert math.isclose(got[f"{kind} image, {w} qd1"].value or 0, 1.2)
    scaling = got["aioublk 2 queues / 1 queue, empty image, 4k randread qd64"]
    assert math.isclose(scaling.value or 0, 1.6) and scaling.target == 1.5
    null = got["aioublk allocating randwrite qd64 (empty image) / null target"]
    assert math.isclose(null.value or 0, 1 / 3) and null.target == 0.4
    text = qcow2.report(data(goal_runs(scale), rounds=2), "cmd")
    assert f"| {geo.label} | {scale:.2f} | ≥ 3.0 | {'yes' if met else 'no'} |" in text


def test_a_goal_row_missing_leaves_its_goal_open() -> None:
    runs = [r for r in goal_runs(3.5) if r["workload"] != IN_PLACE]
    got = {g.label: g.value for g in qcow2.goals(data(runs, rounds=2))}
    assert got["geomean: empty image, qd64: allocating randwrite, randread and in-place "
               "randwrite after the fill"] is None
    assert got["aioublk 2 queues / 1 queue, empty image, 4k randwrite in place qd64"] is None
    assert "| — | ≥ 1.5 | — |" in qcow2.report(data(runs, rounds=2), "cmd")


def test_diagnostics_are_the_deltas_per_io() -> None:
    before = {1: ("python3", 1_000_000), 2: ("iou-wrk-1", 0)}
    after = {1: ("python3", 3_000_000), 2: ("iou-wrk-1", 500_000), 3: ("iou-wrk-1", 500_000)}
    assert qcow2.cpu_fields(before, after, 1000) == {
        "cpu_us_per_io": 2.0, "iou_wrk_us_per_io": 1.0, "iou_wrk_threads": 2}
    assert qcow2.cpu_fields(before, after, None) == {}
    got = qcow2.dp_fields({"c_served": 10, "py_handed": 5, "wakes": 3},
                          {"c_served": 100, "py_handed": 15, "wakes": 12})
    assert got["c_share"] == 0.9 and got["wakes_per_c"] == 0.1
    assert qcow2.dp_fields({}, {})["c_share"] is None


def test_the_report_shows_the_diagnostics_medians() -> None:
    runs = []
    for rnd, share in enumerate([0.5, 0.9, 0.8], 1):
        runs += [run(rnd, IO_URING, "empty", RANDREAD, 1, 100, cpu_us_per_io=40.0,
                     iou_wrk_us_per_io=0.0),
                 run(rnd, AIOUBLK, "empty", RANDREAD, 1, 100, c_share=share,
                     wakes_per_c=1.0, cpu_us_per_io=30.0, iou_wrk_us_per_io=5.0)]
    text = qcow2.report(data(runs), "cmd")
    assert "| empty | 4k randread qd1 | 0.800 | 1.000 | 30.0 | 5.0 | 40.0 | 0.0 |" in text


def test_goal_rows_and_all_rows() -> None:
    goals, every = qcow2.plan("goals", False), qcow2.plan("all", False)
    keys = {kind: [s.key for s in steps] for kind, steps in goals.items()}
    assert keys["empty"] == [
        "4k randwrite qd1", "4k randwrite qd64", "1M write (fill) qd16", "4k randread qd1",
        "4k randread qd64", "4k randwrite in place qd1", "4k randwrite in place qd64",
        "4k randread qd64 2q", "4k randwrite in place qd64 2q"]
    assert keys["prealloc"] == keys["empty"][:-2]
    assert keys["backing"] == keys["extl2"] == ["4k randwrite qd1", "4k randwrite qd64"]
    assert all(len(every[k]) > len(goals[k]) for k in goals if k not in qcow2.BACKED)
    assert "512k rw qd64" in [s.key for s in every["prealloc"]]
    assert qcow2.guest_timeout(5, 3, "all", False, 3) > qcow2.guest_timeout(5, 3, "goals",
                                                                              False, 3)


def test_subclusters_pair_each_servers_extl2_with_its_backing_rows() -> None:
    runs = []
    for rnd, gain in enumerate([2.0, 3.0, 2.5], 1):
        for server, base in ((AIOUBLK, 100.0), (IO_URING, 50.0)):
            for qd in (1, 64):
                runs += [run(rnd, server, "backing", RANDWRITE, qd, base * rnd),
                         run(rnd, server, "extl2", RANDWRITE, qd,
                             base * rnd * (gain if server == AIOUBLK else 1.5))]
    text = qcow2.report(data(runs), "cmd")
    assert "| aioublk | 2.50 (2.00 – 3.00) | 2.50 (2.00 – 3.00) |" in text
    assert "| qemu-nbd io_uring | 1.50 (1.50 – 1.50) | 1.50 (1.50 – 1.50) |" in text
    assert "**backing** and **extl2**" in text


def test_write_through_pairs_its_rows_with_aioublks_own() -> None:
    runs = []
    for rnd, cost in enumerate([0.5, 0.6, 0.4], 1):
        for qd in (1, 64):
            runs += [run(rnd, AIOUBLK, "empty", RANDWRITE, qd, 1000.0 * rnd),
                     run(rnd, qcow2.WRITE_THROUGH, "empty", RANDWRITE, qd,
                         1000.0 * rnd * cost * (2 if qd == 1 else 1))]
    text = qcow2.report(data(runs), "cmd")
    assert "## Metadata write-through" in text
    assert "| 4k randwrite qd64 | 2,000 | 1,200 | 0.50 (0.40 – 0.60) | ≥ 0.5 | yes |" in text
    assert "| 4k randwrite qd1 | 2,000 | 2,400 | 1.00 (0.80 – 1.20) | — | — |" in text
    assert row(data(runs), ("empty", RANDWRITE, 64, 1)).aioublk == 2000.0  # (its own rows)
    assert "## Metadata write-through" not in qcow2.report(data(runs[:1]), "cmd")


def test_results_of_the_one_round_script_render_with_a_note(tmp_path: Path) -> None:
    old = {**data([]), "runs": [
        {"kind": "empty", "server": IO_URING, "workload": RANDREAD, "qd": 64, "iops": 100.0},
        {"kind": "empty", "server": AIOUBLK, "workload": RANDREAD, "qd": 64, "iops": 150.0}],
        "ceiling": {"4k randread qd64": 300.0}}
    del old["format"], old["rounds"]
    text = qcow2.report(old, "cmd")
    assert "Produced by an older bench/qcow2.py" in text
    assert "| empty | 4k randread qd64 | 100 | io_uring | — | 150 | 1.50 | 1.50 – 1.50 |" in text
    assert "| 4k randread qd64 | 300 | 0.50 |" in text
