"""The nbd target's C transmission against a server that misbehaves on
purpose (tests/support/hostile_nbd.py): replies before the request left,
to requests long finished, with overlapping chunks, split at every byte,
or a server that stops reading. Dropping the connection is a fine answer
(the requests go back to Python, which reconnects); taking wrong bytes for
a read's answer, answering a request before its bytes left, or a crash
are not. The test plays the kernel as test_nbd_dataplane's rig does."""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioublk._uring import lib as ulib
from aioublk.dataplane.plane import EV_IO, EV_RETRY
from aioublk.kernel import uapi
from tests.nbd.test_nbd_dataplane import DEPTH, MAX_IO, NbdPlane, Rig, _io_done, rig_of
from tests.nbd.test_nbd_host import SIZE, pytestmark  # noqa: F401 - its skips
from tests.support.hostile_nbd import HostileServer, simple

PY_COOKIE = 1 << 63


@pytest.fixture
def hostile(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    kw = getattr(request, "param", {})
    server = HostileServer(tmp_path / "hostile.sock", SIZE, **kw)
    try:
        yield server
    finally:
        server.close()


def _retried(p: NbdPlane) -> set[int]:
    return {e[1] for e in p.events if e[0] == EV_RETRY}


def _committed(p: NbdPlane) -> set[int]:
    return {e[1] for e in p.events if _io_done(e)}


async def _writes_in_flight(rig: Rig, server: HostileServer) -> list[bytes]:
    """DEPTH 128k writes fetched while the server reads nothing: more than
    the socket takes, so C's send of them stays in flight. What each holds."""
    p, lib, ext = rig.plane, rig.t.lib, rig.link.ext
    server.hold()
    datas = [os.urandom(MAX_IO) for _ in range(DEPTH)]
    sends = lib.anbd_ext_sends(ext)
    p.events.clear()
    for tag, data in enumerate(datas):
        p.buf(tag)[:MAX_IO] = data
        p.fetch(tag, uapi.Op.WRITE, MAX_IO >> 9, tag * (MAX_IO >> 9))
    await p.wait_for(lambda: ulib.aur_dp_inflight(p.dp.c) == DEPTH
                     and lib.anbd_ext_sends(ext) > sends)
    return datas


@pytest.mark.asyncio
async def test_an_early_reply_to_pythons_command_drops_the_connection(
        hostile: HostileServer, caplog: pytest.LogCaptureFixture) -> None:
    """Python's flush queued behind writes the server does not read yet: a
    reply to its (guessable) cookie before a byte of it left is the
    server's error. The connection is dropped; the flush is not answered
    by it, and is sent again, and answered, on the next connection."""
    async with rig_of(hostile.uri(), reconnect_timeout=20) as rig:
        p, link = rig.plane, rig.link
        assert rig.t.lib.anbd_ext_own(link.ext) == 1
        await _writes_in_flight(rig, hostile)
        rid = next(copy.copy(link.ids))
        flush = asyncio.ensure_future(rig.t.flush())
        await p.wait_for(lambda: rid in link.pending)
        hostile.inject(simple(PY_COOKIE | rid))
        await p.wait_for(lambda: flush.done() or len(_retried(p)) == DEPTH, timeout=10)
        answered_early = flush.done()
        hostile.release()  # (the send goes on: it must not build on a command answered)
        await p.wait_for(lambda: len(_retried(p)) + len(_committed(p)) == DEPTH, timeout=20)
        await p.wait_for(flush.done, timeout=20)
        assert not answered_early, "the flush was answered by a reply sent before it"
        assert not _committed(p)
        await flush
        assert hostile.connections >= 2
    assert 'error="a reply to a request not sent yet"' in caplog.text


@pytest.mark.asyncio
async def test_replies_to_requests_still_being_sent_commit_nothing(
        hostile: HostileServer) -> None:
    """Replies, with a careless client's cookies, to writes whose bytes the
    server has not read (nor could have): not one write is committed by
    them; the connection is dropped and each goes back to Python."""
    async with rig_of(hostile.uri(), reconnect_timeout=20) as rig:
        p = rig.plane
        await _writes_in_flight(rig, hostile)
        hostile.inject(b"".join(simple(tag) for tag in range(DEPTH)))
        await p.wait_for(lambda: len(_retried(p)) + len(_committed(p)) == DEPTH, timeout=10)
        assert not _committed(p), "writes committed on replies sent before their data"
        hostile.release()


@pytest.mark.parametrize("hostile", [{"mode": "overlap", "every": 1}], indirect=True)
@pytest.mark.asyncio
async def test_overlapping_chunks_never_complete_a_read(hostile: HostileServer) -> None:
    """A read answered with its first half twice and its second half never:
    the halves add up to its length, yet the read is not complete. It is
    never committed with the bytes an earlier request left in the buffer."""
    hostile.data[:8192] = os.urandom(8192)
    async with rig_of(hostile.uri(), reconnect_timeout=20) as rig:
        p = rig.plane
        p.buf(0)[:8192] = b"\xa5" * 8192
        ev = await rig.rw(0, uapi.Op.READ, 0, 8192)
        assert ev[0] == EV_RETRY, f"committed {bytes(p.buf(0)[4096:4104])!r}..."
        assert hostile.misbehaved == 1


@pytest.mark.parametrize("hostile", [{"mode": "stale", "every": 2, "structured": False}],
                         indirect=True)
@pytest.mark.asyncio
async def test_a_late_duplicate_reply_is_not_the_next_requests(hostile: HostileServer) -> None:
    """The first read's reply comes again before the second read's, the
    second on the same tag: it is a reply to a finished request, not to the
    one that holds the tag now, and never its data. (Simple replies: a
    structured one names its offset, which gives it away.)"""
    first, second = os.urandom(4096), os.urandom(4096)
    hostile.data[:4096], hostile.data[1 << 20:(1 << 20) + 4096] = first, second
    async with rig_of(hostile.uri(), reconnect_timeout=20) as rig:
        p = rig.plane
        assert _io_done(await rig.rw(0, uapi.Op.READ, 0, 4096))
        assert bytes(p.buf(0)[:4096]) == first
        ev = await rig.rw(0, uapi.Op.READ, 1 << 20, 4096)
        assert hostile.misbehaved == 1
        if ev[0] == EV_IO:
            assert bytes(p.buf(0)[:4096]) == second, "a stale reply's data was taken"
        else:
            assert ev[0] == EV_RETRY


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.asyncio
async def test_replies_split_at_every_byte(tmp_path: Path, structured: bool) -> None:
    """Every reply written a byte at a time (its header; its data in small
    pieces), structured and simple: each read lands whole and right, and
    the connection is never dropped."""
    server = HostileServer(tmp_path / "split.sock", SIZE, mode="split", every=1,
                           structured=structured)
    data = os.urandom(DEPTH * 16384)
    server.data[:len(data)] = data
    try:
        async with rig_of(server.uri(), reconnect_timeout=20) as rig:
            p, connections = rig.plane, server.connections
            for length in (512, 16384):
                p.events.clear()
                for tag in range(DEPTH):
                    p.buf(tag)[:length] = b"\xa5" * length
                    p.fetch(tag, uapi.Op.READ, length >> 9, tag * (16384 >> 9))
                await p.wait_for(lambda: len(p.events) == DEPTH, timeout=20)
                assert _committed(p) == set(range(DEPTH))
                for tag in range(DEPTH):
                    assert bytes(p.buf(tag)[:length]) == data[tag * 16384:tag * 16384 + length]
            assert server.connections == connections
    finally:
        server.close()


@pytest.mark.parametrize("hostile", [{"mode": "stall", "every": 3, "stall": 0.5}],
                         indirect=True)
@pytest.mark.asyncio
async def test_a_server_that_stops_reading_for_a_while(hostile: HostileServer) -> None:
    """The server stops reading now and then while 128k writes are sent:
    every write is committed once the server took it, and reads give back
    what was written, on one connection."""
    async with rig_of(hostile.uri(), reconnect_timeout=20) as rig:
        p, connections = rig.plane, hostile.connections
        datas = [os.urandom(MAX_IO) for _ in range(DEPTH)]
        p.events.clear()
        for tag, data in enumerate(datas):
            p.buf(tag)[:MAX_IO] = data
            p.fetch(tag, uapi.Op.WRITE, MAX_IO >> 9, tag * (MAX_IO >> 9))
        await p.wait_for(lambda: len(p.events) == DEPTH, timeout=20)
        assert _committed(p) == set(range(DEPTH))
        assert bytes(hostile.data[:DEPTH * MAX_IO]) == b"".join(datas)
        assert hostile.misbehaved >= 2
        assert hostile.connections == connections
