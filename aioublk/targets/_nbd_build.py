"""cffi (API mode) builder for ``aioublk.targets._nbd``, libnbd for the nbd
target (``nbd.py``).

A separate extension from ``aioublk._uring`` so that aioublk builds and runs
on a machine without libnbd: ``setup.py`` builds this one only when
``libnbd.h`` is there, and the nbd target alone says what to install.

libnbd's functions are bound as they are, except its completion callbacks:
a command's completion is recorded in C (``anbd_done``: our request id and
its errno) and reaped in bulk after each ``nbd_aio_notify_*``, as the ring's
CQEs are, rather than calling into Python once per completion.

Supported: libnbd >= 1.14 (Debian 12).
"""

from __future__ import annotations

import cffi

CDEF = """
struct nbd_handle;
struct anbd_q;
struct anbd_done { uint64_t id; int32_t error; };

struct nbd_handle *nbd_create(void);
void nbd_close(struct nbd_handle *h);
const char *nbd_get_error(void);
int nbd_get_errno(void);

int nbd_set_request_structured_replies(struct nbd_handle *h, bool request);
int nbd_set_request_block_size(struct nbd_handle *h, bool request);
int nbd_set_uri_allow_transports(struct nbd_handle *h, uint32_t mask);
int nbd_set_uri_allow_tls(struct nbd_handle *h, int tls);
int nbd_set_tls_certificates(struct nbd_handle *h, const char *dir);
int nbd_aio_connect_uri(struct nbd_handle *h, const char *uri);
int nbd_poll(struct nbd_handle *h, int timeout);
int anbd_can_tls_hostname(void);
int anbd_set_tls_hostname(struct nbd_handle *h, const char *hostname);
int nbd_shutdown(struct nbd_handle *h, uint32_t flags);

int nbd_aio_get_fd(struct nbd_handle *h);
unsigned nbd_aio_get_direction(struct nbd_handle *h);
int nbd_aio_notify_read(struct nbd_handle *h);
int nbd_aio_notify_write(struct nbd_handle *h);
int nbd_aio_is_ready(struct nbd_handle *h);
int nbd_aio_is_connecting(struct nbd_handle *h);
int nbd_aio_is_processing(struct nbd_handle *h);
int nbd_aio_is_dead(struct nbd_handle *h);
int nbd_aio_is_closed(struct nbd_handle *h);

int64_t nbd_get_size(struct nbd_handle *h);
int64_t nbd_get_block_size(struct nbd_handle *h, int size_type);
int nbd_is_read_only(struct nbd_handle *h);
int nbd_can_flush(struct nbd_handle *h);
int nbd_can_fua(struct nbd_handle *h);
int nbd_can_trim(struct nbd_handle *h);
int nbd_can_zero(struct nbd_handle *h);
int nbd_can_fast_zero(struct nbd_handle *h);
int nbd_can_multi_conn(struct nbd_handle *h);
int nbd_get_structured_replies_negotiated(struct nbd_handle *h);

struct anbd_q *anbd_q_new(void);
void anbd_q_free(struct anbd_q *q);
unsigned anbd_reap(struct anbd_q *q, struct anbd_done *out, unsigned max);
int64_t anbd_pread(struct nbd_handle *h, struct anbd_q *q, void *buf, size_t count,
                   uint64_t offset, uint64_t id, uint32_t flags);
int64_t anbd_pwrite(struct nbd_handle *h, struct anbd_q *q, const void *buf, size_t count,
                    uint64_t offset, uint64_t id, uint32_t flags);
int64_t anbd_flush(struct nbd_handle *h, struct anbd_q *q, uint64_t id, uint32_t flags);
int64_t anbd_trim(struct nbd_handle *h, struct anbd_q *q, uint64_t count, uint64_t offset,
                  uint64_t id, uint32_t flags);
int64_t anbd_zero(struct nbd_handle *h, struct anbd_q *q, uint64_t count, uint64_t offset,
                  uint64_t id, uint32_t flags);

#define LIBNBD_SIZE_MINIMUM ...
#define LIBNBD_SIZE_PREFERRED ...
#define LIBNBD_SIZE_MAXIMUM ...
#define LIBNBD_CMD_FLAG_FUA ...
#define LIBNBD_CMD_FLAG_NO_HOLE ...
#define LIBNBD_AIO_DIRECTION_READ ...
#define LIBNBD_AIO_DIRECTION_WRITE ...
#define LIBNBD_ALLOW_TRANSPORT_TCP ...
#define LIBNBD_ALLOW_TRANSPORT_UNIX ...
#define LIBNBD_TLS_ALLOW ...
#define LIBNBD_SHUTDOWN_ABANDON_PENDING ...
"""

SOURCE = r"""
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <libnbd.h>

struct anbd_done { uint64_t id; int32_t error; };

/* the completions not yet reaped, in the order they came */
struct anbd_q { struct anbd_done *done; unsigned n, cap; };

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
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("aioublk.targets._nbd", SOURCE, libraries=["nbd"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
