"""The queue lifecycle table (aioublk/queue/lifecycle.py): every (state, event)
pair of both paths against the rules it is meant to encode, the sequences
of the last two bug fixes, and the drivers carrying the actions out on a
host ring with no device (as in test_batch.py)."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest

from aioublk.kernel import uapi
from aioublk.queue.lifecycle import BATCH, PER_IO, Action, Event, Lifecycle, State, Table
from tests.queue.test_batch import _deliver, _driver, _Path, _SlowPath

TABLES = {"per-io": PER_IO, "batch": BATCH}
PAIRS = [(name, s, e) for name in TABLES for s in State for e in Event]


def _expected_state(s: State, e: Event) -> State:
    if s is State.LIVE:
        return State.STOPPING if e in (Event.ABORT, Event.DETACH) else s
    if e in (Event.DRAIN_TIMEOUT, Event.DRAIN_END):
        return State.SEALED
    if s is State.STOPPING and e is Event.LAST_ANSWERED:
        return State.DRAINED
    return s


def _expected_actions(batch: bool, s: State, e: Event, new: State) -> set[Action]:
    live = s is State.LIVE
    out: set[Action] = set()
    if e is Event.REQUEST:
        out.add(Action.START if live else Action.LEAVE)
    if e is Event.ANSWER:
        out.add(Action.DROP if s is State.SEALED else Action.COMMIT)
    if e is Event.FETCH_ENDED and live:
        out.add(Action.REARM)
    if live and new is not State.LIVE:
        out.add(Action.SET_STOPPING)
    if e is Event.ABORT and (live or not batch):
        out.add(Action.TELL_SIBLINGS)
    if e is Event.ABORT and live and batch:
        out.add(Action.START_GRACE)
    if new is State.DRAINED and s is not State.DRAINED:
        out.add(Action.RESOLVE_DRAINED)
        if not batch:  # an aborted per-I/O worker ends once it holds nothing
            out.add(Action.FINISH)
    if new is State.SEALED and s is not State.SEALED:
        out.add(Action.SEAL)
    if e is Event.NOTHING_ARMED or (e is Event.GRACE_FIRED and not live):
        out.add(Action.FINISH)
    return out


@pytest.mark.parametrize(("name", "state", "event"), PAIRS,
                         ids=[f"{n}-{s.value}-{e.value}" for n, s, e in PAIRS])
def test_every_state_and_event(name: str, state: State, event: Event) -> None:
    table = TABLES[name]
    new, actions = table[(state, event)]
    assert new is _expected_state(state, event)
    assert len(set(actions)) == len(actions)
    assert set(actions) == _expected_actions(name == "batch", state, event, new)


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_the_table_is_complete_and_never_goes_back(table: Table) -> None:
    assert set(table) == {(s, e) for s in State for e in Event}
    order = list(State)
    for (s, _e), (new, _a) in table.items():
        assert order.index(new) >= order.index(s)


def _run(table: Table, *events: Event) -> tuple[Lifecycle, list[tuple[Action, ...]]]:
    life = Lifecycle(table)
    return life, [life.fire(e) for e in events]


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_a_request_finishing_after_the_drain_is_not_acknowledged(table: Table) -> None:
    life, acts = _run(table, Event.REQUEST, Event.DETACH, Event.DRAIN_TIMEOUT, Event.ANSWER)
    assert acts[0] == (Action.START,)
    assert Action.SEAL in acts[2] and life.state is State.SEALED
    assert acts[3] == (Action.DROP,) and not life.commits


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
@pytest.mark.parametrize("cause", [Event.DETACH, Event.ABORT])
def test_requests_fetched_after_stopping_began_are_not_started(table: Table,
                                                               cause: Event) -> None:
    life, acts = _run(table, Event.REQUEST, cause, Event.REQUEST, Event.ANSWER)
    assert acts[0] == (Action.START,) and acts[2] == (Action.LEAVE,)
    assert acts[3] == (Action.COMMIT,), "a request held before the stop is still answered"
    assert not life.starts and life.commits


def test_an_aborted_batch_worker_ends_on_its_grace_timer_not_when_idle() -> None:
    life, acts = _run(BATCH, Event.ABORT, Event.LAST_ANSWERED, Event.ABORT, Event.GRACE_FIRED)
    assert Action.START_GRACE in acts[0]
    assert Action.FINISH not in acts[1] and acts[2] == ()
    assert acts[3] == (Action.FINISH,)


def test_an_aborted_per_io_worker_ends_when_idle() -> None:
    life, acts = _run(PER_IO, Event.ABORT, Event.LAST_ANSWERED, Event.DETACH, Event.DRAIN_END)
    assert Action.FINISH in acts[1] and life.state is State.SEALED
    assert acts[3] == (Action.SEAL,)


# -- the drivers carry the actions out ---------------------------------------

class _Worker:
    """What the tests look at of the worker a driver tells things to."""

    def __init__(self, driver: Any) -> None:
        self.finished = 0
        self.told = 0
        driver.w.finished = self._finished
        driver.w.device_ending = self._told

    def _finished(self) -> None:
        self.finished += 1

    def _told(self) -> None:
        self.told += 1


@pytest.mark.asyncio
async def test_per_io_abort_of_an_idle_worker_ends_it_and_its_siblings() -> None:
    from aioublk.dataplane.plane import EV_IO
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        driver = _driver(ring, _Path(), batch=False)
        w = _Worker(driver)
        driver.event(EV_IO, 0, 3, 0, -errno.ENODEV, 0)
        assert driver.life.state is State.DRAINED and driver.stopping
        assert (w.told, w.finished) == (1, 1)
        driver.event(EV_IO, 0, 4, 0, -errno.ENODEV, 0)
        assert w.told == 2  # the worker's own guard keeps it to one telling
        driver.event(EV_IO, 0, 5, 0, uapi.IO_RES_OK, 0)
        assert driver.live == 5 and driver.inflight == 0, "a request was started at stop"
        await driver.drain()
        assert driver.life.state is State.SEALED
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_batch_abort_ends_the_worker_after_the_grace_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aioublk.dataplane.plane import EV_FETCH
    from aioublk.queue import driver as driver_mod
    from aioublk.ring import Ring

    monkeypatch.setattr(driver_mod, "GRACE_SECONDS", 0.01)
    ring = Ring(16)
    try:
        path = _SlowPath()
        driver = _driver(ring, path)
        w = _Worker(driver)
        driver.live = 2  # two fetches armed
        _deliver(driver, [1])
        await asyncio.sleep(0)
        driver.event(EV_FETCH, 0, 0, 0, -errno.ENODEV, 0)
        assert driver.stopping and (w.told, w.finished) == (1, 0)
        driver.event(EV_FETCH, 0, 0, 0, 0, 0)  # the other fetch ends: not re-armed
        assert driver.live == 0 and w.finished == 1
        await asyncio.sleep(0.05)
        assert w.finished == 2  # the grace timer (finishing twice is harmless)
        path.release.set()
        await driver.drain()
        assert driver.life.state is State.SEALED and driver.inflight == 0
    finally:
        ring.close()
