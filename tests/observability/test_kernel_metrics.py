"""serve's ``[metrics]`` endpoint against the real driver: a null device (its
requests served in C) and a loop device, scraped while fio runs and after;
the counters grow, and the latency histograms count what the counters do."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.serve.test_kernel_serve import Server
from tests.support import kernel
from tests.support.kernel import DevListing, make_file

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


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(port: int) -> Samples:
    """/metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sum(samples: Samples, name: str, dev_id: int, **labels: str) -> float:
    want = {("device", str(dev_id)), *labels.items()}
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def _completed(dev_id: int) -> int:
    """Reads and writes the kernel completed on /dev/ublkbN (its own counters:
    reading them costs the guest's slow CPU nothing, unlike a scrape)."""
    fields = Path(f"/sys/block/ublkb{dev_id}/stat").read_text().split()
    return int(fields[0]) + int(fields[4])


def _until(done: Callable[[], bool], what: str, fios: list[subprocess.Popen[bytes]],
           logs: list[Path], timeout: float = 300) -> None:
    """Until ``done()``, while every fio still runs (they stop only when told)."""
    deadline = time.monotonic() + timeout
    while not done():
        for p, log in zip(fios, logs, strict=True):
            assert p.poll() is None, f"fio exited ({p.returncode}): {log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.1)


def test_metrics_grow_during_fio_and_histograms_count_the_requests(tmp_path: Path) -> None:
    """Scraped before fio, while it runs (once the kernel has completed some of
    its requests: on a busy machine fio may take seconds to issue any) and
    after fio is stopped (once more have completed after that scrape)."""
    make_file(tmp_path / "loop.img", 64 * MiB)
    port = _free_port()
    (tmp_path / "cfg.toml").write_text(CONFIG.format(port=port))
    srv = Server(tmp_path / "cfg.toml")
    devs: list[DevListing] = []
    fios: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"fio{i}.log" for i in range(2)]
    try:
        devs = srv.devices(2)
        before = _scrape(port)
        for d in devs:
            assert ("aioublk_inflight", frozenset({("device", str(d.dev_id)),
                                                   ("queue", "0")})) in before, before
        start = {d.dev_id: _completed(d.dev_id) for d in devs}
        for d, log in zip(devs, logs, strict=True):
            with open(log, "wb") as out:  # runs until stopped below (or its own limit)
                fios.append(subprocess.Popen(
                    ["fio", "--name=t", f"--filename=/dev/ublkb{d.dev_id}",
                     "--ioengine=io_uring", "--direct=1", "--rw=randrw", "--bs=4k",
                     "--size=16M", "--iodepth=16", "--time_based", "--runtime=600"],
                    cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=out))
        _until(lambda: all(_completed(d) > n for d, n in start.items()),
               "request of fio completed", fios, logs)
        during = _scrape(port)
        # more than a queue's depth since: the server has answered some after that scrape
        seen = {d.dev_id: _completed(d.dev_id) for d in devs}
        _until(lambda: all(_completed(d) > n + 16 for d, n in seen.items()),
               "further requests of fio completed", fios, logs)
        for p in fios:
            p.send_signal(signal.SIGINT)
        for p in fios:
            p.wait(timeout=120)
        after = _scrape(port)
        assert "Traceback" not in srv.stderr()
        for d in devs:
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
        for p in fios:
            if p.poll() is None:
                p.kill()
                p.wait()
        _stop(srv, devs)


def _stop(srv: Server, devs: list[DevListing]) -> None:
    """However the test ended: serve stopped (SIGTERM deletes its devices;
    a kill would leave them DEAD), then any of its devices still there deleted."""
    if srv.rc is None:
        try:
            srv.terminate()
        except AssertionError:
            pass  # still running after its wait: killed below
    srv.close()
    mine = {d.dev_id for d in devs}
    for d in kernel.listing():
        if d.dev_id in mine:
            kernel.delete(d.dev_id)


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
