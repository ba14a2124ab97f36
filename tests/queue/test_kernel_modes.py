"""Both queue paths (batch and per-I/O), the data-copy modes and the thread
layouts, against the real driver."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from aioublk import Device
from aioublk.errors import UblkError
from aioublk.queue.options import CopyMode, DeviceConfig
from aioublk.target import Target
from aioublk.targets import LoopTarget, NullTarget, StripeTarget
from tests.support import kernel
from tests.support.kernel import cli, fio, make_file, run, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
BATCH_FLAG = 1 << 15


def make_target(kind: str, tmp_path: Path, size: int = 256 * MiB) -> Target:
    if kind == "null":
        return NullTarget()
    if kind == "loop":
        return LoopTarget(str(make_file(tmp_path / "loop.img", size)))
    return StripeTarget([str(make_file(tmp_path / f"s{i}.img", size // 2)) for i in range(2)])


def verify(dev: Device, cwd: Path, size: str = "48M") -> None:
    job = fio(dev.path, cwd, "--rw=randwrite", "--bsrange=4k-64k", "--iodepth=32",
              f"--size={size}", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")
    assert job["write"]["io_bytes"] > 0  # type: ignore[index]


def ext4_roundtrip(dev: Device, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mkfs.ext4", "-q", "-F", "-E", "nodiscard", dev.path)
    run("mount", dev.path, str(mnt))
    files = {f"f{i}": os.urandom(100 * 1024 + i) for i in range(8)}
    for name, body in files.items():
        (mnt / name).write_bytes(body)
    run("umount", str(mnt))
    run("mount", dev.path, str(mnt))
    try:
        assert {n: (mnt / n).read_bytes() for n in files} == files
    finally:
        run("umount", str(mnt))


@pytest.mark.parametrize("target", ["null", "loop", "stripe"])
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_path_serves_fio_and_ext4(batch: bool, target: str, tmp_path: Path) -> None:
    with served(make_target(target, tmp_path), queues=2, batch=batch) as dev:
        assert dev.batch is batch
        assert dev.info is not None and bool(dev.info.flags & BATCH_FLAG) is batch
        if target == "null":  # keeps nothing: fio without verify
            job = fio(dev.path, tmp_path, "--rw=randrw", "--bs=4k", "--iodepth=64",
                      "--size=64M")
            assert job["read"]["io_bytes"] > 0  # type: ignore[index]
            return
        verify(dev, tmp_path)
        ext4_roundtrip(dev, tmp_path)


@pytest.mark.parametrize("queues,nthreads,batch,per_io_tasks", [
    (4, 1, True, False),   # 1 loop serving 4 queues
    (1, 4, True, False),   # 4 loops serving 1 queue
    (1, 4, False, True),   # per-I/O path, the tags of 1 queue over 4 loops
], ids=["1loop-4queues", "4loops-1queue", "per_io_tasks"])
def test_thread_layouts(queues: int, nthreads: int, batch: bool, per_io_tasks: bool,
                        tmp_path: Path) -> None:
    with served(make_target("loop", tmp_path), queues=queues, nthreads=nthreads, batch=batch,
                per_io_tasks=per_io_tasks) as dev:
        assert len(dev.workers) == nthreads
        assert dev.info is not None and dev.info.nr_hw_queues == queues
        verify(dev, tmp_path)


MODES = {"z": (CopyMode.ZERO_COPY, False), "auto_zc": (CopyMode.AUTO_ZC, False),
         "u": (CopyMode.USER_COPY, False), "auto_zc_fallback": (CopyMode.AUTO_ZC, True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_copy_modes_verify_on_loop(batch: bool, mode: str, tmp_path: Path) -> None:
    copy, fallback = MODES[mode]
    with served(make_target("loop", tmp_path), queues=2, batch=batch, copy=copy,
                auto_zc_fallback=fallback) as dev:
        assert dev.info is not None and dev.info.flags & copy.flags
        verify(dev, tmp_path)


@pytest.mark.parametrize("mode", ["z", "auto_zc", "u"])
def test_copy_modes_on_stripe_and_null(mode: str, tmp_path: Path) -> None:
    copy, _ = MODES[mode]
    with served(make_target("stripe", tmp_path), copy=copy) as dev:
        verify(dev, tmp_path, size="32M")
    with served(NullTarget(), copy=copy) as dev:
        fio(dev.path, tmp_path, "--rw=randrw", "--bs=64k", "--size=32M")


@pytest.mark.parametrize("args,message", [
    (["-b", "--auto_zc", "-q", "1", "--nthreads", "2"], "--auto_zc with batch"),
    (["--no-batch", "-q", "1", "--nthreads", "2"], "--nthreads 2 differs from -q 1"),
    (["-g", "-b"], "-g/--get_data needs the per-I/O path"),
    (["-g", "-u"], "-g/--get_data and copy mode user_copy conflict"),
])
def test_cli_refuses_combinations(args: list[str], message: str) -> None:
    p = cli("add", "-t", "null", *args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert kernel.listing() == []


def _fio_verify(path: str, cwd: Path) -> None:
    import subprocess

    p = subprocess.run(
        ["fio", "--name=v", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
         "--rw=randwrite", "--bsrange=4k-128k", "--iodepth=128", "--size=48M",
         "--verify=crc32c", "--verify_fatal=1", "--do_verify=1"],
        cwd=cwd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.asyncio
async def test_tiny_fetch_buffers_lose_no_request(tmp_path: Path) -> None:
    """One provided buffer of two tags per queue, depth 128: the kernel keeps
    running out of fetch buffers (-ENOBUFS ends the multishot fetch) and every
    request must still be served exactly once."""
    img = make_file(tmp_path / "tiny.img", 128 * MiB)
    cfg = DeviceConfig(queues=1, depth=128, batch=True, fetch_buf_bytes=4,
                       fetch_buf_entries=1)
    async with Device(LoopTarget(str(img)), cfg) as dev:
        await asyncio.get_running_loop().run_in_executor(None, _fio_verify, dev.path, tmp_path)


@pytest.mark.asyncio
async def test_zero_copy_needs_a_fixed_buffer_target() -> None:
    from aioublk.queue.options import CopyMode
    from tests.examples.test_kernel_embed import RamDisk

    with pytest.raises(UblkError, match="cannot serve zero-copy"):
        Device(RamDisk(MiB), DeviceConfig(copy=CopyMode.ZERO_COPY))
