"""The control plane's guards, on the host (no kernel: fakes stand in)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.kernel import uapi
from aioublk.kernel.control import Control


def _control() -> Control:
    """A Control whose every command would fail the test if sent."""
    ctrl = Control.__new__(Control)
    ctrl.privileged = True
    ctrl.blocking = False
    ctrl._unprivileged = set()

    async def raw(*a: object, **kw: object) -> int:
        raise AssertionError("the command was sent")
    ctrl._raw = raw  # type: ignore[method-assign]
    return ctrl


@pytest.mark.parametrize("op,dev_id", [
    (uapi.Cmd.DEL_DEV, 1 << 32), (uapi.Cmd.STOP_DEV, uapi.DEV_ID_ANY),
    (uapi.Cmd.GET_DEV_INFO, 1 << 20), (uapi.Cmd.ADD_DEV, 1 << 20), (uapi.Cmd.DEL_DEV, -1),
])
def test_control_never_sends_an_id_outside_the_kernels_range(op: int, dev_id: int) -> None:
    """An id is sent as a u32: 1 << 32 would be device 0. Only ADD_DEV may
    say "any" (U32_MAX)."""
    with pytest.raises(UblkError, match=f"device id {dev_id} is out of range: use 0..1048575"):
        asyncio.run(_control().cmd(op, dev_id))


class _FakeControl:
    """Answers GET_DEV_INFO with ``info``; records every other command."""

    def __init__(self, info: uapi.DevInfo) -> None:
        self.info = info
        self.sent: list[str] = []

    async def get_info(self, dev_id: int) -> uapi.DevInfo:
        return self.info

    async def get_params(self, dev_id: int) -> uapi.Params:
        return uapi.Params(dev_sectors=(1 << 20) >> 9)  # the target's size

    def __getattr__(self, name: str) -> object:
        async def record(*a: object, **kw: object) -> int:
            self.sent.append(name)
            return 0
        return record


@pytest.mark.parametrize("flags", [uapi.Feature.UNPRIVILEGED_DEV, 0])
def test_recovery_refuses_a_device_another_user_created(flags: int) -> None:
    """``recover`` and serve's reattach go through ``_begin_recovery``: a
    device whose owner_uid is not ours is refused before anything is sent
    (as root too: root reattaching a user's device would serve root's
    files to a disk that user controls), whatever flags the kernel kept."""
    import os

    from aioublk.device import Device
    from aioublk.queue.options import DeviceConfig
    from aioublk.targets.null import NullTarget

    info = uapi.DevInfo(dev_id=3, state=uapi.State.QUIESCED,
                        flags=uapi.Feature.USER_RECOVERY | flags,
                        owner_uid=os.getuid() + 1000, owner_gid=os.getgid() + 1000)
    ctrl = _FakeControl(info)
    dev = Device(NullTarget(1 << 20), DeviceConfig(dev_id=3, recovery=True))
    with pytest.raises(UblkError) as e:
        asyncio.run(dev._begin_recovery(ctrl, 0xfffff))  # type: ignore[arg-type]
    assert str(e.value) == (f"device 3 belongs to uid {os.getuid() + 1000}, not to this "
                            f"server's uid {os.getuid()}: only the user who added a device "
                            "may recover it")
    assert ctrl.sent == []


@pytest.mark.parametrize("what", ["ADD_DEV", "START_DEV"])
def test_a_kernel_that_never_answers_add_or_start_is_one_line(
        what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ADD_DEV and START_DEV are awaited with a time limit: a driver that
    never completes them costs one line, not a server hung for ever."""
    from aioublk.kernel import control

    ctrl = _control()

    async def never(*a: object, **kw: object) -> int:
        await asyncio.get_running_loop().create_future()
        return 0
    ctrl._raw = never  # type: ignore[method-assign]
    monkeypatch.setattr(control, "CTRL_TIMEOUT", 0.2)

    async def run() -> None:
        if what == "ADD_DEV":
            await ctrl.add_dev(uapi.DevInfo())
        else:
            await ctrl.start_dev(7, 1234)
    with pytest.raises(UblkError) as e:
        asyncio.run(asyncio.wait_for(run(), 10))
    dev = "" if what == "ADD_DEV" else " of device 7"
    assert str(e.value) == (f"{what}{dev}: no answer from ublk_drv in 0.2 s (is the kernel "
                            "stuck? see dmesg)")



def test_a_blocking_control_ring_answers_before_it_returns(tmp_path: Path) -> None:
    """``Control(blocking=True)``'s ring (list, del, udev owner: no event
    loop): the command's CQE is waited for in ``uring_cmd``, so ``run_now``
    gets its result; a regular file refuses a URING_CMD."""
    from aioublk.kernel.control import _WaitingRing, run_now

    ring = _WaitingRing(4)
    try:
        with open(tmp_path / "f", "wb") as f:
            res = run_now(ring.uring_cmd(f.fileno(), uapi.Cmd.GET_FEATURES, bytes(32)))
    finally:
        ring.close()
    assert res in (-errno.EOPNOTSUPP, -errno.EINVAL, -errno.ENOTTY)


def test_run_now_refuses_a_coroutine_that_waits() -> None:
    from aioublk.kernel.control import run_now

    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="waited for an event loop"):
        run_now(waits())
