"""A ublk queue: one thread, one uvloop loop, one Ring, one coroutine per
request.

The per-tag protocol (per-I/O path, every kernel):

    FETCH_REQ ──► (request arrives: CQE res 0) ──► target coroutine
        ▲                                              │
        └──────────── COMMIT_AND_FETCH_REQ(result) ◄───┘

A CQE with res -ENODEV means the kernel aborted the tag (device stopped or
deleted): the tag is finished and is not re-armed. The queue ends when every
tag is finished. Commands for a tag must be issued by the thread that fetched
it, which holds because each queue's Ring is used only by its own thread.

``serve_request`` (the op → target dispatch) is shared with the batch driver
in ``batch.py``.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import structlog

from aioublk import uapi
from aioublk.ring import Ring, buffer_address
from aioublk.target import Target

if TYPE_CHECKING:
    from aioublk.device import DeviceConfig

log = structlog.get_logger("aioublk.queue")

_READ, _WRITE, _FLUSH, _DISCARD, _WRITE_ZEROES = (
    uapi.Op.READ, uapi.Op.WRITE, uapi.Op.FLUSH, uapi.Op.DISCARD, uapi.Op.WRITE_ZEROES)


async def serve_request(target: Target, op_flags: int, nr_sectors: int, start_sector: int,
                        buf: memoryview) -> int:
    """Run one request on the target; returns the result for the kernel
    (bytes for read/write, 0 for the others, -errno on failure)."""
    op = op_flags & 0xFF
    offset = start_sector << 9
    length = nr_sectors << 9
    try:
        if op == _READ:
            await target.read(offset, buf[:length])
            return length
        if op == _WRITE:
            await target.write(offset, buf[:length], bool(op_flags & uapi.IO_F_FUA))
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
        log.exception("target raised", op=op, offset=offset, length=length)
        return -errno.EIO


class Queue:
    """Serves one hardware queue of a device on a thread of its own."""

    def __init__(self, cfg: DeviceConfig, q_id: int, char_fd: int, target: Target,
                 max_io: int) -> None:
        self.cfg = cfg
        self.q_id = q_id
        self.depth = cfg.depth
        self.char_fd = char_fd
        self.target = target
        self.max_io = max_io
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"ublk{cfg.dev_id}q{q_id}",
                                       daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self.log = log.bind(q=q_id)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the control plane
            self.error = e
            self.log.error("queue failed", error=str(e))
        finally:
            self.ready.set()
            loop.close()

    async def _main(self) -> None:
        depth = self.depth
        ring = Ring(
            max(2 * depth, 64), cq_entries=max(8 * depth, 256),
            flags=queue_ring_flags(), bind_thread=True,
        )
        descs = mmap.mmap(self.char_fd, uapi.desc_area_size(depth), mmap.MAP_SHARED,
                          mmap.PROT_READ, offset=uapi.desc_mmap_offset(self.q_id))
        bufs = mmap.mmap(-1, depth * self.max_io, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._stop = asyncio.get_running_loop().create_future()
        driver = PerIoDriver(self, ring, descs, bufs)
        try:
            driver.arm()
            if driver.failed:
                raise OSError(-driver.failed, "FETCH_REQ refused by the kernel: "
                              + os.strerror(-driver.failed))
            self.ready.set()
            await self._stop
            await driver.drain()
        finally:
            ring.close()
            del driver
            descs.close()
            try:
                bufs.close()
            except BufferError:
                pass  # a straggling view; the mapping goes with the process

    def finished(self) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)


def queue_ring_flags() -> int:
    """Setup flags for a queue's ring: single issuer and deferred task work
    (completions are run only when the queue's own thread asks for them)."""
    from aioublk._uring import lib

    return int(lib.IORING_SETUP_SINGLE_ISSUER | lib.IORING_SETUP_DEFER_TASKRUN
               | lib.IORING_SETUP_COOP_TASKRUN)


class PerIoDriver:
    """``FETCH_REQ`` / ``COMMIT_AND_FETCH_REQ`` for every tag of a queue."""

    def __init__(self, queue: Queue, ring: Ring, descs: mmap.mmap, bufs: mmap.mmap) -> None:
        self.q = queue
        self.ring = ring
        self.descs = descs
        self.target = queue.target
        depth = queue.depth
        max_io = queue.max_io
        base = buffer_address(bufs)
        self.addrs = [base + t * max_io for t in range(depth)]
        view = memoryview(bufs)
        self.views = [view[t * max_io:(t + 1) * max_io] for t in range(depth)]
        self.handlers: list[Callable[[int, int], None]] = [
            partial(self._on_cqe, t) for t in range(depth)]
        self.live = depth
        self.busy: set[asyncio.Task[None]] = set()
        self.failed = 0
        self.loop = asyncio.get_running_loop()
        self._unpack = uapi.IO_DESC.unpack_from

    def arm(self) -> None:
        q = self.q
        for tag in range(q.depth):
            self.ring.prep_ublk_io(q.char_fd, uapi.IoCmd.FETCH_REQ, q.q_id, tag, 0,
                                   self.addrs[tag], self.handlers[tag])
        # FETCH must reach the kernel before START_DEV; errors come back at once
        self.ring.submit_now()
        self.ring._reap()

    def _on_cqe(self, tag: int, res: int, flags: int) -> None:
        if res == uapi.IO_RES_OK:
            op_flags, nr, sector, _addr = self._unpack(self.descs, tag * 24)
            task = self.loop.create_task(self._serve(tag, op_flags, nr, sector))
            self.busy.add(task)
            task.add_done_callback(self.busy.discard)
            return
        if res != -errno.ENODEV:
            self.q.log.warning("io command failed", tag=tag, res=res)
            if not self.failed:
                self.failed = res
        self.live -= 1
        if self.live == 0:
            self.q.finished()

    async def _serve(self, tag: int, op_flags: int, nr: int, sector: int) -> None:
        res = await serve_request(self.target, op_flags, nr, sector, self.views[tag])
        q = self.q
        self.ring.prep_ublk_io(q.char_fd, uapi.IoCmd.COMMIT_AND_FETCH_REQ, q.q_id, tag, res,
                               self.addrs[tag], self.handlers[tag])

    async def drain(self) -> None:
        if self.busy:
            await asyncio.wait(list(self.busy), timeout=5)
