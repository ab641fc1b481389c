/* expert_client against real expert servers (worker/expert_server.h in
 * threads of this process, real ZeroMQ sockets over ipc://) on the tiny model:
 * the gathered outputs equal the in-process backend's bit for bit for random
 * batches and any assignment of experts to workers, replicated ones included
 * (each replica does get work); ownership gaps and fingerprint mismatches are
 * refused naming the workers, overlaps (replicas) are accepted; a silent worker fails
 * the request within the deadline naming it, its late reply is dropped and the
 * next request fails at once until the worker is back; a stopped worker fails
 * the next request at once, and one restarted on its endpoint is re-verified
 * (refused with other ranges) and serves again; and submit/gather do not
 * allocate on the calling thread. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "common/log.h"
#include "common/st.h"
#include "coordinator/engine/engine.h"
#include "coordinator/engine/engine_int.h"
#include "coordinator/cluster/expert_client.h"
#include "coordinator/engine/experts_local.h"
#include "kernels/kernels.h"
#include "proto/fprint.h"
#include "proto/shard.h"
#include "tests/unit/test.h"
#include "tests/unit/test_srv.h"
#include "worker/expert_server.h"

#define MAXW 4

static char model[4096];
static shoal_k3cfg cfg;
static shoal_st *store;
static uint8_t fp[SHOAL_PROTO_FP_BYTES];
static int have_model;

typedef test_srv srv;

static int tag;
static void srv_start(srv *s, const char *ranges, unsigned delay_us)
{
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://@shoal-test-client-%d-%d", (int)getpid(), tag++);
    test_srv_start(s, model, ep, ranges, NULL, delay_us);
}

/* Restart on s's endpoint (a worker process restarted in place). */
static void srv_restart(srv *s, const char *ranges)
{
    test_srv_start(s, model, s->ep, ranges, NULL, 0);
}

#define srv_stop test_srv_stop

static int open_client(shoal_expert_client **c, srv *w, int n, const uint8_t *fpr, int timeout_ms, char *err,
                       size_t errlen)
{
    const char *eps[MAXW];
    for (int i = 0; i < n; i++)
        eps[i] = w[i].ep;
    shoal_expert_client_opts o = {.endpoints = eps, .nworkers = n, .cfg = &cfg, .fingerprint = fpr,
                                  .max_tokens = 16, .timeout_ms = timeout_ms, .hello_timeout_ms = 5000};
    return shoal_expert_client_open(c, &o, err, errlen);
}

static uint32_t rng = 88172645u;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

/* Random routing: T tokens, k distinct ascending experts each. */
static void random_batch(int T, float *z, int32_t *ids)
{
    int d = cfg.latent_size, k = cfg.experts_per_token, E = cfg.num_experts;
    for (int i = 0; i < T * d; i++)
        z[i] = (float)((int)(rnd() % 20001) - 10000) / 3000.0f;
    for (int t = 0; t < T; t++) {
        int chosen[256] = {0}, n = 0;
        while (n < k) {
            int e = (int)(rnd() % (uint32_t)E);
            if (!chosen[e]) {
                chosen[e] = 1;
                n++;
            }
        }
        for (int e = 0, s = 0; e < E; e++)
            if (chosen[e])
                ids[t * k + s++] = e;
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Compare the client with the in-process backend over random batches. */
static void compare(shoal_expert_client *c, int trials)
{
    char err[1024];
    shoal_experts local;
    CHECK(shoal_experts_local_open(&local, store, &cfg, "language_model.model.layers.", 16, err, sizeof err) == 0);
    shoal_experts remote = shoal_expert_client_backend(c);
    int d = cfg.latent_size, k = cfg.experts_per_token;
    float *z = malloc(sizeof(float) * 16 * (size_t)d);
    int32_t *ids = malloc(sizeof(int32_t) * 16 * (size_t)k);
    uint16_t *ya = malloc(2 * 16 * (size_t)k * (size_t)d), *yb = malloc(2 * 16 * (size_t)k * (size_t)d);
    for (int trial = 0; trial < trials; trial++) {
        int T = 1 + (int)(rnd() % 16), layer = 1 + (int)(rnd() % 8);
        random_batch(T, z, ids);
        memset(ya, 0x11, 2 * (size_t)T * k * d);
        memset(yb, 0x22, 2 * (size_t)T * k * d);
        CHECK(local.vt->submit(local.self, layer, T, k, z, ids, err, sizeof err) == 0);
        CHECK(local.vt->gather(local.self, ya, err, sizeof err) == 0);
        CHECK_MSG(remote.vt->submit(remote.self, layer, T, k, z, ids, err, sizeof err) == 0, "%s", err);
        CHECK_MSG(remote.vt->gather(remote.self, yb, err, sizeof err) == 0, "%s", err);
        CHECK_MSG(!memcmp(ya, yb, 2 * (size_t)T * k * d), "trial %d: T %d layer %d", trial, T, layer);
    }
    local.vt->close(local.self);
    free(z);
    free(ids);
    free(ya);
    free(yb);
}

static void t_matches_local(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    static const char *layouts[][MAXW] = {
        {"1-8:0-23"},                                           /* one worker */
        {"1-8:0-11", "1-8:12-23"},                              /* contiguous */
        {"1-8:0-5,1-8:12-17", "1-8:6-11,1-8:18-23"},            /* interleaved blocks */
        {"1-8:0-20", "1-8:21", "1-4:22-23", "5-8:22-23"},       /* uneven, split by layers too */
    };
    static const int nws[] = {1, 2, 2, 4};
    for (int li = 0; li < 4; li++) {
        srv w[MAXW];
        for (int i = 0; i < nws[li]; i++)
            srv_start(&w[i], layouts[li][i], 0);
        shoal_expert_client *c = NULL;
        char err[2048];
        int rc = open_client(&c, w, nws[li], fp, 10000, err, sizeof err);
        CHECK_MSG(rc == 0, "layout %d: %s", li, err);
        if (!rc) {
            compare(c, 25);
            shoal_expert_client_stats st;
            shoal_expert_client_get_stats(c, &st);
            CHECK(st.requests == 25 && st.failures == 0 && st.late_replies == 0 && st.bytes_out > 0);
            CHECK(st.messages >= 25 && st.messages <= 25u * (unsigned)nws[li]);
        }
        shoal_expert_client_close(c);
        for (int i = 0; i < nws[li]; i++) {
            srv_stop(&w[i]);
            CHECK_MSG(w[i].rc == 0, "%s", w[i].err);
        }
    }
}

static void t_refuses_gaps_not_overlaps(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[2];
    srv_start(&w[0], "1-8:0-11", 0);
    srv_start(&w[1], "1-8:10-20", 0);
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK(open_client(&c, w, 2, fp, 1000, err, sizeof err) == SHOAL_ECONFIG && c == NULL);
    CHECK_STR_CONTAINS(err, "layers 1-8 experts 21-23: owned by no worker");
    CHECK(strstr(err, "experts 10-11") == NULL); /* the overlap is a replica, not an error */
    srv_stop(&w[0]);
    srv_stop(&w[1]);
}

/* Replicated experts: the outputs equal the in-process backend's whichever
 * owner computes them, and the choice spreads the work: over many random
 * batches every worker gets requests, including a worker that owns only
 * replicas (w2 below holds nothing the others lack). */
static void t_replicas(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    static const char *layouts[][3] = {
        {"1-8:0-23", "1-8:0-23"},                       /* everything twice */
        {"1-8:0-15", "1-8:8-23", "1-4:4-19,7:0-23"},    /* partial overlaps; w2 only replicas */
    };
    static const int nws[] = {2, 3};
    for (int li = 0; li < 2; li++) {
        srv w[MAXW];
        for (int i = 0; i < nws[li]; i++)
            srv_start(&w[i], layouts[li][i], 0);
        shoal_expert_client *c = NULL;
        char err[2048];
        int rc = open_client(&c, w, nws[li], fp, 10000, err, sizeof err);
        CHECK_MSG(rc == 0, "layout %d: %s", li, err);
        if (!rc) {
            /* involvement per worker, request by request */
            shoal_experts local, remote = shoal_expert_client_backend(c);
            CHECK(shoal_experts_local_open(&local, store, &cfg, "language_model.model.layers.", 16, err, sizeof err) ==
                  0);
            int d = cfg.latent_size, k = cfg.experts_per_token, used[MAXW] = {0};
            float *z = malloc(sizeof(float) * 16 * (size_t)d);
            int32_t *ids = malloc(sizeof(int32_t) * 16 * (size_t)k);
            uint16_t *ya = malloc(2 * 16 * (size_t)k * (size_t)d), *yb = malloc(2 * 16 * (size_t)k * (size_t)d);
            for (int trial = 0; trial < 30; trial++) {
                int T = 1 + (int)(rnd() % 16), layer = 1 + (int)(rnd() % 8);
                random_batch(T, z, ids);
                CHECK(local.vt->submit(local.self, layer, T, k, z, ids, err, sizeof err) == 0);
                CHECK(local.vt->gather(local.self, ya, err, sizeof err) == 0);
                CHECK_MSG(remote.vt->submit(remote.self, layer, T, k, z, ids, err, sizeof err) == 0, "%s", err);
                CHECK_MSG(remote.vt->gather(remote.self, yb, err, sizeof err) == 0, "%s", err);
                CHECK_MSG(!memcmp(ya, yb, 2 * (size_t)T * k * d), "layout %d trial %d: T %d layer %d", li, trial, T,
                          layer);
                for (int i = 0; i < nws[li]; i++) {
                    uint64_t q, cu, rtt;
                    used[i] += shoal_expert_client_last(c, i, &q, &cu, &rtt);
                }
            }
            for (int i = 0; i < nws[li]; i++)
                CHECK_MSG(used[i] > 0, "layout %d: worker %d never picked", li, i);
            local.vt->close(local.self);
            free(z);
            free(ids);
            free(ya);
            free(yb);
        }
        shoal_expert_client_close(c);
        for (int i = 0; i < nws[li]; i++) {
            srv_stop(&w[i]);
            CHECK_MSG(w[i].rc == 0, "%s", w[i].err);
        }
    }
}

static void t_refuses_fingerprint(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[1];
    srv_start(&w[0], "1-8:0-23", 0);
    uint8_t other[SHOAL_PROTO_FP_BYTES];
    memcpy(other, fp, sizeof other);
    other[5] ^= 0x40;
    shoal_expert_client *c = NULL;
    char err[2048], a[65], b[65];
    CHECK(open_client(&c, w, 1, other, 1000, err, sizeof err) == SHOAL_EFINGERPRINT);
    shoal_proto_hex(other, a);
    shoal_proto_hex(fp, b);
    CHECK_STR_CONTAINS(err, a);
    CHECK_STR_CONTAINS(err, b);
    CHECK_STR_CONTAINS(err, w[0].ep);
    srv_stop(&w[0]);
}

static void t_no_hello_deadline(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[1];
    memset(w, 0, sizeof w);
    snprintf(w[0].ep, sizeof w[0].ep, "ipc://@shoal-test-nobody-%d", (int)getpid());
    const char *eps[1] = {w[0].ep};
    shoal_expert_client_opts o = {.endpoints = eps, .nworkers = 1, .cfg = &cfg, .fingerprint = fp, .max_tokens = 4,
                                  .hello_timeout_ms = 300};
    shoal_expert_client *c = NULL;
    char err[1024];
    double t0 = now_s();
    CHECK(shoal_expert_client_open(&c, &o, err, sizeof err) == SHOAL_ETIMEOUT && c == NULL);
    double dt = now_s() - t0;
    CHECK_MSG(dt >= 0.25 && dt < 2.0, "took %.3f s", dt);
    CHECK_STR_CONTAINS(err, w[0].ep);
    CHECK_STR_CONTAINS(err, "not connected");
}

static void t_silent_worker_deadline(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[2];
    srv_start(&w[0], "1-8:0-11", 0);
    srv_start(&w[1], "1-8:12-23", 1000000); /* 1 s per batch */
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK(open_client(&c, w, 2, fp, 200, err, sizeof err) == 0);
    if (c) {
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float z[4 * 64];
        int32_t ids[4 * 16];
        uint16_t *y = malloc(2 * 4 * (size_t)k * (size_t)d);
        CHECK(d <= 64 && k <= 16);
        random_batch(4, z, ids);
        ids[0] = 12; /* make sure w1 is involved: token 0 gets expert 12.. */
        for (int s = 1; s < k; s++)
            ids[s] = 12 + s;
        double t0 = now_s();
        CHECK(b.vt->submit(b.self, 2, 4, k, z, ids, err, sizeof err) == 0);
        int rc = b.vt->gather(b.self, y, err, sizeof err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == SHOAL_ETIMEOUT, "rc %d: %s", rc, err);
        CHECK_MSG(dt >= 0.19 && dt < 0.9, "failed after %.3f s (deadline 0.2 s, reply after 1 s)", dt);
        CHECK_STR_CONTAINS(err, w[1].ep);
        CHECK_STR_CONTAINS(err, "within 200 ms");
        /* w1 is down now: the next request that needs it fails at once, naming it */
        char why[512];
        CHECK(shoal_expert_client_worker_up(c, 1, why, sizeof why) == 0);
        CHECK_STR_CONTAINS(why, "no reply within 200 ms");
        t0 = now_s();
        CHECK(b.vt->submit(b.self, 2, 4, k, z, ids, err, sizeof err) == 0);
        rc = b.vt->gather(b.self, y, err, sizeof err);
        dt = now_s() - t0;
        CHECK_MSG(rc == SHOAL_EPEER && dt < 0.1, "rc %d after %.3f s: %s", rc, dt, err);
        CHECK_STR_CONTAINS(err, w[1].ep);
        CHECK_STR_CONTAINS(err, "is down");
        /* the keeper's HELLO is answered after the late batch (at 1 s): w1 is
         * back, the late reply was dropped, and a request with a longer
         * deadline succeeds */
        double t1 = now_s();
        while (!shoal_expert_client_worker_up(c, 1, NULL, 0) && now_s() - t1 < 5.0)
            usleep(10000);
        CHECK_MSG(shoal_expert_client_worker_up(c, 1, why, sizeof why), "still down after 5 s: %s", why);
        shoal_expert_client_set_timeout(c, 5000);
        compare(c, 1);
        shoal_expert_client_stats st;
        shoal_expert_client_get_stats(c, &st);
        CHECK_MSG(st.late_replies == 1 && st.failures == 2 && st.downs == 1 && st.recoveries == 1,
                  "late %llu failures %llu downs %llu recoveries %llu", (unsigned long long)st.late_replies,
                  (unsigned long long)st.failures, (unsigned long long)st.downs, (unsigned long long)st.recoveries);
        free(y);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
    srv_stop(&w[1]);
}

/* Failover: w1, silent (1 s per batch), owns everything, as does w0; w2
 * owns experts 12-23. A request that involves w1 is not failed: after
 * failover_ms (150) w1 is given up (marked down) and its pairs are resent to
 * w0 or w2 within the same 3 s deadline; the outputs equal the in-process
 * backend's bit for bit; the next requests avoid w1 (down) and are quick.
 * Then w2 is stopped (a disconnect): its pairs go to w0 at once. */
static void t_failover(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[3];
    srv_start(&w[0], "1-8:0-23", 0);
    srv_start(&w[1], "1-8:0-23", 1000000);
    srv_start(&w[2], "1-8:12-23", 0);
    const char *eps[3] = {w[0].ep, w[1].ep, w[2].ep};
    shoal_expert_client_opts o = {.endpoints = eps, .nworkers = 3, .cfg = &cfg, .fingerprint = fp,
                                  .max_tokens = 16, .timeout_ms = 3000, .failover_ms = 150,
                                  .hello_timeout_ms = 5000};
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK_MSG(shoal_expert_client_open(&c, &o, err, sizeof err) == 0, "%s", err);
    if (c) {
        shoal_experts local, b = shoal_expert_client_backend(c);
        CHECK(shoal_experts_local_open(&local, store, &cfg, "language_model.model.layers.", 16, err, sizeof err) == 0);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float *z = malloc(sizeof(float) * 16 * (size_t)d);
        int32_t *ids = malloc(sizeof(int32_t) * 16 * (size_t)k);
        uint16_t *ya = malloc(2 * 16 * (size_t)k * (size_t)d), *yb = malloc(2 * 16 * (size_t)k * (size_t)d);
        int T = 8;
        random_batch(T, z, ids); /* 8 tokens x k experts over 3 owners: every worker gets pairs */
        CHECK(local.vt->submit(local.self, 3, T, k, z, ids, err, sizeof err) == 0);
        CHECK(local.vt->gather(local.self, ya, err, sizeof err) == 0);
        double t0 = now_s();
        CHECK_MSG(b.vt->submit(b.self, 3, T, k, z, ids, err, sizeof err) == 0, "%s", err);
        int rc = b.vt->gather(b.self, yb, err, sizeof err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == 0, "rc %d: %s", rc, err);
        CHECK_MSG(dt >= 0.14 && dt < 0.9, "finished after %.3f s (failover 0.15 s, the silent reply at 1 s)", dt);
        CHECK(!memcmp(ya, yb, 2 * (size_t)T * k * d));
        shoal_expert_client_stats st;
        shoal_expert_client_get_stats(c, &st);
        CHECK_MSG(st.failovers == 1 && st.resent_pairs > 0 && st.failures == 0 && st.downs == 1,
                  "failovers %llu resent %llu failures %llu downs %llu", (unsigned long long)st.failovers,
                  (unsigned long long)st.resent_pairs, (unsigned long long)st.failures, (unsigned long long)st.downs);
        char why[512];
        CHECK(shoal_expert_client_worker_up(c, 1, why, sizeof why) == 0);
        CHECK_STR_CONTAINS(why, "failover");
        /* w1 down: picks avoid it, no waiting */
        for (int trial = 0; trial < 3; trial++) {
            random_batch(T, z, ids);
            CHECK(local.vt->submit(local.self, 5, T, k, z, ids, err, sizeof err) == 0);
            CHECK(local.vt->gather(local.self, ya, err, sizeof err) == 0);
            t0 = now_s();
            CHECK(b.vt->submit(b.self, 5, T, k, z, ids, err, sizeof err) == 0);
            rc = b.vt->gather(b.self, yb, err, sizeof err);
            dt = now_s() - t0;
            CHECK_MSG(rc == 0 && dt < 0.14, "rc %d after %.3f s: %s", rc, dt, err);
            CHECK(!memcmp(ya, yb, 2 * (size_t)T * k * d));
        }
        /* w2 goes away: a disconnect; its pairs go to w0 (w1 may be back
         * by now: the keeper re-probes it, and it is slow, so it may be
         * given up again) */
        srv_stop(&w[2]);
        random_batch(T, z, ids);
        CHECK(local.vt->submit(local.self, 7, T, k, z, ids, err, sizeof err) == 0);
        CHECK(local.vt->gather(local.self, ya, err, sizeof err) == 0);
        CHECK(b.vt->submit(b.self, 7, T, k, z, ids, err, sizeof err) == 0);
        rc = b.vt->gather(b.self, yb, err, sizeof err);
        CHECK_MSG(rc == 0, "rc %d: %s", rc, err);
        CHECK(!memcmp(ya, yb, 2 * (size_t)T * k * d));
        local.vt->close(local.self);
        free(z);
        free(ids);
        free(ya);
        free(yb);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
    srv_stop(&w[1]);
}

static void t_stopped_worker_fails_fast(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[2];
    srv_start(&w[0], "1-8:0-11", 0);
    srv_start(&w[1], "1-8:12-23", 0);
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK(open_client(&c, w, 2, fp, 10000, err, sizeof err) == 0);
    if (c) {
        compare(c, 2);
        srv_stop(&w[1]);
        usleep(200000); /* the disconnect is seen */
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float z[64];
        int32_t ids[16];
        uint16_t *y = malloc(2 * (size_t)k * (size_t)d);
        random_batch(1, z, ids);
        ids[k - 1] = 23;
        for (int s = 0; s < k - 1; s++)
            ids[s] = s;
        double t0 = now_s();
        CHECK(b.vt->submit(b.self, 3, 1, k, z, ids, err, sizeof err) == 0);
        int rc = b.vt->gather(b.self, y, err, sizeof err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == SHOAL_EPEER && dt < 1.0, "rc %d after %.3f s: %s", rc, dt, err);
        CHECK_STR_CONTAINS(err, w[1].ep);
        free(y);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
}

static int wait_link(shoal_expert_client *c, int i, int up, double s)
{
    double t0 = now_s();
    while (shoal_expert_client_worker_up(c, i, NULL, 0) != up && now_s() - t0 < s)
        usleep(10000);
    return shoal_expert_client_worker_up(c, i, NULL, 0) == up;
}

/* A worker that goes away is marked down (seen by the keeper, without a
 * request), requests needing it fail at once; restarted on its endpoint with
 * other ranges it is refused; restarted as before it is re-verified, marked up
 * and serves the same outputs as in-process. */
static void t_worker_comes_back(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[2];
    srv_start(&w[0], "1-8:0-11", 0);
    srv_start(&w[1], "1-8:12-23", 0);
    shoal_expert_client *c = NULL;
    char err[2048], why[512];
    CHECK(open_client(&c, w, 2, fp, 5000, err, sizeof err) == 0);
    if (c) {
        compare(c, 2);
        srv_stop(&w[1]);
        CHECK_MSG(wait_link(c, 1, 0, 3.0), "worker 1 not marked down 3 s after it stopped");
        shoal_expert_client_worker_up(c, 1, why, sizeof why);
        CHECK_STR_CONTAINS(why, "disconnected");
        CHECK(shoal_expert_client_worker_up(c, 0, NULL, 0) == 1);
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float z[64];
        int32_t ids[16];
        uint16_t *y = malloc(2 * (size_t)k * (size_t)d);
        random_batch(1, z, ids);
        for (int s = 0; s < k; s++)
            ids[s] = 8 + s; /* 8..23: both workers */
        CHECK(k <= 16);
        double t0 = now_s();
        CHECK(b.vt->submit(b.self, 3, 1, k, z, ids, err, sizeof err) == 0);
        int rc = b.vt->gather(b.self, y, err, sizeof err);
        CHECK_MSG(rc == SHOAL_EPEER && now_s() - t0 < 0.1, "rc %d after %.3f s: %s", rc, now_s() - t0, err);
        CHECK_STR_CONTAINS(err, w[1].ep);
        /* back with other experts: refused, stays down */
        srv_restart(&w[1], "1-4:12-23");
        usleep(800000);
        CHECK(shoal_expert_client_worker_up(c, 1, why, sizeof why) == 0);
        CHECK_STR_CONTAINS(why, "refused on reconnection");
        srv_stop(&w[1]);
        /* back as before: up again, same outputs */
        srv_restart(&w[1], "1-8:12-23");
        CHECK_MSG(wait_link(c, 1, 1, 10.0), "worker 1 not back 10 s after its restart");
        compare(c, 2);
        shoal_expert_client_stats st;
        shoal_expert_client_get_stats(c, &st);
        CHECK_MSG(st.downs == 1 && st.recoveries == 1, "downs %llu recoveries %llu", (unsigned long long)st.downs,
                  (unsigned long long)st.recoveries);
        free(y);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
    srv_stop(&w[1]);
}

/* A reply that arrives while the caller still computes (between submit and
 * gather) counts its round trip to its arrival, not to gather(): the
 * network/queue/compute split must not absorb the shared experts' time. The
 * client times arrivals that way once it has seen a reply come early, so the
 * first of the three exchanges may count to gather(). */
static void t_rtt_excludes_caller_time(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[1];
    srv_start(&w[0], "1-8:0-23", 0);
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK(open_client(&c, w, 1, fp, 5000, err, sizeof err) == 0);
    if (c) {
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float z[64];
        int32_t ids[16];
        uint16_t *y = malloc(2 * (size_t)k * (size_t)d);
        int fast = 0;
        for (int r = 0; r < 3; r++) {
            random_batch(1, z, ids);
            CHECK(b.vt->submit(b.self, 2, 1, k, z, ids, err, sizeof err) == 0);
            usleep(300000); /* "the shared experts" */
            CHECK(b.vt->gather(b.self, y, err, sizeof err) == 0);
            uint64_t q, cu, rtt;
            CHECK(shoal_expert_client_last(c, 0, &q, &cu, &rtt));
            fast += rtt < 150000000u; /* the worker answers in well under 150 ms */
        }
        CHECK_MSG(fast >= 2, "%d of 3 round trips under 150 ms with 300 ms between submit and gather", fast);
        free(y);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
}

/* A fake worker: answers HELLO and PING like a real one, and every
 * EXPERT_BATCH with an unsolicited HELLO reply, then ERROR INTERNAL. */
typedef struct {
    char ep[128];
    volatile int stop;
    pthread_t th;
} fake;

static void *fake_main(void *arg)
{
    fake *fk = arg;
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0, ms = 50;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
    zmq_bind(s, fk->ep);
    shoal_proto_range *own = NULL;
    size_t nown = 0;
    char err[256];
    shoal_shard_parse("1-8:0-23", &own, &nown, err, sizeof err);
    shoal_proto_hello h = {.major = SHOAL_PROTO_MAJOR, .minor = SHOAL_PROTO_MINOR, .owned = own, .nowned = nown,
                           .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32) | SHOAL_WIRE_MASK(SHOAL_WIRE_BF16),
                           .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16), .max_tokens = 64, .threads = 1};
    memcpy(h.fingerprint, fp, SHOAL_PROTO_FP_BYTES);
    snprintf(h.id, sizeof h.id, "fake");
    snprintf(h.isa, sizeof h.isa, "scalar");
    while (!fk->stop) {
        zmq_msg_t part[4];
        int np = 0, more = 1;
        while (more && np < 4) {
            zmq_msg_init(&part[np]);
            if (zmq_msg_recv(&part[np], s, 0) < 0) {
                zmq_msg_close(&part[np]);
                break;
            }
            more = zmq_msg_more(&part[np]);
            np++;
        }
        if (np >= 2) {
            shoal_frame f[3];
            for (int j = 1; j < np; j++)
                f[j - 1] = (shoal_frame){zmq_msg_data(&part[j]), zmq_msg_size(&part[j])};
            shoal_proto_msg m;
            memset(&m, 0, sizeof m);
            int perr;
            if (!shoal_proto_decode(f, np - 1, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err)) {
                uint8_t buf[4096];
                size_t len = 0;
                zmq_send(s, zmq_msg_data(&part[0]), zmq_msg_size(&part[0]), ZMQ_SNDMORE);
                if (m.type == SHOAL_MSG_HELLO) {
                    shoal_proto_enc_hello(buf, sizeof buf, &len, m.rid, &h, 1);
                } else if (m.type == SHOAL_MSG_PING) {
                    shoal_proto_enc_empty(buf, sizeof buf, &len, SHOAL_MSG_PONG, m.rid);
                } else {
                    shoal_proto_enc_hello(buf, sizeof buf, &len, m.rid, &h, 1);
                    zmq_send(s, buf, len, 0);
                    zmq_send(s, zmq_msg_data(&part[0]), zmq_msg_size(&part[0]), ZMQ_SNDMORE);
                    shoal_proto_enc_error(buf, sizeof buf, &len, m.rid, SHOAL_PERR_INTERNAL, "fake worker");
                }
                zmq_send(s, buf, len, 0);
            }
            shoal_proto_msg_clear(&m);
        }
        for (int j = 0; j < np; j++)
            zmq_msg_close(&part[j]);
    }
    free(own);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return NULL;
}

/* An unsolicited HELLO reply during a request is dropped without being
 * decoded on the caller's thread (decoding one allocates its ranges): no
 * allocation, and the request ends with the worker's ERROR naming it. */
static void t_unsolicited_hello_no_alloc(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    fake fk = {.stop = 0};
    snprintf(fk.ep, sizeof fk.ep, "ipc://@shoal-test-fake-%d", (int)getpid());
    CHECK(pthread_create(&fk.th, NULL, fake_main, &fk) == 0);
    const char *eps[1] = {fk.ep};
    shoal_expert_client_opts o = {.endpoints = eps, .nworkers = 1, .cfg = &cfg, .fingerprint = fp, .max_tokens = 16,
                                  .timeout_ms = 5000, .hello_timeout_ms = 5000};
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK_MSG(shoal_expert_client_open(&c, &o, err, sizeof err) == 0, "%s", err);
    if (c) {
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float z[64];
        int32_t ids[16];
        uint16_t *y = malloc(2 * (size_t)k * (size_t)d);
        random_batch(1, z, ids);
        uint64_t before = shoal_engine_alloc_count();
        shoal__engine_guard_arm(1);
        int rs = b.vt->submit(b.self, 2, 1, k, z, ids, err, sizeof err);
        int rg = rs ? rs : b.vt->gather(b.self, y, err, sizeof err);
        shoal__engine_guard_arm(0);
        CHECK_EQ_INT(shoal_engine_alloc_count() - before, 0);
        CHECK_MSG(rs == 0 && rg == SHOAL_EINTERNAL, "submit %d gather %d: %s", rs, rg, err);
        CHECK_STR_CONTAINS(err, "fake worker");
        free(y);
    }
    shoal_expert_client_close(c);
    fk.stop = 1;
    pthread_join(fk.th, NULL);
}

static void t_no_alloc_on_caller(void)
{
    if (!have_model)
        SKIP("tests/models/tiny-k3 not present");
    srv w[2];
    srv_start(&w[0], "1-8:0-11", 0);
    srv_start(&w[1], "1-8:12-23", 0);
    shoal_expert_client *c = NULL;
    char err[2048];
    CHECK(open_client(&c, w, 2, fp, 10000, err, sizeof err) == 0);
    if (c) {
        shoal_experts b = shoal_expert_client_backend(c);
        int d = cfg.latent_size, k = cfg.experts_per_token;
        float *z = malloc(sizeof(float) * 16 * (size_t)d);
        int32_t *ids = malloc(sizeof(int32_t) * 16 * (size_t)k);
        uint16_t *y = malloc(2 * 16 * (size_t)k * (size_t)d);
        random_batch(16, z, ids);
        uint64_t before = shoal_engine_alloc_count();
        shoal__engine_guard_arm(1); /* counts (and in debug builds aborts on) any malloc on this thread */
        /* enough exchanges for zmq's pipes to wrap their chunks several
         * times, prefill-sized and decode-sized */
        int bad = 0;
        for (int r = 0; r < 600; r++) {
            int T = r % 3 ? 1 : 16;
            bad += b.vt->submit(b.self, 1 + r % 8, T, k, z, ids, err, sizeof err) != 0;
            bad += b.vt->gather(b.self, y, err, sizeof err) != 0;
        }
        shoal__engine_guard_arm(0);
        CHECK_EQ_INT(shoal_engine_alloc_count() - before, 0);
        CHECK_MSG(bad == 0, "%d failures: %s", bad, err);
        free(z);
        free(ids);
        free(y);
    }
    shoal_expert_client_close(c);
    srv_stop(&w[0]);
    srv_stop(&w[1]);
}

int main(void)
{
    test_binary = "test_expert_client";
    shoal_log_set_level(SHOAL_LOG_ERROR);
    shoal_kernels_init();
    snprintf(model, sizeof model, "%s", test_src_path("tests/models/tiny-k3"));
    char path[4200], err[1024];
    snprintf(path, sizeof path, "%s/config.json", model);
    shoal_st_opts so = {.map = 1};
    have_model = access(path, R_OK) == 0 && shoal_k3cfg_load(&cfg, path, err, sizeof err) == 0 &&
                 shoal_st_open(&store, model, &so, err, sizeof err) == 0 &&
                 shoal_fprint_model(fp, &cfg, store, err, sizeof err) == 0;
    RUN(t_matches_local);
    RUN(t_refuses_gaps_not_overlaps);
    RUN(t_replicas);
    RUN(t_refuses_fingerprint);
    RUN(t_no_hello_deadline);
    RUN(t_silent_worker_deadline);
    RUN(t_failover);
    RUN(t_stopped_worker_fails_fast);
    RUN(t_worker_comes_back);
    RUN(t_rtt_excludes_caller_time);
    RUN(t_unsolicited_hello_no_alloc);
    RUN(t_no_alloc_on_caller);
    shoal_st_close(store);
    return test_finish();
}
