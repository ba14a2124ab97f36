"""``aioublk img check``: find and repair what ``qemu-img check`` finds in a
qcow2 image that nothing has open.

Every cluster's references are counted from the metadata, as QEMU counts
them (the header, the active and the snapshots' L1 tables, each L2 table
once per L1 entry naming it and its data clusters each time, the snapshot
table, the refcount table and blocks, the bitmaps when QEMU would read
them), and compared with the refcounts on disk: more on disk is a leak
(waste, no harm), fewer is a corruption (a write could reuse a cluster
still in use). An L1 or L2 entry's COPIED flag must say whether its
cluster's refcount is 1. Repair sets each refcount to its references (only
the leaks with ``leaks``, everything with ``all``) and fixes the COPIED
flags, then checks again; a repair that leaves nothing wrong clears the
dirty and corrupt bits, as QEMU's does.

The scan is free of I/O: it reads through a callable, so the tests feed it
images as bytes. Exit codes are qemu-img's: 0 clean, 1 the check could not
finish, 2 corruptions, 3 leaks only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, Qcow2Error

Read = Callable[[int, int], bytes]
#: told how far a long scan has come (0.0 to 1.0)
Progress = Callable[[float], None]

AUTOCLEAR_BITMAPS = fmt.AUTOCLEAR_BITMAPS


@dataclass
class Copied:
    """A table entry whose COPIED flag disagrees with its cluster's refcount."""

    at: int  # where the entry lies in the file
    entry: int
    refcount: int
    l1_index: int | None  # an L1 entry's index; None: an L2 entry


@dataclass
class Result:
    """What one pass found (the fields of qemu-img's ``--output json``)."""

    cluster_size: int
    refs: dict[int, int] = field(default_factory=dict)  # host cluster -> references
    disk: dict[int, int] = field(default_factory=dict)  # host cluster -> refcount on disk
    leaks: dict[int, tuple[int, int]] = field(default_factory=dict)  # (refcount, reference)
    low: dict[int, tuple[int, int]] = field(default_factory=dict)  # refcount < reference
    copied: list[Copied] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # corruptions no repair here fixes
    bad_refblocks: int = 0  # reftable entries naming no usable block (of ``other``)
    shared_refblocks: int = 0  # refcount blocks also used as something else (of ``other``)
    far_refblocks: int = 0  # of those, past the end of the file
    refblock_clusters: set[int] = field(default_factory=set)
    #: L2 entries of zero clusters at a misaligned offset, made plain zero
    #: clusters by a repair of everything (where they lie, and what they become)
    zeroed: list[tuple[int, bytes]] = field(default_factory=list)
    check_errors: int = 0
    total_clusters: int = 0
    allocated: int = 0
    fragmented: int = 0
    compressed: int = 0
    image_end: int = 0

    @property
    def needs_rebuild(self) -> bool:
        """A cluster in use counted free, or a refcount block lost: QEMU then
        builds the refcount structure anew (``-r all``) rather than patch it."""
        return bool(self.bad_refblocks or self.shared_refblocks) or \
            any(have == 0 for have, _ in self.low.values())

    @property
    def corruptions(self) -> int:
        return len(self.low) + len(self.copied) + len(self.other)

    def exit_code(self) -> int:
        return 1 if self.check_errors else 2 if self.corruptions else 3 if self.leaks else 0


def _table(read: Read, offset: int, entries: int) -> list[int]:
    data = read(offset, entries * 8)
    return list(fmt.load_table(data[:len(data) & ~7]))


def l2_table(read: Read, offset: int, h: fmt.Header) -> tuple[list[int], list[int] | None]:
    """An L2 table's entries and (extended L2) their subcluster words."""
    words = _table(read, offset, h.cluster_size // 8)
    if not h.extended_l2:
        return words, None
    return words[0::2], words[1::2]


def _clusters(offset: int, length: int, bits: int) -> range:
    return range(offset >> bits, ((offset + length - 1) >> bits) + 1) if length > 0 else range(0)


class _Scan:
    """One pass over an image: its references, refcounts and flags.

    What is corrupt is counted as QEMU counts it, so that a repair frees
    what ``qemu-img check -r`` frees and nothing more: a table or cluster
    at a misaligned offset is still counted (the clusters it overlaps) and
    read there; only a reference a cluster or more past the end of the
    file is not counted."""

    def __init__(self, read: Read, file_size: int, progress: Progress | None = None,
                 *, fix_errors: bool = False) -> None:
        self.progress = progress
        self.fix_errors = fix_errors
        # every read clipped to the file: a table's size never sizes a buffer
        self.read: Read = lambda off, n: read(off, max(0, min(n, file_size - off)))
        self.file_size = file_size
        first = read(0, 1 << 21)
        self.h = h = fmt.parse_header(first, file_size)
        if h.incompatible & fmt.INCOMPAT_DATA_FILE:
            raise Qcow2Error("images with an external data file cannot be checked here yet: "
                             "use qemu-img check")
        self.bits = h.cluster_bits
        self.res = Result(h.cluster_size)
        # (no reference is counted past the end of the file's last cluster)
        self.limit = -(-file_size // h.cluster_size) + 1

    def ref(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        if offset + length - self.file_size >= self.h.cluster_size:
            self.res.other.append(f"a reference to {length:#x} bytes at {offset:#x} lies a "
                                  "cluster or more past the end of the file")
            return
        for c in _clusters(offset, length, self.bits):
            self.res.refs[c] = self.res.refs.get(c, 0) + 1

    def run(self) -> Result:
        h, res = self.h, self.res
        cs = h.cluster_size
        res.total_clusters = -(-h.size // cs)
        self.ref(0, cs)
        self.l1(h.l1_table_offset, h.l1_size, active=True)
        if h.nb_snapshots:
            snaps, nbytes = fmt.parse_snapshots(self.read(h.snapshots_offset, 1 << 24),
                                                h.nb_snapshots)
            self.ref(h.snapshots_offset, nbytes)
            for s in snaps:
                if s.l1_table_offset % cs:
                    res.other.append(f"snapshot '{s.name}': L1 table offset "
                                     f"{s.l1_table_offset:#x} is not cluster aligned")
                    continue
                self.l1(s.l1_table_offset, s.l1_size, active=False)
        self.ref(h.refcount_table_offset, h.refcount_table_clusters * cs)
        if h.autoclear & AUTOCLEAR_BITMAPS and fmt.EXT_BITMAPS in h.extensions:
            self.bitmaps(h.extensions[fmt.EXT_BITMAPS])
        self.refcounts()
        self.compare()
        self.check_copied()
        return res

    def l1(self, offset: int, size: int, *, active: bool) -> None:
        cs = self.h.cluster_size
        if size * 8 > fmt.MAX_L1_BYTES:
            self.res.other.append(f"an L1 table of {size} entries is too large")
            return
        self.ref(offset, size * 8)
        for i, e in enumerate(_table(self.read, offset, size)):
            if active and self.progress is not None and not i % 64:
                self.progress(i / size)  # (the active tables are most of the work)
            if not e:
                continue
            if e & fmt.L1_RESERVED:
                self.res.other.append(f"L1 entry {e:#x} has reserved bits set")
            l2 = e & OFFSET_MASK
            self.ref(l2, cs)
            if l2 % cs:  # (still read there: what QEMU counts, to free no more than it)
                self.res.other.append(f"L2 table offset {l2:#x} is not cluster aligned; "
                                      "L1 entry corrupted")
            self.l2(l2, active)

    def l2(self, offset: int, active: bool) -> None:
        h, res = self.h, self.res
        cs = h.cluster_size
        contiguous = 0
        entries, subs = l2_table(self.read, offset, h)
        for k, e in enumerate(entries):
            word = subs[k] if subs is not None else 0
            if subs is not None and (bad := self.bad_subclusters(e, word)):
                res.other.append(f"L2 entry {e:#x} has {bad} {word:#x}")
            if e & COMPRESSED:
                if e & COPIED:
                    res.other.append(f"compressed L2 entry {e:#x} has the COPIED flag set")
                if word:
                    continue  # (QEMU counts nothing of it)
                span = fmt.compressed_span(e & ~COPIED, self.bits)
                self.ref(span.offset, span.length)
                if active:
                    res.allocated += 1
                    res.compressed += 1
                    res.fragmented += 1  # (compressed clusters are, by nature)
                continue
            host = e & OFFSET_MASK
            if e & fmt.L2_RESERVED or host and subs is not None and e & fmt.ZERO:
                res.other.append(f"L2 entry {e:#x} has reserved bits set")
            if not host:
                continue
            if host % cs:
                no_data = not word & fmt.SUB_ALLOC if subs is not None else e & fmt.ZERO
                if no_data and self.fix_errors:  # (as QEMU: a plain zero cluster now)
                    zero = (0, word & fmt.SUB_ZERO | (word & fmt.SUB_ALLOC) << 32) \
                        if subs is not None else (fmt.ZERO,)
                    res.zeroed.append((offset + h.l2_entry_bytes * k,
                                       struct.pack(f">{len(zero)}Q", *zero)))
                    continue
                # (still counted where it lies: what QEMU counts, to free no more than it)
                res.other.append(f"data cluster offset {host:#x} is not cluster aligned; "
                                 "L2 entry corrupted")
            self.ref(host, cs)
            if active:
                res.allocated += 1
                if contiguous and host != contiguous:
                    res.fragmented += 1
                contiguous = host + cs

    @staticmethod
    def bad_subclusters(e: int, word: int) -> str:
        """What is wrong with an extended L2 entry's subcluster word ("": nothing)."""
        if e & COMPRESSED:
            return "a compressed cluster with a subcluster bitmap" if word else ""
        if word & fmt.SUB_ALLOC & word >> 32:
            return "subclusters both allocated and zero in bitmap"
        if word & fmt.SUB_ALLOC and not e & OFFSET_MASK:
            return "allocated subclusters but no cluster in bitmap"
        return ""

    def bitmaps(self, ext: bytes) -> None:
        try:
            _, offset, size = fmt.bitmaps_directory(ext)
            marks = fmt.parse_bitmaps(ext, self.read)
        except Qcow2Error as e:
            self.res.other.append(str(e))
            return
        self.ref(offset, size)
        for b in marks:
            self.ref(b.table_offset, b.table_size * 8)
            for entry in _table(self.read, b.table_offset, b.table_size):
                if entry & fmt.BITMAP_OFFSET_MASK:
                    self.ref(entry & fmt.BITMAP_OFFSET_MASK, self.h.cluster_size)

    def refcounts(self) -> None:
        """The refcount blocks (each one more reference) and what they hold."""
        h, res = self.h, self.res
        cs = h.cluster_size
        self.reftable = _table(self.read, h.refcount_table_offset,
                               h.refcount_table_clusters * cs // 8)
        self.blocks: dict[int, fmt.RefBlock] = {}
        for i, e in enumerate(self.reftable):
            off = e & fmt.REFT_OFFSET_MASK
            if not off:
                continue
            if off % cs:
                res.other.append(f"refcount block {i} is not cluster aligned; refcount "
                                 "table entry corrupted")
                res.bad_refblocks += 1
                continue
            if off >= self.file_size:
                res.other.append(f"refcount block {i} is outside the image")
                res.bad_refblocks += 1
                res.far_refblocks += 1
                continue
            self.ref(off, cs)
            if (n := res.refs.get(off >> self.bits, 0)) != 1:
                res.other.append(f"refcount block {i} is also something else "
                                 f"({n} references)")
                res.shared_refblocks += 1
            res.refblock_clusters.add(off >> self.bits)
            block = fmt.RefBlock(h.refcount_bits, self.read(off, cs).ljust(cs, b"\0"))
            self.blocks[i] = block
            base = i * h.refblock_entries
            for j in range(min(block.entries, self.limit - base)):  # (none past the limit)
                if v := block[j]:
                    res.disk[base + j] = v

    def compare(self) -> None:
        res = self.res
        n = -(-self.file_size // res.cluster_size)
        if res.refs:
            n = max(n, max(res.refs) + 1)
        highest = -1
        for c in sorted(set(res.refs) | {c for c in res.disk if c < n}):
            have, want = res.disk.get(c, 0), res.refs.get(c, 0)
            if have or want:
                highest = max(highest, c)
            if have > want:
                res.leaks[c] = (have, want)
            elif have < want:
                res.low[c] = (have, want)
        res.image_end = (highest + 1) * res.cluster_size

    def check_copied(self) -> None:
        res = self.res
        res.copied = list(copied_flags(self.read, self.h, lambda c: res.disk.get(c, 0),
                                       {at for at, _ in res.zeroed}))


def copied_flags(read: Read, h: fmt.Header, refcount: Callable[[int], int],
                 skip: set[int]) -> Iterable[Copied]:
    """The COPIED flags that disagree with ``refcount`` (a cluster's), in the
    active L1's entries and their L2 tables' (QEMU looks no further); not
    the entries at ``skip``."""
    for i, e in enumerate(_table(read, h.l1_table_offset, h.l1_size)):
        l2 = e & OFFSET_MASK
        if not l2:
            continue
        rc = refcount(l2 >> h.cluster_bits)
        if (rc == 1) != bool(e & COPIED):
            yield Copied(h.l1_table_offset + 8 * i, e, rc, i)
        for j, d in enumerate(l2_table(read, l2, h)[0]):
            host, at = d & OFFSET_MASK, l2 + h.l2_entry_bytes * j
            if d & COMPRESSED or not host or at in skip:
                continue
            rc = refcount(host >> h.cluster_bits)
            if (rc == 1) != bool(d & COPIED):
                yield Copied(at, d, rc, None)


def scan(read: Read, file_size: int, progress: Progress | None = None, *,
         fix_errors: bool = False) -> tuple[fmt.Header, Result]:
    """An image's findings; with ``fix_errors`` (a repair of everything to
    follow), the misaligned zero clusters QEMU makes plain are found as
    fixes, not counted."""
    s = _Scan(read, file_size, progress, fix_errors=fix_errors)
    h, res = s.h, s.run()
    if progress is not None:
        progress(1.0)
    return h, res


# -- repair ------------------------------------------------------------------------------


@dataclass
class Repair:
    """The writes that repair a pass's findings, and what they fix."""

    writes: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, bytes)
    #: written after ``writes`` are on disk: the header's switch to a rebuilt structure
    then: list[tuple[int, bytes]] = field(default_factory=list)
    leaks_fixed: int = 0
    corruptions_fixed: int = 0
    lines: list[str] = field(default_factory=list)  # "Repairing ..." as qemu-img says


def plan_repair(read: Read, file_size: int, h: fmt.Header, res: Result, mode: str) -> Repair:
    """Refcounts set to their references (leaks only with ``leaks``), then the
    COPIED flags as the new refcounts say (with ``all``, or with ``leaks`` when
    nothing else is wrong, as QEMU does)."""
    out = Repair()
    if res.needs_rebuild:
        if mode != "all":
            raise Qcow2Error("a cluster in use has refcount 0 or a refcount block is lost: "
                             "the refcount structure must be rebuilt: repair with -r all")
        final = _rebuild(h, res, file_size, out)
    else:
        final = _patch(read, file_size, h, res, mode, out)
    if mode == "all":
        for at, zero in res.zeroed:
            out.lines.append(f"Repairing L2 entry at {at:#x}: a zero cluster at a "
                             "misaligned offset made a plain zero cluster")
            out.writes.append((at, zero))
            out.corruptions_fixed += 1
    # with leaks only, the flags are fixed only where the refcounts now are right
    safe = not (res.check_errors or res.other or res.low) and out.leaks_fixed == len(res.leaks)
    if mode == "all" or safe:
        # (as the refcounts are once repaired: a refcount set to 2 makes a flag wrong)
        for cp in copied_flags(read, h, lambda c: final.get(c, 0),
                               {at for at, _ in res.zeroed} if mode == "all" else set()):
            entry = cp.entry | COPIED if cp.refcount == 1 else cp.entry & ~COPIED
            what = f"L2 cluster: l1_index={cp.l1_index} l1_entry={cp.entry:x}" \
                if cp.l1_index is not None else f"data cluster: l2_entry={cp.entry:x}"
            out.lines.append(f"Repairing OFLAG_COPIED {what} refcount={cp.refcount}")
            out.writes.append((cp.at, struct.pack(">Q", entry)))
            out.corruptions_fixed += 1
    return out


def _rebuild(h: fmt.Header, res: Result, file_size: int, out: Repair) -> dict[int, int]:
    """A new refcount structure holding exactly the references, in clusters
    past everything in use (so a crash before the header names it loses
    nothing): its blocks, then its table, then the header."""
    cs, bits = h.cluster_size, h.cluster_bits
    counts = dict(res.refs)
    old = set(_clusters(h.refcount_table_offset, h.refcount_table_clusters * cs, bits))
    # (the old blocks each hold one reference in res.refs; they are free once replaced)
    old |= res.refblock_clusters
    unref(counts, old)
    start = max(-(-file_size // cs), max(counts, default=0) + 1)
    writes, switch = refcount_structure(h, counts, start)
    out.writes += writes
    out.then.append((fmt.OFF_REFTABLE, switch))
    out.lines.append("Rebuilding refcount structure")
    # (qemu-img counts a block past the end twice: it grows the file to take
    # it, which makes its cluster one more in use with refcount 0)
    out.corruptions_fixed += len(res.low) + res.bad_refblocks + res.far_refblocks + \
        res.shared_refblocks
    out.leaks_fixed += len(res.leaks)
    return counts


def unref(counts: dict[int, int], clusters: Iterable[int]) -> None:
    """One reference fewer to each of ``clusters``."""
    for c in clusters:
        if counts.get(c, 0) > 0:
            counts[c] -= 1
            if not counts[c]:
                del counts[c]


def refcount_structure(h: fmt.Header, counts: dict[int, int],
                       start: int) -> tuple[list[tuple[int, bytes]], bytes]:
    """A refcount structure holding ``counts`` (which it adds its own clusters
    to), laid out from cluster ``start`` on: its writes, and the header's
    reftable fields that switch to it."""
    cs, rbe = h.cluster_size, h.refblock_entries
    nblocks = ntable = 0
    while True:  # the new clusters need counting too
        end = start + nblocks + ntable
        want_blocks = -(-end // rbe)
        want_table = -(-want_blocks * 8 // cs)
        if (want_blocks, want_table) == (nblocks, ntable):
            break
        nblocks, ntable = want_blocks, want_table
    for c in range(start, start + nblocks + ntable):
        counts[c] = 1
    writes = []
    table = bytearray(ntable * cs)
    for i in range(nblocks):
        block = fmt.RefBlock(h.refcount_bits, bytes(cs))
        for c in range(i * rbe, (i + 1) * rbe):
            if n := counts.get(c):
                try:
                    block[c % rbe] = n
                except OverflowError:
                    raise Qcow2Error(f"cluster {c} has {n} references, more than "
                                     f"{h.refcount_bits}-bit refcounts hold") from None
        off = (start + i) * cs
        writes.append((off, block.dump()))
        struct.pack_into(">Q", table, 8 * i, off)
    table_off = (start + nblocks) * cs
    writes.append((table_off, bytes(table)))
    return writes, fmt.pack_reftable_fields(table_off, ntable)


def _patch(read: Read, file_size: int, h: fmt.Header, res: Result, mode: str,
           out: Repair) -> dict[int, int]:
    """Each wrong refcount set right in its block (only the leaks with ``leaks``)."""
    cs, rbe = h.cluster_size, h.refblock_entries
    reftable = _table(read, h.refcount_table_offset, h.refcount_table_clusters * cs // 8)
    blocks: dict[int, tuple[int, fmt.RefBlock]] = {}
    final = dict(res.disk)
    fixes = dict(res.leaks)
    if mode == "all":
        fixes.update(res.low)
    for c, (have, want) in sorted(fixes.items()):
        i = c // rbe
        off = reftable[i] & fmt.REFT_OFFSET_MASK if i < len(reftable) else 0
        if not off or off % cs or off >= file_size:
            continue  # no block to hold it: qemu-img rebuilds the refcount structure
        if i not in blocks:
            blocks[i] = (off, fmt.RefBlock(h.refcount_bits, read(off, cs).ljust(cs, b"\0")))
        blocks[i][1][c % rbe] = want
        final[c] = want
        out.lines.append(f"Repairing cluster {c} refcount={have} reference={want}")
        if have > want:
            out.leaks_fixed += 1
        else:
            out.corruptions_fixed += 1
    out.writes += [(off, b.dump()) for off, b in blocks.values()]
    return final


def apply(repair: Repair, write: Callable[[int, bytes], None],
          sync: Callable[[], None]) -> None:
    """The repair's writes, durable, then the header's switch (if any), durable."""
    for batch in (repair.writes, repair.then):
        for off, data in batch:
            write(off, data)
        sync()


def json_report(res: Result, filename: str, repair: Repair | None = None) -> dict[str, Any]:
    """qemu-img's ``--output json`` keys (a zero count is left out, as there)."""
    out: dict[str, Any] = {}
    if res.image_end:
        out["image-end-offset"] = res.image_end
    if res.total_clusters:
        out["total-clusters"] = res.total_clusters
    out["check-errors"] = res.check_errors
    for key, v in (("leaks", len(res.leaks)), ("corruptions", res.corruptions),
                   ("leaks-fixed", repair.leaks_fixed if repair else 0),
                   ("corruptions-fixed", repair.corruptions_fixed if repair else 0),
                   ("allocated-clusters", res.allocated),
                   ("fragmented-clusters", res.fragmented),
                   ("compressed-clusters", res.compressed)):
        if v:
            out[key] = v
    out["filename"] = filename
    out["format"] = "qcow2"
    return out


def human_report(res: Result) -> list[str]:
    """qemu-img's words for a pass (stdout)."""
    lines: list[str] = []
    if not (res.corruptions or res.leaks or res.check_errors):
        lines.append("No errors were found on the image.")
    else:
        if res.corruptions:
            lines += ["", f"{res.corruptions} errors were found on the image.",
                      "Data may be corrupted, or further writes to the image may corrupt it."]
        if res.leaks:
            lines += ["", f"{len(res.leaks)} leaked clusters were found on the image.",
                      "This means waste of disk space, but no harm to data."]
        if res.check_errors:
            lines += ["", f"{res.check_errors} internal errors have occurred during the "
                      "check."]
    if res.total_clusters and res.allocated:
        lines.append(f"{res.allocated}/{res.total_clusters} = "
                     f"{res.allocated * 100.0 / res.total_clusters:.2f}% allocated, "
                     f"{res.fragmented * 100.0 / res.allocated:.2f}% fragmented, "
                     f"{res.compressed * 100.0 / res.allocated:.2f}% compressed clusters")
    if res.image_end:
        lines.append(f"Image end offset: {res.image_end}")
    return lines


def finding_lines(res: Result) -> list[str]:
    """One stderr line per finding, as qemu-img prints them."""
    lines = [f"ERROR {m}" for m in res.other]
    for c, (have, want) in sorted((res.low | res.leaks).items()):
        lines.append(f"{'ERROR' if have < want else 'Leaked'} cluster {c} refcount={have} "
                     f"reference={want}")
    for cp in res.copied:
        what = f"L2 cluster: l1_index={cp.l1_index} l1_entry={cp.entry:x}" \
            if cp.l1_index is not None else f"data cluster: l2_entry={cp.entry:x}"
        lines.append(f"ERROR OFLAG_COPIED {what} refcount={cp.refcount}")
    return lines


def clean_bits(h: fmt.Header) -> int:
    """The incompatible features with dirty and corrupt cleared."""
    return h.incompatible & ~(fmt.INCOMPAT_DIRTY | fmt.INCOMPAT_CORRUPT)
