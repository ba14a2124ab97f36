"""null, loop and stripe against the real driver, through the CLI."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aioublk.io.hostfile import Backing, HostFile
from aioublk.ring import Ring
from aioublk.targets.stripe import split
from tests.support import kernel
from tests.support.kernel import add, cli, delete, fio, make_file, run

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20


def target_args(target: str, tmp_path: Path, size: int = 256 * MiB) -> list[str]:
    if target == "null":
        return ["-t", "null"]
    if target == "loop":
        return ["-t", "loop", str(make_file(tmp_path / "loop.img", size))]
    return ["-t", "stripe", "--chunk_size", "65536",
            str(make_file(tmp_path / "s0.img", size // 2)),
            str(make_file(tmp_path / "s1.img", size // 2))]


@pytest.mark.parametrize("target", ["null", "loop", "stripe"])
@pytest.mark.parametrize("queues,depth", [(1, 1), (2, 64), (4, 128)])
def test_fio_randrw(target: str, queues: int, depth: int, tmp_path: Path) -> None:
    dev = add(*target_args(target, tmp_path), "-q", str(queues), "-d", str(depth))
    assert dev.queues == queues, "the guest needs as many CPUs as queues"
    assert dev.depth == depth
    assert len(dev.affinity) == dev.queues
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randrw", "--bs=4k",
              f"--iodepth={max(depth, 1)}", "--time_based", "--runtime=2", "--size=128M",
              f"--numjobs={1}")
    assert job["read"]["io_bytes"] > 0 and job["write"]["io_bytes"] > 0  # type: ignore[index]
    delete(dev.dev_id)
    assert not Path(f"/dev/ublkb{dev.dev_id}").exists()


@pytest.mark.parametrize("target", ["loop", "stripe"])
def test_fio_verify(target: str, tmp_path: Path) -> None:
    dev = add(*target_args(target, tmp_path), "-q", "2")
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=8k",
              "--iodepth=32", "--size=48M", "--verify=crc32c", "--verify_fatal=1",
              "--do_verify=1")
    assert job["write"]["io_bytes"] == 48 * MiB  # type: ignore[index]
    delete(dev.dev_id)


def _pattern(n: int) -> bytes:
    return b"".join(i.to_bytes(4, "little") * 1024 for i in range(n))  # n 4 KiB blocks


@pytest.mark.parametrize("target", ["loop", "stripe"])
def test_written_data_reaches_backing(target: str, tmp_path: Path) -> None:
    args = target_args(target, tmp_path, size=64 * MiB)
    dev = add(*args, "-q", "1")
    data = _pattern(2048)  # 8 MiB, crossing many 64 KiB chunks
    offset = 3 * MiB + 4096
    fd = os.open(f"/dev/ublkb{dev.dev_id}", os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    delete(dev.dev_id)
    files = [Path(a) for a in args if a.endswith(".img")]
    if target == "loop":
        with open(files[0], "rb") as f:
            f.seek(offset)
            assert f.read(len(data)) == data
        return
    got = bytearray(len(data))
    for idx, (file_off, pieces) in split(offset, len(data), 65536, len(files)).items():
        with open(files[idx], "rb") as f:
            f.seek(file_off)
            for start, n in pieces:
                got[start:start + n] = f.read(n)
    assert bytes(got) == data


@pytest.mark.parametrize("target", ["loop", "stripe"])
def test_ext4_survives_remount_and_readd(target: str, tmp_path: Path) -> None:
    args = target_args(target, tmp_path)
    dev = add(*args)
    blk = f"/dev/ublkb{dev.dev_id}"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mkfs.ext4", "-q", "-F", blk)
    run("mount", blk, str(mnt))
    files = {f"f{i}": os.urandom(37 * 1024 + i) for i in range(20)}
    for name, body in files.items():
        (mnt / name).write_bytes(body)
    run("umount", str(mnt))
    run("mount", blk, str(mnt))
    assert {n: (mnt / n).read_bytes() for n in files} == files
    run("umount", str(mnt))
    delete(dev.dev_id)
    # the data lives in the backing files: a new device over them sees it
    dev = add(*args)
    blk = f"/dev/ublkb{dev.dev_id}"
    run("mount", "-o", "ro", blk, str(mnt))
    try:
        assert {n: (mnt / n).read_bytes() for n in files} == files
    finally:
        run("umount", str(mnt))
    delete(dev.dev_id)


def _wait_io_started(dev_id: int) -> None:
    stat = Path(f"/sys/block/ublkb{dev_id}/stat")
    for _ in range(200):
        fields = stat.read_text().split()
        if int(fields[0]) + int(fields[4]) > 100:
            return
        time.sleep(0.05)
    raise AssertionError("fio never started I/O")


def _interrupt_fio(dev: kernel.DevListing, cwd: Path, interrupt: Callable[[], None]) -> None:
    """Run fio on the device, interrupt the server mid-I/O, and check that fio
    ends (nothing hangs) reporting errors."""
    proc = subprocess.Popen(
        ["fio", "--name=bg", f"--filename=/dev/ublkb{dev.dev_id}", "--ioengine=io_uring",
         "--direct=1", "--rw=randrw", "--bs=4k", "--iodepth=32", "--time_based",
         "--runtime=60"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    try:
        _wait_io_started(dev.dev_id)
        interrupt()
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0, out
    kernel.wait_gone(dev.pid)


# each queue path once, each target once (kill -9 below takes the other pairs)
@pytest.mark.parametrize("target,path", [("null", "-b"), ("loop", "--no-batch")])
def test_delete_under_io(target: str, path: str, tmp_path: Path) -> None:
    dev = add(*target_args(target, tmp_path), path)
    _interrupt_fio(dev, tmp_path, lambda: cli("del", "-n", str(dev.dev_id), timeout=60))
    assert not Path(f"/dev/ublkb{dev.dev_id}").exists()


@pytest.mark.parametrize("target,path", [("loop", "-b"), ("null", "--no-batch")])
def test_kill9_under_io(target: str, path: str, tmp_path: Path) -> None:
    dev = add(*target_args(target, tmp_path), path)
    _interrupt_fio(dev, tmp_path, lambda: os.kill(dev.pid, 9))
    # the kernel ends the device in work it queues once the server's file is
    # released, after the process is gone: until then it still reads LIVE
    deadline = time.monotonic() + 30
    while [d.state for d in kernel.listing() if d.dev_id == dev.dev_id] == ["LIVE"]:
        assert time.monotonic() < deadline, f"device {dev.dev_id} still LIVE without a server"
        time.sleep(0.1)
    cli("del", "-n", str(dev.dev_id), check=False)
    assert not [d for d in kernel.listing() if d.dev_id == dev.dev_id]


def test_several_devices_at_once(tmp_path: Path) -> None:
    kinds = ("null", "loop", "stripe")
    devs = {}
    for t in kinds:
        (tmp_path / t).mkdir()
        devs[t] = add(*target_args(t, tmp_path / t), "-q", "1")
    assert len({d.dev_id for d in devs.values()}) == 3
    procs = [subprocess.Popen(
        ["fio", "--name=m", f"--filename=/dev/ublkb{d.dev_id}", "--ioengine=io_uring",
         "--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=16M",
         # the null target keeps nothing, so only the others can verify
         *(["--verify=crc32c"] if t != "null" else [])],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for t, d in devs.items()]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    assert sorted(d.dev_id for d in kernel.listing()) == sorted(d.dev_id for d in devs.values())
    for d in devs.values():
        delete(d.dev_id)


@pytest.mark.parametrize("args,message", [
    (["-t", "loop", "/nonexistent.img"], "does not exist"),
    (["-t", "bogus"], "unknown target type"),
    (["-t", "null", "-d", "0"], "queue depth 0"),
    (["-t", "null", "-d", "4097"], "queue depth 4097"),
    (["-t", "null", "-q", "33"], "33 queues"),
    (["-t", "stripe", "SMALL0", "SMALL1"], "smaller than one chunk"),
    (["-t", "null", "EXTRA"], "takes no backing file"),
])
def test_bad_input(args: list[str], message: str, tmp_path: Path) -> None:
    small = [str(make_file(tmp_path / f"small{i}", 4096)) for i in range(2)]
    args = [small[0] if a == "SMALL0" else small[1] if a == "SMALL1" else a for a in args]
    p = cli("add", *args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert kernel.listing() == []


def test_device_id_in_use(tmp_path: Path) -> None:
    dev = add("-t", "null", "-n", "5")
    assert dev.dev_id == 5
    p = cli("add", "-t", "null", "-n", "5", check=False)
    assert p.returncode != 0
    assert p.stderr.strip().count("\n") == 0 and "already in use" in p.stderr, p.stderr
    assert [d.dev_id for d in kernel.listing()] == [5]
    delete(5)


def test_features_names_every_bit() -> None:
    out = cli("features").stdout.splitlines()
    assert out[0].startswith("ublk_drv features: 0x")
    feats = int(out[0].split("0x")[1], 16)
    assert feats & 0x8000, "the guest kernel offers UBLK_F_BATCH_IO"
    assert len(out) - 1 == bin(feats).count("1")
    for line in out[1:]:
        bit, name = line.split(": ")
        assert len(bit) == 18 and name.startswith("UBLK_F_"), line


def test_foreground_serves_until_sigterm_then_deletes(tmp_path: Path) -> None:
    proc = subprocess.Popen([*kernel.CLI, "add", "-t", "null", "-q", "1", "--foreground"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        (dev,) = kernel.parse_list("".join(lines))
        assert dev.state == "LIVE" and dev.pid == proc.pid
        fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randread", "--bs=4k", "--size=16M")
        proc.send_signal(15)
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    assert kernel.listing() == []


# ------------------------------------------------------------ cache flags --
# What each target tells the kernel about its cache (ublk_param_basic.attrs ->
# sysfs queue/write_cache and queue/fua), against what the target does. A
# target with volatile state (qcow2's cached metadata) or a volatile backing
# (a file's page cache, a disk's write cache) must say "write back", so that
# the kernel sends it FLUSH (each implements flush: tests/targets/test_fua_durable.py);
# FUA may be advertised only where a FUA write is durable when it completes
# (qcow2: write, then flush; the others leave FUA to the kernel, which sends a
# FLUSH after the write).

CACHE_FLAGS = {
    "null": ("write through", "0"),   # keeps nothing
    "loop": ("write back", "0"),
    "stripe": ("write back", "0"),
    "qcow2": ("write back", "1"),
}


def _flushes(dev_id: int) -> int:
    """Flush requests the device completed (/sys/block/X/stat, field 16)."""
    return int(Path(f"/sys/block/ublkb{dev_id}/stat").read_text().split()[15])


@pytest.mark.parametrize("target", list(CACHE_FLAGS))
def test_advertised_cache_flags_match_the_target(target: str, tmp_path: Path) -> None:
    if target == "qcow2":
        img = tmp_path / "img.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", str(img), "64M")
        args = ["-t", "qcow2", str(img)]
    else:
        args = target_args(target, tmp_path, size=64 * MiB)
    dev = add(*args, "-q", "1")
    try:
        queue = Path(f"/sys/block/ublkb{dev.dev_id}/queue")
        got = (queue.joinpath("write_cache").read_text().strip(),
               queue.joinpath("fua").read_text().strip())
        assert got == CACHE_FLAGS[target], f"{target}: write_cache, fua = {got}"
        # a write-back device is sent FLUSH (and it succeeds); a write-through one never is
        before = _flushes(dev.dev_id)
        fd = os.open(f"/dev/ublkb{dev.dev_id}", os.O_WRONLY | os.O_DSYNC)
        try:
            os.pwrite(fd, b"\x5c" * 4096, 0)   # O_DSYNC: FUA where offered, else + FLUSH
            os.fsync(fd)
        finally:
            os.close(fd)
        sent = _flushes(dev.dev_id) - before
        assert (sent > 0) == (got[0] == "write back"), f"{target}: {sent} flushes for {got}"
    finally:
        delete(dev.dev_id)


def test_daemon_runs_in_root_with_umask_022(tmp_path: Path) -> None:
    """``add``'s daemon holds no directory of the caller's busy and creates
    files with umask 022 whatever the caller's."""
    old = os.umask(0o077)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        dev = add("-t", "null", "-q", "1")
    finally:
        os.chdir(cwd)
        os.umask(old)
    try:
        assert os.readlink(f"/proc/{dev.pid}/cwd") == "/"
        status = Path(f"/proc/{dev.pid}/status").read_text()
        assert "Umask:\t0022" in status, status
    finally:
        delete(dev.dev_id)


# ------------------------------------------------ 4K-sector backing devices --

@contextmanager
def sectors_4k(tmp_path: Path, size: int = 64 * MiB) -> Iterator[str]:
    """A block device with 4096-byte logical sectors (a loop device over a file
    in ``tmp_path``): O_DIRECT on it refuses anything not 4 KiB aligned."""
    run("modprobe", "loop")
    back = make_file(tmp_path / "sectors4k.img", size)
    dev = run("losetup", "--sector-size", "4096", "-f", "--show", str(back)).strip()
    try:
        lbs = Path(f"/sys/block/{Path(dev).name}/queue/logical_block_size").read_text()
        assert lbs == "4096\n", f"{dev} has {lbs.strip()}-byte sectors"
        yield dev
    finally:
        run("losetup", "-d", dev)


def _aligned(data: bytes | int) -> memoryview:
    m = memoryview(mmap.mmap(-1, data if isinstance(data, int) else len(data)))
    if not isinstance(data, int):
        m[:] = data
    return m


def test_loop_over_a_4k_sector_device(tmp_path: Path) -> None:
    """The ublk device advertises the 4 KiB logical blocks its backing needs
    (a 512-byte request would be refused by O_DIRECT), and keeps data."""
    with sectors_4k(tmp_path) as back:
        dev = add("-t", "loop", "-q", "1", back)
        try:
            lbs = Path(f"/sys/block/ublkb{dev.dev_id}/queue/logical_block_size").read_text()
            assert lbs == "4096\n"
            assert dev.block_size == 4096
            job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=4k",
                      "--iodepth=16", "--size=32M", "--verify=crc32c", "--verify_fatal=1",
                      "--do_verify=1")
            assert job["write"]["io_bytes"] == 32 * MiB  # type: ignore[index]
        finally:
            delete(dev.dev_id)


@pytest.mark.asyncio
async def test_loop_backing_refused_by_direct_io_goes_buffered(ring: Ring,
                                                               tmp_path: Path) -> None:
    """A request O_DIRECT refuses (512 bytes on 4 KiB sectors, as a config's
    logical_block_size = 512 would send) is retried buffered, not failed."""
    with sectors_4k(tmp_path) as back:
        b = Backing(back)
        try:
            data = _aligned(os.urandom(512))
            await asyncio.wait_for(b.write(data, 512), 30)
            got = _aligned(512)
            await b.read_into(got, 512)
            assert got == data
            assert not b.direct and b.align.offset == 4096
        finally:
            b.close()


@pytest.mark.asyncio
async def test_qcow2_host_file_on_4k_sectors_does_not_spin(ring: Ring, tmp_path: Path) -> None:
    """HostFile used to retry an O_DIRECT EINVAL forever (holding the engine's
    write-back lock); now it opens buffered where 512-byte I/O cannot be direct."""
    with sectors_4k(tmp_path) as back:
        f = HostFile(back, read_only=False, direct=True)
        try:
            data = _aligned(os.urandom(512))
            await asyncio.wait_for(f.write(data, 512), 10)
            got = _aligned(512)
            await asyncio.wait_for(f.read_into(got, 512), 10)
            assert got == data and not f.direct
        finally:
            f.close()


def test_qcow2_on_a_4k_sector_file_system(tmp_path: Path) -> None:
    """A qcow2 image on ext4 over 4 KiB sectors: served (buffered), data kept
    with 4 KiB and 512-byte writes, the image clean for qemu-img check."""
    with sectors_4k(tmp_path, 256 * MiB) as back:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        run("mkfs.ext4", "-q", "-F", "-b", "4096", back)
        run("mount", back, str(mnt))
        try:
            img = str(mnt / "x.qcow2")
            run("qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
            dev = add("-t", "qcow2", "-q", "1", img)
            try:
                for bs, size in (("4k", "16M"), ("512", "2M")):
                    fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", f"--bs={bs}",
                        "--iodepth=8", f"--size={size}", "--verify=crc32c",
                        "--verify_fatal=1", "--do_verify=1", timeout=60)
            finally:
                delete(dev.dev_id)
            run("qemu-img", "check", img)
        finally:
            run("umount", str(mnt))
