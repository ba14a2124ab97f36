"""C owns the worker's wait (``aioublk.dataplane.cwait``, dataplane/csrc/uvhook.c).

A worker's shape on its own thread: a uvloop loop, a ring and a data plane
whose wait the loop's prepare hook hands to C. Its setup asks C to idle a
minute in each reap (``idle_us``), as the older way would: every test below
would wait that minute if anything but the hook ended C's wait."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from aioublk._uring import lib
from aioublk.dataplane.maps import Linear
from aioublk.dataplane.plane import EV_IO, EV_TAG, encode
from aioublk.kernel import uapi
from aioublk.ring import Ring
from tests.dataplane.test_crossloop import IDLE, WAIT, UvloopThread, asleep_in_io_uring, wait_until
from tests.dataplane.test_hostile_kernel import Plane


class HookedWorker(UvloopThread):
    """A thread running a uvloop loop whose data plane owns its wait; C
    serves reads from an empty pipe (``backing``), so a request it takes
    stays C's until the test writes the pipe."""

    def __init__(self) -> None:
        self.backing = os.pipe()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.plane: Plane | None = None
        self.tid = 0
        self.loop_errors: list[dict[str, Any]] = []
        self.start()

    async def _main(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        plane = self.plane = Plane(Ring(16), -1, map=Linear(self.backing[0]), setup=IDLE,
                                   own_wait=True)
        self._stop = loop.create_future()
        self.tid = threading.get_native_id()
        self._up.set()
        try:
            await self._stop
        finally:
            plane.close()

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` on the worker's loop, through the plain
        ``call_soon_threadsafe`` (no kick of aioublk's own)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def sleeping_in_c(self) -> bool:
        return asleep_in_io_uring(self.tid)

    def stop(self) -> None:
        if self._stop is not None:
            self.call(self._stop.set_result, None)
        self.thread.join(WAIT)
        assert not self.thread.is_alive() and self.error is None, self.error
        for fd in self.backing:
            os.close(fd)


@pytest.fixture
def worker() -> Any:
    w = HookedWorker()
    try:
        yield w
    finally:
        w.stop()


def test_the_data_plane_owns_a_uvloop_loops_wait(worker: HookedWorker) -> None:
    assert worker.plane is not None and worker.plane.dp.owns_wait


def test_an_idle_worker_sleeps_in_io_uring_not_in_epoll(worker: HookedWorker) -> None:
    """With nothing to do, the thread sleeps where C can serve the next
    request without a loop turn: in io_uring_enter."""
    wait_until(worker.sleeping_in_c, "the worker to sleep in io_uring_enter")


def test_call_soon_threadsafe_ends_cs_wait(worker: HookedWorker) -> None:
    """The loop's own wake-up (uvloop's, not aioublk's kick) reaches C."""
    wait_until(worker.sleeping_in_c, "the worker to sleep in C")
    ran = threading.Event()
    worker.call(ran.set)
    assert ran.wait(WAIT), "the call waited for C's idle timeout"
    wait_until(worker.sleeping_in_c, "the worker to sleep in C again")


def test_a_loop_timer_ends_cs_wait_when_it_is_due(worker: HookedWorker) -> None:
    """C waits only until the loop's next timer: a timer set while C sleeps
    runs, and C sleeps again after it."""
    wait_until(worker.sleeping_in_c, "the worker to sleep in C")
    fired = threading.Event()
    assert worker.loop is not None
    worker.call(worker.loop.call_later, 0.2, fired.set)
    assert fired.wait(WAIT), "the timer waited for C's idle timeout"
    wait_until(worker.sleeping_in_c, "the worker to sleep in C again")


def test_a_reader_added_to_the_loop_ends_cs_wait(worker: HookedWorker) -> None:
    """An fd the loop starts watching (libuv arms it in its own poll, after
    the hook) wakes it from C when it becomes readable."""
    r, w = os.pipe()
    try:
        got = threading.Event()
        assert worker.loop is not None
        loop = worker.loop

        def on_readable() -> None:
            os.read(r, 1)
            got.set()

        worker.call(loop.add_reader, r, on_readable)
        wait_until(worker.sleeping_in_c, "the worker to sleep in C")
        os.write(w, b"x")
        assert got.wait(WAIT), "the reader waited for C's idle timeout"
        worker.call(loop.remove_reader, r)
        wait_until(worker.sleeping_in_c, "the worker to sleep in C again")
    finally:
        os.close(r)
        os.close(w)


def test_c_serves_while_it_owns_the_wait_and_python_gets_its_records(
        worker: HookedWorker) -> None:
    """A request C takes completes in C's wait; its commit's answer (a
    record, here -EOPNOTSUPP from the pipe that plays /dev/ublkcN) reaches
    Python through what the wait kept for it."""
    plane = worker.plane
    assert plane is not None
    worker.call(plane.fetch, 0, uapi.Op.READ, 8)
    wait_until(lambda: plane.dp.inflight == 1 and worker.sleeping_in_c(),
               "C to hold the read and sleep")
    assert not plane.events
    os.write(worker.backing[1], bytes(4096))  # the read completes; C commits it
    wait_until(lambda: bool(plane.events), "the commit's record to reach Python")
    assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]
    assert plane.dp.counts[0].c_served == 1 and plane.dp.counts[0].py_handed == 0


def test_a_completion_signalled_when_c_cannot_wait_still_wakes_the_loop(
        worker: HookedWorker) -> None:
    """C's wait takes the ring's eventfd signal first; when it then finds no
    SQE for its poll on the loop's epoll (the SQ full, the kernel refusing
    submissions), it must signal again what the CQ holds, or the loop sleeps
    in epoll through a completion that already came. Here the ring's fd
    briefly names /dev/null, so every io_uring_enter fails and the SQ stays
    full; a record for Python completes in the loop turn's last callback."""
    plane = worker.plane
    assert plane is not None
    ring = plane.ring
    assert not ring.flags & lib.IORING_SETUP_SINGLE_ISSUER  # (it enters by its fd)
    ring_fd = lib.aur_ring_fd(ring.raw)
    saved, null = os.dup(ring_fd), os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    refused = threading.Event()

    def complete_then_refuse() -> None:
        # (C's prepare hook runs next: it submits what the SQ holds, so the
        # NOP goes now, and the SQ is full before the hook)
        assert lib.aur_prep(ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0,
                            encode(EV_TAG, 0, 3)) == 0
        assert lib.aur_submit(ring.raw) == 1
        os.dup2(null, ring_fd, inheritable=False)
        while lib.aur_prep(ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0, 0) == 0:
            pass
        refused.set()

    try:
        wait_until(worker.sleeping_in_c, "the worker to sleep in C")
        worker.call(complete_then_refuse)
        assert refused.wait(WAIT), f"the callback failed: {worker.loop_errors}"
        wait_until(lambda: bool(plane.events), "the loop to take a completion already signalled")
        assert plane.events == [(EV_TAG, 3, 0, 0)]
    finally:
        os.dup2(saved, ring_fd, inheritable=False)
        os.close(saved)
        os.close(null)


def test_aioublk_own_wait_0_keeps_the_older_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The knob bench.mixed compares the two waits with."""
    monkeypatch.setenv("AIOUBLK_OWN_WAIT", "0")
    w = HookedWorker()
    try:
        assert w.plane is not None and not w.plane.dp.owns_wait
    finally:
        w.stop()


def test_closing_the_ring_gives_the_hook_back_cleanly() -> None:
    """The worker closes its ring, then its loop: uvloop's close finds the
    hook's handle closed, and nothing is reported."""
    w = HookedWorker()
    w.stop()
    assert not w.loop_errors


@pytest.mark.asyncio
async def test_a_loop_c_cannot_read_keeps_the_older_wait() -> None:
    """Not a uvloop loop: C polls in its reaps, as before."""
    loop = asyncio.get_running_loop()
    ring = Ring(16)
    r, w = os.pipe()
    try:
        plane = Plane(ring, -1, map=Linear(r), own_wait=True)
        try:
            import uvloop
            assert plane.dp.owns_wait == isinstance(loop, uvloop.Loop)
        finally:
            plane.close()
    finally:
        os.close(r)
        os.close(w)
