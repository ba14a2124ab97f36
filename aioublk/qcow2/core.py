"""The image's state and its guards: what the request paths (``reads``,
``writes``) share, set up by ``Qcow2Image.__init__`` in
``aioublk.qcow2.image``: the header's geometry, the L1 table, the
collaborators the image holds, and the guards that mark an image corrupt
rather than write where it must not."""

from __future__ import annotations

import asyncio
import errno
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import Backing, _eio, log
from aioublk.qcow2.flush import Frees, WriteBack
from aioublk.qcow2.l2cache import L2Cache
from aioublk.qcow2.pools import Pools
from aioublk.qcow2.publish import Publisher
from aioublk.qcow2.refcounts import Refcounts
from aioublk.qcow2.zcache import ZCache


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
    #: ``frees.io_begin``/``io_end`` and ``pools.drain``, bound: every
    #: request counts its I/O, and looks for C's records first
    _io_begin: Callable[[], int]
    _io_end: Callable[[int], None]
    _drain_c: Callable[[], None]
    _busy: dict[int, asyncio.Future[None]]  # virtual clusters being changed
    _zcache: OrderedDict[int, bytes]  # decompressed clusters
    #: a backing image's decompressed clusters, where the data plane reads them
    zc: ZCache | None = None
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
