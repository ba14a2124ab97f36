"""The nbd target's C transmission against a server that misbehaves on
purpose (tests/support/hostile_nbd.py): replies before the request left,
to requests long finished, with overlapping chunks, split at every byte,
or a server that stops reading. Dropping the connection is a fine answer
(the requests go back to Python, which reconnects); taking wrong bytes for
a read's answer, answering a request before its bytes left, or a crash
are not. The test plays the kernel as test_nbd_dataplane's rig does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioublk.kernel import uapi
from tests.host.test_nbd_dataplane import DEPTH, MAX_IO, NbdPlane, _io_done, rig_of
from tests.host.test_nbd_host import SIZE, pytestmark  # noqa: F401 - its skips
from tests.support.hostile_nbd import HostileServer


@pytest.fixture
def hostile(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    kw = getattr(request, "param", {})
    server = HostileServer(tmp_path / "hostile.sock", SIZE, **kw)
    try:
        yield server
    finally:
        server.close()


def _committed(p: NbdPlane) -> set[int]:
    return {e[1] for e in p.events if _io_done(e)}


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
