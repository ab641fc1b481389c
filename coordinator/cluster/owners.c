/* Owner sets and the per-exchange choice among replicas (see owners.h). */
#include "coordinator/cluster/owners.h"

#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "proto/shard.h"

struct shoal_owners {
    int nw, L, E;
    uint32_t *off;  /* [L * E + 1]: owners of cell c are who[off[c] .. off[c + 1]) */
    int32_t *who;   /* ascending worker index per cell */
    size_t *count;  /* [nw] cells owned */
    size_t replicated;
    /* pick scratch */
    uint32_t *cnt;  /* [E] pairs per expert in this exchange */
    int32_t *used;  /* [E] replicated experts of this exchange */
    uint64_t *load; /* [nw] pairs given to each worker so far */
};

int shoal_owners_open(shoal_owners **out, int nw, const shoal_proto_range *const *r, const size_t *nr,
                      const char *const *names, int num_layers, const uint8_t *is_moe, int num_experts, char *err,
                      size_t errlen)
{
    *out = NULL;
    if (nw < 1 || num_layers < 1 || num_experts < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "owners: no workers or an empty model");
    const size_t cells = (size_t)num_layers * (size_t)num_experts;
    int32_t *first = shoal_xmalloc(cells * sizeof *first);
    size_t rep = 0;
    int rc = shoal_shard_cover_replicas(nw, r, nr, names, num_layers, is_moe, num_experts, first, &rep, err, errlen);
    free(first);
    if (rc)
        return rc;
    shoal_owners *o = shoal_xcalloc(1, sizeof *o);
    o->nw = nw;
    o->L = num_layers;
    o->E = num_experts;
    o->replicated = rep;
    /* per cell, a bit per worker would be L*E*nw; two passes over the ranges
     * into a compact list instead. A worker listing a cell twice counts once. */
    uint32_t *n = shoal_xcalloc(cells + 1, sizeof *n);
    int32_t *last = shoal_xmalloc(cells * sizeof *last); /* last worker counted per cell */
    for (int pass = 0; pass < 2; pass++) {
        for (size_t c = 0; c < cells; c++)
            last[c] = -1;
        if (pass == 1) {
            o->off = shoal_xmalloc((cells + 1) * sizeof *o->off);
            o->off[0] = 0;
            for (size_t c = 0; c < cells; c++)
                o->off[c + 1] = o->off[c] + n[c];
            o->who = shoal_xmalloc(((size_t)o->off[cells] + 1) * sizeof *o->who);
            memset(n, 0, (cells + 1) * sizeof *n);
        }
        for (int w = 0; w < nw; w++) /* ascending w: each cell's list comes out sorted */
            for (size_t i = 0; i < nr[w]; i++) {
                const shoal_proto_range *x = &r[w][i];
                for (uint32_t l = x->l_lo; l <= x->l_hi && l < (uint32_t)num_layers; l++)
                    for (uint32_t e = x->e_lo; e <= x->e_hi && e < (uint32_t)num_experts; e++) {
                        size_t c = (size_t)l * (size_t)num_experts + e;
                        if (last[c] == w)
                            continue;
                        last[c] = w;
                        if (pass == 1)
                            o->who[o->off[c] + n[c]] = w;
                        n[c]++;
                    }
            }
    }
    free(n);
    free(last);
    o->count = shoal_xcalloc((size_t)nw, sizeof *o->count);
    for (size_t c = 0; c < cells; c++)
        for (uint32_t j = o->off[c]; j < o->off[c + 1]; j++)
            o->count[o->who[j]]++;
    o->cnt = shoal_xcalloc((size_t)num_experts, sizeof *o->cnt);
    o->used = shoal_xmalloc((size_t)num_experts * sizeof *o->used);
    o->load = shoal_xcalloc((size_t)nw, sizeof *o->load);
    *out = o;
    return 0;
}

void shoal_owners_close(shoal_owners *o)
{
    if (!o)
        return;
    free(o->off);
    free(o->who);
    free(o->count);
    free(o->cnt);
    free(o->used);
    free(o->load);
    free(o);
}

size_t shoal_owners_count(const shoal_owners *o, int w)
{
    return w >= 0 && w < o->nw ? o->count[w] : 0;
}

size_t shoal_owners_replicated(const shoal_owners *o)
{
    return o->replicated;
}

int shoal_owners_of(const shoal_owners *o, int layer, int expert, const int32_t **who)
{
    *who = NULL;
    if (layer < 0 || layer >= o->L || expert < 0 || expert >= o->E)
        return 0;
    size_t c = (size_t)layer * (size_t)o->E + (size_t)expert;
    *who = o->who + o->off[c];
    return (int)(o->off[c + 1] - o->off[c]);
}

void shoal_owners_pick(shoal_owners *o, int layer, int T, int k, const int32_t *ids, const uint8_t *live,
                       int32_t *pick)
{
    if (layer < 0 || layer >= o->L || T < 1 || k < 1)
        return;
    const int E = o->E;
    const uint32_t *off = o->off + (size_t)layer * (size_t)E;
    const size_t n = (size_t)T * (size_t)k;
    /* pairs per expert; the single-owner experts' pairs are fixed load */
    memset(o->load, 0, (size_t)o->nw * sizeof *o->load);
    int nu = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t e = ids[i];
        if (e < 0 || e >= E || off[e] == off[e + 1])
            continue;
        if (o->cnt[e]++ == 0 && off[e + 1] - off[e] > 1)
            o->used[nu++] = e;
    }
    for (size_t i = 0; i < n; i++) {
        int32_t e = ids[i];
        if (e < 0 || e >= E || off[e] == off[e + 1] || off[e + 1] - off[e] > 1 || !o->cnt[e])
            continue;
        pick[e] = o->who[off[e]];
        o->load[pick[e]] += o->cnt[e];
        o->cnt[e] = 0; /* counted once */
    }
    /* replicated experts, most pairs first, ties to the lower id (insertion
     * sort: at most min(T * k, E) of them, and no allocation) */
    for (int i = 1; i < nu; i++) {
        int32_t x = o->used[i];
        int j = i;
        while (j > 0 && (o->cnt[o->used[j - 1]] < o->cnt[x] ||
                         (o->cnt[o->used[j - 1]] == o->cnt[x] && o->used[j - 1] > x))) {
            o->used[j] = o->used[j - 1];
            j--;
        }
        o->used[j] = x;
    }
    for (int i = 0; i < nu; i++) {
        int32_t e = o->used[i];
        int32_t best = -1;
        for (uint32_t j = off[e]; j < off[e + 1]; j++) { /* ascending index: ties to the lower */
            int32_t w = o->who[j];
            if (live && !live[w])
                continue;
            if (best < 0 || o->load[w] < o->load[best])
                best = w;
        }
        if (best < 0) /* no owner up: the lowest (the request names it down) */
            best = o->who[off[e]];
        pick[e] = best;
        o->load[best] += o->cnt[e];
        o->cnt[e] = 0;
    }
}
