/* expert_server: the `shoal expert` process -- loads a model's config and the
 * owned experts, binds a ZeroMQ ROUTER socket and answers PROTOCOL.md requests
 * until SHUTDOWN or the stop flag (SIGTERM/SIGINT in the CLI). The request being
 * computed is always finished and answered; requests queued behind it when the
 * stop comes are answered with ERROR SHUTTING_DOWN. The one thread that calls
 * shoal_expert_server_run owns the socket; the experts run on OpenMP threads
 * inside the kernels. Callers: cli (shoal_cmd_expert), tests (in a thread). */
#ifndef SHOAL_EXPERT_SERVER_H
#define SHOAL_EXPERT_SERVER_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "worker/hostfacts.h" /* the host facts of PROBE, also measured by `shoal doctor` on its own host */

typedef struct {
    const char *model;    /* model directory (config.json + safetensors) */
    const char *experts;  /* RANGES, PROTOCOL.md §7; NULL: none (then trunk is required) */
    const char *trunk;    /* ROWSPEC, PROTOCOL.md §7.1: trunk rows to serve (1.3); NULL: none */
    const char *listen;   /* ZeroMQ endpoint to bind */
    const char *id;       /* worker id in HELLO and logs; NULL: the endpoint */
    int threads;          /* OpenMP threads; 0: the OpenMP default */
    int max_tokens;       /* largest T per request; 0: 1024 */
    /* Polled between requests; non-zero stops the server. NULL: never. */
    volatile sig_atomic_t *stop;
    /* Test hook: microseconds to sleep before computing each EXPERT_BATCH
     * (fault tests: a worker that is slow or gets killed mid-request). 0 off. */
    unsigned delay_us;
    /* Benchmark hook: answer every batch with zero outputs, skipping only the
     * expert FFNs and trunk row products (decode, checks, grouping, the reply
     * all happen), so the cost of the exchange itself can be measured. */
    int skip_compute;
    int refuse_shutdown; /* --refuse-shutdown: no peer may stop this worker by message (PROTOCOL.md §3.3) */
    /* Prometheus /metrics (docs/METRICS.md) on metrics_host:metrics_port
     * (host NULL: 127.0.0.1); port 0: off. */
    int metrics_port;
    const char *metrics_host;
    /* The model fingerprint a placement plan was made for (SHOAL_PROTO_FP_BYTES,
     * borrowed), or NULL: a different model is refused (SHOAL_EFINGERPRINT). */
    const unsigned char *plan_fingerprint;
    /* RAM budget for the experts (worker/store.h): cache_bytes or cache_slots
     * non-zero serve from a fixed-slot cache filled by pread instead of
     * mapping the whole shard. */
    uint64_t cache_bytes;
    uint32_t cache_slots;
    /* Or a preset for the budget: "small" (the minimum), "medium" (a quarter
     * of the shard), "large" (the whole shard), "auto" (what the cgroup limit
     * and MemAvailable leave, common/memplan.h). */
    const char *cache_preset;
    const char *cache_policy; /* "lfu" (default) or "lru" */
    int io_threads;           /* concurrent expert reads; 0: 8 */
    int no_direct;            /* 1: buffered reads only (no O_DIRECT) */
    int no_prefetch;          /* 1: ignore PREFETCH hints (the cache reads only on demand) */
    /* model is a pack (common/packfile.h): 1 checks every file's BLAKE2b
     * before serving (sizes are always checked). */
    int verify;
    /* CURVE (common/curve.h, PROTOCOL.md section 9): this worker's key pair
     * file and the file of allowed coordinator public keys; NULL: off (the
     * CLI refuses a non-ipc endpoint without CURVE unless --insecure). */
    const char *curve_secret;
    const char *curve_allow;
    /* Reply budget (worker/rbudget.h, PROTOCOL.md section 6): bytes of
     * replies ZeroMQ may hold unread for one connection, and for all of them;
     * 0: the defaults (SHOAL_EXPERT_PEER_REPLY_MB, SHOAL_EXPERT_REPLY_BUDGET_MB). */
    uint64_t peer_reply_bytes;
    uint64_t reply_budget_bytes;
    /* --relay-peers LIST (worker/relay.h, PROTOCOL.md §3.9): the workers this
     * one may forward trunk inputs to, `endpoint[@key]`, comma-separated;
     * NULL: it relays to nobody (it still takes relayed inputs). */
    const char *relay_peers;
    /* This worker's own entry in that list (never sent to); NULL: listen. */
    const char *relay_self;
} shoal_expert_server_opts;

#define SHOAL_EXPERT_PEER_REPLY_MB 256
#define SHOAL_EXPERT_REPLY_BUDGET_MB 1024

/* Runs the server. Returns 0 after a clean stop, or an error code with err:
 * SHOAL_EINVAL (options), SHOAL_ECONFIG / SHOAL_EMODEL (model), SHOAL_ERANGE
 * (ranges outside the model), -errno (bind, I/O). */
int shoal_expert_server_run(const shoal_expert_server_opts *o, char *err, size_t errlen);

#endif
