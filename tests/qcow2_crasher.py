"""Run by tests/test_qcow2_crash.py as a child process: write a known pattern,
flush, say so, then keep writing, zeroing and discarding at random (with the
odd flush) until killed."""

from __future__ import annotations

import asyncio
import os
import random
import sys

from aioublk import logs
from aioublk.qcow2 import Qcow2Image
from aioublk.ring import Ring

KiB = 1024


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def main(path: str, seed: int, flushed_bytes: int) -> None:
    ring = Ring(128, bind_thread=True)
    img = Qcow2Image.open(path)
    await img.write(0, pattern(flushed_bytes, seed))
    await img.flush()
    sys.stdout.write("FLUSHED\n")
    sys.stdout.flush()
    rnd = random.Random(seed + 1)
    area = img.size - flushed_bytes

    async def one() -> None:
        off = flushed_bytes + rnd.randrange(area // 512 - 256) * 512
        n = rnd.randrange(1, 256) * 512
        k = rnd.random()
        if k < 0.7:
            await img.write(off, os.urandom(n))
        elif k < 0.85:
            await img.write_zeroes(off, n, unmap=rnd.random() < 0.5)
        elif k < 0.97:
            await img.discard(off, n)
        else:
            await img.flush()

    while True:
        await asyncio.gather(*(one() for _ in range(32)))
    del ring


if __name__ == "__main__":
    logs.configure()
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
