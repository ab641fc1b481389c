#!/usr/bin/env python3
"""Live ZeroMQ fuzzer (issue 20): a rogue peer sends mutated and truncated
HELLO / EXPERT_BATCH / PREFETCH / PING / STATS / SHUTDOWN frames to a running
`shoal expert` (proto/PROTOCOL.md; formats as tools/proto_golden.py), a second
one past HELLO asks for the largest legal replies and never reads them (issue
30: held to --peer-reply-mb, every excess request refused naming it), while a
well-behaved coordinator connection checks, every CHECK_EVERY cases, that the
worker still answers a valid EXPERT_BATCH with the same bytes as before the
fuzz. Two workers: the mapped bank, and the expert cache (--cache-gb).

Bounded: SHOAL_LIVE_FUZZ_SECONDS (default 20 per worker) and SHOAL_LIVE_FUZZ_CASES
(default 10^6, the time budget ends a CI run first). The long run:
  SHOAL_LIVE_FUZZ_SECONDS=3600 SHOAL_LIVE_FUZZ_CASES=1000000 .venv/bin/python3 tests/e2e/test_fuzz_zmq.py
Prints cases, crashes, and the worker's RSS and open fds before and after the
first 10^4 hostile frames (docs/TESTING.md records them). Fixed seed
(SHOAL_LIVE_FUZZ_SEED), so a failure replays.
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_fuzz_zmq"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
SECONDS = float(os.environ.get("SHOAL_LIVE_FUZZ_SECONDS", "20"))
CASES = int(os.environ.get("SHOAL_LIVE_FUZZ_CASES", "1000000"))
SEED = int(os.environ.get("SHOAL_LIVE_FUZZ_SEED", "20"))
CHECK_EVERY = 2000
CHUNK = 64  # hostile messages sent before the replies are drained
SINK_MAX = 500  # requests of the never-reading peer

try:
    import msgpack
    import zmq
except ImportError as e:
    msgpack = zmq = None
    IMPORT_ERR = str(e)

HELLO, ERROR, PING, PONG, STATS, STATS_REPLY, SHUTDOWN, SHUTDOWN_ACK, BATCH, RESULT, PREFETCH = range(1, 12)


def ctl(t, rid, body):
    return msgpack.packb([t, rid, body], use_bin_type=True)


def tensor(dtype, rows, cols, payload):
    return b"SHTF" + bytes([dtype, 0, 0, 0]) + struct.pack("<II", rows, cols) + payload


def batch(rid, layer, d, pairs, T=1, out="bf16"):
    z = struct.pack(f"<{T * d}f", *[((i * 37) % 101 - 50) / 25.0 for i in range(T * d)])
    route = struct.pack(f"<{2 * len(pairs)}i", *[v for p in pairs for v in p])
    return [ctl(BATCH, rid, {"layer": layer, "out": out}), tensor(1, T, d, z), tensor(3, len(pairs), 2, route)]


def proc_figures(pid):
    rss = 0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Mutator:
    def __init__(self, rng, fp, d, E, L):
        self.rng, self.fp, self.d, self.E, self.L = rng, fp, d, E, L

    def seed(self):
        r = self.rng
        k = r.randrange(7)
        rid = r.randrange(1, 1 << 20)
        if k == 0:
            return [ctl(HELLO, rid, {"proto": [1, r.choice([0, 2, 9])], "fingerprint": self.fp, "peer": "fuzz"})]
        if k in (1, 2):
            T = r.randrange(1, 4)
            pairs = sorted({(t, r.randrange(self.E)) for t in range(T) for _ in range(r.randrange(1, 3))})
            return batch(rid, r.randrange(1, self.L), self.d, pairs, T, r.choice(["bf16", "f32"]))
        if k == 3:
            return [ctl(PREFETCH, 0, {"layer": r.randrange(self.L + 2),
                                      "experts": sorted(r.sample(range(self.E + 4), r.randrange(6)))})]
        return [ctl(r.choice([PING, STATS, SHUTDOWN]), rid, {})]

    def structural(self, fr):
        """change a value inside the control map or a tensor header"""
        r = self.rng
        try:
            m = msgpack.unpackb(fr[0], raw=False)
        except Exception:  # noqa: BLE001
            return fr
        odd = r.choice([-1, 0, 2 ** 32, 2 ** 63, 2 ** 64 - 1, "x" * r.randrange(300), "é" * 63, b"\xff" * 9, None,
                        [], {}, 1.5, True, self.L, self.E, 10 ** 6])
        j = r.randrange(4)
        if j == 0:
            m[0] = odd if r.random() < 0.5 else r.randrange(-2, 20)
        elif j == 1:
            m[1] = odd
        elif j == 2 and isinstance(m[2], dict) and m[2]:
            key = r.choice(list(m[2]))
            if r.random() < 0.3:
                del m[2][key]
            else:
                m[2][key] = odd
        else:
            if isinstance(m[2], dict):
                m[2][r.choice(["extra", "layer", "out", "experts", "proto", "fingerprint"])] = odd
        try:
            fr = [msgpack.packb(m, use_bin_type=True)] + fr[1:]
        except Exception:  # noqa: BLE001
            pass
        if len(fr) > 1 and r.random() < 0.4:  # a tensor header that lies
            i = r.randrange(1, len(fr))
            b = bytearray(fr[i])
            if len(b) >= 16:
                w = r.randrange(4)
                if w == 0:
                    b[4] = r.randrange(256)
                elif w == 1:
                    b[8:12] = struct.pack("<I", r.choice([0, 1, 9, 1 << 31, (1 << 32) - 1, 8193]))
                elif w == 2:
                    b[12:16] = struct.pack("<I", r.choice([0, 1, 2, 3, self.d + 1, (1 << 32) - 1]))
                else:  # route pairs: out of range, negative, unsorted
                    if len(b) >= 24:
                        b[16:24] = struct.pack("<ii", r.choice([-1, 0, 5, 1 << 30]), r.choice([-1, self.E, 1 << 30]))
            fr[i] = bytes(b)
        return fr

    def bytes_level(self, fr):
        r = self.rng
        fr = [bytearray(f) for f in fr]
        k = r.randrange(6)
        i = r.randrange(len(fr))
        if k == 0:
            fr[i] = fr[i][:r.randrange(len(fr[i]) + 1)]
        elif k == 1:
            for _ in range(r.randrange(1, 6)):
                if fr[i]:
                    fr[i][r.randrange(len(fr[i]))] = r.randrange(256)
        elif k == 2:
            del fr[i]
            if not fr:
                fr = [bytearray()]
        elif k == 3:
            fr.insert(i, bytearray(r.randbytes(r.randrange(40))))
        elif k == 4:
            fr += [bytearray()] * r.randrange(1, 12)  # more frames than allowed
        else:
            fr[i] += r.randbytes(r.randrange(1, 64))
        return [bytes(f) for f in fr]

    def case(self):
        fr = self.seed()
        k = self.rng.randrange(3)
        if k == 0:
            return fr
        if k == 1:
            return self.structural(fr)
        return self.bytes_level(self.structural(fr) if self.rng.random() < 0.3 else fr)


def fuzz_worker(tag, extra, tmp):
    c = json.load(open(os.path.join(TINY, "config.json")))
    tc = c.get("text_config", c)
    d = tc["routed_expert_hidden_size"]
    E = tc.get("num_experts", 24)
    fp = bytes.fromhex(subprocess.run([BIN, "expert", "--model", TINY, "--print-fingerprint"], capture_output=True,
                                      text=True, timeout=60).stdout.strip())
    ep = f"ipc://{tmp}/{tag}.sock"
    log = harness.logfile()
    # --refuse-shutdown: a SHUTDOWN from the rogue (which completed HELLO) would
    # otherwise end the worker, as PROTOCOL.md §3.3 allows; refused, it is one more case
    w = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", ep, "--threads", "1",
                          "--refuse-shutdown", "--peer-reply-mb", "1", "--reply-budget-mb", "4", *extra],
                         stdout=subprocess.DEVNULL, stderr=log)
    ctx = zmq.Context()
    good = ctx.socket(zmq.DEALER)
    good.setsockopt(zmq.LINGER, 0)
    good.connect(ep)

    def good_call(frames, ms=10000):
        good.send_multipart(frames)
        if not good.poll(ms):
            return None
        return good.recv_multipart()
    h = good_call([ctl(HELLO, 1, {"proto": [1, 2], "fingerprint": fp, "peer": "good"})], 30000)
    ref = good_call(batch(2, 3, d, [(0, 1), (0, 5), (1, 2)], T=2))
    if not R.check(f"{tag}: the worker answers a valid coordinator before the fuzz", h is not None and ref is not None
                   and msgpack.unpackb(ref[0])[0] == RESULT, str(ref)[:200]):
        w.kill()
        return
    ref_data = ref[1]
    rogue = [ctx.socket(zmq.DEALER) for _ in range(2)]  # one that says HELLO first, one that never does
    for s in rogue:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 5000)
        s.setsockopt(zmq.RCVHWM, 100000)
        s.connect(ep)
    rogue[0].send_multipart([ctl(HELLO, 1, {"proto": [1, 2], "fingerprint": fp, "peer": "rogue"})])
    # a third rogue past HELLO asks for the largest replies a legal request can (every token routed
    # to k experts, f32 out) and never reads them (issue 30 item 3): the worker's reply budget
    # (--peer-reply-mb 1 here) refuses it once it holds a MiB unread, the good client is not refused
    sink = ctx.socket(zmq.DEALER)
    sink.setsockopt(zmq.LINGER, 0)
    sink.setsockopt(zmq.SNDTIMEO, 5000)
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    sink.connect(ep)
    sink.send_multipart([ctl(HELLO, 1, {"proto": [1, 2], "fingerprint": fp, "peer": "sink"})])
    if sink.poll(30000):  # its HELLO reply, so that it is connected before the fds are counted
        sink.recv_multipart()
    k = tc["num_experts_per_token"]
    ST = 64
    amp = batch(3, 3, d, [(t, (t + j) % E) for t in range(ST) for j in sorted(range(k), key=lambda j: (t + j) % E)],
                T=ST, out="f32")
    amp_bytes = 16 + 4 * ST * k * d
    sink_sent = 0
    rng = random.Random(SEED)
    mut = Mutator(rng, fp, d, E, int(tc.get("num_hidden_layers", 9)))
    rss0, fds0 = proc_figures(w.pid)
    fig10k = None
    n = checks = bad_checks = send_fail = 0
    t0 = time.monotonic()
    rid = 10
    while n < CASES and time.monotonic() - t0 < SECONDS and w.poll() is None:
        for _ in range(CHUNK):
            fr = mut.case()
            try:
                rogue[rng.randrange(2)].send_multipart(fr)
            except zmq.Again:
                send_fail += 1
            n += 1
        if sink_sent < SINK_MAX:  # within ZeroMQ's 1000 queued replies, so every one is answered
            try:
                sink.send_multipart(amp)
                sink_sent += 1
            except zmq.Again:
                send_fail += 1
        for s in rogue:
            while s.poll(0):
                s.recv_multipart()
        if fig10k is None and n >= 10000:
            time.sleep(0.2)
            fig10k = proc_figures(w.pid)
        if n % CHECK_EVERY < CHUNK:
            rid += 1
            r = good_call(batch(rid, 3, d, [(0, 1), (0, 5), (1, 2)], T=2))
            checks += 1
            if r is None or msgpack.unpackb(r[0])[0] != RESULT or r[1] != ref_data:
                bad_checks += 1
    dt = time.monotonic() - t0
    time.sleep(0.3)
    for s in rogue:
        while s.poll(200):
            s.recv_multipart()
    sink_res = sink_err = sink_named = 0
    while sink.poll(500):
        f = sink.recv_multipart()
        h = msgpack.unpackb(f[0], raw=False)
        sink_res += h[0] == RESULT
        sink_err += h[0] == ERROR
        sink_named += h[0] == ERROR and "--peer-reply-mb" in h[2].get("message", "")
    sink.close()
    alive = w.poll() is None
    rid += 1
    r = good_call(batch(rid, 3, d, [(0, 1), (0, 5), (1, 2)], T=2)) if alive else None
    end_ok = r is not None and r[1] == ref_data
    rss1, fds1 = proc_figures(w.pid) if alive else (0, 0)
    if fig10k is None:
        fig10k = (rss1, fds1)
    log.seek(0)
    text = log.read().decode(errors="replace")
    print(f"{tag} figures: {n} hostile messages in {dt:.1f} s ({n / dt:.0f}/s), seed {SEED}, crashes "
          f"{0 if alive else 1}, good-client checks {checks} ({bad_checks} wrong), sends timed out {send_fail}; "
          f"RSS {rss0 / 2**20:.1f} MiB before, {fig10k[0] / 2**20:.1f} MiB after 10^4, {rss1 / 2**20:.1f} MiB at the "
          f"end; open fds {fds0} / {fig10k[1]} / {fds1}; log {len(text.splitlines())} lines")
    R.check(f"{tag}: the worker is alive after {n} hostile messages (0 crashes)", alive,
            f"rc {w.poll()}: {text[-600:]}")
    R.check(f"{tag}: every good-client check got the reference bytes", bad_checks == 0 and end_ok and checks > 0,
            f"{bad_checks} of {checks}; end {end_ok}")
    R.check(f"{tag}: no fd growth over the fuzz", fds1 <= fds0 + 2, f"{fds0} -> {fds1}")
    R.check(f"{tag}: RSS bounded (< 64 MiB growth)", rss1 - rss0 < 64 << 20, f"{rss0} -> {rss1}")
    R.check(f"{tag}: the log stays bounded (ERROR replies rate-limited)", len(text.splitlines()) < 2000,
            f"{len(text.splitlines())} lines")
    # the sink: replies admitted while it held under a MiB (the first always), the rest refused naming the limit
    print(f"{tag} figures: the never-reading peer sent {sink_sent} requests for {amp_bytes / 1024:.0f} KiB replies: "
          f"{sink_res} admitted, {sink_err} refused ({sink_named} naming --peer-reply-mb)")
    R.check(f"{tag}: a never-reading peer is held to its reply budget (--peer-reply-mb 1)",
            sink_sent > 0 and 1 <= sink_res <= max(1, (1 << 20) // amp_bytes) + 1 and sink_named > 0
            and sink_res + sink_err == sink_sent, f"sent {sink_sent}, results {sink_res}, errors {sink_err}")
    for s in rogue:
        s.close()
    good.close()
    ctx.term()
    harness.terminate(w)


def main():
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
        return 77
    if zmq is None:
        R.record("SKIP", "all", f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-fuzzzmq-")
    try:
        fuzz_worker("mapped", [], tmp)
        fuzz_worker("cached", ["--cache-slots", "64"], tmp)
    finally:
        subprocess.run(["rm", "-rf", tmp])
    print(f"{R.counts['PASS']} passed, {R.counts['FAIL']} failed, {R.counts['SKIP']} skipped")
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
