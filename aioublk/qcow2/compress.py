"""Compression and decompression of qcow2 compressed clusters: zlib (raw
deflate, as QEMU writes it) and zstd. Both release the GIL, so another
queue's thread or the ring keeps going while a cluster inflates."""

from __future__ import annotations

import zlib

from aioublk.qcow2.format import COMPRESSION_ZSTD


def decompress(kind: int, data: bytes | memoryview, cluster_size: int) -> bytes:
    """One cluster's bytes, or ValueError when the data does not inflate to a
    full cluster. Trailing bytes (the sector padding) are ignored."""
    if kind == COMPRESSION_ZSTD:
        from aioublk.qcow2._zstd import ffi, lib

        out = bytearray(cluster_size)
        n = lib.aur_zstd_decompress(ffi.from_buffer(out), cluster_size,
                                    ffi.from_buffer(data), len(data))
        if n != cluster_size:
            raise ValueError("zstd data does not inflate to a full cluster")
        return bytes(out)
    d = zlib.decompressobj(-15)  # raw deflate; 15 accepts every window size
    try:
        out_b = d.decompress(data, cluster_size)
    except zlib.error as e:
        raise ValueError(f"deflate data is corrupt ({e})") from None
    if len(out_b) != cluster_size:
        raise ValueError("deflate data does not inflate to a full cluster")
    return out_b


def compress(kind: int, data: bytes | memoryview, limit: int) -> bytes | None:
    """One cluster compressed as QEMU compresses it (deflate with a 4 KiB
    window, or one zstd frame), or None when that takes more than ``limit``
    bytes: the cluster is then better stored as it is."""
    if kind == COMPRESSION_ZSTD:
        from aioublk.qcow2._zstd import ffi, lib

        out = bytearray(limit)
        n = lib.aur_zstd_compress(ffi.from_buffer(out), limit, ffi.from_buffer(data), len(data))
        return bytes(out[:n]) if n >= 0 else None
    c = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -12, 9)
    packed = c.compress(data) + c.flush()
    return packed if len(packed) <= limit else None
