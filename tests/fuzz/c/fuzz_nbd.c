/*
 * The nbd target's C transmission (aioublk/targets/csrc/nbd.c) against a
 * hostile server and an arbitrary order of the ring's completions.
 *
 * nbd.c is driven only through its public entry points: the plug-in table
 * of dp_ext.h (this file plays the data plane: one read and one send in
 * flight at a time, a read or send of a socket let go of cancelled, a tag
 * submitted again only after its done()), anbd_cmd and anbd_reap for
 * Python's commands, anbd_ext_plug for Python's connections. libnbd is
 * stubbed below: every handle is negotiated, plain and idle, so nbd.c
 * takes its socket (a descriptor of /dev/null: shutdown() on it fails
 * harmlessly). The bytes nbd.c "sends" are parsed here as an NBD server
 * would; the replies are built from them (well formed, to a cookie it
 * sent, or stale, or guessed), or are raw bytes, and delivered in pieces.
 *
 * Checked: done() once per submit, for a submitted tag only; a read
 * answered as complete has every byte of its buffer written by the
 * server's data or holes (buffers start as a canary), and, unless the
 * input forged replies, with the data of the bytes it asked for; each
 * request goes on the wire once, with its own header and its own data;
 * unplugging answers everything; Python's commands each answered once.
 * Buffers are freed the moment they are answered, so ASan sees any later use.
 *
 * FUZZ_NBD_WHOLE=1 in the environment: the server answers only requests it
 * has read whole, and never guesses a cookie (to look past the defects of
 * replies that race their request's send).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "nbd.h"
#include "input.h"

#define MAXQ 2
#define MAXD 8
#define MAXREC 1024
#define MAXSENT 1024
#define MAXSTREAM (4u << 20)
#define CANARY 0xA5
#define PY_ID0 1000
#define NREQ_MAGIC 0x25609513u

/* -- libnbd, stubbed: a plain, negotiated, idle handle ---------------------- */

static char handles[64];
static int devnull[2] = { -1, -1 };
static int structured;

static unsigned handle_no(struct nbd_handle *h) { return (unsigned)((char *)h - handles); }

int nbd_get_tls_negotiated(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_in_flight(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_is_ready(struct nbd_handle *h) { (void)h; return 1; }
int nbd_aio_is_dead(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_is_closed(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_get_fd(struct nbd_handle *h) { return devnull[handle_no(h) & 1]; }
unsigned nbd_aio_get_direction(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_notify_read(struct nbd_handle *h) { (void)h; return 0; }
int nbd_aio_notify_write(struct nbd_handle *h) { (void)h; return 0; }
int nbd_get_structured_replies_negotiated(struct nbd_handle *h) { (void)h; return structured; }
int nbd_get_extended_headers_negotiated(struct nbd_handle *h) { (void)h; return 0; }
const char *nbd_get_error(void) { return "stub"; }

/* libnbd's commands are refused (a handle C does not own): as libnbd does,
   the callback's free runs even so */
static int64_t refuse(nbd_completion_callback cb)
{
    if (cb.free)
        cb.free(cb.user_data);
    return -1;
}

int64_t nbd_aio_pread(struct nbd_handle *h, void *buf, size_t count, uint64_t offset,
                      nbd_completion_callback cb, uint32_t flags)
{ (void)h; (void)buf; (void)count; (void)offset; (void)flags; return refuse(cb); }
int64_t nbd_aio_pwrite(struct nbd_handle *h, const void *buf, size_t count, uint64_t offset,
                       nbd_completion_callback cb, uint32_t flags)
{ (void)h; (void)buf; (void)count; (void)offset; (void)flags; return refuse(cb); }
int64_t nbd_aio_flush(struct nbd_handle *h, nbd_completion_callback cb, uint32_t flags)
{ (void)h; (void)flags; return refuse(cb); }
int64_t nbd_aio_trim(struct nbd_handle *h, uint64_t count, uint64_t offset,
                     nbd_completion_callback cb, uint32_t flags)
{ (void)h; (void)count; (void)offset; (void)flags; return refuse(cb); }
int64_t nbd_aio_zero(struct nbd_handle *h, uint64_t count, uint64_t offset,
                     nbd_completion_callback cb, uint32_t flags)
{ (void)h; (void)count; (void)offset; (void)flags; return refuse(cb); }
int nbd_set_tls_hostname(struct nbd_handle *h, const char *hostname)
{ (void)h; (void)hostname; return -1; }

/* -- the requests, by serial (each one's offset carries it) ----------------- */

struct rec {
    uint8_t py, kind, on_wire, live;
    uint16_t local, tag;
    uint64_t off;
    uint32_t len;
    uint8_t *buf;          /* Python's: until reaped */
};

struct tagst { int busy; unsigned serial; };

/* what the server read: a request and the cookie it came with */
struct sent { uint64_t cookie; unsigned serial; int answered, whole; };
static int whole_only;

static struct {
    const struct aur_dp_ext *ops;
    struct anbd_ext *x;
    struct anbd_q *q;
    struct nbd_handle *h;   /* Python's connection */
    unsigned nh;            /* handles made */
    unsigned nq, depth;
    struct tagst tags[MAXQ][MAXD];
    uint8_t *tagbuf[MAXQ][MAXD];
    struct rec recs[MAXREC];
    unsigned nrec;
    int forged;             /* a reply not built for the cookie it names */
    /* the data plane's ring */
    int fd;
    unsigned gen, armed, polls;
    int reading, sending;
    unsigned rgen, sgen;
    struct iovec *iov;
    int niov;
    struct msghdr *msg;
    /* the server: what it read, and what it has to say */
    uint8_t hdr[28];
    unsigned have;
    uint32_t data_left, data_pos;
    unsigned data_serial;
    struct sent sent[MAXSENT];
    unsigned nsent;
    uint8_t *out;
    size_t out_len, out_pos, out_cap;
} S;

static struct aur_dp *const DP = (struct aur_dp *)&S;

/* what the disk holds at a byte: never 0 (a hole) nor the canary */
static uint8_t disk(uint64_t off)
{
    uint8_t v = (uint8_t)((off * 2654435761u) >> 13);

    return v == 0 ? 1 : v == CANARY ? CANARY + 1 : v;
}

/* what a write carries */
static uint8_t wpat(unsigned serial, uint32_t i) { return (uint8_t)(serial * 131u + i * 7u + 3u); }

static void check_read(const uint8_t *buf, uint32_t len, uint64_t off, const char *who)
{
    uint32_t i;

    for (i = 0; i < len; i++) {
        FUZZ_CHECK(buf[i] != CANARY, "%s at %#llx+%u answered as complete, byte %u never "
                   "written by the server's reply (stale)", who, (unsigned long long)off,
                   len, i);
        FUZZ_CHECK(S.forged || buf[i] == 0 || buf[i] == disk(off + i),
                   "%s at %#llx+%u: byte %u is not its data (%#x, not %#x): another "
                   "request's reply", who, (unsigned long long)off, len, i, buf[i],
                   disk(off + i));
    }
}

/* -- the data plane --------------------------------------------------------- */

/* dp_ext_watch: ask wants(), move to a new fd, post a read, a send or polls */
static void watch(void)
{
    int fd = -1;
    unsigned want = S.ops->wants(S.x, &fd), bit;

    FUZZ_CHECK(!(want & (AUR_EXT_IN | AUR_EXT_OUT)) || fd >= 0, "wants %#x without an fd",
               want);
    if (fd != S.fd) {
        S.armed = 0;
        S.polls = 0;
        S.gen++;
        S.fd = fd;
    }
    for (bit = AUR_EXT_IN; fd >= 0 && bit <= AUR_EXT_OUT; bit <<= 1) {
        if (!(want & bit) || (S.armed & bit))
            continue;
        if (bit == AUR_EXT_IN) {
            struct iovec *iov;
            int n;

            if (S.reading)
                continue;
            if ((n = S.ops->recv(S.x, &iov)) > 0) {
                FUZZ_CHECK(n <= 2 && iov, "recv gave %d buffers", n);
                S.iov = iov;
                S.niov = n;
                S.reading = 1;
                S.rgen = S.gen;
                S.armed |= bit;
                continue;
            }
        } else {
            struct msghdr *msg;

            if (S.sending)
                continue;
            if (S.ops->send(S.x, &msg) > 0) {
                FUZZ_CHECK(msg && msg->msg_iov && msg->msg_iovlen > 0 &&
                           msg->msg_iovlen <= 1024, "send gave a bad message");
                S.msg = msg;
                S.sending = 1;
                S.sgen = S.gen;
                S.armed |= bit;
                continue;
            }
        }
        S.armed |= bit;
        S.polls |= bit;
    }
}

static void done_cb(struct aur_dp *dp, unsigned local, uint16_t tag, int err)
{
    struct tagst *t;
    struct rec *r;

    FUZZ_CHECK(dp == DP, "done() for another data plane");
    FUZZ_CHECK(local < S.nq && tag < S.depth, "done() for (%u, %u), out of range", local, tag);
    t = &S.tags[local][tag];
    FUZZ_CHECK(t->busy, "done(%d) for (%u, %u): not submitted, or answered already", err,
               local, tag);
    FUZZ_CHECK(err <= 0, "done() with %d", err);
    r = &S.recs[t->serial];
    if (!err && r->kind == ANBD_READ)
        check_read(S.tagbuf[local][tag], r->len, r->off, "a read of the data plane's");
    r->live = 0;
    free(S.tagbuf[local][tag]);
    S.tagbuf[local][tag] = NULL;
    t->busy = 0;
}

static int kick_cb(struct aur_dp *dp)
{
    FUZZ_CHECK(dp == DP, "kick() for another data plane");
    watch();
    return 0;
}

/* -- the server -------------------------------------------------------------- */

static void say(const void *p, size_t n)
{
    if (!n || S.out_len + n > MAXSTREAM)
        return;
    if (S.out_len + n > S.out_cap) {
        size_t cap = S.out_cap ? S.out_cap : 4096;

        while (cap < S.out_len + n)
            cap *= 2;
        S.out = realloc(S.out, cap);
        if (!S.out)
            abort();
        S.out_cap = cap;
    }
    memcpy(S.out + S.out_len, p, n);
    S.out_len += n;
}

static void say32(uint32_t v) { uint8_t b[4] = { v >> 24, v >> 16, v >> 8, v }; say(b, 4); }
static void say16(uint16_t v) { uint8_t b[2] = { v >> 8, v }; say(b, 2); }
static void say64(uint64_t v) { say32((uint32_t)(v >> 32)); say32((uint32_t)v); }
static void say_disk(uint64_t off, uint32_t n)
{
    uint8_t b[512];
    uint32_t i, k;

    while (n) {
        k = n < sizeof(b) ? n : sizeof(b);
        for (i = 0; i < k; i++)
            b[i] = disk(off + i);
        say(b, k);
        off += k;
        n -= k;
    }
}

static uint64_t be64(const uint8_t *p)
{
    uint64_t v = 0;
    int i;

    for (i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* A byte nbd.c sent: the server reads requests, and checks each against
   what was submitted. */
static void server_read(uint8_t b)
{
    struct rec *r;
    uint32_t magic, len;
    uint16_t type;
    uint64_t off;
    unsigned serial;

    if (S.data_left) {
        FUZZ_CHECK(b == wpat(S.data_serial, S.data_pos), "write %u: byte %u on the wire is "
                   "%#x, not its data %#x", S.data_serial, S.data_pos, b,
                   wpat(S.data_serial, S.data_pos));
        S.data_pos++;
        if (!--S.data_left && S.nsent)
            S.sent[S.nsent - 1].whole = 1;
        return;
    }
    S.hdr[S.have++] = b;
    if (S.have < 28)
        return;
    S.have = 0;
    magic = (uint32_t)S.hdr[0] << 24 | S.hdr[1] << 16 | S.hdr[2] << 8 | S.hdr[3];
    type = (uint16_t)(S.hdr[6] << 8 | S.hdr[7]);
    off = be64(S.hdr + 16);
    len = (uint32_t)S.hdr[24] << 24 | S.hdr[25] << 16 | S.hdr[26] << 8 | S.hdr[27];
    FUZZ_CHECK(magic == NREQ_MAGIC, "a request with magic %#x", magic);
    serial = (unsigned)(off >> 24);
    FUZZ_CHECK(serial < S.nrec, "a request at %#llx: never submitted", (unsigned long long)off);
    r = &S.recs[serial];
    FUZZ_CHECK(r->off == off && r->kind == type && r->len == len,
               "request %u went out as type %u at %#llx+%u, not as submitted", serial, type,
               (unsigned long long)off, len);
    FUZZ_CHECK(!r->on_wire, "request %u (%s) went on the wire twice", serial,
               r->py ? "Python's" : "the data plane's");
    r->on_wire = 1;
    if (S.nsent < MAXSENT)
        S.sent[S.nsent++] = (struct sent){ be64(S.hdr + 8), serial, 0,
                                           type != ANBD_WRITE || !len };
    if (type == ANBD_WRITE && len) {
        S.data_left = len;
        S.data_pos = 0;
        S.data_serial = serial;
    }
}

/* the request a reply is for: one the server read, and its cookie */
static struct sent *pick(struct in *in, uint64_t *cookie)
{
    uint8_t how = in_u8(in), which = in_u8(in);
    struct sent *s = NULL;
    unsigned i, k;

    if (!S.nsent)
        return NULL;
    if (how & 1 || whole_only) {  /* the which-th not answered yet */
        for (i = 0, k = 0; i < S.nsent; i++)
            if ((!S.sent[i].answered || !(how & 1)) && (S.sent[i].whole || !whole_only) &&
                k++ == which % S.nsent) {
                s = &S.sent[i];
                break;
            }
    }
    if (!s && whole_only)
        return NULL;
    if (!s)
        s = &S.sent[which % S.nsent];
    *cookie = s->cookie;
    if (how & 2 && !whole_only) {  /* a guess: near a cookie seen */
        *cookie += (uint64_t)(int64_t)(int8_t)in_u8(in);
        S.forged = 1;
    }
    return s;
}

static const uint32_t errs[] = { 0, EIO, EINVAL, ENOSPC, EPERM, 12345 };

static void reply_simple(struct in *in)
{
    uint64_t cookie;
    struct sent *s = pick(in, &cookie);
    uint32_t err = errs[in_u8(in) % 6];
    struct rec *r;

    if (!s)
        return;
    r = &S.recs[s->serial];
    s->answered = 1;
    say32(0x67446698u);
    say32(err);
    say64(cookie);
    if (!err && r->kind == ANBD_READ)
        say_disk(r->off, r->len);
}

static void reply_chunk(struct in *in)
{
    uint64_t cookie;
    struct sent *s = pick(in, &cookie);
    uint8_t kind = in_u8(in), flags = in_u8(in);
    uint32_t start = in_u16(in), n = in_u16(in), len;
    uint16_t done = flags & 1;
    struct rec *r;

    if (!s)
        return;
    r = &S.recs[s->serial];
    len = r->len;
    if (!(flags & 2)) {  /* inside the request (else anywhere near it) */
        start = len ? start % (len + 1) : 0;
        n = flags & 4 ? len - start : n % (len - start + 1);
    }
    if (done)
        s->answered = 1;
    say32(0x668e33efu);
    say16(done);
    switch (kind % 4) {
    case 0:  /* NONE */
        say16(0);
        say64(cookie);
        say32(0);
        break;
    case 1:  /* OFFSET_DATA */
        say16(1);
        say64(cookie);
        say32(8 + n);
        say64(r->off + start);
        say_disk(r->off + start, n);
        break;
    case 2:  /* OFFSET_HOLE */
        say16(2);
        say64(cookie);
        say32(12);
        say64(r->off + start);
        say32(n);
        break;
    case 3:  /* ERROR */
        n %= 64;
        say16(0x8001);
        say64(cookie);
        say32(6 + n);
        say32(errs[start % 6]);
        say16((uint16_t)n);
        say_disk(0, n);
        break;
    }
}

static void reply_raw(struct in *in)
{
    uint8_t b[64];
    unsigned n = in_u8(in) % 65, i;

    if (whole_only)
        return;

    for (i = 0; i < n; i++) {
        b[i] = in_u8(in);
        if (b[i] == CANARY)  /* (the canary marks what no reply wrote) */
            b[i]--;
    }
    S.forged = 1;
    say(b, n);
}

/* -- the ring's completions ------------------------------------------------- */

static void complete_read(struct in *in)
{
    uint8_t how = in_u8(in);
    uint32_t want = in_u16(in) + 1u, n = 0;
    int i;

    if (!S.reading)
        return;
    if (S.rgen != S.gen) {  /* cancelled: the socket was shut down, nothing read */
        S.reading = 0;
        watch();
        return;
    }
    if (how % 8 == 0) {
        n = 0;  /* the server closed */
    } else if (how % 8 == 1) {
        S.reading = 0;
        S.armed &= ~AUR_EXT_IN;
        S.ops->received(S.x, how & 8 ? -ECONNRESET : -EAGAIN);
        watch();
        return;
    } else {
        size_t avail = S.out_len - S.out_pos;

        if (!avail)
            return;  /* (the read waits for bytes) */
        if (want > avail)
            want = (uint32_t)avail;
        for (i = 0; i < S.niov && n < want; i++) {
            uint32_t k = want - n < S.iov[i].iov_len ? want - n : (uint32_t)S.iov[i].iov_len;

            memcpy(S.iov[i].iov_base, S.out + S.out_pos + n, k);
            n += k;
        }
        S.out_pos += n;
        FUZZ_CHECK(n > 0, "recv gave buffers of no room");
    }
    S.reading = 0;
    S.armed &= ~AUR_EXT_IN;
    S.ops->received(S.x, (int)n);
    watch();
}

static void complete_send(struct in *in)
{
    uint8_t how = in_u8(in);
    uint32_t want = in_u16(in), total = 0, n = 0;
    size_t i;
    int res;

    if (!S.sending)
        return;
    S.sending = 0;
    if (S.sgen != S.gen) {  /* cancelled: shut down first, nothing sent */
        watch();
        return;
    }
    S.armed &= ~AUR_EXT_OUT;
    for (i = 0; i < S.msg->msg_iovlen; i++)
        total += (uint32_t)S.msg->msg_iov[i].iov_len;
    if (how % 8 == 0) {
        res = how & 8 ? -EPIPE : -EAGAIN;
    } else {
        want = how % 8 < 5 ? total : want % (total + 1);
        for (i = 0; i < S.msg->msg_iovlen && n < want; i++) {
            const uint8_t *p = S.msg->msg_iov[i].iov_base;
            uint32_t k = want - n < S.msg->msg_iov[i].iov_len ? want - n :
                (uint32_t)S.msg->msg_iov[i].iov_len, j;

            for (j = 0; j < k; j++)
                server_read(p[j]);
            n += k;
        }
        res = (int)n;
    }
    S.ops->sent(S.x, res);
    watch();
}

static void complete_poll(struct in *in)
{
    unsigned bit = in_u8(in) & 1 ? AUR_EXT_OUT : AUR_EXT_IN;

    if (!(S.polls & bit))
        return;
    S.polls &= ~bit;
    S.armed &= ~bit;
    S.ops->ready(S.x, bit == AUR_EXT_IN ? POLLIN : POLLOUT);
    watch();
}

/* -- the data plane's requests and Python's commands ------------------------ */

static unsigned new_rec(int py, unsigned kind, uint32_t len, uint8_t sub)
{
    unsigned serial = S.nrec++;
    struct rec *r = &S.recs[serial];

    memset(r, 0, sizeof(*r));
    r->py = (uint8_t)py;
    r->kind = (uint8_t)kind;
    r->len = len;
    r->off = (uint64_t)serial << 24 | (uint64_t)sub << 9;
    return serial;
}

static uint32_t pick_len(uint8_t b)
{
    return b & 0x80 ? (32u << 10) + (b & 0x7fu) * 256u : ((b & 0x7fu) + 1u) * 512u;
}

static void submit(struct in *in)
{
    unsigned local = in_u8(in) % S.nq, tag = in_u8(in) % S.depth, op = in_u8(in) & 1;
    uint32_t len = pick_len(in_u8(in)), i;
    uint8_t sub = in_u8(in);
    struct tagst *t = &S.tags[local][tag];
    unsigned serial;
    uint8_t *buf;
    int ret;

    if (t->busy || S.nrec == MAXREC)
        return;  /* (a tag comes again only once answered) */
    serial = new_rec(0, op == AUR_EXT_READ ? ANBD_READ : ANBD_WRITE, len, sub);
    buf = malloc(len);
    if (!buf)
        abort();
    for (i = 0; i < len; i++)
        buf[i] = op == AUR_EXT_READ ? CANARY : wpat(serial, i);
    S.recs[serial].local = (uint16_t)local;
    S.recs[serial].tag = (uint16_t)tag;
    S.recs[serial].live = 1;
    S.tagbuf[local][tag] = buf;
    t->busy = 1;
    t->serial = serial;
    ret = S.ops->submit(S.x, local, (uint16_t)tag, op, S.recs[serial].off, len, buf);
    if (ret < 0) {
        FUZZ_CHECK(t->busy && t->serial == serial, "done() for a submit refused (%d)", ret);
        t->busy = 0;
        S.recs[serial].live = 0;
        free(buf);
        S.tagbuf[local][tag] = NULL;
    }
    watch();
}

static const unsigned kinds[] = { ANBD_READ, ANBD_WRITE, ANBD_FLUSH, ANBD_TRIM, ANBD_ZERO };

static void py_cmd(struct in *in)
{
    unsigned kind = kinds[in_u8(in) % 5];
    uint32_t len = kind == ANBD_FLUSH ? 0 : pick_len(in_u8(in)), i;
    uint8_t sub = in_u8(in);
    unsigned serial;
    struct rec *r;
    int64_t ret;

    if (S.nrec == MAXREC)
        return;
    serial = new_rec(1, kind, len, sub);
    r = &S.recs[serial];
    if (kind == ANBD_READ || kind == ANBD_WRITE) {
        if (!(r->buf = malloc(len)))
            abort();
        for (i = 0; i < len; i++)
            r->buf[i] = kind == ANBD_READ ? CANARY : wpat(serial, i);
    }
    r->live = 1;
    ret = anbd_cmd(S.h, S.q, S.x, kind, r->buf, len, r->off, PY_ID0 + serial, 0);
    if (ret < 0) {
        r->live = 0;
        free(r->buf);
        r->buf = NULL;
        return;
    }
    FUZZ_CHECK(ret == PY_ID0 + serial, "anbd_cmd returned %lld", (long long)ret);
    anbd_ext_kick(S.x);  /* (Python kicks the plug-in after its commands) */
}

static void reap(void)
{
    struct anbd_done d[16];
    unsigned n, i;

    while ((n = anbd_reap(S.q, d, 16)) > 0)
        for (i = 0; i < n; i++) {
            uint64_t serial = d[i].id - PY_ID0;
            struct rec *r = &S.recs[serial];

            FUZZ_CHECK(d[i].id >= PY_ID0 && serial < S.nrec && r->py,
                       "an answer for %llu: no command of Python's",
                       (unsigned long long)d[i].id);
            FUZZ_CHECK(r->live, "Python's command %llu answered twice",
                       (unsigned long long)d[i].id);
            FUZZ_CHECK(d[i].error >= 0, "Python's command answered with %d", d[i].error);
            if (!d[i].error && r->kind == ANBD_READ)
                check_read(r->buf, r->len, r->off, "Python's read");
            r->live = 0;
            free(r->buf);
            r->buf = NULL;
        }
}

/* Python plugs a new connection in (a new server), or none */
static void plug(int none)
{
    unsigned i, j;

    if (none) {
        anbd_ext_plug(S.x, NULL);
        for (i = 0; i < S.nq; i++)
            for (j = 0; j < S.depth; j++)
                FUZZ_CHECK(!S.tags[i][j].busy, "(%u, %u) not answered once unplugged", i, j);
        reap();
        for (i = 0; i < S.nrec; i++)
            FUZZ_CHECK(!S.recs[i].live, "request %u not answered once unplugged", i);
        return;
    }
    S.h = (struct nbd_handle *)&handles[S.nh++ % sizeof(handles)];
    S.have = 0;
    S.data_left = 0;
    S.nsent = 0;
    S.out_len = S.out_pos = 0;
    anbd_ext_plug(S.x, S.h);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    unsetenv("AIOUBLK_NBD_LIBNBD");
    whole_only = getenv("FUZZ_NBD_WHOLE") && *getenv("FUZZ_NBD_WHOLE") == '1';
    devnull[0] = open("/dev/null", O_RDWR);
    devnull[1] = open("/dev/null", O_RDWR);
    return devnull[0] < 0 || devnull[1] < 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct in in = { data, size };
    uint8_t cfg = in_u8(&in);
    unsigned steps = 0;

    memset(&S, 0, sizeof(S));
    S.fd = -1;
    S.nq = 1 + (cfg & 1);
    S.depth = 1 + (cfg >> 1) % MAXD;
    structured = !(cfg & 0x80);
    S.ops = anbd_ext_ops();
    S.q = anbd_q_new();
    S.x = anbd_ext_new(0, S.q);
    if (!S.q || !S.x)
        abort();
    FUZZ_CHECK(S.ops->bind(S.x, DP, S.nq, S.depth, done_cb, kick_cb) == 0, "bind refused");
    watch();
    plug(0);
    while (in_more(&in) && steps++ < 2000) {
        switch (in_u8(&in) % 12) {
        case 0: submit(&in); break;
        case 1: S.ops->flush(S.x); watch(); break;
        case 2: complete_send(&in); break;
        case 3: complete_read(&in); break;
        case 4: reply_simple(&in); break;
        case 5: reply_chunk(&in); break;
        case 6: reply_raw(&in); break;
        case 7: py_cmd(&in); break;
        case 8: reap(); break;
        case 9: {
            uint8_t b = in_u8(&in);

            structured = !(b & 2);
            plug(b & 1);
            break;
        }
        case 10: complete_poll(&in); break;
        case 11: anbd_ext_kick(S.x); break;
        }
    }
    plug(1);
    anbd_ext_free(S.x);
    anbd_q_free(S.q);
    free(S.out);
    return 0;
}
