"""``async with Qcow2Image.open(...)``: the image is closed (written back) on
exit, and a thread without a ring gets one for the block, made and closed by
the image; a ring already bound (a ublk queue's) is used and left open.
Images are made with ``qemu-img create`` and checked with ``qemu-img check``
and ``qemu-io`` afterwards."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from aioublk.qcow2 import Qcow2Image
from aioublk.ring import Ring, bound_ring
from tests.support.qcow2_util import K, M, check_clean, create, qemu_io

pytestmark = pytest.mark.asyncio


async def write_and_read_back(img: Qcow2Image, offset: int, byte: int) -> None:
    data = bytes([byte]) * (64 * K)
    await img.write(offset, data)
    buf = bytearray(64 * K)
    await img.read(offset, buf)
    assert buf == data


async def test_without_a_ring_the_image_makes_and_closes_its_own(tmp_path: Path) -> None:
    path = create(tmp_path / "img.qcow2", 4 * M)
    assert bound_ring() is None
    async with Qcow2Image.open(str(path)) as img:
        own = bound_ring()
        assert own is not None and not own.closed
        await write_and_read_back(img, 1 * M, 0x5A)
    assert own.closed and bound_ring() is None
    assert img.file.fd < 0
    check_clean(path)
    qemu_io(path, f"read -P 0x5a {1 * M} {64 * K}")  # written back, as QEMU reads it


async def test_a_bound_ring_is_used_and_left_open(tmp_path: Path, ring: Ring) -> None:
    path = create(tmp_path / "img.qcow2", 4 * M)
    async with Qcow2Image.open(str(path)) as img:
        assert bound_ring() is ring
        await write_and_read_back(img, 0, 0x11)
    assert bound_ring() is ring and not ring.closed
    assert await ring.nop() == 0  # still usable
    check_clean(path)
    qemu_io(path, f"read -P 0x11 0 {64 * K}")


async def test_an_error_in_the_block_still_closes_the_image(tmp_path: Path) -> None:
    path = create(tmp_path / "img.qcow2", 4 * M)
    with pytest.raises(ValueError, match="in the block"):
        async with Qcow2Image.open(str(path)) as img:
            own = bound_ring()
            await img.write(2 * M, b"\x77" * (4 * K))
            raise ValueError("in the block")
    assert own is not None and own.closed and bound_ring() is None
    assert img.file.fd < 0
    check_clean(path)
    qemu_io(path, f"read -P 0x77 {2 * M} {4 * K}")


async def test_images_one_after_the_other_each_get_a_working_ring(tmp_path: Path) -> None:
    for i, byte in enumerate((0x21, 0x42)):
        path = create(tmp_path / f"img{i}.qcow2", 4 * M)
        async with Qcow2Image.open(str(path)) as img:
            await write_and_read_back(img, 0, byte)
        assert bound_ring() is None
        check_clean(path)
        qemu_io(path, f"read -P {byte:#x} 0 {64 * K}")


async def test_a_failed_final_write_back_is_raised_and_the_ring_closed(tmp_path: Path) -> None:
    path = create(tmp_path / "img.qcow2", 4 * M)

    async def fails() -> None:
        raise OSError(errno.EIO, "write-back failed")

    with pytest.raises(OSError, match="write-back failed"):
        async with Qcow2Image.open(str(path)) as img:
            own = bound_ring()
            await img.write(0, bytes(4 * K))
            img.writeback = fails  # type: ignore[method-assign]
    assert own is not None and own.closed and bound_ring() is None
    assert img.file.fd < 0


async def test_read_only_image_gets_a_ring_too(tmp_path: Path) -> None:
    path = create(tmp_path / "img.qcow2", 4 * M)
    qemu_io(path, f"write -P 0x33 0 {64 * K}")
    async with Qcow2Image.open(str(path), read_only=True) as img:
        buf = bytearray(64 * K)
        await img.read(0, buf)
        assert buf == b"\x33" * (64 * K)
    assert bound_ring() is None
