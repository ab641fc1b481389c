#!/usr/bin/env python3
"""Writes Kimi K3 checkpoints with random weights in the exact published layout.

    python3 tools/make_tiny_k3.py --preset tiny-k3       --out tests/models/tiny-k3
    python3 tools/make_tiny_k3.py --preset tiny-k3-plain --out tests/models/tiny-k3-plain
    python3 tools/make_tiny_k3.py --preset k3-scale      --out DIR   # real widths, ~2 GB
    python3 tools/make_tiny_k3.py --preset tiny-k3-vocab --out DIR   # toy widths, vocab 163,840
    python3 tools/make_tiny_k3.py --preset k3-slice --layers 4 --experts-per-layer 32 --out DIR

Output directory: config.json (the official nested kimi_k3 layout, SPEC §1),
model.safetensors.index.json, shards `model-XXXXX-of-NNNNNN.safetensors`
(5-digit index, 6-digit total, as the real checkpoint), tiktoken.model (the
project's own vocabulary, tools/vocab/) and tokenizer_config.json (the official
structure with the special ids moved to just after the ranks).

Tensor names, dtypes and packing follow SPEC §2 and §4: `language_model.`
prefix; BF16 trunk (F32 for the `float32` plain preset); F32 A_log stored
longer than the head count (zero padding), dt_bias, conv taps [C,1,K], KDA
o_norm and e_score_correction_bias; routed experts as compressed-tensors MXFP4
(`weight_packed` U8 [rows, cols/2], element 2j in the low nibble;
`weight_scale` U8 E8M0 [rows, cols/32]) or, unquantized, BF16 `.weight`; a few
`vision_tower.` / `mm_projector.` tensors that a text engine must skip.

Determinism: numpy only, no floating-point transcendental functions. Every
tensor is a pure function of (seed, tensor name): a counter-based SplitMix64
stream keyed by sha256(seed, name) gives the random bits; uniform values are
formed with exact integer/float64 arithmetic and rounded to bf16 by
round-to-nearest-even on the bit pattern. The bytes therefore do not depend on
the numpy version, the CPU, or the order or chunking in which tensors are
written, and shards are streamed tensor by tensor in bounded chunks, so a
multi-gigabyte slice needs little memory. The safetensors files are written
directly (8-byte little-endian header length, JSON header padded with spaces to
8 bytes, data).
"""
import argparse
import copy
import hashlib
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_CONFIG = os.path.join(HERE, "k3_official_config.json")
TEMPLATE_TOKCFG = os.path.join(HERE, "k3_official_tokenizer_config.json")
VOCAB = os.path.join(HERE, "vocab", "shoal-tiny.tiktoken")
K3_SPECIAL_BASE = 163584  # first special id of the real K3 vocabulary

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
CHUNK = 1 << 22  # elements generated per step (bounded memory)
E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # rms of a random code

# ---------------------------------------------------------------- presets

PRESETS = {
    # every K3 feature at toy widths; MXFP4 experts, bf16 trunk, lower-bound gate
    "tiny-k3": dict(
        vocab_from_tokenizer=True, hidden=96, layers=9, block=4,
        kda_heads=4, kda_head_dim=32, a_log_len=8, conv=4, gate_lower_bound=-5.0,
        mla_heads=4, q_lora=64, kv_lora=64, nope=64, rope=32, v_dim=32,
        inter=192, moe_inter=64, latent=64, experts=24, topk=6, shared=2,
        quantized=True, dtype="bfloat16", router_tie=(5, 17), max_pos=4096,
        shard_bytes=2_000_000, vt=32),
    # the other code paths: softplus gate, unquantized bf16 experts, F32 trunk
    "tiny-k3-plain": dict(
        vocab_from_tokenizer=True, hidden=64, layers=5, block=2,
        kda_heads=3, kda_head_dim=32, a_log_len=4, conv=4, gate_lower_bound=None,
        mla_heads=2, q_lora=32, kv_lora=32, nope=32, rope=32, v_dim=64,
        inter=128, moe_inter=32, latent=96, experts=16, topk=4, shared=2,
        quantized=False, dtype="float32", router_tie=None, max_pos=4096,
        shard_bytes=2_000_000, vt=32),
    # toy widths with the real vocabulary size (163,840 logits; tokenizer padded
    # as for k3-slice, the real K3 files copied over it or given with --tokenizer):
    # regenerated at test time (tests/e2e/test_k3_real_vocab.py), never committed
    "tiny-k3-vocab": dict(
        vocab_from_tokenizer=False, vocab=163840, hidden=64, layers=2, block=2,
        kda_heads=2, kda_head_dim=32, a_log_len=4, conv=4, gate_lower_bound=-5.0,
        mla_heads=2, q_lora=32, kv_lora=32, nope=32, rope=32, v_dim=32,
        inter=128, moe_inter=32, latent=32, experts=8, topk=2, shared=1,
        quantized=False, dtype="bfloat16", router_tie=None, max_pos=4096,
        shard_bytes=64_000_000, vt=32),
    # real K3 widths, one KDA+dense, one MLA+MoE layer, few experts, small vocab:
    # regenerated at test time for the engine's scale test (never committed)
    "k3-scale": dict(
        vocab_from_tokenizer=True, hidden=7168, layers=2, block=12,
        kda_heads=96, kda_head_dim=128, a_log_len=128, conv=4, gate_lower_bound=-5.0,
        mla_heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128,
        inter=3072, moe_inter=3072, latent=3584, experts=8, topk=4, shared=2,
        quantized=True, dtype="bfloat16", router_tie=None, max_pos=1048576,
        shard_bytes=1 << 30, vt=64),
    # real K3 widths and vocabulary; layers and experts from flags (benchmarks)
    "k3-slice": dict(
        vocab_from_tokenizer=False, vocab=163840, hidden=7168, layers=4, block=12,
        kda_heads=96, kda_head_dim=128, a_log_len=128, conv=4, gate_lower_bound=-5.0,
        mla_heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128,
        inter=33792, moe_inter=3072, latent=3584, experts=32, topk=16, shared=2,
        quantized=True, dtype="bfloat16", router_tie=None, max_pos=1048576,
        shard_bytes=4 << 30, vt=64),
}

# output gains (rms of a Linear's output for a unit-rms input) and value ranges;
# chosen so SiTU saturates on a good fraction of inputs (gate rms 6 against
# beta 4, up rms 25 against beta 25), attention is sharp, the router correction
# bias is as large as the score spread, and yet fp32 implementations that differ
# only in summation order stay close: the routed branch is up-projected with a
# small gain, because the bf16 rounding of each expert output (SPEC §3.6)
# turns fp32 noise into occasional bf16-ulp jumps that would otherwise cascade
# through the layers (measurements in docs/TESTING.md).
GAIN = dict(
    embed=1.0, lm_head=3.0, res_proj=2.0,
    kda_qkv=1.0, kda_g=2.0, kda_o=1.0, f_a=1.0, f_b=2.0, b_proj=2.0,
    q_a=1.0, q_b=2.0, kv_a=2.0, kv_b=2.0, mla_g=2.0, mla_o=1.0,
    mlp_gate=6.0, mlp_up=25.0, mlp_down=0.04,
    router=2.0, r_down=1.0, r_up=0.05,
    ex_gate=6.0, ex_up=25.0, ex_down=0.04,
)
ROUTER_BIAS_RANGE = 0.25

# ---------------------------------------------------------------- random bits


def mix64(x):
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def tensor_key(seed, name):
    h = hashlib.sha256(f"shoal-k3/{seed}/{name}".encode()).digest()
    return np.uint64(int.from_bytes(h[:8], "little"))


def stream(key, i0, n):
    """u64 words i0..i0+n-1 of the stream `key` (counter-based)."""
    ctr = np.arange(i0, i0 + n, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return mix64(key + ctr * GOLDEN)


def lanes(key, e0, e1, width):
    """Element e0..e1-1 of the stream viewed as `width`-bit lanes (8, 16, 32)."""
    per = 64 // width
    j0, j1 = e0 // per, (e1 + per - 1) // per
    words = stream(key, j0, j1 - j0).astype("<u8")
    v = words.view({8: "<u1", 16: "<u2", 32: "<u4"}[width])
    off = e0 - j0 * per
    return v[off:off + (e1 - e0)]


def bf16_bits(x32):
    """float32 array -> bf16 bit patterns, round to nearest even (no NaN here)."""
    u = x32.view(np.uint32).astype(np.uint64)
    r = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return r.astype("<u2")


def uniform64(key, e0, e1, lo, hi):
    """Uniform values in [lo, hi) as float64, 24 random bits each, exact arithmetic."""
    k = (lanes(key, e0, e1, 32) >> np.uint32(8)).astype(np.float64)
    return lo + (k + 0.5) * ((hi - lo) / 16777216.0)


# ---------------------------------------------------------------- tensor specs

DT_SIZE = {"BF16": 2, "F32": 4, "U8": 1}


class T:
    """One tensor: name, safetensors dtype, shape, and how to fill it.

    fill: ("uniform", lo, hi)        values in [lo, hi) (rounded to the dtype)
          ("bytes",)                 random bytes (MXFP4 packed codes)
          ("e8m0", center, spread)   E8M0 exponents center-spread..center+spread
          ("array", ndarray)         explicit values (small tensors)
    """

    def __init__(self, name, dtype, shape, fill):
        self.name, self.dtype, self.shape, self.fill = name, dtype, list(shape), fill
        self.numel = int(np.prod(shape)) if shape else 1
        self.nbytes = self.numel * DT_SIZE[dtype]

    def chunks(self, seed):
        """Yields the tensor's little-endian bytes in bounded chunks."""
        kind = self.fill[0]
        if kind == "array":
            a = self.fill[1]
            if self.dtype == "BF16":
                yield bf16_bits(np.ascontiguousarray(a, dtype=np.float32).ravel()).tobytes()
            elif self.dtype == "F32":
                yield np.ascontiguousarray(a, dtype="<f4").ravel().tobytes()
            else:
                yield np.ascontiguousarray(a, dtype="u1").ravel().tobytes()
            return
        key = tensor_key(seed, self.name)
        for e0 in range(0, self.numel, CHUNK):
            e1 = min(self.numel, e0 + CHUNK)
            if kind == "uniform":
                v = uniform64(key, e0, e1, self.fill[1], self.fill[2]).astype(np.float32)
                yield (bf16_bits(v) if self.dtype == "BF16" else v.astype("<f4")).tobytes()
            elif kind == "bytes":
                yield lanes(key, e0, e1, 8).tobytes()
            elif kind == "e8m0":
                c, s = self.fill[1], self.fill[2]
                b = lanes(key, e0, e1, 8).astype(np.int64) % (2 * s + 1)
                yield (c - s + b).astype("u1").tobytes()
            else:
                raise ValueError(kind)


def small_uniform(seed, name, n, lo, hi):
    """Explicit array for small tensors that need post-processing."""
    return uniform64(tensor_key(seed, name), 0, n, lo, hi)


def lin(name, out, inp, gain, dtype):
    a = gain * math.sqrt(3.0 / inp)
    return T(name, dtype, [out, inp], ("uniform", -a, a))


def norm(name, n, dtype):
    return T(name, dtype, [n], ("uniform", 0.75, 1.25))


def e8m0_center(gain, cols):
    """E8M0 exponent making a random-code MXFP4 row have output rms ~ gain."""
    return 127 + int(round(math.log2(gain / (E2M1_RMS * math.sqrt(cols)))))


def expert_tensors(prefix, rows, cols, gain, quantized):
    if quantized:
        if cols % 32:
            raise SystemExit(f"make_tiny_k3: {prefix}: cols {cols} not a multiple of 32")
        return [T(prefix + ".weight_packed", "U8", [rows, cols // 2], ("bytes",)),
                T(prefix + ".weight_scale", "U8", [rows, cols // 32], ("e8m0", e8m0_center(gain, cols), 1))]
    return [lin(prefix + ".weight", rows, cols, gain, "BF16")]


def schedule(n_layers):
    """Real K3 pattern: MLA where (L+1) % 4 == 0 and on the last layer."""
    return ["mla" if (L + 1) % 4 == 0 or L == n_layers - 1 else "kda" for L in range(n_layers)]


def build(p, seed):
    """Ordered tensor list: layers, then globals, then vision (like the real shards)."""
    tdt = "BF16" if p["dtype"] == "bfloat16" else "F32"
    d, V = p["hidden"], p["vocab"]
    H, D = p["kda_heads"], p["kda_head_dim"]
    C = H * D
    out = []
    kinds = schedule(p["layers"])
    for L in range(p["layers"]):
        pre = f"language_model.model.layers.{L}."
        lay = []
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            lay.append(norm(pre + nm + ".weight", d, tdt))
        for nm in ("self_attention_res_proj", "mlp_res_proj"):
            lay.append(lin(pre + nm + ".weight", 1, d, GAIN["res_proj"], tdt))
        a = pre + "self_attn."
        if kinds[L] == "kda":
            for nm in ("q", "k", "v"):
                lay.append(lin(a + nm + "_proj.weight", C, d, GAIN["kda_qkv"], tdt))
                lay.append(T(a + nm + "_conv1d.weight", "F32", [C, 1, p["conv"]], ("uniform", -0.6, 0.6)))
            lay.append(lin(a + "f_a_proj.weight", D, d, GAIN["f_a"], tdt))
            lay.append(lin(a + "f_b_proj.weight", C, D, GAIN["f_b"], tdt))
            lay.append(lin(a + "b_proj.weight", H, d, GAIN["b_proj"], tdt))
            if p["gate_lower_bound"] is not None:
                alo, ahi, dlo, dhi = 0.0, 1.4, -3.0, 1.0   # g = lb*sigmoid(exp(A)*z)
            else:
                alo, ahi, dlo, dhi = -1.5, 0.5, -4.0, 0.0  # g = -exp(A)*softplus(z)
            alog = np.zeros(p["a_log_len"], dtype=np.float64)
            alog[:H] = small_uniform(seed, a + "A_log", H, alo, ahi)
            lay.append(T(a + "A_log", "F32", [p["a_log_len"]], ("array", alog)))
            lay.append(T(a + "dt_bias", "F32", [C], ("uniform", dlo, dhi)))
            lay.append(T(a + "o_norm.weight", "F32", [D], ("uniform", 0.8, 1.2)))
            lay.append(lin(a + "g_proj.weight", C, d, GAIN["kda_g"], tdt))
            lay.append(lin(a + "o_proj.weight", d, C, GAIN["kda_o"], tdt))
        else:
            Hm = p["mla_heads"]
            lay.append(lin(a + "q_a_proj.weight", p["q_lora"], d, GAIN["q_a"], tdt))
            lay.append(norm(a + "q_a_layernorm.weight", p["q_lora"], tdt))
            lay.append(lin(a + "q_b_proj.weight", Hm * (p["nope"] + p["rope"]), p["q_lora"], GAIN["q_b"], tdt))
            lay.append(lin(a + "kv_a_proj_with_mqa.weight", p["kv_lora"] + p["rope"], d, GAIN["kv_a"], tdt))
            lay.append(norm(a + "kv_a_layernorm.weight", p["kv_lora"], tdt))
            lay.append(lin(a + "kv_b_proj.weight", Hm * (p["nope"] + p["v_dim"]), p["kv_lora"], GAIN["kv_b"], tdt))
            lay.append(lin(a + "g_proj.weight", Hm * p["v_dim"], d, GAIN["mla_g"], tdt))
            lay.append(lin(a + "o_proj.weight", d, Hm * p["v_dim"], GAIN["mla_o"], tdt))
        if L < 1:  # first_k_dense_replace = 1
            m = pre + "mlp."
            lay.append(lin(m + "gate_proj.weight", p["inter"], d, GAIN["mlp_gate"], tdt))
            lay.append(lin(m + "up_proj.weight", p["inter"], d, GAIN["mlp_up"], tdt))
            lay.append(lin(m + "down_proj.weight", d, p["inter"], GAIN["mlp_down"], tdt))
        else:
            m = pre + "block_sparse_moe."
            E, lat, fi = p["experts"], p["latent"], p["moe_inter"]
            gate_name = m + "gate.weight"
            ga = GAIN["router"] * math.sqrt(3.0 / d)
            bias = small_uniform(seed, m + "gate.e_score_correction_bias", E, -ROUTER_BIAS_RANGE, ROUTER_BIAS_RANGE)
            if p["router_tie"]:
                # two experts with identical router rows and bias: an exact tie
                # that the lower-index rule must break (SPEC §3.5, torch.topk)
                i, j = p["router_tie"]
                gw = small_uniform(seed, gate_name, E * d, -ga, ga).reshape(E, d)
                gw[j] = gw[i]
                bias[j] = bias[i]
                lay.append(T(gate_name, tdt, [E, d], ("array", gw)))
            else:
                lay.append(T(gate_name, tdt, [E, d], ("uniform", -ga, ga)))
            lay.append(T(m + "gate.e_score_correction_bias", "F32", [E], ("array", bias)))
            lay.append(lin(m + "routed_expert_down_proj.weight", lat, d, GAIN["r_down"], tdt))
            lay.append(norm(m + "routed_expert_norm.weight", lat, tdt))
            lay.append(lin(m + "routed_expert_up_proj.weight", d, lat, GAIN["r_up"], tdt))
            sw = p["shared"] * fi
            lay.append(lin(m + "shared_experts.gate_proj.weight", sw, d, GAIN["mlp_gate"], tdt))
            lay.append(lin(m + "shared_experts.up_proj.weight", sw, d, GAIN["mlp_up"], tdt))
            lay.append(lin(m + "shared_experts.down_proj.weight", d, sw, GAIN["mlp_down"], tdt))
            # experts: six tensors back to back, experts in a scrambled order
            # (the real shards are not id-ordered either)
            order = sorted(range(E), key=lambda e: int(tensor_key(seed, f"{m}order/{e}")))
            for e in order:
                x = f"{m}experts.{e}."
                for w, rows, cols, g in (("w1", fi, lat, GAIN["ex_gate"]), ("w2", lat, fi, GAIN["ex_down"]),
                                         ("w3", fi, lat, GAIN["ex_up"])):
                    lay.extend(expert_tensors(x + w, rows, cols, g, p["quantized"]))
        out.extend(lay)
    g = "language_model."
    out.append(lin(g + "model.embed_tokens.weight", V, d, GAIN["embed"] * math.sqrt(d / 3.0), tdt))
    out.append(lin(g + "lm_head.weight", V, d, GAIN["lm_head"], tdt))
    out.append(norm(g + "model.norm.weight", d, tdt))
    out.append(norm(g + "model.output_attn_res_norm.weight", d, tdt))
    out.append(lin(g + "model.output_attn_res_proj.weight", 1, d, GAIN["res_proj"], tdt))
    vt = p["vt"]
    for nm, shape in (("vision_tower.patch_embed.proj.weight", [vt, 3, 14, 14]),
                      ("vision_tower.encoder.blocks.0.wqkv.weight", [3 * vt, vt]),
                      ("vision_tower.encoder.blocks.0.norm0.weight", [vt]),
                      ("vision_tower.encoder.final_layernorm.weight", [vt]),
                      ("mm_projector.proj.0.weight", [4 * vt, 4 * vt]),
                      ("mm_projector.proj.2.weight", [d, 4 * vt]),
                      ("mm_projector.post_norm.weight", [d])):
        out.append(T(nm, "BF16", shape, ("uniform", -0.05, 0.05)))
    return out


# ---------------------------------------------------------------- files


def shard_plan(tensors, budget):
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > budget:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    shards.append(cur)
    return shards


def write_shard(path, tensors, seed):
    hdr = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        hdr[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hj = json.dumps(hdr, separators=(",", ":")).encode()
    hj += b" " * ((-len(hj)) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for t in tensors:
            n = 0
            for b in t.chunks(seed):
                f.write(b)
                n += len(b)
            if n != t.nbytes:
                raise RuntimeError(f"{t.name}: wrote {n} bytes, expected {t.nbytes}")
    os.replace(path + ".tmp", path)
    return off


def read_ranks(path):
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                n += 1
    return n


def write_tokenizer(out, p):
    """tiktoken.model + tokenizer_config.json. Tiny presets: the project's vocab,
    specials at n_ranks + (real_id - 163584). k3-slice: the vocabulary padded to
    the real 163584 ranks with unreachable 3-byte tokens, specials at real ids."""
    src = open(VOCAB, "rb").read()
    n = read_ranks(VOCAB)
    if p["vocab_from_tokenizer"]:
        with open(os.path.join(out, "tiktoken.model"), "wb") as f:
            f.write(src)
        base = n
    else:
        import base64
        have = set(base64.b64decode(line.split()[0]) for line in src.splitlines() if line.strip())
        lines = [src]
        r = n
        lead = 0xF8  # never a UTF-8 byte: these tokens are unreachable by merges
        while r < K3_SPECIAL_BASE:
            for b1 in range(256):
                for b2 in range(256):
                    if r >= K3_SPECIAL_BASE:
                        break
                    t = bytes([lead, b1, b2])
                    if t in have:
                        continue
                    lines.append(base64.b64encode(t) + b" " + str(r).encode() + b"\n")
                    r += 1
            lead += 1
        with open(os.path.join(out, "tiktoken.model"), "wb") as f:
            f.write(b"".join(lines))
        base = K3_SPECIAL_BASE
    tc = json.load(open(TEMPLATE_TOKCFG, encoding="utf-8"))
    tc["added_tokens_decoder"] = {str(int(k) - K3_SPECIAL_BASE + base): v
                                  for k, v in tc["added_tokens_decoder"].items()}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tc, indent=2, ensure_ascii=False))
    return base


def write_config(out, p, special_base):
    c = json.load(open(TEMPLATE_CONFIG))
    t = c["text_config"]
    bos, eos, pad = special_base + 0, special_base + 2, special_base + 255
    for o in (c, t):
        o["bos_token_id"], o["eos_token_id"], o["pad_token_id"] = bos, eos, pad
        o["dtype"] = p["dtype"]
    c["media_placeholder_token_id"] = special_base + (163605 - K3_SPECIAL_BASE)
    kinds = schedule(p["layers"])
    la = t["linear_attn_config"]
    la["kda_layers"] = [L + 1 for L, k in enumerate(kinds) if k == "kda"]
    la["full_attn_layers"] = [L + 1 for L, k in enumerate(kinds) if k == "mla"]
    la["num_heads"], la["head_dim"], la["short_conv_kernel_size"] = p["kda_heads"], p["kda_head_dim"], p["conv"]
    if p["gate_lower_bound"] is None:
        la.pop("gate_lower_bound", None)
    else:
        la["gate_lower_bound"] = p["gate_lower_bound"]
    t.update(
        vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
        num_attention_heads=p["mla_heads"], num_key_value_heads=p["mla_heads"],
        q_lora_rank=p["q_lora"], kv_lora_rank=p["kv_lora"], qk_nope_head_dim=p["nope"],
        qk_rope_head_dim=p["rope"], v_head_dim=p["v_dim"], intermediate_size=p["inter"],
        moe_intermediate_size=p["moe_inter"], routed_expert_hidden_size=p["latent"],
        num_experts=p["experts"], num_experts_per_token=p["topk"], num_shared_experts=p["shared"],
        attn_res_block_size=p["block"], max_position_embeddings=p["max_pos"])
    if not p["quantized"]:
        t.pop("quantization_config", None)
    v = c["vision_config"]
    vt = p["vt"]
    v.update(vt_hidden_size=vt, mm_hidden_size=vt, vt_intermediate_size=4 * vt, qkv_hidden_size=3 * vt // 2,
             vt_num_attention_heads=2, vt_num_hidden_layers=1, text_hidden_size=p["hidden"])
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(json.dumps(c, indent=2, sort_keys=True))


def generate(preset, out, seed, layers=None, experts=None, shard_bytes=None, log=None):
    p = copy.deepcopy(PRESETS[preset])
    if layers is not None:
        p["layers"] = layers
    if experts is not None:
        p["experts"] = experts
        p["topk"] = min(p["topk"], experts)
    if shard_bytes is not None:
        p["shard_bytes"] = shard_bytes
    if p["layers"] < 2:
        raise SystemExit("make_tiny_k3: need at least 2 layers (dense layer 0 + one MoE layer)")
    os.makedirs(out, exist_ok=True)
    base = write_tokenizer(out, p)
    if p["vocab_from_tokenizer"]:
        p["vocab"] = base + 256
    write_config(out, p, base)
    tensors = build(p, seed)
    shards = shard_plan(tensors, p["shard_bytes"])
    n = len(shards)
    wmap, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:06d}.safetensors"
        total += write_shard(os.path.join(out, fn), sh, seed)
        for t in sh:
            wmap[t.name] = fn
        if log:
            log(f"{fn}: {len(sh)} tensors")
    idx = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    return p, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layers", type=int, help="k3-slice/k3-scale: number of layers")
    ap.add_argument("--experts-per-layer", type=int, help="k3-slice/k3-scale: routed experts per MoE layer")
    ap.add_argument("--shard-bytes", type=int, help="split shards above this many bytes")
    a = ap.parse_args()
    if (a.layers or a.experts_per_layer) and a.preset.startswith("tiny"):
        raise SystemExit("make_tiny_k3: --layers/--experts-per-layer are for the k3-slice/k3-scale presets")
    p, total = generate(a.preset, a.out, a.seed, a.layers, a.experts_per_layer, a.shard_bytes,
                        log=lambda s: print(s, file=sys.stderr))
    print(f"make_tiny_k3: {a.preset}: {p['layers']} layers, {p['experts']} experts/layer, "
          f"{total} bytes of tensors in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
