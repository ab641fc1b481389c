/* The expert client's worker links (the split: expert_client_int.h): connect,
 * HELLO and the ownership checks, down and back (the keeper thread: probe
 * HELLOs with backoff, re-verification, warm-up), open and close.
 *
 * Warm-up. The forward thread never allocates (expert_client.c); most of
 * zmq's allocations (a pipe's queue chunks, connection set-up) happen on
 * first use of a connection, so every new connection is warmed up by the
 * thread that verifies it (open, keeper) before the forward thread uses it;
 * see warm_send(). */
#include "coordinator/cluster/expert_client_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/log.h"
#include "common/utf8.h"
#include "coordinator/obs/obs.h"
#include "coordinator/cluster/owners.h"
#include "kernels/kernels.h"
#include "proto/fprint.h"
#include "proto/shard.h"

#define BACKOFF_MIN_MS 100u          /* first re-HELLO after a failure ... */
#define BACKOFF_MAX_MS 5000u         /* ... doubling up to this */
#define KEEPER_TICK_MS 100u          /* disconnects and stale replies noticed within this */
/* ZeroMQ queues a pipe's messages in chunks of 256 (message_pipe_granularity)
 * and recycles one spare chunk once the reader has left it: the first time a
 * new connection's outbound pipe fills a chunk, the sender allocates the next
 * one. This many PINGs (one frame each) make the thread that verified the
 * connection take that allocation; afterwards the chunks are recycled, since
 * every request is read by zmq before its reply can come back. */
#define WARM_PINGS 260
#define WARM_ROUNDS 40
/* Workers per zmq I/O thread: each layer's sends post at most one command
 * per message (the batch, and a PREFETCH hint) and worker to the I/O thread's
 * queue of 16-command chunks; at most 16 per burst wrap it at most once,
 * onto the spare chunk. */
#define WORKERS_PER_IO_THREAD 8

/* ---- HELLO and ownership (open) --------------------------------------------- */

static int send_hello(shoal_expert_client *c, shoal__ec_worker *w, uint64_t rid, char *err, size_t errlen)
{
    shoal_proto_hello h = {.major = SHOAL_PROTO_MAJOR, .minor = SHOAL_PROTO_MINOR};
    memcpy(h.fingerprint, c->o.fingerprint, SHOAL_PROTO_FP_BYTES);
    if (c->o.peer)
        snprintf(h.id, sizeof h.id, "%s", c->o.peer);
    else
        snprintf(h.id, sizeof h.id, "coordinator %d", (int)getpid());
    uint8_t buf[256];
    size_t len;
    if (shoal_proto_enc_hello(buf, sizeof buf, &len, rid, &h, 0))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "HELLO does not encode (peer name too long?)");
    if (zmq_send(w->sock, buf, len, ZMQ_DONTWAIT) < 0)
        return -errno;
    return 0;
}

/* Check a worker's HELLO (decoded, type HELLO) against this coordinator:
 * major version, fingerprint, a valid shard, the wire dtypes and the batch
 * size. `name` names the worker in the message. */
static int check_hello(shoal_expert_client *c, const char *name, const shoal_proto_hello *h, char *err, size_t errlen)
{
    char why[512];
    int rc;
    if (h->major != SHOAL_PROTO_MAJOR)
        return shoal_err_set(err, errlen, SHOAL_EVERSION,
                             "expert worker %s: protocol major version mismatch: coordinator %d.%d, worker %u.%u", name,
                             SHOAL_PROTO_MAJOR, SHOAL_PROTO_MINOR, h->major, h->minor);
    if (memcmp(h->fingerprint, c->o.fingerprint, SHOAL_PROTO_FP_BYTES)) {
        char a[65], b[65];
        shoal_proto_hex(c->o.fingerprint, a);
        shoal_proto_hex(h->fingerprint, b);
        return shoal_err_set(err, errlen, SHOAL_EFINGERPRINT,
                             "expert worker %s: model fingerprint mismatch: coordinator %s, worker %s", name, a, b);
    }
    if ((h->nowned || !h->ntrunk) &&
        (rc = shoal_shard_check(h->owned, h->nowned, c->L, c->cfg->is_moe, c->E, why, sizeof why)))
        return shoal_err_set(err, errlen, rc, "expert worker %s: %s", name, why);
    if (c->o.trunk_role && h->ntrunk) { /* the rows exist here, and the matrices are the same as here */
        uint8_t tfp[SHOAL_PROTO_FP_BYTES];
        if ((rc = shoal_tshard_check(h->trunk, h->ntrunk, c->tmats, c->ntmats, why, sizeof why)))
            return shoal_err_set(err, errlen, rc, "trunk worker %s: %s", name, why);
        if ((rc = shoal_fprint_trunk(tfp, c->o.st, h->trunk, h->ntrunk, why, sizeof why)))
            return shoal_err_set(err, errlen, rc, "trunk worker %s: %s", name, why);
        if (memcmp(tfp, h->trunk_fp, SHOAL_PROTO_FP_BYTES)) {
            char a[65], b[65];
            shoal_proto_hex(tfp, a);
            shoal_proto_hex(h->trunk_fp, b);
            return shoal_err_set(err, errlen, SHOAL_EFINGERPRINT,
                                 "trunk worker %s: trunk fingerprint mismatch: coordinator %s, worker %s", name, a, b);
        }
    }
    /* one numerics class per cluster: a worker computing another order would
     * change the ids (docs/ARCHITECTURE.md, "Numerics classes") */
    const char *mine = shoal_numerics_name(shoal_kernels_numerics());
    if (strcmp(h->numerics, mine))
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "%s worker %s computes numerics class '%s', this coordinator '%s': one class per cluster "
                             "(start every process with the same --numerics)",
                             h->ntrunk && !h->nowned ? "trunk" : "expert", name, h->numerics, mine);
    if (!(h->act_mask & SHOAL_WIRE_MASK(SHOAL_WIRE_F32)) || !(h->out_mask & SHOAL_WIRE_MASK(SHOAL_WIRE_BF16)))
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "expert worker %s does not offer f32 activations and "
                             "bf16 outputs", name);
    if (h->max_tokens < (uint32_t)c->o.max_tokens)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "expert worker %s accepts %u tokens per request, the "
                             "coordinator needs %d (start it with --max-tokens %d)", name, h->max_tokens,
                             c->o.max_tokens, c->o.max_tokens);
    return 0;
}

/* Which activations go to w as bf16 (PROTOCOL.md 1.7), from its accepted
 * HELLO: only in the mu class, where the worker's products round their input
 * to bf16 with the same function the coordinator packs with
 * (shoal_mu_round_bf16), so the bits are those of the f32 input; a 1.0-1.6
 * worker, or --wire-act f32, keeps f32. smu held (or at open). */
static void set_wire16(shoal_expert_client *c, shoal__ec_worker *w, const shoal_proto_hello *h)
{
    int on = !c->o.wire_f32 && shoal_kernels_numerics() == SHOAL_NUMERICS_MU && h->minor >= 7;
    w->act16 = on && h->bf16_exact && (h->act_mask & SHOAL_WIRE_MASK(SHOAL_WIRE_BF16));
    w->trunk16 = on && h->ntrunk > 0;
}

/* The relay tree (PROTOCOL.md §3.9) from w's accepted HELLO: its index in
 * its own relay list under the endpoint we reach it at, and a hash of the
 * list (FNV-1a over the endpoints, NUL-separated): a tree joins only workers
 * with the same list, so one index names the same worker on each of them.
 * smu held (or at open). */
static void set_relay(shoal__ec_worker *w, const shoal_proto_hello *h)
{
    w->relay_idx = -1;
    w->relay_hash = 0;
    if (h->minor < 8 || !h->nrelay)
        return;
    uint64_t x = 1469598103934665603ull;
    for (uint32_t i = 0; i < h->nrelay; i++) {
        for (const char *p = h->relay[i];; p++) {
            x = (x ^ (uint8_t)*p) * 1099511628211ull;
            if (!*p)
                break;
        }
        if (!strcmp(h->relay[i], w->endpoint))
            w->relay_idx = (int)i;
    }
    w->relay_hash = x;
}

/* Handle a HELLO reply from w at open: checks and records ownership. */
static int take_hello(shoal_expert_client *c, shoal__ec_worker *w, const shoal_frame *f, int nf, char *err,
                      size_t errlen)
{
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr, rc;
    char why[512];
    if (shoal_proto_decode(f, nf, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why)) {
        rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "expert worker %s: malformed HELLO reply: %s", w->endpoint, why);
        goto out;
    }
    if (m.type == SHOAL_MSG_ERROR) {
        char e2[401]; /* the peer's text */
        rc = shoal_err_set(err, errlen, shoal_perr_to_err((int)m.error.code),
                           "expert worker %s refused HELLO: %s: %s", w->endpoint, shoal_perr_name((int)m.error.code),
                           shoal_utf8_clip(e2, sizeof e2, m.error.message, SHOAL_UTF8_NOCTRL));
        goto out;
    }
    if (m.type != SHOAL_MSG_HELLO || m.rid != 1) {
        rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "expert worker %s answered HELLO with %s (rid %llu)", w->endpoint,
                           shoal_msg_type_name(m.type), (unsigned long long)m.rid);
        goto out;
    }
    const shoal_proto_hello *h = &m.hello;
    snprintf(w->name, sizeof w->name, "%s (%s)", h->id, w->endpoint);
    if ((rc = check_hello(c, w->name, h, err, errlen)))
        goto out;
    w->max_tokens = h->max_tokens;
    snprintf(w->id, sizeof w->id, "%s", h->id);
    w->expert_bytes = h->expert_bytes;
    w->mem_total = h->mem_total;
    w->prefetch = h->minor >= 2 && h->prefetch;
    w->chain = h->minor >= 4;
    set_wire16(c, w, h);
    set_relay(w, h);
    w->owned = h->owned;
    w->nowned = h->nowned;
    m.hello.owned = NULL; /* taken */
    w->trunk = h->trunk;
    w->ntrunk = h->ntrunk;
    m.hello.trunk = NULL;
    SHOAL_INFO("expert worker %s: %zu range%s, isa %s, %u threads, %.1f MiB of experts", w->name, w->nowned,
               w->nowned == 1 ? "" : "s", h->isa, h->threads, (double)h->expert_bytes / 1048576.0);
    rc = 0;
out:
    shoal_proto_msg_clear(&m);
    return rc;
}

/* The client's role in the keeper's log lines (one keeper per client). */
#define ROLE(c) ((c)->o.trunk_role ? "trunk" : "expert")

static const shoal_tshard_mat *sort_mats; /* trunk_place's qsort only (open is not reentrant on one client) */
static int by_name(const void *a, const void *b)
{
    return strcmp(sort_mats[*(const int32_t *)a].name, sort_mats[*(const int32_t *)b].name);
}

/* Trunk role, at open: the row cells of every announced matrix with their
 * owners (proto/tshard.h), refused with the gaps named; the names sorted for
 * the forward's lookup; the request buffers. */
static int trunk_place(shoal_expert_client *c, char *err, size_t errlen)
{
    const shoal_proto_trows **t = shoal_xcalloc((size_t)c->nw, sizeof *t);
    size_t *nt = shoal_xcalloc((size_t)c->nw, sizeof *nt), any = 0;
    for (int i = 0; i < c->nw; i++) {
        t[i] = c->w[i].trunk;
        nt[i] = c->w[i].ntrunk;
        any += nt[i];
    }
    c->tremote = shoal_xcalloc((size_t)c->ntmats + 1, 1);
    int rc = any ? shoal_tshard_cells(c->tmats, c->ntmats, c->nw, t, nt, c->tremote, &c->cells, &c->ncells, &c->cown,
                                      &c->ncown, err, errlen)
                 : shoal_err_set(err, errlen, SHOAL_ECONFIG, "--trunk remote: no worker announces trunk rows "
                                 "(start them with shoal expert --trunk ROWSPEC)");
    free(t);
    free(nt);
    if (rc)
        return rc;
    c->cbeg = shoal_xcalloc((size_t)c->ntmats, sizeof *c->cbeg);
    c->ccnt = shoal_xcalloc((size_t)c->ntmats, sizeof *c->ccnt);
    size_t replicated = 0;
    for (size_t i = c->ncells; i-- > 0;) {
        c->cbeg[c->cells[i].mat] = (int32_t)i;
        c->ccnt[c->cells[i].mat]++;
        replicated += c->cells[i].n > 1;
    }
    c->maxc = 1;
    for (int k = 0; k < c->ntmats; k++)
        c->maxc = c->ccnt[k] > c->maxc ? c->ccnt[k] : c->maxc;
    c->tpick = shoal_xcalloc((size_t)SHOAL_RMAT_MAX_JOBS * (size_t)c->maxc, sizeof *c->tpick);
    c->tfrom = shoal_xcalloc((size_t)SHOAL_RMAT_MAX_JOBS * (size_t)c->maxc, sizeof *c->tfrom);
    c->twant = shoal_xcalloc(2 * (size_t)c->maxc, 1);
    c->tup = shoal_xcalloc((size_t)c->nw, 1);
    c->tload = shoal_xcalloc((size_t)c->nw, sizeof *c->tload);
    c->rorder = shoal_xcalloc((size_t)c->nw, sizeof *c->rorder);
    if (getrandom(&c->next_xid, sizeof c->next_xid, 0) != (ssize_t)sizeof c->next_xid) /* xids unique per coordinator */
        c->next_xid = (uint64_t)shoal__ec_now_ns() ^ ((uint64_t)getpid() << 32);
    c->next_xid >>= 2; /* a random 62-bit start: 2^62 steps before a wrap */
    c->tsorted = shoal_xcalloc((size_t)c->ntmats, sizeof *c->tsorted);
    size_t cols = 0;
    int nremote = 0;
    for (int k = 0; k < c->ntmats; k++) {
        c->tsorted[k] = k;
        if (c->tremote[k]) {
            nremote++;
            if ((size_t)c->tmats[k].cols > cols)
                cols = (size_t)c->tmats[k].cols;
        }
    }
    sort_mats = c->tmats;
    qsort(c->tsorted, (size_t)c->ntmats, sizeof *c->tsorted, by_name);
    sort_mats = NULL;
    c->tx_cap = SHOAL_PROTO_TENSOR_HDR + (size_t)c->o.max_tokens * cols * 4;
    c->tx = shoal_xmalloc(c->tx_cap);
    c->tx16 = shoal_xmalloc(SHOAL_PROTO_TENSOR_HDR + (size_t)c->o.max_tokens * cols * 2);
    c->tbf16 = shoal_xcalloc((size_t)c->ntmats + 1, 1);
    for (int k = 0; k < c->ntmats; k++) {
        const shoal_tensor *tt = shoal_st_find(c->o.st, c->tmats[k].name);
        c->tbf16[k] = tt && tt->dtype == SHOAL_DT_BF16;
    }
    for (int i = 0; i < c->nw; i++) {
        c->w[i].tseg = shoal_xcalloc(SHOAL_PROTO_MAX_TSEGS, sizeof *c->w[i].tseg);
        c->w[i].tctl = shoal_xmalloc(SHOAL__EC_TCTL_CAP);
        if (c->w[i].ntrunk && c->w[i].max_tokens < (uint32_t)c->o.max_tokens)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "trunk worker %s accepts %u tokens per request, the "
                                 "coordinator needs %d", c->w[i].name, c->w[i].max_tokens, c->o.max_tokens);
    }
    SHOAL_INFO("trunk: %d matri%s remote in %zu row cell%s over %d worker%s (%zu with more than one owner)", nremote,
               nremote == 1 ? "x" : "ces", c->ncells, c->ncells == 1 ? "" : "s", c->nw, c->nw == 1 ? "" : "s",
               replicated);
    return 0;
}

/* Connect every worker, send HELLO as soon as its connection is up, collect
 * every reply before the deadline. */
/* Why a worker never connected, for the HELLO deadline's message: the host
 * does not resolve (named, with the resolver's error), or nothing listens
 * there, or (ipc) there is no socket at the path. Only on that error path, so
 * the resolver's own timeout is not on any request's way. */
static void unconnected_why(const char *ep, char *why, size_t n)
{
    if (!strncmp(ep, "tcp://", 6)) {
        char host[256];
        const char *colon = strrchr(ep + 6, ':');
        size_t hl = colon ? (size_t)(colon - (ep + 6)) : strlen(ep + 6);
        if (hl >= sizeof host)
            hl = sizeof host - 1;
        memcpy(host, ep + 6, hl);
        host[hl] = 0;
        if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') { /* [v6] */
            memmove(host, host + 1, hl - 2);
            host[hl - 2] = 0;
        }
        struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
        int g = getaddrinfo(host, colon ? colon + 1 : NULL, &hints, &ai);
        if (g) {
            char h2[201];
            snprintf(why, n, "not connected: host '%s' does not resolve: %s",
                     shoal_utf8_clip(h2, sizeof h2, host, SHOAL_UTF8_NOCTRL), gai_strerror(g));
            return;
        }
        freeaddrinfo(ai);
        char h2[201], p2[16];
        snprintf(why, n, "not connected: '%s' resolves, but no connection was accepted on port %s",
                 shoal_utf8_clip(h2, sizeof h2, host, SHOAL_UTF8_NOCTRL),
                 shoal_utf8_clip(p2, sizeof p2, colon ? colon + 1 : "?", SHOAL_UTF8_NOCTRL));
        return;
    }
    if (!strncmp(ep, "ipc://", 6) && ep[6] != '@') {
        struct stat sb;
        char e2[201];
        int serr = stat(ep + 6, &sb) ? errno : 0;
        shoal_utf8_clip(e2, sizeof e2, ep + 6, SHOAL_UTF8_NOCTRL);
        if (serr)
            snprintf(why, n, "not connected: no socket at %s: %s", e2, strerror(serr));
        else
            snprintf(why, n, "not connected: %s exists, but no connection was accepted", e2);
        return;
    }
    snprintf(why, n, "not connected");
}

static int hello_all(shoal_expert_client *c, char *err, size_t errlen)
{
    int hello_ms = c->o.hello_timeout_ms > 0 ? c->o.hello_timeout_ms : 60000;
    uint64_t deadline = shoal__ec_now_us() + (uint64_t)hello_ms * 1000u;
    int *sent = shoal_xcalloc((size_t)c->nw, sizeof *sent), *got = shoal_xcalloc((size_t)c->nw, sizeof *got);
    zmq_pollitem_t *pi = shoal_xcalloc(2 * (size_t)c->nw, sizeof *pi);
    int ngot = 0, rc = 0;
    uint64_t next_check = shoal__ec_now_us();
    while (ngot < c->nw) {
        uint64_t now = shoal__ec_now_us();
        if (now >= deadline) {
            size_t at = 0;
            at += (size_t)snprintf(err, errlen, "no HELLO within %d ms from expert worker%s:", hello_ms,
                                   c->nw - ngot > 1 ? "s" : "");
            for (int i = 0; i < c->nw && at < errlen; i++)
                if (!got[i]) {
                    char why[320];
                    unconnected_why(c->w[i].endpoint, why, sizeof why);
                    at += (size_t)snprintf(err + at, errlen - at, " %s (%s)", c->w[i].endpoint,
                                           sent[i] ? "connected, no answer" : why);
                }
            rc = SHOAL_ETIMEOUT;
            break;
        }
        if (c->o.check && now >= next_check) {
            if ((rc = c->o.check(c->o.check_ctx, err, errlen)))
                break;
            next_check = now + 100000;
        }
        for (int i = 0; i < c->nw; i++) {
            if (!sent[i]) { /* ZMQ_IMMEDIATE: the send succeeds once the connection is up */
                int s = send_hello(c, &c->w[i], 1, err, errlen);
                if (s == 0)
                    sent[i] = 1;
                else if (s != -EAGAIN) {
                    rc = s < 0 && s > -4096 ? shoal_err_set(err, errlen, s, "expert worker %s: send: %s",
                                                            c->w[i].endpoint, zmq_strerror(-s))
                                            : s;
                    goto out;
                }
            }
            pi[i] = (zmq_pollitem_t){.socket = c->w[i].sock, .events = (short)(sent[i] ? ZMQ_POLLIN : ZMQ_POLLOUT)};
            pi[c->nw + i] = (zmq_pollitem_t){.socket = c->w[i].mon, .events = ZMQ_POLLIN};
        }
        long ms = (long)((deadline - now) / 1000u) + 1;
        if (ms > 100)
            ms = 100;
        if (zmq_poll(pi, 2 * c->nw, ms) < 0 && errno != EINTR) {
            rc = shoal_err_set(err, errlen, -errno, "zmq_poll: %s", zmq_strerror(errno));
            break;
        }
        for (int i = 0; i < c->nw; i++) {
            if ((pi[c->nw + i].revents & ZMQ_POLLIN) && shoal__ec_monitor_disconnected(c->w[i].mon) && sent[i] &&
                !got[i]) {
                rc = shoal_err_set(err, errlen, SHOAL_EPEER, "expert worker %s disconnected before answering HELLO",
                                   c->w[i].endpoint);
                goto out;
            }
            if (!sent[i] || got[i] || !(pi[i].revents & ZMQ_POLLIN))
                continue;
            /* keep at most MAX_FRAMES + 1 parts: one too many is enough to refuse */
            zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES + 1];
            int np = 0, more = 1;
            while (more) {
                zmq_msg_t m;
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, c->w[i].sock, ZMQ_DONTWAIT) < 0) {
                    zmq_msg_close(&m);
                    break;
                }
                more = zmq_msg_more(&m);
                if (np < SHOAL_PROTO_MAX_FRAMES + 1)
                    parts[np++] = m;
                else
                    zmq_msg_close(&m);
            }
            if (!np)
                continue;
            shoal_frame f[SHOAL_PROTO_MAX_FRAMES + 1];
            for (int j = 0; j < np; j++)
                f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
            rc = take_hello(c, &c->w[i], f, np, err, errlen);
            for (int j = 0; j < np; j++)
                zmq_msg_close(&parts[j]);
            if (rc)
                goto out;
            got[i] = 1;
            ngot++;
        }
    }
out:
    free(sent);
    free(got);
    free(pi);
    return rc;
}

/* ---- links: down, probes, recovery (smu held) ------------------------------ */

void shoal__ec_mark_down(shoal_expert_client *c, int i, const char *fmt, ...)
{
    shoal__ec_worker *w = &c->w[i];
    if (atomic_load(&w->link) == W_DOWN)
        return;
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&c->wmu);
    vsnprintf(w->why, sizeof w->why, fmt, ap);
    pthread_mutex_unlock(&c->wmu);
    va_end(ap);
    atomic_store(&w->link, W_DOWN);
    w->logged = 0;
    w->down_us = shoal__ec_now_us();
    w->backoff_ms = BACKOFF_MIN_MS;
    w->next_probe_us = w->down_us + BACKOFF_MIN_MS * 1000u;
    w->warm_left = 0;
    w->probe_rid = 0;
    w->downs++;
    if (c->cm)
        shoal_cmetrics_worker_up(c->cm, i, 0);
}

/* One PING or HELLO outside a request (open, keeper; smu held or no keeper
 * yet): the rid continues the client's one increasing sequence (PROTOCOL.md
 * section 2). 0 or -errno. */
static int send_probe(shoal_expert_client *c, shoal__ec_worker *w, int type)
{
    uint64_t rid = ++c->next_rid;
    if (type == SHOAL_MSG_HELLO && !w->probe_rid)
        w->probe_rid = rid;
    if (type == SHOAL_MSG_HELLO) {
        char err[256];
        int rc = send_hello(c, w, rid, err, sizeof err);
        return rc > -4096 ? rc : -EINVAL;
    }
    uint8_t buf[32];
    size_t len;
    shoal_proto_enc_empty(buf, sizeof buf, &len, SHOAL_MSG_PING, rid);
    return zmq_send(w->sock, buf, len, ZMQ_DONTWAIT) < 0 ? -errno : 0;
}

/* Start warming w's connection up (see WARM_PINGS): 0, or -errno when the
 * PINGs cannot be queued. */
static int warm_send(shoal_expert_client *c, shoal__ec_worker *w, int n)
{
    for (int j = 0; j < n; j++) {
        int rc = send_probe(c, w, SHOAL_MSG_PING);
        if (rc)
            return rc;
    }
    w->warm_left = n;
    return 0;
}

/* Send n PINGs to every worker and wait for every PONG (open; the opening
 * thread may allocate). */
static int ping_all(shoal_expert_client *c, int n, uint64_t deadline, int hello_ms, zmq_pollitem_t *pi, char *err,
                    size_t errlen)
{
    for (int i = 0; i < c->nw; i++) {
        int rc = warm_send(c, &c->w[i], n);
        if (rc)
            return shoal_err_set(err, errlen, SHOAL_EPEER, "expert worker %s: cannot send PING: %s", c->w[i].name,
                                 zmq_strerror(-rc));
    }
    for (;;) {
        int np_ = 0;
        for (int i = 0; i < c->nw; i++)
            if (c->w[i].warm_left)
                pi[np_++] = (zmq_pollitem_t){.socket = c->w[i].sock, .events = ZMQ_POLLIN};
        if (!np_)
            return 0;
        uint64_t now = shoal__ec_now_us();
        if (now >= deadline)
            for (int i = 0; i < c->nw; i++)
                if (c->w[i].warm_left)
                    return shoal_err_set(err, errlen, SHOAL_ETIMEOUT, "expert worker %s: %d PINGs unanswered "
                                         "within %d ms of open", c->w[i].name, c->w[i].warm_left, hello_ms);
        long ms = (long)((deadline - now) / 1000u) + 1;
        if (zmq_poll(pi, np_, ms > 100 ? 100 : ms) < 0 && errno != EINTR)
            return shoal_err_set(err, errlen, -errno, "zmq_poll: %s", zmq_strerror(errno));
        for (int i = 0; i < c->nw; i++) {
            zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
            int np, truncated;
            while (c->w[i].warm_left && (np = shoal__ec_recv_parts(c->w[i].sock, parts, &truncated)) > 0) {
                shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
                for (int j = 0; j < np; j++)
                    f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
                shoal_proto_msg m;
                memset(&m, 0, sizeof m);
                int perr;
                char why[256];
                if (!truncated && !shoal_proto_decode(f, np, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why) &&
                    m.type == SHOAL_MSG_PONG)
                    c->w[i].warm_left--;
                shoal_proto_msg_clear(&m);
                shoal__ec_close_parts(parts, np);
            }
        }
    }
}

/* Warm every connection up at open, so that the forward thread's sends find
 * zmq's queues grown: WARM_ROUNDS single round trips (each send then wakes
 * the I/O thread with a command, so its command queue -- chunks of 16 --
 * wraps and keeps a spare chunk), then a burst of WARM_PINGS (the message
 * pipe's chunk, see WARM_PINGS). */
static int warm_all(shoal_expert_client *c, char *err, size_t errlen)
{
    int hello_ms = c->o.hello_timeout_ms > 0 ? c->o.hello_timeout_ms : 60000;
    uint64_t deadline = shoal__ec_now_us() + (uint64_t)hello_ms * 1000u;
    zmq_pollitem_t *pi = shoal_xcalloc((size_t)c->nw, sizeof *pi);
    int rc = 0;
    for (int r = 0; r < WARM_ROUNDS && !rc; r++)
        rc = ping_all(c, 1, deadline, hello_ms, pi, err, errlen);
    if (!rc)
        rc = ping_all(c, WARM_PINGS, deadline, hello_ms, pi, err, errlen);
    free(pi);
    return rc;
}

/* Equal lists of trunk rows (same entries, same order: a worker announces
 * its --trunk ROWSPEC's expansion, so a restart with the same spec gives the
 * same list). */
static int same_trows(const shoal_proto_trows *a, size_t na, const shoal_proto_trows *b, size_t nb)
{
    if (na != nb)
        return 0;
    for (size_t i = 0; i < na; i++)
        if (a[i].lo != b[i].lo || a[i].hi != b[i].hi || strcmp(a[i].name, b[i].name))
            return 0;
    return 1;
}

/* "name lo-hi, ..." into out (cut with "..." when it does not fit; "none"). */
static void format_trows(const shoal_proto_trows *t, size_t n, char *out, size_t cap)
{
    size_t at = 0;
    out[0] = 0;
    if (!n) {
        snprintf(out, cap, "none");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const char *nm = t[i].name;
        if (!strncmp(nm, "language_model.", 15))
            nm += 15;
        int k = snprintf(out + at, cap - at, "%s%s %u-%u", i ? ", " : "", nm, t[i].lo, t[i].hi);
        if (k < 0 || (size_t)k >= cap - at) {
            if (cap > 4)
                snprintf(out + (at < cap - 4 ? at : cap - 4), 4, "...");
            return;
        }
        at += (size_t)k;
    }
}

/* A reconnection refused for `why`: logged (by the keeper) the first time
 * and whenever the reason changes; the same refusal again, every backoff
 * period, is only counted (shown when the reason changes or the worker comes
 * back). */
static void refused(shoal_expert_client *c, shoal__ec_worker *w, const char *why)
{
    pthread_mutex_lock(&c->wmu);
    int same = !strcmp(w->why, why);
    if (!same)
        snprintf(w->why, sizeof w->why, "%s", why);
    if (same)
        w->refusals++; /* under wmu: worker_up shows it */
    pthread_mutex_unlock(&c->wmu);
    if (!same) {
        pthread_mutex_lock(&c->wmu);
        uint64_t before = w->refusals;
        w->refusals = 0;
        pthread_mutex_unlock(&c->wmu);
        if (before)
            SHOAL_WARN("%s worker %s: the previous refusal repeated %llu more times", ROLE(c), w->name,
                       (unsigned long long)before);
        w->logged = 0;
    }
}

/* A message from a worker outside a request (the keeper; smu held). */
static void keeper_take(shoal_expert_client *c, int i, zmq_msg_t *parts, int np, int truncated)
{
    shoal__ec_worker *w = &c->w[i];
    shoal__ec_busy_answered(c, i); /* it answers */
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    for (int j = 0; j < np; j++)
        f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr, link = atomic_load(&w->link);
    char why[512];
    int drc = truncated ? SHOAL_EPROTO : shoal_proto_decode(f, np, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why);
    int probe_err = m.type == SHOAL_MSG_ERROR && w->probe_rid && m.rid >= w->probe_rid;
    if (drc || m.type == SHOAL_MSG_EXPERT_RESULT || m.type == SHOAL_MSG_TRUNK_RESULT ||
        (m.type == SHOAL_MSG_ERROR && !probe_err)) {
        /* a reply to a request that already failed (or junk) */
        c->st.late_replies++;
        if (c->cm)
            shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_STALE);
    } else if (link == W_DOWN && m.type == SHOAL_MSG_HELLO) {
        char err[1024];
        int same = m.hello.nowned == w->nowned &&
                   (!w->nowned || !memcmp(m.hello.owned, w->owned, sizeof *w->owned * w->nowned));
        /* the trunk placement was fixed at open from these rows: a worker that
         * comes back with others would be sent rows it does not own (or leave
         * rows uncomputed), so it is refused like one with other experts */
        int same_trunk = !c->o.trunk_role || same_trows(m.hello.trunk, m.hello.ntrunk, w->trunk, w->ntrunk);
        char r[sizeof w->why];
        if (check_hello(c, w->name, &m.hello, err, sizeof err)) {
            char e2[451];
            snprintf(r, sizeof r, "refused on reconnection: %s", shoal_utf8_clip(e2, sizeof e2, err, 0));
            refused(c, w, r);
        } else if (!same) {
            char a[256], b[256];
            shoal_shard_format(w->owned, w->nowned, a, sizeof a);
            shoal_shard_format(m.hello.owned, m.hello.nowned, b, sizeof b);
            snprintf(r, sizeof r, "refused on reconnection: it now owns %.200s, not %.200s", b, a);
            refused(c, w, r);
        } else if (c->o.trunk_role && w->chain && m.hello.minor < 4) {
            snprintf(r, sizeof r, "refused on reconnection: it now speaks protocol %u.%u, which has no chained trunk "
                     "segments; it was placed with them at %d.%d", m.hello.major, m.hello.minor, SHOAL_PROTO_MAJOR, 4);
            refused(c, w, r);
        } else if (!same_trunk) {
            char a[200], b[200];
            format_trows(w->trunk, w->ntrunk, a, sizeof a);
            format_trows(m.hello.trunk, m.hello.ntrunk, b, sizeof b);
            snprintf(r, sizeof r, "refused on reconnection: it now owns trunk rows %.200s, not %.200s", b, a);
            refused(c, w, r);
        } else if (warm_send(c, w, WARM_PINGS) == 0) {
            set_wire16(c, w, &m.hello); /* a worker restarted with another version or flags */
            set_relay(w, &m.hello);
            atomic_store(&w->link, W_WARM);
        }
    } else if (link == W_DOWN && probe_err) {
        char r[sizeof w->why];
        char e2[401]; /* the peer's text: cut on a character, invalid bytes and controls replaced */
        snprintf(r, sizeof r, "refused HELLO on reconnection: %s: %s", shoal_perr_name((int)m.error.code),
                 shoal_utf8_clip(e2, sizeof e2, m.error.message, SHOAL_UTF8_NOCTRL));
        refused(c, w, r);
    } else if (link == W_WARM && m.type == SHOAL_MSG_PONG && --w->warm_left == 0) {
        atomic_store(&w->link, W_UP);
        w->recoveries++;
        w->logged = 0;
        if (c->cm)
            shoal_cmetrics_worker_up(c->cm, i, 1);
    }
    /* else: an answer to an older probe */
    shoal_proto_msg_clear(&m);
    shoal__ec_close_parts(parts, np);
}

/* One pass of the keeper over every worker (smu held, between requests). */
static unsigned keeper_pass(shoal_expert_client *c)
{
    unsigned tick = KEEPER_TICK_MS;
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (shoal__ec_monitor_disconnected(w->mon))
            shoal__ec_mark_down(c, i, "disconnected (the worker died?)");
        zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
        int np, truncated;
        while ((np = shoal__ec_recv_parts(w->sock, parts, &truncated)) > 0)
            keeper_take(c, i, parts, np, truncated);
        int link = atomic_load(&w->link);
        uint64_t now = shoal__ec_now_us();
        if (!w->logged) {
            w->logged = 1;
            if (link == W_DOWN)
                SHOAL_WARN("%s worker %s is down: %s; reconnecting in the background", ROLE(c), w->name, w->why);
            else if (link == W_UP) {
                SHOAL_INFO("%s worker %s is back (re-verified HELLO) after %.1f s", ROLE(c), w->name,
                           (double)(now - w->down_us) * 1e-6);
                pthread_mutex_lock(&c->wmu);
                uint64_t before = w->refusals;
                w->refusals = 0;
                pthread_mutex_unlock(&c->wmu);
                if (before)
                    SHOAL_INFO("%s worker %s: its last refusal had repeated %llu more times", ROLE(c), w->name,
                               (unsigned long long)before);
            }
        }
        if (link == W_DOWN) {
            if (now >= w->next_probe_us) {
                send_probe(c, w, SHOAL_MSG_HELLO); /* EAGAIN while not connected: tried again later */
                w->next_probe_us = now + (uint64_t)w->backoff_ms * 1000u;
                w->backoff_ms = w->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : w->backoff_ms * 2;
            }
            unsigned ms = (unsigned)((w->next_probe_us - now + 999) / 1000);
            if (ms < tick)
                tick = ms ? ms : 1;
        } else if (link == W_WARM) {
            tick = 2;
        }
    }
    return tick;
}

/* The keeper: between requests, a pass over the workers about every tick
 * (keeper_pass, under smu: taken with trylock, so it never waits on a
 * request). During a request it also notes when a reply arrives while the
 * forward is still computing the shared experts, so that the round trip
 * excludes the reply's wait for them: submit() arms the worker's ZMQ_FD in
 * the keeper's epoll (one-shot; an OS-level wait on the fd zmq signals when
 * a message reaches the socket -- the socket itself stays the forward's), and
 * gather() disarms what has not fired, timing the arrival itself from then
 * on. So the keeper wakes only for replies that came early, and the forward
 * wakes nobody. submit() arms only workers whose last reply was early (the
 * only case where it matters; two syscalls saved per exchange otherwise);
 * for those, gather() ends the exchange with a receive that finds nothing,
 * which leaves the socket in the state where the next arrival signals. */
static void *keeper_main(void *arg)
{
    shoal_expert_client *c = arg;
    unsigned tick = KEEPER_TICK_MS;
    uint64_t next_pass = shoal__ec_now_us() + (uint64_t)tick * 1000u;
    for (;;) {
        uint64_t now = shoal__ec_now_us();
        int ms = next_pass > now ? (int)((next_pass - now + 999) / 1000) : 0;
        int n = epoll_wait(c->epfd, c->kev, 1 + c->nw, ms);
        uint64_t t = shoal__ec_now_ns();
        for (int j = 0; j < n; j++) {
            uint32_t i = c->kev[j].data.u32;
            if (i < (uint32_t)c->nw) {
                int one = 1;
                if (atomic_compare_exchange_strong(&c->w[i].obs, &one, 0))
                    atomic_store(&c->w[i].arr_ns, t);
            } else {
                uint64_t v;
                ssize_t r = read(c->kfd, &v, sizeof v);
                (void)r;
            }
        }
        if (n < 0 && errno != EINTR)
            usleep(1000);
        if (atomic_load(&c->quit))
            break;
        if (shoal__ec_now_us() >= next_pass) {
            if (pthread_mutex_trylock(&c->smu) == 0) {
                tick = keeper_pass(c);
                pthread_mutex_unlock(&c->smu);
            } else {
                tick = 10; /* a request is out: try again soon */
            }
            next_pass = shoal__ec_now_us() + (uint64_t)tick * 1000u;
        }
    }
    return NULL;
}

/* ---- open and close --------------------------------------------------------- */

void shoal_expert_client_close(shoal_expert_client *c)
{
    if (!c)
        return;
    if (c->keeper_started) {
        atomic_store(&c->quit, 1);
        uint64_t one = 1;
        if (write(c->kfd, &one, sizeof one) < 0)
            SHOAL_WARN("expert client: eventfd write: %s", strerror(errno));
        pthread_join(c->keeper, NULL);
    }
    if (c->kfd >= 0)
        close(c->kfd);
    if (c->epfd >= 0)
        close(c->epfd);
    free(c->kev);
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (w->mon)
            zmq_close(w->mon);
        if (w->sock) {
            zmq_socket_monitor(w->sock, NULL, 0);
            zmq_close(w->sock);
        }
    }
    if (c->zctx) /* after this, zmq no longer reads the request buffers */
        zmq_ctx_term(c->zctx);
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        free(w->owned);
        free(w->trunk);
        free(w->tseg);
        free(w->tctl);
        free(w->act);
        free(w->route);
        free(w->dest);
        free(w->hint_ids);
        free(w->hint_ctl[0]);
        free(w->hint_ctl[1]);
    }
    if (c->sib && c->sib->sib == c) /* no request of the other is under way (expert_client.h) */
        c->sib->sib = NULL;
    pthread_mutex_destroy(&c->smu);
    pthread_mutex_destroy(&c->wmu);
    free(c->pfd);
    free(c->pidx);
    shoal_proto_scratch_free(c->dec);
    shoal_owners_close(c->owners);
    free(c->tmats);
    free(c->tremote);
    free(c->cells);
    free(c->cown);
    free(c->cbeg);
    free(c->ccnt);
    free(c->tpick);
    free(c->tfrom);
    free(c->twant);
    free(c->tup);
    free(c->tload);
    free(c->rorder);
    free(c->tsorted);
    free(c->tx);
    free(c->tx16);
    free(c->tbf16);
    free(c->pick);
    free(c->seen);
    free(c->powner);
    free(c->rs_ids);
    free(c->live);
    free(c->hpick);
    free(c->w);
    free(c);
}

int shoal_expert_client_open(shoal_expert_client **out, const shoal_expert_client_opts *o, char *err,
                             size_t errlen)
{
    *out = NULL;
    if (o->nworkers < 1 || o->nworkers > SHOAL_EXPERT_CLIENT_MAX_WORKERS)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: %d workers (1 to %d)", o->nworkers,
                             SHOAL_EXPERT_CLIENT_MAX_WORKERS);
    if (o->max_tokens < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: max_tokens must be positive");
    if (o->relay_fanout == SHOAL_RELAY_GREEDY && !(o->relay_nic_Bps > 0 && o->relay_peer_Bps > 0 &&
                                                   o->relay_hop_s >= 0 && o->relay_hop_s < 10))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: the greedy relay schedule needs the NIC and "
                             "peer rates (> 0) and the hop latency (>= 0)");
    if (o->relay_fanout != SHOAL_RELAY_GREEDY && (o->relay_fanout < 0 || o->relay_fanout == 1 || o->relay_fanout > 4))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: relay fan-out %d (0, 2 to 4, or greedy)",
                             o->relay_fanout);
    shoal_expert_client *c = shoal_xcalloc(1, sizeof *c);
    c->o = *o;
    /* the keeper's re-HELLOs use the fingerprint long after open: keep our own
     * copy (shoal_dist_start's is on its stack) */
    if (o->fingerprint)
        memcpy(c->fp, o->fingerprint, SHOAL_PROTO_FP_BYTES);
    c->o.fingerprint = c->fp;
    if (c->o.timeout_ms <= 0)
        c->o.timeout_ms = 30000;
    c->cfg = o->cfg;
    c->nw = o->nworkers;
    c->d = o->cfg->latent_size;
    c->k = o->cfg->experts_per_token;
    c->E = o->cfg->num_experts;
    c->L = o->cfg->num_layers;
    pthread_mutex_init(&c->smu, NULL);
    pthread_mutex_init(&c->wmu, NULL);
    c->kfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->epfd = epoll_create1(EPOLL_CLOEXEC);
    c->kev = shoal_xcalloc(1 + (size_t)o->nworkers, sizeof *c->kev);
    c->pfd = shoal_xcalloc(2 * (size_t)o->nworkers, sizeof *c->pfd);
    c->pidx = shoal_xcalloc(2 * (size_t)o->nworkers, sizeof *c->pidx);
    c->dec = shoal_proto_scratch_new();
    c->w = shoal_xcalloc((size_t)c->nw, sizeof *c->w);
    if (o->trunk_role && (!o->st || shoal_tshard_mats(o->cfg, &c->tmats, &c->ntmats))) {
        shoal_expert_client_close(c);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk client: no model store, or its matrices do not list");
    }
    c->seen = shoal_xcalloc((size_t)c->E, sizeof *c->seen);
    c->powner = shoal_xcalloc((size_t)o->max_tokens * (size_t)c->k, sizeof *c->powner);
    c->rs_ids = shoal_xcalloc((size_t)o->max_tokens * (size_t)c->k, sizeof *c->rs_ids);
    c->live = shoal_xcalloc((size_t)c->nw, 1);
    c->hpick = shoal_xcalloc((size_t)c->E, sizeof *c->hpick);
    {
        int fo = o->failover_ms > 0 ? o->failover_ms : (c->o.timeout_ms / 3 < 1000 ? c->o.timeout_ms / 3 : 1000);
        c->failover_us = (uint64_t)(fo > 0 ? fo : 1) * 1000u;
    }
    c->zctx = zmq_ctx_new();
    zmq_ctx_set(c->zctx, ZMQ_IO_THREADS, (c->nw + WORKERS_PER_IO_THREAD - 1) / WORKERS_PER_IO_THREAD);
    int rc = 0;
    size_t mt = (size_t)o->max_tokens;
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (strlen(o->endpoints[i]) >= sizeof w->endpoint) {
            rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "endpoint too long: %s", o->endpoints[i]);
            goto fail;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(o->endpoints[j], o->endpoints[i])) {
                rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "expert worker %s given twice", o->endpoints[i]);
                goto fail;
            }
        snprintf(w->endpoint, sizeof w->endpoint, "%s", o->endpoints[i]);
        w->logged = 1; /* up, nothing to say */
        snprintf(w->name, sizeof w->name, "%s", w->endpoint);
        w->act = shoal_xmalloc(SHOAL_PROTO_TENSOR_HDR + mt * (size_t)c->d * 4);
        w->route = shoal_xmalloc(SHOAL_PROTO_TENSOR_HDR + mt * (size_t)c->k * 8);
        w->dest = shoal_xmalloc(mt * (size_t)c->k * sizeof *w->dest);
        w->hint_ids = shoal_xmalloc((size_t)c->E * sizeof *w->hint_ids);
        for (int b = 0; b < 2; b++)
            w->hint_ctl[b] = shoal_xmalloc(32 + 5 * (size_t)c->E);
        w->sock = zmq_socket(c->zctx, ZMQ_DEALER);
        int zero = 0, one = 1;
        zmq_setsockopt(w->sock, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(w->sock, ZMQ_IMMEDIATE, &one, sizeof one);
        /* a routing id of our own: a transient reconnection to the same worker
         * process keeps its HELLO state; a restarted worker has none (NO_HELLO) */
        uint8_t rid[16];
        if (getrandom(rid, sizeof rid, 0) != (ssize_t)sizeof rid) { /* never blocks once the pool is up */
            uint64_t x = shoal__ec_now_ns() ^ (uint64_t)getpid() << 32 ^ (uint64_t)i;
            for (int j = 0; j < 16; j++, x = x * 6364136223846793005ull + 1442695040888963407ull)
                rid[j] = (uint8_t)(x >> 56);
        }
        rid[0] |= 1; /* ZeroMQ reserves routing ids starting with a zero byte */
        zmq_setsockopt(w->sock, ZMQ_ROUTING_ID, rid, sizeof rid);
        if (o->curve && o->curve_server_keys && o->curve_server_keys[i] &&
            (rc = shoal_curve_set_client(w->sock, o->curve, o->curve_server_keys[i], err, errlen)))
            goto fail;
        char mon[128];
        snprintf(mon, sizeof mon, "inproc://shoal-expert-client-%p-%d", (void *)c, i);
        if (zmq_socket_monitor(w->sock, mon, ZMQ_EVENT_DISCONNECTED)) {
            rc = shoal_err_set(err, errlen, -errno, "zmq_socket_monitor: %s", zmq_strerror(errno));
            goto fail;
        }
        w->mon = zmq_socket(c->zctx, ZMQ_PAIR);
        zmq_setsockopt(w->mon, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_connect(w->mon, mon) || zmq_connect(w->sock, w->endpoint)) {
            rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "expert worker %s: cannot connect: %s", w->endpoint,
                               zmq_strerror(errno));
            goto fail;
        }
    }
    if ((rc = hello_all(c, err, errlen)))
        goto fail;
    c->next_rid = 1; /* HELLO used 1; the warm-up PINGs, batches and probes follow */
    /* ownership: every expert of every MoE layer at least once (overlaps are
     * replicas: each exchange picks one owner, coordinator/cluster/owners.h) */
    c->pick = shoal_xcalloc((size_t)c->E, sizeof *c->pick);
    if (c->o.trunk_role) {
        if ((rc = trunk_place(c, err, errlen)))
            goto fail;
    } else {
        const shoal_proto_range **r = shoal_xcalloc((size_t)c->nw, sizeof *r);
        size_t *nr = shoal_xcalloc((size_t)c->nw, sizeof *nr);
        const char **names = shoal_xcalloc((size_t)c->nw, sizeof *names);
        for (int i = 0; i < c->nw; i++) {
            r[i] = c->w[i].owned;
            nr[i] = c->w[i].nowned;
            names[i] = c->w[i].name;
        }
        rc = shoal_owners_open(&c->owners, c->nw, r, nr, names, c->L, c->cfg->is_moe, c->E, err, errlen);
        free(r);
        free(nr);
        free(names);
        if (rc)
            goto fail;
        if (shoal_owners_replicated(c->owners))
            SHOAL_INFO("%zu (layer, expert) pairs are owned by more than one worker: each exchange picks one",
                       shoal_owners_replicated(c->owners));
    }
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        size_t fl = sizeof w->fd;
        if (zmq_getsockopt(w->sock, ZMQ_FD, &w->fd, &fl) ||
            (fl = sizeof w->mfd, zmq_getsockopt(w->mon, ZMQ_FD, &w->mfd, &fl))) {
            rc = shoal_err_set(err, errlen, -errno, "zmq_getsockopt ZMQ_FD: %s", zmq_strerror(errno));
            goto fail;
        }
    }
    if ((rc = warm_all(c, err, errlen)))
        goto fail;
    if (c->kfd < 0 || c->epfd < 0) {
        rc = shoal_err_set(err, errlen, -errno, "eventfd/epoll: %s", strerror(errno));
        goto fail;
    }
    {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
        int bad = epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->kfd, &ev);
        for (int i = 0; i < c->nw && !bad; i++) {
            ev = (struct epoll_event){.events = 0, .data.u32 = (uint32_t)i};
            bad = epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->w[i].fd, &ev);
        }
        if (bad) {
            rc = shoal_err_set(err, errlen, -errno, "epoll_ctl: %s", strerror(errno));
            goto fail;
        }
    }
    if (pthread_create(&c->keeper, NULL, keeper_main, c)) {
        rc = shoal_err_set(err, errlen, SHOAL_EINTERNAL, "cannot start the expert client's keeper thread");
        goto fail;
    }
    c->keeper_started = 1;
    *out = c;
    return 0;
fail:
    shoal_expert_client_close(c);
    return rc;
}

/* ---- the workers, for callers ----------------------------------------------- */

int shoal_expert_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm, char *err, size_t errlen)
{
    pthread_mutex_lock(&c->smu);
    int rc = 0;
    for (int i = 0; i < c->nw && cm && !rc; i++) {
        uint64_t owned = shoal_owners_count(c->owners, i);
        rc = shoal_cmetrics_set_worker(cm, i, c->w[i].id, c->w[i].endpoint, owned, c->w[i].expert_bytes,
                                       c->w[i].mem_total);
        if (!rc)
            shoal_cmetrics_worker_up(cm, i, atomic_load(&c->w[i].link) == W_UP);
    }
    if (rc)
        shoal_err_set(err, errlen, rc, "expert client: the metrics do not take %d workers", c->nw);
    else
        c->cm = cm;
    pthread_mutex_unlock(&c->smu);
    return rc;
}

int shoal_expert_client_worker_up(shoal_expert_client *c, int i, char *why, size_t whylen)
{
    if (i < 0 || i >= c->nw)
        return 0;
    pthread_mutex_lock(&c->wmu);
    int link = atomic_load(&c->w[i].link);
    if (why && whylen) {
        int n = snprintf(why, whylen, "%s", link == W_UP ? "up" : link == W_WARM ? "reconnecting (warming up)" : c->w[i].why);
        if (link == W_DOWN && c->w[i].refusals && n >= 0 && (size_t)n < whylen)
            snprintf(why + n, whylen - (size_t)n, " (%llu times)", (unsigned long long)c->w[i].refusals + 1);
    }
    pthread_mutex_unlock(&c->wmu);
    return link == W_UP;
}

int shoal_expert_client_set_sibling(shoal_expert_client *a, shoal_expert_client *b, char *err, size_t errlen)
{
    if (!a || !b || a == b || a->nw != b->nw)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: siblings need the same workers");
    for (int i = 0; i < a->nw; i++)
        if (strcmp(a->w[i].endpoint, b->w[i].endpoint))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: sibling worker %d is %s, not %s", i,
                                 b->w[i].endpoint, a->w[i].endpoint);
    pthread_mutex_lock(&a->smu);
    a->sib = b;
    pthread_mutex_unlock(&a->smu);
    pthread_mutex_lock(&b->smu);
    b->sib = a;
    pthread_mutex_unlock(&b->smu);
    return 0;
}

/* Worker names of a list of owners for covered()'s message. */
static void owner_names(const shoal_expert_client *c, const int32_t *who, int n, char *out, size_t len)
{
    size_t at = 0;
    out[0] = 0;
    for (int q = 0; q < n && at < len; q++)
        at += (size_t)snprintf(out + at, len - at, "%s%s", q ? ", " : "",
                               c->w[who[q]].id[0] ? c->w[who[q]].id : c->w[who[q]].endpoint);
}

/* Up for covered(): on this client's link and on the sibling's (a worker is
 * up in /health when both its links are; one that either client has seen
 * die is not counted on, as the picks do not count on it). */
static int up_both(const shoal_expert_client *c, int i)
{
    return atomic_load(&c->w[i].link) == W_UP && (!c->sib || atomic_load(&c->sib->w[i].link) == W_UP);
}

int shoal_expert_client_covered(shoal_expert_client *c, char *why, size_t whylen)
{
    char names[512];
    int32_t who[16];
    if (c->o.trunk_role) {
        for (size_t i = 0; i < c->ncells; i++) {
            const shoal_tshard_cell *x = &c->cells[i];
            int ok = 0, n = 0;
            for (uint32_t j = x->off; j < x->off + x->n && !ok; j++) {
                ok = up_both(c, c->cown[j].w);
                if (n < 16)
                    who[n++] = c->cown[j].w;
            }
            if (ok)
                continue;
            if (why && whylen) {
                owner_names(c, who, n, names, sizeof names);
                snprintf(why, whylen, "trunk rows %u-%u of %s: %s %s down", x->lo, x->hi, c->tmats[x->mat].name,
                         x->n > 1 ? "all their owners" : "their owner", names);
            }
            return 0;
        }
        return 1;
    }
    for (int l = 0; l < c->L; l++)
        for (int e = 0; c->cfg->is_moe[l] && e < c->E; e++) {
            const int32_t *ow;
            int n = shoal_owners_of(c->owners, l, e, &ow), ok = 0;
            for (int q = 0; q < n && !ok; q++)
                ok = up_both(c, ow[q]);
            if (ok || n == 0)
                continue;
            if (why && whylen) {
                owner_names(c, ow, n < 16 ? n : 16, names, sizeof names);
                snprintf(why, whylen, "layer %d expert %d: %s %s down", l, e, n > 1 ? "all its owners" : "its owner",
                         names);
            }
            return 0;
        }
    return 1;
}

int shoal_expert_client_any_prefetch(const shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++)
        if (c->w[i].prefetch)
            return 1;
    return 0;
}

int shoal_expert_client_any_trunk(const shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++)
        if (c->w[i].ntrunk)
            return 1;
    return 0;
}

int shoal_expert_client_nworkers(const shoal_expert_client *c)
{
    return c->nw;
}

const char *shoal_expert_client_worker_name(const shoal_expert_client *c, int i)
{
    return i >= 0 && i < c->nw ? c->w[i].name : "?";
}
