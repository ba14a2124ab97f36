/* The extent table: device range -> what each granule is (host data at
   (fd, host offset, writable), zeros, or zeros a write may allocate), filled
   from Python, read by the C data plane, which allocates from pools of host
   clusters Python counted and reports each allocation back as a record.
   Thread-safe; see extents.c. */
#ifndef AIOUBLK_EXTENTS_H
#define AIOUBLK_EXTENTS_H

#include <stdint.h>

/* cdef: begin (plain declarations and `#define NAME value` only) */
struct aur_ext;
/* a run of a request: fd at host_off, or zeros when fd is -1 (a ZERO run);
   with zalg set, one ZIP granule's part: its compressed bytes are zlen at
   (fd, host_off), and the run is [zskip, zskip + len) of what they inflate to */
struct aur_ext_piece { int32_t fd; uint32_t len; uint64_t host_off;
                       uint32_t zlen, zskip; int32_t zalg; };

/* what a granule is (0: not in the table, as aur_ext_publish_l2's pub_out says) */
#define AUR_EXT_MAP 1     /* data at (fd, host_off); written in place if writable */
#define AUR_EXT_ZERO 2    /* reads as zeros; a write is a miss */
#define AUR_EXT_ALLOC 3   /* reads as zeros; a write allocates from the writer's pool */
#define AUR_EXT_COW 5     /* data at (fd, host_off), read-only; a write allocates from
                             the writer's pool and copies the rest of the granule */
#define AUR_EXT_COW_SUB 6 /* as COW, in 32 subclusters: a write allocates and copies
                             only the rest of the subclusters it touches, and its
                             record says which (the granule then leaves the table) */
#define AUR_EXT_ZIP 7     /* a compressed cluster: zlen bytes at (fd, host_off) that
                             inflate (zalg) to the whole granule; read only, a write
                             is a miss */
#define AUR_EXT_ZIP_COW 8 /* as ZIP, and a write allocates from the writer's pool and
                             copies the rest of the granule, inflated, as COW does */
#define AUR_EXT_SUB 9     /* a cluster of the writer's file at (fd, host_off) whose
                             subclusters in subs are data there, the others still at
                             (src_fd, src_off) (a COW_SUB after its first write): a
                             read takes each subcluster from where it is, a write to
                             those in subs goes in place, one to the others copies
                             the rest of them from src and records them (no pool) */
#define AUR_EXT_SUBCLUSTERS 32
/* how a ZIP granule's bytes are compressed (qcow2's compression types) */
#define AUR_EXT_ZLIB 1    /* raw deflate */
#define AUR_EXT_ZSTD 2    /* one zstd frame; bytes after it are padding */

/* pools of host clusters, one per attached slot (a data plane) */
#define AUR_EXT_SLOTS 64
/* what became of an acquisition's writes (aur_ext_release) */
#define AUR_EXT_DONE 0     /* all written */
#define AUR_EXT_FAILED 1   /* some write failed: what it allocated holds garbage */
#define AUR_EXT_UNUSED 2   /* nothing was written */
/* an id of aur_ext_acquire's whose granule it allocated (entry ids are below) */
#define AUR_EXT_ID_ALLOC 0x80000000
/* a record's flags */
#define AUR_EXT_REC_OK 1      /* gran's data is now at host_off */
#define AUR_EXT_REC_FAILED 2  /* host_off was allocated and holds garbage: free it */
#define AUR_EXT_REC_GROWN 4   /* with OK: host_off was gran's cluster already (SUB), and
                                 subs are now all its subclusters that are data */
/* bytes a write to a COW granule leaves to copy into its new cluster: from
   (src_fd, src_off) to (dst_fd, dst_off), dst_fd the allocation fd; with zalg
   set (ZIP_COW), the granule's [zskip, zskip + len) of what the zlen bytes at
   (src_fd, src_off) inflate to */
struct aur_ext_copy { int32_t src_fd, dst_fd; uint32_t len; uint64_t src_off, dst_off;
                      uint32_t zlen, zskip; int32_t zalg; };
/* an allocation's outcome, for the owner (aur_ext_drain) */
/* subs: AUR_EXT_COW_SUB's subclusters the write made data (bit i: the i-th
   32nd of the granule), 0 for a whole granule; with AUR_EXT_REC_GROWN, every
   subcluster of the SUB granule that is data now */
struct aur_ext_rec { uint64_t gran, host_off; uint32_t flags, slot, subs; };
struct aur_ext_stats {
    uint64_t locks, contended;        /* lock operations, and those that had to wait */
    uint64_t done, failed, unused;    /* allocations released with each outcome */
    uint64_t grown;                   /* of done: more subclusters of a SUB's cluster */
    uint32_t log_n, allocating;       /* records not drained; allocations in flight */
};

/* the rules aur_ext_publish_l2 applies to each qcow2 L2 entry */
struct aur_pub_rules {
    uint64_t used_end;      /* host bytes at or past this are never published */
    uint64_t size;          /* the disk's size: granules at or past it are not published */
    uint64_t backing_end;   /* unallocated granules below this show a backing file (0: none) */
    const uint64_t *meta;   /* host clusters holding metadata, sorted: never published */
    const uint64_t *skip;   /* granules being changed, sorted: not published */
    uint32_t nmeta, nskip;
    int writable_ok;        /* a COPIED cluster may be written in place */
    int alloc_ok;           /* zeros without a host cluster are ALLOC, not ZERO */
};

struct aur_ext *aur_ext_new(unsigned granule_shift, unsigned max_entries);
void aur_ext_free(struct aur_ext *t);
int aur_ext_insert(struct aur_ext *t, uint64_t dev_off, uint64_t len, int fd,
                   uint64_t host_off, int writable);
/* kind AUR_EXT_MAP: as aur_ext_insert; AUR_EXT_COW, AUR_EXT_COW_SUB: read-only
   data at (fd, host_off); AUR_EXT_ZERO, AUR_EXT_ALLOC: fd, host_off and
   writable unused */
int aur_ext_insert_kind(struct aur_ext *t, uint64_t dev_off, uint64_t len, int kind, int fd,
                        uint64_t host_off, int writable);
/* Publish the n qcow2 L2 entries (host byte order) of the granules from dev_base
   on, each by the rules, skipping those whose pub_out is already set; pub_out
   gets each one's kind, host_out and gran_out the (host cluster, granule) of
   each MAP one. Returns how many MAP pairs, or -EEXIST on a granule mapped
   otherwise (-EINVAL: bad arguments). A full table leaves the rest unpublished. */
int aur_ext_publish_l2(struct aur_ext *t, int fd, uint64_t dev_base, const uint64_t *entries,
                       unsigned n, const struct aur_pub_rules *r, uint8_t *pub_out,
                       uint64_t *host_out, uint64_t *gran_out);
/* One ZIP (or ZIP_COW: kind) granule at dev_off; -EINVAL on a bad argument,
   -EEXIST, -ENOSPC as aur_ext_insert_kind */
int aur_ext_insert_zip(struct aur_ext *t, uint64_t dev_off, int kind, int fd, uint64_t zoff,
                       uint32_t zlen, int zalg);
/* One SUB granule at dev_off: its cluster at (fd, host_off), writable, subs the
   subclusters that are data there (not none, not all), the others' data at
   (src_fd, src_off); -EINVAL on a bad argument, -EEXIST, -ENOSPC as
   aur_ext_insert_kind */
int aur_ext_insert_sub(struct aur_ext *t, uint64_t dev_off, int fd, uint64_t host_off,
                       uint32_t subs, int src_fd, uint64_t src_off);
unsigned aur_ext_invalidate(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_busy(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_count(struct aur_ext *t);
/* slot: the caller's pool (aur_ext_attach), -1 for none (an ALLOC write misses) */
int aur_ext_acquire(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write, int slot,
                    struct aur_ext_piece *pieces, unsigned max_pieces,
                    uint32_t *ids, unsigned max_ids);
/* As aur_ext_acquire, and a write to COW granules allocates too: copies gets
   what the write does not cover of them (at most 2: the first granule's head,
   the last one's tail), *ncopies how many. aur_ext_acquire misses there. */
int aur_ext_acquire_cow(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write, int slot,
                        struct aur_ext_piece *pieces, unsigned max_pieces,
                        uint32_t *ids, unsigned max_ids,
                        struct aur_ext_copy *copies, unsigned *ncopies);
/* outcome: AUR_EXT_DONE/FAILED/UNUSED, for the granules the ids allocated;
   returns how many of them became data (records pushed with AUR_EXT_REC_OK) */
unsigned aur_ext_release(struct aur_ext *t, const uint32_t *ids, unsigned n, int outcome);

/* a pool slot for one data plane: 0.., or -ENOSPC past AUR_EXT_SLOTS */
int aur_ext_attach(struct aur_ext *t);
/* allocate in fd, each slot's pool holding at most pool_cap clusters, at most
   log_cap records waiting; once (-EALREADY after), -EINVAL on a bad argument */
int aur_ext_set_alloc(struct aur_ext *t, int fd, unsigned pool_cap, unsigned log_cap);
/* add zeroed, counted, granule-aligned host offsets to slot's pool (at its tail);
   returns how many fitted, or -EINVAL (bad slot, misaligned, allocation off) */
int aur_ext_pool_add(struct aur_ext *t, unsigned slot, const uint64_t *host, unsigned n);
/* take up to max unused host offsets back from slot's pool, in the order C
   would have used them */
unsigned aur_ext_pool_take(struct aur_ext *t, unsigned slot, uint64_t *out, unsigned max);
unsigned aur_ext_pool_level(struct aur_ext *t, unsigned slot);
/* move up to max records out, oldest first */
unsigned aur_ext_drain(struct aur_ext *t, struct aur_ext_rec *out, unsigned max);
/* whether the data plane answers the writes it serves from this table itself
   (0, the default) or hands each to the target once done (AUR_DP_EV_HELD),
   which answers it once its metadata is durable (a qcow2 image that writes
   its metadata through); set before any data plane serves the table */
void aur_ext_set_hold_writes(struct aur_ext *t, int on);
int aur_ext_holds_writes(struct aur_ext *t);
/* an eventfd C adds 1 to when the owner has work (see extents.c); -1: none */
void aur_ext_set_notify(struct aur_ext *t, int efd);
/* the owner waits (or stops waiting) for held entries to be released */
void aur_ext_wait_begin(struct aur_ext *t);
void aur_ext_wait_end(struct aur_ext *t);
void aur_ext_stats(struct aur_ext *t, struct aur_ext_stats *out);
/* cdef: end */

#endif
