/* The distributed routed-expert backend (see expert_client.h): the per-layer
 * expert exchange on the engine's forward thread. The worker links (connect,
 * HELLO, the keeper thread, open and close) are in links.c; the split, the
 * shared client struct and the threads and locks are in expert_client_int.h.
 *
 * No allocation on the forward thread: request frames are sent as ZeroMQ
 * constant messages (zmq_msg_init_data without a free function) over the
 * client's buffers (a worker's own; the activation frame of workers that get
 * every token is one of theirs, packed once), so zmq copies nothing and
 * allocates nothing; a buffer is rewritten by the next submit() only, after
 * the replies to the previous request arrived (so zmq has finished with it)
 * -- or after that request failed, when a stale request may go out with torn
 * contents, which the worker validates and answers under the old rid, dropped
 * here. Replies are received as zmq messages allocated by zmq's own I/O thread
 * and kept until the next request. The rest of zmq's allocations (a pipe's
 * queue chunks, connection set-up) are moved off the forward thread: every
 * new connection is warmed up by the thread that verifies it (open, keeper)
 * before the forward thread uses it; see warm_send() in links.c. */
#include "coordinator/cluster/expert_client_int.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/log.h"
#include "common/st.h"
#include "coordinator/obs/obs.h"
#include "coordinator/cluster/owners.h"

/* ---- the request (forward thread) ------------------------------------------ */

/* Arm or disarm worker i's arrival watch (forward thread): its ZMQ_FD in
 * the keeper's epoll, one-shot (keeper_main in links.c). */
static void watch(shoal_expert_client *c, int i, int on)
{
    struct epoll_event ev = {.events = on ? EPOLLIN | EPOLLONESHOT : 0, .data.u32 = (uint32_t)i};
    epoll_ctl(c->epfd, EPOLL_CTL_MOD, c->w[i].fd, &ev);
}

/* Record the request's failure (smu held). */
void shoal__ec_fail(shoal_expert_client *c, int rc, const char *fmt, ...)
{
    if (c->state != SENT)
        return;
    c->rc = rc;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    c->st.failures++;
    c->state = FAILED;
}

/* Give up worker i's part of the current round (smu held; the caller has
 * marked it down): in the expert role its pairs keep their owner in powner,
 * so that gather() resends them to other owners (resend()); in the trunk role
 * its cells keep theirs in tpick (trunk_client.c). The first loss of the
 * request is kept: its error is the request's when no other owner is up. */
void shoal__ec_lose(shoal_expert_client *c, int i, int rc, const char *fmt, ...)
{
    shoal__ec_worker *w = &c->w[i];
    if (c->state != SENT || w->lost || w->answered)
        return;
    w->lost = 1;
    if (!w->lost_sent_ns)
        w->lost_sent_ns = w->sent_ns ? w->sent_ns : shoal__ec_now_ns();
    if (!c->lost_rc) {
        c->lost_rc = rc;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->lost_err, sizeof c->lost_err, fmt, ap);
        va_end(ap);
    }
}

void shoal__ec_count_failover_time(shoal_expert_client *c)
{
    if (!c->round)
        return;
    uint64_t now = shoal__ec_now_ns();
    for (int i = 0; i < c->nw; i++)
        if (c->w[i].lost_sent_ns) {
            c->st.failover_ns += now - c->w[i].lost_sent_ns;
            if (c->cm)
                shoal_cmetrics_failover_time(c->cm, now - c->w[i].lost_sent_ns);
        }
}

int shoal__ec_check_worker(shoal_expert_client *c, int i, int disconnected,
                           int (*others_up)(shoal_expert_client *c, int i), const char *role, const char *part,
                           uint64_t *next_fo)
{
    shoal__ec_worker *w = &c->w[i];
    if (disconnected) {
        if (c->cm)
            shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
        shoal__ec_mark_down(c, i, "disconnected (the worker died?)");
        shoal__ec_lose(c, i, SHOAL_EPEER, "%s worker %s disconnected before answering layer %d (the worker died?)",
                       role, w->name, c->layer);
        return 1;
    }
    /* silent past the failover time: given up if every part of it has
     * another owner up (checked once per round) */
    uint64_t fo_at = w->sent_ns / 1000u + c->failover_us;
    if (!w->fo_checked && shoal__ec_now_us() >= fo_at) {
        w->fo_checked = 1;
        if (others_up(c, i)) {
            if (c->cm)
                shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_TIMEOUT);
            shoal__ec_mark_down(c, i, "no reply within %llu ms (failover)",
                                (unsigned long long)(c->failover_us / 1000u));
            shoal__ec_lose(c, i, SHOAL_ETIMEOUT, "no reply to %slayer %d within %llu ms from %s worker %s", part,
                           c->layer, (unsigned long long)(c->failover_us / 1000u), role, w->name);
            return 1;
        }
    }
    if (!w->fo_checked && fo_at < *next_fo)
        *next_fo = fo_at;
    return 0;
}

/* Can worker i's pairs of this round all go to another owner that is up
 * (smu held)? */
static int others_up(shoal_expert_client *c, int i)
{
    const shoal__ec_worker *w = &c->w[i];
    for (uint32_t p = 0; p < w->npairs; p++) {
        const int32_t *who;
        int n = shoal_owners_of(c->owners, c->layer, c->ids[w->dest[p]], &who), ok = 0;
        for (int q = 0; q < n && !ok; q++)
            ok = who[q] != i && shoal__ec_pickable(c, who[q]);
        if (!ok)
            return 0;
    }
    return 1;
}

/* Queue one frame of a request without copying it: a constant message over
 * the worker's buffer (no free function: zmq allocates nothing for it). */
int shoal__ec_send_frame(void *sock, void *data, size_t len, int more)
{
    zmq_msg_t m;
    zmq_msg_init_data(&m, data, len, NULL, NULL);
    if (zmq_msg_send(&m, sock, (more ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0) {
        int e = errno;
        zmq_msg_close(&m);
        errno = e;
        return -1;
    }
    return 0;
}

/* A disconnect not yet seen by the keeper (smu held): mark that worker down
 * and leave its socket alone (its pending pipe commands, and a
 * reconnection's, allocate: the keeper's). One poll over the monitors' fds
 * of the workers that are up (a monitor read to the end signals the next
 * event), reading only those that have something. Before a pick, so that a
 * worker that just died is not picked. */
void shoal__ec_see_disconnects(shoal_expert_client *c)
{
    int n = 0;
    for (int i = 0; i < c->nw; i++)
        if (atomic_load(&c->w[i].link) == W_UP) {
            c->pidx[n] = i;
            c->pfd[n++] = (struct pollfd){.fd = c->w[i].mfd, .events = POLLIN};
        }
    if (n && poll(c->pfd, (nfds_t)n, 0) > 0)
        for (int j = 0; j < n; j++)
            if (c->pfd[j].revents && shoal__ec_monitor_disconnected(c->w[c->pidx[j]].mon))
                shoal__ec_mark_down(c, c->pidx[j], "disconnected (the worker died?)");
}

/* Send the packed request to every involved worker (smu held, state SENT). */
static void send_all(shoal_expert_client *c)
{
    c->st.requests++;
    for (int i = 0; i < c->nw; i++) {
        c->w[i].answered = 0;
        c->w[i].lost = 0;
        c->w[i].fo_checked = 0;
        c->w[i].mon_hot = 0;
    }
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved || atomic_load(&w->link) == W_UP)
            continue;
        /* picked though down: an expert of its part has no owner up; fail
         * fast (the keeper is bringing it back) -- or, when it went down
         * between the pick and now and every pair has another owner, lose it */
        if (!others_up(c, i)) {
            shoal__ec_fail(c, SHOAL_EPEER,
                           "expert worker %s is down (%s); not sent layer %d, reconnecting in the background", w->name,
                           w->why, c->layer);
            return;
        }
        shoal__ec_lose(c, i, SHOAL_EPEER, "expert worker %s is down (%s); not sent layer %d", w->name, w->why,
                       c->layer);
    }
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved || w->lost)
            continue;
        size_t alen, rlen;
        shoal_proto_tensor_len(w->act16 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32, w->ntok, (uint32_t)c->d, &alen);
        shoal_proto_tensor_len(SHOAL_WIRE_I32, w->npairs, 2, &rlen);
        atomic_store(&w->arr_ns, 0);
        w->sent_ns = shoal__ec_now_ns();
        shoal__ec_busy_sent(c, i, w->sent_ns);
        if (shoal__ec_send_frame(w->sock, w->ctl, w->ctl_len, 1) ||
            shoal__ec_send_frame(w->sock, (void *)w->tx_act, alen, 1) ||
            shoal__ec_send_frame(w->sock, w->route, rlen, 0)) {
            int e = errno;
            if (c->cm)
                shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
            shoal__ec_mark_down(c, i, "cannot send: %s", e == EAGAIN ? "not connected" : zmq_strerror(e));
            if (!others_up(c, i)) {
                shoal__ec_fail(c, SHOAL_EPEER, "expert worker %s: cannot send layer %d: %s", w->name, c->layer,
                               e == EAGAIN ? "not connected (the worker is down?)" : zmq_strerror(e));
                return;
            }
            shoal__ec_lose(c, i, SHOAL_EPEER, "expert worker %s: cannot send layer %d: %s", w->name, c->layer,
                 e == EAGAIN ? "not connected (the worker is down?)" : zmq_strerror(e));
            continue; /* its pairs go to other owners (gather) */
        }
        c->st.messages++;
        c->st.pairs += w->npairs;
        c->st.bytes_out += w->ctl_len + alen + rlen;
        w->bytes_out = w->ctl_len + alen + rlen;
        if (w->early) { /* the reply may come before gather(): have the keeper time it */
            atomic_store(&w->obs, 1);
            watch(c, i, 1);
        }
    }
}

/* One message from involved worker i during gather() (smu held). Takes
 * ownership of parts. */
static void on_reply(shoal_expert_client *c, int i, zmq_msg_t *parts, int np, int truncated)
{
    shoal__ec_worker *w = &c->w[i];
    shoal__ec_busy_answered(c, i); /* it answers */
    uint64_t t_recv = shoal__ec_now_ns();
    shoal_frame f[SHOAL_PROTO_MAX_FRAMES];
    size_t bytes = 0;
    for (int j = 0; j < np; j++) {
        f[j] = (shoal_frame){zmq_msg_data(&parts[j]), zmq_msg_size(&parts[j])};
        bytes += f[j].len;
    }
    /* a HELLO answer (to an old probe, or unsolicited) is not decoded here:
     * decoding one allocates its ranges, and this is the forward's thread.
     * Every control frame is [type, rid, body]: 0x93, then the type's byte. */
    if (!truncated && f[0].len >= 2 && f[0].data[0] == 0x93 && f[0].data[1] == SHOAL_MSG_HELLO) {
        shoal__ec_close_parts(parts, np);
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
    if (!drc && (m.type == SHOAL_MSG_HELLO || m.type == SHOAL_MSG_PONG)) { /* an answer to an old probe */
        shoal_proto_msg_clear(&m);
        shoal__ec_close_parts(parts, np);
        return;
    }
    c->st.bytes_in += bytes;
    int current = c->state == SENT && !w->answered && !w->lost && m.rid == w->rid;
    int bad = drc || m.type != SHOAL_MSG_EXPERT_RESULT || m.result.y.dtype != SHOAL_WIRE_BF16 ||
              m.result.y.rows != w->npairs || m.result.y.cols != (uint32_t)c->d;
    if (c->cm && !current)
        shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_STALE);
    if (c->cm && current && bad)
        shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_ERROR);
    if (!current) {
        c->st.late_replies++; /* a reply to a request that already failed (or junk) */
    } else if (drc) {
        shoal__ec_mark_down(c, i, "malformed reply: %s", why);
        shoal__ec_lose(c, i, SHOAL_EPROTO, "expert worker %s: malformed reply to layer %d: %s", w->name, c->layer, why);
    } else if (m.type == SHOAL_MSG_ERROR) {
        shoal__ec_mark_down(c, i, "answered ERROR %s", shoal_perr_name((int)m.error.code));
        shoal__ec_lose(c, i, shoal_perr_to_err((int)m.error.code), "expert worker %s refused layer %d: %s: %s", w->name,
                       c->layer, shoal_perr_name((int)m.error.code), m.error.message);
    } else if (m.type != SHOAL_MSG_EXPERT_RESULT) {
        shoal__ec_mark_down(c, i, "answered a request with %s", shoal_msg_type_name(m.type));
        shoal__ec_lose(c, i, SHOAL_EPROTO, "expert worker %s answered layer %d with %s", w->name, c->layer,
             shoal_msg_type_name(m.type));
    } else if (bad) {
        shoal__ec_mark_down(c, i, "reply of the wrong shape");
        shoal__ec_lose(c, i, SHOAL_EPROTO, "expert worker %s: layer %d reply is %s [%u, %u], expected bf16 [%u, %d]",
                       w->name, c->layer, shoal_wire_dtype_name(m.result.y.dtype), m.result.y.rows, m.result.y.cols,
                       w->npairs, c->d);
    } else {
        w->queue_us = m.result.queue_us;
        w->compute_us = m.result.compute_us;
        /* the reply may have waited for the shared experts: count the round
         * trip to its arrival when the keeper saw it */
        uint64_t arr = atomic_load(&w->arr_ns);
        w->rtt_ns = (arr >= w->sent_ns && arr <= t_recv ? arr : t_recv) - w->sent_ns;
        c->st.worker_queue_us += m.result.queue_us;
        c->st.worker_compute_us += m.result.compute_us;
        if (c->cm) {
            shoal_cmetrics_xchg x = {.tokens = w->ntok, .pairs = w->npairs, .experts = w->nexperts,
                                     .bytes_out = w->bytes_out, .bytes_in = bytes, .rtt_ns = w->rtt_ns,
                                     .queue_us = m.result.queue_us, .compute_us = m.result.compute_us};
            shoal_cmetrics_exchange(c->cm, i, c->layer, &x);
        }
        c->last_answer = i;
        /* into (token, slot) order now, while later replies are on their way
         * (a request that fails after this returns its error, y unspecified) */
        size_t row = (size_t)c->d * 2;
        const uint8_t *src = m.result.y.data;
        for (uint32_t p = 0; p < w->npairs; p++) {
            memcpy(c->y + (size_t)w->dest[p] * c->d, src + (size_t)p * row, row);
            c->powner[w->dest[p]] = -1; /* done */
        }
        w->answered = 1;
    }
    shoal_proto_msg_clear(&m);
    shoal__ec_close_parts(parts, np);
}

/* Wait for every involved worker's reply, a failure or the deadline (smu
 * held, state SENT). The wait is a poll() over the sockets' ZMQ_FD: a
 * non-blocking receive that finds nothing has processed the socket's pending
 * commands, after which its ZMQ_FD signals the next arrival -- so after the
 * first pass only the sockets whose fd signalled are received from (an empty
 * receive is a system call or two in zmq), and all of them again only when a
 * poll times out (its 50 ms cap: a missed wake-up could only delay). */
static void wait_replies(shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++) { /* from here on, arrivals are timed here */
        int one = 1;
        c->w[i].sock_hot = 1;
        if (c->w[i].involved && atomic_compare_exchange_strong(&c->w[i].obs, &one, 0))
            watch(c, i, 0);
    }
    for (int first = 1;; first = 0) {
        int n = 0;
        uint64_t next_fo = UINT64_MAX; /* the earliest failover time still to check */
        for (int i = 0; i < c->nw && c->state == SENT; i++) {
            shoal__ec_worker *w = &c->w[i];
            if (!w->involved || w->answered || w->lost)
                continue;
            zmq_msg_t parts[SHOAL_PROTO_MAX_FRAMES];
            int np, truncated;
            if (w->sock_hot || w->mon_hot) { /* a reply is read before its worker's disconnect */
                w->sock_hot = 0;
                while (c->state == SENT && !w->answered && !w->lost &&
                       (np = shoal__ec_recv_parts(w->sock, parts, &truncated)) > 0)
                    on_reply(c, i, parts, np, truncated);
            }
            if (first)
                w->early = w->answered;
            /* when the next reply is to be timed by the keeper, read until a
             * receive finds nothing: that leaves the socket's fd to signal it */
            while (c->state == SENT && w->answered && w->early &&
                   (np = shoal__ec_recv_parts(w->sock, parts, &truncated)) > 0)
                on_reply(c, i, parts, np, truncated);
            if (c->state != SENT || w->answered || w->lost)
                continue;
            if (shoal__ec_check_worker(c, i, w->mon_hot && shoal__ec_monitor_disconnected(w->mon), others_up, "expert",
                                       "", &next_fo))
                continue;
            w->mon_hot = 0;
            c->pidx[n] = i;
            c->pfd[n++] = (struct pollfd){.fd = w->fd, .events = POLLIN};
            c->pidx[n] = i;
            c->pfd[n++] = (struct pollfd){.fd = w->mfd, .events = POLLIN};
        }
        if (c->state != SENT || n == 0)
            return;
        uint64_t now = shoal__ec_now_us();
        if (now >= c->deadline_us) {
            size_t at = 0;
            char names[768] = "";
            for (int i = 0; i < c->nw && at < sizeof names; i++)
                if (c->w[i].involved && !c->w[i].answered && !c->w[i].lost) {
                    at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? ", " : "", c->w[i].name);
                    if (c->cm)
                        shoal_cmetrics_failure_add(c->cm, i, SHOAL_CMETRICS_TIMEOUT);
                    shoal__ec_mark_down(c, i, "no reply within %d ms", c->o.timeout_ms);
                }
            shoal__ec_fail(c, SHOAL_ETIMEOUT, "no reply to layer %d within %d ms from expert worker %s", c->layer,
                 c->o.timeout_ms, names);
            return;
        }
        /* capped, so that a missed wake-up could only delay, never hang */
        uint64_t until = next_fo < c->deadline_us ? (next_fo > now ? next_fo : now) : c->deadline_us;
        uint64_t ms = (until - now + 999) / 1000;
        int pr = poll(c->pfd, (nfds_t)n, ms > 50 ? 50 : (int)ms);
        if (pr < 0 && errno != EINTR)
            usleep(1000);
        for (int j = 0; j < n; j += 2) {
            shoal__ec_worker *w = &c->w[c->pidx[j]];
            w->sock_hot = pr <= 0 || c->pfd[j].revents; /* nothing signalled: look at every socket */
            w->mon_hot = c->pfd[j + 1].revents != 0;
        }
    }
}

/* ---- the backend ------------------------------------------------------------ */

/* One activation row onto the wire: fp32 as is, or (a worker whose products
 * round it anyway, PROTOCOL.md 1.7) bf16 with the mu kernels' own rounding,
 * so the worker computes the bits the f32 row gives. dst is 2-byte aligned
 * (a 16-byte header, then rows of even length); the host is little-endian. */
static void pack_row(uint8_t *dst, const float *zt, int d, int bf16)
{
    if (!bf16)
        memcpy(dst, zt, (size_t)d * 4);
    else
        shoal_mu_round_bf16((uint16_t *)(void *)dst, zt, (size_t)d);
}

/* This round's requests from powner (smu held): every pair whose owner is
 * w >= 0 goes to w, in (token, slot) order; the activation rows of each
 * involved worker's tokens are packed from c->z (a worker that has every
 * token shares one packed frame). Sets involved, rids and the control frames. */
static void pack(shoal_expert_client *c)
{
    const int T = c->T, k = c->k, d = c->d;
    if (++c->tag == 0) { /* wrapped: forget old stamps */
        memset(c->seen, 0, sizeof *c->seen * (size_t)c->E);
        c->tag = 1;
    }
    for (int i = 0; i < c->nw; i++) {
        c->w[i].ntok = c->w[i].npairs = c->w[i].nexperts = 0;
        c->w[i].last_t = -1;
        c->w[i].involved = 0;
    }
    for (int t = 0; t < T; t++)
        for (int s = 0; s < k; s++) {
            int32_t o = c->powner[(size_t)t * k + s], e = c->ids[(size_t)t * k + s];
            if (o < 0)
                continue;
            shoal__ec_worker *w = &c->w[o];
            if (w->last_t != t) { /* first pair of this token for w: its next activation row */
                w->last_t = t;
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
    /* the activation rows: a worker that has every token gets the same frame
     * as any other such worker of its wire dtype, packed once (always so in
     * decode, T = 1); the others get their own tokens' rows, in token order */
    const uint8_t *all[2] = {NULL, NULL};
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved)
            continue;
        const int bf16 = w->act16;
        const size_t row = (size_t)d * (bf16 ? 2 : 4);
        if (w->ntok == (uint32_t)T && all[bf16]) {
            w->tx_act = all[bf16];
            continue;
        }
        uint32_t r = 0;
        for (uint32_t p = 0, last = UINT32_MAX; p < w->npairs; p++) {
            uint32_t t = (uint32_t)w->dest[p] / (uint32_t)k;
            if (t != last) {
                last = t;
                pack_row(w->act + SHOAL_PROTO_TENSOR_HDR + (size_t)r++ * row, c->z + (size_t)t * d, d, bf16);
            }
        }
        shoal_proto_tensor_hdr(w->act, bf16 ? SHOAL_WIRE_BF16 : SHOAL_WIRE_F32, w->ntok, (uint32_t)d);
        w->tx_act = w->act;
        if (w->ntok == (uint32_t)T)
            all[bf16] = w->act;
    }
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->involved)
            continue;
        w->rid = ++c->next_rid;
        shoal_proto_tensor_hdr(w->route, SHOAL_WIRE_I32, w->npairs, 2);
        if (shoal_proto_enc_batch(w->ctl, sizeof w->ctl, &w->ctl_len, w->rid, (uint32_t)c->layer, SHOAL_WIRE_BF16))
            SHOAL_PANIC("EXPERT_BATCH control does not fit");
    }
}

/* The live mask of a pick (smu held): the workers that are up (here and on
 * the sibling client's link). */
static void live_mask(shoal_expert_client *c)
{
    for (int i = 0; i < c->nw; i++)
        c->live[i] = shoal__ec_pickable(c, i);
}

/* Failover (smu held, state SENT, after a round in which every involved
 * worker answered or was lost): the pairs still owned by a lost worker go to
 * other owners that are up, picked as in submit() among them, in a new round
 * under the same deadline. With an expert that has no other owner up, the
 * request fails with the first loss's error. */
static void resend(shoal_expert_client *c)
{
    live_mask(c);
    const size_t n = (size_t)c->T * (size_t)c->k;
    int m = 0;
    for (size_t p = 0; p < n; p++) {
        if (c->powner[p] < 0)
            continue;
        int32_t e = c->ids[p];
        const int32_t *who;
        int no = shoal_owners_of(c->owners, c->layer, e, &who), ok = 0;
        for (int q = 0; q < no && !ok; q++)
            ok = c->live[who[q]];
        if (!ok) {
            shoal__ec_fail(c, c->lost_rc ? c->lost_rc : SHOAL_EPEER, "%s%s", c->lost_err,
                           no > 1 ? " (and no other owner of that expert is up)" : "");
            return;
        }
        c->rs_ids[m++] = e;
    }
    shoal_owners_pick(c->owners, c->layer, m, 1, c->rs_ids, c->live, c->pick);
    uint64_t now = shoal__ec_now_ns();
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->lost)
            continue;
        c->st.failovers++;
        SHOAL_WARN("expert worker %s lost at layer %d after %.1f ms (%s): its %u pairs resent to other owners",
                   w->name, c->layer, (double)(now - w->sent_ns) * 1e-6, w->why, w->npairs);
        if (c->cm)
            shoal_cmetrics_failover(c->cm, i, w->npairs);
    }
    for (size_t p = 0; p < n; p++)
        if (c->powner[p] >= 0) {
            int32_t from = c->powner[p];
            c->powner[p] = c->pick[c->ids[p]];
            if (c->cm)
                shoal_cmetrics_takeover(c->cm, from, c->powner[p], 1);
        }
    c->st.resent_pairs += (uint64_t)m;
    c->round++;
    pack(c);
    send_all(c);
}

static int submit(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    if (c->state != IDLE) /* only this thread writes state */
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: submit while a request is outstanding");
    if (layer < 0 || layer >= c->L || !c->cfg->is_moe[layer])
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: layer %d is not an MoE layer", layer);
    if (T < 1 || T > c->o.max_tokens || k != c->k)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: T = %d (max %d), k = %d (model %d)", T,
                             c->o.max_tokens, k, c->k);
    for (int t = 0; t < T; t++)
        for (int s = 0; s < k; s++) {
            int32_t e = ids[(size_t)t * k + s];
            if (e < 0 || e >= c->E || (s && e <= ids[(size_t)t * k + s - 1]))
                return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: token %d slot %d: expert id %d out "
                                     "of range or not ascending", t, s, (int)e);
        }
    /* the request buffers may still be read by zmq until the previous
     * request's replies came; the lock also waits out a keeper pass */
    pthread_mutex_lock(&c->smu);
    for (int i = 0; i < c->nw; i++) {
        c->w[i].lost = 0;
        c->w[i].lost_sent_ns = 0;
        c->w[i].sent_ns = 0;
    }
    c->z = z;
    c->ids = ids;
    c->T = T;
    c->layer = layer;
    shoal__ec_see_disconnects(c);
    live_mask(c);
    /* one owner per expert, balanced over the owners that are up */
    shoal_owners_pick(c->owners, layer, T, k, ids, c->live, c->pick);
    for (size_t p = 0; p < (size_t)T * (size_t)k; p++)
        c->powner[p] = c->pick[ids[p]];
    if (c->cm && shoal_owners_replicated(c->owners)) /* pairs of replicated experts, per picked worker */
        for (size_t p = 0; p < (size_t)T * (size_t)k; p++) {
            const int32_t *who;
            if (shoal_owners_of(c->owners, layer, ids[p], &who) > 1)
                shoal_cmetrics_replica_pick(c->cm, c->powner[p], 1);
        }
    c->round = 0;
    c->lost_rc = 0;
    c->lost_err[0] = 0;
    pack(c);
    c->rc = 0;
    c->err[0] = 0;
    c->deadline_us = shoal__ec_now_us() + (uint64_t)c->o.timeout_ms * 1000u;
    c->req_seq++;
    c->state = SENT;
    send_all(c); /* a failure is reported by gather() */
    return 0;    /* smu stays held until gather() */
}

static int gather(void *self, uint16_t *y, char *err, size_t errlen)
{
    shoal_expert_client *c = self;
    if (c->state == IDLE)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert client: gather without submit");
    uint64_t t0 = shoal__ec_now_us();
    c->y = y;
    /* rounds: every involved worker answers or is lost; the lost ones' pairs
     * are resent to other owners (resend), until all are answered, the
     * deadline passes or an expert has no owner left */
    while (c->state == SENT) {
        wait_replies(c);
        int left = 0;
        for (size_t p = 0; p < (size_t)c->T * (size_t)c->k && !left; p++)
            left = c->powner[p] >= 0;
        if (c->state != SENT || !left)
            break;
        resend(c);
    }
    int rc = c->state == FAILED ? c->rc : 0;
    c->rc = rc;
    if (!rc)
        shoal__ec_count_failover_time(c);
    if (c->cm)
        shoal_cmetrics_layer_wait(c->cm, c->layer, (shoal__ec_now_us() - t0) * 1000u, rc ? -1 : c->last_answer);
    if (rc) {
        shoal_err_set(err, errlen, rc, "%s", c->err);
    } else {
        for (int i = 0; i < c->nw; i++) /* hints sent before this request have left */
            for (int b = 0; b < 2; b++)
                if (c->w[i].involved && c->w[i].hint_req[b] && c->w[i].hint_req[b] < c->req_seq)
                    c->w[i].hint_req[b] = 0;
    }
    c->state = IDLE;
    c->st.wait_s += (double)(shoal__ec_now_us() - t0) * 1e-6;
    pthread_mutex_unlock(&c->smu);
    return rc;
}

/* Split the hinted experts of `layer` by owner and send one PREFETCH notice
 * to each worker that acts on hints (PROTOCOL.md §3.6), right after this
 * request's batches (forward thread, smu held, between submit and gather).
 * A replicated expert is hinted only to the owner a later exchange would
 * pick for it: the pick of submit() (owners.h) on the hinted experts among
 * the owners that are up -- the same choice when the guess is a decode
 * token's experts. Fire and forget: nothing waits for it; a worker down, or
 * both of its hint buffers still possibly in ZeroMQ's hands, just gets no
 * hint (counted as dropped). Never allocates. */
static void hint(void *self, int layer, const int32_t *experts, int n)
{
    shoal_expert_client *c = self;
    if (c->state != SENT || layer < 0 || layer >= c->L || !c->cfg->is_moe[layer] || n < 1)
        return;
    for (int i = 0; i < c->nw; i++) {
        c->w[i].hint_n = 0;
        c->live[i] = shoal__ec_pickable(c, i);
    }
    shoal_owners_pick(c->owners, layer, n, 1, experts, c->live, c->hpick);
    for (int j = 0; j < n; j++) { /* ascending in, ascending out per worker */
        if (experts[j] < 0 || experts[j] >= c->E)
            continue;
        shoal__ec_worker *w = &c->w[c->hpick[experts[j]]];
        if (w->prefetch && w->hint_n < SHOAL_PROTO_MAX_PREFETCH &&
            (!w->hint_n || (uint32_t)experts[j] > w->hint_ids[w->hint_n - 1]))
            w->hint_ids[w->hint_n++] = (uint32_t)experts[j];
    }
    for (int i = 0; i < c->nw; i++) {
        shoal__ec_worker *w = &c->w[i];
        if (!w->hint_n)
            continue;
        int b = !w->hint_req[0] ? 0 : !w->hint_req[1] ? 1 : -1;
        size_t len;
        if (b < 0 || atomic_load(&w->link) != W_UP ||
            shoal_proto_enc_prefetch(w->hint_ctl[b], 32 + 5 * (size_t)c->E, &len, 0, (uint32_t)layer, w->hint_ids,
                                     w->hint_n) ||
            shoal__ec_send_frame(w->sock, w->hint_ctl[b], len, 0)) {
            c->st.hints_dropped++;
            continue;
        }
        w->hint_req[b] = c->req_seq;
        c->st.hints++;
        c->st.bytes_out += len;
    }
}

static void vt_close(void *self)
{
    shoal_expert_client_close(self);
}

static const shoal_experts_vt client_vt = {.submit = submit, .gather = gather, .close = vt_close, .hint = hint};

shoal_experts shoal_expert_client_backend(shoal_expert_client *c)
{
    return (shoal_experts){.vt = &client_vt, .self = c};
}

/* ---- the requests, for callers ---------------------------------------------- */

void shoal_expert_client_set_timeout(shoal_expert_client *c, int timeout_ms)
{
    pthread_mutex_lock(&c->smu);
    c->o.timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
    if (c->o.failover_ms <= 0)
        c->failover_us = (uint64_t)(c->o.timeout_ms / 3 < 1000 ? (c->o.timeout_ms / 3 > 0 ? c->o.timeout_ms / 3 : 1)
                                                              : 1000) * 1000u;
    pthread_mutex_unlock(&c->smu);
}

void shoal_expert_client_get_stats(shoal_expert_client *c, shoal_expert_client_stats *out)
{
    pthread_mutex_lock(&c->smu);
    *out = c->st;
    for (int i = 0; i < c->nw; i++) {
        out->downs += c->w[i].downs;
        out->recoveries += c->w[i].recoveries;
    }
    pthread_mutex_unlock(&c->smu);
}

void shoal_expert_client_reset_stats(shoal_expert_client *c)
{
    pthread_mutex_lock(&c->smu);
    memset(&c->st, 0, sizeof c->st);
    for (int i = 0; i < c->nw; i++)
        c->w[i].downs = c->w[i].recoveries = 0;
    pthread_mutex_unlock(&c->smu);
}

int shoal_expert_client_last(shoal_expert_client *c, int w, uint64_t *queue_us, uint64_t *compute_us,
                             uint64_t *rtt_ns)
{
    pthread_mutex_lock(&c->smu);
    int in = w >= 0 && w < c->nw && c->state == IDLE && c->rc == 0 && c->w[w].involved && c->w[w].answered;
    if (in) {
        *queue_us = c->w[w].queue_us;
        *compute_us = c->w[w].compute_us;
        *rtt_ns = c->w[w].rtt_ns;
    }
    pthread_mutex_unlock(&c->smu);
    return in;
}
