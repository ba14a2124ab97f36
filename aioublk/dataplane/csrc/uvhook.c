/*
 * C owns the wait: the worker's libuv loop hooked (a prepare handle), so that
 * its thread sleeps in the ring instead of in epoll.
 *
 * Where a worker's thread sleeps. Left to itself the worker's loop (uvloop,
 * so libuv) sleeps in epoll_wait, and a request wakes it through the ring's
 * eventfd: an epoll return, an eventfd read and a Python callback before C
 * sees the request. Here C sleeps instead, in the one io_uring_enter that
 * also submits, for as long as the loop itself would have slept, and only
 * then:
 *
 * - a prepare handle on the loop runs this just before libuv would poll,
 *   after the loop ran every callback that was ready;
 * - uv_backend_timeout is how long libuv would sleep: 0 while Python has
 *   work (callbacks ready, pending or closing handles, a stop), else until
 *   the next timer, or forever (-1);
 * - everything else that would wake the loop (any fd it watches, the wake-up
 *   of call_soon_threadsafe, signals) is ready in libuv's epoll set, so a
 *   poll on the epoll fd itself, through the ring, ends C's wait: its CQE
 *   is a request like the others;
 * - what C's wait finds for Python it keeps (dp->kept), signals the ring's
 *   eventfd and returns: libuv's poll finds it at once and the reader takes
 *   the records first.
 *
 * libuv applies the changes to what it watches only in its poll, after
 * prepare: while some are queued (watcher_queue), C does not wait, and the
 * loop sleeps in epoll this once, woken by the eventfd as before.
 *
 * The loop is reached through the uv_loop_t uvloop made and the libuv its
 * extension exports, both handed over by Python (struct aur_uv); the two
 * private fields read here (backend_fd, the watcher queue) are checked
 * against what libuv answers before the hook is installed, and a loop that
 * does not match keeps waiting the old way (aur_dp_reap's poll).
 */

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <liburing.h>

#include "dp_internal.h"

#define DP_UV_PREPARE 9            /* UV_PREPARE in uv_handle_type */
/* uv_loop_t (libuv 1.x, 64-bit): where backend_fd and the watcher queue sit */
#define DP_UVL_BACKEND_FD 64
#define DP_UVL_PENDING 72
#define DP_UVL_WATCHERS 88

struct dp_uvq { struct dp_uvq *next, *prev; };

typedef void dp_uv_cb(void *handle);
/* libuv's functions C calls (struct aur_uv's addresses, typed) */
struct dp_uv {
    void *loop;
    size_t (*handle_size)(int type);
    int (*prepare_init)(void *loop, void *prepare);
    int (*prepare_start)(void *prepare, dp_uv_cb *cb);
    int (*prepare_stop)(void *prepare);
    void (*close)(void *handle, dp_uv_cb *cb);
    int (*backend_fd)(const void *loop);
    int (*backend_timeout)(const void *loop);
    void (*update_time)(void *loop);
};

struct dp_hook {
    struct aur_dp *dp;
    struct dp_uv uv;
    int epfd;
    /* the uv_prepare_t (uv.handle_size of it), 16-byte aligned */
    char handle[] __attribute__((aligned(16)));
};

static const struct dp_uvq *dp_uvq(const void *loop, size_t off)
{
    return (const struct dp_uvq *)((const char *)loop + off);
}

static int dp_uvq_sane(const struct dp_uvq *q)
{
    return q->next && q->prev && q->next->prev == q && q->prev->next == q;
}

/* The SQEs the next io_uring_enter submits whose CQEs it posts before it
   waits: COMMIT_IO_CMDS completes in its issue. The wait asks for one CQE
   beyond them, or a commit's own CQE would end it at once and each request
   at QD1 would cost a second io_uring_enter (kublk -b pays it). Counting one
   that is not submitted would sleep through a real CQE, so this reads the
   SQ itself; one that completes later still comes, and ends no wait early. */
static unsigned dp_inline_cqes(struct aur_dp *dp)
{
    struct io_uring *ring = &dp->r->ring;
    unsigned shift = (ring->flags & IORING_SETUP_SQE128) ? 1 : 0, i, n = 0;
    const struct io_uring_sqe *sqe;

    if (!dp->s.batch)
        return 0;
    for (i = io_uring_smp_load_acquire(ring->sq.khead); i != ring->sq.sqe_tail; i++) {
        sqe = &ring->sq.sqes[(i & ring->sq.ring_mask) << shift];
        if (sqe->opcode == IORING_OP_URING_CMD && sqe->cmd_op == dp->s.op_commit_io_cmds)
            n++;
    }
    return n;
}

/* Serve and wait until Python has work or ms pass (-1: no timer is due). */
static void dp_own_wait(struct aur_dp *dp, int ms)
{
    struct dp_hook *h = dp->hook;
    struct io_uring *ring = &dp->r->ring;
    struct dp_out o = { dp->kept, 0 };
    struct io_uring_cqe *cqe;
    uint64_t deadline = ms < 0 ? 0 : dp_now_ns() + 1000000ULL * (uint64_t)ms;
    unsigned served = dp->served, completed = dp->completed;
    uint64_t count;
    unsigned want;
    int full = 0, quiet, ret;

    /* C takes the CQ from here: a signal of the ring's eventfd still unread
       (a CQE that came while Python ran) would end the poll on the loop's
       epoll at once, and every batch would go round through Python. What
       Python must see, C signals again when it returns (dp_wake_loop). */
    if (read(dp->r->efd, &count, sizeof(count)) < 0) {
        /* EAGAIN: nothing was signalled */
    }
    if (!dp->loop_armed) {
        if (aur_prep(dp->r, IORING_OP_POLL_ADD, h->epfd, 0, 0, 0, POLLIN, 0, 0,
                     DP_UD(DP_K_LOOP, 0, 0, 0)) < 0) {
            /* no SQE: the loop sleeps in epoll this time, and the signal
               read above must not be lost with it */
            dp_wake_loop(dp);
            return;
        }
        dp->loop_armed = 1;
    }
    dp->loop_ready = 0;
    quiet = io_uring_cq_eventfd_toggle(ring, false) == 0;
    for (;;) {
        dp_pass(dp, &o, dp->out_cap, &full, 0);
        if (o.n || full || dp->loop_ready || dp->nr_done)
            break;
        if (dp_waiting(dp)) {  /* answers the SQ could not take: submit, go again */
            io_uring_submit(ring);
            continue;
        }
        want = 1 + dp_inline_cqes(dp);
        if (deadline) {
            uint64_t now = dp_now_ns(), ns;
            struct __kernel_timespec ts;

            if (now >= deadline)
                break;
            ns = deadline - now;
            ts.tv_sec = (long long)(ns / 1000000000ULL);
            ts.tv_nsec = (long long)(ns % 1000000000ULL);
            ret = io_uring_submit_and_wait_timeout(ring, &cqe, want, &ts, NULL);
        } else {
            ret = io_uring_submit_and_wait_timeout(ring, &cqe, want, NULL, NULL);
        }
        if (ret == -ETIME)
            break;  /* a timer is due */
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY)
            break;  /* (the loop's reader sees what is wrong) */
    }
    if (io_uring_sq_ready(ring))
        io_uring_submit(ring);
    if (quiet)
        io_uring_cq_eventfd_toggle(ring, true);
    dp->nr_kept = o.n;
    if (dp->served != served || dp->completed != completed)
        dp->q[0].counts->wakes++;
    dp_wake_loop(dp);
}

static void dp_hook_prepare(void *handle)
{
    struct dp_hook *h = (struct dp_hook *)((char *)handle - offsetof(struct dp_hook, handle));
    struct aur_dp *dp = h->dp;
    int ms;

    if (!dp || dp->nr_kept)
        return;  /* Python has records to take: the eventfd says so */
    if (io_uring_sq_ready(&dp->r->ring))
        io_uring_submit(&dp->r->ring);
    if (dp_uvq(h->uv.loop, DP_UVL_WATCHERS)->next != dp_uvq(h->uv.loop, DP_UVL_WATCHERS)) {
        /* libuv (re)arms watchers in its poll, after this: let it, and
           come back at once (the eventfd ends that poll) to wait here */
        uint64_t one = 1;

        if (write(dp->r->efd, &one, sizeof(one)) < 0) {
            /* the count is full: a wake-up is pending anyway */
        }
        return;
    }
    h->uv.update_time(h->uv.loop);
    ms = h->uv.backend_timeout(h->uv.loop);
    if (ms == 0)
        return;
    dp_own_wait(dp, ms);
    h->uv.update_time(h->uv.loop);  /* libuv's timeout then counts C's wait */
}

static void dp_hook_closed(void *handle)
{
    free((char *)handle - offsetof(struct dp_hook, handle));
}

int aur_dp_own_wait(struct aur_dp *dp, const struct aur_uv *a)
{
    struct dp_uv u = {
        a->loop, (size_t (*)(int))a->handle_size, (int (*)(void *, void *))a->prepare_init,
        (int (*)(void *, dp_uv_cb *))a->prepare_start, (int (*)(void *))a->prepare_stop,
        (void (*)(void *, dp_uv_cb *))a->close, (int (*)(const void *))a->backend_fd,
        (int (*)(const void *))a->backend_timeout, (void (*)(void *))a->update_time,
    };
    const struct dp_uv *uv = &u;
    struct dp_hook *h;
    size_t size;
    int epfd;

    if (!a->handle_size || !a->prepare_init || !a->prepare_start || !a->prepare_stop ||
        !a->close || !a->backend_fd || !a->backend_timeout || !a->update_time)
        return -EINVAL;
    if (dp->hook)
        return -EBUSY;
    if (!uv->loop || !*(void *const *)uv->loop)  /* uvloop sets data to its Loop */
        return -ENOTSUP;
    epfd = uv->backend_fd(uv->loop);
    if (epfd < 0 || *(const int *)((const char *)uv->loop + DP_UVL_BACKEND_FD) != epfd ||
        !dp_uvq_sane(dp_uvq(uv->loop, DP_UVL_PENDING)) ||
        !dp_uvq_sane(dp_uvq(uv->loop, DP_UVL_WATCHERS)))
        return -ENOTSUP;  /* not the uv_loop_t layout this reads */
    size = uv->handle_size(DP_UV_PREPARE);
    if (size < 32 || size > 1024)
        return -ENOTSUP;
    if (!dp->kept && !(dp->kept = malloc(16 * (size_t)dp->out_cap)))
        return -ENOMEM;
    h = calloc(1, sizeof(*h) + size);
    if (!h)
        return -ENOMEM;
    h->dp = dp;
    h->uv = *uv;
    h->epfd = epfd;
    if (uv->prepare_init(uv->loop, h->handle) < 0) {
        free(h);
        return -EINVAL;
    }
    /* uv_handle_t.data: uvloop's close walks the loop's handles and reads a
       UVHandle from it; NULL, it only complains about a foreign one */
    *(void **)h->handle = NULL;
    if (uv->prepare_start(h->handle, dp_hook_prepare) < 0) {
        uv->close(h->handle, dp_hook_closed);
        return -EINVAL;
    }
    dp->hook = h;
    dp->loop_armed = 0;
    dp->loop_ready = 0;
    return 0;
}

/* Before the ring closes, on the loop's thread: the handle goes with the
   loop's next turn (its close callback frees it); C waits the old way. */
void aur_dp_release_wait(struct aur_dp *dp)
{
    struct dp_hook *h = dp->hook;

    if (!h)
        return;
    dp->hook = NULL;
    h->dp = NULL;
    h->uv.prepare_stop(h->handle);
    h->uv.close(h->handle, dp_hook_closed);
}
