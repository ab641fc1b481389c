"""Prometheus' own checker on what shoal exports (issue 35): `promtool check
metrics` on the real /metrics of both processes (`shoal serve` with one
remote worker, and that `shoal expert --metrics-port`), after a request so
every per-worker series is there; both carry shoal_build_info and
process_start_time_seconds. The alert rules (deploy/prometheus-alerts.yml)
pass `promtool check rules`, query only documented metrics, and fire in
`promtool test rules` on series that should trigger them (and stay quiet on
healthy ones). Skipped by name when promtool (Debian package prometheus) is
absent."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import promcheck  # noqa: E402

R = promcheck.Results("test_promtool")
src = os.environ.get("SHOAL_SRC", ".")
build = os.environ.get("SHOAL_BUILD", "build")
BIN = os.environ.get("SHOAL_BIN", os.path.join(build, "bin", "shoal"))
TINY = os.path.join(src, "tests", "models", "tiny-k3")
RULES = os.path.join(src, "deploy", "prometheus-alerts.yml")
PROMTOOL = shutil.which("promtool")
TMP = tempfile.mkdtemp(prefix="shoal_promtool_")
procs = []


def promtool(*args, stdin=None):
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60)


def fetch(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def both_processes():
    wp, mp = harness.free_port(), harness.free_port()
    w = subprocess.Popen([BIN, "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", f"tcp://127.0.0.1:{wp}",
                          "--insecure", "--threads", "1", "--metrics-port", str(mp)],
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(TMP, "w.log"), "w"))
    procs.append(w)
    srv = subprocess.Popen([BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1", "--worker",
                            f"tcp://127.0.0.1:{wp}", "--insecure-workers"],
                           stdout=subprocess.PIPE, stderr=open(os.path.join(TMP, "s.log"), "w"), text=True)
    procs.append(srv)
    line = srv.stdout.readline()
    assert "listening on" in line, open(os.path.join(TMP, "s.log")).read()[-2000:]
    url = line.split("listening on ")[1].strip()
    body = json.dumps({"model": "tiny-k3", "prompt": [1, 2, 3], "max_tokens": 3}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    now = time.time()
    for name, u in (("coordinator", url + "/metrics"), ("worker", f"http://127.0.0.1:{mp}/metrics")):
        text = fetch(u)
        p = promtool("check", "metrics", stdin=text)
        assert p.returncode == 0 and not p.stdout.strip(), f"{name}: promtool: {p.stdout}{p.stderr}"
        fams = promcheck.parse(text)
        (labels, v), = promcheck.samples(fams, "shoal_build_info")
        assert v == 1 and re.fullmatch(r"\d+\.\d+\.\d+", labels["version"]), (name, labels)
        assert labels["kernels"] in ("scalar", "avx2", "avx512") and labels["isa"] in ("scalar", "avx2", "avx512")
        assert labels["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", labels["commit"]), labels
        (_, st), = promcheck.samples(fams, "process_start_time_seconds")
        assert now - 600 < st <= now + 1, (name, st, now)
        # the coordinator's latencies: histograms only (one form per latency)
        assert not [f for f in fams if f.endswith("_quantile_seconds")], sorted(fams)
    srv.send_signal(signal.SIGTERM)
    srv.wait(timeout=30)


def documented_names():
    doc = open(os.path.join(src, "docs", "METRICS.md")).read()
    return set(re.findall(r"^\| `((?:shoal|process)_[a-z0-9_]+)` \|", doc, re.M))


def rules_check():
    p = promtool("check", "rules", RULES)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr
    used = set(re.findall(r"\b(shoal_[a-z0-9_]+)", open(RULES).read()))
    doc = documented_names()
    bad = sorted(n for n in used if n not in doc and re.sub(r"_(bucket|sum|count)$", "", n) not in doc)
    assert not bad, f"alert rules query undocumented metrics: {bad}"


RULE_TESTS = """
rule_files: [RULES_PATH]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'shoal_worker_up{instance="c1", worker="a"}'
        values: '1 0 0 0 0 0 0 0'
      - series: 'shoal_worker_up{instance="c1", worker="b"}'
        values: '1 1 1 1 1 1 1 1'
      - series: 'shoal_ready{instance="c1"}'
        values: '1 1 1 1 1 1 1 1'
      - series: 'shoal_sched_queued{instance="c1"}'
        values: '0 9 9 9 9 9 9 9'
      - series: 'shoal_sched_queue_capacity{instance="c1"}'
        values: '10 10 10 10 10 10 10 10'
      - series: 'shoal_sched_refused_total{instance="c1"}'
        values: '0 0 0 0 0 0 0 0'
      - series: 'shoal_http_responses_total{instance="c1", endpoint="/v1/chat/completions", status="200"}'
        values: '0+60x7'
      - series: 'shoal_http_responses_total{instance="c1", endpoint="/v1/chat/completions", status="503"}'
        values: '0+30x7'
    alert_rule_test:
      - eval_time: 3m
        alertname: ShoalWorkerDown
        exp_alerts:
          - exp_labels: {severity: warning, instance: c1, worker: a}
            exp_annotations:
              summary: "expert worker a is down on c1"
              description: "The coordinator marked worker a down for a minute. With replicas the requests are still served (/health \\"degraded\\"); without, every request that needs its experts fails with 503 worker_unavailable."
      - eval_time: 7m
        alertname: ShoalDegraded
        exp_alerts:
          - exp_labels: {severity: warning, instance: c1}
            exp_annotations:
              summary: "c1 has been serving on replicas for 5 minutes"
              description: "1 worker(s) down while the server is ready: replicas cover them, with less capacity and no spare copy. Bring the workers back (`shoal top` names them)."
      - eval_time: 4m
        alertname: ShoalQueueSaturated
        exp_alerts:
          - exp_labels: {severity: warning, instance: c1}
            exp_annotations:
              summary: "the request queue of c1 is nearly full (or refusing with 429)"
      - eval_time: 7m
        alertname: ShoalErrorRate
        exp_alerts:
          - exp_labels: {severity: critical, instance: c1}
            exp_annotations:
              summary: "more than 5% of the generation requests on c1 fail"
              description: "33.33% answered 5xx over the last 5 minutes."
      - eval_time: 7m
        alertname: ShoalNotReady
        exp_alerts: []
  - interval: 1m
    input_series:
      - series: 'shoal_worker_up{instance="c2", worker="a"}'
        values: '1 1 1 1 1 1 1 1'
      - series: 'shoal_ready{instance="c2"}'
        values: '1 1 1 1 1 1 1 1'
    alert_rule_test:
      - eval_time: 7m
        alertname: ShoalWorkerDown
        exp_alerts: []
      - eval_time: 7m
        alertname: ShoalDegraded
        exp_alerts: []
"""


def rules_fire():
    t = os.path.join(TMP, "rules_test.yml")
    with open(t, "w") as f:
        f.write(RULE_TESTS.replace("RULES_PATH", json.dumps(os.path.abspath(RULES))))
    p = promtool("test", "rules", t)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


def grafana_exprs():
    """every query of deploy/grafana-shoal.json is valid PromQL (promtool parses
    it as a recording rule, the dashboard's variables replaced by values), and
    the dashboard has the instance and worker variables and the request,
    failover and drafting panels"""
    d = json.load(open(os.path.join(src, "deploy", "grafana-shoal.json")))
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["instance", "worker"], names
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    titles = [p["title"] for p in d["panels"]]
    for need in ("Time to first token", "Inter-token time", "Queue wait and depth", "Failovers and restarts",
                 "Speculative decoding", "Prefix cache: hits and saved prefill"):
        assert need in titles, need
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"shoal:grafana_{i}", "expr": e.replace("$__rate_interval", "1m").replace("$instance", ".*")
         .replace("$worker", ".*")} for i, e in enumerate(exprs)]}]}
    path = os.path.join(TMP, "grafana_rules.yml")
    with open(path, "w") as f:
        json.dump(rules, f)  # JSON is YAML
    p = promtool("check", "rules", path)
    assert p.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in p.stdout, p.stdout + p.stderr
    for e in exprs:  # every series filtered by the variables
        for m in re.finditer(r"\b(shoal_[a-z0-9_]+)\{([^}]*)\}", e):
            if not m.group(1).startswith("shoal_expert_server_"):
                assert 'instance=~"$instance"' in m.group(2), e
            if m.group(1).startswith(("shoal_worker_", "shoal_expert_server_")):
                assert 'worker=~"$worker"' in m.group(2), e


try:
    if not PROMTOOL:
        R.record("SKIP", "all", "promtool not installed (Debian package prometheus; scripts/deps.sh installs it)")
    elif not os.path.exists(BIN):
        R.record("SKIP", "all", "build/bin/shoal missing")
    else:
        R.check("promtool_check_metrics_coordinator_and_worker", both_processes)
        R.check("promtool_check_rules_documented_names", rules_check)
        R.check("promtool_test_rules_alerts_fire", rules_fire)
        R.check("grafana_queries_parse_and_use_the_variables", grafana_exprs)
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
R.finish()
