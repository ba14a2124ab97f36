"""Decompressed clusters of a read-only image, kept where the data plane can
read them.

A cloud image is a compressed qcow2 base under an overlay, and a VM reads
its hot clusters again and again. Inflating one costs a request coroutine
and the decompression each time. A read-only image (a backing file: its
clusters never change) keeps the clusters it decompressed in a memfd of
bounded size, one slot per cluster; ``Qcow2Image.place`` then places a
cached compressed cluster in its slot, so the overlay publishes it like any
other data and C serves reads of it from RAM.

Slots are never overwritten while anything may read them: when the cache
is full it is emptied whole. It stops placing clusters, asks every
publisher holding extents in its memfd to take them back and wait until no
request C started on them is in flight (``holders``), and only then hands
its slots out again."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Awaitable, Callable


class ZCache:
    """Slots of decompressed clusters in a memfd, keyed by L2 entry."""

    def __init__(self, cluster_size: int, capacity: int) -> None:
        self.cluster_size = cluster_size
        self.nslots = max(1, capacity // cluster_size)
        self.fd = os.memfd_create("aioublk-qcow2-clusters", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nslots * cluster_size)
            self.mm = mmap.mmap(self.fd, self.nslots * cluster_size)
        except BaseException:
            os.close(self.fd)
            raise
        self.slots: dict[int, int] = {}  # compressed L2 entry -> slot
        #: publishers of this memfd's bytes: each takes back every extent it
        #: published in ``fd`` and returns once none is in flight
        self.holders: list[Callable[[int], Awaitable[None]]] = []
        self._emptying: asyncio.Future[None] | None = None

    def get(self, e: int) -> memoryview | None:
        """The cluster of compressed entry ``e``, if cached (valid until the
        next await)."""
        slot = self.slots.get(e)
        if slot is None:
            return None
        at = slot * self.cluster_size
        return memoryview(self.mm)[at:at + self.cluster_size]

    def where(self, e: int) -> int | None:
        """The memfd offset of entry ``e``'s cluster, for the data plane; None
        when not cached or while the cache empties."""
        slot = self.slots.get(e) if self._emptying is None else None
        return None if slot is None else slot * self.cluster_size

    async def put(self, e: int, data: bytes | memoryview) -> memoryview:
        """Keep ``data``, entry ``e``'s cluster (emptying the cache first when
        full); its view in the cache (valid until the next await)."""
        while e not in self.slots and len(self.slots) >= self.nslots:
            await self._empty()
        slot = self.slots.get(e)
        if slot is None:
            slot = self.slots[e] = len(self.slots)
            at = slot * self.cluster_size
            self.mm[at:at + self.cluster_size] = data
        at = slot * self.cluster_size
        return memoryview(self.mm)[at:at + self.cluster_size]

    async def _empty(self) -> None:
        if self._emptying is not None:
            await asyncio.shield(self._emptying)
            return
        self._emptying = asyncio.get_running_loop().create_future()
        try:
            for take_back in list(self.holders):
                await take_back(self.fd)
            self.slots.clear()
        finally:
            self._emptying.set_result(None)
            self._emptying = None

    def close(self) -> None:
        self.slots.clear()
        try:
            self.mm.close()
        except BufferError:
            pass  # (a view still exported: the mapping goes with the last one)
        os.close(self.fd)
