/* kernels: ISA choice (CPUID; SHOAL_ISA, SHOAL_MX_DECODE, SHOAL_MU_FOLD, SHOAL_AMX_MIN_T and SHOAL_AMX_VARIANT overrides read here and nowhere else)
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
#include <unistd.h>

#include "common/err.h"
#include "common/st.h"
#include "kernels/kernels_int.h"

static const shoal__kernels_table scalar_table = {
    .gemm_bf16 = shoal__kernels_gemm_bf16_scalar,
    .gemm_f32 = shoal__kernels_gemm_f32_scalar,
    .gemm_mxfp4 = shoal__kernels_gemm_mxfp4_scalar,
    .gemv_t_bf16 = shoal__kernels_gemv_t_bf16_scalar,
    .gemv_t_f32 = shoal__kernels_gemv_t_f32_scalar,
    .kda_head = shoal__kernels_kda_head_scalar,
    .mla_heads = shoal__kernels_mla_heads_scalar,
    .gemm_bf16_mu = shoal__kernels_gemm_bf16_mu_scalar,
    .gemm_mxfp4_mu = shoal__kernels_gemm_mxfp4_mu_scalar,
};

static shoal__kernels_table isa_tables[3];
/* The AVX-512 MXFP4 decodes (bit-identical; shoal_kernels_set_mx_decode): two
 * shuffles per 32 weights (shift) against three (vpmovzx). vpmovzx by default
 * (mx_decode_default), shift by SHOAL_MX_DECODE=shift: made for Intel, where
 * every 512-bit shuffle issues on port 5 (fewer port-5 uops by llvm-mca; not yet
 * timed on an Intel CPU; on the AMD Zen 4 of issue 33 it ran 1.13x slower in
 * cache). docs/PERFORMANCE.md, "MXFP4 T = 1:
 * two shuffles per group on Intel". */
static shoal_mx_decode mx_decode = SHOAL_MX_DECODE_VPMOVZX;
static shoal__gemm_mxfp4_fn mx_fns[2];
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
        if (ok && isa == SHOAL_ISA_AVX512) {
            mx_fns[SHOAL_MX_DECODE_SHIFT] = isa_tables[isa].gemm_mxfp4;
            mx_fns[SHOAL_MX_DECODE_VPMOVZX] = isa_tables[isa].gemm_mxfp4_zx;
            isa_tables[isa].gemm_mxfp4 = mx_fns[mx_decode];
        }
    }
    return isa_built[isa] == 1;
}

const char *shoal_mx_decode_name(shoal_mx_decode d)
{
    return d == SHOAL_MX_DECODE_SHIFT ? "shift" : d == SHOAL_MX_DECODE_VPMOVZX ? "vpmovzx" : "?";
}

int shoal__kernels_mu_fold = 1;

void shoal_kernels_set_mu_fold(int on)
{
    shoal__kernels_mu_fold = on != 0;
}

int shoal_kernels_mu_fold(void)
{
    return shoal__kernels_mu_fold;
}

shoal_mx_decode shoal_kernels_mx_decode(void)
{
    return mx_decode;
}

int shoal_kernels_set_mx_decode(shoal_mx_decode d)
{
    if ((unsigned)d > SHOAL_MX_DECODE_VPMOVZX)
        return SHOAL_EINVAL;
    mx_decode = d;
    if (isa_built[SHOAL_ISA_AVX512] == 1)
        isa_tables[SHOAL_ISA_AVX512].gemm_mxfp4 = mx_fns[d];
    return 0;
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

/* Bytes of L2 per core (the GEMMs' row blocks are sized from it). */
static long l2_bytes = 1L << 20;

int shoal__kernels_gemm_rb(int row_bytes, int max)
{
    long rb = l2_bytes / 2 / (row_bytes > 0 ? row_bytes : 1);
    rb = rb > max ? max : rb;
    rb &= ~3L;
    return rb < 4 ? 4 : (int)rb;
}

long shoal_kernels_l2_bytes(void)
{
    return l2_bytes;
}

static void mu_try_amx(void);
static int amx_variant_sel; /* SHOAL__AMX_* flags of the AMX GEMM: SHOAL_AMX_VARIANT, default 0 */

/* vpmovzx everywhere until a timing on an Intel CPU says otherwise: shift has
 * fewer port-5 uops by llvm-mca's Skylake-server model (3.19 against 3.25
 * cycles per 32 weights) but ran 1.13x slower in cache on the AMD Zen 4 where
 * it was measured; tests/bench/amx_machine.sh (step 4b) times both on the
 * lent device's Intel host. */
static shoal_mx_decode mx_decode_default(void)
{
    return SHOAL_MX_DECODE_VPMOVZX;
}

int shoal_kernels_init(void)
{
    if (initialised)
        return 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 >= (64L << 10) && l2 <= (64L << 20))
        l2_bytes = l2;
#endif
    /* parsed on every machine, so a misspelt variant is refused everywhere
     * (before anything is selected: a refused init changes nothing) */
    const char *av = getenv("SHOAL_AMX_VARIANT");
    if (av && shoal__kernels_amx_variant_parse(av, &amx_variant_sel))
        return SHOAL_EINVAL;
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
    shoal_kernels_set_mx_decode(mx_decode_default());
    const char *mxd = getenv("SHOAL_MX_DECODE");
    if (mxd && *mxd) {
        if (!strcmp(mxd, "shift"))
            shoal_kernels_set_mx_decode(SHOAL_MX_DECODE_SHIFT);
        else if (!strcmp(mxd, "vpmovzx"))
            shoal_kernels_set_mx_decode(SHOAL_MX_DECODE_VPMOVZX);
        else
            return SHOAL_EINVAL;
    }
    const char *muf = getenv("SHOAL_MU_FOLD");
    if (muf && *muf) {
        if (strcmp(muf, "on") && strcmp(muf, "off"))
            return SHOAL_EINVAL;
        shoal_kernels_set_mu_fold(!strcmp(muf, "on"));
    }
    if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512) && isa_usable(SHOAL_ISA_AVX512))
        mu_try_amx();
    initialised = 1;
    return 0;
}

/* ---- instruction peaks ---------------------------------------------------- */

double shoal_kernels_peak(shoal_peak kind, long n, const char **what)
{
    const char *dummy;
    what = what ? what : &dummy;
    *what = "none";
#if defined(__x86_64__)
    switch (kind) {
    case SHOAL_PEAK_FMA_F32:
        /* the peak that binds the active kernels: ymm under SHOAL_ISA=avx2 on an
         * AVX-512 CPU (a class played on a wider core), the CPU's widest otherwise */
        if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512) && active_isa != SHOAL_ISA_AVX2) {
            *what = "vfmadd231ps zmm";
            return shoal__kernels_peak_fma_zmm(n);
        }
        if (shoal_kernels_cpu_has(SHOAL_ISA_AVX2)) {
            *what = "vfmadd231ps ymm";
            return shoal__kernels_peak_fma_ymm(n);
        }
        return 0;
    case SHOAL_PEAK_BF16_DOT:
        if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512) && __builtin_cpu_supports("avx512bf16")) {
            *what = "vdpbf16ps zmm";
            return shoal__kernels_peak_bf16dot(n);
        }
        return 0;
    case SHOAL_PEAK_INT8_VNNI:
        if (shoal_kernels_cpu_has(SHOAL_ISA_AVX512) && __builtin_cpu_supports("avx512vnni")) {
            *what = "vpdpbusd zmm";
            return shoal__kernels_peak_vnni8(n);
        }
        return 0;
    case SHOAL_PEAK_AMX_BF16:
        if (shoal__kernels_amx_usable()) {
            *what = "tdpbf16ps 16x16x32";
            return shoal__kernels_peak_amx_bf16(n);
        }
        return 0;
    }
#else
    (void)kind, (void)n;
#endif
    return 0;
}

/* ---- threaded entry points ---------------------------------------------- */

/* Threads split the rows into one contiguous range each, in multiples of
 * ROW_BLOCK (a multiple of every worker's row tile); the worker then blocks
 * its range for the caches (one call per thread, so a row block of the
 * blocked GEMM can span more than 16 rows and x is read once per block). */
#define ROW_BLOCK 16
/* Below this many multiply-adds a call runs on the calling thread only: a
 * parallel region costs microseconds, a 128x512 GEMV about ten. */
#define PAR_MIN_WORK (1L << 18)

#define ROW_SPLIT(call)                                                                                         \
    do {                                                                                                        \
        int nb_ = (rows + ROW_BLOCK - 1) / ROW_BLOCK;                                                           \
        long work_ = (long)rows * cols * T;                                                                     \
        _Pragma("omp parallel if (work_ >= PAR_MIN_WORK)")                                                      \
        {                                                                                                       \
            int nt_ = omp_get_num_threads(), id_ = omp_get_thread_num();                                        \
            int r0 = (int)((long)nb_ * id_ / nt_) * ROW_BLOCK, r1 = (int)((long)nb_ * (id_ + 1) / nt_) * ROW_BLOCK; \
            r1 = r1 < rows ? r1 : rows;                                                                         \
            if (r1 > r0)                                                                                        \
                call;                                                                                           \
        }                                                                                                       \
    } while (0)

/* ---- the numerics class ---------------------------------------------------- */

static shoal_numerics numerics = SHOAL_NUMERICS_PORTABLE;

void shoal_kernels_set_numerics(shoal_numerics n)
{
    numerics = n == SHOAL_NUMERICS_MU ? SHOAL_NUMERICS_MU : SHOAL_NUMERICS_PORTABLE;
}

shoal_numerics shoal_kernels_numerics(void)
{
    return numerics;
}

const char *shoal_numerics_name(shoal_numerics n)
{
    return n == SHOAL_NUMERICS_MU ? "mu" : "portable";
}

int shoal_numerics_parse(const char *s, shoal_numerics *out)
{
    if (s && !strcmp(s, "portable"))
        *out = SHOAL_NUMERICS_PORTABLE;
    else if (s && !strcmp(s, "mu"))
        *out = SHOAL_NUMERICS_MU;
    else
        return SHOAL_EINVAL;
    return 0;
}

/* the active ISA's bf16 / MXFP4 worker of the active numerics class */
static shoal__gemm_bf16_fn bf16_fn(void)
{
    return numerics == SHOAL_NUMERICS_MU ? shoal__kernels_active->gemm_bf16_mu : shoal__kernels_active->gemm_bf16;
}

static shoal__gemm_mxfp4_fn mxfp4_fn(void)
{
    return numerics == SHOAL_NUMERICS_MU ? shoal__kernels_active->gemm_mxfp4_mu : shoal__kernels_active->gemm_mxfp4;
}

void shoal_gemm_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int T)
{
    shoal__gemm_bf16_fn fn = bf16_fn();
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
    shoal__gemm_mxfp4_fn fn = mxfp4_fn();
    ROW_SPLIT(fn(y, packed, scale, x, rows, cols, T, r0, r1));
}

void shoal_gemm_bf16_mu(float *y, const uint16_t *w, const float *x, int rows, int cols, int T)
{
    shoal__gemm_bf16_fn fn = shoal__kernels_active->gemm_bf16_mu;
    ROW_SPLIT(fn(y, w, x, rows, cols, T, r0, r1));
}

void shoal_gemm_mxfp4_mu(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                         int T)
{
    shoal__gemm_mxfp4_fn fn = shoal__kernels_active->gemm_mxfp4_mu;
    ROW_SPLIT(fn(y, packed, scale, x, rows, cols, T, r0, r1));
}

/* ---- one routed expert -------------------------------------------------------
 * y = bf16(W2 · SiTU(W1 x, W3 x)) in ONE parallel region, not one per matrix:
 * at T = 1 a K3 expert matrix streams in about 0.1 ms, and with passive
 * waiting every region costs a futex wake-up of the other threads (~40 us,
 * docs/PERFORMANCE.md, "Routed experts: one parallel region per expert").
 * Each thread computes its rows of W1 and W3 (the same split as ROW_SPLIT),
 * applies SiTU-GLU to those rows, waits at one barrier (W2 reads all of h),
 * then computes its rows of W2 and rounds them to bf16. Every output element
 * is still computed whole by the same worker in the canonical order, so the
 * bits are those of the matrix-at-a-time form for any thread count. W2's
 * fp32 rows go through the dead h3 half of the scratch in chunks: thread i
 * owns floats [i*T*cw, (i+1)*T*cw) of it, cw = f / threads rows. */
static void expert_rows(float *y, const shoal_expert_w *e, const void *w, const uint8_t *scale, const float *x,
                        int rows, int cols, int T, int r0, int r1)
{
    switch (e->kind) {
    case SHOAL_EXPERT_MXFP4:
        mxfp4_fn()(y, w, scale, x, rows, cols, T, r0, r1);
        break;
    case SHOAL_EXPERT_BF16:
        bf16_fn()(y, w, x, rows, cols, T, r0, r1);
        break;
    case SHOAL_EXPERT_F32:
        shoal__kernels_active->gemm_f32(y, w, x, rows, cols, T, r0, r1);
        break;
    }
}

/* W2 rows [r0, r1) of an expert: start row r0 of the matrix, n rows */
static const void *expert_w2_at(const shoal_expert_w *e, int r0, const uint8_t **scale)
{
    size_t f = (size_t)e->f;
    *scale = e->w2_scale ? e->w2_scale + (size_t)r0 * (f / 32) : NULL;
    switch (e->kind) {
    case SHOAL_EXPERT_MXFP4:
        return (const uint8_t *)e->w2 + (size_t)r0 * (f / 2);
    case SHOAL_EXPERT_BF16:
        return (const uint16_t *)e->w2 + (size_t)r0 * f;
    default:
        return (const float *)e->w2 + (size_t)r0 * f;
    }
}

/* thread id of nt: its rows of W1 and W3, SiTU-GLU on them into h1 */
static void expert_w13(const shoal_expert_w *e, const float *x, int T, float b1, float b2, float *scratch, int id,
                       int nt)
{
    int d = e->d, f = e->f;
    float *h1 = scratch, *h3 = scratch + (size_t)T * f;
    int nb = (f + ROW_BLOCK - 1) / ROW_BLOCK;
    int r0 = (int)((long)nb * id / nt) * ROW_BLOCK, r1 = (int)((long)nb * (id + 1) / nt) * ROW_BLOCK;
    r1 = r1 < f ? r1 : f;
    if (r1 <= r0)
        return;
    expert_rows(h1, e, e->w1, e->w1_scale, x, f, d, T, r0, r1);
    expert_rows(h3, e, e->w3, e->w3_scale, x, f, d, T, r0, r1);
    for (int t = 0; t < T; t++)
        shoal_situ_glu(h1 + (size_t)t * f + r0, h1 + (size_t)t * f + r0, h3 + (size_t)t * f + r0, r1 - r0, b1, b2);
}

/* thread id of nt: its rows of W2 over all of h1, rounded to bf16 into y */
static void expert_w2(uint16_t *y, const shoal_expert_w *e, int T, float *scratch, int id, int nt)
{
    int d = e->d, f = e->f;
    float *h1 = scratch, *h3 = scratch + (size_t)T * f;
    int nb = (d + ROW_BLOCK - 1) / ROW_BLOCK;
    int a0 = (int)((long)nb * id / nt) * ROW_BLOCK, a1 = (int)((long)nb * (id + 1) / nt) * ROW_BLOCK;
    a1 = a1 < d ? a1 : d;
    int cw = f / nt; /* >= ROW_BLOCK: nt <= f / ROW_BLOCK */
    float *out = h3 + (size_t)id * T * cw;
    for (int c0 = a0; c0 < a1; c0 += cw) {
        int n = a1 - c0 < cw ? a1 - c0 : cw;
        const uint8_t *sc;
        const void *w = expert_w2_at(e, c0, &sc);
        expert_rows(out, e, w, sc, h1, n, f, T, 0, n);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < n; j++)
                y[(size_t)t * d + c0 + j] = shoal_f32_to_bf16(out[(size_t)t * n + j]);
    }
}

/* a whole expert on the calling thread */
static void expert_alone(uint16_t *y, const shoal_expert_w *e, const float *x, int T, float b1, float b2,
                         float *scratch)
{
    expert_w13(e, x, T, b1, b2, scratch, 0, 1);
    expert_w2(y, e, T, scratch, 0, 1);
}

void shoal_expert_ffn(uint16_t *y, const shoal_expert_w *e, const float *x, int T, float b1, float b2,
                      float *scratch)
{
    long work = 3L * e->f * e->d * T;
    int want = omp_get_max_threads(), most = e->f / ROW_BLOCK > 0 ? e->f / ROW_BLOCK : 1;
    want = want < most ? want : most;
    if (want <= 1 || work < PAR_MIN_WORK || omp_in_parallel()) {
        expert_alone(y, e, x, T, b1, b2, scratch);
        return;
    }
#pragma omp parallel num_threads(want)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        expert_w13(e, x, T, b1, b2, scratch, id, nt);
#pragma omp barrier
        expert_w2(y, e, T, scratch, id, nt);
    }
}

void shoal_expert_ffn_many(uint16_t *const *y, const shoal_expert_w *const *e, const float *const *x, const int *T,
                           int n, float b1, float b2, float *scratch, int scratch_threads)
{
    int nt = omp_get_max_threads(), maxT = 1, f = 1;
    nt = nt < scratch_threads ? nt : scratch_threads;
    nt = nt > 1 ? nt : 1;
    for (int i = 0; i < n; i++) {
        maxT = T[i] > maxT ? T[i] : maxT;
        f = e[i]->f > f ? e[i]->f : f;
    }
    if (nt == 1 || n < 4 * nt || omp_in_parallel()) {
        for (int i = 0; i < n; i++)
            shoal_expert_ffn(y[i], e[i], x[i], T[i], b1, b2, scratch);
        return;
    }
    /* whole experts per thread, each on one thread (no nested region) */
#pragma omp parallel num_threads(nt)
    {
        float *scr = scratch + (size_t)omp_get_thread_num() * 2 * (size_t)maxT * (size_t)f;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n; i++) {
            expert_alone(y[i], e[i], x[i], T[i], b1, b2, scr);
        }
    }
}

/* ---- the start-up self-test of a matrix-unit-order kernel ---------------------
 * Probe inputs that separate the candidate orders, run through the candidate
 * and the scalar specification, compared value for value (NaN by class):
 * the flush threshold (an exact 2^-126 - 1.5 * 2^-151 that the subnormal grid
 * rounds up to 2^-126 but an unbounded exponent rounds to a tiny value),
 * even/odd chains against one chain, signed zeros, subnormal activations and
 * weights, the per-32 fold (random rows over several column chunks), several
 * token and row tiles with remainders, and MXFP4 edge scales. Static buffers:
 * kernels never allocate. */
#define ST_ROWS 70
#define ST_COLS 2080
#define ST_T 17
static uint16_t st_w[ST_ROWS * ST_COLS];
static uint8_t st_p[ST_ROWS * ST_COLS / 2], st_s[ST_ROWS * ST_COLS / 32];
static float st_x[ST_T * ST_COLS], st_y0[ST_T * ST_ROWS], st_y1[ST_T * ST_ROWS];

static uint32_t st_rand(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (uint32_t)(*s >> 16);
}

static int st_same(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!(a[i] != a[i] && b[i] != b[i]) && memcmp(&a[i], &b[i], 4))
            return 0;
    return 1;
}

int shoal__kernels_mu_selftest(shoal__gemm_bf16_fn bf, shoal__gemm_mxfp4_fn mx)
{
    shoal__kernels_mx_tables();
    uint64_t seed = 0x243f6a8885a308d3ull;
    /* T = 40: above the AMX SWAP variant's 32 tokens, so a swap variant's self-test
     * runs both of its arrangements */
    static const int shapes[][3] = {{1, 32, 1}, {3, 64, 1}, {70, 64, 17}, {20, ST_COLS, 3}, {24, 96, 40}};
    for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
        int rows = shapes[k][0], cols = shapes[k][1], T = shapes[k][2];
        for (int i = 0; i < rows * cols; i++) {
            uint32_t r = st_rand(&seed);
            /* bf16 of every exponent class: normal around 1, tiny, subnormal, signed zero */
            unsigned ex = r % 8 == 0 ? (r >> 8) % 256 : r % 8 == 1 ? 0 : 120 + (r >> 8) % 14;
            st_w[i] = (uint16_t)((r >> 31) << 15 | (ex & 0xff) << 7 | ((r >> 16) & 0x7f));
            if ((st_w[i] & 0x7f80) == 0x7f80)
                st_w[i] &= 0xbfff; /* no inf/NaN weights: their payloads are not specified */
        }
        for (int i = 0; i < rows * cols / 2; i++)
            st_p[i] = (uint8_t)st_rand(&seed);
        for (int i = 0; i < rows * cols / 32; i++) {
            uint32_t r = st_rand(&seed);
            st_s[i] = (uint8_t)(r % 9 == 0 ? 0 : r % 9 == 1 ? 1 : r % 9 == 2 ? 254 : 118 + r % 12);
        }
        for (int i = 0; i < T * cols; i++) {
            uint32_t r = st_rand(&seed);
            float v = (float)(int32_t)(r & 0xffff) / 16384.0f - 2.0f;
            st_x[i] = r % 11 == 0 ? v * 1e-39f : r % 11 == 1 ? v * 0x1p-125f : r % 11 == 2 ? -0.0f : v;
        }
        if (k == 0) { /* the flush threshold: 2^-126 - 1.5 * 2^-151 in the even chain */
            memset(st_w, 0, 64);
            memset(st_x, 0, 128);
            st_w[0] = 0x3f80, st_x[0] = 0x1p-126f, st_w[2] = 0x99c0, st_x[2] = 0x1p-75f;
        }
        if (k == 1) { /* row 0: even/odd chains (1, 2^24, -2^24); row 1: -1 * +0 everywhere; row 2: +0 */
            memset(st_w, 0, 3 * 64);
            memset(st_x, 0, 128);
            st_w[0] = st_w[3] = st_w[4] = 0x3f80;
            st_x[0] = 1.0f, st_x[3] = 0x1p24f, st_x[4] = -0x1p24f;
            for (int i = 0; i < 32; i++)
                st_w[64 + i] = 0xbf80;
        }
        bf(st_y1, st_w, st_x, rows, cols, T, 0, rows);
        shoal__kernels_gemm_bf16_mu_scalar(st_y0, st_w, st_x, rows, cols, T, 0, rows);
        if (!st_same(st_y0, st_y1, (size_t)T * rows))
            return SHOAL_EUNSUPPORTED;
        mx(st_y1, st_p, st_s, st_x, rows, cols, T, 0, rows);
        shoal__kernels_gemm_mxfp4_mu_scalar(st_y0, st_p, st_s, st_x, rows, cols, T, 0, rows);
        if (!st_same(st_y0, st_y1, (size_t)T * rows))
            return SHOAL_EUNSUPPORTED;
    }
    return 0;
}

/* Where the mu kernels run: "amx" after a passed self-test, else the ISA. */
static const char *mu_path_note;

const char *shoal_kernels_mu_path(void)
{
    if (mu_path_note && active_isa == SHOAL_ISA_AVX512)
        return mu_path_note;
    return shoal_isa_name(active_isa);
}

const char *shoal_kernels_mu_engine(void)
{
    if (mu_path_note && active_isa == SHOAL_ISA_AVX512 && !strncmp(mu_path_note, "amx", 3))
        return "amx";
    return shoal_isa_name(active_isa);
}

/* AMX for the AVX-512 table's mu kernels, if the unit computes the order:
 * calls of T >= amx_min_t tokens run on the tiles, smaller ones on the
 * AVX-512 emulation of the same order (a tile holds 16 tokens; below a few
 * the weight packing costs more than the emulation; bit-identical either
 * way, so the threshold moves only the clock; 8 from the Xeon figures in
 * docs/PERFORMANCE.md: below it the emulation ran 1.2-2.5x faster). SHOAL_AMX_MIN_T=N sets it
 * (0: AMX never). */
#define AMX_MIN_T_DEFAULT 8
static int amx_min_t = AMX_MIN_T_DEFAULT;
static shoal__gemm_bf16_fn mu_small_bf16;
static shoal__gemm_mxfp4_fn mu_small_mxfp4;
static char mu_path_buf[160];
static int amx_installed; /* the AMX kernels passed the self-test and are in the AVX-512 table */

static const char *const amx_flag_names[] = {"k256", "once", "pf", "pipe", "swap"};

const char *shoal__kernels_amx_variant_name(int v, char *buf, size_t n)
{
    size_t o = 0;
    if (n)
        buf[0] = '\0';
    for (int i = 0; i < 5; i++)
        if (v & (1 << i)) {
            int k = snprintf(buf + o, o < n ? n - o : 0, "%s%s", o ? "+" : "", amx_flag_names[i]);
            o += k > 0 ? (size_t)k : 0;
        }
    if (!o)
        snprintf(buf, n, "base");
    return buf;
}

int shoal__kernels_amx_variant_parse(const char *s, int *v)
{
    int f = 0;
    for (int more = *s != '\0'; more;) {
        size_t len = strcspn(s, "+,");
        int hit = len == 4 && !strncmp(s, "base", 4);
        for (int i = 0; i < 5 && !hit; i++)
            if (strlen(amx_flag_names[i]) == len && !strncmp(s, amx_flag_names[i], len)) {
                f |= 1 << i;
                hit = 1;
            }
        if (!hit) /* an unknown or empty name ("swap+") */
            return SHOAL_EINVAL;
        s += len;
        more = *s != '\0';
        s += more;
    }
    *v = f;
    return 0;
}

static void mu_path_amx(void)
{
    char vn[48], note[64] = "";
    if (amx_variant_sel)
        snprintf(note, sizeof note, "variant %s", shoal__kernels_amx_variant_name(amx_variant_sel, vn, sizeof vn));
    if (amx_min_t > 1)
        snprintf(mu_path_buf, sizeof mu_path_buf, "amx (calls of %d+ tokens; fewer: avx512%s%s)", amx_min_t,
                 *note ? "; " : "", note);
    else if (*note)
        snprintf(mu_path_buf, sizeof mu_path_buf, "amx (%s)", note);
    else
        snprintf(mu_path_buf, sizeof mu_path_buf, "amx");
    mu_path_note = mu_path_buf;
}

static void gemm_bf16_mu_amx_or_small(float *y, const uint16_t *w, const float *x, int rows, int cols, int T, int r0,
                                      int r1)
{
    (T >= amx_min_t ? shoal__kernels_gemm_bf16_mu_amx : mu_small_bf16)(y, w, x, rows, cols, T, r0, r1);
}

static void gemm_mxfp4_mu_amx_or_small(float *y, const uint8_t *packed, const uint8_t *scale, const float *x,
                                       int rows, int cols, int T, int r0, int r1)
{
    (T >= amx_min_t ? shoal__kernels_gemm_mxfp4_mu_amx : mu_small_mxfp4)(y, packed, scale, x, rows, cols, T, r0, r1);
}

int shoal_kernels_set_amx_min_t(int n)
{
    int old = amx_min_t;
    if (n >= 1)
        amx_min_t = n;
    return old;
}

static void mu_try_amx(void)
{
    if (!shoal__kernels_amx_usable() || isa_built[SHOAL_ISA_AVX512] != 1)
        return;
    const char *env = getenv("SHOAL_AMX_MIN_T");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v >= 0 && v <= 1000000)
            amx_min_t = (int)v;
    }
    if (amx_min_t == 0) {
        mu_path_note = "avx512 (AMX off: SHOAL_AMX_MIN_T=0)";
        return;
    }
    shoal__kernels_amx_set_variant(amx_variant_sel);
    if (shoal__kernels_mu_selftest(shoal__kernels_gemm_bf16_mu_amx, shoal__kernels_gemm_mxfp4_mu_amx) == 0) {
        mu_small_bf16 = isa_tables[SHOAL_ISA_AVX512].gemm_bf16_mu;
        mu_small_mxfp4 = isa_tables[SHOAL_ISA_AVX512].gemm_mxfp4_mu;
        isa_tables[SHOAL_ISA_AVX512].gemm_bf16_mu = gemm_bf16_mu_amx_or_small;
        isa_tables[SHOAL_ISA_AVX512].gemm_mxfp4_mu = gemm_mxfp4_mu_amx_or_small;
        amx_installed = 1;
        mu_path_amx();
    } else if (amx_variant_sel) {
        char vn[48];
        snprintf(mu_path_buf, sizeof mu_path_buf,
                 "avx512 (AMX present but variant %s failed the matrix-unit-order self-test: not used)",
                 shoal__kernels_amx_variant_name(amx_variant_sel, vn, sizeof vn));
        mu_path_note = mu_path_buf;
    } else
        mu_path_note = "avx512 (AMX present but failed the matrix-unit-order self-test: not used)";
}

int shoal_kernels_set_amx_variant(const char *name)
{
    int v;
    if (!name || shoal__kernels_amx_variant_parse(name, &v))
        return SHOAL_EINVAL;
    if (!amx_installed)
        return SHOAL_EUNSUPPORTED;
    shoal__kernels_amx_set_variant(v);
    if (shoal__kernels_mu_selftest(shoal__kernels_gemm_bf16_mu_amx, shoal__kernels_gemm_mxfp4_mu_amx)) {
        shoal__kernels_amx_set_variant(amx_variant_sel);
        return SHOAL_EUNSUPPORTED;
    }
    amx_variant_sel = v;
    mu_path_amx();
    return 0;
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
