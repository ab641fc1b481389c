#!/usr/bin/env python3
"""Writes the malformed model files of tests/bad/ (one per refusal of
common/st.c and common/k3cfg.c) and tests/bad/expect.tsv, the message each
must be refused with. The files are committed; rerun this script only to
change them. Every fixture is small and written byte by byte here, independent
of the C reader. expect.tsv columns: kind (st | config), path relative to the
repository root, a substring the refusal message must contain."""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ST = os.path.join(HERE, "st")
CFG = os.path.join(HERE, "config")
rows = []


def st_bytes(header, data=b"", hlen=None):
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


def put(path, blob):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(blob)


def st(name, blob, msg):
    put(os.path.join(ST, name), blob)
    rows.append(("st", f"tests/bad/st/{name}", msg))


def hdr(d):
    return json.dumps(d, separators=(",", ":"))


def ent(dt, shape, b, e):
    return {"dtype": dt, "shape": shape, "data_offsets": [b, e]}


ok = hdr({"w": ent("F32", [2], 0, 8)})

st("too_short.safetensors", b"\x05\x00\x00", "too short for a safetensors header")
st("header_past_eof.safetensors", st_bytes(ok, b"\0" * 8, hlen=4096),
   "header length 4096 runs past the end of the file")
st("header_absurd.safetensors", st_bytes(ok, b"\0" * 8, hlen=1 << 62), "is absurd")
st("malformed_json.safetensors", st_bytes('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},}', b"\0" * 8),
   "malformed JSON")
st("malformed_json_string.safetensors", st_bytes('{"w\x01":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 8),
   "control character in string")
st("not_object.safetensors", st_bytes('[1,2]', b""), "the header must be a JSON object")
st("unknown_dtype.safetensors", st_bytes(hdr({"w": ent("F4", [2], 0, 1)}), b"\0"), "tensor 'w': unknown dtype 'F4'")
st("unknown_key.safetensors",
   st_bytes('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"offset":0}}', b"\0" * 8),
   "unknown key 'offset' in tensor entry")
st("missing_key.safetensors", st_bytes('{"w":{"dtype":"F32","shape":[2]}}', b""), "tensor entry lacks 'data_offsets'")
st("negative_shape.safetensors", st_bytes('{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', b"\0" * 8),
   "shape entries must be non-negative integers")
st("begin_gt_end.safetensors", st_bytes(hdr({"w": ent("F32", [0], 8, 4)}), b"\0" * 8),
   "tensor 'w': data_offsets begin 8 > end 4")
st("past_data.safetensors", st_bytes(hdr({"w": ent("F32", [4], 0, 16)}), b"\0" * 8),
   "tensor 'w': data_offsets end 16 is past the data section (8 bytes)")
st("size_mismatch.safetensors", st_bytes(hdr({"w": ent("F32", [3], 0, 8)}), b"\0" * 8),
   "tensor 'w': data_offsets span 8 bytes but shape [3] x F32 needs 12")
st("size_overflow.safetensors",
   st_bytes(hdr({"w": ent("BF16", [1 << 32, 1 << 32], 0, 0)}), b""),
   "tensor 'w': byte size of shape x BF16 overflows 64 bits")
st("overlap.safetensors",
   st_bytes(hdr({"a": ent("F32", [2], 0, 8), "b": ent("F32", [2], 4, 12)}), b"\0" * 12),
   "tensors 'a' [0, 8) and 'b' [4, 12) overlap")
st("duplicate.safetensors",
   st_bytes('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            '"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0\0"),
   "duplicate tensor name 'w'")


def index_dir(name, shards, weight_map, msg, raw_index=None):
    d = os.path.join(ST, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for fn, tensors in shards.items():
        off, h = 0, {}
        for tn, (dt, shape, nb) in tensors.items():
            h[tn] = ent(dt, shape, off, off + nb)
            off += nb
        put(os.path.join(d, fn), st_bytes(hdr(h), b"\0" * off))
    text = raw_index if raw_index is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    put(os.path.join(d, "model.safetensors.index.json"), text.encode())
    rows.append(("st", f"tests/bad/st/{name}/model.safetensors.index.json", msg))


A = {"a": ("U8", [4], 4)}
B = {"b": ("U8", [2], 2)}
index_dir("index_missing_shard", {"s1.safetensors": A}, {"a": "s1.safetensors", "b": "s2.safetensors"},
          "tensor 'b' is in shard")
index_dir("index_missing_tensor", {"s1.safetensors": A}, {"a": "s1.safetensors", "c": "s1.safetensors"},
          "tensor 'c' is not in shard")
index_dir("index_wrong_shard", {"s1.safetensors": A, "s2.safetensors": B}, {"a": "s2.safetensors", "b": "s1.safetensors"},
          "tensor 'a' is listed in shard")
index_dir("index_unlisted", {"s1.safetensors": {**A, **B}}, {"a": "s1.safetensors"},
          "tensor 'b' is not listed in")
index_dir("index_duplicate", {"s1.safetensors": A}, None, "duplicate tensor name 'a' in weight_map",
          raw_index='{"weight_map":{"a":"s1.safetensors","a":"s1.safetensors"}}')
index_dir("index_malformed", {"s1.safetensors": A}, None, "malformed JSON",
          raw_index='{"weight_map":{"a":"s1.safetensors"')
index_dir("index_escape", {"s1.safetensors": A}, {"a": "../s1.safetensors"}, "is not a plain file name")
index_dir("dup_across_shards", {"s1.safetensors": A, "s2.safetensors": {**A, **B}},
          {"a": "s1.safetensors", "b": "s2.safetensors"},
          "tensor 'a' appears in both")
index_dir("index_no_weight_map", {"s1.safetensors": A}, None, "no 'weight_map' object",
          raw_index='{"metadata":{"total_size":4}}')

# ---- configs --------------------------------------------------------------
os.makedirs(CFG, exist_ok=True)
with open(os.path.join(HERE, "..", "fixtures", "official", "config.json"), "rb") as f:
    official = f.read().decode()


def cfg(name, text, msgs):
    put(os.path.join(CFG, name), text.encode())
    for m in msgs:
        rows.append(("config", f"tests/bad/config/{name}", m))


def edit(frm, to):
    assert official.count(frm) >= 1, frm
    return official.replace(frm, to, 1)


cfg("malformed.json", official[:-30], ["malformed JSON"])
cfg("missing_fields.json",
    edit('"hidden_size": 7168,', "").replace('"num_experts": 896,', "", 1),
    ["text_config.hidden_size: missing", "text_config.num_experts: missing"])
cfg("ill_formed.json",
    edit('"num_experts_per_token": 16', '"num_experts_per_token": "16"').replace('"kv_lora_rank": 512', '"kv_lora_rank": -1', 1),
    ["num_experts_per_token: expected an integer, got a string", "kv_lora_rank: -1 is out of range"])
cfg("layer_zero_indexed.json", edit('"kda_layers": [\n        1,', '"kda_layers": [\n        0,'),
    ["layer 0 is outside 1..93 (the list is 1-indexed)", "in neither kda_layers nor full_attn_layers"])
cfg("quant_group16.json", edit('"group_size": 32', '"group_size": 16'), ["group_size: 16 is not supported"])
cfg("model_type.json", edit('"model_type": "kimi_k3"', '"model_type": "deepseek_v3"'),
    ["model_type: 'deepseek_v3' is not supported"])

with open(os.path.join(HERE, "expect.tsv"), "w") as f:
    f.write("# kind\tpath\texpected message substring (generated by make_bad.py)\n")
    for r in rows:
        f.write("\t".join(r) + "\n")
print(f"{len(rows)} expectations")
