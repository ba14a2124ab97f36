"""``aioublk img check -r`` against ``qemu-img check -r`` on every kind of
corruption ``qemu-img check`` knows (host only). Each is made on a copy of
one image with snapshots and repaired by both tools. A repair must leave
the image no worse than qemu-img's does: ``qemu-img check`` finds no more
errors, leaks or check errors in it, it frees no cluster qemu-img's
keeps (qemu-img discards what it frees: the counts once the corrupt bytes
are put back say little), and once they are put back every byte of guest
data that survives qemu-img's repair survives ours, also once new data has
been written (a cluster still in use but counted free would be handed out
to it)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioublk.qcow2 import format as fmt
from tests.img.test_img_check import (
    Raw,
    img_snapshots,
    leaks,
    lost_refblock,
    ours,
    too_low,
    unreferenced_in_use,
)
from tests.support.qcow2_util import K, M, to_raw

MISALIGN = 0x200  # (the offset fields keep bits 9 and up: the least they can be off)
PAST_END = 1 << 30  # a cluster-aligned offset past the end of every file here
NEW_AT, NEW_LEN = 50 * M, 192 * K  # where new data is written after a repair


class Broken(Raw):
    """A ``Raw`` that remembers what each write replaced, to put it back."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.undo: list[tuple[int, bytes, bytes]] = []  # (offset, was, now)

    def write(self, off: int, data: bytes) -> None:
        self.undo.append((off, self.read(off, len(data)), data))
        super().write(off, data)

    def u64(self, off: int) -> int:
        value: int = struct.unpack(">Q", self.read(off, 8))[0]
        return value

    def set_u64(self, off: int, value: int) -> None:
        self.write(off, struct.pack(">Q", value))

    def l2(self) -> int:
        """The active layer's (first) L2 table."""
        return self.u64(self.l1_entry_at(0)) & fmt.OFFSET_MASK

    def own_entry(self) -> int:
        """Where the active L2 entry of a data cluster only the active layer
        uses lies (its COPIED flag set)."""
        at = next(self.l2() + 8 * i for i in range(self.h.cluster_size // 8)
                  if self.u64(self.l2() + 8 * i) & fmt.COPIED)
        return at

    def shared_entry(self) -> int:
        """Where an active L2 entry of a data cluster a snapshot shares lies."""
        return next(self.l2() + 8 * i for i in range(self.h.cluster_size // 8)
                    if self.u64(self.l2() + 8 * i) & fmt.OFFSET_MASK
                    and not self.u64(self.l2() + 8 * i) & fmt.COPIED)

    def snapshot_at(self) -> int:
        """Where the first snapshot's table entry lies."""
        return self.h.snapshots_offset


def plus(at: int, delta: int) -> Callable[[Broken], None]:
    return lambda b: b.set_u64(at, b.u64(at) + delta)


def misaligned_l2(b: Broken) -> None:
    plus(b.l1_entry_at(0), MISALIGN)(b)


def misaligned_data(b: Broken) -> None:
    plus(b.own_entry(), MISALIGN)(b)


def misaligned_preallocated(b: Broken) -> None:
    """A zero cluster's entry with a misaligned (preallocated) offset."""
    at = b.own_entry()
    b.set_u64(at, (b.u64(at) | fmt.ZERO) + MISALIGN)


def l1_reserved_bits(b: Broken) -> None:
    at = b.l1_entry_at(0)
    b.set_u64(at, b.u64(at) | 1 << 56)


def l2_reserved_bits(b: Broken) -> None:
    at = b.shared_entry()
    b.set_u64(at, b.u64(at) | 1 << 56)


def snapshot_l1_too_large(b: Broken) -> None:
    b.write(b.snapshot_at() + 8, struct.pack(">I", fmt.MAX_L1_BYTES // 8 + 1))


def snapshot_l1_misaligned(b: Broken) -> None:
    plus(b.snapshot_at(), MISALIGN)(b)


def copied_flag(b: Broken) -> None:
    at = b.own_entry()
    b.set_u64(at, b.u64(at) & ~fmt.COPIED)


def l1_copied_flag(b: Broken) -> None:
    at = b.l1_entry_at(0)
    b.set_u64(at, b.u64(at) & ~fmt.COPIED)


def referenced_twice(b: Broken) -> None:
    """Two L2 entries name one data cluster (whose refcount stays 1)."""
    b.set_u64(b.shared_entry(), b.u64(b.own_entry()))


def l2_past_end(b: Broken) -> None:
    b.set_u64(b.l1_entry_at(0), fmt.COPIED | PAST_END)


def data_past_end(b: Broken) -> None:
    b.set_u64(b.own_entry(), fmt.COPIED | PAST_END)


def refblock_misaligned(b: Broken) -> None:
    plus(b.h.refcount_table_offset, MISALIGN)(b)


def refblock_shared(b: Broken) -> None:
    """A data cluster that is also the refcount block."""
    b.set_u64(b.own_entry(), fmt.COPIED | b.u64(b.h.refcount_table_offset))


CASES: dict[str, Callable[[Broken], None]] = {
    "misaligned-l2": misaligned_l2, "misaligned-data": misaligned_data,
    "misaligned-preallocated": misaligned_preallocated,
    "l1-reserved-bits": l1_reserved_bits, "l2-reserved-bits": l2_reserved_bits,
    "snapshot-l1-too-large": snapshot_l1_too_large,
    "snapshot-l1-misaligned": snapshot_l1_misaligned,
    "leaks": leaks, "too-low": too_low, "unreferenced-in-use": unreferenced_in_use,
    "copied-flag": copied_flag, "l1-copied-flag": l1_copied_flag,
    "referenced-twice": referenced_twice, "l2-past-end": l2_past_end,
    "data-past-end": data_past_end, "refblock-misaligned": refblock_misaligned,
    "refblock-past-end": lost_refblock, "refblock-shared": refblock_shared,
}


def qemu_check(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", "check", "--output", "json", *args, str(path)],
                          capture_output=True, text=True, timeout=120)


def counts(path: Path) -> dict[str, int]:
    """What ``qemu-img check`` finds wrong in an image (a check that cannot
    finish: the worst)."""
    p = qemu_check(path)
    if not p.stdout:
        assert p.returncode == 1, p.stderr
        return dict.fromkeys(("corruptions", "leaks", "check-errors"), sys.maxsize)
    got: dict[str, Any] = json.loads(p.stdout)
    return {k: got.get(k, 0) for k in ("corruptions", "leaks", "check-errors")}


def guest_data(path: Path, out: Path) -> bytes | None:
    """The active layer's guest data; None where qemu-img cannot read it."""
    p = subprocess.run(["qemu-img", "convert", "-O", "raw", str(path), str(out)],
                       capture_output=True, text=True, timeout=120)
    return out.read_bytes() if p.returncode == 0 else None


def surviving(data: bytes | None, want: bytes) -> set[int]:
    """The 4 KiB blocks of ``data`` that hold what they held before the damage."""
    if data is None:
        return set()
    step = 4 * K
    return {i for i in range(0, len(want), step) if data[i:i + step] == want[i:i + step]
            and not NEW_AT <= i < NEW_AT + NEW_LEN}


def write_new(path: Path) -> None:
    """New guest data where there was none: a cluster allocated (which may
    fail on an image QEMU will not write to)."""
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x77 {NEW_AT} {NEW_LEN}",
                    str(path)],
                   capture_output=True, timeout=120)


@dataclass
class Outcome:
    """One tool's repair: its exit code, and ``qemu-img check``'s findings
    after it, then once the damage is put back."""

    rc: int
    after: dict[str, int]
    kept: set[int] = field(repr=False)  # clusters with a refcount after the repair
    undone: dict[str, int]
    survived: set[int] = field(repr=False)  # 4 KiB blocks, once the damage is put back
    survived_write: set[int] = field(repr=False)  # ... and new data written


def repair(tool: Callable[..., subprocess.CompletedProcess[str]], path: Path, mode: str,
           b: Broken, want: bytes) -> Outcome:
    p = tool("-r", mode, path)
    after = counts(path)
    kept = set(Raw(path).res.disk)
    with open(path, "r+b") as f:
        for off, was, now in reversed(b.undo):
            f.seek(off)
            if f.read(len(now)) == now:  # (what the repair did not rewrite)
                f.seek(off)
                f.write(was)
    undone = counts(path)
    survived = surviving(guest_data(path, path.with_suffix(".raw")), want)
    write_new(path)
    survived_write = surviving(guest_data(path, path.with_suffix(".raw")), want)
    return Outcome(p.returncode, after, kept, undone, survived, survived_write)


def theirs(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", "check", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """The image every case breaks a copy of, and its guest data."""
    d = tmp_path_factory.mktemp("clean")
    p = img_snapshots(d)
    return p, to_raw(p, d / "clean.raw").read_bytes()


def run_case(name: str, mode: str, clean: tuple[Path, bytes],
             d: Path) -> tuple[Outcome, Outcome]:
    """qemu-img's repair of a case, then ours."""
    path, want = clean
    base = d / "broken.qcow2"
    shutil.copy(path, base)
    b = Broken(base)
    CASES[name](b)
    out = []
    for tool, who in ((theirs, "qemu"), (ours, "ours")):
        copy = d / f"{who}.qcow2"
        shutil.copy(base, copy)
        out.append(repair(tool, copy, mode, b, want))
    return out[0], out[1]


def tables_and_data(path: Path) -> set[int]:
    """The clusters an image's tables name, but for its refcount structure
    (which a rebuild may place anywhere, in any cluster named by nothing)."""
    r = Raw(path)
    h, cs = r.h, r.h.cluster_size
    reftable = range(h.refcount_table_offset // cs,
                     h.refcount_table_offset // cs + h.refcount_table_clusters)
    return set(r.res.refs) - r.res.refblock_clusters - set(reftable)


def no_worse(mine: dict[str, int], qemus: dict[str, int]) -> bool:
    return all(mine[k] <= qemus[k] for k in mine)


@pytest.mark.parametrize("mode", ["leaks", "all"])
@pytest.mark.parametrize("name", list(CASES))
def test_repair_no_worse_than_qemu_img(name: str, mode: str, clean: tuple[Path, bytes],
                                       tmp_path: Path) -> None:
    q, a = run_case(name, mode, clean, tmp_path)
    assert no_worse(a.after, q.after), f"after the repair: ours {a.after}, qemu-img's {q.after}"
    freed = sorted((q.kept - a.kept) & tables_and_data(tmp_path / "broken.qcow2"))
    assert not freed, f"clusters qemu-img's repair keeps, ours frees: {freed}"
    lost = sorted(q.survived - a.survived)
    assert not lost, f"{len(lost)} blocks of data survive qemu-img's repair, not ours " \
        f"(the first at {lost[0]:#x})"
    lost = sorted(q.survived_write - a.survived_write)
    assert not lost, f"{len(lost)} blocks of data lost to new writes after our repair, " \
        f"not after qemu-img's (the first at {lost[0]:#x})"


def test_misaligned_l2_table_not_freed_by_a_leak_repair(clean: tuple[Path, bytes],
                                                       tmp_path: Path) -> None:
    """An L1 entry off by 512 bytes: QEMU still counts its L2 table's
    cluster (and the clusters it reads there) as in use, so ``-r leaks``
    must not free them; put back, the table is intact even after new data
    was written, and as much data survives as after qemu-img's repair."""
    path, _ = clean
    l2 = Broken(path).l2()
    table = Broken(path).read(l2, Broken(path).h.cluster_size)
    q, a = run_case("misaligned-l2", "leaks", clean, tmp_path)
    now = Raw(tmp_path / "ours.qcow2").read(l2, len(table))
    new = slice(8 * NEW_AT // len(table), 8 * (NEW_AT + NEW_LEN) // len(table))
    assert now[:new.start] + now[new.stop:] == table[:new.start] + table[new.stop:], \
        "the L2 table was overwritten: its cluster was handed out as free"
    assert no_worse(a.undone, q.undone), \
        f"once the L1 entry is put back: ours {a.undone}, qemu-img's {q.undone}"
    assert a.survived >= q.survived and a.survived_write >= q.survived_write
