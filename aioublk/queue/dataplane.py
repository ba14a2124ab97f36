"""The data plane: where a target says its data lives, so that C can serve
those requests without entering Python.

A target that knows where a request's bytes are returns a **map** from
``Target.map()``:

- ``Null()``: reads leave the buffer as it is, writes vanish (the null target).
- ``Linear(fd, base)``: device offset ``o`` is ``fd`` at ``base + o`` (loop).
- ``Striped(fds, chunk)``: chunk ``c`` is in ``fds[c % n]`` at chunk ``c // n``
  (RAID-0, the stripe target).
- ``Extents(table)``: an ``ExtentTable`` the target fills and invalidates as
  it learns and changes its mapping (qcow2; any target whose layout is a
  table). A request the table does not wholly cover is a miss. Its ``pool``
  gives the data plane that serves it a pool of clusters to allocate from:
  called only then, so a filter that drops or wraps the map costs no pool.
- ``Passthrough(fd, nsid, block_size)``: the device is NVMe namespace
  ``nsid`` behind generic char device ``fd``; each request is one
  ``NVME_URING_CMD_IO`` (the nvme target; its ring has 128-byte SQEs).
- ``External(ops, ctx, wake, owner)``: a plug-in in another C extension
  moves the data (the nbd target's, over its NBD connection): C hands it
  each READ and WRITE through a table of function pointers
  (``csrc/dp_ext.h``), watches its fd on the queue's ring, and calls
  ``wake`` when it asks for Python. Copy mode only.

Each queue worker serves, in C and with the GIL released, every READ and
non-FUA WRITE its map resolves, from the fetch to the commit. What the map
does not cover comes to the target's coroutines as before: flush, discard,
write-zeroes, FUA writes, misses, and any request whose backend I/O was not
a full success (a short transfer, O_DIRECT's EINVAL, an error), which the
coroutine path serves again from the start. So a map is an accelerator,
never the contract: a target must still serve everything through
``read``/``write``.

C serves every copy mode: the default, ``--auto_zc``, ``-z`` and ``-u``
(C copies between the tag's buffer and /dev/ublkcN itself); ``-v`` (which
logs every request) keeps every request in Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioublk._uring import ffi, lib
from aioublk.queue.cwait import hand_wait_to_c
from aioublk.ring import UD_MARK, EventHandler, Ring

if TYPE_CHECKING:
    from aioublk.queue.extents import ExtentTable


@dataclass(frozen=True, slots=True)
class Null:
    """Every read and write succeeds at once, touching nothing."""


@dataclass(frozen=True, slots=True)
class Linear:
    """The device is ``fd`` from byte ``base`` on."""

    fd: int
    base: int = 0


@dataclass(frozen=True, slots=True)
class Striped:
    """RAID-0 over ``fds`` in chunks of ``chunk`` bytes (a power of two)."""

    fds: Sequence[int]
    chunk: int


@dataclass(frozen=True, slots=True)
class Extents:
    """Device ranges the target published in ``table``; ``slot`` is this data
    plane's pool in it (``ExtentTable.attach``), from which writes to ALLOC
    granules take their clusters. None: such writes are misses (the target
    allocates), as a table that never enabled allocation would have them.
    ``pool``: attaches a pool and returns its slot (None: none), called by
    the data plane that serves this map: a pool is counted clusters a crash
    leaks, so one is made only where a data plane can take from it."""

    table: ExtentTable
    slot: int | None = None
    pool: Callable[[], int | None] | None = field(default=None, compare=False, repr=False)

    def served(self) -> Extents:
        """This map as a data plane serves it: with its pool's slot."""
        if self.pool is None:
            return self
        return Extents(self.table, self.pool())


@dataclass(frozen=True, slots=True)
class Passthrough:
    """The device is NVMe namespace ``nsid`` of ``fd`` (``/dev/ngXnY``),
    ``block_size``-byte blocks from LBA 0; a request not in whole blocks is
    a miss. Flush, discard and write zeroes are one command each; with a
    ``volatile_cache``, a flush is a command and a FUA write carries the
    bit where the namespace takes it (``fua``), else it is Python's."""

    fd: int
    nsid: int
    block_size: int
    volatile_cache: bool = False
    fua: bool = False


@dataclass(frozen=True, slots=True)
class External:
    """A plug-in's ``struct aur_dp_ext`` table at address ``ops`` with its
    context at ``ctx`` (both in another extension, held alive by ``owner``
    for as long as the data plane lives); ``wake`` runs on the worker's
    loop when the plug-in asks Python to look (its connection died, its
    commands for Python completed)."""

    ops: int
    ctx: int
    wake: Callable[[], None]
    owner: object


Map = Null | Linear | Striped | Extents | Passthrough | External

#: the kinds of record the data plane hands to Python (the kind in its user_data)
EV_IO, EV_FETCH, EV_TAG, EV_RETRY, EV_COMMIT, EV_LOST, EV_IDLE, EV_EXT = (
    lib.AUR_DP_EV_IO, lib.AUR_DP_EV_FETCH, lib.AUR_DP_EV_TAG, lib.AUR_DP_EV_RETRY,
    lib.AUR_DP_EV_COMMIT, lib.AUR_DP_EV_LOST, lib.AUR_DP_EV_IDLE, lib.AUR_DP_EV_EXT)

# the layout's fields, as C defines them (dataplane.h)
_KIND_SHIFT, _KIND_MASK = lib.AUR_DP_UD_KIND_SHIFT, lib.AUR_DP_UD_KIND_MASK
_LOCAL_SHIFT, _LOCAL_MASK = lib.AUR_DP_UD_LOCAL_SHIFT, lib.AUR_DP_UD_LOCAL_MASK
_TAG_SHIFT, _TAG_MASK = lib.AUR_DP_UD_TAG_SHIFT, lib.AUR_DP_UD_TAG_MASK
_AUX_MASK = lib.AUR_DP_UD_AUX_MASK


def decode(ud: int) -> tuple[int, int, int, int]:
    """(kind, queue's local index, tag, aux) of a data-plane user_data."""
    return ((ud >> _KIND_SHIFT) & _KIND_MASK, (ud >> _LOCAL_SHIFT) & _LOCAL_MASK,
            (ud >> _TAG_SHIFT) & _TAG_MASK, ud & _AUX_MASK)


def encode(kind: int, local: int, tag: int, aux: int = 0) -> int:
    """The user_data C would give (kind, local, tag, aux): for tests that play the
    kernel's part."""
    return (UD_MARK | (kind & _KIND_MASK) << _KIND_SHIFT | (local & _LOCAL_MASK) << _LOCAL_SHIFT
            | (tag & _TAG_MASK) << _TAG_SHIFT | aux & _AUX_MASK)


#: time every request from fetch to commit on data planes made from now on
#: (the latency histograms of ``aioublk.frontend.metrics``); off, it costs nothing
#: measurable. Switched by ``metrics.enable_timing``.
timing = False


class DataPlane:
    """A worker's C data plane, made on ``ring`` and handed to it (the ring
    reaps through it from now on and frees it when it closes); the records
    C leaves to Python go to ``on_event``."""

    def __init__(self, ring: Ring, setup: dict[str, int], nr_queues: int,
                 on_event: EventHandler, *, own_wait: bool = True) -> None:
        err = ffi.new("int *")
        c = lib.aur_dp_new(ring.raw, ffi.new("struct aur_dp_setup *", setup), err)
        if c == ffi.NULL:
            raise OSError(-err[0], f"data plane setup failed: {os.strerror(-err[0])}")
        self.c = c
        self.on_event = on_event
        #: per local queue, the counters C keeps (Python owns the memory)
        self.counts = ffi.new("struct aur_dp_counts[]", max(nr_queues, 1))
        #: held, not just recorded: C reads an Extents map's table, which is
        #: freed with its last Python reference
        self.map: Map | None = None
        try:
            ring.attach(self)
        except BaseException:
            lib.aur_dp_free(c)
            raise
        #: C sleeps in the ring for the worker's loop (cwait); else it polls in reaps
        self.owns_wait = own_wait and hand_wait_to_c(c, ring.loop)
        if self.owns_wait:
            ring.c_submits()

    def set_map(self, m: Map | None) -> None:
        """Serve ``m`` in C from now on (None: every request goes to Python)."""
        if m is None:
            return
        if isinstance(m, Null):
            ret = lib.aur_dp_map_null(self.c)
        elif isinstance(m, Linear):
            ret = lib.aur_dp_map_linear(self.c, m.fd, m.base)
        elif isinstance(m, Striped):
            fds = ffi.new("int[]", list(m.fds))
            ret = lib.aur_dp_map_striped(self.c, fds, len(m.fds), m.chunk)
        elif isinstance(m, Extents):
            m = m.served()
            ret = lib.aur_dp_map_extents(self.c, m.table.cdata,
                                         m.table.granule.bit_length() - 1,
                                         -1 if m.slot is None else m.slot)
        elif isinstance(m, Passthrough):
            flags = (lib.AUR_NVME_VWC if m.volatile_cache else 0) | \
                (lib.AUR_NVME_FUA if m.fua else 0)
            ret = lib.aur_dp_map_nvme(self.c, m.fd, m.nsid, m.block_size.bit_length() - 1,
                                      flags)
        elif isinstance(m, External):
            ret = lib.aur_dp_map_extern(self.c, ffi.cast("const struct aur_dp_ext *", m.ops),
                                        ffi.cast("void *", m.ctx))
        else:
            raise TypeError(f"not a data-plane map: {m!r}")
        if ret < 0:
            raise OSError(-ret, f"the data plane refused {m!r}: {os.strerror(-ret)}")
        self.map = m

    def wake(self) -> None:
        """The external map's plug-in asked for Python (``EV_EXT``)."""
        if isinstance(self.map, External):
            self.map.wake()

    @property
    def inflight(self) -> int:
        """Requests C holds."""
        return int(lib.aur_dp_inflight(self.c))

    def set_timing(self, on: bool) -> None:
        lib.aur_dp_set_timing(self.c, int(on))

    def set_stopping(self, stopping: bool) -> None:
        lib.aur_dp_set_stopping(self.c, int(stopping))

    def set_sealed(self) -> None:
        lib.aur_dp_set_sealed(self.c, 1)

    def check(self, ret: int, what: str) -> None:
        if ret < 0:
            raise OSError(-ret, f"{what}: {os.strerror(-ret)}")

