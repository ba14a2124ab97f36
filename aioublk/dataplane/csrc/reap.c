/*
 * The ring's completions: aur_dp_reap reaps the CQ (the GIL released), hands
 * each of the data plane's own CQEs to its step (a fetch serves the request,
 * a piece's completion may finish it, a commit's answer frees its slot) and
 * copies out only what Python must see; while C alone has work it waits in
 * the kernel a while for more.
 */

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <liburing.h>

#include "dp_internal.h"
#include "plugin.h"

/* A request was fetched: stamp it, when timing. */
static inline void dp_clock_start(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    struct dp_queue *q = &dp->q[local];
    unsigned op;

    if (!dp->timing)
        return;
    op = ublksrv_get_op(&q->descs[tag]);
    q->tags[tag].lat_op = (uint8_t)(op < AUR_LAT_OPS - 1 ? op : AUR_LAT_OPS - 1);
    q->tags[tag].t0 = dp_now_ns();
}

static void dp_fetched(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag)
{
    /* a tag no kernel may hand out: beyond the depth, or one C serves now */
    if (tag >= dp->s.depth || dp->q[local].tags[tag].served) {
        dp->q[local].counts->kernel_bad++;
        return;
    }
    if (!dp->stopping) {  /* (a stopping worker leaves it to the kernel) */
        dp->q[local].counts->started++;
        dp_clock_start(dp, local, tag);
    }
    if (dp_serve(dp, o, local, tag))
        return;
    if (!dp->stopping)
        dp->q[local].counts->py_handed++;
    dp_emit(o, DP_UD(AUR_DP_EV_TAG, local, tag, 0), 0, 0);
}

static void dp_fetch_done(struct aur_dp *dp, struct dp_out *o, struct io_uring_cqe *cqe)
{
    unsigned local = DP_LOCAL(cqe->user_data), i, n;
    struct dp_queue *q = &dp->q[local];

    if (cqe->flags & IORING_CQE_F_BUFFER) {
        unsigned bid = cqe->flags >> 16, max = dp->s.fetch_buf_bytes / 2;
        uint16_t tags[DP_FETCH_MAX];

        n = cqe->res > 0 ? (unsigned)cqe->res / 2 : 0;
        /* (what no kernel sends: a buffer not in the ring, more than it
           holds) the rest, or nothing, is taken, the buffer given back */
        if (bid >= dp->s.fetch_buf_entries || n > max) {
            q->counts->kernel_bad++;
            n = bid >= dp->s.fetch_buf_entries ? 0 : max;
        }
        if (bid < dp->s.fetch_buf_entries) {
            memcpy(tags, q->tags_mem + (size_t)bid * dp->s.fetch_buf_bytes, n * 2);
            dp_give_back(dp, q, bid, 0);
            io_uring_buf_ring_advance(q->br, 1);
        }
        for (i = 0; i < n; i++)
            dp_fetched(dp, o, local, tags[i]);
    }
    if (!(cqe->flags & IORING_CQE_F_MORE))
        dp_emit(o, cqe->user_data, cqe->res, cqe->flags & ~IORING_CQE_F_BUFFER);
}

static void dp_commit_done(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res)
{
    unsigned local = DP_LOCAL(ud), done;
    uint16_t slot = DP_TAG(ud), tag;
    struct dp_queue *q = &dp->q[local];
    struct dp_commit *c = q->commits[slot];
    struct ublk_elem_header h;
    int32_t result;

    done = res >= 0 ? (unsigned)res / dp->elem_bytes : 0;
    if (done < c->nr && res != -ENODEV) {  /* (ENODEV: the device is gone) */
        memcpy(&h, c->elems + (size_t)done * dp->elem_bytes, sizeof(h));
        tag = h.tag;
        result = h.result;
        /* the refused element: a request still waiting is failed, once */
        dp_emit(o, DP_UD(AUR_DP_EV_COMMIT, local, tag, result >= 0 ? 0 : 1),
                res < 0 ? res : 0, (uint32_t)result);
        if (result >= 0) {
            q->counts->ios--;  /* counted again as the failure */
            if (result > 0)
                q->counts->bytes -= (uint64_t)result;
            dp_commit(dp, local, tag, -EIO);
        }
        done++;
    } else if (done < c->nr) {
        done = c->nr;
    }
    if (done < c->nr) {  /* the rest goes again, from the same slot */
        memmove(c->elems, c->elems + (size_t)done * dp->elem_bytes,
                (size_t)(c->nr - done) * dp->elem_bytes);
        c->nr -= done;
        dp_send_commit(dp, local, c, slot);
        return;
    }
    if (c->cap > DP_COMMIT_KEEP) {
        free(c);
        q->commits[slot] = NULL;
    }
    q->free_slots[q->nr_free++] = slot;
}

/* The poll on the loop's epoll fd completed: the loop has work (uvhook.c). */
static void dp_loop_ready(struct aur_dp *dp)
{
    if (dp->hook) {
        dp->loop_armed = 0;
        dp->loop_ready = 1;
    }
}

static void dp_cqe(struct aur_dp *dp, struct dp_out *o, struct io_uring_cqe *cqe)
{
    uint64_t ud = cqe->user_data;

    if (!(ud & DP_BIT)) {
        dp_emit(o, ud, cqe->res, cqe->flags);
        return;
    }
    switch (DP_KIND(ud)) {
    case DP_K_RW:
    case DP_K_REG:
    case DP_K_UC:
    case DP_K_ZIP:
    case DP_K_ZCOPY:
    case DP_K_MERGE:
        dp_rw_done(dp, o, ud, cqe->res);
        return;
    case AUR_DP_EV_IO:
        if (cqe->res == UBLK_IO_RES_NEED_GET_DATA) {
            /* -g: a write's data is not in the buffer yet; the kernel copies
               it on this command, whose completion (res 0) is the request */
            int err = dp_io_cmd(dp, DP_LOCAL(ud), DP_TAG(ud), dp->s.op_need_get_data, 0);

            if (err < 0)
                dp_emit(o, ud, err, cqe->flags);
            return;
        }
        if (cqe->res == 0 && !dp->stopping) {
            dp->q[DP_LOCAL(ud)].counts->started++;
            dp_clock_start(dp, DP_LOCAL(ud), DP_TAG(ud));
            if (dp_serve(dp, o, DP_LOCAL(ud), DP_TAG(ud)))
                return;
            dp->q[DP_LOCAL(ud)].counts->py_handed++;
        }
        dp_emit(o, ud, cqe->res, cqe->flags);
        return;
    case AUR_DP_EV_FETCH:
        dp_fetch_done(dp, o, cqe);
        return;
    case DP_K_COMMIT:
        dp_commit_done(dp, o, ud, cqe->res);
        return;
    case DP_K_LOOP:
        dp_loop_ready(dp);
        return;
    case DP_K_EXT:
        dp_ext_cqe(dp, o, ud, cqe->res);
        return;
    }
    dp_emit(o, ud, cqe->res, cqe->flags);
}

/* One pass: reap what the CQ holds, serve, commit, and (submit) submit; a
   few rounds while C alone has work. Without submit the caller's wait
   submits: one io_uring_enter for both. */
DP_HIDDEN void dp_pass(struct aur_dp *dp, struct dp_out *o, unsigned max, int *full, int submit)
{
    struct io_uring *ring = &dp->r->ring;
    struct io_uring_cqe *cqe;
    unsigned head, seen, rounds;

    for (rounds = 0; rounds < 8 && !*full; rounds++) {
        seen = 0;
        io_uring_for_each_cqe(ring, head, cqe) {
            if (max - o->n < dp->room) {
                *full = 1;
                break;
            }
            dp_cqe(dp, o, cqe);
            seen++;
        }
        io_uring_cq_advance(ring, seen);
        /* what C moved itself, as those CQEs (handling one may add more) */
        while (dp->nr_done && !*full) {
            if (max - o->n < dp->room) {
                *full = 1;
                break;
            }
            dp->nr_done--;
            dp_rw_done(dp, o, dp->done[dp->nr_done].ud, dp->done[dp->nr_done].res);
            seen++;
        }
        if (!*full && io_uring_cq_has_overflow(ring)) {
            io_uring_get_events(ring);
            continue;
        }
        aur_dp_flush(dp);
        if (submit && io_uring_sq_ready(ring))
            io_uring_submit(ring);
        if (!seen || o->n)
            break;
    }
}

/*
 * Back to Python as soon as it has work. While C alone has work and has
 * served something in this call, it waits in the kernel (the GIL released, the
 * thread asleep) up to poll_us for the next completion instead of going back
 * through the loop's epoll and a Python callback: at queue depth 1 that
 * round trip is most of a request's time. Python gets its loop back after
 * poll_us without traffic, and at least every POLL_BUDGET_NS. Meanwhile the
 * eventfd is muted (a flag in the shared CQ ring, no syscall).
 *
 * With idle_us (a target whose every reason to run Python arrives as a CQE
 * on this ring: its own I/O, ublk commands, the worker's kick), C waits
 * idle_us instead, and the budget is at least that: a kick's CQE ends the
 * wait like any record. What does not come as a CQE (a loop timer) waits at
 * most the budget.
 *
 * Whatever stays in the CQ signals the eventfd again: no completion waits
 * for a wake-up that already happened.
 */
#define POLL_BUDGET_NS 4000000ULL

/* Signal the ring's eventfd when the loop has something to take from C:
   no completion waits for a wake-up that already happened. */
DP_HIDDEN void dp_wake_loop(struct aur_dp *dp)
{
    struct io_uring *ring = &dp->r->ring;

    if (dp->nr_kept || io_uring_cq_ready(ring) || io_uring_cq_has_overflow(ring) ||
        dp_waiting(dp) || dp->nr_done) {
        uint64_t one = 1;

        if (write(dp->r->efd, &one, sizeof(one)) < 0) {
            /* the count is full: a wake-up is pending anyway */
        }
    }
}

unsigned aur_dp_reap(struct aur_dp *dp, void *out, unsigned max)
{
    struct io_uring *ring = &dp->r->ring;
    struct dp_out o = { out, 0 };
    struct io_uring_cqe *cqe;
    /* (C waits in the loop's hook when it owns the wait, never here) */
    uint64_t start = 0, wait_ns = dp->hook ? 0 :
        1000ULL * (dp->s.idle_us ? dp->s.idle_us : dp->s.poll_us);
    uint64_t budget = wait_ns > POLL_BUDGET_NS ? wait_ns : POLL_BUDGET_NS, spent = 0;
    unsigned served = dp->served, completed = dp->completed;
    int full = 0, quiet = 0;

    if (dp->nr_kept) {  /* what C's wait kept for Python comes first */
        unsigned n = dp->nr_kept < max ? dp->nr_kept : max;

        memcpy(out, dp->kept, 16 * (size_t)n);
        memmove(dp->kept, dp->kept + 16 * (size_t)n, 16 * (size_t)(dp->nr_kept - n));
        dp->nr_kept -= n;
        o.n = n;
        if (dp->nr_kept || max - o.n < dp->room) {
            dp_wake_loop(dp);
            return o.n;
        }
    }
    for (;;) {
        dp_pass(dp, &o, max, &full, 1);
        if (o.n || full || !wait_ns || dp->served == served)
            break;
        if (!start) {
            start = dp_now_ns();
            /* while C waits, the loop's eventfd need not hear of each CQE */
            quiet = io_uring_cq_eventfd_toggle(ring, false) == 0;
        } else if ((spent = dp_now_ns() - start) > budget) {
            break;
        }
        {
            /* (never past the budget: a loop timer waits at most that) */
            uint64_t ns = wait_ns < budget - spent ? wait_ns : budget - spent;
            struct __kernel_timespec ts = { (long long)(ns / 1000000000ULL),
                                            (long long)(ns % 1000000000ULL) };

            int ret = io_uring_wait_cqe_timeout(ring, &cqe, &ts);

            if (ret < 0) {
                if (ret == -ETIME)
                    dp->q[0].counts->poll_timeouts++;
                break;
            }
        }
    }
    if (dp->served != served || dp->completed != completed)
        dp->q[0].counts->wakes++;
    if (quiet)
        io_uring_cq_eventfd_toggle(ring, true);
    dp_wake_loop(dp);
    return o.n;
}
