/* bench_spec: the cost of a speculative verify pass (shoal_seq_verify, T = K+1
 * tokens, every position's logits, per-position KDA states kept) against a
 * plain decode step (T = 1), at the same position of the same sequence, for
 * K = 0..kmax (docs/PERFORMANCE.md, issue 21). Each repetition restores the
 * sequence to the position after the prompt (shoal_seq_copy from a snapshot,
 * not timed) and times one forward; the order of T values is rotated per
 * repetition so drift in the machine's load spreads over all of them. Also
 * times, at T = kmax+1, the same chunk without keeping states (a plain
 * prefill with all logits: the cost of the state copies) and the rewind.
 * Experts in process, or remote with the distributed flags (--workers N,
 * --worker EP ... --insecure-workers) as for `shoal run`.
 *
 * Usage: bench_spec MODEL_DIR [--kmax K] [--reps R] [--prompt N] [--threads N]
 *        [distributed-expert flags]
 * Prints one JSON object per measurement and a summary object last. */
#include <jansson.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/engine/engine.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_spec MODEL_DIR [--kmax K] [--reps R] [--prompt N] [--threads N] [dist flags]\n");
        return 2;
    }
    const char *dir = argv[1];
    int kmax = 8, reps = 3, np = 32, threads = 0;
    shoal_dist_opts dopts = {0};
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--kmax") && i + 1 < argc)
            kmax = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            np = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (shoal_dist_parse_arg(&dopts, "bench_spec", argc, argv, &i) <= 0) {
            fprintf(stderr, "bench_spec: bad argument '%s'\n", argv[i]);
            return 2;
        }
    }
    char err[4096];
    shoal_model_opts mo = {.max_context = np + kmax + 8, .max_batch = kmax + 1 > 16 ? kmax + 1 : 16,
                           .threads = threads, .quiet = 1, .remote_experts = shoal_dist_enabled(&dopts)};
    shoal_model *m;
    int rc = shoal_model_open(&m, dir, &mo, err, sizeof err);
    if (rc) {
        fprintf(stderr, "bench_spec: %s\n", err);
        return 3;
    }
    shoal_dist *dist = NULL;
    if (shoal_dist_enabled(&dopts) && (rc = shoal_dist_start(&dist, &dopts, dir, m, err, sizeof err))) {
        fprintf(stderr, "bench_spec: workers: %s\n", err);
        shoal_model_close(m);
        return 3;
    }
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    int V = info.vocab, NT = kmax + 1;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(np + NT));
    for (int i = 0; i < np + NT; i++)
        ids[i] = (int32_t)((1000 + 7919 * (int64_t)i) % (V > 3840 ? 3840 : V)); /* ordinary ids */
    float *lg = malloc(sizeof(float) * (size_t)NT * (size_t)V);
    shoal_seq *snap, *s;
    if (shoal_seq_create(&snap, m, 0, err, sizeof err) || shoal_seq_create(&s, m, 0, err, sizeof err) ||
        shoal_seq_reserve_rewind(s, kmax, err, sizeof err)) {
        fprintf(stderr, "bench_spec: %s\n", err);
        return 3;
    }
    double t0 = now_s();
    if ((rc = shoal_seq_prefill(snap, ids, np, SHOAL_LOGITS_NONE, NULL, err, sizeof err))) {
        fprintf(stderr, "bench_spec: prefill: %s\n", err);
        return 4;
    }
    double prefill_s = now_s() - t0;
    /* warm-up: one T = 1 and one T = NT pass */
    shoal_seq_copy(s, snap, err, sizeof err);
    shoal_seq_verify(s, ids + np, 1, lg, err, sizeof err);
    shoal_seq_copy(s, snap, err, sizeof err);
    shoal_seq_verify(s, ids + np, NT, lg, err, sizeof err);

    double *t = calloc((size_t)(NT + 1) * (size_t)reps, sizeof(double)); /* [T index][rep]; NT = no states */
    double *rw = calloc((size_t)reps, sizeof(double));
    double *tc = calloc((size_t)(NT + 1) * (size_t)reps, sizeof(double)); /* process CPU seconds */
    for (int r = 0; r < reps; r++) {
        for (int j = 0; j <= NT; j++) {
            int ti = (j + r) % (NT + 1); /* 0..NT-1: verify of T = ti+1; NT: prefill of NT without states */
            shoal_seq_copy(s, snap, err, sizeof err);
            double a = now_s(), ca = cpu_s();
            if (ti < NT)
                rc = shoal_seq_verify(s, ids + np, ti + 1, lg, err, sizeof err);
            else
                rc = shoal_seq_prefill(s, ids + np, NT, SHOAL_LOGITS_ALL, lg, err, sizeof err);
            double b = now_s(), cb = cpu_s();
            if (rc) {
                fprintf(stderr, "bench_spec: forward: %s\n", err);
                return 4;
            }
            t[(size_t)ti * reps + r] = b - a;
            tc[(size_t)ti * reps + r] = cb - ca;
            printf("{\"rep\":%d,\"T\":%d,\"states\":%s,\"s\":%.6f,\"cpu_s\":%.6f}\n", r, ti < NT ? ti + 1 : NT,
                   ti < NT ? "true" : "false", b - a, cb - ca);
            fflush(stdout);
            if (ti == NT - 1) { /* the rewind from the longest chunk back to its first token */
                a = now_s();
                rc = shoal_seq_rewind(s, np + 1, err, sizeof err);
                rw[r] = now_s() - a;
                if (rc) {
                    fprintf(stderr, "bench_spec: rewind: %s\n", err);
                    return 4;
                }
            }
        }
    }
    json_t *o = json_object(), *med = json_array(), *ratio = json_array();
    double base = median(t, reps);
    json_array_append_new(med, json_real(base));
    json_array_append_new(ratio, json_real(1.0));
    for (int ti = 1; ti < NT; ti++) {
        double v = median(t + (size_t)ti * reps, reps);
        json_array_append_new(med, json_real(v));
        json_array_append_new(ratio, json_real(v / base));
    }
    double nost = median(t + (size_t)NT * reps, reps);
    json_t *cmed = json_array();
    for (int ti = 0; ti <= NT; ti++)
        json_array_append_new(cmed, json_real(median(tc + (size_t)ti * reps, reps)));
    json_object_set_new(o, "model", json_string(dir));
    json_object_set_new(o, "workers", json_integer(shoal_dist_nworkers(dist)));
    json_object_set_new(o, "threads", json_integer(omp_get_max_threads()));
    json_object_set_new(o, "prompt", json_integer(np));
    json_object_set_new(o, "reps", json_integer(reps));
    json_object_set_new(o, "prefill_s", json_real(prefill_s));
    json_object_set_new(o, "median_s_by_T", med);
    json_object_set_new(o, "ratio_to_T1", ratio);
    json_object_set_new(o, "median_s_T_max_without_states", json_real(nost));
    json_object_set_new(o, "median_cpu_s_by_T_then_without_states", cmed);
    json_object_set_new(o, "median_rewind_s", json_real(median(rw, reps)));
    json_object_set_new(o, "seq_fixed_bytes", json_integer((json_int_t)info.seq_fixed_bytes));
    char *js = json_dumps(o, JSON_COMPACT);
    printf("%s\n", js);
    free(js);
    json_decref(o);
    shoal_seq_free(s);
    shoal_seq_free(snap);
    shoal_model_close(m);
    shoal_dist_stop(dist);
    free(t);
    free(rw);
    free(tc);
    free(lg);
    free(ids);
    return 0;
}
