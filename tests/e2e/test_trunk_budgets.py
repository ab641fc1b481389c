#!/usr/bin/env python3
"""Coordinator trunk budget, end to end (issue 11): `shoal run --trunk-gb`
generates token ids byte-identical to the mapped trunk at budgets from the
minimum (two streaming buffers of the largest layer) to fully resident, with
O_DIRECT and buffered reads, with in-process experts and against `shoal
expert` workers on their smallest caches; the memory plan is printed; a
budget below the minimum is refused with exit 3 naming the minimum in bytes;
`auto` reads a cgroup v1 memory cap (refused under a cap too small, identical
ids under a cap that fits); `shoal serve --trunk-gb small` answers like the
mapped server; peak RSS is in the --json output.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS."""
import json
import re
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk_budgets"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
PROMPTS = ["1,2,3,4,5,6,7,8,9,10,11", "300,17,4000,9"]


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


def run(*args, prefix=()):
    r = subprocess.run([*prefix, BIN, "run", "--model", TINY, "--json", "--threads", "1", "--gen", "10", *args],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr, r.returncode
    except (ValueError, IndexError):
        return None, r.stderr, r.returncode


def gb(nbytes):
    """a --trunk-gb value that parses back to at least nbytes (and less than nbytes + 1)"""
    return "%.15f" % ((nbytes + 0.5) / 2**30)


def config():
    c = json.load(open(os.path.join(TINY, "config.json")))
    return c.get("text_config", c)


def start_worker(ranges, *extra):
    ep = f"ipc://@shoal-trunk-{tag}-{random.randrange(1 << 30):x}"
    log = harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", ranges, "--listen", ep, "--threads", "1",
                          *extra], stdout=subprocess.DEVNULL, stderr=log)
    p.log, p.ep = log, ep
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15 and p.poll() is None:
        log.seek(0)
        if b"serving " in log.read():
            return p
        time.sleep(0.05)
    return p


def stop(p):
    harness.terminate(p)
    if hasattr(p, "log"):
        p.log.seek(0)
        return p.log.read().decode(errors="replace")
    return ""


def serve_ids(*extra):
    """start shoal serve, one greedy completion of token ids, stop it"""
    log = harness.logfile()
    p = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1", "--max-context", "64",
                          *extra], stdout=subprocess.PIPE, stderr=log, text=True)
    p.log = log
    try:
        line = p.stdout.readline()
        if "listening on" not in line:
            return None, stop(p)
        url = line.strip().split("listening on ")[1]
        body = json.dumps({"model": "tiny-k3", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6, "temperature": 0,
                           "logprobs": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            prom = r.read().decode()
        serve_ids.metrics = {k: float(v) for k, v in re.findall(r"^(shoal_trunk_[a-z_]+) (\S+)$", prom, re.M)}
        return out["choices"][0]["text"], stop(p)
    except Exception as e:  # noqa: BLE001 (reported as a failure below)
        return None, f"{e}: " + stop(p)


def main():
    if not os.path.exists(os.path.join(TINY, "config.json")) or not os.access(BIN, os.X_OK):
        record("SKIP", "all", "tiny model or shoal binary missing")
        return 77
    ref = {p: run("--ids", p)[0] for p in PROMPTS}
    if not check("reference_runs", all(ref.values()), "mapped run failed"):
        return 1
    ref = {p: o["generated_ids"] for p, o in ref.items()}

    o, err, rc = run("--ids", PROMPTS[0], "--trunk-gb", "small")
    if not check("small_runs", o is not None and "trunk" in o, f"rc {rc}: {err[-600:]}"):
        return 1
    tmin, tfull = o["trunk"]["min_bytes"], o["trunk"]["full_bytes"]
    check("plan_printed", "trunk plan: budget" in err and f"minimum {tmin} bytes" in err and
          "peak resident memory" in err, err[-600:])
    check("peak_rss_json", o.get("peak_rss_bytes", 0) > 0 and o.get("peak_vmhwm_bytes", 0) > 0, str(o)[-300:])

    # below the minimum: refused (exit 3) naming the minimum in bytes
    o2, err2, rc2 = run("--ids", PROMPTS[0], "--trunk-gb", gb(tmin - 1))
    check("below_minimum_refused", rc2 == 3 and f"at least {tmin} bytes" in err2, f"rc {rc2}: {err2[-400:]}")

    # budgets from the minimum to fully resident; streamed bytes fall as the budget grows
    rungs = [("small", "small"), ("min", gb(tmin)), ("q1", gb(tmin + (tfull - tmin) // 4)),
             ("medium", "medium"), ("q3", gb(tmin + 3 * (tfull - tmin) // 4)), ("full_minus", gb(tfull - 4096)),
             ("large", "large"), ("gb_above_full", gb(tfull * 2))]
    prev = None
    for name, val in rungs:
        for pr in PROMPTS:
            o, err, rc = run("--ids", pr, "--trunk-gb", val)
            ok = check(f"ids_{name}_{pr.split(',')[0]}", o is not None and o["generated_ids"] == ref[pr],
                       f"rc {rc}: {(o or {}).get('generated_ids')} != {ref[pr]}: {err[-400:]}")
            if ok and pr == PROMPTS[0]:
                t = o["trunk"]
                within = t["resident_bytes"] + t["buffer_bytes"] <= t["budget_bytes"]
                mono = prev is None or t["streamed_bytes_per_forward"] <= prev
                check(f"plan_{name}", within and mono, json.dumps(t))
                prev = t["streamed_bytes_per_forward"]
                if name in ("large", "gb_above_full"):
                    check(f"nothing_streamed_{name}", t["streamed_bytes_per_forward"] == 0 and t["buffer_bytes"] == 0,
                          json.dumps(t))
                if name == "small":
                    # every streamed unit once per token, give or take the reader's
                    # prefetch across the prefill/decode boundary (at most both buffers)
                    check("small_reads_per_token", abs(t["decode_read_bytes_per_token"] -
                                                       t["streamed_bytes_per_forward"]) <= t["buffer_bytes"],
                          json.dumps(t))

    o, err, rc = run("--ids", PROMPTS[1], "--trunk-gb", "small", "--trunk-no-direct")
    check("ids_small_buffered", o is not None and o["generated_ids"] == ref[PROMPTS[1]] and
          o["trunk"]["direct"] is False, f"rc {rc}: {err[-400:]}")
    o, err, rc = run("--ids", PROMPTS[0], "--trunk-gb", "small", "--batch", "3")
    check("ids_small_prefill_chunks", o is not None and o["generated_ids"] == ref[PROMPTS[0]],
          f"rc {rc}: {err[-400:]}")

    # with expert workers on their smallest caches
    c = config()
    L, E, k = c["num_hidden_layers"], c["num_experts"], c["num_experts_per_token"]
    moe = [l for l in range(L) if l >= c["first_k_dense_replace"] and l % c["moe_layer_freq"] == 0]
    allr = f"{moe[0]}-{moe[-1]}:0-{E - 1}"
    for slots in (k, k + 3):
        w = start_worker(allr, "--cache-slots", str(slots))
        if w.poll() is not None:
            check(f"worker_cache_{slots}_start", False, stop(w)[-400:])
            continue
        # the prefetch hints need each next MoE layer's router: pinned resident under
        # any budget, so the hints are those of the mapped trunk
        hm, _, _ = run("--ids", PROMPTS[0], "--worker", w.ep)
        for tb in ("small", "medium"):
            for pr in PROMPTS:
                o, err, rc = run("--ids", pr, "--worker", w.ep, "--trunk-gb", tb)
                check(f"ids_worker_cache{slots}_trunk_{tb}_{pr.split(',')[0]}",
                      o is not None and o["generated_ids"] == ref[pr], f"rc {rc}: {err[-400:]}")
                if pr == PROMPTS[0] and o is not None and hm is not None:
                    check(f"hints_worker_cache{slots}_trunk_{tb}", "prefetch_hints" in o and
                          o["prefetch_hints"] == hm.get("prefetch_hints"),
                          f"{o.get('prefetch_hints')} vs mapped {hm.get('prefetch_hints')}")
        stop(w)

    # auto under a cgroup v1 memory cap (where this machine lets us make one)
    cg = f"/sys/fs/cgroup/memory/shoal-test-trunk-{tag}"
    try:
        os.mkdir(cg)
    except OSError as e:
        record("SKIP", "auto_cgroup", f"cannot create a memory cgroup: {e}")
        cg = None
    if cg:
        try:
            pre = ("sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"')
            for cap, ok in ((64 << 20, False), (512 << 20, True)):
                with open(f"{cg}/memory.limit_in_bytes", "w") as f:
                    f.write(str(cap))
                o, err, rc = run("--ids", PROMPTS[0], "--trunk-gb", "auto", prefix=pre)
                if ok:
                    check(f"auto_cap_{cap >> 20}m", o is not None and o["generated_ids"] == ref[PROMPTS[0]] and
                          f"cgroup v1 limit {cap >> 20}.0 MiB" in err, f"rc {rc}: {err[-600:]}")
                else:
                    check(f"auto_cap_{cap >> 20}m_refused", rc == 3 and "--trunk-gb auto" in err and
                          f"at least {tmin} bytes" in err, f"rc {rc}: {err[-600:]}")
        finally:
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except OSError:
                    time.sleep(0.1)

    # shoal serve: the same completion with and without a budget
    serve_ids.metrics = {}
    a, la = serve_ids()
    ma = serve_ids.metrics
    serve_ids.metrics = {}
    b, lb = serve_ids("--trunk-gb", "small")
    mb = serve_ids.metrics
    check("serve_small_same_text", a is not None and a == b and "trunk plan: budget" in lb and
          "peak resident memory" in lb, f"{a!r} vs {b!r}: {lb[-600:]}")
    # /metrics: nothing streamed when mapped; under the minimum budget the
    # budget is the plan's minimum and the reader streamed the non-resident units
    check("serve_metrics_mapped", ma.get("shoal_trunk_budget_bytes") == 0 and
          ma.get("shoal_trunk_read_bytes_total") == 0, repr(ma))
    check("serve_metrics_small", mb.get("shoal_trunk_budget_bytes") == tmin and
          0 < mb.get("shoal_trunk_resident_bytes", -1) < tmin and
          mb.get("shoal_trunk_read_bytes_total", 0) > 0 and mb.get("shoal_trunk_stall_seconds_total", -1) >= 0,
          f"{mb!r}, minimum {tmin}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
