"""The C extent table (aioublk/dataplane/csrc/extents.c) through its Python owner."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from array import array
from dataclasses import dataclass

import pytest

from aioublk._uring import ffi, lib
from aioublk.dataplane.extents import (
    COW,
    COW_SUB,
    DONE,
    FAILED,
    MAP,
    UNUSED,
    ZERO_FD,
    ExtentConflict,
    ExtentTable,
    Handle,
    Piece,
    Record,
)
from aioublk.dataplane.extents import ZERO as ZERO_KIND  # (ZERO: the L2 entry's flag)
from aioublk.qcow2.format import COMPRESSED, COPIED, ZERO

G = 64 * 1024        # granule of most tests (a default qcow2 cluster)
MB = 1 << 20


@pytest.fixture
def t() -> ExtentTable:
    return ExtentTable(G, max_entries=1024)


def test_insert_and_lookup(t: ExtentTable) -> None:
    assert t.lookup(0, 4096, write=False) is None
    assert t.insert(2 * G, 2 * G, 7, 10 * MB, writable=True)
    assert len(t) == 2
    assert t.lookup(2 * G, 4096, write=False) == [(7, 10 * MB, 4096)]
    assert t.lookup(3 * G + 512, 1024, write=True) == [(7, 10 * MB + G + 512, 1024)]
    assert t.lookup(2 * G, 2 * G, write=True) == [(7, 10 * MB, 2 * G)]
    # one byte either side is unmapped
    assert t.lookup(2 * G - 1, 2, write=False) is None
    assert t.lookup(4 * G - 1, 2, write=False) is None
    assert t.lookup(G, 4096, write=False) is None


def test_unaligned_inside_one_granule(t: ExtentTable) -> None:
    t.insert(5 * G, G, 3, 7 * G, writable=False)
    assert t.lookup(5 * G + 1, 1, write=False) == [(3, 7 * G + 1, 1)]
    assert t.lookup(6 * G - 1, 1, write=False) == [(3, 8 * G - 1, 1)]
    assert t.lookup(5 * G + 100, G - 100, write=False) == [(3, 7 * G + 100, G - 100)]
    assert t.lookup(5 * G + 100, G - 99, write=False) is None


def test_reinsert_identical_is_idempotent(t: ExtentTable) -> None:
    assert t.insert(0, 2 * G, 4, 0, writable=True)
    assert t.insert(0, 2 * G, 4, 0, writable=True)
    assert t.insert(G, G, 4, G, writable=True)
    # overlapping an identical mapping and extending it
    assert t.insert(G, 2 * G, 4, G, writable=True)
    assert len(t) == 3
    assert t.lookup(0, 3 * G, write=True) == [(4, 0, 3 * G)]


@pytest.mark.parametrize("fd, host, writable", [(5, 3 * G, True), (4, 4 * G, True),
                                                (4, 3 * G, False)])
def test_conflicting_insert_changes_nothing(t: ExtentTable, fd: int, host: int,
                                            writable: bool) -> None:
    t.insert(G, G, 4, G, writable=True)
    # granules 0 and 2 are free, granule 1 is mapped to (4, G, writable)
    with pytest.raises(ExtentConflict):
        t.insert(0, 3 * G, fd, host - G, writable=writable)
    assert len(t) == 1
    assert t.lookup(0, G, write=False) is None
    assert t.lookup(2 * G, G, write=False) is None
    assert t.lookup(G, G, write=True) == [(4, G, G)]


def test_misaligned_insert(t: ExtentTable) -> None:
    for args in [(512, G, 0), (0, G + 512, 0), (0, G, 512), (0, G, -G)]:
        with pytest.raises(ValueError) as e:
            t.insert(args[0], args[1], 3, args[2], writable=True)
        assert not isinstance(e.value, ExtentConflict)
    with pytest.raises(ValueError):
        t.insert(0, G, -1, 0, writable=True)
    with pytest.raises(ValueError):      # host range past 2**64
        t.insert(0, 2 * G, 3, (1 << 64) - G, writable=True)
    assert len(t) == 0
    with pytest.raises(ValueError):
        ExtentTable(1000)
    with pytest.raises(ValueError):
        ExtentTable(256)


def test_full_table_is_all_or_nothing() -> None:
    t = ExtentTable(4096, max_entries=4)
    assert t.insert(0, 3 * 4096, 3, 0, writable=True)
    assert not t.insert(8192, 3 * 4096, 3, 8192, writable=True)   # needs 2 more
    assert len(t) == 3
    assert t.lookup(12288, 1, write=False) is None
    assert t.insert(8192, 2 * 4096, 3, 8192, writable=True)        # needs 1
    assert len(t) == 4
    assert t.insert(0, 4 * 4096, 3, 0, writable=True)              # needs none
    assert not t.insert(1 << 30, 4096, 3, 0, writable=True)
    assert not t.insert(0, 100 * 4096, 3, 0, writable=True)
    # a removed entry a request holds keeps its slot until released
    held = t.acquire(0, 1, write=False)
    assert held is not None
    assert t.invalidate(0, 4096) == 1
    assert len(t) == 3
    assert not t.insert(1 << 30, 4096, 3, 0, writable=True)
    t.release(held[1])
    assert t.insert(1 << 30, 4096, 3, 0, writable=True)
    assert len(t) == 4


def test_invalidate_partial_overlaps(t: ExtentTable) -> None:
    t.insert(0, 8 * G, 3, 0, writable=True)
    assert t.invalidate(G + 100, 10) == 1                 # inside granule 1
    assert t.lookup(G, 1, write=False) is None
    assert t.invalidate(G, 1) == 0                        # already gone
    assert t.invalidate(3 * G - G // 2, G) == 2           # halves of 2 and 3
    assert t.invalidate(5 * G - 1, 2) == 2                # last byte of 4, first of 5
    assert t.invalidate(0, 0) == 0
    assert len(t) == 3
    assert [t.lookup(g * G, 1, write=False) is not None for g in range(8)] == [
        True, False, False, False, False, False, True, True]
    # wider than the table: the slab is scanned instead of every granule probed
    assert t.invalidate(7 * G, (1 << 64) - 1 - 7 * G) == 1
    assert t.invalidate(0, (1 << 64) - 1) == 2
    assert len(t) == 0


def test_pieces_merge_when_host_contiguous(t: ExtentTable) -> None:
    t.insert(0, G, 3, 10 * G, writable=True)
    t.insert(G, G, 3, 11 * G, writable=True)        # contiguous on host, same fd
    t.insert(2 * G, G, 3, 20 * G, writable=True)    # jump on host
    t.insert(3 * G, G, 4, 21 * G, writable=True)    # contiguous, other fd
    t.insert(4 * G, G, 4, 22 * G, writable=True)
    assert t.lookup(100, 2 * G - 200, write=True) == [(3, 10 * G + 100, 2 * G - 200)]
    assert t.lookup(G + 5, G, write=True) == [(3, 11 * G + 5, G - 5), (3, 20 * G, 5)]
    assert t.lookup(G + 5, 2 * G, write=True) == [
        (3, 11 * G + 5, G - 5), (3, 20 * G, G), (4, 21 * G, 5)]
    assert t.lookup(G // 2, 5 * G - G, write=False) == [
        (3, 10 * G + G // 2, 2 * G - G // 2), (3, 20 * G, G), (4, 21 * G, G + G // 2)]
    # descending host offsets never merge
    t.insert(5 * G, G, 4, 30 * G, writable=True)
    t.insert(6 * G, G, 4, 29 * G, writable=True)
    assert t.lookup(5 * G, 2 * G, write=False) == [(4, 30 * G, G), (4, 29 * G, G)]


def test_read_only_serves_reads_only(t: ExtentTable) -> None:
    t.insert(0, G, 3, 0, writable=True)
    t.insert(G, G, 3, G, writable=False)
    assert t.lookup(G, 512, write=False) == [(3, G, 512)]
    assert t.lookup(G, 512, write=True) is None
    assert t.lookup(0, 2 * G, write=False) == [(3, 0, 2 * G)]
    assert t.lookup(0, 2 * G, write=True) is None
    assert t.lookup(0, G, write=True) == [(3, 0, G)]
    assert t.busy(0, 2 * G) == 0          # a refused acquire holds nothing


def test_busy_until_release_then_slot_reused(t: ExtentTable) -> None:
    t.insert(0, 2 * G, 3, 0, writable=True)
    held = t.acquire(G - 1, 2, write=True)
    assert held is not None
    pieces, handle = held
    assert pieces == [(3, G - 1, 2)]
    assert t.busy(0, 2 * G) == 2 and t.busy(0, G) == 1 and t.busy(G, 1) == 1
    assert t.invalidate(0, G) == 1
    assert t.busy(0, 1) == 1 and t.busy(0, 2 * G) == 2
    # the granule may be mapped anew while the old entry drains
    assert t.insert(0, G, 5, 9 * G, writable=True)
    assert t.lookup(0, 1, write=False) == [(5, 9 * G, 1)]
    assert t.busy(0, 1) == 1
    t.release(handle)
    assert t.busy(0, 2 * G) == 0
    with pytest.raises(RuntimeError):
        t.release(handle)
    # the freed slot serves a new entry; the old handle's ids mean nothing now
    t.invalidate(0, 2 * G)
    t.insert(4 * G, 2 * G, 6, 0, writable=True)
    second = t.acquire(4 * G, 2 * G, write=False)
    assert second is not None and second[0] == [(6, 0, 2 * G)]
    assert t.busy(0, 2 * G) == 0 and t.busy(4 * G, G) == 1
    t.invalidate(4 * G, G)
    assert t.busy(4 * G, 2 * G) == 2
    t.release(second[1])
    assert t.busy(0, 1 << 40) == 0
    assert len(t) == 1


def test_close(t: ExtentTable) -> None:
    t.insert(0, G, 3, 0, writable=True)
    held = t.acquire(0, 1, write=False)
    assert held is not None
    t.invalidate(0, G)
    with pytest.raises(RuntimeError):
        t.close()
    t.release(held[1])
    t.close()
    t.close()
    with pytest.raises(RuntimeError):
        t.cdata  # noqa: B018


@pytest.mark.asyncio
async def test_unmap_waits_for_release(t: ExtentTable) -> None:
    t.insert(0, 4 * G, 3, 0, writable=True)
    held = t.acquire(G, G, write=True)
    other = t.acquire(3 * G, 1, write=False)
    assert held is not None and other is not None
    loop = asyncio.get_running_loop()
    released = loop.create_future()

    def release() -> None:
        t.release(held[1])
        released.set_result(None)

    loop.call_later(0.02, release)
    await t.unmap(0, 2 * G)
    assert released.done()
    assert len(t) == 2 and t.busy(0, 2 * G) == 0
    await asyncio.wait_for(t.unmap(2 * G, G), 1)        # nothing held there
    assert len(t) == 1 and t.busy(3 * G, G) == 1
    t.release(other[1])


def test_large_table() -> None:
    """Granules inserted one by one in random order: the index grows and rehashes
    under a table that must find every one afterwards."""
    n = 50_000
    t = ExtentTable(4096, max_entries=n)
    order = list(range(n))
    random.Random(1).shuffle(order)
    for g in order:
        assert t.insert(g * 4096, 4096, 3, (n - g) * 4096, writable=True)
    assert len(t) == n
    assert not t.insert(n * 4096, 4096, 3, 0, writable=True)
    for g in range(0, n, 997):
        assert t.lookup(g * 4096 + 7, 9, write=True) == [(3, (n - g) * 4096 + 7, 9)]
    assert t.invalidate(4096, (n - 2) * 4096) == n - 2
    assert len(t) == 2
    assert t.lookup((n - 1) * 4096, 1, write=False) == [(3, 4096, 1)]


def test_zero_granules_read_as_zero_pieces_that_merge(t: ExtentTable) -> None:
    """A ZERO granule is a piece with fd -1; zeros after zeros are one piece,
    whatever host data sits between them in the table."""
    assert t.insert_zero(0, 2 * G)
    assert t.insert(2 * G, 2 * G, 7, 10 * G, writable=True)
    assert t.insert_zero(4 * G, G)
    assert len(t) == 5
    assert t.lookup(100, G, write=False) == [(ZERO_FD, 0, G)]
    assert t.lookup(100, 5 * G - 200, write=False) == [
        (ZERO_FD, 0, 2 * G - 100), (7, 10 * G, 2 * G), (ZERO_FD, 0, G - 100)]
    # zeros never merge with the host piece next to them, even at host offset 0
    t.insert(5 * G, G, 7, 0, writable=True)
    assert t.lookup(4 * G, 2 * G, write=False) == [(ZERO_FD, 0, G), (7, 0, G)]


def test_a_write_to_zero_granules_misses(t: ExtentTable) -> None:
    t.insert_zero(0, G)
    t.insert(G, G, 7, 0, writable=True)
    assert t.lookup(0, 512, write=True) is None
    assert t.lookup(G - 512, 1024, write=True) is None
    assert t.lookup(G, 512, write=True) == [(7, 0, 512)]
    assert t.busy(0, 2 * G) == 0          # a refused acquire holds nothing


def test_kinds_conflict_both_ways_and_zero_again_is_fine(t: ExtentTable) -> None:
    assert t.insert_zero(0, 2 * G)
    assert t.insert_zero(G, 2 * G)        # granule 1 already zeros: the same
    assert len(t) == 3
    with pytest.raises(ExtentConflict):
        t.insert(2 * G, 2 * G, 7, 0, writable=False)
    t.insert(4 * G, G, 7, 0, writable=True)
    with pytest.raises(ExtentConflict):
        t.insert_zero(3 * G, 2 * G)
    assert len(t) == 4 and t.lookup(3 * G, 1, write=False) is None
    # insert_kind is the one entry point: a kind it does not know is refused
    with pytest.raises(ValueError):
        t.insert_kind(99, 8 * G, G, 7, 0)
    with pytest.raises(ValueError):
        t.insert_kind(MAP, 8 * G, G)      # data needs an fd
    assert t.insert_kind(ZERO_KIND, 8 * G, G, 7, 5 * G, writable=True)  # (fd etc. unused)
    assert t.lookup(8 * G, G, write=True) is None
    assert t.lookup(8 * G, G, write=False) == [(ZERO_FD, 0, G)]


@pytest.mark.asyncio
async def test_zero_granules_are_held_invalidated_and_waited_for_as_data(
        t: ExtentTable) -> None:
    """What holds a MAP granule holds a ZERO one: a read in flight keeps it
    busy after its removal, and unmap waits for it, so the owner may give it
    data only once no read of its zeros is in flight."""
    t.insert_zero(0, 2 * G)
    held = t.acquire(G - 1, 2, write=False)
    assert held is not None and held[0] == [(ZERO_FD, 0, 2)]
    assert t.busy(0, 2 * G) == 2
    assert t.invalidate(0, G) == 1
    assert t.busy(0, G) == 1 and len(t) == 1
    assert t.insert(0, G, 7, 3 * G, writable=True)   # mapped anew while the old drains
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, t.release, held[1])
    await t.unmap(0, 2 * G)
    assert t.busy(0, 1 << 40) == 0 and len(t) == 0


def _publish(t: ExtentTable, entries: list[int], dev_base: int = 0, **kw: object) -> \
        tuple[bytearray, list[tuple[int, int]]]:
    pub = bytearray(len(entries))
    rules: dict[str, object] = {"used_end": 1 << 40, "size": 1 << 40, "writable_ok": True}
    rules.update(kw)
    return pub, t.publish_l2(7, dev_base, array("Q", entries), pub, **rules)  # type: ignore[arg-type]


def test_publish_l2_applies_the_rules_per_entry(t: ExtentTable) -> None:
    entries = [
        10 * G | COPIED,          # 0 MAP, writable
        11 * G,                     # 1 MAP, read-only (shared)
        0,                          # 2 unallocated, no backing: ZERO
        ZERO,                     # 3 ZERO
        12 * G | COPIED | ZERO,  # 4 zero flag with a host cluster: ZERO
        COMPRESSED | 13 * G,        # 5 compressed: none
        14 * G + 512 | COPIED,    # 6 not cluster aligned: none
        100 * G | COPIED,         # 7 at used_end: none
        15 * G | COPIED,          # 8 a metadata cluster: none
        16 * G | COPIED,          # 9 being changed (skip): none
    ]
    pub, pairs = _publish(t, entries, dev_base=32 * G, used_end=100 * G, meta=[15, 3],
                          skip=[32 + 9])
    assert list(pub) == [MAP, MAP, ZERO_KIND, ZERO_KIND, ZERO_KIND, 0, 0, 0, 0, 0]
    assert pairs == [(10, 32), (11, 33)]
    assert t.lookup(32 * G, 5 * G, write=False) == [(7, 10 * G, 2 * G), (ZERO_FD, 0, 3 * G)]
    assert t.lookup(32 * G, G, write=True) == [(7, 10 * G, G)]
    assert t.lookup(33 * G, G, write=True) is None
    assert len(t) == 5
    # published already: left alone (the pub byte says so), the rest as before
    pub2 = bytearray(pub)
    assert t.publish_l2(7, 32 * G, array("Q", entries), pub2, used_end=100 * G,
                        size=1 << 40, writable_ok=True, meta=[15]) == [(16, 41)]
    assert list(pub2) == list(pub[:9]) + [MAP]


def test_publish_l2_backing_size_and_writability() -> None:
    t = ExtentTable(G, max_entries=1024)
    # a backing file of 2.5 clusters: clusters 0-2 show it, 3 on read as zeros
    pub, _ = _publish(t, [0, 0, 0, 0, ZERO, 5 * G | COPIED], backing_end=2 * G + G // 2,
                      writable_ok=False, size=5 * G + 1)
    assert list(pub) == [0, 0, 0, ZERO_KIND, ZERO_KIND, MAP]
    assert t.lookup(5 * G, G, write=True) is None      # writable_ok off: read-only
    # the disk ends inside entry 1: entries 2 on are past it
    t2 = ExtentTable(G, max_entries=1024)
    pub, _ = _publish(t2, [0, 0, 0], size=G + 1)
    assert list(pub) == [ZERO_KIND, ZERO_KIND, 0]


def test_publish_l2_conflict_and_full_table() -> None:
    t = ExtentTable(G, max_entries=3)
    t.insert(G, G, 7, 50 * G, writable=True)
    with pytest.raises(ExtentConflict):
        _publish(t, [0, 9 * G | COPIED])
    # a full table publishes what fits, in order, and says so in pub
    t.invalidate(0, 1 << 40)
    pub, pairs = _publish(t, [1 * G, 0, 2 * G, 3 * G, 0])
    assert list(pub) == [MAP, ZERO_KIND, MAP, 0, 0] and pairs == [(1, 0), (2, 2)]
    with pytest.raises(ValueError):
        t.publish_l2(7, 0, array("Q", [0]), bytearray(2), used_end=0, size=G,
                     writable_ok=True)
    with pytest.raises(ValueError):  # dev_base not a granule's
        t.publish_l2(7, 512, array("Q", [0]), bytearray(1), used_end=0, size=G,
                     writable_ok=True)


@dataclass
class _Entry:
    fd: int
    host: int
    writable: bool
    inflight: int = 0


class _Model:
    """The table as a dict of granules, entries removed while held kept aside."""

    def __init__(self, granule: int, max_entries: int) -> None:
        self.granule, self.max = granule, max_entries
        self.live: dict[int, _Entry] = {}
        self.gone: list[_Entry] = []
        self.gone_at: list[int] = []

    def span(self, off: int, length: int) -> range:
        return range(off // self.granule, (off + length - 1) // self.granule + 1)

    def insert(self, g0: int, n: int, fd: int, host: int, writable: bool) -> str:
        """fd ZERO_FD: a ZERO insert (no host, never writable)."""
        if fd == ZERO_FD:
            host, writable = 0, False
        need = 0
        for k in range(n):
            e = self.live.get(g0 + k)
            want = (fd, host + k * self.granule if fd != ZERO_FD else 0, writable)
            if e is None:
                need += 1
            elif (e.fd, e.host, e.writable) != want:
                return "conflict"
        if len(self.live) + len(self.gone) + need > self.max:
            return "full"
        for k in range(n):
            self.live.setdefault(g0 + k, _Entry(
                fd, host + k * self.granule if fd != ZERO_FD else 0, writable))
        return "ok"

    def invalidate(self, off: int, length: int) -> int:
        removed = 0
        for g in self.span(off, length) if length else ():
            e = self.live.pop(g, None)
            if e is not None:
                removed += 1
                if e.inflight:
                    self.gone.append(e)
                    self.gone_at.append(g)
        return removed

    def busy(self, off: int, length: int) -> int:
        span = self.span(off, length)
        return (sum(self.live[g].inflight for g in span if g in self.live)
                + sum(e.inflight for e, g in zip(self.gone, self.gone_at, strict=True)
                      if g in span))

    def acquire(self, off: int, length: int, write: bool) -> list[Piece] | None:
        entries = [self.live.get(g) for g in self.span(off, length)]
        if any(e is None or (write and not e.writable) for e in entries):
            return None
        pieces: list[Piece] = []
        pos, end = off, off + length
        for g, e in zip(self.span(off, length), entries, strict=True):
            assert e is not None
            stop = min(end, (g + 1) * self.granule)
            host = e.host + pos - g * self.granule if e.fd != ZERO_FD else 0
            if pieces and pieces[-1][0] == e.fd and (
                    e.fd == ZERO_FD or pieces[-1][1] + pieces[-1][2] == host):
                pieces[-1] = (e.fd, pieces[-1][1], pieces[-1][2] + stop - pos)
            else:
                pieces.append((e.fd, host, stop - pos))
            e.inflight += 1
            pos = stop
        return pieces

    def release(self, entries: list[_Entry]) -> None:
        for e in entries:
            e.inflight -= 1
        keep = [i for i, e in enumerate(self.gone) if e.inflight]
        self.gone = [self.gone[i] for i in keep]
        self.gone_at = [self.gone_at[i] for i in keep]


def _insert(t: ExtentTable, off: int, length: int, fd: int, host: int, writable: bool) -> bool:
    if fd == ZERO_FD:
        return t.insert_zero(off, length)
    return t.insert(off, length, fd, host, writable=writable)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_against_model(seed: int) -> None:
    rng = random.Random(seed)
    gran = 4096
    t, m = ExtentTable(gran, max_entries=48), _Model(gran, 48)
    held: list[tuple[Handle, list[_Entry]]] = []
    space = 64 * gran                   # device offsets beyond stay unmapped

    def rand_range() -> tuple[int, int]:
        off = rng.randrange(space)
        return off, rng.randint(1, 5 * gran)

    for step in range(6000):
        op = rng.random()
        if op < 0.3:
            g0, n = rng.randrange(64), rng.randint(1, 4)
            # few fds and host bases so that neighbours often merge or coincide;
            # ZERO granules among them
            fd, host = rng.choice((3, 4, ZERO_FD)), rng.choice((g0, g0 + 1, 2 * g0, 100)) * gran
            writable = rng.random() < 0.8
            want = m.insert(g0, n, fd, host, writable)

            args = (g0 * gran, n * gran, fd, host)
            if want == "conflict":
                with pytest.raises(ExtentConflict):
                    _insert(t, *args, writable)
            else:
                assert _insert(t, *args, writable) == (want == "ok"), step
        elif op < 0.45:
            off, length = rand_range()
            length = rng.choice((length, length // 8, 0))
            assert t.invalidate(off, length) == m.invalidate(off, length), step
        elif op < 0.8:
            off, length = rand_range()
            write = rng.random() < 0.5
            found = [m.live.get(g) for g in m.span(off, length)]
            want_pieces = m.acquire(off, length, write)
            got = t.acquire(off, length, write=write)
            if want_pieces is None:
                assert got is None, step
            else:
                assert got is not None and got[0] == want_pieces, step
                assert sum(p[2] for p in got[0]) == length
                held.append((got[1], [e for e in found if e is not None]))
        elif op < 0.95 and held:
            handle, entries = held.pop(rng.randrange(len(held)))
            t.release(handle)
            m.release(entries)
        else:
            off, length = rand_range()
            assert t.busy(off, length) == m.busy(off, length), step
        assert len(t) == len(m.live), step
    for handle, entries in held:
        t.release(handle)
        m.release(entries)
    assert t.busy(0, 1 << 63) == 0 and not m.gone
    assert len(t) == len(m.live)


def test_threads_stress() -> None:
    """Three threads acquire and release while a fourth maps and unmaps: every
    piece seen must be one some mapping of that granule gave, and nothing may
    stay held at the end."""
    gran, n, versions = 4096, 32, 3
    big = 1 << 40                       # host = version * big + device offset
    t = ExtentTable(gran, max_entries=n)
    stop = threading.Event()
    errors: list[str] = []
    counts = [0, 0, 0]

    def reader(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            off = rng.randrange(n * gran)
            length = rng.randint(1, 3 * gran)
            held = t.acquire(off, length, write=bool(k % 2))
            if held is None:
                continue
            pos = off
            for fd, host, plen in held[0]:
                if fd != 10 + (host - pos) // big or (host - pos) % big:
                    errors.append(f"{off}+{length}: {held[0]}")
                pos += plen
            if pos != off + length:
                errors.append(f"{off}+{length}: {held[0]} short")
            counts[k] += 1
            t.release(held[1])

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    rng = random.Random(7)
    live: dict[int, int] = {}           # granule -> version
    try:
        for _ in range(20_000):
            g0, cnt = rng.randrange(n), rng.randint(1, 4)
            if rng.random() < 0.5:
                t.invalidate(g0 * gran, cnt * gran)
                for g in range(g0, g0 + cnt):
                    live.pop(g, None)
            else:
                v = rng.randrange(versions)
                if all(live.get(g, v) == v for g in range(g0, g0 + cnt)) and \
                        t.insert(g0 * gran, cnt * gran, 10 + v, v * big + g0 * gran,
                                 writable=True):
                    live.update((g, v) for g in range(g0, g0 + cnt))
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[:5]
    assert len(t) == len(live)
    assert t.busy(0, n * gran) == 0
    assert all(counts), counts


# -- allocation: ALLOC granules, pools, records --------------------------------

AFD = 9             # the fd allocated pieces carry (set_alloc's; never used for I/O here)


def alloc_table(pool_cap: int = 8, log_cap: int = 8) -> tuple[ExtentTable, int]:
    t = ExtentTable(G, max_entries=1024)
    t.set_alloc(AFD, pool_cap, log_cap)
    return t, t.attach()


def test_a_write_to_alloc_granules_takes_clusters_from_its_slots_pool() -> None:
    t, slot = alloc_table()
    assert t.pool_add(slot, [100 * G, 101 * G, 102 * G]) == 3
    assert t.insert_alloc(0, 4 * G)
    assert t.lookup(0, 4 * G, write=False) == [(ZERO_FD, 0, 4 * G)]
    assert t.acquire(G, G, write=True) is None          # no slot: the target's write
    held = t.acquire(G, 2 * G, write=True, slot=slot)
    assert held is not None
    assert held[0] == [(AFD, 100 * G, 2 * G)]           # consecutive clusters merge
    assert t.pool_level(slot) == 1
    # allocating: nobody else may read zeros there, or write
    assert t.acquire(G, 512, write=False) is None
    assert t.acquire(2 * G, 512, write=True, slot=slot) is None
    assert t.busy(G, 2 * G) == 2 and t.stats()["allocating"] == 2
    assert t.drain() == []
    assert t.release(held[1]) == 2
    assert t.drain() == [Record(1, 100 * G, True, slot), Record(2, 101 * G, True, slot)]
    assert t.drain() == []
    assert t.lookup(G, 2 * G, write=True) == [(AFD, 100 * G, 2 * G)]
    # part of a granule allocates the whole (the rest is the pool's zeros)
    assert t.lookup(3 * G + 512, 512, write=True, slot=slot) == [(AFD, 102 * G + 512, 512)]
    assert t.drain() == [Record(3, 102 * G, True, slot)]
    assert t.pool_level(slot) == 0
    assert t.stats()["done"] == 3


def test_failed_records_the_cluster_and_unused_puts_it_back_first() -> None:
    t, slot = alloc_table()
    t.pool_add(slot, [10 * G, 11 * G, 12 * G])
    t.insert_alloc(0, G)
    held = t.acquire(0, G, write=True, slot=slot)
    assert held is not None and held[0] == [(AFD, 10 * G, G)]
    assert t.release(held[1], UNUSED) == 0
    assert t.drain() == [] and t.pool_level(slot) == 3
    held = t.acquire(0, G, write=True, slot=slot)      # the same cluster, first again
    assert held is not None and held[0] == [(AFD, 10 * G, G)]
    assert t.release(held[1], FAILED) == 0
    assert t.drain() == [Record(0, 10 * G, False, slot)]
    assert t.lookup(0, G, write=False) == [(ZERO_FD, 0, G)]    # ALLOC again
    held = t.acquire(0, G, write=True, slot=slot)      # 10 G is never handed out again
    assert held is not None and held[0] == [(AFD, 11 * G, G)]
    t.release(held[1])
    assert t.pool_take(slot) == [12 * G]
    s = t.stats()
    assert (s["done"], s["failed"], s["unused"], s["allocating"]) == (1, 1, 1, 0)
    with pytest.raises(ValueError):
        t.release(Handle(held[1]._ids, 1), 7)


# -- copy-on-write: COW granules ------------------------------------------------

BFD = 7             # the fd a COW granule's data is in (a backing file's)


def test_a_write_to_a_cow_granule_allocates_and_says_what_to_copy() -> None:
    """Reads of a COW granule go to its data; a write takes a pool cluster
    like ALLOC, and the acquisition says which bytes of the old data to copy
    into it: the first granule's head before the write, the last one's tail
    after it, nothing for a granule the write covers."""
    t, slot = alloc_table()
    t.pool_add(slot, [100 * G, 101 * G, 102 * G, 103 * G])
    assert t.insert_kind(COW, 0, 4 * G, BFD, 50 * G)
    assert t.lookup(G + 512, 1024, write=False) == [(BFD, 51 * G + 512, 1024)]
    assert t.acquire(0, G, write=True) is None               # no slot: the target's
    held = t.acquire(G + 512, 2 * G - 1024, write=True, slot=slot)
    assert held is not None
    assert held[0] == [(AFD, 100 * G + 512, 2 * G - 1024)]
    assert held[1].copies == [(BFD, 51 * G, AFD, 100 * G, 512),
                              (BFD, 53 * G - 512, AFD, 102 * G - 512, 512)]
    assert t.acquire(G, 512, write=False) is None            # allocating: no reads
    assert t.release(held[1]) == 2
    assert t.drain() == [Record(1, 100 * G, True, slot), Record(2, 101 * G, True, slot)]
    assert t.lookup(G, 2 * G, write=True) == [(AFD, 100 * G, 2 * G)]
    # a whole granule copies nothing; one the request's middle covers neither
    held = t.acquire(3 * G, G, write=True, slot=slot)
    assert held is not None and held[1].copies == [] and held[0] == [(AFD, 102 * G, G)]
    t.release(held[1])
    # the old acquire (what C served before COW) leaves COW writes to the target
    assert t.insert_kind(COW, 4 * G, G, BFD, 60 * G)
    ids = ffi.new("uint32_t[]", 1)
    pieces = ffi.new("struct aur_ext_piece[]", 1)
    assert lib.aur_ext_acquire(t.cdata, 4 * G, 512, 1, slot, pieces, 1, ids, 1) == 0


@pytest.mark.parametrize("outcome", [FAILED, UNUSED])
def test_a_cow_write_that_did_not_land_leaves_the_old_data(outcome: int) -> None:
    t, slot = alloc_table()
    t.pool_add(slot, [100 * G, 101 * G])
    t.insert_kind(COW, 0, G, BFD, 50 * G)
    held = t.acquire(512, 512, write=True, slot=slot)
    assert held is not None and len(held[1].copies) == 2
    assert t.release(held[1], outcome) == 0
    assert t.drain() == ([Record(0, 100 * G, False, slot)] if outcome == FAILED else [])
    assert t.lookup(0, G, write=False) == [(BFD, 50 * G, G)]  # COW again, where it was
    held = t.acquire(0, 512, write=True, slot=slot)
    assert held is not None
    assert held[0] == [(AFD, (100 if outcome == UNUSED else 101) * G, 512)]
    assert held[1].copies == [(BFD, 50 * G + 512, AFD, held[0][0][1] + 512, G - 512)]
    t.release(held[1])


def test_a_write_to_a_cow_sub_granule_copies_only_its_subclusters() -> None:
    """With subclusters (a 32nd of the granule each, 2 KiB here) a write
    copies only the rest of the subclusters it touches, its record says
    which it made data, and the granule is SUB: part of it in the new
    cluster, the rest still where it was."""
    t, slot = alloc_table()
    t.pool_add(slot, [100 * G, 101 * G, 102 * G])
    sub = G // 32
    assert t.insert_kind(COW_SUB, 0, 3 * G, BFD, 50 * G)
    assert t.lookup(512, 512, write=False) == [(BFD, 50 * G + 512, 512)]
    held = t.acquire(sub + 512, 2 * sub, write=True, slot=slot)  # subclusters 1-3, in part
    assert held is not None and held[0] == [(AFD, 100 * G + sub + 512, 2 * sub)]
    assert held[1].copies == [(BFD, 50 * G + sub, AFD, 100 * G + sub, 512),
                              (BFD, 50 * G + 3 * sub + 512, AFD, 100 * G + 3 * sub + 512,
                               sub - 512)]
    assert t.release(held[1]) == 1
    assert t.drain() == [Record(0, 100 * G, True, slot, 0b1110)]
    assert t.lookup(0, 5 * sub, write=False) == [(BFD, 50 * G, sub), (AFD, 100 * G + sub, 3 * sub),
                                                  (BFD, 50 * G + 4 * sub, sub)]
    # aligned to subclusters: nothing to copy; across granules: each its own
    held = t.acquire(2 * G - 2 * sub, 4 * sub, write=True, slot=slot)
    assert held is not None and held[1].copies == []
    t.release(held[1])
    assert t.drain() == [Record(1, 101 * G, True, slot, 0b11 << 30),
                         Record(2, 102 * G, True, slot, 0b11)]
    assert len(t) == 3
    # a write that did not land leaves it COW_SUB where it was
    t.invalidate(0, 3 * G)
    t.pool_add(slot, [103 * G])
    t.insert_kind(COW_SUB, 3 * G, G, BFD, 60 * G)
    held = t.acquire(3 * G, 512, write=True, slot=slot)
    assert held is not None
    t.release(held[1], UNUSED)
    assert t.lookup(3 * G, G, write=False) == [(BFD, 60 * G, G)]
    with pytest.raises(ValueError):
        ExtentTable(8 * 1024).insert_kind(COW_SUB, 0, 8 * 1024, BFD, 0)  # 256 B subclusters


def test_cow_granules_are_never_written_in_place_and_invalidate_like_any() -> None:
    t, slot = alloc_table()
    t.insert_kind(COW, 0, 2 * G, BFD, 50 * G)
    assert t.insert_kind(COW, 0, G, BFD, 50 * G)             # the same again: no change
    with pytest.raises(ExtentConflict):
        t.insert(0, G, BFD, 50 * G, writable=False)          # as MAP: mapped otherwise
    assert t.acquire(0, G, write=True, slot=slot) is None    # empty pool: a miss
    assert t.invalidate(0, 2 * G) == 2 and len(t) == 0


def test_an_empty_pool_or_no_such_slot_makes_a_write_a_miss() -> None:
    t, slot = alloc_table()
    t.insert_alloc(0, 2 * G)
    t.insert_zero(2 * G, G)
    assert t.acquire(0, G, write=True, slot=slot) is None
    assert t.acquire(0, G, write=True, slot=slot + 1) is None   # not attached
    t.pool_add(slot, [5 * G])
    assert t.acquire(2 * G, G, write=True, slot=slot) is None   # ZERO: still the target's
    assert t.acquire(0, 2 * G, write=True, slot=slot) is None   # two granules, one cluster
    assert t.pool_level(slot) == 1                              # (a miss takes nothing)
    assert t.lookup(0, 3 * G, write=False) == [(ZERO_FD, 0, 3 * G)]
    assert t.lookup(G, G, write=True, slot=slot) == [(AFD, 5 * G, G)]
    with pytest.raises(ValueError):
        t.pool_add(slot, [G + 512])                            # misaligned
    with pytest.raises(ValueError):
        ExtentTable(G).pool_add(0, [G])                        # allocation off
    with pytest.raises(OSError):
        t.set_alloc(AFD, 8, 8)                                 # once


def test_a_full_log_makes_a_write_a_miss_until_drained() -> None:
    t, slot = alloc_table(log_cap=2)
    t.pool_add(slot, [G * k for k in range(10, 16)])
    t.insert_alloc(0, 4 * G)
    a = t.acquire(0, G, write=True, slot=slot)
    b = t.acquire(G, G, write=True, slot=slot)
    assert a is not None and b is not None
    assert t.acquire(2 * G, G, write=True, slot=slot) is None   # two records are promised
    t.release(a[1])
    assert t.acquire(2 * G, G, write=True, slot=slot) is None   # one in the log, one to come
    t.release(b[1], FAILED)
    assert t.acquire(2 * G, G, write=True, slot=slot) is None
    assert [r.ok for r in t.drain()] == [True, False]
    assert t.lookup(2 * G, G, write=True, slot=slot) == [(AFD, 12 * G, G)]


def _notified(efd: int) -> int:
    try:
        return os.eventfd_read(efd)
    except BlockingIOError:
        return 0


def _notifying(efd: int, pool_cap: int, log_cap: int, clusters: int) -> tuple[ExtentTable, int]:
    """A table of 16 ALLOC granules notifying efd, its pool given ``clusters``."""
    t, slot = alloc_table(pool_cap=pool_cap, log_cap=log_cap)
    t.set_notify(efd)
    t.insert_alloc(0, 16 * G)
    t.pool_add(slot, [G * k for k in range(100, 100 + clusters)])
    return t, slot


def _write_each(t: ExtentTable, slot: int, grans: range, efd: int) -> list[tuple[int, int]]:
    """(pool level, notifications) after a completed allocating write to each granule."""
    out = []
    for g in grans:
        t.lookup(g * G, G, write=True, slot=slot)
        out.append((t.pool_level(slot), _notified(efd)))
    return out


def test_notify_once_per_pool_crossing_and_per_half_full_log() -> None:
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        t, slot = _notifying(efd, pool_cap=4, log_cap=64, clusters=4)
        assert _write_each(t, slot, range(3), efd) == [(3, 0), (2, 1), (1, 0)]  # at half, once
        t.pool_add(slot, [200 * G])
        assert _notified(efd) == 0
        assert _write_each(t, slot, range(3, 4), efd) == [(1, 1)]  # again, after a refill
        # the log: notified as it reaches half of 4
        u, s2 = _notifying(efd, pool_cap=16, log_cap=4, clusters=16)
        assert [n for _, n in _write_each(u, s2, range(3), efd)] == [0, 1, 0]
        assert len(u.drain()) == 3
        held = u.acquire(3 * G, G, write=True, slot=s2)
        assert held is not None
        u.release(held[1], FAILED)                          # failed records count too
        u.lookup(4 * G, G, write=True, slot=s2)
        assert _notified(efd) == 1
        u.set_notify(-1)
        assert t.stats()["locks"] > 0
    finally:
        os.close(efd)


@pytest.mark.asyncio
async def test_notify_when_a_held_entry_an_unmap_waits_for_is_let_go() -> None:
    t, slot = alloc_table()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        t.set_notify(efd)
        t.insert(0, G, 3, 0, writable=True)
        held = t.acquire(0, G, write=False)
        assert held is not None
        t.insert(G, G, 3, G, writable=True)
        other = t.acquire(G, G, write=False)
        assert other is not None
        t.invalidate(G, G)
        t.release(other[1])                 # nobody waits: no notification
        assert _notified(efd) == 0
        unmap = asyncio.ensure_future(t.unmap(0, G))
        await asyncio.sleep(0)              # it runs to its first sleep: waiting
        assert not unmap.done()
        t.release(held[1])
        assert _notified(efd) == 1
        await unmap
    finally:
        os.close(efd)


def test_pool_take_returns_what_is_unused_and_room_is_kept_for_what_comes_back() -> None:
    t, slot = alloc_table(pool_cap=4)
    t.insert_alloc(0, 4 * G)
    assert t.pool_add(slot, [G * k for k in (7, 8, 9)]) == 3
    held = t.acquire(0, G, write=True, slot=slot)
    assert held is not None
    assert t.pool_take(slot, 1) == [8 * G]
    assert t.pool_add(slot, [20 * G, 21 * G, 22 * G]) == 2     # one place is 7 G's
    t.release(held[1], UNUSED)
    assert t.pool_level(slot) == 4
    assert t.pool_take(slot) == [7 * G, 9 * G, 20 * G, 21 * G]
    assert t.pool_take(slot) == []
    # a write of several granules gives its clusters back in the pool's order
    t.pool_add(slot, [G * k for k in (30, 32, 34)])
    held = t.acquire(0, 3 * G, write=True, slot=slot)
    assert held is not None and len(held[0]) == 3
    t.release(held[1], UNUSED)
    assert t.pool_take(slot) == [30 * G, 32 * G, 34 * G]


def test_an_allocating_granule_invalidated_still_records_its_cluster() -> None:
    t, slot = alloc_table()
    t.pool_add(slot, [30 * G])
    t.insert_alloc(0, G)
    held = t.acquire(0, G, write=True, slot=slot)
    assert held is not None
    assert t.invalidate(0, G) == 1
    assert len(t) == 0 and t.busy(0, G) == 1
    assert t.release(held[1]) == 1
    assert t.drain() == [Record(0, 30 * G, True, slot)]
    assert t.busy(0, G) == 0 and t.lookup(0, G, write=False) is None


def test_attach_runs_out_of_slots() -> None:
    t = ExtentTable(G)
    assert [t.attach() for _ in range(64)] == list(range(64))
    with pytest.raises(OSError):
        t.attach()


def test_threads_allocate_while_the_owner_invalidates_and_drains() -> None:
    n, nthreads = 64, 4
    t = ExtentTable(G, max_entries=4 * n)
    t.set_alloc(AFD, 16, 256)
    slots = [t.attach() for _ in range(nthreads)]
    t.insert_alloc(0, n * G)
    stop = threading.Event()
    errors: list[str] = []
    allocs = [0] * nthreads

    def writer(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            g, cnt = rng.randrange(n - 1), rng.randint(1, 2)
            held = t.acquire(g * G + rng.randrange(2) * 512, cnt * G - 1024, write=True,
                             slot=slots[k])
            if held is None:
                continue
            if any(fd not in (AFD, ZERO_FD) for fd, _, _ in held[0]):
                errors.append(f"{g}: {held[0]}")
            r = rng.random()
            allocs[k] += t.release(held[1], DONE if r < 0.8 else FAILED if r < 0.9 else UNUSED)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(nthreads)]
    for th in threads:
        th.start()
    rng = random.Random(99)
    added: list[int] = []
    records: list[Record] = []
    nxt = 1000
    try:
        while len(records) < 4000 and not errors:
            for s in slots:
                if t.pool_level(s) < 8:
                    fresh = [G * (nxt + i) for i in range(8)]
                    got = t.pool_add(s, fresh)
                    added += fresh[:got]
                    nxt += 8
            g, cnt = rng.randrange(n), rng.randint(1, 4)
            t.invalidate(g * G, cnt * G)
            t.insert_alloc(g * G, min(cnt, n - g) * G)
            records += t.drain()
    finally:
        stop.set()
        for th in threads:
            th.join()
    records += t.drain()
    left = [h for s in slots for h in t.pool_take(s)]
    assert not errors, errors[:5]
    hosts = [r.host_off for r in records]
    assert len(set(hosts)) == len(hosts)                    # each cluster given once
    assert sorted(hosts + left) == sorted(added)            # and none lost
    assert sum(r.ok for r in records) == sum(allocs)
    assert t.busy(0, n * G) == 0
    s = t.stats()
    assert (s["allocating"], s["log_n"]) == (0, 0)
    assert s["done"] == sum(allocs) and s["failed"] == len(records) - sum(allocs)
    assert s["failed"] and s["unused"]                      # every outcome was met


def sub_table() -> tuple[ExtentTable, int, int]:
    """A table whose granule 0 is SUB: subclusters 1-3 data in cluster 100,
    the others in the backing file at 50 (as a COW_SUB's first write leaves
    it)."""
    t, slot = alloc_table()
    sub = G // 32
    t.pool_add(slot, [100 * G])
    t.insert_kind(COW_SUB, 0, G, BFD, 50 * G)
    held = t.acquire(sub, 3 * sub, write=True, slot=slot)
    assert held is not None and held[1].copies == []
    t.release(held[1])
    assert t.drain() == [Record(0, 100 * G, True, slot, 0b1110)]
    return t, slot, sub


def test_a_sub_granule_reads_each_subcluster_from_where_it_is() -> None:
    t, slot, sub = sub_table()
    assert t.lookup(0, G, write=False) == [(BFD, 50 * G, sub), (AFD, 100 * G + sub, 3 * sub),
                                           (BFD, 50 * G + 4 * sub, G - 4 * sub)]
    assert t.lookup(2 * sub + 512, 512, write=False) == [(AFD, 100 * G + 2 * sub + 512, 512)]
    # more runs than pieces: a miss, whole
    pieces = ffi.new("struct aur_ext_piece[2]")
    ids = ffi.new("uint32_t[1]")
    assert lib.aur_ext_acquire(t.cdata, 0, G, 0, slot, pieces, 2, ids, 1) == 0
    assert t.stats()["allocating"] == 0


def test_a_write_to_a_sub_granule_goes_in_place_or_copies_the_rest_of_new_subclusters() -> None:
    """A write to subclusters that are data goes in place with nothing to
    record; one that touches others copies the rest of those from the
    backing data into the granule's own cluster (no pool), holds the
    granule alone meanwhile, and its record (GROWN) says which subclusters
    are data now. When all are, the granule is MAP."""
    t, slot, sub = sub_table()
    held = t.acquire(sub + 512, 1024, write=True, slot=slot)  # inside data: in place
    assert held is not None and held[0] == [(AFD, 100 * G + sub + 512, 1024)]
    assert held[1].copies == [] and not held[1].allocates
    assert t.acquire(sub, 512, write=True, slot=slot) is not None  # (shared, as MAP)
    assert t.release(held[1]) == 0 and t.drain() == []
    # from the middle of subcluster 3 (data) into the middle of 5: copies 5's tail
    held = t.acquire(3 * sub + 512, 2 * sub, write=True, slot=slot)
    assert held is not None and held[1].allocates
    assert held[0] == [(AFD, 100 * G + 3 * sub + 512, 2 * sub)]
    assert held[1].copies == [(BFD, 50 * G + 5 * sub + 512, AFD, 100 * G + 5 * sub + 512,
                               sub - 512)]
    assert t.acquire(0, 512, write=False) is None   # held alone until it lands
    assert t.pool_level(slot) == 0                  # (no pool cluster taken)
    assert t.release(held[1]) == 1
    assert t.drain() == [Record(0, 100 * G, True, slot, 0b111110, grown=True)]
    assert t.lookup(4 * sub, 3 * sub, write=False) == [(AFD, 100 * G + 4 * sub, 2 * sub),
                                                        (BFD, 50 * G + 6 * sub, sub)]
    # the head of subcluster 0, the rest of the granule: all data now, MAP
    held = t.acquire(512, G - 512, write=True, slot=slot)
    assert held is not None
    assert held[1].copies == [(BFD, 50 * G, AFD, 100 * G, 512)]
    t.release(held[1])
    assert t.drain() == [Record(0, 100 * G, True, slot, 0xFFFF_FFFF, grown=True)]
    assert t.lookup(0, G, write=True) == [(AFD, 100 * G, G)]


@pytest.mark.parametrize("outcome", [FAILED, UNUSED])
def test_a_sub_write_that_did_not_land_leaves_the_granule_as_it_was(outcome: int) -> None:
    """Nothing to free (the cluster stays the granule's) and nothing to
    record: the subclusters it touched still read from the backing data."""
    t, slot, sub = sub_table()
    before = t.lookup(0, G, write=False)
    held = t.acquire(6 * sub, 512, write=True, slot=slot)
    assert held is not None and held[1].allocates
    assert t.release(held[1], outcome) == 0
    assert t.drain() == []
    assert t.lookup(0, G, write=False) == before
    assert t.stats()["allocating"] == 0


def test_a_sub_write_needs_room_in_the_log_and_a_slot() -> None:
    t, slot = alloc_table(log_cap=1)
    sub = G // 32
    assert t.insert_sub(0, AFD, 100 * G, 0b1, BFD, 50 * G)
    assert t.insert_sub(G, AFD, 101 * G, 0b1, BFD, 51 * G)
    assert t.insert_sub(0, AFD, 100 * G, 0b1, BFD, 50 * G)  # the same again: no change
    with pytest.raises(ExtentConflict):
        t.insert_sub(0, AFD, 100 * G, 0b11, BFD, 50 * G)
    assert t.acquire(sub, 512, write=True, slot=-1) is None  # no slot: no record
    first = t.acquire(sub, 512, write=True, slot=slot)
    assert first is not None
    assert t.acquire(G + sub, 512, write=True, slot=slot) is None  # the log's room is taken
    assert t.acquire(G, 512, write=True, slot=slot) is not None  # (in place: no record)
    t.release(first[1])
    assert [r.subs for r in t.drain()] == [0b11]
    for bad in [(0, AFD, 100 * G, 0, BFD, 0), (0, AFD, 100 * G, 0xFFFF_FFFF, BFD, 0),
                (512, AFD, 100 * G, 1, BFD, 0), (0, -1, 100 * G, 1, BFD, 0)]:
        with pytest.raises(ValueError):
            t.insert_sub(*bad)
