"""The nvme target against the real driver, on the emulated NVMe controller
every guest boot has (aioublk.testing.guest: /dev/ng0n1 over a sparse file
on the host), through the CLI."""

from __future__ import annotations

import mmap
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.qcow2.test_kernel_qcow2 import delta, served
from tests.support import kernel
from tests.support.kernel import add, cli, delete, fio, parse_list, run

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
NG = "/dev/ng0n1"
BLOCK = "/dev/nvme0n1"
SYSFS = Path("/sys/block/nvme0n1")


@pytest.fixture(autouse=True)
def namespace() -> Iterator[None]:
    """The emulated namespace is there (a guest boot without it is a broken
    harness, not a reason to skip)."""
    assert stat.S_ISCHR(os.stat(NG).st_mode), f"{NG} is missing: the guest has no NVMe drive"
    yield


def _queue(name: str) -> int:
    return int((SYSFS / "queue" / name).read_text().split()[0])


def test_the_device_has_the_namespace_geometry() -> None:
    dev = add("-t", "nvme", NG, "-q", "1")
    try:
        lbs = _queue("logical_block_size")
        assert dev.block_size == lbs
        assert dev.sectors * 512 == int((SYSFS / "size").read_text()) * 512 // lbs * lbs
        (listed,) = parse_list(cli("list", "-n", str(dev.dev_id)).stdout)
        assert listed.target == f"nvme file {NG}", listed
        ublk = Path(f"/sys/block/ublkb{dev.dev_id}/queue")
        assert int((ublk / "logical_block_size").read_text()) == lbs
        assert int((ublk / "max_hw_sectors_kb").read_text()) <= _queue("max_hw_sectors_kb")
    finally:
        delete(dev.dev_id)


# (every copy mode of the C data plane's passthrough: test_kernel_dataplane)
@pytest.mark.parametrize("copy", [[], ["-z"]], ids=["copy", "zero_copy"])
def test_fio_verify(copy: list[str], tmp_path: Path) -> None:
    dev = add("-t", "nvme", NG, "-q", "2", *copy)
    try:
        job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=8k",
                  "--iodepth=32", "--size=32M", "--verify=crc32c", "--verify_fatal=1",
                  "--do_verify=1")
        assert job["write"]["io_bytes"] == 32 * MiB  # type: ignore[index]
        job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randrw", "--bsrange=4k-256k",
                  "--iodepth=16", "--size=32M", "--offset=128M", "--verify=md5",
                  "--verify_fatal=1", "--do_verify=1")
        assert job["write"]["io_bytes"] > 0  # type: ignore[index]
    finally:
        delete(dev.dev_id)


def _direct_read(path: str, offset: int, length: int) -> bytes:
    """Read past the page cache (the namespace's block device may cache an
    older copy of what the ublk device wrote)."""
    buf = mmap.mmap(-1, length)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buf], offset) == length
        return bytes(buf)
    finally:
        os.close(fd)
        buf.close()


def test_written_data_reaches_the_namespace() -> None:
    dev = add("-t", "nvme", NG, "-q", "1")
    data = b"".join(i.to_bytes(4, "little") * 1024 for i in range(2048))  # 8 MiB
    offset = 5 * MiB
    fd = os.open(f"/dev/ublkb{dev.dev_id}", os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
        delete(dev.dev_id)
    assert _direct_read(BLOCK, offset, len(data)) == data


def test_ext4_survives_remount_and_readd(tmp_path: Path) -> None:
    dev = add("-t", "nvme", NG)
    blk = f"/dev/ublkb{dev.dev_id}"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    files = {f"f{i}": os.urandom(37 * 1024 + i) for i in range(20)}
    try:
        run("mkfs.ext4", "-q", "-F", blk)
        run("mount", blk, str(mnt))
        for name, body in files.items():
            (mnt / name).write_bytes(body)
        run("umount", str(mnt))
        run("mount", blk, str(mnt))
        assert {n: (mnt / n).read_bytes() for n in files} == files
        run("umount", str(mnt))
    finally:
        delete(dev.dev_id)
    # the data lives on the namespace: a new device over it sees it
    dev = add("-t", "nvme", NG)
    blk = f"/dev/ublkb{dev.dev_id}"
    run("mount", "-o", "ro", blk, str(mnt))
    try:
        assert {n: (mnt / n).read_bytes() for n in files} == files
    finally:
        run("umount", str(mnt))
        delete(dev.dev_id)


def test_discard_and_write_zeroes() -> None:
    dev = add("-t", "nvme", NG, "-q", "1")
    blk = f"/dev/ublkb{dev.dev_id}"
    try:
        queue = Path(f"/sys/block/ublkb{dev.dev_id}/queue")
        assert int((queue / "discard_max_bytes").read_text()) > 0
        fd = os.open(blk, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xa5" * (4 * MiB), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        run("blkdiscard", "-o", str(MiB), "-l", str(MiB), blk)  # deallocate
        run("blkdiscard", "-z", "-o", str(2 * MiB), "-l", str(MiB), blk)  # write zeroes
        assert _direct_read(blk, 2 * MiB, MiB) == bytes(MiB)
        assert _direct_read(blk, 3 * MiB, MiB) == b"\xa5" * MiB
    finally:
        delete(dev.dev_id)


@pytest.mark.parametrize("copy", [[], ["-z"], ["--auto_zc"]],
                         ids=["copy", "zero_copy", "auto_zc"])
def test_flush_discard_write_zeroes_and_fua_are_served_in_c(copy: list[str]) -> None:
    """Issue #25: the namespace's flush, deallocate, write zeroes and FUA
    writes are each one command from the C data plane; none reaches
    Python, and what they did is on the namespace."""
    dev = add("-t", "nvme", NG, "-q", "1", *copy)
    blk = f"/dev/ublkb{dev.dev_id}"
    try:
        queue = Path(f"/sys/block/ublkb{dev.dev_id}/queue")
        assert (queue / "write_cache").read_text().strip() == "write back"
        assert int((queue / "fua").read_text()) == 1  # the namespace takes FUA: so do we
        s0 = served(dev.dev_id, time.time())
        data = mmap.mmap(-1, MiB)
        data.write(b"\x3c" * MiB)
        fd = os.open(blk, os.O_WRONLY | os.O_DIRECT | os.O_DSYNC)  # FUA writes
        try:
            for i in range(4):
                assert os.pwritev(fd, [data], 8 * MiB + i * MiB) == MiB
            os.fsync(fd)  # a flush
        finally:
            os.close(fd)
            data.close()
        run("blkdiscard", "-o", str(MiB), "-l", str(MiB), blk)  # deallocate
        run("blkdiscard", "-z", "-o", str(2 * MiB), "-l", str(MiB), blk)  # write zeroes
        d = delta(s0, served(dev.dev_id, time.time()))
        assert d["py_handed"] == 0, f"requests reached Python: {d}"
        assert d["c_served"] >= 4 + 1 + 2, d
        assert _direct_read(BLOCK, 2 * MiB, MiB) == bytes(MiB)
        assert _direct_read(BLOCK, 8 * MiB, 4 * MiB) == b"\x3c" * (4 * MiB)
    finally:
        delete(dev.dev_id)


@pytest.mark.parametrize(("args", "message"), [
    ([BLOCK], f"{BLOCK} is not a character device"),
    (["/dev/null"], "/dev/null is not an NVMe generic char device"),
    ([], "the nvme target needs exactly one NVMe generic char device, got 0"),
])
def test_refusals_are_one_line(args: list[str], message: str) -> None:
    p = cli("add", "-t", "nvme", *args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert kernel.listing() == []
