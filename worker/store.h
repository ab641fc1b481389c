/* store: a worker's routed experts under a RAM budget -- a fixed number of
 * expert-sized slots allocated once at open, filled from the safetensors files
 * with pread (O_DIRECT where the filesystem accepts it, into aligned buffers;
 * buffered pread otherwise) when a request needs an expert that is not
 * resident. Used instead of the bank (worker/bank.h, everything mapped) when
 * `shoal expert --cache-gb/--cache-slots` is given. The views it hands out
 * point at the same bytes the mapped bank would show (same offsets modulo the
 * page), so shoal_expert_ffn computes bit-identical outputs.
 *
 * A request's experts are fetched in passes: each pass pins up to `slots`
 * experts and issues every missing read of the pass at once to a small pool of
 * I/O threads; the caller waits for each expert just before computing it (so
 * computing one overlaps reading the next) and then asks for the next pass. So any budget of at least the
 * minimum (one token's experts: min(k, the most experts owned in one layer))
 * serves any request; smaller budgets are refused at open naming the minimum.
 *
 * Callers: the worker's request handler (worker/serve.c), the server (open,
 * close), tests. Not thread-safe: one thread (the request handler's) calls
 * fetch; the I/O threads are internal. */
#ifndef SHOAL_STORE_H
#define SHOAL_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/cachepol.h"
#include "common/k3cfg.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "proto/shard.h"
#include "worker/wmetrics.h"

typedef struct shoal_store shoal_store;

typedef struct {
    uint64_t cache_bytes;       /* RAM budget for the slots; used when slots == 0 */
    uint32_t slots;             /* explicit slot count (tests); 0: from cache_bytes */
    shoal_cachepol_kind policy; /* default LFU (designated-initialiser zero is LRU: set it) */
    int io_threads;             /* concurrent reads; 0: 8 */
    int no_direct;              /* 1: never try O_DIRECT */
} shoal_store_opts;

typedef struct {
    uint64_t hits, misses;    /* expert fetches found resident (prefetch hits apart) / read from disk on demand */
    uint64_t prefetch_hits;   /* fetches of an expert a hint brought in (or is bringing in), its first use */
    uint64_t prefetch_reads;  /* experts read because of a hint */
    uint64_t prefetch_wasted; /* of those, evicted before any use */
    uint64_t prefetch_bytes;  /* bytes read for hints (not in bytes_read) */
    uint64_t bytes_read;      /* bytes read from disk on demand (aligned spans included) */
    uint64_t read_us;         /* wall time the caller was blocked waiting for reads (demand or prefetch) */
    uint32_t slots;           /* slots allocated */
    uint32_t min_slots;       /* the minimum budget in slots */
    uint64_t slot_bytes;      /* bytes of one slot */
    uint64_t expert_bytes;    /* weight bytes of one expert (no alignment padding) */
    uint64_t owned;           /* experts owned */
    int direct;               /* 1: every file is read with O_DIRECT */
} shoal_store_stats;

/* st may be opened with map=0 (only headers and offsets are used); it must
 * outlive the store (file paths). Refuses (SHOAL_ECONFIG) a budget below the
 * minimum, naming the minimum in bytes and slots; SHOAL_EMODEL for a missing
 * or mis-shaped tensor; -errno for a file that cannot be opened. The number of
 * slots is capped at the experts owned (a budget above that is fully
 * resident after the first reads). */
int shoal_store_open(shoal_store **out, const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own,
                     const shoal_store_opts *o, char *err, size_t errlen);
void shoal_store_close(shoal_store *s); /* accepts NULL */

/* The bytes one slot needs and the minimum slots, without opening (for the
 * memory plan and refusals). 0 or an error as shoal_store_open. */
int shoal_store_plan(const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own, uint64_t *slot_bytes,
                     uint32_t *min_slots, char *err, size_t errlen);

/* Make the leading experts of experts[n] (distinct, owned, of MoE layer
 * `layer`) resident and pinned: returns m in 1..n with views[0..m-1] set
 * (valid until the next fetch), or a negative error (SHOAL_ERANGE: an expert
 * out of range or not owned; nothing is changed). The reads of the missing
 * ones are issued before it returns and complete in the background, in entry
 * order: call shoal_store_wait(i) before reading views[i]'s weights, so the
 * caller computes expert i while later ones are still being read. */
int shoal_store_fetch(shoal_store *s, int layer, const int32_t *experts, int n, const shoal_expert_w **views,
                      char *err, size_t errlen);

/* Block until entry i of the last fetch is in memory. 0, or the error of a
 * failed read of the pass (-errno / SHOAL_EIO naming the file): then the
 * pass's missed experts are forgotten and every later wait of the pass fails
 * too. The time blocked is counted as read_us (the reads not hidden behind
 * computation). */
int shoal_store_wait(shoal_store *s, int i, char *err, size_t errlen);

/* A hint (PROTOCOL.md PREFETCH): start reading, in the background, the
 * experts of experts[n] (of MoE layer `layer`) that are owned and not
 * resident, into free slots or the policy's victims -- never a slot still
 * being filled, never one holding another expert of the same hint; ids out of
 * range or not owned are skipped. The key is inserted without counting a use
 * (shoal_cachepol_insert): its first fetch is a prefetch hit (waiting for the
 * read if it is still in flight), and it is counted wasted if evicted before.
 * Call between requests: the views of the last fetch are no longer valid
 * afterwards (as after the next fetch). Returns the reads started (experts).
 * Demand reads always go before queued prefetch reads; a failed prefetch read
 * only forgets that expert (a fetch that waits on it fails as any read). */
int shoal_store_prefetch(shoal_store *s, int layer, const int32_t *experts, int n);

/* Block until every read in flight (demand and prefetch) has landed. */
void shoal_store_drain(shoal_store *s);

/* Report hits, misses and reads to wm from now on (borrowed; may be NULL). */
void shoal_store_set_metrics(shoal_store *s, shoal_wmetrics *wm);

int shoal_store_owns(const shoal_store *s, int layer, int expert);
int shoal_store_d(const shoal_store *s);
int shoal_store_f(const shoal_store *s);
float shoal_store_b1(const shoal_store *s);
float shoal_store_b2(const shoal_store *s);
uint64_t shoal_store_bytes(const shoal_store *s); /* weight bytes of the owned experts */
void shoal_store_stats_get(const shoal_store *s, shoal_store_stats *out);

#endif
