#!/usr/bin/env python3
"""Structured outputs against an anchor (issue 36): llguidance (PyPI wheel,
the Rust library behind vLLM/SGLang's guidance backend) and shoal's matcher
on the same JSON schemas, the same token walks and K3's real vocabulary
(tiktoken.model, 163,840 ids). Not part of CI (llguidance is not in
tools/requirements.txt); run by hand:

  python3 -m venv V && V/bin/pip install llguidance==1.9.1 tiktoken==0.14.0 numpy jsonschema
  V/bin/python tests/bench/constrain_anchor.py K3_DIR OUT.json [N_GENERATED] [ROUNDS]

Walks: build/tests/bench_constrain_walk draws them over shoal's masks (so
every id is one shoal allows; whitespace-only tokens avoided, since
llguidance refuses whitespace around the document where shoal allows up to
16 bytes) and writes each step's mask and its CPU time. A walk whose next id
llguidance refuses stops being compared (counted).
llguidance replays each walk: at every step its mask is computed (timed:
the thread's CPU time of fill_next_token_bitmask, Python call included) and
compared with shoal's on the ordinary ids (specials left out): equal sets,
shoal's a subset (shoal accepts a documented subset: declared property order,
at most 16 whitespace bytes in a row, bounded digits), or ids shoal allows
that llguidance refuses (counted, with examples). Timing rounds alternate
shoal / llguidance (interleaved) on the same walks; the spread is over
rounds. Whitespace: llguidance with whitespace_flexible (any JSON
whitespace), the closer of its policies to shoal's."""
import json
import os
import random
import statistics
import subprocess
import sys
import time

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SRC, "tools"))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
import k3_oracle  # noqa: E402
import llguidance  # noqa: E402
import llguidance.numpy as lnp  # noqa: E402
import llguidance.tiktoken as ltk  # noqa: E402
import numpy as np  # noqa: E402

WALK = os.path.join(SRC, "build", "tests", "bench_constrain_walk")
V = 163840
N_ORD = 163584  # ids below are ordinary (ranks); above: specials


def fixed_schemas():
    # the schemas constrain_bench.py decodes with (the 20 fields of tests/bench/bench_constrain.c; a tree)
    from constrain_bench import REC, f20_schema
    return [("json_object", None), ("schema_20_fields", f20_schema()), ("schema_recursive", REC)]


def run_ours(k3, schemas, walks, steps, seed, masks):
    inp = "".join(json.dumps(s) + "\n" for _, s in schemas)
    p = subprocess.run([WALK, k3, str(walks), str(steps), str(seed), masks, "nows"], input=inp, capture_output=True,
                       text=True, check=True)
    return [json.loads(line) for line in p.stdout.splitlines()]


def main():
    k3, out = sys.argv[1], sys.argv[2]
    n_gen = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    import test_constrain as TC
    r = random.Random(4)
    schemas = fixed_schemas() + [(f"gen_{k}", TC.gen_recursive(r) if k % 5 == 4 else TC.gen_schema(r))
                                 for k in range(n_gen)]
    tok = k3_oracle.KimiTokenizer(k3)
    eos = tok.names and [i for i, n in tok.names.items() if n == "[EOS]"][0]
    t0 = time.time()
    llt = ltk.lltokenizer_from_encoding(tok.enc, n_vocab=V, eos_token=eos)
    ll_tok_s = time.time() - t0
    grammars, compile_us = {}, {}
    for name, s in schemas:
        t = time.thread_time_ns()
        g = llguidance.LLMatcher.grammar_from_json_schema(s if s is not None else {"type": "object"},
                                                          defaults={"whitespace_flexible": True})
        m = llguidance.LLMatcher(llt, g)
        compile_us[name] = (time.thread_time_ns() - t) / 1e3
        if m.is_error():
            compile_us[name] = None
            continue
        grammars[name] = g
    keep = [(n, s) for n, s in schemas if n in grammars]
    masks = os.path.join(os.path.dirname(os.path.abspath(out)), "constrain_anchor_masks.bin")
    per_round = []
    agree = {"steps": 0, "equal": 0, "subset": 0, "ours_not_ll": 0, "ours_not_ll_del_or_solidus": 0,
             "ours_not_ll_whitespace": 0, "ours_not_ll_document_whitespace_or_del_solidus": 0,
             "ours_not_ll_forced_text_split": 0, "ours_not_ll_other": 0,
             "ll_refused_walk_id": 0, "examples": [],
             "ours_allowed_mean": 0.0, "ll_allowed_mean": 0.0}
    bm = lnp.allocate_token_bitmask(1, V)
    rowb = (V + 7) // 8
    for rd in range(rounds):
        res = run_ours(k3, keep, 2, 48, 11, masks)  # shoal's masks, timed in the driver
        ours_us = [u for line in res for w in line["walks"] for u in w["cpu_us"]]
        ll_us = []
        mf = open(masks, "rb") if rd == 0 else None
        for (name, _), line in zip(keep, res):
            for w in line["walks"]:
                m = llguidance.LLMatcher(llt, grammars[name])
                ok = True
                for k, u in enumerate(w["cpu_us"]):
                    t = time.thread_time_ns()
                    lnp.fill_next_token_bitmask(m, bm, 0)
                    ll_us.append((time.thread_time_ns() - t) / 1e3)
                    if mf:
                        ours = np.unpackbits(np.frombuffer(mf.read(rowb), np.uint8), bitorder="little")[:N_ORD]
                        if ok:
                            ll = np.unpackbits(bm.view(np.uint8).ravel(), bitorder="little")[:N_ORD]
                            agree["steps"] += 1
                            agree["ours_allowed_mean"] += int(ours.sum())
                            agree["ll_allowed_mean"] += int(ll.sum())
                            extra = np.nonzero(ours & ~ll)[0]
                            if not extra.size:
                                agree["subset"] += 1
                                agree["equal"] += int((ours == ll).all())
                            else:
                                agree["ours_not_ll"] += 1
                                tb = [tok.enc.decode_single_token_bytes(int(i)) for i in extra]
                                # RFC 8259 strings: DEL (0x7f) unescaped and the escape \/ are valid JSON;
                                # llguidance refuses both inside strings
                                ws = b" \t\n\r"

                                def explained(b):
                                    # DEL / \/ in a string; whitespace before the document (step 0) or
                                    # after it (a token ending in whitespace: between tokens both allow it)
                                    return (b"\x7f" in b or b"\\/" in b or (k == 0 and b[:1] in (b" ", b"\t", b"\n"))
                                            or b.rstrip(ws) != b)
                                if all(b"\x7f" in b or b"\\/" in b for b in tb):
                                    cls = "del_or_solidus"
                                elif all(b and not b.strip(ws) for b in tb):
                                    cls = "whitespace"  # around the document / between tokens
                                elif all(explained(b) for b in tb):
                                    cls = "document_whitespace_or_del_solidus"
                                elif (ll_forced := bytes(m.compute_ff_bytes())) and all(
                                        ll_forced.startswith(b) for b in tb):
                                    # llguidance forces these bytes and offers only its own tokenization of them
                                    cls = "forced_text_split"
                                else:
                                    cls = "other"
                                agree["ours_not_ll_" + cls] += 1
                                if sum(e["class"] == cls for e in agree["examples"]) < 10:
                                    agree["examples"].append({"class": cls, "schema": name, "step": k,
                                                              "text": tok.enc.decode(w["ids"][:k]),
                                        "ids_only_ours": [
                                        tok.enc.decode_single_token_bytes(int(i)).decode("utf-8", "replace")
                                        for i in extra[:6]], "n": int(extra.size)})
                    idk = w["ids"][k] if k < len(w["ids"]) else None
                    if idk is None or idk >= N_ORD:
                        continue
                    if ok and not m.consume_token(idk):
                        ok = False
                        agree["ll_refused_walk_id"] += 1
        if mf:
            mf.close()
        per_round.append({"round": rd, "ours_cpu_us": ours_us, "ll_cpu_us": ll_us})
        print(f"round {rd}: ours p50 {statistics.median(ours_us):.1f} us, llguidance p50 "
              f"{statistics.median(ll_us):.1f} us over {len(ours_us)}/{len(ll_us)} steps", flush=True)
    if agree["steps"]:
        agree["ours_allowed_mean"] /= agree["steps"]
        agree["ll_allowed_mean"] /= agree["steps"]

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]

    summary = {"machine": "AMD EPYC 2 cores, AVX-512F + AVX512-BF16, no AMX (shared, loaded)",
               "loadavg_start_end": None, "llguidance": llguidance.__version__ if hasattr(llguidance, "__version__")
               else "1.9.1", "ll_tokenizer_build_s": ll_tok_s, "schemas": len(schemas), "compiled_by_ll": len(keep),
               "ll_compile_us": compile_us, "agreement": agree,
               "rounds": [{"ours_p50": pct(x["ours_cpu_us"], .5), "ours_p99": pct(x["ours_cpu_us"], .99),
                           "ll_p50": pct(x["ll_cpu_us"], .5), "ll_p99": pct(x["ll_cpu_us"], .99),
                           "steps": len(x["ours_cpu_us"])} for x in per_round]}
    summary["loadavg"] = os.getloadavg()
    with open(out, "w") as f:
        json.dump({"summary": summary, "raw": per_round}, f)
    os.unlink(masks)
    print(json.dumps(summary, indent=1)[:4000])


if __name__ == "__main__":
    main()
