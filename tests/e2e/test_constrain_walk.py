#!/usr/bin/env python3
"""The 1,000-schema property test of structured outputs (issue 36), offline.

test_constrain.py's generator (every supported keyword, nested, recursive
through $defs) makes SHOAL_CONSTRAIN_WALK_SCHEMAS schemas (default 1,000);
build/tests/bench_constrain_walk compiles each and runs random token walks
over the mask of a real vocabulary (no server, no model: the walk draws among
the allowed ids, so it explores far more of each schema's states than a
model's favourite paths). Oracle: Python's jsonschema. Cases:
  walk/<vocab>/compile  every generated schema compiles (the generator emits
                        only supported keywords)
  walk/<vocab>/<k>      every walk that took the end id is JSON that validates
                        against schema k; every walk cut at the step limit is a
                        prefix of JSON text (the scanner of test_constrain.py);
                        no mask came out empty
Vocabularies: k3-nano's (4,096 ids) for all schemas, 2 walks each; K3's
real tiktoken.model (163,840 ids) for every 50th schema when it is beside the
checkout. The end-to-end subset (through `shoal serve` and a model) stays in
test_constrain.py. Failures print the schema and the text."""
import json
import os
import random
import subprocess
import sys
import time

SRC = os.environ.get("SHOAL_SRC", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
import harness  # noqa: E402
import test_constrain as TC  # noqa: E402  (the generator and the oracles)

R = harness.Recorder("test_constrain_walk")
WALK = os.path.join(BUILD, "tests", "bench_constrain_walk")
N = int(os.environ.get("SHOAL_CONSTRAIN_WALK_SCHEMAS", "1000"))


def utf8_prefix(b):
    """bytes cut at a step limit may end inside a character: drop that tail"""
    for cut in range(4):
        try:
            return b[:len(b) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def run(label, tok_dir, schemas, idx, walks, steps, seed):
    inp = "".join(json.dumps(schemas[k]) + "\n" for k in idx)
    t0 = time.time()
    p = subprocess.run([WALK, tok_dir, str(walks), str(steps), str(seed)], input=inp, capture_output=True,
                       text=True, timeout=300)
    if not R.check(f"walk/{label}/driver", p.returncode == 0, p.stderr[-500:]):
        return
    lines = p.stdout.splitlines()
    if not R.check(f"walk/{label}/lines", len(lines) == len(idx), f"{len(lines)} lines for {len(idx)} schemas"):
        return
    bad_compile, fails, ends, cuts = [], 0, 0, 0
    for k, line in zip(idx, lines):
        out = json.loads(line)
        if out["compile"] != "ok":
            bad_compile.append(f"{k}: {out['compile']} {json.dumps(schemas[k])}"[:300])
            continue
        for w in out["walks"]:
            raw = bytes.fromhex(w["hex"])
            why = None
            if w["dead"]:
                why = "a mask came out empty"
            elif w["end"]:
                ends += 1
                try:
                    why = TC.validate(schemas[k], json.loads(raw.decode("utf-8"))) or None
                except ValueError as e:
                    why = f"not JSON ({e})"
            else:
                cuts += 1
                text = utf8_prefix(raw)
                if text is None or not TC.json_prefix_ok(text):
                    why = "a cut walk is no JSON prefix"
            if why:
                fails += 1
                R.record("FAIL", f"walk/{label}/{k}", f"{why}: {raw[:300]!r} schema {json.dumps(schemas[k])}"[:900])
    R.check(f"walk/{label}/compile", not bad_compile, "; ".join(bad_compile[:3]))
    R.check(f"walk/{label}/valid", fails == 0, f"{fails} walks failed (listed above)")
    R.check(f"walk/{label}/finished_some", ends >= len(idx) * walks // 3, f"{ends} complete walks, {cuts} cut")
    print(f"  {label}: {len(idx)} schemas, {ends} complete walks validated, {cuts} cut walks checked as "
          f"prefixes, {time.time() - t0:.1f} s", flush=True)


def main():
    if TC.jsonschema is None:
        R.record("SKIP", "all", "python jsonschema missing (tools/requirements.txt; scripts/deps.sh installs it)")
        return 77
    if not os.path.exists(WALK):
        R.record("FAIL", "driver", f"{WALK} is not built")
        return 1
    r = random.Random(1000)
    schemas = [TC.gen_recursive(r) if k % 5 == 4 else TC.gen_schema(r) for k in range(N)]
    run("nano", TC.NANO, schemas, list(range(N)), 2, 160, 1)
    real = TC.real_dir()
    if not real:
        R.record("SKIP", "walk/real_vocab", "K3's real vocabulary is not beside the checkout "
                 "(../shared/k3/tiktoken.model; SHOAL_K3_TOKENIZER_DIR)")
    else:
        run("real_vocab", real, schemas, list(range(0, N, 50)), 1, 80, 2)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
