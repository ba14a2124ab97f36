"""``update_size``: the device's new size, refused when it is more than the
recorded target's backing files hold."""

from __future__ import annotations

import argparse
import os
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import ctl, registry, stats
from aioublk.frontend.addargs import size
from aioublk.frontend.values import SIZE_FORMS
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel.control import Control


def _arguments(us: argparse.ArgumentParser) -> None:
    add_dev_id(us, "device to resize")
    us.add_argument("-s", "--size", type=size, required=True,
                    help=f"new size: {SIZE_FORMS}")


async def _update_size(args: argparse.Namespace) -> int:
    async def run(ctrl: Control, dev_id: int) -> None:
        params = await ctrl.get_params(dev_id)
        block = 1 << params.logical_bs_shift
        if not 0 < args.size < 1 << 63 or args.size % block:
            raise UblkError(f"size {args.size} is not a positive multiple of the device's "
                            f"logical block size ({block})")
        pid = (await ctrl.get_info(dev_id)).ublksrv_pid
        record = stats.read_record(dev_id)
        # (a record left by a server of another device of this id is not its)
        limit = _backing_bytes(record) if record and record.get("pid") == pid else None
        if record is not None and limit is not None and args.size > limit:
            raise UblkError(f"size {args.size} is more than device {dev_id}'s "
                            f"{record['target']} target can serve: its backing files "
                            f"hold {limit} bytes (grow them first)")
        res = await ctrl.update_size(dev_id, args.size >> 9)
        if res < 0:
            raise UblkError(f"cannot resize device {dev_id}: {os.strerror(-res)}")
    return await ctl.on_device(args, run)


def _backing_bytes(record: dict[str, Any]) -> int | None:
    """The bytes a recorded device's files hold now, which its target can
    serve and no more (past them a loop target would grow its file); None
    when no file bounds the target, or the files cannot be read."""
    spec = registry.TARGETS.get(str(record.get("target")))
    files = record.get("files") or []
    if spec is None or not isinstance(files, list) or not files:
        return None
    try:
        return spec.target_class().capacity([str(f) for f in files],
                                            dict(record.get("options") or {}))
    except (OSError, TypeError, ValueError, AttributeError):
        return None


VERB = Verb("update_size", "change the device's size", _arguments, ctl.on_loop(_update_size),
            place=7)
