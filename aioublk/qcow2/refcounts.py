"""Refcounts: the refcount blocks (loaded on demand, created inside the range
they describe), the refcount table (grown by moving it to the end of the
file), and cluster allocation. Every refcount change runs under
``alloc_lock``. Frees are deferred (``_defer_free``): see
``aioublk.qcow2.flush``."""

from __future__ import annotations

from array import array

from aioublk.io.hostfile import aligned
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import ImageBase, _eio, log
from aioublk.qcow2.format import COMPRESSED, OFFSET_MASK
from aioublk.qcow2.writeback import REFBLOCK, REFTABLE


class Refcounts(ImageBase):
    """Refcount blocks, the refcount table and allocation."""

    async def _refblock(self, t: int, create: bool) -> fmt.RefBlock | None:
        b = self.refblocks.get(t)
        if b is not None:
            return b
        if t >= len(self.reftable):
            if not create:
                return None
            await self._grow_reftable(t)
            return await self._refblock(t, create)  # growing may have made block t
        off = self.reftable[t] & fmt.REFT_OFFSET_MASK
        if off:
            if off & self.cmask or off + self.cluster_size > self.used_end:
                raise _eio(f"{self.path}: refcount table entry {t} points to {off:#x}, "
                           "which is invalid")
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            b = fmt.RefBlock(self.h.refcount_bits, buf)
            self.refblocks[t] = b
            return b
        if not create:
            return None
        # a missing block means every cluster it covers is free: put the block
        # inside its own range so that it describes itself
        base = t * self.rbe
        c = next((c for c in range(base, base + self.rbe) if not self._taken(c)), None)
        b = fmt.RefBlock(self.h.refcount_bits, bytes(self.cluster_size))
        self.refblocks[t] = b
        if c is not None:
            b[c - base] = 1
        else:
            c = self._clear_past_end(max(self._end_cluster(), base + self.rbe), 1)
            self._reserving.add(c)
            try:
                await self._add_ref(c, 1)
            finally:
                self._reserving.discard(c)
        self.meta[c] = REFBLOCK
        self.used_end = max(self.used_end, (c + 1) << self.cbits)
        self.reftable[t] = c << self.cbits
        self.reftable_dirty = True
        self._rt_gen += 1
        b.dirty = True
        b.gen += 1
        return b

    def _end_cluster(self) -> int:
        return (self.used_end + self.cmask) >> self.cbits

    def _taken(self, c: int) -> bool:
        """Whether host cluster ``c`` is metadata (also one a table points to
        past the end of the file) or is being claimed."""
        return c in self.meta or c in self._reserving

    def _clear_past_end(self, start: int, n: int) -> int:
        """The first cluster from ``start`` on (past the end of the file) that
        begins ``n`` clusters none of which is taken."""
        c = start
        while c < start + n:
            if self._taken(c):
                start = c + 1
            c += 1
        return start

    async def _add_ref(self, c: int, delta: int) -> int:
        """Change a refcount; returns the new value. A decrement never creates
        refcount structures: a cluster without a refcount is left alone (leaked
        at worst) and reported, as QEMU does."""
        return self._bump(await self._refblock(c // self.rbe, create=delta > 0), c, delta)

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

    async def _add_ref_run(self, run: range, delta: int) -> None:
        """Raise (or lower) the refcounts of ``run`` by ``delta``: one refcount
        block lookup per block the run touches, not one await per cluster,
        since allocation counts whole runs (``_alloc``) and allocation speed
        is what a first write to a cluster waits for."""
        rbe = self.rbe
        c = run.start
        while c < run.stop:
            stop = min(run.stop, (c // rbe + 1) * rbe)
            b = await self._refblock(c // rbe, create=delta > 0)
            for x in range(c, stop):
                self._bump(b, x, delta)
            c = stop

    async def _claim(self, run: range) -> None:
        """Count free clusters ``run`` as taken (refcount 1), under
        ``alloc_lock``. The run is claimed before it is counted: a refcount
        block or a grown table made on the way must land elsewhere."""
        self.used_end = max(self.used_end, run.stop << self.cbits)
        self._reserving.update(run)
        try:
            await self._add_ref_run(run, 1)
        finally:
            self._reserving.difference_update(run)

    async def _grow_reftable(self, need: int) -> None:
        """Move the refcount table to a bigger place at the end of the file. The
        header switches to it in write-back; the old one is freed after."""
        cs = self.cluster_size
        per = cs // 8
        start = max(self._end_cluster(), max(self._reserving, default=-1) + 1)
        entries = max(need + 1, len(self.reftable) * 2)
        while True:  # big enough to cover itself and the blocks that count it
            clusters = -(-entries // per)
            free = self._clear_past_end(start, clusters)  # not over a table past the end
            if free != start:
                start = free
                continue
            needed = (start + clusters + 8) // self.rbe + 1
            if entries >= needed:
                break
            entries = needed
        entries = clusters * per
        old_off, old_clusters = self.reftable_offset, self.reftable_clusters
        grown = array("Q", self.reftable)
        grown.extend(array("Q", bytes(8 * (entries - len(grown)))))
        self.reftable = grown
        run = range(start, start + clusters)
        await self._claim(run)
        for c in run:
            self.meta[c] = REFTABLE
        self.reftable_offset = start << self.cbits
        self.reftable_clusters = clusters
        self.reftable_dirty = True
        self.reftable_moved = True
        self._rt_gen += 1
        for c in range(old_off >> self.cbits, (old_off >> self.cbits) + old_clusters):
            self._defer_free(c)
        log.info("qcow2 refcount table grown", image=self.path, clusters=clusters)

    async def _alloc(self, n: int, meta: int | None = None) -> tuple[int, bool]:
        """``n`` contiguous free host clusters, their refcounts set to 1: the
        first one, and whether they were never written (past the old end of
        the file, so their unwritten parts read as zeros)."""
        rbe = self.rbe
        async with self.alloc_lock:
            start = c = self._free_hint
            hole = -1  # the first free cluster passed over (a run too short for n)
            end_cluster = self._end_cluster()
            while c - start < n:
                if self._taken(c):  # also past the end: a table may point there
                    start = c = c + 1
                    continue
                if c >= end_cluster:
                    c += 1  # past the end, no refcount: free
                    continue
                b = await self._refblock(c // rbe, create=False)
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
            if self._pub_host:
                await self._claim_unpublished(run)
            fresh = start << self.cbits >= self.used_end
            await self._claim(run)
            self._free_hint = run.stop if hole < 0 else hole
            if meta is not None:
                for c in run:
                    self.meta[c] = meta
            return start, fresh

    def _defer_free(self, c: int) -> None:
        self._frees.append((self.gen, c))

    def _release(self, entry: int) -> None:
        """Drop the references an L2 entry held (deferred: see the module
        docstring). An entry pointing nowhere valid is leaked, not freed."""
        if entry & COMPRESSED:
            clusters = fmt.compressed_clusters(entry, self.cbits)
            if clusters.stop << self.cbits <= self.used_end + self.cluster_size:
                for c in clusters:
                    self._defer_free(c)
        elif entry & OFFSET_MASK:
            host = entry & OFFSET_MASK
            if not host & self.cmask and host < self.used_end and host >> self.cbits \
                    not in self.meta:
                self._defer_free(host >> self.cbits)

