"""The write-back: run ``aioublk.qcow2.writeback``'s plan for a cut of every
dirty table, mark clean what a successful sync made durable, then apply the
frees that waited for it (``Frees``: a cluster's count drops only once the
change that dropped its last user is durable and no I/O begun before that
change is in flight).

``WriteBack`` knows the file, the tables it writes (the L1 table and its
dirty entries, the L2 cache, the refcounts) and the map of metadata
clusters the plan is checked against; of the rest of the image only what
it must ask: the corrupt bit for the header it writes, and whom to tell
when a planned write would overwrite something else."""

from __future__ import annotations

import asyncio
import errno
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import NoReturn

from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import format as fmt
from aioublk.qcow2 import writeback as wbplan
from aioublk.qcow2.base import L2Table, _eio, log
from aioublk.qcow2.pools import Pools
from aioublk.qcow2.refcounts import Refcounts


class Frees:
    """Frees waiting to be applied, and the data I/O in flight per write-back
    generation (a free waits for the I/O begun before the change that made it)."""

    def __init__(self) -> None:
        self.gen = 0
        self.io: dict[int, int] = {}  # generation -> data I/O in flight
        self.pending: list[tuple[int, int]] = []  # (generation, host cluster)
        self.punch: set[int] = set()  # host clusters a discard freed: punched once free

    def io_begin(self) -> int:
        g = self.gen
        self.io[g] = self.io.get(g, 0) + 1
        return g

    def io_end(self, g: int) -> None:
        n = self.io[g] - 1
        if n:
            self.io[g] = n
        else:
            del self.io[g]

    def defer(self, c: int) -> None:
        """Free host cluster ``c`` once the change that dropped it is durable."""
        self.pending.append((self.gen, c))

    def cut(self) -> int:
        """A new generation begins; the frees of the one returned go with its cut."""
        g = self.gen
        self.gen += 1
        return g

    def ready(self, cut: int) -> list[int]:
        """Take the frees whose last user's change is durable (``cut``) and
        that no I/O begun before it may still use."""
        oldest_io = min(self.io) if self.io else self.gen
        ready = [c for g, c in self.pending if g <= cut and g < oldest_io]
        if ready:
            self.pending = [(g, c) for g, c in self.pending
                            if not (g <= cut and g < oldest_io)]
        return ready


class WriteBack:
    """Flush and write-back: the cut, the plan run, the frees."""

    def __init__(self, file: HostFile, path: str, h: fmt.Header, head: bytearray,
                 l1: array[int], l1_dirty: set[int], l2cache: OrderedDict[int, L2Table],
                 meta: dict[int, int], refs: Refcounts, pools: Pools, frees: Frees,
                 corrupt_bit: Callable[[bytes | bytearray], bytes],
                 mark_corrupt: Callable[[str], NoReturn]) -> None:
        self.file = file
        self.path = path
        self.cbits = h.cluster_bits
        self.cluster_size = h.cluster_size
        self.l1_offset = h.l1_table_offset
        self.head = head  # sector 0 as durable, updated in place
        self.l1 = l1
        self.l1_dirty = l1_dirty
        self.l2cache = l2cache
        self.meta = meta
        self.refs = refs
        self.pools = pools
        self.frees = frees
        self.corrupt_bit = corrupt_bit
        self.mark_corrupt = mark_corrupt
        self.seq = 0  # metadata changes made in memory (counted, see ``changed``)
        self.written = 0  # ... of which the image file holds the first this many
        self.sync_error: OSError | None = None  # the first sync that failed
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """The lock one write-back of cached metadata runs under at a time."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def changed(self, n: int = 1) -> None:
        """``n`` metadata changes made in memory."""
        self.seq += n

    def dirty(self) -> bool:
        return bool(self.l1_dirty or self.refs.dirty() or any(
            t.dirty for t in self.l2cache.values()))

    async def run(self) -> None:
        """Write every dirty table in dependency order (see
        ``aioublk.qcow2.writeback``), then apply frees whose dropping is durable."""
        async with self.lock:
            await self.run_locked()

    async def write_through(self) -> None:
        """Return once every metadata change made so far is in the image file.
        Requests waiting together share one write-back: whoever gets the lock
        first writes a cut that holds all their changes."""
        want = self.seq
        while self.written < want:
            async with self.lock:
                if self.written < want:
                    await self.run_locked()

    def sync_failed(self, e: OSError) -> None:
        """A sync of the image failed: Linux reports a lost page-cache write-back
        once, so the first failure sticks (every later one fails, see ``sync``)."""
        if self.sync_error is None:
            self.sync_error = e
            log.error("qcow2 image sync failed: every later flush fails", image=self.path,
                      error=str(e))

    async def sync(self) -> None:
        """fdatasync the image file. Linux reports a lost page-cache write-back
        once, to one fsync: after that, later syncs succeed although the data
        is gone. So the first failure sticks (as QEMU's file-posix does): every
        later sync of this image fails, and dirty state is only ever cleared
        after a sync that succeeded."""
        if self.sync_error is not None:
            raise _eio(f"{self.path}: an earlier sync of the image failed "
                       f"({self.sync_error.strerror}): writes may be lost, check the image")
        try:
            await self.file.sync()
        except OSError as e:
            self.sync_failed(e)
            raise _eio(f"{self.path}: sync failed ({e.strerror}): writes may be lost, "
                       "check the image") from None

    async def run_locked(self) -> None:
        """A write-back, ``lock`` held."""
        # every C write that completed before the FLUSH was sent recorded its
        # allocation before it was answered: in the cut with everything else
        self.pools.drain()
        seq = self.seq
        if not self.dirty() and not self.frees.pending:
            await self.sync()
            self.written = max(self.written, seq)
            return
        if self.sync_error is not None:
            await self.sync()  # fails: nothing is written after a lost write-back
        # the cut: a consistent picture of every dirty table, taken without
        # awaiting; nothing is marked clean before the sync after its write
        refs_ = self.refs
        cut = self.frees.cut()
        l2s = [(t, t.gen) for t in self.l2cache.values() if t.dirty]
        l1 = {i: self.l1[i] for i in self.l1_dirty}
        refs = refs_.cut()
        rt_gen = refs_.table_gen
        rt_fields = fmt.pack_reftable_fields(refs_.table_offset, refs_.table_clusters)
        header = None  # self.head stays the durable header until this one is on disk
        if refs_.table_moved:
            header = bytearray(self.head)
            header[fmt.OFF_REFTABLE:fmt.OFF_REFTABLE + 12] = rt_fields
        steps = self._plan(wbplan.Cut(
            refblocks=[(refs_.block_offset(t), raw) for t, _b, _g, raw in refs],
            reftable=(refs_.table_offset, fmt.dump_table(refs_.table))
            if refs_.table_dirty else None,
            header=bytes(header) if header is not None else None,
            l2=[(t.offset, t.dump()) for t, _g in l2s],
            l1=self._l1_sectors(l1)))
        await self._run(steps)
        # all durable: clean what the cut held, unless it changed since
        if header is not None:
            self.head[fmt.OFF_REFTABLE:fmt.OFF_REFTABLE + 12] = rt_fields
        refs_.clean(refs)
        if rt_gen == refs_.table_gen:
            refs_.table_dirty = refs_.table_moved = False
        for t, g in l2s:
            if t.gen == g:
                t.dirty = False
        for i, v in l1.items():
            if self.l1[i] == v:
                self.l1_dirty.discard(i)
        self.written = max(self.written, seq)
        await self._apply_frees(cut)

    def _plan(self, cut: wbplan.Cut) -> list[wbplan.Step]:
        try:
            return wbplan.plan(cut, self.meta, self.cbits)
        except wbplan.Overlap as e:
            self.mark_corrupt(str(e))

    async def _run(self, steps: list[wbplan.Step]) -> None:
        for s in steps:
            if type(s) is wbplan.Write:  # a mark made since the cut stays in the header
                data = self.corrupt_bit(s.data) if s.kind == wbplan.HEADER else s.data
                await self.file.write(data, s.offset)
            else:
                await self.sync()

    def _l1_sectors(self, l1: dict[int, int]) -> list[tuple[int, bytes]]:
        """The 512-byte sectors of the L1 table holding the changed entries."""
        if not l1:
            return []
        raw = fmt.dump_table(self.l1)
        base = self.l1_offset
        return [(base + s * 512, raw[s * 512:(s + 1) * 512].ljust(512, b"\0"))
                for s in sorted({i // 64 for i in l1})]

    async def _punch_cluster(self, c: int) -> None:
        """Deallocate a free cluster in the file (before anyone may take it:
        under the allocation lock). A file system that cannot is left as is."""
        try:
            await self.file.punch(c << self.cbits, self.cluster_size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

    async def _apply_frees(self, cut: int) -> None:
        """Drop the references whose last user's change is durable (``cut``) and
        that no I/O begun before it may still use."""
        ready = self.frees.ready(cut)
        if not ready:
            return
        refs_, punch = self.refs, self.frees.punch
        async with refs_.lock:
            for c in ready:
                if await refs_.add_ref(c, -1) == 0:
                    self.meta.pop(c, None)
                    refs_.free_hint = min(refs_.free_hint, c)
                    self.l2cache.pop(c << self.cbits, None)
                    if c in punch:  # a discard's, shared by no snapshot: give
                        await self._punch_cluster(c)  # the host its space, as QEMU does
                punch.discard(c)
        refs = refs_.cut()
        await self._run(self._plan(wbplan.Cut(
            refblocks=[(refs_.block_offset(t), raw) for t, _b, _g, raw in refs])))
        refs_.clean(refs)
