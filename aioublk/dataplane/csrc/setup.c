/*
 * A data plane made, given its queues and a map, and freed (the map's
 * meaning is in dataplane.h; serve.c resolves requests against it).
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <liburing.h>

#include "dp_internal.h"

void aur_dp_free(struct aur_dp *dp)
{
    unsigned i, j;

    if (!dp)
        return;
    for (i = 0; i < dp->s.nr_queues; i++) {
        struct dp_queue *q = &dp->q[i];

        if (q->tags) {
            for (j = 0; j < dp->s.depth; j++) {
                free(q->tags[j].ids);
                free(q->tags[j].pieces);
                free(q->tags[j].bounce);
                free(q->tags[j].zips);
                free(q->tags[j].zbuf);
            }
            free(q->tags);
        }
        if (q->commits) {
            for (j = 0; j < dp->s.depth; j++)
                free(q->commits[j]);
            free(q->commits);
        }
        free(q->free_slots);
        free(q->held);
        free(q->elems);
        if (q->br && !q->withdrawn)
            continue;  /* the kernel may still pick one: kept for good */
        free(q->br);
        free(q->tags_mem);
    }
    free(dp->done);
    free(dp->kept);
    free(dp->ext_map);
    dp_inflater_free(dp);
    free(dp);
}

struct aur_dp *aur_dp_new(struct aur *r, const struct aur_dp_setup *s, int *err)
{
    struct aur_dp *dp;
    unsigned i, j;

    *err = -EINVAL;
    if ((s->max_io >> 9) > AUR_DP_MAX_SECTORS ||
        (s->batch && s->fetch_buf_bytes / 2 > DP_FETCH_MAX))
        return NULL;
    *err = -ENOMEM;
    dp = calloc(1, sizeof(*dp) + s->nr_queues * sizeof(struct dp_queue));
    if (!dp)
        return NULL;
    dp->r = r;
    dp->s = *s;
    dp->elem_bytes = sizeof(struct ublk_elem_header) + (s->mode == AUR_DP_COPY ? 8 : 0) +
        (s->zoned ? 8 : 0);
    dp->batch_flags = (s->mode == AUR_DP_COPY ? UBLK_BATCH_F_HAS_BUF_ADDR : 0) |
        (s->zoned ? UBLK_BATCH_F_HAS_ZONE_LBA : 0) |
        (s->mode == AUR_DP_AUTO_ZC && s->auto_zc_fallback ?
         UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK : 0);
    /* the most records one CQE can produce: a fetch's tags, and itself */
    dp->room = (s->batch ? s->fetch_buf_bytes / 2 : 0) + 2;
    dp->out_cap = 4 * dp->room > 256 ? 4 * dp->room : 256;
    {
        unsigned cq = r->ring.cq.ring_entries, fixed = s->nr_queues * (s->depth + 2);

        dp->max_cqes = cq > fixed ? cq - fixed : 0;
    }
    if (s->inline_io && !(dp->done = malloc((dp->max_cqes + 1) * sizeof(*dp->done))))
        goto fail;
    for (i = 0; i < s->nr_queues; i++) {
        struct dp_queue *q = &dp->q[i];

        q->tags = calloc(s->depth, sizeof(*q->tags));
        q->held = malloc(s->depth * sizeof(uint16_t));
        if (!q->tags || !q->held)
            goto fail;
        for (j = 0; j < s->depth; j++) {
            q->tags[j].ids = malloc(DP_MAX_PIECES * sizeof(uint32_t));
            if (!q->tags[j].ids)
                goto fail;
            if (s->mode == AUR_DP_USER_COPY &&
                !(q->tags[j].pieces = malloc(DP_MAX_PIECES * sizeof(struct dp_piece))))
                goto fail;
        }
        if (!s->batch)
            continue;
        q->elems = malloc((size_t)s->depth * dp->elem_bytes);
        q->commits = calloc(s->depth, sizeof(*q->commits));
        q->free_slots = malloc(s->depth * sizeof(uint16_t));
        if (!q->elems || !q->commits || !q->free_slots)
            goto fail;
        for (j = 0; j < s->depth; j++)
            q->free_slots[j] = (uint16_t)(s->depth - 1 - j);
        q->nr_free = s->depth;
    }
    aur_fix_file(r, s->char_fd);  /* every ublk command goes through the table */
    *err = 0;
    return dp;
fail:
    aur_dp_free(dp);
    return NULL;
}

void aur_dp_queue(struct aur_dp *dp, unsigned local, uint16_t q_id, const void *descs,
                  void *bufs, struct aur_dp_counts *counts)
{
    dp->q[local].q_id = q_id;
    dp->q[local].descs = descs;
    dp->q[local].bufs = bufs;
    dp->q[local].counts = counts;
}

void aur_dp_buf_index(struct aur_dp *dp, unsigned local, uint16_t tag, uint16_t index)
{
    dp_tag(dp, local, tag)->buf_index = index;
}

/*
 * Before the ring's exit: take the fetch buffers back from the kernel. A
 * multishot fetch still armed picks one and writes tags into it whenever a
 * request comes, and the ring's teardown ends only some time after its exit
 * returns. Once the group is unregistered nothing picks them, so
 * aur_dp_free may free them; a group that could not be is kept for the
 * life of the process. Returns how many were kept.
 */
unsigned aur_dp_withdraw(struct aur_dp *dp)
{
    unsigned i, kept = 0;

    for (i = 0; i < dp->s.nr_queues; i++) {
        struct dp_queue *q = &dp->q[i];

        if (!q->br || q->withdrawn)
            continue;
        if (io_uring_unregister_buf_ring(&dp->r->ring, (int)i) == 0)
            q->withdrawn = 1;
        else
            kept++;
    }
    return kept;
}

unsigned aur_dp_room(struct aur_dp *dp) { return dp->room; }
unsigned aur_dp_out_cap(struct aur_dp *dp) { return dp->out_cap; }
unsigned aur_dp_inflight(struct aur_dp *dp) { return dp->inflight; }
void aur_dp_set_stopping(struct aur_dp *dp, int stopping) { dp->stopping = stopping; }
void aur_dp_set_sealed(struct aur_dp *dp, int sealed) { dp->sealed = sealed; }

void aur_dp_set_timing(struct aur_dp *dp, int on) { dp->timing = on; }

/* A new map: only /dev/ublkcN stays in the ring's file table, the map's
   own fds join it (an extent table's as C meets them). */
DP_HIDDEN void dp_new_map(struct aur_dp *dp, const int *fds, unsigned n)
{
    unsigned i;

    aur_unfix_files(dp->r, dp->s.char_fd);
    for (i = 0; i < n; i++)
        aur_fix_file(dp->r, fds[i]);
    dp_zcache_clear(dp);  /* (what it kept was the old map's) */
}

int aur_dp_map_null(struct aur_dp *dp)
{
    dp_new_map(dp, NULL, 0);
    dp->map = AUR_MAP_NULL;
    return 0;
}

int aur_dp_map_linear(struct aur_dp *dp, int fd, uint64_t base)
{
    dp_new_map(dp, &fd, 1);
    dp->fds[0] = fd;
    dp->nr_fds = 1;
    dp->base = base;
    dp->map = AUR_MAP_LINEAR;
    return 0;
}

int aur_dp_map_striped(struct aur_dp *dp, const int *fds, unsigned n, uint64_t chunk)
{
    if (!n || n > DP_MAX_PIECES || !chunk || (chunk & (chunk - 1)) || chunk % 512)
        return -EINVAL;
    dp_new_map(dp, fds, n);
    memcpy(dp->fds, fds, n * sizeof(int));
    dp->nr_fds = n;
    dp->chunk = chunk;
    dp->map = AUR_MAP_STRIPED;
    return 0;
}

int aur_dp_map_extents(struct aur_dp *dp, struct aur_ext *t, unsigned granule_shift, int slot)
{
    if (slot >= AUR_EXT_SLOTS)
        return -EINVAL;
    dp_new_map(dp, NULL, 0);
    dp->ext = t;
    dp->ext_shift = granule_shift;
    dp->ext_slot = slot < 0 ? -1 : slot;
    dp->hold_writes = aur_ext_holds_writes(t);
    dp->map = AUR_MAP_EXTENTS;
    return 0;
}

int aur_dp_map_nvme(struct aur_dp *dp, int fd, uint32_t nsid, unsigned lba_shift,
                    unsigned flags)
{
    if (dp->r->sqe_size < 128 || lba_shift < 9 || lba_shift > 16)
        return -EINVAL;
    dp_new_map(dp, &fd, 1);
    dp->fds[0] = fd;
    dp->nr_fds = 1;
    dp->nsid = nsid;
    dp->lba_shift = lba_shift;
    dp->nvme_flags = flags;
    dp->map = AUR_MAP_NVME;
    return 0;
}
