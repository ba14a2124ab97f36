/*
 * The data plane's commands to the kernel: FETCH_REQ and COMMIT_AND_FETCH_REQ
 * (per-I/O), the batch's fetch buffers, FETCH_IO_CMDS, PREP_IO_CMDS and
 * COMMIT_IO_CMDS with its elements, and an answer counted and timed on its
 * way out. One the SQ cannot take is held and sent by the next flush, never
 * dropped.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <liburing.h>

#include "dp_internal.h"
#include "plugin.h"

/* A timed request's answer: into the op's log2 bucket (once: a refused commit
   answers again). The clock started at its fetch (reap.c). */
static void dp_clock_stop(struct aur_dp_counts *c, struct dp_tag *t)
{
    uint64_t ns = dp_now_ns() - t->t0, units = ns >> 10;
    unsigned b = units ? 64 - (unsigned)__builtin_clzll(units) : 0;

    t->t0 = 0;
    if (b >= AUR_LAT_BUCKETS)
        b = AUR_LAT_BUCKETS - 1;
    c->lat[t->lat_op][b]++;
    c->lat_ns[t->lat_op] += ns;
}

/* the buffer address the kernel copies to and from (copy mode only) */
static uint64_t dp_io_addr(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    if (dp->s.mode != AUR_DP_COPY || !dp->q[local].bufs)
        return 0;
    return (uint64_t)(uintptr_t)dp_buf(dp, local, tag);
}

DP_HIDDEN int dp_io_cmd(struct aur_dp *dp, unsigned local, uint16_t tag, uint32_t op,
                        int32_t res)
{
    uint64_t sqe_addr = 0;
    struct dp_tag *t = dp_tag(dp, local, tag);

    if (dp->s.mode == AUR_DP_AUTO_ZC) {
        struct ublk_auto_buf_reg reg = {
            .index = t->buf_index,
            .flags = dp->s.auto_zc_fallback ? UBLK_AUTO_BUF_REG_FALLBACK : 0,
        };

        sqe_addr = ublk_auto_buf_reg_to_sqe_addr(&reg);
    }
    /* a zone append's sector goes where a fetch's buffer address would
       (the union's zone_append_lba; zoned devices have no buffer address) */
    return aur_prep_ublk_io(dp->r, dp->s.char_fd, op, dp->q[local].q_id, tag, res,
                            t->has_lba ? t->zone_lba : dp_io_addr(dp, local, tag), sqe_addr, 0,
                            DP_UD(AUR_DP_EV_IO, local, tag, 0));
}

int aur_dp_fetch_req(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    return dp_io_cmd(dp, local, tag, dp->s.op_fetch_req, 0);
}

int aur_dp_fetch_io_cmds(struct aur_dp *dp, unsigned local)
{
    /* the buffer the kernel picks is filled with tags, 2 bytes each */
    struct ublk_batch_io cmd = { .q_id = dp->q[local].q_id,
                                 .nr_elem = (uint16_t)(dp->s.fetch_buf_bytes / 2),
                                 .elem_bytes = 2 };

    return aur_prep_cmd(dp->r, dp->s.char_fd, dp->s.op_fetch_io_cmds, &cmd, sizeof(cmd),
                        0, 0, IORING_URING_CMD_MULTISHOT, (uint16_t)local,
                        IOSQE_BUFFER_SELECT, DP_UD(AUR_DP_EV_FETCH, local, 0, 0));
}

int aur_dp_provide(struct aur_dp *dp, unsigned local)
{
    struct dp_queue *q = &dp->q[local];
    unsigned i;
    int err;

    if (posix_memalign((void **)&q->tags_mem, 4096,
                       (size_t)dp->s.fetch_buf_entries * dp->s.fetch_buf_bytes))
        return -ENOMEM;
    q->br = aur_buf_ring_setup(dp->r, dp->s.fetch_buf_entries, (int)local, &err);
    if (!q->br)
        return err;
    for (i = 0; i < dp->s.fetch_buf_entries; i++)
        dp_give_back(dp, q, i, (int)i);
    io_uring_buf_ring_advance(q->br, dp->s.fetch_buf_entries);
    return 0;
}

/* The command area of PREP or COMMIT_IO_CMDS with nr elements of queue `local`. */
static struct ublk_batch_io dp_batch_cmd(struct aur_dp *dp, unsigned local, unsigned nr)
{
    struct ublk_batch_io cmd = { .q_id = dp->q[local].q_id, .flags = (uint16_t)dp->batch_flags,
                                 .nr_elem = (uint16_t)nr, .elem_bytes = (uint8_t)dp->elem_bytes };

    return cmd;
}

/* A COMMIT_IO_CMDS from its slot. One the SQ cannot take is held and sent
   by the next flush: its requests wait for it, it is never dropped. */
DP_HIDDEN void dp_send_commit(struct aur_dp *dp, unsigned local, struct dp_commit *c,
                              uint16_t slot)
{
    struct dp_queue *q = &dp->q[local];
    struct ublk_batch_io cmd = dp_batch_cmd(dp, local, c->nr);

    q->commits[slot] = c;
    if (aur_prep_cmd(dp->r, dp->s.char_fd, dp->s.op_commit_io_cmds, &cmd, sizeof(cmd),
                     (uint64_t)(uintptr_t)c->elems, c->nr * dp->elem_bytes, 0, 0, 0,
                     DP_UD(DP_K_COMMIT, local, slot, 0)) < 0)
        q->held[q->nr_held++] = slot;
}

/* Per-I/O: a request's COMMIT_AND_FETCH; one the SQ cannot take is held
   (with its zone append's sector) and sent by the next flush. */
static void dp_answer_io(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    struct dp_queue *q = &dp->q[local];

    if (dp_io_cmd(dp, local, tag, dp->s.op_commit_and_fetch, res) < 0) {
        t->held_res = res;
        q->held[q->nr_held++] = tag;
        return;
    }
    t->has_lba = 0;
    t->zone_lba = 0;
}

/* What earlier flushes could not queue, again (in order; what still does
   not fit is held again). */
static void dp_send_held(struct aur_dp *dp, unsigned local)
{
    struct dp_queue *q = &dp->q[local];
    unsigned n = q->nr_held, i;
    uint16_t id;

    q->nr_held = 0;  /* (each one held again lands at or before the one read) */
    for (i = 0; i < n; i++) {
        id = q->held[i];
        if (dp->s.batch) {
            dp_send_commit(dp, local, q->commits[id], id);
        } else {
            dp_answer_io(dp, local, id, dp_tag(dp, local, id)->held_res);
        }
    }
}

static int dp_flush_queue(struct aur_dp *dp, unsigned local)
{
    struct dp_queue *q = &dp->q[local];
    struct dp_commit *c;
    size_t bytes = (size_t)q->nr_elems * dp->elem_bytes;
    uint16_t slot;

    if (!q->nr_elems)
        return 0;
    if (!q->nr_free)
        return -EBUSY;  /* cannot happen: each commit in flight holds a tag */
    slot = q->free_slots[q->nr_free - 1];
    c = q->commits[slot];
    if (!c || c->cap < bytes) {
        /* room for a whole queue's answers, up to what is kept */
        size_t cap = (size_t)dp->s.depth * dp->elem_bytes;

        if (cap > DP_COMMIT_KEEP)
            cap = DP_COMMIT_KEEP;
        if (cap < bytes)
            cap = bytes;
        free(c);
        q->commits[slot] = NULL;
        if (!(c = malloc(sizeof(*c) + cap)))
            return -ENOMEM;
        c->cap = (unsigned)cap;
    }
    q->nr_free--;
    c->nr = q->nr_elems;
    memcpy(c->elems, q->elems, bytes);
    q->nr_elems = 0;
    dp_send_commit(dp, local, c, slot);
    return 0;
}

int aur_dp_flush(struct aur_dp *dp)
{
    unsigned i;
    int ret, first = 0;

    dp_ext_flush(dp);
    for (i = 0; i < dp->s.nr_queues; i++) {
        dp_send_held(dp, i);
        if (!dp->s.batch)
            continue;
        ret = dp_flush_queue(dp, i);
        if (ret < 0 && !first)
            first = ret;
    }
    return first;
}

/* One element of PREP or COMMIT_IO_CMDS at e (elem_bytes): the header, then
   the fields the batch flags ask for. The one place the layout is written. */
static void dp_put_elem(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res,
                        uint64_t zone_lba, char *e)
{
    struct ublk_elem_header h = {
        .tag = tag,
        .buf_index = dp->s.mode == AUR_DP_AUTO_ZC ? dp_tag(dp, local, tag)->buf_index : 0,
        .result = res,
    };
    uint64_t addr;

    memcpy(e, &h, sizeof(h));
    e += sizeof(h);
    if (dp->batch_flags & UBLK_BATCH_F_HAS_BUF_ADDR) {
        addr = dp_io_addr(dp, local, tag);
        memcpy(e, &addr, 8);
        e += 8;
    }
    if (dp->batch_flags & UBLK_BATCH_F_HAS_ZONE_LBA)
        memcpy(e, &zone_lba, 8);
}

static void dp_add_elem(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res)
{
    struct dp_queue *q = &dp->q[local];

    if (q->nr_elems == dp->s.depth) {  /* (a kernel that handed a tag out twice) */
        q->counts->kernel_bad++;
        return;
    }

    dp_put_elem(dp, local, tag, res, q->tags[tag].zone_lba,
                q->elems + (size_t)q->nr_elems * dp->elem_bytes);
    q->nr_elems++;
}

/* cmd: the SQE's 16-byte command area (struct ublk_batch_io) */
_Static_assert(sizeof(struct ublk_batch_io) == 16, "ublk_batch_io is 16 bytes");

int aur_dp_prep_io_cmds(struct aur_dp *dp, unsigned local, void *cmd, void *out,
                        unsigned max)
{
    struct ublk_batch_io c = dp_batch_cmd(dp, local, dp->s.depth);
    unsigned bytes = dp->s.depth * dp->elem_bytes;
    uint16_t tag;

    if (!dp->s.batch)
        return -EINVAL;
    if (bytes > max)
        return -ENOSPC;
    for (tag = 0; tag < dp->s.depth; tag++)
        dp_put_elem(dp, local, tag, 0, 0, (char *)out + (size_t)tag * dp->elem_bytes);
    memcpy(cmd, &c, sizeof(c));
    return (int)bytes;
}

/* An answer for the kernel: counted, then committed (or held until the SQ
   takes it: never dropped). */
DP_HIDDEN int dp_commit(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res)
{
    struct aur_dp_counts *c = dp->q[local].counts;

    if (dp->q[local].tags[tag].t0)
        dp_clock_stop(c, &dp->q[local].tags[tag]);
    c->ios++;
    if (res > 0)
        c->bytes += (uint64_t)res;
    else if (res < 0)
        c->errors++;
    if (dp->s.batch) {
        dp_add_elem(dp, local, tag, res);
        dp->q[local].tags[tag].has_lba = 0;
        dp->q[local].tags[tag].zone_lba = 0;
    } else {
        dp_answer_io(dp, local, tag, res);
    }
    return 0;
}

void aur_dp_zone_lba(struct aur_dp *dp, unsigned local, uint16_t tag, uint64_t lba)
{
    dp->q[local].tags[tag].has_lba = 1;
    dp->q[local].tags[tag].zone_lba = lba;
}

int aur_dp_answer(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res)
{
    return dp_commit(dp, local, tag, res);
}

unsigned aur_dp_pending(struct aur_dp *dp, unsigned local, void *out, unsigned max)
{
    struct dp_queue *q = &dp->q[local];
    unsigned bytes = q->nr_elems * dp->elem_bytes;

    if (!dp->s.batch)
        return 0;
    if (bytes > max)
        bytes = max;
    memcpy(out, q->elems, bytes);
    return bytes;
}
