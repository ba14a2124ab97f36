"""bench/trees.py without a guest: its command line and what it hands the
guest, each tree's command, the pairing of new with old round by round, and
the report's table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import trees
from bench.common import ROOT


def dp(rnd: int, tree: str, device: str, workload: str, iops: float | None,
       error: str | None = None) -> dict[str, Any]:
    return {"round": rnd, "server": tree, "device": device, "workload": workload,
            "iops": iops, "error": error}


def qc(rnd: int, tree: str, kind: str, workload: str, qd: int, iops: float,
       c_share: float | None = None, cpu: float | None = None) -> dict[str, Any]:
    return {"round": rnd, "server": tree, "kind": kind, "workload": workload, "qd": qd,
            "queues": 1, "how": "time", "iops": iops, "error": None, "c_share": c_share,
            "cpu_us_per_io": cpu}


def data(runs: list[dict[str, Any]], rounds: int = 3) -> dict[str, Any]:
    return {"kernel": "7.0", "cpus": 2, "guest": True, "runtime": 3, "ramp": 1,
            "rounds": rounds, "quick": False, "image_size": 512 << 20, "complete": True,
            "runs": runs, "devices": [],
            "trees": {"old": {"path": "/src/old", "commit": "abc1234", "dirty": False},
                      "new": {"path": "/src/new", "commit": "def5678", "dirty": True}},
            "command": ".venv/bin/python -m bench.trees --baseline /src/old"}


def test_each_tree_runs_its_own_aioublk_and_nothing_else() -> None:
    cmd = trees.aioublk("/src/old")
    assert cmd[:2] == ["env", "PYTHONPATH=/src/old"]
    assert cmd[3:] == ["-P", "-m", "aioublk"]  # -P: not the working folder's aioublk


def test_a_tree_without_its_extensions_is_refused(tmp_path: Path) -> None:
    (tmp_path / "aioublk").mkdir()
    with pytest.raises(SystemExit, match="build its C extensions"):
        trees.describe(tmp_path)


def test_a_tree_whose_command_imports_another_aioublk_is_refused(tmp_path: Path) -> None:
    (tmp_path / "aioublk").mkdir()
    (tmp_path / "aioublk" / "_uring.abi3.so").touch()  # but no package there
    with pytest.raises(SystemExit, match="imports aioublk from"):
        trees.describe(tmp_path)


def test_this_tree_describes_itself() -> None:
    if not list((ROOT / "aioublk").glob("_uring*.so")):
        pytest.skip("the C extension is not built here")
    got = trees.describe(ROOT)
    assert got["path"] == str(ROOT.resolve()) and got["commit"] != "?"


def test_a_run_needs_a_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        trees.main([])
    assert e.value.code == 2
    assert "--baseline DIR" in capsys.readouterr().err


def test_the_guest_gets_the_options_and_the_baseline(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    asked: dict[str, Any] = {}

    def run_guest(module: str, args: list[str], timeout: float,
                  **kw: Any) -> tuple[int, dict[str, Any]]:
        asked.update(module=module, args=args, timeout=timeout, **kw)
        got = data([dp(1, "old", "null", "4k randread qd1", 100.0),
                    dp(1, "new", "null", "4k randread qd1", 110.0)], rounds=1)
        del got["trees"], got["command"]
        return 0, got

    monkeypatch.setattr(trees, "run_guest", run_guest)
    monkeypatch.setattr(trees, "describe", lambda tree: {"path": f"/abs/{tree}",
                                                         "commit": "c", "dirty": False})
    monkeypatch.setattr(trees.compileall, "compile_dir", lambda *a, **kw: True)
    monkeypatch.setattr(trees, "plot", lambda d, path: None)
    assert trees.main(["--baseline", "base", "--rounds", "1", "--runtime", "2",
                       "--timeout", "99", "--cpus", "4", "--out", str(tmp_path)]) == 0
    assert asked["module"] == "bench.trees"
    assert asked["args"] == ["--runtime=2", "--rounds=1"]
    assert asked["inner"] == ["/abs/base"] and asked["kublk"] is False
    assert (asked["timeout"], asked["cpus"]) == (99, 4)
    text = (tmp_path / "trees.md").read_text()
    assert json.loads((tmp_path / "trees.json").read_text())["host_load"]["samples"] == 2
    assert "`.venv/bin/python -m bench.trees --baseline base --runtime=2 --rounds=1 " \
           "--cpus=4`" in text
    assert "| null, 4k randread qd1 | 100 | 110 | 1.10 (1.10 – 1.10) | — |" in text


def test_quick_is_one_round_of_short_runs() -> None:
    assert trees.guest_options(2, 1, True) == ["--runtime=2", "--rounds=1", "--quick"]
    assert trees.guest_timeout(2, 1, True) < trees.guest_timeout(3, 3, False) < 4 * 3600


def test_new_is_paired_with_old_round_by_round() -> None:
    """Old is faster in round 1, new in round 2 (the host got slower in between
    for both): the per-round ratios show it, the medians alone would not."""
    runs = [dp(1, "old", "loop", "4k randread qd64", 200.0),
            dp(1, "new", "loop", "4k randread qd64", 190.0),
            dp(2, "new", "loop", "4k randread qd64", 105.0),
            dp(2, "old", "loop", "4k randread qd64", 100.0),
            qc(1, "old", "backing", "4k randread", 64, 50.0, c_share=0.0, cpu=30.0),
            qc(1, "new", "backing", "4k randread", 64, 50.0, c_share=0.0, cpu=33.0),
            qc(2, "new", "backing", "4k randread", 64, 40.0, c_share=0.1),
            qc(2, "old", "backing", "4k randread", 64, 40.0, c_share=0.2)]
    got = trees.rows(data(runs, rounds=2))
    assert [r.label for r in got] == ["loop, 4k randread qd64", "qcow2 backing, 4k randread qd64"]
    loop, backing = got
    assert loop.ratios == [0.95, 1.05]
    assert (loop.old, loop.new) == (150.0, 147.5)
    assert loop.c_share == {"old": None, "new": None}
    assert backing.ratios == [1.0, 1.0]
    assert backing.c_share == pytest.approx({"old": 0.1, "new": 0.05})
    assert backing.cpu == {"old": 30.0, "new": 33.0}  # the rounds that have it


def test_the_report_has_a_row_each_the_trees_and_the_errors() -> None:
    runs = [dp(1, "old", "null", "4k randread qd1", 100.0),
            dp(1, "new", "null", "4k randread qd1", 90.0),
            dp(2, "new", "null", "4k randread qd1", 100.0),
            dp(2, "old", "null", "4k randread qd1", 100.0),
            dp(1, "old", "null", "4k randwrite qd64", 100.0),
            dp(1, "new", "null", "4k randwrite qd64", None, error="add exit 1: no")]
    d = data(runs, rounds=2)
    d["devices"] = [{"round": 1, "kind": "empty", "server": "new", "check": "exit 3: leak"}]
    text = trees.report(d, d["command"])
    assert "- old: `/src/old` at abc1234\n" in text
    assert "- new: `/src/new` at def5678 with uncommitted changes" in text
    assert "| null, 4k randread qd1 | 100 | 95 | 0.95 (0.90 – 1.00) | — | — | — | — |" in text
    assert "| null, 4k randwrite qd64 | 100 | — | — | — | — | — | — |" in text
    assert "All rows, geometric mean of new / old: 0.950." in text
    assert "- new null, 4k randwrite qd64: `add exit 1: no`" in text
    assert "- new qcow2 empty check: `exit 3: leak`" in text


def test_the_hosts_load_is_sampled_while_the_guest_runs() -> None:
    with trees.HostLoad(every=0.01) as host:
        time.sleep(0.1)
    got = host.summary()
    assert got["samples"] >= 3 and got["max"] >= got["median"] >= 0


def test_a_busy_host_is_said() -> None:
    assert trees.load_note(None) == []
    quiet = trees.load_note({"cpus": 2, "median": 0.5, "max": 1.5, "samples": 30})
    assert "median 0.5, at most 1.5, on 2 CPUs." in quiet[1] and "Busy" not in quiet[1]
    busy = trees.load_note({"cpus": 2, "median": 6.0, "max": 11.1, "samples": 30})
    assert "**Busy host**" in busy[1]
