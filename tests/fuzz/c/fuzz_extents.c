/*
 * The extent table (aioublk/dataplane/csrc/extents.c) against a model of what its
 * header and comments promise: random sequences of inserts, L2
 * publications, acquires, releases (each outcome settling what a write
 * allocated), invalidations, pools and drains, each result compared with
 * the model's: the pieces a request gets (merged where host-contiguous,
 * zeros as fd -1, an allocating write the taken-th cluster of its pool, a
 * ZIP granule a piece of its own, a SUB granule's read a piece per run of
 * subclusters), the copies a copy-on-write gets (COW, COW_SUB, ZIP_COW,
 * and a SUB granule's new subclusters),
 * busy counts including removed-but-held entries, the records in the log
 * in order, pool order (an unused cluster goes back to the head), stats.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "extents.h"
#include "input.h"

#define NG 256          /* granules the model's device has */
#define MAXIDS 16
#define MAXHOLDS 32
#define ALLOCATING 4
#define ALLOC_FD 9
#define NSLOTS 3

struct ment {           /* an entry: live (in lmap) or removed but held */
    int used, gone, kind, fd, writable, slot;
    uint64_t gran, host;
    uint32_t inflight, cid;
    int has_cid;
    int src_fd, src_kind;   /* COW kinds while ALLOCATING; SUB: the others' data */
    uint64_t src_host;
    uint32_t subs, grow;    /* COW_SUB while ALLOCATING: touched; SUB: data here */
    uint32_t zlen;
    int zalg;
};

struct hold { int used; unsigned n; uint32_t ids[MAXIDS]; struct ment *m[MAXIDS]; };

static struct {
    struct aur_ext *t;
    unsigned shift, max;
    uint64_t gmask;
    struct ment ents[NG * 2 + MAXHOLDS * MAXIDS];
    struct ment *lmap[NG];
    unsigned live, gone;
    struct hold holds[MAXHOLDS];
    int alloc_on;
    unsigned pool_cap, log_cap, nslots;
    uint64_t pool[NSLOTS][64];
    unsigned pool_head[NSLOTS], pool_n[NSLOTS], pool_out[NSLOTS];
    struct aur_ext_rec log[64];
    unsigned log_head, log_n, allocating;
    uint64_t done, failed, unused, grown;
} M;

#define ALL_SUBS 0xffffffffu
#define IS_DATA(k) ((k) == AUR_EXT_MAP || (k) == AUR_EXT_COW || (k) == AUR_EXT_COW_SUB || \
                    (k) == AUR_EXT_SUB)

static struct ment *ment_new(void)
{
    size_t i;

    for (i = 0; i < sizeof(M.ents) / sizeof(M.ents[0]); i++)
        if (!M.ents[i].used) {
            memset(&M.ents[i], 0, sizeof(M.ents[i]));
            M.ents[i].used = 1;
            return &M.ents[i];
        }
    abort();
}

static void ment_drop(struct ment *m)
{
    m->used = 0;
}

/* -- insert and publish ----------------------------------------------------- */

static int same(const struct ment *m, int kind, int fd, uint64_t host, int writable,
                uint32_t zlen, int zalg)
{
    if (m->kind != kind)
        return 0;
    if (kind == AUR_EXT_ZIP || kind == AUR_EXT_ZIP_COW)
        return m->fd == fd && m->host == host && m->zlen == zlen && m->zalg == zalg;
    return !IS_DATA(kind) || (m->fd == fd && m->host == host && m->writable == !!writable);
}

/* ext_insert_locked's promise: all or nothing, -EEXIST, -ENOSPC (ZIP: n is 1,
   host the compressed bytes' offset) */
static int model_insert_z(uint64_t g0, uint64_t n, int kind, int fd, uint64_t host,
                          int writable, uint32_t zlen, int zalg)
{
    uint64_t k, need = 0;

    if (n > M.max)
        return -ENOSPC;
    for (k = 0; k < n; k++) {
        struct ment *m = M.lmap[g0 + k];

        if (!m)
            need++;
        else if (!same(m, kind, fd, kind == AUR_EXT_ZIP || kind == AUR_EXT_ZIP_COW ? host :
                       host + (k << M.shift), writable, zlen, zalg))
            return -EEXIST;
    }
    if (!need)
        return 0;
    if (M.live + M.gone + need > M.max)
        return -ENOSPC;
    for (k = 0; k < n; k++) {
        struct ment *m;

        if (M.lmap[g0 + k])
            continue;
        m = ment_new();
        m->gran = g0 + k;
        m->kind = kind;
        m->src_fd = -1;
        if (IS_DATA(kind)) {
            m->fd = fd;
            m->host = host + (k << M.shift);
            m->writable = !!writable;
        } else if (kind == AUR_EXT_ZIP || kind == AUR_EXT_ZIP_COW) {
            m->fd = fd;
            m->host = host;
            m->zlen = zlen;
            m->zalg = zalg;
        } else {
            m->fd = -1;
        }
        M.lmap[g0 + k] = m;
        M.live++;
    }
    return 0;
}

static int model_insert(uint64_t g0, uint64_t n, int kind, int fd, uint64_t host, int writable)
{
    return model_insert_z(g0, n, kind, fd, host, writable, 0, 0);
}

static void op_insert(struct in *in)
{
    static const int kinds[] = { AUR_EXT_MAP, AUR_EXT_ZERO, AUR_EXT_ALLOC, 7,
                                 AUR_EXT_COW, AUR_EXT_COW_SUB, AUR_EXT_MAP, AUR_EXT_SUB };
    uint8_t b = in_u8(in), b2 = in_u8(in);
    uint64_t g0 = in_u8(in) % NG, n = in_u8(in) % 9, host = (uint64_t)in_u8(in) << M.shift;
    int kind = kinds[(b & 3) | (b2 & 4)], fd = b & 4 ? -1 : 3 + (b >> 3 & 1),
        writable = b >> 4 & 1;
    uint64_t off = g0 << M.shift, len, gmask = M.gmask;
    int want, got;

    if (g0 + n > NG)
        n = NG - g0;
    len = n << M.shift;
    if (b & 0x20)  /* misaligned */
        host |= 1;
    if (b & 0x40)
        len += 1;
    if (kind == AUR_EXT_ZERO || kind == AUR_EXT_ALLOC) {
        fd = -1;
        host = 0;
        writable = 0;
    }
    if ((kind == AUR_EXT_COW || kind == AUR_EXT_COW_SUB) && fd >= 0)
        writable = 0;   /* (read-only data) */
    if ((kind != AUR_EXT_ZERO && kind != AUR_EXT_ALLOC &&
         ((kind != AUR_EXT_MAP && kind != AUR_EXT_COW && kind != AUR_EXT_COW_SUB) || fd < 0)) ||
        (kind == AUR_EXT_COW_SUB && M.shift < 9 + 5) ||  /* (subclusters under a sector) */
        (off | len | host) & gmask)
        want = -EINVAL;
    else if (!len)
        want = 0;
    else
        want = model_insert(g0, n, kind, fd, host, writable);
    got = aur_ext_insert_kind(M.t, off, len, kind, fd, host, writable);
    FUZZ_CHECK(got == want, "insert kind %d granules %llu+%llu: %d, the model says %d", kind,
               (unsigned long long)g0, (unsigned long long)n, got, want);
}

static void op_insert_zip(struct in *in)
{
    uint8_t b = in_u8(in);
    uint64_t g = in_u8(in) % NG, off = (g << M.shift) | (b & 1), zoff = in_u16(in);
    int kind = b & 2 ? AUR_EXT_ZIP_COW : AUR_EXT_ZIP, fd = b & 4 ? -1 : 3 + (b >> 3 & 1);
    int zalg = b >> 4 & 3, want, got;
    uint32_t zlen = b & 0x40 ? 0 : 1 + in_u16(in);

    if (b & 0x80)
        kind = AUR_EXT_MAP;
    if ((kind != AUR_EXT_ZIP && kind != AUR_EXT_ZIP_COW) || fd < 0 || !zlen ||
        (zalg != AUR_EXT_ZLIB && zalg != AUR_EXT_ZSTD) || off & M.gmask)
        want = -EINVAL;
    else
        want = model_insert_z(g, 1, kind, fd, zoff, 0, zlen, zalg);
    got = aur_ext_insert_zip(M.t, off, kind, fd, zoff, zlen, zalg);
    FUZZ_CHECK(got == want, "insert_zip kind %d granule %llu: %d, the model says %d", kind,
               (unsigned long long)g, got, want);
}

static void op_insert_sub(struct in *in)
{
    uint8_t b = in_u8(in);
    uint64_t g = in_u8(in) % NG, off = (g << M.shift) | (b & 1);
    uint64_t host = ((uint64_t)in_u8(in) << M.shift) | (b >> 1 & 1);
    uint64_t src = (uint64_t)in_u8(in) << M.shift;
    uint32_t subs = b & 4 ? in_u32(in) : (b & 8 ? ALL_SUBS : 0x0000ff0fu << (b >> 4 & 7));
    int fd = b & 0x80 ? -1 : ALLOC_FD, src_fd = b & 0x40 ? -1 : 3, want, got;
    struct ment *m = g < NG ? M.lmap[g] : NULL;

    if (src_fd < 0)
        src = 0;
    if (M.shift < 9 + 5 || fd < 0 || !subs || subs == ALL_SUBS || (off | host) & M.gmask)
        want = -EINVAL;
    else if (m)
        want = m->kind == AUR_EXT_SUB && m->fd == fd && m->host == host && m->subs == subs &&
               m->src_fd == src_fd && m->src_host == src ? 0 : -EEXIST;
    else if ((want = model_insert(g, 1, AUR_EXT_SUB, fd, host, 1)) == 0) {
        m = M.lmap[g];
        m->subs = subs;
        m->src_fd = src_fd;
        m->src_host = src;
    }
    got = aur_ext_insert_sub(M.t, off, fd, host, subs, src_fd, src);
    FUZZ_CHECK(got == want, "insert_sub granule %llu subs %#x: %d, the model says %d",
               (unsigned long long)g, subs, got, want);
}

static int in_sorted(const uint64_t *a, unsigned n, uint64_t v)
{
    unsigned i;

    for (i = 0; i < n; i++)
        if (a[i] == v)
            return 1;
    return 0;
}

#define COPIED (1ULL << 63)
#define COMPRESSED (1ULL << 62)
#define OFFSET_MASK 0x00fffffffffffe00ULL

static void op_publish(struct in *in)
{
    uint64_t entries[16], meta[4], skip[4], host_out[16], gran_out[16];
    uint8_t pub[16], pub_want[16];
    unsigned n = in_u8(in) % 17, k, i;
    uint64_t g0 = in_u8(in) % NG, host_want[16], gran_want[16];
    struct aur_pub_rules r;
    int want = 0, got;
    uint8_t b = in_u8(in);

    if (g0 + n > NG)
        n = (unsigned)(NG - g0);
    memset(&r, 0, sizeof(r));
    r.used_end = (uint64_t)in_u8(in) << M.shift;
    r.size = (uint64_t)(in_u8(in) + 1) << M.shift;
    r.backing_end = b & 1 ? (uint64_t)in_u8(in) << M.shift : 0;
    r.writable_ok = b >> 1 & 1;
    r.alloc_ok = b >> 2 & 1;
    r.nmeta = in_u8(in) % 5;
    for (i = 0; i < r.nmeta; i++)  /* sorted, granule numbers */
        meta[i] = (i ? meta[i - 1] : 0) + in_u8(in) % 8;
    r.nskip = in_u8(in) % 5;
    for (i = 0; i < r.nskip; i++)
        skip[i] = (i ? skip[i - 1] : g0) + in_u8(in) % 4;
    r.meta = meta;
    r.skip = skip;
    for (k = 0; k < n; k++) {
        uint8_t e = in_u8(in);

        entries[k] = ((uint64_t)in_u8(in) << M.shift) | (e & 1 ? COPIED : 0) |
            (e & 2 ? COMPRESSED : 0) | (e & 4 ? 1 : 0) | (e & 8 ? 0x200 : 0);
        if (e & 16)
            entries[k] &= ~OFFSET_MASK;
        pub[k] = pub_want[k] = e & 32 ? AUR_EXT_ZERO : 0;
    }
    /* the rules, as the header and aioublk.qcow2.l2cache state them */
    for (k = 0; k < n; k++) {
        uint64_t g = g0 + k, e = entries[k], host = e & OFFSET_MASK;
        int zeros = r.alloc_ok && !host ? AUR_EXT_ALLOC : AUR_EXT_ZERO, kind, w = 0, ret;

        if (g << M.shift >= r.size)
            break;
        if (pub_want[k] || in_sorted(skip, r.nskip, g))
            continue;
        if (e & COMPRESSED)
            kind = 0;
        else if (e & 1)
            kind = zeros;
        else if (!host)
            kind = g << M.shift >= r.backing_end ? zeros : 0;
        else if (host & M.gmask || host >= r.used_end || in_sorted(meta, r.nmeta, host >> M.shift))
            kind = 0;
        else {
            kind = AUR_EXT_MAP;
            w = (e & COPIED) && r.writable_ok;
        }
        if (!kind)
            continue;
        ret = model_insert(g, 1, kind, 5, kind == AUR_EXT_MAP ? host : 0, w);
        if (ret == -ENOSPC)
            break;
        if (ret < 0) {
            want = ret;
            break;
        }
        pub_want[k] = (uint8_t)kind;
        if (kind == AUR_EXT_MAP) {
            host_want[want] = host >> M.shift;
            gran_want[want] = g;
            want++;
        }
    }
    got = aur_ext_publish_l2(M.t, 5, g0 << M.shift, entries, n, &r, pub, host_out, gran_out);
    FUZZ_CHECK(got == want, "publish_l2 of %u at granule %llu: %d, the model says %d", n,
               (unsigned long long)g0, got, want);
    FUZZ_CHECK(!memcmp(pub, pub_want, n), "publish_l2: pub_out differs from the model's");
    for (i = 0; (int)i < got; i++)
        FUZZ_CHECK(host_out[i] == host_want[i] && gran_out[i] == gran_want[i],
                   "publish_l2: MAP pair %u differs from the model's", i);
}

/* -- acquire and release ---------------------------------------------------- */

static int can_record(int slot, unsigned recs)
{
    if (slot < 0 || (unsigned)slot >= M.nslots || !M.log_cap)
        return 0;
    return M.log_n + M.allocating + recs < M.log_cap;
}

static int can_alloc(int slot, unsigned taken, unsigned recs)
{
    return can_record(slot, recs) && M.pool_n[slot] > taken;
}

/* the subclusters of the k-th of n granules [off, last] touches */
static uint32_t touched(unsigned k, unsigned n, uint64_t off, uint64_t last)
{
    unsigned ss = M.shift - 5, i0 = k ? 0 : (unsigned)((off & M.gmask) >> ss);
    unsigned i1 = k < n - 1 ? 31 : (unsigned)((last & M.gmask) >> ss);
    uint32_t m = 0;
    unsigned i;

    for (i = i0; i <= i1; i++)
        m |= 1u << i;
    return m;
}

/* a run onto the wanted pieces, merged where it goes on from the last; 0, or
   -1 with no room */
static int put(struct aur_ext_piece *want, unsigned *np, unsigned max, int *mergeable, int fd,
               uint64_t hst, uint32_t len)
{
    struct aur_ext_piece *p = *np ? &want[*np - 1] : NULL;

    if (p && *mergeable && p->fd == fd && (fd < 0 || p->host_off + p->len == hst)) {
        p->len += len;
        return 0;
    }
    if (*np == max)
        return -1;
    want[(*np)++] = (struct aur_ext_piece){ fd, len, hst, 0, 0, 0 };
    *mergeable = 1;
    return 0;
}

static void op_acquire(struct in *in)
{
    uint8_t b = in_u8(in);
    int write = b & 1, slot = (int)(in_u8(in) % (NSLOTS + 2)) - 1, cow = !(b & 4);
    unsigned max_pieces = 1 + in_u8(in) % 8, max_ids = 1 + in_u8(in) % MAXIDS;
    uint64_t g = in_u8(in), sub = in_u16(in) & M.gmask;
    uint32_t len = 1 + in_u32(in) % (8u << M.shift);
    uint64_t off = b & 2 ? UINT64_MAX - in_u16(in) : (g << M.shift) + sub;
    struct aur_ext_piece want[MAXIDS], got[MAXIDS];
    struct aur_ext_copy wc[2], gc[2];
    uint32_t ids[MAXIDS], alloc_bit[MAXIDS];
    struct ment *ms[MAXIDS];
    unsigned np = 0, taken = 0, recs = 0, nc = 0, gnc = 0, k, n, h;
    uint64_t last = 0, g0, g1, pos;
    int miss = 0, ret, mergeable = 0;
    struct hold *hd = NULL;

    for (h = 0; h < MAXHOLDS; h++)
        if (!M.holds[h].used) {
            hd = &M.holds[h];
            break;
        }
    if (!hd)
        return;
    if (len - 1 > UINT64_MAX - off) {
        miss = 1;
        n = 0;
    } else {
        last = off + (len - 1);
        g0 = off >> M.shift;
        g1 = last >> M.shift;
        n = g1 - g0 >= max_ids ? 0 : (unsigned)(g1 - g0 + 1);
        miss = !n;
        pos = off;
        for (k = 0; k < n && !miss; k++) {
            struct ment *m = g0 + k < NG ? M.lmap[g0 + k] : NULL;
            int fd;
            uint64_t hst, end, a, bb;
            uint32_t plen;

            alloc_bit[k] = 0;
            if (!m || m->kind == ALLOCATING) {
                miss = 1;
                break;
            }
            ms[k] = m;
            end = (g0 + k) << M.shift | M.gmask;
            if (end > last)
                end = last;
            plen = (uint32_t)(end - pos + 1);
            a = pos & M.gmask;
            bb = end & M.gmask;
            if (m->kind == AUR_EXT_SUB) {
                unsigned ss = M.shift - 5, s0 = (unsigned)(a >> ss), s1 = (unsigned)(bb >> ss);
                uint64_t from = (uint64_t)s0 << ss, to = ((uint64_t)(s1 + 1) << ss) - 1;

                if (!write) {   /* a piece per run of subclusters in one place */
                    uint64_t q = a;

                    while (q <= bb && !miss) {
                        unsigned si = (unsigned)(q >> ss);
                        int here = m->subs >> si & 1;
                        uint64_t e = ((uint64_t)(si + 1) << ss) - 1;

                        if (e > bb)
                            e = bb;
                        if (here ? put(want, &np, max_pieces, &mergeable, m->fd, m->host + q,
                                       (uint32_t)(e - q + 1))
                                 : put(want, &np, max_pieces, &mergeable, m->src_fd,
                                       m->src_fd >= 0 ? m->src_host + q : 0,
                                       (uint32_t)(e - q + 1)))
                            miss = 1;
                        q = e + 1;
                    }
                    pos = end + 1;
                    continue;
                }
                if (!m->writable) {
                    miss = 1;
                    break;
                }
                if (touched(k, n, off, last) & ~m->subs) {
                    int head = !(m->subs >> s0 & 1) && a > from;
                    int tail = !(m->subs >> s1 & 1) && to > bb;

                    if (!cow || !can_record(slot, recs) || ((head || tail) && m->src_fd < 0)) {
                        miss = 1;
                        break;
                    }
                    if (head)
                        wc[nc++] = (struct aur_ext_copy){ m->src_fd, m->fd, (uint32_t)(a - from),
                                                          m->src_host + from, m->host + from,
                                                          0, 0, 0 };
                    if (tail)
                        wc[nc++] = (struct aur_ext_copy){ m->src_fd, m->fd, (uint32_t)(to - bb),
                                                          m->src_host + bb + 1,
                                                          m->host + bb + 1, 0, 0, 0 };
                    recs++;
                    alloc_bit[k] = AUR_EXT_ID_ALLOC;
                }
                fd = m->fd;
                hst = m->host + a;
            } else if (write && (m->kind == AUR_EXT_ALLOC ||
                                 ((m->kind == AUR_EXT_COW || m->kind == AUR_EXT_COW_SUB ||
                                   m->kind == AUR_EXT_ZIP_COW) && cow))) {
                uint64_t from = 0, to = M.gmask;

                if (!can_alloc(slot, taken, recs)) {
                    miss = 1;
                    break;
                }
                fd = ALLOC_FD;
                hst = M.pool[slot][(M.pool_head[slot] + taken++) % M.pool_cap];
                recs++;
                if (m->kind == AUR_EXT_COW_SUB) {
                    unsigned ss = M.shift - 5;

                    from = a >> ss << ss;
                    to = (bb >> ss << ss) + ((uint64_t)1 << ss) - 1;
                }
                if (m->kind == AUR_EXT_ZIP_COW) {
                    if (a > from)
                        wc[nc++] = (struct aur_ext_copy){ m->fd, ALLOC_FD, (uint32_t)(a - from),
                                                          m->host, hst + from, m->zlen,
                                                          (uint32_t)from, m->zalg };
                    if (to > bb)
                        wc[nc++] = (struct aur_ext_copy){ m->fd, ALLOC_FD, (uint32_t)(to - bb),
                                                          m->host, hst + bb + 1, m->zlen,
                                                          (uint32_t)(bb + 1), m->zalg };
                } else if (m->kind != AUR_EXT_ALLOC) {
                    if (a > from)
                        wc[nc++] = (struct aur_ext_copy){ m->fd, ALLOC_FD, (uint32_t)(a - from),
                                                          m->host + from, hst + from, 0, 0, 0 };
                    if (to > bb)
                        wc[nc++] = (struct aur_ext_copy){ m->fd, ALLOC_FD, (uint32_t)(to - bb),
                                                          m->host + bb + 1, hst + bb + 1,
                                                          0, 0, 0 };
                }
                hst += a;
                alloc_bit[k] = AUR_EXT_ID_ALLOC;
            } else if (write && !m->writable) {
                miss = 1;
                break;
            } else if (m->kind == AUR_EXT_ZIP || m->kind == AUR_EXT_ZIP_COW) {
                if (np == max_pieces) {
                    miss = 1;
                    break;
                }
                want[np++] = (struct aur_ext_piece){ m->fd, plen, m->host, m->zlen,
                                                     (uint32_t)a, m->zalg };
                mergeable = 0;
                pos = end + 1;
                continue;
            } else {
                fd = m->fd;
                hst = IS_DATA(m->kind) ? m->host + a : 0;
            }
            if (put(want, &np, max_pieces, &mergeable, fd, hst, plen)) {
                miss = 1;
                break;
            }
            pos = end + 1;
        }
    }
    ret = aur_ext_acquire_cow(M.t, off, len, write, slot, got, max_pieces, ids, max_ids,
                              cow ? gc : NULL, cow ? &gnc : NULL);
    if (miss) {
        FUZZ_CHECK(ret == 0, "acquire %s %#llx+%u: %d pieces, the model says a miss",
                   write ? "write" : "read", (unsigned long long)off, len, ret);
        FUZZ_CHECK(gnc == 0, "acquire: a miss with %u copies", gnc);
        return;
    }
    FUZZ_CHECK(ret == (int)np, "acquire %s %#llx+%u: %d pieces, the model says %u",
               write ? "write" : "read", (unsigned long long)off, len, ret, np);
    for (k = 0; k < np; k++)
        FUZZ_CHECK(got[k].fd == want[k].fd && got[k].len == want[k].len &&
                   got[k].host_off == want[k].host_off && got[k].zlen == want[k].zlen &&
                   got[k].zskip == want[k].zskip && got[k].zalg == want[k].zalg,
                   "acquire: piece %u is (%d, %u, %#llx), the model says (%d, %u, %#llx)", k,
                   got[k].fd, got[k].len, (unsigned long long)got[k].host_off, want[k].fd,
                   want[k].len, (unsigned long long)want[k].host_off);
    FUZZ_CHECK(gnc == nc, "acquire: %u copies, the model says %u", gnc, nc);
    for (k = 0; k < nc; k++)
        FUZZ_CHECK(!memcmp(&gc[k], &wc[k], sizeof(wc[k])) ||
                   (gc[k].src_fd == wc[k].src_fd && gc[k].dst_fd == wc[k].dst_fd &&
                    gc[k].len == wc[k].len && gc[k].src_off == wc[k].src_off &&
                    gc[k].dst_off == wc[k].dst_off && gc[k].zlen == wc[k].zlen &&
                    gc[k].zskip == wc[k].zskip && gc[k].zalg == wc[k].zalg),
                   "acquire: copy %u (%d %#llx -> %#llx, %u) differs from the model's (%d "
                   "%#llx -> %#llx, %u)", k, gc[k].src_fd, (unsigned long long)gc[k].src_off,
                   (unsigned long long)gc[k].dst_off, gc[k].len, wc[k].src_fd,
                   (unsigned long long)wc[k].src_off, (unsigned long long)wc[k].dst_off,
                   wc[k].len);
    hd->used = 1;
    hd->n = n;
    for (k = 0; k < n; k++) {
        struct ment *m = ms[k];
        uint32_t cid = ids[k] & ~AUR_EXT_ID_ALLOC;

        FUZZ_CHECK((ids[k] & AUR_EXT_ID_ALLOC) == alloc_bit[k], "acquire: id %u's alloc bit",
                   k);
        FUZZ_CHECK(!m->has_cid || m->cid == cid, "acquire: an entry's id changed");
        m->has_cid = 1;
        m->cid = cid;
        m->inflight++;
        hd->ids[k] = ids[k];
        hd->m[k] = m;
        if (!alloc_bit[k])
            continue;
        M.allocating++;
        m->slot = slot;
        if (m->kind == AUR_EXT_SUB) {   /* more subclusters of its own cluster */
            m->grow = touched(k, n, off, last) & ~m->subs;
            m->src_kind = AUR_EXT_SUB;
            m->kind = ALLOCATING;
            continue;
        }
        if (m->kind == AUR_EXT_ALLOC) {
            m->src_fd = -1;
            m->src_kind = 0;
        } else {
            m->src_fd = m->fd;
            m->src_host = m->host;
            m->src_kind = m->kind;
        }
        m->subs = m->kind == AUR_EXT_COW_SUB ? touched(k, n, off, last) : 0;
        m->kind = ALLOCATING;
        m->fd = ALLOC_FD;
        m->writable = 0;
        m->host = M.pool[slot][M.pool_head[slot]];
        M.pool_head[slot] = (M.pool_head[slot] + 1) % M.pool_cap;
        M.pool_n[slot]--;
        M.pool_out[slot]++;
    }
    /* no two entries held share an id */
    for (k = 0; k < sizeof(M.ents) / sizeof(M.ents[0]); k++)
        for (h = 0; h < n; h++)
            FUZZ_CHECK(!M.ents[k].used || !M.ents[k].has_cid || &M.ents[k] == ms[h] ||
                       M.ents[k].cid != (ids[h] & ~AUR_EXT_ID_ALLOC),
                       "acquire: two entries with id %u", ids[h] & ~AUR_EXT_ID_ALLOC);
}

static void log_push(const struct ment *m, uint32_t flags)
{
    FUZZ_CHECK(M.log_n < M.log_cap, "a record with the log full (its room was reserved)");
    M.log[(M.log_head + M.log_n) % M.log_cap] = (struct aur_ext_rec){
        .gran = m->gran, .host_off = m->host, .flags = flags, .slot = (uint32_t)m->slot,
        .subs = m->subs,
    };
    M.log_n++;
}

/* what becomes of ALLOCATING entry m's write; 1 if it became data */
static unsigned settle(struct ment *m, int outcome)
{
    int s = m->slot;

    M.allocating--;
    if (m->src_kind == AUR_EXT_SUB) {   /* its own cluster: nothing to free */
        m->kind = AUR_EXT_SUB;
        if (outcome != AUR_EXT_DONE) {
            outcome == AUR_EXT_UNUSED ? M.unused++ : M.failed++;
            return 0;
        }
        m->subs |= m->grow;
        if (m->subs == ALL_SUBS) {
            m->kind = AUR_EXT_MAP;
            m->src_fd = -1;
        }
        M.done++;
        M.grown++;
        log_push(m, AUR_EXT_REC_OK | AUR_EXT_REC_GROWN);
        return 1;
    }
    M.pool_out[s]--;
    if (outcome == AUR_EXT_DONE) {
        m->kind = AUR_EXT_MAP;
        m->writable = 1;
        if (m->src_kind == AUR_EXT_COW_SUB && m->subs != ALL_SUBS)
            m->kind = AUR_EXT_SUB;
        else
            m->src_fd = -1;
        M.done++;
        log_push(m, AUR_EXT_REC_OK);
        return 1;
    }
    if (outcome == AUR_EXT_UNUSED) {
        M.pool_head[s] = (M.pool_head[s] + M.pool_cap - 1) % M.pool_cap;
        M.pool[s][M.pool_head[s]] = m->host;
        M.pool_n[s]++;
        M.unused++;
    } else {
        log_push(m, AUR_EXT_REC_FAILED);
        M.failed++;
    }
    if (m->src_fd >= 0) {   /* as it was: its data where it was */
        m->kind = m->src_kind;
        m->fd = m->src_fd;
        m->host = m->src_host;
        m->src_fd = -1;
    } else {
        m->kind = AUR_EXT_ALLOC;
        m->fd = -1;
        m->host = 0;
    }
    return 0;
}

static void release(struct hold *hd, int outcome)
{
    unsigned k, j, want = 0, got;

    got = aur_ext_release(M.t, hd->ids, hd->n, outcome);
    for (k = 0; k < hd->n; k++) {
        struct ment *m;

        j = outcome == AUR_EXT_UNUSED ? hd->n - 1 - k : k;
        m = hd->m[j];
        if (hd->ids[j] & AUR_EXT_ID_ALLOC && m->kind == ALLOCATING)
            want += settle(m, outcome);
        if (--m->inflight == 0 && m->gone) {
            M.gone--;
            ment_drop(m);
        }
    }
    FUZZ_CHECK(got == want, "release: %u became data, the model says %u", got, want);
    hd->used = 0;
}

static void op_release(struct in *in)
{
    struct hold *hd = &M.holds[in_u8(in) % MAXHOLDS];

    if (hd->used)
        release(hd, in_u8(in) % 3);
}

/* -- invalidate, busy, count ------------------------------------------------ */

static void range(struct in *in, uint64_t *off, uint64_t *len)
{
    uint8_t b = in_u8(in);

    *off = ((uint64_t)in_u8(in) << M.shift) + (b & 1 ? in_u16(in) : 0);
    *len = b & 2 ? UINT64_MAX - in_u8(in) : (uint64_t)in_u8(in) << (M.shift - (b & 4 ? 3 : 0));
}

static int overlaps(uint64_t g, uint64_t off, uint64_t len)
{
    uint64_t g0 = off >> M.shift, last = len - 1 > UINT64_MAX - off ? UINT64_MAX : off + len - 1;

    return len && g >= g0 && g <= last >> M.shift;
}

static void op_invalidate(struct in *in)
{
    uint64_t off, len, g;
    unsigned want = 0, got;

    range(in, &off, &len);
    got = aur_ext_invalidate(M.t, off, len);
    for (g = 0; g < NG; g++) {
        struct ment *m = M.lmap[g];

        if (!m || !overlaps(g, off, len))
            continue;
        want++;
        M.lmap[g] = NULL;
        M.live--;
        if (m->inflight) {
            m->gone = 1;
            M.gone++;
        } else {
            ment_drop(m);
        }
    }
    FUZZ_CHECK(got == want, "invalidate %#llx+%#llx removed %u, the model says %u",
               (unsigned long long)off, (unsigned long long)len, got, want);
}

static void op_busy(struct in *in)
{
    uint64_t off, len, want = 0;
    size_t i;
    unsigned got;

    range(in, &off, &len);
    got = aur_ext_busy(M.t, off, len);
    for (i = 0; i < sizeof(M.ents) / sizeof(M.ents[0]); i++)
        if (M.ents[i].used && overlaps(M.ents[i].gran, off, len))
            want += M.ents[i].inflight;
    FUZZ_CHECK(got == want, "busy %#llx+%#llx is %u, the model says %llu",
               (unsigned long long)off, (unsigned long long)len, got,
               (unsigned long long)want);
    FUZZ_CHECK(aur_ext_count(M.t) == M.live, "count %u, the model says %u",
               aur_ext_count(M.t), M.live);
}

/* -- pools and records ------------------------------------------------------ */

static void op_alloc(struct in *in)
{
    unsigned pool_cap = 1 + in_u8(in) % 64, log_cap = 1 + in_u8(in) % 64;
    int got = aur_ext_set_alloc(M.t, ALLOC_FD, pool_cap, log_cap), want;

    want = M.alloc_on ? -EALREADY : 0;
    FUZZ_CHECK(got == want, "set_alloc: %d, the model says %d", got, want);
    if (!M.alloc_on) {
        M.alloc_on = 1;
        M.pool_cap = pool_cap;
        M.log_cap = log_cap;
    }
}

static void op_attach(void)
{
    int got;

    if (M.nslots < NSLOTS) {  /* (the model's pools: three) */
        got = aur_ext_attach(M.t);
        FUZZ_CHECK(got == (int)M.nslots, "attach gave slot %d, not %u", got, M.nslots);
        M.nslots++;
    }
}

static void op_pool_add(struct in *in)
{
    unsigned slot = in_u8(in) % (NSLOTS + 1), n = in_u8(in) % 9, k, room;
    uint64_t host[8];
    int got, want;
    uint8_t b = in_u8(in);

    if (slot >= M.nslots && slot < NSLOTS)
        return;  /* (a slot the model never attached: beyond the three it uses) */
    for (k = 0; k < n; k++)
        host[k] = ((uint64_t)(in_u8(in) + 256 * (b & 1)) << M.shift) | (b & 2 && k == 0);
    got = aur_ext_pool_add(M.t, slot, host, n);
    if (b & 2 && n)
        want = -EINVAL;
    else if (slot >= M.nslots || !M.pool_cap)
        want = -EINVAL;
    else {
        room = M.pool_cap - M.pool_n[slot] - M.pool_out[slot];
        want = (int)(n < room ? n : room);
        for (k = 0; k < (unsigned)want; k++)
            M.pool[slot][(M.pool_head[slot] + M.pool_n[slot] + k) % M.pool_cap] = host[k];
        M.pool_n[slot] += (unsigned)want;
    }
    FUZZ_CHECK(got == want, "pool_add %u to slot %u: %d, the model says %d", n, slot, got, want);
}

static void op_pool_take(struct in *in)
{
    unsigned slot = in_u8(in) % NSLOTS, max = in_u8(in) % 8, got, k;
    uint64_t out[8];

    if (slot >= M.nslots)
        return;
    FUZZ_CHECK(aur_ext_pool_level(M.t, slot) == M.pool_n[slot], "pool level %u, the model "
               "says %u", aur_ext_pool_level(M.t, slot), M.pool_n[slot]);
    got = aur_ext_pool_take(M.t, slot, out, max);
    FUZZ_CHECK(got == (max < M.pool_n[slot] ? max : M.pool_n[slot]), "pool_take: %u", got);
    for (k = 0; k < got; k++) {
        FUZZ_CHECK(out[k] == M.pool[slot][M.pool_head[slot]], "pool_take: cluster %u is "
                   "%#llx, the model says %#llx", k, (unsigned long long)out[k],
                   (unsigned long long)M.pool[slot][M.pool_head[slot]]);
        M.pool_head[slot] = (M.pool_head[slot] + 1) % M.pool_cap;
        M.pool_n[slot]--;
    }
}

static void op_drain(struct in *in)
{
    struct aur_ext_rec out[8];
    unsigned max = in_u8(in) % 9, got = aur_ext_drain(M.t, out, max), k;
    struct aur_ext_stats st;

    FUZZ_CHECK(got == (max < M.log_n ? max : M.log_n), "drain gave %u of %u", got, M.log_n);
    for (k = 0; k < got; k++) {
        const struct aur_ext_rec *w = &M.log[M.log_head];

        FUZZ_CHECK(out[k].gran == w->gran && out[k].host_off == w->host_off &&
                   out[k].flags == w->flags && out[k].slot == w->slot && out[k].subs == w->subs,
                   "record %u is (%llu, %#llx, %u, %u), the model says (%llu, %#llx, %u, %u)",
                   k, (unsigned long long)out[k].gran, (unsigned long long)out[k].host_off,
                   out[k].flags, out[k].slot, (unsigned long long)w->gran,
                   (unsigned long long)w->host_off, w->flags, w->slot);
        M.log_head = (M.log_head + 1) % M.log_cap;
        M.log_n--;
    }
    aur_ext_stats(M.t, &st);
    FUZZ_CHECK(st.done == M.done && st.failed == M.failed && st.unused == M.unused &&
               st.grown == M.grown && st.log_n == M.log_n && st.allocating == M.allocating,
               "stats differ from the model's");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct in in = { data, size };
    uint8_t cfg = in_u8(&in);
    unsigned steps = 0, h;

    memset(&M, 0, sizeof(M));
    M.shift = 9 + cfg % 8;
    M.gmask = ((uint64_t)1 << M.shift) - 1;
    M.max = 1 + in_u8(&in) % 200;
    M.t = aur_ext_new(M.shift, M.max);
    if (!M.t)
        abort();
    while (in_more(&in) && steps++ < 5000) {
        switch (in_u8(&in) % 15) {
        case 0: case 1: op_insert(&in); break;
        case 2: op_publish(&in); break;
        case 3: case 4: op_acquire(&in); break;
        case 5: op_release(&in); break;
        case 6: op_invalidate(&in); break;
        case 7: op_busy(&in); break;
        case 8: op_alloc(&in); break;
        case 9: op_attach(); break;
        case 10: op_pool_add(&in); break;
        case 11: op_pool_take(&in); break;
        case 12: op_drain(&in); break;
        case 13: op_insert_zip(&in); break;
        case 14: op_insert_sub(&in); break;
        }
    }
    for (h = 0; h < MAXHOLDS; h++)
        if (M.holds[h].used)
            release(&M.holds[h], AUR_EXT_UNUSED);
    FUZZ_CHECK(aur_ext_busy(M.t, 0, UINT64_MAX) == 0, "busy after every release");
    aur_ext_free(M.t);
    return 0;
}
