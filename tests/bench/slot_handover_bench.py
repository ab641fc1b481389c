"""Issue 30: a queued request's wait for a slot after k of 4 clients vanish
(FIN or RST), the cases interleaved, a fresh server per case (the steps
figure is a max since start). Uses tests/e2e/test_serve_hardening3.py's
case. Usage: .venv/bin/python tests/bench/slot_handover_bench.py ROUNDS OUT.json
Raw data: docs/data/fin_slot_handover_*_20261204.json; summary in
docs/PERFORMANCE.md ("A vanished client's slot")."""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
os.environ.setdefault("SHOAL_SRC", os.path.join(HERE, "..", ".."))
import test_serve_hardening3 as T  # noqa: E402
T.R.figures = []
n = int(sys.argv[1]); out = sys.argv[2]
loads = [os.getloadavg()[0]]
fails = []
for i in range(n):
    for how, k in (("fin", 4), ("rst", 4), ("fin", 2), ("rst", 2)):
        S = T.Server("--slots", "4")  # fresh: the steps figure is a max since start
        try:
            T.vanish_then_admit(S, how, k)
        except AssertionError as e:
            fails.append(str(e)[:200])
        finally:
            S.stop()
        loads.append(os.getloadavg()[0])
res = {}
for f in T.R.figures:
    key = "%s k=%d" % (f["how"], f["vanished"])
    res.setdefault(key, {"steps": [], "time_steps": [], "handover_steps": []})
    res[key]["handover_steps"].append(round(f["handover_ms"] / f["step_ms"], 2))
    res[key]["steps"].append(f["handover_steps_max"])
    res[key]["time_steps"].append(round((f["after_vanish_ms"] - f["idle_ms"]) / f["step_ms"], 2))
for key, v in res.items():
    print(key, "boundaries", v["steps"], "| cancel -> admission in steps: median %.2f [%.2f, %.2f]" % (
        statistics.median(v["handover_steps"]), min(v["handover_steps"]), max(v["handover_steps"])),
        "| (close -> answer) - idle in steps: median %.2f [%.2f, %.2f]" % (
        statistics.median(v["time_steps"]), min(v["time_steps"]), max(v["time_steps"])))
print("load 1-min: min %.1f max %.1f" % (min(loads), max(loads)), "fails:", len(fails))
json.dump({"figures": T.R.figures, "load1": loads, "fails": fails,
           "cpu": "AMD EPYC, 2 cores, AVX-512F + AVX512-BF16, no AMX"}, open(out, "w"), indent=1)
