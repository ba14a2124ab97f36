"""What the parts of a qcow2 image share: the L2 table and entry forms,
the image's state (set up by ``Qcow2Image.__init__`` in
``aioublk.qcow2.image``: the header's geometry, the L1 table, the
collaborators it holds) and the guards that mark an image corrupt rather
than write where it must not. The request paths (``reads``, ``writes``)
build on ``ImageBase``; the collaborators (``refcounts``, ``pools``,
``flush``, ``l2cache``, ``publish``) take from here only the table forms
and the errors."""

from __future__ import annotations

import asyncio
import errno
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from aioublk import logs
from aioublk.io.hostfile import HostFile, aligned
from aioublk.qcow2 import format as fmt

if TYPE_CHECKING:
    from aioublk.qcow2.flush import Frees, WriteBack
    from aioublk.qcow2.l2cache import L2Cache
    from aioublk.qcow2.pools import Pools
    from aioublk.qcow2.publish import Publisher
    from aioublk.qcow2.refcounts import Refcounts

log = logs.get_logger("aioublk.qcow2")

DEFAULT_CACHE_BYTES = 32 << 20  # L2 cache bound, as QEMU's default maximum
OFFLOAD_BYTES = 64 << 10  # clusters this big are decompressed on a worker thread
MAX_CHAIN = 64
_ZEROS = bytes(1 << 20)

Backing = Any  # Qcow2Image | RawBacking


#: an engine entry no standard entry can say (an extended L2 entry whose
#: subclusters differ): its subcluster word says, per subcluster. A reserved
#: bit of the standard entry, never written as such (``ext_entry``)
PARTIAL = 1 << 1


def engine_entry(e: int, sub: int) -> int:
    """An extended L2 entry as the engine works with it: a standard entry
    where the subclusters all agree, else the entry marked PARTIAL."""
    e &= ~fmt.ZERO  # (reserved with extended L2)
    if e & fmt.COMPRESSED:
        return e
    alloc, zero = sub & fmt.SUB_ALLOC, sub >> 32
    if e & fmt.OFFSET_MASK and alloc == fmt.SUB_ALLOC and not zero:
        return e
    if zero == fmt.SUB_ALLOC and not alloc:
        return e | fmt.ZERO
    if not e & fmt.OFFSET_MASK and not sub:
        return 0
    return e | PARTIAL


def ext_entry(e: int, sub: int) -> tuple[int, int]:
    """An engine entry as an extended L2 entry and its subcluster word
    (``sub``: what the table held, kept where the entry is PARTIAL)."""
    if e & PARTIAL:
        return e & ~PARTIAL, sub
    if e & fmt.COMPRESSED:
        return e, 0
    if e & fmt.ZERO:
        return e & ~fmt.ZERO, fmt.SUB_ZERO
    return (e, fmt.SUB_ALLOC) if e & fmt.OFFSET_MASK else (0, 0)


class L2Table:
    """A cached L2 table: the L1 index it maps (``l1i``) and, per entry, what
    the data plane has of it (``pub``: 0 nothing, else the kind it was
    published as, ``aioublk.dataplane.extents.MAP`` or ``ZERO``; see
    ``aioublk.qcow2.publish``). With extended L2, ``entries`` are engine
    entries (``engine_entry``) and ``subs`` the subcluster words as loaded."""

    __slots__ = ("offset", "entries", "dirty", "gen", "l1i", "pub", "subs")

    def __init__(self, offset: int, entries: array[int], l1i: int,
                 dirty: bool = False, subs: array[int] | None = None) -> None:
        self.offset = offset
        self.entries = entries
        self.dirty = dirty
        self.gen = 0
        self.l1i = l1i
        self.pub = bytearray(len(entries))
        self.subs = subs

    @classmethod
    def parse(cls, offset: int, data: bytes | memoryview, l1i: int,
              extended: bool) -> L2Table:
        entries, subs = fmt.split_l2(data, extended)
        if subs is not None:
            entries = array("Q", map(engine_entry, entries, subs))
        return cls(offset, entries, l1i, subs=subs)

    def dump(self) -> bytes:
        if self.subs is None:
            return fmt.dump_table(self.entries)
        pairs = list(map(ext_entry, self.entries, self.subs))
        return fmt.join_l2(array("Q", (e for e, _ in pairs)), array("Q", (s for _, s in pairs)))

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


class ImageBase:
    """The state of an open image (see ``Qcow2Image``)."""

    file: HostFile
    path: str
    read_only: bool
    h: fmt.Header
    head: bytearray  # sector 0, updated in place
    cluster_size: int
    cbits: int
    cmask: int
    l2_bits: int
    l2_mask: int
    size: int
    v3: bool
    corrupt: bool
    lazy: bool  # lazy refcounts: the dirty bit is set while the image is open
    l1: array[int]
    meta: dict[int, int]  # host cluster -> metadata kind (aioublk.qcow2.writeback)
    refs: Refcounts  # refcounts and allocation (also owns ``used_end``)
    pools: Pools  # the data planes' pools of counted clusters
    frees: Frees  # frees deferred until durable, and the I/O they wait for
    wb: WriteBack  # the write-back of cached metadata
    l2: L2Cache  # the L2 tables (and the L1 table's dirty entries)
    plane: Publisher  # the extent table the data plane serves from
    #: ``frees.io_begin``/``io_end``, bound: every request counts its I/O
    _io_begin: Callable[[], int]
    _io_end: Callable[[int], None]
    _busy: dict[int, asyncio.Future[None]]  # virtual clusters being changed
    _zcache: OrderedDict[int, bytes]  # decompressed clusters
    backing: Backing
    _aliased = False  # two L1 entries name one L2 table: no data plane (``extent_table``)

    #: every request that changed metadata returns only once the change is in
    #: the image file (see ``_write_through``); an attribute, or ``open``'s keyword
    metadata_write_through = False
    #: whole clusters are written compressed (``open``'s keyword; set before
    #: the extent table is made: the data plane then writes nothing)
    compress = False

    async def _data_write(self, bufs: list[Any], host: int) -> None:
        g = self._io_begin()
        try:
            await self.file.writev(bufs, host)
        finally:
            self._io_end(g)


    # ------------------------------------------------------------------ guards
    def _writable(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"{self.path} is open read-only")
        if self.corrupt:
            raise _eio(f"{self.path} was marked corrupt: repair it with "
                       f"`aioublk img check -r all {self.path}`")

    def _overlap(self, host: int, length: int) -> None:
        first = host >> self.cbits
        last = (host + length - 1) >> self.cbits
        for c in range(first, last + 1):
            if c in self.meta:
                self._mark_corrupt(f"a data write to {host:#x} would overwrite metadata")

    def _mark_corrupt(self, why: str) -> NoReturn:
        self.corrupt = True
        self.plane.drop()
        log.error("qcow2 image marked corrupt", image=self.path, reason=why)
        if self.v3 and not self.read_only:
            # the last durable header: a refcount table a write-back is moving
            # is named only once it is on disk (``WriteBack.run_locked``)
            head = self._corrupt_bit(self.head)
            try:
                self.file.pwrite_sector(head, 0, sync=False)
            except OSError:
                pass  # best effort: the image is refused in memory all the same
            else:
                try:
                    self.file.datasync()
                except OSError as e:
                    self.wb.sync_failed(e)
                else:
                    self.head[:] = head
        raise _eio(f"{self.path}: {why}; image marked corrupt, run "
                   f"`aioublk img check -r all {self.path}`")

    def _set_dirty(self, on: bool) -> None:
        """The header's dirty bit set (or cleared), durably."""
        inc = int.from_bytes(self.head[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8], "big")
        inc = inc | fmt.INCOMPAT_DIRTY if on else inc & ~fmt.INCOMPAT_DIRTY
        self.head[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8] = fmt.pack_u64(inc)
        self.file.pwrite_sector(bytes(self.head), 0)
        self.h.incompatible = inc

    def _corrupt_bit(self, head: bytes | bytearray) -> bytes:
        """Header bytes ``head`` with the corrupt bit set if the image is corrupt."""
        if not self.corrupt:
            return bytes(head)
        out = bytearray(head)
        inc = int.from_bytes(out[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8], "big")
        out[fmt.OFF_INCOMPAT:fmt.OFF_INCOMPAT + 8] = fmt.pack_u64(inc | fmt.INCOMPAT_CORRUPT)
        return bytes(out)



    def _check_host(self, host: int, vc: int) -> None:
        if host & self.cmask:
            self._mark_corrupt(f"the L2 entry of cluster {vc} is not cluster aligned "
                               f"({host:#x})")
        if host >= self.refs.used_end:
            self._mark_corrupt(f"the L2 entry of cluster {vc} points past the end of the "
                               f"file ({host:#x})")
