"""docs/METRICS.md names every metric family shoal exposes, and nothing
else; deploy/grafana-shoal.json is a well-formed dashboard that queries only
documented metrics. The expositions come from the coordinator and expert
server modules (the unit tests' hand cases, which fill every family) and from
a live `shoal serve` on tests/models/tiny-k3."""
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promcheck  # noqa: E402

R = promcheck.Results("test_metrics_docs")
src = os.environ.get("SHOAL_SRC", ".")
build = os.environ.get("SHOAL_BUILD", "build")
shoal = os.environ.get("SHOAL_BIN", os.path.join(build, "bin", "shoal"))
doc = open(os.path.join(src, "docs", "METRICS.md")).read()
# shoal's families, and the standard process_start_time_seconds
documented = set(re.findall(r"^\| `((?:shoal|process)_[a-z0-9_]+)` \| (?:counter|gauge|histogram|summary) \|", doc,
                            re.M))
doc_types = dict(re.findall(r"^\| `((?:shoal|process)_[a-z0-9_]+)` \| (counter|gauge|histogram|summary) \|", doc,
                            re.M))

exposed = {}  # family name as written in the TYPE line -> type


def types_of(text):
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def collect():
    with tempfile.TemporaryDirectory() as tmp:
        for t in ("test_cmetrics", "test_wmetrics"):
            path = os.path.join(tmp, t + ".prom")
            env = dict(os.environ, SHOAL_METRICS_DUMP=path)
            env.pop("SHOAL_TEST_RESULTS", None)
            subprocess.run([os.path.join(build, "tests", t)], env=env, check=True, timeout=60)
            exposed.update(types_of(open(path).read()))
        p = subprocess.Popen([shoal, "serve", "--model", os.path.join(src, "tests", "models", "tiny-k3"), "--port",
                              "0", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = p.stdout.readline()
            assert "listening on" in line, line
            url = line.strip().split("listening on ")[1]
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                text = r.read().decode()
            promcheck.parse(text)
            exposed.update(types_of(text))
        finally:
            p.terminate()
            p.wait(timeout=30)
    assert len(exposed) > 50, len(exposed)


R.check("collect_expositions", collect)


def every_family_documented():
    missing = sorted(set(exposed) - documented)
    assert not missing, f"exposed but not in docs/METRICS.md: {missing}"
    wrong = sorted(n for n in exposed if doc_types.get(n) != exposed[n])
    assert not wrong, f"type differs from docs/METRICS.md: {[(n, exposed[n], doc_types.get(n)) for n in wrong]}"


R.check("every_exposed_family_documented_with_its_type", every_family_documented)


def nothing_stale():
    stale = sorted(documented - set(exposed))
    assert not stale, f"documented but never exposed: {stale}"


R.check("no_stale_documentation", nothing_stale)


def grafana():
    d = json.load(open(os.path.join(src, "deploy", "grafana-shoal.json")))
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    used = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (p["title"], g)
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            used.update(re.findall(r"\b(shoal_[a-z0-9_]+)", t["expr"]))
    base = set()
    for n in used:
        for suf in ("_bucket", "_sum", "_count", ""):
            if suf and n.endswith(suf) and n[: -len(suf)] in documented:
                base.add(n[: -len(suf)])
                break
        else:
            assert n in documented, f"dashboard queries undocumented {n}"
            base.add(n)
    # the dashboard covers the per-shard essentials
    for need in ("shoal_worker_load_share", "shoal_worker_rtt_seconds", "shoal_layer_imbalance",
                 "shoal_phase_seconds_total", "shoal_expert_server_resident_bytes"):
        assert need in base, need


R.check("grafana_dashboard_well_formed_and_documented", grafana)
R.finish()
