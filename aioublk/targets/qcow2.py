"""The qcow2 target: a thin adapter from ublk requests to ``Qcow2Image``.

Every queue has its own worker (thread, loop, ring, C data plane), and every
data plane serves from the image's one extent table (``map``): reads and
in-place writes of the clusters the image has published run on every queue
in parallel, without Python.

The engine itself has one owner, worker 0's loop: its caches and locks
belong to that loop (see ``aioublk.qcow2.image``), and nothing of it is
touched from another thread. A request another worker's data plane could
not serve is handed to the owner whole (``crossloop.call_on``: one kick
there, one back) and runs there as it would on a one-queue device; what the
engine looks up for it is published, so the next request for that cluster
stays in C on whichever queue it arrives.

Stopping, each other worker tells the owner when its requests are done (its
``queue_teardown``, which also runs when its start failed); the owner waits
for all of them before its final write-back and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aioublk import logs
from aioublk.dataplane import crossloop
from aioublk.dataplane.maps import Extents, Map
from aioublk.kernel import uapi
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2.format import HEADER_BYTES, Qcow2Error, virtual_size
from aioublk.ring import current_ring
from aioublk.target import Done, Geometry, QueueContext, Target
from aioublk.targets.spec import BOOL, BUFFERED, CHOICE, PATH, PATHS, SIZE, Option, TargetSpec

log = logs.get_logger("aioublk.qcow2")

T = TypeVar("T")

#: how long the owner waits for the other workers' requests before its final
#: write-back: a worker's own drain gives up after 5 s
#: (``aioublk.queue.driver.DRAIN_SECONDS``), and its requests are then stranded
OTHERS_SECONDS = 15.0


class Qcow2Target(Target):
    """A QEMU qcow2 image as the disk (``-t qcow2``): the image engine
    (``aioublk.qcow2``) decides every mapping and its extent table lets C
    serve what is mapped; crash-safe, and locked as QEMU locks it."""

    name = "qcow2"
    # everything a worker's loop waits for arrives through its ring or a kick:
    # hand-offs (call_on), executor results (run_in_thread), C's notifications
    # (pools, and the releases an unmap waits for)
    c_idle = True

    def __init__(self, path: str, *, read_only: bool = False,
                 cache_bytes: int | None = None, direct: bool = True,
                 allow_backing: Sequence[str] = (), backing_format: str | None = None,
                 compress: bool = False) -> None:
        self.image = Qcow2Image.open(path, read_only=read_only, cache_bytes=cache_bytes,
                                     direct=direct, allow_backing=allow_backing,
                                     backing_format=backing_format, compress=compress)
        cs = self.image.cluster_size
        if self.image.size < 512:
            self.image.release()
            raise Qcow2Error(f"{path}: its disk has {self.image.size} bytes, less than one "
                             "512-byte sector: resize it (qemu-img resize)")
        self.geometry = Geometry(
            size=self.image.size & ~511, volatile_cache=True, fua=True, read_only=read_only,
            discard=not read_only, discard_granularity=max(cs, 4096),
            write_zeroes=not read_only, io_opt=max(cs, 4096))
        self._closed = False
        # made here, before any worker runs: every worker's map() shares it
        table = self.image.extent_table()
        # C asks for the engine through this (its pools at half, its records
        # to apply), and each data plane after attaching a pool
        self._notify = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if table is not None:
            table.set_notify(self._notify)
        self._owner: crossloop.LoopHandle | None = None  # worker 0's loop: the engine's
        self._lock = threading.Lock()
        self._workers = 0   # queue_setup calls, on every worker
        self._drained = 0   # the other workers done with their requests (owner's loop)
        self._others: asyncio.Event | None = None  # on the owner's loop

    def configure(self, device_flags: int) -> None:
        if device_flags & (uapi.Feature.SUPPORT_ZERO_COPY | uapi.Feature.AUTO_BUF_REG):
            # the data plane has no buffer to inflate a compressed cluster into
            self.image.plane.zip_ok = False
        # the engine keeps L2 and refcount changes in memory until a FLUSH: a
        # device that outlives us needs them in the file before a write completes
        if device_flags & uapi.Feature.USER_RECOVERY:
            self.image.metadata_write_through = True
            # C writes and allocates still; each answer waits for settle_writes
            self.image.hold_c_writes()

    async def queue_setup(self, q: QueueContext) -> None:
        with self._lock:
            self._workers += 1
        if q.worker == 0:
            self._owner = crossloop.current()
            self._others = asyncio.Event()
            crossloop.FdWatch(current_ring(), self._notify, self._service,
                              "allocating writes wait for Python")

    def _service(self) -> None:  # on the owner's loop
        try:
            os.eventfd_read(self._notify)
        except BlockingIOError:  # (an earlier completion took it)
            pass
        if self.image.extents is not None:
            self.image.extents.notified()  # an unmap waiting for a release
        if not self._closed and self._notify >= 0:
            self.image.service()

    def map(self) -> Map | None:
        """The image's extent table, shared by every queue: the clusters it
        has published, served in C (see ``aioublk.qcow2.image``, "The data
        plane"). A data plane that serves it attaches its pool (a filter
        above may drop the map: then no pool is counted for nothing)."""
        table = self.image.extent_table()  # (made already: this only reads, on any thread)
        if table is None:
            return None
        return Extents(table, pool=self._attach_pool)

    def _attach_pool(self) -> int | None:
        """A pool for the data plane serving the table (its queue's thread)."""
        slot = self.image.attach_pool()  # (C's, under the table's mutex)
        if slot < 0:
            return None
        os.eventfd_write(self._notify, 1)  # the owner fills it
        return slot

    def _away(self) -> crossloop.LoopHandle | None:
        """This thread's handle when it is not the engine's owner, else None
        (the owner, or a caller outside any worker: tests, embedding)."""
        here = crossloop.current()
        owner = self._owner
        return None if owner is None or here is None or here is owner else here

    async def _engine(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """``await fn(*args)`` on the engine's loop: here, or one hand-off.
        The caller's buffer is used until the call ends; no request task is
        cancelled, and call_on never cancels the owner's side."""
        here = self._away()
        if here is None:
            return await fn(*args)
        assert self._owner is not None
        return await crossloop.call_on(self._owner, here, fn, *args)

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._engine(self.image.read, offset, buf)

    async def write(self, offset: int, buf: memoryview,
                    fua: bool = False) -> None:
        await self._engine(self._write, offset, buf, fua)

    async def _write(self, offset: int, buf: memoryview, fua: bool) -> None:
        await self.image.write(offset, buf)
        if fua:
            await self.image.flush()

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self._away() is None and self.image.start_read(offset, buf, done)

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self._away() is None and self.image.start_write(offset, buf, done)

    async def flush(self) -> None:
        await self._engine(self.image.flush)

    async def settle_writes(self) -> None:
        await self._engine(self.image.settle_writes)

    async def discard(self, offset: int, length: int) -> None:
        await self._engine(self.image.discard, offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._engine(self._write_zeroes, offset, length, unmap)

    async def _write_zeroes(self, offset: int, length: int, unmap: bool) -> None:
        await self.image.write_zeroes(offset, length, unmap=unmap)

    async def queue_teardown(self, q: QueueContext) -> None:
        """Another worker is done (after its drain, or a start that failed):
        none of its requests will reach the engine again; tell the owner."""
        if self._away() is not None:
            assert self._owner is not None
            with contextlib.suppress(RuntimeError):  # the owner is gone: nobody waits
                self._owner.call_soon(self._other_drained)

    async def drain(self) -> None:
        """The owner: wait until every other worker is done (their requests
        keep being handed over meanwhile), then write back and close."""
        if self._away() is not None or self._closed:
            return
        others = self._others
        if others is not None and self._workers > 1:
            try:
                await asyncio.wait_for(others.wait(), OTHERS_SECONDS)
            except TimeoutError:
                log.error("other queues did not finish in time; closing the image "
                          "anyway (their requests in flight fail)",
                          waiting=self._workers - 1 - self._drained)
        self._closed = True
        await self.image.close()

    def _other_drained(self) -> None:  # on the owner's loop
        self._drained += 1
        if self._others is not None and self._drained >= self._workers - 1:
            self._others.set()

    def close(self) -> None:
        if self._notify >= 0:  # (C must not write it once closed: the number is reused)
            if self.image.extents is not None:
                self.image.extents.set_notify(-1)
            os.close(self._notify)
            self._notify = -1
        if not self._closed:  # never served: nothing cached, just the files
            self._closed = True
            self.image.release()

    @classmethod
    def capacity(cls, files: list[str], options: dict[str, Any]) -> int | None:
        if not files:
            return None
        with open(files[0], "rb") as f:
            size = virtual_size(f.read(HEADER_BYTES))
        return None if size is None else size & ~511

    def describe(self) -> dict[str, object]:
        h = self.image.h
        return {"target": self.name, "size": self.geometry.size, "file": self.image.path,
                "cluster_size": self.image.cluster_size, "version": h.version,
                "backing": h.backing_file,
                "metadata_write_through": self.image.metadata_write_through,
                "compress": self.image.compress}


#: ``-t qcow2``: its options, as the command line and config files take them
SPEC = TargetSpec("qcow2", Qcow2Target, (
    Option("image", PATH, "the qcow2 image", arg="*", required=True, what="image"),
    Option("l2_cache", SIZE, "L2 cache size", default_help="map the whole disk, up to 32M",
           flags=("--l2-cache",), arg="cache_bytes", lo=1),
    BUFFERED,
    Option("allow_backing", PATHS, "backing files may also be under this directory, or be "
           "this file or block device (repeatable; by default only files in the image's "
           "own directory)", default=(), flags=("--allow-backing",)),
    Option("backing_format", CHOICE, "the format of backing files whose image records "
           "none (never guessed)", flags=("--backing-format",), choices=("raw", "qcow2")),
    Option("compress", BOOL, "write whole, aligned clusters compressed, with the image's "
           "compression type (as qemu-img convert -c); C then serves reads only",
           default=False, flags=("--compress",)),
), files="image", read_only=True, rank=4)
