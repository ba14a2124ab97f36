"""Power cut, not just kill -9 (host only, QEMU's tools as the oracle).

kill -9 keeps the page cache, so it cannot tell a write-back that syncs in
the right order from one that never syncs. Here the engine runs a workload
over a recording layer under its image file (every write with its bytes,
every sync as a barrier, each with when it was submitted and when it
completed), and crash images are built from the recording at every cut
point: the file as of the last completed sync (every write that completed
before that sync began), plus any subset of the writes submitted before the
next sync completed, in random subsets with fixed seeds, some of them torn
(only a prefix of their 512-byte sectors written). Each crash image must
pass ``qemu-img check`` (exit 0, or 3: leaked clusters only; never 2,
corruption) and read back, through ``qemu-img convert``, exactly what the
last completed flush made durable (the sectors no later request touched).

Workloads: allocation, copy-on-write over a backing file, copy-on-write
over an internal snapshot (``qemu-img snapshot -c``), refcount-table growth,
discard and reuse of the freed clusters, and the metadata write-through
mode. The checker is checked too: a write-back plan with a barrier dropped,
or with refcount blocks and L2 tables swapped, must be caught.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioublk.io.hostfile import HostFile
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2 import writeback as wbplan
from aioublk.ring import Ring
from tests.support.qcow2_util import SECTOR, K, M, create, qemu_img, qemu_io, to_raw

VARIANTS = 14  # crash images per cut point besides "nothing after" and "everything after"


# -- the recording layer ------------------------------------------------------------------


@dataclass
class WriteEv:
    offset: int
    data: bytes
    submit: int
    complete: int = 1 << 62  # never, until it completes


@dataclass
class SyncEv:
    begin: int
    end: int


@dataclass
class Recording:
    initial: bytes
    writes: list[WriteEv] = field(default_factory=list)
    syncs: list[SyncEv] = field(default_factory=list)
    flushes: list[tuple[int, bytes]] = field(default_factory=list)  # (when, disk content)
    touched_after: list[bytearray] = field(default_factory=list)  # per flush: sector mask
    clock: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock


def recording_file(rec: Recording) -> type[HostFile]:
    """A HostFile that records into ``rec`` (swapped in as the image file's class)."""

    class RecordingFile(HostFile):
        __slots__ = ()

        async def write(self, buf: Any, offset: int) -> None:
            ev = WriteEv(offset, bytes(buf), rec.tick())
            rec.writes.append(ev)
            await super().write(buf, offset)
            ev.complete = rec.tick()

        async def writev(self, bufs: list[Any], offset: int) -> None:
            ev = WriteEv(offset, b"".join(bytes(b) for b in bufs), rec.tick())
            rec.writes.append(ev)
            await super().writev(bufs, offset)
            ev.complete = rec.tick()

        async def sync(self) -> None:
            begin = rec.tick()
            await super().sync()
            rec.syncs.append(SyncEv(begin, rec.tick()))

    return RecordingFile


class Disk:
    """The expected content of the virtual disk, and what touched which sector."""

    def __init__(self, content: bytes) -> None:
        self.content = bytearray(content)
        self.masks: list[bytearray] = []  # one per flush so far: sectors touched since

    def touch(self, off: int, data: bytes) -> None:
        self.content[off:off + len(data)] = data
        s, e = off // SECTOR, -(-(off + len(data)) // SECTOR)
        for m in self.masks:
            m[s:e] = b"\1" * (e - s)


class Session:
    """A workload's view: requests through the engine, mirrored into ``disk``."""

    def __init__(self, img: Qcow2Image, rec: Recording, disk: Disk) -> None:
        self.img, self.rec, self.disk = img, rec, disk

    async def batch(self, ops: list[tuple[str, int, int]], rng: random.Random) -> None:
        """Non-overlapping (kind, offset, length) requests, all at once."""
        calls: list[Awaitable[None]] = []
        for kind, off, n in ops:
            if kind == "write":
                data = rng.randbytes(n)
                calls.append(self.img.write(off, data))
            else:
                data = bytes(n)
                calls.append(self.img.write_zeroes(off, n, unmap=kind == "zero-unmap")
                             if kind.startswith("zero") else self.img.discard(off, n))
            self.disk.touch(off, data)
        await asyncio.gather(*calls)

    async def flush(self) -> None:
        await self.img.flush()
        self.flushed()

    def flushed(self) -> None:
        self.rec.flushes.append((self.rec.tick(), bytes(self.disk.content)))
        mask = bytearray(len(self.disk.content) // SECTOR)
        self.disk.masks.append(mask)
        self.rec.touched_after.append(mask)


Workload = Callable[[Session, random.Random], Awaitable[None]]


def record(path: Path, workload: Workload, seed: int, *, write_through: bool = False) -> Recording:
    """Run ``workload`` on the image at ``path`` and record what reached the file."""
    raw = path.with_suffix(".start.raw")
    to_raw(path, raw)
    disk = Disk(raw.read_bytes())
    raw.unlink()

    async def main() -> Recording:
        ring = Ring(256, bind_thread=True)
        try:
            img = Qcow2Image.open(str(path), metadata_write_through=write_through)
            rec = Recording(path.read_bytes())
            img.file.__class__ = recording_file(rec)
            s = Session(img, rec, disk)
            try:
                await workload(s, random.Random(seed))
            finally:
                await img.close()
            s.flushed()
            return rec
        finally:
            ring.close()
    return asyncio.run(main())


# -- crash images -------------------------------------------------------------------------


@dataclass
class Report:
    workload: str
    cut_points: int = 0
    images: int = 0
    leaky: int = 0
    sectors: int = 0  # flushed sectors compared, over all crash images
    corrupt: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.workload}: {self.cut_points} cut points, {self.images} crash images, "
                f"{self.leaky} with leaks, {self.sectors} flushed sectors compared, "
                f"{len(self.corrupt)} bad")


def apply(img: bytearray, ev: WriteEv, sectors: int | None = None) -> None:
    data = ev.data if sectors is None else ev.data[:sectors * SECTOR]
    end = ev.offset + len(data)
    if end > len(img):
        img.extend(bytes(end - len(img)))
    img[ev.offset:end] = data


def crash_images(rec: Recording, seed: int) -> list[tuple[str, bytes, int]]:
    """(name, file bytes, crash clock) for every cut point and variant."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes, int]] = []
    bounds = [SyncEv(0, 0)] + rec.syncs  # "before the first sync" is a cut point too
    for i, sync in enumerate(bounds):
        until = bounds[i + 1].end if i + 1 < len(bounds) else rec.clock + 1
        durable = [w for w in rec.writes if w.complete < sync.begin]
        later = [w for w in rec.writes if w.complete >= sync.begin and w.submit < until]
        base = bytearray(rec.initial)
        for w in durable:
            apply(base, w)
        picks: list[tuple[str, list[WriteEv], WriteEv | None]] = [("none", [], None)]
        if later:
            picks.append(("all", later, None))
            for v in range(VARIANTS):
                chosen = [w for w in later if rng.random() < 0.5]
                torn = rng.choice(later) if v % 2 else None
                picks.append((f"subset{v}" + ("+torn" if torn else ""), chosen, torn))
        for name, chosen, torn in picks:
            img = bytearray(base)
            for w in sorted(chosen + ([torn] if torn else []), key=lambda w: w.submit):
                if w is torn:
                    apply(img, w, rng.randrange(len(w.data) // SECTOR + 1))
                else:
                    apply(img, w)
            out.append((f"cut {i}/{len(bounds) - 1} {name}", bytes(img), until - 1))
    return out


def expected(rec: Recording, crash: int) -> tuple[bytes, bytearray] | None:
    """The disk content of the last flush completed before ``crash``, and the
    mask of sectors touched after it (those may hold either)."""
    done = [k for k, (when, _c) in enumerate(rec.flushes) if when < crash]
    if not done:
        return None
    k = done[-1]
    return rec.flushes[k][1], rec.touched_after[k]


def check_one(tmp: Path, name: str, data: bytes, want: tuple[bytes, bytearray] | None,
              ) -> tuple[str, int, int, str]:
    """(name, qemu-img check exit, flushed sectors compared, problem or "")."""
    path = tmp / f"crash-{threading.get_ident()}.qcow2"
    path.write_bytes(data)
    check = subprocess.run(["qemu-img", "check", str(path)], capture_output=True, text=True)
    if check.returncode not in (0, 3):
        return name, check.returncode, 0, (f"qemu-img check exit {check.returncode}: "
                                           + " | ".join(check.stdout.splitlines()[:4]))
    compared = 0
    if want is not None:
        raw = path.with_suffix(".raw")
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(raw)], check=True)
        got = raw.read_bytes()
        content, touched = want
        for s in range(len(touched)):
            if touched[s]:
                continue
            compared += 1
            if got[s * SECTOR:(s + 1) * SECTOR] != content[s * SECTOR:(s + 1) * SECTOR]:
                return name, check.returncode, compared, f"flushed sector {s} reads back wrong"
    return name, check.returncode, compared, ""


def check_recording(rec: Recording, tmp: Path, workload: str, seed: int,
                    stop_at_corruption: bool = False) -> Report:
    rep = Report(workload, cut_points=len(rec.syncs) + 1)
    images = crash_images(rec, seed)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(check_one, tmp, name, data, expected(rec, crash))
                for name, data, crash in images]
        for f in futs:
            name, rc, compared, problem = f.result()
            rep.images += 1
            rep.sectors += compared
            rep.leaky += rc == 3
            if problem:
                rep.corrupt.append(f"{name}: {problem}")
                if stop_at_corruption:
                    for g in futs:
                        g.cancel()
                    break
    return rep


# -- workloads ----------------------------------------------------------------------------


def spread(rng: random.Random, size: int, slot: int, n: int, kinds: tuple[str, ...] = ("write",),
           ) -> list[tuple[str, int, int]]:
    """``n`` requests in distinct ``slot``-sized slots, unaligned inside them."""
    ops = []
    for s in rng.sample(range(size // slot), n):
        length = rng.randrange(1, slot // SECTOR + 1) * SECTOR
        off = s * slot + rng.randrange(0, (slot - length) // SECTOR + 1) * SECTOR
        ops.append((rng.choice(kinds), off, length))
    return ops


async def allocation(s: Session, rng: random.Random) -> None:
    for round_ in range(8):
        await s.batch(spread(rng, s.img.size, 32 * K, 12), rng)
        await s.batch(spread(rng, s.img.size, 32 * K, 6, ("write", "zero", "zero-unmap")), rng)
        if round_ % 2:
            await s.flush()


async def overwrite(s: Session, rng: random.Random) -> None:
    """Partial overwrites of what lies below (backing file or snapshot): COW."""
    for _round in range(4):
        await s.batch(spread(rng, s.img.size, 64 * K, 10), rng)
        await s.flush()


async def many_clusters(s: Session, rng: random.Random) -> None:
    """2.4 MiB of data in 512 B clusters: the file outgrows the 2 MiB the first
    refcount table covers."""
    slots = rng.sample(range(s.img.size // (4 * K)), 600)
    for r in range(0, len(slots), 100):
        await s.batch([("write", slot * 4 * K, 4 * K) for slot in slots[r:r + 100]], rng)
        if r % 200:
            await s.flush()


async def discard_reuse(s: Session, rng: random.Random) -> None:
    await s.batch([("write", off, 64 * K) for off in range(0, s.img.size // 2, 64 * K)], rng)
    await s.flush()
    for _round in range(3):
        await s.batch(spread(rng, s.img.size // 2, 128 * K, 8, ("discard", "zero-unmap")), rng)
        await s.batch(spread(rng, s.img.size, 64 * K, 8), rng)  # reuses the freed clusters
        await s.flush()


async def write_through(s: Session, rng: random.Random) -> None:
    for _round in range(3):
        await s.batch(spread(rng, s.img.size, 32 * K, 8, ("write", "write", "zero-unmap")), rng)
    await s.flush()
    await s.batch(spread(rng, s.img.size, 32 * K, 8), rng)


def image_alloc(d: Path) -> Path:
    return create(d / "alloc.qcow2", 4 * M, cluster_size=4 * K)


def image_backing(d: Path) -> Path:
    base = create(d / "base.qcow2", 4 * M)
    qemu_io(base, f"write -P 0x5a 0 {4 * M}")
    return create(d / "over.qcow2", 4 * M, backing=base)


def image_snapshot(d: Path) -> Path:
    path = create(d / "snap.qcow2", 4 * M)
    qemu_io(path, f"write -P 0x3c 0 {3 * M}")
    qemu_img("snapshot", "-c", "s1", path)
    # a cluster past the snapshot table: the engine refuses a table whose last
    # entry's padding lies past the end of the file (format.parse_snapshots)
    qemu_io(path, f"write -P 0x3d {3 * M} 512")
    return path


def image_growth(d: Path) -> Path:
    # 512 B clusters, 64-bit refcounts: the first refcount table covers 2 MiB of file
    return create(d / "grow.qcow2", 4 * M, cluster_size=512, refcount_bits=64)


def image_discard(d: Path) -> Path:
    return create(d / "discard.qcow2", 4 * M)


WORKLOADS: dict[str, tuple[Callable[[Path], Path], Workload, bool]] = {
    "allocation": (image_alloc, allocation, False),
    "cow-backing": (image_backing, overwrite, False),
    "cow-snapshot": (image_snapshot, overwrite, False),
    "refcount-growth": (image_growth, many_clusters, False),
    "discard": (image_discard, discard_reuse, False),
    "write-through": (image_alloc, write_through, True),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_power_cut_at_every_barrier(name: str, tmp_path: Path) -> None:
    make, workload, wt = WORKLOADS[name]
    path = make(tmp_path)
    t0 = time.monotonic()
    rec = record(path, workload, seed=list(WORKLOADS).index(name) + 1, write_through=wt)
    if name == "refcount-growth":
        grown = int.from_bytes(path.read_bytes()[56:60], "big")
        assert grown > 1, "the refcount table did not grow"
    rep = check_recording(rec, tmp_path, name, seed=7)
    print(f"\npower cut: {rep.line()}, {len(rec.writes)} writes, "
          f"{time.monotonic() - t0:.1f} s")
    assert rep.cut_points >= 4, f"{name}: only {rep.cut_points} cut points"
    assert rep.sectors, f"{name}: no flushed data was compared"
    assert not rep.corrupt, f"{name}: {len(rep.corrupt)} bad crash images:\n" + \
        "\n".join(rep.corrupt[:10])


# -- the checker catches a broken write-back order ----------------------------------------


def drop_barrier(steps: list[wbplan.Step]) -> list[wbplan.Step]:
    """The sync between refcounts and the L2 tables that use them, removed."""
    return [s for s in steps if not (type(s) is wbplan.Barrier and "L2 entries" in s.why)]


def swap_refblocks_and_l2(steps: list[wbplan.Step]) -> list[wbplan.Step]:
    """The L2 table writes where the refcount blocks were, and the other way round."""
    ref = [s for s in steps if type(s) is wbplan.Write and s.kind == wbplan.REFBLOCK]
    l2 = [s for s in steps if type(s) is wbplan.Write and s.kind == wbplan.L2]
    if not ref or not l2:
        return steps
    out: list[wbplan.Step] = []
    for s in steps:
        if s is ref[0]:
            out += l2
        elif s is l2[0]:
            out += ref
        elif s not in ref and s not in l2:
            out.append(s)
    return out


@pytest.mark.parametrize("mutation", [drop_barrier, swap_refblocks_and_l2],
                         ids=["drop-barrier", "swap-refblock-l2"])
def test_checker_catches_a_broken_order(mutation: Callable[[list[wbplan.Step]],
                                                           list[wbplan.Step]],
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = wbplan.plan

    def broken(cut: wbplan.Cut, meta: Any, cluster_bits: int) -> list[wbplan.Step]:
        return mutation(real(cut, meta, cluster_bits))
    monkeypatch.setattr(wbplan, "plan", broken)
    path = image_alloc(tmp_path)
    rec = record(path, allocation, seed=3)
    rep = check_recording(rec, tmp_path, mutation.__name__, seed=7, stop_at_corruption=True)
    print(f"\nmutated plan ({mutation.__name__}): {rep.line()}: {rep.corrupt[:1]}")
    assert rep.corrupt, f"{mutation.__name__}: the checker found no bad crash image"


# -- the plan itself, without I/O ---------------------------------------------------------


def test_plan_orders_and_checks_overlaps() -> None:
    cb = 12
    meta = {0: wbplan.HEADER, 1: wbplan.L1, 2: wbplan.REFTABLE, 3: wbplan.REFBLOCK,
            4: wbplan.L2, 9: wbplan.REFTABLE}
    cut = wbplan.Cut(refblocks=[(3 << cb, b"r")], reftable=(9 << cb, b"t"), header=b"h",
                     l2=[(4 << cb, b"l")], l1=[(1 << cb, b"1")])
    kinds = [wbplan.KIND_NAMES[s.kind].split()[0] if isinstance(s, wbplan.Write) else "|"
             for s in wbplan.plan(cut, meta, cb)]
    assert kinds == ["refcount", "|", "refcount", "|", "header", "|", "L2", "|", "L1", "|"]
    assert wbplan.plan(wbplan.Cut(), meta, cb) == [
        wbplan.Barrier("data and refcounts before the L2 entries that use them")]
    with pytest.raises(wbplan.Overlap, match="L2 table write to 0x3000 would overwrite "
                                             "refcount block"):
        wbplan.plan(wbplan.Cut(refblocks=[(3 << cb, b"r")], l2=[(3 << cb, b"l")]), meta, cb)
    with pytest.raises(wbplan.Overlap, match="would overwrite data"):
        wbplan.plan(wbplan.Cut(l2=[(5 << cb, b"l")]), meta, cb)


def test_recording_sees_syncs(tmp_path: Path) -> None:
    """The recording layer is in the path: a flush shows up as barriers."""
    path = image_alloc(tmp_path)

    async def one(s: Session, rng: random.Random) -> None:
        await s.batch([("write", 0, 4 * K)], rng)
        await s.flush()
    rec = record(path, one, seed=1)
    assert len(rec.syncs) >= 2 and len(rec.writes) >= 3, (rec.syncs, len(rec.writes))
    assert os.path.getsize(path) > 0
