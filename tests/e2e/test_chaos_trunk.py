#!/usr/bin/env python3
"""Failover of trunk row shards under chaos, end to end with real processes
(issue 18, the trunk half of tests/e2e/test_chaos.py).

`shoal plan --replicas 1 --trunk spread` on a 4-worker manifest puts every
routed expert of tests/models/tiny-k3 on 2 distinct workers and every quarter
of every row-shardable trunk matrix (`*:p/4`) on 2 distinct workers too; the 4
servers are started here (`shoal expert --experts RANGES --trunk ROWSPEC
--listen ipc://@...`, so the driver can stop, kill and restart them on the
same endpoint) behind `shoal serve --trunk remote`, driven with the official
`openai` client:

- the plan: every worker holds its own quarter and one more, every quarter is
  on exactly 2 workers;
- reference: the same greedy completions from `shoal serve` with the whole
  model in-process; the fault-free run with the trunk on the workers must give
  the same ids (an independent path: no worker, no row split);
- /health: one worker killed -> 200 "degraded" (replicas cover everything)
  and a request is served with the same ids; the worker that shares a quarter
  with it killed too -> 503 "unavailable" naming what is uncovered, and a
  request is refused with 503 naming a lost worker; both restarted -> 200
  "ok" again;
- chaos: the completions, one after another, while a driver thread SIGKILLs
  (restarted after a random delay) and SIGSTOPs (SIGCONTed after a random
  delay) random workers at random moments -- mid-step, since nothing
  synchronises it with the forward -- and two at once when the plan allows
  it; the driver only takes a worker down when the workers it leaves up still
  hold every expert and every trunk quarter (what R = 1 promises to survive);
- checks: 0 failed requests, every id sequence identical to the fault-free
  run, trunk failovers happened and were counted (shoal_trunk_failovers_total
  > 0, counted in shoal_failovers_total too; resent trunk rows = the lost rows
  summed over workers = the rows taken over), the service ends with all 4 up.

N distinct prompts (SHOAL_CHAOS_N, default 30) of 12 tokens; the chaos phase
cycles through them until at least N completions and SHOAL_CHAOS_S seconds
(default 15) are done. SHOAL_CHAOS_SEED fixes the driver (default: random,
printed); SHOAL_CHAOS_OUT writes the run's figures (JSON). Time: ~60 s on 2
cores. Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
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

T = "test_chaos_trunk"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
N = int(os.environ.get("SHOAL_CHAOS_N", "30"))
CHAOS_S = float(os.environ.get("SHOAL_CHAOS_S", "15"))
SEED = int(os.environ.get("SHOAL_CHAOS_SEED", str(random.randrange(1 << 30))))
GEN = 12
TIMEOUT_MS = 8000   # a step's deadline: the resend fits in it
FAILOVER_MS = 300   # a silent worker is given up after this
L, E = 9, 24        # tiny-k3: layer 0 dense, 1-8 MoE, 24 experts
W = 4

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
procs = []


def parse_parts(spec):
    """the quarters `*:p/4` of a ROWSPEC (KDA's f_a, whole on every worker, aside)"""
    out = set()
    for item in spec.split(","):
        pat, rows = item.rsplit(":", 1)
        if pat == "*" and "/" in rows:
            p, n = rows.split("/")
            if int(n) == W:
                out.add(("part", int(p)))
    return out


class Workers:
    def __init__(self, plan, eps):
        self.plan, self.eps = plan, eps
        self.p = [None] * W
        for i in range(W):
            self.start(i)

    def start(self, i):
        w = self.plan["workers"][i]
        log = harness.logfile()
        p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", w["experts"], "--trunk", w["trunk"],
                              "--listen", self.eps[i], "--threads", "1", "--id", f"cw{i}"],
                             stdout=subprocess.DEVNULL, stderr=log)
        p.log = log
        procs.append(p)
        self.p[i] = p


def start_serve(extra):
    log = harness.logfile()
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1",
                            "--memo", "0", "--expert-timeout-ms", str(TIMEOUT_MS), "--failover-ms", str(FAILOVER_MS),
                            "--hello-timeout-ms", "20000"] + extra, stdout=subprocess.PIPE, stderr=log, text=True)
    srv.log = log
    procs.append(srv)
    line = srv.stdout.readline()
    if "listening on" not in line:
        log.seek(0)
        return srv, None, f"{line!r} {log.read()[-2000:]!r}"
    return srv, line.strip().split("listening on ")[1], ""


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
    tmp = tempfile.mkdtemp(prefix="shoal-chaos-trunk-")
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i in range(W):
        hosts.append({"name": f"cw{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": 20000000, "port": 6000 + i})
    cl = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(cl, "w"))
    pj = os.path.join(tmp, "plan.json")
    r = subprocess.run([BIN, "plan", "--model", TINY, "--cluster", cl, "--replicas", "1", "--trunk", "spread",
                        "-o", pj], capture_output=True, text=True, timeout=60)
    if not check("plan --replicas 1 --trunk spread on 4 workers", r.returncode == 0, r.stderr[-400:]):
        return 1
    plan = json.load(open(pj))
    ws = plan["workers"]
    parts = [parse_parts(w["trunk"]) for w in ws]
    held = [parse_ranges(w["experts"]) | parts[i] for i, w in enumerate(ws)]
    need = {(l, e) for l in range(1, L) for e in range(E)} | {("part", p) for p in range(W)}
    check("every worker holds its own quarter and one more; every quarter on 2 workers",
          all(("part", i) in parts[i] and len(parts[i]) == 2 for i in range(W)) and
          all(sum(("part", p) in x for x in parts) == 2 for p in range(W)) and
          all(sorted(p for _, p in parts[i]) == sorted(ws[i]["trunk_parts"]) for i in range(W)),
          str([w["trunk"] for w in ws]))
    check("every expert and every trunk quarter covered by the plan",
          all(sum(c in h for h in held) == 2 for c in need), "")
    pairs_ok = [(a, b) for a in range(W) for b in range(a + 1, W)
                if covers(need, held, [i for i in range(W) if i not in (a, b)])]
    print(f"# trunk {[w['trunk'] for w in ws]}; two down at once allowed for {pairs_ok}", flush=True)

    prompts = [[1 + (7 * i) % 50, 2 + (3 * i) % 40, 5, 6 + i % 9] for i in range(N)]

    def completer(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(p):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=GEN, temperature=0,
                                          extra_body={"return_token_ids": True})
            return (r.choices[0].model_extra or {}).get("token_ids")
        return complete

    # ---- the in-process reference
    srv, url, why = start_serve([])
    if not check("in-process serve starts", url is not None, why):
        return 1
    complete = completer(url)
    ref = [complete(p) for p in prompts]
    harness.terminate(srv, 10)
    check(f"in-process: every completion has {GEN} ids", all(isinstance(x, list) and len(x) == GEN for x in ref))

    tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
    eps = [f"ipc://@shoal-chaos-trunk-{tag}-{i}" for i in range(W)]
    wk = Workers(plan, eps)
    extra = ["--trunk", "remote"]
    for ep in eps:
        extra += ["--worker", ep]
    srv, url, why = start_serve(extra)
    stop = threading.Event()
    try:
        if not check("serve --trunk remote starts", url is not None, why):
            return 1
        srv.log.seek(0)
        check("the trunk is on the workers", "matrices on the workers (--trunk remote)" in srv.log.read().decode(
            errors="replace"))
        complete = completer(url)
        t0 = time.time()
        base = [complete(p) for p in prompts]
        t_clean = time.time() - t0
        diff = [i for i in range(N) if base[i] != ref[i]]
        check(f"fault-free, trunk on the workers: the in-process ids ({N} completions)", not diff,
              f"{len(diff)} differ, e.g. #{diff[0] if diff else 0}: {base[diff[0]] if diff else ''} vs "
              f"{ref[diff[0]] if diff else ''}")
        print(f"# fault-free: {N} completions in {t_clean:.1f} s", flush=True)

        def up_in_health():
            return chaos.up_in_health(url)

        def wait_up(want, secs=30):
            t_end = time.time() + secs
            while time.time() < t_end and up_in_health() != want:
                time.sleep(0.05)
            return up_in_health() == want

        # ---- /health tells covered from uncovered
        a, b = 1, 2  # quarter 1 is on cw1 and cw2 only (the plan's ring)
        check("the plan puts quarter 1 on cw1 and cw2 only", [i for i in range(W) if ("part", 1) in parts[i]] == [a, b],
              str(parts))
        wk.p[a].kill()
        wk.p[a].wait()
        seen = wait_up({0, 1, 2, 3} - {a}, 10)
        st, h = harness.health(url)
        check("one worker killed: /health 200 \"degraded\", ready (replicas cover it)",
              seen and st == 200 and h.get("status") == "degraded" and h.get("ready") is True and
              "uncovered" not in h, f"{st} {h}")
        got = complete(prompts[0])
        check("one worker killed: served, the same ids", got == base[0], f"{got} vs {base[0]}")
        wk.p[b].kill()
        wk.p[b].wait()
        seen = wait_up({0, 1, 2, 3} - {a, b}, 10)
        st, h = harness.health(url)
        experts_left = covers({(l, e) for l in range(1, L) for e in range(E)}, held, [0, 3])
        unc = h.get("uncovered", "")
        check("both holders of quarter 1 killed: /health 503 \"unavailable\", naming what is uncovered",
              seen and st == 503 and h.get("status") == "unavailable" and h.get("ready") is False and
              (not experts_left or unc.startswith("trunk rows")) and ("cw1" in unc or "cw2" in unc),
              f"{st} {h}")
        try:
            complete(prompts[0])
            check("both holders of quarter 1 killed: a request is refused", False, "served")
        except openai.APIStatusError as e:
            check("both holders of quarter 1 killed: a request is refused (503, naming a lost worker)",
                  e.status_code == 503 and ("cw1" in e.message or "cw2" in e.message), f"{e.status_code} {e.message}")
        wk.start(a)
        wk.start(b)
        ok = wait_up({0, 1, 2, 3})
        st, h = harness.health(url)
        check("both restarted: /health 200 \"ok\" again", ok and st == 200 and h.get("status") == "ok", f"{st} {h}")
        m0 = metrics(url)

        # ---- chaos (tests/e2e/chaos.py); the first two faults a stop and a kill
        ev, got, failed, lat, total, t_chaos = chaos.run(wk, url, need, held, pairs_ok, rng, complete, prompts, N,
                                                         CHAOS_S, stop, first=("stop", "kill"))
        print(f"# chaos: {total} completions in {t_chaos:.1f} s; faults {ev}", flush=True)
        check("chaos: 0 failed requests", not failed, f"{len(failed)} failed: {failed[:3]}")
        diff = [i for i in range(total) if got[i] is not None and got[i] != base[i % N]]
        check(f"chaos: every id sequence identical to the fault-free run ({total} completions)", not diff,
              f"{len(diff)} differ, e.g. #{diff[0] if diff else 0}: {got[diff[0]] if diff else ''} vs "
              f"{base[diff[0] % N] if diff else ''}")
        check("chaos: the driver took workers down (kill and stop)" + (", two at once at least once" if pairs_ok
                                                                       else ""),
              ev["kill"] > 0 and ev["stop"] > 0 and (not pairs_ok or (ev["two"] > 0 and ev["max_down"] >= 2)),
              str(ev))
        m = metrics(url)

        def delta(family):
            return metric_sum(m, family) - metric_sum(m0, family)
        fo, tfo = delta("shoal_failovers_total"), delta("shoal_trunk_failovers_total")
        rs, lost, took = (delta("shoal_failover_resent_trunk_rows_total"), delta("shoal_worker_lost_trunk_rows_total"),
                          delta("shoal_worker_takeover_trunk_rows_total"))
        check("chaos: trunk failovers happened and were counted (in shoal_failovers_total too); resent = lost = "
              "taken-over trunk rows",
              tfo > 0 and fo >= tfo and rs > 0 and lost == rs and took == rs,
              f"failovers {fo}, trunk {tfo}, resent rows {rs}, lost {lost}, taken over {took}")
        print(f"# failovers {fo:.0f} (trunk {tfo:.0f}), trunk rows resent {rs:.0f}", flush=True)
        al = metric_sum(m, "shoal_forward_allocations_total")
        check("chaos: no heap allocation on the forward thread through the failovers", al == 0,
              f"shoal_forward_allocations_total {al}")
        fos = [x for x in m.splitlines() if x.startswith("shoal_failover_seconds")]
        for line in fos:
            print("# " + line, flush=True)
        check("after the chaos: all 4 workers up again", wait_up({0, 1, 2, 3}))
        st, h = harness.health(url)
        check("after the chaos: /health 200 \"ok\"", st == 200 and h.get("status") == "ok", f"{st} {h}")
        check("after the chaos: the same ids again", complete(prompts[0]) == base[0])
        if os.environ.get("SHOAL_CHAOS_OUT"):
            json.dump({"n": N, "gen": GEN, "completions": total, "seed": SEED, "faults": ev, "failed": len(failed),
                       "differ": len(diff), "t_clean_s": t_clean, "t_chaos_s": t_chaos, "latency_s": lat,
                       "failovers": fo, "trunk_failovers": tfo, "resent_trunk_rows": rs, "metrics_failover": fos,
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
