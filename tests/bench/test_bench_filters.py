"""bench/filters.py's analysis on synthetic results (no guest): ratios paired
by round, a Python filter's cost per request, and the goal over the stacks
that keep C."""

from __future__ import annotations

from typing import Any

from bench import filters


def data(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"cpus": 2, "kernel": "7.2", "runtime": 5, "rounds": 2, "quick": False,
            "backing": {"fs": "tmpfs"}, "stacks": filters.STACKS, "runs": runs,
            "complete": True}


def test_costs_and_goal_come_from_paired_rounds() -> None:
    runs = []
    for rnd, plain in ((1, 1000.0), (2, 2000.0)):
        for w in filters.WORKLOADS:
            runs += [{"round": rnd, "stack": "plain", "workload": w, "iops": plain},
                     {"round": rnd, "stack": "placement", "workload": w, "iops": plain * 0.97},
                     {"round": rnd, "stack": "protect", "workload": w, "iops": plain * 0.9},
                     {"round": rnd, "stack": "log", "workload": w, "iops": plain / 2}]
    # log halves the rate: 1/500 - 1/1000 s and 1/1000 - 1/2000 s, median 750 µs
    assert filters._cost_us(runs, "log", filters.WORKLOADS[0]) == 750.0
    text = filters.report(data(runs), "cmd")
    assert "(placement, protect) over loop, the lowest paired ratio of their rows: **0.90** " \
        "(goal >= 0.95: not met)" in text
    assert "| log | 750 | 750 | 750 |" in text
