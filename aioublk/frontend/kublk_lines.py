"""The lines kublk prints for a device, which ``add``, ``recover``, ``list``
and ``serve`` print alike: scripts written for kublk parse them, so they
stay byte for byte what kublk prints (a change here breaks those scripts).
``list`` adds a line of its own after them (``target_line``), and only for
devices an aioublk ``add`` recorded.
"""

from __future__ import annotations

import os
import re
from typing import Any

from aioublk.kernel.control import Control, state_name

_CHAR_DEVICE = re.compile(r"ublkc(\d+)")


def device_ids(root: str | os.PathLike[str] = "/") -> list[int]:
    """The ids of every ublk device, in numeric order, whatever they are
    (ids go up to 2^20, not just kublk's 0..254). Read from sysfs, where the
    driver registers each device's char device whether or not udev made
    its node; ``/dev`` is the fallback for a system without sysfs mounted
    (a container), where a node missing from /dev is missed."""
    for directory in (os.path.join(root, "sys/class/ublk-char"), os.path.join(root, "dev")):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        return sorted(int(m[1]) for name in names if (m := _CHAR_DEVICE.fullmatch(name)))
    return []


def target_line(record: dict[str, Any]) -> str:
    """aioublk's line after kublk's: the target and files ``add`` recorded."""
    files = [str(f) for f in record.get("files", [])]
    what = "" if not files else f" file {files[0]}" if len(files) == 1 else \
        f" files {' '.join(files)}"
    filters = record.get("options", {}).get("filter") or []
    stack = f" filters {' '.join(filters)}" if filters else ""
    return f"\ttarget: {record.get('target')}{what}{stack}"


async def dump(ctrl: Control, dev_id: int) -> list[str]:
    """kublk's three-part description of one device."""
    info = await ctrl.get_info(dev_id)
    params = await ctrl.get_params(dev_id)
    lines = [
        f"dev id {info.dev_id}: nr_hw_queues {info.nr_hw_queues} "
        f"queue_depth {info.queue_depth} block size {1 << params.logical_bs_shift} "
        f"dev_capacity {params.dev_sectors}",
        f"\tmax rq size {info.max_io_buf_bytes} daemon pid {info.ublksrv_pid} "
        f"flags 0x{info.flags:x} state {state_name(info.state)}",
    ]
    for q in range(info.nr_hw_queues):
        cpus = await ctrl.queue_affinity(dev_id, q)
        # kublk keeps only the first CPU of each queue's set
        lines.append(f"\tqueue {q}: affinity({''.join(f'{c} ' for c in cpus[:1])})")
    return lines


async def print_device(ctrl: Control, dev_id: int) -> None:
    """Print the device's lines at once (flushed: whoever waits for a new
    device reads them before the server goes on serving)."""
    print("\n".join(await dump(ctrl, dev_id)), flush=True)
