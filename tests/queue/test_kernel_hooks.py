"""Target.queue_setup / queue_teardown against the real driver: every
request runs on a loop whose setup finished, one setup per worker."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from aioublk import Geometry, QueueContext, Target, current_queue
from tests.support.kernel import fio, served

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("no_devices_left")]

MiB = 1 << 20


class PerLoopRam(Target):
    """A RAM disk whose requests insist on their loop's setup having run."""

    name = "per-loop-ram"

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.geometry = Geometry(size=size)
        self.lock = threading.Lock()
        self.setups: dict[int, asyncio.AbstractEventLoop] = {}  # thread -> its loop
        self.teardowns: list[int] = []
        self.served: set[int] = set()  # threads that served a request

    async def queue_setup(self, q: QueueContext) -> None:
        await asyncio.sleep(0.05)  # a slow connect: no request may overtake it
        with self.lock:
            self.setups[threading.get_ident()] = q.loop
        q.state["ready"] = True

    def _check(self) -> None:
        q = current_queue()
        assert q.state.get("ready"), "a request ran before its loop's setup finished"
        assert q.loop is asyncio.get_running_loop()
        assert self.setups[threading.get_ident()] is q.loop
        self.served.add(threading.get_ident())

    async def read(self, offset: int, buf: memoryview) -> None:
        self._check()
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        self._check()
        self.data[offset:offset + len(buf)] = buf

    async def queue_teardown(self, q: QueueContext) -> None:
        assert q.state.pop("ready")
        with self.lock:
            self.teardowns.append(threading.get_ident())


def test_requests_run_on_set_up_loops_one_per_worker(tmp_path: Path) -> None:
    target = PerLoopRam(64 * MiB)
    with served(target, queues=2, depth=32) as dev:
        # two jobs on disjoint halves, so each verifies its own writes
        job = fio(dev.path, tmp_path, "--rw=randwrite", "--bs=4k", "--iodepth=16",
                  "--numjobs=2", "--size=16M", "--offset_increment=16M", "--verify=crc32c",
                  "--verify_fatal=1", "--do_verify=1", "--group_reporting")
        assert job["write"]["io_bytes"] == 32 * MiB  # type: ignore[index]
    assert len(target.setups) == 2, "one setup per worker (one worker per queue)"
    assert len(set(target.setups.values())) == 2  # each on its own loop
    assert target.served <= set(target.setups)
    assert sorted(target.teardowns) == sorted(target.setups)
