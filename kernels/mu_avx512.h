/* kernels: AVX-512 pieces shared by the matrix-unit-order kernels of
 * gemm_avx512.c and gemm_amx.c (both compiled with AVX-512F flags; include
 * after <immintrin.h>). Internal to kernels/. */
#ifndef SHOAL_KERNELS_MU_AVX512_H
#define SHOAL_KERNELS_MU_AVX512_H

/* 16 x 16 dword transpose: d[j] lane i = r[i] lane j */
static inline __attribute__((always_inline)) void shoal__mu_transpose16(__m512i d[16], const __m512i r[16])
{
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) {
        b[4 * m + 0] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
        b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        d[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        d[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        d[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        d[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

/* One MXFP4 group (16 bytes) with E8M0 code e -> 32 bf16 words in column order. */
static inline __attribute__((always_inline)) __m512i shoal__mu_mx_dec(const uint8_t *p, unsigned e)
{
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i idx = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(15)), _mm512_slli_epi32(_mm512_srli_epi32(d, 4), 16));
    __m512i tab = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)shoal__kernels_mu_bf[e]));
    return _mm512_permutexvar_epi16(idx, tab);
}

#endif
