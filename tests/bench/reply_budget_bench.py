#!/usr/bin/env python3
"""Worker memory under a never-reading peer at K3 widths (issue 30 item 3;
docs/PERFORMANCE.md "Reply budget"). The k3-scale model ($SHOAL_BUILD/k3-scale,
tools/ensure_scale_model.sh), one `shoal expert --trunk '*:all'
--bench-skip-compute` per run (zeros instead of the row products: the reply
buffers are the same and written whole), one rogue peer past HELLO that sends N
TRUNK_BATCH requests for every owned 7168-wide row at T (12.5x amplified) and
never reads. Two settings, interleaved, R repetitions each: the default budget
(256 MiB per connection, 1024 MiB in all) and the budget off (10^6 MiB each:
what a worker without it holds). Peak RssAnon of the worker, sampled every
10 ms. Writes JSON to stdout.
Usage: reply_budget_bench.py [N=40] [T=64] [R=3]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import msgpack
import zmq

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build")), "k3-scale")


def rss_anon(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def widths():
    out = {}
    for fn in sorted(os.listdir(MODEL)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(MODEL, fn), "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                for k, v in json.loads(f.read(n)).items():
                    if k != "__metadata__" and len(v["shape"]) == 2:
                        out[k] = tuple(v["shape"])
    return out


def one(tag, extra, N, T, fp, wd, tmp):
    ep = f"ipc://{tmp}/{tag}.sock"
    w = subprocess.Popen([BIN, "expert", "--model", MODEL, "--trunk", "*:all", "--listen", ep, "--threads", "1",
                          "--bench-skip-compute", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(ep)
    s.send_multipart([msgpack.packb([1, 1, {"proto": [1, 4], "fingerprint": fp, "peer": "rogue"}])])
    if not s.poll(60000):
        raise SystemExit("no HELLO")
    h = msgpack.unpackb(s.recv_multipart()[0], raw=False)[2]
    owned = {n: (lo, hi) for n, lo, hi in h["trunk"]}
    cols = 7168
    mats = sorted(n for n in owned if wd[n][1] == cols)[:64]
    rows = sum(owned[n][1] - owned[n][0] + 1 for n in mats)
    ctl = msgpack.packb([12, 2, {"layer": 0, "mats": [[n, *owned[n]] for n in mats]}], use_bin_type=True)
    x = b"SHTF" + bytes([1, 0, 0, 0]) + struct.pack("<II", T, cols) + bytes(4 * T * cols)
    base = rss_anon(w.pid)
    peak = base
    for _ in range(N):
        s.send_multipart([ctl, x])
        peak = max(peak, rss_anon(w.pid))
    end = time.monotonic() + 5  # the worker takes them within ms; sample a while longer
    while time.monotonic() < end:
        peak = max(peak, rss_anon(w.pid))
        time.sleep(0.01)
    s.close()
    ctx.term()
    w.terminate()
    w.wait(30)
    return {"setting": tag, "base_rss_anon": base, "peak_rss_anon": peak, "reply_bytes": 16 + 4 * T * rows,
            "request_bytes": len(x), "rows": rows}


def main():
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    R = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    fp = bytes.fromhex(subprocess.run([BIN, "expert", "--model", MODEL, "--print-fingerprint"], capture_output=True,
                                      text=True, timeout=60).stdout.strip())
    wd = widths()
    tmp = tempfile.mkdtemp(prefix="shoal-rbb-")
    runs = []
    load0 = os.getloadavg()
    for r in range(R):
        for tag, extra in (("budget default", []),
                           ("budget off", ["--peer-reply-mb", "1000000", "--reply-budget-mb", "1000000"])):
            runs.append(dict(one(tag.replace(" ", "_") + str(r), extra, N, T, fp, wd, tmp), setting=tag, rep=r))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"command": f"tests/bench/reply_budget_bench.py {N} {T} {R}", "commit": commit,
                      "model": "k3-scale (hidden 7168, K3 widths)", "requests": N, "T": T,
                      "loadavg_before": load0, "loadavg_after": os.getloadavg(), "runs": runs}, indent=1))
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
