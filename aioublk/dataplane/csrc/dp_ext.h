/*
 * An external map: the data plane's requests served by a plug-in that lives
 * in another extension (the nbd target's, aioublk/targets/csrc/nbd.c), called
 * through this table of function pointers, never through Python.
 *
 * Python hands the table's and the plug-in context's addresses to the data
 * plane once (aur_dp_map_extern); the data plane binds the context to
 * itself (bind: 0, or -errno to refuse), saying which requests it will
 * hand over (nr_queues local queues of depth tags) and giving the two
 * entry points the plug-in calls back. Everything below runs on the
 * worker's thread.
 *
 * - submit: a READ or WRITE of [off, off+len) with its data in buf (the
 *   tag's buffer: copy mode only). 0: taken, and done() is called exactly
 *   once for it, now or later; < 0: not taken, done() never comes, Python
 *   serves the request.
 * - done(dp, local, tag, err): the plug-in's answer, err 0 (all of it
 *   moved) or -errno. The data plane handles it on its next pass, as a CQE:
 *   success commits the request, anything else hands it to Python from the
 *   start (AUR_DP_EV_RETRY), which decides what an error means.
 * - wants(ctx, &fd): the fd the plug-in needs watched (-1: none) and for
 *   what (AUR_EXT_IN, AUR_EXT_OUT), plus AUR_EXT_PY when Python must look
 *   (the data plane hands it an AUR_DP_EV_EXT record). Asked after every
 *   submit and every ready, and by kick.
 * - ready(ctx, revents): the watched fd's poll result (poll(2) bits, or
 *   -errno when the poll itself failed).
 * - flush(ctx), optional: the pass handed over what it had; send it now
 *   (a plug-in may gather a pass's requests into one send).
 * - recv(ctx, &iov) and received(ctx, res), optional: while the plug-in
 *   wants AUR_EXT_IN, a READV of the fd on the ring instead of a poll:
 *   recv gives the buffers (their count; 0: poll instead), and received
 *   the read's result (bytes, 0 at end of file, or -errno). One read is in
 *   flight at a time. When the plug-in lets go of the fd, the read is
 *   cancelled by the submit that ends that pass, before Python sees what
 *   the pass answered; one that completed before is ignored (its result is
 *   never handed over), and the next read is asked for only after it has.
 * - send(ctx, &msg) and sent(ctx, res), optional: while the plug-in wants
 *   AUR_EXT_OUT, a SENDMSG of msg on the ring instead of a poll: send
 *   gives the message (1; 0: poll instead), sent its result. One at a time;
 *   msg and what it points to stay valid until sent, or until the fd is
 *   let go of (the plug-in shuts the socket down first, so that a send
 *   cancelled late reads nothing).
 * - kick(dp): from the plug-in, outside the data plane's pass (Python did
 *   something on the connection): ask wants() again. Returns nonzero when
 *   the ring has work queued (Python ends its loop turn with a submit).
 */
#ifndef AIOUBLK_DP_EXT_H
#define AIOUBLK_DP_EXT_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

struct aur_dp;

/* wants() */
#define AUR_EXT_IN 1
#define AUR_EXT_OUT 2
#define AUR_EXT_PY 4

/* submit()'s ops (UBLK_IO_OP_READ and _WRITE) */
#define AUR_EXT_READ 0
#define AUR_EXT_WRITE 1

typedef void (*aur_dp_ext_done_fn)(struct aur_dp *dp, unsigned local, uint16_t tag, int err);
typedef int (*aur_dp_ext_kick_fn)(struct aur_dp *dp);

struct aur_dp_ext {
    int (*bind)(void *ctx, struct aur_dp *dp, unsigned nr_queues, unsigned depth,
                aur_dp_ext_done_fn done, aur_dp_ext_kick_fn kick);
    int (*submit)(void *ctx, unsigned local, uint16_t tag, unsigned op, uint64_t off,
                  uint32_t len, void *buf);
    unsigned (*wants)(void *ctx, int *fd);
    void (*ready)(void *ctx, int revents);
    void (*flush)(void *ctx);
    int (*recv)(void *ctx, struct iovec **iov);
    void (*received)(void *ctx, int res);
    int (*send)(void *ctx, struct msghdr **msg);
    void (*sent)(void *ctx, int res);
};

#endif
