"""The qcow2 engine writes images QEMU agrees with (host only: no ublk, no kernel).

Seeded random writes, write_zeroes (unmap True and False) and discards go
through the engine, many at once (asyncio.gather) around the same clusters and
L2 tables, with reads of untouched ranges in flight among them. Every
operation is mirrored into a raw file with plain os.pwrite. Within one batch
the operations never overlap (their order is not defined), but they share
clusters and L2 tables. After ``await img.close()``:

- ``qemu-img check``: exit 0, no leaks, no corruptions;
- ``qemu-img compare -f qcow2 -F raw image mirror``: identical;
- ``qemu-img map``: every range it reports without data reads as zeros in
  the mirror; a cluster only zeroed with unmap has no data (see
  ``Case.zero_only`` for exactly which);
- the engine, reopening the image, reads back the mirror.

What a discard reads back (the mirror's rule):

- without a backing file: zeros, the whole discarded range (also the parts
  of partial clusters: the engine's contract; QEMU itself leaves partial
  clusters of a discard alone);
- with a backing file, compat 1.1: zeros, the whole range (QEMU makes whole
  clusters zero clusters: ``qcow2_cluster_discard`` with full_discard=false
  writes QCOW_OFLAG_ZERO when there is a backing file and qcow_version >= 3);
- with a backing file, compat 0.10 (no zero flag): QEMU clears the L2 entry,
  so the backing file's bytes show through again. The engine may do that or
  read zeros: each discarded sector must read as zeros or as the backing
  chain's bytes, never as what was there before; the mirror then takes what
  the engine reads.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioublk.io.hostfile import HostFile
from aioublk.ring import Ring
from tests.support.qcow2_util import (
    CHUNKS_B,
    SECTOR,
    K,
    M,
    Spec,
    assert_same,
    check_clean,
    check_consistent,
    compare_identical,
    create,
    data_clusters,
    info,
    mixed_content,
    opened,
    qemu_img,
    qemu_io,
    qemu_map,
    read_all,
    read_file,
    to_raw,
)

pytestmark = pytest.mark.asyncio


# -- operations and the raw mirror -------------------------------------------------------


@dataclass(frozen=True)
class Op:
    kind: str  # write | zero | zero-unmap | discard | read | flush
    off: int
    length: int
    data: bytes = b""

    @property
    def end(self) -> int:
        return self.off + self.length

    def __repr__(self) -> str:
        return f"{self.kind}({self.off:#x}, {self.length:#x})"


@dataclass
class Case:
    """An image under test and its mirror."""

    path: Path
    mirror: Path
    size: int
    cs: int
    v3: bool
    #: clusters with no data in the image at the start (top layer)
    unallocated: set[int]
    #: compat 0.10 with a backing file: the chain below, as raw bytes (a
    #: discarded sector may read back as this instead of zeros)
    below: bytes | None = None
    log: list[str] = field(default_factory=list)
    #: clusters that must have no data in the end: since a zero-unmap request
    #: covered them whole (or, without a backing file, since the start, when
    #: they held nothing), nothing but zero-unmap requests and discards touched
    #: them. QEMU keeps such clusters without data (zero flag or unallocated),
    #: also through partial zero-unmap requests and with compat 0.10. Not
    #: tracked for compat 0.10 with a backing file (a zeroed cluster then needs
    #: data).
    zero_only: set[int] = field(default_factory=set)


def new_case(path: Path, mirror: Path, below: bytes | None = None) -> Case:
    """The mirror starts as ``qemu-img convert -O raw`` of the image."""
    i = info(path)
    cs, size = i["cluster-size"], i["virtual-size"]
    to_raw(path, mirror)
    allocated: set[int] = set()
    for e in qemu_map(path):
        if e["depth"] == 0 and (e["data"] or not e["zero"]):
            allocated.update(range(e["start"] // cs, (e["start"] + e["length"] - 1) // cs + 1))
    v3 = i["format-specific"]["data"]["compat"] != "0.10"
    unallocated = set(range(-(-size // cs))) - allocated
    case = Case(path, mirror, size, cs, v3, unallocated, below)
    if "backing-filename" not in i:
        case.zero_only = set(unallocated)
    return case


def mirror_apply(case: Case, op: Op) -> None:
    fd = os.open(case.mirror, os.O_WRONLY)
    try:
        if op.kind == "write":
            os.pwrite(fd, op.data, op.off)
        elif op.kind in ("zero", "zero-unmap", "discard"):
            os.pwrite(fd, bytes(op.length), op.off)
    finally:
        os.close(fd)
    if op.kind in ("read", "flush"):
        return
    first, last = op.off // case.cs, (op.end - 1) // case.cs
    for c in range(first, last + 1):
        whole = op.off <= c * case.cs and op.end >= min((c + 1) * case.cs, case.size)
        if op.kind == "zero-unmap" and whole and (case.v3 or case.below is None):
            case.zero_only.add(c)
        elif op.kind not in ("zero-unmap", "discard"):
            case.zero_only.discard(c)


async def run_op(img: Any, op: Op, want: bytes) -> None:
    if op.kind == "write":
        await img.write(op.off, op.data)
    elif op.kind == "zero":
        await img.write_zeroes(op.off, op.length, unmap=False)
    elif op.kind == "zero-unmap":
        await img.write_zeroes(op.off, op.length, unmap=True)
    elif op.kind == "discard":
        await img.discard(op.off, op.length)
    elif op.kind == "flush":
        await img.flush()
    else:
        buf = bytearray(b"\xa5") * op.length
        await img.read(op.off, buf)
        assert_same(buf, want[op.off:op.end],
                    f"read {op} while writes to other ranges were in flight", base=op.off)


async def run_batch(case: Case, img: Any, batch: Sequence[Op]) -> None:
    """Run non-overlapping operations all at once, then mirror them. Discards
    on compat 0.10 images with a backing file are run on their own and the
    mirror takes what the engine then reads, if that is legal (see top)."""
    case.log.append(" ".join(map(repr, batch)))
    want = read_file(case.mirror) if any(op.kind == "read" for op in batch) else b""
    if case.below is not None:
        later = [op for op in batch if op.kind == "discard"]
        batch = [op for op in batch if op.kind != "discard"]
    else:
        later = []
    try:
        await asyncio.gather(*(run_op(img, op, want) for op in batch))
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- operation log ---\n{oplog(case)}") from None
    for op in batch:
        mirror_apply(case, op)
    for op in later:
        await discard_over_backing_v2(case, img, op)


async def discard_over_backing_v2(case: Case, img: Any, op: Op) -> None:
    assert case.below is not None
    await img.discard(op.off, op.length)
    got = bytearray(b"\xa5") * op.length
    await img.read(op.off, got)
    below = case.below[op.off:op.end].ljust(op.length, b"\0")
    zero = bytes(SECTOR)
    for s in range(0, op.length, SECTOR):
        sector = got[s:s + SECTOR]
        assert sector == zero or sector == below[s:s + SECTOR], (
            f"discard {op} on a compat 0.10 image with a backing file: sector at "
            f"{op.off + s:#x} reads {bytes(sector[:16]).hex(' ')}..., neither zeros nor the "
            f"backing file's {below[s:s + 16].hex(' ')}...")
    fd = os.open(case.mirror, os.O_WRONLY)
    try:
        os.pwrite(fd, got, op.off)
    finally:
        os.close(fd)


# -- random batches ----------------------------------------------------------------------


def op_length(rng: random.Random, cs: int) -> int:
    """512 B to a few clusters (a few 512 B clusters being little, sometimes up
    to 64 KiB so that 512 B cluster images see requests over several L2 tables)."""
    r = rng.random()
    if r < 0.45:
        sectors = rng.randrange(1, 9)
    elif r < 0.8:
        sectors = rng.randrange(1, 2 * cs // SECTOR + 1)
    elif r < 0.9:
        sectors = rng.randrange(1, 4 * cs // SECTOR + 1)
    else:
        sectors = rng.randrange(1, max(4 * cs, 64 * K) // SECTOR + 1)
    return sectors * SECTOR


def hot_spots(size: int, cs: int, extra: Sequence[int] = ()) -> list[int]:
    """Where batches gather: cluster boundaries near the start, L2-table
    boundaries, the end of the image, and whatever the test adds."""
    l2 = cs * cs // 8
    spots = [k * cs for k in range(min(40, size // cs))]
    spots += [k * l2 for k in range(1, size // l2 + 1)]
    spots += [size, *extra]
    return sorted({s for s in spots if 0 <= s <= size})


def random_batch(rng: random.Random, case: Case, n: int, kinds: Sequence[str],
                 weights: Sequence[int], spots: Sequence[int]) -> list[Op]:
    """Up to ``n`` non-overlapping operations, most of them around one hot spot
    (within one or a few clusters: same-cluster and same-L2 races), some anywhere."""
    size, cs = case.size, case.cs
    hot = rng.choice(spots)
    window = rng.choice((cs, 2 * cs, 8 * cs, 64 * K))
    taken: list[Op] = []
    for _ in range(n * 4):
        if len(taken) >= n:
            break
        kind = rng.choices(kinds, weights)[0]
        length = min(op_length(rng, cs), size)
        if rng.random() < 0.8:
            lo = max(0, hot - window)
            hi = min(size - length, hot + window)
            if hi < lo:
                continue
            off = rng.randrange(lo // SECTOR, hi // SECTOR + 1) * SECTOR
        else:
            off = rng.randrange(0, (size - length) // SECTOR + 1) * SECTOR
        if any(off < t.end and t.off < off + length for t in taken):
            continue
        data = rng.randbytes(length) if kind == "write" else b""
        taken.append(Op(kind, off, length, data))
    if rng.random() < 0.2:
        taken.append(Op("flush", 0, 0))
    return taken


ALL_KINDS = ("write", "zero", "zero-unmap", "discard", "read")
ALL_WEIGHTS = (5, 2, 2, 2, 1)


async def random_io(case: Case, img: Any, rng: random.Random, *, batches: int, per_batch: int,
                    spots: Sequence[int]) -> None:
    """A first batch of writes only (so there is data to zero and discard), then
    mixed batches."""
    await run_batch(case, img, random_batch(rng, case, per_batch, ("write",), (1,), spots))
    for _ in range(batches - 1):
        await run_batch(case, img, random_batch(rng, case, per_batch, ALL_KINDS, ALL_WEIGHTS,
                                                spots))


def scale(cs: int) -> tuple[int, int]:
    """(batches, operations per batch): fewer for 2 MiB clusters, whose
    operations are megabytes."""
    return (4, 12) if cs >= 2 * M else (8, 24)


# -- after close -------------------------------------------------------------------------


async def verify(case: Case, what: str) -> None:
    """The image is closed: QEMU finds it sound and equal to the mirror, its map
    is consistent with what was written, and the engine reads the mirror."""
    where = f"{what} (operations: see the log below)"
    try:
        check_clean(case.path)
        compare_identical(case.path, case.mirror)
        want = read_file(case.mirror)
        extents = qemu_map(case.path)
        for e in extents:
            if not e["data"]:
                seg = memoryview(want)[e["start"]:e["start"] + e["length"]]
                assert seg == bytes(len(seg)), (
                    f"qemu-img map says no data at [{e['start']:#x}, +{e['length']:#x}) but the "
                    f"mirror has data there: {e}")
        wrong = sorted(case.zero_only & data_clusters(case.path, case.cs))
        assert not wrong, (
            f"{len(wrong)} clusters that were only zeroed with unmap=True (since a request "
            f"covered them whole, or since the start when they held nothing and there is no "
            f"backing file) have data (qemu-img map): {[hex(c * case.cs) for c in wrong[:10]]}")
        async with opened(case.path, read_only=True) as img:
            assert img.size == case.size
            assert_same(await read_all(img, chunks=CHUNKS_B, concurrency=8), want,
                        f"{what}: the engine reopening the image")
    except AssertionError as e:
        raise AssertionError(f"{where}\n{e}\n--- operation log ---\n{oplog(case)}") from None


async def read_matches_mirror(case: Case, img: Any, what: str) -> None:
    try:
        assert_same(await read_all(img, concurrency=16), read_file(case.mirror),
                    f"{what}: reading back before close")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- operation log ---\n{oplog(case)}") from None


def oplog(case: Case) -> str:
    """The operations so far, one batch a line (ops within a batch ran at once)."""
    log = "\n".join(f"  batch {i}: {b}" for i, b in enumerate(case.log))
    return log if len(log) < 20000 else "[...]\n" + log[-20000:]


# -- empty images -----------------------------------------------------------------------------


EMPTY = {
    "c512-rb64-v3": Spec(512, 64, "1.1", 4 * M),
    "c512-rb16-v2": Spec(512, 16, "0.10", 4 * M),
    "c4k-rb1-v3": Spec(4 * K, 1, "1.1", 6 * M + 1536),
    "c64k-rb1-v3": Spec(64 * K, 1, "1.1", 16 * M + 512),
    "c64k-rb16-v2": Spec(64 * K, 16, "0.10", 16 * M),
    "c64k-rb64-v3": Spec(64 * K, 64, "1.1", 16 * M),
    "c2m-rb16-v3": Spec(2 * M, 16, "1.1", 24 * M),
    "c2m-rb16-v2": Spec(2 * M, 16, "0.10", 24 * M + 1024),
}


@pytest.mark.parametrize("name", list(EMPTY))
async def test_random_io_on_empty_image(name: str, tmp_path: Path, ring: Ring) -> None:
    """Random concurrent I/O on a new image, close, check; reopen, more, close, check.
    On compat 0.10 (no zero flag) zeroes and discards must still read back zeros."""
    spec = EMPTY[name]
    path = create(tmp_path / "img.qcow2", spec.size, cluster_size=spec.cluster,
                  refcount_bits=spec.refcount_bits, compat=spec.compat)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"empty-{name}")
    spots = hot_spots(spec.size, spec.cluster)
    batches, per = scale(spec.cluster)
    async with opened(path) as img:
        await random_io(case, img, rng, batches=batches, per_batch=per, spots=spots)
        await read_matches_mirror(case, img, name)
    await verify(case, f"{name}, first session")
    async with opened(path) as img:
        await random_io(case, img, rng, batches=batches // 2, per_batch=per, spots=spots)
        await read_matches_mirror(case, img, name)
    await verify(case, f"{name}, after reopening")


async def test_zeroes_over_data_read_back_zero_compat_010(tmp_path: Path, ring: Ring) -> None:
    """compat 0.10 has no zero flag: every kind of zeroing over data (whole
    clusters, partial, with and without unmap, discard) must still read zeros."""
    cs = 64 * K
    path = create(tmp_path / "img.qcow2", 4 * M, compat="0.10")
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(5)
    async with opened(path) as img:
        await run_batch(case, img, [Op("write", 0, 2 * M, rng.randbytes(2 * M))])
        await run_batch(case, img, [
            Op("zero", 0, cs), Op("zero-unmap", cs, cs), Op("discard", 2 * cs, cs),
            Op("zero", 3 * cs + 512, 1024), Op("zero-unmap", 4 * cs + 512, cs),
            Op("discard", 6 * cs - 512, cs + 1024), Op("zero-unmap", 8 * cs, 8 * cs),
            Op("discard", 16 * cs, 4 * cs)])
        await read_matches_mirror(case, img, "zeroes over data, compat 0.10")
    await verify(case, "zeroes over data, compat 0.10")


@pytest.mark.parametrize("compat", ["1.1", "0.10"], ids=["v3", "v2"])
async def test_random_io_on_preallocated_image(compat: str, tmp_path: Path, ring: Ring) -> None:
    """``preallocation=metadata``: every cluster is allocated before the first
    write (zero-flagged with compat 1.1); writes land in those clusters."""
    path = tmp_path / "img.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o",
             f"preallocation=metadata,compat={compat},cluster_size=4k", path, 6 * M)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"prealloc-{compat}")
    async with opened(path) as img:
        await random_io(case, img, rng, batches=6, per_batch=24,
                        spots=hot_spots(case.size, case.cs))
        await read_matches_mirror(case, img, "preallocated")
    await verify(case, f"preallocated image, compat {compat}")


@pytest.mark.parametrize("cluster", [64 * K, 2 * M], ids=["c64k", "c2m"])
@pytest.mark.parametrize("unmap", [False, True], ids=["zero", "zero-unmap"])
async def test_zeroes_across_one_cluster_boundary(cluster: int, unmap: bool, tmp_path: Path,
                                                  ring: Ring) -> None:
    """A zero request with no whole cluster in it, crossing one boundary: the
    tail of a cluster that reads zeros and the head of one with data (and the
    other way round). Both parts are zeroed."""
    path = create(tmp_path / "img.qcow2", 8 * cluster, cluster_size=cluster)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(71)
    kind = "zero-unmap" if unmap else "zero"
    async with opened(path) as img:
        await run_batch(case, img, [Op("write", cluster + 0x4200, 0x400, rng.randbytes(0x400)),
                                    Op("write", 4 * cluster - 0x2000, 0x400,
                                       rng.randbytes(0x400))])
        await run_batch(case, img, [Op(kind, cluster - 0x1000, 0x6000)])
        await run_batch(case, img, [Op(kind, 4 * cluster - 0x3000, 0x4000)])
        await read_matches_mirror(case, img, "zeroes across one boundary")
    await verify(case, "zeroes across one boundary")


@pytest.mark.parametrize("cluster", [64 * K, 2 * M], ids=["c64k", "c2m"])
async def test_new_cluster_in_reused_host_space_is_clean(cluster: int, tmp_path: Path,
                                                         ring: Ring) -> None:
    """Host clusters freed by a discard are reused (after reopening) for new
    clusters: what a partial write leaves out of the new cluster reads zeros,
    not what the host cluster held before, also when that is more than 1 MiB."""
    path = create(tmp_path / "img.qcow2", 16 * cluster, cluster_size=cluster)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(72)
    async with opened(path) as img:
        await run_batch(case, img, [Op("write", 2 * cluster, 3 * cluster,
                                       rng.randbytes(3 * cluster))])
        await run_batch(case, img, [Op("discard", 2 * cluster, 3 * cluster)])
    async with opened(path) as img:
        await run_batch(case, img, [Op("write", 8 * cluster + 512, 512, rng.randbytes(512)),
                                    Op("write", 10 * cluster - 1024, 2048, rng.randbytes(2048)),
                                    Op("write", 13 * cluster - 512, 512, rng.randbytes(512))])
        await read_matches_mirror(case, img, "new clusters in reused host space")
    await verify(case, "new clusters in reused host space")


# -- compressed clusters -----------------------------------------------------------------------


@pytest.mark.parametrize("ctype,cluster", [("zlib", 64 * K), ("zstd", 64 * K), ("zstd", 4 * K)],
                         ids=["zlib-c64k", "zstd-c64k", "zstd-c4k"])
async def test_random_io_over_compressed_clusters(ctype: str, cluster: int, tmp_path: Path,
                                                  ring: Ring) -> None:
    """An image from ``qemu-img convert -c``: partial writes over compressed
    clusters (decompress, merge, write a plain cluster), zeroes and discards
    of compressed clusters (their host sectors are freed: check finds no leak)."""
    size = 6 * M
    src = tmp_path / "src.raw"
    src.write_bytes(mixed_content(size, seed=11))
    path = tmp_path / "img.qcow2"
    qemu_img("convert", "-c", "-O", "qcow2", "-o",
             f"compression_type={ctype},cluster_size={cluster}", src, path)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"compressed-{ctype}-{cluster}")
    spots = hot_spots(size, cluster, extra=[k * cluster for k in range(0, size // cluster, 7)])
    async with opened(path) as img:
        # one sector into each of the first 32 clusters, all at once
        await run_batch(case, img, [Op("write", k * cluster + 512 * (k % 3), 512,
                                       rng.randbytes(512)) for k in range(32)])
        await random_io(case, img, rng, batches=8, per_batch=24, spots=spots)
        await read_matches_mirror(case, img, f"over {ctype} clusters")
    await verify(case, f"writes over {ctype}-compressed clusters")


# -- backing chains ------------------------------------------------------------------------------


def chain2(d: Path, compat: str) -> tuple[Path, bytes]:
    """top (4k clusters) over base (64k clusters, data, zeroes, compressed), a
    relative backing name. Returns the top and the base's content."""
    base = create(d / "base.qcow2", 8 * M, compat=compat)
    src = d / "pattern"
    src.write_bytes(mixed_content(600 * K, seed=21))
    qemu_io(base, f"write -s {src} 0 {3 * M}", f"write -c -s {src} {4 * M} {M}",
            f"write -z {M} {64 * K}", f"write -P 0x42 {6 * M - 512} {M}")
    top = create(d / "top.qcow2", 8 * M, cluster_size=4 * K, compat=compat,
                 backing="base.qcow2")
    return top, read_file(to_raw(base, d / "base.raw"))


def chain3(d: Path) -> tuple[Path, bytes]:
    """top (64k, 12 MiB) -> mid (512 B clusters, 8 MiB, 64-bit refcounts) ->
    base.raw (5 MiB + 700 bytes): the top is larger than its backing file,
    which is larger than its own."""
    base = d / "base.raw"
    base.write_bytes(mixed_content(5 * M + 700, seed=22))
    mid = create(d / "mid.qcow2", 8 * M, cluster_size=512, refcount_bits=64,
                 backing="base.raw", backing_fmt="raw")
    qemu_io(mid, f"write -P 0x61 {M + 512} 1024", f"write -z {2 * M} {3 * K}",
            f"write -P 0x62 {5 * M - 1024} 2048", f"write -c -P 0x63 {3 * M} {2 * K}",
            f"write -P 0x64 {7 * M} {4 * K}")
    top = create(d / "top.qcow2", 12 * M, cluster_size=64 * K, refcount_bits=16,
                 backing="mid.qcow2")
    return top, read_file(to_raw(mid, d / "mid.raw"))


@pytest.mark.parametrize("chain", ["qcow2-over-qcow2-v3", "depth3-raw-base", "qcow2-over-qcow2-v2"])
async def test_random_io_over_backing_chain(chain: str, tmp_path: Path, ring: Ring) -> None:
    """Copy-on-write: a partial-cluster write keeps the backing file's bytes
    around it (the mirror starts as the whole chain's content); zeroes hide
    the backing file; reads past a smaller backing file's end are zeros,
    also after writes there. The backing files are never written."""
    if chain == "depth3-raw-base":
        top, below = chain3(tmp_path)
        extra = [5 * M, 5 * M + 512, 8 * M, 12 * M]
    else:
        top, below = chain2(tmp_path, "0.10" if chain.endswith("v2") else "1.1")
        extra = [M, 4 * M, 6 * M]
    backing = sorted(p for p in tmp_path.iterdir() if p.name != top.name)
    sums = {p: read_file(p) for p in backing if p.suffix in (".qcow2", ".raw")}
    case = new_case(top, tmp_path / "mirror.raw",
                    below=below.ljust(12 * M, b"\0") if chain.endswith("v2") else None)
    rng = random.Random(f"chain-{chain}")
    spots = hot_spots(case.size, case.cs, extra=extra)
    async with opened(top) as img:
        # partial writes into clusters whose content comes from below
        await run_batch(case, img, [Op("write", o, 1024, rng.randbytes(1024))
                                    for o in (512, 64 * K + 1536, M + 3 * K, 5 * M - 512,
                                              5 * M + 1024, 7 * M + 2048)])
        await random_io(case, img, rng, batches=8, per_batch=24, spots=spots)
        await read_matches_mirror(case, img, chain)
    await verify(case, f"writes over the {chain} chain")
    for p, content in sums.items():
        assert read_file(p) == content, f"backing file {p.name} was modified"


# -- internal snapshots --------------------------------------------------------------------------


@pytest.mark.parametrize("cluster,compat", [(4 * K, "1.1"), (64 * K, "0.10")],
                         ids=["c4k-v3", "c64k-v2"])
async def test_writes_keep_internal_snapshot(cluster: int, compat: str, tmp_path: Path,
                                             ring: Ring) -> None:
    """Clusters shared with a snapshot (refcount 2) are copied, never written in
    place; zeroing and discarding them leaves the snapshot's copy. Afterwards the
    snapshot, extracted and applied (``snapshot -a`` in a copy), is unchanged."""
    size = 8 * M
    path = create(tmp_path / "img.qcow2", size, cluster_size=cluster, compat=compat)
    src = tmp_path / "pattern"
    src.write_bytes(mixed_content(700 * K, seed=31))
    qemu_io(path, f"write -s {src} 0 {3 * M}", f"write -c -s {src} {4 * M} {512 * K}",
            f"write -P 0x55 {6 * M} {M}")
    qemu_img("snapshot", "-c", "snap", path)
    qemu_io(path, f"write -P 0x66 {cluster + 512} 1024")
    snap_raw = read_file(to_raw(path, tmp_path / "snap.raw", snapshot="snap"))
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(f"snapshot-{cluster}")
    spots = hot_spots(size, cluster, extra=[4 * M, 6 * M, 7 * M])
    async with opened(path) as img:
        await random_io(case, img, rng, batches=8, per_batch=24, spots=spots)
        await run_batch(case, img, [Op("zero-unmap", 6 * M, M // 2), Op("discard", 4 * M, 256 * K),
                                    Op("zero", 7 * M - 512, 1024)])
        await read_matches_mirror(case, img, "active layer with a snapshot")
    await verify(case, f"writes with an internal snapshot ({compat})")
    snaps = info(path)["snapshots"]
    assert [s["name"] for s in snaps] == ["snap"]
    assert_same(read_file(to_raw(path, tmp_path / "snap-after.raw", snapshot="snap")), snap_raw,
                "the snapshot (qemu-img convert -l) after the engine's writes")
    applied = tmp_path / "applied.qcow2"
    shutil.copyfile(path, applied)
    qemu_img("snapshot", "-a", "snap", applied)
    check_clean(applied)
    assert_same(read_file(to_raw(applied, tmp_path / "applied.raw")), snap_raw,
                "the image copy with the snapshot applied (qemu-img snapshot -a)")
    async with opened(applied, read_only=True) as img:
        assert_same(await read_all(img), snap_raw, "the engine reading the applied snapshot")


# -- growth of the refcount table ----------------------------------------------------------------


def refcount_table_clusters(path: Path) -> int:
    with open(path, "rb") as f:
        header = f.read(72)
    clusters: int = struct.unpack_from(">I", header, 56)[0]
    return clusters


async def test_refcount_table_grows(tmp_path: Path, ring: Ring) -> None:
    """512 B clusters with 64-bit refcounts: a refcount block covers 64 clusters
    (32 KiB of file), the first one-cluster refcount table 64 blocks (2 MiB of
    file). A few MiB written all over the disk (a data cluster and an L2 table
    per write) make the table grow, with many writes in flight."""
    size = 64 * M
    path = create(tmp_path / "img.qcow2", size, cluster_size=512, refcount_bits=64)
    before = refcount_table_clusters(path)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(41)
    ops: list[Op] = []
    slots = rng.sample(range(size // (16 * K)), 384)  # 16 KiB slots, disjoint
    for s in slots:
        n = rng.randrange(1, 33) * SECTOR
        off = s * 16 * K + rng.randrange(0, (16 * K - n) // SECTOR + 1) * SECTOR
        ops.append(Op("write", off, n, rng.randbytes(n)))
    async with opened(path) as img:
        for i in range(0, len(ops), 64):
            await run_batch(case, img, ops[i:i + 64])
        await run_batch(case, img, [Op("zero-unmap", op.off, op.length) for op in ops[::5]]
                        + [Op("discard", op.off, op.length) for op in ops[1::5]])
        await read_matches_mirror(case, img, "refcount table growth")
    after = refcount_table_clusters(path)
    assert after > before, f"refcount table {before} -> {after} clusters: did it grow?"
    await verify(case, "refcount table growth")


# -- flush in the middle, reopen, continue ------------------------------------------------


async def test_flush_midway_then_reopen_and_continue(tmp_path: Path, ring: Ring) -> None:
    """After ``flush`` the file on disk is a sound image with everything written
    so far (it may leak clusters, as after a crash, but nothing else), while
    the engine keeps it open; then more writes, close, reopen, more writes."""
    size, cs = 16 * M, 64 * K
    path = create(tmp_path / "img.qcow2", size, cluster_size=cs)
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(51)
    spots = hot_spots(size, cs)
    async with opened(path) as img:
        await random_io(case, img, rng, batches=4, per_batch=24, spots=spots)
        await img.flush()
        check_consistent(path)
        compare_identical(path, case.mirror, force_share=True)
        await random_io(case, img, rng, batches=4, per_batch=24, spots=spots)
        await img.flush()
        check_consistent(path)
        compare_identical(path, case.mirror, force_share=True)
        await random_io(case, img, rng, batches=2, per_batch=24, spots=spots)
    await verify(case, "first session (two flushes)")
    async with opened(path) as img:
        await read_matches_mirror(case, img, "reopened")
        await random_io(case, img, rng, batches=4, per_batch=24, spots=spots)
    await verify(case, "second session")


# -- an extension the engine does not keep up to date -------------------------------------


async def test_persistent_bitmap_is_invalidated_by_writes(tmp_path: Path, ring: Ring) -> None:
    """A persistent dirty bitmap (autoclear bit 0 + bitmaps extension) that
    the engine does not keep up to date is marked in use, as QEMU marks one
    it has open: QEMU then calls it inconsistent (it missed our writes) and
    keeps it, its clusters still counted, so `qemu-img check` is clean and
    `qemu-img bitmap --remove` takes it away. (Clearing the autoclear bit,
    as the spec allows, would drop the bitmap with its clusters leaked.)"""
    path = create(tmp_path / "img.qcow2", 4 * M)
    qemu_img("bitmap", "--add", path, "b0")
    qemu_io(path, f"write -P 0x11 0 {128 * K}")
    with open(path, "rb") as f:
        f.seek(88)
        assert struct.unpack(">Q", f.read(8))[0] & 1, "qemu-img bitmap --add sets autoclear bit 0"
    case = new_case(path, tmp_path / "mirror.raw")
    rng = random.Random(61)
    async with opened(path) as img:
        await run_batch(case, img, [Op("write", 64 * K + 512, 4 * K, rng.randbytes(4 * K)),
                                    Op("write", 2 * M, 512, rng.randbytes(512))])
    data = json.loads(qemu_img("info", "--output=json", path).stdout)["format-specific"]["data"]
    assert data["bitmaps"] == [{"flags": ["in-use", "auto"], "name": "b0",
                                "granularity": 65536}], data
    check_clean(path)
    compare_identical(path, case.mirror)
    qemu_img("bitmap", "--remove", path, "b0")
    check_clean(path)
    async with opened(path, read_only=True) as img:
        assert_same(await read_all(img), read_file(case.mirror), "reopened")


async def test_read_only_image_refuses_changes(tmp_path: Path, ring: Ring) -> None:
    """Opened read-only: write, write_zeroes and discard fail (OSError) and the
    file is not touched."""
    path = create(tmp_path / "img.qcow2", 4 * M)
    qemu_io(path, f"write -P 0x11 0 {128 * K}")
    before = read_file(path)
    async with opened(path, read_only=True) as img:
        with pytest.raises(OSError):
            await img.write(0, bytes(4 * K))
        with pytest.raises(OSError):
            await img.write_zeroes(0, 4 * K, unmap=True)
        with pytest.raises(OSError):
            await img.discard(0, 64 * K)
        buf = bytearray(4 * K)
        await img.read(0, buf)
        assert buf == b"\x11" * (4 * K)
    assert read_file(path) == before, "a read-only image file changed"


# -- metadata write-through ---------------------------------------------------------------


class WriteBacks:
    """Counts ``img``'s write-backs from now on (``n``)."""

    def __init__(self, img: Any) -> None:
        self.n = 0
        real = img.wb.run_locked

        async def counted() -> None:
            self.n += 1
            await real()
        img.wb.run_locked = counted


async def test_metadata_write_through_shares_write_backs(tmp_path: Path, ring: Ring) -> None:
    """``metadata_write_through``: each allocating write returns with its L2 and
    refcount changes in the file (another reader sees a consistent image with
    the data, before any flush), and concurrent requests share write-backs."""
    from aioublk.qcow2 import Qcow2Image

    path = create(tmp_path / "img.qcow2", 16 * M)
    mirror = bytearray(16 * M)
    img = Qcow2Image.open(str(path), metadata_write_through=True)
    assert img.metadata_write_through
    wbs = WriteBacks(img)
    try:
        rng = random.Random(71)
        await img.write(3 * 64 * K + 512, b"\x11" * 4 * K)
        mirror[3 * 64 * K + 512:3 * 64 * K + 512 + 4 * K] = b"\x11" * 4 * K
        assert wbs.n == 1
        qemu_img("check", "-U", path)  # exit 0: clean, while still open
        compare_identical(path, _raw(tmp_path, mirror), force_share=True)
        ops = [(s * 256 * K, rng.randbytes(rng.randrange(1, 64) * SECTOR))
               for s in rng.sample(range(64), 32)]
        await asyncio.gather(*(img.write(off, data) for off, data in ops))
        for off, data in ops:
            mirror[off:off + len(data)] = data
        assert wbs.n < 1 + len(ops) // 2, f"{wbs.n - 1} write-backs for {len(ops)} writes"
        qemu_img("check", "-U", path)  # exit 0: clean, while still open
        compare_identical(path, _raw(tmp_path, mirror), force_share=True)
        before = wbs.n
        await img.write(3 * 64 * K + 512, b"\x22" * 4 * K)  # in place: no metadata
        assert wbs.n == before
    finally:
        await img.close()


async def test_held_c_writes_are_settled_by_one_write_back(tmp_path: Path, ring: Ring) -> None:
    """Metadata write-through with C's writes held (``hold_c_writes``, a
    device with user recovery): C still allocates and writes in place, and
    ``settle_writes``, which the held writes' answers wait for, puts what
    they changed in the file in one write-back for all of them."""
    from aioublk.qcow2 import Qcow2Image
    from tests.qcow2.test_qcow2_extents import DataPlaneStandIn, published

    path = create(tmp_path / "img.qcow2", 16 * M)
    img = Qcow2Image.open(str(path), metadata_write_through=True, direct=False)
    try:
        assert img.attach_pool() == -1  # (not held: C may not allocate)
        img.hold_c_writes()
        dp = DataPlaneStandIn(img, random.Random(5), c_alloc=True)
        await img.write(0, b"\x01" * 4 * K)  # (the L2 table: Python's, written through)
        img.service()
        if img.pools.filling is not None:
            await img.pools.filling
        assert published(dp.table, 0) == "rw" and img.c_allocating
        mirror = bytearray(16 * M)
        mirror[:4 * K] = b"\x01" * 4 * K
        wbs = WriteBacks(img)
        served = dp.served
        for k in range(1, 9):
            await dp.write(k * 64 * K + 512, bytes([k]) * 4 * K)  # (C: allocates)
            mirror[k * 64 * K + 512:k * 64 * K + 512 + 4 * K] = bytes([k]) * 4 * K
        await dp.write(1024, b"\x02" * 512)  # (C: in place)
        mirror[1024:1536] = b"\x02" * 512
        assert dp.served - served >= 8 and wbs.n == 0
        await img.settle_writes()
        assert wbs.n == 1
        qemu_img("check", "-U", path)  # exit 0: clean, while still open
        compare_identical(path, _raw(tmp_path, mirror), force_share=True)
        await img.settle_writes()  # (nothing new: no write-back)
        assert wbs.n == 1
    finally:
        await img.close()


def _raw(tmp_path: Path, data: bytes | bytearray) -> Path:
    out = tmp_path / "expected.raw"
    out.write_bytes(data)
    return out


# -- a failed sync is never forgotten ------------------------------------------------------


class _FailingSync(HostFile):
    """The image file, with its next ``fail`` syncs failing with EIO (as Linux
    reports a lost page-cache write-back: once, then the error is gone)."""

    __slots__ = ()
    fail = 0
    syncs = 0

    async def sync(self) -> None:
        type(self).syncs += 1
        if type(self).fail:
            type(self).fail -= 1
            raise OSError(errno.EIO, "injected write-back error")
        await super().sync()


async def test_failed_sync_is_never_forgotten(tmp_path: Path, ring: Ring) -> None:
    """A sync fails once. That flush fails; so does every later flush, write-back
    and the close (QEMU's file-posix does the same: the kernel reports a lost
    write-back once, so the data it held may be gone whatever later syncs say).
    The tables the failed write-back held stay dirty."""
    from aioublk.qcow2 import Qcow2Image

    path = create(tmp_path / "img.qcow2", 16 * M)
    img = Qcow2Image.open(str(path))
    img.file.__class__ = _FailingSync
    try:
        await img.write(5 * M + 512, b"\x33" * 8 * K)
        _FailingSync.fail = 1
        with pytest.raises(OSError) as err:
            await img.flush()
        assert err.value.errno == errno.EIO
        assert any(b.dirty for b in img.refs.blocks.values()), \
            "refcount blocks marked clean before the sync that failed"
        assert img.wb.dirty()
        syncs = _FailingSync.syncs
        with pytest.raises(OSError) as err:
            await img.flush()  # the kernel would report success now
        assert err.value.errno == errno.EIO, "a second flush after a failed sync succeeded"
        await img.write(9 * M, b"\x44" * 4 * K)  # data writes still go on (as in QEMU)
        with pytest.raises(OSError):
            await img.writeback()
        assert _FailingSync.syncs == syncs, "a sync was retried after one failed"
    finally:
        with pytest.raises(OSError) as err:
            await img.close()
    assert err.value.errno == errno.EIO, "close after a failed sync reported success"
    assert img.file.fd < 0, "close left the image file open"


# -- a request waits for every leg ----------------------------------------------------------


class _FailingRead(HostFile):
    """The image file, every read failing at once with EIO."""

    __slots__ = ()

    async def read_into(self, buf: memoryview, offset: int) -> None:
        raise OSError(errno.EIO, "injected read error")


async def _split_read(tmp_path: Path) -> tuple[Any, bytearray]:
    """An image whose first 128 KiB read is split: its first cluster from the
    image file, the next from the backing file's (an allocated one); the L2
    tables are loaded already."""
    from aioublk.qcow2 import Qcow2Image

    base = create(tmp_path / "base.qcow2", 4 * M)
    qemu_io(base, f"write -P 0x22 0 {128 * K}")
    path = create(tmp_path / "img.qcow2", 4 * M, backing=base)
    qemu_io(path, f"write -P 0x11 0 {64 * K}")
    img = Qcow2Image.open(str(path))
    buf = bytearray(128 * K)
    await img.read(0, buf)
    return img, buf


async def test_failed_leg_waits_for_its_siblings(tmp_path: Path, ring: Ring) -> None:
    """A read split over the image file and the backing file: the leg from the
    image fails at once, the backing leg is still filling the caller's buffer.
    The read must not return (its buffer goes back to the kernel) before the
    slow leg has finished."""
    img, buf = await _split_read(tmp_path)
    try:
        img.file.__class__ = _FailingRead
        finished = False

        async def slow_backing(pos: int, view: memoryview) -> None:
            nonlocal finished
            await asyncio.sleep(0.2)
            view[:] = b"\x22" * len(view)
            finished = True
        img._read_backing = slow_backing  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await img.read(0, buf)
        assert finished, "the read returned while its backing leg still wrote into the buffer"
    finally:
        img.file.__class__ = HostFile
        await img.close()


async def test_read_failing_on_two_legs_leaves_no_cycle(tmp_path: Path, ring: Ring) -> None:
    """A read split over the image file and the backing file, both legs
    failing: the error raised must not sit in a reference cycle with the
    frames that did the I/O (they hold views of the request's buffer; the
    collector clearing those while cffi still exports them crashes)."""
    import gc

    img, buf = await _split_read(tmp_path)
    try:
        img.file.__class__ = _FailingRead
        img.backing.file.__class__ = _FailingRead
        gc.collect()
        gc.disable()
        try:
            try:
                await img.read(0, buf)
            except OSError as e:
                assert "injected" in str(e)
            else:
                pytest.fail("a read failing on both legs succeeded")
            for _ in range(5):  # the loop lets go of the legs' tasks
                await asyncio.sleep(0)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cyclic = [o for o in gc.garbage if isinstance(o, OSError)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert not cyclic, "the read's error was left in a reference cycle"
    finally:
        img.file.__class__ = HostFile
        img.backing.file.__class__ = HostFile
        await img.close()


# -- the corrupt mark names only a durable refcount table ---------------------------------


class _FailingWrite(HostFile):
    """The image file, its writes at ``at`` failing with EIO."""

    __slots__ = ()
    at = -1

    async def write(self, buf: Any, offset: int) -> None:
        if offset == type(self).at:
            raise OSError(errno.EIO, "injected write error")
        await super().write(buf, offset)


async def test_corrupt_mark_names_the_durable_refcount_table(tmp_path: Path,
                                                             ring: Ring) -> None:
    """The refcount table moved, and the write-back that would have written it
    there failed; then the image is marked corrupt. The header with the corrupt
    bit must still name the old refcount table (on disk), not the new place
    (never written)."""
    from aioublk.qcow2 import Qcow2Image

    path = create(tmp_path / "img.qcow2", 16 * M)
    rt_before = struct.unpack_from(">QI", read_file(path), 48)
    img = Qcow2Image.open(str(path))
    try:
        await img.write(0, b"\x33" * 64 * K)
        await img.flush()
        async with img.refs.lock:
            await img.refs.grow_table(len(img.refs.table))
        assert img.refs.table_offset != rt_before[0]
        img.file.__class__ = _FailingWrite
        _FailingWrite.at = img.refs.table_offset
        with pytest.raises(OSError):
            await img.writeback()
        with pytest.raises(OSError):
            img._mark_corrupt("injected")
    finally:
        img.file.__class__ = HostFile
        img.release()
    head = read_file(path)
    assert struct.unpack_from(">Q", head, 72)[0] & 2, "the corrupt bit was not written"
    assert struct.unpack_from(">QI", head, 48) == rt_before, \
        "the header names a refcount table that was never written"


async def test_failed_sync_of_corrupt_mark_sticks(tmp_path: Path, ring: Ring,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync after writing the corrupt mark fails: as any failed sync of the
    image, it makes every later flush fail."""
    from aioublk.qcow2 import Qcow2Image

    path = create(tmp_path / "img.qcow2", 16 * M)
    img = Qcow2Image.open(str(path))
    try:
        await img.write(0, b"\x33" * 64 * K)
        await img.flush()

        def failing(fd: int) -> None:
            raise OSError(errno.EIO, "injected sync error")
        monkeypatch.setattr(os, "fdatasync", failing)
        with pytest.raises(OSError):
            img._mark_corrupt("injected")
        monkeypatch.undo()
        with pytest.raises(OSError) as err:
            await img.flush()
        assert err.value.errno == errno.EIO, "a flush after a failed sync succeeded"
    finally:
        img.release()


# -- the task-free path, refused by O_DIRECT, retries buffered -----------------------------


@pytest.mark.parametrize("op", ["read", "write"])
async def test_fast_path_refused_by_direct_io_is_retried_buffered_once(
        tmp_path: Path, ring: Ring, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """A task-free request O_DIRECT refuses (EINVAL: here 512 bytes at a
    misaligned offset, on a file system that enforces alignment) is submitted
    once more, buffered: not again direct before that (as loop and stripe)."""
    import fcntl
    import mmap

    from aioublk.qcow2 import Qcow2Image

    path = create(tmp_path / "img.qcow2", 4 * M)
    qemu_io(path, f"write -P 0x11 0 {64 * K}")
    img = Qcow2Image.open(str(path))
    submitted: list[bool] = []  # O_DIRECT on the image file at each submission
    try:
        if not img.file.direct:
            pytest.skip("no direct I/O on the file system of the test's files")
        await img.read(0, bytearray(4 * K))  # loads the L2 table: the cluster is mapped
        real_rw = ring.submit_rw

        def rw(opcode: int, fd: int, *args: Any) -> None:
            submitted.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
            real_rw(opcode, fd, *args)
        monkeypatch.setattr(ring, "submit_rw", rw)
        buf = memoryview(mmap.mmap(-1, 4096))[:512]
        buf[:] = b"\x22" * 512
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        start = img.start_write if op == "write" else img.start_read
        assert start(100, buf, done.set_result)
        assert await asyncio.wait_for(done, 5) == 512
        if submitted == [True]:
            pytest.skip("the file system took a misaligned direct request")
        assert submitted == [True, False]
        want = b"\x22" if op == "write" else b"\x11"
        assert bytes(buf) == want * 512
    finally:
        await img.close()
