#!/usr/bin/env python3
"""Decode seconds per token against worker count and emulated round-trip time
(issue 10, docs/PERFORMANCE.md "Across machines"). Starts N `shoal expert`
processes on tcp:// (plain, --insecure: the benchmark measures the exchange,
not encryption), one delay-injecting relay per worker (tests/e2e/relay.py,
D ms each way), and runs `shoal run --json` through the relays; records one
JSON row per run, and what the relay adds to a round trip, measured first.
Timings are recorded, never asserted.

  cluster_bench.py MODEL OUT [--workers 1,2,4] [--delay-ms 0,0.25,1] [--gen 17] [--reps 2] [--ids LIST]
"""
import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
src = os.path.abspath(os.path.join(here, "..", ".."))
sys.path.insert(0, os.path.join(src, "tests", "e2e"))
from relay import measure  # noqa: E402

BIN = os.environ.get("SHOAL_BIN", os.path.join(src, "build", "bin", "shoal"))
IDS = "1000,2000,3000,4000,5000,6000,7000,8000,9000,10000,11000,12000,13000,14000,15000,16000"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def split(n, moe, E):
    """worker w of n: experts [w*E/n, (w+1)*E/n) of every MoE layer"""
    lo, hi = min(moe), max(moe)
    return [f"{lo}-{hi}:{w * E // n}-{(w + 1) * E // n - 1}" for w in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--delay-ms", default="0,0.25,1")
    ap.add_argument("--gen", type=int, default=17)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ids", default=IDS)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    c = json.load(open(os.path.join(a.model, "config.json")))
    t = c.get("text_config", c)
    L, E = t["num_hidden_layers"], t["num_experts"]
    fk, fr = t["first_k_dense_replace"], t["moe_layer_freq"]
    moe = [l for l in range(L) if l >= fk and (l - fk) % fr == 0]
    commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = open(a.out, "w")

    def w(line):
        out.write(line + "\n")
        out.flush()
        print(line, flush=True)
    w(f"# cluster_bench (docs/PERFORMANCE.md, Across machines); commit {commit}")
    w(f"# command {' '.join(sys.argv)}")
    w(f"# date {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; {platform.machine()}, {os.cpu_count()} cpus; "
      f"load before {' '.join(open('/proc/loadavg').read().split()[:3])}")
    w(f"# model {a.model}: layers {L}, MoE layers {len(moe)}, experts {E}, top {t['num_experts_per_token']}, "
      f"hidden {t['hidden_size']}, latent {t['routed_expert_hidden_size']}; coordinator --threads {a.threads}, "
      f"workers --threads {a.worker_threads}")
    subprocess.run([BIN, "run", "--model", a.model, "--ids", a.ids, "--gen", "2", "--json"], capture_output=True)
    delays = [float(x) for x in a.delay_ms.split(",")]
    for d in delays:
        direct, relayed = measure(d, n=300)
        w(json.dumps({"relay_check": True, "delay_ms_each_way": d, "direct_rtt_us": round(direct * 1e6, 1),
                      "relayed_rtt_us": round(relayed * 1e6, 1), "added_us": round((relayed - direct) * 1e6, 1)}))
    for rep in range(a.reps):
        for n in [int(x) for x in a.workers.split(",")]:
            for d in delays:
                procs, relays, eps = [], [], []
                for i, rg in enumerate(split(n, moe, E)):
                    port = free_port()
                    procs.append(subprocess.Popen([BIN, "expert", "--model", a.model, "--experts", rg, "--listen",
                                                   f"tcp://127.0.0.1:{port}", "--insecure", "--threads",
                                                   str(a.worker_threads), "--id", f"w{i}"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    rport = free_port()  # one relay process per link (no shared GIL)
                    relays.append(subprocess.Popen([sys.executable, os.path.join(src, "tests", "e2e", "relay.py"),
                                                    f"127.0.0.1:{rport}", f"127.0.0.1:{port}", "--delay-ms", str(d)],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    eps += ["--worker", f"tcp://127.0.0.1:{rport}"]
                try:
                    time.sleep(0.5)
                    t0 = time.monotonic()
                    r = subprocess.run([BIN, "run", "--model", a.model, "--ids", a.ids, "--gen", str(a.gen),
                                        "--json", "--threads", str(a.threads), "--insecure-workers", *eps],
                                       capture_output=True, text=True)
                    wall = time.monotonic() - t0
                finally:  # never leave workers or relays behind
                    for p in procs + relays:
                        p.terminate()
                        p.wait()
                try:
                    doc = json.loads(r.stdout.strip().splitlines()[-1])
                except Exception:
                    doc = {"error": r.stderr[-300:]}
                keep = {k: v for k, v in doc.items() if k in (
                    "generated_ids", "decode_tokens", "decode_s", "prefill_s", "decode_wire_bytes_per_token",
                    "decode_wire_messages_per_token", "decode_expert_wait_s", "decode_worker_compute_s",
                    "decode_step_ms", "error")}
                w(json.dumps({"rep": rep, "workers": n, "delay_ms_each_way": d, "wall_s": round(wall, 3), **keep}))
    w(f"# load after {' '.join(open('/proc/loadavg').read().split()[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
