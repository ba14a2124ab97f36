"""The log of the kernel's dm-log-writes target, read and replayed.

dm-log-writes sits between a file system and its device and appends every write
to a log device in the order the writes reached stable storage: a write is logged
only once a later FLUSH has completed (or at once when it was FUA). Replaying the
log onto a copy of the device's starting state, up to a FLUSH or FUA entry, gives
the device as a power cut just after that entry could have left it.

The log, all little-endian: a super block (magic, version, number of entries,
sector size) filling the first sector, then per entry one sector holding its
header (sector, number of sectors, flags, length of its private data; a mark's
name follows the header) and, unless it is a discard, the data it wrote. Sectors
are the data device's logical blocks, the log's ``sectorsize``.

Nothing here opens files: ``read_log`` and ``Replayer`` take file objects, so a
log in memory (``io.BytesIO``) works as well as a device."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = 0x6A736677736872
VERSION = 1
FLUSH, FUA, DISCARD, MARK, METADATA = 1, 2, 4, 8, 16
FLAG_NAMES = {FLUSH: "FLUSH", FUA: "FUA", DISCARD: "DISCARD", MARK: "MARK",
              METADATA: "METADATA"}
KNOWN_FLAGS = FLUSH | FUA | DISCARD | MARK | METADATA
SUPER = struct.Struct("<QQQI")
HEADER = struct.Struct("<QQQQ")
#: the dm target's own mark, logged when the target is removed
END_MARK = "dm-log-writes-end"
_CHUNK = 1 << 20


class LogError(ValueError):
    """The log is not a dm-log-writes log, or is cut short or damaged."""


@dataclass(frozen=True)
class Entry:
    """One logged write, discard, flush or mark."""

    index: int
    sector: int  # where on the data device, in the log's sectors
    nr_sectors: int
    flags: int
    data_at: int  # the byte in the log where its data starts
    mark: str | None = None

    @property
    def durable(self) -> bool:
        """A FLUSH or FUA: what was logged up to here had reached stable storage."""
        return bool(self.flags & (FLUSH | FUA))

    def describe(self) -> str:
        names = [n for f, n in FLAG_NAMES.items() if self.flags & f] or ["WRITE"]
        what = f"mark {self.mark!r}" if self.mark is not None else (
            f"sector {self.sector} +{self.nr_sectors}")
        return f"entry {self.index}: {'|'.join(names)} {what}"


@dataclass(frozen=True)
class Log:
    sectorsize: int
    entries: Sequence[Entry]

    def mark(self, name: str) -> int:
        """The index of the first mark called `name`."""
        for e in self.entries:
            if e.mark == name:
                return e.index
        raise LogError(f"the log has no mark {name!r}")

    def marks(self) -> dict[str, int]:
        """Each mark's name and the index of its first entry."""
        found: dict[str, int] = {}
        for e in self.entries:
            if e.mark is not None:
                found.setdefault(e.mark, e.index)
        return found

    def durable_points(self, after: int = -1) -> list[int]:
        """The indexes of the FLUSH and FUA entries past entry `after`."""
        return [e.index for e in self.entries if e.durable and e.index > after]


def _read_exact(f: BinaryIO, at: int, n: int, what: str) -> bytes:
    f.seek(at)
    got = f.read(n)
    if len(got) != n:
        raise LogError(f"log cut short: {what} needs bytes {at}..{at + n}, "
                       f"the log ends at byte {at + len(got)}")
    return got


def read_log(f: BinaryIO) -> Log:
    """Parse a whole log: its super block and every entry it counts."""
    head = _read_exact(f, 0, SUPER.size, "the super block")
    magic, version, nr_entries, sectorsize = SUPER.unpack(head)
    if magic != MAGIC:
        raise LogError(f"not a dm-log-writes log: magic {magic:#x}, expected {MAGIC:#x}")
    if version != VERSION:
        raise LogError(f"dm-log-writes log version {version}: only version {VERSION} is known")
    if sectorsize < 512 or sectorsize > 65536 or sectorsize & (sectorsize - 1):
        raise LogError(f"dm-log-writes log with sector size {sectorsize}: "
                       "not a power of two from 512 to 65536")
    entries = []
    at = sectorsize
    for index in range(nr_entries):
        what = f"entry {index} of {nr_entries}"
        block = _read_exact(f, at, sectorsize, what)
        sector, nr_sectors, flags, data_len = HEADER.unpack_from(block)
        if flags & ~KNOWN_FLAGS:
            raise LogError(f"{what} at byte {at}: unknown flags {flags:#x}")
        mark = None
        if flags & MARK:
            if data_len > sectorsize - HEADER.size:
                raise LogError(f"{what} at byte {at}: a mark of {data_len} bytes "
                               f"does not fit its {sectorsize}-byte sector")
            mark = block[HEADER.size:HEADER.size + data_len].decode(errors="replace")
        at += sectorsize
        entries.append(Entry(index, sector, nr_sectors, flags, at, mark))
        if not flags & DISCARD:
            at += nr_sectors * sectorsize
    if entries:  # the last entry's data must be there too
        last = entries[-1]
        if not last.flags & DISCARD and last.nr_sectors:
            size = last.nr_sectors * sectorsize
            f.seek(last.data_at + size - 1)
            if len(f.read(1)) != 1:
                raise LogError(f"log cut short: entry {last.index}'s data needs bytes "
                               f"{last.data_at}..{last.data_at + size}")
    return Log(sectorsize, entries)


class Replayer:
    """Applies a log's entries in order onto a target (a copy of the data
    device's starting state), forward only, from where it last stopped."""

    def __init__(self, log: Log, source: BinaryIO, target: BinaryIO, size: int) -> None:
        self.log, self.source, self.target, self.size = log, source, target, size
        self.applied = 0  # entries [0, applied) are on the target
        self.written = 0  # bytes written to the target, discards included

    def to(self, index: int) -> None:
        """Replay up to and including entry `index`."""
        if index >= len(self.log.entries):
            raise LogError(f"entry {index} is past the log's last, "
                           f"{len(self.log.entries) - 1}")
        if index < self.applied - 1:
            raise LogError(f"entry {index} is already replayed (up to "
                           f"{self.applied - 1}): replay onto a fresh copy to go back")
        for entry in self.log.entries[self.applied:index + 1]:
            self._apply(entry)
            self.applied = entry.index + 1
        self.target.flush()

    def _apply(self, e: Entry) -> None:
        if not e.nr_sectors or e.flags & MARK:
            return
        ss = self.log.sectorsize
        start, length = e.sector * ss, e.nr_sectors * ss
        if start + length > self.size:
            raise LogError(f"{e.describe()} ends at byte {start + length}, past the "
                           f"replay target's {self.size}")
        done = 0
        while done < length:
            n = min(_CHUNK, length - done)
            if e.flags & DISCARD:
                data = bytes(n)  # what a discarded range reads back as here
            else:
                data = _read_exact(self.source, e.data_at + done, n, e.describe())
            self.target.seek(start + done)
            self.target.write(data)
            done += n
        self.written += length


def pick(points: Sequence[int], most: int) -> list[int]:
    """At most `most` of `points`, evenly spread, always the last one."""
    if most <= 0 or not points:
        return []
    if len(points) <= most:
        return list(points)
    if most == 1:
        return [points[-1]]
    step = (len(points) - 1) / (most - 1)
    return sorted({points[round(i * step)] for i in range(most)})
