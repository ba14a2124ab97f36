"""The Prometheus metrics on the host: serve's [metrics] table, the bucket
maths, the C data plane's latency histogram on a real ring (no device), the
collector reading real counters, and the endpoint."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from typing import Any

import pytest

from aioublk._uring import lib
from aioublk.dataplane import plane as dataplane
from aioublk.device import Device
from aioublk.frontend import config, metrics, values
from aioublk.kernel import uapi
from tests.queue.test_batch import _driver, _Path

NULL = {"devices": [{"target": "null"}]}


def _parse(extra: dict[str, Any]) -> config.ServeConfig:
    return config.parse(NULL | extra, "s.toml", base="/")


# -- config ---------------------------------------------------------------------

@pytest.mark.parametrize("listen, want", [
    ("127.0.0.1:9341", ("127.0.0.1", 9341)),
    ("[::1]:9341", ("::1", 9341)),
    ("localhost:80", ("localhost", 80)),
])
def test_listen_is_host_and_port(listen: str, want: tuple[str, int]) -> None:
    assert _parse({"metrics": {"listen": listen}}).metrics.listen == want


def test_no_metrics_table_means_no_endpoint() -> None:
    assert _parse({}).metrics.listen is None
    assert _parse({"metrics": {}}).metrics.listen is None


@pytest.mark.parametrize("listen, words", [
    ("9341", "is not host:port"),
    ("::1:9341", "is not host:port"),
    ("127.0.0.1:", "is not host:port"),
    ("127.0.0.1:70000", "port 70000 is out of range"),
    (9341, "is an integer: use a string"),
])
def test_bad_listen_is_one_line(listen: Any, words: str) -> None:
    with pytest.raises(values.Invalid, match=f"^metrics.listen: .*{words}") as e:
        _parse({"metrics": {"listen": listen}})
    assert "\n" not in str(e.value)


def test_unknown_metrics_key_suggests_the_known_one() -> None:
    with pytest.raises(values.Invalid, match=r'^metrics.lsten: unknown key \(did you mean '
                                              r'"listen"\?\)'):
        _parse({"metrics": {"lsten": "127.0.0.1:1"}})
    with pytest.raises(values.Invalid, match="^metrics: 1 is an integer: use a table"):
        _parse({"metrics": 1})


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec",
                        lambda name: None if name == "prometheus_client" else real(name))
    with pytest.raises(values.Invalid, match=r"pip install 'aioublk\[metrics\]'"):
        _parse({"metrics": {"listen": "127.0.0.1:9341"}})


# -- bucket maths ---------------------------------------------------------------

def test_buckets_are_log2_of_1024_ns_units() -> None:
    assert [metrics.bucket_of(ns) for ns in (0, 1023, 1024, 2047, 2048, 4095, 4096)] \
        == [0, 0, 1, 1, 2, 2, 3]
    assert metrics.bucket_of(10**12) == metrics.NR_BUCKETS - 1  # the last takes the rest
    # a latency is at most its bucket's bound, and more than the bucket before's
    for ns in (1, 1000, 1024, 5000, 123456, 9_999_999):
        b = metrics.bucket_of(ns)
        assert ns / 1e9 < metrics.BOUNDS[b] and (b == 0 or ns / 1e9 >= metrics.BOUNDS[b - 1])


def test_cumulative_buckets_end_in_inf_with_the_count() -> None:
    buckets = [0] * metrics.NR_BUCKETS
    buckets[0], buckets[3], buckets[-1] = 2, 5, 1
    out = metrics.cumulative(buckets)
    assert out[0] == (repr(1024 / 1e9), 2.0) and out[3][1] == 7.0
    assert out[-1] == ("+Inf", 8.0) and len(out) == metrics.NR_BUCKETS


# -- the C histogram, on a real ring and driver -----------------------------------

def _fetched(driver: Any, tag: int, op: int) -> None:
    """The kernel hands tag a request of ``op``: its descriptor, then a CQE
    the data plane takes for a per-I/O fetch (a NOP carrying its user_data)."""
    qm = driver.w.spec.work[0][0]
    uapi.IO_DESC.pack_into(qm.descs, tag * uapi.IO_DESC.size, op, 8, 0, 0)
    ud = dataplane.encode(dataplane.EV_IO, 0, tag)
    assert lib.aur_prep(driver.ring._r, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0, ud) == 0
    assert lib.aur_submit(driver.ring._r) >= 0


async def _served(timing: bool, ops: list[int]) -> Any:
    """A per-I/O driver (no map: Python serves) after requests of ``ops``."""
    from aioublk.ring import Ring

    ring = Ring(16)
    old, dataplane.timing = dataplane.timing, timing
    try:
        driver = _driver(ring, _Path(), batch=False)
    finally:
        dataplane.timing = old
    for tag, op in enumerate(ops):
        _fetched(driver, tag, op)
    for _ in range(20):
        await asyncio.sleep(0.001)
        ring.reap_now()
        if driver.stats[0].ios == len(ops):
            break
    return ring, driver


@pytest.mark.asyncio
async def test_c_times_each_request_into_its_ops_histogram() -> None:
    ring, driver = await _served(True, [0, 1, 1, 2])
    try:
        st = driver.stats[0]
        assert st.started == st.ios == 4
        per_op = st.latency()
        counts = [sum(b) for b, _ in per_op]
        assert counts[:3] == [1, 2, 1] and sum(counts) == 4
        assert all(s > 0 for (b, s) in per_op[:3])
        assert per_op[1][1] < 2 * 10**9  # ns: two writes, well under a second each
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_no_timing_unless_enabled() -> None:
    ring, driver = await _served(False, [0, 1])
    try:
        assert driver.stats[0].ios == 2
        assert all(not any(b) and not s for b, s in driver.stats[0].latency())
    finally:
        ring.close()


# -- the collector ----------------------------------------------------------------

class _Dev:
    """A device of one worker: Device's own stats and latency over a real driver."""

    stats = Device.stats
    latency = Device.latency

    def __init__(self, driver: Any) -> None:
        self.id, self.info = 7, object()
        self.workers = [type("W", (), {"driver": driver})()]


@pytest.mark.asyncio
async def test_collector_exports_counters_and_latency_per_device_queue_and_op() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    ring, driver = await _served(True, [0, 1, 1])
    try:
        registry = CollectorRegistry()
        registry.register(metrics.Collector(lambda: [_Dev(driver)]))  # type: ignore[arg-type]
        text = generate_latest(registry).decode()
    finally:
        ring.close()
    lab = 'device="7",queue="0"'
    op = 'device="7",op="{}",queue="0"'  # (labels come out sorted)
    assert f"aioublk_requests_total{{{lab}}} 3.0" in text
    assert f"aioublk_bytes_total{{{lab}}} 12288.0" in text  # three 4096-byte answers
    assert f"aioublk_errors_total{{{lab}}} 0.0" in text
    assert f"aioublk_inflight{{{lab}}} 0.0" in text
    assert f'aioublk_latency_seconds_count{{{op.format("read")}}} 1.0' in text
    assert f'aioublk_latency_seconds_count{{{op.format("write")}}} 2.0' in text
    inf = 'device="7",le="+Inf",op="write",queue="0"'
    assert f"aioublk_latency_seconds_bucket{{{inf}}} 2.0" in text
    assert 'op="flush"' not in text  # ops never seen are left out


# -- the endpoint -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_endpoint_serves_metrics_and_turns_timing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "timing", False)
    port = _free_port()
    stop = metrics.start("127.0.0.1", port, lambda: [])
    try:
        assert dataplane.timing
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "# TYPE aioublk_requests_total counter" in text
        assert "# TYPE aioublk_latency_seconds histogram" in text
    finally:
        stop()


def test_port_in_use_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "timing", False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(metrics.MetricsError, match=f"^cannot listen on 127.0.0.1:{port}: "
                                                       ".*: pick another port") as e:
            metrics.start("127.0.0.1", port, lambda: [])
    assert "\n" not in str(e.value) and not dataplane.timing


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_cost_no_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 connections that never send a request: no thread for each (the
    endpoint runs as root, in serve), the oldest dropped past a bound, and a
    scrape still answered."""
    import threading

    monkeypatch.setattr(dataplane, "timing", False)
    port = _free_port()
    before = threading.active_count()
    stop = metrics.start("127.0.0.1", port, lambda: [])
    idle: list[socket.socket] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
        # answered after the server took every connection before it (one listen queue)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"aioublk_requests_total" in r.read()
        assert threading.active_count() - before <= 2, threading.enumerate()
        dropped = sum(_closed_by_server(s, 0.01) for s in idle[:150])
        assert dropped == 150, dropped  # only the newest few are kept waiting
    finally:
        for s in idle:
            s.close()
        stop()


def test_a_slow_client_is_dropped_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "timing", False)
    monkeypatch.setattr(metrics, "CLIENT_SECONDS", 0.5, raising=False)
    port = _free_port()
    stop = metrics.start("127.0.0.1", port, lambda: [])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the end
            assert _closed_by_server(slow, 5)
    finally:
        stop()
