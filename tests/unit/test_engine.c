/* coordinator/engine: the engine's own invariants on both tiny models
 * (tests/models/tiny-k3: bf16 trunk, MXFP4 experts, lower-bound gate;
 * tiny-k3-plain: f32 trunk, bf16 experts, softplus gate). Agreement with the
 * independent reference is in test_engine_ref.c; here the engine is compared
 * with itself under different schedules, which must be bit-identical by
 * design: batched prefill vs token-by-token, chunk sizes, incremental decode vs
 * full recomputation, decode batches, 1 vs 2 threads, copy/fork. Plus model
 * refusal, the allocation guard, cancellation and a failing expert backend. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/err.h"
#include "common/st.h"
#include "coordinator/engine/engine.h"
#include "coordinator/engine/engine_int.h"
#include "coordinator/engine/sampler.h"
#include "kernels/kernels.h"
#include "test.h"

static const char *MODELS[] = {"tests/models/tiny-k3", "tests/models/tiny-k3-plain"};
#define NMODELS 2

static const int32_t PROMPT[] = {17, 256, 3000, 42, 42, 9, 1023, 4000, 5, 77, 3839, 12, 600, 2048, 1};
#define NPROMPT ((int)(sizeof PROMPT / sizeof PROMPT[0]))

static shoal_model *open_model(const char *rel, int max_batch, int max_context)
{
    char err[4096];
    shoal_model_opts o = {.max_context = max_context, .max_batch = max_batch, .quiet = 1};
    shoal_model *m = NULL;
    int rc = shoal_model_open(&m, test_src_path(rel), &o, err, sizeof err);
    if (rc) {
        fprintf(stderr, "  open %s: %s: %s\n", rel, shoal_strerror(rc), err);
        return NULL;
    }
    return m;
}

static int vocab_of(shoal_model *m)
{
    shoal_model_info in;
    shoal_model_get_info(m, &in);
    return in.vocab;
}

/* logits of every prompt position with prefill chunks of max_batch */
static float *prefill_all(shoal_model *m, const int32_t *ids, int n)
{
    int V = vocab_of(m);
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    shoal_seq *s;
    char err[512];
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    int rc = shoal_seq_prefill(s, ids, n, SHOAL_LOGITS_ALL, lg, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK_EQ_INT(shoal_seq_pos(s), n);
    shoal_seq_free(s);
    return lg;
}

static float *stepwise_all(shoal_model *m, const int32_t *ids, int n)
{
    int V = vocab_of(m);
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    shoal_seq *s;
    char err[512];
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    for (int i = 0; i < n; i++) {
        int rc = shoal_seq_decode(s, ids[i], lg + (size_t)i * V, err, sizeof err);
        CHECK_MSG(rc == 0, "%s", err);
    }
    shoal_seq_free(s);
    return lg;
}

static int first_diff(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)))
            return (int)i;
    return -1;
}

/* batched prefill (one chunk, and chunks of 4) == token-by-token, bit for bit */
static void t_prefill_equals_stepwise(void)
{
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 64, 64);
        shoal_model *m4 = open_model(MODELS[mi], 4, 64);
        CHECK(m && m4);
        if (!m || !m4)
            return;
        int V = vocab_of(m);
        float *a = prefill_all(m, PROMPT, NPROMPT);
        float *b = stepwise_all(m, PROMPT, NPROMPT);
        float *c = prefill_all(m4, PROMPT, NPROMPT);
        int d1 = first_diff(a, b, (size_t)NPROMPT * V), d2 = first_diff(a, c, (size_t)NPROMPT * V);
        CHECK_MSG(d1 < 0, "%s: prefill vs stepwise differ at token %d", MODELS[mi], d1 / V);
        CHECK_MSG(d2 < 0, "%s: chunk 64 vs chunk 4 differ at token %d", MODELS[mi], d2 / V);
        free(a);
        free(b);
        free(c);
        shoal_model_close(m);
        shoal_model_close(m4);
    }
}

/* greedy with incremental decode == greedy recomputing the whole sequence
 * from scratch at every step (ids and logits identical) */
static void t_incremental_equals_full(void)
{
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 64, 64);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m), gen = 10;
        char err[512];
        float *li = malloc(sizeof(float) * V), *lf = malloc(sizeof(float) * V);
        int32_t seq[64];
        memcpy(seq, PROMPT, sizeof(int32_t) * 6);
        int n = 6;
        shoal_seq *inc, *full;
        CHECK(shoal_seq_create(&inc, m, 0, err, sizeof err) == 0);
        CHECK(shoal_seq_create(&full, m, 0, err, sizeof err) == 0);
        CHECK(shoal_seq_prefill(inc, seq, n, SHOAL_LOGITS_LAST, li, err, sizeof err) == 0);
        for (int g = 0; g < gen; g++) {
            shoal_seq_reset(full);
            CHECK(shoal_seq_prefill(full, seq, n, SHOAL_LOGITS_LAST, lf, err, sizeof err) == 0);
            CHECK_MSG(first_diff(li, lf, (size_t)V) < 0, "%s: step %d logits differ", MODELS[mi], g);
            int32_t nx = shoal_argmax(li, V);
            CHECK_EQ_INT(nx, shoal_argmax(lf, V));
            seq[n++] = nx;
            CHECK(shoal_seq_decode(inc, nx, li, err, sizeof err) == 0);
        }
        shoal_seq_free(inc);
        shoal_seq_free(full);
        free(li);
        free(lf);
        shoal_model_close(m);
    }
}

/* one decode batch of three sequences at different positions == each alone */
static void t_decode_batch(void)
{
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 8, 32);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m);
        char err[512];
        shoal_seq *a[3], *b[3];
        int lens[3] = {1, 5, 9};
        for (int i = 0; i < 3; i++) {
            CHECK(shoal_seq_create(&a[i], m, 0, err, sizeof err) == 0);
            CHECK(shoal_seq_create(&b[i], m, 0, err, sizeof err) == 0);
            CHECK(shoal_seq_prefill(a[i], PROMPT + i, lens[i], SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
            CHECK(shoal_seq_prefill(b[i], PROMPT + i, lens[i], SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
        }
        float *lb = malloc(sizeof(float) * 3 * V), *l1 = malloc(sizeof(float) * V);
        for (int step = 0; step < 3; step++) {
            int32_t ids[3] = {100 + step, 200 + step, 300 + step};
            CHECK(shoal_model_decode_batch(m, a, ids, 3, lb, err, sizeof err) == 0);
            for (int i = 0; i < 3; i++) {
                CHECK(shoal_seq_decode(b[i], ids[i], l1, err, sizeof err) == 0);
                CHECK_MSG(first_diff(lb + (size_t)i * V, l1, (size_t)V) < 0, "%s: batch step %d seq %d differs",
                          MODELS[mi], step, i);
            }
        }
        for (int i = 0; i < 3; i++) {
            CHECK_EQ_INT(shoal_seq_pos(a[i]), lens[i] + 3);
            shoal_seq_free(a[i]);
            shoal_seq_free(b[i]);
        }
        free(lb);
        free(l1);
        shoal_model_close(m);
    }
}

/* a mixed step (shoal_model_step): a decode token of one sequence, a prompt
 * chunk of another that ends in the chunk, a first chunk of a third that does
 * not, then a step finishing the third beside two decode tokens == each
 * sequence fed alone (logits and the state the next decode sees), plus the
 * refusals: a sequence's tokens apart, bad logits rows */
static void t_step_mixed(void)
{
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 16, 48);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m);
        char err[512];
        shoal_seq *a[3], *b[3];
        for (int i = 0; i < 3; i++) {
            CHECK(shoal_seq_create(&a[i], m, 0, err, sizeof err) == 0);
            CHECK(shoal_seq_create(&b[i], m, 0, err, sizeof err) == 0);
        }
        /* seq 0 has a 4-token prompt already; 1 gets its 6-token prompt in
         * step 1; 2 gets 5 of its 9 prompt tokens in step 1, 4 in step 2 */
        CHECK(shoal_seq_prefill(a[0], PROMPT, 4, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
        CHECK(shoal_seq_prefill(b[0], PROMPT, 4, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
        float *lg = malloc(sizeof(float) * 3 * V), *l1 = malloc(sizeof(float) * V);
        shoal_seq *cs[16];
        int32_t ids[16];
        int n = 0;
        cs[n] = a[0], ids[n++] = 500;
        for (int j = 0; j < 6; j++)
            cs[n] = a[1], ids[n++] = PROMPT[3 + j];
        for (int j = 0; j < 5; j++)
            cs[n] = a[2], ids[n++] = PROMPT[6 + j];
        int rows1[2] = {0, 6};
        CHECK(shoal_model_step(m, cs, ids, n, rows1, 2, lg, err, sizeof err) == 0);
        CHECK(shoal_seq_decode(b[0], 500, l1, err, sizeof err) == 0);
        CHECK_MSG(first_diff(lg, l1, (size_t)V) < 0, "%s: step 1 decode row differs", MODELS[mi]);
        CHECK(shoal_seq_prefill(b[1], PROMPT + 3, 6, SHOAL_LOGITS_LAST, l1, err, sizeof err) == 0);
        CHECK_MSG(first_diff(lg + V, l1, (size_t)V) < 0, "%s: step 1 prompt-end row differs", MODELS[mi]);
        CHECK(shoal_seq_prefill(b[2], PROMPT + 6, 9, SHOAL_LOGITS_LAST, l1, err, sizeof err) == 0);
        n = 0;
        cs[n] = a[0], ids[n++] = 501;
        cs[n] = a[1], ids[n++] = 502;
        for (int j = 0; j < 4; j++)
            cs[n] = a[2], ids[n++] = PROMPT[11 + j];
        int rows2[3] = {0, 1, 5};
        CHECK(shoal_model_step(m, cs, ids, n, rows2, 3, lg, err, sizeof err) == 0);
        CHECK_MSG(first_diff(lg + 2 * (size_t)V, l1, (size_t)V) < 0, "%s: step 2 prompt-end row differs",
                  MODELS[mi]);
        CHECK(shoal_seq_decode(b[0], 501, l1, err, sizeof err) == 0);
        CHECK_MSG(first_diff(lg, l1, (size_t)V) < 0, "%s: step 2 decode row 0 differs", MODELS[mi]);
        CHECK(shoal_seq_decode(b[1], 502, l1, err, sizeof err) == 0);
        CHECK_MSG(first_diff(lg + V, l1, (size_t)V) < 0, "%s: step 2 decode row 1 differs", MODELS[mi]);
        /* the states carry on identically */
        for (int i = 0; i < 3; i++) {
            CHECK_EQ_INT(shoal_seq_pos(a[i]), shoal_seq_pos(b[i]));
            CHECK(shoal_seq_decode(a[i], 7, lg, err, sizeof err) == 0);
            CHECK(shoal_seq_decode(b[i], 7, l1, err, sizeof err) == 0);
            CHECK_MSG(first_diff(lg, l1, (size_t)V) < 0, "%s: seq %d after the steps differs", MODELS[mi], i);
        }
        /* refusals, before anything runs */
        int pos0 = shoal_seq_pos(a[0]);
        shoal_seq *apart[3] = {a[0], a[1], a[0]};
        int32_t three[3] = {1, 2, 3};
        int r0[1] = {2}, rbad[2] = {1, 1}, rout[1] = {3};
        CHECK(shoal_model_step(m, apart, three, 3, r0, 1, lg, err, sizeof err) == SHOAL_EINVAL);
        shoal_seq *ok[3] = {a[0], a[0], a[1]};
        CHECK(shoal_model_step(m, ok, three, 3, rbad, 2, lg, err, sizeof err) == SHOAL_EINVAL);
        CHECK(shoal_model_step(m, ok, three, 3, rout, 1, lg, err, sizeof err) == SHOAL_EINVAL);
        CHECK_EQ_INT(shoal_seq_pos(a[0]), pos0);
        for (int i = 0; i < 3; i++) {
            shoal_seq_free(a[i]);
            shoal_seq_free(b[i]);
        }
        free(lg);
        free(l1);
        shoal_model_close(m);
    }
}

/* identical logits with 1 and 2 OpenMP threads */
static void t_threads(void)
{
    int saved = omp_get_max_threads();
    if (omp_get_num_procs() < 2)
        fprintf(stderr, "  note: 1 CPU; 2 OpenMP threads still run (time-sliced)\n");
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 16, 64);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m);
        omp_set_num_threads(1);
        float *a = prefill_all(m, PROMPT, NPROMPT);
        float *as = stepwise_all(m, PROMPT, 4);
        omp_set_num_threads(2);
        float *b = prefill_all(m, PROMPT, NPROMPT);
        float *bs = stepwise_all(m, PROMPT, 4);
        CHECK_MSG(first_diff(a, b, (size_t)NPROMPT * V) < 0, "%s: 1 vs 2 threads differ (prefill)", MODELS[mi]);
        CHECK_MSG(first_diff(as, bs, (size_t)4 * V) < 0, "%s: 1 vs 2 threads differ (decode)", MODELS[mi]);
        free(a);
        free(b);
        free(as);
        free(bs);
        shoal_model_close(m);
    }
    omp_set_num_threads(saved);
}

/* keep / restore / fork: a copy taken at position p continues exactly like
 * the original */
static void t_copy_fork(void)
{
    shoal_model *m = open_model(MODELS[0], 16, 32);
    CHECK(m);
    if (!m)
        return;
    int V = vocab_of(m);
    char err[512];
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    shoal_seq *s, *keep, *f;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_create(&keep, m, 8, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(s, PROMPT, 6, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_copy(keep, s, err, sizeof err) == 0);
    CHECK(shoal_seq_fork(&f, s, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(s, PROMPT + 6, 3, SHOAL_LOGITS_LAST, l1, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(f, PROMPT + 6, 3, SHOAL_LOGITS_LAST, l2, err, sizeof err) == 0);
    CHECK(first_diff(l1, l2, (size_t)V) < 0);
    /* restore s to the kept prefix, continue differently, compare with fork */
    CHECK(shoal_seq_copy(s, keep, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_pos(s), 6);
    shoal_seq_reset(f);
    CHECK(shoal_seq_prefill(f, PROMPT, 6, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_decode(s, 999, l1, err, sizeof err) == 0);
    CHECK(shoal_seq_decode(f, 999, l2, err, sizeof err) == 0);
    CHECK(first_diff(l1, l2, (size_t)V) < 0);
    /* a copy into a too-small sequence is refused */
    shoal_seq *tiny;
    CHECK(shoal_seq_create(&tiny, m, 2, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_copy(tiny, s, err, sizeof err), SHOAL_ERANGE);
    /* full sequence: refused before anything runs, state unchanged */
    CHECK(shoal_seq_prefill(tiny, PROMPT, 2, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_seq_decode(tiny, 1, l1, err, sizeof err), SHOAL_ERANGE);
    CHECK_EQ_INT(shoal_seq_pos(tiny), 2);
    /* out-of-range ids refused */
    int32_t bad[2] = {1, V};
    CHECK_EQ_INT(shoal_seq_prefill(s, bad, 2, SHOAL_LOGITS_NONE, NULL, err, sizeof err), SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "token id");
    CHECK_EQ_INT(shoal_seq_pos(s), 7);
    shoal_seq_free(tiny);
    shoal_seq_free(s);
    shoal_seq_free(keep);
    shoal_seq_free(f);
    free(l1);
    free(l2);
    shoal_model_close(m);
}

/* the decode path allocates nothing (count stays 0),
 * and the guard does catch an allocation when armed */
static void t_alloc_guard(void)
{
    shoal_model *m = open_model(MODELS[0], 16, 64);
    CHECK(m);
    if (!m)
        return;
    int V = vocab_of(m);
    char err[512];
    float *lg = malloc(sizeof(float) * V);
    shoal_seq *s;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    uint64_t before = shoal_engine_alloc_count();
    CHECK(shoal_seq_prefill(s, PROMPT, NPROMPT, SHOAL_LOGITS_LAST, lg, err, sizeof err) == 0);
    for (int i = 0; i < 8; i++)
        CHECK(shoal_seq_decode(s, shoal_argmax(lg, V), lg, err, sizeof err) == 0);
    CHECK_EQ_INT(shoal_engine_alloc_count() - before, 0);
    shoal_seq_free(s);
    free(lg);
    shoal_model_close(m);

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    SKIP("allocation guard is compiled out under sanitizers");
#else
    /* armed guard + malloc in a child: with SHOAL_ALLOC_GUARD=abort it must
     * die with SIGABRT; without it the hit is counted and the child lives */
    for (int strict = 1; strict >= 0; strict--) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            int fd = open("/dev/null", O_WRONLY);
            dup2(fd, 2);
            if (strict)
                setenv("SHOAL_ALLOC_GUARD", "abort", 1);
            else
                unsetenv("SHOAL_ALLOC_GUARD");
            uint64_t hits = shoal_engine_alloc_count();
            shoal__engine_guard_arm(1);
            volatile char *p = malloc(64);
            p[0] = 1;
            shoal__engine_guard_arm(0);
            _exit(shoal_engine_alloc_count() == hits + 1 ? 42 : 0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        if (strict)
            CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "strict: child status %d", st);
        else
            CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 42, "counting: child status %d (want the hit counted)",
                      st);
    }
#endif
}

/* cancellation at a chunk boundary: the sequence holds the completed chunks
 * and continues exactly */
static atomic_int cancel_flag;
static void set_cancel_after_layer0(void *ctx, int layer, int T, const float *P, int d)
{
    (void)ctx;
    (void)T;
    (void)P;
    (void)d;
    if (layer == 0)
        atomic_store(&cancel_flag, 1);
}

static void t_cancel(void)
{
    shoal_model *m = open_model(MODELS[0], 4, 32);
    shoal_model *ref = open_model(MODELS[0], 4, 32);
    CHECK(m && ref);
    if (!m || !ref)
        return;
    int V = vocab_of(m);
    char err[512];
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    shoal_seq *s, *r;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_create(&r, ref, 0, err, sizeof err) == 0);
    atomic_store(&cancel_flag, 0);
    shoal_model_set_cancel(m, &cancel_flag);
    m->trace = set_cancel_after_layer0;
    CHECK_EQ_INT(shoal_seq_prefill(s, PROMPT, 10, SHOAL_LOGITS_LAST, l1, err, sizeof err), SHOAL_ECANCELED);
    CHECK_EQ_INT(shoal_seq_pos(s), 4); /* the first chunk completed */
    m->trace = NULL;
    atomic_store(&cancel_flag, 0);
    CHECK(shoal_seq_prefill(s, PROMPT + 4, 6, SHOAL_LOGITS_LAST, l1, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(r, PROMPT, 10, SHOAL_LOGITS_LAST, l2, err, sizeof err) == 0);
    CHECK(first_diff(l1, l2, (size_t)V) < 0);
    shoal_model_set_cancel(m, NULL);
    shoal_seq_free(s);
    shoal_seq_free(r);
    shoal_model_close(m);
    shoal_model_close(ref);
    free(l1);
    free(l2);
}

/* a backend failing in gather: the error surfaces with its message, the
 * sequence is marked broken until reset */
static int fail_submit(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err,
                       size_t errlen)
{
    (void)self, (void)layer, (void)T, (void)k, (void)z, (void)ids, (void)err, (void)errlen;
    return 0;
}
static int fail_gather(void *self, uint16_t *y, char *err, size_t errlen)
{
    (void)y;
    int *calls = self;
    (*calls)++;
    return shoal_err_set(err, errlen, SHOAL_EPEER, "worker tcp://test:1 died");
}
static void fail_close(void *self)
{
    (void)self;
}
static const shoal_experts_vt fail_vt = {.submit = fail_submit, .gather = fail_gather, .close = fail_close};

static void t_backend_failure(void)
{
    char err[512];
    shoal_model_opts o = {.max_context = 16, .max_batch = 8, .remote_experts = 1, .quiet = 1};
    shoal_model *m = NULL;
    CHECK(shoal_model_open(&m, test_src_path(MODELS[0]), &o, err, sizeof err) == 0);
    if (!m)
        return;
    shoal_seq *s;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    /* no backend yet */
    CHECK_EQ_INT(shoal_seq_decode(s, 1, NULL, err, sizeof err), SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "backend");
    int calls = 0;
    shoal_experts b = {.vt = &fail_vt, .self = &calls};
    CHECK(shoal_model_set_experts(m, &b, err, sizeof err) == 0);
    CHECK(b.vt == NULL);
    CHECK_EQ_INT(shoal_seq_decode(s, 1, NULL, err, sizeof err), SHOAL_EPEER);
    CHECK_STR_CONTAINS(err, "tcp://test:1");
    CHECK_EQ_INT(calls, 1);
    CHECK_EQ_INT(shoal_seq_decode(s, 1, NULL, err, sizeof err), SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "broken");
    CHECK_EQ_INT(calls, 1);
    shoal_seq_reset(s);
    CHECK_EQ_INT(shoal_seq_decode(s, 1, NULL, err, sizeof err), SHOAL_EPEER);
    shoal_seq_free(s);
    shoal_model_close(m);
}

/* stop ids from both files: config.json eos_token_id and the tokenizer's
 * eos_token (docs/TESTING.md: tiny [EOS] = 3841, <|end_of_msg|> = 3842) */
static void t_eos_ids(void)
{
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 1, 4);
        CHECK(m);
        if (!m)
            return;
        shoal_model_info in;
        shoal_model_get_info(m, &in);
        CHECK_EQ_INT(in.n_eos, 2);
        CHECK_EQ_INT(in.eos[0], 3841);
        CHECK_EQ_INT(in.eos[1], 3842);
        shoal_model_close(m);
    }
}

/* ---- refusing a model with missing tensors -------------------------------- */

static int copy_file(const char *src, const char *dst)
{
    FILE *a = fopen(src, "rb"), *b = fopen(dst, "wb");
    if (!a || !b) {
        if (a)
            fclose(a);
        if (b)
            fclose(b);
        return -1;
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0)
        fwrite(buf, 1, n, b);
    fclose(a);
    fclose(b);
    return 0;
}

/* write dst/model.safetensors holding every tensor of src except drop[];
 * the tensor named flatten (if any) is written 1-D (a shape mismatch) */
static int write_without(const char *src, const char *dst, const char **drop, int ndrop, const char *flatten)
{
    char err[512], path[4096];
    shoal_st *st;
    if (shoal_st_open(&st, src, NULL, err, sizeof err))
        return -1;
    mkdir(dst, 0755);
    json_t *h = json_object();
    uint64_t off = 0;
    size_t n = shoal_st_count(st);
    for (size_t i = 0; i < n; i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        int skip = 0;
        for (int j = 0; j < ndrop; j++)
            skip |= !strcmp(t->name, drop[j]);
        if (skip)
            continue;
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        json_object_set_new(e, "dtype", json_string(shoal_dtype_name(t->dtype)));
        if (flatten && !strcmp(t->name, flatten))
            json_array_append_new(shape, json_integer((json_int_t)(t->nbytes / shoal_dtype_size(t->dtype))));
        else
            for (int k = 0; k < t->ndim; k++)
                json_array_append_new(shape, json_integer(t->shape[k]));
        json_object_set_new(e, "shape", shape);
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + t->nbytes)));
        json_object_set_new(e, "data_offsets", offs);
        json_object_set_new(h, t->name, e);
        off += (t->nbytes + 7) & ~(uint64_t)7;
    }
    char *hs = json_dumps(h, JSON_COMPACT);
    size_t hl = strlen(hs), padded = (hl + 7) & ~(size_t)7;
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    FILE *f = fopen(path, "wb");
    uint64_t le = padded;
    fwrite(&le, 8, 1, f);
    fwrite(hs, 1, hl, f);
    for (size_t i = hl; i < padded; i++)
        fputc(' ', f);
    static const char zeros[8];
    for (size_t i = 0; i < n; i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        int skip = 0;
        for (int j = 0; j < ndrop; j++)
            skip |= !strcmp(t->name, drop[j]);
        if (skip)
            continue;
        fwrite(t->data, 1, t->nbytes, f);
        fwrite(zeros, 1, ((t->nbytes + 7) & ~(uint64_t)7) - t->nbytes, f);
    }
    fclose(f);
    free(hs);
    json_decref(h);
    shoal_st_close(st);
    const char *files[] = {"config.json", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        char a[4096], b[4096];
        snprintf(a, sizeof a, "%s/%s", src, files[i]);
        snprintf(b, sizeof b, "%s/%s", dst, files[i]);
        if (copy_file(a, b))
            return -1;
    }
    return 0;
}

static void t_refuses_missing(void)
{
    const char *drop[] = {
        "language_model.model.norm.weight",
        "language_model.model.layers.2.self_attn.q_proj.weight",
        "language_model.model.layers.2.self_attn.A_log",
        "language_model.model.layers.3.self_attn.kv_b_proj.weight",
        "language_model.model.layers.5.block_sparse_moe.gate.e_score_correction_bias",
        "language_model.model.layers.5.block_sparse_moe.experts.7.w2.weight_scale",
        "language_model.model.layers.8.block_sparse_moe.experts.23.w1.weight_packed",
    };
    int nd = (int)(sizeof drop / sizeof drop[0]);
    char dir[] = "/tmp/shoal_test_engine_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char dst[4200];
    snprintf(dst, sizeof dst, "%s/m", dir);
    const char *flat = "language_model.model.layers.6.self_attn.b_proj.weight";
    CHECK(write_without(test_src_path(MODELS[0]), dst, drop, nd, flat) == 0);
    /* sanity: the rewritten model without drops opens (so only the drops matter) */
    char full[4200];
    snprintf(full, sizeof full, "%s/full", dir);
    CHECK(write_without(test_src_path(MODELS[0]), full, NULL, 0, NULL) == 0);
    char err[16384];
    shoal_model_opts o = {.max_context = 8, .quiet = 1};
    shoal_model *m = NULL;
    CHECK_EQ_INT(shoal_model_open(&m, full, &o, err, sizeof err), 0);
    shoal_model_close(m);
    m = NULL;
    int rc = shoal_model_open(&m, dst, &o, err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_EMODEL);
    CHECK(m == NULL);
    for (int i = 0; i < nd; i++)
        CHECK_STR_CONTAINS(err, drop[i]);
    CHECK_STR_CONTAINS(err, flat);
    CHECK_STR_CONTAINS(err, "(8 problems");
    /* with remote experts the expert tensors are not required */
    o.remote_experts = 1;
    rc = shoal_model_open(&m, dst, &o, err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_EMODEL);
    CHECK(strstr(err, "experts.7.w2") == NULL);
    CHECK_STR_CONTAINS(err, "(6 problems");
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* The numerics classes (issue 33): the mu class changes the logits (the switch
 * reaches the trunk and the experts of both models' bf16/MXFP4 matrices), and
 * within the class the logits are bit-identical on every ISA this CPU runs
 * (scalar specification, AVX2 and AVX-512F emulations). Leaves the process in
 * the class it found. */
static void t_numerics_classes(void)
{
    shoal_numerics saved = shoal_kernels_numerics();
    shoal_isa isa0 = shoal_kernels_isa();
    for (int mi = 0; mi < NMODELS; mi++) {
        shoal_model *m = open_model(MODELS[mi], 16, 64);
        CHECK(m);
        if (!m)
            return;
        int V = vocab_of(m);
        shoal_kernels_set_numerics(SHOAL_NUMERICS_PORTABLE);
        float *p = prefill_all(m, PROMPT, NPROMPT);
        shoal_kernels_set_numerics(SHOAL_NUMERICS_MU);
        float *ref = NULL;
        int nisa = 0;
        for (int isa = SHOAL_ISA_SCALAR; isa <= SHOAL_ISA_AVX512; isa++) {
            if (shoal_kernels_set_isa((shoal_isa)isa))
                continue; /* this CPU lacks it */
            float *q = prefill_all(m, PROMPT, NPROMPT);
            float *qs = stepwise_all(m, PROMPT, 3);
            CHECK_MSG(first_diff(q, qs, (size_t)3 * V) < 0, "%s: mu class on %s: prefill vs stepwise differ",
                      MODELS[mi], shoal_isa_name((shoal_isa)isa));
            free(qs);
            if (!ref) {
                ref = q;
                /* the rows are not the portable ones: the switch reached the matmuls */
                size_t differ = 0;
                for (size_t i = 0; i < (size_t)NPROMPT * V; i++)
                    differ += memcmp(&p[i], &q[i], sizeof(float)) != 0;
                printf("  %s: mu vs portable: %zu of %zu logits differ\n", MODELS[mi], differ, (size_t)NPROMPT * V);
                CHECK_MSG(differ > (size_t)NPROMPT * V / 2, "%s: the mu class changed only %zu of %zu logits",
                          MODELS[mi], differ, (size_t)NPROMPT * V);
            } else {
                int d = first_diff(ref, q, (size_t)NPROMPT * V);
                CHECK_MSG(d < 0, "%s: mu class: scalar vs %s differ at token %d", MODELS[mi],
                          shoal_isa_name((shoal_isa)isa), d / V);
                free(q);
            }
            nisa++;
        }
        printf("  %s: mu class bit-identical on %d ISA variant%s (mu path on the best: %s)\n", MODELS[mi], nisa,
               nisa == 1 ? "" : "s", shoal_kernels_mu_engine());
        shoal_kernels_set_isa(isa0);
        free(ref);
        free(p);
        shoal_model_close(m);
    }
    shoal_kernels_set_numerics(saved);
}

int main(int argc, char **argv)
{
    test_binary = "test_engine";
    if (argc == 3 && !strcmp(argv[1], "--numerics")) {
        /* the schedule invariants again in another numerics class (test_engine_mu) */
        shoal_numerics nc;
        if (shoal_numerics_parse(argv[2], &nc)) {
            fprintf(stderr, "test_engine: --numerics portable|mu\n");
            return 2;
        }
        shoal_kernels_set_numerics(nc);
        test_binary = nc == SHOAL_NUMERICS_MU ? "test_engine_mu" : "test_engine";
        omp_set_num_threads(1);
        RUN(t_prefill_equals_stepwise);
        RUN(t_incremental_equals_full);
        RUN(t_decode_batch);
        RUN(t_step_mixed);
        RUN(t_threads);
        RUN(t_copy_fork);
        RUN(t_alloc_guard);
        return test_finish();
    }
    /* one thread except where t_threads compares 1 and 2: OpenMP spin-waits
     * make tiny-model runs slow on a loaded 2-core CI machine */
    omp_set_num_threads(1);
    RUN(t_numerics_classes);
    RUN(t_prefill_equals_stepwise);
    RUN(t_incremental_equals_full);
    RUN(t_decode_batch);
    RUN(t_step_mixed);
    RUN(t_threads);
    RUN(t_copy_fork);
    RUN(t_alloc_guard);
    RUN(t_cancel);
    RUN(t_backend_failure);
    RUN(t_eos_ids);
    RUN(t_refuses_missing);
    return test_finish();
}
