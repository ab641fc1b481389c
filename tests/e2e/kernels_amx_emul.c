/* Check of kernels/gemm_amx.c, every variant (SHOAL__AMX_* flags, all 32
 * combinations unless argv[1] lists names such as "base,k256+once"), against
 * the scalar specification (values; NaN by class) over shapes with token, row
 * and column-chunk remainders, token groups, the swap arrangement's chunks, a
 * thread's row range, and the start-up self-test's probes. Two builds:
 * - emulated (test_kernels_amx_emul.sh): the file compiled with the tile
 *   intrinsics replaced by a software model (kernels_amx_emul_shim.h), on any
 *   AVX-512 CPU: checks the AMX code's data layout and control flow only, no
 *   substitute for a run on the unit;
 * - real (KERNELS_AMX_REAL: build/tests/kernels_amx_real, ctest
 *   test_kernels_amx_real): the library's kernels on the tiles; SKIPPED
 *   without usable AMX. tests/bench/amx_machine.sh runs it first and
 *   excludes a variant that fails. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels_int.h"

#ifdef KERNELS_AMX_REAL
#define GEMM_BF16 shoal__kernels_gemm_bf16_mu_amx
#define GEMM_MX shoal__kernels_gemm_mxfp4_mu_amx
#define SET_VARIANT shoal__kernels_amx_set_variant
#define TAG "kernels_amx_real"
#else
void emul_bf16_mu_amx(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1);
void emul_mxfp4_mu_amx(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols, int T,
                       int r0, int r1);
void emul_amx_set_variant(int v);
#define GEMM_BF16 emul_bf16_mu_amx
#define GEMM_MX emul_mxfp4_mu_amx
#define SET_VARIANT emul_amx_set_variant
#define TAG "kernels_amx_emul"
#endif

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
    fflush(stdout); /* a later variant that crashes must not take these lines with it */
    if (path) {
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "%s\t" TAG "\t%s%s%s\n", ok ? "PASS" : "FAIL", name, ok ? "" : ": ", ok ? "" : detail);
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

/* the floats past the output: a kernel writing beyond T tokens changes them */
static int intact(const float *g, size_t n, char *detail, size_t dl)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &g[i], 4);
        if (b != 0x5a5a5a5au) {
            snprintf(detail, dl, "wrote past the output (float %zu after it)", i);
            return 0;
        }
    }
    return 1;
}

typedef struct {
    int rows, cols, T;
    uint16_t *w;
    uint8_t *p, *s;
    float *x, *ybf, *ymx; /* the specification's outputs */
} shape;

/* one variant over every shape: 1 when all match, else 0 with the first difference in detail */
static int check_variant(const shape *sh, int nsh, float *y1, char *detail, size_t dl)
{
    if (shoal__kernels_mu_selftest(GEMM_BF16, GEMM_MX)) {
        snprintf(detail, dl, "the start-up self-test refused it");
        return 0;
    }
    for (int k = 0; k < nsh; k++) {
        int rows = sh[k].rows, cols = sh[k].cols, T = sh[k].T;
        size_t ny = (size_t)T * rows, guard = (size_t)32 * rows + 64;
        char what[160];
        memset(y1, 0x5a, (ny + guard) * 4);
        GEMM_BF16(y1, sh[k].w, sh[k].x, rows, cols, T, 0, rows);
        if (!intact(y1 + ny, guard, what, sizeof what) || !same(sh[k].ybf, y1, ny, what, sizeof what)) {
            snprintf(detail, dl, "bf16 %dx%d T=%d: %s", rows, cols, T, what);
            return 0;
        }
        memset(y1, 0x5a, (ny + guard) * 4);
        GEMM_MX(y1, sh[k].p, sh[k].s, sh[k].x, rows, cols, T, 0, rows);
        if (!intact(y1 + ny, guard, what, sizeof what) || !same(sh[k].ymx, y1, ny, what, sizeof what)) {
            snprintf(detail, dl, "mxfp4 %dx%d T=%d: %s", rows, cols, T, what);
            return 0;
        }
        /* a thread's share of the rows: [r0, r1) written, nothing else */
        int r0 = rows / 3, r1 = rows - rows / 5;
        for (int kind = 0; kind < 2; kind++) {
            const float *y0 = kind ? sh[k].ymx : sh[k].ybf;
            memset(y1, 0x5a, (ny + guard) * 4);
            if (kind)
                GEMM_MX(y1, sh[k].p, sh[k].s, sh[k].x, rows, cols, T, r0, r1);
            else
                GEMM_BF16(y1, sh[k].w, sh[k].x, rows, cols, T, r0, r1);
            if (!intact(y1 + ny, guard, what, sizeof what)) {
                snprintf(detail, dl, "%s %dx%d T=%d rows [%d, %d): %s", kind ? "mxfp4" : "bf16", rows, cols, T, r0, r1,
                         what);
                return 0;
            }
            for (int t = 0; t < T; t++)
                for (int r = 0; r < rows; r++) {
                    float e = y0[(size_t)t * rows + r], g = y1[(size_t)t * rows + r];
                    uint32_t gb;
                    memcpy(&gb, &g, 4);
                    int ok = r >= r0 && r < r1 ? !memcmp(&e, &g, 4) || (isnan(e) && isnan(g)) : gb == 0x5a5a5a5au;
                    if (!ok) {
                        snprintf(detail, dl, "%s %dx%d T=%d rows [%d, %d): token %d row %d: %a (spec %a)",
                                 kind ? "mxfp4" : "bf16", rows, cols, T, r0, r1, t, r, g, e);
                        return 0;
                    }
                }
        }
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (shoal_kernels_init())
        return 1;
    shoal__kernels_mx_tables();
#ifdef KERNELS_AMX_REAL
    if (!shoal__kernels_amx_usable()) {
        const char *path = getenv("SHOAL_TEST_RESULTS");
        printf("SKIP: AMX-BF16 not on this CPU (or not usable): the AMX kernels not run on tiles\n");
        FILE *f = path ? fopen(path, "a") : NULL;
        if (f) {
            fprintf(f, "SKIP\t" TAG "\tall: AMX-BF16 not on this CPU (or not usable)\n");
            fclose(f);
        }
        return 77;
    }
#endif
    /* tokens across groups (150; 520 > the largest ONCE group), a 36-token call
     * (above SWAP's 32), T <= 32 with one and two token tiles, columns across
     * chunks of 256, 512 and SWAP's 4096, rows with remainders */
    static const int shapes[][3] = {{16, 32, 1},     {5, 64, 3},     {70, 96, 17},   {33, 2080, 2}, {130, 160, 33},
                                    {40, 1056, 150}, {47, 544, 36},  {21, 8224, 20}, {24, 96, 520}, {90, 800, 32}};
    enum { NSH = sizeof shapes / sizeof *shapes };
    shape sh[NSH];
    size_t ymax = 0;
    for (int k = 0; k < NSH; k++) {
        int rows = shapes[k][0], cols = shapes[k][1], T = shapes[k][2];
        size_t n = (size_t)rows * cols;
        sh[k] = (shape){.rows = rows, .cols = cols, .T = T, .w = malloc(n * 2), .p = malloc(n / 2),
                        .s = malloc(n / 32), .x = malloc((size_t)T * cols * 4), .ybf = malloc((size_t)T * rows * 4),
                        .ymx = malloc((size_t)T * rows * 4)};
        ymax = (size_t)(T + 32) * rows + 64 > ymax ? (size_t)(T + 32) * rows + 64 : ymax;
        for (size_t i = 0; i < n; i++) { /* exponents around 1, tiny, subnormal; signs */
            uint32_t r = rnd();
            unsigned ex = r % 9 == 0 ? 0 : r % 9 == 1 ? 5 + r % 20 : 118 + r % 16;
            sh[k].w[i] = (uint16_t)((r >> 15 & 1) << 15 | ex << 7 | (r >> 20 & 0x7f));
        }
        for (size_t i = 0; i < n / 2; i++)
            sh[k].p[i] = (uint8_t)rnd();
        for (size_t i = 0; i < n / 32; i++) {
            uint32_t r = rnd();
            sh[k].s[i] = (uint8_t)(r % 7 == 0 ? 0 : r % 7 == 1 ? 254 : r % 7 == 2 ? 255 : 118 + r % 12);
        }
        for (size_t i = 0; i < (size_t)T * cols; i++) {
            uint32_t r = rnd();
            float v = (float)(r & 0xffff) / 16384.0f - 2.0f;
            sh[k].x[i] = r % 13 == 0 ? v * 1e-39f : r % 13 == 1 ? v * 0x1p-120f : r % 13 == 2 ? -0.0f : v;
        }
        shoal__kernels_gemm_bf16_mu_scalar(sh[k].ybf, sh[k].w, sh[k].x, rows, cols, T, 0, rows);
        shoal__kernels_gemm_mxfp4_mu_scalar(sh[k].ymx, sh[k].p, sh[k].s, sh[k].x, rows, cols, T, 0, rows);
    }
    int vars[SHOAL__AMX_ALL + 1], nv = 0;
    if (argc > 1) {
        char list[512];
        snprintf(list, sizeof list, "%s", argv[1]);
        for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok && nv <= SHOAL__AMX_ALL;
             tok = strtok_r(NULL, ",", &save))
            if (shoal__kernels_amx_variant_parse(tok, &vars[nv++])) {
                fprintf(stderr, "unknown variant %s\n", tok);
                return 2;
            }
    } else
        for (int v = 0; v <= SHOAL__AMX_ALL; v++)
            vars[nv++] = v;
    float *y1 = malloc(ymax * 4);
    int fails = 0;
    for (int i = 0; i < nv; i++) {
        char name[64], vn[48], detail[256] = "";
        SET_VARIANT(vars[i]);
        int ok = check_variant(sh, NSH, y1, detail, sizeof detail);
        snprintf(name, sizeof name, "variant %s", shoal__kernels_amx_variant_name(vars[i], vn, sizeof vn));
        report(name, ok, detail);
        fails += !ok;
    }
    SET_VARIANT(0);
    for (int k = 0; k < NSH; k++)
        free(sh[k].w), free(sh[k].p), free(sh[k].s), free(sh[k].x), free(sh[k].ybf), free(sh[k].ymx);
    free(y1);
    return fails ? 1 : 0;
}
