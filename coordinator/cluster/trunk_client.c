/* The remote trunk matmul backend (trunk_client.h): the per-call exchange on
 * the engine's forward thread, over the links of an expert client opened in
 * the trunk role (links.c; the shared struct in expert_client_int.h).
 *
 * No allocation on the forward thread: control frames are the workers' own
 * buffers, the input frame is the client's (packed once, the same bytes for
 * every worker), all sent as ZeroMQ constant messages; a buffer is rewritten
 * by the next submit() only, after every reply to the previous one arrived
 * (or it failed: a stale request may then go out with torn contents, which
 * the worker validates and answers under the old rid, dropped here). */
#include "coordinator/cluster/trunk_client.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "coordinator/cluster/expert_client_int.h"

/* Index of matrix name among the client's matrices (binary search), or -1. */
static int find_mat(const shoal_expert_client *c, const char *name)
{
    int lo = 0, hi = c->ntmats - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, k = c->tsorted[mid];
        int r = strcmp(name, c->tmats[k].name);
        if (!r)
            return k;
        if (r < 0)
            hi = mid - 1;
        else
            lo = mid + 1;
    }
    return -1;
}

static int has(void *self, const char *name, int rows, int cols)
{
    shoal_expert_client *c = self;
    int k = find_mat(c, name);
    return k >= 0 && c->tremote[k] && c->tmats[k].rows == rows && c->tmats[k].cols == cols;
}

/* Worker w holds all rows of matrix k in one announced range. */
static int holds_all(const shoal__ec_worker *w, const shoal_tshard_mat *mt)
{
    for (size_t i = 0; i < w->ntrunk; i++)
        if (!strcmp(w->trunk[i].name, mt->name) && w->trunk[i].lo == 0 && (int)w->trunk[i].hi == mt->rows - 1)
            return 1;
    return 0;
}

/* A chain pre -> name: both remote with these shapes, pre small enough, and
 * every worker that computes rows of name (the placement's pieces) speaks
 * 1.4 and holds all of pre (PROTOCOL.md §3.7). */
static int has_chain(void *self, const char *pre, int pre_rows, int pre_cols, const char *name, int rows, int cols)
{
    shoal_expert_client *c = self;
    if (!has(c, pre, pre_rows, pre_cols) || !has(c, name, rows, cols) || cols != pre_rows ||
        pre_rows > SHOAL_PROTO_MAX_CHAIN_ROWS)
        return 0;
    int ka = find_mat(c, pre), kb = find_mat(c, name);
    for (int p = c->pbeg[kb]; p < c->pbeg[kb] + c->pcnt[kb]; p++) {
        const shoal__ec_worker *w = &c->w[c->pieces[p].w];
        if (!w->chain || !holds_all(w, &c->tmats[ka]))
            return 0;
    }
    return 1;
}

static int submit(void *self, int layer, const shoal_rmat_job *jobs, int n, const float *x, int T, char *err,
                  size_t errlen)
{
    shoal_expert_client *c = self;
    if (n < 1 || n > SHOAL_RMAT_MAX_JOBS || T < 1 || T > c->o.max_tokens)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk submit: %d jobs, %d tokens", n, T);
    int cols = jobs[0].pre ? jobs[0].pre_cols : jobs[0].cols;
    for (int j = 0; j < n; j++) {
        const shoal_rmat_job *jb = &jobs[j];
        if ((jb->pre ? jb->pre_cols : jb->cols) != cols || !has(c, jb->name, jb->rows, jb->cols) ||
            (jb->pre && !has_chain(c, jb->pre, jb->pre_rows, jb->pre_cols, jb->name, jb->rows, jb->cols)))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk submit: %s%s%s is not a remote %s of width %d",
                                 jb->pre ? jb->pre : "", jb->pre ? " -> " : "", jb->name,
                                 jb->pre ? "chain" : "matrix", cols);
    }
    if ((size_t)SHOAL_PROTO_TENSOR_HDR + (size_t)T * (size_t)cols * 4 > c->tx_cap)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk submit: input larger than the buffer");
    pthread_mutex_lock(&c->smu);
    c->state = SENT;
    c->rc = 0;
    c->err[0] = 0;
    c->layer = layer;
    c->tjobs = jobs;
    c->ntjobs = n;
    c->tT = T;
    for (int i = 0; i < c->nw; i++) {
        c->w[i].ntseg = 0;
        c->w[i].ntchain = 0;
        c->w[i].trows = 0;
        c->w[i].tweight = 0;
        c->w[i].involved = 0;
        c->w[i].answered = 0;
    }
    for (int j = 0; j < n && c->state == SENT; j++) {
        int k = find_mat(c, jobs[j].name), ka = jobs[j].pre ? find_mat(c, jobs[j].pre) : -1;
        for (int p = c->pbeg[k]; p < c->pbeg[k] + c->pcnt[k]; p++) {
            const shoal_tshard_piece *pc = &c->pieces[p];
            shoal__ec_worker *w = &c->w[pc->w];
            if (ka < 0 ? w->ntseg == SHOAL_PROTO_MAX_TSEGS : w->ntchain == SHOAL_PROTO_MAX_TCHAIN) {
                shoal__ec_fail(c, SHOAL_ECONFIG, "trunk worker %s: more than %d %s in one request (layer %d)",
                               w->name, ka < 0 ? SHOAL_PROTO_MAX_TSEGS : SHOAL_PROTO_MAX_TCHAIN,
                               ka < 0 ? "row ranges" : "chained row ranges", layer);
                break;
            }
            shoal_proto_trows *g;
            if (ka < 0) {
                g = &w->tseg[w->ntseg];
                w->tjob[w->ntseg++] = j;
            } else {
                shoal_proto_tchain *ch = &w->tchain[w->ntchain];
                memcpy(ch->a, c->tmats[ka].name, sizeof ch->a);
                g = &ch->b;
                w->tcjob[w->ntchain++] = j;
            }
            memcpy(g->name, c->tmats[k].name, sizeof g->name);
            g->lo = pc->lo;
            g->hi = pc->hi;
            w->trows += pc->hi - pc->lo + 1;
            const shoal_tensor *tt = shoal_st_find(c->o.st, c->tmats[k].name); /* O(1), no allocation */
            w->tweight += (uint64_t)(pc->hi - pc->lo + 1) * (uint64_t)c->tmats[k].cols *
                          (tt ? shoal_dtype_size(tt->dtype) : 0);
            if (ka >= 0) { /* the chain's first matrix, read whole by this worker */
                const shoal_tensor *ta = shoal_st_find(c->o.st, c->tmats[ka].name);
                w->tweight += ta ? ta->nbytes : 0;
            }
            w->involved = 1;
        }
    }
    size_t xlen = 0;
    if (c->state == SENT) {
        shoal_proto_tensor_hdr(c->tx, SHOAL_WIRE_F32, (uint32_t)T, (uint32_t)cols);
        memcpy(c->tx + SHOAL_PROTO_TENSOR_HDR, x, (size_t)T * (size_t)cols * 4);
        shoal_proto_tensor_len(SHOAL_WIRE_F32, (uint32_t)T, (uint32_t)cols, &xlen);
    }
    for (int i = 0; i < c->nw && c->state == SENT; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved)
            continue;
        if (atomic_load(&w->link) != W_UP) {
            shoal__ec_fail(c, SHOAL_EPEER,
                           "trunk worker %s is down (%s); not sent layer %d, reconnecting in the background", w->name,
                           w->why, layer);
            break;
        }
        w->rid = ++c->next_rid;
        if (shoal_proto_enc_tbatch(w->tctl, SHOAL__EC_TCTL_CAP, &w->tctl_len, w->rid, (uint32_t)layer, w->tseg,
                                   w->ntseg, w->tchain, w->ntchain)) {
            shoal__ec_fail(c, SHOAL_EINTERNAL, "trunk worker %s: TRUNK_BATCH does not encode", w->name);
            break;
        }
        if (shoal__ec_send_frame(w->sock, w->tctl, w->tctl_len, 1) || shoal__ec_send_frame(w->sock, c->tx, xlen, 0)) {
            int e = errno;
            shoal__ec_mark_down(c, i, "cannot send: %s", e == EAGAIN ? "not connected" : zmq_strerror(e));
            shoal__ec_fail(c, SHOAL_EPEER, "trunk worker %s: cannot send layer %d: %s", w->name, layer,
                 e == EAGAIN ? "not connected (the worker is down?)" : zmq_strerror(e));
            break;
        }
        c->trunk_messages++;
        c->st.messages++;
        c->st.bytes_out += w->tctl_len + xlen;
        w->bytes_out = w->tctl_len + xlen;
        w->sent_ns = shoal__ec_now_us() * 1000u;
    }
    c->trunk_requests++;
    c->st.requests++;
    c->deadline_us = shoal__ec_now_us() + (uint64_t)c->o.timeout_ms * 1000u;
    return 0; /* a failure is returned by gather() (it releases the lock) */
}

/* One message from involved worker i (smu held): checked and scattered. */
static void on_reply(shoal_expert_client *c, int i, zmq_msg_t *parts, int np, int truncated)
{
    shoal__ec_worker *w = &c->w[i];
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    for (int j = 0; j < np; j++)
        f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
    if (!truncated && f[0].len >= 2 && f[0].data[0] == 0x93 && f[0].data[1] == SHOAL_MSG_HELLO) {
        shoal__ec_close_parts(parts, np); /* an answer to an old probe: decoding one allocates */
        return;
    }
    shoal_proto_msg m;
    memset(&m, 0, sizeof m);
    int perr;
    char why[512];
    int drc = truncated ? SHOAL_EPROTO
                        : shoal_proto_decode_with(c->dec, f, np, SHOAL_SIDE_COORDINATOR, &m, &perr, why, sizeof why);
    if (truncated)
        snprintf(why, sizeof why, "more frames than the protocol allows");
    int current = c->state == SENT && !w->answered && m.rid == w->rid;
    uint64_t want = w->trows * (uint64_t)c->tT;
    if (!drc && (m.type == SHOAL_MSG_PONG || m.type == SHOAL_MSG_HELLO)) {
        /* an answer to an old probe */
    } else if (!current) {
        c->st.late_replies++;
    } else if (drc) {
        shoal__ec_mark_down(c, i, "malformed reply: %s", why);
        shoal__ec_fail(c, SHOAL_EPROTO, "trunk worker %s: malformed reply to layer %d: %s", w->name, c->layer, why);
    } else if (m.type == SHOAL_MSG_ERROR) {
        shoal__ec_mark_down(c, i, "answered ERROR %s", shoal_perr_name((int)m.error.code));
        shoal__ec_fail(c, shoal_perr_to_err((int)m.error.code), "trunk worker %s refused layer %d: %s: %s", w->name,
                       c->layer, shoal_perr_name((int)m.error.code), m.error.message);
    } else if (m.type != SHOAL_MSG_TRUNK_RESULT || m.tresult.y.cols != want) {
        shoal__ec_mark_down(c, i, "reply of the wrong type or shape");
        shoal__ec_fail(c, SHOAL_EPROTO,
                       "trunk worker %s answered layer %d with %s of %u values, expected TRUNK_RESULT of %llu", w->name,
                       c->layer, shoal_msg_type_name(m.type), m.tresult.y.cols, (unsigned long long)want);
    } else {
        const shoal_rmat_job *jobs = c->tjobs;
        const uint8_t *src = m.tresult.y.data;
        int T = c->tT;
        for (uint32_t s = 0; s < w->ntseg + w->ntchain; s++) { /* segments, then chained segments */
            const shoal_proto_trows *g = s < w->ntseg ? &w->tseg[s] : &w->tchain[s - w->ntseg].b;
            const shoal_rmat_job *jb = &jobs[s < w->ntseg ? w->tjob[s] : w->tcjob[s - w->ntseg]];
            size_t nr = (size_t)(g->hi - g->lo + 1);
            for (int t = 0; t < T; t++)
                memcpy(jb->y + (size_t)t * (size_t)jb->rows + g->lo, src + ((size_t)t * nr) * 4, nr * 4);
            src += (size_t)T * nr * 4;
        }
        c->st.worker_queue_us += m.tresult.queue_us;
        c->st.worker_compute_us += m.tresult.compute_us;
        w->answered = 1;
        if (c->cm) {
            uint64_t t = shoal__ec_now_us() * 1000u, in = 0;
            for (int j = 0; j < np; j++)
                in += f[j].len;
            shoal_cmetrics_txchg x = {.rows = w->trows * (uint64_t)T, .weight_bytes = w->tweight,
                                      .bytes_out = w->bytes_out, .bytes_in = in,
                                      .rtt_ns = t > w->sent_ns ? t - w->sent_ns : 0,
                                      .queue_us = m.tresult.queue_us, .compute_us = m.tresult.compute_us};
            shoal_cmetrics_trunk(c->cm, i, &x);
        }
    }
    for (int j = 0; j < np; j++)
        c->st.bytes_in += f[j].len;
    shoal_proto_msg_clear(&m);
    shoal__ec_close_parts(parts, np);
}

static int gather(void *self, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    uint64_t t0 = shoal__ec_now_us();
    while (c->state == SENT) {
        int n = 0;
        for (int i = 0; i < c->nw && c->state == SENT; i++) {
            shoal__ec_worker *w = &c->w[i];
            if (!w->involved || w->answered)
                continue;
            zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
            int np, truncated;
            while (c->state == SENT && !w->answered && (np = shoal__ec_recv_parts(w->sock, parts, &truncated)) > 0)
                on_reply(c, i, parts, np, truncated);
            if (c->state != SENT || w->answered)
                continue;
            if (shoal__ec_monitor_disconnected(w->mon)) {
                shoal__ec_mark_down(c, i, "disconnected (the worker died?)");
                shoal__ec_fail(c, SHOAL_EPEER,
                               "trunk worker %s disconnected before answering layer %d (the worker died?)", w->name,
                               c->layer);
                break;
            }
            c->pfd[n] = (struct pollfd){.fd = w->fd, .events = POLLIN};
            c->pidx[n++] = i;
            c->pfd[n] = (struct pollfd){.fd = w->mfd, .events = POLLIN};
            c->pidx[n++] = i;
        }
        if (c->state != SENT || n == 0)
            break;
        uint64_t now = shoal__ec_now_us();
        if (now >= c->deadline_us) {
            char names[768] = "";
            size_t at = 0;
            for (int i = 0; i < c->nw && at < sizeof names; i++)
                if (c->w[i].involved && !c->w[i].answered) {
                    at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? ", " : "", c->w[i].name);
                    shoal__ec_mark_down(c, i, "no reply within %d ms", c->o.timeout_ms);
                }
            shoal__ec_fail(c, SHOAL_ETIMEOUT,
                           "no reply to the trunk rows of layer %d within %d ms from trunk worker %s", c->layer,
                           c->o.timeout_ms, names);
            break;
        }
        /* capped, so that a missed wake-up (ZMQ_FD is edge-like) only delays */
        uint64_t ms = (c->deadline_us - now + 999) / 1000;
        if (poll(c->pfd, (nfds_t)n, ms > 20 ? 20 : (int)ms) < 0 && errno != EINTR)
            usleep(1000);
    }
    c->st.wait_s += (double)(shoal__ec_now_us() - t0) / 1e6;
    int rc = c->state == FAILED ? c->rc : 0;
    if (rc)
        shoal_err_set(err, errlen, rc, "%s", c->err);
    c->state = IDLE;
    c->tjobs = NULL;
    pthread_mutex_unlock(&c->smu);
    return rc;
}

static void vt_close(void *self)
{
    shoal_expert_client_close(self);
}

static const shoal_rmat_vt trunk_vt = {.has = has, .has_chain = has_chain, .submit = submit, .gather = gather,
                                       .close = vt_close};

int shoal_trunk_client_open(shoal_expert_client **out, const shoal_expert_client_opts *o, char *err, size_t errlen)
{
    if (!o->trunk_role || !o->st)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk client: trunk_role and st are required");
    return shoal_expert_client_open(out, o, err, errlen);
}

shoal_rmat shoal_trunk_client_backend(shoal_expert_client *c)
{
    return (shoal_rmat){.vt = &trunk_vt, .self = c};
}

void shoal_trunk_client_counts(shoal_expert_client *c, uint64_t *requests, uint64_t *messages)
{
    pthread_mutex_lock(&c->smu);
    *requests = c->trunk_requests;
    *messages = c->trunk_messages;
    pthread_mutex_unlock(&c->smu);
}

void shoal_trunk_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm)
{
    pthread_mutex_lock(&c->smu);
    c->cm = cm; /* the workers were described by the expert client (same indexes) */
    pthread_mutex_unlock(&c->smu);
}

int shoal_trunk_client_nremote(const shoal_expert_client *c)
{
    int n = 0;
    for (int k = 0; k < c->ntmats; k++)
        n += c->tremote[k] != 0;
    return n;
}
