"""``UBLK_F_BATCH_IO``: ``BatchDriver``, the queue driver. The commands and
their elements are encoded in C (``dataplane/csrc/commands.c``), the one place: the
data plane's commits and fetches, and the PREP it builds for ``arm``.

How a worker serves its queues with batch I/O:

- Before START_DEV, the first worker of each queue arms every tag of it with
  one ``PREP_IO_CMDS`` (with each tag's buffer in copy mode).
- Each worker keeps two multishot ``FETCH_IO_CMDS`` armed per queue over a
  provided-buffer group of its own; a completion carries up to 128 tags, each
  started as a coroutine. A fetch ends on -ENOBUFS or without ``F_MORE``
  (the kernel put the tags back): it is re-armed at once.
- Results are gathered per queue and sent as one ``COMMIT_IO_CMDS`` per queue
  at the end of the loop turn (a ring flush hook), so one command commits
  everything the turn finished. A partial commit is resent from the element
  after the one the kernel refused.
- Once the worker is stopping (an abort, or a detach on SIGTERM), tags a
  fetch still delivers are not started: the kernel reissues or fails them
  when /dev/ublkcN closes, and the target's final write-back (``drain``)
  comes after the last request the worker answered.

Facts from the kernel (drivers/block/ublk_drv.c, Linux 7.2):

- PREP/COMMIT_IO_CMDS carry a 16-byte ``ublk_batch_io`` in the SQE's command
  area and an array of elements at ``sqe->addr``. An element is an 8-byte
  header (tag u16, buf_index u16, result s32), then a u64 buffer address when
  ``UBLK_BATCH_F_HAS_BUF_ADDR`` is set (copy mode), then a u64 zone LBA when
  ``UBLK_BATCH_F_HAS_ZONE_LBA`` is set. ``elem_bytes`` must match the flags
  exactly and ``nr_elem`` may not exceed the queue depth (-E2BIG).
- COMMIT walks the elements in order and stops at the first one it refuses
  (e.g. -EBUSY: the tag is not owned by the server). It returns the bytes it
  processed, or that element's error when it is the first. So the element at
  the stop point is the bad one, and the ones after it are sent again.
  Sending the bad one again as it was would fail the same way forever, yet
  its request (if the tag is ours) waits for an answer: it is answered once
  more, as failed with EIO; a refused failure is logged as lost.
- FETCH_IO_CMDS completes with ``res`` bytes of u16 tags in the selected
  provided buffer.
"""

from __future__ import annotations

import errno
from functools import partial

from aioublk._uring import ffi, lib
from aioublk.dataplane.plane import EV_COMMIT, EV_FETCH, EV_TAG
from aioublk.kernel import uapi
from aioublk.queue.driver import Driver, IoPath, Serving
from aioublk.queue.lifecycle import BATCH, Action, Event
from aioublk.ring import Ring, buffer_address


class BatchDriver(Driver):
    """Serves a worker's queues with ``UBLK_F_BATCH_IO`` (see the module doc;
    fetches, their buffers and commits are the data plane's, in C)."""

    FETCHES = 2
    table = BATCH
    batch = True

    def __init__(self, worker: Serving, ring: Ring, path: IoPath) -> None:
        super().__init__(worker, ring, path)
        self.queues = [qm for qm, _tags in worker.spec.work]
        for local in range(len(self.queues)):
            for tag in range(self.depth):
                lib.aur_dp_buf_index(self.dp.c, local, tag, self._index(local, tag))
        self.dones = [[partial(self._answer, local, tag) for tag in range(self.depth)]
                      for local in range(len(self.queues))]
        self.live = 0
        ring.add_flush_hook(self._commit)

    # -- setup ----------------------------------------------------------------

    def _index(self, local: int, tag: int) -> int:
        return local * self.depth + tag

    def arm(self) -> None:
        results: list[int] = []
        expected = 0
        for local, qm in enumerate(self.queues):
            if qm.q_id not in self.w.spec.prep:
                continue
            if self.path.arming is not None:
                for tag in range(self.depth):
                    self.path.arming(qm.q_id, tag)
            cmd = bytearray(uapi.BATCH_IO.size)
            data = bytearray(self.depth * lib.AUR_DP_MAX_ELEM_BYTES)
            n = lib.aur_dp_prep_io_cmds(self.dp.c, local, ffi.from_buffer(cmd),
                                        ffi.from_buffer(data), len(data))
            self.dp.check(n, "cannot build PREP_IO_CMDS")
            self.ring.prep_cmd(self.char_fd, uapi.IoCmd.PREP_IO_CMDS, bytes(cmd),
                               addr=buffer_address(data), length=n,
                               handler=lambda res, _f: results.append(res), keep=data)
            expected += 1
        for local in range(len(self.queues)):
            ret = lib.aur_dp_provide(self.dp.c, local)
            if ret < 0:
                self.failed = ret
                return
            for _ in range(self.FETCHES):
                self._fetch(local)
        self.ring.submit_now()
        self.ring.reap_now()
        if len(results) < expected:
            self.failed = -errno.ETIMEDOUT  # PREP completes inline unless something broke
        self.failed = self.failed or min([0, *results])

    def _fetch(self, local: int) -> None:
        self.dp.check(lib.aur_dp_fetch_io_cmds(self.dp.c, local), "cannot queue FETCH_IO_CMDS")
        self.live += 1

    # -- what C leaves to Python ----------------------------------------------

    def event(self, kind: int, local: int, tag: int, aux: int, res: int, flags: int) -> None:
        if kind == EV_TAG:
            if not self.life.starts:
                # The worker is ending and the target may be writing back
                # for the last time: this is left to the kernel, which
                # reissues (-i 1) or fails it when /dev/ublkcN closes.
                self.w.log.info("request left to the kernel at stop",
                                q=self.queues[local].q_id, tag=tag)
            elif not self.start(self.queues[local], tag, self.dones[local][tag]):
                self.spawn(self._serve(local, tag))
        elif kind == EV_FETCH:
            self._fetch_ended(local, res)
        elif kind == EV_COMMIT:
            q = self.queues[local].q_id
            if aux == 0:
                self.w.log.warning("COMMIT_IO_CMDS refused a tag: its request fails", q=q,
                                   tag=tag, res=res or None)
            else:
                self.w.log.error("COMMIT_IO_CMDS refused a tag's failure: its request is "
                                 "lost", q=q, tag=tag, res=res or None,
                                 result=flags - (1 << 32))

    def retry(self, local: int, tag: int) -> None:
        self.spawn(self._serve(local, tag))

    def _fetch_ended(self, local: int, res: int) -> None:
        """A multishot fetch ended: re-arm it, or end the worker."""
        self.live -= 1
        if res >= 0 or res == -errno.ENOBUFS:
            if Action.REARM in self.fire(Event.FETCH_ENDED):
                self._fetch(local)
                return
        elif res not in (-errno.ENODEV, -errno.ECANCELED):  # (ECANCELED: our ring closed)
            self.w.log.warning("FETCH_IO_CMDS failed", q=self.queues[local].q_id, res=res)
            if not self.failed:
                self.failed = res
        else:
            # stop or quiesce: every worker of the device ends, this one
            # once its fetches have ended or its grace timer fires
            self.fire(Event.ABORT)
        if self.live == 0:
            self.fire(Event.NOTHING_ARMED)

    # -- commit ---------------------------------------------------------------

    async def _serve(self, local: int, tag: int) -> None:
        try:
            res = await self.path.serve(self.queues[local], tag, self._index(local, tag))
        except BaseException:
            self.answered()
            raise
        self._answer(local, tag, res)

    def _answer(self, local: int, tag: int, res: int) -> None:
        if self.settle(tag):
            self.commit(local, tag, res)

    def _commit(self) -> None:
        ret = lib.aur_dp_flush(self.dp.c)
        if ret < 0:
            self.w.log.error("cannot queue COMMIT_IO_CMDS", error=ret)

    async def drain(self) -> None:
        await super().drain()
        self._commit()
