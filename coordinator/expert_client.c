/* The distributed routed-expert backend (see expert_client.h).
 *
 * State machine of the one outstanding request (guarded by mu):
 *   IDLE --submit()--> SUBMITTED --I/O thread sends--> INFLIGHT
 *   INFLIGHT --all replies / a failure / the deadline--> DONE --gather()--> IDLE
 * Request buffers (per worker: control, act and route frames, destinations)
 * are written by the caller's thread only in IDLE and read by the I/O thread in
 * SUBMITTED; replies are written by the I/O thread in INFLIGHT and read by the
 * caller in DONE. The I/O thread releases the previous replies when the next
 * request arrives. */
#include "coordinator/expert_client.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/log.h"
#include "common/st.h"
#include "coordinator/cmetrics.h"
#include "coordinator/owners.h"
#include "proto/shard.h"

enum { IDLE, SUBMITTED, INFLIGHT, DONE };

typedef struct {
    char endpoint[256];
    char name[SHOAL_PROTO_MAX_ID + 300]; /* "id (endpoint)" */
    void *sock, *mon;
    shoal_proto_range *owned;
    size_t nowned;
    uint32_t max_tokens;
    char id[SHOAL_PROTO_MAX_ID + 1];
    uint64_t expert_bytes, mem_total;
    /* request (caller thread in IDLE) */
    uint8_t ctl[64];
    size_t ctl_len;
    uint8_t *act;     /* [16 + max_tokens * d * 4] */
    uint8_t *route;   /* [16 + max_tokens * k * 8] */
    int32_t *dest;    /* [max_tokens * k]: destination row t*k + slot of pair i */
    uint32_t ntok, npairs, nexperts;
    int last_t;
    uint64_t rid;
    int involved;
    /* reply (I/O thread in INFLIGHT) */
    zmq_msg_t rmsg;
    int have_rmsg, answered;
    uint64_t queue_us, compute_us;
    uint64_t sent_ns, bytes_out, rtt_ns; /* this request */
} worker;

struct shoal_expert_client {
    shoal_expert_client_opts o;
    const shoal_k3cfg *cfg;
    int nw, d, k, E, L;
    worker *w;
    shoal_owners *owners; /* who owns each (layer, expert); replicas allowed */
    int32_t *pick;        /* [E]: this exchange's chosen owner per expert (caller thread) */
    void *zctx;
    int efd;
    pthread_t io;
    int io_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state, quit, wake;
    int layer;
    int rc;
    char err[1024];
    uint64_t deadline_us;
    uint64_t next_rid;
    shoal_expert_client_stats st;
    uint32_t *seen; /* [E]: request tag that last counted expert e (distinct experts per request) */
    uint32_t tag;
    shoal_cmetrics *cm; /* optional, borrowed */
    int last_answer;    /* worker whose reply completed the request */
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* ---- open: connect, HELLO, ownership -------------------------------------- */

static int send_hello(shoal_expert_client *c, worker *w, char *err, size_t errlen)
{
    shoal_proto_hello h = {.major = SHOAL_PROTO_MAJOR, .minor = SHOAL_PROTO_MINOR};
    memcpy(h.fingerprint, c->o.fingerprint, SHOAL_PROTO_FP_BYTES);
    if (c->o.peer)
        snprintf(h.id, sizeof h.id, "%s", c->o.peer);
    else
        snprintf(h.id, sizeof h.id, "coordinator %d", (int)getpid());
    uint8_t buf[256];
    size_t len;
    if (shoal_proto_enc_hello(buf, sizeof buf, &len, 1, &h, 0))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "HELLO does not encode (peer name too long?)");
    if (zmq_send(w->sock, buf, len, ZMQ_DONTWAIT) < 0)
        return -errno;
    return 0;
}

/* Handle a HELLO reply from w: checks and records ownership. */
static int take_hello(shoal_expert_client *c, worker *w, const shoal_frame *f, int nf, char *err, size_t errlen)
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
        rc = shoal_err_set(err, errlen, shoal_perr_to_err((int)m.error.code),
                           "expert worker %s refused HELLO: %s: %s", w->endpoint, shoal_perr_name((int)m.error.code),
                           m.error.message);
        goto out;
    }
    if (m.type != SHOAL_MSG_HELLO || m.rid != 1) {
        rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "expert worker %s answered HELLO with %s (rid %llu)", w->endpoint,
                           shoal_msg_type_name(m.type), (unsigned long long)m.rid);
        goto out;
    }
    const shoal_proto_hello *h = &m.hello;
    snprintf(w->name, sizeof w->name, "%s (%s)", h->id, w->endpoint);
    if (h->major != SHOAL_PROTO_MAJOR) {
        rc = shoal_err_set(err, errlen, SHOAL_EVERSION,
                           "expert worker %s: protocol major version mismatch: coordinator %d.%d, worker %u.%u", w->name,
                           SHOAL_PROTO_MAJOR, SHOAL_PROTO_MINOR, h->major, h->minor);
        goto out;
    }
    if (memcmp(h->fingerprint, c->o.fingerprint, SHOAL_PROTO_FP_BYTES)) {
        char a[65], b[65];
        shoal_proto_hex(c->o.fingerprint, a);
        shoal_proto_hex(h->fingerprint, b);
        rc = shoal_err_set(err, errlen, SHOAL_EFINGERPRINT,
                           "expert worker %s: model fingerprint mismatch: coordinator %s, worker %s", w->name, a, b);
        goto out;
    }
    if ((rc = shoal_shard_check(h->owned, h->nowned, c->L, c->cfg->is_moe, c->E, why, sizeof why))) {
        rc = shoal_err_set(err, errlen, rc, "expert worker %s: %s", w->name, why);
        goto out;
    }
    int want_act = c->o.act_bf16 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32;
    if (!(h->act_mask & SHOAL_WIRE_MASK(want_act)) || !(h->out_mask & SHOAL_WIRE_MASK(SHOAL_WIRE_BF16))) {
        rc = shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "expert worker %s does not offer %s activations and bf16 "
                           "outputs", w->name, shoal_wire_dtype_name(want_act));
        goto out;
    }
    if (h->max_tokens < (uint32_t)c->o.max_tokens) {
        rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "expert worker %s accepts %u tokens per request, the coordinator "
                           "needs %d (start it with --max-tokens %d)", w->name, h->max_tokens, c->o.max_tokens,
                           c->o.max_tokens);
        goto out;
    }
    w->max_tokens = h->max_tokens;
    snprintf(w->id, sizeof w->id, "%s", h->id);
    w->expert_bytes = h->expert_bytes;
    w->mem_total = h->mem_total;
    w->owned = h->owned;
    w->nowned = h->nowned;
    m.hello.owned = NULL; /* taken */
    SHOAL_INFO("expert worker %s: %zu range%s, isa %s, %u threads, %.1f MiB of experts", w->name, w->nowned,
               w->nowned == 1 ? "" : "s", h->isa, h->threads, (double)h->expert_bytes / 1048576.0);
    rc = 0;
out:
    shoal_proto_msg_clear(&m);
    return rc;
}

/* Read the events waiting on a monitor socket; 1 if one was a disconnect. */
static int monitor_disconnected(void *mon)
{
    int disc = 0;
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return disc;
        }
        uint16_t id = 0;
        if (zmq_msg_size(&ev) >= 2)
            memcpy(&id, zmq_msg_data(&ev), 2);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        while (more) { /* the endpoint frame */
            zmq_msg_t addr;
            zmq_msg_init(&addr);
            if (zmq_msg_recv(&addr, mon, 0) < 0) {
                zmq_msg_close(&addr);
                break;
            }
            more = zmq_msg_more(&addr);
            zmq_msg_close(&addr);
        }
        disc |= (id & ZMQ_EVENT_DISCONNECTED) != 0;
    }
}

/* Connect every worker, send HELLO as soon as its connection is up, collect
 * every reply before the deadline. */
static int hello_all(shoal_expert_client *c, char *err, size_t errlen)
{
    int hello_ms = c->o.hello_timeout_ms > 0 ? c->o.hello_timeout_ms : 60000;
    uint64_t deadline = now_us() + (uint64_t)hello_ms * 1000u;
    int *sent = shoal_xcalloc((size_t)c->nw, sizeof *sent), *got = shoal_xcalloc((size_t)c->nw, sizeof *got);
    zmq_pollitem_t *pi = shoal_xcalloc(2 * (size_t)c->nw, sizeof *pi);
    int ngot = 0, rc = 0;
    uint64_t next_check = now_us();
    while (ngot < c->nw) {
        uint64_t now = now_us();
        if (now >= deadline) {
            size_t at = 0;
            at += (size_t)snprintf(err, errlen, "no HELLO within %d ms from expert worker%s:", hello_ms,
                                   c->nw - ngot > 1 ? "s" : "");
            for (int i = 0; i < c->nw && at < errlen; i++)
                if (!got[i])
                    at += (size_t)snprintf(err + at, errlen - at, " %s (%s)", c->w[i].endpoint,
                                           sent[i] ? "connected, no answer" : "not connected");
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
                int s = send_hello(c, &c->w[i], err, errlen);
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
            if ((pi[c->nw + i].revents & ZMQ_POLLIN) && monitor_disconnected(c->w[i].mon) && sent[i] && !got[i]) {
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

/* ---- the I/O thread --------------------------------------------------------- */

/* Called with mu held. */
static void finish(shoal_expert_client *c, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void finish(shoal_expert_client *c, int rc, const char *fmt, ...)
{
    if (c->state != INFLIGHT && c->state != SUBMITTED)
        return;
    c->rc = rc;
    if (rc) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, sizeof c->err, fmt, ap);
        va_end(ap);
        c->st.failures++;
    }
    c->state = DONE;
    c->wake = 1; /* signalled by io_unlock, after the mutex is released */
}

/* Unlock mu and wake gather() if a request finished: signalling after the
 * unlock spares the woken thread from blocking again on the mutex. */
static void io_unlock(shoal_expert_client *c)
{
    int wake = c->wake;
    c->wake = 0;
    pthread_mutex_unlock(&c->mu);
    if (wake)
        pthread_cond_signal(&c->cv);
}

static void release_replies(shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++)
        if (c->w[i].have_rmsg) {
            zmq_msg_close(&c->w[i].rmsg);
            c->w[i].have_rmsg = 0;
        }
}

/* Send the submitted request to every involved worker (mu held). */
static void send_all(shoal_expert_client *c)
{
    release_replies(c);
    c->st.requests++;
    for (int i = 0; i < c->nw; i++) {
        worker *w = &c->w[i];
        w->answered = 0;
        if (!w->involved)
            continue;
        size_t alen, rlen;
        shoal_proto_tensor_len(c->o.act_bf16 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32, w->ntok, (uint32_t)c->d, &alen);
        shoal_proto_tensor_len(SHOAL_WIRE_I32, w->npairs, 2, &rlen);
        if (zmq_send(w->sock, w->ctl, w->ctl_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(w->sock, w->act, alen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(w->sock, w->route, rlen, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            c->state = INFLIGHT;
            if (c->cm) {
                shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
                shoal_cmetrics_worker_up(c->cm, i, 0);
            }
            finish(c, SHOAL_EPEER, "expert worker %s: cannot send layer %d: %s", w->name, c->layer,
                   e == EAGAIN ? "not connected (the worker is down?)" : zmq_strerror(e));
            return;
        }
        c->st.messages++;
        c->st.pairs += w->npairs;
        c->st.bytes_out += w->ctl_len + alen + rlen;
        w->bytes_out = w->ctl_len + alen + rlen;
        w->sent_ns = now_ns();
    }
    c->state = INFLIGHT;
}

/* One reply from worker i (mu held). Takes ownership of parts. */
static void on_reply(shoal_expert_client *c, int i, zmq_msg_t *parts, int np, int truncated)
{
    worker *w = &c->w[i];
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    size_t bytes = 0;
    for (int j = 0; j < np; j++) {
        f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
        bytes += f[j].len;
    }
    c->st.bytes_in += bytes;
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr;
    char why[512];
    int drc = truncated ? SHOAL_EPROTO : shoal_proto_decode(f, np, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why);
    if (truncated)
        snprintf(why, sizeof why, "more frames than the protocol allows");
    int current = c->state == INFLIGHT && w->involved && !w->answered && m.rid == w->rid;
    int bad = drc || m.type != SHOAL_MSG_EXPERT_RESULT || m.result.y.dtype != SHOAL_WIRE_BF16 ||
              m.result.y.rows != w->npairs || m.result.y.cols != (uint32_t)c->d;
    if (c->cm && !current)
        shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_STALE);
    if (c->cm && current && bad) {
        shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
        shoal_cmetrics_worker_up(c->cm, i, 0);
    }
    if (!current) {
        c->st.late_replies++; /* a reply to a request that already failed (or junk) */
    } else if (drc) {
        finish(c, SHOAL_EPROTO, "expert worker %s: malformed reply to layer %d: %s", w->name, c->layer, why);
    } else if (m.type == SHOAL_MSG_ERROR) {
        finish(c, shoal_perr_to_err((int)m.error.code), "expert worker %s refused layer %d: %s: %s", w->name,
               c->layer, shoal_perr_name((int)m.error.code), m.error.message);
    } else if (m.type != SHOAL_MSG_EXPERT_RESULT) {
        finish(c, SHOAL_EPROTO, "expert worker %s answered layer %d with %s", w->name, c->layer,
               shoal_msg_type_name(m.type));
    } else if (bad) {
        finish(c, SHOAL_EPROTO, "expert worker %s: layer %d reply is %s [%u, %u], expected bf16 [%u, %d]", w->name,
               c->layer, shoal_wire_dtype_name(m.result.y.dtype), m.result.y.rows, m.result.y.cols, w->npairs, c->d);
    } else {
        w->queue_us = m.result.queue_us;
        w->compute_us = m.result.compute_us;
        c->st.worker_queue_us += m.result.queue_us;
        c->st.worker_compute_us += m.result.compute_us;
        if (c->cm) {
            shoal_cmetrics_xchg x = {.tokens = w->ntok, .pairs = w->npairs, .experts = w->nexperts,
                                     .bytes_out = w->bytes_out, .bytes_in = bytes, .rtt_ns = now_ns() - w->sent_ns,
                                     .queue_us = m.result.queue_us, .compute_us = m.result.compute_us};
            shoal_cmetrics_exchange(c->cm, i, c->layer, &x);
        }
        c->last_answer = i;
        w->rtt_ns = now_ns() - w->sent_ns;
        zmq_msg_init(&w->rmsg);
        zmq_msg_move(&w->rmsg, &parts[1]); /* keep the y frame until the next request */
        w->have_rmsg = 1;
        w->answered = 1;
        int all = 1;
        for (int j = 0; j < c->nw; j++)
            all &= !c->w[j].involved || c->w[j].answered;
        if (all)
            finish(c, 0, "ok");
    }
    shoal_proto_msg_clear(&m);
    for (int j = 0; j < np; j++)
        zmq_msg_close(&parts[j]);
}

static void drain_socket(shoal_expert_client *c, int i)
{
    for (;;) {
        zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
        int np = 0, truncated = 0, more = 1;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->w[i].sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (np < SHOAL_PROTO_MAX_FRAMES)
                parts[np++] = m;
            else {
                truncated = 1;
                zmq_msg_close(&m);
            }
        }
        if (!np)
            return;
        pthread_mutex_lock(&c->mu);
        on_reply(c, i, parts, np, truncated);
        io_unlock(c);
    }
}

static void drain_monitor(shoal_expert_client *c, int i)
{
    if (!monitor_disconnected(c->w[i].mon))
        return;
    worker *w = &c->w[i];
    pthread_mutex_lock(&c->mu);
    if (c->state == INFLIGHT && w->involved && !w->answered) {
        if (c->cm) {
            shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
            shoal_cmetrics_worker_up(c->cm, i, 0);
        }
        finish(c, SHOAL_EPEER, "expert worker %s disconnected before answering layer %d (the worker died?)", w->name,
               c->layer);
    }
    io_unlock(c);
    SHOAL_WARN("expert worker %s disconnected", w->name);
}

static void *io_main(void *arg)
{
    shoal_expert_client *c = arg;
    int n = 1 + 2 * c->nw;
    zmq_pollitem_t *pi = shoal_xcalloc((size_t)n, sizeof *pi);
    pi[0] = (zmq_pollitem_t){.fd = c->efd, .events = ZMQ_POLLIN};
    for (int i = 0; i < c->nw; i++) {
        pi[1 + i] = (zmq_pollitem_t){.socket = c->w[i].sock, .events = ZMQ_POLLIN};
        pi[1 + c->nw + i] = (zmq_pollitem_t){.socket = c->w[i].mon, .events = ZMQ_POLLIN};
    }
    for (;;) {
        pthread_mutex_lock(&c->mu);
        long timeout = -1;
        if (c->state == INFLIGHT) {
            uint64_t now = now_us();
            if (now >= c->deadline_us) {
                size_t at = 0;
                char names[768] = "";
                for (int i = 0; i < c->nw && at < sizeof names; i++)
                    if (c->w[i].involved && !c->w[i].answered) {
                        at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? ", " : "", c->w[i].name);
                        if (c->cm) {
                            shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_TIMEOUT);
                            shoal_cmetrics_worker_up(c->cm, i, 0);
                        }
                    }
                finish(c, SHOAL_ETIMEOUT, "no reply to layer %d within %d ms from expert worker %s", c->layer,
                       c->o.timeout_ms, names);
            } else {
                timeout = (long)((c->deadline_us - now + 999) / 1000);
            }
        }
        int quit = c->quit;
        io_unlock(c);
        if (quit)
            break;
        if (zmq_poll(pi, n, timeout) < 0) {
            if (errno == EINTR)
                continue;
            SHOAL_ERROR("expert client: zmq_poll failed: %s", zmq_strerror(errno));
            usleep(1000);
            continue;
        }
        if (pi[0].revents & ZMQ_POLLIN) {
            uint64_t v;
            if (read(c->efd, &v, sizeof v) < 0 && errno != EAGAIN)
                SHOAL_WARN("expert client: eventfd read: %s", strerror(errno));
            pthread_mutex_lock(&c->mu);
            if (c->state == SUBMITTED)
                send_all(c);
            io_unlock(c);
        }
        for (int i = 0; i < c->nw; i++) {
            if (pi[1 + i].revents & ZMQ_POLLIN)
                drain_socket(c, i);
            if (pi[1 + c->nw + i].revents & ZMQ_POLLIN)
                drain_monitor(c, i);
        }
    }
    free(pi);
    return NULL;
}

/* ---- the backend ------------------------------------------------------------ */

static int submit(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    pthread_mutex_lock(&c->mu);
    int state = c->state;
    pthread_mutex_unlock(&c->mu);
    if (state != IDLE)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: submit while a request is outstanding");
    if (layer < 0 || layer >= c->L || !c->cfg->is_moe[layer])
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: layer %d is not an MoE layer", layer);
    if (T < 1 || T > c->o.max_tokens || k != c->k)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: T = %d (max %d), k = %d (model %d)", T,
                             c->o.max_tokens, k, c->k);
    int d = c->d, bf16 = c->o.act_bf16;
    size_t row = (size_t)d * (bf16 ? 2 : 4);
    if (++c->tag == 0) { /* wrapped: forget old stamps */
        memset(c->seen, 0, sizeof *c->seen * (size_t)c->E);
        c->tag = 1;
    }
    for (int i = 0; i < c->nw; i++) {
        c->w[i].ntok = c->w[i].npairs = c->w[i].nexperts = 0;
        c->w[i].last_t = -1;
        c->w[i].involved = 0;
    }
    shoal_owners_pick(c->owners, layer, T, k, ids, c->pick); /* one owner per expert, balanced */
    const int32_t *own = c->pick;
    for (int t = 0; t < T; t++) {
        const float *zt = z + (size_t)t * d;
        for (int s = 0; s < k; s++) {
            int32_t e = ids[(size_t)t * k + s];
            if (e < 0 || e >= c->E || (s && e <= ids[(size_t)t * k + s - 1]))
                return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: token %d slot %d: expert id %d out "
                                     "of range or not ascending", t, s, (int)e);
            worker *w = &c->w[own[e]];
            if (w->last_t != t) { /* first pair of this token for w: append its activation row */
                w->last_t = t;
                uint8_t *dst = w->act + SHOAL_PROTO_TENSOR_HDR + (size_t)w->ntok * row;
                if (bf16) {
                    for (int j = 0; j < d; j++) {
                        uint16_t b = shoal_f32_to_bf16(zt[j]);
                        dst[2 * j] = (uint8_t)b;
                        dst[2 * j + 1] = (uint8_t)(b >> 8);
                    }
                } else {
                    memcpy(dst, zt, row);
                }
                w->ntok++;
            }
            int32_t pair[2] = {(int32_t)w->ntok - 1, e};
            memcpy(w->route + SHOAL_PROTO_TENSOR_HDR + (size_t)w->npairs * 8, pair, 8);
            w->dest[w->npairs++] = t * k + s;
            w->involved = 1;
            if (c->seen[e] != c->tag) {
                c->seen[e] = c->tag;
                w->nexperts++;
            }
        }
    }
    for (int i = 0; i < c->nw; i++) {
        worker *w = &c->w[i];
        if (!w->involved)
            continue;
        w->rid = ++c->next_rid;
        shoal_proto_tensor_hdr(w->act, bf16 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32, w->ntok, (uint32_t)d);
        shoal_proto_tensor_hdr(w->route, SHOAL_WIRE_I32, w->npairs, 2);
        if (shoal_proto_enc_batch(w->ctl, sizeof w->ctl, &w->ctl_len, w->rid, (uint32_t)layer, SHOAL_WIRE_BF16))
            SHOAL_PANIC("EXPERT_BATCH control does not fit");
    }
    pthread_mutex_lock(&c->mu);
    c->layer = layer;
    c->rc = 0;
    c->err[0] = 0;
    c->deadline_us = now_us() + (uint64_t)c->o.timeout_ms * 1000u;
    c->state = SUBMITTED;
    pthread_mutex_unlock(&c->mu);
    uint64_t one = 1;
    if (write(c->efd, &one, sizeof one) != sizeof one)
        SHOAL_PANIC("expert client: eventfd write failed");
    return 0;
}

static int gather(void *self, uint16_t *y, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    uint64_t t0 = now_us();
    pthread_mutex_lock(&c->mu);
    if (c->state == IDLE) {
        pthread_mutex_unlock(&c->mu);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: gather without submit");
    }
    /* the I/O thread enforces the deadline; this wait only guards against it being stuck */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t lim_ms = (uint64_t)c->o.timeout_ms + 5000;
    ts.tv_sec += (time_t)(lim_ms / 1000);
    ts.tv_nsec += (long)(lim_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    while (c->state != DONE) {
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT && c->state != DONE) {
            c->state = DONE; /* abandon: late replies will be dropped by rid */
            c->rc = SHOAL_ETIMEOUT;
            snprintf(c->err, sizeof c->err, "expert client: layer %d: the I/O thread did not finish in %llu ms",
                     c->layer, (unsigned long long)lim_ms);
        }
    }
    int rc = c->rc;
    if (c->cm)
        shoal_cmetrics_layer_wait(c->cm, c->layer, (now_us() - t0) * 1000u, rc ? -1 : c->last_answer);
    if (rc) {
        shoal_err_set(err, errlen, rc, "%s", c->err);
    } else {
        size_t row = (size_t)c->d * 2;
        for (int i = 0; i < c->nw; i++) {
            const worker *w = &c->w[i];
            if (!w->involved)
                continue;
            const uint8_t *src = (const uint8_t *)zmq_msg_data((zmq_msg_t *)&w->rmsg) + SHOAL_PROTO_TENSOR_HDR;
            for (uint32_t p = 0; p < w->npairs; p++)
                memcpy(y + (size_t)w->dest[p] * c->d, src + (size_t)p * row, row);
        }
    }
    c->state = IDLE;
    c->st.wait_s += (double)(now_us() - t0) * 1e-6;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void vt_close(void *self)
{
    shoal_expert_client_close(self);
}

static const shoal_experts_vt client_vt = {.submit = submit, .gather = gather, .close = vt_close};

shoal_experts shoal_expert_client_backend(shoal_expert_client *c)
{
    return (shoal_experts){.vt = &client_vt, .self = c};
}

void shoal_expert_client_close(shoal_expert_client *c)
{
    if (!c)
        return;
    if (c->io_started) {
        pthread_mutex_lock(&c->mu);
        c->quit = 1;
        pthread_mutex_unlock(&c->mu);
        uint64_t one = 1;
        if (write(c->efd, &one, sizeof one) < 0)
            SHOAL_WARN("expert client: eventfd write: %s", strerror(errno));
        pthread_join(c->io, NULL);
    }
    release_replies(c);
    for (int i = 0; i < c->nw; i++) {
        worker *w = &c->w[i];
        if (w->mon)
            zmq_close(w->mon);
        if (w->sock) {
            zmq_socket_monitor(w->sock, NULL, 0);
            zmq_close(w->sock);
        }
        free(w->owned);
        free(w->act);
        free(w->route);
        free(w->dest);
    }
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    if (c->efd >= 0)
        close(c->efd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    shoal_owners_close(c->owners);
    free(c->pick);
    free(c->seen);
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
    shoal_expert_client *c = shoal_xcalloc(1, sizeof *c);
    c->o = *o;
    if (c->o.timeout_ms <= 0)
        c->o.timeout_ms = 30000;
    c->cfg = o->cfg;
    c->nw = o->nworkers;
    c->d = o->cfg->latent_size;
    c->k = o->cfg->experts_per_token;
    c->E = o->cfg->num_experts;
    c->L = o->cfg->num_layers;
    c->efd = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    c->w = shoal_xcalloc((size_t)c->nw, sizeof *c->w);
    c->seen = shoal_xcalloc((size_t)c->E, sizeof *c->seen);
    c->zctx = zmq_ctx_new();
    int rc = 0;
    size_t mt = (size_t)o->max_tokens;
    for (int i = 0; i < c->nw; i++) {
        worker *w = &c->w[i];
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
        snprintf(w->name, sizeof w->name, "%s", w->endpoint);
        w->act = shoal_xmalloc(SHOAL_PROTO_TENSOR_HDR + mt * (size_t)c->d * 4);
        w->route = shoal_xmalloc(SHOAL_PROTO_TENSOR_HDR + mt * (size_t)c->k * 8);
        w->dest = shoal_xmalloc(mt * (size_t)c->k * sizeof *w->dest);
        w->sock = zmq_socket(c->zctx, ZMQ_DEALER);
        int zero = 0, one = 1;
        zmq_setsockopt(w->sock, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(w->sock, ZMQ_IMMEDIATE, &one, sizeof one);
        /* a routing id of our own: a transient reconnection to the same worker
         * process keeps its HELLO state; a restarted worker has none (NO_HELLO) */
        uint8_t rid[16];
        if (getrandom(rid, sizeof rid, 0) != (ssize_t)sizeof rid) { /* never blocks once the pool is up */
            uint64_t x = now_ns() ^ (uint64_t)getpid() << 32 ^ (uint64_t)i;
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
    c->next_rid = 1; /* HELLO used 1; batches start at 2 */
    /* ownership: every expert of every MoE layer at least once (overlaps are
     * replicas: each exchange picks one owner, coordinator/owners.h) */
    c->pick = shoal_xcalloc((size_t)c->E, sizeof *c->pick);
    {
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
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) {
        rc = shoal_err_set(err, errlen, -errno, "eventfd: %s", strerror(errno));
        goto fail;
    }
    if (pthread_create(&c->io, NULL, io_main, c)) {
        rc = shoal_err_set(err, errlen, SHOAL_EINTERNAL, "cannot start the expert client's I/O thread");
        goto fail;
    }
    c->io_started = 1;
    *out = c;
    return 0;
fail:
    shoal_expert_client_close(c);
    return rc;
}

int shoal_expert_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm, char *err, size_t errlen)
{
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    for (int i = 0; i < c->nw && cm && !rc; i++) {
        uint64_t owned = shoal_owners_count(c->owners, i);
        rc = shoal_cmetrics_set_worker(cm, i, c->w[i].id, c->w[i].endpoint, owned, c->w[i].expert_bytes,
                                       c->w[i].mem_total);
        if (!rc)
            shoal_cmetrics_worker_up(cm, i, 1);
    }
    if (rc)
        shoal_err_set(err, errlen, rc, "expert client: the metrics do not take %d workers", c->nw);
    else
        c->cm = cm;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void shoal_expert_client_set_timeout(shoal_expert_client *c, int timeout_ms)
{
    pthread_mutex_lock(&c->mu);
    c->o.timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
    pthread_mutex_unlock(&c->mu);
}

void shoal_expert_client_get_stats(shoal_expert_client *c, shoal_expert_client_stats *out)
{
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
}

void shoal_expert_client_reset_stats(shoal_expert_client *c)
{
    pthread_mutex_lock(&c->mu);
    memset(&c->st, 0, sizeof c->st);
    pthread_mutex_unlock(&c->mu);
}

int shoal_expert_client_last(shoal_expert_client *c, int w, uint64_t *queue_us, uint64_t *compute_us,
                             uint64_t *rtt_ns)
{
    pthread_mutex_lock(&c->mu);
    int in = w >= 0 && w < c->nw && c->state == IDLE && c->rc == 0 && c->w[w].involved && c->w[w].answered;
    if (in) {
        *queue_us = c->w[w].queue_us;
        *compute_us = c->w[w].compute_us;
        *rtt_ns = c->w[w].rtt_ns;
    }
    pthread_mutex_unlock(&c->mu);
    return in;
}

int shoal_expert_client_nworkers(const shoal_expert_client *c)
{
    return c->nw;
}

const char *shoal_expert_client_worker_name(const shoal_expert_client *c, int i)
{
    return i >= 0 && i < c->nw ? c->w[i].name : "?";
}
