/* replay: offline replay of routing traces (coordinator/obs/trace.h) against the
 * expert cache's replacement policies (common/cachepol.h) -- the evidence for
 * the worker's choice of policy. The access sequence is the one a worker
 * owning every expert would see: each run of consecutive records of one layer
 * is one request, whose distinct experts are fetched in ascending order in
 * passes of at most `slots` pinned experts (worker/store.c does the same), so
 * the hit rates are those the store would get. Policies: LRU, LFU with aging,
 * LFU seeded with the heat of another trace, and Belady's optimum (OPT, an
 * upper bound no online policy reaches).
 * Callers: `shoal trace replay`, tests. */
#ifndef SHOAL_REPLAY_H
#define SHOAL_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "common/cachepol.h"
#include "coordinator/obs/obs.h"

#define SHOAL_REPLAY_GROUP 0x80000000u /* flag on a key: the first access of a request */

/* The access sequence of f: keys (layer * num_experts + expert), each
 * request's first key flagged with SHOAL_REPLAY_GROUP. *keys allocated
 * (free()). */
void shoal_replay_keys(const shoal_trace_file *f, uint32_t **keys, uint64_t *n);

/* Hits of one policy with nslots slots over keys[n] (< nkeys once unflagged).
 * seed: LFU starting counts [nkeys] or NULL. aging 0: the policy's default.
 * 0, or SHOAL_EINVAL. */
int shoal_replay_run(const uint32_t *keys, uint64_t n, uint32_t nkeys, uint32_t nslots, shoal_cachepol_kind kind,
                     uint64_t aging, const uint64_t *seed, uint64_t *hits, char *err, size_t errlen);

/* `shoal trace replay FILE --cache-slots N[,N...] [--heat TRACE] [--aging N]
 * [--json]` (argv[0] is "replay"). */
int shoal_replay_cmd(int argc, char **argv);

#endif
