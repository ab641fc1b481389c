/* In-process routed experts (experts_local.h). */
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "coordinator/engine/experts_local.h"

typedef struct {
    shoal_k3cfg cfg;
    int E, lat, f, maxT;
    int *moe_idx;      /* [num_layers]: index among MoE layers, or -1 */
    shoal_expert_w *w; /* [num_moe, E] */
    /* request (between submit and gather) */
    int pending, layer, T, k;
    const float *z;
    const int32_t *ids;
    /* scratch */
    int *count, *start, *list; /* [E], [E+1], [maxT * k] */
    float *xg, *ffn;           /* [maxT, lat], [2 * maxT * f] */
    uint16_t *yg;              /* [maxT, lat] */
    /* the one-call path (shoal_expert_ffn_many) for at most MANY_ROWS (token,
     * slot) pairs, i.e. decode: rows grouped by expert, threads take whole experts */
    int nth;                   /* threads the scratch is sized for */
    float *xm, *ffm;           /* [MANY_ROWS, lat], [nth, 2 * min(maxT, MANY_ROWS) * f] */
    uint16_t *ym;              /* [MANY_ROWS, lat] */
    const shoal_expert_w **pe; /* [E] per selected expert */
    const float **px;
    uint16_t **py;
    int *pt;
} local;

#define MANY_ROWS 64

size_t shoal_experts_local_expert_bytes(const shoal_k3cfg *c, shoal_expert_kind kind)
{
    size_t f = (size_t)c->moe_intermediate_size, d = (size_t)c->latent_size;
    switch (kind) {
    case SHOAL_EXPERT_MXFP4:
        return 2 * f * (d / 2 + d / 32) + d * (f / 2 + f / 32);
    case SHOAL_EXPERT_BF16:
        return 3 * f * d * 2;
    default:
        return 3 * f * d * 4;
    }
}

static int submit(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err, size_t errlen)
{
    local *l = self;
    if (l->pending)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "local experts: submit with a request outstanding");
    if (layer < 0 || layer >= l->cfg.num_layers || l->moe_idx[layer] < 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "local experts: layer %d is not a MoE layer", layer);
    if (T < 1 || T > l->maxT || k < 1 || k > l->cfg.experts_per_token)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "local experts: T=%d k=%d (max %d, %d)", T, k, l->maxT,
                             l->cfg.experts_per_token);
    for (int i = 0; i < T * k; i++)
        if (ids[i] < 0 || ids[i] >= l->E)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "local experts: expert id %d outside [0, %d)",
                                 (int)ids[i], l->E);
    l->pending = 1;
    l->layer = layer;
    l->T = T;
    l->k = k;
    l->z = z;
    l->ids = ids;
    return 0;
}

/* Computes on gather: in-process there is nothing to overlap with. Tokens are
 * grouped by expert (counting sort, stable in (t, slot) order), each selected
 * expert runs once over all its tokens: up to MANY_ROWS rows all experts in
 * one shoal_expert_ffn_many call (threads take whole experts: no parallel
 * region per expert), beyond that in ascending expert id. */
static int gather(void *self, uint16_t *y, char *err, size_t errlen)
{
    local *l = self;
    if (!l->pending)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "local experts: gather without submit");
    l->pending = 0;
    int T = l->T, k = l->k, E = l->E, lat = l->lat;
    memset(l->count, 0, sizeof(int) * (size_t)E);
    for (int i = 0; i < T * k; i++)
        l->count[l->ids[i]]++;
    l->start[0] = 0;
    for (int e = 0; e < E; e++)
        l->start[e + 1] = l->start[e] + l->count[e];
    for (int e = 0; e < E; e++)
        l->count[e] = 0;
    for (int i = 0; i < T * k; i++) {
        int e = l->ids[i];
        l->list[l->start[e] + l->count[e]++] = i;
    }
    const shoal_expert_w *W = l->w + (size_t)l->moe_idx[l->layer] * E;
    if (T * k <= MANY_ROWS) {
        /* every row at once, grouped by expert; one call for the layer */
        int n = 0;
        for (int e = 0; e < E; e++) {
            int c = l->count[e];
            if (!c)
                continue;
            const int *li = l->list + l->start[e];
            for (int j = 0; j < c; j++)
                memcpy(l->xm + (size_t)(l->start[e] + j) * lat, l->z + (size_t)(li[j] / k) * lat,
                       sizeof(float) * (size_t)lat);
            l->pe[n] = &W[e];
            l->px[n] = l->xm + (size_t)l->start[e] * lat;
            l->py[n] = l->ym + (size_t)l->start[e] * lat;
            l->pt[n] = c;
            n++;
        }
        shoal_expert_ffn_many(l->py, l->pe, l->px, l->pt, n, l->cfg.situ_beta, l->cfg.situ_linear_beta, l->ffm,
                              l->nth);
        for (int i = 0; i < T * k; i++)
            memcpy(y + (size_t)l->list[i] * lat, l->ym + (size_t)i * lat, sizeof(uint16_t) * (size_t)lat);
        (void)err;
        (void)errlen;
        return 0;
    }
    for (int e = 0; e < E; e++) {
        int n = l->count[e];
        if (!n)
            continue;
        const int *li = l->list + l->start[e];
        for (int j = 0; j < n; j++)
            memcpy(l->xg + (size_t)j * lat, l->z + (size_t)(li[j] / k) * lat, sizeof(float) * (size_t)lat);
        shoal_expert_ffn(l->yg, &W[e], l->xg, n, l->cfg.situ_beta, l->cfg.situ_linear_beta, l->ffn);
        for (int j = 0; j < n; j++)
            memcpy(y + (size_t)li[j] * lat, l->yg + (size_t)j * lat, sizeof(uint16_t) * (size_t)lat);
    }
    (void)err;
    (void)errlen;
    return 0;
}

static void lclose(void *self)
{
    local *l = self;
    if (!l)
        return;
    free(l->moe_idx);
    free(l->w);
    free(l->count);
    free(l->start);
    free(l->list);
    free(l->xg);
    free(l->ffn);
    free(l->yg);
    free(l->xm);
    free(l->ffm);
    free(l->ym);
    free(l->pe);
    free(l->px);
    free(l->py);
    free(l->pt);
    free(l);
}

static const shoal_experts_vt local_vt = {.submit = submit, .gather = gather, .close = lclose};

typedef struct {
    char *err;
    size_t errlen, used;
    int n;
} plist;

static void padd(plist *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void padd(plist *p, const char *fmt, ...)
{
    char line[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    SHOAL_ERROR("experts: %s", line);
    p->n++;
    if (p->err && p->errlen > p->used + 1) {
        int w = snprintf(p->err + p->used, p->errlen - p->used, "%s%s", p->used ? "\n" : "", line);
        if (w > 0)
            p->used += (size_t)w < p->errlen - p->used ? (size_t)w : p->errlen - p->used - 1;
    }
}

/* tensor name + expected dtype/shape; returns data or NULL (problem noted) */
static const void *need(const shoal_st *st, plist *p, const char *name, shoal_dtype dt, int64_t r, int64_t c,
                        int any_float)
{
    const shoal_tensor *t = shoal_st_find(st, name);
    if (!t) {
        padd(p, "missing tensor %s", name);
        return NULL;
    }
    int dt_ok = any_float ? (t->dtype == SHOAL_DT_BF16 || t->dtype == SHOAL_DT_F32) : t->dtype == dt;
    if (!dt_ok || (any_float && t->dtype != dt)) {
        padd(p, "tensor %s: dtype %s, expected %s", name, shoal_dtype_name(t->dtype), shoal_dtype_name(dt));
        return NULL;
    }
    if (t->ndim != 2 || t->shape[0] != r || t->shape[1] != c) {
        padd(p, "tensor %s: shape [%lld, %lld] (ndim %d), expected [%lld, %lld]", name,
             (long long)(t->ndim > 0 ? t->shape[0] : 0), (long long)(t->ndim > 1 ? t->shape[1] : 0), t->ndim,
             (long long)r, (long long)c);
        return NULL;
    }
    if ((uintptr_t)t->data % shoal_dtype_size(t->dtype)) {
        padd(p, "tensor %s: data misaligned for %s", name, shoal_dtype_name(t->dtype));
        return NULL;
    }
    return t->data;
}

int shoal_experts_local_open(shoal_experts *out, const shoal_st *st, const shoal_k3cfg *cfg, const char *prefix,
                             int max_tokens, char *err, size_t errlen)
{
    out->vt = NULL;
    out->self = NULL;
    if (max_tokens < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "local experts: max_tokens %d", max_tokens);
    if (cfg->expert_format == SHOAL_EXPERTS_MXFP4 &&
        (cfg->latent_size % 32 || cfg->moe_intermediate_size % 32))
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "local experts: MXFP4 widths %d, %d are not multiples of 32", cfg->latent_size,
                             cfg->moe_intermediate_size);
    local *l = shoal_xcalloc(1, sizeof *l);
    l->cfg = *cfg;
    l->E = cfg->num_experts;
    l->lat = cfg->latent_size;
    l->f = cfg->moe_intermediate_size;
    l->maxT = max_tokens;
    l->moe_idx = shoal_xmalloc(sizeof(int) * (size_t)cfg->num_layers);
    int nm = 0;
    for (int L = 0; L < cfg->num_layers; L++)
        l->moe_idx[L] = cfg->is_moe[L] ? nm++ : -1;
    l->w = shoal_xcalloc((size_t)nm * (size_t)l->E + 1, sizeof(shoal_expert_w));

    plist p = {.err = err, .errlen = errlen};
    if (err && errlen)
        err[0] = 0;
    int d = l->lat, f = l->f;
    shoal_dtype plain_dt = SHOAL_DT_BF16;
    if (cfg->expert_format != SHOAL_EXPERTS_MXFP4) {
        /* every expert must share the first one's dtype (BF16 or F32) */
        for (int L = 0; L < cfg->num_layers; L++) {
            if (!cfg->is_moe[L])
                continue;
            char name[320];
            snprintf(name, sizeof name, "%s%d.block_sparse_moe.experts.0.w1.weight", prefix, L);
            const shoal_tensor *t = shoal_st_find(st, name);
            if (t && t->dtype == SHOAL_DT_F32)
                plain_dt = SHOAL_DT_F32;
            break;
        }
    }
    for (int L = 0; L < cfg->num_layers; L++) {
        if (!cfg->is_moe[L])
            continue;
        for (int e = 0; e < l->E; e++) {
            shoal_expert_w *w = &l->w[(size_t)l->moe_idx[L] * l->E + e];
            char base[256], name[320];
            snprintf(base, sizeof base, "%s%d.block_sparse_moe.experts.%d.", prefix, L, e);
            w->d = d;
            w->f = f;
            if (cfg->expert_format == SHOAL_EXPERTS_MXFP4) {
                w->kind = SHOAL_EXPERT_MXFP4;
                snprintf(name, sizeof name, "%sw1.weight_packed", base);
                w->w1 = need(st, &p, name, SHOAL_DT_U8, f, d / 2, 0);
                snprintf(name, sizeof name, "%sw1.weight_scale", base);
                w->w1_scale = need(st, &p, name, SHOAL_DT_U8, f, d / 32, 0);
                snprintf(name, sizeof name, "%sw3.weight_packed", base);
                w->w3 = need(st, &p, name, SHOAL_DT_U8, f, d / 2, 0);
                snprintf(name, sizeof name, "%sw3.weight_scale", base);
                w->w3_scale = need(st, &p, name, SHOAL_DT_U8, f, d / 32, 0);
                snprintf(name, sizeof name, "%sw2.weight_packed", base);
                w->w2 = need(st, &p, name, SHOAL_DT_U8, d, f / 2, 0);
                snprintf(name, sizeof name, "%sw2.weight_scale", base);
                w->w2_scale = need(st, &p, name, SHOAL_DT_U8, d, f / 32, 0);
            } else {
                w->kind = plain_dt == SHOAL_DT_F32 ? SHOAL_EXPERT_F32 : SHOAL_EXPERT_BF16;
                snprintf(name, sizeof name, "%sw1.weight", base);
                w->w1 = need(st, &p, name, plain_dt, f, d, 1);
                snprintf(name, sizeof name, "%sw3.weight", base);
                w->w3 = need(st, &p, name, plain_dt, f, d, 1);
                snprintf(name, sizeof name, "%sw2.weight", base);
                w->w2 = need(st, &p, name, plain_dt, d, f, 1);
            }
        }
    }
    if (p.n) {
        lclose(l);
        return SHOAL_EMODEL;
    }
    size_t T = (size_t)max_tokens, k = (size_t)cfg->experts_per_token;
    l->count = shoal_xcalloc((size_t)l->E + 1, sizeof(int));
    l->start = shoal_xcalloc((size_t)l->E + 1, sizeof(int));
    l->list = shoal_xcalloc(T * k + 1, sizeof(int));
    l->xg = shoal_xcalloc(T * (size_t)d + 1, sizeof(float));
    l->ffn = shoal_xcalloc(2 * T * (size_t)f + 1, sizeof(float));
    l->yg = shoal_xcalloc(T * (size_t)d + 1, sizeof(uint16_t));
    size_t mt = T < MANY_ROWS ? T : MANY_ROWS;
    l->nth = omp_get_max_threads();
    l->xm = shoal_xcalloc(MANY_ROWS * (size_t)d, sizeof(float));
    l->ym = shoal_xcalloc(MANY_ROWS * (size_t)d, sizeof(uint16_t));
    l->ffm = shoal_xcalloc((size_t)l->nth * 2 * mt * (size_t)f + 1, sizeof(float));
    l->pe = shoal_xcalloc((size_t)l->E, sizeof *l->pe);
    l->px = shoal_xcalloc((size_t)l->E, sizeof *l->px);
    l->py = shoal_xcalloc((size_t)l->E, sizeof *l->py);
    l->pt = shoal_xcalloc((size_t)l->E, sizeof *l->pt);
    out->vt = &local_vt;
    out->self = l;
    return 0;
}
