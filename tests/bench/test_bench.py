"""Every benchmark's report and chart render from its committed results
(``--report JSON``, bench/common.py's scaffolding) without running anything: the
report is the very one committed, so a change to the shared tables or a bench's
report shows here, not at the next hour-long run."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: each bench's results name and module: bench/NAME.py, and the suites of bench/suites
SUITES = importlib.import_module("bench.suites.__main__").SUITES
MODULES = {p.stem: f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")
           if p.stem not in ("__init__", "common")} | {s: f"bench.suites.{s}" for s in SUITES}
#: benches whose first measured run is still to come (their report and goals are tested by
#: tests/bench/test_bench_NAME.py on synthetic results)
NO_RESULTS_YET: set[str] = set()
BENCHES = sorted(set(MODULES) - NO_RESULTS_YET)


def test_every_bench_has_results() -> None:
    results = sorted(p.stem for p in RESULTS.glob("*.json"))
    assert results == BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_report_renders_from_the_committed_json(name: str, tmp_path: Path) -> None:
    bench = importlib.import_module(MODULES[name])
    assert bench.main(["--report", str(RESULTS / f"{name}.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text()
    assert json.loads((tmp_path / f"{name}.json").read_text()) == \
        json.loads((RESULTS / f"{name}.json").read_text())
    try:
        import matplotlib  # noqa: F401 - the bench extra, not the test one
    except ImportError:
        return
    if (RESULTS / f"{name}.png").exists():
        assert (tmp_path / f"{name}.png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(MODULES))
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module(MODULES[name])
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--report JSON" in out and "--out" in out


def test_against_best_pairs_each_sides_best_setting_round_by_round() -> None:
    from bench.common import against_best

    runs = [{"round": r, "server": s, "iops": v, "workload": "w"} for r, s, v in [
        (1, "k -b", 100.0), (1, "k", 80.0), (1, "a", 90.0), (1, "a nb", 120.0),
        (2, "k -b", 70.0), (2, "k", 140.0), (2, "a", 70.0), (2, "a nb", 35.0),
        (2, "other", 999.0)]]
    peer = {"k -b": "-b", "k": "per-io"}
    both = against_best(runs, {"a": "default", "a nb": "--no-batch"}, peer, workload="w")
    assert both.ratios == [1.2, 0.5]
    assert (both.settings, both.our_settings) == ("-b / per-io", "--no-batch / default")
    assert (both.peer, both.ours) == (120.0, 95.0)
    alone = against_best(runs, "a", peer, workload="w")
    assert alone.ratios == [0.9, 0.5]
    assert alone.our_settings == "a"
