#!/usr/bin/env python3
"""Measured plans against measured runs (issue 34): on the shaped netns cluster
of tests/e2e/test_doctor_netns.py (one coordinator and three worker hosts,
rates by tc tbf, delays by relays, CURVE on every link), for each shaping:

1. `shoal doctor` measures the workers -> doctor.json;
2. `shoal plan --measured doctor.json` predicts every placement it considers
   (trunk local, spread over 1, 2, 3 workers) and chooses one;
3. each placement is written (`--trunk-servers G`), its workers started from
   the plan in their namespaces, and `shoal run --plan --trunk auto` decodes
   REPS times: the median decode s/token is the measurement;
4. per placement: predicted vs measured, the ids (identical across every
   placement and to the in-process run), and whether the chosen one is the
   fastest measured (or within 10%).

With --numerics mu the whole cluster runs the mu class (doctor, workers,
runs); with --wire-compare (issue 34, PROTOCOL.md 1.7) only the placement the
plan chose is run, REPS times each with `--wire-act auto` (bf16 activations)
and `--wire-act f32`, interleaved, against the plan's prediction for each
(`--numerics mu` and `--numerics portable`: the same kernels, f32 inputs).

Usage (root): plan_netns_bench.py [--model DIR] [--reps N] [--gen N] [--numerics mu]
              [--wire-compare [--trunk-servers G]] [--out FILE.json]
Needs root, iproute2 (tc tbf). Prints a table; writes the raw results as JSON.
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
import test_doctor_netns as net  # noqa: E402

BIN, SRC = net.BIN, net.SRC
PROMPT = "5,17,3,99,42,7"


def load():
    return open("/proc/loadavg").read().split()[0]


def start_workers(tmp, plan):
    ps = []
    for w in ("w0", "w1", "w2"):
        ps.append(subprocess.Popen(
            ["ip", "netns", "exec", net.NS[w], BIN, "expert", "--model", MODEL, "--plan", plan, "--name", w,
             "--threads", "1", "--curve-secret", f"{tmp}/keys/{w}.key", "--curve-allow", f"{tmp}/c.pub",
             "--numerics", NUMERICS],
            stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{w}.log", "a")))
    return ps


def write_plan(tmp, cluster, g, extra=(), measured=True):
    out = f"{tmp}/plan-{g}.json"
    r = subprocess.run([BIN, "plan", "--model", MODEL, "--cluster", cluster, "-o", out] +
                       (["--measured", f"{tmp}/doctor.json"] if measured else []) +
                       (["--trunk-servers", str(g)] if g is not None else []) + list(extra),
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr)
    p = json.load(open(out))
    for w in p["workers"]:  # the coordinator reaches each worker through its relay
        w["endpoint"] = f"tcp://127.0.0.1:{net.PORT[w['name']]}"
        w["listen"] = f"tcp://{net.IP[w['name']]}:5555"
    json.dump(p, open(out, "w"), indent=1)
    return out, p, r.stdout


def predictions(text):
    """{label: (s/token, bottleneck)} from plan --measured's table"""
    out = {}
    for m in re.finditer(r"^  (trunk (?:local|spread over \d+))\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                         r"([\d.]+)\s+([\d.]+)\s+(.*?)(?:\s+<-.*)?$", text, re.M):
        out[m.group(1)] = {"reads": float(m.group(2)), "coord": float(m.group(3)), "rtt": float(m.group(4)),
                           "wire": float(m.group(5)), "s_per_token": float(m.group(6)), "bottleneck": m.group(8)}
    return out


def run_plan(tmp, plan, reps, gen, extra=()):
    ts, ids = [], None
    for _ in range(reps):
        r = subprocess.run(["ip", "netns", "exec", net.NS["c"], BIN, "run", "--model", MODEL, "--plan", plan,
                            "--curve-secret", f"{tmp}/c.key", "--curve-keys", f"{tmp}/keys", "--trunk", "auto",
                            "--ids", PROMPT, "--gen", str(gen), "--json", "--threads", "1",
                            "--hello-timeout-ms", "60000", "--expert-timeout-ms", "60000",
                            "--numerics", NUMERICS, *extra],
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(r.stderr[-800:])
        j = json.loads(r.stdout)
        ts.append(1.0 / j["decode_tokens_per_s"])
        ids = j["generated_ids"] if ids is None else ids
        if j["generated_ids"] != ids:
            raise RuntimeError("ids differ between repetitions")
    return ts, ids, j


NUMERICS = "portable"


def main():
    global MODEL, NUMERICS
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(SRC, "tests", "models", "tiny-k3"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--overhead-us", default="100")
    ap.add_argument("--out", default="")
    ap.add_argument("--uniform", action="store_true", help="w2 shaped like w0 and w1 (no slow host)")
    ap.add_argument("--numerics", default="portable", choices=("portable", "mu"))
    ap.add_argument("--wire-compare", action="store_true",
                    help="run only the chosen placement, --wire-act auto and f32 interleaved")
    ap.add_argument("--trunk-servers", type=int, default=-1,
                    help="with --wire-compare: this placement (0: trunk local; G: spread over G) instead of the chosen")
    a = ap.parse_args()
    NUMERICS = a.numerics
    if a.uniform:
        net.SHAPE["w2"] = net.SHAPE["w0"]
    MODEL = net.TINY = os.path.abspath(a.model)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-planbench-")
    os.makedirs(f"{tmp}/keys")
    for k in ("c", "w0", "w1", "w2"):
        subprocess.run([BIN, "keygen", "-o", f"{tmp}/keys/{k}" if k != "c" else f"{tmp}/c"], check=True,
                       capture_output=True)
    # the in-process reference
    r = subprocess.run([BIN, "run", "--model", MODEL, "--ids", PROMPT, "--gen", str(a.gen), "--json", "--threads",
                        "1", "--numerics", NUMERICS], capture_output=True, text=True, check=True)
    ref = json.loads(r.stdout)
    cluster = f"{tmp}/cluster.json"
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
               "hosts": [{"name": "c", "address": net.IP["c"], "ssh_user": "root", "cpus": 1, "expert_ram": 0}] +
               [{"name": w, "address": net.IP[w], "ssh_user": "root", "cpus": 1, "expert_ram": "8GiB"}
                for w in ("w0", "w1", "w2")]}, open(cluster, "w"))
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    res = {"model": MODEL, "load_start": load(), "cpu": cpu, "cores": os.cpu_count(),
           "avx512f": " avx512f " in flags, "avx512_bf16": " avx512_bf16 " in flags,
           "command": " ".join(sys.argv), "shape": {k: list(v) for k, v in net.SHAPE.items()},
           "rate_fast_mbit": net.RATE_FAST, "tbf_burst": net.BURST, "reps": a.reps, "gen": a.gen, "overhead_us": float(a.overhead_us),
           "numerics": NUMERICS, "placements": {}}
    net.N.setup()
    procs = []
    try:
        net.shape()
        procs += net.relays(True)
        # doctor against the workers of a plain plan (any placement: doctor measures hosts and links)
        plan0, _, _ = write_plan(tmp, cluster, None, measured=False)
        ws = start_workers(tmp, plan0)
        args = ["ip", "netns", "exec", net.NS["c"], BIN, "doctor", "--model", MODEL, "--curve-secret",
                f"{tmp}/c.key", "--curve-keys", f"{tmp}/keys", "--plan", plan0, "--json", "-o", f"{tmp}/doctor.json",
                "--hello-timeout-ms", "60000", "--numerics", NUMERICS]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        for p in ws:
            harness.terminate(p, 5)
        if r.returncode:
            raise RuntimeError("doctor: " + r.stderr[-800:])
        res["doctor"] = json.load(open(f"{tmp}/doctor.json"))
        _, chosen_plan, text = write_plan(tmp, cluster, None, ["--overhead-us", a.overhead_us])
        pred = predictions(text)
        chosen = re.search(r"chosen: (trunk (?:local|spread over \d+))", text).group(1)
        res["plan_output"] = text
        res["chosen"] = chosen
        print(text, flush=True)
        if a.wire_compare:
            res["chosen"] = chosen
            if a.trunk_servers >= 0:
                chosen = "trunk local" if a.trunk_servers == 0 else f"trunk spread over {a.trunk_servers}"
            wire_compare(tmp, cluster, chosen, pred, a, ref, res)
            return 0
        for label in pred:
            g = 0 if label == "trunk local" else int(label.split()[-1])
            plan, p, _ = write_plan(tmp, cluster, g, ["--overhead-us", a.overhead_us])
            ws = start_workers(tmp, plan)
            try:
                ts, ids, j = run_plan(tmp, plan, a.reps, a.gen)
            finally:
                for q in ws:
                    harness.terminate(q, 5)
            m = statistics.median(ts)
            res["placements"][label] = {"predicted": pred[label], "measured_s_per_token": ts, "median": m,
                                        "ids_equal_in_process": ids == ref["generated_ids"],
                                        "trunk_round_trips": j.get("decode_trunk_round_trips_per_token"),
                                        "wire_bytes_per_token": j.get("decode_wire_bytes_per_token")}
            print(f"{label:24s} predicted {pred[label]['s_per_token'] * 1e3:8.2f} ms  measured "
                  f"{m * 1e3:8.2f} ms [{min(ts) * 1e3:.2f}, {max(ts) * 1e3:.2f}]  ratio {pred[label]['s_per_token'] / m:5.2f}"
                  f"  ids {'same' if ids == ref['generated_ids'] else 'DIFFER'}", flush=True)
        best = min(res["placements"].items(), key=lambda kv: kv[1]["median"])
        res["fastest_measured"] = best[0]
        res["chosen_within_10pct"] = res["placements"][chosen]["median"] <= 1.1 * best[1]["median"]
        res["load_end"] = load()
        print(f"chosen {chosen}; fastest measured {best[0]}; chosen within 10%: {res['chosen_within_10pct']}; "
              f"load {res['load_start']} -> {res['load_end']}")
    finally:
        for p in procs:
            harness.terminate(p, 5)
        net.N.teardown()
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


def wire_compare(tmp, cluster, chosen, pred, a, ref, res):
    """the chosen placement, --wire-act auto and f32 interleaved (one rep each per round)"""
    g = 0 if chosen == "trunk local" else int(chosen.split()[-1])
    plan, _, _ = write_plan(tmp, cluster, g, ["--overhead-us", a.overhead_us])
    _, _, text32 = write_plan(tmp, cluster, g, ["--overhead-us", a.overhead_us, "--numerics", "portable"])
    pr = {"auto": pred[chosen], "f32": predictions(text32)[chosen]}
    ws = start_workers(tmp, plan)
    out = {m: {"s_per_token": [], "ids_equal_in_process": True} for m in ("auto", "f32")}
    try:
        for _ in range(a.reps):
            for m in ("auto", "f32"):
                ts, ids, j = run_plan(tmp, plan, 1, a.gen, ["--wire-act", m])
                o = out[m]
                o["s_per_token"] += ts
                o["ids_equal_in_process"] &= ids == ref["generated_ids"]
                o["wire_bytes_out_per_token"] = j.get("decode_wire_bytes_out_per_token")
                o["trunk_wire_bytes_out_per_token"] = j.get("decode_trunk_wire_bytes_out_per_token")
    finally:
        for q in ws:
            harness.terminate(q, 5)
    for m in ("auto", "f32"):
        o = out[m]
        o["median"] = statistics.median(o["s_per_token"])
        o["predicted"] = pr[m]
        print(f"{chosen} --wire-act {m:4s}: predicted {pr[m]['s_per_token'] * 1e3:8.2f} ms  measured "
              f"{o['median'] * 1e3:8.2f} ms [{min(o['s_per_token']) * 1e3:.2f}, {max(o['s_per_token']) * 1e3:.2f}]  "
              f"sent {o['wire_bytes_out_per_token']} B/token (trunk {o['trunk_wire_bytes_out_per_token']})  ids "
              f"{'same' if o['ids_equal_in_process'] else 'DIFFER'}", flush=True)
    res["wire_compare"] = {"placement": chosen, **out}
    res["load_end"] = load()
    print(f"auto / f32 measured {out['auto']['median'] / out['f32']['median']:.3f}, predicted "
          f"{pr['auto']['s_per_token'] / pr['f32']['s_per_token']:.3f}; load {res['load_start']} -> {res['load_end']}")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
