"""The qcow2 engine's collaborators, each without the image: the deferred
frees, the map of metadata clusters, the refcounts and allocation, the L2
cache and the write-back, given only the file and tables they work on."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import NoReturn

import pytest

from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import format as fmt
from aioublk.qcow2 import metamap
from aioublk.qcow2.base import L2Table
from aioublk.qcow2.flush import Frees, WriteBack
from aioublk.qcow2.l2cache import L2Cache
from aioublk.qcow2.pools import Pools
from aioublk.qcow2.refcounts import Refcounts, counted_end
from aioublk.qcow2.writeback import HEADER, L1, L2, REFBLOCK, REFTABLE
from aioublk.ring import Ring
from tests.support.qcow2_util import K, M, check_clean, create

CS = 64 * K


def test_frees_wait_for_their_cut_and_the_io_begun_before_it() -> None:
    f = Frees()
    g = f.io_begin()  # I/O of generation 0 in flight
    f.defer(7)
    cut = f.cut()
    assert f.ready(cut) == [], "freed under I/O begun before the change"
    f.io_end(g)
    f.defer(8)  # a change after the cut: not durable with it
    assert f.ready(cut) == [7]
    assert f.pending == [(1, 8)]
    assert f.ready(f.cut()) == [8] and not f.pending


class Opened:
    """The header and tables of an image file, as the image reads them."""

    def __init__(self, path: Path) -> None:
        self.file = HostFile(str(path), read_only=False, direct=False)
        first = self.file.pread(0, 1 << 21)
        self.h = fmt.parse_header(first, self.file.size)
        self.head = bytearray(first[:512])
        self.l1 = fmt.load_table(self.file.pread(self.h.l1_table_offset, self.h.l1_size * 8))
        rt = self.file.pread(self.h.refcount_table_offset, self.h.refcount_table_clusters * CS)
        self.reftable = fmt.load_table(rt)
        self.meta = metamap.scan(self.file, str(path), self.h, self.l1, self.reftable, False)
        self.freed: list[int] = []
        self.refs = Refcounts(self.file, str(path), self.h, self.reftable, self.meta,
                              max(self.file.size, counted_end(self.file, self.h, self.reftable)),
                              self.freed.append, {}, self.published)

    async def published(self, run: range) -> None:  # (nothing is: no data plane)
        raise AssertionError("asked with an empty pub_host")

    @staticmethod
    def corrupt(why: str) -> NoReturn:
        raise AssertionError(why)


def test_metamap_of_a_fresh_image(tmp_path: Path) -> None:
    o = Opened(create(tmp_path / "a.qcow2", 16 * M))
    try:
        assert o.meta[0] == HEADER
        assert o.meta[o.h.l1_table_offset // CS] == L1
        assert o.meta[o.h.refcount_table_offset // CS] == REFTABLE
        assert o.meta[o.reftable[0] // CS] == REFBLOCK
        assert L2 not in o.meta.values()  # nothing written: no L2 table
    finally:
        o.file.close()


@pytest.mark.asyncio
async def test_refcounts_allocate_and_release_without_an_image(tmp_path: Path,
                                                               ring: Ring) -> None:
    o = Opened(create(tmp_path / "a.qcow2", 16 * M))
    try:
        end = o.refs.end_cluster()  # (the first cluster past the file)
        c, fresh = await o.refs.alloc(2, meta=L2)
        assert (c, fresh) == (end, True)
        assert o.meta[c] == o.meta[c + 1] == L2
        assert o.refs.used_end == (c + 2) * CS
        block = await o.refs.block(0, create=False)
        assert block is not None and block[c] == block[c + 1] == 1 and block.dirty
        o.refs.release(c * CS | fmt.COPIED)  # a metadata cluster: never freed
        o.meta.pop(c + 1)
        o.refs.release((c + 1) * CS | fmt.COPIED)
        assert o.freed == [c + 1]  # (deferred: the count drops once that is durable)
        async with o.refs.lock:
            assert await o.refs.add_ref(c + 1, -1) == 0
        o.refs.free_hint = 0  # (as the write-back sets it after a free)
        again, _ = await o.refs.alloc(1)
        assert again == c + 1, "the freed cluster is not found again"
    finally:
        o.file.close()


@pytest.mark.asyncio
async def test_l2_cache_and_write_back_without_an_image(tmp_path: Path, ring: Ring) -> None:
    """A table made private by the cache, written by the write-back in the
    plan's order, leaves an image qemu-img calls clean."""
    path = create(tmp_path / "a.qcow2", 16 * M)
    o = Opened(path)
    told: list[tuple[str, int]] = []

    class Plane:
        def entered(self, t: L2Table) -> None:
            told.append(("entered", t.l1i))

        def replaced(self, t: L2Table) -> None:
            told.append(("replaced", t.l1i))

        async def take_back(self, t: L2Table) -> None:
            raise AssertionError("nothing published")

        def forget(self, t: L2Table) -> None:
            told.append(("forget", t.l1i))

    try:
        tables: OrderedDict[int, L2Table] = OrderedDict()
        l1_dirty: set[int] = set()
        frees = Frees()
        pools = Pools(str(path), o.h.cluster_bits, o.h.cluster_bits - 3, o.refs, o.l1, tables,
                      {}, lambda n: None, lambda: False)
        wb = WriteBack(o.file, str(path), o.h, o.head, o.l1, l1_dirty, tables, o.meta, o.refs,
                       pools, frees, bytes, o.corrupt)
        cache = L2Cache(o.file, str(path), o.h, o.l1, l1_dirty, tables, 4, o.meta, o.refs,
                        Plane(), frees.defer, wb.changed, wb.run, o.corrupt)
        assert cache.lookup(0) == 0  # no table
        t = await cache.for_update(0)
        assert told == [("replaced", 0)] and l1_dirty == {0} and wb.seq == 1
        assert o.l1[0] == t.offset | fmt.COPIED and o.meta[t.offset // CS] == L2
        host, _ = await o.refs.alloc(1)
        await o.file.write(b"\x5a" * CS, host * CS)
        t.entries[3] = host * CS | fmt.COPIED
        t.touch()
        assert cache.lookup(3) == host * CS | fmt.COPIED
        await wb.run()
        assert not wb.dirty() and wb.written == 1
    finally:
        o.file.close()
    check_clean(path)
    # and what the cache loads again is what it wrote
    o = Opened(path)
    try:
        async def no_write_back() -> None:
            raise AssertionError("nothing to write back")
        cache = L2Cache(o.file, str(path), o.h, o.l1, set(), OrderedDict(), 4, o.meta, o.refs,
                        Plane(), o.freed.append, lambda: None, no_write_back, o.corrupt)
        assert await cache.entry(3) == host * CS | fmt.COPIED
    finally:
        o.file.close()
