"""The image file under a qcow2 image (and a raw backing file): reads and
writes through the current queue's ring, with O_DIRECT where the file
system has it and bounce buffers where a caller's buffer is not aligned.

The engine reads and writes in 512-byte sectors, so direct I/O is kept only
where the file takes 512-byte aligned I/O (``aioublk.io.directio``); otherwise,
and whenever O_DIRECT refuses a request all the same, the file goes
buffered (one log line) and the request is retried that way, once."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from typing import Any

from aioublk.io import directio, locking
from aioublk.qcow2.backing_policy import Checked
from aioublk.qcow2.format import Qcow2Error
from aioublk.ring import buffer_address, current_ring

ALIGN = 4096  # O_DIRECT alignment we assume for addresses and lengths of bounces
SECTOR = 512  # what O_DIRECT needs of a buffer we pass through unbounced


def aligned(n: int) -> memoryview:
    """A zeroed, page-aligned buffer (usable with O_DIRECT)."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


class HostFile:
    __slots__ = ("path", "fd", "direct", "size")  # direct: the fd has O_DIRECT now

    def __init__(self, path: str, *, read_only: bool, direct: bool,
                 checked: Checked | None = None) -> None:
        """Open ``path`` (a regular file or a block device). A backing file
        comes ``checked`` by its policy: opened in the directory the policy
        reached, with ``O_NOFOLLOW``, and refused unless it is the very inode
        the policy checked. The open never blocks (O_NONBLOCK: a FIFO would
        wait for a writer) and the type is checked on the opened descriptor,
        so a name swapped after a check is caught too."""
        self.path = path
        mode = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC | os.O_NONBLOCK \
            | os.O_NOCTTY
        name, at = path, None
        if checked is not None:
            name, at, mode = checked.leaf, checked.dir_fd, mode | os.O_NOFOLLOW
        self.fd = -1
        try:
            fd = directio.open_direct(name, mode, dir_fd=at) if direct else None
            self.direct = fd is not None
            self.fd = fd if fd is not None else os.open(name, mode, dir_fd=at)
        except OSError as e:
            raise Qcow2Error(f"cannot open {path}: {e.strerror}") from None
        try:
            self._opened(path, read_only, checked)
        except BaseException as e:
            self.close()  # with its lock, if it got one
            if isinstance(e, locking.InUse | locking.LockFailed):
                raise Qcow2Error(str(e)) from None
            if isinstance(e, OSError):
                raise Qcow2Error(f"cannot open {path}: {e.strerror or e}") from None
            raise

    def _opened(self, path: str, read_only: bool, checked: Checked | None) -> None:
        st = os.fstat(self.fd)
        if checked is not None:
            checked.same(st)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise Qcow2Error(f"{path} is neither a regular file nor a block device")
        os.set_blocking(self.fd, True)
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        if self.direct:
            need = directio.alignment(self.fd)
            if need is None or need.offset > SECTOR or need.memory > ALIGN:
                self._buffered("the file system does not take 512-byte direct I/O")
        # before the first byte is read: QEMU's locks (read-only for backing files)
        locking.lock(self.fd, path, write=not read_only)

    # --- synchronous, for open
    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (short at end of file)."""
        start = offset & ~(ALIGN - 1)
        end = (offset + length + ALIGN - 1) & ~(ALIGN - 1)
        buf = aligned(end - start)
        try:
            n = os.preadv(self.fd, [buf], start)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            self._buffered(f"a read of {end - start} bytes at {start}")
            n = os.preadv(self.fd, [buf], start)
        return bytes(buf[offset - start:max(offset - start, min(n, offset + length - start))])

    def pwrite_sector(self, data: bytes, offset: int, *, sync: bool = True) -> None:
        """Write whole sectors synchronously and (``sync``) make them durable
        (header updates)."""
        buf = aligned(len(data))
        buf[:] = data
        try:
            os.pwritev(self.fd, [buf], offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            self._buffered(f"a write of {len(data)} bytes at {offset}")
            os.pwritev(self.fd, [buf], offset)
        if sync:
            self.datasync()

    def datasync(self) -> None:
        """fdatasync, synchronously."""
        os.fdatasync(self.fd)

    def _buffered(self, why: str) -> None:
        directio.drop_direct(self, why)

    def refused(self) -> None:
        """For ``rw_handler``: O_DIRECT refused a task-free request (EINVAL); the
        file goes buffered before the retry, which is then not the same again."""
        self._buffered("a task-free request")

    @staticmethod
    def _only_memory_misaligned(buf: Any, offset: int) -> bool:
        """Whether a bounce buffer would make this request acceptable."""
        return bool(buffer_address(buf) & (SECTOR - 1)) and not (offset | len(buf)) & (SECTOR - 1)

    # --- asynchronous, on the current ring. O_DIRECT refuses a misaligned
    # request with EINVAL; only then do we look why (checking first costs every
    # call): a misaligned buffer is bounced, anything else makes the file
    # buffered. ``direct`` is sampled before the I/O: another request may have
    # made the file buffered meanwhile, and this one is retried all the same.
    async def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``; zeros past the end of the file."""
        direct = self.direct
        try:
            await self._read(buf, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            if self.direct and (buffer_address(buf) | offset | len(buf)) & (ALIGN - 1):
                await self._bounce_read(buf, offset)
            else:
                self._buffered(f"a read of {len(buf)} bytes at {offset}")
                await self._read(buf, offset)

    async def _read(self, buf: memoryview, offset: int) -> None:
        ring = current_ring()
        total = len(buf)
        done = 0
        while done < total:  # nearly always one read
            n = await ring.read(self.fd, buf[done:] if done else buf, offset + done)
            if n == 0:
                buf[done:] = bytes(total - done)
                return
            done += n

    async def _bounce_read(self, buf: memoryview, offset: int) -> None:
        start = offset & ~(ALIGN - 1)
        end = (offset + len(buf) + ALIGN - 1) & ~(ALIGN - 1)
        bounce = aligned(end - start)
        await self.read_into(bounce, start)  # aligned: refused again means buffered
        buf[:] = bounce[offset - start:offset - start + len(buf)]

    async def write(self, buf: Any, offset: int) -> None:
        view = memoryview(buf)
        direct = self.direct
        try:
            await self._write(view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            if self.direct and self._only_memory_misaligned(view, offset):
                bounce = aligned(len(view))
                bounce[:] = view
                await self.write(bounce, offset)  # aligned: refused again means buffered
            else:
                self._buffered(f"a write of {len(view)} bytes at {offset}")
                await self._write(view, offset)
        if offset + len(view) > self.size:
            self.size = offset + len(view)

    async def _write(self, view: memoryview, offset: int) -> None:
        ring = current_ring()
        done = 0
        total = len(view)
        while done < total:
            n = await ring.write(self.fd, view[done:] if done else view, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n

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
        direct = self.direct
        try:
            n = await current_ring().writev(self.fd, bufs, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            self._buffered(f"a write of {total} bytes at {offset}")  # pieces were aligned
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

    def __init__(self, path: str, direct: bool, checked: Checked | None = None) -> None:
        self.file = HostFile(path, read_only=True, direct=direct, checked=checked)
        self.size = self.file.size

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.file.read_into(buf, offset)

    def release(self) -> None:
        self.file.close()
