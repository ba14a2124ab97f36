"""The image file under a qcow2 image (and a raw backing file): reads and
writes through the current queue's ring, with O_DIRECT where the file
system has it and bounce buffers where a caller's buffer is not aligned."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Any

from aioublk import locking
from aioublk.qcow2.format import Qcow2Error
from aioublk.ring import buffer_address, current_ring

ALIGN = 4096  # O_DIRECT alignment we assume for addresses and lengths of bounces
SECTOR = 512  # what O_DIRECT needs of a buffer we pass through unbounced


def aligned(n: int) -> memoryview:
    """A zeroed, page-aligned buffer (usable with O_DIRECT)."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


class HostFile:
    __slots__ = ("path", "fd", "direct", "size")

    def __init__(self, path: str, *, read_only: bool, direct: bool) -> None:
        self.path = path
        mode = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        try:
            st = os.stat(path)
        except OSError as e:
            raise Qcow2Error(f"cannot open {path}: {e.strerror}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise Qcow2Error(f"{path} is neither a regular file nor a block device")
        self.fd = -1
        self.direct = False
        if direct:
            try:
                self.fd = os.open(path, mode | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise Qcow2Error(f"cannot open {path}: {e.strerror}") from None
        if self.fd < 0:
            try:
                self.fd = os.open(path, mode)
            except OSError as e:
                raise Qcow2Error(f"cannot open {path}: {e.strerror}") from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        try:  # before the first byte is read: QEMU's locks (read-only for backing files)
            locking.lock(self.fd, path, write=not read_only)
        except locking.InUse as e:
            self.close()
            raise Qcow2Error(str(e)) from None

    # --- synchronous, for open
    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (short at end of file)."""
        start = offset & ~(ALIGN - 1)
        end = (offset + length + ALIGN - 1) & ~(ALIGN - 1)
        buf = aligned(end - start)
        n = os.preadv(self.fd, [buf], start)
        return bytes(buf[offset - start:max(offset - start, min(n, offset + length - start))])

    def pwrite_sector(self, data: bytes, offset: int) -> None:
        """Write whole sectors synchronously and make them durable (header updates)."""
        buf = aligned(len(data))
        buf[:] = data
        os.pwritev(self.fd, [buf], offset)
        os.fdatasync(self.fd)

    # --- asynchronous, on the current ring. With O_DIRECT an unaligned buffer
    # fails with EINVAL; only then do we bounce (checking first costs every call)
    async def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``; zeros past the end of the file."""
        ring = current_ring()
        total = len(buf)
        done = 0
        while done < total:  # nearly always one read
            try:
                n = await ring.read(self.fd, buf[done:] if done else buf, offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                await self._bounce_read(buf[done:], offset + done)
                return
            if n == 0:
                buf[done:] = bytes(total - done)
                return
            done += n

    async def _bounce_read(self, buf: memoryview, offset: int) -> None:
        start = offset & ~(ALIGN - 1)
        end = (offset + len(buf) + ALIGN - 1) & ~(ALIGN - 1)
        bounce = aligned(end - start)
        await self.read_into(bounce, start)
        buf[:] = bounce[offset - start:offset - start + len(buf)]

    async def write(self, buf: Any, offset: int) -> None:
        ring = current_ring()
        done = 0
        total = len(buf)
        view = memoryview(buf)
        while done < total:
            try:
                n = await ring.write(self.fd, view[done:] if done else view, offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct or (offset | total) & 511:
                    raise
                bounce = aligned(total - done)
                bounce[:] = view[done:]
                view, offset, total, done = bounce, offset + done, total - done, 0
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n
        if offset + total > self.size:
            self.size = offset + total

    async def writev(self, bufs: list[Any], offset: int) -> None:
        """Write the pieces back to back (one syscall when they are aligned)."""
        if len(bufs) == 1:
            await self.write(bufs[0], offset)
            return
        total = sum(len(b) for b in bufs)
        if self.direct and any((buffer_address(b) | len(b)) & (SECTOR - 1) for b in bufs):
            joined = aligned(total)
            pos = 0
            for b in bufs:
                joined[pos:pos + len(b)] = b
                pos += len(b)
            await self.write(joined, offset)
            return
        n = await current_ring().writev(self.fd, bufs, offset)
        if n != total:  # rare: finish piece by piece
            pos = 0
            for b in bufs:
                if pos + len(b) > n:
                    skip = max(0, n - pos)
                    await self.write(memoryview(b)[skip:], offset + pos + skip)
                pos += len(b)
        if offset + total > self.size:
            self.size = offset + total

    async def sync(self) -> None:
        await current_ring().fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RawBacking:
    """A raw backing file: its bytes, zeros past its end."""

    def __init__(self, path: str, direct: bool) -> None:
        self.file = HostFile(path, read_only=True, direct=direct)
        self.size = self.file.size

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.file.read_into(buf, offset)

    def release(self) -> None:
        self.file.close()
