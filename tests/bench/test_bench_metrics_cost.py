"""bench/metrics_cost.py's pure parts (no guest): the serve config it writes
is one serve accepts, the order swaps every round, the endpoint's histogram
counts are summed, and the ratios are paired within each round."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from aioublk.frontend import config
from bench import metrics_cost
from examples.ramdisk import RamDisk


def run(rnd: int, device: str, workload: str, setting: str, iops: float | None,
        cpu: float = 10.0, error: str | None = None) -> dict[str, Any]:
    return {"round": rnd, "device": device, "workload": workload, "setting": setting,
            "iops": iops, "error": error, "scrapes": None, "cpu_us_per_io": cpu}


def data(runs: list[dict[str, Any]], rounds: int = 3) -> dict[str, Any]:
    return {"kernel": "7.2", "cpus": 2, "guest": True, "runtime": 5, "ramp": 1,
            "rounds": rounds, "quick": False, "scrape_every": 1.0, "clocksource": "tsc",
            "backing": {"path": "/tmp/x/loop.img", "fs": "tmpfs", "o_direct": False},
            "timed": [12345], "complete": True, "runs": runs}


@pytest.mark.parametrize("metrics", [False, True])
def test_the_config_is_one_serve_accepts(metrics: bool, tmp_path: Path) -> None:
    backing = tmp_path / "loop.img"
    backing.write_bytes(b"\0" * 4096)
    text = metrics_cost.config(metrics, str(backing), port=9999)
    cfg = config.parse(tomllib.loads(text), str(tmp_path / "serve.toml"), base=str(tmp_path))
    assert cfg.metrics.listen == (("127.0.0.1", 9999) if metrics else None)
    assert [d.target for d in cfg.devices] == ["null", "loop", "examples.ramdisk:RamDisk"]
    assert [d.config.dev_id for d in cfg.devices] == [40, 41, 42]
    assert all(d.config.queues == 1 and d.config.depth == 128 for d in cfg.devices)
    assert cfg.devices[1].options["file"] == str(backing)
    target = cfg.devices[2].build_target()
    assert isinstance(target, RamDisk) and target.geometry.size == metrics_cost.RAMDISK_SIZE


def test_off_and_on_swap_every_round_and_so_do_their_settings() -> None:
    assert metrics_cost.order(0) == [("off", ["off"]), ("on", ["timing", "scraped"])]
    assert metrics_cost.order(1) == [("on", ["scraped", "timing"]), ("off", ["off"])]
    assert metrics_cost.order(2) == metrics_cost.order(0)


def test_timed_sums_the_histograms_counts() -> None:
    exposition = "\n".join([
        "# TYPE aioublk_latency_seconds histogram",
        'aioublk_latency_seconds_bucket{device="40",queue="0",op="read",le="+Inf"} 7.0',
        'aioublk_latency_seconds_count{device="40",queue="0",op="read"} 7.0',
        'aioublk_latency_seconds_sum{device="40",queue="0",op="read"} 0.01',
        'aioublk_latency_seconds_count{device="42",queue="0",op="write"} 3.0',
        'aioublk_requests_total{device="40",queue="0"} 99.0',
    ])
    assert metrics_cost.timed(exposition) == 10
    assert metrics_cost.timed("") == 0


def test_ratios_are_paired_within_each_round() -> None:
    """A slow round slows every setting: each round's own ratio stays what it
    is, and the goal is judged on their median."""
    runs = []
    for rnd, (off, timing, scraped) in enumerate([(100, 99, 98), (50, 49, 45), (200, 200, 196)],
                                                 1):
        runs += [run(rnd, "null", "4k randread qd64", "off", off, cpu=10),
                 run(rnd, "null", "4k randread qd64", "timing", timing, cpu=10.5),
                 run(rnd, "null", "4k randread qd64", "scraped", scraped, cpu=11)]
    [row] = metrics_cost.rows(data(runs))
    assert (row.device, row.workload) == ("null", "4k randread qd64")
    assert row.iops == {"off": 100, "timing": 99, "scraped": 98}
    assert row.ratios["scraped"] == [0.98, 0.9, 0.98]
    assert row.paired("scraped") == 0.98 and row.paired("timing") == 0.99
    assert row.cpu == {"off": 10, "timing": 10.5, "scraped": 11}
    text = metrics_cost.report(data(runs), "cmd")
    assert "| null | 4k randread qd64 | 100 | 99 | 98 | 0.990 | 0.980 | 0.90–0.98 |" in text
    assert "| 1.100 | yes |" in text and "12,345" in text


def test_a_failed_setting_leaves_its_ratio_open_and_names_the_error() -> None:
    runs = [run(1, "python", "4k randread qd1", "off", 10.0),
            run(1, "python", "4k randread qd1", "timing", None, error="fio exit 1: boom"),
            run(1, "python", "4k randread qd1", "scraped", 9.0)]
    d = data(runs, rounds=1) | {"complete": False}
    [row] = metrics_cost.rows(d)
    assert row.paired("timing") is None and row.paired("scraped") == 0.9
    text = metrics_cost.report(d, "cmd")
    assert "| 0.900 | 0.90–0.90 |" in text and "| no |" in text
    assert "- python timing: `fio exit 1: boom`" in text and "**Incomplete**" in text


def test_scrape_reads_the_endpoint() -> None:
    pytest.importorskip("prometheus_client")
    from aioublk.frontend import metrics

    stop = metrics.start("127.0.0.1", 0, lambda: [])
    try:
        port = stop.__self__.sock.getsockname()[1]  # type: ignore[attr-defined]
        body = metrics_cost.scrape(port)
    finally:
        stop()
        metrics.enable_timing(False)
    assert "# TYPE aioublk_requests_total counter" in body
    assert metrics_cost.timed(body) == 0
