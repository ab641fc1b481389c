#!/usr/bin/env python3
"""A worker that fails and comes back, end to end with real processes
(issue 7: /health marks a worker up again after a failure).

`shoal serve` on tests/models/tiny-k3 with two expert servers started here
(`shoal expert ... --listen ipc://...`, so the test can stop, kill and restart
them on the same endpoint), driven with the official `openai` client:

- baseline: both workers up on /health, a greedy completion's token ids;
- SIGSTOP one worker: the next request fails within the deadline with 503
  worker_unavailable naming it; /health is 503 and lists it down (the others
  up); the request after that fails at once (fail fast), naming it;
- SIGCONT: /health is 200 again by itself (the coordinator re-sent HELLO and
  re-verified it), shoal_worker_up is 1, and the same request gives the same
  ids as the baseline;
- SIGKILL the worker: /health lists it down without any request (disconnect
  seen), a request fails naming it; restarted on the same endpoint with other
  experts it is refused (stays down, /health says why); restarted as before,
  /health is 200 again and the same request gives the same ids.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_dist_recovery"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
TIMEOUT_MS = 1500


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


procs = []


def start_worker(ranges, ep, wid):
    log = harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", ranges, "--listen", ep, "--threads", "1",
                          "--id", wid], stdout=subprocess.DEVNULL, stderr=log)
    p.log = log
    procs.append(p)
    return p


health = harness.health


def wait_health(url, code, secs):
    t0 = time.time()
    while True:
        st, body = health(url)
        if st == code or time.time() - t0 > secs:
            return st, body, time.time() - t0
        time.sleep(0.05)


def worker_up_metric(url, wid):
    return harness.worker_metric(url, "shoal_worker_up", wid)


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
    eps = [f"ipc://@shoal-recovery-{tag}-{i}" for i in range(2)]
    ranges = ["1-8:0-11", "1-8:12-23"]
    ids = ["rw0", "rw1"]
    w = [start_worker(ranges[i], eps[i], ids[i]) for i in range(2)]
    log = harness.logfile()
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1",
                            "--worker", eps[0], "--worker", eps[1], "--expert-timeout-ms", str(TIMEOUT_MS),
                            "--memo", "0"], stdout=subprocess.PIPE, stderr=log, text=True)
    procs.append(srv)
    try:
        line = srv.stdout.readline()
        if "listening on" not in line:
            log.seek(0)
            check("serve starts", False, f"{line!r} {log.read()[-2000:]!r}")
            return 1
        url = line.strip().split("listening on ")[1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete():
            r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            return (r.choices[0].model_extra or {}).get("token_ids")

        def refused(case, max_s):
            t0 = time.time()
            try:
                complete()
                check(case, False, "served with a worker down")
                return
            except openai.APIStatusError as e:
                dt = time.time() - t0
                check(case, e.status_code == 503 and e.code == "worker_unavailable" and ids[1] in e.message
                      and dt < max_s, f"{e.status_code} {e.code} after {dt:.2f} s (< {max_s}): {e.message}")
                return e.message

        st, h, _ = wait_health(url, 200, 30)
        check("both workers up at start", st == 200 and all(x["up"] for x in h["workers"]), f"{st} {h}")
        base = complete()
        check("baseline ids", isinstance(base, list) and len(base) == 6, repr(base))

        # ---- SIGSTOP: deadline error, down on /health, fail fast, back on SIGCONT
        os.kill(w[1].pid, signal.SIGSTOP)
        refused("stopped worker: request fails within the deadline naming it", TIMEOUT_MS / 1000 + 3)
        st, h = health(url)
        down = [x for x in h["workers"] if not x["up"]]
        check("stopped worker: /health 503 lists it down", st == 503 and len(down) == 1 and ids[1] in
              down[0]["endpoint"] and h["workers"][0]["up"], f"{st} {h}")
        msg = refused("stopped worker: next request fails at once", 1.0)
        check("stopped worker: the fast error says it is down", msg is not None and "is down" in msg, repr(msg))
        check("stopped worker: shoal_worker_up 0", worker_up_metric(url, ids[1]) == 0.0,
              repr(worker_up_metric(url, ids[1])))
        os.kill(w[1].pid, signal.SIGCONT)
        st, h, dt = wait_health(url, 200, 20)
        check("continued worker: /health 200 again", st == 200 and all(x["up"] for x in h["workers"]),
              f"{st} after {dt:.1f} s: {h}")
        check("continued worker: shoal_worker_up 1", worker_up_metric(url, ids[1]) == 1.0,
              repr(worker_up_metric(url, ids[1])))
        got = complete()
        check("continued worker: same ids as before", got == base, f"{got} vs {base}")

        # ---- SIGKILL: down without a request; refused with other experts; back when restarted as before
        w[1].kill()
        w[1].wait()
        st, h, dt = wait_health(url, 503, 5)
        down = [x for x in h["workers"] if not x["up"]]
        check("killed worker: /health lists it down without a request", st == 503 and len(down) == 1 and
              ids[1] in down[0]["endpoint"], f"{st} after {dt:.1f} s: {h}")
        refused("killed worker: request fails at once naming it", 1.0)
        w[1] = start_worker("1-4:12-23", eps[1], ids[1])
        # polled until the re-HELLO was refused (a fixed 1.5 s hoped it had been)
        deadline = time.time() + 30
        while True:
            st, h = health(url)
            down = [x for x in h["workers"] if not x["up"]]
            if (down and "refused on reconnection" in down[0]["state"]) or time.time() > deadline:
                break
            time.sleep(0.1)
        check("restarted with other experts: refused, still down",
              st == 503 and len(down) == 1 and "refused on reconnection" in down[0]["state"], f"{st} {h}")
        w[1].terminate()
        w[1].wait()
        w[1] = start_worker(ranges[1], eps[1], ids[1])
        st, h, dt = wait_health(url, 200, 20)
        check("restarted worker: /health 200 again", st == 200 and all(x["up"] for x in h["workers"]),
              f"{st} after {dt:.1f} s: {h}")
        got = complete()
        check("restarted worker: same ids as before", got == base, f"{got} vs {base}")
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
                    p.wait(20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    p.kill()
    rc = srv.returncode
    check("serve exits cleanly", rc == 0, f"exit code {rc}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
