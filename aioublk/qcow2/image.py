"""A qcow2 image as an async object: read/write/discard/write_zeroes/flush at
byte offsets, every cluster lookup and refcount update a coroutine, all I/O
through the calling thread's ring.

One loop owns an image. Every request, lookup and metadata change runs on
that loop, so the only interleavings are at awaits. Python runs one thread at
a time anyway, and a queue per thread would buy lock traffic, not speed; the
ublk target therefore serves all of a device's queues from one loop (batch
I/O maps N queues onto one thread; the per-I/O path uses per-I/O daemons).

Concurrency inside the loop:
- a write that changes a cluster's L2 entry (allocation, copy-on-write,
  zeroing, discard) holds that virtual cluster (``_busy``) from reading the
  old entry to setting the new one: no double allocation, no lost update;
- creating or copying an L2 table is guarded per L1 index (``_l2_busy``);
- refcounts change only under ``_alloc_lock``;
- no code keeps a cached table across an await: it looks it up again.

Crash safety (write-back caches with ordering, as QEMU's cache dependencies):
metadata changes stay in memory until a flush or a cache eviction, which
takes a consistent cut of every dirty table and writes it in this order,
with ``fdatasync`` between dependent steps:

    refcount blocks -> refcount table -> header -> L2 tables -> L1 table

A new cluster's data is written before its L2 entry even changes in memory,
so the barrier before the L2 step covers it. A cluster that loses its last
reference is not decremented at once: the free waits until the L2/L1 change
that dropped it is durable and no I/O begun before it is in flight. So a
crash at any moment leaves at most leaked clusters, never an entry pointing
at unwritten or freed space. Data writes go only to clusters outside the
image's metadata (checked as QEMU's overlap checks do); a write that would
land on metadata marks the image corrupt and fails with EIO instead.
"""

from __future__ import annotations

import asyncio
import errno
import os
from array import array
from collections import OrderedDict
from typing import Any, NoReturn

import structlog

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.compress import decompress
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, ZERO, Qcow2Error
from aioublk.qcow2.hostfile import HostFile, RawBacking, aligned
from aioublk.ring import Handler, current_ring
from aioublk.target import Done, rw_handler

log = structlog.get_logger("aioublk.qcow2")

# metadata kinds, strongest first (see _add_meta)
HEADER, L1, REFTABLE, REFBLOCK, SNAPSHOT, L2 = range(6)
KIND_NAMES = {HEADER: "header", L1: "L1 table", REFTABLE: "refcount table",
              REFBLOCK: "refcount block", SNAPSHOT: "snapshot table", L2: "L2 table"}

DEFAULT_CACHE_BYTES = 32 << 20  # L2 cache bound, as QEMU's default maximum
OFFLOAD_BYTES = 64 << 10  # clusters this big are decompressed on a worker thread
MAX_CHAIN = 64
_ZEROS = bytes(1 << 20)

Backing = Any  # Qcow2Image | RawBacking


class L2Table:
    __slots__ = ("offset", "entries", "dirty", "gen")

    def __init__(self, offset: int, entries: array[int], dirty: bool = False) -> None:
        self.offset = offset
        self.entries = entries
        self.dirty = dirty
        self.gen = 0

    def touch(self) -> None:
        self.dirty = True
        self.gen += 1


def _eio(what: str) -> OSError:
    return OSError(errno.EIO, what)


def _nclusters(offset: int, length: int, cs: int) -> int:
    return 0 if length <= 0 else (offset + length - 1) // cs - offset // cs + 1


def _zero_buf(n: int) -> Any:
    """``n`` zero bytes (a slice of a shared buffer when it is long enough)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else aligned(n)


def _fill_zero(view: memoryview) -> None:
    n = len(view)
    pos = 0
    while pos < n:
        k = min(n - pos, len(_ZEROS))
        view[pos:pos + k] = _ZEROS[:k]
        pos += k


class Qcow2Image:
    """An open qcow2 image. ``open`` is synchronous (it reads the header and
    the tables it needs with plain preads); everything after runs on the
    calling loop's ring (``aioublk.ring.current_ring``)."""

    #: every request that changed metadata returns only once the change is in
    #: the image file (see ``_write_through``); an attribute, or ``open``'s keyword
    metadata_write_through = False
    _meta_seq = 0  # metadata changes made in memory (counted, see _changed)
    _meta_written = 0  # ... of which the image file holds the first this many
    _rt_gen = 0  # bumped on each change of the refcount table (or its place)
    _sync_error: OSError | None = None  # the first sync that failed: every later one fails

    @classmethod
    def open(cls, path: str, *, read_only: bool = False, cache_bytes: int | None = None,
             direct: bool = True, metadata_write_through: bool = False,
             _chain: tuple[str, ...] = ()) -> Qcow2Image:
        real = os.path.realpath(path)
        if real in _chain:
            raise Qcow2Error(f"backing chain loops back to {path}")
        if len(_chain) >= MAX_CHAIN:
            raise Qcow2Error(f"backing chain deeper than {MAX_CHAIN} images at {path}")
        f = HostFile(path, read_only=read_only, direct=direct)
        try:
            img = cls(f, read_only, cache_bytes, direct, _chain + (real,))
            img.metadata_write_through = metadata_write_through
            return img
        except Qcow2Error as e:
            f.close()
            msg = str(e) if path in str(e) else f"{path}: {e}"
            # one line whatever the image says (a backing file name may hold a newline)
            raise Qcow2Error("".join(c if c.isprintable() else repr(c)[1:-1]
                                     for c in msg)) from None
        except BaseException:
            f.close()
            raise

    def __init__(self, f: HostFile, read_only: bool, cache_bytes: int | None, direct: bool,
                 chain: tuple[str, ...]) -> None:
        self.file = f
        self.path = f.path
        self.read_only = read_only
        first = f.pread(0, 1 << 21)
        h = self.h = fmt.parse_header(first, f.size)
        self.head = bytearray(first[:512].ljust(512, b"\0"))  # sector 0, updated in place
        self.cluster_size = cs = h.cluster_size
        self.cbits = h.cluster_bits
        self.cmask = cs - 1
        self.l2_bits = h.cluster_bits - 3
        self.l2_mask = (1 << self.l2_bits) - 1
        self.size = h.size
        self.v3 = h.version >= 3
        self.corrupt = False
        if not read_only:
            if h.incompatible & fmt.INCOMPAT_DIRTY:
                raise Qcow2Error(f"{self.path} is marked dirty (lazy refcounts): repair it "
                                 f"with `qemu-img check -r all {self.path}`, or open it "
                                 "read-only")
            if h.incompatible & fmt.INCOMPAT_CORRUPT:
                raise Qcow2Error(f"{self.path} is marked corrupt: repair it with "
                                 f"`qemu-img check -r all {self.path}`, or open it read-only")
        # tables
        self.l1 = fmt.load_table(f.pread(h.l1_table_offset, h.l1_size * 8)) \
            if h.l1_size else array("Q")
        if len(self.l1) != h.l1_size:
            raise Qcow2Error("qcow2 L1 table lies past the end of the file")
        self.l1_dirty: set[int] = set()
        rt_bytes = h.refcount_table_clusters * cs
        rt = f.pread(h.refcount_table_offset, rt_bytes)
        self.reftable = fmt.load_table(rt.ljust(rt_bytes, b"\0"))
        self.reftable_offset = h.refcount_table_offset
        self.reftable_clusters = h.refcount_table_clusters
        self.reftable_dirty = False
        self.reftable_moved = False
        self.refblocks: dict[int, fmt.RefBlock] = {}
        self.rbe = h.refblock_entries
        # every metadata cluster and what it holds: data writes must never touch
        # one, and a table is only ever written where a table of its kind lives
        self.meta: dict[int, int] = {}
        self._add_meta(0, cs, HEADER)
        self._add_meta(h.l1_table_offset, h.l1_size * 8, L1)
        self._add_meta(h.refcount_table_offset, rt_bytes, REFTABLE)
        if len(self.meta) < 1 + _nclusters(h.l1_table_offset, h.l1_size * 8, cs) + \
                h.refcount_table_clusters:
            raise Qcow2Error("qcow2 header, L1 table and refcount table overlap each other")
        for e in self.reftable:
            if e & fmt.REFT_OFFSET_MASK:
                self._add_meta(e & fmt.REFT_OFFSET_MASK, cs, REFBLOCK)
        l2s = [e & OFFSET_MASK for e in self.l1 if e & OFFSET_MASK]
        if h.nb_snapshots:
            raw = f.pread(h.snapshots_offset, 1 << 24)
            snaps, nbytes = fmt.parse_snapshots(raw, h.nb_snapshots)
            self._add_meta(h.snapshots_offset, nbytes, SNAPSHOT)
            for s in snaps:
                if s.l1_size * 8 > fmt.MAX_L1_BYTES or s.l1_table_offset % cs:
                    raise Qcow2Error(f"qcow2 snapshot '{s.name}' has an invalid L1 table")
                self._add_meta(s.l1_table_offset, s.l1_size * 8, SNAPSHOT)
                l2s += [e & OFFSET_MASK for e in
                        fmt.load_table(f.pread(s.l1_table_offset, s.l1_size * 8))
                        if e & OFFSET_MASK]
        for off in l2s:
            self._add_meta(off, cs, L2)
        self.used_end = f.size  # below this the file may hold old bytes
        # L2 cache, sized by how much of the disk it maps
        want = len(self.l1) * cs
        bound = cache_bytes if cache_bytes is not None else min(want, DEFAULT_CACHE_BYTES)
        self.l2_capacity = max(4, bound // cs)
        self.l2cache: OrderedDict[int, L2Table] = OrderedDict()
        self._loading: dict[int, asyncio.Future[L2Table]] = {}
        self._busy: dict[int, asyncio.Future[None]] = {}
        self._l2_busy: dict[int, asyncio.Future[None]] = {}
        self._alloc_lock: asyncio.Lock | None = None
        self._wb_lock: asyncio.Lock | None = None
        self._reserving: set[int] = set()
        self._free_hint = 0
        self._frees: list[tuple[int, int]] = []  # (generation, host cluster)
        self.gen = 0
        self._io: dict[int, int] = {}  # generation -> data I/O in flight
        self._zcache: OrderedDict[int, bytes] = OrderedDict()  # decompressed clusters
        # backing chain
        self.backing: Backing = None
        if h.backing_file:
            self.backing = self._open_backing(h, direct, chain)
        if not read_only and self.v3 and h.autoclear:
            # we keep none of the autoclear extensions up to date (e.g. bitmaps)
            self.head[fmt.OFF_AUTOCLEAR:fmt.OFF_AUTOCLEAR + 8] = bytes(8)
            f.pwrite_sector(bytes(self.head), 0)
            h.autoclear = 0

    def _open_backing(self, h: fmt.Header, direct: bool, chain: tuple[str, ...]) -> Backing:
        name = h.backing_file or ""
        if name.startswith(("json:", "nbd:", "http:", "https:")):
            raise Qcow2Error(f"backing file '{name}' is a protocol, not a file: not supported")
        path = name if os.path.isabs(name) else os.path.join(os.path.dirname(self.path), name)
        if not os.path.exists(path):
            raise Qcow2Error(f"backing file {path} of {self.path} does not exist")
        kind = h.backing_format
        if kind is None:
            with open(path, "rb") as probe:
                kind = "qcow2" if probe.read(4) == fmt.MAGIC else "raw"
        if kind == "qcow2":
            return Qcow2Image.open(path, read_only=True, direct=direct, _chain=chain)
        if kind == "raw":
            return RawBacking(path, direct)
        raise Qcow2Error(f"backing file {path} has format '{kind}': only qcow2 and raw")

    def _add_meta(self, offset: int, length: int, kind: int) -> None:
        """Record metadata clusters; where two kinds claim one cluster the
        stronger (lower) kind wins, so writing the weaker table there is refused."""
        meta = self.meta
        for c in range(offset >> self.cbits, ((offset + length - 1) >> self.cbits) + 1):
            if meta.get(c, 99) > kind:
                meta[c] = kind

    def _meta_write(self, kind: int, offset: int, length: int) -> None:
        """QEMU's overlap check for a metadata write: only onto its own kind."""
        for c in range(offset >> self.cbits, ((offset + length - 1) >> self.cbits) + 1):
            if self.meta.get(c) != kind:
                self._mark_corrupt(f"a {KIND_NAMES[kind]} write to {offset:#x} would "
                                   f"overwrite {KIND_NAMES.get(self.meta.get(c, -1), 'data')}")

    # ------------------------------------------------------------------ locks, I/O
    @property
    def alloc_lock(self) -> asyncio.Lock:
        if self._alloc_lock is None:
            self._alloc_lock = asyncio.Lock()
        return self._alloc_lock

    @property
    def wb_lock(self) -> asyncio.Lock:
        if self._wb_lock is None:
            self._wb_lock = asyncio.Lock()
        return self._wb_lock

    def _io_begin(self) -> int:
        g = self.gen
        self._io[g] = self._io.get(g, 0) + 1
        return g

    def _io_end(self, g: int) -> None:
        n = self._io[g] - 1
        if n:
            self._io[g] = n
        else:
            del self._io[g]

    async def _data_write(self, bufs: list[Any], host: int) -> None:
        g = self._io_begin()
        try:
            await self.file.writev(bufs, host)
        finally:
            self._io_end(g)

    # ------------------------------------------------------------------ L2 cache
    def _lookup(self, vc: int) -> int | None:
        """vcluster's L2 entry if its table is cached (0: no L2 table), None on a miss."""
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        if not off:
            return 0
        t = self.l2cache.get(off)
        if t is None:
            return None
        return t.entries[vc & self.l2_mask]

    async def _entry(self, vc: int) -> int:
        e = self._lookup(vc)
        while e is None:
            await self._load_l2(self.l1[vc >> self.l2_bits] & OFFSET_MASK)
            e = self._lookup(vc)
        return e

    async def _load_l2(self, off: int) -> L2Table:
        t = self.l2cache.get(off)
        if t is not None:
            self.l2cache.move_to_end(off)
            return t
        pending = self._loading.get(off)
        if pending is not None:
            return await asyncio.shield(pending)
        if off & self.cmask or off + self.cluster_size > self.used_end:
            self._mark_corrupt(f"an L1 entry points to {off:#x}, " + (
                "not cluster aligned" if off & self.cmask else "past the end of the file"))
        if self.meta.get(off >> self.cbits) != L2:
            kind = KIND_NAMES.get(self.meta.get(off >> self.cbits, -1), "?")
            self._mark_corrupt(f"an L1 entry points to {off:#x}, which holds the {kind}")
        fut: asyncio.Future[L2Table] = asyncio.get_running_loop().create_future()
        self._loading[off] = fut
        try:
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            await self._make_room()
            t = self.l2cache.get(off)  # created meanwhile (cannot be, but stay exact)
            if t is None:
                t = L2Table(off, fmt.load_table(buf))
                self.l2cache[off] = t
            fut.set_result(t)
            return t
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[off]

    async def _make_room(self) -> None:
        while len(self.l2cache) >= self.l2_capacity:
            for off, t in self.l2cache.items():
                if not t.dirty:
                    del self.l2cache[off]
                    break
            else:
                await self.writeback()

    async def _table_for_update(self, l1i: int) -> L2Table:
        """The L2 table of ``l1i``, owned by the active layer alone (created, or
        copied from a table shared with a snapshot, as needed)."""
        while True:
            l1e = self.l1[l1i]
            off = l1e & OFFSET_MASK
            if off and l1e & COPIED:
                return await self._load_l2(off)
            busy = self._l2_busy.get(l1i)
            if busy is not None:
                await asyncio.shield(busy)
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._l2_busy[l1i] = fut
            try:
                if off:
                    old = await self._load_l2(off)
                    entries = array("Q", old.entries)
                else:
                    entries = array("Q", bytes(self.cluster_size))
                c, _fresh = await self._alloc(1, meta=L2)
                new = L2Table(c << self.cbits, entries, dirty=True)
                await self._make_room()
                self.l2cache[new.offset] = new
                self.l1[l1i] = new.offset | COPIED
                self.l1_dirty.add(l1i)
                self._meta_seq += 1
                if off:
                    self._defer_free(off >> self.cbits)
                return new
            finally:
                del self._l2_busy[l1i]
                fut.set_result(None)

    # ------------------------------------------------------------------ refcounts
    async def _refblock(self, t: int, create: bool) -> fmt.RefBlock | None:
        b = self.refblocks.get(t)
        if b is not None:
            return b
        if t >= len(self.reftable):
            if not create:
                return None
            await self._grow_reftable(t)
            return await self._refblock(t, create)  # growing may have made block t
        off = self.reftable[t] & fmt.REFT_OFFSET_MASK
        if off:
            if off & self.cmask or off + self.cluster_size > self.used_end:
                raise _eio(f"{self.path}: refcount table entry {t} points to {off:#x}, "
                           "which is invalid")
            buf = aligned(self.cluster_size)
            await self.file.read_into(buf, off)
            b = fmt.RefBlock(self.h.refcount_bits, buf)
            self.refblocks[t] = b
            return b
        if not create:
            return None
        # a missing block means every cluster it covers is free: put the block
        # inside its own range so that it describes itself
        base = t * self.rbe
        c = next((c for c in range(base, base + self.rbe)
                  if c not in self._reserving and c not in self.meta), None)
        b = fmt.RefBlock(self.h.refcount_bits, bytes(self.cluster_size))
        self.refblocks[t] = b
        if c is not None:
            b[c - base] = 1
        else:
            c = max(self._end_cluster(), base + self.rbe)
            self._reserving.add(c)
            try:
                await self._add_ref(c, 1)
            finally:
                self._reserving.discard(c)
        self.meta[c] = REFBLOCK
        self.used_end = max(self.used_end, (c + 1) << self.cbits)
        self.reftable[t] = c << self.cbits
        self.reftable_dirty = True
        self._rt_gen += 1
        b.dirty = True
        b.gen += 1
        return b

    def _end_cluster(self) -> int:
        return (self.used_end + self.cmask) >> self.cbits

    async def _add_ref(self, c: int, delta: int) -> int:
        """Change a refcount; returns the new value. A decrement never creates
        refcount structures: a cluster without a refcount is left alone (leaked
        at worst) and reported, as QEMU does."""
        b = await self._refblock(c // self.rbe, create=delta > 0)
        i = c % self.rbe
        if b is None or b[i] + delta < 0:
            log.error("qcow2 refcount underflow: cluster left alone", image=self.path,
                      cluster=c)
            return -1
        v = b[i] + delta
        b[i] = v
        return v

    async def _grow_reftable(self, need: int) -> None:
        """Move the refcount table to a bigger place at the end of the file. The
        header switches to it in write-back; the old one is freed after."""
        cs = self.cluster_size
        per = cs // 8
        start = max(self._end_cluster(), max(self._reserving, default=-1) + 1)
        entries = max(need + 1, len(self.reftable) * 2)
        while True:  # big enough to cover itself and the blocks that count it
            clusters = -(-entries // per)
            needed = (start + clusters + 8) // self.rbe + 1
            if entries >= needed:
                break
            entries = needed
        entries = clusters * per
        old_off, old_clusters = self.reftable_offset, self.reftable_clusters
        grown = array("Q", self.reftable)
        grown.extend(array("Q", bytes(8 * (entries - len(grown)))))
        self.reftable = grown
        run = range(start, start + clusters)
        self._reserving.update(run)
        self.used_end = max(self.used_end, run.stop << self.cbits)
        try:
            for c in run:
                await self._add_ref(c, 1)
        finally:
            self._reserving.difference_update(run)
        for c in run:
            self.meta[c] = REFTABLE
        self.reftable_offset = start << self.cbits
        self.reftable_clusters = clusters
        self.reftable_dirty = True
        self.reftable_moved = True
        self._rt_gen += 1
        for c in range(old_off >> self.cbits, (old_off >> self.cbits) + old_clusters):
            self._defer_free(c)
        log.info("qcow2 refcount table grown", image=self.path, clusters=clusters)

    async def _alloc(self, n: int, meta: int | None = None) -> tuple[int, bool]:
        """``n`` contiguous free host clusters, their refcounts set to 1: the
        first one, and whether they were never written (past the old end of
        the file, so their unwritten parts read as zeros)."""
        rbe = self.rbe
        async with self.alloc_lock:
            start = c = self._free_hint
            hole = -1  # the first free cluster passed over (a run too short for n)
            end_cluster = self._end_cluster()
            while c - start < n:
                if c >= end_cluster:
                    break  # everything past the end is free
                if c in self.meta or c in self._reserving:
                    start = c = c + 1
                    continue
                b = await self._refblock(c // rbe, create=False)
                if b is None or b[c % rbe] == 0:
                    c += 1
                    continue
                if hole < 0 and c > start:
                    hole = start
                c += 1
                if c % rbe:
                    nxt = b.first_free(c % rbe)
                    c = (c // rbe + 1) * rbe if nxt < 0 else (c // rbe) * rbe + nxt
                start = c
            run = range(start, start + n)
            fresh = start << self.cbits >= self.used_end
            # claim the run before counting it: a refcount block or a grown table
            # made on the way must land elsewhere
            self.used_end = max(self.used_end, run.stop << self.cbits)
            self._reserving.update(run)
            try:
                for c in run:
                    await self._add_ref(c, 1)
            finally:
                self._reserving.difference_update(run)
            self._free_hint = run.stop if hole < 0 else hole
            if meta is not None:
                for c in run:
                    self.meta[c] = meta
            return start, fresh

    def _defer_free(self, c: int) -> None:
        self._frees.append((self.gen, c))

    def _release(self, entry: int) -> None:
        """Drop the references an L2 entry held (deferred: see the module
        docstring). An entry pointing nowhere valid is leaked, not freed."""
        if entry & COMPRESSED:
            clusters = fmt.compressed_clusters(entry, self.cbits)
            if clusters.stop << self.cbits <= self.used_end + self.cluster_size:
                for c in clusters:
                    self._defer_free(c)
        elif entry & OFFSET_MASK:
            host = entry & OFFSET_MASK
            if not host & self.cmask and host < self.used_end and host >> self.cbits \
                    not in self.meta:
                self._defer_free(host >> self.cbits)

    # ------------------------------------------------------------------ reads
    def _check_host(self, host: int, vc: int) -> None:
        if host & self.cmask:
            self._mark_corrupt(f"the L2 entry of cluster {vc} is not cluster aligned "
                               f"({host:#x})")
        if host >= self.used_end:
            self._mark_corrupt(f"the L2 entry of cluster {vc} points past the end of the "
                               f"file ({host:#x})")

    async def read(self, offset: int, buf: Any) -> None:
        """Fill ``buf`` with the disk's bytes at ``offset``."""
        view = buf if type(buf) is memoryview and buf.format == "B" else memoryview(buf).cast("B")
        end = offset + len(view)
        if end > self.size:
            raise OSError(errno.EINVAL, f"read past the end of {self.path}")
        # counted as in flight from the lookup on: no cluster it looked up is
        # freed (and reused) before it is done
        g = self._io_begin()
        try:
            host = self._mapped(offset, len(view), False)  # the common case
            if host >= 0:
                await self.file.read_into(view, host)
                return
            await self._read(view, offset, end)
        finally:
            self._io_end(g)

    def _mapped(self, offset: int, n: int, write: bool) -> int:
        """The host offset of [offset, offset+n) when it lies in one cached,
        allocated cluster (written in place, for a write), else -1."""
        vc = offset >> self.cbits
        if (offset + n - 1) >> self.cbits != vc or offset + n > self.size:
            return -1
        e = self._lookup(vc)
        if not e or e & (COMPRESSED | ZERO) or not e & OFFSET_MASK:
            return -1
        host = e & OFFSET_MASK
        if host & self.cmask or host >= self.used_end:
            return -1  # the coroutine path reports it
        if write and (not e & COPIED or self.read_only or self.corrupt or vc in self._busy
                      or host >> self.cbits in self.meta or self._meta_written < self._meta_seq
                      and self.metadata_write_through):
            return -1
        return host + (offset & self.cmask)

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        """The task-free read (see ``Target.start_read``): one mapped cluster."""
        host = self._mapped(offset, len(buf), False)
        if host < 0:
            return False
        current_ring().start_read(self.file.fd, buf, host, self._tracked(
            rw_handler(len(buf), done, lambda: self.read(offset, buf))))
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        """The task-free write: in place, into one cluster the image owns alone."""
        host = self._mapped(offset, len(buf), True)
        if host < 0:
            return False
        current_ring().start_write(self.file.fd, buf, host, self._tracked(
            rw_handler(len(buf), done, lambda: self.write(offset, buf))))
        return True

    def _tracked(self, handler: Handler) -> Handler:
        """Count the I/O in flight until its CQE (frees wait for it)."""
        g = self._io_begin()

        def on_cqe(res: int, flags: int) -> None:
            self._io_end(g)
            handler(res, flags)
        return on_cqe

    async def _read(self, view: memoryview, offset: int, end: int) -> None:
        cbits, cmask, cs = self.cbits, self.cmask, self.cluster_size
        pending = []
        pos = offset
        while pos < end:
            vc = pos >> cbits
            e = self._lookup(vc)
            if e is None:
                e = await self._entry(vc)
            stop = min(end, (vc + 1) << cbits)
            sub = view[pos - offset:stop - offset]
            if e & COMPRESSED:
                pending.append(self._read_compressed(e, pos & cmask, sub))
            elif e & ZERO:
                _fill_zero(sub)
            elif e & OFFSET_MASK:
                host = e & OFFSET_MASK
                self._check_host(host, vc)
                # extend over clusters that follow on disk too
                nxt = host + cs
                while stop < end:
                    e2 = self._lookup(stop >> cbits)
                    if e2 is None or e2 & (COMPRESSED | ZERO) or (e2 & OFFSET_MASK) != nxt:
                        break
                    stop = min(end, stop + cs)
                    nxt += cs
                sub = view[pos - offset:stop - offset]
                pending.append(self.file.read_into(sub, host + (pos & cmask)))
            elif self.backing is not None:
                while stop < end and self._lookup(stop >> cbits) == 0:
                    stop = min(end, stop + cs)
                sub = view[pos - offset:stop - offset]
                pending.append(self._read_backing(pos, sub))
            else:
                _fill_zero(sub)
            pos = stop
        if len(pending) == 1:
            await pending[0]
        elif pending:
            await asyncio.gather(*pending)

    async def _read_backing(self, pos: int, view: memoryview) -> None:
        b = self.backing
        have = max(0, min(len(view), b.size - pos))
        if have:
            await b.read(pos, view[:have] if have < len(view) else view)
        if have < len(view):
            _fill_zero(view[have:])

    async def _cluster_bytes(self, e: int) -> bytes:
        """A compressed cluster, decompressed (a few are cached for sequential reads)."""
        got = self._zcache.get(e)
        if got is not None:
            return got
        span = fmt.compressed_span(e, self.cbits)
        if span.offset + span.length > max(self.used_end, self.file.size) + 512:
            raise _eio(f"{self.path}: compressed cluster at {span.offset:#x} lies past the "
                       "end of the file")
        raw = aligned(span.length)
        await self.file.read_into(raw, span.offset)
        try:
            if self.cluster_size >= OFFLOAD_BYTES:  # inflating takes long: off the loop
                data = await asyncio.get_running_loop().run_in_executor(
                    None, decompress, self.h.compression_type, raw, self.cluster_size)
            else:
                data = decompress(self.h.compression_type, raw, self.cluster_size)
        except ValueError as err:
            raise _eio(f"{self.path}: compressed cluster at {span.offset:#x}: {err}") from None
        self._zcache[e] = data
        if len(self._zcache) > 8:
            self._zcache.popitem(last=False)
        return data

    async def _read_compressed(self, e: int, at: int, view: memoryview) -> None:
        data = await self._cluster_bytes(e)
        view[:] = data[at:at + len(view)]

    # ------------------------------------------------------------------ writes
    def _writable(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"{self.path} is open read-only")
        if self.corrupt:
            raise _eio(f"{self.path} was marked corrupt: repair it with "
                       f"`qemu-img check -r all {self.path}`")

    def _overlap(self, host: int, length: int) -> None:
        first = host >> self.cbits
        last = (host + length - 1) >> self.cbits
        for c in range(first, last + 1):
            if c in self.meta:
                self._mark_corrupt(f"a data write to {host:#x} would overwrite metadata")

    def _mark_corrupt(self, why: str) -> NoReturn:
        self.corrupt = True
        log.error("qcow2 image marked corrupt", image=self.path, reason=why)
        if self.v3 and not self.read_only:
            inc = int.from_bytes(self.head[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8], "big")
            self.head[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8] = fmt.pack_u64(
                inc | fmt.INCOMPAT_CORRUPT)
            try:
                self.file.pwrite_sector(bytes(self.head), 0)
            except OSError:
                pass
        raise _eio(f"{self.path}: {why}; image marked corrupt, run "
                   f"`qemu-img check -r all {self.path}`")

    async def write(self, offset: int, data: Any) -> None:
        """Store ``data`` at ``offset``."""
        if self.read_only or self.corrupt:
            self._writable()
        view = data if type(data) is memoryview and data.format == "B" else \
            memoryview(data).cast("B")
        end = offset + len(view)
        if end > self.size:
            raise OSError(errno.EINVAL, f"write past the end of {self.path}")
        host = self._mapped(offset, len(view), True)  # in place: the common case
        if host >= 0:
            g = self._io_begin()
            try:
                await self.file.write(view, host)
            finally:
                self._io_end(g)
            return
        await self._per_table(offset, end, lambda s, e: self._write_chunk(s, e, offset, view))
        await self._write_through()

    async def _per_table(self, start: int, end: int, fn: Any) -> None:
        """Run ``fn(s, e)`` for each piece of [start, end) that one L2 table maps."""
        span = 1 << (self.cbits + self.l2_bits)
        pos = start
        while pos < end:
            stop = min(end, (pos // span + 1) * span)
            await fn(pos, stop)
            pos = stop

    async def _lock(self, vcs: range) -> None:
        loop = asyncio.get_running_loop()
        for vc in vcs:
            while (f := self._busy.get(vc)) is not None:
                await asyncio.shield(f)
            self._busy[vc] = loop.create_future()

    def _unlock(self, vcs: range) -> None:
        for vc in vcs:
            f = self._busy.pop(vc, None)
            if f is not None:
                f.set_result(None)

    async def _write_chunk(self, s: int, e: int, base: int, view: memoryview) -> None:
        cbits, cs = self.cbits, self.cluster_size
        vcs = range(s >> cbits, ((e - 1) >> cbits) + 1)
        await self._lock(vcs)
        try:
            olds = [await self._entry(vc) for vc in vcs]
            i = 0
            while i < len(vcs):
                e0 = olds[i]
                j = i + 1
                if e0 & (COPIED | COMPRESSED | ZERO) == COPIED and e0 & OFFSET_MASK:
                    host = e0 & OFFSET_MASK
                    self._check_host(host, vcs[i])
                    while j < len(vcs) and olds[j] & (COPIED | COMPRESSED | ZERO) == COPIED \
                            and olds[j] & OFFSET_MASK == host + (j - i) * cs:
                        j += 1
                    ws = max(s, vcs[i] << cbits)
                    we = min(e, vcs[j - 1] + 1 << cbits)
                    h0 = host + (ws - (vcs[i] << cbits))
                    self._overlap(h0, we - ws)
                    await self._data_write([view[ws - base:we - base]], h0)
                else:
                    while j < len(vcs) and not (olds[j] & (COPIED | COMPRESSED | ZERO) == COPIED
                                                and olds[j] & OFFSET_MASK):
                        j += 1
                    await self._alloc_write(vcs[i:j], olds[i:j], s, e, base, view)
                i = j
        finally:
            self._unlock(vcs)

    async def _alloc_write(self, vcs: range, olds: list[int], s: int, e: int, base: int,
                           view: memoryview) -> None:
        """Write into fresh clusters (filling what the request leaves out from the
        old contents), then point the L2 entries at them."""
        cbits, cs = self.cbits, self.cluster_size
        l1i = vcs[0] >> self.l2_bits
        await self._table_for_update(l1i)
        c0, fresh = await self._alloc(len(vcs))
        host0 = c0 << cbits
        run_s, run_e = vcs[0] << cbits, (vcs[-1] + 1) << cbits
        ws, we = max(s, run_s), min(e, run_e)
        bufs: list[Any] = []
        at = host0
        try:
            if ws > run_s:
                head = await self._cow(vcs[0], olds[0], 0, ws - run_s)
                if head is None and fresh:
                    at = host0 + (ws - run_s)
                else:
                    bufs.append(head if head is not None else _zero_buf(ws - run_s))
            bufs.append(view[ws - base:we - base])
            if we < run_e:
                tail = await self._cow(vcs[-1], olds[-1], we - (vcs[-1] << cbits), run_e - we)
                if tail is not None or not fresh:
                    bufs.append(tail if tail is not None else _zero_buf(run_e - we))
            await self._data_write(bufs, at)
        except BaseException:
            for c in range(c0, c0 + len(vcs)):
                self._defer_free(c)  # leaked otherwise; nothing points at them
            raise
        t = await self._table_for_update(l1i)
        for k, vc in enumerate(vcs):
            t.entries[vc & self.l2_mask] = (host0 + k * cs) | COPIED
            self._release(olds[k])
        self._changed(t)

    async def _cow(self, vc: int, old: int, at: int, length: int) -> Any:
        """The old contents of ``length`` bytes at ``at`` in cluster ``vc``, or
        None when they are zeros."""
        if old & COMPRESSED:
            data = await self._cluster_bytes(old)
            return memoryview(data)[at:at + length]
        if old & ZERO:
            return None
        if old & OFFSET_MASK:
            self._check_host(old & OFFSET_MASK, vc)
            buf = aligned(length)
            await self.file.read_into(buf, (old & OFFSET_MASK) + at)  # under the cluster lock
            return buf
        if self.backing is None or (vc << self.cbits) + at >= self.backing.size:
            return None
        buf = aligned(length)
        await self._read_backing((vc << self.cbits) + at, buf)
        return buf

    async def write_zeroes(self, offset: int, length: int, unmap: bool = False) -> None:
        """Zeros at [offset, offset+length): whole clusters by their L2 entries,
        the rest by writing zeros."""
        self._writable()
        await self._zero_or_discard(offset, length, unmap=unmap, discard=False)
        await self._write_through()

    async def discard(self, offset: int, length: int) -> None:
        """Unmap whole clusters (they read as zeros, or as the backing file's
        bytes on a v2 image, where there is no zero flag). The parts of
        clusters at either end are zeroed rather than left with old data
        (QEMU leaves them): a discarded range never reads back stale bytes."""
        self._writable()
        await self._zero_or_discard(offset, length, unmap=True, discard=True)
        await self._write_through()

    async def _zero_or_discard(self, offset: int, length: int, *, unmap: bool,
                               discard: bool) -> None:
        end = offset + length
        if end > self.size:
            raise OSError(errno.EINVAL, f"range past the end of {self.path}")
        cs = self.cluster_size
        first = (offset + cs - 1) & ~self.cmask
        last = end & ~self.cmask if end != self.size else -(-end // cs) * cs
        if first >= last:  # no whole cluster, but maybe the end of one and the start of the next
            cut = offset < first < end
            await self._zero_part(offset, first if cut else end)
            if cut:
                await self._zero_part(first, end)
            return
        if offset < first:
            await self._zero_part(offset, first)
        if last < end:
            await self._zero_part(last, end)
        zero_flag = self.v3 and (self.backing is not None or not discard)
        if not self.v3 and self.backing is not None and not discard:
            await self._write_zero_bytes(first, min(last, end))  # v2 cannot hide the backing
            return
        await self._per_table(first, min(last, self.size),
                              lambda s, e: self._zero_chunk(s, e, unmap, zero_flag))

    async def _zero_part(self, s: int, e: int) -> None:
        """Zeros inside one cluster: nothing to do if it reads as zeros already."""
        vc = s >> self.cbits
        old = await self._entry(vc)
        if old & COMPRESSED == 0 and (old & ZERO or not old & OFFSET_MASK and (
                self.backing is None or vc << self.cbits >= self.backing.size)):
            return
        await self._write_zero_bytes(s, e)

    async def _write_zero_bytes(self, s: int, e: int) -> None:
        pos = s
        while pos < e:
            n = min(e - pos, len(_ZEROS))
            await self.write(pos, _ZEROS[:n])
            pos += n

    async def _zero_chunk(self, s: int, e: int, unmap: bool, zero_flag: bool) -> None:
        vcs = range(s >> self.cbits, ((e - 1) >> self.cbits) + 1)
        await self._lock(vcs)
        try:
            l1i = vcs[0] >> self.l2_bits
            olds = [await self._entry(vc) for vc in vcs]
            want = ZERO if zero_flag else 0
            if all(self._same_zero(o, want) for o in olds):
                return
            t = await self._table_for_update(l1i)
            for vc, old in zip(vcs, olds, strict=True):
                if self._same_zero(old, want):
                    continue
                keep = not unmap and zero_flag and old & (COPIED | COMPRESSED) == COPIED \
                    and old & OFFSET_MASK
                if keep:
                    t.entries[vc & self.l2_mask] = (old & OFFSET_MASK) | COPIED | ZERO
                else:
                    t.entries[vc & self.l2_mask] = want
                    self._release(old)
            self._changed(t)
        finally:
            self._unlock(vcs)

    def _changed(self, t: L2Table) -> None:
        """An L2 table changed (the refcounts it needs were changed before)."""
        t.touch()
        self._meta_seq += 1

    async def _write_through(self) -> None:
        """With ``metadata_write_through``: return once every metadata change
        made so far (this request's, and any other's it may depend on: a
        write in place into a cluster whose allocation is still in memory)
        is in the image file. Requests waiting together share one write-back:
        whoever gets the lock first writes a cut that holds all their changes."""
        if not self.metadata_write_through:
            return
        want = self._meta_seq
        while self._meta_written < want:
            async with self.wb_lock:
                if self._meta_written < want:
                    await self._writeback_locked()

    @staticmethod
    def _same_zero(old: int, want: int) -> bool:
        return old == want or (want == ZERO and old & (ZERO | COMPRESSED) == ZERO)

    # ------------------------------------------------------------------ write-back
    async def flush(self) -> None:
        """Everything written so far, data and metadata, durable."""
        if self.read_only:
            return
        await self.writeback()

    def _dirty(self) -> bool:
        return bool(self.l1_dirty or self.reftable_dirty or any(
            b.dirty for b in self.refblocks.values()) or any(
            t.dirty for t in self.l2cache.values()))

    async def writeback(self) -> None:
        """Write every dirty table in dependency order (see the module
        docstring), then apply frees whose dropping is durable."""
        async with self.wb_lock:
            await self._writeback_locked()

    async def _sync(self) -> None:
        """fdatasync the image file. Linux reports a lost page-cache write-back
        once, to one fsync: after that, later syncs succeed although the data
        is gone. So the first failure sticks (as QEMU's file-posix does): every
        later sync of this image fails, and dirty state is only ever cleared
        after a sync that succeeded."""
        if self._sync_error is not None:
            raise _eio(f"{self.path}: an earlier sync of the image failed "
                       f"({self._sync_error.strerror}): writes may be lost, check the image")
        try:
            await self.file.sync()
        except OSError as e:
            self._sync_error = e
            log.error("qcow2 image sync failed: every later flush fails", image=self.path,
                      error=str(e))
            raise _eio(f"{self.path}: sync failed ({e.strerror}): writes may be lost, "
                       "check the image") from None

    async def _writeback_locked(self) -> None:
        f = self.file
        seq = self._meta_seq
        if not self._dirty() and not self._frees:
            await self._sync()
            self._meta_written = max(self._meta_written, seq)
            return
        if self._sync_error is not None:
            await self._sync()  # fails: nothing written after a lost write-back
        # the cut: a consistent picture of every dirty table, taken without
        # awaiting; nothing is marked clean before the sync after its write
        cut = self.gen
        self.gen += 1
        l2s = [(t, t.gen, fmt.dump_table(t.entries)) for t in self.l2cache.values()
               if t.dirty]
        l1 = {i: self.l1[i] for i in sorted(self.l1_dirty)}
        l1_bytes = fmt.dump_table(self.l1) if l1 else b""
        refs = self._refblock_cut()
        rt_gen = self._rt_gen
        rt = fmt.dump_table(self.reftable) if self.reftable_dirty else None
        rt_off = self.reftable_offset
        moved = (self.reftable_offset, self.reftable_clusters) if self.reftable_moved else None
        for t, _g, _raw in l2s:  # refuse before writing anything
            self._meta_write(L2, t.offset, self.cluster_size)
        for ti, _b, _g, _raw in refs:
            self._meta_write(REFBLOCK, self.reftable[ti] & fmt.REFT_OFFSET_MASK,
                             self.cluster_size)
        if rt is not None:
            self._meta_write(REFTABLE, rt_off, len(rt))
        if l1:
            self._meta_write(L1, self.h.l1_table_offset, len(self.l1) * 8)
        await self._write_refblocks(refs)
        if rt is not None:
            await self._sync()
            await f.write(rt, rt_off)
        if moved is not None:
            await self._sync()
            self.head[fmt.OFF_REFTABLE:fmt.OFF_REFTABLE + 12] = \
                fmt.pack_reftable_fields(*moved)
            await f.write(bytes(self.head), 0)
        await self._sync()  # data and refcounts before the L2 entries that use them
        self._refblocks_clean(refs)
        if rt_gen == self._rt_gen:
            self.reftable_dirty = self.reftable_moved = False
        if l2s:
            for t, _g, raw in l2s:
                await f.write(raw, t.offset)
            await self._sync()
            for t, g, _raw in l2s:
                if t.gen == g:
                    t.dirty = False
        if l1:
            await self._write_l1(list(l1), l1_bytes)
            await self._sync()
            for i, v in l1.items():
                if self.l1[i] == v:  # not changed since the cut
                    self.l1_dirty.discard(i)
        self._meta_written = max(self._meta_written, seq)
        await self._apply_frees(cut)

    def _refblock_cut(self) -> list[tuple[int, fmt.RefBlock, int, bytes]]:
        return [(t, b, b.gen, b.dump()) for t, b in self.refblocks.items() if b.dirty]

    async def _write_refblocks(self, refs: list[tuple[int, fmt.RefBlock, int, bytes]]) -> None:
        for t, _b, _g, raw in refs:
            await self.file.write(raw, self.reftable[t] & fmt.REFT_OFFSET_MASK)

    @staticmethod
    def _refblocks_clean(refs: list[tuple[int, fmt.RefBlock, int, bytes]]) -> None:
        """After the sync that made them durable: clean unless changed since."""
        for _t, b, g, _raw in refs:
            if b.gen == g:
                b.dirty = False

    async def _write_l1(self, idx: list[int], raw: bytes) -> None:
        """Write the 512-byte sectors of the L1 table that changed."""
        base = self.h.l1_table_offset
        sectors = sorted({i // 64 for i in idx})
        for s in sectors:
            await self.file.write(raw[s * 512:(s + 1) * 512].ljust(512, b"\0"), base + s * 512)

    async def _apply_frees(self, cut: int) -> None:
        oldest_io = min(self._io) if self._io else self.gen
        ready = [c for g, c in self._frees if g <= cut and g < oldest_io]
        if not ready:
            return
        self._frees = [(g, c) for g, c in self._frees if not (g <= cut and g < oldest_io)]
        async with self.alloc_lock:
            for c in ready:
                if await self._add_ref(c, -1) == 0:
                    self.meta.pop(c, None)
                    self._free_hint = min(self._free_hint, c)
                    self.l2cache.pop(c << self.cbits, None)
        refs = self._refblock_cut()
        await self._write_refblocks(refs)
        await self._sync()
        self._refblocks_clean(refs)

    async def close(self) -> None:
        """Flush (if writable) and close the image and its backing chain."""
        try:
            if not self.read_only and self.file.fd >= 0 and not self.corrupt:
                await self.writeback()
                if self._frees:
                    await self.writeback()
        finally:
            self.release()

    def release(self) -> None:
        """Close the files of the image and its backing chain, without writing."""
        self.file.close()
        if self.backing is not None:
            self.backing.release()
