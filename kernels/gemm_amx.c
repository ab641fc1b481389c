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
 * Blocking (no bit depends on it): tokens in groups of tg, columns in chunks
 * of kc. Per group and chunk the activations are rounded once (xa, for every
 * row of the call); per 32 rows the chunk's weights are packed once (bp:
 * decoded and transposed with AVX-512, reused by every token tile of the
 * group); then 2 x 2 tiles (two token tiles x two row tiles: C tiles 0-3, A
 * tiles 4-5, B tiles 6-7) run over the chunk's column blocks. Between chunks
 * the C tiles live in y itself (an fp32 accumulator stored and reloaded is
 * exact), so every output's chain is the specification's.
 *
 * Variants (SHOAL_AMX_VARIANT, read once in kernels.c; kernels/README.md),
 * each a change of blocking or arrangement only, so each computes the same
 * bits (test_kernels_amx_emul runs every combination; test_kernels runs the
 * selected one on real tiles): K256 chunks of 256 columns (the A and B panels
 * of a 2 x 2 step then fit in L1: 2 x 16 KiB); ONCE groups of up to 256 (512
 * with K256) tokens, so at T <= that each weight panel is packed once per call
 * instead of once per 128 tokens; PIPE packs the next 32-row panel in slices
 * between the current panel's tile steps (double-buffered bp: the AVX-512
 * shuffles overlap the unit's work); PF prefetches the raw weights of the
 * panel packed next into L2 in slices between tile steps; SWAP runs calls of
 * T <= 32 with the roles exchanged (amx_rows_swap below). */
#define AMX_KC_MAX 512
#define AMX_TG 128
#define AMX_XA_WORDS (256 * AMX_KC_MAX) /* rounded activations, per thread: 256 KiB */
#define AMX_SWAP_T 32
#define AMX_SWAP_KC 4096

static int amx_variant; /* SHOAL__AMX_* flags; set between calls only */

void shoal__kernels_amx_set_variant(int v)
{
    amx_variant = v & SHOAL__AMX_ALL;
}

__attribute__((aligned(64))) static __thread uint16_t xa[AMX_XA_WORDS];
__attribute__((aligned(64))) static __thread uint32_t bp[2][AMX_KC_MAX / 32][2][256];

/* 16 floats rounded to bf16 (nearest even; a NaN stays a quiet NaN), as 16 words */
static inline __m256i amx_bf16x16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* tokens t..t+nt-1, columns [c0, c1) rounded to bf16 into xa[b * kc + c - c0]; rows nt..ntp-1 zero */
static void amx_round_x(uint16_t *xa_, const float *x, int cols, int kc, int t, int nt, int ntp, int c0, int c1)
{
    for (int b = 0; b < ntp; b++)
        for (int c = c0; c < c1; c += 16) {
            __m256i r = _mm256_setzero_si256();
            if (b < nt)
                r = amx_bf16x16(_mm512_loadu_ps(x + (size_t)(t + b) * cols + c));
            _mm256_storeu_si256((__m256i *)(xa_ + (size_t)b * kc + (c - c0)), r);
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

/* Work spread over a panel's tile steps (PIPE: packing the next panel's
 * blocks; PF: prefetching a later panel's lines): after step s of n, items
 * [0, total * s / n) are done. */
typedef struct {
    const uint16_t *w;
    const uint8_t *packed, *scale;
    int cols, r1, c0, c1, ncb;
    int steps, on;
    /* PIPE: the next panel (first row nrow; nn0, nn1 rows in its two halves) into nbt */
    uint32_t (*nbt)[2][256];
    int nrow, nn0, nn1, ndone, nneed, nacc;
    /* PF: rows [prow, prow + npr) of the chunk, pl lines per row */
    int prow, npr, pl, pdone, pneed, pacc;
} amx_side;

static void amx_side_panel(amx_side *s, int pipe, int pf, int rb, uint32_t (*nbt)[2][256], int steps)
{
    s->steps = steps > 0 ? steps : 1;
    s->nneed = s->ndone = s->nacc = 0;
    if (pipe && rb + 32 < s->r1) {
        s->nbt = nbt;
        s->nrow = rb + 32;
        s->nn0 = s->r1 - s->nrow < 16 ? s->r1 - s->nrow : 16;
        s->nn1 = s->r1 - s->nrow - 16 < 16 ? s->r1 - s->nrow - 16 : 16;
        s->nneed = s->ncb * (s->nn1 > 0 ? 2 : 1);
    }
    s->pneed = s->pdone = s->pacc = 0;
    if (pf) {
        s->prow = rb + (pipe ? 64 : 32);
        s->npr = s->r1 - s->prow < 32 ? s->r1 - s->prow : 32;
        int bytes = s->w ? (s->c1 - s->c0) * 2 : (s->c1 - s->c0) / 2;
        s->pl = bytes / 64 + 1 + (s->w ? 0 : 1); /* MXFP4: and the row's scale bytes */
        s->pneed = s->npr > 0 ? s->npr * s->pl : 0;
    }
    s->on = s->nneed + s->pneed > 0;
}

static void amx_side_pack(amx_side *s, int b)
{
    int half = s->nn1 > 0 ? b & 1 : 0, cb = s->nn1 > 0 ? b >> 1 : b;
    amx_pack_b(s->nbt[cb][half], s->w, s->packed, s->scale, s->cols, s->nrow + 16 * half, half ? s->nn1 : s->nn0,
               s->c0 + 32 * cb);
}

static void amx_side_prefetch(amx_side *s, int i)
{
    int row = s->prow + i / s->pl, l = i % s->pl;
    const char *p;
    if (s->w)
        p = (const char *)(s->w + (size_t)row * s->cols + s->c0) + 64 * l;
    else if (l < s->pl - 1)
        p = (const char *)(s->packed + (size_t)row * (s->cols / 2) + s->c0 / 2) + 64 * l;
    else
        p = (const char *)(s->scale + (size_t)row * (s->cols / 32) + s->c0 / 32);
    _mm_prefetch(p, _MM_HINT_T1);
}

/* after one tile step: this step's share of the side work (need / steps items
 * per step, carried without a division: acc counts need per step and pays
 * one item per steps) */
static inline void amx_side_step(amx_side *s)
{
    if (!s->on)
        return;
    for (s->nacc += s->nneed; s->nacc >= s->steps && s->ndone < s->nneed; s->nacc -= s->steps)
        amx_side_pack(s, s->ndone++);
    for (s->pacc += s->pneed; s->pacc >= s->steps && s->pdone < s->pneed; s->pacc -= s->steps)
        amx_side_prefetch(s, s->pdone++);
}

/* the rest of the next panel (a panel of fewer steps than expected) */
static void amx_side_finish(amx_side *s)
{
    for (; s->ndone < s->nneed; s->ndone++)
        amx_side_pack(s, s->ndone);
}

static void amx_rows_swap(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, const float *x,
                          int rows, int cols, int T, int r0, int r1);

static void amx_rows(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, const float *x,
                     int rows, int cols, int T, int r0, int r1)
{
    int v = amx_variant;
    if ((v & SHOAL__AMX_SWAP) && T <= AMX_SWAP_T) {
        amx_rows_swap(y, w, packed, scale, x, rows, cols, T, r0, r1);
        return;
    }
    int kc = v & SHOAL__AMX_K256 ? 256 : AMX_KC_MAX;
    int tg = v & SHOAL__AMX_ONCE ? AMX_XA_WORDS / kc : AMX_TG;
    int pipe = (v & SHOAL__AMX_PIPE) != 0, pf = (v & SHOAL__AMX_PF) != 0;
    __attribute__((aligned(64))) float cbuf[16 * 16];
    amx_side side = {.w = w, .packed = packed, .scale = scale, .cols = cols, .r1 = r1};
    tiles_config(16);
    for (int t0 = 0; t0 < T; t0 += tg) {
        int nt = T - t0 < tg ? T - t0 : tg, ntt = (nt + 15) / 16, npairs = (ntt + 1) / 2;
        for (int c0 = 0; c0 < cols; c0 += kc) {
            int c1 = c0 + kc < cols ? c0 + kc : cols, ncb = (c1 - c0) / 32, cur = 0;
            side.c0 = c0, side.c1 = c1, side.ncb = ncb;
            amx_round_x(xa, x, cols, kc, t0, nt, ntt * 16, c0, c1);
            if (pipe) { /* the first panel; later ones are packed during their predecessor */
                amx_side_panel(&side, 1, 0, r0 - 32, bp[0], 1);
                amx_side_finish(&side);
            }
            for (int rb = r0; rb < r1; rb += 32) {
                int nr0 = r1 - rb < 16 ? r1 - rb : 16, nr1 = r1 - rb - 16 < 16 ? r1 - rb - 16 : 16;
                int two = nr1 > 0;
                uint32_t(*bc)[2][256] = bp[cur];
                if (!pipe)
                    for (int cb = 0; cb < ncb; cb++) {
                        amx_pack_b(bc[cb][0], w, packed, scale, cols, rb, nr0, c0 + 32 * cb);
                        if (two)
                            amx_pack_b(bc[cb][1], w, packed, scale, cols, rb + 16, nr1, c0 + 32 * cb);
                    }
                amx_side_panel(&side, pipe, pf, rb, bp[cur ^ 1], npairs * ncb);
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
                    const uint16_t *xj = xa + (size_t)16 * j * kc;
                    if (pair && two)
                        for (int cb = 0; cb < ncb; cb++) {
                            _tile_loadd(4, xj + 32 * cb, kc * 2);
                            _tile_loadd(5, xj + 16 * kc + 32 * cb, kc * 2);
                            _tile_loadd(6, bc[cb][0], 64);
                            _tile_loadd(7, bc[cb][1], 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                            amx_side_step(&side);
                        }
                    else
                        for (int cb = 0; cb < ncb; cb++) {
                            _tile_loadd(4, xj + 32 * cb, kc * 2);
                            _tile_loadd(6, bc[cb][0], 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (two) {
                                _tile_loadd(7, bc[cb][1], 64);
                                _tile_dpbf16ps(1, 4, 7);
                            }
                            if (pair) {
                                _tile_loadd(5, xj + 16 * kc + 32 * cb, kc * 2);
                                _tile_dpbf16ps(2, 5, 6);
                            }
                            amx_side_step(&side);
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
                if (pipe) {
                    amx_side_finish(&side);
                    cur ^= 1;
                }
            }
        }
    }
    _tile_release();
}

/* ---- SWAP: calls of T <= 32 tokens with the weights as the A tiles --------------
 * A = 16 weight rows x 32 columns as stored (bf16: loaded straight from W,
 * no packing; MXFP4: decoded to bf16 in column order), B = the activations in
 * the VNNI layout (row p: pair p of 16 tokens, rounded and transposed once
 * per call and chunk of AMX_SWAP_KC columns: xs), C = 16 rows x 16 tokens,
 * kept in the tiles across the chunk's columns and transposed to y's
 * token-major layout through cbuf. Per output (row r, token t) TDPBF16PS
 * forms the same even chain over w[2p] * a[2p] and odd chain over w[2p+1] *
 * a[2p+1] as with the roles the other way round (a product does not depend on
 * which operand is A; DAZ applies to both), so the bits are the
 * specification's; test_kernels (real tiles) and test_kernels_amx_emul check
 * it. Tiles: one token tile (T <= 16): C 0-3 = four row tiles, A 4/5
 * alternating, B 6; two token tiles: C 0-3 = two row tiles x two token
 * tiles, A 4/5, B 6/7. */

/* C tile k (rows r.. x tokens t..) from / to y (y[t][r], token-major) */
static void amx_ct_in(int k, float *y, float *cbuf, int rows, int t, int nt, int r, int nr, int first)
{
    if (first) {
        AMX_C_SWITCH(AMX_C_ZERO, k);
        return;
    }
    __m512i v[16], d[16];
    __mmask16 m = (__mmask16)((1u << nr) - 1);
    for (int n = 0; n < 16; n++)
        v[n] = n < nt ? _mm512_maskz_loadu_epi32(m, y + (size_t)(t + n) * rows + r) : _mm512_setzero_si512();
    shoal__mu_transpose16(d, v);
    for (int i = 0; i < 16; i++)
        _mm512_store_si512(cbuf + 16 * i, d[i]);
    AMX_C_SWITCH(AMX_C_LOAD, k, cbuf, 64);
}

static void amx_ct_out(int k, float *y, float *cbuf, int rows, int t, int nt, int r, int nr)
{
    __m512i v[16], d[16];
    __mmask16 m = (__mmask16)((1u << nr) - 1);
    AMX_C_SWITCH(AMX_C_STORE, k, cbuf, 64);
    for (int i = 0; i < 16; i++)
        v[i] = _mm512_load_si512(cbuf + 16 * i);
    shoal__mu_transpose16(d, v);
    for (int n = 0; n < nt; n++)
        _mm512_mask_storeu_epi32(y + (size_t)(t + n) * rows + r, m, d[n]);
}

/* xs[(q * ncb + cb) * 256 + p * 16 + n] = pair p of token 16q + n, block cb of [c0, c1); tokens past T zero */
static void amx_pack_x_swap(uint32_t *xs, const float *x, int cols, int T, int ntt, int c0, int c1)
{
    int ncb = (c1 - c0) / 32;
    for (int q = 0; q < ntt; q++)
        for (int cb = 0; cb < ncb; cb++) {
            __m512i v[16], d[16];
            for (int n = 0; n < 16; n++) {
                int t = 16 * q + n;
                if (t < T) {
                    const float *xp = x + (size_t)t * cols + c0 + 32 * cb;
                    v[n] = _mm512_inserti64x4(_mm512_castsi256_si512(amx_bf16x16(_mm512_loadu_ps(xp))),
                                              amx_bf16x16(_mm512_loadu_ps(xp + 16)), 1);
                } else
                    v[n] = _mm512_setzero_si512();
            }
            shoal__mu_transpose16(d, v);
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(xs + ((size_t)q * ncb + cb) * 256 + p * 16, d[p]);
        }
}

/* The A operand: rows r..r+15 (past nr: the last row again), columns [c, c+32) in column order. */
static inline const uint16_t *amx_a_src(uint16_t *abuf, long *stride, const uint16_t *w, const uint8_t *packed,
                                        const uint8_t *scale, int cols, int r, int nr, int c, int pf)
{
    if (w && nr == 16) {
        if (pf)
            for (int m = 0; m < 16; m++)
                _mm_prefetch((const char *)(w + (size_t)(r + m) * cols + c + 128), _MM_HINT_T0);
        *stride = (long)cols * 2;
        return w + (size_t)r * cols + c;
    }
    for (int m = 0; m < 16; m++) {
        size_t row = (size_t)r + (m < nr ? m : nr - 1);
        __m512i a = w ? _mm512_loadu_si512(w + row * cols + c)
                      : shoal__mu_mx_dec(packed + row * (cols / 2) + c / 2, scale[row * (cols / 32) + c / 32]);
        if (pf && !w && (c & 127) == 0)
            _mm_prefetch((const char *)(packed + row * (cols / 2) + c / 2 + 256), _MM_HINT_T0);
        _mm512_store_si512(abuf + 32 * m, a);
    }
    *stride = 64;
    return abuf;
}

#define AMX_A_LOAD(tile, i)                                                                                     \
    do {                                                                                                        \
        long s_;                                                                                                \
        const uint16_t *p_ = amx_a_src(abuf[(tile)-4], &s_, w, packed, scale, cols, rb + 16 * (i), nr[i],     \
                                       c0 + 32 * cb, pf);                                                       \
        _tile_loadd(tile, p_, s_);                                                                              \
    } while (0)

static void amx_rows_swap(float *y, const uint16_t *w, const uint8_t *packed, const uint8_t *scale, const float *x,
                          int rows, int cols, int T, int r0, int r1)
{
    __attribute__((aligned(64))) uint16_t abuf[2][16 * 32];
    __attribute__((aligned(64))) float cbuf[16 * 16];
    uint32_t *xs = (uint32_t *)xa; /* 2 x AMX_SWAP_KC / 32 x 1 KiB = 256 KiB: fits xa */
    int ntt = (T + 15) / 16, R = ntt == 1 ? 4 : 2, pf = (amx_variant & SHOAL__AMX_PF) != 0;
    tiles_config(16);
    for (int c0 = 0; c0 < cols; c0 += AMX_SWAP_KC) {
        int c1 = c0 + AMX_SWAP_KC < cols ? c0 + AMX_SWAP_KC : cols, ncb = (c1 - c0) / 32;
        amx_pack_x_swap(xs, x, cols, T, ntt, c0, c1);
        const uint32_t *xs0 = xs, *xs1 = xs + (size_t)ncb * 256;
        for (int rb = r0; rb < r1; rb += 16 * R) {
            int nr[4], nrt = 0;
            for (int i = 0; i < R && rb + 16 * i < r1; i++, nrt++)
                nr[i] = r1 - rb - 16 * i < 16 ? r1 - rb - 16 * i : 16;
            int nt1 = T - 16 < 16 ? T - 16 : 16; /* tokens of the second token tile (ntt 2) */
            if (ntt == 1) {
                for (int i = 0; i < nrt; i++)
                    amx_ct_in(i, y, cbuf, rows, 0, T, rb + 16 * i, nr[i], c0 == 0);
                for (int cb = 0; cb < ncb; cb++) {
                    _tile_loadd(6, xs0 + (size_t)cb * 256, 64);
                    AMX_A_LOAD(4, 0);
                    _tile_dpbf16ps(0, 4, 6);
                    if (nrt > 1) {
                        AMX_A_LOAD(5, 1);
                        _tile_dpbf16ps(1, 5, 6);
                    }
                    if (nrt > 2) {
                        AMX_A_LOAD(4, 2);
                        _tile_dpbf16ps(2, 4, 6);
                    }
                    if (nrt > 3) {
                        AMX_A_LOAD(5, 3);
                        _tile_dpbf16ps(3, 5, 6);
                    }
                }
                for (int i = 0; i < nrt; i++)
                    amx_ct_out(i, y, cbuf, rows, 0, T, rb + 16 * i, nr[i]);
            } else {
                for (int i = 0; i < nrt; i++) {
                    amx_ct_in(2 * i, y, cbuf, rows, 0, 16, rb + 16 * i, nr[i], c0 == 0);
                    amx_ct_in(2 * i + 1, y, cbuf, rows, 16, nt1, rb + 16 * i, nr[i], c0 == 0);
                }
                for (int cb = 0; cb < ncb; cb++) {
                    _tile_loadd(6, xs0 + (size_t)cb * 256, 64);
                    _tile_loadd(7, xs1 + (size_t)cb * 256, 64);
                    AMX_A_LOAD(4, 0);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (nrt > 1) {
                        AMX_A_LOAD(5, 1);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int i = 0; i < nrt; i++) {
                    amx_ct_out(2 * i, y, cbuf, rows, 0, 16, rb + 16 * i, nr[i]);
                    amx_ct_out(2 * i + 1, y, cbuf, rows, 16, nt1, rb + 16 * i, nr[i]);
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
void shoal__kernels_amx_set_variant(int v)
{
    (void)v;
}
#endif
