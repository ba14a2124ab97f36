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
 * it fetches, the request's tag buffer as the data. Without TLS the
 * plug-in speaks the transmission phase itself (below: "own"); over TLS
 * it sends them with nbd_aio_pread/pwrite and libnbd parses the replies
 * (simple or structured) into the buffer. Each answer goes to the data
 * plane (done), which commits on its next pass. The socket's readiness comes
 * from polls on the queue's ring (wants/ready): nbd_aio_notify_read and
 * _write run on the worker's thread, inside the data plane's pass, and
 * Python's own commands on the same handle complete there too.
 *
 * C never decides what a failure means: a command answered with an error
 * goes back to the data plane as that error, which hands the request to
 * Python (the target retries it, holds it while it reconnects, or fails
 * it). When the connection dies (libnbd fails what was in flight, or the
 * socket C owns closes, fails, or carries a reply that breaks the
 * protocol), the plug-in lets go of it at once, so that new requests go to Python, which
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
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

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

    if (!n)
        return 0;  /* (q->done may be NULL yet: no copy from it, not even of 0 bytes) */
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

/* One command of Python's, as libnbd sends it (kind: ANBD_READ...). */
static int64_t anbd_libnbd_cmd(struct nbd_handle *h, struct anbd_q *q, unsigned kind,
                               void *buf, uint64_t count, uint64_t offset, uint64_t id,
                               uint32_t flags)
{
    int ok;
    nbd_completion_callback cb = anbd_cb(q, id, &ok);

    if (!ok)
        return -1;
    switch (kind) {
    case ANBD_READ:
        return nbd_aio_pread(h, buf, count, offset, cb, flags);
    case ANBD_WRITE:
        return nbd_aio_pwrite(h, buf, count, offset, cb, flags);
    case ANBD_FLUSH:
        return nbd_aio_flush(h, cb, flags);
    case ANBD_TRIM:
        return nbd_aio_trim(h, count, offset, cb, flags);
    case ANBD_ZERO:
        return nbd_aio_zero(h, count, offset, cb, flags);
    }
    free(cb.user_data);
    return -1;
}

/* -- the data plane's plug-in ----------------------------------------------- */

/*
 * Two ways to move the bytes, chosen when Python plugs a handle in:
 *
 * - own (the transmission phase in C): libnbd negotiated, TLS is off and
 *   nothing is in flight, so the socket is plain NBD from here on. The
 *   plug-in writes the requests itself and parses the replies, simple or
 *   structured, and the queue's ring moves the bytes: each pass's requests
 *   in one SENDMSG from the tag buffers (flush, send), the replies by a
 *   READV kept in flight (recv): into the tag buffer whose data comes
 *   next, then a large stage, from which the rest is parsed and copied
 *   (a header at a time while large reads are about, so that their data
 *   goes from the socket straight to its buffer). No syscall of its own
 *   per request. Python's commands on the connection go the same way
 *   (anbd_cmd), since a second writer on the socket would interleave.
 *   libnbd's handle sits idle and takes the socket back when unplugged
 *   clean (the goodbye, nbd_shutdown).
 * - libnbd: for TLS (the bytes on the socket are gnutls's), and a handle
 *   with commands still in flight. nbd_aio_* send, libnbd parses.
 */

#define NBD_REQUEST_MAGIC 0x25609513u
#define NBD_SIMPLE_REPLY_MAGIC 0x67446698u
#define NBD_STRUCTURED_REPLY_MAGIC 0x668e33efu
#define NBD_REPLY_FLAG_DONE 1
#define NBD_REPLY_TYPE_NONE 0
#define NBD_REPLY_TYPE_OFFSET_DATA 1
#define NBD_REPLY_TYPE_OFFSET_HOLE 2
#define NBD_REPLY_TYPE_ERROR_BIT 0x8000
/* bytes of a simple reply's header, and of a structured chunk's */
#define NBD_SIMPLE_REPLY_BYTES 16
#define NBD_CHUNK_HEADER_BYTES 20
/*
 * Cookies. Python's: ANBD_PY_COOKIE | its request id (ids only ever grow).
 * C's: a sequence number, one per command sent, above the request's index
 * (local * depth + tag) in the low ANBD_INDEX_BITS: a late or duplicated
 * reply to a request that is finished names a cookie no command holds any
 * more, even when the kernel has handed the same tag a new request.
 */
#define ANBD_PY_COOKIE (1ULL << 63)
#define ANBD_INDEX_BITS 24
#define ANBD_INDEX_MASK ((1ULL << ANBD_INDEX_BITS) - 1)
/* the disjoint ranges of a structured read's reply kept apart at most (in
   order, servers send one) */
#define ANBD_COV 8
#define ANBD_STAGE (256 << 10)
/* A read this long or longer has its reply's data read straight into its
   buffer (anbd_ext_recv). */
#define ANBD_DIRECT_MIN (32 << 10)
#define ANBD_IOV 64

_Static_assert(LIBNBD_CMD_FLAG_FUA == 1 && LIBNBD_CMD_FLAG_NO_HOLE == 2,
               "libnbd's command flags are the protocol's");

/*
 * A command sent by the plug-in itself: a request's (slots) or Python's.
 *
 * Its send and its reply may finish in either order (a server may answer a
 * read once it has the header, while the rest of the send is still going
 * out), and the command, its buffer and its place in the send queue stay
 * alive until both have: a reply that comes first is kept (replied) and
 * handed on when the send is done with the command's bytes. A reply to a
 * command not one byte of which was handed to a send yet is the server's
 * error (it cannot have read the request), and drops the connection.
 */
struct anbd_rcmd {
    uint8_t hdr[28];               /* the request on the wire */
    uint16_t kind, local, tag;
    uint8_t py;                    /* Python's: its answer goes to q under id */
    uint8_t live;                  /* its reply is awaited: found by its cookie */
    uint8_t queued;                /* its bytes wait in the send queue, not all sent */
    uint8_t started;               /* a send was handed some of them */
    uint8_t replied;               /* its reply came while queued: err waits for the send */
    uint8_t big;                   /* a live read of ANBD_DIRECT_MIN or more */
    uint8_t ncov;                  /* a structured read's ranges covered (cov), */
    uint8_t scattered;             /* or more of them than cov holds */
    int err;                       /* a structured reply's first error (errno) */
    uint64_t cookie, id, off;
    uint32_t len;
    struct { uint32_t from, to; } cov[ANBD_COV];  /* relative to off, in order */
    char *buf;                     /* a read's destination, a write's source */
    struct anbd_rcmd *next;        /* Python's, in flight */
};

/* where the reply being read is, byte by byte across reads */
enum { RX_HDR, RX_OFFSET, RX_HOLE, RX_ERROR, RX_DATA };

struct anbd_rx {
    int state;
    uint8_t small[4096 + 8];       /* a header, an offset, a hole or an error chunk */
    unsigned have, need;
    struct anbd_rcmd *c;           /* the reply's command */
    int structured;                /* the header's kind */
    uint16_t flags, type;
    uint32_t length;               /* a structured chunk's payload */
    char *dst;                     /* RX_DATA: where the rest goes */
    uint32_t left;
};

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
    uint64_t seq;                  /* C's commands sent: their cookies' upper part */
    char why[256];
    struct anbd_slot *slots;       /* nr_queues * depth */
    /* own transmission (own: the socket is ours) */
    int own, fd, structured;
    int go;                        /* the queue may be sent: the pass is over (flush) */
    struct anbd_rcmd *cmds;        /* nr_queues * depth: the requests' */
    struct anbd_rcmd *pys;         /* Python's in flight */
    struct anbd_rcmd **out;        /* to send, in order: out[head..tail) */
    unsigned head, tail, cap;
    uint32_t out_done;             /* bytes of out[head] already sent */
    struct anbd_rx rx;
    char *stage;                   /* where the ring reads what is not a reply's data */
    struct iovec riov[2];          /* the ring's read in flight (recv): a reply's
                                      data straight to its buffer, then the stage */
    uint32_t rdirect;              /* riov[0]'s length when it is the data's */
    unsigned live, big;            /* live commands, and reads of ANBD_DIRECT_MIN or more */
    int last_big;                  /* the last read answered was one */
    struct iovec siov[ANBD_IOV];   /* the ring's send in flight (send) */
    struct msghdr smsg;
    uint64_t reads;                /* the ring's reads of the socket, and its sends */
    uint64_t sends;
    uint64_t staged;               /* bytes of replies' data copied out of the stage */
};

struct anbd_ext *anbd_ext_new(int read_only, struct anbd_q *q)
{
    struct anbd_ext *x = calloc(1, sizeof(*x));

    if (!x)
        return NULL;
    x->q = q;
    x->read_only = read_only;
    x->fd = -1;
    return x;
}

void anbd_ext_free(struct anbd_ext *x)
{
    while (x->pys) {  /* (Python's, never answered: the connection went first) */
        struct anbd_rcmd *c = x->pys;

        x->pys = c->next;
        free(c);
    }
    free(x->slots);
    free(x->cmds);
    free(x->out);
    free(x->stage);
    free(x);
}

static int anbd_ext_bind(void *ctx, struct aur_dp *dp, unsigned nr_queues, unsigned depth,
                         aur_dp_ext_done_fn done, aur_dp_ext_kick_fn kick)
{
    struct anbd_ext *x = ctx;
    size_t n = (size_t)nr_queues * depth, i;

    if (x->dp || !n || n > ANBD_INDEX_MASK + 1)
        return -EINVAL;
    x->slots = malloc(n * sizeof(*x->slots));
    x->cmds = calloc(n, sizeof(*x->cmds));
    x->out = malloc((n + 16) * sizeof(*x->out));
    x->stage = malloc(ANBD_STAGE);
    if (!x->slots || !x->cmds || !x->out || !x->stage)
        return -ENOMEM;  /* (freed with x) */
    x->cap = (unsigned)n + 16;
    for (i = 0; i < n; i++) {
        x->slots[i] = (struct anbd_slot){ x, (uint16_t)(i / depth), (uint16_t)(i % depth) };
        x->cmds[i].local = (uint16_t)(i / depth);
        x->cmds[i].tag = (uint16_t)(i % depth);
    }
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

struct nbd_handle *anbd_ext_handle(struct anbd_ext *x) { return x->h; }
const char *anbd_ext_why(struct anbd_ext *x) { return x->why; }
uint64_t anbd_ext_sent(struct anbd_ext *x) { return x->sent; }
uint64_t anbd_ext_failed(struct anbd_ext *x) { return x->failed; }
int anbd_ext_own(struct anbd_ext *x) { return x->own; }
uint64_t anbd_ext_reads(struct anbd_ext *x) { return x->reads; }
uint64_t anbd_ext_sends(struct anbd_ext *x) { return x->sends; }
uint64_t anbd_ext_staged(struct anbd_ext *x) { return x->staged; }

/* c's reply came (or never will): no reply may come for it any more */
static void anbd_settle(struct anbd_ext *x, struct anbd_rcmd *c)
{
    if (!c->live)
        return;
    c->live = 0;
    x->live--;
    if (c->kind == ANBD_READ)
        x->last_big = c->big;
    if (c->big) {
        c->big = 0;
        x->big--;
    }
}

/* libnbd's error on this thread, kept for Python's log line */
static void anbd_ext_note(struct anbd_ext *x)
{
    const char *why = nbd_get_error();

    snprintf(x->why, sizeof(x->why), "%s", why ? why : "connection closed");
}

/* -- own transmission -- */

static void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v & 0xff; }
static void put32(uint8_t *p, uint32_t v) { put16(p, v >> 16); put16(p + 2, v & 0xffff); }
static void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, v & 0xffffffffu); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t get32(const uint8_t *p) { return (uint32_t)get16(p) << 16 | get16(p + 2); }
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

/* the errno of an NBD error: the protocol's values are Linux's; others EINVAL */
static int anbd_errno(uint32_t e)
{
    switch (e) {
    case EPERM: case EIO: case ENOMEM: case EINVAL: case ENOSPC: case EOVERFLOW:
    case ENOTSUP: case ESHUTDOWN:
        return (int)e;
    }
    return EINVAL;
}

/* c's answer (errno or 0), its reply and its send both done with it: to
   Python (reaped with the rest of q; c is freed) or to the data plane */
static void anbd_answer(struct anbd_ext *x, struct anbd_rcmd *c, int err)
{
    c->replied = 0;
    if (c->py) {
        struct anbd_cmd cmd = { x->q, c->id };
        struct anbd_rcmd **p;

        for (p = &x->pys; *p; p = &(*p)->next)
            if (*p == c) {
                *p = c->next;
                break;
            }
        anbd_completed(&cmd, &err);
        free(c);
        return;
    }
    if (err)
        x->failed++;
    x->done(x->dp, c->local, c->tag, err ? -err : 0);
}

/* c's reply came whole (a reply for it again is the server's error): its
   answer now, or once the send queue is done with its bytes */
static void anbd_reply(struct anbd_ext *x, struct anbd_rcmd *c, int err)
{
    anbd_settle(x, c);
    if (c->queued) {
        c->replied = 1;
        c->err = err;
        return;
    }
    anbd_answer(x, c, err);
}

/* c, whatever it waited for, is answered with err now (the connection is
   gone: no send of it goes on, the socket is shut down) */
static void anbd_drop(struct anbd_ext *x, struct anbd_rcmd *c, int err)
{
    anbd_settle(x, c);
    c->queued = c->started = 0;
    anbd_answer(x, c, err);
}

/* The socket is no use any more (closed, failed, or the server broke the
   protocol): what was in flight goes back (C's to Python as retries,
   Python's as lost), and the handle with it: Python closes and reconnects. */
static void anbd_own_die(struct anbd_ext *x, const char *why)
{
    size_t i, n = (size_t)x->nr_queues * x->depth;

    if (!x->why[0])
        snprintf(x->why, sizeof(x->why), "%s", why);
    shutdown(x->fd, SHUT_RDWR);  /* libnbd finds it dead too */
    x->own = 0;
    x->fd = -1;
    x->h = NULL;
    x->py = 1;
    x->head = x->tail = 0;
    x->out_done = 0;
    memset(&x->rx, 0, sizeof(x->rx));
    for (i = 0; i < n; i++)
        if (x->cmds[i].live || x->cmds[i].queued)
            anbd_drop(x, &x->cmds[i], ENOTCONN);
    while (x->pys)
        anbd_drop(x, x->pys, ENOTCONN);
}

/* Queue c's request (its header written now) for the next send. */
static int anbd_own_queue(struct anbd_ext *x, struct anbd_rcmd *c, unsigned kind,
                          uint32_t flags, uint64_t off, uint32_t len, void *buf)
{
    if (c->live || c->queued)
        return -EBUSY;  /* (a request handed over again before its answer: never) */
    if (x->tail == x->cap) {
        if (x->head) {
            memmove(x->out, x->out + x->head, (x->tail - x->head) * sizeof(*x->out));
            x->tail -= x->head;
            x->head = 0;
        } else {
            struct anbd_rcmd **out = realloc(x->out, 2 * x->cap * sizeof(*out));

            if (!out)
                return -ENOMEM;
            x->out = out;
            x->cap *= 2;
        }
    }
    c->kind = (uint16_t)kind;
    c->off = off;
    c->len = len;
    c->buf = buf;
    c->err = 0;
    c->ncov = c->scattered = 0;
    c->live = c->queued = 1;
    c->started = c->replied = 0;
    c->cookie = c->py ? ANBD_PY_COOKIE | c->id :
        (++x->seq << ANBD_INDEX_BITS | ((uint64_t)c->local * x->depth + c->tag)) &
        ~ANBD_PY_COOKIE;
    c->big = kind == ANBD_READ && len >= ANBD_DIRECT_MIN;
    x->big += c->big;
    x->live++;
    put32(c->hdr, NBD_REQUEST_MAGIC);
    put16(c->hdr + 4, (uint16_t)flags);
    put16(c->hdr + 6, (uint16_t)kind);
    put64(c->hdr + 8, c->cookie);
    put64(c->hdr + 16, off);
    put32(c->hdr + 24, len);
    x->out[x->tail++] = c;
    return 0;
}

/* c's bytes on the wire: the header, and a write's data */
static uint32_t anbd_wire(const struct anbd_rcmd *c)
{
    return 28 + (c->kind == ANBD_WRITE ? c->len : 0);
}

/* The next send: what is queued, from out[head] on (its first out_done bytes
   already sent), headers and write data in one message. 0: nothing queued. */
static int anbd_own_msg(struct anbd_ext *x, struct msghdr **msg)
{
    unsigned i, n = 0, skip = x->out_done;

    for (i = x->head; i < x->tail && n + 2 <= ANBD_IOV; i++, skip = 0) {
        struct anbd_rcmd *c = x->out[i];

        c->started = 1;
        if (skip < 28)
            x->siov[n++] = (struct iovec){ c->hdr + skip, 28 - skip };
        if (c->kind == ANBD_WRITE && c->len) {
            uint32_t from = skip > 28 ? skip - 28 : 0;

            x->siov[n++] = (struct iovec){ c->buf + from, c->len - from };
        }
    }
    x->go = 0;  /* (until the next pass ends, or this send comes back short) */
    if (!n)
        return 0;
    x->smsg = (struct msghdr){ .msg_iov = x->siov, .msg_iovlen = n };
    *msg = &x->smsg;
    x->sends++;
    return 1;
}

/* sent bytes of the queue are done with: a command whose reply came
   first is answered now */
static void anbd_own_advance(struct anbd_ext *x, size_t sent)
{
    while (sent > 0 && x->head < x->tail) {
        struct anbd_rcmd *c = x->out[x->head];
        uint32_t rest = anbd_wire(c) - x->out_done;

        if (sent < rest) {
            x->out_done += (uint32_t)sent;
            break;
        }
        sent -= rest;
        x->out_done = 0;
        x->head++;
        c->queued = 0;
        if (c->replied)
            anbd_answer(x, c, c->err);
    }
    if (x->head == x->tail)
        x->head = x->tail = 0;
}

/* The command a reply names (rx->c), or why there is none: 0, or the
   server's error. */
static const char *anbd_rx_find(struct anbd_ext *x, uint64_t cookie)
{
    struct anbd_rcmd *c = NULL;

    if (cookie & ANBD_PY_COOKIE) {
        for (c = x->pys; c && c->cookie != cookie; c = c->next)
            ;
    } else if ((cookie & ANBD_INDEX_MASK) < (uint64_t)x->nr_queues * x->depth) {
        c = &x->cmds[cookie & ANBD_INDEX_MASK];
    }
    if (!c || !c->live || c->cookie != cookie)
        return "a reply to no request in flight";
    if (!c->started)
        return "a reply to a request not sent yet";
    x->rx.c = c;
    return NULL;
}

/* [from, to) of c's read (relative to its offset) came: 0, or why that
   breaks the protocol (chunks never overlap) */
static const char *anbd_cover(struct anbd_rcmd *c, uint32_t from, uint32_t to)
{
    unsigned i, n = c->ncov;
    int left, right;

    if (from == to || c->scattered)
        return NULL;
    for (i = 0; i < n && c->cov[i].to <= from; i++)
        ;
    if (i < n && c->cov[i].from < to)
        return "overlapping chunks in a read";
    left = i > 0 && c->cov[i - 1].to == from;
    right = i < n && c->cov[i].from == to;
    if (left && right) {
        c->cov[i - 1].to = c->cov[i].to;
        memmove(&c->cov[i], &c->cov[i + 1], (n - i - 1) * sizeof(c->cov[0]));
        c->ncov--;
    } else if (left) {
        c->cov[i - 1].to = to;
    } else if (right) {
        c->cov[i].from = from;
    } else if (n == ANBD_COV) {
        c->scattered = 1;  /* (no longer checked: the read fails, never passes short) */
    } else {
        memmove(&c->cov[i + 1], &c->cov[i], (n - i) * sizeof(c->cov[0]));
        c->cov[i].from = from;
        c->cov[i].to = to;
        c->ncov++;
    }
    return NULL;
}

/* every byte of c's read came, once */
static int anbd_covered(const struct anbd_rcmd *c)
{
    return !c->len || (!c->scattered && c->ncov == 1 && c->cov[0].from == 0 &&
                       c->cov[0].to == c->len);
}

static void anbd_rx_expect(struct anbd_rx *rx, int state, unsigned need)
{
    rx->state = state;
    rx->have = 0;
    rx->need = need;
}

/* A structured chunk ended: the reply too if it said so. */
static void anbd_rx_chunk_end(struct anbd_ext *x)
{
    struct anbd_rx *rx = &x->rx;

    struct anbd_rcmd *c = rx->c;

    if (rx->flags & NBD_REPLY_FLAG_DONE) {
        if (!c->err && c->kind == ANBD_READ && !anbd_covered(c))
            c->err = EIO;  /* (a part never came) */
        anbd_reply(x, c, c->err);
    }
    anbd_rx_expect(rx, RX_HDR, 4);
}

/* The range [off, off+n) of a read's reply: inside the read, or NULL. */
static char *anbd_rx_range(struct anbd_rcmd *c, uint64_t off, uint64_t n)
{
    if (c->kind != ANBD_READ || off < c->off || off - c->off > c->len ||
        n > c->len - (off - c->off))
        return NULL;
    return c->buf + (off - c->off);
}

/* rx->small holds what the state needed: act on it. 0, or why the reply
   breaks the protocol. */
static const char *anbd_rx_step(struct anbd_ext *x)
{
    struct anbd_rx *rx = &x->rx;
    const char *why;
    uint32_t magic;
    char *dst;

    switch (rx->state) {
    case RX_HDR:
        magic = get32(rx->small);
        if (rx->need == 4) {  /* the magic says how long the header is */
            if (magic == NBD_SIMPLE_REPLY_MAGIC)
                rx->need = NBD_SIMPLE_REPLY_BYTES;
            else if (magic == NBD_STRUCTURED_REPLY_MAGIC && x->structured)
                rx->need = NBD_CHUNK_HEADER_BYTES;
            else
                return "a reply with a bad magic";
            return NULL;
        }
        rx->structured = magic == NBD_STRUCTURED_REPLY_MAGIC;
        if (!rx->structured) {
            uint32_t err = get32(rx->small + 4);
            const char *why = anbd_rx_find(x, get64(rx->small + 8));

            if (why)
                return why;
            if (err || rx->c->kind != ANBD_READ || !rx->c->len) {
                anbd_reply(x, rx->c, err ? anbd_errno(err) : 0);
                anbd_rx_expect(rx, RX_HDR, 4);
                return NULL;
            }
            rx->dst = rx->c->buf;
            rx->left = rx->c->len;
            rx->state = RX_DATA;
            return NULL;
        }
        rx->flags = get16(rx->small + 4);
        rx->type = get16(rx->small + 6);
        rx->length = get32(rx->small + 16);
        if ((why = anbd_rx_find(x, get64(rx->small + 8))))
            return why;
        if (rx->type == NBD_REPLY_TYPE_NONE) {
            if (rx->length || !(rx->flags & NBD_REPLY_FLAG_DONE))
                return "a bad NONE chunk";
            anbd_rx_chunk_end(x);
        } else if (rx->type == NBD_REPLY_TYPE_OFFSET_DATA) {
            if (rx->length <= 8)
                return "a bad OFFSET_DATA chunk";
            anbd_rx_expect(rx, RX_OFFSET, 8);
        } else if (rx->type == NBD_REPLY_TYPE_OFFSET_HOLE) {
            if (rx->length != 12)
                return "a bad OFFSET_HOLE chunk";
            anbd_rx_expect(rx, RX_HOLE, 12);
        } else if (rx->type & NBD_REPLY_TYPE_ERROR_BIT) {
            if (rx->length < 6 || rx->length > sizeof(rx->small))
                return "a bad error chunk";
            anbd_rx_expect(rx, RX_ERROR, rx->length);
        } else {
            return "a reply chunk of a type not asked for";
        }
        return NULL;
    case RX_OFFSET:
        if (!(dst = anbd_rx_range(rx->c, get64(rx->small), rx->length - 8)))
            return "data outside its read";
        if ((why = anbd_cover(rx->c, (uint32_t)(dst - rx->c->buf),
                              (uint32_t)(dst - rx->c->buf) + (rx->length - 8))))
            return why;
        rx->dst = dst;
        rx->left = rx->length - 8;
        rx->state = RX_DATA;
        return NULL;
    case RX_HOLE:
        if (!(dst = anbd_rx_range(rx->c, get64(rx->small), get32(rx->small + 8))))
            return "a hole outside its read";
        if ((why = anbd_cover(rx->c, (uint32_t)(dst - rx->c->buf),
                              (uint32_t)(dst - rx->c->buf) + get32(rx->small + 8))))
            return why;
        memset(dst, 0, get32(rx->small + 8));
        anbd_rx_chunk_end(x);
        return NULL;
    case RX_ERROR:
        if (!rx->c->err)
            rx->c->err = anbd_errno(get32(rx->small));
        if (!rx->c->err)
            rx->c->err = EINVAL;
        anbd_rx_chunk_end(x);
        return NULL;
    }
    return "a lost reply";
}

/* The data of a reply arrived whole. */
static void anbd_rx_data_end(struct anbd_ext *x)
{
    if (x->rx.structured)
        anbd_rx_chunk_end(x);
    else {
        anbd_reply(x, x->rx.c, 0);
        anbd_rx_expect(&x->rx, RX_HDR, 4);
    }
}

/* Parse the staged bytes; 0, or why the connection is to be dropped. */
static const char *anbd_rx_parse(struct anbd_ext *x, const char *p, unsigned n)
{
    struct anbd_rx *rx = &x->rx;
    const char *why;

    while (n) {
        if (rx->state == RX_DATA) {
            unsigned k = n < rx->left ? n : rx->left;

            memcpy(rx->dst, p, k);
            x->staged += k;
            rx->dst += k;
            rx->left -= k;
            p += k;
            n -= k;
            if (!rx->left)
                anbd_rx_data_end(x);
            continue;
        }
        {
            unsigned k = rx->need - rx->have;

            if (k > n)
                k = n;
            memcpy(rx->small + rx->have, p, k);
            rx->have += k;
            p += k;
            n -= k;
            if (rx->have == rx->need && (why = anbd_rx_step(x)))
                return why;
        }
    }
    return NULL;
}

/* Take h's socket for C's own transmission, if the bytes on it are plain NBD
   and nothing of libnbd's is in flight. */
static void anbd_own_take(struct anbd_ext *x, struct nbd_handle *h)
{
    int fd;

    if (getenv("AIOUBLK_NBD_LIBNBD") || nbd_get_tls_negotiated(h) == 1 ||
        nbd_aio_in_flight(h) != 0 || !nbd_aio_is_ready(h))
        return;
#ifdef LIBNBD_HAVE_NBD_GET_EXTENDED_HEADERS_NEGOTIATED
    if (nbd_get_extended_headers_negotiated(h) == 1)
        return;
#endif
    if ((fd = nbd_aio_get_fd(h)) < 0)
        return;
    x->own = 1;
    x->fd = fd;
    x->structured = nbd_get_structured_replies_negotiated(h) == 1;
    x->head = x->tail = 0;
    x->out_done = 0;
    memset(&x->rx, 0, sizeof(x->rx));
    anbd_rx_expect(&x->rx, RX_HDR, 4);
}

/* Give the socket back to libnbd: clean (nothing in flight, no request or
   reply cut in half) or shut down, so that libnbd never reads the middle
   of a reply. */
static void anbd_own_release(struct anbd_ext *x)
{
    size_t i, n = (size_t)x->nr_queues * x->depth;
    int clean = x->head == x->tail && x->rx.state == RX_HDR && x->rx.have == 0 && !x->pys;

    for (i = 0; i < n; i++)
        clean &= !x->cmds[i].live;
    if (!clean)
        anbd_own_die(x, "the connection was unplugged with requests in flight");
    x->own = 0;
    x->fd = -1;
}

/* -- both ways -- */

int anbd_ext_plug(struct anbd_ext *x, struct nbd_handle *h)
{
    if (x->own)
        anbd_own_release(x);
    x->h = h;
    if (h) {
        x->why[0] = 0;
        if (x->dp)
            anbd_own_take(x, h);
    }
    return anbd_ext_kick(x);
}

int64_t anbd_cmd(struct nbd_handle *h, struct anbd_q *q, struct anbd_ext *x, unsigned kind,
                 void *buf, uint64_t count, uint64_t offset, uint64_t id, uint32_t flags)
{
    struct anbd_rcmd *c;

    if (!x || !x->own || x->h != h)
        return anbd_libnbd_cmd(h, q, kind, buf, count, offset, id, flags);
    if (count > UINT32_MAX || !(c = calloc(1, sizeof(*c))))
        return -1;
    c->py = 1;
    c->id = id;
    if (anbd_own_queue(x, c, kind, flags, offset, (uint32_t)count, buf) < 0) {
        free(c);
        return -1;
    }
    c->next = x->pys;
    x->pys = c;
    x->go = 1;
    return (int64_t)id;  /* (sent by the ring: Python kicks the plug-in next) */
}

/* The handle died or closed: let go of it (Python closes it and reconnects). */
static void anbd_ext_check(struct anbd_ext *x)
{
    if (x->h && !x->own && (nbd_aio_is_dead(x->h) || nbd_aio_is_closed(x->h))) {
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
    if (op != AUR_EXT_READ && (op != AUR_EXT_WRITE || x->read_only))
        return -EOPNOTSUPP;
    if (x->own) {
        int err = anbd_own_queue(x, &x->cmds[(size_t)local * x->depth + tag],
                                 op == AUR_EXT_READ ? ANBD_READ : ANBD_WRITE, 0, off, len, buf);

        if (err < 0)
            return err;
        x->sent++;
        return 0;  /* sent by the pass's flush, with the others */
    }
    s = &x->slots[(size_t)local * x->depth + tag];
    cb.user_data = s;
    if (op == AUR_EXT_READ)
        cookie = nbd_aio_pread(x->h, buf, len, off, cb, 0);
    else
        cookie = nbd_aio_pwrite(x->h, buf, len, off, cb, 0);
    if (cookie == -1) {  /* not sent, no callback: Python serves it */
        anbd_ext_check(x);
        return -EIO;
    }
    x->sent++;
    return 0;
}

/* The pass handed over all it had: its requests go in one send. */
static void anbd_ext_flush(void *ctx)
{
    struct anbd_ext *x = ctx;

    x->go = x->head < x->tail;
}

static unsigned anbd_ext_wants(void *ctx, int *fd)
{
    struct anbd_ext *x = ctx;
    unsigned want = 0, dir;

    *fd = -1;
    anbd_ext_check(x);
    if (x->own) {
        *fd = x->fd;
        want = AUR_EXT_IN | (x->go && x->head < x->tail ? AUR_EXT_OUT : 0);
    } else if (x->h) {
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
    if (revents < 0)  /* the poll failed: let the socket say what is wrong */
        revents = POLLIN | POLLOUT;
    if (x->own)
        return;  /* (its socket is read and written by the ring, not polled) */
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

/* The ring reads the socket C owns into the stage; libnbd's is polled.
   While large reads are the order of the day (half or more of what is in
   flight; with nothing in flight, the last read answered: the read kept
   in flight between bursts is posted then), the stage takes one header at
   a time (a structured reply's with its data's offset), so that the next
   read puts the data straight into its buffer: through the stage, every
   byte of it would be copied once more. Otherwise replies come many to a
   read, at the cost of copying the data of the few large ones. */
static int anbd_ext_recv(void *ctx, struct iovec **iov)
{
    struct anbd_ext *x = ctx;
    int direct = x->live ? 2 * x->big >= x->live : x->last_big;
    size_t stage = !direct ? ANBD_STAGE :
        x->structured ? NBD_CHUNK_HEADER_BYTES + 8 : NBD_SIMPLE_REPLY_BYTES;
    int n = 0;

    if (!x->own)
        return 0;
    x->rdirect = 0;
    if (x->rx.state == RX_DATA && x->rx.left) {
        x->rdirect = x->rx.left;
        x->riov[n++] = (struct iovec){ x->rx.dst, x->rx.left };
    }
    x->riov[n++] = (struct iovec){ x->stage, stage };
    *iov = x->riov;
    return n;
}

static void anbd_ext_received(void *ctx, int res)
{
    struct anbd_ext *x = ctx;
    const char *why;

    x->reads++;
    if (!x->own)
        return;
    if (res == -EAGAIN || res == -EINTR)
        return;  /* (asked again by the next watch) */
    if (res <= 0) {
        anbd_own_die(x, res ? strerror(-res) : "the server closed the connection");
        return;
    }
    if (x->rdirect) {  /* the data's part came first, in place */
        uint32_t k = (uint32_t)res < x->rdirect ? (uint32_t)res : x->rdirect;

        x->rx.dst += k;
        x->rx.left -= k;
        res -= (int)k;
        if (!x->rx.left)
            anbd_rx_data_end(x);
    }
    if (res && (why = anbd_rx_parse(x, x->stage, (unsigned)res)))
        anbd_own_die(x, why);
}

static int anbd_ext_sendmsg(void *ctx, struct msghdr **msg)
{
    struct anbd_ext *x = ctx;

    return x->own ? anbd_own_msg(x, msg) : 0;
}

static void anbd_ext_sendmsg_done(void *ctx, int res)
{
    struct anbd_ext *x = ctx;

    if (!x->own)
        return;
    if (res < 0 && res != -EAGAIN && res != -EINTR) {
        anbd_own_die(x, strerror(-res));
        return;
    }
    if (res > 0)
        anbd_own_advance(x, (size_t)res);
    x->go = x->head < x->tail;  /* (what is left goes with the next watch) */
}

static const struct aur_dp_ext anbd_ext_table = {
    .bind = anbd_ext_bind,
    .submit = anbd_ext_submit,
    .wants = anbd_ext_wants,
    .ready = anbd_ext_ready,
    .flush = anbd_ext_flush,
    .recv = anbd_ext_recv,
    .received = anbd_ext_received,
    .send = anbd_ext_sendmsg,
    .sent = anbd_ext_sendmsg_done,
};

const struct aur_dp_ext *anbd_ext_ops(void)
{
    return &anbd_ext_table;
}
