"""The qcow2 target on several workers (host only: threads stand in for the
queue workers, each with its own uvloop loop, ring and ``LoopHandle``).

Worker 0 owns the engine; another worker's requests are handed to it
whole (``crossloop.call_on``) and run there. Here:

- writes, reads, flushes, discards and zeroes from two workers at once end
  in an image QEMU agrees with, byte for byte against a mirror;
- a request handed over runs on the owner's thread, never on the caller's;
- the owner's final write-back waits for the other workers' drain;
- ``unmap`` on the owner waits for an extent a data plane on another thread
  holds (the rule "a mapping C started on stays valid until that request
  completes", across threads).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from aioublk.dataplane import crossloop
from aioublk.dataplane.maps import Extents
from aioublk.ring import Ring
from aioublk.target import QueueContext, setup_queue, teardown_queue
from aioublk.targets.qcow2 import Qcow2Target
from tests.support.qcow2_util import K, M, check_clean, compare_identical, create

CS = 64 * K
SIZE = 16 * M

Work = Callable[[Qcow2Target, int], Awaitable[None]]


class Workers:
    """N threads, each a worker as ``aioublk.queue.worker`` makes it: a loop,
    a ring bound to the thread, a handle whose kicks arrive on the ring.
    ``run`` sets every worker up (worker 0 first), runs ``work`` on each at
    once, then drains them all as a stopping device does."""

    def __init__(self, target: Qcow2Target, n: int) -> None:
        self.target = target
        self.n = n
        self.errors: list[BaseException] = []
        self.threads: dict[int, int] = {}  # worker -> thread id
        self.maps: dict[int, Any] = {}  # worker -> its data plane's map
        self._set_up = [threading.Event() for _ in range(n)]
        self._go = threading.Event()

    def run(self, work: Work, timeout: float = 120) -> None:
        threads = [threading.Thread(target=self._thread, args=(i, work), daemon=True)
                   for i in range(self.n)]
        for t in threads:
            t.start()
        for e in self._set_up:
            assert e.wait(timeout), "a worker did not set up"
        self._go.set()
        for t in threads:
            t.join(timeout)
            assert not t.is_alive(), "a worker did not finish"
        if self.errors:
            raise self.errors[0]

    def _thread(self, index: int, work: Work) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        handle = crossloop.LoopHandle.new(loop)
        handle.bind()
        try:
            loop.run_until_complete(self._main(index, handle, work))
        except BaseException as e:  # noqa: BLE001 - the test's to see
            self.errors.append(e)
            self._set_up[index].set()
        finally:
            loop.close()
            handle.close()

    async def _main(self, index: int, handle: crossloop.LoopHandle, work: Work) -> None:
        self.threads[index] = threading.get_ident()
        ring = Ring(256, bind_thread=True)
        handle.watch(ring)
        q = QueueContext(index, (index,), asyncio.get_running_loop())
        try:
            if index:  # the owner is set up first, as its queue_setup names it
                await asyncio.to_thread(self._set_up[0].wait)
            await setup_queue(self.target, q)
            self._set_up[index].set()
            await asyncio.to_thread(self._go.wait)
            # every worker's data plane takes the map at once, attaching a pool
            m = self.target.map()
            self.maps[index] = m.served() if isinstance(m, Extents) else m
            try:
                await work(self.target, index)
            finally:
                await self.target.drain()
                await teardown_queue(self.target, q)
        finally:
            ring.close()


def image(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "a.qcow2"
    create(path, SIZE, cluster_size=CS)
    mirror = tmp_path / "mirror.raw"
    with open(mirror, "wb") as f:
        f.truncate(SIZE)
    return path, mirror


def test_two_workers_random_io_match_a_mirror(tmp_path: Path) -> None:
    """Each worker writes, zeroes, discards and reads its own half (sizes
    across cluster boundaries), flushing now and then; at the end the image
    reads back as the mirror and `qemu-img check` finds nothing."""
    path, mirror = image(tmp_path)
    target = Qcow2Target(str(path))
    mfd = os.open(mirror, os.O_RDWR)
    lock = threading.Lock()

    async def work(t: Qcow2Target, index: int) -> None:
        rng = random.Random(index)
        half = SIZE // 2
        base = index * half

        async def op() -> None:
            off = base + rng.randrange(0, half - 3 * CS, 512)
            n = rng.choice((512, 4 * K, CS, CS + 4 * K, 2 * CS))
            kind = rng.choices(("write", "read", "zero", "discard", "flush"),
                               (6, 3, 1, 1, 1))[0]
            if kind == "write":
                data = rng.randbytes(n)
                with lock:
                    os.pwrite(mfd, data, off)
                await t.write(off, memoryview(bytearray(data)))
            elif kind == "read":
                buf = bytearray(n)
                with lock:
                    want = os.pread(mfd, n, off)
                await t.read(off, memoryview(buf))
                assert buf == want, f"worker {index}: read at {off}+{n} differs"
            elif kind in ("zero", "discard"):
                off, n = off & ~(CS - 1), CS * rng.randint(1, 2)
                with lock:
                    os.pwrite(mfd, bytes(n), off)
                if kind == "zero":
                    await t.write_zeroes(off, n)
                else:
                    await t.discard(off, n)
            else:
                await t.flush()

        # a worker's ops run one after another (a guest's overlapping writes
        # have no defined order), the two workers' at once
        for _ in range(300):
            await op()

    workers = Workers(target, 2)
    try:
        workers.run(work)
    finally:
        os.close(mfd)
        target.close()
    slots = {m.slot for m in workers.maps.values()}
    assert len(slots) == 2 and None not in slots, f"each worker attaches a pool: {slots}"
    check_clean(path)
    compare_identical(path, mirror)


def test_a_handed_over_request_runs_on_the_owner(tmp_path: Path) -> None:
    path, _mirror = image(tmp_path)
    target = Qcow2Target(str(path))
    ran_on: dict[int, int] = {}
    read = target.image.read

    async def spy(offset: int, buf: memoryview) -> None:
        ran_on[offset] = threading.get_ident()
        await read(offset, buf)

    target.image.read = spy  # type: ignore[method-assign]

    async def work(t: Qcow2Target, index: int) -> None:
        await t.read(index * CS, memoryview(bytearray(CS)))
        # the owner's fast path is the owner's alone
        started = t.start_read(0, memoryview(bytearray(4 * K)), lambda res: None)
        assert started is False or index == 0

    workers = Workers(target, 2)
    try:
        workers.run(work)
    finally:
        target.close()
    assert ran_on == {0: workers.threads[0], CS: workers.threads[0]}


def test_owner_closes_the_image_after_the_others_drain(tmp_path: Path) -> None:
    """Worker 1 is still writing when worker 0 has nothing left to do: the
    owner's drain waits, serving worker 1's hand-offs meanwhile, and its
    final write-back includes them."""
    path, _mirror = image(tmp_path)
    target = Qcow2Target(str(path))
    data = bytes(range(256)) * (CS // 256)
    owner_draining = threading.Event()
    drain = target.drain

    async def watched_drain() -> None:
        if threading.get_ident() == workers.threads[0]:
            owner_draining.set()
        await drain()

    target.drain = watched_drain  # type: ignore[method-assign]

    async def work(t: Qcow2Target, index: int) -> None:
        if index == 1:
            await asyncio.to_thread(owner_draining.wait)
            for i in range(8):
                await t.write(i * CS, memoryview(bytearray(data)))

    workers = Workers(target, 2)
    try:
        workers.run(work)
    finally:
        target.close()
    check_clean(path)
    raw = tmp_path / "want.raw"
    with open(raw, "wb") as f:
        f.truncate(SIZE)
        for i in range(8):
            f.seek(i * CS)
            f.write(data)
    compare_identical(path, raw)


@pytest.mark.asyncio
@pytest.mark.parametrize("notified", [False, True])
async def test_unmap_waits_for_a_holder_on_another_thread(notified: bool, tmp_path: Path,
                                                          ring: Ring) -> None:
    """Polling, or woken by the release's notification (what lets the
    engine's loop idle in C while it waits)."""
    heard: list[int] = []
    path, _mirror = image(tmp_path)
    target = Qcow2Target(str(path))
    try:
        img = target.image
        await img.write(0, memoryview(bytearray(b"x" * CS)))
        table = img.extent_table()
        assert table is not None
        held = threading.Event()
        let_go = threading.Event()

        def plane() -> None:  # a data plane on its own thread, as C holds an extent
            got = table.acquire(0, 4 * K, write=False)
            assert got is not None, "cluster 0 is not published"
            held.set()
            let_go.wait(60)
            table.release(got[1])

        t = threading.Thread(target=plane)
        t.start()
        assert await asyncio.to_thread(held.wait, 60)
        if notified:  # the target's way: C's release notifies, the loop hears it
            efd = os.eventfd(0, os.EFD_NONBLOCK)
            table.set_notify(efd)
            asyncio.get_running_loop().add_reader(
                efd, lambda: (os.eventfd_read(efd), table.notified(), heard.append(1)))
        unmap = asyncio.ensure_future(table.unmap(0, CS))
        for _ in range(20):  # it keeps waiting while the holder holds
            await asyncio.sleep(0)
        assert not unmap.done()
        let_go.set()
        await asyncio.wait_for(unmap, 60)
        t.join()
        assert table.lookup(0, CS, write=False) is None
        assert heard or not notified, "the release did not notify"
    finally:
        if notified:
            asyncio.get_running_loop().remove_reader(efd)
            table.set_notify(-1)
            os.close(efd)
        await target.drain()
