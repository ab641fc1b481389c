/* trunk_client: the remote trunk matmul backend (coordinator/engine/rmat.h)
 * over the trunk servers (PROTOCOL.md §3.7, §7.1). It is an expert client
 * (expert_client.h) opened in the trunk role: the same links code (connect,
 * HELLO with version, fingerprint and trunk-fingerprint checks, CURVE, down
 * and back, the keeper thread), on its own DEALER per worker, so a trunk
 * request and the layer's outstanding expert batch never share a reply
 * stream (the shared experts run between the expert submit and gather).
 *
 * Per call: submit() splits every job's rows over the workers by the
 * placement fixed at open (every row exactly once), packs one TRUNK_BATCH per
 * involved worker (all its segments, one shared input frame) and sends them
 * all before reading any reply; gather() waits for every involved worker or
 * the deadline and scatters the rows into each job's y. Failures name the
 * worker (deadline, disconnect, ERROR, malformed reply); y is then not to be
 * used. The forward thread allocates nothing here. */
#ifndef SHOAL_TRUNK_CLIENT_H
#define SHOAL_TRUNK_CLIENT_H

#include "coordinator/cluster/expert_client.h"
#include "coordinator/engine/engine.h" /* rmat.h through the public header */

/* o->trunk_role and o->st must be set. Errors as shoal_expert_client_open;
 * SHOAL_ECONFIG: no worker announces trunk rows, or rows of an announced
 * matrix are owned by no worker (named). */
int shoal_trunk_client_open(shoal_expert_client **out, const shoal_expert_client_opts *o, char *err, size_t errlen);
/* The backend view: {vt, c}; vt->close closes c. */
shoal_rmat shoal_trunk_client_backend(shoal_expert_client *c);
/* Requests (round trips) and TRUNK_BATCH messages since open. */
void shoal_trunk_client_counts(shoal_expert_client *c, uint64_t *requests, uint64_t *messages);
/* Report each TRUNK_BATCH exchange to cm (shoal_cmetrics_trunk), under the
 * worker indexes the expert client over the same endpoints described
 * (shoal_expert_client_set_metrics first). cm outlives the client. */
void shoal_trunk_client_set_metrics(shoal_expert_client *c, shoal_cmetrics *cm);

/* Matrices the workers' announcements make remote. */
int shoal_trunk_client_nremote(const shoal_expert_client *c);

#endif
