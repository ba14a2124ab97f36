/*
 * The data plane: one per worker, beside its ring.
 *
 * Why it exists: a request whose data has a known place (the target's map)
 * needs no decision, so it should cost no Python. Python pays per request a
 * task, closures, cffi views, dict lookups and a loop turn, all under one
 * GIL; C pays a descriptor read and an SQE. So C owns the hot loop: one call
 * (aur_dp_reap, the GIL released) reaps the ring, serves every request the
 * map resolves from fetch to commit, and copies out only what Python must
 * see: its own CQEs, requests the map does not take, failures.
 *
 * What C serves: READ and WRITE without FUA, in copy mode (data in the tag's
 * buffer), with automatic buffer registration (fixed-buffer I/O on the slot
 * the kernel registered), in -z mode (a linked chain, queued whole in one
 * submission: register the request's pages, the fixed-buffer pieces,
 * unregister; the request is done when the unregister is, so the commit
 * never overtakes it) and in -u mode
 * (two steps through the tag's buffer: a write's data is read from
 * /dev/ublkcN first, then written to the backend; a read's data is read
 * from the backend first, then written to /dev/ublkcN). The backend I/O is
 * a read or write of a file, or (AUR_MAP_NVME) one NVMe passthrough command
 * to a namespace's char device, whose success is a result of 0. Where
 * io_uring would only pass a file's I/O to an io-wq worker (no FMODE_NOWAIT:
 * tmpfs, ramfs, /dev/ublkcN's -u copies; aur_dp_setup.inline_io), C does it
 * with pread/pwrite in this thread and handles the result as that CQE on
 * the next pass: the same steps, without a thread switch per request. A read of
 * an extent table's ZERO granules needs none: in copy and -u mode C fills
 * those pieces of the tag's buffer with zeros itself (before -u's copy out),
 * and a read of zeros alone completes at once, as the null map does; the
 * zero-copy modes have no buffer to fill, so such a read is Python's. With
 * UBLK_F_NEED_GET_DATA (-g, per-I/O path, copy mode) a write's fetch
 * completes with UBLK_IO_RES_NEED_GET_DATA: C asks for the data with
 * UBLK_IO_NEED_GET_DATA on the tag's buffer, and that command's completion
 * is the request, served like any other by C or Python. Everything else
 * (flush, discard, zeroes, FUA, a map miss, a stopping worker, a request
 * whose data is in a --shmem_zc shared buffer) goes to Python as it
 * arrived. A backend result that is not the full piece (short, EINVAL from
 * O_DIRECT, EAGAIN, an error) sends the whole request to Python once every
 * piece of it has completed: C never answers anything but full success, and
 * a buffer is never handed back while a piece may still write it.
 *
 * user_data (AUR_DP_UD_* in dataplane.h): Python's operations count up
 * from 1 and never reach the mark bit; ours set it and carry a kind, the
 * queue's local index, the tag and aux (a piece's length in sectors, a
 * commit slot). The same layout marks the records handed to Python
 * (AUR_DP_EV_*).
 *
 * Counters (struct aur_dp_counts) live in memory Python owns, so the control
 * thread may read them while the worker closes.
 *
 * Latency (aur_dp_set_timing, off unless metrics asked for it): every
 * request is fetched and committed here, whichever side served it, so one
 * clock read at fetch and one at commit time both paths. Off, it costs a
 * test of a flag at fetch and of the tag's stamp at commit. The buckets are
 * plain counters another thread reads while they move: a read may be one
 * request behind, never more (64-bit loads do not tear on the targets we
 * build for).
 */

#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <poll.h>
#include <unistd.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <linux/nvme_ioctl.h>
#include <liburing.h>

#include "dataplane.h"
#include "extents.h"
#include "ring.h"
#include "ublk_cmd.h"

_Static_assert(sizeof(((struct aur_dp_counts *)0)->lat) ==
               AUR_LAT_OPS * AUR_LAT_BUCKETS * sizeof(uint64_t), "lat's shape");

#define DP_BIT (1ULL << AUR_DP_UD_MARK_SHIFT)
/* each field masked to its width: a value too large must never reach the
   next field (a piece's sectors spilling into the tag completes another
   request); aur_dp_new refuses a max_io whose sectors aux cannot hold */
#define DP_UD(kind, local, tag, aux) \
    (DP_BIT | (((uint64_t)(kind) & AUR_DP_UD_KIND_MASK) << AUR_DP_UD_KIND_SHIFT) | \
     (((uint64_t)(local) & AUR_DP_UD_LOCAL_MASK) << AUR_DP_UD_LOCAL_SHIFT) | \
     (((uint64_t)(tag) & AUR_DP_UD_TAG_MASK) << AUR_DP_UD_TAG_SHIFT) | \
     ((uint64_t)(aux) & AUR_DP_UD_AUX_MASK))
#define DP_KIND(ud) ((unsigned)((ud) >> AUR_DP_UD_KIND_SHIFT) & AUR_DP_UD_KIND_MASK)
#define DP_LOCAL(ud) ((unsigned)((ud) >> AUR_DP_UD_LOCAL_SHIFT) & AUR_DP_UD_LOCAL_MASK)
#define DP_TAG(ud) ((uint16_t)(((ud) >> AUR_DP_UD_TAG_SHIFT) & AUR_DP_UD_TAG_MASK))
#define DP_AUX(ud) ((unsigned)(ud) & AUR_DP_UD_AUX_MASK)

_Static_assert(AUR_DP_MAX_SECTORS == AUR_DP_UD_AUX_MASK, "a piece's sectors fill aux");

/* kinds of our own operations (EV_IO and EV_FETCH are also kinds) */
#define DP_K_RW 2
#define DP_K_COMMIT 4
#define DP_K_REG 5     /* -z: (un)registering a request's pages (aux 1: register) */
#define DP_K_UC 11     /* -u: the copy to or from /dev/ublkcN (aux: sectors) */
#define DP_K_LOOP 12   /* the poll on the worker loop's epoll fd (aur_dp_own_wait) */
#define DP_K_EXT 21    /* an external map's poll and its wake-ups (aux: see dp_ext) */

#define DP_MAX_PIECES AUR_DP_MAX_PIECES
/* fds whose inline_io answer a data plane remembers */
#define DP_FD_INLINE_MAX 64

/* -u: where a request's data is on /dev/ublkcN (64-bit: the queue id sits at bit 41) */
#define DP_USER_COPY_OFF(q, tag) \
    ((uint64_t)UBLKSRV_IO_BUF_OFFSET + \
     (((uint64_t)(q) << UBLK_QID_OFF) | ((uint64_t)(tag) << UBLK_TAG_OFF)))

struct dp_piece { int fd; uint32_t len; uint64_t host_off; uint32_t buf_off; };

struct dp_tag {
    uint8_t served;      /* C holds this request */
    uint16_t pending;    /* backend pieces not completed yet */
    uint16_t nr_ids;     /* extents held */
    uint16_t buf_index;  /* buffer-table slot (zero-copy modes) */
    uint8_t write;
    uint8_t then;        /* -u: the second step is still to come */
    uint16_t nr_pieces;  /* -u write: pieces kept for the second step */
    int32_t bad;         /* first piece that was not a full success */
    uint8_t lat_op;      /* timing: the op's histogram */
    uint32_t len;
    uint64_t t0;         /* timing: CLOCK_MONOTONIC ns at fetch; 0: not timed */
    int32_t held_res;    /* per-I/O: the answer waiting for an SQE (the queue's held) */
    uint16_t cqes;       /* CQEs reserved for its backend I/O (of aur_dp.cqes) */
    uint8_t has_lba;     /* zoned: the next commit carries zone_lba */
    uint64_t zone_lba;   /* zoned: where a zone append landed, in sectors */
    uint8_t fua;         /* nvme: the write carries the FUA bit */
    uint32_t *ids;       /* DP_MAX_PIECES extent ids */
    struct dp_piece *pieces;  /* -u: DP_MAX_PIECES */
    /* nvme: a discard's one range (context attributes, blocks, starting LBA,
       little-endian), which the controller reads until the command is done */
    uint32_t dsm[4];
};

/* A COMMIT_IO_CMDS's elements. Its buffer stays with the slot once the
   kernel is done with it, and the slot's next commit reuses it when it
   fits: no malloc and free per commit. One over DP_COMMIT_KEEP bytes is
   freed, so a queue keeps at most that per slot it ever had in flight. */
struct dp_commit {
    unsigned nr;         /* elements */
    unsigned cap;        /* bytes elems can hold */
    char elems[];
};

#define DP_COMMIT_KEEP 4096u

/* the most tags a fetch buffer holds (fetch_buf_bytes / 2) */
#define DP_FETCH_MAX 4096u

struct dp_queue {
    uint16_t q_id;
    const struct ublksrv_io_desc *descs;
    char *bufs;
    struct aur_dp_counts *counts;
    struct dp_tag *tags;
    /* batch */
    struct io_uring_buf_ring *br;
    char *tags_mem;
    int withdrawn;          /* br is no longer the kernel's (aur_dp_withdraw) */
    char *elems;            /* answered, for the next COMMIT_IO_CMDS */
    unsigned nr_elems;
    struct dp_commit **commits;  /* COMMIT_IO_CMDS by slot: in flight, or kept */
    uint16_t *free_slots;
    unsigned nr_free;
    /* answers the SQ could not take, sent again by the next flush: per-I/O
       tags (their COMMIT_AND_FETCH), batch commit slots (a COMMIT_IO_CMDS) */
    uint16_t *held;
    unsigned nr_held;
};

struct aur_dp {
    struct aur *r;
    struct aur_dp_setup s;
    unsigned elem_bytes, batch_flags, room;
    int map;
    int fds[DP_MAX_PIECES];
    unsigned nr_fds;
    uint64_t base, chunk;
    struct aur_ext *ext;
    unsigned ext_shift;
    int ext_slot;           /* its pool in ext (aur_ext_attach); -1: no allocation */
    uint32_t nsid;          /* AUR_MAP_NVME */
    unsigned lba_shift;
    unsigned nvme_flags;    /* AUR_NVME_* */
    int stopping, sealed, timing;
    unsigned inflight;
    unsigned served;        /* requests C took, ever (wraps) */
    unsigned completed;     /* requests C completed, ever (wraps) */
    /* CQEs C's backend I/O may have outstanding, and the most it may: the
       CQ less one per tag (its fetch or commit) and two fetches per queue */
    unsigned cqes, max_cqes;
    /* inline_io: the results of I/O C did itself, handled as the CQEs they
       stand for on the next pass (at most max_cqes: each holds a reserved
       CQE); and which fds that applies to, learnt once per fd (a map's fds
       live as long as the map) */
    struct dp_done { uint64_t ud; int32_t res; } *done;
    unsigned nr_done;
    struct dp_fd_inline { int fd; int on; } fd_inline[DP_FD_INLINE_MAX];
    unsigned nr_fd_inline;
    /* aur_dp_own_wait: the loop's hook, and the records C's wait kept for
       Python (out_cap of them at most), which its next reap takes first */
    struct dp_hook *hook;
    char *kept;
    unsigned nr_kept, out_cap;
    struct dp_ext *ext_map;  /* AUR_MAP_EXTERN */
    struct dp_queue q[];
};

static struct dp_tag *dp_tag(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    return &dp->q[local].tags[tag];
}

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

static uint64_t dp_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A request was fetched: stamp it, when timing. */
static void dp_clock_start(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    struct dp_queue *q = &dp->q[local];
    unsigned op;

    if (!dp->timing)
        return;
    op = ublksrv_get_op(&q->descs[tag]);
    q->tags[tag].lat_op = (uint8_t)(op < AUR_LAT_OPS - 1 ? op : AUR_LAT_OPS - 1);
    q->tags[tag].t0 = dp_now_ns();
}

/* Its answer: into the op's log2 bucket (once: a refused commit answers again). */
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

/* A new map: only /dev/ublkcN stays in the ring's file table, the map's
   own fds join it (an extent table's as C meets them). */
static void dp_new_map(struct aur_dp *dp, const int *fds, unsigned n)
{
    unsigned i;

    aur_unfix_files(dp->r, dp->s.char_fd);
    for (i = 0; i < n; i++)
        aur_fix_file(dp->r, fds[i]);
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

/* -- commands to the kernel ------------------------------------------------ */

static char *dp_buf(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    return dp->q[local].bufs + (size_t)tag * dp->s.max_io;
}

/* the buffer address the kernel copies to and from (copy mode only) */
static uint64_t dp_io_addr(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    if (dp->s.mode != AUR_DP_COPY || !dp->q[local].bufs)
        return 0;
    return (uint64_t)(uintptr_t)dp_buf(dp, local, tag);
}

static int dp_io_cmd(struct aur_dp *dp, unsigned local, uint16_t tag, uint32_t op, int32_t res)
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

static void dp_give_back(struct aur_dp *dp, struct dp_queue *q, unsigned bid, int offset)
{
    io_uring_buf_ring_add(q->br, q->tags_mem + (size_t)bid * dp->s.fetch_buf_bytes,
                          dp->s.fetch_buf_bytes, (unsigned short)bid,
                          io_uring_buf_ring_mask(dp->s.fetch_buf_entries), offset);
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
static void dp_send_commit(struct aur_dp *dp, unsigned local, struct dp_commit *c,
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

static void dp_ext_flush(struct aur_dp *dp);

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
static int dp_commit(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res)
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

/* -- serving ---------------------------------------------------------------- */

struct dp_out {
    char *buf;
    unsigned n;
};

static void dp_emit(struct dp_out *o, uint64_t ud, int32_t res, uint32_t flags)
{
    char *p = o->buf + 16 * o->n++;

    memcpy(p, &ud, 8);
    memcpy(p + 8, &res, 4);
    memcpy(p + 12, &flags, 4);
}

static void dp_idle_check(struct aur_dp *dp, struct dp_out *o)
{
    if (!dp->inflight && dp->stopping)
        dp_emit(o, DP_UD(AUR_DP_EV_IDLE, 0, 0, 0), 0, 0);
}

/* C's request is done with a full result. */
static void dp_complete(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag,
                        int32_t res)
{
    dp->inflight--;
    dp->completed++;
    dp_tag(dp, local, tag)->served = 0;
    if (dp->sealed) {
        dp_emit(o, DP_UD(AUR_DP_EV_LOST, local, tag, 0), res, 0);
    } else {
        dp->q[local].counts->c_served++;
        dp_commit(dp, local, tag, res);
    }
    dp_idle_check(dp, o);
}

static int dp_zero_copy(const struct aur_dp *dp)
{
    return dp->s.mode == AUR_DP_ZERO_COPY || dp->s.mode == AUR_DP_AUTO_ZC;
}

/* The pieces of [off, off+len) under the map; 0: not C's to serve. A piece
   with fd -1 is zeros (an extent table's ZERO granules): those need the
   tag's buffer, so in the zero-copy modes such a request is Python's. */
static unsigned dp_resolve(struct aur_dp *dp, struct dp_tag *t, uint64_t off, uint32_t len,
                           int write, struct dp_piece *p)
{
    struct aur_ext_piece ep[DP_MAX_PIECES];
    uint32_t pos = 0;
    unsigned n = 0, i;
    int got;

    switch (dp->map) {
    case AUR_MAP_LINEAR:
        p[0] = (struct dp_piece){ dp->fds[0], len, dp->base + off, 0 };
        return 1;
    case AUR_MAP_STRIPED:
        while (pos < len) {
            uint64_t dev = off + pos, idx = dev / dp->chunk, within = dev % dp->chunk;
            uint32_t l = (uint32_t)(dp->chunk - within);

            if (l > len - pos)
                l = len - pos;
            if (n == DP_MAX_PIECES)
                return 0;
            p[n++] = (struct dp_piece){ dp->fds[idx % dp->nr_fds], l,
                                        (idx / dp->nr_fds) * dp->chunk + within, pos };
            pos += l;
        }
        return n;
    case AUR_MAP_EXTENTS:
        got = aur_ext_acquire(dp->ext, off, len, write, dp->ext_slot, ep, DP_MAX_PIECES,
                              t->ids, DP_MAX_PIECES);
        if (got <= 0)
            return 0;
        t->nr_ids = (uint16_t)(((off + len - 1) >> dp->ext_shift) - (off >> dp->ext_shift) + 1);
        for (i = 0; i < (unsigned)got; i++) {
            if (ep[i].fd < 0 && dp_zero_copy(dp)) {
                aur_ext_release(dp->ext, t->ids, t->nr_ids, AUR_EXT_UNUSED);
                t->nr_ids = 0;
                return 0;
            }
            p[i] = (struct dp_piece){ ep[i].fd, ep[i].len, ep[i].host_off, pos };
            pos += ep[i].len;
        }
        return (unsigned)got;
    case AUR_MAP_NVME:  /* one command, in whole blocks, at most 2^16 of them */
        if (((off | len) & ((1u << dp->lba_shift) - 1)) || (len >> dp->lba_shift) > 65536)
            return 0;
        p[0] = (struct dp_piece){ dp->fds[0], len, off, 0 };
        return 1;
    }
    return 0;
}

/* A request C served is done with its backend: its extents and CQEs go back.
   outcome (AUR_EXT_DONE, FAILED or UNUSED) settles what its write allocated;
   the record that pushes is in the table before the caller commits, so the
   owner can see it before the guest sees the write complete. */
static void dp_release(struct aur_dp *dp, struct dp_tag *t, unsigned local, int outcome)
{
    dp->cqes -= t->cqes;
    t->cqes = 0;
    if (t->nr_ids) {
        dp->q[local].counts->c_alloc += aur_ext_release(dp->ext, t->ids, t->nr_ids, outcome);
        t->nr_ids = 0;
    }
}

/* -z: (un)register the request's pages at its buffer-table slot, counted as
   one more piece. The register is linked to the pieces (a failed one
   cancels them all: they would use a slot that holds nothing), the pieces
   hard-linked to the unregister (it runs whatever became of them). */
static int dp_zc_link(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                      int reg)
{
    int ret = aur_prep_ublk_io(dp->r, dp->s.char_fd,
                               reg ? dp->s.op_register_buf : dp->s.op_unregister_buf,
                               dp->q[local].q_id, tag, 0, t->buf_index, 0,
                               reg ? IOSQE_IO_LINK : 0, DP_UD(DP_K_REG, local, tag, reg));

    if (ret == 0)
        t->pending++;
    return ret;
}

/* A piece as one NVMe read or write: in the zero-copy modes the request's
   pages are the buffer-table slot (a kernel-registered buffer starts at
   address 0, so addr is the offset in it), else the tag's buffer. */
static int dp_nvme_rw(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                      const struct dp_piece *p, uint64_t ud)
{
    uint64_t lba = p->host_off >> dp->lba_shift;
    int zc = dp_zero_copy(dp);
    struct nvme_uring_cmd cmd = {
        .opcode = t->write ? 0x01 : 0x02,
        .nsid = dp->nsid,
        .addr = zc ? p->buf_off : (uint64_t)(uintptr_t)(dp_buf(dp, local, tag) + p->buf_off),
        .data_len = p->len,
        .cdw10 = (uint32_t)lba,
        .cdw11 = (uint32_t)(lba >> 32),
        .cdw12 = ((p->len >> dp->lba_shift) - 1) | (t->fua ? 1u << 30 : 0),
    };

    return aur_prep_cmd(dp->r, p->fd, NVME_URING_CMD_IO, &cmd, sizeof(cmd), 0, 0,
                        zc ? IORING_URING_CMD_FIXED : 0, zc ? t->buf_index : 0,
                        dp->s.mode == AUR_DP_ZERO_COPY ? IOSQE_IO_HARDLINK : 0, ud);
}

/* Does C move fd's pieces itself (AUR_DP_INLINE_RAM)? tmpfs and ramfs
   files never offer io_uring a nonblocking attempt. */
static int dp_inline_fd(struct aur_dp *dp, int fd)
{
    struct statfs sf;
    unsigned i;
    int on;

    if (!(dp->s.inline_io & AUR_DP_INLINE_RAM))
        return 0;
    for (i = 0; i < dp->nr_fd_inline; i++)
        if (dp->fd_inline[i].fd == fd)
            return dp->fd_inline[i].on;
    on = fstatfs(fd, &sf) == 0 &&
        ((unsigned long)sf.f_type == TMPFS_MAGIC || (unsigned long)sf.f_type == RAMFS_MAGIC);
    if (dp->nr_fd_inline < DP_FD_INLINE_MAX)  /* (past it: asked again each time) */
        dp->fd_inline[dp->nr_fd_inline++] = (struct dp_fd_inline){ fd, on };
    return on;
}

/* One transfer between buf and fd at off, now, in this thread; its result
   waits for the next pass as the CQE the ring would have given. */
static void dp_inline_rw(struct aur_dp *dp, int write, int fd, void *buf, uint32_t len,
                         uint64_t off, uint64_t ud)
{
    ssize_t got = write ? pwrite(fd, buf, len, (off_t)off) : pread(fd, buf, len, (off_t)off);

    dp->done[dp->nr_done++] = (struct dp_done){ ud, got < 0 ? -errno : (int32_t)got };
}

/* The backend I/O of pieces p[0..n), each one more pending piece; a piece
   the ring cannot take marks the request bad and stops there. */
static void dp_queue_pieces(struct aur_dp *dp, unsigned local, uint16_t tag,
                            const struct dp_piece *p, unsigned n)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    unsigned i;

    for (i = 0; i < n; i++) {
        uint64_t ud = DP_UD(DP_K_RW, local, tag, p[i].len >> 9);
        int op, ret;

        if (dp->map == AUR_MAP_EXTENTS)  /* (the table's fds live as long as the map) */
            aur_fix_file(dp->r, p[i].fd);
        if (dp->map == AUR_MAP_NVME) {
            ret = dp_nvme_rw(dp, t, local, tag, &p[i], ud);
        } else if (dp_zero_copy(dp)) {
            op = t->write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
            ret = aur_prep(dp->r, op, p[i].fd, p[i].buf_off, p[i].len, p[i].host_off, 0,
                           t->buf_index,
                           dp->s.mode == AUR_DP_ZERO_COPY ? IOSQE_IO_HARDLINK : 0, ud);
        } else if (dp_inline_fd(dp, p[i].fd)) {
            dp_inline_rw(dp, t->write, p[i].fd, dp_buf(dp, local, tag) + p[i].buf_off,
                         p[i].len, p[i].host_off, ud);
            ret = 0;
        } else {
            op = t->write ? IORING_OP_WRITE : IORING_OP_READ;
            ret = aur_prep(dp->r, op, p[i].fd,
                           (uint64_t)(uintptr_t)(dp_buf(dp, local, tag) + p[i].buf_off),
                           p[i].len, p[i].host_off, 0, 0, 0, ud);
        }
        if (ret < 0) {
            t->bad = ret;
            return;
        }
        t->pending++;
    }
}

/* -u: the request's data between the tag's buffer and /dev/ublkcN (in for a
   write, out for a read), one more pending piece. */
static int dp_uc_copy(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    char *buf = dp_buf(dp, local, tag);
    uint64_t off = DP_USER_COPY_OFF(dp->q[local].q_id, tag);
    uint64_t ud = DP_UD(DP_K_UC, local, tag, t->len >> 9);
    int ret = 0;

    if (dp->s.inline_io & AUR_DP_INLINE_CHAR)  /* (a write's data comes in: a read) */
        dp_inline_rw(dp, !t->write, dp->s.char_fd, buf, t->len, off, ud);
    else
        ret = aur_prep(dp->r, t->write ? IORING_OP_READ : IORING_OP_WRITE, dp->s.char_fd,
                       (uint64_t)(uintptr_t)buf, t->len, off, 0, 0, 0, ud);
    if (ret == 0)
        t->pending++;
    return ret;
}

/* Room in the SQ for n more SQEs, submitting what is queued if need be. A
   linked chain must reach the kernel in one submission (io_uring does not
   carry a link across two: the rest would run unordered, an unregister
   before its register), so one is started only when all of it fits. */
static int dp_sq_room(struct aur_dp *dp, unsigned n)
{
    struct io_uring *ring = &dp->r->ring;

    if (io_uring_sq_space_left(ring) >= n)
        return 1;
    io_uring_submit(ring);
    return io_uring_sq_space_left(ring) >= n;
}

/* Zero pieces (copy and -u modes only, see dp_resolve): how many of p[0..n). */
static unsigned dp_nr_zero(const struct dp_piece *p, unsigned n)
{
    unsigned i, z = 0;

    for (i = 0; i < n; i++)
        z += p[i].fd < 0;
    return z;
}

/* Zeros into the tag's buffer where p's zero pieces say, now: they need no
   backend I/O. The other pieces are moved to the front; returns how many. */
static unsigned dp_fill_zeros(struct aur_dp *dp, unsigned local, uint16_t tag,
                              struct dp_piece *p, unsigned n)
{
    char *buf = dp_buf(dp, local, tag);
    unsigned i, k = 0;

    for (i = 0; i < n; i++) {
        if (p[i].fd < 0)
            memset(buf + p[i].buf_off, 0, p[i].len);
        else
            p[k++] = p[i];
    }
    return k;
}

/* -- an external map (dp_ext.h) ------------------------------------------------
 *
 * A plug-in in another extension moves the data (the nbd target: libnbd on
 * a socket). C hands it each READ and WRITE the way it would queue backend
 * pieces: the request holds one reserved CQE, and the plug-in's answer
 * (dp_ext_done) waits in dp->done as the CQE it stands for, handled by
 * dp_rw_done once the call that produced it has returned: success
 * commits, anything else is Python's from the start. So an answer that comes while the plug-in is
 * being called, even from Python (closing its connection fails what is in
 * flight), is never handled inside that call.
 *
 * The plug-in's fd is watched on this ring: one-shot polls for what it
 * wants (readable, writable), re-armed after each completion, their
 * user_data DP_UD(DP_K_EXT, 0, 0, gen << 3 | what). When the fd changes (a
 * new connection, or none) the polls of the old one are removed and gen
 * moves on, so a late completion of theirs is ignored: a poll holds its
 * file, and a socket the plug-in closed would stay open under it. When the
 * plug-in asks for Python (AUR_EXT_PY) outside a CQE's handling, a NOP
 * (what DP_EXT_NOP) brings the record on the next pass, so no CQE ever
 * makes more records than dp->room allows.
 */
#define DP_EXT_NOP 4
#define DP_EXT_RECV 5
#define DP_EXT_SEND 6
#define DP_EXT_GEN_MASK 0x1fff
/* CQEs kept for the plug-in's own: two polls, a NOP, removes and the
   polls of an old fd completing late */
#define DP_EXT_CQES 16

_Static_assert(AUR_EXT_READ == UBLK_IO_OP_READ && AUR_EXT_WRITE == UBLK_IO_OP_WRITE,
               "dp_ext.h's ops are ublk's");

struct dp_ext {
    const struct aur_dp_ext *ops;
    void *ctx;
    int fd;            /* what the polls in flight watch; -1: none */
    unsigned gen;      /* fd's generation */
    unsigned armed;    /* AUR_EXT_IN, AUR_EXT_OUT: its polls in flight */
    int nop;           /* a NOP is in flight */
    int reading;       /* a READV is in flight (of fd, or of an fd let go of) */
    int sending;       /* a SENDMSG is in flight (the same) */
    int py;            /* Python is to be told (by the NOP's completion) */
};

static uint64_t dp_ext_ud(unsigned gen, unsigned what)
{
    return DP_UD(DP_K_EXT, 0, 0, (gen & DP_EXT_GEN_MASK) << 3 | what);
}

/* Ask the plug-in what it wants, and make the polls say it: o, a CQE's
   records (NULL: none may be added now). Returns 1 if SQEs were queued. */
static int dp_ext_watch(struct aur_dp *dp, struct dp_out *o)
{
    struct dp_ext *e = dp->ext_map;
    unsigned want, bit;
    int fd = -1, queued = 0;

    want = e->ops->wants(e->ctx, &fd);
    if (fd != e->fd) {
        for (bit = AUR_EXT_IN; bit <= AUR_EXT_OUT; bit <<= 1) {
            /* (a bit's is a READV or SENDMSG while one is in flight) */
            unsigned what = bit == AUR_EXT_IN && e->reading ? DP_EXT_RECV :
                bit == AUR_EXT_OUT && e->sending ? DP_EXT_SEND : bit;

            if ((e->armed & bit) && aur_prep(dp->r, IORING_OP_ASYNC_CANCEL, -1,
                                             dp_ext_ud(e->gen, what), 0, 0, 0, 0, 0,
                                             dp_ext_ud(e->gen, 0)) == 0)
                queued = 1;
        }
        e->armed = 0;
        e->gen = (e->gen + 1) & DP_EXT_GEN_MASK;
        e->fd = fd;
    }
    for (bit = AUR_EXT_IN; fd >= 0 && bit <= AUR_EXT_OUT; bit <<= 1) {
        if (!(want & bit) || (e->armed & bit))
            continue;
        if (bit == AUR_EXT_IN && e->ops->recv) {
            struct iovec *iov;
            int n;

            if (e->reading)
                continue;  /* (an old fd's read still has the buffers) */
            if ((n = e->ops->recv(e->ctx, &iov)) > 0) {
                if (aur_prep(dp->r, IORING_OP_READV, fd, (uintptr_t)iov, (uint32_t)n, 0, 0,
                             0, 0, dp_ext_ud(e->gen, DP_EXT_RECV)) == 0) {
                    e->armed |= bit;
                    e->reading = 1;
                    queued = 1;
                }
                continue;
            }
        }
        if (bit == AUR_EXT_OUT && e->ops->send) {
            struct msghdr *msg;

            if (e->sending)
                continue;
            /* MSG_WAITALL: what the socket cannot take at once the ring
               sends as it drains, with no CQE (and pass) per part */
            if (e->ops->send(e->ctx, &msg) > 0) {
                if (aur_prep(dp->r, IORING_OP_SENDMSG, fd, (uintptr_t)msg, 1, 0,
                             MSG_NOSIGNAL | MSG_WAITALL,
                             0, 0, dp_ext_ud(e->gen, DP_EXT_SEND)) == 0) {
                    e->armed |= bit;
                    e->sending = 1;
                    queued = 1;
                }
                continue;
            }
        }
        if (aur_prep(dp->r, IORING_OP_POLL_ADD, fd, 0, 0, 0,
                     bit == AUR_EXT_IN ? POLLIN : POLLOUT, 0, 0, dp_ext_ud(e->gen, bit)) == 0) {
            e->armed |= bit;
            queued = 1;
        }
    }
    if (want & AUR_EXT_PY)
        e->py = 1;
    if (e->py) {
        if (o) {
            dp_emit(o, DP_UD(AUR_DP_EV_EXT, 0, 0, 0), 0, 0);
            e->py = 0;
        } else if (!e->nop && aur_prep(dp->r, IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0,
                                       dp_ext_ud(e->gen, DP_EXT_NOP)) == 0) {
            e->nop = 1;
            queued = 1;
        }
    }
    return queued;
}

/* The pass handed the plug-in what it had: it sends it (and says what it
   waits for: a socket that took only part). */
static void dp_ext_flush(struct aur_dp *dp)
{
    struct dp_ext *e = dp->ext_map;

    if (e && e->ops->flush) {
        e->ops->flush(e->ctx);
        dp_ext_watch(dp, NULL);
    }
}

/* The plug-in's answer to (local, tag): the CQE it stands for, next pass. */
static void dp_ext_done(struct aur_dp *dp, unsigned local, uint16_t tag, int err)
{
    struct dp_tag *t;

    if (local >= dp->s.nr_queues || tag >= dp->s.depth)
        return;
    t = dp_tag(dp, local, tag);
    if (!t->served || t->pending != 1 || dp->nr_done > dp->max_cqes)
        return;  /* (not one it was given: never) */
    dp->done[dp->nr_done++] = (struct dp_done){ DP_UD(DP_K_RW, local, tag, t->len >> 9),
                                                err ? err : (int32_t)t->len };
}

static int dp_ext_kick(struct aur_dp *dp)
{
    uint64_t one = 1;
    int queued;

    if (!dp->ext_map)
        return 0;
    queued = dp_ext_watch(dp, NULL);
    if (dp->nr_done && write(dp->r->efd, &one, sizeof(one)) < 0) {
        /* the count is full: a wake-up is pending anyway */
    }
    return queued || dp->nr_done;
}


int aur_dp_map_extern(struct aur_dp *dp, const struct aur_dp_ext *ops, void *ctx)
{
    struct dp_ext *e;
    int ret;

    if (dp->ext_map)
        return -EBUSY;
    if (!ops || dp->max_cqes < 2 * DP_EXT_CQES)
        return -EINVAL;
    if (dp->s.mode != AUR_DP_COPY)  /* (the data must be in the tag's buffer) */
        return 0;  /* never bound: the plug-in's owner serves everything */
    if (!dp->done && !(dp->done = malloc((dp->max_cqes + 1) * sizeof(*dp->done))))
        return -ENOMEM;
    if (!(e = calloc(1, sizeof(*e))))
        return -ENOMEM;
    e->ops = ops;
    e->ctx = ctx;
    e->fd = -1;
    ret = ops->bind(ctx, dp, dp->s.nr_queues, dp->s.depth, dp_ext_done, dp_ext_kick);
    if (ret < 0) {
        free(e);
        return ret;
    }
    dp_new_map(dp, NULL, 0);  /* (the plug-in's fd changes with its connections) */
    dp->max_cqes -= DP_EXT_CQES;
    dp->ext_map = e;
    dp->map = AUR_MAP_EXTERN;
    dp_ext_watch(dp, NULL);
    return 0;
}

/* dp_serve's step for AUR_MAP_EXTERN: 1 if the plug-in took the request. */
static int dp_ext_serve(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                        unsigned op, uint64_t off, uint32_t len)
{
    struct dp_ext *e = dp->ext_map;
    int ret;

    /* one CQE held for its answer */
    if (!dp->q[local].bufs || dp->cqes + 1 > dp->max_cqes)
        return 0;
    t->pending = 1;
    t->cqes = 1;
    t->served = 1;
    ret = e->ops->submit(e->ctx, local, tag, op, off, len, dp_buf(dp, local, tag));
    if (ret == 0) {
        dp->cqes++;
        dp->served++;
        dp->inflight++;
    } else {
        t->pending = 0;
        t->cqes = 0;
        t->served = 0;
    }
    dp_ext_watch(dp, NULL);
    return ret == 0;
}

static void dp_ext_cqe(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res)
{
    struct dp_ext *e = dp->ext_map;
    unsigned what = DP_AUX(ud) & 7, gen = DP_AUX(ud) >> 3;

    if (!e)
        return;
    if (what == DP_EXT_NOP) {
        e->nop = 0;
    } else if (what == DP_EXT_RECV) {
        e->reading = 0;  /* the buffers are the plug-in's again */
        if (gen == e->gen) {
            e->armed &= ~AUR_EXT_IN;
            e->ops->received(e->ctx, res);
        }
    } else if (what == DP_EXT_SEND) {
        e->sending = 0;
        if (gen == e->gen) {
            e->armed &= ~AUR_EXT_OUT;
            e->ops->sent(e->ctx, res);
        }
    } else if (what == AUR_EXT_IN || what == AUR_EXT_OUT) {
        if (gen != e->gen)
            return;  /* a poll of an fd no longer watched */
        e->armed &= ~what;
        e->ops->ready(e->ctx, res);
    } else {
        return;  /* a remove's answer */
    }
    dp_ext_watch(dp, o);
}

/* A request C takes on: its tag's state from scratch. */
static void dp_tag_start(struct dp_tag *t, uint32_t len, int write, int fua)
{
    t->bad = 0;
    t->len = len;
    t->write = (uint8_t)write;
    t->fua = (uint8_t)fua;
    t->then = 0;
    t->nr_ids = 0;
    t->pending = 0;
    t->cqes = 0;
}

/* nvme: a flush, discard or write zeroes as the one command that does it
   (a flush without a volatile cache has nothing to do); 1 if C serves it,
   0 if it is Python's (not in whole blocks, too long for one command, the
   CQ or SQ full). */
static int dp_nvme_other(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag,
                         unsigned op, uint64_t off, uint32_t len, uint32_t op_flags)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    uint64_t lba = off >> dp->lba_shift, nlb = len >> dp->lba_shift;
    struct nvme_uring_cmd cmd = { .nsid = dp->nsid };

    if (op == UBLK_IO_OP_FLUSH) {
        cmd.opcode = 0x00;
    } else if (!nlb || ((off | len) & ((1u << dp->lba_shift) - 1))) {
        return 0;
    } else if (op == UBLK_IO_OP_DISCARD) {  /* dataset management, deallocate */
        t->dsm[0] = 0;
        t->dsm[1] = htole32((uint32_t)nlb);
        t->dsm[2] = htole32((uint32_t)lba);
        t->dsm[3] = htole32((uint32_t)(lba >> 32));
        cmd.opcode = 0x09;
        cmd.addr = (uint64_t)(uintptr_t)t->dsm;
        cmd.data_len = sizeof(t->dsm);
        cmd.cdw10 = 0;        /* one range */
        cmd.cdw11 = 1u << 2;  /* AD */
    } else if (op == UBLK_IO_OP_WRITE_ZEROES && nlb <= 65536) {
        cmd.opcode = 0x08;
        cmd.cdw10 = (uint32_t)lba;
        cmd.cdw11 = (uint32_t)(lba >> 32);
        cmd.cdw12 = (uint32_t)(nlb - 1) |
            (op_flags & UBLK_IO_F_NOUNMAP ? 0 : 1u << 25);  /* DEAC */
    } else {
        return 0;
    }
    if (op == UBLK_IO_OP_FLUSH && !(dp->nvme_flags & AUR_NVME_VWC)) {
        dp_tag_start(t, 0, 0, 0);
        dp->served++;
        dp->inflight++;
        t->served = 1;
        dp_complete(dp, o, local, tag, 0);
        return 1;
    }
    if (dp->cqes + 1 > dp->max_cqes)
        return 0;
    dp_tag_start(t, 0, 0, 0);  /* (its result is 0: only reads and writes count bytes) */
    if (aur_prep_cmd(dp->r, dp->fds[0], NVME_URING_CMD_IO, &cmd, sizeof(cmd), 0, 0, 0, 0, 0,
                     DP_UD(DP_K_RW, local, tag, 0)) < 0)
        return 0;
    t->cqes = 1;
    dp->cqes++;
    t->pending = 1;
    dp->served++;
    dp->inflight++;
    t->served = 1;
    return 1;
}

/* A fetched request: 1 if C serves it, 0 if it is Python's. */
static int dp_serve(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag)
{
    struct dp_queue *q = &dp->q[local];
    const struct ublksrv_io_desc *d = &q->descs[tag];
    struct dp_tag *t = &q->tags[tag];
    struct dp_piece p[DP_MAX_PIECES];
    unsigned op = ublksrv_get_op(d), n, nz, need;
    uint64_t off = d->start_sector << 9;
    uint32_t len = d->nr_sectors << 9;
    int write = op == UBLK_IO_OP_WRITE, uc = dp->s.mode == AUR_DP_USER_COPY;
    int fua = write && (d->op_flags & UBLK_IO_F_FUA);

    if (dp->map == AUR_MAP_NONE || dp->stopping)
        return 0;
    if (dp->map == AUR_MAP_NVME) {
        if (op == UBLK_IO_OP_FLUSH || op == UBLK_IO_OP_DISCARD ||
            op == UBLK_IO_OP_WRITE_ZEROES)
            return dp_nvme_other(dp, o, local, tag, op, off, len, d->op_flags);
        if (!(dp->nvme_flags & AUR_NVME_VWC))
            fua = 0;  /* every write is durable when it completes */
        else if (fua && !(dp->nvme_flags & AUR_NVME_FUA))
            return 0;  /* a write and a flush: Python's */
    } else if (fua) {
        return 0;
    }
    if (op > UBLK_IO_OP_WRITE || !len)
        return 0;
    if (dp->s.mode == AUR_DP_AUTO_ZC && (d->op_flags & UBLK_IO_F_NEED_REG_BUF))
        return 0;
    if (len > dp->s.max_io)  /* (never from the kernel: its buffer, its encoding) */
        return 0;
    dp_tag_start(t, len, write, fua);
    if (dp->map == AUR_MAP_NULL) {
        dp->served++;
        dp->inflight++;
        t->served = 1;
        dp_complete(dp, o, local, tag, (int32_t)len);
        return 1;
    }
    /* --shmem_zc: the data is in a shared buffer, not where the mode puts it;
       Python serves it there (null, above, has no data to move) */
    if (d->op_flags & UBLK_IO_F_SHMEM_ZC)
        return 0;
    if (dp->map == AUR_MAP_EXTERN)
        return dp_ext_serve(dp, t, local, tag, op, off, len);
    n = dp_resolve(dp, t, off, len, write, p);
    if (!n)
        return 0;
    nz = dp_nr_zero(p, n);  /* (only in a read, in copy or -u mode) */
    /* its CQEs at most: the pieces, -z's register and unregister, -u's copy */
    need = n - nz + (dp->s.mode == AUR_DP_ZERO_COPY ? 2 : 0) + (unsigned)uc;
    if (dp->cqes + need > dp->max_cqes ||  /* the CQ could overflow */
        (dp->s.mode == AUR_DP_ZERO_COPY && !dp_sq_room(dp, need))) {  /* a chain, whole */
        dp_release(dp, t, local, AUR_EXT_UNUSED);
        return 0;
    }
    t->cqes = (uint16_t)need;
    dp->cqes += need;
    dp->served++;
    dp->inflight++;
    t->served = 1;
    if (nz)
        n = dp_fill_zeros(dp, local, tag, p, n);
    if (!n && !uc) {  /* zeros only, in the buffer already: done, as the null map */
        dp_release(dp, t, local, AUR_EXT_DONE);
        dp_complete(dp, o, local, tag, (int32_t)len);
        return 1;
    }
    if (!n) {  /* -u, zeros only: just the copy out */
        if (dp_uc_copy(dp, local, tag) < 0)
            t->bad = -EBUSY;
    } else if (uc && write) {  /* the data first; the pieces when it is in */
        memcpy(t->pieces, p, n * sizeof(*p));
        t->nr_pieces = (uint16_t)n;
        t->then = 1;
        if (dp_uc_copy(dp, local, tag) < 0)
            t->bad = -EBUSY;
    } else if (dp->s.mode == AUR_DP_ZERO_COPY && dp_zc_link(dp, t, local, tag, 1) < 0) {
        t->bad = -EBUSY;
    } else {
        t->then = (uint8_t)uc;  /* -u read: the copy out when the pieces are in */
        dp_queue_pieces(dp, local, tag, p, n);
        /* the chain's last link; it runs whatever became of the pieces */
        if (dp->s.mode == AUR_DP_ZERO_COPY && dp_zc_link(dp, t, local, tag, 0) < 0 && !t->bad)
            t->bad = -EBUSY;
    }
    if (!t->pending) {  /* nothing queued: Python serves it from the start */
        dp_release(dp, t, local, AUR_EXT_UNUSED);
        dp->inflight--;
        t->served = 0;
        return 0;
    }
    return 1;
}

/* -u: the step after the first, once all of the first is in; 1 if queued. */
static int dp_then(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    struct dp_tag *t = dp_tag(dp, local, tag);

    t->then = 0;
    if (t->write)
        dp_queue_pieces(dp, local, tag, t->pieces, t->nr_pieces);
    else if (dp_uc_copy(dp, local, tag) < 0)
        t->bad = -EBUSY;
    if (t->pending)
        return 1;
    if (!t->bad)
        t->bad = -EBUSY;
    return 0;
}

/* A piece's result when it all moved: its bytes, or 0 for a passthrough
   command (a positive result there is the controller's status). */
static int32_t dp_full(const struct aur_dp *dp, uint64_t ud)
{
    if (DP_KIND(ud) == DP_K_RW && dp->map == AUR_MAP_NVME)
        return 0;
    return (int32_t)(DP_AUX(ud) << 9);
}

static void dp_rw_done(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res)
{
    unsigned local = DP_LOCAL(ud);
    uint16_t tag = DP_TAG(ud);
    struct dp_tag *t = dp_tag(dp, local, tag);

    if (DP_KIND(ud) == DP_K_REG) {
        if (DP_AUX(ud) && res < 0 && !t->bad)  /* (an unregister's result changes nothing) */
            t->bad = res;
    } else if (res != dp_full(dp, ud) && !t->bad) {
        t->bad = res < 0 ? res : -EIO;  /* (a positive NVMe status too) */
    }
    if (--t->pending)
        return;
    if (t->then && !t->bad && dp_then(dp, local, tag))
        return;
    dp_release(dp, t, local, t->bad ? AUR_EXT_FAILED : AUR_EXT_DONE);
    if (!t->bad) {
        dp_complete(dp, o, local, tag, (int32_t)t->len);
        return;
    }
    /* Python serves it from the start, on the coroutine path */
    dp->inflight--;
    t->served = 0;
    dp->q[local].counts->py_handed++;
    dp_emit(o, DP_UD(AUR_DP_EV_RETRY, local, tag, 0), t->bad, 0);
    dp_idle_check(dp, o);
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

static void dp_loop_ready(struct aur_dp *dp);

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
static void dp_pass(struct aur_dp *dp, struct dp_out *o, unsigned max, int *full, int submit)
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

/* Answers not queued yet (held, or a batch not sent): the loop must come back. */
static int dp_waiting(const struct aur_dp *dp)
{
    unsigned i;

    for (i = 0; i < dp->s.nr_queues; i++)
        if (dp->q[i].nr_held || dp->q[i].nr_elems)
            return 1;
    return 0;
}

/* Signal the ring's eventfd when the loop has something to take from C:
   no completion waits for a wake-up that already happened. */
static void dp_wake_loop(struct aur_dp *dp)
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

/* -- C owns the wait -------------------------------------------------------- */

/*
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
    int armed;       /* the poll on epfd is in the kernel */
    int ready;       /* it completed since the wait began: the loop has work */
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

static void dp_loop_ready(struct aur_dp *dp)
{
    if (dp->hook) {
        dp->hook->armed = 0;
        dp->hook->ready = 1;
    }
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
    if (!h->armed) {
        if (aur_prep(dp->r, IORING_OP_POLL_ADD, h->epfd, 0, 0, 0, POLLIN, 0, 0,
                     DP_UD(DP_K_LOOP, 0, 0, 0)) < 0) {
            /* no SQE: the loop sleeps in epoll this time, and the signal
               read above must not be lost with it */
            dp_wake_loop(dp);
            return;
        }
        h->armed = 1;
    }
    h->ready = 0;
    quiet = io_uring_cq_eventfd_toggle(ring, false) == 0;
    for (;;) {
        dp_pass(dp, &o, dp->out_cap, &full, 0);
        if (o.n || full || h->ready || dp->nr_done)
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
