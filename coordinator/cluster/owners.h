/* owners: which expert workers own each routed expert (layer, expert) -- one,
 * or several when a plan replicates it (docs/CLUSTER.md, "Replicas") -- and,
 * for each expert exchange, the choice of one owner per expert so that the
 * work is spread over the owners.
 *
 * Built by the expert client from the workers' HELLO ranges: every expert of
 * every MoE layer must be owned at least once (a gap is refused naming it,
 * proto/shard.h); overlaps are replicas. The choice is deterministic (a
 * function of the owner sets and the exchange's routing only) and balances the
 * (token, expert) pairs each worker gets in the exchange: the experts with one
 * owner are fixed; the replicated experts of the exchange, most pairs first
 * (ties to the lower id), each go to the owner with the fewest pairs so far
 * (ties to the lower worker index), among the owners that are up. Any choice gives the same bits: every
 * worker computes an expert with the same kernels (PROTOCOL.md section 8).
 *
 * Not thread-safe: one owner thread (the expert client's caller). pick does
 * not allocate (scratch sized at open). */
#ifndef SHOAL_OWNERS_H
#define SHOAL_OWNERS_H

#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

typedef struct shoal_owners shoal_owners;

/* Owner sets of nw workers' ranges r[w][0..nr[w]) (each already checked with
 * shoal_shard_check) on a model of num_layers x num_experts; names[w] name
 * the workers in the refusal. 0, or SHOAL_ECONFIG listing the gaps. */
int shoal_owners_open(shoal_owners **out, int nw, const shoal_proto_range *const *r, const size_t *nr,
                      const char *const *names, int num_layers, const uint8_t *is_moe, int num_experts, char *err,
                      size_t errlen);
void shoal_owners_close(shoal_owners *o); /* accepts NULL */

/* (layer, expert) pairs worker w owns, replicas included. */
size_t shoal_owners_count(const shoal_owners *o, int w);
/* (layer, expert) pairs owned by two workers or more. */
size_t shoal_owners_replicated(const shoal_owners *o);
/* The owners of (layer, expert), ascending worker index: returns their number
 * (0 for a dense layer or out of range) and sets *who (borrowed, lives as long
 * as o). */
int shoal_owners_of(const shoal_owners *o, int layer, int expert, const int32_t **who);

/* One exchange at MoE layer `layer`: ids[T * k] are the routed experts of T
 * tokens. Sets pick[e] (pick has num_experts entries) to the chosen owner of
 * every expert e in ids that is in range; other entries are left as they
 * are. Out-of-range ids are skipped (the caller refuses them). live[w] (or
 * NULL: all) says which workers may be picked: a replicated expert goes to
 * a live owner only (failover: the dead ones are passed over), or to its
 * lowest owner when none is live (the caller then fails the request naming
 * it); a single-owner expert always goes to its owner. Also used on a
 * compact list of experts (T = n, k = 1), e.g. for the resend of a lost
 * worker's pairs and for the prefetch hints. */
void shoal_owners_pick(shoal_owners *o, int layer, int T, int k, const int32_t *ids, const uint8_t *live,
                       int32_t *pick);

#endif
