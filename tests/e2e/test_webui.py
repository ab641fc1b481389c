"""The live cluster page (issue 35) in a real headless browser (Debian's
chromium over the DevTools protocol, tests/e2e/cdp.py), against `shoal serve
--api-key` with two remote workers that each hold every expert (replicas):
the page shell loads without the key and asks for it; with the key it shows
both workers with their shard (experts owned, memory); a request's tokens/s
shows; a worker stopped with SIGSTOP (and a request that needs it) turns red
within 2 s and shows "taken over by" the other; `shoal top --web` serves the
same page for that coordinator. /v1/cluster and its event stream refuse a
caller without the key. Saves a screenshot (SHOAL_WEBUI_SCREENSHOT=PATH
keeps it, e.g. for docs/). Skipped by name without chromium."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cdp  # noqa: E402
import harness  # noqa: E402
import promcheck  # noqa: E402

R = promcheck.Results("test_webui")
src = os.environ.get("SHOAL_SRC", ".")
build = os.environ.get("SHOAL_BUILD", "build")
BIN = os.environ.get("SHOAL_BIN", os.path.join(build, "bin", "shoal"))
TINY = os.path.join(src, "tests", "models", "tiny-k3")
TMP = tempfile.mkdtemp(prefix="shoal_webui_")
KEY = "web-" + os.urandom(6).hex()
procs = []
S = {}


def get(url, key=None, timeout=10):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def complete(n, stream=False):
    body = json.dumps({"model": "tiny-k3", "prompt": [1, 2, 3, 4], "max_tokens": n, "temperature": 0,
                       "stream": stream}).encode()
    req = urllib.request.Request(S["url"] + "/v1/completions", data=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def start():
    eps = [f"ipc://{TMP}/w{i}.sock" for i in range(2)]
    for i, ep in enumerate(eps):
        procs.append(subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", ep,
                                       "--id", f"w{i}", "--threads", "1"],
                                      stdout=subprocess.DEVNULL, stderr=open(os.path.join(TMP, f"w{i}.log"), "w")))
    S["workers"] = procs[:2]
    cmd = [BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1", "--api-key", KEY, "--memo", "0",
           "--failover-ms", "300", "--expert-timeout-ms", "5000"]
    for ep in eps:
        cmd += ["--worker", ep]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(os.path.join(TMP, "serve.log"), "w"), text=True)
    procs.append(srv)
    line = srv.stdout.readline()
    assert "listening on" in line, open(os.path.join(TMP, "serve.log")).read()[-2000:]
    S["url"] = line.split("listening on ")[1].strip()


def endpoints():
    u = S["url"]
    st, h, body = get(u + "/")
    assert st == 200 and h["Content-Type"].startswith("text/html") and b"<svg" in body, (st, h)
    assert "default-src 'none'" in h["Content-Security-Policy"], h
    assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b""), "the page loads something external"
    for p in ("/v1/cluster", "/v1/cluster/events"):
        st, _, body = get(u + p)
        assert st == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (p, st, body)
    st, _, body = get(u + "/v1/cluster", KEY)
    c = json.loads(body)
    assert st == 200 and [w["id"] for w in c["workers"]] == ["w0", "w1"], body[:500]
    assert all(w["experts_owned"] == 192 and w["up"] == 1 for w in c["workers"]), c["workers"]
    assert c["status"] == "ok" and c["coordinator"]["build"]["version"], c["coordinator"].get("build")


def page():
    if not cdp.find_chromium():
        raise promcheck.SkipCase("chromium not installed (Debian package chromium; scripts/deps.sh)")
    b = cdp.Browser()
    S["browser"] = b
    u = S["url"]
    # without the key: the shell loads and asks for it
    b.navigate(u + "/")
    b.wait("document.getElementById('keyform').style.display === 'block'", "the key form")
    assert "API key" in b.eval("document.getElementById('status').textContent")
    # with the key (in the fragment: never sent to the server); a new load,
    # not a fragment change of the same document
    b.navigate("about:blank")
    b.navigate(u + "/#key=" + KEY)
    b.wait("document.querySelectorAll('[data-worker]').length === 2", "both workers drawn")
    for w in ("w0", "w1"):
        t = b.eval(f"document.querySelector('[data-worker=\"{w}\"]').textContent")
        assert w in t and "experts 192" in t and "memory" in t and "up" in t, t
        assert b.eval(f"document.querySelector('[data-worker=\"{w}\"]').getAttribute('data-state')") == "up"
    # a request's tokens/s (over the last minute, from the counters' increase)
    complete(64)
    v = b.wait("(x => x !== '-' && parseFloat(x) > 0 ? x : null)(document.getElementById('tps').textContent)",
               "tokens/s after a request")
    assert float(v) > 0, v
    b.wait("document.getElementById('ttft').textContent.indexOf('- /') < 0", "TTFT shown")
    # the heat map: one cell per MoE layer (tiny-k3: 1..8) and worker, from the routing counters
    b.wait("document.querySelectorAll('#heat rect[data-heat]').length === 16", "16 heat cells")
    assert b.eval("Math.max(...[...document.querySelectorAll('#heat rect[data-heat]')]"
                  ".map(r => parseFloat(r.getAttribute('data-heat'))))") == 1.0
    # the chat box streams a completion through the API, with the key
    b.eval("document.getElementById('prompt').value = 'hello'; document.getElementById('send').click(); 1")
    b.wait("/^[1-9][0-9]* chunks/.test(document.getElementById('chatstat').textContent) && "
           "document.getElementById('chatlog').textContent.length > 0", "the chat box's streamed answer", timeout=60)
    # SIGSTOP w0, then a request that needs it: red within 2 s, taken over by w1
    w0 = S["workers"][0]
    os.kill(w0.pid, signal.SIGSTOP)
    S["stopped"] = w0
    t0 = time.monotonic()
    th = threading.Thread(target=complete, args=(8,), daemon=True)
    th.start()
    b.wait("document.querySelector('[data-worker=\"w0\"]').getAttribute('data-state') === 'down'",
           "w0 drawn down", timeout=10, poll=0.02)
    dt = time.monotonic() - t0
    assert dt <= 2.0, f"w0 turned red {dt:.2f} s after SIGSTOP"
    print(f"# w0 red {dt:.2f} s after SIGSTOP", flush=True)
    t = b.wait("(t => t.indexOf('taken over by w1') >= 0 ? t : null)"
               "(document.querySelector('[data-worker=\"w0\"]').textContent)", "taken over by w1")
    assert "taken over by w1" in t, t
    th.join(60)
    fill = b.eval("document.querySelector('[data-worker=\"w0\"] rect').getAttribute('fill')")
    assert fill == "#f8d4d4", fill  # the red of a node that is down
    assert b.eval("document.getElementById('status').textContent") == "degraded"
    b.wait("document.getElementById('events').textContent.indexOf('w0 down') >= 0", "the event on the timeline")
    shot = os.environ.get("SHOAL_WEBUI_SCREENSHOT") or os.path.join(TMP, "cluster.png")
    b.screenshot(shot)
    assert os.path.getsize(shot) > 10000, shot
    print(f"# screenshot {shot}", flush=True)


def top_web():
    if "browser" not in S:
        raise promcheck.SkipCase("no browser (see page)")
    p = subprocess.Popen([BIN, "top", "--coordinator", S["url"].replace("http://", ""), "--api-key", KEY,
                          "--web", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(p)
    line = p.stdout.readline()
    assert "cluster page on http://" in line, line
    u = line.split("cluster page on ")[1].split("/ for")[0]
    st, _, _ = get(u + "/v1/cluster")
    assert st == 401, st
    b = S["browser"]
    b.navigate("about:blank")
    b.navigate(u + "/#key=" + KEY)
    b.wait("document.querySelectorAll('[data-worker]').length === 2", "both workers via top --web")
    b.wait("document.querySelector('[data-worker=\"w0\"]').getAttribute('data-state') === 'down'", "w0 down")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 0
    # beyond this machine only behind the key
    r = subprocess.run([BIN, "top", "--coordinator", "127.0.0.1:1", "--web", "0", "--web-host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--api-key" in r.stderr, (r.returncode, r.stderr)


try:
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
    else:
        R.check("start", start)
        if "url" in S:
            R.check("endpoints_and_auth", endpoints)
            R.check("page_in_chromium", page)
            R.check("top_web", top_web)
finally:
    if "stopped" in S:
        S["stopped"].send_signal(signal.SIGCONT)
    if "browser" in S:
        S["browser"].close()
    for p in reversed(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
R.finish()
