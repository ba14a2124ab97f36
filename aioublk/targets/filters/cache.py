"""The cache filter: a cache in RAM, write-through or write-back, FLUSH
and FUA honoured."""

from __future__ import annotations

import asyncio
import mmap
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from aioublk.dataplane import crossloop
from aioublk.kernel import uapi
from aioublk.target import Target
from aioublk.targets.filters.base import Filter, runs
from aioublk.targets.spec import CHOICE, SIZE, FilterSpec, Option


class CacheFilter(Filter):
    """A cache in RAM of ``size`` bytes in ``block``-byte blocks, least recently
    used out first, as nbdkit's cache filter.

    ``mode="writethrough"`` (the default): a write goes to the inner layer,
    and the blocks it touches leave the cache, so what the cache holds is
    always what the inner layer holds. ``mode="writeback"``: a write lands in
    the cache (dirty) and the device advertises a volatile cache with FUA: a
    FLUSH writes the dirty blocks back and flushes the inner layer, a FUA
    write is written back and flushed before it completes. A device with
    user recovery (``-r 1``) must lose no acknowledged write to a new server,
    so there the cache writes through whatever the mode.

    The queues' threads share the cache, and their requests interleave at
    every await: a block's bytes from the inner layer (a *fill*) are kept
    only if nothing changed the block while they were read; a block is
    written back by one request at a time, so an older copy never lands
    after a newer one."""

    name = "cache"

    def __init__(self, inner: Target, size: int = 64 << 20, block: int = 65536,
                 mode: str = "writethrough") -> None:
        lbs = inner.geometry.logical_block_size
        if block & (block - 1) or not lbs <= block <= size:
            raise ValueError(f"block {block} is not a power of two between the logical block "
                             f"size {lbs} and size {size}: give e.g. 64K")
        if mode not in ("writethrough", "writeback"):
            raise ValueError(f"mode {mode!r}: use writethrough or writeback")
        self.block, self.slots, self.mode = block, max(1, size // block), mode
        self.blocks: OrderedDict[int, bytearray] = OrderedDict()
        self.dirty: dict[int, int] = {}  # block -> its version (write-back)
        self.version = 0
        self.fills: dict[int, set[int]] = {}  # per inner read in flight: its still valid blocks
        self.writing: dict[int, list[Callable[[], None]]] = {}  # written back now -> waiters
        self.lock = threading.Lock()
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        if self.mode == "writeback":
            return replace(geometry, volatile_cache=True, fua=True)
        return geometry

    def configure(self, device_flags: int) -> None:
        if self.mode == "writeback" and device_flags & uapi.Feature.USER_RECOVERY:
            self.mode = "writethrough"  # (nothing dirty yet: no request came)
        super().configure(device_flags)

    def _span(self, offset: int, length: int) -> range:
        return range(offset // self.block, (offset + length - 1) // self.block + 1)

    def _partial(self, offset: int, length: int) -> list[int]:
        """The blocks ``[offset, offset + length)`` covers only in part."""
        span = self._span(offset, length)
        return [b for b in dict.fromkeys((span[0], span[-1]))
                if offset > b * self.block or (b + 1) * self.block > offset + length]

    async def _fetch(self, first: int, last: int) -> memoryview:
        """Blocks ``first..last`` from the inner layer, in page-aligned memory."""
        buf = memoryview(mmap.mmap(-1, (last - first + 1) * self.block))
        await self.inner.read(first * self.block, buf)
        return buf

    def _fill(self, blocks: Iterable[int]) -> tuple[int, set[int]]:
        """(Under the lock.) Watch ``blocks`` while an inner read fetches them."""
        self.version += 1
        fill = self.fills[self.version] = set(blocks)
        return self.version, fill

    def _insert(self, b: int, data: bytearray | memoryview, dirty: bool = False) -> None:
        """(Under the lock.) Block ``b`` is ``data`` (a bytearray is kept, not
        copied); clean blocks past the capacity leave, least recently used first."""
        self.blocks[b] = data if isinstance(data, bytearray) else bytearray(data)
        self.blocks.move_to_end(b)
        for fill in self.fills.values():
            fill.discard(b)
        if dirty:
            self.version += 1
            self.dirty[b] = self.version
        while len(self.blocks) > self.slots:
            old = next((k for k in self.blocks if k not in self.dirty), None)
            if old is None:
                break  # all dirty: write-back trims them (_trim)
            del self.blocks[old]

    def _forget(self, span: range) -> None:
        """(Under the lock.) The blocks of ``span`` change under the cache."""
        blocks = span if len(span) <= len(self.blocks) else [b for b in self.blocks if b in span]
        for b in blocks:
            self.blocks.pop(b, None)
            self.dirty.pop(b, None)
        for fill in self.fills.values():
            fill.difference_update([b for b in fill if b in span])

    def _copy_cached(self, offset: int, buf: memoryview) -> list[int]:
        """(Under the lock.) The cached blocks' bytes into ``buf``; the blocks
        that are not cached."""
        missing = []
        for b in self._span(offset, len(buf)):
            data = self.blocks.get(b)
            if data is None:
                missing.append(b)
                continue
            self.blocks.move_to_end(b)
            base = b * self.block
            start, end = max(offset, base), min(offset + len(buf), base + self.block)
            buf[start - offset:end - offset] = data[start - base:end - base]
        return missing

    async def read(self, offset: int, buf: memoryview) -> None:
        with self.lock:
            missing = self._copy_cached(offset, buf)
            if missing:
                token, fill = self._fill(missing)
        if not missing:
            return
        try:
            for first, last in runs(missing):
                data = await self._fetch(first, last)
                with self.lock:
                    for b in range(first, last + 1):
                        piece = data[(b - first) * self.block:(b - first + 1) * self.block]
                        base = b * self.block
                        start = max(offset, base)
                        end = min(offset + len(buf), base + self.block)
                        if b in self.blocks:  # written meanwhile (write-back): it wins
                            piece = memoryview(self.blocks[b])
                        elif b in fill:
                            self._insert(b, piece)
                        buf[start - offset:end - offset] = piece[start - base:end - base]
        finally:
            with self.lock:
                del self.fills[token]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if self.mode == "writethrough":
            await self._around(offset, len(buf), super().write(offset, buf, fua))
            return
        await self._store(offset, buf)
        if fua:  # this write's blocks, and any a trim wrote back first, durable now
            await self._write_back(self._span(offset, len(buf)))
            await super().flush()
        await self._trim()

    async def _store(self, offset: int, buf: memoryview) -> None:
        """(Write-back.) ``buf`` into the cache, dirty. A block
        written in part is first fetched, unless cached; the write lands only
        when every such block's bytes are current, so a fetch a write (or an
        eviction) overtook is done again."""
        length = len(buf)
        partial = self._partial(offset, length)
        while True:
            with self.lock:
                need = [b for b in partial if b not in self.blocks]
                if not need:
                    self._apply(offset, buf, length, {})
                    return
                token, fill = self._fill(need)
            try:
                got = {b: await self._fetch(b, b) for b in need}
                with self.lock:
                    if all(b in self.blocks or b in fill for b in partial):
                        self._apply(offset, buf, length, got)
                        return
            finally:
                with self.lock:
                    del self.fills[token]

    def _apply(self, offset: int, buf: memoryview, length: int,
               fetched: dict[int, memoryview]) -> None:
        """(Under the lock.) Lay the write over the cached or ``fetched`` blocks,
        all taken before any goes in (an insert may evict a clean one)."""
        span = self._span(offset, length)
        olds = [self.blocks.get(b) for b in span]
        for b, old in zip(span, olds, strict=True):
            base = b * self.block
            start, end = max(offset, base), min(offset + length, base + self.block)
            block = old if old is not None else bytearray(fetched.get(b, bytes(self.block)))
            block[start - base:end - base] = buf[start - offset:end - offset]
            self._insert(b, block, dirty=True)

    async def _trim(self) -> None:
        """Write back the oldest dirty blocks while there are more than fit."""
        while True:
            with self.lock:
                over = len(self.blocks) - self.slots
                victims = [b for b in self.blocks if b in self.dirty][:max(over, 0)]
            if not victims:
                return
            await self._write_back(victims)
            with self.lock:
                for b in victims:
                    if b not in self.dirty:
                        self.blocks.pop(b, None)

    async def _write_back(self, blocks: Iterable[int]) -> None:
        """Write these blocks, if dirty, to the inner layer; each stays dirty if
        it was written again meanwhile."""
        with self.lock:
            todo = [b for b in blocks if b in self.dirty]
        await asyncio.gather(*(self._write_back_one(b) for b in todo))

    async def _write_back_one(self, b: int) -> None:
        """Block ``b``'s cached bytes to the inner layer, after any write-back of
        it in flight (whose older bytes must not land after these)."""
        while True:
            with self.lock:
                version = self.dirty.get(b)
                if version is None:
                    return  # (another write-back took it)
                waiters = self.writing.get(b)
                if waiters is None:
                    self.writing[b] = []
                    out = memoryview(mmap.mmap(-1, self.block))  # page aligned: O_DIRECT
                    out[:] = self.blocks[b]
                    break
                ready, wake = crossloop.waiter()
                waiters.append(wake)
            await ready
        try:
            await self.inner.write(b * self.block, out)
            with self.lock:
                if self.dirty.get(b) == version:
                    del self.dirty[b]
        finally:
            with self.lock:
                for wake in self.writing.pop(b):
                    wake()

    async def flush(self) -> None:
        with self.lock:
            dirty = list(self.dirty)
        await self._write_back(dirty)
        await super().flush()

    async def _around(self, offset: int, length: int, change: Awaitable[None]) -> None:
        """Run ``change`` of ``[offset, offset + length)`` on the inner layer, its
        blocks out of the cache before and after, so no fill that read the old
        bytes stays. (Write-back: only whole blocks, none being written back.)"""
        span = self._span(offset, length)
        with self.lock:
            self._forget(span)
            busy = [b for b in self.writing if b in span]
        for b in busy:  # an older write-back must not land on top of the change
            await self._settled(b)
        try:
            await change
        finally:
            with self.lock:
                self._forget(span)

    async def _settled(self, b: int) -> None:
        """Until no write-back of block ``b`` is in flight."""
        with self.lock:
            waiters = self.writing.get(b)
            if waiters is None:
                return
            ready, wake = crossloop.waiter()
            waiters.append(wake)
        await ready

    async def _zero(self, offset: int, length: int,
                    change: Callable[[int, int], Awaitable[None]]) -> None:
        """A discard or write-zeroes: through, or (write-back) zeros in the
        cache for the blocks it covers in part and ``change`` of the whole
        ones between."""
        if self.mode == "writethrough":
            await self._around(offset, length, change(offset, length))
            return
        first = -(-offset // self.block) * self.block
        end = (offset + length) // self.block * self.block
        if first >= end:  # within a block, or two
            first = end = offset + length
        for lo, hi in ((offset, min(first, offset + length)), (max(end, first), offset + length)):
            if lo < hi:
                await self._store(lo, memoryview(bytes(hi - lo)))
        if first < end:
            await self._around(first, end - first, change(first, end - first))
        await self._trim()

    async def discard(self, offset: int, length: int) -> None:
        await self._zero(offset, length, self.inner.discard)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._zero(offset, length, lambda o, n: self.inner.write_zeroes(o, n, unmap))

    async def drain(self) -> None:
        await self.flush()
        await super().drain()

    def settings(self) -> dict[str, object]:
        return {"size": self.slots * self.block, "block": self.block, "mode": self.mode}


SPEC = FilterSpec(
    "cache", CacheFilter,
    "a cache in RAM, write-through or write-back (FLUSH and FUA honoured; "
    "write-through under -r 1); Python serves every request", (
        Option("size", SIZE, "the cache's bytes", default=64 << 20, lo=4096),
        Option("block", SIZE, "its block size, a power of two", default=65536,
               lo=512, power_of_two=True),
        Option("mode", CHOICE, "writethrough or writeback",
               default="writethrough", choices=("writethrough", "writeback"))), rank=8)
