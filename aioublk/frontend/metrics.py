"""Prometheus metrics: serve's ``[metrics] listen`` endpoint, and a
collector embedders register in their own registry.

- Counters cost nothing on the hot path: the collector reads
  ``Device.stats()`` (the counters the data plane keeps anyway) when
  scraped.
- Latency is timed in C for every request, whichever side served it (every
  fetch and commit goes through the data plane), into fixed log2 buckets
  per queue and op; only while ``enable_timing()`` is on (serve turns it on
  when ``[metrics]`` is configured). The buckets are plain counters read
  while they move: a scrape may see one bucket a request behind another.
- The endpoint is one daemon thread running its own event loop: a scrape
  then never waits for serve's loop (nor delays it), and the collector only
  reads memory, which needs no loop. It costs a bounded amount whatever
  clients do (serve runs as root): no thread per connection, at most
  ``MAX_CLIENTS`` connections (a new one drops the oldest), each given
  ``CLIENT_SECONDS`` in all to send its request head (at most 8 KiB) and
  take the answer, then dropped. HTTP/1.0 and 1.1, GET and HEAD, one
  request per connection; the answer is ``prometheus_client``'s exposition
  (text, or OpenMetrics when the scraper's Accept asks for it).

``prometheus_client`` is the optional extra ``aioublk[metrics]``; this
module imports it only when a collector or endpoint is made.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aioublk._uring import lib
from aioublk.dataplane import plane as dataplane
from aioublk.device import Device
from aioublk.errors import Error

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

#: the histograms' ops, in the data plane's order (ublk's op codes 0-5, then the rest)
OPS = ("read", "write", "flush", "discard", "write_same", "write_zeroes", "other")
#: the data plane's bucket unit: 1024 ns
UNIT_NS = 1024
NR_BUCKETS = int(lib.AUR_LAT_BUCKETS)
#: bucket b's upper bound in seconds (the last bucket is +Inf)
BOUNDS = tuple((UNIT_NS << b) / 1e9 for b in range(NR_BUCKETS - 1)) + (float("inf"),)
INSTALL = "pip install 'aioublk[metrics]'"
#: connections served at once; one more drops the oldest
MAX_CLIENTS = 16
#: seconds a connection has to send its request and take the answer
CLIENT_SECONDS = 10.0
_HEAD_LIMIT = 8192


class MetricsError(Error):
    """The endpoint cannot start, in one line saying what to do."""


def enable_timing(on: bool = True) -> None:
    """Time requests on devices started from now on (the latency
    histograms); off by default, when it costs nothing measurable."""
    dataplane.timing = on


def bucket_of(ns: int) -> int:
    """The bucket a latency of ``ns`` nanoseconds lands in (as C computes it)."""
    return min((ns // UNIT_NS).bit_length(), NR_BUCKETS - 1)


class Collector:
    """A prometheus_client collector of the devices ``devices()`` returns,
    read at scrape time. Embedders: ``registry.register(Collector(lambda:
    [dev]))`` and ``enable_timing()`` before starting the devices."""

    def __init__(self, devices: Callable[[], list[Device]]) -> None:
        self.devices = devices

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        labels = ["device", "queue"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "ios": CounterMetricFamily("aioublk_requests", "Requests answered", labels=labels),
            "bytes": CounterMetricFamily("aioublk_bytes", "Bytes read or written",
                                         labels=labels),
            "errors": CounterMetricFamily("aioublk_errors", "Requests answered with an error",
                                          labels=labels),
            "inflight": GaugeMetricFamily("aioublk_inflight", "Requests in flight",
                                          labels=labels),
        }
        latency = HistogramMetricFamily(
            "aioublk_latency_seconds", "Request latency, fetch to commit",
            labels=[*labels, "op"])
        for dev in self.devices():
            if dev.info is None:
                continue
            dev_id = str(dev.id)
            for row in dev.stats():
                for key, family in families.items():
                    family.add_metric([dev_id, str(row["queue"])], row[key])
            for q, per_op in dev.latency().items():
                for op, (buckets, sum_ns) in zip(OPS, per_op, strict=True):
                    if any(buckets):
                        latency.add_metric([dev_id, str(q), op], cumulative(buckets),
                                           sum_ns / 1e9)
        yield from families.values()
        yield latency


def cumulative(buckets: list[int]) -> list[tuple[str, float]]:
    """The data plane's buckets as Prometheus's cumulative ``le`` pairs."""
    out, total = [], 0
    for bound, n in zip(BOUNDS, buckets, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
    return out


def start(host: str, port: int, devices: Callable[[], list[Device]]) -> Callable[[], None]:
    """Serve ``/metrics`` for ``devices()`` on host:port (a daemon thread) and
    time requests; returns what stops it. MetricsError if it cannot listen."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise MetricsError(f"metrics need the prometheus-client package: {INSTALL}") from None
    registry: CollectorRegistry = CollectorRegistry()
    registry.register(Collector(devices))
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise MetricsError(f"cannot listen on {_show(host, port)}: {e.strerror}: pick another "
                           "port in [metrics] listen, or stop what uses it") from None
    endpoint = _Endpoint(sock, registry)
    enable_timing()
    return endpoint.stop


class _Endpoint:
    """The HTTP endpoint: one thread, one event loop, bounded clients."""

    def __init__(self, sock: socket.socket, registry: CollectorRegistry) -> None:
        self.sock, self.registry = sock, registry
        self.clients: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,),
                                       name="aioublk-metrics", daemon=True)
        self.thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._client, sock=self.sock, limit=_HEAD_LIMIT))
        finally:
            started.set()
        loop.run_forever()
        server.close()
        for writer in self.clients:
            writer.transport.abort()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.clients) >= MAX_CLIENTS:
            oldest = next(iter(self.clients))
            del self.clients[oldest]
            oldest.transport.abort()
        self.clients[writer] = None
        try:
            await asyncio.wait_for(self._answer(reader, writer), CLIENT_SECONDS)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # gone, too slow or too long: dropped
        finally:
            self.clients.pop(writer, None)
            writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method = head[0].split(" ")[0]
        headers = dict(line.partition(":")[::2] for line in head[1:] if line)
        accept = next((v for k, v in headers.items() if k.strip().lower() == "accept"), "")
        if method in ("GET", "HEAD"):
            from prometheus_client.exposition import choose_encoder

            encode, content_type = choose_encoder(accept.strip())
            status, body = "200 OK", encode(self.registry)
        else:
            status, content_type, body = "405 Method Not Allowed", "text/plain", b""
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode("latin-1") + (body if method != "HEAD" else b""))
        await writer.drain()
        writer.close()
        await writer.wait_closed()


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
