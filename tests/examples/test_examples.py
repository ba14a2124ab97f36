"""examples/kvdisk.py without a kernel: its protocol, and KvTarget driven
directly on event loops the way queues drive it (on this loop and on a
second thread's)."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import random
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import pytest_asyncio
import uvloop

from aioublk.target import QueueContext, QueueSetupError, setup_queue, teardown_queue

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BLOCK = 4096
SIZE = 1 << 20


def load_example(name: str) -> ModuleType:
    """examples/ is no package: load a file as a module (registered, so that
    its classes pickle and introspect like any other)."""
    key = f"aioublk_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


kvdisk = load_example("kvdisk")
pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Any]:
    async with kvdisk.KvServer() as s:
        yield s


@pytest_asyncio.fixture
async def target(server: Any) -> AsyncIterator[Any]:
    """The target with this loop set up as a queue worker's (its connection)."""
    t = kvdisk.KvTarget(SIZE, server.host, server.port)
    q = QueueContext(0, (0,), asyncio.get_running_loop())
    await setup_queue(t, q)
    yield t
    await teardown_queue(t, q)  # this loop's connection, as a queue does at stop
    assert q.state == {}
    t.close()


async def read(target: Any, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    await target.read(offset, memoryview(buf))
    return bytes(buf)


async def test_missing_blocks_read_as_zeros(server: Any, target: Any) -> None:
    assert await read(target, 0, 3 * BLOCK + 512) == bytes(3 * BLOCK + 512)
    assert await read(target, SIZE - 100, 100) == bytes(100)
    assert server.blocks == {}


@pytest.mark.parametrize("offset,length", [
    (0, BLOCK), (0, 1), (100, 1), (BLOCK - 512, 1024), (5000, 3 * BLOCK + 17),
    (10 * BLOCK - 1, 2), (7 * BLOCK, 64 * BLOCK), (SIZE - 513, 513),
])
async def test_unaligned_ranges(server: Any, target: Any, offset: int, length: int) -> None:
    data = random.randbytes(length)
    await target.write(offset, memoryview(data))
    assert await read(target, offset, length) == data
    assert server.read(offset, length) == data
    # the rest of the touched blocks stayed zero, and only those blocks exist
    first, end = offset // BLOCK * BLOCK, -(-(offset + length) // BLOCK) * BLOCK
    assert server.read(first, offset - first) == bytes(offset - first)
    assert server.read(offset + length, end - offset - length) == bytes(end - offset - length)
    assert sorted(server.blocks) == list(range(first // BLOCK, end // BLOCK))


async def test_partial_write_keeps_the_rest_of_the_block(server: Any, target: Any) -> None:
    await target.write(BLOCK, memoryview(b"\xaa" * BLOCK))
    await target.write(BLOCK + 10, memoryview(b"hello"))
    assert await read(target, BLOCK, BLOCK) == b"\xaa" * 10 + b"hello" + b"\xaa" * (BLOCK - 15)


async def test_discard_trims_whole_blocks_and_zeroes_partial_ones(server: Any,
                                                                  target: Any) -> None:
    data = random.randbytes(8 * BLOCK)
    await target.write(0, memoryview(data))
    await target.discard(BLOCK + 100, 4 * BLOCK)  # blocks 2..4 whole, 1 and 5 partial
    expect = data[:BLOCK + 100] + bytes(4 * BLOCK) + data[5 * BLOCK + 100:]
    assert await read(target, 0, 8 * BLOCK) == expect
    assert sorted(server.blocks) == [0, 1, 5, 6, 7]
    await target.write_zeroes(0, 8 * BLOCK)
    assert server.blocks == {}
    assert await read(target, 0, 8 * BLOCK) == bytes(8 * BLOCK)


async def test_concurrent_requests_pipeline_on_one_connection(server: Any, target: Any) -> None:
    rng = random.Random(5)
    model = bytearray(SIZE)
    # 200 disjoint ranges at random offsets and of random sizes, in random order
    cuts = sorted(rng.sample(range(SIZE), 400))
    ranges = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
    rng.shuffle(ranges)
    writes = []
    for offset, length in ranges:
        data = rng.randbytes(length)
        model[offset:offset + length] = data
        writes.append(target.write(offset, memoryview(data)))
    await asyncio.gather(*writes)
    backs = await asyncio.gather(*(read(target, o, n) for o, n in ranges))
    for (offset, length), back in zip(ranges, backs, strict=True):
        assert back == model[offset:offset + length]
    assert server.read(0, SIZE) == model
    assert server.connections == 1


async def test_one_connection_per_loop(server: Any, target: Any) -> None:
    """A second thread with its own uvloop loop (as a second queue) gets its
    own connection; both see each other's writes. The server lives on this
    loop, so the thread runs in an executor while this loop keeps serving."""
    mine, theirs = random.randbytes(3 * BLOCK), random.randbytes(2 * BLOCK + 7)
    await target.write(100, memoryview(mine))

    async def other_loop() -> bytes:
        q = QueueContext(1, (1,), asyncio.get_running_loop())
        await setup_queue(target, q)
        await target.write(SIZE // 2 + 5, memoryview(theirs))
        back = await read(target, 100, len(mine))
        await teardown_queue(target, q)
        assert q.state == {}  # its connection closed
        return back

    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, uvloop.run, other_loop()) == mine
    assert await read(target, SIZE // 2 + 5, len(theirs)) == theirs
    assert server.connections == 2


async def test_lost_connection_fails_waiting_requests_then_reconnects(server: Any,
                                                                     target: Any) -> None:
    await target.write(0, memoryview(b"x" * 512))
    conn = await target._conn()
    pending = conn.call(kvdisk.GET, 0)
    for w in list(server._clients):  # the server drops the client
        w.close()
    with pytest.raises(ConnectionResetError):
        await pending
    assert await read(target, 0, 512) == b"x" * 512  # a new connection
    assert server.connections == 2


async def test_a_server_that_is_down_fails_the_queue_setup() -> None:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = kvdisk.KvTarget(SIZE, "127.0.0.1", port)
    q = QueueContext(0, (0,), asyncio.get_running_loop())
    with pytest.raises(QueueSetupError, match="target 'kv': queue_setup failed on worker 0 "
                       r"\(queues 0\): ConnectionRefusedError"):
        await setup_queue(t, q)


async def test_server_refuses_bad_requests(server: Any, target: Any) -> None:
    conn = await target._conn()
    with pytest.raises(OSError) as e:
        await conn.call(kvdisk.PUT, 0, BLOCK - 1, b"ab")  # past the block's end
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        await conn.call(99, 0)
    assert e.value.errno == errno.EINVAL
    assert await conn.call(kvdisk.GET, 0) == b""  # missing: an empty reply
    assert server.blocks == {}


async def test_raw_protocol_frames(server: Any) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    req, rep = kvdisk.REQ, kvdisk.REP
    writer.write(req.pack(kvdisk.PUT, 7, 3, 10, 3) + b"abc" + req.pack(kvdisk.GET, 8, 3, 0, 0))
    assert rep.unpack(await reader.readexactly(rep.size)) == (7, 0, 0)
    assert rep.unpack(await reader.readexactly(rep.size)) == (8, 0, BLOCK)
    assert await reader.readexactly(BLOCK) == bytes(10) + b"abc" + bytes(BLOCK - 13)
    writer.write(req.pack(kvdisk.TRIM, 9, 0, 10, 0))
    assert rep.unpack(await reader.readexactly(rep.size)) == (9, 0, 0)
    assert server.blocks == {}
    writer.write(req.pack(kvdisk.PUT, 1, 0, 0, BLOCK + 1))  # oversized: hung up on
    assert await reader.read() == b""
    writer.close()
