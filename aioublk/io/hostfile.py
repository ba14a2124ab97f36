"""The host files under a device: loop, stripe and zoned's backing files and
qcow2's image and raw backing files, read and written through the current
queue's ring.

Opened with O_DIRECT where the file system allows it (so the page cache is not
filled twice); file systems that refuse O_DIRECT get buffered I/O. What direct
I/O needs is read at open (``aioublk.io.directio``): a file that needs larger
blocks than its user reads in (512-byte sectors for qcow2, a page for the
targets) goes buffered at once. A request O_DIRECT refuses all the same is
bounced when only its buffer is misaligned; otherwise the file goes buffered
(one log line) and the request is retried that way, once.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from aioublk import logs
from aioublk.errors import Error
from aioublk.io import directio, locking
from aioublk.ring import buffer_address, current_ring
from aioublk.target import Buffer, FixedBuf, Geometry

ALIGN = 4096  # O_DIRECT alignment we assume for addresses and lengths of bounces
SECTOR = 512  # what O_DIRECT needs of a buffer we pass through unbounced
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

log = logs.get_logger("aioublk.hostfile")


class BackingError(Error):
    """A backing file that cannot be used, explained in one line."""


class Checked(Protocol):
    """A file a policy checked before it is opened (qcow2's backing files):
    opened as ``leaf`` in ``dir_fd`` with O_NOFOLLOW; ``same`` raises unless
    the opened file is the one checked."""

    @property
    def leaf(self) -> str: ...
    @property
    def dir_fd(self) -> int: ...
    def same(self, st: os.stat_result) -> None: ...


def file_bytes(path: str) -> int:
    """A file's or a block device's size."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def aligned(n: int) -> memoryview:
    """A zeroed, page-aligned buffer (usable with O_DIRECT)."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


def fit_geometry(geo: Geometry, files: Sequence[HostFile]) -> Geometry:
    """``geo`` with a logical block size and memory alignment every one of
    ``files`` can do directly (its size rounded down to that block size)."""
    lbs = max(b.logical_block_size for b in files)
    mem = max(b.align.memory if b.direct else 512 for b in files)
    return replace(geo, size=geo.size & ~(lbs - 1), logical_block_size=lbs, io_min=lbs,
                   physical_block_size=max(lbs, *(b.align.physical for b in files)),
                   dma_alignment=max(mem, 512) - 1)


class HostFile:
    """One open host file (a regular file or a block device), locked as QEMU
    locks images. ``direct``: the fd has O_DIRECT now; ``opened_direct``: it
    had at open, so an EINVAL may be O_DIRECT's refusal."""

    __slots__ = ("path", "fd", "direct", "opened_direct", "size", "is_block", "align")

    #: how an error after the open names the file (``{}``: ``name``)
    failed = "cannot open {}"

    def __init__(self, path: str, *, read_only: bool, direct: bool,
                 checked: Checked | None = None, error: type[Error] = BackingError,
                 name: str | None = None, block: int = SECTOR) -> None:
        """Open ``path``; errors are ``error`` naming it ``name`` (the path by
        default). Direct I/O is kept only if the file takes ``block``-byte I/O.
        A ``checked`` file is opened as its policy says, and refused unless it
        is the very inode checked. The open never blocks (O_NONBLOCK: a FIFO
        would wait for a writer) and the type is checked on the opened
        descriptor, so a name swapped after a check is caught too."""
        self.path = path
        name = path if name is None else name
        mode = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC | os.O_NONBLOCK \
            | os.O_NOCTTY
        leaf, at = path, None
        if checked is not None:
            leaf, at, mode = checked.leaf, checked.dir_fd, mode | os.O_NOFOLLOW
        self.fd = -1
        try:
            fd = directio.open_direct(leaf, mode, dir_fd=at) if direct else None
            self.direct = self.opened_direct = fd is not None
            self.fd = fd if fd is not None else os.open(leaf, mode, dir_fd=at)
        except OSError as e:
            raise error(f"cannot open {name}: {e.strerror}") from None
        try:
            self._opened(name, read_only, checked, error, block)
        except BaseException as e:
            HostFile.close(self)  # with its lock, if it got one
            if isinstance(e, locking.InUse | locking.LockFailed):
                raise error(str(e)) from None
            if isinstance(e, OSError):
                raise error(f"{self.failed.format(name)}: {e.strerror or e}") from None
            raise

    def _opened(self, name: str, read_only: bool, checked: Checked | None,
                error: type[Error], block: int) -> None:
        st = os.fstat(self.fd)
        if checked is not None:
            checked.same(st)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise error(f"{name} is neither a regular file nor a block device")
        os.set_blocking(self.fd, True)
        self.is_block = stat.S_ISBLK(st.st_mode)
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        need = directio.alignment(self.fd)
        self.align = need or directio.Alignment()
        if self.direct:
            if need is None:
                self._buffered("the file system has no direct I/O")
            elif need.offset > block or need.memory > mmap.PAGESIZE:
                self._buffered(f"it needs {need.offset}-byte alignment, more than the "
                               f"{block}-byte blocks it is used in")
        # before the first byte is read: QEMU's locks (read-only for backing files)
        locking.lock(self.fd, self.path, write=not read_only)

    @property
    def logical_block_size(self) -> int:
        """The smallest I/O the file takes as it is opened."""
        return self.align.offset if self.direct else 512

    def _buffered(self, why: str) -> None:
        directio.drop_direct(self, why)

    def refused(self, what: str = "a task-free request") -> bool:
        """Whether a request that failed with EINVAL (``rw_handler``'s, or one
        of the caller's own) may be O_DIRECT refusing it; if so the file is
        buffered from now on and the caller retries, once. A request sent
        before another one made the file buffered is retried too."""
        if not self.opened_direct:
            return False
        self._buffered(what)
        return True

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

    def patch(self, offset: int, data: bytes) -> None:
        """Write ``data`` at any offset, synchronously: the sectors around it
        are read and written whole (O_DIRECT takes nothing else)."""
        start = offset & ~(ALIGN - 1)
        end = (offset + len(data) + ALIGN - 1) & ~(ALIGN - 1)
        whole = bytearray(self.pread(start, end - start).ljust(end - start, b"\0"))
        whole[offset - start:offset - start + len(data)] = data
        self.pwrite_sector(bytes(whole), start, sync=False)

    def datasync(self) -> None:
        """fdatasync, synchronously."""
        os.fdatasync(self.fd)

    @staticmethod
    def _only_memory_misaligned(buf: Any, offset: int) -> bool:
        """Whether a bounce buffer would make this request acceptable."""
        return bool(buffer_address(buf) & (SECTOR - 1)) and not (offset | len(buf)) & (SECTOR - 1)

    # --- asynchronous, on the current ring. O_DIRECT refuses a misaligned
    # request with EINVAL; only then do we look why (checking first costs every
    # call): a misaligned buffer is bounced, anything else makes the file
    # buffered. ``direct`` is sampled before the I/O: another request may have
    # made the file buffered meanwhile, and this one is retried all the same.
    async def read_into(self, buf: Buffer, offset: int) -> None:
        """Fill ``buf`` from ``offset``; zeros past the end of the file (a
        registered buffer cannot be filled: EIO)."""
        direct = self.direct
        try:
            await self._read(buf, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            if self.direct and not isinstance(buf, FixedBuf) \
                    and (buffer_address(buf) | offset | len(buf)) & (ALIGN - 1):
                await self._bounce_read(buf, offset)
            else:
                self._buffered(f"a read of {len(buf)} bytes at {offset}")
                await self._read(buf, offset)

    async def _read(self, buf: Buffer, offset: int) -> None:
        ring = current_ring()
        total = len(buf)
        done = 0
        while done < total:  # nearly always one read
            if isinstance(buf, FixedBuf):
                n = await ring.read_fixed(self.fd, buf.offset + done, total - done,
                                          offset + done, buf.index)
            else:
                n = await ring.read(self.fd, buf[done:] if done else buf, offset + done)
            if n == 0:
                if isinstance(buf, FixedBuf):
                    raise OSError(errno.EIO, f"read past the end of {self.path}")
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
        """Write all of ``buf`` (a registered buffer, or any buffer)."""
        view: Buffer = buf if isinstance(buf, FixedBuf) else memoryview(buf)
        direct = self.direct
        try:
            await self._write(view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            if self.direct and not isinstance(view, FixedBuf) \
                    and self._only_memory_misaligned(view, offset):
                bounce = aligned(len(view))
                bounce[:] = view
                await self.write(bounce, offset)  # aligned: refused again means buffered
            else:
                self._buffered(f"a write of {len(view)} bytes at {offset}")
                await self._write(view, offset)
        if offset + len(view) > self.size:
            self.size = offset + len(view)

    async def _write(self, view: Buffer, offset: int) -> None:
        ring = current_ring()
        done = 0
        total = len(view)
        while done < total:
            if isinstance(view, FixedBuf):
                n = await ring.write_fixed(self.fd, view.offset + done, total - done,
                                           offset + done, view.index)
            else:
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
        zeros = aligned(chunk)  # page-aligned, for O_DIRECT
        done = 0
        while done < length:
            n = min(chunk, length - done)
            await self.write(zeros[:n], offset + done)
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Backing(HostFile):
    """A target's backing file (loop, stripe, zoned): named so in its errors,
    direct if it takes page-sized blocks, and its first failed sync sticks."""

    __slots__ = ("sync_error",)
    failed = "{}"

    def __init__(self, path: str, *, direct: bool = True, read_only: bool = False) -> None:
        try:  # first by name: a directory's open would fail with a vaguer error
            st = os.stat(path)
        except FileNotFoundError:
            raise BackingError(f"backing file {path} does not exist") from None
        except OSError as e:
            raise BackingError(f"backing file {path}: {e.strerror}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise BackingError(f"backing file {path} is neither a regular file nor a "
                               "block device")
        super().__init__(path, read_only=read_only, direct=direct, error=BackingError,
                         name=f"backing file {path}", block=mmap.PAGESIZE)
        #: the first sync that failed: every later one fails (Linux reports a lost
        #: write-back once, and the next sync would acknowledge writes it lost)
        self.sync_error: OSError | None = None

    async def sync(self) -> None:
        if self.sync_error is not None:
            raise OSError(errno.EIO, f"{self.path}: an earlier sync of the backing file "
                          f"failed ({self.sync_error.strerror}): writes may be lost")
        try:
            await super().sync()
        except OSError as e:
            self.sync_error = self.sync_error or e
            log.error("backing file sync failed: every later flush fails", path=self.path,
                      error=str(e))
            raise OSError(errno.EIO, f"{self.path}: sync failed ({e.strerror}): writes may "
                          "be lost") from None

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            except OSError as e:  # the queues' drain() reports it; close only tells
                log.error("final sync of a backing file failed: writes may be lost",
                          path=self.path, error=e.strerror)
        super().close()
