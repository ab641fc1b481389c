/* Emulated check of kernels/gemm_avx512.c on a CPU without AVX-512: the file
 * is compiled against SIMDe's portable AVX-512 intrinsics (by
 * test_kernels_avx512_emul.sh) and each worker is compared bit for bit with
 * the scalar specification. This checks the lane logic of the AVX-512 code;
 * it does not replace running test_kernels on real AVX-512 hardware. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/st.h"
#include "kernels/kernels_int.h"

int shoal_test_fill_avx512_emul(shoal__kernels_table *t);

static uint64_t rs = 0x1234567887654321ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 16);
}
static float fr(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() & 0xffffff) / (float)0x1000000;
}

static int fails, checks;

/* memcmp, except that two NaNs of either sign are equal: SIMDe's emulation
 * of the MXFP4 worker gives the default NaN (sign set) where the scalar code
 * and the hardware give +NaN for an E8M0 code 255 group (kernels/README.md:
 * NaN payloads and signs are not specified; test_kernels compares the
 * native workers with memcmp, NaN included). */
static int differ(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, 4) && !(isnan(a[i]) && isnan(b[i])))
            return 1;
    return 0;
}
static void result(const char *name, int ok, const char *detail)
{
    const char *path = getenv("SHOAL_TEST_RESULTS");
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, ok ? "" : ": ", ok ? "" : detail);
    if (path) {
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "%s\tkernels_avx512_emul\t%s%s%s\n", ok ? "PASS" : "FAIL", name, ok ? "" : ": ", ok ? "" : detail);
            fclose(f);
        }
    }
    fails += !ok;
}

int main(void)
{
    shoal__kernels_table e;
    memset(&e, 0, sizeof e);
    if (!shoal_test_fill_avx512_emul(&e) || !e.gemm_mxfp4 || !e.gemm_mxfp4_zx || !e.gemm_mxfp4_mu || !e.gemm_bf16_mu) {
        result("fill", 0, "the AVX-512 file compiled to its fallback");
        return 1;
    }
    int rows_l[] = {1, 3, 4, 5, 8, 9, 13, 17, 33};
    int cols_l[] = {32, 64, 96, 160, 544, 1056, 8224};
    int T_l[] = {1, 2, 3, 4, 5, 7, 9};
    char msg[256] = "";
    /* bf16, f32, MXFP4 shift decode, MXFP4 vpmovzx decode, and the matrix-unit
     * order: bf16, MXFP4 (fold and table paths: scale codes 0, 2, 255 in some blocks) */
    int ok[6] = {1, 1, 1, 1, 1, 1};
    for (int k = 0; k < 6; k++)
        for (size_t ri = 0; ri < sizeof rows_l / sizeof *rows_l; ri++)
            for (size_t ci = 0; ci < sizeof cols_l / sizeof *cols_l; ci++) {
                /* (the mu kernels at T = 1, decode's four-block step, for every other width) */
                int rows = rows_l[ri], cols = cols_l[ci], T = k >= 4 && ci % 2 == 0 ? 1 : T_l[(ri + 2 * ci) % 7];
                size_t n = (size_t)rows * cols;
                uint16_t *wb = malloc(n * 2);
                float *wf = malloc(n * 4), *x = malloc((size_t)T * cols * 4);
                uint8_t *p = malloc(n / 2), *s = malloc(n / 32);
                for (size_t i = 0; i < n; i++) {
                    wb[i] = shoal_f32_to_bf16(fr(-1, 1));
                    wf[i] = fr(-1, 1);
                }
                for (size_t i = 0; i < n / 2; i++)
                    p[i] = (uint8_t)rnd();
                /* the mu kernels: the special codes in whole column blocks (b % 7 == 3), so
                 * the blocks between take the fold path four at a time */
                for (size_t i = 0; i < n / 32; i++)
                    s[i] = (uint8_t)((k >= 4 ? i % (size_t)(cols / 32) : i) % 7 == 3 ? (i % 3 == 0 ? 0 : i % 3 == 1 ? 2 : 255)
                                                                                  : 118 + rnd() % 12);
                for (size_t i = 0; i < (size_t)T * cols; i++)
                    x[i] = i % 13 == 0 ? 0.0f : fr(-3, 3);
                size_t ny = (size_t)T * rows;
                float *ya = malloc(ny * 4), *yb = malloc(ny * 4);
                if (k == 0) {
                    shoal__kernels_gemm_bf16_scalar(ya, wb, x, rows, cols, T, 0, rows);
                    e.gemm_bf16(yb, wb, x, rows, cols, T, 0, rows);
                } else if (k == 1) {
                    shoal__kernels_gemm_f32_scalar(ya, wf, x, rows, cols, T, 0, rows);
                    e.gemm_f32(yb, wf, x, rows, cols, T, 0, rows);
                } else if (k == 4) {
                    shoal__kernels_gemm_bf16_mu_scalar(ya, wb, x, rows, cols, T, 0, rows);
                    e.gemm_bf16_mu(yb, wb, x, rows, cols, T, 0, rows);
                } else if (k == 5) {
                    shoal__kernels_gemm_mxfp4_mu_scalar(ya, p, s, x, rows, cols, T, 0, rows);
                    e.gemm_mxfp4_mu(yb, p, s, x, rows, cols, T, 0, rows);
                } else {
                    shoal__kernels_gemm_mxfp4_scalar(ya, p, s, x, rows, cols, T, 0, rows);
                    (k == 2 ? e.gemm_mxfp4 : e.gemm_mxfp4_zx)(yb, p, s, x, rows, cols, T, 0, rows);
                }
                checks++;
                if (differ(ya, yb, ny) && ok[k]) {
                    ok[k] = 0;
                    snprintf(msg, sizeof msg, "%dx%d T=%d differs from scalar", rows, cols, T);
                }
                free(wb), free(wf), free(x), free(p), free(s), free(ya), free(yb);
            }
    result("gemm_bf16_bit_identical", ok[0], msg);
    result("gemm_f32_bit_identical", ok[1], msg);
    result("gemm_mxfp4_bit_identical", ok[2], msg);
    result("gemm_mxfp4_vpmovzx_bit_identical", ok[3], msg);
    result("gemm_bf16_mu_bit_identical", ok[4], msg);
    result("gemm_mxfp4_mu_bit_identical", ok[5], msg);

    int gok = 1;
    for (int sh = 0; sh < 4; sh++) {
        int rows = 1 + 37 * sh, cols = 64 * (1 + sh) + (sh & 1) * 32;
        uint16_t *wb = malloc((size_t)rows * cols * 2);
        float *wf = malloc((size_t)rows * cols * 4), *x = malloc((size_t)rows * 4);
        for (int i = 0; i < rows * cols; i++)
            wb[i] = shoal_f32_to_bf16(fr(-1, 1)), wf[i] = fr(-1, 1);
        for (int i = 0; i < rows; i++)
            x[i] = fr(-2, 2);
        float *a = malloc((size_t)cols * 4), *b = malloc((size_t)cols * 4);
        for (int c0 = 0; c0 < cols; c0 += 64) {
            int c1 = c0 + 64 < cols ? c0 + 64 : cols;
            shoal__kernels_gemv_t_bf16_scalar(a, wb, x, rows, cols, c0, c1);
            e.gemv_t_bf16(b, wb, x, rows, cols, c0, c1);
            gok &= !memcmp(a + c0, b + c0, (size_t)(c1 - c0) * 4);
            shoal__kernels_gemv_t_f32_scalar(a, wf, x, rows, cols, c0, c1);
            e.gemv_t_f32(b, wf, x, rows, cols, c0, c1);
            gok &= !memcmp(a + c0, b + c0, (size_t)(c1 - c0) * 4);
        }
        free(wb), free(wf), free(x), free(a), free(b);
    }
    result("gemv_t_bit_identical", gok, "gemv_t differs from scalar");

    int kok = 1;
    for (int D = 64; D <= 128; D += 64) {
        float *S0 = malloc((size_t)D * D * 4), *S1 = malloc((size_t)D * D * 4);
        float q[128], kk[128], v[128], g[128], o0[128], o1[128];
        for (int i = 0; i < D * D; i++)
            S0[i] = S1[i] = fr(-1, 1);
        for (int i = 0; i < D; i++)
            q[i] = fr(-0.1f, 0.1f), kk[i] = fr(-0.1f, 0.1f), v[i] = fr(-1, 1), g[i] = fr(-2, 0);
        shoal__kernels_kda_head_scalar(o0, S0, q, kk, v, g, 0.37f, D);
        e.kda_head(o1, S1, q, kk, v, g, 0.37f, D);
        kok &= !memcmp(o0, o1, (size_t)D * 4) && !memcmp(S0, S1, (size_t)D * D * 4);
        free(S0), free(S1);
    }
    result("kda_head_bit_identical", kok, "kda head differs from scalar");
    printf("%d shapes compared, %d failures\n", checks, fails);
    return fails ? 1 : 0;
}
