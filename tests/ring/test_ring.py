"""The Ring against real files on the host (any io_uring kernel)."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
import pytest_asyncio

from aioublk._uring import lib
from aioublk.ring import Ring, buffer_address, current_ring

pytestmark = pytest.mark.asyncio


DEFER = lib.IORING_SETUP_SINGLE_ISSUER | lib.IORING_SETUP_DEFER_TASKRUN


@pytest_asyncio.fixture(params=[0, DEFER], ids=["plain", "defer_taskrun"])
async def ring(request: pytest.FixtureRequest):
    r = Ring(64, flags=request.param, bind_thread=True)
    yield r
    r.close()


@pytest.fixture
def datafile(tmp_path: Path):
    path = tmp_path / "data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


async def test_write_then_read_back(ring: Ring, datafile: int) -> None:
    payload = os.urandom(64 << 10)
    assert await ring.write(datafile, payload, 4096) == len(payload)
    buf = bytearray(len(payload))
    assert await ring.read(datafile, buf, 4096) == len(payload)
    assert buf == payload
    assert os.pread(datafile, 16, 4096) == payload[:16]


async def test_read_past_eof_is_short(ring: Ring, datafile: int) -> None:
    os.pwrite(datafile, b"abc", 0)
    buf = bytearray(100)
    assert await ring.read(datafile, buf, 0) == 3
    assert await ring.read(datafile, buf, 1000) == 0


async def test_readv_writev(ring: Ring, datafile: int) -> None:
    parts = [b"a" * 512, b"b" * 1024, b"c" * 512]
    assert await ring.writev(datafile, parts, 0) == 2048
    bufs = [bytearray(1024), bytearray(1024)]
    assert await ring.readv(datafile, bufs, 0) == 2048
    assert bytes(bufs[0]) + bytes(bufs[1]) == b"".join(parts)


async def test_fsync_fdatasync_fallocate(ring: Ring, datafile: int) -> None:
    await ring.write(datafile, b"x" * 8192, 0)
    await ring.fsync(datafile)
    await ring.fdatasync(datafile)
    await ring.fallocate(datafile, 0, 0, 1 << 20)
    assert os.fstat(datafile).st_size == 1 << 20
    # punch a hole (PUNCH_HOLE | KEEP_SIZE): the range reads back as zeros
    await ring.fallocate(datafile, 0x02 | 0x01, 0, 4096)
    assert os.pread(datafile, 8192, 0) == bytes(4096) + b"x" * 4096


async def test_errors_raise_oserror(ring: Ring) -> None:
    with pytest.raises(OSError) as e:
        await ring.read(9999, bytearray(10), 0)
    assert e.value.errno == errno.EBADF


async def test_thousands_concurrent(ring: Ring, datafile: int) -> None:
    n = 5000
    blocks = [os.urandom(16) for _ in range(n)]
    await asyncio.gather(*(ring.write(datafile, b, i * 16) for i, b in enumerate(blocks)))
    bufs = [bytearray(16) for _ in range(n)]
    await asyncio.gather(*(ring.read(datafile, b, i * 16) for i, b in enumerate(bufs)))
    assert [bytes(b) for b in bufs] == blocks
    assert ring.in_flight == 0


async def test_cancel_blocked_read(ring: Ring) -> None:
    rfd, wfd = os.pipe()
    try:
        buf = bytearray(10)
        fut = ring._op(lib.IORING_OP_READ, rfd, keep=buf,
                       addr=buffer_address(buf),
                       length=10, offset=-1 & 0xFFFF_FFFF_FFFF_FFFF)
        await asyncio.sleep(0.05)
        assert not fut.done()
        ud = ring._next_ud - 1
        assert await ring.cancel(ud) == 0
        assert await fut == -errno.ECANCELED
    finally:
        os.close(rfd)
        os.close(wfd)


async def test_close_with_io_in_flight_settles_everything() -> None:
    ring = Ring(16)
    rfd, wfd = os.pipe()
    try:
        pending = [asyncio.ensure_future(ring.read(rfd, bytearray(8), -1 & (2**64 - 1)))
                   for _ in range(4)]
        await asyncio.sleep(0.05)
        ring.close()
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, OSError) and r.errno == errno.ECANCELED for r in results)
        assert ring.in_flight == 0
        with pytest.raises(RuntimeError):
            await ring.nop()
    finally:
        os.close(rfd)
        os.close(wfd)


async def test_close_keeps_the_buffers_of_operations_the_kernel_still_holds() -> None:
    """Past its timeout, close gives up waiting for the kernel, which may
    still write into the buffers of what it holds (an uncancellable ublk
    command, a read stuck in a device): those buffers are kept for the
    life of the process, with a log line, never freed for reuse."""
    import gc
    import weakref

    from structlog.testing import capture_logs

    class Buf(bytearray):  # (a bytearray cannot be weakly referenced)
        pass

    ring = Ring(16)
    rfd, wfd = os.pipe()
    try:
        buf = Buf(8)
        kept = weakref.ref(buf)
        fut = ring._op(lib.IORING_OP_READ, rfd, keep=buf, addr=buffer_address(buf),
                       length=8, offset=-1 & 0xFFFF_FFFF_FFFF_FFFF)
        await asyncio.sleep(0.05)
        with capture_logs() as logs:
            ring.close(timeout=0)  # no time to see the cancel complete
        assert fut.done()
        del buf, fut
        gc.collect()
        assert kept() is not None, "a buffer the kernel may still write was freed"
        assert [e["event"] for e in logs] == ["ring closed with operations in the kernel: "
                                              "their buffers are kept"], logs
        assert logs[0]["n"] == 1
    finally:
        os.close(rfd)
        os.close(wfd)


async def test_current_ring_is_per_thread(ring: Ring) -> None:
    assert current_ring() is ring
    seen: list[object] = []

    def other() -> None:
        try:
            current_ring()
        except RuntimeError as e:
            seen.append(e)

    await asyncio.get_running_loop().run_in_executor(None, other)
    assert isinstance(seen[0], RuntimeError)


async def test_uring_cmd_area_limits(ring: Ring, datafile: int) -> None:
    with pytest.raises(OSError):
        ring.prep_cmd(-1, 0, bytes(17))  # a 64-byte SQE holds 16 command bytes
    assert await ring.uring_cmd(datafile, 0, bytes(16)) == -errno.EOPNOTSUPP
    big = Ring(8, sqe128=True)
    try:
        # a regular file has no uring_cmd: the kernel answers, not the ring
        fd = datafile
        try:
            assert await big.uring_cmd(fd, 0, bytes(80)) == -errno.EOPNOTSUPP
        finally:
            pass
    finally:
        big.close()


async def test_many_task_work_items_from_one_wakeup(ring: Ring) -> None:
    """Many completions arriving together (200 timers expiring at once) all
    reach their awaiters. With DEFER_TASKRUN the kernel runs at most 20
    task-work items per enter and signals the eventfd only on the first, so
    the ring keeps entering until IORING_SQ_TASKRUN is clear; the lost wake-up
    this prevents showed up with ublk (tests/targets/test_kernel_targets.py,
    delete under I/O), not with timers on this kernel."""
    from aioublk._uring import ffi

    ts = ffi.new("struct __kernel_timespec *", {"tv_sec": 0, "tv_nsec": 50_000_000})
    loop = asyncio.get_running_loop()
    futs = []
    for _ in range(200):
        fut: asyncio.Future[int] = loop.create_future()
        ring.prep(lib.IORING_OP_TIMEOUT, -1, addr=int(ffi.cast("uintptr_t", ts)), length=1,
                  handler=fut, keep=ts)
        futs.append(fut)
    done = await asyncio.wait_for(asyncio.gather(*futs), timeout=10)
    assert done == [-errno.ETIME] * 200


async def test_cqe32_ring_reaps_res_and_flags(datafile: int) -> None:
    """A ring of 32-byte CQEs (NVMe passthrough) still hands each completion's
    result to its awaiter: the reap walks the CQ at the ring's CQE size."""
    big = Ring(8, sqe128=True, cqe32=True)
    try:
        assert big.flags & lib.IORING_SETUP_CQE32
        assert await big.uring_cmd(datafile, 0, bytes(80)) == -errno.EOPNOTSUPP
        buf = bytearray(4096)
        await big.write(datafile, b"x" * 4096, 0)
        assert await big.read(datafile, buf, 0) == 4096 and buf == b"x" * 4096
        assert [await big.nop() for _ in range(20)] == [0] * 20
    finally:
        big.close()


@pytest.mark.asyncio
async def test_the_ring_keeps_its_data_plane_alive_until_it_closes() -> None:
    """C writes into memory the DataPlane object owns (its counters): a
    driver dropping its reference must not free that under the ring."""
    import gc
    import weakref

    from aioublk.dataplane.plane import DataPlane

    ring = Ring(8)
    dp = DataPlane(ring, {"char_fd": -1, "nr_queues": 1, "depth": 1, "max_io": 4096}, 1,
                   lambda ud, res, flags: None)
    alive = weakref.ref(dp)
    del dp
    gc.collect()
    assert alive() is not None
    ring.close()
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="ring is closed"):
        ring.attach(DataPlane.__new__(DataPlane))


def registered_files(ring: Ring) -> list[str]:
    """The files in ``ring``'s file table, as the kernel lists them."""
    info = Path(f"/proc/self/fdinfo/{lib.aur_ring_fd(ring.raw)}").read_text().splitlines()
    start = next(i for i, line in enumerate(info) if line.startswith("UserFiles:"))
    files = []
    for line in info[start + 1:]:
        head, _, name = line.strip().partition(": ")
        if not head.isdigit():
            break
        files.append(name)
    return files


async def test_a_fixed_file_serves_its_fd_through_the_table(tmp_path: Path) -> None:
    """Once fixed, SQEs on the fd name the table's slot: the file read is
    the registered one even after the fd number is made another file's."""
    ring = Ring(16, flags=lib.IORING_SETUP_SINGLE_ISSUER)
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"A" * 4096)
    second.write_bytes(b"B" * 4096)
    fd = os.open(first, os.O_RDONLY)
    other = os.open(second, os.O_RDONLY)
    try:
        slot = lib.aur_fix_file(ring.raw, fd)
        assert slot >= 0 and lib.aur_fix_file(ring.raw, fd) == slot  # (once)
        assert registered_files(ring) == [str(first)]
        os.dup2(other, fd)  # the number is now the second file's
        buf = bytearray(4096)
        assert await ring.read(fd, buf, 0) == 4096 and buf == b"A" * 4096
        lib.aur_unfix_files(ring.raw, -1)
        assert registered_files(ring) == []
        assert await ring.read(fd, buf, 0) == 4096 and buf == b"B" * 4096
    finally:
        ring.close()
        os.close(fd)
        os.close(other)


async def test_a_ring_with_its_own_table_fixes_nothing(datafile: int) -> None:
    ring = Ring(16, flags=lib.IORING_SETUP_SINGLE_ISSUER)
    try:
        ring.register_files([datafile])
        assert lib.aur_fix_file(ring.raw, datafile) == -1
    finally:
        ring.close()
