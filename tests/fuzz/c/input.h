/* The fuzz input read as a little program: bytes and small numbers taken
   from the front, zeros once it runs out (so every input is a program). */
#ifndef FUZZ_INPUT_H
#define FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

struct in { const uint8_t *p; size_t n; };

static inline int in_more(const struct in *in) { return in->n > 0; }

static inline uint8_t in_u8(struct in *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

static inline uint16_t in_u16(struct in *in)
{
    uint16_t lo = in_u8(in);

    return (uint16_t)(lo | in_u8(in) << 8);
}

static inline uint32_t in_u32(struct in *in)
{
    uint32_t lo = in_u16(in);

    return lo | (uint32_t)in_u16(in) << 16;
}

static inline uint64_t in_u64(struct in *in)
{
    uint64_t lo = in_u32(in);

    return lo | (uint64_t)in_u32(in) << 32;
}

/* A broken invariant: say which, and crash so that libFuzzer keeps the input. */
#define FUZZ_CHECK(cond, ...)                                          \
    do {                                                               \
        if (!(cond)) {                                                 \
            fprintf(stderr, "INVARIANT %s:%d: ", __FILE__, __LINE__);  \
            fprintf(stderr, __VA_ARGS__);                              \
            fputc('\n', stderr);                                       \
            abort();                                                   \
        }                                                              \
    } while (0)

#endif
