"""The offset filter: a window of the inner device, from a byte on, as
nbdkit's offset filter. A placement filter: C still serves a loop's
requests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aioublk.dataplane.maps import Linear, Map, Null
from aioublk.target import Buffer, Target
from aioublk.targets.filters.base import Filter, aligned
from aioublk.targets.spec import SIZE, FilterSpec, Option


class OffsetFilter(Filter):
    """Serve the inner device from byte ``offset`` on, ``size`` bytes (default:
    to its end): one window of a disk, as nbdkit's offset filter."""

    name = "offset"
    placement = True

    def __init__(self, inner: Target, offset: int, size: int | None = None) -> None:
        g = inner.geometry
        aligned("offset", offset, g)
        if offset >= g.size:
            raise ValueError(f"offset {offset} is not inside the {g.size}-byte inner device: "
                             "give a smaller offset")
        room = g.size - offset
        if size is not None:
            aligned("size", size, g)
            if not 0 < size <= room:
                raise ValueError(f"size {size} does not fit the {room} bytes after offset "
                                 f"{offset}: give at most {room}")
        self.offset, self.size = offset, size if size is not None else room
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, size=self.size)

    def place(self, inner: Map | None) -> Map | None:
        if isinstance(inner, Linear):
            return Linear(inner.fd, inner.base + self.offset)
        if isinstance(inner, Null):
            return inner
        return None  # a striped or extent map does not shift: Python serves the window

    async def read(self, offset: int, buf: Buffer) -> None:
        await self.inner.read(offset + self.offset, buf)  # type: ignore[arg-type]

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        await self.inner.write(offset + self.offset, buf, fua)  # type: ignore[arg-type]

    async def discard(self, offset: int, length: int) -> None:
        await self.inner.discard(offset + self.offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.inner.write_zeroes(offset + self.offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"offset": self.offset, "size": self.size}


SPEC = FilterSpec(
    "offset", OffsetFilter,
    "a window of the device: from OFFSET on, SIZE bytes (C still serves a loop's)", (
        Option("offset", SIZE, "the window's first byte", required=True, lo=0),
        Option("size", SIZE, "the window's length (default: to the end)", lo=1)), rank=1)
