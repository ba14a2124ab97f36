/*
 * The extent table (aioublk/dataplane/csrc/extents.c) against a model of what its
 * header and comments promise: random sequences of inserts, L2
 * publications, acquires, releases (each outcome settling what a write
 * allocated), invalidations, pools and drains, each result compared with
 * the model's: the pieces a request gets (merged where host-contiguous,
 * zeros as fd -1, an allocating write the taken-th cluster of its pool),
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
    uint64_t done, failed, unused;
} M;

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

static int same(const struct ment *m, int kind, int fd, uint64_t host, int writable)
{
    if (m->kind != kind)
        return 0;
    return kind != AUR_EXT_MAP || (m->fd == fd && m->host == host && m->writable == !!writable);
}

/* ext_insert_locked's promise: all or nothing, -EEXIST, -ENOSPC */
static int model_insert(uint64_t g0, uint64_t n, int kind, int fd, uint64_t host, int writable)
{
    uint64_t k, need = 0;

    if (n > M.max)
        return -ENOSPC;
    for (k = 0; k < n; k++) {
        struct ment *m = M.lmap[g0 + k];

        if (!m)
            need++;
        else if (!same(m, kind, fd, host + (k << M.shift), writable))
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
        m->fd = kind == AUR_EXT_MAP ? fd : -1;
        m->host = kind == AUR_EXT_MAP ? host + (k << M.shift) : 0;
        m->writable = kind == AUR_EXT_MAP && writable;
        M.lmap[g0 + k] = m;
        M.live++;
    }
    return 0;
}

static void op_insert(struct in *in)
{
    static const int kinds[] = { AUR_EXT_MAP, AUR_EXT_ZERO, AUR_EXT_ALLOC, 7 };
    uint8_t b = in_u8(in);
    uint64_t g0 = in_u8(in) % NG, n = in_u8(in) % 9, host = (uint64_t)in_u8(in) << M.shift;
    int kind = kinds[b & 3], fd = b & 4 ? -1 : 3 + (b >> 3 & 1), writable = b >> 4 & 1;
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
    if ((kind != AUR_EXT_ZERO && kind != AUR_EXT_ALLOC && (kind != AUR_EXT_MAP || fd < 0)) ||
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

static int can_alloc(int slot, unsigned taken)
{
    if (slot < 0 || (unsigned)slot >= M.nslots || !M.log_cap)
        return 0;
    return M.pool_n[slot] > taken && M.log_n + M.allocating + taken < M.log_cap;
}

static void op_acquire(struct in *in)
{
    uint8_t b = in_u8(in);
    int write = b & 1, slot = (int)(in_u8(in) % (NSLOTS + 2)) - 1;
    unsigned max_pieces = 1 + in_u8(in) % 8, max_ids = 1 + in_u8(in) % MAXIDS;
    uint64_t g = in_u8(in), sub = in_u16(in) & M.gmask;
    uint32_t len = 1 + in_u32(in) % (8u << M.shift);
    uint64_t off = b & 2 ? UINT64_MAX - in_u16(in) : (g << M.shift) + sub;
    struct aur_ext_piece want[MAXIDS], got[MAXIDS];
    uint32_t ids[MAXIDS], alloc_bit[MAXIDS];
    struct ment *ms[MAXIDS];
    unsigned np = 0, taken = 0, k, n, h;
    uint64_t last, g0, g1, pos;
    int miss = 0, ret;
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
            uint64_t hst, end;
            uint32_t plen;

            alloc_bit[k] = 0;
            if (!m || m->kind == ALLOCATING) {
                miss = 1;
                break;
            }
            if (write && m->kind == AUR_EXT_ALLOC) {
                if (!can_alloc(slot, taken)) {
                    miss = 1;
                    break;
                }
                fd = ALLOC_FD;
                hst = M.pool[slot][(M.pool_head[slot] + taken++) % M.pool_cap] + (pos & M.gmask);
                alloc_bit[k] = AUR_EXT_ID_ALLOC;
            } else if (write && !m->writable) {
                miss = 1;
                break;
            } else {
                fd = m->fd;
                hst = m->kind == AUR_EXT_MAP ? m->host + (pos & M.gmask) : 0;
            }
            ms[k] = m;
            end = (g0 + k) << M.shift | M.gmask;
            if (end > last)
                end = last;
            plen = (uint32_t)(end - pos + 1);
            if (np && want[np - 1].fd == fd &&
                (fd < 0 || want[np - 1].host_off + want[np - 1].len == hst)) {
                want[np - 1].len += plen;
            } else {
                if (np == max_pieces) {
                    miss = 1;
                    break;
                }
                want[np++] = (struct aur_ext_piece){ fd, plen, hst };
            }
            pos = end + 1;
        }
    }
    ret = aur_ext_acquire(M.t, off, len, write, slot, got, max_pieces, ids, max_ids);
    if (miss) {
        FUZZ_CHECK(ret == 0, "acquire %s %#llx+%u: %d pieces, the model says a miss",
                   write ? "write" : "read", (unsigned long long)off, len, ret);
        return;
    }
    FUZZ_CHECK(ret == (int)np, "acquire %s %#llx+%u: %d pieces, the model says %u",
               write ? "write" : "read", (unsigned long long)off, len, ret, np);
    for (k = 0; k < np; k++)
        FUZZ_CHECK(got[k].fd == want[k].fd && got[k].len == want[k].len &&
                   got[k].host_off == want[k].host_off,
                   "acquire: piece %u is (%d, %u, %#llx), the model says (%d, %u, %#llx)", k,
                   got[k].fd, got[k].len, (unsigned long long)got[k].host_off, want[k].fd,
                   want[k].len, (unsigned long long)want[k].host_off);
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
        if (alloc_bit[k]) {
            m->kind = ALLOCATING;
            m->slot = slot;
            m->fd = ALLOC_FD;
            m->host = M.pool[slot][M.pool_head[slot]];
            M.pool_head[slot] = (M.pool_head[slot] + 1) % M.pool_cap;
            M.pool_n[slot]--;
            M.pool_out[slot]++;
            M.allocating++;
        }
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
    };
    M.log_n++;
}

static void release(struct hold *hd, int outcome)
{
    unsigned k, j, want = 0, got;

    got = aur_ext_release(M.t, hd->ids, hd->n, outcome);
    for (k = 0; k < hd->n; k++) {
        struct ment *m;

        j = outcome == AUR_EXT_UNUSED ? hd->n - 1 - k : k;
        m = hd->m[j];
        if (hd->ids[j] & AUR_EXT_ID_ALLOC && m->kind == ALLOCATING) {
            int s = m->slot;

            M.pool_out[s]--;
            M.allocating--;
            if (outcome == AUR_EXT_DONE) {
                m->kind = AUR_EXT_MAP;
                m->writable = 1;
                M.done++;
                want++;
                log_push(m, AUR_EXT_REC_OK);
            } else {
                if (outcome == AUR_EXT_UNUSED) {
                    M.pool_head[s] = (M.pool_head[s] + M.pool_cap - 1) % M.pool_cap;
                    M.pool[s][M.pool_head[s]] = m->host;
                    M.pool_n[s]++;
                    M.unused++;
                } else {
                    log_push(m, AUR_EXT_REC_FAILED);
                    M.failed++;
                }
                m->kind = AUR_EXT_ALLOC;
                m->fd = -1;
                m->host = 0;
            }
        }
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
                   out[k].flags == w->flags && out[k].slot == w->slot,
                   "record %u is (%llu, %#llx, %u, %u), the model says (%llu, %#llx, %u, %u)",
                   k, (unsigned long long)out[k].gran, (unsigned long long)out[k].host_off,
                   out[k].flags, out[k].slot, (unsigned long long)w->gran,
                   (unsigned long long)w->host_off, w->flags, w->slot);
        M.log_head = (M.log_head + 1) % M.log_cap;
        M.log_n--;
    }
    aur_ext_stats(M.t, &st);
    FUZZ_CHECK(st.done == M.done && st.failed == M.failed && st.unused == M.unused &&
               st.log_n == M.log_n && st.allocating == M.allocating,
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
        switch (in_u8(&in) % 13) {
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
        }
    }
    for (h = 0; h < MAXHOLDS; h++)
        if (M.holds[h].used)
            release(&M.holds[h], AUR_EXT_UNUSED);
    FUZZ_CHECK(aur_ext_busy(M.t, 0, UINT64_MAX) == 0, "busy after every release");
    aur_ext_free(M.t);
    return 0;
}
