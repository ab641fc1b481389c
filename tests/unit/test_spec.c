/* coordinator/engine draft.c, spec.c and the rewind entry points
 * (shoal_seq_verify / shoal_seq_rewind): speculative decoding must give the
 * same ids and the same logits, bit for bit, as plain decoding. Expected
 * values always come from plain decoding (shoal_seq_decode + the sampler)
 * on a separate sequence; the speculative side only has to reproduce them.
 * Drafts are forced to hit and miss with the test drafter
 * (SHOAL_DRAFT_SCRIPT: a token list with planted errors), and the prompt-
 * lookup drafter runs on a prompt built to repeat. The drafter's own
 * contract (draft.h) is checked on hand-made histories. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/engine/engine.h"
#include "coordinator/engine/engine_int.h"
#include "test.h"

static const char *MODELS[] = {"tests/models/tiny-k3", "tests/models/tiny-k3-plain"};
#define NMODELS 2
#define GEN 48

static shoal_model *open_model(const char *rel, int max_batch, int max_context)
{
    char err[4096];
    shoal_model_opts o = {.max_context = max_context, .max_batch = max_batch, .quiet = 1};
    shoal_model *m = NULL;
    int rc = shoal_model_open(&m, test_src_path(rel), &o, err, sizeof err);
    if (rc)
        fprintf(stderr, "  open %s: %s: %s\n", rel, shoal_strerror(rc), err);
    return m;
}

static int vocab_of(shoal_model *m)
{
    shoal_model_info in;
    shoal_model_get_info(m, &in);
    return in.vocab;
}

/* ---- the drafter alone ---------------------------------------------------- */

static void t_drafter_contract(void)
{
    char err[256];
    shoal_drafter *d;
    shoal_draft_opts o = {.mode = SHOAL_DRAFT_NGRAM, .max = 4, .fixed = 1};
    CHECK(shoal_drafter_create(&d, &o, err, sizeof err) == 0);
    int32_t out[16];
    /* longest suffix match wins over a more recent shorter one: suffix 1 2 3
     * matches at index 2 (length 3: "1 2 3" then 7 8) and at index 8 only
     * "2 3"-long ... */
    int32_t h1[] = {9, 1, 2, 3, 7, 8, 5, 2, 3, 6, 6, 1, 2, 3};
    int n = shoal_drafter_propose(d, h1, 14, 4, out);
    CHECK_EQ_INT(n, 4);
    CHECK(out[0] == 7 && out[1] == 8 && out[2] == 5 && out[3] == 2);
    /* equal length: the most recent; limit caps the count */
    int32_t h2[] = {4, 5, 10, 4, 5, 11, 4, 5};
    n = shoal_drafter_propose(d, h2, 8, 2, out);
    CHECK_EQ_INT(n, 2);
    CHECK(out[0] == 11 && out[1] == 4);
    /* a loop continues past the end of the history */
    int32_t h3[] = {1, 2, 3, 1, 2, 3};
    n = shoal_drafter_propose(d, h3, 6, 4, out);
    CHECK_EQ_INT(n, 4);
    CHECK(out[0] == 1 && out[1] == 2 && out[2] == 3 && out[3] == 1);
    /* only a 1-token match: below ngram_min 2, no draft */
    int32_t h4[] = {1, 2, 3, 4, 5, 3};
    CHECK_EQ_INT(shoal_drafter_propose(d, h4, 6, 4, out), 0);
    CHECK_EQ_INT(shoal_drafter_propose(d, h3, 6, 0, out), 0);
    shoal_drafter_free(d);

    /* adaptation (cost 1 + 0.3 + 0.2 k): start r = 1/2 -> tokens per cost
     * 1, 1.5/1.5, 1.75/1.7, 1.875/1.9 -> K = 2; all accepted raises it to max,
     * rejections bring it down to 0 (shadow only) */
    o = (shoal_draft_opts){.mode = SHOAL_DRAFT_NGRAM, .max = 8};
    CHECK(shoal_drafter_create(&d, &o, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_drafter_k(d), 2);
    for (int i = 0; i < 30; i++)
        shoal_drafter_update(d, 2, 2);
    CHECK_EQ_INT(shoal_drafter_k(d), 8);
    for (int i = 0; i < 30; i++)
        shoal_drafter_update(d, 8, 0);
    CHECK_EQ_INT(shoal_drafter_k(d), 0);
    /* one miss of 2 from the start: r = .8 / 2.6 = .31, 1.31 / 1.5 < 1 -> 0 */
    shoal_drafter_reset(d);
    shoal_drafter_update(d, 2, 0);
    CHECK_EQ_INT(shoal_drafter_k(d), 0);
    /* two shadow hits: r = 2.312 / 3.464 = .667 -> per cost 1.11, 1.24,
     * 1.268, 1.24 for k = 1..4 -> K = 3 */
    shoal_drafter_update(d, 1, 1);
    shoal_drafter_update(d, 1, 1);
    CHECK_EQ_INT(shoal_drafter_k(d), 3);
    /* r = S/N after one chunk of 4 drafted, 1 accepted from the start:
     * S = .8 + 1, N = 1.6 + 2 -> r = .5 -> K 2 */
    shoal_drafter_reset(d);
    shoal_drafter_update(d, 4, 1);
    CHECK_EQ_INT(shoal_drafter_k(d), 2);
    shoal_drafter_free(d);

    /* bad options are refused by name */
    o = (shoal_draft_opts){.mode = SHOAL_DRAFT_NGRAM, .max = 17};
    CHECK(shoal_drafter_create(&d, &o, err, sizeof err) == SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "max");
    o = (shoal_draft_opts){.mode = SHOAL_DRAFT_NGRAM, .cost = 1.5};
    CHECK(shoal_drafter_create(&d, &o, err, sizeof err) == SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "cost");
    o = (shoal_draft_opts){.mode = SHOAL_DRAFT_NGRAM, .ngram_min = 5, .ngram_max = 3};
    CHECK(shoal_drafter_create(&d, &o, err, sizeof err) == SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "n-gram");
    shoal_draft_opts co = {0};
    CHECK(shoal_draft_parse_cost("0.15,0.5", &co) == 0 && co.cost == 0.15 && co.cost0 == 0.5);
    CHECK(shoal_draft_parse_cost("0.3", &co) == 0 && co.cost == 0.3 && co.cost0 == 0.0);
    CHECK(shoal_draft_parse_cost("0.3,0", &co) == 0 && co.cost0 < 0.0); /* explicitly no fixed cost */
    CHECK(shoal_draft_parse_cost("1.5", &co) == SHOAL_EINVAL);
    CHECK(shoal_draft_parse_cost("0.2,9", &co) == SHOAL_EINVAL);
    CHECK(shoal_draft_parse_cost("0.2,x", &co) == SHOAL_EINVAL);
    shoal_draft_mode md;
    CHECK(shoal_draft_parse_mode("ngram", &md) == 0 && md == SHOAL_DRAFT_NGRAM);
    CHECK(shoal_draft_parse_mode("off", &md) == 0 && md == SHOAL_DRAFT_OFF);
    CHECK(shoal_draft_parse_mode("eagle", &md) == SHOAL_EINVAL);
}

/* ---- plain decoding: the reference ---------------------------------------- */

typedef struct {
    int32_t ids[GEN];
    float *lg; /* [GEN + 1, V]: lg row i chose ids[i]; row GEN = after the last fed */
} plain_run;

static const shoal_sampler_opts GREEDY = {.temperature = 0.0f, .top_p = 1.0f};
static const shoal_sampler_opts SAMPLED = {.temperature = 0.9f, .top_p = 0.95f, .top_k = 0, .seed = 1234};
static const shoal_sampler_opts SAMPLED_K = {.temperature = 0.7f, .top_p = 1.0f, .top_k = 40, .seed = 99};

/* prompt, then GEN sampled ids, each fed back (GEN decodes) */
static void plain_decode(shoal_model *m, const int32_t *prompt, int np, const shoal_sampler_opts *so, plain_run *r)
{
    char err[512];
    int V = vocab_of(m);
    r->lg = malloc(sizeof(float) * (size_t)(GEN + 1) * V);
    shoal_seq *s;
    shoal_sampler *smp;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_sampler_create(&smp, so, V, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(s, prompt, np, SHOAL_LOGITS_LAST, r->lg, err, sizeof err) == 0);
    for (int i = 0; i < GEN; i++) {
        r->ids[i] = shoal_sampler_sample(smp, r->lg + (size_t)i * V);
        int rc = shoal_seq_decode(s, r->ids[i], r->lg + (size_t)(i + 1) * V, err, sizeof err);
        CHECK_MSG(rc == 0, "%s", err);
    }
    shoal_sampler_free(smp);
    shoal_seq_free(s);
}

/* The same generation through shoal_spec_decode; ids and every row of
 * logits must equal the plain run's. Returns the stats. */
static shoal_spec_stats spec_decode(shoal_model *m, const int32_t *prompt, int np, const shoal_sampler_opts *so,
                                    const shoal_draft_opts *dopt, const plain_run *ref, const char *what)
{
    char err[512];
    int V = vocab_of(m);
    shoal_spec_stats st = {0};
    float *lg = malloc(sizeof(float) * V);
    int32_t *hist = malloc(sizeof(int32_t) * (size_t)(np + GEN));
    memcpy(hist, prompt, sizeof(int32_t) * (size_t)np);
    shoal_seq *s;
    shoal_sampler *smp;
    shoal_spec *sp;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_sampler_create(&smp, so, V, err, sizeof err) == 0);
    CHECK_MSG(shoal_spec_create(&sp, s, dopt, err, sizeof err) == 0, "%s", err);
    CHECK(shoal_seq_prefill(s, prompt, np, SHOAL_LOGITS_LAST, lg, err, sizeof err) == 0);
    shoal_spec_begin(sp);
    int bad_ids = -1, bad_lg = -1;
    for (int i = 0; i < GEN; i++) {
        if (bad_lg < 0 && memcmp(lg, ref->lg + (size_t)i * V, sizeof(float) * V))
            bad_lg = i;
        int32_t id = shoal_sampler_sample(smp, lg);
        if (bad_ids < 0 && id != ref->ids[i])
            bad_ids = i;
        hist[np + i] = id;
        int rc = shoal_spec_decode(sp, hist, np + i + 1, GEN - i, lg, err, sizeof err);
        CHECK_MSG(rc == 0, "%s: %s", what, err);
        if (rc)
            break;
    }
    /* the logits after the last fed token: bit for bit */
    if (bad_lg < 0 && memcmp(lg, ref->lg + (size_t)GEN * V, sizeof(float) * V))
        bad_lg = GEN;
    CHECK_MSG(bad_ids < 0, "%s: id %d differs from plain decoding", what, bad_ids);
    CHECK_MSG(bad_lg < 0, "%s: logits of step %d differ from plain decoding", what, bad_lg);
    /* settled, the sequence holds exactly prompt + GEN: one more plain decode
     * gives the same logits as the plain run's next step would */
    CHECK(shoal_spec_settle(sp, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_pos(s), np + GEN);
    shoal_spec_get_stats(sp, &st);
    CHECK_EQ_INT((int)st.fed, GEN);
    CHECK_EQ_INT((int)(st.passes + st.accepted), GEN);
    shoal_spec_free(sp);
    shoal_sampler_free(smp);
    shoal_seq_free(s);
    free(hist);
    free(lg);
    return st;
}

static const int32_t PROMPT[] = {17, 256, 3000, 42, 42, 9, 1023, 4000, 5, 77, 3839, 12, 600, 2048, 1};
#define NPROMPT ((int)(sizeof PROMPT / sizeof PROMPT[0]))

/* script = the plain ids with every `every`-th one replaced (a miss there) */
static void planted(int32_t *script, const int32_t *prompt, int np, const plain_run *r, int every, int V)
{
    memcpy(script, prompt, sizeof(int32_t) * (size_t)np);
    for (int i = 0; i < GEN; i++)
        script[np + i] = (every && i % every == every - 1) ? (r->ids[i] + 1) % V : r->ids[i];
}

static void t_identity_script(void)
{
    const shoal_sampler_opts *sos[] = {&GREEDY, &SAMPLED, &SAMPLED_K};
    const char *son[] = {"greedy", "seeded top-p", "seeded top-k"};
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 16, 128);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m);
        for (int k = 0; k < 3; k++) {
            plain_run r;
            plain_decode(m, PROMPT, NPROMPT, sos[k], &r);
            int32_t script[NPROMPT + GEN];
            /* all hits (K 8 fixed), a miss every 3rd / 5th / 2nd token, K 1..8
             * adaptive: mixed accept and reject, rewinds of every length */
            int everys[] = {0, 3, 5, 2, 7};
            int maxes[] = {8, 4, 8, 1, 6};
            uint64_t acc = 0, rew = 0;
            for (int e = 0; e < 5; e++) {
                planted(script, PROMPT, NPROMPT, &r, everys[e], V);
                shoal_draft_opts d = {.mode = SHOAL_DRAFT_SCRIPT, .max = maxes[e], .fixed = e < 2,
                                      .script = script, .n_script = NPROMPT + GEN};
                char what[160];
                snprintf(what, sizeof what, "%s %s, miss every %d, K %d", MODELS[mi], son[k], everys[e], maxes[e]);
                shoal_spec_stats st = spec_decode(m, PROMPT, NPROMPT, sos[k], &d, &r, what);
                acc += st.accepted;
                rew += st.rewinds;
                if (e == 0)
                    CHECK_MSG(st.passes <= (GEN + 8) / 9 + 1, "%s: %llu passes for %d tokens, all drafts right",
                              what, (unsigned long long)st.passes, GEN);
            }
            CHECK(acc > GEN);
            CHECK(rew > 10);
            free(r.lg);
        }
        shoal_model_close(m);
    }
}

/* the prompt-lookup drafter itself: random-weight models do not continue
 * their prompt, so drafts nearly always miss; a long prompt of many distinct
 * ids with ngram_min 1 makes it propose often (every generated id that occurs
 * in the prompt), which exercises propose/verify/rewind on real model output */
static void t_identity_ngram(void)
{
    enum { NP = 700 };
    int32_t *prompt = malloc(sizeof(int32_t) * NP);
    for (int i = 0; i < NP; i++)
        prompt[i] = (int32_t)((i * 7 + (i / 50) * 3) % 4096);
    const shoal_sampler_opts *sos[] = {&GREEDY, &SAMPLED};
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 16, NP + GEN + 1);
        CHECK(m);
        if (!m)
            break;
        for (int k = 0; k < 2; k++) {
            plain_run r;
            plain_decode(m, prompt, NP, sos[k], &r);
            shoal_draft_opts d = {.mode = SHOAL_DRAFT_NGRAM, .max = 6, .ngram_min = 1};
            char what[160];
            snprintf(what, sizeof what, "%s ngram %s", MODELS[mi], k ? "seeded" : "greedy");
            shoal_spec_stats st = spec_decode(m, prompt, NP, sos[k], &d, &r, what);
            CHECK_MSG(st.drafted > 0, "%s: nothing drafted", what);
            fprintf(stderr, "  %s: drafted %llu accepted %llu passes %llu for %d tokens, %llu shadowed\n", what,
                    (unsigned long long)st.drafted, (unsigned long long)st.accepted, (unsigned long long)st.passes,
                    GEN, (unsigned long long)st.shadowed);
            free(r.lg);
        }
        shoal_model_close(m);
    }
    free(prompt);
}

/* rewind reaches only the last verify chunk */
static void t_rewind_api(void)
{
    shoal_model *m = open_model(MODELS[0], 8, 64);
    CHECK(m);
    if (!m)
        return;
    char err[512];
    int V = vocab_of(m);
    float *lg = malloc(sizeof(float) * 8 * V), *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    shoal_seq *s, *p;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_create(&p, m, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_reserve_rewind(s, 8, err, sizeof err) == SHOAL_EINVAL); /* >= max_batch */
    CHECK(shoal_seq_reserve_rewind(s, 4, err, sizeof err) == 0);
    CHECK(shoal_seq_verify(s, PROMPT, 6, lg, err, sizeof err) == SHOAL_EINVAL); /* needs room 5 */
    CHECK(shoal_seq_prefill(s, PROMPT, 3, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_rewind(s, 2, err, sizeof err) == SHOAL_ERANGE); /* no verify yet */
    CHECK(shoal_seq_verify(s, PROMPT + 3, 5, lg, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_pos(s), 8);
    CHECK(shoal_seq_rewind(s, 3, err, sizeof err) == SHOAL_ERANGE); /* before the chunk */
    CHECK(shoal_seq_rewind(s, 6, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_pos(s), 6);
    CHECK(shoal_seq_rewind(s, 7, err, sizeof err) == SHOAL_ERANGE); /* forward again: no */
    CHECK(shoal_seq_rewind(s, 5, err, sizeof err) == 0);            /* further back: yes */
    /* then the next token equals plain decoding's */
    CHECK(shoal_seq_prefill(p, PROMPT, 5, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_decode(p, 3000, a, err, sizeof err) == 0);
    CHECK(shoal_seq_decode(s, 3000, b, err, sizeof err) == 0);
    CHECK(memcmp(a, b, sizeof(float) * V) == 0);
    CHECK(shoal_seq_rewind(s, 5, err, sizeof err) == SHOAL_ERANGE); /* a plain forward ended the reach */
    /* verify logits are prefill logits */
    float *pl = malloc(sizeof(float) * 5 * V);
    shoal_seq_reset(p);
    CHECK(shoal_seq_prefill(p, PROMPT, 3, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    for (int i = 0; i < 5; i++)
        CHECK(shoal_seq_decode(p, PROMPT[3 + i], pl + (size_t)i * V, err, sizeof err) == 0);
    shoal_seq_reset(s);
    CHECK(shoal_seq_prefill(s, PROMPT, 3, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_verify(s, PROMPT + 3, 5, lg, err, sizeof err) == 0);
    CHECK(memcmp(lg, pl, sizeof(float) * 5 * V) == 0);
    free(pl);
    free(lg);
    free(a);
    free(b);
    shoal_seq_free(s);
    shoal_seq_free(p);
    shoal_model_close(m);
}

int main(void)
{
    test_binary = "test_spec";
    omp_set_num_threads(1);
    RUN(t_drafter_contract);
    RUN(t_rewind_api);
    RUN(t_identity_script);
    RUN(t_identity_ngram);
    return test_finish();
}
