"""The UBLK_F_BATCH_IO encoding C builds (PREP, COMMIT) and the batch driver's
bookkeeping, without a kernel."""

from __future__ import annotations

import asyncio
import errno
import struct
from typing import Any

import pytest

from aioublk._uring import ffi, lib
from aioublk.kernel import uapi

_ADDR = struct.Struct("=Q")


def _elems(flags: int, elems: list[tuple[int, int, int, int, int]]) -> bytes:
    """PREP/COMMIT elements (tag, buf_index, result, buffer address, zone LBA)
    in the kernel's layout: the header, then what ``flags`` ask for."""
    out = b""
    for tag, index, res, addr, lba in elems:
        out += uapi.ELEM_HEADER.pack(tag, index, res)
        if flags & uapi.BatchFlag.HAS_BUF_ADDR:
            out += _ADDR.pack(addr)
        if flags & uapi.BatchFlag.HAS_ZONE_LBA:
            out += _ADDR.pack(lba)
    return out


def _elem_bytes(flags: int) -> int:
    return len(_elems(flags, [(0, 0, 0, 0, 0)]))


def test_elem_sizes_follow_flags() -> None:
    f = uapi.BatchFlag
    assert _elem_bytes(0) == uapi.ELEM_HEADER.size == 8
    assert _elem_bytes(f.HAS_BUF_ADDR) == 16
    assert _elem_bytes(f.HAS_BUF_ADDR | f.HAS_ZONE_LBA) == 24
    assert _elem_bytes(f.HAS_BUF_ADDR | f.HAS_ZONE_LBA) <= lib.AUR_DP_MAX_ELEM_BYTES


# -- worker layout and option resolution ------------------------------------

def test_layout_one_worker_per_queue_by_default() -> None:
    from aioublk.queue.options import layout

    plan = layout(2, 4, 2, batch=False, per_io_tasks=False)
    assert plan == [[(0, [0, 1, 2, 3])], [(1, [0, 1, 2, 3])]]


def test_placement_pins_one_queue_workers_as_kublk_does() -> None:
    from aioublk.queue.options import layout, placement

    plan = layout(2, 4, 2, batch=False, per_io_tasks=False)
    # one CPU of each queue's own mask; the device id picks which
    assert placement(plan, [[0, 1], [2, 3]], {0, 1, 2, 3}, dev_id=0) == [0, 2]
    assert placement(plan, [[0, 1], [2, 3]], {0, 1, 2, 3}, dev_id=1) == [1, 3]
    # only CPUs this process may run on count (taskset, a cpuset)
    assert placement(plan, [[0, 1], [2, 3]], {1, 2}, dev_id=0) == [1, 2]
    assert placement(plan, [[0, 1], [2, 3]], {1}, dev_id=0) == [1, None]
    # the driver gave no masks: nobody is pinned
    assert placement(plan, [], {0, 1}, dev_id=0) == [None, None]


def test_placement_pins_nothing_for_a_target_that_says_not_to() -> None:
    from aioublk.queue.options import layout, placement

    plan = layout(2, 4, 2, batch=False, per_io_tasks=False)
    assert placement(plan, [[0, 1], [2, 3]], {0, 1, 2, 3}, dev_id=0) == [0, 2]
    assert placement(plan, [[0, 1], [2, 3]], {0, 1, 2, 3}, dev_id=0, pin=False) == [None, None]


def test_placement_leaves_shared_workers_to_the_scheduler() -> None:
    from aioublk.queue.options import layout, placement

    cpus = [[0], [1], [2], [3]]
    one_loop = layout(4, 2, 1, batch=True, per_io_tasks=False)  # one worker, 4 queues
    assert placement(one_loop, cpus, {0, 1, 2, 3}, dev_id=0) == [None]
    four_loops = layout(1, 2, 4, batch=True, per_io_tasks=False)  # 4 workers, 1 queue
    assert placement(four_loops, cpus, {0, 1, 2, 3}, dev_id=0) == [None] * 4
    spread = layout(2, 4, 2, batch=False, per_io_tasks=True)  # tags of both queues each
    assert placement(spread, cpus, {0, 1, 2, 3}, dev_id=0) == [None, None]


def test_layout_batch_maps_n_workers_onto_m_queues() -> None:
    from aioublk.queue.options import layout

    one_loop = layout(4, 2, 1, batch=True, per_io_tasks=False)
    assert [[q for q, _ in w] for w in one_loop] == [[0, 1, 2, 3]]
    four_loops = layout(1, 2, 4, batch=True, per_io_tasks=False)
    assert [[q for q, _ in w] for w in four_loops] == [[0]] * 4
    two_four = layout(4, 2, 2, batch=True, per_io_tasks=False)
    assert [[q for q, _ in w] for w in two_four] == [[0, 2], [1, 3]]


def test_layout_per_io_tasks_deals_every_tag_once() -> None:
    from aioublk.queue.options import layout

    plan = layout(2, 3, 4, batch=False, per_io_tasks=True)
    pairs = [(q, t) for w in plan for q, tags in w for t in tags]
    assert sorted(pairs) == [(q, t) for q in range(2) for t in range(3)]
    assert plan[0] == [(0, [0]), (1, [1])]  # (0,0) and the 5th pair, (1,1)


ALL = int(uapi.Feature.CMD_IOCTL_ENCODE | uapi.Feature.BATCH_IO | uapi.Feature.USER_COPY
          | uapi.Feature.SUPPORT_ZERO_COPY | uapi.Feature.AUTO_BUF_REG
          | uapi.Feature.PER_IO_DAEMON)


def test_batch_is_the_default_where_the_kernel_has_it() -> None:
    from aioublk.queue.options import DeviceConfig

    assert DeviceConfig().resolve(ALL) == (True, uapi.Feature.BATCH_IO)
    assert DeviceConfig().resolve(ALL & ~uapi.Feature.BATCH_IO) == (False, 0)
    assert DeviceConfig(batch=False).resolve(ALL)[0] is False
    assert DeviceConfig(per_io_tasks=True, nthreads=2).resolve(ALL)[0] is False
    assert DeviceConfig(depth=1).resolve(ALL)[0] is False  # the kernel refuses depth 1


@pytest.mark.parametrize("kw,features,message", [
    ({"batch": True}, ALL & ~uapi.Feature.BATCH_IO, "lacks UBLK_F_BATCH_IO"),
    ({"batch": True, "depth": 1}, ALL, "queue depth of 2 or more"),
    ({"copy": "user_copy"}, ALL & ~uapi.Feature.USER_COPY, "UBLK_F_USER_COPY"),
    ({"nthreads": 3, "queues": 1, "batch": False}, ALL, "--nthreads 3 differs from -q 1"),
    ({"copy": "auto_zc", "queues": 1, "nthreads": 2}, ALL, "--auto_zc with batch"),
    ({"per_io_tasks": True, "nthreads": 2}, ALL & ~uapi.Feature.PER_IO_DAEMON,
     "UBLK_F_PER_IO_DAEMON"),
    ({"one_loop": True, "queues": 2, "batch": False}, ALL & ~uapi.Feature.PER_IO_DAEMON,
     "all 2 queues from one thread"),
])
def test_resolve_refuses_with_one_line(kw: dict[str, object], features: int,
                                       message: str) -> None:
    from aioublk.errors import UblkError
    from aioublk.queue.options import CopyMode, DeviceConfig

    if "copy" in kw:
        kw["copy"] = CopyMode(kw["copy"])
    cfg = DeviceConfig(**kw)
    cfg.validate()
    with pytest.raises(UblkError, match=message) as e:
        cfg.resolve(features)
    assert "\n" not in str(e.value)


def test_one_loop_targets_get_one_worker_on_either_path() -> None:
    """A target that keeps per-loop state (zoned, rbd) sees all queues on one loop:
    batch maps them N:1, the per-I/O path deals the tags to one daemon."""
    from aioublk.device import Device
    from aioublk.errors import UblkError
    from aioublk.queue.options import layout
    from aioublk.target import Geometry, Target

    class OneLoop(Target):
        one_loop = True
        geometry = Geometry(size=1 << 20)

    cfg = Device(OneLoop(), queues=4, depth=8).config
    assert cfg.one_loop and cfg.threads() == 1
    for batch in (True, False):
        spread = cfg.spread(batch)
        assert spread is not batch
        plan = layout(4, 8, cfg.threads(), batch=batch, per_io_tasks=spread)
        assert len(plan) == 1 and [q for q, _t in plan[0]] == [0, 1, 2, 3]
    with pytest.raises(UblkError, match="serves all queues from one thread"):
        Device(OneLoop(), queues=4, nthreads=2)


def test_auto_zc_fallback_adds_zero_copy_and_needs_auto_zc() -> None:
    from aioublk.errors import UblkError
    from aioublk.queue.options import CopyMode, DeviceConfig

    batch, flags = DeviceConfig(copy=CopyMode.AUTO_ZC, auto_zc_fallback=True).resolve(ALL)
    assert flags & uapi.Feature.SUPPORT_ZERO_COPY and flags & uapi.Feature.AUTO_BUF_REG
    with pytest.raises(UblkError, match="--auto_zc_fallback needs --auto_zc"):
        DeviceConfig(auto_zc_fallback=True).validate()


# -- the driver's bookkeeping, on a real ring but without a device ------------

class _Path:
    """A copy path that records what the driver starts (fast path and coroutine)."""

    arming = None
    debug = False

    def __init__(self, mode: Any = None) -> None:
        from aioublk.queue.options import CopyMode

        self.mode = mode or CopyMode.COPY
        self.started: list[int] = []

    def start(self, qm: object, tag: int, done: object) -> bool:
        self.started.append(tag)
        return False  # on to the coroutine path

    async def serve(self, qm: object, tag: int, index: int) -> int:
        return 4096


class _NoMap:
    c_idle = False  # (C waits poll_us, as for most targets)

    def map(self) -> None:
        return None


def _driver(ring: Any, path: _Path, batch: bool = True, char_fd: int = -1,
            prep: bool = False, **cfg: Any) -> Any:
    """A driver serving queue 0 (depth 8) of no device: its commands go to
    ``char_fd`` (nowhere, or /dev/null, which refuses every one), what it
    starts and commits is what the tests look at; ``prep``: it arms queue 0,
    ``cfg``: more of the device's options."""
    import mmap
    from types import SimpleNamespace

    import structlog

    from aioublk.batch import BatchDriver
    from aioublk.queue.driver import WorkerSpec
    from aioublk.queue.options import DeviceConfig
    from aioublk.queue.perio import PerIoDriver

    bufs = mmap.mmap(-1, 8 * 4096)
    qm = SimpleNamespace(q_id=0, descs=bytearray(8 * uapi.IO_DESC.size), bufs=bufs)
    worker = SimpleNamespace(
        cfg=DeviceConfig(depth=8, max_io_size=4096, **cfg), mode=path.mode, char_fd=char_fd,
        target=_NoMap(), spec=WorkerSpec(0, [(qm, list(range(8)))], {0} if prep else set()),
        log=structlog.get_logger("test"), device_ending=lambda: None, finished=lambda: None)
    return (BatchDriver if batch else PerIoDriver)(worker, ring, path)


def _deliver(driver: Any, tags: list[int]) -> None:
    """Fetched requests the data plane leaves to Python (no map)."""
    from aioublk.dataplane.plane import EV_TAG

    for tag in tags:
        driver.event(EV_TAG, 0, tag, 0, 0, 0)


def _pending(driver: Any) -> list[tuple[int, int]]:
    """(tag, result) of the elements C holds for queue 0's next commit."""
    out = bytearray(8 * 16)
    n = lib.aur_dp_pending(driver.dp.c, 0, ffi.from_buffer(out), len(out))
    size = _elem_bytes(uapi.BatchFlag.HAS_BUF_ADDR)
    return [uapi.ELEM_HEADER.unpack_from(out, i)[::2] for i in range(0, n, size)]


@pytest.mark.asyncio
async def test_tags_fetched_after_the_worker_began_stopping_are_not_started() -> None:
    """Once the worker is stopping (SIGTERM hand-over, detach), a tag a fetch
    still delivers is left to the kernel (reissued or failed when
    /dev/ublkcN closes), never served: the target's final write-back would
    otherwise run before a write it then acknowledges."""
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        path = _Path()
        driver = _driver(ring, path)
        _deliver(driver, [1, 2])
        assert path.started == [1, 2]
        driver.ring = _NoFlush(ring)
        await asyncio.sleep(0)  # the two requests run and are answered
        assert driver.inflight == 0 and _pending(driver) == [(1, 4096), (2, 4096)]
        lib_flush(driver)

        await driver.drain()  # the worker begins stopping
        _deliver(driver, [3, 4])
        await asyncio.sleep(0)
        assert path.started == [1, 2], "a tag was started after the worker began stopping"
        assert driver.inflight == 0 and _pending(driver) == []
    finally:
        ring.close()


class _NoFlush:
    """The driver's ring, without the end-of-turn flush: what the driver
    queued for the kernel stays in C, for the test to look at."""

    def __init__(self, ring: Any) -> None:
        self._ring = ring

    def request_flush(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)


def lib_flush(driver: Any) -> None:
    """Drop what C holds for the next commit (sent to char fd -1: refused)."""
    driver._commit()


@pytest.mark.asyncio
async def test_per_io_requests_arriving_after_the_worker_began_stopping_are_not_started(
        ) -> None:
    """The same on the per-I/O path (a detach after a failed QUIESCE_DEV):
    a request the kernel hands a re-armed tag once the worker is stopping
    is left to the kernel."""
    from aioublk.dataplane.plane import EV_IO
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        path = _Path()
        driver = _driver(ring, path, batch=False)
        driver.event(EV_IO, 0, 1, 0, uapi.IO_RES_OK, 0)
        await asyncio.sleep(0)
        assert path.started == [1] and driver.inflight == 0
        await driver.drain()
        driver.event(EV_IO, 0, 2, 0, uapi.IO_RES_OK, 0)
        await asyncio.sleep(0)
        assert path.started == [1], "a request was started after the worker began stopping"
        assert driver.inflight == 0
    finally:
        ring.close()


class _SlowPath(_Path):
    """Requests that finish only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def serve(self, qm: object, tag: int, index: int) -> int:
        await self.release.wait()
        return 4096


@pytest.mark.asyncio
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-io"])
async def test_a_request_that_outlives_the_drain_is_not_acknowledged(
        batch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """drain gives up on a request after a while; the target's final
    write-back (qcow2 metadata) runs next. A request that finishes after it
    must not be acknowledged, its data may not be in that write-back: it is
    left to the kernel (failed or reissued when /dev/ublkcN closes)."""
    from aioublk.dataplane.plane import EV_IO
    from aioublk.queue import driver as driver_mod
    from aioublk.ring import Ring

    monkeypatch.setattr(driver_mod, "DRAIN_SECONDS", 0.01)
    ring = Ring(16)
    try:
        path = _SlowPath()
        driver = _driver(ring, path, batch=batch)
        sent: list[int] = []
        driver.commit = lambda local, tag, res: sent.append(tag)
        if batch:
            _deliver(driver, [1])
        else:
            driver.event(EV_IO, 0, 1, 0, uapi.IO_RES_OK, 0)
        await asyncio.sleep(0)
        assert path.started == [1] and driver.inflight == 1
        await driver.drain()  # gives up on tag 1; the final write-back would run now
        path.release.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert driver.inflight == 0, "the request should have finished"
        assert sent == [], "a request finished after the drain was acknowledged"
    finally:
        ring.close()


#: copy mode, --auto_zc_fallback, zoned: the flags C must send
_MODES = {"copy": ("COPY", False, False, uapi.BatchFlag.HAS_BUF_ADDR),
          "auto_zc": ("AUTO_ZC", False, False, 0),
          "auto_zc_fallback": ("AUTO_ZC", True, False, uapi.BatchFlag.AUTO_BUF_REG_FALLBACK),
          "z": ("ZERO_COPY", False, False, 0),
          "zoned": ("USER_COPY", False, True, uapi.BatchFlag.HAS_ZONE_LBA)}


def _mode_driver(ring: Any, mode: str, **kw: Any) -> tuple[Any, int]:
    """A batch driver in ``mode`` (one of _MODES), and the flags it must send."""
    from aioublk.queue.options import CopyMode

    name, fallback, zoned, flags = _MODES[mode]
    driver = _driver(ring, _Path(CopyMode[name]), auto_zc_fallback=fallback, zoned=zoned, **kw)
    return driver, int(flags)


def _addr(driver: Any, tag: int) -> int:
    """The address of ``tag``'s buffer (what copy mode hands the kernel)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(driver.queues[0].bufs))) + tag * 4096


@pytest.mark.parametrize("mode", sorted(_MODES))
@pytest.mark.asyncio
async def test_c_prep_arms_every_tag_in_the_kernels_layout(mode: str) -> None:
    """PREP_IO_CMDS, as C builds it for ``arm``: the command area names the
    queue, the flags, every tag and the element size; each element is the
    tag, its buffer slot (auto_zc), result 0 and (copy) its buffer."""
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        driver, flags = _mode_driver(ring, mode)
        cmd, out = bytearray(uapi.BATCH_IO.size), bytearray(8 * lib.AUR_DP_MAX_ELEM_BYTES)
        n = lib.aur_dp_prep_io_cmds(driver.dp.c, 0, ffi.from_buffer(cmd), ffi.from_buffer(out),
                                    len(out))
        size = _elem_bytes(flags)
        assert uapi.BATCH_IO.unpack(cmd) == (0, flags, 8, size, 0, 0)
        zc = mode.startswith("auto_zc")
        assert bytes(out[:n]) == _elems(flags, [(t, t if zc else 0, 0, _addr(driver, t), 0)
                                                for t in range(8)])
        assert lib.aur_dp_prep_io_cmds(driver.dp.c, 0, ffi.from_buffer(cmd),
                                       ffi.from_buffer(out), n - 1) == -errno.ENOSPC
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_arm_sends_c_prep_and_reports_its_refusal() -> None:
    """``arm`` calls the target's arming hook for every tag, sends C's PREP
    (here to fd -1: refused) and fails with the kernel's answer."""
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        path = _Path()
        armed: list[tuple[int, int]] = []
        path.arming = lambda q, tag: armed.append((q, tag))  # type: ignore[assignment]
        driver = _driver(ring, path, prep=True)
        sent: list[tuple[int, bytes, bytes]] = []
        prep_cmd = ring.prep_cmd

        def spy(fd: int, op: int, cmd: bytes, **kw: Any) -> Any:
            sent.append((op, cmd, bytes(kw["keep"][:kw["length"]])))
            return prep_cmd(fd, op, cmd, **kw)
        ring.prep_cmd = spy  # type: ignore[method-assign]
        driver.arm()
        assert armed == [(0, t) for t in range(8)]
        flags = uapi.BatchFlag.HAS_BUF_ADDR
        assert sent == [(uapi.IoCmd.PREP_IO_CMDS, uapi.BATCH_IO.pack(0, flags, 8, 16, 0, 0),
                         _elems(flags, [(t, 0, 0, _addr(driver, t), 0) for t in range(8)]))]
        assert driver.failed == -errno.EBADF
    finally:
        ring.close()


@pytest.mark.parametrize("mode", sorted(_MODES))
@pytest.mark.asyncio
async def test_c_commit_elements_are_in_the_kernels_layout(mode: str) -> None:
    """The elements C packs for COMMIT_IO_CMDS are the answers in the
    kernel's layout, in order; a zone append's commit carries its sector."""
    from aioublk.ring import Ring

    ring = Ring(16)
    try:
        driver, flags = _mode_driver(ring, mode)
        driver.ring = _NoFlush(ring)
        answers = [(3, 4096), (0, -errno.EIO), (7, 512), (5, 0)]
        lbas = {7: 0x1234} if flags & uapi.BatchFlag.HAS_ZONE_LBA else {}
        for tag, lba in lbas.items():
            lib.aur_dp_zone_lba(driver.dp.c, 0, tag, lba)
        for tag, res in answers:
            driver.commit(0, tag, res)
        out = bytearray(8 * lib.AUR_DP_MAX_ELEM_BYTES)
        n = lib.aur_dp_pending(driver.dp.c, 0, ffi.from_buffer(out), len(out))
        zc = mode.startswith("auto_zc")
        assert bytes(out[:n]) == _elems(flags, [
            (tag, tag if zc else 0, res, _addr(driver, tag), lbas.get(tag, 0))
            for tag, res in answers])
        lib_flush(driver)
    finally:
        ring.close()


@pytest.mark.asyncio
async def test_refused_commit_elements_fail_their_requests_then_are_lost() -> None:
    """COMMIT_IO_CMDS stops at the first element it refuses: that request
    would wait forever, so C answers it again as failed (EIO), once, and
    sends the rest again; a refused failure is logged as lost. Here every
    command goes to /dev/null, which refuses each one (EOPNOTSUPP): each
    answer is refused, failed once, and then lost."""
    import os

    from structlog.testing import capture_logs

    from aioublk.ring import Ring

    fd = os.open("/dev/null", os.O_RDWR)
    ring = Ring(16)
    try:
        driver = _driver(ring, _Path(), char_fd=fd)
        with capture_logs() as logs:
            driver.commit(0, 3, 4096)
            driver.commit(0, 5, 1024)
            for _ in range(20):
                await asyncio.sleep(0.001)
        events = [(e["event"], e["tag"]) for e in logs]
        fails = "COMMIT_IO_CMDS refused a tag: its request fails"
        lost = "COMMIT_IO_CMDS refused a tag's failure: its request is lost"
        assert sorted(events) == sorted([(fails, 3), (fails, 5), (lost, 3), (lost, 5)]), events
        assert [e["result"] for e in logs if e["event"] == lost] == [-errno.EIO] * 2
        st = driver.stats[0]
        assert (st.ios, st.bytes, st.errors) == (2, 0, 2)
    finally:
        ring.close()
        os.close(fd)


@pytest.mark.parametrize("stranded", [0, 2])
@pytest.mark.asyncio
async def test_tag_buffers_outlive_a_ring_closed_with_data_plane_requests(stranded: int) -> None:
    """A data-plane read the closed ring left in the kernel may still write
    into its tag's buffer: the driver then keeps the buffers mapped for good
    (a later mapping at the same address would get those bytes), and lets
    them go otherwise. The descriptors are released either way (their
    mapping holds /dev/ublkcN open)."""
    from aioublk.ring import Ring

    ring = Ring(16)
    driver = _driver(ring, _Path())
    qm = driver.queues[0]
    ring.close()
    assert ring.dp_stranded == 0  # nothing was in flight here
    ring.dp_stranded = stranded  # as if the kernel still held two requests
    driver.close()
    if stranded:
        with pytest.raises(BufferError):
            qm.bufs.close()
    else:
        qm.bufs.close()
        assert qm.bufs.closed
