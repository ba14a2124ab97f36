"""Failures of the loop and stripe targets' backing files: a lost write-back
keeps failing, the final one reaches the caller, and an unusable file is a
one-line error (host only, no kernel needed)."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from aioublk.io import locking
from aioublk.io.hostfile import Backing
from aioublk.ring import Ring
from aioublk.target import Target
from aioublk.targets import BackingError, LoopTarget, StripeTarget

K = 1024
M = 1 << 20


def aligned(data: bytes) -> memoryview:
    m = memoryview(mmap.mmap(-1, len(data)))
    m[:] = data
    return m


def _fail_sync_once(ring: Ring, monkeypatch: pytest.MonkeyPatch, fd: int) -> list[int]:
    """The ring's fdatasync of ``fd`` fails once with EIO, as Linux reports a
    lost write-back (once); later ones go to the kernel and succeed."""
    real: Callable[[int], Awaitable[None]] = ring.fdatasync
    failed: list[int] = []

    async def fdatasync(f: int) -> None:
        if f == fd and not failed:
            failed.append(f)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        await real(f)
    monkeypatch.setattr(ring, "fdatasync", fdatasync)
    return failed


@pytest.fixture(params=["loop", "stripe"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Target, int]]:
    """A loop or stripe target over fresh files, and the fd whose sync fails."""
    paths = [tmp_path / f"f{i}" for i in range(1 if request.param == "loop" else 2)]
    for p in paths:
        p.write_bytes(bytes(M))
    t: Target
    if request.param == "loop":
        t = LoopTarget(str(paths[0]))
        fd = t.backing.fd
    else:
        t = StripeTarget([str(p) for p in paths], chunk_size=4096)
        fd = t.files[1].fd
    try:
        yield t, fd
    finally:
        t.close()


@pytest.mark.asyncio
async def test_a_failed_sync_fails_every_later_flush(
        ring: Ring, target: tuple[Target, int], monkeypatch: pytest.MonkeyPatch) -> None:
    t, fd = target
    failed = _fail_sync_once(ring, monkeypatch, fd)
    await t.write(0, aligned(os.urandom(8 * K)))
    with pytest.raises(OSError) as first:
        await t.flush()
    assert failed and first.value.errno == errno.EIO
    # the kernel reported the error once: the next sync would succeed,
    # and would acknowledge writes that never reached the disk
    for _ in range(2):
        with pytest.raises(OSError, match="an earlier sync .* failed") as later:
            await t.flush()
        assert later.value.errno == errno.EIO
    with pytest.raises(OSError, match="earlier sync"):
        await t.write(4 * K, aligned(os.urandom(8 * K)), fua=True)


@pytest.mark.asyncio
async def test_drain_syncs_and_raises_when_the_sync_fails(
        ring: Ring, target: tuple[Target, int], monkeypatch: pytest.MonkeyPatch) -> None:
    t, fd = target
    await t.write(0, aligned(os.urandom(8 * K)))
    await t.drain()  # the sync works: nothing to report
    await t.drain()  # several workers drain one device: again is fine
    failed = _fail_sync_once(ring, monkeypatch, fd)
    await t.write(0, aligned(os.urandom(8 * K)))
    with pytest.raises(OSError) as e:
        await t.drain()
    assert failed and e.value.errno == errno.EIO
    with pytest.raises(OSError, match="earlier sync"):
        await t.drain()  # the next worker's drain fails too


def test_close_logs_a_failed_final_fsync(target: tuple[Target, int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t, _fd = target

    def fsync(f: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr("aioublk.io.hostfile.os.fsync", fsync)
    with capture_logs() as logs:
        t.close()  # does not raise
    errors = [e for e in logs if e["log_level"] == "error"]
    assert errors and all("Input/output error" in e["error"] for e in errors), logs


def test_open_failing_after_the_lock_is_one_line_and_closes_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What fails once the file is open and locked (its direct I/O alignment,
    a block device's size) is a BackingError, and the fd and lock are gone."""
    path = tmp_path / "disk"
    path.write_bytes(bytes(M))

    def alignment(fd: int) -> None:
        raise OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
    monkeypatch.setattr("aioublk.io.hostfile.directio.alignment", alignment)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(BackingError, match=f"^backing file {path}: .*Inappropriate ioctl"):
        Backing(str(path))
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert not locking.in_use(str(path))


def test_a_lock_failing_for_another_reason_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An errno the lock does not expect (not a conflict, not "no OFD locks
    here") says which file and why, in one line, and stays an OSError."""
    path = tmp_path / "disk"
    path.write_bytes(bytes(M))

    def conflict(fd: int, used: int, shared: int) -> bool:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(locking, "conflict", conflict)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError) as e:
            locking.lock(fd, str(path), write=True)
        assert e.value.errno == errno.EIO
        assert str(e.value) == f"cannot lock {path}: Input/output error"
    finally:
        os.close(fd)
    with pytest.raises(BackingError, match=f"^cannot lock {path}: Input/output error$"):
        Backing(str(path))


@pytest.mark.parametrize("where", ["alignment", "lock"])
def test_qcow2_host_file_failing_after_open_is_one_line_and_closes_the_file(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a qcow2 image's file: one line, no fd or lock left."""
    from aioublk.io.hostfile import HostFile
    from aioublk.qcow2 import Qcow2Error

    path = tmp_path / "img"
    path.write_bytes(bytes(M))

    def fail(*args: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    if where == "alignment":
        monkeypatch.setattr("aioublk.io.hostfile.directio.alignment", fail)
    else:
        monkeypatch.setattr(locking, "conflict", fail)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(Qcow2Error, match=f"{path}: .*Input/output error$"):
        HostFile(str(path), read_only=False, direct=True, error=Qcow2Error)
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert not locking.in_use(str(path))
