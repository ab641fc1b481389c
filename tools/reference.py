#!/usr/bin/env python3
"""Independent fp32 PyTorch reference of the Kimi K3 text model (SPEC §3).

Written from ../shared/k3/SPEC.md only, not from the engine's C code. It reads a
model directory in the published layout (config.json with text_config,
model.safetensors.index.json + shards) through the `safetensors` package.

    python3 tools/reference.py --model tests/models/tiny-k3 --ids 1,2,3 --gen 8 [--incremental]

Numerics (the engine's default contract, SPEC §3.9 "Engine default"):
  * everything in fp32: bf16 weights widened exactly, F32 tensors used exactly as
    stored (A_log[:num_heads]), MXFP4 experts dequantized exactly;
  * the one rounding kept: each routed expert's output y_e is rounded to bf16
    (round to nearest even) before the weighted sum (SPEC §3.6 step 4);
  * the routed weighted sum runs in ascending expert-id order in fp32, starting
    from the lowest id; the renormalisation denominator is summed in the same
    order (+1e-20);
  * router logits are accumulated in float64 (the same reduction for every
    row) and rounded once to fp32, so equal router rows give bit-equal logits
    whatever the token batch; top-k ties on
    the biased score are broken by the lower expert index;
  * norms: rms_norm_eps everywhere except the MLA q_a/kv_a norms (1e-6) and the
    KDA q/k L2 norm x/sqrt(sum(x^2)+1e-6).

Two paths: `forward_full` (the whole sequence at once; causal attention, a
token-by-token KDA recurrence) and `Session.step` (incremental: MLA latent cache
of the normed c_kv and k_pe, KDA state and conv windows). They must give the
same tokens; their logits differ only by fp32 summation order.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


# ---------------------------------------------------------------- loading

def mxfp4_dequant(packed, scale):
    """weight_packed U8 [rows, cols/2] (element 2j in the low nibble) and
    weight_scale U8 E8M0 [rows, cols/32] -> fp32 [rows, cols], exactly."""
    rows = packed.shape[0]
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(rows, -1)
    vals = E2M1[codes]
    e = scale.to(torch.float64) - 127.0
    s = torch.pow(torch.tensor(2.0, dtype=torch.float64), e)
    vals = vals.reshape(rows, scale.shape[1], 32) * s[:, :, None]
    return vals.reshape(rows, -1).to(torch.float32)


def bf16_round(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32 (float64 in, float64 out: the
    float64 variant below keeps the same rounding)."""
    return x.to(torch.bfloat16).to(x.dtype)


class Config:
    def __init__(self, path):
        top = json.load(open(path))
        t = top.get("text_config", top)
        self.raw = top
        la = t["linear_attn_config"]
        self.vocab = t["vocab_size"]
        self.d = t["hidden_size"]
        self.n_layers = t["num_hidden_layers"]
        self.eps = float(t["rms_norm_eps"])
        self.kda_layers = set(L - 1 for L in la["kda_layers"])
        self.mla_layers = set(L - 1 for L in la["full_attn_layers"])
        assert self.kda_layers.isdisjoint(self.mla_layers)
        assert self.kda_layers | self.mla_layers == set(range(self.n_layers))
        self.H = la["num_heads"]
        self.D = la["head_dim"]
        self.conv = la["short_conv_kernel_size"]
        self.lower_bound = la.get("gate_lower_bound")  # None -> softplus gate
        self.mla_heads = t["num_attention_heads"]
        self.q_lora = t["q_lora_rank"]
        self.kv_lora = t["kv_lora_rank"]
        self.nope = t["qk_nope_head_dim"]
        self.rope = t["qk_rope_head_dim"]
        self.v_dim = t["v_head_dim"]
        assert t.get("mla_use_nope", True) and t.get("mla_use_output_gate", True)
        self.first_dense = t["first_k_dense_replace"]
        assert t["moe_layer_freq"] == 1
        self.E = t["num_experts"]
        self.topk = t["num_experts_per_token"]
        self.latent = t["routed_expert_hidden_size"]
        self.latent_norm = t["latent_moe_use_norm"]
        assert t["moe_router_activation_func"] == "sigmoid" and t["topk_method"] == "noaux_tc"
        assert t["num_expert_group"] == 1 and t["topk_group"] == 1
        self.renorm = t["moe_renormalize"]
        self.scaling = float(t["routed_scaling_factor"])
        self.beta1 = float(t["activation_situ_beta"])
        self.beta2 = float(t["activation_situ_linear_beta"])
        assert t["hidden_act"] == "situ"
        self.block = t["attn_res_block_size"]


class Model:
    def __init__(self, model_dir, dtype=torch.float32):
        """dtype float64: the same computation with every fp32 quantity held in
        float64 (weights widened exactly; the contract's two roundings kept:
        expert outputs to bf16, router scores and weights in fp32) -- the
        near-exact value that make_fixtures.py measures fp32 rounding against."""
        from safetensors import safe_open
        self.dir = model_dir
        self.dtype = dtype
        self.cfg = Config(os.path.join(model_dir, "config.json"))
        idx = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))
        self.w = {}
        raw = {}
        for shard in sorted(set(idx["weight_map"].values())):
            with safe_open(os.path.join(model_dir, shard), framework="pt") as f:
                for k in f.keys():
                    if k.startswith("vision_tower.") or k.startswith("mm_projector."):
                        continue  # text model only (SPEC §2.8)
                    raw[k] = f.get_tensor(k)
        self.dtypes = {k: str(v.dtype) for k, v in raw.items()}
        for k, v in raw.items():
            if k.endswith(".weight_packed"):
                base = k[: -len(".weight_packed")]
                self.w[base + ".weight"] = mxfp4_dequant(v, raw[base + ".weight_scale"]).to(dtype)
            elif k.endswith(".weight_scale"):
                continue
            else:
                self.w[k] = v.to(dtype)  # exact widening of bf16/f32
        c = self.cfg
        # A_log is stored longer than the head count; only the first H are used.
        for L in c.kda_layers:
            k = f"language_model.model.layers.{L}.self_attn.A_log"
            assert self.w[k].numel() >= c.H, k
            self.w[k] = self.w[k][: c.H].clone()

    def W(self, name):
        return self.w["language_model." + name]

    def Lw(self, L, name):
        return self.w[f"language_model.model.layers.{L}.{name}"]


# ---------------------------------------------------------------- building blocks

def rms_norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def linear(x, W):
    """the matrix product (tools/measure_tolerances.py replaces it by products
    in other summation orders)"""
    return x @ W.t()


# ---------------------------------------------------------------- numerics classes
# The engine's two numerics classes (issue 33; docs/ARCHITECTURE.md "Numerics
# classes"). portable: fp32 activations into every matrix product (the
# contract above). mu, the matrix-unit order: every product whose weight is
# stored bf16 or MXFP4 -- what the engine computes with shoal_gemm_bf16 /
# shoal_gemm_mxfp4 -- takes its input rounded to bf16 (subnormals read as
# zero), with tiny results flushed; fp32-stored weights, the AttnRes
# projections (fp32 vectors in the engine) and the MLA query's absorption
# into the latent (a transposed GEMV with fp32 activations) keep fp32 inputs,
# and the MLA values are applied to the attention-mixed latent, which is
# rounded (the engine's absorbed form, mla_layer). Within the class the
# summation order is free (the engine's is AMX's, kernels/README.md), so
# measure_tolerances.py --numerics mu samples orders as for portable.
MU = None  # None: portable; else the id()s of the weights whose products take bf16 inputs
TINY = 2.0 ** -126


def mu_in(x):
    """a mu-class product's input: x to bf16, subnormals read as zero (DAZ)"""
    x = bf16_round(x)
    return torch.where(x.abs() < TINY, torch.zeros_like(x), x)


def mu_out(y):
    """a mu-class product's result: tiny values flushed to (signed) zero (FTZ)"""
    return torch.where(y.abs() < TINY, y * 0, y)


def mm(x, W):
    """a matrix product of the model, in the numerics class set by set_numerics"""
    if MU is not None and id(W) in MU:
        return mu_out(linear(mu_in(x), W))
    return linear(x, W)


def set_numerics(m, name):
    """portable or mu for every forward from now on (one model at a time)."""
    global MU
    if name == "portable":
        MU = None
        return
    assert name == "mu", name
    ids = set()
    for k, dt in m.dtypes.items():
        if k.endswith(".weight_packed"):
            k = k[: -len("_packed")]
        elif dt != "torch.bfloat16" or not k.endswith(".weight"):
            continue
        if "res_proj" in k or k.endswith("kv_b_proj.weight") or k not in m.w:
            continue
        w = m.w[k]
        w[w.abs() < TINY] = 0  # bf16 weights: subnormals read as zero too (MXFP4 decodes have none)
        ids.add(id(w))
    MU = ids


def situ(g, u, b1, b2):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def attn_res(blocks, p, w_norm, w_proj, eps):
    """Softmax mix of the saved block inputs and the current partial sum.
    blocks: list of [T, d]; p: [T, d]. Scores from the RMS-normed candidates,
    mixing of the raw candidates (SPEC §3.2)."""
    V = torch.stack(list(blocks) + [p], dim=0)  # [n+1, T, d]
    k = rms_norm(V, w_norm, eps)
    s = linear(k, w_proj)[..., 0]  # [n+1, T]; an fp32 vector in the engine: never mu
    a = torch.softmax(s, dim=0)
    return (a[..., None] * V).sum(0)


class Stats:
    """Counters that show the fixture exercises what it should."""

    def __init__(self):
        self.c = dict(situ_gate_n=0, situ_gate_sat=0, situ_up_n=0, situ_up_sat=0,
                      router_tokens=0, router_reordered=0, router_tie_boundary=0)
        self.layer = 0  # set by run_layers
        self.pos0 = 0   # position of the first row (set by the caller)
        self.router = {}  # (layer, position) -> (ids list, biased scores fp32, gap)

    def situ(self, g, u, b1, b2):
        self.c["situ_gate_n"] += g.numel()
        self.c["situ_gate_sat"] += int((g.abs() > 2 * b1).sum())  # tanh(g/b1) > 0.96
        self.c["situ_up_n"] += u.numel()
        self.c["situ_up_sat"] += int((u.abs() > b2).sum())  # tanh(u/b2) > 0.76


def router(x, Wg, bias, cfg, stats=None):
    """noaux_tc: returns (ids [T, k] ascending, weights [T, k] fp32)."""
    # float64 products summed along each row by one reduction: the same
    # arithmetic for every row, so equal router rows give bit-equal logits
    # (a BLAS gemv may treat rows differently), then one rounding to fp32
    if MU is not None and id(Wg) in MU:  # the mu class: a bf16 router's product takes bf16 inputs
        x = mu_in(x)
    logits = (x.double()[:, None, :] * Wg.double()[None, :, :]).sum(-1).float()
    if MU is not None and id(Wg) in MU:
        logits = mu_out(logits)
    # sigmoid in float64, rounded once: torch's float32 sigmoid may take a
    # vectorised or a scalar path depending on an element's position, which
    # would split an exact tie between equal rows
    s = torch.sigmoid(logits.double()).float()
    choice = s + bias.float()  # fp32 (a no-op but for the float64 variant)
    order = torch.sort(choice, dim=-1, descending=True, stable=True).indices  # ties: lower id first
    ids = torch.sort(order[:, : cfg.topk], dim=-1).values
    w = torch.gather(s, 1, ids)
    if cfg.renorm:
        den = torch.zeros(w.shape[0], dtype=torch.float32)
        for j in range(cfg.topk):
            den = den + w[:, j]
        w = w / (den + 1e-20)[:, None]
    w = w * cfg.scaling
    if stats is not None:
        plain = torch.sort(torch.sort(s, dim=-1, descending=True, stable=True).indices[:, : cfg.topk], -1).values
        stats.c["router_tokens"] += x.shape[0]
        stats.c["router_reordered"] += int((plain != ids).any(-1).sum())
        kth = torch.gather(choice, 1, order[:, cfg.topk - 1: cfg.topk])
        nxt = torch.gather(choice, 1, order[:, cfg.topk: cfg.topk + 1])
        stats.c["router_tie_boundary"] += int((kth == nxt).sum())
        for t in range(x.shape[0]):
            # gap: k-th minus (k+1)-th biased score; 0 for an exact tie, which
            # the lower-index rule decides exactly (not a fragile decision)
            stats.router[(stats.layer, stats.pos0 + t)] = (ids[t].tolist(), choice[t].clone(),
                                                           float(kth[t, 0] - nxt[t, 0]))
    return ids, w


def moe(m, L, x, stats=None):
    """Latent MoE + shared experts for rows x [T, d] (SPEC §3.5-§3.7)."""
    c = m.cfg
    pre = "block_sparse_moe."
    ids, w = router(x, m.Lw(L, pre + "gate.weight"), m.Lw(L, pre + "gate.e_score_correction_bias"), c, stats)
    z = mm(x, m.Lw(L, pre + "routed_expert_down_proj.weight"))
    T = x.shape[0]
    r = torch.zeros(T, c.latent, dtype=z.dtype)
    for e in range(c.E):  # ascending expert id: the canonical summation order
        sel = (ids == e)
        rows = sel.any(-1).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        we = (w * sel).sum(-1)[rows]  # exactly one nonzero term per row
        ze = z[rows]
        g = mm(ze, m.Lw(L, f"{pre}experts.{e}.w1.weight"))
        u = mm(ze, m.Lw(L, f"{pre}experts.{e}.w3.weight"))
        if stats is not None:
            stats.situ(g, u, c.beta1, c.beta2)
        y = mm(situ(g, u, c.beta1, c.beta2), m.Lw(L, f"{pre}experts.{e}.w2.weight"))
        y = bf16_round(y)
        r[rows] = r[rows] + we[:, None] * y
    if c.latent_norm:
        r = rms_norm(r, m.Lw(L, pre + "routed_expert_norm.weight"), c.eps)
    r = mm(r, m.Lw(L, pre + "routed_expert_up_proj.weight"))
    sg = mm(x, m.Lw(L, pre + "shared_experts.gate_proj.weight"))
    su = mm(x, m.Lw(L, pre + "shared_experts.up_proj.weight"))
    if stats is not None:
        stats.situ(sg, su, c.beta1, c.beta2)
    sh = mm(situ(sg, su, c.beta1, c.beta2), m.Lw(L, pre + "shared_experts.down_proj.weight"))
    return r + sh


def dense_mlp(m, L, x, stats=None):
    c = m.cfg
    g = mm(x, m.Lw(L, "mlp.gate_proj.weight"))
    u = mm(x, m.Lw(L, "mlp.up_proj.weight"))
    if stats is not None:
        stats.situ(g, u, c.beta1, c.beta2)
    return mm(situ(g, u, c.beta1, c.beta2), m.Lw(L, "mlp.down_proj.weight"))


def ffn(m, L, x, stats=None):
    return dense_mlp(m, L, x, stats) if L < m.cfg.first_dense else moe(m, L, x, stats)


# ---------------------------------------------------------------- KDA

def kda_gate(zg, A_log, dt_bias, lower_bound, H):
    """zg [T, C] = W_fb W_fa x -> log-space decay g [T, H, D]."""
    z = (zg + dt_bias).view(zg.shape[0], H, -1)
    a = torch.exp(A_log).view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z)


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_recurrence(q, k, v, g, beta, S):
    """Delta rule per token. q,k [T,H,K] (normed, q scaled), v [T,H,V], g [T,H,K],
    beta [T,H], S [H,K,V] (updated in place semantics: returns new S). -> o [T,H,V]."""
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, :, None]
        u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + k[t][:, :, None] * (beta[t][:, None] * u)[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs, 0), S


def kda_layer(m, L, x, state):
    """x [T, d] (normed). state: dict with 'S' [H,D,D] and 'conv' {q,k,v: [K-1, C]}
    (the last K-1 pre-conv inputs). Returns (out [T, d], new state)."""
    c = m.cfg
    H, D, K = c.H, c.D, c.conv
    a = "self_attn."
    T = x.shape[0]
    new_conv = {}
    qkv = {}
    for nm in ("q", "k", "v"):
        pre = mm(x, m.Lw(L, a + nm + "_proj.weight"))  # [T, C]
        win = torch.cat([state["conv"][nm], pre], 0)  # [K-1+T, C]
        taps = m.Lw(L, a + nm + "_conv1d.weight")[:, 0, :]  # [C, K]; tap K-1 = current token
        out = torch.zeros_like(pre)
        for j in range(K):
            out = out + taps[:, j] * win[j: j + T]
        qkv[nm] = F.silu(out)
        new_conv[nm] = win[T:].clone()
    q = l2norm(qkv["q"].view(T, H, D)) * (D ** -0.5)
    k = l2norm(qkv["k"].view(T, H, D))
    v = qkv["v"].view(T, H, D)
    zg = mm(mm(x, m.Lw(L, a + "f_a_proj.weight")), m.Lw(L, a + "f_b_proj.weight"))
    g = kda_gate(zg, m.Lw(L, a + "A_log"), m.Lw(L, a + "dt_bias"), c.lower_bound, H)
    beta = torch.sigmoid(mm(x, m.Lw(L, a + "b_proj.weight")))
    o, S = kda_recurrence(q, k, v, g, beta, state["S"])
    G = mm(x, m.Lw(L, a + "g_proj.weight")).view(T, H, D)
    o = rms_norm(o, m.Lw(L, a + "o_norm.weight"), c.eps) * torch.sigmoid(G)
    out = mm(o.reshape(T, H * D), m.Lw(L, a + "o_proj.weight"))
    return out, {"S": S, "conv": new_conv}


def kda_state0(c, dtype=torch.float32):
    C = c.H * c.D
    return {"S": torch.zeros(c.H, c.D, c.D, dtype=dtype),
            "conv": {nm: torch.zeros(c.conv - 1, C, dtype=dtype) for nm in "qkv"}}


# ---------------------------------------------------------------- MLA

def mla_layer(m, L, x, cache):
    """x [T, d] (normed) for positions len(cache)..len(cache)+T-1.
    cache: dict with 'c' [S, kv_lora] (normed latent) and 'kpe' [S, rope].
    Returns (out [T, d], new cache)."""
    c = m.cfg
    a = "self_attn."
    T, Hm, nope, rope, vd = x.shape[0], c.mla_heads, c.nope, c.rope, c.v_dim
    q = mm(rms_norm(mm(x, m.Lw(L, a + "q_a_proj.weight")), m.Lw(L, a + "q_a_layernorm.weight"), 1e-6),
               m.Lw(L, a + "q_b_proj.weight")).view(T, Hm, nope + rope)
    ckv = mm(x, m.Lw(L, a + "kv_a_proj_with_mqa.weight"))
    chat = rms_norm(ckv[:, : c.kv_lora], m.Lw(L, a + "kv_a_layernorm.weight"), 1e-6)
    kpe = ckv[:, c.kv_lora:]
    allc = torch.cat([cache["c"], chat], 0)
    allk = torch.cat([cache["kpe"], kpe], 0)
    S = allc.shape[0]
    wkv = m.Lw(L, a + "kv_b_proj.weight")
    kv = linear(allc, wkv).view(S, Hm, nope + vd)  # never mu: the engine absorbs it (below)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = (torch.einsum("thd,shd->hts", q[..., :nope], k_nope)
              + torch.einsum("thd,sd->hts", q[..., nope:], allk)) / math.sqrt(nope + rope)
    pos_q = torch.arange(S - T, S)[:, None]
    pos_k = torch.arange(S)[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if MU is None:
        o = torch.einsum("hts,shd->thd", p, v).reshape(T, Hm * vd)
    else:
        # the mu class, as the engine computes it: the values applied to the
        # attention-mixed latent (W_UV · sum_s p_s c_s, a bf16 product: its
        # input rounded); the scores' absorbed query (W_UK^T q) stays fp32
        mix = torch.einsum("hts,sr->thr", p, allc)  # [T, Hm, kv_lora]
        wuv = wkv.view(Hm, nope + vd, -1)[:, nope:, :]  # [Hm, vd, kv_lora]
        o = torch.stack([mu_out(linear(mu_in(mix[:, h]), wuv[h])) for h in range(Hm)], 1).reshape(T, Hm * vd)
    o = o * torch.sigmoid(mm(x, m.Lw(L, a + "g_proj.weight")))
    return mm(o, m.Lw(L, a + "o_proj.weight")), {"c": allc, "kpe": allk}


def mla_cache0(c, dtype=torch.float32):
    return {"c": torch.zeros(0, c.kv_lora, dtype=dtype), "kpe": torch.zeros(0, c.rope, dtype=dtype)}


# ---------------------------------------------------------------- model

def summarize(h):
    """Per-position summary of a hidden state [T, d]: rms, mean, absmax, first 4."""
    return {"rms": torch.sqrt((h * h).mean(-1)), "mean": h.mean(-1), "absmax": h.abs().max(-1).values,
            "head": h[:, :4]}


def run_layers(m, h, states, stats=None, trace=None):
    """h [T, d] embeddings of the new positions; states: per-layer KDA state / MLA
    cache (updated). Returns the final hidden state after AttnRes-out [T, d]."""
    c = m.cfg
    B = []
    P = None
    for L in range(c.n_layers):
        if stats is not None:
            stats.layer = L
        if B:
            x = attn_res(B, h, m.Lw(L, "self_attention_res_norm.weight"), m.Lw(L, "self_attention_res_proj.weight"),
                         c.eps)
        else:
            x = h
        if L % c.block == 0:
            B.append(h)
            P = None
        else:
            P = h
        xn = rms_norm(x, m.Lw(L, "input_layernorm.weight"), c.eps)
        if L in c.kda_layers:
            a, states[L] = kda_layer(m, L, xn, states[L])
        else:
            a, states[L] = mla_layer(m, L, xn, states[L])
        P = a if P is None else P + a
        y = attn_res(B, P, m.Lw(L, "mlp_res_norm.weight"), m.Lw(L, "mlp_res_proj.weight"), c.eps)
        f = ffn(m, L, rms_norm(y, m.Lw(L, "post_attention_layernorm.weight"), c.eps), stats)
        P = P + f
        if trace is not None:
            trace.append(P.clone())
        h = P
    return attn_res(B, P, m.W("model.output_attn_res_norm.weight"), m.W("model.output_attn_res_proj.weight"), c.eps)


def init_states(m):
    c = m.cfg
    dt = getattr(m, "dtype", torch.float32)
    return [kda_state0(c, dt) if L in c.kda_layers else mla_cache0(c, dt) for L in range(c.n_layers)]


def logits_of(m, h):
    return mm(rms_norm(h, m.W("model.norm.weight"), m.cfg.eps), m.W("lm_head.weight"))


def forward_full(m, ids, stats=None, trace=None):
    """Whole sequence at once -> logits [T, vocab]."""
    h = m.W("model.embed_tokens.weight")[torch.tensor(ids, dtype=torch.long)]
    return logits_of(m, run_layers(m, h, init_states(m), stats, trace))


class Session:
    """Incremental decoding: one token per step, state carried across steps."""

    def __init__(self, m):
        self.m = m
        self.states = init_states(m)

        self.pos = 0

    def feed(self, toks, stats=None, trace=None):
        """Process len(toks) new positions at once (a prefill chunk) -> logits [T, V]."""
        if stats is not None:
            stats.pos0 = self.pos
        h = self.m.W("model.embed_tokens.weight")[torch.tensor(list(toks), dtype=torch.long)]
        self.pos += len(toks)
        return logits_of(self.m, run_layers(self.m, h, self.states, stats, trace))

    def step(self, tok, stats=None, trace=None):
        return self.feed([tok], stats, trace)[0]


def greedy(m, prompt, n, incremental=False):
    """Greedy continuation of n tokens. incremental=False recomputes the full
    sequence for every new token (the full path); True carries state."""
    ids = list(prompt)
    out = []
    if incremental:
        s = Session(m)
        for t in prompt[:-1]:
            s.step(t)
        lg = s.step(prompt[-1])
        for _ in range(n):
            nxt = int(torch.argmax(lg))
            out.append(nxt)
            lg = s.step(nxt)
        return out
    for _ in range(n):
        lg = forward_full(m, ids)[-1]
        nxt = int(torch.argmax(lg))
        out.append(nxt)
        ids.append(nxt)
    return out


def main():
    ap = argparse.ArgumentParser(description="K3 fp32 reference")
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="comma-separated prompt ids")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--incremental", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = Model(a.model)
    prompt = [int(x) for x in a.ids.split(",")]
    with torch.no_grad():
        print(json.dumps({"prompt_ids": prompt, "generated_ids": greedy(m, prompt, a.gen, a.incremental)}))


if __name__ == "__main__":
    sys.exit(main())
