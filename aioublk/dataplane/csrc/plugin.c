/*
 * An external map's plug-in (plugin.h, dp_ext.h): bound to the data plane,
 * its fd watched on the ring (polls, or a READV and a SENDMSG for it), and
 * its answers and kicks, which come through the table it was handed.
 */

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/socket.h>
#include <liburing.h>

#include "dp_internal.h"
#include "plugin.h"

/* Ask the plug-in what it wants, and make the polls say it: o, a CQE's
   records (NULL: none may be added now). Returns 1 if SQEs were queued. */
DP_HIDDEN int dp_ext_watch(struct aur_dp *dp, struct dp_out *o)
{
    struct dp_ext *e = dp->ext_map;
    unsigned want, bit;
    int fd = -1, queued = 0;

    want = e->ops->wants(e->ctx, &fd);
    if (fd != e->fd) {
        for (bit = AUR_EXT_IN; bit <= AUR_EXT_OUT; bit <<= 1) {
            /* (a bit's is a READV or SENDMSG while one is in flight) */
            unsigned what = bit == AUR_EXT_IN && e->reading ? DP_EXT_RECV :
                bit == AUR_EXT_OUT && e->sending ? DP_EXT_SEND : bit;

            if ((e->armed & bit) && aur_prep(dp->r, IORING_OP_ASYNC_CANCEL, -1,
                                             dp_ext_ud(e->gen, what), 0, 0, 0, 0, 0,
                                             dp_ext_ud(e->gen, 0)) == 0)
                queued = 1;
        }
        e->armed = 0;
        e->gen = (e->gen + 1) & DP_EXT_GEN_MASK;
        e->fd = fd;
    }
    for (bit = AUR_EXT_IN; fd >= 0 && bit <= AUR_EXT_OUT; bit <<= 1) {
        if (!(want & bit) || (e->armed & bit))
            continue;
        if (bit == AUR_EXT_IN && e->ops->recv) {
            struct iovec *iov;
            int n;

            if (e->reading)
                continue;  /* (an old fd's read still has the buffers) */
            if ((n = e->ops->recv(e->ctx, &iov)) > 0) {
                if (aur_prep(dp->r, IORING_OP_READV, fd, (uintptr_t)iov, (uint32_t)n, 0, 0,
                             0, 0, dp_ext_ud(e->gen, DP_EXT_RECV)) == 0) {
                    e->armed |= bit;
                    e->reading = 1;
                    queued = 1;
                }
                continue;
            }
        }
        if (bit == AUR_EXT_OUT && e->ops->send) {
            struct msghdr *msg;

            if (e->sending)
                continue;
            /* MSG_WAITALL: what the socket cannot take at once the ring
               sends as it drains, with no CQE (and pass) per part */
            if (e->ops->send(e->ctx, &msg) > 0) {
                if (aur_prep(dp->r, IORING_OP_SENDMSG, fd, (uintptr_t)msg, 1, 0,
                             MSG_NOSIGNAL | MSG_WAITALL,
                             0, 0, dp_ext_ud(e->gen, DP_EXT_SEND)) == 0) {
                    e->armed |= bit;
                    e->sending = 1;
                    queued = 1;
                }
                continue;
            }
        }
        if (aur_prep(dp->r, IORING_OP_POLL_ADD, fd, 0, 0, 0,
                     bit == AUR_EXT_IN ? POLLIN : POLLOUT, 0, 0, dp_ext_ud(e->gen, bit)) == 0) {
            e->armed |= bit;
            queued = 1;
        }
    }
    if (want & AUR_EXT_PY)
        e->py = 1;
    if (e->py) {
        if (o) {
            dp_emit(o, DP_UD(AUR_DP_EV_EXT, 0, 0, 0), 0, 0);
            e->py = 0;
        } else if (!e->nop && aur_prep(dp->r, IORING_OP_NOP, -1, 0, 0, 0, 0, 0, 0,
                                       dp_ext_ud(e->gen, DP_EXT_NOP)) == 0) {
            e->nop = 1;
            queued = 1;
        }
    }
    return queued;
}

/* The plug-in's answer to (local, tag): the CQE it stands for, next pass. */
static void dp_ext_done(struct aur_dp *dp, unsigned local, uint16_t tag, int err)
{
    struct dp_tag *t;

    if (local >= dp->s.nr_queues || tag >= dp->s.depth)
        return;
    t = dp_tag(dp, local, tag);
    if (!t->served || t->pending != 1 || dp->nr_done > dp->max_cqes)
        return;  /* (not one it was given: never) */
    dp->done[dp->nr_done++] = (struct dp_done){ DP_UD(DP_K_RW, local, tag, t->len >> 9),
                                                err ? err : (int32_t)t->len };
}

static int dp_ext_kick(struct aur_dp *dp)
{
    uint64_t one = 1;
    int queued;

    if (!dp->ext_map)
        return 0;
    queued = dp_ext_watch(dp, NULL);
    if (dp->nr_done && write(dp->r->efd, &one, sizeof(one)) < 0) {
        /* the count is full: a wake-up is pending anyway */
    }
    return queued || dp->nr_done;
}

int aur_dp_map_extern(struct aur_dp *dp, const struct aur_dp_ext *ops, void *ctx)
{
    struct dp_ext *e;
    int ret;

    if (dp->ext_map)
        return -EBUSY;
    if (!ops || dp->max_cqes < 2 * DP_EXT_CQES)
        return -EINVAL;
    if (dp->s.mode != AUR_DP_COPY)  /* (the data must be in the tag's buffer) */
        return 0;  /* never bound: the plug-in's owner serves everything */
    if (!dp->done && !(dp->done = malloc((dp->max_cqes + 1) * sizeof(*dp->done))))
        return -ENOMEM;
    if (!(e = calloc(1, sizeof(*e))))
        return -ENOMEM;
    e->ops = ops;
    e->ctx = ctx;
    e->fd = -1;
    ret = ops->bind(ctx, dp, dp->s.nr_queues, dp->s.depth, dp_ext_done, dp_ext_kick);
    if (ret < 0) {
        free(e);
        return ret;
    }
    dp_new_map(dp, NULL, 0);  /* (the plug-in's fd changes with its connections) */
    dp->max_cqes -= DP_EXT_CQES;
    dp->ext_map = e;
    dp->map = AUR_MAP_EXTERN;
    dp_ext_watch(dp, NULL);
    return 0;
}
