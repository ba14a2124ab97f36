/*
 * The io_uring shim under ring.py.
 *
 * Why a shim instead of binding liburing's inline helpers one by one: every
 * crossing of the cffi boundary costs ~60 ns and releases the GIL, so each SQE
 * is prepared by exactly one call (aur_prep*), and completions are copied out
 * in bulk (aur_reap: up to N raw 16-byte CQEs into a caller buffer, decoded in
 * Python with one struct.iter_unpack).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <liburing.h>

#include "ring.h"
#include "ublk_cmd.h"

int aur_init(struct aur *r, unsigned entries, unsigned cq_entries,
             unsigned flags)
{
    struct io_uring_params p;
    int ret;

    memset(&p, 0, sizeof(p));
    p.flags = flags;
    if (cq_entries) {
        p.flags |= IORING_SETUP_CQSIZE;
        p.cq_entries = cq_entries;
    }
    ret = io_uring_queue_init_params(entries, &r->ring, &p);
    if (ret < 0)
        return ret;
    r->flags = p.flags;
    r->sqe_size = (flags & IORING_SETUP_SQE128) ? 128 : 64;
    for (unsigned i = 0; i < AUR_FIXED_MAX; i++)
        r->fixed[i] = -1;
    r->nr_fixed = 0;
    r->fixed_state = 0;
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        ret = -errno;
        io_uring_queue_exit(&r->ring);
        return ret;
    }
    ret = io_uring_register_eventfd(&r->ring, r->efd);
    if (ret < 0) {
        close(r->efd);
        io_uring_queue_exit(&r->ring);
        return ret;
    }
    /* A ring one thread drives enters by its registered index, as kublk's
       do: no fd lookup per io_uring_enter. The registration is the
       thread's, which SINGLE_ISSUER makes the only one to enter; a kernel
       without it (before 5.18) enters by fd, as before. */
    if (flags & IORING_SETUP_SINGLE_ISSUER)
        io_uring_register_ring_fd(&r->ring);
    return 0;
}

void aur_exit(struct aur *r)
{
    io_uring_queue_exit(&r->ring);
    close(r->efd);
}

int aur_eventfd(struct aur *r) { return r->efd; }
int aur_ring_fd(struct aur *r) { return r->ring.ring_fd; }
unsigned aur_setup_flags(struct aur *r) { return r->flags; }

/* An SQE, zeroed but for the fields every preparation sets; submits what is
   queued when the SQ is full. */
static struct io_uring_sqe *aur_sqe(struct aur *r, uint8_t opcode, int fd, uint64_t addr,
                                    uint32_t len, uint16_t buf_index, uint8_t sqe_flags,
                                    uint64_t user_data)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);

    if (!sqe) {
        io_uring_submit(&r->ring);
        sqe = io_uring_get_sqe(&r->ring);
        if (!sqe)
            return NULL;
    }
    memset(sqe, 0, r->sqe_size);
    sqe->opcode = opcode;
    sqe->fd = fd;
    if (r->nr_fixed && fd >= 0) {
        for (unsigned i = 0; i < AUR_FIXED_MAX; i++)
            if (r->fixed[i] == fd) {
                sqe->fd = (int)i;
                sqe_flags |= IOSQE_FIXED_FILE;
                break;
            }
    }
    sqe->addr = addr;
    sqe->len = len;
    sqe->buf_index = buf_index;
    sqe->flags = sqe_flags;
    sqe->user_data = user_data;
    return sqe;
}

int aur_prep(struct aur *r, uint8_t opcode, int fd, uint64_t addr,
             uint32_t len, uint64_t off, uint32_t op_flags,
             uint16_t buf_index, uint8_t sqe_flags, uint64_t user_data)
{
    struct io_uring_sqe *sqe = aur_sqe(r, opcode, fd, addr, len, buf_index, sqe_flags,
                                       user_data);

    if (!sqe)
        return -EBUSY;
    sqe->off = off;
    sqe->rw_flags = op_flags;
    return 0;
}

int aur_prep_cmd(struct aur *r, int fd, uint32_t cmd_op, const void *cmd,
                 unsigned cmd_len, uint64_t addr, uint32_t len,
                 uint32_t cmd_flags, uint16_t buf_index, uint8_t sqe_flags,
                 uint64_t user_data)
{
    struct io_uring_sqe *sqe;

    if (cmd_len > r->sqe_size - 48)
        return -EINVAL;
    sqe = aur_sqe(r, IORING_OP_URING_CMD, fd, addr, len, buf_index, sqe_flags, user_data);
    if (!sqe)
        return -EBUSY;
    sqe->cmd_op = cmd_op;
    sqe->uring_cmd_flags = cmd_flags;
    memcpy(sqe->cmd, cmd, cmd_len);
    return 0;
}

int aur_prep_ublk_io(struct aur *r, int fd, uint32_t cmd_op, uint16_t q_id,
                     uint16_t tag, int32_t result, uint64_t io_addr,
                     uint64_t sqe_addr, uint8_t sqe_flags,
                     uint64_t user_data)
{
    struct io_uring_sqe *sqe = aur_sqe(r, IORING_OP_URING_CMD, fd, sqe_addr, 0, 0, sqe_flags,
                                       user_data);
    struct ublksrv_io_cmd *cmd;

    if (!sqe)
        return -EBUSY;
    sqe->cmd_op = cmd_op;
    cmd = (struct ublksrv_io_cmd *)sqe->cmd;
    cmd->q_id = q_id;
    cmd->tag = tag;
    cmd->result = result;
    cmd->addr = io_addr;
    return 0;
}

/*
 * With DEFER_TASKRUN a plain GETEVENTS enter (io_uring_get_events) runs at
 * most 20 task-work items (IO_LOCAL_TW_DEFAULT_MAX), and the eventfd is
 * signalled only when the work list goes from empty to non-empty: work left
 * behind would never wake us again (seen as requests stuck in a ublk queue).
 * A wait for "as many CQEs as the CQ holds" with a zero timeout makes the
 * kernel run every pending item before it gives up waiting.
 */
static int aur_run_task_work(struct aur *r)
{
    struct __kernel_timespec ts = { 0, 0 };
    struct io_uring_cqe *cqe;
    int ret = io_uring_wait_cqes(&r->ring, &cqe, r->ring.cq.ring_entries, &ts, NULL);

    return (ret == -ETIME || ret == -EAGAIN || ret == -EINTR) ? 0 : ret;
}

/*
 * A plain submit (no GETEVENTS) never runs deferred task work, so it cannot
 * leave a partly-run list behind; whatever it queues signals the eventfd and
 * is run in full by the next aur_wake. One syscall per loop turn.
 */
int aur_submit(struct aur *r)
{
    return io_uring_submit(&r->ring);
}

/* Consume the eventfd's count and run deferred task work, if any. */
int aur_wake(struct aur *r)
{
    uint64_t v;

    if (read(r->efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        return -errno;
    if (r->flags & IORING_SETUP_DEFER_TASKRUN)
        return aur_run_task_work(r);
    return 0;
}

unsigned aur_reap(struct aur *r, void *out, unsigned max)
{
    struct io_uring_cqe *cqe;
    unsigned head, n = 0;

    io_uring_for_each_cqe(&r->ring, head, cqe) {
        if (n == max)
            break;
        memcpy((char *)out + 16 * n, cqe, 16);
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    /* CQEs that overflowed into the kernel's list come back only on enter */
    if (n < max && io_uring_cq_has_overflow(&r->ring)) {
        unsigned first = n;

        io_uring_get_events(&r->ring);
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            if (n == max)
                break;
            memcpy((char *)out + 16 * n, cqe, 16);
            n++;
        }
        io_uring_cq_advance(&r->ring, n - first);
    }
    return n;
}

unsigned aur_pending_sqes(struct aur *r)
{
    return io_uring_sq_ready(&r->ring);
}

/* Block up to timeout_ms for one CQE; used only while closing. */
int aur_wait(struct aur *r, unsigned timeout_ms)
{
    struct __kernel_timespec ts;
    struct io_uring_cqe *cqe;

    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = (long long)(timeout_ms % 1000) * 1000000;
    return io_uring_wait_cqe_timeout(&r->ring, &cqe, &ts);
}

int aur_register_buffers_sparse(struct aur *r, unsigned nr)
{
    return io_uring_register_buffers_sparse(&r->ring, nr);
}

int aur_register_files(struct aur *r, const int *fds, unsigned nr)
{
    int ret = io_uring_register_files(&r->ring, fds, nr);

    if (ret == 0)
        r->fixed_state = -1;  /* the caller's table, not aur_fix_file's */
    return ret;
}

int aur_fix_file(struct aur *r, int fd)
{
    unsigned i, slot = AUR_FIXED_MAX;

    if (fd < 0 || r->fixed_state < 0)
        return -1;
    for (i = 0; i < AUR_FIXED_MAX; i++) {
        if (r->fixed[i] == fd)
            return (int)i;
        if (r->fixed[i] < 0 && slot == AUR_FIXED_MAX)
            slot = i;
    }
    if (slot == AUR_FIXED_MAX)
        return -1;
    if (r->fixed_state == 0) {
        /* (before 5.19, or a ring that has a table: no fixed files) */
        r->fixed_state = io_uring_register_files_sparse(&r->ring, AUR_FIXED_MAX) == 0 ? 1 : -1;
        if (r->fixed_state < 0)
            return -1;
    }
    if (io_uring_register_files_update(&r->ring, slot, &fd, 1) != 1)
        return -1;
    r->fixed[slot] = fd;
    r->nr_fixed++;
    return (int)slot;
}

void aur_unfix_files(struct aur *r, int keep_fd)
{
    int none = -1;

    for (unsigned i = 0; i < AUR_FIXED_MAX; i++) {
        if (r->fixed[i] < 0 || r->fixed[i] == keep_fd)
            continue;
        /* (an update that fails leaves the slot's file registered, never
           used: no SQE names it once it is out of fixed[]) */
        io_uring_register_files_update(&r->ring, i, &none, 1);
        r->fixed[i] = -1;
        r->nr_fixed--;
    }
}

void *aur_buf_ring_setup(struct aur *r, unsigned entries, int bgid, int *err)
{
    struct io_uring_buf_reg reg;
    struct io_uring_buf_ring *br;
    size_t size = entries * sizeof(struct io_uring_buf);
    int ret;

    if (posix_memalign((void **)&br, 4096, size)) {
        *err = -ENOMEM;
        return NULL;
    }
    memset(br, 0, size);
    memset(&reg, 0, sizeof(reg));
    reg.ring_addr = (unsigned long)br;
    reg.ring_entries = entries;
    reg.bgid = bgid;
    ret = io_uring_register_buf_ring(&r->ring, &reg, 0);
    if (ret) {
        free(br);
        *err = ret;
        return NULL;
    }
    io_uring_buf_ring_init(br);
    *err = 0;
    return br;
}

/* r may be NULL once the ring is gone (its exit unregistered every group) */
int aur_buf_ring_free(struct aur *r, void *br, unsigned entries, int bgid)
{
    int ret = r ? io_uring_unregister_buf_ring(&r->ring, bgid) : 0;

    (void)entries;
    free(br);
    return ret;
}

void aur_buf_ring_add(void *br, uint64_t addr, unsigned len, uint16_t bid,
                      unsigned entries, int offset)
{
    io_uring_buf_ring_add((struct io_uring_buf_ring *)br, (void *)addr, len,
                          bid, io_uring_buf_ring_mask(entries), offset);
}

void aur_buf_ring_advance(void *br, unsigned count)
{
    io_uring_buf_ring_advance((struct io_uring_buf_ring *)br, count);
}
