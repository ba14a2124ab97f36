"""The device control plane's promises, checked on the real driver."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
from pathlib import Path

import pytest

from aioublk.targets.null import NullTarget
from tests.support.kernel import cli, delete, make_file, parse_list, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", [
    ["-t", "null", "-s", "64M"],
    ["-t", "fault_inject", "-s", "64M"],
    ["-t", "stripe", "{a}", "{b}"],
    ["-t", "zoned", "-s", "256M"],
    ["-t", "examples.ramdisk:RamDisk", "--opt", f"size={64 * MiB}"],
    ["-t", "loop", "{a}"],
], ids=["null", "fault_inject", "stripe", "zoned", "custom", "loop"])
def test_add_read_only_gives_a_read_only_disk(tmp_path: Path, target: list[str]) -> None:
    """``add --read-only`` means what serve's ``read_only`` does, whatever the
    target: the kernel is told (/sys/block/ublkbN/ro is 1) and a write to
    the disk fails with EPERM."""
    files = {k: str(make_file(tmp_path / k, 64 * MiB)) for k in ("a", "b")}
    p = cli("add", *[a.format(**files) for a in target], "--read-only", "-q", "1",
            timeout=180, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    (dev,) = parse_list(p.stdout)
    try:
        name = f"ublkb{dev.dev_id}"
        assert Path(f"/sys/block/{name}/ro").read_text().strip() == "1"
        with pytest.raises(OSError) as e:
            fd = os.open(f"/dev/{name}", os.O_WRONLY)
            try:
                os.pwrite(fd, b"x" * 4096, 0)
            finally:
                os.close(fd)
        assert e.value.errno == errno.EPERM
    finally:
        delete(dev.dev_id)


def test_update_size_stays_within_the_backing_file(tmp_path: Path) -> None:
    """A loop device over a 64 MiB file is not grown to 1 GiB (past the
    file a write would grow it); shrinking within it is done."""
    # (a loaded machine under emulation can take over a minute to add it)
    (dev,) = parse_list(cli("add", "-t", "loop", "-q", "1",
                            str(make_file(tmp_path / "disk", 64 * MiB)), timeout=180).stdout)
    try:
        sectors = Path(f"/sys/block/ublkb{dev.dev_id}/size")
        p = cli("update_size", "-n", str(dev.dev_id), "-s", "1G", check=False, timeout=180)
        assert p.returncode == 1 and p.stderr == (
            f"aioublk: size {1 << 30} is more than device {dev.dev_id}'s loop target can "
            f"serve: its backing files hold {64 * MiB} bytes (grow them first)\n"), p.stderr
        assert int(sectors.read_text()) == 64 * MiB >> 9
        cli("update_size", "-n", str(dev.dev_id), "-s", "32M", timeout=180)
        assert int(sectors.read_text()) == 32 * MiB >> 9
    finally:
        delete(dev.dev_id)


def test_serving_threads_are_io_flushers() -> None:
    """Every queue thread has PR_SET_IO_FLUSHER (the guest runs as root,
    with CAP_SYS_RESOURCE): a server whose disk backs a file system under
    memory pressure must not recurse into reclaim writing to its own
    disk. PR_GET_IO_FLUSHER (58) asks each thread, on its own loop."""
    libc = ctypes.CDLL(None, use_errno=True)

    async def io_flusher() -> int:
        return int(libc.prctl(58, 0, 0, 0, 0))
    with served(NullTarget(64 * MiB), queues=2, nthreads=2) as dev:
        assert len(dev.workers) == 2
        got = [asyncio.run_coroutine_threadsafe(io_flusher(), w.loop).result(30)
               for w in dev.workers if w.loop is not None]
    assert got == [1, 1]
