#!/usr/bin/env python3
"""Local workers are supervised (issue 18): `shoal serve --workers 2` restarts
a local expert server that dies, with the same experts, and serves again.

Real processes and the official `openai` client:
- baseline: a greedy completion's token ids with both local workers up;
- SIGKILL one local worker (found among serve's children): it is reaped (no
  zombie child of serve is left), restarted with the same `--experts` and
  endpoint, /health is 200 again and the same request gives the same ids;
  `shoal_worker_restarts_total` is 1 for it; the log names the signal;
- the time from the kill to the first successful request, over 3 kills;
- the rate limit: killed again and again, after 5 restarts within 60 s the
  worker is left down: /health 503 names it, a request gets a 503
  worker_unavailable naming it at once (no hang), the log says so;
- serve exits cleanly and leaves no expert process behind.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_supervise"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


def children(pid):
    """{pid: (state, argv)} of the direct children of pid."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            rest = st[st.rindex(")") + 2:].split()
            if int(rest[1]) != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            out[int(d)] = (rest[0], [a.decode(errors="replace") for a in argv if a])
        except (OSError, ValueError):
            continue
    return out


def worker_pid(srv, wid):
    for pid, (state, argv) in children(srv.pid).items():
        if "expert" in argv and wid in argv and state != "Z":
            return pid, argv
    return None, None


health = harness.health


def restarts_metric(url, wid):
    return harness.worker_metric(url, "shoal_worker_restarts_total", wid)


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    try:
        import openai
    except ImportError:
        record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    log = harness.logfile()
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1",
                            "--workers", "2", "--worker-threads", "1", "--expert-timeout-ms", "1500", "--memo", "0"],
                           stdout=subprocess.PIPE, stderr=log, text=True)

    def logtext():
        log.seek(0)
        return log.read().decode(errors="replace")

    try:
        line = srv.stdout.readline()
        if "listening on" not in line:
            check("serve starts", False, f"{line!r} {logtext()[-2000:]!r}")
            return 1
        url = line.strip().split("listening on ")[1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete():
            r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            return (r.choices[0].model_extra or {}).get("token_ids")

        base = complete()
        check("baseline ids", isinstance(base, list) and len(base) == 6, repr(base))
        pid0, argv0 = worker_pid(srv, "w1")
        check("serve has local worker w1 as a child", pid0 is not None, repr(children(srv.pid)))
        if pid0 is None:
            return 1

        def kill_and_recover(case):
            """SIGKILL w1; seconds until a request succeeds again (None: not within 30 s), and its ids."""
            pid, _ = worker_pid(srv, "w1")
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while time.monotonic() - t0 < 30:
                try:
                    got = complete()
                    return time.monotonic() - t0, got, pid
                except openai.APIStatusError:
                    time.sleep(0.05)
            return None, None, pid

        dt, got, old = kill_and_recover("first kill")
        check("killed worker: requests succeed again within 30 s", dt is not None, logtext()[-1500:])
        check("killed worker: same ids as before", got == base, f"{got} vs {base}")
        pid1, argv1 = worker_pid(srv, "w1")
        check("restarted as a new process with the same arguments (experts, endpoint)",
              pid1 is not None and pid1 != old and argv1 == argv0, f"{old}->{pid1} {argv0} {argv1}")
        zombies = [p for p, (st, _) in children(srv.pid).items() if st == "Z"]
        check("no zombie child left", not zombies, repr(zombies))
        check("shoal_worker_restarts_total is 1 for w1, 0 for w0",
              restarts_metric(url, "w1") == 1.0 and restarts_metric(url, "w0") == 0.0,
              f"{restarts_metric(url, 'w1')} {restarts_metric(url, 'w0')}")
        check("the log names the exit and the restart", "exited (signal 9); restarted as pid" in logtext(),
              logtext()[-800:])
        times = [dt] if dt is not None else []
        for k in range(2):
            dt, got, _ = kill_and_recover(f"kill {k + 2}")
            check(f"kill {k + 2}: served again with the same ids", dt is not None and got == base, f"{dt} {got}")
            if dt is not None:
                times.append(dt)
        if times:
            print(f"figure: kill to first successful request: p50 {statistics.median(times):.2f} s, "
                  f"max {max(times):.2f} s over {len(times)} kills", flush=True)
        # the rate limit: 5 restarts within 60 s, then left down
        t0 = time.monotonic()
        while "left down" not in logtext() and time.monotonic() - t0 < 60:
            pid, _ = worker_pid(srv, "w1")
            if pid:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.3)
        check("over the rate limit: the log says it is left down", "restarted 5 times within 60 s, so it is left down"
              in logtext(), logtext()[-800:])
        t1 = time.monotonic()
        while time.monotonic() - t1 < 10:
            st, h = health(url)
            if st == 503:
                break
            time.sleep(0.1)
        down = [x for x in h["workers"] if not x["up"]]
        check("left down: /health 503 names it", st == 503 and len(down) == 1 and "w1" in json.dumps(down),
              f"{st} {h}")
        t2 = time.monotonic()
        try:
            complete()
            check("left down: a request gets a named 503", False, "served")
        except openai.APIStatusError as e:
            check("left down: a request gets a named 503 at once", e.status_code == 503 and
                  e.code == "worker_unavailable" and time.monotonic() - t2 < 5, f"{e.status_code} {e.message}")
        check("left down: no process for it, no zombie", worker_pid(srv, "w1")[0] is None and
              not [p for p, (s, _) in children(srv.pid).items() if s == "Z"], repr(children(srv.pid)))
        check("shoal_worker_restarts_total is 5 for w1", restarts_metric(url, "w1") == 5.0,
              repr(restarts_metric(url, "w1")))
    finally:
        kids = list(children(srv.pid))
        rc = harness.terminate(srv, 30)
    check("serve exits cleanly", rc == 0, f"exit code {rc}: {logtext()[-600:]}")
    left = [p for p in kids if os.path.exists(f"/proc/{p}") and "expert" in open(f"/proc/{p}/cmdline").read()]
    check("no expert process left after serve exits", not left, repr(left))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
