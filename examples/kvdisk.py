"""A block device whose blocks live in a key-value server reached over TCP.

Run as root on a host with ublk_drv (server and device in one process, one
event loop):  python examples/kvdisk.py 64

- ``KvServer``: an asyncio block store (``asyncio.start_server`` on
  127.0.0.1) keeping blocks in a dict; a block never written is absent.
- ``KvTarget``: the ublk target; it maps device byte ranges onto blocks and
  asks the server for them. Missing blocks read as zeros.

The protocol, little-endian: a request is ``REQ`` (op, id, block, arg,
length) followed by ``length`` payload bytes; a reply is ``REP`` (id, errno,
length) followed by ``length`` bytes.

- GET block: the block's bytes, or nothing when it was never written.
- PUT block, arg = offset in the block, payload = bytes to store there. A
  partial PUT is merged by the server, so two queues writing different
  sectors of one block never race in a client-side read-modify-write.
- TRIM block, arg = count: forget ``count`` blocks (they read as zeros).

When the server runs on the application's loop, as here, never block that
loop (do blocking I/O on the device in an executor thread): the device's
requests wait for the server's replies.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import struct
import sys
from collections.abc import Iterator
from contextlib import suppress

from aioublk import Device, Geometry, QueueContext, Target, UblkError, current_queue

BLOCK = 4096
GET, PUT, TRIM = 1, 2, 3
REQ = struct.Struct("<BIQII")  # op, id, block, arg, payload length
REP = struct.Struct("<IiI")  # id, errno (0: ok), payload length


class KvServer:
    """The block store: ``blocks`` maps a block number to its bytes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, block_size: int = BLOCK) -> None:
        self.host, self.port = host, port
        self.block_size = block_size
        self.blocks: dict[int, bytearray] = {}
        self.connections = 0  # accepted so far
        self._clients: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> KvServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._clients):  # newer Pythons' wait_closed waits for them
                w.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> KvServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def open_connections(self) -> int:
        """Clients connected now (``connections`` counts every one so far)."""
        return len(self._clients)

    def read(self, offset: int, length: int) -> bytes:
        """The device's bytes at ``offset`` as stored (zeros where missing), for checks."""
        bs = self.block_size
        out = bytearray()
        for block in range(offset // bs, -(-(offset + length) // bs)):
            out += self.blocks.get(block, bytes(bs))
        return bytes(out[offset % bs:offset % bs + length])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client: requests answered in arrival order (the ids let a
        client pipeline; they would also allow answering out of order)."""
        self.connections += 1
        self._clients.add(writer)
        try:
            while True:
                op, rid, block, arg, n = REQ.unpack(await reader.readexactly(REQ.size))
                if n > self.block_size:
                    break  # not our protocol: hang up
                status, reply = self._handle(op, block, arg, await reader.readexactly(n))
                writer.write(REP.pack(rid, status, len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            self._clients.discard(writer)
            writer.close()

    def _handle(self, op: int, block: int, arg: int, data: bytes) -> tuple[int, bytes]:
        if op == GET:
            return 0, bytes(self.blocks.get(block, b""))
        if op == PUT:
            if arg + len(data) > self.block_size:
                return errno.EINVAL, b""
            stored = self.blocks.get(block)
            if stored is None:
                stored = self.blocks[block] = bytearray(self.block_size)
            stored[arg:arg + len(data)] = data
            return 0, b""
        if op == TRIM:
            gone = range(block, block + arg)  # walk the range or the dict, the smaller
            keys = gone if len(gone) < len(self.blocks) else [k for k in self.blocks if k in gone]
            for key in keys:
                self.blocks.pop(key, None)
            return 0, b""
        return errno.EINVAL, b""


class _Conn:
    """One loop's connection: requests pipelined, replies matched to them by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self.closed = False
        self._ids = itertools.count(1)
        self._replies = asyncio.get_running_loop().create_task(self._read_replies())

    def call(self, op: int, block: int, arg: int = 0,
             data: bytes | memoryview = b"") -> asyncio.Future[bytes]:
        """Send one request; the future gets the reply's payload. The frame
        goes out in one synchronous write, so concurrent callers' frames
        never interleave (no lock). The write is not awaited (no drain):
        what may be buffered is bounded by the requests in flight."""
        if self.closed:
            raise ConnectionResetError(errno.ECONNRESET, "kv server connection lost")
        rid = next(self._ids) & 0xFFFF_FFFF
        fut = self.pending[rid] = asyncio.get_running_loop().create_future()
        self.writer.write(REQ.pack(op, rid, block, arg, len(data)) + data)
        return fut

    async def _read_replies(self) -> None:
        try:
            while True:
                rid, status, n = REP.unpack(await self.reader.readexactly(REP.size))
                data = await self.reader.readexactly(n)
                fut = self.pending.pop(rid, None)
                if fut is None or fut.done():
                    continue  # its request was cancelled
                if status:
                    fut.set_exception(OSError(status, os.strerror(status)))
                else:
                    fut.set_result(data)
        except (asyncio.IncompleteReadError, OSError) as e:
            self._fail(ConnectionResetError(errno.ECONNRESET, f"kv server connection lost: {e}"))

    def _fail(self, error: Exception) -> None:
        self.closed = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()

    async def close(self) -> None:
        self.writer.close()  # the reader task then ends on EOF
        with suppress(OSError):
            await self.writer.wait_closed()
        await asyncio.wait([self._replies])


class KvTarget(Target):
    """Device blocks served by a ``KvServer`` at ``host:port``.

    Target coroutines run on each queue's own loop (one thread each), and an
    asyncio connection belongs to the loop that opened it: ``queue_setup``
    connects on each queue loop before its first request (a server that is
    down fails the device's start), keeps the connection in that loop's
    ``state``, where requests find it (``current_queue()``), and
    ``queue_teardown`` closes it when the queue stops.

    Requests are pipelined on that connection (ids, one reader task) rather
    than served by a pool of connections per loop: a queue has up to
    ``depth`` requests in flight (128 by default), each touching up to
    256 blocks, and a pool would need a connection per in-flight exchange to
    match that, plus a rule for growing it. A cancelled request is also
    harmless here: its late reply finds no waiter and is dropped, where a
    pooled connection would be left mid-exchange and have to be thrown away.

    A lost connection fails the requests waiting on it (ECONNRESET; the
    kernel reports EIO) and the next request reconnects.
    """

    name = "kv"

    def __init__(self, size: int, host: str, port: int, block_size: int = BLOCK) -> None:
        self.geometry = Geometry(size=size, physical_block_size=block_size, discard=True,
                                 discard_granularity=block_size, write_zeroes=True)
        self.address = (host, port)
        self.block_size = block_size

    async def queue_setup(self, q: QueueContext) -> None:
        await self._conn()

    async def _conn(self) -> _Conn:
        state = current_queue().state
        opening: asyncio.Task[_Conn] | None = state.get("kv")
        if opening is None or opening.done() and (
                opening.cancelled() or opening.exception() is not None
                or opening.result().closed):
            opening = state["kv"] = asyncio.get_running_loop().create_task(self._open())
        # shielded: a request cancelled while connecting must not cancel the
        # connect the other requests of this loop wait for
        return await asyncio.shield(opening)

    async def _open(self) -> _Conn:
        return _Conn(*await asyncio.open_connection(*self.address))

    def _pieces(self, offset: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(block, offset in it, offset in the request, length) of each block a range touches."""
        pos = 0
        while pos < length:
            block, start = divmod(offset + pos, self.block_size)
            n = min(self.block_size - start, length - pos)
            yield block, start, pos, n
            pos += n

    async def read(self, offset: int, buf: memoryview) -> None:
        conn = await self._conn()
        pieces = list(self._pieces(offset, len(buf)))
        blocks = await asyncio.gather(*(conn.call(GET, block) for block, *_ in pieces))
        for (_block, start, pos, n), data in zip(pieces, blocks, strict=True):
            buf[pos:pos + n] = data[start:start + n] if data else bytes(n)

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        # each PUT is stored by the time it is answered: FUA needs nothing more
        conn = await self._conn()
        await asyncio.gather(*(conn.call(PUT, block, start, buf[pos:pos + n])
                               for block, start, pos, n in self._pieces(offset, len(buf))))

    async def discard(self, offset: int, length: int) -> None:
        """Whole blocks are trimmed in one request; partial ones get zeros."""
        conn = await self._conn()
        pieces = list(self._pieces(offset, length))
        whole = [block for block, _s, _p, n in pieces if n == self.block_size]
        futs = [conn.call(TRIM, whole[0], len(whole))] if whole else []
        futs += [conn.call(PUT, block, start, bytes(n))
                 for block, start, _pos, n in pieces if n < self.block_size]
        await asyncio.gather(*futs)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.discard(offset, length)  # a missing block reads as zeros

    async def queue_teardown(self, q: QueueContext) -> None:
        """On each queue loop at stop: close that loop's connection."""
        opening: asyncio.Task[_Conn] | None = q.state.pop("kv", None)
        if opening is None:
            return
        await asyncio.wait([opening])  # a reconnect under way finishes first
        if not opening.cancelled() and opening.exception() is None:
            await opening.result().close()

    def describe(self) -> dict[str, object]:
        host, port = self.address
        return {**super().describe(), "server": f"{host}:{port}"}


async def main(mib: int) -> None:
    async with KvServer() as server:
        target = KvTarget(mib << 20, server.host, server.port)
        async with Device(target, queues=2) as dev:
            print(f"serving {dev.path} from {server.host}:{server.port}; Ctrl-C to stop",
                  flush=True)
            await dev.wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 64))
    except KeyboardInterrupt:
        pass
    except UblkError as e:
        sys.exit(f"kvdisk: {e}")
