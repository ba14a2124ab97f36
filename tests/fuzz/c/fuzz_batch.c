/*
 * UBLK_F_BATCH_IO's COMMIT_IO_CMDS as the data plane (aioublk/dataplane/csrc)
 * builds it and takes the kernel's answer to it. The encoding and the partial
 * commit's handling are static in its files, so this file includes them (one
 * translation unit) and stands in for the ring (ring.c): each SQE the data
 * plane prepares is decoded here as the kernel would (struct ublk_batch_io
 * and its elements), and the fuzz input chooses the kernel's answers: all of
 * it, part and a refused element, an error, ENODEV, or an SQ that cannot
 * take the command.
 *
 * Checked against a model: elem_bytes and flags as the setup asks (buffer
 * address in copy mode, zone LBA when zoned), nr_elem within the depth and
 * the length nr_elem * elem_bytes; each element the answer given for its
 * tag, in order, with the tag's buffer address or buffer index and zone
 * LBA; a partial commit sent again from the element after the refused one,
 * the refused one reported (EV_COMMIT) and a success failed with EIO in the
 * next commit; nothing answered is dropped; slots are reused.
 *
 * With the fetch side on (a bit of the first byte), tags come from the
 * multishot FETCH_IO_CMDS instead: the input plays the kernel's CQEs over
 * the queue's provided buffers, as it should (the ring's next buffer, tags
 * it holds, res their bytes) or not (any res, buffer id, flags, a tag
 * beyond the depth or one the data plane serves already), and the data
 * plane serves what it can (a null or linear map, the backend's SQEs
 * answered by the input too). Checked: what the data plane reads is what
 * the kernel wrote into one of its buffers, at most a buffer's worth; each
 * tag in range that C does not hold is handed over once, to C or to
 * Python (EV_TAG), in order, and the rest is counted (kernel_bad), never
 * served; the buffer goes back to the ring as it was provided; a CQE
 * without MORE comes back to Python (EV_FETCH) to re-arm.
 */
#include "setup.c"
#include "commands.c"
#include "serve.c"
#include "inflate.c"
#include "plugin.c"
#include "reap.c"
#include "uvhook.c"

#include "input.h"

#define MAXQ 2
#define MAXDEPTH 64
#define MAXIO 4096

/* -- the ring, stubbed: SQEs are decoded, never submitted -------------------- */

/* a COMMIT_IO_CMDS's elements, as the model expects them */
struct cm { unsigned nr; int slot; uint16_t tag[MAXDEPTH]; int32_t res[MAXDEPTH];
            uint64_t lba[MAXDEPTH]; };
struct sqe_seen { uint32_t op; struct ublk_batch_io cmd; uint64_t addr; uint32_t len; uint64_t ud; };

static struct {
    struct aur r;
    struct aur_dp *dp;
    struct aur_dp_setup s;
    int sq_full;             /* the next preps fail (the SQ has no room) */
    struct sqe_seen seen[256];
    unsigned nseen, used;
    /* the model: what each queue answered since its last commit was built */
    struct cm pend[MAXQ];
    struct cm held[MAXQ][MAXDEPTH];  /* built, not queued (the SQ was full): in order */
    unsigned nheld[MAXQ];
    struct cm fl[MAXQ][MAXDEPTH];    /* in flight, by slot (nr 0: none) */
    int owned[MAXQ][MAXDEPTH];       /* the tag's request waits for an answer */
    uint64_t lba[MAXQ][MAXDEPTH];
    int has_lba[MAXQ][MAXDEPTH];
    uint16_t q_id[MAXQ], buf_index[MAXQ][MAXDEPTH];
    char *bufs[MAXQ];
    struct aur_dp_counts counts[MAXQ];
    /* the fetch side: the model of what the kernel holds, C serves, and the
       kernel's head of each queue's buffer ring */
    int fetch, map;
    int kern[MAXQ][MAXDEPTH], cheld[MAXQ][MAXDEPTH];
    uint16_t khead[MAXQ];
    struct ublksrv_io_desc descs[MAXQ][MAXDEPTH];
    uint64_t rw[MAXQ * MAXDEPTH];    /* the backend's SQEs in flight (user_data) */
    unsigned nrw;
    uint64_t bad[MAXQ], handed[MAXQ], served[MAXQ];
} B;

#define MAP_NONE 0
#define MAP_NULL 1
#define MAP_LINEAR 2
#define BASE 1048576

/* The backend I/O of a request C serves under the linear map: checked
   against the tag's descriptor, kept until the input completes it. */
int aur_prep(struct aur *r, uint8_t opcode, int fd, uint64_t addr, uint32_t len,
             uint64_t off, uint32_t rw_flags, uint16_t buf_index, uint8_t flags,
             uint64_t user_data)
{
    unsigned local = DP_LOCAL(user_data), zc = B.s.mode == AUR_DP_AUTO_ZC;
    uint16_t tag = DP_TAG(user_data);
    const struct ublksrv_io_desc *d;
    int write;

    (void)r; (void)rw_flags;
    if (B.sq_full)
        return -EBUSY;
    FUZZ_CHECK(B.map == MAP_LINEAR && DP_KIND(user_data) == DP_K_RW && local < B.s.nr_queues &&
               tag < B.s.depth && B.cheld[local][tag] == 1, "backend I/O for (%u, %u)", local,
               tag);
    d = &B.descs[local][tag];
    write = (d->op_flags & 0xff) == UBLK_IO_OP_WRITE;
    FUZZ_CHECK(opcode == (zc ? (write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED)
                             : (write ? IORING_OP_WRITE : IORING_OP_READ)) && fd == 99 &&
               len == d->nr_sectors << 9 && off == BASE + (d->start_sector << 9) &&
               DP_AUX(user_data) == d->nr_sectors && !flags, "the backend I/O of (%u, %u)",
               local, tag);
    FUZZ_CHECK(zc ? addr == 0 && buf_index == B.buf_index[local][tag]
                  : addr == (uint64_t)(uintptr_t)(B.bufs[local] + (size_t)tag * MAXIO),
               "the buffer of (%u, %u)'s backend I/O", local, tag);
    B.rw[B.nrw++] = user_data;
    B.cheld[local][tag] = 2;  /* (its one piece is queued) */
    return 0;
}

int aur_prep_cmd(struct aur *r, int fd, uint32_t cmd_op, const void *cmd, unsigned cmd_len,
                 uint64_t addr, uint32_t len, uint32_t off, uint16_t buf_index, uint8_t flags,
                 uint64_t user_data)
{
    struct sqe_seen *q;

    (void)r; (void)fd; (void)off; (void)buf_index; (void)flags;
    if (B.sq_full)
        return -EBUSY;
    FUZZ_CHECK(cmd_len == sizeof(struct ublk_batch_io), "a command area of %u bytes", cmd_len);
    FUZZ_CHECK(B.nseen < 256, "too many commands queued");
    q = &B.seen[B.nseen++];
    q->op = cmd_op;
    memcpy(&q->cmd, cmd, sizeof(q->cmd));
    q->addr = addr;
    q->len = len;
    q->ud = user_data;
    return 0;
}

int aur_prep_ublk_io(struct aur *r, int fd, uint32_t cmd_op, uint16_t q_id, uint16_t tag,
                     int32_t result, uint64_t addr, uint64_t sqe_addr, uint8_t flags,
                     uint64_t user_data)
{
    (void)r; (void)fd; (void)cmd_op; (void)q_id; (void)tag; (void)result; (void)addr;
    (void)sqe_addr; (void)flags; (void)user_data;
    return -EBUSY;
}

int aur_fix_file(struct aur *r, int fd) { (void)r; (void)fd; return -1; }
void aur_unfix_files(struct aur *r, int keep_fd) { (void)r; (void)keep_fd; }
void *aur_buf_ring_setup(struct aur *r, unsigned entries, int bgid, int *err)
{
    struct io_uring_buf_ring *br;

    (void)r; (void)bgid;
    if (posix_memalign((void **)&br, 4096, entries * sizeof(struct io_uring_buf))) {
        *err = -ENOMEM;
        return NULL;
    }
    io_uring_buf_ring_init(br);
    return br;
}
int aur_buf_ring_free(struct aur *r, void *br, unsigned entries, int bgid)
{ (void)r; (void)br; (void)entries; (void)bgid; return 0; }

/* -- the kernel's side ------------------------------------------------------ */

static unsigned elem_bytes(void)
{
    return 8 + (B.s.mode == AUR_DP_COPY ? 8 : 0) + (B.s.zoned ? 8 : 0);
}

/* The next command the data plane queued: the commit m of queue `local`,
   decoded as the kernel would, checked, and put in flight under its slot. */
static void took(unsigned local, const struct cm *m)
{
    struct sqe_seen *q;
    struct ublk_batch_io *c;
    unsigned eb = elem_bytes(), k, slot, nr = m->nr;
    uint16_t flags = (B.s.mode == AUR_DP_COPY ? UBLK_BATCH_F_HAS_BUF_ADDR : 0) |
        (B.s.zoned ? UBLK_BATCH_F_HAS_ZONE_LBA : 0) |
        (B.s.mode == AUR_DP_AUTO_ZC && B.s.auto_zc_fallback ? UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK
                                                             : 0);
    const char *e;

    FUZZ_CHECK(B.used < B.nseen, "no COMMIT_IO_CMDS queued for %u answers", nr);
    q = &B.seen[B.used++];
    c = &q->cmd;
    e = (const char *)(uintptr_t)q->addr;
    FUZZ_CHECK(q->op == B.s.op_commit_io_cmds, "a command %#x, not COMMIT_IO_CMDS", q->op);
    FUZZ_CHECK(c->q_id == B.q_id[local], "q_id %u, not %u", c->q_id, B.q_id[local]);
    FUZZ_CHECK(c->flags == flags, "flags %#x, not %#x", c->flags, flags);
    FUZZ_CHECK(c->elem_bytes == eb, "elem_bytes %u, not %u", c->elem_bytes, eb);
    FUZZ_CHECK(c->nr_elem == nr && nr <= B.s.depth, "nr_elem %u, not %u (depth %u)",
               c->nr_elem, nr, B.s.depth);
    FUZZ_CHECK(q->len == nr * eb, "%u bytes of elements for %u", q->len, nr);
    FUZZ_CHECK(DP_KIND(q->ud) == DP_K_COMMIT && DP_LOCAL(q->ud) == local,
               "user_data %#llx", (unsigned long long)q->ud);
    slot = DP_TAG(q->ud);
    FUZZ_CHECK(slot < B.s.depth, "slot %u", slot);
    FUZZ_CHECK(m->slot < 0 || (unsigned)m->slot == slot, "resent from slot %u, not %d", slot,
               m->slot);
    FUZZ_CHECK(!B.fl[local][slot].nr, "slot %u in flight twice", slot);
    for (k = 0; k < nr; k++, e += eb) {
        struct ublk_elem_header h;
        uint64_t v;

        memcpy(&h, e, sizeof(h));
        FUZZ_CHECK(h.tag == m->tag[k] && h.result == m->res[k], "element %u is (%u, %d), not "
                   "(%u, %d)", k, h.tag, h.result, m->tag[k], m->res[k]);
        FUZZ_CHECK(h.buf_index == (B.s.mode == AUR_DP_AUTO_ZC ? B.buf_index[local][h.tag] : 0),
                   "element %u: buf_index %u", k, h.buf_index);
        if (B.s.mode == AUR_DP_COPY) {
            memcpy(&v, e + 8, 8);
            FUZZ_CHECK(v == (uint64_t)(uintptr_t)(B.bufs[local] + (size_t)h.tag * MAXIO),
                       "element %u: a buffer address not its tag's", k);
        }
        if (B.s.zoned) {
            memcpy(&v, e + eb - 8, 8);
            FUZZ_CHECK(v == m->lba[k], "element %u: zone LBA %llu, not %llu", k,
                       (unsigned long long)v, (unsigned long long)m->lba[k]);
        }
    }
    B.fl[local][slot] = *m;
    B.fl[local][slot].slot = (int)slot;
}

/* The kernel has the tag again (its commit was taken): it may hand it out. */
static void back(unsigned local, uint16_t tag)
{
    if (B.fetch)
        B.kern[local][tag] = 1;
    else
        B.owned[local][tag] = 1;
}

static void answer(unsigned local, uint16_t tag, int32_t res)
{
    struct cm *p = &B.pend[local];
    uint64_t lba = B.has_lba[local][tag] ? B.lba[local][tag] : 0;

    B.has_lba[local][tag] = 0;
    if (p->nr == B.s.depth) {  /* (a tag the kernel handed out twice: dropped) */
        FUZZ_CHECK(B.fetch, "more answers than the depth");
        B.bad[local]++;
        return;
    }
    p->tag[p->nr] = tag;
    p->res[p->nr] = res;
    p->lba[p->nr] = lba;
    p->nr++;
}

static void op_answer(struct in *in)
{
    unsigned local = in_u8(in) % B.s.nr_queues;
    uint16_t tag = in_u16(in) % B.s.depth;
    uint8_t how = in_u8(in);
    int32_t res = how & 1 ? -(int32_t)(in_u8(in) % 64) : (int32_t)(in_u16(in) % (MAXIO + 1));

    if (!B.owned[local][tag])
        return;  /* (only a request the kernel handed over is answered) */
    if (B.s.zoned && how & 2) {
        B.lba[local][tag] = in_u64(in);
        B.has_lba[local][tag] = 1;
        aur_dp_zone_lba(B.dp, local, tag, B.lba[local][tag]);
    }
    B.owned[local][tag] = 0;
    FUZZ_CHECK(aur_dp_answer(B.dp, local, tag, res) == 0, "aur_dp_answer failed");
    answer(local, tag, res);
}

/* aur_dp_flush: per queue, what the SQ refused before (in order), then what
   was answered since; with the SQ full, all of it held. */
static void op_flush(struct in *in)
{
    unsigned local, k, slot, used, full = in_u8(in) % 4 == 0;
    int ret, want = 0, busy[MAXQ] = { 0 };

    for (local = 0; local < B.s.nr_queues; local++) {
        /* (all slots in use: only with tags handed out twice) */
        for (slot = 0, used = B.nheld[local]; slot < B.s.depth; slot++)
            used += B.fl[local][slot].nr != 0;
        busy[local] = B.pend[local].nr && used == B.s.depth;
        if (busy[local] && !want)
            want = -EBUSY;
    }
    B.sq_full = (int)full;
    B.nseen = B.used = 0;
    ret = aur_dp_flush(B.dp);
    B.sq_full = 0;
    FUZZ_CHECK(ret == want, "aur_dp_flush: %d, not %d", ret, want);
    for (local = 0; local < B.s.nr_queues; local++) {
        if (busy[local]) {
            for (k = 0; !full && k < B.nheld[local]; k++)
                took(local, &B.held[local][k]);
            B.nheld[local] = full ? B.nheld[local] : 0;
            continue;  /* (its answers wait for a slot) */
        }
        if (full) {
            if (B.pend[local].nr) {
                B.held[local][B.nheld[local]++] = B.pend[local];
                B.held[local][B.nheld[local] - 1].slot = -1;
            }
        } else {
            for (k = 0; k < B.nheld[local]; k++)
                took(local, &B.held[local][k]);
            B.nheld[local] = 0;
            B.pend[local].slot = -1;  /* (a new commit: any free slot) */
            if (B.pend[local].nr)
                took(local, &B.pend[local]);
        }
        B.pend[local].nr = 0;
    }
    FUZZ_CHECK(B.used == B.nseen, "%u commands queued, the model says %u", B.nseen, B.used);
}

/* The kernel's answer to a commit in flight. */
static void op_complete(struct in *in)
{
    unsigned local = in_u8(in) % B.s.nr_queues, slot = in_u8(in) % B.s.depth;
    uint8_t how = in_u8(in);
    unsigned eb = elem_bytes(), nr, acc, k;
    char recs[16 * 8];
    struct dp_out o = { recs, 0 };
    struct cm m = B.fl[local][slot], rest;
    int32_t res;

    if (!m.nr)
        return;
    nr = m.nr;
    switch (how % 5) {
    case 0: res = (int32_t)(nr * eb); break;                     /* all of it */
    case 1: res = (int32_t)((in_u8(in) % nr) * eb); break;       /* up to a refused one */
    case 2: res = -EBUSY; break;                                 /* the first refused */
    case 3: res = -ENODEV; break;                                /* the device is gone */
    default: res = -(int32_t)(1 + in_u8(in) % 64); break;
    }
    B.fl[local][slot].nr = 0;
    B.sq_full = how & 8 ? 1 : 0;  /* a resend the SQ cannot take: held */
    B.nseen = B.used = 0;
    dp_commit_done(B.dp, &o, DP_UD(DP_K_COMMIT, local, slot, 0), res);
    B.sq_full = 0;
    acc = res == -ENODEV ? nr : res >= 0 ? (unsigned)res / eb : 0;
    for (k = 0; k < acc && k < nr; k++)
        back(local, m.tag[k]);
    if (acc >= nr) {
        FUZZ_CHECK(o.n == 0 && !B.nseen, "a commit taken whole: %u records, %u commands",
                   o.n, B.nseen);
        return;
    }
    {
        uint16_t t = m.tag[acc];
        int32_t r = m.res[acc], rr;
        uint64_t ud;

        FUZZ_CHECK(o.n == 1, "%u records for a refused element", o.n);
        memcpy(&ud, recs, 8);
        memcpy(&rr, recs + 8, 4);
        FUZZ_CHECK(DP_KIND(ud) == AUR_DP_EV_COMMIT && DP_TAG(ud) == t &&
                   DP_AUX(ud) == (r >= 0 ? 0u : 1u) && rr == (res < 0 ? res : 0),
                   "the refused element's record");
        if (r >= 0)
            answer(local, t, -EIO);  /* its request fails, in the next commit */
        else
            back(local, t);          /* (lost: the model lets the tag come again) */
    }
    if (acc + 1 >= nr) {
        FUZZ_CHECK(!B.nseen, "a commit queued with nothing left");
        return;
    }
    rest.nr = nr - acc - 1;
    rest.slot = (int)slot;
    for (k = 0; k < rest.nr; k++) {
        rest.tag[k] = m.tag[acc + 1 + k];
        rest.res[k] = m.res[acc + 1 + k];
        rest.lba[k] = m.lba[acc + 1 + k];
    }
    if (how & 8) {
        FUZZ_CHECK(!B.nseen, "a resend into a full SQ");
        B.held[local][B.nheld[local]++] = rest;
        return;
    }
    took(local, &rest);
}

/* -- the fetch side --------------------------------------------------------- */

/* Whether C serves the request of (local, tag) as its descriptor says:
   0 Python's, 1 done at once (null map), 2 held until its backend I/O. */
static int c_serves(unsigned local, uint16_t tag)
{
    const struct ublksrv_io_desc *d = &B.descs[local][tag];
    unsigned op = d->op_flags & 0xff, len = d->nr_sectors << 9;

    if (B.map == MAP_NONE || (op == UBLK_IO_OP_WRITE && d->op_flags & UBLK_IO_F_FUA))
        return 0;
    if (op > UBLK_IO_OP_WRITE || !len || len > MAXIO)
        return 0;
    return B.map == MAP_NULL ? 1 : B.sq_full ? 0 : 2;
}

/* A tag the data plane read from a fetch buffer, as the model expects it
   handled; its records go to want. */
static void fetched(unsigned local, uint16_t tag, struct dp_out *want)
{
    int how;

    if (tag >= B.s.depth || B.cheld[local][tag]) {
        B.bad[local]++;  /* never the kernel's to hand out: dropped */
        return;
    }
    B.kern[local][tag] = 0;
    B.handed[local]++;
    how = c_serves(local, tag);
    if (how == 1) {
        B.served[local]++;
        answer(local, tag, (int32_t)(B.descs[local][tag].nr_sectors << 9));
    } else if (how == 2) {
        B.cheld[local][tag] = 1;
    } else {
        B.owned[local][tag] = 1;
        dp_emit(want, DP_UD(AUR_DP_EV_TAG, local, tag, 0), 0, 0);
    }
}

/* The kernel puts a request in the tag's descriptor. */
static void describe(struct in *in, unsigned local, uint16_t tag)
{
    uint8_t b = in_u8(in);

    B.descs[local][tag] = (struct ublksrv_io_desc){
        .op_flags = (b & 3u) | (b & 4u ? UBLK_IO_F_FUA : 0), .nr_sectors = (b >> 3) % 10u,
        .start_sector = in_u8(in) };
}

/* A completion of the multishot FETCH_IO_CMDS of queue `local`. */
static void op_fetch(struct in *in)
{
    unsigned local = in_u8(in) % B.s.nr_queues, bytes = B.s.fetch_buf_bytes;
    unsigned ents = B.s.fetch_buf_entries, nt = 0, n, k, bid = 0, room = B.dp->room;
    uint8_t how = in_u8(in);
    struct dp_queue *q = &B.dp->q[local];
    struct io_uring_buf_ring *br = q->br;
    struct io_uring_cqe cqe = { .user_data = DP_UD(AUR_DP_EV_FETCH, local, 0, 0) };
    char *recs = malloc(16 * (size_t)room), *wrecs = malloc(16 * (size_t)room);
    struct dp_out o = { recs, 0 }, want = { wrecs, 0 };
    uint16_t tail = br->tail, *tags;

    if (how & 1 && (how & 64 || (!(how & 4) && tail == B.khead[local]))) {
        cqe.res = -ENOBUFS;  /* no buffer to pick: the fetch ends */
    } else if (how & 1) {
        if (how & 4) {
            bid = in_u16(in);  /* any buffer id */
        } else {  /* the ring's next buffer, filled with tags the kernel holds */
            struct io_uring_buf *b = &br->bufs[B.khead[local]++ & (ents - 1)];

            bid = b->bid;
            FUZZ_CHECK(bid < ents && b->len == bytes &&
                       b->addr == (uint64_t)(uintptr_t)(q->tags_mem + (size_t)bid * bytes),
                       "a fetch buffer not as provided: id %u, %u bytes", bid, b->len);
            tags = (uint16_t *)(uintptr_t)b->addr;
            for (n = in_u8(in) % (bytes / 2 + 1); nt < n; nt++) {
                uint16_t t = in_u16(in);

                if (in_u8(in) % 4) {  /* a tag the kernel holds (else any u16) */
                    for (k = 0; k < B.s.depth && !B.kern[local][(t + k) % B.s.depth]; k++)
                        ;
                    if (k == B.s.depth)
                        break;
                    t = (uint16_t)((t + k) % B.s.depth);
                    B.kern[local][t] = 0;
                    describe(in, local, t);
                }
                tags[nt] = t;
            }
        }
        cqe.res = (int32_t)(2 * nt + (how >> 4 & 1));  /* (odd: half a tag more) */
        cqe.flags = IORING_CQE_F_BUFFER | bid << 16;
    }
    if (how & 8)  /* any res */
        cqe.res = (int32_t)in_u32(in);
    else if (!(how & 1) && how & 16)
        cqe.res = -(int32_t)(in_u8(in) % 128);
    if (how & 2)
        cqe.flags |= IORING_CQE_F_MORE;
    /* the model: the tags in the buffer, as far as res and the buffer go */
    if (cqe.flags & IORING_CQE_F_BUFFER) {
        n = cqe.res > 0 ? (unsigned)cqe.res / 2 : 0;
        if (bid >= ents) {
            B.bad[local]++;
            n = 0;
        } else if (n > bytes / 2) {
            B.bad[local]++;
            n = bytes / 2;
        }
        tags = (uint16_t *)(q->tags_mem + (size_t)(bid < ents ? bid : 0) * bytes);
        B.sq_full = how >> 5 & 1;  /* C's backend I/O cannot be queued */
        for (k = 0; k < n; k++)
            fetched(local, tags[k], &want);
    }
    if (!(cqe.flags & IORING_CQE_F_MORE))
        dp_emit(&want, cqe.user_data, cqe.res, cqe.flags & ~IORING_CQE_F_BUFFER);
    FUZZ_CHECK(want.n <= room, "%u records for a CQE, room for %u", want.n, room);
    dp_cqe(B.dp, &o, &cqe);
    B.sq_full = 0;
    FUZZ_CHECK(o.n == want.n && !memcmp(recs, wrecs, 16 * (size_t)o.n),
               "%u records for the fetch, the model says %u", o.n, want.n);
    FUZZ_CHECK(B.counts[local].kernel_bad == B.bad[local] &&
               B.counts[local].started == B.handed[local] &&
               B.counts[local].c_served == B.served[local], "counts: %llu dropped, not %llu",
               (unsigned long long)B.counts[local].kernel_bad, (unsigned long long)B.bad[local]);
    /* the buffer back in the ring, as provided (none that is not one) */
    FUZZ_CHECK(br->tail == (uint16_t)(tail + (cqe.flags & IORING_CQE_F_BUFFER && bid < ents)),
               "the ring's tail");
    if (br->tail != tail) {
        struct io_uring_buf *b = &br->bufs[tail & (ents - 1)];

        FUZZ_CHECK(b->bid == bid && b->len == bytes &&
                   b->addr == (uint64_t)(uintptr_t)(q->tags_mem + (size_t)bid * bytes),
                   "buffer %u given back as %u", bid, b->bid);
    }
    free(recs);
    free(wrecs);
}

/* The backend's completion of a piece C queued: all of it, or not. */
static void op_rw_done(struct in *in)
{
    unsigned i = B.nrw ? in_u8(in) % B.nrw : 0, local;
    uint8_t how = in_u8(in);
    uint16_t tag;
    char recs[16 * 4];
    struct dp_out o = { recs, 0 };
    struct io_uring_cqe cqe = { .user_data = B.rw[i] };
    int32_t full;

    if (!B.nrw)
        return;
    B.rw[i] = B.rw[--B.nrw];
    local = DP_LOCAL(cqe.user_data);
    tag = DP_TAG(cqe.user_data);
    full = (int32_t)(DP_AUX(cqe.user_data) << 9);
    cqe.res = how % 3 == 0 ? -EIO : how % 3 == 1 ? full / 2 : full;
    dp_cqe(B.dp, &o, &cqe);
    B.cheld[local][tag] = 0;
    if (cqe.res == full) {
        FUZZ_CHECK(o.n == 0, "%u records for a request C completed", o.n);
        B.served[local]++;
        answer(local, tag, full);
    } else {
        uint64_t ud;
        int32_t res;

        memcpy(&ud, recs, 8);
        memcpy(&res, recs + 8, 4);
        FUZZ_CHECK(o.n == 1 && ud == DP_UD(AUR_DP_EV_RETRY, local, tag, 0) &&
                   res == (cqe.res < 0 ? cqe.res : -EIO), "a failed piece's record");
        B.owned[local][tag] = 1;  /* Python serves it from the start */
    }
    FUZZ_CHECK(B.counts[local].c_served == B.served[local], "c_served");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct in in = { data, size };
    uint8_t cfg = in_u8(&in);
    unsigned steps = 0, local, tag;
    int err;

    memset(&B, 0, sizeof(B));
    B.r.ring.cq.ring_entries = 4096;
    B.s.char_fd = -1;
    B.s.batch = 1;
    B.s.mode = cfg & 1 ? AUR_DP_AUTO_ZC : AUR_DP_COPY;
    B.s.auto_zc_fallback = cfg >> 1 & 1;
    B.s.zoned = cfg >> 2 & 1;
    B.s.nr_queues = 1 + (cfg >> 3 & 1);
    B.s.depth = 1 + in_u8(&in) % MAXDEPTH;
    B.s.max_io = MAXIO;
    B.s.op_commit_io_cmds = 0xc0107526;  /* (any value: it is passed through) */
    B.fetch = cfg >> 4 & 1;
    B.map = (cfg >> 5 & 3) % 3;
    B.s.fetch_buf_bytes = 2 * (B.fetch ? 1 + in_u8(&in) % B.s.depth : B.s.depth);
    B.s.fetch_buf_entries = B.fetch ? 1u << in_u8(&in) % 4 : 2;
    B.dp = aur_dp_new(&B.r, &B.s, &err);
    FUZZ_CHECK(B.dp, "aur_dp_new: %d", err);
    if (B.map == MAP_NULL)
        aur_dp_map_null(B.dp);
    else if (B.map == MAP_LINEAR)
        aur_dp_map_linear(B.dp, 99, BASE);
    for (local = 0; local < B.s.nr_queues; local++) {
        B.q_id[local] = (uint16_t)(in_u8(&in) + local);
        B.bufs[local] = malloc((size_t)B.s.depth * MAXIO);
        aur_dp_queue(B.dp, local, B.q_id[local], B.descs[local], B.bufs[local],
                     &B.counts[local]);
        for (tag = 0; tag < B.s.depth; tag++) {
            if (B.fetch)
                B.kern[local][tag] = 1;  /* the kernel hands it out */
            else
                B.owned[local][tag] = 1;  /* each tag fetched once */
            B.buf_index[local][tag] = (uint16_t)(tag * 3 + local + 1);
            aur_dp_buf_index(B.dp, local, (uint16_t)tag, B.buf_index[local][tag]);
        }
        if (B.fetch) {
            FUZZ_CHECK(aur_dp_provide(B.dp, local) == 0, "aur_dp_provide");
            memset(B.dp->q[local].tags_mem, 0xff,
                   (size_t)B.s.fetch_buf_entries * B.s.fetch_buf_bytes);
        }
    }
    while (in_more(&in) && steps++ < 3000) {
        switch (in_u8(&in) % (B.fetch ? 6 : 4)) {
        case 0: case 1: op_answer(&in); break;
        case 2: op_flush(&in); break;
        case 3: op_complete(&in); break;
        case 4: op_fetch(&in); break;
        case 5: op_rw_done(&in); break;
        }
    }
    for (local = 0; local < B.s.nr_queues; local++)
        B.dp->q[local].withdrawn = 1;  /* (no kernel holds the buffers) */
    aur_dp_free(B.dp);
    for (local = 0; local < B.s.nr_queues; local++)
        free(B.bufs[local]);
    return 0;
}
