"""The L2 cache: tables loaded on demand (one load per table however many
requests ask), evicted clean in LRU order (a full cache of dirty tables
forces a write-back), and made private to the active layer before a change
(created, or copied from a table a snapshot shares)."""

from __future__ import annotations

import asyncio
from array import array

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import L2Table
from aioublk.qcow2.flush import WriteBack
from aioublk.qcow2.format import COPIED, OFFSET_MASK
from aioublk.qcow2.hostfile import aligned
from aioublk.qcow2.writeback import KIND_NAMES, L2


class L2Cache(WriteBack):
    """The L2 table cache."""

    def _lookup(self, vc: int) -> int | None:
        """vcluster's L2 entry if its table is cached (0: no L2 table), None on a miss."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        if not off:
            return 0
        t = self.l2cache.get(off)
        if t is None:
            return None
        return t.entries[vc & self.l2_mask]

    async def _entry(self, vc: int) -> int:
        e = self._lookup(vc)
        while e is None:
            await self._load_l2(self.l1[vc >> self.l2_bits] & OFFSET_MASK)
            e = self._lookup(vc)
        return e

    async def _load_l2(self, off: int) -> L2Table:
        t = self.l2cache.get(off)
        if t is not None:
            self.l2cache.move_to_end(off)
            return t
        pending = self._loading.get(off)
        if pending is not None:
            return await asyncio.shield(pending)
        if off & self.cmask or off + self.cluster_size > self.used_end:
            self._mark_corrupt(f"an L1 entry points to {off:#x}, " + (
                "not cluster aligned" if off & self.cmask else "past the end of the file"))
        if self.meta.get(off >> self.cbits) != L2:
            kind = KIND_NAMES.get(self.meta.get(off >> self.cbits, -1), "?")
            self._mark_corrupt(f"an L1 entry points to {off:#x}, which holds the {kind}")
        fut: asyncio.Future[L2Table] = asyncio.get_running_loop().create_future()
        self._loading[off] = fut
        try:
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            await self._make_room()
            t = self.l2cache.get(off)  # created meanwhile (cannot be, but stay exact)
            if t is None:
                t = L2Table(off, fmt.load_table(buf))
                self.l2cache[off] = t
            fut.set_result(t)
            return t
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[off]

    async def _make_room(self) -> None:
        while len(self.l2cache) >= self.l2_capacity:
            for off, t in self.l2cache.items():
                if not t.dirty:
                    del self.l2cache[off]
                    break
            else:
                await self.writeback()

    async def _table_for_update(self, l1i: int) -> L2Table:
        """The L2 table of ``l1i``, owned by the active layer alone (created, or
        copied from a table shared with a snapshot, as needed)."""
        while True:
            l1e = self.l1[l1i]
            off = l1e & OFFSET_MASK
            if off and l1e & COPIED:
                return await self._load_l2(off)
            busy = self._l2_busy.get(l1i)
            if busy is not None:
                await asyncio.shield(busy)
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._l2_busy[l1i] = fut
            try:
                if off:
                    old = await self._load_l2(off)
                    entries = array("Q", old.entries)
                else:
                    entries = array("Q", bytes(self.cluster_size))
                c, _fresh = await self._alloc(1, meta=L2)
                new = L2Table(c << self.cbits, entries, dirty=True)
                await self._make_room()
                self.l2cache[new.offset] = new
                self.l1[l1i] = new.offset | COPIED
                self.l1_dirty.add(l1i)
                self._meta_seq += 1
                if off:
                    self._defer_free(off >> self.cbits)
                return new
            finally:
                del self._l2_busy[l1i]
                fut.set_result(None)

