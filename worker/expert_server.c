/* `shoal expert`: the expert server's socket loop and CLI (see expert_server.h).
 *
 * Loop: poll the ROUTER; take every message already waiting into a small FIFO
 * (stamped on arrival, so queue_us is the time spent behind earlier requests);
 * answer the head; repeat. One thread owns the socket. Replies are written
 * straight into ZeroMQ messages (no copy of the expert outputs). */
#include "common/suggest.h"
#include "worker/expert_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <malloc.h>
#include <netinet/in.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <sodium.h>
#include <zmq.h>

#include "cli/commands.h"
#include "common/curve.h"
#include "common/err.h"
#include "common/k3cfg.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "common/memplan.h"
#include "common/packfile.h"
#include "common/planfile.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "proto/fprint.h"
#include "proto/proto.h"
#include "proto/shard.h"
#include "proto/tshard.h"
#include "worker/bank.h"
#include "worker/rbudget.h"
#include "worker/relay.h"
#include "worker/serve.h"
#include "worker/store.h"

#define QCAP 16 /* requests taken off the socket ahead of the one computed */
#define MAX_PARTS (1 + SHOAL_PROTO_MAX_FRAMES) /* routing id + frames */
#define RELAY_PARK 8 /* relayed requests, and inputs, parked at most (PROTOCOL.md §3.9) */

typedef struct {
    zmq_msg_t part[MAX_PARTS];
    int nparts;
    int too_many; /* more frames than the protocol allows (dropped) */
    uint64_t arrived_us;
} qreq;

typedef struct {
    zmq_msg_t msg;
    int live;
    shoal_rbudget *budget; /* admits and counts every reply data frame */
    const uint8_t *peer;   /* the request's routing id */
    size_t peerlen;
} out_frame;

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The reply's data frame, admitted by the reply budget (worker/rbudget.h):
 * ZeroMQ releases it through shoal_rbudget_release once it has written it or
 * dropped its connection, which is what keeps the count of unread reply bytes
 * per peer true. */
static void *alloc_frame(void *ctx, size_t len, char *why, size_t whylen)
{
    out_frame *o = ctx;
    void *data, *hint;
    if (shoal_rbudget_alloc(o->budget, o->peer, o->peerlen, len, &data, &hint, why, whylen))
        return NULL;
    if (zmq_msg_init_data(&o->msg, data, len, shoal_rbudget_release, hint)) {
        shoal_rbudget_release(data, hint);
        return NULL;
    }
    o->live = 1;
    return data;
}

/* Receive one whole multipart message: if one is waiting, or with `wait`
 * within the socket's ZMQ_RCVTIMEO (a blocking receive costs the idle worker
 * fewer system calls than zmq_poll followed by a receive). 1 got, 0 none
 * (timeout, signal), <0 error. */
static int recv_one(void *sock, qreq *r, int wait)
{
    r->nparts = 0;
    r->too_many = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, r->nparts == 0 && !wait ? ZMQ_DONTWAIT : 0) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            if (r->nparts == 0)
                return e == EAGAIN || e == EINTR ? 0 : -e;
            /* the rest of a multipart message is always there; keep what we have */
            return 1;
        }
        int more = zmq_msg_more(&m);
        if (r->nparts < MAX_PARTS) {
            r->part[r->nparts++] = m;
        } else {
            r->too_many = 1;
            zmq_msg_close(&m);
        }
        if (!more)
            break;
    }
    r->arrived_us = now_us();
    return 1;
}

static void qreq_close(qreq *r)
{
    for (int i = 0; i < r->nparts; i++)
        zmq_msg_close(&r->part[i]);
    r->nparts = 0;
}

/* Send [routing id, control, data?]. A peer that has gone (EHOSTUNREACH) or a
 * full queue is logged and counted; the server goes on. */
static void send_reply(void *sock, zmq_msg_t *rid, const shoal_serve_reply *rep, out_frame *of, uint64_t *dropped)
{
    int rc = zmq_send(sock, zmq_msg_data(rid), zmq_msg_size(rid), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0)
        rc = zmq_send(sock, rep->frames[0].data, rep->frames[0].len, (rep->n == 2 ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT);
    if (rc >= 0 && rep->n == 2) {
        rc = zmq_msg_send(&of->msg, sock, ZMQ_DONTWAIT);
        if (rc >= 0)
            of->live = 0; /* ZeroMQ owns it now */
    }
    if (rc < 0) { /* a peer that never reads fills its queue: counted, logged the first 20 then every 1000th */
        if (*dropped < 20 || *dropped % 1000 == 0)
            SHOAL_WARN("reply not sent: %s%s", zmq_strerror(errno),
                       *dropped >= 20 ? " (counting; logged every 1000th)" : "");
        (*dropped)++;
    }
    if (of->live) {
        zmq_msg_close(&of->msg);
        of->live = 0;
    }
}

static void handle(void *sock, shoal_serve *srv, qreq *r, int stopping, int *shutdown, uint64_t *dropped,
                   shoal_wmetrics *wm, shoal_rbudget *budget)
{
    if (r->nparts < 2) { /* no routing id or no frame: nothing to answer */
        qreq_close(r);
        return;
    }
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    int nf = r->nparts - 1;
    for (int i = 0; i < nf; i++)
        f[i] = (shoal_frame){zmq_msg_data(&r->part[i + 1]), zmq_msg_size(&r->part[i + 1])};
    shoal_serve_reply rep;
    out_frame of = {.live = 0, .budget = budget, .peer = zmq_msg_data(&r->part[0]), .peerlen = zmq_msg_size(&r->part[0])};
    if (r->too_many) {
        shoal_serve_refuse(srv, f, nf, SHOAL_PERR_MALFORMED, "message has more frames than the protocol allows",
                           &rep);
    } else if (stopping) {
        shoal_serve_refuse(srv, f, nf, SHOAL_PERR_SHUTTING_DOWN, "the worker is shutting down", &rep);
    } else {
        uint64_t q = now_us() - r->arrived_us;
        shoal_serve_handle(srv, zmq_msg_data(&r->part[0]), zmq_msg_size(&r->part[0]), f, nf, q, alloc_frame, &of,
                           &rep);
    }
    uint64_t before = *dropped;
    if (rep.n) /* 0: a notice (PREFETCH), never answered */
        send_reply(sock, &r->part[0], &rep, &of, dropped);
    if (*dropped != before)
        shoal_wmetrics_send_failed(wm);
    if (rep.shutdown)
        *shutdown = 1;
    qreq_close(r);
}

static uint64_t mem_total(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

/* Connections refused before ZAP sees them: a plain (NULL mechanism) client of
 * a CURVE worker fails the ZMTP handshake (mechanism mismatch), which only the
 * socket monitor reports -- and its events name the listener's own endpoint,
 * not the peer (libzmq 4.3's monitor gives a bound socket's local address).
 * So a thread of its own reads the monitor as events come: at ACCEPTED (whose
 * value is the new connection's fd) it asks the kernel for the peer's address
 * (getpeername) at once, before the handshake can fail and the fd be closed;
 * a HANDSHAKE_FAILED is followed by that connection's DISCONNECTED (same fd),
 * which names the address to log. (The race with the close is usually won:
 * the handshake needs the peer's greeting first; when lost, the line says the
 * address could not be read -- never the listener's endpoint as if it were
 * the peer's.) Logged the first 20, then every 1000th. */
#define MON_FDS 64
typedef struct {
    void *mon;
    pthread_t th;
    atomic_int stop;
    int started;
    uint64_t refused;
    struct {
        int fd;
        char addr[80];
    } fds[MON_FDS];
    int next;
} monitor;

static void peer_of(int fd, char *out, size_t n)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[INET6_ADDRSTRLEN] = "";
    if (getpeername(fd, (struct sockaddr *)&ss, &sl)) { /* the handshake failed and closed it first */
        snprintf(out, n, "a peer that left before its address could be read");
        return;
    }
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
        snprintf(out, n, "%s:%u", host, (unsigned)ntohs(a->sin_port));
    } else if (ss.ss_family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
        snprintf(out, n, "[%s]:%u", host, (unsigned)ntohs(a->sin6_port));
    } else {
        snprintf(out, n, "a local socket");
    }
}

static void *monitor_main(void *arg)
{
    monitor *m = arg;
    int failed = 0;
    uint32_t failed_val = 0;
    while (!atomic_load(&m->stop)) {
        zmq_pollitem_t it = {m->mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 200) <= 0)
            continue;
        zmq_msg_t ev, addr;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, m->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            continue;
        }
        zmq_msg_init(&addr);
        if (zmq_msg_more(&ev))
            zmq_msg_recv(&addr, m->mon, ZMQ_DONTWAIT);
        uint16_t id = 0;
        uint32_t val = 0;
        if (zmq_msg_size(&ev) >= 6) {
            memcpy(&id, zmq_msg_data(&ev), 2);
            memcpy(&val, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        }
        zmq_msg_close(&ev);
        zmq_msg_close(&addr);
        if (id == ZMQ_EVENT_ACCEPTED) {
            int k = m->next++ % MON_FDS; /* the oldest entry goes first */
            for (int i = 0; i < MON_FDS; i++)
                if (m->fds[i].fd == (int)val + 1) /* a reused fd: its old entry is stale */
                    k = i;
            m->fds[k].fd = (int)val + 1; /* 0: a free entry */
            peer_of((int)val, m->fds[k].addr, sizeof m->fds[k].addr);
        } else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL || id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
            failed = 1;
            failed_val = val;
        } else if (id == ZMQ_EVENT_DISCONNECTED) {
            const char *a = "a peer whose address was not seen";
            for (int i = 0; i < MON_FDS; i++)
                if (m->fds[i].fd == (int)val + 1) {
                    a = m->fds[i].addr;
                    m->fds[i].fd = 0;
                }
            if (failed && (m->refused < 20 || m->refused % 1000 == 0))
                SHOAL_WARN("refused a connection from %s: %s (0x%x)%s", a,
                           failed_val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                               ? "handshake failed: the client does not speak CURVE (plain TCP?)"
                               : "handshake failed",
                           (unsigned)failed_val, m->refused >= 20 ? " (counting; logged every 1000th)" : "");
            m->refused += failed;
            failed = 0;
        }
    }
    return NULL;
}

typedef struct {
    shoal_k3cfg cfg;
    shoal_st *st;
    shoal_proto_range *ranges;
    size_t nranges;
    shoal_shard *own;
    shoal_bank *bank;
    shoal_store *store;
    shoal_serve *srv;
    void *zctx, *sock;
    monitor *mon; /* CURVE: the handshake-failure monitor and its thread */
    shoal_curve_zap *zap;
    qreq *q;
    shoal_wmetrics *wm;
    shoal_rbudget *budget; /* freed after the context: ZeroMQ may release replies until then */
    /* trunk rows (--trunk): what HELLO announces and where each is mapped */
    shoal_st *tst; /* a mapped store for the trunk when st is headers-only (cached experts) */
    shoal_proto_trows *trunk;
    size_t ntrunk;
    shoal_serve_tmat *tmat;
    uint8_t trunk_fp[SHOAL_PROTO_FP_BYTES];
    uint64_t logged_full; /* inputs dropped for a full park (the log's rate limit) */
    shoal_relay *relay; /* --relay-peers: this worker's links to its relay children (NULL: none) */
    /* relayed requests without their input, inputs without their request
     * (PROTOCOL.md §3.9): at most RELAY_PARK each, each until its wait_ms */
    struct {
        qreq q;
        uint64_t xid, until_us;
        int live;
    } preq[RELAY_PARK];
    struct {
        zmq_msg_t x;
        uint64_t xid, until_us;
        int live;
    } px[RELAY_PARK];
} server;

static void server_free(server *s)
{
    if (s->mon) {
        if (s->mon->started) {
            atomic_store(&s->mon->stop, 1);
            pthread_join(s->mon->th, NULL);
        }
        if (s->mon->mon)
            zmq_close(s->mon->mon);
        free(s->mon);
    }
    for (int i = 0; i < RELAY_PARK; i++) {
        if (s->preq[i].live)
            qreq_close(&s->preq[i].q);
        if (s->px[i].live)
            zmq_msg_close(&s->px[i].x);
    }
    shoal_relay_close(s->relay);
    if (s->sock)
        zmq_close(s->sock);
    shoal_curve_zap_stop(s->zap);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    shoal_rbudget_close(s->budget);
    shoal_serve_close(s->srv);
    shoal_wmetrics_close(s->wm);
    shoal_bank_close(s->bank);
    shoal_store_close(s->store);
    shoal_shard_close(s->own);
    free(s->ranges);
    shoal_st_close(s->st);
    shoal_st_close(s->tst);
    free(s->trunk);
    free(s->tmat);
    free(s->q);
}

/* ---- the relay tree (PROTOCOL.md §3.9) ---------------------------------- */

/* Move the parts of a received message (zmq_msg_move: the struct itself must
 * not be copied). */
static void qreq_move(qreq *dst, qreq *src)
{
    for (int i = 0; i < src->nparts; i++) {
        zmq_msg_init(&dst->part[i]);
        zmq_msg_move(&dst->part[i], &src->part[i]);
        zmq_msg_close(&src->part[i]);
    }
    dst->nparts = src->nparts;
    dst->too_many = src->too_many;
    dst->arrived_us = src->arrived_us;
    src->nparts = 0;
}

/* Answer r (a request) with ERROR perr, or, when x is given, compute it as
 * a relayed TRUNK_BATCH with that input; then close r. */
static void answer(server *s, qreq *r, int perr, const char *msg, zmq_msg_t *x, uint64_t *dropped)
{
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    int nf = r->nparts - 1;
    for (int i = 0; i < nf; i++)
        f[i] = (shoal_frame){zmq_msg_data(&r->part[i + 1]), zmq_msg_size(&r->part[i + 1])};
    shoal_serve_reply rep;
    out_frame of = {.live = 0, .budget = s->budget, .peer = zmq_msg_data(&r->part[0]),
                    .peerlen = zmq_msg_size(&r->part[0])};
    if (x) {
        shoal_frame xf = {zmq_msg_data(x), zmq_msg_size(x)};
        shoal_serve_handle_relayed(s->srv, of.peer, of.peerlen, f, nf, &xf, now_us() - r->arrived_us, alloc_frame,
                                   &of, &rep);
    } else {
        shoal_serve_refuse(s->srv, f, nf, perr, msg, &rep);
    }
    uint64_t before = *dropped;
    if (rep.n)
        send_reply(s->sock, &r->part[0], &rep, &of, dropped);
    if (*dropped != before)
        shoal_wmetrics_send_failed(s->wm);
    qreq_close(r);
}

/* The relay's part of the server loop, for the message at the head of the
 * queue: 1 when it took it (parked, paired, forwarded and kept, refused), 0
 * when the ordinary handler is to serve it (after forwarding a root's x). A
 * TRUNK_X from a connection that is not a relay parent is left to the
 * handler, which refuses it. */
static int relay_take(server *s, qreq *r, uint64_t *dropped)
{
    if (r->too_many || r->nparts < 2)
        return 0;
    const uint8_t *c = zmq_msg_data(&r->part[1]);
    size_t cl = zmq_msg_size(&r->part[1]);
    if (cl < 2 || c[0] != 0x93 || (c[1] != SHOAL_MSG_TRUNK_BATCH && c[1] != SHOAL_MSG_TRUNK_X))
        return 0; /* not one of the two (a fixarray of 3 whose type is a positive fixint) */
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    int nf = r->nparts - 1;
    for (int i = 0; i < nf; i++)
        f[i] = (shoal_frame){zmq_msg_data(&r->part[i + 1]), zmq_msg_size(&r->part[i + 1])};
    static shoal_proto_msg m; /* large; one thread */
    memset(&m, 0, sizeof m);
    int perr;
    char why[256];
    if (shoal_proto_decode(f, nf, SHOAL_SIDE_WORKER, &m, &perr, why, sizeof why))
        return 0; /* the handler answers it with the same error */
    const uint8_t *peer = zmq_msg_data(&r->part[0]);
    size_t peerlen = zmq_msg_size(&r->part[0]);
    const shoal_proto_relay *rl = m.type == SHOAL_MSG_TRUNK_X ? &m.trunkx.relay : &m.tbatch.relay;
    if (!rl->xid)
        return 0; /* a TRUNK_BATCH of 1.7 */
    if (m.type == SHOAL_MSG_TRUNK_X && !shoal_serve_relay_parent(s->srv, peer, peerlen))
        return 0; /* refused by the handler (UNKNOWN_TYPE), counted there */
    uint32_t bad;
    if (rl->nfwd && shoal_relay_check(s->relay, rl->fwd, rl->nfwd, &bad)) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s: 'fwd'[%u] names relay peer %u; this worker has %d relay peer%s%s",
                 shoal_msg_type_name(m.type), bad, rl->fwd[bad].peer, shoal_relay_count(s->relay),
                 shoal_relay_count(s->relay) == 1 ? "" : "s", s->relay ? " (and never relays to itself)" : "");
        if (m.type == SHOAL_MSG_TRUNK_BATCH) {
            answer(s, r, SHOAL_PERR_BAD_SHAPE, msg, NULL, dropped);
        } else {
            SHOAL_WARN("relay: %s: dropped", msg);
            shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_DROPPED);
            qreq_close(r);
        }
        return 1;
    }
    if (m.type == SHOAL_MSG_TRUNK_BATCH && m.tbatch.has_x) { /* a root: forward first, then compute */
        shoal_relay_forward(s->relay, rl->xid, rl->wait_ms, rl->fwd, rl->nfwd, &r->part[2]);
        return 0;
    }
    uint64_t now = now_us();
    if (m.type == SHOAL_MSG_TRUNK_BATCH) { /* relayed: its input parked already, or park it */
        for (int i = 0; i < RELAY_PARK; i++)
            if (s->px[i].live && s->px[i].xid == rl->xid) {
                answer(s, r, 0, NULL, &s->px[i].x, dropped);
                zmq_msg_close(&s->px[i].x);
                s->px[i].live = 0;
                return 1;
            }
        for (int i = 0; i < RELAY_PARK; i++)
            if (!s->preq[i].live) {
                qreq_move(&s->preq[i].q, r);
                s->preq[i].xid = rl->xid;
                s->preq[i].until_us = r->arrived_us + (uint64_t)rl->wait_ms * 1000u;
                s->preq[i].live = 1;
                shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_PARKED);
                return 1;
            }
        answer(s, r, SHOAL_PERR_INTERNAL, "relay queue full: 8 relayed requests already wait for their input",
               NULL, dropped);
        return 1;
    }
    /* TRUNK_X from a relay parent: forward on first, then its request, or park it */
    shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_IN);
    shoal_wmetrics_relay_in_bytes(s->wm, zmq_msg_size(&r->part[2]));
    if (rl->nfwd)
        shoal_relay_forward(s->relay, rl->xid, rl->wait_ms, rl->fwd, rl->nfwd, &r->part[2]);
    for (int i = 0; i < RELAY_PARK; i++)
        if (s->preq[i].live && s->preq[i].xid == rl->xid) {
            s->preq[i].live = 0;
            answer(s, &s->preq[i].q, 0, NULL, &r->part[2], dropped);
            qreq_close(r);
            return 1;
        }
    for (int i = 0; i < RELAY_PARK; i++)
        if (!s->px[i].live) {
            zmq_msg_init(&s->px[i].x);
            zmq_msg_move(&s->px[i].x, &r->part[2]);
            s->px[i].xid = rl->xid;
            s->px[i].until_us = now + (uint64_t)rl->wait_ms * 1000u;
            s->px[i].live = 1;
            shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_PARKED);
            qreq_close(r);
            return 1;
        }
    if (s->logged_full < 20 || s->logged_full % 1000 == 0)
        SHOAL_WARN("relay: input %llu dropped: 8 inputs already wait for their request", (unsigned long long)rl->xid);
    s->logged_full++;
    shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_DROPPED);
    qreq_close(r);
    return 1;
}

/* Parked halves past their wait: a request is answered ERROR INTERNAL naming
 * its xid, an input dropped; stopping: every parked request is refused. */
static void relay_expire(server *s, int stopping, uint64_t *dropped)
{
    uint64_t now = now_us();
    for (int i = 0; i < RELAY_PARK; i++) {
        if (s->preq[i].live && (stopping || now >= s->preq[i].until_us)) {
            char msg[160];
            snprintf(msg, sizeof msg, "relay: no input (TRUNK_X) for xid %llu came within the request's wait_ms",
                     (unsigned long long)s->preq[i].xid);
            s->preq[i].live = 0;
            if (!stopping)
                shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_EXPIRED);
            answer(s, &s->preq[i].q, stopping ? SHOAL_PERR_SHUTTING_DOWN : SHOAL_PERR_INTERNAL,
                   stopping ? "the worker is shutting down" : msg, NULL, dropped);
        }
        if (s->px[i].live && now >= s->px[i].until_us) {
            zmq_msg_close(&s->px[i].x);
            s->px[i].live = 0;
            shoal_wmetrics_relay(s->wm, SHOAL_WRELAY_EXPIRED);
        }
    }
}

/* --trunk: parse the ROWSPEC against the model's row-shardable matrices and
 * point at each range's first row in a mapped store (the model's mapping; a
 * second, mapped store of the same files when the experts are read by pread).
 * Mapping is lazy: only the rows that requests read become resident.
 *
 * From a pack (`shoal pack` of a plan worker with trunk rows): each range must
 * lie inside one slice the manifest lists (trunk_rows), the slice tensor is
 * checked against the manifest and the config's matrix, and the trunk
 * fingerprint is computed from the manifest's FULL dtype, shape and size, so
 * the HELLO announces what a worker on the full model directory would. */
/* 1 when every expert this worker owns has MXFP4 or BF16 weights (their mu
 * products round the input to bf16, so a bf16 EXPERT_BATCH act is exact in
 * that class, PROTOCOL.md 1.7 `bf16_exact`); 0 when one has F32 weights
 * (shoal_gemm_f32 reads its input in fp32) or a tensor is not found. */
static int experts_round_input(const server *s)
{
    for (int l = 0; l < s->cfg.num_layers; l++)
        for (int e = 0; e < s->cfg.num_experts; e++) {
            if (!shoal_shard_owns(s->own, l, e))
                continue;
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(&s->cfg, l, e, ent);
            if (n == 6) /* MXFP4: packed + scale per matrix */
                continue;
            const shoal_tensor *t = n > 0 ? shoal_st_find(s->st, ent[0].name) : NULL;
            if (!t || t->dtype != SHOAL_DT_BF16)
                return 0;
        }
    return 1;
}

static int load_trunk(server *s, const char *dir, const char *spec, char *err, size_t errlen)
{
    shoal_tshard_mat *mats = NULL;
    int nm = 0, rc;
    if ((rc = shoal_tshard_mats(&s->cfg, &mats, &nm)))
        return shoal_err_set(err, errlen, rc, "--trunk: the model's trunk matrices do not list");
    rc = shoal_tshard_parse(spec, mats, nm, &s->trunk, &s->ntrunk, err, errlen);
    shoal_packfile pk = {0};
    int pack = !rc && shoal_packfile_is_pack(dir);
    if (pack && !(rc = shoal_packfile_read(&pk, dir, err, errlen)) && !pk.ntrows)
        rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                           "--trunk: pack %s holds no trunk rows (pack it from a plan made with --trunk spread)", dir);
    const shoal_packfile_trows **slice = pack ? shoal_xcalloc(s->ntrunk ? s->ntrunk : 1, sizeof *slice) : NULL;
    for (size_t i = 0; pack && !rc && i < s->ntrunk; i++) {
        const shoal_proto_trows *e = &s->trunk[i];
        for (int k = 0; k < pk.ntrows && !slice[i]; k++)
            if (!strcmp(pk.trows[k].name, e->name) && pk.trows[k].lo <= e->lo && e->hi <= pk.trows[k].hi)
                slice[i] = &pk.trows[k];
        int m = shoal_tshard_find(mats, nm, e->name);
        if (!slice[i])
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "--trunk: pack %s does not hold rows %u-%u of %s (it holds %s)",
                               dir, e->lo, e->hi, e->name, pk.trunk);
        else if (m < 0 || slice[i]->shape[0] != (uint64_t)mats[m].rows || slice[i]->shape[1] != (uint64_t)mats[m].cols)
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "--trunk: pack %s: %s is [%llu, %llu] in the manifest, "
                               "not the config's shape", dir, e->name, (unsigned long long)slice[i]->shape[0],
                               (unsigned long long)slice[i]->shape[1]);
    }
    free(mats);
    const shoal_st *st = s->st;
    if (!rc && s->ntrunk) {
        const shoal_tensor *t0 = shoal_st_find(s->st, pack ? slice[0]->tensor : s->trunk[0].name);
        if (t0 && !t0->data) {
            shoal_st_opts so = {.map = 1};
            if (!(rc = shoal_st_open(&s->tst, dir, &so, err, errlen)))
                st = s->tst;
        }
    }
    if (!rc)
        s->tmat = shoal_xcalloc(s->ntrunk, sizeof *s->tmat);
    shoal_fprint f;
    shoal_fprint_trunk_begin(&f);
    for (size_t i = 0; !rc && i < s->ntrunk; i++) {
        const shoal_tensor *t = shoal_st_find(st, pack ? slice[i]->tensor : s->trunk[i].name);
        if (!t || !t->data) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "--trunk: %s is not in %s%s", pack ? slice[i]->tensor :
                               s->trunk[i].name, dir, pack ? "" : " (a pack holds no trunk)");
            break;
        }
        if (t->ndim != 2 || (t->dtype != SHOAL_DT_BF16 && t->dtype != SHOAL_DT_F32) ||
            (pack && (strcmp(shoal_dtype_name(t->dtype), slice[i]->dtype) || (uint64_t)t->shape[1] != slice[i]->shape[1] ||
                      (uint64_t)t->shape[0] != (uint64_t)(slice[i]->hi - slice[i]->lo + 1)))) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "--trunk: %s is not a 2-D BF16 or F32 matrix%s", t->name,
                               pack ? " of the manifest's rows, width and dtype" : "");
            break;
        }
        size_t esz = shoal_dtype_size(t->dtype);
        uint32_t first = pack ? s->trunk[i].lo - slice[i]->lo : s->trunk[i].lo; /* the range's first row in t */
        s->tmat[i] = (shoal_serve_tmat){.w = (const char *)t->data + (size_t)first * (size_t)t->shape[1] * esz,
                                        .bf16 = t->dtype == SHOAL_DT_BF16, .cols = (int)t->shape[1],
                                        .rows = pack ? (int)slice[i]->shape[0] : (int)t->shape[0]};
        if (pack) { /* the full matrix's line, once per distinct matrix (as shoal_fprint_trunk) */
            int seen = 0;
            for (size_t j = 0; j < i && !seen; j++)
                seen = !strcmp(s->trunk[j].name, s->trunk[i].name);
            int64_t shape[2] = {(int64_t)slice[i]->shape[0], (int64_t)slice[i]->shape[1]};
            if (!seen)
                shoal_fprint_tensor(&f, slice[i]->name, slice[i]->dtype, 2, shape, slice[i]->nbytes);
        }
    }
    if (!rc && pack)
        shoal_fprint_end(&f, s->trunk_fp);
    else if (!rc)
        rc = shoal_fprint_trunk(s->trunk_fp, st, s->trunk, s->ntrunk, err, errlen);
    free(slice);
    shoal_packfile_free(&pk);
    return rc;
}

/* A model directory, or a pack (`shoal pack`, common/packfile.h): a pack holds
 * only some experts, so its fingerprint is the one recorded in its manifest
 * (computed by `shoal pack` from the full model's headers); its files' sizes
 * are always checked, their BLAKE2b checksums with verify. */
static int load_model_files(server *s, const char *dir, int map, int verify, uint8_t fp[SHOAL_PROTO_FP_BYTES],
                            char *err, size_t errlen)
{
    char path[4096];
    shoal_packfile pk = {0};
    int rc, pack = shoal_packfile_is_pack(dir);
    if (pack) {
        if ((rc = shoal_packfile_read(&pk, dir, err, errlen)))
            return rc;
        rc = shoal_packfile_check(&pk, dir, verify, err, errlen);
        memcpy(fp, pk.fingerprint, SHOAL_PROTO_FP_BYTES);
        if (!rc)
            SHOAL_INFO("pack %s: worker %s, experts %s%s%s, %d files%s", dir, pk.worker, pk.experts,
                       pk.trunk ? ", trunk rows " : "", pk.trunk ? pk.trunk : "", pk.nfiles,
                       verify ? ", checksums verified" : "");
        shoal_packfile_free(&pk);
        if (rc)
            return rc;
    } else if (verify) {
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "--verify: %s is not a pack (no %s); original shards carry no checksums", dir,
                             SHOAL_PACKFILE_NAME);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    if ((rc = shoal_k3cfg_load(&s->cfg, path, err, errlen)))
        return rc;
    shoal_st_opts so = {.map = map};
    if ((rc = shoal_st_open(&s->st, dir, &so, err, errlen)))
        return rc;
    return pack ? 0 : shoal_fprint_model(fp, &s->cfg, s->st, err, errlen);
}

/* Every failure to load the model is "invalid model" (exit 3), whatever the
 * system error under it (a missing shard, a read error), except a usage
 * mistake (--verify on a directory that is no pack: exit 2). */
static int load_model(server *s, const char *dir, int map, int verify, uint8_t fp[SHOAL_PROTO_FP_BYTES], char *err,
                      size_t errlen)
{
    int rc = load_model_files(s, dir, map, verify, fp, err, errlen);
    return rc && shoal_err_exit_code(rc) == 4 ? SHOAL_EMODEL : rc;
}

/* The memory plan, printed before the cache is allocated; a preset becomes a
 * slot count here. */
static int cache_plan(server *s, const shoal_expert_server_opts *o, shoal_store_opts *sto, char *err, size_t errlen)
{
    uint64_t sb;
    uint32_t mins;
    int rc = shoal_store_plan(s->st, &s->cfg, s->own, &sb, &mins, err, errlen);
    if (rc)
        return rc;
    uint64_t owned = shoal_shard_count(s->own);
    int mt = o->max_tokens > 0 ? o->max_tokens : 1024; /* as the request handler below */
    /* the request handler's scratch (worker/serve.c) */
    uint64_t scratch = (uint64_t)mt * (uint64_t)s->cfg.latent_size * 6 +
                       (uint64_t)mt * (uint64_t)s->cfg.moe_intermediate_size * 8 +
                       (uint64_t)mt * (uint64_t)s->cfg.experts_per_token * 16;
    shoal_memplan_probe p;
    shoal_memplan_read("", &p);
    uint64_t usable = shoal_memplan_usable(&p);
    char a[32], b[32], c[32], d[32], e[32], g[32];
    SHOAL_INFO("memory plan: usable %s (cgroup v%d limit %s%s%s, MemAvailable %s); shard %llu experts (%s in slots); "
               "slot %llu bytes; minimum %u slots = %s; request scratch %s",
               shoal_memplan_fmt(usable, a, sizeof a), p.cgroup_version, shoal_memplan_fmt(p.cgroup_limit, b, sizeof b),
               p.cgroup_version ? " from " : "", p.cgroup_version ? p.cgroup_file : "",
               shoal_memplan_fmt(p.mem_available, c, sizeof c), (unsigned long long)owned,
               shoal_memplan_fmt(owned * sb, d, sizeof d), (unsigned long long)sb, mins,
               shoal_memplan_fmt(mins * sb, e, sizeof e), shoal_memplan_fmt(scratch, g, sizeof g));
    if (!o->cache_preset)
        return 0;
    const char *pr = o->cache_preset;
    uint64_t slots;
    if (!strcmp(pr, "small")) {
        slots = mins;
    } else if (!strcmp(pr, "medium")) {
        slots = owned / 4 > mins ? owned / 4 : mins;
    } else if (!strcmp(pr, "large")) {
        slots = owned;
    } else if (!strcmp(pr, "auto")) {
        /* keep a reserve for the process itself, ZeroMQ, the scratch, and the
         * kernel's own page cache (10% + 64 MiB) */
        uint64_t reserve = scratch + (64ull << 20) + (usable == UINT64_MAX ? 0 : usable / 10);
        uint64_t budget = usable > reserve ? usable - reserve : 0;
        slots = budget / sb;
        if (slots < mins)
            return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                                 "--cache-gb auto: %s usable leaves %s for the expert cache after a %s reserve; the "
                                 "minimum is %u slots = %s (raise the memory limit by the difference)",
                                 shoal_memplan_fmt(usable, a, sizeof a), shoal_memplan_fmt(budget, b, sizeof b),
                                 shoal_memplan_fmt(reserve, c, sizeof c), mins, shoal_memplan_fmt(mins * sb, d, sizeof d));
        if (slots > owned)
            slots = owned;
    } else {
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--cache-gb: '%s' is not a size or small|medium|large|auto",
                             pr);
    }
    sto->slots = (uint32_t)slots;
    SHOAL_INFO("memory plan: preset %s -> %llu slots = %s", pr, (unsigned long long)slots,
               shoal_memplan_fmt(slots * sb, a, sizeof a));
    return 0;
}

/* CURVE server (PROTOCOL.md section 9): our key pair, and a ZAP handler that
 * accepts only the listed coordinator keys. Before the bind. */
static int setup_curve(server *s, const shoal_expert_server_opts *o, char *err, size_t errlen)
{
    shoal_curve_keypair kp;
    char(*keys)[SHOAL_CURVE_Z85] = NULL;
    int n = 0, rc;
    if (!o->curve_allow)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--curve-secret needs --curve-allow FILE (coordinator keys)");
    if ((rc = shoal_curve_read_pair(&kp, o->curve_secret, err, errlen)) ||
        (rc = shoal_curve_read_allow(&keys, &n, o->curve_allow, err, errlen)))
        return SHOAL_EINVAL; /* files named by flags: a usage mistake (exit 2) */
    rc = shoal_curve_zap_start(&s->zap, s->zctx, (const char(*)[SHOAL_CURVE_Z85])keys, n, err, errlen);
    free(keys);
    if (!rc)
        rc = shoal_curve_set_server(s->sock, &kp, err, errlen);
    if (!rc)
        SHOAL_INFO("CURVE on: worker public key %s, %d coordinator key%s allowed", kp.pub, n, n == 1 ? "" : "s");
    sodium_memzero(&kp, sizeof kp);
    return rc;
}

int shoal_expert_server_run(const shoal_expert_server_opts *o, char *err, size_t errlen)
{
    if (!o->model || (!o->experts && !o->trunk) || !o->listen)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--model, --experts (or --trunk) and --listen are required");
    server s = {0};
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    int cached = o->cache_bytes > 0 || o->cache_slots > 0 || o->cache_preset;
    shoal_cachepol_kind pol = SHOAL_CACHEPOL_LFU;
    if (o->cache_policy && (shoal_cachepol_parse(o->cache_policy, &pol) || pol == SHOAL_CACHEPOL_OPT))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--cache-policy: '%s' is not lfu or lru", o->cache_policy);
    int rc = load_model(&s, o->model, !cached, o->verify, fp, err, errlen);
    if (rc)
        goto out;
    if (o->plan_fingerprint && memcmp(o->plan_fingerprint, fp, SHOAL_PROTO_FP_BYTES)) {
        char a[65], b[65];
        shoal_proto_hex(o->plan_fingerprint, a);
        shoal_proto_hex(fp, b);
        rc = shoal_err_set(err, errlen, SHOAL_EFINGERPRINT, "the plan was made for model %.16s..., %s is %.16s...", a,
                           o->model, b);
        goto out;
    }
    if ((o->experts && (rc = shoal_shard_parse(o->experts, &s.ranges, &s.nranges, err, errlen))) ||
        (rc = shoal_shard_open(&s.own, s.ranges, s.nranges, s.cfg.num_layers, s.cfg.is_moe, s.cfg.num_experts, err,
                               errlen)))
        goto out;
    if (o->trunk && (rc = load_trunk(&s, o->model, o->trunk, err, errlen)))
        goto out;
    if (!o->experts) {
        /* trunk rows only: no expert bank */
    } else if (cached) {
        shoal_store_opts sto = {.cache_bytes = o->cache_bytes, .slots = o->cache_slots, .policy = pol,
                                .io_threads = o->io_threads, .no_direct = o->no_direct};
        if ((rc = cache_plan(&s, o, &sto, err, errlen)))
            goto out;
        if ((rc = shoal_store_open(&s.store, s.st, &s.cfg, s.own, &sto, err, errlen)))
            goto out;
        shoal_store_stats ss;
        shoal_store_stats_get(s.store, &ss);
        SHOAL_INFO("expert cache: %u of %llu experts resident at once (%u slots x %llu bytes = %.1f MiB; minimum %u "
                   "slots = %.1f MiB; shard %.1f MiB), policy %s, %s reads",
                   ss.slots, (unsigned long long)ss.owned, ss.slots, (unsigned long long)ss.slot_bytes,
                   (double)ss.slots * (double)ss.slot_bytes / 1048576.0, ss.min_slots,
                   (double)ss.min_slots * (double)ss.slot_bytes / 1048576.0,
                   (double)shoal_store_bytes(s.store) / 1048576.0, shoal_cachepol_name(pol),
                   ss.direct ? "O_DIRECT" : "buffered");
    } else if ((rc = shoal_bank_open(&s.bank, s.st, &s.cfg, s.own, err, errlen))) {
        goto out;
    } else {
        shoal_bank_guard(s.bank); /* a shard truncated under the mapping: a named exit, never a silent one */
    }
    uint64_t owned_bytes = s.store ? shoal_store_bytes(s.store) : s.bank ? shoal_bank_bytes(s.bank) : 0;
    if (o->threads > 0)
        omp_set_num_threads(o->threads);
    if ((rc = shoal_kernels_init())) {
        shoal_err_set(err, errlen, rc, "kernels: cannot select them (SHOAL_ISA, SHOAL_MX_DECODE, SHOAL_MU_FOLD or SHOAL_AMX_VARIANT "
                                       "names a kernel this build or CPU lacks?)");
        goto out;
    }
    const char *id = o->id ? o->id : o->listen;
    shoal_wmetrics_opts wo = {.id = id, .num_layers = s.cfg.num_layers, .is_moe = s.cfg.is_moe,
                              .num_experts = s.cfg.num_experts, .owned = shoal_shard_count(s.own),
                              .expert_bytes = shoal_shard_count(s.own) ? owned_bytes / shoal_shard_count(s.own)
                                                                       : 0};
    if ((rc = shoal_wmetrics_open(&s.wm, &wo, err, errlen)))
        goto out;
    if (s.store) {
        shoal_store_stats ss;
        shoal_store_stats_get(s.store, &ss);
        shoal_wmetrics_cache_config(s.wm, ss.slots, ss.slot_bytes);
        shoal_store_set_metrics(s.store, s.wm);
    }
    if (o->metrics_port > 0) {
        int port = 0;
        if ((rc = shoal_wmetrics_listen(s.wm, o->metrics_host, o->metrics_port, &port, err, errlen)))
            goto out;
        SHOAL_INFO("metrics on http://%s:%d/metrics", o->metrics_host ? o->metrics_host : "127.0.0.1", port);
    }
    shoal_serve_opts so = {.id = id, .fingerprint = fp, .owned = s.ranges, .nowned = s.nranges, .own = s.own,
                           .num_layers = s.cfg.num_layers, .is_moe = s.cfg.is_moe, .num_experts = s.cfg.num_experts,
                           .k = s.cfg.experts_per_token, .max_tokens = o->max_tokens > 0 ? o->max_tokens : 1024,
                           .isa = shoal_isa_name(shoal_kernels_isa()), .threads = omp_get_max_threads(),
                           .mem_total = mem_total(), .metrics = s.wm, .delay_us = o->delay_us,
                           .skip_compute = o->skip_compute, .refuse_shutdown = o->refuse_shutdown, .store = s.store,
                           .prefetch = !o->no_prefetch, .trunk = s.trunk, .tmat = s.tmat, .ntrunk = s.ntrunk,
                           .trunk_fp = s.trunk_fp, .model_dir = o->model,
                           .experts_round_input = experts_round_input(&s)};
    s.zctx = zmq_ctx_new();
    if (o->relay_peers) {
        shoal_relay_opts ro = {.list = o->relay_peers, .self = o->relay_self ? o->relay_self : o->listen, .curve_secret = o->curve_secret,
                               .zctx = s.zctx, .fingerprint = fp, .id = id, .wm = s.wm};
        if ((rc = shoal_relay_open(&s.relay, &ro, err, errlen)))
            goto out;
        so.relay = shoal_relay_endpoints(s.relay);
        so.nrelay = shoal_relay_count(s.relay);
    }
    if ((rc = shoal_serve_open(&s.srv, &so, s.bank, err, errlen)))
        goto out;
    if (o->skip_compute)
        SHOAL_WARN("--bench-skip-compute: answering zeros instead of the experts and trunk rows (benchmarks only)");

    /* requests (ZeroMQ's receive buffers) of a MiB and more are mapped and
     * unmapped directly: glibc's default would raise the threshold to 32 MiB
     * after the first large free and keep freed requests in the heap, so the
     * worker would hold its peak for good (replies: worker/rbudget.c) */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    shoal_rbudget_opts bo = {
        .peer_bytes = o->peer_reply_bytes ? o->peer_reply_bytes : (uint64_t)SHOAL_EXPERT_PEER_REPLY_MB << 20,
        .total_bytes = o->reply_budget_bytes ? o->reply_budget_bytes : (uint64_t)SHOAL_EXPERT_REPLY_BUDGET_MB << 20,
        .wait_us = 2000};
    if ((rc = shoal_rbudget_open(&s.budget, &bo, err, errlen)))
        goto out;
    s.sock = zmq_socket(s.zctx, ZMQ_ROUTER);
    int one = 1, linger = 2000;
    int64_t maxmsg = 16 + (int64_t)so.max_tokens * s.cfg.latent_size * 4;
    for (size_t i = 0; i < s.ntrunk; i++) /* a TRUNK_BATCH's input frame */
        if (16 + (int64_t)so.max_tokens * s.tmat[i].cols * 4 > maxmsg)
            maxmsg = 16 + (int64_t)so.max_tokens * s.tmat[i].cols * 4;
    if (maxmsg < (int64_t)SHOAL_PROTO_MAX_CONTROL)
        maxmsg = SHOAL_PROTO_MAX_CONTROL;
    zmq_setsockopt(s.sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(s.sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(s.sock, ZMQ_LINGER, &linger, sizeof linger);
    /* memory a peer can make the worker hold: (RCVHWM + QCAP) messages of at
     * most maxmsg bytes per connection */
    int rcvhwm = 16;
    zmq_setsockopt(s.sock, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    int rcvtimeo = 100; /* the idle wait's tick: the stop flag is checked this often */
    zmq_setsockopt(s.sock, ZMQ_RCVTIMEO, &rcvtimeo, sizeof rcvtimeo);
    if (o->curve_secret && (rc = setup_curve(&s, o, err, errlen)))
        goto out;
    if (o->curve_secret) {
        int lz = 0;
        s.mon = shoal_xcalloc(1, sizeof *s.mon);
        if (zmq_socket_monitor(s.sock, "inproc://shoal-worker-monitor",
                               ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) ||
            !(s.mon->mon = zmq_socket(s.zctx, ZMQ_PAIR)) ||
            zmq_setsockopt(s.mon->mon, ZMQ_LINGER, &lz, sizeof lz) ||
            zmq_connect(s.mon->mon, "inproc://shoal-worker-monitor")) {
            rc = shoal_err_set(err, errlen, -errno, "socket monitor: %s", zmq_strerror(errno));
            goto out;
        }
        if (pthread_create(&s.mon->th, NULL, monitor_main, s.mon)) {
            rc = shoal_err_set(err, errlen, SHOAL_ENOMEM, "cannot start the socket monitor thread");
            goto out;
        }
        s.mon->started = 1;
    } else if (shoal_curve_needed(o->listen)) {
        SHOAL_WARN("--insecure: %s is plain TCP, neither encrypted nor authenticated: anyone who reaches it can use "
                   "this worker and read the activations (trusted networks, tests and benchmarks only)",
                   o->listen);
    }
    if (zmq_bind(s.sock, o->listen)) {
        rc = shoal_err_set(err, errlen, -errno, "cannot listen on %s: %s", o->listen, zmq_strerror(errno));
        goto out;
    }
    SHOAL_INFO("serving %zu experts (%s, %.1f MiB) of %s on %s; isa %s, numerics %s (mu path %s), %d threads, max %d "
               "tokens per request",
               shoal_shard_count(s.own), o->experts ? o->experts : "none", (double)owned_bytes / 1048576.0, o->model,
               o->listen, so.isa, shoal_numerics_name(shoal_kernels_numerics()), shoal_kernels_mu_path(), so.threads,
               so.max_tokens);
    if (s.ntrunk) {
        uint64_t tb = 0;
        for (size_t i = 0; i < s.ntrunk; i++)
            tb += (uint64_t)(s.trunk[i].hi - s.trunk[i].lo + 1) * (uint64_t)s.tmat[i].cols * (s.tmat[i].bf16 ? 2 : 4);
        SHOAL_INFO("serving %zu trunk row range%s (%s, %.1f MiB)", s.ntrunk, s.ntrunk == 1 ? "" : "s", o->trunk,
                   (double)tb / 1048576.0);
    }

    {
        /* the largest reply a legal request can ask for: T = max_tokens, every
         * pair f32 (EXPERT_BATCH); every owned trunk row once (TRUNK_BATCH,
         * overlaps refused), at most the 2 GiB reply limit */
        uint64_t big = shoal_shard_count(s.own) ? (uint64_t)so.max_tokens * (uint64_t)so.k * (uint64_t)s.cfg.latent_size * 4
                                                : 0, rows = 0;
        for (size_t i = 0; i < s.ntrunk; i++)
            rows += s.trunk[i].hi - s.trunk[i].lo + 1;
        uint64_t tb = rows * (uint64_t)so.max_tokens * 4;
        if (tb > (1ull << 31))
            tb = 1ull << 31;
        if (tb > big)
            big = tb;
        SHOAL_INFO("reply budget: %.0f MiB of unread replies per connection, %.0f MiB in all (the largest legal reply "
                   "is %.1f MiB)", (double)bo.peer_bytes / 1048576.0, (double)bo.total_bytes / 1048576.0,
                   (double)(big + 16) / 1048576.0);
    }
    s.q = shoal_xcalloc(QCAP, sizeof *s.q);
    int head = 0, count = 0, shutdown = 0;
    uint64_t dropped = 0, handled = 0;
    while (!shutdown && !(o->stop && *o->stop)) {
        if (count == 0) { /* idle: block in the receive itself (ZMQ_RCVTIMEO), as cheap as a wait gets */
            int g = recv_one(s.sock, &s.q[head], 1);
            if (g < 0) {
                rc = shoal_err_set(err, errlen, g, "receive on %s failed: %s", o->listen, zmq_strerror(-g));
                goto out;
            }
            count = g;
        }
        while (count < QCAP) { /* take what is waiting, stamped on arrival */
            int g = recv_one(s.sock, &s.q[(head + count) % QCAP], 0);
            if (g <= 0)
                break;
            count++;
        }
        shoal_relay_drain(s.relay);
        relay_expire(&s, 0, &dropped);
        if (count == 0)
            continue;
        if (!relay_take(&s, &s.q[head], &dropped))
            handle(s.sock, s.srv, &s.q[head], 0, &shutdown, &dropped, s.wm, s.budget);
        head = (head + 1) % QCAP;
        count--;
        handled++;
    }
    /* stopping: what is queued (and what is already waiting, and parked) is refused, not computed */
    relay_expire(&s, 1, &dropped);
    for (;;) {
        while (count < QCAP && recv_one(s.sock, &s.q[(head + count) % QCAP], 0) > 0)
            count++;
        if (count == 0)
            break;
        handle(s.sock, s.srv, &s.q[head], 1, &shutdown, &dropped, s.wm, s.budget);
        head = (head + 1) % QCAP;
        count--;
    }
    char pk[32];
    SHOAL_INFO("peak resident memory %s", shoal_memplan_fmt(shoal_memplan_peak_rss(), pk, sizeof pk));
    shoal_proto_stats st;
    shoal_serve_stats(s.srv, &st);
    SHOAL_INFO("stopping (%s): %llu requests, %llu batches, %llu pairs, %llu errors, %llu replies dropped",
               shutdown ? "SHUTDOWN" : "signal", (unsigned long long)st.requests, (unsigned long long)st.batches,
               (unsigned long long)st.pairs, (unsigned long long)st.errors, (unsigned long long)dropped);
    if (s.store) {
        shoal_store_stats ss;
        shoal_store_stats_get(s.store, &ss);
        SHOAL_INFO("expert cache: %llu hits, %llu misses (hit rate %.3f), %.1f MiB read from disk in %.3f s",
                   (unsigned long long)ss.hits, (unsigned long long)ss.misses,
                   ss.hits + ss.misses ? (double)ss.hits / (double)(ss.hits + ss.misses) : 0.0,
                   (double)ss.bytes_read / 1048576.0, (double)ss.read_us / 1e6);
        uint64_t notices, pdropped;
        shoal_serve_prefetch_counts(s.srv, &notices, &pdropped);
        SHOAL_INFO("expert cache prefetch%s: %llu hints (%llu dropped); %llu experts read ahead (%.1f MiB), %llu "
                   "prefetch hits, %llu wasted (evicted unused); resident hits %llu, prefetch hits %llu, demand "
                   "misses %llu of %llu fetches",
                   o->no_prefetch ? " (off: hints ignored)" : "", (unsigned long long)notices,
                   (unsigned long long)pdropped, (unsigned long long)ss.prefetch_reads,
                   (double)ss.prefetch_bytes / 1048576.0, (unsigned long long)ss.prefetch_hits,
                   (unsigned long long)ss.prefetch_wasted, (unsigned long long)ss.hits,
                   (unsigned long long)ss.prefetch_hits, (unsigned long long)ss.misses,
                   (unsigned long long)(ss.hits + ss.prefetch_hits + ss.misses));
    }
    rc = 0;
out:
    server_free(&s);
    return rc;
}

/* ---- CLI ------------------------------------------------------------------ */

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal expert --model DIR --experts RANGES --listen ENDPOINT [options]\n"
               "\n"
               "Serve the routed experts RANGES of the model in DIR to coordinators over ZeroMQ\n"
               "(proto/PROTOCOL.md). RANGES: comma-separated LAYERS:EXPERTS groups, each side 'a' or\n"
               "'a-b' (inclusive, absolute 0-indexed layers), e.g. 1-92:0-447. ENDPOINT: tcp://HOST:PORT\n"
               "or ipc:///PATH. DIR may be a pack written by `shoal pack` (docs/DEPLOY.md).\n"
               "\n"
               "options:\n"
               "  --trunk ROWSPEC      also (or, without --experts, only) serve rows of trunk matrices\n"
               "                       (PROTOCOL.md 7.1): PATTERN:ROWS items, comma-separated; PATTERN a\n"
               "                       glob over tensor names (the language_model. prefix optional), ROWS\n"
               "                       a, a-b, all or i/n; e.g. 'model.layers.*.mlp.*:0/2,lm_head.weight:all'\n"
               "  --plan FILE          take RANGES, ENDPOINT and the trunk ROWSPEC (if any) from plan.json\n"
               "                       (`shoal plan`, docs/CLUSTER.md)\n"
               "  --name NAME          this worker's name in --plan (also its --id)\n"
               "  --verify             DIR is a pack (`shoal pack`): check every file's BLAKE2b first\n"
               "  --curve-secret FILE  CURVE key pair of this worker (`shoal keygen`): every link is\n"
               "                       encrypted and authenticated (PROTOCOL.md section 9)\n"
               "  --curve-allow FILE   public keys of the coordinators this worker accepts, one per line\n"
               "  --insecure           plain TCP without CURVE (a tcp:// ENDPOINT needs CURVE or this)\n"
               "  --threads N          OpenMP threads (default: all cores)\n"
               "  --id NAME            worker id in HELLO and logs (default: the endpoint)\n"
               "  --max-tokens N       largest token count per request (default 1024)\n"
               "  --metrics-port N     serve Prometheus metrics on http://HOST:N/metrics (docs/METRICS.md)\n"
               "  --metrics-host HOST  address for --metrics-port (default 127.0.0.1)\n"
               "  --cache-gb G         RAM budget for the experts in GiB (fractions allowed): experts are read\n"
               "                       from disk into a fixed cache of that size instead of mapping the shard;\n"
               "                       or a preset: small (the minimum: one token's experts), medium (a quarter\n"
               "                       of the shard), large (all of it), auto (the cgroup limit / MemAvailable\n"
               "                       less a reserve)\n"
               "  --cache-slots N      the same budget given as a number of experts\n"
               "  --cache-policy P     lfu (default: frequency with aging) or lru\n"
               "  --io-threads N       concurrent expert reads (default 8)\n"
               "  --no-direct          buffered reads (no O_DIRECT)\n"
               "  --no-prefetch        ignore the coordinator's PREFETCH hints (read only on demand)\n"
               "  --numerics CLASS     portable (default: the fp32-activation order) or mu (the matrix-unit\n"
               "                       order: AMX where it passes its self-test, an exact emulation elsewhere);\n"
               "                       every process of a cluster must use the same (docs/CONFIG.md)\n"
               "  --refuse-shutdown    answer SHUTDOWN with ERROR (what `shoal serve --workers N` gives its\n"
               "                       workers: only the coordinator that started them stops them, by SIGTERM)\n"
               "  --peer-reply-mb N    MiB of replies one connection may leave unread before its requests are\n"
               "                       refused with ERROR (default 256; a connection holding none may always\n"
               "                       have one reply; PROTOCOL.md section 6)\n"
               "  --reply-budget-mb N  the same for all connections together (default 1024)\n"
               "  --relay-peers LIST   workers this one may forward trunk inputs to (the relay tree,\n"
               "                       PROTOCOL.md 3.9): ENDPOINT[@KEY],... in the same order on every worker\n"
               "                       of the tree; KEY (Z85, or a .pub file) for a tcp:// peer with CURVE;\n"
               "                       each peer's --curve-allow must list this worker's public key;\n"
               "                       with --plan and a plan relay_fanout: every trunk worker of the plan\n"
               "  --relay-keys DIR     with --plan: the relay peers' public keys are DIR/NAME.pub\n"
               "  --print-fingerprint  print the model fingerprint (PROTOCOL.md section 5) and exit\n"
               "  --test-delay-ms N    (tests) sleep N ms before computing each batch\n"
               "  --bench-skip-compute (benchmarks) answer zeros instead of running the experts (and trunk rows)\n"
               "\n"
               "SIGTERM/SIGINT: finish the request in flight, refuse queued ones, exit 0.\n");
}

int shoal_cmd_expert(int argc, char **argv)
{
    static const struct option longopts[] = {{"model", required_argument, 0, 'm'},
                                             {"experts", required_argument, 0, 'e'},
                                             {"listen", required_argument, 0, 'l'},
                                             {"trunk", required_argument, 0, 'T'},
                                             {"threads", required_argument, 0, 't'},
                                             {"id", required_argument, 0, 'i'},
                                             {"max-tokens", required_argument, 0, 'x'},
                                             {"print-fingerprint", no_argument, 0, 'p'},
                                             {"metrics-port", required_argument, 0, 'M'},
                                             {"metrics-host", required_argument, 0, 'H'},
                                             {"test-delay-ms", required_argument, 0, 'd'},
                                             {"bench-skip-compute", no_argument, 0, 's'},
                                             {"plan", required_argument, 0, 'P'},
                                             {"verify", no_argument, 0, 'V'},
                                             {"curve-secret", required_argument, 0, 'K'},
                                             {"curve-allow", required_argument, 0, 'A'},
                                             {"insecure", no_argument, 0, 'U'},
                                             {"name", required_argument, 0, 'N'},
                                             {"cache-gb", required_argument, 0, 'G'},
                                             {"cache-slots", required_argument, 0, 'S'},
                                             {"cache-policy", required_argument, 0, 'Y'},
                                             {"io-threads", required_argument, 0, 'I'},
                                             {"no-direct", no_argument, 0, 'D'},
                                             {"no-prefetch", no_argument, 0, 'F'},
                                             {"refuse-shutdown", no_argument, 0, 'R'},
                                             {"peer-reply-mb", required_argument, 0, 'Q'},
                                             {"reply-budget-mb", required_argument, 0, 'B'},
                                             {"numerics", required_argument, 0, 'n'},
                                             {"relay-peers", required_argument, 0, 'r'},
                                             {"relay-keys", required_argument, 0, 'k'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    shoal_expert_server_opts o = {.stop = &stop_flag};
    int print_fp = 0, c;
    const char *plan = NULL, *name = NULL, *relay_keys = NULL;
    int insecure = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        char *end = NULL;
        long v = 0;
        if (c == 't' || c == 'x' || c == 'd' || c == 'M' || c == 'S' || c == 'I' || c == 'Q' || c == 'B') {
            errno = 0;
            v = strtol(optarg, &end, 10);
            if (errno || !end || *end || v < 0 || v > 1000000) {
                fprintf(stderr, "shoal expert: bad number '%s'\n", optarg);
                return 2;
            }
        }
        switch (c) {
        case 'm': o.model = optarg; break;
        case 'e': o.experts = optarg; break;
        case 'T': o.trunk = optarg; break;
        case 'l': o.listen = optarg; break;
        case 'i': o.id = optarg; break;
        case 't': o.threads = (int)v; break;
        case 'x': o.max_tokens = (int)v; break;
        case 'd': o.delay_us = (unsigned)v * 1000u; break;
        case 'p': print_fp = 1; break;
        case 's': o.skip_compute = 1; break;
        case 'M':
            if (v < 1 || v > 65535) {
                fprintf(stderr, "shoal expert: --metrics-port must be 1..65535\n");
                return 2;
            }
            o.metrics_port = (int)v;
            break;
        case 'H': o.metrics_host = optarg; break;
        case 'P': plan = optarg; break;
        case 'V': o.verify = 1; break;
        case 'K': o.curve_secret = optarg; break;
        case 'A': o.curve_allow = optarg; break;
        case 'U': insecure = 1; break;
        case 'N': name = optarg; break;
        case 'S':
            if (v < 1) {
                fprintf(stderr, "shoal expert: --cache-slots must be at least 1\n");
                return 2;
            }
            o.cache_slots = (uint32_t)v;
            break;
        case 'I': o.io_threads = (int)v; break;
        case 'Y': o.cache_policy = optarg; break;
        case 'D': o.no_direct = 1; break;
        case 'F': o.no_prefetch = 1; break;
        case 'R': o.refuse_shutdown = 1; break;
        case 'r': o.relay_peers = optarg; break;
        case 'k': relay_keys = optarg; break;
        case 'n': {
            shoal_numerics nc;
            if (shoal_numerics_parse(optarg, &nc)) {
                fprintf(stderr, "shoal expert: --numerics takes portable or mu, not '%s'\n", optarg);
                return 2;
            }
            shoal_kernels_set_numerics(nc);
            break;
        }
        case 'Q':
        case 'B':
            if (v < 1) {
                fprintf(stderr, "shoal expert: --%s must be at least 1\n", c == 'Q' ? "peer-reply-mb" : "reply-budget-mb");
                return 2;
            }
            *(c == 'Q' ? &o.peer_reply_bytes : &o.reply_budget_bytes) = (uint64_t)v << 20;
            break;
        case 'G': {
            if (strspn(optarg, "abcdefghijklmnopqrstuvwxyz") == strlen(optarg)) {
                o.cache_preset = optarg; /* checked by the server, with the model */
                break;
            }
            errno = 0;
            double g = strtod(optarg, &end);
            if (errno || !end || *end || !(g > 0) || g > 1e6) {
                fprintf(stderr, "shoal expert: bad --cache-gb '%s'\n", optarg);
                return 2;
            }
            o.cache_bytes = (uint64_t)(g * 1073741824.0);
            if (!o.cache_bytes)
                o.cache_bytes = 1;
            break;
        }
        case 'h': usage(stdout); return 0;
        default: /* getopt named it; a typo of a long option gets a suggestion, not the whole help */
            if (optind > 1 && !strncmp(argv[optind - 1], "--", 2) && shoal_suggest_flag(argv[optind - 1], usage))
                fprintf(stderr, "shoal expert: did you mean %s?\n", shoal_suggest_flag(argv[optind - 1], usage));
            else
                usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "shoal expert: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    char err[4096] = "";
    if (print_fp) {
        if (!o.model) {
            fprintf(stderr, "shoal expert: --print-fingerprint needs --model\n");
            return 2;
        }
        server s = {0};
        uint8_t fp[SHOAL_PROTO_FP_BYTES];
        int rc = load_model(&s, o.model, 0, o.verify, fp, err, sizeof err);
        server_free(&s);
        if (rc) {
            fprintf(stderr, "shoal expert: %s\n", err);
            return shoal_err_exit_code(rc);
        }
        char hex[65];
        shoal_proto_hex(fp, hex);
        printf("%s\n", hex);
        return 0;
    }
    shoal_planfile pf = {0};
    char *relay_list = NULL; /* --relay-peers built from the plan (freed at exit) */
    if (plan || name) {
        const shoal_planfile_worker *pw;
        if (!plan || !name || o.experts) {
            fprintf(stderr, "shoal expert: --plan needs --name (and replaces --experts)\n");
            return 2;
        }
        if (shoal_planfile_read(&pf, plan, err, sizeof err)) {
            fprintf(stderr, "shoal expert: %s\n", err);
            return 3;
        }
        if (!(pw = shoal_planfile_find(&pf, name)) || (!o.listen && !pw->listen)) {
            fprintf(stderr, "shoal expert: plan %s has %s \"%s\"\n", plan,
                    pw ? "no listen endpoint (give --listen) for worker" : "no worker", name);
            shoal_planfile_free(&pf);
            return 3;
        }
        o.experts = pw->experts;
        if (!o.trunk)
            o.trunk = pw->trunk; /* the plan's trunk rows (`shoal plan --trunk spread`) unless --trunk */
        if (!o.listen)
            o.listen = pw->listen;
        if (!o.id)
            o.id = pw->name;
        if (pf.has_fingerprint)
            o.plan_fingerprint = pf.fingerprint;
        if (pf.relay_fanout && o.trunk && !o.relay_peers) {
            /* the plan's relay tree (PROTOCOL.md §3.9): every worker with trunk rows, in plan order, at the
             * endpoint the coordinator uses (so the indexes agree); CURVE keys from --relay-keys DIR/NAME.pub */
            size_t cap = 1;
            for (int w = 0; w < pf.nworkers; w++)
                if (pf.workers[w].trunk && pf.workers[w].endpoint)
                    cap += strlen(pf.workers[w].endpoint) + (relay_keys ? strlen(relay_keys) : 0) +
                           strlen(pf.workers[w].name) + 8;
            relay_list = shoal_xcalloc(cap, 1);
            for (int w = 0; w < pf.nworkers; w++) {
                const shoal_planfile_worker *q = &pf.workers[w];
                if (!q->trunk || !q->endpoint)
                    continue;
                if (o.curve_secret && shoal_curve_needed(q->endpoint) && !relay_keys) {
                    fprintf(stderr, "shoal expert: the plan relays trunk inputs (relay_fanout) over CURVE links: "
                                    "give --relay-keys DIR holding each worker's NAME.pub\n");
                    shoal_planfile_free(&pf);
                    free(relay_list);
                    return 2;
                }
                size_t at = strlen(relay_list);
                snprintf(relay_list + at, cap - at, "%s%s%s%s%s%s", at ? "," : "", q->endpoint,
                         relay_keys && shoal_curve_needed(q->endpoint) ? "@" : "",
                         relay_keys && shoal_curve_needed(q->endpoint) ? relay_keys : "",
                         relay_keys && shoal_curve_needed(q->endpoint) ? "/" : "",
                         relay_keys && shoal_curve_needed(q->endpoint) ? q->name : "");
                if (relay_keys && shoal_curve_needed(q->endpoint))
                    strcat(relay_list, ".pub");
                if (!strcmp(q->name, pw->name))
                    o.relay_self = q->endpoint;
            }
            o.relay_peers = relay_list;
        }
    }
    if (!o.model || (!o.experts && !o.trunk) || !o.listen) {
        shoal_planfile_free(&pf);
        usage(stderr);
        return 2;
    }
    if (shoal_curve_needed(o.listen) && !o.curve_secret && !insecure) {
        fprintf(stderr, "shoal expert: %s is not ipc://: give --curve-secret FILE and --curve-allow FILE "
                        "(docs/DEPLOY.md, Keys), or --insecure for plain TCP\n", o.listen);
        shoal_planfile_free(&pf);
        return 2;
    }
    if (o.curve_secret && insecure) {
        fprintf(stderr, "shoal expert: --insecure and --curve-secret are exclusive\n");
        shoal_planfile_free(&pf);
        return 2;
    }
    char role[16] = "W";
    if (o.id && o.id[0] == 'w' && o.id[1] && strspn(o.id + 1, "0123456789") == strlen(o.id + 1))
        snprintf(role, sizeof role, "W%.12s", o.id + 1);
    shoal_log_set_role(role);
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    int rc = shoal_expert_server_run(&o, err, sizeof err);
    shoal_planfile_free(&pf);
    free(relay_list);
    if (rc) {
        SHOAL_ERROR("%s", err);
        return shoal_err_exit_code(rc);
    }
    return 0;
}
