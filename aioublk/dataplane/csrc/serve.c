/*
 * A request C takes on: resolved against the map into backend pieces, its
 * data moved in the queue's copy mode (the tag's buffer, automatic buffer
 * registration, -z's linked chain, -u's two steps through /dev/ublkcN, or
 * C's own pread/pwrite where the ring would hand the file to an io-wq
 * worker), and its pieces' completions gathered into one answer: full
 * success is committed, anything else goes to Python from the start.
 */

#define _GNU_SOURCE  /* copy_file_range */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <liburing.h>

#include "dp_internal.h"
#include "nvme.h"
#include "plugin.h"

/* C's request is done with a full result. */
static void dp_complete(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag,
                        int32_t res)
{
    struct dp_tag *t = dp_tag(dp, local, tag);

    dp->inflight--;
    dp->completed++;
    t->served = 0;
    if (dp->sealed) {
        dp_emit(o, DP_UD(AUR_DP_EV_LOST, local, tag, 0), res, 0);
    } else {
        dp->q[local].counts->c_served++;
        if (t->write && dp->map == AUR_MAP_EXTENTS && dp->hold_writes)
            dp_emit(o, DP_UD(AUR_DP_EV_HELD, local, tag, 0), res, 0);  /* the target answers */
        else
            dp_commit(dp, local, tag, res);
    }
    dp_idle_check(dp, o);
}

/* Whether a write may copy-on-write here: the copies go through the tag's
   bounce buffer (2 granules), so the granule is at most 2 MiB, and the modes
   whose data never enters the buffer (-z, --auto_zc) leave them to Python. */
static int dp_can_cow(const struct aur_dp *dp)
{
    return dp->ext_shift <= 21 && dp->s.mode != AUR_DP_ZERO_COPY &&
           dp->s.mode != AUR_DP_AUTO_ZC;
}

/* Room in the tag for its ZIP pieces (need: their compressed bytes' reads)
   and its compressed copies: their state, and their reads; 0 when there is
   no memory for them. */
static int dp_zip_room(struct dp_tag *t, size_t need)
{
    unsigned i;

    for (i = 0; i < t->nr_copies; i++)  /* (at most: two copies may share one read) */
        if (t->copies[i].zalg)
            need += DP_ZIP_READ(t->copies[i].src_off, t->copies[i].zlen);
    if (!need || (t->zips && t->zbuf_cap >= need))
        return 1;
    if (!t->zips && !(t->zips = malloc(DP_MAX_PIECES * sizeof(*t->zips))))
        return 0;
    if (t->zbuf_cap < need) {
        free(t->zbuf);
        t->zbuf_cap = 0;
        if (posix_memalign((void **)&t->zbuf, DP_ZIP_ALIGN, need)) {
            t->zbuf = NULL;
            return 0;
        }
        t->zbuf_cap = need;
    }
    return 1;
}

/* The pieces of [off, off+len) under the map; 0: not C's to serve. A piece
   with fd -1 is zeros (an extent table's ZERO granules): those need the
   tag's buffer, so in the zero-copy modes such a request is Python's. */
static unsigned dp_resolve(struct aur_dp *dp, struct dp_tag *t, uint64_t off, uint32_t len,
                           int write, struct dp_piece *p)
{
    struct aur_ext_piece ep[DP_MAX_PIECES];
    size_t zneed = 0;
    uint32_t pos = 0;
    unsigned n = 0, i, nc = 0;
    int got;

    switch (dp->map) {
    case AUR_MAP_LINEAR:
        p[0] = (struct dp_piece){ dp->fds[0], len, dp->base + off, 0, 0, 0, 0 };
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
                                        (idx / dp->nr_fds) * dp->chunk + within, pos,
                                        0, 0, 0 };
            pos += l;
        }
        return n;
    case AUR_MAP_EXTENTS:
        got = aur_ext_acquire_cow(dp->ext, off, len, write, dp->ext_slot, ep, DP_MAX_PIECES,
                                  t->ids, DP_MAX_PIECES, dp_can_cow(dp) ? t->copies : NULL,
                                  &nc);
        if (got <= 0)
            return 0;
        t->nr_ids = (uint16_t)(((off + len - 1) >> dp->ext_shift) - (off >> dp->ext_shift) + 1);
        t->nr_copies = (uint8_t)nc;
        if (nc && !t->bounce &&
            posix_memalign(&t->bounce, 4096, (size_t)2 << dp->ext_shift)) {
            t->bounce = NULL;   /* (no memory for the copies: Python's) */
            aur_ext_release(dp->ext, t->ids, t->nr_ids, AUR_EXT_UNUSED);
            t->nr_ids = 0;
            t->nr_copies = 0;
            return 0;
        }
        for (i = 0; i < (unsigned)got; i++) {
            if ((ep[i].fd < 0 || ep[i].zalg) && dp_zero_copy(dp)) {
                aur_ext_release(dp->ext, t->ids, t->nr_ids, AUR_EXT_UNUSED);
                t->nr_ids = 0;
                return 0;
            }
            p[i] = (struct dp_piece){ ep[i].fd, ep[i].len, ep[i].host_off, pos,
                                      ep[i].zlen, ep[i].zskip, (uint8_t)ep[i].zalg };
            if (ep[i].zalg)
                zneed += DP_ZIP_READ(ep[i].host_off, ep[i].zlen);
            pos += ep[i].len;
        }
        t->has_zip = zneed != 0;
        if ((zneed || nc) && !dp_zip_room(t, zneed)) {  /* (no memory: Python's) */
            aur_ext_release(dp->ext, t->ids, t->nr_ids, AUR_EXT_UNUSED);
            t->nr_ids = 0;
            return 0;
        }
        return (unsigned)got;
    case AUR_MAP_NVME:  /* one command, in whole blocks, at most 2^16 of them */
        if (((off | len) & ((1u << dp->lba_shift) - 1)) || (len >> dp->lba_shift) > 65536)
            return 0;
        p[0] = (struct dp_piece){ dp->fds[0], len, off, 0, 0, 0, 0 };
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

/* One read or write of a file for a request, by the ring, or now in this
   thread where the ring would pass it to a worker (dp_inline_fd): 0, or
   -EBUSY when the SQ has no room. */
static int dp_file_rw(struct aur_dp *dp, int write, int fd, void *buf, uint32_t len,
                      uint64_t off, uint64_t ud)
{
    if (dp_inline_fd(dp, fd)) {
        dp_inline_rw(dp, write, fd, buf, len, off, ud);
        return 0;
    }
    if (!dp_sq_room(dp, 1))
        return -EBUSY;
    return aur_prep(dp->r, write ? IORING_OP_WRITE : IORING_OP_READ, fd,
                    (uint64_t)(uintptr_t)buf, len, off, 0, 0, 0, ud) < 0 ? -EBUSY : 0;
}

/* len bytes from src_fd at src to dst_fd at dst by copy_file_range, for
   files both on tmpfs or ramfs: one copy in the kernel, where a read and a
   write through the bounce buffer make two. len, -errno, or 0 if the kernel
   will not copy between them (dp->no_copy_range set: the caller moves the
   bytes itself, now and from then on). A source that ends early is -EIO,
   as a short read is. */
static int32_t dp_copy_range(struct aur_dp *dp, int src_fd, uint64_t src, int dst_fd,
                             uint64_t dst, uint32_t len)
{
    loff_t s = (loff_t)src, d = (loff_t)dst;
    uint32_t left = len;

    while (left && !dp->no_copy_range) {
        ssize_t n = copy_file_range(src_fd, &s, dst_fd, &d, left, 0);

        if (n > 0) {
            left -= (uint32_t)n;
        } else if (n == 0) {
            return -EIO;
        } else if (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP ||
                   errno == ENOSYS) {
            dp->no_copy_range = 1;  /* (what was copied is copied again) */
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return left ? 0 : (int32_t)len;
}

/* A merged copy-on-write of a granule not compressed, both files on tmpfs or
   ramfs, now: the old data beside the write copied in the kernel, the
   write's data written; one piece, done. 0 if the kernel will not copy
   (dp_copy_range): the caller merges through the bounce buffer instead. */
static int dp_merged_now(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                         const struct dp_piece *p, uint64_t d0, uint64_t d1)
{
    const struct aur_ext_copy *c = &t->copies[0];
    uint64_t shift = c->src_off - c->dst_off, w1 = p->host_off + p->len;
    int32_t res = (int32_t)(d1 - d0);

    if (!dp_inline_fd(dp, c->src_fd) || !dp_inline_fd(dp, p->fd))
        return 0;
    if (p->host_off > d0)
        res = dp_copy_range(dp, c->src_fd, d0 + shift, p->fd, d0, (uint32_t)(p->host_off - d0));
    if (res > 0 && d1 > w1)
        res = dp_copy_range(dp, c->src_fd, w1 + shift, p->fd, w1, (uint32_t)(d1 - w1));
    if (res == 0)
        return 0;
    if (res > 0) {
        ssize_t got = pwrite(p->fd, dp_buf(dp, local, tag), p->len, (off_t)p->host_off);

        res = got == (ssize_t)p->len ? (int32_t)(d1 - d0) : got < 0 ? -errno : -EIO;
    }
    dp->done[dp->nr_done++] = (struct dp_done){ DP_UD(DP_K_RW, local, tag, (d1 - d0) >> 9), res };
    t->pending++;
    return 1;
}

/* The backend I/O of pieces p[0..n), each one more pending piece; a piece
   the ring cannot take marks the request bad and stops there. */
static void dp_queue_pieces(struct aur_dp *dp, unsigned local, uint16_t tag,
                            const struct dp_piece *p, unsigned n)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    uint32_t zat = 0;
    unsigned i;

    for (i = 0; i < n; i++) {
        uint64_t ud = DP_UD(DP_K_RW, local, tag, p[i].len >> 9);
        int op, ret;

        if (dp->map == AUR_MAP_EXTENTS)  /* (the table's fds live as long as the map) */
            aur_fix_file(dp->r, p[i].fd);
        if (p[i].zalg) {  /* its compressed bytes now, the inflate when they are in */
            struct dp_zip *z = &t->zips[t->nr_zips];
            uint32_t rd_len = (uint32_t)DP_ZIP_READ(p[i].host_off, p[i].zlen);
            uint64_t rd_off = p[i].host_off - DP_ZIP_LEAD(p[i].host_off);

            *z = (struct dp_zip){ zat, DP_ZIP_LEAD(p[i].host_off), p[i].zlen, p[i].zskip,
                                  p[i].len, p[i].buf_off, p[i].zalg, p[i].fd,
                                  p[i].host_off };
            ud = DP_UD(DP_K_ZIP, local, tag, t->nr_zips++);
            ret = dp_file_rw(dp, 0, p[i].fd, t->zbuf + zat, rd_len, rd_off, ud);
            zat += rd_len;
        } else if (dp->map == AUR_MAP_NVME) {
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

/* How many compressed bytes a read of them brought (res: its result, the
   first lead bytes not theirs), at most zlen; < 0: none, why. A read short
   of zlen (the file ends inside the last sector's padding) is fine if what
   came inflates. */
static int32_t dp_zip_have(int32_t res, uint32_t lead, uint32_t zlen)
{
    if (res < 0)
        return res;
    if ((uint32_t)res <= lead)
        return -EIO;
    return (uint32_t)res - lead > zlen ? (int32_t)zlen : (int32_t)((uint32_t)res - lead);
}

/* A compressed copy c, one more pending piece: the read of its granule's
   compressed bytes, unless the copy before it read the same (a write inside
   a granule leaves its head and its tail: one read, one inflate, two
   writes). Inflated into the bounce buffer at bounce_off. */
static int dp_queue_zcopy(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                          const struct aur_ext_copy *c, uint32_t bounce_off)
{
    struct dp_zcopy *z = t->nr_zcopy ? &t->zcopy[t->nr_zcopy - 1] : NULL;
    uint32_t rd = z ? z->rd + (uint32_t)DP_ZIP_READ(z->c[0]->src_off, z->zlen) : 0;
    uint32_t rd_len = (uint32_t)DP_ZIP_READ(c->src_off, c->zlen);
    uint64_t ud;

    if (z && z->c[0]->src_fd == c->src_fd && z->c[0]->src_off == c->src_off) {
        z->c[z->n++] = c;   /* (its writes are queued with the first's) */
        return 0;
    }
    z = &t->zcopy[t->nr_zcopy];
    *z = (struct dp_zcopy){ rd, DP_ZIP_LEAD(c->src_off), c->zlen, bounce_off,
                            (uint8_t)c->zalg, 1, { c, NULL } };
    ud = DP_UD(DP_K_ZCOPY, local, tag, t->nr_zcopy++);
    aur_fix_file(dp->r, c->src_fd);
    aur_fix_file(dp->r, c->dst_fd);
    if (dp_file_rw(dp, 0, c->src_fd, t->zbuf + rd, rd_len, c->src_off - z->lead, ud) < 0)
        return -EBUSY;
    t->pending++;
    return 0;
}

/* A compressed copy's bytes are in (res: the read's result): inflated as far
   as its last copy needs, and each copy's write queued (one more pending
   piece each); 0, or why not. */
static int32_t dp_zcopy_done(struct aur_dp *dp, struct dp_tag *t, unsigned local, uint16_t tag,
                             unsigned k, int32_t res)
{
    const struct dp_zcopy *z = &t->zcopy[k];
    char *out = (char *)t->bounce + z->bounce_off;
    int32_t have = dp_zip_have(res, z->lead, z->zlen);
    uint32_t end = 0;
    unsigned i;

    if (have < 0)
        return have;
    for (i = 0; i < z->n; i++)
        if (z->c[i]->zskip + z->c[i]->len > end)
            end = z->c[i]->zskip + z->c[i]->len;
    if (dp_inflate(dp, z->alg, z->c[0]->src_fd, z->c[0]->src_off, t->zbuf + z->rd + z->lead,
                   (uint32_t)have, out, 0, end))
        return -EIO;
    for (i = 0; i < z->n; i++) {
        const struct aur_ext_copy *c = z->c[i];

        if (dp_file_rw(dp, 1, c->dst_fd, out + c->zskip, c->len, c->dst_off,
                       DP_UD(DP_K_RW, local, tag, c->len >> 9)) < 0)
            return -EBUSY;
        t->pending++;
    }
    return 0;
}

/* A copy-on-write inside one granule, in copy mode (the write's data is in
   the tag's buffer already), one pending piece: the old data the new
   cluster needs around the write read into the bounce buffer in one read
   (a compressed granule's: read and inflated), the write's data put over
   it there when it is in, and all of it written in one write
   (dp_merged_done). Two I/Os where the copies beside the write take five. */
static void dp_queue_merged(struct aur_dp *dp, unsigned local, uint16_t tag,
                            const struct dp_piece *p)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    const struct aur_ext_copy *c = &t->copies[0];
    uint64_t d0 = p->host_off, d1 = p->host_off + p->len, src;
    uint32_t rd_len;
    unsigned i;

    for (i = 0; i < t->nr_copies; i++) {
        if (t->copies[i].dst_off < d0)
            d0 = t->copies[i].dst_off;
        if (t->copies[i].dst_off + t->copies[i].len > d1)
            d1 = t->copies[i].dst_off + t->copies[i].len;
    }
    t->merge = (struct dp_merge){ d0, (uint32_t)(d1 - d0), (uint32_t)(p->host_off - d0),
                                  c->zalg ? (uint32_t)(c->zskip - (c->dst_off - d0)) : 0,
                                  p->fd };
    if (!c->zalg && dp_merged_now(dp, t, local, tag, p, d0, d1))
        return;
    aur_fix_file(dp->r, c->src_fd);
    aur_fix_file(dp->r, p->fd);
    if (c->zalg) {  /* the compressed bytes, into zbuf (as dp_queue_zcopy's) */
        t->zcopy[0] = (struct dp_zcopy){ 0, DP_ZIP_LEAD(c->src_off), c->zlen, 0,
                                         (uint8_t)c->zalg, 0, { NULL, NULL } };
        rd_len = (uint32_t)DP_ZIP_READ(c->src_off, c->zlen);
        src = c->src_off - t->zcopy[0].lead;
        if (dp_file_rw(dp, 0, c->src_fd, t->zbuf, rd_len, src,
                       DP_UD(DP_K_MERGE, local, tag, 0)) < 0) {
            t->bad = -EBUSY;
            return;
        }
    } else if (dp_file_rw(dp, 0, c->src_fd, t->bounce, t->merge.len,
                          d0 + (c->src_off - c->dst_off), DP_UD(DP_K_MERGE, local, tag, 0)) < 0) {
        t->bad = -EBUSY;
        return;
    }
    t->pending++;
}

/* The old data of a merged copy-on-write is in (res: its read's result):
   the write's data over it, and the one write queued; 0, or why not. */
static int32_t dp_merged_done(struct aur_dp *dp, struct dp_tag *t, unsigned local,
                              uint16_t tag, int32_t res)
{
    const struct dp_merge *m = &t->merge;
    char *b = t->bounce;

    if (t->copies[0].zalg) {
        const struct dp_zcopy *z = &t->zcopy[0];
        int32_t have = dp_zip_have(res, z->lead, z->zlen);

        if (have < 0)
            return have;
        if (dp_inflate(dp, z->alg, t->copies[0].src_fd, t->copies[0].src_off, t->zbuf + z->lead,
                       (uint32_t)have, b, m->skip, m->len))
            return -EIO;
    } else if (res != (int32_t)m->len) {
        return res < 0 ? res : -EIO;
    }
    memcpy(b + m->data, dp_buf(dp, local, tag), t->len);
    if (dp_file_rw(dp, 1, m->fd, b, m->len, m->d0, DP_UD(DP_K_RW, local, tag, m->len >> 9)) < 0)
        return -EBUSY;
    t->pending++;
    return 0;
}

/* A copy-on-write's copies: each a read of the backing data into the tag's
   bounce buffer linked to its write into the new cluster (a failed or short
   read cancels the write), two pending pieces; the first that cannot be
   queued marks the request bad and stops there. */
static void dp_queue_copies(struct aur_dp *dp, unsigned local, uint16_t tag)
{
    struct dp_tag *t = dp_tag(dp, local, tag);
    size_t at = 0;
    unsigned i;

    for (i = 0; i < t->nr_copies; i++) {
        const struct aur_ext_copy *c = &t->copies[i];
        uint64_t buf = (uint64_t)(uintptr_t)((char *)t->bounce + at);
        uint64_t ud = DP_UD(DP_K_RW, local, tag, c->len >> 9);

        if (c->zalg) {  /* compressed: read now, inflate and write when it is in */
            if (dp_queue_zcopy(dp, t, local, tag, c, (uint32_t)at) < 0) {
                t->bad = -EBUSY;
                return;
            }
            at += (size_t)1 << dp->ext_shift;
            continue;
        }

        aur_fix_file(dp->r, c->src_fd);
        aur_fix_file(dp->r, c->dst_fd);
        if (dp_inline_fd(dp, c->src_fd) && dp_inline_fd(dp, c->dst_fd)) {
            /* now: in the kernel, one piece; or where it will not copy, both
               through the buffer in order, a read not whole cancelling the write */
            int32_t res = dp_copy_range(dp, c->src_fd, c->src_off, c->dst_fd, c->dst_off,
                                        c->len);

            if (res != 0) {
                dp->done[dp->nr_done++] = (struct dp_done){ ud, res };
                t->pending++;
                at += c->len;
                continue;
            }
            dp_inline_rw(dp, 0, c->src_fd, (void *)(uintptr_t)buf, c->len, c->src_off, ud);
            if (dp->done[dp->nr_done - 1].res == (int32_t)c->len)
                dp_inline_rw(dp, 1, c->dst_fd, (void *)(uintptr_t)buf, c->len, c->dst_off, ud);
            else
                dp->done[dp->nr_done++] = (struct dp_done){ ud, -ECANCELED };
            t->pending += 2;
            at += c->len;
            continue;
        }
        if (!dp_sq_room(dp, 2)) {  /* (the pair in one submission: see dp_sq_room) */
            t->bad = -EBUSY;
            return;
        }
        if (aur_prep(dp->r, IORING_OP_READ, c->src_fd, buf, c->len, c->src_off, 0, 0,
                     IOSQE_IO_LINK, ud) < 0) {
            t->bad = -EBUSY;
            return;
        }
        t->pending++;
        if (aur_prep(dp->r, IORING_OP_WRITE, c->dst_fd, buf, c->len, c->dst_off, 0, 0, 0,
                     ud) < 0) {  /* (cannot be: room for both was made) */
            t->bad = -EBUSY;
            return;
        }
        t->pending++;
        at += c->len;
    }
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

/* ZIP pieces the plane's cache of inflated clusters holds, copied into the
   tag's buffer now: they need no I/O. The other pieces are moved to the
   front; returns how many. */
static unsigned dp_fill_inflated(struct aur_dp *dp, unsigned local, uint16_t tag,
                                 struct dp_piece *p, unsigned n)
{
    char *buf = dp_buf(dp, local, tag);
    unsigned i, k = 0;

    for (i = 0; i < n; i++)
        if (!p[i].zalg ||
            !dp_zcache_get(dp, p[i].fd, p[i].host_off, buf + p[i].buf_off, p[i].zskip, p[i].len))
            p[k++] = p[i];
    return k;
}

/* A fetched request: 1 if C serves it, 0 if it is Python's. */
DP_HIDDEN int dp_serve(struct aur_dp *dp, struct dp_out *o, unsigned local, uint16_t tag)
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
            op == UBLK_IO_OP_WRITE_ZEROES) {
            int ret = dp_nvme_other(dp, local, tag, op, off, len, d->op_flags);

            if (ret != DP_NVME_NOTHING)
                return ret;
            dp_tag_start(t, 0, 0, 0);  /* done at once, as the null map's */
            dp->served++;
            dp->inflight++;
            t->served = 1;
            dp_complete(dp, o, local, tag, 0);
            return 1;
        }
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
    /* its CQEs at most: the pieces, -z's register and unregister, -u's copy,
       a copy-on-write's reads and writes */
    need = n - nz + (dp->s.mode == AUR_DP_ZERO_COPY ? 2 : 0) + (unsigned)uc +
           2u * t->nr_copies;
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
    if (t->has_zip)  /* (a read's: a write to ZIP granules misses) */
        n = dp_fill_inflated(dp, local, tag, p, n);
    if (t->nr_copies && n == 1 && t->nr_ids == 1 && !uc) {  /* one granule: merged */
        dp_queue_merged(dp, local, tag, p);
        goto queued;
    }
    if (t->nr_copies)  /* (a write: it has pieces, the copies go beside them) */
        dp_queue_copies(dp, local, tag);
    if (!n && !uc) {  /* in the buffer already (zeros, cached): done, as the null map */
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
queued:
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

/* A ZIP piece's compressed bytes are in (res: the read's result): its part
   inflated into buf; 0, or why not. */
static int32_t dp_zip_done(struct aur_dp *dp, struct dp_tag *t, char *buf, unsigned k,
                           int32_t res)
{
    const struct dp_zip *z = &t->zips[k];
    int32_t have = dp_zip_have(res, z->lead, z->zlen);

    if (have < 0)
        return have;
    return dp_inflate(dp, z->alg, z->fd, z->zoff, t->zbuf + z->rd + z->lead, (uint32_t)have,
                      buf + z->buf_off, z->skip, z->len) ? -EIO : 0;
}

DP_HIDDEN void dp_rw_done(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res)
{
    unsigned local = DP_LOCAL(ud);
    uint16_t tag = DP_TAG(ud);
    struct dp_tag *t = dp_tag(dp, local, tag);

    if (DP_KIND(ud) == DP_K_REG) {
        if (DP_AUX(ud) && res < 0 && !t->bad)  /* (an unregister's result changes nothing) */
            t->bad = res;
    } else if (DP_KIND(ud) == DP_K_ZIP) {
        if (!t->bad)
            t->bad = dp_zip_done(dp, t, dp_buf(dp, local, tag), DP_AUX(ud), res);
    } else if (DP_KIND(ud) == DP_K_ZCOPY) {
        if (!t->bad)
            t->bad = dp_zcopy_done(dp, t, local, tag, DP_AUX(ud), res);
    } else if (DP_KIND(ud) == DP_K_MERGE) {
        if (!t->bad)
            t->bad = dp_merged_done(dp, t, local, tag, res);
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
