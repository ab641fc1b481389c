#!/usr/bin/env python3
"""Summary of tests/bench/mx_t1_ab.sh: per configuration, median [min, max]
over rounds of the expert GEMV's ratio to the read pass, the in-cache GEMV's
ns per 32 weights (thread CPU time) and bench_gemm's gmacs_cpu by T; then each
configuration against the first one, round by round (same round = same load).
usage: mx_t1_ab_summary.py FILE.jsonl"""
import json
import statistics
import sys
from collections import defaultdict


def fmt(v):
    return "%.3f [%.3f, %.3f]" % (statistics.median(v), min(v), max(v)) if v else "-"


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    val = defaultdict(dict)  # (metric) -> {(config, round): value}
    order, loads = [], []
    for d in rows:
        c, r = d["config"], d["round"]
        if c not in order:
            order.append(c)
        loads.append(float(d["load"].split()[0]))
        if d.get("op") == "gemv_mxfp4" and d.get("layer", "").startswith("expert"):
            val["ratio " + d["layer"]][(c, r)] = d["ratio"]
        elif d.get("op") == "gemv_mxfp4" and d.get("layer") == "in_cache" and "ns_per_32_weights" in d:
            val["in-cache ns/32w " + d["shape"]][(c, r)] = d["ns_per_32_weights"]
        elif d.get("kind") == "mxfp4":
            val["bench_gemm gmacs_cpu T=%d" % d["T"]][(c, r)] = d["gmacs_cpu"]
    print("load average (1 min) before the runs: %.2f-%.2f" % (min(loads), max(loads)))
    for m in sorted(val):
        print(m)
        for c in order:
            print("  %-10s %s" % (c, fmt([v for (cc, r), v in val[m].items() if cc == c])))
        base = order[0]
        for c in order[1:]:
            q = [val[m][(c, r)] / val[m][(base, r)] for (cc, r) in val[m] if cc == c and (base, r) in val[m]]
            print("  %s/%s per round: %s" % (c, base, fmt(q)))


if __name__ == "__main__":
    main()
