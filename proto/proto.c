/* Encode/decode of PROTOCOL.md messages over byte buffers (see proto.h).
 *
 * Decoding is two passes: scan() walks the MessagePack structure first and
 * refuses any container that declares more elements than bytes remain (msgpack-c
 * would otherwise allocate count × sizeof(msgpack_object) up front, so a 5-byte
 * frame could ask for gigabytes), nesting deeper than the protocol uses, or a
 * truncated value; only then msgpack-c builds the object tree in a zone that is
 * freed with the call. */
#include "proto/proto.h"

#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "shoal's wire format is little-endian; "
                                                          "a big-endian host needs byte swapping");

#define MAX_DEPTH 4 /* envelope, body, a list, its items (PROTOCOL.md §2.1) */

static const char tensor_magic[4] = {'S', 'H', 'T', 'F'};

const char *shoal_msg_type_name(int type)
{
    static const char *names[] = {"?",           "HELLO",    "ERROR",        "PING",         "PONG",         "STATS",
                                  "STATS_REPLY", "SHUTDOWN", "SHUTDOWN_ACK", "EXPERT_BATCH", "EXPERT_RESULT", "PREFETCH",
                                  "TRUNK_BATCH", "TRUNK_RESULT", "PROBE", "PROBE_REPLY", "TRUNK_X"};
    return type >= 1 && type <= SHOAL_MSG_TRUNK_X ? names[type] : "?";
}

const char *shoal_perr_name(int perr)
{
    switch (perr) {
#define SHOAL_PERR_NAME(name, val, code)                                                                               \
    case val: return #name;
        SHOAL_PERR_MAP(SHOAL_PERR_NAME)
#undef SHOAL_PERR_NAME
    default: return "?";
    }
}

int shoal_perr_to_err(int perr)
{
    switch (perr) {
#define SHOAL_PERR_CODE(name, val, code)                                                                               \
    case val: return code;
        SHOAL_PERR_MAP(SHOAL_PERR_CODE)
#undef SHOAL_PERR_CODE
    default: return SHOAL_EPEER;
    }
}

size_t shoal_wire_dtype_size(int dt)
{
    switch (dt) {
    case SHOAL_WIRE_F32:
    case SHOAL_WIRE_I32: return 4;
    case SHOAL_WIRE_BF16: return 2;
    default: return 0;
    }
}

const char *shoal_wire_dtype_name(int dt)
{
    switch (dt) {
    case SHOAL_WIRE_F32: return "f32";
    case SHOAL_WIRE_BF16: return "bf16";
    case SHOAL_WIRE_I32: return "i32";
    default: return "?";
    }
}

static int wire_dtype_parse(const char *s, size_t n)
{
    if (n == 3 && !memcmp(s, "f32", 3))
        return SHOAL_WIRE_F32;
    if (n == 4 && !memcmp(s, "bf16", 4))
        return SHOAL_WIRE_BF16;
    return 0;
}

void shoal_proto_msg_clear(shoal_proto_msg *m)
{
    if (!m)
        return;
    free(m->hello.owned);
    free(m->hello.trunk);
    memset(m, 0, sizeof *m);
}

void shoal_proto_hex(const uint8_t fp[SHOAL_PROTO_FP_BYTES], char out[2 * SHOAL_PROTO_FP_BYTES + 1])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < SHOAL_PROTO_FP_BYTES; i++) {
        out[2 * i] = hx[fp[i] >> 4];
        out[2 * i + 1] = hx[fp[i] & 15];
    }
    out[2 * SHOAL_PROTO_FP_BYTES] = 0;
}

/* ---- encoding ---------------------------------------------------------- */

typedef struct {
    uint8_t *buf;
    size_t cap, len;
    int overflow;
} wbuf;

static int wb_write(void *data, const char *p, size_t n)
{
    wbuf *w = data;
    if (w->overflow || n > w->cap - w->len) {
        w->overflow = 1;
        return -1;
    }
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}

typedef struct {
    wbuf w;
    msgpack_packer pk;
} enc;

static void enc_init(enc *e, uint8_t *buf, size_t cap)
{
    e->w = (wbuf){.buf = buf, .cap = cap};
    msgpack_packer_init(&e->pk, &e->w, wb_write);
}

static void enc_key(enc *e, const char *k)
{
    size_t n = strlen(k);
    msgpack_pack_str(&e->pk, n);
    msgpack_pack_str_body(&e->pk, k, n);
}

static void enc_str(enc *e, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(&e->pk, n);
    msgpack_pack_str_body(&e->pk, s, n);
}

static void enc_ku64(enc *e, const char *k, uint64_t v)
{
    enc_key(e, k);
    msgpack_pack_uint64(&e->pk, v);
}

/* [type, rid, {<nkeys> ...}] header */
static void enc_head(enc *e, int type, uint64_t rid, size_t nkeys)
{
    msgpack_pack_array(&e->pk, 3);
    msgpack_pack_uint64(&e->pk, (uint64_t)type);
    msgpack_pack_uint64(&e->pk, rid);
    msgpack_pack_map(&e->pk, nkeys);
}

static int enc_done(enc *e, size_t *len)
{
    if (e->w.overflow)
        return SHOAL_ERANGE;
    *len = e->w.len;
    return 0;
}

static void enc_dtype_list(enc *e, uint32_t mask, const int *order, int n)
{
    int cnt = 0;
    for (int i = 0; i < n; i++)
        cnt += (mask & SHOAL_WIRE_MASK(order[i])) != 0;
    msgpack_pack_array(&e->pk, (size_t)cnt);
    for (int i = 0; i < n; i++)
        if (mask & SHOAL_WIRE_MASK(order[i]))
            enc_str(e, shoal_wire_dtype_name(order[i]));
}

int shoal_proto_enc_hello(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_hello *h, int reply)
{
    if (strlen(h->id) > SHOAL_PROTO_MAX_ID || (reply && h->nowned > SHOAL_PROTO_MAX_RANGES) ||
        (reply && h->ntrunk > SHOAL_PROTO_MAX_TROWS) || (reply && h->nrelay > SHOAL_PROTO_MAX_RELAY))
        return SHOAL_ERANGE;
    for (uint32_t i = 0; reply && i < h->nrelay; i++)
        if (!h->relay[i][0] || strnlen(h->relay[i], SHOAL_PROTO_MAX_ENDPOINT + 1) > SHOAL_PROTO_MAX_ENDPOINT)
            return SHOAL_ERANGE;
    for (size_t i = 0; reply && i < h->ntrunk; i++)
        if (strlen(h->trunk[i].name) > SHOAL_PROTO_MAX_NAME || h->trunk[i].lo > h->trunk[i].hi)
            return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    int numerics = reply && h->numerics[0] && strcmp(h->numerics, "portable");
    if (strlen(h->numerics) > SHOAL_PROTO_MAX_NUMERICS)
        return SHOAL_ERANGE;
    enc_head(&e, SHOAL_MSG_HELLO, rid,
             reply ? 11 + (h->prefetch != 0) + 2 * (h->ntrunk > 0) + numerics + (h->bf16_exact != 0) + (h->nrelay > 0)
                   : 3 + (h->relay_parent != 0));
    enc_key(&e, "proto");
    msgpack_pack_array(&e.pk, 2);
    msgpack_pack_uint32(&e.pk, h->major);
    msgpack_pack_uint32(&e.pk, h->minor);
    enc_key(&e, "fingerprint");
    msgpack_pack_bin(&e.pk, SHOAL_PROTO_FP_BYTES);
    msgpack_pack_bin_body(&e.pk, h->fingerprint, SHOAL_PROTO_FP_BYTES);
    if (!reply) {
        enc_key(&e, "peer");
        enc_str(&e, h->id);
        if (h->relay_parent) {
            enc_key(&e, "relay");
            msgpack_pack_true(&e.pk);
        }
        return enc_done(&e, len);
    }
    enc_key(&e, "worker");
    enc_str(&e, h->id);
    enc_key(&e, "owned");
    msgpack_pack_array(&e.pk, h->nowned);
    for (size_t i = 0; i < h->nowned; i++) {
        msgpack_pack_array(&e.pk, 4);
        msgpack_pack_uint32(&e.pk, h->owned[i].l_lo);
        msgpack_pack_uint32(&e.pk, h->owned[i].l_hi);
        msgpack_pack_uint32(&e.pk, h->owned[i].e_lo);
        msgpack_pack_uint32(&e.pk, h->owned[i].e_hi);
    }
    static const int act_order[] = {SHOAL_WIRE_F32, SHOAL_WIRE_BF16};
    static const int out_order[] = {SHOAL_WIRE_BF16, SHOAL_WIRE_F32};
    enc_key(&e, "act");
    enc_dtype_list(&e, h->act_mask, act_order, 2);
    enc_key(&e, "out");
    enc_dtype_list(&e, h->out_mask, out_order, 2);
    enc_ku64(&e, "max_tokens", h->max_tokens);
    enc_key(&e, "isa");
    enc_str(&e, h->isa);
    enc_ku64(&e, "threads", h->threads);
    enc_ku64(&e, "expert_bytes", h->expert_bytes);
    enc_ku64(&e, "mem_total", h->mem_total);
    if (h->prefetch) {
        enc_key(&e, "prefetch");
        msgpack_pack_true(&e.pk);
    }
    if (h->ntrunk) {
        enc_key(&e, "trunk");
        msgpack_pack_array(&e.pk, h->ntrunk);
        for (size_t i = 0; i < h->ntrunk; i++) {
            msgpack_pack_array(&e.pk, 3);
            enc_str(&e, h->trunk[i].name);
            msgpack_pack_uint32(&e.pk, h->trunk[i].lo);
            msgpack_pack_uint32(&e.pk, h->trunk[i].hi);
        }
        enc_key(&e, "trunk_fp");
        msgpack_pack_bin(&e.pk, SHOAL_PROTO_FP_BYTES);
        msgpack_pack_bin_body(&e.pk, h->trunk_fp, SHOAL_PROTO_FP_BYTES);
    }
    if (numerics) {
        enc_key(&e, "numerics");
        enc_str(&e, h->numerics);
    }
    if (h->bf16_exact) {
        enc_key(&e, "bf16_exact");
        msgpack_pack_true(&e.pk);
    }
    if (h->nrelay) {
        enc_key(&e, "relay");
        msgpack_pack_array(&e.pk, h->nrelay);
        for (uint32_t i = 0; i < h->nrelay; i++)
            enc_str(&e, h->relay[i]);
    }
    return enc_done(&e, len);
}

int shoal_proto_enc_error(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, int code, const char *message)
{
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_ERROR, rid, 2);
    enc_ku64(&e, "code", (uint64_t)code);
    enc_key(&e, "message");
    size_t n = strlen(message);
    if (n > SHOAL_PROTO_MAX_TEXT)
        n = SHOAL_PROTO_MAX_TEXT; /* a long message is cut, never refused */
    msgpack_pack_str(&e.pk, n);
    msgpack_pack_str_body(&e.pk, message, n);
    return enc_done(&e, len);
}

int shoal_proto_enc_empty(uint8_t *buf, size_t cap, size_t *len, int type, uint64_t rid)
{
    if (type != SHOAL_MSG_PING && type != SHOAL_MSG_PONG && type != SHOAL_MSG_STATS && type != SHOAL_MSG_SHUTDOWN &&
        type != SHOAL_MSG_SHUTDOWN_ACK)
        return SHOAL_EINVAL;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, type, rid, 0);
    return enc_done(&e, len);
}

int shoal_proto_enc_stats(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_stats *s)
{
    if (strlen(s->worker) > SHOAL_PROTO_MAX_ID)
        return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_STATS_REPLY, rid, 11);
    enc_key(&e, "worker");
    enc_str(&e, s->worker);
    enc_ku64(&e, "uptime_us", s->uptime_us);
    enc_ku64(&e, "requests", s->requests);
    enc_ku64(&e, "errors", s->errors);
    enc_ku64(&e, "batches", s->batches);
    enc_ku64(&e, "tokens", s->tokens);
    enc_ku64(&e, "pairs", s->pairs);
    enc_ku64(&e, "bytes_in", s->bytes_in);
    enc_ku64(&e, "bytes_out", s->bytes_out);
    enc_ku64(&e, "queue_us", s->queue_us);
    enc_ku64(&e, "compute_us", s->compute_us);
    return enc_done(&e, len);
}

int shoal_proto_enc_batch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer, int out_dtype)
{
    if (out_dtype != SHOAL_WIRE_BF16 && out_dtype != SHOAL_WIRE_F32)
        return SHOAL_EINVAL;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_EXPERT_BATCH, rid, 2);
    enc_ku64(&e, "layer", layer);
    enc_key(&e, "out");
    enc_str(&e, shoal_wire_dtype_name(out_dtype));
    return enc_done(&e, len);
}

int shoal_proto_enc_result(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint64_t queue_us, uint64_t compute_us)
{
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_EXPERT_RESULT, rid, 2);
    enc_ku64(&e, "queue_us", queue_us);
    enc_ku64(&e, "compute_us", compute_us);
    return enc_done(&e, len);
}

int shoal_proto_enc_prefetch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                             const uint32_t *experts, uint32_t n)
{
    if (n > SHOAL_PROTO_MAX_PREFETCH)
        return SHOAL_ERANGE;
    for (uint32_t i = 1; i < n; i++)
        if (experts[i] <= experts[i - 1])
            return SHOAL_EINVAL;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_PREFETCH, rid, 2);
    enc_ku64(&e, "layer", layer);
    enc_key(&e, "experts");
    msgpack_pack_array(&e.pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint32(&e.pk, experts[i]);
    return enc_done(&e, len);
}

static int name_ok(const char *name)
{
    return name[0] && strlen(name) <= SHOAL_PROTO_MAX_NAME;
}

int shoal_proto_fwd_check(const shoal_proto_fwd *fwd, uint32_t nfwd)
{
    if (nfwd > SHOAL_PROTO_MAX_RELAY)
        return SHOAL_ERANGE;
    uint64_t seen = 0;
    for (uint32_t i = 0; i < nfwd; i++) {
        if (fwd[i].peer >= SHOAL_PROTO_MAX_RELAY || fwd[i].up > i || (seen >> fwd[i].peer & 1u))
            return SHOAL_ERANGE;
        seen |= (uint64_t)1 << fwd[i].peer;
    }
    return 0;
}

uint32_t shoal_proto_fwd_subtree(const shoal_proto_fwd *fwd, uint32_t n, uint32_t e, shoal_proto_fwd *out)
{
    /* pos[i]: 1 + the position of entry i in out (0: not in the subtree);
     * entry e itself is the new receiver (position "0") */
    uint8_t pos[SHOAL_PROTO_MAX_RELAY] = {0};
    uint32_t m = 0;
    for (uint32_t i = e + 1; i < n && i < SHOAL_PROTO_MAX_RELAY; i++) {
        uint32_t up = fwd[i].up;
        if (up == e + 1) { /* a child of e: a child of the new receiver */
            out[m] = (shoal_proto_fwd){fwd[i].peer, 0};
            pos[i] = (uint8_t)++m;
        } else if (up > e + 1 && pos[up - 1]) { /* below one of e's descendants */
            out[m] = (shoal_proto_fwd){fwd[i].peer, pos[up - 1]};
            pos[i] = (uint8_t)++m;
        }
    }
    return m;
}

static int relay_ok(const shoal_proto_relay *r)
{
    return r->xid >= 1 && r->wait_ms >= 1 && r->wait_ms <= SHOAL_PROTO_MAX_WAIT_MS && !shoal_proto_fwd_check(r->fwd, r->nfwd);
}

static void enc_relay(enc *e, const shoal_proto_relay *r)
{
    enc_ku64(e, "xid", r->xid);
    enc_ku64(e, "wait_ms", r->wait_ms);
    if (r->nfwd) {
        enc_key(e, "fwd");
        msgpack_pack_array(&e->pk, r->nfwd);
        for (uint32_t i = 0; i < r->nfwd; i++) {
            msgpack_pack_array(&e->pk, 2);
            msgpack_pack_uint32(&e->pk, r->fwd[i].peer);
            msgpack_pack_uint32(&e->pk, r->fwd[i].up);
        }
    }
}

int shoal_proto_enc_trunk_x(uint8_t *buf, size_t cap, size_t *len, const shoal_proto_relay *r)
{
    if (!relay_ok(r))
        return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_TRUNK_X, 0, 2 + (r->nfwd > 0));
    enc_relay(&e, r);
    return enc_done(&e, len);
}

int shoal_proto_enc_tbatch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                           const shoal_proto_trows *seg, uint32_t n, const shoal_proto_tchain *chain,
                           uint32_t nchain)
{
    return shoal_proto_enc_tbatch_relay(buf, cap, len, rid, layer, seg, n, chain, nchain, NULL);
}

int shoal_proto_enc_tbatch_relay(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                                 const shoal_proto_trows *seg, uint32_t n, const shoal_proto_tchain *chain,
                                 uint32_t nchain, const shoal_proto_relay *r)
{
    if (r && !r->xid)
        r = NULL;
    if (n > SHOAL_PROTO_MAX_TSEGS || nchain > SHOAL_PROTO_MAX_TCHAIN || n + nchain < 1 || (r && !relay_ok(r)))
        return SHOAL_ERANGE;
    for (uint32_t i = 0; i < n; i++)
        if (!name_ok(seg[i].name) || seg[i].lo > seg[i].hi)
            return SHOAL_ERANGE;
    for (uint32_t i = 0; i < nchain; i++)
        if (!name_ok(chain[i].a) || !name_ok(chain[i].b.name) || chain[i].b.lo > chain[i].b.hi)
            return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_TRUNK_BATCH, rid, (nchain ? 3 : 2) + (r ? 2 + (r->nfwd > 0) : 0));
    enc_ku64(&e, "layer", layer);
    enc_key(&e, "mats");
    msgpack_pack_array(&e.pk, n);
    for (uint32_t i = 0; i < n; i++) {
        msgpack_pack_array(&e.pk, 3);
        enc_str(&e, seg[i].name);
        msgpack_pack_uint32(&e.pk, seg[i].lo);
        msgpack_pack_uint32(&e.pk, seg[i].hi);
    }
    if (nchain) {
        enc_key(&e, "chain");
        msgpack_pack_array(&e.pk, nchain);
        for (uint32_t i = 0; i < nchain; i++) {
            msgpack_pack_array(&e.pk, 4);
            enc_str(&e, chain[i].a);
            enc_str(&e, chain[i].b.name);
            msgpack_pack_uint32(&e.pk, chain[i].b.lo);
            msgpack_pack_uint32(&e.pk, chain[i].b.hi);
        }
    }
    if (r)
        enc_relay(&e, r);
    return enc_done(&e, len);
}

int shoal_proto_enc_tresult(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint64_t queue_us,
                            uint64_t compute_us)
{
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_TRUNK_RESULT, rid, 2);
    enc_ku64(&e, "queue_us", queue_us);
    enc_ku64(&e, "compute_us", compute_us);
    return enc_done(&e, len);
}

int shoal_proto_enc_probe(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t reply, int facts)
{
    if (reply < 4 || reply % 4 || reply > SHOAL_PROTO_MAX_PROBE)
        return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_PROBE, rid, facts ? 2 : 1);
    enc_ku64(&e, "reply", reply);
    if (facts) {
        enc_key(&e, "facts");
        msgpack_pack_true(&e.pk);
    }
    return enc_done(&e, len);
}

int shoal_proto_enc_probe_reply(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_facts *f)
{
    int has = f && f->has;
    if (has && (strlen(f->cpu) > SHOAL_PROTO_MAX_CPU || strlen(f->isa) > 16 || strlen(f->version) > 32))
        return SHOAL_ERANGE;
    enc e;
    enc_init(&e, buf, cap);
    enc_head(&e, SHOAL_MSG_PROBE_REPLY, rid, has ? 15 : 0);
    if (has) {
        enc_key(&e, "cpu");
        enc_str(&e, f->cpu);
        enc_key(&e, "isa");
        enc_str(&e, f->isa);
        enc_key(&e, "version");
        enc_str(&e, f->version);
        enc_ku64(&e, "cores", f->cores);
        enc_ku64(&e, "threads", f->threads);
        enc_ku64(&e, "mem_total", f->mem_total);
        enc_ku64(&e, "mem_avail", f->mem_avail);
        enc_ku64(&e, "disk_free", f->disk_free);
        enc_ku64(&e, "disk_total", f->disk_total);
        enc_ku64(&e, "read_bw_1", f->read_bw_1);
        enc_ku64(&e, "read_bw_all", f->read_bw_all);
        enc_ku64(&e, "disk_read_bw", f->disk_read_bw);
        enc_ku64(&e, "held_bytes", f->held_bytes);
        enc_ku64(&e, "measure_us", f->measure_us);
        enc_ku64(&e, "facts", 1);
    }
    return enc_done(&e, len);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int shoal_proto_tensor_len(int dtype, uint32_t rows, uint32_t cols, size_t *len)
{
    size_t es = shoal_wire_dtype_size(dtype);
    if (!es || !rows || !cols)
        return SHOAL_ERANGE;
    uint64_t n = (uint64_t)rows * cols; /* < 2^64: both < 2^32 */
    if (n > (UINT64_MAX - SHOAL_PROTO_TENSOR_HDR) / es || n * es + SHOAL_PROTO_TENSOR_HDR > SIZE_MAX)
        return SHOAL_ERANGE;
    *len = (size_t)(n * es + SHOAL_PROTO_TENSOR_HDR);
    return 0;
}

int shoal_proto_tensor_hdr(uint8_t hdr[SHOAL_PROTO_TENSOR_HDR], int dtype, uint32_t rows, uint32_t cols)
{
    size_t len;
    int rc = shoal_proto_tensor_len(dtype, rows, cols, &len);
    if (rc)
        return rc;
    memcpy(hdr, tensor_magic, 4);
    hdr[4] = (uint8_t)dtype;
    hdr[5] = hdr[6] = hdr[7] = 0;
    put_u32(hdr + 8, rows);
    put_u32(hdr + 12, cols);
    return 0;
}

/* ---- decoding ---------------------------------------------------------- */

static uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Walk one MessagePack value at b[*off..len): well-formed, not truncated,
 * containers no deeper than MAX_DEPTH and never declaring more elements than
 * bytes remain. Advances *off. 0 or -1 with a reason. */
static int scan(const uint8_t *b, size_t len, size_t *off, int depth, const char **why)
{
    if (*off >= len) {
        *why = "truncated MessagePack value";
        return -1;
    }
    uint8_t c = b[(*off)++];
    size_t rem = len - *off;
    uint64_t n = 0, skip = 0; /* n: container elements; skip: raw bytes */
    int hdr = 0, is_map = 0, container = 0;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3)
        return 0;
    if (c >= 0x80 && c <= 0x8f) {
        n = c & 15u;
        is_map = container = 1;
    } else if (c >= 0x90 && c <= 0x9f) {
        n = c & 15u;
        container = 1;
    } else if (c >= 0xa0 && c <= 0xbf) {
        skip = c & 31u;
    } else {
        switch (c) {
        case 0xc4:
        case 0xd9: hdr = 1; break; /* bin8, str8 */
        case 0xc5:
        case 0xda: hdr = 2; break;
        case 0xc6:
        case 0xdb: hdr = 4; break;
        case 0xc7:
            hdr = 1;
            skip = 1;
            break; /* ext8: len, type, data */
        case 0xc8:
            hdr = 2;
            skip = 1;
            break;
        case 0xc9:
            hdr = 4;
            skip = 1;
            break;
        case 0xca: skip = 4; break;
        case 0xcb: skip = 8; break;
        case 0xcc:
        case 0xd0: skip = 1; break;
        case 0xcd:
        case 0xd1: skip = 2; break;
        case 0xce:
        case 0xd2: skip = 4; break;
        case 0xcf:
        case 0xd3: skip = 8; break;
        case 0xd4: skip = 2; break; /* fixext1: type + 1 */
        case 0xd5: skip = 3; break;
        case 0xd6: skip = 5; break;
        case 0xd7: skip = 9; break;
        case 0xd8: skip = 17; break;
        case 0xdc:
            hdr = 2;
            container = 1;
            break;
        case 0xdd:
            hdr = 4;
            container = 1;
            break;
        case 0xde:
            hdr = 2;
            container = is_map = 1;
            break;
        case 0xdf:
            hdr = 4;
            container = is_map = 1;
            break;
        default: *why = "invalid MessagePack type byte 0xc1"; return -1;
        }
        if (hdr) {
            if (rem < (size_t)hdr) {
                *why = "truncated MessagePack length";
                return -1;
            }
            uint64_t v = be(b + *off, hdr);
            *off += (size_t)hdr;
            rem -= (size_t)hdr;
            if (container)
                n = v;
            else
                skip += v;
        }
    }
    if (!container) {
        if (skip > rem) {
            *why = "truncated MessagePack value";
            return -1;
        }
        *off += (size_t)skip;
        return 0;
    }
    if (depth >= MAX_DEPTH) {
        *why = "MessagePack nesting deeper than the protocol allows";
        return -1;
    }
    if (n > rem || (is_map && n > rem / 2)) {
        *why = "MessagePack container declares more elements than bytes remain";
        return -1;
    }
    uint64_t items = is_map ? 2 * n : n;
    for (uint64_t i = 0; i < items; i++)
        if (scan(b, len, off, depth + 1, why))
            return -1;
    return 0;
}

typedef struct {
    char *err;
    size_t errlen;
    int perr;
} dctx;

__attribute__((format(printf, 3, 4))) static int fail(dctx *c, int perr, const char *fmt, ...)
{
    c->perr = perr;
    if (c->err && c->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    return SHOAL_EPROTO;
}

/* Body field table: a key, its slot, whether required. */
typedef struct {
    const char *key;
    int required;
    const msgpack_object *val; /* filled by get_fields */
} field;

static int key_is(const msgpack_object *k, const char *s)
{
    size_t n = strlen(s);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && !memcmp(k->via.str.ptr, s, n);
}

static int get_fields(dctx *c, const msgpack_object *body, const char *tname, field *f, int nf)
{
    if (body->type != MSGPACK_OBJECT_MAP)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: body is not a map", tname);
    const msgpack_object_map *mp = &body->via.map;
    if (mp->size > SHOAL_PROTO_MAX_KEYS)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: body has %u keys (limit %d)", tname, mp->size, SHOAL_PROTO_MAX_KEYS);
    for (uint32_t i = 0; i < mp->size; i++) {
        const msgpack_object *k = &mp->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: body key %u is not a string", tname, i);
        for (uint32_t j = 0; j < i; j++) {
            const msgpack_object *k2 = &mp->ptr[j].key;
            if (k2->via.str.size == k->via.str.size &&
                (!k->via.str.size || !memcmp(k2->via.str.ptr, k->via.str.ptr, k->via.str.size))) /* "" has no ptr */
                return fail(c, SHOAL_PERR_MALFORMED, "%s: key '%.*s' appears twice", tname,
                            (int)(k->via.str.size > 64 ? 64 : k->via.str.size), k->via.str.ptr);
        }
        for (int j = 0; j < nf; j++)
            if (key_is(k, f[j].key))
                f[j].val = &mp->ptr[i].val;
    }
    for (int j = 0; j < nf; j++)
        if (f[j].required && !f[j].val)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: missing key '%s'", tname, f[j].key);
    return 0;
}

static int get_u64(dctx *c, const char *tname, const field *f, uint64_t max, uint64_t *out)
{
    if (f->val->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s' is not a non-negative integer", tname, f->key);
    if (f->val->via.u64 > max)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s' = %llu exceeds %llu", tname, f->key,
                    (unsigned long long)f->val->via.u64, (unsigned long long)max);
    *out = f->val->via.u64;
    return 0;
}

static int get_u32f(dctx *c, const char *tname, const field *f, uint32_t *out)
{
    uint64_t v = 0;
    int rc = get_u64(c, tname, f, UINT32_MAX, &v);
    if (!rc)
        *out = (uint32_t)v;
    return rc;
}

/* A str of at most max bytes into out[max+1]; control bytes become '?'. */
static int get_str(dctx *c, const char *tname, const field *f, char *out, size_t max)
{
    if (f->val->type != MSGPACK_OBJECT_STR)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s' is not a string", tname, f->key);
    size_t n = f->val->via.str.size;
    if (n > max)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s' is %zu bytes (limit %zu)", tname, f->key, n, max);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)f->val->via.str.ptr[i];
        out[i] = (ch < 0x20 || ch == 0x7f) ? '?' : (char)ch;
    }
    out[n] = 0;
    return 0;
}

static int get_dtype_list(dctx *c, const char *tname, const field *f, uint32_t *mask)
{
    if (f->val->type != MSGPACK_OBJECT_ARRAY || f->val->via.array.size > 8)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s' is not a list of at most 8 dtype names", tname, f->key);
    *mask = 0;
    for (uint32_t i = 0; i < f->val->via.array.size; i++) {
        const msgpack_object *o = &f->val->via.array.ptr[i];
        if (o->type != MSGPACK_OBJECT_STR)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: '%s'[%u] is not a string", tname, f->key, i);
        int dt = wire_dtype_parse(o->via.str.ptr, o->via.str.size);
        if (dt) /* unknown names: a later minor version's dtypes, ignored */
            *mask |= SHOAL_WIRE_MASK(dt);
    }
    return 0;
}

/* A trunk matrix name: 1 to SHOAL_PROTO_MAX_NAME printable ASCII bytes. */
static int dec_tname(dctx *c, const char *what, uint32_t i, const msgpack_object *o, char out[SHOAL_PROTO_MAX_NAME + 1])
{
    if (o->type != MSGPACK_OBJECT_STR || o->via.str.size < 1 || o->via.str.size > SHOAL_PROTO_MAX_NAME)
        return fail(c, SHOAL_PERR_MALFORMED, "%s[%u]: the name is not a string of 1 to %d bytes", what, i,
                    SHOAL_PROTO_MAX_NAME);
    for (uint32_t j = 0; j < o->via.str.size; j++) {
        unsigned char ch = (unsigned char)o->via.str.ptr[j];
        if (ch <= 0x20 || ch >= 0x7f)
            return fail(c, SHOAL_PERR_MALFORMED, "%s[%u]: the name has a byte 0x%02x (printable ASCII only)", what, i,
                        ch);
    }
    memcpy(out, o->via.str.ptr, o->via.str.size);
    out[o->via.str.size] = 0;
    return 0;
}

/* lo, hi of a row range: 32-bit, lo <= hi. */
static int dec_lohi(dctx *c, const char *what, uint32_t i, const msgpack_object *a, uint32_t *lo, uint32_t *hi)
{
    if (a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        a[0].via.u64 > UINT32_MAX || a[1].via.u64 > UINT32_MAX || a[0].via.u64 > a[1].via.u64)
        return fail(c, SHOAL_PERR_MALFORMED, "%s[%u]: lo, hi are not 32-bit rows with lo <= hi", what, i);
    *lo = (uint32_t)a[0].via.u64;
    *hi = (uint32_t)a[1].via.u64;
    return 0;
}

/* One [name, lo, hi] item of a trunk row list (HELLO 'trunk', TRUNK_BATCH
 * 'mats'). */
static int dec_trows(dctx *c, const char *what, uint32_t i, const msgpack_object *r, shoal_proto_trows *out)
{
    if (r->type != MSGPACK_OBJECT_ARRAY || r->via.array.size != 3)
        return fail(c, SHOAL_PERR_MALFORMED, "%s[%u] is not [name, lo, hi]", what, i);
    const msgpack_object *a = r->via.array.ptr;
    int rc = dec_tname(c, what, i, &a[0], out->name);
    return rc ? rc : dec_lohi(c, what, i, a + 1, &out->lo, &out->hi);
}

/* One [a, b, lo, hi] item of TRUNK_BATCH 'chain' (1.4). */
static int dec_tchain(dctx *c, uint32_t i, const msgpack_object *r, shoal_proto_tchain *out)
{
    const char *what = "TRUNK_BATCH: 'chain'";
    if (r->type != MSGPACK_OBJECT_ARRAY || r->via.array.size != 4)
        return fail(c, SHOAL_PERR_MALFORMED, "%s[%u] is not [a, b, lo, hi]", what, i);
    const msgpack_object *a = r->via.array.ptr;
    int rc;
    if ((rc = dec_tname(c, what, i, &a[0], out->a)) || (rc = dec_tname(c, what, i, &a[1], out->b.name)))
        return rc;
    return dec_lohi(c, what, i, a + 2, &out->b.lo, &out->b.hi);
}

static int dec_trunk_owned(dctx *c, const msgpack_object *tv, const msgpack_object *fv, shoal_proto_hello *h)
{
    if (tv->type != MSGPACK_OBJECT_ARRAY || tv->via.array.size < 1 || tv->via.array.size > SHOAL_PROTO_MAX_TROWS)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'trunk' is not a list of 1 to %d row ranges",
                    SHOAL_PROTO_MAX_TROWS);
    if (fv->type != MSGPACK_OBJECT_BIN || fv->via.bin.size != SHOAL_PROTO_FP_BYTES)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'trunk_fp' is not %d bytes of bin", SHOAL_PROTO_FP_BYTES);
    uint32_t n = tv->via.array.size;
    shoal_proto_trows *t = shoal_xcalloc(n, sizeof *t);
    for (uint32_t i = 0; i < n; i++) {
        int rc = dec_trows(c, "HELLO: 'trunk'", i, &tv->via.array.ptr[i], &t[i]);
        if (rc) {
            free(t);
            return rc;
        }
    }
    h->trunk = t;
    h->ntrunk = n;
    memcpy(h->trunk_fp, fv->via.bin.ptr, SHOAL_PROTO_FP_BYTES);
    return 0;
}

static int dec_hello(dctx *c, const msgpack_object *body, int reply, shoal_proto_hello *h)
{
    field f[] = {{"proto", 1, NULL},
                 {"fingerprint", 1, NULL},
                 {reply ? "worker" : "peer", 1, NULL},
                 {"owned", reply, NULL},
                 {"act", reply, NULL},
                 {"out", reply, NULL},
                 {"max_tokens", reply, NULL},
                 {"isa", reply, NULL},
                 {"threads", reply, NULL},
                 {"expert_bytes", reply, NULL},
                 {"mem_total", reply, NULL},
                 {"prefetch", 0, NULL},
                 {"trunk", 0, NULL},
                 {"trunk_fp", 0, NULL},
                 {"numerics", 0, NULL},
                 {"bf16_exact", 0, NULL},
                 {"relay", 0, NULL}};
    int nf = 17; /* a request reads only proto, fingerprint, peer and relay */
    int rc = get_fields(c, body, "HELLO", f, nf);
    if (rc)
        return rc;
    const msgpack_object *pv = f[0].val;
    if (pv->type != MSGPACK_OBJECT_ARRAY || pv->via.array.size != 2 ||
        pv->via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        pv->via.array.ptr[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER || pv->via.array.ptr[0].via.u64 > 65535 ||
        pv->via.array.ptr[1].via.u64 > 65535)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'proto' is not [major, minor]");
    h->major = (uint32_t)pv->via.array.ptr[0].via.u64;
    h->minor = (uint32_t)pv->via.array.ptr[1].via.u64;
    const msgpack_object *fv = f[1].val;
    if (fv->type != MSGPACK_OBJECT_BIN || fv->via.bin.size != SHOAL_PROTO_FP_BYTES)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'fingerprint' is not %d bytes of bin", SHOAL_PROTO_FP_BYTES);
    memcpy(h->fingerprint, fv->via.bin.ptr, SHOAL_PROTO_FP_BYTES);
    if ((rc = get_str(c, "HELLO", &f[2], h->id, SHOAL_PROTO_MAX_ID)))
        return rc;
    const msgpack_object *rv = f[16].val;
    if (!reply) {
        if (rv && rv->type != MSGPACK_OBJECT_BOOLEAN)
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'relay' is not a boolean");
        h->relay_parent = rv && rv->via.boolean;
        return 0;
    }
    if (rv) {
        if (rv->type != MSGPACK_OBJECT_ARRAY || rv->via.array.size < 1 || rv->via.array.size > SHOAL_PROTO_MAX_RELAY)
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'relay' is not a list of 1 to %d endpoints",
                        SHOAL_PROTO_MAX_RELAY);
        for (uint32_t i = 0; i < rv->via.array.size; i++) {
            const msgpack_object *o = &rv->via.array.ptr[i];
            if (o->type != MSGPACK_OBJECT_STR || o->via.str.size < 1 || o->via.str.size > SHOAL_PROTO_MAX_ENDPOINT)
                return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'relay'[%u] is not a string of 1 to %d bytes", i,
                            SHOAL_PROTO_MAX_ENDPOINT);
            for (uint32_t j = 0; j < o->via.str.size; j++) {
                unsigned char ch = (unsigned char)o->via.str.ptr[j];
                if (ch <= 0x20 || ch >= 0x7f)
                    return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'relay'[%u] has a byte 0x%02x (printable ASCII only)",
                                i, ch);
            }
            memcpy(h->relay[i], o->via.str.ptr, o->via.str.size);
            h->relay[i][o->via.str.size] = 0;
        }
        h->nrelay = rv->via.array.size;
    }
    const msgpack_object *ov = f[3].val;
    if (ov->type != MSGPACK_OBJECT_ARRAY || ov->via.array.size > SHOAL_PROTO_MAX_RANGES)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'owned' is not a list of at most %d ranges",
                    SHOAL_PROTO_MAX_RANGES);
    uint32_t nr = ov->via.array.size;
    for (uint32_t i = 0; i < nr; i++) {
        const msgpack_object *r = &ov->via.array.ptr[i];
        int ok = r->type == MSGPACK_OBJECT_ARRAY && r->via.array.size == 4;
        for (int j = 0; ok && j < 4; j++)
            ok = r->via.array.ptr[j].type == MSGPACK_OBJECT_POSITIVE_INTEGER &&
                 r->via.array.ptr[j].via.u64 <= UINT32_MAX;
        if (!ok)
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'owned'[%u] is not [l_lo, l_hi, e_lo, e_hi]", i);
        uint64_t v[4];
        for (int j = 0; j < 4; j++)
            v[j] = r->via.array.ptr[j].via.u64;
        if (v[0] > v[1] || v[2] > v[3])
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'owned'[%u] = [%llu, %llu, %llu, %llu] is an empty range", i,
                        (unsigned long long)v[0], (unsigned long long)v[1], (unsigned long long)v[2],
                        (unsigned long long)v[3]);
    }
    h->owned = nr ? shoal_xcalloc(nr, sizeof *h->owned) : NULL;
    h->nowned = nr;
    for (uint32_t i = 0; i < nr; i++) {
        const msgpack_object *a = ov->via.array.ptr[i].via.array.ptr;
        h->owned[i] = (shoal_proto_range){(uint32_t)a[0].via.u64, (uint32_t)a[1].via.u64, (uint32_t)a[2].via.u64,
                                          (uint32_t)a[3].via.u64};
    }
    if ((rc = get_dtype_list(c, "HELLO", &f[4], &h->act_mask)) ||
        (rc = get_dtype_list(c, "HELLO", &f[5], &h->out_mask)))
        return rc;
    if ((rc = get_u32f(c, "HELLO", &f[6], &h->max_tokens)))
        return rc;
    if (!h->max_tokens)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'max_tokens' is 0");
    if ((rc = get_str(c, "HELLO", &f[7], h->isa, sizeof h->isa - 1)) ||
        (rc = get_u32f(c, "HELLO", &f[8], &h->threads)) ||
        (rc = get_u64(c, "HELLO", &f[9], UINT64_MAX, &h->expert_bytes)) ||
        (rc = get_u64(c, "HELLO", &f[10], UINT64_MAX, &h->mem_total)))
        return rc;
    if (f[11].val) {
        if (f[11].val->type != MSGPACK_OBJECT_BOOLEAN)
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'prefetch' is not a boolean");
        h->prefetch = f[11].val->via.boolean;
    }
    if (f[15].val) {
        if (f[15].val->type != MSGPACK_OBJECT_BOOLEAN)
            return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'bf16_exact' is not a boolean");
        h->bf16_exact = f[15].val->via.boolean;
    }
    snprintf(h->numerics, sizeof h->numerics, "portable");
    if (f[14].val && (rc = get_str(c, "HELLO", &f[14], h->numerics, SHOAL_PROTO_MAX_NUMERICS)))
        return rc;
    if (!f[12].val != !f[13].val)
        return fail(c, SHOAL_PERR_MALFORMED, "HELLO: 'trunk' and 'trunk_fp' come together");
    if (f[12].val)
        return dec_trunk_owned(c, f[12].val, f[13].val, h);
    return 0;
}

static int dec_empty(dctx *c, const msgpack_object *body, int type)
{
    return get_fields(c, body, shoal_msg_type_name(type), NULL, 0);
}

int shoal_proto_tensor_decode(const shoal_frame *f, shoal_proto_tensor *t, char *err, size_t errlen)
{
    if (f->len < SHOAL_PROTO_TENSOR_HDR)
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame of %zu bytes is shorter than its %d-byte header",
                             f->len, SHOAL_PROTO_TENSOR_HDR);
    const uint8_t *p = f->data;
    if (memcmp(p, tensor_magic, 4))
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame: bad magic %02x %02x %02x %02x", p[0], p[1], p[2],
                             p[3]);
    if (p[5] || p[6] || p[7])
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame: reserved header bytes are not zero");
    int dt = p[4];
    uint32_t rows = get_u32(p + 8), cols = get_u32(p + 12);
    size_t want;
    if (!shoal_wire_dtype_size(dt))
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame: unknown dtype %d", dt);
    if (shoal_proto_tensor_len(dt, rows, cols, &want))
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame: bad shape [%u, %u]", rows, cols);
    if (want != f->len)
        return shoal_err_set(err, errlen, SHOAL_EPROTO, "tensor frame: %s [%u, %u] needs %zu bytes, the frame has %zu",
                             shoal_wire_dtype_name(dt), rows, cols, want, f->len);
    *t = (shoal_proto_tensor){.dtype = dt,
                              .rows = rows,
                              .cols = cols,
                              .data = p + SHOAL_PROTO_TENSOR_HDR,
                              .nbytes = want - SHOAL_PROTO_TENSOR_HDR};
    return 0;
}

static int dec_tensor(dctx *c, const shoal_frame *f, const char *what, shoal_proto_tensor *t)
{
    char why[256];
    if (shoal_proto_tensor_decode(f, t, why, sizeof why))
        return fail(c, SHOAL_PERR_MALFORMED, "%s: %s", what, why);
    return 0;
}

/* Frames of a message of this type (a TRUNK_BATCH: 2, or 1 when relayed
 * without x, checked once its keys are read). */
static int frames_needed(int type)
{
    return type == SHOAL_MSG_EXPERT_BATCH                                             ? 3
           : type == SHOAL_MSG_EXPERT_RESULT || type == SHOAL_MSG_TRUNK_BATCH || type == SHOAL_MSG_TRUNK_RESULT ||
                   type == SHOAL_MSG_PROBE || type == SHOAL_MSG_PROBE_REPLY || type == SHOAL_MSG_TRUNK_X
               ? 2
               : 1;
}

/* The 1.8 relay keys (PROTOCOL.md §3.9) of a TRUNK_BATCH or TRUNK_X: xid
 * >= 1, wait_ms 1 .. MAX_WAIT_MS, fwd a list of 1 to MAX_RELAY [peer, up]
 * with every peer < MAX_RELAY and at most once, every up <= its position. */
static int dec_relay(dctx *c, const char *tname, const field *xf, const field *wf, const field *ff,
                     shoal_proto_relay *r)
{
    int rc;
    if ((rc = get_u64(c, tname, xf, UINT64_MAX, &r->xid)))
        return rc;
    if (!r->xid)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: 'xid' is 0", tname);
    if (!wf->val)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: 'xid' without 'wait_ms'", tname);
    if ((rc = get_u32f(c, tname, wf, &r->wait_ms)))
        return rc;
    if (r->wait_ms < 1 || r->wait_ms > SHOAL_PROTO_MAX_WAIT_MS)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: 'wait_ms' = %u is not 1 to %d", tname, r->wait_ms,
                    SHOAL_PROTO_MAX_WAIT_MS);
    if (!ff->val)
        return 0;
    const msgpack_object *fv = ff->val;
    if (fv->type != MSGPACK_OBJECT_ARRAY || fv->via.array.size < 1 || fv->via.array.size > SHOAL_PROTO_MAX_RELAY)
        return fail(c, SHOAL_PERR_MALFORMED, "%s: 'fwd' is not a list of 1 to %d [peer, up]", tname,
                    SHOAL_PROTO_MAX_RELAY);
    uint64_t seen = 0;
    for (uint32_t i = 0; i < fv->via.array.size; i++) {
        const msgpack_object *o = &fv->via.array.ptr[i];
        if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 2 ||
            o->via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            o->via.array.ptr[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: 'fwd'[%u] is not [peer, up]", tname, i);
        uint64_t peer = o->via.array.ptr[0].via.u64, up = o->via.array.ptr[1].via.u64;
        if (peer >= SHOAL_PROTO_MAX_RELAY)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: 'fwd'[%u]: peer %llu is not below %d", tname, i,
                        (unsigned long long)peer, SHOAL_PROTO_MAX_RELAY);
        if (up > i)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: 'fwd'[%u]: up %llu does not name an earlier entry", tname, i,
                        (unsigned long long)up);
        if (seen >> peer & 1u)
            return fail(c, SHOAL_PERR_MALFORMED, "%s: 'fwd'[%u]: peer %llu appears twice", tname, i,
                        (unsigned long long)peer);
        seen |= (uint64_t)1 << peer;
        r->fwd[i] = (shoal_proto_fwd){(uint8_t)peer, (uint8_t)up};
    }
    r->nfwd = fv->via.array.size;
    return 0;
}

static int dec_body(dctx *c, const shoal_frame *frames, int nframes, shoal_proto_side side, const msgpack_object *body,
                    shoal_proto_msg *m)
{
    int type = m->type, rc;
    int is_req = type == SHOAL_MSG_HELLO || type == SHOAL_MSG_PING || type == SHOAL_MSG_STATS ||
                 type == SHOAL_MSG_SHUTDOWN || type == SHOAL_MSG_EXPERT_BATCH || type == SHOAL_MSG_PREFETCH ||
                 type == SHOAL_MSG_TRUNK_BATCH || type == SHOAL_MSG_PROBE || type == SHOAL_MSG_TRUNK_X;
    int is_rep = type == SHOAL_MSG_HELLO || type == SHOAL_MSG_ERROR || type == SHOAL_MSG_PONG ||
                 type == SHOAL_MSG_STATS_REPLY || type == SHOAL_MSG_SHUTDOWN_ACK || type == SHOAL_MSG_EXPERT_RESULT ||
                 type == SHOAL_MSG_TRUNK_RESULT || type == SHOAL_MSG_PROBE_REPLY;
    if (side == SHOAL_SIDE_WORKER ? !is_req : !is_rep)
        return fail(c, SHOAL_PERR_UNKNOWN_TYPE, "message type %d (%s) is not a %s", type, shoal_msg_type_name(type),
                    side == SHOAL_SIDE_WORKER ? "request" : "reply");
    if (nframes != frames_needed(type) && !(type == SHOAL_MSG_TRUNK_BATCH && nframes == 1))
        return fail(c, SHOAL_PERR_MALFORMED, "%s: %d frames, expected %d", shoal_msg_type_name(type), nframes,
                    frames_needed(type));
    switch (type) {
    case SHOAL_MSG_HELLO: return dec_hello(c, body, side == SHOAL_SIDE_COORDINATOR, &m->hello);
    case SHOAL_MSG_ERROR: {
        field f[] = {{"code", 1, NULL}, {"message", 1, NULL}};
        if ((rc = get_fields(c, body, "ERROR", f, 2)) || (rc = get_u32f(c, "ERROR", &f[0], &m->error.code)))
            return rc;
        return get_str(c, "ERROR", &f[1], m->error.message, SHOAL_PROTO_MAX_TEXT);
    }
    case SHOAL_MSG_STATS_REPLY: {
        field f[] = {{"worker", 1, NULL},    {"uptime_us", 1, NULL}, {"requests", 1, NULL},  {"errors", 1, NULL},
                     {"batches", 1, NULL},   {"tokens", 1, NULL},    {"pairs", 1, NULL},     {"bytes_in", 1, NULL},
                     {"bytes_out", 1, NULL}, {"queue_us", 1, NULL},  {"compute_us", 1, NULL}};
        shoal_proto_stats *s = &m->stats;
        uint64_t *dst[] = {&s->uptime_us, &s->requests, &s->errors,    &s->batches,  &s->tokens,
                           &s->pairs,     &s->bytes_in, &s->bytes_out, &s->queue_us, &s->compute_us};
        if ((rc = get_fields(c, body, "STATS_REPLY", f, 11)) ||
            (rc = get_str(c, "STATS_REPLY", &f[0], s->worker, SHOAL_PROTO_MAX_ID)))
            return rc;
        for (int i = 0; i < 10; i++)
            if ((rc = get_u64(c, "STATS_REPLY", &f[i + 1], UINT64_MAX, dst[i])))
                return rc;
        return 0;
    }
    case SHOAL_MSG_EXPERT_BATCH: {
        field f[] = {{"layer", 1, NULL}, {"out", 1, NULL}};
        if ((rc = get_fields(c, body, "EXPERT_BATCH", f, 2)) ||
            (rc = get_u32f(c, "EXPERT_BATCH", &f[0], &m->batch.layer)))
            return rc;
        if (f[1].val->type != MSGPACK_OBJECT_STR)
            return fail(c, SHOAL_PERR_MALFORMED, "EXPERT_BATCH: 'out' is not a string");
        m->batch.out = wire_dtype_parse(f[1].val->via.str.ptr, f[1].val->via.str.size);
        if (!m->batch.out)
            return fail(c, SHOAL_PERR_UNSUPPORTED, "EXPERT_BATCH: 'out' dtype '%.*s' is not bf16 or f32",
                        (int)(f[1].val->via.str.size > 16 ? 16 : f[1].val->via.str.size), f[1].val->via.str.ptr);
        if ((rc = dec_tensor(c, &frames[1], "EXPERT_BATCH act", &m->batch.act)) ||
            (rc = dec_tensor(c, &frames[2], "EXPERT_BATCH route", &m->batch.route)))
            return rc;
        return 0;
    }
    case SHOAL_MSG_EXPERT_RESULT: {
        field f[] = {{"queue_us", 1, NULL}, {"compute_us", 1, NULL}};
        if ((rc = get_fields(c, body, "EXPERT_RESULT", f, 2)) ||
            (rc = get_u64(c, "EXPERT_RESULT", &f[0], UINT64_MAX, &m->result.queue_us)) ||
            (rc = get_u64(c, "EXPERT_RESULT", &f[1], UINT64_MAX, &m->result.compute_us)))
            return rc;
        return dec_tensor(c, &frames[1], "EXPERT_RESULT y", &m->result.y);
    }
    case SHOAL_MSG_PREFETCH: {
        field f[] = {{"layer", 1, NULL}, {"experts", 1, NULL}};
        if ((rc = get_fields(c, body, "PREFETCH", f, 2)) || (rc = get_u32f(c, "PREFETCH", &f[0], &m->prefetch.layer)))
            return rc;
        const msgpack_object *ev = f[1].val;
        if (ev->type != MSGPACK_OBJECT_ARRAY || ev->via.array.size > SHOAL_PROTO_MAX_PREFETCH)
            return fail(c, SHOAL_PERR_MALFORMED, "PREFETCH: 'experts' is not a list of at most %d expert ids",
                        SHOAL_PROTO_MAX_PREFETCH);
        for (uint32_t i = 0; i < ev->via.array.size; i++) {
            const msgpack_object *o = &ev->via.array.ptr[i];
            if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER || o->via.u64 > UINT32_MAX)
                return fail(c, SHOAL_PERR_MALFORMED, "PREFETCH: 'experts'[%u] is not a 32-bit expert id", i);
            if (i && o->via.u64 <= m->prefetch.experts[i - 1])
                return fail(c, SHOAL_PERR_MALFORMED, "PREFETCH: 'experts'[%u] = %llu does not follow %u (ascending)",
                            i, (unsigned long long)o->via.u64, m->prefetch.experts[i - 1]);
            m->prefetch.experts[i] = (uint32_t)o->via.u64;
        }
        m->prefetch.n = ev->via.array.size;
        return 0;
    }
    case SHOAL_MSG_TRUNK_X: {
        field f[] = {{"xid", 1, NULL}, {"wait_ms", 1, NULL}, {"fwd", 0, NULL}};
        if ((rc = get_fields(c, body, "TRUNK_X", f, 3)) ||
            (rc = dec_relay(c, "TRUNK_X", &f[0], &f[1], &f[2], &m->trunkx.relay)))
            return rc;
        if ((rc = dec_tensor(c, &frames[1], "TRUNK_X x", &m->trunkx.x)))
            return rc;
        if (m->trunkx.x.dtype != SHOAL_WIRE_F32 && m->trunkx.x.dtype != SHOAL_WIRE_BF16)
            return fail(c, SHOAL_PERR_UNSUPPORTED, "TRUNK_X x: dtype %s, only f32 or bf16",
                        shoal_wire_dtype_name(m->trunkx.x.dtype));
        return 0;
    }
    case SHOAL_MSG_TRUNK_BATCH: {
        field f[] = {{"layer", 1, NULL}, {"mats", 1, NULL}, {"chain", 0, NULL},
                     {"xid", 0, NULL},   {"wait_ms", 0, NULL}, {"fwd", 0, NULL}};
        if ((rc = get_fields(c, body, "TRUNK_BATCH", f, 6)) ||
            (rc = get_u32f(c, "TRUNK_BATCH", &f[0], &m->tbatch.layer)))
            return rc;
        const msgpack_object *mv = f[1].val, *cv = f[2].val;
        if (mv->type != MSGPACK_OBJECT_ARRAY || mv->via.array.size > SHOAL_PROTO_MAX_TSEGS)
            return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_BATCH: 'mats' is not a list of up to %d [name, lo, hi]",
                        SHOAL_PROTO_MAX_TSEGS);
        for (uint32_t i = 0; i < mv->via.array.size; i++)
            if ((rc = dec_trows(c, "TRUNK_BATCH: 'mats'", i, &mv->via.array.ptr[i], &m->tbatch.seg[i])))
                return rc;
        m->tbatch.n = mv->via.array.size;
        if (cv) {
            if (cv->type != MSGPACK_OBJECT_ARRAY || cv->via.array.size < 1 ||
                cv->via.array.size > SHOAL_PROTO_MAX_TCHAIN)
                return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_BATCH: 'chain' is not a list of 1 to %d [a, b, lo, hi]",
                            SHOAL_PROTO_MAX_TCHAIN);
            for (uint32_t i = 0; i < cv->via.array.size; i++)
                if ((rc = dec_tchain(c, i, &cv->via.array.ptr[i], &m->tbatch.chain[i])))
                    return rc;
            m->tbatch.nchain = cv->via.array.size;
        }
        if (m->tbatch.n + m->tbatch.nchain < 1)
            return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_BATCH: no segment ('mats' empty and no 'chain')");
        if (f[3].val) { /* 1.8: relayed; without 'fwd' the x comes as TRUNK_X, not here */
            if ((rc = dec_relay(c, "TRUNK_BATCH", &f[3], &f[4], &f[5], &m->tbatch.relay)))
                return rc;
        } else if (f[4].val || f[5].val) {
            return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_BATCH: 'wait_ms' or 'fwd' without 'xid'");
        }
        int want = m->tbatch.relay.xid && !m->tbatch.relay.nfwd ? 1 : 2;
        if (nframes != want)
            return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_BATCH: %d frames, expected %d%s", nframes, want,
                        want == 1 ? " (relayed: x comes as TRUNK_X)" : "");
        if (want == 1)
            return 0;
        m->tbatch.has_x = 1;
        if ((rc = dec_tensor(c, &frames[1], "TRUNK_BATCH x", &m->tbatch.x)))
            return rc;
        if (m->tbatch.x.dtype != SHOAL_WIRE_F32 && m->tbatch.x.dtype != SHOAL_WIRE_BF16)
            return fail(c, SHOAL_PERR_UNSUPPORTED, "TRUNK_BATCH x: dtype %s, only f32 or bf16",
                        shoal_wire_dtype_name(m->tbatch.x.dtype));
        return 0;
    }
    case SHOAL_MSG_TRUNK_RESULT: {
        field f[] = {{"queue_us", 1, NULL}, {"compute_us", 1, NULL}};
        if ((rc = get_fields(c, body, "TRUNK_RESULT", f, 2)) ||
            (rc = get_u64(c, "TRUNK_RESULT", &f[0], UINT64_MAX, &m->tresult.queue_us)) ||
            (rc = get_u64(c, "TRUNK_RESULT", &f[1], UINT64_MAX, &m->tresult.compute_us)))
            return rc;
        if ((rc = dec_tensor(c, &frames[1], "TRUNK_RESULT y", &m->tresult.y)))
            return rc;
        if (m->tresult.y.dtype != SHOAL_WIRE_F32 || m->tresult.y.rows != 1)
            return fail(c, SHOAL_PERR_MALFORMED, "TRUNK_RESULT y: %s [%u, %u], expected f32 [1, n]",
                        shoal_wire_dtype_name(m->tresult.y.dtype), m->tresult.y.rows, m->tresult.y.cols);
        return 0;
    }
    case SHOAL_MSG_PROBE: {
        field f[] = {{"reply", 1, NULL}, {"facts", 0, NULL}};
        uint64_t r = 0;
        if ((rc = get_fields(c, body, "PROBE", f, 2)) || (rc = get_u64(c, "PROBE", &f[0], SHOAL_PROTO_MAX_PROBE, &r)))
            return rc;
        if (r < 4 || r % 4)
            return fail(c, SHOAL_PERR_MALFORMED, "PROBE: 'reply' = %llu is not a multiple of 4 from 4 to %u",
                        (unsigned long long)r, SHOAL_PROTO_MAX_PROBE);
        m->probe.reply = (uint32_t)r;
        if (f[1].val) {
            if (f[1].val->type != MSGPACK_OBJECT_BOOLEAN)
                return fail(c, SHOAL_PERR_MALFORMED, "PROBE: 'facts' is not a boolean");
            m->probe.facts = f[1].val->via.boolean;
        }
        if ((rc = dec_tensor(c, &frames[1], "PROBE x", &m->probe.x)))
            return rc;
        if (m->probe.x.dtype != SHOAL_WIRE_F32 || m->probe.x.rows != 1 || m->probe.x.nbytes > SHOAL_PROTO_MAX_PROBE)
            return fail(c, SHOAL_PERR_MALFORMED, "PROBE x: %s [%u, %u], expected f32 [1, n] of at most %u bytes",
                        shoal_wire_dtype_name(m->probe.x.dtype), m->probe.x.rows, m->probe.x.cols,
                        SHOAL_PROTO_MAX_PROBE);
        return 0;
    }
    case SHOAL_MSG_PROBE_REPLY: {
        field f[] = {{"facts", 0, NULL},       {"cpu", 0, NULL},        {"isa", 0, NULL},
                     {"version", 0, NULL},     {"cores", 0, NULL},      {"threads", 0, NULL},
                     {"mem_total", 0, NULL},   {"mem_avail", 0, NULL},  {"disk_free", 0, NULL},
                     {"disk_total", 0, NULL},  {"read_bw_1", 0, NULL},  {"read_bw_all", 0, NULL},
                     {"disk_read_bw", 0, NULL}, {"held_bytes", 0, NULL}, {"measure_us", 0, NULL}};
        shoal_proto_facts *x = &m->preply.facts;
        if ((rc = get_fields(c, body, "PROBE_REPLY", f, 15)))
            return rc;
        if (f[0].val) { /* the facts come together: every key required */
            for (int i = 1; i < 15; i++)
                if (!f[i].val)
                    return fail(c, SHOAL_PERR_MALFORMED, "PROBE_REPLY: 'facts' without '%s'", f[i].key);
            uint64_t one = 0, cores = 0, threads = 0;
            uint64_t *dst[] = {&x->mem_total, &x->mem_avail, &x->disk_free, &x->disk_total, &x->read_bw_1,
                               &x->read_bw_all, &x->disk_read_bw, &x->held_bytes, &x->measure_us};
            if ((rc = get_u64(c, "PROBE_REPLY", &f[0], 1, &one)) ||
                (rc = get_str(c, "PROBE_REPLY", &f[1], x->cpu, SHOAL_PROTO_MAX_CPU)) ||
                (rc = get_str(c, "PROBE_REPLY", &f[2], x->isa, 16)) ||
                (rc = get_str(c, "PROBE_REPLY", &f[3], x->version, 32)) ||
                (rc = get_u64(c, "PROBE_REPLY", &f[4], UINT32_MAX, &cores)) ||
                (rc = get_u64(c, "PROBE_REPLY", &f[5], UINT32_MAX, &threads)))
                return rc;
            for (int i = 0; i < 9; i++)
                if ((rc = get_u64(c, "PROBE_REPLY", &f[6 + i], UINT64_MAX, dst[i])))
                    return rc;
            x->cores = (uint32_t)cores;
            x->threads = (uint32_t)threads;
            x->has = one == 1;
        }
        if ((rc = dec_tensor(c, &frames[1], "PROBE_REPLY y", &m->preply.y)))
            return rc;
        if (m->preply.y.dtype != SHOAL_WIRE_F32 || m->preply.y.rows != 1)
            return fail(c, SHOAL_PERR_MALFORMED, "PROBE_REPLY y: %s [%u, %u], expected f32 [1, n]",
                        shoal_wire_dtype_name(m->preply.y.dtype), m->preply.y.rows, m->preply.y.cols);
        return 0;
    }
    default: return dec_empty(c, body, type);
    }
}

/* The decoder proper, with the caller's MessagePack zone (empty on entry;
 * emptied again by the caller). */
static int decode_in(msgpack_zone *zone_p, const shoal_frame *frames, int nframes, shoal_proto_side side,
                     shoal_proto_msg *m, int *perr, char *err, size_t errlen)
{
    dctx c = {.err = err, .errlen = errlen, .perr = SHOAL_PERR_OK};
    int dummy;
    if (!perr)
        perr = &dummy;
    *perr = SHOAL_PERR_OK;
    m->type = 0;
    m->rid = 0;
    int rc;
    if (nframes < 1 || nframes > SHOAL_PROTO_MAX_FRAMES) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "message has %d frames (1 to %d)", nframes, SHOAL_PROTO_MAX_FRAMES);
        *perr = c.perr;
        return rc;
    }
    const uint8_t *b = frames[0].data;
    size_t len = frames[0].len;
    const char *why = NULL;
    size_t off = 0;
    if (len > SHOAL_PROTO_MAX_CONTROL) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "control frame of %zu bytes exceeds %u", len, SHOAL_PROTO_MAX_CONTROL);
        *perr = c.perr;
        return rc;
    }
    if (scan(b, len, &off, 0, &why) || off != len) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "control frame: %s", why ? why : "trailing bytes after the envelope");
        *perr = c.perr;
        return rc;
    }
    msgpack_object root;
    size_t uoff = 0;
    msgpack_unpack_return ur = msgpack_unpack((const char *)b, len, &uoff, zone_p, &root);
    if (ur != MSGPACK_UNPACK_SUCCESS) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "control frame: msgpack-c refused it (%d)", (int)ur);
        goto out;
    }
    if (root.type != MSGPACK_OBJECT_ARRAY || root.via.array.size != 3) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "control frame is not [type, rid, body]");
        goto out;
    }
    const msgpack_object *ty = &root.via.array.ptr[0], *rid = &root.via.array.ptr[1];
    if (ty->type != MSGPACK_OBJECT_POSITIVE_INTEGER || rid->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
        rc = fail(&c, SHOAL_PERR_MALFORMED, "control frame: type and rid must be non-negative integers");
        goto out;
    }
    m->rid = rid->via.u64;
    if (ty->via.u64 < 1 || ty->via.u64 > SHOAL_MSG_TRUNK_X) {
        rc = fail(&c, SHOAL_PERR_UNKNOWN_TYPE, "unknown message type %llu", (unsigned long long)ty->via.u64);
        goto out;
    }
    m->type = (int)ty->via.u64;
    rc = dec_body(&c, frames, nframes, side, &root.via.array.ptr[2], m);
out:
    *perr = c.perr;
    return rc;
}

int shoal_proto_decode(const shoal_frame *frames, int nframes, shoal_proto_side side, shoal_proto_msg *m, int *perr,
                       char *err, size_t errlen)
{
    msgpack_zone zone;
    if (!msgpack_zone_init(&zone, 2048))
        SHOAL_PANIC("out of memory (msgpack zone)");
    int rc = decode_in(&zone, frames, nframes, side, m, perr, err, errlen);
    msgpack_zone_destroy(&zone);
    return rc;
}

struct shoal_proto_scratch {
    msgpack_zone zone;
};

shoal_proto_scratch *shoal_proto_scratch_new(void)
{
    shoal_proto_scratch *s = shoal_xcalloc(1, sizeof *s);
    if (!msgpack_zone_init(&s->zone, 2048))
        SHOAL_PANIC("out of memory (msgpack zone)");
    return s;
}

void shoal_proto_scratch_free(shoal_proto_scratch *s)
{
    if (!s)
        return;
    msgpack_zone_destroy(&s->zone);
    free(s);
}

int shoal_proto_decode_with(shoal_proto_scratch *s, const shoal_frame *frames, int nframes, shoal_proto_side side,
                            shoal_proto_msg *m, int *perr, char *err, size_t errlen)
{
    int rc = decode_in(&s->zone, frames, nframes, side, m, perr, err, errlen);
    msgpack_zone_clear(&s->zone); /* frees any chunk beyond the first, keeps that one */
    return rc;
}

/* ---- semantic checks of an EXPERT_BATCH -------------------------------- */

__attribute__((format(printf, 4, 5))) static int pfail(char *err, size_t errlen, int perr, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return perr;
}

int shoal_proto_check_batch(const shoal_proto_msg *m, const shoal_proto_limits *lim, char *err, size_t errlen)
{
    const shoal_proto_tensor *a = &m->batch.act, *r = &m->batch.route;
    uint32_t layer = m->batch.layer;
    if (layer >= (uint32_t)lim->num_layers || !lim->is_moe[layer])
        return pfail(err, errlen, SHOAL_PERR_BAD_SHAPE,
                     "EXPERT_BATCH: layer %u is not an MoE layer of this "
                     "model (%d layers)",
                     layer, lim->num_layers);
    if (!(lim->out_mask & SHOAL_WIRE_MASK(m->batch.out)))
        return pfail(err, errlen, SHOAL_PERR_UNSUPPORTED, "EXPERT_BATCH: output dtype %s not offered",
                     shoal_wire_dtype_name(m->batch.out));
    if ((a->dtype != SHOAL_WIRE_F32 && a->dtype != SHOAL_WIRE_BF16) || !(lim->act_mask & SHOAL_WIRE_MASK(a->dtype)))
        return pfail(err, errlen, SHOAL_PERR_UNSUPPORTED, "EXPERT_BATCH: act dtype %s not offered",
                     shoal_wire_dtype_name(a->dtype));
    if (a->cols != (uint32_t)lim->d)
        return pfail(err, errlen, SHOAL_PERR_BAD_SHAPE,
                     "EXPERT_BATCH: act has %u columns, the model's latent width is %d", a->cols, lim->d);
    if (a->rows > (uint32_t)lim->max_tokens)
        return pfail(err, errlen, SHOAL_PERR_BAD_SHAPE, "EXPERT_BATCH: act has %u rows, max_tokens is %d", a->rows,
                     lim->max_tokens);
    if (r->dtype != SHOAL_WIRE_I32 || r->cols != 2)
        return pfail(err, errlen, SHOAL_PERR_BAD_SHAPE, "EXPERT_BATCH: route must be i32 [n, 2], got %s [%u, %u]",
                     shoal_wire_dtype_name(r->dtype), r->rows, r->cols);
    if ((uint64_t)r->rows > (uint64_t)a->rows * (uint64_t)lim->k)
        return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE,
                     "EXPERT_BATCH: %u route pairs for %u tokens exceed k = %d per token", r->rows, a->rows, lim->k);
    int32_t pt = -1, pe = -1;
    uint32_t covered = 0, per_tok = 0;
    for (uint32_t i = 0; i < r->rows; i++) {
        int32_t t, e;
        shoal_proto_route_pair(r, i, &t, &e);
        if (t < 0 || (uint32_t)t >= a->rows)
            return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE, "EXPERT_BATCH: route pair %u token %d outside 0..%u", i, t,
                         a->rows - 1);
        if (e < 0 || e >= lim->num_experts)
            return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE, "EXPERT_BATCH: route pair %u expert %d outside 0..%d", i, e,
                         lim->num_experts - 1);
        if (t < pt || (t == pt && e <= pe))
            return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE,
                         "EXPERT_BATCH: route pair %u (%d, %d) does not follow (%d, %d) in "
                         "(token, expert) order",
                         i, t, e, pt, pe);
        if (t != pt) {
            if ((uint32_t)t != covered)
                return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE,
                             "EXPERT_BATCH: activation row %u is used by no route pair", covered);
            covered++;
            per_tok = 0;
        }
        if (++per_tok > (uint32_t)lim->k)
            return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE, "EXPERT_BATCH: token %d has more than k = %d experts", t,
                         lim->k);
        if (lim->owns && !lim->owns(lim->owns_ctx, (int)layer, e))
            return pfail(err, errlen, SHOAL_PERR_NOT_OWNED,
                         "EXPERT_BATCH: layer %u expert %d is not owned by this worker", layer, e);
        pt = t;
        pe = e;
    }
    if (covered != a->rows)
        return pfail(err, errlen, SHOAL_PERR_BAD_ROUTE, "EXPERT_BATCH: activation row %u is used by no route pair",
                     covered);
    return SHOAL_PERR_OK;
}
