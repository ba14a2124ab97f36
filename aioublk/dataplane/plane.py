"""A worker's C data plane: made on its ring, it serves what the target's map
(``maps``) resolves from fetch to commit, and leaves records for Python in
user_data whose layout ``decode`` reads."""

from __future__ import annotations

import os

from aioublk._uring import ffi, lib
from aioublk.dataplane.cwait import hand_wait_to_c
from aioublk.dataplane.maps import Extents, External, Linear, Map, Null, Passthrough, Striped
from aioublk.ring import UD_MARK, EventHandler, Ring

#: the kinds of record the data plane hands to Python (the kind in its user_data)
EV_IO, EV_FETCH, EV_TAG, EV_RETRY, EV_COMMIT, EV_LOST, EV_IDLE, EV_EXT, EV_HELD = (
    lib.AUR_DP_EV_IO, lib.AUR_DP_EV_FETCH, lib.AUR_DP_EV_TAG, lib.AUR_DP_EV_RETRY,
    lib.AUR_DP_EV_COMMIT, lib.AUR_DP_EV_LOST, lib.AUR_DP_EV_IDLE, lib.AUR_DP_EV_EXT,
    lib.AUR_DP_EV_HELD)

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

