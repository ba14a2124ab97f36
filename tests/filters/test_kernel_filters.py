"""Filter stacks against the real driver: fio verifies through them, and each
filter's effect is checked from outside (the backing file, the clock, the
errno a reader gets, the kernel's read-only flag)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.kernel import (
    add,
    cli,
    delete,
    fio,
    make_file,
    parse_list,
    run,
    start_server,
    tail,
    wait_exit,
    write_synced,
)

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20


def _direct_read(path: str, offset: int, n: int = 4096) -> bytes:
    buf = mmap.mmap(-1, n)  # page aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.preadv(fd, [buf], offset)
    finally:
        os.close(fd)
    return bytes(buf[:got])


def _c_served(dev_id: int, timeout: float = 30) -> float:
    """The requests the server's C data plane served, once it published them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cli("list", "-n", str(dev_id), "--stats", "--json").stdout
        rows = json.loads(out)[0]["stats"]
        if rows and sum(r.get("ios", 0) for r in rows):
            return float(sum(r.get("c_served", 0) for r in rows))
        time.sleep(0.5)
    raise AssertionError(f"device {dev_id} published no counters in {timeout} s")


def test_placement_filters_keep_c_serving_and_move_the_data(tmp_path: Path) -> None:
    backing = make_file(tmp_path / "disk.img", 96 * MiB)
    # outermost first: a 16 MiB offset into the file's first 64 MiB
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", "offset:offset=16M",
              "--filter", "truncate:size=64M")
    assert dev.sectors == 48 * MiB >> 9
    [listed] = parse_list(cli("list", "-n", str(dev.dev_id)).stdout)
    assert listed.target.endswith("filters offset:offset=16M truncate:size=64M")
    blk = f"/dev/ublkb{dev.dev_id}"
    job = fio(blk, tmp_path, "--rw=randwrite", "--bs=8k", "--iodepth=16", "--size=32M",
              "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    assert job["write"]["io_bytes"] == 32 * MiB  # type: ignore[index]
    mark = os.urandom(4096)
    fd = os.open(blk, os.O_WRONLY)
    try:
        os.pwrite(fd, mark, 40 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert _c_served(dev.dev_id) > 0, "the placement filters took the map away"
    delete(dev.dev_id)
    with open(backing, "rb") as f:
        assert f.read(16 * MiB) == bytes(16 * MiB)  # nothing before the window
        f.seek(56 * MiB)
        assert f.read(4096) == mark


def test_fio_verifies_through_a_stack_of_the_python_filters(tmp_path: Path) -> None:
    """fio's verify through one stack of every filter that hands data on
    (encrypt changed and back), outermost first; the ones that refuse or
    fail guard ranges fio does not write, so they pass its requests on."""
    backing = make_file(tmp_path / "disk.img", 40 * MiB)
    key = tmp_path / "key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)  # (a key others may read is refused)
    log = tmp_path / "requests.log"
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", f"log:file={log}",
              "--filter", "rate:iops=100000", "--filter", "delay:write=1ms",
              "--filter", "error:ops=write,offset=30M", "--filter", "protect:ranges=31M-32M",
              "--filter", f"encrypt:keyfile={key}", "--filter", "offset:offset=1M",
              "--filter", "truncate:size=36M")
    assert dev.sectors == 35 * MiB >> 9  # (truncate, inner, first; then the offset)
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=8k",
              "--iodepth=16", "--size=16M", "--verify=crc32c", "--verify_fatal=1",
              "--do_verify=1")
    assert job["write"]["io_bytes"] == 16 * MiB  # type: ignore[index]
    delete(dev.dev_id)
    ops = {json.loads(line)["op"] for line in log.read_text().splitlines()}
    assert {"read", "write"} <= ops
    with open(backing, "rb") as f:
        assert f.read(MiB) == bytes(MiB)  # before the offset: never written
        assert f.read(16 * MiB).count(0) < 8 * MiB  # fio's blocks, encrypted


def test_delay_error_and_readonly_are_seen_from_outside(tmp_path: Path) -> None:
    backing = make_file(tmp_path / "disk.img", 16 * MiB)
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter",
              "error:ops=read,errno=ENOSPC,offset=1M,length=1M", "--filter", "delay:read=200ms",
              "--filter", "readonly")
    blk = f"/dev/ublkb{dev.dev_id}"
    t0 = time.monotonic()
    assert _direct_read(blk, 0) == bytes(4096)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(OSError):  # (the block layer reports its own errno for ENOSPC)
        _direct_read(blk, MiB + 4096)
    assert _direct_read(blk, 2 * MiB) == bytes(4096)
    with open(f"/sys/block/ublkb{dev.dev_id}/ro") as f:
        assert f.read().strip() == "1"
    fd = os.open(blk, os.O_WRONLY | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as e:
            os.pwritev(fd, [mmap.mmap(-1, 4096)], 0)
    finally:
        os.close(fd)
    assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    delete(dev.dev_id)


def _inflight(dev_id: int, n: int, timeout: float = 60) -> None:
    """Wait until the server says ``n`` requests are in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = json.loads(cli("list", "-n", str(dev_id), "--stats", "--json").stdout)[0]["stats"]
        if rows and sum(r["inflight"] for r in rows) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"device {dev_id}: never {n} request(s) in flight in {timeout} s")


def test_error_hang_holds_a_read_until_the_server_stops(tmp_path: Path) -> None:
    """``hang``: the read is not answered while the server serves (the
    kernel would wait forever on a privileged device); the server's own stop
    (SIGTERM, as Ctrl-C or systemd's) fails it and still removes the device.
    The range spares the blocks the kernel's partition scan reads."""
    log = tmp_path / "server.log"
    dev = start_server(["-t", "null", "-q", "1", "--filter",
                        "error:ops=read,offset=1M,length=1M,hang=true"], log)
    reader = subprocess.Popen(["dd", f"if=/dev/ublkb{dev.dev_id}", "of=/dev/null", "bs=4k",
                               "count=1", "skip=256", "iflag=direct"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        _inflight(dev.dev_id, 1)
        assert reader.poll() is None, reader.stderr
        assert _direct_read(f"/dev/ublkb{dev.dev_id}", 0) == bytes(4096)  # the rest serves
        os.kill(dev.pid, signal.SIGTERM)
        assert wait_exit(dev.pid, 120) == 0, tail(log)
        _, err = reader.communicate(timeout=60)
    finally:
        reader.kill()
        reader.wait()
    assert reader.returncode != 0 and "Input/output error" in err, err
    assert not Path(f"/dev/ublkc{dev.dev_id}").exists()


def test_run_serves_for_the_commands_lifetime(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    p = cli("add", "-t", "null", "--run", f'test -b "$ublk" && echo "$ublk_id $ublk" > {seen}; '
            "exit 7", check=False)
    assert p.returncode == 7, p.stderr
    dev_id, node = seen.read_text().split()
    assert node == f"/dev/ublkb{dev_id}" and not Path(node).exists()
    assert not Path(f"/dev/ublkc{dev_id}").exists()


def test_rate_limits_and_log_records_each_request(tmp_path: Path) -> None:
    backing = make_file(tmp_path / "disk.img", 16 * MiB)
    log = tmp_path / "requests.log"
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", f"log:file={log}",
              "--filter", "rate:iops=100")
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randread", "--bs=4k", "--iodepth=8",
              "--time_based", "--runtime=3", "--size=16M")
    ios = job["read"]["total_ios"]  # type: ignore[index]
    assert 0 < ios <= 100 + 3 * 100 + 8  # a second's burst, then 100 a second
    delete(dev.dev_id)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    reads = [x for x in lines if x["op"] == "read"]
    assert len(reads) >= ios and all(x["result"] == 0 and x["length"] == 4096 for x in reads)


def test_cow_verifies_and_leaves_the_backing_file_unwritten(tmp_path: Path) -> None:
    backing = make_file(tmp_path / "disk.img", 32 * MiB)
    before = backing.read_bytes()
    dev = add("-t", "loop", str(backing), "-q", "2", "--filter", "cow")
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=6k",
              "--iodepth=16", "--size=24M", "--verify=crc32c", "--verify_fatal=1",
              "--do_verify=1")
    assert job["write"]["io_bytes"] == 24 * MiB  # type: ignore[index]
    delete(dev.dev_id)
    assert backing.read_bytes() == before
    dev = add("-t", "loop", str(backing), "-q", "2", "--filter", "cow:commit=true")
    mark = os.urandom(12288)
    write_synced(f"/dev/ublkb{dev.dev_id}", mark, 5 * MiB + 512)
    assert backing.read_bytes() == before  # until the device stops
    delete(dev.dev_id)
    assert _read_synced(str(backing), 5 * MiB + 512, 12288) == mark


def test_cow_commits_on_a_command_while_serving(tmp_path: Path) -> None:
    """``aioublk commit -n ID``: the overlay's blocks reach the backing file
    (flushed) while the device serves on, a write after the commit stays in
    the overlay, and a device without a cow filter is refused in one line."""
    backing = make_file(tmp_path / "disk.img", 32 * MiB)
    before = backing.read_bytes()
    dev = add("-t", "loop", str(backing), "-q", "2", "--filter", "cow")
    blk = f"/dev/ublkb{dev.dev_id}"
    mark, later = os.urandom(12288), os.urandom(4096)
    write_synced(blk, mark, 5 * MiB + 512)
    assert backing.read_bytes() == before
    out = cli("commit", "-n", str(dev.dev_id)).stdout
    assert out == f"device {dev.dev_id}: 4 blocks of 4096 bytes committed\n"
    assert _read_synced(str(backing), 5 * MiB + 512, 12288) == mark
    write_synced(blk, later, 9 * MiB)
    assert _read_synced(blk, 5 * MiB + 512, 12288) == mark  # still serving
    assert cli("commit", "-n", str(dev.dev_id)).stdout.startswith(
        f"device {dev.dev_id}: 1 block of")
    assert _read_synced(str(backing), 9 * MiB, 4096) == later
    delete(dev.dev_id)
    plain = add("-t", "null", "-q", "1")
    refused = cli("commit", "-n", str(plain.dev_id), check=False)
    assert (refused.returncode, refused.stderr) == (
        1, f"aioublk: device {plain.dev_id} has no cow filter: nothing to commit\n")
    delete(plain.dev_id)


def _read_synced(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def test_encrypt_matches_dm_crypt_plain_both_ways(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DM_DISABLE_UDEV", "1")  # (no udev in the guest: nodes made directly)
    run("modprobe", "dm_crypt")
    run("modprobe", "loop")
    key = tmp_path / "key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)  # (a key others may read is refused)
    backing = make_file(tmp_path / "disk.img", 8 * MiB)
    ours, theirs = os.urandom(MiB), os.urandom(MiB)
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", f"encrypt:keyfile={key}")
    write_synced(f"/dev/ublkb{dev.dev_id}", ours, MiB)
    delete(dev.dev_id)
    assert _read_synced(str(backing), MiB, MiB) != ours  # stored encrypted
    name = f"aioublk-{os.getpid()}"
    run("cryptsetup", "open", "--type", "plain", "--cipher", "aes-xts-plain64",
        "--key-size", "512", "--key-file", str(key), str(backing), name)
    try:
        mapped = f"/dev/mapper/{name}"
        assert _read_synced(mapped, MiB, MiB) == ours  # what we wrote, as dm-crypt reads it
        write_synced(mapped, theirs, 5 * MiB)
    finally:
        run("cryptsetup", "close", name)
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", f"encrypt:keyfile={key}")
    got = _read_synced(f"/dev/ublkb{dev.dev_id}", 5 * MiB, MiB)
    delete(dev.dev_id)
    assert got == theirs  # what dm-crypt wrote, as we read it


def test_protect_refuses_writes_to_its_ranges(tmp_path: Path) -> None:
    backing = make_file(tmp_path / "disk.img", 8 * MiB)
    dev = add("-t", "loop", str(backing), "-q", "1", "--filter", "protect:ranges=0-1M")
    blk = f"/dev/ublkb{dev.dev_id}"
    with pytest.raises(OSError):
        write_synced(blk, os.urandom(4096), 4096)
    write_synced(blk, b"k" * 4096, 2 * MiB)
    assert _c_served(dev.dev_id) > 0, "protect took the loop's map away"
    delete(dev.dev_id)
    assert _read_synced(str(backing), 0, MiB) == bytes(MiB)
    assert _read_synced(str(backing), 2 * MiB, 4096) == b"k" * 4096


def test_partition_serves_one_gpt_partition(tmp_path: Path) -> None:
    disk = make_file(tmp_path / "gpt.img", 64 * MiB)
    run("sgdisk", "-n", "1:2048:+8M", "-n", "2:0:+16M", str(disk))
    info = run("sgdisk", "-i", "2", str(disk))
    first = int(info.split("First sector: ")[1].split()[0]) * 512
    dev = add("-t", "loop", str(disk), "-q", "1", "--filter", "partition:partition=2")
    assert dev.sectors == 16 * MiB >> 9
    mark = os.urandom(8192)
    write_synced(f"/dev/ublkb{dev.dev_id}", mark, MiB)
    assert _c_served(dev.dev_id) > 0, "the partition filter took the map away"
    delete(dev.dev_id)
    assert _read_synced(str(disk), first + MiB, 8192) == mark


def test_partition_serves_a_logical_mbr_partition(tmp_path: Path) -> None:
    """Partition 6, the second logical one in an extended partition's EBR
    chain, where the kernel itself finds it on a plain loop of the file."""
    disk = make_file(tmp_path / "mbr.img", 64 * MiB)
    run("parted", "-s", str(disk), "mklabel", "msdos", "mkpart", "extended", "1MiB", "60MiB",
        "mkpart", "logical", "2MiB", "10MiB", "mkpart", "logical", "11MiB", "27MiB")
    dev = add("-t", "loop", str(disk), "-q", "1", "--filter", "partition:partition=6")
    assert dev.sectors == 16 * MiB >> 9
    mark = os.urandom(8192)
    write_synced(f"/dev/ublkb{dev.dev_id}", mark, MiB)
    assert _c_served(dev.dev_id) > 0, "the partition filter took the map away"
    delete(dev.dev_id)
    # the kernel's own reading of the table: sysfs gives partition 6's first sector
    run("modprobe", "loop")
    loop = run("losetup", "--find", "--show", "--partscan", str(disk)).strip()
    try:
        start = int(Path(f"/sys/class/block/{Path(loop).name}p6/start").read_text()) * 512
    finally:
        run("losetup", "-d", loop)
    assert start == 11 * MiB
    assert _read_synced(str(disk), start + MiB, 8192) == mark


def test_cache_write_back_verifies_and_loses_nothing_to_kill9(tmp_path: Path) -> None:
    from tests.device.test_kernel_lifecycle import reap, wait_state
    backing = make_file(tmp_path / "disk.img", 64 * MiB)
    dev = add("-t", "loop", str(backing), "-q", "2", "--filter",
              "cache:mode=writeback,size=4M,block=16K")
    job = fio(f"/dev/ublkb{dev.dev_id}", tmp_path, "--rw=randwrite", "--bs=8k",
              "--iodepth=16", "--size=24M", "--verify=crc32c", "--verify_fatal=1",
              "--do_verify=1", "--fsync=64")  # 24 MiB through a 4 MiB cache: evictions
    assert job["write"]["io_bytes"] == 24 * MiB  # type: ignore[index]
    delete(dev.dev_id)
    # with user recovery a write acknowledged is the next server's: the cache writes
    # through, so a write never flushed survives its server's SIGKILL
    args = ["-t", "loop", str(backing), "-q", "1", "-r", "1", "--filter",
            "cache:mode=writeback"]
    dev = start_server(args, tmp_path / "first.log")
    mark = mmap.mmap(-1, 65536)
    mark.write(os.urandom(65536))
    fd = os.open(f"/dev/ublkb{dev.dev_id}", os.O_WRONLY | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [mark], 3 * MiB) == 65536
    finally:
        os.close(fd)
    os.kill(dev.pid, signal.SIGKILL)
    assert reap(dev.pid) == -signal.SIGKILL
    wait_state(dev.dev_id, "QUIESCED")
    new = start_server(["-n", str(dev.dev_id), *args], tmp_path / "second.log", cmd="recover")
    got = _direct_read(f"/dev/ublkb{dev.dev_id}", 3 * MiB, 65536)
    delete(dev.dev_id)
    assert reap(new.pid) == 0
    assert got == bytes(mark)


def test_add_json_prints_the_device_as_list_json_does() -> None:
    p = cli("add", "-t", "null", "-q", "1", "--json", "--filter", "readonly")
    [dev] = json.loads(p.stdout)
    try:
        assert dev["state"] == "LIVE" and dev["nr_hw_queues"] == 1
        assert (dev["target"], dev["filters"]) == ("null", ["readonly"])
        listed = json.loads(cli("list", "-n", str(dev["dev_id"]), "--json").stdout)
        assert listed == [dev]
    finally:
        delete(dev["dev_id"])
