/* Small pieces the C benchmarks share (tests/bench/): a comparison for
 * qsort of doubles, a xorshift generator (each program its own state, the
 * same seed), and a 256-bit read sweep (XOR of every 64-bit word, four
 * independent chains so the loads set the pace). Header-only: benchmarks
 * are single files. */
#ifndef SHOAL_BENCH_UTIL_H
#define SHOAL_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline int bench_cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t bench_rs = 88172645463325252ull;
static inline uint32_t bench_rnd(void)
{
    bench_rs ^= bench_rs << 13, bench_rs ^= bench_rs >> 7, bench_rs ^= bench_rs << 17;
    return (uint32_t)(bench_rs >> 11);
}

/* XOR of every 64-bit word of [p, p+n), n rounded down to 128 bytes, on
 * 256-bit vectors (call only where the CPU has AVX2) */
typedef uint64_t bench_v4u64 __attribute__((vector_size(32)));
__attribute__((target("avx2"))) static inline uint64_t bench_sweep_avx2(const uint8_t *p, size_t n)
{
    bench_v4u64 a = {0}, b = {0}, c = {0}, d = {0};
    size_t vecs = (n / 128) * 4;
    for (size_t i = 0; i < vecs; i += 4) {
        bench_v4u64 w0, w1, w2, w3;
        memcpy(&w0, p + 32 * i, 32);
        memcpy(&w1, p + 32 * (i + 1), 32);
        memcpy(&w2, p + 32 * (i + 2), 32);
        memcpy(&w3, p + 32 * (i + 3), 32);
        a ^= w0, b ^= w1, c ^= w2, d ^= w3;
    }
    bench_v4u64 x = a ^ b ^ c ^ d;
    return x[0] ^ x[1] ^ x[2] ^ x[3];
}

#endif
