/* kernels: SSE2 and scalar pieces shared by the matrix-unit-order kernels
 * of gemm_avx512.c and gemm_avx2.c (include after <immintrin.h>). Internal
 * to kernels/. */
#ifndef SHOAL_KERNELS_MU_SSE_H
#define SHOAL_KERNELS_MU_SSE_H

/* out[j] byte i = in[i] byte j (16 x 16 bytes) */
static inline __attribute__((always_inline)) void shoal__mu_transpose_b16(__m128i out[16], const __m128i in[16])
{
    __m128i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[k] = _mm_unpacklo_epi8(in[2 * k], in[2 * k + 1]);     /* rows 2k,2k+1: bytes 0..7 */
        a[8 + k] = _mm_unpackhi_epi8(in[2 * k], in[2 * k + 1]); /* bytes 8..15 */
    }
    /* a[k] word j = (row 2k, row 2k+1) of byte j (k < 8), byte 8 + j (k >= 8) */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            b[8 * h + k] = _mm_unpacklo_epi16(a[8 * h + 2 * k], a[8 * h + 2 * k + 1]);
            b[8 * h + 4 + k] = _mm_unpackhi_epi16(a[8 * h + 2 * k], a[8 * h + 2 * k + 1]);
        }
    /* b[8h + k] dword j = rows 4k..4k+3 of byte 8h + j (k < 4: j 0..3; k >= 4: byte 8h + 4 + j, rows 4(k-4)..) */
    for (int h = 0; h < 4; h++) {
        a[4 * h + 0] = _mm_unpacklo_epi32(b[4 * h + 0], b[4 * h + 1]);
        a[4 * h + 1] = _mm_unpackhi_epi32(b[4 * h + 0], b[4 * h + 1]);
        a[4 * h + 2] = _mm_unpacklo_epi32(b[4 * h + 2], b[4 * h + 3]);
        a[4 * h + 3] = _mm_unpackhi_epi32(b[4 * h + 2], b[4 * h + 3]);
    }
    /* a[4h + 0] qword j = rows 0..7 of byte 4h' + j ... (ordered below) */
    for (int h = 0; h < 4; h++) {
        out[4 * h + 0] = _mm_unpacklo_epi64(a[4 * h + 0], a[4 * h + 2]);
        out[4 * h + 1] = _mm_unpackhi_epi64(a[4 * h + 0], a[4 * h + 2]);
        out[4 * h + 2] = _mm_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
        out[4 * h + 3] = _mm_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
    }
}

/* The fold path's scale-code range of one 32-column block (gemm_avx512.c,
 * "The fold path"): mn[0..n) / mx[0..n) the lanes' least nonzero (0xff: none)
 * and greatest exponent fields of its rounded activations; emin the least
 * code whose 2^(e - 127) times the kernel's weight scaling stays normal and
 * fhmax the greatest exponent field its unscaled chains allow. The codes
 * allowed, one inside each exact bound, go to *lo..*hi (*lo > *hi: none). */
static inline void shoal__mu_fold_range(uint8_t *lo, uint8_t *hi, const uint32_t *mn, const uint32_t *mx, int n,
                                        int emin, int fhmax)
{
    int fl = 255, fh = 0;
    for (int i = 0; i < n; i++) {
        fl = (int)mn[i] < fl ? (int)mn[i] : fl;
        fh = (int)mx[i] > fh ? (int)mx[i] : fh;
    }
    int l = 137 - fl < emin ? emin : 137 - fl, u = 371 - fh > 252 ? 252 : 371 - fh;
    if (fl < 10 || fh > fhmax || !shoal__kernels_mu_fold) /* tiny or huge (or non-finite) activations, or off */
        l = 255, u = 0;
    *lo = (uint8_t)l, *hi = (uint8_t)u;
}

#endif
