/* The extent table: device range -> what each granule is (host data at
   (fd, host offset, writable), or zeros), filled from Python, read by the C
   data plane. Thread-safe; see extents.c. */
#ifndef AIOUBLK_EXTENTS_H
#define AIOUBLK_EXTENTS_H

#include <stdint.h>

/* cdef: begin (plain declarations and `#define NAME value` only) */
struct aur_ext;
/* a run of a request: fd at host_off, or zeros when fd is -1 (a ZERO run) */
struct aur_ext_piece { int32_t fd; uint32_t len; uint64_t host_off; };

/* what a granule is (0: not in the table, as aur_ext_publish_l2's pub_out says) */
#define AUR_EXT_MAP 1     /* data at (fd, host_off); written in place if writable */
#define AUR_EXT_ZERO 2    /* reads as zeros; a write is a miss */

/* the rules aur_ext_publish_l2 applies to each qcow2 L2 entry */
struct aur_pub_rules {
    uint64_t used_end;      /* host bytes at or past this are never published */
    uint64_t size;          /* the disk's size: granules at or past it are not published */
    uint64_t backing_end;   /* unallocated granules below this show a backing file (0: none) */
    const uint64_t *meta;   /* host clusters holding metadata, sorted: never published */
    const uint64_t *skip;   /* granules being changed, sorted: not published */
    uint32_t nmeta, nskip;
    int writable_ok;        /* a COPIED cluster may be written in place */
};

struct aur_ext *aur_ext_new(unsigned granule_shift, unsigned max_entries);
void aur_ext_free(struct aur_ext *t);
int aur_ext_insert(struct aur_ext *t, uint64_t dev_off, uint64_t len, int fd,
                   uint64_t host_off, int writable);
/* kind AUR_EXT_MAP: as aur_ext_insert; AUR_EXT_ZERO: fd, host_off and writable unused */
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
unsigned aur_ext_invalidate(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_busy(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_count(struct aur_ext *t);
int aur_ext_acquire(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write,
                    struct aur_ext_piece *pieces, unsigned max_pieces,
                    uint32_t *ids, unsigned max_ids);
void aur_ext_release(struct aur_ext *t, const uint32_t *ids, unsigned n);
/* cdef: end */

#endif
