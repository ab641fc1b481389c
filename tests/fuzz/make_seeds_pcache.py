#!/usr/bin/env python3
"""Builds the committed seed corpus of fuzz_pcache: small state files written
from the documented layout (docs/ARCHITECTURE.md "prefix cache": header, ids,
state, logits; the checksums computed here) for fuzz_pcache's model layout
(64 bytes fixed + 8 per token), and a few near misses."""
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from test_prefix_cache import ids_hash, pcsum  # noqa: E402


def write(data):
    d = os.path.join(HERE, "corpus", "fuzz_pcache")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)


def state_file(ids, n_logits, fp=bytes(range(32)), fixed=64, per_token=8):
    idb = b"".join(i.to_bytes(4, "little") for i in ids)
    state = bytes((7 * k) & 0xFF for k in range(fixed + per_token * len(ids)))
    logits = b"".join(int(0x3F800000 + k).to_bytes(4, "little") for k in range(n_logits))
    s = pcsum(pcsum(pcsum(0, idb), state), logits)
    h = bytearray(96)
    h[0:8] = b"SHOALST\x1a"
    h[8:12] = (1).to_bytes(4, "little")
    h[12:16] = (96).to_bytes(4, "little")
    h[16:48] = fp
    h[48:52] = len(ids).to_bytes(4, "little")
    h[52:56] = n_logits.to_bytes(4, "little")
    h[56:64] = len(state).to_bytes(8, "little")
    h[64:72] = ids_hash(ids).to_bytes(8, "little")
    h[72:80] = s.to_bytes(8, "little")
    h[80:88] = pcsum(0, bytes(h[:80])).to_bytes(8, "little")
    return bytes(h) + idb + state + logits


good = state_file([5, 17, 3, 99], 0)
write(good)
write(state_file([1], 8))
write(state_file(list(range(40)), 3))
write(good[:-1])                         # truncated
write(good[:60])                         # truncated header
b = bytearray(good)
b[100] ^= 1                              # an id changed: hash mismatch
write(bytes(b))
b = bytearray(good)
b[-1] ^= 1                               # payload checksum
write(bytes(b))
b = bytearray(good)
b[8] = 2                                 # version
write(bytes(b))
