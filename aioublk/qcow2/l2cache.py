"""The L2 cache: tables loaded on demand (one load per table however many
requests ask), evicted clean in LRU order (a full cache of dirty tables
forces a write-back), and made private to the active layer before a change
(created, or copied from a table a snapshot shares).

The cache is also where the data plane learns the image's layout: a table
is published in the image's extent table when it enters the cache, every
entry at once (``_publish_run``: normal clusters as data, clusters that read
as zeros as ZERO), an entry changed later is published again, and every
change of an entry goes through ``_remap``, which takes it back first. The
rules are in ``aioublk.qcow2.image`` ("The data plane")."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

from aioublk.dataplane.extents import ALLOC, ExtentConflict, ExtentTable
from aioublk.io.hostfile import aligned
from aioublk.qcow2.base import PARTIAL, ImageBase, L2Table, _eio, log
from aioublk.qcow2.format import COPIED, OFFSET_MASK
from aioublk.qcow2.writeback import KIND_NAMES, L2


class L2Cache(ImageBase):
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

    def _sub_word(self, vc: int) -> int:
        """The subcluster word of ``vc``'s PARTIAL entry (its table cached)."""
        t = self.l2cache[self.l1[vc >> self.l2_bits] & OFFSET_MASK]
        if t.subs is None:  # (a standard entry with that reserved bit set)
            raise _eio(f"{self.path}: the L2 entry of cluster {vc} has reserved bits set: "
                       "run qemu-img check")
        return t.subs[vc & self.l2_mask]

    async def _entry(self, vc: int) -> int:
        e = self._lookup(vc)
        while e is None:
            l1i = vc >> self.l2_bits
            await self._load_l2(self.l1[l1i] & OFFSET_MASK, l1i)
            e = self._lookup(vc)
        return e

    async def _load_l2(self, off: int, l1i: int) -> L2Table:
        t = self.l2cache.get(off)
        if t is not None:
            self.l2cache.move_to_end(off)
            return t
        pending = self._loading.get(off)
        if pending is not None:
            return await asyncio.shield(pending)
        if off & self.cmask or off + self.cluster_size > self.refs.used_end:
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
                t = L2Table.parse(off, buf, l1i, self.h.extended_l2)
                self.l2cache[off] = t
                self._publish_table(t)
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
                if not t.dirty and ALLOC in t.pub:
                    # C may be allocating in it: a record must never name a
                    # table gone from the cache. Take it back, apply what C
                    # did (the table may be dirty now), and look again
                    await self._take_back(t)
                    break
                if not t.dirty:
                    del self.l2cache[off]
                    self._forget(t)
                    break
            else:
                await self.wb.run()

    async def _table_for_update(self, l1i: int) -> L2Table:
        """The L2 table of ``l1i``, owned by the active layer alone (created, or
        copied from a table shared with a snapshot, as needed)."""
        while True:
            l1e = self.l1[l1i]
            off = l1e & OFFSET_MASK
            if off and l1e & COPIED:
                return await self._load_l2(off, l1i)
            busy = self._l2_busy.get(l1i)
            if busy is not None:
                await asyncio.shield(busy)
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._l2_busy[l1i] = fut
            try:
                subs = array("Q", bytes(8 << self.l2_bits)) if self.h.extended_l2 else None
                if off:
                    old = await self._load_l2(off, l1i)
                    entries = array("Q", old.entries)
                    if old.subs is not None:
                        subs = array("Q", old.subs)
                else:
                    entries = array("Q", bytes(8 << self.l2_bits))
                c, _fresh = await self.refs.alloc(1, meta=L2)
                new = L2Table(c << self.cbits, entries, l1i, dirty=True, subs=subs)
                await self._make_room()
                self.l2cache[new.offset] = new
                self.l1[l1i] = new.offset | COPIED
                self.l1_dirty.add(l1i)
                self.wb.changed()
                if off:
                    self.frees.defer(off >> self.cbits)
                # the same entries (or none yet): take back what the old table
                # published (no mapping changes, so nothing waits) and publish
                # the new one whole, its pub bytes then telling the truth
                if self.extents is not None:
                    span = self.l2_bits + self.cbits
                    self.extents.invalidate(l1i << span, 1 << span)
                self._publish_table(new)
                return new
            finally:
                del self._l2_busy[l1i]
                fut.set_result(None)


    # ------------------------------------------------------------ data plane
    def extent_table(self) -> ExtentTable | None:
        """The extent table the data plane serves this image from (made on the
        first call; publishing starts then), or None where the engine cannot
        keep the table's promise: a corrupt image, or one whose L1 table names
        an L2 table twice (a change through one name would leave the other's
        extents stale). It holds as many clusters as the L2 cache does, so a
        table entering the cache always finds room for its clusters."""
        if self.corrupt or self._aliased or self.file.fd < 0:
            return None
        if self.extents is None:
            self.extents = ExtentTable(self.cluster_size, max_entries=min(
                (1 << 32) - 2, max(1 << 20, self.l2_capacity << self.l2_bits)))
            self._publishing = True
            self.pools.table = self.extents
            for t in list(self.l2cache.values()):
                self._publish_table(t)
        return self.extents

    @property
    def c_allocating(self) -> bool:
        """Whether C may allocate now: what publishing ALLOC asks first."""
        return bool(self.pools.slots) and not self.read_only and not self.corrupt \
            and not self.metadata_write_through and not self.compress and not self.file.is_block

    def attach_pool(self) -> int:
        """A pool for one more data plane (``Pools.attach``), or -1 where C may
        not allocate in this image."""
        if self.extents is None or not self.pools.c_alloc or self.read_only \
                or self.file.is_block or self.metadata_write_through or self.compress:
            return -1
        return self.pools.attach(self.file.fd)

    def service(self) -> None:
        """C asked for the engine: see ``Pools.service``."""
        self.pools.service()

    def republish(self) -> None:
        """Take every extent back and publish the cached tables again: after a
        change of what may be writable (``metadata_write_through`` set before
        the first request). No mapping changes, so nothing waits."""
        if self.extents is None:
            return
        self.extents.invalidate(0, (1 << 64) - 1)
        self._pub_host.clear()
        for t in list(self.l2cache.values()):
            t.pub[:] = bytes(len(t.pub))
            self._publish_table(t)

    async def _take_back(self, t: L2Table) -> None:
        """Unpublish all of ``t`` (cached), waiting for what C holds of it."""
        assert self.extents is not None
        span = self.l2_bits + self.cbits
        await self.extents.unmap(t.l1i << span, 1 << span)
        self.pools.drain()
        t.pub[:] = bytes(len(t.pub))

    def _publish_table(self, t: L2Table) -> None:
        """Publish every entry of ``t``, just cached, if L1 names it."""
        if self._publishing and self.l1[t.l1i] & OFFSET_MASK == t.offset:
            self._publish_run(t, 0, len(t.entries))

    def _publish(self, vc: int) -> None:
        """Offer cluster ``vc`` to the data plane if its table is cached."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        t = self.l2cache.get(off) if off else None
        if t is not None and not t.pub[vc & self.l2_mask]:
            self._publish_in(t, vc)

    def _publish_vcs(self, vcs: range) -> None:
        """Offer clusters ``vcs`` (one L2 table's) to the data plane, in one call."""
        off = self.l1[vcs.start >> self.l2_bits] & OFFSET_MASK
        t = self.l2cache.get(off) if off else None
        if t is not None:
            self._publish_run(t, vcs.start & self.l2_mask, len(vcs))

    def _publish_in(self, t: L2Table, vc: int) -> None:
        """Publish cluster ``vc``, whose entry is in ``t`` (cached and current),
        by the rules of ``_publish_run``."""
        self._publish_run(t, vc & self.l2_mask, 1)

    def _publish_run(self, t: L2Table, i: int, n: int) -> None:
        """Publish entries [i, i + n) of ``t`` (cached, current, named by L1)
        that are not published yet, in one C call (``ExtentTable.publish_l2``,
        the one place the rules are applied):

        - as data (MAP), a normal cluster: allocated, not compressed or ZERO,
          cluster aligned, inside the file, not a metadata cluster. It is
          writable where a write may go in place (as ``_mapped(..., write=True)``
          decides, less what changes per request): COPIED, the image writable,
          no ``metadata_write_through``; read-only elsewhere;
        - as ZERO, an entry that reads as zeros without backing data: the ZERO
          flag (with a host cluster or not), or unallocated with no backing
          file or wholly past the backing file's end. Reads are then C's, and
          a write misses, to be allocated here;
        - as ALLOC, what would be ZERO without a host cluster, where C may
          allocate (``aioublk.qcow2.pools``: ``c_allocating``, and the table
          private to the active layer, COPIED in L1, so that a record never
          needs the table copied): reads are zeros, a write takes a cluster
          from the queue's pool;
        - never a compressed cluster, one whose subclusters differ, one that
          shows the backing file, one
          past the disk's end, nor one being changed (``_busy``): its changer
          has taken it back or is about to, and publishes it after."""
        if not self._publishing:
            return
        assert self.extents is not None
        cbits, vc0 = self.cbits, (t.l1i << self.l2_bits) + i
        if n == 1:  # (the one host cluster and vc are all the rules need to know)
            if vc0 in self._busy or t.entries[i] & PARTIAL:
                return
            c = (t.entries[i] & OFFSET_MASK) >> cbits
            meta: Any = (c,) if c in self.meta else ()
            skip: Any = ()
        else:
            meta = self.meta
            skip = [vc for vc in self._busy if vc0 <= vc < vc0 + n]
            if t.subs is not None:  # (subclusters that differ: Python's, vc by vc)
                skip = sorted({*skip, *(vc0 + k for k in range(n)
                                        if t.entries[i + k] & PARTIAL)})
        try:
            pairs = self.extents.publish_l2(
                self.file.fd, vc0 << cbits, memoryview(t.entries)[i:i + n],
                memoryview(t.pub)[i:i + n], used_end=self.refs.used_end, size=self.size,
                writable_ok=not (self.read_only or self.metadata_write_through
                                 or self.compress),
                alloc_ok=self.c_allocating and bool(self.l1[t.l1i] & COPIED),
                backing_end=self.backing.size if self.backing is not None else 0,
                meta=meta, skip=skip)
        except ExtentConflict:
            # a mapping changed without _remap: a bug; stop serving from the table
            log.error("qcow2 extent conflict: data plane off", image=self.path, cluster=vc0)
            self._drop_extents()
            return
        if pairs:
            self._pub_host.update(pairs)

    def _forget(self, t: L2Table) -> None:
        """``t`` left the cache: take back what it published, so that the data
        plane holds only clusters whose entries are cached. The mapping does
        not change, so requests in flight may finish (a later change waits for
        them in ``_remap``). A table L1 no longer names (a copy replaced it)
        leaves its successor's extents alone."""
        if self.extents is not None and any(t.pub) and \
                self.l1[t.l1i] & OFFSET_MASK == t.offset:
            span = self.l2_bits + self.cbits
            self.extents.invalidate(t.l1i << span, 1 << span)

    async def _remap(self, vcs: range) -> L2Table:
        """The one way to change L2 entries: take clusters ``vcs`` (one L2
        table's, held in ``_busy`` by the caller) back from the data plane, wait
        until no request it started on them is in flight, and return their
        table made private for the update, with the entries marked unpublished.
        The caller sets the entries without awaiting after this; ``_busy``
        keeps them from being published again meanwhile."""
        if self.extents is not None:
            await self.extents.unmap(vcs.start << self.cbits, len(vcs) << self.cbits)
        t = await self._table_for_update(vcs.start >> self.l2_bits)
        pub, mask = t.pub, self.l2_mask
        for vc in vcs:
            pub[vc & mask] = 0
        return t
