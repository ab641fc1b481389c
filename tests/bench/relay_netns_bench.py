#!/usr/bin/env python3
"""The relay tree for the trunk inputs (PROTOCOL.md §3.9) on a shaped network:
network namespaces on one bridge play a coordinator host and 4 worker hosts;
the coordinator's link is slow (tc tbf on both ends of its veth, RATE_C
Mbit/s), the workers' links fast (RATE_W), so the coordinator's egress is the
bottleneck a relay tree is for. Every link is tcp:// with CURVE; the workers
allow the coordinator's key and each other's (a relay parent connects to its
children with its own key). Worker i holds part i of 4 of every trunk matrix
and a quarter of the experts, and lists all 4 as --relay-peers.

`shoal run --trunk remote --relay-fanout F` for F = 0 (direct), 2, 3 and greedy
(the latency-aware schedule, --relay-rates from the shaping and doctor's RTT),
interleaved per round (one run of each per round, REPS rounds): decode s/token
(1 / decode_tokens_per_s), the coordinator's trunk bytes sent per decoded
token, relayed requests, fallbacks, and the ids against the in-process run;
before the runs, `shoal doctor` on these links and `shoal plan --measured
--nic-gbps RATE_C/1000 --peer-gbps RATE_W/1000` (the coordinator's link as the shared NIC, the
workers' links as the relay hops; doctor measures only the coordinator's links): its
prediction for the trunk over the 4 direct and with F = 2, 3, and its choice.

Usage (root): relay_netns_bench.py [--model DIR] [--reps N] [--gen N]
              [--rate-c MBIT] [--rate-w MBIT] [--out FILE.json]
Needs root and iproute2 (tc tbf). Prints a table; writes the raw results.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import harness  # noqa: E402

SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
PROMPT = "5,17,3,99,42,7"
HOSTS = ("c", "w0", "w1", "w2", "w3")


def load():
    return open("/proc/loadavg").read().split()[0]


def moe_split(model, n):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    L0, L, E = c["first_k_dense_replace"], c["num_hidden_layers"], c["num_experts"]
    return [f"{L0}-{L - 1}:{i * E // n}-{(i + 1) * E // n - 1}" for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(SRC, "build", "k3-scale"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--rate-c", type=int, default=100, help="the coordinator's link, Mbit/s")
    ap.add_argument("--rate-w", type=int, default=1000, help="each worker's link, Mbit/s")
    ap.add_argument("--burst", default="8kb")
    ap.add_argument("--fanouts", default="0,2,3,greedy")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 77
    model = os.path.abspath(a.model)
    fans = [x if x == "greedy" else int(x) for x in a.fanouts.split(",")]
    tmp = tempfile.mkdtemp(prefix="shoal-relaybench-")
    for k in HOSTS:
        subprocess.run([BIN, "keygen", "-o", f"{tmp}/{k}"], check=True, capture_output=True)
    open(f"{tmp}/allow", "w").write("".join(open(f"{tmp}/{k}.pub").read() for k in HOSTS))
    r = subprocess.run([BIN, "run", "--model", model, "--ids", PROMPT, "--gen", str(a.gen), "--json", "--threads",
                        "1"], capture_output=True, text=True, check=True)
    ref = json.loads(r.stdout)
    N = harness.Netns("rl", 79, HOSTS)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    res = {"model": model, "cpu": cpu, "cores": os.cpu_count(), "avx512f": " avx512f " in flags,
           "avx512_bf16": " avx512_bf16 " in flags, "amx": " amx_tile " in flags, "command": " ".join(sys.argv),
           "rate_c_mbit": a.rate_c, "rate_w_mbit": a.rate_w, "burst": a.burst, "reps": a.reps, "gen": a.gen,
           "load_start": load(), "runs": []}
    N.setup()
    ws = []
    try:
        N.shape("c", a.rate_c, a.burst)
        for w in HOSTS[1:]:
            N.shape(w, a.rate_w, a.burst)
        eps = [f"tcp://{N.ip[w]}:5555" for w in HOSTS[1:]]
        peers = ",".join(f"{e}@{tmp}/{w}.pub" for e, w in zip(eps, HOSTS[1:]))
        split = moe_split(model, 4)
        for i, w in enumerate(HOSTS[1:]):
            ws.append(N.popen(w, [BIN, "expert", "--model", model, "--listen", eps[i], "--id", w, "--threads", "1",
                                  "--experts", split[i], "--trunk", f"*:{i}/4", "--curve-secret", f"{tmp}/{w}.key",
                                  "--curve-allow", f"{tmp}/allow", "--relay-peers", peers],
                              stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{w}.log", "w")))

        def linked():
            return all(open(f"{tmp}/{w}.log").read().count("as a relay parent") == 3 for w in HOSTS[1:])
        if not harness.poll(linked, 300, 0.5):
            raise RuntimeError("workers not linked: " + open(f"{tmp}/w0.log").read()[-800:])
        # the plan's prediction for each fan-out: shoal doctor on these links, then plan --measured with the
        # coordinator's link as the shared NIC (--nic-gbps), the trunk over the 4
        wargs = []
        for e, w in zip(eps, HOSTS[1:]):
            wargs += ["--worker", e, "--worker-key", f"{tmp}/{w}.pub"]
        r = subprocess.run([*N.prefix("c"), BIN, "doctor", "--model", model, "--curve-secret", f"{tmp}/c.key",
                            "--hello-timeout-ms", "60000", "--json", "-o", f"{tmp}/doctor.json"] + wargs,
                           capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            res["doctor"] = json.load(open(f"{tmp}/doctor.json"))
            json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
                       "hosts": [{"name": h, "address": N.ip[h], "ssh_user": "root", "cpus": 1,
                                  "expert_ram": 0 if h == "c" else "8GiB"} for h in HOSTS]},
                      open(f"{tmp}/cluster.json", "w"))
            for force in (["--trunk-servers", "4"], []):
                r = subprocess.run([BIN, "plan", "--model", model, "--cluster", f"{tmp}/cluster.json", "--measured",
                                    f"{tmp}/doctor.json", "--nic-gbps", str(a.rate_c / 1000),
                                    "--peer-gbps", str(a.rate_w / 1000), "-o",
                                    f"{tmp}/plan.json"] + force, capture_output=True, text=True)
                res["plan_output" + ("_forced_4" if force else "")] = r.stdout
                print(r.stdout, flush=True)
            pred = {}
            for F, label in ((0, "trunk spread over 4"), (2, "spread over 4, relay F=2"),
                             (3, "spread over 4, relay F=3"), ("greedy", "spread over 4, relay greedy")):
                m = re.search(r"^  " + re.escape(label) + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                              r"([\d.]+)", res["plan_output_forced_4"], re.M)
                if m:
                    pred[F] = float(m.group(5))
            res["predicted_s_per_token"] = pred
            cm = re.search(r"chosen: ([^,\n]+(?:, relay (?:F=\d|greedy))?)", res["plan_output"])
            res["plan_chose"] = cm.group(1) if cm else None
        else:
            print("doctor failed: " + r.stderr[-500:], flush=True)
        base = [*N.prefix("c"), BIN, "run", "--model", model, "--ids", PROMPT, "--gen", str(a.gen), "--json",
                "--threads", "1", "--trunk", "remote", "--curve-secret", f"{tmp}/c.key", "--hello-timeout-ms",
                "60000", "--expert-timeout-ms", "60000"]
        for e, w in zip(eps, HOSTS[1:]):
            base += ["--worker", e, "--worker-key", f"{tmp}/{w}.pub"]
        # the greedy schedule's rates, as the plan prices it: the coordinator's link, the workers', and a hop of
        # the slowest worker's RTT / 2 + the plan's 100 us overhead
        rtt = max(w["rtt_p50_us"] for w in res["doctor"]["workers"]) if "doctor" in res else 200
        res["relay_rates"] = rates = f"{a.rate_c / 1000!r},{a.rate_w / 1000!r},{rtt / 2 + 100!r}"
        for rnd in range(a.reps):
            for F in fans:
                t0 = time.monotonic()
                r = subprocess.run(base + ["--relay-fanout", str(F)] +
                                   (["--relay-rates", rates] if F == "greedy" else []),
                                   capture_output=True, text=True, timeout=900)
                if r.returncode:
                    raise RuntimeError(f"F={F}: {r.stderr[-800:]}")
                j = json.loads(r.stdout)
                run = {"round": rnd, "F": F, "decode_s_per_token": 1.0 / j["decode_tokens_per_s"],
                       "trunk_bytes_out_per_token": j.get("decode_trunk_wire_bytes_out_per_token"),
                       "trunk_bytes_in_per_token": j.get("decode_trunk_wire_bytes_per_token", 0) -
                       j.get("decode_trunk_wire_bytes_out_per_token", 0),
                       "relayed": j.get("trunk_relayed_requests"), "fallbacks": j.get("trunk_relay_fallbacks"),
                       "ids_equal_in_process": j["generated_ids"] == ref["generated_ids"],
                       "wall_s": time.monotonic() - t0, "load": load()}
                res["runs"].append(run)
                print(f"round {rnd} F={F}: {run['decode_s_per_token'] * 1e3:8.1f} ms/token, trunk sent "
                      f"{run['trunk_bytes_out_per_token']:.0f} B/token, relayed {run['relayed']}, fallbacks "
                      f"{run['fallbacks']}, ids {'same' if run['ids_equal_in_process'] else 'DIFFER'}, load "
                      f"{run['load']}", flush=True)
    finally:
        for p in ws:
            harness.terminate(p, 5)
        N.teardown()
    res["load_end"] = load()
    pred = res.get("predicted_s_per_token", {})
    print(f"plan (no forcing) chose: {res.get('plan_chose')}")
    print(f"{'F':>3} {'median ms/token':>16} {'[min, max]':>20} {'trunk sent B/token':>19} {'paired F/0':>11} "
          f"{'predicted ms':>13} {'pred/meas':>10}")
    for F in fans:
        ts = [x["decode_s_per_token"] for x in res["runs"] if x["F"] == F]
        ratio = [x["decode_s_per_token"] / y["decode_s_per_token"] for x in res["runs"] if x["F"] == F
                 for y in res["runs"] if y["F"] == 0 and y["round"] == x["round"]]
        b = [x["trunk_bytes_out_per_token"] for x in res["runs"] if x["F"] == F][0]
        res.setdefault("summary", {})[str(F)] = {"median_s": statistics.median(ts), "min_s": min(ts),
                                                 "max_s": max(ts), "paired_ratio_median": statistics.median(ratio),
                                                 "trunk_bytes_out_per_token": b}
        pm = pred.get(F, pred.get(str(F)))
        print(f"{F!s:>3} {statistics.median(ts) * 1e3:16.1f} [{min(ts) * 1e3:8.1f}, {max(ts) * 1e3:8.1f}] {b:19.0f} "
              f"{statistics.median(ratio):11.3f} {pm * 1e3 if pm else float('nan'):13.1f} "
              f"{pm / statistics.median(ts) if pm else float('nan'):10.2f}")
    print(f"load {res['load_start']} -> {res['load_end']}; ids all same: "
          f"{all(x['ids_equal_in_process'] for x in res['runs'])}")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
