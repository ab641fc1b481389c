"""`shoal run --trace` on tests/models/tiny-k3: the trace (read here with an
independent Python reader of the format in docs/METRICS.md) holds exactly one
record per (token, MoE layer), k ascending experts each; the same routing
whatever the thread count and prefill chunking; the routing decisions of a
prefill equal the reference's (tests/fixtures/*/hidden.json), in-process
and with two expert servers; `shoal trace stats` agrees;
and the run report carries the per-token phase breakdown."""
import json
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promcheck  # noqa: E402

R = promcheck.Results("test_run_trace")
src = os.environ.get("SHOAL_SRC", ".")
shoal = os.environ.get("SHOAL_BIN", "build/bin/shoal")
model = os.path.join(src, "tests", "models", "tiny-k3")
cfg = json.load(open(os.path.join(model, "config.json")))
tc = cfg.get("text_config", cfg)
L, E, K = tc["num_hidden_layers"], tc["num_experts"], tc["num_experts_per_token"]
fk, freq = tc["first_k_dense_replace"], tc["moe_layer_freq"]
moe = [l for l in range(L) if l >= fk and (l - fk) % freq == 0]
PROMPT, GEN = [1, 2, 3, 4, 5], 6
NTOK = len(PROMPT) + GEN - 1  # the last generated token is never run

tmp = tempfile.mkdtemp(prefix="shoal_run_trace_")


def read_trace(path):
    b = open(path, "rb").read()
    assert b[:8] == b"SHOALRT\0", b[:8]
    major, minor, hb, nl, ne, k, rb = struct.unpack_from("<HHIIIII", b, 8)
    assert (major, minor, hb, nl, ne, k, rb) == (1, 0, 64, L, E, K, 8 + 2 * K), (major, minor, hb, nl, ne, k, rb)
    assert (len(b) - hb) % rb == 0, "partial record"
    recs = []
    for off in range(hb, len(b), rb):
        tok, layer, n = struct.unpack_from("<IHH", b, off)
        ex = list(struct.unpack_from(f"<{K}H", b, off + 8))
        recs.append((tok, layer, n, ex))
    return b[32:64], recs


def run(trace, *extra):
    p = subprocess.run([shoal, "run", "--model", model, "--ids", ",".join(map(str, PROMPT)), "--gen", str(GEN),
                        "--trace", trace, "--json", *extra], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    return json.loads(p.stdout)


out = {}


def one_record_per_token_and_layer():
    t = os.path.join(tmp, "a.trace")
    out["json"] = run(t, "--threads", "1")
    fp, recs = read_trace(t)
    out["a"] = recs
    assert fp != bytes(32), "fingerprint missing"
    assert len(recs) == NTOK * len(moe), (len(recs), NTOK, len(moe))
    seen = set()
    for tok, layer, n, ex in recs:
        assert n == K and layer in moe and 0 <= tok < NTOK, (tok, layer, n)
        assert ex == sorted(set(ex)) and all(e < E for e in ex), ex
        assert (tok, layer) not in seen, (tok, layer)
        seen.add((tok, layer))


R.check("one_record_per_token_and_moe_layer", one_record_per_token_and_layer)


def same_routing_any_threads_and_chunking():
    t = os.path.join(tmp, "b.trace")
    run(t, "--threads", "2", "--batch", "2")
    _, recs = read_trace(t)
    # chunking reorders records (chunk by chunk, layer-major) but not decisions
    assert sorted(recs) == sorted(out["a"]), "routing differs with --threads 2 --batch 2"
    # chunks of 2: the first record block is layer moe[0] for tokens 0, 1
    assert [r[:2] for r in recs[:3]] == [(0, moe[0]), (1, moe[0]), (0, moe[1])], recs[:3]


R.check("same_routing_any_threads_and_chunking", same_routing_any_threads_and_chunking)


def trace_stats_agrees():
    p = subprocess.run([shoal, "trace", "stats", os.path.join(tmp, "a.trace")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    want = f"records {NTOK * len(moe)}, tokens {NTOK}, pairs {NTOK * len(moe) * K}"
    assert want in p.stdout, (want, p.stdout[:500])
    # the hottest expert line equals the maximum count computed here
    hits = {}
    for tok, layer, n, ex in out["a"]:
        for e in ex:
            hits[(layer, e)] = hits.get((layer, e), 0) + 1
    top = max(hits.values())
    line = p.stdout.split("hottest experts")[1].strip().split("\n")[2].split()
    assert int(line[2]) == top and hits[(int(line[0]), int(line[1]))] == top, (line, top)


R.check("trace_stats_agrees", trace_stats_agrees)


def phase_breakdown():
    ph = out["json"].get("decode_phase_ms_per_token")
    assert ph is not None, "no decode_phase_ms_per_token"
    assert set(ph) == {"attention", "routing", "experts", "shared", "combine", "dense", "head", "sampling"}, ph
    assert all(v >= 0 for v in ph.values()), ph
    assert ph["attention"] > 0 and ph["experts"] > 0 and ph["head"] > 0, ph


R.check("decode_phase_breakdown", phase_breakdown)


def matches_reference(mname, *extra):
    """The trace of a prefill of tests/fixtures/<model>/hidden.json's ids holds
    exactly the reference's routed expert sets (tools/reference.py; the
    fixture is audited so that every routing decision is robust)."""
    def case():
        fx = json.load(open(os.path.join(src, "tests", "fixtures", mname, "hidden.json")))
        ids = fx["ids"]
        t = os.path.join(tmp, f"ref-{mname}.trace")
        p = subprocess.run([shoal, "run", "--model", os.path.join(src, "tests", "models", mname), "--ids",
                            ",".join(map(str, ids)), "--gen", "1", "--trace", t, "--json", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
        b = open(t, "rb").read()
        k = struct.unpack_from("<I", b, 24)[0]
        hb, rb = struct.unpack_from("<I", b, 12)[0], struct.unpack_from("<I", b, 28)[0]
        got = {}
        for off in range(hb, len(b), rb):
            tok, layer, n = struct.unpack_from("<IHH", b, off)
            got[(tok, layer)] = list(struct.unpack_from(f"<{n}H", b, off + 8))
        want = {}
        for ly in fx["layers"]:
            if ly["ffn"] == "moe":
                for tok, ex in enumerate(ly["experts"]):
                    want[(tok, ly["layer"])] = sorted(ex)
        assert len(want) == len(ids) * len([l for l in fx["layers"] if l["ffn"] == "moe"]) and k > 0
        bad = [(key, got.get(key), want[key]) for key in sorted(want) if got.get(key) != want[key]]
        assert not bad and len(got) == len(want), f"{len(bad)} of {len(want)} differ, e.g. {bad[:3]}"
    return case


R.check("routing_matches_reference_tiny_k3", matches_reference("tiny-k3"))
R.check("routing_matches_reference_tiny_k3_plain", matches_reference("tiny-k3-plain"))
R.check("routing_matches_reference_two_workers", matches_reference("tiny-k3", "--workers", "2"))
subprocess.run(["rm", "-rf", tmp])
R.finish()
