"""The zone state machine of a host-managed zoned device, as a plain class
(no I/O): each zone's type, condition and write pointer, and the rules the
kernel expects of them (ZBC/ZNS, as null_blk implements them).

- Conventional zones take writes anywhere and no zone operation.
- A sequential zone takes writes only at its write pointer: anything else,
  or a write to a FULL zone, fails with EIO. A write to an EMPTY or CLOSED
  zone opens it implicitly; reaching the zone's end makes it FULL.
- ``max_open`` (0: no limit) bounds the implicitly and explicitly open
  zones; an implicit open at the limit closes another implicitly open zone
  first, and fails with ETOOMANYREFS (the block layer's "open zones
  exceeded") when there is none. ``max_active`` bounds open plus CLOSED
  zones: past it, EOVERFLOW ("active zones exceeded").

All positions are in 512-byte sectors. Every zone a change touches is added
to ``dirty``, for whoever keeps the table on disk.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

from aioublk.kernel import uapi

CONVENTIONAL = uapi.ZONE_TYPE_CONVENTIONAL
SEQUENTIAL = uapi.ZONE_TYPE_SEQWRITE_REQ
NOT_WP = uapi.ZONE_COND_NOT_WP
EMPTY = uapi.ZONE_COND_EMPTY
IMP_OPEN = uapi.ZONE_COND_IMP_OPEN
EXP_OPEN = uapi.ZONE_COND_EXP_OPEN
CLOSED = uapi.ZONE_COND_CLOSED
FULL = uapi.ZONE_COND_FULL


@dataclass(slots=True)
class Zone:
    start: int
    length: int
    type: int
    cond: int
    wp: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def entry(self) -> tuple[int, int, int, int, int, int]:
        """(start, len, wp, type, cond, capacity) for ``uapi.pack_zones``."""
        return (self.start, self.length, self.wp, self.type, self.cond, self.length)


def _fail(code: int, why: str) -> OSError:
    return OSError(code, why)


@dataclass
class ZoneTable:
    zone_sectors: int
    nr_zones: int
    nr_conventional: int = 0
    max_open: int = 0
    max_active: int = 0
    zones: list[Zone] = field(init=False)
    dirty: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.zone_sectors <= 0 or self.zone_sectors & (self.zone_sectors - 1):
            raise ValueError("the zone size must be a power of two")
        if not 0 <= self.nr_conventional < self.nr_zones:
            raise ValueError("at least one zone must be sequential")
        self.zones = []
        for i in range(self.nr_zones):
            start = i * self.zone_sectors
            if i < self.nr_conventional:
                # (the wp of a zone without one, as null_blk reports it)
                self.zones.append(Zone(start, self.zone_sectors, CONVENTIONAL, NOT_WP,
                                       start + self.zone_sectors))
            else:
                self.zones.append(Zone(start, self.zone_sectors, SEQUENTIAL, EMPTY, start))

    # -- counts ------------------------------------------------------------

    def count(self, *conds: int) -> int:
        return sum(1 for z in self.zones if z.cond in conds)

    def _open_ok(self) -> bool:
        return not self.max_open or self.count(IMP_OPEN, EXP_OPEN) < self.max_open

    def _check_active(self) -> None:
        if self.max_active and self.count(IMP_OPEN, EXP_OPEN, CLOSED) >= self.max_active:
            raise _fail(errno.EOVERFLOW, "too many active zones")

    def _check_open(self) -> None:
        """Room for one more open zone, closing an implicitly open one if need be."""
        if self._open_ok():
            return
        victim = next((z for z in self.zones if z.cond == IMP_OPEN), None)
        if victim is None:
            raise _fail(errno.ETOOMANYREFS, "too many open zones")
        self._close(victim)

    def _check_resources(self, z: Zone) -> None:
        """What opening ``z`` needs: an active slot if it is EMPTY, and an open one."""
        if z.cond == EMPTY:
            self._check_active()
        self._check_open()

    # -- lookups -----------------------------------------------------------

    def zone_at(self, sector: int) -> Zone:
        index = sector // self.zone_sectors
        if not 0 <= index < self.nr_zones or sector < 0:
            raise _fail(errno.EIO, f"sector {sector} is past the last zone")
        return self.zones[index]

    def _sequential(self, sector: int) -> Zone:
        z = self.zone_at(sector)
        if z.type == CONVENTIONAL:
            raise _fail(errno.EIO, f"zone at sector {z.start} is conventional")
        return z

    def _set(self, z: Zone, cond: int, wp: int) -> None:
        z.cond, z.wp = cond, wp
        self.dirty.add(z.start // self.zone_sectors)

    def report(self, sector: int, nr_zones: int) -> list[Zone]:
        """Up to ``nr_zones`` zones from the one holding ``sector``."""
        first = self.zone_at(sector).start // self.zone_sectors
        return self.zones[first:first + nr_zones]

    # -- writes ------------------------------------------------------------

    def write(self, sector: int, nr_sectors: int) -> None:
        """Account for a write of ``nr_sectors`` at ``sector`` (before its data
        goes out, so concurrent writes see the moved pointer), or refuse it."""
        z = self.zone_at(sector)
        if sector + nr_sectors > z.end:
            raise _fail(errno.EIO, f"write at sector {sector} crosses its zone's end")
        if z.type == CONVENTIONAL:
            return
        if z.cond == FULL:
            raise _fail(errno.EIO, f"zone at sector {z.start} is full")
        if sector != z.wp:
            raise _fail(errno.EIO, f"write at sector {sector}, not at the zone's write "
                        f"pointer {z.wp}")
        self._advance(z, nr_sectors)

    def append(self, sector: int, nr_sectors: int) -> int:
        """Zone append to the zone holding ``sector``: the sector the data goes to."""
        z = self._sequential(sector)
        if z.cond == FULL or z.wp + nr_sectors > z.end:
            raise _fail(errno.EIO, f"zone at sector {z.start} has no room for "
                        f"{nr_sectors} sectors")
        at = z.wp
        self._advance(z, nr_sectors)
        return at

    def _advance(self, z: Zone, nr_sectors: int) -> None:
        cond = z.cond
        if cond in (EMPTY, CLOSED):
            self._check_resources(z)
            cond = IMP_OPEN
        wp = z.wp + nr_sectors
        self._set(z, FULL if wp == z.end else cond, wp)

    # -- zone operations ---------------------------------------------------

    def open(self, sector: int) -> None:
        z = self._sequential(sector)
        if z.cond == EXP_OPEN:
            return
        if z.cond == FULL:
            raise _fail(errno.EIO, f"zone at sector {z.start} is full")
        if z.cond in (EMPTY, CLOSED):
            self._check_resources(z)
        self._set(z, EXP_OPEN, z.wp)

    def close(self, sector: int) -> None:
        z = self._sequential(sector)
        if z.cond == CLOSED:
            return
        if z.cond not in (IMP_OPEN, EXP_OPEN):
            raise _fail(errno.EIO, f"zone at sector {z.start} is not open")
        self._close(z)

    def _close(self, z: Zone) -> None:
        self._set(z, EMPTY if z.wp == z.start else CLOSED, z.wp)

    def finish(self, sector: int) -> None:
        z = self._sequential(sector)
        if z.cond == FULL:
            return
        if z.cond == EMPTY:
            self._check_active()
        self._set(z, FULL, z.end)

    def reset(self, sector: int) -> None:
        z = self._sequential(sector)
        if z.cond != EMPTY:
            self._set(z, EMPTY, z.start)

    def reset_all(self) -> None:
        for z in self.zones:
            if z.type == SEQUENTIAL and z.cond != EMPTY:
                self._set(z, EMPTY, z.start)

    # -- restart -----------------------------------------------------------

    def restore(self, index: int, cond: int, wp: int) -> None:
        """A sequential zone's saved state, as a restarted device finds it:
        an open zone is closed (or EMPTY if nothing was written)."""
        z = self.zones[index]
        if z.type == CONVENTIONAL:
            return
        if not (z.start <= wp <= z.end) or cond not in (EMPTY, IMP_OPEN, EXP_OPEN, CLOSED,
                                                          FULL):
            raise ValueError(f"zone {index}: condition {cond} and write pointer {wp} make "
                             "no sense")
        if cond in (IMP_OPEN, EXP_OPEN, CLOSED):
            cond = EMPTY if wp == z.start else CLOSED
        z.cond, z.wp = cond, wp
