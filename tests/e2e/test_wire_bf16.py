#!/usr/bin/env python3
"""bf16 activations on the wire in the mu numerics class (issue 34;
proto/PROTOCOL.md 1.7), with real processes and sockets on tiny-k3 (BF16
trunk, MXFP4 experts):

- ids_identical: `shoal run --numerics mu` with its routed experts and every
  trunk row on 2 external `shoal expert --numerics mu` workers gives the token
  ids and logits (--dump-logits, byte for byte) of the in-process run, both
  with bf16 on the wire (the default, --wire-act auto) and with f32
  (--wire-act f32); the remote runs really went remote (trunk round trips and
  expert messages counted in their JSON);
- bytes_halve: measured by the receivers (each worker's
  shoal_expert_server_activation_bytes_total{dtype} and
  received_bytes_total, scraped before and after each run): the auto run sent
  every activation frame as bf16 (no f32 activation byte), the f32 run none as
  bf16, f32 bytes = exactly 2 x the bf16 bytes on each worker (the same
  requests), and the difference of all received bytes between the runs is
  exactly the bf16 payload (everything else on the wire is the same);
- old_worker_f32: a worker behind a proxy that announces protocol 1.6 (its
  HELLO reply rewritten: minor 6, no bf16_exact) is sent only f32 activation
  frames (the proxy reads every EXPERT_BATCH/TRUNK_BATCH frame's dtype byte)
  while the direct 1.7 worker gets bf16; ids and logits unchanged;
- portable_unchanged: in the portable class (`--workers 2 --trunk remote`)
  the bytes sent per token (the run's JSON) are the same with --wire-act auto
  and f32, and the ids are the in-process ones; in the mu class the same
  local workers are sent fewer bytes per token with auto than with f32, both
  trunk and expert requests, ids equal;
- refused_where_inexact: a bf16 TRUNK_BATCH x to a portable worker, and to a
  mu worker for an F32 matrix (tiny-k3-plain's trunk), is answered ERROR
  UNSUPPORTED naming why (a raw client over ZeroMQ); the worker keeps serving;
  a bf16 x of the wrong length is MALFORMED.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: about
15 s on 2 busy cores.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_wire_bf16"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PLAIN = os.path.join(SRC, "tests", "models", "tiny-k3-plain")
IDS = "5,17,3,99,42,7"
R = harness.Recorder(T)
check, record = R.check, R.record
tmp = tempfile.mkdtemp(prefix="shoal-wire16-")
procs = []

try:
    import msgpack
    import zmq
except ImportError as e:  # the project venv has both (tools/requirements.txt)
    msgpack = zmq = None
    IMPORT_ERR = str(e)

HELLO, ERROR, TBATCH, EBATCH = 1, 2, 12, 9
F32, BF16 = 1, 2


def cfg(model):
    c = json.load(open(os.path.join(model, "config.json")))
    return c.get("text_config", c)


def worker(model, name, experts, trunk, numerics="mu"):
    ep = f"ipc://{tmp}/{name}"
    port = harness.free_port()
    args = [BIN, "expert", "--model", model, "--listen", ep, "--threads", "1", "--id", name,
            "--numerics", numerics, "--metrics-port", str(port)]
    if experts:
        args += ["--experts", experts]
    if trunk:
        args += ["--trunk", trunk]
    log = open(f"{tmp}/{name}.log", "w")
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    up = harness.poll(lambda: p.poll() is None and os.path.exists(ep[6:]) and scrape(url, name) is not None, 60)
    if not up:
        raise SystemExit(f"worker {name} did not start: {open(f'{tmp}/{name}.log').read()[-2000:]}")
    return ep, url


def scrape(url, wid):
    """(activation f32 bytes, activation bf16 bytes, received bytes) of worker wid, or None"""
    try:
        m = harness.metrics(url)
    except OSError:
        return None
    f = m.get(f'shoal_expert_server_activation_bytes_total{{worker="{wid}",dtype="f32"}}')
    b = m.get(f'shoal_expert_server_activation_bytes_total{{worker="{wid}",dtype="bf16"}}')
    r = m.get(f'shoal_expert_server_received_bytes_total{{worker="{wid}"}}')
    return None if f is None or b is None or r is None else (f, b, r)


def run(model, *extra, timeout=120):
    out = f"{tmp}/logits{time.monotonic_ns()}.bin"
    args = [BIN, "run", "--model", model, "--ids", IDS, "--gen", "6", "--json", "--dump-logits", out,
            "--hello-timeout-ms", "20000", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    j = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    logits = open(out, "rb").read() if os.path.exists(out) else b""
    return r.returncode, j, logits, r.stderr


class OldWorkerProxy:
    """A 1.6 worker as a coordinator sees it: a real worker behind a ZeroMQ
    proxy that rewrites its HELLO replies (minor 6, no bf16_exact) and records
    the dtype byte of every activation frame the coordinator sends it."""

    def __init__(self, backend, front):
        self.backend, self.front = backend, front
        self.dtypes = []  # (message type, activation frame dtype)
        self.stop = False
        self.ctx = zmq.Context()
        self.r = self.ctx.socket(zmq.ROUTER)
        self.r.bind(front)
        self.th = threading.Thread(target=self.loop, daemon=True)
        self.th.start()

    def loop(self):
        poller = zmq.Poller()
        poller.register(self.r, zmq.POLLIN)
        back = {}  # coordinator routing id -> its DEALER to the worker
        while not self.stop:
            for s, _ in poller.poll(50):
                if s is self.r:
                    parts = self.r.recv_multipart()
                    rid, frames = parts[0], parts[1:]
                    if rid not in back:
                        d = self.ctx.socket(zmq.DEALER)
                        d.setsockopt(zmq.LINGER, 0)
                        d.connect(self.backend)
                        back[rid] = d
                        poller.register(d, zmq.POLLIN)
                    t = frames[0][1] if len(frames[0]) > 1 else 0  # [type, rid, body]: 0x93, type
                    if t in (EBATCH, TBATCH) and len(frames) > 1 and len(frames[1]) >= 16:
                        self.dtypes.append((t, frames[1][4]))
                    back[rid].send_multipart(frames)
                else:
                    frames = s.recv_multipart()
                    c = msgpack.unpackb(frames[0], raw=False)
                    if c[0] == HELLO:
                        c[2]["proto"] = [1, 6]
                        c[2].pop("bf16_exact", None)
                        frames[0] = msgpack.packb(c, use_bin_type=True)
                    rid = next(k for k, v in back.items() if v is s)
                    self.r.send_multipart([rid] + frames)
        for d in back.values():
            d.close()
        self.r.close()

    def close(self):
        self.stop = True
        self.th.join(5)
        self.ctx.term()


def deltas(before, after):
    return tuple(a - b for a, b in zip(after, before))


def case_cluster():
    c = cfg(TINY)
    L, E = c["num_hidden_layers"], c["num_experts"]
    k = c["first_k_dense_replace"]
    ex = [f"{k}-{L - 1}:0-{E // 2 - 1}", f"{k}-{L - 1}:{E // 2}-{E - 1}"]
    eps, urls, names = [], [], ["wa", "wb"]
    for i, n in enumerate(names):
        ep, url = worker(TINY, n, ex[i], f"*:{i}/2")
        eps.append(ep)
        urls.append(url)
    ref = run(TINY, "--numerics", "mu")
    if not check("in-process mu run", ref[0] == 0 and ref[1] and ref[2], ref[3][-1500:]):
        return
    remote = ["--numerics", "mu", "--trunk", "remote"] + sum((["--worker", e] for e in eps), [])
    got = {}
    for mode in ("auto", "f32"):
        before = [scrape(u, n) for u, n in zip(urls, names)]
        r = run(TINY, *remote, "--wire-act", mode)
        after = [scrape(u, n) for u, n in zip(urls, names)]
        ok = r[0] == 0 and r[1] is not None
        check(f"ids_identical {mode}: run", ok, r[3][-1500:])
        if not ok:
            return
        j = r[1]
        check(f"ids_identical {mode}: went remote", j.get("decode_trunk_round_trips_per_token", 0) > 0 and
              j.get("decode_wire_messages_per_token", 0) > 0,
              json.dumps({k2: v for k2, v in j.items() if "trunk" in k2 or "wire" in k2}))
        check(f"ids_identical {mode}: ids", j["generated_ids"] == ref[1]["generated_ids"], f"{j['generated_ids']} vs {ref[1]['generated_ids']}")
        check(f"ids_identical {mode}: logits byte-identical to in-process", r[2] == ref[2] and len(r[2]) > 0,
              f"{len(r[2])} vs {len(ref[2])} bytes")
        got[mode] = [deltas(b, a) for b, a in zip(before, after)]
    for i, n in enumerate(names):
        (af, ab, ar), (ff, fb, fr) = got["auto"][i], got["f32"][i]
        check(f"bytes_halve {n}: auto sent every activation as bf16", af == 0 and ab > 0, f"f32 {af}, bf16 {ab}")
        check(f"bytes_halve {n}: --wire-act f32 sent none as bf16", fb == 0 and ff > 0, f"f32 {ff}, bf16 {fb}")
        check(f"bytes_halve {n}: f32 activation bytes = 2 x bf16", ff == 2 * ab, f"f32 {ff}, bf16 {ab}")
        check(f"bytes_halve {n}: all received bytes differ by exactly the bf16 payload", fr - ar == ab,
              f"received f32 run {fr}, auto run {ar}, bf16 payload {ab}")
        print(f"  {n}: activation bytes f32 run {ff:.0f}, auto run {ab:.0f} (x{ff / ab:.3f}); "
              f"all received {fr:.0f} -> {ar:.0f} (x{fr / ar:.3f})", flush=True)

    # a 1.6 worker (wb behind the proxy) keeps getting f32; wa gets bf16
    if zmq is None:
        record("SKIP", "old_worker_f32", f"python zmq/msgpack missing: {IMPORT_ERR}")
        return
    px = OldWorkerProxy(eps[1], f"ipc://{tmp}/old-wb")
    try:
        before = scrape(urls[0], "wa")
        r = run(TINY, "--numerics", "mu", "--trunk", "remote", "--worker", eps[0], "--worker", f"ipc://{tmp}/old-wb")
        after = scrape(urls[0], "wa")
        ok = r[0] == 0 and r[1] is not None
        check("old_worker_f32: run", ok, r[3][-1500:])
        if ok:
            check("old_worker_f32: ids and logits as in-process", r[1]["generated_ids"] == ref[1]["generated_ids"] and r[2] == ref[2])
            kinds = {t for t, _ in px.dtypes}
            check("old_worker_f32: the 1.6 worker got expert and trunk batches, all f32",
                  kinds == {EBATCH, TBATCH} and all(d == F32 for _, d in px.dtypes),
                  f"{len(px.dtypes)} frames, types {sorted(kinds)}, dtypes {sorted({d for _, d in px.dtypes})}")
            d = deltas(before, after)
            check("old_worker_f32: the 1.7 worker beside it got bf16", d[0] == 0 and d[1] > 0, f"{d}")
    finally:
        px.close()


def case_local():
    """--workers 2 --trunk remote, both classes: bytes per token from the run's JSON"""
    per = {}
    for cls in ("portable", "mu"):
        ref = run(TINY, "--numerics", cls)
        for mode in ("auto", "f32"):
            r = run(TINY, "--numerics", cls, "--workers", "2", "--trunk", "remote", "--wire-act", mode)
            ok = r[0] == 0 and r[1] is not None and ref[0] == 0
            check(f"local {cls} {mode}: run", ok, r[3][-1500:])
            if not ok:
                return
            check(f"local {cls} {mode}: ids and logits as in-process", r[1]["generated_ids"] == ref[1]["generated_ids"] and r[2] == ref[2])
            j = r[1]
            per[cls, mode] = (j["decode_wire_bytes_out_per_token"], j.get("decode_trunk_wire_bytes_out_per_token", 0))
    print(f"  decode bytes/token sent (experts + trunk, trunk alone): {per}", flush=True)
    check("portable_unchanged: auto = f32 bytes per token", per["portable", "auto"] == per["portable", "f32"],
          f"{per}")
    check("mu local: auto sends fewer bytes per token than f32, trunk and experts",
          per["mu", "auto"][1] < per["mu", "f32"][1] and
          per["mu", "auto"][0] - per["mu", "auto"][1] < per["mu", "f32"][0] - per["mu", "f32"][1], f"{per}")


def raw_tbatch(ep, fp, width, elems):
    """HELLO, then one TRUNK_BATCH for every row of the first matrix the worker
    announces, x a bf16 frame [1, elems] of 1.0, then PING, over a raw DEALER:
    the three replies' control frames"""
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 20000)
    d.connect(ep)
    try:
        d.send_multipart([msgpack.packb([HELLO, 1, {"proto": [1, 7], "fingerprint": fp, "peer": "raw"}],
                                        use_bin_type=True)])
        h = msgpack.unpackb(d.recv_multipart()[0], raw=False)
        name, lo, hi = h[2]["trunk"][0]
        hdr = b"SHTF" + bytes([BF16, 0, 0, 0]) + struct.pack("<II", 1, width)
        d.send_multipart([msgpack.packb([TBATCH, 2, {"layer": 0, "mats": [[name, lo, hi]]}], use_bin_type=True),
                          hdr + b"\x80\x3f" * elems])
        c = msgpack.unpackb(d.recv_multipart()[0], raw=False)
        d.send_multipart([msgpack.packb([3, 3, {}], use_bin_type=True)])  # PING: still serving
        pong = msgpack.unpackb(d.recv_multipart()[0], raw=False)
    finally:
        d.close()
        ctx.term()
    return h, c, pong


def fingerprint(model):
    r = subprocess.run([BIN, "expert", "--model", model, "--print-fingerprint"], capture_output=True, text=True,
                       timeout=60)
    try:
        return bytes.fromhex(r.stdout.strip())
    except ValueError:
        return None


def case_refused():
    if zmq is None:
        record("SKIP", "refused_where_inexact", f"python zmq/msgpack missing: {IMPORT_ERR}")
        return
    for model, cls, want in ((TINY, "portable", "computes the portable class"), (PLAIN, "mu", "has F32 weights")):
        fp = fingerprint(model)
        if not check(f"refused_where_inexact {cls}: fingerprint from shoal expert --print-fingerprint", fp is not None):
            continue
        hid = cfg(model)["hidden_size"]
        ep, _ = worker(model, f"raw-{cls}", None, "model.layers.0.mlp.gate_proj.weight:all", cls)
        h, r, pong = raw_tbatch(ep, fp, hid, hid)
        # bf16_exact is about EXPERT_BATCH act: never in the portable class; this mu worker serves no
        # expert (and tiny-k3-plain's are BF16), so it may say so -- the trunk is checked per request
        check(f"refused_where_inexact {cls}: HELLO 1.7" + (", no bf16_exact" if cls == "portable" else ""),
              h[2]["proto"] == [1, 8] and (cls == "mu" or not h[2].get("bf16_exact")),
              f"{h[2].get('proto')} {h[2].get('bf16_exact')}")
        check(f"refused_where_inexact {cls}: bf16 x answered UNSUPPORTED naming why",
              r[0] == ERROR and r[2]["code"] == 9 and want in r[2]["message"], f"{r}")
        check(f"refused_where_inexact {cls}: still serving", pong[0] == 4, f"{pong}")
        # a frame whose length is not rows x cols x 2: MALFORMED, and the worker serves on
        h, r, pong = raw_tbatch(ep, fp, hid, hid - 1)
        check(f"refused_where_inexact {cls}: a bf16 x one element short is MALFORMED",
              r[0] == ERROR and r[2]["code"] == 1 and pong[0] == 4, f"{r} {pong}")


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 0
    t0 = time.monotonic()
    try:
        case_cluster()
        case_local()
        case_refused()
    finally:
        for p in procs:
            harness.terminate(p, 5)
    print(f"{T}: {R.counts} in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
