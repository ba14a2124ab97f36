"""What every part of the qcow2 engine shares: the L2 table and the forms
of its entries, the engine's logger, errors and limits, and zeros."""

from __future__ import annotations

import errno
from array import array
from typing import Any

from aioublk import logs
from aioublk.io.hostfile import aligned
from aioublk.qcow2 import format as fmt

log = logs.get_logger("aioublk.qcow2")

DEFAULT_CACHE_BYTES = 32 << 20  # L2 cache bound, as QEMU's default maximum
OFFLOAD_BYTES = 64 << 10  # clusters this big are decompressed on a worker thread
MAX_CHAIN = 64
_ZEROS = bytes(1 << 20)

Backing = Any  # Qcow2Image | RawBacking


#: an engine entry no standard entry can say (an extended L2 entry whose
#: subclusters differ): its subcluster word says, per subcluster. A reserved
#: bit of the standard entry, never written as such (``ext_entry``)
PARTIAL = 1 << 1


def engine_entry(e: int, sub: int) -> int:
    """An extended L2 entry as the engine works with it: a standard entry
    where the subclusters all agree, else the entry marked PARTIAL."""
    e &= ~fmt.ZERO  # (reserved with extended L2)
    if e & fmt.COMPRESSED:
        return e
    alloc, zero = sub & fmt.SUB_ALLOC, sub >> 32
    if e & fmt.OFFSET_MASK and alloc == fmt.SUB_ALLOC and not zero:
        return e
    if zero == fmt.SUB_ALLOC and not alloc:
        return e | fmt.ZERO
    if not e & fmt.OFFSET_MASK and not sub:
        return 0
    return e | PARTIAL


def ext_entry(e: int, sub: int) -> tuple[int, int]:
    """An engine entry as an extended L2 entry and its subcluster word
    (``sub``: what the table held, kept where the entry is PARTIAL)."""
    if e & PARTIAL:
        return e & ~PARTIAL, sub
    if e & fmt.COMPRESSED:
        return e, 0
    if e & fmt.ZERO:
        return e & ~fmt.ZERO, fmt.SUB_ZERO
    return (e, fmt.SUB_ALLOC) if e & fmt.OFFSET_MASK else (0, 0)


class L2Table:
    """A cached L2 table: the L1 index it maps (``l1i``) and, per entry, what
    the data plane has of it (``pub``: 0 nothing, else the kind it was
    published as, ``aioublk.dataplane.extents.MAP`` or ``ZERO``; see
    ``aioublk.qcow2.publish``). With extended L2, ``entries`` are engine
    entries (``engine_entry``) and ``subs`` the subcluster words as loaded."""

    __slots__ = ("offset", "entries", "dirty", "gen", "l1i", "pub", "subs")

    def __init__(self, offset: int, entries: array[int], l1i: int,
                 dirty: bool = False, subs: array[int] | None = None) -> None:
        self.offset = offset
        self.entries = entries
        self.dirty = dirty
        self.gen = 0
        self.l1i = l1i
        self.pub = bytearray(len(entries))
        self.subs = subs

    @classmethod
    def parse(cls, offset: int, data: bytes | memoryview, l1i: int,
              extended: bool) -> L2Table:
        entries, subs = fmt.split_l2(data, extended)
        if subs is not None:
            entries = array("Q", map(engine_entry, entries, subs))
        return cls(offset, entries, l1i, subs=subs)

    def dump(self) -> bytes:
        if self.subs is None:
            return fmt.dump_table(self.entries)
        pairs = list(map(ext_entry, self.entries, self.subs))
        return fmt.join_l2(array("Q", (e for e, _ in pairs)), array("Q", (s for _, s in pairs)))

    def touch(self) -> None:
        self.dirty = True
        self.gen += 1


def _eio(what: str) -> OSError:
    return OSError(errno.EIO, what)


def _nclusters(offset: int, length: int, cs: int) -> int:
    return 0 if length <= 0 else (offset + length - 1) // cs - offset // cs + 1


def _zero_buf(n: int) -> Any:
    """``n`` zero bytes (a slice of a shared buffer when it is long enough)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else aligned(n)


def _fill_zero(view: memoryview) -> None:
    n = len(view)
    pos = 0
    while pos < n:
        k = min(n - pos, len(_ZEROS))
        view[pos:pos + k] = _ZEROS[:k]
        pos += k
