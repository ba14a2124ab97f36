"""A RAM disk target, installed as a package and found by name (``-t ramdisk``)."""

from aioublk import Geometry, Target


class RamDisk(Target):
    """``size`` bytes in RAM (``--opt size=64M``; a config's ``options.size``)."""

    name = "ramdisk"

    def __init__(self, size: int = 64 << 20) -> None:
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)

    async def read(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self.data[offset:offset + len(buf)] = buf
