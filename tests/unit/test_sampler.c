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
    return test_finish();
}
