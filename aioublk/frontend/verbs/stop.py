"""``stop``: the device's server exits (``del`` then removes the device);
``--safe`` only if nothing holds the disk open."""

from __future__ import annotations

import argparse
import errno
import os

from aioublk.errors import UblkError
from aioublk.frontend import ctl
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel.control import Control


def _arguments(st: argparse.ArgumentParser) -> None:
    add_dev_id(st, "device to stop")
    st.add_argument("--safe", action="store_true", help="only if nothing has the disk open")


async def _stop(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        await ctrl.get_info(dev_id)  # "does not exist" in one line
        if args.safe:
            res = await ctrl.try_stop_dev(dev_id)
            if res == -errno.EBUSY:
                raise UblkError(f"device {dev_id} is open (mounted, or held by a program): "
                                "close it first, or stop without --safe")
        else:
            res = await ctrl.stop_dev(dev_id)
        if res < 0:
            raise UblkError(f"cannot stop device {dev_id}: {os.strerror(-res)}")
    return await ctl.on_device(args, run)


VERB = Verb("stop", "stop a device (its server exits; del removes it)", _arguments,
            ctl.on_loop(_stop), place=4)
