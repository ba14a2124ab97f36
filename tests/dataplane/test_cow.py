"""C's copy-on-write, on a real ring with the test playing the kernel
(``test_hostile_kernel.Plane``): a write to COW or COW_SUB granules lands in
its pool cluster with the old data around it, in one read and one write when
it stays inside a granule (copy mode), or as copies beside the write (across
granules, and with -u), and is recorded before its commit."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from aioublk._uring import lib
from aioublk.dataplane.extents import COW, COW_SUB, ExtentTable, Record
from aioublk.dataplane.maps import Extents
from aioublk.dataplane.plane import EV_IO
from aioublk.kernel import uapi
from aioublk.ring import Ring
from tests.dataplane.test_hostile_kernel import Plane
from tests.support.files import Where

G = 64 * 1024
SUB = G // 32

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("kind", [COW, COW_SUB], ids=["cow", "cow_sub"])
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
async def test_c_copies_on_write_around_the_write(where: Where, kind: int,
                                                  user_copy: bool) -> None:
    """Writes inside a granule (head and tail to copy; only a head; a
    whole granule: nothing) and one across two granules (the first's head,
    the last's tail): each new cluster holds the old data with the write
    over it (COW_SUB: only the subclusters it touched, the rest left zero
    for the engine's bitmap), and a record says where."""
    old = os.urandom(6 * G)
    base = os.open(where.dir / "base", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(base, old, 0)
    alloc = os.open(where.dir / "alloc", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(alloc, 16 * G)
    table = ExtentTable(G)
    table.set_alloc(alloc, 8, 8)
    slot = table.attach()
    assert table.pool_add(slot, [k * 2 * G for k in range(6)]) == 6
    assert table.insert_kind(kind, 0, 6 * G, base, 0)
    ring = Ring(16)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = Plane(ring, alloc, depth=2, max_io=2 * G, mode=mode,
                  map=Extents(table, slot=slot), copy_in=user_copy, setup=where.setup)
    host = 0
    try:
        for dev, length in ((4096 + 512, 8192), (2 * G - 4096, 4096), (2 * G, G),
                            (3 * G + G // 2, G)):
            body = os.urandom(length)
            await plane.write(0, dev, body)
            assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)], (dev, length)
            records = table.drain()
            first, last = dev // G, (dev + length - 1) // G
            assert [(r.gran, r.ok) for r in records] == [(g, True) for g in range(first, last + 1)]
            for r in records:
                want = bytearray(old[r.gran * G:(r.gran + 1) * G])
                lo, hi = max(dev, r.gran * G), min(dev + length, (r.gran + 1) * G)
                want[lo - r.gran * G:hi - r.gran * G] = body[lo - dev:hi - dev]
                if kind == COW_SUB:  # (outside the touched subclusters: the pool's zeros)
                    s0, s1 = (lo - r.gran * G) // SUB * SUB, -(-(hi - r.gran * G) // SUB) * SUB
                    want[:s0] = bytes(s0)
                    want[s1:] = bytes(G - s1)
                    assert r.subs != 0
                assert os.pread(alloc, G, r.host_off) == want, (dev, length, r.gran)
                assert r.host_off == host
                host += 2 * G
        c = plane.dp.counts[0]
        assert (c.c_alloc, c.py_handed) == (5, 0)
        assert plane.dp.inflight == 0 and table.busy(0, 6 * G) == 0
        assert table.drain() == []
    finally:
        plane.close()
        os.close(base)
        os.close(alloc)


async def test_a_merged_copy_whose_old_data_cannot_be_read_goes_to_python(
        where: Where) -> None:
    """The old data's read comes back short (the base ends inside the
    granule): the cluster is recorded failed (freed, never referenced) and
    the write goes to Python from the start. Through the ring nothing is
    written; on tmpfs the kernel copies the head before the tail comes up
    short, which the freed cluster may keep."""
    base = os.open(where.dir / "base", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(base, os.urandom(G // 2), 0)
    alloc = os.open(where.dir / "alloc", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(alloc, 4 * G)
    table = ExtentTable(G)
    table.set_alloc(alloc, 8, 8)
    slot = table.attach()
    assert table.pool_add(slot, [2 * G]) == 1
    assert table.insert_kind(COW, 0, G, base, 0)
    ring = Ring(16)
    plane = Plane(ring, alloc, depth=2, max_io=G, map=Extents(table, slot=slot),
                  setup=where.setup)
    try:
        plane.buf(0)[:4096] = b"\x11" * 4096
        plane.fetch(0, uapi.Op.WRITE, 8, 8)
        await plane.wait_for(lambda: plane.events)
        assert plane.events[0][:2] == (lib.AUR_DP_EV_RETRY, 0)
        assert table.drain() == [Record(0, 2 * G, False, slot)]
        if not where.setup:
            assert os.pread(alloc, G, 2 * G) == bytes(G)
        assert plane.dp.inflight == 0 and table.busy(0, G) == 0
    finally:
        plane.close()
        os.close(base)
        os.close(alloc)


async def test_tmpfs_files_the_kernel_will_not_copy_between_are_merged_in_the_buffer(
        ) -> None:
    """On tmpfs C copies a cluster's old data with copy_file_range; between
    two tmpfs mounts (a memfd base, an image in /dev/shm) the kernel refuses
    (EXDEV), and C merges through its buffer instead, then and after."""
    old = os.urandom(2 * G)
    base = os.memfd_create("base")
    os.pwrite(base, old, 0)
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    alloc = os.open(d / "alloc", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(alloc, 4 * G)
    with pytest.raises(OSError) as refused:  # (what the test stands on)
        os.copy_file_range(base, alloc, 4096, 0, 0)
    assert refused.value.errno == errno.EXDEV
    table = ExtentTable(G)
    table.set_alloc(alloc, 8, 8)
    slot = table.attach()
    assert table.pool_add(slot, [2 * G, 3 * G]) == 2
    assert table.insert_kind(COW, 0, 2 * G, base, 0)
    plane = Plane(Ring(16), alloc, depth=2, max_io=G, map=Extents(table, slot=slot),
                  setup={"inline_io": lib.AUR_DP_INLINE_RAM})
    try:
        for gran in (0, 1):
            body = os.urandom(4096)
            await plane.write(0, gran * G + 8192, body)
            assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]
            [r] = table.drain()
            assert (r.gran, r.ok) == (gran, True)
            want = bytearray(old[gran * G:(gran + 1) * G])
            want[8192:8192 + 4096] = body
            assert os.pread(alloc, G, r.host_off) == want
        assert (plane.dp.counts[0].c_alloc, plane.dp.counts[0].py_handed) == (2, 0)
    finally:
        plane.close()
        os.close(base)
        os.close(alloc)
        shutil.rmtree(d)
