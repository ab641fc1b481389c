/* The relay parent's links (relay.h; PROTOCOL.md §3.9). */
#include "worker/relay.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/curve.h"
#include "common/err.h"
#include "common/log.h"

typedef struct {
    char ep[SHOAL_PROTO_MAX_ENDPOINT + 1];
    void *sock;     /* NULL: this worker itself (never a child of itself) */
    int need_hello; /* 1: send HELLO (relay: true) before the next TRUNK_X */
} rpeer;

struct shoal_relay {
    rpeer p[SHOAL_PROTO_MAX_RELAY];
    const char *eps[SHOAL_PROTO_MAX_RELAY];
    int n;
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    char id[SHOAL_PROTO_MAX_ID + 1];
    shoal_wmetrics *wm;
    uint8_t ctl[2048]; /* a TRUNK_X's or HELLO's control frame (64 fwd entries take < 400 bytes) */
    uint64_t logged;
};

static int add_peer(shoal_relay *r, const shoal_relay_opts *o, const shoal_curve_keypair *kp, const char *item,
                    size_t len, char *err, size_t errlen)
{
    char buf[SHOAL_PROTO_MAX_ENDPOINT + 512];
    if (!len || len >= sizeof buf)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: entry %d is empty or too long", r->n + 1);
    if (r->n >= SHOAL_PROTO_MAX_RELAY)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: more than %d peers", SHOAL_PROTO_MAX_RELAY);
    memcpy(buf, item, len);
    buf[len] = 0;
    char *at = strchr(buf, '@'), *key = NULL; /* the first: a Z85 key may hold an @ itself */
    if (at) {
        *at = 0;
        key = at + 1;
    }
    size_t el = strlen(buf);
    if (!el || el > SHOAL_PROTO_MAX_ENDPOINT)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: endpoint '%s' is empty or over %d bytes", buf,
                             SHOAL_PROTO_MAX_ENDPOINT);
    for (size_t i = 0; i < el; i++)
        if ((unsigned char)buf[i] <= 0x20 || (unsigned char)buf[i] >= 0x7f)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: endpoint '%s' has a non-printable byte",
                                 buf);
    for (int i = 0; i < r->n; i++)
        if (!strcmp(r->p[i].ep, buf))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: '%s' is listed twice", buf);
    rpeer *p = &r->p[r->n];
    memcpy(p->ep, buf, el + 1);
    r->eps[r->n] = p->ep;
    r->n++;
    if (o->self && !strcmp(buf, o->self))
        return 0; /* this worker: listed so that every worker's list is the same, never sent to */
    char pub[SHOAL_CURVE_Z85] = "";
    int curve = kp && shoal_curve_needed(buf);
    if (curve) {
        if (!key || !*key)
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "--relay-peers: %s needs the peer's public key (ENDPOINT@KEY, a Z85 key or a .pub file)",
                                 buf);
        if (strlen(key) < SHOAL_CURVE_Z85 && shoal_curve_valid(key)) {
            snprintf(pub, sizeof pub, "%s", key);
        } else if (shoal_curve_read_public(pub, key, err, errlen)) {
            return SHOAL_EINVAL;
        }
    }
    p->sock = zmq_socket(o->zctx, ZMQ_DEALER);
    if (!p->sock)
        return shoal_err_set(err, errlen, -errno, "relay peer %s: %s", buf, zmq_strerror(errno));
    int zero = 0, one = 1, hwm = 64;
    zmq_setsockopt(p->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(p->sock, ZMQ_IMMEDIATE, &one, sizeof one); /* a send to a peer not connected fails at once */
    zmq_setsockopt(p->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    if (curve && shoal_curve_set_client(p->sock, kp, pub, err, errlen))
        return SHOAL_EINVAL;
    if (zmq_connect(p->sock, buf))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-peers: cannot connect to %s: %s", buf,
                             zmq_strerror(errno));
    p->need_hello = 1;
    return 0;
}

int shoal_relay_open(shoal_relay **out, const shoal_relay_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->list || !o->zctx || !o->fingerprint)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "relay: list, context and fingerprint are required");
    shoal_relay *r = shoal_xcalloc(1, sizeof *r);
    memcpy(r->fp, o->fingerprint, SHOAL_PROTO_FP_BYTES);
    snprintf(r->id, sizeof r->id, "%s", o->id ? o->id : "");
    r->wm = o->wm;
    shoal_curve_keypair kp;
    int have_kp = 0, rc = 0;
    if (o->curve_secret) {
        if (shoal_curve_read_pair(&kp, o->curve_secret, err, errlen)) {
            free(r);
            return SHOAL_EINVAL;
        }
        have_kp = 1;
    }
    const char *s = o->list;
    while (!rc) {
        const char *c = strchr(s, ',');
        size_t len = c ? (size_t)(c - s) : strlen(s);
        rc = add_peer(r, o, have_kp ? &kp : NULL, s, len, err, errlen);
        if (!c)
            break;
        s = c + 1;
    }
    if (have_kp)
        sodium_memzero(&kp, sizeof kp);
    if (rc) {
        shoal_relay_close(r);
        return rc;
    }
    int socks = 0;
    for (int i = 0; i < r->n; i++)
        socks += r->p[i].sock != NULL;
    SHOAL_INFO("relay: %d peer%s (%d linked, %s)", r->n, r->n == 1 ? "" : "s", socks,
               have_kp ? "CURVE where the link needs it" : "plain links");
    *out = r;
    return 0;
}

void shoal_relay_close(shoal_relay *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->n; i++)
        if (r->p[i].sock)
            zmq_close(r->p[i].sock);
    free(r);
}

int shoal_relay_count(const shoal_relay *r)
{
    return r ? r->n : 0;
}

const char *const *shoal_relay_endpoints(const shoal_relay *r)
{
    return r ? r->eps : NULL;
}

int shoal_relay_check(const shoal_relay *r, const shoal_proto_fwd *fwd, uint32_t n, uint32_t *bad)
{
    for (uint32_t i = 0; i < n; i++)
        if (!r || fwd[i].peer >= r->n || !r->p[fwd[i].peer].sock) {
            *bad = i;
            return -1;
        }
    return 0;
}

static int send_hello(shoal_relay *r, rpeer *p)
{
    shoal_proto_hello h = {.major = SHOAL_PROTO_MAJOR, .minor = SHOAL_PROTO_MINOR, .relay_parent = 1};
    memcpy(h.fingerprint, r->fp, SHOAL_PROTO_FP_BYTES);
    snprintf(h.id, sizeof h.id, "%s", r->id);
    size_t len;
    if (shoal_proto_enc_hello(r->ctl, sizeof r->ctl, &len, 1, &h, 0))
        return -1;
    if (zmq_send(p->sock, r->ctl, len, ZMQ_DONTWAIT) < 0)
        return -1;
    p->need_hello = 0;
    return 0;
}

int shoal_relay_forward(shoal_relay *r, uint64_t xid, uint32_t wait_ms, const shoal_proto_fwd *fwd, uint32_t n,
                        zmq_msg_t *x)
{
    int sent = 0;
    shoal_proto_relay t = {.xid = xid, .wait_ms = wait_ms};
    for (uint32_t e = 0; e < n; e++) {
        if (fwd[e].up != 0)
            continue;
        rpeer *p = r && fwd[e].peer < r->n ? &r->p[fwd[e].peer] : NULL;
        t.nfwd = shoal_proto_fwd_subtree(fwd, n, e, t.fwd);
        size_t len;
        zmq_msg_t copy;
        int ok = p && p->sock && (!p->need_hello || !send_hello(r, p)) &&
                 !shoal_proto_enc_trunk_x(r->ctl, sizeof r->ctl, &len, &t) &&
                 zmq_send(p->sock, r->ctl, len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0;
        if (ok) { /* the first part went: the rest of a multipart message is always accepted */
            zmq_msg_init(&copy);
            zmq_msg_copy(&copy, x); /* a reference to the same bytes */
            if (zmq_msg_send(&copy, p->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&copy);
                ok = 0;
            }
        }
        if (ok) {
            sent++;
            shoal_wmetrics_relay(r->wm, SHOAL_WRELAY_OUT);
        } else {
            shoal_wmetrics_relay(r ? r->wm : NULL, SHOAL_WRELAY_DROPPED);
            if (r && (r->logged < 20 || r->logged % 1000 == 0))
                SHOAL_WARN("relay: TRUNK_X %llu not forwarded to peer %u (%s): %s", (unsigned long long)xid,
                           fwd[e].peer, p ? p->ep : "not in the list",
                           !p || !p->sock ? "no such peer" : zmq_strerror(errno));
            if (r)
                r->logged++;
        }
    }
    return sent;
}

void shoal_relay_drain(shoal_relay *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->n; i++) {
        rpeer *p = &r->p[i];
        if (!p->sock)
            continue;
        if (p->need_hello) /* as soon as the link is up (ZMQ_IMMEDIATE: refused until then), not at the first input */
            send_hello(r, p);
        for (;;) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, p->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            const uint8_t *d = zmq_msg_data(&m);
            /* [type, rid, body]: ERROR is type 2; anything but a HELLO reply means the link lost its HELLO */
            if (zmq_msg_size(&m) >= 2 && d[0] == 0x93 && d[1] == SHOAL_MSG_ERROR) {
                p->need_hello = 1;
                if (r->logged < 20 || r->logged % 1000 == 0)
                    SHOAL_WARN("relay: peer %s answered ERROR; HELLO again before its next input", p->ep);
                r->logged++;
            }
            while (zmq_msg_more(&m)) { /* the rest of a multipart reply */
                zmq_msg_close(&m);
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, p->sock, ZMQ_DONTWAIT) < 0)
                    break;
            }
            zmq_msg_close(&m);
        }
    }
}
