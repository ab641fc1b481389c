#!/usr/bin/env python3
"""Builds the committed seed corpora of fuzz_metrics (Prometheus text) and
fuzz_trace (routing trace files): expositions of the coordinator and expert
server modules (dumped by build/tests/test_cmetrics and test_wmetrics with
SHOAL_METRICS_DUMP), hand-written edge cases, and small traces written from
the format in docs/METRICS.md. Run from the repository root after a build."""
import hashlib
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")


def write(target, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)


with tempfile.TemporaryDirectory() as tmp:
    for t in ("test_cmetrics", "test_wmetrics", "test_metrics"):
        path = os.path.join(tmp, t)
        env = dict(os.environ, SHOAL_METRICS_DUMP=path)
        env.pop("SHOAL_TEST_RESULTS", None)
        subprocess.run([os.path.join(BUILD, "tests", t)], env=env, check=True)
        write("fuzz_metrics", open(path, "rb").read())
for s in [b"x 1\n", b'a{b="c\\"d\\\\e\\nf"} +Inf 123\n', b"a{} NaN\r\n# c\n\n", b"x{a=\"1\",} -Inf\n",
          b"x 1e-300 -5\n", b"x{a=\"1\" 2\n", b"__y{__z=\"\"} 0\n", b"a:b:c 0x1\n"]:
    write("fuzz_metrics", s)


def trace(L, E, K, recs, major=1, extra_hdr=b"", rb=None):
    rb = rb or 8 + 2 * K
    h = b"SHOALRT\0" + struct.pack("<HHIIIII", major, 0, 64 + len(extra_hdr), L, E, K, rb) + bytes(32) + extra_hdr
    out = bytearray(h)
    for tok, layer, ex in recs:
        r = struct.pack("<IHH", tok, layer, len(ex)) + struct.pack(f"<{K}H", *(ex + [0xFFFF] * (K - len(ex))))
        out += r + bytes(rb - len(r))
    return bytes(out)


hand = [(0, 1, [0, 1]), (1, 1, [0, 2]), (0, 2, [1, 3]), (1, 2, [1, 2]), (2, 1, [0, 1]), (2, 2, [0, 1])]
write("fuzz_trace", trace(3, 4, 2, hand))
write("fuzz_trace", trace(3, 4, 2, hand)[:-5])
write("fuzz_trace", trace(3, 4, 2, [(0, 1, [3])]))
write("fuzz_trace", trace(3, 4, 2, hand, extra_hdr=b"\x01" * 8, rb=16))
write("fuzz_trace", trace(3, 4, 2, hand, major=2))
write("fuzz_trace", trace(9, 24, 6, [(t, l, [1, 3, 5, 7, 11, 23]) for t in range(4) for l in range(1, 9)]))
write("fuzz_trace", b"SHOALRT\0")
