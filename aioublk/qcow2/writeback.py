"""The write-back as a plan: which metadata writes, in which order, with which
barriers (``fdatasync``) between them. No I/O here. ``plan`` takes the cut (the
bytes of every dirty table, and where each goes) and the map of metadata
clusters, checks every write against the map, and returns the steps; the
image runs them (``aioublk.qcow2.flush``). The order that makes an image
crash safe is stated here once, and a test can record it, cut it at any
barrier, or break it on purpose to see the checker notice.

The order (QEMU's cache dependencies, see ``qcow2_cache_set_dependency``):

1. refcount blocks: the counts of every cluster allocated since the last
   write-back (data, L2 tables, new refcount blocks, a grown refcount table);
2. barrier, then the refcount table, when it gained a block or grew: it must
   never name a block that is not on disk;
3. barrier, then the header, when the refcount table moved: it must never
   name a table that is not on disk;
4. barrier: data clusters and refcounts are durable before anything points
   at a cluster (a crash leaves a counted cluster nobody uses: a leak);
5. the L2 tables, then a barrier: before the L1 entries that point at new
   tables;
6. the changed 512-byte sectors of the L1 table, then a barrier: the flush
   is durable.

A crash between any two barriers therefore leaves at worst leaked clusters.
Frees go the other way (a cluster's count drops only after the L2/L1 change
that dropped its last user is durable): the image applies them after a
write-back, as the plan of a cut that holds only refcount blocks (the
blocks, then one barrier).

Overlap checks (QEMU's ``qcow2_pre_write_overlap_check``): every write must
land only on clusters the map says hold its own kind of table; anything else
is refused before the first write of the plan (``Overlap``), and the image
marks itself corrupt instead of overwriting data or other metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# metadata kinds, strongest first (where two claim one cluster, the lower wins)
HEADER, L1, REFTABLE, REFBLOCK, SNAPSHOT, L2 = range(6)
KIND_NAMES = {HEADER: "header", L1: "L1 table", REFTABLE: "refcount table",
              REFBLOCK: "refcount block", SNAPSHOT: "snapshot table", L2: "L2 table"}


@dataclass(frozen=True, slots=True)
class Write:
    kind: int
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Barrier:
    why: str


Step = Write | Barrier


@dataclass(slots=True)
class Cut:
    """What a write-back writes: (file offset, bytes) of each dirty table."""

    refblocks: list[tuple[int, bytes]] = field(default_factory=list)
    reftable: tuple[int, bytes] | None = None
    header: bytes | None = None  #: sector 0, when the refcount table moved
    l2: list[tuple[int, bytes]] = field(default_factory=list)
    l1: list[tuple[int, bytes]] = field(default_factory=list)  #: changed sectors


class Overlap(Exception):
    """A planned write would land on something other than its own kind."""


def plan(cut: Cut, meta: Mapping[int, int], cluster_bits: int) -> list[Step]:
    """The steps that write ``cut`` crash-safely (see the module docstring)."""
    steps: list[Step] = [Write(REFBLOCK, off, raw) for off, raw in cut.refblocks]
    if cut.reftable is not None:
        steps.append(Barrier("refcount blocks before the table that names them"))
        steps.append(Write(REFTABLE, *cut.reftable))
    if cut.header is not None:
        steps.append(Barrier("the refcount table before the header that names it"))
        steps.append(Write(HEADER, 0, cut.header))
    steps.append(Barrier("data and refcounts before the L2 entries that use them"))
    if cut.l2:
        steps += [Write(L2, off, raw) for off, raw in cut.l2]
        steps.append(Barrier("L2 tables before the L1 entries that point at them"))
    if cut.l1:
        steps += [Write(L1, off, raw) for off, raw in cut.l1]
        steps.append(Barrier("the L1 table durable"))
    check(steps, meta, cluster_bits)
    return steps


def check(steps: list[Step], meta: Mapping[int, int], cluster_bits: int) -> None:
    """Refuse any write onto a cluster that does not hold its own kind."""
    for s in steps:
        if type(s) is not Write:
            continue
        for c in range(s.offset >> cluster_bits,
                       ((s.offset + len(s.data) - 1) >> cluster_bits) + 1):
            if meta.get(c) != s.kind:
                raise Overlap(f"a {KIND_NAMES[s.kind]} write to {s.offset:#x} would "
                              f"overwrite {KIND_NAMES.get(meta.get(c, -1), 'data')}")
