"""Unprivileged devices' nodes for their owners: the udev rule and its helper.

A user without CAP_SYS_ADMIN may add a device with UBLK_F_UNPRIVILEGED_DEV
through a world-writable ``/dev/ublk-control``; the kernel records the user as
the device's owner and, for every later command, checks the caller's access
to ``/dev/ublkcN`` instead of its capabilities. So the nodes devtmpfs makes
(root's, mode 0600) must become the owner's, which is udev's job: for each
new ``ublkcN``/``ublkbN[pM]`` the rule runs ``aioublk udev owner NAME`` (as
root), which asks the kernel for the device's owner with GET_DEV_INFO2 and
prints ``UID GID``; udev applies them as it creates the node, so there is no
moment where the node has the wrong owner once the server can see it. A
privileged device makes the helper exit 1: the rule does not match, and
its nodes stay root's. The kernel itself lets only the owner open an
unprivileged disk, whatever the node's mode says.

The rule names the interpreter aioublk is installed for (udev runs programs
with a bare environment), hence ``aioublk udev rules`` prints it for this
installation; ``examples/99-aioublk.rules`` is its output for a system-wide
install.
"""

from __future__ import annotations

import asyncio
import re
import sys

from aioublk import uapi
from aioublk.device import Control
from aioublk.options import UblkError

RULES_FILE = "/etc/udev/rules.d/99-aioublk.rules"
_NODE = re.compile(r"ublk[bc](\d+)(?:p\d+)?")


def rules(python: str = sys.executable) -> str:
    """The rule file for an aioublk importable by ``python``."""
    return f"""\
# aioublk: users may create ublk devices of their own (add --unprivileged).
# Install as {RULES_FILE}, then: udevadm control --reload
# Anyone may send ADD_DEV; ublk_drv caps unprivileged devices (module
# parameter ublks_max, 64 by default) and checks every other command
# against the caller's access to the device's /dev/ublkcN.
KERNEL=="ublk-control", MODE="0666", OPTIONS+="static_node=ublk-control"
# An unprivileged device's nodes belong to the user who created it.
ACTION=="add", KERNEL=="ublk[bc][0-9]*", PROGRAM="{python} -m aioublk udev owner %k", \\
    OWNER="%c{{1}}", GROUP="%c{{2}}", MODE="0600"
"""


def dev_id_of(name: str) -> int:
    """The device id in a node's kernel name: ublkc3, ublkb3, ublkb3p1."""
    m = _NODE.fullmatch(name)
    if m is None:
        raise UblkError(f"{name!r} is not a ublk node name (ublkcN, ublkbN or ublkbNpM)")
    return int(m.group(1))


async def owner(dev_id: int) -> tuple[int, int] | None:
    """(uid, gid) of an unprivileged device's owner; None for a privileged one."""
    ctrl = Control()
    try:
        info = await ctrl.get_info2(dev_id)
    finally:
        ctrl.close()
    if not info.flags & uapi.Feature.UNPRIVILEGED_DEV:
        return None
    return info.owner_uid, info.owner_gid


def main_owner(name: str) -> int:
    """``aioublk udev owner NAME``: print ``UID GID``, or exit 1 (no match)."""
    found = asyncio.run(owner(dev_id_of(name)))
    if found is None:
        return 1
    print(*found)
    return 0
