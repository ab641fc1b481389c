#!/usr/bin/env python3
"""`shoal pack` end to end on tests/models/tiny-k3 (docs/DEPLOY.md "Packs", issue 10):

- each worker's pack holds exactly its experts: every safetensors file is
  parsed here (independently of the C code) and each tensor's bytes equal the
  original model's; the manifest's sizes and BLAKE2b-256 sums equal hashlib's;
- workers serving from their packs (with --verify) and a coordinator on the
  original model generate the in-process ids;
- a rerun keeps the finished files (not rewritten), and rewrites a file that
  was corrupted or left unfinished;
- a pack with one flipped byte is refused by `shoal expert --verify`, a
  truncated one even without --verify.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_pack"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PROMPT = "3,17,250,1001,42,7,99,512,4000,1"


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
free_port = harness.free_port


def sh(*args, timeout=120):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


def st_tensors(path):
    """name -> bytes of every tensor of one safetensors file"""
    b = open(path, "rb").read()
    n = struct.unpack_from("<Q", b, 0)[0]
    h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        a, z = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], b[8 + n + a:8 + n + z])
    return out


def model_tensors(model):
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        out.update(st_tensors(os.path.join(model, fn)))
    return out


def parse_ranges(s):
    cells = set()
    for g in s.split(","):
        ls, es = g.split(":")
        la, lb = ls.split("-") if "-" in ls else (ls, ls)
        ea, eb = es.split("-") if "-" in es else (es, es)
        for l in range(int(la), int(lb) + 1):
            for e in range(int(ea), int(eb) + 1):
                cells.add((l, e))
    return cells


def run_ids(*args, model=TINY):
    r = subprocess.run([BIN, "run", "--model", model, "--json", "--ids", PROMPT, "--gen", "6", *args],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["generated_ids"], r
    except Exception:
        return None, r


def b2(path):
    return hashlib.blake2b(open(path, "rb").read(), digest_size=32).hexdigest()


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-pack-")
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1, "expert_ram": 0}]
    for i in range(2):
        hosts.append({"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": "1MiB", "port": free_port()})
    cl = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(cl, "w"))
    plan = os.path.join(tmp, "plan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "-o", plan)
    if not check("plan", r.returncode == 0, r.stderr[-400:]):
        return 1
    pl = json.load(open(plan))
    orig = model_tensors(TINY)
    procs = []
    try:
        packs = {}
        for w in pl["workers"]:
            d = os.path.join(tmp, "pack-" + w["name"])
            r = sh("pack", "--model", TINY, "--plan", plan, "--worker", w["name"], "-o", d)
            if not check(f"pack {w['name']}: exit 0", r.returncode == 0, r.stderr[-400:]):
                return 1
            check(f"pack {w['name']}: progress with bytes, rate and ETA", "GiB" in r.stderr and "MiB/s" in r.stderr
                  and "ETA" in r.stderr, r.stderr[-300:])
            packs[w["name"]] = d
            man = json.load(open(os.path.join(d, "shoal-pack.json")))
            ok = all(os.path.getsize(os.path.join(d, f["name"])) == f["bytes"] and
                     b2(os.path.join(d, f["name"])) == f["blake2b"] for f in man["files"])
            check(f"pack {w['name']}: manifest sizes and BLAKE2b-256 equal hashlib's", ok)
            got = {}
            for f in man["files"]:
                if f["name"].endswith(".safetensors"):
                    got.update(st_tensors(os.path.join(d, f["name"])))
            want = {}
            for (l, e) in parse_ranges(w["experts"]):
                for k, v in orig.items():
                    if k.startswith(f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}."):
                        want[k] = v
            check(f"pack {w['name']}: exactly its experts' tensors, bytes equal the model's",
                  got == want and len(want) == 6 * len(parse_ranges(w["experts"])),
                  f"{len(got)} tensors, want {len(want)}")
            check(f"pack {w['name']}: config.json copied byte for byte",
                  open(os.path.join(d, "config.json"), "rb").read() ==
                  open(os.path.join(TINY, "config.json"), "rb").read())

        ref, rr = run_ids()
        keys = os.path.join(tmp, "keys")
        os.mkdir(keys)
        for n in ["coordinator"] + [w["name"] for w in pl["workers"]]:
            sh("keygen", "-o", os.path.join(keys, n))
        if check("in-process reference", ref is not None, rr.stderr[-400:]):
            for w in pl["workers"]:
                log = harness.logfile()
                p = subprocess.Popen([BIN, "expert", "--model", packs[w["name"]], "--verify", "--plan", plan,
                                      "--name", w["name"], "--threads", "1",
                                      "--curve-secret", os.path.join(keys, w["name"] + ".key"),
                                      "--curve-allow", os.path.join(keys, "coordinator.pub")],
                                     stdout=subprocess.DEVNULL, stderr=log)
                p.log = log
                procs.append(p)
            got, rr = run_ids("--plan", plan, "--curve-secret", os.path.join(keys, "coordinator.key"),
                              "--curve-keys", keys)
            check("2 workers serving from packs (--verify, CURVE): ids identical to in-process", got == ref,
                  f"got {got} want {ref}: {rr.stderr[-600:]}")
            trunk = os.path.join(tmp, "trunk")
            r = sh("pack", "--model", TINY, "--trunk", "--plan", plan, "-o", trunk)
            tt = {}
            for f in os.listdir(trunk):
                if f.endswith(".safetensors"):
                    tt.update(st_tensors(os.path.join(trunk, f)))
            want = {k: v for k, v in orig.items() if ".block_sparse_moe.experts." not in k and
                    not k.startswith(("vision_tower.", "mm_projector."))}
            check("trunk pack: every tensor but the routed experts and the vision tower, bytes equal",
                  r.returncode == 0 and tt == want and os.path.exists(os.path.join(trunk, "tiktoken.model")),
                  f"{len(tt)} vs {len(want)}: {r.stderr[-300:]}")
            got, rr = run_ids("--plan", plan, "--curve-secret", os.path.join(keys, "coordinator.key"),
                              "--curve-keys", keys, model=trunk)
            check("coordinator on the trunk pack + workers on their packs: ids identical", got == ref,
                  f"got {got} want {ref}: {rr.stderr[-600:]}")
            for p in procs:
                p.send_signal(signal.SIGTERM)
                rc = p.wait(10)
                p.log.seek(0)
                check("pack worker exits 0 on SIGTERM", rc == 0, p.log.read().decode()[-300:])

        # resume
        w0 = pl["workers"][0]["name"]
        d = packs[w0]
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        mt = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in files}
        r = sh("pack", "--model", TINY, "--plan", plan, "--worker", w0, "-o", d)
        check("rerun: finished files kept, not rewritten", r.returncode == 0 and "0.000 GiB copied" in r.stdout and
              all(os.stat(os.path.join(d, f)).st_mtime_ns == mt[f] for f in files), r.stdout + r.stderr[-300:])
        victim = os.path.join(d, files[0])
        good = open(victim, "rb").read()
        bad = bytearray(good)
        bad[-5] ^= 0x40
        open(victim, "wb").write(bad)
        os.remove(os.path.join(d, files[1]))  # as if interrupted before that file
        open(os.path.join(d, files[1] + ".part"), "wb").write(b"partial")
        r = sh("expert", "--model", d, "--verify", "--plan", plan, "--name", w0, "--listen",
               f"tcp://127.0.0.1:{free_port()}", "--insecure", timeout=30)
        check("a damaged pack (flipped byte, missing file) is refused", r.returncode == 3,
              f"rc {r.returncode}: {r.stderr[-300:]}")
        r = sh("pack", "--model", TINY, "--plan", plan, "--worker", w0, "-o", d)
        man = json.load(open(os.path.join(d, "shoal-pack.json")))
        check("rerun: corrupted and unfinished files rewritten, the rest kept",
              r.returncode == 0 and open(victim, "rb").read() == good and
              all(b2(os.path.join(d, f["name"])) == f["blake2b"] for f in man["files"]) and
              os.stat(os.path.join(d, files[2])).st_mtime_ns == mt[files[2]], r.stderr[-300:])
        open(victim, "wb").write(bad)
        r = sh("expert", "--model", d, "--verify", "--plan", plan, "--name", w0, "--listen",
               f"tcp://127.0.0.1:{free_port()}", "--insecure", timeout=30)
        check("corrupted pack refused by --verify naming the file", r.returncode == 3 and "checksum mismatch" in
              r.stderr and files[0] in r.stderr, f"rc {r.returncode}: {r.stderr[-300:]}")
        open(victim, "wb").write(good[:-7])
        r = sh("expert", "--model", d, "--plan", plan, "--name", w0, "--listen", f"tcp://127.0.0.1:{free_port()}",
               "--insecure", timeout=30)
        check("truncated pack refused without --verify", r.returncode == 3 and "manifest says" in r.stderr,
              f"rc {r.returncode}: {r.stderr[-300:]}")
        r = sh("expert", "--model", TINY, "--verify", "--plan", plan, "--name", w0, "--listen",
               f"tcp://127.0.0.1:{free_port()}", "--insecure", timeout=30)
        check("--verify on original shards refused (no checksums)", r.returncode == 2 and "not a pack" in r.stderr,
              f"rc {r.returncode}: {r.stderr[-300:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
