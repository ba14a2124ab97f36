"""The protect filter: writes to byte ranges refused with EPERM, as
nbdkit's protect filter."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable

from aioublk.dataplane.extents import ExtentTable
from aioublk.dataplane.maps import Extents, Linear, Map
from aioublk.target import Buffer, Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import RANGES, FilterSpec, Option


class ProtectFilter(Filter):
    """Refuse writes, discards and write-zeroes touching any of ``ranges``
    ((start, end) bytes, end exclusive) with EPERM, as nbdkit's protect filter.

    Over a linear map (loop) C keeps serving: the map becomes an extent table
    of the same file whose protected granules are read-only, so their writes
    miss to Python, which refuses them. The granule is the largest power of
    two (up to 2 MiB) the ranges, the size and the file offset are multiples
    of; a table that would not fit ``MAX_GRANULES`` leaves all to Python."""

    name = "protect"
    placement = True
    MAX_GRANULES = 1 << 20

    def __init__(self, inner: Target, ranges: Iterable[tuple[int, int]]) -> None:
        self.ranges = list(ranges)
        if not self.ranges or any(not 0 <= a < b for a, b in self.ranges):
            raise ValueError(f"ranges {self.ranges}: give at least one, each START < END")
        self._table: ExtentTable | None = None
        self._built = False
        self._table_lock = threading.Lock()  # (map() runs on every queue's thread)
        super().__init__(inner)

    def place(self, inner: Map | None) -> Map | None:
        if not isinstance(inner, Linear):
            return None
        with self._table_lock:
            if not self._built:
                self._table, self._built = self._fence(inner), True
        return Extents(self._table) if self._table is not None else None

    def _fence(self, inner: Linear) -> ExtentTable | None:
        size = self.geometry.size
        edges = {0, size, inner.base, *(x for r in self.ranges for x in r if x < size)}
        granule = 1 << 21
        while granule > 512 and any(e % granule for e in edges):
            granule >>= 1
        if any(e % granule for e in edges) or size // granule > self.MAX_GRANULES:
            return None
        table = ExtentTable(granule, max_entries=size // granule + 1)
        cuts = sorted({0, size, *(x for r in self.ranges for x in r if x < size)})
        for start, end in zip(cuts, cuts[1:], strict=False):
            fenced = any(start < b and end > a for a, b in self.ranges)
            if not table.insert(start, end - start, inner.fd, inner.base + start,
                                writable=not fenced):
                table.close()
                return None
        return table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
        super().close()

    def _check(self, offset: int, length: int) -> None:
        for start, end in self.ranges:
            if offset < end and offset + length > start:
                raise OSError(errno.EPERM, f"protect filter: bytes {start}-{end} are protected")

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        self._check(offset, len(buf))
        await self.inner.write(offset, buf, fua)  # type: ignore[arg-type]

    async def discard(self, offset: int, length: int) -> None:
        self._check(offset, length)
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        self._check(offset, length)
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"ranges": "+".join(f"{a}-{b}" for a, b in self.ranges)}


SPEC = FilterSpec(
    "protect", ProtectFilter,
    "refuse writes to byte ranges with EPERM (Python serves every request)", (
        Option("ranges", RANGES, "START-END byte ranges (END exclusive), joined by +, "
               "e.g. 0-1M+4G-5G", required=True),), rank=10)
