"""Reads: a request is split into runs (allocated clusters that follow on
disk, zeros, the backing file, compressed clusters), read at once; the
one-cluster case is served without a coroutine (``start_read``)."""

from __future__ import annotations

import errno
from collections.abc import Awaitable
from typing import Any

from aioublk.dataplane.crossloop import run_in_thread
from aioublk.dataplane.extents import ZERO_FD, ZLIB, ZSTD, Zipped
from aioublk.io.hostfile import aligned
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import OFFLOAD_BYTES, PARTIAL, _eio, _fill_zero
from aioublk.qcow2.compress import decompress
from aioublk.qcow2.core import ImageBase
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, ZERO
from aioublk.ring import Handler, current_ring
from aioublk.target import Done, gather_all, rw_handler


class Reads(ImageBase):
    """The read path."""

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
        self._drain_c()  # (every request looks here first: C's news before its lookups)
        vc = offset >> self.cbits
        if (offset + n - 1) >> self.cbits != vc or offset + n > self.size:
            return -1
        off = self.l1[vc >> self.l2_bits] & OFFSET_MASK
        t = self.l2.tables.get(off) if off else None
        if t is None:
            return -1
        e = t.entries[vc & self.l2_mask]
        if e & (COMPRESSED | ZERO | PARTIAL) or not e & OFFSET_MASK:
            return -1
        host = e & OFFSET_MASK
        if host & self.cmask or host >= self.refs.used_end:
            return -1  # the coroutine path reports it
        if self.plane.on and not t.pub[vc & self.l2_mask]:
            self.plane.publish_in(t, vc)  # the next request on it may not come here
        if write and (not e & COPIED or self.read_only or self.corrupt or self.compress
                      or vc in self._busy
                      or host >> self.cbits in self.meta or self.metadata_write_through
                      and self.wb.written < self.wb.seq):
            return -1
        return host + (offset & self.cmask)

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        """The task-free read (see ``Target.start_read``): one mapped cluster."""
        host = self._mapped(offset, len(buf), False)
        if host < 0:
            return False
        current_ring().start_read(self.file.fd, buf, host, self._tracked(
            rw_handler(len(buf), done, lambda: self.read(offset, buf),
                       self.file.refused)))
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
        lookup, plane = self.l2.lookup, self.plane
        pending: list[Awaitable[Any]] = []  # legs returning None: gather_all takes them
        pos = offset
        while pos < end:
            vc = pos >> cbits
            e = lookup(vc)
            if e is None:
                e = await self.l2.entry(vc)
            stop = min(end, (vc + 1) << cbits)
            sub = view[pos - offset:stop - offset]
            if e & COMPRESSED:
                pending.append(self._read_compressed(e, pos & cmask, sub))
            elif e & PARTIAL:
                pending.append(self._read_partial(vc, e, self.l2.sub_word(vc), pos & cmask, sub))
            elif e & ZERO:
                _fill_zero(sub)
            elif e & OFFSET_MASK:
                host = e & OFFSET_MASK
                self._check_host(host, vc)
                if plane.on:
                    plane.publish(vc)
                # extend over clusters that follow on disk too
                nxt = host + cs
                while stop < end:
                    e2 = lookup(stop >> cbits)
                    if e2 is None or e2 & (COMPRESSED | ZERO | PARTIAL) or \
                            (e2 & OFFSET_MASK) != nxt:
                        break
                    if plane.on:
                        plane.publish(stop >> cbits)
                    stop = min(end, stop + cs)
                    nxt += cs
                sub = view[pos - offset:stop - offset]
                pending.append(self.file.read_into(sub, host + (pos & cmask)))
            elif self.backing is not None:
                while stop < end and lookup(stop >> cbits) == 0:
                    stop = min(end, stop + cs)
                sub = view[pos - offset:stop - offset]
                pending.append(self._read_through(pos, sub) if plane.on
                               else self._read_backing(pos, sub))
            else:
                _fill_zero(sub)
            pos = stop
        if pending:  # every leg done (they fill the caller's buffer) before an error
            await gather_all(pending)

    async def _read_partial(self, vc: int, e: int, word: int, at: int,
                            view: memoryview) -> None:
        """Bytes [at, at + len(view)) of a cluster whose subclusters differ
        (extended L2, subcluster word ``word``), in runs of subclusters alike:
        allocated ones from its host cluster, zero ones as zeros, the others
        from the backing file (or zeros)."""
        sc = self.cluster_size // fmt.SUBCLUSTERS
        host = e & OFFSET_MASK

        def kind(i: int) -> int:  # 1 allocated, 2 zero, 0 neither
            return (word >> i & 1) | (word >> (32 + i) & 1) << 1

        pending: list[Awaitable[Any]] = []
        pos, end = at, at + len(view)
        while pos < end:
            k = kind(pos // sc)
            stop = min(end, (pos // sc + 1) * sc)
            while stop < end and kind(stop // sc) == k:
                stop = min(end, stop + sc)
            part = view[pos - at:stop - at]
            if k == 3 or k == 1 and not host:
                raise _eio(f"{self.path}: the L2 entry of cluster {vc} has an invalid "
                           f"subcluster bitmap {word:#x}: run qemu-img check")
            if k == 1:
                self._check_host(host, vc)
                pending.append(self.file.read_into(part, host + pos))
            elif k == 0 and self.backing is not None:
                pending.append(self._read_backing((vc << self.cbits) + pos, part))
            else:
                _fill_zero(part)
            pos = stop
        if pending:
            await gather_all(pending)

    async def _read_through(self, pos: int, view: memoryview) -> None:
        """The backing file's bytes, then the clusters offered to the data
        plane where the chain holds them (the chain's tables are cached now)."""
        await self._read_backing(pos, view)
        self.plane.through(range(pos >> self.cbits,
                                 (pos + len(view) + self.cmask) >> self.cbits))

    def place(self, pos: int, n: int) -> tuple[int, int, int] | Zipped | None:
        """Where this image (as a backing file: read only) holds bytes
        [pos, pos + n), as far as its cached tables say without I/O: a run
        (fd, offset, length), one file and contiguous or all zeros, at most
        n long; a compressed cluster not in ``zc`` that [pos, pos + n) starts
        with and covers, as its compressed bytes (``Zipped``); None where the
        first cluster needs I/O or Python (a table not cached, part of a
        compressed cluster, subclusters that differ, an entry the coroutine
        path would refuse) (``aioublk.qcow2.publish.Place``)."""
        cbits, cmask, cs = self.cbits, self.cmask, self.cluster_size
        lookup, backing = self.l2.lookup, self.backing
        fd = off = -2  # (the run so far: none)
        got, end = 0, pos + n
        while pos + got < end:
            at = pos + got
            take = min(end - at, cs - (at & cmask), self.size - at)
            if at >= self.size:
                piece: tuple[int, int, int] | None = (ZERO_FD, 0, end - at)
            else:
                e = lookup(at >> cbits)
                if e is None:
                    piece = None
                elif e & COMPRESSED:  # (before PARTIAL: a compressed entry's bits differ)
                    ram = self.zc.where(e) if self.zc is not None else None
                    if ram is None:  # (its compressed bytes: a run of its own)
                        if got:
                            break
                        return self._zipped(e, take) if take == cs else None
                    piece = (self.zc.fd, ram + (at & cmask), take)  # type: ignore[union-attr]
                elif e & PARTIAL:
                    piece = None
                elif e & ZERO:
                    piece = (ZERO_FD, 0, take)
                elif e & OFFSET_MASK:
                    host = e & OFFSET_MASK
                    piece = None if host & cmask or host >= self.refs.used_end or \
                        host >> cbits in self.meta else (self.file.fd, host + (at & cmask), take)
                elif backing is not None and at < backing.size:
                    below = backing.place(at, take)
                    if isinstance(below, Zipped):  # (one cluster, a run of its own)
                        if got:
                            break
                        return below
                    piece = below
                else:
                    piece = (ZERO_FD, 0, take)
            if piece is None:
                break
            pfd, poff, plen = piece
            if got and (pfd != fd or pfd != ZERO_FD and poff != off + got):
                break
            if not got:
                fd, off = pfd, poff
            got += plen
        return (fd, off, got) if got else None

    def _zipped(self, e: int, length: int) -> Zipped | None:
        """Compressed entry ``e``'s bytes, for a reader that inflates them;
        None where they lie past the end of the file (the coroutine path
        reports that)."""
        span = fmt.compressed_span(e, self.cbits)
        if span.offset + span.length > max(self.refs.used_end, self.file.size) + 512:
            return None
        alg = ZSTD if self.h.compression_type == fmt.COMPRESSION_ZSTD else ZLIB
        return Zipped(self.file.fd, span.offset, length, span.length, 0, alg)

    async def _read_backing(self, pos: int, view: memoryview) -> None:
        b = self.backing
        have = max(0, min(len(view), b.size - pos))
        if have:
            await b.read(pos, view[:have] if have < len(view) else view)
        if have < len(view):
            _fill_zero(view[have:])

    async def _cluster_bytes(self, e: int) -> bytes | memoryview:
        """A compressed cluster, decompressed (valid until the next await): a
        few are cached for sequential reads, and a backing image keeps many
        where the data plane reads them (``zc``)."""
        zc = self.zc
        got: bytes | memoryview | None = self._zcache.get(e) if zc is None else zc.get(e)
        if got is not None:
            return got
        span = fmt.compressed_span(e, self.cbits)
        if span.offset + span.length > max(self.refs.used_end, self.file.size) + 512:
            raise _eio(f"{self.path}: compressed cluster at {span.offset:#x} lies past the "
                       "end of the file")
        raw = aligned(span.length)
        await self.file.read_into(raw, span.offset)
        try:
            if self.cluster_size >= OFFLOAD_BYTES:  # inflating takes long: off the loop
                data = await run_in_thread(  # (its result kicks a worker waiting in C)
                    decompress, self.h.compression_type, raw, self.cluster_size)
            else:
                data = decompress(self.h.compression_type, raw, self.cluster_size)
        except ValueError as err:
            raise _eio(f"{self.path}: compressed cluster at {span.offset:#x}: {err}") from None
        if zc is not None:
            return await zc.put(e, data)
        self._zcache[e] = data
        if len(self._zcache) > 8:
            self._zcache.popitem(last=False)
        return data

    async def _read_compressed(self, e: int, at: int, view: memoryview) -> None:
        data = await self._cluster_bytes(e)
        view[:] = data[at:at + len(view)]

