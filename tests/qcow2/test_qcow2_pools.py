"""Where a qcow2 image's data plane gets a pool (host only: no ublk, no kernel).

A pool is counted clusters a data plane takes for its allocating writes: a
crash leaks what it holds. So a pool is attached only for a data plane that
serves from the image's own extent table: not under a filter that drops
the map (Python serves every request) or wraps it (``offset``), nor under
``readonly`` (no write reaches C). Here the queue is set up and its data
plane given the stack's map as the worker does it.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

from aioublk.dataplane.extents import MAP, SUB, Record
from aioublk.dataplane.maps import Extents, Null
from aioublk.frontend import registry
from aioublk.qcow2.base import PARTIAL, L2Table
from aioublk.qcow2.format import COPIED, SUB_ALLOC
from aioublk.qcow2.pools import Pools
from aioublk.ring import Ring
from aioublk.target import QueueContext, Target, setup_queue, teardown_queue
from aioublk.targets.qcow2 import Qcow2Target
from tests.dataplane.test_hostile_kernel import Plane
from tests.support.qcow2_util import K, M, check_clean, create

pytestmark = pytest.mark.asyncio

CS = 64 * K


async def serve(ring: Ring, top: Target) -> Plane:
    """Queue 0 set up on this loop and its data plane given the stack's map,
    as a worker does; then the owner's servicing (what C's notification
    asks for) has run to its end."""
    inner = top
    while not isinstance(inner, Qcow2Target):
        inner = inner.inner  # type: ignore[attr-defined]
    await setup_queue(top, QueueContext(0, (0,), asyncio.get_running_loop()))
    m = top.map()
    # (None: C serves nothing; the plane's map stands for that as Null)
    plane = Plane(ring, -1, map=m if m is not None else Null())
    inner.image.service()
    if inner.image.pools.filling is not None:
        await inner.image.pools.filling
    return plane


async def crash_after_writes(top: Target, plane: Plane) -> None:
    """Python allocates clusters, a flush makes every count durable, and the
    server dies (the files closed, nothing written back)."""
    for k in range(4):
        await top.write(k * CS, memoryview(bytearray(bytes([k + 1]) * CS)))
    await top.flush()
    await teardown_queue(top, QueueContext(0, (0,), asyncio.get_running_loop()))
    plane.close()
    top.close()  # (never drained: the image released as at a kill -9)


@pytest.mark.parametrize("stack", [["offset:offset=1M"], ["delay:write=0"],
                                   ["protect:ranges=8M-9M"], ["cache"]])
async def test_no_pool_under_a_filter_that_drops_the_map(tmp_path: Path, ring: Ring,
                                                        stack: list[str]) -> None:
    """The stack's map is not the image's table: no pool, nothing counted
    for one, and a crash after writes leaves no leaked cluster."""
    path = create(tmp_path / "a.qcow2", 16 * M, cluster_size=CS)
    qcow2 = Qcow2Target(str(path), direct=False)
    top = registry.with_filters(qcow2, registry.filter_stack(stack))
    plane = await serve(ring, top)
    assert plane.dp.map is None or not isinstance(plane.dp.map, Extents)
    assert not qcow2.image.c_allocating, f"under {stack}: a pool no data plane takes from"
    await crash_after_writes(top, plane)
    check_clean(path)


async def test_no_pool_under_readonly(tmp_path: Path, ring: Ring) -> None:
    """``readonly`` passes the table on (C serves reads), but no write
    reaches the data plane: no pool."""
    path = create(tmp_path / "a.qcow2", 16 * M, cluster_size=CS)
    qcow2 = Qcow2Target(str(path), direct=False)
    top = registry.with_filters(qcow2, registry.filter_stack(["readonly"]))
    plane = await serve(ring, top)
    try:
        assert isinstance(plane.dp.map, Extents) and plane.dp.map.slot is None
        assert not qcow2.image.c_allocating, "a pool under readonly"
    finally:
        await top.drain()
        plane.close()
        top.close()
    check_clean(path)


@pytest.mark.parametrize("stack", [[], ["truncate:size=8M"]])
async def test_a_data_plane_serving_the_table_gets_its_pool(tmp_path: Path, ring: Ring,
                                                            stack: list[str]) -> None:
    """The plain image, or under a filter that passes its table on: the
    data plane has a pool, filled, and a clean close takes it back."""
    path = create(tmp_path / "a.qcow2", 16 * M, cluster_size=CS)
    qcow2 = Qcow2Target(str(path), direct=False)
    top = registry.with_filters(qcow2, registry.filter_stack(stack))
    plane = await serve(ring, top)
    try:
        m = plane.dp.map
        assert isinstance(m, Extents) and m.slot is not None
        assert qcow2.image.c_allocating
        assert m.table.pool_level(m.slot) > 0, "the pool was not filled"
        await top.write(0, memoryview(bytearray(b"x" * CS)))
    finally:
        await top.drain()
        plane.close()
        top.close()
    check_clean(path)


async def test_records_apply_only_to_the_entries_the_engine_let_c_change() -> None:
    """What C records is applied to the L2 entries it was published for: an
    allocation to an entry with no cluster, more subclusters to the partial
    entry of the cluster named. A record for an entry that holds something
    else is refused (the cluster leaks, the entry stays), and a failed one
    frees its cluster."""
    x, y, z = 10 * CS, 11 * CS, 12 * CS
    entries = array("Q", [0, x | COPIED, y | COPIED | PARTIAL, 0])
    l2 = L2Table(CS, entries, 0, subs=array("Q", [0, 0, 1, 0]))
    freed: list[int] = []
    changed: list[int] = []
    pools = Pools("img", 16, 13, SimpleNamespace(defer_free=freed.append),  # type: ignore[arg-type]
                  array("Q", [CS]), OrderedDict({CS: l2}), {}, changed.append, lambda: True)
    records = [Record(0, z, True, 0, 0, False),            # allocation: applied
               Record(1, 13 * CS, True, 0, 0, False),      # entry has a cluster: refused
               Record(2, y, True, 0, 3, True),             # more subclusters: applied
               Record(1, x, True, 0, 3, True),             # entry not partial: refused
               Record(3, 14 * CS, False, 0, 0, False)]     # failed: freed
    pools.table = SimpleNamespace(drain=lambda: records)  # type: ignore[assignment]
    pools.slots = [0]
    pools.drain()
    assert list(entries) == [z | COPIED, x | COPIED, y | COPIED | PARTIAL, 0]
    assert list(l2.subs or ()) == [SUB_ALLOC, 0, 3, 0]
    assert list(l2.pub) == [MAP, 0, SUB, 0]
    assert freed == [14] and changed == [2]
