/* The AMX tile intrinsics that kernels/gemm_amx.c uses, in software, for
 * test_kernels_amx_emul.sh on a CPU without AMX. TDPBF16PS follows the model
 * measured in shared/amx-probe (per output and instruction: an even-k and an
 * odd-k FMA chain from +0 over the 32 k, then C + (E + O); DAZ on inputs, FTZ
 * after each rounding), computed here with x86 MXCSR FTZ|DAZ, which the probe
 * found to be AMX's flush rule: a check of gemm_amx.c's tile layout (A rows,
 * the transposed B pairs, the C tiles and their stores), not of a real unit. */
#ifndef KERNELS_AMX_EMUL_SHIM_H
#define KERNELS_AMX_EMUL_SHIM_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#undef _tile_loadconfig
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_release

static _Thread_local struct { /* per thread, as the tile registers are */
    uint8_t data[8][16][64];
    int rows[8], colsb[8], configured;
} emul_tiles;

static void emul_loadconfig(const void *cfg)
{
    const uint8_t *c = cfg;
    for (int i = 0; i < 8; i++) {
        emul_tiles.colsb[i] = c[16 + 2 * i] | c[17 + 2 * i] << 8;
        emul_tiles.rows[i] = c[48 + i];
    }
    emul_tiles.configured = 1;
}

static void emul_zero(int t)
{
    memset(emul_tiles.data[t], 0, sizeof emul_tiles.data[t]);
}

static void emul_loadd(int t, const void *base, long stride)
{
    for (int r = 0; r < emul_tiles.rows[t]; r++)
        memcpy(emul_tiles.data[t][r], (const uint8_t *)base + r * stride, (size_t)emul_tiles.colsb[t]);
}

static void emul_stored(int t, void *base, long stride)
{
    for (int r = 0; r < emul_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emul_tiles.data[t][r], (size_t)emul_tiles.colsb[t]);
}

/* Per output row m, the 16 columns n at once (lane n): E[n] = fma(A[m][2p],
 * B[p][2n], E[n]) and O likewise with the odd elements, p = 0..K/2-1, from
 * +0; then C + (E + O). Each lane is the scalar model's chain, rounded per
 * step under MXCSR FTZ|DAZ (DAZ reads subnormal inputs as zero, FTZ flushes
 * tiny results), as the probe measured for TDPBF16PS. */
static void emul_dp(int c, int a, int b)
{
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    int M = emul_tiles.rows[c], K2 = emul_tiles.colsb[a] / 4;
    for (int m = 0; m < M; m++) {
        __m512 E = _mm512_setzero_ps(), O = _mm512_setzero_ps();
        for (int p = 0; p < K2; p++) {
            uint32_t pa;
            memcpy(&pa, &emul_tiles.data[a][m][4 * p], 4);
            __m512i bp_ = _mm512_loadu_si512(emul_tiles.data[b][p]);
            __m512 ae = _mm512_castsi512_ps(_mm512_set1_epi32((int)(pa << 16)));
            __m512 ao = _mm512_castsi512_ps(_mm512_set1_epi32((int)(pa & 0xffff0000u)));
            E = _mm512_fmadd_ps(ae, _mm512_castsi512_ps(_mm512_slli_epi32(bp_, 16)), E);
            O = _mm512_fmadd_ps(ao, _mm512_castsi512_ps(_mm512_and_si512(bp_, _mm512_set1_epi32((int)0xffff0000u))), O);
        }
        __m512 C = _mm512_loadu_ps((const float *)emul_tiles.data[c][m]);
        _mm512_storeu_ps((float *)emul_tiles.data[c][m], _mm512_add_ps(C, _mm512_add_ps(E, O)));
    }
    _mm_setcsr(csr);
}

#define _tile_loadconfig(cfg) emul_loadconfig(cfg)
#define _tile_zero(t) emul_zero(t)
#define _tile_loadd(t, base, stride) emul_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) emul_stored((t), (base), (long)(stride))
#define _tile_dpbf16ps(c, a, b) emul_dp((c), (a), (b))
#define _tile_release() ((void)0)
#endif
