#!/usr/bin/env python3
"""Prefill and decode cost of the two numerics classes (issue 33), interleaved.

    numerics_bench.py MODEL OUT.jsonl [--rounds N] [--prompt P] [--gen G] [--threads T]

Each round runs `shoal run --json` once per class (portable, mu; the order
alternates every round so drift hits both), on the same P-token prompt of
deterministic ids, G greedy steps, T threads, and appends one JSON row per run
with the run report's prefill/decode tokens/s, the ISA, the mu path and the
1-minute load average before the run and the run's process CPU time (user + sys of
the child: model load, prefill and decode). A summary (median [min, max] of the per-round
mu/portable ratios) is printed at the end. Model: any shoal model directory;
the figures in docs/PERFORMANCE.md use a k3-slice (real K3 widths).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    ids = ",".join(str((i * 7919 + 13) % 1000 + 1) for i in range(a.prompt))
    ratios = {"prefill": [], "decode": [], "cpu": []}
    commit = subprocess.run(["git", "-C", SRC, "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    with open(a.out, "a") as out:
        out.write(json.dumps({"meta": True, "commit": commit, "machine": f"{cpu}, {os.cpu_count()} cpus",
                              "command": " ".join(sys.argv), "clock": "wall (shoal run's prefill_s / decode_s)",
                              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}) + "\n")
        for r in range(a.rounds):
            order = ("portable", "mu") if r % 2 == 0 else ("mu", "portable")
            got = {}
            for cls in order:
                load = os.getloadavg()[0]
                t0 = time.time()
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                p = subprocess.run([BIN, "run", "--model", a.model, "--ids", ids, "--gen", str(a.gen), "--json",
                                    "--threads", str(a.threads), "--numerics", cls, "--batch", str(a.prompt)],
                                   capture_output=True, text=True, timeout=3600)
                if p.returncode:
                    sys.exit(f"shoal run --numerics {cls} failed ({p.returncode}): {p.stderr[-2000:]}")
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                d = json.loads(p.stdout.strip().splitlines()[-1])
                row = {"round": r, "numerics": cls, "mu_path": d.get("mu_path"), "isa": d.get("isa"),
                       "threads": d.get("threads"), "prompt_tokens": a.prompt, "gen": a.gen,
                       "prefill_tokens_per_s": d["prefill_tokens_per_s"],
                       "decode_tokens_per_s": d["decode_tokens_per_s"], "generated_ids": d["generated_ids"],
                       "load1_before": load, "wall_s": time.time() - t0,
                       "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), "model": os.path.basename(a.model.rstrip("/"))}
                out.write(json.dumps(row) + "\n")
                out.flush()
                got[cls] = row
                print(json.dumps({k: row[k] for k in ("round", "numerics", "prefill_tokens_per_s",
                                                      "decode_tokens_per_s", "cpu_s", "load1_before")}), flush=True)
            for k in ("prefill", "decode"):
                ratios[k].append(got["mu"][f"{k}_tokens_per_s"] / got["portable"][f"{k}_tokens_per_s"])
            ratios["cpu"].append(got["mu"]["cpu_s"] / got["portable"]["cpu_s"])
    for k, v in ratios.items():
        what = "process CPU seconds (load, prefill and decode)" if k == "cpu" else "tokens/s"
        print(f"{k}: mu/portable {what} = {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}] "
              f"over {len(v)} rounds")


if __name__ == "__main__":
    main()
