/* Token sampling (sampler.h): greedy, temperature, top-k, top-p; xoshiro256**
 * seeded by splitmix64. No allocation after create: ranking uses binary heaps
 * over a preallocated index array (qsort may allocate). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/engine/sampler.h"

struct shoal_sampler {
    shoal_sampler_opts o;
    int vocab;
    uint64_t s[4];
    int32_t *idx; /* [vocab] */
    double *p;    /* [vocab] */
    /* adjustments (sampler.h a-c); NULL when unused */
    shoal_logit_bias *bias;
    int nbias;
    int penalties;    /* any penalty set */
    int32_t *counts;  /* [vocab]: times generated */
    uint8_t *seen;    /* [vocab]: in the prompt or generated */
    float *adj;       /* [vocab]: the adjusted row */
    double log_min_p; /* log(min_p); -inf when off */
};

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t r = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

void shoal_sampler_reseed(shoal_sampler *s, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        s->s[i] = splitmix64(&x);
}

int shoal_sampler_create(shoal_sampler **out, const shoal_sampler_opts *opts, int vocab, char *err, size_t errlen)
{
    *out = NULL;
    shoal_sampler_opts o = opts ? *opts : (shoal_sampler_opts){.temperature = 0.0f, .top_p = 1.0f};
    if (vocab < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: vocab %d", vocab);
    if (!isfinite(o.temperature))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: temperature must be finite");
    if (o.top_p == 0.0f)
        o.top_p = 1.0f;
    if (!(o.top_p > 0.0f && o.top_p <= 1.0f))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: top_p %g outside (0, 1]", (double)o.top_p);
    if (o.top_k < 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: top_k %d is negative", o.top_k);
    if (!(o.min_p >= 0.0f && o.min_p <= 1.0f))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: min_p %g outside [0, 1]", (double)o.min_p);
    if (!isfinite(o.presence_penalty) || !isfinite(o.frequency_penalty))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: presence/frequency penalties must be finite");
    if (o.repetition_penalty == 0.0f)
        o.repetition_penalty = 1.0f;
    if (!(o.repetition_penalty > 0.0f) || !isfinite(o.repetition_penalty))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: repetition_penalty %g must be > 0",
                             (double)o.repetition_penalty);
    if (o.nbias < 0 || (o.nbias && !o.bias))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: logit_bias without entries");
    for (int i = 0; i < o.nbias; i++) {
        if (o.bias[i].id < 0 || o.bias[i].id >= vocab)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: logit_bias id %d outside [0, %d)",
                                 (int)o.bias[i].id, vocab);
        if (!isfinite(o.bias[i].bias))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "sampler: logit_bias of id %d is not finite",
                                 (int)o.bias[i].id);
    }
    shoal_sampler *s = shoal_xcalloc(1, sizeof *s);
    s->o = o;
    s->vocab = vocab;
    s->idx = shoal_xmalloc(sizeof(int32_t) * (size_t)vocab);
    s->p = shoal_xmalloc(sizeof(double) * (size_t)vocab);
    s->log_min_p = o.min_p > 0.0f ? log((double)o.min_p) : -INFINITY;
    if (o.nbias) {
        s->bias = shoal_xmalloc(sizeof *s->bias * (size_t)o.nbias);
        memcpy(s->bias, o.bias, sizeof *s->bias * (size_t)o.nbias);
        s->nbias = o.nbias;
    }
    s->o.bias = NULL;
    s->penalties = o.presence_penalty != 0.0f || o.frequency_penalty != 0.0f || o.repetition_penalty != 1.0f;
    if (s->penalties) {
        s->counts = shoal_xcalloc((size_t)vocab, sizeof *s->counts);
        s->seen = shoal_xcalloc((size_t)vocab, 1);
    }
    if (s->penalties || s->nbias)
        s->adj = shoal_xmalloc(sizeof(float) * (size_t)vocab);
    shoal_sampler_reseed(s, o.seed);
    *out = s;
    return 0;
}

void shoal_sampler_free(shoal_sampler *s)
{
    if (!s)
        return;
    free(s->idx);
    free(s->p);
    free(s->bias);
    free(s->counts);
    free(s->seen);
    free(s->adj);
    free(s);
}

void shoal_sampler_observe(shoal_sampler *s, int32_t id, int generated)
{
    if (!s->penalties || id < 0 || id >= s->vocab)
        return;
    s->seen[id] = 1;
    if (generated && s->counts[id] < INT32_MAX)
        s->counts[id]++;
}

int shoal_sampler_adjusts(const shoal_sampler *s)
{
    return s->adj != NULL;
}

/* sampler.h a-c on a copy of the row. */
static const float *adjust(shoal_sampler *s, const float *logits)
{
    if (!s->adj)
        return logits;
    float *a = s->adj;
    memcpy(a, logits, sizeof(float) * (size_t)s->vocab);
    for (int i = 0; i < s->nbias; i++)
        a[s->bias[i].id] += s->bias[i].bias;
    if (s->penalties) {
        float r = s->o.repetition_penalty, fp = s->o.frequency_penalty, pp = s->o.presence_penalty;
        for (int j = 0; j < s->vocab; j++) {
            if (!s->seen[j])
                continue;
            if (r != 1.0f)
                a[j] = a[j] > 0.0f ? a[j] / r : a[j] * r;
            int32_t c = s->counts[j];
            if (c > 0)
                a[j] -= (float)c * fp + pp;
        }
    }
    return a;
}

int32_t shoal_argmax(const float *x, int n)
{
    int32_t best = -1;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i]))
            continue;
        if (best < 0 || x[i] > x[best])
            best = i;
    }
    return best < 0 ? 0 : best;
}

/* rank order: larger logit first, ties by lower id */
static int better(const float *l, int32_t a, int32_t b)
{
    return l[a] > l[b] || (l[a] == l[b] && a < b);
}

/* heap helpers over idx[0..n): "top" is the element for which before(top, x)
 * holds for every x; max-heap when before = better, min-heap when before =
 * worse. */
static void sift_down(int32_t *h, int n, int i, const float *l, int maxheap)
{
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n)
            return;
        if (c + 1 < n && (maxheap ? better(l, h[c + 1], h[c]) : better(l, h[c], h[c + 1])))
            c++;
        int swap = maxheap ? better(l, h[c], h[i]) : better(l, h[i], h[c]);
        if (!swap)
            return;
        int32_t t = h[i];
        h[i] = h[c];
        h[c] = t;
        i = c;
    }
}

/* Walk candidates cand[0..n) with masses p[0..n) (total tot) and draw one. */
static int32_t draw(shoal_sampler *s, const int32_t *cand, const double *p, int n, double tot)
{
    double u = (double)(xoshiro_next(s->s) >> 11) * 0x1.0p-53;
    double target = u * tot, cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += p[i];
        if (cum > target)
            return cand[i];
    }
    return cand[n - 1];
}

int32_t shoal_sampler_sample(shoal_sampler *s, const float *raw)
{
    const float *logits = adjust(s, raw);
    int V = s->vocab;
    float T = s->o.temperature;
    int k = s->o.top_k;
    double top_p = s->o.top_p;
    if (T <= 0.0f || k == 1)
        return shoal_argmax(logits, V);
    int32_t amax = shoal_argmax(logits, V);
    if (isnan(logits[amax]))
        return 0;
    double lmax = logits[amax], invT = 1.0 / (double)T;

    if (k == 0 && top_p >= 1.0) {
        /* full distribution, id order */
        int n = 0;
        double tot = 0.0;
        for (int i = 0; i < V; i++) {
            if (isnan(logits[i]) || ((double)logits[i] - lmax) * invT < s->log_min_p)
                continue;
            s->idx[n] = i;
            s->p[n] = exp(((double)logits[i] - lmax) * invT);
            tot += s->p[n++];
        }
        return draw(s, s->idx, s->p, n, tot);
    }

    int32_t *h = s->idx;
    int n = 0; /* ranked candidates end up in h[0..n) in rank order */
    if (k > 0) {
        /* min-heap of the k best */
        int m = 0;
        for (int i = 0; i < V; i++) {
            if (isnan(logits[i]))
                continue;
            if (m < k) {
                h[m++] = i;
                /* sift up */
                int j = m - 1;
                while (j > 0) {
                    int pj = (j - 1) / 2;
                    if (!better(logits, h[pj], h[j]))
                        break;
                    int32_t t = h[pj];
                    h[pj] = h[j];
                    h[j] = t;
                    j = pj;
                }
            } else if (better(logits, i, h[0])) {
                h[0] = i;
                sift_down(h, m, 0, logits, 0);
            }
        }
        /* heap-sort: repeatedly move the worst to the end -> rank order */
        for (int e = m - 1; e > 0; e--) {
            int32_t t = h[0];
            h[0] = h[e];
            h[e] = t;
            sift_down(h, e, 0, logits, 0);
        }
        n = m;
        while (n > 1 && ((double)logits[h[n - 1]] - lmax) * invT < s->log_min_p)
            n--; /* min_p: rank order, so the kept ones are a prefix */
        double tot = 0.0;
        for (int i = 0; i < n; i++) {
            s->p[i] = exp(((double)logits[h[i]] - lmax) * invT);
            tot += s->p[i];
        }
        if (top_p < 1.0) {
            double cum = 0.0;
            int keep = n;
            for (int i = 0; i < n; i++) {
                cum += s->p[i];
                if (cum >= top_p * tot) {
                    keep = i + 1;
                    break;
                }
            }
            n = keep;
            tot = cum;
        }
        return draw(s, h, s->p, n, tot);
    }

    /* top-p over the whole vocabulary: the normaliser first, then pop a
     * max-heap in rank order until the mass is reached */
    double Z = 0.0;
    int m = 0;
    for (int i = 0; i < V; i++) {
        if (isnan(logits[i]) || ((double)logits[i] - lmax) * invT < s->log_min_p)
            continue;
        Z += exp(((double)logits[i] - lmax) * invT);
        h[m++] = i;
    }
    for (int i = m / 2 - 1; i >= 0; i--)
        sift_down(h, m, i, logits, 1);
    double cum = 0.0;
    int heap = m;
    /* popped elements are stored from the end of idx backwards; move them to
     * p[] order as we go: p[j] and cand j = h[V-1-j] would need care, so keep a
     * separate order in the tail of h */
    while (heap > 0) {
        int32_t top = h[0];
        h[0] = h[heap - 1];
        heap--;
        sift_down(h, heap, 0, logits, 1);
        h[heap] = top; /* tail h[heap..m) holds popped candidates, best at h[m-1] */
        double pi = exp(((double)logits[top] - lmax) * invT);
        s->p[n++] = pi;
        cum += pi;
        if (cum >= top_p * Z)
            break;
    }
    /* candidates in rank order: h[m-1], h[m-2], ..., h[m-n] */
    double u = (double)(xoshiro_next(s->s) >> 11) * 0x1.0p-53;
    double target = u * cum, c = 0.0;
    for (int i = 0; i < n; i++) {
        c += s->p[i];
        if (c > target)
            return h[m - 1 - i];
    }
    return h[m - n];
}

double shoal_logprobs(const float *logits, int n, int32_t id, int k, int32_t *top_ids, double *top_lp)
{
    int32_t amax = shoal_argmax(logits, n);
    double lmax = logits[amax], z = 0.0;
    int m = 0; /* top_ids[0..m): the best so far, rank order */
    for (int i = 0; i < n; i++) {
        if (isnan(logits[i]))
            continue;
        z += exp((double)logits[i] - lmax);
        if (k <= 0 || (m == k && !better(logits, i, top_ids[m - 1])))
            continue;
        int j = m < k ? m++ : k - 1; /* insert, dropping the last when full */
        while (j > 0 && better(logits, i, top_ids[j - 1])) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = i;
    }
    double lse = isnan(lmax) ? NAN : lmax + log(z);
    for (int i = 0; i < m; i++)
        top_lp[i] = (double)logits[top_ids[i]] - lse;
    for (int i = m; i < k; i++) {
        top_ids[i] = -1;
        top_lp[i] = -INFINITY;
    }
    return id >= 0 && id < n ? (double)logits[id] - lse : -INFINITY;
}
