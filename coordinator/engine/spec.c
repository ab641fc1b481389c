/* Speculative decoding, the verify side (engine.h shoal_spec_*): a drop-in
 * for shoal_seq_decode that runs drafted tokens ahead in one verify chunk
 * and serves their logits while the fed tokens follow the draft.
 *
 * State: the sequence holds base + nchunk tokens; the first base + used of
 * them are fed (committed), chunk[used..nchunk) are drafts run ahead, and
 * lg row j holds the logits after chunk[j]. Nothing else changes how tokens
 * are chosen: the caller samples every position itself, in order. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "coordinator/engine/engine_int.h"

struct shoal_spec {
    shoal_seq *s;
    shoal_drafter *d;
    int V, K;
    float *lg;      /* [K + 1, V] */
    int32_t *chunk; /* [K + 1] */
    int base, nchunk, used;
    int32_t shadow; /* K = 0: the draft proposed but not verified, -1: none */
    shoal_spec_stats st;
    shoal_spec_hook hook; /* told the drafts before each verify forward */
    void *hook_ctx;
};

void shoal_spec_set_hook(shoal_spec *sp, shoal_spec_hook fn, void *ctx)
{
    sp->hook = fn;
    sp->hook_ctx = ctx;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int shoal_spec_create(shoal_spec **out, shoal_seq *s, const shoal_draft_opts *opts, char *err, size_t errlen)
{
    *out = NULL;
    shoal_drafter *d;
    int rc = shoal_drafter_create(&d, opts, err, errlen);
    if (rc)
        return rc;
    int K = shoal_drafter_mode(d) == SHOAL_DRAFT_OFF ? 0 : shoal_drafter_max(d);
    if (K + 1 > s->m->info.max_batch)
        K = s->m->info.max_batch - 1; /* a verify chunk is one forward chunk */
    if ((rc = shoal_seq_reserve_rewind(s, K, err, errlen))) {
        shoal_drafter_free(d);
        return rc;
    }
    shoal_spec *sp = shoal_xcalloc(1, sizeof *sp);
    sp->s = s;
    sp->d = d;
    sp->K = K;
    sp->V = s->m->info.vocab;
    sp->lg = K ? shoal_xmalloc(sizeof(float) * (size_t)(K + 1) * (size_t)sp->V) : NULL;
    sp->chunk = shoal_xmalloc(sizeof(int32_t) * (size_t)(K + 1));
    sp->shadow = -1;
    *out = sp;
    return 0;
}

size_t shoal_spec_bytes(const shoal_model *m, const shoal_draft_opts *opts)
{
    if (!opts || opts->mode == SHOAL_DRAFT_OFF)
        return 0;
    int K = opts->max ? opts->max : 8; /* shoal_drafter_create's default */
    if (K > SHOAL_DRAFT_MAX_K)
        K = SHOAL_DRAFT_MAX_K;
    if (K + 1 > m->info.max_batch)
        K = m->info.max_batch - 1;
    if (K < 0)
        K = 0;
    return shoal_model_rewind_bytes(m, K) +
           (size_t)(K + 1) * (sizeof(float) * (size_t)m->info.vocab + sizeof(int32_t));
}

void shoal_spec_free(shoal_spec *sp)
{
    if (!sp)
        return;
    shoal_drafter_free(sp->d);
    free(sp->lg);
    free(sp->chunk);
    free(sp);
}

void shoal_spec_begin(shoal_spec *sp)
{
    sp->nchunk = sp->used = 0;
    sp->base = sp->s->pos;
    sp->shadow = -1;
    shoal_drafter_reset(sp->d);
}

static void count(shoal_spec *sp, uint64_t fed, uint64_t passes, uint64_t drafted, uint64_t accepted)
{
    sp->st.fed += fed;
    sp->st.passes += passes;
    sp->st.drafted += drafted;
    sp->st.accepted += accepted;
    shoal_cmetrics_spec(sp->s->m->cm, fed, passes, drafted, accepted);
}

/* cut the pending drafts off: the sequence then holds base + used tokens */
static int cut(shoal_spec *sp, char *err, size_t errlen)
{
    if (sp->used >= sp->nchunk)
        return 0;
    shoal_drafter_update(sp->d, sp->nchunk - 1, sp->used - 1);
    double t0 = now_s();
    int rc = shoal_seq_rewind(sp->s, sp->base + sp->used, err, errlen);
    sp->st.rewind_s += now_s() - t0;
    sp->st.rewinds++;
    sp->nchunk = sp->used;
    return rc;
}

int shoal_spec_settle(shoal_spec *sp, char *err, size_t errlen)
{
    return sp ? cut(sp, err, errlen) : 0;
}

int shoal_spec_decode(shoal_spec *sp, const int32_t *hist, int n, int limit, float *logits, char *err,
                      size_t errlen)
{
    shoal_seq *s = sp->s;
    if (n < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "spec decode: empty history");
    int32_t id = hist[n - 1];
    if (sp->shadow >= 0) { /* the unverified draft of the last plain step: was it right? */
        shoal_drafter_update(sp->d, 1, sp->shadow == id);
        sp->st.shadowed++;
        sp->st.shadow_hits += sp->shadow == id;
        sp->shadow = -1;
    }
    if (sp->used < sp->nchunk) {
        if (sp->base + sp->used != n - 1)
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "spec decode: history of %d tokens, the sequence holds %d fed ones", n - 1,
                                 sp->base + sp->used);
        if (sp->chunk[sp->used] == id) { /* the draft was right: its logits are ready */
            memcpy(logits, sp->lg + (size_t)sp->used * sp->V, sizeof(float) * (size_t)sp->V);
            sp->used++;
            count(sp, 1, 0, 0, 1);
            if (sp->used == sp->nchunk)
                shoal_drafter_update(sp->d, sp->nchunk - 1, sp->nchunk - 1);
            return 0;
        }
        int rc = cut(sp, err, errlen);
        if (rc)
            return rc;
    }
    if (s->pos != n - 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "spec decode: history of %d tokens, the sequence is at position %d", n - 1, s->pos);
    int room = s->capacity - s->pos - 1, K = shoal_drafter_k(sp->d);
    if (K > sp->K)
        K = sp->K;
    int k = limit < K ? limit : K;
    if (k > room)
        k = room;
    k = k > 0 ? shoal_drafter_propose(sp->d, hist, n, k, sp->chunk + 1) : 0;
    sp->base = s->pos;
    int rc;
    if (k == 0) {
        if (K == 0 && limit > 0 && sp->K > 0 && shoal_drafter_propose(sp->d, hist, n, 1, sp->chunk + 1) == 1)
            sp->shadow = sp->chunk[1];
        sp->nchunk = sp->used = 0;
        rc = shoal_seq_decode(s, id, logits, err, errlen);
        if (rc)
            return rc;
        sp->base = s->pos;
        count(sp, 1, 1, 0, 0);
        return 0;
    }
    sp->chunk[0] = id;
    sp->nchunk = sp->used = 0;
    if (sp->hook)
        sp->hook(sp->hook_ctx, sp->chunk + 1, k);
    rc = shoal_seq_verify(s, sp->chunk, k + 1, sp->lg, err, errlen);
    if (rc)
        return rc;
    sp->nchunk = k + 1;
    sp->used = 1;
    sp->st.verifies++;
    memcpy(logits, sp->lg, sizeof(float) * (size_t)sp->V);
    count(sp, 1, 1, (uint64_t)k, 0);
    return 0;
}

void shoal_spec_get_stats(const shoal_spec *sp, shoal_spec_stats *out)
{
    *out = sp->st;
}

int shoal_spec_k(const shoal_spec *sp)
{
    return shoal_drafter_k(sp->d);
}
