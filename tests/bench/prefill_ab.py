#!/usr/bin/env python3
"""Prefill A/B by process CPU time and wall (issue 33): bench_engine builds and
thread counts interleaved in rotating order, each run its own process, the
load recorded around every run. Not a test.

  prefill_ab.py --model DIR --out FILE.json [--prompt 256] [--rounds 3]
                --config LABEL=BENCH_ENGINE:THREADS[:ENV=VALUE,...] (repeat)

A config's ENV entries are added to the environment of its runs (for example
OMP_WAIT_POLICY=passive); an empty one leaves the environment as it is.
Every run prefills one fresh PROMPT-token sequence in one chunk
(bench_engine --steps 1 --prefill P --max-batch P) and reports the engine's
own prefill seconds and process CPU seconds (all threads), plus the rusage of
the whole process and the config row (threads, OpenMP wait policy, ISA)."""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_anchor  # noqa: E402  (run: a process with its rusage and load)


def run_one(bench, model, threads, env_extra, prompt):
    env = dict(os.environ)
    env.update(env_extra)
    cmd = [bench, model, "--threads", str(threads), "--steps", "1", "--reps", "1", "--prefill", str(prompt),
           "--prefill-reps", "1", "--max-batch", str(prompt)]
    out, info = prefill_anchor.run(cmd, env)
    row, config = None, None
    for line in out.splitlines():
        if line.startswith("row=prefill "):
            row = dict(x.split("=", 1) for x in line.split()[1:])
        elif line.startswith("row=config "):
            config = line
    if row is None:
        raise SystemExit(f"{cmd}: no prefill row")
    return {"command": cmd, "env": env_extra, "config": config, "prefill_s": float(row["seconds"]),
            "prefill_cpu_s": float(row["cpu_seconds"]), "experts_s": float(row["experts_seconds"]),
            **info}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", action="append", required=True)
    a = ap.parse_args()
    configs = []
    for c in a.config:
        label, rest = c.split("=", 1)
        parts = rest.split(":")
        env = {}
        if len(parts) > 2 and parts[2]:
            env = dict(kv.split("=", 1) for kv in parts[2].split(","))
        configs.append({"label": label, "bench": parts[0], "threads": int(parts[1]), "env": env})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    out = {"what": "prefill_ab (issue 33): bench_engine prefill, configs interleaved", "commit": commit,
           "machine": f"{model_name}, {os.cpu_count()} CPUs", "argv": sys.argv, "prompt": a.prompt,
           "configs": configs, "runs": []}
    for r in range(a.rounds):
        n = len(configs)
        for i in range(n):
            c = configs[(i + r) % n]
            res = run_one(c["bench"], a.model, c["threads"], c["env"], a.prompt)
            res.update({"round": r, "label": c["label"], "threads": c["threads"]})
            out["runs"].append(res)
            print(f"round {r} {c['label']}: prefill {res['prefill_s']:.2f} s, cpu {res['prefill_cpu_s']:.2f} s, "
                  f"{a.prompt / res['prefill_cpu_s']:.2f} tok/CPU-s, load {res['loadavg_before'][0]:.1f}",
                  flush=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
