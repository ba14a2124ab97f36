/*
 * Inflating a compressed qcow2 cluster (an extent table's ZIP granule) on
 * the worker's thread, for the request that reads part of it.
 *
 * Why here and not in Python: the compressed bytes' place is published like
 * any backing data, so the read of them and the inflate are all a request
 * needs; handing it to Python would cost a coroutine through the image's
 * layers per request. Why only up to the part asked for: a stream inflates
 * from its start, so bytes past the request's end are never needed; a 4 KiB
 * read inflates half a cluster on average.
 *
 * One inflater per data plane (its worker inflates one piece at a time):
 * zlib's stream and zstd's context are made on first use and reset, never
 * remade, per cluster; a scratch buffer takes the bytes before the part
 * asked for.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>
#include <zstd.h>

#include "dp_internal.h"

struct dp_inflater {
    z_stream zs;
    int zs_ready;
    ZSTD_DCtx *zd;
    char *scratch;
    size_t scratch_cap;
};

/* Raw deflate (qcow2's zlib type: no header, any window up to 32 KiB) into
   out[0, n): 0 once n bytes came out. */
static int dp_inflate_zlib(struct dp_inflater *f, const void *src, size_t srclen, char *out,
                           size_t n)
{
    int ret;

    if (!f->zs_ready) {
        if (inflateInit2(&f->zs, -15) != Z_OK)
            return -ENOMEM;
        f->zs_ready = 1;
    } else if (inflateReset(&f->zs) != Z_OK) {
        return -EIO;
    }
    f->zs.next_in = (Bytef *)(uintptr_t)src;
    f->zs.avail_in = (uInt)srclen;
    f->zs.next_out = (Bytef *)out;
    f->zs.avail_out = (uInt)n;
    ret = inflate(&f->zs, Z_SYNC_FLUSH);
    if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR)
        return -EIO;
    return f->zs.avail_out ? -EIO : 0;
}

/* One zstd frame into out[0, n): 0 once n bytes came out; what follows the
   frame (the sector's padding) is never looked at. */
static int dp_inflate_zstd(struct dp_inflater *f, const void *src, size_t srclen, char *out,
                           size_t n)
{
    ZSTD_inBuffer in = { src, srclen, 0 };
    ZSTD_outBuffer o = { out, n, 0 };

    if (!f->zd && !(f->zd = ZSTD_createDCtx()))
        return -ENOMEM;
    ZSTD_DCtx_reset(f->zd, ZSTD_reset_session_only);
    while (o.pos < o.size) {
        size_t r = ZSTD_decompressStream(f->zd, &o, &in);

        if (ZSTD_isError(r) || r == 0 || (in.pos == in.size && o.pos < o.size))
            return o.pos == o.size ? 0 : -EIO;  /* (an error, the frame or input ended) */
    }
    return 0;
}

DP_HIDDEN int dp_inflate(struct aur_dp *dp, int alg, const void *src, size_t srclen,
                         char *dst, uint32_t skip, uint32_t len)
{
    struct dp_inflater *f = dp->inflater;
    size_t n = (size_t)skip + len;
    char *out = dst;
    int ret;

    if (!f && !(f = dp->inflater = calloc(1, sizeof(*f))))
        return -ENOMEM;
    if (skip) {  /* the bytes before the part asked for land in the scratch */
        if (f->scratch_cap < n) {
            free(f->scratch);
            f->scratch_cap = 0;
            if (!(f->scratch = malloc(n)))
                return -ENOMEM;
            f->scratch_cap = n;
        }
        out = f->scratch;
    }
    if (alg == AUR_EXT_ZLIB)
        ret = dp_inflate_zlib(f, src, srclen, out, n);
    else if (alg == AUR_EXT_ZSTD)
        ret = dp_inflate_zstd(f, src, srclen, out, n);
    else
        ret = -EINVAL;
    if (!ret && skip)
        memcpy(dst, out + skip, len);
    return ret;
}

DP_HIDDEN void dp_inflater_free(struct aur_dp *dp)
{
    struct dp_inflater *f = dp->inflater;

    if (!f)
        return;
    if (f->zs_ready)
        inflateEnd(&f->zs);
    ZSTD_freeDCtx(f->zd);
    free(f->scratch);
    free(f);
    dp->inflater = NULL;
}
