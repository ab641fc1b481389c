/* Trunk row shards (tshard.h, PROTOCOL.md §7.1). */
#include "proto/tshard.h"

#include <ctype.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/k3schema.h"

#define LM_PREFIX "language_model."

typedef struct {
    shoal_tshard_mat *m;
    int n, cap;
} collect;

static int is_shardable(const shoal_k3schema_entry *e)
{
    if (e->cls == SHOAL_TC_EXPERT || e->ndim != 2 || e->shape[0] < 2)
        return 0; /* experts; vectors and the [1, d] AttnRes projections */
    size_t n = strlen(e->name);
    static const char *const skip[] = {"embed_tokens.weight", "kv_b_proj.weight"};
    for (size_t i = 0; i < sizeof skip / sizeof *skip; i++) {
        size_t k = strlen(skip[i]);
        if (n >= k && !strcmp(e->name + n - k, skip[i]))
            return 0;
    }
    return 1;
}

static int add_mat(const shoal_k3schema_entry *e, void *ctx)
{
    collect *c = ctx;
    if (!is_shardable(e))
        return 0;
    if (strlen(e->name) > SHOAL_PROTO_MAX_NAME || e->shape[0] > INT32_MAX || e->shape[1] > INT32_MAX)
        return SHOAL_EINVAL;
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 64;
        c->m = shoal_xrealloc(c->m, (size_t)c->cap * sizeof *c->m);
    }
    shoal_tshard_mat *m = &c->m[c->n++];
    snprintf(m->name, sizeof m->name, "%s", e->name);
    m->rows = (int)e->shape[0];
    m->cols = (int)e->shape[1];
    m->layer = e->layer;
    return 0;
}

int shoal_tshard_mats(const shoal_k3cfg *c, shoal_tshard_mat **out, int *n)
{
    collect cl = {0};
    int rc = shoal_k3schema_foreach(c, add_mat, &cl);
    if (rc) {
        free(cl.m);
        return rc;
    }
    *out = cl.m;
    *n = cl.n;
    return 0;
}

int shoal_tshard_spread_spec(const shoal_tshard_mat *mats, int nmats, int i, int n, char *buf, size_t cap, char *err,
                             size_t errlen)
{
    if (n < 1 || i < 0 || i >= n || nmats < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk spread: part %d of %d over %d matrices", i, n, nmats);
    int fa = 0;
    for (int k = 0; k < nmats; k++) {
        int whole = strstr(mats[k].name, ".f_a_proj.weight") != NULL;
        fa |= whole;
        if (mats[k].rows < n)
            return shoal_err_set(err, errlen, SHOAL_ERANGE,
                                 "the trunk cannot be spread over %d workers: %s has %d rows (at most %d workers)", n,
                                 mats[k].name, mats[k].rows, mats[k].rows);
    }
    int w = snprintf(buf, cap, "*:%d/%d%s", i, n, fa ? ",*.f_a_proj.weight:all" : "");
    if (w < 0 || (size_t)w >= cap)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk spread: ROWSPEC buffer too small");
    return 0;
}

int shoal_tshard_find(const shoal_tshard_mat *mats, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(mats[i].name, name))
            return i;
    return -1;
}

static int parse_u32(const char *s, const char *end, uint32_t *out)
{
    if (s == end || end - s > 10)
        return -1;
    uint64_t v = 0;
    for (const char *p = s; p < end; p++) {
        if (!isdigit((unsigned char)*p))
            return -1;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    if (v > INT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* ROWS of one item for a matrix of R rows: lo, hi; 0, -1 syntax, -2 range. */
static int rows_of(const char *s, const char *end, uint32_t R, uint32_t *lo, uint32_t *hi)
{
    size_t n = (size_t)(end - s);
    if (n == 3 && !memcmp(s, "all", 3)) {
        *lo = 0;
        *hi = R - 1;
        return 0;
    }
    const char *slash = memchr(s, '/', n), *dash = memchr(s, '-', n);
    if (slash) {
        uint32_t i, k;
        if (parse_u32(s, slash, &i) || parse_u32(slash + 1, end, &k) || k == 0)
            return -1;
        if (i >= k || k > R)
            return -2;
        *lo = (uint32_t)((uint64_t)i * R / k);
        *hi = (uint32_t)((uint64_t)(i + 1) * R / k) - 1;
        return 0;
    }
    if (dash) {
        if (parse_u32(s, dash, lo) || parse_u32(dash + 1, end, hi))
            return -1;
    } else {
        if (parse_u32(s, end, lo))
            return -1;
        *hi = *lo;
    }
    if (*lo > *hi)
        return -1;
    return *hi < R ? 0 : -2;
}

int shoal_tshard_parse(const char *spec, const shoal_tshard_mat *mats, int nmats, shoal_proto_trows **out,
                       size_t *nout, char *err, size_t errlen)
{
    *out = NULL;
    *nout = 0;
    if (!spec || !*spec)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--trunk: empty ROWSPEC");
    size_t cap = 0, n = 0;
    shoal_proto_trows *t = NULL;
    const char *p = spec;
    int rc = 0;
    while (*p) {
        const char *end = strchr(p, ',');
        if (!end)
            end = p + strlen(p);
        const char *colon = NULL;
        for (const char *q = end; q > p; q--)
            if (q[-1] == ':') {
                colon = q - 1;
                break;
            }
        char pat[2 * SHOAL_PROTO_MAX_NAME];
        if (!colon || colon == p || (size_t)(colon - p) >= sizeof pat) {
            rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "--trunk: '%.*s' is not PATTERN:ROWS", (int)(end - p), p);
            goto fail;
        }
        memcpy(pat, p, (size_t)(colon - p));
        pat[colon - p] = 0;
        int matched = 0;
        for (int i = 0; i < nmats; i++) {
            const char *nm = mats[i].name;
            const char *shortn = strncmp(nm, LM_PREFIX, strlen(LM_PREFIX)) ? nm : nm + strlen(LM_PREFIX);
            if (fnmatch(pat, nm, 0) && fnmatch(pat, shortn, 0))
                continue;
            uint32_t lo, hi;
            int r = rows_of(colon + 1, end, (uint32_t)mats[i].rows, &lo, &hi);
            if (r == -1) {
                rc = shoal_err_set(err, errlen, SHOAL_EINVAL,
                                   "--trunk: '%.*s': ROWS must be a, a-b, all or i/n (0 <= i < n)", (int)(end - p), p);
                goto fail;
            }
            if (r == -2) {
                rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "--trunk: '%.*s': %s has %d rows", (int)(end - p), p, nm,
                                   mats[i].rows);
                goto fail;
            }
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                t = shoal_xrealloc(t, cap * sizeof *t);
            }
            snprintf(t[n].name, sizeof t[n].name, "%s", nm);
            t[n].lo = lo;
            t[n].hi = hi;
            n++;
            matched++;
        }
        if (!matched) {
            rc = shoal_err_set(err, errlen, SHOAL_ERANGE,
                               "--trunk: '%s' matches no row-shardable trunk matrix (e.g. %s)", pat,
                               nmats ? mats[0].name : "none in this model");
            goto fail;
        }
        if (n > SHOAL_PROTO_MAX_TROWS) {
            rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "--trunk: more than %d row ranges", SHOAL_PROTO_MAX_TROWS);
            goto fail;
        }
        p = *end ? end + 1 : end;
    }
    *out = t;
    *nout = n;
    return 0;
fail:
    free(t);
    return rc;
}

int shoal_tshard_check(const shoal_proto_trows *t, size_t n, const shoal_tshard_mat *mats, int nmats, char *err,
                       size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        int k = shoal_tshard_find(mats, nmats, t[i].name);
        if (k < 0)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "trunk rows of '%s': not a row-shardable matrix of this model",
                                 t[i].name);
        if (t[i].lo > t[i].hi || t[i].hi >= (uint32_t)mats[k].rows)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "trunk rows %u-%u of %s: the matrix has %d rows", t[i].lo,
                                 t[i].hi, t[i].name, mats[k].rows);
    }
    return 0;
}

/* One announced range, for the cells: matrix k, worker w, its index j in t[w]. */
typedef struct {
    int k, w, j;
    uint32_t lo, hi;
} ann;

static const shoal_tshard_mat *cmp_mats; /* by_name's qsort only (shoal_tshard_cells is not reentrant) */
static int by_name(const void *a, const void *b)
{
    return strcmp(cmp_mats[*(const int *)a].name, cmp_mats[*(const int *)b].name);
}

static int by_mat_lo(const void *a, const void *b)
{
    const ann *x = a, *y = b;
    if (x->k != y->k)
        return x->k < y->k ? -1 : 1;
    if (x->lo != y->lo)
        return x->lo < y->lo ? -1 : 1;
    return x->w != y->w ? (x->w < y->w ? -1 : 1) : (x->j > y->j) - (x->j < y->j);
}

static int by_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Worker w's range holding rows lo..hi among a[0..n): the one reaching
 * farthest, then starting lowest, then listed first; -1 if none. */
static int holding(const ann *a, size_t n, int w, uint32_t lo, uint32_t hi)
{
    int best = -1;
    for (size_t i = 0; i < n; i++) {
        if (a[i].w != w || a[i].lo > lo || a[i].hi < hi)
            continue;
        if (best < 0 || a[i].hi > a[best].hi || (a[i].hi == a[best].hi && a[i].lo < a[best].lo))
            best = (int)i;
    }
    return best;
}

int shoal_tshard_cells(const shoal_tshard_mat *mats, int nmats, int nw, const shoal_proto_trows *const *t,
                       const size_t *nt, uint8_t *remote, shoal_tshard_cell **cells, size_t *ncells,
                       shoal_tshard_owner **own, size_t *nown, char *err, size_t errlen)
{
    *cells = NULL;
    *ncells = 0;
    *own = NULL;
    *nown = 0;
    memset(remote, 0, (size_t)nmats);
    /* the matrices by name, for a lookup per announced range */
    int *sorted = shoal_xmalloc((size_t)(nmats ? nmats : 1) * sizeof *sorted);
    for (int k = 0; k < nmats; k++)
        sorted[k] = k;
    cmp_mats = mats;
    qsort(sorted, (size_t)nmats, sizeof *sorted, by_name);
    cmp_mats = NULL;
    size_t na = 0;
    for (int w = 0; w < nw; w++)
        na += nt[w];
    ann *a = shoal_xmalloc((na ? na : 1) * sizeof *a);
    na = 0;
    for (int w = 0; w < nw; w++)
        for (size_t j = 0; j < nt[w]; j++) {
            const shoal_proto_trows *g = &t[w][j];
            int lo = 0, hi = nmats - 1, k = -1;
            while (lo <= hi && k < 0) {
                int mid = (lo + hi) / 2, r = strcmp(g->name, mats[sorted[mid]].name);
                if (!r)
                    k = sorted[mid];
                else if (r < 0)
                    hi = mid - 1;
                else
                    lo = mid + 1;
            }
            if (k < 0 || g->lo > g->hi || g->hi >= (uint32_t)mats[k].rows) {
                free(sorted);
                free(a);
                return shoal_err_set(err, errlen, SHOAL_ERANGE, "trunk rows of '%s' outside the model", g->name);
            }
            remote[k] = 1;
            a[na++] = (ann){.k = k, .w = w, .j = (int)j, .lo = g->lo, .hi = g->hi};
        }
    free(sorted);
    qsort(a, na, sizeof *a, by_mat_lo);
    size_t cap = 0, n = 0, ocap = 0, no = 0, at = 0;
    shoal_tshard_cell *c = NULL;
    shoal_tshard_owner *o = NULL;
    uint32_t *cut = shoal_xmalloc((2 * na + 2) * sizeof *cut);
    int gaps = 0;
    if (errlen)
        err[0] = 0;
    for (size_t s0 = 0; s0 < na;) {
        size_t s1 = s0;
        while (s1 < na && a[s1].k == a[s0].k)
            s1++;
        const int k = a[s0].k;
        const uint32_t R = (uint32_t)mats[k].rows;
        /* the boundaries: 0, R and every range's lo and hi + 1 */
        size_t nc = 0;
        cut[nc++] = 0;
        cut[nc++] = R;
        for (size_t i = s0; i < s1; i++) {
            cut[nc++] = a[i].lo;
            cut[nc++] = a[i].hi + 1;
        }
        qsort(cut, nc, sizeof *cut, by_u32);
        size_t u = 0;
        for (size_t i = 0; i < nc; i++)
            if (!u || cut[i] != cut[u - 1])
                cut[u++] = cut[i];
        for (size_t b = 0; b + 1 < u; b++) {
            uint32_t lo = cut[b], hi = cut[b + 1] - 1;
            /* owners, ascending worker, each with its range holding lo..hi */
            size_t first = no;
            for (int w = 0; w < nw; w++) {
                int h = holding(a + s0, s1 - s0, w, lo, hi);
                if (h < 0)
                    continue;
                if (no == ocap) {
                    ocap = ocap ? 2 * ocap : 64;
                    o = shoal_xrealloc(o, ocap * sizeof *o);
                }
                o[no++] = (shoal_tshard_owner){.w = w, .range = a[s0 + (size_t)h].j};
            }
            if (no == first) { /* a gap (cuts are next to owned rows: never two gap pieces in a row) */
                if (gaps++ < 16 && at < errlen)
                    at += (size_t)snprintf(err + at, errlen - at, "%s%s rows %u-%u", gaps > 1 ? ", " : "",
                                           mats[k].name, lo, hi);
                continue;
            }
            /* the same owners in the same ranges as the cell before: one cell */
            if (n && c[n - 1].mat == k && c[n - 1].hi + 1 == lo && c[n - 1].n == no - first &&
                !memcmp(&o[c[n - 1].off], &o[first], (no - first) * sizeof *o)) {
                c[n - 1].hi = hi;
                no = first;
                continue;
            }
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                c = shoal_xrealloc(c, cap * sizeof *c);
            }
            c[n++] = (shoal_tshard_cell){.mat = k, .lo = lo, .hi = hi, .off = (uint32_t)first,
                                         .n = (uint32_t)(no - first)};
        }
        s0 = s1;
    }
    free(cut);
    free(a);
    if (gaps) {
        free(c);
        free(o);
        char list[1024];
        snprintf(list, sizeof list, "%s", err);
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "trunk rows owned by no worker (%d gap%s): %s%s", gaps,
                             gaps == 1 ? "" : "s", list, gaps > 16 ? ", ..." : "");
    }
    *cells = c;
    *ncells = n;
    *own = o;
    *nown = no;
    return 0;
}

void shoal_tshard_pick(const shoal_tshard_cell *cells, int n, const shoal_tshard_owner *own, int nw,
                       const uint8_t *live, const uint8_t *want, uint64_t *load, int32_t *pick)
{
    memset(load, 0, (size_t)nw * sizeof *load);
    for (int i = 0; i < n; i++) {
        if (want && !want[i])
            continue;
        const shoal_tshard_cell *x = &cells[i];
        int32_t best = -1;
        for (uint32_t j = x->off; j < x->off + x->n; j++) { /* ascending worker: ties to the lower */
            int32_t w = own[j].w;
            if (live && !live[w])
                continue;
            if (best < 0 || load[w] < load[own[best].w])
                best = (int32_t)j;
        }
        pick[i] = best;
        if (best >= 0)
            load[own[best].w] += x->hi - x->lo + 1;
    }
}
