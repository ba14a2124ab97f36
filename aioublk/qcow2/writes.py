"""Writes: in place where the image alone owns the cluster, else into fresh
clusters (copy-on-write of what the request leaves out), then the L2 entries
switch over; write_zeroes and discard change L2 entries of whole clusters
and write zeros into the parts of others."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

from aioublk.io.hostfile import aligned
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import _ZEROS, PARTIAL, L2Table, _zero_buf, engine_entry
from aioublk.qcow2.compress import compress
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, ZERO
from aioublk.qcow2.reads import Reads
from aioublk.ring import current_ring
from aioublk.target import Done, rw_handler


def _in_place(e: int) -> bool:
    """Whether a write to the cluster of entry ``e`` goes into its host
    cluster: allocated, the image's alone, plain data in every subcluster."""
    return e & (COPIED | COMPRESSED | ZERO | PARTIAL) == COPIED and bool(e & OFFSET_MASK)


class Writes(Reads):
    """The write, write_zeroes and discard paths."""

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        """The task-free write: in place, into one cluster the image owns alone."""
        host = self._mapped(offset, len(buf), True)
        if host < 0:
            return False
        current_ring().start_write(self.file.fd, buf, host, self._tracked(
            rw_handler(len(buf), done, lambda: self.write(offset, buf),
                       self.file.refused)))
        return True


    async def write(self, offset: int, data: Any) -> None:
        """Store ``data`` at ``offset``."""
        if self.read_only or self.corrupt:
            self._writable()
        view = data if type(data) is memoryview and data.format == "B" else \
            memoryview(data).cast("B")
        end = offset + len(view)
        if end > self.size:
            raise OSError(errno.EINVAL, f"write past the end of {self.path}")
        host = self._mapped(offset, len(view), True)  # in place: the common case
        if host >= 0:
            g = self._io_begin()
            try:
                await self.file.write(view, host)
            finally:
                self._io_end(g)
            return
        chunk = self._compress_chunk if self.compress else self._write_chunk
        await self._per_table(offset, end, lambda s, e: chunk(s, e, offset, view))
        await self._write_through()

    async def _per_table(self, start: int, end: int, fn: Any) -> None:
        """Run ``fn(s, e)`` for each piece of [start, end) that one L2 table maps."""
        span = 1 << (self.cbits + self.l2_bits)
        pos = start
        while pos < end:
            stop = min(end, (pos // span + 1) * span)
            await fn(pos, stop)
            pos = stop

    async def _lock(self, vcs: range) -> None:
        loop = asyncio.get_running_loop()
        for vc in vcs:
            while (f := self._busy.get(vc)) is not None:
                await asyncio.shield(f)
            self._busy[vc] = loop.create_future()
        try:
            await self.pools.settle(vcs)
        except BaseException:
            self._unlock(vcs)
            raise

    def _unlock(self, vcs: range) -> None:
        for vc in vcs:
            f = self._busy.pop(vc, None)
            if f is not None:
                f.set_result(None)

    async def _write_chunk(self, s: int, e: int, base: int, view: memoryview) -> None:
        cbits, cs = self.cbits, self.cluster_size
        vcs = range(s >> cbits, ((e - 1) >> cbits) + 1)
        await self._lock(vcs)
        try:
            olds = [await self.l2.entry(vc) for vc in vcs]
            i = 0
            while i < len(vcs):
                e0 = olds[i]
                j = i + 1
                if _in_place(e0):
                    host = e0 & OFFSET_MASK
                    self._check_host(host, vcs[i])
                    while j < len(vcs) and _in_place(olds[j]) \
                            and olds[j] & OFFSET_MASK == host + (j - i) * cs:
                        j += 1
                    ws = max(s, vcs[i] << cbits)
                    we = min(e, vcs[j - 1] + 1 << cbits)
                    h0 = host + (ws - (vcs[i] << cbits))
                    self._overlap(h0, we - ws)
                    await self._data_write([view[ws - base:we - base]], h0)
                else:
                    while j < len(vcs) and not _in_place(olds[j]):
                        j += 1
                    a, b = i, j
                    if self.h.extended_l2:  # (the clusters it covers in part: by subcluster)
                        if await self._sub_write(vcs[a], olds[a], s, e, base, view):
                            a += 1
                        if b > a and await self._sub_write(vcs[b - 1], olds[b - 1], s, e, base,
                                                           view):
                            b -= 1
                    if b > a:
                        await self._alloc_write(vcs[a:b], olds[a:b], s, e, base, view)
                i = j
        finally:
            self._unlock(vcs)
        if self.plane.on:  # what it wrote, in place or into new clusters
            self.plane.publish_vcs(vcs)
            if self.backing is not None:  # (the first time: the rest of the span, COW)
                self.plane.through(vcs)

    async def _compress_chunk(self, s: int, e: int, base: int, view: memoryview) -> None:
        """With ``compress``: the whole clusters of [s, e) compressed (runs of
        those that do not shrink, and the parts of clusters at either end,
        written as usual)."""
        cbits, cs = self.cbits, self.cluster_size
        first, last = -(-s // cs) * cs, e // cs * cs
        if first >= last:
            await self._write_chunk(s, e, base, view)
            return
        if s < first:
            await self._write_chunk(s, first, base, view)
        vcs = range(first >> cbits, last >> cbits)
        kind = self.h.compression_type
        blobs = [compress(kind, view[(vc << cbits) - base:(vc + 1 << cbits) - base], cs - 1)
                 for vc in vcs]
        i = 0
        while i < len(vcs):
            j = i + 1
            while j < len(vcs) and (blobs[j] is None) == (blobs[i] is None):
                j += 1
            if blobs[i] is None:
                await self._write_chunk(vcs[i] << cbits, vcs[j - 1] + 1 << cbits, base, view)
            else:
                await self._compressed_run(vcs[i:j], [b for b in blobs[i:j] if b is not None])
            i = j
        if last < e:
            await self._write_chunk(last, e, base, view)

    def _pack(self, blobs: list[bytes]) -> tuple[list[int], list[int]]:
        """Where each compressed cluster goes in a run of fresh host clusters
        (byte offsets from its start, one after another, a cluster skipped
        where its refcount would overflow), and how many of them touch each
        host cluster of the run: its refcount."""
        cbits = self.cbits
        most = (1 << self.h.refcount_bits) - 1
        at = 0
        offs: list[int] = []
        touches: list[int] = []
        for b in blobs:
            if at >> cbits < len(touches) and touches[at >> cbits] >= most:
                at = (at >> cbits) + 1 << cbits
            offs.append(at)
            for c in range(at >> cbits, (at + len(b) - 1 >> cbits) + 1):
                touches += [0] * (c + 1 - len(touches))
                touches[c] += 1
            at += len(b)
        return offs, touches

    async def _compressed_run(self, vcs: range, blobs: list[bytes]) -> None:
        """Whole clusters stored compressed, packed into fresh host clusters,
        then their L2 entries switched over (as ``_alloc_write``)."""
        cbits, cs = self.cbits, self.cluster_size
        offs, touches = self._pack(blobs)
        n = len(touches)
        buf = aligned(n * cs)
        for off, b in zip(offs, blobs, strict=True):
            buf[off:off + len(b)] = b
        await self._lock(vcs)
        try:
            olds = [await self.l2.entry(vc) for vc in vcs]
            await self.l2.for_update(vcs[0] >> self.l2_bits)
            c0, _ = await self.refs.alloc(n)
            host0 = c0 << cbits
            try:
                self._overlap(host0, n * cs)
                await self._data_write([buf], host0)
            except BaseException:
                for c in range(c0, c0 + n):
                    self.frees.defer(c)
                raise
            async with self.refs.lock:
                for k, t in enumerate(touches):
                    if t > 1:
                        await self.refs.add_ref(c0 + k, t - 1)
            shift = 62 - (cbits - 8)
            table = await self._remap(vcs)
            for k, vc in enumerate(vcs):
                host = host0 + offs[k]
                sectors = (host + len(blobs[k]) - 1 >> 9) - (host >> 9)
                table.entries[vc & self.l2_mask] = COMPRESSED | sectors << shift | host
                self.refs.release(olds[k])
            self._changed(table)
        finally:
            self._unlock(vcs)
        if self.plane.on:
            self.plane.publish_vcs(vcs)

    async def _sub_write(self, vc: int, old: int, s: int, e: int, base: int,
                         view: memoryview) -> bool:
        """Extended L2: the part of [s, e) in cluster ``vc`` (held), if it
        covers the cluster only in part, written into the subclusters it
        touches alone, as QEMU's subclusters allow: the others keep showing
        what they showed (the backing file, zeros, their data), so nothing
        is copied but the edges of the subclusters written. False where
        that does not apply (a whole cluster written; a compressed or shared
        one, or preallocated zeros): the caller writes the cluster whole."""
        cbits, cs = self.cbits, self.cluster_size
        c0 = vc << cbits
        ws, we = max(s, c0), min(e, c0 + cs)
        if ws == c0 and we == c0 + cs or old & COMPRESSED or \
                old & OFFSET_MASK and (not old & COPIED or old & ZERO):
            return False
        sc = cs // fmt.SUBCLUSTERS
        lo, hi = (ws - c0) // sc * sc, -(-(we - c0) // sc) * sc
        touched = (1 << hi // sc) - (1 << lo // sc)
        if old & PARTIAL:
            await self.l2.entry(vc)  # (its table cached again, if it went)
            word = self.l2.sub_word(vc)
        else:
            word = fmt.SUB_ZERO if old & ZERO else 0
        host = old & OFFSET_MASK
        fresh = not host
        if fresh:
            await self.l2.for_update(vc >> self.l2_bits)
            c, _ = await self.refs.alloc(1)
            host = c << cbits
        else:
            self._check_host(host, vc)
        try:
            bufs: list[Any] = []
            for at, n in ((lo, ws - c0 - lo), (we - c0, hi - (we - c0))):
                if n:  # (the edges of the subclusters written: what they showed)
                    edge = aligned(n)
                    await self._read_partial(vc, old, word, at, edge)
                    bufs.append(edge)
                if at == lo:
                    bufs.append(view[ws - base:we - base])
            self._overlap(host + lo, hi - lo)
            await self._data_write(bufs, host + lo)
        except BaseException:
            if fresh:
                self.frees.defer(host >> cbits)
            raise
        t = await self._remap(range(vc, vc + 1))
        assert t.subs is not None
        alloc = word & fmt.SUB_ALLOC | touched
        k = vc & self.l2_mask
        t.subs[k] = alloc | (word >> 32 & ~touched) << 32
        t.entries[k] = host | COPIED | (0 if alloc == fmt.SUB_ALLOC else PARTIAL)
        self._changed(t)
        return True

    async def _alloc_write(self, vcs: range, olds: list[int], s: int, e: int, base: int,
                           view: memoryview) -> None:
        """Write into fresh clusters (filling what the request leaves out from the
        old contents), then point the L2 entries at them."""
        cbits, cs = self.cbits, self.cluster_size
        l1i = vcs[0] >> self.l2_bits
        await self.l2.for_update(l1i)
        c0, fresh = await self.refs.alloc(len(vcs))
        host0 = c0 << cbits
        run_s, run_e = vcs[0] << cbits, (vcs[-1] + 1) << cbits
        ws, we = max(s, run_s), min(e, run_e)
        bufs: list[Any] = []
        at = host0
        try:
            if ws > run_s:
                head = await self._cow(vcs[0], olds[0], 0, ws - run_s)
                if head is None and fresh:
                    at = host0 + (ws - run_s)
                else:
                    bufs.append(head if head is not None else _zero_buf(ws - run_s))
            bufs.append(view[ws - base:we - base])
            if we < run_e:
                tail = await self._cow(vcs[-1], olds[-1], we - (vcs[-1] << cbits), run_e - we)
                if tail is not None or not fresh:
                    bufs.append(tail if tail is not None else _zero_buf(run_e - we))
            self._overlap(at, sum(len(b) for b in bufs))  # as in place: never over a table
            await self._data_write(bufs, at)
        except BaseException:
            for c in range(c0, c0 + len(vcs)):
                self.frees.defer(c)  # leaked otherwise; nothing points at them
            raise
        t = await self._remap(vcs)
        for k, vc in enumerate(vcs):
            t.entries[vc & self.l2_mask] = (host0 + k * cs) | COPIED
            self.refs.release(olds[k])
        self._changed(t)

    async def _cow(self, vc: int, old: int, at: int, length: int) -> Any:
        """The old contents of ``length`` bytes at ``at`` in cluster ``vc``, or
        None when they are zeros."""
        if old & PARTIAL and not old & COMPRESSED:  # (vc is held: its word stays)
            await self.l2.entry(vc)  # (its table cached again, if it went)
            buf = aligned(length)
            await self._read_partial(vc, old, self.l2.sub_word(vc), at, buf)
            return buf
        if old & COMPRESSED:
            data = await self._cluster_bytes(old)
            return memoryview(data)[at:at + length]
        if old & ZERO:
            return None
        if old & OFFSET_MASK:
            self._check_host(old & OFFSET_MASK, vc)
            buf = aligned(length)
            await self.file.read_into(buf, (old & OFFSET_MASK) + at)  # under the cluster lock
            return buf
        if self.backing is None or (vc << self.cbits) + at >= self.backing.size:
            return None
        buf = aligned(length)
        await self._read_backing((vc << self.cbits) + at, buf)
        return buf

    async def write_zeroes(self, offset: int, length: int, unmap: bool = False) -> None:
        """Zeros at [offset, offset+length): whole clusters by their L2 entries,
        the rest by writing zeros."""
        self._writable()
        await self._zero_or_discard(offset, length, unmap=unmap, discard=False)
        await self._write_through()

    async def discard(self, offset: int, length: int) -> None:
        """Unmap whole clusters (they read as zeros, or as the backing file's
        bytes on a v2 image, where there is no zero flag). The parts of
        clusters at either end are zeroed rather than left with old data
        (QEMU leaves them): a discarded range never reads back stale bytes."""
        self._writable()
        await self._zero_or_discard(offset, length, unmap=True, discard=True)
        await self._write_through()

    async def _zero_or_discard(self, offset: int, length: int, *, unmap: bool,
                               discard: bool) -> None:
        end = offset + length
        if end > self.size:
            raise OSError(errno.EINVAL, f"range past the end of {self.path}")
        cs = self.cluster_size
        first = (offset + cs - 1) & ~self.cmask
        last = end & ~self.cmask if end != self.size else -(-end // cs) * cs
        if first >= last:  # no whole cluster, but maybe the end of one and the start of the next
            cut = offset < first < end
            await self._zero_part(offset, first if cut else end)
            if cut:
                await self._zero_part(first, end)
            return
        if offset < first:
            await self._zero_part(offset, first)
        if last < end:
            await self._zero_part(last, end)
        zero_flag = self.v3 and (self.backing is not None or not discard)
        if not self.v3 and self.backing is not None and not discard:
            await self._write_zero_bytes(first, min(last, end))  # v2 cannot hide the backing
            return
        await self._per_table(first, min(last, self.size),
                              lambda s, e: self._zero_chunk(s, e, unmap, zero_flag))

    async def _zero_part(self, s: int, e: int) -> None:
        """Zeros inside one cluster: nothing to do if it reads as zeros already."""
        vc = s >> self.cbits
        old = await self.l2.entry(vc)
        if old & COMPRESSED == 0 and (old & ZERO or not old & OFFSET_MASK and (
                self.backing is None or vc << self.cbits >= self.backing.size)):
            return
        if self.h.extended_l2 and not old & COMPRESSED:
            # whole subclusters by their zero bits, as QEMU zeroes them
            sc, c0 = self.cluster_size // fmt.SUBCLUSTERS, vc << self.cbits
            lo, hi = c0 + -(-(s - c0) // sc) * sc, c0 + (e - c0) // sc * sc
            if lo < hi:
                for a, b in ((s, lo), (hi, e)):
                    if a < b:
                        await self._write_zero_bytes(a, b)
                await self._zero_subclusters(vc, (lo - c0) // sc, (hi - c0) // sc)
                return
        await self._write_zero_bytes(s, e)

    async def _zero_subclusters(self, vc: int, a: int, b: int) -> None:
        """Subclusters [a, b) of cluster ``vc`` read as zeros: their zero bits
        set, their allocation bits cleared (the host cluster, if any, stays:
        the other subclusters may hold data)."""
        vcs = range(vc, vc + 1)
        await self._lock(vcs)
        try:
            old = await self.l2.entry(vc)
            if old & COMPRESSED:  # (compressed meanwhile: zeros the long way, below)
                return
            word = self.l2.sub_word(vc) if old & PARTIAL else fmt.SUB_ZERO if old & ZERO \
                else fmt.SUB_ALLOC if old & OFFSET_MASK else 0
            mask = (1 << b) - (1 << a)
            word = word & fmt.SUB_ALLOC & ~mask | ((word >> 32) | mask) << 32
            t = await self._remap(vcs)
            assert t.subs is not None
            k = vc & self.l2_mask
            t.subs[k] = word
            t.entries[k] = engine_entry(old & ~(PARTIAL | ZERO), word)
            self._changed(t)
        finally:
            self._unlock(vcs)
        if old & COMPRESSED:
            sc = self.cluster_size // fmt.SUBCLUSTERS
            await self._write_zero_bytes((vc << self.cbits) + a * sc, (vc << self.cbits) + b * sc)
        elif self.plane.on:
            self.plane.publish_vcs(vcs)

    async def _write_zero_bytes(self, s: int, e: int) -> None:
        pos = s
        while pos < e:
            n = min(e - pos, len(_ZEROS))
            await self.write(pos, _ZEROS[:n])
            pos += n

    async def _zero_chunk(self, s: int, e: int, unmap: bool, zero_flag: bool) -> None:
        vcs = range(s >> self.cbits, ((e - 1) >> self.cbits) + 1)
        await self._lock(vcs)
        try:
            olds = [await self.l2.entry(vc) for vc in vcs]
            want = ZERO if zero_flag else 0
            if not all(self._same_zero(o, want) for o in olds):
                t = await self._remap(vcs)
                for vc, old in zip(vcs, olds, strict=True):
                    if self._same_zero(old, want):
                        continue
                    keep = not unmap and zero_flag and old & (COPIED | COMPRESSED) == COPIED \
                        and old & OFFSET_MASK
                    if keep:
                        t.entries[vc & self.l2_mask] = (old & OFFSET_MASK) | COPIED | ZERO
                    else:
                        t.entries[vc & self.l2_mask] = want
                        if unmap and old & OFFSET_MASK and not old & COMPRESSED:
                            self.frees.punch.add((old & OFFSET_MASK) >> self.cbits)
                        self.refs.release(old)
                self._changed(t)
        finally:
            self._unlock(vcs)
        if self.plane.on:  # zeros now: reads of them are C's again
            self.plane.publish_vcs(vcs)

    async def _remap(self, vcs: range) -> L2Table:
        """The one way to change L2 entries: take clusters ``vcs`` (one L2
        table's, held in ``_busy`` by the caller) back from the data plane, wait
        until no request it started on them is in flight, and return their
        table made private for the update, with the entries marked unpublished.
        The caller sets the entries without awaiting after this; ``_busy``
        keeps them from being published again meanwhile."""
        await self.plane.unmap(vcs)
        t = await self.l2.for_update(vcs.start >> self.l2_bits)
        pub, mask = t.pub, self.l2_mask
        for vc in vcs:
            pub[vc & mask] = 0
        return t

    def _changed(self, t: L2Table) -> None:
        """An L2 table changed (the refcounts it needs were changed before)."""
        t.touch()
        self.wb.changed()

    async def _write_through(self) -> None:
        """With ``metadata_write_through``: return once every metadata change
        made so far (this request's, and any other's it may depend on: a
        write in place into a cluster whose allocation is still in memory)
        is in the image file (``WriteBack.write_through``)."""
        if self.metadata_write_through:
            await self.wb.write_through()

    @staticmethod
    def _same_zero(old: int, want: int) -> bool:
        return old == want or (want == ZERO and old & (ZERO | COMPRESSED) == ZERO)

