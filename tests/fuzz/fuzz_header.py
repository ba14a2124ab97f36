"""Fuzz target: ``aioublk.qcow2.format.parse_header`` over an image's first
cluster. The input is the first bytes; it is parsed twice, as the whole
file and as the start of a large one (so checks against the file size go
both ways). Only a Header or a one-line Qcow2Error may come out."""

from __future__ import annotations

from aioublk.qcow2 import format as fmt
from tests.fuzz.common import check_error


def one_input(data: bytes) -> None:
    for file_size in (len(data), 1 << 40):
        try:
            h = fmt.parse_header(data, file_size)
        except fmt.Qcow2Error as e:
            check_error(e)
        else:
            assert isinstance(h, fmt.Header)
