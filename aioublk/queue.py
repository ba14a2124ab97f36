"""Serving ublk queues: shared per-queue memory, worker threads (one uvloop
loop and one Ring each), the data-copy modes, and the per-I/O driver.

The per-tag protocol of the per-I/O path (every kernel):

    FETCH_REQ ──► (request arrives: CQE res 0) ──► target coroutine
        ▲                                              │
        └──────────── COMMIT_AND_FETCH_REQ(result) ◄───┘

A CQE with res -ENODEV means the kernel aborted the tag (device stopped or
deleted): the tag is finished and is not re-armed. A worker ends when all its
tags are finished. Commands for a tag must come from the thread that fetched
it; every worker uses only its own Ring, so that holds.

Workers and queues (``layout``): by default one worker per queue. With
``--per_io_tasks`` (``UBLK_F_PER_IO_DAEMON``) the (queue, tag) pairs are dealt
out to N workers in turn, so one busy queue keeps every worker busy. The batch
path (``batch.py``) maps N workers onto M queues round-robin, the way kublk
does: a worker may serve several queues and a queue several workers.

``IoPath`` is the one place that knows the data-copy modes; both drivers run
every request through it and ``serve_request`` (the op → target dispatch).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import mmap
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import structlog

from aioublk import logs, uapi
from aioublk._uring import ffi, lib
from aioublk.dataplane import EV_IDLE, EV_LOST, EV_RETRY, decode
from aioublk.ring import Ring, buffer_address
from aioublk.target import Buffer, Done, FixedBuf, Target

if TYPE_CHECKING:
    from aioublk.device import DeviceConfig

log = structlog.get_logger("aioublk.queue")
#: how long a stopping worker waits for the requests it holds to finish
DRAIN_SECONDS = 5.0
#: how long the data plane waits in C for the next completion, while it alone
#: has work, before the queue's loop gets its turn (see _dataplane.c)
POLL_US = 1000

_READ, _WRITE, _FLUSH, _DISCARD, _WRITE_ZEROES = (
    uapi.Op.READ, uapi.Op.WRITE, uapi.Op.FLUSH, uapi.Op.DISCARD, uapi.Op.WRITE_ZEROES)


async def serve_request(target: Target, op_flags: int, nr_sectors: int, start_sector: int,
                        buf: Buffer, *, q: int = -1, tag: int = -1) -> int:
    """Run one request on the target; returns the result for the kernel
    (bytes for read/write, 0 for the others, -errno on failure)."""
    op = op_flags & 0xFF
    offset = start_sector << 9
    length = nr_sectors << 9
    try:
        # (a FixedBuf only reaches targets that declared fixed_buffers)
        if op == _READ:
            await target.read(offset, cast(memoryview, buf[:length]))
            return length
        if op == _WRITE:
            await target.write(offset, cast(memoryview, buf[:length]),
                               bool(op_flags & uapi.IO_F_FUA))
            return length
        if op == _FLUSH:
            await target.flush()
            return 0
        if op == _DISCARD:
            await target.discard(offset, length)
            return 0
        if op == _WRITE_ZEROES:
            await target.write_zeroes(offset, length, not op_flags & uapi.IO_F_NOUNMAP)
            return 0
        return -errno.EOPNOTSUPP
    except OSError as e:
        return -(e.errno or errno.EIO)
    except Exception:
        log.exception("target raised: request failed with EIO", q=q, tag=tag, op=op,
                      offset=offset, length=length)
        return -errno.EIO


class CopyMode(enum.Enum):
    """How request data moves between the kernel and the target (kublk's flags)."""

    COPY = "copy"             # default: the kernel copies to/from our buffer
    ZERO_COPY = "zero_copy"   # -z: register the request's pages, fixed-buffer I/O
    AUTO_ZC = "auto_zc"       # --auto_zc: the kernel registers them for us
    USER_COPY = "user_copy"   # -u: pread/pwrite on /dev/ublkcN

    @property
    def flags(self) -> int:
        return {
            CopyMode.COPY: 0,
            CopyMode.ZERO_COPY: uapi.Feature.SUPPORT_ZERO_COPY,
            CopyMode.AUTO_ZC: uapi.Feature.AUTO_BUF_REG,
            CopyMode.USER_COPY: uapi.Feature.USER_COPY,
        }[self]

    @property
    def kernel_buffers(self) -> bool:
        """Whether the kernel copies into a buffer of ours (given with each command)."""
        return self is CopyMode.COPY

    @property
    def own_buffers(self) -> bool:
        return self in (CopyMode.COPY, CopyMode.USER_COPY)

    @property
    def fixed(self) -> bool:
        return self in (CopyMode.ZERO_COPY, CopyMode.AUTO_ZC)

    @property
    def data_plane(self) -> int:
        """How the C data plane serves in this mode (``AUR_DP_*``): in the tag's
        buffer, with fixed-buffer I/O on the kernel's registration or on its
        own (-z), or not at all (-u)."""
        return int({CopyMode.COPY: lib.AUR_DP_COPY, CopyMode.AUTO_ZC: lib.AUR_DP_AUTO_ZC,
                    CopyMode.ZERO_COPY: lib.AUR_DP_ZERO_COPY}.get(self, lib.AUR_DP_OTHER))


class QueueMem:
    """One hardware queue's memory, shared by the workers that serve it: the
    kernel's read-only request descriptors and (copy modes) one buffer per tag."""

    def __init__(self, char_fd: int, q_id: int, depth: int, max_io: int, mode: CopyMode) -> None:
        self.q_id = q_id
        self.depth = depth
        self.descs = mmap.mmap(char_fd, uapi.desc_area_size(depth), mmap.MAP_SHARED,
                               mmap.PROT_READ, offset=uapi.desc_mmap_offset(q_id))
        self.bufs: mmap.mmap | None = None
        self.addrs = [0] * depth
        self.views: list[memoryview] = []
        if mode.own_buffers:
            self.bufs = mmap.mmap(-1, depth * max_io, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = buffer_address(self.bufs)
            self.addrs = [base + t * max_io for t in range(depth)]
            view = memoryview(self.bufs)
            self.views = [view[t * max_io:(t + 1) * max_io] for t in range(depth)]
        self.unpack = partial(uapi.IO_DESC.unpack_from, self.descs)

    def close(self) -> None:
        self.views.clear()
        for m in (self.descs, self.bufs):
            if m is None:
                continue
            try:
                m.close()
            except BufferError:
                pass  # a straggling view; the mapping goes with the process


class IoPath:
    """Runs one request on the target in the device's copy mode. ``index``
    is the tag's slot in the worker ring's buffer table (zero-copy modes)."""

    def __init__(self, target: Target, ring: Ring, char_fd: int, mode: CopyMode) -> None:
        self.target = target
        self.ring = ring
        self.char_fd = char_fd
        self.mode = mode
        #: the target's arming hook, if it has one (fault injection)
        self.arming = target.arming if type(target).arming is not Target.arming else None
        #: -v logs every request, on the coroutine path only: the fast path stays untouched
        self.debug = logs.per_request()
        self.fast = mode is CopyMode.COPY and not self.debug and (
            type(target).start_read is not Target.start_read
            or type(target).start_write is not Target.start_write)

    def start(self, qm: QueueMem, tag: int, done: Done) -> bool:
        """The target's task-free path (``Target.start_read``/``start_write``),
        where the copy mode and the op allow it; False: use ``serve``."""
        if not self.fast:
            return False
        op_flags, nr, sector, _addr = qm.unpack(tag * 24)
        op = op_flags & 0xFF
        if op == _READ:
            return self.target.start_read(sector << 9, qm.views[tag][:nr << 9], done)
        if op == _WRITE and not op_flags & uapi.IO_F_FUA:
            return self.target.start_write(sector << 9, qm.views[tag][:nr << 9], done)
        return False

    def serve(self, qm: QueueMem, tag: int, index: int) -> Coroutine[Any, Any, int]:
        if self.debug:
            return self._traced(qm, tag, index)
        return self._serve(qm, tag, index)

    async def _traced(self, qm: QueueMem, tag: int, index: int) -> int:
        op_flags, nr, sector, _addr = qm.unpack(tag * 24)
        res = await self._serve(qm, tag, index)
        log.debug("request", q=qm.q_id, tag=tag, op=uapi.op_name(op_flags), sector=sector,
                  sectors=nr, res=res)
        return res

    def _serve(self, qm: QueueMem, tag: int, index: int) -> Coroutine[Any, Any, int]:
        op_flags, nr, sector, _addr = qm.unpack(tag * 24)
        mode = self.mode
        if mode is CopyMode.COPY or op_flags & 0xFF not in (_READ, _WRITE):
            return serve_request(self.target, op_flags, nr, sector,
                                 qm.views[tag] if qm.views else _NO_DATA, q=qm.q_id, tag=tag)
        if mode is CopyMode.USER_COPY:
            return self._user_copy(qm, tag, op_flags, nr, sector)
        if mode is CopyMode.ZERO_COPY or op_flags & uapi.IO_F_NEED_REG_BUF:
            return self._registered(qm, tag, index, op_flags, nr, sector)
        return serve_request(self.target, op_flags, nr, sector, FixedBuf(index, 0, nr << 9),
                             q=qm.q_id, tag=tag)

    async def _user_copy(self, qm: QueueMem, tag: int, op_flags: int, nr: int,
                         sector: int) -> int:
        length = nr << 9
        view = qm.views[tag][:length]
        pos = uapi.user_copy_offset(qm.q_id, tag)
        try:
            if op_flags & 0xFF == _WRITE and not await self._char_io(self.ring.read, view, pos):
                return -errno.EIO
            res = await serve_request(self.target, op_flags, nr, sector, view, q=qm.q_id,
                                      tag=tag)
            if op_flags & 0xFF == _READ and res > 0 and not await self._char_io(
                    self.ring.write, view[:res], pos):
                return -errno.EIO
            return res
        except OSError as e:
            return -(e.errno or errno.EIO)

    async def _char_io(self, op: Callable[[int, Any, int], Awaitable[int]], view: memoryview,
                       pos: int) -> bool:
        """All of ``view`` from/to the request's data on /dev/ublkcN (``-u``)."""
        done = 0
        while done < len(view):
            n = await op(self.char_fd, view[done:], pos + done)
            if n <= 0:
                return False
            done += n
        return True

    async def _registered(self, qm: QueueMem, tag: int, index: int, op_flags: int, nr: int,
                          sector: int) -> int:
        """-z (or an auto registration the kernel could not do): register the
        request's pages at ``index``, serve, unregister. The unregister is
        queued, not awaited: it reaches the kernel before the commit, in order."""
        ring = self.ring
        res = await ring.uring_cmd(self.char_fd, uapi.IoCmd.REGISTER_IO_BUF,
                                   uapi.io_cmd(qm.q_id, tag, 0, index))
        if res < 0:
            log.warning("REGISTER_IO_BUF failed", q=qm.q_id, tag=tag, res=res)
            return res
        try:
            return await serve_request(self.target, op_flags, nr, sector,
                                       FixedBuf(index, 0, nr << 9), q=qm.q_id, tag=tag)
        finally:
            ring.prep_cmd(self.char_fd, uapi.IoCmd.UNREGISTER_IO_BUF,
                          uapi.io_cmd(qm.q_id, tag, 0, index))


_NO_DATA = memoryview(b"")


def auto_buf_reg(index: int, fallback: bool) -> int:
    """``struct ublk_auto_buf_reg`` as the kernel reads it from ``sqe->addr``."""
    return index | (1 << 16 if fallback else 0)


def layout(queues: int, depth: int, nthreads: int, *, batch: bool,
           per_io_tasks: bool) -> list[list[tuple[int, list[int]]]]:
    """For each worker, the (queue, tags) it serves."""
    work: list[dict[int, list[int]]] = [{} for _ in range(nthreads)]
    if batch:
        # kublk's round-robin N:M map: worker i % N serves queue i % M
        for i in range(max(queues, nthreads)):
            work[i % nthreads].setdefault(i % queues, list(range(depth)))
        return [sorted(w.items()) for w in work]
    if per_io_tasks:
        # the n-th (queue, tag) pair, in queue-major order, goes to worker n % N
        for n in range(queues * depth):
            work[n % nthreads].setdefault(n // depth, []).append(n % depth)
        return [sorted(w.items()) for w in work]
    return [[(q, list(range(depth)))] for q in range(queues)]


class QueueStats:
    """What one worker has answered on one queue: counters the data plane
    keeps in memory Python owns, read by the control thread for ``list
    --stats`` and serve's stats log."""

    __slots__ = ("_c",)

    def __init__(self, counts: Any) -> None:
        self._c = counts

    @property
    def started(self) -> int:
        """Requests received; started - ios are in flight."""
        return int(self._c.started)

    @property
    def ios(self) -> int:
        return int(self._c.ios)

    @property
    def bytes(self) -> int:
        return int(self._c.bytes)

    @property
    def errors(self) -> int:
        return int(self._c.errors)


class Driver:
    """What the per-I/O and batch drivers share: a worker's ring, its data
    plane and copy path, and the requests Python serves (one task each)."""

    def __init__(self, worker: Worker, ring: Ring, path: IoPath, *, batch: bool) -> None:
        self.w = worker
        self.ring = ring
        self.path = path
        self.char_fd = worker.char_fd
        self.failed = 0  # the first error the kernel answered an arming command with
        self.inflight = 0  # requests Python started and has not answered yet
        cfg = worker.cfg
        self.depth = cfg.depth
        work = worker.spec.work
        self.dp = ring.data_plane({
            "char_fd": worker.char_fd, "batch": int(batch), "mode": path.mode.data_plane,
            "auto_zc_fallback": int(cfg.auto_zc_fallback), "nr_queues": len(work),
            "depth": cfg.depth, "max_io": cfg.max_io_size,
            "op_fetch_req": uapi.IoCmd.FETCH_REQ,
            "op_commit_and_fetch": uapi.IoCmd.COMMIT_AND_FETCH_REQ,
            "op_fetch_io_cmds": uapi.IoCmd.FETCH_IO_CMDS,
            "op_commit_io_cmds": uapi.IoCmd.COMMIT_IO_CMDS,
            "op_register_buf": uapi.IoCmd.REGISTER_IO_BUF,
            "op_unregister_buf": uapi.IoCmd.UNREGISTER_IO_BUF,
            "fetch_buf_bytes": cfg.fetch_buf_bytes or 2 * min(cfg.depth, 128),
            "fetch_buf_entries": cfg.fetch_buf_entries or 8, "poll_us": POLL_US,
        }, len(work), self._on_event)
        self._views: list[Any] = []  # the C side's views of the queues' memory
        for local, (qm, _tags) in enumerate(work):
            descs = ffi.from_buffer(qm.descs)
            # the kernel's buffer address for each tag (copy mode; with -u the
            # buffers are ours alone, and the kernel refuses an address)
            kernel_bufs = qm.bufs is not None and path.mode.kernel_buffers
            bufs = ffi.from_buffer(qm.bufs) if kernel_bufs else ffi.NULL
            self._views += [descs, bufs]
            lib.aur_dp_queue(self.dp.c, local, qm.q_id, descs, bufs, self.dp.counts + local)
        self.stats = {qm.q_id: QueueStats(self.dp.counts[local])
                      for local, (qm, _tags) in enumerate(work)}
        if path.debug or path.mode.data_plane == lib.AUR_DP_OTHER:
            self.w.log.debug("data plane off: every request is served in Python")
        else:
            self.dp.set_map(worker.target.map())
        #: ending (the kernel aborted a command, or a detach began): serve what
        #: is held, start nothing new, then end
        self._stopping = False
        #: drain has returned: the target's final write-back may have run, so
        #: a request still finishing must not be acknowledged (see settle)
        self.sealed = False
        self._drained: asyncio.Future[None] | None = None
        self.loop = asyncio.get_running_loop()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        self.dp.set_stopping(value)

    def arm(self) -> None:
        """Queue the commands that must reach the kernel before START_DEV."""
        raise NotImplementedError

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        """A record of the data plane: what C left to Python."""
        kind, local, tag, aux = decode(ud)
        if kind == EV_RETRY:
            self.retry(local, tag)
        elif kind == EV_IDLE:
            if not self.inflight and self.stopping:
                self.idle()
        elif kind == EV_LOST:
            self.w.log.warning("request finished after the final write-back: left to the "
                               "kernel", tag=tag)
        else:
            self.event(kind, local, tag, aux, res, flags)

    def event(self, kind: int, local: int, tag: int, aux: int, res: int, flags: int) -> None:
        """The driver's own records (per-I/O or batch commands)."""
        raise NotImplementedError

    def retry(self, local: int, tag: int) -> None:
        """A request C started and could not finish: Python serves it anew."""
        raise NotImplementedError

    def start(self, qm: QueueMem, tag: int, done: Done) -> bool:
        """Start a request on the target's fast path (``done`` answers it)."""
        self.inflight += 1
        try:
            started = self.path.start(qm, tag, done)
        except Exception:  # noqa: BLE001 - the coroutine path still serves it
            self.w.log.exception("target fast path raised")
            started = False
        if not started:
            self.inflight -= 1
        return started

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start one request; it calls ``answered`` when done. (A pending task
        stays referenced through the ring future it awaits: no set to keep.)"""
        self.inflight += 1
        self.loop.create_task(coro)

    def answered(self) -> None:
        self.inflight -= 1
        if not self.inflight and self.stopping and not self.dp.inflight:
            self.idle()

    def settle(self, tag: int) -> bool:
        """A request is done: whether its answer may go to the kernel. Not once
        drain has given up on it: acknowledging it after the target's final
        write-back could lose its data, so the kernel fails or reissues it
        when /dev/ublkcN closes."""
        self.answered()
        if self.sealed:
            self.w.log.warning("request finished after the final write-back: left to the "
                               "kernel", tag=tag)
            return False
        return True

    def commit(self, local: int, tag: int, res: int) -> None:
        """Python's answer to a request, queued in C for the end of this turn."""
        ret = lib.aur_dp_answer(self.dp.c, local, tag, res)
        if ret < 0:
            self.w.log.error("cannot queue a request's answer", tag=tag, error=ret)
        self.ring.request_flush()

    def idle(self) -> None:
        """Nothing is in flight any more, and the device is going away."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Let the requests in flight finish (bounded) after the device stopped."""
        self.stopping = True
        if self.inflight or self.dp.inflight:
            self._drained = self.loop.create_future()
            try:
                await asyncio.wait_for(self._drained, DRAIN_SECONDS)
            except TimeoutError:
                self.w.log.warning("requests still in flight at stop",
                                   n=self.inflight + self.dp.inflight)
        self.sealed = True
        self.dp.set_sealed()

    def close(self) -> None:
        """Release what outlives the ring (called after the ring is closed):
        the C side's views of the queues' memory, which would otherwise keep
        the mappings, and with them /dev/ublkcN, open (DEL_DEV waits for it)."""
        for v in self._views:
            if v != ffi.NULL:
                ffi.release(v)
        self._views.clear()


@dataclass
class WorkerSpec:
    """What one worker thread serves."""

    index: int
    work: list[tuple[QueueMem, list[int]]]
    prep: set[int]  # batch: queues whose tags this worker prepares before START_DEV


class Worker:
    """One thread, one uvloop loop, one Ring: serves its share of the queues."""

    def __init__(self, cfg: DeviceConfig, spec: WorkerSpec, char_fd: int, target: Target,
                 batch: bool) -> None:
        self.cfg = cfg
        self.spec = spec
        self.char_fd = char_fd
        self.target = target
        self.mode = cfg.copy
        self.batch = batch
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.drain_error: Exception | None = None  # the target's final write-back failed
        self.driver: Driver | None = None  # while serving (stats)
        self.thread = threading.Thread(target=self._run, name=f"ublk{cfg.dev_id}w{spec.index}",
                                       daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._finish = False  # finished() came before the loop ran
        self.siblings: list[Worker] = []  # every worker of the device (set by Device)
        self.siblings_told = False
        self.log = log.bind(dev=cfg.dev_id, worker=spec.index)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        import uvloop

        # every log line of this thread's tasks names the device and worker
        structlog.contextvars.bind_contextvars(dev=self.cfg.dev_id, worker=self.spec.index)
        loop = uvloop.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the control plane
            self.error = e
            self.log.error("worker failed", error=str(e))
        finally:
            self.ready.set()
            loop.close()

    @property
    def nr_tags(self) -> int:
        return sum(len(tags) for _qm, tags in self.spec.work)

    @property
    def table_size(self) -> int:
        """Buffer-table slots the ring needs (zero copy): one per tag it may see;
        with batch any tag of its queues, indexed queue-major."""
        return len(self.spec.work) * self.cfg.depth if self.batch else self.nr_tags

    async def _main(self) -> None:
        depth = max(self.nr_tags, 1)
        ring = Ring(
            max(2 * depth, 64), cq_entries=max(8 * depth, 256),
            flags=queue_ring_flags(), bind_thread=True,
        )
        self._stop = asyncio.get_running_loop().create_future()
        if self._finish:
            self._stop.set_result(None)
        path = IoPath(self.target, ring, self.char_fd, self.mode)
        driver: Driver
        if self.batch:
            from aioublk.batch import BatchDriver

            driver = BatchDriver(self, ring, path)
        else:
            driver = PerIoDriver(self, ring, path)
        self.driver = driver
        try:
            if self.mode.fixed:
                ring.register_buffers_sparse(self.table_size)
            driver.arm()
            if driver.failed:
                raise OSError(-driver.failed, "the kernel refused the queue's commands: "
                              + os.strerror(-driver.failed))
            self.ready.set()
            await self._stop
            await driver.drain()
            try:
                await self.target.drain()
            except Exception as e:  # noqa: BLE001 - reported through the device
                self.drain_error = e
                self.log.error("the target's final write-back failed: data it acknowledged "
                               "may be lost", error=str(e))
        finally:
            # Stopping, the requests are drained: what is left are ublk
            # commands (re-armed fetches after a quiesce), which io_uring's
            # cancel cannot reach and the ring's exit will: a short wait reaps
            # those the kernel is still completing.
            ring.close(timeout=1.0 if driver.stopping else 5.0)
            driver.close()
            self.driver = None
            del driver, path

    def finished(self) -> None:
        """Stop serving (on this worker's loop): drain, then close the ring."""
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def request_finish(self) -> None:
        """``finished`` from any thread; a worker already gone is left alone."""
        self._finish = True  # seen by _main if its loop has not run yet
        loop = self.loop
        if loop is None or not self.thread.is_alive():
            return
        try:
            loop.call_soon_threadsafe(self.finished)
        except RuntimeError:  # its loop closed meanwhile
            pass

    def device_ending(self) -> None:
        """The kernel aborted one of our commands: the device is stopping or
        being quiesced, so every worker of it ends (a quiesce aborts only
        idle tags, and a worker whose tags are all busy would see none)."""
        if self.siblings_told:
            return
        self.siblings_told = True
        for w in self.siblings:
            if w is not self:
                w.request_finish()


def queue_ring_flags() -> int:
    """Setup flags for a worker's ring: single issuer, cooperative task work
    (run at the thread's next syscall, no IPI). Measured in the guest against
    DEFER_TASKRUN, whose wake needs a second enter that waits with a zero
    timeout (about 9 us per wake): 4k reads at qd64, null 5.7k -> 9.2k IOPS,
    qcow2 2.5k -> 3.8k, loop 3.0k -> 3.7k."""
    from aioublk._uring import lib

    return int(lib.IORING_SETUP_SINGLE_ISSUER | lib.IORING_SETUP_COOP_TASKRUN)


class PerIoDriver(Driver):
    """``FETCH_REQ`` / ``COMMIT_AND_FETCH_REQ`` for every tag a worker owns
    (the commands themselves are built and, for mapped requests, answered in C)."""

    def __init__(self, worker: Worker, ring: Ring, path: IoPath) -> None:
        super().__init__(worker, ring, path, batch=False)
        # (queue, local index, tag) per owned tag; its slot is its buffer-table index
        self.slots: list[tuple[QueueMem, int, int]] = []
        self.slot_of: list[list[int]] = []
        for local, (qm, tags) in enumerate(worker.spec.work):
            self.slot_of.append([-1] * self.depth)
            for tag in tags:
                slot = len(self.slots)
                self.slot_of[local][tag] = slot
                lib.aur_dp_buf_index(self.dp.c, local, tag, slot)
                self.slots.append((qm, local, tag))
        self.live = len(self.slots)
        self.dones = [partial(self._answer, slot) for slot in range(len(self.slots))]

    def arm(self) -> None:
        hook = self.path.arming
        for qm, local, tag in self.slots:
            if hook is not None:
                hook(qm.q_id, tag)
            self.dp.check(lib.aur_dp_fetch_req(self.dp.c, local, tag), "cannot queue FETCH_REQ")
        # FETCH must reach the kernel before START_DEV; errors come back at once
        self.ring.submit_now()
        self.ring.reap_now()

    def event(self, kind: int, local: int, tag: int, aux: int, res: int, flags: int) -> None:
        self._on_cqe(self.slot_of[local][tag], res)

    def retry(self, local: int, tag: int) -> None:
        self.spawn(self._serve(self.slot_of[local][tag]))

    def _on_cqe(self, slot: int, res: int) -> None:
        """A tag's command completed and C did not serve what it brought."""
        if res == uapi.IO_RES_OK:
            if self.stopping:
                # as on the batch path: once the worker is ending, a new
                # request is the kernel's to reissue or fail (the tag is
                # not re-armed)
                self.w.log.info("request left to the kernel at stop", slot=slot)
                self.live -= 1
                if self.live == 0:
                    self.w.finished()
                return
            qm, _local, tag = self.slots[slot]
            if not self.start(qm, tag, self.dones[slot]):
                self.spawn(self._serve(slot))
            return
        self.live -= 1
        if res not in (-errno.ENODEV, -errno.ECANCELED):  # (ECANCELED: our ring closed)
            # the kernel refused this tag's command: the tag is lost, the rest serve on
            self.w.log.warning("io command failed", slot=slot, res=res)
            if not self.failed:
                self.failed = res
            if self.live == 0:
                self.w.finished()
            return
        # Aborted. On STOP_DEV every tag is aborted once nothing is in flight;
        # on QUIESCE_DEV only the idle ones are (maybe none of this worker's):
        # every worker of the device ends once the requests it holds are
        # committed; re-armed commands go with the rings.
        self.stopping = True
        self.w.device_ending()
        if self.live == 0 or not (self.inflight or self.dp.inflight):
            self.w.finished()

    def idle(self) -> None:
        super().idle()
        self.w.finished()

    async def _serve(self, slot: int) -> None:
        qm, _local, tag = self.slots[slot]
        try:
            res = await self.path.serve(qm, tag, slot)
        except BaseException:
            self.answered()
            raise
        self._answer(slot, res)

    def _answer(self, slot: int, res: int) -> None:
        qm, local, tag = self.slots[slot]
        if self.settle(tag):
            self.commit(local, tag, res)
