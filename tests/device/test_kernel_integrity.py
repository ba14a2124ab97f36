"""Integrity metadata (``UBLK_F_INTEGRITY``) against the real driver, after
the kernel's selftests (test_integrity_01/02.sh): the block device's
integrity attributes in sysfs follow kublk's options, the PI the block layer
generates for a write reaches loop's metadata file (a T10-DIF guard over each
sector, the sector as reference tag), reads verify against it, and a
corrupted guard makes a read fail with EIO.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kernel import add, delete, make_file

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
META = 8  # bytes of metadata per 512-byte sector: one T10 PI tuple


def sysfs(dev_id: int, name: str) -> str:
    return Path(f"/sys/block/ublkb{dev_id}/integrity/{name}").read_text().strip()


@pytest.mark.parametrize("args,want", [
    (["--metadata_size", "8"], ("0", "nop", "512", "0")),
    (["--integrity_capable", "--metadata_size", "64", "--pi_offset", "56", "--csum_type", "ip"],
     ("1", "T10-DIF-TYPE3-IP", "512", "0")),
    (["--integrity_reftag", "--metadata_size", "8", "--csum_type", "t10dif"],
     ("0", "T10-DIF-TYPE1-CRC", "512", "0")),
    (["--metadata_size", "16", "--csum_type", "nvme", "--tag_size", "8"],
     ("0", "EXT-DIF-TYPE3-CRC64", "512", "8")),
])
def test_sysfs_integrity_follows_the_options(args: list[str], want: tuple[str, ...]) -> None:
    d = add("-t", "null", "-s", str(64 * MiB), "-u", "--no_auto_part_scan", *args)
    try:
        assert (sysfs(d.dev_id, "device_is_integrity_capable"), sysfs(d.dev_id, "format"),
                sysfs(d.dev_id, "protection_interval_bytes"), sysfs(d.dev_id, "tag_size")) \
            == want
        if "--csum_type" in args:  # null's 0xFF metadata is not verified: reads work
            _read(f"/dev/ublkb{d.dev_id}", 0, 64 << 10)
    finally:
        delete(d.dev_id)


def crc16_t10dif(data: bytes) -> int:
    """The T10-DIF guard: CRC-16, polynomial 0x8BB7, no reflection, init 0."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8BB7 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc


def _write(dev: str, offset: int, data: bytes) -> None:
    fd = os.open(dev, os.O_WRONLY | os.O_DIRECT)
    try:
        buf = _aligned(len(data))
        buf[:] = data
        assert os.pwrite(fd, buf, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(dev: str, offset: int, length: int) -> bytes:
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = _aligned(length)
        assert os.preadv(fd, [buf], offset) == length
        return bytes(buf)
    finally:
        os.close(fd)


def _aligned(length: int) -> memoryview:
    return memoryview(mmap.mmap(-1, length))[:length]  # page aligned, as O_DIRECT needs


@pytest.fixture
def pi_loop(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    data = make_file(tmp_path / "data.img", 16 * MiB)
    meta = make_file(tmp_path / "meta.img", 16 * MiB // 512 * META)
    d = add("-t", "loop", "-u", "--no_auto_part_scan", "--integrity_reftag",
            "--metadata_size", str(META), "--csum_type", "t10dif", str(data), str(meta))
    yield d.dev_id, meta
    delete(d.dev_id)


def test_written_pi_reaches_the_metadata_file(pi_loop: tuple[int, Path]) -> None:
    dev_id, meta = pi_loop
    dev = f"/dev/ublkb{dev_id}"
    assert sysfs(dev_id, "format") == "T10-DIF-TYPE1-CRC"
    data = os.urandom(64 << 10)
    start = 1 * MiB
    _write(dev, start, data)
    stored = meta.read_bytes()
    for i in range(len(data) // 512):
        sector = (start >> 9) + i
        tuple_ = stored[sector * META:(sector + 1) * META]
        guard = int.from_bytes(tuple_[0:2], "big")
        ref = int.from_bytes(tuple_[4:8], "big")
        assert guard == crc16_t10dif(data[i * 512:(i + 1) * 512]), sector
        assert ref == sector & 0xFFFF_FFFF, sector
    # sectors never written keep the 0xFF escape the block layer does not check
    assert stored[:META] == b"\xff" * META
    assert _read(dev, start, len(data)) == data  # verified by the block layer on the way


def test_a_corrupted_guard_fails_the_read(pi_loop: tuple[int, Path]) -> None:
    dev_id, meta = pi_loop
    dev = f"/dev/ublkb{dev_id}"
    data = os.urandom(4096)
    _write(dev, 0, data)
    assert _read(dev, 0, 4096) == data
    with open(meta, "r+b") as f:  # the first sector's guard, flipped
        guard = f.read(2)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in guard))
    with pytest.raises(OSError) as e:
        _read(dev, 0, 4096)
    # the block layer's verification: BLK_STS_PROTECTION, which reaches a
    # reader as EILSEQ
    assert e.value.errno == errno.EILSEQ
    assert _read(dev, 4096, 4096)  # the sectors after it still read
