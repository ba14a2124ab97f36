"""The control plane's guards, on the host (no kernel: fakes stand in)."""

from __future__ import annotations

import asyncio

import pytest

from aioublk import uapi
from aioublk.device import Control
from aioublk.options import UblkError


def _control() -> Control:
    """A Control whose every command would fail the test if sent."""
    ctrl = Control.__new__(Control)
    ctrl.privileged = True
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
