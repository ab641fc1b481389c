#!/usr/bin/env python3
"""`shoal serve --trunk remote` (issue 16, milestone 2), real processes over
ipc://, driven with the official `openai` client:

- the same completion (token ids and text) and the same chat answer from
  `serve` with the whole model in-process and from `serve --trunk remote` with
  routed experts on one worker and the trunk rows split over two trunk servers
  (thirds 0 / 1+2); the remote server must really be remote (its log says how
  many matrices are on the workers);
- reconnection: a trunk server SIGKILLed and restarted on its endpoint owning
  other trunk rows is refused (it stays down; /health names it and says it now
  owns other trunk rows; a request fails with 503 naming it); restarted with
  its rows as before, /health is 200 again and the same ids come back.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS. Time: ~10 s.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk_serve"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
TIMEOUT_MS = 1500
R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
procs = []


def start_worker(ep, wid, experts=None, trunk=None):
    log = harness.logfile()
    args = [BIN, "expert", "--model", TINY, "--listen", ep, "--threads", "1", "--id", wid]
    if experts:
        args += ["--experts", experts]
    if trunk:
        args += ["--trunk", trunk]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
    p.log = log
    procs.append(p)
    return p


def start_serve(extra):
    log = harness.logfile()
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1",
                            "--memo", "0", "--expert-timeout-ms", str(TIMEOUT_MS), "--hello-timeout-ms", "10000"]
                           + extra, stdout=subprocess.PIPE, stderr=log, text=True)
    srv.log = log
    procs.append(srv)
    line = srv.stdout.readline()
    if "listening on" not in line:
        log.seek(0)
        return srv, None, f"{line!r} {log.read()[-2000:]!r}"
    return srv, line.strip().split("listening on ")[1], ""


health = harness.health


def wait_health(url, code, secs, pred=lambda h: True):
    t0 = time.time()
    while True:
        st, body = health(url)
        if (st == code and pred(body)) or time.time() - t0 > secs:
            return st, body, time.time() - t0
        time.sleep(0.05)


def answers(openai, url):
    """(completion ids, completion text, chat text) for fixed greedy requests."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt=[5, 17, 3, 99, 42, 7], max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=8, temperature=0)
    return (r.choices[0].model_extra or {}).get("token_ids"), r.choices[0].text, c.choices[0].message.content


def log_text(p):
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    if not os.path.exists(os.path.join(TINY, "config.json")):
        record("SKIP", "all", "tests/models/tiny-k3 not present")
        return 77
    try:
        import openai
    except ImportError:
        record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
    eps = [f"ipc://@shoal-tserve-{tag}-{i}" for i in range(3)]
    trunk = [None, "*:0/3", "*:1/3,*:2/3"]
    ids = ["tx0", "tt1", "tt2"]
    try:
        srv, url, why = start_serve([])
        if not check("in-process serve starts", url is not None, why):
            return 1
        ref = answers(openai, url)
        check("in-process: 8 ids and text", isinstance(ref[0], list) and len(ref[0]) == 8 and ref[1], repr(ref))
        harness.terminate(srv, 10)

        w = [start_worker(eps[0], ids[0], experts="1-8:0-23")] + \
            [start_worker(eps[i], ids[i], trunk=trunk[i]) for i in (1, 2)]
        args = ["--trunk", "remote"]
        for e in eps:
            args += ["--worker", e]
        srv, url, why = start_serve(args)
        if not check("serve --trunk remote starts", url is not None, why):
            return 1
        st, h, _ = wait_health(url, 200, 20)
        check("remote: every worker up", st == 200 and all(x["up"] for x in h["workers"]), f"{st} {h}")
        got = answers(openai, url)
        log = log_text(srv)
        check("remote: really remote (matrices on the workers)", "matrices on the workers (--trunk remote)" in log,
              log[-600:])
        check("remote: same completion ids as in-process", got[0] == ref[0], f"{got[0]} vs {ref[0]}")
        check("remote: same completion text", got[1] == ref[1], f"{got[1]!r} vs {ref[1]!r}")
        check("remote: same chat answer", got[2] == ref[2], f"{got[2]!r} vs {ref[2]!r}")
        # /metrics: per worker trunk requests, bytes and the time split (docs/METRICS.md)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()

        def metric(name, wid):
            for l in text.splitlines():
                if l.startswith(name + "{") and f'worker="{wid}"' in l:
                    return float(l.rsplit(" ", 1)[1])
            return None
        tr = {w: metric("shoal_worker_trunk_requests_total", w) for w in ids}
        check("metrics: trunk requests on the trunk servers only", tr["tx0"] == 0 and tr["tt1"] > 0 and
              tr["tt1"] == tr["tt2"], str(tr))
        parts = {p: metric(f"shoal_worker_trunk_{p}_seconds_total", "tt2") for p in ("network", "queue", "compute")}
        wb = metric("shoal_worker_trunk_weight_bytes_total", "tt2")
        sent = metric("shoal_worker_trunk_sent_bytes_total", "tt2")
        check("metrics: trunk compute, network time, weight and wire bytes counted",
              parts["compute"] and parts["compute"] > 0 and parts["network"] is not None and parts["network"] >= 0
              and parts["queue"] is not None and wb and wb > 0 and sent and sent > 0, f"{parts} {wb} {sent}")

        # ---- a trunk server comes back owning other rows: refused, named; as before: back
        w[2].kill()
        w[2].wait()
        st, h, dt = wait_health(url, 503, 5)
        check("killed trunk server: /health 503", st == 503, f"{st} after {dt:.1f} s: {h}")
        w[2] = start_worker(eps[2], ids[2], trunk="*:1/2")
        st, h, dt = wait_health(url, 503, 5, lambda b: any("trunk rows" in x.get("state", "")
                                                            for x in b["workers"] if not x["up"]))
        down = [x for x in h["workers"] if not x["up"]]
        check("restarted with other trunk rows: refused, named, still down",
              st == 503 and len(down) == 1 and ids[2] in down[0]["endpoint"] + down[0].get("name", "")
              and "refused on reconnection: it now owns trunk rows" in down[0]["state"]
              and "1/2" not in down[0]["state"], f"{st} after {dt:.1f} s: {h}")
        try:
            answers(openai, url)
            check("restarted with other trunk rows: a request is refused", False, "served")
        except openai.APIStatusError as e:
            check("restarted with other trunk rows: a request is refused", e.status_code == 503 and
                  ids[2] in e.message, f"{e.status_code} {e.message}")
        w[2].terminate()
        w[2].wait()
        w[2] = start_worker(eps[2], ids[2], trunk=trunk[2])
        st, h, dt = wait_health(url, 200, 20)
        check("restarted with its rows: /health 200 again", st == 200 and all(x["up"] for x in h["workers"]),
              f"{st} after {dt:.1f} s: {h}")
        got = answers(openai, url)
        check("restarted with its rows: same answers", got == ref, f"{got} vs {ref}")
    finally:
        for p in procs:
            harness.terminate(p, 5)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
