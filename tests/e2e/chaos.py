"""The fault driver and helpers shared by the chaos tests (test_chaos: replicated
experts; test_chaos_trunk: replicated experts and trunk rows).

run() keeps completing prompts through the openai client while a driver thread
takes workers down at random moments (SIGKILL, restarted once the coordinator
has seen it go; or SIGSTOP, then SIGCONT), one at a time or two at once, only
ever leaving down a set of workers whose loss the plan covers (covers()), and
brings each back after 0.2-1.5 s. Every error of a completion counts as a lost
request. The driver's random choices come from the caller's rng (the tests'
SHOAL_CHAOS_SEED)."""
import os
import signal
import subprocess
import threading
import time
import urllib.request

import harness


def parse_ranges(s):
    """a LAYERS:EXPERTS list (`1-8:0-11,3:5`) as a set of (layer, expert)"""
    out = set()
    for g in s.split(","):
        ls, es = g.split(":")
        la, lb = ls.split("-") if "-" in ls else (ls, ls)
        ea, eb = es.split("-") if "-" in es else (es, es)
        out |= {(l, e) for l in range(int(la), int(lb) + 1) for e in range(int(ea), int(eb) + 1)}
    return out


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(text, family):
    """the sum of a family's samples over all label sets"""
    s = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            s += float(line.rsplit(" ", 1)[1])
    return s


def covers(need, held, up):
    """do the workers in up hold everything in need between them?"""
    got = set()
    for i in up:
        got |= held[i]
    return need <= got


def up_in_health(url):
    """the worker indexes /health lists up (nothing, while the server is busy)"""
    try:
        st, h = harness.health(url)
        return {i for i, x in enumerate(h["workers"]) if x["up"]}
    except Exception:  # noqa: BLE001 -- a busy server: nothing known up
        return set()


def run(wk, url, need, held, pairs, rng, complete, prompts, n, chaos_s, stop, first=()):
    """At least n completions (prompts cycled) and chaos_s seconds under faults.
    wk: the workers (.p[i] the process, .start(i) restarts i with the same
    part); need/held: what the plan must keep covered and what each worker
    holds; pairs: the pairs of workers the plan allows down at once (none:
    one at a time); first: the kinds of the first faults ("stop", "kill"),
    then at random. Returns (ev, got, failed, lat, total, seconds): the fault
    counts, each completion's ids (None when it failed), the failures (index,
    error), each completion's latency."""
    import openai
    ev = {"kill": 0, "stop": 0, "two": 0, "max_down": 0}
    faulted = set()
    lock = threading.Lock()
    W = len(held)

    def heal(i, how):
        if how == "kill":
            # restarted once the coordinator has seen it go (else /health
            # could still list the old process up, and the driver could take
            # its replica down too: a double fault R = 1 does not cover)
            t_end = time.time() + 5
            while time.time() < t_end and i in up_in_health(url):
                time.sleep(0.02)
            wk.start(i)
        else:
            try:
                os.kill(wk.p[i].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        with lock:
            faulted.discard(i)

    def driver():
        timers = []
        while not stop.is_set():
            time.sleep(rng.uniform(0.1, 0.6))
            if stop.is_set():
                break
            avail = up_in_health(url) - faulted
            # two at once: whenever all are up until it has happened once, then at random
            two = pairs and (len(avail) == W and (ev["two"] == 0 or rng.random() < 0.5) or rng.random() < 0.1)
            if two:
                cand = [p for p in pairs if p[0] in avail and p[1] in avail and covers(need, held, avail - set(p))]
                victims = list(rng.choice(cand)) if cand else []
            else:
                cand = [i for i in avail if covers(need, held, avail - {i})]
                victims = [rng.choice(cand)] if cand else []
            if not victims:
                continue
            for i in victims:
                nf = ev["kill"] + ev["stop"]
                how = first[nf] if nf < len(first) else rng.choice(["kill", "stop"])
                with lock:
                    faulted.add(i)
                if how == "kill":
                    wk.p[i].kill()
                    wk.p[i].wait()
                else:
                    os.kill(wk.p[i].pid, signal.SIGSTOP)
                ev[how] += 1
                t = threading.Timer(rng.uniform(0.2, 1.5), heal, (i, how))
                t.start()
                timers.append(t)
            ev["two"] += len(victims) == 2
            with lock:
                ev["max_down"] = max(ev["max_down"], len(faulted))
        for t in timers:
            t.join()

    th = threading.Thread(target=driver, daemon=True)
    th.start()
    got, failed, lat = [], [], []
    t0 = time.time()
    i = 0
    while i < n or time.time() - t0 < chaos_s:
        t1 = time.time()
        try:
            got.append(complete(prompts[i % n]))
        except openai.APIError as e:  # every error counts: a lost request
            got.append(None)
            failed.append((i, repr(e)[:300]))
        lat.append(time.time() - t1)
        i += 1
    seconds = time.time() - t0
    stop.set()
    th.join(30)
    return ev, got, failed, lat, i, seconds


def reap(procs):
    """end every process still running (a stopped one is continued first)"""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                p.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                p.kill()
