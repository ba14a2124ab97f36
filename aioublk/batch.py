"""``UBLK_F_BATCH_IO``: the command encoding and commit bookkeeping (plain
classes, no I/O), and ``BatchDriver``, the queue driver built on them.

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
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from aioublk import uapi
from aioublk._uring import ffi, lib
from aioublk.queue import CopyMode, Driver, IoPath, QueueMem, QueueStats
from aioublk.ring import Ring, buffer_address

if TYPE_CHECKING:
    from aioublk.queue import Worker

F_HAS_ZONE_LBA = 1 << 0
F_HAS_BUF_ADDR = 1 << 1
F_AUTO_BUF_REG_FALLBACK = 1 << 2

_HEADER = uapi.ELEM_HEADER  # =HHi
_ADDR = struct.Struct("=Q")


def elem_bytes(flags: int) -> int:
    """Size of one element for the given ``UBLK_BATCH_F_*`` flags."""
    size = _HEADER.size
    if flags & F_HAS_BUF_ADDR:
        size += 8
    if flags & F_HAS_ZONE_LBA:
        size += 8
    return size


def batch_header(q_id: int, flags: int, nr_elem: int) -> bytes:
    """The 16-byte ``ublk_batch_io`` command area."""
    return uapi.BATCH_IO.pack(q_id, flags, nr_elem, elem_bytes(flags), 0, 0)


def fetch_header(q_id: int, nr_tags: int) -> bytes:
    """The command area of ``FETCH_IO_CMDS``: elements are u16 tags."""
    return uapi.BATCH_IO.pack(q_id, 0, nr_tags, 2, 0, 0)


#: the kernel copies at most this many tags into one fetch completion
MAX_TAGS_PER_FETCH = 128


def fetched_tags(buf: bytes | bytearray | memoryview, nbytes: int) -> list[int]:
    """The tags a FETCH_IO_CMDS completion delivered (``res`` bytes of u16)."""
    tags: list[int] = memoryview(buf)[:nbytes].cast("H").tolist()
    return tags


@dataclass
class Batch:
    """One PREP or COMMIT command: the elements, packed, ready to send."""

    q_id: int
    flags: int
    tags: list[int]
    data: bytearray

    @property
    def nr_elem(self) -> int:
        return len(self.tags)

    def header(self) -> bytes:
        return batch_header(self.q_id, self.flags, self.nr_elem)

    def after(self, res: int) -> tuple[Batch | None, tuple[int, int] | None]:
        """Given the kernel's answer, the batch still to send (None when all
        went through) and the element it refused as (tag, result), or None."""
        size = elem_bytes(self.flags)
        done = res // size if res >= 0 else 0
        if done >= self.nr_elem:
            return None, None
        tag, _index, result = _HEADER.unpack_from(self.data, done * size)
        refused = (tag, result)
        rest = self.tags[done + 1:]
        if not rest:
            return None, refused
        return Batch(self.q_id, self.flags, rest, self.data[(done + 1) * size:]), refused


@dataclass
class BatchBuilder:
    """Packs (tag, result[, buffer address]) elements for one queue into
    commands of at most ``depth`` elements each."""

    q_id: int
    depth: int
    flags: int = 0
    _tags: list[int] = field(default_factory=list)
    _data: bytearray = field(default_factory=bytearray)

    def add(self, tag: int, result: int = 0, *, buf_addr: int = 0, buf_index: int = 0) -> None:
        self._tags.append(tag)
        self._data += _HEADER.pack(tag, buf_index, result)
        if self.flags & F_HAS_BUF_ADDR:
            self._data += _ADDR.pack(buf_addr)
        if self.flags & F_HAS_ZONE_LBA:
            self._data += _ADDR.pack(0)

    def __len__(self) -> int:
        return len(self._tags)

    def take(self) -> list[Batch]:
        """Everything added so far, as commands of at most ``depth`` elements."""
        size = elem_bytes(self.flags)
        out = []
        for i in range(0, len(self._tags), self.depth):
            tags = self._tags[i:i + self.depth]
            out.append(Batch(self.q_id, self.flags, tags,
                             self._data[i * size:(i + len(tags)) * size]))
        self._tags = []
        self._data = bytearray()
        return out


@dataclass
class _QueueState:
    """A worker's view of one queue it serves."""

    qm: QueueMem
    local: int                   # position among the worker's queues: buffer group id
    builder: BatchBuilder
    tags_mem: bytearray          # the provided buffers the fetches fill with tags
    stats: QueueStats            # this worker's counters of this queue
    tags_addr: int = 0           # its address, for handing buffers back
    buf_ring: Any = None         # the C buffer ring of group ``local``
    dones: list[Any] = field(default_factory=list)  # per tag: answer it (fast path)


class BatchDriver(Driver):
    """Serves a worker's queues with ``UBLK_F_BATCH_IO`` (see the module doc)."""

    FETCHES = 2

    def __init__(self, worker: Worker, ring: Ring, path: IoPath) -> None:
        super().__init__(worker, ring, path)
        cfg = worker.cfg
        self.depth = cfg.depth
        self.mode = worker.mode
        flags = 0
        if self.mode is CopyMode.COPY:
            flags |= F_HAS_BUF_ADDR
        if self.mode is CopyMode.AUTO_ZC and cfg.auto_zc_fallback:
            flags |= F_AUTO_BUF_REG_FALLBACK
        self.flags = flags
        self.auto_zc = self.mode is CopyMode.AUTO_ZC
        self.buf_bytes = cfg.fetch_buf_bytes or 2 * min(self.depth, MAX_TAGS_PER_FETCH)
        self.buf_entries = cfg.fetch_buf_entries or 8
        self.queues = [
            _QueueState(qm, i, BatchBuilder(qm.q_id, self.depth, flags),
                        bytearray(self.buf_entries * self.buf_bytes), self.stats[qm.q_id])
            for i, (qm, _tags) in enumerate(worker.spec.work)]
        for qs in self.queues:
            qs.dones = [partial(self._answer, qs, tag) for tag in range(self.depth)]
        self.live = 0
        ring.add_flush_hook(self._commit)

    # -- setup ----------------------------------------------------------------

    def _index(self, qs: _QueueState, tag: int) -> int:
        return qs.local * self.depth + tag

    def _add(self, qs: _QueueState, tag: int, result: int) -> None:
        qs.builder.add(tag, result, buf_addr=qs.qm.addrs[tag],
                       buf_index=self._index(qs, tag) if self.auto_zc else 0)

    def arm(self) -> None:
        results: list[int] = []
        expected = 0
        for qs in self.queues:
            if qs.qm.q_id in self.w.spec.prep:
                for tag in range(self.depth):
                    if self.path.arming is not None:
                        self.path.arming(qs.qm.q_id, tag)
                    self._add(qs, tag, 0)
                for b in qs.builder.take():
                    self._send(uapi.IoCmd.PREP_IO_CMDS, b, lambda res, _f: results.append(res))
                    expected += 1
        for qs in self.queues:
            if not self._provide(qs):
                return
            for _ in range(self.FETCHES):
                self._fetch(qs)
        self.ring.submit_now()
        self.ring._reap()
        if len(results) < expected:
            self.failed = -errno.ETIMEDOUT  # PREP completes inline unless something broke
        self.failed = self.failed or min([0, *results])

    def _provide(self, qs: _QueueState) -> bool:
        """Register the queue's provided-buffer group (the fetches' tag
        buffers) and hand every buffer to it; False (``failed`` set) if the
        ring refused."""
        err = ffi.new("int *")
        br = lib.aur_buf_ring_setup(self.ring.raw, self.buf_entries, qs.local, err)
        if br == ffi.NULL:
            self.failed = err[0]
            return False
        qs.buf_ring = br
        qs.tags_addr = buffer_address(qs.tags_mem)
        for bid in range(self.buf_entries):
            self._give_back(qs, bid, bid)
        lib.aur_buf_ring_advance(br, self.buf_entries)
        return True

    def _send(self, op: int, b: Batch, handler: Callable[[int, int], None]) -> None:
        data = b.data
        self.ring.prep_cmd(self.char_fd, op, b.header(), addr=buffer_address(data),
                           length=len(data), handler=handler, keep=data)

    # -- fetch ----------------------------------------------------------------

    def _fetch(self, qs: _QueueState) -> None:
        self.ring.prep_cmd(
            self.char_fd, uapi.IoCmd.FETCH_IO_CMDS,
            fetch_header(qs.qm.q_id, self.buf_bytes // 2),
            cmd_flags=lib.IORING_URING_CMD_MULTISHOT, buf_index=qs.local,
            sqe_flags=lib.IOSQE_BUFFER_SELECT, handler=partial(self._on_fetch, qs))
        self.live += 1

    def _give_back(self, qs: _QueueState, bid: int, offset: int = 0) -> None:
        """Put provided buffer ``bid`` back (at ``offset`` past the ring's tail;
        the caller advances the tail)."""
        size = self.buf_bytes
        lib.aur_buf_ring_add(qs.buf_ring, qs.tags_addr + bid * size, size, bid,
                             self.buf_entries, offset)

    def _on_fetch(self, qs: _QueueState, res: int, flags: int) -> None:
        if self.ring.closed:
            return  # tags fetched as the ring closes: the kernel takes them back
        if flags & lib.IORING_CQE_F_BUFFER:
            bid = flags >> 16
            tags = fetched_tags(memoryview(qs.tags_mem)[bid * self.buf_bytes:], max(res, 0))
            self._give_back(qs, bid)
            lib.aur_buf_ring_advance(qs.buf_ring, 1)
            if self.stopping:
                # The worker is ending and the target may be writing back
                # for the last time: these are left to the kernel, which
                # reissues (-i 1) or fails them when /dev/ublkcN closes.
                self.w.log.info("requests left to the kernel at stop", q=qs.qm.q_id,
                                n=len(tags))
            else:
                serve = self._serve
                spawn = self.spawn
                start = self.start
                qm, dones = qs.qm, qs.dones
                qs.stats.started += len(tags)
                for tag in tags:
                    if not start(qm, tag, dones[tag]):
                        spawn(serve(qs, tag))
        if flags & lib.IORING_CQE_F_MORE:
            return
        self.live -= 1
        if res >= 0 or res == -errno.ENOBUFS:
            if not self.stopping:
                self._fetch(qs)
                return
        elif res not in (-errno.ENODEV, -errno.ECANCELED):  # (ECANCELED: our ring closed)
            self.w.log.warning("FETCH_IO_CMDS failed", q=qs.qm.q_id, res=res)
            if not self.failed:
                self.failed = res
        elif not self.stopping:
            # Stop or quiesce: every worker of the device ends. The kernel
            # may leave the fetch it is dispatching on armed for a moment
            # (ublk_batch_cancel_queue): it ends once that dispatch is done,
            # and if it does not, the worker ends after a grace period.
            self.stopping = True
            self.w.device_ending()
            self.loop.call_later(2.0, self.w.finished)
        if self.live == 0:
            self.w.finished()

    # -- commit ---------------------------------------------------------------

    async def _serve(self, qs: _QueueState, tag: int) -> None:
        try:
            res = await self.path.serve(qs.qm, tag, self._index(qs, tag))
        except BaseException:
            self.answered()
            raise
        self._answer(qs, tag, res)

    def _answer(self, qs: _QueueState, tag: int, res: int) -> None:
        if not self.settle(tag):
            return
        qs.stats.count(res)
        self._add(qs, tag, res)
        self.ring.request_flush()

    def _commit(self) -> None:
        for qs in self.queues:
            if len(qs.builder):
                for b in qs.builder.take():
                    self._send(uapi.IoCmd.COMMIT_IO_CMDS, b, partial(self._on_commit, b))

    def _on_commit(self, b: Batch, res: int, flags: int) -> None:
        rest, refused = b.after(res)
        if refused is not None and res != -errno.ENODEV:  # (ENODEV: the device is gone)
            tag, result = refused
            err = res if res < 0 else None
            if result >= 0:
                # the request still waits for an answer: fail it (once)
                self.w.log.warning("COMMIT_IO_CMDS refused a tag: its request fails",
                                   q=b.q_id, tag=tag, res=err)
                qs = next(qs for qs in self.queues if qs.qm.q_id == b.q_id)
                self._add(qs, tag, -errno.EIO)
                self.ring.request_flush()
            else:
                self.w.log.error("COMMIT_IO_CMDS refused a tag's failure: its request is lost",
                                 q=b.q_id, tag=tag, res=err, result=result)
        if rest is not None:
            self._send(uapi.IoCmd.COMMIT_IO_CMDS, rest, partial(self._on_commit, rest))

    async def drain(self) -> None:
        await super().drain()
        self._commit()

    def close(self) -> None:
        """Free the buffer rings' memory (after the ring is gone)."""
        for qs in self.queues:
            if qs.buf_ring is not None:
                lib.aur_buf_ring_free(ffi.NULL, qs.buf_ring, self.buf_entries, qs.local)
            qs.buf_ring = None
