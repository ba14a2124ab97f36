"""Target.queue_setup / queue_teardown without a kernel: the helpers that run
them, and a real Worker (its thread, loop and ring) serving through a fake
driver, which shows where the hooks fall among arming and draining."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from aioublk.queue import worker as worker_mod
from aioublk.queue.driver import WorkerSpec
from aioublk.queue.options import DeviceConfig
from aioublk.ring import current_ring
from aioublk.target import (
    Geometry,
    QueueContext,
    QueueSetupError,
    Target,
    current_queue,
    setup_queue,
    teardown_queue,
)


class Hooked(Target):
    """Records each step with the thread it ran on; setup can be made to fail."""

    name = "hooked"

    def __init__(self, events: list[tuple[str, int]], setup_error: Exception | None = None,
                 teardown_error: Exception | None = None) -> None:
        self.geometry = Geometry(size=1 << 20)
        self.events = events
        self.setup_error = setup_error
        self.teardown_error = teardown_error

    def _note(self, what: str) -> None:
        self.events.append((what, threading.get_ident()))

    async def queue_setup(self, q: QueueContext) -> None:
        assert current_queue() is q and q.loop is asyncio.get_running_loop()
        current_ring()  # the worker's ring exists: setup may do I/O on it
        await asyncio.sleep(0)  # a real await: nothing may start meanwhile
        if self.setup_error is not None:
            raise self.setup_error
        q.state["conn"] = "open"
        self._note("setup")

    async def drain(self) -> None:
        assert current_queue().state == {"conn": "open"}
        self._note("drain")

    async def queue_teardown(self, q: QueueContext) -> None:
        current_ring()  # not closed yet: teardown's I/O still works
        q.state["conn"] = "closed"
        self._note("teardown")
        if self.teardown_error is not None:
            raise self.teardown_error


def _queue() -> QueueContext:
    return QueueContext(0, (0, 1), asyncio.get_running_loop())


@pytest.mark.asyncio
async def test_setup_binds_the_context_and_teardown_unbinds_it(ring: Any) -> None:
    events: list[tuple[str, int]] = []
    t, q = Hooked(events), _queue()
    await setup_queue(t, q)
    assert current_queue() is q and q.state == {"conn": "open"}
    await teardown_queue(t, q)
    assert q.state == {"conn": "closed"} and [e for e, _ in events] == ["setup", "teardown"]
    with pytest.raises(RuntimeError, match="no aioublk queue worker"):
        current_queue()


@pytest.mark.asyncio
async def test_a_failed_setup_is_one_line_naming_the_target_and_the_cause(ring: Any) -> None:
    t = Hooked([], setup_error=ConnectionRefusedError(111, "Connection refused"))
    with pytest.raises(QueueSetupError) as e:
        await setup_queue(t, _queue())
    assert str(e.value) == ("target 'hooked': queue_setup failed on worker 0 (queues 0, 1): "
                            "ConnectionRefusedError: [Errno 111] Connection refused")
    with pytest.raises(RuntimeError):
        current_queue()  # not left bound


@pytest.mark.asyncio
async def test_a_failed_teardown_is_logged_not_raised(ring: Any) -> None:
    t, q = Hooked([], teardown_error=OSError(5, "gone")), _queue()
    await setup_queue(t, q)
    with capture_logs() as logs:
        await teardown_queue(t, q)
    assert [(x["event"], x["error"]) for x in logs] == [
        ("the target's queue_teardown failed", "OSError: [Errno 5] gone")]
    with pytest.raises(RuntimeError):
        current_queue()


class FakeDriver:
    """What Worker needs of a driver, recording when it is armed and drained."""

    batch = False

    def __init__(self, w: Any, ring: Any, path: Any) -> None:
        self.events: list[tuple[str, int]] = w.target.events
        self.failed = 0
        self.stopping = False

    def arm(self) -> None:
        assert current_queue().state == {"conn": "open"}, "armed before setup finished"
        self.events.append(("arm", threading.get_ident()))

    async def drain(self) -> None:
        self.events.append(("driver drain", threading.get_ident()))

    def close(self) -> None:
        self.events.append(("driver close", threading.get_ident()))


def _worker(target: Target) -> worker_mod.Worker:
    qm: Any = SimpleNamespace(q_id=3)
    return worker_mod.Worker(DeviceConfig(), WorkerSpec(0, [(qm, [0, 1])], set()), -1,
                             target, cast(Any, FakeDriver))


def test_a_worker_sets_up_before_arming_and_tears_down_after_draining() -> None:
    events: list[tuple[str, int]] = []
    w = _worker(Hooked(events))
    w.start()
    assert w.ready.wait(10) and w.error is None
    w.request_finish()
    w.join(10)
    assert not w.thread.is_alive() and w.error is None
    assert [e for e, _ in events] == ["setup", "arm", "driver drain", "drain", "teardown",
                                      "driver close"]
    assert {tid for _, tid in events} == {w.thread.ident}  # all on the worker's own thread


def test_a_worker_whose_setup_fails_never_arms() -> None:
    events: list[tuple[str, int]] = []
    w = _worker(Hooked(events, setup_error=ValueError("no server")))
    w.start()
    assert w.ready.wait(10)
    w.join(10)
    assert isinstance(w.error, QueueSetupError)
    assert str(w.error) == ("target 'hooked': queue_setup failed on worker 0 (queues 3): "
                            "ValueError: no server")
    assert events == []  # no arm, no drain, no teardown of what was never set up
