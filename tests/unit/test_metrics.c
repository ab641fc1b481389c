/* common/metrics: bucket boundaries, quantiles, concurrency, the Prometheus
 * writer (exact text, escaping) and the parser (round trip, refusals).
 * With SHOAL_METRICS_DUMP=PATH, also writes a sample exposition there for
 * tests/e2e/test_metrics_expo.py to check with the prometheus_client parser. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/metrics.h"
#include "test.h"

static void t_bucket_bounds(void)
{
    /* b_i = 2^(i/4) µs, hand-computed: b_1 = 1189.207 ns, b_4 = 2000 ns */
    CHECK_EQ_INT(shoal_metrics_bucket_of(0), 0);
    CHECK_EQ_INT(shoal_metrics_bucket_of(1000), 0);
    CHECK_EQ_INT(shoal_metrics_bucket_of(1001), 1);
    CHECK_EQ_INT(shoal_metrics_bucket_of(1189), 1);
    CHECK_EQ_INT(shoal_metrics_bucket_of(1190), 2);
    CHECK_EQ_INT(shoal_metrics_bucket_of(2000), 4);
    CHECK_EQ_INT(shoal_metrics_bucket_of(2001), 5);
    CHECK_EQ_INT(shoal_metrics_bucket_of(1000000), 40);       /* 1000 µs: 4·log2(1000) = 39.86 */
    CHECK_EQ_INT(shoal_metrics_bucket_of(1024000), 40);       /* 2^10 µs = b_40 exactly */
    CHECK_EQ_INT(shoal_metrics_bucket_of(1024001), 41);
    CHECK_EQ_INT(shoal_metrics_bucket_of(268435456000ull), 112); /* 2^28 µs = last bound */
    CHECK_EQ_INT(shoal_metrics_bucket_of(268435456001ull), 113); /* overflow */
    CHECK_EQ_INT(shoal_metrics_bucket_of(UINT64_MAX), SHOAL_METRICS_HIST_BOUNDS);
    CHECK_NEAR(shoal_metrics_bound_s(0), 1e-6, 1e-18);
    CHECK_NEAR(shoal_metrics_bound_s(1), 1.189207115e-6, 1e-15);
    CHECK_NEAR(shoal_metrics_bound_s(112), 268.435456, 1e-9);
    CHECK(isinf(shoal_metrics_bound_s(113)));
}

static shoal_metrics_hist hist_zero;

static void t_quantiles(void)
{
    shoal_metrics_hist h = hist_zero;
    shoal_metrics_snap s;
    shoal_metrics_snapshot(&h, &s);
    CHECK(isnan(shoal_metrics_quantile(&s, 0.5)));

    /* ten observations of exactly 2 µs: all in bucket 4 = (2^(3/4), 2^1] µs.
     * p50 -> rank 5 of 10 -> halfway (geometrically) through the bucket:
     * 2^(3.5/4) µs; p100 is the upper bound = the maximum = 2 µs. */
    for (int i = 0; i < 10; i++)
        shoal_metrics_observe(&h, 2000);
    shoal_metrics_snapshot(&h, &s);
    CHECK_EQ_INT(s.count, 10);
    CHECK_EQ_INT(s.sum_ns, 20000);
    CHECK_EQ_INT(s.max_ns, 2000);
    CHECK_EQ_INT(s.bucket[4], 10);
    CHECK_NEAR(shoal_metrics_quantile(&s, 0.5), 1e-6 * pow(2.0, 3.5 / 4), 1e-12);
    CHECK_NEAR(shoal_metrics_quantile(&s, 1.0), 2e-6, 1e-15);

    /* 1000 observations 1..1000 µs: every quantile within one bucket
     * width (factor 2^(1/4)) of the exact order statistic */
    shoal_metrics_hist g = hist_zero;
    for (int i = 1; i <= 1000; i++)
        shoal_metrics_observe(&g, (uint64_t)i * 1000);
    shoal_metrics_snapshot(&g, &s);
    const double qs[] = {0.5, 0.9, 0.99};
    for (int i = 0; i < 3; i++) {
        double exact = qs[i] * 1000e-6, est = shoal_metrics_quantile(&s, qs[i]);
        CHECK_MSG(est / exact < 1.19 && exact / est < 1.19, "q=%g est %g exact %g", qs[i], est, exact);
    }
    /* never above the maximum, even in the top bucket */
    CHECK(shoal_metrics_quantile(&s, 1.0) <= 1000e-6 + 1e-15);

    /* merge: two snapshots add up bucket-wise */
    shoal_metrics_snap a, b;
    shoal_metrics_snapshot(&h, &a);
    shoal_metrics_snapshot(&g, &b);
    shoal_metrics_snap_merge(&a, &b);
    CHECK_EQ_INT(a.count, 1010);
    CHECK_EQ_INT(a.max_ns, 1000000);
    CHECK_EQ_INT(a.sum_ns, 20000 + 500500000ull);
}

#define NTHREADS 4
#define NPER 100000
static shoal_metrics_hist conc_h;
static shoal_metrics_counter conc_c;

static void *conc_worker(void *arg)
{
    uint64_t base = (uint64_t)(uintptr_t)arg;
    for (uint64_t i = 0; i < NPER; i++) {
        shoal_metrics_observe(&conc_h, base + i);
        shoal_metrics_add(&conc_c, 3);
    }
    return NULL;
}

static void t_concurrent(void)
{
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++)
        pthread_create(&th[i], NULL, conc_worker, (void *)(uintptr_t)(i * 1000000));
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    shoal_metrics_snap s;
    shoal_metrics_snapshot(&conc_h, &s);
    CHECK_EQ_INT(s.count, NTHREADS * NPER);
    /* sum over threads t of sum_i (t*1e6 + i) */
    uint64_t want = 0;
    for (int t = 0; t < NTHREADS; t++)
        want += (uint64_t)t * 1000000 * NPER + (uint64_t)NPER * (NPER - 1) / 2;
    CHECK_EQ_INT(s.sum_ns, want);
    CHECK_EQ_INT(s.max_ns, (NTHREADS - 1) * 1000000 + NPER - 1);
    CHECK_EQ_INT(shoal_metrics_get(&conc_c), 3ull * NTHREADS * NPER);
}

static void t_writer_exact(void)
{
    shoal_metrics_buf b = {0};
    shoal_metrics_family(&b, "shoal_x_total", SHOAL_METRICS_COUNTER, "Things\\counted\nhere.");
    shoal_metrics_label l[] = {{"worker", "w\"0\\a\nb"}, {"layer", "3"}};
    shoal_metrics_sample(&b, "shoal_x_total", l, 2, 42);
    shoal_metrics_sample(&b, "shoal_x_total", NULL, 0, 0.25);
    shoal_metrics_family(&b, "shoal_g", SHOAL_METRICS_GAUGE, "A gauge.");
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, NAN);
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, INFINITY);
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, -INFINITY);
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, 0.1);
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, 1e300);
    shoal_metrics_sample(&b, "shoal_g", NULL, 0, -7);
    const char *want = "# HELP shoal_x_total Things\\\\counted\\nhere.\n"
                       "# TYPE shoal_x_total counter\n"
                       "shoal_x_total{worker=\"w\\\"0\\\\a\\nb\",layer=\"3\"} 42\n"
                       "shoal_x_total 0.25\n"
                       "# HELP shoal_g A gauge.\n"
                       "# TYPE shoal_g gauge\n"
                       "shoal_g NaN\n"
                       "shoal_g +Inf\n"
                       "shoal_g -Inf\n"
                       "shoal_g 0.1\n"
                       "shoal_g 1e+300\n"
                       "shoal_g -7\n";
    CHECK_MSG(b.p && !strcmp(b.p, want), "got:\n%s", b.p ? b.p : "(null)");
    shoal_metrics_buf_free(&b);
}

static void t_writer_hist(void)
{
    shoal_metrics_hist h = hist_zero;
    shoal_metrics_observe(&h, 500);        /* bucket 0 (<= 1 µs) */
    shoal_metrics_observe(&h, 1500);       /* 4·log2(1.5) = 2.34: bucket 3 = (1.414, 1.682] µs */
    shoal_metrics_observe(&h, 3000000000); /* 3 s */
    shoal_metrics_snap s;
    shoal_metrics_snapshot(&h, &s);
    shoal_metrics_buf b = {0};
    shoal_metrics_family(&b, "shoal_h_seconds", SHOAL_METRICS_HISTOGRAM, "h");
    shoal_metrics_label l[] = {{"worker", "a"}};
    shoal_metrics_hist_samples(&b, "shoal_h_seconds", l, 1, &s);
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_bucket{worker=\"a\",le=\"1e-06\"} 1\n");
    /* le = 2 µs (i = 4): 2; 3 s is in bucket 87 (4·log2(3e6) = 86.07), so
     * le = 2^21 µs (i = 84) still 2, le = 2^22 µs (i = 88) 3 */
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_bucket{worker=\"a\",le=\"2e-06\"} 2\n");
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_bucket{worker=\"a\",le=\"2.097152\"} 2\n");
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_bucket{worker=\"a\",le=\"4.194304\"} 3\n");
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_bucket{worker=\"a\",le=\"+Inf\"} 3\n");
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_sum{worker=\"a\"} 3.000002\n");
    CHECK_STR_CONTAINS(b.p, "shoal_h_seconds_count{worker=\"a\"} 3\n");
    /* 57 finite bounds exposed (every other of 113) + Inf */
    int nb = 0;
    for (const char *p = b.p; (p = strstr(p, "_bucket{")); p++)
        nb++;
    CHECK_EQ_INT(nb, 58);
    shoal_metrics_buf_free(&b);
}

typedef struct {
    int n;
    char names[8][64];
    char lv[8][64];
    double v[8];
} collect_ctx;

static int collect(void *ctx, const shoal_metrics_parsed *s)
{
    collect_ctx *c = ctx;
    if (c->n >= 8)
        return 1;
    snprintf(c->names[c->n], 64, "%s", s->name);
    const char *w = shoal_metrics_label_get(s, "worker");
    snprintf(c->lv[c->n], 64, "%s", w ? w : "");
    c->v[c->n] = s->value;
    c->n++;
    return 0;
}

static void t_parse_roundtrip(void)
{
    shoal_metrics_buf b = {0};
    shoal_metrics_family(&b, "shoal_x_total", SHOAL_METRICS_COUNTER, "x");
    shoal_metrics_label l[] = {{"worker", "w\"0\\a\nb"}};
    shoal_metrics_sample(&b, "shoal_x_total", l, 1, 42);
    shoal_metrics_sample(&b, "shoal_x_total", NULL, 0, NAN);
    shoal_metrics_sample(&b, "shoal_y", NULL, 0, -INFINITY);
    shoal_metrics_sample(&b, "shoal_y", NULL, 0, 1.0 / 3);
    collect_ctx c = {0};
    char err[256] = "";
    CHECK_EQ_INT(shoal_metrics_parse(b.p, b.len, collect, &c, err, sizeof err), 0);
    CHECK_EQ_INT(c.n, 4);
    CHECK(!strcmp(c.names[0], "shoal_x_total"));
    CHECK(!strcmp(c.lv[0], "w\"0\\a\nb"));
    CHECK(c.v[0] == 42);
    CHECK(isnan(c.v[1]));
    CHECK(isinf(c.v[2]) && c.v[2] < 0);
    CHECK(c.v[3] == 1.0 / 3); /* exact: the writer prints round-trip digits */
    shoal_metrics_buf_free(&b);

    /* timestamps, CR LF, spaces inside braces, trailing comma */
    const char *t = "# c\r\n\r\na_b{ worker = \"x\" , } 1.5 1700000000000\r\nz 2\n";
    collect_ctx d = {0};
    CHECK_EQ_INT(shoal_metrics_parse(t, strlen(t), collect, &d, err, sizeof err), 0);
    CHECK_EQ_INT(d.n, 2);
    CHECK(!strcmp(d.lv[0], "x") && d.v[0] == 1.5 && d.v[1] == 2);
}

static void t_parse_refusals(void)
{
    const char *bad[] = {
        "x{a=\"1} 2\n",      /* unterminated value */
        "x{a=\"\\q\"} 2\n",  /* unknown escape */
        "x{a=1} 2\n",        /* unquoted */
        "x 0x10\n",          /* hex */
        "x nan\n",           /* lower-case nan is not the format's NaN */
        "x 1 2 3\n",         /* garbage after timestamp */
        "1x 2\n",            /* name starts with a digit */
        "x{1a=\"1\"} 2\n",   /* label name starts with a digit */
        "x\n",               /* no value */
        "x{a=\"1\" b=\"2\"} 3\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        collect_ctx c = {0};
        char err[256] = "";
        int rc = shoal_metrics_parse(bad[i], strlen(bad[i]), collect, &c, err, sizeof err);
        CHECK_MSG(rc == SHOAL_EFORMAT, "accepted: %s", bad[i]);
        CHECK_STR_CONTAINS(err, "metrics line 1:");
    }
    /* 17 labels: one too many */
    char many[1024] = "x{";
    for (int i = 0; i < 17; i++) {
        char l[32];
        snprintf(l, sizeof l, "%sl%d=\"v\"", i ? "," : "", i);
        strcat(many, l);
    }
    strcat(many, "} 1\n");
    collect_ctx c = {0};
    char err[256] = "";
    CHECK_EQ_INT(shoal_metrics_parse(many, strlen(many), collect, &c, err, sizeof err), SHOAL_EFORMAT);
    CHECK_STR_CONTAINS(err, "too many labels");
    /* a NUL inside a line */
    const char nul[] = "x 1\ny\0 2\n";
    CHECK_EQ_INT(shoal_metrics_parse(nul, sizeof nul - 1, collect, &c, err, sizeof err), SHOAL_EFORMAT);
    CHECK_STR_CONTAINS(err, "line 2");
}

/* The exposition checked by tests/e2e/test_metrics_expo.py with Python's
 * prometheus_client parser (values known there independently). */
static int write_dump(const char *path)
{
    shoal_metrics_buf b = {0};
    shoal_metrics_family(&b, "shoal_test_requests_total", SHOAL_METRICS_COUNTER, "Requests \\ with \"help\"\nline.");
    shoal_metrics_label l1[] = {{"worker", "a\"b\\c\nd"}, {"endpoint", "tcp://127.0.0.1:5555"}};
    shoal_metrics_sample(&b, "shoal_test_requests_total", l1, 2, 7);
    shoal_metrics_family(&b, "shoal_test_share", SHOAL_METRICS_GAUGE, "A ratio.");
    shoal_metrics_label l2[] = {{"worker", "w1"}};
    shoal_metrics_sample(&b, "shoal_test_share", l2, 1, 0.125);
    shoal_metrics_hist h = hist_zero;
    for (int i = 1; i <= 100; i++)
        shoal_metrics_observe(&h, (uint64_t)i * 10000); /* 10 µs .. 1 ms */
    shoal_metrics_snap s;
    shoal_metrics_snapshot(&h, &s);
    shoal_metrics_family(&b, "shoal_test_rtt_seconds", SHOAL_METRICS_HISTOGRAM, "Round trips.");
    shoal_metrics_hist_samples(&b, "shoal_test_rtt_seconds", l2, 1, &s);
    shoal_metrics_family(&b, "shoal_test_rtt_q_seconds", SHOAL_METRICS_SUMMARY, "Round trip quantiles.");
    const double qs[] = {0.5, 0.9, 0.99};
    shoal_metrics_summary_samples(&b, "shoal_test_rtt_q_seconds", l2, 1, &s, qs, 3);
    FILE *f = fopen(path, "w");
    int ok = f && fwrite(b.p, 1, b.len, f) == b.len;
    if (f && fclose(f))
        ok = 0;
    shoal_metrics_buf_free(&b);
    if (!ok)
        fprintf(stderr, "test_metrics: cannot write %s\n", path);
    return ok ? 0 : 1;
}

int main(void)
{
    const char *dump = getenv("SHOAL_METRICS_DUMP");
    if (dump)
        return write_dump(dump);
    test_binary = "test_metrics";
    RUN(t_bucket_bounds);
    RUN(t_quantiles);
    RUN(t_concurrent);
    RUN(t_writer_exact);
    RUN(t_writer_hist);
    RUN(t_parse_roundtrip);
    RUN(t_parse_refusals);
    return test_finish();
}
