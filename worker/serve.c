/* The worker's request handler (see serve.h). */
#include "worker/serve.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "worker/hostfacts.h"

#define MAX_PEERS 256

typedef struct {
    uint8_t id[256];
    size_t len;
    uint64_t used; /* LRU stamp; 0 = free slot */
    int relay_parent; /* its HELLO said `relay` (1.8): a worker that sends TRUNK_X on this connection */
} peer;

/* PROBE host facts (PROTOCOL.md §3.8): each measurement stalls the loop about
 * a second, so at most FACTS_BURST in a row, then one per FACTS_EVERY_US;
 * beyond that the last figures are sent again (measure_us 0) */
#define FACTS_BURST 8.0
#define FACTS_EVERY_US 7500000.0

struct shoal_serve {
    shoal_serve_opts o;
    shoal_proto_facts facts;  /* the last measured (facts.has: there is one) */
    double facts_tokens;      /* measurements allowed now (a bucket of FACTS_BURST) */
    uint64_t facts_at_us;     /* when the bucket was last topped up */
    char id[SHOAL_PROTO_MAX_ID + 1];
    uint8_t fingerprint[SHOAL_PROTO_FP_BYTES];
    const shoal_bank *bank;
    shoal_proto_limits lim;
    int d, f;
    /* control frame buffer: HELLO reply with every range fits */
    uint8_t *ctl;
    size_t ctlcap;
    /* scratch, sized at open for max_tokens */
    float *xe;       /* [max_tokens, d] gathered activations of one expert */
    uint16_t *ye;    /* [max_tokens, d] its outputs */
    float *h;        /* [2 * max_tokens * f] kernel scratch */
    int32_t *cnt;    /* [num_experts] pairs per expert (zero between requests) */
    int32_t *start;  /* [num_experts] */
    int32_t *perm;   /* [max_tokens * k] pair indices grouped by expert */
    int32_t *touched; /* [max_tokens * k] distinct experts of the request */
    const shoal_expert_w **views; /* [max_tokens * k] the weights of touched[i] */
    int32_t *pf_ids;  /* [num_experts] a PREFETCH's usable ids */
    uint64_t pf_notices, pf_dropped;
    peer peers[MAX_PEERS];
    int npeers;      /* peers[0 .. npeers) have been used */
    peer *last_peer; /* the last one found or added */
    uint64_t clock;
    shoal_proto_stats st;
    uint64_t t0_us;
    uint64_t logged_errors;
    uint64_t hello_peers; /* connections that completed HELLO (for the log's rate limit) */
    int last_perr; /* ERROR code of the reply being built (0: not an ERROR) */
    float *tx;     /* [max_tokens * max trunk cols]: a TRUNK_BATCH's input, aligned */
    size_t tx_cap; /* floats */
    float *ta;     /* [max_tokens * chain_rows]: a chain's first output (1.4) */
    int chain_rows; /* the most rows of a wholly owned matrix usable as a chain's first (<= MAX_CHAIN_ROWS) */
    uint64_t tbatches;
};

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

int shoal_serve_open(shoal_serve **out, const shoal_serve_opts *o, const shoal_bank *bank, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->id || strlen(o->id) > SHOAL_PROTO_MAX_ID)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "worker id must be 1..%d bytes", SHOAL_PROTO_MAX_ID);
    if (o->max_tokens < 1 || o->k < 1 || o->num_experts < 1 || o->num_layers < 1 ||
        o->nowned > SHOAL_PROTO_MAX_RANGES)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "serve: bad limits");
    int d = o->store ? shoal_store_d(o->store) : bank ? shoal_bank_d(bank) : 0;
    int f = o->store ? shoal_store_f(o->store) : bank ? shoal_bank_f(bank) : 0;
    if ((d <= 0 || f <= 0) && !o->ntrunk)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "serve: the bank owns no expert");
    if (o->ntrunk && (!o->trunk || !o->tmat || !o->trunk_fp || o->ntrunk > SHOAL_PROTO_MAX_TROWS))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "serve: bad trunk rows");
    if (d <= 0 || f <= 0)
        d = f = 1; /* trunk rows only: every EXPERT_BATCH is refused (nothing owned) */
    shoal_serve *s = shoal_xcalloc(1, sizeof *s);
    s->o = *o;
    snprintf(s->id, sizeof s->id, "%s", o->id);
    s->o.id = s->id;
    memcpy(s->fingerprint, o->fingerprint, SHOAL_PROTO_FP_BYTES);
    s->bank = bank;
    s->d = d;
    s->f = f;
    s->lim = (shoal_proto_limits){.num_layers = o->num_layers, .is_moe = o->is_moe, .num_experts = o->num_experts,
                                  .k = o->k, .d = d, .max_tokens = o->max_tokens,
                                  .act_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_F32) | SHOAL_WIRE_MASK(SHOAL_WIRE_BF16),
                                  .out_mask = SHOAL_WIRE_MASK(SHOAL_WIRE_BF16) | SHOAL_WIRE_MASK(SHOAL_WIRE_F32),
                                  .owns = shoal_shard_owns, .owns_ctx = o->own};
    s->ctlcap = 4096 + SHOAL_PROTO_MAX_TEXT + o->nowned * 32 + o->ntrunk * (SHOAL_PROTO_MAX_NAME + 16) +
                SHOAL_PROTO_MAX_RELAY * (SHOAL_PROTO_MAX_ENDPOINT + 8);
    size_t tcols = 0;
    for (size_t i = 0; i < o->ntrunk; i++)
        if ((size_t)o->tmat[i].cols > tcols)
            tcols = (size_t)o->tmat[i].cols;
    s->tx_cap = tcols * (size_t)o->max_tokens;
    s->tx = s->tx_cap ? shoal_xmalloc(s->tx_cap * sizeof *s->tx) : NULL;
    for (size_t i = 0; i < o->ntrunk; i++) /* wholly owned, small enough to be a chain's first matrix */
        if (o->trunk[i].lo == 0 && (int)o->trunk[i].hi == o->tmat[i].rows - 1 &&
            o->tmat[i].rows <= SHOAL_PROTO_MAX_CHAIN_ROWS && o->tmat[i].rows > s->chain_rows)
            s->chain_rows = o->tmat[i].rows;
    s->ta = s->chain_rows ? shoal_xmalloc((size_t)s->chain_rows * (size_t)o->max_tokens * sizeof *s->ta) : NULL;
    s->ctl = shoal_xmalloc(s->ctlcap);
    size_t mt = (size_t)o->max_tokens, pairs = mt * (size_t)o->k;
    s->xe = shoal_xmalloc(mt * (size_t)d * sizeof *s->xe);
    s->ye = shoal_xmalloc(mt * (size_t)d * sizeof *s->ye);
    s->h = shoal_xmalloc(2 * mt * (size_t)f * sizeof *s->h);
    s->cnt = shoal_xcalloc((size_t)o->num_experts, sizeof *s->cnt);
    s->start = shoal_xcalloc((size_t)o->num_experts, sizeof *s->start);
    s->perm = shoal_xmalloc(pairs * sizeof *s->perm);
    s->views = shoal_xmalloc(pairs * sizeof *s->views);
    s->touched = shoal_xmalloc(pairs * sizeof *s->touched);
    s->pf_ids = shoal_xmalloc((size_t)o->num_experts * sizeof *s->pf_ids);
    snprintf(s->st.worker, sizeof s->st.worker, "%s", s->id);
    s->t0_us = now_us();
    *out = s;
    return 0;
}

void shoal_serve_close(shoal_serve *s)
{
    if (!s)
        return;
    free(s->ctl);
    free(s->tx);
    free(s->ta);
    free(s->xe);
    free(s->ye);
    free(s->h);
    free(s->cnt);
    free(s->start);
    free(s->perm);
    free(s->views);
    free(s->touched);
    free(s->pf_ids);
    free(s);
}

/* ---- peers ---------------------------------------------------------------- */

static peer *peer_find(shoal_serve *s, const uint8_t *id, size_t len)
{
    peer *p = s->last_peer; /* nearly always the one (a worker has one coordinator or few) */
    if (p && p->used && p->len == len && !memcmp(p->id, id, len))
        return p;
    for (int i = 0; i < s->npeers; i++)
        if (s->peers[i].used && s->peers[i].len == len && !memcmp(s->peers[i].id, id, len))
            return s->last_peer = &s->peers[i];
    return NULL;
}

/* 1 when id was not a peer yet */
static int peer_add(shoal_serve *s, const uint8_t *id, size_t len)
{
    if (len > sizeof s->peers[0].id)
        len = sizeof s->peers[0].id;
    peer *p = peer_find(s, id, len);
    int fresh = !p;
    if (!p) {
        if (s->npeers < MAX_PEERS) { /* slots are taken in order and never freed */
            p = &s->peers[s->npeers++];
        } else {
            p = &s->peers[0];
            for (int i = 1; i < MAX_PEERS; i++) /* the least recently used */
                if (s->peers[i].used < p->used)
                    p = &s->peers[i];
        }
        memcpy(p->id, id, len);
        p->len = len;
        s->last_peer = p;
    }
    p->used = ++s->clock;
    return fresh;
}

/* ---- replies -------------------------------------------------------------- */

static void reply_ctl(shoal_serve_reply *rep, shoal_serve *s, int type, size_t len)
{
    rep->frames[0] = (shoal_frame){s->ctl, len};
    rep->n = 1;
    rep->type = type;
}

static void reply_error(shoal_serve *s, shoal_serve_reply *rep, uint64_t rid, int perr, const char *msg)
{
    size_t len = 0;
    if (shoal_proto_enc_error(s->ctl, s->ctlcap, &len, rid, perr, msg))
        SHOAL_PANIC("ERROR reply does not fit its buffer");
    reply_ctl(rep, s, SHOAL_MSG_ERROR, len);
    s->st.errors++;
    s->last_perr = perr;
    /* exceptional, but a misbehaving peer must not flood the log */
    if (s->logged_errors < 20 || s->logged_errors % 1000 == 0)
        SHOAL_WARN("replied ERROR %s (rid %llu): %s", shoal_perr_name(perr), (unsigned long long)rid, msg);
    s->logged_errors++;
}

/* A reply's buffer from alloc; NULL after replying ERROR INTERNAL
 * "<what>: <alloc's reason>" (the reply budget's refusal) or "<what>: out of
 * memory for the N-byte reply". */
static uint8_t *alloc_reply(shoal_serve *s, shoal_serve_alloc_fn alloc, void *actx, size_t ylen, const char *what,
                            uint64_t rid, shoal_serve_reply *rep)
{
    char why[384] = "", msg[512];
    uint8_t *y = alloc(actx, ylen, why, sizeof why);
    if (!y) {
        if (why[0])
            snprintf(msg, sizeof msg, "%s: %s", what, why);
        else
            snprintf(msg, sizeof msg, "%s: out of memory for the %zu-byte reply", what, ylen);
        reply_error(s, rep, rid, SHOAL_PERR_INTERNAL, msg);
    }
    return y;
}

static void count_out(shoal_serve *s, const shoal_serve_reply *rep, int type, const shoal_frame *in, int nin)
{
    uint64_t in_bytes = 0, out_bytes = 0;
    for (int i = 0; i < nin; i++)
        in_bytes += in[i].len;
    for (int i = 0; i < rep->n; i++)
        out_bytes += rep->frames[i].len;
    s->st.bytes_out += out_bytes;
    shoal_wmetrics_request(s->o.metrics, type, in_bytes);
    if (rep->n) /* a notice has no reply */
        shoal_wmetrics_reply(s->o.metrics, out_bytes, s->last_perr);
}

static void do_hello(shoal_serve *s, const shoal_proto_msg *m, const uint8_t *peer_id, size_t peerlen,
                     shoal_serve_reply *rep)
{
    char msg[512];
    const shoal_proto_hello *h = &m->hello;
    if (h->major != SHOAL_PROTO_MAJOR) {
        snprintf(msg, sizeof msg, "protocol major version mismatch: coordinator %u.%u, worker %d.%d", h->major,
                 h->minor, SHOAL_PROTO_MAJOR, SHOAL_PROTO_MINOR);
        reply_error(s, rep, m->rid, SHOAL_PERR_VERSION, msg);
        return;
    }
    if (memcmp(h->fingerprint, s->fingerprint, SHOAL_PROTO_FP_BYTES)) {
        char a[65], b[65];
        shoal_proto_hex(h->fingerprint, a);
        shoal_proto_hex(s->fingerprint, b);
        snprintf(msg, sizeof msg, "model fingerprint mismatch: coordinator %s, worker %s", a, b);
        reply_error(s, rep, m->rid, SHOAL_PERR_FINGERPRINT, msg);
        return;
    }
    shoal_proto_hello r = {.major = SHOAL_PROTO_MAJOR, .minor = SHOAL_PROTO_MINOR,
                           .owned = (shoal_proto_range *)s->o.owned, .nowned = s->o.nowned,
                           .act_mask = s->lim.act_mask, .out_mask = s->lim.out_mask,
                           .max_tokens = (uint32_t)s->o.max_tokens, .threads = (uint32_t)s->o.threads,
                           .expert_bytes = s->o.store ? shoal_store_bytes(s->o.store) : s->bank ? shoal_bank_bytes(s->bank) : 0,
                           .mem_total = s->o.mem_total,
                           .prefetch = s->o.store && s->o.prefetch,
                           .trunk = (shoal_proto_trows *)s->o.trunk, .ntrunk = s->o.ntrunk};
    memcpy(r.fingerprint, s->fingerprint, SHOAL_PROTO_FP_BYTES);
    if (s->o.ntrunk)
        memcpy(r.trunk_fp, s->o.trunk_fp, SHOAL_PROTO_FP_BYTES);
    snprintf(r.id, sizeof r.id, "%s", s->id);
    snprintf(r.isa, sizeof r.isa, "%s", s->o.isa ? s->o.isa : "?");
    snprintf(r.numerics, sizeof r.numerics, "%s", shoal_numerics_name(shoal_kernels_numerics()));
    r.bf16_exact = shoal_kernels_numerics() == SHOAL_NUMERICS_MU && s->o.experts_round_input;
    for (int i = 0; i < s->o.nrelay && i < SHOAL_PROTO_MAX_RELAY; i++)
        snprintf(r.relay[r.nrelay++], sizeof r.relay[0], "%s", s->o.relay[i]);
    size_t len = 0;
    if (shoal_proto_enc_hello(s->ctl, s->ctlcap, &len, m->rid, &r, 1))
        SHOAL_PANIC("HELLO reply does not fit its buffer");
    reply_ctl(rep, s, SHOAL_MSG_HELLO, len);
    /* logged for a new connection only, and a peer opening connections in a
     * loop must not flood the log: the first 20, then every 1000th */
    int fresh = peer_add(s, peer_id, peerlen);
    s->last_peer->relay_parent = h->relay_parent; /* a second HELLO replaces the first */
    if (fresh) {
        if (s->hello_peers < 20 || s->hello_peers % 1000 == 0)
            SHOAL_INFO("HELLO from '%s' (protocol %u.%u)%s%s", h->id, h->major, h->minor,
                       h->relay_parent ? " as a relay parent" : "",
                       s->hello_peers >= 20 ? " (new connections counted; logged every 1000th)" : "");
        s->hello_peers++;
    }
}

int shoal_serve_relay_parent(shoal_serve *s, const uint8_t *peer_id, size_t peerlen)
{
    peer *p = peer_find(s, peer_id, peerlen > 256 ? 256 : peerlen);
    return p && p->relay_parent;
}

static void do_batch(shoal_serve *s, const shoal_proto_msg *m, uint64_t queue_us, shoal_serve_alloc_fn alloc,
                     void *actx, shoal_serve_reply *rep)
{
    char msg[512];
    int perr = shoal_proto_check_batch(m, &s->lim, msg, sizeof msg);
    if (perr) {
        reply_error(s, rep, m->rid, perr, msg);
        return;
    }
    if (s->o.delay_us) { /* fault tests: a slow worker, or one killed mid-request (the line is what they wait for) */
        SHOAL_INFO("test delay: EXPERT_BATCH %llu held %u ms", (unsigned long long)m->rid, s->o.delay_us / 1000u);
        usleep(s->o.delay_us);
    }
    uint64_t t0 = now_us();
    const shoal_proto_tensor *act = &m->batch.act, *route = &m->batch.route;
    uint32_t n = route->rows;
    int d = s->d, layer = (int)m->batch.layer;
    int out_dt = m->batch.out;
    size_t oes = shoal_wire_dtype_size(out_dt), ylen;
    if (shoal_proto_tensor_len(out_dt, n, (uint32_t)d, &ylen)) {
        reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, "EXPERT_BATCH: reply size overflows");
        return;
    }
    /* group the pairs by expert (counting sort, stable in pair order) */
    int ntouched = 0;
    for (uint32_t i = 0; i < n; i++) {
        int32_t t, e;
        shoal_proto_route_pair(route, i, &t, &e);
        if (s->cnt[e]++ == 0)
            s->touched[ntouched++] = e;
    }
    /* ascending expert order: the order the in-process engine uses */
    for (int i = 1; i < ntouched; i++) {
        int32_t v = s->touched[i];
        int j = i;
        for (; j > 0 && s->touched[j - 1] > v; j--)
            s->touched[j] = s->touched[j - 1];
        s->touched[j] = v;
    }
    int32_t at = 0;
    for (int i = 0; i < ntouched; i++) {
        s->start[s->touched[i]] = at;
        at += s->cnt[s->touched[i]];
    }
    for (uint32_t i = 0; i < n; i++) {
        int32_t t, e;
        shoal_proto_route_pair(route, i, &t, &e);
        s->perm[s->start[e]++] = (int32_t)i;
    }
    /* start[e] now points past e's pairs. Every expert must have weights
     * (ownership says so; a mismatch is a broken invariant, answered, not fatal) */
    int missing = -1;
    for (int i = 0; i < ntouched && missing < 0; i++)
        if (s->o.store ? !shoal_store_owns(s->o.store, layer, s->touched[i])
                       : !shoal_bank_get(s->bank, layer, s->touched[i]))
            missing = s->touched[i];
    /* a mapped shard truncated under us: refuse by name instead of SIGBUS */
    if (missing < 0 && !s->o.store && shoal_bank_check(s->bank, layer, s->touched, ntouched, msg, sizeof msg)) {
        for (int i = 0; i < ntouched; i++)
            s->cnt[s->touched[i]] = 0;
        reply_error(s, rep, m->rid, SHOAL_PERR_INTERNAL, msg);
        return;
    }
    char why[384] = "";
    uint8_t *y = missing < 0 ? alloc(actx, ylen, why, sizeof why) : NULL;
    if (!y) {
        for (int i = 0; i < ntouched; i++)
            s->cnt[s->touched[i]] = 0;
        if (missing >= 0)
            snprintf(msg, sizeof msg, "EXPERT_BATCH: layer %d expert %d is owned but has no weights bound", layer,
                     missing);
        else if (why[0])
            snprintf(msg, sizeof msg, "EXPERT_BATCH: %s", why);
        else
            snprintf(msg, sizeof msg, "EXPERT_BATCH: cannot allocate the %zu-byte reply", ylen);
        reply_error(s, rep, m->rid, SHOAL_PERR_INTERNAL, msg);
        return;
    }
    shoal_proto_tensor_hdr(y, out_dt, n, (uint32_t)d);
    const float b1 = s->o.store ? shoal_store_b1(s->o.store) : shoal_bank_b1(s->bank);
    const float b2 = s->o.store ? shoal_store_b2(s->o.store) : shoal_bank_b2(s->bank);
    size_t row_in = (size_t)d * shoal_wire_dtype_size(act->dtype);
    /* weights: all at once from the bank, or in passes of what the store's
     * slots hold (each pass's reads issued together; each expert waited for
     * just before it is used, so computing it overlaps the later reads).
     * Outputs land in each pair's own row, so the pass order changes nothing. */
    int ready = 0, pass0 = 0;
    for (int i = 0; i < ntouched; i++) {
        int32_t e = s->touched[i], ne = s->cnt[e];
        const int32_t *pi = s->perm + (s->start[e] - ne);
        if (i == ready) {
            if (s->o.store) {
                int got = shoal_store_fetch(s->o.store, layer, s->touched + i, ntouched - i, s->views + i, msg,
                                            sizeof msg);
                if (got < 0) {
                    for (int j = 0; j < ntouched; j++)
                        s->cnt[s->touched[j]] = 0;
                    reply_error(s, rep, m->rid, SHOAL_PERR_INTERNAL, msg);
                    return; /* the data frame is the caller's to free (rep->n == 1) */
                }
                pass0 = i;
                ready = i + got;
            } else {
                for (int j = i; j < ntouched; j++)
                    s->views[j] = shoal_bank_get(s->bank, layer, s->touched[j]);
                ready = ntouched;
            }
        }
        const shoal_expert_w *w = s->views[i];
        if (s->o.store && shoal_store_wait(s->o.store, i - pass0, msg, sizeof msg)) {
            for (int j = 0; j < ntouched; j++)
                s->cnt[s->touched[j]] = 0;
            reply_error(s, rep, m->rid, SHOAL_PERR_INTERNAL, msg);
            return; /* the data frame is the caller's to free (rep->n == 1) */
        }
        /* The expert's rows are read in place when they are consecutive fp32
         * rows of the activation frame, and its outputs written in place when
         * its pairs are consecutive rows of a bf16 reply -- always so in decode
         * (one pair per expert): no gather, no scatter. The kernels load and
         * store element by element whatever the alignment, so the results are
         * the same bits either way. */
        int32_t tf, ee;
        shoal_proto_route_pair(route, (uint32_t)pi[0], &tf, &ee);
        int in_place = act->dtype == SHOAL_WIRE_F32 && ((uintptr_t)act->data & 3) == 0;
        int out_place = out_dt == SHOAL_WIRE_BF16 && ((uintptr_t)y & 1) == 0;
        for (int j = 1; j < ne && (in_place || out_place); j++) {
            int32_t t;
            shoal_proto_route_pair(route, (uint32_t)pi[j], &t, &ee);
            in_place &= t == tf + j;
            out_place &= pi[j] == pi[0] + j;
        }
        const float *x = s->xe;
        if (in_place) {
            x = (const float *)(const void *)(act->data + (size_t)tf * row_in);
        } else {
            for (int j = 0; j < ne; j++) {
                int32_t t;
                shoal_proto_route_pair(route, (uint32_t)pi[j], &t, &ee);
                const uint8_t *src = act->data + (size_t)t * row_in;
                float *dst = s->xe + (size_t)j * d;
                if (act->dtype == SHOAL_WIRE_F32) {
                    memcpy(dst, src, row_in);
                } else {
                    for (int c = 0; c < d; c++)
                        dst[c] = shoal_bf16_to_f32((uint16_t)(src[2 * c] | src[2 * c + 1] << 8));
                }
            }
        }
        uint16_t *yo = out_place ? (uint16_t *)(void *)(y + SHOAL_PROTO_TENSOR_HDR + (size_t)pi[0] * d * 2) : s->ye;
        if (s->o.skip_compute) /* benchmarks of the exchange alone: everything but the FFNs */
            memset(yo, 0, (size_t)ne * d * sizeof *yo);
        else
            shoal_expert_ffn(yo, w, x, ne, b1, b2, s->h);
        shoal_wmetrics_expert(s->o.metrics, layer, e, (uint32_t)ne);
        for (int j = 0; j < ne && !out_place; j++) {
            uint8_t *dst = y + SHOAL_PROTO_TENSOR_HDR + (size_t)pi[j] * d * oes;
            const uint16_t *src = s->ye + (size_t)j * d;
            if (out_dt == SHOAL_WIRE_BF16) {
                memcpy(dst, src, (size_t)d * 2);
            } else {
                for (int c = 0; c < d; c++) {
                    float v = shoal_bf16_to_f32(src[c]);
                    memcpy(dst + 4 * (size_t)c, &v, 4);
                }
            }
        }
    }

    for (int i = 0; i < ntouched; i++)
        s->cnt[s->touched[i]] = 0;
    uint64_t compute_us = now_us() - t0;
    size_t len = 0;
    if (shoal_proto_enc_result(s->ctl, s->ctlcap, &len, m->rid, queue_us, compute_us))
        SHOAL_PANIC("EXPERT_RESULT does not fit its buffer");
    reply_ctl(rep, s, SHOAL_MSG_EXPERT_RESULT, len);
    rep->frames[1] = (shoal_frame){y, ylen};
    rep->n = 2;
    s->st.batches++;
    s->st.tokens += act->rows;
    s->st.pairs += n;
    s->st.queue_us += queue_us;
    s->st.compute_us += compute_us;
    shoal_wmetrics_batch(s->o.metrics, act->rows, n, (uint32_t)ntouched, queue_us, compute_us);
    shoal_wmetrics_activation(s->o.metrics, act->dtype, act->nbytes);
}

/* The owned range of trunk rows lo..hi of `name` (inside one range), or -1;
 * *named: some range of that matrix is owned. */
static int trunk_owner(const shoal_serve *s, const char *name, uint32_t lo, uint32_t hi, int *named)
{
    *named = 0;
    for (size_t j = 0; j < s->o.ntrunk; j++) {
        const shoal_proto_trows *o = &s->o.trunk[j];
        if (strcmp(o->name, name))
            continue;
        *named = 1;
        if (o->lo <= lo && hi <= o->hi)
            return (int)j;
    }
    return -1;
}

static void tgemm(float *y, const shoal_serve_tmat *tm, size_t skip_rows, const float *x, int n, int T)
{
    size_t skip = skip_rows * (size_t)tm->cols;
    if (tm->bf16)
        shoal_gemm_bf16(y, (const uint16_t *)tm->w + skip, x, n, tm->cols, T);
    else
        shoal_gemm_f32(y, (const float *)tm->w + skip, x, n, tm->cols, T);
}

/* TRUNK_BATCH (PROTOCOL.md §3.7): every segment inside one owned range,
 * of the input's width; each computed with the coordinator's in-process
 * kernel (shoal_gemm_bf16/f32 over the segment's rows), so every output
 * element has the bits it has in-process (kernels/README.md, contract 1).
 * A chained segment (1.4) applies every row of its first matrix (owned whole
 * here) to x with the same kernel, then its rows of the second to that
 * output: the first output is what the coordinator computes in-process, so
 * the second's elements keep their bits too. */
static void do_tbatch(shoal_serve *s, const shoal_proto_msg *m, uint64_t queue_us, shoal_serve_alloc_fn alloc,
                      void *actx, shoal_serve_reply *rep)
{
    char msg[512];
    const shoal_proto_tensor *x = &m->tbatch.x;
    int owner[SHOAL_PROTO_MAX_TSEGS], aown[SHOAL_PROTO_MAX_TCHAIN], bown[SHOAL_PROTO_MAX_TCHAIN];
    uint64_t total = 0;
    int named;
    if (!s->o.ntrunk) {
        reply_error(s, rep, m->rid, SHOAL_PERR_NOT_OWNED, "TRUNK_BATCH: this worker owns no trunk rows");
        return;
    }
    if (x->rows > (uint32_t)s->o.max_tokens) {
        snprintf(msg, sizeof msg, "TRUNK_BATCH: x has %u rows, max_tokens is %d", x->rows, s->o.max_tokens);
        reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
        return;
    }
    for (uint32_t i = 0; i < m->tbatch.n; i++) {
        const shoal_proto_trows *g = &m->tbatch.seg[i];
        int k = trunk_owner(s, g->name, g->lo, g->hi, &named);
        if (k < 0) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: rows %u-%u of %s are not owned by this worker%s", g->lo, g->hi,
                     g->name, named ? " (not inside one owned range)" : "");
            reply_error(s, rep, m->rid, SHOAL_PERR_NOT_OWNED, msg);
            return;
        }
        if ((uint32_t)s->o.tmat[k].cols != x->cols) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: x has %u columns, %s has %d", x->cols, g->name,
                     s->o.tmat[k].cols);
            reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
            return;
        }
        owner[i] = k;
        total += (uint64_t)(g->hi - g->lo + 1);
    }
    for (uint32_t i = 0; i < m->tbatch.nchain; i++) {
        const shoal_proto_tchain *ch = &m->tbatch.chain[i];
        int a = -1;
        for (size_t j = 0; j < s->o.ntrunk && a < 0; j++)
            if (!strcmp(s->o.trunk[j].name, ch->a) && s->o.trunk[j].lo == 0 &&
                (int)s->o.trunk[j].hi == s->o.tmat[j].rows - 1)
                a = (int)j;
        if (a < 0) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: chain[%u]: this worker does not own all rows of %s", i, ch->a);
            reply_error(s, rep, m->rid, SHOAL_PERR_NOT_OWNED, msg);
            return;
        }
        const shoal_serve_tmat *ta = &s->o.tmat[a];
        if ((uint32_t)ta->cols != x->cols || ta->rows > s->chain_rows) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: chain[%u]: %s is [%d, %d]; x has %u columns, a chain's first "
                     "matrix has at most %d rows", i, ch->a, ta->rows, ta->cols, x->cols, SHOAL_PROTO_MAX_CHAIN_ROWS);
            reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
            return;
        }
        int b = trunk_owner(s, ch->b.name, ch->b.lo, ch->b.hi, &named);
        if (b < 0) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: chain[%u]: rows %u-%u of %s are not owned by this worker%s", i,
                     ch->b.lo, ch->b.hi, ch->b.name, named ? " (not inside one owned range)" : "");
            reply_error(s, rep, m->rid, SHOAL_PERR_NOT_OWNED, msg);
            return;
        }
        if (s->o.tmat[b].cols != ta->rows) {
            snprintf(msg, sizeof msg, "TRUNK_BATCH: chain[%u]: %s has %d columns, %s gives %d", i, ch->b.name,
                     s->o.tmat[b].cols, ch->a, ta->rows);
            reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
            return;
        }
        aown[i] = a;
        bown[i] = b;
        total += (uint64_t)(ch->b.hi - ch->b.lo + 1);
    }
    /* A bf16 x (1.7) only where it is exact: in the mu class every product
     * reading x (each segment's matrix, each chain's first) must have BF16
     * weights, whose mu kernel rounds x to bf16 anyway; an F32 matrix, or the
     * portable class, would compute with the rounded values and change the
     * bits, so it is refused instead (PROTOCOL.md §3.7). */
    if (x->dtype == SHOAL_WIRE_BF16) {
        const char *f32 = NULL;
        for (uint32_t i = 0; i < m->tbatch.n && !f32; i++)
            if (!s->o.tmat[owner[i]].bf16)
                f32 = m->tbatch.seg[i].name;
        for (uint32_t i = 0; i < m->tbatch.nchain && !f32; i++)
            if (!s->o.tmat[aown[i]].bf16)
                f32 = m->tbatch.chain[i].a;
        if (shoal_kernels_numerics() != SHOAL_NUMERICS_MU || f32) {
            if (f32)
                snprintf(msg, sizeof msg, "TRUNK_BATCH: x is bf16, but %s has F32 weights: its product needs the f32 x",
                         f32);
            else
                snprintf(msg, sizeof msg, "TRUNK_BATCH: x is bf16, but this worker computes the %s class, which "
                         "reads x in f32: send it f32", shoal_numerics_name(shoal_kernels_numerics()));
            reply_error(s, rep, m->rid, SHOAL_PERR_UNSUPPORTED, msg);
            return;
        }
    }
    /* No row twice in one reply: duplicated or overlapping segments (of
     * `mats`, or of the chains' b rows) would let a small request ask for a
     * reply many times its size (PROTOCOL.md section 6). Adjacent is fine. */
    uint32_t nseg = m->tbatch.n + m->tbatch.nchain;
    for (uint32_t i = 0; i < nseg; i++) {
        const shoal_proto_trows *gi = i < m->tbatch.n ? &m->tbatch.seg[i] : &m->tbatch.chain[i - m->tbatch.n].b;
        for (uint32_t j = i + 1; j < nseg; j++) {
            const shoal_proto_trows *gj = j < m->tbatch.n ? &m->tbatch.seg[j] : &m->tbatch.chain[j - m->tbatch.n].b;
            if (gi->lo <= gj->hi && gj->lo <= gi->hi && !strcmp(gi->name, gj->name)) {
                snprintf(msg, sizeof msg, "TRUNK_BATCH: rows %u-%u and %u-%u of %s overlap (segments %u and %u): "
                         "a request asks for each row at most once", gi->lo, gi->hi, gj->lo, gj->hi, gi->name, i, j);
                reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
                return;
            }
        }
    }
    uint64_t nout = total * x->rows;
    if (nout > UINT32_MAX || nout * 4 > (1ull << 31)) {
        snprintf(msg, sizeof msg, "TRUNK_BATCH: %llu outputs exceed the 2 GiB reply limit", (unsigned long long)nout);
        reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, msg);
        return;
    }
    if (s->o.delay_us) { /* fault tests: a slow worker, or one killed mid-request (the line is what they wait for) */
        SHOAL_INFO("test delay: TRUNK_BATCH %llu held %u ms", (unsigned long long)m->rid, s->o.delay_us / 1000u);
        usleep(s->o.delay_us);
    }
    uint64_t t0 = now_us();
    size_t ylen;
    if (shoal_proto_tensor_len(SHOAL_WIRE_F32, 1, (uint32_t)nout, &ylen)) {
        reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, "TRUNK_BATCH: reply too large");
        return;
    }
    uint8_t *y = alloc_reply(s, alloc, actx, ylen, "TRUNK_BATCH", m->rid, rep);
    if (!y)
        return;
    shoal_proto_tensor_hdr(y, SHOAL_WIRE_F32, 1, (uint32_t)nout);
    if (x->dtype == SHOAL_WIRE_F32) {
        memcpy(s->tx, x->data, x->nbytes); /* the frame is unaligned in general */
    } else { /* bf16, widened exactly: the mu kernels round it back to itself */
        size_t nx = (size_t)x->rows * x->cols;
        for (size_t i = 0; i < nx; i++)
            s->tx[i] = shoal_bf16_to_f32((uint16_t)(x->data[2 * i] | x->data[2 * i + 1] << 8));
    }
    /* the reply frame: 16-byte header, then floats (the allocation is at least
     * 16-byte aligned, so the payload is float-aligned) */
    float *out = (float *)(void *)(y + SHOAL_PROTO_TENSOR_HDR);
    int T = (int)x->rows;
    if (s->o.skip_compute) { /* benchmark hook: the exchange and the reply, zeros instead of the rows */
        memset(out, 0, (size_t)nout * sizeof *out);
        nout = 0;
    }
    for (uint32_t i = 0; i < m->tbatch.n && nout; i++) {
        const shoal_proto_trows *g = &m->tbatch.seg[i];
        int n = (int)(g->hi - g->lo + 1);
        tgemm(out, &s->o.tmat[owner[i]], g->lo - s->o.trunk[owner[i]].lo, s->tx, n, T);
        out += (size_t)n * (size_t)T;
    }
    for (uint32_t i = 0; i < m->tbatch.nchain && nout; i++) {
        const shoal_proto_tchain *ch = &m->tbatch.chain[i];
        int n = (int)(ch->b.hi - ch->b.lo + 1);
        if (!i || aown[i] != aown[i - 1]) /* consecutive segments of one chain share its first output */
            tgemm(s->ta, &s->o.tmat[aown[i]], 0, s->tx, s->o.tmat[aown[i]].rows, T);
        tgemm(out, &s->o.tmat[bown[i]], ch->b.lo - s->o.trunk[bown[i]].lo, s->ta, n, T);
        out += (size_t)n * (size_t)T;
    }
    uint64_t compute_us = now_us() - t0;
    size_t len = 0;
    if (shoal_proto_enc_tresult(s->ctl, s->ctlcap, &len, m->rid, queue_us, compute_us))
        SHOAL_PANIC("TRUNK_RESULT does not fit its buffer");
    reply_ctl(rep, s, SHOAL_MSG_TRUNK_RESULT, len);
    rep->frames[1] = (shoal_frame){y, ylen};
    rep->n = 2;
    s->tbatches++;
    shoal_wmetrics_activation(s->o.metrics, x->dtype, x->nbytes);
    s->st.queue_us += queue_us;
    s->st.compute_us += compute_us;
}

/* PREFETCH: a notice, never answered (rep->n stays 0). */
static void do_prefetch(shoal_serve *s, const shoal_proto_msg *m)
{
    uint32_t layer = m->prefetch.layer;
    if (layer >= (uint32_t)s->o.num_layers || !s->o.is_moe[layer]) {
        s->pf_dropped++;
        shoal_wmetrics_prefetch_dropped(s->o.metrics);
        return;
    }
    if (!s->o.store || !s->o.prefetch)
        return; /* nothing to read ahead: the experts are mapped, or hints are off */
    int n = 0;
    for (uint32_t i = 0; i < m->prefetch.n; i++)
        if (m->prefetch.experts[i] < (uint32_t)s->o.num_experts)
            s->pf_ids[n++] = (int32_t)m->prefetch.experts[i];
    shoal_store_prefetch(s->o.store, (int)layer, s->pf_ids, n);
}

/* PROBE (1.5, PROTOCOL.md §3.8): y of the asked size (zeros) and, when asked,
 * the host facts, measured now (about a second). */
static void do_probe(shoal_serve *s, const shoal_proto_msg *m, shoal_serve_alloc_fn alloc, void *actx,
                     shoal_serve_reply *rep)
{
    size_t ylen;
    if (shoal_proto_tensor_len(SHOAL_WIRE_F32, 1, m->probe.reply / 4, &ylen)) {
        reply_error(s, rep, m->rid, SHOAL_PERR_BAD_SHAPE, "PROBE: reply size");
        return;
    }
    uint8_t *y = alloc_reply(s, alloc, actx, ylen, "PROBE", m->rid, rep);
    if (!y)
        return;
    shoal_proto_tensor_hdr(y, SHOAL_WIRE_F32, 1, m->probe.reply / 4);
    memset(y + SHOAL_PROTO_TENSOR_HDR, 0, ylen - SHOAL_PROTO_TENSOR_HDR);
    shoal_proto_facts f;
    memset(&f, 0, sizeof f);
    uint64_t now = now_us();
    if (!s->facts_at_us)
        s->facts_tokens = FACTS_BURST;
    else
        s->facts_tokens += (double)(now - s->facts_at_us) / FACTS_EVERY_US;
    if (s->facts_tokens > FACTS_BURST)
        s->facts_tokens = FACTS_BURST;
    s->facts_at_us = now;
    if (m->probe.facts && s->facts_tokens < 1 && s->facts.has) {
        f = s->facts; /* over the rate: the last figures again */
        f.measure_us = 0;
    } else if (m->probe.facts) {
        s->facts_tokens -= 1;
        shoal_hostfacts_measure(&f, s->o.model_dir, s->o.threads);
        snprintf(f.isa, sizeof f.isa, "%s", s->o.isa ? s->o.isa : "?");
        f.threads = (uint32_t)s->o.threads;
        f.held_bytes = s->o.store ? shoal_store_bytes(s->o.store) : s->bank ? shoal_bank_bytes(s->bank) : 0;
        for (size_t i = 0; i < s->o.ntrunk; i++)
            f.held_bytes += (uint64_t)(s->o.trunk[i].hi - s->o.trunk[i].lo + 1) * (uint64_t)s->o.tmat[i].cols *
                            (s->o.tmat[i].bf16 ? 2u : 4u);
        s->facts = f;
    }
    size_t len = 0;
    if (shoal_proto_enc_probe_reply(s->ctl, s->ctlcap, &len, m->rid, &f))
        SHOAL_PANIC("PROBE_REPLY does not fit its buffer");
    reply_ctl(rep, s, SHOAL_MSG_PROBE_REPLY, len);
    rep->frames[1] = (shoal_frame){y, ylen};
    rep->n = 2;
}

static void handle(shoal_serve *s, const uint8_t *peer_id, size_t peerlen, const shoal_frame *in, int nin,
                   const shoal_frame *xf, uint64_t queue_us, shoal_serve_alloc_fn alloc, void *actx,
                   shoal_serve_reply *rep);

void shoal_serve_handle(shoal_serve *s, const uint8_t *peer_id, size_t peerlen, const shoal_frame *in, int nin,
                        uint64_t queue_us, shoal_serve_alloc_fn alloc, void *actx, shoal_serve_reply *rep)
{
    handle(s, peer_id, peerlen, in, nin, NULL, queue_us, alloc, actx, rep);
}

void shoal_serve_handle_relayed(shoal_serve *s, const uint8_t *peer_id, size_t peerlen, const shoal_frame *in,
                                int nin, const shoal_frame *x, uint64_t queue_us, shoal_serve_alloc_fn alloc,
                                void *actx, shoal_serve_reply *rep)
{
    handle(s, peer_id, peerlen, in, nin, x, queue_us, alloc, actx, rep);
}

static void handle(shoal_serve *s, const uint8_t *peer_id, size_t peerlen, const shoal_frame *in, int nin,
                   const shoal_frame *xf, uint64_t queue_us, shoal_serve_alloc_fn alloc, void *actx,
                   shoal_serve_reply *rep)
{
    memset(rep, 0, sizeof *rep);
    s->last_perr = 0;
    s->st.requests++;
    for (int i = 0; i < nin; i++)
        s->st.bytes_in += in[i].len;
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr = 0;
    char msg[512];
    if (shoal_proto_decode(in, nin, SHOAL_SIDE_WORKER, &m, &perr, msg, sizeof msg)) {
        if (m.type == SHOAL_MSG_PREFETCH) { /* a notice: dropped, never answered */
            s->pf_notices++;
            s->pf_dropped++;
            shoal_wmetrics_prefetch_dropped(s->o.metrics);
            goto done;
        }
        reply_error(s, rep, m.rid, perr ? perr : SHOAL_PERR_MALFORMED, msg);
        goto done;
    }
    if (m.type == SHOAL_MSG_HELLO) {
        do_hello(s, &m, peer_id, peerlen, rep);
        goto done;
    }
    peer *p = peer_find(s, peer_id, peerlen > 256 ? 256 : peerlen);
    if (m.type == SHOAL_MSG_TRUNK_X) { /* a notice from a relay parent (taken by the server loop); else refused */
        if (p && p->relay_parent) {
            p->used = ++s->clock;
        } else {
            snprintf(msg, sizeof msg, "TRUNK_X refused: this connection is not a relay parent (PROTOCOL.md 3.9: "
                                      "only a worker whose HELLO said `relay` may send it)");
            reply_error(s, rep, 0, SHOAL_PERR_UNKNOWN_TYPE, msg);
            shoal_wmetrics_relay(s->o.metrics, SHOAL_WRELAY_REFUSED);
        }
        goto done;
    }
    if (m.type == SHOAL_MSG_PREFETCH) {
        s->pf_notices++;
        if (p) {
            p->used = ++s->clock;
            do_prefetch(s, &m);
        } else {
            s->pf_dropped++;
            shoal_wmetrics_prefetch_dropped(s->o.metrics);
        }
        goto done;
    }
    if (!p) {
        snprintf(msg, sizeof msg, "%s before HELLO on this connection", shoal_msg_type_name(m.type));
        reply_error(s, rep, m.rid, SHOAL_PERR_NO_HELLO, msg);
        goto done;
    }
    p->used = ++s->clock;
    size_t len = 0;
    switch (m.type) {
    case SHOAL_MSG_PING:
        shoal_proto_enc_empty(s->ctl, s->ctlcap, &len, SHOAL_MSG_PONG, m.rid);
        reply_ctl(rep, s, SHOAL_MSG_PONG, len);
        break;
    case SHOAL_MSG_STATS: {
        shoal_proto_stats st;
        shoal_serve_stats(s, &st);
        shoal_proto_enc_stats(s->ctl, s->ctlcap, &len, m.rid, &st);
        reply_ctl(rep, s, SHOAL_MSG_STATS_REPLY, len);
        break;
    }
    case SHOAL_MSG_SHUTDOWN:
        if (s->o.refuse_shutdown) { /* a local worker: only its parent stops it, by SIGTERM */
            reply_error(s, rep, m.rid, SHOAL_PERR_UNKNOWN_TYPE,
                        "SHUTDOWN refused: this worker was started by its coordinator (--refuse-shutdown), which "
                        "stops it with SIGTERM");
            break;
        }
        shoal_proto_enc_empty(s->ctl, s->ctlcap, &len, SHOAL_MSG_SHUTDOWN_ACK, m.rid);
        reply_ctl(rep, s, SHOAL_MSG_SHUTDOWN_ACK, len);
        rep->shutdown = 1;
        break;
    case SHOAL_MSG_EXPERT_BATCH:
        do_batch(s, &m, queue_us, alloc, actx, rep);
        break;
    case SHOAL_MSG_TRUNK_BATCH:
        if (!m.tbatch.has_x) { /* relayed (1.8): x is the TRUNK_X of its xid, paired by the server loop */
            char why[256];
            if (!xf) {
                snprintf(msg, sizeof msg, "TRUNK_BATCH: relayed input xid %llu was not paired with its TRUNK_X",
                         (unsigned long long)m.tbatch.relay.xid);
                reply_error(s, rep, m.rid, SHOAL_PERR_INTERNAL, msg);
                break;
            }
            if (shoal_proto_tensor_decode(xf, &m.tbatch.x, why, sizeof why) ||
                (m.tbatch.x.dtype != SHOAL_WIRE_F32 && m.tbatch.x.dtype != SHOAL_WIRE_BF16)) {
                snprintf(msg, sizeof msg, "TRUNK_BATCH: the relayed x of xid %llu: %s",
                         (unsigned long long)m.tbatch.relay.xid, m.tbatch.x.dtype ? "dtype not f32 or bf16" : why);
                reply_error(s, rep, m.rid, SHOAL_PERR_MALFORMED, msg);
                break;
            }
        }
        do_tbatch(s, &m, queue_us, alloc, actx, rep);
        break;
    case SHOAL_MSG_PROBE:
        do_probe(s, &m, alloc, actx, rep);
        break;
    default: /* decode only passes requests */
        reply_error(s, rep, m.rid, SHOAL_PERR_UNKNOWN_TYPE, "not a request");
        break;
    }
done:
    count_out(s, rep, m.type, in, nin);
    shoal_proto_msg_clear(&m);
}

void shoal_serve_refuse(shoal_serve *s, const shoal_frame *in, int nin, int perr, const char *msg,
                        shoal_serve_reply *rep)
{
    memset(rep, 0, sizeof *rep);
    s->last_perr = 0;
    s->st.requests++;
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int dummy;
    shoal_proto_decode(in, nin, SHOAL_SIDE_WORKER, &m, &dummy, NULL, 0);
    if (m.type != SHOAL_MSG_PREFETCH) /* a notice is never answered */
        reply_error(s, rep, m.rid, perr, msg);
    count_out(s, rep, m.type, in, nin);
    shoal_proto_msg_clear(&m);
}

void shoal_serve_prefetch_counts(const shoal_serve *s, uint64_t *notices, uint64_t *dropped)
{
    *notices = s->pf_notices;
    *dropped = s->pf_dropped;
}

void shoal_serve_stats(const shoal_serve *s, shoal_proto_stats *out)
{
    *out = s->st;
    out->uptime_us = now_us() - s->t0_us;
}
