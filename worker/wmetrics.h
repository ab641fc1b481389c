/* wmetrics: the expert server's own metrics (docs/METRICS.md, "Expert
 * server"): requests by type, errors by code, batches, tokens, pairs,
 * per-expert hit counts, weight bytes read, queue wait and compute time
 * (histograms), frame bytes, resident memory and uptime; written as
 * Prometheus text and served on `shoal expert --metrics-port` by a tiny
 * blocking HTTP responder on its own thread (GET /metrics only; no libuv in
 * worker/). STATS over the protocol keeps answering from the request
 * handler's counters; this module adds what an operator scrapes directly.
 *
 * Callers: the worker's request handler and server loop (updates), the
 * `shoal expert` command (open, listen, close), tests.
 * Thread-safety: updates are lock-free (relaxed atomics) and never allocate
 * or log; the HTTP thread only reads them. */
#ifndef SHOAL_WMETRICS_H
#define SHOAL_WMETRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"

typedef struct {
    const char *id;        /* worker id (label), copied */
    int num_layers;        /* model layers */
    const uint8_t *is_moe; /* [num_layers], copied */
    int num_experts;       /* routed experts per MoE layer */
    uint64_t expert_bytes; /* bytes of one expert's weights (weight bytes read) */
    uint64_t owned;        /* (layer, expert) pairs owned */
} shoal_wmetrics_opts;

typedef struct shoal_wmetrics shoal_wmetrics;

int shoal_wmetrics_open(shoal_wmetrics **out, const shoal_wmetrics_opts *o, char *err, size_t errlen);
/* Stops the HTTP thread (if any) and frees. Accepts NULL. */
void shoal_wmetrics_close(shoal_wmetrics *wm);

/* ---- hot-path updates (wm may be NULL: no-op) -------------------------- */

/* A message was received (type: its decoded type, 0 if it did not decode;
 * bytes: all its frames). */
void shoal_wmetrics_request(shoal_wmetrics *wm, int type, uint64_t bytes);
/* A reply was sent (bytes: all its frames); perr != 0 when it was an ERROR
 * with that PROTOCOL.md code. */
void shoal_wmetrics_reply(shoal_wmetrics *wm, uint64_t bytes, int perr);
/* A reply could not be sent (peer gone, ZeroMQ error). */
void shoal_wmetrics_send_failed(shoal_wmetrics *wm);
/* An EXPERT_BATCH was served: T rows, n pairs, the distinct experts it ran
 * (each read once), queue and compute time as put in the reply. */
void shoal_wmetrics_batch(shoal_wmetrics *wm, uint32_t T, uint32_t n, uint32_t distinct, uint64_t queue_us,
                          uint64_t compute_us);
/* count tokens of a served batch were routed to (layer, expert). */
void shoal_wmetrics_expert(shoal_wmetrics *wm, int layer, int expert, uint32_t count);
/* A served request's activation frame (EXPERT_BATCH act, TRUNK_BATCH x):
 * its payload bytes (header excluded), by wire dtype (SHOAL_WIRE_F32 or
 * SHOAL_WIRE_BF16; PROTOCOL.md 1.7). */
void shoal_wmetrics_activation(shoal_wmetrics *wm, int dtype, uint64_t bytes);

/* The expert cache (worker/store.h): its size, set once at start (0 slots:
 * experts mapped, no cache) ... */
void shoal_wmetrics_cache_config(shoal_wmetrics *wm, uint32_t slots, uint64_t slot_bytes);
/* ... and, per fetch pass, the experts found resident (hits), read from disk
 * (misses), the bytes read and the microseconds waited for the reads. */
void shoal_wmetrics_cache(shoal_wmetrics *wm, uint64_t hits, uint64_t misses, uint64_t bytes, uint64_t read_us);

/* Prefetch hints (worker/store.h): expert reads started by hints and their
 * bytes, prefetch hits (a hinted expert's first use), wasted prefetches
 * (evicted unused); and a PREFETCH notice dropped (malformed, before HELLO,
 * not an MoE layer). */
void shoal_wmetrics_prefetch(shoal_wmetrics *wm, uint64_t reads, uint64_t bytes, uint64_t hits, uint64_t wasted);
void shoal_wmetrics_prefetch_dropped(shoal_wmetrics *wm);

/* The relay tree (PROTOCOL.md §3.9, 1.8): TRUNK_X taken from a relay parent
 * (IN), sent to a child (OUT), a request or an input parked for its other
 * half (PARKED), one expired unpaired (EXPIRED), an input not forwarded or
 * not kept (DROPPED: a child's queue refused it, the park was full, its
 * subtree named a peer this worker does not have), a TRUNK_X from a
 * connection that is not a relay parent (REFUSED). */
typedef enum {
    SHOAL_WRELAY_IN,
    SHOAL_WRELAY_OUT,
    SHOAL_WRELAY_PARKED,
    SHOAL_WRELAY_EXPIRED,
    SHOAL_WRELAY_DROPPED,
    SHOAL_WRELAY_REFUSED,
    SHOAL_WRELAY_N
} shoal_wrelay_event;
void shoal_wmetrics_relay(shoal_wmetrics *wm, shoal_wrelay_event ev);
/* Bytes of a TRUNK_X's x frame (header included) taken from a relay parent. */
void shoal_wmetrics_relay_in_bytes(shoal_wmetrics *wm, uint64_t bytes);

/* ---- reading ------------------------------------------------------------ */

void shoal_wmetrics_write(shoal_wmetrics *wm, shoal_metrics_buf *b);
uint64_t shoal_wmetrics_expert_hits(shoal_wmetrics *wm, int layer, int expert);

/* Serve GET /metrics on host:port (IPv4 dotted address or "localhost"; port
 * 0 picks a free one) from a thread of its own. Returns 0 and the bound port
 * in *bound, or -errno / SHOAL_EINVAL naming the address. At most once. */
int shoal_wmetrics_listen(shoal_wmetrics *wm, const char *host, int port, int *bound, char *err, size_t errlen);

/* Resident set size of this process in bytes (/proc/self/statm; 0 if
 * unreadable). */
uint64_t shoal_wmetrics_rss_bytes(void);

#endif
