"""Test your own target against the real ublk driver: copy this file into your tests.

With aioublk installed, pytest loads its plugin by itself (entry point
``aioublk``). A test marked ``guest`` runs in place where
``/dev/ublk-control`` exists (as root); on a host without it, every selected
``guest`` test runs in ONE QEMU guest booting a kernel that has the driver
(Debian sid's, fetched and cached on first use; ``--guest-kernel PATH`` for
yours) and is reported in the same summary. A guest test never skips: it
fails if the driver or a tool (here fio and dd, the host's) is missing.

    pytest examples/test_my_target.py         # your tests/ folder, the same way
    pytest --no-guest                         # only the host tests
"""

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from aioublk import Device, Geometry, Target

MiB = 1 << 20


class MyTarget(Target):
    """Stands for yours: a RAM disk."""

    name = "mine"

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)

    async def read(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self.data[offset:offset + len(buf)] = buf


def run(*cmd: str) -> None:
    """A tool on the device, from a thread: the device's control plane runs
    on this test's loop, which must not block."""
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.guest
def test_fio_reads_back_what_it_wrote() -> None:
    async def main() -> None:
        async with Device(MyTarget(64 * MiB), queues=2) as dev:
            await asyncio.to_thread(
                run, "fio", "--name=verify", f"--filename={dev.path}", "--rw=randwrite",
                "--bs=4k", "--size=16M", "--ioengine=io_uring", "--direct=1",
                "--iodepth=16", "--verify=crc32c", "--verify_fatal=1")

    asyncio.run(main())


@pytest.mark.guest
def test_dd_writes_reach_the_target(tmp_path: Path) -> None:
    target = MyTarget(16 * MiB)
    data = os.urandom(MiB)
    (tmp_path / "data").write_bytes(data)

    async def main() -> None:
        async with Device(target, queues=1) as dev:
            await asyncio.to_thread(run, "dd", f"if={tmp_path / 'data'}", f"of={dev.path}",
                                    "bs=64K", "seek=2", "oflag=direct", "status=none")

    asyncio.run(main())
    assert target.data[128 * 1024:128 * 1024 + MiB] == data
