/* serve: the worker's request handler -- one decoded request in, exactly one
 * reply out (PROTOCOL.md §3; a PREFETCH notice gets none), with no sockets, so
 * the tests and the fuzz target drive it directly. It keeps the per-peer HELLO
 * state, validates every request
 * (proto/proto.h decode + shoal_proto_check_batch against the model and the
 * ownership), computes EXPERT_BATCH grouped by expert (each expert's weights read
 * once per request, shoal_expert_ffn over the tokens routed to it, experts in
 * ascending id order) and answers anything wrong with ERROR -- never a crash.
 * Callers: the worker's server loop (worker/expert_server.c), tests, fuzzing.
 * Scratch is sized at open from max_tokens; a request allocates only its reply
 * data frame, through the caller's allocator (so the server can write straight
 * into a ZeroMQ message). Not thread-safe: one thread owns a shoal_serve. */
#ifndef SHOAL_SERVE_H
#define SHOAL_SERVE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"
#include "proto/shard.h"
#include "worker/bank.h"
#include "worker/store.h"
#include "worker/wmetrics.h"

/* Rows of a trunk matrix as stored: w points at the first owned row of
 * W[rows, cols] (row-major BF16 or F32, read-only, borrowed). */
typedef struct {
    const void *w;
    int bf16; /* 1: BF16, 0: F32 */
    int cols;
    int rows; /* the whole matrix's rows (a range lo = 0, hi = rows - 1 owns all of it) */
} shoal_serve_tmat;

typedef struct {
    const char *id;                        /* worker id, at most 64 bytes */
    const uint8_t *fingerprint;            /* SHOAL_PROTO_FP_BYTES */
    const shoal_proto_range *owned;        /* the --experts ranges, for HELLO; borrowed */
    size_t nowned;
    const shoal_shard *own;                /* ownership bitmap; borrowed */
    int num_layers;
    const uint8_t *is_moe;                 /* [num_layers]; borrowed */
    int num_experts;
    int k;                                 /* experts per token */
    int max_tokens;                        /* largest T accepted (> 0) */
    const char *isa;                       /* kernel variant name */
    int threads;
    uint64_t mem_total;
    shoal_wmetrics *metrics;               /* optional (NULL): counters for /metrics; borrowed */
    unsigned delay_us;                     /* test hook: sleep before computing each EXPERT_BATCH */
    int skip_compute;                      /* benchmark hook: outputs zero instead of the expert FFNs and trunk rows */
    int refuse_shutdown;                   /* 1: SHUTDOWN is answered ERROR UNKNOWN_TYPE (PROTOCOL.md §3.3) */
    /* Optional: the experts come from this RAM-budgeted store (worker/store.h)
     * instead of the bank, which is then NULL. Borrowed; one thread uses it. */
    shoal_store *store;
    /* 1: act on PREFETCH hints (PROTOCOL.md §3.6) by reading the hinted
     * experts into the store ahead of use; 0: hints are received and ignored.
     * No effect without a store. */
    int prefetch;
    /* 1.3: trunk row shards (PROTOCOL.md §3.7). trunk[i] are rows lo..hi of a
     * trunk matrix, announced in HELLO with trunk_fp; tmat[i] is where they
     * are stored (row lo of the matrix, as mapped from the model). All
     * borrowed. ntrunk 0: no trunk rows (a worker may also own no experts
     * when it has some). */
    const shoal_proto_trows *trunk;
    const shoal_serve_tmat *tmat;
    size_t ntrunk;
    const uint8_t *trunk_fp; /* SHOAL_PROTO_FP_BYTES */
    /* 1.5 PROBE (PROTOCOL.md §3.8): the model directory or pack whose disk
     * the facts describe (borrowed; NULL: disk figures 0) */
    const char *model_dir;
    /* 1.7 (PROTOCOL.md §3.1 `bf16_exact`): 1 when every expert it serves has
     * MXFP4 or BF16 weights, so in the mu class a bf16 EXPERT_BATCH act gives
     * the bits of its f32 original; announced in HELLO only in the mu class.
     * (A bf16 TRUNK_BATCH x is checked per request against its matrices.) */
    int experts_round_input;
    /* 1.8 (PROTOCOL.md §3.9): the relay peers' endpoints (`--relay-peers`),
     * announced in HELLO in this order; borrowed. nrelay 0: no relaying. */
    const char *const *relay;
    int nrelay;
} shoal_serve_opts;

typedef struct shoal_serve shoal_serve;

/* Allocates the reply's data frame (len bytes); NULL on failure or when the
 * caller's reply budget refuses it (worker/rbudget.h): answered with ERROR
 * INTERNAL whose message is `why` when the function wrote one (it names the
 * limit), else a generic one. ctx is the caller's. Called at most once per request:
 * the caller owns and sends (or frees) it. The reply carries it (rep->n == 2)
 * unless reading an expert from the store failed afterwards (rep->n == 1, an
 * ERROR): then the caller frees it. */
typedef void *(*shoal_serve_alloc_fn)(void *ctx, size_t len, char *why, size_t whylen);

typedef struct {
    shoal_frame frames[2]; /* [0] control (the serve's buffer, valid until the next call), [1] data */
    int n;                 /* 1 or 2; 0: nothing to send (a PREFETCH notice) */
    int type;              /* reply message type */
    int shutdown;          /* 1: SHUTDOWN was acknowledged; exit once sent */
} shoal_serve_reply;

/* o and bank (or o->store) are borrowed and must outlive the handler. */
int shoal_serve_open(shoal_serve **out, const shoal_serve_opts *o, const shoal_bank *bank, char *err, size_t errlen);
void shoal_serve_close(shoal_serve *s); /* accepts NULL */

/* Handle one message from peer (ZeroMQ routing id bytes; any bytes identify a
 * connection). queue_us: how long it waited in the server's queue. */
void shoal_serve_handle(shoal_serve *s, const uint8_t *peer, size_t peerlen, const shoal_frame *in, int nin,
                        uint64_t queue_us, shoal_serve_alloc_fn alloc, void *actx, shoal_serve_reply *rep);

/* A relayed TRUNK_BATCH (1.8, PROTOCOL.md §3.9: `xid` and no x frame) with
 * the x frame of its TRUNK_X, which the server loop paired with it; x is
 * checked as a TRUNK_BATCH's x. Any other message: as shoal_serve_handle. */
void shoal_serve_handle_relayed(shoal_serve *s, const uint8_t *peer, size_t peerlen, const shoal_frame *in,
                                int nin, const shoal_frame *x, uint64_t queue_us, shoal_serve_alloc_fn alloc,
                                void *actx, shoal_serve_reply *rep);
/* 1 when this connection's last HELLO said `relay` (1.8): it may send TRUNK_X.
 * (shoal_serve_handle answers a TRUNK_X from any other connection with
 * ERROR UNKNOWN_TYPE, and one from it with nothing: the server loop takes it.) */
int shoal_serve_relay_parent(shoal_serve *s, const uint8_t *peer, size_t peerlen);

/* ERROR perr for a request that will not be served (e.g. SHUTTING_DOWN), with
 * the request's rid when its envelope decodes. */
void shoal_serve_refuse(shoal_serve *s, const shoal_frame *in, int nin, int perr, const char *msg,
                        shoal_serve_reply *rep);

/* PREFETCH notices received and dropped (malformed, before HELLO, not an
 * MoE layer) since open. */
void shoal_serve_prefetch_counts(const shoal_serve *s, uint64_t *notices, uint64_t *dropped);

/* Counters since open (STATS_REPLY). */
void shoal_serve_stats(const shoal_serve *s, shoal_proto_stats *out);

#endif
