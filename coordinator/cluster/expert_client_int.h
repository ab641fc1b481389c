/* Internals of the expert client (expert_client.h), shared by its files and
 * included by them only: links.c, expert_client.c and trunk_client.c. Not for
 * other modules, nor for the unit test, which goes through expert_client.h.
 *
 * The split. links.c holds the worker links: connect, HELLO and the ownership
 * checks, down and back (the keeper thread: probes with backoff,
 * re-verification, warm-up PINGs), open and close. expert_client.c holds the
 * per-layer expert exchange on the forward thread: submit, gather, hint, the
 * backend vtable and the request's stats; trunk_client.c the trunk step of a
 * client opened in the trunk role, over the same links code.
 *
 * Calls point one way: the exchange calls into the links (shoal__ec_mark_down,
 * and the socket helpers at the end of this header), never the reverse. What
 * the links need of the exchange is data in the shared struct below: the
 * keeper counts stale replies into `st` and times early replies through `obs`
 * and `arr_ns` (armed by the exchange in the keeper's epoll); HELLO probes and
 * batches draw their rids from the one `next_rid`; and open sizes the
 * exchange's buffers (request frames, hint buffers, gather()'s poll set and
 * decoder) and close frees them, since the forward thread must never allocate:
 * all of its memory exists from open on.
 *
 * Threads and locks. The engine's forward thread drives the sockets itself:
 * submit() takes smu, packs and sends every involved worker's EXPERT_BATCH,
 * and returns holding smu; gather() waits on the involved sockets (its own
 * poll over their ZMQ_FD, with the deadline), checks and scatters the replies
 * and releases smu. No hand-off to another thread is on the path of a layer.
 * The keeper thread takes smu only between requests (trylock, never waiting
 * on a request): it drains stale replies and disconnect events, and brings
 * down workers back (probe HELLO with backoff, re-verification, warm-up
 * PINGs). During a request it touches no socket: it only times replies that
 * arrive before gather() (keeper_main).
 * ZeroMQ sockets may move between threads across a full memory barrier; smu
 * is that barrier. `state` is only touched by the forward thread. */
#ifndef SHOAL_EXPERT_CLIENT_INT_H
#define SHOAL_EXPERT_CLIENT_INT_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/epoll.h>
#include <zmq.h>

#include "coordinator/cluster/expert_client.h"
#include "coordinator/cluster/owners.h"
#include "coordinator/cluster/relaytree.h"
#include "proto/proto.h"
#include "proto/tshard.h"

enum { IDLE, SENT, FAILED };         /* the forward thread's request */
enum { W_UP, W_DOWN, W_WARM };       /* a worker's link */

typedef struct {
    char endpoint[256];
    char name[SHOAL_PROTO_MAX_ID + 300]; /* "id (endpoint)" */
    void *sock, *mon;
    int fd, mfd; /* ZMQ_FD of sock and mon: the forward thread's poll */
    shoal_proto_range *owned;
    size_t nowned;
    uint32_t max_tokens;
    char id[SHOAL_PROTO_MAX_ID + 1];
    uint64_t expert_bytes, mem_total;
    /* the link (under smu; `link` also read without it by worker_up) */
    atomic_int link;
    char why[512];            /* why it is down */
    int logged;               /* the keeper logged the current state */
    uint64_t down_us, next_probe_us;
    unsigned backoff_ms;
    int warm_left;            /* PONGs still to come in W_WARM */
    /* arrival of the reply (see observe in keeper_main): obs set by submit(),
     * cleared by whoever sees the reply first; arr_ns written by the keeper */
    atomic_int obs;
    atomic_ullong arr_ns;
    uint64_t probe_rid;       /* rid of the first HELLO sent since it went down (0: none yet) */
    uint64_t downs, recoveries;
    uint64_t refusals;        /* re-HELLOs refused again for the reason already logged (counted, not logged) */
    /* request (forward thread) */
    uint8_t ctl[64];
    size_t ctl_len;
    uint8_t *act;     /* [16 + max_tokens * d * 4] */
    const uint8_t *tx_act; /* the activation frame sent: act, or another worker's act holding the same rows */
    uint8_t *route;   /* [16 + max_tokens * k * 8] */
    int32_t *dest;    /* [max_tokens * k]: destination row t*k + slot of pair i */
    uint32_t ntok, npairs, nexperts;
    int last_t;
    uint64_t rid;
    int involved;
    int lost;     /* involved in this round, its part given up (marked down): resent to other owners */
    int fo_checked; /* the failover time passed this round and was looked at */
    uint64_t lost_sent_ns; /* when its lost part was first sent (time lost per failover) */
    int early;    /* its last reply was already there when gather() began: time the next one's arrival */
    int mon_hot;  /* its monitor's fd polled readable: read the monitor */
    int sock_hot; /* its socket's fd polled readable: receive */
    /* PREFETCH hints (forward thread): sent zero-copy like the requests, so a
     * buffer is reused only once this worker has answered a request sent after
     * it (the socket's pipe is FIFO: ZeroMQ has read the hint by then) */
    int prefetch;          /* its HELLO (1.2+) said it acts on hints */
    uint32_t *hint_ids;    /* [E] */
    uint8_t *hint_ctl[2];  /* [32 + 5 * E] each */
    uint64_t hint_req[2];  /* req_seq of the request the hint followed; 0: free */
    uint32_t hint_n;
    /* trunk rows it announced (HELLO 1.3; owned) and, in the trunk role, its
     * part of the current TRUNK_BATCH (forward thread) */
    shoal_proto_trows *trunk;
    size_t ntrunk;
    shoal_proto_trows *tseg; /* [SHOAL_PROTO_MAX_TSEGS] */
    int32_t tjob[SHOAL_PROTO_MAX_TSEGS];
    int32_t tcell[SHOAL_PROTO_MAX_TSEGS][2]; /* the cells (first, last, of its job's matrix) a segment spans */
    uint32_t ntseg;
    int chain;                /* its HELLO (1.4+): it takes chained segments */
    /* bf16 activations (PROTOCOL.md 1.7; links.c set_wire16): act16, its
     * EXPERT_BATCH act; trunk16, a TRUNK_BATCH x whose matrices are all BF16.
     * Set at each accepted HELLO (smu held); read by the forward thread. */
    int act16, trunk16;
    int t16;                  /* this round's TRUNK_BATCH x is bf16 (trunk role, forward thread) */
    shoal_proto_tchain tchain[SHOAL_PROTO_MAX_TCHAIN]; /* chained segments, after tseg in its reply */
    int32_t tcjob[SHOAL_PROTO_MAX_TCHAIN];
    int32_t tccell[SHOAL_PROTO_MAX_TCHAIN][2];
    uint32_t ntchain;
    /* relay tree (PROTOCOL.md §3.9; links.c set_relay at each accepted
     * HELLO): its index in its own announced relay list (-1: it does not
     * relay, or its list does not name it under our endpoint) and a hash of
     * that list (trees join only workers with the same list); relay_down: a
     * relayed request through it failed, so it relays no more (forward
     * thread). This round (trunk role): rrole 0 direct, 1 a root, 2 relayed;
     * rparent the worker index of its parent (-1: a root); rl its keys. */
    int relay_idx;
    uint64_t relay_hash;
    int relay_down;
    int rrole, rparent;
    shoal_proto_relay rl;
    uint64_t trows;          /* sum of its segments' rows */
    uint64_t tweight;        /* bytes of those rows of the matrices (metrics) */
    uint8_t *tctl;           /* [TCTL_CAP] its TRUNK_BATCH control frame */
    size_t tctl_len;
    /* reply */
    int answered;
    uint64_t queue_us, compute_us;
    uint64_t sent_ns, bytes_out, rtt_ns; /* this request */
} shoal__ec_worker;

#define SHOAL__EC_RTCACHE 8 /* relay schedules kept (greedy) */

struct shoal_expert_client {
    shoal_expert_client_opts o; /* o.fingerprint points at fp (the caller's may be gone after open) */
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    const shoal_k3cfg *cfg;
    int nw, d, k, E, L;
    shoal__ec_worker *w;
    shoal_owners *owners; /* who owns each (layer, expert); replicas allowed */
    int32_t *pick;        /* [E]: this exchange's chosen owner per expert (forward thread) */
    void *zctx;
    struct pollfd *pfd; /* [2 * nw]: gather()'s poll set */
    int *pidx;          /* [2 * nw]: worker of each pfd entry */
    shoal_proto_scratch *dec; /* gather()'s reply decoder (allocates nothing) */
    pthread_mutex_t smu; /* sockets, links, stats; held from submit() to the end of gather() */
    pthread_mutex_t wmu; /* the workers' `why` strings (held briefly: /health reads them mid-request) */
    /* keeper thread */
    pthread_t keeper;
    int keeper_started;
    int kfd;             /* eventfd: quit */
    int epfd;            /* the keeper's epoll: kfd, and each worker's ZMQ_FD while armed */
    atomic_int quit;
    struct epoll_event *kev; /* [1 + nw] */
    /* the request (forward thread; read by others under smu between requests) */
    int state;
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
    uint16_t *y;        /* gather()'s output: each reply is scattered into it as it arrives */
    uint64_t req_seq;   /* requests submitted (never reset) */
    /* failover (expert_client.c, forward thread): the request's inputs, kept
     * until gather() returns (the engine leaves z and ids alone until then,
     * engine/experts.h), each pair's worker in this round (-1: answered),
     * the live mask of the pick, the first loss of the request (its error
     * is the request's when no other owner is up) and the round */
    const float *z;
    const int32_t *ids;
    int T;
    int32_t *powner;    /* [max_tokens * k], pair t*k+s */
    int32_t *rs_ids;    /* [max_tokens * k]: the experts to resend */
    uint8_t *live;      /* [nw] */
    int32_t *hpick;     /* [E]: the prefetch hints' owner per expert */
    int round;
    int lost_rc;
    char lost_err[1024];
    uint64_t failover_us; /* a silent worker whose pairs all have another live owner is given up after this */
    /* the other client over the same workers (the expert client and the trunk
     * client of one coordinator, shoal_expert_client_set_sibling), or NULL: a
     * worker down on its link is not picked among replicas here either, so a
     * stopped worker costs one failover time per step, not one per client.
     * Read by the forward thread only (its link is atomic). */
    shoal_expert_client *sib;
    /* trunk role (trunk_client.c): the row-shardable matrices, which are
     * remote, their row cells with the owners of each (proto/tshard.h; by
     * matrix then row: matrix k's are cells[cbeg[k] .. cbeg[k] + ccnt[k]),
     * at most maxc), the names sorted for lookup, the shared input frame and
     * the current request: its jobs and, per job j and cell i of its matrix,
     * tpick[j * maxc + i] = the owner entry (index into cown) computing the
     * cell in this round, -1 once its rows arrived; the pick's scratch */
    shoal_tshard_mat *tmats;
    int ntmats;
    uint8_t *tremote;
    shoal_tshard_cell *cells;
    size_t ncells;
    shoal_tshard_owner *cown;
    size_t ncown;
    int32_t *cbeg, *ccnt, *tsorted;
    int maxc;
    int32_t *tpick;  /* [SHOAL_RMAT_MAX_JOBS * maxc] */
    int32_t *tfrom;  /* [SHOAL_RMAT_MAX_JOBS * maxc]: a resent cell's lost worker (-1: done) */
    uint8_t *twant;  /* [2 * maxc]: the pick's retry, then the resend's cells */
    uint8_t *tup;    /* [nw]: up on this client's link, not lost (the pick's second choice) */
    uint64_t *tload; /* [nw] */
    uint8_t *tx;     /* [16 + max_tokens * max cols * 4] */
    size_t tx_cap, txlen;
    /* the same input rounded to bf16 (1.7; packed when some worker gets it:
     * its trunk16 and every matrix of its part BF16, tbf16[k]) */
    uint8_t *tx16;   /* [16 + max_tokens * max cols * 2] */
    size_t tx16len;
    uint8_t *tbf16;  /* [ntmats]: matrix k is stored BF16 (its mu product rounds x) */
    const void *tjobs; /* the submitted shoal_rmat_job[] (borrowed until gather returns) */
    int ntjobs, tT;
    uint64_t trunk_requests, trunk_messages;
    /* relay tree (trunk role, forward thread): the last xid used (a random
     * 62-bit start), requests sent without x, those resent directly */
    uint64_t next_xid;
    uint64_t trunk_relayed, trunk_relay_fallbacks;
    int32_t *rorder; /* [nw]: this round's tree members in order */
    /* relay_fanout greedy: the schedules of the last steps, by member count
     * and x bytes (a step's x size depends on its width and T; computed once
     * per size, round robin over the slots) */
    shoal_relaytree rtc[SHOAL__EC_RTCACHE];
    size_t rtc_xb[SHOAL__EC_RTCACHE];
    int rtc_n[SHOAL__EC_RTCACHE], rtc_next;
};

#define SHOAL__EC_TCTL_CAP                                                                                        \
    (64 + SHOAL_PROTO_MAX_TSEGS * (SHOAL_PROTO_MAX_NAME + 16) + SHOAL_PROTO_MAX_TCHAIN * (2 * SHOAL_PROTO_MAX_NAME + 24) + \
     40 + SHOAL_PROTO_MAX_RELAY * 6)

/* ---- links.c, for the exchange ---------------------------------------------- */

/* Mark worker i down (smu held), why it is down in fmt: every request that
 * needs it fails at once until the keeper has brought it back. Nothing if it
 * is down already. */
void shoal__ec_mark_down(shoal_expert_client *c, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- expert_client.c, for the trunk client ------------------------------------ */

/* Give up worker i's part of the current round (smu held; the caller has
 * marked it down): its work is resent to other owners by the caller's
 * gather. The first loss of the request is kept in lost_rc / lost_err: its
 * error is the request's when no other owner is up. */
void shoal__ec_lose(shoal_expert_client *c, int i, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A request that resent lost parts and succeeded (smu held): the time from
 * each lost part's send to now goes to the stats and the failover histogram. */
void shoal__ec_count_failover_time(shoal_expert_client *c);
/* The checks of one unanswered worker in a wait round (smu held), for both
 * roles: a dropped connection (disconnected) loses it at once; silence past
 * the failover time loses it when others_up(c, i) says every part of it has
 * another owner up (checked once per round). role names it in the error
 * ("expert", "trunk"), part prefixes "layer N" ("" or "the trunk rows of ").
 * Returns 1 when it was lost; else 0, with *next_fo lowered to its failover
 * time while that check is still to come. */
int shoal__ec_check_worker(shoal_expert_client *c, int i, int disconnected,
                           int (*others_up)(shoal_expert_client *c, int i), const char *role, const char *part,
                           uint64_t *next_fo);
/* Mark down the workers that are up here whose connection dropped (smu held;
 * before a pick, so that a worker that just died is not picked). */
void shoal__ec_see_disconnects(shoal_expert_client *c);

/* Record the request's failure (smu held; only the first one of a request
 * counts: nothing unless the state is SENT). */
void shoal__ec_fail(shoal_expert_client *c, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Queue one frame of a request without copying it: a constant message over
 * the caller's buffer (zmq allocates nothing for it). -1 with errno. */
int shoal__ec_send_frame(void *sock, void *data, size_t len, int more);

/* ---- socket helpers of both files ------------------------------------------- */

/* These are on the forward thread's path too (every reply, every disconnect a
 * request sees), so they are static inline: each file keeps its own copy, as
 * when the client was one file, and that path makes no call across files. */

/* May a pick choose worker i (smu held)? Up on this client's link, not lost
 * in this round, and not down on the sibling client's link. */
static inline int shoal__ec_pickable(const shoal_expert_client *c, int i)
{
    return !c->w[i].lost && atomic_load(&c->w[i].link) == W_UP &&
           (!c->sib || atomic_load(&c->sib->w[i].link) == W_UP);
}

/* CLOCK_MONOTONIC in ns and us, for deadlines and per-worker timings. */
static inline uint64_t shoal__ec_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t shoal__ec_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The supervisor's busy record of worker i (opts.busy): a request sent
 * (kept if an older one is still unanswered), or any message received. */
static inline void shoal__ec_busy_sent(shoal_expert_client *c, int i, uint64_t ns)
{
    if (c->o.busy && !atomic_load(&c->o.busy[i]))
        atomic_store(&c->o.busy[i], ns);
}
static inline void shoal__ec_busy_answered(shoal_expert_client *c, int i)
{
    if (c->o.busy)
        atomic_store(&c->o.busy[i], 0);
}

/* Read the events waiting on a monitor socket; 1 if one was a disconnect. */
static inline int shoal__ec_monitor_disconnected(void *mon)
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

/* Read one whole message (at most MAX_FRAMES parts kept) without waiting:
 * its number of parts, 0 when none is waiting; *truncated when it had more. */
static inline int shoal__ec_recv_parts(void *sock, zmq_msg_t *parts, int *truncated)
{
    int np = 0, more = 1;
    *truncated = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (np < SHOAL_PROTO_MAX_FRAMES)
            parts[np++] = m;
        else {
            *truncated = 1;
            zmq_msg_close(&m);
        }
    }
    return np;
}

static inline void shoal__ec_close_parts(zmq_msg_t *parts, int np)
{
    for (int j = 0; j < np; j++)
        zmq_msg_close(&parts[j]);
}

#endif
