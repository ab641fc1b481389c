"""The scripted monitoring run: tests/models/tiny-k3 with two expert servers
(`shoal expert --metrics-port`) and `shoal run --worker ... --trace FILE
--metrics-file FILE`. Every expected count is derived here from the routing
trace (read with this file's own reader of docs/METRICS.md's format) and the
ownership ranges given to the workers, and every expected byte count from
proto/PROTOCOL.md's message layout (control frames packed with the Python
msgpack package); then both workers' /metrics and the coordinator's
exposition (all parsed with prometheus_client) must agree:
requests = (chunk, MoE layer) exchanges involving the worker, pairs and
per-expert hits = routing decisions, weight bytes = distinct experts x expert
bytes, bytes sent by the coordinator = bytes the worker received for batches,
and the worker-reported queue/compute sums identical on both sides."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgpack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import promcheck  # noqa: E402

free_port = harness.free_port
R = promcheck.Results("test_metrics_workers")
src = os.environ.get("SHOAL_SRC", ".")
shoal = os.environ.get("SHOAL_BIN", "build/bin/shoal")
model = os.path.join(src, "tests", "models", "tiny-k3")
cfg = json.load(open(os.path.join(model, "config.json")))
tc = cfg.get("text_config", cfg)
L, E, K, D = tc["num_hidden_layers"], tc["num_experts"], tc["num_experts_per_token"], tc["routed_expert_hidden_size"]
fk, freq = tc["first_k_dense_replace"], tc["moe_layer_freq"]
moe = [l for l in range(L) if l >= fk and (l - fk) % freq == 0]
PROMPT, GEN = [1, 2, 3, 4, 5, 6, 7], 6
NTOK = len(PROMPT) + GEN - 1
# uneven split, so the shares differ: w0 owns experts 0-9, w1 10-23
SPLIT = 10
RANGES = [f"{moe[0]}-{moe[-1]}:0-{SPLIT - 1}", f"{moe[0]}-{moe[-1]}:{SPLIT}-{E - 1}"]
owner = lambda e: 0 if e < SPLIT else 1  # noqa: E731

tmp = tempfile.mkdtemp(prefix="shoal_mon_")


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
        return r.read().decode()


procs, ports, eps = [], [], []
state = {}


def start_workers():
    for i, rg in enumerate(RANGES):
        ep = f"ipc://{tmp}/w{i}.sock"
        port = free_port()
        p = subprocess.Popen([shoal, "expert", "--model", model, "--experts", rg, "--listen", ep, "--id", f"w{i}",
                              "--threads", "1", "--metrics-port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"w{i}.log"), "w"))
        procs.append(p)
        ports.append(port)
        eps.append(ep)
    end = time.time() + 30
    for i, port in enumerate(ports):
        while True:
            try:
                scrape(port)
                break
            except OSError:
                assert procs[i].poll() is None, open(os.path.join(tmp, f"w{i}.log")).read()
                assert time.time() < end, "worker metrics endpoint did not come up"
                time.sleep(0.1)
    # before any request: the workers' counters are zero
    for port in ports:
        f = promcheck.parse(scrape(port))
        assert promcheck.value(f, "shoal_expert_server_batches", "shoal_expert_server_batches_total") == 0


def run_coordinator():
    trace, mfile = os.path.join(tmp, "run.trace"), os.path.join(tmp, "run.prom")
    cmd = [shoal, "run", "--model", model, "--ids", ",".join(map(str, PROMPT)), "--gen", str(GEN), "--json",
           "--trace", trace, "--metrics-file", mfile]
    for ep in eps:
        cmd += ["--worker", ep]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-3000:]}"
    state["json"] = json.loads(p.stdout)
    state["coord"] = promcheck.parse(open(mfile).read())
    state["workers"] = [promcheck.parse(scrape(port)) for port in ports]
    b = open(trace, "rb").read()
    hb, rb = struct.unpack_from("<I", b, 12)[0], struct.unpack_from("<I", b, 28)[0]
    recs = []
    for off in range(hb, len(b), rb):
        tok, layer, n = struct.unpack_from("<IHH", b, off)
        recs.append((tok, layer, list(struct.unpack_from(f"<{n}H", b, off + 8))))
    state["recs"] = recs


R.check("start_two_workers_with_metrics", start_workers)
R.check("run_with_trace_and_metrics_file", run_coordinator)


def expectations():
    """Per worker, from the trace: exchanges, tokens, pairs, per-(layer,
    expert) hits, distinct experts, and the EXPERT_BATCH bytes per exchange."""
    recs = state["recs"]
    chunk_of = lambda tok: 0 if tok < len(PROMPT) else tok - len(PROMPT) + 1  # noqa: E731
    ex = {}  # (chunk, layer, w) -> {"toks": set, "pairs": n, "experts": set}
    for tok, layer, exps in recs:
        for e in exps:
            k = (chunk_of(tok), layer, owner(e))
            d = ex.setdefault(k, {"toks": set(), "pairs": 0, "experts": set()})
            d["toks"].add(tok)
            d["pairs"] += 1
            d["experts"].add(e)
    want = [{"req": 0, "tok": 0, "pairs": 0, "distinct": 0, "hits": {}, "lpairs": {}, "sent": 0,
             "yin": 0, "nreply": 0, "rids": []} for _ in RANGES]
    # requests go out in (chunk, layer) order, workers ascending; rids are
    # one counter for the coordinator (PROTOCOL.md: per connection increasing):
    # HELLO is 1, then come the client's warm-up PINGs to both workers
    rid = 1 + int(sum(promcheck.value(f, "shoal_expert_server_requests", "shoal_expert_server_requests_total",
                                      worker=f"w{i}", type="PING") for i, f in enumerate(state["workers"])))
    for (c, layer, w) in sorted(ex):
        d = ex[(c, layer, w)]
        rid += 1
        x = want[w]
        x["req"] += 1
        x["tok"] += len(d["toks"])
        x["pairs"] += d["pairs"]
        x["distinct"] += len(d["experts"])
        x["lpairs"][layer] = x["lpairs"].get(layer, 0) + d["pairs"]
        ctl = msgpack.packb([9, rid, {"layer": layer, "out": "bf16"}])
        x["sent"] += len(ctl) + 16 + 4 * len(d["toks"]) * D + 16 + 8 * d["pairs"]
        x["yin"] += 16 + 2 * d["pairs"] * D
        x["rids"].append(rid)
    for tok, layer, exps in recs:
        for e in exps:
            h = want[owner(e)]["hits"]
            h[(layer, e)] = h.get((layer, e), 0) + 1
    return want


def trace_shape():
    recs = state["recs"]
    assert len(recs) == NTOK * len(moe), (len(recs), NTOK * len(moe))


R.check("trace_one_record_per_token_and_moe_layer", trace_shape)


def worker_counters():
    want = expectations()
    for i, f in enumerate(state["workers"]):
        v = lambda fam, **lab: promcheck.value(f, fam, fam + "_total", worker=f"w{i}", **lab)  # noqa: E731
        w = want[i]
        assert v("shoal_expert_server_batches") == w["req"], (i, v("shoal_expert_server_batches"), w["req"])
        assert v("shoal_expert_server_requests", type="EXPERT_BATCH") == w["req"]
        assert v("shoal_expert_server_requests", type="HELLO") == 1
        assert v("shoal_expert_server_tokens") == w["tok"], (i, v("shoal_expert_server_tokens"), w["tok"])
        assert v("shoal_expert_server_pairs") == w["pairs"]
        assert sum(v("shoal_expert_server_errors", code=c) for c in
                   ["MALFORMED", "VERSION", "FINGERPRINT", "NO_HELLO", "UNKNOWN_TYPE", "BAD_SHAPE", "NOT_OWNED",
                    "BAD_ROUTE", "UNSUPPORTED", "SHUTTING_DOWN", "INTERNAL"]) == 0
        hits = {(int(l["layer"]), int(l["expert"])): x for l, x in
                promcheck.samples(f, "shoal_expert_server_expert_pairs", "shoal_expert_server_expert_pairs_total")}
        assert hits == w["hits"], (i, hits, w["hits"])
        owned = promcheck.value(f, "shoal_expert_server_experts_owned")
        assert owned == len(moe) * (SPLIT if i == 0 else E - SPLIT), owned
        per_expert = promcheck.value(f, "shoal_expert_server_expert_bytes") / owned
        assert v("shoal_expert_server_weight_bytes") == w["distinct"] * per_expert
        # the worker received exactly the batches (computed from the protocol) plus
        # one HELLO and the client's warm-up PINGs (4 to 6 bytes each: rid < 2^16)
        pings = v("shoal_expert_server_requests", type="PING")
        rest = v("shoal_expert_server_received_bytes") - w["sent"]
        assert 40 + pings * len(msgpack.packb([3, 2, {}])) <= rest <= 400 + pings * len(msgpack.packb([3, 65535, {}])), \
            (i, rest, pings)
        assert promcheck.value(f, "shoal_expert_server_resident_bytes") > 0
        assert promcheck.value(f, "shoal_expert_server_compute_time_seconds",
                               "shoal_expert_server_compute_time_seconds_count") == w["req"]


R.check("worker_counters_match_the_trace", worker_counters)


def coordinator_counters():
    want = expectations()
    c = state["coord"]
    v = lambda fam, **lab: promcheck.value(c, fam, fam + "_total", **lab)  # noqa: E731
    assert v("shoal_forward_tokens") == NTOK
    assert v("shoal_forward_chunks") == 1 + (GEN - 1)
    total = sum(x["pairs"] for x in want)
    assert total == NTOK * len(moe) * K
    for i, f in enumerate(state["workers"]):
        w, wid = want[i], f"w{i}"
        wv = lambda fam, **lab: promcheck.value(f, fam, fam + "_total", worker=wid, **lab)  # noqa: E731
        assert v("shoal_worker_requests", worker=wid) == w["req"]
        assert v("shoal_worker_pairs", worker=wid) == w["pairs"]
        assert v("shoal_worker_tokens", worker=wid) == w["tok"]
        assert v("shoal_worker_sent_bytes", worker=wid) == w["sent"], (v("shoal_worker_sent_bytes", worker=wid),
                                                                        w["sent"])
        # received = y frames + one EXPERT_RESULT control frame per reply, whose
        # size depends on the queue/compute values: between all-zero and 8-byte ints
        lo = w["yin"] + sum(len(msgpack.packb([10, r, {"queue_us": 0, "compute_us": 0}])) for r in w["rids"])
        hi = w["yin"] + sum(len(msgpack.packb([10, r, {"queue_us": 2**40, "compute_us": 2**40}])) for r in w["rids"])
        got = v("shoal_worker_received_bytes", worker=wid)
        assert lo <= got <= hi, (lo, got, hi)
        # what the worker sent beyond our replies is its one HELLO reply and the
        # PONGs to the warm-up PINGs (4 to 6 bytes each, like the PINGs)
        pongs = wv("shoal_expert_server_requests", type="PING")
        rest = wv("shoal_expert_server_sent_bytes") - got
        assert 60 + pongs * len(msgpack.packb([4, 2, {}])) <= rest <= 2000 + pongs * len(msgpack.packb([4, 65535, {}])), \
            (rest, pongs)
        # the worker's own figures arrive unchanged
        assert v("shoal_worker_compute_seconds", worker=wid) == wv("shoal_expert_server_compute_seconds")
        assert v("shoal_worker_queue_seconds", worker=wid) == wv("shoal_expert_server_queue_seconds")
        assert v("shoal_worker_weight_bytes", worker=wid) == wv("shoal_expert_server_weight_bytes")
        assert promcheck.value(c, "shoal_worker_load_share", worker=wid) == w["pairs"] / total
        assert promcheck.value(c, "shoal_worker_fair_share", worker=wid) == 0.5
        assert promcheck.value(c, "shoal_worker_up", worker=wid) == 1
        assert promcheck.value(c, "shoal_worker_experts_owned", worker=wid) == len(moe) * (SPLIT if i == 0 else E - SPLIT)
        assert promcheck.value(c, "shoal_worker_rtt_seconds", "shoal_worker_rtt_seconds_count", worker=wid) == w["req"]
        for layer, n in w["lpairs"].items():
            assert v("shoal_worker_layer_pairs", worker=wid, layer=str(layer)) == n
        # rtt = network + queue + compute: the network part is what is left
        net = v("shoal_worker_network_seconds", worker=wid)
        rtt = promcheck.value(c, "shoal_worker_rtt_seconds", "shoal_worker_rtt_seconds_sum", worker=wid)
        q, cp = v("shoal_worker_queue_seconds", worker=wid), v("shoal_worker_compute_seconds", worker=wid)
        # (per exchange, network = max(0, rtt - queue - compute), so the sums obey)
        assert 0 <= net <= rtt + 1e-9 and net + q + cp >= rtt - 1e-9 * w["req"], (rtt, net, q, cp)
        assert v("shoal_worker_timeouts", worker=wid) == 0 and v("shoal_worker_errors", worker=wid) == 0
    for layer in moe:
        a = want[0]["lpairs"].get(layer, 0)
        b = want[1]["lpairs"].get(layer, 0)
        assert abs(promcheck.value(c, "shoal_layer_imbalance", layer=str(layer)) - max(a, b) / ((a + b) / 2)) < 1e-12
    slow = sum(v("shoal_worker_slowest", worker=f"w{i}") for i in range(2))
    assert slow == (1 + GEN - 1) * len(moe), slow  # one last replier per layer exchange


R.check("coordinator_counters_match_the_trace_and_workers", coordinator_counters)


def top_once_on_the_run():
    """`shoal top --once` against a /metrics serving this run's exposition."""
    import http.server
    import threading
    body = open(os.path.join(tmp, "run.prom"), "rb").read()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        p = subprocess.run([shoal, "top", "--coordinator", f"http://127.0.0.1:{srv.server_address[1]}", "--once",
                            "--sort", "name"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.strip().split("\n")
        rows = [l.split() for l in lines[lines.index(next(l for l in lines if l.startswith("SHARD"))) + 1:]]
        want = expectations()
        total = sum(x["pairs"] for x in want)
        assert [r[0] for r in rows] == ["w0", "w1"], rows
        for i, r in enumerate(rows):
            assert r[1] == "up" and r[2] == str(len(moe) * (SPLIT if i == 0 else E - SPLIT)), r
            assert r[3] == f"{want[i]['pairs'] / total:.3f}", (r, want[i]["pairs"] / total)
            assert r[10] == str(want[i]["req"]) and r[11] == "0", r
        assert f"{NTOK} tokens, 2/2 shards up" in p.stdout, p.stdout
    finally:
        srv.shutdown()


R.check("top_once_on_the_run", top_once_on_the_run)

def timeout_counted():
    """A worker slower than the deadline: the run fails naming it, and the
    metrics written at exit count one timeout for it and mark it down, while
    the other worker stays up with no failure."""
    slow = []
    try:
        eps2 = []
        for i, rg in enumerate(RANGES):
            ep = f"ipc://{tmp}/s{i}.sock"
            extra = ["--test-delay-ms", "4000"] if i == 1 else []
            slow.append(subprocess.Popen([shoal, "expert", "--model", model, "--experts", rg, "--listen", ep,
                                          "--id", f"s{i}", "--threads", "1", *extra],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            eps2.append(ep)
        mfile = os.path.join(tmp, "slow.prom")
        cmd = [shoal, "run", "--model", model, "--ids", "1,2,3", "--gen", "2", "--metrics-file", mfile,
               "--expert-timeout-ms", "1000"]
        for ep in eps2:
            cmd += ["--worker", ep]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 4 and "s1" in p.stderr, (p.returncode, p.stderr[-1500:])
        c = promcheck.parse(open(mfile).read())
        v = lambda fam, w: promcheck.value(c, fam, fam + "_total", worker=w)  # noqa: E731
        assert v("shoal_worker_timeouts", "s1") == 1, v("shoal_worker_timeouts", "s1")
        assert promcheck.value(c, "shoal_worker_up", worker="s1") == 0
        assert promcheck.value(c, "shoal_worker_up", worker="s0") == 1
        assert v("shoal_worker_timeouts", "s0") == 0 and v("shoal_worker_errors", "s0") == 0
        assert v("shoal_worker_requests", "s1") == 0 and v("shoal_worker_requests", "s0") == 1
    finally:
        for q in slow:
            q.kill()
            q.wait()


R.check("timeout_counted_and_worker_marked_down", timeout_counted)

for p in procs:
    p.terminate()
for p in procs:
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
shutil.rmtree(tmp, ignore_errors=True)
R.finish()
