"""A random-weight llama-architecture GGUF, the anchor model for the batching
benchmark (issue 17): llama-server --parallel N runs it beside shoal's k3-slice
so the shape of the throughput curve can be compared on the same machine.

The model is sized by its decode weight bytes per token (every bf16 matrix is
read once per token; the embedding is one row), chosen to match what
`shoal run --json` reports for the k3-slice (decode_weight_bytes_per_token).
Weights are bf16 (the dtype of K3's trunk; --dtype f16 for llama.cpp's faster
path on CPUs without AVX512-BF16) drawn from N(0, 0.02) with a fixed seed;
norms are 1. The vocabulary is SentencePiece-shaped (<unk> <s> </s>, the
256 byte tokens, then "t<i>" pieces) so llama.cpp loads it; the benchmark
sends token ids and asks llama-server to ignore EOS, so the text is irrelevant.

Needs the `gguf` and `numpy` packages (pip install gguf numpy), not the
project venv's requirements.

Usage: make_anchor_gguf.py --out FILE.gguf [--hidden 4096] [--ffn 11008]
       [--layers N | --bytes-per-token B] [--vocab 32000] [--heads 32] [--seed 1] [--dtype bf16|f16]
"""
import argparse
import sys

import numpy as np


def bf16_bits(a):
    """fp32 -> bf16 bit patterns, round to nearest even."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def layer_bytes(h, f):
    return 2 * (4 * h * h + 3 * h * f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--bytes-per-token", type=float, default=0,
                    help="choose --layers so the decode weight bytes per token come closest to this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    a = ap.parse_args()
    import gguf

    h, f, V = a.hidden, a.ffn, a.vocab
    head_bytes = 2 * V * h + 2 * h  # output.weight + one embedding row (+ norms, negligible)
    if a.layers <= 0:
        if a.bytes_per_token <= head_bytes:
            sys.exit("make_anchor_gguf: give --layers N or --bytes-per-token above the output matrix's "
                     f"{head_bytes} B")
        a.layers = max(1, round((a.bytes_per_token - head_bytes) / layer_bytes(h, f)))
    L = a.layers
    per_token = head_bytes + L * layer_bytes(h, f)
    print(f"make_anchor_gguf: llama, {L} layers, hidden {h}, ffn {f}, vocab {V}: "
          f"{per_token} decode weight bytes per token", file=sys.stderr)

    rng = np.random.default_rng(a.seed)
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("shoal-anchor-random")
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(f)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(h // a.heads)
    w.add_layer_norm_rms_eps(1e-5)
    f16 = a.dtype == "f16"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.MOSTLY_BF16)
    toks, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        toks.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    for i in range(len(toks), V):
        toks.append(f"\u2581t{i}")
        scores.append(-float(i))
        types.append(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def mat(name, rows, cols):
        # chunks of rows keep the fp32 temporary small
        out = np.empty((rows, cols), dtype=np.float16 if f16 else np.uint16)
        step = max(1, (64 << 20) // (4 * cols))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            v = rng.standard_normal((n, cols), dtype=np.float32) * 0.02
            out[r:r + n] = v.astype(np.float16) if f16 else bf16_bits(v)
        if f16:
            w.add_tensor(name, out)
        else:
            w.add_tensor(name, out, raw_shape=(rows, cols), raw_dtype=gguf.GGMLQuantizationType.BF16)

    def ones(name, n):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    mat("token_embd.weight", V, h)
    ones("output_norm.weight", h)
    mat("output.weight", V, h)
    for i in range(L):
        ones(f"blk.{i}.attn_norm.weight", h)
        mat(f"blk.{i}.attn_q.weight", h, h)
        mat(f"blk.{i}.attn_k.weight", h, h)
        mat(f"blk.{i}.attn_v.weight", h, h)
        mat(f"blk.{i}.attn_output.weight", h, h)
        ones(f"blk.{i}.ffn_norm.weight", h)
        mat(f"blk.{i}.ffn_gate.weight", f, h)
        mat(f"blk.{i}.ffn_up.weight", f, h)
        mat(f"blk.{i}.ffn_down.weight", h, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
