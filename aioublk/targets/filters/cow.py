"""The cow filter: copy on write, an overlay (a file or memory) over an
inner device that is never written but on request, as qemu-nbd -s."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
from dataclasses import replace
from typing import Any

from aioublk.dataplane import crossloop
from aioublk.target import QueueContext, Target
from aioublk.targets.filters.base import Filter, runs
from aioublk.targets.spec import BOOL, SIZE, STR, FilterSpec, Option


class CowFilter(Filter):
    """Copy on write, as ``qemu-nbd -s`` and nbdkit's cow filter: writes go to an
    overlay (in memory, or in ``file``, a sparse file made anew) in ``block``
    -byte blocks, reads take each block from the overlay if written, else
    from the inner device, which is never written but on request. The
    overlay lives as long as the server: a scratch layer, not a store.
    ``commit_now`` (``aioublk commit -n ID``, a signal to the server) writes
    what it holds that the inner device has not, and flushes it, while the
    device serves (qemu-img commit's effect); ``commit`` does so when the
    device stops too."""

    name = "cow"

    def __init__(self, inner: Target, file: str | None = None, block: int = 4096,
                 commit: bool = False) -> None:
        lbs = inner.geometry.logical_block_size
        if block & (block - 1) or block < lbs:
            raise ValueError(f"block {block} is not a power of two of at least the logical "
                             f"block size {lbs}: give e.g. 4096")
        self.block, self.file = block, os.path.abspath(file) if file else None
        self.mem: dict[int, bytes] = {}
        self.present = bytearray(-(-inner.geometry.size // block))
        self.fd = -1
        if self.file:
            try:
                self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                  0o600)
            except OSError as e:
                raise ValueError(f"cannot create {self.file}: {e.strerror}: fix the path") \
                    from None
        self.lock = threading.Lock()  # the overlay's blocks, shared by the queue threads
        #: blocks the inner device does not have yet: block -> the write's number
        #: (a block written again while a commit copies it is owed again)
        self.owed: dict[int, int] = {}
        self._writes = 0
        self.commit = commit
        #: the first queue loop's handle: commits run there, on its ring
        self._owner: crossloop.LoopHandle | None = None
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, discard=True, write_zeroes=True)

    async def queue_setup(self, q: QueueContext) -> None:
        if self._owner is None:
            self._owner = crossloop.current()
        await super().queue_setup(q)

    async def drain(self) -> None:
        """With ``commit``: what the inner device is owed, before it drains."""
        if self.commit:
            await self._commit()
        await super().drain()

    async def commit_now(self) -> int:
        """Write to the inner device every block of the overlay it does not
        have, then flush it; the device serves meanwhile (a block written
        again during the commit is owed again). Returns the blocks written.
        Runs on the first queue's loop, from any loop."""
        here, owner = crossloop.current(), self._owner
        if owner is None or here is owner:
            return await self._commit()
        temporary = here is None
        if here is None:  # (a loop without a handle: the server's control loop)
            here = crossloop.LoopHandle.new(asyncio.get_running_loop())
        try:
            return await crossloop.call_on(owner, here, self._commit)
        finally:
            if temporary:
                here.close()

    async def _commit(self) -> int:
        with self.lock:  # taken: a commit running beside this one finds none of them
            owed, self.owed = sorted(self.owed.items()), {}
        out = memoryview(mmap.mmap(-1, self.block))  # page aligned: O_DIRECT
        try:
            for b, _ in owed:
                with self.lock:
                    out[:] = self._get(b)
                await self.inner.write(b * self.block, out)
            if owed:
                await self.inner.flush()
        except BaseException:
            with self.lock:  # still owed (a block written since has its newer entry)
                for b, n in owed:
                    self.owed.setdefault(b, n)
            raise
        return len(owed)

    def _get(self, b: int) -> bytes:
        if self.fd >= 0:
            return os.pread(self.fd, self.block, b * self.block)
        return self.mem[b]

    def _put(self, b: int, data: bytes) -> None:
        if self.fd >= 0:
            os.pwrite(self.fd, data, b * self.block)
        else:
            self.mem[b] = data
        self.present[b] = 1
        self._writes += 1
        self.owed[b] = self._writes

    async def read(self, offset: int, buf: memoryview) -> None:
        first, last = offset // self.block, (offset + len(buf) - 1) // self.block
        with self.lock:
            absent = [b for b in range(first, last + 1) if not self.present[b]]
        for lo, hi in runs(absent):  # straight from the inner device, in runs
            start = max(offset, lo * self.block)
            end = min(offset + len(buf), (hi + 1) * self.block)
            await self.inner.read(start, buf[start - offset:end - offset])
        with self.lock:  # the overlay wins, including blocks written meanwhile
            for b in range(first, last + 1):
                if self.present[b]:
                    start = max(offset, b * self.block)
                    end = min(offset + len(buf), (b + 1) * self.block)
                    base = b * self.block
                    buf[start - offset:end - offset] = self._get(b)[start - base:end - base]

    async def _store(self, offset: int, data: memoryview | bytes, length: int) -> None:
        """``data`` (or zeros, when empty) over ``[offset, offset + length)``; a
        block written in part is first filled from the inner device."""
        first, last = offset // self.block, (offset + length - 1) // self.block
        edges: dict[int, bytes] = {}
        for b in {first, last}:
            whole = offset <= b * self.block and (b + 1) * self.block <= offset + length
            if not whole and not self.present[b]:
                piece = memoryview(bytearray(self.block))
                await self.inner.read(b * self.block, piece)
                edges[b] = bytes(piece)
        with self.lock:
            for b in range(first, last + 1):
                base = b * self.block
                start, end = max(offset, base), min(offset + length, base + self.block)
                if start == base and end == base + self.block:
                    block = bytes(data[start - offset:end - offset]) if data else \
                        bytes(self.block)
                else:
                    old = bytearray(self._get(b) if self.present[b] else edges[b])
                    old[start - base:end - base] = data[start - offset:end - offset] if data \
                        else bytes(end - start)
                    block = bytes(old)
                self._put(b, block)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._store(offset, buf, len(buf))

    async def discard(self, offset: int, length: int) -> None:
        await self._store(offset, b"", length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._store(offset, b"", length)

    async def flush(self) -> None:
        """Nothing to make durable: the overlay is scratch."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()

    def settings(self) -> dict[str, object]:
        return {"file": self.file or "memory", "block": self.block, "commit": self.commit}


SPEC = FilterSpec(
    "cow", CowFilter,
    "copy on write: the device under it is never written (as qemu-nbd -s); "
    "Python serves every request", (
        Option("file", STR, "the overlay file, made anew (default: in memory)"),
        Option("block", SIZE, "the overlay's block size, a power of two",
               default=4096, lo=512, power_of_two=True),
        Option("commit", BOOL, "write the overlay to the device when it stops",
               default=False)), rank=9)
