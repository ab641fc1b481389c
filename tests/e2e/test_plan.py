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
- with --hot 2 and a trace: every expert owned at least once, the two
  hottest of every layer (from the trace, read here) exactly twice, budgets
  kept, expected shares recomputed here from the documented levelling rule,
  layer-weighted imbalance no worse than without replicas; the replicated
  plan's workers (packs: the replicas included) give the in-process ids, and
  the workers' per-expert pair counters (their /metrics) add up to the trace's
  routing decisions exactly (each pair computed once, by one of its owners); a
  worker holding only replicas, added to the plan, is given work and the ids
  stay identical; replicas the budgets cannot hold are refused with the
  shortfall;
- a cluster too small is refused with the shortfall;
- a worker given a plan made for another model is refused.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_plan"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PLAIN = os.path.join(SRC, "tests", "models", "tiny-k3-plain")
PROMPT = "3,17,250,1001,42,7,99,512,4000,1"
L, E, EXPERT_BYTES = 9, 24, 6528  # tiny-k3 (shoal inspect); checked against plan.json below


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
free_port = harness.free_port


def sh(*args, timeout=120):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


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


def replicated_loads(plan, hits):
    """{worker: [load per layer]} by the rule of docs/CLUSTER.md: every expert's
    hits on its owner, then each replicated expert, hottest first (ties to the
    lower id), moves min(hits, (owner - replica) / 2) from its owner to its
    replica when the owner is the busier."""
    names = [w["name"] for w in plan["workers"]]
    held = {w["name"]: parse_ranges(w["experts"]) for w in plan["workers"]}
    rep = {w["name"]: parse_ranges(w.get("replica_experts", "") or "0:0") - {(0, 0)} for w in plan["workers"]}
    load = {n: [0.0] * L for n in names}
    for l in range(1, L):
        moved = []
        for e in range(E):
            h = hits.get((l, e), 0)
            owner = [n for n in names if (l, e) in held[n] and (l, e) not in rep[n]]
            second = [n for n in names if (l, e) in rep[n]]
            assert len(owner) == 1 and len(second) <= 1, (l, e, owner, second)
            load[owner[0]][l] += h
            if second:
                moved.append((-h, e, owner[0], second[0]))
        for mh, e, a, b in sorted(moved):
            x = min(-mh, (load[a][l] - load[b][l]) / 2)
            if x > 0:
                load[a][l] -= x
                load[b][l] += x
    return load


def scrape_value(port, name):
    """the (first) sample of metric name on a worker's /metrics"""
    txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(r'^' + name + r'(?:\{[^}]*\})? (\S+)$', txt, re.M)
    return float(m.group(1)) if m else None


def scrape_pairs(port):
    """{(layer, expert): pairs} from a worker's shoal_expert_server_expert_pairs_total"""
    txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^shoal_expert_server_expert_pairs_total\{([^}]*)\} (\S+)$', txt, re.M):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(int(lab["layer"]), int(lab["expert"]))] = int(float(m.group(2)))
    return out


def start_plan_workers(plan_path, names, procs, tmp, model=TINY, extra=()):
    """workers of plan_path with --metrics-port; {name: metrics port} once all answer"""
    ports = {}
    for n in names:
        port = free_port()
        p = subprocess.Popen([BIN, "expert", "--model", model, "--plan", plan_path, "--name", n, "--threads", "1",
                              "--insecure", "--metrics-port", str(port), *extra], stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(tmp, f"{n}.log"), "a"))
        procs.append(p)
        ports[n] = port
    end = time.time() + 30
    for n, port in ports.items():
        while True:
            try:
                scrape_pairs(port)
                break
            except OSError:
                if time.time() > end or procs[-1].poll() is not None:
                    raise RuntimeError(open(os.path.join(tmp, f"{n}.log")).read()[-500:])
                time.sleep(0.1)
    return ports


def stop_all(procs):
    for p in procs:
        harness.terminate(p)
    procs.clear()


def case_replicas(tmp, tr, hits, ref, plan_plain_lw, procs):
    budgets = [600000] * 3  # 91 experts each: 64 primary + room for 27
    cl = cluster(tmp, budgets, "cluster_r.json")
    pr = os.path.join(tmp, "plan_r.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "--trace", tr, "--hot", "2", "-o", pr)
    if not check("replicas: plan --hot 2 --trace exits 0", r.returncode == 0, r.stderr[-500:]):
        return
    plan = json.load(open(pr))
    p0 = os.path.join(tmp, "plan_r0.json")
    sh("plan", "--model", TINY, "--cluster", cl, "--trace", tr, "-o", p0)
    lw0 = json.load(open(p0))["layer_weighted_imbalance"]
    moe = [(l, e) for l in range(1, L) for e in range(E)]
    owned = {}
    for w in plan["workers"]:
        for c in parse_ranges(w["experts"]):
            owned.setdefault(c, []).append(w["name"])
    twice = {c for c, v in owned.items() if len(v) == 2}
    hottest = set()
    for l in range(1, L):
        hottest |= {(l, e) for e in sorted(range(E), key=lambda e: (-hits.get((l, e), 0), e))[:2]}
    check("replicas: every expert owned at least once, none three times", sorted(owned) == moe and
          all(1 <= len(v) <= 2 for v in owned.values()), f"{len(owned)} cells")
    check("replicas: the two hottest experts of every layer (from the trace) are the ones held twice",
          twice == hottest, f"twice {sorted(twice)} hottest {sorted(hottest)}")
    ok_b = all(len(parse_ranges(w["experts"])) * EXPERT_BYTES <= budgets[i] and
               w["bytes"] == len(parse_ranges(w["experts"])) * EXPERT_BYTES for i, w in enumerate(plan["workers"]))
    check("replicas: each worker within its budget, replicas counted", ok_b)
    load = replicated_loads(plan, hits)
    total = sum(hits.get(c, 0) for c in moe)
    ok = all(abs(w["expected_share"] - sum(load[w["name"]]) / total) < 1e-9 for w in plan["workers"])
    check("replicas: expected shares recomputed here (levelling rule)", ok,
          str([(w["name"], w["expected_share"], sum(load[w["name"]]) / total) for w in plan["workers"]]))
    smax = sum(max(load[n][l] for n in load) for l in range(1, L))
    smean = sum(sum(load[n][l] for n in load) / len(load) for l in range(1, L))
    check("replicas: layer-weighted imbalance recomputed, no worse than without replicas",
          abs(plan["layer_weighted_imbalance"] - smax / smean) < 1e-9 and plan["layer_weighted_imbalance"] <= lw0 + 1e-12,
          f"{plan['layer_weighted_imbalance']} vs {smax / smean}, without {lw0}")

    # serve it: each worker from its pack (replicas included), verified at load;
    # w0 and w1 through a small RAM cache (--cache-gb) instead of mapping the pack
    cache = {"w0": ("--cache-gb", "small"), "w1": ("--cache-gb", "0.0001"), "w2": ()}
    for w in plan["workers"]:
        pk = os.path.join(tmp, "pack_" + w["name"])
        r = sh("pack", "--model", TINY, "--plan", pr, "--worker", w["name"], "-o", pk, "--quiet")
        if not check(f"replicas: pack for {w['name']}", r.returncode == 0, r.stderr[-300:]):
            return
    ports = {}
    try:
        for w in plan["workers"]:
            ports.update(start_plan_workers(pr, [w["name"]], procs, tmp, model=os.path.join(tmp, "pack_" + w["name"]),
                                            extra=("--verify", *cache[w["name"]])))
    except RuntimeError as e:
        check("replicas: workers serve their packs", False, str(e))
        stop_all(procs)
        return
    got, rr = run_ids("--plan", pr, "--insecure-workers")
    check("replicas: 3 workers of a replicated plan on their packs: ids identical to in-process", got == ref,
          f"got {got} want {ref}: {rr.stderr[-600:]}")
    cs = {n: (scrape_value(ports[n], "shoal_expert_server_cache_slots"),
              scrape_value(ports[n], "shoal_expert_server_experts_owned"),
              scrape_value(ports[n], "shoal_expert_server_cache_misses_total")) for n in ("w0", "w1")}
    check("pack + --verify + small --cache-gb (w0: small, w1: 0.0001 GiB): the cache held fewer experts than "
          "the worker serves and missed, and the ids above are identical",
          got == ref and all(s is not None and o is not None and m is not None and 0 < s < o and m > 0
                             for s, o, m in cs.values()), f"(slots, owned, misses) {cs}")
    served = {}
    for n, port in ports.items():
        for c, v in scrape_pairs(port).items():
            served.setdefault(c, {})[n] = v
    sums = {c: sum(v.values()) for c, v in served.items()}
    want = {c: h for c, h in hits.items() if h}
    check("replicas: the workers' pair counters add up to the trace exactly (each pair computed once)",
          sums == want, f"{len(sums)} vs {len(want)} experts; first differences "
          f"{[(c, sums.get(c), want.get(c)) for c in sorted(set(sums) | set(want)) if sums.get(c) != want.get(c)][:5]}")
    check("replicas: each worker computed only experts it holds",
          all(c in parse_ranges(w["experts"]) for w in plan["workers"] for c, v in served.items() if w["name"] in v))
    rep_used = sum(1 for c in twice for n in served.get(c, {}) if n not in
                   [w["name"] for w in plan["workers"] if c in parse_ranges(w["experts"]) and
                    c not in parse_ranges(w.get("replica_experts", "0:0"))])
    print(f"# replicated experts served by their replica (second owner): {rep_used} of {len(twice)}", flush=True)

    # a fourth worker holding every expert, only replicas: the coordinator gives it work
    plan["workers"].append({"name": "wr", "host": "wr", "experts": "1-8:0-23", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                            "listen": ""})
    plan["workers"][-1]["listen"] = plan["workers"][-1]["endpoint"]
    pr4 = os.path.join(tmp, "plan_r4.json")
    json.dump(plan, open(pr4, "w"), indent=2)
    before = {n: sum(scrape_pairs(p).values()) for n, p in ports.items()}
    try:
        ports.update(start_plan_workers(pr4, ["wr"], procs, tmp))
    except RuntimeError as e:
        check("replicas: a replicas-only worker starts", False, str(e))
        stop_all(procs)
        return
    got, rr = run_ids("--plan", pr4, "--insecure-workers")
    wr = sum(scrape_pairs(ports["wr"]).values())
    others = sum(sum(scrape_pairs(p).values()) - before[n] for n, p in ports.items() if n != "wr")
    check("replicas: a 4th worker holding only replicas gets pairs, the ids stay identical",
          got == ref and wr > 0 and wr + others == sum(want.values()),
          f"got {got} want {ref}; wr {wr} pairs, others {others}, trace {sum(want.values())}: {rr.stderr[-400:]}")
    print(f"# replicas-only worker computed {wr} of {wr + others} pairs", flush=True)
    stop_all(procs)

    # replicas the budgets cannot hold: refused with the shortfall
    small = cluster(tmp, [460000, 460000, 340000], "exact.json")  # room for exactly the 192
    r = sh("plan", "--model", TINY, "--cluster", small, "--hot", "1", "-o", os.path.join(tmp, "x.json"))
    check("replicas the budgets cannot hold refused with the shortfall",
          r.returncode == 3 and f"need room for 8 more experts" in r.stderr and
          f"short by 8 experts = {8 * EXPERT_BYTES} B" in r.stderr, f"rc {r.returncode}: {r.stderr[-300:]}")


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


def case_redundancy(tmp):
    """issue 18: --replicas R puts every routed expert on R + 1 distinct hosts
    (distinct failure domains when the manifest names them), within each
    host's budget; refused naming the numbers when it cannot be. The expected
    counts are worked out here from the budgets, not taken from the planner."""
    moe = {(l, e) for l in range(1, L) for e in range(E)}
    n = len(moe)

    def holders(plan):
        h = {}
        for w in plan["workers"]:
            for c in parse_ranges(w["experts"]):
                h.setdefault(c, []).append(w["name"])
        return h

    def manifest(budgets, domains, name):
        path = cluster(tmp, budgets, name)
        doc = json.load(open(path))
        for h, d in zip(doc["hosts"][1:], domains):
            if d:
                h["domain"] = d
        json.dump(doc, open(path, "w"))
        return path

    # 4 hosts in 2 domains, room for 306 experts each: R = 1
    cl = manifest([2000000] * 4, ["a", "a", "b", "b"], "red_dom.json")
    pr = os.path.join(tmp, "red_dom_plan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "--replicas", "1", "-o", pr)
    if check("redundancy: --replicas 1 on 2 domains exits 0", r.returncode == 0, r.stderr[-400:]):
        plan = json.load(open(pr))
        dom = {f"w{i}": "ab"[i // 2] for i in range(4)}
        h = holders(plan)
        check("redundancy: every routed expert on exactly 2 hosts, in distinct domains, nothing else held",
              set(h) == moe and all(len(v) == 2 and dom[v[0]] != dom[v[1]] for v in h.values()),
              str(sorted((c, v) for c, v in h.items() if len(v) != 2 or dom[v[0]] == dom[v[1]])[:5]))
        check("redundancy: the plan says replicas 1 and each worker's domain",
              plan["replicas"] == 1 and [w.get("domain") for w in plan["workers"]] == ["a", "a", "b", "b"])
        check("redundancy: counts as even as the budgets allow (2 x 192 / 4 each)",
              [w["expert_count"] for w in plan["workers"]] == [96] * 4, str([w["expert_count"] for w in plan["workers"]]))
        # shoal pack writes every copy: each worker's pack holds exactly its RANGES
        ok, why = True, ""
        for w in plan["workers"]:
            d = os.path.join(tmp, "red_pack_" + w["name"])
            r = sh("pack", "--model", TINY, "--plan", pr, "--worker", w["name"], "-o", d, "--quiet")
            pj = json.load(open(os.path.join(d, "shoal-pack.json"))) if r.returncode == 0 else {}
            if r.returncode or parse_ranges(pj.get("experts", "")) != parse_ranges(w["experts"]):
                ok, why = False, f"{w['name']}: rc {r.returncode} {pj.get('experts')} vs {w['experts']} {r.stderr[-200:]}"
        check("redundancy: shoal pack writes each worker's copies (its pack holds exactly its RANGES)", ok, why)
    # R = 2 on 2 domains: refused, naming the domains
    r = sh("plan", "--model", TINY, "--cluster", cl, "--replicas", "2", "-o", os.path.join(tmp, "x.json"))
    check("redundancy: --replicas 2 with 2 failure domains refused naming them",
          r.returncode == 3 and "3 distinct failure domains; the cluster has 2" in r.stderr, r.stderr[-300:])
    # uneven budgets, no domains: 107, 306, 306 and 45 experts of room
    budgets = [700000, 2000000, 2000000, 300000]
    room = [min(b // EXPERT_BYTES, n) for b in budgets]
    cl2 = manifest(budgets, [None] * 4, "red_uneven.json")
    pr2 = os.path.join(tmp, "red_uneven_plan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl2, "--replicas", "1", "-o", pr2)
    if check("redundancy: --replicas 1 on uneven budgets exits 0", r.returncode == 0, r.stderr[-400:]):
        plan = json.load(open(pr2))
        h = holders(plan)
        check("redundancy: every expert on 2 distinct hosts (uneven budgets)",
              set(h) == moe and all(len(set(v)) == 2 == len(v) for v in h.values()))
        check("redundancy: each host within its budget",
              all(w["expert_count"] <= room[i] and w["bytes"] <= budgets[i] for i, w in enumerate(plan["workers"])),
              str([(w["expert_count"], room[i]) for i, w in enumerate(plan["workers"])]))
    # R = 2 needs 3 x 192 = 576 copies; the room is min(room, 192) summed
    need, have = 3 * n, sum(min(x, n) for x in room)
    r = sh("plan", "--model", TINY, "--cluster", cl2, "--replicas", "2", "-o", os.path.join(tmp, "x.json"))
    check("redundancy: --replicas 2 beyond the budgets refused with the copies, the room and the shortfall",
          r.returncode == 3 and f"{need} expert copies" in r.stderr and f"hold {have}" in r.stderr and
          f"short by {need - have} experts = {(need - have) * EXPERT_BYTES} B" in r.stderr, r.stderr[-400:])
    r = sh("plan", "--model", TINY, "--cluster", cl2, "--replicas", "4", "-o", os.path.join(tmp, "x.json"))
    check("redundancy: --replicas 4 on 4 hosts refused (5 hosts needed)",
          r.returncode == 3 and "5 distinct worker hosts; the cluster has 4" in r.stderr, r.stderr[-300:])
    r = sh("plan", "--model", TINY, "--cluster", cl2, "--replicas", "1", "--hot", "2", "-o", os.path.join(tmp, "x.json"))
    check("redundancy: --replicas with --hot refused as a usage error", r.returncode == 2 and "--hot" in r.stderr,
          r.stderr[-300:])


def case_inventory_injection(tmp):
    """issue 20 item 7: a cluster manifest string with a quote and a newline
    (ssh_user, address, or any other string) is refused naming the field;
    what is written is quoted, read back by PyYAML (system python3) and by
    ansible-inventory when present: exactly the hosts and variables expected"""
    good = json.load(open(cluster(tmp, [2000000], "inj_ok.json")))
    evil = [("hosts[1].ssh_user", lambda d: d["hosts"][1].__setitem__("ssh_user", 'root"\n          evil: "1')),
            ("hosts[1].address", lambda d: d["hosts"][1].__setitem__("address", '127.0.0.1"\n  evil: 1')),
            ("hosts[0].note", lambda d: d["hosts"][0].__setitem__("note", "x\ny")),
            ("hosts[1].ssh_user", lambda d: d["hosts"][1].__setitem__("ssh_user", 'ro"ot'))]
    for field, mutate in evil:
        d = json.loads(json.dumps(good))
        mutate(d)
        path = os.path.join(tmp, "inj.json")
        json.dump(d, open(path, "w"))
        inv = os.path.join(tmp, "inj.yml")
        if os.path.exists(inv):
            os.unlink(inv)
        r = sh("plan", "--model", TINY, "--cluster", path, "-o", os.path.join(tmp, "inj_plan.json"),
               "--inventory", inv)
        check(f"inventory injection via {field} refused naming the field", r.returncode == 3 and
              field.split(".")[0] in r.stderr and "." + field.split(".")[1] in r.stderr and not os.path.exists(inv), f"rc {r.returncode}: {r.stderr[-300:]}")
    # a plan path with a quote and a newline: quoted, not injected
    odd = os.path.join(tmp, 'pl"an\nevil: 1.json')
    inv = os.path.join(tmp, "inj_ok.yml")
    r = sh("plan", "--model", TINY, "--cluster", os.path.join(tmp, "inj_ok.json"), "-o", odd, "--inventory", inv)
    ok = r.returncode == 0
    parsed = None
    if ok:
        y = subprocess.run(["python3", "-c", "import json,sys,yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
                            inv], capture_output=True, text=True, timeout=30)
        parsed = json.loads(y.stdout) if y.returncode == 0 else None
    want = {"all": {"vars": {"shoal_plan_file": odd, "shoal_worker_port_default": 5555},
                    "children": {"shoal_coordinator": {"hosts": {"head": {
                        "ansible_host": "127.0.0.1", "ansible_user": "root", "ansible_port": 22, "shoal_cpus": 2}}},
                                 "shoal_workers": {"hosts": {"w0": {
                                     "ansible_host": "127.0.0.1", "ansible_user": "root", "ansible_port": 22,
                                     "shoal_cpus": 1, "shoal_worker_port": good["hosts"][1]["port"]}}}}}}
    check("inventory: every string quoted (a plan path with a quote and a newline reads back as itself)",
          ok and parsed == want, f"rc {r.returncode} {r.stderr[-200:]}; parsed {parsed}")
    if shutil.which("ansible-inventory"):
        a = subprocess.run(["ansible-inventory", "-i", inv, "--list"], capture_output=True, text=True, timeout=120)
        doc = json.loads(a.stdout) if a.returncode == 0 else {}
        hv = doc.get("_meta", {}).get("hostvars", {})
        check("inventory: ansible-inventory sees exactly the two hosts and no extra variable",
              set(hv) == {"head", "w0"} and not any("evil" in v for v in hv.values()), a.stdout[-400:] + a.stderr[-300:])
    else:
        record("SKIP", "inventory: ansible-inventory read-back", "ansible-inventory not installed")


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
                log = harness.logfile()
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
            procs.clear()
            case_replicas(tmp, tr, hits, ref, None, procs)

        # too small
        small = cluster(tmp, [460000, 300000], "small.json")  # 70 + 45 of the 192 experts
        r = sh("plan", "--model", TINY, "--cluster", small, "-o", os.path.join(tmp, "x.json"))
        want = f"short by {192 - 115} experts = {(192 - 115) * EXPERT_BYTES} B"
        check("too small a cluster refused with the shortfall", r.returncode == 3 and want in r.stderr,
              f"rc {r.returncode}: {r.stderr[-300:]}")
        r = sh("plan", "--model", TINY, "--cluster", cl, "--hot", "25", "-o", os.path.join(tmp, "x.json"))
        check("--hot beyond the experts of a layer refused", r.returncode == 3 and "at most the 24" in r.stderr,
              r.stderr[-300:])

        case_inventory_injection(tmp)
        case_redundancy(tmp)

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
