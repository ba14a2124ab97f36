"""Fuzz target: ``aioublk.qcow2.format.parse_snapshots``. The input is a
2-byte big-endian snapshot count (the header allows up to 65535 here; it
refuses more than 65536) followed by the table's bytes. Only the snapshots
or a one-line Qcow2Error may come out, and the table never claims more
bytes than it was given."""

from __future__ import annotations

from aioublk.qcow2 import format as fmt
from tests.fuzz.common import check_error


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    count = int.from_bytes(data[:2], "big")
    table = data[2:]
    try:
        snaps, nbytes = fmt.parse_snapshots(table, count)
    except fmt.Qcow2Error as e:
        check_error(e)
        return
    assert len(snaps) == count
    # the padding after the last entry may run up to 7 bytes past the data
    assert nbytes <= len(table) + 7, (nbytes, len(table))
