/* trunk_client against real trunk servers (worker/expert_server.h in threads
 * of this process, real ZeroMQ sockets over ipc://) on the tiny model, with
 * replicated trunk rows (issue 18): every row of a matrix on two of three
 * servers, one of them slow. The rows the client gathers equal the
 * in-process kernel's (shoal_gemm_bf16/_f32 over the whole matrix: what the
 * coordinator computes without workers) bit for bit: when every worker
 * answers, when the slow one is given up after failover_ms and its rows are
 * resent to the other owner within the same call (timed: after the failover
 * time, before the slow reply would have come), and in the calls after, which
 * avoid it without waiting. shoal_expert_client_covered() says covered while
 * each row keeps an owner up and names the rows once both of their owners
 * are gone; a call then fails naming a worker. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "common/log.h"
#include "common/st.h"
#include "coordinator/cluster/trunk_client.h"
#include "kernels/kernels.h"
#include "proto/fprint.h"
#include "proto/tshard.h"
#include "tests/unit/test.h"
#include "tests/unit/test_srv.h"
#include "worker/expert_server.h"

static char model[4096];
static shoal_k3cfg cfg;
static shoal_st *store;
static uint8_t fp[SHOAL_PROTO_FP_BYTES];
static int have_model;

typedef test_srv srv;

static void srv_start(srv *s, int tag, const char *trunk, unsigned delay_us)
{
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://@shoal-test-trunk-client-%d-%d", (int)getpid(), tag);
    test_srv_start(s, model, ep, NULL, trunk, delay_us);
}

#define srv_stop test_srv_stop

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* y[T, rows] = x[T, cols] · Wᵀ in process (the coordinator's own kernel). */
static void local_rows(const shoal_tensor *t, const float *x, int T, float *y)
{
    int rows = (int)t->shape[0], cols = (int)t->shape[1];
    if (t->dtype == SHOAL_DT_BF16)
        shoal_gemm_bf16(y, t->data, x, rows, cols, T);
    else
        shoal_gemm_f32(y, t->data, x, rows, cols, T);
}

static void t_failover(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    shoal_tshard_mat *mats = NULL;
    int nm = 0;
    CHECK(shoal_tshard_mats(&cfg, &mats, &nm) == 0 && nm > 0);
    /* lm_head: the largest, the same ROWSPEC item on every server */
    int k = shoal_tshard_find(mats, nm, "language_model.lm_head.weight");
    CHECK(k >= 0);
    if (k < 0) {
        free(mats);
        return;
    }
    const shoal_tensor *tt = shoal_st_find(store, mats[k].name);
    CHECK(tt && tt->data);
    const int rows = mats[k].rows, cols = mats[k].cols, T = 3;
    /* halves: h0 on w0 and w1, h1 on w1 (slow: 1 s per batch) and w2; the
     * pick sends h0 to w0 and h1 to w1 (its first holder) */
    srv w[3];
    srv_start(&w[0], 0, "lm_head.weight:0/2", 0);
    srv_start(&w[1], 1, "lm_head.weight:1/2,lm_head.weight:0/2", 1000000);
    srv_start(&w[2], 2, "lm_head.weight:1/2", 0);
    const char *eps[3] = {w[0].ep, w[1].ep, w[2].ep};
    shoal_expert_client_opts o = {.endpoints = eps, .nworkers = 3, .cfg = &cfg, .fingerprint = fp, .max_tokens = 8,
                                  .timeout_ms = 3000, .failover_ms = 150, .hello_timeout_ms = 5000,
                                  .trunk_role = 1, .st = store};
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK_MSG(shoal_trunk_client_open(&c, &o, err, sizeof err) == 0, "%s", err);
    float *x = malloc(sizeof(float) * (size_t)T * (size_t)cols);
    float *ya = malloc(sizeof(float) * (size_t)T * (size_t)rows), *yb = malloc(sizeof(float) * (size_t)T * rows);
    uint32_t r = 2463534242u;
    for (int i = 0; i < T * cols; i++) {
        r ^= r << 13;
        r ^= r >> 17;
        r ^= r << 5;
        x[i] = (float)((int)(r % 20001) - 10000) / 4000.0f;
    }
    local_rows(tt, x, T, ya);
    if (c) {
        shoal_rmat b = shoal_trunk_client_backend(c);
        CHECK(b.vt->has(b.self, mats[k].name, rows, cols));
        shoal_rmat_job job = {.name = mats[k].name, .rows = rows, .cols = cols, .y = yb};
        /* 1: w1 silent past the failover time: its half resent to w2 */
        memset(yb, 0x7f, sizeof(float) * (size_t)T * rows);
        double t0 = now_s();
        CHECK_MSG(b.vt->submit(b.self, cfg.num_layers, &job, 1, x, T, err, sizeof err) == 0, "%s", err);
        int rc = b.vt->gather(b.self, err, sizeof err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == 0, "rc %d: %s", rc, err);
        CHECK_MSG(dt >= 0.14 && dt < 0.9, "finished after %.3f s (failover 0.15 s, the slow reply at 1 s)", dt);
        CHECK(!memcmp(ya, yb, sizeof(float) * (size_t)T * rows));
        shoal_expert_client_stats st;
        shoal_expert_client_get_stats(c, &st);
        CHECK_MSG(st.failovers == 1 && st.resent_pairs == (uint64_t)(rows - rows / 2) && st.failures == 0 &&
                      st.downs == 1,
                  "failovers %llu, resent rows %llu (want %d), failures %llu, downs %llu",
                  (unsigned long long)st.failovers, (unsigned long long)st.resent_pairs, rows - rows / 2,
                  (unsigned long long)st.failures, (unsigned long long)st.downs);
        char why[512];
        CHECK(shoal_expert_client_worker_up(c, 1, why, sizeof why) == 0);
        CHECK_STR_CONTAINS(why, "failover");
        CHECK(shoal_expert_client_covered(c, why, sizeof why) == 1);
        /* 2: w1 down: the picks avoid it, no waiting, the same bits */
        for (int trial = 0; trial < 3; trial++) {
            memset(yb, 0x7f, sizeof(float) * (size_t)T * rows);
            t0 = now_s();
            CHECK(b.vt->submit(b.self, cfg.num_layers, &job, 1, x, T, err, sizeof err) == 0);
            rc = b.vt->gather(b.self, err, sizeof err);
            dt = now_s() - t0;
            if (shoal_expert_client_worker_up(c, 1, NULL, 0))
                break; /* the keeper brought it back (it answers HELLO between batches): it may be picked */
            CHECK_MSG(rc == 0 && dt < 0.14, "rc %d after %.3f s: %s", rc, dt, err);
            CHECK(!memcmp(ya, yb, sizeof(float) * (size_t)T * rows));
        }
        /* 3: both holders of h1 gone: not covered, named; a call fails naming a worker */
        srv_stop(&w[2]);
        srv_stop(&w[1]);
        int cov = 1;
        for (double t_end = now_s() + 5; now_s() < t_end && (cov = shoal_expert_client_covered(c, why, sizeof why));)
            usleep(20000);
        CHECK_MSG(cov == 0, "still covered after both holders of the upper half stopped");
        char want[256];
        snprintf(want, sizeof want, "trunk rows %d-%d of %s: all their owners", rows / 2, rows - 1, mats[k].name);
        CHECK_STR_CONTAINS(why, want);
        CHECK(b.vt->submit(b.self, cfg.num_layers, &job, 1, x, T, err, sizeof err) == 0);
        rc = b.vt->gather(b.self, err, sizeof err);
        CHECK_MSG(rc == SHOAL_EPEER && strstr(err, "trunk worker") && strstr(err, "is down"), "rc %d: %s", rc, err);
    }
    shoal_expert_client_close(c);
    for (int i = 0; i < 3; i++)
        srv_stop(&w[i]);
    free(x);
    free(ya);
    free(yb);
    free(mats);
}

int main(void)
{
    test_binary = "test_trunk_client";
    shoal_log_set_level(SHOAL_LOG_ERROR);
    shoal_kernels_init();
    snprintf(model, sizeof model, "%s", test_src_path("tests/models/tiny-k3"));
    char path[4200], err[1024];
    snprintf(path, sizeof path, "%s/config.json", model);
    shoal_st_opts so = {.map = 1};
    have_model = access(path, R_OK) == 0 && shoal_k3cfg_load(&cfg, path, err, sizeof err) == 0 &&
                 shoal_st_open(&store, model, &so, err, sizeof err) == 0 &&
                 shoal_fprint_model(fp, &cfg, store, err, sizeof err) == 0;
    RUN(t_failover);
    shoal_st_close(store);
    return test_finish();
}
