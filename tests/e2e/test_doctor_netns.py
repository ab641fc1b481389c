#!/usr/bin/env python3
"""`shoal doctor` on a shaped network (issue 34): network namespaces joined by a
bridge play one coordinator host and three worker hosts. Every worker's link
is shaped both ways: its rate by a `tc tbf` qdisc on both ends of its veth,
its delay by a delay-injecting relay in the coordinator's namespace
(tests/e2e/relay.py: this kernel has no netem qdisc) -- w0 and w1 like cheap
VPSs (RATE_FAST, 1 ms each way: 2 ms RTT), w2 a slow host (RATE_SLOW,
4 ms each way: 8 ms RTT). The workers listen on tcp:// with CURVE
(PROTOCOL.md §9) and the coordinator's doctor measures them over those real
connections (PROBE, §3.8).

Checks, against the shaping (the independent reference):
- each link's RTT p50 lies within 20% of the shaped RTT (never below 80%
  on any run; at most 120% + 1 ms (BUSY_US) on the best of up to three
  runs, as a busy host
  only adds to a round trip and only takes from a rate): the path's own
  round trip, measured by doctor in this run through the same relays with no
  delay and no rate limit, plus what the relay's delay adds to a round trip
  as the relay itself measures it (`relay.py --measure`: a raw TCP
  ping-pong, nothing of shoal's; about 2 x delay plus its timer slack);
- each link's rate each way lies within 20% of the shaped rate (tbf counts
  IP packets; goodput over TCP with CURVE is a few % below);
- the findings name w2 for its RTT and its link, and nobody else for those;
- the host facts are there (cores, memory, the read pass), as the host says;
- --json and -o write the same document; --cluster with a manifest;
- `shoal plan --measured` on this doctor.json keeps tiny-k3's trunk local (8
  round trips rather than 48), and the plan, served from the namespaces
  through the shaped links, gives the in-process ids at a measured s/token
  within 30% of its prediction (the best of up to three runs).
Needs root and iproute2 with netem (scripts/deps.sh): SKIPs otherwise.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~35 s.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_doctor_netns"
SRC = os.path.abspath(os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
HOSTS = ["c", "w0", "w1", "w2"]
N = harness.Netns("sd", 78, HOSTS)
NS, IP = N.ns, N.ip
# shaping: (one-way delay ms, rate Mbit/s) per worker host. The fast rate is
# what the relay (Python, on this 2-core machine) forwards with room to spare.
RATE_FAST = int(os.environ.get("SHOAL_DOCTOR_RATE_MBIT", "200"))
RATE_SLOW = RATE_FAST // 4
SHAPE = {"w0": (1.0, RATE_FAST), "w1": (1.0, RATE_FAST), "w2": (4.0, RATE_SLOW)}
PORT = {"w0": 17101, "w1": 17102, "w2": 17103}
# tbf's bucket: a few packets, so a message of the forward's size (tens of kB) is paced at
# the rate as on a real link, not let through at the veth's speed after an idle gap
BURST = os.environ.get("SHOAL_DOCTOR_BURST", "8kb")

# What a CPU hog at equal priority on both cores adds to a round trip through three
# user-space processes (the delay relay's timer, the worker, doctor), on top of the 20%
# band: measured 400-550 us on the 2-core VM with two busy loops beside the suite (the
# unshaped path and relay.py --measure, taken minutes apart with one process active,
# do not see it). Doctor under-reporting is caught by the lower bound, which has none.
BUSY_US = int(os.environ.get("SHOAL_DOCTOR_BUSY_US", "1000"))

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
sh = harness.sh


def shape():
    """tbf on both ends of each worker's veth"""
    for h, (_, mbit) in SHAPE.items():
        N.shape(h, mbit, BURST)


def relays(delay):
    """one relay per worker in the coordinator's namespace: 127.0.0.1:PORT -> worker:5555"""
    return [N.relay("c", f"127.0.0.1:{PORT[w]}", f"{IP[w]}:5555", SHAPE[w][0] if delay else 0.0)
            for w in ("w0", "w1", "w2")]


def doctor(tmp, extra):
    args = [*N.prefix("c"), BIN, "doctor", "--model", TINY, "--curve-secret", f"{tmp}/c.key",
            "--hello-timeout-ms", "20000"]
    for w in ("w0", "w1", "w2"):
        args += ["--worker", f"tcp://127.0.0.1:{PORT[w]}", "--worker-key", f"{tmp}/{w}.pub"]
    return sh(args + extra, check_rc=False, timeout=180)


def main():
    if os.geteuid() != 0:
        record("SKIP", "all", "needs root (network namespaces)")
        return 77
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    if not N.setup_or_skip(R):
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-doctor-")
    procs = []
    try:
        for k in ("c", "w0", "w1", "w2"):
            sh([BIN, "keygen", "-o", f"{tmp}/{k}"])
        for w, ex in zip(("w0", "w1", "w2"), harness.moe_split(TINY, 3)):
            procs.append(subprocess.Popen(
                [*N.prefix(w), BIN, "expert", "--model", TINY, "--experts", ex, "--listen",
                 f"tcp://{IP[w]}:5555", "--id", w, "--threads", "1", "--curve-secret", f"{tmp}/{w}.key",
                 "--curve-allow", f"{tmp}/c.pub"], stdout=subprocess.DEVNULL,
                stderr=open(f"{tmp}/{w}.log", "w")))
        # the path's own round trip, unshaped (CURVE, zmq, the relay, processes on a busy host)
        rel = relays(False)
        r = doctor(tmp, ["--json", "--no-facts", "--no-local", "--rounds", "300"])
        for p in rel:
            harness.terminate(p, 5)
        if not check("doctor on the unshaped links", r.returncode == 0, r.stderr[-800:]):
            return 1
        base = {w["name"]: w["rtt_p50_us"] for w in json.loads(r.stdout)["workers"]}
        print(f"unshaped RTT p50 (us): {base}", flush=True)
        import re
        added = {}
        for d in sorted({v[0] for v in SHAPE.values()} | {0.0}):
            m = sh([sys.executable, os.path.join(SRC, "tests", "e2e", "relay.py"), "--measure", str(d)])
            added[d] = float(re.search(r"added_us ([\d.]+)", m.stdout).group(1))
        print(f"relay adds per round trip (us), by one-way delay (ms): {added}", flush=True)
        shape()
        procs += relays(True)
        t0 = time.monotonic()
        r = doctor(tmp, ["--json", "-o", f"{tmp}/doctor.json", "--rounds", "300", "--bulk-count", "12"])
        dt = time.monotonic() - t0
        if not check(f"doctor on the shaped links ({dt:.1f} s)", r.returncode == 0, r.stderr[-800:]):
            return 1
        doc = json.loads(r.stdout)
        check("--json and -o write the same document", json.load(open(f"{tmp}/doctor.json")) == doc)
        ws = {w["name"]: w for w in doc["workers"]}
        check("every worker measured", sorted(ws) == ["w0", "w1", "w2"] and all(w["ok"] for w in ws.values()),
              json.dumps(doc)[:600])
        # A busy host only adds to a round trip and only takes from a rate: the bound on that
        # side is checked on the best of up to three doctor runs (the first is the one above);
        # the other side (an RTT below the shaping, a rate above it) on every run.
        best = {n: dict(w) for n, w in ws.items()}

        def rtt_hi(want):
            return 1.2 * want + BUSY_US

        def off(name):
            ms, mbit = SHAPE[name]
            want_rtt, rate = added[ms] - added[0.0], mbit * 1e6 / 8
            b = best.get(name)
            return b is None or (b["rtt_p50_us"] - base.get(name, 0) > rtt_hi(want_rtt) or
                                 min(b["out_bytes_per_s"], b["in_bytes_per_s"]) < 0.8 * rate)

        runs = [ws]
        for again in range(2):
            if not any(off(n) for n in SHAPE):
                break
            r2 = doctor(tmp, ["--json", "--no-facts", "--no-local", "--rounds", "300", "--bulk-count", "12"])
            if r2.returncode:
                break
            w2 = {w["name"]: w for w in json.loads(r2.stdout)["workers"] if w.get("ok")}
            runs.append(w2)
            for n, w in w2.items():
                b = best.setdefault(n, dict(w))
                b["rtt_p50_us"] = min(b["rtt_p50_us"], w["rtt_p50_us"])
                for k in ("out_bytes_per_s", "in_bytes_per_s"):
                    b[k] = max(b[k], w[k])
        print(f"doctor runs on the shaped links: {len(runs)}", flush=True)
        for name, (ms, mbit) in SHAPE.items():
            w = ws.get(name)
            if not w:
                continue
            want_rtt = added[ms] - added[0.0]  # the delay's share of the relay's round trip
            rate = mbit * 1e6 / 8
            print(f"{name}: RTT p50 {w['rtt_p50_us']:.0f} us (shaped {want_rtt:.0f} + path {base.get(name, 0):.0f}), "
                  f"p99 {w['rtt_p99_us']:.0f} us; out {w['out_bytes_per_s'] / 1e6:.1f} MB/s, in "
                  f"{w['in_bytes_per_s'] / 1e6:.1f} MB/s (shaped {mbit / 8:.1f} MB/s); fwd "
                  f"{w['fwd_out_us']:.0f}/{w['fwd_in_us']:.0f} us; best of {len(runs)}: RTT "
                  f"{best[name]['rtt_p50_us']:.0f} us, {best[name]['out_bytes_per_s'] / 1e6:.1f}/"
                  f"{best[name]['in_bytes_per_s'] / 1e6:.1f} MB/s", flush=True)
            lows = [x[name]["rtt_p50_us"] - base.get(name, 0) for x in runs if name in x]
            check(f"{name}: RTT p50 less the unshaped path never below 80% of the shaped {want_rtt / 1000:.2f} ms",
                  min(lows) >= 0.8 * want_rtt, f"{[round(v) for v in lows]} us")
            got = best[name]["rtt_p50_us"] - base.get(name, 0)
            check(f"{name}: RTT p50 less the unshaped path at most 120% of the shaped {want_rtt / 1000:.2f} ms "
                  f"+ {BUSY_US} us (best of {len(runs)})", got <= rtt_hi(want_rtt), f"{got:.0f} us")
            for k in ("out_bytes_per_s", "in_bytes_per_s"):
                highs = [x[name][k] for x in runs if name in x]
                check(f"{name}: {k.split('_')[0]} rate never above 120% of the shaped {mbit} Mbit/s",
                      max(highs) <= 1.2 * rate, f"{[round(v / 1e6, 1) for v in highs]} MB/s vs {rate / 1e6:.1f}")
                check(f"{name}: {k.split('_')[0]} rate at least 80% of the shaped {mbit} Mbit/s (best of {len(runs)})",
                      best[name][k] >= 0.8 * rate, f"{best[name][k] / 1e6:.1f} MB/s vs {rate / 1e6:.1f}")
            h = w.get("host", {})
            check(f"{name}: host facts (cores, memory, read pass) as this host says",
                  h.get("cores") == os.cpu_count() and h.get("mem_total", 0) > 0 and h.get("read_bw_all", 0) > 1e8
                  and h.get("read_bw_1", 0) > 1e8 and h.get("isa") and h.get("version"), json.dumps(h))
        f = doc.get("findings", [])
        print("findings:\n  " + "\n  ".join(f), flush=True)
        check("findings: w2's RTT named", any(s.startswith("w2:") and "RTT" in s and "the others" in s for s in f),
              repr(f))
        check("findings: w2's link named", any(s.startswith("w2:") and "link" in s and "slower" in s for s in f),
              repr(f))
        check("findings: nobody else's RTT or link", not any(
            (s.startswith("w0:") or s.startswith("w1:")) and ("RTT" in s or "link" in s) and "the others" in s
            for s in f), repr(f))
        # against the cluster manifest: the hosts at their addresses (no relay), keys from --curve-keys
        man = f"{tmp}/cluster.json"
        json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555, "hosts":
                   [{"name": "c", "address": IP["c"], "ssh_user": "root", "cpus": 1, "expert_ram": 0}] +
                   [{"name": w, "address": IP[w], "ssh_user": "root", "cpus": 1,
                     "expert_ram": "100TiB" if w == "w1" else "8MiB"} for w in ("w0", "w1", "w2")]}, open(man, "w"))
        r = sh([*N.prefix("c"), BIN, "doctor", "--model", TINY, "--cluster", man, "--curve-secret",
                f"{tmp}/c.key", "--curve-keys", tmp, "--json", "--rounds", "50", "--bulk-count", "4", "--no-local",
                "--hello-timeout-ms", "20000"], check_rc=False, timeout=180)
        ok = r.returncode == 0
        if check("doctor --cluster (the manifest's hosts, CURVE keys by name)", ok, r.stderr[-800:]):
            dc = json.loads(r.stdout)
            check("--cluster: the three hosts measured", sorted(w["name"] for w in dc["workers"] if w["ok"]) ==
                  ["w0", "w1", "w2"], json.dumps(dc)[:400])
            check("--cluster: a budget larger than the host's memory is named",
                  any(s.startswith("w1 has") and "the manifest gives it" in s for s in dc["findings"]) and
                  not any(s.startswith(("w0 has", "w2 has")) for s in dc["findings"]), repr(dc["findings"]))
        # the person's table: every worker, the worst values marked
        r = doctor(tmp, ["--no-facts", "--no-local", "--rounds", "50", "--bulk-count", "8"])
        lines = r.stdout.splitlines()
        w2 = [x for x in lines if x.startswith("w2 ")]
        check("the table marks w2's RTT as the worst", r.returncode == 0 and w2 and "*" in w2[0] and
              not any("*" in x for x in lines if x.startswith("w0 ") or x.startswith("w1 ")), r.stdout[-1500:])
        # the measured plan on these figures, served: its choice, and its prediction against a run
        wprocs = procs[:3]
        for p in wprocs:
            harness.terminate(p, 5)
            procs.remove(p)
        case_measured_plan(tmp, man, procs)
    finally:
        for p in procs:
            harness.terminate(p, 5)
        N.teardown()
    return 1 if counts["FAIL"] else 0


def case_measured_plan(tmp, man, procs):
    """plan --measured on this run's doctor.json (tiny-k3: 3 MB of trunk, round trips of 2 and
    8 ms): the trunk stays local, the experts split by the measured read pass; the plan's
    workers started from it in their namespaces, one decode through the relays: ids as in
    process, the measured s/token within 30% of the prediction"""
    import re
    gen = 16
    ref = sh([BIN, "run", "--model", TINY, "--ids", "5,17,3,99", "--gen", str(gen), "--json", "--threads", "1"])
    ref_ids = json.loads(ref.stdout)["generated_ids"]
    out = f"{tmp}/plan.json"
    r = sh([BIN, "plan", "--model", TINY, "--cluster", man, "--measured", f"{tmp}/doctor.json", "-o", out],
           check_rc=False)
    if not check("plan --measured on the doctor's figures", r.returncode == 0, r.stderr[-600:] + r.stdout[-600:]):
        return
    m = re.search(r"^  trunk local\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+).*<- chosen", r.stdout, re.M)
    check("it keeps the trunk local (8 round trips rather than 48 at these RTTs)", m is not None, r.stdout[-1500:])
    if not m:
        return
    pred = float(m.group(1))
    p = json.load(open(out))
    for w in p["workers"]:
        w["endpoint"] = f"tcp://127.0.0.1:{PORT[w['name']]}"
        w["listen"] = f"tcp://{IP[w['name']]}:5555"
    json.dump(p, open(out, "w"))
    for w in ("w0", "w1", "w2"):
        procs.append(subprocess.Popen(
            [*N.prefix(w), BIN, "expert", "--model", TINY, "--plan", out, "--name", w, "--threads",
             "1", "--curve-secret", f"{tmp}/{w}.key", "--curve-allow", f"{tmp}/c.pub"],
            stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{w}.plan.log", "w")))
    def run_plan():
        return sh([*N.prefix("c"), BIN, "run", "--model", TINY, "--plan", out, "--curve-secret",
                   f"{tmp}/c.key", "--curve-keys", tmp, "--ids", "5,17,3,99", "--gen", str(gen), "--json",
                   "--threads", "1", "--hello-timeout-ms", "30000"], check_rc=False, timeout=180)
    r = run_plan()
    if not check("the measured plan served through the shaped links", r.returncode == 0, r.stderr[-800:]):
        return
    j = json.loads(r.stdout)
    # a busy host only slows a run: the prediction is compared with the best of up to three
    times = [1.0 / j["decode_tokens_per_s"]]
    while len(times) < 3 and abs(pred - min(times)) > 0.3 * min(times):
        r2 = run_plan()
        if r2.returncode:
            break
        times.append(1.0 / json.loads(r2.stdout)["decode_tokens_per_s"])
    meas = min(times)
    print(f"measured plan runs (ms/token): {[round(t * 1e3, 1) for t in times]}", flush=True)
    print(f"measured plan: predicted {pred * 1e3:.1f} ms/token, measured {meas * 1e3:.1f} ms/token", flush=True)
    check("the measured plan's run: ids identical to the in-process run", j["generated_ids"] == ref_ids,
          f"{j['generated_ids']} vs {ref_ids}")
    check(f"its prediction ({pred * 1e3:.1f} ms) within 30% of the measured s/token ({meas * 1e3:.1f} ms)",
          abs(pred - meas) <= 0.3 * meas, "")


if __name__ == "__main__":
    sys.exit(main())
