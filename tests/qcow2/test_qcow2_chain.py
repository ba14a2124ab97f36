"""Reads through a backing chain from the data plane (host only: no ublk).

An unallocated cluster of an overlay whose data a backing image holds is
published read-only at its place in the backing file: a raw base at the
same offset, a qcow2 base where its own L2 entry says, at any depth, and
as zeros where the chain reads as zeros. A read through the backing file
publishes what it read and the rest of its L2 span; a write to such a
cluster is Python's (a copy-on-write), which takes the extent back first.

Here, for chains of depth 1 to 3 (raw and qcow2 bases, cluster sizes that
differ between layers, compressed and zeroed clusters below):
- every published cluster's pieces hold the chain's bytes (``qemu-img
  convert`` of the top is the reference), and what the data plane cannot
  serve (a cluster whose bytes lie in two places) is not published;
- a qcow2 base's compressed clusters are published from its memfd of
  decompressed clusters (``aioublk.qcow2.zcache``), and a full cache is
  emptied only once no request C started on it is in flight;
- a held backing extent keeps the copy-on-write waiting;
- random I/O served as C serves it (``DataPlaneStandIn``) leaves an image
  QEMU agrees with, and never writes a backing file.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
from pathlib import Path

import pytest

from aioublk.dataplane.extents import UNUSED, ZERO_FD, ExtentTable, Zipped
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2.base import PARTIAL
from aioublk.qcow2.format import SUB_ALLOC
from aioublk.ring import Ring
from tests.qcow2.test_qcow2_extents import DataPlaneStandIn, _held_then_released, published
from tests.qcow2.test_qcow2_writes import (
    chain2,
    chain3,
    hot_spots,
    new_case,
    random_io,
    read_matches_mirror,
    verify,
)
from tests.support.qcow2_util import (
    K,
    M,
    check_clean,
    create,
    mixed_content,
    qemu_io,
    read_file,
    to_raw,
    zipped_bytes,
)

pytestmark = pytest.mark.asyncio

CHAINS = ["raw-base", "qcow2-base", "depth2-compressed", "depth3-raw-base", "extl2-raw-base"]


def chain1(d: Path, fmt: str, extended_l2: bool = False) -> Path:
    """top (64k clusters, 6 MiB) over a 4 MiB base of data (raw, or qcow2
    with 64k clusters, some zeroed and some never written): the top larger
    than its base, a few clusters of its own (with ``extended_l2``, one of
    them in part: its other subclusters show the base)."""
    data = mixed_content(4 * M, seed=41)
    if fmt == "raw":
        (d / "base.raw").write_bytes(data)
        base = "base.raw"
    else:
        src = d / "pattern"
        src.write_bytes(data)
        create(d / "base.qcow2", 4 * M)
        qemu_io(d / "base.qcow2", f"write -s {src} 0 {3 * M}", f"write -z {M} {128 * K}")
        base = "base.qcow2"
    top = create(d / "top.qcow2", 6 * M, backing=base, backing_fmt=fmt,
                 extended_l2=extended_l2)
    qemu_io(top, f"write -P 0x71 {192 * K} {64 * K}", f"write -P 0x72 {2 * M + 512} 1024")
    return top


def build(chain: str, d: Path) -> Path:
    if chain == "raw-base":
        return chain1(d, "raw")
    if chain == "qcow2-base":
        return chain1(d, "qcow2")
    if chain == "depth2-compressed":
        return chain2(d, "1.1")[0]
    if chain == "extl2-raw-base":
        return chain1(d, "raw", extended_l2=True)
    return chain3(d)[0]


def piece_bytes(pieces: list[tuple[int, int, int] | Zipped]) -> bytes:
    out = bytearray()
    for piece in pieces:
        if isinstance(piece, Zipped):
            out += zipped_bytes(piece)
            continue
        fd, host, n = piece
        if fd == ZERO_FD:
            out += bytes(n)
            continue
        buf = mmap.mmap(-1, n)  # (files open O_DIRECT: an aligned buffer)
        assert os.preadv(fd, [buf], host) == n
        out += buf[:]
    return bytes(out)


async def read_whole(img: Qcow2Image) -> None:
    step = img.cluster_size
    for off in range(0, img.size, step):
        await img.read(off, bytearray(min(step, img.size - off)))


@pytest.mark.parametrize("chain", CHAINS)
async def test_published_backing_clusters_hold_the_chains_bytes(chain: str, tmp_path: Path,
                                                                ring: Ring) -> None:
    top = build(chain, tmp_path)
    want = read_file(to_raw(top, tmp_path / "want.raw"))
    img = Qcow2Image.open(str(top))
    try:
        table = img.extent_table()
        assert table is not None
        await read_whole(img)
        cs = img.cluster_size
        kinds = {"rw": 0, "ro": 0, "zero": 0, "zip": 0, "-": 0}
        for vc in range(-(-img.size // cs)):
            kind = published(table, vc, cs)
            kinds[kind] += 1
            if kind == "-":
                continue
            n = min(cs, img.size - vc * cs)
            pieces = table.lookup(vc * cs, n, write=False)
            assert pieces is not None
            assert piece_bytes(pieces) == want[vc * cs:vc * cs + n], \
                f"{chain}: cluster {vc} ({kind}) is published with other bytes"
    finally:
        await img.close()
    total = sum(kinds.values())
    # what stays Python's: a top cluster whose bytes lie in more than one
    # place (chain3's mid has 512 byte clusters: its writes at 1M, 2M, 3M
    # (compressed), 5M (two clusters) and 7M each leave a 64k cluster of the
    # top part in mid, part in base.raw or zeros). Compressed clusters of a
    # qcow2 base are published from its memfd of decompressed clusters; an
    # extended-L2 cluster whose subclusters differ is the engine's
    unpublished = {"raw-base": 0, "qcow2-base": 0, "depth2-compressed": 0,
                   "depth3-raw-base": 6, "extl2-raw-base": 1}[chain]
    assert kinds["-"] == unpublished, (chain, kinds)
    assert kinds["ro"] > total // 4, (chain, kinds)


async def test_a_raw_base_is_published_in_one_piece_per_run(tmp_path: Path, ring: Ring) -> None:
    """One read of a fresh overlay over a raw base publishes its whole L2
    span at the base's own offsets, no table of the overlay needed."""
    top = chain1(tmp_path, "raw")
    fresh = create(tmp_path / "fresh.qcow2", None, backing="base.raw", backing_fmt="raw")
    img = Qcow2Image.open(str(fresh))
    try:
        table = img.extent_table()
        assert table is not None
        await img.read(5 * img.cluster_size, bytearray(4096))
        assert not img.l2.tables  # (nothing allocated: the overlay has no L2 table)
        span = 4 * M // img.cluster_size
        assert [published(table, vc) for vc in range(span)] == ["ro"] * span
        assert table.lookup(0, 4 * M, write=False) == [(img.backing.file.fd, 0, 4 * M)]
    finally:
        await img.close()
    assert top.exists()


async def test_loose_backing_extents_are_bounded(tmp_path: Path, ring: Ring) -> None:
    """Extents published where the overlay has no L2 table are not forgotten
    with a table: past their bound they are all taken back, and published
    again by the next read through the backing file."""
    chain1(tmp_path, "raw")
    fresh = create(tmp_path / "fresh.qcow2", 4 * M, cluster_size=4 * K, backing="base.raw",
                   backing_fmt="raw")  # (4k clusters: a span is 2 MiB, two spans)
    img = Qcow2Image.open(str(fresh))
    try:
        table = img.extent_table()
        assert table is not None
        span = 512
        img.plane.loose_cap = span + 10
        await img.read(0, bytearray(4096))
        assert len(table) == span
        await img.read(2 * M, bytearray(4096))  # a second span: over the bound
        assert len(table) == span and published(table, 0, 4 * K) == "-"
        assert published(table, span, 4 * K) == "ro"
        await img.read(0, bytearray(4096))
        assert published(table, 0, 4 * K) == "ro"
    finally:
        await img.close()


async def test_held_backing_extent_delays_copy_on_write(tmp_path: Path, ring: Ring) -> None:
    top = chain1(tmp_path, "qcow2")
    img = Qcow2Image.open(str(top))
    try:
        table = img.extent_table()
        assert table is not None
        await img.read(0, bytearray(4096))
        assert published(table, 1) == "ro"
        events, after = await _held_then_released(img, 1, img.write(64 * K, b"c" * 4096),
                                                  write=False)
        assert events == ["released", "changed"] and after
        assert published(table, 1) == "rw"
        pieces = table.lookup(64 * K, 64 * K, write=False)
        assert pieces is not None and pieces[0][0] == img.file.fd
        assert piece_bytes(pieces)[:4096] == b"c" * 4096
    finally:
        await img.close()


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("planes", [0, 1])
async def test_random_io_through_a_chain_with_the_data_plane(chain: str, planes: int,
                                                             tmp_path: Path,
                                                             ring: Ring) -> None:
    """Reads the table covers are served from the backing files, writes
    over them copy up in Python, with or without C allocating; the image
    ends as QEMU reads the same operations, the backing files untouched."""
    top = build(chain, tmp_path)
    backing = {p: read_file(p) for p in tmp_path.iterdir()
               if p != top and p.suffix in (".qcow2", ".raw")}
    case = new_case(top, tmp_path / "mirror.raw")
    rng = random.Random(f"through-{chain}-{planes}")
    spots = hot_spots(case.size, case.cs, extra=[M, 4 * M, 5 * M])
    img = Qcow2Image.open(str(top), direct=False)  # the stand-in's I/O is buffered
    try:
        dp = DataPlaneStandIn(img, rng, c_alloc=bool(planes))
        await read_matches_mirror(case, dp, chain)  # (publishes through the chain)
        assert through_backing(img, dp.table) > 0
        served = dp.served
        for _ in range(3):  # (the writes copy up most of the small disk)
            await random_io(case, dp, rng, batches=8, per_batch=24, spots=spots)
            await read_matches_mirror(case, dp, chain)
        assert served > 0 and dp.served > served
        assert not planes or dp.copied > 0, "no copy-on-write was C's"
    finally:
        await img.close()
    await verify(case, f"random I/O through the {chain} chain")
    for p, content in backing.items():
        assert read_file(p) == content, f"backing file {p.name} was modified"


def through_backing(img: Qcow2Image, table: ExtentTable) -> int:
    """How many clusters are published in a file of the chain below."""
    below = set()
    b = img.backing
    while b is not None:
        below.add(b.file.fd)
        b = getattr(b, "backing", None)
    cs = img.cluster_size
    n = 0
    for vc in range(-(-img.size // cs)):
        pieces = table.lookup(vc * cs, min(cs, img.size - vc * cs), write=False)
        n += bool(pieces) and pieces[0][0] in below  # type: ignore[index]
    return n


def compressed_chain(d: Path, compression: str = "zlib") -> Path:
    """top (64k clusters) over a qcow2 base whose first 2 MiB (32 clusters,
    each its own pattern) are compressed and the rest plain."""
    src = d / "pattern"
    src.write_bytes(mixed_content(256 * K, seed=43))
    base = create(d / "base.qcow2", 4 * M, compression_type=compression)
    qemu_io(base, *(f"write -c -P {vc + 1} {vc * 64 * K} 64k" for vc in range(32)),
            f"write -s {src} {2 * M} {2 * M}")
    assert check_clean(base).get("compressed-clusters") == 32
    return create(d / "top.qcow2", None, backing="base.qcow2")


@pytest.mark.parametrize("compression", ["zlib", "zstd"])
async def test_compressed_clusters_of_the_base_are_published_for_c_to_inflate(
        tmp_path: Path, ring: Ring, compression: str) -> None:
    """A read through the chain publishes each compressed cluster of the base
    as ZIP, its compressed bytes' place, before Python ever inflated it, and
    those bytes inflate to the cluster's; a write to one is the engine's
    copy-on-write, after which the cluster is the top's own data."""
    top = compressed_chain(tmp_path, compression)
    want = read_file(to_raw(top, tmp_path / "want.raw"))
    img = Qcow2Image.open(str(top))
    try:
        table = img.extent_table()
        assert table is not None
        cs = img.cluster_size
        await img.read(40 * cs, bytearray(4096))  # (a plain one: publishes the L2 span)
        assert [published(table, vc) for vc in range(32)] == ["zip"] * 32
        assert not img.backing.zc.slots, "inflated in Python"  # type: ignore[union-attr]
        for vc in range(32):
            for off, n in ((0, cs), (4096, 4096), (cs - 512, 512)):
                got = table.lookup(vc * cs + off, n, write=False)
                assert got is not None
                assert piece_bytes(got) == want[vc * cs + off:vc * cs + off + n], (vc, off)
        assert published(table, 40) == "ro"  # (plain clusters: the base's own)
        await img.write(5 * cs + 100, b"\x99" * 100)
        assert published(table, 5) in ("rw", "-")
        back = bytearray(cs)
        await img.read(5 * cs, back)
        assert back == want[5 * cs:5 * cs + 100] + b"\x99" * 100 + want[5 * cs + 200:6 * cs]
    finally:
        await img.close()
    assert check_clean(top)


async def test_a_full_cache_of_decompressed_clusters_empties_safely(
        tmp_path: Path, ring: Ring, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of 4 clusters under 32 compressed ones: each read of a fifth
    empties it, taking back the top's extents in it first; a held extent in
    it keeps the emptying waiting, and every cluster published at any time
    holds its own bytes, never a slot's next tenant."""
    monkeypatch.setattr(Qcow2Image, "ZCACHE_BYTES", 4 * 64 * K)
    top = compressed_chain(tmp_path)
    want = read_file(to_raw(top, tmp_path / "want.raw"))
    img = Qcow2Image.open(str(top))
    img.plane.zip_ok = False  # (a zero-copy mode: C cannot inflate, the cache serves)
    try:
        table = img.extent_table()
        assert table is not None
        zc = img.backing.zc
        assert zc is not None and zc.nslots == 4
        cs = img.cluster_size
        for vc in range(32):
            await img.read(vc * cs, bytearray(4096))
            cached = [c for c in range(32) if published(table, c) == "ro"]
            assert 1 <= len(cached) <= 4 and vc in cached, (vc, cached)
            for c in cached:
                got = table.lookup(c * cs, cs, write=False)
                assert got is not None and got[0][0] == zc.fd
                assert piece_bytes(got) == want[c * cs:(c + 1) * cs], f"cluster {c}"
        # plain clusters of the base are published from the base file
        await img.read(3 * M, bytearray(4096))
        assert published(table, 48) == "ro"
        # a request C holds on a cached cluster delays the emptying
        held = table.acquire(31 * cs, 4096, write=False)
        assert held is not None and held[0][0][0] == zc.fd
        reads = [asyncio.create_task(img.read(vc * cs, bytearray(4096)))
                 for vc in range(27, 32) if published(table, vc) == "-"]
        await asyncio.sleep(0.01)
        assert reads and not any(r.done() for r in reads), "the cache emptied under a held slot"
        table.release(held[1])
        await asyncio.wait_for(asyncio.gather(*reads), 5)
    finally:
        await img.close()


async def c_allocating(img: Qcow2Image, seed: str) -> DataPlaneStandIn:
    """A stand-in data plane allocating in C over ``img``, an overlay whose
    first cluster is then written (its L2 table made, private: C may
    allocate in it) and whose pool is filled, as C's notification has it."""
    dp = DataPlaneStandIn(img, random.Random(seed), c_alloc=True)
    await img.write(0, b"t" * 4096)
    img.service()
    if img.pools.filling is not None:
        await img.pools.filling
    return dp


async def test_zeros_of_the_chain_are_allocated_by_c(tmp_path: Path, ring: Ring) -> None:
    """Where the chain reads as zeros (a qcow2 base's zeroed or never
    written clusters) and C may allocate in the overlay's table, a first
    write takes a pool cluster in C: the rest of it reads as zeros, as the
    chain does. Data of the base stays read-only: its first writes copy up
    in Python."""
    top = chain1(tmp_path, "qcow2")  # base: data in [0, 3M) but zeros at [1M, 1M+128k)
    img = Qcow2Image.open(str(top), direct=False)
    try:
        dp = await c_allocating(img, "zeros")
        await img.read(M, bytearray(4096))
        cs = img.cluster_size
        assert [published(dp.table, vc) for vc in (16, 17, 18, 48, 63)] == \
            ["zero", "zero", "ro", "zero", "zero"]
        assert dp.table.lookup(16 * cs, 4096, write=True) is None  # (no slot: a miss)
        for off in (M + 8 * K, 3 * M + 512, 2 * M):
            await dp.write(off, b"w" * 1024)
        # the zero clusters (the stand-in fails or drops one in 50 after or
        # before writing); 2M is base data: Python's copy-up
        stats = dp.table.stats()
        assert dp.allocated + stats["failed"] + stats["unused"] == 2, stats
        got = bytearray(2 * cs)
        await dp.read(M, got)
        assert got == bytes(8 * K) + b"w" * 1024 + bytes(2 * cs - 9 * K)
    finally:
        await img.close()
    check_clean(top)


async def test_copy_on_write_of_backing_data_in_c(tmp_path: Path, ring: Ring) -> None:
    """Where C may allocate in the overlay's table, backing data is published
    COW: a first write there takes a pool cluster, copies the rest of the
    cluster from the backing file around the write, and records it; the
    image then reads the backing bytes around the write, as QEMU does."""
    top = chain1(tmp_path, "raw")
    base = read_file(tmp_path / "base.raw")
    img = Qcow2Image.open(str(top), direct=False)
    try:
        dp = await c_allocating(img, "cow")
        cs = img.cluster_size
        await img.read(5 * cs, bytearray(4096))  # (through the chain: publishes the span)
        assert dp.table.lookup(5 * cs, 4096, write=True) is None  # (no slot: the target's)
        writes = [(5 * cs + 512, 1024), (6 * cs, cs), (7 * cs + cs - 4096, 4096 + 512)]
        for off, n in writes:
            await dp.write(off, b"w" * n)
        stats = dp.table.stats()
        # clusters 5, 6, 7 and 8 taken by "C" (the stand-in fails after, or
        # drops before writing, one request in 50: Python then serves it)
        assert stats["done"] + stats["failed"] + stats["unused"] == 4, stats
        assert stats["done"] >= 2 and dp.copied >= 2  # (5's head and tail; 6 whole)
        img.pools.drain()
        got = bytearray(5 * cs)
        await img.read(5 * cs, got)
    finally:
        await img.close()
    want = bytearray(base[5 * cs:10 * cs])
    for off, n in writes:
        want[off - 5 * cs:off - 5 * cs + n] = b"w" * n
    assert got == want
    check_clean(top)
    qemu_raw = read_file(to_raw(top, tmp_path / "after.raw"))
    assert qemu_raw[5 * cs:10 * cs] == want


async def test_copy_on_write_of_subclusters_in_c(tmp_path: Path, ring: Ring) -> None:
    """On an extended-L2 overlay a first write in C copies only the rest of
    the subclusters it touches (2 KiB each at 64 KiB clusters), and the
    engine applies the record as a cluster whose other subclusters still
    show the backing file, as QEMU writes it. The cluster stays C's (SUB):
    later writes to its other subclusters copy the rest of those into it,
    reads take each subcluster from where it is, and a write that makes the
    last subclusters data leaves a normal cluster."""
    chain1(tmp_path, "raw")
    top = create(tmp_path / "ext.qcow2", 6 * M, backing="base.raw", backing_fmt="raw",
                 extended_l2=True)
    base = read_file(tmp_path / "base.raw")
    img = Qcow2Image.open(str(top), direct=False)
    try:
        dp = await c_allocating(img, "sub")
        cs, sub = img.cluster_size, img.cluster_size // 32
        await img.read(5 * cs, bytearray(4096))  # (through the chain: publishes the span)
        writes = [(5 * cs + sub + 512, 1024), (6 * cs + 4 * sub, 2 * sub),
                  (7 * cs + cs - sub, 2 * sub)]
        for off, n in writes:
            await dp.write(off, b"w" * n)
        stats = dp.table.stats()
        assert stats["done"] + stats["failed"] + stats["unused"] == 4, stats
        assert stats["done"] >= 2 and dp.copied >= 2  # (5: the rest of subcluster 1)
        img.pools.drain()
        t = img.l2.table_of(5)
        assert t is not None and t.subs is not None
        words = [t.subs[vc] for vc in (5, 6)]
        # more of clusters 5 and 6: the subclusters C has not written yet
        # (in part: C copies the rest of them into the cluster the granule has)
        served = dp.served
        more = [(5 * cs + 3 * sub + 100, 3000), (6 * cs, 5 * sub),
                (6 * cs + 6 * sub + 100, cs - 6 * sub - 100)]
        for off, n in more:
            await dp.write(off, b"m" * n)
        assert dp.served - served >= 2, "later writes of a cluster C copied into went to Python"
        got, served = bytearray(2 * cs), dp.served
        await dp.read(5 * cs, got)  # (SUB and MAP granules: C's)
        assert dp.served == served + 1
        got += bytearray(3 * cs)
        await img.read(7 * cs, memoryview(got)[2 * cs:])
        img.pools.drain()
        whole = t.subs[6] if t.entries[6] & PARTIAL else SUB_ALLOC
    finally:
        await img.close()
    want = bytearray(base[5 * cs:10 * cs])
    for (off, n), body in [*((w, b"w") for w in writes), *((w, b"m") for w in more)]:
        want[off - 5 * cs:off - 5 * cs + n] = body * n
    assert got == want
    assert words[0] in (0b10, 0) and words[1] in (0b11 << 4, 0), [bin(w) for w in words]
    assert whole == SUB_ALLOC or words[1] == 0, bin(whole)  # (6: every subcluster written)
    check_clean(top)
    assert read_file(to_raw(top, tmp_path / "after.raw"))[5 * cs:10 * cs] == want


async def test_a_cluster_with_subclusters_in_two_places_is_published_for_c(
        tmp_path: Path, ring: Ring) -> None:
    """A cluster QEMU wrote in part on an extended-L2 overlay (its other
    subclusters show the base) is published as SUB where C may allocate:
    reads in C take each subcluster from where it is, and a write to one of
    the others copies the rest of it into the cluster and is recorded."""
    top = chain1(tmp_path, "raw", extended_l2=True)  # (cluster 32: subcluster 0 written)
    want = bytearray(read_file(to_raw(top, tmp_path / "want.raw")))
    img = Qcow2Image.open(str(top), direct=False)
    try:
        dp = await c_allocating(img, "sub")
        want[:4096] = b"t" * 4096
        cs, sub, vc = img.cluster_size, img.cluster_size // 32, 32
        await img.read(vc * cs, bytearray(512))  # (caches the table: publishes it)
        pieces = dp.table.lookup(vc * cs, cs, write=False)
        assert pieces is not None and len(pieces) == 2, pieces
        assert piece_bytes(pieces) == want[vc * cs:(vc + 1) * cs]
        served = dp.served
        await dp.write(vc * cs + 5 * sub + 512, b"s" * 1024)
        assert dp.served == served + 1 and dp.table.stats()["grown"] == 1
        want[vc * cs + 5 * sub + 512:vc * cs + 5 * sub + 1536] = b"s" * 1024
        got = bytearray(cs)
        await dp.read(vc * cs, got)
        assert dp.served == served + 2
        img.pools.drain()
        t = img.l2.table_of(vc)
        assert t is not None and t.subs is not None and t.subs[vc & img.l2_mask] == 0b100001
    finally:
        await img.close()
    assert got == want[vc * cs:(vc + 1) * cs]
    check_clean(top)
    assert read_file(to_raw(top, tmp_path / "after.raw")) == want


async def test_a_first_write_publishes_the_span_for_copy_on_write(tmp_path: Path,
                                                                  ring: Ring) -> None:
    """A guest that only writes: its first write to a fresh overlay makes
    the L2 table, and the rest of the table's span is published COW from
    there, with no read through the chain."""
    chain1(tmp_path, "raw")
    fresh = create(tmp_path / "fresh.qcow2", None, backing="base.raw", backing_fmt="raw")
    img = Qcow2Image.open(str(fresh), direct=False)
    try:
        dp = await c_allocating(img, "write-only")
        cs = img.cluster_size
        assert [published(dp.table, vc) for vc in (0, 1, 9, 63)] == ["rw", "ro", "ro", "ro"]
        held = dp.table.acquire(9 * cs + 512, 512, write=True, slot=dp.slot)
        assert held is not None and len(held[1].copies) == 2
        dp.table.release(held[1], UNUSED)
    finally:
        await img.close()
