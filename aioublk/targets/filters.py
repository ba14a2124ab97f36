"""Filters: a layer in front of a target (or another filter), as nbdkit stacks
filters in front of a plugin.

A filter is a ``Target`` that wraps ``inner`` and passes every operation on
unchanged unless it overrides it. What it overrides decides how the C data
plane may serve it:

- a **placement** filter (an offset, a smaller size, read-only) changes only
  where and whether the bytes go; it overrides ``place`` to transform the
  inner map, so C still serves the requests it resolves;
- a filter that touches data or timing (a delay, an error, a log) keeps the
  base ``place``, which removes the map: every request comes to its
  coroutines, which then call the inner layer's.

A minimal filter, failing every write past 1 GiB::

    class Fence(Filter):
        name = "fence"

        async def write(self, offset, buf, fua=False):
            if offset + len(buf) > 1 << 30:
                raise OSError(errno.EPERM, "past the fence")
            await self.inner.write(offset, buf, fua)

``Device(Fence(LoopTarget("disk.img")))`` serves it; the command line stacks
built-in filters with ``--filter NAME[:KEY=VALUE,...]``.

The built-in filters, by the names ``--filter`` and a config's ``filters``
use: placement filters keep the C data plane: ``offset`` (a window of the inner
device), ``partition`` (the window one MBR or GPT partition holds),
``truncate`` (a shorter device), ``readonly`` and ``protect`` (ranges whose
writes are refused). Timing, fault and accounting filters take every request
through Python: ``delay``, ``error``, ``rate`` (token buckets) and ``log`` (a
JSON line per request); so do ``cache``, a read (and write-back) cache in
RAM, ``cow``, an overlay that keeps the inner device unwritten, and
``encrypt``, dm-crypt's plain AES-XTS.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import logging.handlers
import mmap
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from aioublk.dataplane import crossloop
from aioublk.dataplane.extents import ExtentTable
from aioublk.dataplane.maps import Extents, Linear, Map, Null
from aioublk.kernel import uapi
from aioublk.ring import Ring
from aioublk.target import Buffer, Geometry, QueueContext, Target


class Filter(Target):
    """Passes everything to ``inner``; subclasses override what they change.

    ``geometry`` starts as the inner layer's (``shape`` may change it). The
    per-queue hooks and the life cycle always reach the inner layer.
    """

    name = "filter"

    def __init__(self, inner: Target) -> None:
        self.inner = inner
        # what the inner layer can do, unless this filter says otherwise
        self.fixed_buffers = inner.fixed_buffers and self.placement
        self.one_loop = inner.one_loop
        self.pin_workers = inner.pin_workers
        self.c_idle = inner.c_idle and self.placement
        self.big_ring_entries = inner.big_ring_entries
        self.metadata = False  # (no filter passes integrity metadata on)
        self.geometry = self.shape(inner.geometry)

    #: True: this filter only moves or fences requests (``place`` transforms
    #: the map); False: it touches data or timing, so Python serves it all
    placement = False

    def shape(self, geometry: Any) -> Any:
        """The geometry this filter shows, from the inner layer's."""
        return geometry

    def place(self, inner: Map | None) -> Map | None:
        """This layer's map from the inner one's; None: Python serves all."""
        return None

    def map(self) -> Map | None:
        return self.place(self.inner.map())

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.inner.read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self.inner.write(offset, buf, fua)

    async def flush(self) -> None:
        await self.inner.flush()

    async def discard(self, offset: int, length: int) -> None:
        await self.inner.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.inner.write_zeroes(offset, length, unmap)

    async def report_zones(self, offset: int, buf: memoryview) -> None:
        await self.inner.report_zones(offset, buf)

    async def zone_append(self, offset: int, buf: memoryview, fua: bool = False) -> int:
        return await self.inner.zone_append(offset, buf, fua)

    async def zone_open(self, offset: int) -> None:
        await self.inner.zone_open(offset)

    async def zone_close(self, offset: int) -> None:
        await self.inner.zone_close(offset)

    async def zone_finish(self, offset: int) -> None:
        await self.inner.zone_finish(offset)

    async def zone_reset(self, offset: int) -> None:
        await self.inner.zone_reset(offset)

    async def zone_reset_all(self) -> None:
        await self.inner.zone_reset_all()

    def use_integrity(self, integrity: uapi.Integrity, *, fresh: bool) -> None:
        self.inner.use_integrity(integrity, fresh=fresh)
        self.geometry = replace(self.shape(self.inner.geometry), integrity=integrity)

    def configure(self, device_flags: int) -> None:
        self.inner.configure(device_flags)

    async def queue_setup(self, q: QueueContext) -> None:
        await self.inner.queue_setup(q)

    async def queue_teardown(self, q: QueueContext) -> None:
        await self.inner.queue_teardown(q)

    def arming(self, q_id: int, tag: int) -> None:
        self.inner.arming(q_id, tag)

    async def drain(self) -> None:
        await self.inner.drain()

    def stopping(self) -> None:
        self.inner.stopping()

    def close(self) -> None:
        self.inner.close()

    def settings(self) -> dict[str, object]:
        """This filter's options, for ``list`` and logs."""
        return {}

    def describe(self) -> dict[str, object]:
        """The inner layer's fields, the stack outermost first under ``filters``
        and this layer's size."""
        inner = self.inner.describe()
        mine = {"name": self.name, **self.settings()}
        filters = [mine, *inner.get("filters", ())]  # type: ignore[misc]
        return {**inner, "filters": filters, "size": self.geometry.size}


#: the operations ``delay`` and ``error`` act on, as their options name them
OPS = ("read", "write", "flush", "discard", "write_zeroes")


def _aligned(what: str, value: int, geometry: Geometry) -> None:
    lbs = geometry.logical_block_size
    if value % lbs:
        raise ValueError(f"{what} {value} is not a multiple of the logical block size "
                         f"{lbs}: round it")


class OffsetFilter(Filter):
    """Serve the inner device from byte ``offset`` on, ``size`` bytes (default:
    to its end): one window of a disk, as nbdkit's offset filter."""

    name = "offset"
    placement = True

    def __init__(self, inner: Target, offset: int, size: int | None = None) -> None:
        g = inner.geometry
        _aligned("offset", offset, g)
        if offset >= g.size:
            raise ValueError(f"offset {offset} is not inside the {g.size}-byte inner device: "
                             "give a smaller offset")
        room = g.size - offset
        if size is not None:
            _aligned("size", size, g)
            if not 0 < size <= room:
                raise ValueError(f"size {size} does not fit the {room} bytes after offset "
                                 f"{offset}: give at most {room}")
        self.offset, self.size = offset, size if size is not None else room
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, size=self.size)

    def place(self, inner: Map | None) -> Map | None:
        if isinstance(inner, Linear):
            return Linear(inner.fd, inner.base + self.offset)
        if isinstance(inner, Null):
            return inner
        return None  # a striped or extent map does not shift: Python serves the window

    async def read(self, offset: int, buf: Buffer) -> None:
        await self.inner.read(offset + self.offset, buf)  # type: ignore[arg-type]

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        await self.inner.write(offset + self.offset, buf, fua)  # type: ignore[arg-type]

    async def discard(self, offset: int, length: int) -> None:
        await self.inner.discard(offset + self.offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.inner.write_zeroes(offset + self.offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"offset": self.offset, "size": self.size}


class PartitionFilter(OffsetFilter):
    """Serve partition ``partition`` (from 1; an MBR's logical ones from 5) of
    the inner device's MBR or GPT partition table, as nbdkit's partition
    filter: an offset window, read from the table when the stack is built
    (through the inner target, on a ring of its own), so C still serves a
    loop's requests."""

    name = "partition"

    def __init__(self, inner: Target, partition: int) -> None:
        lbs = inner.geometry.logical_block_size
        try:
            start, size = find_partition(lambda at, n: _peek(inner, at, n), lbs, partition)
        except OSError as e:
            raise ValueError(f"cannot read the partition table through the {inner.name} "
                             f"target: {e.strerror or e}") from None
        self.partition = partition
        super().__init__(inner, start, size)

    def settings(self) -> dict[str, object]:
        return {"partition": self.partition, **super().settings()}


#: MBR partition types of an extended partition (DOS, LBA, Linux): a chain of EBRs
EXTENDED = (0x05, 0x0F, 0x85)
#: EBRs followed at most (Linux's msdos parser stops sooner)
MAX_LOGICAL = 256


def find_partition(read: Callable[[int, int], bytes], lbs: int,
                   number: int) -> tuple[int, int]:
    """(first byte, bytes) of partition ``number`` of an MBR, numbered as
    Linux numbers them (1-4 primary, 5 on the logical ones of the extended
    partition's chain), or of entry ``number`` of a GPT (its protective MBR
    leads to it), on a disk of ``lbs``-byte sectors read through
    ``read(offset, length)``; raises ValueError naming what is missing."""
    mbr = read(0, 512)
    if mbr[510:512] != b"\x55\xaa":
        raise ValueError("no partition table (no MBR signature in sector 0): give an offset "
                         "filter instead")
    entries = [_mbr_entry(mbr, i) for i in range(4)]
    if any(kind == 0xEE for kind, _, _ in entries):
        return _gpt_partition(read, lbs, number)
    if number > 4:
        return _logical_partition(read, lbs, number, entries)
    if number < 1:
        raise ValueError(f"partition {number}: MBR partitions count from 1")
    kind, start, sectors = entries[number - 1]
    if kind == 0 or not sectors:
        raise ValueError(f"partition {number} is empty in the MBR")
    if kind in EXTENDED:
        raise ValueError(f"partition {number} is an extended partition: give one of its "
                         "logical partitions (5 and on)")
    return start * lbs, sectors * lbs


def _mbr_entry(sector: bytes, i: int) -> tuple[int, int, int]:
    """(type, first sector, sectors) of entry ``i`` of an MBR or EBR."""
    e = sector[446 + 16 * i:462 + 16 * i]
    return e[4], int.from_bytes(e[8:12], "little"), int.from_bytes(e[12:16], "little")


def _logical_partition(read: Callable[[int, int], bytes], lbs: int, number: int,
                       primary: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Logical partition ``number`` (5 and on): the extended partition holds a
    chain of EBRs, each with its partition (first sector counted from the
    EBR) and a link to the next EBR (counted from the extended partition)."""
    extended = [start for kind, start, sectors in primary if kind in EXTENDED and sectors]
    if not extended:
        raise ValueError(f"partition {number}: this MBR has no extended partition, so no "
                         "logical ones (give 1-4)")
    base = ebr = extended[0]
    found, seen = 4, set()
    for _ in range(MAX_LOGICAL):
        if ebr in seen:
            raise ValueError(f"partition {number}: the extended partition's chain of EBRs "
                             f"comes back to sector {ebr} (a loop): check it with fdisk -l")
        seen.add(ebr)
        sector = read(ebr * lbs, 512)
        if sector[510:512] != b"\x55\xaa":
            raise ValueError(f"partition {number}: no EBR signature at sector {ebr}: the "
                             "extended partition's chain is damaged (check it with fdisk -l)")
        kind, start, sectors = _mbr_entry(sector, 0)
        if kind and sectors:
            found += 1
            if found == number:
                return (ebr + start) * lbs, sectors * lbs
        link, next_start, next_sectors = _mbr_entry(sector, 1)
        if not link or not next_sectors:
            break
        ebr = base + next_start
    else:
        raise ValueError(f"partition {number}: the extended partition's chain of EBRs is "
                         f"longer than {MAX_LOGICAL}: check it with fdisk -l")
    have = "none" if found == 4 else f"5-{found}"
    raise ValueError(f"partition {number}: this MBR's logical partitions are {have}")


def _gpt_partition(read: Callable[[int, int], bytes], lbs: int,
                   number: int) -> tuple[int, int]:
    header = read(lbs, 92)
    if header[:8] != b"EFI PART":
        raise ValueError(f"a protective MBR but no GPT header at byte {lbs}: check the "
                         "logical block size")
    table = int.from_bytes(header[72:80], "little")
    count = int.from_bytes(header[80:84], "little")
    size = int.from_bytes(header[84:88], "little")
    if not 1 <= number <= count or size < 128:
        raise ValueError(f"partition {number}: this GPT has entries 1-{count}")
    entry = read(table * lbs + (number - 1) * size, 128)
    if uuid.UUID(bytes_le=entry[:16]).int == 0:
        raise ValueError(f"partition {number} is unused in the GPT")
    first, last = int.from_bytes(entry[32:40], "little"), int.from_bytes(entry[40:48], "little")
    if last < first:
        raise ValueError(f"partition {number}'s GPT entry ends before it starts")
    return first * lbs, (last - first + 1) * lbs


def _peek(target: Target, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` through ``target.read``, before any device
    exists: on a thread with its own loop and ring (a caller's loop, if any,
    is not disturbed), into page-aligned memory (O_DIRECT)."""
    span = -(-(offset % 4096 + length) // 4096) * 4096
    buf = mmap.mmap(-1, span)
    result: list[BaseException | None] = [None]

    async def read() -> None:
        ring = Ring(8, bind_thread=True)
        try:
            await target.read(offset - offset % 4096, memoryview(buf))
        finally:
            ring.close()

    def run() -> None:
        try:
            asyncio.run(read())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result[0] = e
    t = threading.Thread(target=run, name="aioublk-peek")
    t.start()
    t.join()
    if result[0] is not None:
        raise result[0]
    return bytes(buf[offset % 4096:offset % 4096 + length])


class TruncateFilter(Filter):
    """Serve the first ``size`` bytes of the inner device."""

    name = "truncate"
    placement = True

    def __init__(self, inner: Target, size: int) -> None:
        g = inner.geometry
        _aligned("size", size, g)
        if not 0 < size <= g.size:
            raise ValueError(f"size {size} is larger than the {g.size}-byte inner device: "
                             f"give at most {g.size}")
        self.size = size
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, size=self.size)

    def place(self, inner: Map | None) -> Map | None:
        return inner  # the kernel sends nothing past the size

    def settings(self) -> dict[str, object]:
        return {"size": self.size}


class ReadonlyFilter(Filter):
    """A read-only disk (the kernel refuses writes); a write that reaches it
    anyway fails with EROFS."""

    name = "readonly"
    placement = True

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, read_only=True)

    def place(self, inner: Map | None) -> Map | None:
        if isinstance(inner, Extents):  # no write reaches C: no pool to allocate from
            return Extents(inner.table, inner.slot)
        return inner

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        raise OSError(errno.EROFS, "read-only filter")

    async def discard(self, offset: int, length: int) -> None:
        raise OSError(errno.EROFS, "read-only filter")

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        raise OSError(errno.EROFS, "read-only filter")


class DelayFilter(Filter):
    """Hold each request of an operation for its delay (seconds) before the
    inner layer sees it, as nbdkit's delay filter: a slow disk."""

    name = "delay"

    def __init__(self, inner: Target, read: float = 0, write: float = 0, flush: float = 0,
                 discard: float = 0, write_zeroes: float = 0) -> None:
        self.delays = {"read": read, "write": write, "flush": flush, "discard": discard,
                       "write_zeroes": write_zeroes}
        super().__init__(inner)

    async def _wait(self, op: str) -> None:
        if self.delays[op]:
            await asyncio.sleep(self.delays[op])

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._wait("read")
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._wait("write")
        await super().write(offset, buf, fua)

    async def flush(self) -> None:
        await self._wait("flush")
        await super().flush()

    async def discard(self, offset: int, length: int) -> None:
        await self._wait("discard")
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._wait("write_zeroes")
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {op: s for op, s in self.delays.items() if s}


class ErrorFilter(Filter):
    """Fail requests with ``errno`` (a name, e.g. "EIO"): those of the operations
    in ``ops`` ("+"-separated, default all of ``OPS``) that touch
    ``[offset, offset + length)`` (default: the whole device), each with
    probability ``rate``, as nbdkit's error filter. Zone operations pass.

    With ``hang`` such a request is never answered, to see what the kernel
    does with one: on an unprivileged device its request timeout kills the
    server (``/sys/block/ublkbN/queue/io_timeout``); on a privileged one the
    request waits until the server stops, which fails it with ``errno``."""

    name = "error"

    def __init__(self, inner: Target, rate: float = 1.0, ops: str = "+".join(OPS),
                 errno: str = "EIO", offset: int = 0, length: int | None = None,
                 seed: int | None = None, hang: bool = False) -> None:
        self.ops = _ops(ops.split("+"))
        if not 0 <= rate <= 1:
            raise ValueError(f"rate {rate} is not between 0 and 1: give e.g. 0.1")
        self.rate, self.errno_name, self.hang = rate, errno, hang
        self.code = _errno(errno)
        self.start = offset
        self.end = offset + length if length is not None else 1 << 64
        self.random = random.Random(seed)
        # wakes of the requests ``hang`` holds, on their queues' loops; None: stopping
        self._held: set[Callable[[], None]] | None = set()
        self._lock = threading.Lock()
        super().__init__(inner)

    def _matches(self, op: str, offset: int = 0, length: int = 1 << 64) -> bool:
        return op in self.ops and offset < self.end and offset + length > self.start and (
            self.rate >= 1 or self.random.random() < self.rate)

    async def _fail(self, op: str) -> None:
        """Fail a matching request, with ``hang`` once the server stops."""
        if self.hang:
            held_until, wake = crossloop.waiter()
            with self._lock:
                held = self._held
                if held is not None:
                    held.add(wake)
            if held is not None:  # (else the server is stopping: fail it now)
                try:
                    await held_until
                finally:
                    with self._lock:
                        held.discard(wake)
        raise OSError(self.code, f"error filter: {op} fails with {self.errno_name}")

    def configure(self, device_flags: int) -> None:
        with self._lock:  # (served again, e.g. recovered: hold again)
            if self._held is None:
                self._held = set()
        super().configure(device_flags)

    def stopping(self) -> None:
        with self._lock:
            held, self._held = list(self._held or ()), None
        for wake in held:
            wake()
        super().stopping()

    async def read(self, offset: int, buf: memoryview) -> None:
        if self._matches("read", offset, len(buf)):
            await self._fail("read")
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if self._matches("write", offset, len(buf)):
            await self._fail("write")
        await super().write(offset, buf, fua)

    async def flush(self) -> None:
        if self._matches("flush"):
            await self._fail("flush")
        await super().flush()

    async def discard(self, offset: int, length: int) -> None:
        if self._matches("discard", offset, length):
            await self._fail("discard")
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        if self._matches("write_zeroes", offset, length):
            await self._fail("write_zeroes")
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"rate": self.rate, "ops": "+".join(sorted(self.ops)), "errno": self.errno_name,
                "offset": self.start,
                "length": None if self.end == 1 << 64 else self.end - self.start,
                **({"hang": True} if self.hang else {})}


def _ops(names: Iterable[str]) -> frozenset[str]:
    ops = frozenset(n.strip() for n in names if n.strip())
    unknown = sorted(ops - set(OPS))
    if unknown or not ops:
        raise ValueError(f"ops {'+'.join(unknown) or '(none)'}: use some of "
                         f"{'+'.join(OPS)}")
    return ops


def _errno(name: str) -> int:
    code = getattr(errno, name.upper(), None)
    if not isinstance(code, int) or not name.upper().startswith("E"):
        raise ValueError(f"errno {name!r} is no errno name: give e.g. EIO or ENOSPC")
    return code


class _Bucket:
    """A token bucket shared by every queue's thread: ``rate`` tokens a second,
    at most ``burst`` saved. A taker may overdraw it and then waits until the
    bucket would have held what it took, so a large request is late, not
    refused."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.then = burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: float) -> float:
        """Seconds the taker of ``n`` tokens must wait."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.then) * self.rate) - n
            self.then = now
            return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class RateFilter(Filter):
    """Limit the device to ``iops`` requests and ``bandwidth`` bytes a second
    (0: no limit), with a burst of one second's worth, as nbdkit's rate
    filter. Reads and writes count bytes; discards and write-zeroes count
    requests only."""

    name = "rate"

    def __init__(self, inner: Target, iops: int = 0, bandwidth: int = 0) -> None:
        if iops < 0 or bandwidth < 0:
            raise ValueError("a negative limit: give 0 (none) or more")
        self.iops = _Bucket(iops, iops) if iops else None
        self.bandwidth = _Bucket(bandwidth, bandwidth) if bandwidth else None
        super().__init__(inner)

    async def _pace(self, n: int) -> None:
        wait = max(self.iops.take(1) if self.iops else 0.0,
                   self.bandwidth.take(n) if self.bandwidth and n else 0.0)
        if wait:
            await asyncio.sleep(wait)

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._pace(len(buf))
        await super().read(offset, buf)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._pace(len(buf))
        await super().write(offset, buf, fua)

    async def discard(self, offset: int, length: int) -> None:
        await self._pace(0)
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._pace(0)
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"iops": int(self.iops.rate) if self.iops else 0,
                "bandwidth": int(self.bandwidth.rate) if self.bandwidth else 0}


class LogFilter(Filter):
    """One JSON line per request to ``file`` (op, offset, length, latency in
    microseconds, result: 0 or -errno), rotated past ``max_size`` bytes with
    ``keep`` old files (FILE.1 ...), as nbdkit's log filter keeps a record."""

    name = "log"

    def __init__(self, inner: Target, file: str, max_size: int = 0, keep: int = 3) -> None:
        self.file = os.path.abspath(file)
        try:  # opened now: a daemon serves from /, and a mistake is the command's error
            self.handler = logging.handlers.RotatingFileHandler(
                self.file, maxBytes=max_size, backupCount=keep if max_size else 0)
        except OSError as e:
            raise ValueError(f"cannot open {self.file}: {e.strerror}: fix the path") from None
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        super().__init__(inner)

    async def _logged(self, op: str, offset: int, length: int, call: Any) -> Any:
        t0 = time.monotonic()
        result = 0
        try:
            return await call
        except OSError as e:
            result = -(e.errno or errno.EIO)
            raise
        except Exception:
            result = -errno.EIO
            raise
        finally:
            line = json.dumps({"time": round(time.time(), 6), "op": op, "offset": offset,
                               "length": length,
                               "latency_us": round((time.monotonic() - t0) * 1e6),
                               "result": result})
            self.handler.emit(logging.makeLogRecord({"msg": line}))

    async def read(self, offset: int, buf: memoryview) -> None:
        await self._logged("read", offset, len(buf), super().read(offset, buf))

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._logged("write_fua" if fua else "write", offset, len(buf),
                           super().write(offset, buf, fua))

    async def flush(self) -> None:
        await self._logged("flush", 0, 0, super().flush())

    async def discard(self, offset: int, length: int) -> None:
        await self._logged("discard", offset, length, super().discard(offset, length))

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._logged("write_zeroes", offset, length,
                           super().write_zeroes(offset, length, unmap))

    def close(self) -> None:
        self.handler.close()
        super().close()

    def settings(self) -> dict[str, object]:
        return {"file": self.file}


class CowFilter(Filter):
    """Copy on write, as ``qemu-nbd -s`` and nbdkit's cow filter: writes go to an
    overlay (in memory, or in ``file``, a sparse file made anew) in ``block``
    -byte blocks, reads take each block from the overlay if written, else
    from the inner device, which is never written but on request. The
    overlay lives as long as the server: a scratch layer, not a store.
    ``commit_now`` (``aioublk commit -n ID``, a signal to the server) writes
    what it holds that the inner device has not, and flushes it, while the
    device serves (qemu-img commit's effect); ``commit`` does so when the
    device stops too."""

    name = "cow"

    def __init__(self, inner: Target, file: str | None = None, block: int = 4096,
                 commit: bool = False) -> None:
        lbs = inner.geometry.logical_block_size
        if block & (block - 1) or block < lbs:
            raise ValueError(f"block {block} is not a power of two of at least the logical "
                             f"block size {lbs}: give e.g. 4096")
        self.block, self.file = block, os.path.abspath(file) if file else None
        self.mem: dict[int, bytes] = {}
        self.present = bytearray(-(-inner.geometry.size // block))
        self.fd = -1
        if self.file:
            try:
                self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                  0o600)
            except OSError as e:
                raise ValueError(f"cannot create {self.file}: {e.strerror}: fix the path") \
                    from None
        self.lock = threading.Lock()  # the overlay's blocks, shared by the queue threads
        #: blocks the inner device does not have yet: block -> the write's number
        #: (a block written again while a commit copies it is owed again)
        self.owed: dict[int, int] = {}
        self._writes = 0
        self.commit = commit
        #: the first queue loop's handle: commits run there, on its ring
        self._owner: crossloop.LoopHandle | None = None
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        return replace(geometry, discard=True, write_zeroes=True)

    async def queue_setup(self, q: QueueContext) -> None:
        if self._owner is None:
            self._owner = crossloop.current()
        await super().queue_setup(q)

    async def drain(self) -> None:
        """With ``commit``: what the inner device is owed, before it drains."""
        if self.commit:
            await self._commit()
        await super().drain()

    async def commit_now(self) -> int:
        """Write to the inner device every block of the overlay it does not
        have, then flush it; the device serves meanwhile (a block written
        again during the commit is owed again). Returns the blocks written.
        Runs on the first queue's loop, from any loop."""
        here, owner = crossloop.current(), self._owner
        if owner is None or here is owner:
            return await self._commit()
        temporary = here is None
        if here is None:  # (a loop without a handle: the server's control loop)
            here = crossloop.LoopHandle.new(asyncio.get_running_loop())
        try:
            return await crossloop.call_on(owner, here, self._commit)
        finally:
            if temporary:
                here.close()

    async def _commit(self) -> int:
        with self.lock:  # taken: a commit running beside this one finds none of them
            owed, self.owed = sorted(self.owed.items()), {}
        out = memoryview(mmap.mmap(-1, self.block))  # page aligned: O_DIRECT
        try:
            for b, _ in owed:
                with self.lock:
                    out[:] = self._get(b)
                await self.inner.write(b * self.block, out)
            if owed:
                await self.inner.flush()
        except BaseException:
            with self.lock:  # still owed (a block written since has its newer entry)
                for b, n in owed:
                    self.owed.setdefault(b, n)
            raise
        return len(owed)

    def _get(self, b: int) -> bytes:
        if self.fd >= 0:
            return os.pread(self.fd, self.block, b * self.block)
        return self.mem[b]

    def _put(self, b: int, data: bytes) -> None:
        if self.fd >= 0:
            os.pwrite(self.fd, data, b * self.block)
        else:
            self.mem[b] = data
        self.present[b] = 1
        self._writes += 1
        self.owed[b] = self._writes

    async def read(self, offset: int, buf: memoryview) -> None:
        first, last = offset // self.block, (offset + len(buf) - 1) // self.block
        with self.lock:
            absent = [b for b in range(first, last + 1) if not self.present[b]]
        for lo, hi in _runs(absent):  # straight from the inner device, in runs
            start = max(offset, lo * self.block)
            end = min(offset + len(buf), (hi + 1) * self.block)
            await self.inner.read(start, buf[start - offset:end - offset])
        with self.lock:  # the overlay wins, including blocks written meanwhile
            for b in range(first, last + 1):
                if self.present[b]:
                    start = max(offset, b * self.block)
                    end = min(offset + len(buf), (b + 1) * self.block)
                    base = b * self.block
                    buf[start - offset:end - offset] = self._get(b)[start - base:end - base]

    async def _store(self, offset: int, data: memoryview | bytes, length: int) -> None:
        """``data`` (or zeros, when empty) over ``[offset, offset + length)``; a
        block written in part is first filled from the inner device."""
        first, last = offset // self.block, (offset + length - 1) // self.block
        edges: dict[int, bytes] = {}
        for b in {first, last}:
            whole = offset <= b * self.block and (b + 1) * self.block <= offset + length
            if not whole and not self.present[b]:
                piece = memoryview(bytearray(self.block))
                await self.inner.read(b * self.block, piece)
                edges[b] = bytes(piece)
        with self.lock:
            for b in range(first, last + 1):
                base = b * self.block
                start, end = max(offset, base), min(offset + length, base + self.block)
                if start == base and end == base + self.block:
                    block = bytes(data[start - offset:end - offset]) if data else \
                        bytes(self.block)
                else:
                    old = bytearray(self._get(b) if self.present[b] else edges[b])
                    old[start - base:end - base] = data[start - offset:end - offset] if data \
                        else bytes(end - start)
                    block = bytes(old)
                self._put(b, block)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        await self._store(offset, buf, len(buf))

    async def discard(self, offset: int, length: int) -> None:
        await self._store(offset, b"", length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._store(offset, b"", length)

    async def flush(self) -> None:
        """Nothing to make durable: the overlay is scratch."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()

    def settings(self) -> dict[str, object]:
        return {"file": self.file or "memory", "block": self.block, "commit": self.commit}


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs


class ProtectFilter(Filter):
    """Refuse writes, discards and write-zeroes touching any of ``ranges``
    ((start, end) bytes, end exclusive) with EPERM, as nbdkit's protect filter.

    Over a linear map (loop) C keeps serving: the map becomes an extent table
    of the same file whose protected granules are read-only, so their writes
    miss to Python, which refuses them. The granule is the largest power of
    two (up to 2 MiB) the ranges, the size and the file offset are multiples
    of; a table that would not fit ``MAX_GRANULES`` leaves all to Python."""

    name = "protect"
    placement = True
    MAX_GRANULES = 1 << 20

    def __init__(self, inner: Target, ranges: Iterable[tuple[int, int]]) -> None:
        self.ranges = list(ranges)
        if not self.ranges or any(not 0 <= a < b for a, b in self.ranges):
            raise ValueError(f"ranges {self.ranges}: give at least one, each START < END")
        self._table: ExtentTable | None = None
        self._built = False
        self._table_lock = threading.Lock()  # (map() runs on every queue's thread)
        super().__init__(inner)

    def place(self, inner: Map | None) -> Map | None:
        if not isinstance(inner, Linear):
            return None
        with self._table_lock:
            if not self._built:
                self._table, self._built = self._fence(inner), True
        return Extents(self._table) if self._table is not None else None

    def _fence(self, inner: Linear) -> ExtentTable | None:
        size = self.geometry.size
        edges = {0, size, inner.base, *(x for r in self.ranges for x in r if x < size)}
        granule = 1 << 21
        while granule > 512 and any(e % granule for e in edges):
            granule >>= 1
        if any(e % granule for e in edges) or size // granule > self.MAX_GRANULES:
            return None
        table = ExtentTable(granule, max_entries=size // granule + 1)
        cuts = sorted({0, size, *(x for r in self.ranges for x in r if x < size)})
        for start, end in zip(cuts, cuts[1:], strict=False):
            fenced = any(start < b and end > a for a, b in self.ranges)
            if not table.insert(start, end - start, inner.fd, inner.base + start,
                                writable=not fenced):
                table.close()
                return None
        return table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
        super().close()

    def _check(self, offset: int, length: int) -> None:
        for start, end in self.ranges:
            if offset < end and offset + length > start:
                raise OSError(errno.EPERM, f"protect filter: bytes {start}-{end} are protected")

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        self._check(offset, len(buf))
        await self.inner.write(offset, buf, fua)  # type: ignore[arg-type]

    async def discard(self, offset: int, length: int) -> None:
        self._check(offset, length)
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        self._check(offset, length)
        await super().write_zeroes(offset, length, unmap)

    def settings(self) -> dict[str, object]:
        return {"ranges": "+".join(f"{a}-{b}" for a, b in self.ranges)}


#: dm-crypt's plain mode as ``cryptsetup open --type plain --cipher aes-xts-plain64
#: --key-size 512`` sets it up: 512-byte sectors, each its own XTS tweak
SECTOR = 512
KEY_BYTES = 64


class EncryptFilter(Filter):
    """AES-XTS with the 64-byte key in ``keyfile``, the same bytes on disk as
    dm-crypt's plain mode (``cryptsetup open --type plain --cipher
    aes-xts-plain64 --key-size 512 --key-file KEYFILE``): each 512-byte
    sector encrypted with its number from the start of the inner device,
    little-endian, as the tweak (plain64). The ``cryptography`` package does
    the cipher. A key file group or others may read or write is refused
    (anyone who reads it reads the disk) unless ``allow_insecure_key``."""

    name = "encrypt"

    def __init__(self, inner: Target, keyfile: str, allow_insecure_key: bool = False) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        except ImportError:
            raise ValueError("needs the cryptography package: pip install "
                             "'aioublk[encrypt]'") from None
        with open(keyfile, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o7777  # (the file read, not its name)
            if mode & 0o066 and not allow_insecure_key:
                raise ValueError(f"key file {keyfile} has mode {mode:04o}, so others may read "
                                 f"or write it: chmod 600 {keyfile}, or add "
                                 "allow_insecure_key=true to the filter to use it anyway")
            key = f.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise ValueError(f"key file {keyfile} holds {len(key)}{'+' * (len(key) > 64)} "
                             f"bytes: an AES-XTS key for --key-size 512 is {KEY_BYTES}: "
                             "make one with head -c 64 /dev/urandom")
        try:
            self._algorithm = algorithms.AES(key)
            Cipher(self._algorithm, modes.XTS(bytes(16))).encryptor()
        except ValueError as e:  # (XTS refuses a key whose two halves are equal)
            raise ValueError(f"key file {keyfile}: {e}") from None
        self._cipher, self._xts = Cipher, modes.XTS
        self.keyfile = os.path.abspath(keyfile)
        super().__init__(inner)

    def _crypt(self, offset: int, data: memoryview, out: memoryview, encrypt: bool) -> None:
        sector = offset // SECTOR
        for at in range(0, len(data), SECTOR):
            tweak = (sector + at // SECTOR).to_bytes(16, "little")
            c = self._cipher(self._algorithm, self._xts(tweak))
            op = c.encryptor() if encrypt else c.decryptor()
            out[at:at + SECTOR] = op.update(data[at:at + SECTOR]) + op.finalize()

    async def read(self, offset: int, buf: memoryview) -> None:
        await super().read(offset, buf)
        self._crypt(offset, buf, buf, encrypt=False)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        sealed = memoryview(bytearray(len(buf)))
        self._crypt(offset, buf, sealed, encrypt=True)
        await super().write(offset, sealed, fua)

    def shape(self, geometry: Any) -> Any:
        # a discarded or zeroed range would read back as the decryption of zeros
        return replace(geometry, discard=False, write_zeroes=False)

    def settings(self) -> dict[str, object]:
        return {"keyfile": self.keyfile, "cipher": "aes-xts-plain64", "key_size": 512}


class CacheFilter(Filter):
    """A cache in RAM of ``size`` bytes in ``block``-byte blocks, least recently
    used out first, as nbdkit's cache filter.

    ``mode="writethrough"`` (the default): a write goes to the inner layer,
    and the blocks it touches leave the cache, so what the cache holds is
    always what the inner layer holds. ``mode="writeback"``: a write lands in
    the cache (dirty) and the device advertises a volatile cache with FUA: a
    FLUSH writes the dirty blocks back and flushes the inner layer, a FUA
    write is written back and flushed before it completes. A device with
    user recovery (``-r 1``) must lose no acknowledged write to a new server,
    so there the cache writes through whatever the mode.

    The queues' threads share the cache, and their requests interleave at
    every await: a block's bytes from the inner layer (a *fill*) are kept
    only if nothing changed the block while they were read; a block is
    written back by one request at a time, so an older copy never lands
    after a newer one."""

    name = "cache"

    def __init__(self, inner: Target, size: int = 64 << 20, block: int = 65536,
                 mode: str = "writethrough") -> None:
        lbs = inner.geometry.logical_block_size
        if block & (block - 1) or not lbs <= block <= size:
            raise ValueError(f"block {block} is not a power of two between the logical block "
                             f"size {lbs} and size {size}: give e.g. 64K")
        if mode not in ("writethrough", "writeback"):
            raise ValueError(f"mode {mode!r}: use writethrough or writeback")
        self.block, self.slots, self.mode = block, max(1, size // block), mode
        self.blocks: OrderedDict[int, bytearray] = OrderedDict()
        self.dirty: dict[int, int] = {}  # block -> its version (write-back)
        self.version = 0
        self.fills: dict[int, set[int]] = {}  # per inner read in flight: its still valid blocks
        self.writing: dict[int, list[Callable[[], None]]] = {}  # written back now -> waiters
        self.lock = threading.Lock()
        super().__init__(inner)

    def shape(self, geometry: Any) -> Any:
        if self.mode == "writeback":
            return replace(geometry, volatile_cache=True, fua=True)
        return geometry

    def configure(self, device_flags: int) -> None:
        if self.mode == "writeback" and device_flags & uapi.Feature.USER_RECOVERY:
            self.mode = "writethrough"  # (nothing dirty yet: no request came)
        super().configure(device_flags)

    def _span(self, offset: int, length: int) -> range:
        return range(offset // self.block, (offset + length - 1) // self.block + 1)

    def _partial(self, offset: int, length: int) -> list[int]:
        """The blocks ``[offset, offset + length)`` covers only in part."""
        span = self._span(offset, length)
        return [b for b in dict.fromkeys((span[0], span[-1]))
                if offset > b * self.block or (b + 1) * self.block > offset + length]

    async def _fetch(self, first: int, last: int) -> memoryview:
        """Blocks ``first..last`` from the inner layer, in page-aligned memory."""
        buf = memoryview(mmap.mmap(-1, (last - first + 1) * self.block))
        await self.inner.read(first * self.block, buf)
        return buf

    def _fill(self, blocks: Iterable[int]) -> tuple[int, set[int]]:
        """(Under the lock.) Watch ``blocks`` while an inner read fetches them."""
        self.version += 1
        fill = self.fills[self.version] = set(blocks)
        return self.version, fill

    def _insert(self, b: int, data: bytearray | memoryview, dirty: bool = False) -> None:
        """(Under the lock.) Block ``b`` is ``data`` (a bytearray is kept, not
        copied); clean blocks past the capacity leave, least recently used first."""
        self.blocks[b] = data if isinstance(data, bytearray) else bytearray(data)
        self.blocks.move_to_end(b)
        for fill in self.fills.values():
            fill.discard(b)
        if dirty:
            self.version += 1
            self.dirty[b] = self.version
        while len(self.blocks) > self.slots:
            old = next((k for k in self.blocks if k not in self.dirty), None)
            if old is None:
                break  # all dirty: write-back trims them (_trim)
            del self.blocks[old]

    def _forget(self, span: range) -> None:
        """(Under the lock.) The blocks of ``span`` change under the cache."""
        blocks = span if len(span) <= len(self.blocks) else [b for b in self.blocks if b in span]
        for b in blocks:
            self.blocks.pop(b, None)
            self.dirty.pop(b, None)
        for fill in self.fills.values():
            fill.difference_update([b for b in fill if b in span])

    def _copy_cached(self, offset: int, buf: memoryview) -> list[int]:
        """(Under the lock.) The cached blocks' bytes into ``buf``; the blocks
        that are not cached."""
        missing = []
        for b in self._span(offset, len(buf)):
            data = self.blocks.get(b)
            if data is None:
                missing.append(b)
                continue
            self.blocks.move_to_end(b)
            base = b * self.block
            start, end = max(offset, base), min(offset + len(buf), base + self.block)
            buf[start - offset:end - offset] = data[start - base:end - base]
        return missing

    async def read(self, offset: int, buf: memoryview) -> None:
        with self.lock:
            missing = self._copy_cached(offset, buf)
            if missing:
                token, fill = self._fill(missing)
        if not missing:
            return
        try:
            for first, last in _runs(missing):
                data = await self._fetch(first, last)
                with self.lock:
                    for b in range(first, last + 1):
                        piece = data[(b - first) * self.block:(b - first + 1) * self.block]
                        base = b * self.block
                        start = max(offset, base)
                        end = min(offset + len(buf), base + self.block)
                        if b in self.blocks:  # written meanwhile (write-back): it wins
                            piece = memoryview(self.blocks[b])
                        elif b in fill:
                            self._insert(b, piece)
                        buf[start - offset:end - offset] = piece[start - base:end - base]
        finally:
            with self.lock:
                del self.fills[token]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        if self.mode == "writethrough":
            await self._around(offset, len(buf), super().write(offset, buf, fua))
            return
        await self._store(offset, buf)
        if fua:  # this write's blocks, and any a trim wrote back first, durable now
            await self._write_back(self._span(offset, len(buf)))
            await super().flush()
        await self._trim()

    async def _store(self, offset: int, buf: memoryview) -> None:
        """(Write-back.) ``buf`` into the cache, dirty. A block
        written in part is first fetched, unless cached; the write lands only
        when every such block's bytes are current, so a fetch a write (or an
        eviction) overtook is done again."""
        length = len(buf)
        partial = self._partial(offset, length)
        while True:
            with self.lock:
                need = [b for b in partial if b not in self.blocks]
                if not need:
                    self._apply(offset, buf, length, {})
                    return
                token, fill = self._fill(need)
            try:
                got = {b: await self._fetch(b, b) for b in need}
                with self.lock:
                    if all(b in self.blocks or b in fill for b in partial):
                        self._apply(offset, buf, length, got)
                        return
            finally:
                with self.lock:
                    del self.fills[token]

    def _apply(self, offset: int, buf: memoryview, length: int,
               fetched: dict[int, memoryview]) -> None:
        """(Under the lock.) Lay the write over the cached or ``fetched`` blocks,
        all taken before any goes in (an insert may evict a clean one)."""
        span = self._span(offset, length)
        olds = [self.blocks.get(b) for b in span]
        for b, old in zip(span, olds, strict=True):
            base = b * self.block
            start, end = max(offset, base), min(offset + length, base + self.block)
            block = old if old is not None else bytearray(fetched.get(b, bytes(self.block)))
            block[start - base:end - base] = buf[start - offset:end - offset]
            self._insert(b, block, dirty=True)

    async def _trim(self) -> None:
        """Write back the oldest dirty blocks while there are more than fit."""
        while True:
            with self.lock:
                over = len(self.blocks) - self.slots
                victims = [b for b in self.blocks if b in self.dirty][:max(over, 0)]
            if not victims:
                return
            await self._write_back(victims)
            with self.lock:
                for b in victims:
                    if b not in self.dirty:
                        self.blocks.pop(b, None)

    async def _write_back(self, blocks: Iterable[int]) -> None:
        """Write these blocks, if dirty, to the inner layer; each stays dirty if
        it was written again meanwhile."""
        with self.lock:
            todo = [b for b in blocks if b in self.dirty]
        await asyncio.gather(*(self._write_back_one(b) for b in todo))

    async def _write_back_one(self, b: int) -> None:
        """Block ``b``'s cached bytes to the inner layer, after any write-back of
        it in flight (whose older bytes must not land after these)."""
        while True:
            with self.lock:
                version = self.dirty.get(b)
                if version is None:
                    return  # (another write-back took it)
                waiters = self.writing.get(b)
                if waiters is None:
                    self.writing[b] = []
                    out = memoryview(mmap.mmap(-1, self.block))  # page aligned: O_DIRECT
                    out[:] = self.blocks[b]
                    break
                ready, wake = crossloop.waiter()
                waiters.append(wake)
            await ready
        try:
            await self.inner.write(b * self.block, out)
            with self.lock:
                if self.dirty.get(b) == version:
                    del self.dirty[b]
        finally:
            with self.lock:
                for wake in self.writing.pop(b):
                    wake()

    async def flush(self) -> None:
        with self.lock:
            dirty = list(self.dirty)
        await self._write_back(dirty)
        await super().flush()

    async def _around(self, offset: int, length: int, change: Awaitable[None]) -> None:
        """Run ``change`` of ``[offset, offset + length)`` on the inner layer, its
        blocks out of the cache before and after, so no fill that read the old
        bytes stays. (Write-back: only whole blocks, none being written back.)"""
        span = self._span(offset, length)
        with self.lock:
            self._forget(span)
            busy = [b for b in self.writing if b in span]
        for b in busy:  # an older write-back must not land on top of the change
            await self._settled(b)
        try:
            await change
        finally:
            with self.lock:
                self._forget(span)

    async def _settled(self, b: int) -> None:
        """Until no write-back of block ``b`` is in flight."""
        with self.lock:
            waiters = self.writing.get(b)
            if waiters is None:
                return
            ready, wake = crossloop.waiter()
            waiters.append(wake)
        await ready

    async def _zero(self, offset: int, length: int,
                    change: Callable[[int, int], Awaitable[None]]) -> None:
        """A discard or write-zeroes: through, or (write-back) zeros in the
        cache for the blocks it covers in part and ``change`` of the whole
        ones between."""
        if self.mode == "writethrough":
            await self._around(offset, length, change(offset, length))
            return
        first = -(-offset // self.block) * self.block
        end = (offset + length) // self.block * self.block
        if first >= end:  # within a block, or two
            first = end = offset + length
        for lo, hi in ((offset, min(first, offset + length)), (max(end, first), offset + length)):
            if lo < hi:
                await self._store(lo, memoryview(bytes(hi - lo)))
        if first < end:
            await self._around(first, end - first, change(first, end - first))
        await self._trim()

    async def discard(self, offset: int, length: int) -> None:
        await self._zero(offset, length, self.inner.discard)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._zero(offset, length, lambda o, n: self.inner.write_zeroes(o, n, unmap))

    async def drain(self) -> None:
        await self.flush()
        await super().drain()

    def settings(self) -> dict[str, object]:
        return {"size": self.slots * self.block, "block": self.block, "mode": self.mode}
