"""Internal snapshots created, applied and deleted on an image nothing has
open (``aioublk img snapshot -c|-a|-d``), as ``qemu-img snapshot`` does.

Each operation is planned from the image as ``check.scan`` counts it, free
of I/O, and writes only to clusters past everything in use until one
header write (within one sector) switches to them: the new snapshot table,
a new active L1 table (and a snapshot's copy of the old one), the L2 tables
whose COPIED flags the new refcounts change, written anew, and a refcount
structure rebuilt from the references (so leaks go, and a dirty image's
refcounts are made right). A crash before the switch leaves the old image
with leaks, after it the new one: never a flag that lets a write reach a
snapshot. The old metadata is left free in the file, for later allocations.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from aioublk.qcow2 import check as chk
from aioublk.qcow2 import format as fmt
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, Qcow2Error

Read = chk.Read

#: QEMU's bound on the snapshot table (QCOW_MAX_SNAPSHOTS_SIZE)
MAX_TABLE_BYTES = 64 << 20
#: size, crypt method, L1 size and offset, reftable offset and clusters,
#: snapshot count and table offset: bytes 24-71, one write
_SWITCH = struct.Struct(">QIIQQIIQ")
OFF_SWITCH = 24


@dataclass
class Plan:
    """The writes of one operation, in two durable steps: everything new,
    then the header's switch to it (one write, within one sector)."""

    before: list[tuple[int, bytes]] = field(default_factory=list)
    switch: list[tuple[int, bytes]] = field(default_factory=list)


def apply(plan: Plan, write: Callable[[int, bytes], None], sync: Callable[[], None]) -> None:
    for step in (plan.before, plan.switch):
        for off, data in step:
            write(off, data)
        sync()


class _Image:
    """An image as the planner sees it: header, scan, snapshots."""

    def __init__(self, read: Read, file_size: int, progress: chk.Progress | None) -> None:
        self.read, self.file_size = read, file_size
        self.h, self.res = chk.scan(read, file_size, progress)
        if self.res.other or self.res.check_errors:
            raise Qcow2Error("the image is corrupt: repair it first with "
                             "'aioublk img check -r all' (or qemu-img check -r all)")
        if self.h.incompatible & fmt.INCOMPAT_CORRUPT:
            raise Qcow2Error("the image is marked corrupt: repair it first with "
                             "'aioublk img check -r all'")
        self.snaps: list[fmt.Snapshot] = []
        if self.h.nb_snapshots:
            self.snaps = fmt.parse_snapshots(read(self.h.snapshots_offset, MAX_TABLE_BYTES),
                                             self.h.nb_snapshots)[0]

    def table(self, offset: int, entries: int) -> list[int]:
        return chk._table(self.read, offset, entries)

    def l1_refs(self, offset: int, size: int) -> dict[int, int]:
        """What an L1 table's entries reference (its L2 tables, their data
        clusters), each as often as check counts it; not the table itself."""
        s = chk._Scan(self.read, self.file_size)
        s.l1(offset, size, active=False)
        chk.unref(s.res.refs, self.clusters(offset, size * 8))
        return s.res.refs

    def clusters(self, offset: int, length: int) -> range:
        return chk._clusters(offset, length, self.h.cluster_bits)


def _find(snaps: list[fmt.Snapshot], key: str, *, by_id: bool) -> int:
    """The index of the snapshot ``key`` names: by ID first (where asked),
    then by name, the first match, as QEMU looks them up; none is an error."""
    if by_id:
        for i, s in enumerate(snaps):
            if s.id == key:
                return i
    for i, s in enumerate(snaps):
        if s.name == key:
            return i
    raise Qcow2Error("snapshot not found")


def _new_id(snaps: list[fmt.Snapshot]) -> str:
    """One more than the highest numeric ID, as QEMU picks it."""
    return str(max((int(s.id) for s in snaps if s.id.isdigit()), default=0) + 1)


def _plan(img: _Image, snaps: list[bytes], active: tuple[int, int], *,
          copy: fmt.Snapshot | None = None, drop: fmt.Snapshot | None = None,
          size: int | None = None) -> Plan:
    """The writes that make ``snaps`` the snapshot table and the L1 table at
    ``active`` (offset, entries) the active disk's, with ``copy`` (a new
    snapshot, its L1 placed here) a copy of the active L1 as it was, and
    ``drop``'s L1 gone."""
    h, res = img.h, img.res
    cs = h.cluster_size
    counts = dict(res.refs)
    # what goes: the refcount structure, the snapshot table, the active L1, a dropped one
    chk.unref(counts, img.clusters(h.refcount_table_offset, h.refcount_table_clusters * cs))
    chk.unref(counts, res.refblock_clusters)
    if h.nb_snapshots:
        chk.unref(counts, img.clusters(h.snapshots_offset, sum(len(s.raw) for s in img.snaps)))
    for off, n in [(h.l1_table_offset, h.l1_size)] + \
            ([(drop.l1_table_offset, drop.l1_size)] if drop else []):
        chk.unref(counts, img.clusters(off, n * 8))
        for c, k in img.l1_refs(off, n).items():
            chk.unref(counts, [c] * k)
    # what comes, past everything in use
    at = max(-(-img.file_size // cs), max(counts, default=0) + 1)
    plan = Plan()

    def place(data: bytes) -> int:
        nonlocal at
        off = at * cs
        n = max(1, -(-len(data) // cs))
        for c in range(at, at + n):
            counts[c] = counts.get(c, 0) + 1
        at += n
        plan.before.append((off, data))
        return off

    sources = [active] + ([(h.l1_table_offset, h.l1_size)] if copy else [])
    for off, n in sources:
        for c, k in img.l1_refs(off, n).items():
            counts[c] = counts.get(c, 0) + k
    if copy is not None:
        copy.l1_size = h.l1_size
        copy.l1_table_offset = place(b"".join(
            struct.pack(">Q", e & ~COPIED) for e in img.table(h.l1_table_offset, h.l1_size)))
        snaps = snaps + [fmt.pack_snapshot(copy)]
    table = b"".join(snaps)
    if len(table) > MAX_TABLE_BYTES or len(snaps) > fmt.MAX_SNAPSHOTS:
        raise Qcow2Error("the snapshot table would be too large: delete snapshots first")
    table_off = place(table) if snaps else 0
    l1 = img.table(*active)
    if size is not None:  # (an L1 that covers the size the disk takes)
        l1 += [0] * (-(-size // (cs * h.l2_entries)) - len(l1))
    l1_off = place(b"".join(struct.pack(">Q", e) for e in _flagged_l1(img, l1, counts, place)))
    writes, reftable = chk.refcount_structure(h, counts, at)
    plan.before += writes
    rt_off, rt_clusters = struct.unpack(">QI", reftable)
    head = _SWITCH.pack(h.size if size is None else size, h.crypt_method, len(l1), l1_off,
                        rt_off, rt_clusters, len(snaps), table_off)
    if h.version >= 3:  # (a dirty image's refcounts are now right)
        head += fmt.pack_u64(h.incompatible & ~fmt.INCOMPAT_DIRTY)
    plan.switch.append((OFF_SWITCH, head))
    return plan


def _flagged(e: int, counts: dict[int, int], bits: int) -> int:
    """Entry ``e`` with its COPIED flag as its cluster's refcount says."""
    if not e & OFFSET_MASK or counts.get((e & OFFSET_MASK) >> bits) != 1:
        return e & ~COPIED
    return e | COPIED


def _flagged_l1(img: _Image, l1: list[int], counts: dict[int, int],
                place: Callable[[bytes], int]) -> list[int]:
    """The active L1's entries with their COPIED flags right, and those of
    their L2 tables: a table whose flags must change is written anew (and
    the old one left to whatever else names it), so nothing in use is
    written before the switch."""
    bits = img.h.cluster_bits
    out = []
    for e in l1:
        l2 = e & OFFSET_MASK
        if not l2:
            out.append(0)
            continue
        entries, subs = chk.l2_table(img.read, l2, img.h)
        want = [d if d & COMPRESSED else _flagged(d, counts, bits) for d in entries]
        if want != entries:  # (an extended L2 table keeps its subcluster words)
            chk.unref(counts, [l2 >> bits])
            l2 = place(fmt.join_l2(array("Q", want),
                                   array("Q", subs) if subs is not None else None))
        out.append(_flagged(l2, counts, bits))
    return out


def plan_create(read: Read, file_size: int, name: str, *, now: float | None = None,
                progress: chk.Progress | None = None) -> Plan:
    """A snapshot of the active disk named ``name`` (names may repeat, as in QEMU)."""
    img = _Image(read, file_size, progress)
    if img.h.refcount_bits < 2:
        raise Qcow2Error("the image's refcounts are 1 bit wide, too narrow for a cluster "
                         "two snapshots share: widen them first (qemu-img amend -o "
                         "refcount_bits=16)")
    t = time.time() if now is None else now
    sn = fmt.Snapshot(0, 0, name, _new_id(img.snaps), int(t), int(t % 1 * 1e9) // 1000 * 1000,
                      0, 0, 0, img.h.size)
    return _plan(img, [s.raw for s in img.snaps], (img.h.l1_table_offset, img.h.l1_size),
                 copy=sn)


def plan_delete(read: Read, file_size: int, name: str,
                progress: chk.Progress | None = None) -> Plan:
    """The first snapshot named ``name`` gone (by name only, as qemu-img -d)."""
    img = _Image(read, file_size, progress)
    i = _find(img.snaps, name, by_id=False)
    return _plan(img, [s.raw for j, s in enumerate(img.snaps) if j != i],
                 (img.h.l1_table_offset, img.h.l1_size), drop=img.snaps[i])


def plan_apply(read: Read, file_size: int, key: str,
               progress: chk.Progress | None = None) -> Plan:
    """The disk as snapshot ``key`` (an ID, or else a name) holds it."""
    img = _Image(read, file_size, progress)
    i = _find(img.snaps, key, by_id=True)
    h = img.h
    if h.autoclear & fmt.AUTOCLEAR_BITMAPS and fmt.EXT_BITMAPS in h.extensions and any(
            b.flags & fmt.BITMAP_AUTO for b in fmt.parse_bitmaps(h.extensions[fmt.EXT_BITMAPS],
                                                                 read)):
        raise Qcow2Error("the image has active dirty bitmaps, which would not record the "
                         "change: remove or disable them first (qemu-img bitmap)")
    sn = img.snaps[i]
    return _plan(img, [s.raw for s in img.snaps], (sn.l1_table_offset, sn.l1_size),
                 size=sn.disk_size or h.size)
