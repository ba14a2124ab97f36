"""The C data plane's edges, on a real ring but without a device: the test
plays the kernel. It writes a queue's descriptors, "fetches" a tag by
posting a NOP whose user_data is that tag's fetch, and sends the commands
C queues for /dev/ublkcN to a pipe, which refuses each one (EOPNOTSUPP): a
request's commit comes back as a record of its tag with that result."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioublk._uring import ffi, lib
from aioublk.dataplane.extents import ExtentTable
from aioublk.dataplane.maps import Extents, Linear, Map, Striped
from aioublk.dataplane.plane import EV_COMMIT, EV_FETCH, EV_IO, EV_RETRY, DataPlane, decode, encode
from aioublk.errors import UblkError
from aioublk.kernel import uapi
from aioublk.queue.options import DeviceConfig
from aioublk.ring import Ring
from tests.ring.test_ring import registered_files


class Plane:
    """A data plane serving queue 0 (``depth`` tags of ``max_io`` bytes)
    from ``backing``, its commands going to a pipe; ``setup``: more of its
    setup fields (``poll_us``, ``idle_us``); ``own_wait``: C waits in the
    loop's hook (``cwait``), not in each reap."""

    def __init__(self, ring: Any, backing: int, *, depth: int = 4, max_io: int = 4096,
                 mode: int = 0, batch: int = 0, map: Map | None = None,
                 poll_us: int = 0, setup: dict[str, int] | None = None,
                 copy_in: bool = False, own_wait: bool = False) -> None:
        self.ring = ring
        self.pipe = os.pipe()
        self.max_io = max_io
        self.copy_in = copy_in
        self._fetcher: Any = None  # batch: the socket pair that plays the multishot fetch
        self.events: list[tuple[int, int, int, int]] = []  # kind, tag, aux, res
        self.descs = bytearray(depth * uapi.IO_DESC.size)
        self.bufs = mmap.mmap(-1, depth * max_io)
        self.dp = DataPlane(ring, {
            # copy_in: the pipe's read end, which -u writes copy their data in
            # from (the test writes it to pipe[1]); nothing can be copied out
            "char_fd": self.pipe[0 if copy_in else 1], "batch": batch, "mode": mode, "nr_queues": 1,
            "depth": depth, "max_io": max_io,
            "op_fetch_req": uapi.IoCmd.FETCH_REQ,
            "op_commit_and_fetch": uapi.IoCmd.COMMIT_AND_FETCH_REQ,
            "op_register_buf": uapi.IoCmd.REGISTER_IO_BUF,
            "op_unregister_buf": uapi.IoCmd.UNREGISTER_IO_BUF,
            "op_commit_io_cmds": uapi.IoCmd.COMMIT_IO_CMDS,
            "fetch_buf_bytes": 2 * depth, "fetch_buf_entries": 8, "poll_us": poll_us,
            **(setup or {}),
        }, 1, self._on_event, own_wait=own_wait)
        self._views = (ffi.from_buffer(self.descs), ffi.from_buffer(self.bufs))
        lib.aur_dp_queue(self.dp.c, 0, 0, self._views[0], self._views[1], self.dp.counts)
        for tag in range(depth):
            lib.aur_dp_buf_index(self.dp.c, 0, tag, tag)
        self.dp.set_map(map or Linear(backing))

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        kind, _local, tag, aux = decode(ud)
        self.events.append((kind, tag, aux, res))

    def fetch(self, tag: int, op: int, sectors: int, start: int = 0) -> None:
        """The kernel hands ``tag`` a request (per-I/O path)."""
        uapi.IO_DESC.pack_into(self.descs, tag * uapi.IO_DESC.size, op, sectors, start, 0)
        assert lib.aur_prep(self.ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0,
                            encode(EV_IO, 0, tag)) == 0
        self.ring.submit_now()

    def fetch_batch(self, tag: int, op: int, sectors: int, start: int = 0,
                    times: int = 1) -> None:
        """The kernel hands ``tag`` a request (batch path): a receive that
        selects one of the queue's fetch buffers, as a multishot fetch does,
        takes the tag (``times`` times in one completion) from a socket. Its
        CQE ends (no MORE), so it comes back as an EV_FETCH record too."""
        import socket

        uapi.IO_DESC.pack_into(self.descs, tag * uapi.IO_DESC.size, op, sectors, start, 0)
        if self._fetcher is None:
            assert lib.aur_dp_provide(self.dp.c, 0) == 0
            self._fetcher = socket.socketpair()
        assert lib.aur_prep(self.ring.raw, 27, self._fetcher[1].fileno(), 0, 2 * times,  # RECV
                            0, 0, 0, lib.IOSQE_BUFFER_SELECT, encode(EV_FETCH, 0, 0)) == 0
        self.ring.submit_now()
        self._fetcher[0].send(tag.to_bytes(2, "little") * times)

    async def write(self, tag: int, dev: int, body: bytes) -> None:
        """The kernel hands ``tag`` a write of ``body`` at byte ``dev`` (per-I/O
        path), its data where the mode has it (copy_in: coming through the
        pipe), and the first record comes back."""
        if self.copy_in:
            os.write(self.pipe[1], body)
        else:
            self.buf(tag)[:len(body)] = body
        self.events.clear()
        self.fetch(tag, uapi.Op.WRITE, len(body) >> 9, dev >> 9)
        await self.wait_for(lambda: self.events)

    def buf(self, tag: int) -> memoryview:
        return memoryview(self.bufs)[tag * self.max_io:(tag + 1) * self.max_io]

    async def wait_for(self, pred: Any, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not pred():
            assert loop.time() < deadline, f"timed out; records: {self.events}"
            lib.aur_wait(self.ring.raw, 20)
            self.ring.reap_now()
            await asyncio.sleep(0)

    def close(self) -> None:
        self.ring.close()
        for v in self._views:
            ffi.release(v)
        self.bufs.close()
        for fd in self.pipe:
            os.close(fd)
        for sock in self._fetcher or ():
            sock.close()


@pytest.fixture
def backing(tmp_path: Path) -> Any:
    fd = os.open(tmp_path / "backing", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 64 << 20)
    yield fd
    os.close(fd)


# -- defect: the user_data aux field (a piece's sectors) spilling into the tag --

@pytest.mark.parametrize("size", [0, 512, 32 << 20, 64 << 20])
def test_max_io_size_the_encoding_cannot_hold_is_refused_in_one_line(size: int) -> None:
    """A piece's length rides in 16 bits of user_data as sectors: a larger
    request would complete the wrong tag, so such sizes are refused up front."""
    with pytest.raises(UblkError, match="max_io_size") as e:
        DeviceConfig(max_io_size=size).validate()
    assert "\n" not in str(e.value)


def test_the_largest_max_io_size_is_accepted() -> None:
    from aioublk.queue.options import MAX_IO_SIZE

    assert MAX_IO_SIZE >> 9 <= lib.AUR_DP_MAX_SECTORS and MAX_IO_SIZE % mmap.PAGESIZE == 0
    DeviceConfig(max_io_size=MAX_IO_SIZE).validate()


@pytest.mark.parametrize("fields", [(EV_IO, 0, 0, 0), (EV_FETCH, 3, 4095, 8),
                                    (0x7F, 0xFFFF, 0xFFFF, lib.AUR_DP_MAX_SECTORS)])
def test_encode_is_decodes_inverse(fields: tuple[int, int, int, int]) -> None:
    """Every field at its widest too: none spills into the next or the mark."""
    ud = encode(*fields)
    assert decode(ud) == fields and ud >> lib.AUR_DP_UD_MARK_SHIFT == 1


@pytest.mark.asyncio
async def test_the_data_plane_refuses_a_max_io_it_cannot_encode(backing: int) -> None:
    ring = Ring(16)
    try:
        with pytest.raises(OSError) as e:
            Plane(ring, backing, max_io=32 << 20)
        assert e.value.errno == errno.EINVAL
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_the_largest_request_commits_its_own_tag(backing: int) -> None:
    """A read of the largest size (its sectors fill the 16-bit field) is
    served by C and committed on its own tag, counted in full."""
    from aioublk.queue.options import MAX_IO_SIZE
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=MAX_IO_SIZE)
    try:
        plane.fetch(0, uapi.Op.READ, MAX_IO_SIZE >> 9)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]  # the commit, on tag 0
        c = plane.dp.counts[0]
        assert (c.ios, c.bytes, c.errors) == (1, MAX_IO_SIZE, 0)
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_request_longer_than_max_io_is_left_to_python(backing: int) -> None:
    """The kernel never sends more than max_io; if a descriptor says so
    anyway, C does not serve it (its buffer is max_io, its length would not
    fit the field): the request goes to Python as fetched."""
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=4096)
    try:
        plane.fetch(1, uapi.Op.READ, 65536)  # 32 MiB: 1 << 16 sectors
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 1, 0, 0)]
        assert plane.dp.inflight == 0
    finally:
        plane.close()


# -- who served: the counters behind list --stats' C share ---------------------

@pytest.mark.asyncio
async def test_a_hit_counts_as_c_served_a_miss_and_a_retry_as_handed_to_python(
        backing: int) -> None:
    """A read of a published granule is C's from fetch to commit; one of an
    unpublished granule goes to Python as fetched, and one whose backend
    read comes up short (its host offset past the file's end) goes to Python
    as a retry. Only the hit and the retry, which C started, wake Python
    for C's sake."""
    from aioublk.dataplane.extents import ExtentTable
    from aioublk.dataplane.maps import Extents
    from aioublk.dataplane.plane import EV_RETRY
    from aioublk.queue.driver import QueueStats
    from aioublk.ring import Ring

    table = ExtentTable(4096, max_entries=16)
    table.insert(0, 4096, backing, 0, writable=True)
    table.insert(8192, 4096, backing, 1 << 30, writable=True)  # the file is 64 MiB
    ring = Ring(16)
    plane = Plane(ring, backing, map=Extents(table))
    c = plane.dp.counts[0]
    try:
        plane.fetch(0, uapi.Op.READ, 8, start=0)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]  # C committed it
        assert (c.started, c.c_served, c.py_handed) == (1, 1, 0)
        assert c.wakes >= 1
        wakes = c.wakes

        plane.fetch(1, uapi.Op.READ, 8, start=8)  # granule 1: not published
        await plane.wait_for(lambda: len(plane.events) > 1)
        assert plane.events[1] == (EV_IO, 1, 0, 0)  # as fetched: Python's
        assert (c.started, c.c_served, c.py_handed) == (2, 1, 1)
        assert c.wakes == wakes

        plane.fetch(2, uapi.Op.READ, 8, start=16)
        await plane.wait_for(lambda: len(plane.events) > 2)
        assert plane.events[2] == (EV_RETRY, 2, 0, -errno.EIO)
        assert (c.started, c.c_served, c.py_handed) == (3, 1, 2)
        assert c.wakes > wakes
        assert c.ios == 1 and plane.dp.inflight == 0  # Python answers the other two
        assert table.busy(0, 3 * 4096) == 0
        st = QueueStats(c)
        assert (st.c_served, st.py_handed, st.wakes, st.poll_timeouts) == \
            (1, 2, c.wakes, 0)
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_wait_for_more_that_times_out_is_counted() -> None:
    """C waits poll_us for the backend read it started (a pipe: nothing to
    read yet) and gives the thread back to Python: one poll timeout. Once the
    data is there the request is still C's."""
    from aioublk.ring import Ring

    r, w = os.pipe()
    ring = Ring(16)
    plane = Plane(ring, r, map=Linear(r), poll_us=1000)
    c = plane.dp.counts[0]
    try:
        plane.fetch(0, uapi.Op.READ, 8)
        await plane.wait_for(lambda: c.poll_timeouts >= 1)
        assert not plane.events and (c.c_served, c.py_handed) == (0, 0)
        assert c.wakes >= 1
        os.write(w, bytes(4096))
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]
        assert (c.c_served, c.py_handed) == (1, 0)
    finally:
        plane.close()
        os.close(r)
        os.close(w)


# -- defect: a commit that cannot be queued was forgotten ---------------------

class Owner:
    """The thread a SINGLE_ISSUER ring belongs to: only it may submit. Any
    other thread's submit fails (EEXIST), so from the test's thread the SQ
    cannot drain, as when the kernel refuses a submit; the owner drains it
    when the test says so."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]] | None] = \
            queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, out = job
            out.put(fn())

    def __call__(self, fn: Callable[[], Any]) -> Any:
        out: queue.Queue[Any] = queue.Queue()
        self._jobs.put((fn, out))
        return out.get(timeout=10)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)


def _fill_sq(ring: Any) -> None:
    """NOPs until the SQ is full (from this thread, the submit that would
    make room fails)."""
    for _ in range(64):
        if lib.aur_prep(ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0, 1) < 0:
            return
    raise AssertionError("the SQ never filled: a submit from this thread worked")


def _reap(plane: Plane, owner: Owner, rounds: int = 20) -> None:
    for _ in range(rounds):
        owner(lambda: lib.aur_submit(plane.ring.raw))
        lib.aur_wait(plane.ring.raw, 10)
        plane.ring.reap_now()


@pytest.mark.parametrize("batch", [0, 1], ids=["per-io", "batch"])
def test_a_commit_the_sq_cannot_take_is_sent_later(batch: int, backing: int) -> None:
    """Python answers a request while the SQ is full and will not drain:
    the answer is kept and sent once there is room, never dropped (the
    request would wait for it forever)."""
    from aioublk.ring import Ring

    loop = asyncio.new_event_loop()
    owner = Owner()
    ring = owner(lambda: Ring(4, flags=lib.IORING_SETUP_SINGLE_ISSUER, loop=loop))
    plane = Plane(ring, backing, batch=batch)
    try:
        _fill_sq(ring)
        lib.aur_dp_answer(plane.dp.c, 0, 2, 4096)
        lib.aur_dp_flush(plane.dp.c)
        _reap(plane, owner)
        want = EV_COMMIT if batch else EV_IO
        assert [e for e in plane.events if e[0] == want and e[1] == 2], plane.events
    finally:
        owner(plane.close)
        owner.stop()
        loop.close()


@pytest.mark.asyncio
async def test_c_takes_no_more_backend_io_than_the_cq_holds(backing: int) -> None:
    """Every operation C has in flight completes into the CQ: a request
    whose pieces the CQ could not hold besides each tag's command is left
    to Python instead of overflowing it."""
    from aioublk.ring import Ring

    ring = Ring(8)  # a CQ of 16: 4 tags' commands and 12 more
    plane = Plane(ring, backing, depth=4, max_io=8192, map=Striped([backing], 512))
    try:
        plane.fetch(1, uapi.Op.READ, 8)  # 8 pieces: C serves it
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 1, 0, -errno.EOPNOTSUPP)]
        plane.fetch(2, uapi.Op.READ, 16)  # 16 pieces: more than the CQ has room for
        await plane.wait_for(lambda: len(plane.events) > 1)
        assert plane.events[1] == (EV_IO, 2, 0, 0)
    finally:
        plane.close()


# -- defect: a -z chain split across two submissions ---------------------------

def test_a_zero_copy_chain_is_queued_whole_or_not_at_all(backing: int) -> None:
    """-z serves a request as one hard-linked chain (register, pieces,
    unregister), and io_uring does not carry a link across submissions:
    the unregister could run before the register. C starts a chain only
    when all of it fits in the SQ; here the SQ cannot drain (see Owner),
    so the request goes to Python whole, and no part of a chain is left
    queued."""
    from aioublk.ring import Ring

    loop = asyncio.new_event_loop()
    owner = Owner()
    ring = owner(lambda: Ring(8, flags=lib.IORING_SETUP_SINGLE_ISSUER, loop=loop))
    plane = Plane(ring, backing, mode=lib.AUR_DP_ZERO_COPY, map=Striped([backing], 512))

    def fetch() -> None:  # (from the owner, so that it reaches the kernel)
        plane.fetch(1, uapi.Op.READ, 4)  # 4 pieces: a chain of 6

    try:
        owner(fetch)
        for _ in range(4):  # 4 of the SQ's 8 entries taken
            assert lib.aur_prep(ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0, 1) == 0
        lib.aur_wait(ring.raw, 1000)
        ring.reap_now()
        assert lib.aur_pending_sqes(ring.raw) == 4, "part of a chain was queued"
        assert plane.events == [(EV_IO, 1, 0, 0)]  # Python's, as fetched
        assert plane.dp.inflight == 0
    finally:
        owner(plane.close)
        owner.stop()
        loop.close()


# -- defect: the fetch buffers freed while the kernel may still write them ----

def _armed_select_after_close() -> bytes:
    """A batch data plane's fetch-buffer group, with an operation armed on
    it that selects a buffer when data comes (a multishot fetch does so
    when a request comes); the ring outlives its close (a second fd holds
    it, as the kernel's teardown of it does for a while). Then the data
    comes: what is left of it in the socket is returned."""
    import socket

    from aioublk.ring import Ring

    async def main() -> bytes:
        ring = Ring(16)
        a, b = socket.socketpair()
        null = os.pipe()
        try:
            dp = DataPlane(ring, {
                "char_fd": null[1], "batch": 1, "nr_queues": 1, "depth": 2, "max_io": 4096,
                # a buffer ring the allocator maps alone (see the caller), 2-byte buffers
                "fetch_buf_bytes": 2, "fetch_buf_entries": 32768}, 1, lambda *a: None)
            assert lib.aur_dp_provide(dp.c, 0) == 0
            assert lib.aur_prep(ring.raw, 27, b.fileno(), 0, 2, 0, 0, 0,  # IORING_OP_RECV, group 0
                                lib.IOSQE_BUFFER_SELECT, encode(EV_FETCH, 0, 0)) == 0
            ring.submit_now()
            alive = os.dup(lib.aur_ring_fd(ring.raw))
            ring.close()
            a.send(b"0123456789")
            left = b.recv(100, socket.MSG_DONTWAIT)
            os.close(alive)
            return left
        finally:
            ring.close()
            a.close()
            b.close()
            for fd in null:
                os.close(fd)

    return asyncio.run(main())


def test_fetch_buffers_are_not_freed_while_the_kernel_may_select_them() -> None:
    """Closing a ring whose fetches are armed freed their buffer ring and
    buffers at once, while the kernel could still pick a buffer and write
    fetched tags into freed memory. Here glibc maps the buffer ring alone
    (MALLOC_MMAP_THRESHOLD_), so its pages, still pinned by the kernel,
    keep their entries after the free, and the buffers are ordinary heap:
    a buffer picked after the close is written in freed memory, which the
    lost bytes show. The data plane now withdraws the group before the
    ring's exit: nothing is picked, nothing is lost."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, "-c", "from tests.dataplane.test_hostile_kernel import "
         "_armed_select_after_close as f; print(f())"],
        cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == repr(b"0123456789"), "the kernel wrote into freed buffers"


# -- defect: a tag fetched again while C serves it -------------------------------

@pytest.mark.asyncio
async def test_a_tag_fetched_again_while_c_serves_it_is_dropped_and_counted(
        backing: int) -> None:
    """A fetch's tags are the kernel's bytes. One that C is serving already
    (its backend read in flight) cannot be the kernel's to hand out: taken
    again, C started the request twice over its own state, and the tag's
    count of pieces wrapped, so the request never ended and the data plane
    never went idle. It is dropped and counted; the request ends once."""
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, batch=1)
    try:
        plane.fetch_batch(1, uapi.Op.READ, 8, times=2)  # one completion: tag 1, twice
        await plane.wait_for(lambda: (EV_COMMIT, 1, 0, -errno.EOPNOTSUPP) in plane.events)
        await plane.wait_for(lambda: plane.dp.inflight == 0, timeout=1.0)
        c = plane.dp.counts[0]
        assert (c.started, c.c_served, c.py_handed, c.kernel_bad) == (1, 1, 0, 1)
    finally:
        plane.close()


# -- an extent table's ZERO granules: zeros without backend I/O -------------------

G4 = 4096  # the granule of these tests


def _zero_table(backing: int) -> ExtentTable:
    """Granules 0-1 ZERO, 2 data (the backing file's bytes at 8 KiB: 0x55)."""
    os.pwrite(backing, b"\x55" * G4, 2 * G4)
    t = ExtentTable(G4, max_entries=16)
    assert t.insert_zero(0, 2 * G4)
    assert t.insert(2 * G4, G4, backing, 2 * G4, writable=True)
    return t


@pytest.mark.asyncio
@pytest.mark.parametrize("batch", [0, 1], ids=["per-io", "batch"])
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
async def test_a_read_of_zero_granules_is_served_with_no_backend_io(
        backing: int, batch: int, user_copy: bool) -> None:
    """C serves a read of ZERO granules by zeroing the tag's buffer: it
    completes in full, holds nothing after, and needs no backend I/O (the
    zeros' pieces have no fd: an SQE on one would fail, and the request
    would come back to Python as a retry). With -u the zeros are in the
    buffer before the copy out: what reaches /dev/ublkcN (here the pipe) is
    zeros, never the buffer's old bytes. Beside data, the zeros and the
    data land each at its place."""
    from aioublk.ring import Ring

    table = _zero_table(backing)
    ring = Ring(16)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = Plane(ring, backing, depth=2, max_io=3 * G4, mode=mode, batch=batch,
                  map=Extents(table))
    fetch = plane.fetch_batch if batch else plane.fetch
    commit = (EV_COMMIT, 1, 0, -errno.EOPNOTSUPP) if batch else (EV_IO, 1, 0, -errno.EOPNOTSUPP)
    try:
        for tag, length, want in ((1, 2 * G4, bytes(2 * G4)),
                                  (1, 3 * G4, bytes(2 * G4) + b"\x55" * G4)):
            plane.buf(tag)[:] = b"\xaa" * (3 * G4)
            plane.events.clear()
            fetch(tag, uapi.Op.READ, length >> 9, 0)
            # (batch: the pipe refuses the element, and C fails the request
            # once more, which the pipe refuses again: aux 1)
            want_events = [commit, (EV_COMMIT, 1, 1, -errno.EOPNOTSUPP)] if batch else [commit]
            n = len(want_events)
            await plane.wait_for(lambda n=n: len([e for e in plane.events
                                                  if e[0] != EV_FETCH]) >= n)
            assert [e for e in plane.events if e[0] != EV_FETCH] == want_events
            if user_copy:
                assert os.read(plane.pipe[0], 4 * G4) == want   # what was copied out
            else:
                assert plane.buf(tag)[:length] == want
            assert plane.dp.inflight == 0 and table.busy(0, 3 * G4) == 0
        c = plane.dp.counts[0]
        if not batch:  # (batch: each answer was refused, and counted as the failure)
            assert (c.ios, c.bytes, c.errors) == (2, 5 * G4, 0)
    finally:
        plane.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["ZERO_COPY", "AUTO_ZC"])
async def test_zero_granules_are_pythons_in_the_zero_copy_modes(backing: int, mode: str) -> None:
    """In the zero-copy modes there is no buffer of C's to zero: a read that
    touches a ZERO granule goes to Python as fetched, holding nothing; one of
    data alone is still C's."""
    from aioublk.ring import Ring

    table = _zero_table(backing)
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=3 * G4, mode=getattr(lib, f"AUR_DP_{mode}"),
                  map=Extents(table))
    try:
        plane.fetch(0, uapi.Op.READ, (2 * G4) >> 9, G4 >> 9)   # zeros, then data
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, 0)]
        assert plane.dp.inflight == 0 and table.busy(0, 3 * G4) == 0
        plane.fetch(1, uapi.Op.READ, G4 >> 9, (2 * G4) >> 9)   # data alone: C's
        await plane.wait_for(lambda: len(plane.events) > 1)
        # (C took it, and a pipe has no buffers to register: a retry)
        assert plane.events[1][:2] == (EV_RETRY, 1)
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_write_to_zero_granules_is_pythons(backing: int) -> None:
    from aioublk.ring import Ring

    table = _zero_table(backing)
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=3 * G4, map=Extents(table))
    try:
        plane.fetch(0, uapi.Op.WRITE, (2 * G4) >> 9, G4 >> 9)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, 0)]
        assert plane.dp.inflight == 0 and table.busy(0, 3 * G4) == 0
    finally:
        plane.close()


# -- an extent table's ALLOC granules: C allocates from its slot's pool ---------

class _RecordsAtCommit(Plane):
    """A Plane that notes, as each record reaches Python, the allocation
    records waiting in ``table``: a commit must find its write's record."""

    def __init__(self, table: ExtentTable, *args: Any, **kw: Any) -> None:
        self.table = table
        self.log_at: list[int] = []
        super().__init__(*args, **kw)

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        self.log_at.append(self.table.stats()["log_n"])
        super()._on_event(ud, res, flags)


def _alloc_table(fd: int, pool: list[int], *, granules: int = 4) -> tuple[ExtentTable, int]:
    """ALLOC granules 0.. of 4 KiB, allocating in fd from one slot's pool."""
    t = ExtentTable(G4, max_entries=64)
    t.set_alloc(fd, 32, 32)
    slot = t.attach()
    assert t.pool_add(slot, pool) == len(pool)
    assert t.insert_alloc(0, granules * G4)
    return t, slot


@pytest.mark.asyncio
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
async def test_an_allocating_write_lands_in_the_pools_cluster_recorded_before_its_commit(
        backing: int, user_copy: bool) -> None:
    """A write to ALLOC granules is C's: its data goes to the clusters at the
    head of the plane's pool (two granules, two clusters apart on the host:
    two pieces), a record of each is in the table before the commit reaches
    anyone, c_alloc counts them, and the granules are data now (a read is
    C's, from there). With -u the data comes in from /dev/ublkcN first."""
    from aioublk.dataplane.extents import Record
    from aioublk.queue.driver import QueueStats
    from aioublk.ring import Ring

    table, slot = _alloc_table(backing, [40 * G4, 42 * G4, 44 * G4])
    ring = Ring(16)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = _RecordsAtCommit(table, ring, backing, depth=2, max_io=2 * G4, mode=mode,
                             map=Extents(table, slot=slot), copy_in=user_copy)
    data = os.urandom(2 * G4 - 1024)
    try:
        if user_copy:
            os.write(plane.pipe[1], data)     # what the kernel's copy in would read
        else:
            plane.buf(0)[:len(data)] = data
        plane.fetch(0, uapi.Op.WRITE, len(data) >> 9, (G4 + 512) >> 9)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]   # C committed it
        assert plane.log_at == [2]                                  # the records first
        assert table.drain() == [Record(1, 40 * G4, True, slot), Record(2, 42 * G4, True, slot)]
        assert os.pread(backing, G4 - 512, 40 * G4 + 512) == data[:G4 - 512]
        assert os.pread(backing, G4 - 512, 42 * G4) == data[G4 - 512:]
        c = plane.dp.counts[0]
        assert (c.c_alloc, QueueStats(c).c_alloc, c.c_served) == (2, 2, 1)
        assert table.pool_level(slot) == 1 and table.busy(0, 4 * G4) == 0
        assert table.lookup(G4, 2 * G4, write=True) == [(backing, 40 * G4, G4),
                                                       (backing, 42 * G4, G4)]
        if not user_copy:       # (copy_in: this plane cannot copy out)
            plane.fetch(1, uapi.Op.READ, 8, (G4 + 512) >> 9)        # now data: C reads it
            await plane.wait_for(lambda: len(plane.events) > 1)
            assert plane.events[1] == (EV_IO, 1, 0, -errno.EOPNOTSUPP)
            assert plane.buf(1)[:G4] == data[:G4]
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_held_write_is_handed_back_for_the_target_to_answer(backing: int) -> None:
    """A table that holds writes (a qcow2 image writing its metadata
    through): a write C served, allocating or in place, comes to Python as
    EV_HELD with its result once its data is written and its record pushed,
    and nothing is committed until Python answers; reads are C's to answer."""
    from aioublk.dataplane.extents import Record
    from aioublk.dataplane.plane import EV_HELD

    table, slot = _alloc_table(backing, [40 * G4])
    table.set_hold_writes(True)
    assert table.holds_writes
    plane = _RecordsAtCommit(table, Ring(16), backing, depth=2, max_io=G4,
                             map=Extents(table, slot=slot))
    body = os.urandom(G4)
    try:
        await plane.write(0, 0, body)
        assert plane.events == [(EV_HELD, 0, 0, G4)]   # not committed: Python's to answer
        assert plane.log_at == [1]                     # the record first
        assert table.drain() == [Record(0, 40 * G4, True, slot)]
        assert os.pread(backing, G4, 40 * G4) == body
        await plane.write(1, 512, b"w" * 512)          # in place now: held too
        assert plane.events == [(EV_HELD, 1, 0, 512)]
        c = plane.dp.counts[0]
        assert (c.c_served, c.c_alloc, c.py_handed, plane.dp.inflight) == (2, 1, 0, 0)
        plane.events.clear()
        assert lib.aur_dp_answer(plane.dp.c, 0, 0, G4) == 0  # the target's answer
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]
        plane.events.clear()
        plane.fetch(0, uapi.Op.READ, 8, 0)             # a read: C answers it
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]
        assert plane.buf(0)[:G4] == body[:512] + b"w" * 512 + body[1024:]
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_an_allocating_write_without_a_slot_is_pythons(backing: int) -> None:
    from aioublk.ring import Ring

    table, slot = _alloc_table(backing, [40 * G4])
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=2 * G4, map=Extents(table))
    try:
        plane.fetch(0, uapi.Op.WRITE, 8, 0)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, 0)]       # as fetched
        assert table.pool_level(slot) == 1 and plane.dp.counts[0].c_alloc == 0
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_failed_allocating_write_is_recorded_failed_and_retried_by_python(
        tmp_path: Path, backing: int) -> None:
    """The allocation fd refuses writes (opened read-only): the write fails,
    its request goes to Python as a retry, and the record says the cluster
    failed (the owner frees it); the granule reads as zeros again and the
    next write takes the next cluster."""
    from aioublk.ring import Ring

    ro = os.open(tmp_path / "backing", os.O_RDONLY)
    table, slot = _alloc_table(ro, [40 * G4, 41 * G4])
    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=2 * G4, map=Extents(table, slot=slot))
    try:
        plane.fetch(0, uapi.Op.WRITE, 8, 0)
        await plane.wait_for(lambda: plane.events)
        assert plane.events[0][:2] == (EV_RETRY, 0) and plane.events[0][3] < 0
        assert [(r.host_off, r.ok) for r in table.drain()] == [(40 * G4, False)]
        assert plane.dp.counts[0].c_alloc == 0 and table.busy(0, G4) == 0
        assert table.lookup(0, G4, write=False) == [(-1, 0, G4)]
        assert table.pool_take(slot) == [41 * G4]       # 40 is never handed out again
    finally:
        plane.close()
        os.close(ro)


@pytest.mark.asyncio
async def test_an_allocating_write_the_cq_cannot_hold_gives_its_clusters_back(
        backing: int) -> None:
    """A write C cannot take (more pieces than the CQ has room for) goes to
    Python as fetched, and what it allocated is UNUSED: every cluster back in
    the pool in its order, no record, the granules ALLOC again."""
    from aioublk.ring import Ring

    pool = [G4 * (100 + 2 * k) for k in range(16)]      # none adjacent: 16 pieces
    table, slot = _alloc_table(backing, pool, granules=16)
    ring = Ring(8)  # a CQ of 16: 4 tags' commands and 12 more
    plane = Plane(ring, backing, depth=4, max_io=16 * G4, map=Extents(table, slot=slot))
    try:
        plane.fetch(1, uapi.Op.WRITE, (16 * G4) >> 9, 0)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 1, 0, 0)]
        assert table.drain() == [] and table.stats()["unused"] == 16
        assert table.busy(0, 16 * G4) == 0 and plane.dp.counts[0].c_alloc == 0
        assert table.pool_take(slot) == pool
        assert table.lookup(0, 16 * G4, write=False) == [(-1, 0, 16 * G4)]
    finally:
        plane.close()


# -- the ring's file table: /dev/ublkcN and the map's files ------------------

@pytest.mark.asyncio
async def test_the_maps_files_and_the_char_fd_are_the_rings_fixed_files(
        tmp_path: Path) -> None:
    """C's SQEs name /dev/ublkcN (here a pipe) and the map's files by slot;
    a new map takes the old map's files out of the table, so a number
    reused for another file is never served from the old one."""
    paths = [tmp_path / "a", tmp_path / "b"]
    fds = []
    for p in paths:
        p.write_bytes(bytes(1 << 20))
        fds.append(os.open(p, os.O_RDWR))
    plane = Plane(Ring(16), fds[0])
    try:
        files = registered_files(plane.ring)
        assert len(files) == 2 and str(paths[0]) in files
        assert any(f.startswith("pipe:") for f in files)
        plane.dp.set_map(Linear(fds[1]))
        files = registered_files(plane.ring)
        assert len(files) == 2 and str(paths[1]) in files and str(paths[0]) not in files
        # (a read through the new map still reads its file)
        os.pwrite(fds[1], b"\x5a" * 4096, 0)
        plane.fetch(0, uapi.Op.READ, 8)
        await plane.wait_for(lambda: plane.dp.counts[0].c_served == 1)
        assert plane.buf(0)[:4096] == b"\x5a" * 4096
    finally:
        plane.close()
        for fd in fds:
            os.close(fd)
