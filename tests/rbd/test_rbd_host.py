"""The rbd target on the host, against a real throwaway one-node Ceph
cluster (``tools.ceph``, started once for the module): its
methods driven directly on the test's loop, the image read back with
``rbd export``."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aioublk.frontend.cli import main as cli_main
from aioublk.target import QueueContext, setup_queue, teardown_queue
from aioublk.targets.rbd import RbdError, RbdTarget
from tools.ceph import Cluster

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aioublk.targets._rbd") is None,
                       reason="librbd binding not built (needs librbd-dev)"),
    pytest.mark.skipif(shutil.which("ceph-mon") is None or shutil.which("ceph-osd") is None,
                       reason="needs ceph-mon and ceph-osd (scripts/setup installs them)"),
]

SIZE = RBD_IMAGE_SIZE = 16 << 20


@pytest_asyncio.fixture
async def attached(ceph: Cluster, rbd_image: str) -> AsyncIterator[RbdTarget]:
    t = RbdTarget(rbd_image, conf=ceph.conf)
    q = QueueContext(0, (0,), asyncio.get_running_loop())
    await setup_queue(t, q)
    try:
        yield t
    finally:
        await teardown_queue(t, q)
        t.close()


def _export(ceph: Cluster, spec: str, tmp_path: Path) -> bytes:
    out = tmp_path / "export.raw"
    out.unlink(missing_ok=True)
    ceph.rbd("export", "--no-progress", spec, str(out))
    return out.read_bytes()


def _used(ceph: Cluster, spec: str) -> int:
    images = json.loads(ceph.rbd("du", "--format", "json", spec))["images"]
    return int(images[0]["used_size"])


def test_geometry(ceph: Cluster, rbd_image: str) -> None:
    t = RbdTarget(rbd_image, conf=ceph.conf)
    try:
        g = t.geometry
        assert (g.size, g.logical_block_size, g.io_opt) == (SIZE, 512, 4 << 20)
        assert g.volatile_cache and g.fua and g.discard and g.write_zeroes
        assert not g.read_only and t.one_loop
        # a discard reaches librbd whole (1 GiB), not cut to the 1 MiB of a data I/O:
        # only a whole object's discard frees it
        assert g.params(1 << 20).discard == (0, 4096, (1 << 30) >> 9, (1 << 20) >> 9, 1)
    finally:
        t.close()


@pytest.mark.asyncio
async def test_round_trip(ceph: Cluster, attached: RbdTarget, tmp_path: Path) -> None:
    """Write (plain, FUA, fast path), read, flush, zero; compare with rbd export."""
    t = attached
    data = bytearray(os.urandom(256 << 10))
    await t.write(64 << 10, memoryview(data))
    await t.write(1 << 20, memoryview(data[:4096]), fua=True)
    results: list[int] = []
    assert t.start_write(2 << 20, memoryview(data[:8192]), results.append)
    out = bytearray(len(data))
    await asyncio.gather(t.read(64 << 10, memoryview(out)), t.flush())
    assert out == data
    fast = bytearray(8192)
    assert t.start_read(2 << 20, memoryview(fast), results.append)
    while len(results) < 2:
        await asyncio.sleep(0.01)
    assert results == [8192, 8192] and fast == data[:8192]
    await t.write_zeroes(128 << 10, 16 << 10)
    await t.flush()
    raw = _export(ceph, t.spec, tmp_path)
    assert raw[64 << 10:128 << 10] == data[:64 << 10]
    assert raw[128 << 10:144 << 10] == bytes(16 << 10)
    assert raw[144 << 10:320 << 10] == data[80 << 10:]
    assert raw[1 << 20:(1 << 20) + 4096] == data[:4096]


@pytest.mark.asyncio
async def test_discard_frees_objects(ceph: Cluster, attached: RbdTarget) -> None:
    t = attached
    await asyncio.gather(*(t.write(off, memoryview(os.urandom(1 << 20)))
                           for off in range(0, 8 << 20, 1 << 20)))
    await t.flush()
    before = _used(ceph, t.spec)
    await t.discard(0, 8 << 20)
    await t.flush()
    assert _used(ceph, t.spec) < before
    out = bytearray(1 << 20)
    await t.read(4 << 20, memoryview(out))
    assert out == bytes(1 << 20)


@pytest.mark.asyncio
async def test_many_in_flight(attached: RbdTarget) -> None:
    """64 requests at once: every completion reaped, each to its own request."""
    t = attached
    blocks = [os.urandom(4096) for _ in range(64)]
    await asyncio.gather(*(t.write(i * 65536, memoryview(b)) for i, b in enumerate(blocks)))
    outs = [bytearray(4096) for _ in blocks]
    await asyncio.gather(*(t.read(i * 65536, memoryview(o)) for i, o in enumerate(outs)))
    assert [bytes(o) for o in outs] == blocks and not t.pending


@pytest.mark.asyncio
async def test_snapshot_is_read_only(ceph: Cluster, rbd_image: str) -> None:
    old = os.urandom(8192)
    t = RbdTarget(rbd_image, conf=ceph.conf)
    q = QueueContext(0, (0,), asyncio.get_running_loop())
    await setup_queue(t, q)
    try:
        await t.write(0, memoryview(old), fua=True)
        ceph.rbd("snap", "create", f"{rbd_image}@s1")
        await t.write(0, memoryview(os.urandom(8192)), fua=True)
    finally:
        await teardown_queue(t, q)
        t.close()
    s = RbdTarget(f"{rbd_image}@s1", conf=ceph.conf)
    q = QueueContext(0, (0,), asyncio.get_running_loop())
    await setup_queue(s, q)
    try:
        assert s.read_only and s.geometry.read_only and not s.geometry.discard
        out = bytearray(8192)
        await s.read(0, memoryview(out))
        assert out == old
        with pytest.raises(OSError) as e:
            await s.write(0, memoryview(old))
        assert e.value.errno == errno.EROFS
        assert not s.start_write(0, memoryview(old), lambda res: None)
    finally:
        await teardown_queue(s, q)
        s.close()


def _one_line(spec: str, says: str, **kw: object) -> None:
    with pytest.raises(RbdError) as e:
        RbdTarget(spec, **kw)  # type: ignore[arg-type]
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg


def test_missing_pool(ceph: Cluster) -> None:
    _one_line("nopool/img", "Ceph pool 'nopool': no such pool", conf=ceph.conf)


def test_missing_image(ceph: Cluster) -> None:
    _one_line("rbd/nope", "RBD image rbd/nope: no such image", conf=ceph.conf)


def test_missing_snapshot(ceph: Cluster, rbd_image: str) -> None:
    _one_line(f"{rbd_image}@nosnap", "has no snapshot 'nosnap'", conf=ceph.conf)


def test_missing_config_file(tmp_path: Path) -> None:
    _one_line("rbd/img", f"Ceph config {tmp_path}/none.conf: no such file",
              conf=str(tmp_path / "none.conf"))


@pytest.mark.parametrize("spec", ["img", "rbd/", "/img", "rbd/img@", "rbd/a/b"])
def test_bad_spec(ceph: Cluster, spec: str) -> None:
    _one_line(spec, "write it POOL/IMAGE", conf=ceph.conf)


def test_unreachable_cluster(tmp_path: Path) -> None:
    """Monitors that never answer: given up on after the timeout, one line."""
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\nmon host = 127.0.0.1:1\nauth client required = none\n")
    _one_line("rbd/img", "is it up and reachable", conf=str(conf), timeout=1)


def test_cli_add_missing_image_is_one_line(ceph: Cluster,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["add", "-t", "rbd", "rbd/nope", "--rbd-conf", ceph.conf]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aioublk: RBD image rbd/nope: no such image") and err.count("\n") == 1


@pytest.mark.asyncio
async def test_read_past_a_shrunk_end_is_zeros_not_stale_bytes(ceph: Cluster,
                                                               attached: RbdTarget) -> None:
    """Another client shrinks the image under the device: librbd clips a read
    that crosses the new end and answers the bytes it read. The rest of the
    buffer must not keep what an earlier request left in it: zeros (as the
    loop target reads past a file's end), on the coroutine and the fast path."""
    t, half = attached, 32 << 10
    data = os.urandom(2 * half)
    await t.write(SIZE - 2 * half, memoryview(bytearray(data)), fua=True)
    ceph.rbd("resize", "--allow-shrink", "--no-progress", "--size", f"{(SIZE - half) >> 10}K",
             t.spec)
    stale = b"\xaa" * (2 * half)
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # until the target's handle has seen the new header
        out = bytearray(stale)
        await t.read(SIZE - 2 * half, memoryview(out))
        if out[half:] != data[half:]:
            break
        assert asyncio.get_running_loop().time() < deadline, "the shrink was never seen"
        await asyncio.sleep(0.05)
    assert out[:half] == data[:half]
    assert out[half:] != stale[half:], "past the new end: the buffer's stale bytes"
    assert out[half:] == bytes(half)
    fast = bytearray(stale)
    results: list[int] = []
    assert t.start_read(SIZE - 2 * half, memoryview(fast), results.append)
    while not results:
        assert asyncio.get_running_loop().time() < deadline + 10, "no answer"
        await asyncio.sleep(0.01)
    assert results == [2 * half] and fast == data[:half] + bytes(half)
