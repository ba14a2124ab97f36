"""What ``aioublk img map`` says of an image: where each range of the disk
lives, through its backing chain, in qemu-img map's entries and words.

Each layer is read through a callable (no I/O here): a qcow2 image's L1
and L2 tables give its runs (data at a host offset, compressed, zero,
or not allocated), and a range no layer allocates falls through to the
next one, down to a raw file (data at the same offset) or to nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aioublk.qcow2 import format as fmt
from aioublk.qcow2.check import Read, l2_table
from aioublk.qcow2.format import COMPRESSED, OFFSET_MASK, ZERO

DATA, PACKED, ZEROS, NONE = "data", "compressed", "zero", "unallocated"

#: the holes in ``[offset, offset + length)`` of a layer's file, as (start, end)
Holes = Callable[[int, int], list[tuple[int, int]]]


def no_holes(offset: int, length: int) -> list[tuple[int, int]]:
    return []


@dataclass
class Layer:
    """One image of the chain: a qcow2 image (``header`` set) or a raw file."""

    filename: str
    read: Read
    size: int  # its virtual size (a raw file's length)
    header: fmt.Header | None = None
    #: a hole in the file reads as zeros: its data is zero too (as QEMU says)
    holes: Holes = no_holes
    _l1: list[int] | None = field(default=None, repr=False)

    def runs(self, start: int, end: int) -> Iterator[tuple[int, int, str, int | None]]:
        """(start, length, kind, host offset) over ``[start, end)`` in this layer alone."""
        h = self.header
        if h is None:
            if start < self.size:
                yield start, min(end, self.size) - start, DATA, start
            if end > self.size:
                yield max(start, self.size), end - max(start, self.size), NONE, None
            return
        cs, per = h.cluster_size, h.l2_entries
        if self._l1 is None:
            raw = self.read(h.l1_table_offset, h.l1_size * 8)
            self._l1 = list(fmt.load_table(raw[:len(raw) & ~7]))
        pos = start
        while pos < end:
            i, j = divmod(pos // cs, per)
            l2 = self._l1[i] & OFFSET_MASK if i < len(self._l1) else 0
            table_end = min(end, (i + 1) * per * cs)
            if not l2 or pos >= self.size:
                yield pos, table_end - pos, NONE, None
                pos = table_end
                continue
            entries, subs = l2_table(self.read, l2, h)
            sc = cs // fmt.SUBCLUSTERS
            while pos < table_end:
                k = (pos // cs) % per
                e = entries[k]
                stop = min(table_end, (pos // cs + 1) * cs)
                if subs is not None and not e & COMPRESSED:
                    # per subcluster: allocated, zero, or neither
                    stop = min(table_end, (pos // sc + 1) * sc)
                    sub = pos % cs // sc
                    e = e & ~ZERO if subs[k] >> sub & 1 else \
                        e | ZERO if subs[k] >> (32 + sub) & 1 else 0
                host = e & OFFSET_MASK
                if e & COMPRESSED:
                    yield pos, stop - pos, PACKED, None
                elif e & ZERO and h.version >= 3:
                    yield pos, stop - pos, ZEROS, (host + pos % cs) if host else None
                elif host:
                    yield pos, stop - pos, DATA, host + pos % cs
                else:
                    yield pos, stop - pos, NONE, None
                pos = stop


@dataclass
class Entry:
    """One line of qemu-img map."""

    start: int
    length: int
    depth: int
    present: bool
    zero: bool
    data: bool
    offset: int | None
    filename: str

    def follows(self, e: Entry) -> bool:
        """Whether ``self`` merges into ``e``, which ends where it starts (qemu-img's rule)."""
        same = (self.zero, self.data, self.depth, self.present, self.filename,
                self.offset is None) == (e.zero, e.data, e.depth, e.present, e.filename,
                                         e.offset is None)
        return same and (self.offset is None or
                         e.offset is not None and e.offset + e.length == self.offset)


def _entries(chain: list[Layer], depth: int, start: int, end: int) -> Iterator[Entry]:
    layer = chain[depth]
    for pos, length, kind, host in layer.runs(start, end):
        # below: the backing file, as far as it goes (past its end: nothing, here)
        below = min(pos + length, chain[depth + 1].size) if depth + 1 < len(chain) else pos
        if kind == NONE and below > pos:
            yield from _entries(chain, depth + 1, pos, below)
        if kind == NONE and below < pos + length:
            yield Entry(max(pos, below), pos + length - max(pos, below), depth, False, True,
                        False, None, layer.filename)
        elif kind == DATA and host is not None:
            yield from _split_holes(layer, depth, pos, length, host)
        elif kind != NONE:
            yield Entry(pos, length, depth, True, kind == ZEROS, kind == PACKED, host,
                        layer.filename)


def _split_holes(layer: Layer, depth: int, pos: int, length: int, host: int) -> Iterator[Entry]:
    """A data run, its parts in holes of the file marked zero, as QEMU's
    file layer reports them under the format's answer."""
    at = host
    for start, end in layer.holes(host, length):
        if start > at:
            yield Entry(pos + at - host, start - at, depth, True, False, True, at,
                        layer.filename)
        # (a qcow2 cluster there is still its data; a raw file's hole is not)
        yield Entry(pos + start - host, end - start, depth, True, True,
                    layer.header is not None, start, layer.filename)
        at = end
    if at < host + length:
        yield Entry(pos + at - host, host + length - at, depth, True, False, True, at,
                    layer.filename)


def block_map(chain: list[Layer]) -> list[Entry]:
    """The map of ``chain[0]`` (its backing files after it), merged as qemu-img merges."""
    out: list[Entry] = []
    for e in _entries(chain, 0, 0, chain[0].size):
        if out and out[-1].start + out[-1].length == e.start and e.follows(out[-1]):
            out[-1].length += e.length
        else:
            out.append(e)
    return out


def json_lines(entries: list[Entry]) -> str:
    """qemu-img map --output json, byte for byte."""
    rows = []
    for e in entries:
        row = (f'{{ "start": {e.start}, "length": {e.length}, "depth": {e.depth}, '
               f'"present": {str(e.present).lower()}, "zero": {str(e.zero).lower()}, '
               f'"data": {str(e.data).lower()}')
        if e.offset is not None:
            row += f', "offset": {e.offset}'
        rows.append(row + "}")
    return "[" + ",\n".join(rows) + "]\n"


def human_lines(entries: list[Entry]) -> tuple[list[str], str | None]:
    """qemu-img map's table (the ranges with data, where they are and in
    which file) up to the first range it cannot show, and why it stopped."""
    def hx(v: int) -> str:
        return f"{v:#x}" if v else "0"

    lines = [f"{'Offset':<16}{'Length':<16}{'Mapped to':<16}File"]
    for e in entries:
        if e.data and not e.zero:
            if e.offset is None:
                return lines, "File contains external, encrypted or compressed clusters."
            lines.append(f"{hx(e.start):<16}{hx(e.length):<16}{hx(e.offset):<16}{e.filename}")
    return lines, None
