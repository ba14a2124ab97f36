/* The io_uring shim ring.py drives (see ring.c). */
#ifndef AIOUBLK_RING_H
#define AIOUBLK_RING_H

#include <stdint.h>
#include <liburing.h>

/* liburing >= 2.3 (Debian 12) is supported: what its header may lack */
#ifndef IORING_URING_CMD_MULTISHOT
#define IORING_URING_CMD_MULTISHOT (1U << 1)
#endif
#ifndef IORING_ASYNC_CANCEL_ANY
#define IORING_ASYNC_CANCEL_ANY (1U << 2)
#endif

/* Python allocates it (cffi learns its size, not its fields); the data
   plane reads its fields */
#define AUR_FIXED_MAX 16
struct aur {
    struct io_uring ring;
    int efd;
    unsigned flags;
    unsigned sqe_size;
    /* the registered file table (aur_fix_file): the fd in each slot, -1 for
       none; fixed_state 0: no table yet, 1: registered, -1: refused */
    int fixed[AUR_FIXED_MAX];
    unsigned nr_fixed;
    int fixed_state;
};

/* cdef: begin (plain declarations and `#define NAME value` only) */
struct aur_iovec { uint64_t base; uint64_t len; };

int aur_init(struct aur *r, unsigned entries, unsigned cq_entries,
             unsigned flags);
void aur_exit(struct aur *r);
int aur_eventfd(struct aur *r);
int aur_ring_fd(struct aur *r);
unsigned aur_setup_flags(struct aur *r);

int aur_prep(struct aur *r, uint8_t opcode, int fd, uint64_t addr,
             uint32_t len, uint64_t off, uint32_t op_flags,
             uint16_t buf_index, uint8_t sqe_flags, uint64_t user_data);
int aur_prep_cmd(struct aur *r, int fd, uint32_t cmd_op, const void *cmd,
                 unsigned cmd_len, uint64_t addr, uint32_t len,
                 uint32_t cmd_flags, uint16_t buf_index, uint8_t sqe_flags,
                 uint64_t user_data);
int aur_prep_ublk_io(struct aur *r, int fd, uint32_t cmd_op, uint16_t q_id,
                     uint16_t tag, int32_t result, uint64_t io_addr,
                     uint64_t sqe_addr, uint8_t sqe_flags,
                     uint64_t user_data);
int aur_submit(struct aur *r);
int aur_wake(struct aur *r);
unsigned aur_reap(struct aur *r, void *out, unsigned max);
unsigned aur_pending_sqes(struct aur *r);
int aur_wait(struct aur *r, unsigned timeout_ms);

int aur_register_buffers_sparse(struct aur *r, unsigned nr);
int aur_register_files(struct aur *r, const int *fds, unsigned nr);
/* SQEs on fd go through the ring's file table from now on (IOSQE_FIXED_FILE:
   no file lookup per operation); the caller keeps fd open while it is
   there. Returns its slot, or -1 (no table, or full): SQEs use the fd. */
int aur_fix_file(struct aur *r, int fd);
/* every fd but keep_fd leaves the table */
void aur_unfix_files(struct aur *r, int keep_fd);

/* provided buffer rings (UBLK_F_BATCH_IO fetch) */
void *aur_buf_ring_setup(struct aur *r, unsigned entries, int bgid, int *err);
int aur_buf_ring_free(struct aur *r, void *br, unsigned entries, int bgid);
void aur_buf_ring_add(void *br, uint64_t addr, unsigned len, uint16_t bid,
                      unsigned entries, int offset);
void aur_buf_ring_advance(void *br, unsigned count);
/* cdef: end */

#endif
