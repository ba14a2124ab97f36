"""The C data plane's -z chains against the real driver: a request is
served as one linked chain (register its pages, the pieces, unregister),
which io_uring runs in order only when it reaches the kernel in one
submission. These loads queue more SQEs than the SQ holds in one reap, so
a chain cut at the SQ's end would let an unregister run before its
register: the request then failed, Python's retry could not register the
slot, and fio never finished. A hang fails the test (fio's timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioublk.queue.options import CopyMode
from aioublk.targets import LoopTarget, StripeTarget
from tests.support.kernel import fio, make_file, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20


def verify(path: str, cwd: Path, *extra: str) -> None:
    job = fio(path, cwd, "--rw=randwrite", "--size=16M", "--verify=crc32c",
              "--verify_fatal=1", "--do_verify=1", *extra, timeout=300)
    assert job["write"]["io_bytes"] == 16 * MiB


def test_batch_zero_copy_at_depth_128(tmp_path: Path) -> None:
    """One fetch completion carries up to 128 tags, 3 SQEs each: more than
    the SQ holds (256 at depth 128)."""
    target = LoopTarget(str(make_file(tmp_path / "loop.img", 32 * MiB)))
    with served(target, batch=True, copy=CopyMode.ZERO_COPY, depth=128) as dev:
        verify(dev.path, tmp_path, "--bs=4k", "--iodepth=128", "--iodepth_batch_submit=128")


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
def test_stripe_4k_chunks_zero_copy_256k_requests(batch: bool, tmp_path: Path) -> None:
    """A 256 KiB request over 4 KiB chunks is a chain of 66 SQEs."""
    files = [str(make_file(tmp_path / f"f{i}.img", 32 * MiB)) for i in range(2)]
    target = StripeTarget(files, chunk_size=4096)
    with served(target, batch=batch, copy=CopyMode.ZERO_COPY) as dev:
        verify(dev.path, tmp_path, "--bs=256k", "--iodepth=32")
