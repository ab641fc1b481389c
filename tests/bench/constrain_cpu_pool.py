#!/usr/bin/env python3
"""Pools constrain_bench.py runs (req rows with cpu_ms): per kind the paired
per-round ratios of process CPU per decode step (and wall) to free on the same
round and run, rounds >= 1 (round 0 faults the model in).
  constrain_cpu_pool.py RUN.txt [RUN.txt ...]"""
import statistics, sys
def load(path, skip=1):
    rows = {}
    for line in open(path):
        if not line.startswith("req ") or "cpu_ms=" not in line:
            continue
        f = dict(x.split("=", 1) for x in line.split()[1:])
        r = int(f["round"])
        if r < skip: continue
        cs = f.get("cpu_steps", f["steps"])
        rows[(path, r, f["kind"])] = (float(f["cpu_ms"]), float(f["step_ms"]), float(f["mask_us"]), float(f["wait_us"]), f["steps"], cs, float(f["load1"]))
    return rows
rows = {}
for p in sys.argv[1:]:
    rows.update(load(p))
kinds = ["json_object", "schema_20", "recursive", "gbnf"]
loads = [v[6] for v in rows.values()]
print(f"requests={len(rows)} load1 {min(loads):.1f}-{max(loads):.1f}")
for p in sys.argv[1:]:
    fr = sorted(v[0] for (pp, r, k), v in rows.items() if pp == p and k == "free")
    print(p, "free cpu_ms", fr)
for k in kinds:
    pr = []; wr = []
    for (p, r, kk), v in rows.items():
        if kk != k or (p, r, "free") not in rows: continue
        f = rows[(p, r, "free")]
        pr.append(v[0] / f[0]); wr.append(v[1] / f[1])
    pr.sort(); wr.sort()
    q = statistics.quantiles(pr, n=4) if len(pr) > 1 else pr * 3
    mk = statistics.median(v[2] for (p, r, kk), v in rows.items() if kk == k)
    wt = statistics.median(v[3] for (p, r, kk), v in rows.items() if kk == k)
    cpu = statistics.median(v[0] for (p, r, kk), v in rows.items() if kk == k)
    print(f"{k}: n={len(pr)} cpu paired median {statistics.median(pr):.3f} [min {pr[0]:.3f}, q1 {q[0]:.3f}, q3 {q[2]:.3f}, max {pr[-1]:.3f}] "
          f"wall paired median {statistics.median(wr):.3f} [{wr[0]:.3f}, {wr[-1]:.3f}] mask_us {mk:.1f} wait_us {wt:.1f} cpu_ms_median {cpu:.1f}")
allp = []
for (p, r, kk), v in rows.items():
    if kk in kinds and (p, r, "free") in rows:
        allp.append(v[0] / rows[(p, r, "free")][0])
print(f"all constrained: n={len(allp)} cpu paired median {statistics.median(allp):.3f} mean {statistics.mean(allp):.3f} sd {statistics.stdev(allp):.3f} sem {statistics.stdev(allp)/len(allp)**0.5:.3f}")
