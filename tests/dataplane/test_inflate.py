"""Compressed clusters in C: the extent table's ZIP granules (a compressed
qcow2 cluster's bytes, published for the data plane) and the data plane
that reads and inflates the part a request asks for, on a real ring with
the test playing the kernel (``test_hostile_kernel.Plane``)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from aioublk._uring import lib
from aioublk.dataplane.extents import (
    DONE,
    UNUSED,
    ZIP_COW,
    ZLIB,
    ZSTD,
    ExtentConflict,
    ExtentTable,
    Record,
    ZipCopy,
    Zipped,
)
from aioublk.dataplane.maps import Extents
from aioublk.dataplane.plane import EV_COMMIT, EV_FETCH, EV_IO, EV_RETRY
from aioublk.kernel import uapi
from aioublk.qcow2.compress import compress
from aioublk.qcow2.format import COMPRESSION_ZLIB, COMPRESSION_ZSTD
from aioublk.ring import Ring
from tests.dataplane.test_hostile_kernel import Plane
from tests.support.files import Where

G = 64 * 1024  # the granule: a default qcow2 cluster
KIND = {ZLIB: COMPRESSION_ZLIB, ZSTD: COMPRESSION_ZSTD}


def cluster(seed: int) -> bytes:
    """A compressible cluster, different for each seed."""
    line = bytes(f"cluster {seed:5d} line ", "ascii")
    return b"".join(line + i.to_bytes(4, "big") * 3 for i in range(G // (len(line) + 12) + 1))[:G]


class Image:
    """A file of compressed clusters at byte offsets that are not aligned (as
    qcow2 packs them), each granule's (offset, length, algorithm) and data."""

    def __init__(self, path: Path, algs: list[int], *, lead: int = 1000) -> None:
        self.want: list[bytes] = []
        self.spans: list[tuple[int, int, int]] = []
        blob = bytearray(os.urandom(lead))
        for i, alg in enumerate(algs):
            data = cluster(i)
            packed = compress(KIND[alg], data, G)
            assert packed is not None
            self.spans.append((len(blob), len(packed), alg))
            self.want.append(data)
            blob += packed + os.urandom(37)  # (a neighbour's bytes follow, as in qcow2)
        path.write_bytes(blob)
        self.fd = os.open(path, os.O_RDONLY)

    def publish(self, table: ExtentTable) -> None:
        for i, (off, n, alg) in enumerate(self.spans):
            assert table.insert_zip(i * G, self.fd, off, n, alg)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def image(where: Where) -> Any:
    img = Image(where.dir / "zipped", [ZLIB, ZSTD, ZLIB])
    yield img
    img.close()


# -- the table ------------------------------------------------------------------

def test_a_zip_granule_reads_as_its_own_piece_and_never_takes_a_write(image: Image) -> None:
    t = ExtentTable(G)
    image.publish(t)
    off, n, alg = image.spans[1]
    assert t.lookup(G + 4096, 8192, write=False) == [Zipped(image.fd, off, 8192, n, 4096, alg)]
    # across granules: one piece each, never merged, each with its own skip
    got = t.lookup(G - 512, 1024, write=False)
    assert got == [Zipped(image.fd, image.spans[0][0], 512, image.spans[0][1], G - 512, ZLIB),
                   Zipped(image.fd, off, 512, n, 0, ZSTD)]
    assert t.lookup(G, 4096, write=True) is None
    slot = t.attach()
    t.set_alloc(99, 8, 8)
    assert t.lookup(G, 4096, write=True, slot=slot) is None  # (no copy-on-write from here)
    # published again the same way: fine; otherwise a conflict
    assert t.insert_zip(G, image.fd, off, n, alg)
    with pytest.raises(ExtentConflict):
        t.insert_zip(G, image.fd, off, n + 1, alg)
    with pytest.raises(ExtentConflict):
        t.insert_kind(lib.AUR_EXT_MAP, G, G, image.fd, 0)


@pytest.mark.parametrize("args", [(512, 0, 100, ZLIB), (0, 0, 0, ZLIB), (0, 0, 100, 3),
                                  (0, 0, 100, 0)])
def test_a_zip_granule_that_cannot_be_is_refused(image: Image, args: tuple[int, ...]) -> None:
    t = ExtentTable(G)
    dev_off, zoff, zlen, alg = args
    with pytest.raises(ValueError):
        t.insert_zip(dev_off, image.fd, zoff, zlen, alg)
    assert len(t) == 0


# -- the data plane -------------------------------------------------------------

def _commit(batch: int, tag: int) -> list[tuple[int, int, int, int]]:
    """What the test's kernel sees of a request C answered in full: its
    commit, refused by the pipe (batch: then the element's failure, refused
    again)."""
    if batch:
        return [(EV_COMMIT, tag, 0, -errno.EOPNOTSUPP), (EV_COMMIT, tag, 1, -errno.EOPNOTSUPP)]
    return [(EV_IO, tag, 0, -errno.EOPNOTSUPP)]


async def _read(plane: Plane, batch: int, tag: int, off: int, length: int) -> None:
    plane.events.clear()
    (plane.fetch_batch if batch else plane.fetch)(tag, uapi.Op.READ, length >> 9, off >> 9)
    n = len(_commit(batch, tag))
    await plane.wait_for(lambda: len([e for e in plane.events if e[0] != EV_FETCH]) >= n)


@pytest.mark.asyncio
@pytest.mark.parametrize("batch", [0, 1], ids=["per-io", "batch"])
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
async def test_c_inflates_the_part_a_read_asks_for(image: Image, where: Where, batch: int,
                                                   user_copy: bool) -> None:
    """zlib and zstd granules, beside plain data: the head, the middle and
    the tail of a cluster, a read across two compressed clusters, and one
    of everything; each served by C in full, the bytes those of the
    clusters, nothing held after."""
    plain = os.open(where.dir / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(plain, b"\x5a" * G, 0)
    table = ExtentTable(G)
    image.publish(table)
    assert table.insert(3 * G, G, plain, 0, writable=False)
    disk = b"".join(image.want) + b"\x5a" * G
    ring = Ring(16)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = Plane(ring, plain, depth=2, max_io=4 * G, mode=mode, batch=batch, map=Extents(table),
                  setup=where.setup)
    fcntl.fcntl(plane.pipe[1], fcntl.F_SETPIPE_SZ, 4 * G)  # (-u: a whole read copied out)
    try:
        for off, length in ((0, 4096), (G + 8192, 4096), (2 * G - 4096, 4096),
                            (G - 4096, 8192), (0, 4 * G), (2 * G + 512, G + 512)):
            plane.buf(1)[:] = b"\xaa" * (4 * G)
            await _read(plane, batch, 1, off, length)
            assert [e for e in plane.events if e[0] != EV_FETCH] == _commit(batch, 1)
            got = os.read(plane.pipe[0], 4 * G) if user_copy else bytes(plane.buf(1)[:length])
            assert got == disk[off:off + length], (off, length)
            assert plane.dp.inflight == 0 and table.busy(0, 4 * G) == 0
        c = plane.dp.counts[0]
        assert c.c_served == 6 and c.py_handed == 0
    finally:
        plane.close()
        os.close(plain)


@pytest.mark.asyncio
async def test_a_cluster_that_does_not_inflate_goes_to_python(where: Where) -> None:
    """Bytes that are not what the entry says (garbage, or a stream cut
    short) are never answered by C: the request comes back to Python from
    the start, which reports the image's fault, and nothing stays held."""
    good = compress(COMPRESSION_ZLIB, cluster(7), G)
    assert good is not None
    path = where.dir / "bad"
    path.write_bytes(os.urandom(3000) + good)
    fd = os.open(path, os.O_RDONLY)
    table = ExtentTable(G)
    assert table.insert_zip(0, fd, 0, 3000, ZLIB)          # garbage
    assert table.insert_zip(G, fd, 3000, len(good) // 2, ZLIB)   # cut short
    assert table.insert_zip(2 * G, fd, 0, 3000, ZSTD)      # no zstd frame
    ring = Ring(16)
    plane = Plane(ring, fd, depth=2, max_io=G, map=Extents(table), setup=where.setup)
    try:
        for dev in (0, G, 2 * G):
            await _read(plane, 0, 0, dev + G - 4096, 4096)
            assert plane.events == [(EV_RETRY, 0, 0, -errno.EIO)], dev
            assert plane.dp.inflight == 0 and table.busy(0, 3 * G) == 0
    finally:
        plane.close()
        os.close(fd)


@pytest.mark.asyncio
async def test_a_cluster_at_the_files_end_is_read_short_and_served(where: Where) -> None:
    """The read of a compressed cluster is widened to 4 KiB boundaries (a file
    opened O_DIRECT wants them), so at the end of the file it comes back
    short: what came is enough."""
    data = cluster(3)
    packed = compress(COMPRESSION_ZSTD, data, G)
    assert packed is not None
    path = where.dir / "end"
    path.write_bytes(os.urandom(5000) + packed)  # (ends mid-block)
    fd = os.open(path, os.O_RDONLY)
    table = ExtentTable(G)
    assert table.insert_zip(0, fd, 5000, len(packed) + 300, ZSTD)  # (its sector's padding)
    ring = Ring(16)
    plane = Plane(ring, fd, depth=2, max_io=G, map=Extents(table), setup=where.setup)
    try:
        await _read(plane, 0, 1, 0, G)
        assert plane.events == _commit(0, 1)
        assert bytes(plane.buf(1)) == data
    finally:
        plane.close()
        os.close(fd)


@pytest.mark.asyncio
async def test_a_cluster_inflated_once_is_read_again_from_the_planes_cache(
        where: Where) -> None:
    """A read within what the plane inflated of a cluster already is a copy
    (its compressed bytes, garbled on disk since, are not read again); one
    further than that inflates again, from the disk (and fails here: to
    Python); a new map empties the cache."""
    image = Image(where.dir / "zipped", [ZLIB, ZSTD])
    table = ExtentTable(G)
    image.publish(table)
    ring = Ring(16)
    plane = Plane(ring, image.fd, depth=2, max_io=G, map=Extents(table), setup=where.setup)
    try:
        await _read(plane, 0, 0, G, 8192)
        assert plane.events == _commit(0, 0)
        off, n, _alg = image.spans[1]
        with open(where.dir / "zipped", "r+b") as f:
            f.seek(off)
            f.write(os.urandom(n))
        for at, length in ((G, 8192), (G + 4096, 4096)):
            plane.buf(1)[:] = bytes(G)
            await _read(plane, 0, 1, at, length)
            assert plane.events == _commit(0, 1)
            assert plane.buf(1)[:length] == image.want[1][at - G:at - G + length]
        await _read(plane, 0, 1, 2 * G - 4096, 4096)
        assert plane.events == [(EV_RETRY, 1, 0, -errno.EIO)]
        await _read(plane, 0, 0, 0, 4096)  # (the other cluster's bytes are as they were)
        assert plane.events == _commit(0, 0)
        plane.dp.set_map(Extents(table))
        await _read(plane, 0, 1, G, 4096)
        assert plane.events == [(EV_RETRY, 1, 0, -errno.EIO)]
    finally:
        plane.close()
        image.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["ZERO_COPY", "AUTO_ZC"])
async def test_zip_granules_are_pythons_in_the_zero_copy_modes(image: Image, mode: str) -> None:
    """No buffer of C's to inflate into: the read goes to Python as fetched."""
    table = ExtentTable(G)
    image.publish(table)
    ring = Ring(16)
    plane = Plane(ring, image.fd, depth=2, max_io=G, mode=getattr(lib, f"AUR_DP_{mode}"),
                  map=Extents(table))
    try:
        await _read(plane, 0, 0, 4096, 4096)
        assert plane.events == [(EV_IO, 0, 0, 0)]
        assert plane.dp.inflight == 0 and table.busy(0, 3 * G) == 0
    finally:
        plane.close()


# -- copy-on-write from a compressed granule ------------------------------------

def test_a_write_to_a_zip_cow_granule_allocates_and_copies_the_inflated_rest(
        image: Image, tmp_path: Path) -> None:
    """With a slot, a write to ZIP_COW takes a pool cluster and says what of
    the inflated granule it leaves (its head and its tail, both from the
    same compressed bytes); without a slot, or as plain ZIP, it is a miss;
    a write that did not land leaves the granule ZIP_COW where it was."""
    t = ExtentTable(G)
    t.set_alloc(99, 8, 8)
    slot = t.attach()
    assert t.pool_add(slot, [10 * G, 11 * G]) == 2
    off, n, alg = image.spans[1]
    assert t.insert_zip(G, image.fd, off, n, alg, kind=ZIP_COW)
    assert t.insert_zip(2 * G, image.fd, *image.spans[2][:2], ZLIB)
    assert t.lookup(G, 4096, write=True) is None
    assert t.lookup(2 * G, 4096, write=True, slot=slot) is None  # (plain ZIP)
    held = t.acquire(G + 4096, 8192, write=True, slot=slot)
    assert held is not None
    pieces, h = held
    assert pieces == [(99, 10 * G + 4096, 8192)]
    src = Zipped(image.fd, off, 4096, n, 0, alg)
    assert h.copies == [ZipCopy(src, 99, 10 * G),
                        ZipCopy(src._replace(length=G - 12288, skip=12288), 99, 10 * G + 12288)]
    t.release(h, UNUSED)
    assert t.lookup(G + 4096, 4096, write=False) == [Zipped(image.fd, off, 4096, n, 4096, alg)]
    whole = t.acquire(G, G, write=True, slot=slot)
    assert whole is not None and whole[1].copies == []
    t.release(whole[1], DONE)
    assert t.drain() == [Record(1, 10 * G, True, slot)]


@pytest.mark.asyncio
@pytest.mark.parametrize("user_copy", [False, True], ids=["copy", "user-copy"])
async def test_c_copies_on_write_from_a_compressed_granule(image: Image, where: Where,
                                                          user_copy: bool) -> None:
    """C's copy-on-write over zlib and zstd granules: a write inside a
    granule (its head and tail inflated once, both written), one at a
    granule's end (only its head), one of a whole granule (nothing to
    copy): each lands in its pool cluster with the inflated rest around it,
    recorded, and the granule is data there after."""
    alloc = os.open(where.dir / "alloc", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(alloc, 8 * G)
    table = ExtentTable(G)
    table.set_alloc(alloc, 8, 8)
    slot = table.attach()
    assert table.pool_add(slot, [2 * G, 4 * G, 6 * G]) == 3
    for i, (off, n, alg) in enumerate(image.spans):
        assert table.insert_zip(i * G, image.fd, off, n, alg, kind=ZIP_COW)
    ring = Ring(16)
    mode = lib.AUR_DP_USER_COPY if user_copy else lib.AUR_DP_COPY
    plane = Plane(ring, alloc, depth=2, max_io=G, mode=mode, map=Extents(table, slot=slot),
                  copy_in=user_copy, setup=where.setup)
    try:
        writes = [(G + 4096, 8192), (3 * G - 4096, 4096), (0, G)]
        for k, (dev, length) in enumerate(writes):
            body = os.urandom(length)
            await plane.write(0, dev, body)
            assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)], (dev, length)
            vc, at = divmod(dev, G)
            host = (2 + 2 * k) * G
            assert table.drain() == [Record(vc, host, True, slot)]
            want = bytearray(image.want[vc])
            want[at:at + length] = body
            assert os.pread(alloc, G, host) == want, (dev, length)
            assert table.lookup(vc * G, G, write=False) == [(alloc, host, G)]
        c = plane.dp.counts[0]
        assert (c.c_alloc, c.c_served, c.py_handed) == (3, 3, 0)
        assert plane.dp.inflight == 0 and table.busy(0, 3 * G) == 0
    finally:
        plane.close()
        os.close(alloc)
