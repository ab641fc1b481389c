/* planfile: reading a placement plan (plan.json, docs/CLUSTER.md "plan.json";
 * the minimal form is in docs/METRICS.md) for the processes that run from it:
 * `shoal expert --plan FILE --name NAME` takes its RANGES and listen endpoint
 * from its entry, `shoal run|serve --plan FILE` connects to every worker's
 * endpoint, `shoal pack` writes one worker's experts. The planner
 * (coordinator/cmd/plan.h) writes the file. In common/ because both the worker and
 * the coordinator read it (neither includes the other).
 *
 * Only the keys those readers need are kept; ownership coverage is checked by
 * the coordinator from the workers' HELLOs, and RANGES syntax by
 * proto/shard.h where the ranges are used. The object is owned by the caller;
 * strings inside live until shoal_planfile_free. Not thread-safe to build,
 * read-only afterwards. */
#ifndef SHOAL_PLANFILE_H
#define SHOAL_PLANFILE_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_PLANFILE_MAX_WORKERS 4096
#define SHOAL_PLANFILE_MAX_NAME 64

typedef struct {
    char *name;     /* unique, 1..64 bytes */
    char *experts;  /* RANGES (proto/PROTOCOL.md section 7) */
    char *endpoint; /* where the coordinator connects, e.g. tcp://10.0.0.2:5555; NULL if absent */
    char *listen;   /* where the worker binds, e.g. tcp://0.0.0.0:5555; NULL if absent */
    char *host;     /* cluster host name; NULL if absent */
    char *trunk;    /* its trunk rows, a ROWSPEC (PROTOCOL.md §7.1); NULL if absent (`shoal plan --trunk spread`) */
} shoal_planfile_worker;

#define SHOAL_RELAY_GREEDY (-1) /* relay_fanout: the latency-aware schedule, not a fixed fan-out */

typedef struct {
    int nworkers;
    shoal_planfile_worker *workers;
    int has_fingerprint;
    uint8_t fingerprint[32]; /* "model.fingerprint" (hex in the file) when present */
    /* "relay_fanout" (`shoal plan --measured`, PROTOCOL.md §3.9): 0 absent or
     * off; 2..4: the coordinator relays each trunk input through a tree of
     * that fan-out over the workers with trunk rows, which are each other's
     * relay peers (in plan order, at their endpoints); "greedy" (stored as
     * SHOAL_RELAY_GREEDY): through the latency-aware schedule
     * (coordinator/cluster/relaytree.h) for the rates of "relay_rates" */
    int relay_fanout;
    /* "relay_rates": {"nic_gbps", "peer_gbps", "hop_us"}, each > 0 (hop_us
     * >= 0), required with "greedy": the coordinator's send rate, the workers'
     * rate to each other and a relay hop's latency the plan measured; 0 when
     * absent */
    double relay_nic_gbps, relay_peer_gbps, relay_hop_us;
} shoal_planfile;

/* Read and check path: format "shoal-plan", version 1, 1..4096 workers with
 * unique string names and string experts; optional strings endpoint, listen,
 * host, trunk; an optional model.fingerprint of 64 hex digits. Errors name the key:
 * SHOAL_EFORMAT, -errno. */
int shoal_planfile_read(shoal_planfile *p, const char *path, char *err, size_t errlen);
void shoal_planfile_free(shoal_planfile *p); /* accepts a zeroed or freed p */
/* The worker called name, or NULL. */
const shoal_planfile_worker *shoal_planfile_find(const shoal_planfile *p, const char *name);

#endif
