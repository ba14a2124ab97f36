"""A RAM disk in a few lines: a coroutine target served as /dev/ublkbN.

Each queue serves its requests on its own thread; they share ``data``
(bytearray slicing holds the GIL, and the block layer orders nothing between
requests in flight anyway).

Run as root on a host with ublk_drv:  python examples/ramdisk.py 64
"""

import asyncio
import sys

from aioublk import Device, Geometry, Target, UblkError


class RamDisk(Target):
    name = "ramdisk"

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)

    async def read(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self.data[offset:offset + len(buf)] = buf


async def main(mib: int) -> None:
    async with Device(RamDisk(mib << 20), queues=2) as dev:
        print(f"serving {dev.path}; Ctrl-C to stop", flush=True)
        await dev.wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 64))
    except KeyboardInterrupt:
        pass
    except UblkError as e:
        sys.exit(f"ramdisk: {e}")
