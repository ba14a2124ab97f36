"""The nbd target's data-plane plug-in (``csrc/nbd.c``) against real NBD
servers on the host: the C data plane sends reads and writes on the
connection Python made and commits them with no Python per request. The
test plays the kernel as test_hostile_kernel's does (a request is fetched by
a NOP, its commit goes to a pipe that refuses it: an EV_IO record of its
tag); the connection's socket is watched on the same ring."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from aioublk._uring import lib as ulib
from aioublk.dataplane.maps import External
from aioublk.dataplane.plane import EV_EXT, EV_IO, EV_RETRY, decode
from aioublk.kernel import uapi
from aioublk.ring import Ring
from aioublk.target import QueueContext, setup_queue, teardown_queue
from aioublk.targets.nbd import NbdTarget
from tests.dataplane.test_hostile_kernel import Plane
from tests.nbd import test_nbd_host
from tests.nbd.test_nbd_host import SIZE, Server, pytestmark  # noqa: F401 - its skips
from tests.support.hostile_nbd import HostileServer

DEPTH, MAX_IO = 8, 128 << 10
#: qemu-nbd serving this module's disk
qemu_nbd = test_nbd_host.qemu_nbd


class NbdPlane(Plane):
    """Plane whose plug-in asks for Python as the driver routes it (EV_EXT)."""

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        if decode(ud)[0] == EV_EXT:
            self.dp.wake()
            return
        super()._on_event(ud, res, flags)

    def answered(self, tag: int) -> list[tuple[int, int, int, int]]:
        return [e for e in self.events if e[1] == tag]

    @property
    def counts(self) -> Any:
        return self.dp.counts[0]


class Rig:
    """A target connected on the test's loop, its map in a data plane."""

    def __init__(self, t: NbdTarget, q: QueueContext, plane: NbdPlane) -> None:
        self.t, self.q, self.plane = t, q, plane
        self.link = q.state["nbd"]

    async def plugged(self, want: bool = True) -> None:
        await self.plane.wait_for(lambda: self.link.plugged == want, timeout=20)

    async def rw(self, tag: int, op: int, offset: int, length: int) -> tuple[int, int, int, int]:
        """One request, fetched and waited for: its first record."""
        self.plane.events.clear()
        self.plane.fetch(tag, op, length >> 9, offset >> 9)
        await self.plane.wait_for(lambda: self.plane.answered(tag))
        return self.plane.answered(tag)[0]


@contextlib.asynccontextmanager
async def rig_of(uri: str, **kw: Any) -> AsyncIterator[Rig]:
    """The target on this loop, its map in a data plane on a ring of its
    own, its connection plugged in."""
    ring = Ring(64, bind_thread=True)
    try:
        t = NbdTarget(uri, **kw)
        q = QueueContext(0, (0,), asyncio.get_running_loop())
        await setup_queue(t, q)
        plane = None
        try:
            m = t.map()
            assert isinstance(m, External)
            plane = NbdPlane(ring, -1, depth=DEPTH, max_io=MAX_IO, map=m)
            rig = Rig(t, q, plane)
            await rig.plugged()
            yield rig
        finally:
            await teardown_queue(t, q)
            if plane is not None:
                plane.close()
    finally:
        ring.close()


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk.raw"
    with open(path, "wb") as f:  # data in the first half, a hole after it
        f.write(os.urandom(SIZE // 2))
        f.truncate(SIZE)
    return path


def _io_done(ev: tuple[int, int, int, int]) -> bool:
    """The record of a commit C sent (the pipe refused it), not a hand-over."""
    return ev[0] == EV_IO and ev[3] < 0


@pytest.mark.asyncio
async def test_reads_and_writes_are_served_in_c(qemu_nbd: Server, disk: Path) -> None:
    """4k and 128k writes then reads of the same ranges: every one sent,
    answered and committed by C (no record but its commit), the bytes in
    the server's file and back in the tag buffers."""
    async with rig_of(qemu_nbd.uri()) as rig:
        p = rig.plane
        writes = [(0, 4096, 1 << 20), (1, MAX_IO, 2 << 20)]
        datas = {}
        for tag, n, off in writes:
            datas[tag] = os.urandom(n)
            p.buf(tag)[:n] = datas[tag]
            assert _io_done(await rig.rw(tag, uapi.Op.WRITE, off, n))
        raw = disk.read_bytes()
        for tag, n, off in writes:
            assert raw[off:off + n] == datas[tag]
        for tag, n, off in writes:
            p.buf(tag + 2)[:n] = bytes(n)
            assert _io_done(await rig.rw(tag + 2, uapi.Op.READ, off, n))
            assert bytes(p.buf(tag + 2)[:n]) == datas[tag]
        assert (p.counts.c_served, p.counts.py_handed) == (4, 0)
        assert rig.t.lib.anbd_ext_sent(rig.link.ext) == 4
        assert rig.t.lib.anbd_ext_own(rig.link.ext) == 1  # C's own transmission, not libnbd


async def _batch(rig: Rig, op: int, n: int, length: int) -> None:
    """n requests of length bytes fetched together, at n consecutive offsets,
    each committed by C."""
    p = rig.plane
    p.events.clear()
    for tag in range(n):
        p.fetch(tag, op, length >> 9, tag * (length >> 9))
    await p.wait_for(lambda: len(p.events) == n)
    assert all(_io_done(e) for e in p.events)


def _fill(p: NbdPlane, length: int) -> list[bytes]:
    """The first length bytes of each of the DEPTH tag buffers made random:
    what each holds."""
    datas = [os.urandom(length) for _ in range(DEPTH)]
    for tag, data in enumerate(datas):
        p.buf(tag)[:length] = data
    return datas


def _clear(p: NbdPlane, length: int) -> None:
    for tag in range(DEPTH):
        p.buf(tag)[:length] = bytes(length)


def _held(p: NbdPlane, length: int) -> list[bytes]:
    return [bytes(p.buf(tag)[:length]) for tag in range(DEPTH)]


@pytest.mark.asyncio
async def test_a_pass_sends_its_requests_in_one_sendmsg(qemu_nbd: Server, disk: Path) -> None:
    """DEPTH writes fetched together go to the socket in one SENDMSG on the
    ring from the tag buffers (header, data, header, data...), and the
    small reads that follow are parsed out of few large reads, each into
    its own buffer."""
    async with rig_of(qemu_nbd.uri()) as rig:
        p, lib, ext = rig.plane, rig.t.lib, rig.link.ext
        datas = _fill(p, 4096)
        sends = lib.anbd_ext_sends(ext)
        await _batch(rig, uapi.Op.WRITE, DEPTH, 4096)
        assert lib.anbd_ext_sends(ext) - sends == 1
        assert disk.read_bytes()[:DEPTH * 4096] == b"".join(datas)
        _clear(p, 4096)
        reads = lib.anbd_ext_reads(ext)
        await _batch(rig, uapi.Op.READ, DEPTH, 4096)
        assert _held(p, 4096) == datas
        # (a read per reply would be 2 * DEPTH: header, then data)
        assert lib.anbd_ext_reads(ext) - reads <= DEPTH


@pytest.mark.asyncio
async def test_a_send_larger_than_the_socket_takes_is_one_sendmsg(qemu_nbd: Server,
                                                                   disk: Path) -> None:
    """DEPTH 128k writes fetched together are more than the socket's send
    buffer takes at once: the ring goes on sending them (MSG_WAITALL), so
    they still cost C one SENDMSG, not one per part the socket took."""
    async with rig_of(qemu_nbd.uri()) as rig:
        p, lib, ext = rig.plane, rig.t.lib, rig.link.ext
        sock = socket.socket(fileno=os.dup(lib.nbd_aio_get_fd(lib.anbd_ext_handle(ext))))
        with sock:
            sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert sndbuf < DEPTH * MAX_IO  # (else this would prove nothing)
        big = _fill(p, MAX_IO)
        sends = lib.anbd_ext_sends(ext)
        await _batch(rig, uapi.Op.WRITE, DEPTH, MAX_IO)
        assert lib.anbd_ext_sends(ext) - sends == 1
        assert disk.read_bytes()[:DEPTH * MAX_IO] == b"".join(big)


@pytest.mark.asyncio
async def test_a_large_reads_data_is_read_straight_into_its_buffer(qemu_nbd: Server,
                                                                    disk: Path) -> None:
    """DEPTH 128k reads at once, after a first one: more than the stage
    holds, yet their replies' data goes from the socket to the requests'
    buffers with no copy through it (at most a header's worth of a reply is
    staged), and every byte is right. (The first comes after small
    replies, and may be staged.)"""
    async with rig_of(qemu_nbd.uri()) as rig:
        p, lib, ext = rig.plane, rig.t.lib, rig.link.ext
        big = _fill(p, MAX_IO)
        await _batch(rig, uapi.Op.WRITE, DEPTH, MAX_IO)
        _clear(p, MAX_IO)
        assert _io_done(await rig.rw(0, uapi.Op.READ, 0, MAX_IO))
        p.buf(0)[:MAX_IO] = bytes(MAX_IO)
        staged = lib.anbd_ext_staged(ext)
        await _batch(rig, uapi.Op.READ, DEPTH, MAX_IO)
        assert _held(p, MAX_IO) == big
        assert lib.anbd_ext_staged(ext) - staged <= DEPTH * 28


#: which of a batch's DEPTH reads are 128k (L) and which 4k (s)
MIXES = ["sssssssL", "Lsssssss", "LsLsLsLs", "LLLsLLLL"]


@pytest.mark.asyncio
@pytest.mark.parametrize("mix", MIXES)
async def test_large_and_small_reads_in_one_batch_land_whole(qemu_nbd: Server, disk: Path,
                                                               mix: str) -> None:
    """Reads of 128k and 4k in flight together: the stage switches between
    a header at a time and many replies to a read as the mix in flight
    changes, and every reply's bytes land whole in their own buffer; twice,
    the second batch starting from what the first left."""
    async with rig_of(qemu_nbd.uri()) as rig:
        p = rig.plane
        datas = _fill(p, MAX_IO)
        await _batch(rig, uapi.Op.WRITE, DEPTH, MAX_IO)
        lengths = [MAX_IO if kind == "L" else 4096 for kind in mix]
        for _ in range(2):
            _clear(p, MAX_IO)
            p.events.clear()
            for tag, length in enumerate(lengths):
                p.fetch(tag, uapi.Op.READ, length >> 9, tag * (MAX_IO >> 9))
            await p.wait_for(lambda: len(p.events) == DEPTH)
            assert all(_io_done(e) for e in p.events)
            assert [bytes(p.buf(t)[:n]) for t, n in enumerate(lengths)] == \
                [d[:n] for d, n in zip(datas, lengths, strict=True)]


@pytest.mark.asyncio
async def test_simple_replies_are_parsed_in_c(tmp_path: Path) -> None:
    """A server that does not speak structured replies (nbdkit --no-sr):
    C reads each simple reply's data into its tag buffer, 4k and 128k, and
    a write then read of the same bytes round-trips."""
    sock = tmp_path / "kit.sock"
    kit = Server(["nbdkit", "-f", "--no-sr", "-U", str(sock), "memory", f"size={SIZE}"],
                 sock).start()
    try:
        async with rig_of(kit.uri("")) as rig:
            lib, p = rig.t.lib, rig.plane
            assert lib.nbd_get_structured_replies_negotiated(rig.link.h) == 0
            assert lib.anbd_ext_own(rig.link.ext) == 1
            for n, off in ((4096, 1 << 20), (MAX_IO, 3 << 20)):
                data = os.urandom(n)
                p.buf(0)[:n] = data
                assert _io_done(await rig.rw(0, uapi.Op.WRITE, off, n))
                p.buf(1)[:n] = bytes(n)
                assert _io_done(await rig.rw(1, uapi.Op.READ, off, n))
                assert bytes(p.buf(1)[:n]) == data
            p.buf(2)[:MAX_IO] = b"\xa5" * MAX_IO  # never written: the server's zeroes
            assert _io_done(await rig.rw(2, uapi.Op.READ, SIZE - MAX_IO, MAX_IO))
            assert bytes(p.buf(2)[:MAX_IO]) == bytes(MAX_IO)
            assert p.counts.c_served == 5
            # an error's simple reply carries no data: the next reply parses after it
            assert (await rig.rw(3, uapi.Op.READ, SIZE, 4096))[::3] == (EV_RETRY, -errno.EINVAL)
            assert _io_done(await rig.rw(1, uapi.Op.READ, 1 << 20, 4096))
            assert lib.anbd_ext_own(rig.link.ext) == 1
    finally:
        kit.kill()


@pytest.mark.skipif(shutil.which("certtool") is None, reason="needs certtool (gnutls-bin)")
@pytest.mark.asyncio
async def test_tls_stays_with_libnbd(tmp_path: Path) -> None:
    """Over TLS the socket carries gnutls's records, not NBD: libnbd keeps
    sending and parsing, plugged into the data plane as before."""
    certs = test_nbd_host._certificates(tmp_path / "certs", server=True)
    kit, uri = test_nbd_host._tls_nbdkit(certs, None)
    try:
        async with rig_of(uri, tls_certificates=str(certs)) as rig:
            p = rig.plane
            assert rig.t.lib.anbd_ext_own(rig.link.ext) == 0
            data = os.urandom(4096)
            p.buf(0)[:4096] = data
            assert _io_done(await rig.rw(0, uapi.Op.WRITE, 0, 4096))
            assert _io_done(await rig.rw(1, uapi.Op.READ, 0, 4096))
            assert bytes(p.buf(1)[:4096]) == data
            assert p.counts.c_served == 2
    finally:
        kit.kill()
        kit.wait()


@pytest.mark.asyncio
async def test_structured_replies_with_holes_fill_the_buffer(qemu_nbd: Server,
                                                             disk: Path) -> None:
    """qemu-nbd answers a read over a hole with structured reply chunks
    (OFFSET_HOLE): C zeroes those parts of the tag buffer, which held
    garbage, and commits the read whole."""
    async with rig_of(qemu_nbd.uri()) as rig:
        assert rig.t.lib.nbd_get_structured_replies_negotiated(rig.link.h) == 1
        p = rig.plane
        off = SIZE // 2 - MAX_IO // 2  # half data, half hole
        p.buf(5)[:MAX_IO] = b"\xa5" * MAX_IO
        assert _io_done(await rig.rw(5, uapi.Op.READ, off, MAX_IO))
        want = disk.read_bytes()[off:off + MAX_IO]
        assert want[MAX_IO // 2:] == bytes(MAX_IO // 2)
        assert bytes(p.buf(5)[:MAX_IO]) == want
        assert p.counts.c_served == 1


@pytest.mark.asyncio
async def test_a_server_error_hands_the_request_to_python(tmp_path: Path) -> None:
    """nbdkit's error filter fails reads while its file exists: C does not
    answer the request, it hands it to Python (EV_RETRY with the error);
    the same read afterwards is C's again."""
    sock, inject = tmp_path / "kit.sock", tmp_path / "inject"
    kit = Server(["nbdkit", "-f", "-U", str(sock), "--filter=error", "memory", f"size={SIZE}",
                  "error-pread=EIO", "error-pread-rate=100%", f"error-pread-file={inject}"],
                 sock).start()
    try:
        async with rig_of(kit.uri("")) as rig:
            inject.touch()
            assert (await rig.rw(0, uapi.Op.READ, 0, 4096))[::3] == (EV_RETRY, -errno.EIO)
            assert (rig.plane.counts.c_served, rig.plane.counts.py_handed) == (0, 1)
            assert rig.link.plugged  # an answer with an error is not a lost connection
            inject.unlink()
            assert _io_done(await rig.rw(0, uapi.Op.READ, 0, 4096))
            assert rig.plane.counts.c_served == 1
    finally:
        kit.kill()


@pytest.mark.asyncio
async def test_connection_lost_requests_go_to_python_until_it_reconnects(
        qemu_nbd: Server, disk: Path) -> None:
    """The server stops with C's writes in flight, then dies: C hands them
    to Python (EV_RETRY), lets go of the dead handle (a new request is
    Python's, EV_IO with res 0, not sent on it), and Python, told through
    EV_EXT, reconnects; its coroutines resend what C handed back, and once
    the new handle is plugged in C serves again."""
    async with rig_of(qemu_nbd.uri(), reconnect_timeout=20) as rig:
        p, t = rig.plane, rig.t
        assert qemu_nbd.proc is not None
        qemu_nbd.proc.send_signal(signal.SIGSTOP)
        datas = {tag: os.urandom(4096) for tag in range(4)}
        p.events.clear()
        for tag, data in datas.items():
            p.buf(tag)[:4096] = data
            p.fetch(tag, uapi.Op.WRITE, 8, tag * 8)
        await p.wait_for(lambda: ulib.aur_dp_inflight(p.dp.c) == 4)
        qemu_nbd.kill()
        await p.wait_for(lambda: len([e for e in p.events if e[0] == EV_RETRY]) == 4)
        assert not any(_io_done(e) for e in p.events)
        await rig.plugged(False)
        p.events.clear()
        p.fetch(4, uapi.Op.READ, 8, 0)
        await p.wait_for(lambda: p.answered(4))
        assert p.answered(4) == [(EV_IO, 4, 0, 0)]  # fetched, and Python's
        # Python serves what C handed back, as the driver would: held until it reconnects
        resent = [asyncio.ensure_future(t.write(tag * 4096, p.buf(tag)[:4096])) for tag in datas]
        qemu_nbd.start()
        await rig.plugged()
        await p.wait_for(lambda: all(w.done() for w in resent), timeout=20)
        await asyncio.gather(*resent)
        assert disk.read_bytes()[:4 * 4096] == b"".join(datas.values())
        before = p.counts.c_served
        assert _io_done(await rig.rw(5, uapi.Op.READ, 4096, 4096))
        assert bytes(p.buf(5)[:4096]) == datas[1]
        assert p.counts.c_served == before + 1


@pytest.mark.asyncio
async def test_pythons_own_commands_complete_on_the_plugged_handle(qemu_nbd: Server,
                                                                   disk: Path) -> None:
    """Flush, zeroes and a FUA write (the coroutines' share) go on the
    handle C watches: their completions reach Python through EV_EXT."""
    async with rig_of(qemu_nbd.uri()) as rig:
        t, p = rig.t, rig.plane

        async def run(coro: Any) -> None:
            task = asyncio.ensure_future(coro)
            await p.wait_for(task.done)
            await task

        data = bytearray(os.urandom(8192))
        await run(t.write(8192, memoryview(data), fua=True))
        await run(t.write_zeroes(8192, 4096, unmap=False))
        await run(t.flush())
        assert disk.read_bytes()[8192:16384] == bytes(4096) + data[4096:]
        assert rig.link.plugged


#: replies that break the protocol, given the request's cookie; what C says of each
BAD_REPLIES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "bad magic": (lambda c: struct.pack(">II", 0x12345678, 0) + c, "a reply with a bad magic"),
    "unknown cookie": (lambda c: struct.pack(">IIQ", 0x67446698, 0, 999_999),
                       "a reply to no request in flight"),
    "data outside the read": (lambda c: (struct.pack(">IHH", 0x668e33ef, 1, 1) + c
                                         + struct.pack(">IQ", 8 + 512, 1 << 30) + bytes(512)),
                              "data outside its read"),
    "a chunk type not asked for": (lambda c: (struct.pack(">IHH", 0x668e33ef, 1, 5) + c
                                              + struct.pack(">I", 0)),
                                   "a reply chunk of a type not asked for"),
}


@pytest.mark.parametrize("bad", list(BAD_REPLIES))
@pytest.mark.asyncio
async def test_a_reply_that_breaks_the_protocol_drops_the_connection(
        tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture) -> None:
    """C parses the replies itself, so it is C that must refuse one the
    protocol does not allow: the request goes back to Python (EV_RETRY),
    the connection is dropped and made again, and the next read, on the new
    connection, is C's. The log line of the loss says what was wrong."""
    reply, why = BAD_REPLIES[bad]
    server = HostileServer(tmp_path / "fake.sock", SIZE, first_read=reply)
    try:
        async with rig_of(server.uri(), reconnect_timeout=20) as rig:
            p, lib = rig.plane, rig.t.lib
            assert lib.anbd_ext_own(rig.link.ext) == 1
            connections = server.connections
            p.buf(0)[:4096] = b"\xa5" * 4096
            assert (await rig.rw(0, uapi.Op.READ, 0, 4096))[0] == EV_RETRY
            await p.wait_for(lambda: server.connections > connections and rig.link.plugged,
                             timeout=20)
            assert _io_done(await rig.rw(1, uapi.Op.READ, 4096, 4096))
            assert bytes(p.buf(1)[:4096]) == bytes(4096)
        assert f'error="{why}"' in caplog.text
    finally:
        server.close()
