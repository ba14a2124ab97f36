"""What a server was told durable is durable, for the targets whose durability is
a server's: nbd against a real NBD server that logs every request and reply
(nbdkit's log filter), nvme's commands to the controller, rbd's calls to librbd.

A write the target acknowledged with FUA must, at that moment, be either a
write the server took with its FUA flag and answered, or a write followed by a
FLUSH that the server received after answering the write and answered too; a
FLUSH must do the same for every write completed before it. A server that
advertises no FUA (nbdkit's eval plugin, can_fua none) must get the FLUSH.
tests/targets/test_fua_durable.py checks the targets whose durability is a host file's.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioublk.target import teardown_queue
from aioublk.targets import nvme
from aioublk.targets.nbd import NbdTarget
from aioublk.targets.rbd import RbdTarget
from tests.nbd.test_nbd_host import Server, _attached
from tests.nvme.test_nvme_host import fake_block, served_by
from tests.rbd.test_rbd_host import attached  # noqa: F401 - a fixture
from tests.targets.test_fua_durable import aligned

needs_nbdkit = pytest.mark.skipif(
    importlib.util.find_spec("aioublk.targets._nbd") is None or shutil.which("nbdkit") is None,
    reason="needs libnbd's binding (libnbd-dev) and nbdkit (scripts/setup installs them)")

K = 1024
_REQUEST = re.compile(r"connection=\d+ (\w+) id=(\d+)(.*) \.\.\.$")
_REPLY = re.compile(r"connection=(\d+) \.\.\.(\w+) id=(\d+) return=(\S+)")


def told_durable(log: list[str], offset: int, count: int) -> bool:
    """Did the server answer, within `log`, a FUA write of this range, or a write of
    it and then (asked after that answer) a flush?"""
    answered: dict[str, int] = {}  # "conn:id" -> index of its successful reply
    requests: list[tuple[int, str, str, str]] = []  # (index, conn:id, verb, args)
    for i, line in enumerate(log):
        conn = re.search(r"connection=(\d+)", line)
        if (m := _REQUEST.search(line)) and conn:
            requests.append((i, f"{conn.group(1)}:{m.group(2)}", m.group(1), m.group(3)))
        elif (m := _REPLY.search(line)) and m.group(4) == "0":
            answered[f"{m.group(1)}:{m.group(3)}"] = i
    for _i, key, verb, args in requests:
        if verb != "Write" or key not in answered:
            continue
        at = int(re.search(r"offset=(0x[0-9a-f]+)", args).group(1), 16)  # type: ignore[union-attr]
        n = int(re.search(r"count=(0x[0-9a-f]+)", args).group(1), 16)  # type: ignore[union-attr]
        if not (at <= offset and offset + count <= at + n):
            continue
        if "fua=1" in args:
            return True
        if any(v == "Flush" and j > answered[key] and k in answered
               for j, k, v, _a in requests):
            return True
    return False


@pytest.fixture(params=["fua", "no-fua"])
def logged_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    disk, log, sock = tmp_path / "disk.raw", tmp_path / "nbdkit.log", tmp_path / "nbd.sock"
    disk.write_bytes(bytes(1 << 20))
    if request.param == "fua":
        plugin = ["file", str(disk)]
    else:  # a server that advertises no FUA: nbdkit's eval plugin over the same file
        plugin = ["eval", "get_size=echo 1048576", "can_write=exit 0", "can_flush=exit 0",
                  "can_fua=echo none", f"flush=sync {disk}",
                  f"pread=dd if={disk} skip=$4 count=$3 iflag=skip_bytes,count_bytes "
                  "status=none",
                  f"pwrite=dd of={disk} seek=$4 conv=notrunc oflag=seek_bytes status=none"]
    server = Server(["nbdkit", "-f", "-U", str(sock), "-e", "exp", "--filter=log", *plugin,
                     f"logfile={log}"], sock).start()
    yield server.uri(), log
    server.kill()


@needs_nbdkit
@pytest.mark.asyncio
async def test_nbd_fua_write_and_flush_are_durable_on_the_server(
        logged_server: tuple[str, Path]) -> None:
    uri, log = logged_server
    t = NbdTarget(uri)
    q = await _attached(t)
    try:
        await t.write(64 * K, aligned(os.urandom(8 * K)))
        assert not told_durable(log.read_text().splitlines(), 64 * K, 8 * K), \
            "the check has no teeth: a plain write counted as durable"
        await t.write(128 * K, aligned(os.urandom(8 * K)), fua=True)
        assert told_durable(log.read_text().splitlines(), 128 * K, 8 * K), log.read_text()
        await t.flush()
        assert told_durable(log.read_text().splitlines(), 64 * K, 8 * K), log.read_text()
    finally:
        await teardown_queue(t, q)


# ------------------------------------------------------------------ nvme --
# The controller is the server: a write is durable when its cache is write-through,
# when the write carried FUA, or when a FLUSH was issued after it completed.

def nvme_told_durable(cmds: list[dict[str, int]], write_back: bool, at: int) -> bool:
    """Is the write command at index `at` of the completed commands durable now?"""
    write = cmds[at]
    assert write["opcode"] == nvme.OP_WRITE
    return not write_back or bool(write["cdw12"] & nvme.FUA) or \
        any(c["opcode"] == nvme.OP_FLUSH for c in cmds[at + 1:])


@pytest.mark.parametrize(("cache", "fua"), [("write back", 1), ("write back", 0),
                                             ("write through", 0)])
@pytest.mark.asyncio
async def test_nvme_fua_write_and_flush_are_durable_on_the_controller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str, fua: int) -> None:
    target, ring = served_by(tmp_path, monkeypatch)
    target.geometry = nvme.geometry_from_sysfs(fake_block(tmp_path / "sys", write_cache=cache,
                                                          fua=fua))
    write_back = cache == "write back"
    cmds = lambda: [c for _f, c in ring.cmds]  # noqa: E731 - completed, in order

    await target.write(0, memoryview(bytearray(4096)))
    assert nvme_told_durable(cmds(), write_back, 0) is not write_back, \
        "the check has no teeth: a plain write to a write-back cache counted as durable"
    await target.write(8192, memoryview(bytearray(4096)), fua=True)
    assert nvme_told_durable(cmds(), write_back, 1)
    await target.flush()
    assert nvme_told_durable(cmds(), write_back, 0)


# ------------------------------------------------------------------- rbd --
# librbd is the server's client: a write is durable once librbd answered a flush
# that was asked after the write was answered (with rbd_cache, the default, librbd
# acknowledges writes from its cache).

RBD_IMAGE_SIZE = 16 << 20  # what the rbd_image fixture creates

needs_ceph = pytest.mark.skipif(
    importlib.util.find_spec("aioublk.targets._rbd") is None
    or shutil.which("ceph-mon") is None or shutil.which("ceph-osd") is None,
    reason="needs librbd's binding (librbd-dev) and Ceph (scripts/setup installs them)")


@needs_ceph
@pytest.mark.asyncio
async def test_rbd_fua_write_and_flush_reach_librbd_in_order(
        attached: RbdTarget) -> None:  # noqa: F811 - the fixture imported above
    t = attached
    ops: list[dict[str, Any]] = []  # {"kind", "asked", "answered"} on one clock
    clock = itertools.count()
    submit = t._submit

    def recording(issue: Any, finish: Any) -> None:
        op = {"kind": next(n for n in issue.__code__.co_names if n.startswith("arbd_")),
              "asked": next(clock), "answered": None}
        ops.append(op)

        def answered(res: int) -> None:
            op["answered"] = next(clock)
            finish(res)
        submit(issue, answered)

    def flushed_after(i: int) -> bool:
        done = ops[i]["answered"]
        return done is not None and any(
            o["kind"] == "arbd_flush" and o["answered"] is not None and o["asked"] > done
            for o in ops)

    t._submit = recording  # type: ignore[method-assign]
    await t.write(0, aligned(os.urandom(8 * K)))
    assert ops[-1]["kind"] == "arbd_write" and not flushed_after(len(ops) - 1), \
        "the check has no teeth: a plain write counted as flushed"
    await t.write(64 * K, aligned(os.urandom(8 * K)), fua=True)
    assert ops[1]["kind"] == "arbd_write" and flushed_after(1), ops
    await t.flush()
    assert flushed_after(0), ops
