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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioublk.dataplane.extents import ExtentTable

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
