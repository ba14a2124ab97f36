"""A filter in a few lines: a loop device whose writes past a fence fail.

Run as root on a host with ublk_drv:  python examples/fence.py disk.img 1G
"""

import asyncio
import errno
import sys

from aioublk import Device, Filter, LoopTarget, Target
from aioublk.frontend.values import parse_size


class Fence(Filter):
    """Writes reaching past ``limit`` fail with EPERM; everything else passes."""

    name = "fence"

    def __init__(self, inner: Target, limit: int) -> None:
        self.limit = limit
        super().__init__(inner)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if offset + len(buf) > self.limit:
            raise OSError(errno.EPERM, "past the fence")
        await self.inner.write(offset, buf, fua)


async def main(path: str, limit: int) -> None:
    async with Device(Fence(LoopTarget(path), limit)) as dev:
        print(f"serving {dev.path}; writes past byte {limit} fail; Ctrl-C to stop", flush=True)
        await dev.wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1], parse_size(sys.argv[2] if len(sys.argv) > 2 else "1G")))
    except KeyboardInterrupt:
        pass
