/* The prompt-lookup drafter (draft.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/engine/draft.h"

#define DECAY 0.8

struct shoal_drafter {
    shoal_draft_opts o;
    double S, N; /* decayed accepted drafts, and trials (accepted + rejections) */
    int k;
};

int shoal_draft_parse_mode(const char *s, shoal_draft_mode *mode)
{
    if (!strcmp(s, "ngram"))
        *mode = SHOAL_DRAFT_NGRAM;
    else if (!strcmp(s, "off"))
        *mode = SHOAL_DRAFT_OFF;
    else
        return SHOAL_EINVAL;
    return 0;
}

int shoal_draft_parse_cost(const char *s, shoal_draft_opts *o)
{
    char *end;
    double a = strtod(s, &end), b = 0.0;
    if (end == s || !(a > 0.0 && a < 1.0))
        return SHOAL_EINVAL;
    if (*end == ',') {
        const char *q = end + 1;
        b = strtod(q, &end);
        if (end == q || !(b >= 0.0 && b <= 4.0))
            return SHOAL_EINVAL;
        if (b == 0.0)
            b = -1.0; /* explicitly none */
    }
    if (*end)
        return SHOAL_EINVAL;
    o->cost = a;
    o->cost0 = b;
    return 0;
}

static int k_of(const shoal_drafter *d)
{
    if (d->o.fixed)
        return d->o.max;
    double r = d->S / d->N;
    if (r <= 0.0)
        return 0;
    /* tokens per cost of a pass with k drafts, the best k (draft.h, 3.) */
    double best = 1.0, gain = 1.0, p = 1.0;
    int bk = 0;
    for (int k = 1; k <= d->o.max; k++) {
        p *= r;
        gain += p;
        double v = gain / (1.0 + d->o.cost0 + d->o.cost * k);
        if (v > best) {
            best = v;
            bk = k;
        }
    }
    return bk;
}

void shoal_drafter_reset(shoal_drafter *d)
{
    d->S = 1.0;
    d->N = 2.0;
    d->k = k_of(d);
}

int shoal_drafter_create(shoal_drafter **out, const shoal_draft_opts *opts, char *err, size_t errlen)
{
    *out = NULL;
    shoal_draft_opts o = opts ? *opts : (shoal_draft_opts){.mode = SHOAL_DRAFT_NGRAM};
    if (o.mode != SHOAL_DRAFT_OFF && o.mode != SHOAL_DRAFT_NGRAM && o.mode != SHOAL_DRAFT_SCRIPT)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: unknown mode %d", (int)o.mode);
    if (!o.max)
        o.max = 8;
    if (!o.ngram_min)
        o.ngram_min = 2;
    if (!o.ngram_max)
        o.ngram_max = 16;
    if (o.cost == 0.0)
        o.cost = 0.2;
    if (!(o.cost > 0.0 && o.cost < 1.0))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: cost %g outside (0, 1)", o.cost);
    if (o.cost0 == 0.0)
        o.cost0 = 0.3;
    else if (o.cost0 < 0.0)
        o.cost0 = 0.0;
    if (!(o.cost0 <= 4.0))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: cost0 %g outside [0, 4]", o.cost0);
    if (o.max < 1 || o.max > SHOAL_DRAFT_MAX_K)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: max %d outside [1, %d]", o.max, SHOAL_DRAFT_MAX_K);
    if (o.ngram_min < 1 || o.ngram_max < o.ngram_min)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: n-gram sizes [%d, %d] (need 1 <= min <= max)",
                             o.ngram_min, o.ngram_max);
    if (o.mode == SHOAL_DRAFT_SCRIPT && (!o.script || o.n_script < 0))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "draft: script mode without a script");
    shoal_drafter *d = shoal_xcalloc(1, sizeof *d);
    d->o = o;
    shoal_drafter_reset(d);
    *out = d;
    return 0;
}

void shoal_drafter_free(shoal_drafter *d)
{
    free(d);
}

int shoal_drafter_k(const shoal_drafter *d)
{
    return d->k;
}

int shoal_drafter_max(const shoal_drafter *d)
{
    return d->o.max;
}

shoal_draft_mode shoal_drafter_mode(const shoal_drafter *d)
{
    return d->o.mode;
}

void shoal_drafter_update(shoal_drafter *d, int drafted, int accepted)
{
    if (drafted <= 0)
        return;
    d->S = DECAY * d->S + accepted;
    d->N = DECAY * d->N + accepted + (accepted < drafted);
    d->k = k_of(d);
}

int shoal_drafter_propose(shoal_drafter *d, const int32_t *hist, int n, int limit, int32_t *out)
{
    int k = limit < SHOAL_DRAFT_MAX_K ? limit : SHOAL_DRAFT_MAX_K;
    if (k <= 0 || n < 1 || d->o.mode == SHOAL_DRAFT_OFF)
        return 0;
    if (d->o.mode == SHOAL_DRAFT_SCRIPT) {
        int m = 0;
        while (m < k && n + m < d->o.n_script) {
            out[m] = d->o.script[n + m];
            m++;
        }
        return m;
    }
    int gmax = d->o.ngram_max, best_len = 0, best_i = -1;
    int32_t last = hist[n - 1];
    for (int i = n - 2; i >= 0; i--) {
        if (hist[i] != last)
            continue;
        int L = 1;
        while (L < gmax && i - L >= 0 && hist[i - L] == hist[n - 1 - L])
            L++;
        if (L > best_len) {
            best_len = L;
            best_i = i;
            if (L == gmax)
                break;
        }
    }
    if (best_len < d->o.ngram_min)
        return 0;
    for (int j = 0; j < k; j++) {
        int p = best_i + 1 + j;
        out[j] = p < n ? hist[p] : out[p - n];
    }
    return k;
}
