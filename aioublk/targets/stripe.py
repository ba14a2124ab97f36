"""The stripe target: RAID-0 over 2 to 4 equally sized backing files, as
kublk's: chunk ``c`` of the device lives in file ``c % n`` at chunk
``c // n``. A request touching several chunks becomes one readv/writev per
file (a file's pieces of one request are contiguous in that file), all in
flight at once."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable
from functools import partial
from typing import Any

from aioublk.dataplane.maps import Map, Striped
from aioublk.io.hostfile import Backing, BackingError, file_bytes, fit_geometry
from aioublk.ring import current_ring
from aioublk.target import Buffer, Done, FixedBuf, Geometry, Target, gather_all, rw_handler
from aioublk.targets.spec import PATHS, SIZE, Option, TargetSpec

MAX_FILES = 4


def split(offset: int, length: int, chunk: int, nr_files: int
          ) -> dict[int, tuple[int, list[tuple[int, int]]]]:
    """Map a device range to ``{file: (file_offset, [(buf_start, buf_len)...])}``."""
    out: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    pos = 0
    while pos < length:
        dev_off = offset + pos
        idx, within = divmod(dev_off, chunk)
        n = min(chunk - within, length - pos)
        f = idx % nr_files
        file_off = (idx // nr_files) * chunk + within
        if f in out:
            out[f][1].append((pos, n))
        else:
            out[f] = (file_off, [(pos, n)])
        pos += n
    return out


class StripeTarget(Target):
    """RAID-0 over 2 to 4 equally sized files (``-t stripe``), ``chunk_size``
    bytes per chunk, as kublk's stripe target lays them out."""

    name = "stripe"
    fixed_buffers = True
    c_idle = True  # every request and its I/O come through the ring

    def __init__(self, paths: list[str], chunk_size: int = 65536, *,
                 read_only: bool = False) -> None:
        if not 2 <= len(paths) <= MAX_FILES:
            raise BackingError(f"stripe needs 2 to {MAX_FILES} backing files, got {len(paths)}")
        if chunk_size & (chunk_size - 1) or not 4096 <= chunk_size <= 512 << 10:
            raise BackingError(f"invalid chunk size {chunk_size}: use a power of two "
                               "from 4096 to 524288")
        self.chunk = chunk_size
        self.files: list[Backing] = []
        try:
            for p in paths:
                self.files.append(Backing(p, read_only=read_only))
            sizes = [b.size & ~(chunk_size - 1) for b in self.files]
            for b, s in zip(self.files, sizes, strict=True):
                if s == 0:
                    raise BackingError(f"backing file {b.path} ({b.size} bytes) is smaller "
                                       f"than one chunk ({chunk_size} bytes)")
            if len(set(sizes)) != 1:
                raise BackingError("stripe backing files must have the same size "
                                   f"(rounded down to the chunk size: {sizes})")
        except BaseException:
            self.close()
            raise
        self.geometry = fit_geometry(Geometry(size=sizes[0] * len(self.files),
                                              volatile_cache=True, read_only=read_only),
                                     self.files)

    def map(self) -> Map:
        return Striped([b.fd for b in self.files], self.chunk)

    async def _rw(self, offset: int, buf: Buffer, write: bool) -> None:
        try:
            await self._rw_once(offset, buf, write)
        except OSError as e:  # O_DIRECT refusing it? Then buffered, and once more
            what = f"a {'write' if write else 'read'} of {len(buf)} bytes at {offset}"
            if e.errno != errno.EINVAL or not [b for b in self.files if b.refused(what)]:
                raise
            await self._rw_once(offset, buf, write)

    async def _rw_once(self, offset: int, buf: Buffer, write: bool) -> None:
        ring = current_ring()
        parts = split(offset, len(buf), self.chunk, len(self.files))
        ops: list[Awaitable[int]] = []
        for f, (file_off, pieces) in parts.items():
            fd = self.files[f].fd
            if isinstance(buf, FixedBuf):
                ops.append(self._fixed(fd, buf, file_off, pieces, write))
                continue
            bufs = [buf[s:s + n] for s, n in pieces]
            ops.append(ring.writev(fd, bufs, file_off) if write
                       else ring.readv(fd, bufs, file_off))
        results = await gather_all(ops)  # every leg done before the buffer is let go
        for (f, (_off, pieces)), n in zip(parts.items(), results, strict=True):
            want = sum(p[1] for p in pieces)
            if n != want:
                raise OSError(5, f"short {'write' if write else 'read'} on "
                              f"{self.files[f].path}: {n} of {want}")

    @staticmethod
    async def _fixed(fd: int, buf: FixedBuf, file_off: int, pieces: list[tuple[int, int]],
                     write: bool) -> int:
        """A file's pieces of a registered buffer: one fixed read/write each
        (no vectored form for fixed buffers on older kernels), in flight together."""
        ring = current_ring()
        op = ring.write_fixed if write else ring.read_fixed
        ops = []
        pos = file_off
        for s, n in pieces:
            ops.append(op(fd, buf.offset + s, n, pos, buf.index))
            pos += n
        return sum(await gather_all(ops))  # short only if some piece was short

    def _one_file(self, offset: int, n: int) -> tuple[Backing, int] | None:
        """(file, offset in it) when [offset, offset+n) lies in one chunk."""
        idx, within = divmod(offset, self.chunk)
        if within + n > self.chunk:
            return None
        nr = len(self.files)
        return self.files[idx % nr], (idx // nr) * self.chunk + within

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        where = self._one_file(offset, len(buf))
        if where is None:
            return False
        f, file_off = where
        current_ring().start_read(f.fd, buf, file_off,
                                  rw_handler(len(buf), done, lambda: self.read(offset, buf),
                                             partial(f.refused, "a read")))
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        where = self._one_file(offset, len(buf))
        if where is None:
            return False
        f, file_off = where
        current_ring().start_write(f.fd, buf, file_off,
                                   rw_handler(len(buf), done, lambda: self.write(offset, buf),
                                              partial(f.refused, "a write")))
        return True

    async def read(self, offset: int, buf: Buffer) -> None:
        await self._rw(offset, buf, False)

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        await self._rw(offset, buf, True)
        if fua:
            await self.flush()

    async def flush(self) -> None:
        # every file's sync ends before the first failure is raised: the
        # ring may close right after a drain
        done = await asyncio.gather(*(b.sync() for b in self.files), return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException):
                raise r

    async def drain(self) -> None:
        await self.flush()  # a failure reaches the exit status

    def close(self) -> None:
        for b in self.files:
            b.close()

    def describe(self) -> dict[str, object]:
        return {"target": self.name, "size": self.geometry.size,
                "files": [b.path for b in self.files], "chunk_size": self.chunk}

    @classmethod
    def capacity(cls, files: list[str], options: dict[str, Any]) -> int | None:
        chunk = options.get("chunk_size") or 65536
        return min(file_bytes(f) & ~(chunk - 1) for f in files) * len(files) if files else None


#: ``-t stripe``: its options, as the command line and config files take them
SPEC = TargetSpec("stripe", StripeTarget, (
    Option("files", PATHS, "the backing files, striped in this order", arg="*", lo=2, hi=4,
           distinct=True, required=True, what="backing file"),
    Option("chunk_size", SIZE, "bytes per chunk, a power of two", default=65536,
           default_help="64K", flags=("--chunk_size",), lo=4096, hi=512 << 10,
           power_of_two=True),
), files="files", read_only=True, rank=3)
