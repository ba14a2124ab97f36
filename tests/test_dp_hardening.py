"""The C data plane's edges, on a real ring but without a device: the test
plays the kernel. It writes a queue's descriptors, "fetches" a tag by
posting a NOP whose user_data is that tag's fetch, and sends the commands
C queues for /dev/ublkcN to a pipe, which refuses each one (EOPNOTSUPP): a
request's commit comes back as a record of its tag with that result."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from aioublk import uapi
from aioublk._uring import ffi, lib
from aioublk.dataplane import EV_IO, Linear, decode
from aioublk.options import DeviceConfig, UblkError


def ud_of(kind: int, local: int, tag: int, aux: int = 0) -> int:
    """A data-plane user_data, laid out as _dataplane.c's DP_UD."""
    return (1 << 63) | (kind << 56) | (local << 40) | (tag << 16) | aux


class Plane:
    """A data plane serving queue 0 (``depth`` tags of ``max_io`` bytes)
    from ``backing``, its commands going to a pipe."""

    def __init__(self, ring: Any, backing: int, *, depth: int = 4, max_io: int = 4096,
                 mode: int = 0, batch: int = 0) -> None:
        self.ring = ring
        self.pipe = os.pipe()
        self.events: list[tuple[int, int, int, int]] = []  # kind, tag, aux, res
        self.descs = bytearray(depth * uapi.IO_DESC.size)
        self.bufs = mmap.mmap(-1, depth * max_io)
        self.dp = ring.data_plane({
            "char_fd": self.pipe[1], "batch": batch, "mode": mode, "nr_queues": 1,
            "depth": depth, "max_io": max_io,
            "op_fetch_req": uapi.IoCmd.FETCH_REQ,
            "op_commit_and_fetch": uapi.IoCmd.COMMIT_AND_FETCH_REQ,
            "op_register_buf": uapi.IoCmd.REGISTER_IO_BUF,
            "op_unregister_buf": uapi.IoCmd.UNREGISTER_IO_BUF,
            "op_commit_io_cmds": uapi.IoCmd.COMMIT_IO_CMDS,
            "fetch_buf_bytes": 2 * depth, "fetch_buf_entries": 8,
        }, 1, self._on_event)
        self._views = (ffi.from_buffer(self.descs), ffi.from_buffer(self.bufs))
        lib.aur_dp_queue(self.dp.c, 0, 0, self._views[0], self._views[1], self.dp.counts)
        for tag in range(depth):
            lib.aur_dp_buf_index(self.dp.c, 0, tag, tag)
        self.dp.set_map(Linear(backing))

    def _on_event(self, ud: int, res: int, flags: int) -> None:
        kind, _local, tag, aux = decode(ud)
        self.events.append((kind, tag, aux, res))

    def fetch(self, tag: int, op: int, sectors: int, start: int = 0) -> None:
        """The kernel hands ``tag`` a request (per-I/O path)."""
        uapi.IO_DESC.pack_into(self.descs, tag * uapi.IO_DESC.size, op, sectors, start, 0)
        assert lib.aur_prep(self.ring.raw, lib.IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0,
                            ud_of(EV_IO, 0, tag)) == 0
        self.ring.submit_now()

    async def wait_for(self, pred: Any, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not pred():
            assert loop.time() < deadline, f"timed out; records: {self.events}"
            lib.aur_wait(self.ring.raw, 20)
            self.ring.reap_now()
            await asyncio.sleep(0)

    def close(self) -> None:
        self.ring.close()
        for v in self._views:
            ffi.release(v)
        self.bufs.close()
        for fd in self.pipe:
            os.close(fd)


@pytest.fixture
def backing(tmp_path: Path) -> Any:
    fd = os.open(tmp_path / "backing", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 64 << 20)
    yield fd
    os.close(fd)


# -- defect: the user_data aux field (a piece's sectors) spilling into the tag --

@pytest.mark.parametrize("size", [0, 512, 32 << 20, 64 << 20])
def test_max_io_size_the_encoding_cannot_hold_is_refused_in_one_line(size: int) -> None:
    """A piece's length rides in 16 bits of user_data as sectors: a larger
    request would complete the wrong tag, so such sizes are refused up front."""
    with pytest.raises(UblkError, match="max_io_size") as e:
        DeviceConfig(max_io_size=size).validate()
    assert "\n" not in str(e.value)


def test_the_largest_max_io_size_is_accepted() -> None:
    from aioublk.options import MAX_IO_SIZE

    assert MAX_IO_SIZE >> 9 <= 0xFFFF and MAX_IO_SIZE % mmap.PAGESIZE == 0
    DeviceConfig(max_io_size=MAX_IO_SIZE).validate()


@pytest.mark.asyncio
async def test_the_data_plane_refuses_a_max_io_it_cannot_encode(backing: int) -> None:
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        with pytest.raises(OSError) as e:
            Plane(ring, backing, max_io=32 << 20)
        assert e.value.errno == errno.EINVAL
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_the_largest_request_commits_its_own_tag(backing: int) -> None:
    """A read of the largest size (its sectors fill the 16-bit field) is
    served by C and committed on its own tag, counted in full."""
    from aioublk.options import MAX_IO_SIZE
    from aioublk.ring import Ring

    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=MAX_IO_SIZE)
    try:
        plane.fetch(0, uapi.Op.READ, MAX_IO_SIZE >> 9)
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 0, 0, -errno.EOPNOTSUPP)]  # the commit, on tag 0
        c = plane.dp.counts[0]
        assert (c.ios, c.bytes, c.errors) == (1, MAX_IO_SIZE, 0)
    finally:
        plane.close()


@pytest.mark.asyncio
async def test_a_request_longer_than_max_io_is_left_to_python(backing: int) -> None:
    """The kernel never sends more than max_io; if a descriptor says so
    anyway, C does not serve it (its buffer is max_io, its length would not
    fit the field): the request goes to Python as fetched."""
    from aioublk.ring import Ring

    ring = Ring(16)
    plane = Plane(ring, backing, depth=2, max_io=4096)
    try:
        plane.fetch(1, uapi.Op.READ, 65536)  # 32 MiB: 1 << 16 sectors
        await plane.wait_for(lambda: plane.events)
        assert plane.events == [(EV_IO, 1, 0, 0)]
        assert plane.dp.inflight == 0
    finally:
        plane.close()
