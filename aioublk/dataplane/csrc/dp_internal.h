/*
 * The data plane's insides, shared by its files: its state, the user_data
 * it encodes, the small helpers each file calls on the per-request path
 * (static inline: the split into files costs no call on that path), and the
 * few functions one file calls in another (DP_HIDDEN).
 *
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
 * zero-copy modes have no buffer to fill, so such a read is Python's. A
 * read of ZIP granules (compressed) reads their compressed bytes and
 * inflates the part asked for into the tag's buffer; a write to COW, COW_SUB
 * or ZIP_COW granules copies the old data around it into its new cluster,
 * merged with the write into one write when it stays inside a granule
 * (copy mode), or as copies beside it; neither in the zero-copy modes. With
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
 * Its files: setup.c (a data plane made, given a map, freed), commands.c
 * (the commands to the kernel and their encoding: fetch, commit and
 * COMMIT_IO_CMDS's elements), serve.c (a request C takes: resolved against
 * the map, its data moved in the queue's copy mode), inflate.c (a
 * compressed qcow2 cluster's part a read asks for), nvme.h (the NVMe
 * passthrough map's commands), plugin.h and plugin.c (an external map's
 * plug-in, dp_ext.h), reap.c (the ring's completions: aur_dp_reap) and
 * uvhook.c (C owns the worker loop's wait).
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
#ifndef AIOUBLK_DP_INTERNAL_H
#define AIOUBLK_DP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <liburing.h>

#include "dataplane.h"
#include "extents.h"
#include "ring.h"
#include "ublk_cmd.h"

/* a function one file of the data plane calls in another: a direct call,
   never through the extension's symbol table, which does not export it */
#define DP_HIDDEN __attribute__((visibility("hidden")))

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
#define DP_K_ZIP 22    /* a ZIP piece's compressed bytes read (aux: its index in zips) */
#define DP_K_ZCOPY 23  /* a ZIP_COW copy's compressed bytes read (aux: its index in zcopy) */
#define DP_K_MERGE 24  /* a copy-on-write's old data read, to merge with the write's */

#define DP_MAX_PIECES AUR_DP_MAX_PIECES
/* fds whose inline_io answer a data plane remembers */
#define DP_FD_INLINE_MAX 64

/* -u: where a request's data is on /dev/ublkcN (64-bit: the queue id sits at bit 41) */
#define DP_USER_COPY_OFF(q, tag) \
    ((uint64_t)UBLKSRV_IO_BUF_OFFSET + \
     (((uint64_t)(q) << UBLK_QID_OFF) | ((uint64_t)(tag) << UBLK_TAG_OFF)))

/* zalg set: a ZIP piece (zlen compressed bytes at host_off, of which the
   request wants [zskip, zskip + len) inflated) */
struct dp_piece { int fd; uint32_t len; uint64_t host_off; uint32_t buf_off;
                  uint32_t zlen, zskip; uint8_t zalg; };

/* A ZIP piece in flight: its compressed bytes are read (from a 4 KiB-aligned
   offset, O_DIRECT's way) into the tag's zbuf at rd, the first of them lead
   bytes in, and inflated to the tag's buffer at buf_off when they are in. */
struct dp_zip { uint32_t rd, lead, zlen, skip, len, buf_off; uint8_t alg; int fd;
                uint64_t zoff; };

/* A copy-on-write's copies from a compressed granule (ZIP_COW): its
   compressed bytes read once into zbuf at rd (as dp_zip's), inflated into
   the bounce buffer at bounce_off as far as the last copy needs, and each
   copy written from there. */
struct dp_zcopy {
    uint32_t rd, lead, zlen, bounce_off;
    uint8_t alg, n;
    const struct aur_ext_copy *c[2];
};

/* where a ZIP piece's read starts and its length */
#define DP_ZIP_ALIGN 4096u
#define DP_ZIP_LEAD(off) ((uint32_t)((off) & (DP_ZIP_ALIGN - 1)))
#define DP_ZIP_READ(off, zlen) \
    ((DP_ZIP_LEAD(off) + (uint64_t)(zlen) + DP_ZIP_ALIGN - 1) & ~(uint64_t)(DP_ZIP_ALIGN - 1))

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
    uint8_t nr_copies;   /* a write's copy-on-write copies (extent table COW) */
    struct aur_ext_copy copies[2];
    void *bounce;        /* the copies' bytes in passing: 2 granules, made on first use */
    /* a copy-on-write inside one granule (serve.c, dp_queue_merged): the new
       cluster's bytes [d0, d0 + len) in fd, the write's own data at `data`
       in them, the old data from the granule's byte `skip` on */
    struct dp_merge { uint64_t d0; uint32_t len, data, skip; int32_t fd; } merge;
    uint8_t nr_zcopy;    /* compressed sources of its copies (ZIP_COW) */
    struct dp_zcopy zcopy[2];
    uint8_t has_zip;     /* its pieces include ZIP ones (dp_resolve) */
    uint8_t nr_zips;     /* ZIP pieces queued (extent table ZIP granules) */
    struct dp_zip *zips; /* DP_MAX_PIECES, made on first use */
    char *zbuf;          /* their compressed bytes, zbuf_cap of room */
    size_t zbuf_cap;
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
    int hold_writes;        /* ext holds the writes served (read once, at the map) */
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
    int no_copy_range;  /* copy_file_range refused between inline files */
    /* aur_dp_own_wait: the loop's hook, and the records C's wait kept for
       Python (out_cap of them at most), which its next reap takes first */
    struct dp_hook *hook;
    int loop_armed;         /* the poll on the loop's epoll fd is in the kernel */
    int loop_ready;         /* it completed since C's wait began: the loop has work */
    char *kept;
    unsigned nr_kept, out_cap;
    struct dp_ext *ext_map;  /* AUR_MAP_EXTERN */
    struct dp_inflater *inflater;  /* inflate.c, made on first use */
    struct dp_queue q[];
};

/* the records aur_dp_reap hands Python, 16 bytes each */
struct dp_out {
    char *buf;
    unsigned n;
};

static inline struct dp_tag *dp_tag(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    return &dp->q[local].tags[tag];
}

static inline char *dp_buf(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    return dp->q[local].bufs + (size_t)tag * dp->s.max_io;
}

static inline int dp_zero_copy(const struct aur_dp *dp)
{
    return dp->s.mode == AUR_DP_ZERO_COPY || dp->s.mode == AUR_DP_AUTO_ZC;
}

static inline uint64_t dp_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline void dp_emit(struct dp_out *o, uint64_t ud, int32_t res, uint32_t flags)
{
    char *p = o->buf + 16 * o->n++;

    memcpy(p, &ud, 8);
    memcpy(p + 8, &res, 4);
    memcpy(p + 12, &flags, 4);
}

static inline void dp_idle_check(struct aur_dp *dp, struct dp_out *o)
{
    if (!dp->inflight && dp->stopping)
        dp_emit(o, DP_UD(AUR_DP_EV_IDLE, 0, 0, 0), 0, 0);
}

/* A request C takes on: its tag's state from scratch. */
static inline void dp_tag_start(struct dp_tag *t, uint32_t len, int write, int fua)
{
    t->bad = 0;
    t->len = len;
    t->write = (uint8_t)write;
    t->fua = (uint8_t)fua;
    t->then = 0;
    t->nr_ids = 0;
    t->nr_copies = 0;
    t->nr_zips = 0;
    t->has_zip = 0;
    t->nr_zcopy = 0;
    t->pending = 0;
    t->cqes = 0;
}

static inline void dp_give_back(struct aur_dp *dp, struct dp_queue *q, unsigned bid, int offset)
{
    io_uring_buf_ring_add(q->br, q->tags_mem + (size_t)bid * dp->s.fetch_buf_bytes,
                          dp->s.fetch_buf_bytes, (unsigned short)bid,
                          io_uring_buf_ring_mask(dp->s.fetch_buf_entries), offset);
}

/* Answers not queued yet (held, or a batch not sent): the loop must come back. */
static inline int dp_waiting(const struct aur_dp *dp)
{
    unsigned i;

    for (i = 0; i < dp->s.nr_queues; i++)
        if (dp->q[i].nr_held || dp->q[i].nr_elems)
            return 1;
    return 0;
}

/* -- across the files ------------------------------------------------------ */

/* setup.c: a new map's file table */
DP_HIDDEN void dp_new_map(struct aur_dp *dp, const int *fds, unsigned n);
/* commands.c */
DP_HIDDEN int dp_io_cmd(struct aur_dp *dp, unsigned local, uint16_t tag, uint32_t op,
                        int32_t res);
DP_HIDDEN void dp_send_commit(struct aur_dp *dp, unsigned local, struct dp_commit *c,
                              uint16_t slot);
DP_HIDDEN int dp_commit(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res);
/* serve.c */
DP_HIDDEN int dp_serve(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag);
DP_HIDDEN void dp_rw_done(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res);
/* reap.c */
DP_HIDDEN void dp_pass(struct aur_dp *dp, struct dp_out *o, unsigned max, int *full,
                       int submit);
DP_HIDDEN void dp_wake_loop(struct aur_dp *dp);
/* inflate.c: bytes [skip, skip + len) of what src, the compressed bytes at
   (fd, zoff), inflates to (alg: AUR_EXT_ZLIB or AUR_EXT_ZSTD) into dst, and
   kept in the plane's cache; 0, or -errno */
DP_HIDDEN int dp_inflate(struct aur_dp *dp, int alg, int fd, uint64_t zoff, const void *src,
                         size_t srclen, char *dst, uint32_t skip, uint32_t len);
/* the same bytes from the cache into dst if it has them: 1, else 0 */
DP_HIDDEN int dp_zcache_get(struct aur_dp *dp, int fd, uint64_t zoff, char *dst, uint32_t skip,
                            uint32_t len);
DP_HIDDEN void dp_zcache_clear(struct aur_dp *dp);
DP_HIDDEN void dp_inflater_free(struct aur_dp *dp);
/* plugin.c: ask the plug-in what it wants (o: a CQE's records, or NULL) */
DP_HIDDEN int dp_ext_watch(struct aur_dp *dp, struct dp_out *o);

#endif
