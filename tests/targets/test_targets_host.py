"""Target logic and the CLI's input checks, on the host (no kernel needed)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aioublk.io.hostfile import HostFile
from aioublk.ring import Ring
from aioublk.target import FixedBuf
from aioublk.targets import BackingError, LoopTarget, StripeTarget
from aioublk.targets.stripe import split

K = 1024


def aligned(data: bytes | int) -> memoryview:
    """A page-aligned buffer, as queues hand to targets (O_DIRECT needs it)."""
    size = data if isinstance(data, int) else len(data)
    m = memoryview(mmap.mmap(-1, size))
    if not isinstance(data, int):
        m[:] = data
    return m


def test_split_single_chunk() -> None:
    assert split(0, 4096, 64 * K, 2) == {0: (0, [(0, 4096)])}
    assert split(64 * K, 4096, 64 * K, 2) == {1: (0, [(0, 4096)])}
    assert split(128 * K + 512, 512, 64 * K, 2) == {0: (64 * K + 512, [(0, 512)])}


def test_split_across_chunks_is_contiguous_per_file() -> None:
    parts = split(60 * K, 200 * K, 64 * K, 2)
    # device [60K, 260K) = chunk0 tail, chunk1, chunk2, chunk3, chunk4 head (4K)
    assert parts[0] == (60 * K, [(0, 4 * K), (68 * K, 64 * K), (196 * K, 4 * K)])
    assert parts[1] == (0, [(4 * K, 64 * K), (132 * K, 64 * K)])
    covered = sorted(p for _f, (_o, ps) in parts.items() for p in ps)
    assert sum(n for _s, n in covered) == 200 * K


def _mirror(offset: int, length: int, chunk: int, n: int) -> list[tuple[int, int, int]]:
    out = []
    for pos in range(offset, offset + length, 512):
        c = pos // chunk
        out.append((pos - offset, c % n, (c // n) * chunk + pos % chunk))
    return out


@pytest.mark.parametrize("files", [2, 3, 4])
@pytest.mark.parametrize("offset,length", [(0, 512), (4096, 1 << 20), (65024, 131584)])
def test_split_matches_sector_by_sector_mapping(files: int, offset: int, length: int) -> None:
    chunk = 64 * K
    parts = split(offset, length, chunk, files)
    got = {}
    for f, (file_off, pieces) in parts.items():
        pos = file_off
        for start, n in pieces:
            for s in range(0, n, 512):
                got[start + s] = (f, pos + s)
            pos += n
    assert got == {b: (f, o) for b, f, o in _mirror(offset, length, chunk, files)}


@pytest.mark.asyncio
async def test_loop_target_round_trip(ring: Ring, tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.write_bytes(bytes(1 << 20))
    t = LoopTarget(str(path))
    try:
        data = aligned(os.urandom(8192))
        await t.write(4096, data)
        await t.flush()
        back = aligned(8192)
        await t.read(4096, back)
        assert back == data
        await t.discard(4096, 4096)
        await t.read(4096, back)
        assert back[:4096] == bytes(4096) and back[4096:] == data[4096:]
        await t.write_zeroes(8192, 4096)
        await t.read(4096, back)
        assert back == bytes(8192)
    finally:
        t.close()
    assert t.geometry.size == 1 << 20


@pytest.mark.asyncio
async def test_stripe_target_layout_on_disk(ring: Ring, tmp_path: Path) -> None:
    paths = [tmp_path / f"s{i}" for i in range(3)]
    for p in paths:
        p.write_bytes(bytes(256 * K))
    t = StripeTarget([str(p) for p in paths], chunk_size=4096)
    try:
        data = b"".join(bytes([i]) * 4096 for i in range(12))
        await t.write(0, aligned(data))
        back = aligned(len(data))
        await t.read(0, back)
        assert back == data
    finally:
        t.close()
    # chunk i lives in file i % 3 at chunk i // 3
    for i in range(12):
        raw = paths[i % 3].read_bytes()
        assert raw[(i // 3) * 4096:(i // 3 + 1) * 4096] == bytes([i]) * 4096


def test_stripe_refuses_bad_layouts(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(128 * K))
    b.write_bytes(bytes(256 * K))
    with pytest.raises(BackingError, match="same size"):
        StripeTarget([str(a), str(b)])
    with pytest.raises(BackingError, match="2 to 4"):
        StripeTarget([str(a)])
    with pytest.raises(BackingError, match="chunk size"):
        StripeTarget([str(a), str(a)], chunk_size=3000)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioublk", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args,message", [
    (["add", "-t", "loop", "/nonexistent.img"], "does not exist"),
    (["add", "-t", "bogus"], "unknown target type 'bogus'"),
    (["add", "-t", "null", "-d", "0"], "queue depth 0 out of range"),
    (["add", "-t", "null", "-d", "5000"], "queue depth 5000 out of range"),
    (["add", "-t", "null", "-q", "64"], "64 queues out of range"),
    (["add", "-t", "null", "-q", "x"], "invalid int value"),
    (["add"], "required"),
    (["frobnicate"], "invalid choice"),
    (["add", "-t", "null", "-z", "-u"], "-z and -u are different data-copy modes"),
    (["add", "-t", "null", "--auto_zc", "-u"], "--auto_zc and -u"),
    (["add", "-t", "null", "-b", "--per_io_tasks"], "--per_io_tasks and -b/--batch conflict"),
    (["add", "-t", "null", "-b", "--no-batch"], "not allowed with argument"),
    (["add", "-t", "null", "--nthreads", "100"], "--nthreads 100 out of range"),
])
def test_cli_bad_input_is_one_line(args: list[str], message: str) -> None:
    p = _cli(*args)
    assert p.returncode != 0
    assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


_FAILING_LOCK = """
import errno, os, sys
from aioublk.frontend import cli
from aioublk.io import locking
def conflict(*args):
    raise OSError(errno.EIO, os.strerror(errno.EIO))
locking.conflict = conflict
sys.exit(cli.main(sys.argv[1:]))
"""


def test_cli_os_error_is_one_line(tmp_path: Path) -> None:
    """An OSError that reaches the command line (here a qcow2 image whose
    lock fails with EIO) is one line and exit 1, not a traceback."""
    img = tmp_path / "a.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), "1M"], check=True)
    p = subprocess.run([sys.executable, "-c", _FAILING_LOCK, "add", "-t", "qcow2", str(img)],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, p.stderr
    assert p.stderr == f"aioublk: cannot lock {img}: Input/output error\n"


def test_cli_without_driver_says_what_to_do() -> None:
    if Path("/dev/ublk-control").exists():
        pytest.skip("this host has ublk_drv loaded")  # the guest tests cover it there
    p = _cli("list")
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "aioublk: /dev/ublk-control not found: the ublk_drv kernel module is not loaded "
        "(run 'modprobe ublk_drv' as root; kernel 6.4 or later)")


def test_device_refuses_flags_it_cannot_serve() -> None:
    from aioublk.errors import UblkError
    from aioublk.kernel import uapi
    from aioublk.queue.options import DeviceConfig

    DeviceConfig(flags=uapi.Feature.NO_AUTO_PART_SCAN).validate()
    with pytest.raises(UblkError, match="UBLK_F_USER_COPY"):
        DeviceConfig(flags=uapi.Feature.USER_COPY).validate()


class _LegRing:
    """A ring whose reads on one fd fail at once and on the others finish
    later: what a dying disk next to a slow one looks like to a stripe."""

    def __init__(self, bad_fd: int) -> None:
        self.bad_fd = bad_fd
        self.slow_done = False

    async def _leg(self, fd: int, n: int) -> int:
        if fd == self.bad_fd:
            raise OSError(5, "leg failed")
        await asyncio.sleep(0.2)
        self.slow_done = True  # the kernel's buffer is written until here
        return n

    async def readv(self, fd: int, bufs: list[memoryview], off: int) -> int:
        return await self._leg(fd, sum(len(b) for b in bufs))

    async def read_fixed(self, fd: int, addr: int, n: int, off: int, index: int) -> int:
        return await self._leg(fd, n)


@pytest.mark.asyncio
@pytest.mark.parametrize("fixed", [False, True], ids=["copy", "fixed"])
async def test_stripe_failing_leg_waits_for_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed: bool) -> None:
    """A request whose first leg fails is answered only after every other leg
    has stopped writing into the request's buffer (the kernel reuses it)."""
    paths = [tmp_path / f"s{i}" for i in range(2)]
    for p in paths:
        p.write_bytes(bytes(256 * K))
    t = StripeTarget([str(p) for p in paths], chunk_size=4096)
    try:
        fake = _LegRing(t.files[0].fd)
        monkeypatch.setattr("aioublk.targets.stripe.current_ring", lambda: fake)
        buf = FixedBuf(0, 0, 16 * K) if fixed else aligned(16 * K)
        with pytest.raises(OSError, match="leg failed"):
            await t.read(0, buf)
        assert fake.slow_done, "answered while a leg was still reading into the buffer"
    finally:
        t.close()


def _direct_refuses_unaligned(path: Path) -> None:
    """The file system under ``path`` must enforce O_DIRECT alignment (a real
    refusal, no stub): a 512-byte read at offset 100 fails with EINVAL."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [aligned(512)], 100)
    except OSError as e:
        assert e.errno == errno.EINVAL, e
    else:
        pytest.fail(f"the file system of {path} takes unaligned O_DIRECT I/O: these tests "
                    "need one that refuses it (ext4, xfs)")
    finally:
        os.close(fd)


@pytest.mark.asyncio
async def test_loop_falls_back_to_buffered_when_direct_io_is_refused(
        ring: Ring, tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.write_bytes(bytes(1 << 20))
    _direct_refuses_unaligned(path)
    t = LoopTarget(str(path))
    try:
        assert t.backing.direct
        data = aligned(os.urandom(512))
        await t.write(100, data)  # refused by O_DIRECT: retried buffered, once
        assert not t.backing.direct
        assert t.geometry.logical_block_size == t.backing.align.offset  # what statx said
        back = aligned(512)
        await t.read(100, back)
        assert back == data
    finally:
        t.close()
    assert path.read_bytes()[100:612] == data


@pytest.mark.asyncio
async def test_stripe_falls_back_to_buffered_when_direct_io_is_refused(
        ring: Ring, tmp_path: Path) -> None:
    paths = [tmp_path / f"s{i}" for i in range(2)]
    for p in paths:
        p.write_bytes(bytes(256 * K))
    _direct_refuses_unaligned(paths[0])
    t = StripeTarget([str(p) for p in paths], chunk_size=4096)
    try:
        data = aligned(os.urandom(8192))
        await t.write(100, data)
        assert not any(b.direct for b in t.files)
        back = aligned(8192)
        await t.read(100, back)
        assert back == data
    finally:
        t.close()


@pytest.mark.asyncio
async def test_qcow2_host_file_falls_back_to_buffered(ring: Ring, tmp_path: Path) -> None:
    """HostFile: a misaligned buffer is bounced; a request O_DIRECT refuses
    for its offset makes the file buffered; neither is retried the same way."""
    path = tmp_path / "f"
    path.write_bytes(bytes(64 * K))
    _direct_refuses_unaligned(path)
    f = HostFile(str(path), read_only=False, direct=True)
    try:
        assert f.direct
        odd = memoryview(bytearray(513))[1:]  # misaligned memory, aligned offset
        odd[:] = b"\x11" * 512
        await asyncio.wait_for(f.write(odd, 4096), 5)
        assert f.direct, "a bounce is enough here"
        await asyncio.wait_for(f.write(aligned(b"\x22" * 512), 100), 5)
        assert not f.direct
        back = aligned(1024)
        await f.read_into(back, 4096 - 512)
        assert back == bytes(512) + b"\x11" * 512
        assert f.pread(100, 512) == b"\x22" * 512
    finally:
        f.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["loop", "stripe"])
async def test_fast_path_refused_by_direct_io_is_retried_buffered_once(
        ring: Ring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A fast-path request O_DIRECT refuses is submitted once more, buffered:
    not again direct (the same way) before that."""
    paths = [tmp_path / f"f{i}" for i in range(2)]
    for p in paths:
        p.write_bytes(bytes(256 * K))
    _direct_refuses_unaligned(paths[0])
    t = LoopTarget(str(paths[0])) if kind == "loop" else StripeTarget([str(p) for p in paths],
                                                                       chunk_size=4096)
    submitted: list[bool] = []  # O_DIRECT on the fd at each submission
    real_rw, real_writev = ring.submit_rw, ring.writev

    def direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def rw(op: int, fd: int, *args: Any) -> None:
        submitted.append(direct(fd))
        real_rw(op, fd, *args)

    async def writev(fd: int, bufs: list[memoryview], off: int) -> int:
        submitted.append(direct(fd))
        return await real_writev(fd, bufs, off)

    monkeypatch.setattr(ring, "submit_rw", rw)
    monkeypatch.setattr(ring, "writev", writev)
    try:
        result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        data = aligned(os.urandom(512))
        assert t.start_write(100, data, result.set_result)
        assert await asyncio.wait_for(result, 5) == 512
        assert submitted == [True, False]
    finally:
        t.close()
    assert paths[0].read_bytes()[100:612] == data
