#!/usr/bin/env python3
"""Summary of the speculative-decoding benchmarks (issue 21): from the raw
bench_spec lines of spec_bench.py's JSON files, the per-T medians and a
least-squares line time(T) = a + b·(T - 1) over every raw sample (robust to
one slow sample, which a 2-core shared machine produces), so the cost of a
verify pass of K + 1 tokens is c(K) = 1 + (b / a)·K; then bench_draft_replay
over the real-text cases with that cost, for K max 4 and 8, giving passes
per token and the estimated s/token = a · cost per token for editing (a),
summarising (b) and free generation (c).

Usage: spec_summary.py --build build --cases CASES.json --out SUMMARY.json BENCH.json..."""
import argparse
import json
import os
import statistics
import subprocess


def fit(points):
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b  # time at x = 0 (T = 1), per extra token


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("bench", nargs="+")
    a = ap.parse_args()
    out = {"runs": {}}
    for path in a.bench:
        doc = json.load(open(path))
        for name, run in doc["runs"].items():
            raw = [r for r in run["raw"] if r["states"]]
            if not raw:
                continue
            key = f"{os.path.basename(path)}: {name}"
            res = {"commit": doc.get("commit"), "load_before": run["load_before"], "load_after": run["load_after"]}
            for field in ("s", "cpu_s"):
                if field not in raw[0]:
                    continue
                pts = [(r["T"] - 1, r[field]) for r in raw]
                t0, slope = fit(pts)
                med = {T: statistics.median(r[field] for r in raw if r["T"] == T) for T in sorted({r["T"] for r in raw})}
                res[field] = {"median_by_T": med, "fit_T1": t0, "fit_per_extra_token": slope,
                              "alpha": slope / t0, "median_ratio_by_T": {T: v / med[1] for T, v in med.items()}}
            out["runs"][key] = res
            alpha = res["s"]["alpha"]
            costs = ",".join(f"{1 + alpha * k:.4f}" for k in range(17))
            res["replay"] = {}
            for kmax in (4, 8):
                r = subprocess.run([os.path.join(a.build, "tests", "bench_draft_replay"), a.cases, costs, "--max",
                                    str(kmax), "--cost", f"{min(max(alpha, 0.01), 0.99):.4f}"],
                                   capture_output=True, text=True, check=True)
                lines = [json.loads(l) for l in r.stdout.splitlines()]
                res["replay"][f"K{kmax}"] = {
                    "cases": [l for l in lines if "case" in l],
                    "totals": {l["kind"]: dict(l, est_s_per_token=res["s"]["fit_T1"] * l["cost_per_token"],
                                               plain_s_per_token=res["s"]["fit_T1"])
                               for l in lines if "total" in l}}
            print(key, f"T1 {res['s']['fit_T1']:.3f} s, +{alpha:.3f}/token (wall)",
                  f"cpu +{res['cpu_s']['alpha']:.3f}" if "cpu_s" in res else "")
            for kmax in (4, 8):
                for kind, l in res["replay"][f"K{kmax}"]["totals"].items():
                    print(f"  K{kmax} {kind:10s} accept {l['acceptance']:.3f} passes/token {l['passes_per_token']:.3f}"
                          f" est {l['est_s_per_token']:.3f} s/token (plain {l['plain_s_per_token']:.3f}) "
                          f"speedup {l['speedup']:.2f}x")
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
