#!/usr/bin/env python3
"""Speculative decoding on the trained k3-nano with real text (issue 21, 23;
docs/PERFORMANCE.md): the prompt-lookup drafter's acceptance on what the model
really writes, and decode time with --draft ngram against --draft off, ids
compared on every run.

Prompts (text: tools/nano_data.py, the Python 3.11 documentation the model was
trained on; held-out documents marked):
  repeat  a documentation passage, then its first line again: the prompt
          lookup drafts the passage's continuation (what an edit or a quote
          would hit); copy_chars records how much of the passage the greedy
          output really reproduces;
  chat    a question in the K3 chat format (the prompt `shoal serve` renders
          for one user message, thinking off), the answer up to <|end_of_msg|>;
  free    the first 300 characters of a held-out document, continued.
Each round runs every prompt with --draft off, --draft ngram (the defaults)
and, with --cost A,B, --draft ngram --draft-cost A,B (a cost model measured on
this model with tests/bench/spec_bench.py); the order rotates per round.
`shoal run --json --threads T --gen N`; decode_s is the decode phase (prefill
excluded), the load average is read before and after every round; cpu_s is the run's process CPU time, and decode CPU is cpu_s
less the median cpu_s of the same prompt with --gen 1 (start, load, prefill).
Writes one JSON file: every run, the summary per kind, the commit,
the machine.

Usage: spec_nano.py --out FILE.json [--bin build/bin/shoal] [--rounds 5] [--gen 200] [--threads 1]
       [--cost A,B]"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(SRC, "tools"))
import nano_data  # noqa: E402

MODEL = os.path.join(SRC, "tests", "models", "k3-nano")
REPEAT = ["topic:assert", "topic:del", "topic:pass", "module:bisect", "topic:return", "topic:yield",
          "module:shlex", "module:quopri"]
CHAT = ["What does json.dumps do?", "Explain the assert statement.", "What is a generator?",
        "How do I use bisect.insort?", "Tell me about pathlib.PurePath.", "What does os.path.join do?"]
FREE = ["topic:comparisons", "topic:typesmapping", "module:pathlib", "module:tempfile", "module:asyncio.events",
        "module:stat"]


def encoder():
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from train_vocab import K3_PAT_STR
    ranks = load_tiktoken_bpe(os.path.join(MODEL, "tiktoken.model"))
    tc = json.load(open(os.path.join(MODEL, "tokenizer_config.json"), encoding="utf-8"))
    sp = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    return tiktoken.Encoding("k3-nano", pat_str=K3_PAT_STR, mergeable_ranks=ranks, special_tokens=sp), sp


def chat_ids(enc, sp, question):
    """one user message + the unclosed assistant message, thinking off (SPEC §5.4)"""
    def t(s):
        return enc.encode(s, disallowed_special=())
    ids = [sp["<|open|>"]] + t("message") + t(" role") + t('="') + t("user") + t('"') + [sp["<|sep|>"]]
    ids += t(question) + [sp["<|close|>"]] + t("message") + [sp["<|sep|>"], sp["<|end_of_msg|>"]]
    ids += [sp["<|open|>"]] + t("message") + t(" role") + t('="') + t("assistant") + t('"') + [sp["<|sep|>"]]
    return ids + [sp["<|open|>"]] + t("response") + [sp["<|sep|>"]]


def cases(enc, sp):
    docs = {n: p for n, k, p in nano_data.documents() if k == "text"}
    out = []
    for n in REPEAT:
        p = docs[n][:1200]
        first = p.split("\n", 1)[0]
        out.append({"kind": "repeat", "name": n, "held_out": nano_data.held_out(n),
                    "ids": enc.encode(p + "\n\n\n" + first + "\n", disallowed_special=()),
                    "rest": p[len(first) + 1:]})
    for q in CHAT:
        out.append({"kind": "chat", "name": q, "held_out": None, "ids": chat_ids(enc, sp, q)})
    for n in FREE:
        assert nano_data.held_out(n), n
        out.append({"kind": "free", "name": n, "held_out": True,
                    "ids": enc.encode(docs[n][:300], disallowed_special=())})
    return out


CONFIGS = {"off": ["--draft", "off"], "ngram": ["--draft", "ngram"]}
BASE = "base"  # --gen 1: start, load, prefill and one token, the part of cpu_s that is not decode


def run(a, ids, draft):
    cmd = [a.bin, "run", "--model", MODEL, "--json", "--threads", str(a.threads), "--gen",
           "1" if draft == BASE else str(a.gen), "--ids", ",".join(map(str, ids)),
           *CONFIGS["off" if draft == BASE else draft]]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the runs are sequential: this child's CPU
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"spec_nano: {' '.join(cmd[:8])} ... failed: {p.stderr[-500:]}")
    d = json.loads(p.stdout.strip().splitlines()[-1])
    return {"draft": draft, "wall_s": wall, "cpu_s": cpu, "decode_s": d["decode_s"], "decode_tokens": d["decode_tokens"],
            "generated": len(d["generated_ids"]), "stop": d["stop_reason"], "ids": d["generated_ids"],
            "text": d.get("text"), "stats": d["draft"]}


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bin", default=os.path.join(SRC, "build", "bin", "shoal"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cost", help="A,B: also run --draft ngram --draft-cost A,B")
    a = ap.parse_args()
    if a.cost:
        CONFIGS["ngram-cost"] = ["--draft", "ngram", "--draft-cost", a.cost]
    names = list(CONFIGS)
    enc, sp = encoder()
    cs = cases(enc, sp)
    rounds = []
    for r in range(a.rounds):
        order = [BASE] + names[r % len(names):] + names[:r % len(names)]
        rec = {"round": r, "order": order, "load_before": os.getloadavg(), "runs": []}
        for i, c in enumerate(cs):
            for draft in order:
                x = run(a, c["ids"], draft)
                x["case"] = i
                rec["runs"].append(x)
        rec["load_after"] = os.getloadavg()
        rounds.append(rec)
        print(f"spec_nano: round {r} done, load {rec['load_before'][0]:.2f} -> {rec['load_after'][0]:.2f}",
              file=sys.stderr, flush=True)
    # per case: ids identical on and off in every round; the drafting (deterministic) of round 0
    per_case = []
    for i, c in enumerate(cs):
        runs = [x for rd in rounds for x in rd["runs"] if x["case"] == i]
        off = [x for x in runs if x["draft"] == "off"]
        base = statistics.median(x["cpu_s"] for x in runs if x["draft"] == BASE)
        runs = [x for x in runs if x["draft"] != BASE]
        same = all(x["ids"] == off[0]["ids"] for x in runs)
        e = {"kind": c["kind"], "name": c["name"], "held_out": c["held_out"], "prompt_tokens": len(c["ids"]),
             "generated": off[0]["generated"], "stop": off[0]["stop"], "ids_identical_on_off": same,
             "fed": off[0]["decode_tokens"], "text": off[0]["text"], "base_cpu_s_median": base}
        for cfg in names:
            on = [x for x in runs if x["draft"] == cfg]
            st = on[0]["stats"]
            e[cfg] = {"drafted": st["drafted"], "accepted": st["accepted"], "passes": st["passes"],
                      "verifies": st["verifies"], "rewinds": st["rewinds"], "shadowed": st["shadowed"],
                      "shadow_hits": st["shadow_hits"], "decode_s": [x["decode_s"] for x in on],
                      "decode_cpu_s": [x["cpu_s"] - base for x in on]}
        if c["kind"] == "repeat":
            e["copy_chars"] = common_prefix(off[0]["text"] or "", c["rest"])
        per_case.append(e)
    kinds = {}
    for k in ("repeat", "chat", "free"):
        es = [e for e in per_case if e["kind"] == k]
        # decode s per fed token, per round: the kind's total decode time / its fed tokens
        fed = sum(e["fed"] for e in es)
        off_r = [sum(e["off"]["decode_s"][r] for e in es) / fed for r in range(a.rounds)]
        off_c = [sum(e["off"]["decode_cpu_s"][r] for e in es) / fed for r in range(a.rounds)]
        kinds[k] = {"cases": len(es), "fed_tokens": fed, "ms_per_token_off": [1e3 * x for x in off_r],
                    "ms_per_token_off_median": 1e3 * statistics.median(off_r),
                    "cpu_ms_per_token_off_median": 1e3 * statistics.median(off_c),
                    "ids_identical_all": all(e["ids_identical_on_off"] for e in es)}
        for cfg in names[1:]:
            on_r = [sum(e[cfg]["decode_s"][r] for e in es) / fed for r in range(a.rounds)]
            ratio = [o / n for o, n in zip(off_r, on_r)]
            on_c = [sum(e[cfg]["decode_cpu_s"][r] for e in es) / fed for r in range(a.rounds)]
            cratio = [o / n for o, n in zip(off_c, on_c)]
            dr, ac = sum(e[cfg]["drafted"] for e in es), sum(e[cfg]["accepted"] for e in es)
            kinds[k][cfg] = {"drafted": dr, "accepted": ac, "acceptance": ac / max(1, dr),
                             "passes": sum(e[cfg]["passes"] for e in es),
                             "passes_per_token": sum(e[cfg]["passes"] for e in es) / fed,
                             "shadowed": sum(e[cfg]["shadowed"] for e in es),
                             "shadow_hits": sum(e[cfg]["shadow_hits"] for e in es),
                             "ms_per_token": [1e3 * x for x in on_r],
                             "ms_per_token_median": 1e3 * statistics.median(on_r),
                             "speedup_per_round": ratio, "speedup_median": statistics.median(ratio),
                             "speedup_min": min(ratio), "speedup_max": max(ratio),
                             "cpu_ms_per_token_median": 1e3 * statistics.median(on_c),
                             "cpu_speedup_per_round": cratio, "cpu_speedup_median": statistics.median(cratio),
                             "cpu_speedup_min": min(cratio), "cpu_speedup_max": max(cratio)}
        if k == "repeat":
            kinds[k]["copy_chars"] = [e["copy_chars"] for e in es]
    commit = subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", SRC, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip() != ""
    doc = {"what": "k3-nano, shoal run --draft off vs --draft ngram (defaults: --draft-max 8, ngram min 2, "
                   "cost 0.2,0.3) [vs --draft-cost COST], greedy", "configs": CONFIGS,
           "commit": commit + ("+dirty" if dirty else ""),
           "cmd": " ".join(sys.argv), "threads": a.threads, "gen": a.gen, "rounds": a.rounds,
           "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
                       "uname": " ".join(platform.uname())},
           "kinds": kinds, "cases": per_case,
           "rounds_load": [{"round": rd["round"], "order": rd["order"], "load_before": rd["load_before"],
                            "load_after": rd["load_after"]} for rd in rounds],
           "runs": [{k: v for k, v in x.items() if k not in ("ids", "text")} for rd in rounds for x in rd["runs"]]}
    with open(a.out, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    for k, v in kinds.items():
        for cfg in names[1:]:
            w = v[cfg]
            print(f"{k} {cfg}: acceptance {w['accepted']}/{w['drafted']} = {w['acceptance']:.3f}, passes/token "
                  f"{w['passes_per_token']:.3f}, speedup median {w['speedup_median']:.2f} "
                  f"({w['speedup_min']:.2f}-{w['speedup_max']:.2f}), by CPU {w['cpu_speedup_median']:.2f} "
                  f"({w['cpu_speedup_min']:.2f}-{w['cpu_speedup_max']:.2f}), ids identical {v['ids_identical_all']}")
    return 0 if all(v["ids_identical_all"] for v in kinds.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
