#!/usr/bin/env python3
"""Reference outputs of the real-width scale-test model (preset k3-scale).

    python3 tools/make_tiny_k3.py --preset k3-scale --seed 1 --out DIR      # numpy only, ~2 GB
    python3 tools/make_scale_fixture.py --model DIR --out tests/fixtures/k3-scale

The model (never committed; CI regenerates it with the numpy generator) has K3's
real widths -- hidden 7168, KDA 96 heads x 128 with the lower-bound gate, MLA 96
heads with q_lora 1536 / kv_lora 512 / nope 128 / rope 64 / v 128, latent MoE
3584 -> 3072 with MXFP4 experts, 2 shared experts -- in two layers: layer 0
KDA + dense MLP (intermediate 3072 instead of 33792 to keep the file ~2 GB),
layer 1 MLA + MoE (8 experts, top-4). The vocabulary is the tiny one (4096).

Writes scale.json: the sha256 and size of every generated model file (so a test
can check the regeneration before comparing), prompt_ids, greedy generated_ids
(full and incremental paths agree), per-position argmax, margins, top-32
logits, the full logits row of the last position, per-layer hidden summaries
and the measured full-vs-incremental logit difference (robustness.json).
"""
import argparse
import hashlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference as R  # noqa: E402

PROMPT = [3840, 79, 1864, 490, 1866, 484, 1854, 59]  # [BOS] + a few tiny-vocabulary ids
GEN = 4


def f32list(t):
    return [float(v) for v in t.reshape(-1).tolist()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    files = {}
    for fn in sorted(os.listdir(a.model)):
        h = hashlib.sha256()
        with open(os.path.join(a.model, fn), "rb") as f:
            for b in iter(lambda: f.read(1 << 24), b""):
                h.update(b)
        files[fn] = {"sha256": h.hexdigest(), "bytes": os.path.getsize(os.path.join(a.model, fn))}
    m = R.Model(a.model)
    with torch.no_grad():
        gen = R.greedy(m, PROMPT, GEN, incremental=True)
        ids = PROMPT + gen
        st = R.Stats()
        trace = []
        full = R.forward_full(m, ids, st, trace)
        s = R.Session(m)
        inc_trace = []
        inc = []
        for t in ids:
            tr = []
            inc.append(s.step(t, trace=tr))
            inc_trace.append(tr)
        inc = torch.stack(inc)
    hidden_rel = 0.0
    for L, P in enumerate(trace):
        a_, b_ = R.summarize(P), R.summarize(torch.cat([inc_trace[t][L] for t in range(len(ids))]))
        scale = float(a_["rms"].mean())
        for k in a_:
            hidden_rel = max(hidden_rel, float((a_[k] - b_[k]).abs().max()) / scale)
    full_gen = [int(x) for x in full.argmax(-1)[len(PROMPT) - 1:-1]]
    if full_gen != gen or not torch.equal(full.argmax(-1), inc.argmax(-1)):
        raise SystemExit(f"make_scale_fixture: full {full_gen} and incremental {gen} paths disagree")
    diff = float((full - inc).abs().max())
    top2 = full.topk(2, -1).values
    margins = top2[:, 0] - top2[:, 1]
    if float(margins.min()) <= 4 * diff:
        raise SystemExit(f"make_scale_fixture: margin {float(margins.min())} too close to divergence {diff}")
    tv, ti = full.topk(32, -1)
    layers = []
    for L, P in enumerate(trace):
        sm = R.summarize(P)
        e = {"layer": L, "attn": "kda" if L in m.cfg.kda_layers else "mla",
             "ffn": "dense" if L < m.cfg.first_dense else "moe",
             "rms": f32list(sm["rms"]), "mean": f32list(sm["mean"]), "absmax": f32list(sm["absmax"]),
             "head4": [f32list(r) for r in sm["head"]]}
        if e["ffn"] == "moe":
            e["experts"] = [st.router[(L, t)][0] for t in range(len(ids))]
        layers.append(e)
    os.makedirs(a.out, exist_ok=True)
    out = {"model": "k3-scale",
           "generator": "python3 tools/make_tiny_k3.py --preset k3-scale --seed 1 --out DIR",
           "model_files": files, "prompt_ids": PROMPT, "generated_ids": gen, "ids": ids,
           "argmax": [int(x) for x in full.argmax(-1)], "margin": f32list(margins),
           "top_k": 32, "top_ids": [[int(x) for x in r] for r in ti], "top_values": [f32list(r) for r in tv],
           "full_rows": {"positions": [len(ids) - 1], "values": [f32list(full[-1])]},
           "layers": layers}
    with open(os.path.join(a.out, "scale.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
    with open(os.path.join(a.out, "robustness.json"), "w") as f:
        json.dump({"model": "k3-scale", "logit_max_abs_diff": diff, "min_argmax_margin": float(margins.min()),
                   "hidden_summary_rel_max_diff_full_vs_incremental": hidden_rel,
                   "situ_gate_saturated_fraction": st.c["situ_gate_sat"] / max(1, st.c["situ_gate_n"]),
                   "situ_up_saturated_fraction": st.c["situ_up_sat"] / max(1, st.c["situ_up_n"]),
                   "router_bias_changes_topk_fraction": st.c["router_reordered"] / max(1, st.c["router_tokens"])},
                  f, indent=1)


if __name__ == "__main__":
    main()
