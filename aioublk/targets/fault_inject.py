"""The fault_inject target (kublk's): a null device whose server is slow or
dies, for testing how clients, the kernel and recovery behave.

``delay_us`` holds every request that long before completing it (a timer on
the queue's loop, so requests overlap). ``die_during_fetch`` kills the
server with SIGKILL while it arms its tags, after tag 0 of a queue is
armed and before tag 1: a queue left with some but not all tags fetched.
"""

from __future__ import annotations

import asyncio
import os
import signal

from aioublk.ring import current_ring
from aioublk.target import Buffer, Geometry, Target
from aioublk.targets.spec import BOOL, DEVICE_SIZE, INT, Option, TargetSpec


class FaultInjectTarget(Target):
    name = "fault_inject"
    fixed_buffers = True

    def __init__(self, size: int = 250 << 30, *, delay_us: int = 0,
                 die_during_fetch: bool = False) -> None:
        if delay_us < 0:
            raise ValueError(f"delay_us {delay_us} is negative")
        self.delay = delay_us / 1e6
        self.die_during_fetch = die_during_fetch
        self.geometry = Geometry(size=size)

    def arming(self, q_id: int, tag: int) -> None:
        if self.die_during_fetch and tag == 1:
            current_ring().submit_now()  # tag 0's command reaches the kernel first
            os.kill(os.getpid(), signal.SIGKILL)

    async def _wait(self) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)

    async def read(self, offset: int, buf: Buffer) -> None:
        await self._wait()

    async def write(self, offset: int, buf: Buffer, fua: bool = False) -> None:
        await self._wait()

    async def flush(self) -> None:
        await self._wait()

    async def discard(self, offset: int, length: int) -> None:
        await self._wait()

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self._wait()

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "delay_us": int(self.delay * 1e6),
                "die_during_fetch": self.die_during_fetch}


#: ``-t fault_inject``: its options, as the command line and config files take them
SPEC = TargetSpec("fault_inject", FaultInjectTarget, (
    DEVICE_SIZE,
    Option("delay_us", INT, "hold each request this many microseconds", default=0,
           flags=("--delay_us",), lo=0),
    Option("die_during_fetch", BOOL, "1 = SIGKILL the server while it arms its tags",
           default=False, flags=("--die_during_fetch",), zero_one=True),
), rank=9)
