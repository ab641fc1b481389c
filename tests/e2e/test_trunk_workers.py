#!/usr/bin/env python3
"""`--workers N --trunk remote` on one host (issue 34): the local workers
that `shoal run|serve --workers N` spawns take the trunk rows too, each its
1/N of every row-shardable matrix (the spread `shoal plan --trunk spread`
gives N workers), with the experts' supervision and metrics.

Real processes over the spawned ipc:// sockets:
- `shoal run --workers 2 --trunk remote` (and 3) on both tiny models: token
  ids and logits byte-identical to the in-process run, and the run really
  went remote (matrices and round trips counted in its JSON);
- `--workers 2 --trunk auto` stays local (the local workers are given trunk
  rows only when asked with remote);
- more workers than a matrix has rows: refused at start (exit 3) naming the
  matrix and its rows (tiny-k3-plain's b_proj has 3 rows);
- `shoal serve --workers 2 --trunk remote`: both workers serve trunk rows
  (shoal_worker_trunk_requests_total > 0 each); one SIGKILLed is restarted by
  the supervisor with the same arguments (its --trunk rows included),
  requests succeed again with the same ids, shoal_worker_restarts_total is 1
  for it, and it serves trunk rows again.
The coordinator's memory bound with local trunk workers is checked in
test_trunk_memory.py. Each case appends PASS/FAIL/SKIP lines to
$SHOAL_TEST_RESULTS. Time: about 15 s.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk_workers"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODELS = [os.path.join(SRC, "tests", "models", m) for m in ("tiny-k3", "tiny-k3-plain")]
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts
tmp = tempfile.mkdtemp(prefix="shoal-trunkw-")


def run(model, extra, timeout=90):
    out = f"{tmp}/logits{time.monotonic_ns()}.bin"
    args = [BIN, "run", "--model", model, "--ids", "5,17,3,99,42,7", "--gen", "6", "--json", "--threads", "1",
            "--dump-logits", out, "--hello-timeout-ms", "30000"] + list(extra)
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    logits = open(out, "rb").read() if os.path.exists(out) else b""
    return r.returncode, j, logits, r.stderr


def matrix_rows(model):
    """{name: rows} of the 2-D trunk tensors, from the safetensors headers."""
    return {k: v["shape"][0] for k, v in harness.st_headers(model) if len(v["shape"]) == 2}


def case_run():
    for model in MODELS:
        name = os.path.basename(model)
        rc, ref, ref_logits, err = run(model, [])
        if not check(f"{name}: in-process reference", rc == 0 and ref and ref_logits, err[-300:]):
            continue
        for n in (2, 3):
            rc, j, lg, err = run(model, ["--workers", str(n), "--worker-threads", "1", "--trunk", "remote"])
            ok = rc == 0 and j is not None
            check(f"{name}: --workers {n} --trunk remote: runs", ok, f"rc {rc}: {err[-400:]}")
            if not ok:
                continue
            check(f"{name}: --workers {n} --trunk remote: really remote ({j.get('trunk_remote_matrices')} matrices, "
                  f"{j.get('decode_trunk_round_trips_per_token')} round trips per token)",
                  j.get("trunk_remote_matrices", 0) > 0 and j.get("decode_trunk_round_trips_per_token", 0) > 0, "")
            check(f"{name}: --workers {n} --trunk remote: ids and logits bit-identical to in-process",
                  j["generated_ids"] == ref["generated_ids"] and lg == ref_logits,
                  f"{j['generated_ids']} vs {ref['generated_ids']}, logits equal: {lg == ref_logits}")
    model = MODELS[0]
    rc, j, _, err = run(model, ["--workers", "2", "--worker-threads", "1", "--trunk", "auto"])
    check("--workers 2 --trunk auto: the trunk stays local", rc == 0 and j and j.get("trunk_remote_matrices") == 0,
          f"rc {rc}: {err[-300:]}")
    # more workers than the smallest matrix has rows
    model = MODELS[1]
    rows = matrix_rows(model)
    small = min((r, k) for k, r in rows.items() if "embed_tokens" not in k and "kv_b_proj" not in k and r >= 2)
    n = small[0] + 1
    rc, j, _, err = run(model, ["--workers", str(n), "--worker-threads", "1", "--trunk", "remote"])
    check(f"--workers {n} --trunk remote with a {small[0]}-row matrix: refused (exit 3) naming it",
          rc == 3 and f"{small[0]} rows" in err and "cannot be spread over" in err, f"rc {rc}: {err[-300:]}")


children, worker_pid = harness.children, harness.worker_pid


def case_serve():
    try:
        import openai
    except ImportError:
        record("SKIP", "serve", "the openai package is not installed (scripts/deps.sh)")
        return
    log = harness.logfile()
    srv = subprocess.Popen([BIN, "serve", "--model", MODELS[0], "--port", "0", "--model-name", "tiny", "--threads",
                            "1", "--workers", "2", "--worker-threads", "1", "--trunk", "remote",
                            "--expert-timeout-ms", "3000", "--memo", "0"],
                           stdout=subprocess.PIPE, stderr=log, text=True)

    def logtext():
        log.seek(0)
        return log.read().decode(errors="replace")

    try:
        line = srv.stdout.readline()
        if not check("serve --workers 2 --trunk remote starts", "listening on" in line, logtext()[-1500:]):
            return
        url = line.strip().split("listening on ")[1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete():
            r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            return (r.choices[0].model_extra or {}).get("token_ids")

        def trunk_reqs(w):
            return harness.worker_metric(url, "shoal_worker_trunk_requests_total", w) or 0.0

        base = complete()
        check("serve: baseline ids", isinstance(base, list) and len(base) == 6, repr(base))
        check("serve: both local workers computed trunk rows", trunk_reqs("w0") > 0 and trunk_reqs("w1") > 0,
              f"{trunk_reqs('w0')} {trunk_reqs('w1')}")
        pid0, argv0 = worker_pid(srv, "w1")
        check("serve: local worker w1 was started with its trunk rows",
              argv0 is not None and "--trunk" in argv0 and argv0[argv0.index("--trunk") + 1].startswith("*:1/2"),
              repr(argv0))
        if pid0 is None:
            return
        before = trunk_reqs("w1")
        t0 = time.monotonic()
        os.kill(pid0, signal.SIGKILL)
        got, dt = None, None
        while time.monotonic() - t0 < 30:
            try:
                got = complete()
                dt = time.monotonic() - t0
                break
            except openai.APIStatusError:
                time.sleep(0.05)
        check("serve: w1 killed: requests succeed again within 30 s", dt is not None, logtext()[-1500:])
        check("serve: w1 killed: the same ids", got == base, f"{got} vs {base}")
        pid1, argv1 = worker_pid(srv, "w1")
        check("serve: w1 restarted as a new process with the same arguments (trunk rows included)",
              pid1 is not None and pid1 != pid0 and argv1 == argv0, f"{pid0}->{pid1} {argv0} {argv1}")
        check("serve: shoal_worker_restarts_total is 1 for w1",
              harness.worker_metric(url, "shoal_worker_restarts_total", "w1") == 1.0, "")
        # the restarted worker serves trunk rows again (the keeper marks it up; poll a few requests)
        t1 = time.monotonic()
        while trunk_reqs("w1") <= before and time.monotonic() - t1 < 20:
            complete()
        check("serve: the restarted w1 computes trunk rows again", trunk_reqs("w1") > before,
              f"{before} -> {trunk_reqs('w1')}")
        if dt is not None:
            print(f"figure: kill to first successful request with local trunk workers: {dt:.2f} s", flush=True)
    finally:
        harness.terminate(srv, 10)
    check("serve exits and leaves no worker behind", not children(srv.pid), repr(children(srv.pid)))


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    case_run()
    case_serve()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
