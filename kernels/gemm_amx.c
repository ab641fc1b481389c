/* kernels: Intel AMX (TILE + BF16). What AMX needs from the OS and the CPU,
 * the instruction-rate loop for `shoal bench peak`, and the matrix-unit-order
 * GEMM (kernels/README.md, "Matrix-unit order"), which is used only after the
 * start-up self-test in kernels.c has compared it with the scalar
 * specification on probe inputs. Compiled with -mamx-tile -mamx-bf16 (from the
 * file name); nothing here runs unless CPUID reports AMX-TILE and AMX-BF16,
 * XCR0 enables the tile state, and Linux grants the process the tile data
 * permission (arch_prctl ARCH_REQ_XCOMP_PERM). The development machine of
 * issue 33 (AMD EPYC, AVX-512 + AVX512-BF16) has no AMX: this code is
 * compiled and its self-test and tests skip there; it has run on no machine
 * yet. */
#include <string.h>

#include "kernels/kernels_int.h"

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int shoal__kernels_amx_usable(void)
{
    static int state; /* 0 unknown, 1 usable, -1 not */
    if (state)
        return state > 0;
    unsigned a, b, c, d;
    state = -1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) /* AMX-TILE, AMX-BF16 */
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) /* XTILECFG, XTILEDATA enabled by the OS */
        return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        return 0;
    state = 1;
    return 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* Tiles 0-3: C (crows x 16 fp32), 4: A (crows rows of 32 bf16), 5: B (16 rows of
 * 16 bf16 pairs); the peak loop also uses 6 and 7 as a second A and B. */
static void tiles_config(int crows)
{
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = (uint8_t)(i <= 4 || i == 6 ? crows : 16);
    }
    _tile_loadconfig(&cfg);
}

double shoal__kernels_peak_amx_bf16(long n)
{
    if (!shoal__kernels_amx_usable())
        return 0;
    __attribute__((aligned(64))) static uint16_t zero[16 * 32];
    tiles_config(16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zero, 64);
    _tile_loadd(5, zero, 64);
    _tile_loadd(6, zero, 64);
    _tile_loadd(7, zero, 64);
    for (long i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 6, 5);
        _tile_dpbf16ps(3, 6, 7);
    }
    _tile_release();
    return (double)n * 4 * 16 * 16 * 32;
}

/* ---- the matrix-unit-order GEMM on AMX ---------------------------------------
 * One TDPBF16PS per 16 tokens x 16 rows x 32 columns computes exactly the
 * specification's step for every output (per 32 columns: even and odd chains
 * from +0, then C + (E + O); DAZ, FTZ): A is 16 tokens of 32 activations
 * rounded to bf16, B the 16 rows' weights as 16 pairs per row, transposed so
 * that B row p holds pair p of every row (the VNNI layout), C the 16 x 16
 * outputs, accumulated over the column blocks in order. Rows go 64 at a time
 * (four C tiles), tokens 16 at a time, columns in chunks of AMX_KC whose
 * rounded activations sit on the stack. */
#define AMX_KC 2048

static void amx_round_x(uint16_t *xa, const float *x, int cols, int t, int TT, int c0, int c1)
{
    for (int b = 0; b < 16; b++)
        for (int c = c0; c < c1; c += 16) {
            __m512i r = _mm512_setzero_si512();
            if (b < TT) {
                __m512 v = _mm512_loadu_ps(x + (size_t)(t + b) * cols + c);
                __m512i u = _mm512_castps_si512(v);
                __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
                r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
                r = _mm512_srli_epi32(r, 16);
            }
            _mm256_storeu_si256((__m256i *)(xa + (size_t)b * AMX_KC + (c - c0)), _mm512_cvtepi32_epi16(r));
        }
}

/* B for rows r..r+15 (past nr: the last row again), columns [c, c+32): bt[p][i] = pair p of row i */
static void amx_pack_b(uint32_t *bt, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, int cols,
                       int r, int nr, int c)
{
    __attribute__((aligned(64))) uint32_t rv[16][16];
    for (int i = 0; i < 16; i++) {
        size_t row = (size_t)r + (i < nr ? i : nr - 1);
        if (w)
            memcpy(rv[i], w + row * cols + c, 64);
        else {
            const uint8_t *p = packed + row * (cols / 2) + c / 2;
            const uint16_t *tab = shoal__kernels_mu_bf[scale[row * (cols / 32) + c / 32]];
            for (int j = 0; j < 16; j++)
                rv[i][j] = (uint32_t)tab[p[j] & 15] | (uint32_t)tab[p[j] >> 4] << 16;
        }
    }
    for (int p = 0; p < 16; p++)
        for (int i = 0; i < 16; i++)
            bt[p * 16 + i] = rv[i][p];
}

#define AMX_DP(i)                                                                                           \
    do {                                                                                                    \
        if ((i) == 0)                                                                                       \
            _tile_dpbf16ps(0, 4, 5);                                                                        \
        else if ((i) == 1)                                                                                  \
            _tile_dpbf16ps(1, 4, 5);                                                                        \
        else if ((i) == 2)                                                                                  \
            _tile_dpbf16ps(2, 4, 5);                                                                        \
        else                                                                                                \
            _tile_dpbf16ps(3, 4, 5);                                                                        \
    } while (0)

static void amx_rows(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, const float *x,
                     int rows, int cols, int T, int r0, int r1)
{
    __attribute__((aligned(64))) static __thread uint16_t xa[16 * AMX_KC];
    __attribute__((aligned(64))) uint32_t bt[16 * 16];
    __attribute__((aligned(64))) float cbuf[16 * 16];
    for (int rb = r0; rb < r1; rb += 64) {
        int re = rb + 64 < r1 ? rb + 64 : r1, ntile = (re - rb + 15) / 16;
        for (int t = 0; t < T; t += 16) {
            int TT = T - t < 16 ? T - t : 16;
            tiles_config(TT);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int c0 = 0; c0 < cols; c0 += AMX_KC) {
                int c1 = c0 + AMX_KC < cols ? c0 + AMX_KC : cols;
                amx_round_x(xa, x, cols, t, TT, c0, c1);
                for (int c = c0; c < c1; c += 32) {
                    _tile_loadd(4, xa + (c - c0), AMX_KC * 2);
                    for (int i = 0; i < ntile; i++) {
                        int r = rb + 16 * i, nr = re - r < 16 ? re - r : 16;
                        amx_pack_b(bt, w, packed, scale, cols, r, nr, c);
                        _tile_loadd(5, bt, 64);
                        AMX_DP(i);
                    }
                }
            }
            for (int i = 0; i < ntile; i++) {
                int r = rb + 16 * i, nr = re - r < 16 ? re - r : 16;
                if (i == 0)
                    _tile_stored(0, cbuf, 64);
                else if (i == 1)
                    _tile_stored(1, cbuf, 64);
                else if (i == 2)
                    _tile_stored(2, cbuf, 64);
                else
                    _tile_stored(3, cbuf, 64);
                for (int b = 0; b < TT; b++)
                    for (int j = 0; j < nr; j++)
                        y[(size_t)(t + b) * rows + r + j] = cbuf[b * 16 + j];
            }
        }
    }
    _tile_release();
}

void shoal__kernels_gemm_bf16_mu_amx(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0,
                                     int r1)
{
    if (cols % 32)
        shoal__kernels_gemm_bf16_mu_scalar(y, w, x, rows, cols, T, r0, r1);
    else
        amx_rows(y, w, NULL, NULL, x, rows, cols, T, r0, r1);
}

void shoal__kernels_gemm_mxfp4_mu_amx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows,
                                      int cols, int T, int r0, int r1)
{
    if (cols % 32)
        shoal__kernels_gemm_mxfp4_mu_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
    else
        amx_rows(y, NULL, packed, scale, x, rows, cols, T, r0, r1);
}
#else
int shoal__kernels_amx_usable(void)
{
    return 0;
}
void shoal__kernels_gemm_bf16_mu_amx(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0,
                                     int r1)
{
    shoal__kernels_gemm_bf16_mu_scalar(y, w, x, rows, cols, T, r0, r1);
}
void shoal__kernels_gemm_mxfp4_mu_amx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows,
                                      int cols, int T, int r0, int r1)
{
    shoal__kernels_gemm_mxfp4_mu_scalar(y, packed, scale, x, rows, cols, T, r0, r1);
}
double shoal__kernels_peak_amx_bf16(long n)
{
    (void)n;
    return 0;
}
#endif
