#!/usr/bin/env python3
"""`shoal plan` end to end on tests/models/tiny-k3 (docs/CLUSTER.md, issue 10):

- a plan on a 3-worker cluster manifest covers every routed expert exactly
  once, keeps each worker within its budget, and its printed/recorded expected
  shares equal the ones computed here from the RANGES (bytes) or from the
  routing trace (read here per docs/METRICS.md, independently of the C code);
- the same inputs give a byte-identical plan.json;
- with a trace, the layer-weighted imbalance is no worse than by bytes;
- workers started with `shoal expert --plan --name` and `shoal run --plan`
  generate the same ids as the in-process run;
- a cluster too small is refused with the shortfall; --replicas > 0 refused;
- a worker given a plan made for another model is refused.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile

T = "test_plan"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
RES = os.environ.get("SHOAL_TEST_RESULTS")
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PLAIN = os.path.join(SRC, "tests", "models", "tiny-k3-plain")
PROMPT = "3,17,250,1001,42,7,99,512,4000,1"
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
L, E, EXPERT_BYTES = 9, 24, 6528  # tiny-k3 (shoal inspect); checked against plan.json below


def record(status, case, why=""):
    counts[status] += 1
    line = f"{status}\t{T}\t{case}" + (f": {why}" if why else "")
    print(line.replace("\t", " "), flush=True)
    if RES:
        with open(RES, "a") as f:
            f.write(line + "\n")


def check(case, cond, why=""):
    record("PASS" if cond else "FAIL", case, "" if cond else why)
    return cond


def sh(*args, timeout=120):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cluster(tmp, budgets, name="cluster.json"):
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i, b in enumerate(budgets):
        hosts.append({"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1, "expert_ram": b,
                      "port": free_port()})
    doc = {"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555, "hosts": hosts}
    path = os.path.join(tmp, name)
    json.dump(doc, open(path, "w"))
    return path


def parse_ranges(s):
    cells = set()
    for g in s.split(","):
        ls, es = g.split(":")
        la, lb = (ls.split("-") + [ls])[:2] if "-" in ls else (ls, ls)
        ea, eb = (es.split("-") + [es])[:2] if "-" in es else (es, es)
        for l in range(int(la), int(lb) + 1):
            for e in range(int(ea), int(eb) + 1):
                cells.add((l, e))
    return cells


def read_trace(path):
    """hits[(layer, expert)] from a routing trace (docs/METRICS.md format 1.0)."""
    b = open(path, "rb").read()
    assert b[:8] == b"SHOALRT\0"
    H, nl, ne, k, R = struct.unpack_from("<IIIII", b, 12)
    hits = {}
    off = H
    while off + R <= len(b):
        tok, layer, n = struct.unpack_from("<IHH", b, off)
        ids = struct.unpack_from(f"<{k}H", b, off + 8)
        for e in ids[:n]:
            hits[(layer, e)] = hits.get((layer, e), 0) + 1
        off += R
    return hits


def run_ids(*args):
    r = subprocess.run([BIN, "run", "--model", TINY, "--json", "--ids", PROMPT, "--gen", "6", *args],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["generated_ids"], r
    except Exception:
        return None, r


def check_plan(tag, plan, budgets, hits=None):
    moe = [(l, e) for l in range(1, L) for e in range(E)]
    check(f"{tag}: model block", plan["model"]["num_layers"] == L and plan["model"]["num_experts"] == E and
          plan["model"]["expert_bytes"] == EXPERT_BYTES, str(plan["model"]))
    owned = {}
    for w in plan["workers"]:
        for c in parse_ranges(w["experts"]):
            owned.setdefault(c, []).append(w["name"])
    check(f"{tag}: every routed expert owned exactly once", sorted(owned) == moe and
          all(len(v) == 1 for v in owned.values()), f"{len(owned)} cells")
    total = sum(hits.get(c, 0) for c in moe) if hits else len(moe)
    ok_budget = ok_share = True
    for i, w in enumerate(plan["workers"]):
        cells = parse_ranges(w["experts"])
        ok_budget &= len(cells) * EXPERT_BYTES <= budgets[i] and w["bytes"] == len(cells) * EXPERT_BYTES
        want = (sum(hits.get(c, 0) for c in cells) if hits else len(cells)) / total
        ok_share &= abs(w["expected_share"] - want) < 1e-9
    check(f"{tag}: each worker within its budget", ok_budget)
    check(f"{tag}: expected shares recomputed here", ok_share,
          str([(w["name"], w["expected_share"]) for w in plan["workers"]]))
    lw = layer_weighted(plan, hits)
    check(f"{tag}: layer-weighted imbalance recomputed", abs(plan["layer_weighted_imbalance"] - lw) < 1e-9,
          f"{plan['layer_weighted_imbalance']} vs {lw}")
    return lw


def layer_weighted(plan, hits):
    """sum over MoE layers of the largest worker load / the mean worker load"""
    smax = smean = 0.0
    for l in range(1, L):
        loads = []
        for w in plan["workers"]:
            cells = [c for c in parse_ranges(w["experts"]) if c[0] == l]
            loads.append(sum(hits.get(c, 0) for c in cells) if hits else len(cells))
        smax += max(loads)
        smean += sum(loads) / len(loads)
    return smax / smean


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    procs = []
    tmp = tempfile.mkdtemp(prefix="shoal-plan-")
    try:
        budgets = [460000, 460000, 340000]  # 70, 70 and 52 experts of 6528 B: exactly the 192
        cl = cluster(tmp, budgets)
        out = os.path.join(tmp, "plan.json")
        r = sh("plan", "--model", TINY, "--cluster", cl, "-o", out)
        if not check("plan by bytes: exit 0", r.returncode == 0, r.stderr[-500:]):
            return 1
        check("plan by bytes: prints shares and imbalance", "imbalance" in r.stdout and "w2" in r.stdout,
              r.stdout[-500:])
        plan = json.load(open(out))
        check_plan("plan by bytes", plan, budgets)
        out2 = os.path.join(tmp, "plan2.json")
        sh("plan", "--model", TINY, "--cluster", cl, "-o", out2)
        check("plan by bytes: deterministic (identical file)", open(out).read() == open(out2).read())

        # the trace reader of `shoal trace stats` accepts the plan, routing trace for --trace
        tr = os.path.join(tmp, "t.trace")
        ref, rr = run_ids("--trace", tr)
        if check("in-process reference with a trace", ref is not None, rr.stderr[-500:]):
            hits = read_trace(tr)
            pt = os.path.join(tmp, "plan_t.json")
            r = sh("plan", "--model", TINY, "--cluster", cl, "--trace", tr, "-o", pt)
            if check("plan by trace: exit 0", r.returncode == 0, r.stderr[-500:]):
                plan_t = json.load(open(pt))
                lw_t = check_plan("plan by trace", plan_t, budgets, hits)
                check("plan by trace: layer-weighted imbalance <= by bytes on this trace",
                      lw_t <= layer_weighted(plan, hits) + 1e-12, f"{lw_t} vs {layer_weighted(plan, hits)}")
                s = sh("trace", "stats", tr, "--plan", pt)
                check("trace stats --plan reads the plan", s.returncode == 0 and "imbalance" in s.stdout,
                      s.stderr[-300:])

            # workers from the plan, coordinator from the plan
            for w in plan["workers"]:
                log = tempfile.TemporaryFile()
                p = subprocess.Popen([BIN, "expert", "--model", TINY, "--plan", out, "--name", w["name"],
                                      "--threads", "1", "--insecure"], stdout=subprocess.DEVNULL, stderr=log)
                p.log = log
                procs.append(p)
            got, rr = run_ids("--plan", out, "--insecure-workers")
            check("3 workers from the plan: ids identical to in-process", got == ref,
                  f"got {got} want {ref}: {rr.stderr[-600:]}")
            for p in procs:
                p.send_signal(signal.SIGTERM)
                check("plan worker exits 0 on SIGTERM", p.wait(10) == 0)

        # too small
        small = cluster(tmp, [460000, 300000], "small.json")  # 70 + 45 of the 192 experts
        r = sh("plan", "--model", TINY, "--cluster", small, "-o", os.path.join(tmp, "x.json"))
        want = f"short by {192 - 115} experts = {(192 - 115) * EXPERT_BYTES} B"
        check("too small a cluster refused with the shortfall", r.returncode == 3 and want in r.stderr,
              f"rc {r.returncode}: {r.stderr[-300:]}")
        r = sh("plan", "--model", TINY, "--cluster", cl, "--replicas", "2", "-o", os.path.join(tmp, "x.json"))
        check("--replicas > 0 refused, saying why", r.returncode == 2 and "replicas" in r.stderr, r.stderr[-300:])

        # a worker with a plan made for another model
        p = subprocess.run([BIN, "expert", "--model", PLAIN, "--plan", out, "--name", "w0", "--listen",
                            f"tcp://127.0.0.1:{free_port()}", "--insecure"], capture_output=True, text=True, timeout=30)
        check("worker refuses a plan made for another model", p.returncode == 3 and "plan was made for" in p.stderr,
              f"rc {p.returncode}: {p.stderr[-300:]}")
        p = subprocess.run([BIN, "expert", "--model", TINY, "--plan", out, "--name", "nobody"], capture_output=True,
                           text=True, timeout=30)
        check("worker refuses a name not in the plan", p.returncode == 3 and "nobody" in p.stderr, p.stderr[-300:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
