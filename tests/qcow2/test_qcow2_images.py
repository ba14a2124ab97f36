"""The qcow2 engine reads what QEMU wrote (host only: no ublk, no kernel).

Every image is made by ``qemu-img`` / ``qemu-io``; the reference content is
``qemu-img convert -O raw`` of the same image. Every byte of every image is
read through the engine, read-write and read-only, in chunks of assorted sizes
(sequentially and with many reads in flight), and must equal the reference.

The images cover every value of each format axis with a pairwise set (cluster
size 512 / 4k / 64k / 2M, refcount_bits 1 / 16 / 64, compat 0.10 / 1.1; compat
0.10 only exists with 16-bit refcounts), each filled with data, zeroes (with
and without unmap), compressed clusters, discards, at offsets unaligned to
clusters and across cluster and L2-table boundaries; compressed images from
``qemu-img convert -c`` (zlib, zstd); backing chains (qcow2 over qcow2, a depth
3 chain over a raw base of a size that is not a multiple of 512, tops larger
than their backing files, relative backing names); images with internal
snapshots. Images whose features the engine may decline (extended L2 entries,
an external data file) must be either refused with Qcow2Error or read right.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aioublk.ring import Ring
from tests.support.qcow2_util import (
    CHUNKS_A,
    CHUNKS_B,
    SECTOR,
    K,
    M,
    Spec,
    assert_same,
    check_clean,
    compare_identical,
    create,
    info,
    mixed_content,
    opened,
    pattern_file,
    qemu_img,
    qemu_io,
    read_all,
    read_file,
    to_raw,
)

pytestmark = pytest.mark.asyncio


# -- the images -----------------------------------------------------------------------


#: Pairwise: every cluster size with compat 0.10 and 1.1, every cluster size
#: with at least two refcount widths, every refcount width with 3+ cluster
#: sizes. Sizes that are not a multiple of the cluster size leave a partial
#: last cluster. One L2 table maps 32 KiB with 512 B clusters and 2 MiB with
#: 4k ones, so those images have many; a 64k L2 table maps 512 MiB, which is
#: too big to read whole here: test_second_l2_table_64k reads around it.
MATRIX = {
    "c512-rb1-v3": Spec(512, 1, "1.1", 8 * M),
    "c512-rb16-v2": Spec(512, 16, "0.10", 4 * M + 512),
    "c512-rb64-v3": Spec(512, 64, "1.1", 6 * M),
    "c4k-rb1-v3": Spec(4 * K, 1, "1.1", 10 * M),
    "c4k-rb16-v3": Spec(4 * K, 16, "1.1", 6 * M + 1536),
    "c4k-rb16-v2": Spec(4 * K, 16, "0.10", 6 * M + 1536),
    "c64k-rb1-v3": Spec(64 * K, 1, "1.1", 8 * M + 512),
    "c64k-rb16-v2": Spec(64 * K, 16, "0.10", 8 * M + 512),
    "c64k-rb64-v3": Spec(64 * K, 64, "1.1", 12 * M + 1024),
    "c2m-rb16-v3": Spec(2 * M, 16, "1.1", 56 * M),
    "c2m-rb16-v2": Spec(2 * M, 16, "0.10", 56 * M),
}


def matrix_commands(cs: int, size: int, v3: bool, pat: Path) -> list[str]:
    """qemu-io commands exercising every kind of L2 entry. Regions of 4 clusters
    each; ``u`` is a step inside a cluster (a whole cluster when it is 512 B, in
    which case "unaligned" can only mean byte-unaligned writes, also here)."""
    u = max(SECTOR, cs // 4)

    def r(k: int) -> int:
        return 4 * k * cs

    c = [
        # region 0: data from an unaligned start over 3 clusters, overwritten
        # across a cluster boundary, and a byte-unaligned write
        f"write -s {pat} {u} {3 * cs}",
        f"write -P 0xa2 {cs - u} {2 * u}",
        f"write -P 0x5e {2 * cs + 100} 1000",
        # region 1: zeroes over data, unaligned across a boundary, and a whole cluster
        f"write -P 0xb1 {r(1)} {4 * cs}",
        f"write -z {r(1) + u} {cs}",
        f"write -z {r(1) + 2 * cs} {cs}",
        # region 2: compressed clusters, partly overwritten and zeroed (QEMU
        # decompresses and copies), and left alone
        f"write -c -s {pat} {r(2)} {2 * cs}",
        f"write -c -P 0xc2 {r(2) + 3 * cs} {cs}",
        f"write -P 0xc3 {r(2) + cs - 512} 1024",
        f"write -z {r(2) + 3 * cs + cs // 2} {max(SECTOR, cs // 4)}",
        # region 3: discards of data: a whole cluster, unaligned ranges
        f"write -s {pat} {r(3)} {4 * cs}",
        f"discard {r(3) + cs} {cs}",
        f"discard {r(3) + 2 * cs + u} {cs}",
        f"discard {r(3) + 3 * cs} {max(SECTOR, cs // 2)}",
        # region 4: zeroes over compressed clusters, discard of a compressed cluster
        f"write -c -P 0xe2 {r(4)} {4 * cs}",
        f"write -z {r(4)} {cs}",
        f"discard {r(4) + cs} {cs}",
    ]
    if v3:
        c += [
            # zeroes with unmap: a whole data cluster, unaligned over data, over
            # compressed, over nothing
            f"write -z -u {r(4) + 2 * cs} {cs}",
            f"write -P 0xe3 {r(5)} {2 * cs}",
            f"write -z -u {r(5)} {cs}",
            f"write -z -u {r(5) + cs + u} {cs}",
            f"write -z -u {r(5) + 3 * cs} {2 * cs}",
        ]
    l2 = cs * cs // 8  # bytes one L2 table maps
    if l2 + 3 * cs <= size and l2 > r(6):
        c += [
            # across the end of the first L2 table: a compressed pair, data and
            # zeroes around the boundary
            f"write -c -s {pat} {l2 - cs} {2 * cs}",
            f"write -P 0x1b {l2 - 2 * cs + u} {cs}",
            f"write -P 0x2b {l2 + cs - 512} {cs}",
            f"write -z {l2 - 512} 1024",
        ]
    if 3 * l2 + cs <= size and l2 > r(6):
        c.append(f"write -s {pat} {2 * l2 - 1536} {l2 + 4096}")  # spans a whole L2 table
    for i in range(1, 7):  # scattered, so that many L1 entries / L2 tables exist
        c.append(f"write -P {0x30 + i} {size * i // 7 // SECTOR * SECTOR} 1536")
    c += [
        f"write -P 0xef {size - cs - 1024} 1024",
        f"write -P 0xee {size - 1536} 1536",  # the (maybe partial) last cluster
    ]
    return c


def build_matrix(name: str) -> Callable[[Path], Path]:
    spec = MATRIX[name]

    def build(d: Path) -> Path:
        img = create(d / "img.qcow2", spec.size, cluster_size=spec.cluster,
                     refcount_bits=spec.refcount_bits, compat=spec.compat)
        qemu_io(img, *matrix_commands(spec.cluster, spec.size, spec.compat != "0.10",
                                      pattern_file(d / "pattern")))
        return img
    return build


def build_convert(ctype: str, cluster: int, size: int, seed: int) -> Callable[[Path], Path]:
    """``qemu-img convert -c``: every non-zero cluster compressed (or stored
    plain where compressing does not help: the random blocks), zeros unallocated."""
    def build(d: Path) -> Path:
        src = d / "src.raw"
        src.write_bytes(mixed_content(size, seed))
        img = d / "img.qcow2"
        qemu_img("convert", "-c", "-O", "qcow2", "-o",
                 f"compression_type={ctype},cluster_size={cluster}", src, img)
        assert info(img)["format-specific"]["data"]["compression-type"] == ctype
        # then a few plain writes over compressed clusters
        qemu_io(img, f"write -P 0x77 {cluster + 512} 1024", f"write -z {3 * cluster} 1536")
        return img
    return build


def build_chain2(compat: str) -> Callable[[Path], Path]:
    """qcow2 (4k clusters) over qcow2 (64k clusters), relative backing name.
    With compat 0.10 a discard in the top uncovers the backing file again; with
    1.1 it leaves a zero cluster. Either way the reference is QEMU's convert."""
    def build(d: Path) -> Path:
        pat = pattern_file(d / "pattern")
        base = create(d / "base.qcow2", 8 * M, cluster_size=64 * K, compat=compat)
        qemu_io(base, f"write -s {pat} 0 {3 * M}", f"write -c -P 0x41 {4 * M} {M}",
                f"write -z {M} {64 * K}", f"write -P 0x42 {6 * M - 512} {M}")
        top = create(d / "top.qcow2", 8 * M, cluster_size=4 * K, compat=compat,
                     backing="base.qcow2")
        cmds = [
            f"write -P 0x51 {64 * K + 512} 1024",     # partial cluster: COW from base
            f"write -P 0x52 {200 * K - 512} {9 * K}",
            f"write -z {100 * K} {8 * K}",             # zeroes over base data
            f"write -z {4 * M + 512} {6 * K}",         # over base's compressed data
            f"discard {300 * K} {64 * K}",             # discard of unallocated-in-top
            f"write -P 0x53 {400 * K} {16 * K}",
            f"discard {400 * K + 4 * K} {8 * K}",      # discard of top data over base
            f"write -c -P 0x54 {M} {8 * K}",           # compressed in the top
            f"write -P 0x55 {8 * M - 6 * K} {6 * K}",
        ]
        if compat == "1.1":
            cmds += [f"write -z -u {512 * K} {8 * K}", f"write -z -u {4 * M + 64 * K} 1536"]
        qemu_io(top, *cmds)
        return top
    return build


def build_chain3_raw(d: Path) -> Path:
    """top (64k, 12 MiB) -> mid (512 B clusters, 8 MiB) -> base.raw (5 MiB + 700
    bytes): each layer larger than the one below; reads past a backing file's
    end are zeros, also inside a sector the raw file ends in."""
    base = d / "base.raw"
    base.write_bytes(mixed_content(5 * M + 700, seed=3))
    mid = create(d / "mid.qcow2", 8 * M, cluster_size=512, refcount_bits=64,
                 backing="base.raw", backing_fmt="raw")
    qemu_io(mid, f"write -P 0x61 {M + 512} 1024", f"write -z {2 * M} {3 * K}",
            f"write -P 0x62 {5 * M - 1024} 2048",  # across the raw file's end
            f"write -c -P 0x63 {3 * M} {2 * K}", f"discard {4 * M} {4 * K}",
            f"write -P 0x64 {7 * M} {4 * K}")
    top = create(d / "top.qcow2", 12 * M, cluster_size=64 * K, refcount_bits=1,
                 backing="mid.qcow2")
    qemu_io(top, f"write -P 0x71 {M + 1024} 512",  # COW of a 64k cluster over 2 layers
            f"write -P 0x72 {5 * M + 32 * K} 512",  # cluster holding the raw file's end
            f"write -P 0x73 {8 * M - 512} 1024",  # across mid's end
            f"write -P 0x74 {10 * M + 512} 512",  # past every backing file
            f"write -z {3 * M + 512} 1024")
    return top


def build_snapshot(cluster: int, compat: str) -> Callable[[Path], Path]:
    """Internal snapshots, then writes to the active layer over shared clusters
    (refcount 2: QEMU copies them), discards and zeroes of shared clusters."""
    def build(d: Path) -> Path:
        pat = pattern_file(d / "pattern")
        img = create(d / "img.qcow2", 16 * M, cluster_size=cluster, compat=compat)
        qemu_io(img, f"write -s {pat} 0 {2 * M}", f"write -c -P 0x81 {4 * M} {256 * K}",
                f"write -P 0x82 {8 * M} {M}")
        qemu_img("snapshot", "-c", "first", img)
        qemu_io(img, f"write -P 0x91 {cluster + 512} 1024", f"write -P 0x92 {M - 512} {M}",
                f"discard {8 * M} {256 * K}", f"write -z {8 * M + 512 * K} {64 * K}",
                f"write -P 0x93 {4 * M + 512} 512", f"write -P 0x94 {12 * M} {64 * K}")
        qemu_img("snapshot", "-c", "second", img)
        qemu_io(img, f"write -P 0xa1 {2 * cluster} {cluster}", f"write -P 0xa2 {15 * M} 512")
        assert len(info(img)["snapshots"]) == 2
        return img
    return build


def build_preallocated(compat: str) -> Callable[[Path], Path]:
    """``preallocation=metadata``: every L2 entry points at a cluster (zero-flagged
    with compat 1.1) before anything is written; then writes, zeroes, discards."""
    def build(d: Path) -> Path:
        img = d / "img.qcow2"
        qemu_img("create", "-q", "-f", "qcow2", "-o",
                 f"preallocation=metadata,compat={compat},cluster_size=4k", img, 6 * M)
        qemu_io(img, f"write -P 0x71 {K} {20 * K}", f"write -z {8 * K} {8 * K}",
                f"discard {64 * K} {64 * K}", f"write -P 0x72 {M} {8 * K}",
                f"write -P 0x73 {2 * M - 512} {K}")
        return img
    return build


BUILDERS: dict[str, Callable[[Path], Path]] = {
    **{name: build_matrix(name) for name in MATRIX},
    "convert-zlib-c64k": build_convert("zlib", 64 * K, 8 * M, seed=1),
    "convert-zstd-c64k": build_convert("zstd", 64 * K, 8 * M, seed=2),
    "convert-zstd-c4k": build_convert("zstd", 4 * K, 4 * M, seed=4),
    "convert-zlib-c2m": build_convert("zlib", 2 * M, 12 * M, seed=5),
    "convert-zstd-c512": build_convert("zstd", 512, 2 * M, seed=6),
    "chain2-v3": build_chain2("1.1"),
    "chain2-v2": build_chain2("0.10"),
    "chain3-raw-base": build_chain3_raw,
    "snapshots-c4k-v3": build_snapshot(4 * K, "1.1"),
    "snapshots-c64k-v2": build_snapshot(64 * K, "0.10"),
    "prealloc-metadata-v3": build_preallocated("1.1"),
    "prealloc-metadata-v2": build_preallocated("0.10"),
}


@dataclass(frozen=True)
class Built:
    name: str
    path: Path
    raw: Path
    info: dict[str, Any]


def build(name: str, d: Path) -> Built:
    path = BUILDERS[name](d)
    check_clean(path)  # what QEMU made is sound to begin with
    return Built(name, path, to_raw(path, d / "expected.raw"), info(path))


@pytest.fixture(scope="module", params=list(BUILDERS))
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def digest(path: Path) -> str:
    return hashlib.sha256(read_file(path)).hexdigest()


# -- reads ------------------------------------------------------------------------------


async def test_read_matches_qemu(image: Built, ring: Ring) -> None:
    want = read_file(image.raw)
    async with opened(image.path) as img:
        assert img.size == image.info["virtual-size"]
        assert img.cluster_size == image.info["cluster-size"]
        got = await read_all(img, chunks=CHUNKS_A)
        assert_same(got, want, f"{image.name}: sequential reads, chunks cycling {CHUNKS_A}")
        got = await read_all(img, chunks=CHUNKS_B, concurrency=32, own_buffers=True)
        assert_same(got, want, f"{image.name}: 32 reads in flight, chunks cycling {CHUNKS_B}")
    # opened read-write, only read, closed: still sound and the same for QEMU
    check_clean(image.path)
    compare_identical(image.path, image.raw)


async def test_read_only_matches_qemu(image: Built, ring: Ring) -> None:
    want = read_file(image.raw)
    before = digest(image.path)
    async with opened(image.path, read_only=True) as img:
        assert img.size == image.info["virtual-size"]
        got = await read_all(img, chunks=CHUNKS_B)
        assert_same(got, want, f"{image.name} (read-only): chunks cycling {CHUNKS_B}")
        got = await read_all(img, chunks=CHUNKS_A, concurrency=8)
        assert_same(got, want, f"{image.name} (read-only): 8 in flight, chunks {CHUNKS_A}")
    assert digest(image.path) == before, "a read-only open changed the image file"


async def test_reads_of_one_sector_everywhere_interesting(image: Built, ring: Ring) -> None:
    """Single-sector and cluster-straddling reads at every cluster boundary of
    the first 64 clusters and of the last 4, all in flight together."""
    want = read_file(image.raw)
    cs = image.info["cluster-size"]
    size = image.info["virtual-size"]
    offsets = sorted({o for k in [*range(65), *range(size // cs - 3, size // cs + 1)]
                      for o in (k * cs - SECTOR, k * cs) if o >= 0 and o + SECTOR <= size})
    async with opened(image.path, read_only=True) as img:
        bufs = [bytearray(2 * SECTOR if o + 2 * SECTOR <= size else SECTOR) for o in offsets]
        await asyncio.gather(*(img.read(o, b) for o, b in zip(offsets, bufs, strict=True)))
    for o, b in zip(offsets, bufs, strict=True):
        assert_same(b, want[o:o + len(b)], f"{image.name}: read of {len(b)} at {o:#x}", base=o)


async def test_second_l2_table_64k(tmp_path: Path, ring: Ring) -> None:
    """One 64k-cluster L2 table maps 512 MiB: compressed, data and zero
    clusters across the end of the first table. The image is too big to read
    whole in this file's time budget: the first MiB and the last 2.5 MiB are
    read, which hold everything that was written."""
    cs, l2 = 64 * K, 512 * M
    size = l2 + 6 * cs + 1024
    img = create(tmp_path / "img.qcow2", size, refcount_bits=64)
    pat = pattern_file(tmp_path / "pattern")
    qemu_io(img, f"write -s {pat} 512 {cs}", f"write -c -s {pat} {l2 - cs} {2 * cs}",
            f"write -P 0x1b {l2 - 2 * cs + 4096} {cs}", f"write -P 0x2b {l2 + cs - 512} {cs}",
            f"write -z {l2 - 512} 1024", f"write -P 0x3b {l2 + 3 * cs} {2 * cs}",
            f"write -z -u {l2 + 3 * cs} {cs}", f"write -P 0x4b {size - 1536} 1536")
    raw = to_raw(img, tmp_path / "expected.raw")
    start = l2 - 2 * M
    with open(raw, "rb") as f:
        head = f.read(M)
        f.seek(start)
        tail = f.read()
    assert len(tail) == size - start
    async with opened(img, read_only=True) as q:
        assert_same(await read_all(q, end=M), head, "first MiB")
        assert_same(await read_all(q, start=start, chunks=CHUNKS_B), tail,
                    "around the first L2 table's end", base=start)
        assert_same(await read_all(q, start=start, concurrency=16), tail,
                    "around the first L2 table's end, 16 in flight", base=start)


# -- features the engine may decline ---------------------------------------------------------


def build_extended_l2(d: Path) -> Path:
    img = d / "img.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", "extended_l2=on,cluster_size=64k", img, 4 * M)
    qemu_io(img, f"write -P 0x11 {4 * K} {2 * K}", f"write -z {64 * K} {64 * K}",
            f"write -P 0x12 {130 * K} 512")
    return img


def build_data_file(d: Path) -> Path:
    img = d / "img.qcow2"
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={d / 'data.raw'}", img, 4 * M)
    qemu_io(img, f"write -P 0x21 {K} {100 * K}", f"write -P 0x22 {2 * M} 512")
    return img


@pytest.mark.parametrize("make", [build_extended_l2, build_data_file],
                         ids=["extended_l2", "data_file"])
async def test_declined_or_read_right(make: Callable[[Path], Path], tmp_path: Path,
                                      ring: Ring) -> None:
    """Never a silent misread: either Qcow2Error at open, or the right bytes."""
    from aioublk.qcow2 import Qcow2Error, Qcow2Image

    path = make(tmp_path)
    want = read_file(to_raw(path, tmp_path / "expected.raw"))
    try:
        img = Qcow2Image.open(str(path), read_only=True)
    except Qcow2Error as e:
        assert "\n" not in str(e).strip() and str(e).strip(), f"message: {str(e)!r}"
        return
    try:
        assert_same(await read_all(img), want, f"{make.__name__} image")
    finally:
        await img.close()


async def test_snapshot_table_at_the_end_of_the_file(tmp_path: Path, ring: Ring) -> None:
    """QEMU writes the snapshot table last and does not pad its last entry to
    8 bytes: an image straight after ``qemu-img snapshot -c`` opens (and its
    file size need not be a multiple of 8)."""
    path = create(tmp_path / "img.qcow2", 4 * M)
    qemu_img("snapshot", "-c", "first", path)
    qemu_img("snapshot", "-c", "x", path)
    assert path.stat().st_size % 8, "the table's last entry should end unpadded"
    want = read_file(to_raw(path, tmp_path / "expected.raw"))
    async with opened(path) as img:
        assert_same(await read_all(img), want, "image ending in its snapshot table")
        await img.write(0, b"\x5a" * 512)
    check_clean(path)


async def test_dirty_lazy_refcounts_image(tmp_path: Path, ring: Ring) -> None:
    """lazy_refcounts=on and a crash (qemu-io ``abort``): the dirty bit is set
    and refcounts are stale. Read-only: read like QEMU does. Read-write: refuse
    with Qcow2Error, or repair it (then the image checks clean after close)."""
    from aioublk.qcow2 import Qcow2Error, Qcow2Image

    path = create(tmp_path / "img.qcow2", 4 * M, lazy_refcounts=True)
    p = subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x31 {K} {200 * K}",
                        "-c", "abort", str(path)], capture_output=True, text=True)
    assert p.returncode != 0, "qemu-io abort should have crashed"
    assert qemu_img("check", path, ok=(2,)).returncode == 2, "the image should be dirty"
    want = read_file(to_raw(path, tmp_path / "expected.raw"))
    async with opened(path, read_only=True) as img:
        assert_same(await read_all(img), want, "dirty image, read-only")
    try:
        img = Qcow2Image.open(str(path))
    except Qcow2Error as e:
        msg = str(e).strip()
        assert msg and "\n" not in msg, f"message: {msg!r}"
        return
    try:
        assert_same(await read_all(img), want, "dirty image, read-write")
    finally:
        await img.close()
    check_clean(path)


# -- what is not a usable qcow2 ----------------------------------------------------------


async def test_open_rejects_what_is_not_qcow2(tmp_path: Path, ring: Ring) -> None:
    from aioublk.qcow2 import Qcow2Error, Qcow2Image

    raw = tmp_path / "raw"
    raw.write_bytes(bytes(M))
    good = create(tmp_path / "good.qcow2", 4 * M)
    cut = tmp_path / "cut.qcow2"
    cut.write_bytes(read_file(good)[:50])
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    for path in (raw, cut, empty):
        with pytest.raises(Qcow2Error) as e:
            Qcow2Image.open(str(path))
        msg = str(e.value).strip()
        assert msg and "\n" not in msg, f"{path.name}: message {msg!r}"


async def test_open_missing_backing_file_fails(tmp_path: Path, ring: Ring) -> None:
    from aioublk.qcow2 import Qcow2Error, Qcow2Image

    base = create(tmp_path / "base.qcow2", 4 * M)
    top = create(tmp_path / "top.qcow2", 4 * M, backing="base.qcow2")
    base.unlink()
    with pytest.raises((Qcow2Error, OSError)) as e:
        Qcow2Image.open(str(top), read_only=True)
    assert "base.qcow2" in str(e.value), f"the message should name the file: {e.value}"
