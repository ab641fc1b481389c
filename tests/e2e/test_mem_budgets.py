#!/usr/bin/env python3
"""Memory as a dial, end to end (issue 11): `shoal run --worker` against real
`shoal expert` processes serving from a RAM-budgeted expert cache
(--cache-slots / --cache-gb) gives token ids byte-identical to the in-process
run at every budget from the minimum (one token's experts) to fully resident,
with both policies, O_DIRECT and buffered reads, one or two workers; a budget
below the minimum is refused at start naming the minimum; the worker's
closing counters are consistent (fully resident: each expert read at most
once; the minimum: misses on every layer). Prefetch hints (PROTOCOL.md
PREFETCH): at every budget the ids are the same with `--prefetch on` and
`--prefetch off`, hinted reads happen and are used below full residency, and
a worker started with --no-prefetch is sent no hint.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS."""
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_mem_budgets"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
nep = 0


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


def ep():
    global nep
    nep += 1
    return f"ipc://@shoal-mem-{tag}-{nep}"


def config():
    c = json.load(open(os.path.join(TINY, "config.json")))
    return c.get("text_config", c)


PROMPTS = ["1,2,3,4,5,6,7,8,9,10,11", "300,17,4000,9"]


def run(*args):
    r = subprocess.run([BIN, "run", "--model", TINY, "--json", "--threads", "1", "--gen", "10", *args],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["generated_ids"], r.stderr
    except (ValueError, IndexError, KeyError):
        return None, r.stderr


def start(ranges, *extra):
    e = ep()
    log = harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", ranges, "--listen", e, "--threads", "1",
                          *extra], stdout=subprocess.DEVNULL, stderr=log)
    p.log, p.ep = log, e
    return p


def stop(p):
    harness.terminate(p)
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def wait_listening(p, timeout=10):
    """The worker logs 'serving' once bound (or exits on a refusal)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.poll() is not None:
            return False
        p.log.seek(0)
        if b"serving " in p.log.read():
            return True
        time.sleep(0.05)
    return False


def counters(log):
    m = re.search(r"expert cache: (\d+) hits, (\d+) misses .*?([\d.]+) MiB read", log)
    return (int(m.group(1)), int(m.group(2)), float(m.group(3))) if m else None


def pf_counters(log):
    """(hints, experts read ahead, prefetch hits, wasted) from the closing summary."""
    m = re.search(r"expert cache prefetch.*?: (\d+) hints \(\d+ dropped\); (\d+) experts read ahead .*?, (\d+) "
                  r"prefetch hits, (\d+) wasted", log)
    return tuple(int(m.group(i)) for i in range(1, 5)) if m else None


def main():
    if not os.path.exists(os.path.join(TINY, "config.json")) or not os.access(BIN, os.X_OK):
        record("SKIP", "all", "tiny model or shoal binary missing")
        return 77
    c = config()
    L, E, k = c["num_hidden_layers"], c["num_experts"], c["num_experts_per_token"]
    first = c["first_k_dense_replace"]
    moe_layers = [l for l in range(L) if l >= first and l % c["moe_layer_freq"] == 0]
    owned = len(moe_layers) * E
    allr = f"{moe_layers[0]}-{moe_layers[-1]}:0-{E - 1}"
    ref = {p: run("--ids", p)[0] for p in PROMPTS}
    if not check("reference_runs", all(ref.values()), "in-process run failed"):
        return 1

    # the minimum: one token's experts (k slots); below it refused at start
    p = start(allr, "--cache-slots", str(k - 1))
    rc = p.wait(20) if True else None
    log = stop(p)
    check("below_minimum_refused", rc == 3 and "minimum is %d slots" % k in log, f"rc {rc}: {log[-400:]}")
    m = re.search(r"hold \d+ slots of (\d+) bytes", log)
    slot_bytes = int(m.group(1)) if m else None
    if slot_bytes:  # the same refusal through --cache-gb, just under the minimum
        gb = (k * slot_bytes - 1) / 2**30
        p = start(allr, "--cache-gb", "%.12f" % gb)
        rc = p.wait(20)
        log = stop(p)
        check("below_minimum_refused_gb", rc == 3 and f"{k * slot_bytes} bytes" in log, f"rc {rc}: {log[-400:]}")

    # six budgets from the minimum to fully resident (slots; the last two via --cache-gb)
    rungs = [("slots", k), ("slots", k + 2), ("slots", 2 * k + 1), ("slots", owned // 4), ("slots", owned // 2),
             ("gb", owned), ("bank", None)]
    for pol in ("lfu", "lru"):
        for kind, n in rungs:
            if kind == "bank" and pol == "lru":
                continue
            extra = []
            if kind == "slots":
                extra = ["--cache-slots", str(n), "--cache-policy", pol]
            elif kind == "gb":
                extra = ["--cache-gb", "%.9f" % (n * (slot_bytes or 16384) / 2**30 + 1e-6), "--cache-policy", pol]
            name = f"{pol}_{kind}_{n}" if kind != "bank" else "mapped_bank"
            port = None
            if kind == "slots" and n == k + 2:  # the counters on /metrics too
                so = socket.socket()
                so.bind(("127.0.0.1", 0))
                port = so.getsockname()[1]
                so.close()
                extra += ["--metrics-port", str(port)]
            w = start(allr, *extra)
            if not wait_listening(w):
                check(f"ids_{name}", False, "worker did not start: " + stop(w)[-400:])
                continue
            ok = True
            for pr in PROMPTS:
                for pf in ("on", "off"):
                    ids, err = run("--ids", pr, "--worker", w.ep, "--prefetch", pf)
                    ok &= check(f"ids_{name}_{pr.split(',')[0]}_prefetch_{pf}", ids == ref[pr],
                                f"{ids} != {ref[pr]}: {err[-300:]}")
            prom = None
            if port:
                try:
                    prom = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                except OSError as e:
                    prom = str(e)
            log = stop(w)
            cn = counters(log)
            if port and cn:
                def metric(nm):
                    m = re.search(r"^%s\{[^}]*\} (\S+)$" % nm, prom, re.M)
                    return float(m.group(1)) if m else None
                pc = pf_counters(log)
                check(f"metrics_{name}", metric("shoal_expert_server_cache_hits_total") == cn[0] and
                      metric("shoal_expert_server_cache_misses_total") == cn[1] and
                      metric("shoal_expert_server_cache_slots") == n and
                      (metric("shoal_expert_server_disk_read_bytes_total") or 0) > 0 and pc is not None and
                      metric("shoal_expert_server_prefetch_reads_total") == pc[1] and
                      metric("shoal_expert_server_prefetch_hits_total") == pc[2] and
                      metric("shoal_expert_server_prefetch_wasted_total") == pc[3] and
                      (metric("shoal_expert_server_prefetch_read_bytes_total") or 0) > 0, f"{cn} {pc} vs {prom[-2500:]}")
            if kind == "bank":
                continue
            if not check(f"counters_{name}", cn is not None, log[-400:]):
                continue
            hits, misses, mib = cn
            pc = pf_counters(log)
            if not check(f"prefetch_counters_{name}", pc is not None and pc[0] > 0, log[-400:]):
                continue
            hints, pf_reads, pf_hits, wasted = pc
            if kind == "gb":  # fully resident: nothing read twice, on demand or ahead
                check(f"counters_{name}_each_once", misses + pf_reads <= owned and hits > 0 and wasted == 0,
                      f"{hits} hits {misses} misses {pc}")
            else:  # hints were acted on, and some of them were used before eviction
                check(f"prefetch_used_{name}", pf_reads > 0 and 0 < pf_hits <= pf_reads and
                      pf_hits + wasted <= pf_reads, f"{pc}")
            if n == k:  # every layer's experts came from disk, on demand or ahead
                check(f"counters_{name}_misses", misses + pf_reads >= len(moe_layers) * k and mib > 0, f"{cn} {pc}")

    # presets: small and medium serve the same ids; the plan is printed first
    for pr in ("small", "medium"):
        w = start(allr, "--cache-gb", pr)
        if not wait_listening(w):
            check(f"preset_{pr}", False, stop(w)[-400:])
            continue
        ids, err = run("--ids", PROMPTS[0], "--worker", w.ep)
        log = stop(w)
        want = k if pr == "small" else max(k, owned // 4)
        check(f"preset_{pr}", ids == ref[PROMPTS[0]] and f"preset {pr} -> {want} slots" in log and
              log.index("memory plan:") < log.index("expert cache:") and "peak resident memory" in log,
              f"{ids}: {log[-600:]}")

    # auto under a cgroup v1 memory cap (where this machine lets us make one)
    cg = f"/sys/fs/cgroup/memory/shoal-test-mem-{tag}"
    try:
        os.mkdir(cg)
    except OSError as e:
        record("SKIP", "preset_auto_cgroup", f"cannot create a memory cgroup: {e}")
        cg = None
    if cg:
        try:
            for cap, ok in ((64 << 20, False), (512 << 20, True)):
                with open(f"{cg}/memory.limit_in_bytes", "w") as f:
                    f.write(str(cap))
                e = ep()
                log = harness.logfile()
                p = subprocess.Popen(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', BIN, "expert",
                                      "--model", TINY, "--experts", allr, "--listen", e, "--threads", "1",
                                      "--cache-gb", "auto"], stdout=subprocess.DEVNULL, stderr=log)
                p.log, p.ep = log, e
                if ok:
                    up = wait_listening(p)
                    ids = run("--ids", PROMPTS[0], "--worker", e)[0] if up else None
                    text = stop(p)
                    check(f"preset_auto_cap_{cap >> 20}m", ids == ref[PROMPTS[0]] and
                          f"cgroup v1 limit {cap >> 20}.0 MiB" in text and "preset auto ->" in text, text[-600:])
                else:
                    rc = p.wait(20)
                    text = stop(p)
                    check(f"preset_auto_cap_{cap >> 20}m_refused", rc == 3 and "the minimum is" in text and
                          f"{cap >> 20}.0 MiB usable" in text, f"rc {rc}: {text[-600:]}")
        finally:
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except OSError:
                    time.sleep(0.1)

    # a worker that ignores hints says so in its HELLO: the coordinator sends none
    w = start(allr, "--cache-slots", str(k + 2), "--no-prefetch")
    if wait_listening(w):
        ids, err = run("--ids", PROMPTS[0], "--worker", w.ep, "--prefetch", "on")
        log = stop(w)
        pc = pf_counters(log)
        check("no_prefetch_worker_gets_no_hints", ids == ref[PROMPTS[0]] and pc is not None and pc[0] == 0 and
              pc[1] == 0, f"{ids} {pc}: {log[-400:]}")
    else:
        check("no_prefetch_worker_gets_no_hints", False, stop(w)[-400:])

    # two workers, each with its minimum, and buffered reads on one
    half = E // 2
    a = start(f"{allr.split(':')[0]}:0-{half - 1}", "--cache-slots", str(k))
    b = start(f"{allr.split(':')[0]}:{half}-{E - 1}", "--cache-slots", str(k + 1), "--no-direct")
    if wait_listening(a) and wait_listening(b):
        for pr in PROMPTS:
            ids, err = run("--ids", pr, "--worker", a.ep, "--worker", b.ep)
            check(f"ids_two_workers_{pr.split(',')[0]}", ids == ref[pr], f"{ids} != {ref[pr]}: {err[-300:]}")
        lb = stop(b)
        check("no_direct_logged", "buffered reads" in lb, lb[-300:])
    else:
        check("two_workers_start", False, stop(a)[-300:] + stop(b)[-300:])
    stop(a)
    stop(b)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
