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
#include <string.h>

#include "kernels/kernels_int.h"
#include "kernels/mu_sse.h"


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
/* GEMV over short rows (cols * sizeof(WT) <= GV_SHORT bytes, e.g. MLA q_b,
 * 1536 bf16 = 3 KiB): PF_DIST ahead on a row lands in the next row of the
 * same tile, which is already being read, so the next tiles' rows were never
 * prefetched. There the tile instead prefetches the tile GV_AHEAD tiles on,
 * as one linear stream: R rows of 16 columns per step = R * 16 * sizeof(WT)
 * bytes, the same as it consumes. */
#define GV_SHORT 4096
#define GV_AHEAD 2

#define DEFINE_TILE(K, WT, LOADW, PF)                                                                       \
    INLINE void tile_##K(float *y, __m256 *st, const WT *w, const float *x, int rows, int cols, int r, int t, \
                         int R, int TT, int k0, int k1, int init, int fin, const char *pfn)                 \
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
            if (pfn) {                                                                                      \
                const char *q_ = pfn + (size_t)(i - k0) * R * sizeof(WT);                                   \
                for (int l_ = 0; l_ < R * 16 * (int)sizeof(WT); l_ += 64)                                   \
                    _mm_prefetch(q_ + l_, _MM_HINT_T0);                                                     \
            }                                                                                               \
            for (int a = 0; a < R; a++)                                                                     \
                if (!pfn && TT == 1)                                                                        \
                    _mm_prefetch((const char *)(wr[a] + i) + (PF), _MM_HINT_T0);                            \
            /* one half (8 lanes) at a time: R weight and 1 x register live beside \
             * the 2*R*TT accumulators (15 of 16 ymm at 2 x 3), each x loaded once */ \
            for (int h = 0; h < 2; h++) {                                                                   \
                __m256 wv[4];                                                                               \
                for (int a = 0; a < R; a++)                                                                 \
                    wv[a] = LOADW(wr[a] + i + 8 * h);                                                       \
                for (int b = 0; b < TT; b++) {                                                              \
                    __m256 xv = _mm256_loadu_ps(xt[b] + i + 8 * h);                                         \
                    __asm__("" : "+x"(xv)); /* one load, not one folded into each FMA */                   \
                    for (int a = 0; a < R; a++)                                                             \
                        acc[a][b][h] = _mm256_fmadd_ps(wv[a], xv, acc[a][b][h]);                            \
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
 * GEMM (T > 1): rows in blocks of 16, tokens in tiles of 3 (of 2 for the
 * last two or four: T = 2 is one 2-token pass, not two GEMVs), columns in blocks
 * of KBLOCK: a 3-token x block (12 KiB) stays in L1 and the 16-row weight
 * block in L2 while every tile passes; each weight is read from DRAM once. */
#define KBLOCK 1024
#define RBLOCK 16

#define TILE_FNS(K, WT, SHORTPF)                                                                            \
    __attribute__((noinline)) static void K##_4x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r, const char *pfn)                                  \
    {                                                                                                       \
        tile_##K(y, NULL, w, x, rows, cols, r, 0, 4, 1, 0, cols, 1, 1, pfn);                                \
    }                                                                                                       \
    __attribute__((noinline)) static void K##_1x1(float *y, const WT *w, const float *x, int rows, int cols, \
                                                  int r)                                                   \
    {                                                                                                       \
        tile_##K(y, NULL, w, x, rows, cols, r, 0, 1, 1, 0, cols, 1, 1, NULL);                               \
    }                                                                                                       \
    /* one (R, TT) tile over columns [k0, k1) */                                                            \
    __attribute__((noinline)) static void K##_tile(float *y, __m256 *st, const WT *w, const float *x, int rows, \
                                                   int cols, int r, int t, int R, int TT, int k0, int k1)   \
    {                                                                                                       \
        int init = k0 == 0, fin = k1 == cols;                                                               \
        if (R == 2 && TT == 3)                                                                              \
            tile_##K(y, st, w, x, rows, cols, r, t, 2, 3, k0, k1, init, fin, NULL);                         \
        else if (R == 2 && TT == 2)                                                                         \
            tile_##K(y, st, w, x, rows, cols, r, t, 2, 2, k0, k1, init, fin, NULL);                         \
        else if (R == 2)                                                                                    \
            tile_##K(y, st, w, x, rows, cols, r, t, 2, 1, k0, k1, init, fin, NULL);                         \
        else if (TT == 3)                                                                                   \
            tile_##K(y, st, w, x, rows, cols, r, t, 1, 3, k0, k1, init, fin, NULL);                         \
        else if (TT == 2)                                                                                   \
            tile_##K(y, st, w, x, rows, cols, r, t, 1, 2, k0, k1, init, fin, NULL);                         \
        else                                                                                                \
            tile_##K(y, st, w, x, rows, cols, r, t, 1, 1, k0, k1, init, fin, NULL);                         \
    }                                                                                                       \
    static void K##_rows(float *y, const WT *w, const float *x, int rows, int cols, int T, int r0, int r1)  \
    {                                                                                                       \
        if (T == 1) {                                                                                       \
            int r = r0, shortr = SHORTPF && (size_t)cols * sizeof(WT) <= GV_SHORT;                          \
            for (; r + 4 <= r1; r += 4) {                                                                   \
                int rp = r + 4 * GV_AHEAD; /* past the matrix: per-row prefetch */                          \
                const char *pfn = shortr && rp + 4 <= rows ? (const char *)(w + (size_t)rp * cols) : NULL;  \
                K##_4x1(y, w, x, rows, cols, r, pfn);                                                       \
            }                                                                                               \
            for (; r < r1; r++)                                                                             \
                K##_1x1(y, w, x, rows, cols, r);                                                            \
            return;                                                                                         \
        }                                                                                                   \
        __m256 st[RBLOCK / 2][12];                                                                          \
        int kb = T <= 4 ? cols : KBLOCK; /* x of <= 4 tokens stays in L2 unblocked */                   \
        for (int rb = r0; rb < r1; rb += RBLOCK) {                                                          \
            int re = rb + RBLOCK < r1 ? rb + RBLOCK : r1;                                                   \
            for (int t = 0; t < T;) {                                                                       \
                int TT = T - t == 4 ? 2 : T - t >= 3 ? 3 : T - t;                                           \
                for (int k0 = 0; k0 < cols; k0 += kb) {                                                     \
                    int k1 = k0 + kb < cols ? k0 + kb : cols;                                               \
                    for (int r = rb; r < re; r += 2)                                                        \
                        K##_tile(y, st[(r - rb) / 2], w, x, rows, cols, r, t, re - r >= 2 ? 2 : 1, TT, k0, k1); \
                }                                                                                           \
                t += TT;                                                                                    \
            }                                                                                               \
        }                                                                                                   \
    }

TILE_FNS(bf16, uint16_t, 1)
TILE_FNS(f32, float, 0)

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

/* ---- MXFP4 ------------------------------------------------------------------
 * The canonical order (kernels/README.md, "MXFP4"): 16 lanes, lane j of a
 * group takes packed byte j, low nibble (column 2j) then high nibble (column
 * 2j+1); result 4 * reduce16. Here the 16 lanes are two ymm registers,
 * acc0 = lanes [0,2,4,6 | 8,10,12,14] and acc1 = lanes [1,3,5,7 | 9,11,13,15], the
 * order the decoder produces (one lane is still one register slot, with the
 * same chain). Decode of one group (16 packed bytes) with E8M0 code e:
 *  1. broadcast the 16 bytes to both 128-bit lanes; vpshufb (ARR) makes lane 0
 *     bytes {0..7, 0..7} and lane 1 bytes {8..15, 8..15};
 *  2. shift the upper qword of each lane right by 4 and mask 0x0F: lane 0 holds
 *     the low-nibble codes of bytes 0-7 then their high-nibble codes, lane 1
 *     the same for bytes 8-15;
 *  3. two vpshufb from the scale's table (shoal__kernels_mx_bf[e]) give the
 *     low and high bytes of the exact weight E2M1/4 * 2^(e-127) as bf16 (exact:
 *     two significant bits);
 *  4. vpunpck{l,h}bw pair them into bf16 words (w0: low nibbles of bytes
 *     [0-7 | 8-15], w1: high nibbles); a dword holds the words of bytes 2i and
 *     2i+1, so fp32 = w << 16 for the even byte and w & 0xffff0000 for the
 *     odd one: f0 = low nibbles of bytes [0,2,4,6 | 8,..,14], f1 = low
 *     [1,3,5,7 | 9,..,15], f2 = high even, f3 = high odd (a shift and a mask
 *     instead of four vpunpck{l,h}wd: 5 shuffles per group, not 9).
 * 11 instructions per 32 weights, the scale folded in; each token then costs
 * four FMAs per group, with x deinterleaved once per column block into the
 * matching order (xb, on the stack). */
#define MX_XB 8192 /* floats of deinterleaved x (32 KiB) */
#define MX_RB 16
#define MX_TMAX 4

typedef struct {
    __m256i arr, shift, mask, hi16;
} mx_consts;

INLINE mx_consts mx_make(void)
{
    mx_consts c;
    c.arr = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11,
                             12, 13, 14, 15);
    c.shift = _mm256_setr_epi64x(0, 4, 0, 4);
    c.mask = _mm256_set1_epi8(0x0f);
    c.hi16 = _mm256_set1_epi32((int)0xffff0000u);
    return c;
}

INLINE void mx_dec(__m256 *f, const uint8_t *p, unsigned e, const mx_consts *c)
{
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    t = _mm256_shuffle_epi8(t, c->arr);
    t = _mm256_and_si256(_mm256_srlv_epi64(t, c->shift), c->mask);
    const uint8_t *tb = shoal__kernels_mx_bf[e];
    __m256i tl = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)tb));
    __m256i th = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(tb + 16)));
    __m256i bl = _mm256_shuffle_epi8(tl, t), bh = _mm256_shuffle_epi8(th, t);
    __m256i w0 = _mm256_unpacklo_epi8(bl, bh), w1 = _mm256_unpackhi_epi8(bl, bh);
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, c->hi16));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, c->hi16));
}

/* reduce16 of the lanes held as acc0 = [0,2,4,6 | 8,10,12,14], acc1 = [1,3,5,7 | 9,11,13,15] */
INLINE float mx_hsum(__m256 a0, __m256 a1)
{
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)); /* b[0,2,4,6] */
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1)); /* b[1,3,5,7] */
    __m128 cu = _mm_add_ps(u, _mm_movehl_ps(u, u)); /* c[0] = b0 + b4, c[2] = b2 + b6 */
    __m128 cv = _mm_add_ps(v, _mm_movehl_ps(v, v)); /* c[1] = b1 + b5, c[3] = b3 + b7 */
    __m128 d = _mm_add_ss(cu, _mm_movehdup_ps(cu)); /* c0 + c2 */
    __m128 e = _mm_add_ss(cv, _mm_movehdup_ps(cv)); /* c1 + c3 */
    return _mm_cvtss_f32(_mm_add_ss(d, e));
}

/* x[t..t+TT) groups [g0, g1) -> xb[b*xs + 32*(g-g0) + 8k + i] = x[4i + o_k], o = (0, 2, 1, 3):
 * slot i of f[k] holds byte 2i (k even) or 2i+1 (k odd) of [0-7 | 8-15], low
 * nibble for k < 2, high for k >= 2 (a 4x4 transpose of each half-group) */
static void mx_deint(float *xb, int xs, const float *x, int cols, int t, int TT, int g0, int g1)
{
    for (int b = 0; b < TT; b++) {
        const float *xt = x + (size_t)(t + b) * cols;
        float *o = xb + (size_t)b * xs;
        for (int g = g0; g < g1; g++) {
            const float *xg = xt + 32 * g;
            __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
                   x3 = _mm256_loadu_ps(xg + 24);
            /* rows of four columns: y0 = [r0 | r4], y1 = [r1 | r5], y2 = [r2 | r6], y3 = [r3 | r7] */
            __m256 y0 = _mm256_permute2f128_ps(x0, x2, 0x20), y1 = _mm256_permute2f128_ps(x0, x2, 0x31);
            __m256 y2 = _mm256_permute2f128_ps(x1, x3, 0x20), y3 = _mm256_permute2f128_ps(x1, x3, 0x31);
            __m256 t0 = _mm256_unpacklo_ps(y0, y1), t1 = _mm256_unpackhi_ps(y0, y1);
            __m256 t2 = _mm256_unpacklo_ps(y2, y3), t3 = _mm256_unpackhi_ps(y2, y3);
            float *og = o + 32 * (g - g0);
            _mm256_store_ps(og, _mm256_shuffle_ps(t0, t2, 0x44));      /* column 4i */
            _mm256_store_ps(og + 8, _mm256_shuffle_ps(t1, t3, 0x44));  /* 4i + 2 */
            _mm256_store_ps(og + 16, _mm256_shuffle_ps(t0, t2, 0xEE)); /* 4i + 1 */
            _mm256_store_ps(og + 24, _mm256_shuffle_ps(t1, t3, 0xEE)); /* 4i + 3 */
        }
    }
}

INLINE void mx_tile(float *y, __m256 *st, const uint8_t *packed, const uint8_t *scale, const float *xb, int xs,
                    int rows, int cols, int r, int R, int t, int TT, int g0, int g1, int init, int fin,
                    const mx_consts *c)
{
    __m256 acc[2][MX_TMAX][2];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            for (int h = 0; h < 2; h++)
                acc[a][b][h] = init ? _mm256_setzero_ps() : st[(a * MX_TMAX + b) * 2 + h];
    int ng = cols / 32;
    const uint8_t *p[2], *s[2];
    for (int a = 0; a < R; a++) {
        p[a] = packed + (size_t)(r + a) * (cols / 2);
        s[a] = scale + (size_t)(r + a) * ng;
    }
    size_t pf = (size_t)R * (cols / 2);
/* one group of every row of the tile, groups in increasing order */
#define MX_GROUP(G)                                                                                         \
    do {                                                                                                    \
        const float *xg = xb + 32 * ((G)-g0);                                                               \
        for (int a = 0; a < R; a++) {                                                                       \
            __m256 f[4];                                                                                    \
            mx_dec(f, p[a] + 16 * (G), s[a][G], c);                                                         \
            for (int k = 0; k < 4; k++)                                                                     \
                for (int b = 0; b < TT; b++)                                                                \
                    acc[a][b][k & 1] =                                                                      \
                        _mm256_fmadd_ps(f[k], _mm256_load_ps(xg + (size_t)b * xs + 8 * k), acc[a][b][k & 1]); \
        }                                                                                                   \
    } while (0)
    /* Four groups per step (g0 is a multiple of 16), so the prefetches need no
     * test per group: one line (4 groups) of the same line of the next tile's
     * row (rows are short), the scales every 16 groups. */
    int g = g0;
    for (; g + 4 <= g1; g += 4) {
        if ((g & 15) == 0)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)s[a] + (size_t)R * ng + g, _MM_HINT_T0);
        for (int a = 0; a < R; a++)
            _mm_prefetch((const char *)p[a] + pf + 16 * g, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
            MX_GROUP(g + u);
    }
    for (; g < g1; g++) {
        if ((g & 15) == 0)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)s[a] + (size_t)R * ng + g, _MM_HINT_T0);
        if ((g & 3) == 0)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)p[a] + pf + 16 * g, _MM_HINT_T0);
        MX_GROUP(g);
    }
#undef MX_GROUP
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++) {
            if (fin)
                y[(size_t)(t + b) * rows + r + a] = 4.0f * mx_hsum(acc[a][b][0], acc[a][b][1]);
            else
                for (int h = 0; h < 2; h++)
                    st[(a * MX_TMAX + b) * 2 + h] = acc[a][b][h];
        }
}

typedef void (*mx_tile_fn)(float *y, __m256 *st, const uint8_t *packed, const uint8_t *scale, const float *xb,
                           int xs, int rows, int cols, int r, int t, int g0, int g1);
/* the constants are built here so they live in registers */
#define MX_TILE(R, TT)                                                                                      \
    __attribute__((noinline)) static void mx_tile_##R##x##TT(float *y, __m256 *st, const uint8_t *packed,     \
                                                             const uint8_t *scale, const float *xb, int xs,   \
                                                             int rows, int cols, int r, int t, int g0, int g1) \
    {                                                                                                       \
        mx_consts c = mx_make();                                                                            \
        mx_tile(y, st, packed, scale, xb, xs, rows, cols, r, R, t, TT, g0, g1, g0 == 0, g1 == cols / 32, &c); \
    }
MX_TILE(2, 1)
MX_TILE(1, 1)
MX_TILE(1, 2)
MX_TILE(1, 4)

static void gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                       int T, int r0, int r1)
{
    if (cols % 32) {
        shoal__kernels_gemm_mxfp4_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    __attribute__((aligned(32))) float xb[MX_XB];
    __m256 st[MX_RB * MX_TMAX * 2];
    int ng = cols / 32;
    /* Row blocks outside the token tiles, so a block's weights stay in L2 while
     * every token tile passes (the caller hands one range per thread). With a
     * single column block for every tile width no lanes are saved: the block
     * is as large as L2 allows (T = 1: the whole range, one stream). */
    int kbmin = MX_XB / (T >= 4 ? 4 : T >= 2 ? 2 : 1) / 32;
    int rbs = ng > kbmin ? MX_RB : T == 1 ? r1 - r0 : shoal__kernels_gemm_rb(cols / 2 + ng, 1 << 16);
    for (int rb = r0; rb < r1; rb += rbs) {
        int re = rb + rbs < r1 ? rb + rbs : r1;
        for (int t = 0; t < T;) {
            int TT = T - t >= 4 ? 4 : T - t >= 2 ? 2 : 1;
            int R = TT == 1 ? 2 : 1;
            mx_tile_fn big = TT == 4 ? mx_tile_1x4 : TT == 2 ? mx_tile_1x2 : mx_tile_2x1;
            mx_tile_fn one = TT == 4 ? mx_tile_1x4 : TT == 2 ? mx_tile_1x2 : mx_tile_1x1;
            int kb = MX_XB / TT / 32, xs = kb * 32;
            for (int g0 = 0; g0 < ng; g0 += kb) {
                int g1 = g0 + kb < ng ? g0 + kb : ng;
                mx_deint(xb, xs, x, cols, t, TT, g0, g1);
                int r = rb;
                for (; r + R <= re; r += R)
                    big(y, st + (size_t)(r - rb) * MX_TMAX * 2, packed, scale, xb, xs, rows, cols, r, t, g0, g1);
                for (; r < re; r++)
                    one(y, st + (size_t)(r - rb) * MX_TMAX * 2, packed, scale, xb, xs, rows, cols, r, t, g0, g1);
            }
            t += TT;
        }
    }
}

/* ---- matrix-unit order (gemm_mu.c is the specification) ----------------------
 * As in gemm_avx512.c with 8 rows per ymm: per 32-column block each row's
 * 64 bytes of bf16 weights (as stored, or an MXFP4 group decoded exactly to
 * bf16 with vpshufb from the scale's split table shoal__kernels_mu_bfs[e]) are
 * two ymm of 8 dwords (pairs 0-7, 8-15); two 8 x 8 dword transposes give the
 * pairs of the 8 rows, split into even (<< 16) and odd (& 0xffff0000) weights
 * in a stack buffer; then per token the E and O chains over p = 0..15 from +0
 * and C += E + O, under MXCSR FTZ|DAZ. */
#define MU_XB 8192
#define MU_TT 4
#define MU_RB 64

/* x[t..t+TT) columns [c0, c1) rounded to bf16 -> xb[b * xs + c - c0]; and,
 * per 32-column block j of the chunk, the scale codes [lo[j], hi[j]] for
 * which the fold path computes that block exactly for all TT tokens (see
 * mu_blk_fold; lo[j] > hi[j]: none; lo NULL: not wanted). */
static void mu_round_x(float *xb, int xs, uint8_t *lo, uint8_t *hi, const float *x, int cols, int t, int TT, int c0,
                       int c1)
{
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i himask = _mm256_set1_epi32((int)0xffff0000u), quiet = _mm256_set1_epi32(0x00400000);
    const __m256i ff = _mm256_set1_epi32(0xff), zero = _mm256_setzero_si256();
    for (int c = c0; c < c1; c += 32) {
        __m256i fmin = ff, fmax = zero; /* exponent fields: least of the nonzero ones, greatest */
        for (int b = 0; b < TT; b++)
            for (int h = 0; h < 32; h += 8) {
                __m256 v = _mm256_loadu_ps(x + (size_t)(t + b) * cols + c + h);
                __m256i u = _mm256_castps_si256(v);
                __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                __m256i rn = _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
                rn = _mm256_and_si256(_mm256_blendv_epi8(rn, _mm256_or_si256(u, quiet), nan), himask);
                _mm256_store_ps(xb + (size_t)b * xs + (c - c0) + h, _mm256_castsi256_ps(rn));
                if (lo) {
                    __m256i f = _mm256_and_si256(_mm256_srli_epi32(rn, 23), ff); /* 0: zero or subnormal (DAZ: zero) */
                    /* a zero field counts as 0xff for the least */
                    fmin = _mm256_min_epu32(fmin, _mm256_or_si256(f, _mm256_and_si256(_mm256_cmpeq_epi32(f, zero), ff)));
                    fmax = _mm256_max_epu32(fmax, f);
                }
            }
        if (!lo) /* bf16 weights: no fold path */
            continue;
        __attribute__((aligned(32))) uint32_t mn[8], mx[8];
        _mm256_store_si256((__m256i *)mn, fmin);
        _mm256_store_si256((__m256i *)mx, fmax);
        /* the bounds of gemm_avx512.c's fold path, and e >= 26 and fmax <= 219 for
         * the 2^24-scaled integer weights (mu_blk_fold) */
        shoal__mu_fold_range(&lo[(c - c0) / 32], &hi[(c - c0) / 32], mn, mx, 8, 26, 219);
    }
}

/* 8 x 8 dword transpose: d[j] lane i = r[i] lane j */
INLINE void mu_transpose8(__m256i d[8], const __m256i r[8])
{
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 2; m++) {
        b[4 * m + 0] = _mm256_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 1] = _mm256_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 2] = _mm256_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
        b[4 * m + 3] = _mm256_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        d[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
        d[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
    }
}

/* One MXFP4 group with E8M0 code e -> the row's two ymm (columns 0-15, 16-31) as bf16 words */
INLINE void mu_mx_dec(__m256i out[2], const uint8_t *p, unsigned e)
{
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    __m128i tl = _mm_load_si128((const __m128i *)shoal__kernels_mu_bfs[e]);
    __m128i th = _mm_load_si128((const __m128i *)(shoal__kernels_mu_bfs[e] + 16));
    for (int h = 0; h < 2; h++) {
        __m128i c = h ? _mm_unpackhi_epi8(lo, hi) : _mm_unpacklo_epi8(lo, hi); /* codes of columns 16h.. */
        __m128i L = _mm_shuffle_epi8(tl, c), H = _mm_shuffle_epi8(th, c);
        out[h] = _mm256_set_m128i(_mm_unpackhi_epi8(L, H), _mm_unpacklo_epi8(L, H));
    }
}

/* Rows r..r+nr-1 (lanes past nr repeat the last row), tokens t..t+TT-1,
 * columns [c0, c1): chains from +0 (c0 == 0) or st, to y (c1 == cols and y
 * not NULL) or st. */
INLINE void mu_tile(float *y, __m256 *st, const uint16_t *w, const uint8_t *packed, const uint8_t *scale,
                    const float *xb, int xs, int rows, int cols, int r, int nr, int t, int TT, int c0, int c1)
{
    __m256 C[MU_TT];
    for (int b = 0; b < TT; b++)
        C[b] = c0 == 0 ? _mm256_setzero_ps() : st[b];
    size_t row[8];
    for (int i = 0; i < 8; i++)
        row[i] = (size_t)r + (i < nr ? i : nr - 1);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __attribute__((aligned(32))) __m256 we[16], wo[16];
    for (int c = c0; c < c1; c += 32) {
        __m256i rv[2][8], d[8];
        for (int i = 0; i < 8; i++) {
            if (w) {
                const uint16_t *q = w + row[i] * cols + c;
                _mm_prefetch((const char *)q + 512, _MM_HINT_T0);
                rv[0][i] = _mm256_loadu_si256((const __m256i *)q);
                rv[1][i] = _mm256_loadu_si256((const __m256i *)(q + 16));
            } else {
                __m256i o[2];
                mu_mx_dec(o, packed + row[i] * (cols / 2) + c / 2, scale[row[i] * (cols / 32) + c / 32]);
                rv[0][i] = o[0], rv[1][i] = o[1];
            }
        }
        for (int h = 0; h < 2; h++) {
            mu_transpose8(d, rv[h]);
            for (int p = 0; p < 8; p++) {
                we[8 * h + p] = _mm256_castsi256_ps(_mm256_slli_epi32(d[p], 16));
                wo[8 * h + p] = _mm256_castsi256_ps(_mm256_and_si256(d[p], hi));
            }
        }
        const float *xc = xb + (c - c0);
        for (int b = 0; b < TT; b++) {
            const float *xq = xc + (size_t)b * xs;
            __m256 E = _mm256_setzero_ps(), O = _mm256_setzero_ps();
            for (int p = 0; p < 16; p++) {
                E = _mm256_fmadd_ps(we[p], _mm256_broadcast_ss(xq + 2 * p), E);
                O = _mm256_fmadd_ps(wo[p], _mm256_broadcast_ss(xq + 2 * p + 1), O);
            }
            C[b] = _mm256_add_ps(C[b], _mm256_add_ps(E, O));
        }
    }
    for (int b = 0; b < TT; b++) {
        if (c1 == cols && y) {
            __attribute__((aligned(32))) float v[8];
            _mm256_store_ps(v, C[b]);
            for (int i = 0; i < nr; i++)
                y[(size_t)(t + b) * rows + r + i] = v[i];
        } else
            st[b] = C[b];
    }
}

/* ---- MXFP4: the fold path (the fast path; gemm_avx512.c explains the fold) ----
 * Lanes are 8 rows. The packed bytes are transposed first (8 rows x 16 bytes
 * = 4 ymm: 4 loads, 4 vinserti128, 8 in-lane unpacks): Q[q] lane i = bytes
 * 4q..4q+3 of row i's group. The chains run on integers: vpshufb looks up
 * each byte's low (high) nibble in a table of 2 * E2M1 as int8 (0, +-1, +-2,
 * +-3, +-4, +-6, +-8, +-12), giving the weights of columns 8q + 2m (8q + 2m +
 * 1) in byte m of each lane; a second vpshufb moves byte m to the top of its
 * dword (the rest zero), and vcvtdq2ps makes that int32, n * 2^24, exactly an
 * fp32: the weight v = E2M1 * 2^(e-127) times 2^(152-e). So per block C =
 * fma(E' + O', 2^(e-152), C), exact under the bounds of gemm_avx512.c plus two
 * for the extra 2^25: 2^(e-152) normal (e >= 26), and the chains of the
 * larger weights below 2^127 (activations' greatest exponent field <= 219).
 * The weight of code 8 (-0) is +0 here: no result can tell, as every chain
 * starts at +0, x + (+-0) is x for x nonzero and +0 for x = +0, and inside
 * the bounds no result is tiny (an FTZ flush could make a -0). */

/* Q[4] of one block (rows p + i * ld, i < 8): Q[q] lane i = bytes 4q..4q+3 of row i */
INLINE void mu_bytes_t8(__m256i Q[4], const uint8_t *p, size_t ld)
{
    __m256i R[4]; /* R[k]: row k (low half), row k + 4 (high half) */
    for (int k = 0; k < 4; k++)
        R[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + k * ld))),
                                       _mm_loadu_si128((const __m128i *)(p + (k + 4) * ld)), 1);
    __m256i a0 = _mm256_unpacklo_epi32(R[0], R[1]), a1 = _mm256_unpackhi_epi32(R[0], R[1]);
    __m256i a2 = _mm256_unpacklo_epi32(R[2], R[3]), a3 = _mm256_unpackhi_epi32(R[2], R[3]);
    Q[0] = _mm256_unpacklo_epi64(a0, a2);
    Q[1] = _mm256_unpackhi_epi64(a0, a2);
    Q[2] = _mm256_unpacklo_epi64(a1, a3);
    Q[3] = _mm256_unpackhi_epi64(a1, a3);
}

/* NB (1, 2 or 4) consecutive blocks of 8 rows p + i * ld by the fold path:
 * C[b] = fma(E' + O', sc[n], C[b]) for block n = 0, 1, ...; sc[n] lane i =
 * 2^(e - 152) of row i's block n, every e inside its block's fold range. */
INLINE void mu_blk_fold(__m256 *C, const uint8_t *p, size_t ld, const __m256 *sc, const float *xc, int xs, int TT,
                        int NB)
{
    const __m256i tab = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8,
                                         12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    /* pos[m]: byte m of each dword to its top byte, the others zero (vpshufb
     * indexes within 128-bit halves: dword d of a half takes byte 4d + m) */
#define MU_POS(m)                                                                                            \
    _mm256_setr_epi32(0x00808080 | (m) << 24, 0x04808080 | (m) << 24, 0x08808080 | (m) << 24,               \
                      0x0c808080 | (m) << 24, 0x00808080 | (m) << 24, 0x04808080 | (m) << 24,               \
                      0x08808080 | (m) << 24, 0x0c808080 | (m) << 24)
    const __m256i pos0 = MU_POS(0), pos1 = MU_POS(1), pos2 = MU_POS(2), pos3 = MU_POS(3);
#undef MU_POS
    __m256i Q[4][4];
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
        mu_bytes_t8(Q[n], p + 16 * n, ld);
    __m256 E[4][MU_TT], O[4][MU_TT];
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
#pragma GCC unroll 4
        for (int b = 0; b < TT; b++)
            E[n][b] = O[n][b] = _mm256_setzero_ps();
    /* tokens inside the column loop: every chain keeps its order (pair 4q + m, q and m ascending) */
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) {
            __m256i L = _mm256_shuffle_epi8(tab, _mm256_and_si256(Q[n][q], m4));
            __m256i H = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi32(Q[n][q], 4), m4));
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
                __m256i ps = m == 0 ? pos0 : m == 1 ? pos1 : m == 2 ? pos2 : pos3;
                __m256 we = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(L, ps));
                __m256 wo = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(H, ps));
#pragma GCC unroll 4
                for (int b = 0; b < TT; b++) {
                    const float *xq = xc + (size_t)b * xs + 32 * n + 8 * q + 2 * m;
                    E[n][b] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(xq), E[n][b]);
                    O[n][b] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xq + 1), O[n][b]);
                }
            }
        }
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
#pragma GCC unroll 4
        for (int b = 0; b < TT; b++)
            C[b] = _mm256_fmadd_ps(_mm256_add_ps(E[n][b], O[n][b]), sc[n], C[b]);
}

#define MU_SB 16 /* column blocks whose scales are transposed at a time */
#ifndef MU_G
#define MU_G 4 /* blocks per fold step at T = 1 (8 chains; 2 ran as fast, 1 slower) */
#endif

/* Rows r..r+7 (all 8 present), MXFP4, tokens t..t+TT-1, columns [c0, c1)
 * (multiples of 32); chains as in mu_tile; flo[j], fhi[j]: block j's fold
 * range (mu_round_x). Blocks outside it take mu_tile's table decode. */
INLINE void mu_tile_mx(float *y, __m256 *st, const uint8_t *packed, const uint8_t *scale, const float *xb, int xs,
                       const uint8_t *flo, const uint8_t *fhi, int rows, int cols, int r, int t, int TT, int c0,
                       int c1)
{
    __m256 C[MU_TT];
    for (int b = 0; b < TT; b++)
        C[b] = c0 == 0 ? _mm256_setzero_ps() : st[b];
    size_t ld = (size_t)cols / 2, ls = (size_t)cols / 32;
    const uint8_t *p0 = packed + (size_t)r * ld, *s0 = scale + (size_t)r * ls;
    const int G = TT == 1 ? MU_G : 1;
    for (int cb = c0; cb < c1; cb += 32 * MU_SB) {
        int nb = (c1 - cb) / 32 < MU_SB ? (c1 - cb) / 32 : MU_SB;
        __m128i sv[16], sT[16];
        __attribute__((aligned(16))) uint8_t sb[MU_SB][16];
        for (int i = 0; i < 16; i++)
            if (i < 8 && nb == MU_SB)
                sv[i] = _mm_loadu_si128((const __m128i *)(s0 + i * ls + cb / 32));
            else { /* rows 8..15 absent; the chunk's last blocks: read no byte past them */
                __attribute__((aligned(16))) uint8_t tb[16] = {0};
                if (i < 8)
                    memcpy(tb, s0 + i * ls + cb / 32, (size_t)nb);
                sv[i] = _mm_load_si128((const __m128i *)tb);
            }
        shoal__mu_transpose_b16(sT, sv);
        unsigned fold = 0;
        for (int j = 0; j < nb; j++) {
            _mm_store_si128((__m128i *)sb[j], sT[j]);
            int jc = (cb - c0) / 32 + j, lo = flo[jc], hi = fhi[jc];
            __m128i v = sT[j], in = _mm_min_epu8(_mm_max_epu8(v, _mm_set1_epi8((char)lo)), _mm_set1_epi8((char)hi));
            /* rows 0..7: lo <= e <= hi */
            if (lo <= hi && (_mm_movemask_epi8(_mm_cmpeq_epi8(in, v)) & 0xff) == 0xff)
                fold |= 1u << j;
        }
        for (int j = 0; j < nb;) {
            int c = cb + 32 * j, g = j + G <= nb && (fold >> j & ((1u << G) - 1)) == (1u << G) - 1 ? G : 1;
            /* 8 row streams of 16 bytes per block: a line of each row every 4
             * blocks, prefetched in the next tile (rows are short) */
            for (int u = 0; u < g; u++)
                for (int i = 0; i < 2; i++)
                    _mm_prefetch((const char *)(p0 + (size_t)(8 + 2 * ((j + u) & 3) + i) * ld + c / 2 + 16 * u),
                                 _MM_HINT_T0);
            if (fold >> j & 1) {
                __m256 sc[4];
                for (int u = 0; u < g; u++)
                    sc[u] = _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_load_si128((const __m128i *)sb[j + u])),
                                         _mm256_set1_epi32(25)),
                        23));
                if (g == 4) {
                    SHOAL__MCA_BEGIN("fold4");
                    mu_blk_fold(C, p0 + c / 2, ld, sc, xb + (c - c0), xs, TT, 4);
                    SHOAL__MCA_END();
                }
                else if (g == 2)
                    mu_blk_fold(C, p0 + c / 2, ld, sc, xb + (c - c0), xs, TT, 2);
                else
                    mu_blk_fold(C, p0 + c / 2, ld, sc, xb + (c - c0), xs, TT, 1);
                j += g;
            } else {
                /* the table path for this block: mu_tile over its 32 columns, chains continued */
                __m256 st1[MU_TT];
                for (int b = 0; b < TT; b++)
                    st1[b] = C[b];
                mu_tile(NULL, st1, NULL, packed, scale, xb + (c - c0), xs, rows, cols, r, 8, t, TT, c, c + 32);
                for (int b = 0; b < TT; b++)
                    C[b] = st1[b];
                j++;
            }
        }
    }
    for (int b = 0; b < TT; b++) {
        if (c1 == cols) {
            __attribute__((aligned(32))) float v[8];
            _mm256_store_ps(v, C[b]);
            for (int i = 0; i < 8; i++)
                y[(size_t)(t + b) * rows + r + i] = v[i];
        } else
            st[b] = C[b];
    }
}

#define MU_TILE(TT)                                                                                          \
    __attribute__((noinline)) static void mu_tile_##TT(float *y, __m256 *st, const uint16_t *w,               \
                                                       const uint8_t *packed, const uint8_t *scale,           \
                                                       const float *xb, int xs, const uint8_t *flo,          \
                                                       const uint8_t *fhi, int rows, int cols, int r, int nr, \
                                                       int t, int c0, int c1)                                 \
    {                                                                                                        \
        if (packed && nr == 8)                                                                               \
            mu_tile_mx(y, st, packed, scale, xb, xs, flo, fhi, rows, cols, r, t, TT, c0, c1);                \
        else                                                                                                 \
            mu_tile(y, st, w, packed, scale, xb, xs, rows, cols, r, nr, t, TT, c0, c1);                      \
    }
MU_TILE(1)
MU_TILE(2)
MU_TILE(3)
MU_TILE(4)

__attribute__((noinline)) static void mu_rows(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale,
                                              const float *x, int rows, int cols, int T, int r0, int r1)
{
    __attribute__((aligned(32))) float xb[MU_XB];
    uint8_t flo[MU_XB / 32], fhi[MU_XB / 32];
    __m256 st[MU_RB / 8 * MU_TT];
    /* one token group and one column chunk (decode): rounded once per call */
    int once = T <= MU_TT && cols <= MU_XB / T / 32 * 32;
    if (once)
        mu_round_x(xb, cols, packed ? flo : NULL, fhi, x, cols, 0, T, 0, cols);
    for (int rb = r0; rb < r1; rb += MU_RB) {
        int re = rb + MU_RB < r1 ? rb + MU_RB : r1;
        for (int t = 0; t < T; t += MU_TT) {
            int TT = T - t < MU_TT ? T - t : MU_TT;
            int kc = MU_XB / TT / 32 * 32, xs = once ? cols : kc;
            for (int c0 = 0; c0 < cols; c0 += kc) {
                int c1 = c0 + kc < cols ? c0 + kc : cols;
                if (!once)
                    mu_round_x(xb, xs, packed ? flo : NULL, fhi, x, cols, t, TT, c0, c1);
                for (int r = rb; r < re; r += 8) {
                    int nr = re - r < 8 ? re - r : 8;
                    __m256 *s = st + (size_t)(r - rb) / 8 * MU_TT;
                    if (TT == 4)
                        mu_tile_4(y, s, w, packed, scale, xb, xs, flo, fhi, rows, cols, r, nr, t, c0, c1);
                    else if (TT == 3)
                        mu_tile_3(y, s, w, packed, scale, xb, xs, flo, fhi, rows, cols, r, nr, t, c0, c1);
                    else if (TT == 2)
                        mu_tile_2(y, s, w, packed, scale, xb, xs, flo, fhi, rows, cols, r, nr, t, c0, c1);
                    else
                        mu_tile_1(y, s, w, packed, scale, xb, xs, flo, fhi, rows, cols, r, nr, t, c0, c1);
                }
            }
        }
    }
}

static void gemm_bf16_mu(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    if (cols % 32) {
        shoal__kernels_gemm_bf16_mu_scalar(y, w, x, rows, cols, T, r0, r1);
        return;
    }
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
    mu_rows(y, w, NULL, NULL, x, rows, cols, T, r0, r1);
    _mm_setcsr(csr);
}

static void gemm_mxfp4_mu(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                          int T, int r0, int r1)
{
    if (cols % 32) {
        shoal__kernels_gemm_mxfp4_mu_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    mu_rows(y, NULL, packed, scale, x, rows, cols, T, r0, r1);
    _mm_setcsr(csr);
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
    shoal__kernels_mx_tables(); /* the MXFP4 decoders read them */
    t->gemm_bf16 = gemm_bf16;
    t->gemm_f32 = gemm_f32;
    t->gemm_mxfp4 = gemm_mxfp4;
    t->gemv_t_bf16 = gemv_t_bf16;
    t->gemv_t_f32 = gemv_t_f32;
    t->kda_head = kda_head;
    t->mla_heads = mla_heads;
    t->gemm_bf16_mu = gemm_bf16_mu;
    t->gemm_mxfp4_mu = gemm_mxfp4_mu;
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
