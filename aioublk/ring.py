"""An io_uring bound to an asyncio event loop.

io_uring facts this module relies on:

- Completions are announced through an eventfd registered with the ring and
  watched with ``loop.add_reader``. The eventfd's count is *not* a CQE count:
  one wake-up may cover many CQEs, or none, so the reader always reaps until
  the CQ is empty.
- With ``IORING_SETUP_DEFER_TASKRUN`` the kernel wakes the eventfd but posts
  CQEs only when the owning thread enters the kernel with GETEVENTS, so the
  reader runs ``io_uring_get_events`` (``aur_wake``) before reaping, and every
  submit is a submit-and-get-events.
- ``IORING_SETUP_SINGLE_ISSUER`` binds the ring to the thread that created it:
  a Ring lives and dies on one thread and one loop.
- A buffer handed to the kernel must stay alive until its CQE arrives, even if
  the awaiting coroutine is cancelled: the Ring keeps a reference per in-flight
  operation, and closing waits (bounded) for the kernel to let go. What it
  still holds after that wait may yet be written: those buffers are kept for
  the life of the process (``_KEPT``), never freed for reuse. The data
  plane's requests use the queue's memory, which its owner keeps the same way
  when ``dp_stranded`` says the closed ring left some in the kernel; its
  fetch buffers are unregistered before the ring's exit (a fetch still armed
  would pick one), and kept for good if that fails.

Submissions made during one loop turn are gathered and flushed with one
``io_uring_enter`` at the end of the turn (``call_soon``), and completions are
copied out of the CQ by one C call per batch.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
from collections.abc import Callable
from typing import Any, Protocol

from aioublk import logs
from aioublk._uring import ffi, lib

log = logs.get_logger("aioublk.ring")

CQE = struct.Struct("=QiI")
_REAP_BATCH = 256
_iter_cqes = CQE.iter_unpack
#: set in every user_data the data plane makes (C's layout); Python's own stay below it
UD_MARK = 1 << lib.AUR_DP_UD_MARK_SHIFT
#: Python's user_data count up from 1 to this and wrap: the data plane's are above
_LAST_UD = UD_MARK - 1

#: A completion handler: called with (res, cqe_flags) on the loop's thread.
Handler = Callable[[int, int], None]

#: A handler for the records the data plane hands to Python: (user_data, res, flags).
EventHandler = Callable[[int, int, int], None]


class DataPlaneLike(Protocol):
    """What a ring's owner hands it with ``attach`` (the queue's
    ``DataPlane``): ``c``, a ``struct aur_dp *`` made on this ring's ``raw``,
    reaps in the ring's place, and the records it leaves to Python (user_data
    with ``UD_MARK`` set) go to ``on_event``, called straight from the reap.
    The ring frees ``c`` when it closes (it must outlive the ring's exit)."""

    c: Any
    on_event: EventHandler


_local = threading.local()

#: buffers of operations a closed ring left in the kernel (see the module doc)
_KEPT: list[Any] = []


def keep(buffer: Any) -> None:
    """Keep ``buffer`` for the life of the process: an operation a closed
    ring left in the kernel may still write to it."""
    _KEPT.append(buffer)


def current_ring() -> Ring:
    """The Ring of the queue thread running this coroutine."""
    ring = bound_ring()
    if ring is None:
        raise RuntimeError("no aioublk Ring is bound to this thread")
    return ring


def bound_ring() -> Ring | None:
    """The Ring bound to this thread, or None: for code that makes its own
    when the caller has none (``Qcow2Image``'s ``async with``)."""
    ring: Ring | None = getattr(_local, "ring", None)
    return ring


def buffer_address(buf: Any) -> int:
    """Address of a writable or read-only buffer (memoryview, bytearray, mmap)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


def check(res: int, what: str = "io_uring operation") -> int:
    """Turn a negative CQE result into OSError."""
    if res < 0:
        raise OSError(-res, f"{what}: {os.strerror(-res)}")
    return res


def queue_ring_flags() -> int:
    """Setup flags for a queue's ring, and for any ring one loop drives:
    single issuer, cooperative task work (run at the thread's next syscall,
    no IPI). Here, below the queue layer, so the qcow2 engine's own ring
    uses them too. Measured in the guest against
    DEFER_TASKRUN, whose wake needs a second enter that waits with a zero
    timeout (about 9 us per wake): 4k reads at qd64, null 5.7k -> 9.2k IOPS,
    qcow2 2.5k -> 3.8k, loop 3.0k -> 3.7k."""
    return int(lib.IORING_SETUP_SINGLE_ISSUER | lib.IORING_SETUP_COOP_TASKRUN)


#: io_uring's largest CQ (IORING_MAX_CQ_ENTRIES)
MAX_CQ_ENTRIES = 1 << 16


def queue_cq_entries(nr_tags: int) -> int:
    """A queue ring's CQ: room for each tag's command and for the backend
    I/O the data plane may have in flight for it (a -z request: its pieces,
    register and unregister). Past io_uring's largest CQ the data plane
    bounds itself to what the CQ holds (it leaves the rest to Python)."""
    return min(MAX_CQ_ENTRIES, max(256, nr_tags * (lib.AUR_DP_MAX_PIECES + 3)))


class Ring:
    """One io_uring, driven by the loop of the thread that created it."""

    def __init__(
        self,
        entries: int = 256,
        *,
        cq_entries: int = 0,
        flags: int = 0,
        sqe128: bool = False,
        cqe32: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
        bind_thread: bool = False,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        if sqe128:
            flags |= lib.IORING_SETUP_SQE128
        if cqe32:  # the reap copies each CQE's first 16 bytes: res and flags
            flags |= lib.IORING_SETUP_CQE32
        self._r = ffi.new("struct aur *")
        ret = lib.aur_init(self._r, entries, cq_entries, flags)
        if ret < 0:
            raise OSError(-ret, f"io_uring setup failed: {os.strerror(-ret)}")
        self.flags = lib.aur_setup_flags(self._r)
        self._efd = lib.aur_eventfd(self._r)
        self._handlers: dict[int, Handler | asyncio.Future[int]] = {}
        self._keep: dict[int, Any] = {}
        self._next_ud = 1
        self._flush_scheduled = False
        self._cqes = bytearray(16 * _REAP_BATCH)
        self._cqe_buf = ffi.from_buffer(self._cqes)
        self._cqe_view = memoryview(self._cqes)
        self._closed = False
        self._flush_hooks: list[Callable[[], None]] = []
        self._c_submits = False
        self._dp: Any = None  # the data plane's C side, once there is one
        self._dp_event: EventHandler | None = None
        self._dp_owner: DataPlaneLike | None = None
        #: data-plane requests still in the kernel when the ring closed
        self.dp_stranded = 0
        self.loop.add_reader(self._efd, self._on_wake)
        if bind_thread:
            _local.ring = self

    # -- submission ---------------------------------------------------------

    def _new_ud(self) -> int:
        ud = self._next_ud
        self._next_ud = ud + 1 if ud < _LAST_UD else 1
        return ud

    def add_flush_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` at the end of every loop turn that submits, just before
        the submit: the place to queue a batch of what the turn produced."""
        self._flush_hooks.append(hook)

    def request_flush(self) -> None:
        """Make sure this loop turn ends with a submit (and its hooks)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def c_submits(self) -> None:
        """The data plane owns the loop's wait (``dataplane.cwait``): what a loop
        turn queued goes with C's next wait, in the same ``io_uring_enter``,
        which runs as the turn ends; only the flush hooks run here."""
        self._c_submits = True

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        for hook in self._flush_hooks:
            hook()
        if self._c_submits:
            return
        ret = lib.aur_submit(self._r)
        if ret < 0 and ret not in (-errno.EAGAIN, -errno.EBUSY, -errno.EINTR):
            raise OSError(-ret, f"io_uring_enter failed: {os.strerror(-ret)}")
        self._reap()

    def _track(self, handler: Handler | asyncio.Future[int] | None, keep: Any) -> int:
        if self._closed:
            raise RuntimeError("ring is closed")
        ud = self._new_ud()
        if handler is not None:
            self._handlers[ud] = handler
        if keep is not None:
            self._keep[ud] = keep
        self.request_flush()
        return ud

    def _checked(self, ret: int, ud: int) -> None:
        if ret < 0:
            self._handlers.pop(ud, None)
            self._keep.pop(ud, None)
            raise OSError(-ret, f"cannot queue SQE: {os.strerror(-ret)}")

    def prep(
        self,
        opcode: int,
        fd: int,
        *,
        addr: int = 0,
        length: int = 0,
        offset: int = 0,
        op_flags: int = 0,
        buf_index: int = 0,
        sqe_flags: int = 0,
        handler: Handler | asyncio.Future[int] | None = None,
        keep: Any = None,
    ) -> int:
        """Queue one SQE; its CQE goes to ``handler``. Returns its user_data."""
        ud = self._track(handler, keep)
        self._checked(
            lib.aur_prep(
                self._r, opcode, fd, addr, length, offset, op_flags, buf_index, sqe_flags, ud
            ),
            ud,
        )
        return ud

    def prep_cmd(
        self,
        fd: int,
        cmd_op: int,
        cmd: bytes,
        *,
        addr: int = 0,
        length: int = 0,
        cmd_flags: int = 0,
        buf_index: int = 0,
        sqe_flags: int = 0,
        handler: Handler | asyncio.Future[int] | None = None,
        keep: Any = None,
    ) -> int:
        """Queue an ``IORING_OP_URING_CMD`` with the raw command area ``cmd``
        (at most 16 bytes on a 64-byte-SQE ring, 80 with ``sqe128``)."""
        ud = self._track(handler, keep)
        self._checked(
            lib.aur_prep_cmd(
                self._r, fd, cmd_op, cmd, len(cmd), addr, length, cmd_flags, buf_index,
                sqe_flags, ud,
            ),
            ud,
        )
        return ud

    def prep_ublk_io(
        self, fd: int, cmd_op: int, q_id: int, tag: int, result: int, io_addr: int,
        handler: Handler, sqe_addr: int = 0, sqe_flags: int = 0,
    ) -> None:
        """The per-I/O hot path: a ``ublksrv_io_cmd`` built in C."""
        ud = self._new_ud()
        self._handlers[ud] = handler
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        ret = lib.aur_prep_ublk_io(
            self._r, fd, cmd_op, q_id, tag, result, io_addr, sqe_addr, sqe_flags, ud
        )
        if ret < 0:
            self._checked(ret, ud)

    def submit_now(self) -> None:
        """Flush queued SQEs at once instead of at the end of the loop turn."""
        ret = lib.aur_submit(self._r)
        if ret < 0 and ret not in (-errno.EAGAIN, -errno.EBUSY, -errno.EINTR):
            raise OSError(-ret, f"io_uring_enter failed: {os.strerror(-ret)}")

    # -- awaitable operations ----------------------------------------------

    def _op(self, opcode: int, fd: int, keep: Any = None, **kw: int) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = self.loop.create_future()
        self.prep(opcode, fd, handler=fut, keep=keep, **kw)
        return fut

    def submit_rw(self, opcode: int, fd: int, view: Any, offset: int,
                  handler: Handler | asyncio.Future[int], rw_flags: int = 0) -> None:
        """The read/write hot path (``prep`` and ``_track`` inlined): ``view``
        is a cffi buffer (``ffi.from_buffer``); the CQE goes to ``handler``."""
        if self._closed:
            raise RuntimeError("ring is closed")
        ud = self._next_ud
        self._next_ud = ud + 1 if ud < _LAST_UD else 1
        self._handlers[ud] = handler
        self._keep[ud] = view
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        ret = lib.aur_prep(self._r, opcode, fd, int(ffi.cast("uintptr_t", view)), len(view),
                           offset, rw_flags, 0, 0, ud)
        if ret < 0:
            self._checked(ret, ud)

    def start_read(self, fd: int, buf: Any, offset: int,
                   handler: Handler | asyncio.Future[int]) -> None:
        """Queue a pread into ``buf``; its CQE goes to ``handler``."""
        self.submit_rw(lib.IORING_OP_READ, fd, ffi.from_buffer(buf, require_writable=True),
                       offset, handler)

    def start_write(self, fd: int, buf: Any, offset: int,
                    handler: Handler | asyncio.Future[int], rw_flags: int = 0) -> None:
        """Queue a pwrite from ``buf``; its CQE goes to ``handler``."""
        self.submit_rw(lib.IORING_OP_WRITE, fd, ffi.from_buffer(buf), offset, handler, rw_flags)

    async def read(self, fd: int, buf: Any, offset: int) -> int:
        """pread into ``buf``; returns bytes read (short at EOF)."""
        fut: asyncio.Future[int] = self.loop.create_future()
        self.start_read(fd, buf, offset, fut)
        return check(await fut, "read")

    async def write(self, fd: int, buf: Any, offset: int, rw_flags: int = 0) -> int:
        """pwrite from ``buf``; returns bytes written."""
        fut: asyncio.Future[int] = self.loop.create_future()
        self.start_write(fd, buf, offset, fut, rw_flags)
        return check(await fut, "write")

    async def read_fixed(self, fd: int, addr: int, length: int, offset: int,
                         buf_index: int) -> int:
        """Read into a registered buffer (``addr`` lies inside buffer ``buf_index``)."""
        res = await self._op(lib.IORING_OP_READ_FIXED, fd, addr=addr, length=length,
                             offset=offset, buf_index=buf_index)
        return check(res, "read_fixed")

    async def write_fixed(self, fd: int, addr: int, length: int, offset: int,
                          buf_index: int) -> int:
        """Write from a registered buffer (``addr`` lies inside buffer
        ``buf_index``); returns bytes written."""
        res = await self._op(lib.IORING_OP_WRITE_FIXED, fd, addr=addr, length=length,
                             offset=offset, buf_index=buf_index)
        return check(res, "write_fixed")

    async def _vec(self, opcode: int, fd: int, bufs: list[Any], offset: int,
                   what: str, writable: bool) -> int:
        views = [ffi.from_buffer(b, require_writable=writable) for b in bufs]
        iov = ffi.new("struct aur_iovec[]", len(views))
        for i, v in enumerate(views):
            iov[i].base = int(ffi.cast("uintptr_t", v))
            iov[i].len = len(v)
        res = await self._op(opcode, fd, keep=(iov, views),
                             addr=int(ffi.cast("uintptr_t", iov)), length=len(views),
                             offset=offset)
        return check(res, what)

    async def readv(self, fd: int, bufs: list[Any], offset: int) -> int:
        """preadv into ``bufs`` in order; returns bytes read (short at EOF)."""
        return await self._vec(lib.IORING_OP_READV, fd, bufs, offset, "readv", True)

    async def writev(self, fd: int, bufs: list[Any], offset: int) -> int:
        """pwritev from ``bufs`` in order; returns bytes written."""
        return await self._vec(lib.IORING_OP_WRITEV, fd, bufs, offset, "writev", False)

    async def fsync(self, fd: int, *, datasync: bool = False) -> None:
        """fsync(2) through the ring (``datasync``: fdatasync's weaker
        promise); OSError on failure."""
        flags = lib.IORING_FSYNC_DATASYNC if datasync else 0
        check(await self._op(lib.IORING_OP_FSYNC, fd, op_flags=flags), "fsync")

    async def fdatasync(self, fd: int) -> None:
        """fdatasync(2) through the ring: the data and what finds it durable."""
        await self.fsync(fd, datasync=True)

    async def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) through the ring: ``mode`` as the syscall takes it
        (0 allocates; ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`` frees;
        ``FALLOC_FL_ZERO_RANGE`` zeroes)."""
        # io_uring's FALLOCATE carries the length in sqe->addr, the mode in len.
        res = await self._op(lib.IORING_OP_FALLOCATE, fd, addr=length, length=mode,
                             offset=offset)
        check(res, "fallocate")

    async def nop(self) -> int:
        """A no-op round trip through the ring (0): what one submission costs."""
        return await self._op(lib.IORING_OP_NOP, -1)

    async def uring_cmd(self, fd: int, cmd_op: int, cmd: bytes, *, keep: Any = None,
                        addr: int = 0, cmd_flags: int = 0, buf_index: int = 0) -> int:
        """A URING_CMD; returns the raw (possibly negative) result. With
        ``IORING_URING_CMD_FIXED`` in ``cmd_flags`` the command's data is
        registered buffer ``buf_index`` (NVMe passthrough in zero copy)."""
        fut: asyncio.Future[int] = self.loop.create_future()
        self.prep_cmd(fd, cmd_op, cmd, addr=addr, cmd_flags=cmd_flags, buf_index=buf_index,
                      handler=fut, keep=keep)
        return await fut

    async def cancel(self, user_data: int, *, any_op: bool = False) -> int:
        """Cancel the operation queued as ``user_data`` (or all, with any_op);
        returns the kernel's answer (0, -ENOENT, -EALREADY, or a count)."""
        flags = lib.IORING_ASYNC_CANCEL_ANY if any_op else 0
        return await self._op(lib.IORING_OP_ASYNC_CANCEL, -1, addr=user_data,
                              op_flags=flags)

    # -- completion ---------------------------------------------------------

    def _on_wake(self) -> None:
        lib.aur_wake(self._r)
        self._reap()

    def reap_now(self) -> None:
        """Deliver every completion the ring holds, now (setup and tests)."""
        self._reap()

    def _reap(self) -> None:
        if self._dp is not None:
            n = lib.aur_dp_reap(self._dp, self._cqe_buf, len(self._cqes) // 16)
            if n:
                self._dispatch(n)
            return
        while True:
            n = lib.aur_reap(self._r, self._cqe_buf, _REAP_BATCH)
            if not n:
                return
            self._dispatch(n)
            if n < _REAP_BATCH:
                return

    def _dispatch(self, n: int) -> None:
        handlers = self._handlers
        keep = self._keep
        more = lib.IORING_CQE_F_MORE
        dp_event = self._dp_event
        mark = UD_MARK
        for ud, res, flags in _iter_cqes(self._cqe_view[: 16 * n]):
            if ud & mark:
                if dp_event is not None:
                    dp_event(ud, res, flags)
                continue
            if flags & more:
                h = handlers.get(ud)
            else:
                h = handlers.pop(ud, None)
                if keep:
                    keep.pop(ud, None)
            if h is None:
                continue
            if isinstance(h, asyncio.Future):
                if not h.done():
                    h.set_result(res)
            else:
                h(res, flags)

    # -- the data plane -----------------------------------------------------

    def attach(self, dp: DataPlaneLike) -> None:
        """From now on every reap goes through ``dp`` (one per ring, freed by
        ``close``); a ring without one reaps everything into Python. The
        ring holds ``dp`` too: C writes into memory it owns (its counters)."""
        if self._closed:
            raise RuntimeError("ring is closed")
        if self._dp is not None:
            raise RuntimeError("the ring has a data plane already")
        self._dp_owner = dp
        self._dp = dp.c
        self._dp_event = dp.on_event
        size = 16 * lib.aur_dp_out_cap(dp.c)
        if size > len(self._cqes):
            self._cqes = bytearray(size)
            self._cqe_buf = ffi.from_buffer(self._cqes)
            self._cqe_view = memoryview(self._cqes)

    def _dp_busy(self) -> bool:
        return self._dp is not None and lib.aur_dp_inflight(self._dp) > 0

    @property
    def in_flight(self) -> int:
        """Submissions whose completion has not come yet."""
        return len(self._handlers)

    # -- resources ----------------------------------------------------------

    def register_buffers_sparse(self, nr: int) -> None:
        """Make ``nr`` empty registered-buffer slots (for zero copy's
        per-request registrations)."""
        check(lib.aur_register_buffers_sparse(self._r, nr), "register sparse buffers")

    def register_files(self, fds: list[int]) -> None:
        """Register ``fds`` as the ring's fixed files, by index."""
        arr = ffi.new("int[]", fds)
        check(lib.aur_register_files(self._r, arr, len(fds)), "register files")

    @property
    def raw(self) -> Any:
        """The C ring (``struct aur *``) for drivers that batch in C."""
        return self._r

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what is in flight, wait (bounded) for the kernel to release
        every buffer, settle every awaiter, and free the ring."""
        if self._closed:
            return
        self._closed = True
        if self._dp is not None:  # (the loop's hook goes first: it may run C's wait)
            lib.aur_dp_release_wait(self._dp)
        self.loop.remove_reader(self._efd)
        if self._handlers or self._dp_busy():
            lib.aur_prep(self._r, lib.IORING_OP_ASYNC_CANCEL, -1, 0, 0, 0,
                         lib.IORING_ASYNC_CANCEL_ANY, 0, 0, 0)
            lib.aur_submit(self._r)
            deadline = self.loop.time() + timeout
            while (self._handlers or self._dp_busy()) and self.loop.time() < deadline:
                lib.aur_wait(self._r, 50)
                lib.aur_wake(self._r)
                self._reap()
        if self._keep:
            log.warning("ring closed with operations in the kernel: their buffers are kept",
                        n=len(self._keep))
            _KEPT.extend(self._keep.values())
        for h in self._handlers.values():
            if isinstance(h, asyncio.Future):
                if not h.done():
                    h.set_exception(OSError(errno.ECANCELED, "io_uring ring closed"))
            else:
                try:
                    h(-errno.ECANCELED, 0)
                except Exception:  # noqa: BLE001 - a handler must not stop the close
                    pass
        self._handlers.clear()
        self._keep.clear()
        if self._dp is not None and lib.aur_dp_withdraw(self._dp):
            log.warning("ring closed with fetch buffers the kernel kept: they are kept")
        lib.aur_exit(self._r)
        if self._dp is not None:
            self.dp_stranded = int(lib.aur_dp_inflight(self._dp))
            if self.dp_stranded:  # their buffers are the queue's memory: see keep()
                log.warning("ring closed with data-plane requests in the kernel: their "
                            "buffers are kept", n=self.dp_stranded)
            lib.aur_dp_free(self._dp)
            self._dp = self._dp_owner = None
        if getattr(_local, "ring", None) is self:
            _local.ring = None

    @property
    def closed(self) -> bool:
        """True once ``close`` ran: nothing may be submitted."""
        return self._closed

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
