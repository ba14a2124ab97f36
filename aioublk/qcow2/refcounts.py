"""Refcounts: the refcount blocks (loaded on demand, created inside the range
they describe), the refcount table (grown by moving it to the end of the
file), and cluster allocation. Every refcount change runs under ``lock``.
Frees are deferred (``defer_free``, the write-back's: a cluster's count
drops only once the change that dropped its last user is durable, see
``aioublk.qcow2.flush``).

A ``Refcounts`` knows the image file, the header's geometry and the map of
metadata clusters (``meta``, shared with the image); nothing of L1, L2 or
the data plane but two hooks the image gives it."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable

from aioublk.io.hostfile import HostFile, aligned
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import _eio, log
from aioublk.qcow2.format import COMPRESSED, OFFSET_MASK
from aioublk.qcow2.writeback import REFBLOCK, REFTABLE


def counted_end(f: HostFile, h: fmt.Header, reftable: array[int]) -> int:
    """The end of the last cluster with a refcount, looking only at the
    refcount blocks that describe clusters past the end of ``f``."""
    cs, bits, rbe, end = h.cluster_size, h.refcount_bits, h.refblock_entries, 0
    for t in range(f.size // cs // rbe, len(reftable)):
        off = reftable[t] & fmt.REFT_OFFSET_MASK
        if not off or off & (cs - 1) or off + cs > f.size:
            continue  # none, or invalid: refused when used (``Refcounts.block``)
        used = len(f.pread(off, cs).rstrip(b"\0"))  # bytes up to the last count
        if used:
            last = (used * 8 - 1) // bits  # (sub-byte widths: at most a byte's worth more)
            end = max(end, (t * rbe + last + 1) * cs)
    return end


class Refcounts:
    """Refcount blocks, the refcount table and allocation of host clusters."""

    def __init__(self, file: HostFile, path: str, h: fmt.Header, reftable: array[int],
                 meta: dict[int, int], used_end: int, defer_free: Callable[[int], None],
                 pub_host: dict[int, int],
                 claim_published: Callable[[range], Awaitable[None]]) -> None:
        self.file = file
        self.path = path
        self.cluster_size = h.cluster_size
        self.cbits = h.cluster_bits
        self.cmask = h.cluster_size - 1
        self.bits = h.refcount_bits
        self.rbe = h.refblock_entries  # refcount entries per block
        self.table = reftable
        self.table_offset = h.refcount_table_offset
        self.table_clusters = h.refcount_table_clusters
        self.table_dirty = False
        self.table_moved = False  # the header must name the table's new place
        self.table_gen = 0  # bumped on each change of the refcount table (or its place)
        self.blocks: dict[int, fmt.RefBlock] = {}
        self.meta = meta  # host cluster -> metadata kind (aioublk.qcow2.writeback)
        #: below this the file may hold old bytes; past it clusters are free
        #: without a look at their refcounts (they read as zeros)
        self.used_end = used_end
        self.free_hint = 0
        self.reserving: set[int] = set()
        self.defer_free = defer_free
        #: host cluster -> the guest cluster the data plane serves from it;
        #: while not empty, a run about to be allocated is first checked by
        #: ``claim_published`` (the image's: no free cluster may still be served)
        self.pub_host = pub_host
        self.claim_published = claim_published
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """The lock every refcount change is made under (made on first use,
        on the loop that uses it)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def block(self, t: int, create: bool) -> fmt.RefBlock | None:
        """Refcount block ``t`` (loaded, or made where ``create``)."""
        b = self.blocks.get(t)
        if b is not None:
            return b
        if t >= len(self.table):
            if not create:
                return None
            await self.grow_table(t)
            return await self.block(t, create)  # growing may have made block t
        off = self.table[t] & fmt.REFT_OFFSET_MASK
        if off:
            if off & self.cmask or off + self.cluster_size > self.used_end:
                raise _eio(f"{self.path}: refcount table entry {t} points to {off:#x}, "
                           "which is invalid")
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            b = fmt.RefBlock(self.bits, buf)
            self.blocks[t] = b
            return b
        if not create:
            return None
        # a missing block means every cluster it covers is free: put the block
        # inside its own range so that it describes itself
        base = t * self.rbe
        c = next((c for c in range(base, base + self.rbe) if not self.taken(c)), None)
        b = fmt.RefBlock(self.bits, bytes(self.cluster_size))
        self.blocks[t] = b
        if c is not None:
            b[c - base] = 1
        else:
            c = self.clear_past_end(max(self.end_cluster(), base + self.rbe), 1)
            self.reserving.add(c)
            try:
                await self.add_ref(c, 1)
            finally:
                self.reserving.discard(c)
        self.meta[c] = REFBLOCK
        self.used_end = max(self.used_end, (c + 1) << self.cbits)
        self.table[t] = c << self.cbits
        self.table_dirty = True
        self.table_gen += 1
        b.dirty = True
        b.gen += 1
        return b

    def end_cluster(self) -> int:
        return (self.used_end + self.cmask) >> self.cbits

    def taken(self, c: int) -> bool:
        """Whether host cluster ``c`` is metadata (also one a table points to
        past the end of the file) or is being claimed."""
        return c in self.meta or c in self.reserving

    def clear_past_end(self, start: int, n: int) -> int:
        """The first cluster from ``start`` on (past the end of the file) that
        begins ``n`` clusters none of which is taken."""
        c = start
        while c < start + n:
            if self.taken(c):
                start = c + 1
            c += 1
        return start

    async def add_ref(self, c: int, delta: int) -> int:
        """Change a refcount; returns the new value. A decrement never creates
        refcount structures: a cluster without a refcount is left alone (leaked
        at worst) and reported, as QEMU does."""
        return self._bump(await self.block(c // self.rbe, create=delta > 0), c, delta)

    def _bump(self, b: fmt.RefBlock | None, c: int, delta: int) -> int:
        """Cluster ``c``'s refcount in ``b`` (its block) changed by ``delta``."""
        i = c % self.rbe
        if b is None or b[i] + delta < 0:
            log.error("qcow2 refcount underflow: cluster left alone", image=self.path,
                      cluster=c)
            return -1
        v = b[i] + delta
        if v >> b.bits:  # a "free" cluster past the end of the file with a refcount
            raise _eio(f"{self.path}: the refcount of cluster {c << self.cbits:#x} would "
                       f"exceed {b.bits} bits: run `qemu-img check -r all {self.path}`")
        b[i] = v
        return v

    async def add_ref_run(self, run: range, delta: int) -> None:
        """Raise (or lower) the refcounts of ``run`` by ``delta``: one refcount
        block lookup per block the run touches, not one await per cluster,
        since allocation counts whole runs (``alloc``) and allocation speed
        is what a first write to a cluster waits for."""
        rbe = self.rbe
        c = run.start
        while c < run.stop:
            stop = min(run.stop, (c // rbe + 1) * rbe)
            b = await self.block(c // rbe, create=delta > 0)
            for x in range(c, stop):
                self._bump(b, x, delta)
            c = stop

    async def claim(self, run: range) -> None:
        """Count free clusters ``run`` as taken (refcount 1), under ``lock``.
        The run is claimed before it is counted: a refcount block or a grown
        table made on the way must land elsewhere."""
        self.used_end = max(self.used_end, run.stop << self.cbits)
        self.reserving.update(run)
        try:
            await self.add_ref_run(run, 1)
        finally:
            self.reserving.difference_update(run)

    async def fresh_run(self, n: int) -> range:
        """``n`` fresh clusters past the end of the file, counted."""
        async with self.lock:
            start = self.clear_past_end(
                max(self.end_cluster(), max(self.reserving, default=-1) + 1), n)
            run = range(start, start + n)
            await self.claim(run)
            return run

    async def grow_table(self, need: int) -> None:
        """Move the refcount table to a bigger place at the end of the file. The
        header switches to it in write-back; the old one is freed after."""
        cs = self.cluster_size
        per = cs // 8
        start = max(self.end_cluster(), max(self.reserving, default=-1) + 1)
        entries = max(need + 1, len(self.table) * 2)
        while True:  # big enough to cover itself and the blocks that count it
            clusters = -(-entries // per)
            free = self.clear_past_end(start, clusters)  # not over a table past the end
            if free != start:
                start = free
                continue
            needed = (start + clusters + 8) // self.rbe + 1
            if entries >= needed:
                break
            entries = needed
        entries = clusters * per
        old_off, old_clusters = self.table_offset, self.table_clusters
        grown = array("Q", self.table)
        grown.extend(array("Q", bytes(8 * (entries - len(grown)))))
        self.table = grown
        run = range(start, start + clusters)
        await self.claim(run)
        for c in run:
            self.meta[c] = REFTABLE
        self.table_offset = start << self.cbits
        self.table_clusters = clusters
        self.table_dirty = True
        self.table_moved = True
        self.table_gen += 1
        for c in range(old_off >> self.cbits, (old_off >> self.cbits) + old_clusters):
            self.defer_free(c)
        log.info("qcow2 refcount table grown", image=self.path, clusters=clusters)

    async def alloc(self, n: int, meta: int | None = None) -> tuple[int, bool]:
        """``n`` contiguous free host clusters, their refcounts set to 1: the
        first one, and whether they were never written (past the old end of
        the file, so their unwritten parts read as zeros)."""
        rbe = self.rbe
        async with self.lock:
            start = c = self.free_hint
            hole = -1  # the first free cluster passed over (a run too short for n)
            end_cluster = self.end_cluster()
            while c - start < n:
                if self.taken(c):  # also past the end: a table may point there
                    start = c = c + 1
                    continue
                if c >= end_cluster:
                    c += 1  # past the end, no refcount: free
                    continue
                b = await self.block(c // rbe, create=False)
                if b is None or b[c % rbe] == 0:
                    c += 1
                    continue
                if hole < 0 and c > start:
                    hole = start
                c += 1
                if c % rbe:
                    nxt = b.first_free(c % rbe)
                    c = (c // rbe + 1) * rbe if nxt < 0 else (c // rbe) * rbe + nxt
                start = c
            run = range(start, start + n)
            if self.pub_host:
                await self.claim_published(run)
            fresh = start << self.cbits >= self.used_end
            await self.claim(run)
            self.free_hint = run.stop if hole < 0 else hole
            if meta is not None:
                for c in run:
                    self.meta[c] = meta
            return start, fresh

    def release(self, entry: int) -> None:
        """Drop the references an L2 entry held (deferred: see the module
        docstring). An entry pointing nowhere valid is leaked, not freed."""
        if entry & COMPRESSED:
            clusters = fmt.compressed_clusters(entry, self.cbits)
            if clusters.stop << self.cbits <= self.used_end + self.cluster_size:
                for c in clusters:
                    self.defer_free(c)
        elif entry & OFFSET_MASK:
            host = entry & OFFSET_MASK
            if not host & self.cmask and host < self.used_end and host >> self.cbits \
                    not in self.meta:
                self.defer_free(host >> self.cbits)

    # ------------------------------------------------------------- write-back
    def dirty(self) -> bool:
        return self.table_dirty or any(b.dirty for b in self.blocks.values())

    def block_offset(self, t: int) -> int:
        return self.table[t] & fmt.REFT_OFFSET_MASK

    def cut(self) -> list[tuple[int, fmt.RefBlock, int, bytes]]:
        """The dirty blocks as they are now: (index, block, generation, bytes)."""
        return [(t, b, b.gen, b.dump()) for t, b in self.blocks.items() if b.dirty]

    @staticmethod
    def clean(refs: list[tuple[int, fmt.RefBlock, int, bytes]]) -> None:
        """After the sync that made ``cut``'s blocks durable: clean unless
        changed since."""
        for _t, b, g, _raw in refs:
            if b.gen == g:
                b.dirty = False
