/* The per-worker data plane (see dp_internal.h, and its files there). */
#ifndef AIOUBLK_DATAPLANE_H
#define AIOUBLK_DATAPLANE_H

#include <stddef.h>
#include <stdint.h>

#include "dp_ext.h"
#include "extents.h"
#include "ring.h"

/* cdef: begin (plain declarations and `#define NAME value` only) */

/* The user_data of the data plane's own operations and of the records it
   hands to Python (dp_internal.h), one field a (shift, mask) pair: the mark bit,
   which Python's own operations never reach, then a kind, the queue's local
   index, the tag and aux, 16 bits more. */
#define AUR_DP_UD_MARK_SHIFT 63
#define AUR_DP_UD_KIND_SHIFT 56
#define AUR_DP_UD_KIND_MASK 0x7f
#define AUR_DP_UD_LOCAL_SHIFT 40
#define AUR_DP_UD_LOCAL_MASK 0xffff
#define AUR_DP_UD_TAG_SHIFT 16
#define AUR_DP_UD_TAG_MASK 0xffff
#define AUR_DP_UD_AUX_MASK 0xffff   /* (at bit 0) */

/* what a record handed to Python is (the kind of its user_data) */
#define AUR_DP_EV_IO 1        /* a per-I/O command's CQE, as the kernel sent it */
#define AUR_DP_EV_FETCH 3     /* a batch fetch's CQE: its tags came as EV_TAG */
#define AUR_DP_EV_TAG 6       /* a fetched request the map did not take */
#define AUR_DP_EV_RETRY 7     /* a request C started and Python must serve (res: why) */
#define AUR_DP_EV_COMMIT 8    /* COMMIT_IO_CMDS refused an element (tag, res) */
#define AUR_DP_EV_LOST 9      /* a request finished after the seal: not answered */
#define AUR_DP_EV_IDLE 10     /* stopping, and C holds no request any more */
#define AUR_DP_EV_EXT 20      /* the external map's plug-in asks Python to look */
#define AUR_DP_EV_HELD 11     /* a write C served whose answer (res) the target gives once
                                 what it changed is durable (aur_ext_set_hold_writes) */

/* the most sectors a request may have: a piece's length is carried in aux
   (max_io_size is bounded by it) */
#define AUR_DP_MAX_SECTORS 0xffff
/* the most backend pieces C splits a request into */
#define AUR_DP_MAX_PIECES 64
/* the largest PREP/COMMIT element: header, buffer address, zone LBA */
#define AUR_DP_MAX_ELEM_BYTES 24

/* maps */
#define AUR_MAP_NONE 0
#define AUR_MAP_NULL 1
#define AUR_MAP_LINEAR 2
#define AUR_MAP_STRIPED 3
#define AUR_MAP_EXTENTS 4
#define AUR_MAP_NVME 5     /* NVMe passthrough: one NVME_URING_CMD_IO per request */
#define AUR_MAP_EXTERN 6   /* a plug-in's (dp_ext.h), copy mode only */
/* aur_dp_map_nvme's flags: what the namespace's write cache asks for */
#define AUR_NVME_VWC 1     /* a volatile write cache: flush and FUA mean something */
#define AUR_NVME_FUA 2     /* writes take the FUA bit (else a FUA write is Python's) */

/* copy modes C serves in */
#define AUR_DP_COPY 0
#define AUR_DP_AUTO_ZC 1
#define AUR_DP_ZERO_COPY 3    /* register the request's pages around its I/O */
#define AUR_DP_USER_COPY 4    /* -u: copy between the tag's buffer and /dev/ublkcN */

/* inline_io: what C moves with pread/pwrite in its own thread, not through
   the ring, because io_uring would hand it to an io-wq worker anyway (the
   file offers no FMODE_NOWAIT): a context switch to another thread per
   request, for what is a memory copy */
#define AUR_DP_INLINE_CHAR 1  /* -u: the copies to and from /dev/ublkcN */
#define AUR_DP_INLINE_RAM 2   /* pieces in files on tmpfs or ramfs */

struct aur_dp;

struct aur_dp_setup {
    int char_fd;
    int batch;
    int mode;               /* AUR_DP_* */
    int auto_zc_fallback;
    int zoned;              /* UBLK_F_ZONED: commits carry a zone append's sector */
    unsigned nr_queues;     /* the worker's queues, in its order ("local") */
    unsigned depth;
    uint32_t max_io;
    uint32_t op_fetch_req, op_commit_and_fetch, op_fetch_io_cmds, op_commit_io_cmds;
    uint32_t op_register_buf, op_unregister_buf, op_need_get_data;
    unsigned fetch_buf_bytes, fetch_buf_entries;
    unsigned poll_us;       /* wait this long in C for more work before Python's turn */
    unsigned idle_us;       /* nonzero: wait this long instead (Python's work wakes C) */
    unsigned inline_io;     /* AUR_DP_INLINE_* */
};

/* latency (aur_dp_set_timing): per op (read, write, flush, discard,
   write_same, write_zeroes, any other), log2 buckets of 1024 ns: bucket b
   counts requests that took under 2^b units, the last one all the rest */
#define AUR_LAT_OPS 7
#define AUR_LAT_BUCKETS 24
struct aur_dp_counts {
    uint64_t started, ios, bytes, errors;
    /* who served: c_served requests C took from fetch to commit, py_handed
       ones handed to Python (EV_TAG, EV_IO, EV_RETRY); the data plane's own
       (on its first queue): wakes, aur_dp_reap's returns after C served or
       completed a request, poll_timeouts, its waits for more that timed out;
       c_alloc, clusters C allocated for writes that completed; kernel_bad,
       what a batch fetch's completion held that no kernel may send (a tag
       beyond the depth or one C serves already, a buffer that is not one of
       the queue's, more tags than it holds), dropped */
    uint64_t c_served, py_handed, wakes, poll_timeouts, c_alloc, kernel_bad;
    uint64_t lat_ns[7];        /* AUR_LAT_OPS: the latencies' sum */
    uint64_t lat[7][24];       /* AUR_LAT_OPS x AUR_LAT_BUCKETS */
};

struct aur_dp *aur_dp_new(struct aur *r, const struct aur_dp_setup *s, int *err);
void aur_dp_free(struct aur_dp *dp);
/* before the ring's exit: unregister the fetch buffers (see setup.c) */
unsigned aur_dp_withdraw(struct aur_dp *dp);
/* queue `local`: its q_id, descriptor area and (copy modes) tag buffers */
void aur_dp_queue(struct aur_dp *dp, unsigned local, uint16_t q_id, const void *descs,
                  void *bufs, struct aur_dp_counts *counts);
/* the buffer-table slot of (local, tag) in the zero-copy modes */
void aur_dp_buf_index(struct aur_dp *dp, unsigned local, uint16_t tag, uint16_t index);

int aur_dp_map_null(struct aur_dp *dp);
int aur_dp_map_linear(struct aur_dp *dp, int fd, uint64_t base);
int aur_dp_map_striped(struct aur_dp *dp, const int *fds, unsigned n, uint64_t chunk);
/* slot: its pool in t (aur_ext_attach) for writes to ALLOC granules; -1: none,
   such a write is Python's */
int aur_dp_map_extents(struct aur_dp *dp, struct aur_ext *t, unsigned granule_shift, int slot);
/* the namespace `nsid` behind generic char device fd, blocks of 1 << lba_shift
   bytes, flags AUR_NVME_*; the ring must have 128-byte SQEs */
int aur_dp_map_nvme(struct aur_dp *dp, int fd, uint32_t nsid, unsigned lba_shift,
                    unsigned flags);
/* the plug-in whose table is ops (dp_ext.h), with its context ctx; -EBUSY
   if the data plane has one already. Copy mode only: in the others it
   returns 0 and binds nothing (every request stays Python's) */
struct aur_dp_ext;
int aur_dp_map_extern(struct aur_dp *dp, const struct aur_dp_ext *ops, void *ctx);

void aur_dp_set_stopping(struct aur_dp *dp, int stopping);
void aur_dp_set_sealed(struct aur_dp *dp, int sealed);
unsigned aur_dp_inflight(struct aur_dp *dp);
/* time each request from fetch to commit into its queue's lat buckets */
void aur_dp_set_timing(struct aur_dp *dp, int on);

/* per-I/O: arm (local, tag) with FETCH_REQ */
int aur_dp_fetch_req(struct aur_dp *dp, unsigned local, uint16_t tag);
/* batch: provide the fetch buffers of queue `local` and arm one multishot fetch */
int aur_dp_provide(struct aur_dp *dp, unsigned local);
int aur_dp_fetch_io_cmds(struct aur_dp *dp, unsigned local);
/* Python's answer to a request: COMMIT_AND_FETCH_REQ, or an element of the
   queue's next COMMIT_IO_CMDS. Returns 0: an answer the SQ cannot take is
   held and sent by a later flush, never dropped. */
int aur_dp_answer(struct aur_dp *dp, unsigned local, uint16_t tag, int32_t res);
/* the sector a zone append landed at, sent with the tag's next answer (zoned) */
void aur_dp_zone_lba(struct aur_dp *dp, unsigned local, uint16_t tag, uint64_t lba);
/* queue the COMMIT_IO_CMDS of what was answered since the last one */
int aur_dp_flush(struct aur_dp *dp);
/* batch: PREP_IO_CMDS for every tag of queue `local`, encoded as its commits
   are: the 16-byte command area into cmd, the elements into out; returns
   their bytes (at most depth * AUR_DP_MAX_ELEM_BYTES), -ENOSPC if max is less */
int aur_dp_prep_io_cmds(struct aur_dp *dp, unsigned local, void *cmd, void *out,
                        unsigned max);
/* the elements queue `local` has for its next commit (bytes copied; tests) */
unsigned aur_dp_pending(struct aur_dp *dp, unsigned local, void *out, unsigned max);
/* Reap the ring: serve what the map covers, copy the rest (16-byte CQEs)
   into out, at most max (at least aur_dp_room); returns how many. CQEs
   left in the ring signal the eventfd again. */
unsigned aur_dp_room(struct aur_dp *dp);
unsigned aur_dp_reap(struct aur_dp *dp, void *out, unsigned max);
/* the most records one reap may return: the size of out, in records */
unsigned aur_dp_out_cap(struct aur_dp *dp);

/* The worker's loop (a uv_loop_t) and the addresses of the libuv functions
   uvloop's extension exports (uv_handle_size, uv_prepare_init, ...): with
   them C owns the worker's wait (uvhook.c). Copied. */
struct aur_uv {
    void *loop;
    void *handle_size, *prepare_init, *prepare_start, *prepare_stop, *close;
    void *backend_fd, *backend_timeout, *update_time;
};
/* 0, or -ENOTSUP: not a loop this can read (it keeps waiting in aur_dp_reap) */
int aur_dp_own_wait(struct aur_dp *dp, const struct aur_uv *uv);
/* before the ring closes, on the loop's thread */
void aur_dp_release_wait(struct aur_dp *dp);
/* cdef: end */

#endif
