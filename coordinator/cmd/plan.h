/* plan: the cluster manifest (docs/CLUSTER.md) and the placement planner
 * behind `shoal plan`: assigns every routed expert (layer, expert) of a model
 * to one worker host so that each host's expert budget holds its share and the
 * expected load is balanced (by routing-trace hits when given, else by
 * bytes), deterministically for the same inputs; optionally gives the hottest
 * experts of each layer a second owner (hot replicas, --hot) with the room left,
 * or puts every expert on R + 1 distinct hosts (--replicas R, failover).
 *
 * shoal_plan_compute is pure (arrays in, owner map out), so the tests drive it
 * with hand-computed cases; shoal_plan_cluster_read parses the manifest; the
 * command (plan_cmd.c) wires in the model config, the trace and writes
 * plan.json. Callers: `shoal plan`, tests. Objects are owned by the caller. */
#ifndef SHOAL_PLAN_H
#define SHOAL_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_PLAN_MAX_HOSTS 4096
#define SHOAL_PLAN_MAX_NAME 64

typedef struct {
    char name[SHOAL_PLAN_MAX_NAME + 1]; /* unique; also the worker's name in the plan */
    char address[256];                  /* DNS name or IP the coordinator and SSH reach */
    char ssh_user[65];
    int ssh_port;                       /* 22 unless given */
    int cpus;                           /* >= 1 */
    uint64_t expert_ram;                /* bytes of expert weights this host may hold (0: not a worker) */
    uint64_t disk;                      /* bytes of disk for its pack; 0: not limited */
    int port;                           /* worker port (the manifest's worker_port unless given) */
    char domain[SHOAL_PLAN_MAX_NAME + 1]; /* failure domain (rack, zone, provider); "" when not given */
} shoal_plan_host;

typedef struct {
    int nhosts;
    shoal_plan_host *hosts;
    int coordinator; /* index into hosts */
    int worker_port;
} shoal_plan_cluster;

/* Parse a manifest; every bad or missing field is refused naming it
 * (SHOAL_EFORMAT / SHOAL_ECONFIG), -errno on I/O. */
int shoal_plan_cluster_read(shoal_plan_cluster *c, const char *path, char *err, size_t errlen);
int shoal_plan_cluster_parse(shoal_plan_cluster *c, const char *json, size_t len, const char *what, char *err,
                             size_t errlen);
void shoal_plan_cluster_free(shoal_plan_cluster *c); /* accepts a zeroed or freed c */

/* "400GiB", "1.5TB", "512MiB", "1000000" (bytes), or a JSON integer in the
 * manifest: binary (KiB MiB GiB TiB) and decimal (KB MB GB TB) units. */
int shoal_plan_parse_bytes(const char *s, uint64_t *out);

typedef struct {
    int num_layers, num_experts;
    const uint8_t *is_moe;   /* [num_layers] */
    uint64_t expert_bytes;   /* bytes of one routed expert */
    const uint64_t *hits;    /* [num_layers * num_experts] routing-trace hits, or NULL: uniform */
    int nworkers;
    const uint64_t *budget;  /* [nworkers] bytes each worker may hold */
} shoal_plan_in;

/* owner[l * num_experts + e] = worker index for every expert of a MoE layer,
 * -1 for the others. Method (docs/CLUSTER.md): 1) counts: each worker holds
 * as equal a number of experts as the budgets allow (water filling, the
 * remainder to the lowest indexes); 2) per layer, each worker's count is its
 * remaining count over the remaining layers, largest remainders first (ties
 * to the lower index); 3) inside a layer, without hits each worker takes a
 * contiguous block in worker order; with hits the experts are taken hottest
 * first (ties to the lower id) and each goes to the worker with the least
 * load at that layer that still has room (ties to the lower index).
 * Returns 0, SHOAL_ECONFIG with err saying by how much the budgets are short,
 * or SHOAL_EINVAL. */
int shoal_plan_compute(const shoal_plan_in *in, int32_t *owner, char *err, size_t errlen);

/* Replicas, after shoal_plan_compute: at every MoE layer the `replicas`
 * hottest experts (hits descending, ties to the lower id; without hits the
 * lowest ids) get a second owner: replica[l * num_experts + e] = that worker,
 * -1 for the others. Each goes to the worker, other than its owner, with room
 * left in its budget and the least expected load at that layer (the loads of
 * shoal_plan_load as replicas are added; ties to the worker with more room
 * left, then the lower index). An expert whose owner is the only worker with room
 * is passed over for the next hottest. Returns 0 (replicas == 0: every entry
 * -1), SHOAL_ECONFIG when the budgets have no room for them (saying by how
 * much) or a layer cannot take them, SHOAL_EINVAL for replicas out of
 * 0..num_experts or fewer than two workers. */
int shoal_plan_replicate(const shoal_plan_in *in, int replicas, const int32_t *owner, int32_t *replica, char *err,
                         size_t errlen);

/* Expected load of worker w at layer l in load[w * num_layers + l] (trace
 * hits, or 1 per expert without hits; 0 at dense layers). Every expert's
 * load starts on its owner; then each replicated expert, hottest first (ties
 * to the lower id), moves from its owner to its replica as much of its load
 * as levels the two (none if the replica is the busier): a conservative
 * model of the coordinator sending each exchange's pairs to the less loaded
 * owner (coordinator/cluster/owners.h); it never raises a layer's largest load.
 * replica may be NULL. */
void shoal_plan_load(const shoal_plan_in *in, const int32_t *owner, const int32_t *replica, double *load);

/* Redundancy (`shoal plan --replicas R`): every routed expert on R + 1
 * distinct workers -- distinct failure domains when domain[w] (0 ..
 * ndomains-1) is given, else each worker its own -- each within its budget:
 * hold[w * num_layers * num_experts + l * num_experts + e] = 1 when worker w
 * holds (l, e). Method (docs/CLUSTER.md, "Replicas"): the (R + 1) x N copies
 * are split over the domains as evenly as their room allows (a host, and a
 * domain, holds an expert at most once: its room is min(budget, N)), then
 * over each domain's hosts; the cells in a fixed cyclic order (MoE layers
 * interleaved; within a layer, with hits, hottest and coldest alternating),
 * repeated R + 1 times, are cut into consecutive runs, one per host, domain
 * after domain: a domain's run is at most N long, so the copies of an expert
 * are in distinct domains. This succeeds exactly when the room suffices:
 * SHOAL_ECONFIG otherwise, naming the copies needed, the room and the
 * shortfall in experts and bytes, or the domains needed. */
int shoal_plan_redundant(const shoal_plan_in *in, int replicas, const int *domain, int ndomains, uint8_t *hold,
                         char *err, size_t errlen);
/* Expected load of a hold map, as shoal_plan_load: per layer, each expert,
 * hottest first, fills its owners' loads to one level (the least loaded
 * first). */
void shoal_plan_load_held(const shoal_plan_in *in, const uint8_t *hold, double *load);
/* shoal_plan_ranges of a hold map. */
int shoal_plan_ranges_held(const uint8_t *hold, int num_layers, const uint8_t *is_moe, int num_experts, int w,
                           char **out);

/* Format worker w's experts (those it owns or holds a replica of; replica
 * may be NULL) as a RANGES string (runs of experts, consecutive MoE layers
 * with identical runs merged). *out allocated (free()). */
int shoal_plan_ranges(const int32_t *owner, const int32_t *replica, int num_layers, const uint8_t *is_moe,
                      int num_experts, int w, char **out);

#endif
