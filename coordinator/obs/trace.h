/* trace: routing traces -- every routing decision (token, MoE layer, the k
 * experts chosen) written by the coordinator's forward to a compact binary
 * file (format: docs/METRICS.md, "Routing traces"), read back, and summarised:
 * per-expert heat, per-layer concentration, and, for a placement plan
 * (plan.json, same section), each worker's expected load share and the
 * imbalance. Callers: the engine's forward (shoal_trace_record, through
 * shoal_model_set_routing_trace), `shoal run|serve --trace`, `shoal trace
 * stats`, the planner (deployment issue), tests.
 *
 * Writer thread-safety: one thread at a time (the forward's). The writer
 * buffers records in memory allocated at create and writes them with write(2)
 * when the buffer fills: recording never allocates and never logs; a write
 * error is sticky and reported by shoal_trace_close. */
#ifndef SHOAL_TRACE_H
#define SHOAL_TRACE_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_TRACE_MAGIC "SHOALRT\0"
#define SHOAL_TRACE_MAJOR 1
#define SHOAL_TRACE_MINOR 0
#define SHOAL_TRACE_HDR_BYTES 64
#define SHOAL_TRACE_MAX_K 64
#define SHOAL_TRACE_NO_EXPERT 0xFFFFu /* an unused expert slot */

typedef struct {
    uint32_t num_layers;  /* model layers (records name absolute 0-indexed layers) */
    uint32_t num_experts; /* routed experts per MoE layer, <= 65535 */
    uint32_t k;           /* experts per token, 1..SHOAL_TRACE_MAX_K */
    uint8_t fingerprint[32]; /* the model fingerprint (PROTOCOL.md §5), zeros if unknown */
} shoal_trace_hdr;

/* Bytes of one record for k experts per token: 8 + 2k. */
static inline size_t shoal_trace_record_bytes(uint32_t k)
{
    return 8 + 2 * (size_t)k;
}

/* ---- writing -------------------------------------------------------------- */

typedef struct shoal_trace shoal_trace;

/* Create (truncate) path and write the header. 0, SHOAL_EINVAL (bad header
 * fields) or -errno, naming the path. */
int shoal_trace_create(shoal_trace **out, const char *path, const shoal_trace_hdr *h, char *err, size_t errlen);
/* Record one MoE layer's routing for a chunk of T tokens: ids[T, k], each
 * row ascending (the engine's canonical order). Token ordinals are assigned
 * here: they count every token the forward ran since create, in order; a
 * layer not above the previous call's layer starts the next chunk. Never
 * allocates; an invalid argument (layer or id out of the header's range, k
 * different from the header's) makes the trace fail (sticky). */
void shoal_trace_record(shoal_trace *t, int layer, int T, int k, const int32_t *ids);
uint64_t shoal_trace_count(const shoal_trace *t); /* records written so far */
/* Flush, close, free. Returns 0 or the first error met (naming the path).
 * Accepts NULL (returns 0). */
int shoal_trace_close(shoal_trace *t, char *err, size_t errlen);

/* ---- reading -------------------------------------------------------------- */

typedef struct {
    uint32_t token, layer, n; /* n valid experts (<= k) */
    uint16_t experts[SHOAL_TRACE_MAX_K];
} shoal_trace_rec;

typedef struct shoal_trace_file shoal_trace_file;

/* Map a trace and validate it all: magic, major version (a different major
 * is refused naming both), header fields, and every record (layer < num_layers,
 * n <= k, experts < num_experts and strictly ascending, unused slots
 * 0xFFFF). A trailing partial record (a writer killed
 * mid-write) is ignored and counted in trailing_bytes; anything else is
 * refused with SHOAL_EFORMAT naming the record and field. */
int shoal_trace_open(shoal_trace_file **out, const char *path, char *err, size_t errlen);
void shoal_trace_file_close(shoal_trace_file *f); /* accepts NULL */
const shoal_trace_hdr *shoal_trace_file_hdr(const shoal_trace_file *f);
uint64_t shoal_trace_file_count(const shoal_trace_file *f);
uint64_t shoal_trace_file_trailing(const shoal_trace_file *f); /* bytes of a partial last record */
/* Record i (< count) of a validated file. */
void shoal_trace_file_get(const shoal_trace_file *f, uint64_t i, shoal_trace_rec *out);

/* ---- statistics ----------------------------------------------------------- */

typedef struct {
    uint32_t num_layers, num_experts, k;
    uint64_t records, pairs;
    uint64_t tokens;          /* span of token ordinals: max - min + 1 */
    uint64_t *hits;           /* [num_layers * num_experts]: pairs routed to (layer, expert) */
    uint64_t *layer_pairs;    /* [num_layers] */
    uint64_t *layer_records;  /* [num_layers]: tokens routed at that layer */
} shoal_trace_stats;

/* Concentration of one layer's hits (uniform routing: max_over_mean 1,
 * top10_share ~0.1, entropy 1, cold 0). */
typedef struct {
    double max_over_mean; /* hottest expert's hits / mean hits per expert */
    double top10_share;   /* share of pairs on the ceil(E/10) hottest experts */
    double entropy;       /* -sum p log p / log E over the layer's experts */
    uint32_t cold;        /* experts with no hit */
} shoal_trace_conc;

/* Fills s (allocating its arrays; free with shoal_trace_stats_free). */
void shoal_trace_stats_compute(const shoal_trace_file *f, shoal_trace_stats *s);
void shoal_trace_stats_free(shoal_trace_stats *s);
/* Concentration of layer l; 0 if the layer has no pairs (out untouched). */
int shoal_trace_layer_conc(const shoal_trace_stats *s, uint32_t l, shoal_trace_conc *out);

/* ---- plans ---------------------------------------------------------------- */
/* A placement plan (docs/METRICS.md, "plan.json"): named workers, each owning
 * RANGES of (layer, expert). An expert owned by several workers (replicas)
 * has its load split equally between them. */

#define SHOAL_TRACE_MAX_NAME 64

typedef struct {
    int nworkers;
    char (*names)[SHOAL_TRACE_MAX_NAME + 1]; /* [nworkers] */
    /* own[w * num_layers * num_experts + l * num_experts + e]: 1 if worker w
     * owns (l, e) */
    uint8_t *own;
    uint32_t num_layers, num_experts;
} shoal_trace_plan;

/* Read plan.json for a model of num_layers x num_experts. Refused naming the
 * field: bad JSON, a missing or ill-typed key, an unknown format or version,
 * a duplicate worker name, a bad RANGES string, a range outside the model.
 * Coverage is checked against a trace by shoal_trace_plan_load. */
int shoal_trace_plan_read(shoal_trace_plan *p, const char *path, uint32_t num_layers, uint32_t num_experts,
                          char *err, size_t errlen);
void shoal_trace_plan_free(shoal_trace_plan *p);

typedef struct {
    double *load;       /* [nworkers * num_layers]: expected pairs of worker w at layer l */
    double *share;      /* [nworkers]: share of all pairs */
    double *fair;       /* [nworkers]: 1 / nworkers */
    uint64_t *owned;    /* [nworkers]: (layer, expert) pairs owned */
    double *layer_imb;  /* [num_layers]: max_w load / mean_w load (0 when no pairs) */
    double imbalance;   /* max_w share / mean_w share */
    double layer_weighted; /* sum_l max_w load / sum_l mean_w load: the expected
                              slowdown of waiting on the slowest worker per layer */
} shoal_trace_load;

/* Expected load of each worker under plan p for the routing in s. Every
 * (layer, expert) with hits must be owned by some worker, else SHOAL_ECONFIG
 * naming it. Arrays allocated (free with shoal_trace_load_free). */
int shoal_trace_plan_load(const shoal_trace_plan *p, const shoal_trace_stats *s, shoal_trace_load *out, char *err,
                          size_t errlen);
void shoal_trace_load_free(shoal_trace_load *l);

#endif
