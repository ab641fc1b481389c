/* coordinator/sampler: the contract of sampler.h. Expected distributions are
 * computed here from the documented formula (softmax of logits/T over the
 * kept candidates), independently of the sampler's code. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/engine/engine_int.h"
#include "coordinator/engine/sampler.h"
#include "test.h"

static shoal_sampler *mk(float temp, float top_p, int top_k, uint64_t seed, int vocab)
{
    shoal_sampler *s = NULL;
    char err[256];
    shoal_sampler_opts o = {.temperature = temp, .top_p = top_p, .top_k = top_k, .seed = seed};
    int rc = shoal_sampler_create(&s, &o, vocab, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    return s;
}

static void t_argmax(void)
{
    float x[6] = {1, 3, 2, 3, NAN, -INFINITY};
    CHECK_EQ_INT(shoal_argmax(x, 6), 1); /* tie 1 vs 3 -> lower */
    float n[2] = {NAN, NAN};
    CHECK_EQ_INT(shoal_argmax(n, 2), 0);
    float y[3] = {NAN, -5, -6};
    CHECK_EQ_INT(shoal_argmax(y, 3), 1);
}

static void t_greedy_default(void)
{
    float x[5] = {0.5f, 2.0f, 2.0f, -1.0f, 1.9f};
    shoal_sampler *s = NULL;
    char err[128];
    CHECK(shoal_sampler_create(&s, NULL, 5, err, sizeof err) == 0);
    for (int i = 0; i < 10; i++)
        CHECK_EQ_INT(shoal_sampler_sample(s, x), 1);
    shoal_sampler_free(s);
    s = mk(1.0f, 1.0f, 1, 7, 5); /* top_k 1 is greedy */
    for (int i = 0; i < 10; i++)
        CHECK_EQ_INT(shoal_sampler_sample(s, x), 1);
    shoal_sampler_free(s);
}

static void t_refuses_bad_opts(void)
{
    shoal_sampler *s = NULL;
    char err[128];
    shoal_sampler_opts o = {.temperature = 1, .top_p = 1.5f};
    CHECK_EQ_INT(shoal_sampler_create(&s, &o, 10, err, sizeof err), SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "top_p");
    o = (shoal_sampler_opts){.temperature = 1, .top_p = 1, .top_k = -1};
    CHECK_EQ_INT(shoal_sampler_create(&s, &o, 10, err, sizeof err), SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "top_k");
    o = (shoal_sampler_opts){.temperature = NAN, .top_p = 1};
    CHECK_EQ_INT(shoal_sampler_create(&s, &o, 10, err, sizeof err), SHOAL_EINVAL);
    o = (shoal_sampler_opts){.temperature = 1, .top_p = NAN};
    CHECK_EQ_INT(shoal_sampler_create(&s, &o, 10, err, sizeof err), SHOAL_EINVAL);
    CHECK(s == NULL);
}

/* same seed -> same ids; another seed -> a different stream; reseed restarts */
static void t_reproducible(void)
{
    enum { V = 1000, N = 200 };
    float *x = malloc(sizeof(float) * V);
    for (int i = 0; i < V; i++)
        x[i] = (float)((i * 7919) % 101) / 25.0f;
    int32_t a[N], b[N], c[N], d[N];
    shoal_sampler *s1 = mk(0.8f, 0.9f, 0, 1234, V), *s2 = mk(0.8f, 0.9f, 0, 1234, V), *s3 = mk(0.8f, 0.9f, 0, 99, V);
    for (int i = 0; i < N; i++) {
        a[i] = shoal_sampler_sample(s1, x);
        b[i] = shoal_sampler_sample(s2, x);
        c[i] = shoal_sampler_sample(s3, x);
    }
    shoal_sampler_reseed(s1, 1234);
    for (int i = 0; i < N; i++)
        d[i] = shoal_sampler_sample(s1, x);
    CHECK(!memcmp(a, b, sizeof a));
    CHECK(!memcmp(a, d, sizeof a));
    CHECK(memcmp(a, c, sizeof a) != 0);
    shoal_sampler_free(s1);
    shoal_sampler_free(s2);
    shoal_sampler_free(s3);
    free(x);
}

/* empirical frequencies against the formula: |f - p| within 5 standard errors */
static void check_freq(const char *what, shoal_sampler *s, const float *x, int V, const double *p, int n)
{
    int *cnt = calloc((size_t)V, sizeof(int));
    for (int i = 0; i < n; i++) {
        int32_t id = shoal_sampler_sample(s, x);
        CHECK(id >= 0 && id < V);
        cnt[id]++;
    }
    for (int i = 0; i < V; i++) {
        double f = (double)cnt[i] / n, se = sqrt(p[i] * (1 - p[i]) / n) + 1e-12;
        if (p[i] == 0)
            CHECK_MSG(cnt[i] == 0, "%s: id %d drawn %d times but excluded", what, i, cnt[i]);
        else
            CHECK_MSG(fabs(f - p[i]) <= 5 * se, "%s: id %d freq %.4f expected %.4f", what, i, f, p[i]);
    }
    free(cnt);
}

/* p_i ∝ exp(x_i / T) over the kept set (given as a mask) */
static void expected(double *p, const float *x, int V, float T, const int *keep)
{
    double z = 0;
    for (int i = 0; i < V; i++) {
        p[i] = keep[i] ? exp((double)x[i] / T) : 0;
        z += p[i];
    }
    for (int i = 0; i < V; i++)
        p[i] /= z;
}

static void t_distributions(void)
{
    enum { V = 6, N = 40000 };
    /* probabilities at T=1 ≈ .43 .26 .16 .09 .04 .02 ; ids shuffled */
    float x[V] = {1.0f, 2.0f, 0.0f, 1.5f, -0.7f, 0.5f};
    double p[V];
    int all[V] = {1, 1, 1, 1, 1, 1};

    shoal_sampler *s = mk(1.0f, 1.0f, 0, 1, V);
    expected(p, x, V, 1.0f, all);
    check_freq("T=1", s, x, V, p, N);
    shoal_sampler_free(s);

    s = mk(0.5f, 1.0f, 0, 2, V);
    expected(p, x, V, 0.5f, all);
    check_freq("T=0.5", s, x, V, p, N);
    shoal_sampler_free(s);

    /* top_k 3 keeps ids 1, 3, 0 */
    int k3[V] = {1, 1, 0, 1, 0, 0};
    s = mk(1.0f, 1.0f, 3, 3, V);
    expected(p, x, V, 1.0f, k3);
    check_freq("top_k=3", s, x, V, p, N);
    shoal_sampler_free(s);

    /* top_p: rank order 1 (.43), 3 (.26), 0 (.16) ...; cumulative .43 .69 .85:
     * top_p 0.6 keeps {1,3}; top_p 0.8 keeps {1,3,0} */
    double full[V];
    expected(full, x, V, 1.0f, all);
    double c2 = full[1] + full[3], c3 = c2 + full[0];
    CHECK(c2 > 0.6 && c2 < 0.8 && c3 > 0.8);
    int p2[V] = {0, 1, 0, 1, 0, 0};
    s = mk(1.0f, 0.6f, 0, 4, V);
    expected(p, x, V, 1.0f, p2);
    check_freq("top_p=0.6", s, x, V, p, N);
    shoal_sampler_free(s);
    s = mk(1.0f, 0.8f, 0, 5, V);
    expected(p, x, V, 1.0f, k3);
    check_freq("top_p=0.8", s, x, V, p, N);
    shoal_sampler_free(s);

    /* top_k 4 then top_p within those four: masses renormalised over the 4,
     * (.43 .26 .16 .09)/.94: cumulative .46 .73 .90 -> top_p .85 keeps 3 */
    s = mk(1.0f, 0.85f, 4, 6, V);
    expected(p, x, V, 1.0f, k3);
    check_freq("top_k=4,top_p=0.85", s, x, V, p, N);
    shoal_sampler_free(s);

    /* a tiny top_p keeps the single best */
    s = mk(1.0f, 0.01f, 0, 7, V);
    for (int i = 0; i < 50; i++)
        CHECK_EQ_INT(shoal_sampler_sample(s, x), 1);
    shoal_sampler_free(s);
}

/* ties in ranking: equal logits, top_k keeps the lower ids */
static void t_topk_ties(void)
{
    float x[6] = {1, 5, 5, 5, 0, 5};
    shoal_sampler *s = mk(1.0f, 1.0f, 2, 11, 6);
    int seen[6] = {0};
    for (int i = 0; i < 2000; i++)
        seen[shoal_sampler_sample(s, x)]++;
    CHECK(seen[1] > 0 && seen[2] > 0);
    CHECK(seen[0] == 0 && seen[3] == 0 && seen[4] == 0 && seen[5] == 0);
    shoal_sampler_free(s);
}

/* NaN logits are never drawn */
static void t_nan(void)
{
    float x[4] = {NAN, 1.0f, NAN, 1.0f};
    shoal_sampler *s = mk(1.0f, 1.0f, 0, 3, 4), *t = mk(1.0f, 0.9f, 0, 3, 4), *u = mk(1.0f, 1.0f, 3, 3, 4);
    for (int i = 0; i < 500; i++) {
        int a = shoal_sampler_sample(s, x), b = shoal_sampler_sample(t, x), c = shoal_sampler_sample(u, x);
        CHECK((a == 1 || a == 3) && (b == 1 || b == 3) && (c == 1 || c == 3));
    }
    shoal_sampler_free(s);
    shoal_sampler_free(t);
    shoal_sampler_free(u);
}

/* sampling a real-size vocabulary allocates nothing (engine's guard armed) */
static void t_no_alloc(void)
{
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    SKIP("allocation guard is compiled out under sanitizers");
#endif
    enum { V = 163840 };
    float *x = malloc(sizeof(float) * V);
    for (int i = 0; i < V; i++)
        x[i] = (float)((i * 2654435761u) % 1000u) / 100.0f;
    shoal_sampler *s[4] = {mk(0.7f, 0.95f, 0, 1, V), mk(0.7f, 1.0f, 40, 1, V), mk(1.0f, 1.0f, 0, 1, V),
                           mk(0.0f, 1.0f, 0, 1, V)};
    uint64_t before = shoal_engine_alloc_count();
    shoal__engine_guard_arm(1);
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < 4; i++)
            (void)shoal_sampler_sample(s[i], x);
    shoal__engine_guard_arm(0);
    CHECK_EQ_INT(shoal_engine_alloc_count() - before, 0);
    for (int i = 0; i < 4; i++)
        shoal_sampler_free(s[i]);
    free(x);
}

/* Penalties and bias (sampler.h a-c), checked against the formulas written
 * out here: greedy must pick the argmax of the reference-adjusted row. */
static void ref_adjust(const float *l, float *a, int V, const int32_t *prompt, int np, const int32_t *gen, int ng,
                       float rep, float freq, float pres, const shoal_logit_bias *b, int nb)
{
    for (int j = 0; j < V; j++)
        a[j] = l[j];
    for (int i = 0; i < nb; i++)
        a[b[i].id] += b[i].bias;
    for (int j = 0; j < V; j++) {
        int seen = 0, c = 0;
        for (int i = 0; i < np; i++)
            seen |= prompt[i] == j;
        for (int i = 0; i < ng; i++)
            c += gen[i] == j;
        if (seen || c)
            a[j] = a[j] > 0 ? a[j] / rep : a[j] * rep;
        a[j] -= (float)c * freq + (c > 0 ? pres : 0.0f);
    }
}

static void t_penalties(void)
{
    enum { V = 8 };
    const float l[V] = {2.0f, 1.9f, -0.5f, 1.7f, -0.2f, 0.3f, 1.8f, -3.0f};
    const int32_t prompt[] = {0, 2};
    const struct {
        float rep, freq, pres;
    } cfg[] = {{1.0f, 0.0f, 0.0f}, {1.3f, 0.0f, 0.0f}, {1.0f, 0.4f, 0.0f}, {1.0f, 0.0f, 0.35f},
               {1.15f, 0.2f, 0.1f}, {0.8f, -0.3f, -0.2f}};
    const shoal_logit_bias bias[] = {{6, -0.05f}, {4, 0.6f}};
    int changed = 0;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
        for (int nb = 0; nb <= 2; nb++) {
            shoal_sampler *s = NULL;
            char err[256];
            shoal_sampler_opts o = {.temperature = 0, .top_p = 1, .repetition_penalty = cfg[c].rep,
                                    .frequency_penalty = cfg[c].freq, .presence_penalty = cfg[c].pres,
                                    .bias = nb ? bias : NULL, .nbias = nb};
            CHECK_MSG(shoal_sampler_create(&s, &o, V, err, sizeof err) == 0, "%s", err);
            for (int i = 0; i < 2; i++)
                shoal_sampler_observe(s, prompt[i], 0);
            int32_t gen[12];
            for (int t = 0; t < 12; t++) {
                float a[V];
                ref_adjust(l, a, V, prompt, 2, gen, t, cfg[c].rep, cfg[c].freq, cfg[c].pres, bias, nb);
                int32_t want = shoal_argmax(a, V), got = shoal_sampler_sample(s, l);
                CHECK_MSG(got == want, "cfg %zu bias %d step %d: %d, want %d", c, nb, t, (int)got, (int)want);
                changed += got != shoal_argmax(l, V);
                gen[t] = got;
                shoal_sampler_observe(s, got, 1);
            }
            shoal_sampler_free(s);
        }
    CHECK(changed > 20); /* the adjustments did change choices */
    /* refusals */
    shoal_sampler *s = NULL;
    char err[128];
    shoal_sampler_opts bad = {.temperature = 1, .top_p = 1, .min_p = 1.5f};
    CHECK(shoal_sampler_create(&s, &bad, V, err, sizeof err) == SHOAL_EINVAL);
    shoal_logit_bias far = {V, 1.0f};
    shoal_sampler_opts bad2 = {.temperature = 1, .top_p = 1, .bias = &far, .nbias = 1};
    CHECK(shoal_sampler_create(&s, &bad2, V, err, sizeof err) == SHOAL_EINVAL);
    shoal_sampler_opts bad3 = {.temperature = 1, .top_p = 1, .repetition_penalty = -1};
    CHECK(shoal_sampler_create(&s, &bad3, V, err, sizeof err) == SHOAL_EINVAL);
}

/* min_p keeps the ids whose probability is at least min_p times the most
 * likely one's: min_p = 1 is greedy at any temperature; otherwise the draws
 * never leave the kept set and cover it, with top_k / top_p or without. */
static void t_min_p(void)
{
    enum { V = 6 };
    const float l[V] = {0.0f, 1.0f, -2.0f, 0.9f, 0.2f, -0.1f};
    /* exp(l - 1): 0.368 1 0.05 0.905 0.449 0.333 */
    const struct {
        float min_p, top_p;
        int top_k;
    } cfg[] = {{1.0f, 1.0f, 0}, {0.4f, 1.0f, 0}, {0.4f, 1.0f, 5}, {0.4f, 0.999f, 0}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        shoal_sampler *s = NULL;
        char err[128];
        shoal_sampler_opts o = {.temperature = 1, .top_p = cfg[c].top_p, .top_k = cfg[c].top_k, .seed = 7 + c,
                                .min_p = cfg[c].min_p};
        CHECK(shoal_sampler_create(&s, &o, V, err, sizeof err) == 0);
        int hits[V] = {0};
        for (int i = 0; i < 3000; i++)
            hits[shoal_sampler_sample(s, l)]++;
        for (int j = 0; j < V; j++) {
            int kept = exp((double)l[j] - 1.0) >= cfg[c].min_p;
            CHECK_MSG(kept ? hits[j] > 0 : hits[j] == 0, "cfg %zu id %d: %d draws (kept %d)", c, j, hits[j], kept);
        }
        shoal_sampler_free(s);
    }
}

/* shoal_logprobs: log-softmax in double, top ids in rank order (ties to the
 * lower id), against a direct computation. */
static void t_logprobs(void)
{
    enum { V = 7 };
    const float l[V] = {1.5f, -2.0f, 3.25f, 1.5f, 0.0f, -40.0f, 3.0f};
    double z = 0;
    for (int j = 0; j < V; j++)
        z += exp((double)l[j]);
    int32_t top[4];
    double lp[4];
    double got = shoal_logprobs(l, V, 4, 4, top, lp);
    CHECK_NEAR(got, 0.0 - log(z), 1e-12);
    const int32_t want[4] = {2, 6, 0, 3};
    for (int i = 0; i < 4; i++) {
        CHECK_EQ_INT(top[i], want[i]);
        CHECK_NEAR(lp[i], (double)l[want[i]] - log(z), 1e-12);
    }
    int32_t top9[9];
    double lp9[9];
    shoal_logprobs(l, V, 0, 9, top9, lp9);
    CHECK_EQ_INT(top9[6], 5);
    CHECK_EQ_INT(top9[7], -1);
    CHECK(shoal_logprobs(l, V, 0, 0, NULL, NULL) < 0);
}

int main(void)
{
    test_binary = "test_sampler";
    RUN(t_argmax);
    RUN(t_greedy_default);
    RUN(t_refuses_bad_opts);
    RUN(t_reproducible);
    RUN(t_distributions);
    RUN(t_topk_ties);
    RUN(t_nan);
    RUN(t_no_alloc);
    RUN(t_penalties);
    RUN(t_min_p);
    RUN(t_logprobs);
    return test_finish();
}
