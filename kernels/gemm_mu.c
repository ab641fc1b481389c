/* kernels: the scalar specification of the matrix-unit order ("mu", the
 * AMX-BF16 order measured in shared/amx-probe; kernels/README.md,
 * "Matrix-unit order"). An opt-in kernel set: bit-identical on every ISA
 * (AVX-512F and AVX2+FMA emulate it with MXCSR FTZ|DAZ; AMX computes it
 * natively where its start-up self-test passes), but a different numerics
 * class from the fp32-activation kernels of gemm.c.
 *
 * For output y[t][r], with K = cols a multiple of 32:
 *   a[k] = daz(bf16(x[t][k]))      activations rounded to bf16 (RNE) at the input
 *   b[k] = daz(W[r][k])            bf16 weights as stored; MXFP4 decoded exactly
 *                                  (E2M1 * 2^(e-127); >= 2^128 in magnitude is
 *                                  +-inf, e = 255 is NaN)
 *   C = +0
 *   per 32-column block: E = +0, O = +0
 *     for p = 0..15: E = ftz(fma(b[2p], a[2p], E)); O = ftz(fma(b[2p+1], a[2p+1], O))
 *     C = ftz(C + ftz(E + O))
 *   y = C
 * daz: a subnormal input reads as a zero of its sign. ftz: a result whose
 * magnitude, rounded with an unbounded exponent, is below 2^-126 becomes a
 * zero of its sign (x86 FTZ: tininess after rounding). The code below
 * implements both in software with default floating-point state, so the
 * specification does not depend on the machine's flush modes. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kernels_int.h"

#define TINY 0x1p-126f

static inline uint32_t fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bitsf(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float daz(float v)
{
    return fabsf(v) < TINY ? copysignf(0.0f, v) : v;
}

float shoal__kernels_mu_round_bf16(float v)
{
    uint32_t u = fbits(v);
    if (isnan(v))
        return bitsf((u | 0x00400000u) & 0xffff0000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return daz(bitsf(u & 0xffff0000u));
}

void shoal_mu_round_bf16(uint16_t *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = (uint16_t)(fbits(shoal__kernels_mu_round_bf16(x[i])) >> 16);
}

/* ftz(fma(a, b, c)) with a, b bf16 values and c fp32, none subnormal. */
static inline float fma_ftz(float a, float b, float c)
{
    float r = fmaf(a, b, c);
    float m = fabsf(r);
    if (m > TINY || isnan(r))
        return r;
    if (m < TINY)
        return copysignf(0.0f, r);
    /* |r| = 2^-126 after rounding to the subnormal grid: the exact value may
     * still be below 2^-126 - 2^-151, which rounds (unbounded exponent) to
     * 2^-126 - 2^-150, a tiny result. Decide on the exact value p + c: p is
     * exact in double (two 8-bit significands), TwoSum gives s + e exactly. */
    double p = (double)a * (double)b, s = p + (double)c;
    double bp = s - (double)c, e = (p - bp) + ((double)c - (s - bp));
    double sg = r > 0 ? 1.0 : -1.0;
    double d = sg * s - (0x1p-126 - 0x1p-151); /* exact (Sterbenz) */
    return d + sg * e < 0 ? copysignf(0.0f, r) : r;
}

static inline float add_ftz(float a, float b)
{
    float r = a + b; /* a tiny sum of normals is exact: the test needs no rounding care */
    return fabsf(r) < TINY ? copysignf(0.0f, r) : r;
}

/* Continue one output's chain C over n columns (n a multiple of 32):
 * b[n] weights (daz'd, decoded), a[n] activations (rounded, daz'd). */
static float chain_mu(float C, const float *b, const float *a, int n)
{
    for (int k0 = 0; k0 < n; k0 += 32) {
        float E = 0.0f, O = 0.0f;
        for (int p = 0; p < 16; p++) {
            E = fma_ftz(b[k0 + 2 * p], a[k0 + 2 * p], E);
            O = fma_ftz(b[k0 + 2 * p + 1], a[k0 + 2 * p + 1], O);
        }
        C = add_ftz(C, add_ftz(E, O));
    }
    return C;
}

/* E2M1 code c with E8M0 code e, exactly, as the matrix unit sees it. */
float shoal__kernels_mu_mx_weight(unsigned c, unsigned e)
{
    if (e == 255)
        return NAN;
    double v = (double)shoal__kernels_e2m1q[c & 15] * 4.0 * ldexp(1.0, (int)e - 127);
    if (fabs(v) >= 0x1p128)
        return copysignf(INFINITY, (float)v);
    return daz((float)v); /* exact: two significant bits, exponent >= -129 */
}

#define MU_CHUNK 512 /* columns converted at a time (stack buffers) */

void shoal__kernels_gemm_bf16_mu_scalar(float *y, const uint16_t *w, const float *x, int rows, int cols, int T,
                                        int r0, int r1)
{
    float a[MU_CHUNK], b[MU_CHUNK];
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++) {
            float C = 0.0f;
            for (int c0 = 0; c0 < cols; c0 += MU_CHUNK) {
                int n = cols - c0 < MU_CHUNK ? cols - c0 : MU_CHUNK;
                for (int k = 0; k < n; k++) {
                    a[k] = shoal__kernels_mu_round_bf16(x[(size_t)t * cols + c0 + k]);
                    b[k] = daz(shoal__bf16f(w[(size_t)r * cols + c0 + k]));
                }
                C = chain_mu(C, b, a, n);
            }
            y[(size_t)t * rows + r] = C;
        }
}

void shoal__kernels_gemm_mxfp4_mu_scalar(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                         int rows, int cols, int T, int r0, int r1)
{
    float a[MU_CHUNK], b[MU_CHUNK];
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++) {
            float C = 0.0f;
            for (int c0 = 0; c0 < cols; c0 += MU_CHUNK) {
                int n = cols - c0 < MU_CHUNK ? cols - c0 : MU_CHUNK;
                for (int k = 0; k < n; k++) {
                    int col = c0 + k;
                    uint8_t byte = packed[(size_t)r * (cols / 2) + col / 2];
                    unsigned code = col & 1 ? byte >> 4 : byte & 15;
                    a[k] = shoal__kernels_mu_round_bf16(x[(size_t)t * cols + col]);
                    b[k] = shoal__kernels_mu_mx_weight(code, scale[(size_t)r * (cols / 32) + col / 32]);
                }
                C = chain_mu(C, b, a, n);
            }
            y[(size_t)t * rows + r] = C;
        }
}
