/* kernels: instruction-rate loops for `shoal bench peak` (AVX-512 F, BF16,
 * VNNI). Each runs n iterations of 12 independent accumulator chains, enough
 * to cover the instruction's latency on current cores, and returns the
 * multiply-adds done (0 when not compiled in). No memory traffic. The values
 * are kept finite and the results are folded into one store, so the compiler
 * cannot drop the loop. */
#include "kernels/kernels_int.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>

static volatile float sink_f;
static volatile int sink_i;

double shoal__kernels_peak_fma_zmm(long n)
{
    __m512 a[12], b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    for (int j = 0; j < 12; j++)
        a[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            a[j] = _mm512_fmadd_ps(a[j], b, c);
        }
    __m512 s = a[0];
    for (int j = 1; j < 12; j++)
        s = _mm512_add_ps(s, a[j]);
    sink_f = _mm512_reduce_add_ps(s);
    return (double)n * 12 * 16;
}

double shoal__kernels_peak_bf16dot(long n)
{
    __m512 a[12];
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3a80); /* 1, ~1e-3 */
    for (int j = 0; j < 12; j++)
        a[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            a[j] = _mm512_dpbf16_ps(a[j], x, y);
        }
    __m512 s = a[0];
    for (int j = 1; j < 12; j++)
        s = _mm512_add_ps(s, a[j]);
    sink_f = _mm512_reduce_add_ps(s);
    return (double)n * 12 * 32;
}

double shoal__kernels_peak_vnni8(long n)
{
    __m512i a[12], x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(1);
    for (int j = 0; j < 12; j++)
        a[j] = _mm512_set1_epi32(j);
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            a[j] = _mm512_dpbusd_epi32(a[j], x, y);
        }
    __m512i s = a[0];
    for (int j = 1; j < 12; j++)
        s = _mm512_add_epi32(s, a[j]);
    sink_i = _mm512_reduce_add_epi32(s);
    return (double)n * 12 * 64;
}
#else
double shoal__kernels_peak_fma_zmm(long n)
{
    (void)n;
    return 0;
}
double shoal__kernels_peak_bf16dot(long n)
{
    (void)n;
    return 0;
}
double shoal__kernels_peak_vnni8(long n)
{
    (void)n;
    return 0;
}
#endif
