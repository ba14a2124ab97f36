"""The per-I/O queue driver (every kernel): ``FETCH_REQ`` and
``COMMIT_AND_FETCH_REQ`` for each tag a worker owns.

The per-tag protocol:

    FETCH_REQ ──► (request arrives: CQE res 0) ──► target coroutine
        ▲                                              │
        └──────────── COMMIT_AND_FETCH_REQ(result) ◄───┘

A CQE with res -ENODEV means the kernel aborted the tag (device stopped or
deleted): the tag is finished and is not re-armed. A worker ends when all its
tags are finished. Commands for a tag must come from the thread that fetched
it; every worker uses only its own Ring, so that holds. The commands
themselves are built, and for mapped requests answered, in C (the data plane).
"""

from __future__ import annotations

import errno
from functools import partial

from aioublk._uring import lib
from aioublk.kernel import uapi
from aioublk.queue.driver import Driver, IoPath, QueueMem, Serving
from aioublk.queue.lifecycle import PER_IO, Event
from aioublk.ring import Ring


class PerIoDriver(Driver):
    """``FETCH_REQ`` / ``COMMIT_AND_FETCH_REQ`` for every tag a worker owns
    (the commands themselves are built and, for mapped requests, answered in C)."""

    table = PER_IO
    batch = False

    def __init__(self, worker: Serving, ring: Ring, path: IoPath) -> None:
        super().__init__(worker, ring, path)
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
            if not self.life.starts:
                # as on the batch path: once the worker is ending, a new
                # request is the kernel's to reissue or fail (the tag is
                # not re-armed)
                self.w.log.info("request left to the kernel at stop", slot=slot)
                self.live -= 1
                if self.live == 0:
                    self.fire(Event.NOTHING_ARMED)
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
                self.fire(Event.NOTHING_ARMED)
            return
        # Aborted. On STOP_DEV every tag is aborted once nothing is in flight;
        # on QUIESCE_DEV only the idle ones are (maybe none of this worker's):
        # every worker of the device ends once the requests it holds are
        # committed; re-armed commands go with the rings.
        self.fire(Event.ABORT)
        if self.live == 0:
            self.fire(Event.NOTHING_ARMED)
        elif not (self.inflight or self.dp.inflight):
            self.fire(Event.LAST_ANSWERED)

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
