"""Queue workers: one thread, one uvloop loop and one Ring each, serving a
share of the device's queues with the per-I/O or the batch driver.

Workers and queues (``options.layout``): by default one worker per queue.
With ``--per_io_tasks`` (``UBLK_F_PER_IO_DAEMON``) the (queue, tag) pairs
are dealt out to N workers in turn, so one busy queue keeps every worker
busy. The batch path maps N workers onto M queues round-robin, the way kublk
does: a worker may serve several queues and a queue several workers.
"""

from __future__ import annotations

import asyncio
import os
import threading

import structlog

from aioublk._uring import lib
from aioublk.dataplane.crossloop import LoopHandle
from aioublk.queue.driver import Driver, IoPath, WorkerSpec, log
from aioublk.queue.options import DeviceConfig
from aioublk.ring import Ring, queue_cq_entries, queue_ring_flags
from aioublk.target import QueueContext, Target, setup_queue, teardown_queue


class Worker:
    """One thread, one uvloop loop, one Ring: serves its share of the queues."""

    def __init__(self, cfg: DeviceConfig, spec: WorkerSpec, char_fd: int, target: Target,
                 driver: type[Driver], cpu: int | None = None) -> None:
        self.cfg = cfg
        self.cpu = cpu  # the CPU the thread is pinned to (options.placement)
        self.spec = spec
        self.char_fd = char_fd
        self.target = target
        self.mode = cfg.copy
        #: the driver's class (per-I/O or batch): the device, above both, picks it
        self.driver_class = driver
        self.batch = driver.batch
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.drain_error: Exception | None = None  # the target's final write-back failed
        self.driver: Driver | None = None  # while serving (stats)
        self.thread = threading.Thread(target=self._run, name=f"ublk{cfg.dev_id}w{spec.index}",
                                       daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        #: how other threads call into the loop (and wake it inside C)
        self.handle: LoopHandle | None = None
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

        if self.cpu is not None:  # first: what the thread allocates stays near it
            try:
                os.sched_setaffinity(0, {self.cpu})  # (0: this thread alone)
            except OSError as e:
                self.log.debug("not pinned", cpu=self.cpu, error=str(e))

        # every log line of this thread's tasks names the device and worker
        structlog.contextvars.bind_contextvars(dev=self.cfg.dev_id, worker=self.spec.index)
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            handle = LoopHandle.new(loop)
        except BaseException:
            loop.close()
            raise
        handle.bind()
        self.loop, self.handle = loop, handle
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the control plane
            self.error = e
            self.log.error("worker failed", error=str(e))
        finally:
            self.ready.set()
            loop.close()
            handle.close()

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
            # (the SQ holds a -z request's whole chain: pieces, register, unregister)
            max(2 * depth, 2 * lib.AUR_DP_MAX_PIECES), cq_entries=queue_cq_entries(depth),
            flags=queue_ring_flags(), bind_thread=True,
            sqe128=self.target.big_ring_entries, cqe32=self.target.big_ring_entries,
        )
        if self.handle is not None:  # (always, on the worker's thread)
            self.handle.watch(ring)  # a cross-thread call wakes C's wait on this ring
        stop = self._stop = asyncio.get_running_loop().create_future()
        if self._finish:
            stop.set_result(None)
        queue = QueueContext(self.spec.index, tuple(qm.q_id for qm, _tags in self.spec.work),
                             asyncio.get_running_loop())
        try:
            # before the driver exists: its map() and every request see a set-up loop
            await setup_queue(self.target, queue)
        except BaseException:
            ring.close()
            raise
        try:
            await self._serve(ring, stop)
        finally:
            await teardown_queue(self.target, queue)
            # Stopping, the requests are drained: what is left are ublk
            # commands (re-armed fetches after a quiesce), which io_uring's
            # cancel cannot reach and the ring's exit will: a short wait reaps
            # those the kernel is still completing.
            driver = self.driver
            ring.close(timeout=1.0 if driver is not None and driver.stopping else 5.0)
            if driver is not None:
                driver.close()
            self.driver = None
            del driver

    async def _serve(self, ring: Ring, stop: asyncio.Future[None]) -> None:
        """Arm the queues' commands, serve until told to stop, then drain the
        driver and the target (the ring is closed by the caller)."""
        path = IoPath(self.target, ring, self.char_fd, self.mode)
        driver = self.driver_class(self, ring, path)
        self.driver = driver
        try:
            if self.mode.fixed:
                ring.register_buffers_sparse(self.table_size)
            driver.arm()
            if driver.failed:
                raise OSError(-driver.failed, "the kernel refused the queue's commands: "
                              + os.strerror(-driver.failed))
            self.ready.set()
            await stop
            await driver.drain()
            try:
                await self.target.drain()
            except Exception as e:  # noqa: BLE001 - reported through the device
                self.drain_error = e
                self.log.error("the target's final write-back failed: data it acknowledged "
                               "may be lost", error=str(e))
        finally:
            del driver, path  # not kept alive by an exception's traceback

    def finished(self) -> None:
        """Stop serving (on this worker's loop): drain, then close the ring."""
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def request_finish(self) -> None:
        """``finished`` from any thread; a worker already gone is left alone."""
        self._finish = True  # seen by _main if its loop has not run yet
        handle = self.handle
        if handle is None or not self.thread.is_alive():
            return
        try:
            handle.call_soon(self.finished)  # (kicks: the thread may be waiting in C)
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

