/* kernels: the scalar specification of the matrix kernels. Every SIMD variant
 * reproduces these loops bit for bit (kernels/README.md, "Canonical orders");
 * change an order here and every variant must change with it. Built with
 * -ffp-contract=off: a*b+c is two roundings unless written fmaf(). */
#include <math.h>
#include <stddef.h>

#include "kernels/kernels_int.h"

/* E2M1 code -> value / 4 (SPEC §4.2 E2M1 divided by 4, exact): the dequantised
 * weight is shoal__kernels_e2m1q[code] * 2^(e-127), exact in fp32 for every
 * E8M0 code e <= 254 (|w| <= 1.5 * 2^127, nonzero |w| >= 2^-130). */
const float shoal__kernels_e2m1q[16] = {0.0f,  0.125f,  0.25f,  0.375f,  0.5f,  0.75f,  1.0f,  1.5f,
                                        -0.0f, -0.125f, -0.25f, -0.375f, -0.5f, -0.75f, -1.0f, -1.5f};

/* 2^(e-127) for e <= 254 (2^-127 is a subnormal fp32, exact), NaN for 255. */
float shoal__kernels_e8m0(unsigned e)
{
    return e >= 255 ? NAN : ldexpf(1.0f, (int)e - 127);
}

/* Fixed reduction trees: halves first (lane j + lane j+n/2), down to one. */
float shoal__kernels_reduce16(const float a[16])
{
    float b[8], c[4];
    for (int j = 0; j < 8; j++)
        b[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; j++)
        c[j] = b[j] + b[j + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

float shoal__kernels_reduce8(const float a[8])
{
    float c[4];
    for (int j = 0; j < 4; j++)
        c[j] = a[j] + a[j + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* Sixteen interleaved partial sums (lane = i mod 16), each a chain of fmaf in
 * increasing i, then reduce16. n need not be a multiple of 16 here (the
 * leftover elements join their lanes in order); the SIMD variants are only
 * used for multiples of 32. */
float shoal__kernels_dot_f32_scalar(const float *a, const float *b, int n)
{
    float acc[16] = {0};
    for (int i = 0; i < n; i++)
        acc[i & 15] = fmaf(a[i], b[i], acc[i & 15]);
    return shoal__kernels_reduce16(acc);
}

static float dot_bf16(const uint16_t *w, const float *x, int n)
{
    float acc[16] = {0};
    for (int i = 0; i < n; i++)
        acc[i & 15] = fmaf(shoal__bf16f(w[i]), x[i], acc[i & 15]);
    return shoal__kernels_reduce16(acc);
}

void shoal__kernels_gemm_bf16_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int T,
                                     int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)t * rows + r] = dot_bf16(w + (size_t)r * cols, x + (size_t)t * cols, cols);
}

void shoal__kernels_gemm_f32_scalar(float *y, const float *w, const float *x, int rows, int cols, int T, int r0,
                                    int r1)
{
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)t * rows + r] = shoal__kernels_dot_f32_scalar(w + (size_t)r * cols, x + (size_t)t * cols, cols);
}

/* MXFP4 row dot product (kernels/README.md, "MXFP4"). For each 32-column
 * group g with E8M0 code e, s = 2^(e-127) (NaN for e = 255), and packed byte j
 * (0..15) of the group, holding the codes of columns 2j (low nibble) and
 * 2j+1 (high nibble):
 *   w(c)    = e2m1q[c] * s                  (exact: E2M1/4 times a power of two)
 *   acc[j]  = fmaf(w(hi), x[32g+2j+1], fmaf(w(lo), x[32g+2j], acc[j]))
 * from acc = +0, groups in increasing order; result = 4 * reduce16(acc).
 * Each weight is the exact value E2M1 * 2^(e-127) / 4, so the result is the
 * fp32 dot product of the exact weights in this order, scaled by an exact
 * power of two, except where a product or partial sum leaves the normal fp32
 * range (below 2^-126 it keeps two bits fewer; 4 * sum overflows to inf
 * exactly when the sum does). */
float shoal__kernels_dot_mxfp4_scalar(const uint8_t *packed, const uint8_t *scale, const float *x, int cols)
{
    float acc[16] = {0};
    int ng = cols / 32;
    for (int g = 0; g < ng; g++) {
        float s = shoal__kernels_e8m0(scale[g]);
        const uint8_t *p = packed + 16 * g;
        const float *xg = x + 32 * g;
        for (int j = 0; j < 16; j++) {
            float wl = shoal__kernels_e2m1q[p[j] & 15] * s, wh = shoal__kernels_e2m1q[p[j] >> 4] * s;
            acc[j] = fmaf(wl, xg[2 * j], acc[j]);
            acc[j] = fmaf(wh, xg[2 * j + 1], acc[j]);
        }
    }
    return 4.0f * shoal__kernels_reduce16(acc);
}

void shoal__kernels_gemm_mxfp4_scalar(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                      int rows, int cols, int T, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++)
            y[(size_t)t * rows + r] = shoal__kernels_dot_mxfp4_scalar(
                packed + (size_t)r * (cols / 2), scale + (size_t)r * (cols / 32), x + (size_t)t * cols, cols);
}

/* y[c] = fmaf chain over r = 0..rows-1 starting from +0. */
void shoal__kernels_gemv_t_bf16_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int c0,
                                       int c1)
{
    for (int c = c0; c < c1; c++)
        y[c] = 0.0f;
    for (int r = 0; r < rows; r++) {
        const uint16_t *wr = w + (size_t)r * cols;
        for (int c = c0; c < c1; c++)
            y[c] = fmaf(shoal__bf16f(wr[c]), x[r], y[c]);
    }
}

void shoal__kernels_gemv_t_f32_scalar(float *y, const float *w, const float *x, int rows, int cols, int c0,
                                      int c1)
{
    for (int c = c0; c < c1; c++)
        y[c] = 0.0f;
    for (int r = 0; r < rows; r++) {
        const float *wr = w + (size_t)r * cols;
        for (int c = c0; c < c1; c++)
            y[c] = fmaf(wr[c], x[r], y[c]);
    }
}

/* Dequantisation tables of the SIMD decoders (kernels_int.h); built once,
 * before any SIMD variant is selected. Every entry is an exact value, so the
 * tables add no rounding of their own. */
__attribute__((aligned(64))) float shoal__kernels_mx_w[256][16];
__attribute__((aligned(64))) uint8_t shoal__kernels_mx_bf[256][32];
__attribute__((aligned(64))) uint16_t shoal__kernels_mu_bf[256][16];
__attribute__((aligned(64))) uint8_t shoal__kernels_mu_bfs[256][32];

void shoal__kernels_mx_tables(void)
{
    static int built;
    if (built)
        return;
    for (unsigned e = 0; e < 256; e++)
        for (int c = 0; c < 16; c++) {
            float w = shoal__kernels_e2m1q[c] * shoal__kernels_e8m0(e);
            union {
                float f;
                uint32_t u;
            } v = {.f = w};
            /* exact weights have at most two significant bits: bf16 holds them */
            shoal__kernels_mx_w[e][c] = w;
            shoal__kernels_mx_bf[e][c] = (uint8_t)(v.u >> 16);
            shoal__kernels_mx_bf[e][16 + c] = (uint8_t)(v.u >> 24);
            v.f = shoal__kernels_mu_mx_weight((unsigned)c, e);
            shoal__kernels_mu_bf[e][c] = (uint16_t)(v.u >> 16); /* exact: two significant bits, or inf/NaN */
            shoal__kernels_mu_bfs[e][c] = (uint8_t)(v.u >> 16);
            shoal__kernels_mu_bfs[e][16 + c] = (uint8_t)(v.u >> 24);
        }
    built = 1;
}
