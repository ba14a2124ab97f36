/*
 * An external map (AUR_MAP_EXTERN, dp_ext.h): the plug-in's state and the
 * steps the per-request path takes through it (static inline: serve.c's
 * submit, reap.c's completions, commands.c's flush); the rest is plugin.c.
 *
 * A plug-in in another extension moves the data (the nbd target: libnbd on
 * a socket). C hands it each READ and WRITE the way it would queue backend
 * pieces: the request holds one reserved CQE, and the plug-in's answer
 * (dp_ext_done) waits in dp->done as the CQE it stands for, handled by
 * dp_rw_done once the call that produced it has returned: success
 * commits, anything else is Python's from the start. So an answer that
 * comes while the plug-in is being called, even from Python (closing its
 * connection fails what is in flight), is never handled inside that call.
 *
 * The plug-in's fd is watched on this ring: one-shot polls for what it
 * wants (readable, writable), re-armed after each completion, their
 * user_data DP_UD(DP_K_EXT, 0, 0, gen << 3 | what). When the fd changes (a
 * new connection, or none) the polls of the old one are removed and gen
 * moves on, so a late completion of theirs is ignored: a poll holds its
 * file, and a socket the plug-in closed would stay open under it. When the
 * plug-in asks for Python (AUR_EXT_PY) outside a CQE's handling, a NOP
 * (what DP_EXT_NOP) brings the record on the next pass, so no CQE ever
 * makes more records than dp->room allows.
 */
#ifndef AIOUBLK_DP_PLUGIN_H
#define AIOUBLK_DP_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "dp_ext.h"
#include "dp_internal.h"

#define DP_EXT_NOP 4
#define DP_EXT_RECV 5
#define DP_EXT_SEND 6
#define DP_EXT_GEN_MASK 0x1fff
/* CQEs kept for the plug-in's own: two polls, a NOP, removes and the
   polls of an old fd completing late */
#define DP_EXT_CQES 16

_Static_assert(AUR_EXT_READ == UBLK_IO_OP_READ && AUR_EXT_WRITE == UBLK_IO_OP_WRITE,
               "dp_ext.h's ops are ublk's");

struct dp_ext {
    const struct aur_dp_ext *ops;
    void *ctx;
    int fd;            /* what the polls in flight watch; -1: none */
    unsigned gen;      /* fd's generation */
    unsigned armed;    /* AUR_EXT_IN, AUR_EXT_OUT: its polls in flight */
    int nop;           /* a NOP is in flight */
    int reading;       /* a READV is in flight (of fd, or of an fd let go of) */
    int sending;       /* a SENDMSG is in flight (the same) */
    int py;            /* Python is to be told (by the NOP's completion) */
};

static inline uint64_t dp_ext_ud(unsigned gen, unsigned what)
{
    return DP_UD(DP_K_EXT, 0, 0, (gen & DP_EXT_GEN_MASK) << 3 | what);
}

/* The pass handed the plug-in what it had: it sends it (and says what it
   waits for: a socket that took only part). */
static inline void dp_ext_flush(struct aur_dp *dp)
{
    struct dp_ext *e = dp->ext_map;

    if (e && e->ops->flush) {
        e->ops->flush(e->ctx);
        dp_ext_watch(dp, NULL);
    }
}

/* dp_serve's step for AUR_MAP_EXTERN: 1 if the plug-in took the request. */
static inline int dp_ext_serve(struct aur_dp *dp, struct dp_tag *t, unsigned local,
                               uint16_t tag, unsigned op, uint64_t off, uint32_t len)
{
    struct dp_ext *e = dp->ext_map;
    int ret;

    /* one CQE held for its answer */
    if (!dp->q[local].bufs || dp->cqes + 1 > dp->max_cqes)
        return 0;
    t->pending = 1;
    t->cqes = 1;
    t->served = 1;
    ret = e->ops->submit(e->ctx, local, tag, op, off, len, dp_buf(dp, local, tag));
    if (ret == 0) {
        dp->cqes++;
        dp->served++;
        dp->inflight++;
    } else {
        t->pending = 0;
        t->cqes = 0;
        t->served = 0;
    }
    dp_ext_watch(dp, NULL);
    return ret == 0;
}

static inline void dp_ext_cqe(struct aur_dp *dp, struct dp_out *o, uint64_t ud, int32_t res)
{
    struct dp_ext *e = dp->ext_map;
    unsigned what = DP_AUX(ud) & 7, gen = DP_AUX(ud) >> 3;

    if (!e)
        return;
    if (what == DP_EXT_NOP) {
        e->nop = 0;
    } else if (what == DP_EXT_RECV) {
        e->reading = 0;  /* the buffers are the plug-in's again */
        if (gen == e->gen) {
            e->armed &= ~AUR_EXT_IN;
            e->ops->received(e->ctx, res);
        }
    } else if (what == DP_EXT_SEND) {
        e->sending = 0;
        if (gen == e->gen) {
            e->armed &= ~AUR_EXT_OUT;
            e->ops->sent(e->ctx, res);
        }
    } else if (what == AUR_EXT_IN || what == AUR_EXT_OUT) {
        if (gen != e->gen)
            return;  /* a poll of an fd no longer watched */
        e->armed &= ~what;
        e->ops->ready(e->ctx, res);
    } else {
        return;  /* a remove's answer */
    }
    dp_ext_watch(dp, o);
}

#endif
