"""``UBLK_F_BATCH_IO`` protocol core: command encoding and commit bookkeeping,
with no I/O (the queue driver that sends these is built on top).

Facts from the kernel (drivers/block/ublk_drv.c, Linux 7.2):

- PREP/COMMIT_IO_CMDS carry a 16-byte ``ublk_batch_io`` in the SQE's command
  area and an array of elements at ``sqe->addr``. An element is an 8-byte
  header (tag u16, buf_index u16, result s32), then a u64 buffer address when
  ``UBLK_BATCH_F_HAS_BUF_ADDR`` is set (copy mode), then a u64 zone LBA when
  ``UBLK_BATCH_F_HAS_ZONE_LBA`` is set. ``elem_bytes`` must match the flags
  exactly and ``nr_elem`` may not exceed the queue depth (-E2BIG).
- COMMIT walks the elements in order and stops at the first one it refuses
  (e.g. -EBUSY: the tag is not owned by the server). It returns the bytes it
  processed, or that element's error when it is the first. So the element at
  the stop point is the bad one: it is dropped (and reported), and the ones
  after it are sent again; sending it again would fail the same way forever.
- FETCH_IO_CMDS completes with ``res`` bytes of u16 tags in the selected
  provided buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from aioublk import uapi

F_HAS_ZONE_LBA = 1 << 0
F_HAS_BUF_ADDR = 1 << 1
F_AUTO_BUF_REG_FALLBACK = 1 << 2

_HEADER = uapi.ELEM_HEADER  # =HHi
_ADDR = struct.Struct("=Q")


def elem_bytes(flags: int) -> int:
    """Size of one element for the given ``UBLK_BATCH_F_*`` flags."""
    size = _HEADER.size
    if flags & F_HAS_BUF_ADDR:
        size += 8
    if flags & F_HAS_ZONE_LBA:
        size += 8
    return size


def batch_header(q_id: int, flags: int, nr_elem: int) -> bytes:
    """The 16-byte ``ublk_batch_io`` command area."""
    return uapi.BATCH_IO.pack(q_id, flags, nr_elem, elem_bytes(flags), 0, 0)


def fetched_tags(buf: bytes | bytearray | memoryview, nbytes: int) -> list[int]:
    """The tags a FETCH_IO_CMDS completion delivered (``res`` bytes of u16)."""
    return list(memoryview(buf)[:nbytes].cast("H"))


@dataclass
class Batch:
    """One PREP or COMMIT command: the elements, packed, ready to send."""

    q_id: int
    flags: int
    tags: list[int]
    data: bytearray

    @property
    def nr_elem(self) -> int:
        return len(self.tags)

    def header(self) -> bytes:
        return batch_header(self.q_id, self.flags, self.nr_elem)

    def after(self, res: int) -> tuple[Batch | None, int | None]:
        """Given the kernel's answer, the batch still to send (None when all
        went through) and the tag it refused (None when none was)."""
        size = elem_bytes(self.flags)
        done = res // size if res >= 0 else 0
        if done >= self.nr_elem:
            return None, None
        refused = self.tags[done]
        rest = self.tags[done + 1:]
        if not rest:
            return None, refused
        return Batch(self.q_id, self.flags, rest, self.data[(done + 1) * size:]), refused


@dataclass
class BatchBuilder:
    """Packs (tag, result[, buffer address]) elements for one queue into
    commands of at most ``depth`` elements each."""

    q_id: int
    depth: int
    flags: int = 0
    _tags: list[int] = field(default_factory=list)
    _data: bytearray = field(default_factory=bytearray)

    def add(self, tag: int, result: int = 0, *, buf_addr: int = 0, buf_index: int = 0) -> None:
        self._tags.append(tag)
        self._data += _HEADER.pack(tag, buf_index, result)
        if self.flags & F_HAS_BUF_ADDR:
            self._data += _ADDR.pack(buf_addr)
        if self.flags & F_HAS_ZONE_LBA:
            self._data += _ADDR.pack(0)

    def __len__(self) -> int:
        return len(self._tags)

    def take(self) -> list[Batch]:
        """Everything added so far, as commands of at most ``depth`` elements."""
        size = elem_bytes(self.flags)
        out = []
        for i in range(0, len(self._tags), self.depth):
            tags = self._tags[i:i + self.depth]
            out.append(Batch(self.q_id, self.flags, tags,
                             self._data[i * size:(i + len(tags)) * size]))
        self._tags = []
        self._data = bytearray()
        return out
