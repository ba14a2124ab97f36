/*
 * The extent table: where the C data plane looks up a request's data.
 *
 * Why one entry per granule (a qcow2 cluster, say) and not ranges: Python
 * publishes what it has learnt cluster by cluster (one L2 entry at a time)
 * and takes it back cluster by cluster (a COW, a discard, an L2 eviction).
 * Ranges would have to be split and merged on every such change; granules
 * never are. A request spanning several granules pays one lookup each, and
 * adjacent granules that are also adjacent on the host are merged back into
 * one piece, so the backend still sees one SQE for a contiguous run.
 *
 * Why a hash index over a slab, and not a sorted array or a tree: an image
 * may have a million clusters mapped, and every lookup, insert and removal
 * must stay O(1) however full the table is; a sorted array would move memory
 * on every insert, a tree would chase pointers on every request. Entries
 * live in one array (the slab) and are named by their index: the id a
 * request holds stays valid when the slab grows, because growing moves the
 * array but renumbers nothing. The slab and the bucket array grow by
 * doubling, never past max_entries, so memory is bounded by the caller.
 *
 * Why entries outlive their removal: the rule the data plane relies on is
 * that a mapping a request resolved stays valid until the request completes.
 * Python removes an extent first and waits until aur_ext_busy says no
 * request holds it (aioublk.dataplane.extents.ExtentTable.unmap), then changes the
 * cluster. A removed entry that requests still hold leaves the index at once
 * (no new request can find it) but keeps its slot on a "removed but busy"
 * list, where aur_ext_busy still counts it, until its last release frees
 * the slot. That list is short: it holds only what in-flight requests hold.
 * Its slots count against max_entries, which keeps the memory bound exact;
 * an insert that finds the table full is merely not cached.
 *
 * Why kinds: a granule is either data somewhere (MAP: fd, host offset,
 * writable) or known to read as zeros (ZERO: a qcow2 cluster that is
 * unallocated with no backing data under it, or has its zero flag). A read
 * of a ZERO granule needs no backend I/O at all: acquire hands it out as a
 * piece with fd -1, which the data plane fills with zeros; a write to it is a
 * miss, because only Python may decide where its data goes. Invalidation,
 * busy counts and the removed-but-busy list treat every kind alike, so the
 * rule above holds for zeros too: Python unmaps a ZERO granule before it
 * gives it data.
 *
 * Why allocation here (ALLOC): an empty qcow2 cluster written for the first
 * time needs a host cluster, and going to Python for one costs a loop turn
 * and a dozen frames per request. So Python counts clusters ahead of need
 * (their refcounts raised, their bytes zero: Python's promise when it adds
 * them) and hands them to a pool, one pool per slot (a data plane, from
 * aur_ext_attach), and a write to an ALLOC granule takes the head of its
 * writer's pool. The entry is ALLOCATING while that write is in flight: it
 * holds the host offset and slot, counts in-flight like any hold, and any
 * other acquire of it, read or write, is a miss (its data is neither zeros
 * nor settled). The acquisition's id carries AUR_EXT_ID_ALLOC, so release
 * knows which of its granules it allocated, and release takes an outcome:
 *  - DONE: the entry becomes MAP, writable, at that host offset in the
 *    allocation fd (aur_ext_set_alloc: the pool's clusters are in one file,
 *    so the fd belongs to the pools, not to each entry), and a record
 *    (gran, host_off, OK, slot) goes to the log;
 *  - FAILED: the entry is ALLOC again, and the cluster, which may hold part
 *    of a write, is not reused: a FAILED record tells Python to free it;
 *  - UNUSED: nothing was written: the cluster goes back to the head of its
 *    pool and the entry is ALLOC again, with no record.
 * A write to part of an ALLOC granule allocates too: the rest of the
 * cluster reads as zeros because pool clusters are zero. Python learns of
 * every allocation only through the log (aur_ext_drain), which is why the
 * data plane releases before it answers: a record is visible before the
 * guest sees its write complete. An ALLOCATING entry that is invalidated is
 * held like any other (it leaves the index, stays busy until released), and
 * its record is still pushed: Python, which unmaps and then drains before
 * any change, must apply a DONE record for a granule it invalidated (its L2
 * entry now points at host_off, and the guest may have seen the write
 * complete) before it makes the change it invalidated for. An allocation
 * that cannot be recorded is not made: a write to an ALLOC granule is a
 * miss when its pool is empty or the log has no room for every record the
 * allocations in flight will push (the log's room is reserved at acquire).
 *
 * Why COW: an overlay's cluster whose data is still in its backing file is
 * read from there (MAP, read-only), but its first write would go to Python
 * for a copy-on-write: a cluster, the rest of the old data copied around the
 * write, an L2 entry. A COW granule is that data with the allocation above
 * delegated too: a write takes the head of the writer's pool as for ALLOC,
 * and acquire also says which bytes of the old data the write leaves (the
 * first granule's head, the last one's tail), which the writer copies into
 * the new cluster before it releases DONE. The entry keeps where its data
 * was while ALLOCATING, so FAILED and UNUSED make it COW again there; DONE
 * makes it MAP in the new cluster and pushes a record as for ALLOC.
 * COW_SUB is COW for an image with subclusters (qcow2's extended L2): a write
 * copies only the rest of the subclusters it touches, and its record says
 * which (subs).
 *
 * Why SUB: after that first write the granule is part new data, part still
 * where it was, and a VM's next write to the cluster is most likely to a
 * subcluster still in the backing file. A SUB granule keeps both places and
 * which subclusters are where (subs): a read takes each subcluster's bytes
 * from where they are, a write to subclusters already data goes in place,
 * and one to others copies the rest of them as COW_SUB does, into the
 * cluster the granule already has (no pool), holding it exclusively as an
 * allocation does; DONE adds them to subs and pushes a record (GROWN: the
 * subclusters that are data now), FAILED and UNUSED leave the granule as
 * it was (what a failed write left in subclusters that are not data is
 * never read: their next write covers them whole, copies included). Once
 * every subcluster is data the granule is MAP.
 *
 * Why ZIP: a cloud image is a compressed qcow2 base under an overlay, and
 * every read of a cluster the VM has not written inflates one of the base's
 * compressed clusters. Going to Python for that costs a coroutine through
 * two image layers per request; the compressed bytes' place (fd, offset,
 * length) and algorithm are as fixed as any backing data, so they are
 * published like it, and the reader inflates them itself. A ZIP granule is
 * never merged with its neighbours (its piece says which part of the
 * inflated granule the request wants) and is never written: a write is a
 * miss, the target's copy-on-write. ZIP_COW is ZIP with that copy-on-write
 * delegated as for COW: the copies acquire returns name the compressed
 * bytes and the parts of the inflated granule the write leaves.
 *
 * Why a notify eventfd: Python's owner loop must refill pools, drain the log
 * and finish unmaps promptly while the data plane threads never enter
 * Python. C adds 1 to it when a slot's pool drops to half its capacity (once
 * until the next pool_add to that slot), when the log reaches half full, and
 * when a removed-but-busy entry is freed while the owner says it waits
 * (aur_ext_wait_begin). The write happens after the lock is dropped.
 *
 * Why one mutex: the callers are queue threads with the GIL released, and
 * Python's inserts and invalidations, all short. Every operation is O(1)
 * per granule under the lock except a range invalidation or busy query
 * wider than the table, which scans the slab once instead of probing each
 * granule of the range. A reader-writer lock would not help: acquire writes
 * (it raises in-flight counts).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "extents.h"

#define EXT_NIL UINT32_MAX
#define EXT_MIN_BITS 6
#define EXT_MAX_BITS 31
#define EXT_MAX_ENTRIES (AUR_EXT_ID_ALLOC - 1)  /* an id never has the alloc bit */
#define EXT_ALLOCATING 4                         /* kind: ALLOC, its first write in flight */

enum { EXT_FREE, EXT_LIVE, EXT_GONE };

struct aur_ext_entry {
    uint64_t gran;      /* device granule number */
    uint64_t host_off;  /* host byte offset of the granule's first byte */
    uint64_t src_off;   /* EXT_ALLOCATING from COW: the data it copies from, at */
    int32_t src_fd;     /* src_off in src_fd (-1: from ALLOC, nothing to copy) */
    uint32_t subs;      /* EXT_ALLOCATING from COW_SUB: the subclusters written; SUB:
                           the subclusters that are data at host_off (src_fd and
                           src_off: the others' data, -1 zeros) */
    uint32_t grow;      /* EXT_ALLOCATING from SUB: the subclusters the write adds */
    uint8_t src_kind;   /* EXT_ALLOCATING from COW, COW_SUB or SUB: which */
    int32_t fd;
    uint32_t inflight;  /* acquisitions not yet released */
    uint32_t next;      /* LIVE: hash chain; GONE: removed list; FREE: free list */
    uint32_t prev;      /* GONE: removed list */
    uint8_t state;
    uint8_t writable;
    uint8_t kind;       /* AUR_EXT_MAP, AUR_EXT_COW, AUR_EXT_ZERO, AUR_EXT_ALLOC (fd,
                           host_off unused), ... or EXT_ALLOCATING (host_off, slot
                           and fd set; src_fd and src_off what it was as COW, or
                           the SUB's other subclusters) */
    uint8_t slot;       /* EXT_ALLOCATING: the pool its cluster came from */
    uint8_t zalg;       /* AUR_EXT_ZIP: how host_off's zlen bytes are compressed */
    uint32_t zlen;
};

/* host offsets [head, head + n) (mod cap); out: taken by allocations in flight */
struct ext_pool { uint64_t *c; uint32_t head, n, out; uint8_t asked; };

struct aur_ext {
    pthread_mutex_t mu;
    unsigned shift;
    uint32_t max;       /* live + removed-but-busy never exceed this */
    uint32_t cap;       /* slots allocated */
    uint32_t hw;        /* slots [0, hw) have been handed out at least once */
    uint32_t nfree;     /* slots on the free list */
    uint32_t free_head;
    uint32_t gone_head; /* removed but busy */
    uint32_t live;
    unsigned bits;      /* 1 << bits buckets */
    uint32_t *buckets;
    struct aur_ext_entry *e;
    /* allocation (all 0 until aur_ext_set_alloc) */
    int alloc_fd;
    uint32_t pool_cap, nslots;
    struct ext_pool pool[AUR_EXT_SLOTS];
    struct aur_ext_rec *log;
    uint32_t log_head, log_n, log_cap;
    uint32_t allocating;        /* records the allocations in flight will push */
    int notify_fd;
    int hold_writes;    /* aur_ext_set_hold_writes: read without the lock */
    uint32_t waiters;
    uint64_t locks, contended, done, failed, unused, grown;
};

/* The lock, counting how often it had to be waited for. */
static void ext_lock(struct aur_ext *t)
{
    if (pthread_mutex_trylock(&t->mu)) {
        pthread_mutex_lock(&t->mu);
        t->contended++;
    }
    t->locks++;
}

/* Unlock, then notify the owner if `notify`. */
static void ext_unlock(struct aur_ext *t, int notify)
{
    int fd = t->notify_fd;
    uint64_t one = 1;

    pthread_mutex_unlock(&t->mu);
    if (notify && fd >= 0 && write(fd, &one, sizeof(one)) < 0) {
        /* the counter is full (the owner is far behind) or the fd is gone: it
           has been told already, or will never listen */
    }
}

static uint32_t ext_bucket(const struct aur_ext *t, uint64_t g)
{
    return (uint32_t)((g * 0x9E3779B97F4A7C15ULL) >> (64 - t->bits));
}

static uint32_t *ext_new_buckets(unsigned bits)
{
    uint32_t *b = malloc(sizeof(*b) << bits);

    if (b)
        memset(b, 0xff, sizeof(*b) << bits);   /* every head EXT_NIL */
    return b;
}

static uint32_t ext_find(const struct aur_ext *t, uint64_t g)
{
    uint32_t i = t->buckets[ext_bucket(t, g)];

    while (i != EXT_NIL && t->e[i].gran != g)
        i = t->e[i].next;
    return i;
}

static void ext_link(struct aur_ext *t, uint32_t i)
{
    uint32_t *head = &t->buckets[ext_bucket(t, t->e[i].gran)];

    t->e[i].next = *head;
    *head = i;
}

static void ext_unlink(struct aur_ext *t, uint32_t i)
{
    uint32_t *link = &t->buckets[ext_bucket(t, t->e[i].gran)];

    while (*link != i)
        link = &t->e[*link].next;
    *link = t->e[i].next;
}

static void ext_slot_free(struct aur_ext *t, uint32_t i)
{
    t->e[i].state = EXT_FREE;
    t->e[i].next = t->free_head;
    t->free_head = i;
    t->nfree++;
}

/* A slot; the caller has made room with ext_reserve. */
static uint32_t ext_slot_alloc(struct aur_ext *t)
{
    uint32_t i = t->free_head;

    if (i != EXT_NIL) {
        t->free_head = t->e[i].next;
        t->nfree--;
        return i;
    }
    return t->hw++;
}

/* Room for `need` more slots (need <= max - used, checked by the caller). */
static int ext_reserve(struct aur_ext *t, uint32_t need)
{
    uint64_t want = (uint64_t)t->hw + need - t->nfree, cap = t->cap;
    struct aur_ext_entry *e;

    if (need <= t->nfree || want <= t->cap)
        return 0;
    while (cap < want)
        cap = cap ? cap * 2 : 64;
    if (cap > t->max)
        cap = t->max;
    e = realloc(t->e, cap * sizeof(*e));
    if (!e)
        return -ENOMEM;
    t->e = e;
    t->cap = (uint32_t)cap;
    return 0;
}

/* Grow the index to at least `live` buckets; on ENOMEM chains just get longer. */
static void ext_rehash(struct aur_ext *t, uint64_t live)
{
    unsigned bits = t->bits, old = 1U << t->bits;
    uint32_t *b, *ob = t->buckets, j, i, next;

    while (bits < EXT_MAX_BITS && ((uint64_t)1 << bits) < live)
        bits++;
    if (bits == t->bits || !(b = ext_new_buckets(bits)))
        return;
    t->buckets = b;
    t->bits = bits;
    for (j = 0; j < old; j++)
        for (i = ob[j]; i != EXT_NIL; i = next) {
            next = t->e[i].next;
            ext_link(t, i);
        }
    free(ob);
}

struct aur_ext *aur_ext_new(unsigned granule_shift, unsigned max_entries)
{
    struct aur_ext *t;

    if (granule_shift > 62)
        return NULL;
    t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->buckets = ext_new_buckets(EXT_MIN_BITS);
    if (!t->buckets || pthread_mutex_init(&t->mu, NULL)) {
        free(t->buckets);
        free(t);
        return NULL;
    }
    t->shift = granule_shift;
    t->max = max_entries < EXT_MAX_ENTRIES ? max_entries : EXT_MAX_ENTRIES;
    t->bits = EXT_MIN_BITS;
    t->free_head = EXT_NIL;
    t->gone_head = EXT_NIL;
    t->alloc_fd = -1;
    t->notify_fd = -1;
    return t;
}

void aur_ext_free(struct aur_ext *t)
{
    unsigned k;

    if (!t)
        return;
    pthread_mutex_destroy(&t->mu);
    for (k = 0; k < AUR_EXT_SLOTS; k++)
        free(t->pool[k].c);
    free(t->log);
    free(t->buckets);
    free(t->e);
    free(t);
}

static int ext_same(const struct aur_ext_entry *x, int kind, int fd, uint64_t host_off,
                    int writable, uint32_t zlen, int zalg)
{
    if (x->kind != kind)
        return 0;
    if (kind == AUR_EXT_ZIP || kind == AUR_EXT_ZIP_COW)
        return x->fd == fd && x->host_off == host_off && x->zlen == zlen && x->zalg == zalg;
    return (kind != AUR_EXT_MAP && kind != AUR_EXT_COW && kind != AUR_EXT_COW_SUB &&
            kind != AUR_EXT_SUB) ||
           (x->fd == fd && x->host_off == host_off && x->writable == !!writable);
}

/* Insert granules [g0, g0 + n) under the lock: all or nothing (ZIP: n is 1,
   host_off its compressed bytes' offset, zlen and zalg theirs). */
static int ext_insert_locked(struct aur_ext *t, uint64_t g0, uint64_t n, int kind, int fd,
                             uint64_t host_off, int writable, uint32_t zlen, int zalg)
{
    uint64_t k, need = 0;
    uint32_t i;
    int ret;

    if (n > t->max)     /* could never be mapped at once: no need to look */
        return -ENOSPC;
    for (k = 0; k < n; k++) {
        i = ext_find(t, g0 + k);
        if (i == EXT_NIL)
            need++;
        else if (!ext_same(&t->e[i], kind, fd, host_off + (k << t->shift), writable, zlen,
                           zalg))
            return -EEXIST;
    }
    if (!need)
        return 0;
    if ((uint64_t)t->hw - t->nfree + need > t->max)
        return -ENOSPC;
    ret = ext_reserve(t, (uint32_t)need);
    if (ret)
        return ret;
    ext_rehash(t, (uint64_t)t->live + need);
    for (k = 0; k < n; k++) {
        if (ext_find(t, g0 + k) != EXT_NIL)
            continue;
        i = ext_slot_alloc(t);
        t->e[i] = (struct aur_ext_entry){
            .gran = g0 + k, .state = EXT_LIVE, .kind = (uint8_t)kind,
        };
        if (kind == AUR_EXT_MAP || kind == AUR_EXT_COW || kind == AUR_EXT_COW_SUB ||
            kind == AUR_EXT_SUB) {
            t->e[i].host_off = host_off + (k << t->shift);
            t->e[i].fd = fd;
            t->e[i].writable = !!writable;
        } else if (kind == AUR_EXT_ZIP || kind == AUR_EXT_ZIP_COW) {
            t->e[i].host_off = host_off;
            t->e[i].fd = fd;
            t->e[i].zlen = zlen;
            t->e[i].zalg = (uint8_t)zalg;
        } else {
            t->e[i].fd = -1;
        }
        t->e[i].src_fd = -1;
        ext_link(t, i);
        t->live++;
    }
    return 0;
}

int aur_ext_insert_kind(struct aur_ext *t, uint64_t dev_off, uint64_t len, int kind, int fd,
                        uint64_t host_off, int writable)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1;
    int ret;

    if (kind == AUR_EXT_ZERO || kind == AUR_EXT_ALLOC) {
        fd = -1;
        host_off = 0;
        writable = 0;
    } else if ((kind == AUR_EXT_COW || kind == AUR_EXT_COW_SUB) && fd >= 0) {
        if (kind == AUR_EXT_COW_SUB && t->shift < 9 + 5)
            return -EINVAL;     /* (a subcluster is at least a sector) */
        writable = 0;
    } else if (kind != AUR_EXT_MAP || fd < 0) {
        return -EINVAL;
    }
    if ((dev_off | len | host_off) & gmask ||
        len > UINT64_MAX - dev_off || len > UINT64_MAX - host_off)
        return -EINVAL;
    if (!len)
        return 0;
    ext_lock(t);
    ret = ext_insert_locked(t, dev_off >> t->shift, len >> t->shift, kind, fd, host_off,
                            writable, 0, 0);
    pthread_mutex_unlock(&t->mu);
    return ret;
}

int aur_ext_insert_zip(struct aur_ext *t, uint64_t dev_off, int kind, int fd, uint64_t zoff,
                       uint32_t zlen, int zalg)
{
    int ret;

    if ((kind != AUR_EXT_ZIP && kind != AUR_EXT_ZIP_COW) ||
        fd < 0 || !zlen || (zalg != AUR_EXT_ZLIB && zalg != AUR_EXT_ZSTD) ||
        dev_off & (((uint64_t)1 << t->shift) - 1) || zlen > UINT64_MAX - zoff)
        return -EINVAL;
    ext_lock(t);
    ret = ext_insert_locked(t, dev_off >> t->shift, 1, kind, fd, zoff, 0, zlen, zalg);
    pthread_mutex_unlock(&t->mu);
    return ret;
}

int aur_ext_insert_sub(struct aur_ext *t, uint64_t dev_off, int fd, uint64_t host_off,
                       uint32_t subs, int src_fd, uint64_t src_off)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1, g = dev_off >> t->shift;
    struct aur_ext_entry *x;
    uint32_t i;
    int ret = 0;

    if (t->shift < 9 + 5 || fd < 0 || src_fd < -1 || !subs || subs == 0xffffffffu ||
        (dev_off | host_off | src_off) & gmask || host_off > UINT64_MAX - gmask ||
        src_off > UINT64_MAX - gmask || (src_fd < 0 && src_off))
        return -EINVAL;
    ext_lock(t);
    i = ext_find(t, g);
    if (i != EXT_NIL) {
        x = &t->e[i];
        if (x->kind != AUR_EXT_SUB || x->fd != fd || x->host_off != host_off ||
            x->subs != subs || x->src_fd != src_fd || x->src_off != src_off)
            ret = -EEXIST;
    } else {
        ret = ext_insert_locked(t, g, 1, AUR_EXT_SUB, fd, host_off, 1, 0, 0);
        if (!ret) {
            x = &t->e[ext_find(t, g)];
            x->subs = subs;
            x->src_fd = src_fd;
            x->src_off = src_off;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return ret;
}

int aur_ext_insert(struct aur_ext *t, uint64_t dev_off, uint64_t len, int fd,
                   uint64_t host_off, int writable)
{
    return aur_ext_insert_kind(t, dev_off, len, AUR_EXT_MAP, fd, host_off, writable);
}

/*
 * Publishing a qcow2 L2 table. It lives here, not in Python, because the
 * engine publishes a whole table when it loads one (8192 entries at 64 KiB
 * clusters) and the same rules for one entry when it changes one: one loop
 * under one lock instead of thousands of Python calls, and one place for the
 * rules (aioublk.qcow2.l2cache).
 */
#define QCOW2_COPIED (1ULL << 63)
#define QCOW2_COMPRESSED (1ULL << 62)
#define QCOW2_ZERO 1ULL
#define QCOW2_OFFSET_MASK 0x00fffffffffffe00ULL

static int ext_in_sorted(const uint64_t *a, uint32_t n, uint64_t v)
{
    uint32_t lo = 0, hi = n, mid;

    while (lo < hi) {
        mid = lo + (hi - lo) / 2;
        if (a[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && a[lo] == v;
}

/* The kind L2 entry e of granule g is published as (0: none), and for MAP
   where its data is. */
static int ext_l2_kind(const struct aur_ext *t, const struct aur_pub_rules *r, uint64_t e,
                       uint64_t g, uint64_t *host, int *writable)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1;

    if (e & QCOW2_COMPRESSED)   /* data to inflate: Python's */
        return 0;
    /* zeros: a write may allocate (C, from its pool) where Python lets it and
       no host cluster is kept for the granule already */
    int zeros = r->alloc_ok && !(e & QCOW2_OFFSET_MASK) ? AUR_EXT_ALLOC : AUR_EXT_ZERO;

    if (e & QCOW2_ZERO)         /* zeros, whatever it holds and whatever lies under it */
        return zeros;
    *host = e & QCOW2_OFFSET_MASK;
    if (!*host)                 /* unallocated: zeros unless a backing file shows through */
        return g << t->shift >= r->backing_end ? zeros : 0;
    /* allocated: only where it is plainly data (Python reports the rest) */
    if (*host & gmask || *host >= r->used_end || ext_in_sorted(r->meta, r->nmeta, *host >> t->shift))
        return 0;
    *writable = (e & QCOW2_COPIED) && r->writable_ok;
    return AUR_EXT_MAP;
}

int aur_ext_publish_l2(struct aur_ext *t, int fd, uint64_t dev_base, const uint64_t *entries,
                       unsigned n, const struct aur_pub_rules *r, uint8_t *pub_out,
                       uint64_t *host_out, uint64_t *gran_out)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1, g0 = dev_base >> t->shift, g, host = 0;
    int kind, writable = 0, ret, m = 0;
    unsigned k;

    if (dev_base & gmask || fd < 0 || (n && g0 + n - 1 > UINT64_MAX >> t->shift))
        return -EINVAL;
    ext_lock(t);
    for (k = 0; k < n; k++) {
        g = g0 + k;
        if (g << t->shift >= r->size)
            break;
        if (pub_out[k] || ext_in_sorted(r->skip, r->nskip, g))
            continue;
        kind = ext_l2_kind(t, r, entries[k], g, &host, &writable);
        if (!kind)
            continue;
        ret = ext_insert_locked(t, g, 1, kind, fd, host, writable, 0, 0);
        if (ret == -ENOSPC)
            break;      /* a cache, full: the rest stays Python's */
        if (ret < 0) {
            m = ret;
            break;
        }
        pub_out[k] = (uint8_t)kind;
        if (kind == AUR_EXT_MAP) {
            host_out[m] = host >> t->shift;
            gran_out[m] = g;
            m++;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return m;
}

/* Granules [*g0, *g1] overlapping [off, off + len), clamped to the offset space. */
static int ext_span(const struct aur_ext *t, uint64_t off, uint64_t len,
                    uint64_t *g0, uint64_t *g1)
{
    if (!len)
        return 0;
    *g0 = off >> t->shift;
    *g1 = (len - 1 > UINT64_MAX - off ? UINT64_MAX : off + len - 1) >> t->shift;
    return 1;
}

/*
 * Visit every live entry in granules [g0, g1]: probe each granule, or scan the
 * slab once when the range has more granules than the slab has slots. The
 * visitor may remove the entry it is given.
 */
static void ext_each_live(struct aur_ext *t, uint64_t g0, uint64_t g1,
                          void (*visit)(struct aur_ext *, uint32_t, void *), void *arg)
{
    uint64_t g;
    uint32_t i;

    if (g1 - g0 >= t->hw) {
        for (i = 0; i < t->hw; i++)
            if (t->e[i].state == EXT_LIVE && t->e[i].gran >= g0 && t->e[i].gran <= g1)
                visit(t, i, arg);
        return;
    }
    for (g = g0;; g++) {
        i = ext_find(t, g);
        if (i != EXT_NIL)
            visit(t, i, arg);
        if (g == g1)
            break;
    }
}

static void ext_remove(struct aur_ext *t, uint32_t i, void *arg)
{
    struct aur_ext_entry *x = &t->e[i];

    ext_unlink(t, i);
    t->live--;
    ++*(unsigned *)arg;
    if (!x->inflight) {
        ext_slot_free(t, i);
        return;
    }
    x->state = EXT_GONE;
    x->prev = EXT_NIL;
    x->next = t->gone_head;
    if (x->next != EXT_NIL)
        t->e[x->next].prev = i;
    t->gone_head = i;
}

unsigned aur_ext_invalidate(struct aur_ext *t, uint64_t dev_off, uint64_t len)
{
    uint64_t g0, g1;
    unsigned removed = 0;

    if (!ext_span(t, dev_off, len, &g0, &g1))
        return 0;
    ext_lock(t);
    ext_each_live(t, g0, g1, ext_remove, &removed);
    pthread_mutex_unlock(&t->mu);
    return removed;
}

static void ext_add_inflight(struct aur_ext *t, uint32_t i, void *arg)
{
    *(uint64_t *)arg += t->e[i].inflight;
}

unsigned aur_ext_busy(struct aur_ext *t, uint64_t dev_off, uint64_t len)
{
    uint64_t g0, g1, busy = 0;
    uint32_t i;

    if (!ext_span(t, dev_off, len, &g0, &g1))
        return 0;
    ext_lock(t);
    ext_each_live(t, g0, g1, ext_add_inflight, &busy);
    for (i = t->gone_head; i != EXT_NIL; i = t->e[i].next)
        if (t->e[i].gran >= g0 && t->e[i].gran <= g1)
            busy += t->e[i].inflight;
    pthread_mutex_unlock(&t->mu);
    return busy < UINT32_MAX ? (unsigned)busy : UINT32_MAX;
}

unsigned aur_ext_count(struct aur_ext *t)
{
    unsigned n;

    ext_lock(t);
    n = t->live;
    pthread_mutex_unlock(&t->mu);
    return n;
}

/* Whether the log has room for one more record after the `recs` a request
   will push already, besides those the allocations in flight will push. */
static int ext_can_record(const struct aur_ext *t, int slot, uint32_t recs)
{
    if (slot < 0 || (unsigned)slot >= t->nslots || !t->log_cap)
        return 0;
    return t->log_n + t->allocating + recs < t->log_cap;
}

/* Whether slot's pool can give one more cluster after `taken` to a request,
   with room for its record. */
static int ext_can_alloc(const struct aur_ext *t, int slot, uint32_t taken, uint32_t recs)
{
    return ext_can_record(t, slot, recs) && t->pool[slot].n > taken;
}

static uint64_t ext_pool_at(const struct aur_ext *t, const struct ext_pool *p, uint32_t k)
{
    return p->c[(p->head + k) % t->pool_cap];
}

/* The head of slot's pool to entry x, which becomes ALLOCATING; 1 if the
   pool just dropped to half its capacity (the owner should refill). */
static int ext_alloc(struct aur_ext *t, struct aur_ext_entry *x, unsigned slot)
{
    struct ext_pool *p = &t->pool[slot];

    if (x->kind == AUR_EXT_COW || x->kind == AUR_EXT_COW_SUB ||
        x->kind == AUR_EXT_ZIP_COW) {  /* (restored if the write does not land; a
                                          ZIP_COW's zlen and zalg stay as they were) */
        x->src_fd = x->fd;
        x->src_off = x->host_off;
        x->src_kind = x->kind;
    } else {
        x->src_fd = -1;
        x->src_kind = 0;
    }
    x->subs = 0;
    x->host_off = p->c[p->head];
    p->head = (p->head + 1) % t->pool_cap;
    p->n--;
    p->out++;
    t->allocating++;
    x->kind = EXT_ALLOCATING;
    x->slot = (uint8_t)slot;
    x->fd = t->alloc_fd;
    x->writable = 0;
    if (p->asked || p->n > t->pool_cap / 2)
        return 0;
    p->asked = 1;
    return 1;
}

/* SUB entry x's write makes subclusters `grow` data: it holds x exclusively
   (ALLOCATING, the cluster it has) until released. */
static void ext_grow(struct aur_ext *t, struct aur_ext_entry *x, unsigned slot, uint32_t grow)
{
    x->grow = grow;
    x->src_kind = AUR_EXT_SUB;
    x->kind = EXT_ALLOCATING;
    x->slot = (uint8_t)slot;
    t->allocating++;
}

/* The subclusters of the k-th of n granules that [dev_off, last] touches. */
static uint32_t ext_touched(const struct aur_ext *t, uint64_t k, uint64_t n, uint64_t dev_off,
                            uint64_t last)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1;
    unsigned ss = t->shift - 5;
    unsigned i0 = k ? 0 : (unsigned)((dev_off & gmask) >> ss);
    unsigned i1 = k < n - 1 ? 31 : (unsigned)((last & gmask) >> ss);

    return (i1 == 31 ? 0xffffffffu : (1u << (i1 + 1)) - 1) & ~((1u << i0) - 1);
}

/* Run (fd, h, len) onto the pieces, merged into *last where it goes on from
   it (host-contiguous data, or zeros after zeros); -1 when there is no room. */
static int ext_put(struct aur_ext_piece *pieces, unsigned *np, unsigned max,
                   struct aur_ext_piece **last, int fd, uint64_t h, uint32_t len)
{
    struct aur_ext_piece *p = *last;

    if (p && p->fd == fd && (fd < 0 || p->host_off + p->len == h)) {
        p->len += len;
        return 0;
    }
    if (*np == max)
        return -1;
    p = *last = &pieces[(*np)++];
    *p = (struct aur_ext_piece){ fd, len, h, 0, 0, 0 };
    return 0;
}

/* The part [a, b] (offsets in it) of SUB entry x, for a read: each run of
   subclusters from where it is. */
static int ext_put_sub(const struct aur_ext *t, const struct aur_ext_entry *x, uint64_t a,
                       uint64_t b, struct aur_ext_piece *pieces, unsigned *np, unsigned max,
                       struct aur_ext_piece **last)
{
    unsigned ss = t->shift - 5, si, sj;
    uint64_t end;
    int in;

    while (a <= b) {
        si = (unsigned)(a >> ss);
        in = x->subs >> si & 1;
        for (sj = si; sj < 31 && (int)(x->subs >> (sj + 1) & 1) == in &&
                      ((uint64_t)(sj + 1) << ss) <= b; sj++)
            ;
        end = ((uint64_t)(sj + 1) << ss) - 1;
        if (end > b)
            end = b;
        if (in ? ext_put(pieces, np, max, last, x->fd, x->host_off + a, (uint32_t)(end - a + 1))
               : ext_put(pieces, np, max, last, x->src_fd,
                         x->src_fd >= 0 ? x->src_off + a : 0, (uint32_t)(end - a + 1)))
            return -1;
        a = end + 1;
    }
    return 0;
}

int aur_ext_acquire(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write, int slot,
                    struct aur_ext_piece *pieces, unsigned max_pieces,
                    uint32_t *ids, unsigned max_ids)
{
    return aur_ext_acquire_cow(t, dev_off, len, write, slot, pieces, max_pieces, ids, max_ids,
                               NULL, NULL);
}

int aur_ext_acquire_cow(struct aur_ext *t, uint64_t dev_off, uint32_t len, int write, int slot,
                        struct aur_ext_piece *pieces, unsigned max_pieces,
                        uint32_t *ids, unsigned max_ids,
                        struct aur_ext_copy *copies, unsigned *ncopies)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1, last, g0, g1, n, k, pos, end, h;
    struct aur_ext_piece *p = NULL;
    struct aur_ext_entry *x;
    uint32_t i, plen, taken = 0, recs = 0;
    unsigned np = 0, nc = 0;
    int fd, notify = 0;

    if (ncopies)
        *ncopies = 0;
    if (!len || len - 1 > UINT64_MAX - dev_off)
        return 0;
    last = dev_off + (len - 1);
    g0 = dev_off >> t->shift;
    g1 = last >> t->shift;
    if (g1 - g0 >= max_ids)
        return 0;
    n = g1 - g0 + 1;
    pos = dev_off;
    ext_lock(t);
    for (k = 0; k < n; k++) {
        i = ext_find(t, g0 + k);
        if (i == EXT_NIL)
            goto miss;
        x = &t->e[i];
        ids[k] = i;
        end = (g0 + k) << t->shift | gmask;    /* last byte of this granule */
        if (end > last)
            end = last;
        plen = (uint32_t)(end - pos + 1);
        if (x->kind == EXT_ALLOCATING) {    /* neither zeros nor settled yet */
            goto miss;
        } else if (x->kind == AUR_EXT_SUB) {
            uint64_t a = pos & gmask, b = end & gmask;
            uint32_t touched = ext_touched(t, k, n, dev_off, last);

            if (!write) {
                if (ext_put_sub(t, x, a, b, pieces, &np, max_pieces, &p))
                    goto miss;
                pos = end + 1;
                continue;
            }
            if (!x->writable)
                goto miss;
            if (touched & ~x->subs) {   /* some not data yet: copies the rest of those */
                unsigned ss = t->shift - 5, s0 = (unsigned)(a >> ss), s1 = (unsigned)(b >> ss);
                uint64_t from = (uint64_t)s0 << ss, to = ((uint64_t)(s1 + 1) << ss) - 1;
                int head = !(x->subs >> s0 & 1) && a > from, tail = !(x->subs >> s1 & 1) && to > b;

                if (!copies || !ext_can_record(t, slot, recs) ||
                    ((head || tail) && x->src_fd < 0))  /* (zeros: no copy says that) */
                    goto miss;
                if (head)
                    copies[nc++] = (struct aur_ext_copy){
                        x->src_fd, x->fd, (uint32_t)(a - from), x->src_off + from,
                        x->host_off + from, 0, 0, 0 };
                if (tail)
                    copies[nc++] = (struct aur_ext_copy){
                        x->src_fd, x->fd, (uint32_t)(to - b), x->src_off + b + 1,
                        x->host_off + b + 1, 0, 0, 0 };
                recs++;
                ids[k] |= AUR_EXT_ID_ALLOC;
            }
            fd = x->fd;
            h = x->host_off + a;
        } else if (write && (x->kind == AUR_EXT_ALLOC ||
                             ((x->kind == AUR_EXT_COW || x->kind == AUR_EXT_COW_SUB ||
                               x->kind == AUR_EXT_ZIP_COW) && copies))) {
            uint64_t a = pos & gmask, b = end & gmask;  /* in it */

            if (!ext_can_alloc(t, slot, taken, recs))
                goto miss;
            /* the cluster the commit below gives it (in order: the taken-th) */
            fd = t->alloc_fd;
            h = ext_pool_at(t, &t->pool[slot], taken++);
            recs++;
            if (x->kind != AUR_EXT_ALLOC) {  /* what the write leaves of the granule, or
                                                of the subclusters it touches */
                uint64_t from = 0, to = gmask;

                if (x->kind == AUR_EXT_COW_SUB) {
                    unsigned sshift = t->shift - 5;

                    from = a >> sshift << sshift;
                    to = (b >> sshift << sshift) + ((uint64_t)1 << sshift) - 1;
                }
                if (x->kind == AUR_EXT_ZIP_COW) {  /* the inflated granule's parts */
                    if (a > from)
                        copies[nc++] = (struct aur_ext_copy){
                            x->fd, t->alloc_fd, (uint32_t)(a - from), x->host_off,
                            h + from, x->zlen, (uint32_t)from, x->zalg };
                    if (to > b)
                        copies[nc++] = (struct aur_ext_copy){
                            x->fd, t->alloc_fd, (uint32_t)(to - b), x->host_off,
                            h + b + 1, x->zlen, (uint32_t)(b + 1), x->zalg };
                } else {
                    if (a > from)
                        copies[nc++] = (struct aur_ext_copy){
                            x->fd, t->alloc_fd, (uint32_t)(a - from), x->host_off + from,
                            h + from, 0, 0, 0 };
                    if (to > b)
                        copies[nc++] = (struct aur_ext_copy){
                            x->fd, t->alloc_fd, (uint32_t)(to - b), x->host_off + b + 1,
                            h + b + 1, 0, 0, 0 };
                }
            }
            h += a;
            ids[k] |= AUR_EXT_ID_ALLOC;
        } else if (write && !x->writable) {  /* (ZERO, ALLOC, COW, ZIP never writable) */
            goto miss;
        } else if (x->kind == AUR_EXT_ZIP || x->kind == AUR_EXT_ZIP_COW) {  /* a piece of
                                                               its own, never merged */
            if (np == max_pieces)
                goto miss;
            pieces[np++] = (struct aur_ext_piece){ x->fd, plen, x->host_off, x->zlen,
                                                   (uint32_t)(pos & gmask), x->zalg };
            p = NULL;
            pos = end + 1;
            continue;
        } else {
            fd = x->fd;
            h = x->kind == AUR_EXT_MAP || x->kind == AUR_EXT_COW || x->kind == AUR_EXT_COW_SUB
                ? x->host_off + (pos & gmask) : 0;
        }
        if (ext_put(pieces, &np, max_pieces, &p, fd, h, plen))
            goto miss;
        pos = end + 1;
    }
    for (k = 0; k < n; k++) {
        x = &t->e[ids[k] & ~AUR_EXT_ID_ALLOC];
        x->inflight++;
        if (!(ids[k] & AUR_EXT_ID_ALLOC))
            continue;
        if (x->kind == AUR_EXT_SUB) {
            ext_grow(t, x, (unsigned)slot, ext_touched(t, k, n, dev_off, last) & ~x->subs);
            continue;
        }
        notify |= ext_alloc(t, x, (unsigned)slot);
        if (x->src_kind == AUR_EXT_COW_SUB)  /* the subclusters it makes data */
            x->subs = ext_touched(t, k, n, dev_off, last);
    }
    ext_unlock(t, notify);
    if (ncopies)
        *ncopies = nc;
    return (int)np;
miss:
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* 1 if the log just reached half full. */
static int ext_log_push(struct aur_ext *t, const struct aur_ext_entry *x, uint32_t flags)
{
    uint32_t half = t->log_cap / 2 ? t->log_cap / 2 : 1;

    t->log[(t->log_head + t->log_n) % t->log_cap] = (struct aur_ext_rec){
        .gran = x->gran, .host_off = x->host_off, .flags = flags, .slot = x->slot,
        .subs = x->subs,
    };
    return ++t->log_n == half;
}

/* What became of an ALLOCATING entry's write; 1 if the owner should hear. */
static int ext_settle(struct aur_ext *t, struct aur_ext_entry *x, int outcome, unsigned *done)
{
    struct ext_pool *p = &t->pool[x->slot];
    int notify = 0;

    t->allocating--;
    if (x->src_kind == AUR_EXT_SUB) {   /* more subclusters of its own cluster */
        x->kind = AUR_EXT_SUB;
        if (outcome != AUR_EXT_DONE) {  /* (as it was: nothing to free) */
            x->grow = 0;
            outcome == AUR_EXT_UNUSED ? t->unused++ : t->failed++;
            return 0;
        }
        x->subs |= x->grow;
        x->grow = 0;
        if (x->subs == 0xffffffffu) {
            x->kind = AUR_EXT_MAP;
            x->src_fd = -1;
        }
        t->done++;
        t->grown++;
        ++*done;
        return ext_log_push(t, x, AUR_EXT_REC_OK | AUR_EXT_REC_GROWN);
    }
    p->out--;
    if (outcome == AUR_EXT_DONE) {
        x->kind = AUR_EXT_MAP;
        x->writable = 1;
        if (x->src_kind == AUR_EXT_COW_SUB && x->subs != 0xffffffffu)
            x->kind = AUR_EXT_SUB;  /* (src_fd, src_off: the other subclusters' data) */
        else
            x->src_fd = -1;
        t->done++;
        ++*done;
        return ext_log_push(t, x, AUR_EXT_REC_OK);
    }
    if (outcome == AUR_EXT_UNUSED) {     /* as good as new: the next to go */
        p->head = (p->head + t->pool_cap - 1) % t->pool_cap;
        p->c[p->head] = x->host_off;
        p->n++;
        t->unused++;
    } else {
        notify = ext_log_push(t, x, AUR_EXT_REC_FAILED);
        t->failed++;
    }
    if (x->src_fd >= 0) {   /* COW again: its data where it was */
        x->kind = x->src_kind;
        x->fd = x->src_fd;
        x->host_off = x->src_off;
        x->src_fd = -1;
        return notify;
    }
    x->kind = AUR_EXT_ALLOC;
    x->fd = -1;
    x->host_off = 0;
    return notify;
}

unsigned aur_ext_release(struct aur_ext *t, const uint32_t *ids, unsigned n, int outcome)
{
    struct aur_ext_entry *x;
    unsigned k, j, done = 0;
    int notify = 0;
    uint32_t i;

    ext_lock(t);
    for (k = 0; k < n; k++) {
        /* unused clusters go back to the head last first: the pool's order stays */
        j = outcome == AUR_EXT_UNUSED ? n - 1 - k : k;
        i = ids[j] & ~AUR_EXT_ID_ALLOC;
        if (i >= t->hw || !t->e[i].inflight)
            continue;   /* not held: a caller's bug, not worth a crash here */
        x = &t->e[i];
        if (ids[j] & AUR_EXT_ID_ALLOC && x->kind == EXT_ALLOCATING)
            notify |= ext_settle(t, x, outcome, &done);
        if (--x->inflight || x->state != EXT_GONE)
            continue;
        if (x->prev != EXT_NIL)
            t->e[x->prev].next = x->next;
        else
            t->gone_head = x->next;
        if (x->next != EXT_NIL)
            t->e[x->next].prev = x->prev;
        ext_slot_free(t, i);
        notify |= t->waiters > 0;
    }
    ext_unlock(t, notify);
    return done;
}

/* -- pools and records ------------------------------------------------------ */

int aur_ext_attach(struct aur_ext *t)
{
    int slot = -ENOSPC;

    ext_lock(t);
    if (t->nslots < AUR_EXT_SLOTS)
        slot = (int)t->nslots++;
    pthread_mutex_unlock(&t->mu);
    return slot;
}

int aur_ext_set_alloc(struct aur_ext *t, int fd, unsigned pool_cap, unsigned log_cap)
{
    struct aur_ext_rec *log;
    int ret = 0;

    if (fd < 0 || !pool_cap || !log_cap || pool_cap > (1u << 24) || log_cap > (1u << 24))
        return -EINVAL;
    log = calloc(log_cap, sizeof(*log));
    if (!log)
        return -ENOMEM;
    ext_lock(t);
    if (t->log_cap) {
        ret = -EALREADY;
    } else {
        t->log = log;
        t->log_cap = log_cap;
        t->pool_cap = pool_cap;
        t->alloc_fd = fd;
        log = NULL;
    }
    pthread_mutex_unlock(&t->mu);
    free(log);
    return ret;
}

int aur_ext_pool_add(struct aur_ext *t, unsigned slot, const uint64_t *host, unsigned n)
{
    uint64_t gmask = ((uint64_t)1 << t->shift) - 1;
    struct ext_pool *p;
    unsigned k;
    int ret = -EINVAL;

    for (k = 0; k < n; k++)
        if (host[k] & gmask)
            return -EINVAL;
    ext_lock(t);
    if (slot >= t->nslots || !t->pool_cap)
        goto out;
    p = &t->pool[slot];
    ret = -ENOMEM;
    if (!p->c && !(p->c = malloc(sizeof(*p->c) * t->pool_cap)))
        goto out;
    /* room for the clusters allocations in flight may give back (UNUSED) */
    if (n > t->pool_cap - p->n - p->out)
        n = t->pool_cap - p->n - p->out;
    for (k = 0; k < n; k++)
        p->c[(p->head + p->n + k) % t->pool_cap] = host[k];
    p->n += n;
    p->asked = 0;
    ret = (int)n;
out:
    pthread_mutex_unlock(&t->mu);
    return ret;
}

unsigned aur_ext_pool_take(struct aur_ext *t, unsigned slot, uint64_t *out, unsigned max)
{
    struct ext_pool *p = &t->pool[slot % AUR_EXT_SLOTS];
    unsigned k = 0;

    ext_lock(t);
    if (slot < t->nslots)
        for (; k < max && p->n; k++) {
            out[k] = p->c[p->head];
            p->head = (p->head + 1) % t->pool_cap;
            p->n--;
        }
    pthread_mutex_unlock(&t->mu);
    return k;
}

unsigned aur_ext_pool_level(struct aur_ext *t, unsigned slot)
{
    unsigned n = 0;

    ext_lock(t);
    if (slot < t->nslots)
        n = t->pool[slot].n;
    pthread_mutex_unlock(&t->mu);
    return n;
}

unsigned aur_ext_drain(struct aur_ext *t, struct aur_ext_rec *out, unsigned max)
{
    unsigned k;

    ext_lock(t);
    for (k = 0; k < max && t->log_n; k++) {
        out[k] = t->log[t->log_head];
        t->log_head = (t->log_head + 1) % t->log_cap;
        t->log_n--;
    }
    pthread_mutex_unlock(&t->mu);
    return k;
}

void aur_ext_set_notify(struct aur_ext *t, int efd)
{
    ext_lock(t);
    t->notify_fd = efd;
    pthread_mutex_unlock(&t->mu);
}

void aur_ext_set_hold_writes(struct aur_ext *t, int on)
{
    __atomic_store_n(&t->hold_writes, !!on, __ATOMIC_RELEASE);
}

int aur_ext_holds_writes(struct aur_ext *t)
{
    return __atomic_load_n(&t->hold_writes, __ATOMIC_ACQUIRE);
}

void aur_ext_wait_begin(struct aur_ext *t)
{
    ext_lock(t);
    t->waiters++;
    pthread_mutex_unlock(&t->mu);
}

void aur_ext_wait_end(struct aur_ext *t)
{
    ext_lock(t);
    if (t->waiters)
        t->waiters--;
    pthread_mutex_unlock(&t->mu);
}

void aur_ext_stats(struct aur_ext *t, struct aur_ext_stats *out)
{
    ext_lock(t);
    *out = (struct aur_ext_stats){
        .locks = t->locks, .contended = t->contended, .done = t->done,
        .failed = t->failed, .unused = t->unused, .grown = t->grown, .log_n = t->log_n,
        .allocating = t->allocating,
    };
    pthread_mutex_unlock(&t->mu);
}
