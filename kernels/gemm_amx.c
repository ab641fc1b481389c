/* kernels: Intel AMX (TILE + BF16). What AMX needs from the OS and the CPU,
 * the instruction-rate loop for `shoal bench peak`, and the matrix-unit-order
 * GEMM (kernels/README.md, "Matrix-unit order"), which is used only after the
 * start-up self-test in kernels.c has compared it with the scalar
 * specification on probe inputs. Compiled with -mamx-tile -mamx-bf16 (from the
 * file name); nothing here runs unless CPUID reports AMX-TILE and AMX-BF16,
 * XCR0 enables the tile state, and Linux grants the process the tile data
 * permission (arch_prctl ARCH_REQ_XCOMP_PERM). The development machine of
 * issue 33 (AMD EPYC, AVX-512 + AVX512-BF16) has no AMX: this code is
 * compiled and its self-test and tests skip there (test_kernels_amx_emul runs
 * this file's tile logic with the tiles emulated); the kernels and the
 * self-test ran on an Intel Xeon with AMX on 2026-12-04 (docs/PERFORMANCE.md). */
#include <string.h>

#include "kernels/kernels_int.h"

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/mu_avx512.h"

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
    /* GCC 12 does not count the whole struct as read by the ldtilecfg
     * builtin: with constant fields (the peak loop's) it dropped the colsb
     * and rows stores, and the unit got stack bytes for a configuration
     * (#GP, seen as SIGSEGV on a Xeon with AMX). The empty asm reads all of
     * cfg, so every store lands before the load. */
    __asm__ volatile("" : : "m"(cfg));
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
 * outputs, accumulated over the column blocks in order.
 *
 * Blocking (no bit depends on it): tokens in groups of AMX_TG, columns in
 * chunks of AMX_KC. Per group and chunk the activations are rounded once
 * (xa, for every row of the call); per 32 rows the chunk's weights are packed
 * once (bp: decoded and transposed with AVX-512, reused by every token tile of
 * the group); then 2 x 2 tiles (two token tiles x two row tiles: C tiles 0-3,
 * A tiles 4-5, B tiles 6-7) run over the chunk's column blocks. Between chunks
 * the C tiles live in y itself (an fp32 accumulator stored and reloaded is
 * exact), so every output's chain is the specification's. */
#define AMX_KC 512
#define AMX_TG 128

/* tokens t..t+nt-1, columns [c0, c1) rounded to bf16 into xa[b][c - c0]; rows nt..ntp-1 zero */
static void amx_round_x(uint16_t *xa, const float *x, int cols, int t, int nt, int ntp, int c0, int c1)
{
    for (int b = 0; b < ntp; b++)
        for (int c = c0; c < c1; c += 16) {
            __m512i r = _mm512_setzero_si512();
            if (b < nt) {
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

/* B for rows r..r+15 (past nr: the last row again), columns [c, c+32):
 * bt[p][i] = pair p of row i. Row i's 16 pairs are one zmm (bf16: a load;
 * MXFP4: the 32 nibbles widened to word indexes, looked up in the block's 16
 * exact bf16 values with vpermw); a 16 x 16 dword transpose writes bt. */
static void amx_pack_b(uint32_t *bt, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, int cols,
                       int r, int nr, int c)
{
    __m512i v[16], t[16];
    for (int i = 0; i < 16; i++) {
        size_t row = (size_t)r + (i < nr ? i : nr - 1);
        if (w)
            v[i] = _mm512_loadu_si512(w + row * cols + c);
        else {
            v[i] = shoal__mu_mx_dec(packed + row * (cols / 2) + c / 2, scale[row * (cols / 32) + c / 32]);
        }
    }
    shoal__mu_transpose16(t, v);
    for (int p = 0; p < 16; p++)
        _mm512_store_si512(bt + p * 16, t[p]);
}

/* C tile k (0-3) of tokens t..t+16 and rows r..r+16 from / to y: directly
 * when the tile is whole, else through cbuf (nt tokens, nr rows valid). */
#define AMX_C_LOAD(k, p, s) _tile_loadd(k, p, s)
#define AMX_C_STORE(k, p, s) _tile_stored(k, p, s)
#define AMX_C_ZERO(k) _tile_zero(k)
#define AMX_C_SWITCH(op, k, ...)                                                                                \
    do {                                                                                                        \
        if ((k) == 0)                                                                                           \
            op(0, ##__VA_ARGS__);                                                                               \
        else if ((k) == 1)                                                                                      \
            op(1, ##__VA_ARGS__);                                                                               \
        else if ((k) == 2)                                                                                      \
            op(2, ##__VA_ARGS__);                                                                               \
        else                                                                                                    \
            op(3, ##__VA_ARGS__);                                                                               \
    } while (0)

static void amx_c_in(int k, float *y, float *cbuf, int rows, int t, int nt, int r, int nr, int first)
{
    if (first)
        AMX_C_SWITCH(AMX_C_ZERO, k);
    else if (nt == 16 && nr == 16)
        AMX_C_SWITCH(AMX_C_LOAD, k, y + (size_t)t * rows + r, (long)rows * 4);
    else {
        for (int b = 0; b < nt; b++)
            memcpy(cbuf + b * 16, y + (size_t)(t + b) * rows + r, (size_t)nr * 4);
        AMX_C_SWITCH(AMX_C_LOAD, k, cbuf, 64);
    }
}

static void amx_c_out(int k, float *y, float *cbuf, int rows, int t, int nt, int r, int nr)
{
    if (nt == 16 && nr == 16)
        AMX_C_SWITCH(AMX_C_STORE, k, y + (size_t)t * rows + r, (long)rows * 4);
    else {
        AMX_C_SWITCH(AMX_C_STORE, k, cbuf, 64);
        for (int b = 0; b < nt; b++)
            memcpy(y + (size_t)(t + b) * rows + r, cbuf + b * 16, (size_t)nr * 4);
    }
}

static void amx_rows(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, const float *x,
                     int rows, int cols, int T, int r0, int r1)
{
    __attribute__((aligned(64))) static __thread uint16_t xa[AMX_TG * AMX_KC];
    __attribute__((aligned(64))) static __thread uint32_t bp[AMX_KC / 32][2][256];
    __attribute__((aligned(64))) float cbuf[16 * 16];
    tiles_config(16);
    for (int t0 = 0; t0 < T; t0 += AMX_TG) {
        int nt = T - t0 < AMX_TG ? T - t0 : AMX_TG, ntt = (nt + 15) / 16;
        for (int c0 = 0; c0 < cols; c0 += AMX_KC) {
            int c1 = c0 + AMX_KC < cols ? c0 + AMX_KC : cols, ncb = (c1 - c0) / 32;
            amx_round_x(xa, x, cols, t0, nt, ntt * 16, c0, c1);
            for (int rb = r0; rb < r1; rb += 32) {
                int nr0 = r1 - rb < 16 ? r1 - rb : 16, nr1 = r1 - rb - 16 < 16 ? r1 - rb - 16 : 16;
                int two = nr1 > 0;
                for (int cb = 0; cb < ncb; cb++) {
                    amx_pack_b(bp[cb][0], w, packed, scale, cols, rb, nr0, c0 + 32 * cb);
                    if (two)
                        amx_pack_b(bp[cb][1], w, packed, scale, cols, rb + 16, nr1, c0 + 32 * cb);
                }
                for (int j = 0; j < ntt; j += 2) {
                    int ta = t0 + 16 * j, na = nt - 16 * j < 16 ? nt - 16 * j : 16;
                    int pair = j + 1 < ntt, tb = ta + 16, nb = pair ? (nt - 16 * (j + 1) < 16 ? nt - 16 * (j + 1) : 16) : 0;
                    amx_c_in(0, y, cbuf, rows, ta, na, rb, nr0, c0 == 0);
                    if (two)
                        amx_c_in(1, y, cbuf, rows, ta, na, rb + 16, nr1, c0 == 0);
                    if (pair) {
                        amx_c_in(2, y, cbuf, rows, tb, nb, rb, nr0, c0 == 0);
                        if (two)
                            amx_c_in(3, y, cbuf, rows, tb, nb, rb + 16, nr1, c0 == 0);
                    }
                    const uint16_t *xj = xa + (size_t)16 * j * AMX_KC;
                    if (pair && two)
                        for (int cb = 0; cb < ncb; cb++) {
                            _tile_loadd(4, xj + 32 * cb, AMX_KC * 2);
                            _tile_loadd(5, xj + 16 * AMX_KC + 32 * cb, AMX_KC * 2);
                            _tile_loadd(6, bp[cb][0], 64);
                            _tile_loadd(7, bp[cb][1], 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    else
                        for (int cb = 0; cb < ncb; cb++) {
                            _tile_loadd(4, xj + 32 * cb, AMX_KC * 2);
                            _tile_loadd(6, bp[cb][0], 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (two) {
                                _tile_loadd(7, bp[cb][1], 64);
                                _tile_dpbf16ps(1, 4, 7);
                            }
                            if (pair) {
                                _tile_loadd(5, xj + 16 * AMX_KC + 32 * cb, AMX_KC * 2);
                                _tile_dpbf16ps(2, 5, 6);
                            }
                        }
                    amx_c_out(0, y, cbuf, rows, ta, na, rb, nr0);
                    if (two)
                        amx_c_out(1, y, cbuf, rows, ta, na, rb + 16, nr1);
                    if (pair) {
                        amx_c_out(2, y, cbuf, rows, tb, nb, rb, nr0);
                        if (two)
                            amx_c_out(3, y, cbuf, rows, tb, nb, rb + 16, nr1);
                    }
                }
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
