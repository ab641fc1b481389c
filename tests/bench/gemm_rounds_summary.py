#!/usr/bin/env python3
"""Summarise tests/bench/gemm_rounds.sh output: per build and T, the median
over rounds of the wall-clock and the thread-CPU-time GMAC/s, with [min, max],
and the ratio of the second build to the first (per round, then median)."""
import collections
import json
import statistics
import sys

for path in sys.argv[1:]:
    rows, meta, order = collections.defaultdict(list), {}, []
    for line in open(path):
        j = json.loads(line)
        if "meta" in j:
            meta[j["meta"]] = j["value"]
            continue
        key = (j["build"], j["isa"], j["shape"], j["T"])
        rows[key].append(j)
        if j["build"] not in order:
            order.append(j["build"])
    print(f"## {path}\n{meta.get('machine')}; {meta.get('command')}; load {meta.get('load_before')} -> {meta.get('load_after')}")
    print("| isa | shape | T | " + " | ".join(f"{b} wall / cpu GMAC/s" for b in order) + " | cpu ratio |")
    print("|---|---|---|" + "---|" * len(order) + "---|")
    for (b, kind, shape, T) in sorted({(k[1], k[2], k[3]) for k in rows} and rows, key=lambda k: (k[1], k[2], k[3])):
        if b != order[0]:
            continue
        cells, cpus = [], []
        for bb in order:
            rs = rows[(bb, kind, shape, T)]
            w = [r["gmacs"] for r in rs]
            c = [r["gmacs_cpu"] for r in rs]
            cpus.append(c)
            cells.append(f"{statistics.median(w):.1f} [{min(w):.1f}, {max(w):.1f}] / {statistics.median(c):.1f} [{min(c):.1f}, {max(c):.1f}]")
        ratio = ""
        if len(cpus) == 2 and len(cpus[0]) == len(cpus[1]):
            rr = [y / x for x, y in zip(cpus[0], cpus[1])]
            ratio = f"{statistics.median(rr):.2f} [{min(rr):.2f}, {max(rr):.2f}]"
        print(f"| {kind} | {shape} | {T} | " + " | ".join(cells) + f" | {ratio} |")
