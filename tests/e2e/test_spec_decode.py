"""Speculative decoding through `shoal run` (issue 21): the same generated ids,
and the same logits byte for byte (--dump-logits), with drafting on as with
--draft off, for greedy and seeded sampling, on both tiny models, in-process
and with 2 local expert workers (--workers 2). Expected ids always come from
the --draft off run. Random-weight models never continue their prompt, so
the prompt-lookup drafter mostly misses there; hits are forced with
--draft-ids (testing: drafts from the plain run's own ids with an error
planted every 3rd token, so accepts and rejects alternate), and a prompt of
repeated code-like id runs makes the lookup draft (and miss) on real output.
The run's JSON draft stats must show the drafting that happened."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

R = harness.Recorder("test_spec_decode")
SRC = os.environ.get("SHOAL_SRC", ".")
BIN = os.environ.get("SHOAL_BIN", os.path.join("build", "bin", "shoal"))
GEN = 40

# a "source file" of repeated lines: runs of ids that recur with small edits
LINES = [[(17 * l + 5 * i) % 3800 + 10 for i in range(9)] for l in range(6)]
REPEAT = [t for rep in range(5) for l in LINES for t in (l if rep % 2 == 0 else l[:4] + [l[4] + 1] + l[5:])]
SHORT = [17, 256, 3000, 42, 42, 9, 1023, 4000, 5, 77]


def run(model, prompt, tmp, tag, *args):
    dump = os.path.join(tmp, tag + ".f32")
    cmd = [BIN, "run", "--model", model, "--json", "--threads", "1", "--gen", str(GEN), "--ids",
           ",".join(map(str, prompt)), "--dump-logits", dump, *map(str, args)]
    with harness.logfile() as log:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=120)
        log.seek(0)
        err = log.read().decode(errors="replace")
    doc = None
    if p.returncode == 0:
        try:
            doc = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    logits = open(dump, "rb").read() if os.path.exists(dump) else None
    return doc, logits, err


def main():
    if not os.path.exists(BIN):
        R.record("SKIP", "all", f"{BIN} not built")
        return 77
    samplers = [("greedy", []), ("seeded", ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"])]
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny-k3", "tiny-k3-plain"):
            model = os.path.join(SRC, "tests", "models", name)
            for sname, sargs in samplers:
                for pname, prompt in (("short", SHORT), ("repeated", REPEAT)):
                    case = f"{name} {sname} {pname}"
                    ref, ref_lg, err = run(model, prompt, tmp, "ref", "--draft", "off", *sargs)
                    if not R.check(f"{case}: --draft off runs", ref is not None, err[-400:]):
                        continue
                    want = ref["generated_ids"]
                    R.check(f"{case}: --draft off drafts nothing", ref["draft"]["drafted"] == 0 and
                            ref["draft"]["passes"] == ref["decode_tokens"], json.dumps(ref["draft"]))
                    # the plain ids with an error every 3rd generated token
                    planted = prompt + [(t + 1) % 3840 if i % 3 == 2 else t for i, t in enumerate(want)]
                    variants = [
                        ("ngram", ["--draft", "ngram", "--draft-ngram-min", "1"]),
                        ("ids K4", ["--draft-ids", ",".join(map(str, planted)), "--draft-max", "4"]),
                        ("ids K8 all right", ["--draft-ids", ",".join(map(str, prompt + want)), "--draft-max", "8"]),
                    ]
                    if pname == "repeated":
                        variants.append(("ngram, 2 workers", ["--draft", "ngram", "--draft-ngram-min", "1",
                                                              "--workers", "2"]))
                        variants.append(("ids K4, 2 workers", ["--draft-ids", ",".join(map(str, planted)),
                                                               "--draft-max", "4", "--workers", "2"]))
                    for vname, vargs in variants:
                        doc, lg, err = run(model, prompt, tmp, "spec", *sargs, *vargs)
                        c = f"{case}, {vname}"
                        if not R.check(f"{c}: runs", doc is not None, err[-400:]):
                            continue
                        got = doc["generated_ids"]
                        R.check(f"{c}: ids identical to --draft off", got == want, f"{got} != {want}")
                        R.check(f"{c}: logits identical byte for byte", lg == ref_lg,
                                f"{len(lg or b'')} vs {len(ref_lg or b'')} bytes")
                        d = doc["draft"]
                        fed = len(want) - 1  # the last sampled id (or EOS) is never fed
                        R.check(f"{c}: stats add up", d["passes"] + d["accepted"] == fed and
                                d["accepted"] <= d["drafted"], json.dumps(d))
                        if vname.startswith("ids") and fed > 6:
                            R.check(f"{c}: drafts accepted, passes per token < 1", d["accepted"] > 0 and
                                    d["passes_per_token"] < 1, json.dumps(d))
                            if "K4" in vname:
                                R.check(f"{c}: planted misses rewound", d["rewinds"] > 0, json.dumps(d))
                        R.check(f"{c}: summary line on stderr", "shoal run: draft " in err, err[-300:])
    print(f"{R.counts['PASS']} passed, {R.counts['FAIL']} failed, {R.counts['SKIP']} skipped")
    return 1 if R.counts["FAIL"] else (77 if not R.counts["PASS"] else 0)


if __name__ == "__main__":
    sys.exit(main())
