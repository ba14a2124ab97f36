"""Images with extended L2 entries (``extended_l2=on``: 32 subclusters per
cluster, each allocated, zero or neither) read and written by the engine,
judged by qemu-img (host only): what QEMU wrote per subcluster reads back
as QEMU reads it, over raw and qcow2 backing files; what we write (in
place, into partly allocated clusters, over zero subclusters, zeroed and
discarded) is what qemu-img compare reads, and qemu-img check is clean."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.support.qcow2_util import (
    K,
    M,
    check_clean,
    compare_identical,
    create,
    qemu_io,
    qemu_map,
    read_file,
    to_raw,
)

pytestmark = pytest.mark.asyncio

SIZE = 16 * M

#: what qemu-io writes first: subclusters in part and whole, zeros, discards
QEMU_WRITES = ["write -P 1 3k 2k", "write -P 2 70k 10k", "write -z 200k 8k", "write -z 1M 64k",
               "write -P 3 2M 64k", "discard 300k 2k", "write -P 4 5M 1536",
               "write -P 5 9M 700k", "write -z 9M 100k"]


def chain(d: Path, base: str, cluster_size: int) -> Path:
    """An extended L2 image over a ``base`` ("raw", "qcow2" or "none")."""
    if base == "none":
        return create(d / "ext.qcow2", SIZE, extended_l2=True, cluster_size=cluster_size)
    b = d / f"base.{base}"
    if base == "raw":
        b.write_bytes(random.Random(1).randbytes(SIZE))
    else:
        create(b, SIZE)
        qemu_io(b, "write -P 0x61 0 4M", "write -P 0x62 6M 3M")
    return create(d / "ext.qcow2", SIZE, backing=b.name, backing_fmt=base,
                  extended_l2=True, cluster_size=cluster_size)


SHAPES = [("raw", 64 * K), ("qcow2", 32 * K), ("none", 16 * K), ("raw", 2 * M)]


@pytest.mark.parametrize(("base", "cluster_size"), SHAPES,
                         ids=[f"{b}-{c // K}k" for b, c in SHAPES])
async def test_reads_and_writes_judged_by_qemu_img(base: str, cluster_size: int,
                                                   tmp_path: Path) -> None:
    from aioublk.qcow2 import Qcow2Image

    image = chain(tmp_path, base, cluster_size)
    qemu_io(image, *QEMU_WRITES)
    want = bytearray(read_file(to_raw(image, tmp_path / "want.raw")))
    async with Qcow2Image.open(str(image)) as img:
        got = bytearray(img.size)
        await img.read(0, got)
        assert got == want, "the engine reads what QEMU reads"
        rnd = random.Random(cluster_size)
        sc = cluster_size // 32
        for n in range(40):
            # subcluster-sized and -aligned pieces, odd sectors, whole clusters
            length = rnd.choice([512, sc, 3 * sc + 512, cluster_size, 2 * cluster_size + 1024])
            at = rnd.randrange(0, 10 * M - length) // 512 * 512
            op = rnd.choice(["w", "w", "w", "z", "d"])
            if op == "w":
                data = os.urandom(length)
                await img.write(at, data)
                want[at:at + length] = data
            elif op == "z":
                await img.write_zeroes(at, length)
                want[at:at + length] = bytes(length)
            else:  # (a discard zeroes here, or shows the backing file where
                # QEMU would: compare what the engine reads afterwards)
                await img.discard(at, length)
                got = bytearray(length)
                await img.read(at, got)
                want[at:at + length] = got
            if n % 10 == 9:
                await img.flush()
        await img.flush()
        got = bytearray(img.size)
        await img.read(0, got)
        assert got == want
    check_clean(image)
    raw = tmp_path / "want.raw"
    raw.write_bytes(bytes(want))
    compare_identical(image, raw)
    # and QEMU writes over what we wrote, by subclusters
    qemu_io(image, "write -P 0x77 1k 1k", "write -z 40k 4k", f"write -P 0x78 {cluster_size} 3k")
    with open(raw, "r+b") as f:
        for at, data in ((1024, b"\x77" * 1024), (40 * K, bytes(4 * K)),
                         (cluster_size, b"\x78" * 3072)):
            f.seek(at)
            f.write(data)
    check_clean(image)
    compare_identical(image, raw)


async def test_c_never_serves_a_cluster_whose_subclusters_differ(tmp_path: Path) -> None:
    """The extent table gets whole clusters only: a partly allocated one is
    left to Python (which reads the backing file where it shows)."""
    from aioublk.dataplane.extents import MAP
    from aioublk.qcow2 import Qcow2Image
    from aioublk.qcow2.format import OFFSET_MASK

    image = chain(tmp_path, "raw", 64 * K)
    qemu_io(image, "write -P 1 4k 4k", "write -P 2 64k 64k")
    async with Qcow2Image.open(str(image)) as img:
        table = img.extent_table()
        assert table is not None
        buf = bytearray(128 * K)
        await img.read(0, buf)
        t = img.l2.tables[img.l1[0] & OFFSET_MASK]
        assert t.pub[0] == 0  # cluster 0: two subclusters of 32
        assert t.pub[1] == MAP  # cluster 1: whole
        assert img._mapped(0, 4096, False) == -1
        assert img._mapped(64 * K, 4096, False) > 0


async def test_a_partial_write_allocates_only_its_subclusters(tmp_path: Path) -> None:
    """What subclusters are for: a 4 KiB write into an empty cluster over a
    backing file copies nothing but its subclusters' edges; the rest of the
    cluster still shows the backing file, as after QEMU's own write."""
    from aioublk.qcow2 import Qcow2Image

    image = chain(tmp_path, "raw", 64 * K)
    twin = tmp_path / "twin.qcow2"
    create(twin, SIZE, backing="base.raw", backing_fmt="raw", extended_l2=True,
           cluster_size=64 * K)
    data = os.urandom(4 * K)
    async with Qcow2Image.open(str(image)) as img:
        await img.write(8 * K + 1024, data)  # subclusters 4-6 of 2 KiB: [8K, 14K)
        await img.flush()
    (tmp_path / "data").write_bytes(data)
    qemu_io(twin, f"write -s {tmp_path / 'data'} {8 * K + 1024} {4 * K}")
    ours = [(m["start"], m["length"]) for m in qemu_map(image) if m["depth"] == 0]
    assert ours == [(8 * K, 6 * K)]
    assert ours == [(m["start"], m["length"]) for m in qemu_map(twin) if m["depth"] == 0]
    check_clean(image)


async def test_zeroes_by_subcluster_bits(tmp_path: Path) -> None:
    """Write-zeroes and discard of whole subclusters inside a cluster set
    their zero bits (no data written), as QEMU's write -z does."""
    from aioublk.qcow2 import Qcow2Image

    image = chain(tmp_path, "raw", 64 * K)
    twin = tmp_path / "twin.qcow2"
    create(twin, SIZE, backing="base.raw", backing_fmt="raw", extended_l2=True,
           cluster_size=64 * K)
    async with Qcow2Image.open(str(image)) as img:
        await img.write(0, b"\x11" * (64 * K))  # a whole cluster of data
        await img.write_zeroes(8 * K, 8 * K)  # subclusters 4-7
        await img.write_zeroes(128 * K + 6 * K, 4 * K)  # over the backing file: 3-4
        await img.discard(256 * K + 1024, 8 * K)  # 1 KiB edges zeroed, 1-4 by bits
        await img.flush()
    qemu_io(twin, f"write -P 0x11 0 {64 * K}", f"write -z {8 * K} {8 * K}",
            f"write -z {128 * K + 6 * K} {4 * K}", f"write -z {256 * K + 1024} {8 * K}")
    assert [m for m in qemu_map(image) if m["start"] < 320 * K] == \
        [m for m in qemu_map(twin) if m["start"] < 320 * K]
    check_clean(image)
    compare = tmp_path / "twin.raw"
    to_raw(twin, compare)
    compare_identical(image, compare)
