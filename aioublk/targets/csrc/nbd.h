/* libnbd for the nbd target (see nbd.c); built into aioublk.targets._nbd,
   not aioublk._uring, and only where libnbd's header is. */
#ifndef AIOUBLK_NBD_H
#define AIOUBLK_NBD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <libnbd.h>

#include "dp_ext.h"

/* cdef: begin (plain declarations and `#define NAME value` only) */
struct anbd_q;
struct anbd_done { uint64_t id; int32_t error; };

int anbd_can_tls_hostname(void);
int anbd_set_tls_hostname(struct nbd_handle *h, const char *hostname);

/* Python's commands: their completions, reaped in bulk */
struct anbd_q *anbd_q_new(void);
void anbd_q_free(struct anbd_q *q);
unsigned anbd_reap(struct anbd_q *q, struct anbd_done *out, unsigned max);
/* kind: the NBD command (ANBD_*); flags: LIBNBD_CMD_FLAG_*; x: the plug-in
   h is plugged into, if any (its own transmission then sends it), or NULL */
#define ANBD_READ 0
#define ANBD_WRITE 1
#define ANBD_FLUSH 3
#define ANBD_TRIM 4
#define ANBD_ZERO 6
struct anbd_ext;
int64_t anbd_cmd(struct nbd_handle *h, struct anbd_q *q, struct anbd_ext *x, unsigned kind,
                 void *buf, uint64_t count, uint64_t offset, uint64_t id, uint32_t flags);

/* The data plane's plug-in (dp_ext.h): one per worker, over its connection */
struct aur_dp_ext;
struct anbd_ext;
/* q: Python's commands on the handles it will plug in (only read while one is) */
struct anbd_ext *anbd_ext_new(int read_only, struct anbd_q *q);
/* only once the data plane it was bound to is freed */
void anbd_ext_free(struct anbd_ext *x);
/* a data plane took it (then Python plugs a handle in) */
int anbd_ext_bound(struct anbd_ext *x);
const struct aur_dp_ext *anbd_ext_ops(void);
/* C sends on h from now on (NULL: on nothing, every request is Python's);
   returns nonzero when the ring has work queued */
int anbd_ext_plug(struct anbd_ext *x, struct nbd_handle *h);
struct nbd_handle *anbd_ext_handle(struct anbd_ext *x);
/* after Python used the plugged handle: the fd's watch may change */
int anbd_ext_kick(struct anbd_ext *x);
/* libnbd's error when C saw the connection fail ("" if none) */
const char *anbd_ext_why(struct anbd_ext *x);
/* C moves the bytes itself (no TLS): 1; through libnbd: 0 */
int anbd_ext_own(struct anbd_ext *x);
/* the reads and the sends of its socket the ring made */
uint64_t anbd_ext_reads(struct anbd_ext *x);
uint64_t anbd_ext_sends(struct anbd_ext *x);
/* bytes of replies' data the plug-in copied out of its stage, not read in place */
uint64_t anbd_ext_staged(struct anbd_ext *x);
/* commands C sent, and those answered with an error */
uint64_t anbd_ext_sent(struct anbd_ext *x);
uint64_t anbd_ext_failed(struct anbd_ext *x);
/* cdef: end */

#endif
