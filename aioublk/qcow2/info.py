"""What ``aioublk img info`` and ``img snapshot -l`` say of a qcow2 image,
in qemu-img's keys and words: the header, the snapshot table and the
bitmaps, read through a callable (no I/O here), so the tests feed it bytes
and the output can be compared line by line with qemu-img's.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.check import AUTOCLEAR_BITMAPS, Read

_BITMAP_FLAGS = ((1, "in-use"), (2, "auto"))


def size_to_str(n: int) -> str:
    """A byte count as qemu-img prints it: three significant digits, binary units."""
    _, exp = math.frexp(n / (1000.0 / 1024.0))
    i = int((exp - 1) / 10)  # (C's division: toward zero)
    return f"{n / (1 << (i * 10)):0.3g} {['', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei'][i]}B"


def snapshots(read: Read, h: fmt.Header) -> list[fmt.Snapshot]:
    if not h.nb_snapshots:
        return []
    return fmt.parse_snapshots(read(h.snapshots_offset, 1 << 24), h.nb_snapshots)[0]


def snapshot_json(s: fmt.Snapshot) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.icount is not None and s.icount != (1 << 64) - 1:
        out["icount"] = s.icount
    out.update({"vm-clock-nsec": s.vm_clock_nsec % 1_000_000_000, "name": s.name,
                "date-sec": s.date_sec, "date-nsec": s.date_nsec,
                "vm-clock-sec": s.vm_clock_nsec // 1_000_000_000, "id": s.id,
                "vm-state-size": s.vm_state_size})
    return out


def snapshot_lines(snaps: list[fmt.Snapshot]) -> list[str]:
    """``Snapshot list:`` and its table, as ``qemu-img snapshot -l`` prints it."""
    lines = ["Snapshot list:",
             f"{'ID':<10}{'TAG':<17}{'VM SIZE':>8}{'DATE':>20}{'VM CLOCK':>13}{'ICOUNT':>11}"]
    for s in snaps:
        secs = s.vm_clock_nsec // 1_000_000_000
        clock = (f"{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}."
                 f"{s.vm_clock_nsec // 1_000_000 % 1000:03d}")
        date = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.date_sec))
        icount = "" if s.icount is None or s.icount == (1 << 64) - 1 else str(s.icount)
        lines.append(f"{s.id:<9} {s.name:<16} {size_to_str(s.vm_state_size):>8}{date:>20}"
                     f"{clock:>13}{icount:>11}")
    return lines


def bitmaps(read: Read, h: fmt.Header) -> list[dict[str, Any]]:
    """The persistent bitmaps QEMU would read (none once the autoclear bit is clear)."""
    if not (h.autoclear & AUTOCLEAR_BITMAPS and fmt.EXT_BITMAPS in h.extensions):
        return []
    return [{"flags": [name for bit, name in _BITMAP_FLAGS if b.flags & bit], "name": b.name,
             "granularity": 1 << b.granularity_bits}
            for b in fmt.parse_bitmaps(h.extensions[fmt.EXT_BITMAPS], read)]


def full_backing(path: str, backing: str) -> str:
    """The backing file's path as QEMU resolves it: beside the image."""
    if os.path.isabs(backing) or not os.path.dirname(path):
        return backing
    return os.path.join(os.path.dirname(path), backing)


def image_info(read: Read, path: str, st: os.stat_result) -> dict[str, Any]:
    """``qemu-img info --output json``'s keys for the image at ``path``."""
    h = fmt.parse_header(read(0, 1 << 21), st.st_size)
    out: dict[str, Any] = {}
    snaps = snapshots(read, h)
    if snaps:
        out["snapshots"] = [snapshot_json(s) for s in snaps]
    if h.backing_file is not None and h.backing_format:
        out["backing-filename-format"] = h.backing_format
    out.update({"virtual-size": h.size, "filename": path, "cluster-size": h.cluster_size,
                "format": "qcow2", "actual-size": st.st_blocks * 512})
    data: dict[str, Any] = {
        "compat": "1.1" if h.version >= 3 else "0.10",
        "compression-type": "zstd" if h.compression_type == fmt.COMPRESSION_ZSTD else "zlib",
    }
    if h.version >= 3:
        data["lazy-refcounts"] = bool(h.compatible & fmt.COMPAT_LAZY_REFCOUNTS)
        marks = bitmaps(read, h)
        if marks:
            data["bitmaps"] = marks
    data["refcount-bits"] = h.refcount_bits
    if h.version >= 3:
        data["corrupt"] = bool(h.incompatible & fmt.INCOMPAT_CORRUPT)
        data["extended-l2"] = bool(h.incompatible & fmt.INCOMPAT_EXTL2)
    out["format-specific"] = {"type": "qcow2", "data": data}
    if h.backing_file is not None:
        out["full-backing-filename"] = full_backing(path, h.backing_file)
        out["backing-filename"] = h.backing_file
    out["dirty-flag"] = bool(h.incompatible & fmt.INCOMPAT_DIRTY)
    return out


def _dump(value: Any, indent: int) -> list[str]:
    """qemu-img's human dump of a dict or list, keys with spaces for dashes."""
    pad = " " * indent
    lines: list[str] = []
    items = value.items() if isinstance(value, dict) else \
        ((f"[{i}]", v) for i, v in enumerate(value))
    for key, v in items:
        key = key.replace("-", " ")
        if isinstance(v, dict | list):
            lines.append(f"{pad}{key}:")
            lines += _dump(v, indent + 4)
        else:
            shown = str(v).lower() if isinstance(v, bool) else str(v)
            lines.append(f"{pad}{key}: {shown}")
    return lines


def human_info(info: dict[str, Any], read: Read) -> list[str]:
    """``qemu-img info``'s lines."""
    lines = [f"image: {info['filename']}", "file format: qcow2",
             f"virtual size: {size_to_str(info['virtual-size'])} "
             f"({info['virtual-size']} bytes)",
             f"disk size: {size_to_str(info['actual-size'])}",
             f"cluster_size: {info['cluster-size']}"]
    if "backing-filename" in info:
        shown, full = info["backing-filename"], info["full-backing-filename"]
        lines.append(f"backing file: {shown}" + (f" (actual path: {full})" if full != shown
                                                 else ""))
    if "backing-filename-format" in info:
        lines.append(f"backing file format: {info['backing-filename-format']}")
    if "snapshots" in info:
        h = fmt.parse_header(read(0, 1 << 21), 1 << 62)
        lines += snapshot_lines(snapshots(read, h))
    lines.append("Format specific information:")
    lines += _dump(info["format-specific"]["data"], 4)
    return lines
