/* libFuzzer target: the worker's request path over arbitrary bytes -- decode
 * (PROTOCOL.md §2-§4), batch validation against a small model (§6), the
 * worker's request handler (worker/serve.h: HELLO state, grouping by expert,
 * the expert FFNs, the reply) on an in-memory bank, and the coordinator's reply
 * decoder on the same frames. Nothing may crash, leak or read out of bounds;
 * every input gets exactly one reply -- except a PREFETCH notice (its envelope
 * says type 11), which gets none -- and every refusal carries an ERROR code.
 *
 * Input: byte 0 picks the frame count (1 + b % 3); then, for every frame but
 * the last, a 2-byte little-endian length and that many bytes; the last frame
 * takes the rest. tests/fuzz/corpus/fuzz_proto/ holds the golden messages of
 * tests/fixtures/proto/golden.json in this form. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "proto/proto.h"
#include "proto/shard.h"
#include "worker/bank.h"
#include "worker/serve.h"

/* A 4-layer model (MoE layers 1-3), 8 experts of latent 32 and width 32 in
 * bf16, owned where (layer + expert) % 3 != 0 (as owns_some below). */
enum { L = 4, E = 8, D = 32, F = 32 };
static uint16_t wts[3][F * D];
static shoal_expert_w views[L * E];
static shoal_shard *own;
static shoal_bank *bank;
static shoal_serve *srv;
static const uint8_t fz_moe[L] = {0, 1, 1, 1};
static uint8_t fp[SHOAL_PROTO_FP_BYTES];
static const char peer_id[] = "fuzz-peer";

static void *alloc_out(void *ctx, size_t len)
{
    (void)ctx;
    return malloc(len);
}

static void setup(void)
{
    shoal_log_set_level(SHOAL_LOG_ERROR);
    uint32_t x = 12345;
    for (int m = 0; m < 3; m++)
        for (int i = 0; i < F * D; i++) {
            x = x * 1664525u + 1013904223u;
            wts[m][i] = (uint16_t)(0x3c00 + (x >> 24) % 0x400) ^ (uint16_t)((x >> 16) & 0x8000);
        }
    shoal_proto_range r[L * E];
    size_t nr = 0;
    for (int l = 1; l < L; l++)
        for (int e = 0; e < E; e++)
            if ((l + e) % 3) {
                r[nr++] = (shoal_proto_range){(uint32_t)l, (uint32_t)l, (uint32_t)e, (uint32_t)e};
                views[l * E + e] = (shoal_expert_w){.kind = SHOAL_EXPERT_BF16, .d = D, .f = F, .w1 = wts[0],
                                                    .w3 = wts[1], .w2 = wts[2]};
            }
    char err[256];
    if (shoal_shard_open(&own, r, nr, L, fz_moe, E, err, sizeof err) ||
        shoal_bank_from_views(&bank, L, E, own, views, 4.0f, 25.0f, err, sizeof err))
        abort();
    static shoal_proto_range ranges[L * E];
    memcpy(ranges, r, sizeof r);
    shoal_serve_opts so = {.id = "fuzz", .fingerprint = fp, .owned = ranges, .nowned = nr, .own = own,
                           .num_layers = L, .is_moe = fz_moe, .num_experts = E, .k = 2, .max_tokens = 16,
                           .isa = "scalar", .threads = 1};
    if (shoal_serve_open(&srv, &so, bank, err, sizeof err))
        abort();
    /* HELLO first, so batches reach the compute path */
    uint8_t buf[256];
    size_t len;
    shoal_proto_hello h = {.major = SHOAL_PROTO_MAJOR, .id = "fuzzer"};
    shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 0);
    shoal_frame f = {buf, len};
    shoal_serve_reply rep;
    shoal_serve_handle(srv, (const uint8_t *)peer_id, sizeof peer_id, &f, 1, 0, alloc_out, NULL, &rep);
    if (rep.type != SHOAL_MSG_HELLO)
        abort();
}

static int owns_some(const void *ctx, int layer, int e)
{
    (void)ctx;
    return (layer + e) % 3 != 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int n = 1 + data[0] % 3;
    size_t at = 1, off[3], len[3];
    for (int i = 0; i < n; i++) {
        if (i == n - 1) {
            len[i] = size - at;
        } else {
            if (size - at < 2)
                return 0;
            len[i] = (size_t)data[at] | (size_t)data[at + 1] << 8;
            at += 2;
            if (len[i] > size - at)
                return 0;
        }
        off[i] = at;
        at += len[i];
    }
    /* copy each frame so ASan sees its exact bounds */
    shoal_frame f[3];
    for (int i = 0; i < n; i++) {
        uint8_t *p = malloc(len[i] ? len[i] : 1);
        memcpy(p, data + off[i], len[i]);
        f[i] = (shoal_frame){p, len[i]};
    }
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr = 0;
    char err[512];
    int rc = shoal_proto_decode(f, n, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err);
    int notice = m.type == SHOAL_MSG_PREFETCH; /* the envelope said PREFETCH */
    for (uint32_t i = 1; !rc && notice && i < m.prefetch.n; i++)
        if (m.prefetch.experts[i] <= m.prefetch.experts[i - 1])
            abort(); /* a decoded PREFETCH is strictly ascending */
    if (rc && (perr < SHOAL_PERR_MALFORMED || perr > SHOAL_PERR_INTERNAL))
        abort(); /* a refusal must name an ERROR code */
    if (!rc && m.type == SHOAL_MSG_EXPERT_BATCH) {
        static const uint8_t is_moe[4] = {0, 1, 1, 1};
        shoal_proto_limits lim = {.num_layers = 4, .is_moe = is_moe, .num_experts = 8, .k = 2, .d = 32,
                                  .max_tokens = 16, .act_mask = 6, .out_mask = 6, .owns = owns_some};
        int pe = shoal_proto_check_batch(&m, &lim, err, sizeof err);
        if (pe == SHOAL_PERR_OK) {
            /* a checked batch may be read in full */
            volatile uint32_t acc = 0;
            for (uint32_t i = 0; i < m.batch.route.rows; i++) {
                int32_t t, e;
                shoal_proto_route_pair(&m.batch.route, i, &t, &e);
                acc += m.batch.act.data[(size_t)t * m.batch.act.cols * shoal_wire_dtype_size(m.batch.act.dtype)];
                acc += (uint32_t)e;
            }
            (void)acc;
        }
    }
    shoal_proto_msg_clear(&m);

    /* the worker's handler: exactly one reply, well-formed */
    if (!srv)
        setup();
    shoal_serve_reply rep;
    shoal_serve_handle(srv, (const uint8_t *)peer_id, sizeof peer_id, f, n, 0, alloc_out, NULL, &rep);
    if (notice) { /* never answered */
        if (rep.n != 0)
            abort();
        goto coordinator_side;
    }
    if (rep.n < 1 || rep.n > 2 || !rep.frames[0].len)
        abort();
    memset(&m, 0, sizeof m);
    if (shoal_proto_decode(rep.frames, rep.n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err))
        abort(); /* the worker's reply must decode */
    if (rep.type == SHOAL_MSG_EXPERT_RESULT && m.result.y.rows == 0)
        abort();
    shoal_proto_msg_clear(&m);
    if (rep.n == 2)
        free((void *)rep.frames[1].data);

coordinator_side:
    memset(&m, 0, sizeof m);
    shoal_proto_decode(f, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err);
    shoal_proto_msg_clear(&m);
    for (int i = 0; i < n; i++)
        free((void *)f[i].data);
    return 0;
}
