/* kernels: the scalar specification of the matrix kernels. Every SIMD variant
 * reproduces these loops bit for bit (kernels/README.md, "Canonical orders");
 * change an order here and every variant must change with it. Built with
 * -ffp-contract=off: a*b+c is two roundings unless written fmaf(). */
#include <math.h>
#include <stddef.h>

#include "kernels/kernels_int.h"

const int8_t shoal__kernels_e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e-152) for 3 <= e <= 254; 0..2 unused; 255 NaN. */
const float shoal__kernels_e8m0_mul[256] = {
    0.0f, 0.0f, 0.0f, 0x1p-149f, 0x1p-148f, 0x1p-147f, 0x1p-146f, 0x1p-145f,
    0x1p-144f, 0x1p-143f, 0x1p-142f, 0x1p-141f, 0x1p-140f, 0x1p-139f, 0x1p-138f, 0x1p-137f,
    0x1p-136f, 0x1p-135f, 0x1p-134f, 0x1p-133f, 0x1p-132f, 0x1p-131f, 0x1p-130f, 0x1p-129f,
    0x1p-128f, 0x1p-127f, 0x1p-126f, 0x1p-125f, 0x1p-124f, 0x1p-123f, 0x1p-122f, 0x1p-121f,
    0x1p-120f, 0x1p-119f, 0x1p-118f, 0x1p-117f, 0x1p-116f, 0x1p-115f, 0x1p-114f, 0x1p-113f,
    0x1p-112f, 0x1p-111f, 0x1p-110f, 0x1p-109f, 0x1p-108f, 0x1p-107f, 0x1p-106f, 0x1p-105f,
    0x1p-104f, 0x1p-103f, 0x1p-102f, 0x1p-101f, 0x1p-100f, 0x1p-99f, 0x1p-98f, 0x1p-97f,
    0x1p-96f, 0x1p-95f, 0x1p-94f, 0x1p-93f, 0x1p-92f, 0x1p-91f, 0x1p-90f, 0x1p-89f,
    0x1p-88f, 0x1p-87f, 0x1p-86f, 0x1p-85f, 0x1p-84f, 0x1p-83f, 0x1p-82f, 0x1p-81f,
    0x1p-80f, 0x1p-79f, 0x1p-78f, 0x1p-77f, 0x1p-76f, 0x1p-75f, 0x1p-74f, 0x1p-73f,
    0x1p-72f, 0x1p-71f, 0x1p-70f, 0x1p-69f, 0x1p-68f, 0x1p-67f, 0x1p-66f, 0x1p-65f,
    0x1p-64f, 0x1p-63f, 0x1p-62f, 0x1p-61f, 0x1p-60f, 0x1p-59f, 0x1p-58f, 0x1p-57f,
    0x1p-56f, 0x1p-55f, 0x1p-54f, 0x1p-53f, 0x1p-52f, 0x1p-51f, 0x1p-50f, 0x1p-49f,
    0x1p-48f, 0x1p-47f, 0x1p-46f, 0x1p-45f, 0x1p-44f, 0x1p-43f, 0x1p-42f, 0x1p-41f,
    0x1p-40f, 0x1p-39f, 0x1p-38f, 0x1p-37f, 0x1p-36f, 0x1p-35f, 0x1p-34f, 0x1p-33f,
    0x1p-32f, 0x1p-31f, 0x1p-30f, 0x1p-29f, 0x1p-28f, 0x1p-27f, 0x1p-26f, 0x1p-25f,
    0x1p-24f, 0x1p-23f, 0x1p-22f, 0x1p-21f, 0x1p-20f, 0x1p-19f, 0x1p-18f, 0x1p-17f,
    0x1p-16f, 0x1p-15f, 0x1p-14f, 0x1p-13f, 0x1p-12f, 0x1p-11f, 0x1p-10f, 0x1p-9f,
    0x1p-8f, 0x1p-7f, 0x1p-6f, 0x1p-5f, 0x1p-4f, 0x1p-3f, 0x1p-2f, 0x1p-1f,
    0x1p0f, 0x1p1f, 0x1p2f, 0x1p3f, 0x1p4f, 0x1p5f, 0x1p6f, 0x1p7f,
    0x1p8f, 0x1p9f, 0x1p10f, 0x1p11f, 0x1p12f, 0x1p13f, 0x1p14f, 0x1p15f,
    0x1p16f, 0x1p17f, 0x1p18f, 0x1p19f, 0x1p20f, 0x1p21f, 0x1p22f, 0x1p23f,
    0x1p24f, 0x1p25f, 0x1p26f, 0x1p27f, 0x1p28f, 0x1p29f, 0x1p30f, 0x1p31f,
    0x1p32f, 0x1p33f, 0x1p34f, 0x1p35f, 0x1p36f, 0x1p37f, 0x1p38f, 0x1p39f,
    0x1p40f, 0x1p41f, 0x1p42f, 0x1p43f, 0x1p44f, 0x1p45f, 0x1p46f, 0x1p47f,
    0x1p48f, 0x1p49f, 0x1p50f, 0x1p51f, 0x1p52f, 0x1p53f, 0x1p54f, 0x1p55f,
    0x1p56f, 0x1p57f, 0x1p58f, 0x1p59f, 0x1p60f, 0x1p61f, 0x1p62f, 0x1p63f,
    0x1p64f, 0x1p65f, 0x1p66f, 0x1p67f, 0x1p68f, 0x1p69f, 0x1p70f, 0x1p71f,
    0x1p72f, 0x1p73f, 0x1p74f, 0x1p75f, 0x1p76f, 0x1p77f, 0x1p78f, 0x1p79f,
    0x1p80f, 0x1p81f, 0x1p82f, 0x1p83f, 0x1p84f, 0x1p85f, 0x1p86f, 0x1p87f,
    0x1p88f, 0x1p89f, 0x1p90f, 0x1p91f, 0x1p92f, 0x1p93f, 0x1p94f, 0x1p95f,
    0x1p96f, 0x1p97f, 0x1p98f, 0x1p99f, 0x1p100f, 0x1p101f, 0x1p102f, NAN,
};

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

/* MXFP4 row dot product. For each 32-column group g with E8M0 code e:
 *   f[i]  = E2M1(code i) * 2^25 (exact: the integer 2*E2M1 times 2^24),
 *   G[l]  = fmaf(f[24+l], x[24+l], fmaf(f[16+l], x[16+l], fmaf(f[8+l], x[8+l], f[l]*x[l])))  l < 8,
 *   acc[g & 1][l] = fmaf(G[l], 2^(e-152), acc[g & 1][l])      for 3 <= e <= 254,
 *                 = fmaf(G[l] * 2^-25, 2^(e-127), acc[g&1][l]) for e <= 2 (2^(e-152) is not an fp32),
 *                 = NaN                                        for e = 255 (OCP MX: NaN scale);
 * result = reduce8(acc[0] + acc[1]). The 2^25 factor makes f an exact
 * int32->fp32 conversion in the SIMD decoders; it is exact here too, so the
 * result equals sum_i E2M1_i * 2^(e-127) * x_i in this order, except when a
 * scaled product or partial sum overflows (|x| around 2^98 and up). */
float shoal__kernels_dot_mxfp4_scalar(const uint8_t *packed, const uint8_t *scale, const float *x, int cols)
{
    float acc[2][8] = {{0}};
    int ng = cols / 32;
    for (int g = 0; g < ng; g++) {
        float f[32];
        for (int j = 0; j < 16; j++) {
            uint8_t b = packed[16 * g + j];
            f[2 * j] = (float)shoal__kernels_e2m1x2[b & 15] * 0x1p24f;
            f[2 * j + 1] = (float)shoal__kernels_e2m1x2[b >> 4] * 0x1p24f;
        }
        const float *xg = x + 32 * g;
        unsigned e = scale[g];
        float *a = acc[g & 1];
        for (int l = 0; l < 8; l++) {
            float G = f[l] * xg[l];
            G = fmaf(f[8 + l], xg[8 + l], G);
            G = fmaf(f[16 + l], xg[16 + l], G);
            G = fmaf(f[24 + l], xg[24 + l], G);
            if (e >= 3)
                a[l] = fmaf(G, shoal__kernels_e8m0_mul[e], a[l]);
            else
                a[l] = fmaf(G * 0x1p-25f, ldexpf(1.0f, (int)e - 127), a[l]);
        }
    }
    float s[8];
    for (int l = 0; l < 8; l++)
        s[l] = acc[0][l] + acc[1][l];
    return shoal__kernels_reduce8(s);
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
