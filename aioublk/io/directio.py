"""What O_DIRECT asks of a host file, found out when it is opened.

Facts this relies on:

- O_DIRECT I/O must have its file offset and length aligned to the device's
  logical block size (512 or 4096), and its memory to the device's DMA
  alignment. A request that is not fails with EINVAL, at submission.
- ``statx(STATX_DIOALIGN)`` (Linux 6.1+) reports both for a regular file
  (0 when the file system has no direct I/O), and for a block device from
  6.11; ``BLKSSZGET``/``BLKPBSZGET`` give a block device's logical and
  physical sector sizes on any kernel.
- Some file systems refuse O_DIRECT at ``open`` (ramfs; tmpfs before 6.6).
- ``fcntl(F_SETFL)`` may clear O_DIRECT on an open file: the same
  descriptor (and its locks) then does buffered I/O.

So a file opened for direct I/O gets its alignment at open; a device served
over it advertises a logical block size it can do; and a request refused all
the same (a file system that does not say) makes the file buffered, with a
log line, and is retried once that way, never again the same way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from aioublk import logs

BLKSSZGET = 0x1268
BLKPBSZGET = 0x127B
STATX_DIOALIGN = 0x2000
AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256
_STATX_MASK = struct.Struct("I")
_STATX_DIO = struct.Struct("II")  # stx_dio_mem_align, stx_dio_offset_align
_STATX_DIO_AT = 152

log = logs.get_logger("aioublk.directio")


@dataclass(frozen=True)
class Alignment:
    """What direct I/O on one file needs: memory addresses aligned to ``memory``,
    file offsets and lengths to ``offset``; ``physical`` is the device's
    physical sector size where known."""

    memory: int = 512
    offset: int = 512
    physical: int = 4096


def _libc_statx() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # a libc without statx (glibc < 2.28)
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    f.restype = ctypes.c_int
    return f


_statx = _libc_statx()


def _statx_dio(fd: int) -> tuple[int, int] | None:
    """(memory, offset) alignment from statx, None if the kernel does not say."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf) != 0:
        return None
    if not _STATX_MASK.unpack_from(buf.raw)[0] & STATX_DIOALIGN:
        return None
    mem, off = _STATX_DIO.unpack_from(buf.raw, _STATX_DIO_AT)
    return mem, off


def _ioctl_int(fd: int, req: int) -> int:
    return int(struct.unpack("I", fcntl.ioctl(fd, req, b"\0" * 4))[0])


def _sysfs_sector(st_dev: int) -> int | None:
    """The logical block size of the device a file system lives on."""
    base = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a partition: its disk's
        try:
            with open(f"{queue}/logical_block_size") as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def alignment(fd: int) -> Alignment | None:
    """What direct I/O on ``fd`` needs; None if the file system has none
    (statx says its offset alignment is 0)."""
    st = os.fstat(fd)
    if stat.S_ISBLK(st.st_mode):
        logical = _ioctl_int(fd, BLKSSZGET)
        physical = max(_ioctl_int(fd, BLKPBSZGET), logical)
        dio = _statx_dio(fd)
        memory = dio[0] if dio and dio[0] else logical
        return Alignment(memory, logical, physical)
    dio = _statx_dio(fd)
    if dio is not None:
        if dio[1] == 0:
            return None
        return Alignment(max(dio[0], 1), dio[1], max(dio[1], 4096))
    sector = _sysfs_sector(st.st_dev) or 512
    return Alignment(sector, sector, max(sector, 4096))


def open_direct(path: str, flags: int, dir_fd: int | None = None) -> int | None:
    """``path`` (in ``dir_fd``, as os.open takes it) opened with O_DIRECT, or
    None where the file system refuses it (EINVAL): the caller opens it
    buffered. Other errors raise."""
    try:
        return os.open(path, flags | os.O_DIRECT, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        log.warning("no direct I/O on this file system: buffered I/O", path=path)
        return None


def make_buffered(fd: int, path: str, why: str) -> None:
    """Clear O_DIRECT on ``fd`` (the same descriptor: its locks stay)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    log.warning("direct I/O refused: buffered I/O from now on", path=path, reason=why)


class DirectFile(Protocol):
    """A host file: ``direct`` says whether its ``fd`` has O_DIRECT now."""

    path: str
    fd: int
    direct: bool


def drop_direct(f: DirectFile, why: str) -> None:
    """Make ``f`` buffered: once, with one log line (the fd and its lock stay)."""
    if f.direct:
        f.direct = False
        make_buffered(f.fd, f.path, why)
