"""cffi (API mode) builder for ``aioublk.qcow2._zstd``: zstd compression and
decompression of qcow2 compressed clusters, with the GIL released.

Why not a PyPI binding: QEMU's zstd clusters end in sector padding after the
frame, and QEMU's reader stops as soon as the cluster is full; one streaming
call in C does exactly that, in ~20 lines and against the system libzstd.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import cffi

CDEF = """
long aur_zstd_decompress(void *dst, size_t dst_len, const void *src, size_t src_len);
long aur_zstd_compress(void *dst, size_t dst_len, const void *src, size_t src_len);
"""

SOURCE = r"""
#include <zstd.h>

/* Decompress until dst is full (bytes written) or the input ends or is bad (-1).
   Trailing bytes after the frame (sector padding) are ignored, as QEMU does. */
long aur_zstd_decompress(void *dst, size_t dst_len, const void *src, size_t src_len)
{
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    ZSTD_outBuffer out = { dst, dst_len, 0 };
    ZSTD_inBuffer in = { src, src_len, 0 };
    long ret = -1;

    if (!dctx)
        return -1;
    while (out.pos < out.size) {
        size_t r = ZSTD_decompressStream(dctx, &out, &in);
        if (ZSTD_isError(r))
            goto done;
        if (in.pos == in.size && out.pos < out.size && r != 0)
            goto done;            /* input ran out mid-frame */
        if (r == 0 && out.pos < out.size)
            break;                /* frame ended before the cluster did */
    }
    ret = (long)out.pos;
done:
    ZSTD_freeDCtx(dctx);
    return ret;
}

/* One frame at zstd's default level (QEMU's), or -1 when it does not fit dst. */
long aur_zstd_compress(void *dst, size_t dst_len, const void *src, size_t src_len)
{
    size_t r = ZSTD_compress(dst, dst_len, src, src_len, ZSTD_CLEVEL_DEFAULT);

    return ZSTD_isError(r) ? -1 : (long)r;
}
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
_LINK = runpy.run_path(str(Path(__file__).parents[2] / "buildlibs.py"))["source_args"](
    "libzstd", ["zstd"])
ffibuilder.set_source("aioublk.qcow2._zstd", SOURCE, **_LINK)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
