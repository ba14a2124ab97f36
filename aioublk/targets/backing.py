"""Backing files for the loop and stripe targets.

Opened with O_DIRECT where the file system allows it (so the page cache is not
filled twice); file systems that refuse O_DIRECT get buffered I/O. What direct
I/O needs is read at open (``aioublk.io.directio``): the device advertises it as
its logical block size, and a request O_DIRECT refuses all the same makes the
file buffered and is retried once that way. Block devices report their size
through BLKGETSIZE64.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from aioublk import logs
from aioublk.errors import Error
from aioublk.io import directio, locking
from aioublk.ring import current_ring
from aioublk.target import Buffer, FixedBuf, Geometry

BLKGETSIZE64 = 0x80081272
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

log = logs.get_logger("aioublk.targets.backing")


class BackingError(Error):
    """A backing file that cannot be used, explained in one line."""


def fit_geometry(geo: Geometry, files: list[Backing]) -> Geometry:
    """``geo`` with a logical block size and memory alignment every one of
    ``files`` can do directly (its size rounded down to that block size)."""
    lbs = max(b.logical_block_size for b in files)
    mem = max(b.align.memory if b.direct else 512 for b in files)
    return replace(geo, size=geo.size & ~(lbs - 1), logical_block_size=lbs, io_min=lbs,
                   physical_block_size=max(lbs, *(b.align.physical for b in files)),
                   dma_alignment=max(mem, 512) - 1)


@dataclass
class Backing:
    path: str
    fd: int
    size: int
    direct: bool  # the fd has O_DIRECT now
    is_block: bool
    align: directio.Alignment = directio.Alignment()  # what direct I/O needs
    opened_direct: bool = False  # an EINVAL may be O_DIRECT's refusal: retry buffered
    #: the first sync that failed: every later one fails (Linux reports a lost
    #: write-back once, and the next sync would acknowledge writes it lost)
    sync_error: OSError | None = field(default=None, compare=False)

    @property
    def logical_block_size(self) -> int:
        """The smallest I/O the file takes as it is opened."""
        return self.align.offset if self.direct else 512

    @classmethod
    def open(cls, path: str, *, direct: bool = True, read_only: bool = False) -> Backing:
        mode = os.O_RDONLY if read_only else os.O_RDWR
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise BackingError(f"backing file {path} does not exist") from None
        except OSError as e:
            raise BackingError(f"backing file {path}: {e.strerror}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise BackingError(f"backing file {path} is neither a regular file nor a "
                               "block device")
        try:
            opened = directio.open_direct(path, mode | os.O_CLOEXEC) if direct else None
            used_direct = opened is not None
            fd = os.open(path, mode | os.O_CLOEXEC) if opened is None else opened
        except OSError as e:
            raise BackingError(f"cannot open backing file {path}: {e.strerror}") from None
        try:
            return cls._opened(path, fd, st, used_direct, read_only)
        except BaseException as e:
            os.close(fd)  # and its lock
            if isinstance(e, (locking.InUse, locking.LockFailed)):
                raise BackingError(str(e)) from None
            if isinstance(e, OSError):
                raise BackingError(f"backing file {path}: {e.strerror}") from None
            raise

    @classmethod
    def _opened(cls, path: str, fd: int, st: os.stat_result, used_direct: bool,
                read_only: bool) -> Backing:
        """The Backing of ``fd``, just opened: locked, sized and aligned."""
        locking.lock(fd, path, write=not read_only)
        is_block = stat.S_ISBLK(st.st_mode)
        if is_block:
            size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
        else:
            size = st.st_size
        align = directio.alignment(fd) or directio.Alignment()
        b = cls(path, fd, size, used_direct, is_block, align, used_direct)
        if used_direct and max(align.offset, align.memory) > mmap.PAGESIZE:
            b.buffered(f"it needs {align.offset}-byte alignment, more than a ublk "
                       "device's largest block size")
        return b

    def buffered(self, why: str) -> None:
        """Drop O_DIRECT (once; the fd and its lock stay)."""
        directio.drop_direct(self, why)

    def einval(self, what: str) -> Callable[[], bool]:
        """For ``rw_handler``: an EINVAL of the fast path makes the file buffered."""
        return lambda: self.refused(OSError(errno.EINVAL, what), what)

    def refused(self, e: OSError, what: str) -> bool:
        """Whether a failed I/O may be O_DIRECT refusing it; if so the file is
        buffered from now on (a log line) and the caller retries, once."""
        if e.errno != errno.EINVAL or not self.opened_direct:
            return False
        self.buffered(what)
        return True

    async def read_full(self, buf: Buffer, offset: int) -> None:
        """Read all of ``buf``; zeros past end of file."""
        await self._buffered_if_refused(self._read_full, buf, offset, "read")

    async def write_full(self, buf: Buffer, offset: int) -> None:
        await self._buffered_if_refused(self._write_full, buf, offset, "write")

    async def _buffered_if_refused(self, io: Callable[[Buffer, int], Awaitable[None]],
                                   buf: Buffer, offset: int, what: str) -> None:
        try:
            await io(buf, offset)
        except OSError as e:
            if not self.refused(e, f"a {what} of {len(buf)} bytes at {offset}"):
                raise
            await io(buf, offset)

    async def _read_full(self, buf: Buffer, offset: int) -> None:
        ring = current_ring()
        done = 0
        total = len(buf)
        while done < total:
            if isinstance(buf, FixedBuf):
                n = await ring.read_fixed(self.fd, buf.offset + done, total - done,
                                          offset + done, buf.index)
            else:
                n = await ring.read(self.fd, buf[done:], offset + done)
            if n == 0:
                break
            done += n
        if done < total:
            if isinstance(buf, FixedBuf):
                raise OSError(errno.EIO, f"read past the end of {self.path}")
            buf[done:] = bytes(total - done)

    async def _write_full(self, buf: Buffer, offset: int) -> None:
        ring = current_ring()
        done = 0
        total = len(buf)
        while done < total:
            if isinstance(buf, FixedBuf):
                n = await ring.write_fixed(self.fd, buf.offset + done, total - done,
                                           offset + done, buf.index)
            else:
                n = await ring.write(self.fd, buf[done:], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n

    async def sync(self) -> None:
        if self.sync_error is not None:
            raise OSError(errno.EIO, f"{self.path}: an earlier sync of the backing file "
                          f"failed ({self.sync_error.strerror}): writes may be lost")
        try:
            await current_ring().fdatasync(self.fd)
        except OSError as e:
            self.sync_error = self.sync_error or e
            log.error("backing file sync failed: every later flush fails", path=self.path,
                      error=str(e))
            raise OSError(errno.EIO, f"{self.path}: sync failed ({e.strerror}): writes may "
                          "be lost") from None

    async def punch(self, offset: int, length: int) -> None:
        """Deallocate a range (reads back as zeros)."""
        await current_ring().fallocate(
            self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)

    async def zero(self, offset: int, length: int, unmap: bool) -> None:
        if unmap:
            try:
                await self.punch(offset, length)
                return
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        try:
            await current_ring().fallocate(
                self.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            await self._write_zeroes(offset, length)

    async def _write_zeroes(self, offset: int, length: int) -> None:
        """For file systems without ZERO_RANGE (tmpfs): plain writes of zeros."""
        chunk = min(length, 1 << 20)
        zeros = memoryview(mmap.mmap(-1, chunk))  # page-aligned, for O_DIRECT
        done = 0
        while done < length:
            n = min(chunk, length - done)
            await self.write_full(zeros[:n], offset + done)
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            except OSError as e:  # the queues' drain() reports it; close only tells
                log.error("final sync of a backing file failed: writes may be lost",
                          path=self.path, error=e.strerror)
            os.close(self.fd)
            self.fd = -1
