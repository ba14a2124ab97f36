"""A qcow2 image as an async object: read/write/discard/write_zeroes/flush at
byte offsets, every cluster lookup and refcount update a coroutine, all I/O
through the calling thread's ring.

One loop owns an image. Every request, lookup and metadata change runs on
that loop, so the only interleavings are at awaits. What crosses threads is
the extent table (C, one mutex): the ublk target's queues each run on their
own thread, their data planes serve published clusters from the table in
parallel, and a request none of them can serve is handed to the owner's
loop whole (``aioublk.targets.qcow2``). Who guards what:
- the engine's state (L1, L2 cache, refcounts, the locks below, the
  write-back): the owner loop alone;
- a mapping C started on stays valid until that request completes: the
  extent table's per-entry in-flight counts, which ``unmap`` waits out on
  every queue before the engine changes the cluster.

Concurrency inside the loop:
- a write that changes a cluster's L2 entry (allocation, copy-on-write,
  zeroing, discard) holds that virtual cluster (``_busy``) from reading the
  old entry to setting the new one: no double allocation, no lost update;
- creating or copying an L2 table is guarded per L1 index (``L2Cache.for_update``);
- refcounts change only under ``refs.lock``;
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
(tests/qcow2/test_qcow2_powercut.py cuts recorded write-backs at every barrier).
Data writes go only to clusters outside the image's metadata (checked as
QEMU's overlap checks do); a write that would land on metadata marks the
image corrupt and fails with EIO instead.

The data plane (``extent_table``; ``aioublk.dataplane.plane``, ``aioublk.dataplane.extents``):
the image owns an extent table, one granule per cluster, from which C serves
reads and in-place writes without entering Python, and reads of zeros
without any I/O.

- What is published, and when: an L2 table is published whole as it enters
  the cache (loaded, created, or copied from a table a snapshot shares),
  in one C call (``Publisher.run``, ``ExtentTable.publish_l2``); an entry
  changed later is published again after the change (``_write_chunk``,
  ``_zero_chunk``), and the lookups of ``_mapped`` and the read path publish
  what a full table left out. One function applies the rules, to a table or
  to one entry. As data (MAP), a normal cluster: allocated, not compressed,
  not ZERO, cluster aligned, inside the file, not a metadata cluster. It is
  writable where a write may go in place: COPIED set, the image writable,
  and under ``metadata_write_through`` only if the table holds C's writes
  (``hold_c_writes``: a write must wait for the metadata that made its
  cluster, so its answer waits for ``settle_writes``; else the data plane
  gets reads only). As
  ZERO (reads as zeros, a write misses and comes here to allocate): the
  ZERO flag, with a host cluster or not, or an unallocated cluster with no
  backing file or wholly past the backing file's end. As ALLOC instead of
  ZERO, where a queue's data plane may allocate (no host cluster kept for
  it, the table COPIED, the image writable, no metadata write-through
  unless C's writes are held, a pool attached): a write takes a counted
  cluster from the plane's pool and C records it; the rules and the drain
  points are ``aioublk.qcow2.pools``'.
  An unallocated cluster over backing data is published read-only where the
  backing chain holds it, at any depth (``Qcow2Image.place``: a raw file at
  the same offset, a qcow2 image where its cached L2 entry points), or as
  ZERO where the chain reads as zeros, once a read went through the chain
  (``Publisher.through``: the clusters read, and the first time the rest of
  their L2 span); the backing files are read-only, so those places never
  change while the overlay is served, and a write to such a cluster is a
  miss, a copy-on-write here. A compressed cluster of a backing image is
  published as ZIP (its compressed bytes' place; C reads and inflates the
  part a request asks for) where the queues' copy mode gives C a buffer,
  and as data in the backing image's cache of clusters it inflated
  (``aioublk.qcow2.zcache``) elsewhere. Never this image's own compressed
  cluster, one whose bytes lie in more than one place, one past the disk's end, or one being changed
  (``_busy``); nothing when the image is corrupt, or when its L1 table names
  one L2 table twice. ``pub`` of a cached table says what each entry is
  published as, and ``Publisher.pub_host`` which host cluster a MAP entry
  serves.
- The invariant: before Python changes where a cluster's data lives, or
  gives a ZERO or ALLOC cluster data, it takes the cluster's extent back
  and waits until no request the data plane started on it is in flight
  (``ExtentTable.unmap``, which treats every kind alike), then applies
  what C allocated meanwhile (``Pools.settle``). A request C
  started therefore sees a mapping that stays valid until it completes.
  Every L2 entry changes in one place, ``_remap``, called with the clusters
  held in ``_busy`` (so nobody publishes them again meanwhile) and followed
  by the change without an await: allocation and copy-on-write
  (``_alloc_write``), discard and write_zeroes (``_zero_chunk``). The
  cluster an entry dropped is freed only after that, so a freed cluster is
  never in flight in C either (the ``Frees.io`` count covers only Python's own
  I/O); an allocation that finds a free cluster still published as data
  (``Publisher.claim``: refcounts too low) marks the image corrupt.
- Changes that keep the mapping, and what they do: copying an L2 table a
  snapshot shares (same entries: the old table's extents are taken back
  without waiting and the copy published whole); evicting a table from the
  cache (its extents are invalidated, without waiting: the data plane holds
  only what the cache holds, and a later change still waits in ``_remap``
  for anything in flight, removed or not; the extent table holds as many
  clusters as the cache, so a table entering it finds room); a change of
  what may be writable (``republish``: everything taken back and the cached
  tables published again); marking the image corrupt and closing it (every
  extent invalidated, nothing published after). The engine never creates,
  applies or deletes snapshots, and no refcount change makes a cluster
  shared (refcounts rise only on allocation of free clusters).

Where the code lives: the image (this module: ``open``, reading the
header and tables, the wiring; ``metamap`` maps the metadata clusters as
it opens) holds one object per structure, each given
only the tables it works on and hooks for what it must ask of the others:
``refs`` (``refcounts``: refcount blocks and table, allocation), ``pools``
(``pools``: allocation in C), ``frees`` and ``wb`` (``flush``: deferred
frees, the write-back running ``writeback``'s plan), ``l2`` (``l2cache``:
the L2 cache and L1's dirty entries) and ``plane`` (``publish``: the
extent table). The request paths are the image's own: ``reads`` and
``writes``, on ``core`` (the state they share and the guards).
"""

from __future__ import annotations

import asyncio
import errno
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from aioublk.dataplane.extents import ZERO_FD, ExtentTable
from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import check, metamap
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.backing_policy import BackingPolicy, Checked
from aioublk.qcow2.base import DEFAULT_CACHE_BYTES, MAX_CHAIN, Backing, L2Table, log
from aioublk.qcow2.flush import Frees, WriteBack
from aioublk.qcow2.format import OFFSET_MASK, Qcow2Error
from aioublk.qcow2.l2cache import L2Cache
from aioublk.qcow2.pools import Pools
from aioublk.qcow2.publish import Publisher
from aioublk.qcow2.refcounts import Refcounts, counted_end
from aioublk.qcow2.writes import Writes
from aioublk.qcow2.zcache import ZCache
from aioublk.ring import Ring, bound_ring, queue_ring_flags

__all__ = ["Qcow2Image"]


class RawBacking:
    """A raw backing file: its bytes, zeros past its end."""

    def __init__(self, path: str, direct: bool, checked: Checked | None = None) -> None:
        self.file = HostFile(path, read_only=True, direct=direct, checked=checked,
                             error=Qcow2Error)
        self.size = self.file.size

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.file.read_into(buf, offset)

    def place(self, pos: int, n: int) -> tuple[int, int, int] | None:
        """Where bytes [pos, pos + n) are (``aioublk.qcow2.publish.Place``):
        here, or zeros past the end; None for a run that crosses the end."""
        if pos >= self.size:
            return ZERO_FD, 0, n
        have = min(n, self.size - pos)
        return (self.file.fd, pos, have) if have >= 512 else None

    def release(self) -> None:
        self.file.close()


class Qcow2Image(Writes):
    """An open qcow2 image. ``open`` is synchronous (it reads the header and
    the tables it needs with plain preads); everything after runs on the
    calling loop's ring (``aioublk.ring.current_ring``).

    ``async with Qcow2Image.open(path) as img:`` closes the image on exit
    (its final write-back; a failure there is raised). A thread with no
    ring bound (a program outside a ublk queue) gets one made for the
    block and closed after the image; a bound ring (a queue's) is used and
    left open."""

    #: the ring ``__aenter__`` made, closed with the image
    _own_ring: Ring | None = None
    #: how many bytes of decompressed clusters a qcow2 backing image keeps
    #: for the data plane (``aioublk.qcow2.zcache``)
    ZCACHE_BYTES = 64 << 20

    # Sized as a queue ring at the default depth, 128 (aioublk.queue.worker): room
    # for a write-back's table writes beside the caller's requests.
    _OWN_RING_ENTRIES = 256
    _OWN_RING_CQ_ENTRIES = 1024

    @classmethod
    def open(cls, path: str, *, read_only: bool = False, cache_bytes: int | None = None,
             direct: bool = True, metadata_write_through: bool = False,
             allow_backing: Iterable[str] = (), backing_format: str | None = None,
             compress: bool = False) -> Qcow2Image:
        """Open the image at ``path`` and its backing chain. Backing files are
        used only where the user allows (``backing_policy``): in the image's
        own directory, or under a path of ``allow_backing`` (a directory, or
        a file such as a block device); ``backing_format`` ("qcow2" or "raw")
        is the format of backing files whose image records none.
        ``metadata_write_through``: see the module docstring. ``compress``:
        whole, aligned clusters are written compressed with the image's
        compression type (as QEMU's compress filter and ``qemu-img convert
        -c`` write them); a cluster that does not shrink is written as it is."""
        try:
            policy = BackingPolicy.for_image(path, allow_backing, backing_format)
        except Qcow2Error as e:
            raise Qcow2Error(cls._one_line(f"{path}: {e}")) from None
        img = cls._open(path, path, read_only, cache_bytes, direct, policy, ())
        img.metadata_write_through = metadata_write_through
        img.compress = compress and not read_only
        return img

    async def __aenter__(self) -> Qcow2Image:
        if bound_ring() is None:
            try:
                self._own_ring = Ring(self._OWN_RING_ENTRIES,
                                      cq_entries=self._OWN_RING_CQ_ENTRIES,
                                      flags=queue_ring_flags(), bind_thread=True)
            except BaseException:
                self.release()  # no __aexit__ will run
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ data plane
    @property
    def extents(self) -> ExtentTable | None:
        """The data plane's map of this image (``extent_table``); None until
        asked for."""
        return self.plane.extents

    def extent_table(self) -> ExtentTable | None:
        """The extent table the data plane serves this image from (made on the
        first call; publishing starts then), or None where the engine cannot
        keep the table's promise: a corrupt image, or one whose L1 table names
        an L2 table twice (a change through one name would leave the other's
        extents stale). It holds as many clusters as the L2 cache does, so a
        table entering the cache always finds room for its clusters."""
        if self.corrupt or self._aliased or self.file.fd < 0:
            return None
        return self.plane.start(min((1 << 32) - 2,
                                    max(1 << 20, self.l2.capacity << self.l2_bits)))

    def republish(self) -> None:
        """Take every extent back and publish the cached tables again: after a
        change of what may be writable (``metadata_write_through`` set before
        the first request). No mapping changes, so nothing waits."""
        self.plane.republish()

    def hold_c_writes(self) -> None:
        """Under ``metadata_write_through`` let the data plane write in place
        and allocate too, its extent table holding each write's answer until
        ``settle_writes`` (``ExtentTable.set_hold_writes``): the answer then
        waits for the write-back that makes the write's metadata durable, as
        the engine's own writes do. Before the first request."""
        table = self.extent_table()
        if table is None:
            return
        table.set_hold_writes(True)
        self.republish()

    async def settle_writes(self) -> None:
        """With ``metadata_write_through``: return once every metadata change
        so far, what C recorded included, is in the image file; the callers
        waiting meanwhile share one write-back."""
        if self.metadata_write_through and not self.read_only:
            self.pools.drain()
            await self.wb.write_through()

    def _c_writes_wait(self) -> bool:
        """Whether metadata write-through keeps C from writing: its writes'
        answers would not wait for their metadata (``hold_c_writes``)."""
        return self.metadata_write_through and not (
            self.plane.extents is not None and self.plane.extents.holds_writes)

    @property
    def c_allocating(self) -> bool:
        """Whether C may allocate now: what publishing ALLOC asks first."""
        return bool(self.pools.slots) and not self.read_only and not self.corrupt \
            and not self._c_writes_wait() and not self.compress and not self.file.is_block

    def attach_pool(self) -> int:
        """A pool for one more data plane (``Pools.attach``), or -1 where C may
        not allocate in this image."""
        if self.plane.extents is None or not self.pools.c_alloc or self.read_only \
                or self.file.is_block or self._c_writes_wait() or self.compress:
            return -1
        return self.pools.attach(self.file.fd)

    def service(self) -> None:
        """C asked for the engine (``Pools.service``)."""
        self.pools.service()

    # ----------------------------------------------------------------- flush
    async def flush(self) -> None:
        """Everything written so far, data and metadata, durable."""
        if self.read_only:
            return
        await self.wb.run()

    async def writeback(self) -> None:
        """Write every dirty table in dependency order (``WriteBack.run``),
        then apply frees whose dropping is durable."""
        await self.wb.run()


    def release(self) -> None:
        """Close the files of the image and its backing chain, without writing."""
        self.plane.drop()
        self.file.close()
        if self.zc is not None:
            self.zc.close()
            self.zc = None
        if self.backing is not None:
            self.backing.release()

    async def close(self) -> None:
        """Flush (if writable) and close the image and its backing chain; then
        the ring ``async with`` made for it, if it made one."""
        try:
            try:
                if not self.read_only and self.file.fd >= 0 and not self.corrupt:
                    await self.pools.take_back()
                    await self.writeback()
                    if self.frees.pending:
                        await self.writeback()
                    if self.lazy:  # every refcount is on disk: clean again
                        self._set_dirty(False)
            finally:
                self.release()
        finally:
            ring, self._own_ring = self._own_ring, None
            if ring is not None:
                ring.close()

    @staticmethod
    def _one_line(msg: str) -> str:
        """A message in one line whatever the image says (a backing file name
        may hold a newline or terminal escapes)."""
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)

    @classmethod
    def _open(cls, path: str, real: str, read_only: bool, cache_bytes: int | None,
              direct: bool, policy: BackingPolicy, chain: tuple[tuple[int, int], ...],
              checked: Checked | None = None) -> Qcow2Image:
        """Open ``path`` by ``real``: the same for the image the user named; for
        a backing file (``chain`` not empty) the real path its policy
        ``checked``, only if it is still the file checked. ``chain`` holds the
        (st_dev, st_ino) of the images above: a loop is the same inode
        whatever its names (symlinks, hard links, other spellings)."""
        try:
            if len(chain) >= MAX_CHAIN:
                raise Qcow2Error(f"backing chain deeper than {MAX_CHAIN} images at {path}")
            f = HostFile(real, read_only=read_only, direct=direct, checked=checked,
                         error=Qcow2Error)
            try:
                st = os.fstat(f.fd)
                if chain:
                    policy.check_kind(path, real, st.st_mode)
                cls._check_loop(path, st, chain)
                return cls(f, path, read_only, cache_bytes, direct, policy,
                           chain + ((st.st_dev, st.st_ino),))
            except BaseException:
                f.close()
                raise
        except Qcow2Error as e:
            raise Qcow2Error(cls._one_line(str(e) if path in str(e) else f"{path}: {e}")) from None

    @staticmethod
    def _check_loop(path: str, st: os.stat_result, chain: tuple[tuple[int, int], ...]) -> None:
        if (st.st_dev, st.st_ino) in chain:
            raise Qcow2Error(f"backing chain loops back to {path}")

    def __init__(self, f: HostFile, path: str, read_only: bool, cache_bytes: int | None,
                 direct: bool, policy: BackingPolicy, chain: tuple[tuple[int, int], ...],
                 ) -> None:
        self.file = f
        self.path = path
        self.read_only = read_only
        first = f.pread(0, 1 << 21)
        h = fmt.parse_header(first, f.size)
        if not read_only and h.incompatible & fmt.INCOMPAT_DIRTY and \
                not h.incompatible & fmt.INCOMPAT_CORRUPT:
            self._repair_dirty(f, path, h)  # as QEMU does on opening one
            first = f.pread(0, 1 << 21)
            h = fmt.parse_header(first, f.size)
        self.h = h
        self.head = bytearray(first[:512].ljust(512, b"\0"))  # sector 0, updated in place
        self.cluster_size = cs = h.cluster_size
        self.cbits = h.cluster_bits
        self.cmask = cs - 1
        self.l2_bits = h.cluster_bits - (4 if h.extended_l2 else 3)
        self.l2_mask = (1 << self.l2_bits) - 1
        self.size = h.size
        self.v3 = h.version >= 3
        self.corrupt = False
        if not read_only and h.incompatible & fmt.INCOMPAT_CORRUPT:
            raise Qcow2Error(f"{self.path} is marked corrupt: repair it with "
                             f"`aioublk img check -r all {self.path}`, or open it read-only")
        # tables
        self.l1 = fmt.load_table(f.pread(h.l1_table_offset, h.l1_size * 8)) \
            if h.l1_size else array("Q")
        if len(self.l1) != h.l1_size:
            raise Qcow2Error("qcow2 L1 table lies past the end of the file")
        named = [e & OFFSET_MASK for e in self.l1 if e & OFFSET_MASK]
        self._aliased = len(set(named)) != len(named)  # no data plane (extent_table)
        rt_bytes = h.refcount_table_clusters * cs
        rt = f.pread(h.refcount_table_offset, rt_bytes)
        reftable = fmt.load_table(rt.ljust(rt_bytes, b"\0"))
        # every metadata cluster and what it holds: data writes must never touch
        # one, and a table is only ever written where a table of its kind lives
        self.meta = metamap.scan(f, path, h, self.l1, reftable, read_only)
        # the backing chain (before the collaborators: the data plane's rules
        # need to know how much of the disk it holds)
        self.backing: Backing = None
        if h.backing_file:
            self.backing = self._open_backing(h, direct, policy, chain)
        self._compose(h, reftable, cache_bytes)
        if not read_only and self.v3 and h.autoclear:
            # persistent bitmaps are kept, marked in use: they miss our writes,
            # and QEMU then calls them inconsistent (as after its own crash)
            # rather than dropping them with their clusters leaked
            keep = h.autoclear & fmt.AUTOCLEAR_BITMAPS if fmt.EXT_BITMAPS in h.extensions \
                else 0
            if keep:
                self._bitmaps_in_use(f, h)
            if h.autoclear & ~keep:  # the others we do not keep up to date
                self.head[fmt.OFF_AUTOCLEAR:fmt.OFF_AUTOCLEAR + 8] = fmt.pack_u64(keep)
                f.pwrite_sector(bytes(self.head), 0)
                h.autoclear = keep
        #: lazy refcounts: dirty while open, as QEMU marks it, so that whoever
        #: opens it after a crash rebuilds its refcounts (leaks included)
        self.lazy = not read_only and self.v3 and \
            bool(h.compatible & fmt.COMPAT_LAZY_REFCOUNTS)
        if self.lazy:
            self._set_dirty(True)

    def _compose(self, h: fmt.Header, reftable: array[int], cache_bytes: int | None) -> None:
        """The collaborators: each given the shared tables it works on (the L1
        table, the L2 cache's dict, the metadata map) and hooks for what it
        must ask of the others. A hook that names another collaborator looks
        it up when called (all exist by then)."""
        f, path, cs = self.file, self.path, self.cluster_size
        pub_host: dict[int, int] = {}  # (the data plane's MAP clusters: the plane's, shared)
        tables: OrderedDict[int, L2Table] = OrderedDict()
        l1_dirty: set[int] = set()
        self._busy: dict[int, asyncio.Future[None]] = {}
        self._zcache: OrderedDict[int, bytes] = OrderedDict()  # decompressed clusters
        self.frees = Frees()
        self._io_begin, self._io_end = self.frees.io_begin, self.frees.io_end
        # below this the file may hold old bytes; past it, allocation takes
        # clusters as free without looking at their refcounts. A crash may
        # leave clusters counted past the end of the file (a data plane's pool,
        # never written): the end is where the last counted cluster ends
        used_end = max(f.size, counted_end(f, h, reftable))
        self.refs = Refcounts(f, path, h, reftable, self.meta, used_end, self.frees.defer,
                              pub_host, lambda run: self.plane.claim(run))
        self.pools = Pools(path, self.cbits, self.l2_bits, self.refs, self.l1, tables, pub_host,
                           lambda n: self.wb.changed(n), lambda: self.c_allocating)
        self._drain_c = self.pools.drain
        self.wb = WriteBack(f, path, h, self.head, self.l1, l1_dirty, tables, self.meta,
                            self.refs, self.pools, self.frees, self._corrupt_bit,
                            self._mark_corrupt)
        self.plane = Publisher(
            f.fd, path, self.cbits, self.l2_bits, self.size,
            self.backing.size if self.backing is not None else 0, self.l1, tables,
            self._busy, self.meta, self.refs, self.pools, pub_host,
            lambda: not (self.read_only or self._c_writes_wait() or self.compress),
            lambda: self.c_allocating, self._mark_corrupt,
            self.backing.place if self.backing is not None else None)
        below = self.backing
        while below is not None:  # (the chain's caches of decompressed clusters)
            if getattr(below, "zc", None) is not None:
                self.plane.hold(below.zc)
            below = getattr(below, "backing", None)
        # the L2 cache, sized by how much of the disk it maps
        want = len(self.l1) * cs
        bound = cache_bytes if cache_bytes is not None else min(want, DEFAULT_CACHE_BYTES)
        self.l2 = L2Cache(f, path, h, self.l1, l1_dirty, tables, max(4, bound // cs),
                          self.meta, self.refs, self.plane, self.frees.defer,
                          self.wb.changed, self.wb.run, self._mark_corrupt)

    @staticmethod
    def _bitmaps_in_use(f: HostFile, h: fmt.Header) -> None:
        for b in fmt.parse_bitmaps(h.extensions[fmt.EXT_BITMAPS], f.pread):
            if not b.flags & fmt.BITMAP_IN_USE:
                f.patch(b.at + 12, (b.flags | fmt.BITMAP_IN_USE).to_bytes(4, "big"))
        f.datasync()

    @staticmethod
    def _repair_dirty(f: HostFile, path: str, h: fmt.Header) -> None:
        """A dirty image (lazy refcounts, left open by a crash): its refcounts
        rebuilt from its tables, as ``img check -r all`` does, before use."""
        try:
            _h, res = check.scan(f.pread, f.size, fix_errors=True)
            repair = check.plan_repair(f.pread, f.size, h, res, "all") \
                if res.leaks or res.corruptions or res.zeroed else None
        except Qcow2Error as e:
            raise Qcow2Error(f"{path} is marked dirty and cannot be repaired here ({e}): "
                             f"try `qemu-img check -r all {path}`") from None
        if repair is not None:
            check.apply(repair, f.patch, f.datasync)
            f.size = os.lseek(f.fd, 0, os.SEEK_END)
            _h, res = check.scan(f.pread, f.size)
            if res.corruptions or res.check_errors:
                raise Qcow2Error(f"{path} is marked dirty and its repair left "
                                 f"{res.corruptions} errors: try `qemu-img check -r all "
                                 f"{path}`")
        f.patch(fmt.OFF_INCOMPAT, fmt.pack_u64(check.clean_bits(h)))
        f.datasync()
        log.info("qcow2 image was dirty: refcounts repaired", image=path,
                 leaks_fixed=repair.leaks_fixed if repair else 0,
                 corruptions_fixed=repair.corruptions_fixed if repair else 0)

    def _open_backing(self, h: fmt.Header, direct: bool, policy: BackingPolicy,
                      chain: tuple[tuple[int, int], ...]) -> Backing:
        """The backing file, where and in the format the policy allows."""
        name = h.backing_file or ""
        real = policy.resolve(self.path, name)
        try:
            st = os.lstat(real)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise Qcow2Error(f"backing file {name} of {self.path} does not exist") from None
            raise Qcow2Error(f"cannot open backing file {name}: {e.strerror}") from None
        policy.check_kind(name, real, st.st_mode)
        policy.check_owner(name, real, st.st_uid, image_uid=os.fstat(self.file.fd).st_uid)
        # before opening it: the open takes the image lock, which we hold ourselves
        self._check_loop(name, st, chain)
        fmt = policy.format(self.path, name, h.backing_format)
        checked = policy.open_dir(name, real, st)
        try:
            if fmt == "qcow2":
                img = Qcow2Image._open(policy.candidate(self.path, name), real, True, None,
                                       direct, policy, chain, checked)
                try:
                    img.zc = ZCache(img.cluster_size, self.ZCACHE_BYTES)
                except BaseException:
                    img.release()
                    raise
                return img
            raw = RawBacking(real, direct, checked)
        finally:
            checked.close()
        try:
            policy.check_kind(name, real, os.fstat(raw.file.fd).st_mode)
        except Qcow2Error:
            raw.release()
            raise
        return raw
