#!/usr/bin/env python3
"""`shoal doctor` on one host (issue 34), without root: the local workers of
`--workers 2` over ipc://, measured through PROBE (PROTOCOL.md §3.8).

Checks against what this host and the model say, worked out here:
- every worker measured; cores = os.cpu_count(); mem_total = /proc/meminfo
  MemTotal; the version = `shoal version`'s; the ISA one of the kernel names;
- held_bytes = the bytes of the routed-expert tensors the worker owns (its
  even half of every MoE layer, from the safetensors headers);
- the read pass gives a positive rate, 1 thread and all; RTT p50 <= p99;
- the table names both workers; a bad --rounds is a usage error (exit 2);
- the worker measures its host at most 8 times in a row (each stalls it about
  a second): a 9th PROBE with facts at once gets the last figures again with
  measure_us 0 (pyzmq and msgpack as a raw peer, PROTOCOL.md §3.8).
(The shaped-network figures are test_doctor_netns.py's.) Each case appends
PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~7 s.
"""
import json
import os
import re
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_doctor"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts


def expert_bytes(model, lo_e, hi_e):
    """bytes of the routed-expert tensors of experts lo_e..hi_e of every layer"""
    tot = 0
    for fn in sorted(os.listdir(model)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(model, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        for k, v in h.items():
            if ".experts." in k and "shared_experts" not in k:
                e = int(k.split(".experts.")[1].split(".")[0])
                if lo_e <= e <= hi_e:
                    tot += v["data_offsets"][1] - v["data_offsets"][0]
    return tot


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    base = [BIN, "doctor", "--model", TINY, "--workers", "2", "--worker-threads", "1", "--rounds", "50",
            "--bulk-count", "8", "--bulk-bytes", "262144"]
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=120)
    if not check("doctor --workers 2 --json", r.returncode == 0, r.stderr[-800:]):
        return 1
    d = json.loads(r.stdout)
    ws = {w["name"]: w for w in d["workers"]}
    check("both local workers measured", sorted(ws) == ["w0", "w1"] and all(w["ok"] for w in ws.values()),
          json.dumps(d)[:500])
    mt = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal:"))
    ver = subprocess.run([BIN, "version"], capture_output=True, text=True).stdout.split()[1]
    c = json.load(open(os.path.join(TINY, "config.json")))
    c = c.get("text_config", c)
    E = c["num_experts"]
    halves = {"w0": (0, E // 2 - 1), "w1": (E // 2, E - 1)}
    for n, w in sorted(ws.items()):
        h = w.get("host", {})
        check(f"{n}: cores, memory, version as this host says",
              h.get("cores") == os.cpu_count() and h.get("mem_total") == mt and h.get("version") == ver and
              0 < h.get("mem_avail", 0) <= mt and h.get("isa") in ("scalar", "avx2", "avx512"), json.dumps(h))
        want = expert_bytes(TINY, *halves[n])
        check(f"{n}: held_bytes = its experts' bytes from the headers ({want})", h.get("held_bytes") == want,
              f"{h.get('held_bytes')}")
        check(f"{n}: the read pass measured with both workers at once too",
              w.get("read_bw_all_together", 0) > 0, json.dumps(w))
        check(f"{n}: read pass and link figures present",
              h.get("read_bw_1", 0) > 0 and h.get("read_bw_all", 0) > 0 and 0 < w["rtt_p50_us"] <= w["rtt_p99_us"]
              and w["out_bytes_per_s"] > 0 and w["in_bytes_per_s"] > 0 and w["fwd_out_us"] > 0, json.dumps(w))
    check("the model fingerprint reported (64 hex digits)",
          re.fullmatch(r"[0-9a-f]{64}", d.get("model_fingerprint", "")) is not None, str(d.get("model_fingerprint")))
    check("this host measured too", d.get("coordinator", {}).get("cores") == os.cpu_count(), str(d.get("coordinator")))
    hid = c["hidden_size"]
    check(f"the forward's rows: out and back hidden x 4 = {hid * 4} bytes in the portable class",
          d.get("fwd_out_bytes") == hid * 4 and d.get("fwd_bytes") == hid * 4,
          f"{d.get('fwd_out_bytes')} / {d.get('fwd_bytes')}")
    r = subprocess.run(base + ["--numerics", "mu", "--no-facts", "--no-local", "--json"], capture_output=True,
                       text=True, timeout=120)
    dm = json.loads(r.stdout) if r.returncode == 0 else {}
    check(f"mu class: the input row goes out as bf16, hidden x 2 = {hid * 2} bytes; back f32",
          dm.get("numerics") == "mu" and dm.get("fwd_out_bytes") == hid * 2 and dm.get("fwd_bytes") == hid * 4,
          r.stderr[-400:] + json.dumps({k: dm.get(k) for k in ("numerics", "fwd_out_bytes", "fwd_bytes")}))
    r = subprocess.run(base + ["--no-facts", "--no-local"], capture_output=True, text=True, timeout=120)
    check("the table lists both workers", r.returncode == 0 and any(l.startswith("w0 ") for l in r.stdout.splitlines())
          and any(l.startswith("w1 ") for l in r.stdout.splitlines()), r.stdout[-800:] + r.stderr[-400:])
    r = subprocess.run([BIN, "doctor", "--model", TINY, "--workers", "2", "--rounds", "0"], capture_output=True,
                       text=True, timeout=60)
    check("--rounds 0: usage error (exit 2)", r.returncode == 2, f"rc {r.returncode}: {r.stderr[-300:]}")
    case_facts_rate(d["model_fingerprint"])
    return 1 if counts["FAIL"] else 0


def case_facts_rate(fp_hex):
    try:
        import msgpack
        import zmq
    except ImportError as e:
        record("SKIP", "facts rate", f"pyzmq/msgpack missing ({e})")
        return
    import tempfile
    import time
    tmp = tempfile.mkdtemp(prefix="shoal-doctor-")
    c = json.load(open(os.path.join(TINY, "config.json")))
    c = c.get("text_config", c)
    ep = f"ipc://{tmp}/w"
    w = subprocess.Popen([BIN, "expert", "--model", TINY, "--listen", ep, "--threads", "1", "--experts",
                          f"{c['first_k_dense_replace']}-{c['num_hidden_layers'] - 1}:0-{c['num_experts'] - 1}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    try:
        def call(mtype, rid, body, frames=()):
            s.send_multipart([msgpack.packb([mtype, rid, body], use_bin_type=True)] + list(frames))
            if not s.poll(60000):
                return None
            fr = s.recv_multipart()
            return msgpack.unpackb(fr[0], raw=False)
        h = call(1, 1, {"proto": [1, 5], "fingerprint": bytes.fromhex(fp_hex), "peer": "test_doctor"})
        if not check("raw peer: HELLO accepted", h is not None and h[0] == 1, repr(h)):
            return
        x = b"SHTF" + bytes([1, 0, 0, 0]) + struct.pack("<II", 1, 1) + b"\0" * 4
        # the worker's bucket: 8 measurements in a row, then one per 7.5 s (worker/serve.c FACTS_*); each
        # takes about a second (more on a busy box), so past the 8th a few more may be measured before the
        # bucket is empty: asked until the last figures come back again (measure_us 0), at most 30 times
        got = []
        t0 = time.monotonic()
        for i in range(30):
            m = call(14, 10 + i, {"reply": 4, "facts": True}, [x])
            got.append(m[2].get("measure_us") if m and m[0] == 15 else repr(m))
            if got[-1] == 0 or not isinstance(got[-1], int):
                break
        elapsed = time.monotonic() - t0
        measured = sum(1 for v in got if isinstance(v, int) and v > 0)
        allowed = 8 + int(elapsed / 7.5) + 1
        check("facts measured 8 times in a row, then no more than the 7.5 s refill allows: the last figures "
              "again (measure_us 0)",
              all(isinstance(v, int) and v > 0 for v in got[:8]) and got[-1] == 0 and measured <= allowed,
              f"{got}: {measured} measured in {elapsed:.1f} s (allowed {allowed})")
    finally:
        s.close()
        ctx.term()
        harness.terminate(w, 5)


if __name__ == "__main__":
    sys.exit(main())
