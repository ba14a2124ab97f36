"""Devices created from inside an asyncio application (the test's own loop)."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from aioublk import Device, Geometry, Target

pytestmark = [pytest.mark.guest, pytest.mark.asyncio]

MiB = 1 << 20


class RamDisk(Target):
    name = "ramdisk"

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)
        self.calls = 0

    async def read(self, offset: int, buf: memoryview) -> None:
        self.calls += 1
        await asyncio.sleep(0)  # a real coroutine: yields to the queue's loop
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self.calls += 1
        self.data[offset:offset + len(buf)] = buf


class Flaky(RamDisk):
    """Fails every read of the second MiB with a Python exception."""

    async def read(self, offset: int, buf: memoryview) -> None:
        if MiB <= offset < 2 * MiB:
            raise ValueError("boom")
        await super().read(offset, buf)


def _pwrite_pread(path: str, data: bytes, offset: int) -> bytes:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        import mmap

        buf = mmap.mmap(-1, len(data))
        buf[:] = data
        os.pwritev(fd, [buf], offset)
        back = mmap.mmap(-1, len(data))
        os.preadv(fd, [back], offset)
        return bytes(back)
    finally:
        os.close(fd)


async def test_coroutine_target_from_the_callers_loop() -> None:
    target = RamDisk(16 * MiB)
    async with Device(target, queues=2, depth=32) as dev:
        assert dev.path == f"/dev/ublkb{dev.id}"
        data = os.urandom(256 * 1024)
        loop = asyncio.get_running_loop()
        back = await loop.run_in_executor(None, _pwrite_pread, dev.path, data, 3 * MiB)
        assert back == data
        assert target.data[3 * MiB:3 * MiB + len(data)] == data
        assert target.calls >= 2
    assert not os.path.exists(dev.path)


async def test_target_exception_is_eio_and_queue_keeps_serving() -> None:
    target = Flaky(4 * MiB)
    async with Device(target, queues=1, depth=8) as dev:
        loop = asyncio.get_running_loop()

        def bad_read() -> int:
            fd = os.open(dev.path, os.O_RDONLY | os.O_DIRECT)
            try:
                import mmap

                os.preadv(fd, [mmap.mmap(-1, 4096)], MiB)
            except OSError as e:
                return e.errno or 0
            finally:
                os.close(fd)
            return 0

        assert await loop.run_in_executor(None, bad_read) == errno.EIO
        data = os.urandom(4096)
        assert await loop.run_in_executor(None, _pwrite_pread, dev.path, data, 0) == data
