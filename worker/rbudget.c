/* rbudget: per-peer and total bytes of replies held by ZeroMQ (see rbudget.h).
 *
 * Why the count comes from the message's free function: ZeroMQ's high-water
 * marks count messages, not bytes, and a ROUTER never says how much it holds
 * for one peer. A reply frame allocated here and sent with zmq_msg_init_data
 * is released by ZeroMQ exactly when it lets go of it -- after its last byte
 * went to the kernel (plain and ipc links write the frame in place), or when
 * the connection is dropped -- so the count is the bytes of replies that
 * really sit in this process. (A CURVE link encrypts the frame into a copy of
 * ZeroMQ's own when it starts writing it and releases ours: at most one such
 * copy per connection, which the count does not see; PROTOCOL.md section 6.) */
#include "worker/rbudget.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"

#define NSLOTS 256 /* peers that may hold unreleased replies at once */
#define HDR 64     /* the data frame starts 64 bytes into its block (alignment) */
/* Blocks from this size up are mapped and unmapped directly, so a released
 * reply's memory goes back to the system at once: from malloc it could stay in
 * the heap (glibc raises its mmap threshold up to 32 MiB as large blocks are
 * freed), and the process would keep the peak of the budget for good. */
#define MAP_MIN (256u << 10)

typedef struct {
    uint8_t id[255];
    size_t idlen; /* 0: free */
    _Atomic uint64_t held;
} slot;

struct shoal_rbudget {
    shoal_rbudget_opts o;
    _Atomic uint64_t held;
    uint64_t peak, refused, admitted; /* the socket thread's */
    slot s[NSLOTS];
};

typedef struct {
    shoal_rbudget *b;
    slot *p;
    size_t len;
    size_t mapped; /* bytes of the mapping, 0: from posix_memalign */
} hdr;

int shoal_rbudget_open(shoal_rbudget **out, const shoal_rbudget_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->peer_bytes || !o->total_bytes)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "reply budget: the per-peer and total limits must be > 0");
    shoal_rbudget *b = shoal_xcalloc(1, sizeof *b);
    b->o = *o;
    *out = b;
    return 0;
}

void shoal_rbudget_close(shoal_rbudget *b)
{
    free(b);
}

/* The slot of this peer, or a free one (idle: holding nothing) claimed for it;
 * NULL when every slot holds replies of other peers. Socket thread only: only
 * it claims, and a slot holding nothing has no live message pointing at it. */
static slot *find(shoal_rbudget *b, const uint8_t *peer, size_t peerlen, int claim)
{
    slot *idle = NULL;
    if (peerlen > sizeof b->s[0].id)
        peerlen = sizeof b->s[0].id;
    for (int i = 0; i < NSLOTS; i++) {
        slot *p = &b->s[i];
        if (p->idlen && p->idlen == (peerlen ? peerlen : 1) && !memcmp(p->id, peer, peerlen))
            return p;
        if (!idle && atomic_load(&p->held) == 0)
            idle = p;
    }
    if (!claim || !idle)
        return NULL;
    memcpy(idle->id, peer, peerlen);
    idle->idlen = peerlen ? peerlen : 1; /* an empty id is a peer too */
    return idle;
}

static void nap_100us(void)
{
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
}

int shoal_rbudget_alloc(shoal_rbudget *b, const uint8_t *peer, size_t peerlen, size_t len, void **data, void **hint,
                        char *why, size_t whylen)
{
    *data = *hint = NULL;
    if (whylen)
        why[0] = 0;
    unsigned waited = 0;
    for (;;) {
        slot *p = find(b, peer, peerlen, 1);
        uint64_t ph = p ? atomic_load(&p->held) : 0, th = atomic_load(&b->held);
        int over_peer = p && ph && ph + len > b->o.peer_bytes;
        int over_total = th && th + len > b->o.total_bytes;
        if (p && !over_peer && !over_total) {
            void *blk = NULL;
            size_t mapped = 0;
            if (len > SIZE_MAX / 2)
                return shoal_err_set(why, whylen, SHOAL_ENOMEM, "cannot allocate the %zu-byte reply", len);
            if (HDR + len >= MAP_MIN) {
                size_t pg = (size_t)sysconf(_SC_PAGESIZE);
                mapped = (HDR + len + pg - 1) / pg * pg;
                blk = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (blk == MAP_FAILED)
                    return shoal_err_set(why, whylen, SHOAL_ENOMEM, "cannot map the %zu-byte reply", len);
            } else if (posix_memalign(&blk, HDR, HDR + len)) {
                return shoal_err_set(why, whylen, SHOAL_ENOMEM, "cannot allocate the %zu-byte reply", len);
            }
            hdr *h = blk;
            *h = (hdr){b, p, len, mapped};
            atomic_fetch_add(&p->held, len);
            uint64_t now = atomic_fetch_add(&b->held, len) + len;
            if (now > b->peak)
                b->peak = now;
            b->admitted++;
            *data = (uint8_t *)blk + HDR;
            *hint = h;
            return 0;
        }
        if (waited >= b->o.wait_us) {
            b->refused++;
            if (!p)
                return shoal_err_set(why, whylen, SHOAL_EBUSY,
                                     "reply of %zu bytes refused: %d other connections hold unread replies", len,
                                     NSLOTS);
            if (over_peer)
                return shoal_err_set(why, whylen, SHOAL_EBUSY,
                                     "reply of %zu bytes refused: this connection holds %llu bytes of unread "
                                     "replies, the limit is %llu per connection (--peer-reply-mb)",
                                     len, (unsigned long long)ph, (unsigned long long)b->o.peer_bytes);
            return shoal_err_set(why, whylen, SHOAL_EBUSY,
                                 "reply of %zu bytes refused: the worker holds %llu bytes of unread replies, the "
                                 "limit is %llu for all connections (--reply-budget-mb)",
                                 len, (unsigned long long)th, (unsigned long long)b->o.total_bytes);
        }
        nap_100us();
        waited += 100;
    }
}

void shoal_rbudget_release(void *data, void *hint)
{
    (void)data;
    hdr *h = hint;
    if (!h)
        return;
    atomic_fetch_sub(&h->p->held, h->len);
    atomic_fetch_sub(&h->b->held, h->len);
    if (h->mapped)
        munmap(h, h->mapped);
    else
        free(h);
}

void shoal_rbudget_stats_get(shoal_rbudget *b, shoal_rbudget_stats *out)
{
    *out = (shoal_rbudget_stats){.held = atomic_load(&b->held), .peak = b->peak, .refused = b->refused,
                                 .admitted = b->admitted};
}

uint64_t shoal_rbudget_peer_held(shoal_rbudget *b, const uint8_t *peer, size_t peerlen)
{
    slot *p = find(b, peer, peerlen, 0);
    return p ? atomic_load(&p->held) : 0;
}
