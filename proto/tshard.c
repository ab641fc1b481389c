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

int shoal_tshard_place(const shoal_tshard_mat *mats, int nmats, int nw, const shoal_proto_trows *const *t,
                       const size_t *nt, uint8_t *remote, shoal_tshard_piece **pieces, size_t *npieces, char *err,
                       size_t errlen)
{
    *pieces = NULL;
    *npieces = 0;
    memset(remote, 0, (size_t)nmats);
    for (int w = 0; w < nw; w++)
        for (size_t j = 0; j < nt[w]; j++) {
            int k = shoal_tshard_find(mats, nmats, t[w][j].name);
            if (k < 0 || t[w][j].hi >= (uint32_t)mats[k].rows)
                return shoal_err_set(err, errlen, SHOAL_ERANGE, "trunk rows of '%s' outside the model", t[w][j].name);
            remote[k] = 1;
        }
    size_t cap = 0, n = 0, at = 0;
    shoal_tshard_piece *pc = NULL;
    int gaps = 0;
    if (errlen)
        err[0] = 0;
    for (int k = 0; k < nmats; k++) {
        if (!remote[k])
            continue;
        uint32_t r = 0, R = (uint32_t)mats[k].rows;
        while (r < R) {
            /* the owner whose range holding r reaches farthest; ties: lower w */
            int best = -1;
            uint32_t reach = 0, next = R; /* next: the first owned row above r when r is a gap */
            for (int w = 0; w < nw; w++)
                for (size_t j = 0; j < nt[w]; j++) {
                    const shoal_proto_trows *g = &t[w][j];
                    if (strcmp(g->name, mats[k].name))
                        continue;
                    if (g->lo <= r && r <= g->hi) {
                        if (best < 0 || g->hi > reach) {
                            best = w;
                            reach = g->hi;
                        }
                    } else if (g->lo > r && g->lo < next) {
                        next = g->lo;
                    }
                }
            if (best < 0) {
                if (gaps++ < 16 && at < errlen)
                    at += (size_t)snprintf(err + at, errlen - at, "%s%s rows %u-%u", gaps > 1 ? ", " : "",
                                           mats[k].name, r, next - 1);
                r = next;
                continue;
            }
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                pc = shoal_xrealloc(pc, cap * sizeof *pc);
            }
            pc[n++] = (shoal_tshard_piece){.mat = k, .w = best, .lo = r, .hi = reach};
            r = reach + 1;
        }
    }
    if (gaps) {
        free(pc);
        char list[1024];
        snprintf(list, sizeof list, "%s", err);
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "trunk rows owned by no worker (%d gap%s): %s%s", gaps,
                             gaps == 1 ? "" : "s", list, gaps > 16 ? ", ..." : "");
    }
    *pieces = pc;
    *npieces = n;
    return 0;
}
