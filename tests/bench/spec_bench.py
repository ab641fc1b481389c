#!/usr/bin/env python3
"""Verify-pass cost for speculative decoding (issue 21, docs/PERFORMANCE.md):
runs build/tests/bench_spec (T = 1..K+1 from the same position, medians)
in process and with N `shoal expert` workers over tcp behind the delay relay
(tests/e2e/relay.py, a fixed one-way delay per direction), the routed experts
split evenly by expert index. Writes one JSON file with every raw line, the
summaries, the commit, the machine and the load.

Usage: spec_bench.py --model DIR --build build --out FILE.json
       [--kmax 8] [--reps 3] [--threads 2] [--workers 4] [--delay-ms 0.5] [--skip-inproc]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402
from relay import Relay  # noqa: E402


def bench(a, extra):
    cmd = [os.path.join(a.build, "tests", "bench_spec"), a.model, "--kmax", str(a.kmax), "--reps", str(a.reps),
           "--threads", str(a.threads), *extra]
    load0 = os.getloadavg()
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return {"cmd": cmd, "rc": r.returncode, "stderr": r.stderr[-2000:], "load_before": load0,
            "load_after": os.getloadavg(), "wall_s": time.time() - t0,
            "raw": [l for l in lines if "rep" in l], "summary": next((l for l in lines if "ratio_to_T1" in l), None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=0.5)
    ap.add_argument("--skip-inproc", action="store_true")
    a = ap.parse_args()
    c = json.load(open(os.path.join(a.model, "config.json")))
    c = c.get("text_config", c)
    moe = f"{c['first_k_dense_replace']}-{c['num_hidden_layers'] - 1}"
    E = c.get("n_routed_experts", c.get("num_experts"))
    doc = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": os.uname()._asdict() if hasattr(os.uname(), "_asdict") else list(os.uname()),
           "cpus": os.cpu_count(), "model": a.model, "runs": {}}
    if not a.skip_inproc:
        doc["runs"]["in-process"] = bench(a, [])
        print(json.dumps(doc["runs"]["in-process"]["summary"]), flush=True)
    if a.workers:
        shoal = os.path.join(a.build, "bin", "shoal")
        procs, relays = [], []
        eps = []
        per = E // a.workers
        for i in range(a.workers):
            port = harness.free_port()
            hi = E - 1 if i == a.workers - 1 else (i + 1) * per - 1
            procs.append(subprocess.Popen([shoal, "expert", "--model", a.model, "--listen", f"tcp://127.0.0.1:{port}",
                                           "--threads", "1", "--experts", f"{moe}:{i * per}-{hi}", "--insecure"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            r = Relay(("127.0.0.1", port), delay_ms=a.delay_ms)
            relays.append(r)
            eps += ["--worker", f"tcp://127.0.0.1:{r.port}"]
        time.sleep(3)
        try:
            name = f"{a.workers} workers, relay {a.delay_ms} ms"
            doc["runs"][name] = bench(a, eps + ["--insecure-workers", "--hello-timeout-ms", "120000",
                                                "--expert-timeout-ms", "120000"])
            print(json.dumps(doc["runs"][name]["summary"]), doc["runs"][name]["stderr"][-300:], flush=True)
        finally:
            for p in procs:
                harness.terminate(p, 5)
            for r in relays:
                try:
                    r.close()
                except Exception:
                    pass
    json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
