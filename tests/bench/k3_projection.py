#!/usr/bin/env python3
"""The full-K3 projection for three cluster classes (issue 34, docs/PERFORMANCE.md
"Plans for real networks"): the model of `shoal plan --measured`
(coordinator/cmd/plan_measured.h), written again here from the per-token
figures of SPEC §6 and PROTOCOL.md §3.7 as docs/PERFORMANCE.md states them, so
the projection does not depend on the C code. For each class and N = 8, 16, 32
equal servers: every placement the plan considers (trunk local; spread over
G = 1, 2, 4, ..., N), and a relay tree of fan-out F = 2, 3, 4 over the G
trunk servers with the terms of the design docs/PERFORMANCE.md "A relay tree
for the trunk inputs" gives (built, protocol 1.8): the coordinator sends every trunk
server its TRUNK_BATCH header (its segments, HDR bytes) directly and the
input x to F roots only; every server forwards x, unchanged, to its <= F
children one after the other on its own link (store and forward: a child's
copy starts when its parent holds the whole x); every server replies its rows
directly to the coordinator. Per trunk step that costs (i) the time the last
server holds x, computed node by node (the coordinator's sends at its NIC
rate, each parent's at its link rate) in place of G x / NIC; (ii) one one-way
hop (RTT/2 + the per-exchange software cost X) per level below the roots;
(iii) a parent's link carries x once in and once per child out. And the best
placement's s/token for one user and tokens/s for 8. Since the latency-aware
schedule (`--relay-fanout greedy`, `greedy_schedule`) the relay hop is inside
each relayed copy's arrival (`timeline`) instead of (ii), every request carries
a HDR-byte header on the coordinator's outgoing side, and greedy is a
candidate for every spread over G >= 2.

The coordinator's NIC is full duplex (plan_measured.h): per trunk step x goes
out to the servers (or the roots) one after the other, and each reply comes
in once its server holds x, the replies one after another as they become
ready (`step_time`); each MoE exchange likewise; the NIC term is steps x the
step + MoE layers x the exchange, against the busiest link's bytes.

Both numerics classes (--numerics, default both): in `mu` every trunk input
and expert activation travels as bf16 (PROTOCOL.md 1.7: the class's products
round them to bf16 anyway, so the bits are the same), half of X_IN and of the
activation in ACT; the outputs (TRUNK_RESULT f32, expert outputs bf16) are the
same in both classes.

--mu-expert-rate R (default 1): in the mu class the routed experts' MXFP4
reads run at R x the portable kernels' rate (issue 33 measured the exact
AVX-512 emulation's MXFP4 GEMV at 0.44x on the 2-core EPYC; decode, T < 8,
runs that emulation on AMX machines too), a sensitivity of the reads term.

Usage: k3_projection.py [--json FILE] [--numerics portable|mu|both] [--mu-expert-rate R]
"""
import argparse
import json
import math

GB = 1e9
# per token (SPEC §6, PROTOCOL.md §3.7, docs/PERFORMANCE.md "The full-K3 projection with the trunk spread")
TRUNK_ALL = 111.2 * GB     # trunk bytes read per token (BF16, embedding table not read)
TRUNK_C = 0.60 * GB        # not row-shardable: kv_b_proj (+ vectors), stays on the coordinator
TRUNK_R = TRUNK_ALL - TRUNK_C
FA = 0.127 * GB            # 69 KDA f_a matrices, held whole by every trunk server
E_TOK = 25.83 * GB         # routed-expert bytes read per token
EXPERTS_ALL = 1446.456 * GB
X_IN_F32 = 13.8e6          # trunk step inputs (f32) sent to every trunk server
Y_OUT = 35.2e6             # trunk step outputs (f32), split over the trunk servers
STEPS = 489 - 92           # serial trunk steps (with the KDA chain); + 92 expert exchanges
MOE = 92
ACT_F32 = 14.5e3           # one expert exchange's activation to one worker: 16 + 3584 x 4 + 16 + 16 x 8 bytes
LATENT = 3584
# per numerics class: (trunk inputs per token per trunk server, one expert exchange's request to one worker);
# in mu the inputs are bf16 on the wire (all K3 trunk matrices are BF16, experts MXFP4: every product rounds them)
WIRE = {"portable": (X_IN_F32, ACT_F32), "mu": (X_IN_F32 / 2, ACT_F32 - LATENT * 2)}
X_IN, ACT = WIRE["portable"]
EXPERT_RATE = 1.0  # the experts' read rate relative to the portable kernels (mu: --mu-expert-rate)
YEXP = 114.7e3             # one token's 16 expert outputs per MoE layer
K = 16
IMB = 1.2                  # load imbalance (assumed, as in the earlier projections)
EFF = 0.82                 # kernel share of the read pass (measured, docs/PERFORMANCE.md)
X = 0.1e-3                 # software cost per exchange beyond the RTT (assumed)
HDR = 194                  # a TRUNK_BATCH's header without x (segments, layer; bytes; measured on k3-nano, as in
                           # plan_measured.c SHOAL_PLAN_TBATCH_HDR), sent to every trunk server every step

CLASSES = {
    "bare metal": {"link_Bps": 25e9 / 8, "rtt": 0.2e-3, "read": 100 * GB},
    "cloud": {"link_Bps": 10e9 / 8, "rtt": 0.2e-3, "read": 40 * GB},
    "cheap VPS": {"link_Bps": 1e9 / 8, "rtt": 0.5e-3, "read": 20 * GB},
    # the same VPSs with a coordinator on a 10 Gb/s port (its NIC carries every link's bytes)
    "cheap VPS, 10G coordinator": {"link_Bps": 1e9 / 8, "nic_Bps": 10e9 / 8, "rtt": 0.5e-3, "read": 20 * GB},
}


def fixed_parents(G, F):
    """the parents (-1: the coordinator) of the tree of fan-out F the
    coordinator builds (PROTOCOL.md §3.9, trunk_client.c plan_tree): F roots,
    then level by level each level's members taking the previous level's
    members in turn as parents (at most F children each); F = 0: all direct"""
    R = F if F else G
    par = [-1] * G
    j, start, size = R, 0, R
    while j < G:
        nxt = 0
        for o in range(F * size):
            if j >= G:
                break
            par[j] = start + o % size
            j += 1
            nxt += 1
        start, size = start + size, nxt
    return par


def timeline(par, xb, nic, link, peer, lat, hdr=0.0):
    """when each server can compute (plan_measured.h): the coordinator sends,
    to each of its own children in server order, x with its header (xb + hdr
    bytes, at nic, each arriving no sooner than xb / link), each followed by
    the headers (hdr bytes each, in server order) of the servers of that
    child's subtree; a relayed server's x arrives at its parent's x arrival +
    its turn among the parent's sends x xb / peer + lat (the hop's one-way
    latency + the forward's software cost), and it computes once it holds
    both x and its header. Returns (the times each can compute, levels,
    children of the busiest parent)."""
    G = len(par)
    tx, t, lvl, nk, root = [0.0] * G, [0.0] * G, [1] * G, [0] * G, list(range(G))
    for j, p in enumerate(par):
        if p >= 0:
            root[j] = root[p]
    hdr_at = [0.0] * G
    sent = 0.0
    for j, p in enumerate(par):
        if p < 0:
            sent += (xb + hdr) / nic
            tx[j] = t[j] = max(sent, xb / link)
            for k in range(j + 1, G):
                if par[k] >= 0 and root[k] == j:
                    sent += hdr / nic
                    hdr_at[k] = sent
        else:
            nk[p] += 1
            tx[j] = tx[p] + nk[p] * xb / peer + lat
            t[j] = max(tx[j], hdr_at[j])
            lvl[j] = lvl[p] + 1
    return t, max(lvl), max(nk)


def tree_arrival(G, F, xb, nic, link, hop=None, lat=0.0, hdr=0.0):
    """the timeline of the fan-out F tree (F = 0: all direct); the hops at
    hop bytes/s (default link)"""
    return timeline(fixed_parents(G, F), xb, nic, link, hop or link, lat, hdr)


def greedy_schedule(G, xb, nic, peer, lat, max_sub=64):
    """the latency-aware relay schedule (`--relay-fanout greedy`, PROTOCOL.md
    §3.9, docs/PERFORMANCE.md "A latency-aware relay schedule"), from the rule
    as documented: every holder of x keeps sending it -- the coordinator's
    k-th copy arrives at k * xb / nic, a server that holds x at a delivers its
    j-th child's at a + j * xb / peer + lat -- and the servers, in index
    order, each go to the holder that delivers earliest; ties to the
    coordinator, then to the earliest-served server; a server joins a root's
    subtree only while it has fewer than max_sub members (else the
    coordinator sends it). Returns [(parent or -1, its position among its
    parent's sends, its root, arrival)] per server."""
    c, d = xb / nic, xb / peer
    out, kids, sub = [], [], {}
    direct = 0
    for i in range(G):
        best, by = (direct + 1) * c, -1
        for p in range(i):
            if sub[out[p][2]] >= max_sub:
                continue
            when = out[p][3] + (kids[p] + 1) * d + lat
            if when < best:
                best, by = when, p
        if by < 0:
            direct += 1
            out.append((-1, direct, i, best))
            sub[i] = 0
        else:
            kids[by] += 1
            out.append((by, kids[by], out[by][2], best))
            sub[out[by][2]] += 1
        kids.append(0)
    return out


def greedy_arrival(G, xb, nic, link, peer, lat, hdr=0.0):
    """the timeline of greedy_schedule's tree (the schedule from x alone, as
    the coordinator computes it; the timeline with the headers)"""
    return timeline([p for p, _, _, _ in greedy_schedule(G, xb, nic, peer, lat)], xb, nic, link, peer, lat, hdr)


def replies_in(t, b):
    """the coordinator NIC's incoming side, apart from its outgoing one (full
    duplex): reply i is ready at t[i] and takes b[i] seconds; they pass one
    after another in the order they become ready. When the last is in."""
    done = 0.0
    for ti, bi in sorted(zip(t, b)):
        done = max(done, ti) + bi
    return done


def step_time(G, F, xb, yb, nic, link, lat=0.0, hdr=0.0):
    """one trunk step's timeline (plan_measured.h): x out to the G servers (or
    the tree's roots, then down the tree: F fixed, or "greedy"), each reply
    (yb) in as soon as its server holds x, through the NIC's incoming side one
    after another, and no faster than its own link. Returns (seconds, levels,
    children of the busiest parent)."""
    if F == "greedy":
        t, levels, kids = greedy_arrival(G, xb, nic, link, link, lat, hdr)
    else:
        t, levels, kids = tree_arrival(G, F, xb, nic, link, lat=lat, hdr=hdr)
    done = max(replies_in(t, [yb / nic] * G), max(ti + yb / link for ti in t))
    return done, levels, kids


def placement(cls, N, G, fanout=0, users=1):
    """terms of one placement: G = 0 trunk local; fanout F > 0: a relay tree"""
    B = cls["read"] * EFF
    rt1 = cls["rtt"] + X
    u = users
    # reads per server: trunk rows once per step, experts per sequence (distinct experts, no overlap assumed)
    EI = E_TOK * IMB * u / EXPERT_RATE
    if G:
        tr = TRUNK_R / G + FA * (1 - 1 / G)
        # water filling with equal bandwidths: experts first to the N - G non-trunk servers
        if N > G and EI / (N - G) <= tr:
            T = max(tr, EI / (N - G)) if EI / (N - G) >= tr else None
        # general: level T with sum over servers max(0, T*B - tr_w) = EI
        trs = [tr] * G + [0.0] * (N - G)
        lo, hi = 0.0, (max(trs) + EI) / B
        for _ in range(200):
            mid = (lo + hi) / 2
            s = sum(max(0.0, mid * B - t) for t in trs)
            lo, hi = (mid, hi) if s < EI else (lo, mid)
        reads = max(hi, tr / B)
        coord = TRUNK_C / B * u
        rt = STEPS * rt1 + MOE * rt1
        F = fanout if fanout == "greedy" or (fanout and G > fanout) else 0
        nic = cls.get("nic_Bps", cls["link_Bps"])
        # every request's header in the timeline; a relay hop (RTT/2 + X) inside each relayed copy's arrival
        step, levels, kids = step_time(G, F, X_IN / STEPS * u, Y_OUT / STEPS / G * u, nic, cls["link_Bps"],
                                       cls["rtt"] / 2 + X, HDR)
    else:
        reads = EI / N / B
        coord = TRUNK_ALL / B + TRUNK_C / B * (u - 1)  # the trunk once per step, the attention part per sequence
        rt = MOE * rt1
        step, kids, F = 0.0, 0, 0
    # the coordinator's NIC, its two directions apart: every trunk step's timeline, every MoE exchange's (each of
    # the N workers' expected request out one after the other, its share of the k outputs in as ready), headers
    nic = cls.get("nic_Bps", cls["link_Bps"])
    inv = 1 - (1 - 1 / N) ** K
    exch = replies_in([(i + 1) * inv * ACT * u / nic for i in range(N)], [YEXP * u / N / nic] * N)
    coord_wire = STEPS * step + MOE * exch
    # each link its own (a trunk server's, the busiest): its x and its rows, its expert traffic; a parent x per child
    link = ((X_IN + Y_OUT / G) * u + STEPS * HDR if G else 0) + MOE * (ACT + YEXP / N) * u + \
        (kids * X_IN * u if F else 0)
    wire = max(coord_wire, link / cls["link_Bps"])
    total = reads + coord + rt + wire
    mem_server = (TRUNK_R / G + FA if G else 0) + EXPERTS_ALL / N if G else EXPERTS_ALL / N
    mem_coord = TRUNK_C + 0.6 * GB if G else 113.5 * GB
    return {"reads": reads, "coord": coord, "rt": rt, "wire": wire, "total": total, "mem_server": mem_server,
            "mem_coord": mem_coord, "G": G, "fanout": fanout}


def name(p):
    if not p["G"]:
        return "trunk local"
    if p["fanout"] == "greedy":
        return f"spread over {p['G']}, relay greedy"
    return f"spread over {p['G']}" + (f", relay tree F={p['fanout']}" if p["fanout"] else "")


def main():
    global X_IN, ACT, EXPERT_RATE
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--numerics", default="both", choices=("portable", "mu", "both"))
    ap.add_argument("--mu-expert-rate", type=float, default=1.0)
    a = ap.parse_args()
    res = {}
    for num in (("portable", "mu") if a.numerics == "both" else (a.numerics,)):
        X_IN, ACT = WIRE[num]
        EXPERT_RATE = a.mu_expert_rate if num == "mu" else 1.0
        print(f"numerics {num}: trunk inputs {X_IN / 1e6:.2f} MB per trunk server per token, "
              f"expert request {ACT / 1e3:.2f} kB per worker per MoE layer, expert reads at {EXPERT_RATE:.2f}x")
        res[num] = project()
    if a.json:
        json.dump(res if a.numerics == "both" else res[a.numerics], open(a.json, "w"), indent=1)


def project():
    out = {}
    for cn, cls in CLASSES.items():
        for N in (8, 16, 32):
            cands = [placement(cls, N, 0)]
            G = 1
            while G <= N:
                cands.append(placement(cls, N, G))
                G *= 2
            built = min(cands, key=lambda p: p["total"])
            tree = []
            G = 4
            while G <= N:
                tree += [placement(cls, N, G, F) for F in (2, 3, 4) if F < G]
                G *= 2
            G = 2
            while G <= N:
                tree.append(placement(cls, N, G, "greedy"))
                G *= 2
            best_any = min(cands + tree, key=lambda p: p["total"])
            u8 = placement(cls, N, built["G"], users=8)
            u8t = placement(cls, N, best_any["G"], best_any["fanout"], users=8)
            out[f"{cn} N={N}"] = {"built_best": built, "best_with_tree": best_any, "all": cands + tree,
                                  "tok_s_8": 8 / u8["total"], "tok_s_8_tree": 8 / u8t["total"]}
            print(f"{cn:10s} N={N:2d}  best built: {name(built):22s} {built['total']:.3f} s/token "
                  f"(reads {built['reads']:.3f}, coord {built['coord']:.3f}, rtt {built['rt']:.3f}, wire "
                  f"{built['wire']:.3f}); 8 users {8 / u8['total']:.2f} tok/s; server {built['mem_server'] / GB:.1f} GB, "
                  f"coordinator {built['mem_coord'] / GB:.1f} GB | with a relay tree: {name(best_any)} "
                  f"{best_any['total']:.3f} s/token, 8 users {8 / u8t['total']:.2f} tok/s")
    return out


if __name__ == "__main__":
    main()
