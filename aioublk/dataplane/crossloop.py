"""Calls between the loops of a device's workers, and into them from other
threads.

A worker's thread may sleep in C, inside ``aur_dp_reap`` with the GIL
released, waiting on its ring: ``loop.call_soon_threadsafe`` wakes only the
loop's own handle, which nobody looks at until C returns. So each worker has
a :class:`LoopHandle`: its ``call_soon`` queues the call on the loop and then
writes the worker's *kick* eventfd, which the worker polls through its ring
(:meth:`LoopHandle.watch`, a multishot ``POLL_ADD``). The poll's completion
is a Python record: C hands it back and returns, the handler reads the
eventfd, and that loop turn runs the queued calls.

Every call into a worker's loop from another thread goes through its handle:
the stop (``Worker.request_finish``), an executor's result
(:func:`run_in_thread`), and one worker asking another to run a coroutine
(:func:`call_on`).
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aioublk import logs
from aioublk._uring import lib
from aioublk.ring import Ring

__all__ = ["FdWatch", "LoopHandle", "call_on", "current", "run_in_thread", "waiter"]

log = logs.get_logger("aioublk.dataplane.crossloop")

T = TypeVar("T")

_local = threading.local()


def current() -> LoopHandle | None:
    """The handle bound to this thread (``LoopHandle.bind``), or None."""
    handle: LoopHandle | None = getattr(_local, "handle", None)
    return handle


class FdWatch:
    """``on_ready()`` on the ring's thread each time ``fd`` (an eventfd) is
    readable: a multishot ``POLL_ADD`` through ``ring``, the one its thread
    waits on in C, so the wake-up reaches a thread asleep there. Armed again
    when the kernel ends the multishot (a CQ overflow), until the ring
    closes; ``lost`` says in the log what waits longer if it fails."""

    def __init__(self, ring: Ring, fd: int, on_ready: Callable[[], None], lost: str) -> None:
        self.ring, self.fd, self.on_ready, self.lost = ring, fd, on_ready, lost
        self._arm()

    def _arm(self) -> None:
        self.ring.prep(lib.IORING_OP_POLL_ADD, self.fd, op_flags=select.POLLIN,
                       length=lib.IORING_POLL_ADD_MULTI, handler=self._on_cqe)

    def _on_cqe(self, res: int, flags: int) -> None:
        if res >= 0:
            self.on_ready()
        if flags & lib.IORING_CQE_F_MORE or self.ring.closed:
            return
        if res < 0:  # (-ECANCELED: the ring closes)
            if res != -errno.ECANCELED:
                log.warning("an eventfd poll failed: " + self.lost, error=os.strerror(-res))
            return
        self._arm()


class LoopHandle:
    """``loop``, callable from any thread; ``kick_fd`` (an eventfd, which the
    handle owns and closes) wakes its thread when it waits in C. Made on the
    loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kick_fd: int) -> None:
        self.loop = loop
        self.kick_fd = kick_fd
        #: the kicks read from the fd: calls from other threads, counted
        self.kicks = 0
        self._thread = threading.get_ident()
        self._lock = threading.Lock()  # a kick never writes a closed (reused) fd

    @classmethod
    def new(cls, loop: asyncio.AbstractEventLoop) -> LoopHandle:
        """A handle with an eventfd of its own."""
        return cls(loop, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))

    def bind(self) -> None:
        """Make this the handle ``current()`` returns on this thread."""
        _local.handle = self

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` on the loop, soon; from any thread. RuntimeError
        once the loop or the handle is closed."""
        if threading.get_ident() == self._thread:  # running Python here: no one to wake
            self.loop.call_soon(fn, *args)
            return
        with self._lock:
            if self.kick_fd < 0:
                raise RuntimeError("the loop's handle is closed")
            self.loop.call_soon_threadsafe(fn, *args)
            try:
                os.eventfd_write(self.kick_fd, 1)
            except BlockingIOError:  # the count is full: a kick is pending anyway
                pass

    def watch(self, ring: Ring) -> None:
        """Poll the kick fd through ``ring`` (the one its thread waits on in C),
        until the ring closes."""
        FdWatch(ring, self.kick_fd, self.read_kicks,
                "cross-thread calls wait for the loop's next turn")

    def read_kicks(self) -> None:
        """Take the kicks the fd holds (on the loop's thread): what watches
        the fd calls it, ``watch``'s poll or a loop's reader."""
        try:
            self.kicks += os.eventfd_read(self.kick_fd)
        except BlockingIOError:  # an earlier completion of the poll read them
            pass

    def close(self) -> None:
        """Close the kick fd; later ``call_soon`` raise RuntimeError."""
        with self._lock:
            fd, self.kick_fd = self.kick_fd, -1
        if fd >= 0:
            os.close(fd)
        if getattr(_local, "handle", None) is self:
            _local.handle = None


def _copy(src: asyncio.Future[T], dst: asyncio.Future[T]) -> None:
    """``src``'s outcome into ``dst`` (on ``dst``'s loop); a cancelled
    ``dst`` (its caller gave up) drops it."""
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif (e := src.exception()) is not None:
        dst.set_exception(e)
    else:
        dst.set_result(src.result())


async def call_on(owner: LoopHandle, here: LoopHandle,
                  fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """``await fn(*args)`` as a task on ``owner``'s loop, from ``here``'s (the
    running one). The caller's cancellation never reaches the owner's task:
    it runs to its end, and its outcome is dropped."""
    coro = fn(*args)  # (runs nothing yet: a bad call fails here, in the caller)
    if here is owner:
        return await coro
    fut: asyncio.Future[T] = here.loop.create_future()

    def done(task: asyncio.Task[T]) -> None:  # on the owner's loop
        try:
            here.call_soon(_copy, task, fut)
        except RuntimeError:  # the caller's loop is gone
            if not task.cancelled():
                task.exception()  # (retrieved: no "never retrieved" warning)

    def start() -> None:  # on the owner's loop
        owner.loop.create_task(coro).add_done_callback(done)

    try:
        owner.call_soon(start)
    except RuntimeError:  # the owner's loop is gone
        coro.close()
        raise
    return await asyncio.shield(fut)


def waiter() -> tuple[asyncio.Future[None], Callable[[], None]]:
    """A future on the running loop, and a ``wake()`` any thread may call once
    to settle it: through this thread's handle (a kick) when it has one."""
    loop = asyncio.get_running_loop()
    here = current()
    fut: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    def wake() -> None:
        try:
            if here is not None and here.loop is loop:
                here.call_soon(settle)
            else:
                loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is gone: nobody waits
            pass
    return fut, wake


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the loop's default executor, its outcome brought back
    through this thread's handle (a kick) when it has one for this loop."""
    loop = asyncio.get_running_loop()
    here = current()
    if here is None or here.loop is not loop:
        return await loop.run_in_executor(None, fn, *args)
    fut: asyncio.Future[T] = loop.create_future()

    def work() -> None:  # on an executor thread
        try:
            res = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the caller's to see
            _deliver(here, fut.set_exception, fut, e)
        else:
            _deliver(here, fut.set_result, fut, res)

    loop.run_in_executor(None, work)
    return await fut


def _deliver(here: LoopHandle, setter: Callable[[Any], None], fut: asyncio.Future[Any],
             value: Any) -> None:
    def settle() -> None:
        if not fut.done():
            setter(value)
    try:
        here.call_soon(settle)
    except RuntimeError:  # the loop is gone: nobody waits
        pass
