/* kernels/: every op against an independent double-precision computation
 * written here from SPEC §3/§4.2 (not from the kernels' code), plus the
 * determinism contract of kernels/kernels.h: bit-identical results across ISA
 * variants, OpenMP thread counts, T and batch composition. A variant the CPU
 * lacks is reported SKIPPED, never passed. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "kernels/kernels_int.h"
#include "test.h"

/* ---- helpers ------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float frand(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() & 0xffffff) / (float)0x1000000;
}
static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        abort();
    return p;
}
static float *frand_vec(size_t n, float lo, float hi)
{
    float *v = xmalloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = frand(lo, hi);
    return v;
}
static uint16_t *bf16_vec(size_t n)
{
    uint16_t *v = xmalloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = shoal_f32_to_bf16(frand(-1.0f, 1.0f));
    return v;
}
static uint8_t *byte_vec(size_t n, int lo, int hi)
{
    uint8_t *v = xmalloc(n);
    for (size_t i = 0; i < n; i++)
        v[i] = (uint8_t)(lo + (int)(rnd() % (unsigned)(hi - lo + 1)));
    return v;
}

/* E2M1 from SPEC §4.2, written out independently of the kernels' table. */
static double e2m1_value(unsigned code)
{
    static const double mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    return (code & 8) ? -mag[code & 7] : mag[code & 7];
}
static double mxfp4_weight(const uint8_t *packed, const uint8_t *scale, int cols, int r, int c)
{
    uint8_t b = packed[(size_t)r * (cols / 2) + c / 2];
    unsigned code = (c & 1) ? (b >> 4) : (b & 15);
    return ldexp(e2m1_value(code), (int)scale[(size_t)r * (cols / 32) + c / 32] - 127);
}

static int isas[3];
static int nisas;
static void collect_isas(void)
{
    nisas = 0;
    for (int i = SHOAL_ISA_SCALAR; i <= SHOAL_ISA_AVX512; i++)
        if (shoal_kernels_cpu_has((shoal_isa)i))
            isas[nisas++] = i;
}

/* Bounds of the rounding error of an fp32 dot product of n terms split in 16
 * interleaved chains then a 4-level tree: (n/16 + 4) unit roundoffs of sum|w x|
 * (plus one for the product), with a margin of 2. */
static double dot_tol(int n, double abs_sum)
{
    return 2.0 * (n / 16.0 + 6.0) * 0x1p-24 * abs_sum + 1e-30;
}

/* ---- dispatch ------------------------------------------------------------ */

static void t_dispatch(void)
{
    CHECK_EQ_INT(shoal_kernels_init(), 0);
    CHECK_EQ_INT(shoal_kernels_init(), 0); /* idempotent */
    CHECK(shoal_kernels_cpu_has(SHOAL_ISA_SCALAR));
    CHECK(!strcmp(shoal_isa_name(SHOAL_ISA_SCALAR), "scalar"));
    CHECK(!strcmp(shoal_isa_name(SHOAL_ISA_AVX2), "avx2"));
    CHECK(!strcmp(shoal_isa_name(SHOAL_ISA_AVX512), "avx512"));
    shoal_isa start = shoal_kernels_isa();
    CHECK(shoal_kernels_cpu_has(start));
    for (int i = SHOAL_ISA_SCALAR; i <= SHOAL_ISA_AVX512; i++) {
        int rc = shoal_kernels_set_isa((shoal_isa)i);
        if (shoal_kernels_cpu_has((shoal_isa)i)) {
            CHECK_EQ_INT(rc, 0);
            CHECK_EQ_INT(shoal_kernels_isa(), i);
        } else {
            CHECK_EQ_INT(rc, SHOAL_EUNSUPPORTED);
        }
    }
    CHECK_EQ_INT(shoal_kernels_set_isa((shoal_isa)7), SHOAL_EUNSUPPORTED);
    /* the default is the best the CPU has */
    const char *env = getenv("SHOAL_ISA");
    if (!env || !*env) {
        shoal_isa best = shoal_kernels_cpu_has(SHOAL_ISA_AVX512) ? SHOAL_ISA_AVX512
                         : shoal_kernels_cpu_has(SHOAL_ISA_AVX2) ? SHOAL_ISA_AVX2
                                                                 : SHOAL_ISA_SCALAR;
        CHECK_EQ_INT(start, best);
    }
    shoal_kernels_set_isa(start);
}

/* ---- MXFP4 decoding (SPEC §4.2) ------------------------------------------ */

/* y = W e_c reads back one dequantized weight exactly (a single product). */
static float mxfp4_probe(const uint8_t *packed, const uint8_t *scale, int cols, int c)
{
    float *x = calloc((size_t)cols, sizeof *x);
    x[c] = 1.0f;
    float y = NAN;
    shoal_gemm_mxfp4(&y, packed, scale, x, 1, cols, 1);
    free(x);
    return y;
}

static void mxfp4_spec_one_isa(void)
{
    uint8_t packed[16] = {0}, scale[1] = {124};
    /* SPEC §4.2 example: byte 0x2B -> element 2j = 0xB = -1.5, 2j+1 = 0x2 = +1.0;
     * with scale byte 124 (2^-3): -0.1875 and 0.125. Put it at byte j = 5. */
    packed[5] = 0x2B;
    CHECK(mxfp4_probe(packed, scale, 32, 10) == -0.1875f);
    CHECK(mxfp4_probe(packed, scale, 32, 11) == 0.125f);
    CHECK(mxfp4_probe(packed, scale, 32, 0) == 0.0f);
    /* every code, both nibbles, a spread of ordinary scales */
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    int escales[] = {1, 3, 26, 100, 127, 128, 140, 200, 254};
    for (size_t si = 0; si < sizeof escales / sizeof escales[0]; si++) {
        int e = escales[si];
        scale[0] = (uint8_t)e;
        for (unsigned code = 0; code < 16; code++) {
            memset(packed, 0, sizeof packed);
            packed[7] = (uint8_t)(code | ((15 - code) << 4));
            double lo = ldexp((code & 8) ? -mag[code & 7] : mag[code & 7], e - 127);
            unsigned c2 = 15 - code;
            double hi = ldexp((c2 & 8) ? -mag[c2 & 7] : mag[c2 & 7], e - 127);
            float ylo = mxfp4_probe(packed, scale, 32, 14), yhi = mxfp4_probe(packed, scale, 32, 15);
            CHECK_MSG(ylo == (float)lo, "code %u e %d: %g vs %g", code, e, ylo, lo);
            CHECK_MSG(yhi == (float)hi, "code %u e %d: %g vs %g", c2, e, yhi, hi);
        }
    }
    /* E8M0 edge codes (README "E8M0 edge codes"): e = 0 is 2^-127 (a
     * subnormal fp32, exact); e = 255 is NaN (OCP MX), whatever the element. */
    memset(packed, 0, sizeof packed);
    packed[0] = 0x72; /* element 0 = 1.0, element 1 = 6.0 */
    scale[0] = 0;
    CHECK(mxfp4_probe(packed, scale, 32, 0) == 0x1p-127f);
    CHECK(mxfp4_probe(packed, scale, 32, 1) == 6.0f * 0x1p-127f);
    scale[0] = 2;
    CHECK(mxfp4_probe(packed, scale, 32, 1) == 6.0f * 0x1p-125f);
    scale[0] = 255;
    CHECK(isnan(mxfp4_probe(packed, scale, 32, 0)));
    CHECK(isnan(mxfp4_probe(packed, scale, 32, 5))); /* a zero element of a NaN-scaled group */
    /* e = 0 in a larger dot product: sum of 1.0 * 2^-127 * x over a group */
    {
        uint8_t p2[32], s2[2] = {0, 127};
        memset(p2, 0x22, sizeof p2); /* every element 1.0 */
        float x[64];
        for (int i = 0; i < 64; i++)
            x[i] = i < 32 ? 1.0f : 0.0f;
        float y;
        shoal_gemm_mxfp4(&y, p2, s2, x, 1, 64, 1);
        CHECK(y == 32.0f * 0x1p-127f);
    }
}

static void for_each_isa(void (*fn)(void), const char *what)
{
    shoal_isa keep = shoal_kernels_isa();
    for (int i = 0; i < nisas; i++) {
        shoal_kernels_set_isa((shoal_isa)isas[i]);
        int before = test_case_failed;
        fn();
        if (test_case_failed && !before)
            fprintf(stderr, "  (%s failed with ISA %s)\n", what, shoal_isa_name((shoal_isa)isas[i]));
    }
    shoal_kernels_set_isa(keep);
}

static void t_mxfp4_decode(void)
{
    for_each_isa(mxfp4_spec_one_isa, "mxfp4 decode");
}

/* ---- matrix kernels against double precision ------------------------------ */

typedef enum { K_BF16, K_F32, K_MXFP4 } mkind;

typedef struct {
    mkind kind;
    int rows, cols;
    uint16_t *wb;
    float *wf;
    uint8_t *packed, *scale;
} mat;

static mat mat_new(mkind kind, int rows, int cols)
{
    mat m = {.kind = kind, .rows = rows, .cols = cols};
    size_t n = (size_t)rows * cols;
    if (kind == K_BF16)
        m.wb = bf16_vec(n);
    else if (kind == K_F32)
        m.wf = frand_vec(n, -1.0f, 1.0f);
    else {
        m.packed = byte_vec(n / 2, 0, 255);
        m.scale = byte_vec(n / 32, 118, 130);
    }
    return m;
}
static void mat_free(mat *m)
{
    free(m->wb);
    free(m->wf);
    free(m->packed);
    free(m->scale);
}
static double mat_w(const mat *m, int r, int c)
{
    switch (m->kind) {
    case K_BF16:
        return shoal_bf16_to_f32(m->wb[(size_t)r * m->cols + c]);
    case K_F32:
        return m->wf[(size_t)r * m->cols + c];
    default:
        return mxfp4_weight(m->packed, m->scale, m->cols, r, c);
    }
}
static void mat_gemm(const mat *m, float *y, const float *x, int T)
{
    switch (m->kind) {
    case K_BF16:
        shoal_gemm_bf16(y, m->wb, x, m->rows, m->cols, T);
        break;
    case K_F32:
        shoal_gemm_f32(y, m->wf, x, m->rows, m->cols, T);
        break;
    default:
        shoal_gemm_mxfp4(y, m->packed, m->scale, x, m->rows, m->cols, T);
        break;
    }
}

static const char *kind_name[] = {"bf16", "f32", "mxfp4"};

/* shapes: rows arbitrary, cols multiples of 32 incl. odd numbers of groups */
static const int shape_rows[] = {1, 3, 4, 5, 17, 33};
static const int shape_cols[] = {32, 64, 96, 160, 544};
static const int shape_T[] = {1, 2, 3, 5, 9};

static void gemm_vs_double_one_isa(void)
{
    for (int k = 0; k < 3; k++)
        for (size_t ri = 0; ri < sizeof shape_rows / sizeof *shape_rows; ri++)
            for (size_t ci = 0; ci < sizeof shape_cols / sizeof *shape_cols; ci++) {
                int rows = shape_rows[ri], cols = shape_cols[ci], T = shape_T[(ri + ci) % 5];
                mat m = mat_new((mkind)k, rows, cols);
                float *x = frand_vec((size_t)T * cols, -2.0f, 2.0f);
                float *y = xmalloc((size_t)T * rows * sizeof *y);
                mat_gemm(&m, y, x, T);
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < rows; r++) {
                        double ref = 0, abs_sum = 0;
                        for (int c = 0; c < cols; c++) {
                            double p = mat_w(&m, r, c) * x[(size_t)t * cols + c];
                            ref += p;
                            abs_sum += fabs(p);
                        }
                        double got = y[(size_t)t * rows + r];
                        CHECK_MSG(fabs(got - ref) <= dot_tol(cols, abs_sum), "%s %dx%d T=%d t=%d r=%d: %.9g vs %.9g",
                                  kind_name[k], rows, cols, T, t, r, got, ref);
                    }
                free(x);
                free(y);
                mat_free(&m);
            }
}

static void t_gemm_vs_double(void)
{
    for_each_isa(gemm_vs_double_one_isa, "gemm vs double");
}

static void t_gemv_t_vs_double(void)
{
    shoal_isa keep = shoal_kernels_isa();
    for (int ii = 0; ii < nisas; ii++) {
        shoal_kernels_set_isa((shoal_isa)isas[ii]);
        int shapes[][2] = {{1, 32}, {7, 64}, {64, 96}, {130, 512}, {3, 1056}};
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            int rows = shapes[s][0], cols = shapes[s][1];
            uint16_t *wb = bf16_vec((size_t)rows * cols);
            float *wf = frand_vec((size_t)rows * cols, -1, 1), *x = frand_vec((size_t)rows, -2, 2);
            float *yb = xmalloc((size_t)cols * 4), *yf = xmalloc((size_t)cols * 4);
            shoal_gemv_t_bf16(yb, wb, x, rows, cols);
            shoal_gemv_t_f32(yf, wf, x, rows, cols);
            for (int c = 0; c < cols; c++) {
                double rb = 0, rf = 0, ab = 0, af = 0;
                for (int r = 0; r < rows; r++) {
                    double pb = (double)shoal_bf16_to_f32(wb[(size_t)r * cols + c]) * x[r];
                    double pf = (double)wf[(size_t)r * cols + c] * x[r];
                    rb += pb, ab += fabs(pb), rf += pf, af += fabs(pf);
                }
                double tb = 2.0 * (rows + 1) * 0x1p-24 * ab + 1e-30, tf = 2.0 * (rows + 1) * 0x1p-24 * af + 1e-30;
                CHECK_MSG(fabs(yb[c] - rb) <= tb, "bf16 %dx%d c=%d", rows, cols, c);
                CHECK_MSG(fabs(yf[c] - rf) <= tf, "f32 %dx%d c=%d", rows, cols, c);
            }
            free(wb), free(wf), free(x), free(yb), free(yf);
        }
    }
    shoal_kernels_set_isa(keep);
}

/* ---- determinism ----------------------------------------------------------- */

/* Every ISA the CPU has equals the scalar specification bit for bit. */
static void t_isa_bit_identical(void)
{
    if (nisas < 2)
        SKIP("only the scalar variant runs on this CPU");
    shoal_isa keep = shoal_kernels_isa();
    int rows_list[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 67};
    int cols_list[] = {32, 64, 96, 128, 160, 224, 544, 1056, 8224};
    int T_list[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17};
    int n = 0;
    for (int k = 0; k < 3; k++)
        for (size_t ri = 0; ri < sizeof rows_list / sizeof *rows_list; ri++)
            for (size_t ci = 0; ci < sizeof cols_list / sizeof *cols_list; ci++) {
                int rows = rows_list[ri], cols = cols_list[ci];
                int T = T_list[(ri * 3 + ci) % 10];
                mat m = mat_new((mkind)k, rows, cols);
                float *x = frand_vec((size_t)T * cols, -3.0f, 3.0f);
                /* some exact zeros, wide magnitudes and signed zeros in x */
                for (size_t i = 0; i < (size_t)T * cols; i += 7)
                    x[i] = (i % 3) ? 0.0f : -0.0f;
                for (size_t i = 3; i < (size_t)T * cols; i += 11)
                    x[i] *= 1e-20f;
                if (k == K_MXFP4) /* rare E8M0 codes: 0..2 two-step path, 255 NaN */
                    for (size_t g = 0; g < (size_t)rows * cols / 32; g += 5)
                        m.scale[g] = (uint8_t)(g % 4 == 0 ? 0 : g % 4 == 1 ? 2 : g % 4 == 2 ? 254 : 130);
                size_t ny = (size_t)T * rows;
                float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
                shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
                mat_gemm(&m, ref, x, T);
                for (int i = 1; i < nisas; i++) {
                    shoal_kernels_set_isa((shoal_isa)isas[i]);
                    memset(got, 0x5a, ny * 4);
                    mat_gemm(&m, got, x, T);
                    CHECK_MSG(!memcmp(ref, got, ny * 4), "%s %s %dx%d T=%d differs from scalar", kind_name[k],
                              shoal_isa_name((shoal_isa)isas[i]), rows, cols, T);
                    n++;
                }
                free(ref), free(got), free(x);
                mat_free(&m);
            }
    /* gemv_t */
    for (int s = 0; s < 4; s++) {
        int rows = 1 + s * 37, cols = 32 * (1 + s * 5);
        uint16_t *wb = bf16_vec((size_t)rows * cols);
        float *wf = frand_vec((size_t)rows * cols, -1, 1), *x = frand_vec((size_t)rows, -2, 2);
        float *r1 = xmalloc((size_t)cols * 4), *r2 = xmalloc((size_t)cols * 4), *g1 = xmalloc((size_t)cols * 4),
              *g2 = xmalloc((size_t)cols * 4);
        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
        shoal_gemv_t_bf16(r1, wb, x, rows, cols);
        shoal_gemv_t_f32(r2, wf, x, rows, cols);
        for (int i = 1; i < nisas; i++) {
            shoal_kernels_set_isa((shoal_isa)isas[i]);
            shoal_gemv_t_bf16(g1, wb, x, rows, cols);
            shoal_gemv_t_f32(g2, wf, x, rows, cols);
            CHECK(!memcmp(r1, g1, (size_t)cols * 4));
            CHECK(!memcmp(r2, g2, (size_t)cols * 4));
        }
        free(wb), free(wf), free(x), free(r1), free(r2), free(g1), free(g2);
    }
    /* MLA attention (H = 13: head blocks with a remainder) */
    {
        int S = 37, H = 13, R = 64, P = 32;
        float *cache = frand_vec((size_t)S * (R + P), -1, 1), *ql = frand_vec((size_t)H * R, -1, 1);
        float *qp = frand_vec((size_t)H * P, -1, 1), *c0 = xmalloc((size_t)H * R * 4), *c1 = xmalloc((size_t)H * R * 4);
        float *scr = xmalloc((size_t)H * S * 4);
        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
        shoal_mla_attend(c0, ql, qp, cache, S, H, R, P, 0.07f, scr);
        for (int i = 1; i < nisas; i++) {
            shoal_kernels_set_isa((shoal_isa)isas[i]);
            shoal_mla_attend(c1, ql, qp, cache, S, H, R, P, 0.07f, scr);
            CHECK_MSG(!memcmp(c0, c1, (size_t)H * R * 4), "mla %s differs from scalar", shoal_isa_name((shoal_isa)isas[i]));
        }
        free(cache), free(ql), free(qp), free(c0), free(c1), free(scr);
    }
    shoal_kernels_set_isa(keep);
    CHECK(n > 0);
    for (int i = 0; i <= SHOAL_ISA_AVX512; i++)
        if (!shoal_kernels_cpu_has((shoal_isa)i))
            printf("  note: ISA %s not on this CPU: its bit-identity is not checked here (see t_isa_avx512)\n",
                   shoal_isa_name((shoal_isa)i));
}

/* The blocked GEMMs at large T (issue 33): several token tiles, column blocks
 * with a remainder, row blocks with leftover rows, 1 and 3 threads; every ISA
 * equals the scalar specification bit for bit. */
static void t_isa_large_T(void)
{
    if (nisas < 2)
        SKIP("only the scalar variant runs on this CPU");
    static const int cases[][3] = {/* rows, cols, T */ {70, 1056, 130}, {37, 2080, 64}, {129, 544, 25},
                                   {5, 8224, 13},   {3, 9248, 7},     {66, 4128, 29},
                                   /* the AVX-512 bf16/f32 token and row blocks (gemm_blocks): with a
                                    * 1 MiB L2, 12 tokens and 12 (bf16) / 4 (f32) rows per block, so
                                    * 41 tokens leave a block of 5 (one 4-token tile and one single)
                                    * and 70 rows leave a short row block and 2 single rows */
                                   {70, 9248, 41}};
    shoal_isa keep = shoal_kernels_isa();
    int n = 0;
    for (int k = 0; k < 3; k++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            int rows = cases[c][0], cols = cases[c][1], T = cases[c][2];
            mat m = mat_new((mkind)k, rows, cols);
            float *x = frand_vec((size_t)T * cols, -2.0f, 2.0f);
            for (size_t i = 5; i < (size_t)T * cols; i += 13)
                x[i] = -0.0f;
            size_t ny = (size_t)T * rows;
            float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
            shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
            mat_gemm(&m, ref, x, T);
            for (int i = 1; i < nisas; i++)
                for (int th = 1; th <= 3; th += 2) {
                    omp_set_num_threads(th);
                    shoal_kernels_set_isa((shoal_isa)isas[i]);
                    memset(got, 0x5a, ny * 4);
                    mat_gemm(&m, got, x, T);
                    CHECK_MSG(!memcmp(ref, got, ny * 4), "%s %s %dx%d T=%d threads=%d differs from scalar",
                              kind_name[k], shoal_isa_name((shoal_isa)isas[i]), rows, cols, T, th);
                    n++;
                }
            omp_set_num_threads(2);
            free(ref), free(got), free(x);
            mat_free(&m);
        }
    shoal_kernels_set_isa(keep);
    CHECK(n > 0);
}

/* shoal bench peak's loops report the multiply-adds they did: n iterations of
 * 12 chains of 16 (zmm) or 8 (ymm) fp32 lanes, 32 bf16 pairs, 64 int8 quads. */
/* The AVX-512 MXFP4 decodes of the portable class (kernels/README.md, "MXFP4
 * (AVX-512)"): the shift decode keeps its lanes in a transposed order (lane p
 * of the zmm is canonical lane 4(p & 3) + (p >> 2)) and puts them back before
 * the reduction; vpmovzx keeps the canonical order. Both must equal the scalar
 * specification bit for bit (memcmp, NaN payloads included): every code at
 * every byte position alone (the lane map), the E8M0 edge codes 0, 1, 2, 127,
 * 253, 254, 255 in groups of their own rows, signed zeros and subnormal
 * products, rows not a multiple of the 4-row tile, columns over several column
 * blocks with a tail block, T 1..9. */
static int first_mismatch(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof *a))
            return (int)i;
    return -1;
}

static void t_mx_decodes(void)
{
    if (!shoal_kernels_cpu_has(SHOAL_ISA_AVX512))
        SKIP("CPU lacks AVX-512F/BW/VL/DQ: the AVX-512 MXFP4 decodes not run (tests/e2e/test_kernels_avx512_emul.sh "
             "checks their lane logic)");
    shoal_isa keep = shoal_kernels_isa();
    shoal_mx_decode keepd = shoal_kernels_mx_decode();
    CHECK(shoal_kernels_set_mx_decode((shoal_mx_decode)7) == SHOAL_EINVAL);
    /* the default: vpmovzx on every CPU until shift is timed on an Intel one (kernels.c) */
    if (!getenv("SHOAL_MX_DECODE"))
        CHECK_MSG(keepd == SHOAL_MX_DECODE_VPMOVZX, "default decode %s", shoal_mx_decode_name(keepd));
    static const shoal_mx_decode decs[] = {SHOAL_MX_DECODE_SHIFT, SHOAL_MX_DECODE_VPMOVZX};
    /* 1. the lane map: one code at one byte position of the second group, x one-hot */
    {
        uint8_t packed[32], scale[2] = {127, 126};
        float x[64], ref, got;
        for (int d = 0; d < 2; d++)
            for (int j = 0; j < 16; j++)
                for (unsigned code = 0; code < 16; code++)
                    for (int hi = 0; hi < 2; hi++) {
                        memset(packed, 0x77, 16); /* group 0: 6.0 everywhere, x zero there */
                        memset(packed + 16, 0, 16);
                        packed[16 + j] = (uint8_t)(hi ? (code << 4) | ((code + 5) & 15) : code | (((code + 3) & 15) << 4));
                        memset(x, 0, sizeof x);
                        x[32 + 2 * j + hi] = 1.5f;
                        x[32 + 2 * ((j + 1) & 15)] = 0x1p-20f; /* a neighbour lane: a swapped lane shows */
                        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
                        shoal_gemm_mxfp4(&ref, packed, scale, x, 1, 64, 1);
                        shoal_kernels_set_isa(SHOAL_ISA_AVX512);
                        shoal_kernels_set_mx_decode(decs[d]);
                        got = NAN;
                        shoal_gemm_mxfp4(&got, packed, scale, x, 1, 64, 1);
                        CHECK_MSG(!memcmp(&ref, &got, 4), "decode %s: code %u at byte %d %s nibble: %a, spec %a",
                                  shoal_mx_decode_name(decs[d]), code, j, hi ? "high" : "low", got, ref);
                    }
    }
    /* 2. random matrices with edge scales, every shape class */
    static const int rows_list[] = {1, 3, 4, 5, 7, 9, 16, 19};
    static const int cols_list[] = {32, 64, 96, 544, 2080, 8224};
    static const uint8_t edge[] = {0, 1, 2, 127, 253, 254, 255};
    int n = 0;
    for (size_t ri = 0; ri < sizeof rows_list / sizeof *rows_list; ri++)
        for (size_t ci = 0; ci < sizeof cols_list / sizeof *cols_list; ci++) {
            int rows = rows_list[ri], cols = cols_list[ci], T = 1 + (int)((ri * 5 + ci * 3) % 9);
            int ng = cols / 32;
            uint8_t *packed = byte_vec((size_t)rows * cols / 2, 0, 255);
            uint8_t *scale = byte_vec((size_t)rows * ng, 110, 135);
            /* row r % 8 == k < 7 carries edge code edge[k] in every third group; rows 7 mod 8 stay ordinary */
            for (int r = 0; r < rows; r++)
                if (r % 8 < 7)
                    for (int g = r % 3; g < ng; g += 3)
                        scale[(size_t)r * ng + g] = edge[r % 8];
            float *x = frand_vec((size_t)T * cols, -3.0f, 3.0f);
            for (size_t i = 0; i < (size_t)T * cols; i += 7)
                x[i] = (i % 3) ? 0.0f : -0.0f; /* signed zeros */
            for (size_t i = 3; i < (size_t)T * cols; i += 11)
                x[i] *= 0x1p-100f; /* with codes 0..2: products far below 2^-126 */
            for (size_t i = 5; i < (size_t)T * cols; i += 13)
                x[i] *= 0x1p40f; /* wide magnitudes: a changed order changes the rounding */
            size_t ny = (size_t)T * rows;
            float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
            shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
            shoal_gemm_mxfp4(ref, packed, scale, x, rows, cols, T);
            shoal_kernels_set_isa(SHOAL_ISA_AVX512);
            for (int d = 0; d < 2; d++) {
                shoal_kernels_set_mx_decode(decs[d]);
                memset(got, 0x5a, ny * 4);
                shoal_gemm_mxfp4(got, packed, scale, x, rows, cols, T);
                int bad = first_mismatch(ref, got, ny);
                CHECK_MSG(bad < 0, "decode %s %dx%d T=%d: output %d (t=%d r=%d) %a, spec %a",
                          shoal_mx_decode_name(decs[d]), rows, cols, T, bad, bad < 0 ? 0 : bad / rows,
                          bad < 0 ? 0 : bad % rows, bad < 0 ? 0.0 : got[bad], bad < 0 ? 0.0 : ref[bad]);
                n++;
            }
            free(ref), free(got), free(x), free(packed), free(scale);
        }
    CHECK(n == 2 * 8 * 6);
    shoal_kernels_set_mx_decode(keepd);
    shoal_kernels_set_isa(keep);
}

static void t_peak_counts(void)
{
    const char *what;
    double f = shoal_kernels_peak(SHOAL_PEAK_FMA_F32, 10, &what);
    if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512) && shoal_kernels_isa() != SHOAL_ISA_AVX2)
        CHECK_MSG(f == 10.0 * 12 * 16 && !strcmp(what, "vfmadd231ps zmm"), "fma %g %s", f, what);
    else if (shoal_kernels_cpu_has(SHOAL_ISA_AVX2))
        CHECK_MSG(f == 10.0 * 12 * 8 && !strcmp(what, "vfmadd231ps ymm"), "fma %g %s", f, what);
    /* with the AVX2 kernels active (SHOAL_ISA=avx2 playing an AVX2 CPU on a wider
     * core) the fp32 peak is the ymm loop's: the one those kernels are bound by */
    shoal_isa keep = shoal_kernels_isa();
    if (shoal_kernels_set_isa(SHOAL_ISA_AVX2) == 0) {
        f = shoal_kernels_peak(SHOAL_PEAK_FMA_F32, 10, &what);
        CHECK_MSG(f == 10.0 * 12 * 8 && !strcmp(what, "vfmadd231ps ymm"), "fma under avx2 %g %s", f, what);
        shoal_kernels_set_isa(keep);
    }
    double b = shoal_kernels_peak(SHOAL_PEAK_BF16_DOT, 10, &what);
    CHECK(b == 0 || b == 10.0 * 12 * 32);
    double v = shoal_kernels_peak(SHOAL_PEAK_INT8_VNNI, 10, &what);
    CHECK(v == 0 || v == 10.0 * 12 * 64);
    double a = shoal_kernels_peak(SHOAL_PEAK_AMX_BF16, 10, &what);
    CHECK(a == 0 || a == 10.0 * 4 * 16 * 16 * 32);
    if (a == 0)
        SKIP("AMX-BF16 not on this CPU: the AMX peak loop not run");
}

/* ---- matrix-unit order (issue 33) --------------------------------------------
 * An oracle written from the measured AMX model (shared/amx-probe/README.md),
 * independently of kernels/gemm_mu.c: bf16 rounding by comparing the two
 * neighbours, ftz decided by redoing a small fma scaled by 2^64 (where the
 * rounding with an unbounded exponent is the ordinary one), MXFP4 weights
 * from SPEC §4.2 in double. */
static float bitsf(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float o_daz(float v)
{
    return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v;
}

static float o_bf16(float v)
{
    if (isnan(v))
        return NAN;
    uint32_t u;
    memcpy(&u, &v, 4);
    float t = bitsf(u & 0xffff0000u), t2 = bitsf((u & 0xffff0000u) + 0x10000u);
    double dv = v, dt = t, dt2 = isinf(t2) ? copysign(0x1p128, v) : (double)t2;
    double e1 = fabs(dv - dt), e2 = fabs(dt2 - dv);
    float r = e1 < e2 ? t : e2 < e1 ? t2 : ((u >> 16) & 1) ? t2 : t;
    return o_daz(r);
}

static float o_fma(float a, float b, float c)
{
    float r = fmaf(a, b, c);
    if (isnan(r) || isinf(r) || fabsf(r) > 0x1p-100f)
        return r;
    float rs = fmaf(a * 0x1p64f, b, c * 0x1p64f); /* exact scalings: |a|, |c| < 2^60 here */
    return fabsf(rs) < 0x1p-62f ? copysignf(0.0f, rs) : rs * 0x1p-64f;
}

static float o_add(float a, float b)
{
    float r = a + b;
    return fabsf(r) < 0x1p-126f ? copysignf(0.0f, r) : r;
}

static float o_mxw(unsigned code, unsigned e)
{
    if (e == 255)
        return NAN;
    double v = ldexp(e2m1_value(code), (int)e - 127);
    if (fabs(v) >= 0x1p128)
        return (float)copysign(INFINITY, v);
    return o_daz((float)v);
}

/* b[cols] weights as the unit reads them, x[cols] fp32 activations */
static float o_dot_mu(const float *b, const float *x, int cols)
{
    float C = 0.0f;
    for (int k0 = 0; k0 < cols; k0 += 32) {
        float E = 0.0f, O = 0.0f;
        for (int p = 0; p < 16; p++) {
            E = o_fma(b[k0 + 2 * p], o_bf16(x[k0 + 2 * p]), E);
            O = o_fma(b[k0 + 2 * p + 1], o_bf16(x[k0 + 2 * p + 1]), O);
        }
        C = o_add(C, o_add(E, O));
    }
    return C;
}

static int same_value(float a, float b)
{
    return (isnan(a) && isnan(b)) || !memcmp(&a, &b, 4);
}

static void mu_gemm(const mat *m, float *y, const float *x, int T)
{
    if (m->kind == K_MXFP4)
        shoal_gemm_mxfp4_mu(y, m->packed, m->scale, x, m->rows, m->cols, T);
    else
        shoal_gemm_bf16_mu(y, m->wb, x, m->rows, m->cols, T);
}

/* The scalar specification equals the oracle on typical, tiny, subnormal,
 * signed-zero and non-finite inputs (values; NaN by class). */
static void t_mu_spec(void)
{
    shoal_isa keep = shoal_kernels_isa();
    shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
    int n = 0, differ_from_fp32 = 0;
    static const int cases[][3] = {{5, 64, 3}, {17, 96, 2}, {3, 544, 1}, {9, 1056, 2}};
    for (int k = 0; k < 2; k++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            int rows = cases[c][0], cols = cases[c][1], T = cases[c][2];
            mat m = mat_new(k ? K_MXFP4 : K_BF16, rows, cols);
            float *x = frand_vec((size_t)T * cols, -2.0f, 2.0f);
            for (size_t i = 0; i < (size_t)T * cols; i += 7)
                x[i] *= (i % 3 == 0) ? 1e-39f : (i % 3 == 1) ? 0x1p-126f : 0.0f; /* subnormal, tiny band, zero */
            for (size_t i = 2; i < (size_t)T * cols; i += 29)
                x[i] = -0.0f;
            if (k == 0) /* weights of every magnitude class, some subnormal */
                for (size_t i = 0; i < (size_t)rows * cols; i += 11)
                    m.wb[i] = (uint16_t)(i % 2 ? 0x0001 + (i & 0x7f) : 0x0080 + (i & 0x7f));
            else
                for (size_t g = 0; g < (size_t)rows * cols / 32; g += 3)
                    m.scale[g] = (uint8_t)(g % 4 == 0 ? 0 : g % 4 == 1 ? 1 : g % 4 == 2 ? 254 : 127);
            if (c == 3) { /* non-finite classes in one row each */
                x[5] = INFINITY;
                if (k == 1)
                    m.scale[(size_t)1 * (cols / 32)] = 255;
            }
            float *y = xmalloc((size_t)T * rows * 4), *yf = xmalloc((size_t)T * rows * 4);
            float *b = xmalloc((size_t)cols * 4);
            mu_gemm(&m, y, x, T);
            mat_gemm(&m, yf, x, T);
            for (int r = 0; r < rows; r++) {
                for (int j = 0; j < cols; j++)
                    b[j] = k ? o_mxw(m.packed[(size_t)r * (cols / 2) + j / 2] >> (4 * (j & 1)) & 15,
                                     m.scale[(size_t)r * (cols / 32) + j / 32])
                             : o_daz(bitsf((uint32_t)m.wb[(size_t)r * cols + j] << 16));
                for (int t = 0; t < T; t++) {
                    float want = o_dot_mu(b, x + (size_t)t * cols, cols), got = y[(size_t)t * rows + r];
                    CHECK_MSG(same_value(want, got), "mu %s %dx%d T=%d r=%d t=%d: spec %a oracle %a", k ? "mxfp4" : "bf16",
                              rows, cols, T, r, t, got, want);
                    differ_from_fp32 += !same_value(got, yf[(size_t)t * rows + r]);
                    n++;
                }
            }
            free(x), free(y), free(yf), free(b);
            mat_free(&m);
        }
    /* the order matters: most outputs differ from the fp32-activation kernels */
    CHECK_MSG(differ_from_fp32 > n / 2, "only %d of %d outputs differ from the fp32 order", differ_from_fp32, n);
    shoal_kernels_set_isa(keep);
}

/* Probes that separate the candidate orders (also what an AMX self-test runs):
 * the flush threshold (an exact value just below 2^-126 that the subnormal grid
 * rounds up to 2^-126), signed zeros, and even/odd chains against one chain. */
static void mu_probe_one_isa(void)
{
    uint16_t w[3 * 32] = {0};
    float x[32] = {0}, y[3];
    /* row 0: E = 1 * 2^-126, then + (-1.5 * 2^-76) * 2^-75: exact 2^-126 - 1.5 * 2^-151, which the
     * subnormal grid rounds to 2^-126 but an unbounded exponent to 2^-126 - 2^-150: tiny, flushed */
    w[0] = 0x3f80, x[0] = 0x1p-126f;
    w[2] = 0x99c0, x[2] = 0x1p-75f;
    /* row 1: (-2^-77) * 2^-75 instead: exact 2^-126 - 2^-152 rounds to 2^-126 either way: kept */
    w[32 + 0] = 0x3f80, w[32 + 2] = 0x9900;
    /* row 2: x = 1 (column 0, even), 2^24 (3, odd), -2^24 (4, even), weights 1: E = 1 - 2^24, O = 2^24,
     * E + O = 1; one chain in column order gives (1 + 2^24) - 2^24 = 0 */
    w[64 + 0] = w[64 + 3] = w[64 + 4] = 0x3f80;
    float xr[3][32] = {{0}};
    memcpy(xr[0], x, sizeof x);
    memcpy(xr[1], x, sizeof x);
    xr[2][0] = 1.0f, xr[2][3] = 0x1p24f, xr[2][4] = -0x1p24f;
    for (int r = 0; r < 3; r++) {
        shoal_gemm_bf16_mu(&y[r], w + 32 * r, xr[r], 1, 32, 1);
    }
    CHECK_MSG(y[0] == 0.0f && !signbit(y[0]), "flush threshold: got %a, want +0", y[0]);
    CHECK_MSG(y[1] == 0x1p-126f, "kept at 2^-126: got %a", y[1]);
    CHECK_MSG(y[2] == 1.0f, "even/odd chains: got %a, want 1 (one chain gives 0)", y[2]);
    /* signed zero: (-1) * (+0) in both chains: E = -0 + ... from +0: +0 + -0 = +0 */
    uint16_t wn[32];
    float xz[32];
    for (int i = 0; i < 32; i++)
        wn[i] = 0xbf80, xz[i] = 0.0f;
    float z;
    shoal_gemm_bf16_mu(&z, wn, xz, 1, 32, 1);
    CHECK_MSG(z == 0.0f && !signbit(z), "chains start at +0: got %a", z);
}

static void t_mu_probes(void)
{
    for_each_isa(mu_probe_one_isa, "mu probes");
}

/* Every ISA equals the scalar specification (values, NaN by class) at many
 * shapes: rows not a multiple of 16, several column chunks, T up to 9, and
 * 1 or 3 threads. */
/* The first output that is not the same value (NaN by class) as the spec's, or -1. */
static int first_diff(const float *ref, const float *got, size_t n)
{
    for (size_t j = 0; j < n; j++)
        if (!same_value(ref[j], got[j]))
            return (int)j;
    return -1;
}

static void t_mu_isa(void)
{
    if (nisas < 2)
        SKIP("only the scalar variant runs on this CPU");
    static const int cases[][3] = {{1, 32, 1},   {7, 64, 1},    {16, 96, 3},   {17, 160, 2}, {33, 544, 5},
                                   {40, 1056, 1}, {5, 8224, 4}, {67, 2080, 9},  {3, 4128, 1}, {64, 7168, 1},
                                   {70, 1056, 33}, {20, 544, 150}};
    /* on an AMX machine every case also runs on the tiles at every T (the
     * engine's threshold sends small calls to the AVX-512 emulation) */
    int amx = strncmp(shoal_kernels_mu_path(), "amx", 3) == 0, min_t = shoal_kernels_set_amx_min_t(0);
    shoal_isa keep = shoal_kernels_isa();
    int n = 0;
    for (int k = 0; k < 2; k++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            int rows = cases[c][0], cols = cases[c][1], T = cases[c][2];
            mat m = mat_new(k ? K_MXFP4 : K_BF16, rows, cols);
            float *x = frand_vec((size_t)T * cols, -2.0f, 2.0f);
            for (size_t i = 0; i < (size_t)T * cols; i += 7)
                x[i] *= (i % 3 == 0) ? 1e-39f : (i % 3 == 1) ? 0x1p-120f : -0.0f;
            if (k)
                for (size_t g = 0; g < (size_t)rows * cols / 32; g += 5)
                    m.scale[g] = (uint8_t)(g % 4 == 0 ? 0 : g % 4 == 1 ? 2 : g % 4 == 2 ? 254 : 255);
            else
                for (size_t i = 0; i < (size_t)rows * cols; i += 13)
                    m.wb[i] = (uint16_t)(0x0001 + (i & 0xff)); /* subnormal and tiny weights */
            size_t ny = (size_t)T * rows;
            float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
            shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
            mu_gemm(&m, ref, x, T);
            for (int i = 1; i < nisas + amx; i++)
                for (int th = 1; th <= 3; th += 2) {
                    omp_set_num_threads(th);
                    shoal_kernels_set_isa((shoal_isa)isas[i < nisas ? i : nisas - 1]);
                    shoal_kernels_set_amx_min_t(i < nisas ? min_t : 1);
                    memset(got, 0x5a, ny * 4);
                    mu_gemm(&m, got, x, T);
                    int bad = first_diff(ref, got, ny);
                    CHECK_MSG(bad < 0, "mu %s %s%s %dx%d T=%d threads=%d: output %d %a, spec %a", k ? "mxfp4" : "bf16",
                              shoal_isa_name((shoal_isa)isas[i < nisas ? i : nisas - 1]), i < nisas ? "" : " amx", rows, cols, T, th, bad, bad < 0 ? 0 : got[bad],
                              bad < 0 ? 0 : ref[bad]);
                    n++;
                }
            omp_set_num_threads(2);
            free(ref), free(got), free(x);
            mat_free(&m);
        }
    shoal_kernels_set_amx_min_t(min_t);
    shoal_kernels_set_isa(keep);
    CHECK(n > 0);
}

/* The MXFP4 mu kernels near the scale codes where a SIMD decode may change
 * method (kernels/README.md: the AVX-512 kernel multiplies by 2^(e-127) when
 * all 16 rows of a block have 1 <= e <= 254, and looks up a per-scale table
 * otherwise): every class of block per column block and row tile, each ISA
 * against the scalar specification, values bit for bit (NaN by class).
 * Low matrices (activations in [-2, 2]): all rows e = 1 (weights 2^-127
 * flush to a signed zero, 2^-126 stays); rows cycling 1, 2, 3, 127; one row
 * e = 0 among typical rows (2^-127 is subnormal: a multiply by it would lose
 * the weights 2^-126 .. 1.5 * 2^-125); one row e = 255 (NaN); typical. High
 * matrices (activations near 2^-110, so sums stay finite): rows cycling 253,
 * 254, typical, 1 and all rows 254, with |E2M1| <= 1.5 (1.5 * 2^127 is the
 * largest finite weight) except in one row per tile (2^128 and above:
 * infinity); typical. Shapes: one block per row (the block alone is the
 * output, so weights near 2^-126 are visible), row tails, block counts not a
 * multiple of 16, several column chunks, T = 1..5. */
static void t_mu_mx_scales(void)
{
    if (nisas < 2)
        SKIP("only the scalar variant runs on this CPU");
    static const int cases[][4] = {{96, 32, 1, 0},   {96, 32, 2, 1},    {48, 64, 1, 0},  {37, 672, 3, 0},
                                   {37, 672, 2, 1},  {32, 4128, 3, 0},  {16, 544, 5, 1}, {64, 7168, 4, 0},
                                   {80, 1056, 1, 1}, {160, 1056, 1, 0}};
    shoal_isa keep = shoal_kernels_isa();
    int n = 0, finite = 0, tiny = 0;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int rows = cases[c][0], cols = cases[c][1], T = cases[c][2], high = cases[c][3], nb = cols / 32;
        mat m = mat_new(K_MXFP4, rows, cols);
        float *x = frand_vec((size_t)T * cols, -2.0f, 2.0f);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++) {
                int i = r % 16, cls = (b + r / 16) % (high ? 3 : 5);
                uint8_t *e = &m.scale[(size_t)r * nb + b], *p = &m.packed[(size_t)r * (cols / 2) + 16 * b];
                if (high && cls == 0)
                    *e = (uint8_t)(i % 4 == 0 ? 253 : i % 4 == 1 ? 254 : i % 4 == 2 ? *e : 1);
                else if (high && cls == 1)
                    *e = 254;
                else if (!high && cls == 0)
                    *e = 1;
                else if (!high && cls == 1)
                    *e = (uint8_t)(i % 4 == 0 ? 1 : i % 4 == 1 ? 2 : i % 4 == 2 ? 3 : 127);
                else if (!high && cls == 2 && i == b % 16)
                    *e = 0;
                else if (!high && cls == 3 && i == 7)
                    *e = 255;
                if (*e >= 253 && i != 6)
                    for (int j = 0; j < 16; j++)
                        p[j] &= 0xbb; /* |E2M1| <= 1.5 */
            }
        for (size_t j = 0; high && j < (size_t)T * cols; j++)
            x[j] *= 0x1p-110f;
        size_t ny = (size_t)T * rows;
        float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
        mu_gemm(&m, ref, x, T);
        for (size_t j = 0; j < ny; j++) {
            finite += isfinite(ref[j]) != 0;
            tiny += ref[j] != 0.0f && fabsf(ref[j]) < 0x1p-120f;
        }
        for (int i = 1; i < nisas; i++) {
            shoal_kernels_set_isa((shoal_isa)isas[i]);
            memset(got, 0x5a, ny * 4);
            mu_gemm(&m, got, x, T);
            int bad = first_diff(ref, got, ny);
            CHECK_MSG(bad < 0, "mu mxfp4 scales %s %dx%d T=%d %s: output %d %a, spec %a",
                      shoal_isa_name((shoal_isa)isas[i]), rows, cols, T, high ? "high" : "low", bad,
                      bad < 0 ? 0 : got[bad], bad < 0 ? 0 : ref[bad]);
            n++;
        }
        free(ref), free(got), free(x);
        mat_free(&m);
    }
    shoal_kernels_set_isa(keep);
    /* the inputs did what they were built for: most outputs finite, some tiny */
    CHECK_MSG(n > 0 && finite > 0 && tiny > 0, "n %d finite %d tiny %d", n, finite, tiny);
}

/* The fold path of the MXFP4 mu kernels (kernels/README.md, "Matrix-unit
 * order": a block's scale leaves its chains when its activations' exponents
 * and its rows' scale codes are inside bounds; otherwise the table path),
 * near and across those bounds, each ISA against the scalar specification,
 * bit for bit (NaN by class). One regime per matrix; in each column block
 * every activation has one exponent field F (the block's least and
 * greatest), different per block, and row r's scale code lies d from the
 * block's exact bound, d = D + (r % 3) - 1 with D one of -12, -2, 0, 2, 12 per
 * 16-row tile (a kernel folds a tile's block only when all 16 rows may: D =
 * -2 tiles fold right at the bound, D = 0 tiles straddle it):
 *   low:   F 20..125, e = 136 - F + d (at least 1: codes below AVX2's 26
 *          too): for d < 0 products and partial sums
 *          below 2^-126 that the specification flushes one by one;
 *   high:  F 200..243 (block 2: 251, block 3: 246, past the AVX-512 fold's
 *          limit on the greatest field), e = 372 - F + d, in odd blocks columns k and k + 2
 *          of equal code and opposite activation: for d > 0 products of
 *          2^128 and more, infinities (and inf - inf) in the specification
 *          where the folded chain cancels;
 *   mixed: typical blocks (|a| in [0.5, 2), e 110..140), one with a single
 *          activation of exponent field 9 (tiny) and one of 245 (huge).
 * Shapes: T = 1 (four blocks at a time on AVX-512) and 2, 3 (one), block
 * counts that leave single blocks after the fours, row tails. A kernel that
 * folded every block with 2 <= e <= 252, whatever its activations, fails
 * this test (checked by mutation, docs/PERFORMANCE.md). */
static int fold_d(int r, int c)
{
    static const int D[5] = {-12, -2, 0, 2, 12};
    return D[(r / 16 + c) % 5] + r % 3 - 1;
}

static void t_mu_mx_fold(void)
{
    if (nisas < 2)
        SKIP("only the scalar variant runs on this CPU");
    static const int cases[][4] = {{37, 160, 1, 0}, {64, 256, 2, 0}, {48, 672, 3, 0}, {37, 160, 1, 1},
                                   {64, 256, 3, 1}, {48, 672, 1, 1}, {37, 288, 1, 2}, {64, 672, 2, 2},
                                   {80, 1056, 1, 2}};
    shoal_isa keep = shoal_kernels_isa();
    int n = 0, zero_low = 0, nonzero_low = 0, nonfinite_high = 0, finite_high = 0;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int rows = cases[c][0], cols = cases[c][1], T = cases[c][2], reg = cases[c][3], nb = cols / 32;
        mat m = mat_new(K_MXFP4, rows, cols);
        float *x = xmalloc((size_t)T * cols * 4);
        for (int b = 0; b < nb; b++) {
            int F = reg == 0 ? 20 + (int)(rnd() % 106) : reg != 1 ? 127 : b == 2 ? 251 : b == 3 ? 246 : 200 + (int)(rnd() % 44);
            for (int t = 0; t < T; t++)
                for (int k = 32 * b; k < 32 * b + 32; k++) {
                    /* (1 + i/128) 2^(F-127): a bf16 value, its own rounding */
                    float v = ldexpf(1.0f + (float)(rnd() % 128) / 128.0f, F - 127 - (reg == 2 && rnd() % 2));
                    x[(size_t)t * cols + k] = rnd() % 2 ? v : -v;
                    if (reg == 1 && b % 2 && k % 4 >= 2)
                        x[(size_t)t * cols + k] = -x[(size_t)t * cols + k - 2];
                }
            if (reg == 2 && b == 1)
                x[32 * b + 5] = ldexpf(1.25f, 9 - 127);
            if (reg == 2 && b == 4)
                x[(size_t)(T - 1) * cols + 32 * b + 30] = -ldexpf(1.5f, 245 - 127);
            for (int r = 0; r < rows; r++) {
                int d = fold_d(r, (int)c), e = reg == 0 ? 136 - F + d : reg == 1 ? 372 - F + d : 110 + (int)(rnd() % 31);
                m.scale[(size_t)r * nb + b] = (uint8_t)(e < 1 ? 1 : e > 254 ? 254 : e);
                if (reg == 1 && b % 2) /* bytes 2i + 1 repeat bytes 2i: columns k and k + 2 share a code */
                    for (int j = 1; j < 16; j += 2)
                        m.packed[(size_t)r * (cols / 2) + 16 * b + j] = m.packed[(size_t)r * (cols / 2) + 16 * b + j - 1];
            }
        }
        size_t ny = (size_t)T * rows;
        float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
        mu_gemm(&m, ref, x, T);
        for (size_t j = 0; j < ny; j++) {
            int d = fold_d((int)(j % (size_t)rows), (int)c);
            if (reg == 0 && d < -8)
                zero_low += ref[j] == 0.0f;
            if (reg == 0 && d > 0)
                nonzero_low += ref[j] != 0.0f;
            if (reg == 1 && d > 8)
                nonfinite_high += !isfinite(ref[j]);
            if (reg == 1 && d < 0)
                finite_high += isfinite(ref[j]) != 0;
        }
        /* and with the fold path off (SHOAL_MU_FOLD=off: the table path for every block), the same bits */
        for (int i = 1; i < 2 * nisas - 1; i++) {
            shoal_kernels_set_isa((shoal_isa)isas[(i - 1) % (nisas - 1) + 1]);
            shoal_kernels_set_mu_fold(i < nisas);
            memset(got, 0x5a, ny * 4);
            mu_gemm(&m, got, x, T);
            int bad = first_diff(ref, got, ny);
            CHECK_MSG(bad < 0, "mu mxfp4 fold %s (fold %s) %dx%d T=%d regime %d: output %d (row %d) %a, spec %a",
                      shoal_isa_name(shoal_kernels_isa()), i < nisas ? "on" : "off", rows, cols, T, reg, bad,
                      bad < 0 ? 0 : bad % rows, bad < 0 ? 0 : got[bad], bad < 0 ? 0 : ref[bad]);
            n++;
        }
        shoal_kernels_set_mu_fold(1);
        free(ref), free(got), free(x);
        mat_free(&m);
    }
    shoal_kernels_set_isa(keep);
    /* the inputs did what they were built for: flushed and kept sums, overflowed and finite ones */
    CHECK_MSG(n > 0 && zero_low > 0 && nonzero_low > 0 && nonfinite_high > 0 && finite_high > 0,
              "n %d zero_low %d nonzero_low %d nonfinite_high %d finite_high %d", n, zero_low, nonzero_low,
              nonfinite_high, finite_high);
}

/* The wire form of the mu class (PROTOCOL.md 1.7): shoal_mu_round_bf16 gives
 * the oracle's bf16 value for every input class (typical, halfway cases, the
 * band that rounds up to 2^-126, subnormal, signed zero, infinities; NaN stays
 * a NaN), and a mu product of the widened bf16 row has exactly the bits of the
 * product of the f32 row, on every ISA, bf16 and MXFP4 weights: the receiver
 * of bf16 activations computes what it would have from f32 ones. */
static void mu_wire_one_isa(void)
{
    static const int cases[][3] = {{5, 64, 3}, {33, 544, 2}, {16, 7168, 1}};
    for (int k = 0; k < 2; k++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            int rows = cases[c][0], cols = cases[c][1], T = cases[c][2];
            size_t nx = (size_t)T * cols, ny = (size_t)T * rows;
            mat m = mat_new(k ? K_MXFP4 : K_BF16, rows, cols);
            float *x = frand_vec(nx, -3.0f, 3.0f), *xw = xmalloc(nx * 4);
            uint16_t *h = xmalloc(nx * 2);
            for (size_t i = 0; i < nx; i += 5) { /* the classes, spread over every chain position */
                uint32_t u;
                memcpy(&u, &x[i], 4);
                switch ((i / 5) % 9) {
                case 0: u = (u & 0xffff0000u) | 0x8000u; break;          /* halfway, ties to even */
                case 1: u = (u & 0xffff0000u) | 0x7fffu; break;          /* just below halfway */
                case 2: u = 0x007fffffu | (u & 0x80000000u); break;      /* largest subnormal: rounds to 2^-126 */
                case 3: u = 0x00000001u | (u & 0x80000000u); break;      /* smallest subnormal */
                case 4: u = 0x80000000u; break;                          /* -0 */
                case 5: u = (u & 0x807f0000u) | 0x00008000u; break;      /* subnormal halfway */
                case 6: u = 0x7f7fffffu | (u & 0x80000000u); break;      /* rounds to infinity */
                case 7: u = i % 2 ? 0x7f800000u : 0xff800000u; break;    /* infinities */
                default: u = 0x7fc00000u | (uint32_t)(i & 0xffff); break; /* NaN with a payload */
                }
                memcpy(&x[i], &u, 4);
            }
            shoal_mu_round_bf16(h, x, nx);
            int bad = -1;
            for (size_t i = 0; i < nx; i++) {
                xw[i] = shoal_bf16_to_f32(h[i]);
                float want = o_bf16(x[i]);
                if (bad < 0 && !same_value(want, xw[i]))
                    bad = (int)i;
            }
            CHECK_MSG(bad < 0, "mu wire rounding of %a: %a, oracle %a", bad < 0 ? 0 : x[bad], bad < 0 ? 0 : xw[bad],
                      bad < 0 ? 0 : o_bf16(x[bad]));
            uint16_t *h2 = xmalloc(nx * 2);
            shoal_mu_round_bf16(h2, xw, nx);
            CHECK_MSG(!memcmp(h, h2, nx * 2), "mu wire rounding is not idempotent");
            float *y = xmalloc(ny * 4), *yw = xmalloc(ny * 4);
            memset(y, 0x11, ny * 4);
            memset(yw, 0x22, ny * 4);
            mu_gemm(&m, y, x, T);
            mu_gemm(&m, yw, xw, T);
            CHECK_MSG(!memcmp(y, yw, ny * 4), "mu %s %dx%d T=%d: the product of the bf16 wire form differs",
                      k ? "mxfp4" : "bf16", rows, cols, T);
            free(x), free(xw), free(h), free(h2), free(y), free(yw);
            mat_free(&m);
        }
}

static void t_mu_wire_round(void)
{
    for_each_isa(mu_wire_one_isa, "mu wire rounding");
}

/* The start-up self-test accepts the specification and every emulation, and
 * refuses kernels of another order: the fp32-activation GEMMs and a variant
 * that rounds to the subnormal grid before flushing (wrappers below). AMX
 * itself only where the CPU has it. */
static void gemm_bf16_as_mu(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    (void)r0, (void)r1;
    shoal_gemm_bf16(y, w, x, rows, cols, T);
}
static void gemm_mxfp4_as_mu(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows, int cols, int T,
                             int r0, int r1)
{
    (void)r0, (void)r1;
    shoal_gemm_mxfp4(y, p, s, x, rows, cols, T);
}
/* the oracle with the flush decided on the subnormal-grid result (|r| < 2^-126) */
static void bf16_mu_gridflush(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++) {
            float C = 0.0f;
            for (int k0 = 0; k0 < cols; k0 += 32) {
                float E = 0.0f, O = 0.0f;
                for (int p = 0; p < 16; p++) {
                    float e = fmaf(o_daz(bitsf((uint32_t)w[(size_t)r * cols + k0 + 2 * p] << 16)),
                                   o_bf16(x[(size_t)t * cols + k0 + 2 * p]), E);
                    float o = fmaf(o_daz(bitsf((uint32_t)w[(size_t)r * cols + k0 + 2 * p + 1] << 16)),
                                   o_bf16(x[(size_t)t * cols + k0 + 2 * p + 1]), O);
                    E = o_daz(e), O = o_daz(o);
                }
                C = o_add(C, o_add(E, O));
            }
            y[(size_t)t * rows + r] = C;
        }
}
static void mxfp4_mu_spec(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows, int cols, int T,
                          int r0, int r1)
{
    shoal_isa keep = shoal_kernels_isa();
    shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
    (void)r0, (void)r1;
    shoal_gemm_mxfp4_mu(y, p, s, x, rows, cols, T);
    shoal_kernels_set_isa(keep);
}
static void bf16_mu_active(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0, int r1)
{
    (void)r0, (void)r1;
    shoal_gemm_bf16_mu(y, w, x, rows, cols, T);
}
static void mxfp4_mu_active(float *y, const uint8_t *p, const uint8_t *s, const float *x, int rows, int cols, int T,
                            int r0, int r1)
{
    (void)r0, (void)r1;
    shoal_gemm_mxfp4_mu(y, p, s, x, rows, cols, T);
}

static void mu_selftest_one_isa(void)
{
    CHECK(shoal__kernels_mu_selftest(bf16_mu_active, mxfp4_mu_active) == 0);
}

static void t_mu_selftest(void)
{
    for_each_isa(mu_selftest_one_isa, "mu self-test");
    CHECK_MSG(shoal__kernels_mu_selftest(gemm_bf16_as_mu, gemm_mxfp4_as_mu) != 0,
              "the self-test accepted the fp32-activation kernels");
    CHECK_MSG(shoal__kernels_mu_selftest(bf16_mu_gridflush, mxfp4_mu_spec) != 0,
              "the self-test accepted a flush on the subnormal grid");
}

/* On an AMX machine the unit passed its self-test and runs the mu kernels
 * (then t_mu_isa compared it with the specification on every shape). */
static void t_mu_amx(void)
{
    shoal_isa keep = shoal_kernels_isa();
    if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512))
        shoal_kernels_set_isa(SHOAL_ISA_AVX512);
    const char *path = shoal_kernels_mu_path();
    shoal_kernels_set_isa(keep);
    if (!strstr(path, "amx"))
        SKIP("AMX-BF16 not on this CPU (or not usable): the AMX kernel and its self-test not run (mu path: %s)",
             path);
    CHECK_MSG(!strncmp(path, "amx", 3) && !strstr(path, "failed"), "AMX present, mu path: %s", path);
}

/* The AMX GEMM's variant names (SHOAL_AMX_VARIANT, shoal_kernels_set_amx_variant):
 * every flag combination round-trips through its name, any order and ','
 * parse, unknown names are refused; t_amx_variants_tiles: on an AMX machine each variant passes the
 * start-up self-test when selected and the mu path names it (the variants'
 * values: test_kernels_amx_emul, emulated tiles; test_kernels_amx_real). */
static void t_amx_variant_names(void)
{
    static const char *const flag[] = {"k256", "once", "pf", "pipe", "swap"};
    for (int v = 0; v <= SHOAL__AMX_ALL; v++) {
        char want[64] = "", got[64], rev[64] = "";
        for (int i = 0; i < 5; i++) /* written here from the flag list, in order and reversed */
            if (v & (1 << i)) {
                snprintf(want + strlen(want), sizeof want - strlen(want), "%s%s", *want ? "+" : "", flag[i]);
                char tmp[64];
                snprintf(tmp, sizeof tmp, "%s%s%s", flag[i], *rev ? "," : "", rev);
                memcpy(rev, tmp, sizeof rev);
            }
        CHECK_MSG(!strcmp(shoal__kernels_amx_variant_name(v, got, sizeof got), v ? want : "base"), "%d: %s", v, got);
        int back = -1;
        CHECK(shoal__kernels_amx_variant_parse(got, &back) == 0 && back == v);
        back = -1;
        CHECK_MSG(shoal__kernels_amx_variant_parse(rev, &back) == 0 && back == v, "%s", rev);
    }
    int v = -1;
    CHECK(shoal__kernels_amx_variant_parse("", &v) == 0 && v == 0);
    static const char *const bad[] = {"k512", "swap+", "Swap", "base+k2", "k256 ", "+"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK_MSG(shoal__kernels_amx_variant_parse(bad[i], &v) == SHOAL_EINVAL, "accepted '%s'", bad[i]);
    CHECK(shoal_kernels_set_amx_variant("nonsense") == SHOAL_EINVAL);
}

static void t_amx_variants_tiles(void)
{
    if (shoal_kernels_set_amx_variant("base") == SHOAL_EUNSUPPORTED) /* t_mu_amx says why */
        SKIP("AMX not in use: the variants' self-tests on the tiles not run (names checked)");
    shoal_isa keep = shoal_kernels_isa();
    shoal_kernels_set_isa(SHOAL_ISA_AVX512);
    for (int w = SHOAL__AMX_ALL; w >= 0; w--) {
        char name[64], note[80];
        shoal__kernels_amx_variant_name(w, name, sizeof name);
        CHECK_MSG(shoal_kernels_set_amx_variant(name) == 0, "variant %s failed the self-test on the tiles", name);
        snprintf(note, sizeof note, "variant %s", name);
        CHECK_MSG(w ? strstr(shoal_kernels_mu_path(), note) != NULL : !strstr(shoal_kernels_mu_path(), "variant"),
                  "%s: mu path %s", name, shoal_kernels_mu_path());
    }
    shoal_kernels_set_isa(keep);
}

/* The AVX-512 variant is compiled in but cannot run on a CPU without it. */
static void t_isa_avx512(void)
{
    if (!shoal_kernels_cpu_has(SHOAL_ISA_AVX512))
        SKIP("CPU lacks AVX-512F/BW/VL/DQ: avx512 variants not run");
    CHECK(shoal_kernels_set_isa(SHOAL_ISA_AVX512) == 0);
    shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
}

static void t_isa_avx2(void)
{
    if (!shoal_kernels_cpu_has(SHOAL_ISA_AVX2))
        SKIP("CPU lacks AVX2/FMA/F16C: avx2 variants not run");
    CHECK(shoal_kernels_set_isa(SHOAL_ISA_AVX2) == 0);
    shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
}

static void threads_one_isa(void)
{
    int nthreads[] = {1, 2, 3, 4, 7};
    for (int k = 0; k < 3; k++) {
        int rows = 261, cols = 544, T = 5; /* 17 groups: an odd count */
        mat m = mat_new((mkind)k, rows, cols);
        float *x = frand_vec((size_t)T * cols, -2, 2);
        size_t ny = (size_t)T * rows;
        float *ref = xmalloc(ny * 4), *got = xmalloc(ny * 4);
        omp_set_num_threads(1);
        mat_gemm(&m, ref, x, T);
        for (size_t i = 1; i < sizeof nthreads / sizeof *nthreads; i++) {
            omp_set_num_threads(nthreads[i]);
            mat_gemm(&m, got, x, T);
            CHECK_MSG(!memcmp(ref, got, ny * 4), "%s threads=%d", kind_name[k], nthreads[i]);
        }
        free(ref), free(got), free(x);
        mat_free(&m);
    }
    /* KDA step and MLA attention, parallel over heads */
    int H = 6, D = 32, S = 700, R = 64, P = 32; /* MLA work above the parallel threshold */
    float *S0 = frand_vec((size_t)H * D * D, -1, 1), *S1 = xmalloc((size_t)H * D * D * 4);
    float *q = frand_vec((size_t)H * D, -0.2f, 0.2f), *kk = frand_vec((size_t)H * D, -0.2f, 0.2f);
    float *v = frand_vec((size_t)H * D, -1, 1), *g = frand_vec((size_t)H * D, -2, 0), *beta = frand_vec(H, 0, 1);
    float *o1 = xmalloc((size_t)H * D * 4), *o2 = xmalloc((size_t)H * D * 4);
    float *cache = frand_vec((size_t)S * (R + P), -1, 1), *ql = frand_vec((size_t)H * R, -1, 1),
          *qp = frand_vec((size_t)H * P, -1, 1);
    float *c1 = xmalloc((size_t)H * R * 4), *c2 = xmalloc((size_t)H * R * 4), *scr = xmalloc((size_t)H * S * 4);
    memcpy(S1, S0, (size_t)H * D * D * 4);
    omp_set_num_threads(1);
    shoal_kda_step(o1, S0, q, kk, v, g, beta, H, D);
    shoal_mla_attend(c1, ql, qp, cache, S, H, R, P, 0.1f, scr);
    omp_set_num_threads(3);
    shoal_kda_step(o2, S1, q, kk, v, g, beta, H, D);
    shoal_mla_attend(c2, ql, qp, cache, S, H, R, P, 0.1f, scr);
    CHECK(!memcmp(o1, o2, (size_t)H * D * 4));
    CHECK(!memcmp(S0, S1, (size_t)H * D * D * 4));
    CHECK(!memcmp(c1, c2, (size_t)H * R * 4));
    free(S0), free(S1), free(q), free(kk), free(v), free(g), free(beta), free(o1), free(o2);
    free(cache), free(ql), free(qp), free(c1), free(c2), free(scr);
    omp_set_num_threads(2);
}

static void t_thread_invariance(void)
{
    for_each_isa(threads_one_isa, "thread invariance");
}

/* y[t] of a batch equals y of that token alone, and of the tokens in any
 * order (batch composition), bit for bit. */
static void t_invariance_one_isa(void)
{
    int T = 11;
    for (int k = 0; k < 3; k++) {
        int rows = 37, cols = 352;
        mat m = mat_new((mkind)k, rows, cols);
        float *x = frand_vec((size_t)T * cols, -2, 2);
        float *yb = xmalloc((size_t)T * rows * 4), *y1 = xmalloc((size_t)rows * 4);
        mat_gemm(&m, yb, x, T);
        for (int t = 0; t < T; t++) {
            mat_gemm(&m, y1, x + (size_t)t * cols, 1);
            CHECK_MSG(!memcmp(y1, yb + (size_t)t * rows, (size_t)rows * 4), "%s token %d", kind_name[k], t);
        }
        /* reversed batch of the first 6 tokens */
        float *xr = xmalloc((size_t)6 * cols * 4), *yr = xmalloc((size_t)6 * rows * 4);
        for (int t = 0; t < 6; t++)
            memcpy(xr + (size_t)t * cols, x + (size_t)(5 - t) * cols, (size_t)cols * 4);
        mat_gemm(&m, yr, xr, 6);
        for (int t = 0; t < 6; t++)
            CHECK(!memcmp(yr + (size_t)t * rows, yb + (size_t)(5 - t) * rows, (size_t)rows * 4));
        free(x), free(yb), free(y1), free(xr), free(yr);
        mat_free(&m);
    }
}

static void t_token_invariance(void)
{
    for_each_isa(t_invariance_one_isa, "T invariance");
}

/* ---- NaN / Inf propagation by class -------------------------------------- */

static void nan_inf_one_isa(void)
{
    int rows = 4, cols = 64;
    for (int k = 0; k < 3; k++) {
        mat m = mat_new((mkind)k, rows, cols);
        float *x = frand_vec((size_t)cols, 0.5f, 1.0f);
        float y[4];
        /* make column 9 of every row a positive nonzero weight */
        for (int r = 0; r < rows; r++) {
            if (k == K_BF16)
                m.wb[(size_t)r * cols + 9] = shoal_f32_to_bf16(0.75f);
            else if (k == K_F32)
                m.wf[(size_t)r * cols + 9] = 0.75f;
            else {
                uint8_t *b = &m.packed[(size_t)r * (cols / 2) + 4];
                *b = (uint8_t)((*b & 0x0f) | (0x3 << 4)); /* element 9 = 1.5 */
            }
        }
        x[9] = NAN;
        mat_gemm(&m, y, x, 1);
        for (int r = 0; r < rows; r++)
            CHECK_MSG(isnan(y[r]), "%s: NaN in x must give NaN", kind_name[k]);
        x[9] = INFINITY;
        mat_gemm(&m, y, x, 1);
        for (int r = 0; r < rows; r++)
            CHECK_MSG(isinf(y[r]) && y[r] > 0, "%s: +inf x with positive weight must give +inf", kind_name[k]);
        x[9] = -INFINITY;
        mat_gemm(&m, y, x, 1);
        for (int r = 0; r < rows; r++)
            CHECK_MSG(isinf(y[r]) && y[r] < 0, "%s: -inf x with positive weight must give -inf", kind_name[k]);
        /* inf times a zero weight is NaN */
        for (int r = 0; r < rows; r++) {
            if (k == K_BF16)
                m.wb[(size_t)r * cols + 9] = 0;
            else if (k == K_F32)
                m.wf[(size_t)r * cols + 9] = 0.0f;
            else
                m.packed[(size_t)r * (cols / 2) + 4] &= 0x0f;
        }
        mat_gemm(&m, y, x, 1);
        for (int r = 0; r < rows; r++)
            CHECK_MSG(isnan(y[r]), "%s: inf x zero weight must give NaN", kind_name[k]);
        x[9] = 1.0f;
        /* non-finite weights */
        if (k == K_BF16) {
            m.wb[2 * cols + 40] = 0x7fc0; /* NaN */
            m.wb[3 * cols + 40] = 0xff80; /* -inf */
            mat_gemm(&m, y, x, 1);
            CHECK(isnan(y[2]) && isinf(y[3]) && y[3] < 0 && isfinite(y[0]) && isfinite(y[1]));
        } else if (k == K_F32) {
            m.wf[2 * cols + 40] = NAN;
            m.wf[3 * cols + 40] = -INFINITY;
            mat_gemm(&m, y, x, 1);
            CHECK(isnan(y[2]) && isinf(y[3]) && y[3] < 0 && isfinite(y[0]) && isfinite(y[1]));
        } else {
            m.scale[1 * (cols / 32) + 1] = 255; /* row 1, group 1: NaN scale */
            mat_gemm(&m, y, x, 1);
            CHECK(isnan(y[1]) && isfinite(y[0]) && isfinite(y[2]) && isfinite(y[3]));
        }
        free(x);
        mat_free(&m);
    }
}

static void t_nan_inf(void)
{
    for_each_isa(nan_inf_one_isa, "nan/inf");
}

/* ---- small fp32 ops ---------------------------------------------------------- */

static double dsig(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

static void t_norms_softmax(void)
{
    int n = 7168;
    float *x = frand_vec((size_t)n, -3, 3), *w = frand_vec((size_t)n, 0.5f, 1.5f), *y = xmalloc((size_t)n * 4);
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    shoal_rmsnorm(y, x, w, n, 1e-5f);
    double r = 1.0 / sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; i++)
        CHECK_NEAR(y[i], x[i] * r * w[i], 4e-7 * fabs(x[i] * r * w[i]) + 1e-30);
    shoal_rmsnorm(y, x, NULL, n, 1e-5f);
    for (int i = 0; i < n; i++)
        CHECK_NEAR(y[i], x[i] * r, 4e-7 * fabs(x[i] * r) + 1e-30);
    memcpy(y, x, (size_t)n * 4);
    shoal_rmsnorm(y, y, w, n, 1e-5f); /* aliasing allowed */
    for (int i = 0; i < n; i++)
        CHECK_NEAR(y[i], x[i] * r * w[i], 4e-7 * fabs(x[i] * r * w[i]) + 1e-30);
    /* l2norm: eps inside the sqrt of the sum (FLA), distinguishable from
     * max(|x|, eps) on a tiny vector */
    float t[4] = {1e-4f, 0, 0, 0};
    shoal_l2norm(t, 4, 1e-6f);
    CHECK_NEAR(t[0], 1e-4 / sqrt(1e-8 + 1e-6), 1e-8);
    memcpy(y, x, 128 * 4);
    shoal_l2norm(y, 128, 1e-6f);
    double s2 = 0;
    for (int i = 0; i < 128; i++)
        s2 += (double)x[i] * x[i];
    for (int i = 0; i < 128; i++)
        CHECK_NEAR(y[i], x[i] / sqrt(s2 + 1e-6), 3e-7 * fabs(y[i]) + 1e-30);
    /* softmax: large offsets need the max subtraction */
    float sm[5] = {1000.0f, 1001.0f, 999.0f, -50.0f, 1001.0f};
    double ref[5], den = 0;
    for (int i = 0; i < 5; i++)
        den += exp((double)sm[i] - 1001.0);
    for (int i = 0; i < 5; i++)
        ref[i] = exp((double)sm[i] - 1001.0) / den;
    shoal_softmax(sm, 5);
    for (int i = 0; i < 5; i++)
        CHECK_NEAR(sm[i], ref[i], 1e-7);
    CHECK(sm[1] == sm[4]);
    /* sigmoid saturates without NaN */
    CHECK(shoal_sigmoid(-200.0f) == 0.0f);
    CHECK(shoal_sigmoid(200.0f) == 1.0f);
    CHECK_NEAR(shoal_sigmoid(0.3f), dsig(0.3), 1e-7);
    free(x), free(w), free(y);
}

static void t_situ_glu(void)
{
    /* values that saturate each tanh (|g| >> 4, |u| >> 25) and ordinary ones */
    float g[8] = {-30.0f, -4.0f, -0.5f, 0.0f, 0.7f, 4.0f, 12.0f, 90.0f};
    float u[8] = {-100.0f, -25.0f, -1.0f, 3.0f, 0.1f, 25.0f, 60.0f, 1.0f};
    float y[8];
    shoal_situ_glu(y, g, u, 8, 4.0f, 25.0f);
    for (int i = 0; i < 8; i++) {
        double a = 4.0 * tanh(g[i] / 4.0) * dsig(g[i]), b = 25.0 * tanh(u[i] / 25.0);
        CHECK_NEAR(y[i], a * b, 2e-6 * fabs(a * b) + 1e-30);
    }
    float g2[8];
    memcpy(g2, g, sizeof g);
    shoal_situ_glu(g2, g2, u, 8, 4.0f, 25.0f); /* y aliases g */
    CHECK(!memcmp(g2, y, sizeof y));
}

static void t_topk(void)
{
    /* ties broken by the lower index; ascending output; NaN never beats a number */
    float s[12] = {0.5f, 0.9f, 0.9f, NAN, 0.1f, 0.9f, 0.7f, -1.0f, 0.7f, 0.2f, 0.9f, 0.3f};
    int32_t idx[5];
    shoal_topk(idx, s, 12, 5);
    int32_t want[5] = {1, 2, 5, 6, 10}; /* four 0.9s, then the lower-index 0.7 */
    for (int i = 0; i < 5; i++)
        CHECK_EQ_INT(idx[i], want[i]);
    shoal_topk(idx, s, 12, 1);
    CHECK_EQ_INT(idx[0], 1);
    int32_t all[12];
    shoal_topk(all, s, 12, 12);
    for (int i = 0; i < 12; i++)
        CHECK_EQ_INT(all[i], i);
    /* a bias that reorders: selection by s + bias */
    float sb[896];
    for (int i = 0; i < 896; i++)
        sb[i] = (float)((i * 7919) % 896) / 896.0f;
    int32_t k16[16];
    shoal_topk(k16, sb, 896, 16);
    for (int i = 0; i < 16; i++) {
        CHECK(sb[k16[i]] >= (float)(896 - 16) / 896.0f);
        if (i)
            CHECK(k16[i] > k16[i - 1]);
    }
}

static void t_kda_conv_gate(void)
{
    int C = 24, K = 4, steps = 6;
    float *taps = frand_vec((size_t)C * K, -1, 1), *win = calloc((size_t)(K - 1) * C, 4);
    float *xs = frand_vec((size_t)steps * C, -2, 2), out[24];
    for (int t = 0; t < steps; t++) {
        shoal_kda_conv_step(out, win, xs + (size_t)t * C, taps, C, K);
        for (int c = 0; c < C; c++) {
            double acc = 0; /* tap K-1 multiplies the current token; before start is 0 */
            for (int j = 0; j < K; j++) {
                int src = t - (K - 1) + j;
                if (src >= 0)
                    acc += (double)taps[c * K + j] * xs[(size_t)src * C + c];
            }
            double ref = acc * dsig(acc);
            CHECK_NEAR(out[c], ref, 1e-6 * (fabs(ref) + 1));
        }
    }
    free(taps), free(win), free(xs);
    /* gates */
    int H = 3, D = 8;
    float *z = frand_vec((size_t)H * D, -3, 3), *al = frand_vec(H, -1, 2.5f), *dt = frand_vec((size_t)H * D, -1, 1);
    float g[24];
    shoal_kda_gate(g, z, al, dt, H, D, 1, -5.0f);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < D; i++) {
            double zz = (double)z[h * D + i] + dt[h * D + i], ref = -5.0 * dsig(exp(al[h]) * zz);
            CHECK_NEAR(g[h * D + i], ref, 2e-6 * fabs(ref) + 1e-7);
            CHECK(g[h * D + i] <= 0 && g[h * D + i] >= -5); /* (-5, 0), closed by fp32 saturation */
        }
    shoal_kda_gate(g, z, al, dt, H, D, 0, 0.0f);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < D; i++) {
            double zz = (double)z[h * D + i] + dt[h * D + i], ref = -exp(al[h]) * log1p(exp(zz));
            CHECK_NEAR(g[h * D + i], ref, 2e-6 * fabs(ref) + 1e-7);
        }
    free(z), free(al), free(dt);
}

/* Delta rule against the closed form S_t = (I - b k k^T) Diag(e^g) S + b k v^T,
 * o = S^T q, in double over several tokens. */
static void kda_one_isa(void)
{
    int H = 3, D = 64, steps = 5;
    size_t n = (size_t)H * D * D;
    float *S = calloc(n, 4);
    double *Sd = calloc(n, sizeof(double));
    for (int t = 0; t < steps; t++) {
        float *q = frand_vec((size_t)H * D, -1, 1), *k = frand_vec((size_t)H * D, -1, 1);
        float *v = frand_vec((size_t)H * D, -1, 1), *g = frand_vec((size_t)H * D, -1.5f, 0);
        float *beta = frand_vec(H, 0.1f, 0.9f), *o = xmalloc((size_t)H * D * 4);
        for (int h = 0; h < H; h++) {
            shoal_l2norm(q + h * D, D, 1e-6f);
            shoal_l2norm(k + h * D, D, 1e-6f);
            for (int i = 0; i < D; i++)
                q[h * D + i] *= 0.125f;
        }
        shoal_kda_step(o, S, q, k, v, g, beta, H, D);
        for (int h = 0; h < H; h++) {
            double *M = Sd + (size_t)h * D * D, u[64], oo[64];
            const float *kh = k + h * D, *qh = q + h * D, *vh = v + h * D, *gh = g + h * D;
            for (int i = 0; i < D; i++)
                for (int j = 0; j < D; j++)
                    M[i * D + j] *= exp(gh[i]);
            for (int j = 0; j < D; j++) {
                double s = 0;
                for (int i = 0; i < D; i++)
                    s += M[i * D + j] * kh[i];
                u[j] = vh[j] - s;
            }
            for (int i = 0; i < D; i++)
                for (int j = 0; j < D; j++)
                    M[i * D + j] += kh[i] * beta[h] * u[j];
            for (int j = 0; j < D; j++) {
                oo[j] = 0;
                for (int i = 0; i < D; i++)
                    oo[j] += M[i * D + j] * qh[i];
                CHECK_NEAR(o[h * D + j], oo[j], 2e-5);
            }
        }
        free(q), free(k), free(v), free(g), free(beta), free(o);
    }
    for (size_t i = 0; i < n; i++)
        CHECK_NEAR(S[i], Sd[i], 2e-5);
    free(S), free(Sd);
}

static void t_kda_step(void)
{
    for_each_isa(kda_one_isa, "kda step");
    /* bit-identical across ISAs */
    if (nisas < 2)
        return;
    int H = 4, D = 128;
    float *S0 = frand_vec((size_t)H * D * D, -1, 1), *S1 = xmalloc((size_t)H * D * D * 4);
    memcpy(S1, S0, (size_t)H * D * D * 4);
    float *q = frand_vec((size_t)H * D, -0.1f, 0.1f), *k = frand_vec((size_t)H * D, -0.1f, 0.1f);
    float *v = frand_vec((size_t)H * D, -1, 1), *g = frand_vec((size_t)H * D, -3, 0), *b = frand_vec(H, 0, 1);
    float *o0 = xmalloc((size_t)H * D * 4), *o1 = xmalloc((size_t)H * D * 4);
    shoal_isa keep = shoal_kernels_isa();
    shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
    shoal_kda_step(o0, S0, q, k, v, g, b, H, D);
    for (int i = 1; i < nisas; i++) {
        float *S2 = xmalloc((size_t)H * D * D * 4);
        memcpy(S2, S1, (size_t)H * D * D * 4);
        shoal_kernels_set_isa((shoal_isa)isas[i]);
        shoal_kda_step(o1, S2, q, k, v, g, b, H, D);
        CHECK(!memcmp(o0, o1, (size_t)H * D * 4));
        CHECK(!memcmp(S0, S2, (size_t)H * D * D * 4));
        free(S2);
    }
    shoal_kernels_set_isa(keep);
    free(S0), free(S1), free(q), free(k), free(v), free(g), free(b), free(o0), free(o1);
}

static void t_gated_rmsnorm(void)
{
    int H = 3, D = 16;
    float *o = frand_vec((size_t)H * D, -2, 2), *gate = frand_vec((size_t)H * D, -4, 4), *w = frand_vec(D, 0.5f, 2);
    float y[48];
    shoal_gated_rmsnorm(y, o, gate, w, H, D, 1e-5f);
    for (int h = 0; h < H; h++) {
        double ss = 0;
        for (int i = 0; i < D; i++)
            ss += (double)o[h * D + i] * o[h * D + i];
        for (int i = 0; i < D; i++) {
            double ref = o[h * D + i] / sqrt(ss / D + 1e-5) * w[i] * dsig(gate[h * D + i]);
            CHECK_NEAR(y[h * D + i], ref, 1e-6 * fabs(ref) + 1e-30);
        }
    }
    free(o), free(gate), free(w);
}

/* Absorbed MLA against the plain formula in double. */
static void t_mla_attend(void)
{
    int S = 37, H = 5, R = 64, P = 32;
    float scale = 1.0f / sqrtf(192.0f);
    float *cache = frand_vec((size_t)S * (R + P), -1, 1), *ql = frand_vec((size_t)H * R, -1, 1);
    float *qp = frand_vec((size_t)H * P, -1, 1), *ctx = xmalloc((size_t)H * R * 4), *scr = xmalloc((size_t)H * S * 4);
    shoal_mla_attend(ctx, ql, qp, cache, S, H, R, P, scale, scr);
    for (int h = 0; h < H; h++) {
        double sc[37], m = -1e300, den = 0;
        for (int s = 0; s < S; s++) {
            double d = 0;
            for (int i = 0; i < R; i++)
                d += (double)ql[h * R + i] * cache[(size_t)s * (R + P) + i];
            for (int i = 0; i < P; i++)
                d += (double)qp[h * P + i] * cache[(size_t)s * (R + P) + R + i];
            sc[s] = d * scale;
            m = sc[s] > m ? sc[s] : m;
        }
        for (int s = 0; s < S; s++)
            den += exp(sc[s] - m);
        for (int i = 0; i < R; i++) {
            double ref = 0;
            for (int s = 0; s < S; s++)
                ref += exp(sc[s] - m) / den * cache[(size_t)s * (R + P) + i];
            CHECK_NEAR(ctx[h * R + i], ref, 2e-6);
        }
    }
    free(cache), free(ql), free(qp), free(ctx), free(scr);
}

/* y = bf16(W2 SiTU(W1 x, W3 x)) against double, for each weight kind. Each
 * output may differ from the correctly rounded bf16 of the double value by
 * one bf16 ulp (fp32 accumulation can sit on the other side of a tie). */
/* Batched (prefill) MLA: each token equals the decode form for that token
 * alone (scalar decode as the reference, every ISA, threads 1 and 3), rows
 * past a token's position are never read (NaN there), several token blocks
 * and head counts with remainders. */
static void mla_prefill_one_isa(void)
{
    static const int cases[][4] = {/* S0, T, H, R */ {0, 11, 13, 64}, {30, 7, 5, 32}, {5, 1, 7, 64},
                                   {47, 9, 6, 96}, {100, 4, 13, 64}};
    shoal_isa isa = shoal_kernels_isa();
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int S0 = cases[k][0], T = cases[k][1], H = cases[k][2], R = cases[k][3], P = 32, W = R + P;
        int cap = S0 + T + 3;
        float *cache = frand_vec((size_t)cap * W, -1, 1);
        for (size_t i = (size_t)(S0 + T) * W; i < (size_t)cap * W; i++)
            cache[i] = NAN; /* not yet written: must never be read */
        float *ql = frand_vec((size_t)T * H * R, -0.5f, 0.5f), *qp = frand_vec((size_t)T * H * P, -1, 1);
        size_t nc = (size_t)T * H * R;
        float *got = xmalloc(nc * 4), *ref = xmalloc(nc * 4);
        float *scr = xmalloc(shoal_mla_prefill_scratch(S0, T, H) * 4), *dscr = xmalloc((size_t)H * (S0 + T) * 4);
        float scale = 0.11f;
        shoal_kernels_set_isa(SHOAL_ISA_SCALAR);
        for (int t = 0; t < T; t++) {
            size_t q = (size_t)t * H;
            shoal_mla_attend(ref + q * R, ql + q * R, qp + q * P, cache, S0 + t + 1, H, R, P, scale, dscr);
        }
        shoal_kernels_set_isa(isa);
        int nth[] = {1, 3};
        for (int j = 0; j < 2; j++) {
            omp_set_num_threads(nth[j]);
            memset(got, 0xff, nc * 4);
            shoal_mla_attend_prefill(got, ql, qp, cache, S0, T, H, R, P, scale, scr);
            CHECK_MSG(!memcmp(got, ref, nc * 4), "mla prefill S0=%d T=%d H=%d R=%d threads=%d differs from decode", S0,
                      T, H, R, nth[j]);
        }
        /* and the decode form of this ISA equals the scalar one */
        for (int t = 0; t < T; t++) {
            size_t q = (size_t)t * H;
            shoal_mla_attend(got + q * R, ql + q * R, qp + q * P, cache, S0 + t + 1, H, R, P, scale, dscr);
        }
        CHECK_MSG(!memcmp(got, ref, nc * 4), "mla decode S0=%d T=%d differs from scalar", S0, T);
        omp_set_num_threads(2);
        free(cache), free(ql), free(qp), free(got), free(ref), free(scr), free(dscr);
    }
}

static void t_mla_prefill(void)
{
    for_each_isa(mla_prefill_one_isa, "mla prefill");
}

static void t_expert_ffn(void)
{
    int d = 96, f = 64, T = 3; /* d > f: W2 output is computed in two chunks */
    for (int k = 0; k < 3; k++) {
        mat w1 = mat_new((mkind)k, f, d), w3 = mat_new((mkind)k, f, d), w2 = mat_new((mkind)k, d, f);
        shoal_expert_w e = {.kind = k == K_BF16 ? SHOAL_EXPERT_BF16 : k == K_F32 ? SHOAL_EXPERT_F32 : SHOAL_EXPERT_MXFP4,
                            .d = d,
                            .f = f};
        if (k == K_MXFP4) {
            e.w1 = w1.packed, e.w3 = w3.packed, e.w2 = w2.packed;
            e.w1_scale = w1.scale, e.w3_scale = w3.scale, e.w2_scale = w2.scale;
        } else if (k == K_BF16) {
            e.w1 = w1.wb, e.w3 = w3.wb, e.w2 = w2.wb;
        } else {
            e.w1 = w1.wf, e.w3 = w3.wf, e.w2 = w2.wf;
        }
        float *x = frand_vec((size_t)T * d, -1, 1), *scr = xmalloc((size_t)2 * T * f * 4);
        uint16_t *y = xmalloc((size_t)T * d * 2);
        shoal_expert_ffn(y, &e, x, T, 4.0f, 25.0f, scr);
        for (int t = 0; t < T; t++) {
            double h[64];
            for (int j = 0; j < f; j++) {
                double a = 0, b = 0;
                for (int c = 0; c < d; c++) {
                    a += mat_w(&w1, j, c) * x[t * d + c];
                    b += mat_w(&w3, j, c) * x[t * d + c];
                }
                h[j] = 4.0 * tanh(a / 4.0) * dsig(a) * 25.0 * tanh(b / 25.0);
            }
            for (int r = 0; r < d; r++) {
                double ref = 0;
                for (int j = 0; j < f; j++)
                    ref += mat_w(&w2, r, j) * h[j];
                double got = shoal_bf16_to_f32(y[t * d + r]);
                double ulp = fabs(ref) * 0x1p-7 + 1e-20;
                CHECK_MSG(fabs(got - ref) <= ulp + 1e-5 * (1 + fabs(ref)), "%s t=%d r=%d: %g vs %g", kind_name[k], t,
                          r, got, ref);
            }
        }
        free(x), free(scr), free(y);
        mat_free(&w1), mat_free(&w2), mat_free(&w3);
    }
}

static shoal_expert_w expert_of(int k, const mat *w1, const mat *w3, const mat *w2, int d, int f)
{
    shoal_expert_w e = {.kind = k == K_BF16 ? SHOAL_EXPERT_BF16 : k == K_F32 ? SHOAL_EXPERT_F32 : SHOAL_EXPERT_MXFP4,
                        .d = d,
                        .f = f};
    if (k == K_MXFP4) {
        e.w1 = w1->packed, e.w3 = w3->packed, e.w2 = w2->packed;
        e.w1_scale = w1->scale, e.w3_scale = w3->scale, e.w2_scale = w2->scale;
    } else if (k == K_BF16) {
        e.w1 = w1->wb, e.w3 = w3->wb, e.w2 = w2->wb;
    } else {
        e.w1 = w1->wf, e.w3 = w3->wf, e.w2 = w2->wf;
    }
    return e;
}

/* The expert FFN by its definition, one public GEMM at a time:
 * y = bf16(W2 · SiTU-GLU(W1 x, W3 x)) (SPEC §3.6). */
static void expert_by_matrices(uint16_t *y, int k, const mat *w1, const mat *w3, const mat *w2, const float *x, int T,
                               int d, int f)
{
    float *h1 = xmalloc((size_t)T * f * 4), *h3 = xmalloc((size_t)T * f * 4), *o = xmalloc((size_t)T * d * 4);
    if (k == K_MXFP4) {
        shoal_gemm_mxfp4(h1, w1->packed, w1->scale, x, f, d, T);
        shoal_gemm_mxfp4(h3, w3->packed, w3->scale, x, f, d, T);
    } else if (k == K_BF16) {
        shoal_gemm_bf16(h1, w1->wb, x, f, d, T);
        shoal_gemm_bf16(h3, w3->wb, x, f, d, T);
    } else {
        shoal_gemm_f32(h1, w1->wf, x, f, d, T);
        shoal_gemm_f32(h3, w3->wf, x, f, d, T);
    }
    shoal_situ_glu(h1, h1, h3, T * f, 4.0f, 25.0f);
    if (k == K_MXFP4)
        shoal_gemm_mxfp4(o, w2->packed, w2->scale, h1, d, f, T);
    else if (k == K_BF16)
        shoal_gemm_bf16(o, w2->wb, h1, d, f, T);
    else
        shoal_gemm_f32(o, w2->wf, h1, d, f, T);
    for (size_t i = 0; i < (size_t)T * d; i++)
        y[i] = shoal_f32_to_bf16(o[i]);
    free(h1), free(h3), free(o);
}

/* shoal_expert_ffn splits one expert's rows over the threads in one parallel
 * region (W2 through per-thread chunks of the scratch): the bits of the
 * matrix-at-a-time definition at 1, 2 and 3 threads, on every ISA; the shape
 * is above PAR_MIN_WORK so the region really runs threaded, d > f and d not a
 * multiple of the chunk so W2 takes several chunks per thread. */
static void expert_split_one_isa(void)
{
    int d = 672, f = 448, Ts[] = {1, 3, 40}; /* 40: past the small-T tiles, into the token blocks */
    for (int k = 0; k < 3; k++)
        for (int ti = 0; ti < 3; ti++) {
            int T = Ts[ti];
            mat w1 = mat_new((mkind)k, f, d), w3 = mat_new((mkind)k, f, d), w2 = mat_new((mkind)k, d, f);
            shoal_expert_w e = expert_of(k, &w1, &w3, &w2, d, f);
            float *x = frand_vec((size_t)T * d, -1, 1), *scr = xmalloc((size_t)2 * T * f * 4);
            uint16_t *want = xmalloc((size_t)T * d * 2), *got = xmalloc((size_t)T * d * 2);
            expert_by_matrices(want, k, &w1, &w3, &w2, x, T, d, f);
            int nth[] = {1, 2, 3};
            for (int j = 0; j < 3; j++) {
                omp_set_num_threads(nth[j]);
                memset(got, 0xff, (size_t)T * d * 2);
                shoal_expert_ffn(got, &e, x, T, 4.0f, 25.0f, scr);
                CHECK_MSG(!memcmp(got, want, (size_t)T * d * 2), "expert_ffn %s T=%d threads=%d: not the bits of the matrix-at-a-time form",
                          kind_name[k], T, nth[j]);
            }
            omp_set_num_threads(2);
            free(x), free(scr), free(want), free(got);
            mat_free(&w1), mat_free(&w2), mat_free(&w3);
        }
}

static void t_expert_ffn_split(void)
{
    for_each_isa(expert_split_one_isa, "expert ffn split");
}

/* shoal_expert_ffn_many: threads take whole experts (13 experts: >= 4 per
 * thread at 2 and 3 threads) or, with fewer, it runs them one by one; every
 * output the bits of shoal_expert_ffn on that expert alone at 1 thread. Mixed
 * kinds and token counts, one scratch block per thread. */
static void t_expert_ffn_many(void)
{
    enum { N = 13 };
    int d = 96, f = 64, Tmax = 3;
    mat m[N][3];
    shoal_expert_w e[N];
    const shoal_expert_w *pe[N];
    const float *px[N];
    uint16_t *py[N], *want[N];
    int T[N];
    for (int i = 0; i < N; i++) {
        int k = i % 3;
        T[i] = 1 + i % Tmax;
        m[i][0] = mat_new((mkind)k, f, d), m[i][1] = mat_new((mkind)k, f, d), m[i][2] = mat_new((mkind)k, d, f);
        e[i] = expert_of(k, &m[i][0], &m[i][1], &m[i][2], d, f);
        pe[i] = &e[i];
        px[i] = frand_vec((size_t)T[i] * d, -1, 1);
        py[i] = xmalloc((size_t)T[i] * d * 2);
        want[i] = xmalloc((size_t)T[i] * d * 2);
    }
    float *scr = xmalloc((size_t)3 * 2 * Tmax * f * 4);
    omp_set_num_threads(1);
    for (int i = 0; i < N; i++)
        shoal_expert_ffn(want[i], &e[i], px[i], T[i], 4.0f, 25.0f, scr);
    int nth[] = {1, 2, 3}, ns[] = {N, 5};
    for (int j = 0; j < 3; j++)
        for (int a = 0; a < 2; a++) {
            omp_set_num_threads(nth[j]);
            for (int i = 0; i < N; i++)
                memset(py[i], 0xff, (size_t)T[i] * d * 2);
            shoal_expert_ffn_many(py, pe, px, T, ns[a], 4.0f, 25.0f, scr, 3);
            for (int i = 0; i < ns[a]; i++)
                CHECK_MSG(!memcmp(py[i], want[i], (size_t)T[i] * d * 2), "expert_ffn_many n=%d threads=%d expert %d differs",
                          ns[a], nth[j], i);
        }
    omp_set_num_threads(2);
    for (int i = 0; i < N; i++) {
        free((void *)px[i]), free(py[i]), free(want[i]);
        mat_free(&m[i][0]), mat_free(&m[i][1]), mat_free(&m[i][2]);
    }
    free(scr);
}

/* SHOAL_ISA is read once, at init: run this binary again with it set. */
static void isa_probe(const char *value, char *out, size_t outlen)
{
    char self[1024], cmd[1200];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        SKIP("cannot resolve /proc/self/exe");
    self[n] = 0;
    snprintf(cmd, sizeof cmd, "SHOAL_ISA=%s '%s' --isa-probe", value, self);
    out[0] = 0;
    FILE *f = popen(cmd, "r");
    if (!f)
        return;
    if (!fgets(out, (int)outlen, f))
        out[0] = 0;
    pclose(f);
    out[strcspn(out, "\n")] = 0;
}

static void t_isa_env_override(void)
{
    char out[128];
    isa_probe("scalar", out, sizeof out);
    CHECK(!strcmp(out, "scalar"));
    isa_probe("sse9", out, sizeof out);
    CHECK(!strcmp(out, "E_INVAL"));
    isa_probe("avx2", out, sizeof out);
    CHECK(!strcmp(out, shoal_kernels_cpu_has(SHOAL_ISA_AVX2) ? "avx2" : "E_UNSUPPORTED"));
    isa_probe("avx512", out, sizeof out);
    CHECK(!strcmp(out, shoal_kernels_cpu_has(SHOAL_ISA_AVX512) ? "avx512" : "E_UNSUPPORTED"));
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--isa-probe")) {
        int rc = shoal_kernels_init();
        printf("%s\n", rc ? shoal_err_name(rc) : shoal_isa_name(shoal_kernels_isa()));
        return 0;
    }
    test_binary = "test_kernels";
    if (shoal_kernels_init() != 0) {
        fprintf(stderr, "shoal_kernels_init failed (SHOAL_ISA=%s)\n", getenv("SHOAL_ISA"));
        return 1;
    }
    collect_isas();
    printf("kernels: active ISA %s; variants run here:", shoal_isa_name(shoal_kernels_isa()));
    for (int i = 0; i < nisas; i++)
        printf(" %s", shoal_isa_name((shoal_isa)isas[i]));
    printf("\n");
    omp_set_num_threads(2);
    RUN(t_dispatch);
    RUN(t_isa_env_override);
    RUN(t_isa_avx2);
    RUN(t_isa_avx512);
    RUN(t_mxfp4_decode);
    RUN(t_gemm_vs_double);
    RUN(t_gemv_t_vs_double);
    RUN(t_isa_bit_identical);
    RUN(t_isa_large_T);
    RUN(t_mx_decodes);
    RUN(t_peak_counts);
    RUN(t_mu_spec);
    RUN(t_mu_probes);
    RUN(t_mu_isa);
    RUN(t_mu_mx_scales);
    RUN(t_mu_mx_fold);
    RUN(t_mu_wire_round);
    RUN(t_mu_selftest);
    RUN(t_mu_amx);
    RUN(t_thread_invariance);
    RUN(t_token_invariance);
    RUN(t_nan_inf);
    RUN(t_norms_softmax);
    RUN(t_situ_glu);
    RUN(t_topk);
    RUN(t_kda_conv_gate);
    RUN(t_kda_step);
    RUN(t_gated_rmsnorm);
    RUN(t_mla_attend);
    RUN(t_mla_prefill);
    RUN(t_expert_ffn);
    RUN(t_expert_ffn_split);
    RUN(t_expert_ffn_many);
    RUN(t_amx_variant_names);
    RUN(t_amx_variants_tiles); /* last: on AMX it leaves the base variant selected */
    return test_finish();
}
