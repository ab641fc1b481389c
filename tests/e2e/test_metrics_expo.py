"""common/metrics writer against the official prometheus_client parser: the
sample exposition of build/tests/test_metrics (SHOAL_METRICS_DUMP) parses,
follows the format's rules, and carries the values it was given (the expected
values below are computed here, independently of the C code)."""
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promcheck  # noqa: E402

R = promcheck.Results("test_metrics_expo")
build = os.environ.get("SHOAL_BUILD", "build")
binary = os.path.join(build, "tests", "test_metrics")

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "dump.prom")
    env = dict(os.environ, SHOAL_METRICS_DUMP=path)
    env.pop("SHOAL_TEST_RESULTS", None)
    subprocess.run([binary], env=env, check=True, timeout=60)
    text = open(path).read()

fams = {}


def parse():
    fams.update(promcheck.parse(text))


R.check("parses_and_validates", parse)


def counter_and_escaping():
    f = fams["shoal_test_requests"]
    assert f.type == "counter"
    assert f.documentation == 'Requests \\ with "help"\nline.', repr(f.documentation)
    (labels, v), = promcheck.samples(fams, "shoal_test_requests", "shoal_test_requests_total")
    assert labels == {"worker": 'a"b\\c\nd', "endpoint": "tcp://127.0.0.1:5555"}, labels
    assert v == 7


R.check("counter_and_label_escaping", counter_and_escaping)


def gauge():
    assert fams["shoal_test_share"].type == "gauge"
    assert promcheck.value(fams, "shoal_test_share", worker="w1") == 0.125


R.check("gauge", gauge)

# 100 observations i * 10 µs, i = 1..100
obs = [i * 10e-6 for i in range(1, 101)]


def histogram():
    f = fams["shoal_test_rtt_seconds"]
    assert f.type == "histogram"
    assert promcheck.value(fams, "shoal_test_rtt_seconds", "shoal_test_rtt_seconds_count") == 100
    assert abs(promcheck.value(fams, "shoal_test_rtt_seconds", "shoal_test_rtt_seconds_sum") - sum(obs)) < 1e-12
    buckets = promcheck.samples(fams, "shoal_test_rtt_seconds", "shoal_test_rtt_seconds_bucket")
    # bounds: 2^(i/4) µs for even i (factor sqrt 2) from 1 µs to 2^28 µs, then +Inf
    les = [float(l["le"]) for l, _ in buckets]
    want = [2 ** (i / 4) * 1e-6 for i in range(0, 113, 2)] + [math.inf]
    assert len(les) == len(want), (len(les), len(want))
    for a, b in zip(les, want):
        assert a == b or abs(a - b) <= 1e-12 * b, (a, b)
    for (l, v) in buckets:
        le = float(l["le"])
        n = sum(1 for o in obs if o <= le * (1 + 1e-12))
        assert v == n, f"le={le}: {v} != {n}"


R.check("histogram_buckets", histogram)


def summary():
    f = fams["shoal_test_rtt_q_seconds"]
    assert f.type == "summary"
    qs = {l["quantile"]: v for l, v in promcheck.samples(fams, "shoal_test_rtt_q_seconds", "shoal_test_rtt_q_seconds")}
    assert set(qs) == {"0.5", "0.9", "0.99"}, qs
    for q, v in qs.items():
        exact = sorted(obs)[max(0, math.ceil(float(q) * 100) - 1)]
        # log-spaced buckets, 4 per octave: within a factor 2^(1/4)
        assert exact / 1.19 <= v <= exact * 1.19, (q, v, exact)


R.check("summary_quantiles", summary)


def coordinator_exposition():
    """The coordinator's families (tests/unit/test_cmetrics.c's hand case:
    worker a: 3 + 5 pairs, rtt 1 ms and 2 ms, queue 100 us, compute 2.1 ms;
    worker b\"x: 1 + 3 pairs) parse and carry the hand-computed values."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.prom")
        env = dict(os.environ, SHOAL_METRICS_DUMP=path)
        env.pop("SHOAL_TEST_RESULTS", None)
        subprocess.run([os.path.join(build, "tests", "test_cmetrics")], env=env, check=True, timeout=60)
        f = promcheck.parse(open(path).read())
    v = promcheck.value
    assert f["shoal_worker_rtt_seconds"].type == "histogram"
    assert f["shoal_worker_layer_rtt_seconds"].type == "summary"
    assert v(f, "shoal_worker_pairs", "shoal_worker_pairs_total", worker="a") == 8
    assert v(f, "shoal_worker_pairs", "shoal_worker_pairs_total", worker='b"x') == 4
    assert abs(v(f, "shoal_worker_load_share", worker="a") - 8 / 12) < 1e-12
    assert abs(v(f, "shoal_worker_network_seconds", "shoal_worker_network_seconds_total", worker="a") - 800e-6) < 1e-12
    assert v(f, "shoal_worker_rtt_seconds", "shoal_worker_rtt_seconds_count", worker="a") == 2
    assert v(f, "shoal_layer_imbalance", layer="1") == 1.5
    assert v(f, "shoal_worker_info", worker="a", endpoint="ipc:///tmp/a") == 1
    phases = {l["phase"] for l, _ in promcheck.samples(f, "shoal_phase_seconds", "shoal_phase_seconds_total")}
    assert phases == {"attention", "routing", "experts", "shared", "combine", "dense", "head", "sampling"}, phases


R.check("coordinator_exposition", coordinator_exposition)


def worker_exposition():
    """The expert server's families (tests/unit/test_wmetrics.c's hand case:
    3 EXPERT_BATCH received, 2 served with 3 + 2 pairs, 2 + 2 distinct experts
    of 1000 bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.prom")
        env = dict(os.environ, SHOAL_METRICS_DUMP=path)
        env.pop("SHOAL_TEST_RESULTS", None)
        subprocess.run([os.path.join(build, "tests", "test_wmetrics")], env=env, check=True, timeout=60)
        f = promcheck.parse(open(path).read())
    v = promcheck.value
    w = 'w"0'
    assert v(f, "shoal_expert_server_requests", "shoal_expert_server_requests_total", worker=w,
             type="EXPERT_BATCH") == 3
    assert v(f, "shoal_expert_server_pairs", "shoal_expert_server_pairs_total", worker=w) == 5
    assert v(f, "shoal_expert_server_weight_bytes", "shoal_expert_server_weight_bytes_total", worker=w) == 4000
    assert v(f, "shoal_expert_server_errors", "shoal_expert_server_errors_total", worker=w, code="NOT_OWNED") == 1
    hits = {(l["layer"], l["expert"]): x for l, x in
            promcheck.samples(f, "shoal_expert_server_expert_pairs", "shoal_expert_server_expert_pairs_total")}
    assert hits == {("1", "0"): 2, ("1", "5"): 1, ("2", "1"): 1, ("2", "2"): 1}, hits
    assert f["shoal_expert_server_compute_time_seconds"].type == "histogram"


R.check("worker_exposition", worker_exposition)
R.finish()
