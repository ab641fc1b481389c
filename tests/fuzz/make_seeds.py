#!/usr/bin/env python3
"""Builds the committed seed corpora of tests/fuzz/ from the repository's own
fixtures: tests/bad/ (every refusal), small valid files, and the configs.
fuzz_st inputs start with a mode byte (see fuzz_st.c)."""
import glob
import hashlib
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def write(target, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)


def st(hdr, data=b""):
    h = json.dumps(hdr, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + data


# fuzz_st: bad single files (both map modes), bad and good index texts
for p in sorted(glob.glob(os.path.join(ROOT, "tests/bad/st/*.safetensors"))):
    b = open(p, "rb").read()
    write("fuzz_st", b"\x00" + b)
    write("fuzz_st", b"\x02" + b)
for p in sorted(glob.glob(os.path.join(ROOT, "tests/bad/st/*/model.safetensors.index.json"))):
    write("fuzz_st", b"\x01" + open(p, "rb").read())
good = st({"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
           "v": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]},
           "z": {"dtype": "F8_E4M3", "shape": [0], "data_offsets": [24, 24]}}, bytes(range(24)))
write("fuzz_st", b"\x00" + good)
write("fuzz_st", b"\x02" + good)
write("fuzz_st", b"\x02" + st({"n\u00e9\U0001F600": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}, b"\x07"))
write("fuzz_st", b"\x01" + json.dumps({"metadata": {"total_size": 22}, "weight_map": {
    "a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}).encode())
write("fuzz_st", b"\x01" + b'{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}}')

# fuzz_k3cfg: every config fixture, good and bad
for p in sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/**/*.json"), recursive=True)) + \
        sorted(glob.glob(os.path.join(ROOT, "tests/bad/config/*.json"))) + \
        sorted(glob.glob(os.path.join(ROOT, "tests/models/*/config.json"))):
    write("fuzz_k3cfg", open(p, "rb").read())
