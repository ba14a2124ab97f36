"""--shmem_zc on the host: the options and their refusals, and how a request
the kernel hands over by reference (IO_F_SHMEM_ZC) is served in our mapping
of the shared buffer, whatever the copy mode. The device itself is tested in
the guest (tests/queue/test_kernel_shmem.py)."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aioublk.errors import UblkError
from aioublk.frontend import addargs, verb
from aioublk.frontend.config import load
from aioublk.kernel import uapi
from aioublk.queue.driver import IoPath
from aioublk.queue.options import CopyMode, DeviceConfig
from aioublk.ring import Ring
from aioublk.targets import LoopTarget, NullTarget

SHMEM = uapi.IO_F_SHMEM_ZC


def _config(*args: str) -> DeviceConfig:
    return addargs.config_from_flags(verb.parser().parse_args(["add", "-t", "null", *args]))


def test_options_ask_the_kernel_for_shmem_zc(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _config("--shmem_zc", "--htlb", "buf", "--rdonly_shmem_buf")
    assert cfg.htlb == str(tmp_path / "buf")  # absolute: a daemon runs in /
    assert cfg.rdonly_shmem_buf
    _batch, flags = cfg.resolve(uapi.Feature.SHMEM_ZC)
    assert flags == uapi.Feature.SHMEM_ZC
    # alone, --shmem_zc only asks for the feature (no buffer to match yet)
    assert _config("--shmem_zc", "-u").resolve(~0 & ((1 << 64) - 1))[1] & uapi.Feature.SHMEM_ZC


@pytest.mark.parametrize("args,message", [
    (["--htlb", "/dev/hugepages/buf"], "--htlb needs --shmem_zc"),
    (["--shmem_zc", "--rdonly_shmem_buf"], "--rdonly_shmem_buf needs --htlb FILE"),
    (["--shmem_zc", "--htlb", "/dev/hugepages/buf", "-r", "1"],
     "user recovery (-r/-i/-e) and --htlb conflict"),
])
def test_refusals_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        _config(*args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_kernel_without_shmem_zc_is_one_line() -> None:
    with pytest.raises(UblkError, match="does not support UBLK_F_SHMEM_ZC: drop the option"):
        _config("--shmem_zc").resolve(uapi.Feature.CMD_IOCTL_ENCODE)


def test_zoned_and_shmem_zc_conflict() -> None:
    with pytest.raises(UblkError, match="a zoned device and --shmem_zc conflict"):
        DeviceConfig(zoned=True, copy=CopyMode.USER_COPY, shmem_zc=True).validate()


def test_config_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "buf").write_bytes(bytes(4096))
    (tmp_path / "config.toml").write_text(
        '[[devices]]\ntarget = "null"\nshmem_zc = true\nhtlb = "buf"\n'
        "rdonly_shmem_buf = true\n")
    (dev,) = load("config.toml").devices
    assert dev.config.shmem_zc and dev.config.rdonly_shmem_buf
    assert dev.config.htlb == str(tmp_path / "buf")


def _request(op: int, sectors: int, index: int, offset: int) -> Any:
    """A queue whose tag 0 holds one SHMEM_ZC request, as the kernel writes it."""
    desc = (op | SHMEM, sectors, 0, index << 32 | offset)
    return SimpleNamespace(q_id=0, unpack=lambda _off: desc, shared={}, views=[])


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", list(CopyMode))
async def test_requests_are_served_in_the_shared_buffer(ring: Ring, tmp_path: Path,
                                                        mode: CopyMode) -> None:
    backing = tmp_path / "disk"
    backing.write_bytes(bytes(1 << 20))
    target = LoopTarget(str(backing))
    shared = memoryview(mmap.mmap(-1, 64 << 10))
    data = os.urandom(8192)
    try:
        path = IoPath(target, ring, -1, mode)
        shared[16384:16384 + 8192] = data
        qm = _request(uapi.Op.WRITE, 16, 3, 16384)
        qm.shared[3] = shared
        assert await path.serve(qm, 0, 0) == 8192
        assert backing.read_bytes()[:8192] == data
        shared[:] = bytes(len(shared))
        qm = _request(uapi.Op.READ, 16, 3, 4096)
        qm.shared[3] = shared
        assert await path.serve(qm, 0, 0) == 8192
        assert shared[4096:4096 + 8192] == data
    finally:
        target.close()


@pytest.mark.asyncio
async def test_a_request_outside_the_buffers_fails(ring: Ring) -> None:
    path = IoPath(NullTarget(), ring, -1, CopyMode.COPY)
    shared = memoryview(mmap.mmap(-1, 8192))
    qm = _request(uapi.Op.WRITE, 8, 1, 0)  # index 1: never registered
    qm.shared[0] = shared
    assert await path.serve(qm, 0, 0) == -errno.EFAULT
    qm = _request(uapi.Op.WRITE, 16, 0, 4096)  # past the buffer's end
    qm.shared[0] = shared
    assert await path.serve(qm, 0, 0) == -errno.EFAULT
    qm = _request(uapi.Op.READ, 8, 0, 0)  # a read into a read-only buffer
    qm.shared[0] = shared.toreadonly()
    assert await path.serve(qm, 0, 0) == -errno.EFAULT


@pytest.mark.asyncio
async def test_the_fast_path_leaves_shared_requests_to_serve(ring: Ring) -> None:
    """The target's task-free path works on the tag's buffer: not where a
    SHMEM_ZC request's data is."""
    path = IoPath(NullTarget(), ring, -1, CopyMode.COPY)
    if not path.fast:
        pytest.skip("-v: no fast path")
    qm = _request(uapi.Op.READ, 8, 0, 0)
    assert path.start(qm, 0, lambda res: None) is False
