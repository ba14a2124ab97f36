"""The map of an image's metadata clusters, made as it opens: which cluster
holds the header, the L1 table, the refcount table and blocks, the L2
tables, the snapshot table and the snapshots' tables. Data writes must
never touch one, and a table is only ever written where a table of its
kind lives (``aioublk.qcow2.writeback``'s overlap check): the map is what
both ask. Where two kinds claim one cluster the stronger (lower) kind
wins, so writing the weaker table there is refused.

What an open may cost. Each table is read once and each distinct offset in
it handled once; offsets inside the file are at most its clusters, and
only ``MAX_FAR_TARGETS`` may point past its end (a read-write image records
them, so that data never lands where a table claims to be). The
snapshots' L1 tables are read as the union of their ranges, clipped to
the file: 200 snapshots naming one 32 MiB table cost one table, and 200
overlapping tables cost the bytes they cover."""

from __future__ import annotations

from array import array

from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.base import _nclusters
from aioublk.qcow2.format import OFFSET_MASK, Qcow2Error
from aioublk.qcow2.writeback import HEADER, L1, L2, REFBLOCK, REFTABLE, SNAPSHOT

SCAN_CHUNK = 1 << 16  # table entries per step
MAX_FAR_TARGETS = 1 << 16


def scan(f: HostFile, path: str, h: fmt.Header, l1: array[int], reftable: array[int],
         read_only: bool) -> dict[int, int]:
    """Host cluster -> the kind of metadata it holds, for the image in ``f``
    (its header ``h``, its tables ``l1`` and ``reftable``); a read-only
    image leaves out what lies past the end of the file (nothing is
    allocated there)."""
    m = _Scan(f, path, h.cluster_bits, read_only)
    cs = h.cluster_size
    m.add(0, cs, HEADER)
    m.add(h.l1_table_offset, h.l1_size * 8, L1)
    m.add(h.refcount_table_offset, h.refcount_table_clusters * cs, REFTABLE)
    if len(m.meta) < 1 + _nclusters(h.l1_table_offset, h.l1_size * 8, cs) + \
            h.refcount_table_clusters:
        raise Qcow2Error("qcow2 header, L1 table and refcount table overlap each other")
    m.targets(reftable, fmt.REFT_OFFSET_MASK, REFBLOCK, set())
    l2_seen: set[int] = set()
    m.targets(l1, OFFSET_MASK, L2, l2_seen)
    if h.nb_snapshots:
        m.snapshots(h, l2_seen)
    return m.meta


class _Scan:
    """The map as it is made."""

    def __init__(self, f: HostFile, path: str, cbits: int, read_only: bool) -> None:
        self.file = f
        self.path = path
        self.cbits = cbits
        self.read_only = read_only
        self.meta: dict[int, int] = {}
        self.far = 0  # table entries pointing past the end of the file (see ``targets``)

    def targets(self, table: array[int], mask: int, kind: int, seen: set[int]) -> None:
        """Record the clusters ``table``'s entries point to (L2 tables or refcount
        blocks) as metadata of ``kind``, each offset once (``seen``)."""
        end = self.file.size
        cs = 1 << self.cbits
        for i in range(0, len(table), SCAN_CHUNK):
            if self.read_only:  # nothing is ever allocated past the end
                offs = {o for e in table[i:i + SCAN_CHUNK] if (o := e & mask) < end}
            else:
                offs = {e & mask for e in table[i:i + SCAN_CHUNK]}
            offs -= seen
            seen |= offs
            offs.discard(0)
            for off in offs:
                if off >= end:
                    self.far += 1
                    if self.far > MAX_FAR_TARGETS:
                        raise Qcow2Error(
                            f"more than {MAX_FAR_TARGETS} table entries point past the "
                            f"end of the file: repair it with `qemu-img check -r all "
                            f"{self.path}`, or open it read-only")
                self.add(off, cs, kind)

    def snapshots(self, h: fmt.Header, l2_seen: set[int]) -> None:
        """The snapshot table and the snapshots' L1 tables as metadata; for a
        read-write image also the L2 tables they point to (never written, but
        never to be overwritten either)."""
        f, cs = self.file, 1 << self.cbits
        raw = f.pread(h.snapshots_offset, 1 << 24)
        snaps, nbytes = fmt.parse_snapshots(raw, h.nb_snapshots)
        self.add(h.snapshots_offset, nbytes, SNAPSHOT)
        spans = []
        for s in snaps:
            if s.l1_size * 8 > fmt.MAX_L1_BYTES or s.l1_table_offset % cs:
                raise Qcow2Error(f"qcow2 snapshot '{s.name}' has an invalid L1 table")
            if s.l1_size:
                spans.append((s.l1_table_offset, s.l1_table_offset + s.l1_size * 8))
        step = SCAN_CHUNK * 8
        for start, end in fmt.merge_spans(spans):
            end = min(end, f.size)  # past the end of the file there is no table to keep
            if start >= end:
                continue
            self.add(start, end - start, SNAPSHOT)
            if self.read_only:
                continue
            for pos in range(start, end, step):
                part = f.pread(pos, min(step, end - pos))
                self.targets(fmt.load_table(part[:len(part) & ~7]), OFFSET_MASK, L2, l2_seen)

    def add(self, offset: int, length: int, kind: int) -> None:
        """Record metadata clusters; where two kinds claim one cluster the
        stronger (lower) kind wins, so writing the weaker table there is refused."""
        meta = self.meta
        for c in range(offset >> self.cbits, ((offset + length - 1) >> self.cbits) + 1):
            if meta.get(c, 99) > kind:
                meta[c] = kind
