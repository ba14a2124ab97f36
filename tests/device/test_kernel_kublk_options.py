"""kublk's add options that aioublk took over for parity (issue #15), against
the real driver: -g (NEED_GET_DATA) on both the data plane and the coroutine
path, -s on null, --no_ublk_fixed_fd (-g's refusals: test_kernel_modes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioublk.target import Target
from aioublk.targets import LoopTarget, NullTarget
from tests.support import kernel
from tests.support.kernel import fio, make_file, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20
NEED_GET_DATA = 1 << 2
VERIFY = ("--rw=randwrite", "--bsrange=4k-64k", "--iodepth=32", "--size=48M",
          "--verify=crc32c", "--verify_fatal=1", "--do_verify=1")


class _CoroutineLoop(LoopTarget):
    """loop without its map: every request reaches the coroutines."""

    def map(self) -> None:
        return None


def _target(kind: str, tmp_path: Path) -> Target:
    if kind == "null":
        return NullTarget()
    cls = _CoroutineLoop if kind == "loop-coroutines" else LoopTarget
    return cls(str(make_file(tmp_path / "loop.img", 256 * MiB)))


@pytest.mark.parametrize("kind", ["null", "loop", "loop-coroutines"])
def test_get_data_serves_writes_on_the_per_io_path(kind: str, tmp_path: Path) -> None:
    """With UBLK_F_NEED_GET_DATA a write's fetch completes asking for its
    data; the data plane fetches it into the tag's buffer before C or the
    target serves the write, so what fio wrote reads back."""
    with served(_target(kind, tmp_path), queues=2, batch=False, get_data=True) as dev:
        assert not dev.batch
        assert dev.info is not None and dev.info.flags & NEED_GET_DATA
        if kind == "null":  # keeps nothing: writes only
            job = fio(dev.path, tmp_path, "--rw=randwrite", "--bs=4k", "--iodepth=64",
                      "--size=64M")
        else:
            job = fio(dev.path, tmp_path, *VERIFY)
        assert job["write"]["io_bytes"] > 0  # type: ignore[index]


def test_get_data_from_the_command_line(tmp_path: Path) -> None:
    """``add -g`` settles on the per-I/O path by itself and serves fio verify."""
    image = make_file(tmp_path / "disk.img", 256 * MiB)
    dev = kernel.add("-t", "loop", "-q", "2", "-g", str(image))
    try:
        assert dev.flags & NEED_GET_DATA
        fio(f"/dev/ublkb{dev.dev_id}", tmp_path, *VERIFY)
    finally:
        kernel.delete(dev.dev_id)


def test_size_of_a_null_device_shows_in_list() -> None:
    dev = kernel.add("-t", "null", "-q", "1", "-s", "64M")
    try:
        assert dev.sectors == 64 * MiB >> 9
        (listed,) = [d for d in kernel.listing() if d.dev_id == dev.dev_id]
        assert listed.sectors == 64 * MiB >> 9
    finally:
        kernel.delete(dev.dev_id)


def test_no_ublk_fixed_fd_serves_fio_verify(tmp_path: Path) -> None:
    image = make_file(tmp_path / "disk.img", 256 * MiB)
    dev = kernel.add("-t", "loop", "-q", "1", "--no_ublk_fixed_fd", str(image))
    try:
        fio(f"/dev/ublkb{dev.dev_id}", tmp_path, *VERIFY)
    finally:
        kernel.delete(dev.dev_id)

