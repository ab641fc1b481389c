#!/usr/bin/env python3
"""A `shoal expert` against hostile neighbours (issue 20), real processes and
sockets, each case named after the defect it reproduces:

- metrics_drip: clients dripping one byte every 1.5 s, and more idle
  connections than the responder has slots, do not block a concurrent real
  scrape (each answered within 1 s) (item 8);
- sigbus_truncated_shard: a shard truncated under a worker that maps it: the
  next request gets ERROR naming the file, the worker logs it and stays alive
  for requests that do not touch the lost pages (item 5);
- sigbus_handler_names_file: the same with the size check switched off
  (SHOAL_DEBUG_SKIP_SIZE_CHECK=1), so the read faults: one log line naming
  the file and exit status 4, not a silent death by the signal;
- cache_truncated_shard_named_error: the expert cache (pread, no mapping):
  a truncated shard is an ERROR naming the file, the worker serves on;
- utf8_cut_worker_messages: a store read error naming a non-ASCII path, cut
  to its fixed size on a character boundary (valid UTF-8, no U+FFFD);
- local_workers_private: `shoal run --workers N` puts its workers' ipc sockets
  in a 0700 directory (no abstract sockets), removed at exit; a peer that is
  not the spawning coordinator is refused SHUTDOWN (item 4).
- reply_amplification_k3 (issue 30 item 3): at K3 widths (the k3-scale model,
  tools/ensure_scale_model.sh into $SHOAL_BUILD/k3-scale; SKIP, visible, when
  it cannot be made), a worker serving every trunk row: TRUNK_BATCH with 64
  copies of lm_head, or overlapping rows, or T past max_tokens, is refused
  BAD_SHAPE naming the overlap; then rogue peers past HELLO ask for ~12x
  amplified replies (every owned row of width 7168, T = 64, and T = 1024) and
  never read: every refusal names the per-connection or the total limit, the
  worker's anonymous RSS stays within the documented bound (PROTOCOL.md
  section 6: the total reply budget, or one largest reply, plus the received
  requests), a reading peer is served again once the rogues read or leave.
  With --bench-skip-compute (zeros instead of the row products: the memory is
  the same reply buffers, written whole; the products would take minutes here).
"""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_worker_hostile"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
R = harness.Recorder(T)
procs = []

try:
    import msgpack
    import zmq
except ImportError as e:
    msgpack = zmq = None
    IMPORT_ERR = str(e)


def start_worker(model, ranges, ep, *extra, log=None):
    log = log or harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", model, "--experts", ranges, "--listen", ep, "--threads", "1",
                          *extra], stdout=subprocess.DEVNULL, stderr=log)
    p.log = log
    procs.append(p)
    return p


def log_of(p):
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def wait_log(p, text, t=30):
    end = time.monotonic() + t
    while time.monotonic() < end and p.poll() is None:
        if text in log_of(p):
            return True
        time.sleep(0.05)
    return text in log_of(p)


def scrape(port, timeout=1.0):
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        body = r.read()
    return time.monotonic() - t0, body


def case_metrics_drip(tmp):
    port = harness.free_port()
    w = start_worker(TINY, "1-8:0-23", f"ipc://{tmp}/m.sock", "--metrics-port", str(port))
    if not wait_log(w, "metrics on"):
        R.check("metrics_drip: worker started", False, log_of(w)[-400:])
        return
    stop = threading.Event()
    drippers = []

    def drip():
        s = socket.create_connection(("127.0.0.1", port))
        drippers.append(s)
        for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n":
            if stop.wait(1.5):
                break
            try:
                s.send(bytes([ch]))
            except OSError:
                break
    ths = [threading.Thread(target=drip, daemon=True) for _ in range(3)]
    for t in ths:
        t.start()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # more than the slots
    time.sleep(0.3)
    times, fails = [], []
    t_end = time.monotonic() + 6  # several drip periods and past the 2 s deadline
    while time.monotonic() < t_end:
        try:
            dt, body = scrape(port)
            times.append(dt)
            if b"shoal_expert_server_batches_total" not in body:
                fails.append("no shoal_expert_server_batches_total")
        except Exception as e:  # noqa: BLE001
            fails.append(repr(e))
        time.sleep(0.2)
    stop.set()
    for s in idle + drippers:
        s.close()
    R.check("metrics_drip: every concurrent scrape answered within 1 s while 3 clients drip and 40 sit idle",
            not fails and len(times) >= 10, f"{len(fails)} failed ({fails[:3]}), {len(times)} answered")
    print(f"metrics_drip figures: {len(times)} scrapes, max {max(times) * 1000:.0f} ms" if times else "none")
    R.check("metrics_drip: the worker is alive", w.poll() is None)
    harness.terminate(w)


def fingerprint(model):
    r = subprocess.run([BIN, "expert", "--model", model, "--print-fingerprint"], capture_output=True, text=True,
                       timeout=60)
    return bytes.fromhex(r.stdout.strip())


class Peer:
    """a DEALER speaking the protocol (PROTOCOL.md §2), every wait bounded"""

    def __init__(self, ep):
        self.ctx = zmq.Context.instance()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(ep)

    def send(self, frames):
        self.s.send_multipart(frames)

    def recv(self, ms=5000):
        if not self.s.poll(ms):
            return None, []
        fr = self.s.recv_multipart()
        return msgpack.unpackb(fr[0], raw=False), fr[1:]

    def call(self, mtype, rid, body, ms=5000):
        self.send([msgpack.packb([mtype, rid, body], use_bin_type=True)])
        return self.recv(ms)

    def close(self):
        self.s.close()


def tensor(dtype, rows, cols, payload):
    return b"SHTF" + bytes([dtype, 0, 0, 0]) + struct.pack("<II", rows, cols) + payload


def latent(model):
    c = json.load(open(os.path.join(model, "config.json")))
    return c.get("text_config", c)["routed_expert_hidden_size"]


def batch_frames(rid, layer, d, pairs, T=1):
    z = struct.pack(f"<{T * d}f", *[((i * 37) % 101 - 50) / 25.0 for i in range(T * d)])
    route = struct.pack(f"<{2 * len(pairs)}i", *[v for p in pairs for v in p])
    return [msgpack.packb([9, rid, {"layer": layer, "out": "bf16"}]), tensor(1, T, d, z),
            tensor(3, len(pairs), 2, route)]


def case_sigbus_truncated_shard(tmp):
    if zmq is None:
        R.record("SKIP", "sigbus_truncated_shard", f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return
    model = os.path.join(tmp, "trunc-model")
    shutil.copytree(TINY, model)
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    f1 = idx["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    f5 = idx["language_model.model.layers.5.block_sparse_moe.experts.0.w1.weight_packed"]
    assert f1 != f5, "the fixture keeps layers 1 and 5 in different files"
    w = start_worker(model, "1-8:0-23", f"ipc://{tmp}/t.sock")
    c = Peer(f"ipc://{tmp}/t.sock")
    m, _ = c.call(1, 1, {"proto": [1, 2], "fingerprint": fingerprint(model), "peer": "e2e"}, ms=30000)
    d = latent(model)
    c.send(batch_frames(2, 1, d, [(0, 0)]))
    m1, _ = c.recv()
    ok = m is not None and m[0] == 1 and m1 is not None and m1[0] == 10
    if not R.check("sigbus_truncated_shard: the worker serves layer 1 before", ok, f"{m} {m1} {log_of(w)[-300:]}"):
        return
    path = os.path.join(model, f1)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 3)  # the mapping now ends before most of the file's experts
    c.send(batch_frames(3, 1, d, [(0, 0)]))
    m2, _ = c.recv()
    R.check("sigbus_truncated_shard: a request on the truncated file gets ERROR naming it, not SIGBUS",
            m2 is not None and m2[0] == 2 and m2[2]["code"] == 11 and f1 in m2[2]["message"] and
            "truncated" in m2[2]["message"], f"{m2}; worker rc {w.poll()}; {log_of(w)[-400:]}")
    c.send(batch_frames(4, 5, d, [(0, 0)]))
    m3, _ = c.recv()
    R.check("sigbus_truncated_shard: the worker stays alive and serves layer 5 (another file)",
            w.poll() is None and m3 is not None and m3[0] == 10, f"{m3}; rc {w.poll()}")
    R.check("sigbus_truncated_shard: the worker's log names the file", f1 in log_of(w), log_of(w)[-400:])
    c.close()
    harness.terminate(w)


def start_worker_env(model, ranges, ep, env, *extra):
    log = harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", model, "--experts", ranges, "--listen", ep, "--threads", "1",
                          *extra], stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **env})
    p.log = log
    procs.append(p)
    return p


def trunc_model(tmp, name):
    """a copy of tiny-k3 and the shard holding layer 1's experts"""
    model = os.path.join(tmp, name)
    shutil.copytree(TINY, model)
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    return model, idx["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]


def case_sigbus_handler_names_file(tmp):
    """The safety net behind the per-batch size check: a shard truncated
    between the check and the kernel's read. SHOAL_DEBUG_SKIP_SIZE_CHECK=1
    turns the check off, so the read of the truncated mapping faults for sure:
    the worker must end with one line naming the file and exit status 4
    (worker/bank.h, docs/CONFIG.md: 4 = an I/O error part-way), not die by
    the signal (-7) with nothing said."""
    name = "sigbus_handler_names_file"
    if zmq is None:
        R.record("SKIP", name, f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return
    model, f1 = trunc_model(tmp, "sigbus-model")
    ep = f"ipc://{tmp}/sb.sock"
    w = start_worker_env(model, "1-8:0-23", ep, {"SHOAL_DEBUG_SKIP_SIZE_CHECK": "1"})
    c = Peer(ep)
    m, _ = c.call(1, 1, {"proto": [1, 2], "fingerprint": fingerprint(model), "peer": "e2e"}, ms=30000)
    d = latent(model)
    c.send(batch_frames(2, 1, d, [(0, 0)]))
    m1, _ = c.recv()
    ok = m is not None and m[0] == 1 and m1 is not None and m1[0] == 10
    if not R.check(f"{name}: the worker serves layer 1 before", ok, f"{m} {m1} {log_of(w)[-300:]}"):
        return
    R.check(f"{name}: the debug switch is announced in the log", "SHOAL_DEBUG_SKIP_SIZE_CHECK" in log_of(w),
            log_of(w)[-300:])
    path = os.path.join(model, f1)
    with open(path, "r+b") as f:
        f.truncate(0)  # every page of the mapping is gone: the next read of it faults
    c.send(batch_frames(3, 1, d, [(0, 0), (0, 1), (0, 2)]))
    m2, _ = c.recv(ms=10000)
    try:
        rc = w.wait(timeout=20)
    except subprocess.TimeoutExpired:
        rc = None
    text = log_of(w)
    lines = [ln for ln in text.splitlines() if "fatal" in ln]
    R.check(f"{name}: no answer to the faulting batch", m2 is None, f"{m2}")
    R.check(f"{name}: the worker exits with status 4, not killed by the signal",
            rc == 4, f"rc {rc} (-{int(signal.SIGBUS)} is a silent SIGBUS death); log {text[-400:]}")
    R.check(f"{name}: exactly one log line, naming the file", len(lines) == 1 and path in lines[0] and
            "status 4" in lines[0], f"{lines}; log {text[-400:]}")
    c.close()


def case_cache_truncated_shard_named_error(tmp):
    """The expert cache (--cache-gb/--cache-slots: pread into slots, no
    mapping): a shard truncated under it gives the request an ERROR naming the
    file ("file ends N bytes early"), the worker stays up and serves another
    file's layer, and once the file is whole again, the truncated layer too."""
    name = "cache_truncated_shard_named_error"
    if zmq is None:
        R.record("SKIP", name, f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return
    model, f1 = trunc_model(tmp, "cache-trunc-model")
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    f5 = idx["language_model.model.layers.5.block_sparse_moe.experts.0.w1.weight_packed"]
    ep = f"ipc://{tmp}/ct.sock"
    # 8 slots: few enough that layer 1's experts are not all still cached
    w = start_worker(model, "1-8:0-23", ep, "--cache-slots", "8")
    c = Peer(ep)
    m, _ = c.call(1, 1, {"proto": [1, 2], "fingerprint": fingerprint(model), "peer": "e2e"}, ms=30000)
    d = latent(model)
    c.send(batch_frames(2, 5, d, [(0, 0)]))
    m1, _ = c.recv()
    ok = m is not None and m[0] == 1 and m1 is not None and m1[0] == 10
    if not R.check(f"{name}: the cached worker serves before", ok, f"{m} {m1} {log_of(w)[-300:]}"):
        return
    path = os.path.join(model, f1)
    whole = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.truncate(len(whole) // 3)
    pairs = [(e // 12, e) for e in range(8, 16)]  # never read before: not in the cache (k = 6 per token)
    c.send(batch_frames(3, 1, d, pairs, T=2))
    m2, _ = c.recv(ms=10000)
    R.check(f"{name}: a request on the truncated file gets ERROR naming it",
            m2 is not None and m2[0] == 2 and f1 in m2[2].get("message", "") and
            "early" in m2[2].get("message", ""), f"{m2}; rc {w.poll()}; {log_of(w)[-400:]}")
    c.send(batch_frames(4, 5, d, [(0, 0), (0, 1)]))
    m3, _ = c.recv()
    R.check(f"{name}: the worker stays up and serves layer 5 (another file)",
            w.poll() is None and m3 is not None and m3[0] == 10 and f5 != f1, f"{m3}; rc {w.poll()}")
    with open(path, "r+b") as f:
        f.write(whole)
    c.send(batch_frames(5, 1, d, pairs, T=2))
    m4, _ = c.recv()
    R.check(f"{name}: the file whole again, the same request is served", m4 is not None and m4[0] == 10,
            f"{m4}; {log_of(w)[-300:]}")
    c.close()
    harness.terminate(w)


def strict_utf8(b):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


def case_utf8_cut_worker_messages(tmp):
    """Error texts that cut outside text to a fixed size (here a path in the
    expert store's read error) cut on a character boundary, never in the
    middle of one: a model under a path of 3-byte characters, placed so that the old
    300-byte cut fell inside a character. The worker's ERROR text must be
    valid UTF-8 as sent (msgpack str, decoded strictly) with no U+FFFD
    standing for a cut character, and hold the path up to a whole character."""
    name = "utf8_cut_worker_messages"
    if zmq is None:
        R.record("SKIP", name, f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return
    lead = os.path.join(tmp, "u")
    # "read " + path cut at 300 bytes: the cut lands 1 byte into a "€" (3 bytes)
    pad = next(p for p in range(3) if (300 - len((lead + "a" * p + "/").encode()) - 240 - 1) % 3 == 1)
    base = lead + "a" * pad + "/" + "€" * 80 + "/" + "€" * 40
    os.makedirs(base)
    model = os.path.join(base, "m")
    shutil.copytree(TINY, model)
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    f1 = idx["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    path = os.path.join(model, f1)
    assert len(path.encode()) > 300 and not strict_utf8(path.encode()[:300]), "the fixture's cut is mid-character"
    ep = f"ipc://{tmp}/u8.sock"
    w = start_worker(model, "1-8:0-23", ep, "--cache-slots", "8")
    c = Peer(ep)
    m, _ = c.call(1, 1, {"proto": [1, 2], "fingerprint": fingerprint(model), "peer": "e2e"}, ms=30000)
    if not R.check(f"{name}: the worker under a non-ASCII path says HELLO", m is not None and m[0] == 1,
                   f"{m}; {log_of(w)[-300:]}"):
        return
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
    d = latent(model)
    c.send(batch_frames(2, 1, d, [(e // 12, e) for e in range(8, 16)], T=2))
    if not c.s.poll(10000):
        R.check(f"{name}: the worker answers the truncated read", False, log_of(w)[-300:])
        return
    fr = c.s.recv_multipart()
    raw = msgpack.unpackb(fr[0], raw=True)
    msg = strict_utf8(raw[2][b"message"]) if raw[0] == 2 else None
    R.check(f"{name}: the store's read error is valid UTF-8 as sent", msg is not None, f"{raw!r:.600}")
    if msg is not None:
        whole = path[:len(path.encode()[:300].decode("utf-8", "ignore"))]  # the path up to its last whole character
        R.check(f"{name}: it holds the path cut on a character, no U+FFFD", "\ufffd" not in msg and whole in msg and
                path not in msg, f"{msg!r:.600}")
    R.check(f"{name}: the worker log is valid UTF-8", strict_utf8(open_log_bytes(w)) is not None, log_of(w)[-300:])
    c.close()
    harness.terminate(w)


def open_log_bytes(p):
    p.log.seek(0)
    return p.log.read()


def children_of(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open(f"/proc/{d}/stat").read()
                if int(st.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def case_local_workers_private(tmp):
    if zmq is None:
        R.record("SKIP", "local_workers_private", f"pyzmq/msgpack missing ({IMPORT_ERR})")
        return
    p = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--workers", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    procs.append(p)
    line = p.stdout.readline()
    if not R.check("local_workers_private: serve --workers 2 started", "listening on" in line, line):
        return
    url = line.split("listening on ")[1].strip()
    kids = children_of(p.pid)
    eps = []
    for k in kids:
        argv = open(f"/proc/{k}/cmdline", "rb").read().split(b"\0")
        if b"--listen" in argv:
            eps.append(argv[argv.index(b"--listen") + 1].decode())
    R.check("local_workers_private: two workers, each on an ipc:// path socket (no abstract @ name)",
            len(eps) == 2 and all(e.startswith("ipc:///") for e in eps), str(eps))
    unix = open("/proc/net/unix").read()
    R.check("local_workers_private: no abstract socket of this coordinator in /proc/net/unix",
            f"@shoal-{p.pid}-" not in unix, [l for l in unix.splitlines() if f"@shoal-{p.pid}" in l][:3])
    if len(eps) != 2:
        return
    d = os.path.dirname(eps[0][6:])
    st = os.stat(d)
    R.check("local_workers_private: the socket directory is 0700 and ours", (st.st_mode & 0o777) == 0o700 and
            st.st_uid == os.geteuid(), f"{d}: {oct(st.st_mode)} uid {st.st_uid}")
    # another user cannot even connect (when we can run as one: root here)
    if os.geteuid() == 0:
        r = subprocess.run(["/usr/bin/python3", "-c", "import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
                            "try:\n s.connect(sys.argv[1]); print('connected')\n"
                            "except OSError as e:\n print(e.errno)", eps[0][6:]],
                           capture_output=True, text=True, timeout=30, preexec_fn=lambda: (os.setgid(65534),
                                                                                           os.setuid(65534)))
        R.check("local_workers_private: user nobody cannot connect to a worker socket (EACCES)",
                r.stdout.strip() == "13", r.stdout + r.stderr)
    else:
        R.record("SKIP", "local_workers_private: connect as another user", "not root: cannot switch users")
    # a peer that can connect (root, or this user) is not the coordinator: SHUTDOWN refused
    c = Peer(eps[0])
    m, _ = c.call(1, 1, {"proto": [1, 2], "fingerprint": fingerprint(TINY), "peer": "intruder"})
    ok_hello = m is not None and m[0] == 1
    m, _ = c.call(7, 2, {})
    R.check("local_workers_private: SHUTDOWN from a peer that is not the spawning coordinator refused (ERROR "
            "UNKNOWN_TYPE)", ok_hello and m is not None and m[0] == 2 and m[2]["code"] == 5 and
            "SHUTDOWN refused" in m[2]["message"], str(m))
    c.close()
    time.sleep(0.3)
    try:
        h = urllib.request.urlopen(url + "/health", timeout=5).read().decode()
    except Exception as e:  # noqa: BLE001
        h = repr(e)
    R.check("local_workers_private: the workers are alive and /health answers ok", all(
        os.path.exists(f"/proc/{k}") for k in kids) and '"ok"' in h, h[:300])
    rc = harness.terminate(p, 20)
    R.check("local_workers_private: the socket directory is removed at exit", rc == 0 and not os.path.exists(d),
            f"rc {rc}, {d} exists: {os.path.exists(d)}")


def proc_mem(pid):
    """(RssAnon, VmRSS, VmHWM) in bytes"""
    v = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, rest = line.partition(":")
        if k in ("RssAnon", "VmRSS", "VmHWM"):
            v[k] = int(rest.split()[0]) * 1024
    return v.get("RssAnon", 0), v.get("VmRSS", 0), v.get("VmHWM", 0)


def st_widths(model):
    """{tensor name: (rows, cols)} of the 2-D tensors, from the safetensors headers"""
    out = {}
    for fn in sorted(os.listdir(model)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(model, fn), "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                for k, v in json.loads(f.read(n)).items():
                    if k != "__metadata__" and len(v["shape"]) == 2:
                        out[k] = tuple(v["shape"])
    return out


def tbatch(rid, mats, T, cols, layer=0):
    return [msgpack.packb([12, rid, {"layer": layer, "mats": [list(m) for m in mats]}], use_bin_type=True),
            tensor(1, T, cols, bytes(4 * T * cols))]


def case_reply_amplification_k3(tmp):
    c = "reply_amplification_k3"
    model = os.path.join(BUILD, "k3-scale")
    if not os.path.isdir(model) and shutil.disk_usage(BUILD).free < 3_000_000_000:
        R.record("SKIP", c, f"k3-scale: less than 3 GB free in {BUILD}")
        return
    g = subprocess.run(["bash", os.path.join(SRC, "tools", "ensure_scale_model.sh"), model],
                       env=dict(os.environ, SHOAL_PYTHON=os.environ.get("SHOAL_PYTHON", sys.executable)),
                       capture_output=True, text=True)
    if g.returncode != 0:
        R.record("SKIP" if "numpy" in g.stderr + g.stdout else "FAIL", c, (g.stdout + g.stderr)[-400:])
        return
    ep = f"ipc://{tmp}/amp.sock"
    log = harness.logfile()
    w = subprocess.Popen([BIN, "expert", "--model", model, "--trunk", "*:all", "--listen", ep, "--threads", "1",
                          "--bench-skip-compute"], stdout=subprocess.DEVNULL, stderr=log)
    w.log = log
    procs.append(w)
    fp = fingerprint(model)
    obs = Peer(ep)
    m, _ = obs.call(1, 1, {"proto": [1, 4], "fingerprint": fp, "peer": "observer"}, ms=60000)
    if not R.check(f"{c}: HELLO", m is not None and m[0] == 1 and m[2].get("trunk"), str(m)[:300] + log_of(w)[-300:]):
        return
    widths = st_widths(model)
    maxT = m[2]["max_tokens"]
    owned = {n: (lo, hi) for n, lo, hi in m[2]["trunk"]}
    lm = next(n for n in owned if n.endswith("lm_head.weight"))
    cols = widths[lm][1]
    wide = sorted(n for n in owned if widths[n][1] == cols)[:64]
    rows = sum(owned[n][1] - owned[n][0] + 1 for n in wide)
    rid = 10
    base = proc_mem(w.pid)
    # the request: 64 copies of lm_head at T = max_tokens (a 1 GiB reply before the fix)
    for name, mats, T in (("64 copies of lm_head", [(lm, 0, owned[lm][1])] * 64, maxT),
                          ("overlapping rows", [(lm, 0, 100), (lm, 50, 200)], 1),
                          ("T past max_tokens", [(lm, 0, 10)], maxT + 1)):
        rid += 1
        obs.send(tbatch(rid, mats, T, cols))
        r, _ = obs.recv(30000)
        want = "overlap" if "T past" not in name else "max_tokens"
        R.check(f"{c}: {name} refused BAD_SHAPE naming the {want}", r is not None and r[0] == 2 and r[2]["code"] == 6
                and want in r[2]["message"], str(r)[:300])
    rid += 1
    obs.send(tbatch(rid, [(lm, 0, 99), (lm, 100, 199)], 1, cols))
    r, fr = obs.recv(30000)
    R.check(f"{c}: adjacent segments are served", r is not None and r[0] == 13 and len(fr[0]) == 16 + 4 * 200,
            str(r)[:300])
    # rogues past HELLO: ~12x amplified replies (every owned row of the input's width), never read
    peer_mb, total_mb = 256, 1024  # the defaults (docs/CONFIG.md "Resource bounds")
    T1 = 64
    rlen = 16 + 4 * T1 * rows
    big = 16 + 4 * maxT * rows
    req = len(tbatch(0, [(n, *owned[n]) for n in wide], T1, cols)[1])
    n_per = 24
    peak = base
    nstats = [0]

    def stats():
        nonlocal rid
        rid += 1
        nstats[0] += 1
        st, _ = obs.call(5, rid, {}, ms=30000)
        return st[2]["requests"] if st and st[0] == 6 else None

    def settle(target):
        """poll STATS (bounded) until the worker has taken `target` more requests than at base_req"""
        nonlocal peak
        end = time.monotonic() + 120
        while time.monotonic() < end:
            q = stats()
            peak = tuple(max(a, b) for a, b in zip(peak, proc_mem(w.pid)))
            if q is not None and q - base_req - nstats[0] >= target:
                return True
            time.sleep(0.1)
        return False

    base_req = stats() - nstats[0]  # requests before any STATS of ours, and before the rogues connect
    ctx = zmq.Context.instance()
    rogues = []
    for i in range(6):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)      # ZeroMQ on the rogue's side takes at most one reply ...
        s.setsockopt(zmq.RCVBUF, 4096)   # ... and the kernel little more: the rest stays with the worker
        s.setsockopt(zmq.SNDTIMEO, 30000)
        s.connect(ep)
        s.send_multipart([msgpack.packb([1, 1, {"proto": [1, 4], "fingerprint": fp, "peer": f"rogue{i}"}])])
        rogues.append(s)
    t0 = time.monotonic()
    sent = 0
    # first the sixth rogue alone: T = max_tokens, each reply larger than the per-connection limit;
    # a connection holding nothing gets one, then it is refused
    bigframes = tbatch(3, [(n, *owned[n]) for n in wide], maxT, cols)
    for k in range(3):
        rogues[5].send_multipart(bigframes)
        sent += 1
    settle(6 + sent)  # the six HELLOs and these
    # then one rogue alone (T = 64): held to its per-connection limit; then four more: the total limit
    frames = tbatch(2, [(n, *owned[n]) for n in wide], T1, cols)
    for k in range(n_per):
        rogues[0].send_multipart(frames)
        sent += 1
    settle(6 + sent)
    for k in range(n_per):
        for i, s in enumerate(rogues[1:5]):
            s.send_multipart(frames)
            sent += 1
        peak = tuple(max(a, b) for a, b in zip(peak, proc_mem(w.pid)))
    settled = settle(6 + sent)
    dt = time.monotonic() - t0
    R.check(f"{c}: the worker took all {sent} rogue requests", settled, log_of(w)[-300:])
    for _ in range(5):
        time.sleep(0.1)
        peak = tuple(max(a, b) for a, b in zip(peak, proc_mem(w.pid)))
    # while the rogues hold the total budget, a small reply for a reading peer may be refused (the
    # price of a total cap); it is answered either way, at once
    rid += 1
    obs.send(tbatch(rid, [(lm, 0, 9)], 1, cols))
    during, _ = obs.recv(30000)
    # now read everything the rogues were sent
    got = []
    for s in rogues:
        res = errs = 0
        msgs = []
        while s.poll(5000):
            f = s.recv_multipart()
            h = msgpack.unpackb(f[0], raw=False)
            if h[0] == 13:
                res += 1
            elif h[0] == 2:
                errs += 1
                msgs.append(h[2]["message"])
        got.append((res, errs, msgs))
    grow = peak[0] - base[0]
    # PROTOCOL.md section 6: replies held <= max(total budget, the largest legal reply); received
    # requests <= (16 queued + 16 per connection in ZeroMQ) x their frame (the T = 64 ones here: the
    # T = max_tokens ones were taken and freed first); scratch sized at open, touched now
    # (the input copy, max_tokens x cols floats); 32 MiB for the allocator and ZeroMQ's pipes
    scratch = 4 * maxT * cols
    bound = max(total_mb << 20, big) + (16 + 16 * 4) * req + scratch + (32 << 20)
    print(f"{c} figures: K3 widths (k3-scale, d = {cols}), {len(wide)} matrices, {rows} rows owned; request "
          f"{req / 2**20:.2f} MiB, reply {rlen / 2**20:.1f} MiB ({rlen / req:.1f}x) at T = {T1}, "
          f"{big / 2**20:.1f} MiB at T = {maxT}; {sent} rogue requests in {dt:.1f} s; worker RssAnon "
          f"{base[0] / 2**20:.1f} MiB before, peak {peak[0] / 2**20:.1f} MiB (+{grow / 2**20:.1f} MiB), VmHWM "
          f"{peak[2] / 2**20:.1f} MiB; bound +{bound / 2**20:.0f} MiB; per rogue (results, errors) "
          f"{[(a, b) for a, b, _ in got]}", flush=True)
    per = (peer_mb << 20) // rlen
    ok_per = all(a <= max(per, 1) for a, _, _ in got[:5]) and got[0][0] == per
    R.check(f"{c}: no connection had more than {per} unread {rlen / 2**20:.1f} MiB replies admitted", ok_per,
            str([(a, b) for a, b, _ in got]))
    R.check(f"{c}: a lone rogue's refusals name the per-connection limit",
            got[0][1] == n_per - per and all("--peer-reply-mb" in x for x in got[0][2]), str(got[0][2][:2]))
    R.check(f"{c}: refusals name the total limit", any("--reply-budget-mb" in x for g in got for x in g[2]),
            str([g[2][:1] for g in got]))
    R.check(f"{c}: at T = max_tokens a connection holding nothing gets one reply over its limit, then refused",
            got[5][0] == 1 and got[5][1] == 2 and all("--peer-reply-mb" in x for x in got[5][2]), str(got[5]))
    R.check(f"{c}: all {sent} rogue requests answered (result or ERROR)",
            sum(a + b for a, b, _ in got) == sent, str([(a, b) for a, b, _ in got]))
    R.check(f"{c}: worker RssAnon grew {grow / 2**20:.0f} MiB, within the bound {bound / 2**20:.0f} MiB", grow <= bound,
            f"{base} -> {peak}")
    R.check(f"{c}: the reading peer was answered during the attack", during is not None and during[0] in (2, 13),
            str(during)[:300])
    for s in rogues:
        s.close()
    # the rogues gone (their replies released): a reading peer is served again
    ok = False
    end = time.monotonic() + 30
    while time.monotonic() < end and not ok:
        rid += 1
        obs.send(tbatch(rid, [(lm, 0, 9)], 1, cols))
        r, fr = obs.recv(30000)
        ok = r is not None and r[0] == 13 and len(fr[0]) == 16 + 40
        if not ok:
            time.sleep(0.1)
    R.check(f"{c}: a reading peer is served once the rogues leave", ok, str(r)[:300])
    # small replies (STATS_REPLY) to a peer that never reads: ZeroMQ's 1000-message queue, then dropped,
    # counted and logged the first 20 times and every 1000th -- not once per reply
    ping = ctx.socket(zmq.DEALER)
    ping.setsockopt(zmq.LINGER, 0)
    ping.setsockopt(zmq.RCVHWM, 1)
    ping.setsockopt(zmq.RCVBUF, 4096)
    ping.setsockopt(zmq.SNDTIMEO, 30000)
    ping.connect(ep)
    n_ping = 6000
    base_req = stats() - nstats[0]  # settle() counts from here: the reading peer's batches above are before it
    ping.send_multipart([msgpack.packb([1, 1, {"proto": [1, 4], "fingerprint": fp, "peer": "pinger"}])])
    for k in range(n_ping):
        ping.send_multipart([msgpack.packb([5, 10 + k, {}])])
    # the state, not a pause: the worker has taken the HELLO and all 6000 (its
    # `requests` counter, read by the reading peer's STATS; each handled, and
    # its reply sent or dropped and logged, before a later STATS is answered)
    read_all = settle(n_ping + 1)
    nlog = log_of(w).count("reply not sent")
    R.check(f"{c}: {n_ping} unread STATS replies: the drops are logged {nlog} times (the first 20, then every 1000th)",
            read_all and 1 <= nlog <= 20 + n_ping // 1000 and w.poll() is None,
            f"all {n_ping} read: {read_all}; " + log_of(w)[-600:])
    ping.close()
    after = proc_mem(w.pid)
    print(f"{c} figures: RssAnon {after[0] / 2**20:.1f} MiB after the rogues left", flush=True)
    R.check(f"{c}: the memory goes back once the rogues leave (RssAnon {after[0] / 2**20:.0f} MiB)",
            after[0] - base[0] < 64 << 20, f"{base} -> {after}")
    R.check(f"{c}: the worker is alive", w.poll() is None, log_of(w)[-400:])
    obs.close()
    harness.terminate(w)


def main():
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-hostile-")
    try:
        case_reply_amplification_k3(tmp)
        case_metrics_drip(tmp)
        case_local_workers_private(tmp)
        case_sigbus_truncated_shard(tmp)
        case_sigbus_handler_names_file(tmp)
        case_cache_truncated_shard_named_error(tmp)
        case_utf8_cut_worker_messages(tmp)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["rm", "-rf", tmp])
    print(f"{R.counts['PASS']} passed, {R.counts['FAIL']} failed, {R.counts['SKIP']} skipped")
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
