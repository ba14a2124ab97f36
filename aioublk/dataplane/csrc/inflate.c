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
 * remade, per cluster.
 *
 * Why a cache: a VM reads a cloud image's hot clusters again and again, and
 * a file read in 4 KiB pages asks for one cluster many times in a row. The
 * plane keeps the clusters it inflated last, direct-mapped by where their
 * compressed bytes are, each as far as it was inflated: a read within that
 * is a copy, with no I/O and no inflate (dp_zcache_get); one past it
 * inflates again from the start, further. A cluster's compressed bytes are
 * a backing file's, never written while it is open, so an entry stays
 * true until the map changes (dp_zcache_clear). At most DP_ZCACHE_BYTES
 * per plane, in at least two slots.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>
#include <zstd.h>

#include "dp_internal.h"

#define DP_ZCACHE_BYTES (4u << 20)

/* a cluster inflated from the compressed bytes at (fd, zoff), its first
   `valid` bytes in data (0: empty) */
struct dp_zslot {
    int fd;
    uint64_t zoff;
    uint32_t valid;
    char *data;
};

struct dp_inflater {
    z_stream zs;
    int zs_ready;
    ZSTD_DCtx *zd;
    unsigned nslots;
    uint32_t slot_bytes;
    struct dp_zslot slots[];
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

/* The plane's inflater, made on first use (its cache's slots sized for the
   map's granule, at most 2 MiB); NULL: no memory. */
static struct dp_inflater *dp_inflater(struct aur_dp *dp)
{
    uint32_t gran = (uint32_t)1 << (dp->ext_shift < 21 ? dp->ext_shift : 21);
    unsigned n = DP_ZCACHE_BYTES / gran < 2 ? 2 : DP_ZCACHE_BYTES / gran;
    struct dp_inflater *f = dp->inflater;

    if (f)
        return f;
    f = calloc(1, sizeof(*f) + n * sizeof(f->slots[0]));
    if (!f)
        return NULL;
    f->nslots = n;
    f->slot_bytes = gran;
    dp->inflater = f;
    return f;
}

static struct dp_zslot *dp_zslot(struct dp_inflater *f, int fd, uint64_t zoff)
{
    uint64_t h = (zoff ^ ((uint64_t)(unsigned)fd << 48)) * 0x9E3779B97F4A7C15ULL;

    return &f->slots[(h >> 32) % f->nslots];
}

DP_HIDDEN int dp_zcache_get(struct aur_dp *dp, int fd, uint64_t zoff, char *dst, uint32_t skip,
                            uint32_t len)
{
    struct dp_inflater *f = dp->inflater;
    struct dp_zslot *z;

    if (!f)
        return 0;
    z = dp_zslot(f, fd, zoff);
    if (!z->valid || z->fd != fd || z->zoff != zoff || (uint64_t)skip + len > z->valid)
        return 0;
    memcpy(dst, z->data + skip, len);
    return 1;
}

DP_HIDDEN void dp_zcache_clear(struct aur_dp *dp)
{
    struct dp_inflater *f = dp->inflater;
    unsigned i;

    for (i = 0; f && i < f->nslots; i++)
        f->slots[i].valid = 0;
}

DP_HIDDEN int dp_inflate(struct aur_dp *dp, int alg, int fd, uint64_t zoff, const void *src,
                         size_t srclen, char *dst, uint32_t skip, uint32_t len)
{
    struct dp_inflater *f = dp_inflater(dp);
    size_t n = (size_t)skip + len;
    struct dp_zslot *z;
    int ret;

    if (!f || n > f->slot_bytes)
        return -ENOMEM;
    z = dp_zslot(f, fd, zoff);
    if (!z->data && !(z->data = malloc(f->slot_bytes)))
        return -ENOMEM;
    z->valid = 0;  /* (its old cluster is gone: the inflate below overwrites it) */
    if (alg == AUR_EXT_ZLIB)
        ret = dp_inflate_zlib(f, src, srclen, z->data, n);
    else if (alg == AUR_EXT_ZSTD)
        ret = dp_inflate_zstd(f, src, srclen, z->data, n);
    else
        ret = -EINVAL;
    if (ret)
        return ret;
    z->fd = fd;
    z->zoff = zoff;
    z->valid = (uint32_t)n;
    memcpy(dst, z->data + skip, len);
    return 0;
}

DP_HIDDEN void dp_inflater_free(struct aur_dp *dp)
{
    struct dp_inflater *f = dp->inflater;
    unsigned i;

    if (!f)
        return;
    if (f->zs_ready)
        inflateEnd(&f->zs);
    ZSTD_freeDCtx(f->zd);
    for (i = 0; i < f->nslots; i++)
        free(f->slots[i].data);
    free(f);
    dp->inflater = NULL;
}
