#!/usr/bin/env python3
"""`shoal pack` of a plan worker's trunk rows (issue 16) on tests/models/tiny-k3,
real processes over loopback tcp:

- `shoal plan --trunk spread` over 3 workers, `shoal pack` per worker: every
  pack's trunk slices are parsed here (independently of the C code) and hold
  exactly the rows PROTOCOL.md §7.1 gives worker w (floor(wR/N) ..
  floor((w+1)R/N)-1) of every row-shardable matrix, and all rows of each KDA
  f_a (the chain of PROTOCOL.md §3.7), bytes equal to those rows
  of the original model; the manifest's trunk_rows carry the FULL shapes,
  dtypes and sizes (from the original headers); its sizes and BLAKE2b-256
  equal hashlib's;
- workers serving their packs (--verify; one of them with an expert cache, so
  its trunk rows come from a second, mapped store) are accepted by a
  coordinator on the full model (same trunk fingerprint as the full model's)
  and `shoal run --plan --trunk auto` gives the in-process ids and logits byte
  for byte (--dump-logits); so does a mix of one worker on the full model
  directory and two on packs;
- with `--replicas 1` (failover, issue 18) each pack also holds the replica
  parts the plan gives its worker (rows checked as above), and the packs serve
  the in-process ids and logits;
- a pack asked for rows it does not hold is refused naming them (exit 3); a
  flipped byte in a trunk-rows file is refused by --verify naming the file.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~15 s.
"""
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_pack_trunk"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
N = 3


def sh(*args, timeout=60):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


def st_file(path):
    """name -> (dtype, shape, bytes) of one safetensors file"""
    b = open(path, "rb").read()
    n = struct.unpack_from("<Q", b, 0)[0]
    h = json.loads(b[8:8 + n])
    return {k: (v["dtype"], v["shape"], b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in h.items() if k != "__metadata__"}


def model_tensors(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            out.update(st_file(os.path.join(d, fn)))
    return out


def b2(path):
    return hashlib.blake2b(open(path, "rb").read(), digest_size=32).hexdigest()


def run_ids(tmp, *extra):
    out = os.path.join(tmp, f"logits{time.monotonic_ns()}.bin")
    r = sh("run", "--model", TINY, "--ids", "5,17,3,99,42,7", "--gen", "6", "--json", "--dump-logits", out,
           "--hello-timeout-ms", "10000", *extra, timeout=120)
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    return j, (open(out, "rb").read() if os.path.exists(out) else b""), r.stderr


def serve(tmp, plan, ws, model_of, extra_of=lambda w: []):
    procs = []
    for w in ws:
        procs.append(subprocess.Popen([BIN, "expert", "--model", model_of(w), "--plan", plan, "--name", w["name"],
                                       "--threads", "1", "--insecure", *extra_of(w)], stdout=subprocess.DEVNULL,
                                      stderr=open(os.path.join(tmp, w["name"] + ".log"), "a")))
    return procs


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-packtrunk-")
    orig = model_tensors(TINY)
    # row-shardable, by PROTOCOL.md §7.1's rule, from the headers
    shard = {k: v for k, v in orig.items()
             if k.startswith("language_model.") and len(v[1]) == 2 and v[1][0] >= 2
             and not (".experts." in k and "shared_experts" not in k)
             and not k.endswith("embed_tokens.weight") and not k.endswith("kv_b_proj.weight")}
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0}]
    for i in range(N):
        hosts.append({"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": 1 << 30, "port": harness.free_port()})
    cl = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555, "hosts": hosts},
              open(cl, "w"))
    plan = os.path.join(tmp, "plan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "--trunk", "spread", "-o", plan)
    if not check("plan --trunk spread", r.returncode == 0, r.stderr[-400:]):
        return 1
    ws = json.load(open(plan))["workers"]
    packs = {}
    for wi, w in enumerate(ws):
        d = os.path.join(tmp, "pack-" + w["name"])
        r = sh("pack", "--model", TINY, "--plan", plan, "--worker", w["name"], "-o", d, "--quiet")
        if not check(f"pack {w['name']}: exit 0", r.returncode == 0, r.stderr[-400:]):
            return 1
        packs[w["name"]] = d
        man = json.load(open(os.path.join(d, "shoal-pack.json")))
        check(f"pack {w['name']}: manifest sizes and BLAKE2b-256 equal hashlib's",
              all(os.path.getsize(os.path.join(d, f["name"])) == f["bytes"] and
                  b2(os.path.join(d, f["name"])) == f["blake2b"] for f in man["files"]))
        rows = man.get("trunk_rows", [])
        got = {}
        for f in man["files"]:
            if f["name"].startswith("trunk-rows-"):
                got.update(st_file(os.path.join(d, f["name"])))
        # §7.1's share of every matrix, and (PROTOCOL.md §3.7, chains) every KDA f_a whole besides
        want_rows = sorted([(k, wi * v[1][0] // N, (wi + 1) * v[1][0] // N - 1) for k, v in shard.items()] +
                           [(k, 0, v[1][0] - 1) for k, v in shard.items() if k.endswith(".f_a_proj.weight")])
        ok = man.get("trunk") == w["trunk"] and sorted((x["name"], x["lo"], x["hi"]) for x in rows) == want_rows
        check(f"pack {w['name']}: trunk_rows are §7.1's rows *:{wi}/{N} of every row-shardable matrix, "
              "and every f_a whole", ok, f"{len(rows)} entries, want {len(want_rows)}")
        ok = all(x["dtype"] == orig[x["name"]][0] and x["shape"] == orig[x["name"]][1] and
                 x["nbytes"] == len(orig[x["name"]][2]) for x in rows)
        check(f"pack {w['name']}: trunk_rows carry the full matrices' dtype, shape and size", ok)
        ok = len(got) == len(rows)
        for x in rows:
            dt, shp, data = orig[x["name"]]
            row = len(data) // shp[0]
            g = got.get(x["tensor"])
            ok = ok and g is not None and g[0] == dt and g[1] == [x["hi"] - x["lo"] + 1, shp[1]] and \
                g[2] == data[x["lo"] * row:(x["hi"] + 1) * row]
        check(f"pack {w['name']}: each slice holds exactly those rows, bytes equal the model's", ok,
              f"{len(got)} slice tensors")

    ref, ref_lg, err = run_ids(tmp)
    if not check("in-process reference", ref is not None and len(ref_lg) > 0, err[-300:]):
        return 1
    procs = []
    try:
        # all from packs; w0 with an expert cache (experts by pread, trunk rows from a mapped store)
        procs = serve(tmp, plan, ws, lambda w: packs[w["name"]],
                      lambda w: ["--verify"] + (["--cache-slots", "16"] if w["name"] == ws[0]["name"] else []))
        j, lg, err = run_ids(tmp, "--plan", plan, "--insecure-workers", "--trunk", "auto")
        ok = j is not None
        check("3 workers on their packs (--verify, one cached): accepted, every trunk matrix remote",
              ok and j.get("trunk_remote_matrices", 0) == len(shard),
              err[-500:] if not ok else str(j.get("trunk_remote_matrices")))
        check("...in-process ids and logits byte for byte", ok and j["generated_ids"] == ref["generated_ids"]
              and lg == ref_lg, "" if not ok else f"{j['generated_ids']} vs {ref['generated_ids']}")
        for p in procs:
            harness.terminate(p, 5)
        # mixed: w0 on the full model directory, the others on packs
        procs = serve(tmp, plan, ws, lambda w: TINY if w["name"] == ws[0]["name"] else packs[w["name"]])
        j, lg, err = run_ids(tmp, "--plan", plan, "--insecure-workers", "--trunk", "auto")
        ok = j is not None
        check("1 worker on the model directory + 2 on packs: in-process ids and logits",
              ok and j.get("trunk_remote_matrices", 0) == len(shard) and
              j["generated_ids"] == ref["generated_ids"] and lg == ref_lg, err[-500:] if not ok else "")
        for p in procs:
            harness.terminate(p, 5)
        procs = []
    finally:
        for p in procs:
            harness.terminate(p, 5)

    # ---- --replicas 1 (failover, issue 18): each pack holds its own part and
    # the replica parts the plan gives it; the packs serve the in-process bits
    rplan = os.path.join(tmp, "rplan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "--trunk", "spread", "--replicas", "1", "-o", rplan)
    if check("plan --trunk spread --replicas 1", r.returncode == 0, r.stderr[-400:]):
        rws = json.load(open(rplan))["workers"]
        check("--replicas 1: every part in the plan on 2 workers",
              all(sum(p in w["trunk_parts"] for w in rws) == 2 for p in range(N)), str([w["trunk"] for w in rws]))
        rpacks = {}
        for w in rws:
            d = os.path.join(tmp, "rpack-" + w["name"])
            r = sh("pack", "--model", TINY, "--plan", rplan, "--worker", w["name"], "-o", d, "--quiet")
            if not check(f"replicas: pack {w['name']}: exit 0", r.returncode == 0, r.stderr[-400:]):
                return 1
            rpacks[w["name"]] = d
            man = json.load(open(os.path.join(d, "shoal-pack.json")))
            got = {}
            for f in man["files"]:
                if f["name"].startswith("trunk-rows-"):
                    got.update(st_file(os.path.join(d, f["name"])))
            want_rows = sorted([(k, p * v[1][0] // N, (p + 1) * v[1][0] // N - 1) for k, v in shard.items()
                                for p in w["trunk_parts"]] +
                               [(k, 0, v[1][0] - 1) for k, v in shard.items() if k.endswith(".f_a_proj.weight")])
            rows = man.get("trunk_rows", [])
            ok = sorted((x["name"], x["lo"], x["hi"]) for x in rows) == want_rows and len(got) == len(rows)
            for x in rows:
                dt, shp, data = orig[x["name"]]
                row = len(data) // shp[0]
                g = got.get(x["tensor"])
                ok = ok and g is not None and g[2] == data[x["lo"] * row:(x["hi"] + 1) * row]
            check(f"replicas: pack {w['name']}: the rows of parts {w['trunk_parts']} of every matrix and every "
                  "f_a whole, bytes equal the model's", ok, f"{len(rows)} entries, want {len(want_rows)}")
        procs = []
        try:
            procs = serve(tmp, rplan, rws, lambda w: rpacks[w["name"]], lambda w: ["--verify"])
            j, lg, err = run_ids(tmp, "--plan", rplan, "--insecure-workers", "--trunk", "auto")
            ok = j is not None
            check("replicas: 3 workers on their packs: every trunk matrix remote, in-process ids and logits",
                  ok and j.get("trunk_remote_matrices", 0) == len(shard) and
                  j["generated_ids"] == ref["generated_ids"] and lg == ref_lg, err[-500:] if not ok else "")
        finally:
            for p in procs:
                harness.terminate(p, 5)

    d = packs[ws[1]["name"]]
    port = harness.free_port()
    r = sh("expert", "--model", d, "--trunk", "*:all", "--listen", f"tcp://127.0.0.1:{port}", "--insecure",
           timeout=30)
    check("a pack asked for rows it does not hold: refused naming them (exit 3)",
          r.returncode == 3 and "does not hold rows" in r.stderr, f"rc {r.returncode}: {r.stderr[-300:]}")
    man = json.load(open(os.path.join(d, "shoal-pack.json")))
    victim = next(f["name"] for f in man["files"] if f["name"].startswith("trunk-rows-L"))
    vp = os.path.join(d, victim)
    bad = bytearray(open(vp, "rb").read())
    bad[-3] ^= 0x10
    open(vp, "wb").write(bad)
    r = sh("expert", "--model", d, "--verify", "--plan", plan, "--name", ws[1]["name"], "--listen",
           f"tcp://127.0.0.1:{harness.free_port()}", "--insecure", timeout=30)
    check("a flipped byte in a trunk-rows file: refused by --verify naming the file",
          r.returncode == 3 and "checksum mismatch" in r.stderr and victim in r.stderr,
          f"rc {r.returncode}: {r.stderr[-300:]}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
