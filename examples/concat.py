"""Files joined end to end as one disk (device-mapper's "linear" table), with
its data served by the C data plane.

The target says where its data lives by returning a map from ``map()``: an
``ExtentTable`` with one extent per file. Reads and writes that the table
covers never reach Python; the coroutines below serve the rest (FUA writes,
flushes, and any request whose backend I/O fell short), so they must do the
same job on their own.

Run as root on a host with ublk_drv:  python examples/concat.py A.img B.img
(each file's size a multiple of 4 KiB).
"""

from __future__ import annotations

import asyncio
import os
import sys

from aioublk import Device, Extents, ExtentTable, Geometry, Map, Target, UblkError, current_ring

GRANULE = 4096


class Concat(Target):
    name = "concat"

    def __init__(self, paths: list[str]) -> None:
        self.files: list[tuple[int, int, int]] = []  # (device offset, size, fd)
        start = 0
        for p in paths:
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
            if not size or size % GRANULE:
                os.close(fd)
                raise UblkError(f"{p}: its size must be a non-zero multiple of {GRANULE}")
            self.files.append((start, size, fd))
            start += size
        self.geometry = Geometry(size=start, volatile_cache=True, fua=True)
        self.table = ExtentTable(GRANULE)
        for dev_off, size, fd in self.files:
            self.table.insert(dev_off, size, fd, 0, writable=True)

    def map(self) -> Map:
        return Extents(self.table)

    def _pieces(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """(fd, file offset, position in the request, length) of a range."""
        out = []
        for dev_off, size, fd in self.files:
            lo, hi = max(offset, dev_off), min(offset + length, dev_off + size)
            if lo < hi:
                out.append((fd, lo - dev_off, lo - offset, hi - lo))
        return out

    async def read(self, offset: int, buf: memoryview) -> None:
        ring = current_ring()
        for fd, at, pos, n in self._pieces(offset, len(buf)):
            if await ring.read(fd, buf[pos:pos + n], at) != n:
                raise OSError(5, "short read")

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        ring = current_ring()
        for fd, at, pos, n in self._pieces(offset, len(buf)):
            if await ring.write(fd, buf[pos:pos + n], at) != n:
                raise OSError(5, "short write")
        if fua:
            await self.flush()

    async def flush(self) -> None:
        for _dev_off, _size, fd in self.files:
            await current_ring().fdatasync(fd)

    def close(self) -> None:
        self.table.close()
        for _dev_off, _size, fd in self.files:
            os.close(fd)


async def main(paths: list[str]) -> None:
    async with Device(Concat(paths), queues=2) as dev:
        print(f"serving {dev.path}; Ctrl-C to stop", flush=True)
        await dev.wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1:]))
    except KeyboardInterrupt:
        pass
    except UblkError as e:
        sys.exit(f"concat: {e}")
