/* kernels: AVX-512 (F/BW/VL/DQ) workers. Same contract as gemm_avx2.c: each
 * reproduces the scalar specification bit for bit (kernels/README.md).
 *   bf16 / f32: the 16 canonical lanes are one zmm; reduce16 = (lo256 + hi256)
 *     then the AVX2 tail tree.
 *   MXFP4: the 16 canonical lanes are one zmm; a group decodes with two
 *     vpermps from a per-scale table of exact weights, its bytes placed by
 *     vpmovzxbd (canonical lane order) or by a broadcast load and qword
 *     shifts (a transposed lane order; fewer shuffles, for Intel).
 *   gemv_t, KDA head: vectorised across independent columns (16 per zmm).
 * The dev machine has no AVX-512: these workers are compiled and dispatched
 * only where CPUID reports AVX-512, and tests/unit/test_kernels.c reports
 * them SKIPPED elsewhere. */
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&             \
    defined(__AVX512DQ__)

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "kernels/kernels_int.h"
#include "kernels/mu_avx512.h"
#include "kernels/mu_sse.h"


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

/* Cache blocks of the T > 1 loop. Every tile still runs over the full width
 * with its own accumulators, so no output's chain changes: the blocks only
 * reorder whole tiles. A block of tb tokens (a multiple of 4) keeps its fp32
 * activation panel (tb x cols x 4 bytes) within half the L2 while every
 * 4-row strip of a row block passes over it; a row block of rb rows keeps
 * its weights within a quarter of the L2 while every token block passes.
 * So x is read from L3 once per row block instead of once per strip (at
 * T = 256 and 7168 columns the panel is 7.3 MB: 1 byte of L3 traffic per
 * multiply-add without the blocks), and weights from DRAM once per call. */
static void gemm_blocks(int *tb, int *rb, int T, int cols, int wbytes)
{
    long l2 = shoal_kernels_l2_bytes();
    long t = l2 / 2 / ((long)cols * 4);
    t &= ~3L;
    *tb = t < 4 ? 4 : t >= T ? T : (int)t;
    long r = l2 / 4 / ((long)cols * wbytes);
    r &= ~3L;
    *rb = r < 4 ? 4 : r > (1 << 20) ? (1 << 20) : (int)r;
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
        int tb, rb;                                                                                         \
        gemm_blocks(&tb, &rb, T, cols, (int)sizeof(WT));                                                    \
        int r4 = r0 + (r1 - r0) / 4 * 4;                                                                    \
        for (int rbk = r0; rbk < r4; rbk += rb) {                                                           \
            int rbe = rbk + rb < r4 ? rbk + rb : r4;                                                        \
            for (int t0 = 0; t0 < T; t0 += tb) {                                                            \
                int te = t0 + tb < T ? t0 + tb : T;                                                         \
                for (r = rbk; r < rbe; r += 4) {                                                            \
                    int t = t0;                                                                             \
                    for (; t + 4 <= te; t += 4)                                                             \
                        K##_4x4(y, w, x, rows, cols, r, t);                                                 \
                    for (; t < te; t++)                                                                     \
                        K##_4x1(y, w, x, rows, cols, r, t);                                                 \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        r = r4;                                                                                             \
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

/* ---- MXFP4 --------------------------------------------------------------------
 * The canonical order (kernels/README.md, "MXFP4"): 16 lanes, lane j of a
 * group takes packed byte j, first its low nibble (column 2j) then its high
 * nibble (column 2j+1); result 4 * reduce16. One zmm holds the 16 lanes. Two
 * decodes, bit-identical, chosen by kernels.c (shoal_kernels_set_mx_decode):
 * "vpmovzx" (zx = 1): d = vpmovzxbd(16 packed bytes), lane j = byte j, then
 * wl = vpermps(d, W[e]), wh = vpermps(d >> 4, W[e]): three shuffles per 32
 * weights. "shift" (zx = 0) holds the lanes in a
 * transposed order: physical lane p = 4L + m (L = p >> 2, the 128-bit block;
 * m = p & 3) is canonical lane MX_LANE(p) = 4m + L, and the lanes are put
 * back in canonical order (one vpermps by the same index: the transpose is its
 * own inverse) only before the final reduce16. The decode of a group:
 *   b  = vbroadcasti32x4(16 packed bytes)   a load, no shuffle: qword 2L+q of
 *        block L holds bytes 8q..8q+7
 *   r  = vpsrlvq(b, 8L)                     low dword of qword 2L+q starts
 *        with byte 8q+L, high dword with byte 8q+L+4: lane p starts with
 *        byte MX_LANE(p)
 *   wl = vpermps(r, W[e]), wh = vpermps(r >> 4, W[e])
 * where W[e] (shoal__kernels_mx_w, one 64-byte row per E8M0 code, a memory
 * operand) holds the exact weights E2M1/4 * 2^(e-127) of the 16 codes:
 * vpermps reads only the low four bits of each index, so these are the low
 * and high nibbles' weights with the scale folded in (exact, no rounding).
 * That is two shuffles (the vpermps) and two shifts per 32 weights; the
 * vpmovzx decode needs three shuffles, and on Intel every
 * 512-bit shuffle runs on port 5, which also hosts one of the two FMA units
 * (docs/PERFORMANCE.md, "MXFP4 T = 1: two shuffles per group on Intel"; on
 * AMD Zen 4 it ran 1.12x slower in cache than vpmovzx). Each token
 * costs two FMAs per group. x is deinterleaved once per column block into the
 * decode's lane order, [x[2 MX_LANE(p)] | x[2 MX_LANE(p) + 1]] per group for
 * shift, [x even | x odd] for vpmovzx (xb, on the stack), so the FMAs take x
 * as stored there. Tiles of R rows x TT tokens
 * decode each row's group once and use it for TT tokens; accumulators are
 * saved between column blocks (same values, same order). */
#define MX_XB 8192 /* floats of deinterleaved x on the stack (32 KiB) */
#define MX_RB 16   /* rows per block when accumulators are saved between column blocks */
#define MX_TMAX 4 /* 4x4 tiles: 2x8 tiles ran 20% slower in cache (docs/PERFORMANCE.md) */
#define MX_LANE(p) (4 * ((p) & 3) + ((p) >> 2))

INLINE void mx_dec(__m512 *wl, __m512 *wh, const uint8_t *p, unsigned e, int zx)
{
    const float *tab = shoal__kernels_mx_w[e];
    if (zx) { /* the vpmovzxbd decode: lane j = byte j, canonical order */
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        *wl = _mm512_permutexvar_ps(d, _mm512_load_ps(tab));
        *wh = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), _mm512_load_ps(tab));
        return;
    }
    const __m512i sh = _mm512_setr_epi64(0, 0, 8, 8, 16, 16, 24, 24);
    __m512i r = _mm512_srlv_epi64(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)), sh);
    *wl = _mm512_permutexvar_ps(r, _mm512_load_ps(tab));
    *wh = _mm512_permutexvar_ps(_mm512_srli_epi64(r, 4), _mm512_load_ps(tab));
}

/* physical lanes -> canonical order (MX_LANE is an involution) */
INLINE __m512 mx_canon(__m512 acc, int zx)
{
    const __m512i ix = _mm512_setr_epi32(MX_LANE(0), MX_LANE(1), MX_LANE(2), MX_LANE(3), MX_LANE(4), MX_LANE(5),
                                         MX_LANE(6), MX_LANE(7), MX_LANE(8), MX_LANE(9), MX_LANE(10), MX_LANE(11),
                                         MX_LANE(12), MX_LANE(13), MX_LANE(14), MX_LANE(15));
    return zx ? acc : _mm512_permutexvar_ps(ix, acc);
}

/* x[t..t+TT) columns of groups [g0, g1) -> xb[b*xs + 32*(g-g0) + {0..15: even, 16..31: odd}],
 * lane p of each half holding column 2 MX_LANE(p) (+1) of the group (2p (+1) for zx) */
static void mx_deint(float *xb, int xs, const float *x, int cols, int t, int TT, int g0, int g1, int zx)
{
#define MX_E(p) (2 * MX_LANE(p))
    const __m512i ie = zx ? _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
                          : _mm512_setr_epi32(MX_E(0), MX_E(1), MX_E(2), MX_E(3), MX_E(4), MX_E(5), MX_E(6), MX_E(7),
                                              MX_E(8), MX_E(9), MX_E(10), MX_E(11), MX_E(12), MX_E(13), MX_E(14),
                                              MX_E(15));
#undef MX_E
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
    for (int b = 0; b < TT; b++) {
        const float *xt = x + (size_t)(t + b) * cols;
        float *o = xb + (size_t)b * xs;
        for (int g = g0; g < g1; g++) {
            __m512 a = _mm512_loadu_ps(xt + 32 * g), c = _mm512_loadu_ps(xt + 32 * g + 16);
            _mm512_store_ps(o + 32 * (g - g0), _mm512_permutex2var_ps(a, ie, c));
            _mm512_store_ps(o + 32 * (g - g0) + 16, _mm512_permutex2var_ps(a, io, c));
        }
    }
}

/* one group g of rows p[0..R), tokens 0..TT-1 of xg (stride xs): decode each row once, 2 FMAs per token */
INLINE void mx_step(__m512 acc[4][MX_TMAX], const uint8_t *const *p, const uint8_t *const *s, const float *xg,
                    int xs, int R, int TT, int g, int zx)
{
    __m512 wl[4], wh[4];
    for (int a = 0; a < R; a++)
        mx_dec(&wl[a], &wh[a], p[a] + 16 * g, s[a][g], zx);
    for (int b = 0; b < TT; b++) {
        __m512 xe = _mm512_load_ps(xg + (size_t)b * xs);
        for (int a = 0; a < R; a++)
            acc[a][b] = _mm512_fmadd_ps(wl[a], xe, acc[a][b]);
    }
    for (int b = 0; b < TT; b++) {
        __m512 xo = _mm512_load_ps(xg + (size_t)b * xs + 16);
        for (int a = 0; a < R; a++)
            acc[a][b] = _mm512_fmadd_ps(wh[a], xo, acc[a][b]);
    }
}

/* rows r..r+R-1, tokens t..t+TT-1, groups [g0, g1); st: saved lanes, row-major [row - rb][MX_TMAX] */
INLINE void mx_tile(float *y, __m512 *st, const uint8_t *packed, const uint8_t *scale, const float *xb, int xs,
                    int rows, int cols, int r, int R, int t, int TT, int g0, int g1, int init, int fin, int zx)
{
    __m512 acc[4][MX_TMAX];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++)
            acc[a][b] = init ? _mm512_setzero_ps() : st[a * MX_TMAX + b];
    int ng = cols / 32;
    const uint8_t *p[4], *s[4];
    for (int a = 0; a < R; a++) {
        p[a] = packed + (size_t)(r + a) * (cols / 2);
        s[a] = scale + (size_t)(r + a) * ng;
    }
    size_t pf = (size_t)R * (cols / 2); /* one tile ahead (2 and 4 measured no better, docs/PERFORMANCE.md) */
    /* Four groups per step (64 bytes of each row: one line), so the prefetches
     * of the step are issued without a branch per row and group: branches and
     * pointer arithmetic take integer ports that on Intel also issue the
     * vector uops (llvm-mca, docs/PERFORMANCE.md). */
    int g = g0;
    for (; g + 4 <= g1; g += 4) {
        if ((g & 15) < 4)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)s[a] + (size_t)R * ng + g, _MM_HINT_T0);
        for (int a = 0; a < R; a++) /* the same line of the next tile's row (rows are short, see MX_PF) */
            _mm_prefetch((const char *)p[a] + pf + 16 * g, _MM_HINT_T0);
        SHOAL__MCA_BEGIN("mx4");
        for (int u = 0; u < 4; u++)
            mx_step(acc, p, s, xb + 32 * (g + u - g0), xs, R, TT, g + u, zx);
        SHOAL__MCA_END();
    }
    for (; g < g1; g++) {
        if ((g & 15) == 0)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)s[a] + (size_t)R * ng + g, _MM_HINT_T0);
        if ((g & 3) == 0)
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)p[a] + pf + 16 * g, _MM_HINT_T0);
        mx_step(acc, p, s, xb + 32 * (g - g0), xs, R, TT, g, zx);
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < TT; b++) {
            if (fin)
                y[(size_t)(t + b) * rows + r + a] = 4.0f * hsum16(mx_canon(acc[a][b], zx));
            else
                st[a * MX_TMAX + b] = acc[a][b];
        }
}

typedef void (*mx_tile_fn)(float *y, __m512 *st, const uint8_t *packed, const uint8_t *scale, const float *xb,
                           int xs, int rows, int cols, int r, int t, int g0, int g1);
#define MX_TILE(R, TT, Z, N)                                                                                   \
    __attribute__((noinline)) static void mx_tile_##N##R##x##TT(float *y, __m512 *st, const uint8_t *packed,      \
                                                               const uint8_t *scale, const float *xb, int xs,    \
                                                               int rows, int cols, int r, int t, int g0, int g1) \
    {                                                                                                          \
        mx_tile(y, st, packed, scale, xb, xs, rows, cols, r, R, t, TT, g0, g1, g0 == 0, g1 == cols / 32, Z);   \
    }
#define MX_TILES(Z, N) MX_TILE(4, 1, Z, N) MX_TILE(1, 1, Z, N) MX_TILE(4, 2, Z, N) MX_TILE(1, 2, Z, N) \
    MX_TILE(4, 4, Z, N) MX_TILE(1, 4, Z, N)
MX_TILES(0, )
MX_TILES(1, zx_)

INLINE void mx_gemm(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols, int T,
                    int r0, int r1, int zx)
{
    if (cols % 32) {
        shoal__kernels_gemm_mxfp4_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    __attribute__((aligned(64))) float xb[MX_XB];
    __m512 st[MX_RB * MX_TMAX];
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
            int TT = T - t >= 4 ? 4 : T - t >= 2 ? 2 : 1, R = 4;
            mx_tile_fn big = zx ? (TT == 4 ? mx_tile_zx_4x4 : TT == 2 ? mx_tile_zx_4x2 : mx_tile_zx_4x1)
                                : (TT == 4 ? mx_tile_4x4 : TT == 2 ? mx_tile_4x2 : mx_tile_4x1);
            mx_tile_fn one = zx ? (TT == 4 ? mx_tile_zx_1x4 : TT == 2 ? mx_tile_zx_1x2 : mx_tile_zx_1x1)
                                : (TT == 4 ? mx_tile_1x4 : TT == 2 ? mx_tile_1x2 : mx_tile_1x1);
            int kb = MX_XB / TT / 32; /* groups per column block */
            int xs = kb * 32;
            for (int g0 = 0; g0 < ng; g0 += kb) {
                int g1 = g0 + kb < ng ? g0 + kb : ng;
                mx_deint(xb, xs, x, cols, t, TT, g0, g1, zx);
                int r = rb;
                for (; r + R <= re; r += R)
                    big(y, st + (size_t)(r - rb) * MX_TMAX, packed, scale, xb, xs, rows, cols, r, t, g0, g1);
                for (; r < re; r++)
                    one(y, st + (size_t)(r - rb) * MX_TMAX, packed, scale, xb, xs, rows, cols, r, t, g0, g1);
            }
            t += TT;
        }
    }
}

/* the two decodes (bit-identical; kernels.c chooses, SHOAL_MX_DECODE) */
static void gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                       int T, int r0, int r1)
{
    mx_gemm(y, packed, scale, x, rows, cols, T, r0, r1, 0);
}

static void gemm_mxfp4_zx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                          int T, int r0, int r1)
{
    mx_gemm(y, packed, scale, x, rows, cols, T, r0, r1, 1);
}

/* ---- matrix-unit order (gemm_mu.c is the specification) ----------------------
 * Lanes are 16 rows. Per 32-column block each row's 64 bytes of bf16 weights
 * (bf16 as stored, or an MXFP4 group decoded exactly to bf16 with one vpermw
 * from the scale's table shoal__kernels_mu_bf[e]) are one zmm of 16 dwords,
 * dword p = the weights of columns 2p (low word) and 2p+1 (high word); a
 * 16 x 16 dword transpose makes D[p] = pair p of the 16 rows. Then per token:
 * E = fma(D[p] << 16, a[2p], E), O = fma(D[p] & 0xffff0000, a[2p+1], O) for
 * p = 0..15 from +0, C += E + O: the specification's chains, one row per lane.
 * MXCSR FTZ|DAZ is set around the arithmetic (restored after): x86 flushes
 * results that are tiny after rounding and reads subnormal inputs as zero,
 * which is the specification's ftz and daz. The activations are rounded to
 * bf16 (RNE, quiet NaN kept) into a stack buffer once per row block and
 * column chunk. */
#define MU_XB 8192 /* floats of rounded activations on the stack */
#define MU_TT 4    /* tokens per pass */
#define MU_RB 64   /* rows per row block (4 tiles of 16): saved chains 16 zmm */

/* x[t..t+TT) columns [c0, c1) rounded to bf16 -> xb[b * xs + c - c0]; and,
 * per 32-column block j of the chunk, the scale codes [lo[j], hi[j]] for
 * which the fold path computes that block exactly for all TT tokens (see
 * "The fold path" below; lo[j] > hi[j]: none; lo NULL: not wanted). */
static void mu_round_x(float *xb, int xs, uint8_t *lo, uint8_t *hi, const float *x, int cols, int t, int TT, int c0,
                       int c1)
{
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u), quiet = _mm512_set1_epi32(0x00400000);
    const __m512i ff = _mm512_set1_epi32(0xff), zero = _mm512_setzero_si512();
    for (int c = c0; c < c1; c += 32) {
        __m512i fmin = ff, fmax = zero; /* exponent fields: least of the nonzero ones, greatest */
        for (int b = 0; b < TT; b++)
            for (int h = 0; h < 32; h += 16) {
                __m512 v = _mm512_loadu_ps(x + (size_t)(t + b) * cols + c + h);
                __m512i u = _mm512_castps_si512(v);
                __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                __m512i rn = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
                rn = _mm512_and_si512(_mm512_mask_or_epi32(rn, nan, u, quiet), himask);
                _mm512_store_ps(xb + (size_t)b * xs + (c - c0) + h, _mm512_castsi512_ps(rn));
                if (lo) {
                    __m512i f = _mm512_and_si512(_mm512_srli_epi32(rn, 23), ff); /* 0: zero or subnormal (DAZ: zero) */
                    fmin = _mm512_mask_min_epu32(fmin, _mm512_test_epi32_mask(f, f), fmin, f);
                    fmax = _mm512_max_epu32(fmax, f);
                }
            }
        if (!lo) /* bf16 weights: no fold path */
            continue;
        __attribute__((aligned(64))) uint32_t mn[16], mx[16];
        _mm512_store_si512((void *)mn, fmin);
        _mm512_store_si512((void *)mx, fmax);
        shoal__mu_fold_range(&lo[(c - c0) / 32], &hi[(c - c0) / 32], mn, mx, 16, 2, 244);
    }
}

/* ---- MXFP4: the fold path (the fast path) -----------------------------------------
 * Instead of decoding each row's group and transposing 16 x 16 dwords, the
 * packed bytes are transposed first (16 rows x 16 bytes = 4 zmm, 8 vpermt2d):
 * Q[q] lane i = bytes 4q..4q+3 of row i's group, so nibble n of a lane's
 * dword (bits 4n..4n+3) is the code of column 8q + n of row i.
 *
 * The scale is folded out of the chains. The chains run on the bare E2M1
 * values v (0, 0.5, ..., 6) instead of the weights v * 2^s (s = e - 127, one
 * per row and block), and the block's sum joins C by C = fma(E' + O', 2^s, C)
 * instead of C + (E + O). That is exact, bit for bit, when no operation of
 * either version is tiny or overflows: rounding commutes with a power-of-two
 * scale in the normal range, so E = E' * 2^s and O = O' * 2^s exactly, E + O
 * = (E' + O') * 2^s, and the fma rounds the same sum C + (E + O) once, as the
 * add does (then FTZ alike). The conditions, per block and for all its
 * tokens, with fmin / fmax the least nonzero / greatest exponent field of the
 * rounded activations a (a zero field is a zero or a subnormal that DAZ reads
 * as zero): every product v * a = n * m * 2^(ea - 8) (v = n / 2, a = m *
 * 2^(ea - 7)) is a multiple of g = 2^(fmin - 135), and so is every rounded
 * partial sum, so a nonzero one is >= g in magnitude: no flush in either
 * version when g * 2^min(s, 0) >= 2^-126, i.e. fmin >= 9 and e >= 136 -
 * fmin; a chain of 16 products of |v| <= 6 stays below 2^(fmax - 119), E + O
 * below 2^(fmax - 118): no overflow when fmax <= 245 and e <= 372 - fmax; and
 * v * 2^s is itself the specification's weight (normal, finite, no DAZ) for
 * 2 <= e <= 252. mu_round_x gives each block the codes allowed, one inside
 * these bounds on each side. A block whose 16 rows are not all inside (scale
 * codes 0, 1 and 253..255, activations below 2^-117 or from 2^118, infinities,
 * NaN) takes the table path (kernels/mu_avx512.h), which computes the
 * specification's chains directly; mixing the two per block is exact.
 *
 * The decode of a bare E2M1 code needs no scale: vpermps reads bits 3:0 of
 * each dword index, so vpermps of X = Q[q] >> 4j from the 16 E2M1 values as
 * fp32 gives column 8q + j; vpermw reads bits 4:0 of each word index, so the
 * same X's high words index nibble 4 + j (with the 16 values as bf16, twice,
 * in its 32-word table), and zero-masking the low words makes each dword
 * that value as fp32: column 8q + 4 + j. Per 16 rows x 32 columns: 12
 * shifts and 32 lookups for 32 weight vectors, no multiply. Two blocks go
 * through at once (four chains of 16 dependent FMAs in flight instead of
 * two: an FMA's latency is four of its issue slots). */


#define MU_SB 16  /* column blocks whose scales are transposed at a time */

/* One 32-column block of rows p + i * ld (i < 16), the table path for scale
 * codes s[i]: v[b] = E + O of token b's chains (the caller adds it to C). */
__attribute__((noinline)) static void mu_blk_tab(__m512 *v, const uint8_t *p, size_t ld, const uint8_t *s,
                                                 const float *xc, int xs, int TT)
{
    __m512i rv[16], d[16];
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < 16; i++)
        rv[i] = shoal__mu_mx_dec(p + i * ld, s[i]);
    shoal__mu_transpose16(d, rv);
    for (int b = 0; b < TT; b++) {
        const float *xq = xc + (size_t)b * xs;
        __m512 E = _mm512_setzero_ps(), O = _mm512_setzero_ps();
        for (int k = 0; k < 16; k++) {
            E = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d[k], 16)), _mm512_set1_ps(xq[2 * k]), E);
            O = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(d[k], hi)), _mm512_set1_ps(xq[2 * k + 1]), O);
        }
        v[b] = _mm512_add_ps(E, O);
    }
}

/* Q[4] of one block (rows p + i * ld, i < 16): Q[q] lane i = bytes 4q..4q+3 of row i */
INLINE void mu_bytes_t(__m512i Q[4], const uint8_t *p, size_t ld)
{
    /* R[k] dword 4j + q = row 4k + j dword q; S: rows 0..7 (8..15) of dwords {0,1} / {2,3} */
    const __m512i i1a = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i1b = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i i2a = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i i2b = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    __m512i R[4], S[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const uint8_t *pk = p + (size_t)4 * k * ld;
        R[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)pk));
        R[k] = _mm512_inserti32x4(R[k], _mm_loadu_si128((const __m128i *)(pk + ld)), 1);
        R[k] = _mm512_inserti32x4(R[k], _mm_loadu_si128((const __m128i *)(pk + 2 * ld)), 2);
        R[k] = _mm512_inserti32x4(R[k], _mm_loadu_si128((const __m128i *)(pk + 3 * ld)), 3);
    }
    S[0] = _mm512_permutex2var_epi32(R[0], i1a, R[1]);
    S[1] = _mm512_permutex2var_epi32(R[0], i1b, R[1]);
    S[2] = _mm512_permutex2var_epi32(R[2], i1a, R[3]);
    S[3] = _mm512_permutex2var_epi32(R[2], i1b, R[3]);
    Q[0] = _mm512_permutex2var_epi32(S[0], i2a, S[2]);
    Q[1] = _mm512_permutex2var_epi32(S[0], i2b, S[2]);
    Q[2] = _mm512_permutex2var_epi32(S[1], i2a, S[3]);
    Q[3] = _mm512_permutex2var_epi32(S[1], i2b, S[3]);
}

/* NB (1 or 4) consecutive blocks of rows p + i * ld (i < 16) by the fold
 * path: C[b] = fma(E' + O', sc[n], C[b]) for block n = 0, 1, ... sc[n] lane
 * i = 2^(e - 127) of row i's block n, every e inside its block's fold range;
 * t32: the E2M1 values as fp32; t16: as bf16 words, twice. The blocks' chains
 * are interleaved four FMAs at a time (2 NB TT chains in flight). */
INLINE void mu_blk_fold(__m512 *C, const uint8_t *p, size_t ld, const __m512 *sc, __m512 t32, __m512i t16,
                        const float *xc, int xs, int TT, int NB)
{
    __m512i Q[4][4];
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
        mu_bytes_t(Q[n], p + 16 * n, ld);
    __m512 E[4][MU_TT], O[4][MU_TT];
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
#pragma GCC unroll 4
        for (int b = 0; b < TT; b++)
            E[n][b] = O[n][b] = _mm512_setzero_ps();
    /* tokens inside the column loop: every chain keeps its order (pair 4q + h, q and h ascending) */
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int n = 0; n < NB; n++) {
            /* w[m]: column 8q + m of block n (m = j: vpermps of X_j; m = 4 + j: vpermw of X_j) */
            __m512 w[8];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m512i X = j ? _mm512_srli_epi32(Q[n][q], 4 * j) : Q[n][q];
                w[j] = _mm512_permutexvar_ps(X, t32);
                w[4 + j] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, X, t16));
            }
            /* pair 4q + h: columns 8q + 2h (E) and 8q + 2h + 1 (O) */
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++)
#pragma GCC unroll 4
                for (int b = 0; b < TT; b++) {
                    const float *xq = xc + (size_t)b * xs + 32 * n + 8 * q + 2 * h;
                    E[n][b] = _mm512_fmadd_ps(w[2 * h], _mm512_set1_ps(xq[0]), E[n][b]);
                    O[n][b] = _mm512_fmadd_ps(w[2 * h + 1], _mm512_set1_ps(xq[1]), O[n][b]);
                }
        }
#pragma GCC unroll 4
    for (int n = 0; n < NB; n++)
#pragma GCC unroll 4
        for (int b = 0; b < TT; b++)
            C[b] = _mm512_fmadd_ps(_mm512_add_ps(E[n][b], O[n][b]), sc[n], C[b]);
}

/* Rows r..r+15 (all 16 present), MXFP4, tokens t..t+TT-1, columns [c0, c1)
 * (multiples of 32); chains as in mu_tile; flo[j], fhi[j]: block j's fold
 * range (mu_round_x). */
INLINE void mu_tile_mx(float *y, __m512 *st, const uint8_t *packed, const uint8_t *scale, const float *xb, int xs,
                       const uint8_t *flo, const uint8_t *fhi, int rows, int cols, int r, int t, int TT, int c0,
                       int c1)
{
    __m512 C[MU_TT];
    for (int b = 0; b < TT; b++)
        C[b] = c0 == 0 ? _mm512_setzero_ps() : st[b];
    size_t ld = (size_t)cols / 2, ls = (size_t)cols / 32;
    const uint8_t *p0 = packed + (size_t)r * ld, *s0 = scale + (size_t)r * ls;
    const __m512 t32 = _mm512_mul_ps(_mm512_loadu_ps(shoal__kernels_e2m1q), _mm512_set1_ps(4.0f)); /* exact */
    /* word j = word 2 (j mod 16) + 1 of t32's dwords: the 16 E2M1 values as bf16 (exact), twice */
    const __m512i dup = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000b0009, 0x000f000d, 0x00130011, 0x00170015,
                                          0x001b0019, 0x001f001d, 0x00030001, 0x00070005, 0x000b0009, 0x000f000d,
                                          0x00130011, 0x00170015, 0x001b0019, 0x001f001d);
    const __m512i t16 = _mm512_permutexvar_epi16(dup, _mm512_castps_si512(t32));
    for (int cb = c0; cb < c1; cb += 32 * MU_SB) {
        int nb = (c1 - cb) / 32 < MU_SB ? (c1 - cb) / 32 : MU_SB;
        __m128i sv[16], sT[16];
        __attribute__((aligned(16))) uint8_t sb[MU_SB][16];
        for (int i = 0; i < 16; i++)
            if (nb == MU_SB)
                sv[i] = _mm_loadu_si128((const __m128i *)(s0 + i * ls + cb / 32));
            else { /* the chunk's last blocks: read no byte past them */
                __attribute__((aligned(16))) uint8_t tb[16] = {0};
                memcpy(tb, s0 + i * ls + cb / 32, (size_t)nb);
                sv[i] = _mm_load_si128((const __m128i *)tb);
            }
        shoal__mu_transpose_b16(sT, sv);
        unsigned fold = 0;
        for (int j = 0; j < nb; j++) {
            _mm_store_si128((__m128i *)sb[j], sT[j]);
            int jc = (cb - c0) / 32 + j, lo = flo[jc], hi = fhi[jc];
            /* no lane's e - lo >= hi - lo + 1 (unsigned bytes): lo <= e <= hi */
            if (lo <= hi)
                fold |= (unsigned)(_mm_cmpge_epu8_mask(_mm_sub_epi8(sT[j], _mm_set1_epi8((char)lo)),
                                                       _mm_set1_epi8((char)(hi - lo + 1))) == 0)
                        << j;
        }
        /* G blocks at a time by the fold path where all G fold: 8 chains at T = 1
         * (2, 3, 4 tokens: one block, 4-8 chains, ran faster than two or four:
         * docs/PERFORMANCE.md) */
        const int G = TT == 1 ? 4 : 1;
        for (int j = 0; j < nb;) {
            int c = cb + 32 * j, g = j + G <= nb && (fold >> j & ((1u << G) - 1)) == (1u << G) - 1 ? G : 1;
            /* 16 row streams of 16 bytes per block: a line of each row every 4
             * blocks, prefetched in the next tile (rows are short; as in mx_tile) */
            for (int u = 0; u < g; u++)
                for (int i = 0; i < 4; i++)
                    _mm_prefetch((const char *)(p0 + (size_t)(16 + 4 * ((j + u) & 3) + i) * ld + c / 2 + 16 * u),
                                 _MM_HINT_T0);
            if (fold >> j & 1) {
                __m512 sc[4];
                for (int u = 0; u < g; u++)
                    sc[u] = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)sb[j + u])), 23));
                if (g == 4) {
                    SHOAL__MCA_BEGIN("fold4");
                    mu_blk_fold(C, p0 + c / 2, ld, sc, t32, t16, xb + (c - c0), xs, TT, 4);
                    SHOAL__MCA_END();
                } else
                    mu_blk_fold(C, p0 + c / 2, ld, sc, t32, t16, xb + (c - c0), xs, TT, 1);
                j += g;
            } else {
                __m512 v[MU_TT];
                mu_blk_tab(v, p0 + c / 2, ld, sb[j], xb + (c - c0), xs, TT);
                for (int b = 0; b < TT; b++)
                    C[b] = _mm512_add_ps(C[b], v[b]);
                j++;
            }
        }
    }
    for (int b = 0; b < TT; b++) {
        if (c1 == cols) {
            __attribute__((aligned(64))) float v[16];
            _mm512_store_ps(v, C[b]);
            for (int i = 0; i < 16; i++)
                y[(size_t)(t + b) * rows + r + i] = v[i];
        } else
            st[b] = C[b];
    }
}

/* Rows r..r+15 (row r + i for lane i, rows >= r + nr repeat the last one and
 * are not stored), tokens t..t+TT-1, columns [c0, c1) (multiples of 32);
 * chains from +0 (c0 == 0) or st[0..TT), to y (c1 == cols) or st. */
INLINE void mu_tile(float *y, __m512 *st, const uint16_t *w, const uint8_t *packed, const uint8_t *scale,
                    const float *xb, int xs, int rows, int cols, int r, int nr, int t, int TT, int c0, int c1)
{
    __m512 C[MU_TT];
    for (int b = 0; b < TT; b++)
        C[b] = c0 == 0 ? _mm512_setzero_ps() : st[b];
    const uint16_t *wr[16];
    const uint8_t *pr[16], *sr[16];
    for (int i = 0; i < 16; i++) {
        size_t row = (size_t)r + (i < nr ? i : nr - 1);
        wr[i] = w ? w + row * cols : NULL;
        pr[i] = packed ? packed + row * (cols / 2) : NULL;
        sr[i] = packed ? scale + row * (cols / 32) : NULL;
    }
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int c = c0; c < c1; c += 32) {
        __m512i rv[16], d[16];
        for (int i = 0; i < 16; i++) {
            if (w) {
                _mm_prefetch((const char *)(wr[i] + c) + 512, _MM_HINT_T0);
                rv[i] = _mm512_loadu_si512((const void *)(wr[i] + c));
            } else
                rv[i] = shoal__mu_mx_dec(pr[i] + c / 2, sr[i][c / 32]);
        }
        shoal__mu_transpose16(d, rv);
        const float *xc = xb + (c - c0);
        for (int b = 0; b < TT; b++) {
            const float *xq = xc + (size_t)b * xs;
            __m512 E = _mm512_setzero_ps(), O = _mm512_setzero_ps();
            for (int p = 0; p < 16; p++) {
                E = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(d[p], 16)), _mm512_set1_ps(xq[2 * p]), E);
                O = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(d[p], hi)), _mm512_set1_ps(xq[2 * p + 1]), O);
            }
            C[b] = _mm512_add_ps(C[b], _mm512_add_ps(E, O));
        }
    }
    for (int b = 0; b < TT; b++) {
        if (c1 == cols) {
            __attribute__((aligned(64))) float v[16];
            _mm512_store_ps(v, C[b]);
            for (int i = 0; i < nr; i++)
                y[(size_t)(t + b) * rows + r + i] = v[i];
        } else
            st[b] = C[b];
    }
}

#define MU_TILE(TT)                                                                                          \
    __attribute__((noinline)) static void mu_tile_##TT(float *y, __m512 *st, const uint16_t *w,               \
                                                       const uint8_t *packed, const uint8_t *scale,           \
                                                       const float *xb, int xs, const uint8_t *flo,          \
                                                       const uint8_t *fhi, int rows, int cols, int r, int nr, \
                                                       int t, int c0, int c1)                                 \
    {                                                                                                        \
        if (packed && nr == 16)                                                                              \
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
    __attribute__((aligned(64))) float xb[MU_XB];
    uint8_t flo[MU_XB / 32], fhi[MU_XB / 32];
    __m512 st[MU_RB / 16 * MU_TT];
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
                for (int r = rb; r < re; r += 16) {
                    int nr = re - r < 16 ? re - r : 16;
                    __m512 *s = st + (size_t)(r - rb) / 16 * MU_TT;
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
    shoal__kernels_mx_tables(); /* the MXFP4 decoders read them */
    t->gemm_bf16 = gemm_bf16;
    t->gemm_f32 = gemm_f32;
    t->gemm_mxfp4 = gemm_mxfp4;
    t->gemm_mxfp4_zx = gemm_mxfp4_zx;
    t->gemv_t_bf16 = gemv_t_bf16;
    t->gemv_t_f32 = gemv_t_f32;
    t->kda_head = kda_head;
    t->gemm_bf16_mu = gemm_bf16_mu;
    t->gemm_mxfp4_mu = gemm_mxfp4_mu;
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
