#!/usr/bin/env python3
"""Failover with replicas under chaos, end to end with real processes (issue 18).

`shoal plan --replicas 1` on a 4-worker manifest places every routed expert of
tests/models/tiny-k3 on 2 distinct workers; the 4 expert servers are started
here (`shoal expert --experts RANGES --listen ipc://@...`, so the driver can
stop, kill and restart them on the same endpoint) behind `shoal serve`, driven
with the official `openai` client:

- fault-free: N greedy completions of different prompts, their token ids;
- chaos: the same completions, one after another, while a driver thread
  SIGKILLs (and restarts after a random delay), SIGSTOPs (and SIGCONTs after a
  random delay) random workers at random moments -- including mid-layer, as
  nothing synchronises it with the forward -- and, when the plan allows it
  (the two left hold every expert), takes two workers down at once. The
  driver only takes a worker down when the workers it leaves up (up in
  /health, not faulted) still hold every expert, which is what R = 1
  promises to survive;
- checks: 0 failed requests, every id sequence identical to the fault-free
  run, failovers happened (shoal_failovers_total > 0, resent pairs counted,
  the takeover pairs per worker add up to them), a worker was down at least
  once and two at once at least once, and the service ends with all 4 up;
- `shoal top --once` with one worker stopped marks it DOWN and names who took
  its pairs over (a worker holding its experts), and /health answers 200
  "degraded" meanwhile (its replicas cover every expert).

N = 100 distinct prompts (SHOAL_CHAOS_N); the chaos phase cycles through them
until at least N completions and SHOAL_CHAOS_S seconds (default 20) are done,
each compared with the fault-free ids of its prompt. SHOAL_CHAOS_SEED fixes the driver's
random choices (default: random, printed). Without replicas the same faults
give named 503s within the deadline: tests/e2e/test_dist_recovery.py.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from chaos import covers, metric_sum, metrics, parse_ranges  # noqa: E402
import chaos  # noqa: E402

T = "test_chaos"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
N = int(os.environ.get("SHOAL_CHAOS_N", "100"))
CHAOS_S = float(os.environ.get("SHOAL_CHAOS_S", "20"))  # the chaos lasts at least this long
SEED = int(os.environ.get("SHOAL_CHAOS_SEED", str(random.randrange(1 << 30))))
TIMEOUT_MS = 8000   # a layer's deadline: the resend fits in it
FAILOVER_MS = 300   # a silent worker is given up after this
L, E = 9, 24        # tiny-k3: layer 0 dense, 1-8 MoE, 24 experts

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
procs = []


class Workers:
    def __init__(self, ranges, eps, ids):
        self.ranges, self.eps, self.ids = ranges, eps, ids
        self.p = [None] * len(ranges)
        for i in range(len(ranges)):
            self.start(i)

    def start(self, i):
        log = harness.logfile()
        p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", self.ranges[i], "--listen", self.eps[i],
                              "--threads", "1", "--id", self.ids[i]], stdout=subprocess.DEVNULL, stderr=log)
        p.log = log
        procs.append(p)
        self.p[i] = p


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    if not os.path.exists(os.path.join(TINY, "config.json")):
        record("SKIP", "all", "tests/models/tiny-k3 not present")
        return 77
    try:
        import openai
    except ImportError:
        record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    print(f"# N={N} SHOAL_CHAOS_SEED={SEED}", flush=True)
    rng = random.Random(SEED)
    tmp = tempfile.mkdtemp(prefix="shoal-chaos-")
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i in range(4):
        hosts.append({"name": f"cw{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": 2000000, "port": 6000 + i})
    cl = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(cl, "w"))
    pj = os.path.join(tmp, "plan.json")
    r = subprocess.run([BIN, "plan", "--model", TINY, "--cluster", cl, "--replicas", "1", "-o", pj],
                       capture_output=True, text=True, timeout=60)
    if not check("plan --replicas 1 on 4 workers", r.returncode == 0, r.stderr[-400:]):
        return 1
    plan = json.load(open(pj))
    ranges = [w["experts"] for w in plan["workers"]]
    held = [parse_ranges(x) for x in ranges]
    cells = {(l, e) for l in range(1, L) for e in range(E)}
    check("every expert on 2 workers", all(sum(c in h for h in held) == 2 for c in cells))
    pairs_ok = [(a, b) for a in range(4) for b in range(a + 1, 4)
                if covers(cells, held, [i for i in range(4) if i not in (a, b)])]
    print(f"# ranges {ranges}; two down at once allowed for {pairs_ok}", flush=True)

    tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
    eps = [f"ipc://@shoal-chaos-{tag}-{i}" for i in range(4)]
    ids = [f"cw{i}" for i in range(4)]
    ws = Workers(ranges, eps, ids)
    log = harness.logfile()
    cmd = [BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1",
           "--expert-timeout-ms", str(TIMEOUT_MS), "--failover-ms", str(FAILOVER_MS), "--memo", "0"]
    for ep in eps:
        cmd += ["--worker", ep]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    procs.append(srv)
    stop = threading.Event()
    try:
        line = srv.stdout.readline()
        if "listening on" not in line:
            log.seek(0)
            check("serve starts", False, f"{line!r} {log.read()[-2000:]!r}")
            return 1
        url = line.strip().split("listening on ")[1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [[1 + (7 * i) % 50, 2 + (3 * i) % 40, 5, 6 + i % 9] for i in range(N)]

        def complete(p):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
            return (r.choices[0].model_extra or {}).get("token_ids")

        t0 = time.time()
        base = [complete(p) for p in prompts]
        t_clean = time.time() - t0
        check("fault-free run: every completion has 16 ids", all(isinstance(b, list) and len(b) == 16 for b in base))
        print(f"# fault-free: {N} completions in {t_clean:.1f} s", flush=True)

        # ---- the chaos (tests/e2e/chaos.py)
        def up_in_health():
            return chaos.up_in_health(url)

        ev, got, failed, lat, total, t_chaos = chaos.run(ws, url, cells, held, pairs_ok, rng, complete, prompts, N,
                                                         CHAOS_S, stop)
        print(f"# chaos: {total} completions in {t_chaos:.1f} s; faults {ev}", flush=True)
        check("chaos: 0 failed requests", not failed, f"{len(failed)} failed: {failed[:3]}")
        diff = [i for i in range(total) if got[i] is not None and got[i] != base[i % N]]
        check(f"chaos: every id sequence identical to the fault-free run ({total} completions)", not diff,
              f"{len(diff)} differ, e.g. #{diff[0] if diff else 0}: {got[diff[0]] if diff else ''} vs "
              f"{base[diff[0] % N] if diff else ''}")
        check("chaos: the driver took workers down (kill and stop), two at once at least once",
              ev["kill"] > 0 and ev["stop"] > 0 and ev["two"] > 0 and ev["max_down"] >= 2, str(ev))
        m = metrics(url)
        fo, rs = metric_sum(m, "shoal_failovers_total"), metric_sum(m, "shoal_failover_resent_pairs_total")
        tk = metric_sum(m, "shoal_worker_takeover_pairs_total")
        lp = metric_sum(m, "shoal_worker_lost_pairs_total")
        check("chaos: failovers happened and were counted; takeover and lost pairs add up to the resent pairs",
              fo > 0 and rs > 0 and tk == rs and lp == rs, f"failovers {fo}, resent {rs}, takeover {tk}, lost {lp}")
        print(f"# failovers {fo:.0f}, resent pairs {rs:.0f}", flush=True)
        al = metric_sum(m, "shoal_forward_allocations_total")
        check("chaos: no heap allocation on the forward thread through the failovers", al == 0,
              f"shoal_forward_allocations_total {al}")
        for line in m.splitlines():
            if line.startswith("shoal_failover_seconds"):
                print("# " + line, flush=True)
        # after the chaos, everything comes back
        t_end = time.time() + 30
        while time.time() < t_end and up_in_health() != {0, 1, 2, 3}:
            time.sleep(0.1)
        check("after the chaos: all 4 workers up again", up_in_health() == {0, 1, 2, 3})
        check("after the chaos: the same ids again", complete(prompts[0]) == base[0])

        # shoal top marks a stopped worker down and names who took over: stop
        # cw0, one request (its exchanges give cw0 up after --failover-ms and
        # resend to the holders of its experts)
        os.kill(ws.p[0].pid, signal.SIGSTOP)
        got0 = complete(prompts[1])
        # /health: cw0 given up, its replicas cover every expert: 200 "degraded"
        st, h = harness.health(url)
        check("health: a worker down, covered by replicas: 200 \"degraded\", ready",
              st == 200 and h.get("status") == "degraded" and h.get("ready") is True and not h["workers"][0]["up"]
              and all(x["up"] for x in h["workers"][1:]), f"{st} {h}")
        top = subprocess.run([BIN, "top", "--coordinator", url, "--once"], capture_output=True, text=True, timeout=30)
        line = [x for x in top.stdout.splitlines() if x.startswith("cw0 is DOWN")]
        takers = [i for i in range(1, 4) if held[i] & held[0]]
        check("top: the stopped worker is DOWN and taken over by a holder of its experts",
              got0 == base[1] and top.returncode == 0 and line and "taken over by" in line[0] and
              any(f"cw{i} (" in line[0] for i in takers) and
              not any(f"cw{i} (" in line[0] for i in range(1, 4) if i not in takers),
              f"ids {got0 == base[1]}, rc {top.returncode}: {top.stdout[-1200:]} {top.stderr[-300:]}")
        check("top: the failover totals line", "failovers " in top.stdout and "pairs resent" in top.stdout,
              top.stdout[-600:])
        os.kill(ws.p[0].pid, signal.SIGCONT)
        t_end = time.time() + 30
        while time.time() < t_end and up_in_health() != {0, 1, 2, 3}:
            time.sleep(0.1)
        if os.environ.get("SHOAL_CHAOS_OUT"):
            json.dump({"n": N, "completions": total, "seed": SEED, "faults": ev, "failed": len(failed), "differ": len(diff),
                       "t_clean_s": t_clean, "t_chaos_s": t_chaos, "latency_s": lat, "failovers": fo,
                       "resent_pairs": rs, "metrics_failover": [x for x in m.splitlines()
                                                                if x.startswith("shoal_failover_seconds")],
                       "loadavg": os.getloadavg()}, open(os.environ["SHOAL_CHAOS_OUT"], "w"), indent=1)
    finally:
        stop.set()
        chaos.reap(procs)
    rc = srv.returncode
    check("serve exits cleanly", rc == 0, f"exit code {rc}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
