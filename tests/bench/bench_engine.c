/* Engine benchmark (docs/PERFORMANCE.md, engine section): decode seconds per
 * token against the bandwidth bound, and prefill tokens/s, on one model.
 *
 *   bench_engine MODEL [--threads N] [--steps N] [--prefill 128,512] [--reps R] [--prefill-reps P]
 *                [--max-batch B] [--numerics portable|mu]
 *
 * 1. Reads every mapped tensor of the model once (warms the page cache), then
 *    measures read bandwidth over the same mapped bytes: R timed passes of a
 *    multi-threaded XOR sweep (256-bit loads where the CPU has AVX2); the best
 *    pass is the bandwidth.
 * 2. Decode: a 4-token prompt, then N greedy steps. Each step: seconds, and the
 *    weight bytes it touched (engine counters: trunk matrices and vectors, one
 *    embedding row, lm_head, the distinct routed experts of every MoE layer).
 *    Bound = bytes / bandwidth; ratio = seconds / bound. On a shared machine the
 *    bandwidth moves with the load, so a sweep also runs right before every
 *    step, and each step is compared with that adjacent sweep too
 *    (ratio_adjacent); both ratios are reported. Then `shoal bench`'s read pass
 *    (shoal_read_bw_pass, kernels/readbw.c) over 512 MiB of fresh memory, R
 *    passes (row=readpass); every step is also compared with its best pass
 *    (ratio_readpass). Each step's time by forward phase (coordinator/obs/
 *    cmetrics.h: attention, routing, experts, shared, combine, dense, head) is
 *    in its row, so the gap to the bound can be placed.
 * 3. Prefill: for each prompt length, P runs (default R) of a fresh sequence: seconds,
 *    tokens/s, process CPU seconds (all threads) and weight bytes read per prompt
 *    token. --max-batch B sets the engine's chunk size (shoal_model_opts.max_batch:
 *    a longer prompt runs in chunks of B); without it one chunk holds the longest
 *    prompt.
 * --numerics mu runs the matrix-unit order (AMX where it passed its self-test,
 * else its exact emulation; docs/ARCHITECTURE.md), portable (default) the
 * fp32-activation order; row=config says which ran and on which path.
 * OpenMP waits as in the `shoal` executable (cli/omp_wait.c: passive unless
 * OMP_WAIT_POLICY or GOMP_SPINCOUNT is set; the config row says which): with
 * libgomp's spinning default, 2 threads burned 1.4-1.7x the CPU per prefill
 * token of 1 thread, a cost `shoal` does not pay (docs/PERFORMANCE.md, issue 33).
 * Output: "key=value" rows (one per measurement) on stdout, for docs/data/. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "cli/omp_wait.h"

#include "common/err.h"
#include "common/st.h"
#include "coordinator/engine/engine.h"
#include "coordinator/obs/cmetrics.h"
#include "coordinator/engine/sampler.h"
#include "kernels/kernels.h"
#include "tests/bench/bench_util.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* XOR of every 64-bit word of [p, p+n) (n rounded down to 128 bytes), four
 * independent chains so the loads, not the XORs, set the pace. With AVX2 the
 * same loop runs on 256-bit vectors (GCC vector extensions, chosen at run time),
 * because 64-bit loads cannot saturate memory from one core and would understate
 * the bound the 256-bit GEMV kernels are held to (bench_sweep_avx2, bench_util.h). */
static uint64_t sweep_scalar(const uint8_t *p, size_t n)
{
    uint64_t a = 0, b = 0, c = 0, d = 0;
    size_t words = (n / 128) * 16;
    const uint64_t *w = (const uint64_t *)(const void *)p;
    for (size_t i = 0; i < words; i += 4) {
        a ^= w[i];
        b ^= w[i + 1];
        c ^= w[i + 2];
        d ^= w[i + 3];
    }
    return a ^ b ^ c ^ d;
}

static int use_avx2;

static uint64_t sweep(const uint8_t *p, size_t n)
{
    return use_avx2 ? bench_sweep_avx2(p, n) : sweep_scalar(p, n);
}

typedef struct {
    const uint8_t *p;
    size_t n;
} region;

/* one pass over all regions, split into 1 MiB pieces across threads */
static double read_pass(const region *r, int nr, uint64_t *sink)
{
    size_t total_pieces = 0;
    for (int i = 0; i < nr; i++)
        total_pieces += (r[i].n + (1u << 20) - 1) >> 20;
    double t0 = now();
    uint64_t acc = 0;
#pragma omp parallel for schedule(static) reduction(^ : acc)
    for (size_t k = 0; k < total_pieces; k++) {
        size_t kk = k;
        int i = 0;
        while (kk >= ((r[i].n + (1u << 20) - 1) >> 20)) {
            kk -= (r[i].n + (1u << 20) - 1) >> 20;
            i++;
        }
        size_t off = kk << 20, len = r[i].n - off < (1u << 20) ? r[i].n - off : (1u << 20);
        acc ^= sweep(r[i].p + off, len);
    }
    *sink ^= acc;
    return now() - t0;
}

/* CPU seconds of the whole process (every thread), for CPU-time rates on a shared machine */
static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr,
                "usage: %s MODEL [--threads N] [--steps N] [--prefill 128,512] [--reps R] [--prefill-reps P] "
                "[--max-batch B] [--numerics portable|mu]\n",
                argv[0]);
        return 2;
    }
    shoal_omp_wait_apply(argv); /* before any OpenMP region: may re-exec */
    const char *model = argv[1];
    int threads = 0, steps = 16, reps = 3, preps = -1, max_batch = 0;
    int plen[8] = {128, 512}, np = 2;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prefill-reps"))
            preps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-batch"))
            max_batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--numerics")) {
            shoal_numerics nc;
            if (shoal_numerics_parse(argv[i + 1], &nc)) {
                fprintf(stderr, "--numerics takes portable or mu, got '%s'\n", argv[i + 1]);
                return 2;
            }
            shoal_kernels_set_numerics(nc);
        }
        else if (!strcmp(argv[i], "--prefill")) {
            np = 0;
            for (char *s = argv[i + 1]; *s && np < 8;) {
                plen[np++] = (int)strtol(s, &s, 10);
                if (*s == ',')
                    s++;
            }
        } else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    int maxp = 0;
    for (int i = 0; i < np; i++)
        maxp = plen[i] > maxp ? plen[i] : maxp;
    char err[8192];
    shoal_model_opts mo = {.max_context = (maxp > 4 + steps ? maxp : 4 + steps) + 1,
                           .max_batch = max_batch > 0 ? max_batch : maxp > 0 ? maxp : 1,
                           .threads = threads};
    shoal_model *m = NULL;
    if (shoal_model_open(&m, model, &mo, err, sizeof err)) {
        fprintf(stderr, "open %s: %s\n", model, err);
        return 3;
    }
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    printf("row=config model=%s threads=%d omp_wait=%s isa=%s vocab=%d layers=%d experts=%d topk=%d "
           "trunk_bytes_per_token=%llu expert_bytes=%llu max_batch=%d numerics=%s mu_path=%s\n",
           model, omp_get_max_threads(), shoal_omp_wait_policy(), shoal_isa_name(shoal_kernels_isa()), info.vocab,
           info.cfg->num_layers,
           info.cfg->num_experts, info.cfg->experts_per_token, (unsigned long long)info.trunk_bytes_per_token,
           (unsigned long long)info.expert_bytes, mo.max_batch,
           shoal_numerics_name(shoal_kernels_numerics()), shoal_kernels_mu_engine());

    /* 1. bandwidth over the model's own mapped bytes */
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
    const shoal_st *st = shoal_model_store(m);
    size_t nt = shoal_st_count(st);
    region *rg = calloc(nt, sizeof *rg);
    int nr = 0;
    uint64_t mapped = 0;
    for (size_t i = 0; i < nt; i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        if (!t->data || t->nbytes < 32)
            continue;
        /* align the start to 8 bytes for the word sweep */
        uintptr_t a = ((uintptr_t)t->data + 7) & ~(uintptr_t)7;
        size_t skip = a - (uintptr_t)t->data;
        if (t->nbytes <= skip + 32)
            continue;
        rg[nr].p = (const uint8_t *)a;
        rg[nr].n = t->nbytes - skip;
        mapped += rg[nr].n;
        nr++;
    }
    uint64_t sink = 0;
    double warm = read_pass(rg, nr, &sink);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double s = read_pass(rg, nr, &sink);
        printf("row=bandwidth pass=%d bytes=%llu seconds=%.6f gbps=%.3f\n", r, (unsigned long long)mapped, s,
               (double)mapped / s / 1e9);
        best = s < best ? s : best;
    }
    double bw = (double)mapped / best;
    printf("row=bandwidth_best bytes=%llu warm_seconds=%.3f gbps=%.3f loads=%s sink=%llu\n",
           (unsigned long long)mapped, warm, bw / 1e9, use_avx2 ? "256-bit" : "64-bit", (unsigned long long)(sink & 1));

    /* `shoal bench`'s read pass (kernels/readbw.c) over fresh memory */
    size_t rb_words = ((size_t)512 << 20) / 8;
    uint64_t *rb = malloc(rb_words * 8);
    if (!rb) {
        fprintf(stderr, "out of memory for the read pass\n");
        return 4;
    }
    for (size_t i = 0; i < rb_words; i++)
        rb[i] = i * 0x9e3779b97f4a7c15ull;
    uint64_t rsink = 0;
    shoal_read_bw_pass(rb, rb_words, 0, &rsink);
    double rp_best = 0;
    for (int r = 0; r < reps; r++) {
        double g = shoal_read_bw_pass(rb, rb_words, 0, &rsink);
        printf("row=readpass pass=%d bytes=%zu gbps=%.3f\n", r, rb_words * 8, g);
        rp_best = g > rp_best ? g : rp_best;
    }
    free(rb);
    printf("row=readpass_best gbps=%.3f sink=%llu\n", rp_best, (unsigned long long)(rsink & 1));

    /* 2. decode */
    float *lg = malloc(sizeof(float) * (size_t)info.vocab);
    shoal_seq *s = NULL;
    if (shoal_seq_create(&s, m, 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 4;
    }
    shoal_cmetrics *cm = NULL;
    {
        shoal_cmetrics_opts co = {.num_layers = info.cfg->num_layers, .is_moe = info.cfg->is_moe,
                                  .num_experts = info.cfg->num_experts,
                                  .expert_bytes = info.expert_bytes};
        if (shoal_cmetrics_open(&cm, &co, err, sizeof err)) {
            fprintf(stderr, "cmetrics: %s\n", err);
            return 4;
        }
        shoal_model_set_monitor(m, cm, NULL);
    }
    int32_t prompt[4] = {1, 2, 3, 4};
    if (shoal_seq_prefill(s, prompt, 4, SHOAL_LOGITS_LAST, lg, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 4;
    }
    double *st_s = malloc(sizeof(double) * (size_t)(steps > 0 ? steps : 1));
    double *ratio = malloc(sizeof(double) * (size_t)(steps > 0 ? steps : 1));
    double *ratio_adj = malloc(sizeof(double) * (size_t)(steps > 0 ? steps : 1));
    double *ratio_rp = malloc(sizeof(double) * (size_t)(steps > 0 ? steps : 1));
    uint64_t bytes_sum = 0;
    for (int i = 0; i < steps; i++) {
        double adj_bw = (double)mapped / read_pass(rg, nr, &sink);
        shoal_model_stats a, b;
        shoal_cmetrics_totals pa, pb;
        shoal_model_get_stats(m, &a);
        shoal_cmetrics_get_totals(cm, &pa);
        int32_t id = shoal_argmax(lg, info.vocab);
        double t0 = now();
        if (shoal_seq_decode(s, id, lg, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return 4;
        }
        double dt = now() - t0;
        shoal_model_get_stats(m, &b);
        shoal_cmetrics_get_totals(cm, &pb);
        uint64_t bytes = (b.trunk_bytes - a.trunk_bytes) + (b.expert_bytes - a.expert_bytes);
        double bound = (double)bytes / bw;
        st_s[i] = dt;
        ratio[i] = dt / bound;
        ratio_adj[i] = dt / ((double)bytes / adj_bw);
        bytes_sum += bytes;
        printf("row=decode step=%d seconds=%.6f bytes=%llu bound_seconds=%.6f ratio=%.3f adjacent_gbps=%.3f "
               "ratio_adjacent=%.3f experts_seconds=%.6f ratio_readpass=%.3f",
               i, dt, (unsigned long long)bytes, bound, dt / bound, adj_bw / 1e9, ratio_adj[i],
               b.experts_s - a.experts_s, dt / ((double)bytes / (rp_best * 1e9)));
        for (int ph = 0; ph < SHOAL_PHASE_SAMPLING; ph++)
            printf(" phase_%s_seconds=%.6f", shoal_cmetrics_phase_name(ph), pb.phase_s[ph] - pa.phase_s[ph]);
        printf("\n");
        ratio_rp[i] = dt / ((double)bytes / (rp_best * 1e9));
    }
    if (steps > 0) {
        qsort(st_s, (size_t)steps, sizeof(double), cmp_d);
        qsort(ratio, (size_t)steps, sizeof(double), cmp_d);
        qsort(ratio_adj, (size_t)steps, sizeof(double), cmp_d);
        qsort(ratio_rp, (size_t)steps, sizeof(double), cmp_d);
        printf("row=decode_summary steps=%d median_seconds=%.6f min_seconds=%.6f max_seconds=%.6f "
               "mean_bytes=%.0f median_ratio=%.3f min_ratio=%.3f max_ratio=%.3f median_ratio_adjacent=%.3f "
               "min_ratio_adjacent=%.3f max_ratio_adjacent=%.3f median_ratio_readpass=%.3f min_ratio_readpass=%.3f "
               "max_ratio_readpass=%.3f\n",
               steps, st_s[steps / 2], st_s[0], st_s[steps - 1], (double)bytes_sum / steps, ratio[steps / 2],
               ratio[0], ratio[steps - 1], ratio_adj[steps / 2], ratio_adj[0], ratio_adj[steps - 1],
               ratio_rp[steps / 2], ratio_rp[0], ratio_rp[steps - 1]);
    }
    fflush(stdout);

    /* 3. prefill */
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(maxp > 0 ? maxp : 1));
    for (int i = 0; i < maxp; i++)
        ids[i] = (int32_t)((i * 2654435761u) % (unsigned)(info.vocab < 3000 ? info.vocab : 3000));
    if (preps < 0)
        preps = reps;
    for (int pi = 0; pi < np; pi++) {
        for (int r = 0; r < preps; r++) {
            shoal_seq_reset(s);
            shoal_model_stats a, b;
            shoal_model_get_stats(m, &a);
            double c0 = cpu_now(), t0 = now();
            if (shoal_seq_prefill(s, ids, plen[pi], SHOAL_LOGITS_LAST, lg, err, sizeof err)) {
                fprintf(stderr, "%s\n", err);
                return 4;
            }
            double dt = now() - t0, dc = cpu_now() - c0;
            shoal_model_get_stats(m, &b);
            uint64_t bytes = (b.trunk_bytes - a.trunk_bytes) + (b.expert_bytes - a.expert_bytes);
            printf("row=prefill tokens=%d rep=%d seconds=%.4f tokens_per_s=%.3f cpu_seconds=%.4f bytes_per_token=%.0f "
                   "experts_seconds=%.4f chunks=%llu\n",
                   plen[pi], r, dt, plen[pi] / dt, dc, (double)bytes / plen[pi], b.experts_s - a.experts_s,
                   (unsigned long long)(b.chunks - a.chunks));
            fflush(stdout);
        }
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("row=rss peak_bytes=%llu\n", (unsigned long long)ru.ru_maxrss * 1024ull);
    shoal_seq_free(s);
    shoal_model_close(m);
    shoal_cmetrics_close(cm);
    free(lg);
    free(ids);
    free(st_s);
    free(ratio);
    free(ratio_adj);
    free(ratio_rp);
    free(rg);
    return 0;
}
