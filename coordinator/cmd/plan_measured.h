/* plan_measured: `shoal plan --measured doctor.json` (issue 34,
 * docs/CLUSTER.md "Measured plans"): predicts the seconds per token of the
 * placements a plan can write -- the trunk on the coordinator, or its rows
 * spread over G of the workers (the G cheapest: round trips, link and reads
 * of one token if it held the whole trunk alone), the routed
 * experts split in proportion to each host's measured read bandwidth within
 * its memory budget -- from the model's per-token bytes and round trips and
 * `shoal doctor`'s measured figures, prints the prediction term by term for
 * each, names the bottleneck, and returns the fastest.
 *
 * The model, per decoded token (every term from the model's tensors or from
 * doctor.json; `eff` and `imbalance` are the two stated assumptions):
 *   trunk reads   trunk bytes on the busiest reader / (read_bw_all x eff)
 *   expert reads  (folded into the same per-server sum: a server reads its
 *                 trunk rows and its experts one after the other)
 *   coordinator   bytes the coordinator reads (all of the trunk when local,
 *                 the non-shardable rest when spread) / its read_bw_all x eff
 *   round trips   serial trunk steps x (the slowest trunk server's RTT + x) +
 *                 MoE layers x (the slowest worker's RTT + x) (PROTOCOL.md §3.7);
 *                 x = --overhead-us, the software cost of an exchange beyond
 *                 doctor's PROBE round trip (assumed, stated)
 *   wire          per link: bytes out / its out rate + bytes in / its in
 *                 rate, the slowest link (a link's x and its reply are
 *                 serial within a step); with --nic-gbps also the
 *                 coordinator's NIC, its two directions separate (full
 *                 duplex, as a real port and tc tbf on each side pace them),
 *                 as a per-step timeline: the coordinator sends the step's x
 *                 (x_in / steps) with its TRUNK_BATCH header (194 bytes,
 *                 measured) to the G trunk servers one after the other
 *                 (at the NIC's rate, at most each link's), and each
 *                 server's reply (y_out / steps / G) passes the NIC's
 *                 incoming side once its server holds x, one reply after
 *                 another in the order they become ready; the step ends
 *                 when the last reply is in (and lasts at least the slowest
 *                 server's x and reply on its own link), so early replies
 *                 overlap later sends (a step of average sizes: every step
 *                 taken as x_in / steps out and y_out / steps in). Each
 *                 MoE layer's exchange the same way (each worker's expected
 *                 request out, its share of the k outputs in). The NIC term
 *                 = steps x the step + MoE layers x the exchange (the inputs
 *                 in bf16 in the mu class where exact, PROTOCOL.md 1.7); the
 *                 wire term is the larger of it and the slowest link
 * and, at S slots (S sequences per step): reads and round trips once per
 * step, wire and coordinator work S times; tokens/s = S / step time.
 *
 * The relay trees (PROTOCOL.md §3.9) are considered for every spread over
 * G >= 4 servers with F = 2, 3, 4 < G, in the tree the coordinator builds (F
 * roots, then level by level, each level's members taking the previous
 * level's in turn as parents), and, with a shared NIC, the latency-aware
 * schedule (`relay greedy`, coordinator/cluster/relaytree.h, the same function
 * the coordinator runs) for every spread over G >= 2, computed from the step's
 * x bytes, the NIC, the peer rate (--peer-gbps, else the slowest trunk
 * server's measured link) and the hop (below). Per step the coordinator sends
 * x with its header to each of its own children one after the other (at
 * --nic-gbps, at most each link's rate), each followed by its subtree's
 * headers (194 bytes each); each parent forwards x to its children one after
 * the other (at --peer-gbps when given; greedy: the peer rate above; else the
 * lower of the parent's and the child's measured link rate; store and
 * forward), a copy arriving its turn x x / rate + the hop after its parent
 * holds x -- the hop is a worker-to-worker one-way latency (the slowest
 * trunk server's RTT / 2) + the overhead, inside the arrival (in the wire
 * term, not the round trips); a server computes once it holds x and its
 * header. The step's timeline above then runs with those times (every server
 * still replies directly), and the busiest link carries x once in from its
 * parent and once per child out. Equal totals over the same servers: the
 * fewer copies of x the coordinator sends itself first (less egress), then
 * direct, the smaller F, greedy last. plan.json gets "relay_fanout" (2..4, or "greedy" with
 * "relay_rates": nic_gbps, peer_gbps, hop_us, what it was priced with).
 * Without a shared NIC (--nic-gbps) the coordinator's links are independent
 * and a tree only adds hops: no fixed tree is chosen, the greedy schedule is
 * not listed.
 *
 * The coordinator's memory: a placement fits only when the bytes the
 * coordinator holds -- the embedding table and, trunk local, every other
 * non-expert tensor; spread, the part no row spec takes (the trunk's bytes
 * less the row-shardable matrices) -- are within its budget (--coordinator-mem,
 * else 0.9 x doctor.json's coordinator mem_total, the rule doctor warns by;
 * neither: no limit). */
#ifndef SHOAL_PLAN_MEASURED_H
#define SHOAL_PLAN_MEASURED_H

#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "common/st.h"

typedef struct {
    /* in */
    const shoal_k3cfg *cfg;
    const shoal_st *st;
    int nworkers;
    const char *const *names; /* [nworkers]: manifest host names (doctor.json's worker names) */
    const uint64_t *budget;   /* [nworkers]: bytes of weights each may hold */
    uint64_t expert_bytes;    /* one routed expert */
    const char *doctor;       /* doctor.json */
    int slots;                /* --slots (>= 1) */
    double nic_Bps;           /* --nic-gbps / 8 * 1e9; 0: no shared coordinator NIC term */
    double peer_Bps;          /* --peer-gbps / 8 * 1e9: the workers' links to each other (the relay tree's
                                 hops); 0: each worker's measured coordinator link (doctor measures no
                                 worker-to-worker link; a lower bound where the coordinator's NIC limits it) */
    double eff;               /* kernel read efficiency (fraction of the read pass) */
    double imbalance;         /* layer-weighted load imbalance of the expert split */
    int max_trunk_servers;    /* 0: any; else spread only over all (replicas need every host) */
    double overhead_s;        /* software cost of one round trip beyond the measured RTT (--overhead-us) */
    int force_G;              /* -1: choose; 0: trunk local; G: spread over G (the report still lists all) */
    int budget_split;         /* 1: the experts will be placed by the budgets (--replicas, --hot), not by count */
    uint64_t coord_mem;       /* --coordinator-mem: bytes the coordinator may hold; 0: 0.9 x doctor.json's
                                 coordinator mem_total when recorded, else no limit */
    /* in/out: the cluster's numerics class (--numerics): 1 mu, 0 portable,
     * -1 doctor.json's "numerics" (absent: portable), set to what was used.
     * In mu the activations travel as bf16 (PROTOCOL.md 1.7): the trunk
     * inputs and expert requests of the wire term are halved where exact. */
    int numerics;
    /* out */
    int spread;         /* 1: trunk rows on G workers */
    int G;
    int relay_fanout;   /* 0: every trunk input direct; F: the relay tree of fan-out F (PROTOCOL.md §3.9);
                           SHOAL_RELAY_GREEDY: the latency-aware schedule (coordinator/cluster/relaytree.h) */
    double relay_peer_Bps, relay_hop_s; /* the hops' rate and latency the relay was priced with (plan.json
                                           relay_rates, with nic_Bps, for the greedy schedule) */
    int *tslot;         /* [nworkers], caller's: part index of worker w, or -1 */
    uint64_t *count;    /* [nworkers], caller's: routed experts each should hold (sum = all) */
    double predicted_s; /* the choice's s/token */
} shoal_plan_measured;

/* Reads doctor.json, prints the candidates (to stdout), fills the outputs.
 * 0, or SHOAL_ECONFIG / SHOAL_EIO with err (a worker missing from doctor.json,
 * a worker it could not measure, no placement fitting the budgets). */
int shoal_plan_measured_choose(shoal_plan_measured *m, char *err, size_t errlen);

#endif
