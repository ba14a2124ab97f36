"""A discard gives the host its space back (host only), as QEMU's qcow2
does with discards passed down: once the freed clusters' tables are
durable their ranges in the image file are holes; a cluster a snapshot
still shares is not punched, and reads back whole through it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aioublk.qcow2 import Qcow2Image
from tests.support.qcow2_util import M, create, qemu_img, qemu_io, to_raw


def allocated(path: Path, offset: int, length: int) -> int:
    """Bytes of [offset, offset+length) of the file that are not holes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total, pos, end = 0, offset, offset + length
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            if data >= end:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            total += hole - data
            pos = hole
        return total
    finally:
        os.close(fd)


async def write_then_discard(path: Path, snapshot_between: bool = False) -> None:
    async with Qcow2Image.open(str(path)) as img:
        await img.write(0, bytearray(b"\x5a" * (4 * M)))
        await img.flush()
    if snapshot_between:
        qemu_img("snapshot", "-c", "keep", path)
    async with Qcow2Image.open(str(path)) as img:
        await img.discard(0, 4 * M)
        await img.flush()
        await img.flush()  # (the frees wait for the flush that made them durable)


def test_discarded_clusters_become_holes(tmp_path: Path) -> None:
    p = create(tmp_path / "d.qcow2", 16 * M)
    asyncio.run(write_then_discard(p))
    size = p.stat().st_size
    assert allocated(p, 0, size) < 2 * M, "the discarded 4 MiB still take space"
    qemu_img("check", p)
    assert to_raw(p, tmp_path / "d.raw").read_bytes()[:4 * M] == bytes(4 * M)


def test_a_cluster_a_snapshot_shares_is_kept(tmp_path: Path) -> None:
    p = create(tmp_path / "s.qcow2", 16 * M)
    asyncio.run(write_then_discard(p, snapshot_between=True))
    assert allocated(p, 0, p.stat().st_size) >= 4 * M
    qemu_img("check", p)
    snap = to_raw(p, tmp_path / "s.raw", snapshot="keep").read_bytes()
    assert snap[:4 * M] == b"\x5a" * (4 * M)
    assert "read" in qemu_io(p, "read -P 0 0 4M")
