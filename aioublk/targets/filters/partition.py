"""The partition filter: the window one partition of the inner device's
MBR or GPT holds, as nbdkit's partition filter, and the partition-table
parsing it reads the window with."""

from __future__ import annotations

import asyncio
import mmap
import threading
import uuid
from collections.abc import Callable

from aioublk.ring import Ring
from aioublk.target import Target
from aioublk.targets.filters.offset import OffsetFilter
from aioublk.targets.spec import INT, FilterSpec, Option


class PartitionFilter(OffsetFilter):
    """Serve partition ``partition`` (from 1; an MBR's logical ones from 5) of
    the inner device's MBR or GPT partition table, as nbdkit's partition
    filter: an offset window, read from the table when the stack is built
    (through the inner target, on a ring of its own), so C still serves a
    loop's requests."""

    name = "partition"

    def __init__(self, inner: Target, partition: int) -> None:
        lbs = inner.geometry.logical_block_size
        try:
            start, size = find_partition(lambda at, n: _peek(inner, at, n), lbs, partition)
        except OSError as e:
            raise ValueError(f"cannot read the partition table through the {inner.name} "
                             f"target: {e.strerror or e}") from None
        self.partition = partition
        super().__init__(inner, start, size)

    def settings(self) -> dict[str, object]:
        return {"partition": self.partition, **super().settings()}


#: MBR partition types of an extended partition (DOS, LBA, Linux): a chain of EBRs
EXTENDED = (0x05, 0x0F, 0x85)
#: EBRs followed at most (Linux's msdos parser stops sooner)
MAX_LOGICAL = 256


def find_partition(read: Callable[[int, int], bytes], lbs: int,
                   number: int) -> tuple[int, int]:
    """(first byte, bytes) of partition ``number`` of an MBR, numbered as
    Linux numbers them (1-4 primary, 5 on the logical ones of the extended
    partition's chain), or of entry ``number`` of a GPT (its protective MBR
    leads to it), on a disk of ``lbs``-byte sectors read through
    ``read(offset, length)``; raises ValueError naming what is missing."""
    mbr = read(0, 512)
    if mbr[510:512] != b"\x55\xaa":
        raise ValueError("no partition table (no MBR signature in sector 0): give an offset "
                         "filter instead")
    entries = [_mbr_entry(mbr, i) for i in range(4)]
    if any(kind == 0xEE for kind, _, _ in entries):
        return _gpt_partition(read, lbs, number)
    if number > 4:
        return _logical_partition(read, lbs, number, entries)
    if number < 1:
        raise ValueError(f"partition {number}: MBR partitions count from 1")
    kind, start, sectors = entries[number - 1]
    if kind == 0 or not sectors:
        raise ValueError(f"partition {number} is empty in the MBR")
    if kind in EXTENDED:
        raise ValueError(f"partition {number} is an extended partition: give one of its "
                         "logical partitions (5 and on)")
    return start * lbs, sectors * lbs


def _mbr_entry(sector: bytes, i: int) -> tuple[int, int, int]:
    """(type, first sector, sectors) of entry ``i`` of an MBR or EBR."""
    e = sector[446 + 16 * i:462 + 16 * i]
    return e[4], int.from_bytes(e[8:12], "little"), int.from_bytes(e[12:16], "little")


def _logical_partition(read: Callable[[int, int], bytes], lbs: int, number: int,
                       primary: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Logical partition ``number`` (5 and on): the extended partition holds a
    chain of EBRs, each with its partition (first sector counted from the
    EBR) and a link to the next EBR (counted from the extended partition)."""
    extended = [start for kind, start, sectors in primary if kind in EXTENDED and sectors]
    if not extended:
        raise ValueError(f"partition {number}: this MBR has no extended partition, so no "
                         "logical ones (give 1-4)")
    base = ebr = extended[0]
    found, seen = 4, set()
    for _ in range(MAX_LOGICAL):
        if ebr in seen:
            raise ValueError(f"partition {number}: the extended partition's chain of EBRs "
                             f"comes back to sector {ebr} (a loop): check it with fdisk -l")
        seen.add(ebr)
        sector = read(ebr * lbs, 512)
        if sector[510:512] != b"\x55\xaa":
            raise ValueError(f"partition {number}: no EBR signature at sector {ebr}: the "
                             "extended partition's chain is damaged (check it with fdisk -l)")
        kind, start, sectors = _mbr_entry(sector, 0)
        if kind and sectors:
            found += 1
            if found == number:
                return (ebr + start) * lbs, sectors * lbs
        link, next_start, next_sectors = _mbr_entry(sector, 1)
        if not link or not next_sectors:
            break
        ebr = base + next_start
    else:
        raise ValueError(f"partition {number}: the extended partition's chain of EBRs is "
                         f"longer than {MAX_LOGICAL}: check it with fdisk -l")
    have = "none" if found == 4 else f"5-{found}"
    raise ValueError(f"partition {number}: this MBR's logical partitions are {have}")


def _gpt_partition(read: Callable[[int, int], bytes], lbs: int,
                   number: int) -> tuple[int, int]:
    header = read(lbs, 92)
    if header[:8] != b"EFI PART":
        raise ValueError(f"a protective MBR but no GPT header at byte {lbs}: check the "
                         "logical block size")
    table = int.from_bytes(header[72:80], "little")
    count = int.from_bytes(header[80:84], "little")
    size = int.from_bytes(header[84:88], "little")
    if not 1 <= number <= count or size < 128:
        raise ValueError(f"partition {number}: this GPT has entries 1-{count}")
    entry = read(table * lbs + (number - 1) * size, 128)
    if uuid.UUID(bytes_le=entry[:16]).int == 0:
        raise ValueError(f"partition {number} is unused in the GPT")
    first, last = int.from_bytes(entry[32:40], "little"), int.from_bytes(entry[40:48], "little")
    if last < first:
        raise ValueError(f"partition {number}'s GPT entry ends before it starts")
    return first * lbs, (last - first + 1) * lbs


def _peek(target: Target, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` through ``target.read``, before any device
    exists: on a thread with its own loop and ring (a caller's loop, if any,
    is not disturbed), into page-aligned memory (O_DIRECT)."""
    span = -(-(offset % 4096 + length) // 4096) * 4096
    buf = mmap.mmap(-1, span)
    result: list[BaseException | None] = [None]

    async def read() -> None:
        ring = Ring(8, bind_thread=True)
        try:
            await target.read(offset - offset % 4096, memoryview(buf))
        finally:
            ring.close()

    def run() -> None:
        try:
            asyncio.run(read())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result[0] = e
    t = threading.Thread(target=run, name="aioublk-peek")
    t.start()
    t.join()
    if result[0] is not None:
        raise result[0]
    return bytes(buf[offset % 4096:offset % 4096 + length])


SPEC = FilterSpec(
    "partition", PartitionFilter,
    "one partition of the device's MBR or GPT (C still serves a loop's)", (
        Option("partition", INT, "its number, from 1 (an MBR's logical ones from 5, "
               "as Linux numbers them)", required=True, lo=1),), rank=2)
