"""The loop target: one backing file or block device, I/O through the queue's
ring. Flush is fdatasync; discard punches a hole."""

from __future__ import annotations

from aioublk.dataplane import Linear, Map
from aioublk.ring import current_ring
from aioublk.target import Buffer, Done, Geometry, Target, rw_handler
from aioublk.targets.backing import Backing, fit_geometry


class LoopTarget(Target):
    name = "loop"
    fixed_buffers = True

    def __init__(self, path: str, *, direct: bool = True, read_only: bool = False) -> None:
        self.backing = Backing.open(path, direct=direct, read_only=read_only)
        self.geometry = fit_geometry(
            Geometry(size=self.backing.size, volatile_cache=True, read_only=read_only,
                     discard=True, write_zeroes=True), [self.backing])

    def map(self) -> Map:
        return Linear(self.backing.fd)

    async def read(self, offset: int, buf: Buffer) -> None:
        await self.backing.read_full(buf, offset)

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        await self.backing.write_full(buf, offset)
        if fua:
            await self.backing.sync()

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        current_ring().start_read(self.backing.fd, buf, offset,
                                  rw_handler(len(buf), done, lambda: self.read(offset, buf),
                                             self.backing.einval("a read")))
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        current_ring().start_write(self.backing.fd, buf, offset,
                                   rw_handler(len(buf), done, lambda: self.write(offset, buf),
                                              self.backing.einval("a write")))
        return True

    async def flush(self) -> None:
        await self.backing.sync()

    async def discard(self, offset: int, length: int) -> None:
        await self.backing.punch(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.backing.zero(offset, length, unmap)

    async def drain(self) -> None:
        await self.backing.sync()  # a failure reaches the exit status

    def close(self) -> None:
        self.backing.close()

    def describe(self) -> dict[str, object]:
        return {"target": self.name, "size": self.geometry.size, "file": self.backing.path,
                "direct": self.backing.direct}
