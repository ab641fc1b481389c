"""Shared helpers for the metrics end-to-end tests: result lines in
$SHOAL_TEST_RESULTS, and a strict check of a Prometheus text exposition with
the official prometheus_client parser (tools/requirements.txt) plus the rules
the parser does not enforce (HELP and TYPE before samples, histogram buckets
cumulative with +Inf == _count, summary quantile labels)."""
import math
import os
import sys
import traceback

from prometheus_client.parser import text_string_to_metric_families


class Results:
    def __init__(self, test):
        self.test = test
        self.path = os.environ.get("SHOAL_TEST_RESULTS")
        self.npass = self.nfail = self.nskip = 0

    def record(self, status, case, why=None):
        line = f"{status}\t{self.test}\t{case}" + (f": {why}" if why else "")
        print(line.replace("\t", " "), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        if status == "PASS":
            self.npass += 1
        elif status == "FAIL":
            self.nfail += 1
        else:
            self.nskip += 1

    def check(self, case, fn):
        """Run fn(); AssertionError or any exception -> FAIL with the message."""
        try:
            fn()
        except SkipCase as e:
            self.record("SKIP", case, str(e))
        except Exception as e:  # noqa: BLE001 - every failure is reported
            tb = traceback.extract_tb(e.__traceback__)[-1]
            self.record("FAIL", case, f"{type(e).__name__} at line {tb.lineno}: {e}")
        else:
            self.record("PASS", case)

    def finish(self):
        print(f"{self.npass} passed, {self.nfail} failed, {self.nskip} skipped")
        if self.nfail:
            sys.exit(1)
        if self.npass == 0:
            sys.exit(77)
        sys.exit(0)


class SkipCase(Exception):
    pass


def parse(text):
    """Parse and validate an exposition. Returns {family name: Metric}, where
    each Metric has .type, .documentation and .samples (name, labels, value).
    Raises AssertionError naming the first rule broken."""
    # HELP then TYPE precede the first sample of each family, once each.
    seen_type = {}
    helps = set()
    for ln, line in enumerate(text.split("\n"), 1):
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"line {ln}: second HELP for {name}"
            helps.add(name)
        elif line.startswith("# TYPE "):
            parts = line.split(" ")
            assert len(parts) == 4, f"line {ln}: malformed TYPE line"
            name = parts[2]
            assert name in helps, f"line {ln}: TYPE for {name} without HELP before it"
            assert name not in seen_type, f"line {ln}: second TYPE for {name}"
            assert parts[3] in ("counter", "gauge", "histogram", "summary"), f"line {ln}: type {parts[3]}"
            base = name[:-6] if name.endswith("_total") else name
            clash = [n for n in seen_type if (n[:-6] if n.endswith("_total") else n) == base]
            assert not clash, f"line {ln}: family {name} clashes with {clash[0]} (same name without _total)"
            seen_type[name] = parts[3]
        elif line and not line.startswith("#"):
            sname = line.split("{")[0].split(" ")[0]
            fam = [n for n in seen_type if sname == n or
                   (sname.startswith(n) and sname[len(n):] in ("_bucket", "_sum", "_count", "_total"))]
            assert fam, f"line {ln}: sample {sname} before its TYPE line"
    fams = {}
    for fam in text_string_to_metric_families(text):
        fams[fam.name] = fam
    for name, fam in fams.items():
        if fam.type == "histogram":
            series = {}
            for s in fam.samples:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                series.setdefault(key, {"buckets": [], "count": None, "sum": None})
                if s.name.endswith("_bucket"):
                    series[key]["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_count"):
                    series[key]["count"] = s.value
                elif s.name.endswith("_sum"):
                    series[key]["sum"] = s.value
            for key, ser in series.items():
                b = ser["buckets"]
                assert b, f"{name}{key}: no buckets"
                les = [x for x, _ in b]
                assert les == sorted(les), f"{name}{key}: le not ascending"
                assert math.isinf(les[-1]), f"{name}{key}: last bucket is not +Inf"
                vals = [v for _, v in b]
                assert all(x <= y for x, y in zip(vals, vals[1:])), f"{name}{key}: buckets not cumulative"
                assert ser["count"] == vals[-1], f"{name}{key}: _count {ser['count']} != +Inf bucket {vals[-1]}"
                assert ser["sum"] is not None, f"{name}{key}: no _sum"
        elif fam.type == "summary":
            for s in fam.samples:
                if s.name == name:
                    q = float(s.labels["quantile"])
                    assert 0 <= q <= 1, f"{name}: quantile {q}"
        elif fam.type == "counter":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    assert s.value >= 0, f"{s.name}: negative counter"
    return fams


def samples(fams, family, sample=None, **labels):
    """Samples of a family (optionally of one sample name) whose labels
    include the given ones: [(labels, value)]."""
    fam = fams.get(family)
    if fam is None:
        raise AssertionError(f"no family {family}")
    out = []
    for s in fam.samples:
        if sample is not None and s.name != sample:
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            out.append((s.labels, s.value))
    return out


def value(fams, family, sample=None, **labels):
    """The one sample's value; AssertionError unless exactly one matches."""
    got = samples(fams, family, sample, **labels)
    assert len(got) == 1, f"{family} {sample or ''} {labels}: {len(got)} samples match"
    return got[0][1]
