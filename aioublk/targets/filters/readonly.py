"""The readonly filter: every write refused, the reads still served by C."""

from __future__ import annotations

import errno
from dataclasses import replace
from typing import Any

from aioublk.dataplane.maps import Extents, Map
from aioublk.target import Buffer
from aioublk.targets.filters.base import Filter
from aioublk.targets.spec import FilterSpec


class ReadonlyFilter(Filter):
    """A read-only disk (the kernel refuses writes); a write that reaches it
    anyway fails with EROFS."""

    name = "readonly"
    placement = True

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, read_only=True)

    def place(self, inner: Map | None) -> Map | None:
        if isinstance(inner, Extents):  # no write reaches C: no pool to allocate from
            return Extents(inner.table, inner.slot)
        return inner

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        raise OSError(errno.EROFS, "read-only filter")

    async def discard(self, offset: int, length: int) -> None:
        raise OSError(errno.EROFS, "read-only filter")

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        raise OSError(errno.EROFS, "read-only filter")


SPEC = FilterSpec("readonly", ReadonlyFilter, "refuse every write", rank=4)
