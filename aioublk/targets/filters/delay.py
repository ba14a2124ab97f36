"""The delay filter: a slow disk, each operation held for its delay, as
nbdkit's delay filter."""

from __future__ import annotations

import asyncio

from aioublk.target import Target
from aioublk.targets.filters.base import OPS, Filter
from aioublk.targets.spec import DURATION, FilterSpec, Option


class DelayFilter(Filter):
    """Hold each request of an operation for its delay (seconds) before the
    inner layer sees it, as nbdkit's delay filter: a slow disk."""

    name = "delay"

    def __init__(self, inner: Target, read: float = 0, write: float = 0, flush: float = 0,
                 discard: float = 0, write_zeroes: float = 0) -> None:
        self.delays = {"read": read, "write": write, "flush": flush, "discard": discard,
                       "write_zeroes": write_zeroes}
        super().__init__(inner)

    async def _wait(self, op: str) -> None:
        if self.delays[op]:
            await asyncio.sleep(self.delays[op])

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._wait("read")
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._wait("write")
        await super().write(offset, buf, fua)

    async def flush(self) -> None:
        await self._wait("flush")
        await super().flush()

    async def discard(self, offset: int, length: int) -> None:
        await self._wait("discard")
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._wait("write_zeroes")
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {op: s for op, s in self.delays.items() if s}


def _delay(op: str) -> Option:
    return Option(op, DURATION, f"hold each {op.replace('_', '-')} this long", default=0)


SPEC = FilterSpec(
    "delay", DelayFilter,
    "a slow disk: each operation held for its delay (Python serves every request)",
    tuple(_delay(op) for op in OPS), rank=5)
