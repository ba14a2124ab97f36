"""The null target: reads return whatever is in the buffer, writes vanish.

Like kublk's null target it is a measure of the framework's own cost: no
backend I/O, 250 GiB by default. With integrity metadata it keeps none: a
read's metadata is all 0xFF, which the block layer does not verify.
"""

from __future__ import annotations

from aioublk.dataplane.maps import Map, Null
from aioublk.target import Buffer, Done, Geometry, Target
from aioublk.targets.spec import DEVICE_SIZE, TargetSpec


class NullTarget(Target):
    """``size`` bytes that store nothing (``-t null``): the framework's own
    cost, as kublk's null target measures it."""

    name = "null"
    fixed_buffers = True
    metadata = True
    c_idle = True  # every request and its I/O come through the ring

    def __init__(self, size: int = 250 << 30) -> None:
        self.geometry = Geometry(size=size, dma_alignment=4095,
                                 segment=(4095, 32 << 10, 32))

    def map(self) -> Map:
        return Null()

    async def read(self, offset: int, buf: Buffer, meta: memoryview | None = None) -> None:
        if meta is not None:
            meta[:] = b"\xff" * len(meta)

    async def write(self, offset: int, buf: Buffer, fua: bool = False,
                    meta: memoryview | None = None) -> None:
        return None

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        done(len(buf))
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        done(len(buf))
        return True

    async def flush(self) -> None:
        return None

    async def discard(self, offset: int, length: int) -> None:
        return None

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        return None


#: ``-t null``: its options, as the command line and config files take them
SPEC = TargetSpec("null", NullTarget, (DEVICE_SIZE,), rank=1)
