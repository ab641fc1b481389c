#!/usr/bin/env python3
"""The full-K3 projection for three cluster classes (issue 34, docs/PERFORMANCE.md
"Plans for real networks"): the model of `shoal plan --measured`
(coordinator/cmd/plan_measured.h), written again here from the per-token
figures of SPEC §6 and PROTOCOL.md §3.7 as docs/PERFORMANCE.md states them, so
the projection does not depend on the C code. For each class and N = 8, 16, 32
equal servers: every placement the plan considers (trunk local; spread over
G = 1, 2, 4, ..., N), and two ways of cutting the coordinator's egress that
are evaluated here only (not built): a relay tree of fan-out F (the
coordinator sends each trunk input to F servers, each forwards it to F more:
egress F x input instead of G x input, one more hop per level on every trunk
step), and the best placement's s/token for one user and tokens/s for 8.

Usage: k3_projection.py [--json FILE] [--md]
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
X_IN = 13.8e6              # trunk step inputs (f32) sent to every trunk server
Y_OUT = 35.2e6             # trunk step outputs (f32), split over the trunk servers
STEPS = 489 - 92           # serial trunk steps (with the KDA chain); + 92 expert exchanges
MOE = 92
ACT = 14.5e3               # one expert exchange's activation to one worker
YEXP = 114.7e3             # one token's 16 expert outputs per MoE layer
K = 16
IMB = 1.2                  # load imbalance (assumed, as in the earlier projections)
EFF = 0.82                 # kernel share of the read pass (measured, docs/PERFORMANCE.md)
X = 0.1e-3                 # software cost per exchange beyond the RTT (assumed)

CLASSES = {
    "bare metal": {"link_Bps": 25e9 / 8, "rtt": 0.2e-3, "read": 100 * GB},
    "cloud": {"link_Bps": 10e9 / 8, "rtt": 0.2e-3, "read": 40 * GB},
    "cheap VPS": {"link_Bps": 1e9 / 8, "rtt": 0.5e-3, "read": 20 * GB},
    # the same VPSs with a coordinator on a 10 Gb/s port (its NIC carries every link's bytes)
    "cheap VPS, 10G coordinator": {"link_Bps": 1e9 / 8, "nic_Bps": 10e9 / 8, "rtt": 0.5e-3, "read": 20 * GB},
}


def placement(cls, N, G, fanout=0, users=1):
    """terms of one placement: G = 0 trunk local; fanout F > 0: a relay tree"""
    B = cls["read"] * EFF
    rt1 = cls["rtt"] + X
    u = users
    # reads per server: trunk rows once per step, experts per sequence (distinct experts, no overlap assumed)
    EI = E_TOK * IMB * u
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
        hops = 1 + (math.ceil(math.log(G, fanout)) - 1 if fanout and G > fanout else 0)
        rt = STEPS * rt1 * hops + MOE * rt1
        egress = (min(G, fanout) if fanout else G) * X_IN * u
    else:
        reads = EI / N / B
        coord = TRUNK_ALL / B + TRUNK_C / B * (u - 1)  # the trunk once per step, the attention part per sequence
        rt = MOE * rt1
        egress = 0.0
    involved = N * (1 - (1 - 1 / N) ** K)
    out = egress + MOE * involved * ACT * u
    inn = (Y_OUT if G else 0) * u + MOE * YEXP * u
    # the coordinator's NIC carries every link's bytes; each link its own (a trunk server's, the busiest)
    nic = cls.get("nic_Bps", cls["link_Bps"])
    link = ((X_IN + Y_OUT / G) * u if G else 0) + MOE * (ACT + YEXP / N) * u
    wire = max((out + inn) / nic, link / cls["link_Bps"])
    total = reads + coord + rt + wire
    mem_server = (TRUNK_R / G + FA if G else 0) + EXPERTS_ALL / N if G else EXPERTS_ALL / N
    mem_coord = TRUNK_C + 0.6 * GB if G else 113.5 * GB
    return {"reads": reads, "coord": coord, "rt": rt, "wire": wire, "total": total, "mem_server": mem_server,
            "mem_coord": mem_coord, "G": G, "fanout": fanout}


def name(p):
    if not p["G"]:
        return "trunk local"
    return f"spread over {p['G']}" + (f", relay tree F={p['fanout']}" if p["fanout"] else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    out = {}
    for cn, cls in CLASSES.items():
        for N in (8, 16, 32):
            cands = [placement(cls, N, 0)]
            G = 1
            while G <= N:
                cands.append(placement(cls, N, G))
                G *= 2
            built = min(cands, key=lambda p: p["total"])
            tree = [placement(cls, N, N, F) for F in (2, 4)]
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
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
