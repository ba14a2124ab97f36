"""The UBLK_F_BATCH_IO encoding and commit/resubmit logic, without a kernel."""

from __future__ import annotations

import struct

import pytest

from aioublk import uapi
from aioublk.batch import (
    F_HAS_BUF_ADDR,
    F_HAS_ZONE_LBA,
    Batch,
    BatchBuilder,
    batch_header,
    elem_bytes,
    fetched_tags,
)


def test_elem_sizes_follow_flags() -> None:
    assert elem_bytes(0) == uapi.ELEM_HEADER.size == 8
    assert elem_bytes(F_HAS_BUF_ADDR) == 16
    assert elem_bytes(F_HAS_BUF_ADDR | F_HAS_ZONE_LBA) == 24


def test_header_layout() -> None:
    raw = batch_header(3, F_HAS_BUF_ADDR, 17)
    assert len(raw) == 16
    assert struct.unpack_from("=HHHB", raw) == (3, F_HAS_BUF_ADDR, 17, 16)


def test_elements_pack_tag_index_result_and_address() -> None:
    b = BatchBuilder(q_id=1, depth=8, flags=F_HAS_BUF_ADDR)
    b.add(5, 4096, buf_addr=0x7F00_0000_1000)
    b.add(6, -5, buf_addr=0x7F00_0000_2000)
    (batch,) = b.take()
    assert batch.tags == [5, 6] and batch.nr_elem == 2
    assert struct.unpack("=HHiQHHiQ", bytes(batch.data)) == (
        5, 0, 4096, 0x7F00_0000_1000, 6, 0, -5, 0x7F00_0000_2000)
    assert len(b) == 0 and b.take() == []


def test_take_splits_at_queue_depth() -> None:
    b = BatchBuilder(q_id=0, depth=4)
    for tag in range(10):
        b.add(tag, tag * 512)
    batches = b.take()
    assert [x.tags for x in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(len(x.data) == 8 * x.nr_elem for x in batches)
    assert struct.unpack_from("=HHi", batches[2].data, 8) == (9, 0, 9 * 512)


def _batch(tags: list[int], flags: int = 0) -> Batch:
    b = BatchBuilder(q_id=2, depth=64, flags=flags)
    for t in tags:
        b.add(t, 100 + t)
    (batch,) = b.take()
    return batch


def test_full_commit_leaves_nothing() -> None:
    assert _batch([1, 2, 3]).after(24) == (None, None)


@pytest.mark.parametrize("flags", [0, F_HAS_BUF_ADDR])
def test_partial_commit_drops_the_refused_element_and_resends_the_rest(flags: int) -> None:
    size = elem_bytes(flags)
    rest, refused = _batch([1, 2, 3, 4, 5], flags).after(2 * size)
    assert refused == 3
    assert rest is not None and rest.tags == [4, 5]
    # the remainder is exactly the original elements 4 and 5, byte for byte
    assert rest.data == _batch([4, 5], flags).data
    assert rest.header() == batch_header(2, flags, 2)


def test_error_on_the_first_element_drops_it() -> None:
    rest, refused = _batch([7, 8]).after(-16)  # -EBUSY
    assert refused == 7
    assert rest is not None and rest.tags == [8]


def test_refused_last_element_leaves_nothing_to_resend() -> None:
    assert _batch([1, 2]).after(8) == (None, 2)


def test_resubmission_converges() -> None:
    """Whatever the kernel refuses, resending the rest ends."""
    batch: Batch | None = _batch(list(range(10)))
    refused = []
    answers = iter([24, -16, 0, 8])  # elements processed before each refusal
    while batch is not None:
        batch, bad = batch.after(next(answers, batch.nr_elem * 8))
        if bad is not None:
            refused.append(bad)
    assert refused == [3, 4, 5, 7]


def test_fetched_tags_decode_u16s() -> None:
    buf = bytearray(64)
    struct.pack_into("=4H", buf, 0, 0, 17, 4095, 3)
    assert fetched_tags(buf, 8) == [0, 17, 4095, 3]
    assert fetched_tags(buf, 0) == []
