"""The zoned target (``UBLK_F_ZONED``, as rublk's): a host-managed zoned
device over a file, or over memory when there is none.

The zone states live in Python (``ZoneTable``); every request of this target
runs in Python (no map for the C data plane): a write is checked against its
zone's write pointer and moves it before its data goes out. All queues are
served from one loop, so that check and move never interleave.

The table is persisted, not rebuilt: ``FILE.zones`` holds each zone's
condition and write pointer, written as each change is accepted and synced
with the data on flush. On restart open zones come back CLOSED, as a
drive's do after a power cycle. A reset punches the zone's data out of the
file, so what lies past a write pointer reads as zeros.

The kernel passes a zone append's sector back in the union of
``ublksrv_io_cmd`` that otherwise holds a buffer address, which it allows
only with user copy or zero copy: this target is served with user copy
(``-u``), chosen for it when no copy mode is given.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct

from aioublk.errors import Error
from aioublk.io.hostfile import Backing, fit_geometry
from aioublk.kernel import uapi
from aioublk.ring import current_ring
from aioublk.target import Geometry, Target
from aioublk.targets.spec import BUFFERED, INT, PATH, SIZE, Option, TargetSpec
from aioublk.targets.zones import CONVENTIONAL, ZoneTable

#: the state file: magic, zone sectors, zones, conventional zones; then per zone
_HEADER = struct.Struct("=8sQII")
_MAGIC = b"AIOUZON1"
_HEADER_BYTES = 64
_ENTRY = struct.Struct("=B7xQ")  # cond, write pointer (sectors)


class ZonedError(Error, ValueError):
    """Zone options or a zone state file that cannot be used, in one line."""


def zone_count(size: int, zone_size: int, conv_zones: int, max_open: int,
               max_active: int) -> int:
    """How many zones ``size`` bytes make; raises ZonedError for options the
    kernel would refuse."""
    if zone_size < 4096 or zone_size & (zone_size - 1):
        raise ZonedError(f"zone size {zone_size} is not a power of two of 4K or more: "
                         "fix --zone_size")
    nr = size // zone_size
    if nr < 1:
        raise ZonedError(f"a device of {size} bytes holds no zone of {zone_size} bytes: "
                         "raise -s or lower --zone_size")
    if not 0 <= conv_zones < nr:
        raise ZonedError(f"{conv_zones} conventional zones leave no sequential zone of the "
                         f"{nr}: lower --conv_zones")
    for name, value in (("--max_open_zones", max_open), ("--max_active_zones", max_active)):
        if not 0 <= value <= nr:
            raise ZonedError(f"{name} {value} is more than the {nr} zones: lower it "
                             "(0: no limit)")
    return nr


class ZonedTarget(Target):
    """A host-managed zoned disk (``-t zoned``) over a file or memory: zones
    of ``zone_size`` bytes, the first ``conv_zones`` conventional, the open
    and active limits enforced (see the module's docstring)."""

    name = "zoned"
    one_loop = True

    def __init__(self, file: str | None = None, *, size: int = 1 << 30,
                 zone_size: int = 64 << 20, conv_zones: int = 0, max_open_zones: int = 0,
                 max_active_zones: int = 0, direct: bool = True) -> None:
        nr = zone_count(size, zone_size, conv_zones, max_open_zones, max_active_zones)
        self.table = ZoneTable(zone_size >> 9, nr, conv_zones, max_open_zones,
                               max_active_zones)
        size = nr * zone_size
        self.backing: Backing | None = None
        self.ram: mmap.mmap | None = None
        self.state_fd = -1
        self.state_path = ""
        geo = Geometry(size=size, zone_size=zone_size, max_open_zones=max_open_zones,
                       max_active_zones=max_active_zones)
        if file is None:
            self.ram = mmap.mmap(-1, size)
            self.geometry = geo
            return
        _grow(file, size)
        self.backing = Backing(file, direct=direct)
        try:
            self.state_path = file + ".zones"
            self._load_state()
        except BaseException:
            self.close()
            raise
        geo.volatile_cache = True
        self.geometry = fit_geometry(geo, [self.backing])

    # -- the state file ----------------------------------------------------

    def _load_state(self) -> None:
        t = self.table
        header = _HEADER.pack(_MAGIC, t.zone_sectors, t.nr_zones, t.nr_conventional)
        try:
            self.state_fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                    0o644)
        except OSError as e:
            raise ZonedError(f"cannot open zone state file {self.state_path}: "
                             f"{e.strerror}") from None
        data = os.pread(self.state_fd, _HEADER_BYTES + t.nr_zones * _ENTRY.size, 0)
        if not data:
            os.pwrite(self.state_fd, header.ljust(_HEADER_BYTES, b"\0"), 0)
            t.dirty.update(range(t.nr_zones))
            self._save()
            return
        if data[:_HEADER.size] != header or len(data) < _HEADER_BYTES + t.nr_zones * 16:
            raise ZonedError(f"zone state file {self.state_path} describes other zones: use "
                             "the zone options it was made with, or delete it (and the data)")
        try:
            for i in range(t.nr_zones):
                cond, wp = _ENTRY.unpack_from(data, _HEADER_BYTES + i * _ENTRY.size)
                t.restore(i, cond, wp)
        except ValueError as e:
            raise ZonedError(f"zone state file {self.state_path} is damaged ({e}): "
                             "delete it (and the data)") from None
        t.dirty.update(range(t.nr_zones))  # what restore closed
        self._save()

    def _save(self) -> None:
        """Write the zones that changed to the state file (the page cache;
        flush makes it durable). Small and synchronous: this loop owns the table."""
        t = self.table
        if self.state_fd < 0:
            t.dirty.clear()
            return
        for i in sorted(t.dirty):
            z = t.zones[i]
            os.pwrite(self.state_fd, _ENTRY.pack(z.cond, z.wp), _HEADER_BYTES + i * _ENTRY.size)
        t.dirty.clear()

    # -- data ----------------------------------------------------------------

    async def read(self, offset: int, buf: memoryview) -> None:
        if self.ram is not None:
            buf[:] = self.ram[offset:offset + len(buf)]
            return
        assert self.backing is not None
        await self.backing.read_into(buf, offset)

    async def _put(self, offset: int, buf: memoryview, fua: bool) -> None:
        if self.ram is not None:
            self.ram[offset:offset + len(buf)] = buf
            return
        assert self.backing is not None
        await self.backing.write(buf, offset)
        if fua:
            await self.flush()

    async def write(self, offset: int, buf: memoryview, fua: bool = False) -> None:
        try:
            self.table.write(offset >> 9, len(buf) >> 9)
        finally:
            self._save()
        await self._put(offset, buf, fua)

    async def zone_append(self, offset: int, buf: memoryview, fua: bool = False) -> int:
        try:
            at = self.table.append(offset >> 9, len(buf) >> 9) << 9
        finally:
            self._save()
        await self._put(at, buf, fua)
        return at

    async def report_zones(self, offset: int, buf: memoryview) -> None:
        zones = self.table.report(offset >> 9, len(buf) // uapi.BLK_ZONE.size)
        uapi.pack_zones([z.entry() for z in zones], buf)

    async def zone_open(self, offset: int) -> None:
        try:
            self.table.open(offset >> 9)
        finally:
            self._save()

    async def zone_close(self, offset: int) -> None:
        try:
            self.table.close(offset >> 9)
        finally:
            self._save()

    async def zone_finish(self, offset: int) -> None:
        try:
            self.table.finish(offset >> 9)
        finally:
            self._save()

    async def zone_reset(self, offset: int) -> None:
        self.table.reset(offset >> 9)
        self._save()
        await self._drop(self.table.zone_at(offset >> 9).start)

    async def zone_reset_all(self) -> None:
        written = [z.start for z in self.table.zones
                   if z.type != CONVENTIONAL and z.wp != z.start]
        self.table.reset_all()
        self._save()
        for start in written:
            await self._drop(start)

    async def _drop(self, sector: int) -> None:
        """A reset zone's data: gone, so it reads back as zeros."""
        offset, length = sector << 9, self.table.zone_sectors << 9
        if self.ram is not None:
            self.ram[offset:offset + length] = bytes(length)
            return
        assert self.backing is not None
        try:
            await self.backing.punch(offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise  # (a file system without holes keeps the old bytes)

    async def flush(self) -> None:
        if self.backing is None:
            return
        await self.backing.sync()
        await current_ring().fdatasync(self.state_fd)

    async def drain(self) -> None:
        await self.flush()

    def close(self) -> None:
        if self.backing is not None:
            self.backing.close()
        if self.state_fd >= 0:
            os.close(self.state_fd)
            self.state_fd = -1
        if self.ram is not None:
            self.ram.close()
            self.ram = None

    def describe(self) -> dict[str, object]:
        t = self.table
        return {"target": self.name, "size": self.geometry.size,
                "file": self.backing.path if self.backing else None,
                "zone_size": t.zone_sectors << 9, "zones": t.nr_zones,
                "conv_zones": t.nr_conventional, "max_open_zones": t.max_open,
                "max_active_zones": t.max_active}


def _grow(path: str, size: int) -> None:
    """Create the backing file (sparse) or extend it to ``size`` bytes."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ZonedError(f"cannot open backing file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size < size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


#: ``-t zoned``: its options, as the command line and config files take them
SPEC = TargetSpec("zoned", ZonedTarget, (
    Option("file", PATH, "the backing file (created if missing; zone states go to "
           "FILE.zones); none: zones in memory", what="backing file"),
    Option("size", SIZE, "bytes the device serves (whole zones)", default=1 << 30,
           default_help="1G", flags=("-s", "--size"), lo=4096, sectors=True),
    Option("zone_size", SIZE, "bytes per zone, a power of two", default=64 << 20,
           default_help="64M", flags=("--zone_size",), lo=4096, power_of_two=True),
    Option("conv_zones", INT, "how many zones, from the first, are conventional",
           default=0, flags=("--conv_zones",), lo=0),
    Option("max_open_zones", INT, "the most zones open at once (0: no limit)", default=0,
           flags=("--max_open_zones",), lo=0),
    Option("max_active_zones", INT, "the most zones open or closed at once (0: no limit)",
           default=0, flags=("--max_active_zones",), lo=0),
    BUFFERED,
), files="file", rank=8)
