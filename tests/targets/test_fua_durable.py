"""A FUA write is durable when it completes, and a FLUSH makes every
completed write durable (host, through the Target API, no kernel).

The ring a target submits to is recorded: every write (with its bytes),
fallocate and fsync, when it was submitted and when it completed. Linux's
rule decides what a power cut at a given moment keeps: a write survives once
it completed and then either it was written with ``RWF_DSYNC`` or an
fsync/fdatasync of the same file was *submitted after* it completed and
completed itself. The image a power cut leaves at the moment the request
completes is the file as it was before, plus the writes that survived; it
must hold the request's data (qcow2: ``qemu-io`` reads it back from that
image, so the metadata that maps the data must have survived too, and
``qemu-img check`` finds no corruption).

nbd, rbd and nvme servers keep their own caches: for them the check is what the
server was told (tests/targets/test_fua_durable_servers.py).

Which targets this applies to is what they advertise (sysfs ``write_cache``
and ``fua``, checked in the guest by tests/targets/test_kernel_targets.py): every
write-back target must make a FLUSH durable; a target advertising FUA must
make a FUA write durable before it completes.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioublk._uring import ffi, lib
from aioublk.ring import Ring
from aioublk.target import Target
from aioublk.targets import LoopTarget, StripeTarget, zoned
from aioublk.targets.qcow2 import Qcow2Target
from aioublk.targets.zoned import ZonedTarget

K = 1024
M = K * K


@dataclass
class Op:
    """One recorded submission."""

    seq: int                      # submission order
    kind: str                     # "write", "fallocate", "fsync"
    fd: int
    offset: int = 0
    data: bytes = b""
    length: int = 0               # fallocate
    mode: int = 0                 # fallocate
    dsync: bool = False
    done: int | None = None       # completion order (None: still in flight)
    res: int | None = None


@dataclass
class Recorder:
    """Wraps one Ring's submissions; ``clock`` orders submissions and
    completions on one time line."""

    ring: Ring
    ops: list[Op] = field(default_factory=list)
    clock: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def _record(self, op: Op) -> Callable[[int], None]:
        self.ops.append(op)

        def done(res: int) -> None:
            op.done, op.res = self.tick(), res
        return done

    def install(self) -> None:
        ring = self.ring
        start_write, op_ = ring.start_write, ring._op

        def rec_start_write(fd: int, buf: Any, offset: int, handler: Any,
                            rw_flags: int = 0) -> None:
            done = self._record(Op(self.tick(), "write", fd, offset, bytes(buf),
                                   dsync=bool(rw_flags & os.RWF_DSYNC)))
            start_write(fd, buf, offset, _wrap(handler, done), rw_flags)

        def rec_op(opcode: int, fd: int, keep: Any = None, **kw: int) -> Any:
            op = None
            if opcode == lib.IORING_OP_WRITEV:
                _iov, views = keep
                op = Op(self.tick(), "write", fd, kw["offset"],
                        b"".join(bytes(ffi.buffer(v)) for v in views))
            elif opcode == lib.IORING_OP_WRITE_FIXED:
                op = Op(self.tick(), "write", fd, kw["offset"],
                        bytes(ffi.buffer(ffi.cast("char *", kw["addr"]), kw["length"])))
            elif opcode == lib.IORING_OP_FSYNC:
                op = Op(self.tick(), "fsync", fd)
            elif opcode == lib.IORING_OP_FALLOCATE:
                op = Op(self.tick(), "fallocate", fd, kw["offset"], length=kw["addr"],
                        mode=kw["length"])
            fut = op_(opcode, fd, keep, **kw)
            if op is not None:
                done = self._record(op)
                fut.add_done_callback(lambda f: done(f.result()))
            return fut

        ring.start_write = rec_start_write  # type: ignore[method-assign]
        ring._op = rec_op  # type: ignore[method-assign]

    def durable_at(self, when: int, fd: int) -> list[Op]:
        """The writes and fallocates to ``fd`` that a power cut at ``when``
        keeps, in completion order."""
        syncs = [o for o in self.ops if o.kind == "fsync" and o.fd == fd
                 and o.done is not None and o.done <= when and o.res == 0]
        kept = []
        for o in self.ops:
            if o.fd != fd or o.kind == "fsync" or o.done is None or o.done > when:
                continue
            if (o.res or 0) < 0:
                continue
            if (o.dsync and o.kind == "write") or any(s.seq > o.done for s in syncs):
                kept.append(o)
        return sorted(kept, key=lambda o: o.done or 0)


def _wrap(handler: Any, done: Callable[[int], None]) -> Any:
    if isinstance(handler, asyncio.Future):
        handler.add_done_callback(lambda f: done(f.result()))
        return handler

    def h(res: int, flags: int) -> None:
        done(res)
        handler(res, flags)
    return h


def crash_image(base: bytes, ops: list[Op]) -> bytes:
    """``base`` with ``ops`` applied: what the file holds after a power cut."""
    img = bytearray(base)
    for o in ops:
        if o.kind == "write":
            end = o.offset + len(o.data)
            if end > len(img):
                img.extend(bytes(end - len(img)))
            img[o.offset:end] = o.data
        elif o.mode & 0x02:  # FALLOC_FL_PUNCH_HOLE
            img[o.offset:o.offset + o.length] = bytes(min(o.length, len(img) - o.offset))
        elif not o.mode & 0x01 and o.offset + o.length > len(img):  # grows the file
            img.extend(bytes(o.offset + o.length - len(img)))
    return bytes(img)


@pytest.fixture
def recorder(ring: Ring) -> Iterator[Recorder]:
    rec = Recorder(ring)
    rec.install()
    yield rec


def aligned(data: bytes) -> memoryview:
    """A page-aligned buffer, as queues hand to targets (O_DIRECT needs it)."""
    m = memoryview(mmap.mmap(-1, len(data)))
    m[:] = data
    return m


async def completes_at(rec: Recorder, aw: Any) -> int:
    """Await a request; the time line's instant at which it completed."""
    await aw
    return rec.tick()


def assert_kept(rec: Recorder, when: int, files: dict[int, tuple[Path, bytes]],
                expect: dict[int, tuple[int, bytes]]) -> None:
    """A power cut at ``when``: each file (fd -> (path, bytes before)) holds
    the ``expect``-ed bytes (fd -> (offset, data))."""
    for fd, (offset, data) in expect.items():
        _path, base = files[fd]
        img = crash_image(base, rec.durable_at(when, fd))
        got = img[offset:offset + len(data)]
        assert got == data, (
            f"a power cut when the request completed loses its data on fd {fd} "
            f"(ops: {[(o.kind, o.offset, len(o.data), o.seq, o.done) for o in rec.ops]})")


# ------------------------------------------------------------------ loop --

def _loop(tmp_path: Path) -> tuple[LoopTarget, dict[int, tuple[Path, bytes]]]:
    path = tmp_path / "disk"
    path.write_bytes(bytes(M))
    t = LoopTarget(str(path))
    return t, {t.backing.fd: (path, path.read_bytes())}


@pytest.mark.asyncio
async def test_loop_fua_write_is_durable_when_it_completes(recorder: Recorder,
                                                           tmp_path: Path) -> None:
    t, files = _loop(tmp_path)
    try:
        data = os.urandom(8 * K)
        when = await completes_at(recorder, t.write(64 * K, aligned(data), fua=True))
        assert_kept(recorder, when, files, {t.backing.fd: (64 * K, data)})
    finally:
        t.close()


@pytest.mark.asyncio
async def test_the_recording_sees_a_write_that_is_not_durable(recorder: Recorder,
                                                              tmp_path: Path) -> None:
    """The check has teeth: a plain write (no FUA, no FLUSH) is not kept, and
    neither is a FUA write whose sync was issued before the write completed."""
    t, files = _loop(tmp_path)
    try:
        data = os.urandom(8 * K)
        when = await completes_at(recorder, t.write(64 * K, aligned(data)))
        with pytest.raises(AssertionError, match="loses its data"):
            assert_kept(recorder, when, files, {t.backing.fd: (64 * K, data)})

        async def sync_too_early(offset: int, buf: Any, fua: bool = False) -> None:
            await asyncio.gather(t.backing.write(buf, offset), t.backing.sync())
        data = os.urandom(8 * K)
        when = await completes_at(recorder, sync_too_early(128 * K, aligned(data), True))
        with pytest.raises(AssertionError, match="loses its data"):
            assert_kept(recorder, when, files, {t.backing.fd: (128 * K, data)})
    finally:
        t.close()


def _stripe(tmp_path: Path) -> tuple[StripeTarget, dict[int, tuple[Path, bytes]]]:
    paths = [tmp_path / f"s{i}" for i in range(2)]
    for p in paths:
        p.write_bytes(bytes(M))
    t = StripeTarget([str(p) for p in paths], chunk_size=4096)
    return t, {b.fd: (p, p.read_bytes()) for b, p in zip(t.files, paths, strict=True)}


@pytest.mark.asyncio
async def test_stripe_fua_write_is_durable_on_every_file(recorder: Recorder,
                                                         tmp_path: Path) -> None:
    """stripe advertises no FUA (the kernel sends write + FLUSH), but its
    write honours the flag anyway: both files' halves are kept."""
    t, files = _stripe(tmp_path)
    try:
        data = os.urandom(8 * K)  # chunk 0 in s0, chunk 1 in s1
        when = await completes_at(recorder, t.write(0, aligned(data), fua=True))
        a, b = (f.fd for f in t.files)
        assert_kept(recorder, when, files, {a: (0, data[:4 * K]), b: (0, data[4 * K:])})
    finally:
        t.close()


@pytest.mark.parametrize("target", ["loop", "stripe"])
@pytest.mark.asyncio
async def test_flush_makes_completed_writes_durable(recorder: Recorder, tmp_path: Path,
                                                    target: str) -> None:
    t: Target
    t, files = _loop(tmp_path) if target == "loop" else _stripe(tmp_path)
    try:
        data = os.urandom(8 * K)
        await t.write(0, aligned(data))
        when = await completes_at(recorder, t.flush())
        expect = {fd: (0, data) for fd in files} if target == "loop" else dict(
            zip(files, [(0, data[:4 * K]), (0, data[4 * K:])], strict=True))
        assert_kept(recorder, when, files, expect)
    finally:
        t.close()


# ----------------------------------------------------------------- zoned --

def _record_pwrites(rec: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zoned target writes its zone state with a plain, synchronous pwrite:
    record those too (complete when the call returns)."""
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        op = Op(rec.tick(), "write", fd, offset, bytes(data))
        rec.ops.append(op)
        n = real(fd, data, offset)
        op.done, op.res = rec.tick(), n
        return n
    monkeypatch.setattr(zoned.os, "pwrite", pwrite)


@pytest.mark.parametrize("how", ["fua", "flush"])
@pytest.mark.asyncio
async def test_zoned_write_and_its_write_pointer_are_durable(
        recorder: Recorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A zone's data without its write pointer is lost to the file system above it
    (the pointer says the zone is empty): both must survive a power cut at the
    moment a FUA write, or the FLUSH after a write, completes."""
    path = tmp_path / "zoned"
    t = ZonedTarget(str(path), size=4 * M, zone_size=M)
    state = Path(t.state_path)
    try:
        files = {t.backing.fd: (path, path.read_bytes()),  # type: ignore[union-attr]
                 t.state_fd: (state, state.read_bytes())}
        _record_pwrites(recorder, monkeypatch)
        data = os.urandom(8 * K)
        if how == "fua":
            when = await completes_at(recorder, t.write(M, aligned(data), fua=True))
        else:
            await t.write(M, aligned(data))
            when = await completes_at(recorder, t.flush())
        zone = t.table.zones[1]
        assert zone.wp == (M + 8 * K) >> 9
        entry = zoned._ENTRY.pack(zone.cond, zone.wp)
        assert_kept(recorder, when, files, {
            t.backing.fd: (M, data),  # type: ignore[union-attr]
            t.state_fd: (zoned._HEADER_BYTES + zoned._ENTRY.size, entry)})
    finally:
        t.close()


# ----------------------------------------------------------------- qcow2 --

def _qemu(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60)


def _check_crash_image(path: Path, crash: bytes, offset: int, byte: int) -> None:
    """QEMU finds no corruption in the crash image and reads ``byte``s back
    from the 4 KiB at ``offset``."""
    out = path.with_name("crash.qcow2")
    out.write_bytes(crash)
    check = _qemu("qemu-img", "check", "--output=json", out)
    report = json.loads(check.stdout or "{}")
    assert report.get("corruptions", 0) == 0 and check.returncode in (0, 3), \
        f"qemu-img check of the power-cut image: {check.stdout}{check.stderr}"
    read = _qemu("qemu-io", "-r", "-f", "qcow2", "-c", f"read -P {byte:#x} {offset} 4k", out)
    assert read.returncode == 0 and "failed" not in read.stdout, (
        "a power cut when the FUA write completed loses it (the data, or the "
        f"L2/L1/refcount update that maps it, was not durable): {read.stdout}{read.stderr}")


@pytest.mark.parametrize("where", ["allocating", "allocated", "new_l2"])
@pytest.mark.asyncio
async def test_qcow2_fua_write_is_durable_with_its_mapping(recorder: Recorder,
                                                           tmp_path: Path, where: str) -> None:
    """qcow2 advertises FUA: a FUA write that allocates a cluster (and an L2
    table, for ``new_l2``) must leave data *and* the metadata that maps it
    durable when it completes."""
    path = tmp_path / "img.qcow2"
    r = _qemu("qemu-img", "create", "-q", "-f", "qcow2", path, "4G")
    assert r.returncode == 0, r.stderr
    r = _qemu("qemu-io", "-f", "qcow2", "-c", "write -q -P 0x11 0 64k", path)
    assert r.returncode == 0, r.stderr
    offset = {"allocating": 256 * K, "allocated": 8 * K, "new_l2": 2 << 30}[where]
    t = Qcow2Target(str(path))
    try:
        await t.flush()  # whatever open cached is on disk: the base
        base = path.read_bytes()
        when = await completes_at(recorder, t.write(offset, aligned(b"\x5c" * 4 * K), fua=True))
        crash = crash_image(base, recorder.durable_at(when, t.image.file.fd))
        _check_crash_image(path, crash, offset, 0x5C)
    finally:
        await t.drain()

