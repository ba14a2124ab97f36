"""``del``: stop a device (or every one), wait for its server, delete it."""

from __future__ import annotations

import argparse

from aioublk.errors import UblkError
from aioublk.frontend import ctl
from aioublk.frontend.kublk_lines import device_ids
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel.control import Control


def _arguments(d: argparse.ArgumentParser) -> None:
    add_dev_id(d, "device to delete")
    d.add_argument("-a", "--all", action="store_true", help="delete all devices")


def _del(ctrl: Control, args: argparse.Namespace) -> int:
    if args.dev_id >= 0:
        ctl.delete(ctrl, args.dev_id)
        return 0
    if not args.all:
        raise UblkError("del needs -n ID or -a")
    for dev_id in device_ids():
        try:
            ctl.delete(ctrl, dev_id)
        except UblkError as e:
            if "does not exist" not in str(e):
                raise
    return 0


VERB = Verb("del", "delete devices", _arguments, ctl.blocking(_del), light=True, place=3)
