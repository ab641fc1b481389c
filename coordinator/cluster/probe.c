/* PROBE measurements over the expert client's links (see probe.h). */
#include "coordinator/cluster/probe.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"
#include "coordinator/cluster/expert_client_int.h"

static uint32_t round4(size_t n)
{
    if (n < 4)
        n = 4;
    if (n > SHOAL_PROTO_MAX_PROBE)
        n = SHOAL_PROTO_MAX_PROBE;
    return (uint32_t)((n + 3) / 4 * 4);
}

static int send_probe(shoal__ec_worker *w, uint64_t rid, uint32_t reply, int facts, uint8_t *x, size_t xlen)
{
    uint8_t ctl[64];
    size_t len;
    if (shoal_proto_enc_probe(ctl, sizeof ctl, &len, rid, reply, facts))
        return SHOAL_EINTERNAL;
    if (zmq_send(w->sock, ctl, len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 || zmq_send(w->sock, x, xlen, ZMQ_DONTWAIT) < 0)
        return -errno;
    return 0;
}

/* Wait (up to the deadline) for one reply on w; its rid into *rid, facts
 * into f when it has them. */
static int recv_reply(shoal__ec_worker *w, uint64_t deadline_us, uint64_t *rid, shoal_proto_facts *f, char *err,
                      size_t errlen)
{
    for (;;) {
        zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
        int trunc = 0, np = shoal__ec_recv_parts(w->sock, parts, &trunc);
        if (np > 0) {
            shoal_frame fr[SHOAL_PROTO_MAX_FRAMES];
            for (int i = 0; i < np; i++)
                fr[i] = (shoal_frame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
            shoal_proto_msg m;
            memset(&m, 0, sizeof m);
            int perr = 0, rc = 0;
            char why[512];
            if (trunc || shoal_proto_decode(fr, np, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why)) {
                rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "worker %s: malformed PROBE reply: %s", w->name,
                                   trunc ? "too many frames" : why);
            } else if (m.type == SHOAL_MSG_ERROR) {
                char e2[401];
                rc = shoal_err_set(err, errlen, shoal_perr_to_err((int)m.error.code),
                                   "worker %s refused PROBE: %s: %s%s", w->name, shoal_perr_name((int)m.error.code),
                                   shoal_utf8_clip(e2, sizeof e2, m.error.message, SHOAL_UTF8_NOCTRL),
                                   m.error.code == SHOAL_PERR_UNKNOWN_TYPE ? " (a worker older than protocol 1.5)"
                                                                           : "");
            } else if (m.type != SHOAL_MSG_PROBE_REPLY) {
                /* a late reply to something else (a HELLO probe): not ours */
                shoal_proto_msg_clear(&m);
                shoal__ec_close_parts(parts, np);
                continue;
            } else {
                *rid = m.rid;
                if (m.preply.facts.has && f)
                    *f = m.preply.facts;
            }
            shoal_proto_msg_clear(&m);
            shoal__ec_close_parts(parts, np);
            return rc;
        }
        uint64_t now = shoal__ec_now_us();
        if (now >= deadline_us)
            return shoal_err_set(err, errlen, SHOAL_ETIMEOUT, "worker %s: no PROBE reply before the deadline",
                                 w->name);
        zmq_pollitem_t pi = {.socket = w->sock, .events = ZMQ_POLLIN};
        long ms = (long)((deadline_us - now) / 1000) + 1;
        zmq_poll(&pi, 1, ms > 1000 ? 1000 : ms);
    }
}

int shoal_probe_run(shoal_expert_client *c, int wi, const shoal_probe_opts *o, shoal_probe_result *r, char *err,
                    size_t errlen)
{
    if (wi < 0 || wi >= c->nw || o->count < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "probe: worker %d, count %d", wi, o->count);
    shoal__ec_worker *w = &c->w[wi];
    uint32_t out = round4(o->out_bytes), in = round4(o->in_bytes);
    size_t xlen = SHOAL_PROTO_TENSOR_HDR + out;
    uint8_t *x = shoal_xcalloc(1, xlen);
    shoal_proto_tensor_hdr(x, SHOAL_WIRE_F32, 1, out / 4);
    int window = o->window < 1 ? 1 : o->window > 8 ? 8 : o->window; /* the worker takes 16 ahead (§1) */
    uint64_t *sent_ns = shoal_xcalloc((size_t)o->count, sizeof *sent_ns);
    uint64_t deadline = shoal__ec_now_us() + (uint64_t)(o->timeout_ms > 0 ? o->timeout_ms : 30000) * 1000u;
    int rc = 0;
    pthread_mutex_lock(&c->smu);
    if (atomic_load(&w->link) != W_UP) {
        rc = shoal_err_set(err, errlen, SHOAL_EPEER, "worker %s is down: %s", w->name, w->why);
        goto out;
    }
    { /* whatever is waiting is stale (a keeper round's late reply) */
        zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
        int trunc, np;
        while ((np = shoal__ec_recv_parts(w->sock, parts, &trunc)) > 0)
            shoal__ec_close_parts(parts, np);
    }
    if (o->facts) {
        uint64_t rid = c->next_rid++, got = 0;
        if ((rc = send_probe(w, rid, 4, 1, x, SHOAL_PROTO_TENSOR_HDR + 4))) {
            rc = shoal_err_set(err, errlen, rc, "worker %s: cannot send PROBE", w->name);
            goto out;
        }
        do
            rc = recv_reply(w, deadline, &got, &r->facts, err, errlen);
        while (!rc && got != rid);
        if (rc)
            goto out;
    }
    uint64_t rid0 = c->next_rid;
    c->next_rid += (uint64_t)o->count;
    int nsent = 0, ndone = 0;
    uint64_t t0 = shoal__ec_now_ns();
    while (ndone < o->count) {
        while (nsent < o->count && nsent - ndone < window) {
            sent_ns[nsent] = shoal__ec_now_ns();
            if ((rc = send_probe(w, rid0 + (uint64_t)nsent, in, 0, x, xlen))) {
                rc = shoal_err_set(err, errlen, rc, "worker %s: cannot send PROBE", w->name);
                goto out;
            }
            nsent++;
        }
        uint64_t got = 0;
        if ((rc = recv_reply(w, deadline, &got, NULL, err, errlen)))
            goto out;
        if (got < rid0 || got >= rid0 + (uint64_t)nsent)
            continue; /* a stale one */
        if (r->rtt_us)
            r->rtt_us[got - rid0] = (double)(shoal__ec_now_ns() - sent_ns[got - rid0]) / 1e3;
        ndone++;
    }
    r->total_s = (double)(shoal__ec_now_ns() - t0) / 1e9;
out:
    pthread_mutex_unlock(&c->smu);
    free(x);
    free(sent_ns);
    return rc;
}

int shoal_probe_facts_together(shoal_expert_client *c, shoal_proto_facts *f, int *ok, int timeout_ms, char *err,
                               size_t errlen)
{
    uint8_t x[SHOAL_PROTO_TENSOR_HDR + 4] = {0};
    shoal_proto_tensor_hdr(x, SHOAL_WIRE_F32, 1, 1);
    uint64_t deadline = shoal__ec_now_us() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 60000) * 1000u;
    uint64_t *rid = shoal_xcalloc((size_t)c->nw + 1, sizeof *rid);
    int rc = 0;
    char e2[512];
    pthread_mutex_lock(&c->smu);
    for (int i = 0; i < c->nw; i++) { /* every request out first: the workers measure at the same time */
        ok[i] = 0;
        memset(&f[i], 0, sizeof f[i]);
        shoal__ec_worker *w = &c->w[i];
        if (atomic_load(&w->link) != W_UP)
            continue;
        zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
        int trunc, np;
        while ((np = shoal__ec_recv_parts(w->sock, parts, &trunc)) > 0)
            shoal__ec_close_parts(parts, np);
        rid[i] = c->next_rid++;
        if (send_probe(w, rid[i], 4, 1, x, sizeof x))
            rid[i] = 0;
    }
    for (int i = 0; i < c->nw; i++) {
        if (!rid[i])
            continue;
        uint64_t got = 0;
        int r;
        do
            r = recv_reply(&c->w[i], deadline, &got, &f[i], e2, sizeof e2);
        while (!r && got != rid[i]);
        if (r && !rc)
            rc = shoal_err_set(err, errlen, r, "%s", e2);
        ok[i] = !r && f[i].has;
    }
    pthread_mutex_unlock(&c->smu);
    free(rid);
    return rc;
}
