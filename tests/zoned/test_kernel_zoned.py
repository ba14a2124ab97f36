"""The zoned target (``-t zoned``) against the real driver: blkzone's view
of the zones and its zone operations, writes off the write pointer refused,
fio's zonemode=zbd with verify on both queue paths, the zone states after a
restart, and file systems made for zoned devices where their tools are
installed (btrfs writes its data with zone append).

The file system tests need Debian packages scripts/setup does not install:
btrfs-progs (mkfs.btrfs -O zoned) and f2fs-tools (mkfs.f2fs -m); without
them those tests skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.kernel import add, cli, delete, fio, run

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
ZONE = 16 * MiB
ZONE_SECTORS = ZONE >> 9

_ZONE_LINE = re.compile(
    r"start: (0x[0-9a-f]+), len (0x[0-9a-f]+), cap (0x[0-9a-f]+), wptr (0x[0-9a-f]+) .*"
    r"zcond:\s*(\d+)\(\w+\) \[type: (\d+)")


@dataclass
class Zone:
    start: int
    length: int
    wp: int  # relative to start, as blkzone prints it
    cond: int
    type: int


def report(dev: str) -> list[Zone]:
    zones = []
    for line in run("blkzone", "report", dev).splitlines():
        m = _ZONE_LINE.search(line)
        assert m, f"unexpected blkzone line: {line!r}"
        start, length, _cap, wp, cond, ztype = (int(x, 0) for x in m.groups())
        zones.append(Zone(start, length, wp, cond, ztype))
    return zones


def zoned(tmp_path: Path, *args: str, size: int = 256 * MiB, conv: int = 2) -> tuple[int, str]:
    d = add("-t", "zoned", str(tmp_path / "zoned.img"), "-s", str(size),
            "--zone_size", str(ZONE), "--conv_zones", str(conv), *args)
    return d.dev_id, f"/dev/ublkb{d.dev_id}"


def dd(dev: str, seek_bytes: int, nbytes: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["dd", "if=/dev/urandom", f"of={dev}", "bs=64k",
                           "oflag=direct,seek_bytes", f"seek={seek_bytes}",
                           f"count={nbytes // (64 << 10)}"],
                          capture_output=True, text=True, timeout=60)


def test_blkzone_report_matches_the_layout(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path, "--max_open_zones", "4", "--max_active_zones", "6")
    zones = report(dev)
    assert len(zones) == 16
    assert [z.start for z in zones] == [i * ZONE_SECTORS for i in range(16)]
    assert all(z.length == ZONE_SECTORS for z in zones)
    assert [(z.type, z.cond) for z in zones[:2]] == [(1, 0), (1, 0)]  # conventional
    assert all((z.type, z.cond, z.wp) == (2, 1, 0) for z in zones[2:])  # empty
    assert Path(f"/sys/block/ublkb{dev_id}/queue/zoned").read_text().strip() == "host-managed"
    sysfs = Path(f"/sys/block/ublkb{dev_id}/queue")
    assert (sysfs / "chunk_sectors").read_text().strip() == str(ZONE_SECTORS)
    assert (sysfs / "max_open_zones").read_text().strip() == "4"
    assert (sysfs / "max_active_zones").read_text().strip() == "6"
    delete(dev_id)


def test_writes_only_at_the_write_pointer(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path)
    seq = 2 * ZONE
    assert dd(dev, seq, MiB).returncode == 0
    z = report(dev)[2]
    assert (z.cond, z.wp) == (2, MiB >> 9)  # implicitly open, moved by 1M
    assert dd(dev, seq, 64 << 10).returncode != 0  # behind the pointer
    assert dd(dev, seq + 4 * MiB, 64 << 10).returncode != 0  # ahead of it
    assert dd(dev, 0, MiB).returncode == 0  # conventional: anywhere
    assert dd(dev, ZONE + 3 * MiB, MiB).returncode == 0
    delete(dev_id)


def test_blkzone_open_close_finish_reset(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path)
    sector = str(3 * ZONE_SECTORS)

    def cond() -> int:
        return report(dev)[3].cond

    run("blkzone", "open", "-o", sector, "-c", "1", dev)
    assert cond() == 3
    run("blkzone", "close", "-o", sector, "-c", "1", dev)
    assert cond() == 1  # nothing written: closing empties it
    assert dd(dev, 3 * ZONE, MiB).returncode == 0
    run("blkzone", "close", "-o", sector, "-c", "1", dev)
    assert cond() == 4
    run("blkzone", "finish", "-o", sector, "-c", "1", dev)
    assert (report(dev)[3].cond, report(dev)[3].wp) == (0xE, ZONE_SECTORS)
    run("blkzone", "reset", "-o", sector, "-c", "1", dev)
    assert (report(dev)[3].cond, report(dev)[3].wp) == (1, 0)
    with open(dev, "rb") as f:  # a reset zone reads back as zeros
        f.seek(3 * ZONE)
        assert f.read(MiB) == bytes(MiB)
    for z in (4, 5):
        assert dd(dev, z * ZONE, MiB).returncode == 0
    run("blkzone", "reset", dev)  # every zone: the kernel sends ZONE_RESET_ALL
    assert all(z.cond == 1 for z in report(dev)[2:])
    delete(dev_id)


@pytest.mark.parametrize("path", ["--no-batch", "-b"])
@pytest.mark.parametrize("rw", ["write", "randwrite"])
def test_fio_zbd_verify(tmp_path: Path, path: str, rw: str) -> None:
    dev_id, dev = zoned(tmp_path, path, "-q", "2", "--max_open_zones", "8")
    job = fio(dev, tmp_path, "--zonemode=zbd", f"--rw={rw}", "--bs=64k", "--iodepth=16",
              "--size=128M", "--offset=32M", "--max_open_zones=8", "--verify=crc32c",
              "--verify_fatal=1", "--do_verify=1", timeout=300)
    assert job["write"]["io_bytes"] > 0  # type: ignore[index]
    delete(dev_id)


def test_zone_states_survive_a_restart(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path)
    data = os.urandom(MiB)
    subprocess.run(["dd", f"of={dev}", "bs=1M", "count=1", "iflag=fullblock",
                    "oflag=direct,seek_bytes", f"seek={2 * ZONE}"], input=data, check=True,
                   capture_output=True, timeout=60)
    run("blkzone", "finish", "-o", str(4 * ZONE_SECTORS), "-c", "1", dev)
    delete(dev_id)
    assert (tmp_path / "zoned.img.zones").exists()
    dev_id, dev = zoned(tmp_path)
    zones = report(dev)
    assert (zones[2].cond, zones[2].wp) == (4, MiB >> 9)  # open before: closed now
    assert (zones[4].cond, zones[4].wp) == (0xE, ZONE_SECTORS)
    with open(dev, "rb") as f:
        f.seek(2 * ZONE)
        assert f.read(MiB) == data
    delete(dev_id)


def test_other_copy_modes_are_refused_in_one_line() -> None:
    p = cli("add", "-t", "zoned", "-z", check=False)
    assert p.returncode != 0
    assert p.stderr.count("\n") == 1 and "-u" in p.stderr


@pytest.mark.skipif(shutil.which("mkfs.btrfs") is None,
                    reason="mkfs.btrfs not installed (Debian package btrfs-progs)")
def test_btrfs_zoned_writes_with_zone_append(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path, size=1024 * MiB, conv=0)
    run("mkfs.btrfs", "-f", "-O", "zoned", "-d", "single", "-m", "single", dev, timeout=300)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = os.urandom(8 * MiB)
    run("mount", "-t", "btrfs", dev, str(mnt))
    try:
        for i in range(4):
            (mnt / f"f{i}").write_bytes(data)
        run("sync")
    finally:
        run("umount", str(mnt))
    assert any(z.wp for z in report(dev))  # data went out (zone appends, in btrfs)
    run("mount", "-t", "btrfs", dev, str(mnt))
    try:
        assert all((mnt / f"f{i}").read_bytes() == data for i in range(4))
    finally:
        run("umount", str(mnt))
    delete(dev_id)


@pytest.mark.skipif(shutil.which("mkfs.f2fs") is None,
                    reason="mkfs.f2fs not installed (Debian package f2fs-tools)")
def test_f2fs_on_the_zoned_device(tmp_path: Path) -> None:
    dev_id, dev = zoned(tmp_path, size=1024 * MiB, conv=8)
    run("mkfs.f2fs", "-f", "-m", dev, timeout=300)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = os.urandom(4 * MiB)
    run("mount", "-t", "f2fs", dev, str(mnt))
    try:
        for i in range(4):
            (mnt / f"f{i}").write_bytes(data)
        run("sync")
    finally:
        run("umount", str(mnt))
    run("mount", "-t", "f2fs", dev, str(mnt))
    try:
        assert all((mnt / f"f{i}").read_bytes() == data for i in range(4))
    finally:
        run("umount", str(mnt))
    delete(dev_id)
