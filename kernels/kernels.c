/* kernels: ISA choice (CPUID, SHOAL_ISA override read here and nowhere else)
 * and the public entry points, which split output rows (or heads, or output
 * columns) over OpenMP threads and call the active ISA's worker. A worker
 * computes every output element in the canonical order, so neither the split
 * nor the thread count changes a bit (kernels/README.md). */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "kernels/kernels_int.h"

static const shoal__kernels_table scalar_table = {
    .gemm_bf16 = shoal__kernels_gemm_bf16_scalar,
    .gemm_f32 = shoal__kernels_gemm_f32_scalar,
    .gemm_mxfp4 = shoal__kernels_gemm_mxfp4_scalar,
    .gemv_t_bf16 = shoal__kernels_gemv_t_bf16_scalar,
    .gemv_t_f32 = shoal__kernels_gemv_t_f32_scalar,
    .kda_head = shoal__kernels_kda_head_scalar,
    .mla_heads = shoal__kernels_mla_heads_scalar,
};

static shoal__kernels_table isa_tables[3];
static int isa_built[3]; /* 1 compiled in and filled, -1 not compiled in */
static shoal_isa active_isa = SHOAL_ISA_SCALAR;
static int initialised;
const shoal__kernels_table *shoal__kernels_active = &scalar_table;

const char *shoal_isa_name(shoal_isa isa)
{
    switch (isa) {
    case SHOAL_ISA_SCALAR:
        return "scalar";
    case SHOAL_ISA_AVX2:
        return "avx2";
    case SHOAL_ISA_AVX512:
        return "avx512";
    }
    return "?";
}

#if defined(__x86_64__) || defined(__i386__)
/* clang 14 rejects __builtin_cpu_supports("f16c"): read CPUID leaf 1 instead. */
static int cpu_has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

int shoal_kernels_cpu_has(shoal_isa isa)
{
    switch (isa) {
    case SHOAL_ISA_SCALAR:
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    case SHOAL_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case SHOAL_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma");
#endif
    default:
        return 0;
    }
}

/* 1 if the variant is compiled in and the CPU runs it. */
static int isa_usable(shoal_isa isa)
{
    if (!shoal_kernels_cpu_has(isa))
        return 0;
    if (!isa_built[isa]) {
        shoal__kernels_mx_tables();
        isa_tables[isa] = scalar_table;
        int ok = 1;
        if (isa == SHOAL_ISA_AVX2)
            ok = shoal__kernels_fill_avx2(&isa_tables[isa]);
        else if (isa == SHOAL_ISA_AVX512)
            ok = shoal__kernels_fill_avx2(&isa_tables[isa]) && shoal__kernels_fill_avx512(&isa_tables[isa]);
        isa_built[isa] = ok ? 1 : -1;
    }
    return isa_built[isa] == 1;
}

int shoal_kernels_set_isa(shoal_isa isa)
{
    if ((unsigned)isa > SHOAL_ISA_AVX512 || !isa_usable(isa))
        return SHOAL_EUNSUPPORTED;
    active_isa = isa;
    shoal__kernels_active = isa == SHOAL_ISA_SCALAR ? &scalar_table : &isa_tables[isa];
    return 0;
}

shoal_isa shoal_kernels_isa(void)
{
    return active_isa;
}

shoal_isa shoal_kernels_cpu_best(void)
{
    return shoal_kernels_cpu_has(SHOAL_ISA_AVX512) ? SHOAL_ISA_AVX512
           : shoal_kernels_cpu_has(SHOAL_ISA_AVX2) ? SHOAL_ISA_AVX2
                                                   : SHOAL_ISA_SCALAR;
}

int shoal_kernels_init(void)
{
    if (initialised)
        return 0;
    const char *env = getenv("SHOAL_ISA");
    if (env && *env) {
        shoal_isa want;
        if (!strcmp(env, "scalar"))
            want = SHOAL_ISA_SCALAR;
        else if (!strcmp(env, "avx2"))
            want = SHOAL_ISA_AVX2;
        else if (!strcmp(env, "avx512"))
            want = SHOAL_ISA_AVX512;
        else
            return SHOAL_EINVAL;
        int rc = shoal_kernels_set_isa(want);
        if (rc)
            return rc;
    } else {
        shoal_isa best = SHOAL_ISA_SCALAR;
        if (isa_usable(SHOAL_ISA_AVX512))
            best = SHOAL_ISA_AVX512;
        else if (isa_usable(SHOAL_ISA_AVX2))
            best = SHOAL_ISA_AVX2;
        shoal_kernels_set_isa(best);
    }
    initialised = 1;
    return 0;
}

/* ---- threaded entry points ---------------------------------------------- */

/* Rows per work item: a multiple of every worker's row blocking (4), large
 * enough that a thread streams long contiguous runs of W. */
#define ROW_BLOCK 16
/* Below this many multiply-adds a call runs on the calling thread only: a
 * parallel region costs microseconds, a 128x512 GEMV about ten. */
#define PAR_MIN_WORK (1L << 18)

#define ROW_SPLIT(call)                                                                                         \
    do {                                                                                                        \
        int nb_ = (rows + ROW_BLOCK - 1) / ROW_BLOCK;                                                           \
        long work_ = (long)rows * cols * T;                                                                     \
        _Pragma("omp parallel for schedule(static) if (work_ >= PAR_MIN_WORK)") for (int b_ = 0; b_ < nb_;      \
                                                                                     b_++)                      \
        {                                                                                                       \
            int r0 = b_ * ROW_BLOCK, r1 = r0 + ROW_BLOCK < rows ? r0 + ROW_BLOCK : rows;                        \
            call;                                                                                               \
        }                                                                                                       \
    } while (0)

void shoal_gemm_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int T)
{
    shoal__gemm_bf16_fn fn = shoal__kernels_active->gemm_bf16;
    ROW_SPLIT(fn(y, w, x, rows, cols, T, r0, r1));
}

void shoal_gemm_f32(float *y, const float *w, const float *x, int rows, int cols, int T)
{
    shoal__gemm_f32_fn fn = shoal__kernels_active->gemm_f32;
    ROW_SPLIT(fn(y, w, x, rows, cols, T, r0, r1));
}

void shoal_gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                      int T)
{
    shoal__gemm_mxfp4_fn fn = shoal__kernels_active->gemm_mxfp4;
    ROW_SPLIT(fn(y, packed, scale, x, rows, cols, T, r0, r1));
}

#define COL_BLOCK 64
#define COL_SPLIT(call)                                                                                         \
    do {                                                                                                        \
        int nb_ = (cols + COL_BLOCK - 1) / COL_BLOCK;                                                           \
        long work_ = (long)rows * cols;                                                                         \
        _Pragma("omp parallel for schedule(static) if (work_ >= PAR_MIN_WORK)") for (int b_ = 0; b_ < nb_;      \
                                                                                     b_++)                      \
        {                                                                                                       \
            int c0 = b_ * COL_BLOCK, c1 = c0 + COL_BLOCK < cols ? c0 + COL_BLOCK : cols;                        \
            call;                                                                                               \
        }                                                                                                       \
    } while (0)

void shoal_gemv_t_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols)
{
    shoal__gemv_t_bf16_fn fn = shoal__kernels_active->gemv_t_bf16;
    COL_SPLIT(fn(y, w, x, rows, cols, c0, c1));
}

void shoal_gemv_t_f32(float *y, const float *w, const float *x, int rows, int cols)
{
    shoal__gemv_t_f32_fn fn = shoal__kernels_active->gemv_t_f32;
    COL_SPLIT(fn(y, w, x, rows, cols, c0, c1));
}

void shoal_kda_step(float *o, float *S, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, int H, int D)
{
    shoal__kda_head_fn fn = shoal__kernels_active->kda_head;
#pragma omp parallel for schedule(static) if (H > 1)
    for (int h = 0; h < H; h++) {
        size_t off = (size_t)h * D;
        fn(o + off, S + off * D, q + off, k + off, v + off, g + off, beta[h], D);
    }
}

/* Each thread takes a contiguous range of heads and walks the cache once per
 * block of tokens. */
static void mla_block(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0, int T, int H,
                      int R, int P, float scale, float *scratch)
{
    shoal__mla_heads_fn fn = shoal__kernels_active->mla_heads;
#pragma omp parallel if ((long)H * (S0 + T) * (R + P) * T >= PAR_MIN_WORK)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int h0 = (int)((long)H * id / nt), h1 = (int)((long)H * (id + 1) / nt);
        if (h1 > h0)
            fn(ctx, q_lat, q_pe, cache, S0, T, H, R, P, scale, scratch, h0, h1);
    }
}

void shoal_mla_attend(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S, int H, int R,
                      int P, float scale, float *scratch)
{
    mla_block(ctx, q_lat, q_pe, cache, S - 1, 1, H, R, P, scale, scratch);
}

void shoal_mla_attend_prefill(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0, int T,
                              int H, int R, int P, float scale, float *scratch)
{
    for (int t0 = 0; t0 < T; t0 += SHOAL_MLA_TBLOCK) {
        int n = T - t0 < SHOAL_MLA_TBLOCK ? T - t0 : SHOAL_MLA_TBLOCK;
        size_t q = (size_t)t0 * H;
        mla_block(ctx + q * R, q_lat + q * R, q_pe + q * P, cache, S0 + t0, n, H, R, P, scale, scratch);
    }
}
