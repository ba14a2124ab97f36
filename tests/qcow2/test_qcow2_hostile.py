"""Hostile qcow2 headers: an open must stay bounded in memory and time.

A qcow2 image is a file of pointers, and an image from elsewhere can make
them as large and as repetitive as the format allows: 200 snapshots that
all name one 32 MiB L1 table (4 M entries each), L1 and refcount tables
whose millions of entries all point past the end of the file, a backing
chain that loops through a hard link, a file whose size is not a multiple
of 8. Each image here is written byte by byte by a small writer (the header
layout of QEMU's docs/interop/qcow2.rst) and opened in a subprocess under an
address-space limit (``RLIMIT_AS``) and a time limit, read-only and
read-write. The expected outcome of each is exactly one of: a successful
open, or a refusal in one line (a ``Qcow2Error``). Never a traceback, a
MemoryError or a timeout.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CB = 16                        # cluster bits of most images here
CS = 1 << CB
COPIED = 1 << 63
FAR = 1 << 40                  # a cluster-aligned offset far past any file here
MAX_L1 = (32 << 20) // 8       # QEMU's largest L1 table, in entries
MAX_REFTABLE = (8 << 20) // 8  # QEMU's largest refcount table, in entries

MEMORY_LIMIT = 1 << 30         # RLIMIT_AS of the opening process
TIME_LIMIT = 30.0              # seconds for the whole subprocess (2 shared cores)
FAST = 10.0                    # CPU seconds the open itself may take

_OPEN = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from aioublk.qcow2 import Qcow2Error, Qcow2Image
# CPU time, not wall time: the bound is on the work a hostile image can cause,
# which a busy machine does not change (its wall time doubled under load)
t = time.process_time()
try:
    img = Qcow2Image.open(sys.argv[1], read_only=sys.argv[2] == "ro")
except Qcow2Error as e:
    print(f"refused {{time.process_time() - t:.2f}} {{e}}")
else:
    print(f"opened {{time.process_time() - t:.2f}}")
    img.release()
"""


@dataclass
class Image:
    """A qcow2 v3 image laid out by hand: header in cluster 0, refcount
    table in cluster 1, snapshot table in cluster 2, active L1 in cluster 3
    (unless moved), then whatever ``blobs`` put where."""

    cluster_bits: int = CB
    size: int = 64 << 20
    l1_offset: int = 3 * CS
    l1_size: int = 1
    reftable_offset: int | None = None  # cluster 1
    reftable_clusters: int = 1
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (L1 offset, size)
    backing: str | None = None
    blobs: dict[int, bytes] = field(default_factory=dict)
    file_size: int | None = None

    def write(self, path: Path) -> Path:
        cs = 1 << self.cluster_bits
        hdr = struct.pack(">4sIQIIQIIQQIIQ", b"QFI\xfb", 3, 0, 0, self.cluster_bits,
                          self.size, 0, self.l1_size, self.l1_offset,
                          cs if self.reftable_offset is None else self.reftable_offset,
                          self.reftable_clusters, len(self.snapshots), 2 * cs)
        hdr += struct.pack(">QQQII", 0, 0, 0, 4, 104)
        if self.backing is not None:  # qcow2 backing format extension, then the name
            fmt_ext = struct.pack(">II", 0xE2792ACA, 5) + b"qcow2" + bytes(3)
            hdr += fmt_ext + bytes(8)
            name = self.backing.encode()
            hdr = hdr[:8] + struct.pack(">QI", len(hdr), len(name)) + hdr[20:] + name
        table = b""
        for i, (off, size) in enumerate(self.snapshots):
            sid, name = str(i).encode(), f"s{i}".encode()
            e = struct.pack(">QIHHIIQII", off, size, len(sid), len(name), 0, 0, 0, 0, 16)
            e += bytes(16) + sid + name
            table += e + bytes(-len(e) % 8)
        with open(path, "wb") as f:
            f.write(hdr.ljust(cs, b"\0"))
            f.seek(2 * cs)
            f.write(table)
            for off, data in sorted(self.blobs.items()):
                f.seek(off)
                f.write(data)
            f.truncate(self.file_size if self.file_size is not None
                       else max([4 * cs, 2 * cs + len(table)]
                                + [o + len(d) for o, d in self.blobs.items()]))
        return path


def repeated(value: int, count: int) -> bytes:
    return struct.pack(">Q", value) * count


def distinct_far(count: int) -> bytes:
    """``count`` different cluster offsets, all past the end of any file here."""
    table = array("Q", range(COPIED | FAR, (COPIED | FAR) + count * CS, CS))
    if sys.byteorder == "little":
        table.byteswap()
    return table.tobytes()


# -- the images ---------------------------------------------------------------


def shared_l1(d: Path) -> Path:
    """200 snapshots, one 32 MiB L1 table: 4 M entries, all the same L2."""
    big = 5 * CS
    return Image(snapshots=[(big, MAX_L1)] * 200,
                 blobs={big: repeated(COPIED | 4 * CS, MAX_L1)}).write(d / "shared.qcow2")


def shifted_l1s(d: Path) -> Path:
    """200 snapshots with 32 MiB L1 tables one 512-byte cluster apart: 200
    different tables that overlap in a 32 MiB file."""
    cs = 512
    base = 128 * cs  # after the snapshot table (cluster 2 on)
    img = Image(cluster_bits=9, l1_offset=64 * cs, size=1 << 20, l1_size=32,
                snapshots=[(base + i * cs, MAX_L1) for i in range(200)],
                blobs={base: repeated(COPIED | 4 * cs, MAX_L1 + 200 * cs // 8)})
    return img.write(d / "shifted.qcow2")


def tables_far(d: Path) -> Path:
    """The active L1 table and a snapshot's, both at QEMU's largest size,
    and the largest refcount table: 9 M entries, each a different offset
    past the end of the file."""
    l1, snap_l1, rt = 4 * CS, 4 * CS + (32 << 20), 4 * CS + (64 << 20)
    far = distinct_far(2 * MAX_L1 + MAX_REFTABLE)
    return Image(l1_offset=l1, l1_size=MAX_L1, snapshots=[(snap_l1, MAX_L1)],
                 reftable_offset=rt, reftable_clusters=(8 << 20) // CS,
                 blobs={l1: far[:32 << 20], snap_l1: far[32 << 20:64 << 20],
                        rt: far[64 << 20:]}).write(d / "far.qcow2")


def snapshot_l1_odd_size(d: Path) -> Path:
    """A snapshot L1 table in the last, partial cluster of a file whose size
    is not a multiple of 8 (a 3-byte table entry)."""
    return Image(snapshots=[(4 * CS, 1)], blobs={4 * CS: b"abc"}).write(d / "odd.qcow2")


def hardlink_loop(d: Path) -> Path:
    """shared.qcow2's tables, backed by 'link.qcow2', a hard link to itself:
    the names differ (realpath cannot tell), the inode is one."""
    big = 5 * CS
    top = Image(snapshots=[(big, MAX_L1)] * 200, backing="link.qcow2",
                blobs={big: repeated(COPIED | 4 * CS, MAX_L1)}).write(d / "top.qcow2")
    os.link(top, d / "link.qcow2")
    return top


# (builder, expected outcome read-only, read-write, words the refusal names)
CASES = {
    "shared_l1_200_snapshots": (shared_l1, "opened", "opened", ()),
    "shifted_l1s_200_snapshots": (shifted_l1s, "opened", "opened", ()),
    "table_entries_past_eof": (tables_far, "opened", "refused", ("end of the file",)),
    "snapshot_l1_in_odd_sized_file": (snapshot_l1_odd_size, "opened", "opened", ()),
    "backing_loop_through_hard_link": (hardlink_loop, "refused", "refused", ("loop",)),
}


def open_limited(path: Path, mode: str) -> tuple[str, float, str]:
    """Open in a subprocess under the limits: (outcome, open seconds, message)."""
    t = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", _OPEN.format(limit=MEMORY_LIMIT),
                            str(path), mode], capture_output=True, text=True,
                           timeout=TIME_LIMIT, cwd=Path(__file__).parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail(f"open({path.name}, {mode}) still running after {TIME_LIMIT} s")
    wall = time.monotonic() - t
    out = p.stdout.strip()
    assert p.returncode == 0 and not p.stderr.strip() and len(out.splitlines()) == 1, (
        f"open({path.name}, {mode}) exited {p.returncode} after {wall:.1f} s:\n"
        f"{p.stdout[-2000:]}{p.stderr[-3000:]}")
    outcome, seconds, *msg = out.split(" ", 2)
    return outcome, float(seconds), " ".join(msg)


@pytest.mark.parametrize("mode", ["ro", "rw"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_image_open_is_bounded(tmp_path: Path, case: str, mode: str) -> None:
    build, ro, rw, words = CASES[case]
    path = build(tmp_path)
    want = ro if mode == "ro" else rw
    outcome, seconds, msg = open_limited(path, mode)
    assert outcome == want, f"{case} ({mode}): {outcome} {msg!r}, expected {want}"
    assert seconds < FAST, f"{case} ({mode}): open took {seconds:.1f} s of CPU"
    if outcome == "refused":
        assert any(w in msg for w in words), f"{case} ({mode}): {msg!r} names none of {words}"
