#!/usr/bin/env python3
"""Cross-checks tools/reference.py and the generator's MXFP4 packing against
implementations written by others (PyPI packages), and prints a JSON report.

    python3 tools/crosscheck.py [--json OUT]

1. KDA gate and recurrence vs fla-core (`fla.ops.kda.gate.naive_kda_gate`,
   `naive_kda_lowerbound_gate`, `fla.ops.kda.naive.naive_recurrent_kda` and
   `naive_chunk_kda`), random inputs, both gate forms.
2. MXFP4 vs compressed-tensors (`unpack_fp4_from_uint8`, `pack_fp4_to_uint8`,
   `decompress_mx_scale`): the committed tiny-k3 experts unpack to the values
   the reference uses, and unpack -> pack gives back the stored bytes exactly.
3. Whole KDA layer vs transformers' Kimi-Linear `KimiLinearDeltaAttention`
   (torch fallback path) with the weights of a tiny-k3-plain KDA layer (softplus
   gate, the Kimi-Linear form). Kimi-Linear's output gate is low rank
   (g_b_proj @ g_a_proj); the reference layer is given the product as its
   full-rank g_proj, which is the same function.
Each check reports its max abs difference and whether it is within the bound.
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import reference as R  # noqa: E402


def ver(mod):
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001
        return None


def check_kda_fla(rep):
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    g = torch.Generator().manual_seed(5)
    T, H, D = 128, 3, 32
    for form in ("lower_bound", "softplus"):
        zg = torch.randn(T, H * D, generator=g) * 2
        A_log = torch.rand(H, generator=g) * 1.4
        dt_bias = torch.rand(H * D, generator=g) * 4 - 3
        lb = -5.0 if form == "lower_bound" else None
        mine = R.kda_gate(zg, A_log, dt_bias, lb, H)
        if lb is None:
            theirs = naive_kda_gate(zg.view(1, T, H, D), A_log, dt_bias)[0]
        else:
            theirs = naive_kda_lowerbound_gate(zg.view(1, T, H, D), A_log, dt_bias, lower_bound=lb)[0]
        gd = float((mine - theirs).abs().max())
        q = R.l2norm(torch.randn(T, H, D, generator=g))
        k = R.l2norm(torch.randn(T, H, D, generator=g))
        v = torch.randn(T, H, D, generator=g)
        beta = torch.sigmoid(torch.randn(T, H, generator=g))
        o, S = R.kda_recurrence(q * D ** -0.5, k, v, mine, beta, torch.zeros(H, D, D))
        o2, S2 = naive_recurrent_kda(q[None], k[None], v[None], mine[None], beta[None], scale=D ** -0.5,
                                     output_final_state=True)
        o3, S3 = naive_chunk_kda(q[None], k[None], v[None], mine[None], beta[None], scale=D ** -0.5,
                                 output_final_state=True, chunk_size=64)
        rep[f"kda_{form}"] = {
            "gate_max_abs_diff_vs_fla_gate": gd,
            "out_max_abs_diff_vs_naive_recurrent_kda": float((o - o2[0]).abs().max()),
            "state_max_abs_diff_vs_naive_recurrent_kda": float((S - S2[0]).abs().max()),
            "out_max_abs_diff_vs_naive_chunk_kda": float((o - o3[0]).abs().max()),
            "out_rms": float(o.pow(2).mean().sqrt()),
            "ok": gd < 1e-5 and float((o - o2[0]).abs().max()) < 1e-4 and float((o - o3[0]).abs().max()) < 1e-3,
        }


def check_mxfp4_ct(rep):
    from safetensors import safe_open
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    md = os.path.join(ROOT, "tests/models/tiny-k3")
    idx = json.load(open(os.path.join(md, "model.safetensors.index.json")))
    n = 0
    bad_rt = bad_val = 0
    for name, shard in sorted(idx["weight_map"].items()):
        if not name.endswith(".weight_packed"):
            continue
        with safe_open(os.path.join(md, shard), "pt") as f:
            packed = f.get_tensor(name)
        with safe_open(os.path.join(md, idx["weight_map"][name.replace("_packed", "_scale")]), "pt") as f:
            scale = f.get_tensor(name.replace("_packed", "_scale"))
        rows, half = packed.shape
        vals = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32)
        bad_rt += int((pack_fp4_to_uint8(vals) != packed).sum())
        sc = decompress_mx_scale(scale).to(torch.float32)  # bf16 2^(e-127), exact for these exponents
        deq = (vals.view(rows, -1, 32) * sc[:, :, None]).view(rows, -1)
        mine = R.mxfp4_dequant(packed, scale)
        bad_val += int((deq != mine).sum()) + int((torch.signbit(deq) != torch.signbit(mine)).sum())
        n += 1
    rep["mxfp4_compressed_tensors"] = {"tensors": n, "pack_roundtrip_mismatched_bytes": bad_rt,
                                       "dequant_mismatched_values": bad_val, "ok": n > 0 and bad_rt == 0 and bad_val == 0}


def check_kda_layer_transformers(rep):
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    m = R.Model(os.path.join(ROOT, "tests/models/tiny-k3-plain"))
    c = m.cfg
    L = 1  # a KDA layer
    assert L in c.kda_layers and c.lower_bound is None
    cfg = KimiLinearConfig(hidden_size=c.d, num_hidden_layers=c.n_layers, rms_norm_eps=c.eps, hidden_act="silu",
                           linear_attn_config={"head_dim": c.D, "num_heads": c.H, "short_conv_kernel_size": c.conv,
                                               "kda_layers": [i + 1 for i in sorted(c.kda_layers)],
                                               "full_attn_layers": [i + 1 for i in sorted(c.mla_layers)]})
    mod = KimiLinearDeltaAttention(cfg, L).float().eval()
    a = f"self_attn."
    W = lambda n: m.Lw(L, a + n)  # noqa: E731
    g = torch.Generator().manual_seed(9)
    ga = torch.randn(c.D, c.d, generator=g) * c.d ** -0.5
    gb = torch.randn(c.H * c.D, c.D, generator=g) * c.D ** -0.5
    with torch.no_grad():
        mod.q_proj.weight.copy_(W("q_proj.weight"))
        mod.k_proj.weight.copy_(W("k_proj.weight"))
        mod.v_proj.weight.copy_(W("v_proj.weight"))
        mod.conv1d.weight.copy_(torch.cat([W("q_conv1d.weight"), W("k_conv1d.weight"), W("v_conv1d.weight")], 0))
        mod.forget_gate.f_a_proj.weight.copy_(W("f_a_proj.weight"))
        mod.forget_gate.f_b_proj.weight.copy_(W("f_b_proj.weight"))
        mod.forget_gate.dt_bias.copy_(W("dt_bias"))
        mod.forget_gate.A_log.copy_(W("A_log").view(1, 1, c.H, 1))
        mod.b_proj.weight.copy_(W("b_proj.weight"))
        mod.g_a_proj.weight.copy_(ga)
        mod.g_b_proj.weight.copy_(gb)
        mod.o_norm.weight.copy_(W("o_norm.weight"))
        mod.o_proj.weight.copy_(W("o_proj.weight"))
        saved = m.w[f"language_model.model.layers.{L}.self_attn.g_proj.weight"]
        m.w[f"language_model.model.layers.{L}.self_attn.g_proj.weight"] = gb @ ga
        x = torch.randn(1, 40, c.d, generator=g)
        theirs = mod(x)
        mine, _ = R.kda_layer(m, L, x[0], R.kda_state0(c))
        m.w[f"language_model.model.layers.{L}.self_attn.g_proj.weight"] = saved
    d = float((mine - theirs[0]).abs().max())
    rep["kda_layer_vs_transformers_kimi_linear"] = {"tokens": 40, "max_abs_diff": d,
                                                    "out_rms": float(mine.pow(2).mean().sqrt()), "ok": d < 1e-4}


def check_nemo_components(rep, nemo_path):
    """NVIDIA NeMo AutoModel's own K3 (nemo_automodel/components/models/kimi_k3):
    SiTU, Attention Residuals, the router and the gated NoPE MLA layer, each fed
    the tiny-k3 weights. Its KDA needs fla's Triton kernels (no CPU backend)."""
    sys.path.insert(0, nemo_path)
    sys.modules["fla"] = None  # nemo's optional fla imports fall back to torch where they can
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.kimi_k3 import model as NM
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
    from nemo_automodel.components.models.kimi_k3.situ import _apply_attn_res, dense_situ
    md = os.path.join(ROOT, "tests/models/tiny-k3")
    m = R.Model(md)
    c = m.cfg
    tc = KimiK3Config.from_pretrained(md).text_config
    gen = torch.Generator().manual_seed(11)
    out = {"nemo_automodel_version": ver("nemo-automodel") or "0.7.0 (unpacked wheel)"}
    # SiTU on saturating inputs
    g = torch.randn(64, 192, generator=gen) * 12
    u = torch.randn(64, 192, generator=gen) * 40
    d = float((R.situ(g, u, c.beta1, c.beta2) - dense_situ(torch.cat([g, u], -1), c.beta1, c.beta2)).abs().max())
    out["situ_max_abs_diff"] = d
    # AttnRes with layer 5's mlp_res weights, 3 saved blocks
    L = 5
    T = 16
    blocks = [torch.randn(T, c.d, generator=gen) * (i + 1) for i in range(3)]
    p = torch.randn(T, c.d, generator=gen) * 2
    norm = NM.KimiRMSNorm(c.d, eps=c.eps, dtype=torch.float32)
    proj = torch.nn.Linear(c.d, 1, bias=False)
    with torch.no_grad():
        norm.weight.copy_(m.Lw(L, "mlp_res_norm.weight"))
        proj.weight.copy_(m.Lw(L, "mlp_res_proj.weight"))
        theirs = _apply_attn_res(p, torch.stack(blocks, 1), proj, norm)
    mine = R.attn_res(blocks, p, m.Lw(L, "mlp_res_norm.weight"), m.Lw(L, "mlp_res_proj.weight"), c.eps)
    out["attn_res_max_abs_diff"] = float((mine - theirs).abs().max())
    # router of layer 1: same expert sets (as sets; nemo's topk order is unspecified) and weights
    gate = NM.KimiK3Gate(NM._build_moe_config(tc, torch.float32, None))
    x = torch.randn(256, c.d, generator=gen)
    with torch.no_grad():
        gate.weight.copy_(m.Lw(1, "block_sparse_moe.gate.weight"))
        gate.e_score_correction_bias.copy_(m.Lw(1, "block_sparse_moe.gate.e_score_correction_bias"))
        w2, i2, _ = gate(x, torch.ones(256, dtype=torch.bool))
    ids, w = R.router(x, m.Lw(1, "block_sparse_moe.gate.weight"),
                      m.Lw(1, "block_sparse_moe.gate.e_score_correction_bias"), c)
    i2s, order = torch.sort(i2, -1)
    w2s = torch.gather(w2, 1, order)
    same = (i2s == ids).all(-1)
    out["router_tokens"] = 256
    out["router_same_expert_sets"] = int(same.sum())
    out["router_weight_max_abs_diff"] = float((w2s[same] - w[same]).abs().max())
    # the others must be exactly the deliberate tie (experts 5 and 17 have equal
    # rows and bias): torch.topk in nemo may keep either, the spec keeps the lower
    tie = {5, 17}
    out["router_other_sets_are_the_5_17_tie"] = all(
        set(ids[t].tolist()) ^ set(i2s[t].tolist()) == tie for t in range(256) if not bool(same[t]))
    # gated NoPE MLA layer 3 (sdpa backend), 24 tokens, causal
    L = 3
    mla = NM.KimiMLAAttention(tc, L, BackendConfig(attn="sdpa")).float().eval()
    sd = {k[len(f"language_model.model.layers.{L}.self_attn."):]: v for k, v in m.w.items()
          if k.startswith(f"language_model.model.layers.{L}.self_attn.")}
    mla.load_state_dict(sd, strict=False)
    missing = [n for n, _ in mla.named_parameters() if n not in sd]
    x = torch.randn(1, 24, c.d, generator=gen)
    with torch.no_grad():
        theirs = mla(x)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        mine, _ = R.mla_layer(m, L, x[0], R.mla_cache0(c))
    out["mla_unloaded_params"] = missing
    out["mla_max_abs_diff"] = float((mine - theirs.reshape(mine.shape)).abs().max())
    out["mla_out_rms"] = float(mine.pow(2).mean().sqrt())
    out["ok"] = (d < 1e-4 and out["attn_res_max_abs_diff"] < 1e-5 and out["router_other_sets_are_the_5_17_tie"]
                 and out["router_weight_max_abs_diff"] < 1e-6 and not missing and out["mla_max_abs_diff"] < 1e-4)
    rep["nemo_automodel_kimi_k3_components"] = out


def transformers_in_subprocess(rep):
    """transformers picks fla's Triton kernels when fla is importable, and Triton
    has no CPU driver here; a child process with fla hidden takes transformers'
    own torch path."""
    import subprocess
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--transformers-only"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    rep.update(json.loads(r.stdout))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--transformers-only", action="store_true")
    ap.add_argument("--nemo-path", help="directory holding an unpacked nemo-automodel wheel (nemo_automodel/)")
    ap.add_argument("--nemo-only", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.transformers_only:
        sys.modules["fla"] = None  # force transformers' torch fallback path
        rep = {}
        check_kda_layer_transformers(rep)
        print(json.dumps(rep))
        return 0
    if a.nemo_only:
        rep = {}
        check_nemo_components(rep, a.nemo_path)
        print(json.dumps(rep))
        return 0
    rep = {"versions": {p: ver(p) for p in ("torch", "fla-core", "compressed-tensors", "transformers", "safetensors")}}
    for fn in (check_kda_fla, check_mxfp4_ct, transformers_in_subprocess):
        try:
            fn(rep)
        except Exception as e:  # noqa: BLE001 -- a check that cannot run is reported, never hidden
            rep[fn.__name__] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if a.nemo_path:
        import subprocess
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--nemo-only", "--nemo-path", a.nemo_path],
                           capture_output=True, text=True)
        if r.returncode == 0:
            rep.update(json.loads(r.stdout.strip().splitlines()[-1]))
        else:
            rep["nemo_automodel_kimi_k3_components"] = {"ok": False, "error": r.stderr.strip()[-400:]}
    else:
        rep["nemo_automodel_kimi_k3_components"] = {"skipped": "no --nemo-path (pip download --no-deps "
                                                    "nemo-automodel==0.7.0, unzip the wheel, pass its directory)"}
    s = json.dumps(rep, indent=1, sort_keys=True)
    print(s)
    if a.json:
        open(a.json, "w").write(s + "\n")
    return 0 if all(v.get("ok", True) for k, v in rep.items() if k != "versions") else 1


if __name__ == "__main__":
    sys.exit(main())
