/*
 * libnbd for the nbd target (aioublk/targets/nbd.py): Python's commands,
 * and the data plane's plug-in that sends reads and writes without Python.
 *
 * Python's commands (negotiation aside: flush, trim, zeroes, whatever C
 * hands back) record their completion here (anbd_q: our request id and
 * its errno), reaped in bulk, rather than calling into Python once each.
 *
 * The plug-in (anbd_ext, dp_ext.h): once Python has connected a handle it
 * plugs it in, and the worker's data plane hands it every READ and WRITE
 * it fetches; it sends them with nbd_aio_pread/pwrite, the request's tag
 * buffer as the data, and libnbd parses the replies (simple or
 * structured) into it. Each completion callback answers the data plane
 * (done), which commits on its next pass. The socket's readiness comes
 * from polls on the queue's ring (wants/ready): nbd_aio_notify_read and
 * _write run on the worker's thread, inside the data plane's pass, and
 * Python's own commands on the same handle complete there too.
 *
 * C never decides what a failure means: a command answered with an error
 * goes back to the data plane as that error, which hands the request to
 * Python (the target retries it, holds it while it reconnects, or fails
 * it). When the handle dies (libnbd fails what was in flight), the
 * plug-in lets go of it at once, so that new requests go to Python, which
 * holds them, and asks Python to look (AUR_EXT_PY): Python closes the
 * handle, reconnects, and plugs the new one in.
 *
 * One thread uses all of it (the worker's): no locks beyond libnbd's.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nbd.h"

/* -- Python's commands ------------------------------------------------------ */

/* the completions not yet reaped, in the order they came; news: some came
   since the plug-in last told Python */
struct anbd_q { struct anbd_done *done; unsigned n, cap; int news; };

/* one command's callback data: which queue, which request */
struct anbd_cmd { struct anbd_q *q; uint64_t id; };

/* the TLS host name a certificate must hold, where libnbd can take it
   (1.22); older ones check only a TCP URI's host, and nothing over a unix socket */
int anbd_can_tls_hostname(void)
{
#ifdef LIBNBD_HAVE_NBD_SET_TLS_HOSTNAME
    return 1;
#else
    return 0;
#endif
}

int anbd_set_tls_hostname(struct nbd_handle *h, const char *hostname)
{
#ifdef LIBNBD_HAVE_NBD_SET_TLS_HOSTNAME
    return nbd_set_tls_hostname(h, hostname);
#else
    (void)h;
    (void)hostname;
    return -1;
#endif
}

struct anbd_q *anbd_q_new(void)
{
    return calloc(1, sizeof(struct anbd_q));
}

/* only after nbd_close of every handle using q: closing runs the callbacks
   of the commands still in flight */
void anbd_q_free(struct anbd_q *q)
{
    free(q->done);
    free(q);
}

static int anbd_completed(void *user_data, int *error)
{
    struct anbd_cmd *c = user_data;
    struct anbd_q *q = c->q;

    if (q->n == q->cap) {
        unsigned cap = q->cap ? 2 * q->cap : 64;
        struct anbd_done *d = realloc(q->done, cap * sizeof(*d));

        if (!d)
            abort();  /* a lost completion would hang its request forever */
        q->done = d;
        q->cap = cap;
    }
    q->done[q->n].id = c->id;
    q->done[q->n].error = *error;
    q->n++;
    q->news = 1;
    return 1;  /* retire the command: its cookie is not polled */
}

unsigned anbd_reap(struct anbd_q *q, struct anbd_done *out, unsigned max)
{
    unsigned n = q->n < max ? q->n : max;

    memcpy(out, q->done, n * sizeof(*out));
    memmove(q->done, q->done + n, (q->n - n) * sizeof(*out));
    q->n -= n;
    return n;
}

static nbd_completion_callback anbd_cb(struct anbd_q *q, uint64_t id, int *ok)
{
    struct anbd_cmd *c = malloc(sizeof(*c));
    nbd_completion_callback cb = { .callback = anbd_completed, .user_data = c, .free = free };

    *ok = c != NULL;
    if (c) {
        c->q = q;
        c->id = id;
    }
    return cb;
}

#define ANBD_CALL(call) do { \
        int ok; \
        nbd_completion_callback cb = anbd_cb(q, id, &ok); \
        if (!ok) \
            return -1; \
        return call; \
    } while (0)

int64_t anbd_pread(struct nbd_handle *h, struct anbd_q *q, void *buf, size_t count,
                   uint64_t offset, uint64_t id, uint32_t flags)
{
    ANBD_CALL(nbd_aio_pread(h, buf, count, offset, cb, flags));
}

int64_t anbd_pwrite(struct nbd_handle *h, struct anbd_q *q, const void *buf, size_t count,
                    uint64_t offset, uint64_t id, uint32_t flags)
{
    ANBD_CALL(nbd_aio_pwrite(h, buf, count, offset, cb, flags));
}

int64_t anbd_flush(struct nbd_handle *h, struct anbd_q *q, uint64_t id, uint32_t flags)
{
    ANBD_CALL(nbd_aio_flush(h, cb, flags));
}

int64_t anbd_trim(struct nbd_handle *h, struct anbd_q *q, uint64_t count, uint64_t offset,
                  uint64_t id, uint32_t flags)
{
    ANBD_CALL(nbd_aio_trim(h, count, offset, cb, flags));
}

int64_t anbd_zero(struct nbd_handle *h, struct anbd_q *q, uint64_t count, uint64_t offset,
                  uint64_t id, uint32_t flags)
{
    ANBD_CALL(nbd_aio_zero(h, count, offset, cb, flags));
}

/* -- the data plane's plug-in ----------------------------------------------- */

/* a request's callback data, one per (local, tag): no allocation per command */
struct anbd_slot { struct anbd_ext *x; uint16_t local, tag; };

struct anbd_ext {
    struct aur_dp *dp;             /* bound to (bind) */
    aur_dp_ext_done_fn done;
    aur_dp_ext_kick_fn kick;
    struct nbd_handle *h;          /* plugged: C sends on it; NULL: Python's requests */
    struct anbd_q *q;              /* Python's commands on h (read only while plugged) */
    int py;                        /* Python must look: bound, or the handle died */
    int read_only;
    unsigned nr_queues, depth;
    uint64_t sent, failed;
    char why[256];
    struct anbd_slot *slots;       /* nr_queues * depth */
};

struct anbd_ext *anbd_ext_new(int read_only, struct anbd_q *q)
{
    struct anbd_ext *x = calloc(1, sizeof(*x));

    if (!x)
        return NULL;
    x->q = q;
    x->read_only = read_only;
    return x;
}

void anbd_ext_free(struct anbd_ext *x)
{
    free(x->slots);
    free(x);
}

static int anbd_ext_bind(void *ctx, struct aur_dp *dp, unsigned nr_queues, unsigned depth,
                         aur_dp_ext_done_fn done, aur_dp_ext_kick_fn kick)
{
    struct anbd_ext *x = ctx;
    size_t n = (size_t)nr_queues * depth, i;

    if (x->dp || !n)
        return -EINVAL;
    if (!(x->slots = malloc(n * sizeof(*x->slots))))
        return -ENOMEM;
    for (i = 0; i < n; i++)
        x->slots[i] = (struct anbd_slot){ x, (uint16_t)(i / depth), (uint16_t)(i % depth) };
    x->nr_queues = nr_queues;
    x->depth = depth;
    x->dp = dp;
    x->done = done;
    x->kick = kick;
    x->py = 1;  /* Python plugs its handle in when it hears of it */
    return 0;
}

int anbd_ext_bound(struct anbd_ext *x) { return x->dp != NULL; }

int anbd_ext_kick(struct anbd_ext *x)
{
    return x->dp ? x->kick(x->dp) : 0;
}

int anbd_ext_plug(struct anbd_ext *x, struct nbd_handle *h)
{
    x->h = h;
    if (h)
        x->why[0] = 0;
    return anbd_ext_kick(x);
}

struct nbd_handle *anbd_ext_handle(struct anbd_ext *x) { return x->h; }
const char *anbd_ext_why(struct anbd_ext *x) { return x->why; }
uint64_t anbd_ext_sent(struct anbd_ext *x) { return x->sent; }
uint64_t anbd_ext_failed(struct anbd_ext *x) { return x->failed; }

/* libnbd's error on this thread, kept for Python's log line */
static void anbd_ext_note(struct anbd_ext *x)
{
    const char *why = nbd_get_error();

    snprintf(x->why, sizeof(x->why), "%s", why ? why : "connection closed");
}

/* The handle died or closed: let go of it (Python closes it and reconnects). */
static void anbd_ext_check(struct anbd_ext *x)
{
    if (x->h && (nbd_aio_is_dead(x->h) || nbd_aio_is_closed(x->h))) {
        if (!x->why[0])
            anbd_ext_note(x);
        x->h = NULL;
        x->py = 1;
    }
}

static int anbd_ext_completed(void *user_data, int *error)
{
    struct anbd_slot *s = user_data;
    struct anbd_ext *x = s->x;

    if (*error)
        x->failed++;
    if (x->dp)
        x->done(x->dp, s->local, s->tag, *error ? -*error : 0);
    return 1;  /* retire the command: its cookie is not polled */
}

static int anbd_ext_submit(void *ctx, unsigned local, uint16_t tag, unsigned op, uint64_t off,
                           uint32_t len, void *buf)
{
    struct anbd_ext *x = ctx;
    struct anbd_slot *s;
    nbd_completion_callback cb = { .callback = anbd_ext_completed };
    int64_t cookie;

    if (!x->h || local >= x->nr_queues || tag >= x->depth)
        return -ENOTCONN;
    s = &x->slots[(size_t)local * x->depth + tag];
    cb.user_data = s;
    if (op == AUR_EXT_READ)
        cookie = nbd_aio_pread(x->h, buf, len, off, cb, 0);
    else if (op == AUR_EXT_WRITE && !x->read_only)
        cookie = nbd_aio_pwrite(x->h, buf, len, off, cb, 0);
    else
        return -EOPNOTSUPP;
    if (cookie == -1) {  /* not sent, no callback: Python serves it */
        anbd_ext_check(x);
        return -EIO;
    }
    x->sent++;
    return 0;
}

static unsigned anbd_ext_wants(void *ctx, int *fd)
{
    struct anbd_ext *x = ctx;
    unsigned want = 0, dir;

    *fd = -1;
    anbd_ext_check(x);
    if (x->h) {
        *fd = nbd_aio_get_fd(x->h);
        dir = nbd_aio_get_direction(x->h);
        want = (dir & LIBNBD_AIO_DIRECTION_READ ? AUR_EXT_IN : 0) |
            (dir & LIBNBD_AIO_DIRECTION_WRITE ? AUR_EXT_OUT : 0);
    }
    if (x->py || (x->h && x->q->news)) {
        want |= AUR_EXT_PY;
        x->py = 0;
        if (x->h)
            x->q->news = 0;
    }
    return want;
}

static void anbd_ext_ready(void *ctx, int revents)
{
    struct anbd_ext *x = ctx;

    if (!x->h)
        return;
    if (revents < 0)  /* the poll failed: let libnbd find out what the socket says */
        revents = POLLIN | POLLOUT;
    if ((revents & (POLLIN | POLLHUP | POLLERR)) &&
        (nbd_aio_get_direction(x->h) & LIBNBD_AIO_DIRECTION_READ) &&
        nbd_aio_notify_read(x->h) == -1)
        anbd_ext_note(x);
    anbd_ext_check(x);
    if (x->h && (revents & (POLLOUT | POLLHUP | POLLERR)) &&
        (nbd_aio_get_direction(x->h) & LIBNBD_AIO_DIRECTION_WRITE) &&
        nbd_aio_notify_write(x->h) == -1)
        anbd_ext_note(x);
    anbd_ext_check(x);
}

static const struct aur_dp_ext anbd_ext_table = {
    .bind = anbd_ext_bind,
    .submit = anbd_ext_submit,
    .wants = anbd_ext_wants,
    .ready = anbd_ext_ready,
};

const struct aur_dp_ext *anbd_ext_ops(void)
{
    return &anbd_ext_table;
}
