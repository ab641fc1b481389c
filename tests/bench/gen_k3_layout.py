#!/usr/bin/env python3
"""Writes a synthetic model directory with the Kimi K3 checkpoint layout of
../shared/k3/SPEC.md §2 for a given config.json: every tensor name, dtype and
shape, spread over N shards named model-XXXXX-of-NNNNNN.safetensors, plus
model.safetensors.index.json and a copy of config.json. Tensor data is all
zero and written as a hole (the file is truncated to its full length), so a
full-size K3 layout (497,220 tensors, ~1.5 TB apparent size) costs only its
headers on disk.

Independent of the C code: the tensor list is written here from the SPEC
tables, so the C schema (common/k3schema.c) is checked against it, not
against itself. Also writes manifest.json: counts and bytes per class.

Usage: gen_k3_layout.py CONFIG_JSON OUT_DIR [--shards N] [--vision]
                        [--drop NAME] [--retype NAME=DTYPE] [--reshape NAME=d0,d1]
"""
import argparse
import json
import os
import struct
import sys

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}


def text_cfg(cfg):
    if cfg.get("model_type") == "kimi_k3":
        return cfg["text_config"]
    return cfg


def tensors(cfg, vision):
    """Yields (name, dtype, shape, cls) in checkpoint order. cls: trunk | expert | vision."""
    t = text_cfg(cfg)
    trunk = {"bfloat16": "BF16", "float32": "F32"}[t.get("dtype", t.get("torch_dtype"))]
    la = t["linear_attn_config"]
    d, V, nl = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    kh, kd, kk = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    mh = t["num_attention_heads"]
    ql, kvl = t["q_lora_rank"], t["kv_lora_rank"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    E, mi, lat = t["num_experts"], t["moe_intermediate_size"], t["routed_expert_hidden_size"]
    ns = t["num_shared_experts"]
    mla = {x - 1 for x in la["full_attn_layers"]}
    mxfp4 = "quantization_config" in t
    # A_log: the real checkpoint stores [128] for 96 heads (SPEC §2.3 note);
    # mimic a padded store whenever head_dim > heads.
    alog = max(kh, kd)
    P = "language_model."
    yield P + "model.embed_tokens.weight", trunk, [V, d], "trunk"
    for L in range(nl):
        p = P + f"model.layers.{L}."
        for n in ("input_layernorm", "post_attention_layernorm",
                  "self_attention_res_norm", "mlp_res_norm"):
            yield p + n + ".weight", trunk, [d], "layer"
        yield p + "self_attention_res_proj.weight", trunk, [1, d], "layer"
        yield p + "mlp_res_proj.weight", trunk, [1, d], "layer"
        a = p + "self_attn."
        if L in mla:
            yield a + "q_a_proj.weight", trunk, [ql, d], "layer"
            yield a + "q_a_layernorm.weight", trunk, [ql], "layer"
            yield a + "q_b_proj.weight", trunk, [mh * (nope + rope), ql], "layer"
            yield a + "kv_a_proj_with_mqa.weight", trunk, [kvl + rope, d], "layer"
            yield a + "kv_a_layernorm.weight", trunk, [kvl], "layer"
            yield a + "kv_b_proj.weight", trunk, [mh * (nope + vd), kvl], "layer"
            yield a + "g_proj.weight", trunk, [mh * vd, d], "layer"
            yield a + "o_proj.weight", trunk, [d, mh * vd], "layer"
        else:
            C = kh * kd
            for n in "qkv":
                yield a + f"{n}_proj.weight", trunk, [C, d], "layer"
            for n in "qkv":
                yield a + f"{n}_conv1d.weight", "F32", [C, 1, kk], "layer"
            yield a + "f_a_proj.weight", trunk, [kd, d], "layer"
            yield a + "f_b_proj.weight", trunk, [C, kd], "layer"
            yield a + "b_proj.weight", trunk, [kh, d], "layer"
            yield a + "A_log", "F32", [alog], "layer"
            yield a + "dt_bias", "F32", [C], "layer"
            yield a + "o_norm.weight", "F32", [kd], "layer"
            yield a + "g_proj.weight", trunk, [C, d], "layer"
            yield a + "o_proj.weight", trunk, [d, C], "layer"
        moe = L >= t["first_k_dense_replace"] and L % t["moe_layer_freq"] == 0
        if not moe:
            I = t["intermediate_size"]
            yield p + "mlp.gate_proj.weight", trunk, [I, d], "layer"
            yield p + "mlp.up_proj.weight", trunk, [I, d], "layer"
            yield p + "mlp.down_proj.weight", trunk, [d, I], "layer"
            continue
        m = p + "block_sparse_moe."
        yield m + "gate.weight", trunk, [E, d], "layer"
        yield m + "gate.e_score_correction_bias", "F32", [E], "layer"
        yield m + "routed_expert_down_proj.weight", trunk, [lat, d], "layer"
        if t["latent_moe_use_norm"]:
            yield m + "routed_expert_norm.weight", trunk, [lat], "layer"
        yield m + "routed_expert_up_proj.weight", trunk, [d, lat], "layer"
        if ns:
            yield m + "shared_experts.gate_proj.weight", trunk, [ns * mi, d], "layer"
            yield m + "shared_experts.up_proj.weight", trunk, [ns * mi, d], "layer"
            yield m + "shared_experts.down_proj.weight", trunk, [d, ns * mi], "layer"
        for e in range(E):
            for w, rows, cols in (("w1", mi, lat), ("w3", mi, lat), ("w2", lat, mi)):
                q = m + f"experts.{e}.{w}."
                if mxfp4:
                    yield q + "weight_packed", "U8", [rows, cols // 2], "expert"
                    yield q + "weight_scale", "U8", [rows, cols // 32], "expert"
                else:
                    yield q + "weight", trunk, [rows, cols], "expert"
    yield P + "model.norm.weight", trunk, [d], "trunk"
    yield P + "model.output_attn_res_norm.weight", trunk, [d], "trunk"
    yield P + "model.output_attn_res_proj.weight", trunk, [1, d], "trunk"
    yield P + "lm_head.weight", trunk, [V, d], "trunk"
    if vision:
        yield "vision_tower.patch_embed.proj.weight", "BF16", [1024, 3, 14, 14], "vision"
        yield "vision_tower.patch_embed.pos_emb.weight", "BF16", [64, 64, 1024], "vision"
        for b in range(27):
            v = f"vision_tower.encoder.blocks.{b}."
            yield v + "wqkv.weight", "BF16", [4608, 1024], "vision"
            yield v + "wo.weight", "BF16", [1024, 1536], "vision"
            yield v + "mlp.fc0.weight", "BF16", [4096, 1024], "vision"
            yield v + "mlp.fc1.weight", "BF16", [1024, 4096], "vision"
            yield v + "norm0.weight", "BF16", [1024], "vision"
            yield v + "norm1.weight", "BF16", [1024], "vision"
        yield "vision_tower.encoder.final_layernorm.weight", "BF16", [1024], "vision"
        yield "mm_projector.proj.0.weight", "BF16", [4096, 4096], "vision"
        yield "mm_projector.proj.2.weight", "BF16", [7168, 4096], "vision"
        yield "mm_projector.post_norm.weight", "BF16", [7168], "vision"


def nbytes(dt, shape):
    n = DTYPE_SIZE[dt]
    for s in shape:
        n *= s
    return n


def write_shard(path, entries):
    hdr, off = {}, 0
    for name, dt, shape in entries:
        nb = nbytes(dt, shape)
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}
        off += nb
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        f.truncate(8 + len(h) + off)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--vision", action="store_true")
    ap.add_argument("--drop", action="append", default=[])
    ap.add_argument("--retype", action="append", default=[])
    ap.add_argument("--reshape", action="append", default=[])
    a = ap.parse_args()
    with open(a.config, "rb") as f:
        raw = f.read()
    cfg = json.loads(raw)
    retype = dict(x.split("=", 1) for x in a.retype)
    reshape = {k: [int(s) for s in v.split(",")] for k, v in (x.split("=", 1) for x in a.reshape)}
    ts = []
    for name, dt, shape, cls in tensors(cfg, a.vision):
        if name in a.drop:
            continue
        ts.append((name, retype.get(name, dt), reshape.get(name, shape), cls))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "wb") as f:
        f.write(raw)
    # split into contiguous runs of roughly equal tensor count
    n = len(ts)
    k = max(1, a.shards)
    weight_map, total = {}, 0
    for s in range(k):
        part = ts[s * n // k:(s + 1) * n // k]
        fname = f"model-{s + 1:05d}-of-{k:06d}.safetensors" if k > 1 else "model.safetensors"
        write_shard(os.path.join(a.out, fname), [(nm, dt, sh) for nm, dt, sh, _ in part])
        for nm, dt, sh, _ in part:
            weight_map[nm] = fname
            total += nbytes(dt, sh)
    if k > 1:
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    man = {"tensors": n, "shards": k, "bytes": {}, "count": {}}
    for _, dt, sh, cls in ts:
        man["bytes"][cls] = man["bytes"].get(cls, 0) + nbytes(dt, sh)
        man["count"][cls] = man["count"].get(cls, 0) + 1
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    print(f"{a.out}: {n} tensors in {k} shards", file=sys.stderr)


if __name__ == "__main__":
    main()
