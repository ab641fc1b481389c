/* shoal bench kernels: the matrix kernels at the real K3 shapes, against a
 * STREAM-like read bandwidth measured in the same run (docs/PERFORMANCE.md).
 *
 * Every weight working set is at least BENCH_SET_BYTES (several distinct copies
 * of a small matrix, cycled), far above the last-level cache, so each call
 * streams its weights from DRAM. A "run" calls the kernel once per copy; the
 * figure per row is the median over --reps runs, with min and max. GB/s counts
 * weight bytes (MXFP4: packed + scale bytes) per call, whatever T is, so at
 * T = 128 the weight bytes per token are bytes/128. Timings never go into
 * tests; this command only measures. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/commands.h"
#include "common/err.h"
#include "common/st.h"
#include "kernels/kernels.h"

#define BENCH_SET_BYTES ((size_t)320 << 20) /* 10x the 32 MiB L3 of the dev machine */
#define READ_BYTES ((size_t)512 << 20)

typedef struct {
    int threads, json, reps;
    const char *only; /* substring filter on the op/shape, NULL = all */
    int quick;        /* T = 1 only, small set: smoke test */
} bench_opts;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    double med, min, max;
} stat3;

static stat3 stats(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    stat3 s = {.min = v[0], .max = v[n - 1]};
    s.med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    return s;
}

static void *big_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 1))
        return NULL;
    return p;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static inline uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void fill_bytes(uint8_t *p, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t r = next_rand();
        memcpy(p + i, &r, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)next_rand();
}

/* bf16 values in (-1, 1): random sign, exponent 112..126, random mantissa */
static void fill_bf16(uint16_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t r = next_rand();
        p[i] = (uint16_t)(((r & 1) << 15) | ((112 + (r >> 1) % 15) << 7) | ((r >> 8) & 0x7f));
    }
}

static void fill_f32(float *p, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        p[i] = lo + (hi - lo) * (float)(next_rand() >> 40) / (float)(1 << 24);
}

/* ---- STREAM-like read bandwidth ------------------------------------------ */

static uint64_t read_sink;

/* The pass itself: kernels/kernels.h (shared with the worker's host facts). */
static double read_bw_once(const uint64_t *buf, size_t nwords)
{
    return shoal_read_bw_pass(buf, nwords, 0, &read_sink);
}

/* The read-bandwidth buffer, kept for the whole run: every row times a read
 * pass right before each of its kernel runs, so kernel and memory figures
 * come from the same moments of a machine whose load drifts. */
static const uint64_t *rd_buf;
static size_t rd_words;

/* ---- rows ---------------------------------------------------------------- */

typedef enum { W_BF16, W_MXFP4 } wkind;

typedef struct {
    const char *op;    /* "gemv_bf16", "gemm_mxfp4", ... */
    const char *layer; /* which K3 weight */
    wkind kind;
    int rows, cols;
} mat_shape;

static const mat_shape shapes[] = {
    {"mxfp4", "expert.w1/w3", W_MXFP4, 3072, 3584},
    {"mxfp4", "expert.w2", W_MXFP4, 3584, 3072},
    {"bf16", "kda.q/k/v", W_BF16, 12288, 7168},
    {"bf16", "kda.o_proj", W_BF16, 7168, 12288},
    {"bf16", "router", W_BF16, 896, 7168},
    {"bf16", "lm_head", W_BF16, 163840, 7168},
    /* the MLA layer's projections (its o_proj and gate have the KDA o_proj and q shapes) */
    {"bf16", "mla.q_a", W_BF16, 1536, 7168},
    {"bf16", "mla.q_b", W_BF16, 18432, 1536},
    {"bf16", "mla.kv_a", W_BF16, 576, 7168},
    {"bf16", "mla.o_proj", W_BF16, 7168, 12288},
    {"bf16", "mla.gate", W_BF16, 12288, 7168},
};

static void print_row(const bench_opts *o, const char *op, const char *layer, const char *shape, int T,
                      size_t bytes, stat3 sec, stat3 rd)
{
    double read_gbps = rd.med;
    double gbps = (double)bytes / sec.med / 1e9, gmin = (double)bytes / sec.max / 1e9,
           gmax = (double)bytes / sec.min / 1e9;
    double us_tok = sec.med * 1e6 / T;
    const char *isa = shoal_isa_name(shoal_kernels_isa());
    if (o->json) {
        printf("{\"op\":\"%s\",\"layer\":\"%s\",\"shape\":\"%s\",\"tokens\":%d,\"threads\":%d,\"isa\":\"%s\","
               "\"numerics\":\"%s\",\"gbps\":%.3f,\"gbps_min\":%.3f,\"gbps_max\":%.3f,\"read_gbps\":%.3f,\"ratio\":%.3f,"
               "\"read_gbps_min\":%.3f,\"read_gbps_max\":%.3f,\"ms\":%.4f,\"us_per_token\":%.2f,\"weight_bytes\":%zu,"
               "\"weight_bytes_per_token\":%.1f,\"reps\":%d}\n",
               op, layer, shape, T, o->threads, isa, shoal_numerics_name(shoal_kernels_numerics()), gbps, gmin,
               gmax, read_gbps, read_gbps > 0 ? gbps / read_gbps : 0,
               rd.min, rd.max, sec.med * 1e3, us_tok, bytes, (double)bytes / T, o->reps);
    } else {
        printf("%-11s %-13s %-13s %4d %3d %-6s %7.2f [%6.2f,%6.2f] %7.2f %6.3f %10.1f %12.0f\n", op, layer, shape, T,
               o->threads, isa, gbps, gmin, gmax, read_gbps, read_gbps > 0 ? gbps / read_gbps : 0, us_tok,
               (double)bytes / T);
    }
    fflush(stdout);
}

/* Median-of-reps timing of one matrix op at T tokens over ncopies copies. */
static int bench_matrix(const bench_opts *o, const mat_shape *s, const int *Ts, int nT)
{
    size_t rows = (size_t)s->rows, cols = (size_t)s->cols;
    size_t wbytes = s->kind == W_BF16 ? rows * cols * 2 : rows * cols / 2;
    size_t sbytes = s->kind == W_MXFP4 ? rows * cols / 32 : 0;
    size_t per = wbytes + sbytes;
    size_t set = o->quick ? BENCH_SET_BYTES / 4 : BENCH_SET_BYTES;
    int ncopies = (int)((set + per - 1) / per);
    if (ncopies < 1)
        ncopies = 1;
    uint8_t *w = big_alloc(wbytes * (size_t)ncopies), *sc = sbytes ? big_alloc(sbytes * (size_t)ncopies) : NULL;
    int Tmax = 1;
    for (int i = 0; i < nT; i++)
        Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
    float *x = big_alloc((size_t)Tmax * cols * sizeof(float)), *y = big_alloc((size_t)Tmax * rows * sizeof(float));
    if (!w || (sbytes && !sc) || !x || !y) {
        fprintf(stderr, "bench: out of memory for %s %zux%zu x%d\n", s->layer, rows, cols, ncopies);
        free(w), free(sc), free(x), free(y);
        return 4;
    }
    if (s->kind == W_BF16)
        fill_bf16((uint16_t *)w, wbytes / 2 * (size_t)ncopies);
    else {
        fill_bytes(w, wbytes * (size_t)ncopies);
        for (size_t i = 0; i < sbytes * (size_t)ncopies; i++)
            sc[i] = (uint8_t)(118 + next_rand() % 12); /* ordinary E8M0 scales */
    }
    fill_f32(x, (size_t)Tmax * cols, -1.0f, 1.0f);
    char shape[32], op[32];
    snprintf(shape, sizeof shape, "%zux%zu", rows, cols);
    for (int ti = 0; ti < nT; ti++) {
        int T = Ts[ti];
        snprintf(op, sizeof op, "%s_%s", T == 1 ? "gemv" : "gemm", s->op);
        double *sec = calloc((size_t)o->reps, sizeof *sec), *rdv = calloc((size_t)o->reps, sizeof *rdv);
        int nc = ncopies;
        for (int rep = -1; rep < o->reps; rep++) {
            if (rep >= 0)
                rdv[rep] = read_bw_once(rd_buf, rd_words);
            double t0 = now_s();
            for (int c = 0; c < nc; c++) {
                if (s->kind == W_BF16)
                    shoal_gemm_bf16(y, (const uint16_t *)(w + wbytes * (size_t)c), x, s->rows, s->cols, T);
                else
                    shoal_gemm_mxfp4(y, w + wbytes * (size_t)c, sc + sbytes * (size_t)c, x, s->rows, s->cols, T);
            }
            double dt = (now_s() - t0) / nc;
            if (rep >= 0)
                sec[rep] = dt;
        }
        print_row(o, op, s->layer, shape, T, per, stats(sec, o->reps), stats(rdv, o->reps));
        free(sec), free(rdv);
    }
    free(w), free(sc), free(x), free(y);
    return 0;
}

/* KDA recurrent step (96 heads x 128 x 128 fp32 state, 6 MiB) with distinct
 * states cycled so each step reads and writes its state from DRAM. */
static int bench_kda(const bench_opts *o)
{
    int H = 96, D = 128;
    size_t sn = (size_t)H * D * D;
    int nst = (int)(BENCH_SET_BYTES / (sn * 4));
    float *S = big_alloc(sn * 4 * (size_t)nst), *q = big_alloc((size_t)H * D * 4), *k = big_alloc((size_t)H * D * 4),
          *v = big_alloc((size_t)H * D * 4), *g = big_alloc((size_t)H * D * 4), *b = big_alloc((size_t)H * 4),
          *out = big_alloc((size_t)H * D * 4);
    if (!S || !q || !k || !v || !g || !b || !out) {
        fprintf(stderr, "bench: out of memory for the KDA state\n");
        return 4;
    }
    fill_f32(S, sn * (size_t)nst, -0.1f, 0.1f);
    fill_f32(q, (size_t)H * D, -0.05f, 0.05f);
    fill_f32(k, (size_t)H * D, -0.05f, 0.05f);
    fill_f32(v, (size_t)H * D, -1, 1);
    fill_f32(g, (size_t)H * D, -0.5f, 0);
    fill_f32(b, (size_t)H, 0, 1);
    double *sec = calloc((size_t)o->reps, sizeof *sec), *rdv = calloc((size_t)o->reps, sizeof *rdv);
    for (int rep = -1; rep < o->reps; rep++) {
        if (rep >= 0)
            rdv[rep] = read_bw_once(rd_buf, rd_words);
        double t0 = now_s();
        for (int c = 0; c < nst; c++)
            shoal_kda_step(out, S + sn * (size_t)c, q, k, v, g, b, H, D);
        if (rep >= 0)
            sec[rep] = (now_s() - t0) / nst;
    }
    /* bytes: the state is read and written once per step */
    print_row(o, "kda_step", "kda.state", "96x128x128", 1, sn * 4 * 2, stats(sec, o->reps), stats(rdv, o->reps));
    free(sec), free(rdv), free(S), free(q), free(k), free(v), free(g), free(b), free(out);
    return 0;
}

/* MLA attention of the absorbed form as the engine's MLA layer runs it
 * (coordinator/engine/forward.c): the W_UK^T query absorption (96 gemv_t of 128x512
 * bf16, parallel over heads), the attention over the latent cache (576 fp32
 * per token), and W_UV (96 gemv of 128x512 bf16, parallel over heads).
 * T = 1: one decode step at S cached tokens (shoal_mla_attend). T > 1: the
 * last T tokens of an S-token prefill (positions S-T..S-1, causal) through the
 * batched form (shoal_mla_attend_prefill, blocks of SHOAL_MLA_TBLOCK tokens);
 * us_per_token compares the two. Several layers' caches are cycled so the
 * cache comes from DRAM. */
static int bench_mla(const bench_opts *o, int S, int T)
{
    int H = 96, R = 512, P = 64, Dn = 128;
    size_t cn = (size_t)S * (R + P);
    int ncache = (int)(BENCH_SET_BYTES / (cn * 4));
    if (ncache < 2)
        ncache = 2;
    if (ncache > 24)
        ncache = 24; /* one per MLA layer at most */
    if (T > 1 && ncache > 4)
        ncache = 4; /* a prefill block reads the cache once per 4 tokens anyway */
    int tb = T < SHOAL_MLA_TBLOCK ? T : SHOAL_MLA_TBLOCK;
    float *cache = big_alloc(cn * 4 * (size_t)ncache);
    uint16_t *wkvb = big_alloc((size_t)H * 2 * Dn * R * 2); /* kv_b_proj [96*256, 512] */
    float *qn = big_alloc((size_t)T * H * Dn * 4), *qpe = big_alloc((size_t)T * H * P * 4),
          *qlat = big_alloc((size_t)T * H * R * 4), *ctx = big_alloc((size_t)T * H * R * 4),
          *outv = big_alloc((size_t)H * Dn * 4), *scr = big_alloc((size_t)tb * H * S * 4);
    if (!cache || !wkvb || !qn || !qpe || !qlat || !ctx || !outv || !scr) {
        fprintf(stderr, "bench: out of memory for the MLA cache\n");
        return 4;
    }
    fill_f32(cache, cn * (size_t)ncache, -1, 1);
    fill_bf16(wkvb, (size_t)H * 2 * Dn * R);
    fill_f32(qn, (size_t)T * H * Dn, -1, 1);
    fill_f32(qpe, (size_t)T * H * P, -1, 1);
    double *sec = calloc((size_t)o->reps, sizeof *sec), *rdv = calloc((size_t)o->reps, sizeof *rdv);
    for (int rep = -1; rep < o->reps; rep++) {
        if (rep >= 0)
            rdv[rep] = read_bw_once(rd_buf, rd_words);
        double t0 = now_s();
        for (int c = 0; c < ncache; c++) {
            for (int t = 0; t < T; t++) {
#pragma omp parallel for schedule(static)
                for (int h = 0; h < H; h++) /* q_lat[h] = W_UK_h^T q_nope[h] */
                    shoal_gemv_t_bf16(qlat + ((size_t)t * H + h) * R, wkvb + (size_t)h * 2 * Dn * R,
                                      qn + ((size_t)t * H + h) * Dn, Dn, R);
            }
            const float *cc = cache + cn * (size_t)c;
            if (T == 1)
                shoal_mla_attend(ctx, qlat, qpe, cc, S, H, R, P, 1.0f / sqrtf(192.0f), scr);
            else
                shoal_mla_attend_prefill(ctx, qlat, qpe, cc, S - T, T, H, R, P, 1.0f / sqrtf(192.0f), scr);
            for (int t = 0; t < T; t++) {
#pragma omp parallel for schedule(static)
                for (int h = 0; h < H; h++) /* o[h] = W_UV_h ctx[h] */
                    shoal_gemm_bf16(outv + (size_t)h * Dn, wkvb + ((size_t)h * 2 + 1) * Dn * R,
                                    ctx + ((size_t)t * H + h) * R, Dn, R, 1);
            }
        }
        if (rep >= 0)
            sec[rep] = (now_s() - t0) / ncache;
    }
    char shape[48];
    snprintf(shape, sizeof shape, "S=%d", S);
    print_row(o, T == 1 ? "mla_decode" : "mla_prefill", "mla.attn", shape, T, cn * 4 + (size_t)H * 2 * Dn * R * 2,
              stats(sec, o->reps), stats(rdv, o->reps));
    free(sec), free(rdv), free(cache), free(wkvb), free(qn), free(qpe), free(qlat), free(ctx), free(outv), free(scr);
    return 0;
}

/* Compute ceiling: one thread, a matrix that fits in L2 (so no DRAM), timed
 * with the thread's CPU clock so time-slicing by other processes on a shared
 * machine does not count. GB/s of weight bytes per CPU-second. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Arithmetic ceilings on one thread, thread CPU clock (kernel-internal
 * comparisons on a shared machine): the GEMMs at T = 128 on a block of rows
 * (gmacs = multiply-adds per CPU-second), and MLA attention at S = 1024 for
 * 16 query tokens, token by token (decode form) and batched (prefill form):
 * us_per_token for each. */
static void incache_row(const bench_opts *o, const char *op, const char *shape, int T, stat3 st, double macs)
{
    const char *isa = shoal_isa_name(shoal_kernels_isa());
    if (o->json)
        printf("{\"op\":\"%s\",\"layer\":\"in_cache\",\"shape\":\"%s\",\"tokens\":%d,\"threads\":1,\"isa\":\"%s\","
               "\"numerics\":\"%s\",\"clock\":\"thread_cpu\",\"gbps\":0,\"read_gbps\":0,\"ratio\":0,\"gmacs\":%.3f,\"gmacs_min\":%.3f,"
               "\"gmacs_max\":%.3f,\"us_per_token\":%.2f,\"us_per_token_min\":%.2f,\"us_per_token_max\":%.2f,"
               "\"reps\":%d}\n",
               op, shape, T, isa, shoal_numerics_name(shoal_kernels_numerics()), macs / st.med / 1e9,
               macs / st.max / 1e9, macs / st.min / 1e9, st.med * 1e6 / T,
               st.min * 1e6 / T, st.max * 1e6 / T, o->reps);
    else
        printf("%-11s %-13s %-13s %4d %3d %-6s %7.2f GMAC/s [%6.2f,%6.2f] %9.1f us/token  (thread CPU time)\n", op,
               "in_cache", shape, T, 1, isa, macs / st.med / 1e9, macs / st.max / 1e9, macs / st.min / 1e9,
               st.med * 1e6 / T);
    fflush(stdout);
}

static void bench_incache_fma(const bench_opts *o)
{
    if (o->quick)
        return;
    double *sec = calloc((size_t)o->reps, sizeof *sec);
    /* GEMM T = 128: 64 rows of a 7168-wide bf16 matrix, 128 of a 3584-wide MXFP4 one */
    {
        int T = 128, rb = 64, cb = 7168, rm = 128, cm = 3584;
        uint16_t *wb = big_alloc((size_t)rb * cb * 2);
        uint8_t *pk = big_alloc((size_t)rm * cm / 2), *sc = big_alloc((size_t)rm * cm / 32);
        float *x = big_alloc((size_t)T * cb * 4), *y = big_alloc((size_t)T * rm * 4);
        if (wb && pk && sc && x && y) {
            fill_bf16(wb, (size_t)rb * cb);
            fill_bytes(pk, (size_t)rm * cm / 2);
            for (size_t j = 0; j < (size_t)rm * cm / 32; j++)
                sc[j] = (uint8_t)(118 + next_rand() % 12);
            fill_f32(x, (size_t)T * cb, -1, 1);
            /* T = 128 (the arithmetic ceiling), then the small-T sweep: per-call
             * compute cost against T = 1, with no memory time in it */
            static const int Ts[] = {128, 1, 2, 4, 8, 16};
            for (int k = 0; k < 2; k++)
                for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                    int Tk = Ts[ti];
                    for (int rep = -1; rep < o->reps; rep++) {
                        double t0 = thread_cpu_s();
                        if (k == 0)
                            shoal_gemm_bf16(y, wb, x, rb, cb, Tk);
                        else
                            shoal_gemm_mxfp4(y, pk, sc, x, rm, cm, Tk);
                        if (rep >= 0)
                            sec[rep] = thread_cpu_s() - t0;
                    }
                    char shape[32];
                    snprintf(shape, sizeof shape, "%dx%d", k ? rm : rb, k ? cm : cb);
                    incache_row(o, Tk == 1 ? (k ? "gemv_mxfp4" : "gemv_bf16") : (k ? "gemm_mxfp4" : "gemm_bf16"),
                                shape, Tk, stats(sec, o->reps), (double)Tk * (k ? (double)rm * cm : (double)rb * cb));
                }
        }
        free(wb), free(pk), free(sc), free(x), free(y);
    }
    /* MLA at S = 1024: 16 tokens at positions 1008..1023 */
    {
        int H = 96, R = 512, P = 64, S = 1024, T = 16;
        float *cache = big_alloc((size_t)S * (R + P) * 4), *ql = big_alloc((size_t)T * H * R * 4),
              *qp = big_alloc((size_t)T * H * P * 4), *ctx = big_alloc((size_t)T * H * R * 4),
              *scr = big_alloc(shoal_mla_prefill_scratch(S - T, T, H) * 4);
        if (cache && ql && qp && ctx && scr) {
            fill_f32(cache, (size_t)S * (R + P), -1, 1);
            fill_f32(ql, (size_t)T * H * R, -0.05f, 0.05f);
            fill_f32(qp, (size_t)T * H * P, -1, 1);
            float scale = 1.0f / sqrtf(192.0f);
            for (int k = 0; k < 2; k++) {
                for (int rep = -1; rep < o->reps; rep++) {
                    double t0 = thread_cpu_s();
                    if (k == 0)
                        for (int t = 0; t < T; t++)
                            shoal_mla_attend(ctx + (size_t)t * H * R, ql + (size_t)t * H * R, qp + (size_t)t * H * P,
                                             cache, S - T + t + 1, H, R, P, scale, scr);
                    else
                        shoal_mla_attend_prefill(ctx, ql, qp, cache, S - T, T, H, R, P, scale, scr);
                    if (rep >= 0)
                        sec[rep] = thread_cpu_s() - t0;
                }
                double macs = 0;
                for (int t = 0; t < T; t++)
                    macs += (double)H * (S - T + t + 1) * (2 * R + P);
                incache_row(o, k ? "mla_prefill" : "mla_decode", "S=1024", T, stats(sec, o->reps), macs);
            }
        }
        free(cache), free(ql), free(qp), free(ctx), free(scr);
    }
    free(sec);
}

static void bench_incache(const bench_opts *o)
{
    const struct {
        const char *op;
        wkind kind;
        int rows, cols;
    } m[] = {{"gemv_mxfp4", W_MXFP4, 256, 3584}, {"gemv_bf16", W_BF16, 64, 7168}};
    int keep = omp_get_max_threads();
    omp_set_num_threads(1);
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
        size_t n = (size_t)m[i].rows * m[i].cols;
        size_t wb = m[i].kind == W_BF16 ? n * 2 : n / 2, sb = m[i].kind == W_MXFP4 ? n / 32 : 0;
        uint8_t *w = big_alloc(wb), *sc = big_alloc(sb ? sb : 1);
        float *x = big_alloc((size_t)m[i].cols * 4), *y = big_alloc((size_t)m[i].rows * 4);
        if (!w || !sc || !x || !y) {
            free(w), free(sc), free(x), free(y);
            continue;
        }
        if (m[i].kind == W_BF16)
            fill_bf16((uint16_t *)w, n);
        else {
            fill_bytes(w, wb);
            for (size_t j = 0; j < sb; j++)
                sc[j] = (uint8_t)(118 + next_rand() % 12);
        }
        fill_f32(x, (size_t)m[i].cols, -1, 1);
        int calls = 200;
        double *sec = calloc((size_t)o->reps, sizeof *sec);
        for (int rep = -1; rep < o->reps; rep++) {
            double t0 = thread_cpu_s();
            for (int c = 0; c < calls; c++) {
                if (m[i].kind == W_BF16)
                    shoal_gemm_bf16(y, (const uint16_t *)w, x, m[i].rows, m[i].cols, 1);
                else
                    shoal_gemm_mxfp4(y, w, sc, x, m[i].rows, m[i].cols, 1);
            }
            if (rep >= 0)
                sec[rep] = (thread_cpu_s() - t0) / calls;
        }
        stat3 st = stats(sec, o->reps);
        double bytes = (double)(wb + sb);
        const char *isa = shoal_isa_name(shoal_kernels_isa());
        if (o->json)
            printf("{\"op\":\"%s\",\"layer\":\"in_cache\",\"shape\":\"%dx%d\",\"tokens\":1,\"threads\":1,"
                   "\"isa\":\"%s\",\"clock\":\"thread_cpu\",\"gbps\":%.3f,\"gbps_min\":%.3f,\"gbps_max\":%.3f,"
                   "\"read_gbps\":0,\"ratio\":0,\"ns_per_32_weights\":%.3f,\"reps\":%d}\n",
                   m[i].op, m[i].rows, m[i].cols, isa, bytes / st.med / 1e9, bytes / st.max / 1e9,
                   bytes / st.min / 1e9, st.med * 1e9 / ((double)n / 32), o->reps);
        else
        {
            char shape[32];
            snprintf(shape, sizeof shape, "%dx%d", m[i].rows, m[i].cols);
            printf("%-11s %-13s %-13s %4d %3d %-6s %7.2f [%6.2f,%6.2f]  (in L2, thread CPU time; %.2f ns per 32 weights)\n",
                   m[i].op, "in_cache", shape, 1, 1, isa, bytes / st.med / 1e9, bytes / st.max / 1e9,
                   bytes / st.min / 1e9, st.med * 1e9 / ((double)n / 32));
        }
        free(sec), free(w), free(sc), free(x), free(y);
    }
    bench_incache_fma(o);
    omp_set_num_threads(keep);
}

static int usage(FILE *f)
{
    fprintf(f, "usage: shoal bench kernels [--threads N] [--json] [--reps N] [--only SUBSTR] [--quick] [--tokens LIST]\n"
               "  Matrix kernels at the K3 shapes (T = 1, 16, 128), the KDA step, MLA decode\n"
               "  attention (S = 1K, 8K) and batched MLA prefill (the last 128 tokens of S),\n"
               "  each next to a STREAM-like read bandwidth measured in the same run\n"
               "  (a read pass right before every timed run of the row; 4 streams per thread).\n"
               "  --threads N   OpenMP threads (default: all)\n"
               "  --json        one JSON object per row\n"
               "  --reps N      timed runs per row, >= 5 (default 5); median, min, max reported\n"
               "  --only S      only rows whose layer name contains S (e.g. expert, lm_head, kda, mla)\n"
               "  --quick       T = 1 only and smaller working sets (smoke test, not for figures)\n"
               "  --tokens L    the matrix rows at these T (comma-separated, e.g. 1,2,4,8,16,128)\n"
               "  --numerics C  portable (default) or mu: the order the bf16/MXFP4 rows compute\n"
               "  The in_cache rows time one thread on an L2-resident matrix with the thread's CPU\n"
               "  clock: the kernel's compute ceiling, unaffected by other processes' time slices.\n"
               "  The kernel ISA is chosen by CPUID or SHOAL_ISA=scalar|avx2|avx512.\n");
    return f == stdout ? 0 : 2;
}

static int bench_kernels(int argc, char **argv)
{
    bench_opts o = {.threads = omp_get_max_threads(), .reps = 5};
    int Tuser[16], nTu = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 1024) {
                fprintf(stderr, "bench: --threads must be an integer in 1..1024, got '%s'\n", argv[i]);
                return 2;
            }
            o.threads = (int)v;
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 5 || v > 1000) {
                fprintf(stderr, "bench: --reps must be an integer in 5..1000, got '%s'\n", argv[i]);
                return 2;
            }
            o.reps = (int)v;
        } else if (!strcmp(argv[i], "--json")) {
            o.json = 1;
        } else if (!strcmp(argv[i], "--numerics") && i + 1 < argc) {
            shoal_numerics nc;
            if (shoal_numerics_parse(argv[++i], &nc)) {
                fprintf(stderr, "bench: --numerics takes portable or mu, got '%s'\n", argv[i]);
                return 2;
            }
            shoal_kernels_set_numerics(nc);
        } else if (!strcmp(argv[i], "--quick")) {
            o.quick = 1;
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            o.only = argv[++i];
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            const char *v = argv[++i];
            nTu = 0;
            while (*v && nTu < 16) {
                char *end;
                long t = strtol(v, &end, 10);
                if (end == v || t < 1 || t > 1024 || (*end && *end != ',')) {
                    fprintf(stderr, "bench: --tokens wants a comma-separated list of 1..1024, got '%s'\n", argv[i]);
                    return 2;
                }
                Tuser[nTu++] = (int)t;
                v = *end ? end + 1 : end;
            }
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            return usage(stdout);
        } else {
            fprintf(stderr, "bench kernels: unknown option '%s'\n", argv[i]);
            return usage(stderr);
        }
    }
    int rc = shoal_kernels_init();
    if (rc) {
        fprintf(stderr, "bench: kernel ISA: %s (SHOAL_ISA=%s)\n", rc == SHOAL_EUNSUPPORTED ? "unsupported on this CPU" : "invalid name",
                getenv("SHOAL_ISA"));
        return 3;
    }
    omp_set_num_threads(o.threads);
    /* read bandwidth: median of reps over a buffer far above the LLC */
    size_t nwords = (o.quick ? READ_BYTES / 4 : READ_BYTES) / 8;
    uint64_t *buf = big_alloc(nwords * 8);
    if (!buf) {
        fprintf(stderr, "bench: out of memory for the read-bandwidth buffer\n");
        return 4;
    }
    fill_bytes((uint8_t *)buf, nwords * 8);
    double *bw = calloc((size_t)o.reps, sizeof *bw);
    read_bw_once(buf, nwords);
    for (int r = 0; r < o.reps; r++)
        bw[r] = read_bw_once(buf, nwords);
    stat3 rb = stats(bw, o.reps);
    free(bw);
    rd_buf = buf;
    rd_words = nwords;
    if (o.json)
        printf("{\"op\":\"read_bw\",\"layer\":\"stream_read\",\"shape\":\"%zuMiB\",\"tokens\":0,\"threads\":%d,"
               "\"isa\":\"%s\",\"gbps\":%.3f,\"gbps_min\":%.3f,\"gbps_max\":%.3f,\"read_gbps\":%.3f,\"ratio\":1.0,"
               "\"reps\":%d}\n",
               (nwords * 8) >> 20, o.threads, shoal_isa_name(shoal_kernels_isa()), rb.med, rb.min, rb.max, rb.med,
               o.reps);
    else {
        printf("# shoal bench kernels: isa %s, numerics %s (mu path %s), threads %d, reps %d (median [min,max]); "
               "weights cycled over >= %zu MiB\n",
               shoal_isa_name(shoal_kernels_isa()), shoal_numerics_name(shoal_kernels_numerics()),
               shoal_kernels_mu_engine(), o.threads, o.reps,
               (o.quick ? BENCH_SET_BYTES / 4 : BENCH_SET_BYTES) >> 20);
        printf("# read bandwidth (%zu MiB, 4 streams per thread): %.2f GB/s [%.2f, %.2f]\n", (nwords * 8) >> 20, rb.med, rb.min,
               rb.max);
        printf("%-11s %-13s %-13s %4s %3s %-6s %7s %15s %7s %6s %10s %12s\n", "op", "layer", "shape", "T", "thr", "isa",
               "GB/s", "[min,max]", "read", "ratio", "us/token", "wbytes/tok");
    }
    if (!o.only || strstr("in_cache", o.only))
        bench_incache(&o);
    int Tfull[] = {1, 16, 128}, Tq[] = {1};
    const int *Ts = nTu ? Tuser : o.quick ? Tq : Tfull;
    int nT = nTu ? nTu : o.quick ? 1 : 3;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        if (o.only && !strstr(shapes[i].layer, o.only) && !strstr(shapes[i].op, o.only))
            continue;
        if (o.quick && !strcmp(shapes[i].layer, "lm_head"))
            continue;
        rc = bench_matrix(&o, &shapes[i], Ts, nT);
        if (rc) {
            free(buf);
            return rc;
        }
    }
    if (!o.only || strstr("kda.state", o.only)) {
        rc = bench_kda(&o);
        if (rc) {
            free(buf);
            return rc;
        }
    }
    if (!o.only || strstr("mla.attn", o.only)) {
        int Ss[] = {1024, 8192};
        for (int i = 0; i < (o.quick ? 1 : 2); i++) {
            rc = bench_mla(&o, Ss[i], 1);
            if (!rc && !o.quick)
                rc = bench_mla(&o, Ss[i], 128);
            if (rc) {
                free(buf);
                return rc;
            }
        }
    }
    free(buf);
    return 0;
}

/* ---- shoal bench peak ------------------------------------------------------ */

/* This machine's per-core ceilings: each instruction loop (kernels/peak_*.c)
 * on one thread, timed with the thread's CPU clock (other processes' time
 * slices do not count), median of reps with [min, max]; then the read pass on
 * one thread and on all. Every kernel figure can then be stated as a fraction
 * of the ceiling that binds it. */
static int bench_peak(int argc, char **argv)
{
    bench_opts o = {.threads = omp_get_max_threads(), .reps = 5};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            o.json = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 3 || v > 1000) {
                fprintf(stderr, "bench peak: --reps must be an integer in 3..1000, got '%s'\n", argv[i]);
                return 2;
            }
            o.reps = (int)v;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: shoal bench peak [--json] [--reps N]\n"
                   "  Per-core instruction ceilings (fp32 FMA, vdpbf16ps, VNNI int8, AMX bf16 where the\n"
                   "  CPU has them; thread CPU time) and the read pass on 1 thread and on all threads.\n"
                   "  The fp32 FMA loop has the active kernels' width: ymm under SHOAL_ISA=avx2.\n");
            return 0;
        } else {
            fprintf(stderr, "bench peak: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    int rc = shoal_kernels_init();
    if (rc) {
        fprintf(stderr, "bench: kernel ISA: %s\n", shoal_err_name(rc));
        return 3;
    }
    static const char *names[SHOAL_PEAK_COUNT] = {"fp32_fma", "bf16_dot", "int8_vnni", "amx_bf16"};
    double *v = calloc((size_t)o.reps, sizeof *v);
    if (!o.json)
        printf("# shoal bench peak: one thread, thread CPU time, median [min, max] of %d runs\n", o.reps);
    for (int k = 0; k < SHOAL_PEAK_COUNT; k++) {
        const char *what;
        if (shoal_kernels_peak((shoal_peak)k, 1, &what) == 0) {
            if (o.json)
                printf("{\"op\":\"peak\",\"what\":\"%s\",\"instr\":\"none\",\"available\":false}\n", names[k]);
            else
                printf("%-10s %-20s not on this CPU (or not in this build)\n", names[k], "-");
            continue;
        }
        /* calibrate: about 0.1 s per run */
        long n = 1 << 12;
        for (;;) {
            double t0 = thread_cpu_s();
            shoal_kernels_peak((shoal_peak)k, n, NULL);
            double dt = thread_cpu_s() - t0;
            if (dt > 0.02 || n > (1L << 40))
                break;
            n *= 4;
        }
        n *= 5;
        for (int r = 0; r < o.reps; r++) {
            double t0 = thread_cpu_s();
            double macs = shoal_kernels_peak((shoal_peak)k, n, NULL);
            v[r] = macs / (thread_cpu_s() - t0) / 1e9;
        }
        stat3 st = stats(v, o.reps);
        if (o.json)
            printf("{\"op\":\"peak\",\"what\":\"%s\",\"instr\":\"%s\",\"available\":true,\"gmacs\":%.2f,"
                   "\"gmacs_min\":%.2f,\"gmacs_max\":%.2f,\"reps\":%d}\n",
                   names[k], what, st.med, st.min, st.max, o.reps);
        else
            printf("%-10s %-20s %9.1f GMAC/s [%.1f, %.1f] per core\n", names[k], what, st.med, st.min, st.max);
        fflush(stdout);
    }
    /* the read pass: one thread, then every thread */
    size_t nwords = READ_BYTES / 8;
    uint64_t *buf = big_alloc(nwords * 8);
    if (!buf) {
        free(v);
        fprintf(stderr, "bench: out of memory for the read-bandwidth buffer\n");
        return 4;
    }
    fill_bytes((uint8_t *)buf, nwords * 8);
    int keep = omp_get_max_threads();
    int ths[2] = {1, keep};
    for (int i = 0; i < (keep > 1 ? 2 : 1); i++) {
        omp_set_num_threads(ths[i]);
        read_bw_once(buf, nwords);
        for (int r = 0; r < o.reps; r++)
            v[r] = read_bw_once(buf, nwords);
        stat3 st = stats(v, o.reps);
        if (o.json)
            printf("{\"op\":\"peak\",\"what\":\"read_pass\",\"threads\":%d,\"gbps\":%.2f,\"gbps_min\":%.2f,"
                   "\"gbps_max\":%.2f,\"reps\":%d}\n",
                   ths[i], st.med, st.min, st.max, o.reps);
        else
            printf("%-10s %-20s %9.2f GB/s [%.2f, %.2f] on %d thread%s (%zu MiB, wall clock)\n", "read_pass", "4 streams/thread",
                   st.med, st.min, st.max, ths[i], ths[i] > 1 ? "s" : "", (nwords * 8) >> 20);
    }
    omp_set_num_threads(keep);
    free(buf), free(v);
    return 0;
}

int shoal_cmd_bench(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fprintf(argc < 2 ? stderr : stdout, "usage: shoal bench kernels|peak [options]   (shoal bench kernels --help)\n");
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "kernels"))
        return bench_kernels(argc - 1, argv + 1);
    if (!strcmp(argv[1], "peak"))
        return bench_peak(argc - 1, argv + 1);
    fprintf(stderr, "shoal bench: unknown benchmark '%s' (known: kernels, peak)\n", argv[1]);
    return 2;
}
