"""bench/vm.py's analysis on synthetic results (no guest): each row and file-level
phase takes qemu-nbd's better AIO setting, ratios are paired within the round,
the goals are judged on them, and failed checks and compares show in the report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench import vm
from bench.qcow2 import AIOUBLK, RANDREAD
from bench.vm import COW

IO_URING, NATIVE = "qemu-nbd io_uring", "qemu-nbd native"


def run(rnd: int, server: str, kind: str, workload: str, qd: int, iops: float,
        queues: int = 1, **extra: object) -> dict[str, Any]:
    return {"round": rnd, "server": server, "kind": kind, "workload": workload, "qd": qd,
            "queues": queues, "iops": iops, "error": None, "connections": 1, **extra}


def phase(rnd: int, server: str, name: str, seconds: float | None,
          **extra: object) -> dict[str, Any]:
    return {"round": rnd, "server": server, "phase": name, "seconds": seconds, "error": None,
            **extra}


def device(rnd: int, server: str, kind: str, **extra: object) -> dict[str, Any]:
    return {"round": rnd, "kind": kind, "server": server, "queues": 1, "connections": 1,
            "attach_s": 1.0, "error": None, "rows": "4k randread qd64", **extra}


def data(runs: list[dict[str, Any]], files: Sequence[dict[str, Any]] = (),
         devices: Sequence[dict[str, Any]] = (), rounds: int = 3) -> dict[str, Any]:
    return {"format": vm.FORMAT, "kernel": "7.0", "cpus": 4, "guest": True, "runtime": 5,
            "ramp": 1, "rounds": rounds, "quick": False, "base_size": 1 << 30,
            "storage": {"path": "/dev/shm/x", "fs": "tmpfs"}, "qemu_nbd": "qemu-nbd 7.2",
            "fio": "fio-3.33", "complete": True, "runs": runs, "files": list(files),
            "devices": list(devices),
            "bases": {"compressed_bytes": 600 << 20},
            "fs": {"size": 512 << 20, "tree": ["/usr/lib/python3.11"], "tree_files": 4000,
                   "tree_bytes": 100 << 20, "install": ["/usr/lib/python3.11"],
                   "archive_files": 1400, "archive_bytes": 50 << 20, "base_bytes": 60 << 20}}


def test_the_plan_gives_a_fresh_overlay_where_a_row_writes() -> None:
    """Reads share one overlay and are compared after; each COW row has its own."""
    specs = vm.plan(quick=False)
    for spec in specs:
        writes = [s for s in spec.steps if s.workload == COW]
        assert len(writes) <= 1 and (not writes or spec.steps == writes)
        assert spec.read_only == (not writes)
    assert {(s.kind, st.workload, st.qd, st.queues) for s in specs for st in s.steps} \
        >= set(vm.TARGETS)
    assert all(s.steps for s in vm.plan(quick=True)) and len(vm.plan(quick=True)) < len(specs)


def test_each_row_is_paired_per_round_against_its_better_aio_setting() -> None:
    """io_uring is the better setting on the compressed base's reads, native on
    COW writes: each row's ratios are those of its own best, round by round."""
    runs = []
    for rnd, (uring_r, native_r, uring_w, native_w) in enumerate(
            [(100, 90, 50, 60), (100, 200, 50, 70), (110, 95, 55, 65)], 1):
        runs += [run(rnd, IO_URING, "compressed", RANDREAD, 64, uring_r),
                 run(rnd, NATIVE, "compressed", RANDREAD, 64, native_r),
                 run(rnd, AIOUBLK, "compressed", RANDREAD, 64, 200),
                 run(rnd, IO_URING, "raw", COW, 64, uring_w),
                 run(rnd, NATIVE, "raw", COW, 64, native_w),
                 run(rnd, AIOUBLK, "raw", COW, 64, 130)]
    got = {g.label: g for g in vm.goals(data(runs))}
    reads = got["compressed qcow2 base: 4k randread qd64"]
    assert reads.ratios == [2.0, 2.0, 200 / 110] and reads.value == 2.0 and reads.met == "yes"
    writes = got["raw base: 4k COW randwrite qd64"]
    assert writes.ratios == [130 / 60, 130 / 70, 2.0] and writes.value == 2.0
    text = vm.report(data(runs), "cmd")
    assert "| compressed qcow2 base | 4k randread qd64 | 100 | 95 | io_uring | 1 | 200 | " \
           "2.00 | 1.82 – 2.00 |" in text
    assert "| raw base | 4k COW randwrite qd64 | 50 | 65 | native |" in text


def goal_runs(scale: float) -> list[dict[str, Any]]:
    """Two rounds of every goal row, aioublk `scale` times qemu-nbd's IOPS."""
    runs = []
    for rnd in (1, 2):
        for kind, workload, qd, _ in vm.TARGETS:
            nbd = 100.0 * rnd
            runs += [run(rnd, IO_URING, kind, workload, qd, nbd),
                     run(rnd, AIOUBLK, kind, workload, qd, nbd * scale)]
    return runs


@pytest.mark.parametrize("scale,met", [(2.5, {"yes"}), (1.1, {"yes", "no"}), (0.9, {"no"})])
def test_goals_are_judged_on_the_paired_values(scale: float, met: set[str]) -> None:
    got = vm.goals(data(goal_runs(scale), rounds=2))
    rows = [g for g in got if not g.label.startswith("file level")]
    assert len(rows) == len(vm.TARGETS) == 11
    assert all(g.value == pytest.approx(scale) for g in rows)
    assert {g.met for g in rows} == met
    assert {g.label: g.target for g in rows}["raw base: 4k randread qd1"] == 1.5
    assert {g.label: g.target for g in rows}["raw base, extended_l2 overlay: 4k COW randwrite "
                                             "qd64"] == 2.0
    text = vm.report(data(goal_runs(scale), rounds=2), "cmd")
    assert f"| compressed qcow2 base: 1M read qd16 | {scale:.2f} | {scale:.2f} – {scale:.2f} " \
           f"| ≥ 1.2 | {'yes' if scale >= 1.2 else 'no'} |" in text
    assert "| file level: boot-like read (qemu-nbd time / aioublk time) | — | — | > 1.0 | — |" \
        in text


def test_file_phases_pair_times_against_the_faster_setting() -> None:
    """Time, not IOPS: the better setting has the lower median, and the ratio is
    its time / aioublk's (above 1 when aioublk is faster); exactly 1.0 is not
    a pass, the goal being strictly above."""
    files = []
    for rnd, (uring, native, mine) in enumerate([(30, 20, 10), (40, 25, 25), (30, 22, 11)], 1):
        files += [phase(rnd, IO_URING, "read", uring), phase(rnd, NATIVE, "read", native),
                  phase(rnd, AIOUBLK, "read", mine, c_share=0.5, cpu_us_per_io=12.0),
                  phase(rnd, IO_URING, "write", 10), phase(rnd, NATIVE, "write", 10),
                  phase(rnd, AIOUBLK, "write", 10)]
    files.append(phase(4, AIOUBLK, "read", None, error="mount exit 32: wrong fs type"))
    [read, write] = vm.file_rows(data([], files))
    assert read.best == NATIVE and read.nbd == {IO_URING: 30, NATIVE: 22}
    assert read.ratios == [2.0, 1.0, 2.0] and read.paired == 2.0 and read.aioublk == 11
    got = {g.label: g for g in vm.goals(data([], files))}
    assert got["file level: boot-like read (qemu-nbd time / aioublk time)"].met == "yes"
    flat = got["file level: install-like write (qemu-nbd time / aioublk time)"]
    assert flat.value == 1.0 and flat.met == "no"
    text = vm.report(data([], files), "cmd")
    assert "| boot-like read | 30.0 | 22.0 | native | 11.0 | 2.00 | 1.00 – 2.00 |" in text
    assert "| file level: boot-like read | 0.500 | 12.0 |" in text
    assert "- aioublk files: `mount exit 32: wrong fs type`" in text


def test_failed_checks_and_compares_show_in_the_report() -> None:
    devices = [
        device(1, AIOUBLK, "raw", check=["No errors were found on the image."], check_ok=True,
               compare="Images are identical.", compare_ok=True),
        device(1, IO_URING, "compressed", check=["No errors were found on the image."],
               check_ok=True, compare="exit 1: Content mismatch at offset 4096!",
               compare_ok=False),
        device(1, AIOUBLK, "extl2", rows="4k COW randwrite qd64",
               check="exit 2: 3 errors were found on the image.", check_ok=False),
        device(1, NATIVE, "raw", error="qemu-img create exit 1: no space"),
    ]
    text = vm.report(data([], devices=devices), "cmd")
    assert "`qemu-img check` after every device: 2 of 3 passed" in text
    assert "must be identical): 1 of 2 passed" in text
    assert "| 1 | raw base | 4k randread qd64 | aioublk | 1 | 1.0 | pass | pass |" in text
    assert "| **FAIL**: exit 1: Content mismatch at offset 4096! |" in text
    assert "| 1 | raw base, extended_l2 overlay | 4k COW randwrite qd64 | aioublk | 1 | 1.0 | " \
           "**FAIL**: exit 2: 3 errors were found on the image. | — |" in text


def test_the_report_and_chart_render_from_a_runs_json(tmp_path: Path) -> None:
    files = [phase(r, s, p, 10.0) for r in (1, 2) for s in (IO_URING, AIOUBLK)
             for p in vm.PHASES]
    path = tmp_path / "in.json"
    path.write_text(json.dumps(data(goal_runs(2.0), files, rounds=2)))
    assert vm.main(["--report", str(path), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "vm.md").read_text()
    assert text.startswith("# vm: qcow2 overlays on a base") and "## Goals" in text
    assert "Reproduce: `.venv/bin/python -m bench.vm --runtime=5 --rounds=2`" in text


def test_base_sizes_are_whole_mib() -> None:
    assert vm._size("1G") == 1 << 30 and vm._size("64m") == 64 << 20
    assert vm._size(str(32 << 20)) == 32 << 20
    for bad in ("1.5G", "1T", "8M", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            vm._size(bad)
