"""`shoal serve` starts like a service (issue 35): the port is bound before
anything is loaded, so a port in use is refused within 1 s, and /health
answers 503 "starting" with what it waits for while the model loads and the
workers connect; a mistyped model directory is named; --max-context above the
model's maximum is refused and its default is said at start; `shoal
--version` and "did you mean" for mistyped commands and flags.

The slow start is a real one: `--worker tcp://...` whose expert server is
started only after /health has been seen answering "starting"."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import promcheck  # noqa: E402

R = promcheck.Results("test_serve_start")
build = os.environ.get("SHOAL_BUILD", "build")
BIN = os.environ.get("SHOAL_BIN", os.path.join(build, "bin", "shoal"))
TINY = os.path.join(os.environ.get("SHOAL_SRC", "."), "tests", "models", "tiny-k3")
TMP = tempfile.mkdtemp(prefix="shoal_start_")
KEY = "start-key-1"
procs = []


def get(url, key=None, timeout=5):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(pred, what, t=30):
    deadline = time.monotonic() + t
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except OSError as e:
            last = e
        if last is True:
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: last {last!r}")


def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    t0 = time.monotonic()
    p = subprocess.run([BIN, "serve", "--model", TINY, "--port", str(port)], capture_output=True, text=True,
                       timeout=30)
    dt = time.monotonic() - t0
    s.close()
    assert p.returncode == 4, (p.returncode, p.stderr)
    assert f"127.0.0.1:{port}: address already in use" in p.stderr, p.stderr
    assert dt < 1.0, f"refused after {dt:.2f} s"
    assert "model:" not in p.stderr and "tokenizer" not in p.stderr, "loaded something before refusing the port"


def slow_start():
    hp, wp = harness.free_port(), harness.free_port()
    url = f"http://127.0.0.1:{hp}"
    log = open(os.path.join(TMP, "serve.log"), "w+")
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", str(hp), "--api-key", KEY, "--threads", "1",
                            "--worker", f"tcp://127.0.0.1:{wp}", "--insecure-workers", "--hello-timeout-ms", "60000"],
                           stdout=subprocess.PIPE, stderr=log, text=True)
    procs.append(srv)
    seen = {}

    def starting():
        st, body = get(url + "/health", KEY, timeout=2)
        h = json.loads(body)
        seen["h"] = (st, h)
        return st == 503 and h.get("status") == "starting" and "workers" in h.get("waiting_for", "")

    wait_for(starting, "/health 503 starting, waiting for the workers")
    st, h = seen["h"]
    assert h["ready"] is False and f"tcp://127.0.0.1:{wp}" in h.get("detail", ""), h
    # without the key: the status only, not the workers' addresses
    st, body = get(url + "/health")
    h2 = json.loads(body)
    assert st == 503 and h2["status"] == "starting" and "detail" not in h2, h2
    # the API: 401 without the key, 503 not_ready (Retry-After) with it
    st, body = get(url + "/v1/models")
    assert st == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (st, body)
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    try:
        urllib.request.urlopen(req, timeout=5)
        raise AssertionError("a request was served while starting")
    except urllib.error.HTTPError as e:
        assert e.code == 503 and e.headers.get("Retry-After") == "1", e.code
        assert json.loads(e.read())["error"]["code"] == "not_ready"
    # now the worker: the start completes and the same server answers
    w = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen",
                          f"tcp://127.0.0.1:{wp}", "--insecure", "--threads", "1"],
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(TMP, "w.log"), "w"))
    procs.append(w)
    line = srv.stdout.readline()
    assert "listening on" in line, line
    st, body = get(url + "/health", KEY)
    assert st == 200 and json.loads(body)["status"] == "ok", (st, body)
    body = json.dumps({"model": "tiny-k3", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    log.seek(0)
    text = log.read()
    assert "waiting for the workers to answer" in text and "ready in" in text, text[-2000:]
    srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=30) == 0


def stop_while_starting():
    """SIGTERM while waiting for the workers is a clean stop (exit 0) at
    once, not after the HELLO deadline (20 s here)"""
    hp, wp = harness.free_port(), harness.free_port()
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", str(hp), "--threads", "1",
                            "--worker", f"tcp://127.0.0.1:{wp}", "--insecure-workers", "--hello-timeout-ms", "20000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(srv)
    wait_for(lambda: b"workers" in get(f"http://127.0.0.1:{hp}/health", timeout=2)[1], "starting: workers")
    t0 = time.monotonic()
    srv.send_signal(signal.SIGTERM)
    out, err = srv.communicate(timeout=30)
    dt = time.monotonic() - t0
    assert "listening on" not in out, out
    assert srv.returncode == 0 and "stopped while starting" in err, (srv.returncode, err[-1500:])
    assert dt < 5, f"took {dt:.1f} s to stop"


def model_dir_named():
    p = subprocess.run([BIN, "serve", "--model", "/nope/model", "--port", "0"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "--model /nope/model: No such file or directory" in p.stderr and "model directory" in p.stderr, p.stderr
    p = subprocess.run([BIN, "serve", "--model", TMP, "--port", "0"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 3 and f"--model {TMP}: no config.json there" in p.stderr, p.stderr


def max_context():
    p = subprocess.run([BIN, "serve", "--model", TINY, "--port", "0", "--max-context", "100000"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "--max-context 100000 is above the model's maximum, 4096" in p.stderr, p.stderr
    # the default: the model's maximum (tiny-k3 declares 4096), said at start
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(srv)
    line = srv.stdout.readline()
    assert "listening on" in line, line
    st, body = get(line.split("listening on ")[1].strip() + "/v1/models")
    assert json.loads(body)["data"][0]["max_model_len"] == 4096, body
    srv.send_signal(signal.SIGTERM)
    _, err = srv.communicate(timeout=30)
    assert "context 4096 tokens per sequence (default: the model's maximum" in err, err[-2000:]


def version_and_suggestions():
    for v in ("--version", "-V", "version"):
        p = subprocess.run([BIN, v], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and p.stdout.startswith("shoal "), (v, p.stdout, p.stderr)
    p = subprocess.run([BIN, "serv"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "did you mean 'serve'?" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) < 6, "a mistyped command prints the whole help"
    p = subprocess.run([BIN, "serve", "--model", TINY, "--max-contxt", "64"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "did you mean --max-context?" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) < 6, p.stderr
    p = subprocess.run([BIN, "top", "--coordinater", "x"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "did you mean --coordinator?" in p.stderr, p.stderr
    p = subprocess.run([BIN, "run", "--model", TINY, "--promt", "x"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "did you mean --prompt?" in p.stderr, p.stderr
    p = subprocess.run([BIN, "version", "--bogus"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stdout)


try:
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
    else:
        R.check("busy_port_refused_within_1s_before_loading", busy_port)
        R.check("health_starting_during_slow_start_then_ready", slow_start)
        R.check("sigterm_while_starting", stop_while_starting)
        R.check("model_dir_named", model_dir_named)
        R.check("max_context_default_and_refusal", max_context)
        R.check("version_and_did_you_mean", version_and_suggestions)
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
R.finish()
