#!/usr/bin/env python3
"""Decode speed of `shoal run --workers W --threads T` with and without one
background CPU hog, for several shoal binaries / environments, interleaved in
one run (docs/PERFORMANCE.md, "Waiting"). Prints one JSON row per run and a
summary (median [min, max] decode ms per step, wall and CPU seconds), with
the load average before and after.

  tests/bench/wait_bench.py --model tests/models/tiny-k3 \
      --case base=/tmp/old/shoal --case new=build/bin/shoal \
      --case new+spin=build/bin/shoal:GOMP_SPINCOUNT=300000 --reps 5

Each case is NAME=BINARY[:VAR=VALUE,...]. Runs are bounded: every shoal run
has a timeout (--timeout, default 120 s) and the hog is killed after each.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def one(binary, env_extra, model, workers, threads, gen, hog, timeout):
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("SHOAL_OMP_WAIT", None)
    env.update(env_extra)
    h = None
    if hog:
        h = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
        time.sleep(0.2)
    try:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        p = subprocess.run([binary, "run", "--model", model, "--ids", "1,2,3,4", "--gen", str(gen),
                            "--workers", str(workers), "--threads", str(threads), "--json"],
                           env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - t0
    finally:
        if h:
            h.kill()
            h.wait()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if hog:
        cpu = None  # the hog's CPU time is counted too; not meaningful
    if p.returncode != 0:
        raise SystemExit(f"{binary} failed ({p.returncode}): {p.stderr[-2000:]}")
    d = json.loads(p.stdout)
    return dict(step_ms=statistics.median(d["decode_step_ms"]), wall_s=wall, cpu_s=cpu,
                ids=d["generated_ids"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    cases = []
    for c in a.case:
        name, rest = c.split("=", 1)
        binary, _, envs = rest.partition(":")
        env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
        cases.append((name, binary, env))
    print(f"# load before: {open('/proc/loadavg').read().strip()}")
    print(f"# workers {a.workers} threads {a.threads} gen {a.gen} reps {a.reps} model {a.model}")
    res = {}
    ids = {}
    for rep in range(a.reps):
        for hog in (False, True):
            for name, binary, env in cases:
                r = one(binary, env, a.model, a.workers, a.threads, a.gen, hog, a.timeout)
                key = (name, hog)
                res.setdefault(key, []).append(r)
                ids.setdefault(name, r["ids"])
                if r["ids"] != ids[name]:
                    print(f"# WARNING: {name} generated different ids", file=sys.stderr)
                print(json.dumps(dict(case=name, hog=hog, rep=rep, step_ms=r["step_ms"], wall_s=r["wall_s"],
                                      cpu_s=r["cpu_s"])), flush=True)
    print(f"# load after: {open('/proc/loadavg').read().strip()}")
    print("# case hog: decode ms/step median [min,max]; wall s median; cpu s median (idle only)")
    for (name, hog), rs in res.items():
        st = [r["step_ms"] for r in rs]
        wall = [r["wall_s"] for r in rs]
        cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
        print(f"# {name:12s} {'hog ' if hog else 'idle'}: {statistics.median(st):9.2f} [{min(st):.2f},{max(st):.2f}]"
              f"  wall {statistics.median(wall):.3f}  cpu {statistics.median(cpu) if cpu else float('nan'):.3f}")
    same = len({tuple(v) for v in ids.values()}) == 1
    print(f"# generated ids identical across cases: {same}")


if __name__ == "__main__":
    main()
