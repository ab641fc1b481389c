/* kernels: AVX2+FMA workers. Each reproduces the scalar specification in
 * gemm.c / ops.c bit for bit (kernels/README.md, "Canonical orders"):
 * the same lane of the same partial sum receives the same products, in the
 * same order, with the same fused multiply-adds, and the same reduction tree.
 * Register blocking (several rows or tokens at once) only interleaves
 * independent chains; it never changes a chain. Widths must be multiples of
 * 32 (kernels.h); any other width falls back to the scalar worker. */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include "kernels/kernels_int.h"

#define INLINE static inline __attribute__((always_inline))

/* reduce16 of lanes (a = lanes 0..7, b = lanes 8..15) */
INLINE float hsum16(__m256 a, __m256 b)
{
    __m256 v = _mm256_add_ps(a, b);                                           /* a[j] + a[j+8] */
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* + [j+4] */
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                            /* c0+c2, c1+c3 */
    __m128 e = _mm_add_ss(d, _mm_movehdup_ps(d));                             /* (c0+c2)+(c1+c3) */
    return _mm_cvtss_f32(e);
}

/* reduce8 of one register */
INLINE float hsum8(__m256 v)
{
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    __m128 e = _mm_add_ss(d, _mm_movehdup_ps(d));
    return _mm_cvtss_f32(e);
}

/* 8 bf16 -> 8 fp32, exact */
INLINE __m256 ld_bf16(const uint16_t *p)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* ---- bf16 / f32: R rows x TT tokens tile, 16 lanes per (row, token) ------
 * A tile accumulates columns [k0, k1) into its 2*R*TT lane registers; the
 * registers start at zero (init) or are reloaded from st, and at the end are
 * reduced into y (fin) or saved to st. Saving and reloading a lane between
 * column blocks changes nothing in its chain, so K-blocking (which keeps the
 * x tile in L1 at large T) is bit-identical to one pass. */

#define PF_DIST 768 /* bytes ahead on each weight row stream */

#define DEFINE_TILE(K, WT, LOADW, PF)                                                                       \
    INLINE void tile_##K(float *y, __m256 *st, const WT *w, const float *x, int rows, int cols, int r, int t, \
                         int R, int TT, int k0, int k1, int init, int fin)                                  \
    {                                                                                                       \
        __m256 acc[4][3][2];                                                                                \
        for (int a = 0; a < R; a++)                                                                         \
            for (int b = 0; b < TT; b++)                                                                    \
                for (int h = 0; h < 2; h++)                                                                 \
                    acc[a][b][h] = init ? _mm256_setzero_ps() : st[(a * TT + b) * 2 + h];                   \
        const WT *wr[4];                                                                                    \
        for (int a = 0; a < R; a++)                                                                         \
            wr[a] = w + (size_t)(r + a) * cols;                                                             \
        const float *xt[3];                                                                                 \
        for (int b = 0; b < TT; b++)                                                                        \
            xt[b] = x + (size_t)(t + b) * cols;                                                             \
        for (int i = k0; i < k1; i += 16) {                                                                 \
            __m256 w0[4], w1[4];                                                                            \
            for (int a = 0; a < R; a++) {                                                                   \
                _mm_prefetch((const char *)(wr[a] + i) + (PF), _MM_HINT_T0);                                \
                w0[a] = LOADW(wr[a] + i);                                                                   \
                w1[a] = LOADW(wr[a] + i + 8);                                                               \
            }                                                                                               \
            for (int b = 0; b < TT; b++) {                                                                  \
                __m256 x0 = _mm256_loadu_ps(xt[b] + i), x1 = _mm256_loadu_ps(xt[b] + i + 8);                \
                for (int a = 0; a < R; a++) {                                                               \
                    acc[a][b][0] = _mm256_fmadd_ps(w0[a], x0, acc[a][b][0]);                                \
                    acc[a][b][1] = _mm256_fmadd_ps(w1[a], x1, acc[a][b][1]);                                \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int a = 0; a < R; a++)                                                                         \
            for (int b = 0; b < TT; b++) {                                                                  \
                if (fin)                                                                                    \
                    y[(size_t)(t + b) * rows + r + a] = hsum16(acc[a][b][0], acc[a][b][1]);                 \
                else                                                                                        \
                    for (int h = 0; h < 2; h++)                                                             \
                        st[(a * TT + b) * 2 + h] = acc[a][b][h];                                            \
            }                                                                                               \
    }

DEFINE_TILE(bf16, uint16_t, ld_bf16, PF_DIST)
DEFINE_TILE(f32, float, _mm256_loadu_ps, 2 * PF_DIST)

/* GEMV (T = 1): four rows share each x load, 8 independent chains.
 * GEMM (T > 1): rows in blocks of 16, tokens in tiles of 3, columns in blocks
 * of KBLOCK: a 3-token x block (12 KiB) stays in L1 and the 16-row weight
 * block in L2 while every tile passes; each weight is read from DRAM once. */
#define KBLOCK 1024
#define RBLOCK 16

#define TILE_FNS(K, WT)                                                                                     \
    __attribute__((noinline)) static void K##_4x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r)                                                   \
    {                                                                                                       \
        tile_##K(y, NULL, w, x, rows, cols, r, 0, 4, 1, 0, cols, 1, 1);                                     \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_1x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r)                                                   \
    {                                                                                                       \
        tile_##K(y, NULL, w, x, rows, cols, r, 0, 1, 1, 0, cols, 1, 1);                                     \
    }                                                                                                       \
    /* one (R, TT) tile over columns [k0, k1) */                                                            \
    __attribute__((noinline)) static void K##_tile(float *y, __m256 *st, const WT *w, const float *x, int rows, \
                                                   int cols, int r, int t, int R, int TT, int k0, int k1)   \
    {                                                                                                       \
        int init = k0 == 0, fin = k1 == cols;                                                               \
        if (R == 2 && TT == 3)                                                                              \
            tile_##K(y, st, w, x, rows, cols, r, t, 2, 3, k0, k1, init, fin);                               \
        else if (R == 2)                                                                                    \
            tile_##K(y, st, w, x, rows, cols, r, t, 2, 1, k0, k1, init, fin);                               \
        else if (TT == 3)                                                                                   \
            tile_##K(y, st, w, x, rows, cols, r, t, 1, 3, k0, k1, init, fin);                               \
        else                                                                                                \
            tile_##K(y, st, w, x, rows, cols, r, t, 1, 1, k0, k1, init, fin);                               \
    }                                                                                                       \
    static void K##_rows(float *y, const WT *w, const float *x, int rows, int cols, int T, int r0, int r1)  \
    {                                                                                                       \
        if (T == 1) {                                                                                       \
            int r = r0;                                                                                     \
            for (; r + 4 <= r1; r += 4)                                                                     \
                K##_4x1(y, w, x, rows, cols, r);                                                            \
            for (; r < r1; r++)                                                                             \
                K##_1x1(y, w, x, rows, cols, r);                                                            \
            return;                                                                                         \
        }                                                                                                   \
        __m256 st[RBLOCK / 2][12];                                                                          \
        for (int rb = r0; rb < r1; rb += RBLOCK) {                                                          \
            int re = rb + RBLOCK < r1 ? rb + RBLOCK : r1;                                                   \
            for (int t = 0; t < T;) {                                                                       \
                int TT = T - t >= 3 ? 3 : 1;                                                                \
                for (int k0 = 0; k0 < cols; k0 += KBLOCK) {                                                 \
                    int k1 = k0 + KBLOCK < cols ? k0 + KBLOCK : cols;                                       \
                    for (int r = rb; r < re; r += 2)                                                        \
                        K##_tile(y, st[(r - rb) / 2], w, x, rows, cols, r, t, re - r >= 2 ? 2 : 1, TT, k0, k1); \
                }                                                                                           \
                t += TT;                                                                                    \
            }                                                                                               \
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

/* ---- MXFP4 ------------------------------------------------------------------ */

/* Decode of one 32-column group (16 packed bytes) into four fp32 vectors
 * f[k] = columns 8k..8k+7 in natural order, each value E2M1 * 2^25:
 *  1. broadcast the 16 bytes to both 128-bit lanes;
 *  2. ARR: lane 0 takes bytes {0,1,4,5,8,9,12,13} (columns 0-3, 8-11, 16-19,
 *     24-27), lane 1 bytes {2,3,6,7,10,11,14,15}; each list twice;
 *  3. shift the upper qword of each lane right by 4 and mask 0x0F: each lane
 *     now holds 8 low-nibble codes then 8 high-nibble codes;
 *  4. LUT: code -> int8 2*E2M1;
 *  5. SPREAD_k: put the int8 of column 8k+i into byte 3 of dword i (zeros
 *     below), so the dword is (2*E2M1) << 24 and int32->fp32 is exact. */
typedef struct {
    __m256i arr, shift, mask, lut, spread[4];
} mx_consts;

INLINE mx_consts mx_make(void)
{
    mx_consts c;
    c.arr = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7,
                             10, 11, 14, 15);
    c.shift = _mm256_setr_epi64x(0, 4, 0, 4);
    c.mask = _mm256_set1_epi8(0x0f);
    c.lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1,
                             -2, -3, -4, -6, -8, -12);
    for (int k = 0; k < 4; k++) {
        char s0 = (char)(2 * k), s1 = (char)(8 + 2 * k), s2 = (char)(2 * k + 1), s3 = (char)(9 + 2 * k);
        const char z = (char)0x80;
        c.spread[k] = _mm256_setr_epi8(z, z, z, s0, z, z, z, s1, z, z, z, s2, z, z, z, s3, z, z, z, s0, z, z, z, s1, z, z,
                                       z, s2, z, z, z, s3);
    }
    return c;
}

/* steps 1-4: 16 packed bytes -> 32 int8 values (the long-latency half) */
INLINE __m256i mx_stage1(const uint8_t *p, const mx_consts *c)
{
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    t = _mm256_shuffle_epi8(t, c->arr);
    t = _mm256_and_si256(_mm256_srlv_epi64(t, c->shift), c->mask);
    return _mm256_shuffle_epi8(c->lut, t);
}

/* step 5 */
INLINE void mx_stage2(__m256 *f, __m256i v, const mx_consts *c)
{
    for (int k = 0; k < 4; k++)
        f[k] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, c->spread[k]));
}

INLINE void mx_decode(__m256 *f, const uint8_t *p, const mx_consts *c)
{
    mx_stage2(f, mx_stage1(p, c), c);
}

/* 2^(e-127) for the rare codes e <= 2, whose 2^(e-152) is not an fp32 */
static const float e8m0_low[3] = {0x1p-127f, 0x1p-126f, 0x1p-125f};

/* acc = fmaf(G, 2^(e-152), acc), or the two-step form for e <= 2 (README).
 * low = 0 is the variant for rows known to hold no code below 3 (row_low),
 * which keeps the rare branch out of the hot loops. */
INLINE __m256 mx_scale_acc(__m256 G, unsigned e, __m256 acc, int low)
{
    if (low && e < 3)
        return _mm256_fmadd_ps(_mm256_mul_ps(G, _mm256_set1_ps(0x1p-25f)), _mm256_broadcast_ss(&e8m0_low[e]), acc);
    return _mm256_fmadd_ps(G, _mm256_broadcast_ss(&shoal__kernels_e8m0_mul[e]), acc);
}

INLINE __m256 mx_group_sum(const __m256 *f, const float *xg)
{
    __m256 G = _mm256_mul_ps(f[0], _mm256_loadu_ps(xg));
    G = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xg + 8), G);
    G = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xg + 16), G);
    G = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xg + 24), G);
    return G;
}

#define MX_PF 1024 /* bytes ahead on the packed stream */

/* Group g's FMAs into the accumulators A (A[b] for token b), f decoded. */
INLINE void mx_fma(__m256 *A, const __m256 *f, unsigned e, const float *xt, int cols, int g, int TT, int low)
{
    for (int b = 0; b < TT; b++)
        A[b] = mx_scale_acc(mx_group_sum(f, xt + (size_t)b * cols + 32 * g), e, A[b], low);
}

/* One row, TT tokens (1..4); even groups into acc0, odd groups into acc1.
 * The first half of the decode (load, arrange, nibbles, LUT: one register)
 * runs two groups ahead, so the conversions and FMAs find it ready; a fully
 * pipelined decode (eight live weight registers) spills and measured slower. */
INLINE void mx_row(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows, int cols, int r, int t,
                   int TT, const mx_consts *c, int low)
{
    __m256 acc0[4], acc1[4];
    for (int b = 0; b < TT; b++)
        acc0[b] = acc1[b] = _mm256_setzero_ps();
    int ng = cols / 32, g = 0;
    const float *xt = x + (size_t)t * cols;
    __m256 f[4];
    if (ng >= 2) {
        __m256i v0 = mx_stage1(p, c), v1 = mx_stage1(p + 16, c);
        for (; g + 4 <= ng; g += 2) {
            if ((g & 3) == 0)
                _mm_prefetch((const char *)p + 16 * g + MX_PF, _MM_HINT_T0);
            __m256i n0 = mx_stage1(p + 16 * (g + 2), c);
            mx_stage2(f, v0, c);
            mx_fma(acc0, f, s[g], xt, cols, g, TT, low);
            v0 = n0;
            __m256i n1 = mx_stage1(p + 16 * (g + 3), c);
            mx_stage2(f, v1, c);
            mx_fma(acc1, f, s[g + 1], xt, cols, g + 1, TT, low);
            v1 = n1;
        }
        mx_stage2(f, v0, c);
        mx_fma(acc0, f, s[g], xt, cols, g, TT, low);
        mx_stage2(f, v1, c);
        mx_fma(acc1, f, s[g + 1], xt, cols, g + 1, TT, low);
        g += 2;
    }
    if (g < ng) {
        mx_decode(f, p + 16 * g, c);
        mx_fma(acc0, f, s[g], xt, cols, g, TT, low);
    }
    for (int b = 0; b < TT; b++)
        y[(size_t)(t + b) * rows + r] = hsum8(_mm256_add_ps(acc0[b], acc1[b]));
}

/* The constants are built here, not passed by pointer: as memory operands
 * they cost seven extra loads per group, which made the loop load-bound. */
#define MX_ROW_FN(name, TT, LOW)                                                                            \
    __attribute__((noinline)) static void name(float *y, const uint8_t *p, const uint8_t *s, const float *x,   \
                                               int rows, int cols, int r, int t)                             \
    {                                                                                                       \
        mx_consts c = mx_make();                                                                            \
        mx_row(y, p, s, x, rows, cols, r, t, TT, &c, LOW);                                                  \
    }
MX_ROW_FN(mx_row1, 1, 0)
MX_ROW_FN(mx_row4, 4, 0)
MX_ROW_FN(mx_row1_low, 1, 1)
MX_ROW_FN(mx_row4_low, 4, 1)

/* 1 if any E8M0 code of the row is below 3 (the two-step scaling) */
static int row_low(const uint8_t *s, int n)
{
    int i = 0;
    const __m256i three = _mm256_set1_epi8(3);
    for (; i + 32 <= n; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(s + i));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(v, three), v)) != -1)
            return 1;
    }
    for (; i < n; i++)
        if (s[i] < 3)
            return 1;
    return 0;
}

/* T > 1: a block of rows is decoded once into a stack buffer (f[g][k] as in
 * mx_decode, 128 bytes per group per row: a transient copy of a few rows,
 * never of the matrix); then tiles of 3 tokens run the same chains over it,
 * sharing each weight load, in column blocks of MX_KB so the x tile stays in
 * L1. The even/odd group accumulators are saved between column blocks
 * (unchanged bits); MX_KB is a multiple of 64 columns so a block always
 * starts on an even group. */
#define MX_BUF_FLOATS 32768 /* 128 KiB of stack */
#define MX_KB 1024
#define MX_RB_MAX 16

INLINE void mx_tile(float *y, __m256 *st, const __m256 *wb, const uint8_t *s, const float *x, int rows, int cols,
                    int r, int t, int TT, int g0, int g1, int init, int fin, int low)
{
    __m256 acc0[3], acc1[3];
    for (int b = 0; b < TT; b++) {
        acc0[b] = init ? _mm256_setzero_ps() : st[2 * b];
        acc1[b] = init ? _mm256_setzero_ps() : st[2 * b + 1];
    }
    const float *xt = x + (size_t)t * cols;
    int g = g0;
    for (; g + 2 <= g1; g += 2) {
        mx_fma(acc0, wb + 4 * g, s[g], xt, cols, g, TT, low);
        mx_fma(acc1, wb + 4 * (g + 1), s[g + 1], xt, cols, g + 1, TT, low);
    }
    if (g < g1)
        mx_fma(acc0, wb + 4 * g, s[g], xt, cols, g, TT, low);
    for (int b = 0; b < TT; b++) {
        if (fin) {
            y[(size_t)(t + b) * rows + r] = hsum8(_mm256_add_ps(acc0[b], acc1[b]));
        } else {
            st[2 * b] = acc0[b];
            st[2 * b + 1] = acc1[b];
        }
    }
}

#define MX_TILE_FN(name, TT, LOW)                                                                           \
    __attribute__((noinline)) static void name(float *y, __m256 *st, const __m256 *wb, const uint8_t *s,       \
                                               const float *x, int rows, int cols, int r, int t, int g0, int g1) \
    {                                                                                                       \
        mx_tile(y, st, wb, s, x, rows, cols, r, t, TT, g0, g1, g0 == 0, g1 == cols / 32, LOW);              \
    }
MX_TILE_FN(mx_tile1, 1, 0)

/* The common case spelled out with named registers: GCC keeps the generic
 * tile's accumulator arrays in registers but also stores them every group. */
#define MX_G3(A, B, C, G)                                                                                   \
    do {                                                                                                    \
        const __m256 *f_ = wb + 4 * (G);                                                                    \
        __m256 f0_ = f_[0], f1_ = f_[1], f2_ = f_[2], f3_ = f_[3];                                          \
        __m256 sc_ = _mm256_broadcast_ss(&shoal__kernels_e8m0_mul[s[G]]);                                   \
        const float *p0_ = x0 + 32 * (G), *p1_ = x1 + 32 * (G), *p2_ = x2 + 32 * (G);                       \
        __m256 g0_ = _mm256_mul_ps(f0_, _mm256_loadu_ps(p0_));                                              \
        __m256 g1_ = _mm256_mul_ps(f0_, _mm256_loadu_ps(p1_));                                              \
        __m256 g2_ = _mm256_mul_ps(f0_, _mm256_loadu_ps(p2_));                                              \
        g0_ = _mm256_fmadd_ps(f1_, _mm256_loadu_ps(p0_ + 8), g0_);                                           \
        g1_ = _mm256_fmadd_ps(f1_, _mm256_loadu_ps(p1_ + 8), g1_);                                           \
        g2_ = _mm256_fmadd_ps(f1_, _mm256_loadu_ps(p2_ + 8), g2_);                                           \
        g0_ = _mm256_fmadd_ps(f2_, _mm256_loadu_ps(p0_ + 16), g0_);                                          \
        g1_ = _mm256_fmadd_ps(f2_, _mm256_loadu_ps(p1_ + 16), g1_);                                          \
        g2_ = _mm256_fmadd_ps(f2_, _mm256_loadu_ps(p2_ + 16), g2_);                                          \
        g0_ = _mm256_fmadd_ps(f3_, _mm256_loadu_ps(p0_ + 24), g0_);                                          \
        g1_ = _mm256_fmadd_ps(f3_, _mm256_loadu_ps(p1_ + 24), g1_);                                          \
        g2_ = _mm256_fmadd_ps(f3_, _mm256_loadu_ps(p2_ + 24), g2_);                                          \
        A = _mm256_fmadd_ps(g0_, sc_, A);                                                                   \
        B = _mm256_fmadd_ps(g1_, sc_, B);                                                                   \
        C = _mm256_fmadd_ps(g2_, sc_, C);                                                                   \
    } while (0)

__attribute__((noinline)) static void mx_tile3(float *y, __m256 *st, const __m256 *wb, const uint8_t *s,
                                               const float *x, int rows, int cols, int r, int t, int g0, int g1)
{
    const float *x0 = x + (size_t)t * cols, *x1 = x0 + cols, *x2 = x1 + cols;
    __m256 a0, a1, a2, b0, b1, b2;
    if (g0 == 0) {
        a0 = a1 = a2 = b0 = b1 = b2 = _mm256_setzero_ps();
    } else {
        a0 = st[0], b0 = st[1], a1 = st[2], b1 = st[3], a2 = st[4], b2 = st[5];
    }
    int g = g0;
    for (; g + 2 <= g1; g += 2) {
        MX_G3(a0, a1, a2, g);
        MX_G3(b0, b1, b2, g + 1);
    }
    if (g < g1)
        MX_G3(a0, a1, a2, g);
    if (g1 == cols / 32) {
        y[(size_t)t * rows + r] = hsum8(_mm256_add_ps(a0, b0));
        y[(size_t)(t + 1) * rows + r] = hsum8(_mm256_add_ps(a1, b1));
        y[(size_t)(t + 2) * rows + r] = hsum8(_mm256_add_ps(a2, b2));
    } else {
        st[0] = a0, st[1] = b0, st[2] = a1, st[3] = b1, st[4] = a2, st[5] = b2;
    }
}
MX_TILE_FN(mx_tile3_low, 3, 1)
MX_TILE_FN(mx_tile1_low, 1, 1)

static void gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                       int T, int r0, int r1)
{
    if (cols % 32) {
        shoal__kernels_gemm_mxfp4_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    mx_consts c = mx_make();
    int ng = cols / 32;
    if (T == 1 || cols > MX_BUF_FLOATS) {
        for (int r = r0; r < r1; r++) {
            const uint8_t *p = packed + (size_t)r * (cols / 2), *s = scale + (size_t)r * ng;
            int low = row_low(s, ng), t = 0;
            for (; t + 4 <= T; t += 4)
                (low ? mx_row4_low : mx_row4)(y, p, s, x, rows, cols, r, t);
            for (; t < T; t++)
                (low ? mx_row1_low : mx_row1)(y, p, s, x, rows, cols, r, t);
        }
        return;
    }
    __m256 buf[MX_BUF_FLOATS / 8];
    __m256 st[MX_RB_MAX][6];
    int rb = MX_BUF_FLOATS / cols;
    rb = rb > MX_RB_MAX ? MX_RB_MAX : rb;
    for (int ra = r0; ra < r1; ra += rb) {
        int re = ra + rb < r1 ? ra + rb : r1;
        for (int r = ra; r < re; r++) {
            const uint8_t *p = packed + (size_t)r * (cols / 2);
            __m256 *wr = buf + (size_t)(r - ra) * (cols / 8);
            for (int g = 0; g < ng; g++)
                mx_decode(wr + 4 * g, p + 16 * g, &c);
        }
        for (int t = 0; t < T;) {
            int TT = T - t >= 3 ? 3 : 1;
            for (int g0 = 0; g0 < ng; g0 += MX_KB / 32) {
                int g1 = g0 + MX_KB / 32 < ng ? g0 + MX_KB / 32 : ng;
                for (int r = ra; r < re; r++) {
                    const __m256 *wr = buf + (size_t)(r - ra) * (cols / 8);
                    const uint8_t *s = scale + (size_t)r * ng;
                    int low = row_low(s + g0, g1 - g0);
                    if (TT == 3)
                        (low ? mx_tile3_low : mx_tile3)(y, st[r - ra], wr, s, x, rows, cols, r, t, g0, g1);
                    else
                        (low ? mx_tile1_low : mx_tile1)(y, st[r - ra], wr, s, x, rows, cols, r, t, g0, g1);
                }
            }
            t += TT;
        }
    }
}

/* ---- gemv_t: y[c] chains over r, eight columns per register -------------- */

#define GT_COLS 64

static void gemv_t_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int c0, int c1)
{
    int c = c0;
    for (; c + GT_COLS <= c1; c += GT_COLS) {
        __m256 acc[GT_COLS / 8];
        for (int j = 0; j < GT_COLS / 8; j++)
            acc[j] = _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const uint16_t *wr = w + (size_t)r * cols + c;
            __m256 xr = _mm256_set1_ps(x[r]);
            for (int j = 0; j < GT_COLS / 8; j++)
                acc[j] = _mm256_fmadd_ps(ld_bf16(wr + 8 * j), xr, acc[j]);
        }
        for (int j = 0; j < GT_COLS / 8; j++)
            _mm256_storeu_ps(y + c + 8 * j, acc[j]);
    }
    if (c < c1)
        shoal__kernels_gemv_t_bf16_scalar(y, w, x, rows, cols, c, c1);
}

static void gemv_t_f32(float *y, const float *w, const float *x, int rows, int cols, int c0, int c1)
{
    int c = c0;
    for (; c + GT_COLS <= c1; c += GT_COLS) {
        __m256 acc[GT_COLS / 8];
        for (int j = 0; j < GT_COLS / 8; j++)
            acc[j] = _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const float *wr = w + (size_t)r * cols + c;
            __m256 xr = _mm256_set1_ps(x[r]);
            for (int j = 0; j < GT_COLS / 8; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(wr + 8 * j), xr, acc[j]);
        }
        for (int j = 0; j < GT_COLS / 8; j++)
            _mm256_storeu_ps(y + c + 8 * j, acc[j]);
    }
    if (c < c1)
        shoal__kernels_gemv_t_f32_scalar(y, w, x, rows, cols, c, c1);
}

/* ---- KDA head: vectorised over the value column j --------------------------- */

#define KDA_JB 64 /* columns per register block (8 accumulators) */

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
    __m256 bv = _mm256_set1_ps(beta);
    for (int j0 = 0; j0 < D; j0 += KDA_JB) {
        __m256 acc[KDA_JB / 8];
        for (int j = 0; j < KDA_JB / 8; j++)
            acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D + j0;
            __m256 ei = _mm256_set1_ps(e[i]), ki = _mm256_set1_ps(k[i]);
            for (int j = 0; j < KDA_JB / 8; j++) {
                __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(Si + 8 * j), ei);
                _mm256_storeu_ps(Si + 8 * j, sv);
                acc[j] = _mm256_fmadd_ps(sv, ki, acc[j]);
            }
        }
        /* acc -> beta * (v - acc), the update vector for these columns */
        __m256 o_acc[KDA_JB / 8];
        for (int j = 0; j < KDA_JB / 8; j++) {
            acc[j] = _mm256_mul_ps(bv, _mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * j), acc[j]));
            o_acc[j] = _mm256_setzero_ps();
        }
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D + j0;
            __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
            for (int j = 0; j < KDA_JB / 8; j++) {
                __m256 sv = _mm256_fmadd_ps(ki, acc[j], _mm256_loadu_ps(Si + 8 * j));
                _mm256_storeu_ps(Si + 8 * j, sv);
                o_acc[j] = _mm256_fmadd_ps(sv, qi, o_acc[j]);
            }
        }
        for (int j = 0; j < KDA_JB / 8; j++)
            _mm256_storeu_ps(o + j0 + 8 * j, o_acc[j]);
    }
}

/* ---- MLA heads ---------------------------------------------------------------
 * Scores: the canonical 16-lane dot over q_lat ‖ q_pe against a cached row.
 * Softmax: shoal_softmax (scalar, so identical). Context: ctx[h][i] chains
 * over s from +0. The cache is walked in blocks of MLA_SB rows (in L2); every
 * head of this worker's range uses a block before the next is read, so the
 * cache comes from DRAM once per call per thread. Heads go 6 at a time
 * through the registers (12 independent chains, one load of each cached
 * chunk per 6 heads); partial context chains are parked in ctx between row
 * blocks, which changes no bit. */
#define MLA_MAXH 6
#define MLA_SB 48
#define MLA_QSET 96 /* queries (token x head) per pass over the cache */

INLINE void mla_scores(float *scratch, const float *q_lat, const float *q_pe, const float *cache, int S, int R, int P,
                       float scale, int h0, int nh, int s0, int s1)
{
    size_t W = (size_t)R + P;
    for (int s = s0; s < s1; s++) {
        const float *c = cache + (size_t)s * W;
        __m256 a[MLA_MAXH][2];
        for (int h = 0; h < nh; h++)
            a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int i = 0; i < R; i += 16) {
            __m256 c0 = _mm256_loadu_ps(c + i), c1 = _mm256_loadu_ps(c + i + 8);
            for (int h = 0; h < nh; h++) {
                const float *ql = q_lat + (size_t)(h0 + h) * R + i;
                a[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(ql), c0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(ql + 8), c1, a[h][1]);
            }
        }
        for (int i = 0; i < P; i += 16) {
            __m256 c0 = _mm256_loadu_ps(c + R + i), c1 = _mm256_loadu_ps(c + R + i + 8);
            for (int h = 0; h < nh; h++) {
                const float *qp = q_pe + (size_t)(h0 + h) * P + i;
                a[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp), c0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 8), c1, a[h][1]);
            }
        }
        for (int h = 0; h < nh; h++)
            scratch[(size_t)(h0 + h) * S + s] = scale * hsum16(a[h][0], a[h][1]);
    }
}

INLINE void mla_ctx(float *ctx, const float *p, const float *cache, int S, int R, int P, int h0, int nh, int s0,
                    int s1)
{
    size_t W = (size_t)R + P;
    for (int i = 0; i < R; i += 16) {
        __m256 acc[MLA_MAXH][2];
        for (int h = 0; h < nh; h++) {
            float *o = ctx + (size_t)(h0 + h) * R + i;
            acc[h][0] = s0 ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
            acc[h][1] = s0 ? _mm256_loadu_ps(o + 8) : _mm256_setzero_ps();
        }
        for (int s = s0; s < s1; s++) {
            const float *c = cache + (size_t)s * W + i;
            __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8);
            for (int h = 0; h < nh; h++) {
                __m256 pv = _mm256_broadcast_ss(p + (size_t)(h0 + h) * S + s);
                acc[h][0] = _mm256_fmadd_ps(pv, c0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(pv, c1, acc[h][1]);
            }
        }
        for (int h = 0; h < nh; h++) {
            _mm256_storeu_ps(ctx + (size_t)(h0 + h) * R + i, acc[h][0]);
            _mm256_storeu_ps(ctx + (size_t)(h0 + h) * R + i + 8, acc[h][1]);
        }
    }
}

#define MLA_FN(n)                                                                                           \
    __attribute__((noinline)) static void mla_scores##n(float *scratch, const float *q_lat, const float *q_pe, \
                                                        const float *cache, int S, int R, int P, float scale, \
                                                        int h0, int s0, int s1)                              \
    {                                                                                                       \
        mla_scores(scratch, q_lat, q_pe, cache, S, R, P, scale, h0, n, s0, s1);                             \
    }                                                                                                       \
    __attribute__((noinline)) static void mla_ctx##n(float *ctx, const float *p, const float *cache, int S,   \
                                                     int R, int P, int h0, int s0, int s1)                   \
    {                                                                                                       \
        mla_ctx(ctx, p, cache, S, R, P, h0, n, s0, s1);                                                     \
    }
MLA_FN(1)
MLA_FN(2)
MLA_FN(3)
MLA_FN(4)
MLA_FN(5)
MLA_FN(6)

static void mla_heads(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0, int T, int H,
                      int R, int P, float scale, float *scratch, int h0, int h1)
{
    typedef void (*scores_fn)(float *, const float *, const float *, const float *, int, int, int, float, int, int,
                              int);
    typedef void (*ctx_fn)(float *, const float *, const float *, int, int, int, int, int, int);
    static const scores_fn sc[MLA_MAXH + 1] = {NULL, mla_scores1, mla_scores2, mla_scores3,
                                               mla_scores4, mla_scores5, mla_scores6};
    static const ctx_fn cx[MLA_MAXH + 1] = {NULL, mla_ctx1, mla_ctx2, mla_ctx3, mla_ctx4, mla_ctx5, mla_ctx6};
    if (R % 16 || P % 16) {
        shoal__kernels_mla_heads_scalar(ctx, q_lat, q_pe, cache, S0, T, H, R, P, scale, scratch, h0, h1);
        return;
    }
    /* Heads go in chunks of at most MLA_QSET/T (a multiple of 6), so the
     * queries a cache block meets (T x chunk x (R+P) floats, 220 KB at K3
     * widths) stay in L2 next to the block: a query is as large as a cached
     * row, so sweeping all 96 heads of 4 tokens per block (885 KB) streamed the
     * queries from L3 and was slower per token than decoding token by token. */
    int hc = MLA_QSET / T / MLA_MAXH * MLA_MAXH;
    hc = hc < MLA_MAXH ? MLA_MAXH : hc;
    if (h1 - h0 > hc) {
        for (int c0 = h0; c0 < h1; c0 += hc)
            mla_heads(ctx, q_lat, q_pe, cache, S0, T, H, R, P, scale, scratch, c0, c0 + hc < h1 ? c0 + hc : h1);
        return;
    }
    int Sm = S0 + T; /* p row stride; token t uses rows [0, S0+t] */
    size_t HR = (size_t)H * R, HP = (size_t)H * P, HS = (size_t)H * Sm;
    for (int s0 = 0; s0 < Sm; s0 += MLA_SB) {
        int s1 = s0 + MLA_SB < Sm ? s0 + MLA_SB : Sm;
        for (int t = 0; t < T; t++) {
            int lim = S0 + t + 1 < s1 ? S0 + t + 1 : s1;
            for (int h = h0; h < h1 && lim > s0; h += MLA_MAXH) {
                int n = h1 - h < MLA_MAXH ? h1 - h : MLA_MAXH;
                sc[n](scratch + t * HS, q_lat + t * HR, q_pe + t * HP, cache, Sm, R, P, scale, h, s0, lim);
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int h = h0; h < h1; h++)
            shoal_softmax(scratch + t * HS + (size_t)h * Sm, S0 + t + 1);
    for (int s0 = 0; s0 < Sm; s0 += MLA_SB) {
        int s1 = s0 + MLA_SB < Sm ? s0 + MLA_SB : Sm;
        for (int t = 0; t < T; t++) {
            int lim = S0 + t + 1 < s1 ? S0 + t + 1 : s1;
            for (int h = h0; h < h1 && lim > s0; h += MLA_MAXH) {
                int n = h1 - h < MLA_MAXH ? h1 - h : MLA_MAXH;
                cx[n](ctx + t * HR, scratch + t * HS, cache, Sm, R, P, h, s0, lim);
            }
        }
    }
}

int shoal__kernels_fill_avx2(shoal__kernels_table *t)
{
    t->gemm_bf16 = gemm_bf16;
    t->gemm_f32 = gemm_f32;
    t->gemm_mxfp4 = gemm_mxfp4;
    t->gemv_t_bf16 = gemv_t_bf16;
    t->gemv_t_f32 = gemv_t_f32;
    t->kda_head = kda_head;
    t->mla_heads = mla_heads;
    return 1;
}

#else
#include "kernels/kernels_int.h"
int shoal__kernels_fill_avx2(shoal__kernels_table *t)
{
    (void)t;
    return 0;
}
#endif
