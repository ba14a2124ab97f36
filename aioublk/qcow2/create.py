"""``aioublk img create``: a new qcow2 image's bytes, free of I/O.

The layout is QEMU's: the header in cluster 0, the refcount table from
cluster 1, its refcount blocks after it, then the L1 table; with
``preallocation=metadata`` (or ``falloc``) every L2 table follows, each
before the data clusters it maps, which are counted and named but left
unwritten (holes in the file, read as zeros).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.format import COPIED, Qcow2Error

PREALLOCATIONS = ("off", "metadata", "falloc")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMGTPE]?)B?")
_UNITS = {"": 1, "k": 1 << 10, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "P": 1 << 50, "E": 1 << 60}


def parse_size(text: str) -> int:
    """A size as qemu-img reads it: bytes, or a number with k, M, G, T, P or E."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or ("." in m[1] and not m[2]):
        raise Qcow2Error(f"invalid image size {text!r}: use bytes, or a number with "
                         "k, M, G, T, P or E (e.g. 10G, 1.5G)")
    return int(float(m[1]) * _UNITS[m[2]]) if "." in m[1] else int(m[1]) * _UNITS[m[2]]


@dataclass
class Options:
    """``-o`` as qemu-img takes it for qcow2 (those this engine writes)."""

    size: int
    cluster_size: int = 65536
    compat: str = "1.1"
    refcount_bits: int = 16
    lazy_refcounts: bool = False
    compression_type: str = "zlib"
    preallocation: str = "off"
    backing_file: str | None = None
    backing_fmt: str | None = None
    extended_l2: bool = False

    def check(self) -> None:
        cs = self.cluster_size
        if cs < 512 or cs > 2 << 20 or cs & (cs - 1):
            raise Qcow2Error(f"cluster_size {cs} is not a power of two from 512 to 2M")
        if self.compat not in ("1.1", "0.10", "v3", "v2"):
            raise Qcow2Error(f"compat {self.compat!r}: use 1.1 or 0.10")
        rb = self.refcount_bits
        if rb < 1 or rb > 64 or rb & (rb - 1):
            raise Qcow2Error(f"refcount_bits {rb} is not a power of two from 1 to 64")
        if self.v2 and (rb != 16 or self.lazy_refcounts or self.compression_type != "zlib"):
            raise Qcow2Error("compat=0.10 images have 16-bit refcounts, no lazy refcounts "
                             "and zlib compression only: use compat=1.1")
        if self.extended_l2 and cs < 16384:
            raise Qcow2Error("Extended L2 entries are only supported with cluster sizes of "
                             "at least 16384 bytes")
        if self.extended_l2 and self.v2:
            raise Qcow2Error("Extended L2 entries are only supported with compatibility "
                             "level 1.1 and above (use version=v3 or greater)")
        if self.compression_type not in ("zlib", "zstd"):
            raise Qcow2Error(f"compression_type {self.compression_type!r}: use zlib or zstd")
        if self.preallocation not in PREALLOCATIONS:
            raise Qcow2Error(f"preallocation {self.preallocation!r}: use one of "
                             f"{', '.join(PREALLOCATIONS)}")
        if self.preallocation != "off" and self.backing_file:
            raise Qcow2Error("preallocation cannot be used with a backing file")
        if self.size % 512:
            raise Qcow2Error(f"image size {self.size} is not a multiple of 512")
        if self.size >> 55:
            raise Qcow2Error(f"image size {self.size} is too large")
        if self.backing_file is not None and len(self.backing_file.encode()) > \
                fmt.MAX_BACKING_NAME:
            raise Qcow2Error("backing file name is too long")

    @property
    def v2(self) -> bool:
        return self.compat in ("0.10", "v2")


def _header(o: Options, l1_size: int, l1_offset: int, reftable_clusters: int) -> bytes:
    cs = o.cluster_size
    bits = cs.bit_length() - 1
    exts = b""
    if o.backing_fmt:
        data = o.backing_fmt.encode()
        exts += struct.pack(">II", fmt.EXT_BACKING_FORMAT, len(data))
        exts += data.ljust((len(data) + 7) & ~7, b"\0")
    exts += bytes(8)  # the end of the extensions
    length = 72 if o.v2 else 112
    name = (o.backing_file or "").encode()
    name_at = length + len(exts) if name else 0
    head = struct.pack(">4sIQIIQIIQQIIQ", fmt.MAGIC, 2 if o.v2 else 3, name_at, len(name),
                       bits, o.size, 0, l1_size, l1_offset, cs, reftable_clusters, 0, 0)
    if not o.v2:
        zstd = o.compression_type == "zstd"
        incompat = (fmt.INCOMPAT_COMPRESSION if zstd else 0) | \
            (fmt.INCOMPAT_EXTL2 if o.extended_l2 else 0)
        head += struct.pack(">QQQII", incompat,
                            fmt.COMPAT_LAZY_REFCOUNTS if o.lazy_refcounts else 0, 0,
                            (o.refcount_bits.bit_length() - 1), length)
        head += bytes([fmt.COMPRESSION_ZSTD if zstd else fmt.COMPRESSION_ZLIB]) + bytes(7)
    out = head + exts + name
    if len(out) > cs:
        raise Qcow2Error("the header does not fit in one cluster: use a larger cluster_size")
    return out


def build(o: Options) -> tuple[list[tuple[int, bytes]], int]:
    """The writes that make the image (offset, bytes), and the file's length."""
    o.check()
    cs = o.cluster_size
    entry = 16 if o.extended_l2 else 8
    l2_entries = cs // entry
    l1_size = -(-o.size // (cs * l2_entries))
    l1_clusters = -(-l1_size * 8 // cs) if l1_size else 0
    data = -(-o.size // cs) if o.preallocation != "off" else 0
    tables = l1_size if o.preallocation != "off" else 0
    rbe = cs * 8 // o.refcount_bits
    blocks = table = 1
    while True:  # the refcount structure counts itself
        used = 1 + table + blocks + l1_clusters + tables + data
        want_blocks = -(-used // rbe)
        want_table = max(1, -(-want_blocks * 8 // cs))
        if (want_blocks, want_table) == (blocks, table):
            break
        blocks, table = max(blocks, want_blocks), max(table, want_table)
    l1_at = (1 + table + blocks) * cs
    writes: list[tuple[int, bytes]] = [(0, _header(o, l1_size, l1_at, table))]
    reftable = bytearray(table * cs)
    for i in range(blocks):
        struct.pack_into(">Q", reftable, 8 * i, (1 + table + i) * cs)
    writes.append((cs, bytes(reftable)))
    end = l1_at + l1_size * 8
    l1 = bytearray(l1_size * 8)
    if tables:
        pos = (l1_at + l1_clusters * cs) // cs  # the next free cluster
        left = data
        for i in range(l1_size):
            l2_at = pos * cs
            struct.pack_into(">Q", l1, 8 * i, l2_at | COPIED)
            n = min(l2_entries, left)
            l2 = bytearray(cs)
            for j in range(n):
                struct.pack_into(">Q", l2, entry * j, (pos + 1 + j) * cs | COPIED)
                if o.extended_l2:  # (every subcluster allocated)
                    struct.pack_into(">Q", l2, entry * j + 8, fmt.SUB_ALLOC)
            writes.append((l2_at, bytes(l2)))
            pos += 1 + n
            left -= n
        end = pos * cs
    if l1:
        writes.append((l1_at, bytes(l1)))
    counted = used
    for i in range(blocks):
        block = fmt.RefBlock(o.refcount_bits, bytes(cs))
        for c in range(i * rbe, min((i + 1) * rbe, counted)):
            block[c - i * rbe] = 1
        writes.append(((1 + table + i) * cs, block.dump()))
    return writes, end


def formatting_line(path: str, o: Options, compat_given: bool,
                    prealloc_given: bool) -> str:
    """qemu-img create's ``Formatting ...`` line."""
    parts = [f"Formatting '{path}', fmt=qcow2", f"cluster_size={o.cluster_size}",
             f"extended_l2={'on' if o.extended_l2 else 'off'}"]
    if prealloc_given:
        parts.append(f"preallocation={o.preallocation}")
    parts += [f"compression_type={o.compression_type}", f"size={o.size}"]
    if o.backing_file is not None:
        parts.append(f"backing_file={o.backing_file}")
        if o.backing_fmt:
            parts.append(f"backing_fmt={o.backing_fmt}")
    if compat_given:
        parts.append(f"compat={o.compat}")
    parts += [f"lazy_refcounts={'on' if o.lazy_refcounts else 'off'}",
              f"refcount_bits={o.refcount_bits}"]
    return " ".join(parts)
