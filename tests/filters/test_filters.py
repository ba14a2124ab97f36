"""Filters on the host: each built-in's effect on a target in memory, what
becomes of the inner map, and how stacks are given and refused (no kernel)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aioublk.dataplane.maps import Linear, Null, Striped
from aioublk.errors import UblkError
from aioublk.frontend import addargs, config, maketarget, registry, verb
from aioublk.frontend.kublk_lines import target_line
from aioublk.target import Geometry, Target
from aioublk.targets.filters.base import Filter
from aioublk.targets.filters.cache import CacheFilter
from aioublk.targets.filters.cow import CowFilter
from aioublk.targets.filters.delay import DelayFilter
from aioublk.targets.filters.error import ErrorFilter
from aioublk.targets.filters.log import LogFilter
from aioublk.targets.filters.partition import find_partition
from aioublk.targets.filters.protect import ProtectFilter
from aioublk.targets.filters.rate import RateFilter

MiB = 1 << 20


class Memory(Target):
    """A disk in a bytearray, its map whatever the test says."""

    name = "memory"

    def __init__(self, size: int = 4 * MiB, the_map: Any = None,
                 data: bytearray | None = None) -> None:
        self.data = bytearray(data) if data is not None else bytearray(size)
        self.geometry = Geometry(size=size, discard=True, write_zeroes=True)
        self.the_map = the_map
        self.closed = False
        self.calls: list[tuple[str, int, int]] = []

    def map(self) -> Any:
        return self.the_map

    async def read(self, offset: int, buf: Any) -> None:
        self.calls.append(("read", offset, len(buf)))
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, buf: Any, fua: bool = False) -> None:
        self.calls.append(("write", offset, len(buf)))
        self.data[offset:offset + len(buf)] = buf

    async def discard(self, offset: int, length: int) -> None:
        self.calls.append(("discard", offset, length))
        self.data[offset:offset + length] = bytes(length)

    async def flush(self) -> None:
        self.calls.append(("flush", 0, 0))

    def close(self) -> None:
        self.closed = True


def stacked(specs: list[str], inner: Target | None = None) -> Target:
    return registry.with_filters(inner or Memory(), registry.filter_stack(specs))


def test_offset_moves_requests_and_keeps_a_linear_map() -> None:
    inner = Memory(the_map=Linear(7, 4096))
    top = stacked(["offset:offset=1M,size=2M"], inner)
    assert top.geometry.size == 2 * MiB
    assert top.map() == Linear(7, 4096 + MiB)
    asyncio.run(top.write(512, memoryview(b"x" * 512)))
    assert inner.data[MiB + 512:MiB + 1024] == b"x" * 512
    buf = bytearray(512)
    asyncio.run(top.read(512, memoryview(buf)))
    assert buf == b"x" * 512


@pytest.mark.parametrize("inner_map,expected", [
    (Null(), Null()), (Striped((3, 4), 65536), None), (None, None)])
def test_offset_keeps_only_maps_that_shift(inner_map: Any, expected: Any) -> None:
    assert stacked(["offset:offset=64K"], Memory(the_map=inner_map)).map() == expected


def test_placement_filters_stack_and_keep_the_map() -> None:
    top = stacked(["readonly", "truncate:size=1M", "offset:offset=1M"],
                  Memory(the_map=Linear(3)))
    assert top.map() == Linear(3, MiB)
    assert top.geometry.size == MiB and top.geometry.read_only
    with pytest.raises(OSError) as e:
        asyncio.run(top.write(0, memoryview(bytes(512))))
    assert e.value.errno == errno.EROFS
    assert [f["name"] for f in top.describe()["filters"]] == [  # type: ignore[attr-defined]
        "readonly", "truncate", "offset"]


def test_filters_pass_on_whether_to_pin_the_workers() -> None:
    local = Memory()
    local.pin_workers = False  # (as -t nbd over a unix socket says)
    assert not stacked(["readonly", "delay:read=1ms", "error:rate=0"], local).pin_workers
    assert stacked(["readonly", "delay:read=1ms"]).pin_workers


def test_data_filters_take_the_map_away() -> None:
    for spec in ("delay:read=1ms", "error:rate=0"):
        top = stacked([spec], Memory(the_map=Linear(3)))
        assert isinstance(top, Filter) and top.map() is None and not top.placement


def test_delay_holds_only_the_operations_named() -> None:
    inner = Memory()
    top = DelayFilter(inner, read=0.05)

    async def timed(op: str) -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if op == "read":
            await top.read(0, memoryview(bytearray(512)))
        else:
            await top.write(0, memoryview(bytes(512)))
        return loop.time() - t0
    assert asyncio.run(timed("read")) >= 0.05
    assert asyncio.run(timed("write")) < 0.05
    assert [c[0] for c in inner.calls] == ["read", "write"]


def test_error_fails_matching_requests_only() -> None:
    inner = Memory()
    top = ErrorFilter(inner, ops="write+discard", errno="ENOSPC", offset=MiB, length=MiB)

    def result(coro: Any) -> int:
        try:
            asyncio.run(coro)
            return 0
        except OSError as e:
            return e.errno or 0
    buf = memoryview(bytes(4096))
    assert result(top.write(MiB - 4096, buf)) == 0  # before the range
    assert result(top.write(MiB - 2048, buf)) == errno.ENOSPC  # straddles it
    assert result(top.write(2 * MiB, buf)) == 0  # after it
    assert result(top.read(MiB, memoryview(bytearray(4096)))) == 0  # not an op named
    assert result(top.discard(MiB, 4096)) == errno.ENOSPC
    assert [c[1] for c in inner.calls if c[0] == "write"] == [MiB - 4096, 2 * MiB]


def test_error_rate_fails_about_that_share() -> None:
    top = ErrorFilter(Memory(), rate=0.25, seed=1)
    failed = 0
    for _ in range(2000):
        try:
            asyncio.run(top.flush())
        except OSError:
            failed += 1
    assert 400 < failed < 600


def test_error_hang_holds_requests_until_the_server_stops() -> None:
    """``hang`` answers nothing it matches until ``stopping`` (called from
    another thread, as a device's stop is); then those fail with ``errno``,
    and so does any that comes after."""
    inner = Memory()
    top = ErrorFilter(inner, ops="read", errno="EIO", hang=True)

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        held = asyncio.ensure_future(top.read(0, memoryview(bytearray(4096))))
        await top.write(0, memoryview(bytes(4096)))  # (not an op named: answered)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not held.done() and ("read", 0, 4096) not in inner.calls
        await asyncio.to_thread(top.stopping)
        first = await asyncio.gather(held, return_exceptions=True)
        later = await asyncio.gather(top.read(0, memoryview(bytearray(4096))),
                                     return_exceptions=True)
        return first[0], later[0]

    first, later = asyncio.run(scenario())
    for e in (first, later):
        assert isinstance(e, OSError) and e.errno == errno.EIO
    assert [c[0] for c in inner.calls] == ["write"]

    async def served_again() -> bool:
        top.configure(0)  # (a new start of the same target, as a recovery's)
        held = asyncio.ensure_future(top.read(0, memoryview(bytearray(4096))))
        for _ in range(20):
            await asyncio.sleep(0)
        waiting = not held.done()
        top.stopping()
        await asyncio.gather(held, return_exceptions=True)
        return waiting

    assert asyncio.run(served_again())


@pytest.mark.parametrize("where", ["memory", "file"])
def test_cow_keeps_the_inner_device_unwritten(where: str, tmp_path: Path) -> None:
    inner = Memory()
    inner.data[:] = bytes(range(256)) * (len(inner.data) // 256)
    before = bytes(inner.data)
    top = CowFilter(inner, file=str(tmp_path / "overlay") if where == "file" else None)
    model = bytearray(before)

    async def scenario() -> None:
        for offset, n in ((1000, 5000), (4096, 4096), (9000, 100), (4 * MiB - 700, 700)):
            data = os.urandom(n)
            model[offset:offset + n] = data
            await top.write(offset, memoryview(data))
        await top.discard(16384, 8192)
        model[16384:16384 + 8192] = bytes(8192)
        await top.write_zeroes(20000, 3000)
        model[20000:23000] = bytes(3000)
        for offset, n in ((0, 65536), (999, 3), (4 * MiB - 8192, 8192)):
            buf = bytearray(n)
            await top.read(offset, memoryview(buf))
            assert buf == model[offset:offset + n], (offset, n)
    asyncio.run(scenario())
    assert bytes(inner.data) == before
    assert not [c for c in inner.calls if c[0] != "read"]
    top.close()


def test_protect_refuses_writes_to_its_ranges_only() -> None:
    inner = Memory()
    [(_, options)] = registry.filter_stack(["protect:ranges=0-4K+1M-2M"])
    top = ProtectFilter(inner, options["ranges"])
    for offset, n, refused in ((0, 512, True), (4096, 512, False), (MiB - 512, 1024, True),
                               (2 * MiB, 4096, False)):
        try:
            asyncio.run(top.write(offset, memoryview(bytes(n))))
            assert not refused, offset
        except OSError as e:
            assert refused and e.errno == errno.EPERM, offset
    with pytest.raises(OSError):
        asyncio.run(top.discard(MiB, 4096))
    asyncio.run(top.read(0, memoryview(bytearray(4096))))


def test_protect_over_loop_keeps_c_with_read_only_granules() -> None:
    from aioublk.dataplane.maps import Extents
    inner = Memory(8 * MiB, the_map=Linear(9, 1 << 20))
    top = stacked(["protect:ranges=1M-2M+6M-6656K"], inner)
    got = top.map()
    assert isinstance(got, Extents) and got.table.granule == 512 << 10
    pieces = got.table.lookup(0, MiB, write=True)
    assert pieces == [(9, 1 << 20, MiB)]  # writable: C writes it
    assert got.table.lookup(MiB, 4096, write=True) is None  # fenced: a miss to Python
    assert got.table.lookup(MiB, 4096, write=False) == [(9, 2 * MiB, 4096)]  # read by C
    assert got.table.lookup(6 * MiB + 512 * 1024, 4096, write=True) is not None
    assert stacked(["protect:ranges=1000-2000"], Memory(the_map=Linear(9))).map() is None
    top.close()


@pytest.mark.parametrize("ranges", ["", "4K", "2M-1M", "x-1M"])
def test_protect_refuses_bad_ranges(ranges: str) -> None:
    with pytest.raises(UblkError) as e:
        stacked([f"protect:ranges={ranges}"])
    assert "protect" in str(e.value) and "\n" not in str(e.value)


def test_cow_commit_writes_the_overlay_back_once_at_stop() -> None:
    inner = Memory()
    top = stacked(["cow:commit=true,block=8K"], inner)

    async def scenario() -> None:
        await top.write(1000, memoryview(b"c" * 3000))
        assert inner.data[1000:4000] == bytes(3000)
        await asyncio.gather(top.drain(), top.drain())  # (every queue drains)
    asyncio.run(scenario())
    assert inner.data[1000:4000] == b"c" * 3000
    assert [c[:2] for c in inner.calls if c[0] == "write"] == [("write", 0)]


def _gpt_disk(path: Path) -> Path:
    path.write_bytes(b"")
    os.truncate(path, 64 * MiB)
    subprocess.run(["sgdisk", "-n", "1:2048:+8M", "-n", "2:0:+16M", str(path)],
                   check=True, capture_output=True)
    return path


def _sgdisk_extent(path: Path, number: int) -> tuple[int, int]:
    out = subprocess.run(["sgdisk", "-i", str(number), str(path)], check=True,
                         capture_output=True, text=True).stdout
    first = int(out.split("First sector: ")[1].split()[0])
    last = int(out.split("Last sector: ")[1].split()[0])
    return first * 512, (last - first + 1) * 512


def test_partition_serves_what_sgdisk_made(tmp_path: Path) -> None:
    from aioublk.targets.loop import LoopTarget
    disk = _gpt_disk(tmp_path / "gpt.img")
    start, size = _sgdisk_extent(disk, 2)
    top = stacked(["partition:partition=2"], LoopTarget(str(disk)))
    try:
        assert top.geometry.size == size == 16 * MiB
        assert top.map() == Linear(top.inner.map().fd, start)  # type: ignore[attr-defined]
        assert top.describe()["filters"] == [{
            "name": "partition", "partition": 2, "offset": start, "size": size}]
    finally:
        top.close()


def _mbr_disk(path: Path, size: int, *parts: tuple[str, str, str]) -> Path:
    """A ``size``-byte file with an MBR parted wrote: each part (kind, start, end)."""
    path.write_bytes(b"")
    os.truncate(path, size)
    subprocess.run(["parted", "-s", str(path), "mklabel", "msdos",
                    *(w for kind, start, end in parts for w in ("mkpart", kind, start, end))],
                   check=True, capture_output=True)
    return path


def test_partition_reads_an_mbr_parted_made(tmp_path: Path) -> None:
    disk = _mbr_disk(tmp_path / "mbr.img", 32 * MiB, ("primary", "1MiB", "5MiB"),
                     ("primary", "5MiB", "13MiB"))
    inner = Memory(32 * MiB)
    inner.data[:] = disk.read_bytes()
    top = stacked(["partition:partition=2"], inner)
    assert (top.offset, top.geometry.size) == (5 * MiB, 8 * MiB)  # type: ignore[attr-defined]
    for number, message in ((3, "partition 3 is empty in the MBR"),
                            (5, "this MBR has no extended partition, so no logical ones")):
        with pytest.raises(UblkError) as e:
            stacked([f"partition:partition={number}"], Memory(32 * MiB, data=inner.data))
        assert message in str(e.value)


def _parted_extents(path: Path) -> dict[int, tuple[int, int]]:
    """parted's own reading of the table: number -> (first byte, bytes)."""
    out = subprocess.run(["parted", "-s", "-m", str(path), "unit", "B", "print"], check=True,
                         capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines()[2:]:
        number, start, _end, size = line.split(":")[:4]
        found[int(number)] = (int(start.rstrip("B")), int(size.rstrip("B")))
    return found


def test_partition_serves_logical_partitions_as_linux_numbers_them(tmp_path: Path) -> None:
    """An extended partition's chain of EBRs: logical partitions are 5 and
    on, each where parted (and the kernel) put it."""
    disk = _mbr_disk(tmp_path / "ext.img", 64 * MiB, ("primary", "1MiB", "5MiB"),
                     ("extended", "5MiB", "60MiB"), ("logical", "6MiB", "10MiB"),
                     ("logical", "11MiB", "20MiB"), ("logical", "21MiB", "59MiB"))
    parted = _parted_extents(disk)
    assert sorted(parted) == [1, 2, 5, 6, 7]
    inner = Memory(64 * MiB, data=bytearray(disk.read_bytes()))
    for number in (1, 5, 6, 7):
        top = stacked([f"partition:partition={number}"], inner)
        assert (top.offset, top.geometry.size) == parted[number]  # type: ignore[attr-defined]
    for number, message in ((2, "partition 2 is an extended partition: give one of its "
                                "logical partitions (5 and on)"),
                            (8, "partition 8: this MBR's logical partitions are 5-7")):
        with pytest.raises(UblkError) as e:
            stacked([f"partition:partition={number}"], inner)
        assert message in str(e.value)


def test_a_looping_ebr_chain_is_refused(tmp_path: Path) -> None:
    disk = _mbr_disk(tmp_path / "ext.img", 64 * MiB, ("extended", "1MiB", "60MiB"),
                     ("logical", "2MiB", "10MiB"))
    data = bytearray(disk.read_bytes())
    ebr = 1 * MiB  # the first EBR, at the extended partition's start
    data[ebr + 462:ebr + 478] = bytes([0, 0, 0, 0, 5, 0, 0, 0]) + (0).to_bytes(4, "little") \
        + (2048).to_bytes(4, "little")  # its link: back to itself
    with pytest.raises(UblkError) as e:
        stacked(["partition:partition=9"], Memory(64 * MiB, data=data))
    assert "chain of EBRs comes back to sector 2048 (a loop)" in str(e.value)


def test_an_mbr_counts_in_logical_blocks() -> None:
    """On a 4K-sector disk an MBR's first sector and length are in 4096-byte
    units, as Linux reads them (msdos.c scales by the logical block size)."""
    mbr = bytearray(512)
    mbr[446 + 4] = 0x83
    mbr[446 + 8:446 + 16] = (256).to_bytes(4, "little") + (1024).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    assert find_partition(lambda at, n: bytes(mbr[at:at + n]), 4096, 1) == (1 * MiB, 4 * MiB)
    assert find_partition(lambda at, n: bytes(mbr[at:at + n]), 512, 1) == (128 << 10,
                                                                           512 << 10)


def test_partition_refuses_a_disk_without_a_table(tmp_path: Path) -> None:
    with pytest.raises(UblkError) as e:
        stacked(["partition:partition=1"])
    assert "no partition table (no MBR signature in sector 0)" in str(e.value)
    disk = _gpt_disk(tmp_path / "gpt.img")
    inner = Memory(64 * MiB, data=bytearray(disk.read_bytes()))
    with pytest.raises(UblkError) as e:
        stacked(["partition:partition=3"], inner)
    assert "partition 3 is unused in the GPT" in str(e.value)


class Slow(Memory):
    """A Memory whose I/O yields to the loop first, so requests interleave."""

    async def read(self, offset: int, buf: Any) -> None:
        await asyncio.sleep(0)
        await super().read(offset, buf)

    async def write(self, offset: int, buf: Any, fua: bool = False) -> None:
        await asyncio.sleep(0)
        await super().write(offset, buf, fua)


@pytest.mark.parametrize("mode", ["writethrough", "writeback"])
def test_cache_reads_what_was_written_through_evictions(mode: str) -> None:
    import random
    rnd = random.Random(7)
    inner = Slow()
    inner.data[:] = os.urandom(len(inner.data))
    model = bytearray(inner.data)
    top = CacheFilter(inner, size=64 << 10, block=8192, mode=mode)

    async def scenario() -> None:
        for _ in range(300):
            offset = rnd.randrange(0, 1 << 20, 512)
            n = rnd.choice((512, 4096, 8192, 20480))
            op = rnd.random()
            if op < 0.45:
                data = os.urandom(n)
                model[offset:offset + n] = data
                await top.write(offset, memoryview(data), fua=rnd.random() < 0.1)
            elif op < 0.5:
                model[offset:offset + n] = bytes(n)
                await top.discard(offset, n)
            elif op < 0.55:
                await top.flush()
                assert inner.data == model
            else:
                buf = bytearray(n)
                await top.read(offset, memoryview(buf))
                assert buf == model[offset:offset + n], (offset, n)
        await top.flush()
    asyncio.run(scenario())
    assert inner.data == model
    assert len(top.blocks) <= top.slots


def test_cache_write_back_waits_for_flush_and_fua_does_not() -> None:
    inner = Memory()
    top = CacheFilter(inner, size=1 << 20, block=4096, mode="writeback")
    assert top.geometry.volatile_cache and top.geometry.fua

    async def scenario() -> None:
        await top.write(8192, memoryview(b"w" * 4096))
        assert inner.data[8192:12288] == bytes(4096)  # dirty in RAM only
        await top.write(0, memoryview(b"f" * 512), fua=True)
        assert inner.data[:512] == b"f" * 512
        await top.flush()
        assert inner.data[8192:12288] == b"w" * 4096
    asyncio.run(scenario())


def test_cache_drops_a_fill_a_write_overtook() -> None:
    inner = Slow()
    top = CacheFilter(inner, block=4096)

    async def scenario() -> None:
        buf = bytearray(4096)
        await asyncio.gather(top.read(0, memoryview(buf)),
                             top.write(0, memoryview(b"n" * 4096)))
        again = bytearray(4096)
        await top.read(0, memoryview(again))
        assert again == b"n" * 4096  # not the old bytes the first read fetched
    asyncio.run(scenario())


def test_cache_writes_through_under_user_recovery() -> None:
    from aioublk.kernel import uapi
    top = CacheFilter(Memory(), mode="writeback")
    top.configure(uapi.Feature.USER_RECOVERY)
    assert top.mode == "writethrough"


def test_rate_paces_requests_and_bytes() -> None:
    async def elapsed(top: Target, n: int, size: int) -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(top.read(0, memoryview(bytearray(size))) for _ in range(n)))
        return loop.time() - t0
    # a second's burst, then the rest at the rate
    assert 0.9 < asyncio.run(elapsed(RateFilter(Memory(), iops=100), 200, 512)) < 5
    assert 0.9 < asyncio.run(elapsed(RateFilter(Memory(), bandwidth=MiB), 16, 128 << 10)) < 5
    assert asyncio.run(elapsed(RateFilter(Memory(), iops=1000), 100, 512)) < 0.9  # the burst


def test_log_writes_a_json_line_per_request_and_rotates(tmp_path: Path) -> None:
    log = tmp_path / "req.log"
    top = LogFilter(ErrorFilter(Memory(), ops="discard", errno="ENOSPC"), str(log),
                    max_size=4096, keep=2)
    asyncio.run(top.write(4096, memoryview(bytes(512)), fua=True))
    with pytest.raises(OSError):
        asyncio.run(top.discard(0, 8192))
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    assert {k: first[k] for k in ("op", "offset", "length", "result")} == {
        "op": "write_fua", "offset": 4096, "length": 512, "result": 0}
    assert second["op"] == "discard" and second["result"] == -errno.ENOSPC
    assert first["latency_us"] >= 0
    for _ in range(200):
        asyncio.run(top.flush())
    top.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["req.log", "req.log.1", "req.log.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())


@pytest.mark.parametrize("specs,message", [
    (["delya:read=1ms"], "unknown filter 'delya' (did you mean \"delay\"?)"),
    (["delay:raed=1ms"], "--filter delay.raed: unknown key (did you mean \"read\"?)"),
    (["delay:read=fast"], "--filter delay.read: \"fast\" is not a duration"),
    (["offset"], "--filter offset.offset: missing: the offset filter needs it"),
    (["error:rate=2"], "--filter error.rate: 2 is out of range: use 0..1"),
    (["truncate:size"], "'size' is not KEY=VALUE"),
])
def test_bad_stacks_are_refused_in_one_line(specs: list[str], message: str) -> None:
    with pytest.raises(UblkError) as e:
        registry.filter_stack(specs)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("specs,message", [
    (["offset:offset=4M"], "offset 4194304 is not inside the 4194304-byte inner device"),
    (["offset:offset=1000"], "offset 1000 is not a multiple of the logical block size 512"),
    (["truncate:size=8M"], "size 8388608 is larger than the 4194304-byte inner device"),
    (["error:errno=EBOGUS"], "errno 'EBOGUS' is no errno name"),
    (["error:ops=read+trim"], "ops trim: use some of read+write+flush+discard+write_zeroes"),
])
def test_a_filter_refusing_its_inner_device_closes_it(specs: list[str], message: str) -> None:
    inner = Memory()
    with pytest.raises(UblkError) as e:
        stacked(specs, inner)
    assert message in str(e.value) and inner.closed


def test_durations_read_as_nbdkit_writes_them() -> None:
    [(_, got)] = registry.filter_stack(["delay:read=50ms,write=2,flush=100us,discard=0.5s"])
    assert got == pytest.approx({"read": 0.05, "write": 2.0, "flush": 1e-4, "discard": 0.5})


def test_serve_config_takes_a_stack(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(4 * MiB))
    conf = tmp_path / "serve.toml"
    conf.write_text(f'[[devices]]\ntarget = "loop"\nfilters = ["offset:offset=1M", '
                    f'"delay:write=5ms"]\noptions.file = "{disk}"\n')
    conf.chmod(0o600)
    [dev] = config.load(str(conf)).devices
    assert dev.filters == [("offset", {"offset": MiB}), ("delay", {"write": 0.005})]
    target = dev.build_target()
    try:
        assert target.geometry.size == 3 * MiB and target.map() is None
    finally:
        target.close()
    conf.write_text('[[devices]]\ntarget = "null"\nfilters = ["ofset:offset=1M"]\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(str(conf))
    assert "devices[0].filters[0]: unknown filter 'ofset' (did you mean \"offset\"?)" \
        in str(e.value)
    conf.write_text('[[devices]]\ntarget = "null"\nfilters = ["delay:read=x"]\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(str(conf))
    assert "devices[0].filters[0].delay.read: \"x\" is not a duration" in str(e.value)


def test_add_builds_the_stack_and_records_it(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(4 * MiB))
    args = verb.parser().parse_args(["add", "-t", "loop", str(disk), "--filter", "readonly",
                                     "--filter", "offset:offset=2M"])
    target = maketarget.make_target(args)
    try:
        assert target.geometry.size == 2 * MiB and target.geometry.read_only
    finally:
        target.close()
    record = addargs.record(args)
    assert record["options"]["filter"] == ["readonly", "offset:offset=2M"]
    assert target_line(record).endswith(" filters readonly offset:offset=2M")


def test_a_bad_filter_is_one_line_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "aioublk", "add", "-t", "null", "--filter",
                           "delay:read=soon"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "is not a duration" in proc.stderr


def test_run_with_foreground_is_refused_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "aioublk", "add", "-t", "null", "--foreground",
                           "--run", "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "--run serves the device in the background" \
        in proc.stderr


def test_the_example_filter_fences_writes() -> None:
    from tests.examples.test_examples import load_example
    inner = Memory()
    fence = load_example("fence").Fence(inner, MiB)
    asyncio.run(fence.write(MiB - 512, memoryview(b"y" * 512)))
    with pytest.raises(OSError) as e:
        asyncio.run(fence.write(MiB - 512, memoryview(bytes(1024))))
    assert e.value.errno == errno.EPERM and inner.data[MiB - 512:MiB] == b"y" * 512


class Disorder(Memory):
    """A Memory shared by threads whose requests take a random while: a write
    lands when it completes, so two in flight land in either order."""

    def __init__(self, seed: int) -> None:
        import random
        super().__init__()
        self.data[:] = random.Random(seed).randbytes(len(self.data))
        self.rnd = random.Random(seed)

    async def _pause(self) -> None:
        await asyncio.sleep(self.rnd.choice((0, 0, 0.0005, 0.002)))

    async def read(self, offset: int, buf: Any) -> None:
        await self._pause()
        await super().read(offset, buf)

    async def write(self, offset: int, buf: Any, fua: bool = False) -> None:
        data = bytes(buf)
        await self._pause()
        self.data[offset:offset + len(data)] = data

    async def discard(self, offset: int, length: int) -> None:
        await self._pause()
        await super().discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.discard(offset, length)


@pytest.mark.parametrize("mode", ["writethrough", "writeback"])
def test_cache_loses_nothing_to_two_threads_interleaving(mode: str) -> None:
    """fio's verify, in miniature: two threads (two queues' loops) with many
    requests each in flight, none overlapping another in flight but many in
    the same cache block, over an inner layer that completes out of order;
    every read sees the last completed write, every flush makes the writes
    completed before it durable."""
    import random
    import threading
    sector = 512
    inner = Disorder(seed=3)
    model = bytearray(inner.data)
    top = CacheFilter(inner, size=64 << 10, block=16384, mode=mode)
    busy: set[int] = set()  # sectors of the requests in flight
    claims = [0] * (len(model) // sector)  # requests that took each sector
    lock = threading.Lock()
    errors: list[str] = []

    def claim(rnd: random.Random) -> tuple[int, int]:
        while True:
            offset = rnd.randrange(0, 512 << 10, sector)
            n = rnd.choice((512, 4096, 8192, 12288, 20480))
            sectors = set(range(offset // sector, (offset + n) // sector))
            with lock:
                if not sectors & busy:
                    busy.update(sectors)
                    for s in sectors:
                        claims[s] += 1
                    return offset, n

    def release(offset: int, n: int) -> None:
        with lock:
            busy.difference_update(range(offset // sector, (offset + n) // sector))

    async def one(rnd: random.Random) -> None:
        op = rnd.random()
        if op < 0.05:
            with lock:  # what no request touches meanwhile must be durable after
                before, moving, seen = bytes(model), set(busy), list(claims)
            await top.flush()
            with lock:
                stale = [s for s in range(len(model) // sector)
                         if s not in moving and claims[s] == seen[s]
                         and inner.data[s * sector:(s + 1) * sector]
                         != before[s * sector:(s + 1) * sector]]
            if stale:
                errors.append(f"flush left sectors {stale[:5]} unwritten")
            return
        offset, n = claim(rnd)
        try:
            if op < 0.5:
                data = rnd.randbytes(n)
                await top.write(offset, memoryview(data), fua=rnd.random() < 0.05)
                with lock:
                    model[offset:offset + n] = data
            elif op < 0.55:
                await (top.discard if rnd.random() < 0.5 else top.write_zeroes)(offset, n)
                with lock:
                    model[offset:offset + n] = bytes(n)
            else:
                buf = bytearray(n)
                await top.read(offset, memoryview(buf))
                with lock:
                    if buf != model[offset:offset + n]:
                        errors.append(f"read {offset}+{n} saw stale bytes")
        finally:
            release(offset, n)

    async def worker(seed: int) -> None:
        rnd = random.Random(seed)
        pending: set[asyncio.Task[None]] = set()
        for _ in range(600):
            while len(pending) >= 16:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.ensure_future(one(rnd)))
        await asyncio.gather(*pending)

    threads = [threading.Thread(target=asyncio.run, args=(worker(seed),)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    asyncio.run(top.flush())
    assert inner.data == model
    assert len(top.blocks) <= top.slots


def test_cow_commit_now_writes_what_is_owed_while_serving() -> None:
    """A commit on request: the inner device gets the overlay's blocks and a
    flush; blocks written again during the commit are owed to the next one,
    and a block committed is not written twice."""
    inner = Memory()
    top = CowFilter(inner, block=4096)

    async def scenario() -> None:
        await top.write(0, memoryview(b"a" * 4096))
        await top.write(8192, memoryview(b"b" * 100))
        assert await top.commit_now() == 2
        assert inner.data[:4096] == b"a" * 4096 and inner.data[8192:8292] == b"b" * 100
        assert ("flush", 0, 0) in inner.calls
        assert await top.commit_now() == 0  # nothing owed
        # a write while the commit's inner write is in flight: owed again
        entered, gate = asyncio.Event(), asyncio.Event()
        inner_write = inner.write

        async def slow_write(offset: int, buf: memoryview, fua: bool = False) -> None:
            entered.set()
            await gate.wait()
            await inner_write(offset, buf, fua)
        inner.write = slow_write  # type: ignore[method-assign]
        await top.write(0, memoryview(b"c" * 4096))
        commit = asyncio.ensure_future(top.commit_now())
        await entered.wait()  # the commit holds block 0's copy
        await top.write(0, memoryview(b"d" * 4096))
        gate.set()
        assert await commit == 1
        assert top.owed.keys() == {0}
        inner.write = inner_write  # type: ignore[method-assign]
        assert await top.commit_now() == 1
        assert inner.data[:4096] == b"d" * 4096
        buf = bytearray(4096)
        await top.read(0, memoryview(buf))
        assert buf == b"d" * 4096
    asyncio.run(scenario())
    top.close()
