"""Backend I/O C does itself (``inline_io``): tmpfs files and /dev/ublkcN
offer io_uring no nonblocking attempt, so every read or write of theirs
through the ring is handed to an io-wq worker thread; C moves those bytes
with pread/pwrite in its own thread instead. The test plays the kernel as
test_hostile_kernel's does; a file on /dev/shm (tmpfs) is the backing, and a
second one stands for /dev/ublkcN in -u mode (C reads and writes a
request's data at the offset the driver gives the tag)."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable, Coroutine, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk._uring import lib
from aioublk.dataplane.maps import Linear
from aioublk.dataplane.plane import EV_COMMIT, EV_FETCH, EV_IO, EV_RETRY
from aioublk.kernel import uapi
from aioublk.ring import Ring
from tests.dataplane.test_hostile_kernel import Plane

INLINE = lib.AUR_DP_INLINE_CHAR | lib.AUR_DP_INLINE_RAM
SHM = Path("/dev/shm")


def _tmpfs_file(name: str, size: int, flags: int = os.O_RDWR) -> Generator[int, None, None]:
    path = SHM / f"aioublk-test-{os.getpid()}-{name}"
    fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, 0o600)
    os.unlink(path)
    os.ftruncate(fd, size)
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.fixture
def shm_backing() -> Iterator[int]:
    yield from _tmpfs_file("backing", 64 << 20)


@pytest.fixture
def shm_char() -> Iterator[int]:
    """The stand-in for /dev/ublkcN: big enough to hold queue 0's tags."""
    yield from _tmpfs_file("char", uapi.user_copy_offset(0, 8))


def _io_workers() -> int:
    """The io-wq worker threads of the calling thread's io_uring
    (``iou-wrk-TID``: a submitter's workers, the last of which lives as long
    as the submitter does)."""
    name = f"iou-wrk-{threading.get_native_id()}"
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                n += f.read().strip() == name
        except FileNotFoundError:  # (a thread that just ended)
            pass
    return n


def _in_a_new_thread(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``body`` on a loop of a thread of its own: one that has never
    submitted anything, so it has no io-wq worker yet."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(body())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)  # (its waits give up after 5 s: longer is a hang, this test's alone)
    assert not t.is_alive(), "the test's thread hung"
    if failed:
        raise failed[0]


@pytest.mark.parametrize("batch", [0, 1], ids=["per-io", "batch"])
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
def test_tmpfs_io_is_moved_by_c_itself_with_no_io_worker(
        shm_backing: int, shm_char: int, batch: int, user_copy: bool) -> None:
    """A write then a read on a tmpfs backing (with -u, through the stand-in
    /dev/ublkcN): each lands where the map says, completes in full (C
    commits it: the stand-in refuses the command, as the pipe does), and
    the submitting thread never gets an io-wq worker, which the same I/O
    through the ring would have started."""
    _in_a_new_thread(lambda: _write_then_read(shm_backing, shm_char, batch, user_copy))


async def _write_then_read(shm_backing: int, shm_char: int, batch: int, user_copy: bool) -> None:
    ring = Ring(32)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = Plane(ring, shm_backing, depth=4, max_io=8192, mode=mode, batch=batch,
                  map=Linear(shm_backing, 4096),
                  setup={"inline_io": INLINE, **({"char_fd": shm_char} if user_copy else {})})
    fetch = plane.fetch_batch if batch else plane.fetch
    done = EV_COMMIT if batch else EV_IO
    data = os.urandom(8192)
    try:
        if user_copy:  # what the kernel's copy in would give C for tag 2
            os.pwrite(shm_char, data, uapi.user_copy_offset(0, 2))
        else:
            plane.buf(2)[:] = data
        fetch(2, uapi.Op.WRITE, 16, 8)
        await plane.wait_for(lambda: any(e[0] == done for e in plane.events))
        assert os.pread(shm_backing, 8192, 4096 + 4096) == data
        plane.events.clear()
        fetch(3, uapi.Op.READ, 8, 16)  # the second half of what was written
        await plane.wait_for(lambda: any(e[0] == done for e in plane.events))
        got = (os.pread(shm_char, 4096, uapi.user_copy_offset(0, 3)) if user_copy
               else bytes(plane.buf(3)[:4096]))
        assert got == data[4096:]
        assert not [e for e in plane.events if e[0] == EV_RETRY]
        c = plane.dp.counts[0]
        assert (c.c_served, c.py_handed) == (2, 0) and plane.dp.inflight == 0
        assert _io_workers() == 0
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_failed_inline_transfer_goes_to_python_with_its_errno() -> None:
    """A backing C cannot read (opened write-only): the pread fails, and the
    request comes back to Python as a retry with that errno, holding nothing."""
    gen = _tmpfs_file("wronly", 1 << 20, os.O_WRONLY)
    wronly = next(gen)
    ring = Ring(16)
    plane = Plane(ring, wronly, depth=2, map=Linear(wronly), setup={"inline_io": INLINE})
    try:
        plane.fetch(1, uapi.Op.READ, 8, 0)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_RETRY, 1, 0, -errno.EBADF)]
        assert plane.dp.inflight == 0 and plane.dp.counts[0].py_handed == 1
    finally:
        plane.close()
        gen.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("batch", [0, 1], ids=["per-io", "batch"])
async def test_a_full_queue_of_inline_requests_all_complete(shm_backing: int, batch: int) -> None:
    """Every tag at once, each its own 4 KiB of the tmpfs backing: each
    transfer's result waits in C for the pass after it, and all of them are
    committed, each with its own data."""
    depth = 8  # (batch: the harness's fetch buffers hold 8 fetches)
    ring = Ring(64)
    plane = Plane(ring, shm_backing, depth=depth, map=Linear(shm_backing),
                  batch=batch, setup={"inline_io": INLINE})
    fetch = plane.fetch_batch if batch else plane.fetch
    done = EV_COMMIT if batch else EV_IO
    try:
        for tag in range(depth):
            plane.buf(tag)[:] = bytes([tag + 1]) * 4096
            fetch(tag, uapi.Op.WRITE, 8, tag * 8)
        await plane.wait_for(lambda: plane.dp.counts[0].c_served == depth
                             and plane.dp.inflight == 0)
        for tag in range(depth):
            assert os.pread(shm_backing, 4096, tag * 4096) == bytes([tag + 1]) * 4096
        assert not [e for e in plane.events if e[0] not in (done, EV_FETCH)]
    finally:
        plane.close()
