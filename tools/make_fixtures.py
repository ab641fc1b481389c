#!/usr/bin/env python3
"""Writes the golden fixtures of a model from the fp32 reference (tools/reference.py).

    python3 tools/make_fixtures.py --model tests/models/tiny-k3 --out tests/fixtures/tiny-k3

Files written (field names documented in docs/TESTING.md):
  greedy.json          prompt_ids (>= 16), generated_ids (>= 24 greedy ids)
  teacher_forced.json  ids (>= 48), argmax and top-1/top-2 margin at every position
  logits.json          top-32 ids/values per position, full rows at a few positions
  hidden.json          per-layer summaries of every position's layer output + routed experts
  sampled.json         a seeded sampled run per coordinator/engine/sampler.h's algorithm
  robustness.json      measured divergences between reference variants -> tolerances

Robustness: every fixture sequence is checked with four computation variants of
the reference (full sequence 1 thread, full sequence 2 threads, incremental one
token at a time, prefill in chunks of 5). They must agree on every argmax and
every routed-expert selection, and every argmax margin must exceed
MARGIN_FACTOR x the largest logit divergence measured between the variants;
candidate texts that fail are skipped (the index of the one used is recorded).
Deterministic: single-threaded torch for the values written, fixed texts.
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference as R  # noqa: E402
import train_vocab  # noqa: E402
import vocab_corpus  # noqa: E402

MARGIN_FACTOR = 4.0
TF_LEN = 64
TOP = 32
GREEDY_PROMPTS = [
    "The router picks a few experts for every token, and the engine must agree. 你好，世界！ Café 🦉 12345\n",
    "Attention residuals mix saved block inputs; the delta rule updates the state. 数据 naïve 🐟 2026\n",
    "A shoal of small fish turns at once. 今天天气很好。 Ça va? 👍🏽 3.14159\n",
    "Greedy decoding takes the most likely token every time, so two correct engines agree. 北京 ü 42\n",
    "Checkpoints are split into shards and an index maps every tensor to its shard. 東京 é 7\n",
]
NANO_PROMPTS = [
    "The \"assert\" statement\n**********************\n\nAssert statements are a convenient way to",
    "Return a new list containing all items from the iterable in ascending order. The",
]
SAMPLE_PROMPT = "Once upon a time, in a data center far away, "
HELDOUT_WINDOWS, HELDOUT_LEN = 4, 256
NANO_CHAT = ["What does json.dumps do?", "Explain the assert statement."]
SAMPLE_OPTS = dict(temperature=0.8, top_p=0.95, top_k=40, seed=1234, n=24)


def encoder(model_dir):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(os.path.join(model_dir, "tiktoken.model"))
    tc = json.load(open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8"))
    specials = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("shoal-tiny", pat_str=train_vocab.K3_PAT_STR, mergeable_ranks=ranks,
                            special_tokens=specials)
    return enc, specials


def f32list(t):
    return [float(v) for v in t.reshape(-1).tolist()]


def variants(m, ids):
    """Logits [T, V] and router decisions of the four computation variants."""
    out = {}
    for name in ("full1", "full2", "incremental", "chunk5"):
        st = R.Stats()
        torch.set_num_threads(2 if name == "full2" else 1)
        with torch.no_grad():
            if name.startswith("full"):
                lg = R.forward_full(m, ids, st)
            else:
                s = R.Session(m)
                step = 1 if name == "incremental" else 5
                lg = torch.cat([s.feed(ids[i:i + step], st) for i in range(0, len(ids), step)])
        out[name] = (lg, st)
    torch.set_num_threads(1)
    return out


def audit(m, ids, first=0):
    """Compares the variants on ids; argmax margins are checked from position
    `first` on. Returns (ok, report, logits, stats)."""
    v = variants(m, ids)
    base_lg, base_st = v["full1"]
    rep = {"logit_max_abs_diff": 0.0, "router_score_max_abs_diff": 0.0, "argmax_disagreements": 0,
           "router_disagreements": 0}
    for name, (lg, st) in v.items():
        if name == "full1":
            continue
        rep["logit_max_abs_diff"] = max(rep["logit_max_abs_diff"], float((lg - base_lg).abs().max()))
        rep["argmax_disagreements"] += int((lg.argmax(-1) != base_lg.argmax(-1)).sum())
        for k, (sel, sc, _) in base_st.router.items():
            sel2, sc2, _ = st.router[k]
            rep["router_disagreements"] += int(sel != sel2)
            rep["router_score_max_abs_diff"] = max(rep["router_score_max_abs_diff"], float((sc - sc2).abs().max()))
    top2 = base_lg.topk(2, -1).values
    margins = (top2[:, 0] - top2[:, 1])[first:]
    rep["min_argmax_margin"] = float(margins.min())
    gaps = [g for (_, _, g) in base_st.router.values() if g > 0]
    rep["min_router_gap"] = min(gaps) if gaps else None
    rep["router_exact_ties_at_boundary"] = base_st.c["router_tie_boundary"]
    ok = (rep["argmax_disagreements"] == 0 and rep["router_disagreements"] == 0
          and rep["min_argmax_margin"] > MARGIN_FACTOR * rep["logit_max_abs_diff"])
    return ok, rep, base_lg, base_st


def nano_heldout_text():
    """k3-nano: its held-out documents (tools/nano_data.py), never trained on."""
    import nano_data
    return "\n\n".join(p for n, k, p in nano_data.documents() if k == "text" and nano_data.held_out(n))


def candidates(enc, bos, n, nano=False):
    """Candidate teacher-forced sequences: [BOS] + the project's own text
    (k3-nano: + its held-out text)."""
    text = nano_heldout_text() if nano else vocab_corpus.corpus(seed=7, paragraphs=400)
    ids_all = enc.encode(text, disallowed_special=())
    step = 97
    for i in range(n):
        yield i, [bos] + ids_all[i * step: i * step + TF_LEN - 1]


def hidden_summary(m, ids):
    """Per-layer summaries from the full path, and the largest difference of any
    summary value to the incremental path's, relative to that layer's mean rms."""
    trace = []
    st = R.Stats()
    with torch.no_grad():
        R.forward_full(m, ids, st, trace)
        s = R.Session(m)
        inc = []
        for t in ids:
            tr = []
            s.step(t, trace=tr)
            inc.append(tr)
    rel = 0.0
    for L, P in enumerate(trace):
        Q = torch.cat([inc[t][L] for t in range(len(ids))])
        a, b = R.summarize(P), R.summarize(Q)
        scale = float(a["rms"].mean())
        for k in a:
            rel = max(rel, float((a[k] - b[k]).abs().max()) / scale)
    c = m.cfg
    layers = []
    for L, P in enumerate(trace):
        s = R.summarize(P)
        e = {"layer": L, "attn": "kda" if L in c.kda_layers else "mla",
             "ffn": "dense" if L < c.first_dense else "moe",
             "rms": f32list(s["rms"]), "mean": f32list(s["mean"]), "absmax": f32list(s["absmax"]),
             "head4": [f32list(r) for r in s["head"]]}
        if e["ffn"] == "moe":
            e["experts"] = [st.router[(L, t)][0] for t in range(len(ids))]
        layers.append(e)
    return layers, st, rel


# ---- sampler of coordinator/engine/sampler.h, re-implemented here from its contract

M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return x, z ^ (z >> 31)


class Xoshiro:
    def __init__(self, seed):
        x = seed & M64
        self.s = []
        for _ in range(4):
            x, z = splitmix64(x)
            self.s.append(z)

    def next(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & M64  # noqa: E731
        result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result


def sample(logits, temperature, top_p, top_k, rng):
    """One draw per sampler.h: rank by logit desc (ties id asc), top_k, softmax in
    double, top_p prefix (mass reaches top_p), u = (next >> 11) * 2^-53, first
    candidate whose cumulative mass exceeds u * total. Returns (id, u, margin)
    where margin is the distance of u*total to the nearest cumulative boundary."""
    import math
    vals = [float(v) for v in logits.tolist()]
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    if top_k > 0:
        order = order[:top_k]
    lmax = vals[order[0]]
    p = [math.exp((vals[i] - lmax) / float(temperature)) for i in order]
    tot = 0.0
    for x in p:
        tot += x
    p = [x / tot for x in p]
    if top_p < 1.0:
        acc, keep = 0.0, 0
        for x in p:
            acc += x
            keep += 1
            if acc >= top_p:
                break
        order, p = order[:keep], p[:keep]
        tot = 0.0
        for x in p:
            tot += x
        p = [x / tot for x in p]
    total = 0.0
    for x in p:
        total += x
    u = (rng.next() >> 11) * 2.0 ** -53
    target = u * total
    acc = 0.0
    for i, x in zip(order, p):
        lo = acc
        acc += x
        if acc > target:
            return i, u, min(target - lo, acc - target)
    return order[-1], u, 0.0


def nano_fixtures(m, enc, specials, out, name, log):
    """heldout.json: per-token log-probabilities of held-out windows (perplexity);
    chat.json: greedy chat answers in the K3 XTML format, and a stop string cut
    from real answer text."""
    import math
    ids_all = enc.encode(nano_heldout_text(), disallowed_special=())
    wins, nll, reps = [], [], []
    i = 0
    while len(wins) < HELDOUT_WINDOWS:
        w = ids_all[i * HELDOUT_LEN: (i + 1) * HELDOUT_LEN + 1]
        i += 1
        if len(w) < HELDOUT_LEN + 1:
            raise SystemExit("make_fixtures: held-out text too short")
        ok, rep, lg, _ = audit(m, w[:-1])
        # the log-probabilities need no argmax margin, only agreement of the routing
        ok = rep["router_disagreements"] == 0
        log(f"held-out window {i - 1}: ok={ok} {rep}")
        if not ok:
            continue
        lp = torch.log_softmax(lg.double(), -1)
        wins.append(w)
        nll.append([float(-lp[t, w[t + 1]]) for t in range(HELDOUT_LEN)])
        reps.append(rep)
    flat = [x for r in nll for x in r]
    json.dump({"model": name, "windows": wins, "nll": nll, "tokens": len(flat),
               "mean_nll": sum(flat) / len(flat), "perplexity": math.exp(sum(flat) / len(flat)),
               "logit_max_abs_diff_variants": max(r["logit_max_abs_diff"] for r in reps)},
              open(os.path.join(out, "heldout.json"), "w"), indent=None, separators=(",", ":"))
    chats = []
    eom = specials["<|end_of_msg|>"]
    for q in NANO_CHAT:
        for thinking in (True, False):
            prompt = prompt_ids(enc, specials, q, thinking)
            with torch.no_grad():
                gen = R.greedy(m, prompt, 64, incremental=True)
            if eom in gen:
                gen = gen[: gen.index(eom) + 1]
            seq = prompt + gen
            ok, rep, lgg, _ = audit(m, seq, first=len(prompt) - 1)
            log(f"chat {q!r} thinking={thinking}: ok={ok} {enc.decode(gen)!r}")
            chats.append({"question": q, "thinking": thinking, "prompt_ids": prompt, "generated_ids": gen,
                          "text": enc.decode(gen), "robust": ok, "min_margin": rep["min_argmax_margin"],
                          **answer_regions(enc, specials, gen, thinking)})
    json.dump({"model": name, "chats": chats}, open(os.path.join(out, "chat.json"), "w"), indent=1,
              ensure_ascii=False)


def answer_regions(enc, sp, gen, thinking):
    """The reasoning and content of a generated answer when it has the trained
    structure ([think ids] <|close|>think<|sep|><|open|>response<|sep|> CONTENT
    <|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>), else {}."""
    def t(s):
        return enc.encode(s, disallowed_special=())
    tail = [sp["<|close|>"]] + t("response") + [sp["<|sep|>"], sp["<|close|>"]] + t("message") + \
        [sp["<|sep|>"], sp["<|end_of_msg|>"]]
    head = [sp["<|close|>"]] + t("think") + [sp["<|sep|>"], sp["<|open|>"]] + t("response") + [sp["<|sep|>"]]
    if len(gen) < len(tail) or gen[-len(tail):] != tail:
        return {"structured": False}
    body = gen[: -len(tail)]
    reasoning = ""
    if thinking:
        for i in range(len(body) - len(head) + 1):
            if body[i: i + len(head)] == head:
                reasoning, body = enc.decode(body[:i]), body[i + len(head):]
                break
        else:
            return {"structured": False}
    specials = set(sp.values())
    if any(x in specials for x in body):
        return {"structured": False}
    return {"structured": True, "reasoning": reasoning, "content": enc.decode(body)}


def prompt_ids(enc, sp, question, thinking):
    """The chat prompt `shoal serve` builds for one user message (SPEC §5.4):
    the user turn, then the unclosed assistant message."""
    def t(s):
        return enc.encode(s, disallowed_special=())
    ids = [sp["<|open|>"]] + t("message") + t(" role") + t('="') + t("user") + t('"') + [sp["<|sep|>"]]
    ids += t(question) + [sp["<|close|>"]] + t("message") + [sp["<|sep|>"], sp["<|end_of_msg|>"]]
    ids += [sp["<|open|>"]] + t("message") + t(" role") + t('="') + t("assistant") + t('"') + [sp["<|sep|>"]]
    ids += [sp["<|open|>"]] + t("think" if thinking else "response") + [sp["<|sep|>"]]
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--candidates", type=int, default=40)
    ap.add_argument("--nano", action="store_true",
                    help="k3-nano (a trained model): held-out text, real prompts, heldout.json and chat.json")
    ap.add_argument("--numerics", choices=("portable", "mu"), default="portable",
                    help="the engine's numerics class the fixtures are for (reference.py set_numerics); mu "
                         "fixtures go to tests/fixtures/MODEL/mu")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    m = R.Model(a.model)
    R.set_numerics(m, a.numerics)
    enc, specials = encoder(a.model)
    bos = specials["[BOS]"]
    os.makedirs(a.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(a.model))
    log = lambda s: print(f"make_fixtures[{name}]: {s}", file=sys.stderr)  # noqa: E731

    # -- teacher-forced sequence, chosen for robustness
    chosen = None
    tried = []
    for i, ids in candidates(enc, bos, a.candidates, a.nano):
        ok, rep, lg, st = audit(m, ids)
        tried.append({"candidate": i, "ok": ok, **rep})
        log(f"candidate {i}: ok={ok} {rep}")
        if ok:
            chosen = (i, ids, rep, lg, st)
            break
    if chosen is None:
        raise SystemExit(f"make_fixtures: no robust teacher-forced sequence among {a.candidates} candidates")
    ci, ids, rep_tf, lg, st = chosen
    top2 = lg.topk(2, -1).values
    json.dump({"model": name, "ids": ids, "argmax": [int(x) for x in lg.argmax(-1)],
               "margin": f32list(top2[:, 0] - top2[:, 1])},
              open(os.path.join(a.out, "teacher_forced.json"), "w"), indent=1)
    tv, ti = lg.topk(TOP, -1)
    rows = sorted(set([0, len(ids) // 2, len(ids) - 1]))
    json.dump({"model": name, "ids": ids, "top_k": TOP, "top_ids": [[int(x) for x in r] for r in ti],
               "top_values": [f32list(r) for r in tv],
               "full_rows": {"positions": rows, "values": [f32list(lg[p]) for p in rows]}},
              open(os.path.join(a.out, "logits.json"), "w"), indent=None, separators=(",", ":"))
    layers, _, hidden_rel = hidden_summary(m, ids)
    json.dump({"model": name, "ids": ids, "summary": "per position of each layer's output P: rms, mean, absmax, "
               "first 4 values; experts = routed ids ascending", "layers": layers},
              open(os.path.join(a.out, "hidden.json"), "w"), indent=None, separators=(",", ":"))

    # -- greedy: incremental decode; verified against the full-sequence path
    greedy_tried = []
    for gi, text in enumerate((NANO_PROMPTS if a.nano else []) + GREEDY_PROMPTS):
        prompt = enc.encode(text, disallowed_special=())
        assert len(prompt) >= 16, len(prompt)
        with torch.no_grad():
            gen = R.greedy(m, prompt, 24, incremental=True)
        seq = prompt + gen
        ok, rep_g, lgg, _ = audit(m, seq, first=len(prompt) - 1)
        full_gen = [int(x) for x in lgg.argmax(-1)[len(prompt) - 1: -1]]
        ok = ok and full_gen == gen
        greedy_tried.append({"prompt": gi, "ok": ok, **rep_g})
        log(f"greedy prompt {gi}: ok={ok} {rep_g}")
        if ok:
            break
    if not ok:
        raise SystemExit("make_fixtures: no robust greedy prompt")
    extra = {"generated_text": enc.decode(gen)} if a.nano else {}
    json.dump({"model": name, "prompt_text": text, "prompt_ids": prompt, "generated_ids": gen,
               "min_margin": rep_g["min_argmax_margin"], **extra},
              open(os.path.join(a.out, "greedy.json"), "w"), indent=1)

    # -- sampled run (sampler.h contract), incremental; margins recorded
    sp = enc.encode(SAMPLE_PROMPT, disallowed_special=())
    rng = Xoshiro(SAMPLE_OPTS["seed"])
    s = R.Session(m)
    with torch.no_grad():
        lgs = s.feed(sp)[-1]
        out, us, margins = [], [], []
        for _ in range(SAMPLE_OPTS["n"]):
            t, u, mg = sample(lgs, SAMPLE_OPTS["temperature"], SAMPLE_OPTS["top_p"], SAMPLE_OPTS["top_k"], rng)
            out.append(t)
            us.append(u)
            margins.append(mg)
            lgs = s.step(t)
    json.dump({"model": name, "prompt_text": SAMPLE_PROMPT, "prompt_ids": sp,
               "temperature": SAMPLE_OPTS["temperature"], "top_p": SAMPLE_OPTS["top_p"],
               "top_k": SAMPLE_OPTS["top_k"], "seed": SAMPLE_OPTS["seed"], "generated_ids": out,
               "draws_u": us, "min_mass_margin": min(margins)},
              open(os.path.join(a.out, "sampled.json"), "w"), indent=1)

    if a.nano:
        nano_fixtures(m, enc, specials, a.out, name, log)

    # -- stats that show the model exercises what it should
    sat = st.c
    json.dump({"model": name, "teacher_forced_candidate": ci, "candidates_tried": tried,
               "teacher_forced": rep_tf, "greedy_prompts_tried": greedy_tried,
               "hidden_summary_rel_max_diff_full_vs_incremental": hidden_rel,
               "situ_gate_saturated_fraction": sat["situ_gate_sat"] / max(1, sat["situ_gate_n"]),
               "situ_up_saturated_fraction": sat["situ_up_sat"] / max(1, sat["situ_up_n"]),
               "router_bias_changes_topk_fraction": sat["router_reordered"] / max(1, sat["router_tokens"]),
               "router_exact_ties_at_boundary": sat["router_tie_boundary"],
               "router_decisions": sat["router_tokens"]},
              open(os.path.join(a.out, "robustness.json"), "w"), indent=1)
    log("done")


if __name__ == "__main__":
    main()
