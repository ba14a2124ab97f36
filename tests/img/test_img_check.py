"""``aioublk img check [-r leaks|all]`` against ``qemu-img check`` on the same
images (host only): clean images of every shape QEMU makes, images broken
on purpose (leaks, refcounts too low, wrong COPIED flags), and the crash
images of the power-cut test. The two must agree on the exit code and on
every number of ``--output json``; a repair by aioublk must leave an image
qemu-img calls what qemu-img's own repair leaves, with the data unchanged."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioublk.qcow2 import check as chk
from tests.support.qcow2_util import K, M, create, held_by_qemu_io, qemu_img, qemu_io, to_raw

AIOUBLK = [sys.executable, "-m", "aioublk"]


def ours(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AIOUBLK, "img", "check", *map(str, args)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def theirs(*args: object) -> subprocess.CompletedProcess[str]:
    return qemu_img("check", *args, ok=(0, 1, 2, 3))


def report(p: subprocess.CompletedProcess[str], path: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(p.stdout)
    assert out.pop("filename") == str(path)
    return out


def agree(path: Path, *args: object) -> tuple[int, dict[str, Any]]:
    """Both checkers on ``path``: the same exit code, JSON and human lines."""
    a, q = ours("--output", "json", *args, path), theirs("--output", "json", *args, path)
    assert (a.returncode, report(a, path)) == (q.returncode, report(q, path)), \
        (a.stderr, q.stderr)
    ha, hq = ours(*args, path), theirs(*args, path)
    assert ha.stdout == hq.stdout and ha.returncode == hq.returncode, (ha.stdout, hq.stdout)
    return a.returncode, report(a, path)


# -- images QEMU makes --------------------------------------------------------------------


def img_data(d: Path) -> Path:
    p = create(d / "data.qcow2", 64 * M)
    qemu_io(p, "write -P 1 0 1M", "write -P 2 8M 64k", "write -P 3 20M 4k", "write -z 30M 1M")
    return p


def img_snapshots(d: Path) -> Path:
    p = img_data(d)
    qemu_img("snapshot", "-c", "one", p)
    qemu_io(p, "write -P 4 0 64k", "write -P 5 40M 128k")
    qemu_img("snapshot", "-c", "two", p)
    qemu_io(p, "write -P 6 32k 4k")
    return p


def img_compressed(d: Path) -> Path:
    raw = d / "raw"
    raw.write_bytes(b"".join(bytes([i % 7]) * 4096 + bytes(range(256)) * 16
                             for i in range(512)))
    p = d / "compressed.qcow2"
    qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", raw, p)
    qemu_io(p, "write -P 9 64k 4k")
    return p


def img_small_clusters(bits: int) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = create(d / f"r{bits}.qcow2", 8 * M, cluster_size=512, refcount_bits=bits)
        qemu_io(p, "write -P 1 0 3M")
        return p
    return make


def img_backing(d: Path) -> Path:
    base = img_data(d)
    p = create(d / "top.qcow2", None, backing=base.name)
    qemu_io(p, "write -P 7 4k 4k")
    return p


def img_bitmaps(d: Path) -> Path:
    p = img_data(d)
    qemu_img("bitmap", "--add", p, "b0")
    qemu_io(p, "write -P 8 2M 1M")
    return p


def img_extended_l2(d: Path) -> Path:
    """Subclusters allocated, zero and unallocated over a backing file."""
    base = img_data(d)
    p = create(d / "ext.qcow2", None, backing=base.name, extended_l2=True, cluster_size=32 * K)
    qemu_io(p, "write -P 7 4k 2k", "write -P 8 70k 10k", "write -z 200k 8k", "write -z 1M 64k",
            "write -P 9 2M 64k", "discard 300k 2k", "write -P 10 8M 3k")
    return p


def img_v2(d: Path) -> Path:
    p = create(d / "v2.qcow2", 16 * M, compat="0.10")
    qemu_io(p, "write -P 1 0 1M")
    qemu_img("snapshot", "-c", "s", p)
    return p


IMAGES: dict[str, Callable[[Path], Path]] = {
    "data": img_data, "snapshots": img_snapshots, "compressed": img_compressed,
    "refcount-1": img_small_clusters(1), "refcount-64": img_small_clusters(64),
    "backing": img_backing, "bitmaps": img_bitmaps, "v2": img_v2,
    "extended-l2": img_extended_l2,
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_clean_images_agree(name: str, tmp_path: Path) -> None:
    rc, rep = agree(IMAGES[name](tmp_path))
    assert rc == 0 and rep["allocated-clusters"] > 0


# -- images broken on purpose -------------------------------------------------------------


class Raw:
    """Edits of an image's bytes: refcounts and table entries."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.h, self.res = chk.scan(self.read, path.stat().st_size)

    def read(self, off: int, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(off)
            return f.read(n)

    def write(self, off: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(off)
            f.write(data)

    def set_refcount(self, cluster: int, value: int) -> None:
        h = self.h
        assert h.refcount_bits == 16
        rt = struct.unpack(">Q", self.read(h.refcount_table_offset + 8 * (
            cluster // h.refblock_entries), 8))[0]
        self.write(rt + 2 * (cluster % h.refblock_entries), struct.pack(">H", value))

    def grow(self, clusters: int) -> int:
        """The file ``clusters`` longer; the first new cluster's index."""
        size = self.path.stat().st_size
        first = -(-size // self.h.cluster_size)
        with open(self.path, "r+b") as f:
            f.truncate((first + clusters) * self.h.cluster_size)
        return first

    def l1_entry_at(self, i: int) -> int:
        return self.h.l1_table_offset + 8 * i


def leaks(r: Raw) -> None:
    c = r.grow(3)
    r.set_refcount(c, 1)
    r.set_refcount(c + 2, 5)


def too_low(r: Raw) -> None:
    shared = min(c for c, n in r.res.refs.items() if n == 2)
    r.set_refcount(shared, 1)


def copied_flag(r: Raw) -> None:
    at = r.l1_entry_at(0)
    e = struct.unpack(">Q", r.read(at, 8))[0]
    assert e & (1 << 63), "L1[0]'s table is the active layer's own"
    r.write(at, struct.pack(">Q", e & ~(1 << 63)))


def everything(r: Raw) -> None:
    leaks(r)
    too_low(r)


def unreferenced_in_use(r: Raw) -> None:
    """A data cluster whose refcount says free: a write could take it."""
    l2 = struct.unpack(">Q", r.read(r.l1_entry_at(0), 8))[0] & chk.OFFSET_MASK
    data = struct.unpack(">Q", r.read(l2, 8))[0] & chk.OFFSET_MASK
    r.set_refcount(data // r.h.cluster_size, 0)


def lost_refblock(r: Raw) -> None:
    """The refcount table's only entry points past the end of the file."""
    r.write(r.h.refcount_table_offset, struct.pack(">Q", 1 << 40))


def unreferenced_and_leaks(r: Raw) -> None:
    leaks(r)
    unreferenced_in_use(r)


BREAKS: dict[str, Callable[[Raw], None]] = {
    "leaks": leaks, "too-low": too_low, "copied-flag": copied_flag,
    "leaks-and-too-low": everything, "unreferenced-in-use": unreferenced_in_use,
    "unreferenced-and-leaks": unreferenced_and_leaks, "lost-refblock": lost_refblock,
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_images_agree_and_repair_alike(name: str, tmp_path: Path) -> None:
    base = img_snapshots(tmp_path)
    BREAKS[name](Raw(base))
    raw = to_raw(base, tmp_path / "before.raw")
    rc, rep = agree(base)
    assert rc in (2, 3) and (rep.get("leaks") or rep.get("corruptions")), rep
    for mode in ("leaks", "all"):
        mine, qemus = tmp_path / f"mine-{mode}.qcow2", tmp_path / f"qemu-{mode}.qcow2"
        shutil.copy(base, mine)
        shutil.copy(base, qemus)
        a, q = ours("--output", "json", "-r", mode, mine), \
            theirs("--output", "json", "-r", mode, qemus)
        if not q.stdout:  # qemu-img gave up: -r leaks where only a rebuild helps
            assert (a.returncode, a.stdout) == (q.returncode, ""), (mode, a.stderr)
            last = a.stderr.strip().splitlines()[-1]  # (after the findings, as qemu-img)
            assert last.startswith("aioublk: ") and "repair with -r all" in last, a.stderr
            continue
        got, want = report(a, mine), report(q, qemus)
        if "Rebuilding refcount structure" in q.stderr:  # (placed elsewhere, as it may)
            assert "Rebuilding refcount structure" in a.stderr
            got.pop("image-end-offset")
            want.pop("image-end-offset")
        assert (a.returncode, got) == (q.returncode, want), (mode, a.stderr, q.stderr)
        after_a, after_q = theirs("--output", "json", mine), theirs("--output", "json", qemus)
        got, want = report(after_a, mine), report(after_q, qemus)
        if "Rebuilding refcount structure" in q.stderr:
            got.pop("image-end-offset")
            want.pop("image-end-offset")
        assert (after_a.returncode, got) == (after_q.returncode, want), mode
        if mode == "all":
            assert after_a.returncode == 0, after_a.stdout
        qemu_img("compare", "-f", "qcow2", "-F", "raw", mine, raw)


# -- the power-cut test's crash images ---------------------------------------------------


@pytest.mark.parametrize("workload", ["allocation", "discard", "c-alloc-2q"])
def test_crash_images_repaired(workload: str, tmp_path: Path) -> None:
    """Every crash image of a recorded workload: the same verdict as
    qemu-img's; after ``-r leaks`` qemu-img finds nothing and the data
    reads back as before the repair."""
    from tests.qcow2 import test_qcow2_powercut as pc

    case = pc.WORKLOADS[workload]
    rec = case.record(case.image(tmp_path), seed=3)
    leaky = 0
    for i, (name, data, _crash) in enumerate(pc.crash_images(rec, seed=11)[:24]):
        img = tmp_path / f"crash{i}.qcow2"
        img.write_bytes(data)
        rc, rep = agree(img)
        assert rc in (0, 3), f"{name}: {rep}"
        if rc == 3:
            leaky += 1
            raw = to_raw(img, tmp_path / f"crash{i}.raw")
            fixed = ours("-r", "leaks", img)
            assert fixed.returncode == 0, fixed.stdout + fixed.stderr
            assert theirs(img).returncode == 0
            qemu_img("compare", "-f", "qcow2", "-F", "raw", img, raw)
        img.unlink()
    assert leaky, "no crash image leaked: the repair was never tried"


# -- the rest -----------------------------------------------------------------------------


def test_dirty_and_corrupt_bits_cleared_by_a_repair(tmp_path: Path) -> None:
    p = create(tmp_path / "lazy.qcow2", 16 * M, lazy_refcounts=True)
    qemu_io(p, "write -P 1 0 1M")
    r = Raw(p)
    incompat = struct.unpack(">Q", r.read(72, 8))[0]
    r.write(72, struct.pack(">Q", incompat | 1 | 2))  # dirty, corrupt
    leaks(r)
    assert ours(p).returncode == 3
    assert ours("-r", "leaks", p).returncode == 0
    assert struct.unpack(">Q", r.read(72, 8))[0] == incompat
    assert theirs(p).returncode == 0


def test_an_image_in_use_is_refused_in_one_line(tmp_path: Path) -> None:
    p = img_data(tmp_path)
    with held_by_qemu_io(p):
        got = ours(p)
        assert got.returncode == 1 and got.stderr.count("\n") == 1, got.stderr
        assert "in use by another process" in got.stderr and "-U" in got.stderr
        assert ours("-r", "leaks", p).returncode == 1
        assert ours("-U", p).returncode in (0, 3)


def test_not_qcow2_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "raw.img"
    p.write_bytes(bytes(64 * K))
    got = ours(p)
    assert got.returncode == 1 and got.stderr.count("\n") == 1 and "qcow2" in got.stderr
    assert "Traceback" not in got.stderr


# -- lazy refcounts: dirty while open, repaired on the next open --------------------------

CRASH = """
import asyncio, os, sys
from aioublk.qcow2 import Qcow2Image

async def main() -> None:
    img = Qcow2Image.open(sys.argv[1])
    async with img:
        buf = bytearray(b"\\x5a" * 65536)
        for i in range(0, 64):
            await img.write(i * 3 * 65536, buf)
        await img.flush()
        print(int.from_bytes(open(sys.argv[1], "rb").read(80)[72:80], "big"), flush=True)
        os._exit(9)  # a crash: nothing written back after the flush

asyncio.run(main())
"""


def incompatible(p: Path) -> int:
    with open(p, "rb") as f:
        return int.from_bytes(f.read(80)[72:80], "big")


def test_lazy_refcounts_dirty_while_open_and_repaired_after_a_crash(tmp_path: Path) -> None:
    p = create(tmp_path / "lazy.qcow2", 64 * M, lazy_refcounts=True)
    crash = subprocess.run([sys.executable, "-c", CRASH, str(p)], capture_output=True,
                           text=True, timeout=120)
    assert crash.returncode == 9, crash.stderr
    assert int(crash.stdout) & 1, "not dirty while open"
    assert incompatible(p) & 1, "the crash left it clean"
    assert "dirty" in json.dumps(json.loads(qemu_img("info", "--output", "json", p).stdout))
    # what QEMU's lazy refcounts leave after a crash: refcounts not written yet
    unreferenced_in_use(Raw(p))
    assert theirs(p).returncode == 2
    # the next open repairs it (as QEMU's does), and a clean close leaves it clean
    fixer = """
import asyncio, sys
from aioublk.qcow2 import Qcow2Image
async def main() -> None:
    async with Qcow2Image.open(sys.argv[1]) as img:
        buf = bytearray(65536)
        await img.read(3 * 65536, buf)
        assert buf == bytearray(b"\\x5a" * 65536), "flushed data lost"
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", fixer, str(p)], check=True, timeout=120)
    assert incompatible(p) & 1 == 0
    assert theirs(p).returncode == 0, theirs(p).stdout
    raw = to_raw(p, tmp_path / "after.raw").read_bytes()
    assert all(raw[i * 3 * 65536:(i * 3 + 1) * 65536] == b"\x5a" * 65536 for i in range(64))


def test_progress_is_drawn_on_a_terminal_only(tmp_path: Path) -> None:
    """Long scans (check, snapshot changes) show qemu-img -p's progress line
    on a terminal, and nothing in a pipe or file."""
    import io

    from aioublk.frontend import img

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert img.terminal_progress(io.StringIO()) is None
    tty = Tty()
    show = img.terminal_progress(tty)
    assert show is not None
    path = img_small_clusters(16)(tmp_path)  # 8 MiB of 512-byte clusters: many L1 entries
    data = path.read_bytes()
    seen: list[float] = []
    chk.scan(lambda off, n: data[off:off + n], len(data), seen.append)
    assert len(seen) > 3 and seen == sorted(seen) and seen[-1] == 1.0
    for done in seen:
        show(done)
    lines = tty.getvalue().split("\r")
    assert lines[0] == "    (0.00/100%)" and lines[-2] == "    (100.00/100%)" and \
        lines[-1] == "\n"
    assert ours(path).stderr == ""  # (a pipe: no progress)
