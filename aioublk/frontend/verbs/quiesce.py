"""``quiesce``: the server detaches, leaving the device QUIESCED for the
next one (``recover``)."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from aioublk.errors import UblkError
from aioublk.frontend import ctl
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel import uapi
from aioublk.kernel.control import Control


def _arguments(qu: argparse.ArgumentParser) -> None:
    add_dev_id(qu, "device to quiesce")


async def _quiesce(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        info = await ctrl.get_info(dev_id)
        if info.flags & uapi.Feature.QUIESCE and info.flags & uapi.Feature.BATCH_IO:
            sys.stderr.write(f"aioublk: warning: device {dev_id} uses batch I/O: until it is "
                             "recovered the kernel fails its new requests (SIGTERM an aioublk "
                             "server instead: it finishes its requests and detaches)\n")
        res = await ctrl.quiesce_dev(dev_id)
        if res == -errno.EOPNOTSUPP:
            raise UblkError(f"device {dev_id} cannot be quiesced: it was added without user "
                            "recovery (-r 1), or this kernel lacks UBLK_F_QUIESCE (6.15+)")
        if res < 0:
            raise UblkError(f"cannot quiesce device {dev_id}: {os.strerror(-res)}")
    return await ctl.on_device(args, run)


VERB = Verb("quiesce", "detach the server, leaving the device QUIESCED", _arguments,
            ctl.on_loop(_quiesce), place=5)
