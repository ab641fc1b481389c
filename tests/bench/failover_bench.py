#!/usr/bin/env python3
"""Failover benchmark (issue 18). Two parts, one JSON file:

decode: decode seconds per token of `shoal run` with 4 expert workers, each
  expert on one worker (R = 0, `shoal plan`) against every expert on two
  workers (R = 1, `shoal plan --replicas 1`), nothing failing. Both worker
  sets stay up (the same files: the page cache is shared); the two
  configurations run interleaved, round-robin, --reps times, so the ratio
  comes from one run under the same load. Every run's ids must equal the
  first R = 0 run's (exit 1 otherwise). The load average is recorded per run.

failover (--failover): `shoal serve` with the R = 1 workers and
  --failover-ms F; --faults streamed greedy completions (the official openai
  client, stream=True) of --stream-gen tokens; in each, after a random number
  of tokens, one random worker is SIGSTOPped (kind "stop": given up after F,
  SIGCONTed after the completion) or SIGKILLed (kind "kill": restarted after
  the completion), and the driver waits until /health lists all 4 up again
  before the next one. The time added to the token the failover happened in
  is the largest inter-token gap after the fault (the server generates ahead
  of the client's reads) minus the median gap of the fault-free completions
  run first: an upper bound, noise spikes included. Every arrival time is kept. Also records the
  coordinator's shoal_failover_seconds quantiles after each kind.

--trunk: the same with the trunk rows on the workers too (`shoal plan --trunk
  spread`, `--replicas 0/1` for both the experts and the trunk quarters;
  `shoal run/serve --trunk remote`): R = 1 then puts every trunk row on two
  workers, and a stopped or killed worker is mostly met first by a trunk step
  (about 6 trunk round trips per expert exchange), counted apart in
  shoal_trunk_failovers_total, recorded per kind and per fault (the counters
  read before and after each faulted completion); "trunk_only" figures are
  over the faults that caused exactly one failover, in a trunk step.

usage: failover_bench.py --model DIR --bin SHOAL --out FILE.json [--gen N] [--reps N]
       [--threads N] [--failover] [--faults N] [--stream-gen N] [--failover-ms F] [--trunk]"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import harness  # noqa: E402


def cluster(path, n, budget):
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i in range(n):
        hosts.append({"name": f"fb{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": budget, "port": 6100 + i})
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(path, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--failover", action="store_true")
    ap.add_argument("--faults", type=int, default=40)
    ap.add_argument("--stream-gen", type=int, default=24)
    ap.add_argument("--failover-ms", type=int, default=300)
    ap.add_argument("--kinds", default="stop,kill")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--trunk", action="store_true", help="trunk rows on the workers too (plan --trunk spread)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="shoal-fobench-")
    procs = []
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    git = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip() != ""
    out = {"commit": git + ("+dirty" if dirty else ""), "command": sys.argv, "machine": " ".join(os.uname()),
           "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "model": a.model, "gen": a.gen,
           "reps": a.reps, "threads": a.threads, "failover_ms": a.failover_ms, "trunk": a.trunk, "decode": [],
           "failover": {}}
    try:
        cl = os.path.join(tmp, "cluster.json")
        cluster(cl, 4, 1 << 50)
        ranges, trunks = {}, {}
        for r in (0, 1):
            pj = os.path.join(tmp, f"plan{r}.json")
            p = subprocess.run([a.bin, "plan", "--model", a.model, "--cluster", cl, "--replicas", str(r), "-o", pj]
                               + (["--trunk", "spread"] if a.trunk else []), capture_output=True, text=True,
                               timeout=600)
            if p.returncode:
                sys.exit(f"plan --replicas {r}: {p.stderr}")
            ranges[r] = [w["experts"] for w in json.load(open(pj))["workers"]]
            trunks[r] = [w.get("trunk") for w in json.load(open(pj))["workers"]]
        out["ranges"] = ranges
        out["trunk_rowspecs"] = trunks if a.trunk else None
        tflag = ["--trunk", "remote"] if a.trunk else []
        tag = f"{os.getpid()}"
        eps = {r: [f"ipc://@shoal-fobench-{tag}-{r}-{i}" for i in range(4)] for r in (0, 1)}
        wp = {}

        def start(r, i):
            p = subprocess.Popen([a.bin, "expert", "--model", a.model, "--experts", ranges[r][i], "--listen",
                                  eps[r][i], "--threads", "1", "--id", f"fb{r}{i}"]
                                 + (["--trunk", trunks[r][i]] if a.trunk else []), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            procs.append(p)
            wp[(r, i)] = p
        for r in (0, 1):
            for i in range(4):
                start(r, i)
        prompt = "1,2,3,4,5,6,7,8"
        ref = None
        for rep in range(0 if a.skip_decode else a.reps):
            for r in (0, 1):
                cmd = [a.bin, "run", "--model", a.model, "--ids", prompt, "--gen", str(a.gen), "--threads",
                       str(a.threads), "--json", "--hello-timeout-ms", "600000"] + tflag
                for ep in eps[r]:
                    cmd += ["--worker", ep]
                load = os.getloadavg()[0]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if p.returncode:
                    sys.exit(f"run R={r}: {p.stderr[-2000:]}")
                j = json.loads(p.stdout)
                ids = j["generated_ids"]
                if ref is None:
                    ref = ids
                if ids != ref:
                    sys.exit(f"R={r} rep {rep}: ids {ids} differ from {ref}")
                row = {"replicas": r, "rep": rep, "load1": load,
                       "decode_s_per_token": j["decode_s"] / max(1, j["decode_tokens"]),
                       "decode_tokens": j["decode_tokens"],
                       "trunk_round_trips_per_token": j.get("decode_trunk_round_trips_per_token")}
                out["decode"].append(row)
                print(json.dumps(row), flush=True)
        if not a.skip_decode:
            for r in (0, 1):
                xs = [x["decode_s_per_token"] for x in out["decode"] if x["replicas"] == r]
                out[f"decode_median_R{r}"] = statistics.median(xs)
            out["decode_ratio_R1_over_R0"] = [b["decode_s_per_token"] / a_["decode_s_per_token"]
                                              for a_, b in zip(out["decode"][0::2], out["decode"][1::2])]
            out["decode_ratio_median"] = statistics.median(out["decode_ratio_R1_over_R0"])
            print(f"decode s/token median R0 {out['decode_median_R0']:.4f} R1 {out['decode_median_R1']:.4f}; "
                  f"paired ratio median {out['decode_ratio_median']:.3f}", flush=True)
        for r in (0,):
            for i in range(4):
                harness.terminate(wp[(r, i)])
        if a.failover:
            import openai
            log = harness.logfile()
            cmd = [a.bin, "serve", "--model", a.model, "--port", "0", "--model-name", "m", "--threads",
                   str(a.threads), "--expert-timeout-ms", "30000", "--failover-ms", str(a.failover_ms), "--memo", "0",
                   "--hello-timeout-ms", "600000"] + tflag
            for ep in eps[1]:
                cmd += ["--worker", ep]
            srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(srv)
            line = srv.stdout.readline()
            if "listening on" not in line:
                log.seek(0)
                sys.exit(f"serve: {line!r} {log.read()[-2000:]!r}")
            url = line.strip().split("listening on ")[1]
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            rng = random.Random(1)

            def stream(prompt, fault=None):
                """arrival times of the tokens; fault = (after_n_tokens, action) run in the loop"""
                times, t_fault, toks = [], None, []
                s = client.completions.create(model="m", prompt=prompt, max_tokens=a.stream_gen, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True})
                for ch in s:
                    times.append(time.time())
                    toks.append((ch.choices[0].model_extra or {}).get("token_ids"))
                    if fault and len(times) == fault[0]:
                        time.sleep(rng.uniform(0, 0.02))  # somewhere in the next token
                        t_fault = time.time()
                        fault[1]()
                return times, t_fault, toks

            def all_up():
                t_end = time.time() + 120
                while time.time() < t_end:
                    st, h = harness.health(url)
                    if all(x["up"] for x in h["workers"]):
                        return True
                    time.sleep(0.05)
                return False

            def counters():
                """(shoal_failovers_total, shoal_trunk_failovers_total) now"""
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                    v = {x.split()[0]: float(x.split()[1]) for x in r.read().decode().splitlines()
                         if x.startswith("shoal_failovers_total ") or x.startswith("shoal_trunk_failovers_total ")}
                return v.get("shoal_failovers_total", 0.0), v.get("shoal_trunk_failovers_total", 0.0)

            gaps = []
            base = {}
            for k in range(8):
                pr = [3 + k, 9, 4, 2]
                t, _, toks = stream(pr)
                base[k] = [x for c in toks for x in (c or [])]
                gaps += [y - x for x, y in zip(t[1:], t[2:])]  # gaps between generated tokens after the first
            med = statistics.median(gaps)
            out["failover"]["clean_gap_median_s"] = med
            out["failover"]["clean_gap_p99_s"] = sorted(gaps)[int(0.99 * (len(gaps) - 1))]
            diffs = []
            out["failover"]["diffs"] = diffs
            for kind in a.kinds.split(","):
                added, loads, bad, raw = [], [], 0, []
                for n in range(a.faults):
                    k = n % 8
                    w = rng.randrange(4)
                    after = rng.randrange(3, a.stream_gen - 4)

                    def act():
                        if kind == "stop":
                            os.kill(wp[(1, w)].pid, signal.SIGSTOP)
                        else:
                            wp[(1, w)].kill()
                    loads.append(os.getloadavg()[0])
                    c0 = counters()
                    t, tf, toks = stream([3 + k, 9, 4, 2], (after, act))
                    flat = [x for c in toks for x in (c or [])]
                    if flat != base[k]:
                        bad += 1
                        diffs.append({"kind": kind, "worker": w, "after": after, "got": flat, "want": base[k],
                                      "chunks": toks})
                    if tf is None:  # the completion ended first (an EOS): no fault
                        continue
                    if kind == "stop":
                        os.kill(wp[(1, w)].pid, signal.SIGCONT)
                    else:
                        wp[(1, w)].wait()
                        # the coordinator must have seen it go before it is
                        # counted up again (else the next fault is a double one)
                        t_end = time.time() + 10
                        while time.time() < t_end and harness.health(url)[1]["workers"][w]["up"]:
                            time.sleep(0.02)
                        start(1, w)
                    all_up()
                    # the token the failover happened in: the largest gap after
                    # the fault (the server generates ahead of the client's
                    # reads, so the token in flight may be several after the
                    # one read last; a stopped worker is given up by the first
                    # exchange that picks it). Noise spikes count too: an
                    # upper bound.
                    nxt = [j for j, x in enumerate(t) if x > tf and j > 0]
                    c1 = counters()
                    fo_n = c1[0] - c0[0]
                    tfo_n = c1[1] - c0[1]
                    raw.append({"worker": w, "after": after, "t_fault": tf, "t": t, "failovers": fo_n,
                                "trunk_failovers": tfo_n})
                    if nxt:
                        added.append(max(t[j] - t[j - 1] for j in nxt) - med)
                        raw[-1]["added_s"] = added[-1]
                added.sort()
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                    m = [x for x in r.read().decode().splitlines()
                         if x.startswith("shoal_failover") or x.startswith("shoal_trunk_failovers_total")]
                cnt = next(float(x.split()[1]) for x in m if x.startswith("shoal_failover_seconds_count"))
                sm = next(float(x.split()[1]) for x in m if x.startswith("shoal_failover_seconds_sum"))
                tf_n = next((float(x.split()[1]) for x in m if x.startswith("shoal_trunk_failovers_total")), 0.0)
                prev = out["failover"].get("_prev", (0.0, 0.0, 0.0))
                out["failover"]["_prev"] = (cnt, sm, tf_n)
                # the faults met by a trunk step alone: one trunk failover, no other
                tonly = sorted(x["added_s"] for x in raw if "added_s" in x and x["failovers"] == 1 and
                               x["trunk_failovers"] == 1)
                res = {"n": len(added), "added_p50_s": statistics.median(added),
                       "trunk_only_n": len(tonly),
                       "trunk_only_added_p50_s": statistics.median(tonly) if tonly else None,
                       "trunk_only_added_p99_s": tonly[int(0.99 * (len(tonly) - 1))] if tonly else None,
                       "per_fault_failovers": [(x["failovers"], x["trunk_failovers"]) for x in raw],
                       "added_p99_s": added[int(0.99 * (len(added) - 1))], "added_max_s": added[-1],
                       "added_s": added, "ids_differ": bad, "load1": loads, "metrics": m, "raw": raw,
                       "failovers": cnt - prev[0], "trunk_failovers": tf_n - prev[2],
                       "failover_mean_s": (sm - prev[1]) / (cnt - prev[0]) if cnt > prev[0] else None}
                out["failover"][kind] = res
                print(f"{kind}: n {res['n']}, added p50 {res['added_p50_s'] * 1e3:.1f} ms, p99 "
                      f"{res['added_p99_s'] * 1e3:.1f} ms; ids differ {bad}; trunk-only faults {len(tonly)}"
                      + (f" p50 {res['trunk_only_added_p50_s'] * 1e3:.1f} p99 {res['trunk_only_added_p99_s'] * 1e3:.1f}"
                         " ms" if tonly else "") + f"; {m}", flush=True)
            harness.terminate(srv)
        out["failover"].pop("_prev", None)
        out["loadavg_end"] = os.getloadavg()
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                harness.terminate(p)
    json.dump(out, open(a.out, "w"), indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
