/* kernels: AVX-512 (F/BW/VL/DQ) workers. Same contract as gemm_avx2.c: each
 * reproduces the scalar specification bit for bit (kernels/README.md).
 *   bf16 / f32: the 16 canonical lanes are one zmm; reduce16 = (lo256 + hi256)
 *     then the AVX2 tail tree.
 *   MXFP4: two groups per zmm: lanes 0-7 hold group g, lanes 8-15 group g+1,
 *     so the canonical even/odd group accumulators are the two halves of one
 *     zmm accumulator; the decoder is the AVX2 one widened to four 128-bit lanes.
 *   gemv_t, KDA head: vectorised across independent columns (16 per zmm).
 * The dev machine has no AVX-512: these workers are compiled and dispatched
 * only where CPUID reports AVX-512, and tests/unit/test_kernels.c reports
 * them SKIPPED elsewhere. */
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&             \
    defined(__AVX512DQ__)

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include "kernels/kernels_int.h"

#define INLINE static inline __attribute__((always_inline))

/* 256-bit halves through the AVX512F forms (f64x4), which need no DQ. */
INLINE __m256 hi256(__m512 a)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
#define INS256(a, b, i) _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(a), _mm256_castps_pd(b), (i)))

/* reduce8 of one ymm: (c0 + c2) + (c1 + c3), c[j] = v[j] + v[j+4] */
INLINE float hsum8(__m256 v)
{
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    __m128 e = _mm_add_ss(d, _mm_movehdup_ps(d));
    return _mm_cvtss_f32(e);
}

/* reduce16 of one zmm: b[j] = a[j] + a[j+8], then reduce8 */
INLINE float hsum16(__m512 a)
{
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi256(a)));
}

INLINE __m512 ld_bf16(const uint16_t *p)
{
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* ---- bf16 / f32 -------------------------------------------------------------- */

INLINE void tile_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int r, int t, int R, int TT)
{
    __m512 acc[8][4];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            acc[a][b] = _mm512_setzero_ps();
    for (int i = 0; i < cols; i += 16) {
        __m512 wv[8];
        for (int a = 0; a < R; a++) {
            const uint16_t *wr = w + (size_t)(r + a) * cols + i;
            _mm_prefetch((const char *)wr + 1024, _MM_HINT_T0);
            wv[a] = ld_bf16(wr);
        }
        for (int b = 0; b < TT; b++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)(t + b) * cols + i);
            for (int a = 0; a < R; a++)
                acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            y[(size_t)(t + b) * rows + r + a] = hsum16(acc[a][b]);
}

INLINE void tile_f32(float *y, const float *w, const float *x, int rows, int cols, int r, int t, int R, int TT)
{
    __m512 acc[8][4];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            acc[a][b] = _mm512_setzero_ps();
    for (int i = 0; i < cols; i += 16) {
        __m512 wv[8];
        for (int a = 0; a < R; a++) {
            const float *wr = w + (size_t)(r + a) * cols + i;
            _mm_prefetch((const char *)wr + 2048, _MM_HINT_T0);
            wv[a] = _mm512_loadu_ps(wr);
        }
        for (int b = 0; b < TT; b++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)(t + b) * cols + i);
            for (int a = 0; a < R; a++)
                acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            y[(size_t)(t + b) * rows + r + a] = hsum16(acc[a][b]);
}

#define TILE_FNS(K, WT)                                                                                     \
    __attribute__((noinline)) static void K##_8x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, int t)                                            \
    {                                                                                                       \
        tile_##K(y, w, x, rows, cols, r, t, 8, 1);                                                          \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_4x4(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, int t)                                            \
    {                                                                                                       \
        tile_##K(y, w, x, rows, cols, r, t, 4, 4);                                                          \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_1x4(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, int t)                                            \
    {                                                                                                       \
        tile_##K(y, w, x, rows, cols, r, t, 1, 4);                                                          \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_4x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, int t)                                            \
    {                                                                                                       \
        tile_##K(y, w, x, rows, cols, r, t, 4, 1);                                                          \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_1x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, int t)                                            \
    {                                                                                                       \
        tile_##K(y, w, x, rows, cols, r, t, 1, 1);                                                          \
    }                                                                                                       \
    static void K##_rows(float *y, const WT *w, const float *x, int rows, int cols, int T, int r0, int r1)  \
    {                                                                                                       \
        int r = r0;                                                                                         \
        if (T == 1) {                                                                                       \
            for (; r + 8 <= r1; r += 8)                                                                     \
                K##_8x1(y, w, x, rows, cols, r, 0);                                                         \
            for (; r < r1; r++)                                                                             \
                K##_1x1(y, w, x, rows, cols, r, 0);                                                         \
            return;                                                                                         \
        }                                                                                                   \
        for (; r + 4 <= r1; r += 4) {                                                                       \
            int t = 0;                                                                                      \
            for (; t + 4 <= T; t += 4)                                                                      \
                K##_4x4(y, w, x, rows, cols, r, t);                                                         \
            for (; t < T; t++)                                                                              \
                K##_4x1(y, w, x, rows, cols, r, t);                                                         \
        }                                                                                                   \
        for (; r < r1; r++) {                                                                               \
            int t = 0;                                                                                      \
            for (; t + 4 <= T; t += 4)                                                                      \
                K##_1x4(y, w, x, rows, cols, r, t);                                                         \
            for (; t < T; t++)                                                                              \
                K##_1x1(y, w, x, rows, cols, r, t);                                                         \
        }                                                                                                   \
    }

TILE_FNS(bf16, uint16_t)
TILE_FNS(f32, float)

static void gemm_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    if (cols % 32)
        shoal__kernels_gemm_bf16_scalar(y, w, x, rows, cols, T, r0, r1);
    else
        bf16_rows(y, w, x, rows, cols, T, r0, r1);
}

static void gemm_f32(float *y, const float *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    if (cols % 32)
        shoal__kernels_gemm_f32_scalar(y, w, x, rows, cols, T, r0, r1);
    else
        f32_rows(y, w, x, rows, cols, T, r0, r1);
}

/* ---- MXFP4: two groups per zmm ---------------------------------------------------
 * The 32 packed bytes of groups g, g+1 are placed as 128-bit lanes [Pg, Pg,
 * Pg+1, Pg+1]; each pair of lanes then goes through the AVX2 decoder (same
 * ARR / shift / LUT / SPREAD tables, repeated per lane pair), giving
 * f[k] = [group g columns 8k..8k+7 | group g+1 columns 8k..8k+7], each value
 * E2M1 * 2^25. */
typedef struct {
    __m512i arr, shift, mask, lut, spread[4], lanes;
} mx_consts;

INLINE mx_consts mx_make(void)
{
    mx_consts c;
    __m256i arr = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3,
                                   6, 7, 10, 11, 14, 15);
    c.arr = _mm512_inserti64x4(_mm512_castsi256_si512(arr), arr, 1);
    c.shift = _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4);
    c.mask = _mm512_set1_epi8(0x0f);
    __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    c.lut = _mm512_broadcast_i32x4(lut);
    for (int k = 0; k < 4; k++) {
        char s0 = (char)(2 * k), s1 = (char)(8 + 2 * k), s2 = (char)(2 * k + 1), s3 = (char)(9 + 2 * k);
        const char z = (char)0x80;
        __m128i sp = _mm_setr_epi8(z, z, z, s0, z, z, z, s1, z, z, z, s2, z, z, z, s3);
        c.spread[k] = _mm512_broadcast_i32x4(sp);
    }
    /* qword source indices for [Pg, Pg, Pg+1, Pg+1] from a 256-bit [Pg | Pg+1] */
    c.lanes = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    return c;
}

/* Groups g and g+1 (32 packed bytes at p). */
INLINE void mx_decode2(__m512 *f, const uint8_t *p, const mx_consts *c)
{
    __m512i t = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    t = _mm512_permutexvar_epi64(c->lanes, t);
    t = _mm512_shuffle_epi8(t, c->arr);
    t = _mm512_and_si512(_mm512_srlv_epi64(t, c->shift), c->mask);
    __m512i v = _mm512_shuffle_epi8(c->lut, t);
    for (int k = 0; k < 4; k++)
        f[k] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, c->spread[k]));
}

/* [x[a .. a+8) | x[b .. b+8)] */
INLINE __m512 ld_x2(const float *xa, const float *xb)
{
    return INS256(_mm512_castps256_ps512(_mm256_loadu_ps(xa)), _mm256_loadu_ps(xb), 1);
}

static const float e8m0_low[3] = {0x1p-127f, 0x1p-126f, 0x1p-125f};

/* The scalar spec's per-group scaling on one 8-lane half. */
INLINE __m256 mx_scale_acc8(__m256 G, unsigned e, __m256 acc)
{
    if (e < 3)
        return _mm256_fmadd_ps(_mm256_mul_ps(G, _mm256_set1_ps(0x1p-25f)), _mm256_broadcast_ss(&e8m0_low[e]), acc);
    return _mm256_fmadd_ps(G, _mm256_broadcast_ss(&shoal__kernels_e8m0_mul[e]), acc);
}

/* Pair (g, g+1) of one token into acc = [acc_even | acc_odd]. */
INLINE __m512 mx_pair(__m512 acc, const __m512 *f, unsigned e0, unsigned e1, const float *xg)
{
    __m512 G = _mm512_mul_ps(f[0], ld_x2(xg, xg + 32));
    G = _mm512_fmadd_ps(f[1], ld_x2(xg + 8, xg + 40), G);
    G = _mm512_fmadd_ps(f[2], ld_x2(xg + 16, xg + 48), G);
    G = _mm512_fmadd_ps(f[3], ld_x2(xg + 24, xg + 56), G);
    if (__builtin_expect(e0 < 3 || e1 < 3, 0)) {
        __m256 lo = mx_scale_acc8(_mm512_castps512_ps256(G), e0, _mm512_castps512_ps256(acc));
        __m256 hi = mx_scale_acc8(hi256(G), e1, hi256(acc));
        return INS256(_mm512_castps256_ps512(lo), hi, 1);
    }
    __m512 s = INS256(_mm512_set1_ps(shoal__kernels_e8m0_mul[e0]), _mm256_set1_ps(shoal__kernels_e8m0_mul[e1]), 1);
    return _mm512_fmadd_ps(G, s, acc);
}

/* A trailing odd group g into the low (even) half. */
INLINE __m512 mx_last(__m512 acc, const __m512 *f, unsigned e, const float *xg)
{
    __m256 G = _mm256_mul_ps(_mm512_castps512_ps256(f[0]), _mm256_loadu_ps(xg));
    G = _mm256_fmadd_ps(_mm512_castps512_ps256(f[1]), _mm256_loadu_ps(xg + 8), G);
    G = _mm256_fmadd_ps(_mm512_castps512_ps256(f[2]), _mm256_loadu_ps(xg + 16), G);
    G = _mm256_fmadd_ps(_mm512_castps512_ps256(f[3]), _mm256_loadu_ps(xg + 24), G);
    __m256 lo = mx_scale_acc8(G, e, _mm512_castps512_ps256(acc));
    return INS256(acc, lo, 0);
}

INLINE float mx_finish(__m512 acc)
{
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), hi256(acc)));
}

/* One row, TT tokens, decoding as it goes. */
INLINE void mx_row(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows, int cols, int r, int t,
                   int TT, const mx_consts *c)
{
    __m512 acc[4];
    for (int b = 0; b < TT; b++)
        acc[b] = _mm512_setzero_ps();
    int ng = cols / 32, g = 0;
    for (; g + 2 <= ng; g += 2) {
        if ((g & 3) == 0)
            _mm_prefetch((const char *)p + 16 * g + 1024, _MM_HINT_T0);
        __m512 f[4];
        mx_decode2(f, p + 16 * g, c);
        for (int b = 0; b < TT; b++)
            acc[b] = mx_pair(acc[b], f, s[g], s[g + 1], x + (size_t)(t + b) * cols + 32 * g);
    }
    if (g < ng) {
        /* decode the last group alone: bytes past the row are not read */
        __m512 f[4];
        uint8_t tmp[32] = {0};
        for (int j = 0; j < 16; j++)
            tmp[j] = p[16 * g + j];
        mx_decode2(f, tmp, c);
        for (int b = 0; b < TT; b++)
            acc[b] = mx_last(acc[b], f, s[g], x + (size_t)(t + b) * cols + 32 * g);
    }
    for (int b = 0; b < TT; b++)
        y[(size_t)(t + b) * rows + r] = mx_finish(acc[b]);
}

/* constants built here so they can live in registers (see gemm_avx2.c) */
__attribute__((noinline)) static void mx_row1(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows,
                                              int cols, int r, int t)
{
    mx_consts c = mx_make();
    mx_row(y, p, s, x, rows, cols, r, t, 1, &c);
}

__attribute__((noinline)) static void mx_row4(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows,
                                              int cols, int r, int t)
{
    mx_consts c = mx_make();
    mx_row(y, p, s, x, rows, cols, r, t, 4, &c);
}

/* T > 1: as in gemm_avx2.c, a block of rows is decoded once into a stack
 * buffer (a transient copy of a few rows, never of the matrix), then tiles of
 * MX_TT tokens run the chains over it in column blocks of MX_KB (the x tile
 * stays in L1), saving a tile's accumulators between column blocks (same
 * values, same order). Here a zmm holds one group of TWO rows, [row r lanes
 * 0-7 | row r+1 lanes 0-7], so the x operand of every FMA is one 8-float
 * slice broadcast to both halves (vbroadcastf32x8: a load, no shuffle), and
 * the canonical even/odd group accumulators are two zmm per token (E, O).
 * Lane l of each half runs exactly the scalar chain of its row: G[l] over
 * k = 0..3, then fmaf(G, 2^(e-152), acc[g mod 2]); the result is
 * hsum8(E + O) of the half. Decoding row r's groups as mx_decode2 does
 * (before: the row was decoded again for every 4-token tile, and x halves
 * were inserted per FMA: T = 128 ran slower than AVX2, docs/PERFORMANCE.md). */
#define MX_BUF_FLOATS 32768 /* 128 KiB of stack */
#define MX_KB 1024
#define MX_PB_MAX 8 /* row pairs per block */
#define MX_TT 8

/* groups g of rows a and b (16 packed bytes each) -> f[k] = [a: cols 8k.. | b: cols 8k..] */
INLINE void mx_decode_ab(__m512 *f, const uint8_t *pa, const uint8_t *pb, const mx_consts *c)
{
    __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                         _mm_loadu_si128((const __m128i *)pb), 1);
    __m512i t = _mm512_permutexvar_epi64(c->lanes, _mm512_castsi256_si512(ab));
    t = _mm512_shuffle_epi8(t, c->arr);
    t = _mm512_and_si512(_mm512_srlv_epi64(t, c->shift), c->mask);
    __m512i v = _mm512_shuffle_epi8(c->lut, t);
    for (int k = 0; k < 4; k++)
        f[k] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, c->spread[k]));
}

__attribute__((noinline)) static void mx_decode_pair(__m512 *w, const uint8_t *pa, const uint8_t *pb, int ng)
{
    mx_consts c = mx_make();
    for (int g = 0; g < ng; g++)
        mx_decode_ab(w + 4 * g, pa + 16 * g, pb + 16 * g, &c);
}

INLINE __m512 bc8(const float *p)
{
    return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
}

/* group g of both rows, TT tokens, into A[b] (E or O) */
INLINE void mx_grp2(__m512 *A, const __m512 *f, unsigned ea, unsigned eb, const float *xt, int cols, int g, int TT)
{
    __m512 G[MX_TT];
    for (int b = 0; b < TT; b++)
        G[b] = _mm512_mul_ps(f[0], bc8(xt + (size_t)b * cols + 32 * g));
    for (int k = 1; k < 4; k++)
        for (int b = 0; b < TT; b++)
            G[b] = _mm512_fmadd_ps(f[k], bc8(xt + (size_t)b * cols + 32 * g + 8 * k), G[b]);
    if (__builtin_expect(ea < 3 || eb < 3, 0)) {
        for (int b = 0; b < TT; b++) {
            __m256 lo = mx_scale_acc8(_mm512_castps512_ps256(G[b]), ea, _mm512_castps512_ps256(A[b]));
            __m256 hi = mx_scale_acc8(hi256(G[b]), eb, hi256(A[b]));
            A[b] = INS256(_mm512_castps256_ps512(lo), hi, 1);
        }
        return;
    }
    __m512 sc = INS256(_mm512_set1_ps(shoal__kernels_e8m0_mul[ea]), _mm256_set1_ps(shoal__kernels_e8m0_mul[eb]), 1);
    for (int b = 0; b < TT; b++)
        A[b] = _mm512_fmadd_ps(G[b], sc, A[b]);
}

/* rows r (and r+1 when two), tokens t..t+TT-1, groups [g0, g1) */
INLINE void mx_tile2(float *y, __m512 *st, const __m512 *wb, const uint8_t *sa, const uint8_t *sb, const float *x,
                     int rows, int cols, int r, int two, int t, int TT, int g0, int g1)
{
    __m512 E[MX_TT], O[MX_TT];
    int init = g0 == 0, fin = g1 == cols / 32;
    for (int b = 0; b < TT; b++) {
        E[b] = init ? _mm512_setzero_ps() : st[2 * b];
        O[b] = init ? _mm512_setzero_ps() : st[2 * b + 1];
    }
    const float *xt = x + (size_t)t * cols;
    int g = g0;
    for (; g + 2 <= g1; g += 2) {
        mx_grp2(E, wb + 4 * g, sa[g], sb[g], xt, cols, g, TT);
        mx_grp2(O, wb + 4 * (g + 1), sa[g + 1], sb[g + 1], xt, cols, g + 1, TT);
    }
    if (g < g1)
        mx_grp2(E, wb + 4 * g, sa[g], sb[g], xt, cols, g, TT);
    for (int b = 0; b < TT; b++) {
        if (fin) {
            __m512 v = _mm512_add_ps(E[b], O[b]);
            y[(size_t)(t + b) * rows + r] = hsum8(_mm512_castps512_ps256(v));
            if (two)
                y[(size_t)(t + b) * rows + r + 1] = hsum8(hi256(v));
        } else {
            st[2 * b] = E[b];
            st[2 * b + 1] = O[b];
        }
    }
}

#define MX_TILE2_FN(name, TT)                                                                               \
    __attribute__((noinline)) static void name(float *y, __m512 *st, const __m512 *wb, const uint8_t *sa,     \
                                               const uint8_t *sb, const float *x, int rows, int cols, int r,  \
                                               int two, int t, int g0, int g1)                                \
    {                                                                                                       \
        mx_tile2(y, st, wb, sa, sb, x, rows, cols, r, two, t, TT, g0, g1);                                  \
    }
MX_TILE2_FN(mx_tile2N, MX_TT)
MX_TILE2_FN(mx_tile2_4, 4)
MX_TILE2_FN(mx_tile2_1, 1)

static void gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                       int T, int r0, int r1)
{
    if (cols % 32) {
        shoal__kernels_gemm_mxfp4_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    int ng = cols / 32;
    size_t pair_vecs = (size_t)ng * 4; /* zmm per decoded row pair */
    if (T == 1 || pair_vecs * 16 > MX_BUF_FLOATS) {
        for (int r = r0; r < r1; r++) {
            const uint8_t *p = packed + (size_t)r * (cols / 2), *s = scale + (size_t)r * ng;
            int t = 0;
            for (; t + 4 <= T; t += 4)
                mx_row4(y, p, s, x, rows, cols, r, t);
            for (; t < T; t++)
                mx_row1(y, p, s, x, rows, cols, r, t);
        }
        return;
    }
    __m512 buf[MX_BUF_FLOATS / 16];
    __m512 st[MX_PB_MAX][2 * MX_TT];
    int pb = (int)(MX_BUF_FLOATS / 16 / pair_vecs);
    pb = pb > MX_PB_MAX ? MX_PB_MAX : pb;
    for (int ra = r0; ra < r1; ra += 2 * pb) {
        int re = ra + 2 * pb < r1 ? ra + 2 * pb : r1;
        for (int r = ra; r < re; r += 2) {
            int rr = r + 1 < re ? r + 1 : r; /* an odd last row pairs with itself; its twin is not stored */
            mx_decode_pair(buf + (size_t)((r - ra) / 2) * pair_vecs, packed + (size_t)r * (cols / 2),
                           packed + (size_t)rr * (cols / 2), ng);
        }
        for (int t = 0; t < T;) {
            int TT = T - t >= MX_TT ? MX_TT : T - t >= 4 ? 4 : 1;
            for (int g0 = 0; g0 < ng; g0 += MX_KB / 32) {
                int g1 = g0 + MX_KB / 32 < ng ? g0 + MX_KB / 32 : ng;
                for (int r = ra; r < re; r += 2) {
                    int two = r + 1 < re, rr = two ? r + 1 : r;
                    const __m512 *wr = buf + (size_t)((r - ra) / 2) * pair_vecs;
                    (TT == MX_TT ? mx_tile2N : TT == 4 ? mx_tile2_4 : mx_tile2_1)(
                        y, st[(r - ra) / 2], wr, scale + (size_t)r * ng, scale + (size_t)rr * ng, x, rows, cols, r,
                        two, t, g0, g1);
                }
            }
            t += TT;
        }
    }
}

/* ---- gemv_t and the KDA head: independent columns, 16 per zmm ------------------- */

#define GT_COLS 64 /* = COL_BLOCK in kernels.c */

static void gemv_t_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int c0, int c1)
{
    int c = c0;
    for (; c + GT_COLS <= c1; c += GT_COLS) {
        __m512 acc[GT_COLS / 16];
        for (int j = 0; j < GT_COLS / 16; j++)
            acc[j] = _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const uint16_t *wr = w + (size_t)r * cols + c;
            __m512 xr = _mm512_set1_ps(x[r]);
            for (int j = 0; j < GT_COLS / 16; j++)
                acc[j] = _mm512_fmadd_ps(ld_bf16(wr + 16 * j), xr, acc[j]);
        }
        for (int j = 0; j < GT_COLS / 16; j++)
            _mm512_storeu_ps(y + c + 16 * j, acc[j]);
    }
    if (c < c1)
        shoal__kernels_gemv_t_bf16_scalar(y, w, x, rows, cols, c, c1);
}

static void gemv_t_f32(float *y, const float *w, const float *x, int rows, int cols, int c0, int c1)
{
    int c = c0;
    for (; c + GT_COLS <= c1; c += GT_COLS) {
        __m512 acc[GT_COLS / 16];
        for (int j = 0; j < GT_COLS / 16; j++)
            acc[j] = _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const float *wr = w + (size_t)r * cols + c;
            __m512 xr = _mm512_set1_ps(x[r]);
            for (int j = 0; j < GT_COLS / 16; j++)
                acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(wr + 16 * j), xr, acc[j]);
        }
        for (int j = 0; j < GT_COLS / 16; j++)
            _mm512_storeu_ps(y + c + 16 * j, acc[j]);
    }
    if (c < c1)
        shoal__kernels_gemv_t_f32_scalar(y, w, x, rows, cols, c, c1);
}

#define KDA_JB 64

static void kda_head(float *o, float *S, const float *q, const float *k, const float *v, const float *g, float beta,
                     int D)
{
    if (D % KDA_JB) {
        shoal__kernels_kda_head_scalar(o, S, q, k, v, g, beta, D);
        return;
    }
    float e[256];
    for (int i = 0; i < D; i++)
        e[i] = expf(g[i]);
    __m512 bv = _mm512_set1_ps(beta);
    for (int j0 = 0; j0 < D; j0 += KDA_JB) {
        __m512 acc[KDA_JB / 16], oacc[KDA_JB / 16];
        for (int j = 0; j < KDA_JB / 16; j++)
            acc[j] = oacc[j] = _mm512_setzero_ps();
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D + j0;
            __m512 ei = _mm512_set1_ps(e[i]), ki = _mm512_set1_ps(k[i]);
            for (int j = 0; j < KDA_JB / 16; j++) {
                __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(Si + 16 * j), ei);
                _mm512_storeu_ps(Si + 16 * j, sv);
                acc[j] = _mm512_fmadd_ps(sv, ki, acc[j]);
            }
        }
        for (int j = 0; j < KDA_JB / 16; j++)
            acc[j] = _mm512_mul_ps(bv, _mm512_sub_ps(_mm512_loadu_ps(v + j0 + 16 * j), acc[j]));
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D + j0;
            __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            for (int j = 0; j < KDA_JB / 16; j++) {
                __m512 sv = _mm512_fmadd_ps(ki, acc[j], _mm512_loadu_ps(Si + 16 * j));
                _mm512_storeu_ps(Si + 16 * j, sv);
                oacc[j] = _mm512_fmadd_ps(sv, qi, oacc[j]);
            }
        }
        for (int j = 0; j < KDA_JB / 16; j++)
            _mm512_storeu_ps(o + j0 + 16 * j, oacc[j]);
    }
}

int shoal__kernels_fill_avx512(shoal__kernels_table *t)
{
    t->gemm_bf16 = gemm_bf16;
    t->gemm_f32 = gemm_f32;
    t->gemm_mxfp4 = gemm_mxfp4;
    t->gemv_t_bf16 = gemv_t_bf16;
    t->gemv_t_f32 = gemv_t_f32;
    t->kda_head = kda_head;
    return 1;
}

#else
#include "kernels/kernels_int.h"
int shoal__kernels_fill_avx512(shoal__kernels_table *t)
{
    (void)t;
    return 0;
}
#endif
