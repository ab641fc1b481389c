#!/usr/bin/env python3
"""Summary of the speculative-decoding benchmarks (issue 21): from the raw
bench_spec lines of spec_bench.py's JSON files, the per-T medians (wall and
process CPU seconds), their ratios to T = 1, and the least-squares line
ratio(K) = 1 + B + A·K through the ratios of K = 1..8 (the drafter's cost
model, draft.h; a line smooths the noise of single medians on a loaded
machine); then bench_draft_replay over the real-text cases with that cost
(and the drafter told the same A, B), for K max 4 and 8: passes per token
and the estimated s/token = median(T = 1) · cost per token for editing (a),
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
                med = {T: statistics.median(r[field] for r in raw if r["T"] == T) for T in sorted({r["T"] for r in raw})}
                ratio = {T: v / med[1] for T, v in med.items()}
                b0, alpha = fit([(T - 1, ratio[T]) for T in ratio if T > 1])
                beta = b0 - 1.0
                res[field] = {"median_by_T": med, "median_ratio_by_T": ratio, "cost_per_draft": alpha,
                              "cost_fixed": beta}
            out["runs"][key] = res
            for field in ("s", "cpu_s"):
                if field not in res:
                    continue
                alpha = min(max(res[field]["cost_per_draft"], 0.01), 0.99)
                beta = min(max(res[field]["cost_fixed"], 0.0), 4.0)
                costs = ",".join(f"{1 + (beta + alpha * k if k else 0):.4f}" for k in range(17))
                res[field]["replay"] = {}
                for kmax in (4, 8):
                    r = subprocess.run([os.path.join(a.build, "tests", "bench_draft_replay"), a.cases, costs, "--max",
                                        str(kmax), "--cost", f"{alpha:.4f}", "--cost0", f"{beta if beta > 0 else -1:.4f}"],
                                       capture_output=True, text=True, check=True)
                    lines = [json.loads(l) for l in r.stdout.splitlines()]
                    t1 = res[field]["median_by_T"][1]
                    res[field]["replay"][f"K{kmax}"] = {
                        "cases": [l for l in lines if "case" in l],
                        "totals": {l["kind"]: dict(l, est_s_per_token=t1 * l["cost_per_token"], plain_s_per_token=t1)
                                   for l in lines if "total" in l}}
                print(key, field, f"T1 median {res[field]['median_by_T'][1]:.3f} s, cost 1 + {beta:.3f} + {alpha:.3f} k")
                for kmax in (4, 8):
                    for kind, l in res[field]["replay"][f"K{kmax}"]["totals"].items():
                        print(f"  K{kmax} {kind:10s} accept {l['acceptance']:.3f} passes/token {l['passes_per_token']:.3f}"
                              f" est {l['est_s_per_token']:.3f} s/token (plain {l['plain_s_per_token']:.3f}) "
                              f"speedup {l['speedup']:.2f}x")
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
