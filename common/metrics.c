/* metrics: counters, histograms, the Prometheus text writer and parser.
 * See metrics.h for the contracts and docs/METRICS.md for the names. */
#include "common/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"

/* ---- histograms --------------------------------------------------------- */

/* Upper bounds in ns: 1000 · 2^(i/4). Computed once (exp2 of a multiple of
 * 1/4: exact for whole octaves; the others are irrational, so no integer
 * number of ns ever sits exactly on them). */
static double bounds_ns[SHOAL_METRICS_HIST_BOUNDS];
static pthread_once_t bounds_once = PTHREAD_ONCE_INIT;

static void init_bounds(void)
{
    for (int i = 0; i < SHOAL_METRICS_HIST_BOUNDS; i++)
        bounds_ns[i] = 1000.0 * exp2((double)i / SHOAL_METRICS_HIST_PER_OCTAVE);
}

int shoal_metrics_bucket_of(uint64_t ns)
{
    pthread_once(&bounds_once, init_bounds);
    double v = (double)ns;
    if (v <= bounds_ns[0])
        return 0;
    if (v > bounds_ns[SHOAL_METRICS_HIST_BOUNDS - 1])
        return SHOAL_METRICS_HIST_BOUNDS;
    /* smallest i with v <= bounds_ns[i]; invariant: bounds[lo] < v <= bounds[hi] */
    int lo = 0, hi = SHOAL_METRICS_HIST_BOUNDS - 1;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (v <= bounds_ns[mid])
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

double shoal_metrics_bound_s(int i)
{
    pthread_once(&bounds_once, init_bounds);
    if (i < 0)
        return 0.0;
    if (i >= SHOAL_METRICS_HIST_BOUNDS)
        return INFINITY;
    return bounds_ns[i] / 1e9; /* divided, so whole-µs bounds print as short decimals */
}

void shoal_metrics_observe(shoal_metrics_hist *h, uint64_t ns)
{
    int i = shoal_metrics_bucket_of(ns);
    atomic_fetch_add_explicit(&h->bucket[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
    uint64_t cur = atomic_load_explicit(&h->max_ns, memory_order_relaxed);
    while (ns > cur && !atomic_compare_exchange_weak_explicit(&h->max_ns, &cur, ns, memory_order_relaxed,
                                                              memory_order_relaxed)) {
    }
}

void shoal_metrics_snapshot(const shoal_metrics_hist *h, shoal_metrics_snap *out)
{
    shoal_metrics_hist *hh = (shoal_metrics_hist *)h; /* atomic loads need a non-const pointer in C11 */
    out->count = 0;
    for (int i = 0; i < SHOAL_METRICS_HIST_BUCKETS; i++) {
        out->bucket[i] = atomic_load_explicit(&hh->bucket[i], memory_order_relaxed);
        out->count += out->bucket[i];
    }
    out->sum_ns = atomic_load_explicit(&hh->sum_ns, memory_order_relaxed);
    out->max_ns = atomic_load_explicit(&hh->max_ns, memory_order_relaxed);
}

void shoal_metrics_snap_merge(shoal_metrics_snap *dst, const shoal_metrics_snap *src)
{
    for (int i = 0; i < SHOAL_METRICS_HIST_BUCKETS; i++)
        dst->bucket[i] += src->bucket[i];
    dst->count += src->count;
    dst->sum_ns += src->sum_ns;
    if (src->max_ns > dst->max_ns)
        dst->max_ns = src->max_ns;
}

double shoal_metrics_quantile(const shoal_metrics_snap *s, double q)
{
    if (s->count == 0 || !(q >= 0.0 && q <= 1.0))
        return NAN;
    double target = q * (double)s->count;
    double cum = 0.0;
    int i = 0;
    for (; i < SHOAL_METRICS_HIST_BUCKETS; i++) {
        if (s->bucket[i] == 0)
            continue;
        if (cum + (double)s->bucket[i] >= target)
            break;
        cum += (double)s->bucket[i];
    }
    if (i == SHOAL_METRICS_HIST_BUCKETS) /* only through a torn snapshot */
        return (double)s->max_ns / 1e9;
    double frac = (target - cum) / (double)s->bucket[i];
    if (frac < 0.0)
        frac = 0.0;
    if (frac > 1.0)
        frac = 1.0;
    double max_s = (double)s->max_ns / 1e9;
    double lower = i == 0 ? 0.0 : shoal_metrics_bound_s(i - 1);
    double upper = shoal_metrics_bound_s(i);
    if (upper > max_s)
        upper = max_s;
    if (lower > upper)
        lower = upper;
    if (lower <= 0.0)
        return upper * frac;
    return lower * pow(upper / lower, frac);
}

/* ---- buffer ------------------------------------------------------------- */

void shoal_metrics_buf_free(shoal_metrics_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static void buf_reserve(shoal_metrics_buf *b, size_t extra)
{
    if (b->len + extra + 1 <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1)
        cap *= 2;
    b->p = shoal_xrealloc(b->p, cap);
    b->cap = cap;
}

void shoal_metrics_buf_printf(shoal_metrics_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char tmp[256];
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        SHOAL_PANIC("metrics: vsnprintf failed for '%s'", fmt);
    buf_reserve(b, (size_t)n);
    if ((size_t)n < sizeof tmp) {
        memcpy(b->p + b->len, tmp, (size_t)n + 1);
    } else {
        va_start(ap, fmt);
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
}

static void buf_putc(shoal_metrics_buf *b, char c)
{
    buf_reserve(b, 1);
    b->p[b->len++] = c;
    b->p[b->len] = 0;
}

static void buf_puts(shoal_metrics_buf *b, const char *s)
{
    size_t n = strlen(s);
    buf_reserve(b, n);
    memcpy(b->p + b->len, s, n + 1);
    b->len += n;
}

/* ---- writer ------------------------------------------------------------- */

static int name_ok(const char *s, int colon)
{
    if (!s || !*s)
        return 0;
    for (const char *p = s; *p; p++) {
        char c = *p;
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
        int digit = c >= '0' && c <= '9';
        if (!alpha && !(digit && p != s))
            return 0;
    }
    return 1;
}

static void check_labels(const shoal_metrics_label *labels, int n)
{
    for (int i = 0; i < n; i++)
        if (!name_ok(labels[i].name, 0) || !strncmp(labels[i].name, "__", 2) || !labels[i].value)
            SHOAL_PANIC("metrics: invalid label name '%s'", labels[i].name ? labels[i].name : "(null)");
}

/* Shortest of %.15g / %.17g that reads back exactly. */
static void format_value(char *out, size_t cap, double v)
{
    if (isnan(v)) {
        snprintf(out, cap, "NaN");
    } else if (isinf(v)) {
        snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
    } else if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(out, cap, "%.0f", v);
    } else {
        snprintf(out, cap, "%.15g", v);
        if (strtod(out, NULL) != v)
            snprintf(out, cap, "%.17g", v);
    }
}

static void put_escaped(shoal_metrics_buf *b, const char *s, int quote)
{
    for (const char *p = s; *p; p++) {
        if (*p == '\\')
            buf_puts(b, "\\\\");
        else if (*p == '\n')
            buf_puts(b, "\\n");
        else if (quote && *p == '"')
            buf_puts(b, "\\\"");
        else
            buf_putc(b, *p);
    }
}

static const char *type_name(shoal_metrics_type t)
{
    switch (t) {
    case SHOAL_METRICS_COUNTER: return "counter";
    case SHOAL_METRICS_GAUGE: return "gauge";
    case SHOAL_METRICS_HISTOGRAM: return "histogram";
    case SHOAL_METRICS_SUMMARY: return "summary";
    }
    SHOAL_PANIC("metrics: unknown type %d", (int)t);
}

void shoal_metrics_family(shoal_metrics_buf *b, const char *name, shoal_metrics_type type, const char *help)
{
    if (!name_ok(name, 1))
        SHOAL_PANIC("metrics: invalid metric name '%s'", name ? name : "(null)");
    buf_puts(b, "# HELP ");
    buf_puts(b, name);
    buf_putc(b, ' ');
    put_escaped(b, help ? help : "", 0);
    buf_puts(b, "\n# TYPE ");
    buf_puts(b, name);
    buf_putc(b, ' ');
    buf_puts(b, type_name(type));
    buf_putc(b, '\n');
}

/* name[suffix]{labels[,extra="xv"]} value */
static void sample_line(shoal_metrics_buf *b, const char *name, const char *suffix, const shoal_metrics_label *labels,
                        int nlabels, const char *extra, const char *xv, double value)
{
    if (!name_ok(name, 1))
        SHOAL_PANIC("metrics: invalid metric name '%s'", name ? name : "(null)");
    check_labels(labels, nlabels);
    buf_puts(b, name);
    if (suffix)
        buf_puts(b, suffix);
    if (nlabels > 0 || extra) {
        buf_putc(b, '{');
        for (int i = 0; i < nlabels; i++) {
            if (i)
                buf_putc(b, ',');
            buf_puts(b, labels[i].name);
            buf_puts(b, "=\"");
            put_escaped(b, labels[i].value, 1);
            buf_putc(b, '"');
        }
        if (extra) {
            if (nlabels)
                buf_putc(b, ',');
            buf_puts(b, extra);
            buf_puts(b, "=\"");
            buf_puts(b, xv);
            buf_putc(b, '"');
        }
        buf_putc(b, '}');
    }
    char v[64];
    format_value(v, sizeof v, value);
    buf_putc(b, ' ');
    buf_puts(b, v);
    buf_putc(b, '\n');
}

void shoal_metrics_sample(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels, int nlabels,
                          double value)
{
    sample_line(b, name, NULL, labels, nlabels, NULL, NULL, value);
}

void shoal_metrics_hist_samples(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels,
                                int nlabels, const shoal_metrics_snap *s)
{
    uint64_t cum = 0;
    char le[64];
    for (int i = 0; i < SHOAL_METRICS_HIST_BOUNDS; i++) {
        cum += s->bucket[i];
        if (i % 2) /* every other bound: factor √2 is enough on the wire */
            continue;
        format_value(le, sizeof le, shoal_metrics_bound_s(i));
        sample_line(b, name, "_bucket", labels, nlabels, "le", le, (double)cum);
    }
    sample_line(b, name, "_bucket", labels, nlabels, "le", "+Inf", (double)s->count);
    sample_line(b, name, "_sum", labels, nlabels, NULL, NULL, (double)s->sum_ns / 1e9);
    sample_line(b, name, "_count", labels, nlabels, NULL, NULL, (double)s->count);
}

void shoal_metrics_summary_samples(shoal_metrics_buf *b, const char *name, const shoal_metrics_label *labels,
                                   int nlabels, const shoal_metrics_snap *s, const double *qs, int nq)
{
    char qv[64];
    for (int i = 0; i < nq; i++) {
        format_value(qv, sizeof qv, qs[i]);
        sample_line(b, name, NULL, labels, nlabels, "quantile", qv, shoal_metrics_quantile(s, qs[i]));
    }
    sample_line(b, name, "_sum", labels, nlabels, NULL, NULL, (double)s->sum_ns / 1e9);
    sample_line(b, name, "_count", labels, nlabels, NULL, NULL, (double)s->count);
}

/* ---- parser ------------------------------------------------------------- */

static int is_name_start(char c, int colon)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
}
static int is_name_char(char c, int colon)
{
    return is_name_start(c, colon) || (c >= '0' && c <= '9');
}

/* Parse one sample line [p, end) into s, copying strings into scratch (at
 * least end - p + SHOAL_METRICS_MAX_LABELS * 2 + 2 bytes). */
static int parse_line(const char *p, const char *end, char *scratch, shoal_metrics_parsed *s, const char **why)
{
    char *w = scratch;
    if (p == end || !is_name_start(*p, 1))
        return *why = "expected a metric name", -1;
    s->name = w;
    while (p < end && is_name_char(*p, 1))
        *w++ = *p++;
    *w++ = 0;
    s->nlabels = 0;
    if (p < end && *p == '{') {
        p++;
        for (;;) {
            while (p < end && (*p == ' ' || *p == '\t'))
                p++;
            if (p < end && *p == '}') {
                p++;
                break;
            }
            if (s->nlabels == SHOAL_METRICS_MAX_LABELS)
                return *why = "too many labels", -1;
            if (p == end || !is_name_start(*p, 0))
                return *why = "expected a label name", -1;
            shoal_metrics_label *l = &s->labels[s->nlabels++];
            l->name = w;
            while (p < end && is_name_char(*p, 0))
                *w++ = *p++;
            *w++ = 0;
            while (p < end && (*p == ' ' || *p == '\t'))
                p++;
            if (p == end || *p != '=')
                return *why = "expected '=' after a label name", -1;
            p++;
            while (p < end && (*p == ' ' || *p == '\t'))
                p++;
            if (p == end || *p != '"')
                return *why = "expected '\"' opening a label value", -1;
            p++;
            l->value = w;
            for (;;) {
                if (p == end)
                    return *why = "unterminated label value", -1;
                char c = *p++;
                if (c == '"')
                    break;
                if (c == '\\') {
                    if (p == end)
                        return *why = "unterminated escape", -1;
                    char e = *p++;
                    if (e == '\\')
                        *w++ = '\\';
                    else if (e == '"')
                        *w++ = '"';
                    else if (e == 'n')
                        *w++ = '\n';
                    else
                        return *why = "unknown escape in a label value", -1;
                } else {
                    *w++ = c;
                }
            }
            *w++ = 0;
            while (p < end && (*p == ' ' || *p == '\t'))
                p++;
            if (p < end && *p == ',') {
                p++;
                continue;
            }
            if (p < end && *p == '}') {
                p++;
                break;
            }
            return *why = "expected ',' or '}' after a label value", -1;
        }
    }
    if (p == end || (*p != ' ' && *p != '\t'))
        return *why = "expected whitespace before the value", -1;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    const char *v0 = p;
    while (p < end && *p != ' ' && *p != '\t')
        p++;
    size_t vn = (size_t)(p - v0);
    if (vn == 0 || vn > 63)
        return *why = "missing or overlong value", -1;
    char vb[64];
    memcpy(vb, v0, vn);
    vb[vn] = 0;
    if (!strcmp(vb, "NaN")) {
        s->value = NAN;
    } else if (!strcmp(vb, "+Inf") || !strcmp(vb, "Inf")) {
        s->value = INFINITY;
    } else if (!strcmp(vb, "-Inf")) {
        s->value = -INFINITY;
    } else {
        /* decimal only: strtod would also take hex, "nan(...)", "infinity" */
        for (size_t i = 0; i < vn; i++)
            if (!strchr("0123456789+-.eE", vb[i]))
                return *why = "value is not a number", -1;
        char *e;
        s->value = strtod(vb, &e);
        if (e != vb + vn)
            return *why = "value is not a number", -1;
    }
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    if (p < end) { /* optional integer timestamp */
        if (*p == '-')
            p++;
        if (p == end || !(*p >= '0' && *p <= '9'))
            return *why = "trailing garbage after the value", -1;
        while (p < end && *p >= '0' && *p <= '9')
            p++;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (p < end)
            return *why = "trailing garbage after the timestamp", -1;
    }
    return 0;
}

int shoal_metrics_parse(const char *text, size_t len, int (*fn)(void *ctx, const shoal_metrics_parsed *s),
                        void *ctx, char *err, size_t errlen)
{
    const char *p = text, *end = text + len;
    char *scratch = NULL;
    size_t scap = 0;
    int line = 0, rc = 0;
    while (p < end) {
        line++;
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *q = p;
        while (q < le && (*q == ' ' || *q == '\t'))
            q++;
        const char *qe = le;
        if (qe > q && qe[-1] == '\r')
            qe--;
        if (memchr(q, 0, (size_t)(qe - q))) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "metrics line %d: NUL byte", line);
            break;
        }
        if (q < qe && *q != '#') {
            size_t need = (size_t)(qe - q) + 2 * SHOAL_METRICS_MAX_LABELS + 2;
            if (need > scap) {
                scap = need * 2;
                scratch = shoal_xrealloc(scratch, scap);
            }
            shoal_metrics_parsed s;
            const char *why = NULL;
            if (parse_line(q, qe, scratch, &s, &why) < 0) {
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "metrics line %d: %s", line, why);
                break;
            }
            rc = fn(ctx, &s);
            if (rc)
                break;
        }
        p = nl ? nl + 1 : end;
    }
    free(scratch);
    return rc;
}

const char *shoal_metrics_label_get(const shoal_metrics_parsed *s, const char *name)
{
    for (int i = 0; i < s->nlabels; i++)
        if (!strcmp(s->labels[i].name, name))
            return s->labels[i].value;
    return NULL;
}

double shoal_metrics_process_start_s(void)
{
    static _Atomic double cached = 0;
    double v = atomic_load(&cached);
    if (v > 0)
        return v;
    v = 0;
    /* field 22 of /proc/self/stat: start time in clock ticks after boot; the
     * command (field 2) may hold spaces and parentheses: parse after the last ')' */
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    unsigned long long ticks = 0;
    int ok = 0;
    if (p) {
        p++;
        for (int field = 3; field < 22 && p; field++) { /* skip fields 3..21 */
            p = strchr(p + 1, ' ');
        }
        ok = p && sscanf(p, " %llu", &ticks) == 1;
    }
    unsigned long long btime = 0;
    f = ok ? fopen("/proc/stat", "r") : NULL;
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "btime %llu", &btime) == 1)
                break;
        fclose(f);
    }
    long hz = sysconf(_SC_CLK_TCK);
    if (ok && btime && hz > 0)
        v = (double)btime + (double)ticks / (double)hz;
    else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = (double)ts.tv_sec + ts.tv_nsec / 1e9;
    }
    atomic_store(&cached, v);
    return v;
}

void shoal_metrics_process_families(shoal_metrics_buf *b, const char *version, const char *isa,
                                    const char *kernels, const char *numerics, const char *mu_path)
{
    shoal_metrics_family(b, "shoal_build_info", SHOAL_METRICS_GAUGE,
                         "Always 1: the version, commit, the CPU's best kernel ISA, the kernels in use, the numerics "
                         "class and what computes the matrix-unit order.");
    shoal_metrics_label l[6] = {{"version", version}, {"commit", SHOAL_COMMIT}, {"isa", isa},
                                {"kernels", kernels}, {"numerics", numerics}, {"mu_path", mu_path}};
    shoal_metrics_sample(b, "shoal_build_info", l, 6, 1);
    shoal_metrics_family(b, "process_start_time_seconds", SHOAL_METRICS_GAUGE,
                         "Start time of the process since unix epoch in seconds.");
    shoal_metrics_sample(b, "process_start_time_seconds", NULL, 0, shoal_metrics_process_start_s());
}
