#!/usr/bin/env python3
"""The relay tree chosen by the measured plan and served on a shaped network
(issue 34): network namespaces on one bridge play a coordinator host and 4
worker hosts. The coordinator's link is slow (tc tbf on both ends of its veth,
RATE_C Mbit/s: its NIC is the bottleneck a relay tree is for), the workers'
fast (RATE_W). Every link is tcp:// with CURVE; each worker allows the
coordinator's key and the other workers' (a relay parent connects to its
children with its own key).

1. `shoal doctor` measures the 4 workers over their real links.
2. `shoal plan --measured doctor.json --coordinator-mem 2MiB --nic-gbps
   RATE_C/1000 --peer-gbps RATE_W/1000` on a manifest whose workers hold at most
   WORKER_RAM each: k3-nano's trunk (6.1 MiB on the coordinator with the trunk
   local, 1.1 MiB spread) does not fit on the coordinator, nor its rows on 1 or
   2 workers (5.0 and 2.5 MiB), so the placements left are the spread over 4,
   direct or through a relay tree (F = 2, 3, or the latency-aware schedule,
   greedy); the plan must choose a tree (plan.json relay_fanout). k3-nano rather than tiny-k3: its trunk inputs per
   step are larger beside the ~200-byte request headers the plan's wire term
   leaves out (docs/PERFORMANCE.md), and its inputs x 4 outweigh its outputs,
   so the model ranks the trees by their own figures.
3. The workers started from that plan in their namespaces (`shoal expert --plan
   --name`, the plan's trunk workers as relay peers, `--relay-keys`); every
   placement the plan priced is served from the coordinator's namespace
   (`shoal run --plan --relay-fanout F`, F = 0, 2, 3, greedy with the plan's
   relay_rates, or the rates it priced greedy with), one greedy generation of
   GEN tokens each, decode s/token = 1 / decode_tokens_per_s.
Checks: the chosen placement's s/token within 10% of the fastest measured; each
placement's prediction within 30% of its measured s/token; the ids identical to
the in-process run for every placement; the relayed runs relayed (and the
direct one did not). A busy host only slows a run, so the times are the best of
up to three interleaved rounds (another round only while a check on the times
fails), as test_doctor_netns does.
Needs root and iproute2 (tc tbf): SKIPs otherwise.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~40 s.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_relay_netns"
SRC = os.path.abspath(os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
MODEL = os.path.join(SRC, "tests", "models", "k3-nano")
HOSTS = ("c", "w0", "w1", "w2", "w3")
WORKERS = HOSTS[1:]
RATE_C = int(os.environ.get("SHOAL_RELAY_RATE_C_MBIT", "4"))
RATE_W = int(os.environ.get("SHOAL_RELAY_RATE_W_MBIT", "100"))
BURST = "8kb"
WORKER_RAM = 2500000  # bytes: a quarter of the trunk rows and the experts fit, half the rows (2.520 MiB) do not
COORD_MEM = "2MiB"    # the trunk spread (0.9 MiB) fits, the trunk local (3.7 MiB) does not
GEN = int(os.environ.get("SHOAL_RELAY_GEN", "12"))
PROMPT = "5,17,3,99"
LABELS = {0: "trunk spread over 4", 2: "spread over 4, relay F=2", 3: "spread over 4, relay F=3",
          "greedy": "spread over 4, relay greedy"}
N = harness.Netns("rn", 76, HOSTS)
R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
sh = harness.sh


def main():
    if os.geteuid() != 0:
        record("SKIP", "all", "needs root (network namespaces)")
        return 77
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    t_start = time.monotonic()
    load0 = open("/proc/loadavg").read().split()[0]
    tmp = tempfile.mkdtemp(prefix="shoal-relaynetns-")
    for k in HOSTS:
        sh([BIN, "keygen", "-o", f"{tmp}/{k}"])
    open(f"{tmp}/allow", "w").write("".join(open(f"{tmp}/{k}.pub").read() for k in HOSTS))
    ref = json.loads(sh([BIN, "run", "--model", MODEL, "--ids", PROMPT, "--gen", str(GEN), "--json", "--threads",
                         "1"]).stdout)["generated_ids"]
    if not N.setup_or_skip(R):
        return 77
    procs = []
    try:
        N.shape("c", RATE_C, BURST)
        for w in WORKERS:
            N.shape(w, RATE_W, BURST)
        ep = {w: f"tcp://{N.ip[w]}:5555" for w in WORKERS}
        # 1. doctor, against workers holding a quarter of the experts each (no trunk rows: doctor measures hosts
        # and links)
        for w, ex in zip(WORKERS, harness.moe_split(MODEL, 4)):
            procs.append(N.popen(w, [BIN, "expert", "--model", MODEL, "--experts", ex, "--listen", ep[w], "--id", w,
                                     "--threads", "1", "--curve-secret", f"{tmp}/{w}.key", "--curve-allow",
                                     f"{tmp}/allow"], stdout=subprocess.DEVNULL,
                                 stderr=open(f"{tmp}/{w}.doctor.log", "w")))
        args = [*N.prefix("c"), BIN, "doctor", "--model", MODEL, "--curve-secret", f"{tmp}/c.key",
                "--hello-timeout-ms", "30000", "--json", "-o", f"{tmp}/doctor.json", "--rounds", "100",
                "--bulk-count", "8", "--bulk-bytes", "65536"]
        for w in WORKERS:
            args += ["--worker", ep[w], "--worker-key", f"{tmp}/{w}.pub"]
        r = sh(args, check_rc=False, timeout=180)
        if not check("doctor on the shaped links", r.returncode == 0, r.stderr[-800:]):
            return 1
        for p in procs:
            harness.terminate(p, 5)
        procs.clear()
        doc = json.load(open(f"{tmp}/doctor.json"))
        for w in doc["workers"]:
            print(f"{w['name']}: RTT p50 {w['rtt_p50_us']:.0f} us, out {w['out_bytes_per_s'] / 1e6:.2f} MB/s, in "
                  f"{w['in_bytes_per_s'] / 1e6:.2f} MB/s (shaped {RATE_C / 8:.2f} MB/s at the coordinator)",
                  flush=True)
        # 2. the measured plan under the coordinator's and the workers' budgets
        man = f"{tmp}/cluster.json"
        json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
                   "hosts": [{"name": h, "address": N.ip[h], "ssh_user": "root", "cpus": 1,
                              "expert_ram": 0 if h == "c" else WORKER_RAM} for h in HOSTS]}, open(man, "w"))
        out = f"{tmp}/plan.json"
        r = sh([BIN, "plan", "--model", MODEL, "--cluster", man, "--measured", f"{tmp}/doctor.json",
                "--coordinator-mem", COORD_MEM, "--nic-gbps", str(RATE_C / 1000), "--peer-gbps",
                str(RATE_W / 1000), "-o", out], check_rc=False)
        print(r.stdout, flush=True)
        plan_out = r.stdout
        if not check("plan --measured --coordinator-mem on the doctor's figures", r.returncode == 0,
                     r.stderr[-600:] + r.stdout[-600:]):
            return 1
        plan = json.load(open(out))
        chosen = plan.get("relay_fanout", 0)
        check("trunk local does not fit: the coordinator's budget named",
              re.search(r"^  trunk local\s+does not fit: needs [\d.]+ MiB on the coordinator, its budget is 2.000 MiB",
                        r.stdout, re.M) is not None, r.stdout[-1500:])
        check("the spreads over 1 and 2 do not fit the workers' budgets",
              all(re.search(r"^  trunk spread over " + g + r"\s+does not fit", r.stdout, re.M) for g in ("1", "2")),
              r.stdout[-1500:])
        pred = {F: (harness.plan_row(r.stdout, lab) or [None] * 5)[4] for F, lab in LABELS.items()}
        if not check("the plan chooses a relay tree over the 4 (relay_fanout in plan.json), every placement priced",
                     plan.get("trunk") == "spread" and plan.get("trunk_servers") == 4 and chosen in (2, 3, "greedy") and
                     all(pred.values()), f"{json.dumps({k: plan.get(k) for k in ('trunk', 'trunk_servers', 'relay_fanout')})} {pred}"):
            return 1
        # 3. the plan's workers, each placement served
        for w in WORKERS:
            procs.append(N.popen(w, [BIN, "expert", "--model", MODEL, "--plan", out, "--name", w, "--threads", "1",
                                     "--curve-secret", f"{tmp}/{w}.key", "--curve-allow", f"{tmp}/allow",
                                     "--relay-keys", tmp], stdout=subprocess.DEVNULL,
                                 stderr=open(f"{tmp}/{w}.log", "w")))

        def linked():
            return all(open(f"{tmp}/{w}.log").read().count("as a relay parent") == 3 for w in WORKERS)
        if not check("the plan's workers up and linked as each other's relay peers", harness.poll(linked, 60, 0.2),
                     open(f"{tmp}/w0.log").read()[-800:]):
            return 1
        base = [*N.prefix("c"), BIN, "run", "--model", MODEL, "--plan", out, "--curve-secret", f"{tmp}/c.key",
                "--curve-keys", tmp, "--ids", PROMPT, "--gen", str(GEN), "--json", "--threads", "1", "--trunk", "remote",
                "--hello-timeout-ms", "30000"]
        times = {F: [] for F in LABELS}
        # the greedy schedule's rates: the plan's relay_rates when it chose it, else what it priced it with (the
        # NIC and peer rates given to plan, the hop = the slowest worker's RTT / 2 + the 100 us overhead)
        rr = plan.get("relay_rates") or {"nic_gbps": RATE_C / 1000, "peer_gbps": RATE_W / 1000,
                                         "hop_us": max(w["rtt_p50_us"] for w in doc["workers"]) / 2 + 100}
        rates = f"{rr['nic_gbps']!r},{rr['peer_gbps']!r},{rr['hop_us']!r}"
        runs = []

        def off():
            best = {F: min(v) for F, v in times.items()}
            fastest = min(best.values())
            return best[chosen] > 1.1 * fastest or any(abs(pred[F] - best[F]) > 0.3 * best[F] for F in LABELS)
        for rnd in range(3):
            for F in LABELS:
                r = sh(base + ["--relay-fanout", str(F)] + (["--relay-rates", rates] if F == "greedy" else []),
                       check_rc=False, timeout=180)
                if not check(f"round {rnd}: {LABELS[F]} served", r.returncode == 0, r.stderr[-800:]):
                    return 1
                j = json.loads(r.stdout)
                times[F].append(1.0 / j["decode_tokens_per_s"])
                runs.append((F, j))
            print(f"round {rnd} (ms/token): " + ", ".join(f"F={F} {times[F][-1] * 1e3:.1f}" for F in LABELS) +
                  f"; load {open('/proc/loadavg').read().split()[0]}", flush=True)
            if not off():
                break
        best = {F: min(v) for F, v in times.items()}
        fastest = min(best, key=best.get)
        for F in LABELS:
            print(f"{LABELS[F]}: predicted {pred[F] * 1e3:.1f} ms/token, measured best {best[F] * 1e3:.1f} "
                  f"(runs {[round(t * 1e3, 1) for t in times[F]]}), predicted/measured {pred[F] / best[F]:.2f}"
                  f"{'  <- chosen' if F == chosen else ''}", flush=True)
        check(f"the chosen placement ({LABELS[chosen]}, {best[chosen] * 1e3:.1f} ms) within 10% of the fastest "
              f"measured ({LABELS[fastest]}, {best[fastest] * 1e3:.1f} ms; best of {len(times[0])})",
              best[chosen] <= 1.1 * best[fastest], "")
        for F in LABELS:
            check(f"{LABELS[F]}: prediction {pred[F] * 1e3:.1f} ms within 30% of the measured {best[F] * 1e3:.1f} ms",
                  abs(pred[F] - best[F]) <= 0.3 * best[F], "")
        bad = [(F, j["generated_ids"]) for F, j in runs if j["generated_ids"] != ref]
        check(f"ids identical to the in-process run in every run ({len(runs)} runs, {len(LABELS)} placements)", not bad,
              f"{bad[:2]} vs {ref}")
        check("the relayed runs relayed, the direct ones did not", all(
            (j.get("trunk_relayed_requests", 0) > 0) == (F != 0) for F, j in runs),
            str([(F, j.get("trunk_relayed_requests"), j.get("trunk_relay_fallbacks")) for F, j in runs]))
        print(f"time: {time.monotonic() - t_start:.1f} s", flush=True)
        if os.environ.get("SHOAL_RELAY_NETNS_OUT"):  # the raw figures, for docs/data
            cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
            json.dump({"cpu": cpu, "cores": os.cpu_count(), "rate_c_mbit": RATE_C, "rate_w_mbit": RATE_W,
                       "worker_ram": WORKER_RAM, "coordinator_mem": COORD_MEM, "gen": GEN, "load_start": load0,
                       "load_end": open("/proc/loadavg").read().split()[0], "doctor": doc, "plan_output": plan_out,
                       "chosen_fanout": chosen, "predicted_s": {str(F): pred[F] for F in LABELS},
                       "measured_s": {str(F): times[F] for F in LABELS},
                       "ids_identical": not bad, "wall_s": time.monotonic() - t_start},
                      open(os.environ["SHOAL_RELAY_NETNS_OUT"], "w"), indent=1)
    finally:
        for p in procs:
            harness.terminate(p, 5)
        N.teardown()
        if not counts["FAIL"]:
            shutil.rmtree(tmp, ignore_errors=True)  # kept on a failure: the workers' logs
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
