"""Run by tests/qcow2/test_qcow2_crash.py as a child process: write a known pattern,
flush, say so, then keep writing, zeroing and discarding at random (with the
odd flush) until killed.

``--write-through PATH SEED``: open the image with metadata write-through,
run a fixed mix of allocating writes (whole and partial clusters),
write_zeroes and discards, never flush, say DONE once all completed and
wait to be killed."""

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


def write_through_ops(size: int, seed: int) -> list[tuple[str, int, bytes]]:
    """(kind, offset, data or zeros) in 512-byte units, disjoint: what the
    killed child completed and the reopened image must hold."""
    rnd = random.Random(seed)
    ops: list[tuple[str, int, bytes]] = []
    slots = rnd.sample(range(size // (256 * KiB)), 24)
    for k, s in enumerate(slots):
        n = rnd.randrange(1, 257) * 512
        off = s * 256 * KiB + rnd.randrange(0, (256 * KiB - n) // 512 + 1) * 512
        kind = "write" if k % 4 else ("zero" if k % 8 else "discard")
        ops.append((kind, off, pattern(n, seed * 1000 + k) if kind == "write" else bytes(n)))
    return ops


async def write_through(path: str, seed: int) -> None:
    ring = Ring(128, bind_thread=True)
    img = Qcow2Image.open(path)
    img.metadata_write_through = True
    ops = write_through_ops(img.size, seed)

    async def one(kind: str, off: int, data: bytes) -> None:
        if kind == "write":
            await img.write(off, data)
        elif kind == "zero":
            await img.write_zeroes(off, len(data), unmap=False)
        else:
            await img.discard(off, len(data))

    # the first half one at a time, the rest all at once (sharing write-backs)
    for op in ops[:len(ops) // 2]:
        await one(*op)
    await asyncio.gather(*(one(*op) for op in ops[len(ops) // 2:]))
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    await asyncio.sleep(3600)
    del ring


if __name__ == "__main__":
    logs.configure()
    if sys.argv[1] == "--write-through":
        asyncio.run(write_through(sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
