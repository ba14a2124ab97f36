"""The L2 cache: tables loaded on demand (one load per table however many
requests ask), evicted clean in LRU order (a full cache of dirty tables
forces a write-back), and made private to the active layer before a change
(created, or copied from a table a snapshot shares).

The cache is also where the data plane learns the image's layout: a table
is published as it enters the cache, taken back as it leaves, and its
extents replaced when a copy takes its place. The cache tells its ``plane``
(``aioublk.qcow2.publish``'s ``Publisher``) at each of those moments; the
rules are in ``aioublk.qcow2.image`` ("The data plane")."""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import NoReturn, Protocol

from aioublk.dataplane.extents import ALLOCATING
from aioublk.io.hostfile import HostFile, aligned
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import L2Table, _eio
from aioublk.qcow2.format import COPIED, OFFSET_MASK
from aioublk.qcow2.refcounts import Refcounts
from aioublk.qcow2.writeback import KIND_NAMES, L2


class Plane(Protocol):
    """What the cache tells the data plane (``Publisher``)."""

    def entered(self, t: L2Table) -> None:
        """``t`` entered the cache."""

    def replaced(self, t: L2Table) -> None:
        """``t``, new in the cache, took the place of the table of its L1 index."""

    async def take_back(self, t: L2Table) -> None:
        """Unpublish all of ``t``, waiting for what C holds of it."""

    def forget(self, t: L2Table) -> None:
        """``t`` left the cache."""


class L2Cache:
    """The L2 table cache, and the L1 table that names its tables."""

    def __init__(self, file: HostFile, path: str, h: fmt.Header, l1: array[int],
                 l1_dirty: set[int], tables: OrderedDict[int, L2Table], capacity: int,
                 meta: dict[int, int], refs: Refcounts, plane: Plane,
                 defer_free: Callable[[int], None], changed: Callable[[], None],
                 write_back: Callable[[], Awaitable[None]],
                 mark_corrupt: Callable[[str], NoReturn]) -> None:
        self.file = file
        self.path = path
        self.cluster_size = h.cluster_size
        self.cbits = h.cluster_bits
        self.cmask = h.cluster_size - 1
        self.extended = h.extended_l2
        self.l2_bits = h.cluster_bits - (4 if h.extended_l2 else 3)
        self.l2_mask = (1 << self.l2_bits) - 1
        self.l1 = l1
        self.l1_dirty = l1_dirty  # L1 entries changed since the last write-back
        self.capacity = capacity
        self.tables = tables  # offset -> table, in LRU order
        self.meta = meta
        self.refs = refs
        self.defer_free = defer_free
        self.changed = changed  # (the write-back's count of metadata changes)
        self.write_back = write_back
        self.mark_corrupt = mark_corrupt
        self.plane = plane  # told of tables entering and leaving the cache
        self._loading: dict[int, asyncio.Future[L2Table]] = {}
        self._l2_busy: dict[int, asyncio.Future[None]] = {}  # L1 indexes being made

    def lookup(self, vc: int) -> int | None:
        """vcluster's L2 entry if its table is cached (0: no L2 table), None on a miss."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        if not off:
            return 0
        t = self.tables.get(off)
        if t is None:
            return None
        return t.entries[vc & self.l2_mask]

    def table_of(self, vc: int) -> L2Table | None:
        """The cached table holding ``vc``'s entry, if any."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        return self.tables.get(off) if off else None

    def sub_word(self, vc: int) -> int:
        """The subcluster word of ``vc``'s PARTIAL entry (its table cached)."""
        t = self.tables[self.l1[vc >> self.l2_bits] & OFFSET_MASK]
        if t.subs is None:  # (a standard entry with that reserved bit set)
            raise _eio(f"{self.path}: the L2 entry of cluster {vc} has reserved bits set: "
                       "run qemu-img check")
        return t.subs[vc & self.l2_mask]

    async def entry(self, vc: int) -> int:
        """vcluster's L2 entry, its table loaded if it must be."""
        e = self.lookup(vc)
        while e is None:
            l1i = vc >> self.l2_bits
            await self.load(self.l1[l1i] & OFFSET_MASK, l1i)
            e = self.lookup(vc)
        return e

    async def load(self, off: int, l1i: int) -> L2Table:
        t = self.tables.get(off)
        if t is not None:
            self.tables.move_to_end(off)
            return t
        pending = self._loading.get(off)
        if pending is not None:
            return await asyncio.shield(pending)
        if off & self.cmask or off + self.cluster_size > self.refs.used_end:
            self.mark_corrupt(f"an L1 entry points to {off:#x}, " + (
                "not cluster aligned" if off & self.cmask else "past the end of the file"))
        if self.meta.get(off >> self.cbits) != L2:
            kind = KIND_NAMES.get(self.meta.get(off >> self.cbits, -1), "?")
            self.mark_corrupt(f"an L1 entry points to {off:#x}, which holds the {kind}")
        fut: asyncio.Future[L2Table] = asyncio.get_running_loop().create_future()
        self._loading[off] = fut
        try:
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            await self.make_room()
            t = self.tables.get(off)  # created meanwhile (cannot be, but stay exact)
            if t is None:
                t = L2Table.parse(off, buf, l1i, self.extended)
                self.tables[off] = t
                self.plane.entered(t)
            fut.set_result(t)
            return t
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[off]

    async def make_room(self) -> None:
        while len(self.tables) >= self.capacity:
            for off, t in self.tables.items():
                if not t.dirty and any(k in t.pub for k in ALLOCATING):
                    # C may be allocating in it: a record must never name a
                    # table gone from the cache. Take it back, apply what C
                    # did (the table may be dirty now), and look again
                    await self.plane.take_back(t)
                    break
                if not t.dirty:
                    del self.tables[off]
                    self.plane.forget(t)
                    break
            else:
                await self.write_back()

    async def for_update(self, l1i: int) -> L2Table:
        """The L2 table of ``l1i``, owned by the active layer alone (created, or
        copied from a table shared with a snapshot, as needed)."""
        while True:
            l1e = self.l1[l1i]
            off = l1e & OFFSET_MASK
            if off and l1e & COPIED:
                return await self.load(off, l1i)
            busy = self._l2_busy.get(l1i)
            if busy is not None:
                await asyncio.shield(busy)
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._l2_busy[l1i] = fut
            try:
                subs = array("Q", bytes(8 << self.l2_bits)) if self.extended else None
                if off:
                    old = await self.load(off, l1i)
                    entries = array("Q", old.entries)
                    if old.subs is not None:
                        subs = array("Q", old.subs)
                else:
                    entries = array("Q", bytes(8 << self.l2_bits))
                c, _fresh = await self.refs.alloc(1, meta=L2)
                new = L2Table(c << self.cbits, entries, l1i, dirty=True, subs=subs)
                await self.make_room()
                self.tables[new.offset] = new
                self.l1[l1i] = new.offset | COPIED
                self.l1_dirty.add(l1i)
                self.changed()
                if off:
                    self.defer_free(off >> self.cbits)
                self.plane.replaced(new)
                return new
            finally:
                del self._l2_busy[l1i]
                fut.set_result(None)
