"""The write-back: run ``aioublk.qcow2.writeback``'s plan for a cut of every
dirty table, mark clean what a successful sync made durable, then apply the
frees that waited for it."""

from __future__ import annotations

import errno

from aioublk.qcow2 import format as fmt
from aioublk.qcow2 import writeback as wbplan
from aioublk.qcow2.base import ImageBase, _eio


class WriteBack(ImageBase):
    """Flush and write-back: the cut, the plan run, the frees."""

    async def flush(self) -> None:
        """Everything written so far, data and metadata, durable."""
        if self.read_only:
            return
        await self.writeback()

    def _dirty(self) -> bool:
        return bool(self.l1_dirty or self.refs.dirty() or any(
            t.dirty for t in self.l2cache.values()))

    async def writeback(self) -> None:
        """Write every dirty table in dependency order (see the module
        docstring), then apply frees whose dropping is durable."""
        async with self.wb_lock:
            await self._writeback_locked()

    async def _sync(self) -> None:
        """fdatasync the image file. Linux reports a lost page-cache write-back
        once, to one fsync: after that, later syncs succeed although the data
        is gone. So the first failure sticks (as QEMU's file-posix does): every
        later sync of this image fails, and dirty state is only ever cleared
        after a sync that succeeded."""
        if self._sync_error is not None:
            raise _eio(f"{self.path}: an earlier sync of the image failed "
                       f"({self._sync_error.strerror}): writes may be lost, check the image")
        try:
            await self.file.sync()
        except OSError as e:
            self._sync_failed(e)
            raise _eio(f"{self.path}: sync failed ({e.strerror}): writes may be lost, "
                       "check the image") from None

    async def _writeback_locked(self) -> None:
        # every C write that completed before the FLUSH was sent recorded its
        # allocation before it was answered: in the cut with everything else
        self.pools.drain()
        seq = self._meta_seq
        if not self._dirty() and not self._frees:
            await self._sync()
            self._meta_written = max(self._meta_written, seq)
            return
        if self._sync_error is not None:
            await self._sync()  # fails: nothing is written after a lost write-back
        # the cut: a consistent picture of every dirty table, taken without
        # awaiting; nothing is marked clean before the sync after its write
        cut = self.gen
        self.gen += 1
        l2s = [(t, t.gen) for t in self.l2cache.values() if t.dirty]
        l1 = {i: self.l1[i] for i in self.l1_dirty}
        refs = self.refs.cut()
        rt_gen = self.refs.table_gen
        rt_fields = fmt.pack_reftable_fields(self.refs.table_offset, self.refs.table_clusters)
        header = None  # self.head stays the durable header until this one is on disk
        if self.refs.table_moved:
            header = bytearray(self.head)
            header[fmt.OFF_REFTABLE:fmt.OFF_REFTABLE + 12] = rt_fields
        steps = self._plan(wbplan.Cut(
            refblocks=[(self.refs.block_offset(t), raw) for t, _b, _g, raw in refs],
            reftable=(self.refs.table_offset, fmt.dump_table(self.refs.table))
            if self.refs.table_dirty else None,
            header=bytes(header) if header is not None else None,
            l2=[(t.offset, t.dump()) for t, _g in l2s],
            l1=self._l1_sectors(l1)))
        await self._run(steps)
        # all durable: clean what the cut held, unless it changed since
        if header is not None:
            self.head[fmt.OFF_REFTABLE:fmt.OFF_REFTABLE + 12] = rt_fields
        self.refs.clean(refs)
        if rt_gen == self.refs.table_gen:
            self.refs.table_dirty = self.refs.table_moved = False
        for t, g in l2s:
            if t.gen == g:
                t.dirty = False
        for i, v in l1.items():
            if self.l1[i] == v:
                self.l1_dirty.discard(i)
        self._meta_written = max(self._meta_written, seq)
        await self._apply_frees(cut)

    def _plan(self, cut: wbplan.Cut) -> list[wbplan.Step]:
        try:
            return wbplan.plan(cut, self.meta, self.cbits)
        except wbplan.Overlap as e:
            self._mark_corrupt(str(e))

    async def _run(self, steps: list[wbplan.Step]) -> None:
        for s in steps:
            if type(s) is wbplan.Write:  # a mark made since the cut stays in the header
                data = self._corrupt_bit(s.data) if s.kind == wbplan.HEADER else s.data
                await self.file.write(data, s.offset)
            else:
                await self._sync()

    def _l1_sectors(self, l1: dict[int, int]) -> list[tuple[int, bytes]]:
        """The 512-byte sectors of the L1 table holding the changed entries."""
        if not l1:
            return []
        raw = fmt.dump_table(self.l1)
        base = self.h.l1_table_offset
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
        oldest_io = min(self._io) if self._io else self.gen
        ready = [c for g, c in self._frees if g <= cut and g < oldest_io]
        if not ready:
            return
        self._frees = [(g, c) for g, c in self._frees if not (g <= cut and g < oldest_io)]
        async with self.refs.lock:
            for c in ready:
                if await self.refs.add_ref(c, -1) == 0:
                    self.meta.pop(c, None)
                    self.refs.free_hint = min(self.refs.free_hint, c)
                    self.l2cache.pop(c << self.cbits, None)
                    if c in self._punch:  # a discard's, shared by no snapshot: give
                        await self._punch_cluster(c)  # the host its space, as QEMU does
                self._punch.discard(c)
        refs = self.refs.cut()
        await self._run(self._plan(wbplan.Cut(
            refblocks=[(self.refs.block_offset(t), raw) for t, _b, _g, raw in refs])))
        self.refs.clean(refs)

    async def close(self) -> None:
        """Flush (if writable) and close the image and its backing chain."""
        try:
            if not self.read_only and self.file.fd >= 0 and not self.corrupt:
                await self.pools.take_back()
                await self.writeback()
                if self._frees:
                    await self.writeback()
                if self.lazy:  # every refcount is on disk: clean again
                    self._set_dirty(False)
        finally:
            self.release()

    def release(self) -> None:
        """Close the files of the image and its backing chain, without writing."""
        self._drop_extents()
        self.file.close()
        if self.backing is not None:
            self.backing.release()

