/* libFuzzer target: the worker's request path over arbitrary bytes -- decode
 * (PROTOCOL.md §2-§4), batch validation against a small model (§6), the
 * worker's request handler (worker/serve.h: HELLO state, grouping by expert,
 * the expert FFNs, the reply) on an in-memory bank, and the coordinator's reply
 * decoder on the same frames. The worker also owns trunk rows (PROTOCOL.md
 * §3.7: rows 0-127 of the golden q_proj in BF16, rows 128-383 of its k_proj in
 * F32, width 32), so a TRUNK_BATCH reaches the row GEMMs and the segment-major
 * reply. Nothing may crash, leak or read out of bounds;
 * every input gets exactly one reply -- except a PREFETCH notice (its envelope
 * says type 11) and a TRUNK_X from a relay parent (1.8), which get none -- and
 * every refusal carries an ERROR code. A relayed TRUNK_BATCH (no x) is also
 * handed to the relayed path with arbitrary bytes as its x.
 *
 * Input: byte 0 picks the frame count (1 + (b & 0x7f) % 3) and, with its top
 * bit, the numerics class the worker computes in (set: mu, where a bf16
 * TRUNK_BATCH x over BF16 matrices is computed, PROTOCOL.md 1.7; clear:
 * portable, where it is refused); then, for every frame but
 * the last, a 2-byte little-endian length and that many bytes; the last frame
 * takes the rest. tests/fuzz/corpus/fuzz_proto/ holds the golden messages of
 * tests/fixtures/proto/golden.json in this form. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "kernels/kernels.h"
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
/* trunk rows: the golden trunk_batch's matrices (tools/proto_golden.py) */
/* and the golden trunk_batch_chain's (1.4): f_a [TA, D] whole, f_b [TB, TA] */
enum { TQ = 128, TK = 256, TA = 8, TB = 128, NTR = 4 };
static uint16_t tq[TQ * D], ta[TA * D], tb[TB * TA];
static float tk[TK * D];
static const shoal_proto_trows trows[NTR] = {
    {.name = "language_model.model.layers.3.self_attn.q_proj.weight", .lo = 0, .hi = TQ - 1},
    {.name = "language_model.model.layers.3.self_attn.k_proj.weight", .lo = 128, .hi = 128 + TK - 1},
    {.name = "language_model.model.layers.1.self_attn.f_a_proj.weight", .lo = 0, .hi = TA - 1},
    {.name = "language_model.model.layers.1.self_attn.f_b_proj.weight", .lo = 0, .hi = TB - 1},
};
static const shoal_serve_tmat tmats[NTR] = {{.w = tq, .bf16 = 1, .cols = D, .rows = TQ},
                                            {.w = tk, .bf16 = 0, .cols = D, .rows = 128 + TK},
                                            {.w = ta, .bf16 = 1, .cols = D, .rows = TA},
                                            {.w = tb, .bf16 = 1, .cols = TA, .rows = TB}};
static uint8_t tfp[SHOAL_PROTO_FP_BYTES];

static void *alloc_out(void *ctx, size_t len, char *why, size_t whylen)
{
    (void)ctx;
    (void)why;
    (void)whylen;
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
    for (int i = 0; i < TQ * D; i++) {
        x = x * 1664525u + 1013904223u;
        tq[i] = (uint16_t)(0x3c00 + (x >> 24) % 0x400) ^ (uint16_t)((x >> 16) & 0x8000);
    }
    for (int i = 0; i < TA * D; i++) {
        x = x * 1664525u + 1013904223u;
        ta[i] = (uint16_t)(0x3c00 + (x >> 24) % 0x400) ^ (uint16_t)((x >> 16) & 0x8000);
    }
    for (int i = 0; i < TB * TA; i++) {
        x = x * 1664525u + 1013904223u;
        tb[i] = (uint16_t)(0x3c00 + (x >> 24) % 0x400) ^ (uint16_t)((x >> 16) & 0x8000);
    }
    for (int i = 0; i < TK * D; i++) {
        x = x * 1664525u + 1013904223u;
        tk[i] = (float)(int)(x >> 20) / 4096.0f - 0.5f;
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
                           .isa = "scalar", .threads = 1, .trunk = trows, .tmat = tmats, .ntrunk = NTR,
                           .trunk_fp = tfp};
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

/* Expected outputs of a decoded TRUNK_BATCH this worker must compute: every
 * segment inside one owned range, x f32 [T <= 16, 32]; 0 when it must be
 * refused. Worked out from the request alone, independently of serve.c. */
static uint64_t trunk_expect(const shoal_proto_msg *m, int mu)
{
    const shoal_proto_tensor *x = &m->tbatch.x;
    int bf16 = x->dtype == SHOAL_WIRE_BF16;
    if ((x->dtype != SHOAL_WIRE_F32 && !bf16) || (bf16 && !mu) || x->cols != D || x->rows < 1 || x->rows > 16)
        return 0;
    uint64_t rows = 0;
    for (uint32_t i = 0; i < m->tbatch.n; i++) {
        const shoal_proto_trows *g = &m->tbatch.seg[i];
        int in = 0;
        for (int j = 0; j < NTR; j++) /* inside one owned range, of width D; a bf16 x only into BF16 weights */
            in |= !strcmp(g->name, trows[j].name) && trows[j].lo <= g->lo && g->hi <= trows[j].hi &&
                  tmats[j].cols == D && (!bf16 || tmats[j].bf16);
        if (!in)
            return 0;
        rows += g->hi - g->lo + 1;
    }
    for (uint32_t i = 0; i < m->tbatch.nchain; i++) {
        const shoal_proto_tchain *c = &m->tbatch.chain[i];
        int a = -1, in = 0;
        for (int j = 0; j < NTR; j++) /* the first owned whole, of width D */
            if (!strcmp(c->a, trows[j].name) && trows[j].lo == 0 && (int)trows[j].hi == tmats[j].rows - 1 &&
                tmats[j].cols == D && (!bf16 || tmats[j].bf16))
                a = j;
        if (a < 0)
            return 0;
        for (int j = 0; j < NTR; j++) /* the second inside one owned range, as wide as the first is tall */
            in |= !strcmp(c->b.name, trows[j].name) && trows[j].lo <= c->b.lo && c->b.hi <= trows[j].hi &&
                  tmats[j].cols == tmats[a].rows;
        if (!in)
            return 0;
        rows += c->b.hi - c->b.lo + 1;
    }
    return rows * x->rows;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int n = 1 + (data[0] & 0x7f) % 3, mu = data[0] >> 7;
    shoal_kernels_set_numerics(mu ? SHOAL_NUMERICS_MU : SHOAL_NUMERICS_PORTABLE); /* one thread here */
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
    if (!srv)
        setup();
    /* notices: the envelope said PREFETCH, or a well-formed TRUNK_X (1.8) from
     * a connection whose HELLO said `relay` (an earlier input may have made
     * the fuzz peer one); a TRUNK_X from any other is refused with ERROR */
    int notice = m.type == SHOAL_MSG_PREFETCH ||
                 (!rc && m.type == SHOAL_MSG_TRUNK_X && shoal_serve_relay_parent(srv, (const uint8_t *)peer_id,
                                                                                  sizeof peer_id));
    int relayed = !rc && m.type == SHOAL_MSG_TRUNK_BATCH && !m.tbatch.has_x;
    uint64_t want_trunk = !rc && m.type == SHOAL_MSG_TRUNK_BATCH ? trunk_expect(&m, mu) : 0;
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
    shoal_serve_reply rep;
    if (relayed) { /* 1.8: a relayed TRUNK_BATCH paired with an x (the same bytes as its control frame) */
        shoal_serve_handle_relayed(srv, (const uint8_t *)peer_id, sizeof peer_id, f, n, &f[0], 0, alloc_out, NULL,
                                   &rep);
        if (rep.n < 1 || rep.n > 2)
            abort();
        if (rep.n == 2)
            free((void *)rep.frames[1].data);
    }
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
    if (want_trunk && (rep.type != SHOAL_MSG_TRUNK_RESULT || m.tresult.y.rows != 1 ||
                       m.tresult.y.cols != want_trunk))
        abort(); /* a valid TRUNK_BATCH is computed: segment-major [1, T * rows] */
    if (!want_trunk && rep.type == SHOAL_MSG_TRUNK_RESULT)
        abort(); /* an invalid one is refused */
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
