"""The loop target: one backing file or block device, I/O through the queue's
ring. Flush is fdatasync; discard punches a hole.

With integrity metadata (``--metadata_size``) it keeps it as kublk's loop
does: in a second file (buffered), ``metadata_size`` bytes per 512-byte
sector at ``sector * metadata_size``. The device is as big as both files
allow; a new device's metadata is set to 0xFF bytes, which the block layer
does not verify (so sectors never written read back)."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from typing import Any

from aioublk.dataplane.maps import Linear, Map
from aioublk.io.hostfile import Backing, BackingError, file_bytes, fit_geometry
from aioublk.kernel import uapi
from aioublk.ring import current_ring
from aioublk.target import Buffer, Done, Geometry, Target, rw_handler
from aioublk.targets.spec import BUFFERED, PATH, Option, TargetSpec

#: bytes written at a time when a new device's metadata file is set to 0xFF
_FILL_CHUNK = 1 << 20


class LoopTarget(Target):
    """A file or block device as the disk (``-t loop``): O_DIRECT at the
    backing's logical block size where it takes it, buffered I/O where not;
    its linear map lets the C data plane serve reads and writes. With
    integrity metadata a second file holds it."""

    name = "loop"
    fixed_buffers = True
    metadata = True
    c_idle = True  # every request and its I/O come through the ring

    def __init__(self, path: str, *, direct: bool = True, read_only: bool = False,
                 metadata_file: str | None = None) -> None:
        self.backing = Backing(path, direct=direct, read_only=read_only)
        size, lbs = self.backing.size, self.backing.logical_block_size
        if size < lbs:
            self.backing.close()
            raise BackingError(f"{path} ({size} bytes) is smaller than one {lbs}-byte block: "
                               "give a larger file")
        self.geometry = fit_geometry(
            Geometry(size=size & ~(lbs - 1), volatile_cache=True, read_only=read_only,
                     discard=True, write_zeroes=True), [self.backing])
        self.meta: Backing | None = None
        self.integrity: uapi.Integrity | None = None
        if metadata_file is not None:
            try:
                self.meta = Backing(metadata_file, direct=False, read_only=read_only)
            except BaseException:
                self.backing.close()
                raise

    def use_integrity(self, integrity: uapi.Integrity, *, fresh: bool) -> None:
        if self.meta is None:
            raise BackingError("loop with --metadata_size needs a second FILE, the metadata "
                               f"file ({integrity.metadata_size} bytes per 512-byte sector)")
        sectors = min(self.geometry.size, integrity.metadata_bytes_to_data(self.meta.size)) >> 9
        size = (sectors << 9) & ~(self.geometry.logical_block_size - 1)
        if not size:
            raise BackingError(f"{self.meta.path} is too small for any metadata: it needs "
                               f"{integrity.metadata_size} bytes per 512-byte sector")
        self.geometry = replace(self.geometry, size=size, integrity=integrity)
        self.integrity = integrity
        if fresh and not self.geometry.read_only:
            fill = b"\xff" * _FILL_CHUNK
            end = integrity.meta_bytes(size)
            for at in range(0, end, _FILL_CHUNK):
                os.pwrite(self.meta.fd, fill[:end - at], at)

    def map(self) -> Map:
        return Linear(self.backing.fd)

    async def read(self, offset: int, buf: Buffer, meta: memoryview | None = None) -> None:
        await self.backing.read_into(buf, offset)
        if meta is not None and self.meta is not None and self.integrity is not None:
            await self.meta.read_into(meta, self.integrity.meta_bytes(offset))

    async def write(self, offset: int, buf: Buffer, fua: bool = False,
                    meta: memoryview | None = None) -> None:
        await self.backing.write(buf, offset)
        if meta is not None and self.meta is not None and self.integrity is not None:
            await self.meta.write(meta, self.integrity.meta_bytes(offset))
        if fua:
            await self.sync()

    async def sync(self) -> None:
        """fdatasync the backing file (and the metadata file)."""
        await self.backing.sync()
        if self.meta is not None:
            await self.meta.sync()

    def start_read(self, offset: int, buf: memoryview, done: Done) -> bool:
        current_ring().start_read(self.backing.fd, buf, offset,
                                  rw_handler(len(buf), done, lambda: self.read(offset, buf),
                                             partial(self.backing.refused, "a read")))
        return True

    def start_write(self, offset: int, buf: memoryview, done: Done) -> bool:
        current_ring().start_write(self.backing.fd, buf, offset,
                                   rw_handler(len(buf), done, lambda: self.write(offset, buf),
                                              partial(self.backing.refused, "a write")))
        return True

    async def flush(self) -> None:
        await self.sync()

    async def discard(self, offset: int, length: int) -> None:
        await self.backing.punch(offset, length)

    async def write_zeroes(self, offset: int, length: int, unmap: bool = True) -> None:
        await self.backing.zero(offset, length, unmap)

    async def drain(self) -> None:
        await self.sync()  # a failure reaches the exit status

    def close(self) -> None:
        self.backing.close()
        if self.meta is not None:
            self.meta.close()

    @classmethod
    def capacity(cls, files: list[str], options: dict[str, Any]) -> int | None:
        return file_bytes(files[0]) & ~511 if files else None

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {"target": self.name, "size": self.geometry.size,
                                "file": self.backing.path, "direct": self.backing.direct}
        if self.meta is not None:
            d["metadata_file"] = self.meta.path
        return d


#: ``-t loop``: its options, as the command line and config files take them
SPEC = TargetSpec("loop", LoopTarget, (
    Option("file", PATH, "the backing file or block device", arg="*",
           required=True, what="backing file"),
    BUFFERED,
    Option("metadata_file", PATH, "with --metadata_size: the file keeping the integrity "
           "metadata, metadata_size bytes per 512-byte sector (the second FILE, as "
           "kublk's)", what="metadata file"),
), files="file", second_file="metadata_file", read_only=True, rank=2)
