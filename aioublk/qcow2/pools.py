"""Allocation in C: pools of clusters the engine counted, and the records of
what C did with them.

A guest's first write to a cluster is an allocation, and in Python that is
a task, a dozen coroutine frames and a Python SQE per request. So an
unallocated cluster of a cached, private L2 table (no backing data under
it, the image writable, no metadata write-through unless C's writes are
held) is published as ALLOC
(``aioublk.dataplane.extents``): the data plane serves a write to it by taking a
cluster from its queue's pool, writing the data there, and recording
``(guest cluster, host cluster)``. Python still decides everything else:
which clusters enter a pool, when, and where each record goes.

The rules that keep the promises of ``aioublk.qcow2.image``:
- a pool holds only clusters that are free, counted (refcount 1 in memory,
  their refcount block dirty) and read as zeros: fresh ones past the end of
  the file. C writes part of one and the rest must read as zeros;
- C pushes a record after the data write completed and before it answers
  the request (``aur_dp``: the record, then the commit). So a request that
  follows a completed C write finds its record, and the engine applies
  records (``drain``: the L2 entry points at the cluster, the table
  dirty) before anything depends on them: at the entry of every request it
  serves, after taking back clusters it is about to change (``settle``),
  before a write-back's cut (a FLUSH covers every C write that completed
  before the guest sent it), before evicting a table C may allocate in, and
  at close;
- a crash leaks at worst: the L2 entry is written only by a write-back,
  whose plan puts the data's and the refcounts' barrier before the L2
  tables; a cluster counted and never referenced is a leak
  (``qemu-img check`` exit 3), which is also what a pool holds at a crash
  (at most ``POOL_BYTES`` per queue). A clean close takes the pools back and
  uncounts them;
- a failed C write is served again by Python, and its cluster (never
  referenced) is freed like any other.

``Pools`` knows the extent table, the refcounts (``aioublk.qcow2.refcounts``),
the L1 table and L2 cache it applies records to, and the data plane's map
of the host clusters it serves (``Publisher.pub_host``); the image decides
when C may allocate (``Qcow2Image.c_allocating``) and tells it.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable

from aioublk.dataplane.extents import ALLOCATING, MAP, SUB, ExtentTable
from aioublk.qcow2.base import PARTIAL, L2Table, log
from aioublk.qcow2.format import COMPRESSED, COPIED, OFFSET_MASK, SUB_ALLOC
from aioublk.qcow2.refcounts import Refcounts

#: what one queue's pool may hold: the most a crash can leak per queue
POOL_BYTES = 8 << 20
#: records C may hold for the engine before an allocating write misses
LOG_RECORDS = 4096
#: the bits of an L2 entry that say where its data is
_WHERE = OFFSET_MASK | COMPRESSED


class Pools:
    """The pools of the queues' data planes, and the records of their use."""

    #: allocation in C may be used (a switch for tests and bisection)
    c_alloc = True

    def __init__(self, path: str, cbits: int, l2_bits: int, refs: Refcounts, l1: array[int],
                 l2cache: OrderedDict[int, L2Table], pub_host: dict[int, int],
                 changed: Callable[[int], None], may_alloc: Callable[[], bool]) -> None:
        self.path = path
        self.cbits = cbits
        self.l2_bits = l2_bits
        self.l2_mask = (1 << l2_bits) - 1
        self.refs = refs
        self.l1 = l1
        self.l2cache = l2cache
        self.pub_host = pub_host  # (``Publisher.pub_host``: a record's cluster is served)
        self.changed = changed  # n L2 entries changed in memory (the write-back's count)
        self.may_alloc = may_alloc  # the image's ``c_allocating``
        #: the image's extent table, once it has one (``Qcow2Image.extent_table``)
        self.table: ExtentTable | None = None
        self.slots: list[int] = []   # attached pools (appended from any thread)
        self._attaching = threading.Lock()  # (every queue's data plane attaches at once)
        self.filling: asyncio.Task[None] | None = None
        #: C asked again while a fill ran: look at every pool once more after it
        #: (C asks once per pool until its next pool_add, so a call missed here
        #: would leave that pool empty for good)
        self.again = False
        self.cap = min(1024, max(16, POOL_BYTES >> cbits))  # clusters per pool

    def attach(self, fd: int) -> int:
        """A pool for one more data plane (any thread: ``ExtentTable.attach``
        is C's, under its mutex); it is filled by the next ``service``."""
        table = self.table
        assert table is not None
        with self._attaching:
            if not self.slots:
                table.set_alloc(fd, self.cap, LOG_RECORDS)
            slot = table.attach()
            self.slots.append(slot)
        return slot

    def drain(self) -> None:
        """Apply what C allocated: each ``ok`` record points its L2 entry at
        its cluster (the table dirty, to be written by the next write-back);
        a failed one frees its cluster."""
        table = self.table
        if table is None or not self.slots:
            return
        n = 0
        # (locals: this loop runs once per write C allocated)
        l1, cached, pub_host = self.l1, self.l2cache.get, self.pub_host
        cbits, l2_bits, l2_mask = self.cbits, self.l2_bits, self.l2_mask
        for vc, host_off, ok, _, subs, grown in table.drain():
            c = host_off >> cbits
            if not ok:
                self.refs.defer_free(c)
                continue
            off = l1[vc >> l2_bits] & OFFSET_MASK
            t = cached(off) if off else None
            i = vc & l2_mask
            # a record applies to an entry with no cluster (an allocation), or
            # (grown: more subclusters) to the partial entry of its cluster
            e = t.entries[i] if t is not None else None
            if e is None or ((e & _WHERE != host_off or not e & PARTIAL) if grown
                             else e & _WHERE):
                # C allocated where the engine did not let it: the cluster is
                # counted and holds acknowledged data nobody points at
                log.error("qcow2: a C allocation for an entry that changed or left the "
                          "cache; the cluster is leaked", image=self.path, cluster=vc,
                          host=host_off)
                continue
            assert t is not None
            if subs and subs != SUB_ALLOC:  # (COW_SUB, SUB: some subclusters data)
                assert t.subs is not None
                t.entries[i] = host_off | COPIED | PARTIAL
                t.subs[i] = subs  # (the others still show the backing file)
                t.pub[i] = SUB  # (as C keeps it)
            else:
                t.entries[i] = host_off | COPIED
                t.pub[i] = MAP
                if t.subs is not None:
                    t.subs[i] = SUB_ALLOC
            pub_host[c] = vc
            t.touch()
            n += 1
        if n:
            self.changed(n)

    def service(self) -> None:
        """C asked for the engine (a pool at half, the record log at half) or
        a pool was attached: apply the records, refill the pools, in one task
        at a time (on the engine's loop)."""
        self.drain()
        if self.filling is not None:
            self.again = True
        elif self.may_alloc():
            self.filling = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        try:
            table = self.table
            self.again = True
            while self.again:  # (until a pass began after C's last call)
                self.again = False
                for slot in list(self.slots):
                    if table is None or not self.may_alloc():
                        return
                    level = table.pool_level(slot)
                    if level * 2 > self.cap:
                        continue
                    run = await self._pool_run(self.cap - level)
                    added = table.pool_add(slot, [c << self.cbits for c in run])
                    if added < len(run):  # (C took fewer: never referenced, uncount)
                        async with self.refs.lock:
                            await self.refs.add_ref_run(run[added:], -1)
        except Exception as e:  # noqa: BLE001 - C allocation waits; Python allocates
            log.error("qcow2: refilling the data plane's pools failed", image=self.path,
                      error=str(e))
        finally:
            self.filling = None

    async def _pool_run(self, n: int) -> range:
        """``n`` fresh clusters past the end of the file, counted."""
        return await self.refs.fresh_run(n)

    async def take_back(self) -> None:
        """At close, after every data plane stopped: apply the last records,
        then uncount what the pools still hold (never referenced)."""
        table = self.table
        if table is None or not self.slots:
            return
        if self.filling is not None:
            await asyncio.shield(self.filling)
        self.drain()
        back = sorted(h >> self.cbits for slot in self.slots for h in table.pool_take(slot))
        async with self.refs.lock:
            for c in back:
                await self.refs.add_ref(c, -1)

    async def settle(self, vcs: range) -> None:
        """Before the engine reads the entries of ``vcs`` (held in ``_busy``) to
        change them: take back those C may allocate, wait for an allocating
        write in flight, and apply its record."""
        table = self.table
        if table is None or not self.slots:
            return
        off = self.l1[vcs.start >> self.l2_bits] & OFFSET_MASK
        t = self.l2cache.get(off) if off else None
        if t is None:
            return
        m = self.l2_mask
        if any(t.pub[vc & m] in ALLOCATING for vc in vcs):
            await table.unmap(vcs.start << self.cbits, len(vcs) << self.cbits)
            self.drain()
            for vc in vcs:  # (unmapped: whatever the records said, nothing is published)
                t.pub[vc & m] = 0
