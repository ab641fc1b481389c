/* kernels: private declarations shared by the kernels' .c files (dispatch in
 * kernels.c, the scalar specification in gemm.c / ops.c, the SIMD variants in
 * gemm_avx2.c / gemm_avx512.c). Nothing outside kernels/ includes this.
 *
 * The matrix kernels are split into a row-range worker per ISA (no threading
 * inside) and one OpenMP wrapper in kernels.c that partitions output rows.
 * Every worker computes each output element with the canonical order written
 * in kernels/README.md, so the partition and the ISA never change a bit. */
#ifndef SHOAL_KERNELS_INT_H
#define SHOAL_KERNELS_INT_H

#include <stdint.h>

#include "kernels/kernels.h"

/* y[t*rows + r] for r in [r0, r1), every t < T. */
typedef void (*shoal__gemm_bf16_fn)(float *y, const uint16_t *w, const float *x, int rows, int cols, int T,
                                    int r0, int r1);
typedef void (*shoal__gemm_f32_fn)(float *y, const float *w, const float *x, int rows, int cols, int T, int r0,
                                   int r1);
typedef void (*shoal__gemm_mxfp4_fn)(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                     int rows, int cols, int T, int r0, int r1);
/* y[c] for c in [c0, c1) of y = W^T x (W [rows, cols]). */
typedef void (*shoal__gemv_t_bf16_fn)(float *y, const uint16_t *w, const float *x, int rows, int cols, int c0,
                                      int c1);
typedef void (*shoal__gemv_t_f32_fn)(float *y, const float *w, const float *x, int rows, int cols, int c0,
                                     int c1);
/* One KDA head (S [D, D], u scratch [D]). */
typedef void (*shoal__kda_head_fn)(float *o, float *S, const float *q, const float *k, const float *v,
                                   const float *g, float beta, int D);

/* MLA heads [h0, h1) of T <= SHOAL_MLA_TBLOCK tokens at positions S0..S0+T-1
 * (token t sees rows 0..S0+t): ctx/q_lat [T, H, R], q_pe [T, H, P], the
 * probabilities of (t, h) at scratch + (t*H + h)*(S0+T). The decode form is
 * T = 1, S0 = S-1. */
typedef void (*shoal__mla_heads_fn)(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0,
                                    int T, int H, int R, int P, float scale, float *scratch, int h0, int h1);

typedef struct {
    shoal__gemm_bf16_fn gemm_bf16;
    shoal__gemm_f32_fn gemm_f32;
    shoal__gemm_mxfp4_fn gemm_mxfp4;
    /* AVX-512 only: the vpmovzxbd decode of gemm_mxfp4 (same bits; kernels.c
     * puts the one shoal_kernels_set_mx_decode chose in gemm_mxfp4) */
    shoal__gemm_mxfp4_fn gemm_mxfp4_zx;
    shoal__gemv_t_bf16_fn gemv_t_bf16;
    shoal__gemv_t_f32_fn gemv_t_f32;
    shoal__kda_head_fn kda_head;
    shoal__mla_heads_fn mla_heads;
    /* the matrix-unit order (gemm_mu.c): an opt-in numerics class */
    shoal__gemm_bf16_fn gemm_bf16_mu;
    shoal__gemm_mxfp4_fn gemm_mxfp4_mu;
} shoal__kernels_table;

/* Scalar specification (always built). */
void shoal__kernels_gemm_bf16_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int T,
                                     int r0, int r1);
void shoal__kernels_gemm_f32_scalar(float *y, const float *w, const float *x, int rows, int cols, int T, int r0,
                                    int r1);
void shoal__kernels_gemm_mxfp4_scalar(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                      int rows, int cols, int T, int r0, int r1);
void shoal__kernels_gemv_t_bf16_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int c0,
                                       int c1);
void shoal__kernels_gemv_t_f32_scalar(float *y, const float *w, const float *x, int rows, int cols, int c0,
                                      int c1);
void shoal__kernels_kda_head_scalar(float *o, float *S, const float *q, const float *k, const float *v,
                                    const float *g, float beta, int D);
/* Matrix-unit order (gemm_mu.c): the scalar specification, activations
 * rounded to bf16 (RNE, NaN kept quiet, subnormals to zero), an MXFP4 weight
 * as the unit sees it (exact, +-inf from 2^128, zero below 2^-126). */
void shoal__kernels_gemm_bf16_mu_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int T,
                                        int r0, int r1);
void shoal__kernels_gemm_mxfp4_mu_scalar(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                         int rows, int cols, int T, int r0, int r1);
float shoal__kernels_mu_round_bf16(float v);
float shoal__kernels_mu_mx_weight(unsigned code, unsigned e);
/* mu_bf[e][c]: shoal__kernels_mu_mx_weight(c, e) as bf16 bits (exact), built with mx_w */
extern uint16_t shoal__kernels_mu_bf[256][16];
/* the same split into low bytes [0..15] and high bytes [16..31] for vpshufb */
extern uint8_t shoal__kernels_mu_bfs[256][32];

/* One MXFP4 row dot product (the spec of one output element); x [cols]. */
float shoal__kernels_dot_mxfp4_scalar(const uint8_t *packed, const uint8_t *scale, const float *x, int cols);
/* Canonical 16-lane dot product of fp32 vectors (lane = i mod 16, fmaf, then
 * the fixed tree of shoal__kernels_reduce16); used by MLA scores. */
float shoal__kernels_dot_f32_scalar(const float *a, const float *b, int n);
float shoal__kernels_reduce16(const float a[16]);
float shoal__kernels_reduce8(const float a[8]);

/* One MLA head (absorbed decode form); p [S] scratch for the probabilities. */
void shoal__kernels_mla_head(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S, int R,
                             int P, float scale, float *p);

void shoal__kernels_mla_heads_scalar(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0,
                                     int T, int H, int R, int P, float scale, float *scratch, int h0, int h1);

/* Instruction-rate loops (peak_*.c, gemm_amx.c): multiply-adds done, 0 when not compiled in. */
double shoal__kernels_peak_fma_zmm(long n);
double shoal__kernels_peak_fma_ymm(long n);
double shoal__kernels_peak_bf16dot(long n);
double shoal__kernels_peak_vnni8(long n);
double shoal__kernels_peak_amx_bf16(long n);
/* 1 when the CPU has AMX-TILE + AMX-BF16, the OS enables the tile state and
 * grants this process the tile data permission (asked once). */
int shoal__kernels_amx_usable(void);
/* The matrix-unit-order GEMM on AMX (gemm_amx.c); selected only after the
 * self-test (kernels.c) found it equal to the scalar specification. */
void shoal__kernels_gemm_bf16_mu_amx(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0,
                                     int r1);
void shoal__kernels_gemm_mxfp4_mu_amx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows,
                                      int cols, int T, int r0, int r1);

/* Variants of the AMX GEMM (gemm_amx.c, kernels/README.md): blocking and
 * arrangement only, each bit-identical to the specification; flags, combined
 * freely. SHOAL_AMX_VARIANT names them (kernels.c); 0 is the default kernel. */
enum {
    SHOAL__AMX_K256 = 1, /* 256-column chunks instead of 512 */
    SHOAL__AMX_ONCE = 2, /* token groups of 256 (K256: 512) instead of 128: weights packed once per call */
    SHOAL__AMX_PF = 4,   /* prefetch the weights of the panel packed next while the tiles run */
    SHOAL__AMX_PIPE = 8, /* pack the next 32-row panel between the current panel's tile steps */
    SHOAL__AMX_SWAP = 16, /* T <= 32: weights as the A tiles, activations as B */
    SHOAL__AMX_ALL = 31
};
/* Selects the variant the AMX GEMM runs (no check; call between kernel calls). */
void shoal__kernels_amx_set_variant(int v);
/* "base", or the flags' names joined by '+' in the enum's order ("k256+once") */
const char *shoal__kernels_amx_variant_name(int v, char *buf, size_t n);
/* Parses such a name (any order; "base" or "" is 0): 0, or SHOAL_EINVAL. */
int shoal__kernels_amx_variant_parse(const char *s, int *v);

/* The start-up self-test of a matrix-unit-order kernel pair: 0 when it equals
 * the scalar specification on the probe inputs, SHOAL_EUNSUPPORTED otherwise. */
int shoal__kernels_mu_selftest(shoal__gemm_bf16_fn bf, shoal__gemm_mxfp4_fn mx);

/* Filled by the ISA files; each returns 0 when the variant was not compiled in. */
int shoal__kernels_fill_avx2(shoal__kernels_table *t);
int shoal__kernels_fill_avx512(shoal__kernels_table *t);

extern const shoal__kernels_table *shoal__kernels_active;

/* Rows per row block of the blocked GEMMs (T > 1): as many rows of row_bytes
 * as fill half of this CPU's L2 (sysconf, read once by shoal_kernels_init;
 * 1 MiB when unknown), a multiple of 4 in [4, max]. Blocking changes no bit. */
int shoal__kernels_gemm_rb(int row_bytes, int max);

/* E2M1 code -> E2M1 value / 4 (codes 8..15 negate 0..7; code 8 is -0). */
/* the mu MXFP4 fold path on (1) or off (0): shoal_kernels_set_mu_fold */
extern int shoal__kernels_mu_fold;
extern const float shoal__kernels_e2m1q[16];
/* E8M0 code -> 2^(e-127) (exact, subnormal for e = 0), NaN for e = 255. */
float shoal__kernels_e8m0(unsigned e);
/* Dequantisation tables built once by shoal_kernels_init (kernels.c):
 * mx_w[e][c] = e2m1q[c] * 2^(e-127), the exact fp32 weight of code c in a
 * group with E8M0 code e (NaN for e = 255), 64-byte aligned rows for vpermps;
 * mx_bf[e] the same values as bf16 (exact: one mantissa bit), split into low
 * bytes [0..15] and high bytes [16..31] for vpshufb. */
extern float shoal__kernels_mx_w[256][16];
extern uint8_t shoal__kernels_mx_bf[256][32];
void shoal__kernels_mx_tables(void);

static inline float shoal__bf16f(uint16_t h)
{
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* llvm-mca regions around hot loops: empty unless compiled with -DSHOAL_MCA
 * (tests/bench/mu_mca.sh compiles a kernel file with it to assembly and
 * feeds the regions to llvm-mca; never in a build). */
#ifdef SHOAL_MCA
#define SHOAL__MCA_BEGIN(name) __asm__ volatile("# LLVM-MCA-BEGIN " name)
#define SHOAL__MCA_END() __asm__ volatile("# LLVM-MCA-END")
#else
#define SHOAL__MCA_BEGIN(name) ((void)0)
#define SHOAL__MCA_END() ((void)0)
#endif

#endif
