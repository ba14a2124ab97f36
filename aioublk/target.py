"""What a block-device target is: coroutines over byte ranges, plus the
parameters it advertises.

One request is one coroutine; many run concurrently on a queue's loop, and
one target object serves every queue (each queue on its own thread), so a
target keeps per-request state in locals. Backend I/O goes through
``aioublk.current_ring()``, the ring of the queue the request arrived on.
What a target needs per queue loop (a connection) it opens in
``queue_setup`` and finds again through ``current_queue()``, rather than in a
dict keyed by the running loop.

Zero-copy modes (``-z``, ``--auto_zc``) hand a target a ``FixedBuf`` instead
of a memoryview: the request's pages registered in the queue ring's buffer
table, reachable only by io_uring fixed-buffer reads and writes. A target
that can work that way sets ``fixed_buffers = True``.

Zoned devices (``UBLK_F_ZONED``): a target whose ``geometry.zone_size`` is
set gets the zone operations as well: ``report_zones`` fills the request's
buffer with ``struct blk_zone`` entries (``uapi.pack_zones``),
``zone_append`` writes at its zone's write pointer and returns the byte
offset the data went to (sent back to the kernel with the commit), and
``zone_open``/``close``/``finish``/``reset``/``reset_all`` change a zone's
state. Writes must land at the write pointer of sequential zones: the target
refuses the others with EIO. Such a device is served with user copy (``-u``).

Integrity (``UBLK_F_INTEGRITY``, kublk's ``--metadata_size``...): a target
that keeps metadata sets ``metadata = True``. ``use_integrity`` tells it the
format before the device is added (the default puts it in the geometry, to
be advertised; override it to size the device by where the metadata goes);
then each READ or WRITE carrying metadata gets it as ``meta=``, a memoryview
of ``integrity.meta_bytes(len(buf))`` bytes, ``metadata_size`` per interval
of data in order: a write stores it with the data, a read fills it with what
was stored. The block layer generates and verifies the PI in it; what a
target never wrote should read back as 0xFF bytes, which the block layer
does not check. Such a device is served with user copy (``-u``), in Python:
the C data plane does not serve it.

Errors: raise ``OSError`` (its errno is returned to the kernel) or anything
else (the request fails with EIO and a log line; the queue keeps serving).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aioublk import logs
from aioublk.dataplane.maps import Map
from aioublk.errors import Error
from aioublk.kernel import uapi


class GeometryError(Error, ValueError):
    """A ``Geometry`` the kernel would refuse or change behind the target's back."""


@dataclass
class Geometry:
    """What the device looks like to the kernel; checked when made (and on
    every ``dataclasses.replace``), so a bad one fails where it is written."""

    size: int
    logical_block_size: int = 512
    physical_block_size: int = 4096
    io_min: int = 512
    io_opt: int = 4096
    max_io_size: int = 1 << 20
    volatile_cache: bool = False
    fua: bool = False
    read_only: bool = False
    rotational: bool = False
    discard: bool = False
    discard_granularity: int = 4096
    #: the longest discard the kernel may send (0: the largest I/O). A
    #: discard moves no data: a backend that frees whole objects or extents
    #: only when it sees them whole wants it long
    max_discard_size: int = 0
    write_zeroes: bool = False
    dma_alignment: int | None = None
    segment: tuple[int, int, int] | None = None
    #: zoned: bytes per zone (a power of two; 0: not zoned) and the open and
    #: active zone limits (0: none)
    zone_size: int = 0
    max_open_zones: int = 0
    max_active_zones: int = 0
    #: UBLK_F_INTEGRITY: the metadata format the device advertises
    integrity: uapi.Integrity | None = None

    def __post_init__(self) -> None:
        lbs, pbs = self.logical_block_size, self.physical_block_size
        if lbs & (lbs - 1) or not 512 <= lbs <= 4096:
            raise GeometryError(f"logical block size {lbs} is not a power of two from 512 to "
                                "4096: use 512 or 4096")
        if pbs & (pbs - 1) or pbs < lbs:
            raise GeometryError(f"physical block size {pbs} is not a power of two of at least "
                                f"the logical block size {lbs}: use e.g. 4096")
        if self.size <= 0 or self.size % lbs:
            raise GeometryError(f"device size {self.size} is not a positive multiple of the "
                                f"logical block size {lbs}: round it down to a multiple of "
                                f"{lbs}")

    def params(self, max_io_buf_bytes: int) -> uapi.Params:
        """The ``ublk_params`` for this geometry, capped by the kernel's
        negotiated max I/O size."""
        attrs = 0
        if self.volatile_cache:
            attrs |= uapi.ATTR_VOLATILE_CACHE
            if self.fua:
                attrs |= uapi.ATTR_FUA
        if self.read_only:
            attrs |= uapi.ATTR_READ_ONLY
        if self.rotational:
            attrs |= uapi.ATTR_ROTATIONAL
        max_bytes = min(self.max_io_size, max_io_buf_bytes)
        discard = None
        if self.discard or self.write_zeroes:
            max_sect = max_bytes >> 9
            discard = (
                0,
                self.discard_granularity if self.discard else 0,
                (self.max_discard_size >> 9 or max_sect) if self.discard else 0,
                max_sect if self.write_zeroes else 0,
                1 if self.discard else 0,
            )
        return uapi.Params(
            dev_sectors=self.size >> 9,
            logical_bs_shift=self.logical_block_size.bit_length() - 1,
            physical_bs_shift=self.physical_block_size.bit_length() - 1,
            io_min_shift=self.io_min.bit_length() - 1,
            io_opt_shift=self.io_opt.bit_length() - 1,
            max_sectors=max_bytes >> 9,
            attrs=attrs,
            discard=discard,
            dma_alignment=self.dma_alignment,
            segment=self.segment,
            chunk_sectors=self.zone_size >> 9,
            zoned=(self.max_open_zones, self.max_active_zones,
                   min(max_bytes, self.zone_size) >> 9) if self.zone_size else None,
            integrity=self.integrity,
        )


@dataclass(frozen=True, slots=True)
class FixedBuf:
    """``length`` bytes at ``offset`` inside registered buffer ``index`` of the
    current ring (use ``ring.read_fixed``/``write_fixed`` with ``addr=offset``)."""

    index: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> FixedBuf:
        start, stop, step = s.indices(self.length)
        if step != 1:
            raise ValueError("FixedBuf slices are contiguous")
        return FixedBuf(self.index, self.offset + start, max(0, stop - start))


Buffer = memoryview | FixedBuf

#: A request's completion: called once with the result for the kernel.
Done = Callable[[int], None]

log = logs.get_logger("aioublk.target")


@dataclass(eq=False)
class QueueContext:
    """One queue worker as its target sees it: the queues it serves, its loop,
    and ``state``, the target's own things for that loop (a connection, a
    session), kept from ``queue_setup`` to ``queue_teardown``."""

    worker: int
    queues: tuple[int, ...]
    loop: asyncio.AbstractEventLoop
    state: dict[str, Any] = field(default_factory=dict)


class QueueSetupError(Error):
    """A target's ``queue_setup`` raised: the device does not start."""


# A worker is one thread running one loop, so a thread-local finds its
# context from anywhere on that loop: a coroutine, a task it spawned, or a
# callback of the C data plane or the ring, none of which carry a contextvar
# set in the worker's own task (the same reasoning as ``current_ring``).
_local = threading.local()


def current_queue() -> QueueContext:
    """The context of the queue worker running this code (inside a target's
    ``read``/``write``...: find this loop's connection in ``state``)."""
    q: QueueContext | None = getattr(_local, "queue", None)
    if q is None:
        raise RuntimeError("no aioublk queue worker runs on this thread")
    return q


#: prctl(2)'s PR_SET_IO_FLUSHER (Linux 5.6)
_PR_SET_IO_FLUSHER = 57
#: why it was refused, once said (it would be for every thread)
_flusher_refused: list[int] = []


@functools.cache
def _prctl() -> Callable[..., int]:
    f = ctypes.CDLL(None, use_errno=True).prctl
    f.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl: Callable[..., int] = f
    return prctl


def _become_io_flusher() -> bool:
    """Mark this thread as serving a block device (PR_SET_IO_FLUSHER): its
    allocations do not wait for reclaim to write out dirty pages, which may
    belong to a file system on the very disk only this thread answers, and
    writeback does not throttle it. Needs CAP_SYS_RESOURCE; without it the
    thread serves all the same (logged once)."""
    if _prctl()(_PR_SET_IO_FLUSHER, 1, 0, 0, 0) == 0:
        return True
    err = ctypes.get_errno()
    if not _flusher_refused:
        _flusher_refused.append(err)
        log.info("queue threads are not I/O flushers: a file system on the device under "
                 "memory pressure may stall it", error=f"PR_SET_IO_FLUSHER: {os.strerror(err)}",
                 needs="CAP_SYS_RESOURCE")
    return False


async def setup_queue(target: Target, q: QueueContext) -> None:
    """Bind ``q`` to this thread (an I/O flusher from now on) and run the
    target's ``queue_setup`` on it; raises ``QueueSetupError`` (one line:
    the target, the worker, the error)."""
    _become_io_flusher()
    _local.queue = q
    try:
        await target.queue_setup(q)
    except Exception as e:
        _local.queue = None
        raise QueueSetupError(
            f"target {target.name!r}: queue_setup failed on worker {q.worker} "
            f"(queues {', '.join(map(str, q.queues)) or 'none'}): {type(e).__name__}: {e}"
        ) from e


async def teardown_queue(target: Target, q: QueueContext) -> None:
    """Run the target's ``queue_teardown``, logging what it raises: the
    worker is stopping and the rest of its shutdown (closing the ring) must
    still happen; then unbind ``q``."""
    try:
        await target.queue_teardown(q)
    except Exception as e:  # noqa: BLE001 - logged: the worker shuts down regardless
        log.error("the target's queue_teardown failed", target=target.name, worker=q.worker,
                  error=f"{type(e).__name__}: {e}")
    finally:
        _local.queue = None


async def gather_all(aws: Sequence[Awaitable[int]]) -> list[int]:
    """Await every one of ``aws`` (backend I/O on one request's buffer), then
    raise the first error if any failed. ``asyncio.gather`` raises as soon as
    one fails while the others still run; a request answered then lets the
    kernel reuse its buffer under a straggling read."""
    if len(aws) == 1:
        return [await aws[0]]
    results = await asyncio.gather(*aws, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return results  # type: ignore[return-value]  # no exception: all ints
    try:
        raise error
    finally:  # no cycle error -> traceback -> this frame -> error: the frames of the
        del error, results  # I/O hold cffi views of the request's buffer



def rw_handler(n: int, done: Done, retry: Callable[[], Coroutine[Any, Any, None]],
               refused: Callable[[], object] | None = None) -> Callable[[int, int], None]:
    """The CQE handler of a fast-path read/write of ``n`` bytes: a full result
    or an error goes straight to ``done``; anything else (a short transfer,
    O_DIRECT refusing an unaligned buffer) runs ``retry``, the coroutine path,
    as a task. ``refused`` is called first on EINVAL (a target's chance to
    stop using O_DIRECT, so the retry is not the same request again)."""
    def on_cqe(res: int, flags: int) -> None:
        if res == n or (res < 0 and res not in (-errno.EINVAL, -errno.EAGAIN)):
            done(res)
        else:
            if res == -errno.EINVAL and refused is not None:
                refused()
            asyncio.get_running_loop().create_task(_retried(retry, n, done))
    return on_cqe


async def _retried(retry: Callable[[], Coroutine[Any, Any, None]], n: int, done: Done) -> None:
    try:
        await retry()
        res = n
    except OSError as e:
        res = -(e.errno or errno.EIO)
    except Exception:
        log.exception("target raised")
        res = -errno.EIO
    done(res)


class Target:
    """Base class of targets. Subclasses set ``geometry`` and override the
    operations they support; the defaults refuse with EOPNOTSUPP."""

    name = "custom"
    geometry: Geometry
    fixed_buffers = False  # True: read/write also accept a FixedBuf (zero copy)
    one_loop = False  # True: every queue of a device is served from one thread's loop
    #: True: everything the target needs its queue's loop for arrives as a
    #: completion on the queue's ring or through the worker's ``LoopHandle``
    #: (no sockets or readers on the loop, no short timers), so the data plane
    #: may idle in C between requests (``IDLE_US``) instead of handing the
    #: thread back to the loop within a millisecond
    c_idle = False
    #: True: the queue rings have 128-byte SQEs and 32-byte CQEs, what an
    #: NVMe passthrough command (``IORING_OP_URING_CMD``) needs
    big_ring_entries = False
    #: True: the target keeps integrity metadata: ``read``/``write`` take
    #: ``meta=`` (see the module's notes)
    metadata = False
    #: False: leave the workers to the scheduler rather than pin each one that
    #: serves one queue to one CPU (kublk's way, ``placement``): for a target
    #: whose backend is another process on this machine, which needs the CPUs
    #: as much as the workers do
    pin_workers = True

    async def read(self, offset: int, buf: memoryview) -> None:
        """Fill all of ``buf`` with the device's bytes at ``offset`` (and,
        with ``metadata``, ``meta=`` with their metadata when given)."""
        raise OSError(errno.EOPNOTSUPP, "read not supported")

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        """Store ``buf`` at ``offset`` (durably before returning if ``fua``;
        with ``metadata``, ``meta=`` too when given)."""
        raise OSError(errno.EOPNOTSUPP, "write not supported")

    def use_integrity(self, integrity: uapi.Integrity, *, fresh: bool) -> None:
        """Before the device is added (``fresh``) or recovered: it has
        ``integrity``'s metadata. The default advertises it; a target that
        stores metadata sizes itself here, and may initialise the store
        when ``fresh`` (never when recovering: it holds the data's PI)."""
        self.geometry = replace(self.geometry, integrity=integrity)

    def map(self) -> Map | None:
        """Where the device's data lives, for the C data plane (see
        ``aioublk.dataplane.plane``): READ and non-FUA WRITE requests the map
        resolves are served in C without reaching ``read``/``write``. Called
        on each queue's loop before its first request; None (the default):
        every request comes to the coroutines."""
        return None

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        """Optional fast path (copy mode): start the read without a coroutine
        and call ``done(result)`` exactly once, now or later on this loop; or
        return False, having done nothing, to be served by ``read``. It saves
        the task a request costs, the bulk of the framework's time per I/O."""
        return False

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        """As ``start_read``, for a write without FUA."""
        return False

    async def settle_writes(self) -> None:
        """Writes the data plane served from a map that holds them (an
        ``ExtentTable`` with ``set_hold_writes``) are answered once this
        returns, many at a time, on the queue's loop: make durable what they
        changed in the target's own metadata (a qcow2 image whose metadata
        is written through). Raising fails them with EIO."""

    async def flush(self) -> None:
        """Make every completed write durable."""

    async def discard(self, offset: int, length: int) -> None:
        """The device's bytes ``[offset, offset + length)`` are no longer
        needed (the backend may free them; what they read back is the target's
        to say). Only with ``Geometry.discard``."""
        raise OSError(errno.EOPNOTSUPP, "discard not supported")

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        """The bytes ``[offset, offset + length)`` read back as zeros;
        ``unmap``: the backend may free them to get there. Only with
        ``Geometry.write_zeroes``."""
        raise OSError(errno.EOPNOTSUPP, "write_zeroes not supported")

    async def report_zones(self, offset: int, buf: memoryview) -> None:
        """Zoned: fill ``buf`` with ``len(buf) // 64`` ``struct blk_zone``
        entries from the zone holding ``offset``, zeros past the last zone."""
        raise OSError(errno.EOPNOTSUPP, "report_zones not supported")

    async def zone_append(self, offset: int, buf: memoryview, fua: bool = False) -> int:
        """Zoned: store ``buf`` at the write pointer of the zone holding
        ``offset``; returns the byte offset it went to."""
        raise OSError(errno.EOPNOTSUPP, "zone_append not supported")

    async def zone_open(self, offset: int) -> None:
        """Zoned: open the zone holding ``offset`` explicitly."""
        raise OSError(errno.EOPNOTSUPP, "zone_open not supported")

    async def zone_close(self, offset: int) -> None:
        """Zoned: close the zone holding ``offset`` (its write pointer stays)."""
        raise OSError(errno.EOPNOTSUPP, "zone_close not supported")

    async def zone_finish(self, offset: int) -> None:
        """Zoned: make the zone holding ``offset`` full."""
        raise OSError(errno.EOPNOTSUPP, "zone_finish not supported")

    async def zone_reset(self, offset: int) -> None:
        """Zoned: empty the zone holding ``offset`` (write pointer to its start)."""
        raise OSError(errno.EOPNOTSUPP, "zone_reset not supported")

    async def zone_reset_all(self) -> None:
        """Zoned: empty every sequential zone."""
        raise OSError(errno.EOPNOTSUPP, "zone_reset_all not supported")

    def configure(self, device_flags: int) -> None:
        """Called once before the first request (at start and at recovery)
        with the device's ``UBLK_F_*`` flags. With ``USER_RECOVERY`` the
        device outlives this server: a write acknowledged must be found by
        the next server, so what the target keeps in memory for it has to
        reach its files (the page cache is enough) before it completes."""

    async def queue_setup(self, q: QueueContext) -> None:
        """On each queue worker's loop, once its ring exists (``current_ring``
        works) and before ``map`` or any request: open what the target needs
        per loop, e.g. a connection (asyncio objects belong to the loop that
        made them), into ``q.state``; requests find it through
        ``current_queue()``. Raising fails the device's start."""

    async def queue_teardown(self, q: QueueContext) -> None:
        """On each worker's loop at stop, after ``drain`` and before its ring
        closes: close what ``queue_setup`` opened. Errors are logged. Not
        called when ``queue_setup`` raised."""

    def arming(self, q_id: int, tag: int) -> None:
        """Called on the queue's loop before each tag is armed (at start and
        at recovery): a hook for fault injection, nothing else."""

    async def drain(self) -> None:
        """On each queue loop, once its requests are done and before its ring
        closes: write back what the target caches (its I/O still works)."""

    def stopping(self) -> None:
        """Called as the server starts to stop or hand the device over (from
        any thread, maybe more than once), before it waits for the requests
        in flight: answer any the target holds back on purpose (the ``error``
        filter's ``hang``), or that wait never ends."""

    def close(self) -> None:
        """Release resources; called once, after every queue has stopped."""

    def describe(self) -> dict[str, object]:
        """Fields for logs and ``list``."""
        return {"target": self.name, "size": self.geometry.size}

    @classmethod
    def capacity(cls, files: list[str], options: dict[str, Any]) -> int | None:
        """The bytes a device of this target over ``files`` (with ``add``'s
        ``options``) can serve as the files are now: ``update_size`` grows it
        no further. None: no file bounds it."""
        return None
