/* proto: golden bytes (hand-written here, and tests/fixtures/proto/golden.json
 * written by tools/proto_golden.py with the Python msgpack package from
 * PROTOCOL.md), round trips, refusals of malformed input, batch checks, expert
 * ownership ranges, the model fingerprint, and a two-process exchange over a
 * socketpair. */
#include <jansson.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/err.h"
#include "proto/fprint.h"
#include "proto/proto.h"
#include "proto/shard.h"
#include "tests/unit/test.h"

/* ---- helpers ------------------------------------------------------------ */

typedef struct {
    int n;
    uint8_t *data[SHOAL_PROTO_MAX_FRAMES];
    size_t len[SHOAL_PROTO_MAX_FRAMES];
} gmsg;

static json_t *golden_doc;

static size_t unhex(const char *h, uint8_t *out)
{
    size_t n = strlen(h) / 2;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(h + 2 * i, "%2x", &v);
        out[i] = (uint8_t)v;
    }
    return n;
}

static int golden(const char *name, gmsg *g)
{
    memset(g, 0, sizeof *g);
    if (!golden_doc) {
        json_error_t je;
        golden_doc = json_load_file(test_src_path("tests/fixtures/proto/golden.json"), 0, &je);
        if (!golden_doc) {
            fprintf(stderr, "cannot read golden.json: %s\n", je.text);
            return -1;
        }
    }
    json_t *frames = json_object_get(json_object_get(golden_doc, "messages"), name);
    if (!json_is_array(frames))
        return -1;
    g->n = (int)json_array_size(frames);
    for (int i = 0; i < g->n; i++) {
        const char *h = json_string_value(json_array_get(frames, (size_t)i));
        g->data[i] = malloc(strlen(h) / 2 + 1);
        g->len[i] = unhex(h, g->data[i]);
    }
    return 0;
}

static void gfree(gmsg *g)
{
    for (int i = 0; i < g->n; i++)
        free(g->data[i]);
}

static void to_frames(const gmsg *g, shoal_frame *f)
{
    for (int i = 0; i < g->n; i++)
        f[i] = (shoal_frame){g->data[i], g->len[i]};
}

static int same_bytes(const uint8_t *a, size_t na, const uint8_t *b, size_t nb)
{
    if (na != nb) {
        fprintf(stderr, "  length %zu vs %zu\n", na, nb);
        return 0;
    }
    for (size_t i = 0; i < na; i++)
        if (a[i] != b[i]) {
            fprintf(stderr, "  first difference at byte %zu: %02x vs %02x\n", i, a[i], b[i]);
            return 0;
        }
    return 1;
}

static int decode_g(const gmsg *g, shoal_proto_side side, shoal_proto_msg *m, int *perr, char *err)
{
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    to_frames(g, f);
    memset(m, 0, sizeof *m);
    return shoal_proto_decode(f, g->n, side, m, perr, err, 256);
}

static uint8_t fp_test[32];
static void init_fp(void)
{
    for (int i = 0; i < 32; i++)
        fp_test[i] = (uint8_t)i;
}

/* ---- hand-written golden bytes (from PROTOCOL.md, not from any encoder) -- */

static void t_hand_golden(void)
{
    uint8_t buf[256];
    size_t len;
    /* [3, 1, {}] : fixarray(3) 0x93, fixint 3, fixint 1, fixmap(0) 0x80 */
    static const uint8_t ping[] = {0x93, 0x03, 0x01, 0x80};
    CHECK(shoal_proto_enc_empty(buf, sizeof buf, &len, SHOAL_MSG_PING, 1) == 0);
    CHECK(same_bytes(buf, len, ping, sizeof ping));
    /* [1, 7, {"proto": [1, 0], "fingerprint": bin32 00..1f, "peer": "C"}] */
    uint8_t hello[128];
    size_t k = 0;
    hello[k++] = 0x93, hello[k++] = 0x01, hello[k++] = 0x07, hello[k++] = 0x83;
    hello[k++] = 0xa5, memcpy(hello + k, "proto", 5), k += 5;
    hello[k++] = 0x92, hello[k++] = 0x01, hello[k++] = 0x00;
    hello[k++] = 0xab, memcpy(hello + k, "fingerprint", 11), k += 11;
    hello[k++] = 0xc4, hello[k++] = 0x20;
    for (int i = 0; i < 32; i++)
        hello[k++] = (uint8_t)i;
    hello[k++] = 0xa4, memcpy(hello + k, "peer", 4), k += 4;
    hello[k++] = 0xa1, hello[k++] = 'C';
    shoal_proto_hello h = {.major = 1, .minor = 0, .id = "C"};
    memcpy(h.fingerprint, fp_test, 32);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 7, &h, 0) == 0);
    CHECK(same_bytes(buf, len, hello, k));
    /* rid 2^32 needs uint64 (0xcf), 300 needs uint16 (0xcd 01 2c):
     * [9, 4294967296, {"layer": 300, "out": "f32"}] */
    static const uint8_t batch[] = {0x93, 0x09, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r',
                                    0xcd, 0x01, 0x2c, 0xa3, 'o', 'u', 't', 0xa3, 'f', '3', '2'};
    CHECK(shoal_proto_enc_batch(buf, sizeof buf, &len, 1ull << 32, 300, SHOAL_WIRE_F32) == 0);
    CHECK(same_bytes(buf, len, batch, sizeof batch));
    /* tensor header: "SHTF", dtype 2 (bf16), 0 0 0, rows 3, cols 258 (LE) */
    static const uint8_t th[16] = {'S', 'H', 'T', 'F', 2, 0, 0, 0, 3, 0, 0, 0, 0x02, 0x01, 0, 0};
    uint8_t hdr[16];
    CHECK(shoal_proto_tensor_hdr(hdr, SHOAL_WIRE_BF16, 3, 258) == 0);
    CHECK(same_bytes(hdr, 16, th, 16));
    size_t tl;
    CHECK(shoal_proto_tensor_len(SHOAL_WIRE_BF16, 3, 258, &tl) == 0 && tl == 16 + 3 * 258 * 2);
}

/* ---- golden.json: the C encoder produces the Python bytes ---------------- */

static void t_golden_encode(void)
{
    uint8_t buf[4096];
    size_t len;
    gmsg g;
    shoal_proto_hello h = {.major = 1, .minor = 0};
    memcpy(h.fingerprint, fp_test, 32);

    strcpy(h.id, "coordinator 4242");
    CHECK(golden("hello_request", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 0) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);

    shoal_proto_range owned[2] = {{1, 8, 0, 11}, {2, 2, 300, 70000}};
    strcpy(h.id, "w1");
    h.owned = owned;
    h.nowned = 2;
    h.act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32) | SHOAL_WIRE_MASK(SHOAL_WIRE_BF16);
    h.out_mask = h.act_mask;
    h.max_tokens = 8192;
    strcpy(h.isa, "avx2");
    h.threads = 2;
    h.expert_bytes = 17547264ull * 448;
    h.mem_total = 25769803776ull;
    CHECK(golden("hello_reply", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    h.prefetch = 1; /* 1.2: the optional key, last */
    CHECK(golden("hello_reply_prefetch", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    h.prefetch = 0;
    strcpy(h.numerics, "portable"); /* 1.6: the default class is not sent */
    CHECK(golden("hello_reply", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    strcpy(h.numerics, "mu"); /* 1.6: another class is, last */
    CHECK(golden("hello_reply_numerics", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    h.bf16_exact = 1; /* 1.7: the optional key, after numerics */
    h.minor = 7;
    CHECK(golden("hello_reply_bf16", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    h.bf16_exact = 0;
    h.minor = 0;
    strcpy(h.numerics, "a class name over 16");
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == SHOAL_ERANGE);
    h.numerics[0] = 0;

    CHECK(golden("error", &g) == 0);
    CHECK(shoal_proto_enc_error(buf, sizeof buf, &len, 9, SHOAL_PERR_NOT_OWNED,
                                "EXPERT_BATCH: layer 3 expert 5 is not owned by this worker") == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);

    static const struct {
        const char *name;
        int type;
        uint64_t rid;
    } empties[] = {{"ping", SHOAL_MSG_PING, 3},
                   {"pong", SHOAL_MSG_PONG, 3},
                   {"stats", SHOAL_MSG_STATS, 4},
                   {"shutdown", SHOAL_MSG_SHUTDOWN, 5},
                   {"shutdown_ack", SHOAL_MSG_SHUTDOWN_ACK, 5}};
    for (size_t i = 0; i < sizeof empties / sizeof empties[0]; i++) {
        CHECK(golden(empties[i].name, &g) == 0);
        CHECK(shoal_proto_enc_empty(buf, sizeof buf, &len, empties[i].type, empties[i].rid) == 0);
        CHECK_MSG(same_bytes(buf, len, g.data[0], g.len[0]), "%s", empties[i].name);
        gfree(&g);
    }

    shoal_proto_stats s = {.worker = "w1", .uptime_us = 5000000000ull, .requests = 70000, .errors = 3,
                           .batches = 65536, .tokens = 131072, .pairs = 300, .bytes_in = 1ull << 40,
                           .bytes_out = (1ull << 32) + 1, .queue_us = 255, .compute_us = 256};
    CHECK(golden("stats_reply", &g) == 0);
    CHECK(shoal_proto_enc_stats(buf, sizeof buf, &len, 4, &s) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);

    /* EXPERT_BATCH: control + act f32 [2,32] + route i32 [3,2] */
    CHECK(golden("expert_batch", &g) == 0);
    CHECK(g.n == 3);
    CHECK(shoal_proto_enc_batch(buf, sizeof buf, &len, (1ull << 40) + 7, 3, SHOAL_WIRE_BF16) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    uint8_t frame[16 + 2 * 32 * 4];
    CHECK(shoal_proto_tensor_hdr(frame, SHOAL_WIRE_F32, 2, 32) == 0);
    for (int i = 0; i < 64; i++) {
        float v = (float)i * 0.25f - 3.0f;
        memcpy(frame + 16 + 4 * i, &v, 4);
    }
    CHECK(same_bytes(frame, sizeof frame, g.data[1], g.len[1]));
    int32_t route[6] = {0, 1, 0, 5, 1, 2};
    uint8_t rframe[16 + 24];
    CHECK(shoal_proto_tensor_hdr(rframe, SHOAL_WIRE_I32, 3, 2) == 0);
    memcpy(rframe + 16, route, 24);
    CHECK(same_bytes(rframe, sizeof rframe, g.data[2], g.len[2]));
    gfree(&g);

    CHECK(golden("expert_result", &g) == 0);
    CHECK(shoal_proto_enc_result(buf, sizeof buf, &len, (1ull << 40) + 7, 12, 3456) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    uint8_t yframe[16 + 3 * 32 * 2];
    CHECK(shoal_proto_tensor_hdr(yframe, SHOAL_WIRE_BF16, 3, 32) == 0);
    for (uint32_t i = 0; i < 96; i++) {
        uint16_t v = (uint16_t)((i * 2654435761u) >> 16);
        memcpy(yframe + 16 + 2 * i, &v, 2);
    }
    CHECK(same_bytes(yframe, sizeof yframe, g.data[1], g.len[1]));
    gfree(&g);

    /* PREFETCH (1.2) */
    static const uint32_t pf[] = {0, 7, 127, 128, 300, 70000};
    CHECK(golden("prefetch", &g) == 0);
    CHECK(shoal_proto_enc_prefetch(buf, sizeof buf, &len, 0, 5, pf, 6) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    CHECK(golden("prefetch_empty", &g) == 0);
    CHECK(shoal_proto_enc_prefetch(buf, sizeof buf, &len, 0, 1, pf, 0) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);

    /* 1.3: trunk rows in HELLO, TRUNK_BATCH, TRUNK_RESULT */
    shoal_proto_trows tr[2] = {{"language_model.model.layers.3.self_attn.q_proj.weight", 0, 127},
                               {"language_model.lm_head.weight", 300, 70000}};
    h.trunk = tr;
    h.ntrunk = 2;
    for (int i = 0; i < 32; i++)
        h.trunk_fp[i] = (uint8_t)(32 + i);
    CHECK(golden("hello_reply_trunk", &g) == 0);
    CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    h.trunk = NULL;
    h.ntrunk = 0;
    shoal_proto_trows ts[2] = {{"language_model.model.layers.3.self_attn.q_proj.weight", 0, 2},
                               {"language_model.model.layers.3.self_attn.k_proj.weight", 255, 256}};
    CHECK(golden("trunk_batch", &g) == 0);
    CHECK(g.n == 2);
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, (1ull << 33) + 1, 3, ts, 2, NULL, 0) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    uint8_t xframe[16 + 2 * 32 * 4];
    CHECK(shoal_proto_tensor_hdr(xframe, SHOAL_WIRE_F32, 2, 32) == 0);
    for (int i = 0; i < 64; i++) {
        float v = (float)i * -0.5f + 1.0f;
        memcpy(xframe + 16 + 4 * i, &v, 4);
    }
    CHECK(same_bytes(xframe, sizeof xframe, g.data[1], g.len[1]));
    gfree(&g);
    CHECK(golden("trunk_result", &g) == 0);
    CHECK(shoal_proto_enc_tresult(buf, sizeof buf, &len, (1ull << 33) + 1, 0, 70000) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    uint8_t tyframe[16 + 10 * 4];
    CHECK(shoal_proto_tensor_hdr(tyframe, SHOAL_WIRE_F32, 1, 10) == 0);
    for (int i = 0; i < 10; i++) {
        float v = (float)i * 1.5f;
        memcpy(tyframe + 16 + 4 * i, &v, 4);
    }
    CHECK(same_bytes(tyframe, sizeof tyframe, g.data[1], g.len[1]));
    gfree(&g);
    /* 1.4: chained segments ('chain' after 'mats'; mats may then be empty) */
    shoal_proto_trows q = {"language_model.model.layers.1.self_attn.q_proj.weight", 0, 31};
    shoal_proto_tchain ch = {"language_model.model.layers.1.self_attn.f_a_proj.weight",
                             {"language_model.model.layers.1.self_attn.f_b_proj.weight", 64, 127}};
    CHECK(golden("trunk_batch_chain", &g) == 0);
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 7, 1, &q, 1, &ch, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    ch.b.lo = 0;
    ch.b.hi = 63;
    CHECK(golden("trunk_batch_chain_only", &g) == 0);
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 8, 1, NULL, 0, &ch, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    gfree(&g);
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 1, 3, NULL, 0, &ch, SHOAL_PROTO_MAX_TCHAIN + 1) ==
          SHOAL_ERANGE);
    ch.b.lo = 70;
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 1, 3, NULL, 0, &ch, 1) == SHOAL_ERANGE);
    /* limits: no segment, too many, lo > hi, a name too long */
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 1, 3, ts, 0, NULL, 0) == SHOAL_ERANGE);
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 1, 3, ts, SHOAL_PROTO_MAX_TSEGS + 1, NULL, 0) == SHOAL_ERANGE);
    ts[0].lo = 5;
    CHECK(shoal_proto_enc_tbatch(buf, sizeof buf, &len, 1, 3, ts, 1, NULL, 0) == SHOAL_ERANGE);
}

/* ---- 1.3 trunk messages: decoding the Python bytes, and refusals ---------- */

static void t_trunk_decode(void)
{
    gmsg g;
    shoal_proto_msg m;
    int perr;
    char err[512];
    memset(&m, 0, sizeof m);
    CHECK(golden("hello_reply_trunk", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.hello.ntrunk == 2 && m.hello.nowned == 2 && m.hello.prefetch == 0);
    if (m.hello.ntrunk == 2) {
        CHECK(!strcmp(m.hello.trunk[0].name, "language_model.model.layers.3.self_attn.q_proj.weight"));
        CHECK(m.hello.trunk[0].lo == 0 && m.hello.trunk[0].hi == 127);
        CHECK(!strcmp(m.hello.trunk[1].name, "language_model.lm_head.weight"));
        CHECK(m.hello.trunk[1].lo == 300 && m.hello.trunk[1].hi == 70000);
        CHECK(m.hello.trunk_fp[0] == 32 && m.hello.trunk_fp[31] == 63);
    }
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply", &g) == 0); /* a 1.0-1.2 worker: no trunk rows */
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.hello.ntrunk == 0 && m.hello.trunk == NULL);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("trunk_batch", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_BATCH && m.rid == (1ull << 33) + 1 && m.tbatch.layer == 3 && m.tbatch.n == 2);
    CHECK(!strcmp(m.tbatch.seg[1].name, "language_model.model.layers.3.self_attn.k_proj.weight"));
    CHECK(m.tbatch.seg[1].lo == 255 && m.tbatch.seg[1].hi == 256);
    CHECK(m.tbatch.x.dtype == SHOAL_WIRE_F32 && m.tbatch.x.rows == 2 && m.tbatch.x.cols == 32);
    shoal_proto_msg_clear(&m);
    /* a request is not a reply */
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE);
    shoal_proto_msg_clear(&m);
    /* without its x frame */
    g.n = 1;
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    shoal_proto_msg_clear(&m);
    g.n = 2;
    gfree(&g);

    CHECK(m.tbatch.nchain == 0);
    shoal_proto_msg_clear(&m);

    /* 1.4 chains */
    CHECK(golden("trunk_batch_chain", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_BATCH && m.rid == 7 && m.tbatch.layer == 1 && m.tbatch.n == 1 &&
          m.tbatch.nchain == 1);
    CHECK(!strcmp(m.tbatch.chain[0].a, "language_model.model.layers.1.self_attn.f_a_proj.weight"));
    CHECK(!strcmp(m.tbatch.chain[0].b.name, "language_model.model.layers.1.self_attn.f_b_proj.weight"));
    CHECK(m.tbatch.chain[0].b.lo == 64 && m.tbatch.chain[0].b.hi == 127);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("trunk_batch_chain_only", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.tbatch.n == 0 && m.tbatch.nchain == 1 && m.tbatch.chain[0].b.hi == 63);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("trunk_result", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_RESULT && m.tresult.compute_us == 70000 && m.tresult.y.rows == 1 &&
          m.tresult.y.cols == 10);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    /* hand-made refusals: lo > hi, a name with a space, an empty list, bf16 x */
    uint8_t ctl[512], x[16 + 32 * 4];
    size_t len;
    CHECK(shoal_proto_tensor_hdr(x, SHOAL_WIRE_F32, 1, 32) == 0);
    memset(x + 16, 0, 32 * 4);
    static const uint8_t bad_lohi[] = {0x93, 0x0c, 0x01, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm', 'a',
                                       't', 's', 0x91, 0x93, 0xa1, 'w', 0x05, 0x04};
    static const uint8_t bad_name[] = {0x93, 0x0c, 0x01, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm', 'a',
                                       't', 's', 0x91, 0x93, 0xa2, 'w', ' ', 0x00, 0x04};
    static const uint8_t empty_list[] = {0x93, 0x0c, 0x01, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00,
                                         0xa4, 'm',  'a',  't',  's',  0x90};
    /* 1.4 'chain': an item of 3, an empty chain, lo > hi, a non-string first name */
    static const uint8_t chain3[] = {0x93, 0x0c, 0x01, 0x83, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm', 'a',
                                     't', 's', 0x90, 0xa5, 'c', 'h', 'a', 'i', 'n', 0x91, 0x93, 0xa1, 'a', 0xa1, 'b',
                                     0x00};
    static const uint8_t chain0[] = {0x93, 0x0c, 0x01, 0x83, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm', 'a',
                                     't', 's', 0x90, 0xa5, 'c', 'h', 'a', 'i', 'n', 0x90};
    static const uint8_t chain_lohi[] = {0x93, 0x0c, 0x01, 0x83, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm',
                                         'a', 't', 's', 0x90, 0xa5, 'c', 'h', 'a', 'i', 'n', 0x91, 0x94, 0xa1, 'a',
                                         0xa1, 'b', 0x05, 0x04};
    static const uint8_t chain_num[] = {0x93, 0x0c, 0x01, 0x83, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x00, 0xa4, 'm',
                                        'a', 't', 's', 0x90, 0xa5, 'c', 'h', 'a', 'i', 'n', 0x91, 0x94, 0x01, 0xa1,
                                        'b', 0x00, 0x04};
    const struct {
        const uint8_t *b;
        size_t n;
    } bad[] = {{bad_lohi, sizeof bad_lohi}, {bad_name, sizeof bad_name}, {empty_list, sizeof empty_list},
               {chain3, sizeof chain3},     {chain0, sizeof chain0},     {chain_lohi, sizeof chain_lohi},
               {chain_num, sizeof chain_num}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        shoal_frame f[2] = {{bad[i].b, bad[i].n}, {x, sizeof x}};
        CHECK_MSG(shoal_proto_decode(f, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
                      perr == SHOAL_PERR_MALFORMED,
                  "case %zu", i);
        shoal_proto_msg_clear(&m);
    }
    shoal_proto_trows one = {"w", 0, 4};
    CHECK(shoal_proto_enc_tbatch(ctl, sizeof ctl, &len, 1, 0, &one, 1, NULL, 0) == 0);
    uint8_t xb[16 + 32 * 2];
    CHECK(shoal_proto_tensor_hdr(xb, SHOAL_WIRE_BF16, 1, 32) == 0);
    memset(xb + 16, 0, 64);
    shoal_frame fb[2] = {{ctl, len}, {xb, sizeof xb}};
    /* 1.7: a bf16 x decodes (the worker decides whether it is exact) ... */
    CHECK(shoal_proto_decode(fb, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == 0 &&
          m.tbatch.x.dtype == SHOAL_WIRE_BF16 && m.tbatch.x.cols == 32 && m.tbatch.x.nbytes == 64);
    shoal_proto_msg_clear(&m);
    /* ... one whose length is that of f32 elements (or one byte short) is malformed ... */
    shoal_frame fl[2] = {{ctl, len}, {xb, sizeof xb - 1}};
    CHECK(shoal_proto_decode(fl, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED);
    shoal_proto_msg_clear(&m);
    uint8_t xl[16 + 16 * 4];
    CHECK(shoal_proto_tensor_hdr(xl, SHOAL_WIRE_BF16, 1, 32) == 0);
    memset(xl + 16, 0, 64);
    xl[12] = 16; /* cols 16: 32 bytes of bf16, the frame has 64 */
    shoal_frame fw[2] = {{ctl, len}, {xl, sizeof xl}};
    CHECK(shoal_proto_decode(fw, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED);
    shoal_proto_msg_clear(&m);
    /* ... and an I32 x is not an activation */
    uint8_t xi[16 + 16 * 4];
    CHECK(shoal_proto_tensor_hdr(xi, SHOAL_WIRE_I32, 1, 16) == 0);
    memset(xi + 16, 0, 64);
    shoal_frame fi[2] = {{ctl, len}, {xi, sizeof xi}};
    CHECK(shoal_proto_decode(fi, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_UNSUPPORTED);
    shoal_proto_msg_clear(&m);
    shoal_frame fg[2] = {{ctl, len}, {x, sizeof x}};
    CHECK(shoal_proto_decode(fg, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == 0 && m.tbatch.n == 1);
    shoal_proto_msg_clear(&m);
}

static void t_trunk_fingerprint(void)
{
    CHECK(golden_doc || (golden("ping", &(gmsg){0}) == 0));
    json_t *fpj = json_object_get(golden_doc, "trunk_fingerprint");
    const char *want = json_string_value(json_object_get(fpj, "blake2b_256"));
    CHECK(want != NULL);
    if (!want)
        return;
    shoal_fprint f;
    shoal_fprint_trunk_begin(&f);
    int64_t a[2] = {192, 96}, b[2] = {4096, 96};
    shoal_fprint_tensor(&f, "language_model.model.layers.0.mlp.gate_proj.weight", "BF16", 2, a, 36864);
    shoal_fprint_tensor(&f, "language_model.lm_head.weight", "F32", 2, b, 1572864);
    uint8_t out[32];
    char hex[65];
    shoal_fprint_end(&f, out);
    shoal_proto_hex(out, hex);
    CHECK_MSG(!strcmp(hex, want), "trunk fingerprint %s, golden %s", hex, want);
}

/* ---- golden.json: the C decoder reads the Python bytes ------------------- */

static void t_golden_decode(void)
{
    gmsg g;
    shoal_proto_msg m;
    int perr;
    char err[256];

    CHECK(golden("hello_request", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_HELLO && m.rid == 1 && m.hello.major == 1 && m.hello.minor == 0);
    CHECK(!memcmp(m.hello.fingerprint, fp_test, 32));
    CHECK(!strcmp(m.hello.id, "coordinator 4242"));
    shoal_proto_msg_clear(&m);
    /* a HELLO request is not a reply */
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("hello_reply", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_HELLO && !strcmp(m.hello.id, "w1") && m.hello.nowned == 2);
    CHECK(m.hello.nowned == 2 && m.hello.owned[1].e_lo == 300 && m.hello.owned[1].e_hi == 70000 &&
          m.hello.owned[0].l_hi == 8);
    CHECK(m.hello.act_mask == (SHOAL_WIRE_MASK(SHOAL_WIRE_F32) | SHOAL_WIRE_MASK(SHOAL_WIRE_BF16)));
    CHECK(m.hello.max_tokens == 8192 && m.hello.threads == 2 && !strcmp(m.hello.isa, "avx2"));
    CHECK(m.hello.expert_bytes == 17547264ull * 448 && m.hello.mem_total == 25769803776ull);
    CHECK(m.hello.prefetch == 0); /* absent: no hints */
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply_prefetch", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.hello.prefetch == 1 && m.hello.max_tokens == 8192 && m.hello.nowned == 2);
    CHECK(!strcmp(m.hello.numerics, "portable")); /* 1.6: absent is the portable class */
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply_numerics", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(!strcmp(m.hello.numerics, "mu") && m.hello.max_tokens == 8192 && m.hello.nowned == 2);
    CHECK(m.hello.bf16_exact == 0); /* 1.7: absent is f32 activations only */
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply_bf16", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(!strcmp(m.hello.numerics, "mu") && m.hello.bf16_exact == 1 && m.hello.minor == 7);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("trunk_batch_bf16", &g) == 0); /* 1.7: a bf16 x, 2 tokens of 32 */
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_BATCH && m.tbatch.n == 1 && m.tbatch.x.dtype == SHOAL_WIRE_BF16 &&
          m.tbatch.x.rows == 2 && m.tbatch.x.cols == 32 && m.tbatch.x.nbytes == 2 * 32 * 2);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("hello_version_2_0", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.hello.major == 2 && m.hello.minor == 0 && !strcmp(m.hello.id, "future"));
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("error", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_ERROR && m.rid == 9 && m.error.code == SHOAL_PERR_NOT_OWNED);
    CHECK_STR_CONTAINS(m.error.message, "layer 3 expert 5");
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("stats_reply", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.stats.uptime_us == 5000000000ull && m.stats.bytes_in == (1ull << 40) && m.stats.queue_us == 255 &&
          m.stats.compute_us == 256 && m.stats.batches == 65536 && !strcmp(m.stats.worker, "w1"));
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("expert_batch", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_EXPERT_BATCH && m.rid == (1ull << 40) + 7 && m.batch.layer == 3 &&
          m.batch.out == SHOAL_WIRE_BF16);
    CHECK(m.batch.act.dtype == SHOAL_WIRE_F32 && m.batch.act.rows == 2 && m.batch.act.cols == 32);
    float v;
    memcpy(&v, m.batch.act.data + 4 * 5, 4);
    CHECK(v == 5 * 0.25f - 3.0f);
    CHECK(m.batch.route.rows == 3 && m.batch.route.cols == 2);
    int32_t t, e;
    shoal_proto_route_pair(&m.batch.route, 1, &t, &e);
    CHECK(t == 0 && e == 5);
    /* as a reply it is an unknown type */
    shoal_proto_msg_clear(&m);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("expert_result", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.result.queue_us == 12 && m.result.compute_us == 3456 && m.result.y.rows == 3 &&
          m.result.y.dtype == SHOAL_WIRE_BF16);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    CHECK(golden("expert_batch_bf16", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.batch.act.dtype == SHOAL_WIRE_BF16 && m.batch.out == SHOAL_WIRE_F32 && m.batch.layer == 1);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    /* PREFETCH (1.2): a notice with rid 0 */
    CHECK(golden("prefetch", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_PREFETCH && m.rid == 0 && m.prefetch.layer == 5 && m.prefetch.n == 6);
    CHECK(m.prefetch.experts[0] == 0 && m.prefetch.experts[1] == 7 && m.prefetch.experts[2] == 127 &&
          m.prefetch.experts[3] == 128 && m.prefetch.experts[4] == 300 && m.prefetch.experts[5] == 70000);
    shoal_proto_msg_clear(&m);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("prefetch_empty", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_PREFETCH && m.prefetch.layer == 1 && m.prefetch.n == 0);
    shoal_proto_msg_clear(&m);
    gfree(&g);

    const char *empties[] = {"ping", "stats", "shutdown"};
    for (int i = 0; i < 3; i++) {
        CHECK(golden(empties[i], &g) == 0);
        CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
        shoal_proto_msg_clear(&m);
        gfree(&g);
    }
}

/* ---- round trips --------------------------------------------------------- */

static void t_roundtrip(void)
{
    size_t cap = 1 << 20, len;
    uint8_t *buf = malloc(cap);
    shoal_proto_msg m;
    int perr;
    char err[256];
    /* a large ownership list, values at their limits */
    size_t nr = 5000;
    shoal_proto_range *r = malloc(nr * sizeof *r);
    for (size_t i = 0; i < nr; i++)
        r[i] = (shoal_proto_range){(uint32_t)i, (uint32_t)i + 1, (uint32_t)(i * 977u), UINT32_MAX - (uint32_t)i};
    shoal_proto_hello h = {.major = 65535, .minor = 65535, .owned = r, .nowned = nr, .max_tokens = UINT32_MAX,
                           .threads = 1, .expert_bytes = UINT64_MAX, .mem_total = 0,
                           .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16), .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32)};
    memset(h.id, 'x', SHOAL_PROTO_MAX_ID);
    strcpy(h.isa, "avx512");
    for (int i = 0; i < 32; i++)
        h.fingerprint[i] = (uint8_t)(255 - i);
    CHECK(shoal_proto_enc_hello(buf, cap, &len, UINT64_MAX, &h, 1) == 0);
    shoal_frame f = {buf, len};
    memset(&m, 0, sizeof m);
    CHECK(shoal_proto_decode(&f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.rid == UINT64_MAX && m.hello.major == 65535 && m.hello.nowned == nr);
    CHECK(m.hello.owned && !memcmp(m.hello.owned, r, nr * sizeof *r));
    CHECK(!memcmp(m.hello.fingerprint, h.fingerprint, 32) && strlen(m.hello.id) == SHOAL_PROTO_MAX_ID);
    CHECK(m.hello.act_mask == h.act_mask && m.hello.out_mask == h.out_mask && m.hello.expert_bytes == UINT64_MAX);
    shoal_proto_msg_clear(&m);
    /* too small a buffer is refused, not overrun */
    CHECK(shoal_proto_enc_hello(buf, 100, &len, 1, &h, 1) == SHOAL_ERANGE);
    /* an id over the limit is refused */
    char longid[SHOAL_PROTO_MAX_ID + 2];
    memset(longid, 'y', sizeof longid - 1);
    longid[sizeof longid - 1] = 0;
    shoal_proto_hello h2 = {.major = 1};
    memcpy(h2.id, longid, SHOAL_PROTO_MAX_ID);
    h2.id[SHOAL_PROTO_MAX_ID] = 0;
    CHECK(shoal_proto_enc_hello(buf, cap, &len, 1, &h2, 0) == 0);
    /* an ERROR message longer than the limit is cut */
    char *big = malloc(5000);
    memset(big, 'z', 4999);
    big[4999] = 0;
    CHECK(shoal_proto_enc_error(buf, cap, &len, 77, SHOAL_PERR_INTERNAL, big) == 0);
    f = (shoal_frame){buf, len};
    memset(&m, 0, sizeof m);
    CHECK(shoal_proto_decode(&f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(strlen(m.error.message) == SHOAL_PROTO_MAX_TEXT && m.error.code == SHOAL_PERR_INTERNAL);
    free(big);
    free(r);
    free(buf);
}

/* ---- refusals ------------------------------------------------------------ */

static int dec1(const uint8_t *b, size_t n, shoal_proto_side side, int *perr, uint64_t *rid)
{
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    shoal_frame f = {b, n};
    char err[256];
    int rc = shoal_proto_decode(&f, 1, side, &m, perr, err, sizeof err);
    if (rid)
        *rid = m.rid;
    shoal_proto_msg_clear(&m);
    return rc;
}

static void t_refusals(void)
{
    int perr;
    uint64_t rid;
    /* array32 declaring 2^32-1 elements in 5 bytes: refused before any allocation */
    static const uint8_t huge[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    CHECK(dec1(huge, sizeof huge, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t hugemap[] = {0x93, 0x03, 0x01, 0xdf, 0x7f, 0xff, 0xff, 0xff, 0x00};
    CHECK(dec1(hugemap, sizeof hugemap, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    static const uint8_t bin[] = {0xc6, 0xff, 0xff, 0xff, 0xf0, 0x00};
    CHECK(dec1(bin, sizeof bin, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* 0xc1 is never valid */
    static const uint8_t c1[] = {0x93, 0x03, 0x01, 0xc1};
    CHECK(dec1(c1, sizeof c1, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* deep nesting */
    static const uint8_t deep[] = {0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x00};
    CHECK(dec1(deep, sizeof deep, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* trailing bytes after a valid PING */
    static const uint8_t trail[] = {0x93, 0x03, 0x01, 0x80, 0x00};
    CHECK(dec1(trail, sizeof trail, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* envelope of 2 elements */
    static const uint8_t two[] = {0x92, 0x03, 0x01};
    CHECK(dec1(two, sizeof two, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* unknown type 17 (14 and 15 are the 1.5 PROBE messages, 16 the 1.8 TRUNK_X), rid still reported */
    static const uint8_t unk[] = {0x93, 0x11, 0x2a, 0x80};
    /* PREFETCH (11) without its keys; with descending, repeated, negative,
     * too-large ids; as a reply */
    static const uint8_t pf0[] = {0x93, 0x0b, 0x00, 0x80};
    CHECK(dec1(pf0, sizeof pf0, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t pfdesc[] = {0x93, 0x0b, 0x00, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01,
                                     0xa7, 'e', 'x', 'p', 'e', 'r', 't', 's', 0x92, 0x05, 0x03};
    CHECK(dec1(pfdesc, sizeof pfdesc, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t pfrep[] = {0x93, 0x0b, 0x00, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01,
                                    0xa7, 'e', 'x', 'p', 'e', 'r', 't', 's', 0x92, 0x03, 0x03};
    CHECK(dec1(pfrep, sizeof pfrep, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t pfneg[] = {0x93, 0x0b, 0x00, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01,
                                    0xa7, 'e', 'x', 'p', 'e', 'r', 't', 's', 0x91, 0xff};
    CHECK(dec1(pfneg, sizeof pfneg, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t pfbig[] = {0x93, 0x0b, 0x00, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01, 0xa7, 'e', 'x',
                                    'p', 'e', 'r', 't', 's', 0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0};
    CHECK(dec1(pfbig, sizeof pfbig, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
    static const uint8_t pfok[] = {0x93, 0x0b, 0x00, 0x82, 0xa5, 'l', 'a', 'y', 'e', 'r', 0x01,
                                   0xa7, 'e', 'x', 'p', 'e', 'r', 't', 's', 0x92, 0x03, 0x05};
    CHECK(dec1(pfok, sizeof pfok, SHOAL_SIDE_WORKER, &perr, NULL) == 0);
    CHECK(dec1(pfok, sizeof pfok, SHOAL_SIDE_COORDINATOR, &perr, NULL) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_UNKNOWN_TYPE);
    {   /* the encoder refuses unsorted ids and too many */
        uint32_t ids[2] = {5, 3};
        uint8_t b[64];
        size_t l;
        CHECK(shoal_proto_enc_prefetch(b, sizeof b, &l, 0, 1, ids, 2) == SHOAL_EINVAL);
        CHECK(shoal_proto_enc_prefetch(b, sizeof b, &l, 0, 1, ids, SHOAL_PROTO_MAX_PREFETCH + 1) == SHOAL_ERANGE);
    }
    CHECK(dec1(unk, sizeof unk, SHOAL_SIDE_WORKER, &perr, &rid) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE &&
          rid == 42);
    /* a reply type sent to the worker */
    static const uint8_t pong[] = {0x93, 0x04, 0x2a, 0x80};
    CHECK(dec1(pong, sizeof pong, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE);
    /* negative type */
    static const uint8_t neg[] = {0x93, 0xff, 0x01, 0x80};
    CHECK(dec1(neg, sizeof neg, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* PING with a non-map body, with a duplicate key, with an int key */
    static const uint8_t nomap[] = {0x93, 0x03, 0x01, 0x90};
    CHECK(dec1(nomap, sizeof nomap, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    static const uint8_t dup[] = {0x93, 0x03, 0x01, 0x82, 0xa1, 'a', 0x01, 0xa1, 'a', 0x02};
    CHECK(dec1(dup, sizeof dup, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    static const uint8_t intkey[] = {0x93, 0x03, 0x01, 0x81, 0x01, 0x01};
    CHECK(dec1(intkey, sizeof intkey, SHOAL_SIDE_WORKER, &perr, NULL) == SHOAL_EPROTO);
    /* unknown keys are ignored (minor-version additions) */
    static const uint8_t extra[] = {0x93, 0x03, 0x01, 0x81, 0xa3, 'n', 'e', 'w', 0xcb, 0, 0, 0, 0, 0, 0, 0, 0};
    CHECK(dec1(extra, sizeof extra, SHOAL_SIDE_WORKER, &perr, NULL) == 0);
    /* the uint8 encoding of a small value is accepted (any integer encoding) */
    static const uint8_t u8[] = {0x93, 0xcc, 0x03, 0xd0, 0x01, 0x80};
    CHECK(dec1(u8, sizeof u8, SHOAL_SIDE_WORKER, &perr, &rid) == 0 && rid == 1);

    /* every strict prefix of every golden message fails cleanly */
    const char *names[] = {"hello_request", "hello_reply", "error", "ping", "stats_reply", "expert_batch",
                           "expert_result"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        gmsg g;
        CHECK(golden(names[i], &g) == 0);
        shoal_proto_side side = (!strcmp(names[i], "hello_reply") || !strcmp(names[i], "error") ||
                                 !strcmp(names[i], "stats_reply") || !strcmp(names[i], "expert_result"))
                                    ? SHOAL_SIDE_COORDINATOR
                                    : SHOAL_SIDE_WORKER;
        for (int fr = 0; fr < g.n; fr++) {
            size_t full = g.len[fr];
            for (size_t cut = 0; cut < full; cut++) {
                shoal_proto_msg m;
                int p;
                char err[256];
                g.len[fr] = cut;
                CHECK_MSG(decode_g(&g, side, &m, &p, err) == SHOAL_EPROTO, "%s frame %d cut at %zu", names[i], fr,
                          cut);
                shoal_proto_msg_clear(&m);
            }
            g.len[fr] = full;
        }
        /* one frame too many / too few */
        if (g.n < SHOAL_PROTO_MAX_FRAMES) {
            shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
            to_frames(&g, f);
            f[g.n] = f[0];
            shoal_proto_msg m = {0};
            int p;
            CHECK(shoal_proto_decode(f, g.n + 1, side, &m, &p, NULL, 0) == SHOAL_EPROTO);
            shoal_proto_msg_clear(&m);
        }
        if (g.n > 1) {
            shoal_proto_msg m = {0};
            int p;
            shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
            to_frames(&g, f);
            CHECK(shoal_proto_decode(f, g.n - 1, side, &m, &p, NULL, 0) == SHOAL_EPROTO);
            shoal_proto_msg_clear(&m);
        }
        gfree(&g);
    }

    /* tensor frames: bad magic, reserved bytes, unknown dtype, zero dims, length mismatch, overflow */
    uint8_t t[16 + 8];
    shoal_proto_tensor ten;
    shoal_frame f = {t, sizeof t};
    CHECK(shoal_proto_tensor_hdr(t, SHOAL_WIRE_F32, 1, 2) == 0);
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == 0 && ten.rows == 1 && ten.cols == 2 && ten.nbytes == 8);
    t[0] = 'X';
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
    t[0] = 'S';
    t[6] = 1;
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
    t[6] = 0;
    t[4] = 9;
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
    t[4] = SHOAL_WIRE_BF16; /* bf16 [1,2] is 4 bytes, frame has 8 */
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
    CHECK(shoal_proto_tensor_hdr(t, SHOAL_WIRE_F32, 0, 2) == SHOAL_ERANGE);
    t[4] = SHOAL_WIRE_F32;
    memset(t + 8, 0xff, 8); /* rows = cols = 2^32-1 */
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
    f.len = 15;
    CHECK(shoal_proto_tensor_decode(&f, &ten, NULL, 0) == SHOAL_EPROTO);
}

/* ---- semantic checks of EXPERT_BATCH ------------------------------------ */

static int own_even(const void *ctx, int layer, int e)
{
    (void)ctx;
    (void)layer;
    return e % 2 == 0;
}

typedef struct {
    uint8_t act[16 + 4 * 4 * 32];
    uint8_t route[16 + 8 * 16];
    shoal_proto_msg m;
} batch_fx;

/* act f32 [T, d], route pairs given flat */
static void mk_batch(batch_fx *b, uint32_t layer, int act_dt, uint32_t T, uint32_t d, const int32_t *pairs, uint32_t n)
{
    memset(&b->m, 0, sizeof b->m);
    size_t alen, rlen;
    shoal_proto_tensor_hdr(b->act, act_dt, T, d);
    shoal_proto_tensor_len(act_dt, T, d, &alen);
    shoal_proto_tensor_hdr(b->route, SHOAL_WIRE_I32, n, 2);
    shoal_proto_tensor_len(SHOAL_WIRE_I32, n, 2, &rlen);
    memcpy(b->route + 16, pairs, (size_t)n * 8);
    shoal_frame fa = {b->act, alen}, fr = {b->route, rlen};
    b->m.type = SHOAL_MSG_EXPERT_BATCH;
    b->m.batch.layer = layer;
    b->m.batch.out = SHOAL_WIRE_BF16;
    shoal_proto_tensor_decode(&fa, &b->m.batch.act, NULL, 0);
    shoal_proto_tensor_decode(&fr, &b->m.batch.route, NULL, 0);
}

static void t_check_batch(void)
{
    uint8_t is_moe[4] = {0, 1, 1, 1};
    shoal_proto_limits lim = {.num_layers = 4, .is_moe = is_moe, .num_experts = 8, .k = 2, .d = 32,
                              .max_tokens = 4, .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32),
                              .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16), .owns = own_even};
    char err[256];
    batch_fx b;
    static const int32_t ok[] = {0, 0, 0, 2, 1, 4, 2, 0};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 3, 32, ok, 4);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_OK);
    mk_batch(&b, 0, SHOAL_WIRE_F32, 3, 32, ok, 4); /* dense layer */
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_SHAPE);
    mk_batch(&b, 4, SHOAL_WIRE_F32, 3, 32, ok, 4); /* beyond the model */
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_SHAPE);
    mk_batch(&b, 1, SHOAL_WIRE_F32, 3, 64, ok, 4); /* wrong width */
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_SHAPE);
    CHECK_STR_CONTAINS(err, "64 columns");
    mk_batch(&b, 1, SHOAL_WIRE_BF16, 3, 32, ok, 4); /* dtype not offered */
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_UNSUPPORTED);
    mk_batch(&b, 1, SHOAL_WIRE_F32, 3, 32, ok, 4);
    b.m.batch.out = SHOAL_WIRE_F32;
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_UNSUPPORTED);
    static const int32_t many[] = {0, 0, 0, 2, 1, 0, 1, 2, 2, 0, 3, 0, 3, 2, 3, 4};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 4, 32, many, 8); /* 8 pairs for 4 tokens, but token 3 has 3 > k */
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t notown[] = {0, 0, 0, 3};
    mk_batch(&b, 2, SHOAL_WIRE_F32, 1, 32, notown, 2);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_NOT_OWNED);
    CHECK_STR_CONTAINS(err, "layer 2 expert 3");
    static const int32_t order[] = {0, 2, 0, 0};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 1, 32, order, 2);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t dupl[] = {0, 2, 0, 2};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 1, 32, dupl, 2);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t tok[] = {0, 0, 5, 0};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 2, 32, tok, 2);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t negt[] = {-1, 0};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 1, 32, negt, 1);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t bige[] = {0, 8};
    mk_batch(&b, 1, SHOAL_WIRE_F32, 1, 32, bige, 1);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t skip[] = {0, 0, 2, 0}; /* row 1 unused */
    mk_batch(&b, 1, SHOAL_WIRE_F32, 3, 32, skip, 2);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    static const int32_t tail[] = {0, 0}; /* row 1 unused at the end */
    mk_batch(&b, 1, SHOAL_WIRE_F32, 2, 32, tail, 1);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_ROUTE);
    lim.max_tokens = 2;
    mk_batch(&b, 1, SHOAL_WIRE_F32, 3, 32, ok, 4);
    CHECK_EQ_INT(shoal_proto_check_batch(&b.m, &lim, err, sizeof err), SHOAL_PERR_BAD_SHAPE);
}

/* ---- ownership ranges ---------------------------------------------------- */

static void t_shard(void)
{
    shoal_proto_range *r;
    size_t n;
    char err[512], buf[256];
    CHECK(shoal_shard_parse("1-92:0-447", &r, &n, err, sizeof err) == 0);
    CHECK(n == 1 && r[0].l_lo == 1 && r[0].l_hi == 92 && r[0].e_lo == 0 && r[0].e_hi == 447);
    free(r);
    CHECK(shoal_shard_parse("1-4:0-7,5:3,6-8:2", &r, &n, err, sizeof err) == 0);
    CHECK(n == 3 && r[1].l_lo == 5 && r[1].l_hi == 5 && r[1].e_lo == 3 && r[2].e_hi == 2);
    CHECK(shoal_shard_format(r, n, buf, sizeof buf) == 0);
    CHECK(!strcmp(buf, "1-4:0-7,5:3,6-8:2"));
    CHECK(shoal_shard_format(r, n, buf, 8) == SHOAL_ERANGE);
    free(r);
    const char *bad[] = {"", "1-92", "1-92:", ":3", "3-1:0", "1:5-4", "1:2,", ",1:2", "1:2 ", "a:b", "1--2:3",
                         "99999999999:1", "1:2:3", "1-2-3:4"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_MSG(shoal_shard_parse(bad[i], &r, &n, err, sizeof err) == SHOAL_EINVAL, "'%s'", bad[i]);
        CHECK(r == NULL);
    }
    uint8_t is_moe[6] = {0, 1, 1, 0, 1, 1};
    CHECK(shoal_shard_parse("1-2:0-3", &r, &n, err, sizeof err) == 0);
    CHECK(shoal_shard_check(r, n, 6, is_moe, 4, err, sizeof err) == 0);
    free(r);
    CHECK(shoal_shard_parse("1-4:0-3", &r, &n, err, sizeof err) == 0);
    CHECK(shoal_shard_check(r, n, 6, is_moe, 4, err, sizeof err) == SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "layer 3 is not an MoE layer");
    free(r);
    CHECK(shoal_shard_parse("1:4", &r, &n, err, sizeof err) == 0);
    CHECK(shoal_shard_check(r, n, 6, is_moe, 4, err, sizeof err) == SHOAL_ERANGE);
    free(r);
    CHECK(shoal_shard_parse("6:0", &r, &n, err, sizeof err) == 0);
    CHECK(shoal_shard_check(r, n, 6, is_moe, 4, err, sizeof err) == SHOAL_ERANGE);
    free(r);

    /* bitmap */
    shoal_shard *s;
    CHECK(shoal_shard_parse("1-2:0-1,5:3,1:1", &r, &n, err, sizeof err) == 0);
    CHECK(shoal_shard_open(&s, r, n, 6, is_moe, 4, err, sizeof err) == 0);
    CHECK(shoal_shard_count(s) == 5);
    CHECK(shoal_shard_owns(s, 1, 1) && shoal_shard_owns(s, 5, 3) && !shoal_shard_owns(s, 5, 2) &&
          !shoal_shard_owns(s, 4, 0) && !shoal_shard_owns(s, -1, 0) && !shoal_shard_owns(s, 6, 0) &&
          !shoal_shard_owns(s, 1, 4));
    shoal_shard_close(s);
    free(r);

    /* even split over 3 workers of 8 experts: 0-1, 2-4, 5-7; layer runs 1-2 and 4-5 */
    shoal_proto_range *parts[3];
    size_t np[3];
    const char *names[3] = {"w0", "w1", "w2"};
    for (int w = 0; w < 3; w++)
        CHECK(shoal_shard_split(w, 3, 6, is_moe, 8, &parts[w], &np[w], err, sizeof err) == 0);
    CHECK(shoal_shard_format(parts[1], np[1], buf, sizeof buf) == 0);
    CHECK_MSG(!strcmp(buf, "1-2:2-4,4-5:2-4"), "%s", buf);
    int32_t owner[6 * 8];
    CHECK(shoal_shard_cover(3, (const shoal_proto_range *const *)parts, np, names, 6, is_moe, 8, owner, err,
                            sizeof err) == 0);
    CHECK(owner[0] == -1 && owner[1 * 8 + 0] == 0 && owner[1 * 8 + 4] == 1 && owner[5 * 8 + 7] == 2 &&
          owner[3 * 8 + 1] == -1);
    CHECK(shoal_shard_split(0, 9, 6, is_moe, 8, &r, &n, err, sizeof err) == SHOAL_EINVAL);
    /* gaps and overlaps, merged over layers (the non-MoE layer 3 between 2 and 4 is skipped) */
    shoal_proto_range b[] = {{1, 2, 3, 5}, {4, 5, 3, 5}, {5, 5, 7, 7}};
    shoal_proto_range a2[] = {{1, 2, 0, 3}, {4, 5, 0, 3}};
    shoal_proto_range *ab[2] = {a2, b};
    size_t nab[2] = {2, 3};
    CHECK(shoal_shard_cover(2, (const shoal_proto_range *const *)ab, nab, names, 6, is_moe, 8, owner, err,
                            sizeof err) == SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "layers 1-5 expert 3: owned by w0 and w1");
    CHECK_STR_CONTAINS(err, "layers 1-4 experts 6-7: owned by no worker");
    CHECK_STR_CONTAINS(err, "layer 5 expert 6: owned by no worker");
    CHECK_STR_CONTAINS(err, "(2 gaps, 1 overlap)");
    /* with replicas allowed the overlap is not an error; the gaps still are */
    size_t nrep = 99;
    CHECK(shoal_shard_cover_replicas(2, (const shoal_proto_range *const *)ab, nab, names, 6, is_moe, 8, owner, &nrep,
                                     err, sizeof err) == SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "(2 gaps):");
    CHECK_STR_CONTAINS(err, "layers 1-4 experts 6-7: owned by no worker");
    CHECK(strstr(err, "owned by w0 and w1") == NULL);
    CHECK_EQ_INT((int)nrep, 4); /* expert 3 of layers 1, 2, 4, 5 */
    shoal_proto_range full[] = {{1, 2, 0, 7}, {4, 5, 0, 7}};
    shoal_proto_range *fb[2] = {full, b};
    size_t nfb[2] = {2, 3};
    CHECK(shoal_shard_cover_replicas(2, (const shoal_proto_range *const *)fb, nfb, names, 6, is_moe, 8, owner, &nrep,
                                     err, sizeof err) == 0);
    CHECK_EQ_INT((int)nrep, 13); /* b: 3 experts x 4 layers + layer 5 expert 7 */
    CHECK(owner[1 * 8 + 3] == 0 && owner[5 * 8 + 7] == 0 && owner[3 * 8 + 3] == -1);
    for (int w = 0; w < 3; w++)
        free(parts[w]);
}

/* ---- fingerprint (expected value from tools/proto_golden.py) ------------- */

static void t_fingerprint(void)
{
    CHECK(golden_doc || (golden("ping", &(gmsg){0}) == 0));
    json_t *fpj = json_object_get(golden_doc, "fingerprint");
    const char *want = json_string_value(json_object_get(fpj, "blake2b_256"));
    CHECK(want != NULL);
    if (!want)
        return;
    shoal_k3cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_layers = 4;
    cfg.hidden_size = 96;
    cfg.vocab_size = 4096;
    cfg.latent_size = 64;
    cfg.moe_intermediate_size = 32;
    cfg.num_experts = 3;
    cfg.experts_per_token = 2;
    cfg.first_k_dense = 1;
    cfg.moe_layer_freq = 1;
    cfg.expert_format = SHOAL_EXPERTS_MXFP4;
    cfg.expert_group_size = 32;
    cfg.situ_beta = 0.1f;
    cfg.situ_linear_beta = 25.0f;
    cfg.is_moe[1] = cfg.is_moe[2] = cfg.is_moe[3] = 1;
    shoal_fprint f;
    shoal_fprint_begin(&f, &cfg);
    int d = 64, ff = 32;
    for (int l = 1; l <= 3; l++)
        for (int e = 0; e < 3; e++)
            for (int wi = 0; wi < 3; wi++) {
                int w = wi == 0 ? 1 : wi == 1 ? 3 : 2;
                int64_t rows = w == 2 ? d : ff, cols = w == 2 ? ff : d;
                char name[256];
                int64_t sp[2] = {rows, cols / 2}, ss[2] = {rows, cols / 32};
                snprintf(name, sizeof name, "language_model.model.layers.%d.block_sparse_moe.experts.%d.w%d.%s", l, e,
                         w, "weight_packed");
                shoal_fprint_tensor(&f, name, "U8", 2, sp, (uint64_t)(rows * cols / 2));
                snprintf(name, sizeof name, "language_model.model.layers.%d.block_sparse_moe.experts.%d.w%d.%s", l, e,
                         w, "weight_scale");
                shoal_fprint_tensor(&f, name, "U8", 2, ss, (uint64_t)(rows * cols / 32));
            }
    uint8_t out[32];
    char hex[65];
    shoal_fprint_end(&f, out);
    shoal_proto_hex(out, hex);
    CHECK_MSG(!strcmp(hex, want), "%s vs %s", hex, want);
    /* one changed constant changes it */
    cfg.situ_beta = 4.0f;
    shoal_fprint_begin(&f, &cfg);
    shoal_fprint_end(&f, out);
    shoal_proto_hex(out, hex);
    CHECK(strcmp(hex, want) != 0);
}

/* ---- a two-process exchange over a socketpair --------------------------- */
/* Framing over SOCK_SEQPACKET: one packet with the frame count, one per frame. */

static int sp_send(int fd, const shoal_frame *f, int n)
{
    uint32_t cnt = (uint32_t)n;
    if (send(fd, &cnt, 4, 0) != 4)
        return -1;
    for (int i = 0; i < n; i++)
        if (send(fd, f[i].data, f[i].len, 0) != (ssize_t)f[i].len)
            return -1;
    return 0;
}

static int sp_recv(int fd, uint8_t bufs[][4096], shoal_frame *f)
{
    uint32_t cnt;
    if (recv(fd, &cnt, 4, 0) != 4 || cnt > SHOAL_PROTO_MAX_FRAMES)
        return -1;
    for (uint32_t i = 0; i < cnt; i++) {
        ssize_t r = recv(fd, bufs[i], 4096, 0);
        if (r < 0)
            return -1;
        f[i] = (shoal_frame){bufs[i], (size_t)r};
    }
    return (int)cnt;
}

/* child: answers HELLO (checks fingerprint), EXPERT_BATCH (y = bf16 of act[t]
 * + expert id, per pair), errors for anything else; exits on SHUTDOWN. */
static int sp_child(int fd)
{
    static uint8_t bufs[SHOAL_PROTO_MAX_FRAMES][4096];
    uint8_t out[4096], y[4096];
    for (;;) {
        shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
        int n = sp_recv(fd, bufs, f);
        if (n < 0)
            return 1;
        shoal_proto_msg m = {0};
        int perr;
        char err[256];
        size_t len;
        shoal_frame rep[2];
        int nrep = 1;
        if (shoal_proto_decode(f, n, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err)) {
            shoal_proto_enc_error(out, sizeof out, &len, m.rid, perr, err);
        } else if (m.type == SHOAL_MSG_HELLO) {
            if (memcmp(m.hello.fingerprint, fp_test, 32)) {
                shoal_proto_enc_error(out, sizeof out, &len, m.rid, SHOAL_PERR_FINGERPRINT, "fingerprint");
            } else {
                shoal_proto_range own = {1, 1, 0, 7};
                shoal_proto_hello h = {.major = 1, .id = "child", .owned = &own, .nowned = 1,
                                       .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32),
                                       .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16), .max_tokens = 4, .isa = "scalar",
                                       .threads = 1};
                memcpy(h.fingerprint, fp_test, 32);
                shoal_proto_enc_hello(out, sizeof out, &len, m.rid, &h, 1);
            }
        } else if (m.type == SHOAL_MSG_EXPERT_BATCH) {
            uint8_t is_moe[2] = {0, 1};
            shoal_proto_limits lim = {.num_layers = 2, .is_moe = is_moe, .num_experts = 8, .k = 2, .d = 32,
                                      .max_tokens = 4, .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32),
                                      .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16)};
            int pe = shoal_proto_check_batch(&m, &lim, err, sizeof err);
            if (pe) {
                shoal_proto_enc_error(out, sizeof out, &len, m.rid, pe, err);
            } else {
                uint32_t np = m.batch.route.rows;
                shoal_proto_tensor_hdr(y, SHOAL_WIRE_BF16, np, 32);
                for (uint32_t i = 0; i < np; i++) {
                    int32_t t, e;
                    shoal_proto_route_pair(&m.batch.route, i, &t, &e);
                    for (int c = 0; c < 32; c++) {
                        float v;
                        memcpy(&v, m.batch.act.data + ((size_t)t * 32 + c) * 4, 4);
                        uint16_t b = shoal_f32_to_bf16(v + (float)e);
                        memcpy(y + 16 + ((size_t)i * 32 + c) * 2, &b, 2);
                    }
                }
                shoal_proto_enc_result(out, sizeof out, &len, m.rid, 1, 2);
                rep[1] = (shoal_frame){y, 16 + (size_t)np * 64};
                nrep = 2;
            }
        } else if (m.type == SHOAL_MSG_SHUTDOWN) {
            shoal_proto_enc_empty(out, sizeof out, &len, SHOAL_MSG_SHUTDOWN_ACK, m.rid);
            rep[0] = (shoal_frame){out, len};
            sp_send(fd, rep, 1);
            return 0;
        } else {
            shoal_proto_enc_empty(out, sizeof out, &len, SHOAL_MSG_PONG, m.rid);
        }
        shoal_proto_msg_clear(&m);
        rep[0] = (shoal_frame){out, len};
        if (sp_send(fd, rep, nrep))
            return 1;
    }
}

static void t_socketpair(void)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        _exit(sp_child(sv[1]));
    }
    close(sv[1]);
    int fd = sv[0];
    static uint8_t bufs[SHOAL_PROTO_MAX_FRAMES][4096];
    uint8_t out[4096];
    size_t len;
    shoal_frame f[3], rf[SHOAL_PROTO_MAX_FRAMES];
    shoal_proto_msg m = {0};
    int perr;
    char err[256];

    shoal_proto_hello h = {.major = 1, .id = "parent"};
    memcpy(h.fingerprint, fp_test, 32);
    CHECK(shoal_proto_enc_hello(out, sizeof out, &len, 1, &h, 0) == 0);
    f[0] = (shoal_frame){out, len};
    CHECK(sp_send(fd, f, 1) == 0);
    int n = sp_recv(fd, bufs, rf);
    CHECK(n == 1 && shoal_proto_decode(rf, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.type == SHOAL_MSG_HELLO && m.rid == 1 && !strcmp(m.hello.id, "child") && m.hello.nowned == 1);
    shoal_proto_msg_clear(&m);

    /* batch: 2 tokens, pairs (0,1) (0,6) (1,3) */
    uint8_t act[16 + 2 * 32 * 4], route[16 + 3 * 8];
    shoal_proto_tensor_hdr(act, SHOAL_WIRE_F32, 2, 32);
    for (int i = 0; i < 64; i++) {
        float v = (float)i * 0.5f;
        memcpy(act + 16 + 4 * i, &v, 4);
    }
    int32_t pairs[6] = {0, 1, 0, 6, 1, 3};
    shoal_proto_tensor_hdr(route, SHOAL_WIRE_I32, 3, 2);
    memcpy(route + 16, pairs, 24);
    CHECK(shoal_proto_enc_batch(out, sizeof out, &len, 2, 1, SHOAL_WIRE_BF16) == 0);
    f[0] = (shoal_frame){out, len};
    f[1] = (shoal_frame){act, sizeof act};
    f[2] = (shoal_frame){route, sizeof route};
    CHECK(sp_send(fd, f, 3) == 0);
    n = sp_recv(fd, bufs, rf);
    CHECK(n == 2 && shoal_proto_decode(rf, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.type == SHOAL_MSG_EXPERT_RESULT && m.rid == 2 && m.result.y.rows == 3 && m.result.y.cols == 32);
    if (m.result.y.rows == 3) {
        uint16_t b;
        memcpy(&b, m.result.y.data + (2 * 32 + 5) * 2, 2); /* pair 2: token 1 col 5 + expert 3 */
        CHECK(shoal_bf16_to_f32(b) == (float)(32 + 5) * 0.5f + 3.0f);
    }
    shoal_proto_msg_clear(&m);

    /* garbage and a wrong fingerprint: ERROR replies, the child keeps serving */
    static const uint8_t junk[] = {0xde, 0xad, 0xbe, 0xef};
    f[0] = (shoal_frame){junk, sizeof junk};
    CHECK(sp_send(fd, f, 1) == 0);
    n = sp_recv(fd, bufs, rf);
    CHECK(n == 1 && shoal_proto_decode(rf, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.type == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_MALFORMED);
    shoal_proto_msg_clear(&m);
    h.fingerprint[0] ^= 1;
    shoal_proto_enc_hello(out, sizeof out, &len, 3, &h, 0);
    f[0] = (shoal_frame){out, len};
    CHECK(sp_send(fd, f, 1) == 0);
    n = sp_recv(fd, bufs, rf);
    CHECK(n == 1 && shoal_proto_decode(rf, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.type == SHOAL_MSG_ERROR && m.error.code == SHOAL_PERR_FINGERPRINT && m.rid == 3);
    shoal_proto_msg_clear(&m);

    shoal_proto_enc_empty(out, sizeof out, &len, SHOAL_MSG_SHUTDOWN, 4);
    f[0] = (shoal_frame){out, len};
    CHECK(sp_send(fd, f, 1) == 0);
    n = sp_recv(fd, bufs, rf);
    CHECK(n == 1 && shoal_proto_decode(rf, n, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == 0);
    CHECK(m.type == SHOAL_MSG_SHUTDOWN_ACK && m.rid == 4);
    int st = -1;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    close(fd);
}

/* 1.5 PROBE / PROBE_REPLY (PROTOCOL.md §3.8): the C encoder gives the Python
 * msgpack bytes of golden.json, the decoder reads them back; refusals */
static void t_probe(void)
{
    gmsg g;
    uint8_t buf[1024];
    size_t len;
    shoal_proto_msg m;
    int perr;
    char err[256];
    memset(&m, 0, sizeof m);
    CHECK(golden("probe", &g) == 0);
    CHECK(shoal_proto_enc_probe(buf, sizeof buf, &len, 300, 8, 0) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_PROBE && m.rid == 300 && m.probe.reply == 8 && !m.probe.facts && m.probe.x.cols == 3);
    shoal_proto_msg_clear(&m);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO && perr == SHOAL_PERR_UNKNOWN_TYPE);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("probe_facts", &g) == 0);
    CHECK(shoal_proto_enc_probe(buf, sizeof buf, &len, 301, 4, 1) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.probe.reply == 4 && m.probe.facts == 1 && m.probe.x.cols == 1);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("probe_reply", &g) == 0);
    CHECK(shoal_proto_enc_probe_reply(buf, sizeof buf, &len, 300, NULL) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_PROBE_REPLY && !m.preply.facts.has && m.preply.y.cols == 2);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    shoal_proto_facts f = {.has = 1, .cpu = "AMD EPYC 9654 96-Core Processor", .isa = "avx512", .version = "0.1.0",
                           .cores = 192, .threads = 96, .mem_total = 1ull << 40, .mem_avail = 700ull << 30,
                           .disk_free = 3000000000000ull, .disk_total = 4000000000000ull, .read_bw_1 = 12000000000ull,
                           .read_bw_all = 380000000000ull, .disk_read_bw = 2500000000ull,
                           .held_bytes = 90400000000ull, .measure_us = 812345};
    CHECK(golden("probe_reply_facts", &g) == 0);
    CHECK(shoal_proto_enc_probe_reply(buf, sizeof buf, &len, 301, &f) == 0);
    CHECK(same_bytes(buf, len, g.data[0], g.len[0]));
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0);
    CHECK(m.preply.facts.has && !strcmp(m.preply.facts.cpu, f.cpu) && !strcmp(m.preply.facts.isa, "avx512") &&
          m.preply.facts.cores == 192 && m.preply.facts.threads == 96 && m.preply.facts.read_bw_all == f.read_bw_all &&
          m.preply.facts.disk_read_bw == f.disk_read_bw && m.preply.facts.held_bytes == f.held_bytes &&
          m.preply.facts.measure_us == 812345 && m.preply.facts.mem_avail == f.mem_avail);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    /* the encoder refuses a reply size that is not a multiple of 4 in 4 .. MAX_PROBE */
    CHECK(shoal_proto_enc_probe(buf, sizeof buf, &len, 1, 0, 0) == SHOAL_ERANGE);
    CHECK(shoal_proto_enc_probe(buf, sizeof buf, &len, 1, 6, 0) == SHOAL_ERANGE);
    CHECK(shoal_proto_enc_probe(buf, sizeof buf, &len, 1, SHOAL_PROTO_MAX_PROBE + 4, 0) == SHOAL_ERANGE);
    /* hand-made refusals: reply 6 (not a multiple of 4), reply 0, facts not a bool, bf16 x */
    uint8_t x[16 + 4], xb[16 + 2];
    CHECK(shoal_proto_tensor_hdr(x, SHOAL_WIRE_F32, 1, 1) == 0);
    CHECK(shoal_proto_tensor_hdr(xb, SHOAL_WIRE_BF16, 1, 1) == 0);
    memset(x + 16, 0, 4);
    memset(xb + 16, 0, 2);
    static const uint8_t r6[] = {0x93, 0x0e, 0x01, 0x81, 0xa5, 'r', 'e', 'p', 'l', 'y', 0x06};
    static const uint8_t r0[] = {0x93, 0x0e, 0x01, 0x81, 0xa5, 'r', 'e', 'p', 'l', 'y', 0x00};
    static const uint8_t r4[] = {0x93, 0x0e, 0x01, 0x81, 0xa5, 'r', 'e', 'p', 'l', 'y', 0x04};
    static const uint8_t fnum[] = {0x93, 0x0e, 0x01, 0x82, 0xa5, 'r', 'e', 'p', 'l', 'y', 0x04,
                                   0xa5, 'f',  'a',  'c',  't',  's', 0x01};
    struct {
        const uint8_t *c;
        size_t n;
        const uint8_t *t;
        size_t tn;
        const char *needle;
    } bad[] = {{r6, sizeof r6, x, sizeof x, "multiple of 4"},
               {r0, sizeof r0, x, sizeof x, "multiple of 4"},
               {fnum, sizeof fnum, x, sizeof x, "'facts' is not a boolean"},
               {r4, sizeof r4, xb, sizeof xb, "expected f32 [1, n]"},
               {r4, sizeof r4, NULL, 0, "frames"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        shoal_frame fr[2] = {{bad[i].c, bad[i].n}, {bad[i].t, bad[i].tn}};
        memset(&m, 0, sizeof m);
        err[0] = 0;
        int rc = shoal_proto_decode(fr, bad[i].t ? 2 : 1, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err);
        CHECK_MSG(rc == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED, "bad probe %zu: rc %d perr %d %s", i, rc, perr,
                  err);
        CHECK_STR_CONTAINS(err, bad[i].needle);
        shoal_proto_msg_clear(&m);
    }
}

/* ---- 1.8 relay tree (PROTOCOL.md §3.9) ---------------------------------- */

static int enc_same(const char *name, int rc, const uint8_t *buf, size_t len)
{
    gmsg g;
    if (rc || golden(name, &g)) {
        fprintf(stderr, "  %s: encode rc %d or no golden\n", name, rc);
        return 0;
    }
    int ok = same_bytes(buf, len, g.data[0], g.len[0]);
    gfree(&g);
    return ok;
}

/* Decode golden `name` with its frames, minus `drop` trailing frames, plus
 * `add` copies of its last frame. */
static int dec_golden_frames(const char *name, int drop, int add, shoal_proto_side side, shoal_proto_msg *m,
                             int *perr, char *err)
{
    gmsg g;
    if (golden(name, &g))
        return -1000;
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES + 1];
    to_frames(&g, f);
    int n = g.n - drop;
    for (int i = 0; i < add; i++, n++)
        f[n] = f[g.n - 1];
    memset(m, 0, sizeof *m);
    int rc = shoal_proto_decode(f, n, side, m, perr, err, 256);
    gfree(&g); /* nothing of m is allocated (no HELLO here); the checks read only its fixed fields */
    return rc;
}

static const shoal_proto_trows relay_mats[1] = {{"language_model.model.layers.3.self_attn.q_proj.weight", 0, 2}};

static void t_relay_codec(void)
{
    uint8_t buf[8192];
    size_t len = 0;
#define ENC_SAME(name, call)                                                                                           \
    do {                                                                                                               \
        int rc_ = (call); /* before len is read */                                                                     \
        CHECK(enc_same(name, rc_, buf, len));                                                                          \
    } while (0)
    /* encoding: the Python bytes */
    shoal_proto_hello h = {.major = 1, .minor = 8, .relay_parent = 1};
    memcpy(h.fingerprint, fp_test, 32);
    strcpy(h.id, "w0");
    ENC_SAME("hello_request_relay", shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 0));
    shoal_proto_range owned[2] = {{1, 8, 0, 11}, {2, 2, 300, 70000}};
    shoal_proto_hello r = {.major = 1, .minor = 8, .owned = owned, .nowned = 2, .max_tokens = 8192, .threads = 2,
                           .expert_bytes = 17547264ull * 448, .mem_total = 25769803776ull, .nrelay = 3};
    memcpy(r.fingerprint, fp_test, 32);
    r.act_mask = r.out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32) | SHOAL_WIRE_MASK(SHOAL_WIRE_BF16);
    strcpy(r.id, "w1");
    strcpy(r.isa, "avx2");
    strcpy(r.relay[0], "ipc:///run/user/1000/shoal-a/w0");
    strcpy(r.relay[1], "tcp://10.0.0.2:5555");
    strcpy(r.relay[2], "tcp://[fd00::3]:5555");
    ENC_SAME("hello_reply_relay", shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &r, 1));
    shoal_proto_relay rl = {.xid = (1ull << 40) + 5, .wait_ms = 2000};
    ENC_SAME("trunk_batch_relayed", shoal_proto_enc_tbatch_relay(buf, sizeof buf, &len, 10, 3, relay_mats, 1, NULL, 0, &rl));
    shoal_proto_relay root = rl;
    root.nfwd = 4;
    root.fwd[0] = (shoal_proto_fwd){1, 0};
    root.fwd[1] = (shoal_proto_fwd){2, 0};
    root.fwd[2] = (shoal_proto_fwd){3, 1};
    root.fwd[3] = (shoal_proto_fwd){5, 3};
    ENC_SAME("trunk_batch_root", shoal_proto_enc_tbatch_relay(buf, sizeof buf, &len, 11, 3, relay_mats, 1, NULL, 0, &root));
    /* the subtree the root forwards to its first child (peer 1) is the golden TRUNK_X's */
    shoal_proto_relay sub = rl;
    sub.nfwd = shoal_proto_fwd_subtree(root.fwd, root.nfwd, 0, sub.fwd);
    CHECK(sub.nfwd == 2 && sub.fwd[0].peer == 3 && sub.fwd[0].up == 0 && sub.fwd[1].peer == 5 && sub.fwd[1].up == 1);
    ENC_SAME("trunk_x", shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &sub));
    shoal_proto_fwd out[SHOAL_PROTO_MAX_RELAY];
    CHECK(shoal_proto_fwd_subtree(root.fwd, root.nfwd, 1, out) == 0); /* peer 2 is a leaf */
    CHECK(shoal_proto_fwd_subtree(root.fwd, root.nfwd, 2, out) == 1 && out[0].peer == 5 && out[0].up == 0);
    shoal_proto_relay leaf = {.xid = 7, .wait_ms = 60000};
    ENC_SAME("trunk_x_leaf", shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &leaf));
    /* a chain of 64: every entry below the one before; the subtree of entry i has 63 - i entries */
    shoal_proto_fwd line[SHOAL_PROTO_MAX_RELAY];
    for (int i = 0; i < SHOAL_PROTO_MAX_RELAY; i++)
        line[i] = (shoal_proto_fwd){(uint8_t)(63 - i), (uint8_t)i};
    CHECK(shoal_proto_fwd_check(line, 64) == 0);
    CHECK(shoal_proto_fwd_subtree(line, 64, 0, out) == 63 && out[0].peer == 62 && out[0].up == 0 &&
          out[62].peer == 0 && out[62].up == 62);
    CHECK(shoal_proto_fwd_subtree(line, 64, 63, out) == 0);

    /* encoder refusals: bounds of xid, wait_ms, fwd */
    shoal_proto_relay bad = rl;
    bad.wait_ms = 0;
    CHECK(shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &bad) == SHOAL_ERANGE);
    bad.wait_ms = SHOAL_PROTO_MAX_WAIT_MS + 1;
    CHECK(shoal_proto_enc_tbatch_relay(buf, sizeof buf, &len, 1, 3, relay_mats, 1, NULL, 0, &bad) == SHOAL_ERANGE);
    bad = root;
    bad.fwd[2].up = 3; /* its own position + 1: not an earlier entry */
    CHECK(shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &bad) == SHOAL_ERANGE);
    bad = root;
    bad.fwd[3].peer = 1; /* twice */
    CHECK(shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &bad) == SHOAL_ERANGE);
    bad = root;
    bad.fwd[0].peer = SHOAL_PROTO_MAX_RELAY;
    CHECK(shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &bad) == SHOAL_ERANGE);
    bad = rl;
    bad.xid = 0;
    CHECK(shoal_proto_enc_trunk_x(buf, sizeof buf, &len, &bad) == SHOAL_ERANGE);
    /* xid 0 on a TRUNK_BATCH: not relayed, the 1.7 bytes */
    CHECK(shoal_proto_enc_tbatch_relay(buf, sizeof buf, &len, 1, 3, relay_mats, 1, NULL, 0, &bad) == 0);

    /* decoding the Python bytes */
    shoal_proto_msg m;
    int perr;
    char err[256];
    gmsg g;
    CHECK(golden("hello_request_relay", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0 && m.hello.relay_parent == 1 &&
          !strcmp(m.hello.id, "w0"));
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_request", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_WORKER, &m, &perr, err) == 0 && m.hello.relay_parent == 0);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply_relay", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0 && m.hello.nrelay == 3 &&
          !strcmp(m.hello.relay[2], "tcp://[fd00::3]:5555") && m.hello.minor == 8 && m.hello.nowned == 2);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(golden("hello_reply", &g) == 0);
    CHECK(decode_g(&g, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == 0 && m.hello.nrelay == 0);
    shoal_proto_msg_clear(&m);
    gfree(&g);
    CHECK(dec_golden_frames("trunk_batch_relayed", 0, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_BATCH && m.tbatch.relay.xid == (1ull << 40) + 5 && m.tbatch.relay.wait_ms == 2000 &&
          m.tbatch.relay.nfwd == 0 && m.tbatch.has_x == 0 && m.tbatch.n == 1);
    CHECK(dec_golden_frames("trunk_batch_root", 0, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.tbatch.has_x == 1 && m.tbatch.x.rows == 2 && m.tbatch.x.cols == 32 && m.tbatch.relay.nfwd == 4 &&
          m.tbatch.relay.fwd[3].peer == 5 && m.tbatch.relay.fwd[3].up == 3);
    CHECK(dec_golden_frames("trunk_batch", 0, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.tbatch.relay.xid == 0 && m.tbatch.has_x == 1);
    CHECK(dec_golden_frames("trunk_x", 0, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.type == SHOAL_MSG_TRUNK_X && m.rid == 0 && m.trunkx.relay.nfwd == 2 && m.trunkx.x.dtype == SHOAL_WIRE_F32 &&
          m.trunkx.x.rows == 2);
    CHECK(dec_golden_frames("trunk_x_leaf", 0, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == 0);
    CHECK(m.trunkx.relay.xid == 7 && m.trunkx.relay.wait_ms == 60000 && m.trunkx.relay.nfwd == 0 &&
          m.trunkx.x.dtype == SHOAL_WIRE_BF16);
    /* frame counts: a relayed request carries no x, a root and a TRUNK_X one */
    CHECK(dec_golden_frames("trunk_batch_relayed", 0, 1, SHOAL_SIDE_WORKER, &m, &perr, err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED);
    CHECK(dec_golden_frames("trunk_batch_root", 1, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED);
    CHECK(dec_golden_frames("trunk_x", 1, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED);
    CHECK(dec_golden_frames("trunk_batch", 1, 0, SHOAL_SIDE_WORKER, &m, &perr, err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_MALFORMED); /* not relayed: x required as in 1.3 */
    /* TRUNK_X is not a reply */
    CHECK(dec_golden_frames("trunk_x", 0, 0, SHOAL_SIDE_COORDINATOR, &m, &perr, err) == SHOAL_EPROTO &&
          perr == SHOAL_PERR_UNKNOWN_TYPE);

    /* bodies out of bounds, written with the encoder's bytes edited where the
     * encoder itself refuses (so the decoder's own checks are what is tested) */
    static const struct {
        const char *what;
        const uint8_t b[40];
        size_t n;
    } rb[] = {
        /* [16, 0, {xid: 0, wait_ms: 1}] */
        {"xid 0", {0x93, 0x10, 0x00, 0x82, 0xa3, 'x', 'i', 'd', 0x00, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01}, 18},
        /* wait_ms 0 */
        {"wait 0", {0x93, 0x10, 0x00, 0x82, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x00}, 18},
        /* wait_ms 60001 (0xcd ea 61) */
        {"wait 60001",
         {0x93, 0x10, 0x00, 0x82, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0xcd, 0xea, 0x61},
         20},
        /* xid without wait_ms */
        {"no wait", {0x93, 0x10, 0x00, 0x81, 0xa3, 'x', 'i', 'd', 0x01}, 9},
        /* fwd [[1, 1]]: up names itself */
        {"up self",
         {0x93, 0x10, 0x00, 0x83, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01, 0xa3, 'f',
          'w', 'd', 0x91, 0x92, 0x01, 0x01},
         26},
        /* fwd [[1, 0], [1, 0]]: a peer twice */
        {"peer twice",
         {0x93, 0x10, 0x00, 0x83, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01, 0xa3, 'f',
          'w', 'd', 0x92, 0x92, 0x01, 0x00, 0x92, 0x01, 0x00},
         29},
        /* fwd [[64, 0]]: peer out of range */
        {"peer 64",
         {0x93, 0x10, 0x00, 0x83, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01, 0xa3, 'f',
          'w', 'd', 0x91, 0x92, 0x40, 0x00},
         26},
        /* fwd []: empty */
        {"fwd empty",
         {0x93, 0x10, 0x00, 0x83, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01, 0xa3, 'f',
          'w', 'd', 0x90},
         23},
        /* fwd [[1, -1]]: negative */
        {"up -1",
         {0x93, 0x10, 0x00, 0x83, 0xa3, 'x', 'i', 'd', 0x01, 0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01, 0xa3, 'f',
          'w', 'd', 0x91, 0x92, 0x01, 0xff},
         26},
    };
    uint8_t xf[16 + 4];
    shoal_proto_tensor_hdr(xf, SHOAL_WIRE_F32, 1, 1);
    memset(xf + 16, 0, 4);
    for (size_t i = 0; i < sizeof rb / sizeof rb[0]; i++) {
        shoal_frame f[2] = {{rb[i].b, rb[i].n}, {xf, sizeof xf}};
        memset(&m, 0, sizeof m);
        int rc = shoal_proto_decode(f, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err);
        if (rc != SHOAL_EPROTO || perr != SHOAL_PERR_MALFORMED)
            fprintf(stderr, "  TRUNK_X case '%s' not refused (rc %d, perr %d)\n", rb[i].what, rc, perr);
        CHECK(rc == SHOAL_EPROTO && perr == SHOAL_PERR_MALFORMED);
        shoal_proto_msg_clear(&m);
    }
    /* the same keys are checked on a TRUNK_BATCH: wait_ms without xid */
    {
        uint8_t b[256];
        CHECK(shoal_proto_enc_tbatch(b, sizeof b, &len, 1, 3, relay_mats, 1, NULL, 0) == 0);
        /* the map header is the 4th byte (fixmap of 2): add a key 'wait_ms': 1 */
        CHECK(b[3] == 0x82);
        b[3] = 0x83;
        static const uint8_t extra[] = {0xa7, 'w', 'a', 'i', 't', '_', 'm', 's', 0x01};
        memcpy(b + len, extra, sizeof extra);
        shoal_frame f[2] = {{b, len + sizeof extra}, {xf, sizeof xf}};
        memset(&m, 0, sizeof m);
        CHECK(shoal_proto_decode(f, 2, SHOAL_SIDE_WORKER, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
              perr == SHOAL_PERR_MALFORMED);
        shoal_proto_msg_clear(&m);
    }
    /* HELLO 'relay' of a reply: not a list, an empty list, 65 entries, an endpoint with a space */
    {
        shoal_proto_hello rr = r;
        rr.nrelay = 1;
        strcpy(rr.relay[0], "tcp://a b");
        CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &rr, 1) == 0); /* the encoder does not judge bytes */
        shoal_frame f = {buf, len};
        memset(&m, 0, sizeof m);
        CHECK(shoal_proto_decode(&f, 1, SHOAL_SIDE_COORDINATOR, &m, &perr, err, sizeof err) == SHOAL_EPROTO &&
              perr == SHOAL_PERR_MALFORMED);
        shoal_proto_msg_clear(&m);
        rr.nrelay = SHOAL_PROTO_MAX_RELAY + 1;
        CHECK(shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &rr, 1) == SHOAL_ERANGE);
    }
}

int main(void)
{
    test_binary = "test_proto";
    init_fp();
    RUN(t_hand_golden);
    RUN(t_golden_encode);
    RUN(t_golden_decode);
    RUN(t_trunk_decode);
    RUN(t_trunk_fingerprint);
    RUN(t_roundtrip);
    RUN(t_refusals);
    RUN(t_check_batch);
    RUN(t_shard);
    RUN(t_fingerprint);
    RUN(t_socketpair);
    RUN(t_probe);
    RUN(t_relay_codec);
    if (golden_doc)
        json_decref(golden_doc);
    return test_finish();
}
