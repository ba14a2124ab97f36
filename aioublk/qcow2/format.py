"""The qcow2 on-disk format, free of I/O: header parsing and checks, table
entries, refcount blocks of any width.

Spec: QEMU's ``docs/interop/qcow2.rst``. Everything is big-endian. Checks
follow what QEMU refuses at open, so an image QEMU calls broken is refused
here too, with one line that names the field and what to do.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aioublk.errors import Error

MAGIC = b"QFI\xfb"

# incompatible feature bits
INCOMPAT_DIRTY = 1 << 0
INCOMPAT_CORRUPT = 1 << 1
INCOMPAT_DATA_FILE = 1 << 2
INCOMPAT_COMPRESSION = 1 << 3
INCOMPAT_EXTL2 = 1 << 4
INCOMPAT_KNOWN = INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2
INCOMPAT_NAMES = {0: "dirty", 1: "corrupt", 2: "external data file",
                  3: "compression type", 4: "extended L2 entries"}

# compatible feature bits
COMPAT_LAZY_REFCOUNTS = 1 << 0

# header extension types
EXT_END = 0
EXT_BACKING_FORMAT = 0xE2792ACA
EXT_FEATURE_NAMES = 0x6803F857
EXT_BITMAPS = 0x23852875

# table entry bits
COPIED = 1 << 63
COMPRESSED = 1 << 62
ZERO = 1
OFFSET_MASK = 0x00FF_FFFF_FFFF_FE00  # bits 9-55: a host cluster offset
L1_RESERVED = 0x7F00_0000_0000_01FF
L2_RESERVED = 0x3F00_0000_0000_01FE
REFT_OFFSET_MASK = ~0x1FF & ((1 << 64) - 1)
# an extended L2 entry's second word: 32 subclusters' allocation bits, then
# their zero bits
SUB_ALLOC = 0xFFFF_FFFF
SUB_ZERO = 0xFFFF_FFFF << 32
SUBCLUSTERS = 32

# QEMU's limits
MAX_L1_BYTES = 32 << 20
MAX_REFTABLE_BYTES = 8 << 20
MAX_SNAPSHOTS = 65536
MAX_SNAPSHOT_EXTRA = 1024
MAX_BACKING_NAME = 1023

COMPRESSION_ZLIB = 0
COMPRESSION_ZSTD = 1

_V2 = struct.Struct(">4sIQIIQIIQQIIQ")  # 72 bytes
#: the version-2 header's bytes, which every image starts with
HEADER_BYTES = _V2.size
_V3 = struct.Struct(">QQQII")  # 32 bytes at offset 72
_SNAP = struct.Struct(">QIHHIIQII")  # 40 bytes, then extra data, id, name


class Qcow2Error(Error):
    """An image this engine refuses, explained in one line."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Header:
    version: int
    backing_file_offset: int
    backing_file_size: int
    cluster_bits: int
    size: int
    crypt_method: int
    l1_size: int
    l1_table_offset: int
    refcount_table_offset: int
    refcount_table_clusters: int
    nb_snapshots: int
    snapshots_offset: int
    incompatible: int = 0
    compatible: int = 0
    autoclear: int = 0
    refcount_order: int = 4
    header_length: int = 72
    compression_type: int = COMPRESSION_ZLIB
    backing_file: str | None = None
    backing_format: str | None = None
    feature_names: dict[tuple[int, int], str] = field(default_factory=dict)
    #: every header extension but the end marker: type -> its data
    extensions: dict[int, bytes] = field(default_factory=dict)

    @property
    def cluster_size(self) -> int:
        return 1 << self.cluster_bits

    @property
    def extended_l2(self) -> bool:
        return bool(self.incompatible & INCOMPAT_EXTL2)

    @property
    def l2_entry_bytes(self) -> int:
        """8, or 16 with extended L2 entries (the entry, then its subclusters)."""
        return 16 if self.extended_l2 else 8

    @property
    def l2_entries(self) -> int:
        return self.cluster_size // self.l2_entry_bytes

    @property
    def refcount_bits(self) -> int:
        return 1 << self.refcount_order

    @property
    def refblock_entries(self) -> int:
        return self.cluster_size * 8 // self.refcount_bits

    def feature_name(self, kind: int, bit: int) -> str:
        """A feature bit's name: the image's own feature name table first."""
        name = self.feature_names.get((kind, bit))
        if name:  # the image's own bytes: a control character would break the line
            return name if name.isprintable() else ascii(name)[1:-1]
        return INCOMPAT_NAMES.get(bit, f"bit {bit}") if kind == 0 else f"bit {bit}"


def virtual_size(first: bytes) -> int | None:
    """The virtual disk size an image's first ``HEADER_BYTES`` declare, unchecked
    (None: not a qcow2 header): for a bound, not for serving the image."""
    if len(first) < HEADER_BYTES or first[:4] != MAGIC:
        return None
    return Header(*_V2.unpack_from(first)[1:]).size


def parse_header(first: bytes, file_size: int) -> Header:
    """Parse and check the header from the image's first bytes (at least one
    cluster, or the whole file if shorter)."""
    if len(first) < HEADER_BYTES:
        raise Qcow2Error(f"not a qcow2 image: only {len(first)} bytes, the header needs "
                         f"{HEADER_BYTES}")
    v = _V2.unpack_from(first)
    if v[0] != MAGIC:
        raise Qcow2Error("not a qcow2 image (bad magic)")
    h = Header(*v[1:])
    if h.version not in (2, 3):
        raise Qcow2Error(f"qcow2 version {h.version} is not supported (only 2 and 3)")
    if h.version == 3:
        if len(first) < 104:
            raise Qcow2Error("qcow2 v3 header is truncated (file shorter than 104 bytes)")
        (h.incompatible, h.compatible, h.autoclear, h.refcount_order,
         h.header_length) = _V3.unpack_from(first, 72)
        if h.header_length < 104:
            raise Qcow2Error(f"qcow2 v3 header_length {h.header_length} is too short "
                             "(at least 104)")
        if h.header_length > 104 and len(first) > 104:
            h.compression_type = first[104]
    if not 9 <= h.cluster_bits <= 21:
        raise Qcow2Error(f"bad cluster_bits {h.cluster_bits}: QEMU allows 9 (512 B) to "
                         "21 (2 MiB)")
    cs = h.cluster_size
    if h.header_length > cs:
        raise Qcow2Error(f"header_length {h.header_length} exceeds the cluster size {cs}")
    if h.refcount_order > 6:
        raise Qcow2Error(f"bad refcount_order {h.refcount_order}: refcount widths are 1 "
                         "to 64 bits (order 0-6)")
    if len(first) < min(cs, file_size):
        raise Qcow2Error("qcow2 image is truncated inside its header cluster")
    _parse_extensions(h, first)
    if h.crypt_method:
        kind = {1: "AES", 2: "LUKS"}.get(h.crypt_method, str(h.crypt_method))
        raise Qcow2Error(f"encrypted qcow2 images ({kind}, crypt_method {h.crypt_method}) are "
                         "not supported: decrypt with qemu-img convert")
    unknown = h.incompatible & ~INCOMPAT_KNOWN
    if unknown:
        names = ", ".join(h.feature_name(0, b) for b in range(64) if unknown >> b & 1)
        raise Qcow2Error(f"qcow2 image uses unsupported incompatible features: {names}; "
                         "convert it with qemu-img convert -O qcow2")
    if h.incompatible & INCOMPAT_COMPRESSION:
        if h.header_length <= 104:
            raise Qcow2Error("qcow2 compression type bit is set but the header has no "
                             "compression_type field")
        if h.compression_type == COMPRESSION_ZLIB:
            raise Qcow2Error("qcow2 compression type bit is set with compression_type zlib "
                             "(0), which the spec forbids")
        if h.compression_type != COMPRESSION_ZSTD:
            raise Qcow2Error(f"unknown qcow2 compression type {h.compression_type}")
    elif h.compression_type != COMPRESSION_ZLIB:
        raise Qcow2Error("qcow2 compression_type is not zlib but the compression type "
                         "incompatible bit is clear")
    if h.extended_l2 and h.cluster_bits < 14:
        raise Qcow2Error(f"extended L2 entries with {cs}-byte clusters: QEMU makes them only "
                         "with clusters of 16 KiB or more")
    if h.size >> 55:
        raise Qcow2Error(f"qcow2 virtual size {h.size} is too large")
    need_l1 = _ceil_div(h.size, cs * h.l2_entries)
    if h.l1_size * 8 > MAX_L1_BYTES:
        raise Qcow2Error(f"qcow2 L1 table is too large ({h.l1_size} entries, at most "
                         f"{MAX_L1_BYTES // 8})")
    if h.l1_size < need_l1:
        raise Qcow2Error(f"qcow2 L1 table has {h.l1_size} entries, too few for a virtual "
                         f"size of {h.size} bytes ({need_l1} needed)")
    if h.l1_size and h.l1_table_offset % cs:
        raise Qcow2Error(f"qcow2 L1 table offset {h.l1_table_offset:#x} is not aligned "
                         "to a cluster")
    if h.l1_size and h.l1_table_offset + h.l1_size * 8 > file_size:
        raise Qcow2Error("qcow2 L1 table lies past the end of the file")
    if h.refcount_table_offset % cs or h.refcount_table_offset == 0:
        raise Qcow2Error(f"qcow2 refcount table offset {h.refcount_table_offset:#x} is "
                         "not aligned to a cluster")
    if h.refcount_table_clusters * cs > MAX_REFTABLE_BYTES or h.refcount_table_clusters == 0:
        raise Qcow2Error(f"qcow2 refcount table size ({h.refcount_table_clusters} clusters) "
                         "is out of range")
    if h.refcount_table_offset + h.refcount_table_clusters * cs > file_size + cs:
        raise Qcow2Error("qcow2 refcount table lies past the end of the file")
    if h.nb_snapshots > MAX_SNAPSHOTS:
        raise Qcow2Error(f"qcow2 image has too many snapshots ({h.nb_snapshots})")
    if h.nb_snapshots and (h.snapshots_offset % cs or h.snapshots_offset >= file_size):
        raise Qcow2Error(f"qcow2 snapshot table offset {h.snapshots_offset:#x} is invalid")
    if h.backing_file_offset:
        if h.backing_file_size > MAX_BACKING_NAME or \
                h.backing_file_offset + h.backing_file_size > min(cs, len(first)):
            raise Qcow2Error("qcow2 backing file name lies outside the header cluster")
        raw = first[h.backing_file_offset:h.backing_file_offset + h.backing_file_size]
        h.backing_file = raw.decode("utf-8", "replace")
    return h


def _parse_extensions(h: Header, first: bytes) -> None:
    pos = h.header_length if h.version == 3 else 72
    end = min(len(first), h.cluster_size)
    if h.backing_file_offset:
        end = min(end, h.backing_file_offset)
    while pos + 8 <= end:
        kind, length = struct.unpack_from(">II", first, pos)
        pos += 8
        if kind == EXT_END:
            return
        if pos + length > end:
            raise Qcow2Error(f"qcow2 header extension {kind:#x} runs past the header cluster")
        data = first[pos:pos + length]
        h.extensions[kind] = data
        if kind == EXT_BACKING_FORMAT:
            h.backing_format = data.decode("utf-8", "replace")
        elif kind == EXT_FEATURE_NAMES:
            for i in range(0, length - 47, 48):
                ftype, bit = data[i], data[i + 1]
                name = data[i + 2:i + 48].split(b"\0", 1)[0].decode("utf-8", "replace")
                h.feature_names[(ftype, bit)] = name
        pos += (length + 7) & ~7


# --- where header fields live, for in-place updates (never rewrite the whole header,
# so unknown fields and extensions stay as they are)
OFF_REFTABLE = 48  # refcount_table_offset (u64) + refcount_table_clusters (u32)
OFF_INCOMPAT = 72
OFF_AUTOCLEAR = 88


def pack_reftable_fields(offset: int, clusters: int) -> bytes:
    return struct.pack(">QI", offset, clusters)


def pack_u64(v: int) -> bytes:
    return struct.pack(">Q", v)


# --- tables of big-endian u64 (L1, L2, refcount table)

def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ``[start, end)`` ranges covering ``spans`` (tables that
    share or overlap their bytes are read once)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def load_table(data: bytes | memoryview) -> array[int]:
    t = array("Q", bytes(data))
    if sys.byteorder == "little":
        t.byteswap()
    return t


def split_l2(data: bytes | memoryview, extended: bool) -> tuple[array[int], array[int] | None]:
    """An L2 table's entries, and with extended L2 their subcluster words."""
    words = load_table(data)
    if not extended:
        return words, None
    return words[0::2], words[1::2]


def join_l2(entries: array[int], subs: array[int] | None) -> bytes:
    if subs is None:
        return dump_table(entries)
    words = array("Q", bytes(16 * len(entries)))
    words[0::2] = entries
    words[1::2] = subs
    return dump_table(words)


def dump_table(t: array[int]) -> bytes:
    if sys.byteorder == "little":
        c = array("Q", t)
        c.byteswap()
        return c.tobytes()
    return t.tobytes()


@dataclass(frozen=True)
class Compressed:
    """Where a compressed cluster's bytes are: ``length`` bytes at ``offset``
    (it may end in the middle of a sector and share its host clusters)."""

    offset: int
    length: int


def compressed_span(entry: int, cluster_bits: int) -> Compressed:
    shift = 62 - (cluster_bits - 8)
    offset = entry & ((1 << shift) - 1)
    sectors = ((entry >> shift) & ((1 << (cluster_bits - 8)) - 1)) + 1
    return Compressed(offset, sectors * 512 - (offset & 511))


def compressed_clusters(entry: int, cluster_bits: int) -> range:
    """The host clusters a compressed cluster's data touches (each holds one
    reference from it)."""
    shift = 62 - (cluster_bits - 8)
    offset = entry & ((1 << shift) - 1)
    sectors = ((entry >> shift) & ((1 << (cluster_bits - 8)) - 1)) + 1
    start = offset & ~511
    end = start + sectors * 512
    return range(start >> cluster_bits, ((end - 1) >> cluster_bits) + 1)


# --- refcount blocks

class RefBlock:
    """One refcount block of any width (1-64 bits), as QEMU lays it out:
    sub-byte widths pack from the least significant bit, wider ones are
    big-endian integers."""

    __slots__ = ("bits", "entries", "_a", "_raw", "dirty", "gen")

    _CODES = {8: "B", 16: "H", 32: "I", 64: "Q"}

    def __init__(self, bits: int, data: bytes | memoryview) -> None:
        self.bits = bits
        self.entries = len(data) * 8 // bits
        self.dirty = False
        self.gen = 0  # bumped on each change: a write-back only cleans what it saw
        if bits >= 8:
            self._a = array(self._CODES[bits], bytes(data))
            if sys.byteorder == "little" and bits > 8:
                self._a.byteswap()
            self._raw = bytearray()
        else:
            self._a = array("B")
            self._raw = bytearray(data)

    def __getitem__(self, i: int) -> int:
        if self.bits >= 8:
            return self._a[i]
        per = 8 // self.bits
        return (self._raw[i // per] >> ((i % per) * self.bits)) & ((1 << self.bits) - 1)

    def __setitem__(self, i: int, v: int) -> None:
        if v < 0 or v >> self.bits:
            raise OverflowError(f"refcount {v} does not fit in {self.bits} bits")
        if self.bits >= 8:
            self._a[i] = v
        else:
            per = 8 // self.bits
            shift = (i % per) * self.bits
            mask = ((1 << self.bits) - 1) << shift
            self._raw[i // per] = (self._raw[i // per] & ~mask) | (v << shift)
        self.dirty = True
        self.gen += 1

    def first_free(self, start: int) -> int:
        """Index of the first zero refcount at or after ``start``, or -1."""
        if self.bits == 8:
            i = self._a.tobytes().find(b"\0", start)
            return i
        if self.bits >= 8:
            try:
                return self._a.index(0, start)
            except ValueError:
                return -1
        for i in range(start, self.entries):
            if not self[i]:
                return i
        return -1

    def dump(self) -> bytes:
        if self.bits < 8:
            return bytes(self._raw)
        if sys.byteorder == "little" and self.bits > 8:
            c = array(self._a.typecode, self._a)
            c.byteswap()
            return c.tobytes()
        return self._a.tobytes()


@dataclass
class Snapshot:
    l1_table_offset: int
    l1_size: int
    name: str
    id: str = ""
    date_sec: int = 0
    date_nsec: int = 0
    vm_clock_nsec: int = 0
    vm_state_size: int = 0
    icount: int | None = None  # (None: the entry predates it)
    disk_size: int | None = None
    #: the entry as stored (padded to 8 bytes), kept so a rewritten table
    #: carries what this code does not read
    raw: bytes = field(default=b"", repr=False, compare=False)


def pack_snapshot(s: Snapshot) -> bytes:
    """A new snapshot table entry, with the extra data QEMU 5+ writes (the
    64-bit VM state size, the disk size, the instruction count), padded."""
    ident, name = s.id.encode(), s.name.encode()
    extra = struct.pack(">QQQ", s.vm_state_size, s.disk_size or 0, s.icount or 0)
    out = _SNAP.pack(s.l1_table_offset, s.l1_size, len(ident), len(name), s.date_sec,
                     s.date_nsec, s.vm_clock_nsec, min(s.vm_state_size, 0xFFFF_FFFF),
                     len(extra)) + extra + ident + name
    return out.ljust((len(out) + 7) & ~7, b"\0")


def parse_snapshots(data: bytes, count: int) -> tuple[list[Snapshot], int]:
    """The snapshots, and how many bytes their table occupies."""
    snaps = []
    pos = 0
    for _ in range(count):
        start = pos
        if pos + _SNAP.size > len(data):
            raise Qcow2Error("qcow2 snapshot table is truncated")
        (l1_off, l1_size, id_len, name_len, date_sec, date_nsec, vm_clock, vm_state,
         extra) = _SNAP.unpack_from(data, pos)
        if extra > MAX_SNAPSHOT_EXTRA:
            raise Qcow2Error(f"qcow2 snapshot table entry has {extra} bytes of extra data "
                             f"(at most {MAX_SNAPSHOT_EXTRA})")
        more = data[pos + _SNAP.size:pos + _SNAP.size + extra]
        words = [int.from_bytes(more[i:i + 8], "big") for i in range(0, len(more) - 7, 8)]
        if words and words[0]:
            vm_state = words[0]  # the 64-bit size, where the entry has it
        pos += _SNAP.size + extra
        ident = data[pos:pos + id_len].decode("utf-8", "replace")
        pos += id_len
        if pos + name_len > len(data):
            raise Qcow2Error("qcow2 snapshot table is truncated")
        name = data[pos:pos + name_len].decode("utf-8", "replace")
        pos = (pos + name_len + 7) & ~7  # padding QEMU leaves out after the last entry
        snaps.append(Snapshot(l1_off, l1_size, name, ident, date_sec, date_nsec, vm_clock,
                              vm_state, words[2] if len(words) > 2 else None,
                              words[1] if len(words) > 1 else None,
                              data[start:pos].ljust(pos - start, b"\0")))
    return snaps, pos


# --- persistent bitmaps (the bitmaps header extension and its directory)

_BITMAPS_EXT = struct.Struct(">IIQQ")  # nb_bitmaps, reserved, directory size, offset
_BITMAP_ENTRY = struct.Struct(">QIIBBHI")  # table offset, size, flags, type, gran, name, extra
BITMAP_OFFSET_MASK = 0x00FF_FFFF_FFFF_FE00


@dataclass
class Bitmap:
    name: str
    table_offset: int
    table_size: int  # entries
    flags: int
    granularity_bits: int
    at: int = 0  # where its directory entry lies in the file


BITMAP_IN_USE = 1  # its data was not stored after the last change: it is inconsistent
BITMAP_AUTO = 2  # enabled: it tracks every write
AUTOCLEAR_BITMAPS = 1  # the bitmaps extension is valid (cleared by a program lacking it)


def bitmaps_directory(ext: bytes) -> tuple[int, int, int]:
    """(count, directory offset, directory size) from the extension's data."""
    if len(ext) < _BITMAPS_EXT.size:
        raise Qcow2Error("qcow2 bitmaps header extension is truncated")
    count, _, size, offset = _BITMAPS_EXT.unpack_from(ext)
    return count, offset, size


def parse_bitmaps(ext: bytes, read: Callable[[int, int], bytes]) -> list[Bitmap]:
    count, offset, size = bitmaps_directory(ext)
    data = read(offset, size)
    out, pos = [], 0
    for _ in range(count):
        if pos + _BITMAP_ENTRY.size > len(data):
            raise Qcow2Error("qcow2 bitmap directory is truncated")
        table, entries, flags, _type, gran, name_len, extra = \
            _BITMAP_ENTRY.unpack_from(data, pos)
        start = pos + _BITMAP_ENTRY.size + extra
        out.append(Bitmap(data[start:start + name_len].decode("utf-8", "replace"), table,
                          entries, flags, gran, offset + pos))
        pos = (start + name_len + 7) & ~7
    return out
