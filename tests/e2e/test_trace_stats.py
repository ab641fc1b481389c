"""`shoal trace stats` on a trace written here in Python from the format in
docs/METRICS.md ("Routing traces"), independently of the C writer, with a
plan.json; the printed figures are checked against values computed by hand
(see the comments) -- the same case as tests/unit/test_trace.c, so the C
writer and this writer must agree on every byte that matters. Also: a plan
written by `shoal plan` from a real trace, checked against Python."""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promcheck  # noqa: E402

R = promcheck.Results("test_trace_stats")
shoal = os.environ.get("SHOAL_BIN", "build/bin/shoal")

L, E, K = 3, 4, 2
recs = [  # (token, layer, experts): chunk 1 = tokens 0-1, chunk 2 = token 2
    (0, 1, [0, 1]), (1, 1, [0, 2]), (0, 2, [1, 3]), (1, 2, [1, 2]),
    (2, 1, [0, 1]), (2, 2, [0, 1]),
]


def header(major=1):
    fp = bytes(range(32))
    return (b"SHOALRT\0" + struct.pack("<HHIIIII", major, 0, 64, L, E, K, 8 + 2 * K) + fp)


def record(tok, layer, ex):
    ids = ex + [0xFFFF] * (K - len(ex))
    return struct.pack("<IHH", tok, layer, len(ex)) + struct.pack(f"<{K}H", *ids)


tmp = tempfile.mkdtemp(prefix="shoal_trace_e2e_")
trace = os.path.join(tmp, "t.trace")
with open(trace, "wb") as f:
    f.write(header())
    for r in recs:
        f.write(record(*r))
plan = os.path.join(tmp, "plan.json")
with open(plan, "w") as f:
    f.write('{"format": "shoal-plan", "version": 1, "workers": ['
            '{"name": "w0", "experts": "1-2:0-1"}, {"name": "w1", "experts": "1-2:2-3"}]}')

out = {}


def run_stats():
    p = subprocess.run([shoal, "trace", "stats", trace, "--plan", plan], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr}"
    out["text"] = p.stdout


R.check("runs", run_stats)
text = out.get("text", "")


def header_line():
    assert "3 layers x 4 experts, k 2" in text, text
    assert "model fingerprint " + bytes(range(32)).hex() in text, text
    assert re.search(r"records 6, tokens 3, pairs 12", text), text


R.check("header_and_counts", header_line)


def row(prefix_re, where=None):
    where = text if where is None else where
    m = re.search(prefix_re, where, re.M)
    assert m, f"no line matching {prefix_re!r} in:\n{where}"
    return m


def concentration():
    # L1 hits 3,2,1,0: max/mean 3/1.5 = 2, top-10% (1 expert) 3/6 = 0.5,
    # entropy (1/2 ln 2 + 1/3 ln 3 + 1/6 ln 6) / ln 4 = 0.730, 1 cold
    row(r"^\s+1\s+3\s+6\s+2\.000\s+0\.500\s+0\.730\s+1$")
    # L2 hits 1,3,1,1: 2, 0.5, (1/2 ln 2 + 1/2 ln 6)/ln 4 = 0.896, 0 cold
    row(r"^\s+2\s+3\s+6\s+2\.000\s+0\.500\s+0\.896\s+0$")
    assert not re.search(r"^\s+0\s+\d+\s+\d+\s+\d", text.split("hottest")[0], re.M), "dense layer 0 listed"


R.check("per_layer_concentration", concentration)


def hottest():
    # hottest first: L1 e0 (3 hits, share 0.5, heat 2) and L2 e1 (3), ties by layer
    sect = text.split("hottest experts")[1]
    lines = [l.split() for l in sect.strip().split("\n")[2:4]]
    assert lines[0] == ["1", "0", "3", "0.5000", "2.000"], lines
    assert lines[1] == ["2", "1", "3", "0.5000", "2.000"], lines


R.check("hottest_experts", hottest)


def plan_load():
    # w0: L1 5 + L2 4 = 9 of 12 -> 0.75; w1 0.25; fair 0.5; owned 4 each
    row(r"^w0\s+4\s+0\.7500\s+0\.5000\s+1\.500$")
    row(r"^w1\s+4\s+0\.2500\s+0\.5000\s+0\.500$")
    row(r"^imbalance \(max/mean share\): 1\.500$")
    # per layer: L1 5/3 = 1.667 (worst), L2 4/3
    row(r"worst 1\.667 at layer 1$")
    row(r"layer-weighted .*: 1\.500$")


R.check("plan_load_share_and_imbalance", plan_load)


def refusals():
    bad = os.path.join(tmp, "bad.trace")
    with open(bad, "wb") as f:
        f.write(header(major=2))
    p = subprocess.run([shoal, "trace", "stats", bad], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "format version 2.0" in p.stderr, (p.returncode, p.stderr)
    with open(bad, "wb") as f:
        f.write(header() + record(0, 1, [2, 1]))
    p = subprocess.run([shoal, "trace", "stats", bad], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "not strictly ascending" in p.stderr, (p.returncode, p.stderr)
    p = subprocess.run([shoal, "trace", "stats"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.returncode


R.check("refusals", refusals)


def planner_plan():
    """A plan written by `shoal plan` (the deployment issue's planner) from a
    real trace of tests/models/tiny-k3 is read by `trace stats --plan`, and the
    printed shares and imbalances equal the ones computed here from the trace
    and the plan's RANGES (replicas split evenly)."""
    src = os.environ.get("SHOAL_SRC", ".")
    model = os.path.join(src, "tests", "models", "tiny-k3")
    t = os.path.join(tmp, "real.trace")
    p = subprocess.run([shoal, "run", "--model", model, "--ids", "1,2,3,4,5,6,7,8", "--gen", "8", "--trace", t],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-1000:]
    cl = os.path.join(tmp, "cluster.json")
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "x", "cpus": 2, "expert_ram": 0}]
    hosts += [{"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "x", "cpus": 2, "expert_ram": "10MiB",
               "port": 6001 + i} for i in range(3)]
    with open(cl, "w") as f:
        json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
                   "hosts": hosts}, f)
    pl = os.path.join(tmp, "plan.json")
    p = subprocess.run([shoal, "plan", "--model", model, "--cluster", cl, "-o", pl], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-1000:]
    plan = json.load(open(pl))
    b = open(t, "rb").read()
    hb, rb = struct.unpack_from("<I", b, 12)[0], struct.unpack_from("<I", b, 28)[0]
    hits = {}
    for off in range(hb, len(b), rb):
        tok, layer, n = struct.unpack_from("<IHH", b, off)
        for e in struct.unpack_from(f"<{n}H", b, off + 8):
            hits[(layer, e)] = hits.get((layer, e), 0) + 1

    def cells(spec):
        out = set()
        for g in spec.split(","):
            ls, es = g.split(":")
            l0, l1 = ls.split("-") if "-" in ls else (ls, ls)
            e0, e1 = es.split("-") if "-" in es else (es, es)
            out |= {(l, e) for l in range(int(l0), int(l1) + 1) for e in range(int(e0), int(e1) + 1)}
        return out

    own = {w["name"]: cells(w["experts"]) for w in plan["workers"]}
    names = [w["name"] for w in plan["workers"]]
    load = {w: {} for w in names}
    for cell, h in hits.items():
        owners = [w for w in names if cell in own[w]]
        assert owners, f"plan leaves {cell} unowned"
        for w in owners:
            load[w][cell[0]] = load[w].get(cell[0], 0) + h / len(owners)
    total = sum(hits.values())
    share = {w: sum(load[w].values()) / total for w in names}
    layers = sorted({c[0] for c in hits})
    lw = sum(max(load[w].get(l, 0) for w in names) for l in layers) / \
        sum(sum(load[w].get(l, 0) for w in names) / len(names) for l in layers)
    p = subprocess.run([shoal, "trace", "stats", t, "--plan", pl], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for w in names:
        row(rf"^{w}\s+{len(own[w])}\s+{share[w]:.4f}\s+{1 / len(names):.4f}\s+" + re.escape(
            f"{share[w] * len(names):.3f}") + "$", p.stdout)
    row(r"^imbalance \(max/mean share\): " + re.escape(f"{max(share.values()) * len(names):.3f}") + "$", p.stdout)
    row(r"layer-weighted .*: " + re.escape(f"{lw:.3f}") + "$", p.stdout)


R.check("plan_written_by_shoal_plan", planner_plan)
subprocess.run(["rm", "-rf", tmp])
R.finish()
