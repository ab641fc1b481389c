#!/usr/bin/env python3
"""Trunk across machines benchmark (issue 16): decode seconds per token with
the trunk in-process ("local": routed experts on one worker) against
`--trunk remote` with the trunk rows split over 1, 2 or 4 workers (worker 0
also owns every routed expert; the others own trunk rows only; ROWSPEC
`*:i/N`), over ipc:// and over tcp:// through the delay relay
(tests/e2e/relay.py, a fixed one-way delay per direction; --insecure on
loopback). Configurations run interleaved, round-robin, `--reps` times, so
ratios come from one run under the same load; every run's ids must equal the
in-process reference (exit 1 otherwise). Records per run: decode s/token,
trunk round trips per token, wire bytes per token (experts + trunk, both
directions), the load average before it.

usage: trunk_bench.py --model DIR --bin SHOAL --out FILE.json [--gen N] [--reps N]
       [--threads N] [--delays 0.2,0.5,1] [--workers 1,2,4] [--relay-workers 0,2] [--chain off|on|both]
--chain on: every trunk worker also holds each KDA f_a whole (ROWSPEC `*:i/N,*.f_a_proj.weight:all`,
as `shoal plan --trunk spread` writes), so f_b(f_a(xn)) goes out chained (PROTOCOL.md §3.7, 1.4);
both: each remote set twice, without ("ipc", "relayD") and with ("ipc+chain", "relayD+chain")."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402
from relay import Relay  # noqa: E402


def moe_range(model):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    return f"{c['first_k_dense_replace']}-{c['num_hidden_layers'] - 1}:0-{c['num_experts'] - 1}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--delays", default="0.2,0.5,1")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--relay-workers", default="0,2", help="worker counts behind the relay (0: the local baseline)")
    ap.add_argument("--chain", default="off", choices=["off", "on", "both"])
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="shoal-tbench-")
    ex = moe_range(a.model)
    procs = []

    def worker(listen, experts=None, trunk=None, extra=()):
        args = [a.bin, "expert", "--model", a.model, "--listen", listen, "--threads", "1"] + list(extra)
        if experts:
            args += ["--experts", experts]
        if trunk:
            args += ["--trunk", trunk]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        return p

    chains = {"off": [False], "on": [True], "both": [False, True]}[a.chain]

    def spec(i, n, chain):
        return f"*:{i}/{n}" + (",*.f_a_proj.weight:all" if chain else "")

    # worker sets: ipc, and tcp behind relays (one relay per worker per delay)
    sets = {}
    for ch in chains:
        for n in sorted({1} | {int(x) for x in a.workers.split(",")}):
            eps = []
            for i in range(n):
                ep = f"ipc://{tmp}/w{n}-{i}{'c' if ch else ''}"
                worker(ep, ex if i == 0 else None, spec(i, n, ch))
                eps.append(ep)
            sets[("ipc+chain" if ch else "ipc", n)] = eps
    # the local baseline's expert worker (no trunk rows), ipc and tcp
    sets[("ipc", 0)] = [f"ipc://{tmp}/x"]
    worker(sets[("ipc", 0)][0], ex)
    relays = []
    delays = [float(x) for x in a.delays.split(",") if x]
    tcp_sets = {}
    for ch in chains:
        for n in sorted({int(x) for x in a.relay_workers.split(",") if x}):  # 0: the local baseline
            if n == 0 and ch:
                continue
            ports = []
            for i in range(max(n, 1)):
                port = harness.free_port()
                worker(f"tcp://127.0.0.1:{port}", ex if i == 0 else None, spec(i, n, ch) if n else None,
                       ["--insecure"])
                ports.append(port)
            tcp_sets[(ch, n)] = ports
    for d in delays:
        for (ch, n), ports in tcp_sets.items():
            eps = []
            for port in ports:
                r = Relay(("127.0.0.1", port), delay_ms=d)
                relays.append(r)
                eps.append(f"tcp://127.0.0.1:{r.port}")
            sets[(f"relay{d}" + ("+chain" if ch else ""), n)] = eps
    time.sleep(3)

    ids = ",".join(str(x) for x in (5, 17, 3, 99, 42, 7, 1000, 2047))
    configs = [(k, n) for (k, n) in sets]
    results = {f"{k}/{'local' if n == 0 else f'remote{n}'}": [] for k, n in configs}
    ref = None
    bad = 0
    for rep in range(a.reps):
        for k, n in configs:
            name = f"{k}/{'local' if n == 0 else f'remote{n}'}"
            args = [a.bin, "run", "--model", a.model, "--ids", ids, "--gen", str(a.gen), "--json", "--threads",
                    str(a.threads), "--hello-timeout-ms", "60000", "--expert-timeout-ms", "60000"]
            for e in sets[(k, n)]:
                args += ["--worker", e]
            if not k.startswith("ipc"):
                args += ["--insecure-workers"]
            if n:
                args += ["--trunk", "remote"]
            load = os.getloadavg()[0]
            r = subprocess.run(args, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                print(f"{name}: exit {r.returncode}: {r.stderr[-400:]}", file=sys.stderr)
                bad += 1
                continue
            j = json.loads(r.stdout)
            if ref is None:
                ref = j["generated_ids"]
            if j["generated_ids"] != ref:
                print(f"{name}: ids differ: {j['generated_ids']} vs {ref}", file=sys.stderr)
                bad += 1
            row = {"rep": rep, "load1": load, "decode_s_per_token": j["decode_s"] / max(j["decode_tokens"], 1),
                   "round_trips_per_token": j.get("decode_trunk_round_trips_per_token", 0),
                   "wire_bytes_per_token": j.get("decode_wire_bytes_per_token"),
                   "wire_messages_per_token": j.get("decode_wire_messages_per_token"),
                   "peak_rss_bytes": j.get("peak_vmhwm_bytes")}
            results[name].append(row)
            print(f"rep {rep} {name}: {row['decode_s_per_token']:.4f} s/token, "
                  f"{row['round_trips_per_token']:.0f} trunk round trips, "
                  f"{(row['wire_bytes_per_token'] or 0) / 1e3:.1f} kB/token, load {load:.2f}", flush=True)
    for p in procs:
        harness.terminate(p, 5)
    for r in relays:
        try:
            r.close()
        except Exception:
            pass
    summary = {}
    base = [x["decode_s_per_token"] for x in results.get("ipc/local", [])]
    for name, rows in results.items():
        v = [x["decode_s_per_token"] for x in rows]
        if not v:
            continue
        summary[name] = {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "n": len(v),
                         "ratio_to_ipc_local": statistics.median(v) / statistics.median(base) if base else None,
                         "round_trips_per_token": rows[0]["round_trips_per_token"],
                         "wire_bytes_per_token": rows[0]["wire_bytes_per_token"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    doc = {"commit": commit, "model": os.path.basename(os.path.normpath(a.model)), "gen": a.gen, "reps": a.reps,
           "threads": a.threads, "worker_threads": 1, "chain": a.chain, "nproc": os.cpu_count(), "command": " ".join(sys.argv),
           "runs": results, "summary": summary, "failures": bad}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for name, s in summary.items():
        print(f"{name:22s} {s['median_s']:.4f} s/token [{s['min_s']:.4f}..{s['max_s']:.4f}] x{s['ratio_to_ipc_local']:.2f}"
              f" rt {s['round_trips_per_token']:.0f} wire {(s['wire_bytes_per_token'] or 0) / 1e3:.1f} kB")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
