"""The task-free request path (``Target.start_read``/``start_write``) on the
host: the completion rules, and the loop and qcow2 targets against real
files through a real ring."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import subprocess
from pathlib import Path

import pytest

from aioublk.qcow2 import Qcow2Image
from aioublk.ring import Ring
from aioublk.target import rw_handler
from aioublk.targets.loop import LoopTarget

pytestmark = pytest.mark.asyncio


def waiter() -> tuple[asyncio.Future[int], object]:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    return fut, fut.set_result


async def test_full_and_failed_results_answer_at_once() -> None:
    calls: list[int] = []

    async def never() -> None:
        raise AssertionError("no retry for a full or failed result")

    rw_handler(4096, calls.append, never)(4096, 0)
    rw_handler(4096, calls.append, never)(-errno.EIO, 0)
    assert calls == [4096, -errno.EIO]


@pytest.mark.parametrize("res", [100, -errno.EINVAL, -errno.EAGAIN])
async def test_short_or_refused_results_retry_on_the_coroutine_path(res: int) -> None:
    retried: list[bool] = []

    async def retry() -> None:
        retried.append(True)

    fut, done = waiter()
    rw_handler(4096, done, retry)(res, 0)  # type: ignore[arg-type]
    assert await asyncio.wait_for(fut, 5) == 4096 and retried == [True]

    async def fails() -> None:
        raise OSError(errno.ENOSPC, "full")

    fut, done = waiter()
    rw_handler(4096, done, fails)(res, 0)  # type: ignore[arg-type]
    assert await asyncio.wait_for(fut, 5) == -errno.ENOSPC


async def test_loop_target_fast_read_and_write(ring: Ring, tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.write_bytes(os.urandom(1 << 20))
    t = LoopTarget(str(path))
    try:
        buf = memoryview(mmap.mmap(-1, 8192))
        buf[:] = os.urandom(8192)
        fut, done = waiter()
        assert t.start_write(65536, buf, done)  # type: ignore[arg-type]
        assert await fut == 8192
        back = memoryview(mmap.mmap(-1, 8192))
        fut, done = waiter()
        assert t.start_read(65536, back, done)  # type: ignore[arg-type]
        assert await fut == 8192 and back == buf
    finally:
        t.close()


async def test_qcow2_fast_path_only_where_the_cluster_is_mapped(ring: Ring,
                                                                 tmp_path: Path) -> None:
    img_path = tmp_path / "img.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img_path), "4M"],
                   check=True)
    subprocess.run(["qemu-io", "-c", "write -P 0x5a 0 64k", str(img_path)], check=True,
                   capture_output=True)
    img = Qcow2Image.open(str(img_path))
    try:
        buf = memoryview(mmap.mmap(-1, 4096))
        await img.read(0, buf)  # brings the L2 table into the cache
        fut, done = waiter()
        assert img.start_read(4096, buf, done)  # type: ignore[arg-type]
        assert await fut == 4096 and bytes(buf) == b"\x5a" * 4096
        buf[:] = b"\xa5" * 4096
        fut, done = waiter()
        assert img.start_write(8192, buf, done)  # type: ignore[arg-type]
        assert await fut == 4096
        # unallocated, or across clusters: the coroutine path's job
        assert not img.start_write(1 << 20, buf, print)
        assert not img.start_read(65536 - 2048, buf, print)
    finally:
        await img.close()
    out = subprocess.run(["qemu-io", "-c", "read -P 0xa5 8k 4k", "-c", "read -P 0x5a 12k 52k",
                          str(img_path)], capture_output=True, text=True, check=True)
    assert "Pattern verification failed" not in out.stdout
    assert subprocess.run(["qemu-img", "check", str(img_path)]).returncode == 0


async def test_fast_path_unless_per_request_logging_was_asked_for(ring: Ring) -> None:
    """An application that embeds devices without configuring aioublk's logs
    (structlog's defaults let debug through) keeps the task-free path and a
    quiet stdout; ``-v`` (debug) turns on a log line per request instead."""
    import structlog

    from aioublk import logs
    from aioublk.queue.driver import IoPath
    from aioublk.queue.options import CopyMode
    from aioublk.targets.null import NullTarget

    structlog.reset_defaults()
    try:
        assert not logs.per_request()
        assert IoPath(NullTarget(), ring, -1, CopyMode.COPY).fast
        logs.configure(verbose=True)
        path = IoPath(NullTarget(), ring, -1, CopyMode.COPY)
        assert path.debug and not path.fast
    finally:
        logs.configure()
    assert not logs.per_request()


async def test_logs_follow_sys_stderr_as_it_is_when_a_line_is_written() -> None:
    """configure() must not keep the sys.stderr of its moment: an application
    (or pytest's capture) may replace and close it, and a later warning then
    raised ValueError (I/O operation on closed file) inside a request."""
    import io
    import sys

    import structlog

    from aioublk import logs

    old, first = sys.stderr, io.StringIO()
    try:
        sys.stderr = first
        logs.configure()
        first.close()
        sys.stderr = second = io.StringIO()
        structlog.get_logger("t").warning("after the swap")
        assert "after the swap" in second.getvalue()
    finally:
        sys.stderr = old
        structlog.reset_defaults()
