"""Power cut, not just kill -9 (host only, QEMU's tools as the oracle).

kill -9 keeps the page cache, so it cannot tell a write-back that syncs in
the right order from one that never syncs. Here the engine runs a workload
over a recording layer under its image file (every write with its bytes,
every sync as a barrier, each with when it was submitted and when it
completed), and crash images are built from the recording at every cut
point: the file as of the last completed sync (every write that completed
before that sync began), plus any subset of the writes submitted before the
next sync completed, in random subsets with fixed seeds, some of them torn
(only a prefix of their 512-byte sectors written). Each crash image must
pass ``qemu-img check`` (exit 0, or 3: leaked clusters only; never 2,
corruption) and read back, through ``qemu-img convert``, exactly what the
last completed flush made durable (the sectors no later request touched).

Workloads: allocation, copy-on-write over a backing file, copy-on-write
over an internal snapshot (``qemu-img snapshot -c``), refcount-table growth,
discard and reuse of the freed clusters, the metadata write-through mode,
and allocation and copy-on-write in C (``aioublk.qcow2.pools``): stand-ins
for the queues' data planes write through the image's real extent table and
pools, copy a backing file's data into the clusters they allocate for it as
C does, and record their writes themselves, since C's bypass the image
file's layer. The checker is checked too: a write-back plan with a barrier
dropped, or with refcount blocks and L2 tables swapped, pools refilled with
clusters never counted, a data plane that records an allocation (and
answers) before its data is written, and one whose copy-on-write copies
land after the next FLUSH, must be caught.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest

from aioublk.dataplane.extents import DONE, FAILED, UNUSED, ZERO_FD, Copy, Handle
from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2 import writeback as wbplan
from aioublk.qcow2.pools import Pools
from aioublk.ring import Ring
from tests.support.qcow2_util import SECTOR, K, M, create, qemu_img, qemu_io, to_raw

VARIANTS = 14  # crash images per cut point besides "nothing after" and "everything after"
T = TypeVar("T")


# -- the recording layer ------------------------------------------------------------------


@dataclass
class WriteEv:
    offset: int
    data: bytes
    submit: int
    complete: int = 1 << 62  # never, until it completes


@dataclass
class SyncEv:
    begin: int
    end: int


@dataclass
class Recording:
    initial: bytes
    writes: list[WriteEv] = field(default_factory=list)
    syncs: list[SyncEv] = field(default_factory=list)
    flushes: list[tuple[int, bytes]] = field(default_factory=list)  # (when, disk content)
    touched_after: list[bytearray] = field(default_factory=list)  # per flush: sector mask
    clock: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # (C stand-ins' threads tick)
    c_allocated: int = 0  # clusters the C stand-ins allocated that became data
    c_grown: int = 0  # of those, writes that added subclusters to a cluster C had
    refused: str = ""  # the engine found its image corrupt and refused it (the workload stopped)
    flushes_over_c: int = 0  # FLUSHes sent while a C stand-in held a write

    def tick(self) -> int:
        with self.lock:
            self.clock += 1
            return self.clock


def recording_file(rec: Recording) -> type[HostFile]:
    """A HostFile that records into ``rec`` (swapped in as the image file's class)."""

    class RecordingFile(HostFile):
        __slots__ = ()

        async def write(self, buf: Any, offset: int) -> None:
            ev = WriteEv(offset, bytes(buf), rec.tick())
            rec.writes.append(ev)
            await super().write(buf, offset)
            ev.complete = rec.tick()

        async def writev(self, bufs: list[Any], offset: int) -> None:
            ev = WriteEv(offset, b"".join(bytes(b) for b in bufs), rec.tick())
            rec.writes.append(ev)
            await super().writev(bufs, offset)
            ev.complete = rec.tick()

        async def sync(self) -> None:
            begin = rec.tick()
            await super().sync()
            rec.syncs.append(SyncEv(begin, rec.tick()))

    return RecordingFile


class Disk:
    """The expected content of the virtual disk (as of the requests completed),
    and what touched which sector."""

    def __init__(self, content: bytes) -> None:
        self.content = bytearray(content)
        self.masks: list[bytearray] = []  # one per flush so far: sectors touched since
        self.pending: dict[int, tuple[int, int]] = {}  # request in flight -> its sectors
        self._seq = 0

    def issue(self, off: int, n: int) -> int:
        """A request for [off, off + n) was sent: returns its key for ``touch``."""
        self._seq += 1
        self.pending[self._seq] = (off // SECTOR, -(-(off + n) // SECTOR))
        return self._seq

    def touch(self, off: int, data: bytes, req: int | None = None) -> None:
        """Request ``req`` (from ``issue``) completed, having written ``data``."""
        self.pending.pop(req or 0, None)
        self.content[off:off + len(data)] = data
        s, e = off // SECTOR, -(-(off + len(data)) // SECTOR)
        for m in self.masks:
            m[s:e] = b"\1" * (e - s)

    def mask(self) -> bytearray:
        """A new mask of the sectors touched from now on (a FLUSH was sent),
        starting with those of the requests in flight: either may be durable."""
        m = bytearray(len(self.content) // SECTOR)
        for s, e in self.pending.values():
            m[s:e] = b"\1" * (e - s)
        self.masks.append(m)
        return m


class CStandIn:
    """One queue's data plane allocating in C, over the image's real extent
    table and a pool of its own: a write the table covers (in place, or to
    ALLOC granules, which take clusters from the pool) is written here with
    ``os.pwrite``, recorded as the image file's layer records the engine's
    writes, and only then released ``DONE``, which pushes C's record; the
    request completes after that, as C answers after its record. One
    allocating write in 50 fails after writing (``FAILED``) and one in 50 is
    given up before (``UNUSED``), both then served by the engine; a miss is
    the engine's too. Each C step runs on a thread of its own (``threads``:
    the table's mutex sees concurrent acquires) or on the loop after a short
    random pause, so that the engine's work interleaves either way."""

    #: the mutation the checker must catch: release (the record) and the
    #: answer before the data of an allocating write is written, the data
    #: landing only after the next FLUSH (the worst a data write may take)
    record_before_data = False
    #: the mutation the checker must catch: a copy-on-write's copies of the
    #: backing data land only after the next FLUSH, while its data and record
    #: (so its L2 entry) are on time
    copies_late = False
    #: the odds of DONE, FAILED and UNUSED for an allocating write
    outcomes = (48, 1, 1)

    def __init__(self, img: Qcow2Image, rec: Recording, seed: int, *, threads: bool) -> None:
        table = img.extent_table()
        assert table is not None
        self.img, self.rec, self.table, self.threads = img, rec, table, threads
        self.rng = random.Random(seed)
        self.slot = img.attach_pool()
        assert self.slot >= 0, "no pool: allocation in C is off"
        self.fd = os.open(img.path, os.O_WRONLY)  # (buffered: the pieces are unaligned)
        self.allocated = 0  # clusters C allocated that became data
        self.copied = 0  # copies of backing data made for a copy-on-write
        self.held = 0  # writes acquired and not yet answered
        self.late: list[asyncio.Task[None]] = []  # data written after the answer (mutation)
        self.closing = False

    async def _step(self, fn: Callable[[], T]) -> T:
        if self.threads:
            return await asyncio.to_thread(fn)
        await asyncio.sleep(self.rng.choice((0, 0, 0.0002, 0.001)))
        return fn()

    def _copy(self, copies: list[Copy]) -> None:
        """A copy-on-write's copies, as C makes them: the backing data read
        into a buffer, written into the new cluster (recorded)."""
        for sfd, soff, dfd, doff, n in copies:
            assert dfd == self.img.file.fd, "a copy into another file than the image"
            buf = mmap.mmap(-1, n)  # (the backing file may be open O_DIRECT)
            assert os.preadv(sfd, [buf], soff) == n
            ev = WriteEv(doff, bytes(buf), self.rec.tick())
            self.rec.writes.append(ev)
            assert os.pwrite(self.fd, ev.data, doff) == n
            ev.complete = self.rec.tick()

    def _pwrite(self, pieces: list[tuple[int, int, int]], data: bytes) -> None:
        pos = 0
        for fd, host, n in pieces:
            assert fd != ZERO_FD, "a write resolved to zeros"
            ev = WriteEv(host, data[pos:pos + n], self.rec.tick())
            self.rec.writes.append(ev)
            assert os.pwrite(self.fd, ev.data, host) == n
            ev.complete = self.rec.tick()
            pos += n

    async def write(self, off: int, data: bytes) -> None:
        self.img.service()  # (C notifies the engine at half a pool: here, at every request)
        if not await self._c_write(off, data):
            await self.img.write(off, data)

    async def _c_write(self, off: int, data: bytes) -> bool:
        held = await self._step(partial(self.table.acquire, off, len(data), write=True,
                                        slot=self.slot))
        if held is None:
            return False
        self.held += 1
        try:
            return await self._write_held(data, *held)
        finally:
            self.held -= 1

    async def _write_held(self, data: bytes, pieces: list[tuple[int, int, int]],
                          handle: Handle) -> bool:
        outcome = DONE
        if handle.allocates:
            outcome = self.rng.choices((DONE, FAILED, UNUSED), self.outcomes)[0]
            if outcome == UNUSED:
                await self._step(partial(self.table.release, handle, UNUSED))
                return False
            if outcome == DONE and self.record_before_data:
                done = await self._step(partial(self.table.release, handle, DONE))
                self.allocated += done  # (not `+= await`: that reads the count before)
                self.late.append(asyncio.create_task(self._late(pieces, data)))
                return True
        if handle.copies and outcome == DONE and self.copies_late:
            self.late.append(asyncio.create_task(self._late_copies(handle.copies)))
        elif handle.copies:
            await self._step(partial(self._copy, handle.copies))
            self.copied += len(handle.copies)
        await self._step(partial(self._pwrite, pieces, data))
        done = await self._step(partial(self.table.release, handle, outcome))
        self.allocated += done
        return outcome == DONE

    async def _late(self, pieces: list[tuple[int, int, int]], data: bytes) -> None:
        flushes = len(self.rec.flushes)
        while len(self.rec.flushes) == flushes and not self.closing:
            await asyncio.sleep(0)
        await self._step(partial(self._pwrite, pieces, data))

    async def _late_copies(self, copies: list[Copy]) -> None:
        flushes = len(self.rec.flushes)
        while len(self.rec.flushes) == flushes and not self.closing:
            await asyncio.sleep(0)
        await self._step(partial(self._copy, copies))

    async def close(self) -> None:
        self.closing = True
        await asyncio.gather(*self.late)
        os.close(self.fd)


class Session:
    """A workload's view: requests through the engine, mirrored into ``disk``;
    with ``planes`` (C stand-ins, one per queue) each write goes to one of
    them, as the kernel spreads requests over queues."""

    def __init__(self, img: Qcow2Image, rec: Recording, disk: Disk,
                 planes: list[CStandIn] | None = None) -> None:
        self.img, self.rec, self.disk = img, rec, disk
        self.planes = planes or []

    async def batch(self, ops: list[tuple[str, int, int]], rng: random.Random, *,
                    flushes: int = 0) -> None:
        """Non-overlapping (kind, offset, length) requests, all at once, and
        ``flushes`` FLUSHes sent while they are in flight."""
        async def one(kind: str, off: int, n: int) -> None:
            data = rng.randbytes(n) if kind == "write" else bytes(n)
            req = self.disk.issue(off, n)
            if kind == "write":
                await (rng.choice(self.planes).write(off, data) if self.planes
                       else self.img.write(off, data))
            elif kind.startswith("zero"):
                await self.img.write_zeroes(off, n, unmap=kind == "zero-unmap")
            else:
                await self.img.discard(off, n)
            self.disk.touch(off, data, req)

        async def flush_soon() -> None:
            # a few loop turns in, once a C stand-in holds a write (if any will)
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)
            while not any(p.held for p in self.planes) and not all(r.done() for r in reqs):
                await asyncio.sleep(0)
            await self.flush()
        reqs = [asyncio.ensure_future(one(*op)) for op in ops]
        for r in await asyncio.gather(*reqs, *(flush_soon() for _ in range(flushes)),
                                      return_exceptions=True):
            if isinstance(r, BaseException):  # (raised once none is in flight)
                raise r

    async def cache_tables(self) -> None:
        """Read a sector of every L2 table's range: the tables are cached, so
        their unallocated clusters are published (ALLOC where C may allocate);
        then wait until the pools are filled, as after a device's start."""
        span = 1 << (self.img.l2_bits + self.img.cbits)
        for off in range(0, self.img.size, span):
            await self.img.read(off, bytearray(SECTOR))
        self.img.service()
        while not all(p.table.pool_level(p.slot) for p in self.planes):
            await asyncio.sleep(0)

    async def flush(self) -> None:
        content, mask = bytes(self.disk.content), self.disk.mask()
        self.rec.flushes_over_c += any(p.held for p in self.planes)
        await self.img.flush()
        self.flushed(content, mask)

    def flushed(self, content: bytes | None = None, mask: bytearray | None = None) -> None:
        """A FLUSH completed that was sent when the disk held ``content``, with
        ``mask`` of the sectors touched since (default: now)."""
        if content is None or mask is None:
            content, mask = bytes(self.disk.content), self.disk.mask()
        self.rec.flushes.append((self.rec.tick(), content))
        self.rec.touched_after.append(mask)


Workload = Callable[[Session, random.Random], Awaitable[None]]


#: clusters per C pool: few, so that the pools are refilled during a workload
POOL_CLUSTERS = 32


def record(path: Path, workload: Workload, seed: int, *, write_through: bool = False,
           queues: int = 0, threads: bool = False) -> Recording:
    """Run ``workload`` on the image at ``path`` and record what reached the
    file; with ``queues`` C stand-ins writing too (``threads``: on threads)."""
    raw = path.with_suffix(".start.raw")
    to_raw(path, raw)
    disk = Disk(raw.read_bytes())
    raw.unlink()

    async def main() -> Recording:
        ring = Ring(256, bind_thread=True)
        try:
            img = Qcow2Image.open(str(path), metadata_write_through=write_through)
            rec = Recording(path.read_bytes())
            img.file.__class__ = recording_file(rec)
            img.pools.cap = POOL_CLUSTERS
            planes = [CStandIn(img, rec, seed * 100 + k, threads=threads) for k in range(queues)]
            s = Session(img, rec, disk, planes)
            try:
                await workload(s, random.Random(seed))
            except OSError as e:
                if not img.corrupt:
                    raise
                rec.refused = str(e)
            finally:
                for p in planes:
                    await p.close()
                await img.close()
            s.flushed()
            rec.c_allocated = sum(p.allocated for p in planes)
            rec.c_grown = planes[0].table.stats()["grown"] if planes else 0  # (one table)
            return rec
        finally:
            ring.close()
    return asyncio.run(main())


# -- crash images -------------------------------------------------------------------------


@dataclass
class Report:
    workload: str
    cut_points: int = 0
    images: int = 0
    leaky: int = 0
    sectors: int = 0  # flushed sectors compared, over all crash images
    corrupt: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.workload}: {self.cut_points} cut points, {self.images} crash images, "
                f"{self.leaky} with leaks, {self.sectors} flushed sectors compared, "
                f"{len(self.corrupt)} bad")


def apply(img: bytearray, ev: WriteEv, sectors: int | None = None) -> None:
    data = ev.data if sectors is None else ev.data[:sectors * SECTOR]
    end = ev.offset + len(data)
    if end > len(img):
        img.extend(bytes(end - len(img)))
    img[ev.offset:end] = data


def crash_images(rec: Recording, seed: int) -> list[tuple[str, bytes, int]]:
    """(name, file bytes, crash clock) for every cut point and variant."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes, int]] = []
    bounds = [SyncEv(0, 0)] + rec.syncs  # "before the first sync" is a cut point too
    for i, sync in enumerate(bounds):
        until = bounds[i + 1].end if i + 1 < len(bounds) else rec.clock + 1
        durable = [w for w in rec.writes if w.complete < sync.begin]
        later = [w for w in rec.writes if w.complete >= sync.begin and w.submit < until]
        base = bytearray(rec.initial)
        for w in durable:
            apply(base, w)
        picks: list[tuple[str, list[WriteEv], WriteEv | None]] = [("none", [], None)]
        if later:
            picks.append(("all", later, None))
            for v in range(VARIANTS):
                chosen = [w for w in later if rng.random() < 0.5]
                torn = rng.choice(later) if v % 2 else None
                picks.append((f"subset{v}" + ("+torn" if torn else ""), chosen, torn))
        for name, chosen, torn in picks:
            img = bytearray(base)
            for w in sorted(chosen + ([torn] if torn else []), key=lambda w: w.submit):
                if w is torn:
                    apply(img, w, rng.randrange(len(w.data) // SECTOR + 1))
                else:
                    apply(img, w)
            out.append((f"cut {i}/{len(bounds) - 1} {name}", bytes(img), until - 1))
    return out


def expected(rec: Recording, crash: int) -> tuple[bytes, bytearray] | None:
    """The disk content of the last flush completed before ``crash``, and the
    mask of sectors touched after it (those may hold either)."""
    done = [k for k, (when, _c) in enumerate(rec.flushes) if when < crash]
    if not done:
        return None
    k = done[-1]
    return rec.flushes[k][1], rec.touched_after[k]


def check_one(tmp: Path, name: str, data: bytes, want: tuple[bytes, bytearray] | None,
              ) -> tuple[str, int, int, str]:
    """(name, qemu-img check exit, flushed sectors compared, problem or "")."""
    path = tmp / f"crash-{threading.get_ident()}.qcow2"
    path.write_bytes(data)
    check = subprocess.run(["qemu-img", "check", str(path)], capture_output=True, text=True)
    if check.returncode not in (0, 3):
        errors = [line for line in check.stderr.splitlines() if line.startswith("ERROR")]
        return name, check.returncode, 0, (f"qemu-img check exit {check.returncode}: "
                                           + " | ".join(errors[:1] + check.stdout.splitlines()[:4]))
    compared = 0
    if want is not None:
        raw = path.with_suffix(".raw")
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(raw)], check=True)
        got = raw.read_bytes()
        content, touched = want
        for s in range(len(touched)):
            if touched[s]:
                continue
            compared += 1
            if got[s * SECTOR:(s + 1) * SECTOR] != content[s * SECTOR:(s + 1) * SECTOR]:
                return name, check.returncode, compared, f"flushed sector {s} reads back wrong"
    return name, check.returncode, compared, ""


def check_recording(rec: Recording, tmp: Path, workload: str, seed: int,
                    stop_at: str | None = None) -> Report:
    """Every crash image checked; with ``stop_at``, only until the first
    problem that says it ("" for any)."""
    rep = Report(workload, cut_points=len(rec.syncs) + 1)
    images = crash_images(rec, seed)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(check_one, tmp, name, data, expected(rec, crash))
                for name, data, crash in images]
        for f in futs:
            name, rc, compared, problem = f.result()
            rep.images += 1
            rep.sectors += compared
            rep.leaky += rc == 3
            if problem:
                rep.corrupt.append(f"{name}: {problem}")
                if stop_at is not None and stop_at in problem:
                    for g in futs:
                        g.cancel()
                    break
    return rep


# -- workloads ----------------------------------------------------------------------------


def spread(rng: random.Random, size: int, slot: int, n: int, kinds: tuple[str, ...] = ("write",),
           ) -> list[tuple[str, int, int]]:
    """``n`` requests in distinct ``slot``-sized slots, unaligned inside them."""
    ops = []
    for s in rng.sample(range(size // slot), n):
        length = rng.randrange(1, slot // SECTOR + 1) * SECTOR
        off = s * slot + rng.randrange(0, (slot - length) // SECTOR + 1) * SECTOR
        ops.append((rng.choice(kinds), off, length))
    return ops


async def allocation(s: Session, rng: random.Random) -> None:
    for round_ in range(8):
        await s.batch(spread(rng, s.img.size, 32 * K, 12), rng)
        await s.batch(spread(rng, s.img.size, 32 * K, 6, ("write", "zero", "zero-unmap")), rng)
        if round_ % 2:
            await s.flush()


async def overwrite(s: Session, rng: random.Random) -> None:
    """Partial overwrites of what lies below (backing file or snapshot): COW."""
    for _round in range(4):
        await s.batch(spread(rng, s.img.size, 64 * K, 10), rng)
        await s.flush()


async def many_clusters(s: Session, rng: random.Random) -> None:
    """2.4 MiB of data in 512 B clusters: the file outgrows the 2 MiB the first
    refcount table covers."""
    slots = rng.sample(range(s.img.size // (4 * K)), 600)
    for r in range(0, len(slots), 100):
        await s.batch([("write", slot * 4 * K, 4 * K) for slot in slots[r:r + 100]], rng)
        if r % 200:
            await s.flush()


async def discard_reuse(s: Session, rng: random.Random) -> None:
    await s.batch([("write", off, 64 * K) for off in range(0, s.img.size // 2, 64 * K)], rng)
    await s.flush()
    for _round in range(3):
        await s.batch(spread(rng, s.img.size // 2, 128 * K, 8, ("discard", "zero-unmap")), rng)
        await s.batch(spread(rng, s.img.size, 64 * K, 8), rng)  # reuses the freed clusters
        await s.flush()


async def write_through(s: Session, rng: random.Random) -> None:
    for _round in range(3):
        await s.batch(spread(rng, s.img.size, 32 * K, 8, ("write", "write", "zero-unmap")), rng)
    await s.flush()
    await s.batch(spread(rng, s.img.size, 32 * K, 8), rng)


async def c_alloc(s: Session, rng: random.Random, *, rounds: int = 6, flushes: int = 0) -> None:
    """Allocation, most first writes served by the C stand-ins: the L2 tables
    exist and are cached first, so their free clusters are ALLOC. With
    ``flushes``, FLUSHes are sent while the writes of every other batch are in
    flight, so that C's records are drained mid-batch. The first write-back
    comes right after the first C allocations."""
    await s.cache_tables()
    for round_ in range(rounds):
        await s.batch(spread(rng, s.img.size, 32 * K, 12), rng, flushes=flushes)
        if not round_:
            await s.flush()
        await s.batch(spread(rng, s.img.size, 32 * K, 6, ("write", "write", "zero", "zero-unmap")),
                      rng)
        if round_ % 2:
            await s.flush()


async def c_cow(s: Session, rng: random.Random, *, rounds: int = 6) -> None:
    """Copy-on-write of a backing file's data, most first writes served by
    the C stand-ins: the overlay's L2 table made (a first write) and a read
    through the chain publish its clusters COW, so a partial first write
    takes a pool cluster and copies the rest of it from the backing file."""
    await s.batch([("write", 0, SECTOR)], rng)
    await s.img.read(64 * K, bytearray(SECTOR))  # (through the backing file)
    await s.cache_tables()
    for round_ in range(rounds):
        await s.batch(spread(rng, s.img.size, 64 * K, 10), rng, flushes=round_ % 2)
        if round_ % 2:
            await s.flush()


def image_alloc(d: Path) -> Path:
    return create(d / "alloc.qcow2", 4 * M, cluster_size=4 * K)


def image_tables(d: Path) -> Path:
    """As ``image_alloc``, with its two L2 tables made (a sector written in each)."""
    path = image_alloc(d)
    qemu_io(path, "write -P 0x11 0 512", f"write -P 0x22 {2 * M} 512")
    return path


def image_backing(d: Path) -> Path:
    base = create(d / "base.qcow2", 4 * M)
    qemu_io(base, f"write -P 0x5a 0 {4 * M}")
    return create(d / "over.qcow2", 4 * M, backing=base)


def image_backing_extl2(d: Path) -> Path:
    """As ``image_backing``, the overlay with subclusters (extended L2)."""
    base = create(d / "base.qcow2", 4 * M)
    qemu_io(base, f"write -P 0x5a 0 {4 * M}")
    return create(d / "over.qcow2", 4 * M, backing=base, extended_l2=True)


def image_snapshot(d: Path) -> Path:
    path = create(d / "snap.qcow2", 4 * M)
    qemu_io(path, f"write -P 0x3c 0 {3 * M}")
    qemu_img("snapshot", "-c", "s1", path)
    # a cluster past the snapshot table: the engine refuses a table whose last
    # entry's padding lies past the end of the file (format.parse_snapshots)
    qemu_io(path, f"write -P 0x3d {3 * M} 512")
    return path


def image_growth(d: Path) -> Path:
    # 512 B clusters, 64-bit refcounts: the first refcount table covers 2 MiB of file
    return create(d / "grow.qcow2", 4 * M, cluster_size=512, refcount_bits=64)


def image_discard(d: Path) -> Path:
    return create(d / "discard.qcow2", 4 * M)


@dataclass(frozen=True)
class Case:
    image: Callable[[Path], Path]
    workload: Workload
    write_through: bool = False
    queues: int = 0  # C stand-ins (data planes allocating in C)
    threads: bool = False  # their C steps on threads
    over_c: bool = False  # FLUSHes are sent over C writes in flight
    grown: bool = False  # C adds subclusters to clusters it copied into before

    def record(self, path: Path, seed: int, *, refusal_ok: bool = False) -> Recording:
        rec = record(path, self.workload, seed, write_through=self.write_through,
                     queues=self.queues, threads=self.threads)
        assert refusal_ok or not rec.refused, rec.refused
        if self.queues:  # (cannot pass with allocation in C off)
            assert rec.c_allocated > 20, f"C allocated only {rec.c_allocated} clusters"
        if self.over_c:
            assert rec.flushes_over_c > 2, f"{rec.flushes_over_c} FLUSHes over C writes"
        if self.grown:
            assert rec.c_grown > 10, f"C added subclusters {rec.c_grown} times"
        return rec


WORKLOADS: dict[str, Case] = {
    "allocation": Case(image_alloc, allocation),
    "cow-backing": Case(image_backing, overwrite),
    "cow-snapshot": Case(image_snapshot, overwrite),
    "refcount-growth": Case(image_growth, many_clusters),
    "discard": Case(image_discard, discard_reuse),
    "write-through": Case(image_alloc, write_through, write_through=True),
    "c-alloc": Case(image_tables, c_alloc, queues=1),
    "c-alloc-2q": Case(image_tables, c_alloc, queues=2),
    "c-alloc-threads": Case(image_tables, c_alloc, queues=2, threads=True),
    "c-alloc-flush-concurrently": Case(image_tables, partial(c_alloc, rounds=4, flushes=1),
                                       queues=2, over_c=True),
    "c-cow-backing": Case(image_backing, c_cow, queues=2),
    "c-cow-subclusters": Case(image_backing_extl2, partial(c_cow, rounds=8), queues=2,
                              grown=True),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_power_cut_at_every_barrier(name: str, tmp_path: Path) -> None:
    case = WORKLOADS[name]
    path = case.image(tmp_path)
    t0 = time.monotonic()
    rec = case.record(path, seed=list(WORKLOADS).index(name) + 1)
    if name == "refcount-growth":
        grown = int.from_bytes(path.read_bytes()[56:60], "big")
        assert grown > 1, "the refcount table did not grow"
    rep = check_recording(rec, tmp_path, name, seed=7)
    c = (f"{rec.c_allocated} clusters allocated in C ({rec.c_grown} more subclusters of "
         f"one), {rec.flushes_over_c} FLUSHes over C writes, " if case.queues else "")
    print(f"\npower cut: {rep.line()}, {len(rec.writes)} writes, {c}"
          f"{time.monotonic() - t0:.1f} s")
    assert rep.cut_points >= 4, f"{name}: only {rep.cut_points} cut points"
    assert rep.sectors, f"{name}: no flushed data was compared"
    assert not rep.corrupt, f"{name}: {len(rep.corrupt)} bad crash images:\n" + \
        "\n".join(rep.corrupt[:10])


# -- the checker catches a broken write-back order ----------------------------------------


def drop_barrier(steps: list[wbplan.Step]) -> list[wbplan.Step]:
    """The sync between refcounts and the L2 tables that use them, removed."""
    return [s for s in steps if not (type(s) is wbplan.Barrier and "L2 entries" in s.why)]


def swap_refblocks_and_l2(steps: list[wbplan.Step]) -> list[wbplan.Step]:
    """The L2 table writes where the refcount blocks were, and the other way round."""
    ref = [s for s in steps if type(s) is wbplan.Write and s.kind == wbplan.REFBLOCK]
    l2 = [s for s in steps if type(s) is wbplan.Write and s.kind == wbplan.L2]
    if not ref or not l2:
        return steps
    out: list[wbplan.Step] = []
    for s in steps:
        if s is ref[0]:
            out += l2
        elif s is l2[0]:
            out += ref
        elif s not in ref and s not in l2:
            out.append(s)
    return out


def plan_mutation(mutate: Callable[[list[wbplan.Step]], list[wbplan.Step]],
                  ) -> Callable[[pytest.MonkeyPatch], None]:
    def install(monkeypatch: pytest.MonkeyPatch) -> None:
        real = wbplan.plan

        def broken(cut: wbplan.Cut, meta: Any, cluster_bits: int) -> list[wbplan.Step]:
            return mutate(real(cut, meta, cluster_bits))
        monkeypatch.setattr(wbplan, "plan", broken)
    return install


def pool_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pools refilled with clusters whose count was undone: C then
    allocates clusters the refcounts call free. Once the engine allocates
    one in Python it finds it free and published and refuses the image
    (``Publisher.claim``): so the pools are big enough for the first
    batch, and no C write falls back to Python before the first FLUSH."""
    monkeypatch.setattr(sys.modules[__name__], "POOL_CLUSTERS", 256)
    monkeypatch.setattr(CStandIn, "outcomes", (1, 0, 0))
    real = Pools._pool_run

    async def uncounted(self: Pools, n: int) -> range:
        run = await real(self, n)
        async with self.refs.lock:
            await self.refs.add_ref_run(run, -1)
        return run
    monkeypatch.setattr(Pools, "_pool_run", uncounted)


def record_before_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CStandIn, "record_before_data", True)


def copies_late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CStandIn, "copies_late", True)


#: name -> (install the mutation, workload, what a bad image must say). Data written
#: after its record also makes images that qemu-img check refuses (their L2 entries
#: point past the end of the file), and which kind comes first depends on the
#: interleaving: the test looks on to the first image that reads back wrong.
MUTATIONS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str, str]] = {
    "drop-barrier": (plan_mutation(drop_barrier), "allocation", ""),
    "swap-refblock-l2": (plan_mutation(swap_refblocks_and_l2), "allocation", ""),
    "pool-uncounted": (pool_uncounted, "c-alloc", ""),
    "record-before-data": (record_before_data, "c-alloc-flush-concurrently", "reads back wrong"),
    "cow-copies-late": (copies_late, "c-cow-backing", "reads back wrong"),
    "subcluster-copies-late": (copies_late, "c-cow-subclusters", "reads back wrong"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_checker_catches_a_mutation(name: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    install, workload, caught_as = MUTATIONS[name]
    install(monkeypatch)
    case = WORKLOADS[workload]
    rec = case.record(case.image(tmp_path), seed=3, refusal_ok=True)
    rep = check_recording(rec, tmp_path, name, seed=7, stop_at=caught_as)
    print(f"\nmutation {name}: {rep.line()}: {rep.corrupt[-1:]}"
          + (f"; then the engine refused: {rec.refused}" if rec.refused else ""))
    assert rep.corrupt, f"{name}: the checker found no bad crash image"
    assert caught_as in rep.corrupt[-1], (
        f"{name}: {len(rep.corrupt)} bad images, none {caught_as!r}: {rep.corrupt[:3]}")


# -- the plan itself, without I/O ---------------------------------------------------------


def test_plan_orders_and_checks_overlaps() -> None:
    cb = 12
    meta = {0: wbplan.HEADER, 1: wbplan.L1, 2: wbplan.REFTABLE, 3: wbplan.REFBLOCK,
            4: wbplan.L2, 9: wbplan.REFTABLE}
    cut = wbplan.Cut(refblocks=[(3 << cb, b"r")], reftable=(9 << cb, b"t"), header=b"h",
                     l2=[(4 << cb, b"l")], l1=[(1 << cb, b"1")])
    kinds = [wbplan.KIND_NAMES[s.kind].split()[0] if isinstance(s, wbplan.Write) else "|"
             for s in wbplan.plan(cut, meta, cb)]
    assert kinds == ["refcount", "|", "refcount", "|", "header", "|", "L2", "|", "L1", "|"]
    assert wbplan.plan(wbplan.Cut(), meta, cb) == [
        wbplan.Barrier("data and refcounts before the L2 entries that use them")]
    with pytest.raises(wbplan.Overlap, match="L2 table write to 0x3000 would overwrite "
                                             "refcount block"):
        wbplan.plan(wbplan.Cut(refblocks=[(3 << cb, b"r")], l2=[(3 << cb, b"l")]), meta, cb)
    with pytest.raises(wbplan.Overlap, match="would overwrite data"):
        wbplan.plan(wbplan.Cut(l2=[(5 << cb, b"l")]), meta, cb)


def test_recording_sees_syncs(tmp_path: Path) -> None:
    """The recording layer is in the path: a flush shows up as barriers."""
    path = image_alloc(tmp_path)

    async def one(s: Session, rng: random.Random) -> None:
        await s.batch([("write", 0, 4 * K)], rng)
        await s.flush()
    rec = record(path, one, seed=1)
    assert len(rec.syncs) >= 2 and len(rec.writes) >= 3, (rec.syncs, len(rec.writes))
    assert os.path.getsize(path) > 0
