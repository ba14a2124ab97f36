"""The qcow2 format layer, without I/O: refcount blocks of every width,
compressed-cluster descriptors, header checks."""

from __future__ import annotations

import struct

import pytest

from aioublk.qcow2 import format as fmt


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32, 64])
def test_refblock_roundtrip_every_width(bits: int) -> None:
    cs = 512
    b = fmt.RefBlock(bits, bytes(cs))
    assert b.entries == cs * 8 // bits
    top = (1 << bits) - 1
    values = {0: 1, 1: top, b.entries - 1: 1, b.entries // 2: top // 2 or 1}
    for i, v in values.items():
        b[i] = v
    raw = b.dump()
    assert len(raw) == cs
    again = fmt.RefBlock(bits, raw)
    for i in range(b.entries):
        assert again[i] == values.get(i, 0)
    if bits < 8:  # QEMU packs sub-byte refcounts from the least significant bit
        assert raw[0] & ((1 << bits) - 1) == 1
    else:  # and wider ones big-endian
        assert int.from_bytes(raw[:bits // 8], "big") == 1
    assert again.first_free(0) == 2
    with pytest.raises(OverflowError):
        b[3] = top + 1


def test_refblock_tracks_changes() -> None:
    b = fmt.RefBlock(16, bytes(512))
    assert not b.dirty
    b[5] = 2
    assert b.dirty and b.gen == 1


@pytest.mark.parametrize("cluster_bits", [9, 12, 16, 21])
def test_compressed_descriptor(cluster_bits: int) -> None:
    shift = 62 - (cluster_bits - 8)
    offset = (7 << cluster_bits) + 1000  # mid-cluster, mid-sector
    extra = min(3, (1 << (cluster_bits - 8)) - 1)  # sectors beyond the first
    entry = fmt.COMPRESSED | (extra << shift) | offset
    span = fmt.compressed_span(entry, cluster_bits)
    assert span.offset == offset
    assert span.length == (extra + 1) * 512 - (offset & 511)
    clusters = fmt.compressed_clusters(entry, cluster_bits)
    first = (offset & ~511) >> cluster_bits
    last = ((offset & ~511) + (extra + 1) * 512 - 1) >> cluster_bits
    assert clusters == range(first, last + 1)


def test_tables_are_big_endian() -> None:
    raw = struct.pack(">3Q", 1, 1 << 63 | 0x10000, 0)
    t = fmt.load_table(raw)
    assert list(t) == [1, 1 << 63 | 0x10000, 0]
    assert fmt.dump_table(t) == raw


def header(**kw: int) -> bytes:
    f = dict(version=3, backing_offset=0, backing_size=0, cluster_bits=16, size=1 << 30,
             crypt=0, l1_size=2, l1_offset=0x30000, rt_offset=0x10000, rt_clusters=1,
             nb_snap=0, snap_offset=0, incompat=0, compat=0, autoclear=0, rorder=4,
             hlen=112)
    f.update(kw)
    raw = struct.pack(">4sIQIIQIIQQIIQQQQII", b"QFI\xfb", f["version"], f["backing_offset"],
                      f["backing_size"], f["cluster_bits"], f["size"], f["crypt"],
                      f["l1_size"], f["l1_offset"], f["rt_offset"], f["rt_clusters"],
                      f["nb_snap"], f["snap_offset"], f["incompat"], f["compat"],
                      f["autoclear"], f["rorder"], f["hlen"])
    return raw.ljust(1 << f["cluster_bits"] if f["cluster_bits"] < 22 else 4096, b"\0")


def test_header_fields() -> None:
    h = fmt.parse_header(header(), 1 << 20)
    assert (h.version, h.cluster_size, h.size, h.refcount_bits) == (3, 65536, 1 << 30, 16)
    assert h.l2_entries == 8192 and h.refblock_entries == 32768


@pytest.mark.parametrize("kw,words", [
    ({"cluster_bits": 8}, "cluster_bits"),
    ({"cluster_bits": 22}, "cluster_bits"),
    ({"rorder": 7}, "refcount_order"),
    ({"hlen": 100}, "header_length"),
    ({"version": 4}, "version"),
    ({"crypt": 1}, "encrypted"),
    ({"incompat": 1 << 2}, "external data file"),
    ({"incompat": 1 << 4, "cluster_bits": 12}, "extended L2"),
    ({"incompat": 1 << 9}, "bit 9"),
    ({"l1_size": 1}, "L1 table"),
    ({"l1_offset": 0x30200}, "not aligned"),
    ({"rt_offset": 0x10200}, "not aligned"),
    ({"rt_clusters": 1 << 20}, "refcount table"),
])
def test_header_refusals_name_the_problem(kw: dict[str, int], words: str) -> None:
    with pytest.raises(fmt.Qcow2Error, match=words) as err:
        fmt.parse_header(header(**kw), 1 << 20)
    assert "\n" not in str(err.value)


def test_capacity_is_the_virtual_size_qemu_img_wrote(tmp_path: object) -> None:
    """``update_size`` bounds a qcow2 device by the size in the image's header."""
    import subprocess
    from pathlib import Path

    from aioublk.targets.qcow2 import Qcow2Target

    img = Path(str(tmp_path)) / "a.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), "10000k"], check=True)
    assert Qcow2Target.capacity([str(img)], {}) == 10000 << 10
    assert fmt.virtual_size(img.read_bytes()[:fmt.HEADER_BYTES - 1]) is None
    assert fmt.virtual_size(bytes(fmt.HEADER_BYTES)) is None
