#!/usr/bin/env python3
"""File fuzzer (issue 20): mutated safetensors headers, the safetensors index,
config.json, cluster manifests, plans and pack manifests, each through the
commands that read them:

  safetensors header, index, config.json -> `shoal inspect DIR`, `shoal run`
                                            and `shoal expert --print-fingerprint`
  cluster manifest                       -> `shoal plan --cluster`
  plan.json                              -> `shoal expert --plan --name` (stops at
                                            its --verify refusal when the plan is good)
  pack manifest (shoal-pack.json)        -> `shoal expert --verify --print-fingerprint`

Every case must end (no hang: a 20 s deadline), by exit, not a signal (no
crash), with an exit code of the documented set (docs/CONFIG.md "Exit codes":
0, 2, 3, 4) and, when it is not 0, a reason on stderr. Plus one FIFO case per
file kind (item 6). Bounded: SHOAL_LIVE_FUZZ_SECONDS (default 40 in all) and
SHOAL_LIVE_FUZZ_CASES; fixed seed SHOAL_LIVE_FUZZ_SEED. Long run:
  SHOAL_LIVE_FUZZ_SECONDS=3600 SHOAL_LIVE_FUZZ_CASES=100000 .venv/bin/python3 tests/e2e/test_fuzz_files.py
Failing inputs are kept under $SHOAL_LIVE_FUZZ_KEEP (default: not kept).
"""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_fuzz_files"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
SECONDS = float(os.environ.get("SHOAL_LIVE_FUZZ_SECONDS", "40"))
CASES = int(os.environ.get("SHOAL_LIVE_FUZZ_CASES", "100000"))
SEED = int(os.environ.get("SHOAL_LIVE_FUZZ_SEED", "20"))
KEEP = os.environ.get("SHOAL_LIVE_FUZZ_KEEP")
DOCUMENTED = {0, 2, 3, 4}
ODD = [-1, 0, 1, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 63, 2 ** 64, 10 ** 30, -2 ** 63, 1.5, 1e308, None, True, "",
       "x" * 5000, "é" * 63, "\u0000", "a\nb", [], {}, [[[[[]]]]], "BF16", "F32", "U8", "I64"]


def mutate_json_value(rng, v, depth=0):
    """structure-aware: one change somewhere inside v"""
    if isinstance(v, dict) and v and rng.random() < 0.85:
        k = rng.choice(list(v))
        j = rng.randrange(6)
        if j == 0:
            del v[k]
        elif j == 1:
            v[k] = rng.choice(ODD)
        elif j == 2:
            v[k + rng.choice(["", "_", "\u00e9"])] = rng.choice(ODD)
        else:
            v[k] = mutate_json_value(rng, v[k], depth + 1)
        return v
    if isinstance(v, list) and v and rng.random() < 0.85:
        i = rng.randrange(len(v))
        j = rng.randrange(5)
        if j == 0:
            del v[i]
        elif j == 1:
            v.insert(i, rng.choice(ODD))
        elif j == 2:
            v[i] = rng.choice(ODD)
        else:
            v[i] = mutate_json_value(rng, v[i], depth + 1)
        return v
    if isinstance(v, bool):
        return rng.choice(ODD)
    if isinstance(v, int):
        return rng.choice([v + 1, v - 1, -v, v * 2 ** 20, 0, 2 ** 64, rng.choice(ODD)])
    if isinstance(v, float):
        return rng.choice([v * 1e300, -v, 0.0, rng.choice(ODD)])
    return rng.choice(ODD)


def mutate_text(rng, b):
    """byte-level: truncate, flip, duplicate a key, deep nesting"""
    b = bytearray(b)
    j = rng.randrange(5)
    if j == 0 and b:
        return bytes(b[:rng.randrange(len(b))])
    if j == 1:
        for _ in range(rng.randrange(1, 8)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if j == 2 and len(b) > 2:  # a key twice
        i = b.find(b'"', 1)
        return bytes(b[:1] + b[1:i + 1] + b'0":1,' + b[1:]) if i > 0 else bytes(b)
    if j == 3:
        return b"[" * 100000 + b"]" * 100000
    return bytes(b) + bytes(rng.randbytes(rng.randrange(1, 16)))


def json_case(rng, text):
    if rng.random() < 0.65:
        try:
            v = json.loads(text)
            for _ in range(rng.randrange(1, 4)):
                v = mutate_json_value(rng, v)
            return json.dumps(v, ensure_ascii=rng.random() < 0.5).encode()
        except (ValueError, TypeError, OverflowError, RecursionError):
            pass
    return mutate_text(rng, text)


def st_case(rng, blob):
    """a safetensors file: mutated header JSON (length fixed up, or not)"""
    n = struct.unpack("<Q", blob[:8])[0]
    hdr, data = blob[8:8 + n], blob[8 + n:]
    j = rng.randrange(4)
    if j == 0:  # the length itself
        n2 = rng.choice([0, 1, 7, n - 1, n + 1, len(blob), 2 ** 63, 2 ** 64 - 1, 100 * 2 ** 20])
        return struct.pack("<Q", n2) + hdr + data
    if j == 1:  # truncated file
        return blob[:rng.randrange(len(blob))]
    h2 = json_case(rng, hdr)
    return struct.pack("<Q", len(h2)) + h2 + data


class Runner:
    def __init__(self, tmp):
        self.tmp = tmp
        self.n = self.crashes = self.hangs = self.undocumented = self.silent = 0
        self.by_cmd = {}

    def __call__(self, what, argv, files, timeout=20):
        self.n += 1
        t0 = time.monotonic()
        try:
            r = subprocess.run([BIN, *argv], capture_output=True, text=True, errors="replace", timeout=timeout,
                               stdin=subprocess.DEVNULL)
            rc, err = r.returncode, r.stderr
        except subprocess.TimeoutExpired:
            rc, err = "hang", ""
        dt = time.monotonic() - t0
        c = self.by_cmd.setdefault(what, {"cases": 0, "exits": {}, "max_s": 0.0})
        c["cases"] += 1
        c["exits"][str(rc)] = c["exits"].get(str(rc), 0) + 1
        c["max_s"] = max(c["max_s"], dt)
        bad = None
        if rc == "hang":
            self.hangs += 1
            bad = "hang"
        elif rc < 0:
            self.crashes += 1
            bad = f"signal {-rc}"
        elif rc not in DOCUMENTED:
            self.undocumented += 1
            bad = f"exit {rc}"
        elif rc != 0 and not err.strip():
            self.silent += 1
            bad = "no reason on stderr"
        if bad:
            print(f"BAD {what}: {bad}: {' '.join(argv)}\n{err[-500:]}", flush=True)
            if KEEP:
                d = os.path.join(KEEP, f"{what}-{self.n}")
                os.makedirs(d, exist_ok=True)
                for f in files:
                    shutil.copy(f, d)
        return rc


def main():
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
        return 77
    rng = random.Random(SEED)
    tmp = tempfile.mkdtemp(prefix="shoal-fuzzfiles-")
    os.chmod(tmp, 0o700)
    run = Runner(tmp)
    try:
        model = os.path.join(tmp, "m")
        shutil.copytree(TINY, model)
        idx_path = os.path.join(model, "model.safetensors.index.json")
        cfg_path = os.path.join(model, "config.json")
        idx_text, cfg_text = open(idx_path, "rb").read(), open(cfg_path, "rb").read()
        shards = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
        shard_blobs = {f: open(os.path.join(model, f), "rb").read() for f in shards}
        # a cluster, its plan and worker w0's pack
        cl = {"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
              "hosts": [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 2, "expert_ram": 0},
                        {"name": "w0", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                         "expert_ram": "2MiB"}]}
        cl_path, plan_path, pack = (os.path.join(tmp, x) for x in ("cluster.json", "plan.json", "pack"))
        json.dump(cl, open(cl_path, "w"))
        r1 = subprocess.run([BIN, "plan", "--model", TINY, "--cluster", cl_path, "-o", plan_path],
                            capture_output=True, text=True, timeout=60)
        r2 = subprocess.run([BIN, "pack", "--model", TINY, "--plan", plan_path, "--worker", "w0", "-o", pack,
                             "--quiet"], capture_output=True, text=True, timeout=120)
        if not R.check("set-up: plan and pack of the tiny model", r1.returncode == 0 and r2.returncode == 0,
                       r1.stderr[-300:] + r2.stderr[-300:]):
            return 1
        cl_text, plan_text = open(cl_path, "rb").read(), open(plan_path, "rb").read()
        pm_path = os.path.join(pack, "shoal-pack.json")
        pm_text = open(pm_path, "rb").read()
        mut_cl, mut_plan = os.path.join(tmp, "cl-mut.json"), os.path.join(tmp, "plan-mut.json")
        ep = f"ipc://{tmp}/never.sock"

        def model_cmds(files):
            k = rng.randrange(3)
            if k == 0:
                run("inspect", ["inspect", model], files)
            elif k == 1:
                run("run", ["run", "--model", model, "--ids", "1,2", "--gen", "1"], files)
            else:
                run("expert --print-fingerprint", ["expert", "--model", model, "--print-fingerprint"], files)

        kinds = ["safetensors", "index", "config", "cluster", "plan", "pack"]
        t0 = time.monotonic()
        while run.n < CASES and time.monotonic() - t0 < SECONDS:
            kind = kinds[run.n % len(kinds)]
            if kind == "safetensors":
                f = rng.choice(shards)
                p = os.path.join(model, f)
                open(p, "wb").write(st_case(rng, shard_blobs[f]))
                model_cmds([p])
                open(p, "wb").write(shard_blobs[f])
            elif kind == "index":
                open(idx_path, "wb").write(json_case(rng, idx_text))
                model_cmds([idx_path])
                open(idx_path, "wb").write(idx_text)
            elif kind == "config":
                open(cfg_path, "wb").write(json_case(rng, cfg_text))
                model_cmds([cfg_path])
                open(cfg_path, "wb").write(cfg_text)
            elif kind == "cluster":
                open(mut_cl, "wb").write(json_case(rng, cl_text))
                run("plan --cluster", ["plan", "--model", TINY, "--cluster", mut_cl, "-o",
                                       os.path.join(tmp, "out-plan.json"), "--inventory",
                                       os.path.join(tmp, "inv.yml")], [mut_cl])
            elif kind == "plan":
                open(mut_plan, "wb").write(json_case(rng, plan_text))
                run("expert --plan", ["expert", "--model", TINY, "--plan", mut_plan, "--name", "w0", "--listen", ep,
                                      "--verify"], [mut_plan])
            else:
                open(pm_path, "wb").write(json_case(rng, pm_text))
                run("expert --verify (pack)", ["expert", "--model", pack, "--verify", "--print-fingerprint"],
                    [pm_path])
                open(pm_path, "wb").write(pm_text)
        dt = time.monotonic() - t0
        # FIFOs in place of each kind of file (item 6): refused, never a hang
        fifo_ok = True
        for p, argv in ((os.path.join(model, shards[0]), ["inspect", model]),
                        (idx_path, ["inspect", model]), (cfg_path, ["run", "--model", model, "--ids", "1", "--gen", "1"]),
                        (mut_cl, ["plan", "--model", TINY, "--cluster", mut_cl, "-o", os.path.join(tmp, "o.json")]),
                        (mut_plan, ["expert", "--model", TINY, "--plan", mut_plan, "--name", "w0", "--listen", ep]),
                        (pm_path, ["expert", "--model", pack, "--verify", "--print-fingerprint"])):
            keep = open(p, "rb").read() if os.path.exists(p) else None
            os.unlink(p)
            os.mkfifo(p)
            rc = run("FIFO", argv, [], timeout=10)
            fifo_ok &= rc in (2, 3)
            os.unlink(p)
            if keep is not None:
                open(p, "wb").write(keep)
        print(f"file fuzz figures: {run.n} cases in {dt:.1f} s, seed {SEED}: crashes {run.crashes}, hangs "
              f"{run.hangs}, undocumented exits {run.undocumented}, failures without a reason {run.silent}")
        for k, v in sorted(run.by_cmd.items()):
            print(f"  {k}: {v['cases']} cases, exits {v['exits']}, slowest {v['max_s']:.2f} s")
        R.check("FIFO in place of a shard, the index, config.json, a cluster manifest, a plan, a pack manifest: "
                "refused (exit 2 or 3), no hang", fifo_ok)
        R.check(f"{run.n} mutated files: no crash (signal)", run.crashes == 0, f"{run.crashes}")
        R.check("no hang (every case ended within 20 s)", run.hangs == 0, f"{run.hangs}")
        R.check("every exit code in the documented set (0, 2, 3, 4)", run.undocumented == 0, f"{run.undocumented}")
        R.check("every failure printed a reason on stderr", run.silent == 0, f"{run.silent}")
        R.check("every target was exercised", len([k for k in run.by_cmd if k != "FIFO"]) == 6, str(list(run.by_cmd)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{R.counts['PASS']} passed, {R.counts['FAIL']} failed, {R.counts['SKIP']} skipped")
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
