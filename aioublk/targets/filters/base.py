"""The base of every filter: a ``Target`` that wraps ``inner`` and passes
every operation on unchanged unless it overrides it; and what several
filters share."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aioublk.dataplane.maps import Map
from aioublk.kernel import uapi
from aioublk.target import Geometry, QueueContext, Target


class Filter(Target):
    """Passes everything to ``inner``; subclasses override what they change.

    ``geometry`` starts as the inner layer's (``shape`` may change it). The
    per-queue hooks and the life cycle always reach the inner layer.
    """

    name = "filter"

    def __init__(self, inner: Target) -> None:
        self.inner = inner
        # what the inner layer can do, unless this filter says otherwise
        self.fixed_buffers = inner.fixed_buffers and self.placement
        self.one_loop = inner.one_loop
        self.pin_workers = inner.pin_workers
        self.c_idle = inner.c_idle and self.placement
        self.big_ring_entries = inner.big_ring_entries
        self.metadata = False  # (no filter passes integrity metadata on)
        self.geometry = self.shape(inner.geometry)

    #: True: this filter only moves or fences requests (``place`` transforms
    #: the map); False: it touches data or timing, so Python serves it all
    placement = False

    def shape(self, geometry: Any) -> Any:
        """The geometry this filter shows, from the inner layer's."""
        return geometry

    def place(self, inner: Map | None) -> Map | None:
        """This layer's map from the inner one's; None: Python serves all."""
        return None

    def map(self) -> Map | None:
        return self.place(self.inner.map())

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.inner.read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self.inner.write(offset, buf, fua)

    async def flush(self) -> None:
        await self.inner.flush()

    async def settle_writes(self) -> None:
        await self.inner.settle_writes()

    async def discard(self, offset: int, length: int) -> None:
        await self.inner.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.inner.write_zeroes(offset, length, unmap)

    async def report_zones(self, offset: int, buf: memoryview) -> None:
        await self.inner.report_zones(offset, buf)

    async def zone_append(self, offset: int, buf: memoryview, fua: bool = False) -> int:
        return await self.inner.zone_append(offset, buf, fua)

    async def zone_open(self, offset: int) -> None:
        await self.inner.zone_open(offset)

    async def zone_close(self, offset: int) -> None:
        await self.inner.zone_close(offset)

    async def zone_finish(self, offset: int) -> None:
        await self.inner.zone_finish(offset)

    async def zone_reset(self, offset: int) -> None:
        await self.inner.zone_reset(offset)

    async def zone_reset_all(self) -> None:
        await self.inner.zone_reset_all()

    def use_integrity(self, integrity: uapi.Integrity, *, fresh: bool) -> None:
        self.inner.use_integrity(integrity, fresh=fresh)
        self.geometry = replace(self.shape(self.inner.geometry), integrity=integrity)

    def configure(self, device_flags: int) -> None:
        self.inner.configure(device_flags)

    async def queue_setup(self, q: QueueContext) -> None:
        await self.inner.queue_setup(q)

    async def queue_teardown(self, q: QueueContext) -> None:
        await self.inner.queue_teardown(q)

    def arming(self, q_id: int, tag: int) -> None:
        self.inner.arming(q_id, tag)

    async def drain(self) -> None:
        await self.inner.drain()

    def stopping(self) -> None:
        self.inner.stopping()

    def close(self) -> None:
        self.inner.close()

    def settings(self) -> dict[str, object]:
        """This filter's options, for ``list`` and logs."""
        return {}

    def describe(self) -> dict[str, object]:
        """The inner layer's fields, the stack outermost first under ``filters``
        and this layer's size."""
        inner = self.inner.describe()
        mine = {"name": self.name, **self.settings()}
        filters = [mine, *inner.get("filters", ())]  # type: ignore[misc]
        return {**inner, "filters": filters, "size": self.geometry.size}


#: the operations ``delay`` and ``error`` act on, as their options name them
OPS = ("read", "write", "flush", "discard", "write_zeroes")


def aligned(what: str, value: int, geometry: Geometry) -> None:
    lbs = geometry.logical_block_size
    if value % lbs:
        raise ValueError(f"{what} {value} is not a multiple of the logical block size "
                         f"{lbs}: round it")


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs
