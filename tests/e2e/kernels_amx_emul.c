/* Emulated check of kernels/gemm_amx.c on a CPU without AMX: the file is
 * compiled with the tile intrinsics replaced by kernels_amx_emul_shim.h (by
 * test_kernels_amx_emul.sh) and its matrix-unit-order GEMMs are compared with
 * the scalar specification (values; NaN by class) over shapes with token,
 * row and column-chunk remainders. Checks the AMX code's data layout only; it
 * is no substitute for test_kernels on an AMX machine. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels_int.h"

void emul_bf16_mu_amx(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1);
void emul_mxfp4_mu_amx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols, int T,
                       int r0, int r1);

static uint64_t rs = 0x0123456789abcdefull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 16);
}

static void report(const char *name, int ok, const char *detail)
{
    const char *path = getenv("SHOAL_TEST_RESULTS");
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, ok ? "" : ": ", ok ? "" : detail);
    if (path) {
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "%s\tkernels_amx_emul\t%s%s%s\n", ok ? "PASS" : "FAIL", name, ok ? "" : ": ", ok ? "" : detail);
            fclose(f);
        }
    }
}

static int same(const float *a, const float *b, size_t n, char *detail, size_t dl)
{
    for (size_t i = 0; i < n; i++)
        if (!(isnan(a[i]) && isnan(b[i])) && memcmp(&a[i], &b[i], 4)) {
            snprintf(detail, dl, "output %zu: %a, spec %a", i, b[i], a[i]);
            return 0;
        }
    return 1;
}

int main(void)
{
    if (shoal_kernels_init())
        return 1;
    shoal__kernels_mx_tables();
    static const int shapes[][3] = {{16, 32, 1}, {5, 64, 3}, {70, 96, 17}, {33, 2080, 2}, {130, 160, 33}, {40, 1056, 150}, {47, 544, 36}};
    int fails = 0;
    for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
        int rows = shapes[k][0], cols = shapes[k][1], T = shapes[k][2];
        size_t n = (size_t)rows * cols;
        uint16_t *w = malloc(n * 2);
        uint8_t *p = malloc(n / 2), *s = malloc(n / 32);
        float *x = malloc((size_t)T * cols * 4), *y0 = malloc((size_t)T * rows * 4), *y1 = malloc((size_t)T * rows * 4);
        for (size_t i = 0; i < n; i++) { /* exponents around 1, tiny, subnormal; signs */
            uint32_t r = rnd();
            unsigned ex = r % 9 == 0 ? 0 : r % 9 == 1 ? 5 + r % 20 : 118 + r % 16;
            w[i] = (uint16_t)((r >> 15 & 1) << 15 | ex << 7 | (r >> 20 & 0x7f));
        }
        for (size_t i = 0; i < n / 2; i++)
            p[i] = (uint8_t)rnd();
        for (size_t i = 0; i < n / 32; i++) {
            uint32_t r = rnd();
            s[i] = (uint8_t)(r % 7 == 0 ? 0 : r % 7 == 1 ? 254 : r % 7 == 2 ? 255 : 118 + r % 12);
        }
        for (size_t i = 0; i < (size_t)T * cols; i++) {
            uint32_t r = rnd();
            float v = (float)(r & 0xffff) / 16384.0f - 2.0f;
            x[i] = r % 13 == 0 ? v * 1e-39f : r % 13 == 1 ? v * 0x1p-120f : r % 13 == 2 ? -0.0f : v;
        }
        char name[64], detail[160];
        shoal__kernels_gemm_bf16_mu_scalar(y0, w, x, rows, cols, T, 0, rows);
        memset(y1, 0x5a, (size_t)T * rows * 4);
        emul_bf16_mu_amx(y1, w, x, rows, cols, T, 0, rows);
        snprintf(name, sizeof name, "bf16_mu_%dx%d_T%d", rows, cols, T);
        int ok = same(y0, y1, (size_t)T * rows, detail, sizeof detail);
        report(name, ok, detail);
        fails += !ok;
        shoal__kernels_gemm_mxfp4_mu_scalar(y0, p, s, x, rows, cols, T, 0, rows);
        memset(y1, 0x5a, (size_t)T * rows * 4);
        emul_mxfp4_mu_amx(y1, p, s, x, rows, cols, T, 0, rows);
        snprintf(name, sizeof name, "mxfp4_mu_%dx%d_T%d", rows, cols, T);
        ok = same(y0, y1, (size_t)T * rows, detail, sizeof detail);
        report(name, ok, detail);
        fails += !ok;
        /* a thread's share of the rows: [r0, r1) written, nothing else */
        int r0 = rows / 3, r1 = rows - rows / 5;
        memset(y1, 0x5a, (size_t)T * rows * 4);
        emul_mxfp4_mu_amx(y1, p, s, x, rows, cols, T, r0, r1);
        ok = 1;
        for (int t = 0; t < T && ok; t++)
            for (int r = 0; r < rows && ok; r++) {
                float e = y0[(size_t)t * rows + r], g = y1[(size_t)t * rows + r];
                uint32_t gb;
                memcpy(&gb, &g, 4);
                ok = r >= r0 && r < r1 ? !memcmp(&e, &g, 4) || (isnan(e) && isnan(g)) : gb == 0x5a5a5a5au;
                if (!ok)
                    snprintf(detail, sizeof detail, "rows [%d, %d): token %d row %d: %a (spec %a)", r0, r1, t, r, g, e);
            }
        snprintf(name, sizeof name, "mxfp4_mu_%dx%d_T%d_rows%d-%d", rows, cols, T, r0, r1);
        report(name, ok, detail);
        fails += !ok;
        free(w), free(p), free(s), free(x), free(y0), free(y1);
    }
    return fails ? 1 : 0;
}
