/* metrics: lock-free counters, gauges and latency histograms that hot paths
 * update, and the Prometheus text exposition (format 0.0.4) that /metrics
 * endpoints write from them; plus a parser of that format for `shoal top` and
 * the tests. Owns no registry: each module keeps its counters in its own
 * struct (worker/wmetrics, coordinator/cmetrics) and writes its own families
 * with the writer below, so a metric's name, labels and help live next to the
 * code that updates it (and in docs/METRICS.md).
 *
 * Thread-safety: every update (counter add, gauge set, histogram observe) is
 * one or a few relaxed atomic operations, callable from any thread, never
 * allocating, never logging. A snapshot read concurrently with updates is not
 * a single instant, but each bucket and counter is monotonic and a snapshot's
 * count is the sum of its buckets, so an exposition is always self-consistent.
 * The writer and the parser are plain functions over caller-owned buffers. */
#ifndef SHOAL_METRICS_H
#define SHOAL_METRICS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* ---- counters and gauges ---------------------------------------------- */

typedef struct {
    _Atomic uint64_t v;
} shoal_metrics_counter;

typedef struct {
    _Atomic int64_t v;
} shoal_metrics_gauge;

static inline void shoal_metrics_add(shoal_metrics_counter *c, uint64_t n)
{
    atomic_fetch_add_explicit(&c->v, n, memory_order_relaxed);
}
static inline uint64_t shoal_metrics_get(const shoal_metrics_counter *c)
{
    return atomic_load_explicit(&((shoal_metrics_counter *)c)->v, memory_order_relaxed);
}
static inline void shoal_metrics_gauge_set(shoal_metrics_gauge *g, int64_t v)
{
    atomic_store_explicit(&g->v, v, memory_order_relaxed);
}
static inline void shoal_metrics_gauge_add(shoal_metrics_gauge *g, int64_t d)
{
    atomic_fetch_add_explicit(&g->v, d, memory_order_relaxed);
}
static inline int64_t shoal_metrics_gauge_get(const shoal_metrics_gauge *g)
{
    return atomic_load_explicit(&((shoal_metrics_gauge *)g)->v, memory_order_relaxed);
}

/* CLOCK_MONOTONIC in nanoseconds (for durations; no allocation, no lock). */
static inline uint64_t shoal_metrics_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- latency histograms ----------------------------------------------- */
/* Fixed, log-spaced buckets: finite upper bounds b_i = 2^(i/4) µs for
 * i = 0 .. SHOAL_METRICS_HIST_BOUNDS-1 (1 µs .. 2^28 µs ≈ 268 s; four buckets
 * per octave, so a quantile read from the buckets is within a factor 2^(1/4)
 * ≈ 1.19 of the true value), plus one overflow bucket. Bucket i counts
 * observations v with b_{i-1} < v <= b_i (Prometheus `le` semantics).
 * Observations are nanoseconds. */
#define SHOAL_METRICS_HIST_PER_OCTAVE 4
#define SHOAL_METRICS_HIST_BOUNDS (28 * SHOAL_METRICS_HIST_PER_OCTAVE + 1)
#define SHOAL_METRICS_HIST_BUCKETS (SHOAL_METRICS_HIST_BOUNDS + 1)

typedef struct {
    _Atomic uint64_t bucket[SHOAL_METRICS_HIST_BUCKETS];
    _Atomic uint64_t sum_ns;
    _Atomic uint64_t max_ns;
} shoal_metrics_hist;

/* A plain copy, for quantiles and exposition. count = sum of bucket[]. */
typedef struct {
    uint64_t bucket[SHOAL_METRICS_HIST_BUCKETS];
    uint64_t count, sum_ns, max_ns;
} shoal_metrics_snap;

/* Record one observation (lock-free, any thread). */
void shoal_metrics_observe(shoal_metrics_hist *h, uint64_t ns);
/* Index of the bucket ns falls in (0 .. SHOAL_METRICS_HIST_BUCKETS-1). */
int shoal_metrics_bucket_of(uint64_t ns);
/* Upper bound of bucket i in seconds (+Inf for the overflow bucket). */
double shoal_metrics_bound_s(int i);

void shoal_metrics_snapshot(const shoal_metrics_hist *h, shoal_metrics_snap *out);
/* dst += src (bucket-wise; max of the maxima). */
void shoal_metrics_snap_merge(shoal_metrics_snap *dst, const shoal_metrics_snap *src);
/* The q-quantile (0 <= q <= 1) in seconds, estimated from the buckets: the
 * bucket holding rank q*count, interpolated geometrically inside it (linearly
 * in the first bucket), never above the recorded maximum. NaN when empty. */
double shoal_metrics_quantile(const shoal_metrics_snap *s, double q);

/* ---- Prometheus text exposition --------------------------------------- */

/* A growable output buffer (the exposition is not a hot path). */
typedef struct {
    char *p;
    size_t len, cap;
} shoal_metrics_buf;

void shoal_metrics_buf_free(shoal_metrics_buf *b); /* frees p; zeroes b */
void shoal_metrics_buf_printf(shoal_metrics_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

typedef struct {
    const char *name;  /* [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" */
    const char *value; /* any UTF-8; escaped on output */
} shoal_metrics_label;

typedef enum {
    SHOAL_METRICS_COUNTER,
    SHOAL_METRICS_GAUGE,
    SHOAL_METRICS_HISTOGRAM,
    SHOAL_METRICS_SUMMARY,
} shoal_metrics_type;

/* "# HELP name help\n# TYPE name type\n". Write once per family, before its
 * samples. Names are compile-time constants: an invalid metric name is a
 * broken invariant (panic), not an input error. */
void shoal_metrics_family(shoal_metrics_buf *b, const char *name, shoal_metrics_type type, const char *help);
/* One sample line "name{labels} value". Values print as integers when they
 * are integral and below 2^53, else with 17 significant digits; NaN and
 * infinities as NaN, +Inf, -Inf. */
void shoal_metrics_sample(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels, int nlabels,
                          double value);
/* A histogram family's samples for one label set: name_bucket{...,le="b"}
 * cumulative for every other bound (factor √2, 1 µs .. 268 s) and +Inf,
 * name_sum (seconds), name_count. */
void shoal_metrics_hist_samples(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels,
                                int nlabels, const shoal_metrics_snap *s);
/* A summary family's samples for one label set: name{...,quantile="q"} for
 * each of qs[nq] (NaN when empty), name_sum (seconds), name_count. */
void shoal_metrics_summary_samples(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels,
                                   int nlabels, const shoal_metrics_snap *s, const double *qs, int nq);

/* ---- the process ------------------------------------------------------ */

/* shoal_build_info{version,commit,isa,kernels,numerics,mu_path} 1 (isa: the
 * best variant this CPU supports; kernels: the variant in use, SHOAL_ISA may
 * lower it; commit: the git commit at configure time; numerics: the process's
 * numerics class, portable or mu; mu_path: what computes the matrix-unit
 * order, amx/avx512/avx2/scalar) and process_start_time_seconds (Unix time,
 * from /proc/self/stat and the boot time), for both processes. */
void shoal_metrics_process_families(shoal_metrics_buf *b, const char *version, const char *isa,
                                    const char *kernels, const char *numerics, const char *mu_path);
/* The process start as Unix time in seconds (cached; the time of the first
 * call when /proc cannot tell). */
double shoal_metrics_process_start_s(void);

/* ---- parsing (for `shoal top` and tests) ------------------------------ */

#define SHOAL_METRICS_MAX_LABELS 16

typedef struct {
    const char *name; /* NUL-terminated copies valid during the callback only */
    int nlabels;
    shoal_metrics_label labels[SHOAL_METRICS_MAX_LABELS];
    double value;
} shoal_metrics_parsed;

/* Parse Prometheus text (comments and blank lines skipped, timestamps
 * ignored) calling fn for each sample; fn returns non-zero to stop. Every
 * byte is checked: a malformed line, an unterminated label value, an
 * unknown escape or more than SHOAL_METRICS_MAX_LABELS labels is refused
 * with SHOAL_EFORMAT naming the line number. Returns 0, or fn's non-zero
 * return, or SHOAL_EFORMAT. */
int shoal_metrics_parse(const char *text, size_t len, int (*fn)(void *ctx, const shoal_metrics_parsed *s),
                        void *ctx, char *err, size_t errlen);
/* Value of label name in s, or NULL. */
const char *shoal_metrics_label_get(const shoal_metrics_parsed *s, const char *name);

#endif
