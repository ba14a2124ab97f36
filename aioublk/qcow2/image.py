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
metadata changes stay in memory until a flush, a cache eviction or (with
``metadata_write_through``, for ublk user recovery) the end of the request
that made them. A write-back takes a consistent cut of every dirty table;
``aioublk.qcow2.writeback`` turns it into a plan (writes and ``fdatasync``
barriers, overlap-checked, no I/O) in this order:

    refcount blocks -> refcount table -> header -> L2 tables -> L1 table

A new cluster's data is written before its L2 entry even changes in memory,
so the barrier before the L2 step covers it. A table is marked clean only
after the sync that made it durable; the first failed sync sticks (every
later flush fails: Linux reports a lost write-back once). A cluster that
loses its last reference is not decremented at once: the free waits until
the L2/L1 change that dropped it is durable and no I/O begun before it is
in flight. So a crash, or a power cut, at any moment leaves at most leaked
clusters, never an entry pointing at unwritten or freed space
(tests/test_qcow2_powercut.py cuts recorded write-backs at every barrier).
Data writes go only to clusters outside the image's metadata (checked as
QEMU's overlap checks do); a write that would land on metadata marks the
image corrupt and fails with EIO instead.

Where the code lives (each layer calls only those before it):
``base`` (state, locks, guards) -> ``refcounts`` -> ``flush`` (runs the
write-back plan) -> ``l2cache`` -> ``reads`` -> ``writes`` -> this module
(``open`` and the parsing of the image's tables).
"""

from __future__ import annotations

import asyncio
import os
from array import array
from collections import OrderedDict

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import DEFAULT_CACHE_BYTES, MAX_CHAIN, Backing, L2Table, _nclusters
from aioublk.qcow2.format import OFFSET_MASK, Qcow2Error
from aioublk.qcow2.hostfile import HostFile, RawBacking
from aioublk.qcow2.writeback import HEADER, L1, L2, REFBLOCK, REFTABLE, SNAPSHOT
from aioublk.qcow2.writes import Writes

__all__ = ["Qcow2Image"]


class Qcow2Image(Writes):
    """An open qcow2 image. ``open`` is synchronous (it reads the header and
    the tables it needs with plain preads); everything after runs on the
    calling loop's ring (``aioublk.ring.current_ring``)."""

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
