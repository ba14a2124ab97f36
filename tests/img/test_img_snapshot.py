"""``aioublk img snapshot -c|-a|-d`` judged by qemu-img on the same images
(host only): each snapshot read back byte-exact through ``qemu-img convert
-l``, the image clean after every step, a crash after any write leaving at
worst leaks, and QEMU's snapshots applied and deleted as well as ours."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.img.test_img_check import IMAGES
from tests.support.qcow2_util import (
    K,
    M,
    assert_same,
    check_clean,
    create,
    held_by_qemu_io,
    qemu_img,
    qemu_io,
    read_file,
    run,
    to_raw,
)


def ours(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioublk", "img", "snapshot",
                           *map(str, args)], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def ok(*args: object) -> None:
    p = ours(*args)
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p.stderr


def raw_of(image: Path, snapshot: str | None = None) -> bytes:
    out = image.with_name(f"{image.name}.{snapshot or 'active'}.raw")
    data = read_file(to_raw(image, out, snapshot=snapshot))
    out.unlink()
    return data


def names(image: Path) -> list[tuple[str, str]]:
    snaps = json.loads(qemu_img("info", "--output", "json", image).stdout).get("snapshots", [])
    return [(s["id"], s["name"]) for s in snaps]


@pytest.mark.parametrize("name", list(IMAGES))
def test_create_apply_delete_judged_by_qemu_img(name: str, tmp_path: Path) -> None:
    image = IMAGES[name](tmp_path)
    before = raw_of(image)
    had = names(image)
    if name == "refcount-1":  # (QEMU cannot either)
        p = ours("-c", "mine", image)
        assert p.returncode == 1 and "refcount_bits=16" in p.stderr, p.stderr
        return
    ok("-c", "mine", image)
    check_clean(image)
    assert names(image)[:-1] == had and names(image)[-1][1] == "mine"
    assert_same(raw_of(image, "mine"), before, "snapshot mine")
    # the active disk changes; the snapshot does not
    qemu_io(image, "write -P 0x5a 0 96k", "write -z 512k 128k", "discard 1M 64k")
    check_clean(image)
    changed = raw_of(image)
    assert changed != before
    assert_same(raw_of(image, "mine"), before, "snapshot mine")
    if name == "bitmaps":  # (an enabled bitmap would miss the change, as QEMU says)
        p = ours("-a", "mine", image)
        assert p.returncode == 1 and "active dirty bitmaps" in p.stderr, p.stderr
        qemu_img("bitmap", "--disable", image, "b0")
    ok("-a", "mine", image)
    check_clean(image)
    assert_same(raw_of(image), before, "active disk")
    for sid, sname in had:  # QEMU's snapshots are untouched by all of it
        assert names(image)[[i for i, _ in names(image)].index(sid)] == (sid, sname)
    ok("-d", "mine", image)
    check_clean(image)
    assert names(image) == had
    assert_same(raw_of(image), before, "active disk")
    for _, sname in had:  # and can be applied and deleted by us too
        ok("-a", sname, image)
        check_clean(image)
        ok("-d", sname, image)
        check_clean(image)
    assert names(image) == []
    assert qemu_img("snapshot", "-l", image).stdout == ""


def test_ids_names_and_lookup_as_qemu_img(tmp_path: Path) -> None:
    """IDs count on from the highest; names may repeat; -a takes an ID or a
    name, -d a name (the first); a name nothing has fails in one line."""
    image = create(tmp_path / "ids.qcow2", 16 * M)
    copy = tmp_path / "qemu.qcow2"
    shutil.copy(image, copy)
    for tool in (ok, lambda *a: qemu_img("snapshot", *a)):
        target = image if tool is ok else copy
        for i, snap in enumerate(("a", "b", "a")):
            qemu_io(target, f"write -P {i + 1} 0 4k")
            tool("-c", snap, target)
        tool("-d", "b", target)
        tool("-c", "c", target)
    assert names(image) == names(copy) == [("1", "a"), ("3", "a"), ("4", "c")]
    ok("-a", "3", image)  # an ID
    assert raw_of(image)[:4 * K] == bytes([3]) * (4 * K)
    ok("-a", "a", image)  # a name: the first
    assert raw_of(image)[:4 * K] == bytes([1]) * (4 * K)
    ok("-d", "a", image)
    assert names(image) == [("3", "a"), ("4", "c")]
    for flag, what in (("-a", "apply"), ("-d", "delete")):
        p = ours(flag, "nope", image)
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
        assert f"could not {what} snapshot 'nope': snapshot not found" in p.stderr
    p = ours("-d", "3", image)  # -d takes names only, as qemu-img's
    assert p.returncode == 1 and "snapshot not found" in p.stderr
    check_clean(image)


def test_refused_in_one_line(tmp_path: Path) -> None:
    image = create(tmp_path / "busy.qcow2", 16 * M)
    with held_by_qemu_io(image):
        p = ours("-c", "s", image)
        assert p.returncode == 1 and "in use by another process" in p.stderr, p.stderr
        p = ours("-U", "-c", "s", image)
        assert p.returncode == 1 and "-U works with -l only" in p.stderr, p.stderr
    qemu_img("bitmap", "--add", image, "b0")
    ok("-c", "s", image)
    p = ours("-a", "s", image)
    assert p.returncode == 1 and "active dirty bitmaps" in p.stderr, p.stderr
    broken = tmp_path / "broken.qcow2"
    shutil.copy(image, broken)
    with open(broken, "r+b") as f:  # the active L1 table's offset, unaligned
        f.seek(40)
        f.write((0x10200).to_bytes(8, "big"))
    p = ours("-c", "t", broken)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert names(image) == [("1", "s")]


def test_lazy_refcounts_image_made_clean(tmp_path: Path) -> None:
    """A dirty image (lazy refcounts, killed QEMU) gets its refcounts rebuilt
    by the snapshot's refcount structure, and its dirty bit cleared."""
    image = create(tmp_path / "lazy.qcow2", 16 * M, lazy_refcounts=True)
    run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "-c", "sigraise 9", image,
        ok=(-9,))
    assert read_file(image)[79] & 1, "qemu-io left no dirty image"
    before = raw_of(image)
    ok("-c", "s", image)
    check_clean(image)
    assert not json.loads(qemu_img("info", "--output", "json", image).stdout)[
        "format-specific"]["data"].get("dirty", False)
    assert_same(raw_of(image, "s"), before, "snapshot s")


#: each operation's planner, and the snapshot it names
PLANS = {"create": ("plan_create", "new"), "apply": ("plan_apply", "one"),
         "delete": ("plan_delete", "one")}


def disks(image: Path) -> dict[str | None, bytes]:
    """The active disk (None) and each snapshot, by name."""
    return {None: raw_of(image), **{n: raw_of(image, n) for _, n in names(image)}}


@pytest.mark.parametrize("op", list(PLANS))
def test_a_crash_after_any_write_leaves_at_most_leaks(op: str, tmp_path: Path) -> None:
    """The plan's writes cut after each one in turn: qemu-img check finds at
    worst leaks, and the disk reads as before the
    operation or as after it, never anything else."""
    from aioublk.qcow2 import snapshot

    image = IMAGES["snapshots"](tmp_path)
    fn, key = PLANS[op]
    old = disks(image)
    done = tmp_path / "done.qcow2"
    shutil.copy(image, done)

    def writes(path: Path) -> list[tuple[int, bytes]]:
        data = read_file(path)
        plan: snapshot.Plan = getattr(snapshot, fn)(lambda off, n: data[off:off + n],
                                                    len(data), key)
        return plan.before + plan.switch

    steps = writes(image)
    assert len(steps) >= 3
    with open(done, "r+b") as f:
        for off, data in steps:
            f.seek(off)
            f.write(data)
    check_clean(done)
    new = disks(done)
    for cut in range(len(steps)):
        crashed = tmp_path / f"crash{cut}.qcow2"
        shutil.copy(image, crashed)
        with open(crashed, "r+b") as f:
            for off, data in steps[:cut]:
                f.seek(off)
                f.write(data)
        p = qemu_img("check", crashed, ok=(0, 3))
        assert p.returncode in (0, 3), p.stdout
        assert disks(crashed) in (old, new), f"cut after {cut} of {len(steps)} writes"
        crashed.unlink()


@pytest.mark.asyncio
async def test_the_engine_writes_around_our_snapshot(tmp_path: Path) -> None:
    """Our engine, serving an image we snapshotted, copies shared clusters
    before writing: the snapshot keeps its bytes."""
    image = IMAGES["data"](tmp_path)
    before = raw_of(image)
    ok("-c", "s", image)
    from aioublk.qcow2 import Qcow2Image

    async with Qcow2Image.open(str(image)) as img:
        await img.write(0, b"\x77" * (64 * K))
        await img.write(8 * M + 4 * K, b"\x66" * (4 * K))
        await img.flush()
    check_clean(image)
    assert_same(raw_of(image, "s"), before, "snapshot s")
    now = raw_of(image)
    assert now[:64 * K] == b"\x77" * (64 * K)
    assert now[8 * M + 4 * K:8 * M + 8 * K] == b"\x66" * (4 * K)
