#!/usr/bin/env python3
"""A `shoal expert` against hostile neighbours (issue 20), real processes and
sockets, each case named after the defect it reproduces:

- metrics_drip: clients dripping one byte every 1.5 s, and more idle
  connections than the responder has slots, do not block a concurrent real
  scrape (each answered within 1 s) (item 8);
- sigbus_truncated_shard: a shard truncated under a worker that maps it: the
  next request gets ERROR naming the file, the worker logs it and stays alive
  for requests that do not touch the lost pages (item 5);
- local_workers_private: `shoal run --workers N` puts its workers' ipc sockets
  in a 0700 directory (no abstract sockets), removed at exit; a peer that is
  not the spawning coordinator is refused SHUTDOWN (item 4).
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
R = harness.Recorder(T)
procs = []

try:
    import msgpack
    import zmq
except ImportError as e:
    msgpack = zmq = None
    IMPORT_ERR = str(e)


def start_worker(model, ranges, ep, *extra, log=None):
    log = log or tempfile.TemporaryFile()
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


def main():
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-hostile-")
    try:
        case_metrics_drip(tmp)
        case_local_workers_private(tmp)
        case_sigbus_truncated_shard(tmp)
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
