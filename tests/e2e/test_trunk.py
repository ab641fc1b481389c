#!/usr/bin/env python3
"""Trunk rows on the expert servers (issue 16, milestone 1), with real
processes over ipc:// (proto/PROTOCOL.md §3.7, §7.1):

- determinism gate: `shoal run --json --dump-logits` token ids and logits
  byte-identical between the in-process trunk (the reference: the engine's own
  path, checked against the Python reference by test_engine_ref) and
  `--trunk remote` on 1 and 2 trunk servers, contiguous uneven and interleaved
  row splits, mixed (some matrices remote, the rest local), with and without
  routed experts on the same workers, on both tiny models; each remote run must
  really have gone remote (matrices and round trips counted in its JSON);
- coverage: rows owned by no worker refused at start (exit 3) naming the gap;
  `--trunk remote` without any worker announcing trunk rows refused;
- failure: a trunk server SIGKILLed mid-run makes the run fail (exit 4) within
  its deadline naming that worker; never a hang.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: about
20 s (SHOAL_TRUNK_CASES=N runs only the first N determinism configurations).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODELS = [os.path.join(SRC, "tests", "models", m) for m in ("tiny-k3", "tiny-k3-plain")]
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts
tmp = tempfile.mkdtemp(prefix="shoal-trunk-")
procs = []
nep = [0]


def moe_range(model):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    return f"{c['first_k_dense_replace']}-{c['num_hidden_layers'] - 1}:0-{c['num_experts'] - 1}"


def worker(model, experts=None, trunk=None, extra=()):
    nep[0] += 1
    ep = f"ipc://{tmp}/w{nep[0]}"
    args = [BIN, "expert", "--model", model, "--listen", ep, "--threads", "1"] + list(extra)
    if experts:
        args += ["--experts", experts]
    if trunk:
        args += ["--trunk", trunk]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/w{nep[0]}.log", "w"))
    procs.append(p)
    return ep, p


def run(model, eps, trunk=None, gen=6, timeout=60, extra=()):
    out = f"{tmp}/logits{time.monotonic_ns()}.bin"
    args = [BIN, "run", "--model", model, "--ids", "5,17,3,99,42,7", "--gen", str(gen), "--json",
            "--dump-logits", out, "--hello-timeout-ms", "10000"] + list(extra)
    for e in eps:
        args += ["--worker", e]
    if trunk:
        args += ["--trunk", trunk]
    t0 = time.monotonic()
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    dt = time.monotonic() - t0
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    logits = open(out, "rb").read() if os.path.exists(out) else b""
    return r.returncode, j, logits, r.stderr, dt


def stop_all():
    for p in procs:
        harness.terminate(p, 5)
    procs.clear()


def configs(model):
    ex = moe_range(model)
    return [
        ("1 trunk server, all rows; experts on another", [(ex, None), (None, "*:all")]),
        ("2 trunk servers, uneven split (1/3 + 2/3)", [(ex, None), (None, "*:0/3"), (None, "*:1/3,*:2/3")]),
        # thirds: tiny-k3-plain's b_proj has 3 rows; lm_head interleaved in 64-row stripes besides
        ("2 trunk servers, interleaved (thirds 0+2 / 1; lm_head in 64-row stripes)",
         [(ex, None), (None, "model.*:0/3,model.*:2/3," + ",".join(f"lm_head.weight:{a}-{a + 63}"
                                                               for a in range(0, 4096, 128))),
          (None, "model.*:1/3," + ",".join(f"lm_head.weight:{a}-{a + 63}" for a in range(64, 4096, 128)))]),
        ("2 workers with routed experts and trunk halves", [(ex.split(":")[0] + ":0-3", "*:0/2"),
                                                            (ex.split(":")[0] + ":4-" + ex.split("-")[-1], "*:1/2")]),
        ("mixed: only the dense MLP, the shared experts and lm_head remote",
         [(ex, "model.layers.*.mlp.*:all,*shared_experts*:0/2,lm_head.weight:0/2"),
          (None, "*shared_experts*:1/2,lm_head.weight:1/2")]),
        ("overlapping owners (every row owned twice)", [(ex, "*:all"), (None, "*:all")]),
    ]


def case_determinism():
    limit = int(os.environ.get("SHOAL_TRUNK_CASES", "100"))
    for model in MODELS:
        name = os.path.basename(model)
        rc, ref, ref_logits, err, _ = run(model, [])
        if not check(f"{name}: in-process reference run", rc == 0 and ref and len(ref_logits) > 0, err[-300:]):
            continue
        for label, spec in configs(model)[:limit]:
            eps = []
            try:
                for experts, trunk in spec:
                    eps.append(worker(model, experts, trunk)[0])
                rc, j, lg, err, _ = run(model, eps, "remote")
                ok = rc == 0 and j is not None
                why = err[-400:] if not ok else ""
                if ok:
                    same_ids = j["generated_ids"] == ref["generated_ids"]
                    same_logits = lg == ref_logits
                    went = j.get("trunk_remote_matrices", 0) > 0 and j.get("decode_trunk_round_trips_per_token", 0) > 0
                    ok = same_ids and same_logits and went
                    why = (f"ids {j['generated_ids']} vs {ref['generated_ids']}, logits identical {same_logits}, "
                           f"remote matrices {j.get('trunk_remote_matrices')}, round trips/token "
                           f"{j.get('decode_trunk_round_trips_per_token')}")
                check(f"{name}: {label}: ids and logits bit-identical to in-process", ok, why)
            finally:
                stop_all()


def kda_layers(model):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    return len(c["linear_attn_config"]["kda_layers"])


def case_chain():
    """Proto 1.4 chains (PROTOCOL.md §3.7): with f_a held whole by every
    worker that computes f_b rows, f_b(f_a(xn)) rides in the KDA layer's first
    request: one round trip fewer per KDA layer, the same bits."""
    for model in MODELS:
        name = os.path.basename(model)
        ex = moe_range(model)
        rc, ref, ref_logits, err, _ = run(model, [])
        if not check(f"{name}: chain: in-process reference run", rc == 0 and ref, err[-300:]):
            continue
        rts = {}
        for label, specs in (("halves", ["*:0/2", "*:1/2"]),
                             ("halves + f_a whole on both", ["*:0/2,*.f_a_proj.weight:all",
                                                             "*:1/2,*.f_a_proj.weight:all"]),
                             # the second computes f_b rows without holding f_a whole
                             ("f_a on one, f_b on the other (no chain possible)",
                              ["*:0/2,*.f_a_proj.weight:all", "*:1/2"])):
            eps = [worker(model, ex)[0]]
            try:
                for t in specs:
                    eps.append(worker(model, None, t)[0])
                rc, j, lg, err, _ = run(model, eps, "remote")
                ok = rc == 0 and j is not None and j["generated_ids"] == ref["generated_ids"] and lg == ref_logits
                rts[label] = j.get("decode_trunk_round_trips_per_token") if j else None
                check(f"{name}: chain: {label}: ids and logits bit-identical to in-process", ok,
                      err[-400:] if not j else f"ids {j['generated_ids']} vs {ref['generated_ids']}")
            finally:
                stop_all()
        a, b, c = (rts.get(k) for k in ("halves", "halves + f_a whole on both",
                                        "f_a on one, f_b on the other (no chain possible)"))
        n = kda_layers(model)
        check(f"{name}: chain: one round trip fewer per KDA layer ({n} layers): {a} -> {b} per token",
              a is not None and b is not None and abs((a - b) - n) < 1e-9, f"{a} -> {b}")
        check(f"{name}: chain: not used where an f_b owner lacks f_a: {c} round trips per token (as without)",
              c is not None and a is not None and abs(c - a) < 1e-9, f"{c} vs {a}")


def case_coverage():
    model = MODELS[0]
    ex = moe_range(model)
    try:
        e1, _ = worker(model, ex, "*:0/2")
        rc, _, _, err, _ = run(model, [e1], "remote")
        check("rows owned by no worker: refused (exit 3) naming the gap", rc == 3 and "owned by no worker" in err
              and "rows" in err, f"rc {rc}: {err[-300:]}")
        rc, j, _, err, _ = run(model, [e1], "local")
        check("--trunk local ignores the announcement", rc == 0 and j and j.get("trunk_remote_matrices") == 0,
              f"rc {rc}: {err[-300:]}")
    finally:
        stop_all()
    try:
        e2, _ = worker(model, ex)
        rc, _, _, err, _ = run(model, [e2], "remote")
        check("--trunk remote with no trunk rows announced: refused (exit 3)",
              rc == 3 and "no worker announces trunk rows" in err, f"rc {rc}: {err[-300:]}")
        rc, j, _, err, _ = run(model, [e2], "auto")
        check("--trunk auto with no trunk rows announced: local", rc == 0 and j and j.get("trunk_remote_matrices") == 0,
              f"rc {rc}: {err[-300:]}")
    finally:
        stop_all()


def case_killed():
    model = MODELS[0]
    ex = moe_range(model)
    try:
        e1, _ = worker(model, ex)
        e2, p2 = worker(model, None, "*:all", extra=["--test-delay-ms", "20", "--id", "trunk-victim"])
        # kill the victim once it holds a TRUNK_BATCH mid-run (the test hook's log line, after the first 40 of
        # them: past HELLO and the first tokens; waited for up to 60 s)
        vlog = f"{tmp}/w{nep[0]}.log"

        def held():
            with open(vlog) as f:
                return f.read().count("test delay: TRUNK_BATCH") >= 40

        def kill_mid_run():
            harness.poll(held, 60, 0.02)
            os.kill(p2.pid, signal.SIGKILL)
        killer = threading.Thread(target=kill_mid_run, daemon=True)
        killer.start()
        rc, _, _, err, dt = run(model, [e1, e2], "remote", gen=400, timeout=60,
                                extra=["--expert-timeout-ms", "3000", "--max-context", "512"])
        killer.join()
        check("trunk server SIGKILLed mid-run: the run fails (exit 4) naming it, within the deadline",
              rc == 4 and "trunk-victim" in err and dt < 60 + 3 + 10, f"rc {rc} after {dt:.1f} s: {err[-400:]}")
    finally:
        stop_all()


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    try:
        case_determinism()
        case_chain()
        case_coverage()
        case_killed()
    finally:
        stop_all()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
