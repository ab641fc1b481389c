#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz/fuzz_proto.c from the golden messages
(tests/fixtures/proto/golden.json) in the fuzz target's framing: a frame-count
byte, 2-byte LE lengths for all frames but the last. Usage: tools/proto_fuzz_corpus.py"""
import json
import os
import struct

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
doc = json.load(open(os.path.join(here, "tests", "fixtures", "proto", "golden.json")))
out = os.path.join(here, "tests", "fuzz", "corpus", "fuzz_proto")
os.makedirs(out, exist_ok=True)
for name, frames in sorted(doc["messages"].items()):
    fr = [bytes.fromhex(h) for h in frames]
    blob = bytes([len(fr) - 1])
    for f in fr[:-1]:
        blob += struct.pack("<H", len(f)) + f
    blob += fr[-1]
    with open(os.path.join(out, name), "wb") as fh:
        fh.write(blob)
