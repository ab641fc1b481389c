/* relaytree: the latency-aware schedule of one trunk step's input x over G
 * trunk servers (PROTOCOL.md §3.9, `--relay-fanout greedy`): which holder of
 * x sends it to which server, in which order, and when each server holds
 * it. A pure function of its inputs (no I/O, no allocation, no globals), used
 * by the trunk client (trunk_client.c, per step from the step's x bytes) and
 * by `shoal plan --measured` (plan_measured.c, its timeline), so the tree
 * the plan prices is the tree the coordinator builds.
 *
 * The rule (docs/PERFORMANCE.md "A latency-aware relay schedule"): every
 * holder of x keeps sending it, one copy after another -- the coordinator at
 * its NIC rate, every server that already holds x at the peer rate -- and
 * the servers, in index order, are each given to the holder that can deliver
 * x to it earliest. With c = xb / nic_Bps and d = xb / peer_Bps:
 *   the coordinator's k-th send (k = 1, 2, ...) arrives at  k x c;
 *   a server that holds x at a delivers its j-th child's copy at
 *                                                            a + j x d + hop_s
 *   (hop_s: a worker-to-worker hop's latency beyond the transfer, one way:
 *   RTT / 2 + the software cost of a forward; the coordinator's own one-way
 *   latency is common to every path and left out).
 * Ties: the coordinator before any server, then the server that got x
 * earliest in the schedule (the lower index) -- the same tree on every run.
 * A server can be given as a child only while its root's subtree has fewer
 * than max_sub members (a `fwd` holds at most 64, PROTOCOL.md §3.9); when no
 * server can take it, the coordinator sends it directly. When hop_s is large
 * against c (a fast coordinator NIC) every server is served directly. Served
 * in index order, every parent precedes its children and a parent's children
 * come in the order of its sends. */
#ifndef SHOAL_RELAYTREE_H
#define SHOAL_RELAYTREE_H

#define SHOAL_RELAYTREE_MAX 256 /* servers (SHOAL_EXPERT_CLIENT_MAX_WORKERS) */

typedef struct {
    int n;                               /* servers scheduled (G) */
    short parent[SHOAL_RELAYTREE_MAX];   /* -1: the coordinator sends it x; else the server that does */
    short order[SHOAL_RELAYTREE_MAX];    /* 1-based: its position among its parent's sends */
    short root[SHOAL_RELAYTREE_MAX];     /* the coordinator's child whose subtree holds it (itself for one) */
    short nkids[SHOAL_RELAYTREE_MAX];    /* servers it sends x to */
    short level[SHOAL_RELAYTREE_MAX];    /* 1: the coordinator's child, 2: its child, ... */
    double arrival[SHOAL_RELAYTREE_MAX]; /* seconds after the step's first send when it holds x */
    int direct;                          /* the coordinator's sends */
    int levels;                          /* the deepest level */
    double last;                         /* the latest arrival */
} shoal_relaytree;

/* Schedule G (1 .. SHOAL_RELAYTREE_MAX) servers for xb > 0 bytes of x, the
 * rates > 0 (bytes/s), hop_s >= 0, max_sub >= 1 (members of one root's
 * subtree, the root not counted). 0, or -1 for inputs out of range (t then
 * untouched). */
int shoal_relaytree_greedy(shoal_relaytree *t, int G, double xb, double nic_Bps, double peer_Bps, double hop_s,
                           int max_sub);

#endif
