#!/usr/bin/env python3
"""Golden bytes for proto/PROTOCOL.md, written from the spec with the Python
`msgpack` package and `struct`/`hashlib` -- independently of shoal's C encoder.

Writes tests/fixtures/proto/golden.json: for every message of the protocol, its
frames as hex (control frame first, then tensor frames), plus one model
fingerprint computed from a synthetic config and expert inventory.
tests/unit/test_proto.c checks that the C encoder produces exactly these bytes
and that the C decoder reads back the fields below;
tests/e2e/test_proto_golden.sh regenerates the file and diffs it.

Usage: tools/proto_golden.py [OUT.json]   (default tests/fixtures/proto/golden.json)
"""
import hashlib
import json
import os
import struct
import sys

import msgpack
import numpy as np

HELLO, ERROR, PING, PONG, STATS, STATS_REPLY, SHUTDOWN, SHUTDOWN_ACK, BATCH, RESULT, PREFETCH, TBATCH, TRESULT, \
    PROBE, PROBE_REPLY, TRUNK_X = range(1, 17)
F32, BF16, I32 = 1, 2, 3

FP = bytes(range(32))  # a test fingerprint: 00 01 .. 1f


def control(mtype, rid, body):
    # PROTOCOL.md §2.1: [type, rid, body], shortest integer encodings, str keys, bin bytes
    return msgpack.packb([mtype, rid, body], use_bin_type=True)


def tensor(dtype, arr):
    # PROTOCOL.md §4: "SHTF", dtype, 3 zero bytes, rows u32, cols u32, LE row-major payload
    rows, cols = arr.shape
    return b"SHTF" + bytes([dtype, 0, 0, 0]) + struct.pack("<II", rows, cols) + arr.tobytes()


def messages():
    m = {}
    m["hello_request"] = [control(HELLO, 1, {"proto": [1, 0], "fingerprint": FP, "peer": "coordinator 4242"})]
    m["hello_reply"] = [control(HELLO, 1, {
        "proto": [1, 0],
        "fingerprint": FP,
        "worker": "w1",
        "owned": [[1, 8, 0, 11], [2, 2, 300, 70000]],
        "act": ["f32", "bf16"],
        "out": ["bf16", "f32"],
        "max_tokens": 8192,
        "isa": "avx2",
        "threads": 2,
        "expert_bytes": 17547264 * 448,
        "mem_total": 25769803776,
    })]
    m["hello_version_2_0"] = [control(HELLO, 2, {"proto": [2, 0], "fingerprint": FP, "peer": "future"})]
    m["error"] = [control(ERROR, 9, {"code": 7, "message": "EXPERT_BATCH: layer 3 expert 5 is not owned by this worker"})]
    m["ping"] = [control(PING, 3, {})]
    m["pong"] = [control(PONG, 3, {})]
    m["stats"] = [control(STATS, 4, {})]
    m["stats_reply"] = [control(STATS_REPLY, 4, {
        "worker": "w1", "uptime_us": 5000000000, "requests": 70000, "errors": 3, "batches": 65536,
        "tokens": 131072, "pairs": 300, "bytes_in": 2**40, "bytes_out": 2**32 + 1, "queue_us": 255,
        "compute_us": 256})]
    m["shutdown"] = [control(SHUTDOWN, 5, {})]
    m["shutdown_ack"] = [control(SHUTDOWN_ACK, 5, {})]
    act = (np.arange(2 * 32, dtype=np.float32) * 0.25 - 3.0).reshape(2, 32).astype("<f4")
    route = np.array([[0, 1], [0, 5], [1, 2]], dtype="<i4")
    m["expert_batch"] = [control(BATCH, 2**40 + 7, {"layer": 3, "out": "bf16"}), tensor(F32, act), tensor(I32, route)]
    y = ((np.arange(3 * 32, dtype=np.uint32) * 2654435761) >> 16).astype("<u2").reshape(3, 32)
    m["expert_result"] = [control(RESULT, 2**40 + 7, {"queue_us": 12, "compute_us": 3456}), tensor(BF16, y)]
    act16 = (np.arange(1 * 32, dtype=np.uint32) + 0x3f80).astype("<u2").reshape(1, 32)
    m["expert_batch_bf16"] = [control(BATCH, 8, {"layer": 1, "out": "f32"}), tensor(BF16, act16),
                              tensor(I32, np.array([[0, 0]], dtype="<i4"))]
    # 1.2: PREFETCH, a notice (rid 0, never answered); ids ascending, one past 255 and one past 65535
    hr = msgpack.unpackb(m["hello_reply"][0])
    hr[2]["prefetch"] = True  # 1.2: the optional key, a worker that acts on hints
    m["hello_reply_prefetch"] = [control(HELLO, 1, hr[2])]
    m["prefetch"] = [control(PREFETCH, 0, {"layer": 5, "experts": [0, 7, 127, 128, 300, 70000]})]
    m["prefetch_empty"] = [control(PREFETCH, 0, {"layer": 1, "experts": []})]
    # 1.3: trunk rows. HELLO announces them (optional keys after the 1.0 ones),
    # TRUNK_BATCH asks for rows of several matrices applied to one f32 input,
    # TRUNK_RESULT returns them segment-major as one f32 [1, T * sum(rows)] frame.
    hr = msgpack.unpackb(m["hello_reply"][0])
    hr[2]["trunk"] = [["language_model.model.layers.3.self_attn.q_proj.weight", 0, 127],
                      ["language_model.lm_head.weight", 300, 70000]]
    hr[2]["trunk_fp"] = bytes(range(32, 64))
    m["hello_reply_trunk"] = [control(HELLO, 1, hr[2])]
    x = (np.arange(2 * 32, dtype=np.float32) * -0.5 + 1.0).reshape(2, 32).astype("<f4")
    m["trunk_batch"] = [control(TBATCH, 2**33 + 1, {"layer": 3, "mats": [
        ["language_model.model.layers.3.self_attn.q_proj.weight", 0, 2],
        ["language_model.model.layers.3.self_attn.k_proj.weight", 255, 256]]}), tensor(F32, x)]
    # 1.4: a chained segment (every row of f_a on x, then rows of f_b on that),
    # after one plain segment; 'chain' is written after 'mats'
    m["trunk_batch_chain"] = [control(TBATCH, 7, {"layer": 1, "mats": [
        ["language_model.model.layers.1.self_attn.q_proj.weight", 0, 31]], "chain": [
        ["language_model.model.layers.1.self_attn.f_a_proj.weight",
         "language_model.model.layers.1.self_attn.f_b_proj.weight", 64, 127]]}), tensor(F32, x)]
    m["trunk_batch_chain_only"] = [control(TBATCH, 8, {"layer": 1, "mats": [], "chain": [
        ["language_model.model.layers.1.self_attn.f_a_proj.weight",
         "language_model.model.layers.1.self_attn.f_b_proj.weight", 0, 63]]}), tensor(F32, x)]
    ty = (np.arange(2 * 5, dtype=np.float32) * 1.5).reshape(1, 10).astype("<f4")
    m["trunk_result"] = [control(TRESULT, 2**33 + 1, {"queue_us": 0, "compute_us": 70000}), tensor(F32, ty)]
    # 1.5: PROBE (a payload out, `reply` bytes back; with 'facts' the host's
    # measured facts) and PROBE_REPLY, facts in the order PROTOCOL.md §3.8 lists
    px = np.zeros((1, 3), dtype="<f4")
    m["probe"] = [control(PROBE, 300, {"reply": 8}), tensor(F32, px)]
    m["probe_facts"] = [control(PROBE, 301, {"reply": 4, "facts": True}), tensor(F32, px[:, :1])]
    m["probe_reply"] = [control(PROBE_REPLY, 300, {}), tensor(F32, np.zeros((1, 2), dtype="<f4"))]
    m["probe_reply_facts"] = [control(PROBE_REPLY, 301, {
        "cpu": "AMD EPYC 9654 96-Core Processor", "isa": "avx512", "version": "0.1.0", "cores": 192,
        "threads": 96, "mem_total": 2**40, "mem_avail": 700 * 2**30, "disk_free": 3 * 10**12,
        "disk_total": 4 * 10**12, "read_bw_1": 12 * 10**9, "read_bw_all": 380 * 10**9,
        "disk_read_bw": 2_500_000_000, "held_bytes": 90_400_000_000, "measure_us": 812345, "facts": 1}),
        tensor(F32, np.zeros((1, 1), dtype="<f4"))]
    # 1.6: the worker's numerics class, an optional key after the 1.0 ones (sent
    # only when not "portable"; absent reads as "portable")
    hr = msgpack.unpackb(m["hello_reply"][0])
    hr[2]["numerics"] = "mu"
    m["hello_reply_numerics"] = [control(HELLO, 1, hr[2])]
    # 1.7: bf16 activations where the receiver rounds them anyway. HELLO's
    # optional `bf16_exact` (after `numerics`; sent only when true) and a
    # TRUNK_BATCH whose x is a bf16 frame (the bits of x rounded to nearest
    # even, as the mu kernels round it: 1.0 - 0.5 t, exact in bf16)
    hr = msgpack.unpackb(m["hello_reply"][0])
    hr[2]["proto"] = [1, 7]
    hr[2]["numerics"] = "mu"
    hr[2]["bf16_exact"] = True
    m["hello_reply_bf16"] = [control(HELLO, 1, hr[2])]
    x16 = (x.view("<u4") >> 16).astype("<u2")
    m["trunk_batch_bf16"] = [control(TBATCH, 9, {"layer": 3, "mats": [
        ["language_model.model.layers.3.self_attn.q_proj.weight", 0, 2]]}), tensor(BF16, x16)]
    # 1.8: the relay tree (PROTOCOL.md §3.9). A relay parent's HELLO says
    # `relay: true`; a worker that relays lists its peers' endpoints in its
    # reply (after the 1.7 keys). A relayed TRUNK_BATCH carries `xid` and
    # `wait_ms` and no x frame; a root's carries x and `fwd`, its subtree as
    # [peer, up] (peer: an index into the relay list; up: 0 for its own
    # children, else 1 + the position of the parent entry). TRUNK_X (16) is a
    # worker-to-worker notice, rid 0: xid, wait_ms, the receiver's subtree, x.
    m["hello_request_relay"] = [control(HELLO, 1, {"proto": [1, 8], "fingerprint": FP, "peer": "w0",
                                                   "relay": True})]
    hr = msgpack.unpackb(m["hello_reply"][0])
    hr[2]["proto"] = [1, 8]
    hr[2]["relay"] = ["ipc:///run/user/1000/shoal-a/w0", "tcp://10.0.0.2:5555", "tcp://[fd00::3]:5555"]
    m["hello_reply_relay"] = [control(HELLO, 1, hr[2])]
    mats = [["language_model.model.layers.3.self_attn.q_proj.weight", 0, 2]]
    m["trunk_batch_relayed"] = [control(TBATCH, 10, {"layer": 3, "mats": mats, "xid": 2**40 + 5,
                                                     "wait_ms": 2000})]
    m["trunk_batch_root"] = [control(TBATCH, 11, {"layer": 3, "mats": mats, "xid": 2**40 + 5, "wait_ms": 2000,
                                                  "fwd": [[1, 0], [2, 0], [3, 1], [5, 3]]}), tensor(F32, x)]
    m["trunk_x"] = [control(TRUNK_X, 0, {"xid": 2**40 + 5, "wait_ms": 2000, "fwd": [[3, 0], [5, 1]]}),
                    tensor(F32, x)]
    m["trunk_x_leaf"] = [control(TRUNK_X, 0, {"xid": 7, "wait_ms": 60000}), tensor(BF16, x16)]
    return m


def fingerprint_case():
    """PROTOCOL.md §5 over a synthetic model: 4 layers (MoE 1..3), 3 experts,
    latent 64, expert width 32, MXFP4 group 32, situ_beta 0.1 (tests %.9g)."""
    cfg = dict(num_layers=4, hidden_size=96, vocab_size=4096, latent_size=64, moe_intermediate_size=32,
               num_experts=3, experts_per_token=2, first_k_dense=1, moe_layer_freq=1)
    f32 = lambda v: float(np.float32(v))
    lines = ["shoal model fingerprint 1"]
    lines += [f"{k}={v}" for k, v in cfg.items()]
    lines += ["expert_format=mxfp4", "expert_group_size=32",
              "situ_beta=%.9g" % f32(0.1), "situ_linear_beta=%.9g" % f32(25.0), "moe_layers=1,2,3"]
    d, f = cfg["latent_size"], cfg["moe_intermediate_size"]
    shapes = {1: (f, d), 3: (f, d), 2: (d, f)}  # logical [rows, cols]
    for layer in (1, 2, 3):
        for e in range(3):
            for w in (1, 3, 2):
                rows, cols = shapes[w]
                pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}."
                lines.append(f"tensor {pre}weight_packed U8 [{rows},{cols // 2}] {rows * cols // 2}")
                lines.append(f"tensor {pre}weight_scale U8 [{rows},{cols // 32}] {rows * cols // 32}")
    text = "".join(line + "\n" for line in lines)
    return {"text": text, "blake2b_256": hashlib.blake2b(text.encode(), digest_size=32).hexdigest()}


def trunk_fingerprint_case():
    """PROTOCOL.md §5.1: two trunk matrices (the first named twice)."""
    lines = ["shoal trunk fingerprint 1",
             "tensor language_model.model.layers.0.mlp.gate_proj.weight BF16 [192,96] 36864",
             "tensor language_model.lm_head.weight F32 [4096,96] 1572864"]
    text = "".join(line + "\n" for line in lines)
    return {"text": text, "blake2b_256": hashlib.blake2b(text.encode(), digest_size=32).hexdigest()}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "proto", "golden.json")
    doc = {
        "generator": "tools/proto_golden.py (Python msgpack %s)" % ".".join(map(str, msgpack.version)),
        "protocol": "1.0",
        "messages": {k: [fr.hex() for fr in v] for k, v in messages().items()},
        "fingerprint": fingerprint_case(),
        "trunk_fingerprint": trunk_fingerprint_case(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
