/* Expert ownership: RANGES strings, bitmaps, even splits, coverage checks. */
#include "proto/shard.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

struct shoal_shard {
    int num_layers, num_experts;
    size_t count;
    uint8_t *bits; /* [num_layers * num_experts], 1 = owned */
};

/* "a" or "a-b" at *p; advances *p. */
static int parse_side(const char **p, uint32_t *lo, uint32_t *hi)
{
    const char *s = *p;
    uint64_t v[2] = {0, 0};
    int nv = 0;
    for (;;) {
        if (!isdigit((unsigned char)*s))
            return -1;
        uint64_t x = 0;
        while (isdigit((unsigned char)*s)) {
            x = x * 10 + (uint64_t)(*s++ - '0');
            if (x > INT32_MAX)
                return -1;
        }
        v[nv++] = x;
        if (*s != '-' || nv == 2)
            break;
        s++;
    }
    *lo = (uint32_t)v[0];
    *hi = (uint32_t)(nv == 2 ? v[1] : v[0]);
    *p = s;
    return *lo <= *hi ? 0 : -1;
}

int shoal_shard_parse(const char *spec, shoal_proto_range **out, size_t *n, char *err, size_t errlen)
{
    *out = NULL;
    *n = 0;
    if (!spec || !*spec)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert ranges: empty (expected LAYERS:EXPERTS, e.g. 1-92:0-447)");
    size_t cap = 1;
    for (const char *q = spec; *q; q++)
        cap += *q == ',';
    if (cap > SHOAL_PROTO_MAX_RANGES)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert ranges: %zu groups (limit %d)", cap,
                             SHOAL_PROTO_MAX_RANGES);
    shoal_proto_range *r = shoal_xcalloc(cap, sizeof *r);
    const char *p = spec;
    size_t k = 0;
    for (;;) {
        const char *g = p;
        shoal_proto_range x;
        if (parse_side(&p, &x.l_lo, &x.l_hi) || *p++ != ':' || parse_side(&p, &x.e_lo, &x.e_hi) ||
            (*p != ',' && *p != 0)) {
            const char *end = strchr(g, ',');
            int glen = end ? (int)(end - g) : (int)strlen(g);
            free(r);
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "expert ranges: bad group '%.*s' (expected LAYERS:EXPERTS, each 'a' or 'a-b' with a <= b)",
                                 glen > 64 ? 64 : glen, g);
        }
        r[k++] = x;
        if (!*p)
            break;
        p++;
    }
    *out = r;
    *n = k;
    return 0;
}

static int put_side(char *buf, size_t cap, size_t *at, uint32_t lo, uint32_t hi)
{
    int w = lo == hi ? snprintf(buf + *at, cap - *at, "%u", lo) : snprintf(buf + *at, cap - *at, "%u-%u", lo, hi);
    if (w < 0 || (size_t)w >= cap - *at)
        return SHOAL_ERANGE;
    *at += (size_t)w;
    return 0;
}

int shoal_shard_format(const shoal_proto_range *r, size_t n, char *buf, size_t cap)
{
    size_t at = 0;
    if (!cap)
        return SHOAL_ERANGE;
    buf[0] = 0;
    for (size_t i = 0; i < n; i++) {
        if (i) {
            if (cap - at < 2)
                return SHOAL_ERANGE;
            buf[at++] = ',';
            buf[at] = 0;
        }
        if (put_side(buf, cap, &at, r[i].l_lo, r[i].l_hi) || cap - at < 2)
            return SHOAL_ERANGE;
        buf[at++] = ':';
        buf[at] = 0;
        if (put_side(buf, cap, &at, r[i].e_lo, r[i].e_hi))
            return SHOAL_ERANGE;
    }
    return 0;
}

int shoal_shard_check(const shoal_proto_range *r, size_t n, int num_layers, const uint8_t *is_moe, int num_experts,
                      char *err, size_t errlen)
{
    if (!n)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "expert ranges: no experts");
    for (size_t i = 0; i < n; i++) {
        if (r[i].l_lo > r[i].l_hi || r[i].e_lo > r[i].e_hi)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "expert range %zu is empty", i);
        if (r[i].l_hi >= (uint32_t)num_layers)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "expert range %u-%u:%u-%u: layer %u beyond the model's %d layers",
                                 r[i].l_lo, r[i].l_hi, r[i].e_lo, r[i].e_hi, r[i].l_hi, num_layers);
        if (r[i].e_hi >= (uint32_t)num_experts)
            return shoal_err_set(err, errlen, SHOAL_ERANGE,
                                 "expert range %u-%u:%u-%u: expert %u beyond the model's %d experts per layer",
                                 r[i].l_lo, r[i].l_hi, r[i].e_lo, r[i].e_hi, r[i].e_hi, num_experts);
        for (uint32_t l = r[i].l_lo; l <= r[i].l_hi; l++)
            if (!is_moe[l])
                return shoal_err_set(err, errlen, SHOAL_ERANGE,
                                     "expert range %u-%u:%u-%u: layer %u is not an MoE layer", r[i].l_lo, r[i].l_hi,
                                     r[i].e_lo, r[i].e_hi, l);
    }
    return 0;
}

int shoal_shard_open(shoal_shard **out, const shoal_proto_range *r, size_t n, int num_layers, const uint8_t *is_moe,
                     int num_experts, char *err, size_t errlen)
{
    *out = NULL;
    /* n == 0: an empty ownership (a worker serving trunk rows only) */
    int rc = n ? shoal_shard_check(r, n, num_layers, is_moe, num_experts, err, errlen) : 0;
    if (rc)
        return rc;
    shoal_shard *s = shoal_xcalloc(1, sizeof *s);
    s->num_layers = num_layers;
    s->num_experts = num_experts;
    s->bits = shoal_xcalloc((size_t)num_layers * (size_t)num_experts, 1);
    for (size_t i = 0; i < n; i++)
        for (uint32_t l = r[i].l_lo; l <= r[i].l_hi; l++)
            for (uint32_t e = r[i].e_lo; e <= r[i].e_hi; e++) {
                uint8_t *b = &s->bits[(size_t)l * (size_t)num_experts + e];
                s->count += !*b;
                *b = 1;
            }
    *out = s;
    return 0;
}

void shoal_shard_close(shoal_shard *s)
{
    if (!s)
        return;
    free(s->bits);
    free(s);
}

int shoal_shard_owns(const void *ctx, int layer, int expert)
{
    const shoal_shard *s = ctx;
    if (layer < 0 || layer >= s->num_layers || expert < 0 || expert >= s->num_experts)
        return 0;
    return s->bits[(size_t)layer * (size_t)s->num_experts + (size_t)expert];
}

size_t shoal_shard_count(const shoal_shard *s)
{
    return s->count;
}

int shoal_shard_split(int w, int n, int num_layers, const uint8_t *is_moe, int num_experts, shoal_proto_range **out,
                      size_t *nout, char *err, size_t errlen)
{
    *out = NULL;
    *nout = 0;
    if (n < 1 || w < 0 || w >= n || n > num_experts)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "cannot split %d experts per layer over %d workers",
                             num_experts, n);
    uint32_t e_lo = (uint32_t)((int64_t)w * num_experts / n);
    uint32_t e_hi = (uint32_t)((int64_t)(w + 1) * num_experts / n - 1);
    shoal_proto_range *r = shoal_xcalloc((size_t)num_layers + 1, sizeof *r);
    size_t k = 0;
    for (int l = 0; l < num_layers; l++) {
        if (!is_moe[l])
            continue;
        if (k && r[k - 1].l_hi + 1 == (uint32_t)l)
            r[k - 1].l_hi = (uint32_t)l;
        else
            r[k++] = (shoal_proto_range){(uint32_t)l, (uint32_t)l, e_lo, e_hi};
    }
    if (!k) {
        free(r);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "the model has no MoE layer");
    }
    *out = r;
    *nout = k;
    return 0;
}

/* ---- coverage ---------------------------------------------------------- */

typedef struct {
    int kind; /* 0 gap, 1 overlap */
    int a, b; /* overlap: two of the owners */
    uint32_t e_lo, e_hi, l_lo, l_hi;
} run;

static int run_cmp(const void *x, const void *y)
{
    const run *p = x, *q = y;
#define CMP(f)                                                                                                         \
    if (p->f != q->f)                                                                                                  \
        return p->f < q->f ? -1 : 1;
    CMP(kind)
    CMP(e_lo)
    CMP(e_hi)
    CMP(a)
    CMP(b)
    CMP(l_lo)
#undef CMP
    return 0;
}

static void appendf(char *err, size_t errlen, size_t *at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void appendf(char *err, size_t errlen, size_t *at, const char *fmt, ...)
{
    if (!err || *at + 1 >= errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(err + *at, errlen - *at, fmt, ap);
    va_end(ap);
    if (w > 0)
        *at = *at + (size_t)w < errlen ? *at + (size_t)w : errlen - 1;
}

/* allow: overlaps are replicas (accepted), only gaps are refused; *nrep
 * counts the experts owned more than once. */
static int cover(int nw, const shoal_proto_range *const *r, const size_t *nr, const char *const *names,
                 int num_layers, const uint8_t *is_moe, int num_experts, int32_t *owner, int allow, size_t *nrep,
                 char *err, size_t errlen)
{
    size_t cells = (size_t)num_layers * (size_t)num_experts;
    int32_t *second = shoal_xmalloc(cells * sizeof *second);
    for (size_t i = 0; i < cells; i++) {
        owner[i] = -1;
        second[i] = -1;
    }
    for (int w = 0; w < nw; w++)
        for (size_t i = 0; i < nr[w]; i++) {
            const shoal_proto_range *x = &r[w][i];
            for (uint32_t l = x->l_lo; l <= x->l_hi && l < (uint32_t)num_layers; l++)
                for (uint32_t e = x->e_lo; e <= x->e_hi && e < (uint32_t)num_experts; e++) {
                    size_t c = (size_t)l * (size_t)num_experts + e;
                    if (owner[c] < 0)
                        owner[c] = w;
                    else if (owner[c] != w && second[c] < 0)
                        second[c] = w;
                }
        }
    /* runs of equal status along the experts of each MoE layer */
    size_t nrun = 0, caprun = 64, rep = 0;
    for (size_t i = 0; i < cells; i++)
        rep += second[i] >= 0;
    if (nrep)
        *nrep = rep;
    if (allow)
        for (size_t i = 0; i < cells; i++)
            second[i] = -1; /* a replica is not an error */
    run *runs = shoal_xmalloc(caprun * sizeof *runs);
    for (int l = 0; l < num_layers; l++) {
        if (!is_moe[l])
            continue;
        for (int e = 0; e < num_experts;) {
            size_t c = (size_t)l * (size_t)num_experts + (size_t)e;
            int kind = owner[c] < 0 ? 0 : second[c] >= 0 ? 1 : -1;
            int a = kind == 1 ? owner[c] : -1, b = kind == 1 ? second[c] : -1;
            int e2 = e + 1;
            while (e2 < num_experts) {
                size_t c2 = (size_t)l * (size_t)num_experts + (size_t)e2;
                int k2 = owner[c2] < 0 ? 0 : second[c2] >= 0 ? 1 : -1;
                if (k2 != kind || (kind == 1 && (owner[c2] != a || second[c2] != b)))
                    break;
                e2++;
            }
            if (kind >= 0) {
                if (nrun == caprun)
                    runs = shoal_xrealloc(runs, (caprun *= 2) * sizeof *runs);
                runs[nrun++] = (run){kind, a, b, (uint32_t)e, (uint32_t)(e2 - 1), (uint32_t)l, (uint32_t)l};
            }
            e = e2;
        }
    }
    free(second);
    if (!nrun) {
        free(runs);
        return 0;
    }
    /* merge the same expert run over consecutive MoE layers */
    qsort(runs, nrun, sizeof *runs, run_cmp);
    size_t m = 0;
    for (size_t i = 0; i < nrun; i++) {
        if (m) {
            run *p = &runs[m - 1];
            int next_moe = 1;
            for (uint32_t l = p->l_hi + 1; l < runs[i].l_lo; l++)
                next_moe &= !is_moe[l];
            if (p->kind == runs[i].kind && p->e_lo == runs[i].e_lo && p->e_hi == runs[i].e_hi && p->a == runs[i].a &&
                p->b == runs[i].b && next_moe) {
                p->l_hi = runs[i].l_hi;
                continue;
            }
        }
        runs[m++] = runs[i];
    }
    size_t at = 0;
    if (err && errlen)
        err[0] = 0;
    size_t ngap = 0, nover = 0;
    for (size_t i = 0; i < m; i++)
        *(runs[i].kind ? &nover : &ngap) += 1;
    if (allow)
        appendf(err, errlen, &at, "the workers do not own every expert (%zu gap%s):", ngap, ngap == 1 ? "" : "s");
    else
        appendf(err, errlen, &at, "the workers do not own every expert exactly once (%zu gap%s, %zu overlap%s):",
                ngap, ngap == 1 ? "" : "s", nover, nover == 1 ? "" : "s");
    size_t shown = 0;
    for (size_t i = 0; i < m && shown < 16; i++, shown++) {
        const run *p = &runs[i];
        appendf(err, errlen, &at, p->l_lo == p->l_hi ? " layer %u" : " layers %u-%u", p->l_lo, p->l_hi);
        appendf(err, errlen, &at, p->e_lo == p->e_hi ? " expert %u" : " experts %u-%u", p->e_lo, p->e_hi);
        if (p->kind == 0)
            appendf(err, errlen, &at, ": owned by no worker;");
        else
            appendf(err, errlen, &at, ": owned by %s and %s;", names[p->a], names[p->b]);
    }
    if (m > shown)
        appendf(err, errlen, &at, " ... and %zu more", m - shown);
    free(runs);
    return SHOAL_ECONFIG;
}

int shoal_shard_cover(int nw, const shoal_proto_range *const *r, const size_t *nr, const char *const *names,
                      int num_layers, const uint8_t *is_moe, int num_experts, int32_t *owner, char *err,
                      size_t errlen)
{
    return cover(nw, r, nr, names, num_layers, is_moe, num_experts, owner, 0, NULL, err, errlen);
}

int shoal_shard_cover_replicas(int nw, const shoal_proto_range *const *r, const size_t *nr, const char *const *names,
                               int num_layers, const uint8_t *is_moe, int num_experts, int32_t *owner,
                               size_t *replicated, char *err, size_t errlen)
{
    return cover(nw, r, nr, names, num_layers, is_moe, num_experts, owner, 1, replicated, err, errlen);
}
