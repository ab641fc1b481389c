/* expert_client: the routed-expert backend (coordinator/engine/experts.h) that runs
 * experts on expert servers over ZeroMQ (proto/PROTOCOL.md). One DEALER per
 * worker; HELLO with each at open (protocol version, model fingerprint,
 * ownership); every expert of every MoE layer must be owned by at least one
 * worker, else open refuses naming the gaps. An expert owned by several workers
 * (a replica, docs/CLUSTER.md) is sent, per exchange, to the one that
 * coordinator/cluster/owners.h picks to balance the pairs; the outputs are the same bits.
 *
 * Per MoE layer: submit() builds one EXPERT_BATCH per involved worker (only the
 * tokens routed to it, pairs in (token, expert) order) and sends them all
 * before any reply is read; the caller computes the shared experts meanwhile;
 * gather() waits until every involved worker has answered or the deadline
 * passed, then places each expert output at its (t, slot). A worker that is
 * silent, disconnects or answers with ERROR has its part resent to other
 * owners (below), or, when some expert of it has none up, fails the whole
 * request with an error naming it; y is then not to be used (never a partial
 * mixture). Late replies carry an old request id and are dropped.
 *
 * Down and back: a worker that failed a request (deadline, ERROR, malformed
 * reply, disconnect, send failure) is marked down. Failover: when every
 * expert of its part has another owner up (replicas), that part is resent to
 * those owners within the same deadline (opts.failover_ms); otherwise the
 * request fails (SHOAL_EPEER, naming it and why), and so does every request
 * that needs one of its experts until it is back. Meanwhile the client's
 * keeper thread re-sends HELLO to it with backoff (100 ms doubling to 5 s,
 * for as long as the client lives), re-verifies the answer (protocol
 * version, fingerprint, exactly the same ownership) and marks it up again;
 * the coordinator metrics' worker state follows (shoal_cmetrics_worker_up).
 *
 * Threads: submit() and gather() run on the caller's thread (the engine's
 * forward), which drives the sockets itself and never allocates (request
 * frames are the client's own buffers, sized at open for max_tokens, sent
 * without copies). One outstanding request per client; submit() holds the
 * client's lock until gather() returns, so the other functions, which take
 * it, wait for the request to end. The keeper thread uses the sockets only
 * between requests.
 *
 * Files: links.c holds the worker links (connect, HELLO, down and back, the
 * keeper thread, open and close), expert_client.c the per-layer exchange
 * (submit, gather, hint); they share the client through expert_client_int.h,
 * which is theirs alone. */
#ifndef SHOAL_EXPERT_CLIENT_H
#define SHOAL_EXPERT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/planfile.h" /* SHOAL_RELAY_GREEDY */
#include "common/curve.h"
#include "common/k3cfg.h"
#include "common/st.h"
#include "coordinator/engine/engine.h"
#include "proto/proto.h"

#define SHOAL_EXPERT_CLIENT_MAX_WORKERS 256

typedef struct {
    const char *const *endpoints; /* one per worker */
    int nworkers;
    const shoal_k3cfg *cfg;       /* borrowed for the client's lifetime */
    const uint8_t *fingerprint;   /* SHOAL_PROTO_FP_BYTES: the coordinator's model (copied at open) */
    int max_tokens;               /* largest T of a submit (the engine's max_batch) */
    int timeout_ms;               /* deadline of each gather; 0: 30000 */
    /* Failover (replicated experts): a worker silent this long after its
     * part of an exchange was sent, whose pairs all have another owner up,
     * is given up (marked down) and its pairs are resent to those owners
     * within the same deadline; 0: the default, min(1000, timeout_ms / 3).
     * A worker that errors or disconnects is given up at once. */
    int failover_ms;
    int hello_timeout_ms;         /* deadline for every worker's HELLO at open; 0: 60000 */
    /* Activations on the wire (PROTOCOL.md 1.7): 0, bf16 to each worker that
     * computes the same bits from them (the mu class: an EXPERT_BATCH act to a
     * worker whose HELLO says bf16_exact, a TRUNK_BATCH x whose matrices are
     * all BF16 to a 1.7 worker), f32 to every other; 1, f32 always
     * (--wire-act f32). The ids are the same either way. */
    int wire_f32;
    const char *peer;             /* our name in HELLO; NULL: "coordinator <pid>" */
    /* Called about every 100 ms while waiting for HELLOs; non-zero aborts the
     * open with that code and its message (e.g. a spawned worker exited). */
    int (*check)(void *ctx, char *err, size_t errlen);
    void *check_ctx;
    /* Optional, nworkers entries that outlive the client (the local workers'
     * supervisor's, coordinator/cluster/spawn.h): busy[i] is set to when the
     * oldest request sent to worker i since its last message was sent
     * (CLOCK_MONOTONIC ns), 0 when it has answered everything. */
    _Atomic unsigned long long *busy;
    /* CURVE (common/curve.h, PROTOCOL.md section 9): our key pair and, per
     * worker, its pinned public key (Z85; NULL entry: that link is plain).
     * Both NULL: no CURVE. Borrowed for open only. */
    const shoal_curve_keypair *curve;
    const char *const *curve_server_keys;
    /* Trunk role (coordinator/cluster/trunk_client.h opens the client so):
     * the links carry TRUNK_BATCH requests instead of expert batches; the
     * expert coverage is not required, the trunk coverage is (every row of
     * every announced matrix owned, else SHOAL_ECONFIG naming the gaps), and
     * each worker's trunk fingerprint is checked against st (borrowed for
     * open). 0: the expert role. */
    int trunk_role;
    const shoal_st *st;
    /* Trunk role: the relay tree (PROTOCOL.md §3.9). 0: every TRUNK_BATCH
     * carries its x (1.7's behaviour); F in 2..4: per step, the involved
     * workers whose HELLO lists relay peers (the same list, naming each of
     * them) form a tree of fan-out F: F roots get x and their subtree, the
     * others only the header with the step's xid. A relayed request not
     * answered within failover_ms (or answered ERROR) is resent directly with
     * x, and its relay parents relay no more. SHOAL_RELAY_GREEDY (-1,
     * common/planfile.h): per step the latency-aware schedule of
     * coordinator/cluster/relaytree.h for the step's x bytes and the three
     * rates below (each > 0, the hop >= 0; else open refuses): the
     * coordinator's children that have children are the roots, the
     * coordinator's other children plain requests. */
    int relay_fanout;
    double relay_nic_Bps, relay_peer_Bps, relay_hop_s;
} shoal_expert_client_opts;

typedef struct shoal_expert_client shoal_expert_client;

/* Connects, HELLOs, checks ownership, warms every connection up (PINGs) and
 * starts the keeper thread. Errors: SHOAL_ETIMEOUT (a worker did not answer HELLO,
 * named), SHOAL_EVERSION / SHOAL_EFINGERPRINT (named, both values),
 * SHOAL_ECONFIG (ownership gaps), SHOAL_ERANGE, SHOAL_EINVAL. */
int shoal_expert_client_open(shoal_expert_client **out, const shoal_expert_client_opts *o, char *err,
                             size_t errlen);
/* The backend view of c: {vt, c}. vt->close(c) closes the client (the engine
 * calls it when it owns the backend; after that c is gone). */
shoal_experts shoal_expert_client_backend(shoal_expert_client *c);
void shoal_expert_client_close(shoal_expert_client *c); /* accepts NULL */

typedef struct {
    uint64_t requests;      /* submits that got as far as sending */
    uint64_t messages;      /* EXPERT_BATCH messages sent (one per involved worker) */
    uint64_t pairs;         /* (token, expert) pairs sent */
    uint64_t bytes_out;     /* frame bytes sent (all frames) */
    uint64_t bytes_in;      /* frame bytes received */
    uint64_t late_replies;  /* replies dropped because their request had already failed */
    uint64_t failures;      /* requests that failed */
    uint64_t worker_queue_us, worker_compute_us; /* sums reported by the workers */
    double wait_s;          /* time gather() spent waiting */
    uint64_t downs;         /* times a worker was marked down */
    uint64_t recoveries;    /* times one came back (HELLO re-verified) */
    uint64_t hints;         /* PREFETCH notices sent (bytes in bytes_out) */
    uint64_t hints_dropped; /* hints not sent (worker down, its hint buffers still queued, or the send failed) */
    uint64_t failovers;     /* workers given up mid-exchange whose part was resent to other owners */
    uint64_t resent_pairs;  /* (token, expert) pairs resent so */
    uint64_t failover_ns;   /* sum over those of the time from the lost part's send to the end of the exchange */
} shoal_expert_client_stats;

/* Report every exchange, layer wait and failure to cm (coordinator/obs/cmetrics.h,
 * opened with max_workers >= the client's workers; borrowed, must outlive the
 * client or be unset with NULL first). Describes each worker from its HELLO.
 * Between requests only. 0 or SHOAL_EINVAL. */
typedef struct shoal_cmetrics shoal_cmetrics;
int shoal_expert_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm, char *err, size_t errlen);

/* Deadline of the following gathers (e.g. longer for a long prefill). Between
 * requests only. */
void shoal_expert_client_set_timeout(shoal_expert_client *c, int timeout_ms);

/* Between requests (they wait for the outstanding one). */
void shoal_expert_client_get_stats(shoal_expert_client *c, shoal_expert_client_stats *out);
void shoal_expert_client_reset_stats(shoal_expert_client *c);
int shoal_expert_client_nworkers(const shoal_expert_client *c);
/* 1 if some worker's HELLO said it acts on PREFETCH hints (an expert cache),
 * as of the HELLOs at open. */
int shoal_expert_client_any_prefetch(const shoal_expert_client *c);
/* 1 if some worker's HELLO (1.3+) announced trunk rows. */
int shoal_expert_client_any_trunk(const shoal_expert_client *c);
/* 1 when worker i is up; 0 when down or reconnecting, with why (e.g. "no
 * reply within 30000 ms", "disconnected (the worker died?)", "refused on
 * reconnection: ...") written to why[whylen] when why is not NULL. Any
 * thread, any time (does not wait for a request). */
int shoal_expert_client_worker_up(shoal_expert_client *c, int i, char *why, size_t whylen);
/* Pair a and b, two clients over the same workers (the same endpoints in the
 * same order: the expert client and the trunk client of one coordinator): a
 * worker down on either's link is not picked among replicas by the other, so
 * a stopped worker given up by one is not waited for again by the other
 * (docs/CLUSTER.md, "Replicas"). Before any request; SHOAL_EINVAL when the
 * workers differ. Closing either unpairs them (the other must have no
 * request under way then). */
int shoal_expert_client_set_sibling(shoal_expert_client *a, shoal_expert_client *b, char *err, size_t errlen);
/* 1 when everything this client serves still has an owner that is up (on
 * this client's link and on its sibling's, if any): in
 * the expert role every expert of every MoE layer, in the trunk role every
 * row of every remote trunk matrix (replicas cover for workers that are
 * down); else 0, with the first thing left without one named in why (e.g.
 * "layer 3 expert 5: its owner cw1 is down", "rows 0-47 of NAME: their 2
 * owners are down"). Any thread, any time (reads the links' states and what
 * open fixed). */
int shoal_expert_client_covered(shoal_expert_client *c, char *why, size_t whylen);
/* Worker w's part in the last request that gathered successfully: 1 and its
 * reported queue/compute microseconds and the round trip seen here (first byte
 * sent to reply received, ns) when it was involved, else 0. Between requests. */
int shoal_expert_client_last(shoal_expert_client *c, int w, uint64_t *queue_us, uint64_t *compute_us,
                             uint64_t *rtt_ns);
/* "id (endpoint)" of worker i; lives as long as c. */
const char *shoal_expert_client_worker_name(const shoal_expert_client *c, int i);

#endif
