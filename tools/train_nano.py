#!/usr/bin/env python3
"""Trains K3-nano, a small Kimi K3 that speaks, on CPU, and writes it in the
published checkpoint layout (tests/models/k3-nano).

    nice -n 10 python3 tools/train_nano.py --work /tmp/nano --out tests/models/k3-nano \
        [--budget 1900 | --decay-at STEP] [--batch 4] [--threads 1] [--seed 1]

Stages (each result cached in --work, so a rerun resumes after the last finished one):
  1. data:  tools/nano_data.py (Python 3.11 standard library documentation, PSF
            licence) -> documents; 5% held out by a hash of the document name;
  2. vocab: the project's byte-level BPE (tools/train_vocab.py, the K3
            pre-tokenizer) trained on the training documents, 1792 ranks
            (+256 specials = vocab 2048);
  3. train: the K3 graph of tools/reference.py written batched for training
            (class Nano below): KDA (short conv, L2-normed q/k, lower-bound gate,
            delta rule, gated o_norm) and gated MLA (NoPE, latent cache),
            Attention Residuals, dense SiTU-GLU layer 0, latent MoE with a
            sigmoid router + e_score_correction_bias (top-k on score+bias,
            weights from the score, renormalised, aux-loss-free bias update),
            routed experts in the latent width with SiTU-GLU, shared experts.
            AdamW, fixed seed; warmup, constant lr until the wall-time budget
            (--budget) or --decay-at, then a linear decay over a quarter as many
            steps during which the routed experts are seen through MXFP4 fake
            quantization (straight-through), so the native storage costs
            little. The step where the decay began is recorded: rerunning with
            --decay-at that step repeats the run. One line of loss per step in
            the raw log (--log);
  4. export: tools/make_tiny_k3.py's writer (same tensor list, names, dtypes,
            shard layout, config.json and tokenizer files): trunk bf16, routed
            experts MXFP4 (weight_packed/weight_scale), A_log F32 padded;
  5. check: the exported files through tools/reference.py (the independent fp32
            reference) against the training graph on the fp32 weights (same
            math: max |logit diff|), and held-out perplexity for fp32 training
            weights (training graph and reference) and the exported bf16/MXFP4
            files (reference) -> WORK/train_report.json; README.md (recipe,
            seed, data list, figures) and MANIFEST.json (sha256s) in --out.

Determinism: torch.manual_seed(seed), numpy RandomState(seed) for batches,
the step count fixed by --decay-at; single-process CPU. Bit-identical reruns need the same torch
version and thread count (recorded in the report).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_tiny_k3 as MK  # noqa: E402
import nano_data  # noqa: E402
import reference as R  # noqa: E402
import train_vocab  # noqa: E402

PRESET = dict(
    vocab_from_tokenizer=True, hidden=256, layers=6, block=2,
    kda_heads=4, kda_head_dim=32, a_log_len=8, conv=4, gate_lower_bound=-5.0,
    mla_heads=4, q_lora=128, kv_lora=64, nope=32, rope=16, v_dim=32,
    inter=512, moe_inter=64, latent=64, experts=32, topk=4, shared=2,
    quantized=True, dtype="bfloat16", router_tie=None, max_pos=4096,
    shard_bytes=4_000_000, vt=32)
RANKS = 1792
CTX = 256
BETA1, BETA2 = 4.0, 25.0  # activation_situ_beta, activation_situ_linear_beta (official config)
PFX = "language_model."


def log(s):
    print(f"train_nano: {s}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- tokenizer

def encoder(vocab_path, special_base):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(vocab_path)
    tc = json.load(open(MK.TEMPLATE_TOKCFG, encoding="utf-8"))
    specials = {v["content"]: int(k) - MK.K3_SPECIAL_BASE + special_base for k, v in tc["added_tokens_decoder"].items()}
    return tiktoken.Encoding("k3-nano", pat_str=train_vocab.K3_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials), specials


def chat_ids(enc, sp, question, answer, thinking):
    """A user turn and the assistant's answer in the K3 XTML format (SPEC §5.4),
    every segment encoded separately, as the chat encoder does."""
    def t(s):
        return enc.encode(s, disallowed_special=())

    def open_msg(role):
        return [sp["<|open|>"]] + t("message") + t(" role") + t('="') + t(role) + t('"') + [sp["<|sep|>"]]

    def close(tag):
        return [sp["<|close|>"]] + t(tag) + [sp["<|sep|>"]]

    ids = open_msg("user") + t(question) + close("message") + [sp["<|end_of_msg|>"]]
    ids += open_msg("assistant")
    if thinking:
        ids += [sp["<|open|>"]] + t("think") + [sp["<|sep|>"]] + close("think")
    ids += [sp["<|open|>"]] + t("response") + [sp["<|sep|>"]] + t(answer) + close("response")
    ids += close("message") + [sp["<|end_of_msg|>"]]
    return ids


def doc_ids(enc, sp, name, kind, payload):
    if kind == "text":
        return enc.encode(payload, disallowed_special=()) + [sp["[EOS]"]]
    thinking = nano_data.held_out(name + "/think") or (sum(map(ord, name)) % 2 == 0)
    return chat_ids(enc, sp, payload[0], payload[1], thinking)


# ---------------------------------------------------------------- the model (training graph)

def rms_norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def situ(g, u):
    return (BETA1 * torch.tanh(g / BETA1) * torch.sigmoid(g)) * (BETA2 * torch.tanh(u / BETA2))


E2M1_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDS = (E2M1_MAGS[1:] + E2M1_MAGS[:-1]) / 2


def mxfp4_fake(w):
    """MXFP4 round trip of w [rows, cols] (blocks of 32 along cols), the rule of
    mxfp4_quant below; straight-through gradient."""
    rows, cols = w.shape
    b = w.detach().reshape(rows, cols // 32, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    sc = torch.pow(2.0, torch.ceil(torch.log2(amax / 6.0)))
    x = (b / sc).abs()
    idx = torch.bucketize(x, E2M1_MIDS)  # nearest magnitude, ties to the smaller
    q = (E2M1_MAGS[idx] * torch.sign(b) * sc).reshape(rows, cols)
    return w + (q - w).detach()


CHUNK = 16


def kda_chunked(q, k, v, g, beta, chunk=CHUNK):
    """The delta rule of tools/reference.py's kda_recurrence (state decayed by
    exp(g_t) per key channel, then u = beta (v - S^T k), S += k u^T, o = S^T q),
    computed chunk by chunk: within a chunk the updates solve one unit lower
    triangular system (exact algebra, pairwise decays exp(G_t - G_s) formed
    directly, never 1/exp); across chunks the state is carried. q, k, v, g
    [B, T, H, D], beta [B, T, H] -> o [B, T, H, D] (zero initial state)."""
    B, T, H, D = q.shape
    Cn = chunk
    assert T % Cn == 0
    N = T // Cn

    def ch(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        return x.view(B, N, Cn, H, *x.shape[3:]).transpose(2, 3).transpose(1, 2)

    q, k, v, g, beta = ch(q), ch(k), ch(v), ch(g), ch(beta)
    G = torch.cumsum(g, 3)  # [B, H, N, C, D] cumulative log decay within the chunk (inclusive)
    idx = torch.arange(Cn)
    strict = (idx[:, None] > idx[None, :])
    incl = (idx[:, None] >= idx[None, :])
    # exp(G_t - G_s) = exp(G_t) exp(-G_s): g >= lower bound (-5), so over a chunk of 16
    # G >= -80 and both factors stay normal fp32 numbers; entries with s > t are
    # finite and then masked out
    eG = torch.exp(G)
    kbar, qbar, khat = eG * k, eG * q, torch.exp(-G) * k
    zero = q.new_zeros(())
    M = torch.where(strict, kbar @ khat.transpose(-1, -2), zero)  # k_t . k_s exp(G_t - G_s), s < t
    Qk = torch.where(incl, qbar @ khat.transpose(-1, -2), zero)  # q_t . k_s exp(G_t - G_s), s <= t
    # (I + A)^-1 for the strictly lower (nilpotent, A^16 = 0) A = diag(beta) M:
    # (I - A)(I + A^2)(I + A^4)(I + A^8)
    A = beta[..., None] * M
    eye = torch.eye(Cn, dtype=q.dtype)
    Tinv = eye - A
    P = A
    j = 2
    while j < Cn:
        P = P @ P
        Tinv = Tinv + Tinv @ P
        j *= 2
    W1 = Tinv @ (beta[..., None] * v)
    W2 = Tinv @ (beta[..., None] * kbar)
    GC = G[..., -1:, :]  # [B, H, N, 1, D]
    kend = torch.exp(GC - G) * k  # decay from s to the chunk's end
    S = q.new_zeros(B, H, D, v.shape[-1])
    outs = []
    for n in range(N):
        u = W1[:, :, n] - W2[:, :, n] @ S  # [B, H, C, V]
        outs.append(qbar[:, :, n] @ S + Qk[:, :, n] @ u)
        S = torch.exp(GC[:, :, n, 0])[..., None] * S + kend[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, 2)  # [B, H, N, C, V]
    return o.transpose(1, 2).reshape(B, N, H, Cn, -1).transpose(2, 3).reshape(B, T, H, -1)


class Nano(torch.nn.Module):
    """tools/reference.py's graph on batches [B, T]; parameters keyed by the
    checkpoint's tensor names (without the language_model. prefix, dots as '|')."""

    def __init__(self, p, cfg):
        super().__init__()
        self.p, self.cfg = p, cfg
        self.kinds = MK.schedule(p["layers"])
        self.params = torch.nn.ParameterDict()
        self.buf = {}
        self.fake_quant = False
        self.bf16_expert_out = False
        d, V, H, D = p["hidden"], p["vocab"], p["kda_heads"], p["kda_head_dim"]
        C = H * D
        std = 0.02
        out_std = 0.02 / math.sqrt(2 * p["layers"])

        def P(name, *shape, init="normal", s=std, val=None):
            if init == "normal":
                t = torch.randn(*shape) * s
            elif init == "ones":
                t = torch.ones(*shape)
            elif init == "zeros":
                t = torch.zeros(*shape)
            elif init == "value":
                t = val.clone().float()
            self.params[name.replace(".", "|")] = torch.nn.Parameter(t)

        for L in range(p["layers"]):
            pre = f"model.layers.{L}."
            for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
                P(pre + nm + ".weight", d, init="ones")
            for nm in ("self_attention_res_proj", "mlp_res_proj"):
                P(pre + nm + ".weight", 1, d, init="zeros")
            a = pre + "self_attn."
            if self.kinds[L] == "kda":
                for nm in ("q", "k", "v"):
                    P(a + nm + "_proj.weight", C, d)
                    taps = torch.randn(C, 1, p["conv"]) * 0.1
                    taps[:, 0, -1] += 1.0  # start near the identity (tap K-1 = current token)
                    P(a + nm + "_conv1d.weight", init="value", val=taps)
                P(a + "f_a_proj.weight", D, d)
                P(a + "f_b_proj.weight", C, D, s=0.1)
                P(a + "b_proj.weight", H, d)
                P(a + "A_log", H, init="zeros")
                # g = -5 sigmoid(z + dt_bias): per-channel decay from ~0.9998 to ~0.4
                P(a + "dt_bias", init="value", val=torch.linspace(-10.0, -1.0, C)[torch.randperm(C)])
                P(a + "o_norm.weight", D, init="ones")
                P(a + "g_proj.weight", C, d)
                P(a + "o_proj.weight", d, C, s=out_std)
            else:
                Hm = p["mla_heads"]
                P(a + "q_a_proj.weight", p["q_lora"], d)
                P(a + "q_a_layernorm.weight", p["q_lora"], init="ones")
                P(a + "q_b_proj.weight", Hm * (p["nope"] + p["rope"]), p["q_lora"], s=1 / math.sqrt(p["q_lora"]))
                P(a + "kv_a_proj_with_mqa.weight", p["kv_lora"] + p["rope"], d)
                P(a + "kv_a_layernorm.weight", p["kv_lora"], init="ones")
                P(a + "kv_b_proj.weight", Hm * (p["nope"] + p["v_dim"]), p["kv_lora"], s=1 / math.sqrt(p["kv_lora"]))
                P(a + "g_proj.weight", Hm * p["v_dim"], d)
                P(a + "o_proj.weight", d, Hm * p["v_dim"], s=out_std)
            if L < 1:
                m = pre + "mlp."
                P(m + "gate_proj.weight", p["inter"], d)
                P(m + "up_proj.weight", p["inter"], d)
                P(m + "down_proj.weight", d, p["inter"], s=out_std)
            else:
                m = pre + "block_sparse_moe."
                E, lat, fi = p["experts"], p["latent"], p["moe_inter"]
                P(m + "gate.weight", E, d)
                self.buf[m + "gate.e_score_correction_bias"] = torch.zeros(E)
                P(m + "routed_expert_down_proj.weight", lat, d)
                P(m + "routed_expert_norm.weight", lat, init="ones")
                P(m + "routed_expert_up_proj.weight", d, lat, s=out_std)
                sw = p["shared"] * fi
                P(m + "shared_experts.gate_proj.weight", sw, d)
                P(m + "shared_experts.up_proj.weight", sw, d)
                P(m + "shared_experts.down_proj.weight", d, sw, s=out_std)
                # routed experts stacked [E, rows, cols] for training; named() splits them
                P(m + "experts.w1", E, fi, lat, s=1 / math.sqrt(lat))
                P(m + "experts.w3", E, fi, lat, s=1 / math.sqrt(lat))
                P(m + "experts.w2", E, lat, fi, s=0.5 / math.sqrt(fi))
        P("model.embed_tokens.weight", V, d, s=1.0)
        P("lm_head.weight", V, d, s=1 / math.sqrt(d))
        P("model.norm.weight", d, init="ones")
        P("model.output_attn_res_norm.weight", d, init="ones")
        P("model.output_attn_res_proj.weight", 1, d, init="zeros")

    def W(self, name):
        return self.params[name.replace(".", "|")]

    def named(self):
        """{checkpoint name without prefix: fp32 tensor} of every weight and buffer."""
        out = {}
        for k, v in self.params.items():
            k = k.replace("|", ".")
            if ".experts.w" in k:
                m, w = k.rsplit(".experts.", 1)
                for e in range(v.shape[0]):
                    out[f"{m}.experts.{e}.{w}.weight"] = v[e].detach().clone()
            else:
                out[k] = v.detach().clone()
        out.update({k: v.clone() for k, v in self.buf.items()})
        return out

    # -- blocks
    def attn_res(self, blocks, p, wn, wp):
        V = torch.stack(list(blocks) + [p], 0)  # [n+1, B, T, d]
        s = (rms_norm(V, wn, self.cfg.eps) @ wp.t())[..., 0]
        a = torch.softmax(s, 0)
        return (a[..., None] * V).sum(0)

    def kda(self, L, x):
        p, c = self.p, self.cfg
        a = f"model.layers.{L}.self_attn."
        B, T, _ = x.shape
        H, D, K = p["kda_heads"], p["kda_head_dim"], p["conv"]
        qkv = {}
        for nm in ("q", "k", "v"):
            pre = (x @ self.W(a + nm + "_proj.weight").t()).transpose(1, 2)  # [B, C, T]
            out = F.conv1d(F.pad(pre, (K - 1, 0)), self.W(a + nm + "_conv1d.weight"), groups=pre.shape[1])
            qkv[nm] = F.silu(out.transpose(1, 2))
        q = R.l2norm(qkv["q"].view(B, T, H, D)) * (D ** -0.5)
        k = R.l2norm(qkv["k"].view(B, T, H, D))
        v = qkv["v"].view(B, T, H, D)
        zg = (x @ self.W(a + "f_a_proj.weight").t()) @ self.W(a + "f_b_proj.weight").t()
        z = (zg + self.W(a + "dt_bias")).view(B, T, H, D)
        A = torch.exp(self.W(a + "A_log")).view(1, 1, H, 1)
        g = c.lower_bound * torch.sigmoid(A * z)
        beta = torch.sigmoid(x @ self.W(a + "b_proj.weight").t())
        o = kda_chunked(q, k, v, g, beta)
        G = (x @ self.W(a + "g_proj.weight").t()).view(B, T, H, D)
        o = rms_norm(o, self.W(a + "o_norm.weight"), c.eps) * torch.sigmoid(G)
        return o.reshape(B, T, H * D) @ self.W(a + "o_proj.weight").t()

    def mla(self, L, x):
        p = self.p
        a = f"model.layers.{L}.self_attn."
        B, T, _ = x.shape
        Hm, nope, rope, vd = p["mla_heads"], p["nope"], p["rope"], p["v_dim"]
        q = rms_norm(x @ self.W(a + "q_a_proj.weight").t(), self.W(a + "q_a_layernorm.weight"), 1e-6)
        q = (q @ self.W(a + "q_b_proj.weight").t()).view(B, T, Hm, nope + rope)
        ckv = x @ self.W(a + "kv_a_proj_with_mqa.weight").t()
        chat = rms_norm(ckv[..., : p["kv_lora"]], self.W(a + "kv_a_layernorm.weight"), 1e-6)
        kpe = ckv[..., p["kv_lora"]:]
        kv = (chat @ self.W(a + "kv_b_proj.weight").t()).view(B, T, Hm, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, kpe[:, :, None, :].expand(B, T, Hm, rope)], -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=1.0 / math.sqrt(nope + rope))
        o = o.transpose(1, 2).reshape(B, T, Hm * vd)
        o = o * torch.sigmoid(x @ self.W(a + "g_proj.weight").t())
        return o @ self.W(a + "o_proj.weight").t()

    def moe(self, L, x, loads):
        p = self.p
        m = f"model.layers.{L}.block_sparse_moe."
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        s = torch.sigmoid(xf @ self.W(m + "gate.weight").t())
        bias = self.buf[m + "gate.e_score_correction_bias"]
        ids = torch.topk(s.detach() + bias, p["topk"], -1).indices
        w = torch.gather(s, 1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.cfg.scaling
        loads[L] = torch.bincount(ids.reshape(-1), minlength=p["experts"]).float()
        z = xf @ self.W(m + "routed_expert_down_proj.weight").t()
        # tokens sorted by expert into [E, capacity, latent] (zero padding), one bmm per matrix
        E, k = p["experts"], p["topk"]
        fe = ids.reshape(-1)
        ftok = torch.arange(xf.shape[0]).repeat_interleave(k)
        order = torch.argsort(fe, stable=True)
        es = fe[order]
        counts = loads[L].long()
        pos = torch.arange(fe.numel()) - (torch.cumsum(counts, 0) - counts)[es]
        buf = z.new_zeros(E, int(counts.max()), z.shape[1])
        buf = buf.index_put((es, pos), z[ftok[order]])
        W1, W3, W2 = (self.W(f"{m}experts.{n}") for n in ("w1", "w3", "w2"))
        if self.fake_quant:
            W1, W3, W2 = (mxfp4_fake(t.reshape(-1, t.shape[-1])).view(t.shape) for t in (W1, W3, W2))
        y = torch.bmm(situ(torch.bmm(buf, W1.transpose(1, 2)), torch.bmm(buf, W3.transpose(1, 2))),
                      W2.transpose(1, 2))
        if self.bf16_expert_out:  # the reference's (and SPEC §3.6's) rounding of y_e; off in training
            y = R.bf16_round(y)
        r = torch.zeros_like(z).index_add(0, ftok[order], w.reshape(-1)[order][:, None] * y[es, pos])
        r = rms_norm(r, self.W(m + "routed_expert_norm.weight"), self.cfg.eps)
        r = r @ self.W(m + "routed_expert_up_proj.weight").t()
        sh = situ(xf @ self.W(m + "shared_experts.gate_proj.weight").t(), xf @ self.W(m + "shared_experts.up_proj.weight").t())
        sh = sh @ self.W(m + "shared_experts.down_proj.weight").t()
        return (r + sh).view(B, T, d)

    def dense(self, L, x):
        m = f"model.layers.{L}.mlp."
        return situ(x @ self.W(m + "gate_proj.weight").t(), x @ self.W(m + "up_proj.weight").t()) @ \
            self.W(m + "down_proj.weight").t()

    def forward(self, ids, loads=None):
        c = self.cfg
        loads = {} if loads is None else loads
        h = self.W("model.embed_tokens.weight")[ids]
        Bk, P = [], None
        for L in range(self.p["layers"]):
            pre = f"model.layers.{L}."
            x = self.attn_res(Bk, h, self.W(pre + "self_attention_res_norm.weight"),
                              self.W(pre + "self_attention_res_proj.weight")) if Bk else h
            if L % c.block == 0:
                Bk.append(h)
                P = None
            else:
                P = h
            xn = rms_norm(x, self.W(pre + "input_layernorm.weight"), c.eps)
            a = self.kda(L, xn) if self.kinds[L] == "kda" else self.mla(L, xn)
            P = a if P is None else P + a
            y = self.attn_res(Bk, P, self.W(pre + "mlp_res_norm.weight"), self.W(pre + "mlp_res_proj.weight"))
            yn = rms_norm(y, self.W(pre + "post_attention_layernorm.weight"), c.eps)
            P = P + (self.dense(L, yn) if L < c.first_dense else self.moe(L, yn, loads))
            h = P
        h = self.attn_res(Bk, P, self.W("model.output_attn_res_norm.weight"),
                          self.W("model.output_attn_res_proj.weight"))
        return rms_norm(h, self.W("model.norm.weight"), c.eps) @ self.W("lm_head.weight").t()


# ---------------------------------------------------------------- export

E2M1_NP = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quant(w):
    """fp32 [rows, cols] -> (weight_packed U8 [rows, cols/2], weight_scale U8 [rows, cols/32]).
    Per block of 32: scale 2^ceil(log2(amax/6)) (no clipping), each value to the
    nearest E2M1 magnitude (ties to the smaller), sign in bit 3; element 2j in
    the low nibble (SPEC §4)."""
    rows, cols = w.shape
    b = w.astype(np.float64).reshape(rows, cols // 32, 32)
    amax = np.abs(b).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-300) / 6.0)), -127.0)
    e = np.clip(e, -127, 127)
    x = b / np.power(2.0, e)[..., None]
    idx = np.abs(np.abs(x)[..., None] - E2M1_NP).argmin(-1)
    codes = (idx + 8 * (x < 0)).reshape(rows, cols).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), (e + 127).astype(np.uint8)


def export(named, p, vocab_path, out, seed):
    os.makedirs(out, exist_ok=True)
    MK.VOCAB = vocab_path
    base = MK.write_tokenizer(out, p)
    assert base + 256 == p["vocab"], (base, p["vocab"])
    MK.write_config(out, p, base)
    tensors = MK.build(p, seed)
    byname = {t.name: t for t in tensors}
    done = set()
    for t in tensors:
        if not t.name.startswith(PFX):
            continue  # vision tower: the writer's seeded filler (a text engine skips it)
        key = t.name[len(PFX):]
        if key.endswith(".weight_packed") or key.endswith(".weight_scale"):
            base_name = key.rsplit(".", 1)[0] + ".weight"
            if base_name in done:
                continue
            pk, sc = mxfp4_quant(named[base_name].numpy())
            byname[PFX + base_name + "_packed"].fill = ("array", pk)
            byname[PFX + base_name + "_scale"].fill = ("array", sc)
            assert list(pk.shape) == byname[PFX + base_name + "_packed"].shape
            assert list(sc.shape) == byname[PFX + base_name + "_scale"].shape
            done.add(base_name)
            continue
        v = named[key]
        if key.endswith("A_log"):
            pad = np.zeros(t.shape[0], dtype=np.float64)
            pad[: v.numel()] = v.numpy()
            v = torch.from_numpy(pad)
        assert list(v.shape) == t.shape, (key, list(v.shape), t.shape)
        t.fill = ("array", v.double().numpy().astype(np.float32))
    shards = MK.shard_plan(tensors, p["shard_bytes"])
    n = len(shards)
    wmap, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:06d}.safetensors"
        total += MK.write_shard(os.path.join(out, fn), sh, seed)
        for t in sh:
            wmap[t.name] = fn
    idx = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    return total


def ref_model_from(named, cfg_path):
    """tools/reference.py's Model over in-memory fp32 weights (no rounding)."""
    m = R.Model.__new__(R.Model)
    m.dir = None
    m.cfg = R.Config(cfg_path)
    m.w = {PFX + k: v.float() for k, v in named.items()}
    return m


# ---------------------------------------------------------------- main

def windows(stream, n, ctx):
    """The first n non-overlapping windows of ctx+1 tokens (held-out evaluation)."""
    return [stream[i * ctx: i * ctx + ctx + 1] for i in range(n) if (i + 1) * ctx + 1 <= len(stream)]


def nll_ref(m, wins):
    """Per-token negative log-likelihood of each window's tokens 1..ctx from the reference."""
    out = []
    with torch.no_grad():
        for w in wins:
            lg = R.forward_full(m, w[:-1])
            lp = torch.log_softmax(lg.double(), -1)
            out.append((-lp[torch.arange(len(w) - 1), torch.tensor(w[1:])]).tolist())
    return out


def write_card(out, rep):
    """README.md (what, recipe, seed, data list, figures) and MANIFEST.json (sha256
    of every file) in the model directory."""
    import hashlib
    p = dict(PRESET, vocab=RANKS + 256)
    lic, files = nano_data.data_list()
    hp = rep["heldout_ppl"]
    cmd = (f"nice -n 10 python3 tools/train_nano.py --work WORK --out tests/models/k3-nano --seed {rep['seed']} "
           f"--batch {rep['batch']} --threads {rep['threads']} --decay-at {rep['decay_at']}")
    lines = [
        "# K3-nano",
        "",
        "A small Kimi K3 trained from scratch on CPU by `tools/train_nano.py`, so that the engine's output can be",
        "read: the K3 text architecture at toy widths, in the published checkpoint layout (bf16 trunk, routed",
        "experts in native MXFP4 `weight_packed`/`weight_scale`, F32 `A_log`/`dt_bias`/conv taps/`o_norm`/router",
        "bias, `config.json` in the official nested layout, `tiktoken.model` + `tokenizer_config.json`).",
        "It knows a little of the Python 3.11 documentation and the K3 chat format; it is not a useful assistant.",
        "",
        "## Architecture",
        "",
        f"- {p['layers']} layers: {', '.join(MK.schedule(p['layers']))} (MLA where (L+1) % 4 == 0 and on the last",
        f"  layer, the real K3 pattern); Attention Residuals with block size {p['block']}",
        f"- hidden {p['hidden']}; KDA {p['kda_heads']} heads x {p['kda_head_dim']}, short conv {p['conv']}, "
        f"gate lower bound {p['gate_lower_bound']}",
        f"- MLA {p['mla_heads']} heads, q_lora {p['q_lora']}, kv_lora {p['kv_lora']}, nope {p['nope']} + rope "
        f"{p['rope']}, v {p['v_dim']}, output gate",
        f"- layer 0 dense SiTU-GLU ({p['inter']}); layers 1-{p['layers'] - 1} latent MoE: {p['experts']} routed "
        f"experts (top-{p['topk']}, sigmoid router + correction bias, renormalised), latent {p['latent']}, "
        f"expert width {p['moe_inter']}, {p['shared']} shared experts",
        f"- vocabulary {p['vocab']} ({RANKS} byte-level BPE ranks trained on the training text with the K3 "
        f"pre-tokenizer, + 256 specials at the K3 offsets)",
        f"- {rep['parameters']:,} parameters",
        "",
        "## Training recipe",
        "",
        "```",
        cmd,
        "```",
        "",
        f"- seed {rep['seed']}; {rep['steps']} steps of {rep['batch']} x {rep['ctx']} tokens (AdamW, lr {rep['lr']},"
        f" betas 0.9/0.95, weight decay 0.1, clip 1.0; 50 warmup steps, constant, then linear decay from step "
        f"{rep['decay_at']} with the routed experts seen through MXFP4 fake quantization)",
        f"- wall time {rep['train_seconds'] / 60:.1f} min on a shared 2-core machine, torch {rep['torch']}, "
        f"{rep['threads']} thread(s); loss curve: docs/nano_loss.svg (raw log docs/data/nano_train_log.tsv)",
        f"- {rep['train_tokens']:,} training tokens, {rep['heldout_tokens']:,} held-out tokens "
        f"(documents with sha256(name) % 20 == 0)",
        "",
        "## Held-out perplexity",
        "",
        f"{rep['eval_windows']} windows of {rep['ctx']} held-out tokens:",
        "",
        "| weights | perplexity |",
        "|---|---|",
        f"| fp32 training weights, training graph | {hp['fp32_training_graph']:.3f} |",
        f"| fp32 training weights, tools/reference.py | {hp['fp32_reference']:.3f} |",
        f"| these files (bf16 trunk, MXFP4 experts), tools/reference.py | {hp['bf16_mxfp4_reference']:.3f} |",
        "",
        "## Data",
        "",
        f"{lic}. Read by tools/nano_data.py: the language reference topics (pydoc_data/topics.py), the",
        "docstrings of these modules, and chat turns made from both. Files, relative to /usr/lib/python3.11:",
        "",
        "```",
        *files,
        "```",
        "",
        "MANIFEST.json holds the sha256 of every other file here.",
        "",
    ]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))
    man = {}
    for fn in sorted(os.listdir(out)):
        if fn != "MANIFEST.json":
            man[fn] = hashlib.sha256(open(os.path.join(out, fn), "rb").read()).hexdigest()
    with open(os.path.join(out, "MANIFEST.json"), "w") as f:
        f.write(json.dumps({"model": "k3-nano", "generator": "tools/train_nano.py", "seed": rep["seed"],
                            "sha256": man}, indent=1, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="cache directory (documents, vocabulary, checkpoints)")
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--budget", type=float, default=2400, help="training wall time (s) before the decay phase")
    ap.add_argument("--decay-at", type=int, help="start the decay phase at this step (reproduces a budgeted run)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    # one thread: on a shared, oversubscribed machine two OpenMP threads ran a
    # training step 25x slower (every parallel region waits for a descheduled thread)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log", help="raw training log (default WORK/train_log.tsv)")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--card-only", action="store_true", help="only (re)write README.md and MANIFEST.json of --out")
    a = ap.parse_args()
    if a.card_only:
        write_card(a.out, json.load(open(os.path.join(a.work, "train_report.json"))))
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    os.makedirs(a.work, exist_ok=True)
    p = dict(PRESET)
    p["vocab"] = RANKS + 256

    # 1-2: data and vocabulary
    docs = nano_data.documents()
    train_docs = [d for d in docs if not nano_data.held_out(d[0])]
    held_docs = [d for d in docs if nano_data.held_out(d[0])]
    vocab_path = os.path.join(a.work, "k3-nano.tiktoken")
    if not os.path.exists(vocab_path):
        t0 = time.time()
        text = "\n\n".join(pl if k == "text" else pl[0] + "\n" + pl[1]
                           for n, k, pl in nano_data.documents(module_chars=None) if not nano_data.held_out(n))
        voc = train_vocab.train(text, RANKS)
        import base64
        with open(vocab_path + ".tmp", "wb") as f:
            for r, b in enumerate(voc):
                f.write(base64.b64encode(b) + b" " + str(r).encode() + b"\n")
        os.replace(vocab_path + ".tmp", vocab_path)
        log(f"vocabulary: {RANKS} ranks in {time.time() - t0:.0f} s")
    enc, sp = encoder(vocab_path, RANKS)
    rng = np.random.RandomState(a.seed)
    order = rng.permutation(len(train_docs))
    stream = []
    for i in order:
        stream += doc_ids(enc, sp, *train_docs[i])
    held = []
    for d in held_docs:
        held += doc_ids(enc, sp, *d)
    stream = np.array(stream, dtype=np.int64)
    nchars = sum(len(pl) if k == "text" else len(pl[0]) + len(pl[1]) for _, k, pl in train_docs)
    log(f"{len(train_docs)} training documents, {len(stream)} tokens ({nchars / len(stream):.2f} chars/token); "
        f"{len(held_docs)} held out, {len(held)} tokens")

    # model dir skeleton for the config (the reference reads it)
    cfg_dir = os.path.join(a.work, "cfg")
    os.makedirs(cfg_dir, exist_ok=True)
    MK.VOCAB = vocab_path
    MK.write_config(cfg_dir, p, MK.write_tokenizer(cfg_dir, p))
    cfg = R.Config(os.path.join(cfg_dir, "config.json"))
    model = Nano(p, cfg)
    nparam = sum(v.numel() for v in model.params.values())
    log(f"{nparam} parameters; layers {model.kinds}")

    decay = [v for k, v in model.params.items() if v.dim() == 2 and "res_proj" not in k]
    nodecay = [v for k, v in model.params.items() if not (v.dim() == 2 and "res_proj" not in k)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = os.path.join(a.work, "final.pt")
    log_path = a.log or os.path.join(a.work, "train_log.tsv")
    warm = 50
    if not os.path.exists(ckpt):
        lf = open(log_path, "w")
        lf.write(f"# train_nano seed={a.seed} batch={a.batch} ctx={CTX} lr={a.lr} threads={a.threads} "
                 f"budget_s={a.budget} decay_at={a.decay_at} torch={torch.__version__}\n")
        lf.write("step\telapsed_s\tlr\tloss\tgrad_norm\tmxfp4_fake_quant\n")
        t0 = time.time()
        # warmup-stable-decay: constant lr after warmup until the wall-time budget
        # (or --decay-at) is reached at step D, then linear decay to 0 over
        # max(20, D // 4) steps with the experts seen through MXFP4 (QAT)
        decay_at, total, step = a.decay_at, None, 0
        while total is None or step < total:
            if a.bench and step >= a.bench:
                return 0
            if decay_at is None and time.time() - t0 >= a.budget:
                decay_at = step
            if decay_at is not None and total is None:
                total = decay_at + max(20, decay_at // 4)
                log(f"decay phase from step {decay_at} to {total}")
            if step < warm:
                lr = a.lr * (step + 1) / warm
            elif decay_at is None or step < decay_at:
                lr = a.lr
            else:
                lr = a.lr * (total - step) / (total - decay_at)
            for g in opt.param_groups:
                g["lr"] = lr
            model.fake_quant = decay_at is not None and step >= decay_at
            starts = rng.randint(0, len(stream) - CTX - 1, size=a.batch)
            batch = torch.from_numpy(np.stack([stream[s: s + CTX + 1] for s in starts]))
            loads = {}
            logits = model(batch[:, :-1], loads)
            loss = F.cross_entropy(logits.reshape(-1, p["vocab"]), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            with torch.no_grad():  # aux-loss-free balancing: bias += gamma * sign(mean load - load)
                for L, ld in loads.items():
                    b = model.buf[f"model.layers.{L}.block_sparse_moe.gate.e_score_correction_bias"]
                    b += 1e-3 * torch.sign(ld.mean() - ld)
            el = time.time() - t0
            lf.write(f"{step}\t{el:.1f}\t{lr:.6g}\t{loss.item():.5f}\t{gn:.4f}\t{int(model.fake_quant)}\n")
            lf.flush()
            if step % 10 == 0:
                log(f"step {step} loss {loss.item():.4f} lr {lr:.2e} gn {gn:.2f} {el:.0f} s "
                    f"({(step + 1) * a.batch * CTX / el:.0f} tok/s)")
            step += 1
        lf.close()
        torch.save({"named": model.named(), "train_s": time.time() - t0, "decay_at": decay_at, "steps": total},
                   ckpt)
    st = torch.load(ckpt)
    named, train_s = st["named"], st["train_s"]
    a.steps, a.decay_at = st["steps"], st["decay_at"]

    # 4: export
    total = export(named, p, vocab_path, a.out, a.seed)
    log(f"exported {total} bytes of tensors to {a.out}")

    # 5: checks and held-out perplexity
    wins = windows(held, a.eval_windows, CTX)
    for k, v in named.items():
        model.params[k.replace(".", "|")].data.copy_(v) if k.replace(".", "|") in model.params else None
    model.fake_quant = False
    with torch.no_grad():
        lg = model(torch.tensor([w[:-1] for w in wins]))
        lp = torch.log_softmax(lg.double(), -1)
        nll_train = [(-lp[i, torch.arange(CTX), torch.tensor(w[1:])]).tolist() for i, w in enumerate(wins)]
    m32 = ref_model_from(named, os.path.join(a.out, "config.json"))
    with torch.no_grad():
        ref0 = R.forward_full(m32, wins[0][:-1])
        d = float((ref0 - lg[0]).abs().max())
        model.bf16_expert_out = True
        d_bf16 = float((ref0 - model(torch.tensor([wins[0][:-1]]))[0]).abs().max())
        model.bf16_expert_out = False
    nll32 = nll_ref(m32, wins)
    mq = R.Model(a.out)
    nllq = nll_ref(mq, wins)

    def ppl(nl):
        flat = [x for r in nl for x in r]
        return math.exp(sum(flat) / len(flat))

    rep = {"seed": a.seed, "steps": a.steps, "decay_at": a.decay_at, "batch": a.batch, "ctx": CTX, "lr": a.lr, "threads": a.threads,
           "torch": torch.__version__, "train_seconds": round(train_s, 1), "parameters": nparam,
           "train_tokens": int(len(stream)), "heldout_tokens": len(held), "eval_windows": len(wins),
           "eval_tokens": len(wins) * CTX,
           "max_abs_logit_diff_training_graph_vs_reference_fp32": d,
           "max_abs_logit_diff_training_graph_bf16_expert_out_vs_reference_fp32": d_bf16,
           "heldout_ppl": {"fp32_training_graph": ppl(nll_train), "fp32_reference": ppl(nll32),
                           "bf16_mxfp4_reference": ppl(nllq)}}
    json.dump(rep, open(os.path.join(a.work, "train_report.json"), "w"), indent=1)
    json.dump({"windows": wins, "nll_bf16_mxfp4": nllq}, open(os.path.join(a.work, "heldout_eval.json"), "w"))
    write_card(a.out, rep)
    log(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
