"""`shoal serve --trace FILE` on tests/models/tiny-k3: GET /metrics parses
with prometheus_client and follows the format's rules (every family of the
server: HTTP, scheduler and the coordinator's); after completions, the
forward token counter equals the routing trace's token span, the phases
(sampling included) have moved, and the trace holds one record per
(token, MoE layer); `shoal top --once` reads the live endpoint; with
--workers 2 the per-worker families add up."""
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promcheck  # noqa: E402

R = promcheck.Results("test_serve_metrics")
src = os.environ.get("SHOAL_SRC", ".")
shoal = os.environ.get("SHOAL_BIN", "build/bin/shoal")
model = os.path.join(src, "tests", "models", "tiny-k3")
cfg = json.load(open(os.path.join(model, "config.json")))
tc = cfg.get("text_config", cfg)
L, K = tc["num_hidden_layers"], tc["num_experts_per_token"]
fk, freq = tc["first_k_dense_replace"], tc["moe_layer_freq"]
moe = [l for l in range(L) if l >= fk and (l - fk) % freq == 0]

tmp = tempfile.mkdtemp(prefix="shoal_serve_metrics_")
trace = os.path.join(tmp, "serve.trace")
log = open(os.path.join(tmp, "serve.log"), "w")
p = subprocess.Popen([shoal, "serve", "--model", model, "--port", "0", "--threads", "1", "--trace", trace],
                     stdout=subprocess.PIPE, stderr=log, text=True)
line = p.stdout.readline()
if "listening on" not in line:
    p.kill()
    R.record("FAIL", "serve_starts", open(os.path.join(tmp, "serve.log")).read()[-2000:])
    R.finish()
URL = line.strip().split("listening on ")[1]


def get_metrics():
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as r:
        assert r.status == 200
        return promcheck.parse(r.read().decode())


def post(path, body):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


st = {}


def before():
    f = get_metrics()
    assert promcheck.value(f, "shoal_forward_tokens", "shoal_forward_tokens_total") == 0
    phases = {l["phase"] for l, _ in promcheck.samples(f, "shoal_phase_seconds", "shoal_phase_seconds_total")}
    assert "sampling" in phases and "attention" in phases, phases


R.check("metrics_valid_before_requests", before)


def after():
    gen = 0
    for prompt in ([1, 2, 3, 4], [5, 6, 7]):
        r = post("/v1/completions", {"model": "tiny-k3", "prompt": prompt, "max_tokens": 5, "temperature": 0})
        gen += r["usage"]["completion_tokens"]
    # the scheduler counts a request's tokens when it releases the request,
    # which may be just after the response went out: wait for it (bounded)
    end = time.time() + 10
    while True:
        f = get_metrics()
        if promcheck.value(f, "shoal_completion_tokens", "shoal_completion_tokens_total") == gen or time.time() > end:
            break
        time.sleep(0.05)
    st["f"] = f
    tokens = promcheck.value(f, "shoal_forward_tokens", "shoal_forward_tokens_total")
    assert tokens > 0
    st["tokens"] = tokens
    ph = {l["phase"]: v for l, v in promcheck.samples(f, "shoal_phase_seconds", "shoal_phase_seconds_total")}
    assert ph["attention"] > 0 and ph["experts"] > 0 and ph["head"] > 0 and ph["sampling"] > 0, ph
    assert promcheck.value(f, "shoal_completion_tokens", "shoal_completion_tokens_total") == gen
    # no expert servers: no per-worker series
    assert "shoal_worker_up" not in f


R.check("counters_after_two_completions", after)


def top_once():
    q = subprocess.run([shoal, "top", "--coordinator", URL, "--once"], capture_output=True, text=True, timeout=30)
    assert q.returncode == 0, q.stderr
    assert "0/0 shards up" in q.stdout and "SHARD" in q.stdout, q.stdout


R.check("top_once_on_serve", top_once)

p.send_signal(signal.SIGTERM)
try:
    p.wait(timeout=60)
except subprocess.TimeoutExpired:
    p.kill()


def trace_matches():
    assert p.returncode == 0, p.returncode
    b = open(trace, "rb").read()
    assert b[:8] == b"SHOALRT\0"
    hb, rb = struct.unpack_from("<I", b, 12)[0], struct.unpack_from("<I", b, 28)[0]
    assert (len(b) - hb) % rb == 0
    toks = set()
    n = 0
    for off in range(hb, len(b), rb):
        tok, layer, k = struct.unpack_from("<IHH", b, off)
        assert layer in moe and k == K
        toks.add(tok)
        n += 1
    # ordinals are contiguous from 0 and cover every forward token
    assert toks == set(range(int(st["tokens"]))), (len(toks), st["tokens"])
    assert n == st["tokens"] * len(moe), (n, st["tokens"])


R.check("trace_covers_every_forward_token", trace_matches)


def with_two_workers():
    """serve --workers 2: after a completion, /metrics has both workers up with
    shares summing to 1 and pairs = forward tokens x MoE layers x k; shoal top
    --once shows both shards."""
    lg = open(os.path.join(tmp, "serve2.log"), "w")
    q = subprocess.Popen([shoal, "serve", "--model", model, "--port", "0", "--threads", "1", "--workers", "2"],
                         stdout=subprocess.PIPE, stderr=lg, text=True)
    try:
        line = q.stdout.readline()
        assert "listening on" in line, open(os.path.join(tmp, "serve2.log")).read()[-2000:]
        url = line.strip().split("listening on ")[1]
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "tiny-k3", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            f = promcheck.parse(r.read().decode())
        ups = promcheck.samples(f, "shoal_worker_up")
        assert len(ups) == 2 and all(v == 1 for _, v in ups), ups
        shares = [v for _, v in promcheck.samples(f, "shoal_worker_load_share")]
        assert abs(sum(shares) - 1) < 1e-12, shares
        tokens = promcheck.value(f, "shoal_forward_tokens", "shoal_forward_tokens_total")
        pairs = sum(v for _, v in promcheck.samples(f, "shoal_worker_pairs", "shoal_worker_pairs_total"))
        assert pairs == tokens * len(moe) * K, (pairs, tokens)
        t = subprocess.run([shoal, "top", "--coordinator", url, "--once"], capture_output=True, text=True, timeout=30)
        assert t.returncode == 0 and "2/2 shards up" in t.stdout, (t.returncode, t.stdout, t.stderr)
    finally:
        q.send_signal(signal.SIGTERM)
        try:
            q.wait(timeout=60)
        except subprocess.TimeoutExpired:
            q.kill()
        lg.close()


R.check("serve_with_two_workers", with_two_workers)
log.close()
subprocess.run(["rm", "-rf", tmp])
R.finish()
