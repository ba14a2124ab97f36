"""The queue driver's core, shared by the per-I/O (``perio.py``) and batch
(``batch.py``) drivers: one hardware queue's memory (``QueueMem``), the copy
path that runs a request on the target in the device's copy mode
(``IoPath`` and ``serve_request``, the op -> target dispatch), the counters
(``QueueStats``), and ``Driver``: a worker's ring, its C data plane, and the
requests Python serves.

A driver knows its worker only as ``Serving`` (what it serves, where to log,
how to say it is finished), so this module imports no worker and no device:
the import order is uapi -> ring -> target -> options -> driver ->
perio/batch -> worker -> device.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Protocol, cast

from aioublk import logs
from aioublk._uring import ffi, lib
from aioublk.dataplane import plane as dataplane
from aioublk.dataplane.plane import (
    EV_EXT,
    EV_HELD,
    EV_IDLE,
    EV_LOST,
    EV_RETRY,
    DataPlane,
    decode,
)
from aioublk.kernel import uapi
from aioublk.queue.lifecycle import Action, Event, Lifecycle, State, Table
from aioublk.queue.options import CopyMode, DeviceConfig
from aioublk.ring import Ring, keep
from aioublk.target import Buffer, Done, FixedBuf, Target

log = logs.get_logger("aioublk.queue")
#: how long a stopping worker waits for the requests it holds to finish
DRAIN_SECONDS = 5.0
#: how long the data plane waits in C for the next completion, while it alone
#: has work, before the queue's loop gets its turn (see dataplane/csrc/reap.c)
POLL_US = 1000
#: instead, for a ``Target.c_idle`` target: everything its loop needs comes as
#: a CQE (ring I/O, ublk commands, the worker's kick), so C may idle long; a
#: loop timer (the grace, the drain's bound) runs late by at most this
IDLE_US = 20000
#: what C moves with pread/pwrite in its own thread rather than through the
#: ring, where io_uring would hand each one to an io-wq worker (no NOWAIT
#: support): -u's copies to /dev/ublkcN, pieces in tmpfs/ramfs files
INLINE_IO = lib.AUR_DP_INLINE_CHAR | lib.AUR_DP_INLINE_RAM
#: how long a batch worker the kernel aborted waits for its fetches to end
GRACE_SECONDS = 2.0

_READ, _WRITE, _FLUSH, _DISCARD, _WRITE_ZEROES = (
    uapi.Op.READ, uapi.Op.WRITE, uapi.Op.FLUSH, uapi.Op.DISCARD, uapi.Op.WRITE_ZEROES)
_ZONE_APPEND, _REPORT_ZONES = uapi.Op.ZONE_APPEND, uapi.Op.REPORT_ZONES
#: the ops whose data the server reads from the request / writes into it
_DATA_IN = (_WRITE, _ZONE_APPEND)
_DATA_OUT = (_READ, _REPORT_ZONES)
#: zone operations without data: the target's method for each
_ZONE_OPS = {uapi.Op.ZONE_OPEN: "zone_open", uapi.Op.ZONE_CLOSE: "zone_close",
             uapi.Op.ZONE_FINISH: "zone_finish", uapi.Op.ZONE_RESET: "zone_reset"}


def data_bytes(op_flags: int, nr: int) -> int:
    """The bytes of a request's data: a zone report's ``nr`` counts zones."""
    return nr * uapi.BLK_ZONE.size if op_flags & 0xFF == _REPORT_ZONES else nr << 9


async def serve_request(target: Target, op_flags: int, nr_sectors: int, start_sector: int,
                        buf: Buffer, *, q: int = -1, tag: int = -1,
                        append_at: Callable[[int], None] | None = None,
                        meta: memoryview | None = None) -> int:
    """Run one request on the target; returns the result for the kernel
    (bytes for read/write, 0 for the others, -errno on failure). A zone
    append's sector goes to ``append_at``, for the commit; a request's
    integrity metadata, if any, goes to read/write as ``meta``."""
    op = op_flags & 0xFF
    offset = start_sector << 9
    length = nr_sectors << 9
    try:
        # (a FixedBuf only reaches targets that declared fixed_buffers)
        if op == _READ:
            if meta is not None:
                await target.read(offset, cast(memoryview, buf[:length]),
                                  meta=meta)  # type: ignore[call-arg]
            else:
                await target.read(offset, cast(memoryview, buf[:length]))
            return length
        if op == _WRITE:
            fua = bool(op_flags & uapi.IO_F_FUA)
            if meta is not None:
                await target.write(offset, cast(memoryview, buf[:length]), fua,
                                   meta=meta)  # type: ignore[call-arg]
            else:
                await target.write(offset, cast(memoryview, buf[:length]), fua)
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
        return await _serve_zoned(target, op, op_flags, nr_sectors, offset, buf, append_at)
    except OSError as e:
        return -(e.errno or errno.EIO)
    except Exception:
        log.exception("target raised: request failed with EIO", q=q, tag=tag, op=op,
                      offset=offset, length=length)
        return -errno.EIO


async def _serve_zoned(target: Target, op: int, op_flags: int, nr: int, offset: int,
                       buf: Buffer, append_at: Callable[[int], None] | None) -> int:
    """The zoned device's own ops (``UBLK_F_ZONED``); others: EOPNOTSUPP."""
    if op == _ZONE_APPEND:
        length = nr << 9
        at = await target.zone_append(offset, cast(memoryview, buf[:length]),
                                      bool(op_flags & uapi.IO_F_FUA))
        if append_at is not None:
            append_at(at >> 9)
        return length
    if op == _REPORT_ZONES:
        length = data_bytes(op_flags, nr)
        await target.report_zones(offset, cast(memoryview, buf[:length]))
        return length
    if op == uapi.Op.ZONE_RESET_ALL:
        await target.zone_reset_all()
        return 0
    name = _ZONE_OPS.get(op)  # type: ignore[call-overload]
    if name is None:
        return -errno.EOPNOTSUPP
    await getattr(target, name)(offset)
    return 0


class QueueMem:
    """One hardware queue's memory, shared by the workers that serve it: the
    kernel's read-only request descriptors, (copy modes) one buffer per tag
    and the device's registered shared buffers (``--shmem_zc``), by index."""

    def __init__(self, char_fd: int, q_id: int, depth: int, max_io: int, mode: CopyMode) -> None:
        self.q_id = q_id
        self.depth = depth
        self.descs = mmap.mmap(char_fd, uapi.desc_area_size(depth), mmap.MAP_SHARED,
                               mmap.PROT_READ, offset=uapi.desc_mmap_offset(q_id))
        self.bufs: mmap.mmap | None = None
        self.views: list[memoryview] = []
        if mode.own_buffers:
            self.bufs = mmap.mmap(-1, depth * max_io, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = memoryview(self.bufs)
            self.views = [view[t * max_io:(t + 1) * max_io] for t in range(depth)]
        self.unpack = partial(uapi.IO_DESC.unpack_from, self.descs)
        #: the device fills it (one dict for all its queues) as it registers them
        self.shared: dict[int, memoryview] = {}

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
        #: zoned: where a zone append's sector goes for its commit (q_id, tag,
        #: sector); the driver sets it
        self.zone_lba: Callable[[int, int, int], None] | None = None
        #: UBLK_F_INTEGRITY: the metadata format (the driver sets it)
        self.integrity: uapi.Integrity | None = None

    def start(self, qm: QueueMem, tag: int, done: Done) -> bool:
        """The target's task-free path (``Target.start_read``/``start_write``),
        where the copy mode and the op allow it; False: use ``serve``."""
        if not self.fast:
            return False
        op_flags, nr, sector, _addr = qm.unpack(tag * 24)
        op = op_flags & 0xFF
        if op_flags & uapi.IO_F_SHMEM_ZC:
            return False
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
        op_flags, nr, sector, addr = qm.unpack(tag * 24)
        mode = self.mode
        op = op_flags & 0xFF
        if op_flags & uapi.IO_F_SHMEM_ZC:  # whatever the mode: the data is in our mapping
            return self._shared(qm, tag, op_flags, nr, sector, addr)
        if mode is CopyMode.USER_COPY and (op in _DATA_IN or op in _DATA_OUT):
            return self._user_copy(qm, tag, op_flags, nr, sector)
        if mode is CopyMode.COPY or op not in (_READ, _WRITE):
            return serve_request(self.target, op_flags, nr, sector,
                                 qm.views[tag] if qm.views else _NO_DATA, q=qm.q_id, tag=tag)
        if mode is CopyMode.ZERO_COPY or op_flags & uapi.IO_F_NEED_REG_BUF:
            return self._registered(qm, tag, index, op_flags, nr, sector)
        return serve_request(self.target, op_flags, nr, sector, FixedBuf(index, 0, nr << 9),
                             q=qm.q_id, tag=tag)

    async def _user_copy(self, qm: QueueMem, tag: int, op_flags: int, nr: int,
                         sector: int) -> int:
        op = op_flags & 0xFF
        view = qm.views[tag][:data_bytes(op_flags, nr)]
        pos = uapi.user_copy_offset(qm.q_id, tag)
        append_at = None
        if op == _ZONE_APPEND and self.zone_lba is not None:
            append_at = partial(self.zone_lba, qm.q_id, tag)
        meta = None
        if op_flags & uapi.IO_F_INTEGRITY and self.integrity is not None:
            # small (a few bytes per sector) and rare: a buffer per request
            meta = memoryview(bytearray(self.integrity.meta_bytes(len(view))))
        meta_pos = uapi.user_copy_offset(qm.q_id, tag, integrity=True)
        try:
            if op in _DATA_IN and not await self._char_io(self.ring.read, view, pos):
                return -errno.EIO
            if meta is not None and op in _DATA_IN and not await self._char_io(
                    self.ring.read, meta, meta_pos):
                return -errno.EIO
            res = await serve_request(self.target, op_flags, nr, sector, view, q=qm.q_id,
                                      tag=tag, append_at=append_at, meta=meta)
            if op in _DATA_OUT and res > 0 and not await self._char_io(
                    self.ring.write, view[:res], pos):
                return -errno.EIO
            if meta is not None and op in _DATA_OUT and res > 0 and not await self._char_io(
                    self.ring.write, meta, meta_pos):
                return -errno.EIO
            return res
        except OSError as e:
            return -(e.errno or errno.EIO)

    async def _shared(self, qm: QueueMem, tag: int, op_flags: int, nr: int, sector: int,
                      addr: int) -> int:
        """--shmem_zc: the request's data is at (index, offset) of a shared
        buffer we registered; the kernel copies nothing either way."""
        index, offset = uapi.shmem_zc_place(addr)
        buf = qm.shared.get(index)
        length = nr << 9
        if buf is None or offset + length > len(buf):
            log.warning("SHMEM_ZC request outside the registered buffers", q=qm.q_id, tag=tag,
                        index=index, offset=offset, length=length)
            return -errno.EFAULT
        if buf.readonly and (op_flags & 0xFF) in _DATA_OUT:
            return -errno.EFAULT  # (a read-only buffer only matches writes)
        return await serve_request(self.target, op_flags, nr, sector,
                                   buf[offset:offset + length], q=qm.q_id, tag=tag)

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

    @property
    def c_served(self) -> int:
        """Requests the C data plane served from fetch to commit."""
        return int(self._c.c_served)

    @property
    def py_handed(self) -> int:
        """Requests C handed to Python: misses (as fetched) and retries."""
        return int(self._c.py_handed)

    @property
    def wakes(self) -> int:
        """The data plane's returns to Python after C served or completed
        requests (counted on the data plane's first queue, 0 on the others)."""
        return int(self._c.wakes)

    @property
    def poll_timeouts(self) -> int:
        """The data plane's waits in C for more work that timed out (on its
        first queue, as ``wakes``)."""
        return int(self._c.poll_timeouts)

    @property
    def c_alloc(self) -> int:
        """Clusters C allocated from its extent-table pool for writes that
        completed (each one a record the target drains)."""
        return int(self._c.c_alloc)

    def latency(self) -> list[tuple[list[int], int]]:
        """Per op (``metrics.OPS``): the log2 buckets' counts and the
        latencies' sum in ns; read while C adds to them (a bucket may be one
        request behind another)."""
        c = self._c
        return [(list(c.lat[op]), int(c.lat_ns[op])) for op in range(lib.AUR_LAT_OPS)]



@dataclass
class WorkerSpec:
    """What one worker thread serves."""

    index: int
    work: list[tuple[QueueMem, list[int]]]
    prep: set[int]  # batch: queues whose tags this worker prepares before START_DEV


class Serving(Protocol):
    """What a driver needs of the worker that runs it (``worker.Worker``)."""

    cfg: DeviceConfig
    spec: WorkerSpec
    char_fd: int
    target: Target
    mode: CopyMode
    log: Any  # a bound structlog logger

    def finished(self) -> None:
        """Stop serving: drain, then close the ring."""

    def device_ending(self) -> None:
        """The kernel aborted a command: every worker of the device ends."""


class Driver:
    """What the per-I/O and batch drivers share: a worker's ring, its data
    plane and copy path, and the requests Python serves (one task each)."""

    #: each driver's own: its queue states' table, and whether it speaks
    #: UBLK_F_BATCH_IO (the worker reads it of the class it is handed)
    table: ClassVar[Table]
    batch: ClassVar[bool]

    def __init__(self, worker: Serving, ring: Ring, path: IoPath) -> None:
        self.w = worker
        self.ring = ring
        self.path = path
        self.char_fd = worker.char_fd
        self.failed = 0  # the first error the kernel answered an arming command with
        self.inflight = 0  # requests Python started and has not answered yet
        #: writes C served whose answers wait for the target (``held``)
        self._held: list[tuple[int, int, int]] = []
        self._settling: asyncio.Task[None] | None = None
        cfg = worker.cfg
        self.depth = cfg.depth
        work = worker.spec.work
        self.dp = DataPlane(ring, {
            "char_fd": worker.char_fd, "batch": int(self.batch), "mode": path.mode.data_plane,
            "auto_zc_fallback": int(cfg.auto_zc_fallback), "zoned": int(cfg.zoned),
            "nr_queues": len(work),
            "depth": cfg.depth, "max_io": cfg.max_io_size,
            "op_fetch_req": uapi.IoCmd.FETCH_REQ,
            "op_commit_and_fetch": uapi.IoCmd.COMMIT_AND_FETCH_REQ,
            "op_fetch_io_cmds": uapi.IoCmd.FETCH_IO_CMDS,
            "op_commit_io_cmds": uapi.IoCmd.COMMIT_IO_CMDS,
            "op_register_buf": uapi.IoCmd.REGISTER_IO_BUF,
            "op_unregister_buf": uapi.IoCmd.UNREGISTER_IO_BUF,
            "op_need_get_data": uapi.IoCmd.NEED_GET_DATA,
            "fetch_buf_bytes": cfg.fetch_buf_bytes or 2 * min(cfg.depth, 128),
            "fetch_buf_entries": cfg.fetch_buf_entries or 8, "poll_us": POLL_US,
            "idle_us": IDLE_US if worker.target.c_idle else 0, "inline_io": INLINE_IO,
        }, len(work), self._on_event)
        self.dp.set_timing(dataplane.timing)
        self._views: list[tuple[Any, Any]] = []  # the C side's views of the queues' memory
        for local, (qm, _tags) in enumerate(work):
            descs = ffi.from_buffer(qm.descs)
            # the tag buffers: the kernel copies to and from them (copy mode),
            # or C does through /dev/ublkcN (-u: the kernel never sees them)
            bufs = ffi.from_buffer(qm.bufs) if qm.bufs is not None else ffi.NULL
            self._views.append((descs, bufs))
            lib.aur_dp_queue(self.dp.c, local, qm.q_id, descs, bufs, self.dp.counts + local)
        self.stats = {qm.q_id: QueueStats(self.dp.counts[local])
                      for local, (qm, _tags) in enumerate(work)}
        if cfg.zoned:
            self._local = {qm.q_id: local for local, (qm, _tags) in enumerate(work)}
            path.zone_lba = self._zone_lba
        path.integrity = cfg.integrity
        if path.debug:  # -v logs each request: they all take the coroutine path
            self.w.log.debug("data plane off: every request is served in Python")
        elif cfg.integrity is not None:  # C moves no metadata: every request comes to Python
            self.w.log.debug("data plane off: integrity metadata is served in Python")
        else:
            self.dp.set_map(worker.target.map())
        #: live, stopping, drained, sealed: see lifecycle.py
        self.life = Lifecycle(self.table)
        self._drained: asyncio.Future[None] | None = None
        self.loop = asyncio.get_running_loop()

    @property
    def stopping(self) -> bool:
        """Ending (the kernel aborted a command, or a detach began): serve
        what is held, start nothing new, then end."""
        return self.life.stopping

    def fire(self, event: Event) -> tuple[Action, ...]:
        """Move the lifecycle on by ``event`` and carry out the actions that
        need no request (the caller does those that do: re-arm a fetch)."""
        actions = self.life.fire(event)
        for a in actions:
            if a is Action.SET_STOPPING:
                self.dp.set_stopping(True)
            elif a is Action.TELL_SIBLINGS:
                self.w.device_ending()
            elif a is Action.START_GRACE:  # (late by at most IDLE_US: C's wait)
                self.loop.call_later(GRACE_SECONDS, self.fire, Event.GRACE_FIRED)
            elif a is Action.RESOLVE_DRAINED:
                if self._drained is not None and not self._drained.done():
                    self._drained.set_result(None)
            elif a is Action.FINISH:
                self.w.finished()
            elif a is Action.SEAL:
                self.dp.set_sealed()
        return actions

    def arm(self) -> None:
        """Queue the commands that must reach the kernel before START_DEV."""
        raise NotImplementedError

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        """A record of the data plane: what C left to Python."""
        kind, local, tag, aux = decode(ud)
        if kind == EV_RETRY:
            self.retry(local, tag)
        elif kind == EV_HELD:
            self.held(local, tag, res)
        elif kind == EV_IDLE:
            if not self.inflight:
                self.fire(Event.LAST_ANSWERED)
        elif kind == EV_LOST:
            self.w.log.warning("request finished after the final write-back: left to the "
                               "kernel", tag=tag)
        elif kind == EV_EXT:
            self.dp.wake()
        else:
            self.event(kind, local, tag, aux, res, flags)

    def event(self, kind: int, local: int, tag: int, aux: int, res: int, flags: int) -> None:
        """The driver's own records (per-I/O or batch commands)."""
        raise NotImplementedError

    def retry(self, local: int, tag: int) -> None:
        """A request C started and could not finish: Python serves it anew."""
        raise NotImplementedError

    def held(self, local: int, tag: int, res: int) -> None:
        """A write C served whose answer waits for ``Target.settle_writes``:
        the writes held meanwhile share one call (a group commit)."""
        self.inflight += 1
        self._held.append((local, tag, res))
        if self._settling is None:
            self._settling = self.loop.create_task(self._settle_held())

    async def _settle_held(self) -> None:
        try:
            while self._held:
                batch, self._held = self._held, []
                failed = False
                try:
                    await self.path.target.settle_writes()
                except Exception as e:  # noqa: BLE001 - the writes fail, the server goes on
                    self.w.log.error("held writes could not be made durable", error=str(e))
                    failed = True
                for local, tag, res in batch:
                    if self.settle(tag):
                        self.commit(local, tag, -errno.EIO if failed else res)
        finally:
            self._settling = None

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
        if not self.inflight and self.life.stopping and not self.dp.inflight:
            self.fire(Event.LAST_ANSWERED)

    def settle(self, tag: int) -> bool:
        """A request is done: whether its answer may go to the kernel. Not once
        drain has given up on it: acknowledging it after the target's final
        write-back could lose its data, so the kernel fails or reissues it
        when /dev/ublkcN closes."""
        self.answered()
        if not self.life.commits:  # (sealed)
            self.w.log.warning("request finished after the final write-back: left to the "
                               "kernel", tag=tag)
            return False
        return True

    def _zone_lba(self, q_id: int, tag: int, sector: int) -> None:
        """A zone append's sector, for the commit of its request."""
        lib.aur_dp_zone_lba(self.dp.c, self._local[q_id], tag, sector)

    def commit(self, local: int, tag: int, res: int) -> None:
        """Python's answer to a request, queued in C for the end of this turn
        (C holds one the SQ cannot take until a later flush: it always goes)."""
        lib.aur_dp_answer(self.dp.c, local, tag, res)
        self.ring.request_flush()

    async def drain(self) -> None:
        """Let the requests in flight finish (bounded) after the device stopped."""
        self.fire(Event.DETACH)
        if not (self.inflight or self.dp.inflight):
            self.fire(Event.LAST_ANSWERED)
        if self.life.state is State.STOPPING:
            self._drained = self.loop.create_future()
            try:
                await asyncio.wait_for(self._drained, DRAIN_SECONDS)
            except TimeoutError:
                self.w.log.warning("requests still in flight at stop",
                                   n=self.inflight + self.dp.inflight)
                self.fire(Event.DRAIN_TIMEOUT)
        self.fire(Event.DRAIN_END)

    def close(self) -> None:
        """Release what outlives the ring (called after the ring is closed):
        the C side's views of the queues' memory, which would otherwise keep
        the mappings, and with them /dev/ublkcN, open (DEL_DEV waits for it).
        The tag buffers stay mapped for good when the closed ring left
        data-plane requests in the kernel."""
        stranded = self.ring.dp_stranded
        for descs, bufs in self._views:
            ffi.release(descs)
            if bufs == ffi.NULL:
                continue
            if stranded:  # a late read may still land in them: never unmapped
                keep(bufs)
            else:
                ffi.release(bufs)
        self._views.clear()

