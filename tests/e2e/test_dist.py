#!/usr/bin/env python3
"""Distributed experts end to end, with real processes and real sockets
(proto/PROTOCOL.md, issue 7):

- `shoal run --json` ids identical to the in-process run for 1, 2 and 4
  workers over tcp:// and ipc://, with contiguous, interleaved and uneven
  (also split by layers) expert assignments, on both tiny models; and with
  `--workers N` (local spawn);
- the model fingerprint equals one computed here from config.json and the
  safetensors headers per PROTOCOL.md section 5 (independently of the C code);
- version and fingerprint mismatches refused naming both sides' values (by the
  worker, and by the coordinator against a fake worker written here);
- ownership gaps refused naming them (overlaps are replicas);
- a worker killed with SIGKILL mid-request, or stopped (SIGSTOP), makes the run
  fail within the deadline naming that worker; never a hang;
- SIGTERM: the request in flight is finished and answered, the queued one is
  refused with SHUTTING_DOWN, exit 0;
- garbage (random frames, raw TCP bytes, an oversized frame) gets ERROR or a
  dropped connection and the worker stays up;
- no orphans: the local workers are gone after a normal exit and after the
  coordinator is SIGKILLed.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import hashlib
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_dist"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# the protocol version this build speaks (proto/PROTOCOL.md's header line, the contract)
PROTO = re.search(r"\*\*Version (\d+\.\d+)\*\*", open(os.path.join(SRC, "proto", "PROTOCOL.md")).read()).group(1)
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PLAIN = os.path.join(SRC, "tests", "models", "tiny-k3-plain")


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


try:
    import msgpack
    import zmq
except ImportError as e:  # the project venv has them (tools/requirements.txt)
    msgpack = zmq = None
    IMPORT_ERR = str(e)

tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
nep = 0


def ipc_ep():
    global nep
    nep += 1
    return f"ipc://@shoal-e2e-{tag}-{nep}"


def tcp_ep():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


procs = []


def start_worker(model, ranges, ep, *extra):
    log = harness.logfile()
    plain = ["--insecure"] if ep.startswith("tcp://") else []  # CURVE is tested in test_curve.py
    p = subprocess.Popen([BIN, "expert", "--model", model, "--experts", ranges, "--listen", ep, "--threads", "1",
                          *plain, *extra], stdout=subprocess.DEVNULL, stderr=log)
    p.log = log
    p.ep = ep
    procs.append(p)
    return p


def stop(p, sig=signal.SIGTERM, wait=10):
    if p.poll() is None:
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass
    try:
        return p.wait(wait)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def log_of(p):
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def run(model, *args, timeout=120):
    t0 = time.monotonic()
    plain = ["--insecure-workers"] if any(str(a).startswith("tcp://") for a in args) else []
    r = subprocess.run([BIN, "run", "--model", model, "--json", *args, *plain], capture_output=True, text=True,
                       timeout=timeout)
    r.elapsed = time.monotonic() - t0
    try:
        r.doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    except (ValueError, IndexError):
        r.doc = None
    return r


def ids_of(r):
    return r.doc["generated_ids"] if r.returncode == 0 and r.doc else None


# ---- fingerprint, computed from the files per PROTOCOL.md section 5 --------

def st_headers(model):
    idx = os.path.join(model, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else \
        [f for f in os.listdir(model) if f.endswith(".safetensors")]
    out = {}
    for fn in files:
        with open(os.path.join(model, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        for k, v in h.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
    return out


def fingerprint(model):
    c = json.load(open(os.path.join(model, "config.json")))
    t = c.get("text_config", c)
    mx = "quantization_config" in t or "quantization_config" in c
    L, E = t["num_hidden_layers"], t["num_experts"]
    moe = [l for l in range(L) if l >= t["first_k_dense_replace"] and l % t["moe_layer_freq"] == 0]
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]
    lines = ["shoal model fingerprint 1", f"num_layers={L}", f"hidden_size={t['hidden_size']}",
             f"vocab_size={t['vocab_size']}", f"latent_size={t['routed_expert_hidden_size']}",
             f"moe_intermediate_size={t['moe_intermediate_size']}", f"num_experts={E}",
             f"experts_per_token={t['num_experts_per_token']}", f"first_k_dense={t['first_k_dense_replace']}",
             f"moe_layer_freq={t['moe_layer_freq']}", "expert_format=" + ("mxfp4" if mx else "unquantized"),
             f"expert_group_size={32 if mx else 0}", "situ_beta=%.9g" % f32(t["activation_situ_beta"]),
             "situ_linear_beta=%.9g" % f32(t["activation_situ_linear_beta"]),
             "moe_layers=" + ",".join(map(str, moe))]
    hdr = st_headers(model)
    for l in moe:
        for e in range(E):
            for w in (1, 3, 2):
                for part in (("weight_packed", "weight_scale") if mx else ("weight",)):
                    name = f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w{w}.{part}"
                    dt, shape, nb = hdr[name]
                    lines.append(f"tensor {name} {dt} [{','.join(map(str, shape))}] {nb}")
    text = "".join(x + "\n" for x in lines)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


# ---- a tiny Python client of the protocol ----------------------------------

def tensor(dtype, rows, cols, payload):
    return b"SHTF" + bytes([dtype, 0, 0, 0]) + struct.pack("<II", rows, cols) + payload


class Client:
    def __init__(self, ep):
        self.ctx = zmq.Context.instance()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.setsockopt(zmq.RCVTIMEO, 10000)
        self.s.connect(ep)

    def send(self, frames):
        self.s.send_multipart(frames)

    def recv(self):
        parts = self.s.recv_multipart()
        return msgpack.unpackb(parts[0]), parts[1:]

    def hello(self, fp, major=1, minor=0, rid=1):
        self.send([msgpack.packb([1, rid, {"proto": [major, minor], "fingerprint": bytes.fromhex(fp),
                                           "peer": "e2e"}])])
        return self.recv()

    def ping(self, rid=5):
        self.send([msgpack.packb([3, rid, {}])])
        return self.recv()

    def close(self):
        self.s.close()


def batch_frames(rid, layer, d, T, pairs):
    z = struct.pack(f"<{T * d}f", *[((i * 37) % 101 - 50) / 25.0 for i in range(T * d)])
    route = struct.pack(f"<{2 * len(pairs)}i", *[v for p in pairs for v in p])
    return [msgpack.packb([9, rid, {"layer": layer, "out": "bf16"}]), tensor(1, T, d, z),
            tensor(3, len(pairs), 2, route)]


def latent(model):
    c = json.load(open(os.path.join(model, "config.json")))
    return c.get("text_config", c)["routed_expert_hidden_size"]


# ---- cases ----------------------------------------------------------------

PROMPT = "3,17,250,1001,42,7,99,512,4000,1"


def case_determinism(model, name, layouts, gen, spawn_counts=(1, 2, 4), base_extra=()):
    ref = run(model, "--ids", PROMPT, "--gen", str(gen), *base_extra)
    want = ids_of(ref)
    if not check(f"{name}: in-process reference", want is not None and len(want) > 0, ref.stderr[-500:]):
        return
    for transport, mk in (("ipc", ipc_ep), ("tcp", tcp_ep)):
        for lname, ranges in layouts:
            ws = [start_worker(model, r, mk(), "--id", f"w{i}") for i, r in enumerate(ranges)]
            args = [a for w in ws for a in ("--worker", w.ep)]
            r = run(model, "--ids", PROMPT, "--gen", str(gen), *base_extra, *args)
            got = ids_of(r)
            check(f"{name}: {len(ws)} worker(s) over {transport}, {lname}: ids identical", got == want,
                  f"got {got} want {want}; rc {r.returncode}: {r.stderr[-600:]}")
            if got == want and r.doc:
                check(f"{name}: {len(ws)} worker(s) over {transport}, {lname}: wire bytes reported",
                      r.doc.get("workers") == len(ws) and r.doc.get("decode_wire_bytes_per_token", 0) > 0,
                      str({k: v for k, v in r.doc.items() if "wire" in k or k == "workers"}))
            for w in ws:
                rc = stop(w)
                check(f"{name}: {transport} {lname}: worker {w.ep} exits 0 on SIGTERM", rc == 0,
                      f"rc {rc}: {log_of(w)[-400:]}")
    for n in spawn_counts:
        r = run(model, "--ids", PROMPT, "--gen", str(gen), *base_extra, "--workers", str(n))
        check(f"{name}: --workers {n} (local ipc): ids identical", ids_of(r) == want,
              f"rc {r.returncode}: {r.stderr[-600:]}")


def case_chunks_threads(model, name):
    """Prefill in chunks of 3 and other thread counts, against 3 workers."""
    ref = ids_of(run(model, "--ids", PROMPT, "--gen", "6"))
    ws = [start_worker(model, r, ipc_ep()) for r in ("1-8:0-7", "1-8:8-15", "1-8:16-23")]
    r = run(model, "--ids", PROMPT, "--gen", "6", "--batch", "3", "--threads", "1",
            *[a for w in ws for a in ("--worker", w.ep)])
    check(f"{name}: 3 workers, prefill chunks of 3, 1 thread: ids identical", ids_of(r) == ref,
          f"rc {r.returncode}: {r.stderr[-600:]}")
    for w in ws:
        stop(w)
    r = run(model, "--ids", PROMPT, "--gen", "6", "--workers", "2", "--worker-threads", "2", "--threads", "2")
    check(f"{name}: --workers 2 with 2 threads each: ids identical", ids_of(r) == ref,
          f"rc {r.returncode}: {r.stderr[-600:]}")


def case_fingerprint():
    for model in (TINY, PLAIN):
        out = subprocess.run([BIN, "expert", "--model", model, "--print-fingerprint"], capture_output=True,
                             text=True)
        mine = fingerprint(model)
        check(f"fingerprint of {os.path.basename(model)} matches PROTOCOL.md section 5 computed in Python",
              out.returncode == 0 and out.stdout.strip() == mine, f"{out.stdout.strip()} vs {mine}")


def case_mismatches():
    fp_tiny, fp_plain = fingerprint(TINY), fingerprint(PLAIN)
    # the worker refuses a HELLO of another major version / another model, naming both
    w = start_worker(TINY, "1-8:0-23", ipc_ep())
    c = Client(w.ep)
    (m, _) = c.hello(fp_tiny, major=2, minor=7)
    check("worker refuses protocol 2.7 naming both versions",
          m[0] == 2 and m[2]["code"] == 2 and f"coordinator 2.7, worker {PROTO}" in m[2]["message"], str(m))
    (m, _) = c.hello(fp_plain)
    check("worker refuses another model's fingerprint naming both",
          m[0] == 2 and m[2]["code"] == 3 and fp_plain in m[2]["message"] and fp_tiny in m[2]["message"], str(m))
    (m, _) = c.ping()
    check("worker refuses PING before a successful HELLO", m[0] == 2 and m[2]["code"] == 4, str(m))
    (m, _) = c.hello(fp_tiny)
    check("worker accepts the right HELLO", m[0] == 1 and m[2]["owned"] == [[1, 8, 0, 23]], str(m))
    c.close()
    stop(w)
    # the coordinator refuses a worker of another model
    w = start_worker(PLAIN, "1-4:0-15", ipc_ep())
    r = run(TINY, "--ids", PROMPT, "--gen", "2", "--worker", w.ep, timeout=60)
    check("coordinator refuses a worker of another model (exit 3, both fingerprints, the endpoint)",
          r.returncode == 3 and fp_tiny in r.stderr and fp_plain in r.stderr and w.ep in r.stderr,
          f"rc {r.returncode}: {r.stderr[-600:]}")
    stop(w)
    # the coordinator refuses a worker that speaks protocol 2.0 (a fake worker)
    ctx = zmq.Context.instance()
    srv = ctx.socket(zmq.ROUTER)
    ep = ipc_ep()
    srv.bind(ep)
    p = subprocess.Popen([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", "2", "--worker", ep,
                          "--hello-timeout-ms", "20000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ok = srv.poll(20000)
    if ok:
        ident, hello = srv.recv_multipart()
        h = msgpack.unpackb(hello)
        srv.send_multipart([ident, msgpack.packb([1, h[1], {
            "proto": [2, 0], "fingerprint": bytes.fromhex(fp_tiny), "worker": "future", "owned": [[1, 8, 0, 23]],
            "act": ["f32"], "out": ["bf16"], "max_tokens": 8192, "isa": "x", "threads": 1, "expert_bytes": 0,
            "mem_total": 0}])])
    try:
        out, errs = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, errs = p.communicate()
    check("coordinator refuses a worker speaking protocol 2.0 (exit 3, both versions)",
          ok and p.returncode == 3 and f"coordinator {PROTO}, worker 2.0" in errs, f"rc {p.returncode}: {errs[-500:]}")
    srv.close()


def case_coverage():
    a = start_worker(TINY, "1-8:0-11", ipc_ep(), "--id", "wa")
    b = start_worker(TINY, "1-8:10-20", ipc_ep(), "--id", "wb")
    r = run(TINY, "--ids", PROMPT, "--gen", "2", "--worker", a.ep, "--worker", b.ep, timeout=60)
    check("gaps refused (exit 3) naming them; the overlap is a replica, not named",
          r.returncode == 3 and "experts 21-23: owned by no worker" in r.stderr and "experts 10-11" not in r.stderr,
          f"rc {r.returncode}: {r.stderr[-600:]}")
    stop(a)
    stop(b)


def case_killed_mid_request():
    a = start_worker(TINY, "1-8:0-11", ipc_ep(), "--id", "wa")
    b = start_worker(TINY, "1-8:12-23", ipc_ep(), "--id", "wb", "--test-delay-ms", "3000")
    p = subprocess.Popen([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", "4", "--worker", a.ep, "--worker",
                          b.ep, "--expert-timeout-ms", "20000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    held = harness.poll(lambda: "test delay: EXPERT_BATCH" in log_of(b), secs=60, every=0.02)
    check("wb holds the first layer's request (its 3 s delay)", held, log_of(b)[-300:])
    t0 = time.monotonic()
    os.kill(b.pid, signal.SIGKILL)
    try:
        out, errs = p.communicate(timeout=25)
        dt = time.monotonic() - t0
        check("SIGKILL of a worker mid-request: the run fails (exit 4) within the deadline naming it",
              p.returncode == 4 and b.ep in errs and dt < 20, f"rc {p.returncode} after {dt:.2f} s: {errs[-500:]}")
        check("  ... and at once (disconnect seen, not the 20 s deadline)", dt < 5, f"{dt:.2f} s")
    except subprocess.TimeoutExpired:
        p.kill()
        record("FAIL", "SIGKILL of a worker mid-request", "coordinator hung")
    b.wait()
    stop(a)
    # a silent (stopped) worker: the deadline
    a = start_worker(TINY, "1-8:0-11", ipc_ep(), "--id", "wa")
    b = start_worker(TINY, "1-8:12-23", ipc_ep(), "--id", "wb", "--test-delay-ms", "1000")
    p = subprocess.Popen([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", "4", "--worker", a.ep, "--worker",
                          b.ep, "--expert-timeout-ms", "2500"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    held = harness.poll(lambda: "test delay: EXPERT_BATCH" in log_of(b), secs=60, every=0.02)
    check("wb holds a request (its 1 s delay)", held, log_of(b)[-300:])
    os.kill(b.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, errs = p.communicate(timeout=30)
        dt = time.monotonic() - t0
        check("a silent (SIGSTOPped) worker: exit 4 within the 2.5 s deadline naming it",
              p.returncode == 4 and b.ep in errs and "within 2500 ms" in errs and dt < 6,
              f"rc {p.returncode} after {dt:.2f} s: {errs[-500:]}")
    except subprocess.TimeoutExpired:
        p.kill()
        record("FAIL", "a silent worker", "coordinator hung")
    os.kill(b.pid, signal.SIGCONT)
    stop(b)
    stop(a)


def case_sigterm():
    d = latent(TINY)
    w = start_worker(TINY, "1-8:0-23", ipc_ep(), "--test-delay-ms", "1000")
    c = Client(w.ep)
    m, _ = c.hello(fingerprint(TINY))
    c.send(batch_frames(10, 2, d, 2, [(0, 1), (0, 5), (1, 3)]))
    c.send(batch_frames(11, 3, d, 1, [(0, 7)]))
    harness.poll(lambda: "test delay: EXPERT_BATCH" in log_of(w), secs=60, every=0.02)  # request 10 in flight
    w.send_signal(signal.SIGTERM)
    r1, f1 = c.recv()
    r2, _ = c.recv()
    rc = w.wait(10)
    check("SIGTERM: the request in flight is finished and answered",
          r1[0] == 10 and r1[1] == 10 and len(f1) == 1 and len(f1[0]) == 16 + 3 * d * 2, str(r1))
    check("SIGTERM: the queued request is refused with SHUTTING_DOWN", r2[0] == 2 and r2[1] == 11 and
          r2[2]["code"] == 10, str(r2))
    check("SIGTERM: the worker exits 0", rc == 0, f"rc {rc}: {log_of(w)[-300:]}")
    c.close()
    # SHUTDOWN message
    w = start_worker(TINY, "1-8:0-23", ipc_ep())
    c = Client(w.ep)
    c.hello(fingerprint(TINY))
    c.send([msgpack.packb([7, 3, {}])])
    m, _ = c.recv()
    check("SHUTDOWN is acknowledged and the worker exits 0", m[0] == 8 and m[1] == 3 and w.wait(10) == 0, str(m))
    c.close()


def case_garbage():
    d = latent(TINY)
    ep = tcp_ep()
    w = start_worker(TINY, "1-8:0-23", ep, "--max-tokens", "16")
    c = Client(ep)
    rnd = random.Random(7)
    bad = 0
    for i in range(300):
        frames = [bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 80))) for _ in range(rnd.randrange(1, 5))]
        if i % 3 == 0:  # near-valid: a real envelope with broken bodies or tensors
            frames[0] = msgpack.packb([rnd.choice([1, 3, 9, 9, 9, 42]), i, {"layer": rnd.randrange(-1, 12),
                                                                           "out": rnd.choice(["bf16", "f64", 3])}])
        c.send(frames)
        m, _ = c.recv()
        bad += not (m[0] == 2 and m[2]["code"] in range(1, 12))
    check("300 malformed messages: one ERROR each", bad == 0, f"{bad} other replies")
    fp = fingerprint(TINY)
    m, _ = c.hello(fp)
    check("after garbage the worker still answers HELLO", m[0] == 1, str(m))
    c.send(batch_frames(12, 1, d, 1, [(0, 3)])[:2] + [tensor(3, 1, 2, struct.pack("<ii", 0, 24))])
    m, _ = c.recv()
    check("an expert id beyond the model gets BAD_ROUTE", m[0] == 2 and m[2]["code"] == 8, str(m))
    c.send(batch_frames(13, 1, d, 17, [(t, 0) for t in range(17)]))
    m, _ = c.recv()
    check("more tokens than --max-tokens gets BAD_SHAPE", m[0] == 2 and m[2]["code"] == 6, str(m))
    # raw bytes on the TCP port (not ZMTP) and an oversized frame: connections dropped, worker up
    host, port = ep[len("tcp://"):].split(":")
    for blob in (b"\x00" * 3, bytes(rnd.randrange(256) for _ in range(5000)), b"GET / HTTP/1.1\r\n\r\n"):
        s = socket.create_connection((host, int(port)))
        try:
            s.sendall(blob)
            s.settimeout(2)
            try:
                s.recv(100)
            except OSError:
                pass
        finally:
            s.close()
    big = Client(ep)
    big.s.setsockopt(zmq.RCVTIMEO, 1500)
    big.send([b"\x93" + b"\x00" * (16 + 17 * d * 4 + 4 * 1024 * 1024)])
    try:
        big.recv()
        over = "answered"
    except zmq.Again:
        over = "dropped"
    big.close()
    m, _ = c.ping()
    check("raw TCP garbage and an oversized frame: the worker stays up and serves",
          w.poll() is None and m[0] == 4, f"oversized frame {over}; reply {m}")
    c.close()
    check("the worker exits 0 after all that", stop(w) == 0, log_of(w)[-300:])


def children_of(pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                if int(st[st.rindex(")") + 2:].split()[1]) == pid:
                    kids.append(int(d))
            except (OSError, ValueError):
                pass
    return kids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def case_no_orphans():
    p = subprocess.Popen([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", "3", "--workers", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and p.poll() is None and len(kids) < 2:
        kids = children_of(p.pid)
        time.sleep(0.02)
    p.wait(60)
    deadline = time.monotonic() + 10  # polled: their exit may trail the parent's on a busy machine
    while time.monotonic() < deadline and any(alive(k) for k in kids):
        time.sleep(0.05)
    check("normal exit: both local workers are gone", len(kids) == 2 and not any(alive(k) for k in kids),
          f"children seen {kids}, alive {[k for k in kids if alive(k)]}")
    p = subprocess.Popen([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", "3000", "--workers", "3"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and len(kids) < 3:
        kids = children_of(p.pid)
        time.sleep(0.05)
    time.sleep(1.0)  # generating
    p.kill()
    p.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5 and any(alive(k) for k in kids):
        time.sleep(0.05)
    left = [k for k in kids if alive(k)]
    check("coordinator SIGKILLed: its 3 local workers exit (PR_SET_PDEATHSIG)", len(kids) == 3 and not left,
          f"children {kids}, still alive {left}")
    for k in left:
        os.kill(k, signal.SIGKILL)


def main():
    if not os.access(BIN, os.X_OK):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    if msgpack is None:
        record("SKIP", "all", f"python msgpack/pyzmq missing ({IMPORT_ERR}); run scripts/deps.sh")
        return 77
    if not os.path.exists(os.path.join(TINY, "config.json")):
        record("SKIP", "all", "tests/models/tiny-k3 missing")
        return 77
    try:
        case_fingerprint()
        case_determinism(TINY, "tiny-k3", [
            ("all experts", ["1-8:0-23"]),
            ("contiguous", ["1-8:0-11", "1-8:12-23"]),
            ("interleaved", ["1-8:0-3,1-8:8-11,1-8:16-19", "1-8:4-7,1-8:12-15,1-8:20-23"]),
            ("uneven, split by layers", ["1-8:0-17", "1-8:18", "1-4:19-23", "5-8:19-23"]),
        ], gen=6)
        case_determinism(PLAIN, "tiny-k3-plain", [
            ("interleaved", ["1-4:0,1-4:2,1-4:4,1-4:6,1-4:8,1-4:10,1-4:12,1-4:14",
                             "1-4:1,1-4:3,1-4:5,1-4:7,1-4:9,1-4:11,1-4:13,1-4:15"]),
            ("uneven", ["1-4:0-12", "1:13-15", "2-3:13-15", "4:13-15"]),
        ], gen=6, spawn_counts=(2,))
        case_chunks_threads(TINY, "tiny-k3")
        case_mismatches()
        case_coverage()
        case_killed_mid_request()
        case_sigterm()
        case_garbage()
        case_no_orphans()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
