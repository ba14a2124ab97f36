"""Reading and replaying dm-log-writes logs, on logs written here the way the
kernel's target writes them."""

from __future__ import annotations

import io
import struct

import pytest

from bench.suites.logwrites import (
    DISCARD,
    FLUSH,
    FUA,
    MAGIC,
    MARK,
    METADATA,
    LogError,
    Replayer,
    pick,
    read_log,
)


class LogWriter:
    """Lays out a log as dm-log-writes does: the super in sector 0, then per
    entry a header sector (a mark's name after the header) and its data."""

    def __init__(self, sectorsize: int = 512) -> None:
        self.ss = sectorsize
        self.body = bytearray()
        self.count = 0

    def _entry(self, sector: int, nr: int, flags: int, data: bytes = b"",
               mark: bytes = b"") -> None:
        head = struct.pack("<QQQQ", sector, nr, flags, len(mark)) + mark
        self.body += head.ljust(self.ss, b"\0") + data
        self.count += 1

    def write(self, sector: int, data: bytes, flags: int = 0) -> None:
        assert len(data) % self.ss == 0
        self._entry(sector, len(data) // self.ss, flags, data)

    def flush(self) -> None:
        self._entry(0, 0, FLUSH)

    def discard(self, sector: int, nr: int) -> None:
        self._entry(sector, nr, DISCARD)

    def mark(self, name: str) -> None:
        self._entry(0, 0, MARK, mark=name.encode())

    def image(self, nr_entries: int | None = None, magic: int = MAGIC,
              version: int = 1) -> io.BytesIO:
        count = self.count if nr_entries is None else nr_entries
        sup = struct.pack("<QQQI", magic, version, count, self.ss).ljust(self.ss, b"\0")
        return io.BytesIO(sup + bytes(self.body))


def block(fill: int, ss: int = 512, n: int = 1) -> bytes:
    return bytes([fill]) * ss * n


def sample(ss: int = 512) -> LogWriter:
    w = LogWriter(ss)
    w.write(0, block(1, ss, 2))                     # 0
    w.flush()                                       # 1
    w.mark("mkfs")                                  # 2
    w.write(4, block(2, ss), METADATA)              # 3
    w.discard(0, 1)                                 # 4
    w.write(1, block(3, ss), FUA)                   # 5
    w.write(6, block(4, ss, 2))                     # 6
    w.write(2, block(5, ss), FLUSH)                 # 7: a flush that carries data
    return w


@pytest.mark.parametrize("ss", [512, 4096])
def test_parses_every_entry_kind(ss: int) -> None:
    log = read_log(sample(ss).image())
    assert log.sectorsize == ss
    got = [(e.sector, e.nr_sectors, e.flags, e.mark) for e in log.entries]
    assert got == [(0, 2, 0, None), (0, 0, FLUSH, None), (0, 0, MARK, "mkfs"),
                   (4, 1, METADATA, None), (0, 1, DISCARD, None), (1, 1, FUA, None),
                   (6, 2, 0, None), (2, 1, FLUSH, None)]
    assert [e.index for e in log.entries] == list(range(8))
    assert log.mark("mkfs") == 2 and log.marks() == {"mkfs": 2}
    assert log.durable_points() == [1, 5, 7]
    assert log.durable_points(after=log.mark("mkfs")) == [5, 7]
    assert "DISCARD sector 0 +1" in log.entries[4].describe()


@pytest.mark.parametrize("ss", [512, 4096])
def test_replays_flush_point_by_flush_point(ss: int) -> None:
    log_file = sample(ss).image()
    log = read_log(log_file)
    target = io.BytesIO(bytes(8 * ss))
    r = Replayer(log, log_file, target, 8 * ss)

    def sectors() -> list[int]:
        raw = target.getvalue()
        return [raw[i * ss] for i in range(8)]

    r.to(1)
    assert sectors() == [1, 1, 0, 0, 0, 0, 0, 0]
    r.to(5)  # the discard zeroes sector 0, the FUA write lands on sector 1
    assert sectors() == [0, 3, 0, 0, 2, 0, 0, 0]
    assert r.applied == 6
    r.to(7)
    assert sectors() == [0, 3, 5, 0, 2, 0, 4, 4]
    assert r.written == (2 + 1 + 1 + 1 + 2 + 1) * ss


def test_replay_does_not_go_back() -> None:
    log_file = sample().image()
    r = Replayer(read_log(log_file), log_file, io.BytesIO(bytes(8 * 512)), 8 * 512)
    r.to(5)
    r.to(5)  # the same point again: nothing to do
    with pytest.raises(LogError, match="already replayed.*fresh copy"):
        r.to(3)
    with pytest.raises(LogError, match="entry 8 is past the log's last, 7"):
        r.to(8)


def test_replay_past_the_target_is_refused() -> None:
    w = LogWriter()
    w.write(10, block(7))
    log_file = w.image()
    r = Replayer(read_log(log_file), log_file, io.BytesIO(bytes(4 * 512)), 4 * 512)
    with pytest.raises(LogError, match=r"entry 0: WRITE sector 10 \+1 ends at byte 5632, "
                                       r"past the replay target's 2048"):
        r.to(0)


def test_counts_only_the_entries_the_super_block_counts() -> None:
    """The target rewrites the super block only at FUA and mark entries: what
    follows the last count is not yet a log entry."""
    log = read_log(sample().image(nr_entries=3))
    assert [e.index for e in log.entries] == [0, 1, 2]


def test_not_a_log() -> None:
    with pytest.raises(LogError, match="not a dm-log-writes log: magic 0x1234"):
        read_log(sample().image(magic=0x1234))
    with pytest.raises(LogError, match="version 2: only version 1"):
        read_log(sample().image(version=2))
    with pytest.raises(LogError, match="super block needs bytes 0..28"):
        read_log(io.BytesIO(b"\0" * 10))


def test_bad_sector_size() -> None:
    raw = bytearray(sample().image().getvalue())
    struct.pack_into("<I", raw, 24, 1000)
    with pytest.raises(LogError, match="sector size 1000: not a power of two"):
        read_log(io.BytesIO(bytes(raw)))


def test_cut_short() -> None:
    raw = sample().image().getvalue()
    with pytest.raises(LogError, match="log cut short: entry 7 of 8 needs bytes"):
        read_log(io.BytesIO(raw[:-2 * 512]))  # entry 7's header is gone
    with pytest.raises(LogError, match="entry 7's data needs bytes"):
        read_log(io.BytesIO(raw[:-100]))  # only the end of its data


def test_damaged_entries() -> None:
    w = LogWriter()
    w.write(0, block(1))
    raw = bytearray(w.image().getvalue())
    struct.pack_into("<Q", raw, 512 + 16, 1 << 9)
    with pytest.raises(LogError, match="entry 0 of 1 at byte 512: unknown flags 0x200"):
        read_log(io.BytesIO(bytes(raw)))
    struct.pack_into("<QQ", raw, 512 + 16, MARK, 600)
    with pytest.raises(LogError, match="a mark of 600 bytes does not fit its 512-byte sector"):
        read_log(io.BytesIO(bytes(raw)))


def test_empty_log() -> None:
    log = read_log(LogWriter().image())
    assert log.entries == [] and log.durable_points() == []
    with pytest.raises(LogError, match="no mark 'mkfs'"):
        log.mark("mkfs")


def test_pick() -> None:
    points = list(range(10, 110))
    assert pick(points, 5) == [10, 35, 60, 84, 109]
    assert pick(points, 1) == [109]
    assert pick(points[:3], 5) == [10, 11, 12]
    assert pick(points, 0) == [] and pick([], 3) == []
    assert len(pick(points, 20)) == 20 and pick(points, 20)[-1] == 109
