/* The extent table: device range -> (fd, host offset, writable) per granule,
   filled from Python, read by the C data plane. Thread-safe; see extents.c. */
#ifndef AIOUBLK_EXTENTS_H
#define AIOUBLK_EXTENTS_H

#include <stdint.h>

/* cdef: begin (plain declarations and `#define NAME value` only) */
struct aur_ext;
struct aur_ext_piece { int32_t fd; uint32_t len; uint64_t host_off; };

struct aur_ext *aur_ext_new(unsigned granule_shift, unsigned max_entries);
void aur_ext_free(struct aur_ext *t);
int aur_ext_insert(struct aur_ext *t, uint64_t dev_off, uint64_t len, int fd,
                   uint64_t host_off, int writable);
unsigned aur_ext_invalidate(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_busy(struct aur_ext *t, uint64_t dev_off, uint64_t len);
unsigned aur_ext_count(struct aur_ext *t);
int aur_ext_acquire(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write,
                    struct aur_ext_piece *pieces, unsigned max_pieces,
                    uint32_t *ids, unsigned max_ids);
void aur_ext_release(struct aur_ext *t, const uint32_t *ids, unsigned n);
/* cdef: end */

#endif
