"""Image locking that QEMU understands: open file description (OFD) locks on
single bytes of the file, the protocol of QEMU's ``file-posix`` driver, so an
image served by aioublk and the same image opened by ``qemu-system``,
``qemu-io``, ``qemu-img`` or ``qemu-nbd`` exclude each other as two QEMUs do.

The protocol, as QEMU defines it:

- Four permissions, bit ``i`` of a mask: consistent read (0), write (1),
  write unchanged (2), resize (3).
- Byte ``100 + i`` is read-locked by every opener that *uses* permission
  ``i``; byte ``200 + i`` by every opener that does *not share* it (does not
  let others use it while it has the file open).
- Only read locks are ever taken, so takers never conflict with each other
  directly. After taking its bytes an opener *tests* with a write lock
  (``F_OFD_GETLK``): for each permission it uses, that nobody else holds
  "not shared" (``200 + i``); for each it does not share, that nobody else
  holds "uses" (``100 + i``). A conflict means another opener is there.
- The locks belong to the open file description: another ``open()`` of the
  same file, in this process or another, conflicts with them; they go away
  when the last descriptor of that description closes (process exit too).

What aioublk takes: a writer uses read, write and resize and shares only
read and write-unchanged (what a QEMU format driver takes on its image
file); a reader uses read and shares the same, so readers coexist but never
with a writer; ``force_share`` (read-only only, as QEMU's ``-U``/
``force-share=on``) uses read and shares everything: it coexists with a
writer and accepts that the data may change under it.

A file system without OFD locks (some network file systems) gets a warning
and no lock, as QEMU's ``locking=auto`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import os
import struct
import time
from collections.abc import Iterator

from aioublk import logs
from aioublk.errors import Error

PERM_BASE = 100
SHARED_BASE = 200

CONSISTENT_READ = 0x1
WRITE = 0x2
WRITE_UNCHANGED = 0x4
RESIZE = 0x8
ALL = 0xF
_BITS = 4

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux (64-bit off_t), padded

#: How long a conflict is retried before it is reported: a server that just
#: exited (kill -9, or a recovery hand-over) keeps its files until the kernel
#: has torn down its io_uring, which takes a moment.
GRACE = 2.0

log = logs.get_logger("aioublk.locking")

_force_share: contextvars.ContextVar[bool] = contextvars.ContextVar("force_share",
                                                                    default=False)


class InUse(Error):
    """Another process (QEMU or aioublk) has the file open incompatibly."""


class LockFailed(Error, OSError):
    """Taking the lock failed for another reason than a conflict: an OSError
    (its errno kept) that reads as one line naming the file."""

    def __init__(self, path: str, e: OSError) -> None:
        super().__init__(e.errno, e.strerror)
        self.path = path

    def __str__(self) -> str:
        return f"cannot lock {self.path}: {self.strerror}"


@contextlib.contextmanager
def force_share(on: bool = True) -> Iterator[None]:
    """Files opened read-only inside this block take the force-share lock
    (the targets open their whole backing chain inside it)."""
    token = _force_share.set(on)
    try:
        yield
    finally:
        _force_share.reset(token)


def permissions(*, write: bool, share_all: bool = False) -> tuple[int, int]:
    """(used, shared) permission masks for a writer, a reader, or a reader
    that shares everything."""
    if write:
        return CONSISTENT_READ | WRITE | RESIZE, CONSISTENT_READ | WRITE_UNCHANGED
    if share_all:
        return CONSISTENT_READ, ALL
    return CONSISTENT_READ, CONSISTENT_READ | WRITE_UNCHANGED


def _flock(fd: int, cmd: int, kind: int, offset: int) -> int:
    arg = _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)
    out = fcntl.fcntl(fd, cmd, arg)
    return int(_FLOCK.unpack(out)[0])


def held_by_others(fd: int, offset: int) -> bool:
    """Whether another open file description holds a lock on byte ``offset``."""
    return _flock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset) != fcntl.F_UNLCK


def in_use(path: str) -> bool:
    """Whether any process holds QEMU's lock bytes of ``path``: a server
    killed with I/O in flight keeps its files (and may still write them)
    until the kernel has finished that I/O and torn down its ring."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return any(held_by_others(fd, base + i)
                   for base in (PERM_BASE, SHARED_BASE) for i in range(_BITS))
    finally:
        os.close(fd)


def wait_released(path: str, timeout: float = 10.0) -> bool:
    """Wait until no process holds ``path``'s lock bytes (``in_use``);
    whether that happened within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while in_use(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def conflict(fd: int, used: int, shared: int) -> bool:
    """Take the bytes for (used, shared) on ``fd``; whether another opener
    conflicts with them."""
    for i in range(_BITS):
        if used & 1 << i:
            _flock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, PERM_BASE + i)
        if not shared & 1 << i:
            _flock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, SHARED_BASE + i)
    for i in range(_BITS):
        if used & 1 << i and held_by_others(fd, SHARED_BASE + i):
            return True  # we use it, someone does not share it
        if not shared & 1 << i and held_by_others(fd, PERM_BASE + i):
            return True  # someone uses it, we do not share it
    return False


def lock(fd: int, path: str, *, write: bool) -> None:
    """Lock ``fd`` (the file at ``path``) for this process's use: writing, or
    reading (sharing everything inside ``force_share()``). Raises InUse with
    the one line for the user (LockFailed if the lock fails otherwise)."""
    share_all = not write and _force_share.get()
    used, shared = permissions(write=write, share_all=share_all)
    deadline = time.monotonic() + GRACE
    while True:
        try:
            busy = conflict(fd, used, shared)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):  # a write lock of some other tool
                busy = True
            elif e.errno in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                log.warning("file system has no OFD locks: not locking", path=path,
                            error=e.strerror)
                return
            else:
                raise LockFailed(path, e) from None
        if not busy:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    fix = "" if share_all else ", or use --read-only --force-share"
    raise InUse(f"{path} is in use by another process (QEMU or aioublk): stop it first{fix}")
