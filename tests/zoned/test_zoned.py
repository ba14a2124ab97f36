"""The zoned target on the host: the zone state machine (every transition,
the open and active limits, write pointer checks, append), the ``blk_zone``
and ``ublk_param_zoned`` encodings, the state file, and the op dispatch that
hands a zone append's sector to the commit."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from aioublk.errors import UblkError
from aioublk.kernel import uapi
from aioublk.queue.driver import serve_request
from aioublk.queue.options import CopyMode, DeviceConfig
from aioublk.target import Geometry
from aioublk.targets.zoned import ZonedError, ZonedTarget
from aioublk.targets.zones import (
    CLOSED,
    CONVENTIONAL,
    EMPTY,
    EXP_OPEN,
    FULL,
    IMP_OPEN,
    NOT_WP,
    SEQUENTIAL,
    ZoneTable,
)

Z = 8  # sectors per zone in the tables below


def table(nr: int = 6, conv: int = 1, max_open: int = 0, max_active: int = 0) -> ZoneTable:
    return ZoneTable(Z, nr, conv, max_open, max_active)


def conds(t: ZoneTable) -> list[int]:
    return [z.cond for z in t.zones]


def fails(code: int, fn: object, *args: int) -> None:
    with pytest.raises(OSError) as e:
        fn(*args)  # type: ignore[operator]
    assert e.value.errno == code


def test_layout() -> None:
    t = table()
    assert [z.type for z in t.zones] == [CONVENTIONAL] + [SEQUENTIAL] * 5
    assert conds(t) == [NOT_WP] + [EMPTY] * 5
    assert [z.wp for z in t.zones] == [Z] + [Z * i for i in range(1, 6)]
    with pytest.raises(ValueError):
        ZoneTable(6, 4)
    with pytest.raises(ValueError):
        ZoneTable(8, 2, 2)


# -- writes ---------------------------------------------------------------------


def test_conventional_zone_takes_writes_anywhere_and_no_zone_op() -> None:
    t = table()
    t.write(3, 2)
    t.write(0, Z)
    assert t.zones[0].cond == NOT_WP
    for op in (t.open, t.close, t.finish, t.reset):
        fails(errno.EIO, op, 0)
    fails(errno.EIO, t.append, 0, 1)


def test_write_at_the_pointer_opens_implicitly_then_fills() -> None:
    t = table()
    t.write(Z, 2)
    assert (t.zones[1].cond, t.zones[1].wp) == (IMP_OPEN, Z + 2)
    t.write(Z + 2, Z - 2)
    assert (t.zones[1].cond, t.zones[1].wp) == (FULL, 2 * Z)
    assert t.dirty == {1}


@pytest.mark.parametrize("sector,n", [(Z, 1), (Z + 3, 1), (2 * Z - 1, 2), (6 * Z, 1)])
def test_write_elsewhere_fails_with_eio(sector: int, n: int) -> None:
    t = table()
    t.write(Z, 1)
    fails(errno.EIO, t.write, sector, n)
    assert t.zones[1].wp == Z + 1


def test_write_to_a_full_zone_fails() -> None:
    t = table()
    t.finish(Z)
    fails(errno.EIO, t.write, Z, 1)
    fails(errno.EIO, t.write, 2 * Z - 1, 1)


def test_append_returns_the_pointer_and_moves_it() -> None:
    t = table()
    assert t.append(Z, 3) == Z
    assert t.append(Z + 5, 2) == Z + 3  # any sector of the zone names it
    assert t.zones[1].cond == IMP_OPEN
    assert t.append(Z, 3) == Z + 5
    assert t.zones[1].cond == FULL
    fails(errno.EIO, t.append, Z, 1)
    t.reset(Z)
    fails(errno.EIO, t.append, Z, Z + 1)


# -- zone operations --------------------------------------------------------


def test_open_close_finish_reset_transitions() -> None:
    t = table()
    z = t.zones[1]
    t.open(Z)
    assert z.cond == EXP_OPEN
    t.open(Z)  # again: nothing
    t.close(Z)
    assert z.cond == EMPTY  # nothing written: closing empties it
    t.write(Z, 1)
    t.close(Z)
    assert (z.cond, z.wp) == (CLOSED, Z + 1)
    t.close(Z)  # again: nothing
    t.write(Z + 1, 1)  # a closed zone reopens implicitly
    assert z.cond == IMP_OPEN
    t.open(Z)
    assert z.cond == EXP_OPEN
    t.finish(Z)
    assert (z.cond, z.wp) == (FULL, 2 * Z)
    t.finish(Z)  # again: nothing
    fails(errno.EIO, t.open, Z)
    fails(errno.EIO, t.close, Z)
    t.reset(Z)
    assert (z.cond, z.wp) == (EMPTY, Z)
    t.reset(Z)  # again: nothing
    fails(errno.EIO, t.close, Z)  # an empty zone is not open
    t.finish(Z)
    assert z.cond == FULL


@pytest.mark.parametrize("start", [EMPTY, IMP_OPEN, EXP_OPEN, CLOSED, FULL])
def test_every_state_resets_and_finishes(start: int) -> None:
    for op, want in (("reset", EMPTY), ("finish", FULL)):
        t = table()
        _reach(t, 1, start)
        getattr(t, op)(Z)
        assert t.zones[1].cond == want
        assert t.zones[1].wp == (Z if want == EMPTY else 2 * Z)


def _reach(t: ZoneTable, index: int, cond: int) -> None:
    at = index * Z
    if cond == IMP_OPEN:
        t.write(at, 1)
    elif cond == EXP_OPEN:
        t.open(at)
    elif cond == CLOSED:
        t.write(at, 1)
        t.close(at)
    elif cond == FULL:
        t.finish(at)
    assert t.zones[index].cond == cond


def test_reset_all_empties_every_sequential_zone() -> None:
    t = table()
    for i, cond in enumerate((IMP_OPEN, EXP_OPEN, CLOSED, FULL), start=1):
        _reach(t, i, cond)
    t.reset_all()
    assert conds(t) == [NOT_WP] + [EMPTY] * 5
    assert [z.wp for z in t.zones[1:]] == [Z * i for i in range(1, 6)]


# -- limits ------------------------------------------------------------------


def test_max_open_closes_an_implicitly_open_zone_to_make_room() -> None:
    t = table(max_open=2)
    t.write(Z, 1)
    t.write(2 * Z, 1)
    t.write(3 * Z, 1)  # zone 1 is closed for it
    assert conds(t)[1:4] == [CLOSED, IMP_OPEN, IMP_OPEN]
    assert t.count(IMP_OPEN, EXP_OPEN) == 2


def test_max_open_refuses_when_every_open_zone_is_explicit() -> None:
    t = table(max_open=2)
    t.open(Z)
    t.open(2 * Z)
    fails(errno.ETOOMANYREFS, t.write, 3 * Z, 1)
    fails(errno.ETOOMANYREFS, t.open, 3 * Z)
    fails(errno.ETOOMANYREFS, t.append, 3 * Z, 1)
    assert t.zones[3].cond == EMPTY
    t.close(Z)
    t.write(3 * Z, 1)
    assert t.zones[3].cond == IMP_OPEN


def test_max_active_counts_open_and_closed_zones() -> None:
    t = table(max_active=2)
    t.write(Z, 1)
    t.close(Z)  # closed: still active
    t.open(2 * Z)
    fails(errno.EOVERFLOW, t.write, 3 * Z, 1)
    fails(errno.EOVERFLOW, t.open, 3 * Z)
    fails(errno.EOVERFLOW, t.finish, 3 * Z)  # finishing an empty zone makes it active first
    t.write(Z + 1, 1)  # a closed zone is already active: it reopens
    t.finish(Z)  # full zones are not active
    t.write(3 * Z, 1)
    assert conds(t)[1:4] == [FULL, EXP_OPEN, IMP_OPEN]


def test_reopening_a_closed_zone_needs_an_open_slot_only() -> None:
    t = table(max_open=1, max_active=2)
    t.write(Z, 1)
    t.close(Z)
    t.open(2 * Z)
    fails(errno.ETOOMANYREFS, t.write, Z + 1, 1)
    t.close(2 * Z)  # empty again: the active slot goes too
    t.write(Z + 1, 1)
    assert t.zones[1].cond == IMP_OPEN


# -- report and restore ----------------------------------------------------


def test_report_from_the_zone_holding_the_sector() -> None:
    t = table()
    assert [z.start for z in t.report(2 * Z + 3, 2)] == [2 * Z, 3 * Z]
    assert [z.start for z in t.report(5 * Z, 9)] == [5 * Z]
    fails(errno.EIO, t.report, 6 * Z, 1)


def test_restore_closes_open_zones() -> None:
    t = table()
    t.restore(1, IMP_OPEN, Z + 2)
    t.restore(2, EXP_OPEN, 2 * Z)
    t.restore(3, FULL, 4 * Z)
    assert conds(t)[1:4] == [CLOSED, EMPTY, FULL]
    with pytest.raises(ValueError):
        t.restore(4, EMPTY, 6 * Z)


# -- encodings ---------------------------------------------------------------


def test_blk_zone_encoding() -> None:
    t = table(nr=3)
    t.write(Z, 2)
    buf = memoryview(bytearray(b"\xff" * 64 * 4))
    uapi.pack_zones([z.entry() for z in t.zones], buf)
    assert uapi.BLK_ZONE.size == 64
    start, length, wp, ztype, cond, non_seq, reset, cap = uapi.BLK_ZONE.unpack_from(buf, 64)
    assert (start, length, wp, ztype, cond, cap) == (Z, Z, Z + 2, SEQUENTIAL, IMP_OPEN, Z)
    assert (non_seq, reset) == (0, 0)
    assert int.from_bytes(buf[32:40], "little") == Z  # capacity at offset 32
    assert buf[24] == CONVENTIONAL and buf[25] == NOT_WP
    assert bytes(buf[192:]) == bytes(64)  # a zero-length zone ends the report
    with pytest.raises(ValueError):
        uapi.pack_zones([z.entry() for z in t.zones], buf[:128])


def test_params_encoding() -> None:
    geo = Geometry(size=64 << 20, zone_size=4 << 20, max_open_zones=3, max_active_zones=5)
    p = geo.params(1 << 20)
    raw = p.pack()
    back = uapi.Params.unpack(raw)
    assert back.types & uapi.PARAM_TYPE_ZONED
    assert back.zoned == (3, 5, (1 << 20) >> 9)  # append at most one request's size
    assert back.chunk_sectors == (4 << 20) >> 9
    plain = uapi.Params.unpack(Geometry(size=1 << 20).params(1 << 20).pack())
    assert plain.zoned is None and not plain.types & uapi.PARAM_TYPE_ZONED
    assert plain.chunk_sectors == 0


# -- the target ----------------------------------------------------------------


def test_options_the_kernel_would_refuse_are_one_line_errors() -> None:
    for kw in ({"zone_size": 3 << 20}, {"size": 1 << 20, "zone_size": 4 << 20},
               {"size": 8 << 20, "zone_size": 4 << 20, "conv_zones": 2},
               {"size": 8 << 20, "zone_size": 4 << 20, "max_open_zones": 3}):
        with pytest.raises(ZonedError) as e:
            ZonedTarget(**kw)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)


def test_ram_target_serves_zone_ops() -> None:
    t = ZonedTarget(size=4 << 20, zone_size=1 << 20, conv_zones=1)
    got: list[int] = []
    zone1 = (1 << 20) >> 9

    async def run() -> None:
        data = memoryview(bytearray(b"a" * 4096))
        w = uapi.Op.WRITE
        assert await serve_request(t, w, 8, zone1, data) == 4096
        assert await serve_request(t, w, 8, zone1, data) == -errno.EIO  # behind the wp
        res = await serve_request(t, uapi.Op.ZONE_APPEND, 8, zone1, data,
                                  append_at=got.append)
        assert res == 4096 and got == [zone1 + 8]
        report = memoryview(bytearray(64 * 4))
        assert await serve_request(t, uapi.Op.REPORT_ZONES, 4, 0, report) == 256
        assert uapi.BLK_ZONE.unpack_from(report, 64)[2] == zone1 + 16
        back = memoryview(bytearray(8192))
        assert await serve_request(t, uapi.Op.READ, 16, zone1, back) == 8192
        assert bytes(back) == b"a" * 8192
        for op in (uapi.Op.ZONE_OPEN, uapi.Op.ZONE_CLOSE, uapi.Op.ZONE_FINISH):
            assert await serve_request(t, op, 0, 2 * zone1, memoryview(b"")) == 0
        assert t.table.zones[2].cond == FULL
        assert await serve_request(t, uapi.Op.ZONE_RESET, 0, zone1, memoryview(b"")) == 0
        assert await serve_request(t, uapi.Op.READ, 16, zone1, back) == 8192
        assert bytes(back) == bytes(8192)  # a reset zone reads back as zeros
        assert await serve_request(t, uapi.Op.ZONE_RESET_ALL, 0, 0, memoryview(b"")) == 0
        assert [z.cond for z in t.table.zones] == [NOT_WP] + [EMPTY] * 3
        assert await serve_request(t, uapi.Op.ZONE_OPEN, 0, 0, memoryview(b"")) == -errno.EIO

    asyncio.run(run())
    t.close()


def test_state_file_survives_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "zoned.img")
    t = ZonedTarget(path, size=4 << 20, zone_size=1 << 20, direct=False)
    assert Path(path).stat().st_size == 4 << 20  # created, sparse
    t.table.write(2048, 4)
    t.table.open(4096)
    t.table.finish(6144)
    t._save()
    t.close()
    t = ZonedTarget(path, size=4 << 20, zone_size=1 << 20, direct=False)
    assert [(z.cond, z.wp) for z in t.table.zones] == [
        (EMPTY, 0), (CLOSED, 2052), (EMPTY, 4096), (FULL, 8192)]
    t.close()
    with pytest.raises(ZonedError) as e:
        ZonedTarget(path, size=4 << 20, zone_size=2 << 20, direct=False)
    assert "describes other zones" in str(e.value)


def test_a_zoned_device_is_served_with_user_copy() -> None:
    cfg = DeviceConfig(zoned=True, copy=CopyMode.USER_COPY)
    cfg.validate()
    _batch, flags = cfg.resolve(uapi.Feature.ZONED | uapi.Feature.USER_COPY)
    assert flags & uapi.Feature.ZONED
    with pytest.raises(UblkError) as e:
        DeviceConfig(zoned=True, copy=CopyMode.ZERO_COPY).validate()
    assert "-u" in str(e.value)
    with pytest.raises(UblkError):  # a kernel without it
        cfg.resolve(uapi.Feature.USER_COPY)
