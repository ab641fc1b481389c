/* kernels: avx512 variants (placeholder until the SIMD workers land). */
#include "kernels/kernels_int.h"

int shoal__kernels_fill_avx512(shoal__kernels_table *t)
{
    (void)t;
    return 1;
}
