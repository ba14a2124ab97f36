"""What the data plane serves of an image: the image's extent table, and
the rules by which the entries of cached L2 tables are published in it
(``Publisher.run``), taken back, and checked against allocation. The rules
and the invariant are in ``aioublk.qcow2.image`` ("The data plane").

A ``Publisher`` knows the extent table, the L1 table and the cached L2
tables (read only), the clusters being changed (``busy``), the map of
metadata clusters, where the file ends (``Refcounts.used_end``) and the
pools; of the image's mode only what it is asked per call (``writable``,
``allocating``)."""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

from aioublk.dataplane.extents import (
    ALLOC,
    COW,
    COW_SUB,
    MAP,
    SUB,
    ZERO,
    ZERO_FD,
    ZIP,
    ZIP_COW,
    ExtentConflict,
    ExtentTable,
    Zipped,
)
from aioublk.qcow2.base import PARTIAL, L2Table, log
from aioublk.qcow2.format import COPIED, OFFSET_MASK, SUB_ALLOC
from aioublk.qcow2.pools import Pools
from aioublk.qcow2.refcounts import Refcounts
from aioublk.qcow2.zcache import ZCache

#: where a backing chain holds bytes [pos, pos + n): a run (fd, offset,
#: length), length > 0 and at most n, fd ``ZERO_FD`` for zeros; one whole
#: compressed cluster's compressed bytes (``Zipped``); None where it cannot
#: say without I/O (a table not cached, part of a compressed cluster)
Place = Callable[[int, int], "tuple[int, int, int] | Zipped | None"]


class Publisher:
    """The extent table of an image, and what of the L2 cache is in it."""

    def __init__(self, fd: int, path: str, cbits: int, l2_bits: int, size: int,
                 backing_end: int, l1: array[int], tables: OrderedDict[int, L2Table],
                 busy: dict[int, asyncio.Future[None]], meta: dict[int, int],
                 refs: Refcounts, pools: Pools, pub_host: dict[int, int],
                 writable: Callable[[], bool], allocating: Callable[[], bool],
                 mark_corrupt: Callable[[str], NoReturn], place: Place | None = None) -> None:
        self.fd = fd
        self.path = path
        self.cbits = cbits
        self.cluster_size = 1 << cbits
        self.l2_bits = l2_bits
        self.l2_mask = (1 << l2_bits) - 1
        self.size = size
        self.backing_end = backing_end  # what of the disk the backing file holds
        self.l1 = l1
        self.tables = tables
        self.busy = busy  # guest clusters being changed: never published meanwhile
        self.meta = meta
        self.refs = refs
        self.pools = pools
        #: host cluster -> the guest cluster it was published for (may be stale:
        #: checked against the L2 entry when used, see ``claim``)
        self.pub_host = pub_host
        self.writable = writable  # a write may go in place (the image's mode)
        self.allocating = allocating  # C may allocate (``Qcow2Image.c_allocating``)
        self.mark_corrupt = mark_corrupt
        #: where the backing chain holds a run of the disk (``Place``): None
        #: without a backing file
        self.place = place
        #: L1 indexes whose unallocated clusters were all offered to the data
        #: plane through the backing chain (``through``); forgotten as their
        #: extents are taken back
        self.walked: set[int] = set()
        #: granules published through the chain where L1 names no table (no
        #: table forgets them): L1 index -> count, bounded by ``loose_cap``
        self.loose: dict[int, int] = {}
        self.loose_cap = 0
        #: the chain's compressed clusters are published as ZIP, for the data
        #: plane to inflate (not in the zero-copy modes, where it has no
        #: buffer to inflate into: there a read inflates them in Python, and
        #: a backing image's cache of them is published instead)
        self.zip_ok = True
        #: memfd of a backing image's decompressed clusters -> the clusters
        #: published in it (``hold``, ``take_back_fd``)
        self.in_ram: dict[int, set[int]] = {}
        #: the data plane's map of this image; None until ``start``
        self.extents: ExtentTable | None = None
        self.on = False  # extents is set and may take new entries

    def start(self, max_entries: int) -> ExtentTable:
        """The extent table (made on the first call, the cached tables
        published in it)."""
        if self.extents is None:
            self.extents = ExtentTable(self.cluster_size, max_entries=max_entries)
            self.loose_cap = max_entries // 4
            self.on = True
            self.pools.table = self.extents
            for t in list(self.tables.values()):
                self.entered(t)
        return self.extents

    def republish(self) -> None:
        """Take every extent back and publish the cached tables again. No
        mapping changes, so nothing waits."""
        if self.extents is None:
            return
        self.extents.invalidate(0, (1 << 64) - 1)
        self.pub_host.clear()
        self.walked.clear()
        self.loose.clear()
        for t in list(self.tables.values()):
            t.pub[:] = bytes(len(t.pub))
            self.entered(t)

    def drop(self) -> None:
        """Take every extent from the data plane and publish no more (a corrupt
        or closing image). Requests C already started finish on mappings that
        are still valid: nothing changes them without ``unmap``."""
        self.on = False
        self.pub_host.clear()
        self.walked.clear()
        self.loose.clear()
        if self.extents is not None:
            self.extents.invalidate(0, (1 << 64) - 1)

    async def claim(self, run: range) -> None:
        """Host clusters about to be allocated must not be any guest cluster's
        published data. On an image whose refcounts are too low a cluster can
        be free and still mapped, and the data plane would then write guest
        data over whatever the cluster becomes: that is corruption, as the
        Python path's metadata-overlap check says. Wait until no request C
        started on it is in flight, then mark the image corrupt."""
        for c in run:
            vc = self.pub_host.get(c)
            if vc is None:
                continue
            off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
            t = self.tables.get(off) if off else None
            i = vc & self.l2_mask
            if t is None or t.pub[i] not in (MAP, SUB) or \
                    (t.entries[i] & OFFSET_MASK) >> self.cbits != c:
                del self.pub_host[c]  # taken back since (ZERO never reads the cluster)
                continue
            assert self.extents is not None
            await self.extents.unmap(vc << self.cbits, self.cluster_size)
            self.mark_corrupt(f"cluster {c << self.cbits:#x} is free by its refcount but "
                              f"still holds the data of guest cluster {vc}")

    async def unmap(self, vcs: range) -> None:
        """Take clusters ``vcs`` back, once no request C started on them is in
        flight (before their mapping changes: ``Qcow2Image._remap``)."""
        if self.extents is not None:
            await self.extents.unmap(vcs.start << self.cbits, len(vcs) << self.cbits)

    # ------------------------------------------------- what the L2 cache tells
    def entered(self, t: L2Table) -> None:
        """Publish every entry of ``t``, just cached, if L1 names it."""
        if self.on and self.l1[t.l1i] & OFFSET_MASK == t.offset:
            self.walked.discard(t.l1i)
            self.run(t, 0, len(t.entries))

    def replaced(self, t: L2Table) -> None:
        """``t`` (new, the same entries or none yet) took the place of its L1
        index's table: take back what the old table published (no mapping
        changes, so nothing waits) and publish ``t`` whole, its pub bytes
        then telling the truth."""
        if self.extents is not None:
            span = self.l2_bits + self.cbits
            self.extents.invalidate(t.l1i << span, 1 << span)
            self.loose.pop(t.l1i, None)
        self.entered(t)

    async def take_back(self, t: L2Table) -> None:
        """Unpublish all of ``t`` (cached), waiting for what C holds of it."""
        assert self.extents is not None
        span = self.l2_bits + self.cbits
        await self.extents.unmap(t.l1i << span, 1 << span)
        self.pools.drain()
        t.pub[:] = bytes(len(t.pub))
        self.walked.discard(t.l1i)

    def forget(self, t: L2Table) -> None:
        """``t`` left the cache: take back what it published, so that the data
        plane holds only clusters whose entries are cached. The mapping does
        not change, so requests in flight may finish (a later change waits for
        them in ``unmap``). A table L1 no longer names (a copy replaced it)
        leaves its successor's extents alone."""
        if self.extents is not None and any(t.pub) and \
                self.l1[t.l1i] & OFFSET_MASK == t.offset:
            span = self.l2_bits + self.cbits
            self.extents.invalidate(t.l1i << span, 1 << span)
            self.walked.discard(t.l1i)

    # ----------------------------------------------------------- publishing
    def publish(self, vc: int) -> None:
        """Offer cluster ``vc`` to the data plane if its table is cached."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        t = self.tables.get(off) if off else None
        if t is not None and not t.pub[vc & self.l2_mask]:
            self.run(t, vc & self.l2_mask, 1)

    def publish_vcs(self, vcs: range) -> None:
        """Offer clusters ``vcs`` (one L2 table's) to the data plane, in one call."""
        off = self.l1[vcs.start >> self.l2_bits] & OFFSET_MASK
        t = self.tables.get(off) if off else None
        if t is not None:
            self.run(t, vcs.start & self.l2_mask, len(vcs))

    def publish_in(self, t: L2Table, vc: int) -> None:
        """Publish cluster ``vc``, whose entry is in ``t`` (cached and current),
        by the rules of ``run``."""
        self.run(t, vc & self.l2_mask, 1)

    def run(self, t: L2Table, i: int, n: int) -> None:
        """Publish entries [i, i + n) of ``t`` (cached, current, named by L1)
        that are not published yet, in one C call (``ExtentTable.publish_l2``,
        the one place the rules are applied):

        - as data (MAP), a normal cluster: allocated, not compressed or ZERO,
          cluster aligned, inside the file, not a metadata cluster. It is
          writable where a write may go in place (as ``Qcow2Image._mapped(...,
          write=True)`` decides, less what changes per request): COPIED, the
          image ``writable``; read-only elsewhere;
        - as ZERO, an entry that reads as zeros without backing data: the ZERO
          flag (with a host cluster or not), or unallocated with no backing
          file or wholly past the backing file's end. Reads are then C's, and
          a write misses, to be allocated here;
        - as ALLOC, what would be ZERO without a host cluster, where C may
          allocate (``aioublk.qcow2.pools``: ``allocating``, and the table
          private to the active layer, COPIED in L1, so that a record never
          needs the table copied): reads are zeros, a write takes a cluster
          from the queue's pool;
        - as SUB, a cluster whose subclusters differ, where C may allocate
          and the rest is in one run of the chain (``_publish_sub``);
        - never a compressed cluster, one that shows the backing file
          (``through`` publishes those), one past the disk's end, nor one
          being changed (``busy``): its changer has taken it back or is about
          to, and publishes it after."""
        if not self.on:
            return
        assert self.extents is not None
        cbits, vc0 = self.cbits, (t.l1i << self.l2_bits) + i
        partial: list[int] = []
        if n == 1:  # (the one host cluster and vc are all the rules need to know)
            if vc0 in self.busy:
                return
            if t.entries[i] & PARTIAL:
                if not t.pub[i]:
                    self._publish_sub(t, i)
                return
            c = (t.entries[i] & OFFSET_MASK) >> cbits
            meta: Any = (c,) if c in self.meta else ()
            skip: Any = ()
        else:
            meta = self.meta
            skip = [vc for vc in self.busy if vc0 <= vc < vc0 + n]
            if t.subs is not None:  # (subclusters that differ: vc by vc, below)
                partial = [k for k in range(i, i + n) if t.entries[k] & PARTIAL]
                skip = sorted({*skip, *(((t.l1i << self.l2_bits) + k) for k in partial)})
        try:
            pairs = self.extents.publish_l2(
                self.fd, vc0 << cbits, memoryview(t.entries)[i:i + n],
                memoryview(t.pub)[i:i + n], used_end=self.refs.used_end, size=self.size,
                writable_ok=self.writable(),
                alloc_ok=self.allocating() and bool(self.l1[t.l1i] & COPIED),
                backing_end=self.backing_end, meta=meta, skip=skip)
        except ExtentConflict:
            self._conflict(vc0)
            return
        if pairs:
            self.pub_host.update(pairs)
        base = t.l1i << self.l2_bits
        for k in partial:
            if not t.pub[k] and base + k not in self.busy:
                self._publish_sub(t, k)

    def _publish_sub(self, t: L2Table, i: int) -> None:
        """Publish entry ``i`` of ``t``, a cluster whose subclusters differ,
        as SUB: only where C may allocate in ``t`` (its records of more
        subclusters need that as an allocation's do), the cluster COPIED and
        plainly data, its subclusters data or not (none of them zero), and
        the chain's bytes under the cluster in one aligned run or zeros."""
        assert self.extents is not None
        e, sub = t.entries[i], t.subs[i] if t.subs is not None else 0
        host, cbits, cs = e & OFFSET_MASK, self.cbits, self.cluster_size
        if self.place is None or sub >> 32 or not sub & SUB_ALLOC or not e & COPIED or \
                host & (cs - 1) or host >= self.refs.used_end or host >> cbits in self.meta or \
                not (self.writable() and self.allocating() and self.l1[t.l1i] & COPIED):
            return
        vc = (t.l1i << self.l2_bits) + i
        pos = vc << cbits
        if pos + cs > self.size:
            return
        got = self.place(pos, cs)
        if not isinstance(got, tuple) or got[2] != cs or got[0] in self.in_ram or \
                got[0] != ZERO_FD and got[1] & (cs - 1):
            return  # (a cache's memfd: its slots are reused, see ``hold``)
        src_fd, src_off = (got[0], got[1]) if got[0] != ZERO_FD else (ZERO_FD, 0)
        try:
            if not self.extents.insert_sub(pos, self.fd, host, sub, src_fd, src_off):
                return
        except ExtentConflict:
            self._conflict(vc)
            return
        t.pub[i] = SUB
        self.pub_host[host >> cbits] = vc

    def _conflict(self, vc: int) -> None:
        """Cluster ``vc`` is mapped otherwise in the table: a mapping changed
        without ``_remap``, a bug; stop serving from the table."""
        log.error("qcow2 extent conflict: data plane off", image=self.path, cluster=vc)
        self.drop()

    # --------------------------------------------- the backing chain's data
    def through(self, vcs: range) -> None:
        """Clusters ``vcs`` were just read through the backing chain, or
        written (a copy-on-write read it): the chain's tables they needed
        are cached now. Publish those still unallocated where the chain
        holds their data and, the first time since the extents of an L2 span
        of theirs were last taken back, every unallocated cluster of that
        span: so a guest that only writes finds the rest of the span COW
        after its first write there. A cluster the chain cannot place
        without I/O stays Python's until a read of it comes here."""
        if not self.on or self.place is None:
            return
        span = 1 << self.l2_bits
        while vcs:
            l1i = vcs.start >> self.l2_bits
            first, stop = l1i << self.l2_bits, min(vcs.stop, (l1i << self.l2_bits) + span)
            if l1i not in self.walked:
                self.walked.add(l1i)
                self._through_span(l1i, range(first, first + span))
            else:
                self._through_span(l1i, range(vcs.start, stop))
            vcs = range(stop, vcs.stop)

    def _through_span(self, l1i: int, vcs: range) -> None:
        off = self.l1[l1i] & OFFSET_MASK
        if off:
            t = self.tables.get(off)
            if t is not None:
                self._chain_in(t, vcs.start & self.l2_mask, len(vcs))
            return
        # no table: nothing is allocated in the span, and nothing forgets what
        # is published here but ``replaced`` (a table made for it) or this bound
        if sum(self.loose.values()) + len(vcs) > self.loose_cap:
            self._forget_loose()
        busy = self.busy
        start = vcs.start
        for vc in sorted(vc for vc in busy if vcs.start <= vc < vcs.stop):
            if start < vc:
                self._publish_chain(start, vc, None)
            start = max(start, vc + 1)
        if start < vcs.stop:
            self._publish_chain(start, vcs.stop, None)

    def _publish_zip(self, pos: int, z: Zipped, t: L2Table | None, cow: bool) -> bool:
        """Publish cluster ``pos`` as the compressed cluster ``z`` places
        there, where it is one of ours and the data plane may inflate it:
        ZIP, or ZIP_COW where ``cow`` (C may allocate in ``t``, whole
        clusters: no subclusters); False when the table is full or
        publishing stopped."""
        assert self.extents is not None
        if not self.zip_ok or z.length != self.cluster_size:
            return True  # (Python's: a read inflates it)
        kind = ZIP_COW if cow else ZIP
        try:
            if not self.extents.insert_zip(pos, z.fd, z.zoff, z.zlen, z.alg, kind=kind):
                return False
        except ExtentConflict:
            self._conflict(pos >> self.cbits)
            return False
        vc = pos >> self.cbits
        if t is not None:
            t.pub[vc & self.l2_mask] = kind
        else:
            self.loose[vc >> self.l2_bits] = self.loose.get(vc >> self.l2_bits, 0) + 1
        return True

    def hold(self, zc: ZCache) -> None:
        """Publish clusters in ``zc``'s memfd where the chain places them
        there, and give them back when it empties."""
        self.in_ram[zc.fd] = set()
        zc.holders.append(self.take_back_fd)

    async def take_back_fd(self, fd: int) -> None:
        """Take back every cluster published in memfd ``fd`` (a cache about
        to reuse its slots) and wait until no request C started on one is
        in flight; those clusters are Python's until a read publishes them
        again."""
        vcs = sorted(self.in_ram.get(fd, ()))
        self.in_ram[fd] = set()
        if not vcs or self.extents is None:
            return
        start = prev = vcs[0]
        for vc in [*vcs[1:], -1]:
            if vc != prev + 1:
                await self.extents.unmap(start << self.cbits, (prev + 1 - start) << self.cbits)
                start = vc
            prev = vc
        self.pools.drain()  # (a copy-on-write C finished meanwhile: its record applied)
        for vc in vcs:  # (unmapped: whatever the records said, nothing is published)
            self.walked.discard(vc >> self.l2_bits)
            t = self.tables.get(self.l1[vc >> self.l2_bits] & OFFSET_MASK)
            if t is not None:
                t.pub[vc & self.l2_mask] = 0

    def _forget_loose(self) -> None:
        assert self.extents is not None
        span = self.l2_bits + self.cbits
        for l1i in self.loose:
            self.extents.invalidate(l1i << span, 1 << span)
            self.walked.discard(l1i)
        self.loose.clear()

    def _chain_in(self, t: L2Table, i: int, n: int) -> None:
        """Publish through the chain the unallocated, unpublished entries of
        [i, i + n) of ``t`` (cached, current, named by L1) that no change holds."""
        entries, pub, busy = t.entries, t.pub, self.busy
        base = t.l1i << self.l2_bits
        k, end = i, min(i + n, len(entries))
        while k < end:
            if entries[k] or pub[k] or base + k in busy:
                k += 1
                continue
            j = k + 1
            while j < end and not entries[j] and not pub[j] and base + j not in busy:
                j += 1
            self._publish_chain(base + k, base + j, t)
            k = j

    def _publish_chain(self, vc: int, stop: int, t: L2Table | None) -> None:
        """Publish clusters [vc, stop) (unallocated here, not busy; ``t`` their
        table or None for a span without one) as the chain places them. Where
        C may allocate in ``t`` (as ``run`` decides for a cluster with no
        backing data): data as COW, a write allocating and copying in C (on
        an extended-L2 image COW_SUB: it copies only the rest of the
        subclusters it touches), and zeros as ALLOC (a pool cluster reads as
        zeros too). Elsewhere data
        read-only, a write to it Python's copy-on-write, and zeros as ZERO.
        A compressed cluster of the chain is ZIP_COW where C may allocate
        (not on an extended-L2 image), elsewhere ZIP, a write to it Python's
        (``_publish_zip``)."""
        assert self.extents is not None and self.place is not None
        cbits, cs = self.cbits, self.cluster_size
        c_allocates = t is not None and self.allocating() and bool(self.l1[t.l1i] & COPIED)
        zeros, data = (ALLOC, COW if t is None or t.subs is None else COW_SUB) \
            if c_allocates else (ZERO, MAP)
        stop = min(stop, (self.size + cs - 1) >> cbits)
        pos, end = vc << cbits, stop << cbits
        while pos < end:
            got = self.place(pos, end - pos)
            if isinstance(got, Zipped):
                if not self._publish_zip(pos, got, t, data == COW):
                    return
                pos += cs
                continue
            length = (got[2] >> cbits << cbits) if got is not None else 0
            if got is None or not length or got[0] != ZERO_FD and got[1] & (cs - 1):
                pos += cs  # (Python's, until a read of it publishes it alone)
                continue
            fd, host, _ = got
            kind = zeros if fd == ZERO_FD else data
            try:
                ok = self.extents.insert_kind(kind, pos, length, fd, host if fd >= 0 else 0)
            except ExtentConflict:
                self._conflict(pos >> cbits)
                return
            if not ok:
                return  # the table is full
            first = pos >> cbits
            ram = self.in_ram.get(fd)
            if ram is not None:
                ram.update(range(first, first + (length >> cbits)))
            if t is not None:
                k, count = first & self.l2_mask, length >> cbits
                t.pub[k:k + count] = bytes((kind,)) * count
            else:
                l1i = first >> self.l2_bits
                self.loose[l1i] = self.loose.get(l1i, 0) + (length >> cbits)
            pos += length
