#!/usr/bin/env python3
"""The trunk determinism gate over CURVE tcp with 4 trunk servers (issue 16),
real processes on loopback (proto/PROTOCOL.md §3.7, §9; keys from `shoal
keygen`, every link encrypted and the worker keys pinned):

- tiny-k3 and tiny-k3-plain: `shoal run --json --dump-logits` token ids and
  logits byte-identical to the in-process trunk with 4 trunk servers in
  contiguous quarters (routed experts on a fifth worker), and in interleaved
  eighths (worker w owns *:w/8 and *:(w+4)/8) with the routed experts split
  over the same 4 workers; each remote run really went remote (matrices and
  round trips counted in its JSON) over tcp (the wire bytes counted);
- k3-scale (real K3 widths, tools/ensure_scale_model.sh into
  $SHOAL_BUILD/k3-scale): one configuration, 4 trunk servers in quarters with
  the routed experts on the first, same ids and logits; and the same with
  every KDA f_a whole on each server (the chain of PROTOCOL.md §3.7): same
  bits, one round trip fewer per KDA layer (12 -> 11 per token). SKIP (visible) when
  the model cannot be made here (no numpy, under 3 GB free) or
  SHOAL_TRUNK_TCP_SCALE=0.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~10 s
for the tiny models, ~20 s more for k3-scale once it exists.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk_tcp"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
MODELS = [os.path.join(SRC, "tests", "models", m) for m in ("tiny-k3", "tiny-k3-plain")]
SCALE = os.path.join(BUILD, "k3-scale")
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts
tmp = tempfile.mkdtemp(prefix="shoal-trunktcp-")
procs = []


def sh(*args, timeout=30):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


def key(n, ext):
    return os.path.join(tmp, f"{n}.{ext}")


def moe(model):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    return c["first_k_dense_replace"], c["num_hidden_layers"] - 1, c["num_experts"]


def shardable(model):
    """name -> rows of every row-shardable matrix (PROTOCOL.md §7.1's rule, from the headers)"""
    out = {}
    for fn in sorted(os.listdir(model)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(model, fn), "rb") as f:
                h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            for k, v in h.items():
                s = v["shape"] if k != "__metadata__" else []
                if k.startswith("language_model.") and len(s) == 2 and s[0] >= 2 and \
                        not (".experts." in k and "shared_experts" not in k) and \
                        not k.endswith("embed_tokens.weight") and not k.endswith("kv_b_proj.weight"):
                    out[k] = s[0]
    return out


def split(mats, nw, owner):
    """Per worker, a ROWSPEC of explicit row ranges: row r of an R-row matrix
    goes to worker owner(r, R) (so matrices with fewer rows than parts work)."""
    specs = [[] for _ in range(nw)]
    for name, rows in sorted(mats.items()):
        a = 0
        for r in range(1, rows + 1):
            if r == rows or owner(r, rows) != owner(a, rows):
                specs[owner(a, rows)].append(f"{name}:{a}-{r - 1}")
                a = r
    return [",".join(s) if s else None for s in specs]


def worker(model, i, experts, trunk, threads=1):
    port = harness.free_port()
    args = [BIN, "expert", "--model", model, "--listen", f"tcp://127.0.0.1:{port}", "--threads", str(threads),
            "--id", f"tw{i}", "--curve-secret", key(f"w{i}", "key"), "--curve-allow", key("coord", "pub")]
    if experts:
        args += ["--experts", experts]
    if trunk:
        args += ["--trunk", trunk]
    procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/w{i}.log", "a")))
    return f"tcp://127.0.0.1:{port}", key(f"w{i}", "pub")


def run(model, ws, ids="5,17,3,99,42,7", gen=6, threads=1, timeout=120):
    out = f"{tmp}/logits{time.monotonic_ns()}.bin"
    args = [BIN, "run", "--model", model, "--ids", ids, "--gen", str(gen), "--json", "--dump-logits", out,
            "--threads", str(threads), "--hello-timeout-ms", "30000", "--expert-timeout-ms", "60000"]
    if ws:
        args += ["--curve-secret", key("coord", "key"), "--trunk", "remote"]
    for ep, pub in ws:
        args += ["--worker", ep, "--worker-key", pub]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    return j, (open(out, "rb").read() if os.path.exists(out) else b""), r.stderr


def stop_all():
    for p in procs:
        harness.terminate(p, 5)
    procs.clear()


def gate(name, model, label, spec, ref, ref_lg, **kw):
    try:
        ws = [worker(model, i, ex, tr, kw.get("threads", 1)) for i, (ex, tr) in enumerate(spec)]
        j, lg, err = run(model, ws, **kw)
        ok = j is not None
        why = err[-500:]
        if ok:
            same = j["generated_ids"] == ref["generated_ids"] and lg == ref_lg and len(lg) > 0
            went = j.get("trunk_remote_matrices", 0) > 0 and j.get("decode_trunk_round_trips_per_token", 0) > 0 \
                and j.get("decode_trunk_wire_bytes_per_token", 0) > 0
            ok = same and went
            why = (f"ids {j['generated_ids']} vs {ref['generated_ids']}, logits identical {lg == ref_lg}, remote "
                   f"matrices {j.get('trunk_remote_matrices')}, round trips/token "
                   f"{j.get('decode_trunk_round_trips_per_token')}, trunk wire bytes/token "
                   f"{j.get('decode_trunk_wire_bytes_per_token')}")
        check(f"{name}: {label}: ids and logits bit-identical to in-process", ok, why)
        return j
    finally:
        stop_all()


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    for n in ["coord"] + [f"w{i}" for i in range(5)]:
        r = sh("keygen", "-o", os.path.join(tmp, n))
        if not check(f"keygen {n}", r.returncode == 0, r.stderr[-200:]):
            return 1
    try:
        for model in MODELS:
            name = os.path.basename(model)
            ref, ref_lg, err = run(model, [])
            if not check(f"{name}: in-process reference", ref is not None and len(ref_lg) > 0, err[-300:]):
                continue
            l0, l1, E = moe(model)
            mats = shardable(model)
            quarters = split(mats, 4, lambda r, R: r * 4 // R)
            gate(name, model, "CURVE tcp, 4 trunk servers in quarters, experts on a fifth",
                 [(None, quarters[w]) for w in range(4)] + [(f"{l0}-{l1}:0-{E - 1}", None)], ref, ref_lg)
            eighths = split(mats, 4, lambda r, R: (r * 8 // R) % 4)
            q = E // 4
            gate(name, model, "CURVE tcp, 4 trunk servers interleaved (eighths w and w+4), experts on the same",
                 [(f"{l0}-{l1}:{w * q}-{(w + 1) * q - 1 if w < 3 else E - 1}", eighths[w]) for w in range(4)],
                 ref, ref_lg)
        if os.environ.get("SHOAL_TRUNK_TCP_SCALE", "1") == "0":
            record("SKIP", "k3-scale", "SHOAL_TRUNK_TCP_SCALE=0")
        else:
            free = os.statvfs(BUILD)
            if not os.path.isdir(SCALE) and free.f_bavail * free.f_frsize < 3_000_000_000:
                record("SKIP", "k3-scale", f"less than 3 GB free in {BUILD}")
            else:
                g = subprocess.run(["bash", os.path.join(SRC, "tools", "ensure_scale_model.sh"), SCALE],
                                   env=dict(os.environ, SHOAL_PYTHON=os.environ.get("SHOAL_PYTHON", sys.executable)),
                                   capture_output=True, text=True)
                if g.returncode != 0:
                    record("SKIP" if "numpy" in g.stderr + g.stdout else "FAIL", "k3-scale model",
                           (g.stdout + g.stderr)[-400:])
                else:
                    ref, ref_lg, err = run(SCALE, [], gen=4, threads=2)
                    if check("k3-scale: in-process reference", ref is not None and len(ref_lg) > 0, err[-300:]):
                        l0, l1, E = moe(SCALE)
                        sm = shardable(SCALE)
                        quarters = split(sm, 4, lambda r, R: r * 4 // R)
                        j1 = gate("k3-scale", SCALE, "CURVE tcp, 4 trunk servers in quarters, experts on the first",
                                  [(f"{l0}-{l1}:0-{E - 1}" if w == 0 else None, quarters[w]) for w in range(4)],
                                  ref, ref_lg, gen=4, threads=2)
                        # the same with every KDA f_a whole on each: the chain of PROTOCOL.md §3.7
                        fa = ",".join(f"{n}:0-{r - 1}" for n, r in sorted(sm.items()) if n.endswith(".f_a_proj.weight"))
                        j2 = gate("k3-scale", SCALE, "CURVE tcp, quarters + f_a whole on each (chained f_a -> f_b)",
                                  [(f"{l0}-{l1}:0-{E - 1}" if w == 0 else None, quarters[w] + "," + fa)
                                   for w in range(4)], ref, ref_lg, gen=4, threads=2)
                        c = json.load(open(os.path.join(SCALE, "config.json")))
                        nk = len(c.get("text_config", c)["linear_attn_config"]["kda_layers"])
                        a = j1.get("decode_trunk_round_trips_per_token") if j1 else None
                        b = j2.get("decode_trunk_round_trips_per_token") if j2 else None
                        check(f"k3-scale: chained: one round trip fewer per KDA layer ({nk}): {a} -> {b} per token",
                              a is not None and b is not None and abs((a - b) - nk) < 1e-9, f"{a} -> {b}")
    finally:
        stop_all()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
