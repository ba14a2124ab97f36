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
from pathlib import Path

import pytest

from aioublk.dataplane.maps import Extents, Null
from aioublk.frontend import registry
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
