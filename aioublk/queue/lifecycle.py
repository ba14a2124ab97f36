"""A queue driver's lifecycle as one table: what each event does in each
state. Pure: no I/O, no loop; the drivers (``driver.py``, ``perio.py``,
``batch.py``) turn what they see into events and carry out the actions.

States:

- ``LIVE``: serving; requests are started and answered.
- ``STOPPING``: the worker is ending (the kernel aborted a command: stop or
  quiesce; or a detach began: SIGTERM hand-over, a batch quiesce, a failed
  QUIESCE_DEV). It serves what it holds and starts nothing new: a request
  it is handed now is left to the kernel, which reissues (``-i 1``) or fails
  it when /dev/ublkcN closes. A fetch that ends is not re-armed.
- ``DRAINED``: stopping, and nothing is in flight any more (in Python or
  in C).
- ``SEALED``: the drain has returned, so the target's final write-back
  (``Target.drain``: qcow2 metadata) may run. A request still finishing now
  (one the drain gave up on) is not acknowledged: its data may not be in
  that write-back, so it too is left to the kernel.

Events:

- ``REQUEST``: a fetched request C did not serve. ``ANSWER``: a request
  Python served is done. Neither changes the state, so the drivers read
  ``Lifecycle.starts`` / ``Lifecycle.commits`` on their hot path instead of
  looking the table up per request.
- ``FETCH_ENDED``: a batch multishot fetch ended without an abort (-ENOBUFS,
  or the kernel put its tags back): re-armed while live.
- ``ABORT``: the kernel aborted a command (-ENODEV: STOP_DEV or QUIESCE_DEV;
  -ECANCELED: our ring is closing). Every worker of the device ends: a
  quiesce aborts only idle tags, and a worker whose tags are all busy would
  see none.
- ``DETACH``: the worker was told to finish (its drain begins).
- ``LAST_ANSWERED``: while stopping, nothing is in flight any more.
- ``DRAIN_TIMEOUT``: the drain gave up waiting for what is in flight.
- ``DRAIN_END``: the drain has returned.
- ``GRACE_FIRED``: the grace period after a batch abort is over. The kernel
  may leave the fetch it is dispatching on armed for a moment
  (ublk_batch_cancel_queue): it ends once that dispatch is done, and if it
  does not, the worker ends when the grace timer fires.
- ``NOTHING_ARMED``: no command of the worker is armed any more (every tag
  or fetch ended, aborted or failed): nothing more can arrive.

The per-I/O and batch paths differ in two places, both in ``PER_IO`` and
``BATCH`` below: a per-I/O worker aborted ends as soon as it holds nothing,
and every aborted tag tells the device's other workers (a detach may have
come first); a batch worker ends when its fetches have ended or its grace
timer fires, and only its first abort matters.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class State(enum.Enum):
    LIVE = "live"
    STOPPING = "stopping"
    DRAINED = "drained"
    SEALED = "sealed"


class Event(enum.Enum):
    REQUEST = "request"
    ANSWER = "answer"
    FETCH_ENDED = "fetch ended"
    ABORT = "abort"
    DETACH = "detach"
    LAST_ANSWERED = "last answered"
    DRAIN_TIMEOUT = "drain timeout"
    DRAIN_END = "drain end"
    GRACE_FIRED = "grace fired"
    NOTHING_ARMED = "nothing armed"


class Action(enum.Enum):
    START = "start the request"
    LEAVE = "leave the request to the kernel"
    COMMIT = "send the answer"
    DROP = "do not send the answer"
    REARM = "re-arm the fetch"
    SET_STOPPING = "tell C to start nothing new"
    TELL_SIBLINGS = "end every worker of the device"
    START_GRACE = "start the grace timer"
    RESOLVE_DRAINED = "wake the drain"
    FINISH = "end the worker"
    SEAL = "tell C to acknowledge nothing more"


Transition = tuple[State, tuple[Action, ...]]
Table = Mapping[tuple[State, Event], Transition]

L, S, D, X = State.LIVE, State.STOPPING, State.DRAINED, State.SEALED
E = Event
A = Action

#: what both paths do
_COMMON: dict[tuple[State, Event], Transition] = {
    # state, event                 new state, actions
    (L, E.REQUEST):                (L, (A.START,)),
    (L, E.ANSWER):                 (L, (A.COMMIT,)),
    (L, E.FETCH_ENDED):            (L, (A.REARM,)),
    (L, E.ABORT):                  (S, (A.SET_STOPPING, A.TELL_SIBLINGS)),
    (L, E.DETACH):                 (S, (A.SET_STOPPING,)),
    (L, E.LAST_ANSWERED):          (L, ()),  # idle, and serving on
    (L, E.DRAIN_TIMEOUT):          (L, ()),  # (no drain runs while live)
    (L, E.DRAIN_END):              (L, ()),  # (idem)
    (L, E.GRACE_FIRED):            (L, ()),  # (no timer runs while live)
    (L, E.NOTHING_ARMED):          (L, (A.FINISH,)),  # every command failed

    (S, E.REQUEST):                (S, (A.LEAVE,)),
    (S, E.ANSWER):                 (S, (A.COMMIT,)),
    (S, E.FETCH_ENDED):            (S, ()),
    (S, E.ABORT):                  (S, ()),
    (S, E.DETACH):                 (S, ()),
    (S, E.LAST_ANSWERED):          (D, (A.RESOLVE_DRAINED,)),
    (S, E.DRAIN_TIMEOUT):          (X, (A.SEAL,)),
    (S, E.DRAIN_END):              (X, (A.SEAL,)),  # (a drain ends drained or timed out)
    (S, E.GRACE_FIRED):            (S, (A.FINISH,)),
    (S, E.NOTHING_ARMED):          (S, (A.FINISH,)),

    (D, E.REQUEST):                (D, (A.LEAVE,)),
    (D, E.ANSWER):                 (D, (A.COMMIT,)),  # (nothing is in flight)
    (D, E.FETCH_ENDED):            (D, ()),
    (D, E.ABORT):                  (D, ()),
    (D, E.DETACH):                 (D, ()),
    (D, E.LAST_ANSWERED):          (D, ()),
    (D, E.DRAIN_TIMEOUT):          (X, (A.SEAL,)),  # (a drained drain does not wait)
    (D, E.DRAIN_END):              (X, (A.SEAL,)),
    (D, E.GRACE_FIRED):            (D, (A.FINISH,)),
    (D, E.NOTHING_ARMED):          (D, (A.FINISH,)),

    (X, E.REQUEST):                (X, (A.LEAVE,)),
    (X, E.ANSWER):                 (X, (A.DROP,)),
    (X, E.FETCH_ENDED):            (X, ()),
    (X, E.ABORT):                  (X, ()),
    (X, E.DETACH):                 (X, ()),
    (X, E.LAST_ANSWERED):          (X, ()),
    (X, E.DRAIN_TIMEOUT):          (X, ()),
    (X, E.DRAIN_END):              (X, ()),
    (X, E.GRACE_FIRED):            (X, (A.FINISH,)),
    (X, E.NOTHING_ARMED):          (X, (A.FINISH,)),
}

#: the per-I/O path: an aborted worker ends once it holds nothing, and each
#: aborted tag tells the other workers (a detach may have come first)
PER_IO: Table = _COMMON | {
    (S, E.LAST_ANSWERED):          (D, (A.RESOLVE_DRAINED, A.FINISH)),
    (S, E.ABORT):                  (S, (A.TELL_SIBLINGS,)),
    (D, E.ABORT):                  (D, (A.TELL_SIBLINGS,)),
    (X, E.ABORT):                  (X, (A.TELL_SIBLINGS,)),
}

#: the batch path: the first abort starts the grace timer
BATCH: Table = _COMMON | {
    (L, E.ABORT):                  (S, (A.SET_STOPPING, A.TELL_SIBLINGS, A.START_GRACE)),
}

del L, S, D, X, E, A


class Lifecycle:
    """One driver's place in its table."""

    __slots__ = ("commits", "starts", "state", "table")

    def __init__(self, table: Table) -> None:
        self.table = table
        self.state = State.LIVE
        self.starts = True
        self.commits = True

    @property
    def stopping(self) -> bool:
        return self.state is not State.LIVE

    def fire(self, event: Event) -> tuple[Action, ...]:
        """Take ``event``: move to the next state, and return what to do."""
        self.state, actions = self.table[(self.state, event)]
        self.starts = Action.START in self.table[(self.state, Event.REQUEST)][1]
        self.commits = Action.COMMIT in self.table[(self.state, Event.ANSWER)][1]
        return actions
