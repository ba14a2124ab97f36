/*
 * The NVMe passthrough map (AUR_MAP_NVME): a request as one NVME_URING_CMD_IO
 * to the namespace's generic char device. Static inline: serve.c's steps on
 * the per-request path.
 */
#ifndef AIOUBLK_DP_NVME_H
#define AIOUBLK_DP_NVME_H

#include <endian.h>
#include <stdint.h>
#include <linux/nvme_ioctl.h>
#include <liburing.h>

#include "dp_internal.h"

/* A piece as one NVMe read or write: in the zero-copy modes the request's
   pages are the buffer-table slot (a kernel-registered buffer starts at
   address 0, so addr is the offset in it), else the tag's buffer. */
static inline int dp_nvme_rw(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
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

/* dp_nvme_other's answer for a flush without a volatile cache: nothing to
   send, the caller completes it now */
#define DP_NVME_NOTHING 2

/* nvme: a flush, discard or write zeroes as the one command that does it;
   1 if C serves it, 0 if it is Python's (not in whole blocks, too long for
   one command, the CQ or SQ full), or DP_NVME_NOTHING. */
static inline int dp_nvme_other(struct aur_dp *dp, unsigned local, uint16_t tag, unsigned op,
                                uint64_t off, uint32_t len, uint32_t op_flags)
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
    if (op == UBLK_IO_OP_FLUSH && !(dp->nvme_flags & AUR_NVME_VWC))
        return DP_NVME_NOTHING;
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

#endif
