/* kernels: the ymm fp32 FMA rate loop for `shoal bench peak` (see peak_avx512.c). */
#include "kernels/kernels_int.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static volatile float sink_f;

double shoal__kernels_peak_fma_ymm(long n)
{
    __m256 a[12], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
    for (int j = 0; j < 12; j++)
        a[j] = _mm256_set1_ps((float)j);
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) {
            a[j] = _mm256_fmadd_ps(a[j], b, c);
        }
    __m256 s = a[0];
    for (int j = 1; j < 12; j++)
        s = _mm256_add_ps(s, a[j]);
    float v[8];
    _mm256_storeu_ps(v, s);
    sink_f = v[0] + v[7];
    return (double)n * 12 * 8;
}
#else
double shoal__kernels_peak_fma_ymm(long n)
{
    (void)n;
    return 0;
}
#endif
