"""Calls into a worker's loop from other threads (``aioublk.dataplane.crossloop``).

The first tests wake a loop whose thread waits inside the C data plane: a
real ring and data plane (test_hostile_kernel's ``Plane``) serving a read from
an empty pipe, so C holds a request and idles (``idle_us``, a minute) with
the GIL released. Only the kick's completion on that ring can end the wait
in time. The rest run ``call_on`` between two loops on two threads, each
watching its kick fd with a plain reader (neither thread ever waits in C)."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from aioublk.dataplane.crossloop import LoopHandle, call_on, run_in_thread
from aioublk.dataplane.maps import Linear
from aioublk.dataplane.plane import EV_IO
from aioublk.kernel import uapi
from aioublk.ring import Ring
from tests.dataplane.test_hostile_kernel import Plane

#: io_uring_enter's number (x86_64 and the generic table alike)
IO_URING_ENTER = 426
#: C's wait between requests: far longer than any test waits for a call
IDLE = {"poll_us": 1000, "idle_us": 60_000_000}
WAIT = 10.0  # seconds a condition may take before a test fails


def asleep_in_io_uring(tid: int) -> bool:
    """Thread ``tid`` of this process sleeps in io_uring_enter (the data
    plane's wait: its submits never sleep)."""
    task = Path(f"/proc/self/task/{tid}")
    try:
        syscall = (task / "syscall").read_text().split()
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return bool(syscall) and syscall[0] == str(IO_URING_ENTER) and state == "S"


def wait_until(pred: Callable[[], bool], what: str) -> None:
    """Block this (non-loop) thread until ``pred()``; fail after WAIT."""
    done = threading.Event()
    deadline = threading.Timer(WAIT, done.set)
    deadline.start()
    try:
        while not pred():
            assert not done.wait(0.001), f"timed out waiting for {what}"
    finally:
        deadline.cancel()


async def until(pred: Callable[[], bool], what: str) -> None:
    """Await (on a loop) until ``pred()``; fail after WAIT."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


class UvloopThread:
    """A uvloop loop on a thread of its own, running the subclass's
    ``_main()``; ``start`` returns once it set ``_up`` (or failed)."""

    error: BaseException | None = None
    _stop: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._up = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._up.wait(WAIT) and self.error is None, self.error

    async def _main(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
            self._up.set()
        finally:
            loop.close()


class IdleWorker(UvloopThread):
    """A worker's shape on its own thread: a loop, a ring with a data plane
    that serves a read from an empty pipe, and a ``LoopHandle`` watching its
    kick fd through that ring. After ``start`` the thread waits in C."""

    def __init__(self) -> None:
        self.pipe = os.pipe()
        self.handle: LoopHandle | None = None
        self.tid = 0
        self.plane: Plane | None = None
        self.start()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        ring = Ring(16)
        handle = self.handle = LoopHandle.new(loop)
        handle.watch(ring)
        plane = self.plane = Plane(ring, -1, map=Linear(self.pipe[0]), setup=IDLE)
        self._stop = loop.create_future()
        self.tid = threading.get_native_id()
        plane.fetch(0, uapi.Op.READ, 8)  # its eventfd wakes the loop: C serves, then idles
        self._up.set()
        try:
            await self._stop
            os.write(self.pipe[1], bytes(4096))  # the read completes, C commits it
            await plane.wait_for(lambda: plane.events)
        finally:
            plane.close()
            handle.close()

    def idling_in_c(self) -> bool:
        plane = self.plane
        return (plane is not None and plane.dp.counts[0].started == 1
                and asleep_in_io_uring(self.tid))

    def stop(self) -> None:
        handle, stop = self.handle, self._stop
        assert handle is not None and stop is not None
        handle.call_soon(stop.set_result, None)
        self.thread.join(WAIT)
        assert not self.thread.is_alive() and self.error is None, self.error
        for fd in self.pipe:
            os.close(fd)


def test_a_call_from_another_thread_runs_while_the_worker_idles_in_c() -> None:
    """C holds a request and waits a minute for the next; a thread's
    ``call_soon`` still runs at once: its kick ends C's wait."""
    w = IdleWorker()
    try:
        wait_until(w.idling_in_c, "the worker to idle in C")
        ran = threading.Event()
        assert w.handle is not None
        w.handle.call_soon(ran.set)
        assert ran.wait(WAIT), "the call waited for C's idle timeout"
        assert w.handle.kicks == 1
        assert w.plane is not None and w.plane.dp.inflight == 1  # (C still holds the read)
    finally:
        w.stop()
    assert w.plane is not None  # its commit:
    assert w.plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]


@pytest.mark.asyncio
async def test_a_kick_ends_aur_dp_reap_with_the_kick_as_its_record() -> None:
    """On the caller's own thread: the reap that serves the request idles
    in C until the kick's poll completion, a Python record, ends it."""
    loop = asyncio.get_running_loop()
    ring = Ring(16)
    handle = LoopHandle.new(loop)
    r, w = os.pipe()
    plane = Plane(ring, -1, map=Linear(r), setup=IDLE)
    try:
        handle.watch(ring)
        ring.submit_now()
        tid = threading.get_native_id()
        reaping = threading.Event()
        ran = loop.create_future()

        def kick() -> None:
            reaping.wait(WAIT)
            wait_until(lambda: asleep_in_io_uring(tid), "the reap to wait in C")
            handle.call_soon(ran.set_result, True)

        kicker = threading.Thread(target=kick)
        kicker.start()
        plane.fetch(0, uapi.Op.READ, 8)
        reaping.set()
        ring.reap_now()  # serves the read, idles, and returns on the kick
        kicker.join(WAIT)
        assert handle.kicks == 1 and plane.dp.counts[0].started == 1
        assert plane.dp.inflight == 1 and not plane.events  # the read is C's, still
        assert await asyncio.wait_for(ran, WAIT)
        os.write(w, bytes(4096))
        await plane.wait_for(lambda: plane.events)
    finally:
        plane.close()
        handle.close()
        os.close(r)
        os.close(w)


@pytest.mark.asyncio
async def test_the_poll_ends_when_the_ring_closes_and_a_closed_handle_refuses() -> None:
    loop = asyncio.get_running_loop()
    ring = Ring(8)
    handle = LoopHandle.new(loop)
    handle.watch(ring)
    ring.submit_now()
    ring.close()  # cancels the poll: not armed again on a closed ring
    assert ring.in_flight == 0
    handle.close()
    with pytest.raises(RuntimeError):
        await asyncio.to_thread(handle.call_soon, print)


# -- call_on: two loops, two threads ------------------------------------------

class LoopThread:
    """A loop on a thread of its own, its handle's kick fd watched by a reader."""

    def __init__(self) -> None:
        self._made: Future[LoopHandle] = Future()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.handle = self._made.result(WAIT)
        self.loop = self.handle.loop

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        handle = LoopHandle.new(loop)
        loop.add_reader(handle.kick_fd, handle.read_kicks)
        self._made.set_result(handle)
        try:
            loop.run_forever()
        finally:
            loop.remove_reader(handle.kick_fd)
            loop.close()
            handle.close()

    def run(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run ``coro`` on this loop (a test's way in); await the result."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)


@pytest_asyncio.fixture
async def loops() -> Any:
    """(the test's loop's handle, another loop on its own thread)."""
    here = LoopHandle.new(asyncio.get_running_loop())
    asyncio.get_running_loop().add_reader(here.kick_fd, here.read_kicks)
    there = LoopThread()
    yield here, there
    there.close()
    asyncio.get_running_loop().remove_reader(here.kick_fd)
    here.close()


async def _where(x: int) -> tuple[int, int]:
    await asyncio.sleep(0)
    return x * 2, threading.get_ident()


async def _fails(msg: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(msg)


@pytest.mark.asyncio
async def test_call_on_runs_on_the_owner_and_returns_its_result(
        loops: tuple[LoopHandle, LoopThread]) -> None:
    here, there = loops
    assert await call_on(there.handle, here, _where, 21) == (42, there.thread.ident)
    # and the other way: the far loop asks this one
    back = await there.run(call_on(here, there.handle, _where, 5))
    assert back == (10, threading.get_ident())
    await until(lambda: there.handle.kicks >= 1 and here.kicks >= 1, "both sides' kicks")


@pytest.mark.asyncio
async def test_call_on_raises_the_owners_exception(loops: tuple[LoopHandle, LoopThread]) -> None:
    here, there = loops
    with pytest.raises(ValueError, match="from there"):
        await call_on(there.handle, here, _fails, "from there")
    with pytest.raises(ValueError, match="from here"):
        await there.run(call_on(here, there.handle, _fails, "from here"))
    with pytest.raises(TypeError):  # a bad call fails in the caller
        await call_on(there.handle, here, _where)  # type: ignore[call-arg]


@pytest.mark.asyncio
async def test_the_callers_cancellation_does_not_cancel_the_owners_task(
        loops: tuple[LoopHandle, LoopThread]) -> None:
    here, there = loops
    started, finished = threading.Event(), threading.Event()
    gate = asyncio.Event()  # (used on the owner's loop only)
    outcome: list[str] = []

    async def slow() -> str:
        started.set()
        try:
            await gate.wait()
            outcome.append("done")
            return "done"
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        finally:
            finished.set()

    caller = asyncio.create_task(call_on(there.handle, here, slow))
    await until(started.is_set, "the owner's task to start")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not finished.is_set()
    there.handle.call_soon(gate.set)
    await until(finished.is_set, "the owner's task to end")
    assert outcome == ["done"]


@pytest.mark.asyncio
async def test_call_on_the_callers_own_loop_awaits_directly() -> None:
    here = LoopHandle.new(asyncio.get_running_loop())
    try:
        assert await call_on(here, here, _where, 1) == (2, threading.get_ident())
        with pytest.raises(BlockingIOError):  # nothing was kicked
            os.eventfd_read(here.kick_fd)
    finally:
        here.close()


@pytest.mark.asyncio
async def test_run_in_thread_brings_the_outcome_back_through_the_kick() -> None:
    loop = asyncio.get_running_loop()
    here = LoopHandle.new(loop)
    loop.add_reader(here.kick_fd, here.read_kicks)
    here.bind()
    try:
        assert await run_in_thread(threading.get_ident) != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await run_in_thread(divmod, 1, 0)
        await until(lambda: here.kicks == 2, "the two results' kicks")
    finally:
        loop.remove_reader(here.kick_fd)
        here.close()
