"""Fuzz target: a qcow2 image's metadata as a whole, through
``aioublk.qcow2.Qcow2Image``. The input is the image file. It is opened
read-only and read (a few ranges, the backing chain's too), then opened
read-write and written, zeroed, discarded and flushed.

Allowed: a one-line Qcow2Error from open (the image refused) and a
one-line OSError with errno EIO from a request or the close (a malformed
table found at I/O time), as tests/qcow2/test_qcow2_malformed.py expects. Every
request has a deadline; the runner bounds memory and time per input.

The image's directory holds base.raw and base.qcow2, the backing files
the seeds name (and a mutation may name), so backing chains open too.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from aioublk.qcow2 import Qcow2Error, Qcow2Image
from tests.fuzz.common import check_error, is_eio

IO_DEADLINE = 5.0
SPAN = 4096  # bytes each request covers

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-image-"))
atexit.register(shutil.rmtree, _DIR, True)
(_DIR / "base.raw").write_bytes(bytes(range(256)) * 256)
shutil.copy(Path(__file__).parent / "data" / "base.qcow2", _DIR / "base.qcow2")
_PATH = str(_DIR / "img.qcow2")


async def _request(aw: Awaitable[Any]) -> None:
    try:
        await asyncio.wait_for(aw, IO_DEADLINE)
    except OSError as e:
        if not is_eio(e):
            raise


def _offsets(size: int) -> list[int]:
    """Where the requests go: the start, the middle, the end."""
    if size < SPAN:
        return []
    return sorted({0, min((size // 2) & ~511, size - SPAN), size - SPAN})


async def _exercise(read_only: bool) -> None:
    try:
        img = Qcow2Image.open(_PATH, read_only=read_only, direct=False)
    except Qcow2Error as e:
        check_error(e)
        return
    try:
        async with img:
            buf = bytearray(SPAN)
            for off in _offsets(img.size):
                await _request(img.read(off, buf))
            if read_only:
                return
            for off in _offsets(img.size):
                await _request(img.write(off, b"\xee" * SPAN))
            for off in _offsets(img.size):
                await _request(img.read(off, buf))
            if img.size >= 2 * SPAN:
                await _request(img.write_zeroes(SPAN, SPAN))
                await _request(img.discard(0, SPAN))
            await _request(img.flush())
    except OSError as e:  # from the close's write-back
        if not is_eio(e):
            raise


def one_input(data: bytes) -> None:
    with open(_PATH, "wb") as f:
        f.write(data)
    asyncio.run(_exercise(True))
    asyncio.run(_exercise(False))
