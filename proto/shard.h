/* shard: which routed experts a worker owns (PROTOCOL.md §7). Parses and
 * formats RANGES strings ("1-92:0-447,5:3"), holds a worker's ownership as a
 * bitmap for O(1) checks, splits a model evenly over N workers, and checks that a
 * set of workers covers every expert of every MoE layer (exactly once, or at
 * least once when replicas are allowed). Pure: no
 * I/O. Callers: the worker (its own --experts), the coordinator (HELLO replies,
 * --workers N), tests. Range lists are plain arrays owned by the caller (freed
 * with free()); a shoal_shard is immutable after open and safe to read from any
 * thread. */
#ifndef SHOAL_SHARD_H
#define SHOAL_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

/* Syntax only: groups "LAYERS:EXPERTS" separated by commas, each side "a" or
 * "a-b" (inclusive, decimal, a <= b < 2^31). *out is allocated (free()). */
int shoal_shard_parse(const char *spec, shoal_proto_range **out, size_t *n, char *err, size_t errlen);

/* Write ranges as a RANGES string; 0, or SHOAL_ERANGE if it does not fit. */
int shoal_shard_format(const shoal_proto_range *r, size_t n, char *buf, size_t cap);

/* Check ranges against a model: layers < num_layers and MoE, experts <
 * num_experts. Names the first offending range. 0 or SHOAL_ERANGE. */
int shoal_shard_check(const shoal_proto_range *r, size_t n, int num_layers, const uint8_t *is_moe, int num_experts,
                      char *err, size_t errlen);

typedef struct shoal_shard shoal_shard;

/* Ownership bitmap of ranges (checked with shoal_shard_check first). */
/* n may be 0: an empty ownership (a worker that serves trunk rows only). */
int shoal_shard_open(shoal_shard **out, const shoal_proto_range *r, size_t n, int num_layers, const uint8_t *is_moe,
                     int num_experts, char *err, size_t errlen);
void shoal_shard_close(shoal_shard *s); /* accepts NULL */
/* Signature of shoal_proto_limits.owns: ctx is a const shoal_shard *. Out-of-range
 * arguments return 0. */
int shoal_shard_owns(const void *ctx, int layer, int expert);
size_t shoal_shard_count(const shoal_shard *s); /* owned (layer, expert) pairs */

/* Worker w of n (0 <= w < n <= num_experts): experts [w*E/n, (w+1)*E/n) of every
 * MoE layer, as ranges (one per run of consecutive MoE layers). */
int shoal_shard_split(int w, int n, int num_layers, const uint8_t *is_moe, int num_experts, shoal_proto_range **out,
                      size_t *nout, char *err, size_t errlen);

/* Coverage of nw workers' ranges: fills owner[layer * num_experts + e] with the
 * index of the worker owning it (-1 for non-MoE layers). Returns 0 if every
 * expert of every MoE layer is owned exactly once, else SHOAL_ECONFIG with err
 * listing the gaps ("layers 1-8 experts 4-7: owned by no worker") and overlaps
 * ("layer 3 expert 2: owned by w0 and w1"), runs merged, names from names[]. */
int shoal_shard_cover(int nw, const shoal_proto_range *const *r, const size_t *nr, const char *const *names,
                      int num_layers, const uint8_t *is_moe, int num_experts, int32_t *owner, char *err,
                      size_t errlen);

/* The same with replicas allowed (PROTOCOL.md section 7): an expert may be
 * owned by several workers; only gaps are refused (SHOAL_ECONFIG, listed as
 * above). owner[] gets the lowest-index owner; *replicated (may be NULL) the
 * number of (layer, expert) owned by two workers or more. */
int shoal_shard_cover_replicas(int nw, const shoal_proto_range *const *r, const size_t *nr, const char *const *names,
                               int num_layers, const uint8_t *is_moe, int num_experts, int32_t *owner,
                               size_t *replicated, char *err, size_t errlen);

#endif
