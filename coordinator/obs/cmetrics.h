/* cmetrics: the coordinator's metrics (docs/METRICS.md, "Coordinator"):
 * per-token time by phase of the forward, and per expert server ("worker")
 * round trips split into network, queue and compute time using the
 * queue_us / compute_us each EXPERT_RESULT carries (no clock sync needed),
 * bytes, load share against the fair share, per-layer imbalance and the time
 * spent waiting on the slowest worker; written as Prometheus text for
 * `shoal serve`'s /metrics and as a plain report for `shoal run`.
 *
 * Callers: the engine's forward (phases), the sampler's caller (sampling
 * phase), the expert client (exchanges, failures, worker state), run/serve
 * (open, workers, report, exposition), tests.
 *
 * Thread-safety: after shoal_cmetrics_set_worker calls are done (start-up),
 * every update is lock-free and callable from any thread, and the writer and
 * the report may run concurrently with updates (each value is read
 * atomically; a scrape is not one instant). set_worker is not concurrent with
 * anything else. Updates never allocate and never log. */
#ifndef SHOAL_CMETRICS_H
#define SHOAL_CMETRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/metrics.h"

/* Where the forward's time goes (per token = seconds / tokens). */
typedef enum {
    SHOAL_PHASE_ATTENTION, /* embedding, AttnRes mixing, norms, KDA/MLA, residual prefix */
    SHOAL_PHASE_ROUTING,   /* router logits, sigmoid + top-k, latent down-projection */
    SHOAL_PHASE_EXPERTS,   /* inside the expert backend's submit() and gather(): in-process,
                              the routed experts' compute; remote, sending and the wait for
                              replies not hidden behind the shared experts */
    SHOAL_PHASE_SHARED,    /* shared experts (overlap the remote experts) */
    SHOAL_PHASE_COMBINE,   /* weighted sum of expert outputs, latent norm, up-projection, residual */
    SHOAL_PHASE_DENSE,     /* dense MLP layers */
    SHOAL_PHASE_HEAD,      /* final AttnRes, norm, LM head */
    SHOAL_PHASE_SAMPLING,  /* the sampler (outside the engine) */
    SHOAL_PHASE_COUNT
} shoal_cmetrics_phase;

const char *shoal_cmetrics_phase_name(int phase); /* "attention", ... */

typedef struct {
    int num_layers;        /* model layers, 1..SHOAL_MAX_LAYERS */
    const uint8_t *is_moe; /* [num_layers], copied */
    int num_experts;       /* routed experts per MoE layer */
    uint64_t expert_bytes; /* bytes of one routed expert's weights (for weight GB/s) */
    int max_workers;       /* 0 for an in-process run */
} shoal_cmetrics_opts;

typedef struct shoal_cmetrics shoal_cmetrics;

int shoal_cmetrics_open(shoal_cmetrics **out, const shoal_cmetrics_opts *o, char *err, size_t errlen);
void shoal_cmetrics_close(shoal_cmetrics *cm); /* accepts NULL */

/* Describe worker w (0 <= w < max_workers) at start-up, from its HELLO: its
 * id, endpoint, (layer, expert) pairs owned, bytes of the experts it serves
 * and its host's memory. Strings are copied (truncated to 64 / 256 bytes).
 * The number of workers is 1 + the highest w described. */
int shoal_cmetrics_set_worker(shoal_cmetrics *cm, int w, const char *id, const char *endpoint, uint64_t owned,
                              uint64_t expert_bytes, uint64_t mem_total);
/* 1 = answered its HELLO and every request so far; 0 = failed (deadline,
 * error, disconnect). */
void shoal_cmetrics_worker_up(shoal_cmetrics *cm, int w, int up);
/* A local worker w was restarted after it exited (shoal_worker_restarts_total). */
void shoal_cmetrics_worker_restarted(shoal_cmetrics *cm, int w);
/* A local worker w that stopped answering while it had work was killed (shoal_worker_hangs_total). */
void shoal_cmetrics_worker_hung(shoal_cmetrics *cm, int w);
/* Seconds until crash-looping local worker w is restarted again, 0 when it is not backing off
 * (shoal_worker_restart_backoff_seconds; set by whoever reads the supervisor's state). */
void shoal_cmetrics_worker_backoff(shoal_cmetrics *cm, int w, double seconds);

/* ---- hot-path updates --------------------------------------------------- */

/* Failover (replicated experts): worker w's part of an exchange (pairs) was
 * given up and resent to other owners; worker w took over pairs of worker
 * from's lost part; pairs of replicated experts were sent to w by an exchange's pick;
 * ns from a lost part's send to the end of the exchange that resent it. */
void shoal_cmetrics_failover(shoal_cmetrics *cm, int w, uint32_t pairs);
void shoal_cmetrics_takeover(shoal_cmetrics *cm, int from, int w, uint32_t pairs);
void shoal_cmetrics_replica_pick(shoal_cmetrics *cm, int w, uint32_t pairs);
void shoal_cmetrics_failover_time(shoal_cmetrics *cm, uint64_t ns);
/* The same for a trunk step (replicated trunk rows, TRUNK_BATCH): worker w's
 * part (rows of the matrices, each for all the step's tokens) was given up
 * and resent -- one failover, counted in the failovers above too; w took
 * over rows of worker from's lost part. */
void shoal_cmetrics_trunk_failover(shoal_cmetrics *cm, int w, uint64_t rows);
void shoal_cmetrics_trunk_takeover(shoal_cmetrics *cm, int from, int w, uint64_t rows);

void shoal_cmetrics_add_phase(shoal_cmetrics *cm, shoal_cmetrics_phase ph, uint64_t ns);
/* One forward chunk of T tokens completed. */
void shoal_cmetrics_forward(shoal_cmetrics *cm, uint32_t T);

/* Speculative decoding (engine.h shoal_spec_decode): tokens fed, forward
 * passes run for them, tokens drafted into verify chunks, drafts accepted. */
void shoal_cmetrics_spec(shoal_cmetrics *cm, uint64_t fed, uint64_t passes, uint64_t drafted, uint64_t accepted);
/* The scheduler's step loop (coordinator/api/sched.c): one step ran
 * `decode` sequences in one decode batch (0: none) and `prompt` prompt
 * tokens in prefill chunks. */
void shoal_cmetrics_step(shoal_cmetrics *cm, uint32_t decode, uint32_t prompt);
/* Per request, in nanoseconds: submit to admission into a slot (queue),
 * submit to its first generated token (ttft), and between two generated
 * tokens (inter-token, one per token after the first). */
void shoal_cmetrics_request_queue(shoal_cmetrics *cm, uint64_t ns);
void shoal_cmetrics_request_ttft(shoal_cmetrics *cm, uint64_t ns);
void shoal_cmetrics_request_itl(shoal_cmetrics *cm, uint64_t ns);
/* Structured output (issue 36): `masks` masks over the vocabulary computed
 * for constrained slots, of them `overlapped` (counted when used) computed on
 * the mask thread during a forward and, of those, `verify` the masks of a
 * drafted chunk's verify rows (computed during the verify forward from the
 * drafted ids); compute_ns the time computing them (on whichever thread
 * did), wait_ns the time the model thread waited for masks (the part of the
 * mask time the forward did not hide: all of it for a mask computed at
 * sampling time, the join after the forward for those computed during it --
 * reported with masks 0). */
void shoal_cmetrics_constrain_mask(shoal_cmetrics *cm, uint64_t masks, uint64_t overlapped, uint64_t verify,
                                   uint64_t compute_ns, uint64_t wait_ns);

/* One EXPERT_BATCH exchange with worker w for MoE layer `layer`, as seen by
 * the coordinator: rtt_ns from the first byte sent to the reply received;
 * queue_us / compute_us as the worker reported them. */
typedef struct {
    uint32_t tokens;    /* activation rows sent */
    uint32_t pairs;     /* (token, expert) pairs */
    uint32_t experts;   /* distinct experts in the request (weights read once each) */
    uint64_t bytes_out; /* bytes of all frames sent */
    uint64_t bytes_in;  /* bytes of all frames received */
    uint64_t rtt_ns;
    uint64_t queue_us, compute_us;
} shoal_cmetrics_xchg;

void shoal_cmetrics_exchange(shoal_cmetrics *cm, int w, int layer, const shoal_cmetrics_xchg *x);
/* One TRUNK_BATCH exchange with worker w (PROTOCOL.md §3.7), as seen by the
 * coordinator: the output rows it computed (all tokens), the weight bytes
 * those rows are (read once per request), frames' bytes, rtt_ns from the
 * send to the reply received, and the worker's queue_us / compute_us. */
typedef struct {
    uint64_t rows;         /* output rows over every segment */
    uint64_t weight_bytes; /* bytes of those rows of the matrices */
    uint64_t bytes_out, bytes_in;
    uint64_t rtt_ns;
    uint64_t queue_us, compute_us;
} shoal_cmetrics_txchg;

void shoal_cmetrics_trunk(shoal_cmetrics *cm, int w, const shoal_cmetrics_txchg *x);

/* One MoE layer's gather finished: wait_ns = time blocked waiting for
 * replies (after the shared experts), slowest = the worker whose reply came
 * last (-1 if none). */
void shoal_cmetrics_layer_wait(shoal_cmetrics *cm, int layer, uint64_t wait_ns, int slowest);

typedef enum {
    SHOAL_CMETRICS_TIMEOUT, /* no reply within the deadline */
    SHOAL_CMETRICS_ERROR,   /* an ERROR reply, a malformed reply, a send failure */
    SHOAL_CMETRICS_STALE,   /* a late reply to a request already given up, dropped */
} shoal_cmetrics_failure;

void shoal_cmetrics_failure_add(shoal_cmetrics *cm, int w, shoal_cmetrics_failure f);

/* ---- reading ------------------------------------------------------------ */

/* Append the coordinator's families to b (docs/METRICS.md). */
void shoal_cmetrics_write(shoal_cmetrics *cm, shoal_metrics_buf *b);
/* The plain-text report of `shoal run`: the per-token breakdown of the
 * forward tokens since `since` (totals taken earlier; NULL = since open),
 * and when there are workers, the per-worker and per-layer tables (since
 * open). */
typedef struct shoal_cmetrics_totals shoal_cmetrics_totals;
void shoal_cmetrics_report(shoal_cmetrics *cm, FILE *f, const shoal_cmetrics_totals *since);

/* Values for reports and tests. */
struct shoal_cmetrics_totals {
    uint64_t tokens, chunks;
    double phase_s[SHOAL_PHASE_COUNT];
    uint64_t spec_fed, spec_passes, spec_drafted, spec_accepted; /* shoal_cmetrics_spec */
};
void shoal_cmetrics_get_totals(shoal_cmetrics *cm, shoal_cmetrics_totals *out);

typedef struct {
    uint64_t requests, tokens, pairs, experts, bytes_out, bytes_in, weight_bytes;
    uint64_t timeouts, errors, stale, slowest;
    double queue_s, compute_s, network_s, rtt_s;
    /* trunk rows (TRUNK_BATCH), apart from the expert exchanges above */
    uint64_t trunk_requests, trunk_rows, trunk_weight_bytes, trunk_bytes_out, trunk_bytes_in;
    double trunk_queue_s, trunk_compute_s, trunk_network_s;
    double share, fair; /* pairs / all pairs; 1 / workers */
    double rtt_p50, rtt_p90, rtt_p99; /* seconds, NaN when none */
    int up;
} shoal_cmetrics_worker_totals;
int shoal_cmetrics_workers(shoal_cmetrics *cm); /* workers described */
void shoal_cmetrics_get_worker(shoal_cmetrics *cm, int w, shoal_cmetrics_worker_totals *out);
/* max_w pairs(w, layer) / mean_w pairs(w, layer); 0 without pairs or workers */
double shoal_cmetrics_layer_imbalance(shoal_cmetrics *cm, int layer);

#endif
