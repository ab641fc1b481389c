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
#include "common/log.h"
#include "coordinator/cluster/expert_client_int.h"
#include "coordinator/obs/obs.h"
#include "kernels/kernels.h"

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
 * every worker that may compute rows of name (every owner of each of its
 * cells: failover may pick any of them) speaks 1.4 and holds all of pre
 * (PROTOCOL.md §3.7). */
static int has_chain(void *self, const char *pre, int pre_rows, int pre_cols, const char *name, int rows, int cols)
{
    shoal_expert_client *c = self;
    if (!has(c, pre, pre_rows, pre_cols) || !has(c, name, rows, cols) || cols != pre_rows ||
        pre_rows > SHOAL_PROTO_MAX_CHAIN_ROWS)
        return 0;
    int ka = find_mat(c, pre), kb = find_mat(c, name);
    for (int i = c->cbeg[kb]; i < c->cbeg[kb] + c->ccnt[kb]; i++)
        for (uint32_t j = c->cells[i].off; j < c->cells[i].off + c->cells[i].n; j++) {
            const shoal__ec_worker *w = &c->w[c->cown[j].w];
            if (!w->chain || !holds_all(w, &c->tmats[ka]))
                return 0;
        }
    return 1;
}

/* One owner per cell of job j's matrix (smu held): want NULL, every cell
 * (a request's first round), else the cells with want[i] set (a resend); the
 * owners that are pickable (up here and on the sibling's link, not lost)
 * first, then for a cell none of whose owners is, one that is up here
 * (shoal__ec_pickable). Returns the index of the first cell with no owner up
 * here, or -1 when every one wanted has one. */
static int pick_job(shoal_expert_client *c, int j, int k, const uint8_t *want)
{
    const shoal_tshard_cell *cl = &c->cells[c->cbeg[k]];
    const int nc = c->ccnt[k];
    int32_t *pk = &c->tpick[(size_t)j * (size_t)c->maxc];
    for (int i = 0; i < c->nw; i++) {
        c->live[i] = shoal__ec_pickable(c, i);
        c->tup[i] = !c->w[i].lost && atomic_load(&c->w[i].link) == W_UP;
    }
    shoal_tshard_pick(cl, nc, c->cown, c->nw, c->live, want, c->tload, pk);
    int again = 0;
    for (int i = 0; i < nc; i++) {
        c->twant[i] = (!want || want[i]) && pk[i] < 0;
        again |= c->twant[i];
    }
    if (!again)
        return -1;
    shoal_tshard_pick(cl, nc, c->cown, c->nw, c->tup, c->twant, c->tload, pk);
    for (int i = 0; i < nc; i++)
        if ((!want || want[i]) && pk[i] < 0)
            return i;
    return -1;
}

/* The relay tree of this round (PROTOCOL.md §3.9; smu held, after the
 * involved workers are known): only in a request's first round and with
 * relay_fanout F >= 2; its members are the involved workers that relay (an
 * index in their own list), not marked down for relaying, with the same list
 * and the same x dtype as the first of them, in worker order. The first F are
 * the roots; the rest fill the tree level by level, each level's members
 * taking the previous level's in turn as parents (at most F children each);
 * the roots get x and their subtree in `fwd` (parents before children), the
 * others only the header with the step's xid. A root left without children,
 * and every member when there are F or fewer, gets a plain request.
 * Greedy (SHOAL_RELAY_GREEDY): the members take the places of the
 * latency-aware schedule (relaytree.h) for this step's x bytes, from the
 * cache when a step of the same size came before. */
static void plan_greedy(shoal_expert_client *c, int n, const shoal_proto_relay *rl);

static void plan_tree(shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++) {
        c->w[i].rrole = 0;
        c->w[i].rparent = -1;
        c->w[i].rl.xid = 0;
        c->w[i].rl.nfwd = 0;
    }
    const int F = c->o.relay_fanout;
    if ((F < 2 && F != SHOAL_RELAY_GREEDY) || c->round > 0)
        return;
    int n = 0, t16 = 0;
    uint64_t hash = 0;
    for (int i = 0; i < c->nw; i++) {
        const shoal__ec_worker *w = &c->w[i];
        if (!w->involved || w->relay_idx < 0 || w->relay_down)
            continue;
        if (n == 0) {
            hash = w->relay_hash;
            t16 = w->t16;
        }
        if (w->relay_hash == hash && w->t16 == t16)
            c->rorder[n++] = i;
    }
    if (n <= F || n < 2)
        return;
    uint64_t fo = c->failover_us / 1000u;
    shoal_proto_relay rl = {.xid = ++c->next_xid,
                            .wait_ms = (uint32_t)(fo < 1 ? 1 : fo > SHOAL_PROTO_MAX_WAIT_MS ? SHOAL_PROTO_MAX_WAIT_MS : fo)};
    if (F == SHOAL_RELAY_GREEDY) {
        plan_greedy(c, n, &rl);
        return;
    }
    uint8_t pos[SHOAL_EXPERT_CLIENT_MAX_WORKERS]; /* a member's position in its root's fwd */
    int16_t root_of[SHOAL_EXPERT_CLIENT_MAX_WORKERS];
    for (int j = 0; j < F; j++) {
        shoal__ec_worker *w = &c->w[c->rorder[j]];
        w->rrole = 1;
        w->rl = rl;
        root_of[j] = (int16_t)j;
    }
    /* level by level: the members of the next level go round the current
     * one's in turn (at most F each), so the children are spread evenly */
    int j = F, lstart = 0, lsize = F, full = 0;
    while (j < n && !full) {
        int next = 0;
        for (int o = 0; j < n && o < F * lsize; o++, j++, next++) {
            int p = lstart + o % lsize, r = root_of[p];
            shoal__ec_worker *rw = &c->w[c->rorder[r]], *w = &c->w[c->rorder[j]];
            if (rw->rl.nfwd == SHOAL_PROTO_MAX_RELAY) { /* the rest direct (a parent precedes its children) */
                full = 1;
                break;
            }
            pos[j] = (uint8_t)rw->rl.nfwd;
            root_of[j] = (int16_t)r;
            rw->rl.fwd[rw->rl.nfwd++] = (shoal_proto_fwd){(uint8_t)w->relay_idx, (uint8_t)(p < F ? 0 : pos[p] + 1)};
            w->rrole = 2;
            w->rparent = c->rorder[p];
            w->rl = rl;
        }
        lstart += lsize;
        lsize = next;
    }
    for (int r = 0; r < F; r++) { /* a root without children is a plain request */
        shoal__ec_worker *w = &c->w[c->rorder[r]];
        if (!w->rl.nfwd) {
            w->rrole = 0;
            w->rl.xid = 0;
        }
    }
}

static void plan_greedy(shoal_expert_client *c, int n, const shoal_proto_relay *rl)
{
    const shoal__ec_worker *w0 = &c->w[c->rorder[0]];
    const size_t xb = w0->t16 ? c->tx16len : c->txlen; /* the members share the dtype */
    const shoal_relaytree *t = NULL;
    for (int s = 0; s < SHOAL__EC_RTCACHE && !t; s++)
        if (c->rtc_n[s] == n && c->rtc_xb[s] == xb)
            t = &c->rtc[s];
    if (!t) {
        int s = c->rtc_next;
        c->rtc_next = (s + 1) % SHOAL__EC_RTCACHE;
        c->rtc_n[s] = 0;
        if (shoal_relaytree_greedy(&c->rtc[s], n, (double)xb, c->o.relay_nic_Bps, c->o.relay_peer_Bps,
                                   c->o.relay_hop_s, SHOAL_PROTO_MAX_RELAY))
            return; /* rates checked at open: cannot happen; every request then carries x */
        c->rtc_n[s] = n;
        c->rtc_xb[s] = xb;
        t = &c->rtc[s];
    }
    uint8_t pos[SHOAL_EXPERT_CLIENT_MAX_WORKERS]; /* a member's position in its root's fwd */
    for (int j = 0; j < n; j++) { /* in schedule order: a parent before its children, its children in send order */
        shoal__ec_worker *w = &c->w[c->rorder[j]];
        int p = t->parent[j];
        w->rl = *rl;
        if (p < 0) {
            w->rrole = 1;
            continue;
        }
        int r = t->root[j];
        shoal__ec_worker *rw = &c->w[c->rorder[r]];
        pos[j] = (uint8_t)rw->rl.nfwd;
        rw->rl.fwd[rw->rl.nfwd++] = (shoal_proto_fwd){(uint8_t)w->relay_idx, (uint8_t)(p == r ? 0 : pos[p] + 1)};
        w->rrole = 2;
        w->rparent = c->rorder[p];
    }
    for (int j = 0; j < n; j++) { /* a coordinator's child without children is a plain request */
        shoal__ec_worker *w = &c->w[c->rorder[j]];
        if (w->rrole == 1 && !w->rl.nfwd) {
            w->rrole = 0;
            w->rl.xid = 0;
        }
    }
}

/* This round's TRUNK_BATCH of every involved worker from tpick (smu held,
 * state SENT): per job, its cells in row order; consecutive cells with the
 * same owner in the same announced range travel as one segment. Resets the
 * round's per-worker state. */
static void pack_round(shoal_expert_client *c)
{
    const shoal_rmat_job *jobs = c->tjobs;
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        w->ntseg = w->ntchain = 0;
        w->trows = w->tweight = 0;
        w->t16 = w->trunk16; /* cleared below by a matrix whose product reads x in f32 */
        w->involved = w->answered = w->lost = w->fo_checked = 0;
    }
    for (int j = 0; j < c->ntjobs && c->state == SENT; j++) {
        int k = find_mat(c, jobs[j].name), ka = jobs[j].pre ? find_mat(c, jobs[j].pre) : -1;
        const shoal_tshard_cell *cl = &c->cells[c->cbeg[k]];
        const int32_t *pk = &c->tpick[(size_t)j * (size_t)c->maxc];
        const shoal_tensor *tt = shoal_st_find(c->o.st, c->tmats[k].name); /* O(1), no allocation */
        const uint64_t rowb = (uint64_t)c->tmats[k].cols * (tt ? shoal_dtype_size(tt->dtype) : 0);
        int32_t prev = -1; /* owner entry of the cell before, when it is sent in this round */
        for (int i = 0; i < c->ccnt[k]; i++) {
            int32_t e = pk[i];
            if (e < 0) {
                prev = -1;
                continue;
            }
            shoal__ec_worker *w = &c->w[c->cown[e].w];
            uint32_t rows = cl[i].hi - cl[i].lo + 1;
            if (prev >= 0 && c->cown[prev].w == c->cown[e].w && c->cown[prev].range == c->cown[e].range) {
                /* the worker's last segment is this job's cell i - 1: extend it */
                if (ka < 0) {
                    w->tseg[w->ntseg - 1].hi = cl[i].hi;
                    w->tcell[w->ntseg - 1][1] = i;
                } else {
                    w->tchain[w->ntchain - 1].b.hi = cl[i].hi;
                    w->tccell[w->ntchain - 1][1] = i;
                }
            } else {
                if (ka < 0 ? w->ntseg == SHOAL_PROTO_MAX_TSEGS : w->ntchain == SHOAL_PROTO_MAX_TCHAIN) {
                    shoal__ec_fail(c, SHOAL_ECONFIG, "trunk worker %s: more than %d %s in one request (layer %d)",
                                   w->name, ka < 0 ? SHOAL_PROTO_MAX_TSEGS : SHOAL_PROTO_MAX_TCHAIN,
                                   ka < 0 ? "row ranges" : "chained row ranges", c->layer);
                    return;
                }
                shoal_proto_trows *g;
                if (ka < 0) {
                    g = &w->tseg[w->ntseg];
                    w->tjob[w->ntseg] = j;
                    w->tcell[w->ntseg][0] = w->tcell[w->ntseg][1] = i;
                    w->ntseg++;
                } else {
                    shoal_proto_tchain *ch = &w->tchain[w->ntchain];
                    memcpy(ch->a, c->tmats[ka].name, sizeof ch->a);
                    g = &ch->b;
                    w->tcjob[w->ntchain] = j;
                    w->tccell[w->ntchain][0] = w->tccell[w->ntchain][1] = i;
                    w->ntchain++;
                    const shoal_tensor *ta = shoal_st_find(c->o.st, c->tmats[ka].name);
                    w->tweight += ta ? ta->nbytes : 0; /* the chain's first matrix, read whole by this worker */
                }
                memcpy(g->name, c->tmats[k].name, sizeof g->name);
                g->lo = cl[i].lo;
                g->hi = cl[i].hi;
            }
            if (!c->tbf16[k] || (ka >= 0 && !c->tbf16[ka]))
                w->t16 = 0;
            w->trows += rows;
            w->tweight += (uint64_t)rows * rowb;
            w->involved = 1;
            prev = e;
        }
    }
    plan_tree(c);
    for (int i = 0; i < c->nw && c->state == SENT; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved)
            continue;
        w->rid = ++c->next_rid;
        if (shoal_proto_enc_tbatch_relay(w->tctl, SHOAL__EC_TCTL_CAP, &w->tctl_len, w->rid, (uint32_t)c->layer,
                                         w->tseg, w->ntseg, w->tchain, w->ntchain, w->rrole ? &w->rl : NULL))
            shoal__ec_fail(c, SHOAL_EINTERNAL, "trunk worker %s: TRUNK_BATCH does not encode", w->name);
    }
}

/* Send worker i's TRUNK_BATCH (smu held): the header, and x unless it is
 * relayed. 0; or -1 when the send fails: the worker is then marked down and
 * lost (its cells go to other owners, gather). */
static int send_one(shoal_expert_client *c, int i)
{
    shoal__ec_worker *w = &c->w[i];
    uint8_t *x = w->t16 ? c->tx16 : c->tx;
    size_t xlen = w->t16 ? c->tx16len : c->txlen;
    int relayed = w->rrole == 2;
    if (relayed ? shoal__ec_send_frame(w->sock, w->tctl, w->tctl_len, 0)
                : shoal__ec_send_frame(w->sock, w->tctl, w->tctl_len, 1) || shoal__ec_send_frame(w->sock, x, xlen, 0)) {
        int e = errno;
        if (c->cm)
            shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
        shoal__ec_mark_down(c, i, "cannot send: %s", e == EAGAIN ? "not connected" : zmq_strerror(e));
        shoal__ec_lose(c, i, SHOAL_EPEER, "trunk worker %s: cannot send layer %d: %s", w->name, c->layer,
                       e == EAGAIN ? "not connected (the worker is down?)" : zmq_strerror(e));
        return -1;
    }
    c->trunk_messages++;
    c->st.messages++;
    w->bytes_out = w->tctl_len + (relayed ? 0 : xlen);
    c->st.bytes_out += w->bytes_out;
    c->trunk_relayed += relayed;
    return 0;
}

/* A relayed request of worker i that failed (smu held, state SENT): no reply
 * within the failover time, or an ERROR (its input never came: a relay
 * parent slow, stopped or dead, a full park). Its relay parents relay no more
 * in this run; the request is resent directly with x under a new rid (a
 * reply to the old one is dropped as late); the rows are the same bits. */
static void relay_fallback(shoal_expert_client *c, int i, const char *why)
{
    shoal__ec_worker *w = &c->w[i];
    for (int p = w->rparent; p >= 0; p = c->w[p].rparent)
        if (!c->w[p].relay_down) {
            c->w[p].relay_down = 1;
            SHOAL_WARN("trunk worker %s: relayed input for %s %s at layer %d: it relays no more; its children get x "
                       "directly",
                       c->w[p].name, w->name, why, c->layer);
        }
    w->rrole = 0;
    w->rparent = -1;
    w->rid = ++c->next_rid;
    c->trunk_relay_fallbacks++;
    if (shoal_proto_enc_tbatch(w->tctl, SHOAL__EC_TCTL_CAP, &w->tctl_len, w->rid, (uint32_t)c->layer, w->tseg,
                               w->ntseg, w->tchain, w->ntchain)) {
        shoal__ec_fail(c, SHOAL_EINTERNAL, "trunk worker %s: TRUNK_BATCH does not encode", w->name);
        return;
    }
    w->sent_ns = shoal__ec_now_ns();
    w->fo_checked = 0;
    send_one(c, i); /* a failed send loses the worker (its cells go to other owners) */
}

/* The root of relayed worker i's tree (i itself when it is not relayed). */
static int root_of(const shoal_expert_client *c, int i)
{
    while (c->w[i].rrole == 2 && c->w[i].rparent >= 0)
        i = c->w[i].rparent;
    return i;
}

static void send_request(shoal_expert_client *c, int i);

/* Send this round's requests (smu held, state SENT), every one before any
 * reply is read. A worker that went down since the pick, or whose send
 * fails, is lost: its cells go to other owners (gather). The order: the
 * requests that carry x in worker order (the order of the relay schedule's
 * direct sends), each root's followed at once by the headers of its
 * subtree (a few hundred bytes each: a relayed worker gets its header about
 * when its parent gets x, before its own copy comes). */
static void send_round(shoal_expert_client *c)
{
    for (int i = 0; i < c->nw && c->state == SENT; i++) {
        if (!c->w[i].involved || c->w[i].rrole == 2)
            continue;
        send_request(c, i);
        for (int k = 0; k < c->nw && c->w[i].rrole == 1 && c->state == SENT; k++)
            if (c->w[k].involved && c->w[k].rrole == 2 && root_of(c, k) == i)
                send_request(c, k);
    }
}

/* Worker i's request of this round (smu held, state SENT); a worker that
 * went down since the pick is lost. */
static void send_request(shoal_expert_client *c, int i)
{
    shoal__ec_worker *w = &c->w[i];
    if (atomic_load(&w->link) != W_UP) {
        shoal__ec_lose(c, i, SHOAL_EPEER, "trunk worker %s is down (%s); not sent layer %d", w->name, w->why,
                       c->layer);
        return;
    }
    w->sent_ns = shoal__ec_now_ns();
    shoal__ec_busy_sent(c, i, w->sent_ns);
    send_one(c, i); /* a failed send loses the worker */
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
    c->round = 0;
    c->lost_rc = 0;
    c->lost_err[0] = 0;
    for (int i = 0; i < c->nw; i++) {
        c->w[i].lost = c->w[i].involved = c->w[i].answered = 0;
        c->w[i].lost_sent_ns = 0;
        c->w[i].sent_ns = 0;
    }
    shoal__ec_see_disconnects(c);
    /* one owner per cell, the rows of each matrix spread over the live owners */
    for (int j = 0; j < n && c->state == SENT; j++) {
        int k = find_mat(c, jobs[j].name), gap = pick_job(c, j, k, NULL);
        if (gap >= 0) { /* no owner up: named after its first owner, fail fast (the keeper is bringing it back) */
            const shoal_tshard_cell *cl = &c->cells[c->cbeg[k] + gap];
            const shoal__ec_worker *w = &c->w[c->cown[cl->off].w];
            shoal__ec_fail(c, SHOAL_EPEER,
                           "trunk worker %s is down (%s); not sent layer %d, reconnecting in the background%s",
                           w->name, w->why, layer, cl->n > 1 ? " (and no other owner of its rows is up)" : "");
        }
    }
    if (c->state == SENT) {
        shoal_proto_tensor_hdr(c->tx, SHOAL_WIRE_F32, (uint32_t)T, (uint32_t)cols);
        memcpy(c->tx + SHOAL_PROTO_TENSOR_HDR, x, (size_t)T * (size_t)cols * 4);
        shoal_proto_tensor_len(SHOAL_WIRE_F32, (uint32_t)T, (uint32_t)cols, &c->txlen);
        int any16 = 0;
        for (int i = 0; i < c->nw; i++)
            any16 |= c->w[i].trunk16;
        if (any16) { /* bf16 with the mu kernels' rounding (PROTOCOL.md 1.7): the same products on the worker */
            shoal_proto_tensor_hdr(c->tx16, SHOAL_WIRE_BF16, (uint32_t)T, (uint32_t)cols);
            shoal_mu_round_bf16((uint16_t *)(void *)(c->tx16 + SHOAL_PROTO_TENSOR_HDR), x, (size_t)T * (size_t)cols);
            shoal_proto_tensor_len(SHOAL_WIRE_BF16, (uint32_t)T, (uint32_t)cols, &c->tx16len);
        }
        pack_round(c);
    }
    c->deadline_us = shoal__ec_now_us() + (uint64_t)c->o.timeout_ms * 1000u;
    if (c->state == SENT)
        send_round(c);
    c->trunk_requests++;
    c->st.requests++;
    return 0; /* a failure is returned by gather() (it releases the lock) */
}

/* One message from involved worker i (smu held): checked and scattered; a
 * bad answer loses the worker's part (resent to other owners). */
static void on_reply(shoal_expert_client *c, int i, zmq_msg_t *parts, int np, int truncated)
{
    shoal__ec_worker *w = &c->w[i];
    shoal__ec_busy_answered(c, i); /* it answers */
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
    int current = c->state == SENT && w->involved && !w->answered && !w->lost && m.rid == w->rid;
    uint64_t want = w->trows * (uint64_t)c->tT;
    if (!drc && (m.type == SHOAL_MSG_PONG || m.type == SHOAL_MSG_HELLO)) {
        /* an answer to an old probe */
    } else if (!current) {
        c->st.late_replies++; /* a reply to a lost part, or to a request that failed */
    } else if (drc) {
        shoal__ec_mark_down(c, i, "malformed reply: %s", why);
        shoal__ec_lose(c, i, SHOAL_EPROTO, "trunk worker %s: malformed reply to layer %d: %s", w->name, c->layer,
                       why);
    } else if (m.type == SHOAL_MSG_ERROR && w->rrole == 2) { /* its input did not come through the tree */
        relay_fallback(c, i, "was refused (its input did not come)");
    } else if (m.type == SHOAL_MSG_ERROR) {
        shoal__ec_mark_down(c, i, "answered ERROR %s", shoal_perr_name((int)m.error.code));
        shoal__ec_lose(c, i, shoal_perr_to_err((int)m.error.code), "trunk worker %s refused layer %d: %s: %s",
                       w->name, c->layer, shoal_perr_name((int)m.error.code), m.error.message);
    } else if (m.type != SHOAL_MSG_TRUNK_RESULT || m.tresult.y.cols != want) {
        shoal__ec_mark_down(c, i, "reply of the wrong type or shape");
        shoal__ec_lose(c, i, SHOAL_EPROTO,
                       "trunk worker %s answered layer %d with %s of %u values, expected TRUNK_RESULT of %llu",
                       w->name, c->layer, shoal_msg_type_name(m.type), m.tresult.y.cols, (unsigned long long)want);
    } else {
        const shoal_rmat_job *jobs = c->tjobs;
        const uint8_t *src = m.tresult.y.data;
        int T = c->tT;
        for (uint32_t s = 0; s < w->ntseg + w->ntchain; s++) { /* segments, then chained segments */
            int plain = s < w->ntseg;
            const shoal_proto_trows *g = plain ? &w->tseg[s] : &w->tchain[s - w->ntseg].b;
            int j = plain ? w->tjob[s] : w->tcjob[s - w->ntseg];
            const int32_t *cells = plain ? w->tcell[s] : w->tccell[s - w->ntseg];
            const shoal_rmat_job *jb = &jobs[j];
            size_t nr = (size_t)(g->hi - g->lo + 1);
            for (int t = 0; t < T; t++)
                memcpy(jb->y + (size_t)t * (size_t)jb->rows + g->lo, src + ((size_t)t * nr) * 4, nr * 4);
            src += (size_t)T * nr * 4;
            for (int ci = cells[0]; ci <= cells[1]; ci++) /* these cells are done */
                c->tpick[(size_t)j * (size_t)c->maxc + (size_t)ci] = -1;
        }
        c->st.worker_queue_us += m.tresult.queue_us;
        c->st.worker_compute_us += m.tresult.compute_us;
        w->answered = 1;
        if (c->cm) {
            uint64_t t = shoal__ec_now_ns(), in = 0;
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

/* Can every cell worker i computes in this round go to another owner that
 * is pickable (smu held)? */
static int others_up(shoal_expert_client *c, int i)
{
    const shoal_rmat_job *jobs = c->tjobs;
    for (int j = 0; j < c->ntjobs; j++) {
        int k = find_mat(c, jobs[j].name);
        const int32_t *pk = &c->tpick[(size_t)j * (size_t)c->maxc];
        for (int ci = 0; ci < c->ccnt[k]; ci++) {
            if (pk[ci] < 0 || c->cown[pk[ci]].w != i)
                continue;
            const shoal_tshard_cell *cl = &c->cells[c->cbeg[k] + ci];
            int ok = 0;
            for (uint32_t e = cl->off; e < cl->off + cl->n && !ok; e++)
                ok = c->cown[e].w != i && shoal__ec_pickable(c, c->cown[e].w);
            if (!ok)
                return 0;
        }
    }
    return 1;
}

/* Wait until every involved worker of this round answered or was lost, or
 * the request failed (smu held, state SENT). A worker is lost when it
 * disconnects, answers badly (on_reply), or stays silent past the failover
 * time while every one of its cells has another owner up; at the deadline
 * the silent ones are marked down and the request fails naming them. The
 * wait is a poll() over the sockets' and monitors' ZMQ_FD. */
static void wait_round(shoal_expert_client *c)
{
    while (c->state == SENT) {
        int n = 0;
        uint64_t next_fo = UINT64_MAX; /* the earliest failover time still to check */
        for (int i = 0; i < c->nw && c->state == SENT; i++) {
            shoal__ec_worker *w = &c->w[i];
            if (!w->involved || w->answered || w->lost)
                continue;
            zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
            int np, truncated;
            while (c->state == SENT && !w->answered && !w->lost &&
                   (np = shoal__ec_recv_parts(w->sock, parts, &truncated)) > 0)
                on_reply(c, i, parts, np, truncated);
            if (c->state != SENT || w->answered || w->lost)
                continue;
            if (w->rrole == 2 && shoal__ec_now_us() >= w->sent_ns / 1000u + c->failover_us)
                relay_fallback(c, i, "did not come within the failover time");
            if (c->state != SENT || w->lost)
                continue;
            if (shoal__ec_check_worker(c, i, shoal__ec_monitor_disconnected(w->mon), others_up, "trunk",
                                       "the trunk rows of ", &next_fo))
                continue;
            c->pfd[n] = (struct pollfd){.fd = w->fd, .events = POLLIN};
            c->pidx[n++] = i;
            c->pfd[n] = (struct pollfd){.fd = w->mfd, .events = POLLIN};
            c->pidx[n++] = i;
        }
        if (c->state != SENT || n == 0)
            return;
        uint64_t now = shoal__ec_now_us();
        if (now >= c->deadline_us) {
            char names[768] = "";
            size_t at = 0;
            for (int i = 0; i < c->nw && at < sizeof names; i++) {
                const shoal__ec_worker *w = &c->w[i];
                if (!w->involved || w->answered || w->lost)
                    continue;
                at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? ", " : "", w->name);
                if (c->cm)
                    shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_TIMEOUT);
                shoal__ec_mark_down(c, i, "no reply within %d ms", c->o.timeout_ms);
            }
            shoal__ec_fail(c, SHOAL_ETIMEOUT,
                           "no reply to the trunk rows of layer %d within %d ms from trunk worker %s", c->layer,
                           c->o.timeout_ms, names);
            return;
        }
        /* capped, so that a missed wake-up (ZMQ_FD is edge-like) only delays */
        uint64_t until = next_fo < c->deadline_us ? (next_fo > now ? next_fo : now) : c->deadline_us;
        uint64_t ms = (until - now + 999) / 1000;
        if (poll(c->pfd, (nfds_t)n, ms > 20 ? 20 : (int)ms) < 0 && errno != EINTR)
            usleep(1000);
    }
}

/* Failover (smu held, state SENT, after a round in which every involved
 * worker answered or was lost): the cells still held by a lost worker go to
 * other owners, picked as in submit() among those up, in a new round under
 * the same deadline. A cell with no other owner up fails the request with
 * the first loss's error. */
static void resend(shoal_expert_client *c)
{
    const shoal_rmat_job *jobs = c->tjobs;
    for (int j = 0; j < c->ntjobs && c->state == SENT; j++) {
        int k = find_mat(c, jobs[j].name);
        int32_t *pk = &c->tpick[(size_t)j * (size_t)c->maxc], *from = &c->tfrom[(size_t)j * (size_t)c->maxc];
        int any = 0;
        for (int ci = 0; ci < c->ccnt[k]; ci++) {
            from[ci] = pk[ci] >= 0 ? c->cown[pk[ci]].w : -1;
            any |= pk[ci] >= 0;
        }
        if (!any)
            continue;
        /* the wanted cells: those not done (their owner was lost) */
        uint8_t *want = c->twant + c->maxc; /* twant[0 .. maxc) is pick_job's */
        for (int ci = 0; ci < c->ccnt[k]; ci++)
            want[ci] = from[ci] >= 0;
        int gap = pick_job(c, j, k, want);
        if (gap >= 0) {
            const shoal_tshard_cell *cl = &c->cells[c->cbeg[k] + gap];
            shoal__ec_fail(c, c->lost_rc ? c->lost_rc : SHOAL_EPEER, "%s%s", c->lost_err,
                           cl->n > 1 ? " (and no other owner of those rows is up)" : "");
            return;
        }
    }
    /* every lost cell has a new owner: the failovers and takeovers */
    uint64_t now = shoal__ec_now_ns(), rows = 0;
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->lost)
            continue;
        c->st.failovers++;
        rows += w->trows;
        SHOAL_WARN("trunk worker %s lost at layer %d after %.1f ms (%s): its %llu rows resent to other owners",
                   w->name, c->layer, (double)(now - (w->sent_ns ? w->sent_ns : now)) * 1e-6, w->why,
                   (unsigned long long)w->trows);
        if (c->cm)
            shoal_cmetrics_trunk_failover(c->cm, i, w->trows);
    }
    for (int j = 0; j < c->ntjobs && c->cm; j++) {
        int k = find_mat(c, jobs[j].name);
        const int32_t *pk = &c->tpick[(size_t)j * (size_t)c->maxc], *from = &c->tfrom[(size_t)j * (size_t)c->maxc];
        for (int ci = 0; ci < c->ccnt[k]; ci++)
            if (from[ci] >= 0) {
                const shoal_tshard_cell *cl = &c->cells[c->cbeg[k] + ci];
                shoal_cmetrics_trunk_takeover(c->cm, from[ci], c->cown[pk[ci]].w, cl->hi - cl->lo + 1);
            }
    }
    c->st.resent_pairs += rows;
    c->round++;
    pack_round(c);
    if (c->state == SENT)
        send_round(c);
}

static int gather(void *self, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    uint64_t t0 = shoal__ec_now_us();
    /* rounds: every involved worker answers or is lost; the lost ones' cells
     * are resent to other owners, until all arrived, the deadline passes or
     * a cell has no owner left */
    while (c->state == SENT) {
        wait_round(c);
        int left = 0;
        for (int i = 0; i < c->nw && !left; i++)
            left = c->w[i].involved && c->w[i].lost;
        if (c->state != SENT || !left)
            break;
        resend(c);
    }
    int rc = c->state == FAILED ? c->rc : 0;
    if (!rc)
        shoal__ec_count_failover_time(c);
    c->st.wait_s += (double)(shoal__ec_now_us() - t0) / 1e6;
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

void shoal_trunk_client_relay_counts(shoal_expert_client *c, int *fanout, uint64_t *relayed, uint64_t *fallbacks)
{
    pthread_mutex_lock(&c->smu);
    *fanout = c->o.relay_fanout;
    *relayed = c->trunk_relayed;
    *fallbacks = c->trunk_relay_fallbacks;
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
