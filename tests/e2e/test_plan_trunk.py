#!/usr/bin/env python3
"""`shoal plan --trunk spread` (issue 16) on tests/models/tiny-k3, with real
processes over loopback tcp (--insecure):

- every worker gets ROWSPEC `*:w/N,*.f_a_proj.weight:all` (its share, and
  KDA's f_a whole for the chain of §3.7) and the trunk bytes of those rows, equal
  to the sum worked out here from the safetensors headers with PROTOCOL.md
  §7.1's rule (a language-model tensor, 2-D, not a routed expert, at least 2 rows, not embed_tokens nor
  kv_b_proj; rows floor(wR/N) .. floor((w+1)R/N)-1); every routed expert is
  still owned exactly once, and trunk + experts stay within each budget (one
  fit);
- a cluster whose budgets hold the experts but not the experts and the trunk
  is refused with `--trunk spread` (and planned without it);
- workers started with `shoal expert --plan --name` pick up their trunk rows,
  and `shoal run --plan --trunk auto` goes remote and gives the in-process ids
  and logits byte for byte;
- `--trunk spread --replicas 1` (failover, issue 18): every worker also holds
  one other part, every part is on exactly 2 workers (in distinct failure
  domains when the manifest names them), trunk bytes = its parts' rows + every
  f_a from the headers, every expert on 2 workers; one failure domain, or a
  budget that holds two copies of the experts but not two of the trunk, is
  refused with the numbers;
- `--trunk` with another value is refused (exit 2).
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~10 s.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_plan_trunk"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


def sh(*args, timeout=60):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


def tensors(d):
    return {k: (v["shape"], v["data_offsets"][1] - v["data_offsets"][0]) for k, v in harness.st_headers(d)}


def cluster(tmp, budgets, name):
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i, b in enumerate(budgets):
        hosts.append({"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1, "expert_ram": b,
                      "port": harness.free_port()})
    path = os.path.join(tmp, name)
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555, "hosts": hosts},
              open(path, "w"))
    return path


def cells(ranges):
    out = []
    for g in ranges.split(","):
        ls, es = g.split(":")
        la, lb = (ls.split("-") if "-" in ls else (ls, ls))
        ea, eb = (es.split("-") if "-" in es else (es, es))
        out += [(l, e) for l in range(int(la), int(lb) + 1) for e in range(int(ea), int(eb) + 1)]
    return out


def run_ids(tmp, *extra):
    out = os.path.join(tmp, f"logits{time.monotonic_ns()}.bin")
    r = sh("run", "--model", TINY, "--ids", "5,17,3,99,42,7", "--gen", "6", "--json", "--dump-logits", out,
           "--hello-timeout-ms", "10000", *extra, timeout=120)
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    return j, (open(out, "rb").read() if os.path.exists(out) else b""), r.stderr


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-plantrunk-")
    ts = tensors(TINY)
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    cfg = cfg.get("text_config", cfg)
    E, L0, L = cfg["num_experts"], cfg["first_k_dense_replace"], cfg["num_hidden_layers"]
    N = 3
    shard = {k: (s, nb) for k, (s, nb) in ts.items()
             if k.startswith("language_model.") and len(s) == 2 and s[0] >= 2 and not (".experts." in k and "shared_experts" not in k)
             and not k.endswith("embed_tokens.weight") and not k.endswith("kv_b_proj.weight")}
    # each worker's share of every matrix; KDA's f_a whole on every worker (PROTOCOL.md §3.7, chains)
    want_tb = [sum((s[0] if k.endswith(".f_a_proj.weight") else (w + 1) * s[0] // N - w * s[0] // N) * (nb // s[0])
                   for k, (s, nb) in shard.items()) for w in range(N)]
    exp_all = sum(nb for k, (s, nb) in ts.items() if ".experts." in k and "shared_experts" not in k)
    trunk_all = sum(nb for s, nb in shard.values())

    # ---- placement and budgets
    big = cluster(tmp, [1 << 30] * N, "big.json")
    pp = os.path.join(tmp, "plan.json")
    r = sh("plan", "--model", TINY, "--cluster", big, "--trunk", "spread", "-o", pp)
    if not check("plan --trunk spread", r.returncode == 0, r.stderr[-400:]):
        return 1
    plan = json.load(open(pp))
    ws = plan["workers"]
    check("every worker gets *:w/N and every f_a whole",
          [w.get("trunk") for w in ws] == [f"*:{i}/{N},*.f_a_proj.weight:all" for i in range(N)],
          str([w.get("trunk") for w in ws]))
    check("trunk bytes per worker as worked out from the headers", [w.get("trunk_bytes") for w in ws] == want_tb,
          f"{[w.get('trunk_bytes') for w in ws]} vs {want_tb}")
    owned = sorted(c for w in ws for c in cells(w["experts"]))
    check("every routed expert owned exactly once", owned == sorted((l, e) for l in range(L0, L) for e in range(E)),
          f"{len(owned)} cells")
    check("plan.json says trunk spread", plan.get("trunk") == "spread", str(plan.get("trunk")))

    # budgets that hold the experts (with room) but not experts + trunk: refused only with spread
    b = (exp_all + trunk_all // 2) // N
    tight = cluster(tmp, [b] * N, "tight.json")
    r1 = sh("plan", "--model", TINY, "--cluster", tight, "-o", os.path.join(tmp, "t1.json"))
    r2 = sh("plan", "--model", TINY, "--cluster", tight, "--trunk", "spread", "-o", os.path.join(tmp, "t2.json"))
    check("a budget for the experts only: planned without --trunk spread", r1.returncode == 0, r1.stderr[-300:])
    check("...and refused with it (one fit), naming the shortfall", r2.returncode == 3 and "short" in r2.stderr,
          f"{r2.returncode} {r2.stderr[-300:]}")
    # budgets exactly per-worker trunk + a fair expert share fit
    per = [want_tb[w] + exp_all // N + (exp_all // (E * (L - L0))) for w in range(N)]
    fit = cluster(tmp, per, "fit.json")
    r3 = sh("plan", "--model", TINY, "--cluster", fit, "--trunk", "spread", "-o", os.path.join(tmp, "t3.json"))
    ok = r3.returncode == 0
    if ok:
        p3 = json.load(open(os.path.join(tmp, "t3.json")))
        ok = all(w["bytes"] + w["trunk_bytes"] <= per[i] for i, w in enumerate(p3["workers"]))
    check("trunk + experts within each budget", ok, r3.stderr[-300:])
    r4 = sh("plan", "--model", TINY, "--cluster", big, "--trunk", "all", "-o", os.path.join(tmp, "t4.json"))
    check("--trunk all refused (usage)", r4.returncode == 2 and "local or spread" in r4.stderr, r4.stderr[-200:])

    # ---- --replicas 1: every quarter of the trunk rows on 2 distinct hosts (failover, issue 18)
    def parts_of(spec):
        return sorted(int(x.split(":")[1].split("/")[0]) for x in spec.split(",")
                      if x.startswith("*:") and x.endswith(f"/{N}"))

    def part_bytes(p):
        return sum(((p + 1) * s[0] // N - p * s[0] // N) * (nb // s[0]) for k, (s, nb) in shard.items()
                   if not k.endswith(".f_a_proj.weight"))
    fa_bytes = sum(nb for k, (s, nb) in shard.items() if k.endswith(".f_a_proj.weight"))
    pr = os.path.join(tmp, "rep.json")
    r = sh("plan", "--model", TINY, "--cluster", big, "--trunk", "spread", "--replicas", "1", "-o", pr)
    if check("plan --trunk spread --replicas 1", r.returncode == 0, r.stderr[-400:]):
        wr = json.load(open(pr))["workers"]
        held = [parts_of(w["trunk"]) for w in wr]
        check("--replicas 1: each worker its own part first and one more; every part on exactly 2 workers",
              all(w["trunk"].startswith(f"*:{i}/{N},") and len(held[i]) == 2 and
                  w["trunk"].endswith(",*.f_a_proj.weight:all") and sorted(w["trunk_parts"]) == held[i]
                  for i, w in enumerate(wr)) and
              all(sum(p in h for h in held) == 2 for p in range(N)), str([w["trunk"] for w in wr]))
        check("--replicas 1: trunk bytes = its parts' rows + every f_a, from the headers",
              [w["trunk_bytes"] for w in wr] == [fa_bytes + sum(part_bytes(p) for p in h) for h in held],
              f"{[w['trunk_bytes'] for w in wr]}")
        owned = sorted(c for w in wr for c in cells(w["experts"]))
        check("--replicas 1: every routed expert on 2 workers too",
              owned == sorted(2 * [(l, e) for l in range(L0, L) for e in range(E)]), f"{len(owned)} cells")
    # failure domains: 4 hosts in 2 domains -> the 2 holders of every part in distinct domains
    dom = os.path.join(tmp, "dom.json")
    cluster(tmp, [1 << 30] * 4, "dom.json")
    c = json.load(open(dom))
    for i, h in enumerate(c["hosts"][1:]):
        h["domain"] = "rack-a" if i < 2 else "rack-b"
    json.dump(c, open(dom, "w"))
    pd = os.path.join(tmp, "repdom.json")
    r = sh("plan", "--model", TINY, "--cluster", dom, "--trunk", "spread", "--replicas", "1", "-o", pd)
    ok = r.returncode == 0
    if ok:
        wd = json.load(open(pd))["workers"]
        hd = [sorted(int(x.split(":")[1].split("/")[0]) for x in w["trunk"].split(",")
                     if x.startswith("*:") and x.endswith("/4")) for w in wd]
        racks = [{("a" if i < 2 else "b") for i in range(4) if p in hd[i]} for p in range(4)]
        ok = all(len([i for i in range(4) if p in hd[i]]) == 2 for p in range(4)) and all(len(x) == 2 for x in racks)
    check("--replicas 1 over 2 failure domains: every part in both", ok, r.stderr[-300:] if r.returncode else str(hd))
    for h in c["hosts"][1:]:
        h["domain"] = "one-rack"
    json.dump(c, open(dom, "w"))
    r = sh("plan", "--model", TINY, "--cluster", dom, "--trunk", "spread", "--replicas", "1", "-o", pd)
    check("--replicas 1 with one failure domain: refused naming the domains needed (exit 3)",
          r.returncode == 3 and "2 distinct failure domains" in r.stderr and "has 1" in r.stderr, r.stderr[-300:])
    # a budget for the experts twice and the trunk once, not twice: refused with the shortfall
    b2 = (2 * exp_all + trunk_all) // N + (2 * exp_all // (E * (L - L0)))
    t2 = cluster(tmp, [b2] * N, "tight2.json")
    r1 = sh("plan", "--model", TINY, "--cluster", t2, "--replicas", "1", "-o", os.path.join(tmp, "t5.json"))
    r2 = sh("plan", "--model", TINY, "--cluster", t2, "--trunk", "spread", "--replicas", "1",
            "-o", os.path.join(tmp, "t6.json"))
    check("a budget for 2 copies of the experts: planned with --replicas 1 alone", r1.returncode == 0,
          r1.stderr[-300:])
    check("...refused with --trunk spread --replicas 1 (2 copies of the trunk too), naming the shortfall",
          r2.returncode == 3 and "short by" in r2.stderr and "replicas" in r2.stderr, f"{r2.returncode} "
          f"{r2.stderr[-300:]}")

    # ---- the plan's workers serve their trunk rows; the coordinator goes remote, same bits
    ref, ref_lg, err = run_ids(tmp)
    procs = []
    try:
        for w in ws:
            procs.append(subprocess.Popen([BIN, "expert", "--model", TINY, "--plan", pp, "--name", w["name"],
                                           "--threads", "1", "--insecure"], stdout=subprocess.DEVNULL,
                                          stderr=open(os.path.join(tmp, w["name"] + ".log"), "w")))
        j, lg, err = run_ids(tmp, "--plan", pp, "--insecure-workers", "--trunk", "auto")
        ok = j is not None and ref is not None
        check("run --plan --trunk auto: remote", ok and j.get("trunk_remote_matrices", 0) == len(shard),
              err[-400:] if not ok else str(j.get("trunk_remote_matrices")))
        check("run --plan --trunk auto: in-process ids and logits", ok and j["generated_ids"] == ref["generated_ids"]
              and lg == ref_lg and len(lg) > 0, "" if not ok else f"{j['generated_ids']} vs {ref['generated_ids']}")
    finally:
        for p in procs:
            harness.terminate(p, 5)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
