"""/dev/ublk-control: the control commands, each a URING_CMD on a small
SQE128 ring on the caller's loop.

- Commands that may sleep (ADD/START/STOP/DEL...) are punted by io_uring to
  a worker, so awaiting them never blocks the caller's loop.
- ADD_DEV, START_DEV and END_USER_RECOVERY are awaited with a time limit: a
  driver that never answers costs one line, not a hung server.
- The kernel checks CAP_SYS_ADMIN, not the uid, for privileged commands.
- ``Control(blocking=True)`` waits for each answer on the spot instead, with
  no event loop: ``list``, ``del`` and ``udev owner`` import neither asyncio
  nor the queue's Ring (``run_now`` drives its coroutines).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from aioublk._uring import ffi, lib
from aioublk.errors import UblkError
from aioublk.kernel import uapi

if TYPE_CHECKING:
    from aioublk.ring import Ring

T = TypeVar("T")

CONTROL_PATH = "/dev/ublk-control"

def state_name(state: int) -> str:
    try:
        return uapi.State(state).name
    except ValueError:
        return "UNKNOWN"


#: control commands that name no existing device
_DEVICELESS = (uapi.Cmd.ADD_DEV, uapi.Cmd.GET_FEATURES)
#: CAP_SYS_ADMIN's bit in /proc's capability masks
_CAP_SYS_ADMIN = 21
#: seconds ADD_DEV, START_DEV and END_USER_RECOVERY may take before the
#: driver is deemed stuck (START_DEV waits for the queues, armed by then,
#: and for the disk's partition scan, which they serve)
CTRL_TIMEOUT = 120.0


def char_path(dev_id: int) -> str:
    return f"/dev/ublkc{dev_id}"


def has_cap_sys_admin() -> bool:
    """Whether the kernel treats us as privileged: it checks CAP_SYS_ADMIN,
    not the uid, when a device is added or a privileged one is controlled."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def command_failed(what: str, res: int) -> UblkError:
    return UblkError(f"{what}: {os.strerror(-res)} (errno {-res})")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends: a blocking Control's
    commands (whose ring answers before ``uring_cmd`` returns)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a blocking Control's command waited for an event loop")


class _WaitingRing:
    """The control ring of a ``Control(blocking=True)``: each command is
    submitted and its answer waited for before ``uring_cmd`` returns."""

    def __init__(self, entries: int) -> None:
        self._r = ffi.new("struct aur *")
        ret = lib.aur_init(self._r, entries, 0, lib.IORING_SETUP_SQE128)
        if ret < 0:
            raise OSError(-ret, f"io_uring setup failed: {os.strerror(-ret)}")
        self._cqe = ffi.new("uint8_t[16]")

    async def uring_cmd(self, fd: int, cmd_op: int, cmd: bytes, *, keep: Any = None) -> int:
        ret = lib.aur_prep_cmd(self._r, fd, cmd_op, cmd, len(cmd), 0, 0, 0, 0, 0, 1)
        if ret >= 0:
            ret = lib.aur_submit(self._r)
        if ret < 0:
            raise OSError(-ret, f"io_uring_enter failed: {os.strerror(-ret)}")
        while not lib.aur_reap(self._r, self._cqe, 1):
            ret = lib.aur_wait(self._r, int(CTRL_TIMEOUT * 1000))
            if ret == -errno.ETIME:
                # (the command stays in the kernel with ``keep``: never freed)
                _STRANDED.append(keep)
                raise UblkError(f"control command 0x{cmd_op:x}: no answer from ublk_drv in "
                                f"{CTRL_TIMEOUT:g} s (is the kernel stuck? see dmesg)")
            if ret < 0 and ret != -errno.EINTR:
                raise OSError(-ret, f"io_uring wait failed: {os.strerror(-ret)}")
        return int.from_bytes(ffi.buffer(self._cqe)[8:12], "little", signed=True)

    def close(self) -> None:
        lib.aur_exit(self._r)


#: buffers of commands a waiting ring gave up on: the kernel may still write them
_STRANDED: list[Any] = []


class Control:
    """/dev/ublk-control, driven from the caller's event loop, or (with
    ``blocking``) answered on the spot for a command line without one."""

    def __init__(self, *, blocking: bool = False) -> None:
        try:
            self.fd = os.open(CONTROL_PATH, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UblkError(
                f"{CONTROL_PATH} not found: the ublk_drv kernel module is not loaded "
                "(run 'modprobe ublk_drv' as root; kernel 6.4 or later)") from None
        except PermissionError:
            raise UblkError(f"{CONTROL_PATH}: permission denied: run as root, or install "
                            "the udev rule for unprivileged devices (aioublk udev rules)") \
                from None
        if blocking:
            self.ring: Ring | _WaitingRing = _WaitingRing(8)
        else:
            from aioublk.ring import Ring

            self.ring = Ring(32, sqe128=True)
        self.blocking = blocking
        self.privileged = has_cap_sys_admin()
        #: devices whose commands must carry their char path: unprivileged ones
        #: (the kernel checks the caller's access to that node instead of
        #: CAP_SYS_ADMIN), learnt when added or when a plain command is refused
        self._unprivileged: set[int] = set()

    async def cmd(self, op: int, dev_id: int, *, buf: bytearray | None = None,
                  data: int = 0, queue_id: int = uapi.CTRL_QUEUE_NONE) -> int:
        """Issue one control command; returns the raw result (negative errno).

        A caller without CAP_SYS_ADMIN can only reach unprivileged devices, so
        it always names the char device. Root names it only for a device
        known to be unprivileged: to a privileged device the path would be
        read as the payload. Root's plain command to an unprivileged device
        fails with EINVAL (no path), so that answer is checked and retried."""
        if not 0 <= dev_id < uapi.MAX_DEV_ID and not (op == uapi.Cmd.ADD_DEV
                                                  and dev_id == uapi.DEV_ID_ANY):
            # (sent as a u32: a larger id would name another device)
            raise UblkError(f"device id {dev_id} is out of range: use 0..{uapi.MAX_DEV_ID - 1}")
        if op in _DEVICELESS:
            return await self._send(op, dev_id, buf, data, queue_id, with_path=False)
        if not self.privileged or dev_id in self._unprivileged:
            return await self._send(op, dev_id, buf, data, queue_id, with_path=True)
        res = await self._send(op, dev_id, buf, data, queue_id, with_path=False)
        if res == -errno.EINVAL and await self._is_unprivileged(dev_id):
            self._unprivileged.add(dev_id)
            res = await self._send(op, dev_id, buf, data, queue_id, with_path=True)
        return res

    async def _send(self, op: int, dev_id: int, buf: bytearray | None, data: int,
                    queue_id: int, *, with_path: bool) -> int:
        if not with_path:
            return await self._raw(op, dev_id, buf, data, queue_id, 0)
        path = char_path(dev_id).encode()
        full = bytearray(path) + (buf or b"")
        res = await self._raw(op, dev_id, full, data, queue_id, len(path))
        if buf is not None:
            buf[:] = full[len(path):]  # the kernel wrote its reply after the path
        return res

    async def _raw(self, op: int, dev_id: int, buf: bytearray | None, data: int,
                   queue_id: int, dev_path_len: int) -> int:
        addr = int(ffi.cast("uintptr_t", ffi.from_buffer(buf))) if buf is not None else 0
        length = len(buf) if buf is not None else 0
        payload = uapi.ctrl_cmd(dev_id, queue_id=queue_id, length=length,
                                addr=addr, data=data, dev_path_len=dev_path_len)
        return await self.ring.uring_cmd(self.fd, op, payload, keep=buf)

    async def _is_unprivileged(self, dev_id: int) -> bool:
        try:
            return bool((await self.get_info2(dev_id)).flags & uapi.Feature.UNPRIVILEGED_DEV)
        except UblkError:
            return False

    async def get_info2(self, dev_id: int) -> uapi.DevInfo:
        """GET_DEV_INFO2, which takes the char path whatever the device is:
        how root learns whether a device is unprivileged, and its owner."""
        buf = bytearray(uapi.DEV_INFO_SIZE)
        res = await self._send(uapi.Cmd.GET_DEV_INFO2, dev_id, buf, 0, uapi.CTRL_QUEUE_NONE,
                               with_path=True)
        if res < 0:
            raise command_failed(f"GET_DEV_INFO2 of device {dev_id}", res)
        return uapi.DevInfo.unpack(buf)

    async def _bounded(self, what: str, op: int, dev_id: int, **kw: Any) -> int:
        """A command that could wait for ever on a stuck driver, within
        ``CTRL_TIMEOUT`` (its buffer stays with the ring if it ever answers)."""
        if self.blocking:  # (its ring waits that long)
            return await self.cmd(op, dev_id, **kw)
        import asyncio

        try:
            return await asyncio.wait_for(self.cmd(op, dev_id, **kw), CTRL_TIMEOUT)
        except TimeoutError:
            raise UblkError(f"{what}: no answer from ublk_drv in {CTRL_TIMEOUT:g} s (is the "
                            "kernel stuck? see dmesg)") from None

    async def _checked(self, what: str, op: int, dev_id: int, **kw: Any) -> int:
        res = await self.cmd(op, dev_id, **kw)
        if res < 0:
            raise command_failed(what, res)
        return res

    async def features(self) -> int:
        """GET_FEATURES: the ``UBLK_F_*`` bits this driver supports."""
        buf = bytearray(8)
        await self._checked("GET_FEATURES", uapi.Cmd.GET_FEATURES, 0, buf=buf)
        return int.from_bytes(buf, "little")

    async def add_dev(self, info: uapi.DevInfo) -> uapi.DevInfo:
        """ADD_DEV: the device ``info`` asks for (``dev_id`` -1: the first free
        id); what the kernel granted (its id, queues, depth, flags). An id in use
        or a missing privilege is a UblkError in one line."""
        buf = bytearray(info.pack())
        res = await self._bounded("ADD_DEV", uapi.Cmd.ADD_DEV, info.dev_id, buf=buf)
        if res == -errno.EEXIST:
            raise UblkError(f"device id {info.dev_id} is already in use "
                            "(pick another -n, or delete it first)")
        if res == -errno.EPERM:
            raise UblkError("creating a ublk device needs root (CAP_SYS_ADMIN): run as root, "
                            "or add --unprivileged (unprivileged = true in a config)")
        if res < 0:
            raise command_failed("ADD_DEV", res)
        added = uapi.DevInfo.unpack(buf)
        if added.flags & uapi.Feature.UNPRIVILEGED_DEV:
            self._unprivileged.add(added.dev_id)
        return added

    async def get_info(self, dev_id: int) -> uapi.DevInfo:
        """GET_DEV_INFO: the device's id, queues, depth, flags, state and
        server pid; UblkError if it does not exist or is not ours."""
        buf = bytearray(uapi.DEV_INFO_SIZE)
        res = await self.cmd(uapi.Cmd.GET_DEV_INFO, dev_id, buf=buf)
        if res == -errno.ENODEV:
            raise UblkError(f"device {dev_id} does not exist")
        if res in (-errno.EPERM, -errno.EACCES):
            raise UblkError(f"device {dev_id} is not yours: it belongs to root or another "
                            "user (only its owner or root may use it)")
        if res < 0:
            raise command_failed(f"GET_DEV_INFO of device {dev_id}", res)
        return uapi.DevInfo.unpack(buf)

    async def set_params(self, dev_id: int, params: uapi.Params) -> None:
        """SET_PARAMS: the device's geometry (sizes, block sizes, discard,
        zones), before START_DEV."""
        buf = bytearray(params.pack())
        await self._checked(f"SET_PARAMS of device {dev_id}", uapi.Cmd.SET_PARAMS, dev_id,
                            buf=buf)

    async def get_params(self, dev_id: int) -> uapi.Params:
        """GET_PARAMS: the ``ublk_params`` the device has now."""
        buf = bytearray(uapi.PARAMS_SIZE)
        buf[0:4] = uapi.PARAMS_SIZE.to_bytes(4, "little")
        await self._checked(f"GET_PARAMS of device {dev_id}", uapi.Cmd.GET_PARAMS, dev_id,
                            buf=buf)
        return uapi.Params.unpack(buf)

    async def queue_affinity(self, dev_id: int, q_id: int) -> list[int]:
        """GET_QUEUE_AFFINITY: the CPUs queue ``q_id`` is bound to, as kublk
        prints them (``affinity(0 1 )``)."""
        buf = bytearray(128)  # a cpu_set_t
        await self._checked("GET_QUEUE_AFFINITY", uapi.Cmd.GET_QUEUE_AFFINITY, dev_id,
                            buf=buf, data=q_id)
        mask = int.from_bytes(buf, "little")
        return [i for i in range(len(buf) * 8) if mask >> i & 1]

    async def start_dev(self, dev_id: int, pid: int) -> None:
        """START_DEV with our ``pid`` as the server's: the disk appears. Bounded
        in time; a failure is a UblkError naming the device."""
        what = f"START_DEV of device {dev_id}"
        res = await self._bounded(what, uapi.Cmd.START_DEV, dev_id, data=pid)
        if res < 0:
            raise command_failed(what, res)

    async def stop_dev(self, dev_id: int) -> int:
        """STOP_DEV: the disk goes away (in-flight requests first); 0 or -errno."""
        return await self.cmd(uapi.Cmd.STOP_DEV, dev_id)

    async def try_stop_dev(self, dev_id: int) -> int:
        """STOP_DEV unless the disk is open (-EBUSY)."""
        return await self.cmd(uapi.Cmd.TRY_STOP_DEV, dev_id)

    async def quiesce_dev(self, dev_id: int, timeout_ms: int = 10_000) -> int:
        """QUIESCE_DEV: detach the server and keep the device (QUIESCED) for
        recovery, waiting at most ``timeout_ms``; 0 or -errno."""
        return await self.cmd(uapi.Cmd.QUIESCE_DEV, dev_id, data=timeout_ms)

    async def update_size(self, dev_id: int, sectors: int) -> int:
        """UPDATE_SIZE: the live device's capacity becomes ``sectors``; 0 or
        -errno."""
        return await self.cmd(uapi.Cmd.UPDATE_SIZE, dev_id, data=sectors)

    async def start_user_recovery(self, dev_id: int) -> int:
        """START_USER_RECOVERY of a QUIESCED (or FAIL_IO) device: the first
        step of serving it again from a new process; 0 or -errno."""
        return await self.cmd(uapi.Cmd.START_USER_RECOVERY, dev_id)

    async def end_user_recovery(self, dev_id: int, pid: int) -> int:
        """END_USER_RECOVERY with the new server's ``pid``, once its queues
        are armed: the device is LIVE again; 0 or -errno."""
        return await self._bounded(f"END_USER_RECOVERY of device {dev_id}",
                                   uapi.Cmd.END_USER_RECOVERY, dev_id, data=pid)

    async def reg_buf(self, dev_id: int, addr: int, length: int, flags: int = 0) -> int:
        """REG_BUF: pin ``length`` bytes of our mapping at ``addr``; the
        buffer's index, or -errno."""
        buf = bytearray(uapi.SHMEM_BUF_REG.pack(addr, length, flags, 0))
        return await self.cmd(uapi.Cmd.REG_BUF, dev_id, buf=buf)

    async def del_dev(self, dev_id: int) -> int:
        """DEL_DEV: remove the device (after STOP_DEV and its server's exit);
        0 or -errno."""
        res = await self.cmd(uapi.Cmd.DEL_DEV, dev_id)
        if res >= 0:
            self._unprivileged.discard(dev_id)  # its id may come back privileged
        return res

    def close(self) -> None:
        """Close the ring and /dev/ublk-control."""
        self.ring.close()
        os.close(self.fd)


async def settled_info(ctrl: Control, dev_id: int, timeout: float = 5.0) -> uapi.DevInfo:
    """GET_DEV_INFO, after waiting out the moment between a server's exit
    and the kernel's release work, when the device still reads LIVE with
    no server (pid -1) before turning QUIESCED or FAIL_IO."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        info = await ctrl.get_info(dev_id)
        if info.state != uapi.State.LIVE or info.ublksrv_pid > 0 or loop.time() > deadline:
            return info
        await asyncio.sleep(0.1)
