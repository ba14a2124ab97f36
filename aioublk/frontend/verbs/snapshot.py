"""``snapshot create|list|delete``: internal snapshots of the qcow2 image a
live device serves, its server stepping aside while one is taken."""

from __future__ import annotations

import argparse

from aioublk.errors import UblkError
from aioublk.frontend import ctl, img
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.io import locking
from aioublk.kernel.control import Control


def _arguments(sn: argparse.ArgumentParser) -> None:
    add_dev_id(sn, "device whose image to snapshot")
    sn.add_argument("action", choices=["create", "list", "delete"],
                    help="create a snapshot, list them, or delete one")
    sn.add_argument("name", nargs="?", help="the snapshot's name (create, delete)")


async def _snapshot(args: argparse.Namespace) -> int:
    from aioublk.frontend import livesnap

    async def run(ctrl: Control, dev_id: int) -> None:
        await ctrl.get_info(dev_id)  # "does not exist" in one line
        image = livesnap.image_of(dev_id)
        if args.action == "list":
            lines = img.snapshot_lines(image, True)
            if lines:
                print("\n".join(lines))
            return
        if not args.name:
            raise UblkError(f"give the snapshot's name: snapshot -n {dev_id} {args.action} NAME")
        if args.action == "delete" and all(s.name != args.name
                                           for s in img.snapshots_of(image, True)):
            # (found before the server steps aside for nothing)
            raise UblkError(f"{image}: could not delete snapshot '{args.name}': "
                            "snapshot not found")
        await livesnap.detach(ctrl, dev_id)
        try:
            if not locking.wait_released(image, livesnap.STEP_TIMEOUT):
                raise UblkError(f"{image} is still in use after its server exited")
            img.change_snapshots(image, args.action, args.name)
        finally:
            livesnap.recover(dev_id)
    return await ctl.on_device(args, run)


VERB = Verb("snapshot", "internal snapshots of the qcow2 image a live device serves (added "
            "with -r 1 -i 1): the server steps aside while one is taken", _arguments,
            ctl.on_loop(_snapshot), place=6)
