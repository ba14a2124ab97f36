/*
 * A QEMU TCG plugin for bench.instructions: how many guest instructions ran
 * where, between two moments the guest picks.
 *
 * Every translated block gets a counter that its every execution bumps
 * (QEMU's inline add: no call, so the guest slows little). The guest asks
 * for a window's counts through the shared folder given as dir=: it creates
 * DIR/N.req (N = 0, 1, 2, ...), and this plugin's own thread answers with
 * DIR/N.out, one line
 * per block that ran since the previous answer: "vaddr instructions runs"
 * (hex, decimal, decimal). A block's runs times its instructions is what
 * it executed, give or take a block an interrupt left early. The request
 * stays: over 9p the guest may still be looking at the file it created.
 *
 * Counters are bumped without atomics by every vCPU: with several vCPUs a
 * few increments are lost, far below what the bench reports.
 *
 * Only the few calls of QEMU's plugin API (version 1, QEMU 4.2 and later)
 * this needs are declared here.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct {
    const char *target_name;
    struct {
        int min, cur;
    } version;
    bool system_emulation;
    union {
        struct {
            int smp_vcpus, max_vcpus;
        } system;
    };
} qemu_info_t;
struct qemu_plugin_tb;
typedef void (*tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, int op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);

#define EXPORT __attribute__((visibility("default")))
#define INLINE_ADD_U64 0
EXPORT int qemu_plugin_version = 1;

/* one per (address, length): a block translated again keeps its counter */
struct block {
    uint64_t vaddr, insns, runs, seen;
    struct block *next;
};

#define BUCKETS (1u << 20)
#define MAX_REQUESTS 100000
static struct block **table;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char dir[4096];

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    uint64_t vaddr = qemu_plugin_tb_vaddr(tb), insns = qemu_plugin_tb_n_insns(tb);
    unsigned h = (unsigned)((vaddr * 0x9E3779B97F4A7C15ull) >> 40) & (BUCKETS - 1);
    struct block *b;

    (void)id;
    pthread_mutex_lock(&lock);
    for (b = table[h]; b; b = b->next)
        if (b->vaddr == vaddr && b->insns == insns)
            break;
    if (!b && (b = calloc(1, sizeof(*b)))) {
        b->vaddr = vaddr;
        b->insns = insns;
        b->next = table[h];
        table[h] = b;
    }
    pthread_mutex_unlock(&lock);
    if (b)
        qemu_plugin_register_vcpu_tb_exec_inline(tb, INLINE_ADD_U64, &b->runs, 1);
}

/* What ran since the last answer, to DIR/N.out (renamed into place whole). */
static void answer(unsigned n)
{
    char tmp[4200], out[4200];
    struct block *b;
    unsigned i;
    FILE *f;

    snprintf(tmp, sizeof(tmp), "%s/%u.tmp", dir, n);
    snprintf(out, sizeof(out), "%s/%u.out", dir, n);
    f = fopen(tmp, "w");
    if (!f)
        return;
    pthread_mutex_lock(&lock);
    for (i = 0; i < BUCKETS; i++)
        for (b = table[i]; b; b = b->next) {
            uint64_t runs = b->runs;

            if (runs != b->seen)
                fprintf(f, "%" PRIx64 " %" PRIu64 " %" PRIu64 "\n", b->vaddr, b->insns,
                        runs - b->seen);
            b->seen = runs;
        }
    pthread_mutex_unlock(&lock);
    if (fclose(f) == 0)
        rename(tmp, out);
}

static void *serve(void *arg)
{
    char req[4200];
    unsigned n = 0;

    (void)arg;
    for (;;) {  /* requests come in order: 0, 1, 2, ... */
        snprintf(req, sizeof(req), "%s/%u.req", dir, n);
        if (access(req, F_OK) == 0) {
            answer(n);
            if (++n == MAX_REQUESTS)
                return NULL;
            continue;
        }
        usleep(10000);
    }
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                               char **argv)
{
    pthread_t thread;

    if (!info->system_emulation || argc != 1 || strncmp(argv[0], "dir=", 4) != 0) {
        fprintf(stderr, "tcg_count: system emulation and one argument, dir=FOLDER\n");
        return -1;
    }
    snprintf(dir, sizeof(dir), "%s", argv[0] + 4);
    table = calloc(BUCKETS, sizeof(*table));
    if (!table || pthread_create(&thread, NULL, serve, NULL) != 0)
        return -1;
    pthread_detach(thread);
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    return 0;
}
