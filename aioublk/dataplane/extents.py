"""The extent table: device range -> (fd, host offset) or zeros, for the C data plane.

A target that knows where some of its data lives publishes it here, granule
by granule (a qcow2 cluster, say), and the data plane serves requests whose
every granule is mapped without entering Python. Everything else (a granule
not mapped, a write to a read-only one) goes to the target's coroutines.

A granule is one of these kinds: MAP, its data at (fd, host offset), ZERO,
known to read as zeros (a qcow2 cluster that is unallocated, or has its
zero flag), ALLOC, zeros that a write may allocate, COW, data read-only
at (fd, host offset) that a write may allocate and copy, or ZIP, a
compressed cluster whose bytes the reader inflates (read only). A read of ZERO or
ALLOC granules needs no backend I/O at all: C fills the buffer. A write to
ZERO is a miss, because where its data goes is the target's decision; the
target unmaps it first like any other granule.

A write to ALLOC is where the target delegated that decision: it counted
host clusters ahead of need and put them in a pool (:meth:`ExtentTable.pool_add`),
one per data plane (:meth:`ExtentTable.attach`), and C gives the granule the
next one. Clusters added must be zero, because a write to part of a granule
leaves the rest of its cluster as it was: that is the target's promise. The
target learns where the data went from the records C keeps
(:meth:`ExtentTable.drain`): each allocated cluster ends up written (a
:class:`Record` with ``ok``, the granule now MAP there), failed (not ``ok``:
the cluster may hold part of a write, free it), or back in its pool. An
empty pool or a full log makes such a write a miss, never a wait.

A write to COW is the same allocation, for a granule whose data lives
elsewhere (a qcow2 overlay's cluster still in its backing file): the writer
first copies what its write does not cover of the granule from there into
the new cluster (the acquisition's ``copies``), and releases it as DONE only
once the copies and the write are all in.

The invariant a target relies on: before it changes where a granule's data
lives (COW, discard, a freed or shared cluster, an evicted L2 table) it calls
:meth:`ExtentTable.unmap`, which removes the mapping and returns once no
request that resolved it is still in flight. A request the data plane started
therefore sees a mapping that stays valid until it completes.

The table itself is C (``aioublk/dataplane/csrc/extents.c``, thread-safe, memory bounded by
``max_entries``); this class is its owner and a thin typed face.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

from aioublk._uring import ffi, lib
from aioublk.errors import Error

__all__ = ["ALLOC", "ALLOCATING", "COW", "COW_SUB", "DONE", "FAILED", "MAP", "SUB", "UNUSED",
           "ZERO",
           "ZERO_FD", "ZIP", "ZIP_COW", "ZLIB", "ZSTD", "Copy", "ExtentConflict", "ExtentTable",
           "Handle", "Piece", "Record", "ZipCopy", "Zipped"]

#: (fd, host offset, length) of one run of a request's data; a run of zeros
#: is (ZERO_FD, 0, length)
Piece = tuple[int, int, int]

#: (source fd, source offset, destination fd, destination offset, length):
#: bytes of a COW granule a write leaves for its new cluster, copied first
Copy = tuple[int, int, int, int, int]

#: the kinds of granule (0: not in the table), as ``publish_l2`` reports them,
#: and COW: data read-only at (fd, host offset) whose first write allocates
#: from the writer's pool and copies what it does not cover
MAP, ZERO, ALLOC, COW = lib.AUR_EXT_MAP, lib.AUR_EXT_ZERO, lib.AUR_EXT_ALLOC, lib.AUR_EXT_COW
#: COW in 32 subclusters: a write copies only the rest of the subclusters it
#: touches, its record says which (``Record.subs``), and the granule is SUB
COW_SUB = lib.AUR_EXT_COW_SUB
#: a cluster of the allocation file part of whose subclusters are data there,
#: the others still elsewhere (``insert_sub``): a write to the others copies
#: the rest of them into the cluster and records them (``Record.grown``)
SUB = lib.AUR_EXT_SUB
#: a compressed cluster: its compressed bytes at (fd, offset), inflated by
#: the reader (ZLIB: raw deflate, ZSTD: one frame), read only; ZIP_COW: and a
#: write allocates and copies the rest of it, inflated, as for COW
ZIP, ZIP_COW = lib.AUR_EXT_ZIP, lib.AUR_EXT_ZIP_COW
ZLIB, ZSTD = lib.AUR_EXT_ZLIB, lib.AUR_EXT_ZSTD
#: the kinds whose write C records (allocating from the writer's pool, or
#: more subclusters of a SUB's cluster)
ALLOCATING = (ALLOC, COW, COW_SUB, ZIP_COW, SUB)
#: what became of an acquisition's writes (:meth:`ExtentTable.release`)
DONE, FAILED, UNUSED = lib.AUR_EXT_DONE, lib.AUR_EXT_FAILED, lib.AUR_EXT_UNUSED
#: the fd of a piece of zeros
ZERO_FD = -1



class Zipped(NamedTuple):
    """A request's run in a ZIP granule: bytes [skip, skip + length) of what
    the ``zlen`` compressed bytes at (``fd``, ``zoff``) inflate to (``alg``)."""

    fd: int
    zoff: int
    length: int
    zlen: int
    skip: int
    alg: int


class ZipCopy(NamedTuple):
    """What a write to a ZIP_COW granule leaves to copy: ``src.length``
    bytes of the inflated granule from ``src.skip`` on, to (``dst_fd``,
    ``dst_off``)."""

    src: Zipped
    dst_fd: int
    dst_off: int


_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
#: struct aur_ext_rec as bytes: gran, host_off, flags, slot, subs
_REC = struct.Struct("=QQIII4x")
assert _REC.size == ffi.sizeof("struct aur_ext_rec")
_REC_OK, _REC_GROWN = lib.AUR_EXT_REC_OK, lib.AUR_EXT_REC_GROWN
_new = tuple.__new__


class Record(NamedTuple):
    """An allocation C settled: granule ``gran`` (its device offset divided by
    the granule) was given host offset ``host_off`` from pool ``slot``. ``ok``:
    its write completed and the granule's data is there now (the granule is
    MAP, writable); not ``ok``: the write failed, the granule is ALLOC again
    and the cluster, which may hold part of the write, is the target's to free.

    A record stands even when the granule was invalidated meanwhile: the guest
    may have seen that write complete, so the target applies an ``ok`` record
    (points the granule at ``host_off``) before the change it invalidated
    for; which is why it drains after every unmap."""

    gran: int
    host_off: int
    ok: bool
    slot: int
    #: for a COW_SUB granule, the subclusters the write made data (bit i: the
    #: i-th 32nd of the granule); 0: the whole granule
    subs: int = 0
    #: a SUB granule's write: ``host_off`` was its cluster already, and
    #: ``subs`` are every subcluster of it that is data now
    grown: bool = False


class ExtentConflict(Error, ValueError):
    """An insert met a granule already mapped elsewhere; nothing was changed."""


class Handle:
    """Entries a request holds (from :meth:`ExtentTable.acquire`) until released."""

    __slots__ = ("_ids", "_n", "copies")

    def __init__(self, ids: Any, n: int, copies: list[Copy | ZipCopy] | None = None) -> None:
        self._ids = ids
        self._n = n
        #: what a write to COW granules must copy into their new clusters
        #: before it is released as DONE
        self.copies: list[Copy | ZipCopy] = copies or []

    @property
    def allocates(self) -> bool:
        """Whether a granule it holds was allocated for it (a write's pieces
        include clusters from the writer's pool): what release's outcome is for."""
        return any(i & lib.AUR_EXT_ID_ALLOC for i in self._ids[0:max(self._n, 0)])


def _check(name: str, value: int, limit: int = _U64) -> None:
    if not 0 <= value <= limit:
        raise ValueError(f"{name} {value} out of range")


def _inserted(ret: int, dev_off: int, length: int, what: str, granule: int) -> bool:
    """An insert's result: True, False when the table has no room, or raised."""
    if ret == 0:
        return True
    if ret == -errno.ENOSPC:
        return False
    if ret == -errno.EEXIST:
        raise ExtentConflict(f"[{dev_off}, +{length}) is mapped elsewhere")
    if ret == -errno.EINVAL:
        raise ValueError(f"[{dev_off}, +{length}) -> {what}: not aligned to {granule}, out of "
                         "range or no such kind")
    raise OSError(-ret, f"extent insert: {errno.errorcode.get(-ret, ret)}")


class ExtentTable:
    """device range -> (fd, host offset) or zeros for the C data plane.

    Mappings are per *granule* (a power of two >= 512 bytes): inserted over
    granule-aligned ranges, removed by any range (every granule it touches),
    and looked up for any byte range. A granule is writable or read-only: a
    read-only one serves reads only, which is how a shared qcow2 cluster stays
    out of the data plane's writes.

    At most ``max_entries`` granules are held at once, counting removed ones
    that requests still hold; an insert past that returns False (the table is
    a cache: the caller serves the request itself).
    """

    def __init__(self, granule: int, max_entries: int = 1 << 20) -> None:
        if granule < 512 or granule & (granule - 1):
            raise ValueError(f"granule {granule} is not a power of two >= 512")
        _check("max_entries", max_entries, _U32 - 1)
        t = lib.aur_ext_new(granule.bit_length() - 1, max_entries)
        if t == ffi.NULL:
            raise MemoryError("extent table")
        self._t: Any = ffi.gc(t, lib.aur_ext_free)
        self.granule = granule
        self.max_entries = max_entries
        self._recs = ffi.new("struct aur_ext_rec[]", 256)  # (drain's, reused)
        self._recs_raw = memoryview(ffi.buffer(self._recs))
        self._notified = False  # a notify fd is set: unmap waits for notified()
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def cdata(self) -> Any:
        """The ``struct aur_ext *`` the data plane reads: valid until close(), and
        only while this object lives (its collection frees the table)."""
        if self._t is None:
            raise RuntimeError("extent table is closed")
        return self._t

    def insert(self, dev_off: int, length: int, fd: int, host_off: int, *,
               writable: bool) -> bool:
        """Map the granules of [dev_off, dev_off + length) to fd at host_off.

        All three must be multiples of the granule. Granules already mapped
        the same way are fine. Returns False, and maps nothing, when the table
        has no room; raises :class:`ExtentConflict`, and maps nothing, when a
        granule is mapped differently (unmap it first).
        """
        return self.insert_kind(MAP, dev_off, length, fd, host_off, writable=writable)

    def insert_zero(self, dev_off: int, length: int) -> bool:
        """Publish the granules of [dev_off, dev_off + length) as zeros: the
        data plane serves their reads by filling the buffer, with no backend
        I/O, and leaves their writes to the target (a write is where the
        target decides where the data goes). Otherwise as :meth:`insert`; a
        granule already mapped to data conflicts."""
        return self.insert_kind(ZERO, dev_off, length)

    def insert_alloc(self, dev_off: int, length: int) -> bool:
        """Publish the granules of [dev_off, dev_off + length) as zeros that the
        data plane may allocate: reads as :meth:`insert_zero`, and a write with
        a slot takes a cluster from that slot's pool (see :meth:`set_alloc`)
        instead of being a miss. Otherwise as :meth:`insert`."""
        return self.insert_kind(ALLOC, dev_off, length)

    def insert_kind(self, kind: int, dev_off: int, length: int, fd: int = -1,
                    host_off: int = 0, *, writable: bool = False) -> bool:
        """:meth:`insert` (``MAP``), :meth:`insert_zero` (``ZERO``),
        :meth:`insert_alloc` (``ALLOC``; neither of the last two takes an fd, a
        host offset or writability) or ``COW`` (data read-only at ``fd``,
        ``host_off``) by kind: the one entry point each new kind of granule
        joins."""
        _check("dev_off", dev_off)
        _check("length", length)
        _check("host_off", host_off)
        ret = lib.aur_ext_insert_kind(self.cdata, dev_off, length, kind, fd, host_off, writable)
        return _inserted(ret, dev_off, length, f"kind {kind}, fd {fd} at {host_off}",
                         self.granule)

    def insert_zip(self, dev_off: int, fd: int, zoff: int, zlen: int, alg: int, *,
                   kind: int = ZIP) -> bool:
        """Publish granule ``dev_off`` as ZIP: it reads as the granule the
        ``zlen`` bytes at (``fd``, ``zoff``) inflate to (``alg``: ZLIB or
        ZSTD); a write to it is a miss (``kind`` ZIP_COW: a write with a slot
        allocates, as for COW). Otherwise as :meth:`insert`."""
        _check("dev_off", dev_off)
        _check("zoff", zoff)
        _check("zlen", zlen, _U32)
        ret = lib.aur_ext_insert_zip(self.cdata, dev_off, kind, fd, zoff, zlen, alg)
        return _inserted(ret, dev_off, self.granule,
                         f"kind {kind}, fd {fd} at {zoff}, {zlen} bytes, type {alg}", self.granule)

    def insert_sub(self, dev_off: int, fd: int, host_off: int, subs: int, src_fd: int,
                   src_off: int) -> bool:
        """Publish granule ``dev_off`` as SUB: its cluster at (``fd``,
        ``host_off``), written in place where ``subs`` (bit i: the i-th 32nd
        of the granule, some but not all) says it is data, the others read
        at (``src_fd``, ``src_off``) (``ZERO_FD``: zeros) until a write
        copies the rest of them in. Otherwise as :meth:`insert`."""
        _check("dev_off", dev_off)
        _check("host_off", host_off)
        _check("src_off", src_off)
        _check("subs", subs, _U32)
        ret = lib.aur_ext_insert_sub(self.cdata, dev_off, fd, host_off, subs, src_fd, src_off)
        return _inserted(ret, dev_off, self.granule,
                         f"SUB {subs:#x}, fd {fd} at {host_off}, the rest fd {src_fd} at "
                         f"{src_off}", self.granule)

    def publish_l2(self, fd: int, dev_base: int, entries: Any, pub: Any, *, used_end: int,
                   size: int, writable_ok: bool, alloc_ok: bool = False, backing_end: int = 0,
                   meta: Iterable[int] = (), skip: Iterable[int] = ()) -> list[tuple[int, int]]:
        """Publish qcow2 L2 entries (host byte order, a buffer of uint64) of the
        granules from ``dev_base`` on, by the rules in C (``aur_ext_publish_l2``)
        and in one call: a whole table costs one lock and no Python per entry.

        An entry whose ``pub`` byte (a writable buffer, one per entry) is set
        already, or whose granule is in ``skip``, is left alone; the others get
        the kind they were published as (0: none, ``MAP``, ``ZERO``). MAP is an
        allocated, uncompressed, aligned cluster below ``used_end`` and not in
        ``meta`` (host clusters), writable if COPIED and ``writable_ok``; ZERO
        is the zero flag, or an unallocated cluster at or past ``backing_end``
        (0: no backing file); with ``alloc_ok`` such zeros without a host
        cluster are ``ALLOC`` instead, where a write allocates from the
        writer's pool. Nothing at or past ``size``. Returns the
        (host cluster, granule) pairs of the MAP ones. A full table publishes
        what it can; a granule mapped otherwise raises :class:`ExtentConflict`
        (what came before it stays published).
        """
        n = len(pub)
        if len(entries) != n:
            raise ValueError(f"{len(entries)} entries, {n} pub bytes")
        _check("dev_base", dev_base)
        keep = [ffi.new("uint64_t[]", sorted(meta)), ffi.new("uint64_t[]", sorted(skip))]
        rules = ffi.new("struct aur_pub_rules *", {
            "used_end": used_end, "size": size, "backing_end": backing_end,
            "meta": keep[0], "nmeta": len(keep[0]), "skip": keep[1], "nskip": len(keep[1]),
            "writable_ok": writable_ok, "alloc_ok": alloc_ok})
        hosts, grans = ffi.new("uint64_t[]", n), ffi.new("uint64_t[]", n)
        ret = lib.aur_ext_publish_l2(self.cdata, fd, dev_base,
                                     ffi.from_buffer("uint64_t[]", entries), n, rules,
                                     ffi.from_buffer("uint8_t[]", pub, require_writable=True),
                                     hosts, grans)
        if ret == -errno.EEXIST:
            raise ExtentConflict(f"a granule of [{dev_base}, +{n} granules) is mapped elsewhere")
        if ret < 0:
            raise ValueError(f"publish_l2 at {dev_base} -> fd {fd}: "
                             f"{errno.errorcode.get(-ret, ret)}")
        return list(zip(ffi.unpack(hosts, ret), ffi.unpack(grans, ret), strict=True))

    def invalidate(self, dev_off: int, length: int) -> int:
        """Unmap every granule [dev_off, dev_off + length) touches; returns how
        many were mapped. Requests already holding them keep them: see unmap()."""
        _check("dev_off", dev_off)
        _check("length", length)
        return int(lib.aur_ext_invalidate(self.cdata, dev_off, length))

    def busy(self, dev_off: int, length: int) -> int:
        """Acquisitions in flight on granules the range touches, removed or not."""
        _check("dev_off", dev_off)
        _check("length", length)
        return int(lib.aur_ext_busy(self.cdata, dev_off, length))

    async def unmap(self, dev_off: int, length: int) -> None:
        """Unmap the range and wait until no request holds any of it: after
        this the caller may change where that data lives. (Records of what it
        held may have been pushed meanwhile: drain them before the change.)
        While it waits, the release of a removed entry notifies (see
        :meth:`set_notify`), so a waiter woken by that need not poll long."""
        self.invalidate(dev_off, length)
        if not self.busy(dev_off, length):
            return
        delay, spins = 0.0, 0
        lib.aur_ext_wait_begin(self.cdata)
        try:
            while self.busy(dev_off, length):
                if spins < 4:
                    spins += 1      # a request finishing this loop turn is the usual case
                    await asyncio.sleep(0)
                elif self._notified:
                    # woken by the release (the loop's thread may sleep in C
                    # meanwhile, where no timer of ours would fire); the
                    # timeout only guards against a lost notification
                    f = asyncio.get_running_loop().create_future()
                    self._waiters.append(f)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(f, 0.05)
                else:
                    delay = min(0.001, delay * 2 or 0.00005)
                    await asyncio.sleep(delay)
        finally:
            lib.aur_ext_wait_end(self.cdata)

    def notified(self) -> None:
        """The target heard the notify fd (on the loop that unmaps): wake the
        unmaps waiting for a release."""
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def acquire(self, dev_off: int, length: int, *, write: bool,
                slot: int | None = None) -> tuple[list[Piece | Zipped], Handle] | None:
        """Resolve and hold [dev_off, dev_off + length) as the data plane does.

        Returns the pieces in device order and a handle to pass to release(),
        or None when some granule is unmapped (or read-only or ZERO, for a
        write; or ALLOC or COW, for a write with no ``slot``, an empty pool or
        a full log; or allocating, for anything; or when SUB granules make
        more runs than it has room for). A run of ZERO or ALLOC
        granules read is one piece ``(ZERO_FD, 0, length)``. A write to ALLOC
        or COW granules gets clusters from ``slot``'s pool: its pieces point
        there, and the handle's ``copies`` say what of the COW granules' data
        the writer copies there too.
        """
        _check("dev_off", dev_off)
        if not 0 < length <= _U32:
            raise ValueError(f"length {length} out of range")
        g = self.granule.bit_length() - 1
        n = ((dev_off + length - 1) >> g) - (dev_off >> g) + 1
        room = n + lib.AUR_EXT_SUBCLUSTERS  # (a SUB granule's runs: a piece each)
        pieces = ffi.new("struct aur_ext_piece[]", room)
        ids = ffi.new("uint32_t[]", n)
        copies = ffi.new("struct aur_ext_copy[2]")
        nc = ffi.new("unsigned *")
        got = lib.aur_ext_acquire_cow(self.cdata, dev_off, length, write,
                                      -1 if slot is None else slot, pieces, room, ids, n,
                                      copies, nc)
        if not got:
            return None
        return [Zipped(p.fd, p.host_off, p.len, p.zlen, p.zskip, p.zalg) if p.zalg
                else (p.fd, p.host_off, p.len) for p in pieces[0:got]], Handle(
            ids, n, [ZipCopy(Zipped(c.src_fd, c.src_off, c.len, c.zlen, c.zskip, c.zalg),
                             c.dst_fd, c.dst_off) if c.zalg
                     else (c.src_fd, c.src_off, c.dst_fd, c.dst_off, c.len)
                     for c in copies[0:nc[0]]])

    def release(self, handle: Handle, outcome: int = DONE) -> int:
        """Let go of what acquire() held; a handle is released once. For the
        granules it allocated, ``outcome`` says what became of the write:
        ``DONE`` (all written: each becomes MAP there, with an ok record),
        ``FAILED`` (maybe partly written: ALLOC again, a failed record so the
        target frees the cluster) or ``UNUSED`` (nothing written: the cluster
        goes back to the head of its pool, no record). Returns how many
        granules it allocated became data."""
        if handle._n < 0:
            raise RuntimeError("extent handle released twice")
        if outcome not in (DONE, FAILED, UNUSED):
            raise ValueError(f"outcome {outcome}")
        done = int(lib.aur_ext_release(self.cdata, handle._ids, handle._n, outcome))
        handle._n = -1
        return done

    # -- allocation: pools of clusters the target counted, records of their use

    def attach(self) -> int:
        """A pool slot for one data plane (``dataplane.Extents(table, slot)``):
        each plane takes clusters from its own pool, so the target can size
        and refill them per queue. At most ``AUR_EXT_SLOTS`` (64)."""
        ret = int(lib.aur_ext_attach(self.cdata))
        if ret < 0:
            raise OSError(-ret, "extent table: every pool slot is attached")
        return ret

    def set_alloc(self, fd: int, pool_cap: int, log_cap: int) -> None:
        """Let writes to ALLOC granules allocate, in ``fd`` (the file every
        pool's host offsets are in), each pool holding at most ``pool_cap``
        clusters and at most ``log_cap`` records waiting to be drained (a
        write that could not be recorded is a miss). Once per table."""
        ret = int(lib.aur_ext_set_alloc(self.cdata, fd, pool_cap, log_cap))
        if ret < 0:
            raise OSError(-ret, f"extent table allocation (fd {fd}, pool {pool_cap}, "
                                f"log {log_cap}): {errno.errorcode.get(-ret, ret)}")

    def pool_add(self, slot: int, host_offs: Iterable[int]) -> int:
        """Add host offsets (granule-aligned; zeroed and counted by the
        caller: C writes into them as they are) to the tail of ``slot``'s
        pool; returns how many fitted, the rest stay the caller's. Resets the
        pool's low-water notification."""
        offs = list(host_offs)
        for h in offs:
            _check("host offset", h)
        ret = int(lib.aur_ext_pool_add(self.cdata, slot, ffi.new("uint64_t[]", offs), len(offs)))
        if ret < 0:
            raise ValueError(f"pool {slot}: a misaligned offset, no such slot or "
                             f"allocation not enabled ({errno.errorcode.get(-ret, ret)})")
        return ret

    def pool_take(self, slot: int, max_n: int | None = None) -> list[int]:
        """Take unused clusters back from ``slot``'s pool (at most ``max_n``;
        None: all), in the order C would have used them: for a close, or a
        pool the target wants smaller."""
        n = self.pool_level(slot) if max_n is None else max_n
        out = ffi.new("uint64_t[]", max(n, 1))
        got = int(lib.aur_ext_pool_take(self.cdata, slot, out, n))
        return list(ffi.unpack(out, got))

    def pool_level(self, slot: int) -> int:
        """Clusters in ``slot``'s pool now."""
        return int(lib.aur_ext_pool_level(self.cdata, slot))

    def drain(self) -> list[Record]:
        """The records of settled allocations, oldest first: each is the only
        news of where a write's data went. Cheap when there are none (one C
        call into a buffer kept for it): a target drains before every
        request it serves. One thread drains a table (its owner's)."""
        out, n, raw = self._recs, len(self._recs), self._recs_raw
        recs: list[Record] = []
        while True:
            got = int(lib.aur_ext_drain(self.cdata, out, n))
            # (unpacked in one call: a cffi attribute read per field cost
            # more than the engine's whole work per record; and made with
            # tuple.__new__, which runs no Python frame as Record() does)
            recs += [_new(Record, (gran, host_off, bool(flags & _REC_OK), slot, subs,
                                   bool(flags & _REC_GROWN)))
                     for gran, host_off, flags, slot, subs
                     in _REC.iter_unpack(raw[:got * _REC.size])]
            if got < n:
                return recs

    def set_hold_writes(self, on: bool) -> None:
        """With ``on``, a data plane serving this table does not answer the
        writes it serves: it hands each to Python once its data is written
        (and its allocation recorded), and the target's ``settle_writes``
        answers them, once what they changed is durable. Set it before any
        data plane serves the table."""
        lib.aur_ext_set_hold_writes(self.cdata, int(on))

    @property
    def holds_writes(self) -> bool:
        """Whether :meth:`set_hold_writes` is on."""
        return bool(lib.aur_ext_holds_writes(self.cdata))

    def set_notify(self, efd: int) -> None:
        """An eventfd C adds 1 to when the target has work: a pool dropped to
        half (once until its next pool_add), the log reached half full, or a
        held entry an :meth:`unmap` waits for was let go. -1: none. The
        target keeps the fd open while the table lives, and calls
        :meth:`notified` when it hears it."""
        lib.aur_ext_set_notify(self.cdata, efd)
        self._notified = efd >= 0

    def stats(self) -> dict[str, int]:
        """Lock operations and how many were contended (waited for another
        thread), allocations per outcome (``grown``: of those done, writes
        that added subclusters to a SUB granule's cluster), records not
        drained, allocations in flight: what says whether the one mutex or
        the pools need work."""
        s = ffi.new("struct aur_ext_stats *")
        lib.aur_ext_stats(self.cdata, s)
        return {k: int(getattr(s, k)) for k in ("locks", "contended", "done", "failed",
                                                "unused", "grown", "log_n", "allocating")}

    def lookup(self, dev_off: int, length: int, *, write: bool,
               slot: int | None = None) -> list[Piece | Zipped] | None:
        """The pieces a request for the range would use, or None (tests,
        debugging). With a slot, a write allocates, and is released as DONE:
        records are pushed as for a completed write."""
        held = self.acquire(dev_off, length, write=write, slot=slot)
        if held is None:
            return None
        self.release(held[1])
        return held[0]

    def __len__(self) -> int:
        """Granules mapped now (not counting removed ones still held)."""
        return int(lib.aur_ext_count(self.cdata))

    def close(self) -> None:
        """Free the table; refused while any request holds an entry."""
        if self._t is None:
            return
        if lib.aur_ext_busy(self._t, 0, _U64):
            raise RuntimeError("extent table closed while requests hold entries")
        ffi.release(self._t)
        self._t = None
