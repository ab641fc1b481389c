/* worker: the request handler (worker/serve.h) on in-memory banks -- every
 * expert output equals shoal_expert_ffn on that token alone, bit for bit, for
 * any batch composition, both output dtypes and bf16 activations; HELLO rules
 * (first on every connection, version and fingerprint refusals naming both
 * sides); ERROR for anything malformed or not owned, and the handler keeps
 * serving; the counters. Then the real server (worker/expert_server.h) on the
 * tiny model over a real socket: HELLO, a batch, garbage, the stop flag. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/log.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "proto/fprint.h"
#include "proto/proto.h"
#include "proto/shard.h"
#include "tests/unit/test.h"
#include "worker/bank.h"
#include "worker/expert_server.h"
#include "worker/serve.h"

enum { L = 4, E = 12, D = 64, F = 32, K = 4, MAXT = 8 };
static const uint8_t is_moe[L] = {0, 1, 1, 1};
static uint8_t fp[SHOAL_PROTO_FP_BYTES];

static uint32_t rng = 2463534242u;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}
static float frand(void)
{
    return (float)((int)(rnd() % 20001) - 10000) / 2500.0f;
}

/* Per (layer, expert): its own bf16 / f32 / MXFP4 weights; kind cycles. */
typedef struct {
    uint16_t w16[3][F * D];
    float w32[3][F * D];
    uint8_t packed[3][F * D / 2], scale[3][F * D / 32];
} ew;
static ew *weights;
static shoal_expert_w views[L * E];

static void make_weights(void)
{
    weights = calloc(L * E, sizeof *weights);
    for (int l = 1; l < L; l++)
        for (int e = 0; e < E; e++) {
            ew *w = &weights[l * E + e];
            int kind = (l + e) % 3;
            for (int m = 0; m < 3; m++) {
                for (int i = 0; i < F * D; i++) {
                    float v = frand() * 0.05f;
                    w->w32[m][i] = v;
                    w->w16[m][i] = shoal_f32_to_bf16(v);
                }
                for (int i = 0; i < F * D / 2; i++)
                    w->packed[m][i] = (uint8_t)rnd();
                for (int i = 0; i < F * D / 32; i++)
                    w->scale[m][i] = (uint8_t)(120 + rnd() % 8);
            }
            shoal_expert_w *v = &views[l * E + e];
            v->d = D;
            v->f = F;
            if (kind == 0) {
                v->kind = SHOAL_EXPERT_BF16;
                v->w1 = w->w16[0], v->w3 = w->w16[1], v->w2 = w->w16[2];
            } else if (kind == 1) {
                v->kind = SHOAL_EXPERT_F32;
                v->w1 = w->w32[0], v->w3 = w->w32[1], v->w2 = w->w32[2];
            } else {
                v->kind = SHOAL_EXPERT_MXFP4;
                v->w1 = w->packed[0], v->w3 = w->packed[1], v->w2 = w->packed[2];
                v->w1_scale = w->scale[0], v->w3_scale = w->scale[1], v->w2_scale = w->scale[2];
            }
        }
}

typedef struct {
    shoal_proto_range r[8];
    size_t nr;
    shoal_shard *own;
    shoal_bank *bank;
    shoal_serve *srv;
} fixture;

static int fx_open(fixture *fx, const char *ranges)
{
    char err[256];
    shoal_proto_range *r;
    if (shoal_shard_parse(ranges, &r, &fx->nr, err, sizeof err))
        return -1;
    memcpy(fx->r, r, fx->nr * sizeof *r);
    free(r);
    if (shoal_shard_open(&fx->own, fx->r, fx->nr, L, is_moe, E, err, sizeof err) ||
        shoal_bank_from_views(&fx->bank, L, E, fx->own, views, 4.0f, 25.0f, err, sizeof err))
        return -1;
    shoal_serve_opts so = {.id = "w-test", .fingerprint = fp, .owned = fx->r, .nowned = fx->nr, .own = fx->own,
                           .num_layers = L, .is_moe = is_moe, .num_experts = E, .k = K, .max_tokens = MAXT,
                           .isa = "scalar", .threads = 1};
    return shoal_serve_open(&fx->srv, &so, fx->bank, err, sizeof err);
}

static void fx_close(fixture *fx)
{
    shoal_serve_close(fx->srv);
    shoal_bank_close(fx->bank);
    shoal_shard_close(fx->own);
}

static void *alloc_out(void *ctx, size_t len, char *why, size_t whylen)
{
    (void)ctx;
    (void)why;
    (void)whylen;
    return malloc(len);
}

/* Send frames from peer; decode the reply into m (caller clears). Returns the reply type. */
static int call(fixture *fx, const char *peer, const shoal_frame *f, int n, shoal_proto_msg *m, shoal_serve_reply *rep)
{
    shoal_serve_handle(fx->srv, (const uint8_t *)peer, strlen(peer), f, n, 7, alloc_out, NULL, rep);
    memset(m, 0, sizeof *m);
    int perr;
    char err[256];
    if (shoal_proto_decode(rep->frames, rep->n, SHOAL_SIDE_COORDINATOR, m, &perr, err, sizeof err))
        return -1;
    return m->type;
}

static void free_rep(shoal_serve_reply *rep)
{
    if (rep->n == 2)
        free((void *)rep->frames[1].data);
}

static int hello(fixture *fx, const char *peer, uint32_t major, const uint8_t *fpr, shoal_proto_msg *m)
{
    uint8_t buf[256];
    size_t len;
    shoal_proto_hello h = {.major = major, .minor = 3, .id = "tester"};
    memcpy(h.fingerprint, fpr, SHOAL_PROTO_FP_BYTES);
    shoal_proto_enc_hello(buf, sizeof buf, &len, 11, &h, 0);
    shoal_frame f = {buf, len};
    shoal_serve_reply rep;
    int t = call(fx, peer, &f, 1, m, &rep);
    free_rep(&rep);
    return t;
}

/* An EXPERT_BATCH of T tokens: act rows x[T, D] (f32 or bf16 on the wire), pairs. */
typedef struct {
    uint8_t ctl[64], act[16 + MAXT * D * 4], route[16 + MAXT * K * 8];
    shoal_frame f[3];
} batch;

static void mk_batch(batch *b, uint64_t rid, int layer, int act_dt, int out_dt, const float *x, int T,
                     const int32_t *pairs, int n)
{
    size_t len;
    shoal_proto_enc_batch(b->ctl, sizeof b->ctl, &len, rid, (uint32_t)layer, out_dt);
    b->f[0] = (shoal_frame){b->ctl, len};
    shoal_proto_tensor_hdr(b->act, act_dt, (uint32_t)T, D);
    for (int i = 0; i < T * D; i++) {
        if (act_dt == SHOAL_WIRE_F32)
            memcpy(b->act + 16 + 4 * i, &x[i], 4);
        else {
            uint16_t h = shoal_f32_to_bf16(x[i]);
            memcpy(b->act + 16 + 2 * i, &h, 2);
        }
    }
    shoal_proto_tensor_len(act_dt, (uint32_t)T, D, &len);
    b->f[1] = (shoal_frame){b->act, len};
    shoal_proto_tensor_hdr(b->route, SHOAL_WIRE_I32, (uint32_t)n, 2);
    memcpy(b->route + 16, pairs, (size_t)n * 8);
    b->f[2] = (shoal_frame){b->route, 16 + (size_t)n * 8};
}

static void t_batch_matches_ffn(void)
{
    fixture fx;
    CHECK(fx_open(&fx, "1-3:0-11") == 0);
    shoal_proto_msg m;
    CHECK(hello(&fx, "p", 1, fp, &m) == SHOAL_MSG_HELLO);
    shoal_proto_msg_clear(&m);
    float scratch[2 * F], x[MAXT * D], xr[D];
    uint16_t want[D];
    static batch b;
    for (int trial = 0; trial < 60; trial++) {
        int T = 1 + (int)(rnd() % MAXT), layer = 1 + (int)(rnd() % 3);
        int act_dt = trial % 3 == 2 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32;
        int out_dt = trial % 2 ? SHOAL_WIRE_F32 : SHOAL_WIRE_BF16;
        for (int i = 0; i < T * D; i++)
            x[i] = frand();
        /* each token: 1..K distinct ascending experts; tokens share experts often */
        int32_t pairs[MAXT * K * 2];
        int n = 0;
        for (int t = 0; t < T; t++) {
            int cnt = 1 + (int)(rnd() % K), e = (int)(rnd() % 4);
            for (int s = 0; s < cnt && e < E; s++, e += 1 + (int)(rnd() % 3)) {
                pairs[2 * n] = t;
                pairs[2 * n + 1] = e;
                n++;
            }
        }
        mk_batch(&b, 100 + (uint64_t)trial, layer, act_dt, out_dt, x, T, pairs, n);
        shoal_serve_reply rep;
        int type = call(&fx, "p", b.f, 3, &m, &rep);
        CHECK_MSG(type == SHOAL_MSG_EXPERT_RESULT, "trial %d: %s %s", trial, shoal_msg_type_name(type),
                  m.error.message);
        if (type == SHOAL_MSG_EXPERT_RESULT) {
            CHECK(m.rid == 100 + (uint64_t)trial && m.result.y.rows == (uint32_t)n && m.result.y.cols == D &&
                  m.result.y.dtype == out_dt && m.result.queue_us == 7);
            for (int i = 0; i < n; i++) {
                int t = pairs[2 * i], e = pairs[2 * i + 1];
                for (int c = 0; c < D; c++) /* what the worker saw on the wire */
                    xr[c] = act_dt == SHOAL_WIRE_F32 ? x[t * D + c] : shoal_round_bf16(x[t * D + c]);
                shoal_expert_ffn(want, &views[layer * E + e], xr, 1, 4.0f, 25.0f, scratch);
                int same = 1;
                for (int c = 0; c < D; c++) {
                    uint16_t got;
                    if (out_dt == SHOAL_WIRE_BF16) {
                        memcpy(&got, m.result.y.data + ((size_t)i * D + c) * 2, 2);
                    } else {
                        float v;
                        memcpy(&v, m.result.y.data + ((size_t)i * D + c) * 4, 4);
                        got = shoal_f32_to_bf16(v);
                        same &= shoal_bf16_to_f32(got) == v; /* f32 output is the bf16 value widened */
                    }
                    same &= got == want[c];
                }
                CHECK_MSG(same, "trial %d pair %d (token %d, expert %d)", trial, i, t, e);
            }
        }
        shoal_proto_msg_clear(&m);
        free_rep(&rep);
    }
    shoal_proto_stats st;
    shoal_serve_stats(fx.srv, &st);
    CHECK(st.batches == 60 && st.errors == 0 && st.requests == 61 && st.pairs > 60 && st.bytes_in > 0 &&
          !strcmp(st.worker, "w-test"));
    fx_close(&fx);
}

static void t_hello_rules(void)
{
    fixture fx;
    CHECK(fx_open(&fx, "1-3:0-11") == 0);
    shoal_proto_msg m;
    uint8_t ping[8];
    size_t len;
    shoal_proto_enc_empty(ping, sizeof ping, &len, SHOAL_MSG_PING, 5);
    shoal_frame pf = {ping, len};
    shoal_serve_reply rep;
    /* before HELLO */
    CHECK(call(&fx, "a", &pf, 1, &m, &rep) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_NO_HELLO && m.rid == 5);
    shoal_proto_msg_clear(&m);
    /* wrong major: named both ways */
    CHECK(hello(&fx, "a", 2, fp, &m) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_VERSION && m.rid == 11);
    CHECK_STR_CONTAINS(m.error.message, "coordinator 2.3, worker 1.8"); /* PROTOCOL.md version 1.7 */
    shoal_proto_msg_clear(&m);
    /* wrong fingerprint: both hex values */
    uint8_t other[SHOAL_PROTO_FP_BYTES];
    memset(other, 0xab, sizeof other);
    CHECK(hello(&fx, "a", 1, other, &m) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_FINGERPRINT);
    CHECK_STR_CONTAINS(m.error.message, "coordinator abababab");
    char hx[65];
    shoal_proto_hex(fp, hx);
    CHECK_STR_CONTAINS(m.error.message, hx);
    shoal_proto_msg_clear(&m);
    CHECK(call(&fx, "a", &pf, 1, &m, &rep) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_NO_HELLO);
    shoal_proto_msg_clear(&m);
    /* a higher minor is fine; the reply carries the worker's view */
    CHECK(hello(&fx, "a", 1, fp, &m) == SHOAL_MSG_HELLO);
    CHECK(m.hello.nowned == 1 && m.hello.owned[0].l_lo == 1 && m.hello.owned[0].e_hi == 11 &&
          m.hello.max_tokens == MAXT && !strcmp(m.hello.id, "w-test"));
    shoal_proto_msg_clear(&m);
    CHECK(call(&fx, "a", &pf, 1, &m, &rep) == SHOAL_MSG_PONG && m.rid == 5);
    shoal_proto_msg_clear(&m);
    /* another connection still needs its own HELLO */
    CHECK(call(&fx, "b", &pf, 1, &m, &rep) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_NO_HELLO);
    shoal_proto_msg_clear(&m);
    /* STATS and SHUTDOWN after HELLO */
    uint8_t sb[8];
    shoal_proto_enc_empty(sb, sizeof sb, &len, SHOAL_MSG_STATS, 6);
    shoal_frame sf = {sb, len};
    CHECK(call(&fx, "a", &sf, 1, &m, &rep) == SHOAL_MSG_STATS_REPLY && m.stats.errors == 5 && m.stats.requests == 8);
    shoal_proto_msg_clear(&m);
    shoal_proto_enc_empty(sb, sizeof sb, &len, SHOAL_MSG_SHUTDOWN, 9);
    CHECK(call(&fx, "a", &sf, 1, &m, &rep) == SHOAL_MSG_SHUTDOWN_ACK && rep.shutdown == 1);
    shoal_proto_msg_clear(&m);
    fx_close(&fx);
}

static void t_errors_keep_serving(void)
{
    fixture fx;
    CHECK(fx_open(&fx, "1:0-5,2-3:6-11") == 0); /* does not own layer 1 experts 6-11 nor layers 2-3 experts 0-5 */
    shoal_proto_msg m;
    CHECK(hello(&fx, "p", 1, fp, &m) == SHOAL_MSG_HELLO);
    shoal_proto_msg_clear(&m);
    float x[2 * D];
    for (int i = 0; i < 2 * D; i++)
        x[i] = frand();
    static batch b;
    shoal_serve_reply rep;
    int32_t notown[] = {0, 2, 0, 7};
    mk_batch(&b, 21, 1, SHOAL_WIRE_F32, SHOAL_WIRE_BF16, x, 1, notown, 2);
    CHECK(call(&fx, "p", b.f, 3, &m, &rep) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_NOT_OWNED && m.rid == 21);
    CHECK_STR_CONTAINS(m.error.message, "layer 1 expert 7");
    shoal_proto_msg_clear(&m);
    int32_t dense[] = {0, 0};
    mk_batch(&b, 22, 0, SHOAL_WIRE_F32, SHOAL_WIRE_BF16, x, 1, dense, 1);
    CHECK(call(&fx, "p", b.f, 3, &m, &rep) == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_BAD_SHAPE);
    shoal_proto_msg_clear(&m);
    /* garbage of many shapes: one ERROR each */
    uint8_t junk[300];
    for (int i = 0; i < 200; i++) {
        size_t n = rnd() % sizeof junk;
        for (size_t j = 0; j < n; j++)
            junk[j] = (uint8_t)rnd();
        if (n && i % 2)
            junk[0] = 0x93; /* an array of 3, to get further into the decoder */
        shoal_frame f[3] = {{junk, n}, {junk, n / 2}, {junk, n / 3}};
        int type = call(&fx, "p", f, 1 + (int)(rnd() % 3), &m, &rep);
        CHECK_MSG(type == SHOAL_MSG_ERROR, "garbage %d gave %s", i, shoal_msg_type_name(type));
        shoal_proto_msg_clear(&m);
        free_rep(&rep);
    }
    /* and the worker still computes */
    int32_t ok[] = {0, 1, 1, 6};
    mk_batch(&b, 23, 2, SHOAL_WIRE_F32, SHOAL_WIRE_BF16, x, 2, ok, 2);
    CHECK(call(&fx, "p", b.f, 3, &m, &rep) == SHOAL_MSG_ERROR); /* (0,1) not owned in layer 2 */
    shoal_proto_msg_clear(&m);
    int32_t ok2[] = {0, 1, 1, 3};
    mk_batch(&b, 24, 1, SHOAL_WIRE_F32, SHOAL_WIRE_BF16, x, 2, ok2, 2);
    CHECK(call(&fx, "p", b.f, 3, &m, &rep) == SHOAL_MSG_EXPERT_RESULT && m.rid == 24);
    shoal_proto_msg_clear(&m);
    free_rep(&rep);
    fx_close(&fx);
}

/* ---- the real server on the tiny model ------------------------------------ */

typedef struct {
    shoal_expert_server_opts o;
    volatile sig_atomic_t stop;
    int rc;
    char err[1024];
} srv_thread;

/* PREFETCH is a notice: no reply, ever -- not before HELLO, not when
 * malformed, not for a dense layer (those are dropped and counted); a bank
 * (no cache) receives it and does nothing; batches after it are unchanged. */
static void t_prefetch_notice(void)
{
    fixture fx;
    CHECK(fx_open(&fx, "1-3:0-11") == 0);
    shoal_proto_msg m;
    shoal_serve_reply rep;
    uint8_t buf[128];
    size_t len;
    uint32_t ids[3] = {1, 4, 9};
    CHECK(shoal_proto_enc_prefetch(buf, sizeof buf, &len, 0, 2, ids, 3) == 0);
    shoal_frame f = {buf, len};
    shoal_serve_handle(fx.srv, (const uint8_t *)"p", 1, &f, 1, 0, alloc_out, NULL, &rep);
    CHECK_EQ_INT(rep.n, 0); /* before HELLO: dropped, unanswered */
    CHECK(hello(&fx, "p", SHOAL_PROTO_MAJOR, fp, &m) == SHOAL_MSG_HELLO);
    shoal_proto_msg_clear(&m);
    shoal_serve_handle(fx.srv, (const uint8_t *)"p", 1, &f, 1, 0, alloc_out, NULL, &rep);
    CHECK_EQ_INT(rep.n, 0);
    CHECK(shoal_proto_enc_prefetch(buf, sizeof buf, &len, 0, 0, ids, 3) == 0); /* layer 0 is dense */
    f.len = len;
    shoal_serve_handle(fx.srv, (const uint8_t *)"p", 1, &f, 1, 0, alloc_out, NULL, &rep);
    CHECK_EQ_INT(rep.n, 0);
    static const uint8_t bad[] = {0x93, 0x0b, 0x00, 0x81, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01}; /* no experts */
    shoal_frame fb = {bad, sizeof bad};
    shoal_serve_handle(fx.srv, (const uint8_t *)"p", 1, &fb, 1, 0, alloc_out, NULL, &rep);
    CHECK_EQ_INT(rep.n, 0);
    uint64_t notices, dropped;
    shoal_serve_prefetch_counts(fx.srv, &notices, &dropped);
    CHECK(notices == 4 && dropped == 3);
    /* refused while stopping: still no reply */
    shoal_serve_refuse(fx.srv, &f, 1, SHOAL_PERR_SHUTTING_DOWN, "stopping", &rep);
    CHECK_EQ_INT(rep.n, 0);
    /* a PING still gets its PONG */
    uint8_t ping[8];
    shoal_proto_enc_empty(ping, sizeof ping, &len, SHOAL_MSG_PING, 5);
    shoal_frame pf = {ping, len};
    CHECK(call(&fx, "p", &pf, 1, &m, &rep) == SHOAL_MSG_PONG && m.rid == 5);
    shoal_proto_msg_clear(&m);
    fx_close(&fx);
}

static void *srv_main(void *arg)
{
    srv_thread *s = arg;
    s->o.stop = &s->stop;
    s->rc = shoal_expert_server_run(&s->o, s->err, sizeof s->err);
    return NULL;
}

static int recv_all(void *sock, zmq_msg_t *parts, int max)
{
    int n = 0, more = 1;
    while (more && n < max) {
        zmq_msg_init(&parts[n]);
        if (zmq_msg_recv(&parts[n], sock, 0) < 0)
            return -1;
        more = zmq_msg_more(&parts[n]);
        n++;
    }
    return n;
}

static void t_server_socket(void)
{
    const char *model = test_src_path("tests/models/tiny-k3");
    char cfgp[4096];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", model);
    if (access(cfgp, R_OK))
        SKIP("tests/models/tiny-k3 not present");
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://@shoal-test-worker-%d", (int)getpid());
    static srv_thread st;
    st.o = (shoal_expert_server_opts){.model = model, .experts = "1-8:0-11", .listen = ep, .id = "w9", .threads = 1};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, srv_main, &st) == 0);
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, tmo = 5000;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    CHECK(zmq_connect(s, ep) == 0);
    /* garbage first: an ERROR, then the server goes on */
    CHECK(zmq_send(s, "\xc1\xc1", 2, 0) == 2);
    zmq_msg_t parts[4];
    int n = recv_all(s, parts, 4);
    CHECK(n == 1);
    shoal_proto_msg m = {0};
    int perr;
    char err[512];
    shoal_frame f[3];
    if (n == 1) {
        f[0] = (shoal_frame){zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0])};
        CHECK(shoal_proto_decode(f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0 &&
              m.type == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_MALFORMED);
        shoal_proto_msg_clear(&m);
        zmq_msg_close(&parts[0]);
    }
    /* a HELLO with the wrong fingerprint is refused, the right one accepted */
    uint8_t buf[256];
    size_t len;
    shoal_proto_hello h = {.major = 1, .id = "test"};
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 0) == 0);
    CHECK(zmq_send(s, buf, len, 0) == (int)len);
    n = recv_all(s, parts, 4);
    CHECK(n == 1);
    if (n == 1) {
        f[0] = (shoal_frame){zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0])};
        CHECK(shoal_proto_decode(f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0 &&
              m.type == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_FINGERPRINT);
        shoal_proto_msg_clear(&m);
        zmq_msg_close(&parts[0]);
    }
    /* learn the real fingerprint from the model the same way the coordinator does */
    shoal_st *store = NULL;
    shoal_k3cfg cfg;
    CHECK(shoal_k3cfg_load(&cfg, cfgp, err, sizeof err) == 0);
    shoal_st_opts so = {.map = 1};
    CHECK(shoal_st_open(&store, model, &so, err, sizeof err) == 0);
    CHECK(shoal_fprint_model(h.fingerprint, &cfg, store, err, sizeof err) == 0);
    shoal_proto_enc_hello(buf, sizeof buf, &len, 2, &h, 0);
    CHECK(zmq_send(s, buf, len, 0) == (int)len);
    n = recv_all(s, parts, 4);
    CHECK(n == 1);
    if (n == 1) {
        f[0] = (shoal_frame){zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0])};
        CHECK(shoal_proto_decode(f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0 &&
              m.type == SHOAL_MSG_HELLO && m.rid == 2 && !strcmp(m.hello.id, "w9"));
        shoal_proto_msg_clear(&m);
        zmq_msg_close(&parts[0]);
    }
    /* one batch on layer 5: the outputs equal shoal_expert_ffn on the model's own tensors */
    int d = cfg.latent_size;
    float *x = calloc((size_t)d * 2, sizeof *x), *scr = calloc(2 * (size_t)cfg.moe_intermediate_size, sizeof *scr);
    uint16_t *want = calloc((size_t)d, sizeof *want);
    for (int i = 0; i < 2 * d; i++)
        x[i] = frand();
    int32_t pairs[] = {0, 3, 0, 11, 1, 3};
    uint8_t ctl[64], *act = malloc(16 + 2 * (size_t)d * 4), route[16 + 24];
    shoal_proto_enc_batch(ctl, sizeof ctl, &len, 3, 5, SHOAL_WIRE_BF16);
    shoal_proto_tensor_hdr(act, SHOAL_WIRE_F32, 2, (uint32_t)d);
    memcpy(act + 16, x, 2 * (size_t)d * 4);
    shoal_proto_tensor_hdr(route, SHOAL_WIRE_I32, 3, 2);
    memcpy(route + 16, pairs, 24);
    zmq_send(s, ctl, len, ZMQ_SNDMORE);
    zmq_send(s, act, 16 + 2 * (size_t)d * 4, ZMQ_SNDMORE);
    zmq_send(s, route, sizeof route, 0);
    n = recv_all(s, parts, 4);
    CHECK(n == 2);
    if (n == 2) {
        f[0] = (shoal_frame){zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0])};
        f[1] = (shoal_frame){zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1])};
        CHECK(shoal_proto_decode(f, 2, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0 &&
              m.type == SHOAL_MSG_EXPERT_RESULT && m.rid == 3 && m.result.y.rows == 3);
        for (int i = 0; i < 3 && m.result.y.rows == 3; i++) {
            char name[256];
            const shoal_tensor *t[6];
            const char *parts6[6] = {"w1.weight_packed", "w1.weight_scale", "w3.weight_packed",
                                     "w3.weight_scale",  "w2.weight_packed", "w2.weight_scale"};
            for (int j = 0; j < 6; j++) {
                snprintf(name, sizeof name, "language_model.model.layers.5.block_sparse_moe.experts.%d.%s",
                         pairs[2 * i + 1], parts6[j]);
                t[j] = shoal_st_find(store, name);
            }
            CHECK(t[0] && t[5]);
            if (!t[0] || !t[5])
                break;
            shoal_expert_w w = {.kind = SHOAL_EXPERT_MXFP4, .d = d, .f = cfg.moe_intermediate_size,
                                .w1 = t[0]->data, .w1_scale = t[1]->data, .w3 = t[2]->data, .w3_scale = t[3]->data,
                                .w2 = t[4]->data, .w2_scale = t[5]->data};
            shoal_expert_ffn(want, &w, x + (size_t)pairs[2 * i] * d, 1, cfg.situ_beta, cfg.situ_linear_beta, scr);
            CHECK_MSG(!memcmp(want, m.result.y.data + (size_t)i * d * 2, (size_t)d * 2), "pair %d", i);
        }
        shoal_proto_msg_clear(&m);
    }
    for (int i = 0; i < n; i++)
        zmq_msg_close(&parts[i]);
    st.stop = 1;
    pthread_join(th, NULL);
    CHECK_MSG(st.rc == 0, "%s", st.err);
    zmq_close(s);
    zmq_ctx_term(ctx);
    shoal_st_close(store);
    free(x);
    free(scr);
    free(want);
    free(act);
}

static void t_server_refuses_bad_options(void)
{
    const char *model = test_src_path("tests/models/tiny-k3");
    char err[1024];
    shoal_expert_server_opts o = {.model = model, .experts = "1-8:0-24", .listen = "ipc://@shoal-never"};
    CHECK(shoal_expert_server_run(&o, err, sizeof err) == SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "expert 24");
    o.experts = "0:0-3";
    CHECK(shoal_expert_server_run(&o, err, sizeof err) == SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "layer 0 is not an MoE layer");
    o.experts = "1-8:0-3";
    o.listen = "bogus://x";
    CHECK(shoal_expert_server_run(&o, err, sizeof err) != 0);
    CHECK_STR_CONTAINS(err, "cannot listen on bogus://x");
}

int main(void)
{
    test_binary = "test_worker";
    shoal_log_set_level(SHOAL_LOG_ERROR);
    shoal_kernels_init();
    for (int i = 0; i < SHOAL_PROTO_FP_BYTES; i++)
        fp[i] = (uint8_t)(i * 7 + 1);
    make_weights();
    RUN(t_batch_matches_ffn);
    RUN(t_hello_rules);
    RUN(t_errors_keep_serving);
    RUN(t_prefetch_notice);
    RUN(t_server_socket);
    RUN(t_server_refuses_bad_options);
    free(weights);
    return test_finish();
}
