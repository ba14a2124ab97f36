"""Backing files for the loop and stripe targets.

Opened with O_DIRECT where the file system allows it (so the page cache is not
filled twice); tmpfs and friends refuse O_DIRECT and get buffered I/O. Block
devices report their size through BLKGETSIZE64.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
from dataclasses import dataclass

from aioublk import locking
from aioublk.ring import current_ring
from aioublk.target import Buffer, FixedBuf

BLKGETSIZE64 = 0x80081272
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10


class BackingError(Exception):
    """A backing file that cannot be used, explained in one line."""


@dataclass
class Backing:
    path: str
    fd: int
    size: int
    direct: bool
    is_block: bool

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
        fd = -1
        used_direct = False
        if direct:
            try:
                fd = os.open(path, mode | os.O_CLOEXEC | os.O_DIRECT)
                used_direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise BackingError(f"cannot open backing file {path}: {e.strerror}") from None
        if fd < 0:
            try:
                fd = os.open(path, mode | os.O_CLOEXEC)
            except OSError as e:
                raise BackingError(f"cannot open backing file {path}: {e.strerror}") from None
        try:
            locking.lock(fd, path, write=not read_only)
        except locking.InUse as e:
            os.close(fd)
            raise BackingError(str(e)) from None
        is_block = stat.S_ISBLK(st.st_mode)
        if is_block:
            size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
        else:
            size = st.st_size
        return cls(path, fd, size, used_direct, is_block)

    async def read_full(self, buf: Buffer, offset: int) -> None:
        """Read all of ``buf``; zeros past end of file."""
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

    async def write_full(self, buf: Buffer, offset: int) -> None:
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
        await current_ring().fdatasync(self.fd)

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
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1
