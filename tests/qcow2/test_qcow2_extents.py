"""The qcow2 engine on the data plane (host only: no ublk, no kernel).

The image publishes each L2 table in its extent table when the table enters
the cache, and takes clusters back before any change of where their data
lives (the invariant in ``aioublk.qcow2.image``, "The data plane"). Here:

- which clusters are published, writable, read-only or as zeros, and which
  never are (compressed, metadata); backing data as the chain places it;
- every change of a mapping takes its extents back: discard, write_zeroes,
  copy-on-write, L2 eviction, a corrupt mark;
- an extent a request holds (``ExtentTable.acquire``, as C does) keeps the
  change waiting until it is released;
- random concurrent I/O of ``test_qcow2_writes``, with reads and writes the
  table covers served as C serves them (straight to the image file, holding
  the extent across awaits), leaves an image QEMU agrees with.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest

from aioublk.dataplane.extents import DONE, FAILED, UNUSED, ZERO_FD, ExtentTable, ZipCopy, Zipped
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2.format import COPIED, OFFSET_MASK, ZERO
from aioublk.ring import Ring
from tests.qcow2.test_qcow2_writes import (
    Op,
    hot_spots,
    new_case,
    random_io,
    read_matches_mirror,
    run_op,
    verify,
)
from tests.support.qcow2_util import K, M, create, qemu_img, qemu_io, zipped_bytes

pytestmark = pytest.mark.asyncio

CS = 64 * K


def published(table: ExtentTable, vc: int, cs: int = CS) -> str:
    """'rw', 'ro', 'zero', 'zip' (compressed, C inflates) or '-': how cluster
    ``vc`` is in the table."""
    if table.lookup(vc * cs, cs, write=True) is not None:
        return "rw"
    pieces = table.lookup(vc * cs, cs, write=False)
    if pieces is None:
        return "-"
    if isinstance(pieces[0], Zipped):
        return "zip"
    return "zero" if pieces[0][0] == ZERO_FD else "ro"


def unpublish(img: Qcow2Image) -> None:
    """Take everything back without republishing (as if the tables had
    entered the cache before the data plane asked)."""
    assert img.extents is not None
    img.extents.invalidate(0, (1 << 64) - 1)
    for t in img.l2.tables.values():
        t.pub[:] = bytes(len(t.pub))


def host_of(img: Qcow2Image, vc: int) -> int:
    e = img.l2.lookup(vc)
    assert e is not None
    return int(e & OFFSET_MASK)


#: how mixed()'s clusters are published (the rest, 6-63, unallocated: zeros)
MIXED = ["rw", "rw", "zero", "zero", "-", "rw"]


def mixed(path: Path) -> Path:
    """Clusters 0-1 data, 2 zero, 3 unallocated, 4 compressed, 5 data (4 MiB)."""
    create(path, 4 * M, cluster_size=CS)
    qemu_io(path, "write -P 1 0 128k", "write -z 128k 64k", "write -c -P 3 256k 64k",
            "write -P 5 320k 64k")
    return path


async def read_all(img: Qcow2Image, size: int, step: int = CS) -> None:
    for off in range(0, size, step):
        await img.read(off, bytearray(step))


async def test_one_read_publishes_the_whole_table(tmp_path: Path, ring: Ring) -> None:
    """The first read loads the L2 table, and the whole table is published in
    one call: data writable, zero and unallocated clusters as zeros (no
    backing file), the compressed one not at all, nothing past the disk."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None and table is img.extent_table()
        calls: list[int] = []
        real = table.publish_l2

        def counting(*args: Any, **kw: Any) -> Any:
            calls.append(len(args[2]))
            return real(*args, **kw)
        table.publish_l2 = counting  # type: ignore[method-assign]
        await img.read(0, bytearray(4096))
        assert calls == [img.cluster_size // 8]
        assert [published(table, vc) for vc in range(64)] == MIXED + ["zero"] * 58
        assert published(table, 64) == "-"
        assert len(table) == 63
        assert table.lookup(0, CS, write=False) == [(img.file.fd, host_of(img, 0), CS)]
        assert sorted(img.plane.pub_host.items()) == sorted(
            (host_of(img, vc) // CS, vc) for vc in (0, 1, 5))
        t = next(iter(img.l2.tables.values()))
        assert list(t.pub[:7]) == [1, 1, 2, 2, 0, 1, 2]
        # the multi-cluster read path publishes each cluster it reads (here
        # after everything was taken back)
        unpublish(img)
        await img.read(0, bytearray(2 * CS))
        assert [published(table, vc) for vc in range(3)] == ["rw", "rw", "-"]
    finally:
        await img.close()
    assert len(table) == 0  # closing takes everything back


async def test_metadata_clusters_are_never_published(tmp_path: Path, ring: Ring) -> None:
    """An L2 entry naming a metadata cluster (a corrupt image: here the L2
    table itself, or the refcount table) is not published, neither with the
    table nor alone; reading it is the engine's, which reports it."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await img.read(0, bytearray(4096))
        t = next(iter(img.l2.tables.values()))
        unpublish(img)
        t.entries[0] = t.offset | COPIED
        t.entries[1] = img.refs.table_offset | COPIED
        img.plane.entered(t)
        assert [published(table, vc) for vc in range(6)] == ["-", "-"] + MIXED[2:]
        img.plane.publish_in(t, 0)
        assert published(table, 0) == "-"
    finally:
        img.release()


async def test_single_cluster_fast_paths_publish(tmp_path: Path, ring: Ring) -> None:
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await img.read(0, bytearray(CS))      # loads the L2 table
        unpublish(img)
        assert len(table) == 0
        assert img._mapped(CS + 512, 4096, False) >= 0       # start_read's lookup
        assert img._mapped(5 * CS, 4096, True) >= 0          # start_write's lookup
        assert [published(table, vc) for vc in (0, 1, 5)] == ["-", "rw", "rw"]
    finally:
        await img.close()


async def test_publishing_is_once_per_cluster(tmp_path: Path, ring: Ring) -> None:
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        newly: list[int] = []   # per call, the entries it published
        real = table.publish_l2

        def counting(*args: Any, **kw: Any) -> Any:
            pub = args[3]
            before = sum(1 for b in pub if b)
            got = real(*args, **kw)
            newly.append(sum(1 for b in pub if b) - before)
            return got
        table.publish_l2 = counting  # type: ignore[method-assign]
        for _ in range(3):
            await read_all(img, 6 * CS, 4096)
            await img.write(4096, b"x" * 4096)
        assert newly[0] == 63 and not any(newly[1:])
    finally:
        await img.close()


async def test_no_table_until_asked(tmp_path: Path, ring: Ring) -> None:
    """Without a data plane (no ``extent_table`` call) nothing is published."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        await read_all(img, 6 * CS)
        assert img.extents is None
        assert not any(any(t.pub) for t in img.l2.tables.values())
    finally:
        await img.close()


async def test_backing_clusters_are_published_read_only(tmp_path: Path, ring: Ring) -> None:
    """A read through the backing file publishes what it read, and the rest
    of its L2 span, where the backing image holds it: read-only, in the
    backing file; a write copies the cluster up and publishes it writable."""
    base = create(tmp_path / "base.qcow2", 4 * M, cluster_size=CS)
    qemu_io(base, "write -P 7 0 256k")
    top = create(tmp_path / "top.qcow2", None, cluster_size=CS, backing=base)
    qemu_io(top, "write -P 8 64k 64k")
    img = Qcow2Image.open(str(top))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 4 * CS)
        assert [published(table, vc) for vc in range(64)] == \
            ["ro", "rw", "ro", "ro"] + ["zero"] * 60
        pieces = table.lookup(0, CS, write=False)
        assert pieces is not None and len(pieces) == 1
        fd, host, n = pieces[0]
        assert os.path.samestat(os.fstat(fd), os.stat(base))
        got = mmap.mmap(-1, n)  # (the backing file is open O_DIRECT: an aligned buffer)
        assert os.preadv(fd, [got], host) == n and got[:] == b"\x07" * CS
        # a write to a backing cluster copies it up: then it is published
        await img.write(0, b"y" * 4096)
        assert published(table, 0) == "rw"
    finally:
        await img.close()


async def test_zeros_past_the_backing_file_are_published(tmp_path: Path, ring: Ring) -> None:
    """Unallocated clusters read as zeros where no backing data lies under
    them (wholly past the backing file's end), and a zero-flagged cluster
    hides the backing file: both are published as zeros. A cluster the
    backing file covers is published once a read goes through the backing
    file, as the backing image's data; one it covers in part stays Python's
    (the backing cluster's bytes past its disk's end are not zeros by any
    rule)."""
    base = create(tmp_path / "base.qcow2", 160 * K, cluster_size=CS)   # 2.5 clusters
    qemu_io(base, "write -P 7 0 160k")
    top = create(tmp_path / "top.qcow2", 1 * M, cluster_size=CS, backing=base)
    qemu_io(top, "write -z 0 64k", "write -P 8 256k 64k")
    img = Qcow2Image.open(str(top))
    try:
        table = img.extent_table()
        assert table is not None
        await img.read(4 * CS, bytearray(4096))  # (no backing data: publishes no more)
        assert [published(table, vc) for vc in range(16)] == \
            ["zero", "-", "-", "zero", "rw"] + ["zero"] * 11
        await img.read(CS, bytearray(4096))
        assert [published(table, vc) for vc in range(16)] == \
            ["zero", "ro", "-", "zero", "rw"] + ["zero"] * 11
        buf = bytearray(16 * CS)
        await img.read(0, buf)
        assert buf[CS:2 * CS] == b"\x07" * CS and buf[2 * CS:160 * K] == b"\x07" * (32 * K)
        assert not any(buf[:CS]) and not any(buf[160 * K:4 * CS])
        # a write to a published zero cluster misses in the table and allocates
        assert table.lookup(5 * CS, 4096, write=True) is None
        await img.write(5 * CS + 512, b"n" * 512)
        assert published(table, 5) == "rw"
        await img.read(5 * CS, memoryview(buf)[:CS])
        assert buf[:CS] == bytes(512) + b"n" * 512 + bytes(CS - 1024)
    finally:
        await img.close()
    qemu_img("check", top)


async def test_read_only_and_write_through_publish_read_only(tmp_path: Path,
                                                             ring: Ring) -> None:
    path = mixed(tmp_path / "a.qcow2")
    for kw in ({"read_only": True}, {"metadata_write_through": True}):
        img = Qcow2Image.open(str(path), **kw)  # type: ignore[arg-type]
        try:
            table = img.extent_table()
            assert table is not None
            await read_all(img, 6 * CS)
            assert [published(table, vc) for vc in range(6)] == \
                ["ro", "ro", "zero", "zero", "-", "ro"], kw
        finally:
            await img.close()


async def test_write_through_set_later_makes_extents_read_only(tmp_path: Path,
                                                               ring: Ring) -> None:
    """The target sets ``metadata_write_through`` in ``configure``: what was
    published writable before is published again read-only."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 2 * CS)
        assert published(table, 0) == "rw"
        img.metadata_write_through = True
        img.republish()
        assert [published(table, vc) for vc in range(6)] == \
            ["ro", "ro", "zero", "zero", "-", "ro"]
    finally:
        await img.close()


async def test_snapshot_shared_cluster_is_read_only_and_cow_moves_it(
        tmp_path: Path, ring: Ring) -> None:
    path = mixed(tmp_path / "a.qcow2")
    qemu_img("snapshot", "-c", "s1", path)
    img = Qcow2Image.open(str(path))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 6 * CS)
        assert [published(table, vc) for vc in range(6)] == \
            ["ro", "ro", "zero", "zero", "-", "ro"]
        old = host_of(img, 1)
        await img.write(CS + 512, b"z" * 512)  # copy-on-write (of the L2 table too)
        new = host_of(img, 1)
        assert new != old
        assert table.lookup(CS, CS, write=True) == [(img.file.fd, new, CS)]
        # the table's copy is published as the table was, less what changed
        assert [published(table, vc) for vc in range(6)] == \
            ["ro", "rw", "zero", "zero", "-", "ro"]
        assert len(table) == 63
    finally:
        await img.close()
    qemu_img("check", path)


@pytest.mark.parametrize("how", ["discard", "zero", "zero-unmap"])
async def test_changes_take_extents_back(how: str, tmp_path: Path, ring: Ring) -> None:
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 6 * CS)
        host = host_of(img, 1)
        if how == "discard":
            await img.discard(CS, CS)
        else:
            await img.write_zeroes(CS, CS, unmap=how == "zero-unmap")
        assert published(table, 1) == "zero"   # published again, as zeros
        assert [published(table, vc) for vc in (0, 5)] == ["rw", "rw"]
        e = img.l2.lookup(1)
        if how == "zero":  # the cluster stays, with the zero flag: zeros all the same
            assert e == host | COPIED | ZERO
        await read_all(img, 6 * CS)
        assert published(table, 1) == "zero"
        assert table.lookup(CS, 4096, write=True) is None   # a write is the engine's
        await img.write(CS, b"w" * 4096)
        assert published(table, 1) == "rw"
        buf = bytearray(CS)
        await img.read(CS, buf)
        assert buf == b"w" * 4096 + bytes(CS - 4096)
    finally:
        await img.close()
    qemu_img("check", tmp_path / "a.qcow2")


async def test_eviction_takes_extents_back(tmp_path: Path, ring: Ring) -> None:
    """4 KiB clusters: an L2 table maps 2 MiB; the cache holds 4 tables."""
    cs = 4 * K
    path = create(tmp_path / "a.qcow2", 16 * M, cluster_size=cs)
    qemu_io(path, *(f"write -P {i + 1} {i * 2 * M} 4k" for i in range(6)))
    img = Qcow2Image.open(str(path), cache_bytes=4 * cs)
    try:
        table = img.extent_table()
        assert table is not None
        per = 2 * M // cs
        await img.read(0, bytearray(cs))
        assert published(table, 0, cs) == "rw"
        for i in range(1, 6):
            await img.read(i * 2 * M, bytearray(cs))
        assert published(table, 0, cs) == "-"
        assert published(table, 1, cs) == "-"   # the zeros went with their table
        assert published(table, 5 * per, cs) == "rw"
        assert published(table, 5 * per + 1, cs) == "zero"
        assert len(table) == 4 * per
    finally:
        await img.close()


async def test_corrupt_mark_takes_everything_back(tmp_path: Path, ring: Ring) -> None:
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 6 * CS)
        assert len(table) == 63
        with pytest.raises(OSError):
            img._mark_corrupt("a test")
        assert len(table) == 0
        assert img.extent_table() is None
        await read_all(img, 6 * CS)  # still readable, nothing published
        assert len(table) == 0
    finally:
        img.release()


async def test_aliased_l2_table_means_no_data_plane(tmp_path: Path, ring: Ring) -> None:
    """An L1 table naming one L2 table twice: a change through one name would
    leave the other's extents stale, so the image refuses a data plane."""
    path = create(tmp_path / "a.qcow2", 2 * 512 * M, cluster_size=CS)
    qemu_io(path, "write -P 1 0 64k")
    img = Qcow2Image.open(str(path), read_only=True)
    l1_off = img.h.l1_table_offset
    img.release()
    with open(path, "r+b") as f:
        f.seek(l1_off)
        first = f.read(8)
        f.seek(l1_off + 8)
        f.write(first)
    img = Qcow2Image.open(str(path), read_only=True)
    try:
        assert img.extent_table() is None
    finally:
        img.release()


# -- a held extent keeps the change waiting -----------------------------------------------


async def _held_then_released(img: Qcow2Image, vc: int, change: Any, *,
                              write: bool) -> tuple[list[str], int]:
    """Hold cluster ``vc`` as C would, start ``change``, release later: the
    events in order, and the entry after."""
    table = img.extent_table()
    assert table is not None
    held = table.acquire(vc * CS, 4096, write=write)
    assert held is not None
    before = img.l2.lookup(vc)
    events: list[str] = []

    async def run() -> None:
        await change
        events.append("changed")
    task = asyncio.create_task(run())
    for _ in range(30):
        await asyncio.sleep(0.001)
        assert img.l2.lookup(vc) == before, "the mapping changed while held"
    assert not task.done()
    assert published(table, vc) == "-", "taken back before waiting"
    events.append("released")
    table.release(held[1])
    await asyncio.wait_for(task, 5)
    after = img.l2.lookup(vc)
    assert after is not None
    return events, after


@pytest.mark.parametrize("how", ["discard", "zero", "zero-unmap"])
async def test_held_extent_delays_the_change(how: str, tmp_path: Path, ring: Ring) -> None:
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        img.extent_table()
        await read_all(img, 2 * CS)
        host = host_of(img, 1)
        change = img.discard(CS, CS) if how == "discard" else \
            img.write_zeroes(CS, CS, unmap=how == "zero-unmap")
        events, after = await _held_then_released(img, 1, change, write=True)
        assert events == ["released", "changed"]
        assert after & OFFSET_MASK != host or after & ZERO
    finally:
        await img.close()


async def test_held_read_delays_copy_on_write(tmp_path: Path, ring: Ring) -> None:
    path = mixed(tmp_path / "a.qcow2")
    qemu_img("snapshot", "-c", "s1", path)
    img = Qcow2Image.open(str(path))
    try:
        img.extent_table()
        await read_all(img, 2 * CS)
        host = host_of(img, 1)
        events, after = await _held_then_released(img, 1, img.write(CS, b"c" * 512),
                                                  write=False)
        assert events == ["released", "changed"]
        assert after & OFFSET_MASK != host and after & COPIED
    finally:
        await img.close()
    qemu_img("check", path)


# -- random I/O with a stand-in for C -----------------------------------------------------


class DataPlaneStandIn:
    """The image as the device sees it with the data plane on: a read or
    write the table covers goes straight to the image file (holding the
    extents across awaits, so changes interleave with it); a miss, or an I/O
    that fails, goes to the image (from the start), as C hands it to Python.

    With ``c_alloc`` it attaches a pool as a queue's data plane does, and a
    write to an ALLOC or COW granule takes a cluster from it (copying what it
    does not cover of a COW granule there first, as C does): one in 50 such writes
    then "fails" after writing (FAILED: Python serves it anew) and one in 50
    never starts (UNUSED); the pool is refilled as C's notification would
    have the engine do."""

    def __init__(self, img: Qcow2Image, rng: random.Random, *, c_alloc: bool = False) -> None:
        self.img = img
        self.rng = rng
        table = img.extent_table()
        assert table is not None
        self.table = table
        self.slot = img.attach_pool() if c_alloc else None
        assert self.slot is None or self.slot >= 0
        self.served = 0
        self.zeros = 0  # reads that had a run of ZERO granules
        self.allocated = 0  # writes that allocated and were answered by "C"
        self.copied = 0  # copies of backing data a copy-on-write made
        self.inflated = 0  # compressed clusters' parts read

    def __getattr__(self, name: str) -> Any:
        return getattr(self.img, name)

    async def _direct(self, off: int, view: memoryview, write: bool) -> bool:
        if self.slot is not None:
            self.img.service()  # (C notifies at half: here, at every request)
        held = self.table.acquire(off, len(view), write=write, slot=self.slot)
        if held is None:
            return False
        pieces, handle = held
        outcome = DONE
        allocating = write and handle.allocates
        if allocating:
            outcome = self.rng.choices((DONE, FAILED, UNUSED), (48, 1, 1))[0]
            if outcome == UNUSED:
                self.table.release(handle, UNUSED)
                return False
        try:
            await asyncio.sleep(self.rng.choice((0, 0, 0.0005, 0.002)))
            for copy in handle.copies:  # (a COW's rest, copied first)
                if isinstance(copy, ZipCopy):
                    body, dfd, doff = zipped_bytes(copy.src), copy.dst_fd, copy.dst_off
                else:
                    sfd, soff, dfd, doff, n = copy
                    body = os.pread(sfd, n, soff)
                if os.pwrite(dfd, body, doff) != len(body):
                    outcome = FAILED
                    return False
                self.copied += 1
            pos = 0
            for piece in pieces:
                if isinstance(piece, Zipped):  # (reads only) C inflates it
                    assert not write
                    view[pos:pos + piece.length] = zipped_bytes(piece)
                    pos += piece.length
                    self.inflated += 1
                    continue
                fd, host, n = piece
                if fd == ZERO_FD:  # (reads only) C fills the buffer
                    assert not write
                    view[pos:pos + n] = bytes(n)
                    done = n
                    self.zeros += 1
                elif write:
                    done = os.pwrite(fd, view[pos:pos + n], host)
                else:
                    done = os.preadv(fd, [view[pos:pos + n]], host)
                if done != n:
                    return False
                pos += n
                await asyncio.sleep(0)
        finally:
            self.table.release(handle, outcome)
        if outcome == FAILED:
            return False
        self.served += 1
        self.allocated += allocating
        return True

    async def read(self, offset: int, buf: Any) -> None:
        if not await self._direct(offset, memoryview(buf).cast("B"), False):
            await self.img.read(offset, buf)

    async def write(self, offset: int, data: Any) -> None:
        if not await self._direct(offset, memoryview(data).cast("B"), True):
            await self.img.write(offset, data)


@pytest.mark.parametrize("cluster", [4 * K, 64 * K])
async def test_random_io_with_the_data_plane(cluster: int, tmp_path: Path,
                                             ring: Ring) -> None:
    size = 8 * M
    path = create(tmp_path / "img.qcow2", size, cluster_size=cluster)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"extents-{cluster}")
    spots = hot_spots(size, cluster)
    img = Qcow2Image.open(str(path), direct=False)  # the stand-in's I/O is buffered
    try:
        dp = DataPlaneStandIn(img, rng)
        for _ in range(3):
            await random_io(case, dp, rng, batches=8, per_batch=24, spots=spots)
            await read_matches_mirror(case, dp, f"c{cluster}")
        assert dp.served > 50 and dp.zeros > 10
    finally:
        await img.close()
    await verify(case, f"c{cluster} through the data plane")


@pytest.mark.parametrize("cluster", [4 * K, 64 * K])
@pytest.mark.parametrize("planes", [1, 2])
async def test_random_io_with_c_allocation(cluster: int, planes: int, tmp_path: Path,
                                           ring: Ring) -> None:
    """As above with allocation in C, from one pool or two (two queues'
    data planes): writes to unallocated clusters take pool clusters, the
    engine applies their records, frees the failed ones, and takes the
    pools back at close: QEMU finds the image equal to the mirror, without
    a leak."""
    size = 8 * M
    path = create(tmp_path / "img.qcow2", size, cluster_size=cluster)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"c-alloc-{cluster}-{planes}")
    spots = hot_spots(size, cluster)
    img = Qcow2Image.open(str(path), direct=False)
    try:
        dps = [DataPlaneStandIn(img, rng, c_alloc=True) for _ in range(planes)]

        class Queues:  # each request on one plane, as the kernel spreads them
            def __getattr__(self, name: str) -> Any:
                return getattr(rng.choice(dps), name)

        for _ in range(3):
            await random_io(case, Queues(), rng, batches=8, per_batch=24, spots=spots)
            await read_matches_mirror(case, Queues(), f"c{cluster} x{planes}")
        assert sum(dp.allocated for dp in dps) > 20, "C allocated (almost) nothing"
    finally:
        await img.close()
    await verify(case, f"c{cluster} with C allocation on {planes} planes")


async def test_write_through_holds_cs_writes(tmp_path: Path, ring: Ring) -> None:
    """User recovery's metadata write-through needs each write's metadata in
    the file before its request completes: the table holds C's writes
    (their answers wait for ``settle_writes``), so C still gets a pool and
    ALLOC entries. An image written through whose table does not hold
    them (a library user's) gets neither."""
    from aioublk.dataplane.extents import ALLOC
    from aioublk.dataplane.maps import Extents
    from aioublk.kernel import uapi
    from aioublk.qcow2 import Qcow2Image
    from aioublk.targets.qcow2 import Qcow2Target

    t = Qcow2Target(str(create(tmp_path / "a.qcow2", 8 * M, cluster_size=CS)))
    try:
        t.configure(uapi.Feature.USER_RECOVERY)
        m = t.map()
        assert isinstance(m, Extents) and m.table.holds_writes
        assert m.served().slot is not None
        await t.write(0, memoryview(bytearray(b"x" * CS)))  # the L2 table, cached
        t.image.service()
        if t.image.pools.filling is not None:
            await t.image.pools.filling
        assert t.image.c_allocating
        assert any(ALLOC in tb.pub for tb in t.image.l2.tables.values())
    finally:
        await t.drain()
        t.close()
    img = Qcow2Image.open(str(create(tmp_path / "c.qcow2", 8 * M, cluster_size=CS)),
                          metadata_write_through=True)
    try:  # (written through, not held: reads only)
        table = img.extent_table()
        assert table is not None and not table.holds_writes and img.attach_pool() == -1
        await img.write(0, b"x" * CS)
        tables = list(img.l2.tables.values())
        assert tables and all(ALLOC not in tb.pub for tb in tables)
        assert published(table, 0) == "ro"
    finally:
        await img.close()
    plain = Qcow2Target(str(create(tmp_path / "b.qcow2", 8 * M, cluster_size=CS)))
    try:  # (the same without write-through: a pool, and ALLOC entries)
        m = plain.map()  # (served as a data plane serves it: with its pool)
        assert isinstance(m, Extents) and m.served().slot is not None
        await plain.write(0, memoryview(bytearray(b"x" * CS)))
        assert any(ALLOC in tb.pub for tb in plain.image.l2.tables.values())
    finally:
        await plain.drain()
        plain.close()


async def test_pools_counted_at_a_crash_are_not_handed_out_again(tmp_path: Path,
                                                                 ring: Ring) -> None:
    """A crash after a write-back counted a pool, whose clusters were never
    written (past the end of the file): the engine opening the image again
    must not take them for fresh clusters (a second count would make them
    shared: corruption)."""
    path = create(tmp_path / "img.qcow2", 8 * M, cluster_size=CS)
    img = Qcow2Image.open(str(path), direct=False)
    dp = DataPlaneStandIn(img, random.Random(1), c_alloc=True)
    await img.write(0, b"a" * CS)  # the L2 table (and its ALLOC entries)
    img.service()
    assert img.pools.filling is not None
    await img.pools.filling
    await dp.write(5 * CS, b"b" * CS)  # one pool cluster used, by C
    assert dp.allocated == 1
    await img.flush()  # the pool's counts are durable; most of it never written
    img.release()  # kill -9 (QEMU checks no refcount past the file's end: it sees no leak)
    assert path.stat().st_size < 20 * CS < img.refs.used_end
    again = Qcow2Image.open(str(path), direct=False)
    try:
        dp = DataPlaneStandIn(again, random.Random(2), c_alloc=True)
        await again.read(0, bytearray(512))  # the table, cached again
        again.service()
        assert again.pools.filling is not None
        await again.pools.filling
        for k in range(8, 40):  # C and Python allocate, many clusters each
            await (dp if k % 2 else again).write(k * CS, bytes([k]) * CS)
        assert dp.allocated > 10
    finally:
        await again.close()
    p = qemu_img("check", path, ok=(0, 1, 2, 3))
    assert p.returncode in (0, 3), f"qemu-img check after serving it again:\n{p.stdout}"
    for k in (8, 9, 39):
        assert "Pattern verification failed" not in qemu_io(
            path, f"read -P {k} {k * CS} {CS}")


async def test_a_pool_that_asks_while_another_is_filled_is_filled_too(tmp_path: Path,
                                                                       ring: Ring) -> None:
    """C asks for the engine once per pool until that pool is refilled. A
    pool that asks while a fill is under way (after the fill looked at it:
    full then) is filled by another pass of the same fill, never forgotten:
    a forgotten pool stays empty and every write of its queue is Python's."""
    img = Qcow2Image.open(str(create(tmp_path / "img.qcow2", 8 * M, cluster_size=CS)),
                          direct=False)
    try:
        table = img.extent_table()
        assert table is not None
        slots = [img.attach_pool(), img.attach_pool()]
        await img.write(0, b"a" * CS)  # (the L2 table: C may allocate in it)
        img.service()
        assert img.pools.filling is not None
        await img.pools.filling
        cap = img.pools.cap
        assert [table.pool_level(s) for s in slots] == [cap, cap]
        entered, gate = asyncio.Event(), asyncio.Event()
        real = img.pools._pool_run

        async def held(n: int) -> range:
            entered.set()
            await gate.wait()
            return await real(n)
        img.pools._pool_run = held  # type: ignore[method-assign]
        table.pool_take(slots[1], cap)  # the second pool empty: a fill starts
        img.service()
        fill = img.pools.filling
        assert fill is not None
        async with asyncio.timeout(30):  # (a lost wake fails here, not the run)
            await entered.wait()  # (its pass looked at the first pool, full, and waits)
            table.pool_take(slots[0], cap)  # now the first one asks
            img.service()
            gate.set()
            await fill
        assert [table.pool_level(s) for s in slots] == [cap, cap]
    finally:
        await img.close()


async def test_run_op_reads_through_the_stand_in(tmp_path: Path, ring: Ring) -> None:
    """The stand-in really serves reads and writes (a guard for the test above)."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")), direct=False)
    try:
        dp = DataPlaneStandIn(img, random.Random(1))
        await read_all(img, 2 * CS)
        await run_op(dp, Op("write", 512, 512, b"q" * 512), b"")
        assert dp.served == 1
        buf = bytearray(512)
        await img.read(512, buf)
        assert bytes(buf) == b"q" * 512
    finally:
        await img.close()


async def test_target_map(tmp_path: Path, ring: Ring) -> None:
    """``Qcow2Target.map`` is the image's table; under user recovery it holds
    C's writes and publishes as before; a corrupt image has no map."""
    from aioublk.dataplane.maps import Extents
    from aioublk.kernel import uapi
    from aioublk.targets.qcow2 import Qcow2Target

    t = Qcow2Target(str(mixed(tmp_path / "a.qcow2")))
    try:
        m = t.map()
        assert isinstance(m, Extents) and m.table is t.image.extents
        await t.read(0, memoryview(bytearray(CS)))
        assert published(m.table, 0) == "rw"
        t.configure(uapi.Feature.USER_RECOVERY)
        assert published(m.table, 0) == "rw" and m.table.holds_writes
        with pytest.raises(OSError):
            t.image._mark_corrupt("a test")
        assert t.map() is None and len(m.table) == 0
    finally:
        t.close()


async def test_a_free_cluster_still_published_is_corruption(tmp_path: Path, ring: Ring) -> None:
    """On an image whose refcounts are too low a cluster can be free and still
    hold a guest cluster's data. Allocating it while the data plane may write
    guest data there would overwrite whatever it becomes (an L2 table, say):
    the engine marks the image corrupt instead, and takes the extent back
    first."""
    img = Qcow2Image.open(str(mixed(tmp_path / "a.qcow2")))
    try:
        table = img.extent_table()
        assert table is not None
        await read_all(img, 6 * CS)
        assert published(table, 5) == "rw"
        c = host_of(img, 5) // CS
        # the refcount the file would have said, had it been corrupt
        block = await img.refs.block(c // img.refs.rbe, create=False)
        assert block is not None
        block[c % img.refs.rbe] = 0
        img.refs.free_hint = c
        with pytest.raises(OSError, match="still holds the data of guest cluster 5"):
            await img.write(10 * CS, bytes(CS))  # allocates: cluster c comes first
        assert img.corrupt
        assert published(table, 5) == "-"
    finally:
        await img.close()
