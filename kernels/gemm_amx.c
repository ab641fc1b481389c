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

/* Tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 rows of 16 bf16 pairs). */
static void tiles_config(int arows)
{
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = (uint8_t)(i < 4 || i == 4 || i == 5 ? arows : 16);
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
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
    return (double)n * 4 * 16 * 16 * 32;
}
#else
int shoal__kernels_amx_usable(void)
{
    return 0;
}
double shoal__kernels_peak_amx_bf16(long n)
{
    (void)n;
    return 0;
}
#endif
