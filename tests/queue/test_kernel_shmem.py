"""Shared-memory zero copy (``--shmem_zc --htlb FILE``) against the real
driver, after the kernel's selftests (test_shmemzc_01..04): fio on null and
loop with its buffers in the hugetlbfs file the server registered, with
and without ``--rdonly_shmem_buf``, in every copy mode; that the requests
really arrive in the shared buffer (the target is handed a view of our
mapping, not the tag's buffer); and the refusals.

Each test mounts hugetlbfs on a directory of its own; the module reserves
a few huge pages (``vm.nr_hugepages``) once, as the selftests do, and fails
without hugetlbfs or huge pages.
"""

from __future__ import annotations

import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk.queue.options import CopyMode
from aioublk.target import Buffer
from aioublk.targets import LoopTarget
from tests.support.kernel import add, cli, delete, fio, make_file, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
BUF_SIZE = 4 * MiB


@pytest.fixture(scope="module")
def huge_pages() -> Iterator[None]:
    """10 huge pages for the module's tests. Reserved once: after the tests
    before this module the guest's memory can be too fragmented for 2 MiB
    pages, so caches are dropped and memory compacted before asking again."""
    assert "hugetlbfs" in Path("/proc/filesystems").read_text(), "no hugetlbfs in the kernel"
    old = NR_HUGEPAGES.read_text().strip()
    for _ in range(3):
        NR_HUGEPAGES.write_text("10\n")
        if int(NR_HUGEPAGES.read_text()) >= 2:
            break
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        Path("/proc/sys/vm/compact_memory").write_text("1\n")
    try:
        assert int(NR_HUGEPAGES.read_text()) >= 2, "cannot reserve 2 huge pages"
        yield
    finally:
        NR_HUGEPAGES.write_text(old + "\n")


@pytest.fixture
def htlb(tmp_path: Path, huge_pages: None) -> Iterator[Path]:
    """A 4M file on a hugetlbfs mounted for the test."""
    mnt = tmp_path / "htlb"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mnt)], check=True)
    try:
        buf = mnt / "ublk_buf"
        subprocess.run(["fallocate", "-l", str(BUF_SIZE), str(buf)], check=True)
        yield buf
    finally:
        # lazily: a server that is still exiting may hold its mapping a moment
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fio_on(dev: str, cwd: Path, buf: Path, *args: str) -> dict[str, object]:
    """fio with its I/O buffers in ``buf`` (MAP_SHARED), so that its requests'
    pages are the registered buffer's."""
    return fio(dev, cwd, "--bs=4k", "--iodepth=32", f"--mem=mmaphuge:{buf}", *args)


def test_null_randwrite_in_the_shared_buffer(tmp_path: Path, htlb: Path) -> None:
    d = add("-t", "null", "--shmem_zc", "--htlb", str(htlb))
    job = fio_on(f"/dev/ublkb{d.dev_id}", tmp_path, htlb, "--rw=randwrite", "--size=4M")
    assert job["write"]["io_bytes"] == 4 * MiB  # type: ignore[index]
    delete(d.dev_id)


def test_null_with_a_read_only_buffer(tmp_path: Path, htlb: Path) -> None:
    d = add("-t", "null", "--shmem_zc", "--htlb", str(htlb), "--rdonly_shmem_buf")
    fio_on(f"/dev/ublkb{d.dev_id}", tmp_path, htlb, "--rw=randwrite", "--size=4M")
    delete(d.dev_id)


@pytest.mark.parametrize("mode", [[], ["-z"], ["--auto_zc"], ["-u"], ["--no-batch"]],
                         ids=["copy", "zero_copy", "auto_zc", "user_copy", "per_io"])
def test_loop_verify_in_the_shared_buffer(tmp_path: Path, htlb: Path, mode: list[str]) -> None:
    backing = make_file(tmp_path / "loop.img", 64 * MiB)
    d = add("-t", "loop", "--shmem_zc", "--htlb", str(htlb), *mode, str(backing))
    fio_on(f"/dev/ublkb{d.dev_id}", tmp_path, htlb, "--rw=randwrite", "--size=16M",
           "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    delete(d.dev_id)


def test_loop_file_system_verify(tmp_path: Path, htlb: Path) -> None:
    """test_shmemzc_03: ext4 on the device, fio verify on a file in it."""
    backing = make_file(tmp_path / "loop.img", 256 * MiB)
    d = add("-t", "loop", "--shmem_zc", "--htlb", str(htlb), str(backing))
    dev = f"/dev/ublkb{d.dev_id}"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
    subprocess.run(["mount", dev, str(mnt)], check=True)
    try:
        fio_on(str(mnt / "testfile"), tmp_path, htlb, "--rw=randwrite", "--size=32M",
               "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    delete(d.dev_id)


def _shared_views(target: LoopTarget) -> list[int]:
    """Count the requests the target is handed as a view of a MAP_SHARED
    mapping the size of the registered file: [reads, writes]."""
    calls = [0, 0]
    for i, name in enumerate(("read", "write")):
        fn = getattr(target, name)

        def wrapper(offset: int, buf: Buffer, *args: Any, fn: Any = fn, i: int = i) -> Any:
            if isinstance(buf, memoryview) and isinstance(buf.obj, mmap.mmap) \
                    and len(buf.obj) == BUF_SIZE:
                calls[i] += 1
            return fn(offset, buf, *args)
        setattr(target, name, wrapper)
    return calls


@pytest.mark.parametrize("read_only", [False, True], ids=["rw", "rdonly"])
def test_requests_arrive_in_the_shared_buffer(tmp_path: Path, htlb: Path,
                                              read_only: bool) -> None:
    """O_DIRECT from and into our own mapping of the file: the kernel hands
    the writes over by reference (and the reads too, unless the buffer was
    registered read-only); the data reaches the file and comes back right."""
    backing = make_file(tmp_path / "loop.img", 16 * MiB)
    target = LoopTarget(str(backing))
    shared = _shared_views(target)
    data = os.urandom(256 << 10)
    fd = os.open(htlb, os.O_RDWR)
    m = mmap.mmap(fd, BUF_SIZE, mmap.MAP_SHARED)
    os.close(fd)
    try:
        with served(target, copy=CopyMode.COPY, shmem_zc=True, htlb=str(htlb),
                    rdonly_shmem_buf=read_only) as dev:
            m[MiB:MiB + len(data)] = data
            ublk = os.open(dev.path, os.O_RDWR | os.O_DIRECT)
            try:
                assert os.pwrite(ublk, memoryview(m)[MiB:MiB + len(data)], 4 * MiB) == len(data)
                m[2 * MiB:2 * MiB + len(data)] = bytes(len(data))
                assert os.preadv(ublk, [memoryview(m)[2 * MiB:2 * MiB + len(data)]],
                                 4 * MiB) == len(data)
            finally:
                os.close(ublk)
            assert m[2 * MiB:2 * MiB + len(data)] == data
        with open(backing, "rb") as f:
            f.seek(4 * MiB)
            assert f.read(len(data)) == data
        assert shared[1] > 0, "no write arrived in the shared buffer"
        assert (shared[0] == 0) if read_only else (shared[0] > 0)
    finally:
        m.close()


@pytest.mark.parametrize("args,message", [
    (["--htlb", "{htlb}"], "--htlb needs --shmem_zc"),
    (["--shmem_zc", "--rdonly_shmem_buf"], "--rdonly_shmem_buf needs --htlb FILE"),
    (["--shmem_zc", "--htlb", "{tmp}/missing"], "--htlb {tmp}/missing: No such file"),
    (["--shmem_zc", "--htlb", "{tmp}/odd"], "registering --htlb {tmp}/odd (5000 bytes) with "
     "the kernel failed"),
])
def test_refusals_are_one_line(tmp_path: Path, htlb: Path, args: list[str],
                               message: str) -> None:
    (tmp_path / "odd").write_bytes(bytes(5000))  # not a page multiple: REG_BUF says EINVAL
    subst = {"htlb": str(htlb), "tmp": str(tmp_path)}
    p = cli("add", "-t", "null", *(a.format(**subst) for a in args), check=False)
    assert p.returncode != 0
    err = p.stderr.strip()
    assert message.format(**subst) in err and "\n" not in err, err
