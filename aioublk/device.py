"""The control plane (/dev/ublk-control) and a Device that owns its queues.

Facts that shape this module:

- Every control command is a URING_CMD on a ring set up with SQE128; its
  payload is a 32-byte ``ublksrv_ctrl_cmd``. Commands that may sleep
  (ADD/START/STOP/DEL...) are punted by io_uring to a worker, so awaiting them
  never blocks the caller's loop.
- ``START_DEV`` waits until every queue has armed every tag, so it must never
  run on a queue's own loop: queues arm on their threads first, then the
  control loop starts the device.
- ``STOP_DEV`` deletes the disk (waiting for in-flight I/O, which the queues
  keep serving) and then aborts the armed commands (CQE -ENODEV): that is
  how a queue learns it is finished. ``DEL_DEV`` waits until /dev/ublkcN is
  closed.
- /dev/ublkcN appears (devtmpfs) shortly after ADD_DEV and opens exclusively;
  udev may hold it for a moment, so opening retries briefly.
"""

from __future__ import annotations

import asyncio
import errno
import os
from dataclasses import dataclass
from typing import Any

import structlog

from aioublk import uapi
from aioublk.queue import Queue
from aioublk.ring import Ring, buffer_address
from aioublk.target import Target

log = structlog.get_logger("aioublk.device")

CONTROL_PATH = "/dev/ublk-control"


class UblkError(Exception):
    """A failure explained in one line for the user."""


def _fail(what: str, res: int) -> UblkError:
    return UblkError(f"{what}: {os.strerror(-res)} (errno {-res})")


class Control:
    """/dev/ublk-control, driven from the caller's event loop."""

    def __init__(self) -> None:
        try:
            self.fd = os.open(CONTROL_PATH, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UblkError(
                f"{CONTROL_PATH} not found: the ublk_drv kernel module is not loaded "
                "(run 'modprobe ublk_drv' as root; kernel 6.4 or later)") from None
        except PermissionError:
            raise UblkError(f"{CONTROL_PATH}: permission denied (run as root)") from None
        self.ring = Ring(32, sqe128=True)

    async def cmd(self, op: int, dev_id: int, *, buf: bytearray | None = None,
                  data: int = 0, queue_id: int = uapi.CTRL_QUEUE_NONE) -> int:
        """Issue one control command; returns the raw result (negative errno)."""
        addr = buffer_address(buf) if buf is not None else 0
        length = len(buf) if buf is not None else 0
        payload = uapi.ctrl_cmd(dev_id & 0xFFFF_FFFF, queue_id=queue_id, length=length,
                                addr=addr, data=data)
        return await self.ring.uring_cmd(self.fd, op, payload, keep=buf)

    async def _checked(self, what: str, op: int, dev_id: int, **kw: Any) -> int:
        res = await self.cmd(op, dev_id, **kw)
        if res < 0:
            raise _fail(what, res)
        return res

    async def features(self) -> int:
        buf = bytearray(8)
        await self._checked("GET_FEATURES", uapi.Cmd.GET_FEATURES, 0, buf=buf)
        return int.from_bytes(buf, "little")

    async def add_dev(self, info: uapi.DevInfo) -> uapi.DevInfo:
        buf = bytearray(info.pack())
        res = await self.cmd(uapi.Cmd.ADD_DEV, info.dev_id, buf=buf)
        if res == -errno.EEXIST:
            raise UblkError(f"device id {info.dev_id} is already in use "
                            "(pick another -n, or delete it first)")
        if res < 0:
            raise _fail("ADD_DEV", res)
        return uapi.DevInfo.unpack(buf)

    async def get_info(self, dev_id: int) -> uapi.DevInfo:
        buf = bytearray(uapi.DevInfo.SIZE)
        res = await self.cmd(uapi.Cmd.GET_DEV_INFO, dev_id, buf=buf)
        if res == -errno.ENODEV:
            raise UblkError(f"device {dev_id} does not exist")
        if res < 0:
            raise _fail(f"GET_DEV_INFO of device {dev_id}", res)
        return uapi.DevInfo.unpack(buf)

    async def set_params(self, dev_id: int, params: uapi.Params) -> None:
        buf = bytearray(params.pack())
        await self._checked(f"SET_PARAMS of device {dev_id}", uapi.Cmd.SET_PARAMS, dev_id,
                            buf=buf)

    async def get_params(self, dev_id: int) -> uapi.Params:
        buf = bytearray(uapi.PARAMS_SIZE)
        buf[0:4] = uapi.PARAMS_SIZE.to_bytes(4, "little")
        await self._checked(f"GET_PARAMS of device {dev_id}", uapi.Cmd.GET_PARAMS, dev_id,
                            buf=buf)
        return uapi.Params.unpack(buf)

    async def queue_affinity(self, dev_id: int, q_id: int) -> list[int]:
        buf = bytearray(128)  # a cpu_set_t
        await self._checked("GET_QUEUE_AFFINITY", uapi.Cmd.GET_QUEUE_AFFINITY, dev_id,
                            buf=buf, data=q_id)
        mask = int.from_bytes(buf, "little")
        return [i for i in range(len(buf) * 8) if mask >> i & 1]

    async def start_dev(self, dev_id: int, pid: int) -> None:
        await self._checked(f"START_DEV of device {dev_id}", uapi.Cmd.START_DEV, dev_id,
                            data=pid)

    async def stop_dev(self, dev_id: int) -> int:
        return await self.cmd(uapi.Cmd.STOP_DEV, dev_id)

    async def del_dev(self, dev_id: int) -> int:
        return await self.cmd(uapi.Cmd.DEL_DEV, dev_id)

    def close(self) -> None:
        self.ring.close()
        os.close(self.fd)


@dataclass
class DeviceConfig:
    """What a device is created with (kublk's add options)."""

    dev_id: int = -1
    queues: int = 1
    depth: int = 128
    flags: int = 0
    max_io_size: int = 1 << 20

    #: device flags this version serves; the copy modes and batch I/O come next
    SUPPORTED_FLAGS = uapi.Feature.NO_AUTO_PART_SCAN

    def validate(self) -> None:
        unsupported = self.flags & ~self.SUPPORTED_FLAGS
        if unsupported:
            raise UblkError(f"aioublk does not serve {uapi.flag_list(unsupported)} yet: "
                            "leave it out")
        if not 1 <= self.depth <= uapi.MAX_QUEUE_DEPTH:
            raise UblkError(f"queue depth {self.depth} out of range: use 1..4096")
        if not 1 <= self.queues <= 32:
            raise UblkError(f"{self.queues} queues out of range: use 1..32")
        if self.dev_id < -1:
            raise UblkError(f"device id {self.dev_id} is invalid: use -1 (any) or >= 0")


async def _open_char(path: str, timeout: float = 3.0) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, PermissionError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.ENOENT, errno.EBUSY,
                                                          errno.EACCES):
                raise
            if loop.time() > deadline:
                raise UblkError(f"cannot open {path}: {e.strerror}") from None
            await asyncio.sleep(0.05)


class Device:
    """A ublk block device served by this process.

    ``async with Device(target) as dev:`` creates and starts it on the
    caller's loop (queues run on their own threads); leaving the block
    stops and deletes it.
    """

    def __init__(self, target: Target, config: DeviceConfig | None = None, **kw: Any) -> None:
        self.target = target
        self.config = config or DeviceConfig(**kw)
        self.config.validate()
        self.info: uapi.DevInfo | None = None
        self.queues: list[Queue] = []
        self._ctrl: Control | None = None
        self._char_fd = -1
        self._stopped = False

    @property
    def id(self) -> int:
        if self.info is None:
            raise RuntimeError("device not added yet")
        return self.info.dev_id

    @property
    def path(self) -> str:
        return f"/dev/ublkb{self.id}"

    @property
    def char_path(self) -> str:
        return f"/dev/ublkc{self.id}"

    async def start(self) -> None:
        cfg = self.config
        ctrl = self._ctrl = Control()
        try:
            features = await ctrl.features()
            if not features & uapi.Feature.CMD_IOCTL_ENCODE:
                raise UblkError("this ublk_drv lacks UBLK_F_CMD_IOCTL_ENCODE: "
                                "aioublk needs kernel 6.4 or later")
            missing = cfg.flags & ~features
            if missing:
                raise UblkError("this kernel's ublk_drv does not support "
                                f"{uapi.flag_list(missing)}")
            want = uapi.DevInfo(
                nr_hw_queues=cfg.queues, queue_depth=cfg.depth,
                max_io_buf_bytes=cfg.max_io_size,
                dev_id=uapi.DEV_ID_ANY if cfg.dev_id < 0 else cfg.dev_id, flags=cfg.flags)
            self.info = await ctrl.add_dev(want)
        except BaseException:
            ctrl.close()
            self._ctrl = None
            raise
        info = self.info
        self.log = log.bind(dev=info.dev_id)
        try:
            self._char_fd = await _open_char(self.char_path)
            params = self.target.geometry.params(info.max_io_buf_bytes)
            await ctrl.set_params(info.dev_id, params)
            qcfg = DeviceConfig(info.dev_id, info.nr_hw_queues, info.queue_depth, info.flags,
                                info.max_io_buf_bytes)
            self.queues = [Queue(qcfg, q, self._char_fd, self.target, info.max_io_buf_bytes)
                           for q in range(info.nr_hw_queues)]
            for q in self.queues:
                q.start()
            loop = asyncio.get_running_loop()
            for q in self.queues:
                await loop.run_in_executor(None, q.ready.wait)
                if q.error is not None:
                    raise UblkError(f"queue {q.q_id} failed to start: {q.error}")
            await ctrl.start_dev(info.dev_id, os.getpid())
            self.info = await ctrl.get_info(info.dev_id)
        except BaseException:
            await self._teardown(delete=True)
            raise
        self.log.info("device started", path=self.path, queues=info.nr_hw_queues,
                      depth=info.queue_depth, **self.target.describe())

    async def wait(self) -> None:
        """Until every queue has ended (the device was stopped or deleted)."""
        loop = asyncio.get_running_loop()
        for q in self.queues:
            await loop.run_in_executor(None, q.join)

    async def stop(self, delete: bool = True) -> None:
        """Stop serving (in-flight requests finish first) and delete the device."""
        if self._stopped:
            return
        await self._teardown(delete=delete)

    async def _teardown(self, delete: bool) -> None:
        self._stopped = True
        ctrl = self._ctrl
        if ctrl is None or self.info is None:
            return
        dev_id = self.info.dev_id
        res = await ctrl.stop_dev(dev_id)
        if res < 0 and res != -errno.ENODEV:
            log.warning("STOP_DEV failed", dev=dev_id, res=res)
        for q in self.queues:
            # a queue whose tags were never fetched has nothing to abort
            if not q.ready.is_set() and q.loop is not None:
                q.loop.call_soon_threadsafe(q.finished)
        await self.wait()
        if self._char_fd >= 0:
            os.close(self._char_fd)
            self._char_fd = -1
        if delete:
            res = await ctrl.del_dev(dev_id)
            if res < 0 and res != -errno.ENODEV:
                log.warning("DEL_DEV failed", dev=dev_id, res=res)
        ctrl.close()
        self._ctrl = None
        self.log.info("device stopped", deleted=delete)

    async def __aenter__(self) -> Device:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
