"""serve's ``[metrics]`` endpoint against the real driver: a null device (its
requests served in C) and a loop device, scraped while fio runs and after;
the counters grow, and the latency histograms count what the counters do."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.kernel import fio, make_file
from tests.test_kernel_serve import Server

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20

CONFIG = """
[metrics]
listen = "127.0.0.1:{port}"

[[devices]]
target = "null"
options = {{ size = "64M" }}

[[devices]]
target = "loop"
options = {{ file = "loop.img" }}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
         dev_id: int, **labels: str) -> float:
    want = {("device", str(dev_id)), *labels.items()}
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def test_metrics_grow_during_fio_and_histograms_count_the_requests(tmp_path: Path) -> None:
    make_file(tmp_path / "loop.img", 64 * MiB)
    port = _free_port()
    (tmp_path / "cfg.toml").write_text(CONFIG.format(port=port))
    srv = Server(tmp_path / "cfg.toml")
    try:
        null, loop = srv.devices(2)
        before = _scrape(port)
        for d in (null, loop):
            assert ("aioublk_inflight", frozenset({("device", str(d.dev_id)),
                                                   ("queue", "0")})) in before, before
        jobs = [threading.Thread(target=fio, args=(f"/dev/ublkb{d.dev_id}", tmp_path,
                                                   "--rw=randrw", "--bs=4k", "--size=16M",
                                                   "--iodepth=16", "--time_based",
                                                   "--runtime=4"))
                for d in (null, loop)]
        for j in jobs:
            j.start()
        time.sleep(2)
        during = _scrape(port)  # while fio runs
        for j in jobs:
            j.join()
        after = _scrape(port)
        assert "Traceback" not in srv.stderr()
        for d in (null, loop):
            reqs = [_sum(s, "aioublk_requests_total", d.dev_id) for s in (before, during, after)]
            nbytes = [_sum(s, "aioublk_bytes_total", d.dev_id) for s in (before, during, after)]
            assert reqs[0] < reqs[1] < reqs[2], (d.dev_id, reqs)
            assert nbytes[0] < nbytes[1] < nbytes[2], (d.dev_id, nbytes)
            assert _sum(after, "aioublk_errors_total", d.dev_id) == 0
            assert _sum(after, "aioublk_inflight", d.dev_id) == 0
            # every request is timed from fetch to commit (the few fio's
            # opening reads and the page cache's included)
            timed = _sum(after, "aioublk_latency_seconds_count", d.dev_id)
            assert abs(timed - reqs[2]) <= max(8, reqs[2] // 100), (d.dev_id, timed, reqs)
            for op in ("read", "write"):
                n = _sum(after, "aioublk_latency_seconds_count", d.dev_id, op=op)
                inf = _sum(after, "aioublk_latency_seconds_bucket", d.dev_id, op=op, le="+Inf")
                assert n > 0 and inf == n, (d.dev_id, op, n, inf)
                assert 0 < _sum(after, "aioublk_latency_seconds_sum", d.dev_id, op=op) < n
        assert srv.terminate() == 0, srv.stderr()
    finally:
        srv.close()


def test_port_in_use_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "cfg.toml").write_text(CONFIG.format(port=port))
        make_file(tmp_path / "loop.img", 64 * MiB)
        srv = Server(tmp_path / "cfg.toml")
        try:
            assert srv.wait() == 1
        finally:
            srv.close()
    err = srv.stderr()
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("aioublk: cfg.toml: metrics.listen: cannot listen "
                                           f"on 127.0.0.1:{port}: "), err
