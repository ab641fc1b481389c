/* trunk_client: the remote trunk matmul backend (coordinator/engine/rmat.h)
 * over the trunk servers (PROTOCOL.md §3.7, §7.1). It is an expert client
 * (expert_client.h) opened in the trunk role: the same links code (connect,
 * HELLO with version, fingerprint and trunk-fingerprint checks, CURVE, down
 * and back, the keeper thread), on its own DEALER per worker, so a trunk
 * request and the layer's outstanding expert batch never share a reply
 * stream (the shared experts run between the expert submit and gather).
 *
 * At open the workers' announced rows are cut into row cells, each with its
 * owners (proto/tshard.h; several when rows are replicated, `shoal plan
 * --trunk spread --replicas R`). Per call: submit() picks one owner that is
 * up for every cell of every job (shoal_tshard_pick: every row exactly once,
 * spread over the live owners), joins each worker's consecutive cells of one
 * announced range into segments, packs one TRUNK_BATCH per involved worker
 * (all its segments, one shared input frame) and sends them all before
 * reading any reply; gather() waits for every involved worker and scatters
 * the rows into each job's y. Failover, as the expert exchange: a worker that
 * disconnects, answers badly, cannot be sent to, or stays silent past
 * opts.failover_ms while each of its cells has another owner up, is marked
 * down (the keeper re-probes it) and its cells are resent to their other
 * owners in a new round under the same deadline; the rows are the same bits
 * whoever computes them. A cell left with no owner up, or the deadline, fails
 * the call naming the worker; y is then not to be used. The forward thread
 * allocates nothing here. */
#ifndef SHOAL_TRUNK_CLIENT_H
#define SHOAL_TRUNK_CLIENT_H

#include "coordinator/cluster/expert_client.h"
#include "coordinator/engine/engine.h" /* rmat.h through the public header */

/* o->trunk_role and o->st must be set. Errors as shoal_expert_client_open;
 * SHOAL_ECONFIG: no worker announces trunk rows, or rows of an announced
 * matrix are owned by no worker (named). Rows owned by several workers are
 * replicas. */
int shoal_trunk_client_open(shoal_expert_client **out, const shoal_expert_client_opts *o, char *err, size_t errlen);
/* The backend view: {vt, c}; vt->close closes c. */
shoal_rmat shoal_trunk_client_backend(shoal_expert_client *c);
/* Requests (round trips) and TRUNK_BATCH messages since open. */
void shoal_trunk_client_counts(shoal_expert_client *c, uint64_t *requests, uint64_t *messages);
/* The relay tree (PROTOCOL.md §3.9): the fan-out it was opened with (0:
 * off), requests sent without x (their input went through the tree), and
 * relayed requests resent directly after a relay failed. */
void shoal_trunk_client_relay_counts(shoal_expert_client *c, int *fanout, uint64_t *relayed, uint64_t *fallbacks);
/* Report each TRUNK_BATCH exchange to cm (shoal_cmetrics_trunk), under the
 * worker indexes the expert client over the same endpoints described
 * (shoal_expert_client_set_metrics first). cm outlives the client. */
void shoal_trunk_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm);

/* Matrices the workers' announcements make remote. */
int shoal_trunk_client_nremote(const shoal_expert_client *c);

#endif
