"""The rate filter: requests and bytes a second limited by token buckets,
as nbdkit's rate filter."""

from __future__ import annotations

import asyncio
import threading
import time

from aioublk.target import Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import INT, SIZE, FilterSpec, Option


class _Bucket:
    """A token bucket shared by every queue's thread: ``rate`` tokens a second,
    at most ``burst`` saved. A taker may overdraw it and then waits until the
    bucket would have held what it took, so a large request is late, not
    refused."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.then = burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: float) -> float:
        """Seconds the taker of ``n`` tokens must wait."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.then) * self.rate) - n
            self.then = now
            return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class RateFilter(Filter):
    """Limit the device to ``iops`` requests and ``bandwidth`` bytes a second
    (0: no limit), with a burst of one second's worth, as nbdkit's rate
    filter. Reads and writes count bytes; discards and write-zeroes count
    requests only."""

    name = "rate"

    def __init__(self, inner: Target, iops: int = 0, bandwidth: int = 0) -> None:
        if iops < 0 or bandwidth < 0:
            raise ValueError("a negative limit: give 0 (none) or more")
        self.iops = _Bucket(iops, iops) if iops else None
        self.bandwidth = _Bucket(bandwidth, bandwidth) if bandwidth else None
        super().__init__(inner)

    async def _pace(self, n: int) -> None:
        wait = max(self.iops.take(1) if self.iops else 0.0,
                   self.bandwidth.take(n) if self.bandwidth and n else 0.0)
        if wait:
            await asyncio.sleep(wait)

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._pace(len(buf))
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._pace(len(buf))
        await super().write(offset, buf, fua)

    async def discard(self, offset: int, length: int) -> None:
        await self._pace(0)
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._pace(0)
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"iops": int(self.iops.rate) if self.iops else 0,
                "bandwidth": int(self.bandwidth.rate) if self.bandwidth else 0}


SPEC = FilterSpec(
    "rate", RateFilter,
    "limit requests and bytes a second, token buckets with a second's burst "
    "(Python serves every request)", (
        Option("iops", INT, "requests a second (0: no limit)", default=0, lo=0),
        Option("bandwidth", SIZE, "bytes a second read and written (0: no limit)",
               default=0, lo=0)), rank=7)
