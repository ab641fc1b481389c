#!/usr/bin/env python3
"""The numerics classes end to end (issue 33; docs/ARCHITECTURE.md, "Numerics
classes"), with real processes and real sockets:

- `shoal run --numerics mu` on tiny-k3 (bf16 trunk, MXFP4 experts): every
  step's logits (--dump-logits, compared byte for byte) are identical with 1
  and 2 threads, with each kernel ISA this CPU has (SHOAL_ISA), with prefill
  in one chunk and token by token (--batch 1), and with the experts on 2 local
  workers (--workers 2, which start in the coordinator's class; also with the
  trunk rows on them, --trunk remote) and on an external `shoal expert
  --numerics mu`; and they differ from the portable
  class's (the switch reaches the matmuls);
- a mixed cluster is refused before any token, naming the worker and both
  classes: a portable coordinator with a mu worker and a mu coordinator with a
  portable worker (exit 3, the "configuration" code of docs/CONFIG.md);
- `shoal serve --numerics mu`: concurrent (continuously batched) requests give
  the texts and logprobs each gives alone;
- `shoal doctor --numerics mu` measures a mu worker; without it the worker is
  refused as by run;
- `--numerics` with another value is a usage error (exit 2);
- `shoal version`, the run report and `/metrics` (shoal_build_info, on the
  coordinator and on the worker) say the class and what computes the mu order.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_numerics"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PROMPT = "17,256,3000,42,42,9,1023,4000,5,77"
GEN = "4"
MU_PATHS = ("amx", "avx512", "avx2", "scalar")

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check
TMP = tempfile.mkdtemp(prefix="shoal_numerics_")
tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
procs = []


def run(*args, env=None, timeout=180):
    """`shoal run --json` on tiny-k3 with its logits dumped; (result, logits bytes)"""
    dump = os.path.join(TMP, f"logits-{len(os.listdir(TMP))}.f32")
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([BIN, "run", "--model", TINY, "--ids", PROMPT, "--gen", GEN, "--json", "--dump-logits", dump,
                        *args], capture_output=True, text=True, timeout=timeout, env=e)
    try:
        r.doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    except (ValueError, IndexError):
        r.doc = None
    r.logits = open(dump, "rb").read() if r.returncode == 0 and os.path.exists(dump) else None
    return r


def cpu_isas():
    """the kernel variants this CPU runs, from /proc/cpuinfo (as kernels.c asks CPUID)"""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    out = ["scalar"]
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        out.append("avx512")
    return out


def start_worker(numerics, *extra):
    ep = f"ipc://@shoal-numerics-{tag}-{len(procs)}"
    log = harness.logfile()
    p = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", ep, "--threads", "1",
                          "--id", f"w-{numerics}", "--numerics", numerics, *extra],
                         stdout=subprocess.DEVNULL, stderr=log)
    p.log, p.ep = log, ep
    procs.append(p)
    return p


def case_version():
    r = subprocess.run([BIN, "version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"^numerics portable \(default; --numerics mu runs the matrix-unit order on (\w+)\)$", r.stdout,
                  re.M)
    check("version names the default class and the mu path", r.returncode == 0 and m and m.group(1) in MU_PATHS,
          r.stdout + r.stderr)


def case_bad_value():
    r = subprocess.run([BIN, "run", "--model", TINY, "--ids", "1", "--gen", "1", "--numerics", "bf16"],
                       capture_output=True, text=True, timeout=60)
    check("run --numerics bf16 is a usage error (exit 2)", r.returncode == 2 and "--numerics" in r.stderr,
          f"rc {r.returncode}: {r.stderr[-500:]}")
    r = subprocess.run([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", "ipc://@x",
                        "--numerics", "fast"], capture_output=True, text=True, timeout=60)
    check("expert --numerics fast is a usage error (exit 2)", r.returncode == 2 and "portable or mu" in r.stderr,
          f"rc {r.returncode}: {r.stderr[-500:]}")


def case_identical():
    ref = run("--numerics", "mu", "--threads", "1")
    ok = check("mu run works and reports its class", ref.returncode == 0 and ref.doc and ref.logits and
               ref.doc.get("numerics") == "mu" and ref.doc.get("mu_path") in MU_PATHS,
               f"rc {ref.returncode}: {ref.stderr[-1500:]} {ref.doc}")
    if not ok:
        return
    port = run("--threads", "1")
    check("portable run reports its class", port.returncode == 0 and port.doc.get("numerics") == "portable",
          f"{port.doc}")
    # every generated step's logits row (--dump-logits): the classes differ in most of them
    if port.logits and len(port.logits) == len(ref.logits):
        n = len(ref.logits) // 4
        differ = sum(ref.logits[4 * i:4 * i + 4] != port.logits[4 * i:4 * i + 4] for i in range(n))
        check("mu logits differ from portable logits", differ > n // 2, f"{differ} of {n} differ")
    else:
        record("FAIL", "mu logits differ from portable logits", "portable run failed or dumped another size")
    variants = [("2 threads", ["--threads", "2"], None),
                ("token by token (--batch 1)", ["--threads", "1", "--batch", "1"], None),
                ("2 local workers", ["--threads", "1", "--workers", "2", "--worker-threads", "1"], None),
                ("2 local workers with the trunk rows (--trunk remote)",
                 ["--threads", "1", "--workers", "2", "--worker-threads", "1", "--trunk", "remote"], None)]
    for isa in cpu_isas():
        variants.append((f"SHOAL_ISA={isa}", ["--threads", "1"], {"SHOAL_ISA": isa}))
    for name, args, env in variants:
        r = run("--numerics", "mu", *args, env=env)
        same = r.returncode == 0 and r.logits == ref.logits and r.doc["generated_ids"] == ref.doc["generated_ids"]
        check(f"mu class: {name}: logits bit-identical to 1 thread in process", same,
              f"rc {r.returncode}: {r.stderr[-1500:]}" if r.returncode else "logits differ")
    w = start_worker("mu")
    r = run("--numerics", "mu", "--threads", "1", "--worker", w.ep, "--hello-timeout-ms", "60000")
    check("mu class: external mu worker: logits bit-identical", r.returncode == 0 and r.logits == ref.logits,
          f"rc {r.returncode}: {r.stderr[-1500:]}")
    harness.terminate(w)


def case_mixed():
    for coord, worker in (("portable", "mu"), ("mu", "portable")):
        w = start_worker(worker)
        t0 = time.monotonic()
        r = run("--numerics", coord, "--threads", "1", "--worker", w.ep, "--hello-timeout-ms", "60000")
        dt = time.monotonic() - t0
        why = f"rc {r.returncode} after {dt:.1f} s: {r.stderr[-1500:]}"
        named = f"w-{worker}" in r.stderr and f"'{worker}'" in r.stderr and f"'{coord}'" in r.stderr
        check(f"{coord} coordinator refuses a {worker} worker by name (exit 3, no token)",
              r.returncode == 3 and named and "numerics class" in r.stderr and r.logits is None and not r.doc,
              why)
        check(f"{coord} coordinator / {worker} worker: the worker stays up", w.poll() is None,
              f"worker exit {w.poll()}")
        harness.terminate(w)


def case_doctor():
    w = start_worker("mu")
    args = [BIN, "doctor", "--model", TINY, "--worker", w.ep, "--rounds", "5", "--bulk-count", "2", "--no-facts"]
    r = subprocess.run(args + ["--numerics", "mu"], capture_output=True, text=True, timeout=120)
    check("doctor --numerics mu measures a mu worker", r.returncode == 0, f"rc {r.returncode}: {r.stderr[-1500:]}")
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    check("doctor (portable) refuses a mu worker by name (exit 3)",
          r.returncode == 3 and "w-mu" in r.stderr and "numerics class 'mu'" in r.stderr,
          f"rc {r.returncode}: {r.stderr[-1500:]}")
    harness.terminate(w)


def case_metrics():
    mp = harness.free_port()
    w = start_worker("mu", "--metrics-port", str(mp))
    try:
        srv = harness.Serve([BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1", "--numerics", "mu",
                             "--worker", w.ep], ready=120, strict=True)
    except RuntimeError as e:
        record("FAIL", "serve --numerics mu starts with a mu worker", str(e)[-1500:])
        harness.terminate(w)
        return
    procs.append(srv.p)
    try:
        def complete(prompt):
            body = json.dumps({"model": "tiny-k3", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                               "logprobs": 1}).encode()
            req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                d = json.loads(resp.read())
            lp = d["choices"][0]["logprobs"]
            return d["choices"][0]["text"], lp["token_logprobs"]

        prompts = [[1, 2, 3], [17, 256, 3000, 42, 42, 9], [500, 7, 7, 7, 1200]]
        alone = [complete(p) for p in prompts]
        check("serve --numerics mu answers completions", all(a[0] is not None for a in alone))
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            together = list(ex.map(complete, prompts))
        check("serve --numerics mu: 3 concurrent (batched) requests equal each alone (text and logprobs)",
              together == alone, f"{together} vs {alone}")
        for name, url in (("coordinator", srv.url), ("worker", f"http://127.0.0.1:{mp}")):
            ms = harness.metrics(url)
            info = [k for k in ms if k.startswith("shoal_build_info{")]
            lab = dict(re.findall(r'(\w+)="([^"]*)"', info[0])) if len(info) == 1 else {}
            check(f"{name} /metrics: shoal_build_info says numerics mu and the mu path",
                  lab.get("numerics") == "mu" and lab.get("mu_path") in MU_PATHS, f"{info}")
    finally:
        srv.stop()
        harness.terminate(w)


def main():
    if not os.access(BIN, os.X_OK):
        record("SKIP", "all", f"no binary at {BIN}")
        return 0
    try:
        case_version()
        case_bad_value()
        case_identical()
        case_mixed()
        case_doctor()
        case_metrics()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
