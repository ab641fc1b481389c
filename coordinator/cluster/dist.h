/* dist: the coordinator's distributed-experts options and wiring, for the
 * commands that run the model (`shoal run`, later `shoal serve`): parses
 * --worker ENDPOINT (repeatable) / --workers N / --plan plan.json / --expert-timeout-ms ..., spawns
 * local workers when asked (coordinator/cluster/spawn.h), opens the expert client
 * (coordinator/cluster/expert_client.h) with the model's fingerprint, and plugs it into
 * the model as its routed-expert backend. Also keeps per-phase wire counters
 * for the run report. One owner; not thread-safe.
 *
 * Use from a command:
 *   shoal_dist_opts d = {0};                      // then, for an unknown argv[i]:
 *   int r = shoal_dist_parse_arg(&d, argc, argv, &i);   // 1 taken, 0 not ours, -1 bad
 *   mo.remote_experts = shoal_dist_enabled(&d);
 *   shoal_model_open(&m, ...); shoal_dist_start(&dist, &d, dir, m, ...);
 *   ... shoal_dist_mark(dist, "prefill", n) ... shoal_dist_mark(dist, "decode", n)
 *   shoal_dist_json(dist, obj) or shoal_dist_print(dist, stdout);
 *   shoal_model_close(m); shoal_dist_stop(dist);   // the model closes the client first */
#ifndef SHOAL_DIST_H
#define SHOAL_DIST_H

#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>

#include "coordinator/engine/engine.h"
#include "coordinator/cluster/expert_client.h"
#include "coordinator/cluster/spawn.h"

typedef struct {
    const char *worker[SHOAL_EXPERT_CLIENT_MAX_WORKERS]; /* --worker, borrowed from argv */
    int nworker;
    int nlocal;           /* --workers N */
    int worker_threads;   /* --worker-threads (local workers) */
    int timeout_ms;       /* --expert-timeout-ms; 0: 30000 */
    int hello_timeout_ms; /* --hello-timeout-ms; 0: 60000 */
    int failover_ms;      /* --failover-ms; 0: min(1000, timeout / 3) */
    const char *plan;     /* --plan plan.json: every worker's endpoint (docs/CLUSTER.md), borrowed */
    /* CURVE (PROTOCOL.md section 9): --curve-secret (our key pair file),
     * --worker-key FILE per --worker (same order), --curve-keys DIR (with
     * --plan: DIR/NAME.pub per worker), --insecure-workers (plain TCP allowed;
     * not --insecure, which is `shoal serve`'s HTTP flag). */
    const char *curve_secret;
    const char *worker_key[SHOAL_EXPERT_CLIENT_MAX_WORKERS];
    int nworker_key;
    const char *curve_keys;
    int insecure;
    int prefetch; /* --prefetch on|off: 1 on, -1 off, 0 the default (SHOAL_DIST_PREFETCH_DEFAULT) */
    /* --trunk local|remote|auto (PROTOCOL.md §3.7): 0 local (the default:
     * the whole trunk in-process), 1 remote (the matrices the workers
     * announce run on them; refused when none does; with --workers N each
     * local worker is started with its 1/N of every row-shardable matrix,
     * shoal_tshard_spread_spec), 2 auto (remote when some worker announces
     * trunk rows; local with --workers) */
    int trunk;
    /* --wire-act auto|f32 (PROTOCOL.md 1.7): 0 auto (the default: bf16
     * activations to the workers that compute the same bits from them, in the
     * mu class), 1 f32 always (shoal_expert_client_opts.wire_f32) */
    int wire_f32;
    /* --relay-fanout F (PROTOCOL.md §3.9; with --trunk remote or auto;
     * relay_given 0: not given, then the plan's relay_fanout with --plan, else
     * off): 0 off (every trunk input sent directly to every trunk server), 2..4:
     * each step's input goes to F of them, which forward it to the others in
     * a tree of fan-out F (shoal_expert_client_opts.relay_fanout); with
     * --workers N the local workers are given each other as relay peers;
     * SHOAL_RELAY_GREEDY (--relay-fanout greedy): the latency-aware schedule
     * (relaytree.h) for the rates below */
    int relay_fanout, relay_given;
    /* --relay-rates N,P,H (with --relay-fanout greedy, or the plan's greedy):
     * the coordinator's send rate and the workers' rate to each other in
     * Gbit/s, a relay hop's latency in us; 0: not given (the plan's) */
    double relay_nic_gbps, relay_peer_gbps, relay_hop_us;
    /* Non-NULL: read while waiting for the workers' HELLO; non-zero aborts
     * shoal_dist_start with SHOAL_ECANCELED (`shoal serve` stopped by a
     * signal while starting). Not a flag. */
    const atomic_int *cancel;
} shoal_dist_opts;

/* Prefetch hints (PROTOCOL.md PREFETCH) when --prefetch is not given; chosen
 * from the measurement in docs/PERFORMANCE.md ("Prefetch hints"). */
#define SHOAL_DIST_PREFETCH_DEFAULT 1

/* Options of a command line: consumes argv[*i] (and its value, advancing *i)
 * if it is one of ours. Returns 1 consumed, 0 not ours, -1 bad value (printed
 * to stderr, prefixed with cmd). */
int shoal_dist_parse_arg(shoal_dist_opts *o, const char *cmd, int argc, char **argv, int *i);
void shoal_dist_usage(FILE *f);
/* 1 when experts run on workers (then open the model with remote_experts = 1);
 * -1 when more than one of --worker, --workers, --plan was given (usage error). */
int shoal_dist_enabled(const shoal_dist_opts *o);

typedef struct shoal_dist shoal_dist;

/* Spawns the local workers (--workers), connects and HELLOs every worker,
 * checks that they own every expert at least once (overlaps are replicas), and sets the model's expert
 * backend (with prefetch hints on or off, shoal_model_set_prefetch). max_tokens: the model's max_batch. */
int shoal_dist_start(shoal_dist **out, const shoal_dist_opts *o, const char *model_dir, shoal_model *m, char *err,
                     size_t errlen);
/* Closes the spawned workers (after shoal_model_close, which closes the
 * client). Accepts NULL. */
void shoal_dist_stop(shoal_dist *d);

/* The expert client (NULL for a NULL d): `shoal doctor` probes its links
 * (coordinator/cluster/probe.h) while no forward runs. */
shoal_expert_client *shoal_dist_client(shoal_dist *d);

/* Workers in use (0 for NULL): for shoal_cmetrics_opts.max_workers. */
int shoal_dist_nworkers(const shoal_dist *d);
/* "id (endpoint)" of worker i (0 <= i < nworkers), as the expert client names
 * it in its errors; lives as long as d. NULL when out of range. */
const char *shoal_dist_worker_name(const shoal_dist *d, int i);
/* 1 when worker i is up, else 0 with why (see shoal_expert_client_worker_up).
 * Any thread, any time. */
int shoal_dist_worker_up(shoal_dist *d, int i, char *why, size_t whylen);
/* The supervision state of local worker i (`--workers N`): restarts, hangs,
 * backoff (coordinator/cluster/spawn.h); -1 when the workers are not local. */
int shoal_dist_local_state(shoal_dist *d, int i, shoal_spawn_state *out);
/* 1 when every routed expert and every remote trunk row still has an owner
 * that is up (replicas covering for the workers that are down: requests are
 * served, /health says "degraded"); else 0 with what is left without one in
 * why. 1 for a NULL d. Any thread, any time. */
int shoal_dist_covered(shoal_dist *d, char *why, size_t whylen);
/* Report the expert exchanges to cm (see shoal_expert_client_set_metrics).
 * cm must outlive the model (which closes the client). 0 for a NULL d. */
int shoal_dist_set_metrics(shoal_dist *d, shoal_cmetrics *cm, char *err, size_t errlen);

/* Record the wire counters since the previous mark as phase name over tokens. */
void shoal_dist_mark(shoal_dist *d, const char *phase, int tokens);
/* Adds "workers" and, per marked phase, "<phase>_wire_bytes_per_token",
 * "<phase>_wire_messages_per_token", "<phase>_expert_wait_s" to o. */
void shoal_dist_json(const shoal_dist *d, json_t *o);
void shoal_dist_print(const shoal_dist *d, FILE *f);

#endif
