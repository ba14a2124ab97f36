"""Devices created from inside an asyncio application (the test's own loop)."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import sys
from pathlib import Path

import pytest

from aioublk import Control, Device, Geometry, Target, UblkError
from tests.examples.test_examples import load_example
from tests.support.kernel import run

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


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, length)
        assert os.preadv(fd, [buf], offset) == length
        return bytes(buf)
    finally:
        os.close(fd)


async def _gone(dev: Device) -> None:
    assert not os.path.exists(dev.path)
    ctrl = Control()
    try:
        with pytest.raises(UblkError, match="does not exist"):
            await ctrl.get_info(dev.id)
    finally:
        ctrl.close()


async def test_example_ramdisk_served_from_the_tests_loop() -> None:
    ramdisk = load_example("ramdisk")
    target = ramdisk.RamDisk(8 * MiB)
    loop = asyncio.get_running_loop()
    async with Device(target, queues=2, depth=16) as dev:
        data = os.urandom(192 * 1024)
        assert await loop.run_in_executor(None, _pwrite_pread, dev.path, data, MiB + 512) == data
        assert target.data[MiB + 512:MiB + 512 + len(data)] == data
    await _gone(dev)


def _ext4(path: str, mnt: Path) -> None:
    """mkfs (with its discards), a file written, remounted, read back; fsck clean."""
    body = os.urandom(300 * 1024)
    run("mkfs.ext4", "-q", "-F", path)
    mnt.mkdir()
    run("mount", path, str(mnt))
    try:
        (mnt / "f").write_bytes(body)
    finally:
        run("umount", str(mnt))
    run("mount", "-o", "ro", path, str(mnt))
    try:
        assert (mnt / "f").read_bytes() == body
    finally:
        run("umount", str(mnt))
    run("e2fsck", "-fn", path)


async def test_example_kv_target_with_the_server_on_the_tests_loop(tmp_path: Path) -> None:
    """The KV server runs on this loop and the queues' threads connect to it:
    all blocking I/O on the device goes to executor threads, or nothing
    would answer the device's requests."""
    kvdisk = load_example("kvdisk")
    loop = asyncio.get_running_loop()
    size = 32 * MiB
    async with kvdisk.KvServer() as server:
        target = kvdisk.KvTarget(size, server.host, server.port)
        async with Device(target, queues=2, depth=32) as dev:
            assert dev.info is not None and dev.info.nr_hw_queues == 2
            # whole blocks, sectors inside a block, blocks' tails and heads, 1 MiB
            for offset, length in [(0, 4096), (3 * MiB + 512, 512), (5 * MiB + 1536, 9216),
                                   (7 * MiB, MiB), (size - 2048, 2048)]:
                data = os.urandom(length)
                back = await loop.run_in_executor(None, _pwrite_pread, dev.path, data, offset)
                assert back == data
                assert server.read(offset, length) == data
            assert server.read(5 * MiB, 1536) == bytes(1536)
            assert await loop.run_in_executor(None, _pread, dev.path, 9 * MiB, 65536) \
                == bytes(65536)
            await loop.run_in_executor(None, _ext4, dev.path, tmp_path / "mnt")
            assert server.connections <= 2  # at most one per queue loop
            await dev.stop()
            await _gone(dev)
            for _ in range(100):  # each queue's teardown closed its connection
                if not server.open_connections:
                    break
                await asyncio.sleep(0.05)
            assert server.open_connections == 0


_APP = '''
import asyncio, mmap, os
from aioublk import Device, Geometry, Target

class Disk(Target):
    name = "appdisk"

    def __init__(self):
        self.data = bytearray(8 << 20)
        self.geometry = Geometry(size=8 << 20)

    async def read(self, offset, buf):
        if offset >= 4 << 20:
            raise ValueError("boom")  # the library logs it: where does it go?
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset, buf, fua=False):
        self.data[offset:offset + len(buf)] = buf

def io(path):
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    m = mmap.mmap(-1, 4096)
    m[:] = b"x" * 4096
    os.pwritev(fd, [m], 0)
    os.preadv(fd, [m], 0)
    assert m[:] == b"x" * 4096
    try:
        os.preadv(fd, [m], 4 << 20)
        raise SystemExit("the failing read succeeded")
    except OSError:
        pass
    os.close(fd)

async def main():
    async with Device(Disk(), queues=1) as dev:
        await asyncio.get_running_loop().run_in_executor(None, io, dev.path)

asyncio.run(main())
'''


async def test_an_embedding_application_sees_nothing_printed(tmp_path: Path) -> None:
    """An application that never configured logging: a device started,
    served (a target error included) and stopped writes nothing to its
    stdout or stderr: the library's records go to the stdlib loggers,
    which have no handler until the application adds one."""
    script = tmp_path / "app.py"
    script.write_text(_APP)
    app = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(app.communicate(), 300)
    assert app.returncode == 0, err.decode()
    assert (out, err) == (b"", b"")
