"""``list``: kublk's lines for each device (or one JSON list), aioublk's
target line for the devices it added, and with ``--stats`` each queue's
counters."""

from __future__ import annotations

import argparse
from typing import Any

from aioublk.errors import UblkError
from aioublk.frontend import ctl, stats
from aioublk.frontend.kublk_lines import device_ids, dump, target_line
from aioublk.frontend.verb import Verb, add_dev_id
from aioublk.kernel.control import Control, run_now


def _arguments(ls: argparse.ArgumentParser) -> None:
    add_dev_id(ls, "device to show (default: all)")
    ls.add_argument("-a", "--all", action="store_true", help="show all devices (the default)")
    ls.add_argument("--stats", action="store_true",
                    help="also each queue's requests, bytes, errors and in-flight count, "
                    "and the share the C data plane served")
    ls.add_argument("--json", action="store_true",
                    help="one JSON list of the devices instead of kublk's lines")


def _lines(ctrl: Control, dev_id: int, with_stats: bool) -> list[str]:
    """kublk's lines for one device, then aioublk's target line (for a
    device an aioublk ``add`` recorded) and ``--stats``' lines."""
    out = run_now(dump(ctrl, dev_id))
    pid = run_now(ctrl.get_info(dev_id)).ublksrv_pid
    record = stats.read_record(dev_id)
    # (a record left by a server of another device of this id is not its)
    if record is not None and record.get("pid") == pid:
        out.append(target_line(record))
    if with_stats:
        rows = stats.read(dev_id, pid)
        out += stats.lines(rows) if rows is not None else [
            f"\tstats: none published by server pid {pid} (not an aioublk server, "
            "or not running)"]
    return out


def _list(ctrl: Control, args: argparse.Namespace) -> int:
    found: list[dict[str, Any]] = []
    for dev_id in [args.dev_id] if args.dev_id >= 0 else device_ids():
        try:
            if args.json:
                found.append(run_now(ctl.describe(ctrl, dev_id, args.stats)))
            else:
                print("\n".join(_lines(ctrl, dev_id, args.stats)))
        except UblkError:
            if args.dev_id >= 0:
                raise
            # (deleted since it was listed)
    if args.json:
        import json

        print(json.dumps(found))
    return 0


VERB = Verb("list", "show devices", _arguments, ctl.blocking(_list), light=True, place=8)
