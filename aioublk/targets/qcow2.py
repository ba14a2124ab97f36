"""The qcow2 target: a thin adapter from ublk requests to ``Qcow2Image``.

All of a device's queues run on one loop (``one_loop``): the image's caches
and locks belong to that loop (see ``aioublk.qcow2.image``). Reads and
in-place writes of clusters the image has looked up are served by the C
data plane from the image's extent table (``map``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aioublk.kernel import uapi
from aioublk.qcow2 import Qcow2Image
from aioublk.qcow2.format import HEADER_BYTES, virtual_size
from aioublk.queue.dataplane import Extents, Map
from aioublk.target import Done, Geometry, Target


class Qcow2Target(Target):
    name = "qcow2"
    one_loop = True

    def __init__(self, path: str, *, read_only: bool = False,
                 cache_bytes: int | None = None, direct: bool = True,
                 allow_backing: Sequence[str] = (), backing_format: str | None = None) -> None:
        self.image = Qcow2Image.open(path, read_only=read_only, cache_bytes=cache_bytes,
                                     direct=direct, allow_backing=allow_backing,
                                     backing_format=backing_format)
        cs = self.image.cluster_size
        self.geometry = Geometry(
            size=self.image.size & ~511, volatile_cache=True, fua=True, read_only=read_only,
            discard=not read_only, discard_granularity=max(cs, 4096),
            write_zeroes=not read_only, io_opt=max(cs, 4096))
        self._closed = False

    def configure(self, device_flags: int) -> None:
        # the engine keeps L2 and refcount changes in memory until a FLUSH: a
        # device that outlives us needs them in the file before a write completes
        if device_flags & uapi.Feature.USER_RECOVERY:
            self.image.metadata_write_through = True
            self.image.republish()  # what the data plane had writable goes read-only

    def map(self) -> Map | None:
        """The image's extent table: the clusters it has looked up, served in C
        (see ``aioublk.qcow2.image``, "The data plane")."""
        table = self.image.extent_table()
        return None if table is None else Extents(table)

    async def read(self, offset: int, buf: memoryview) -> None:
        await self.image.read(offset, buf)

    async def write(self, offset: int, buf: memoryview,
                    fua: bool = False) -> None:
        await self.image.write(offset, buf)
        if fua:
            await self.image.flush()

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self.image.start_read(offset, buf, done)

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        return self.image.start_write(offset, buf, done)

    async def flush(self) -> None:
        await self.image.flush()

    async def discard(self, offset: int, length: int) -> None:
        await self.image.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.image.write_zeroes(offset, length, unmap=unmap)

    async def drain(self) -> None:
        if not self._closed:
            self._closed = True
            await self.image.close()

    def close(self) -> None:
        if not self._closed:  # never served: nothing cached, just the files
            self._closed = True
            self.image.release()

    @classmethod
    def capacity(cls, files: list[str], options: dict[str, Any]) -> int | None:
        if not files:
            return None
        with open(files[0], "rb") as f:
            size = virtual_size(f.read(HEADER_BYTES))
        return None if size is None else size & ~511

    def describe(self) -> dict[str, object]:
        h = self.image.h
        return {"target": self.name, "size": self.geometry.size, "file": self.image.path,
                "cluster_size": self.image.cluster_size, "version": h.version,
                "backing": h.backing_file,
                "metadata_write_through": self.image.metadata_write_through}
