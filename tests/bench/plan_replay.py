#!/usr/bin/env python3
"""Replays `shoal plan --measured` on the doctor.json stored with each netns
run (issue 34: docs/data/plan_netns_*.json, relay_netns_k3scale_*_predicted_*.json)
with the options that run used, and sets the predictions of the plan as built
now beside the s/token measured then: the check of a change to the model
against measurements already taken (docs/PERFORMANCE.md "Plans for real
networks"). Prints per run and placement measured, predicted then, predicted
now, now/measured, and whether the plan's choice (among the placements that
were measured) is the fastest measured or within 10% of it.

With --peer, a relay run's plan also gets the workers' shaped rate as
--peer-gbps (the relay tree's hops; doctor measures only the coordinator's
links, which the 50 Mbit/s coordinator port limits).

Usage: plan_replay.py [--bin build/bin/shoal] [--k3-scale DIR] [--peer] [--json OUT] FILE...
"""
import argparse
import json
import os
import re
import subprocess
import tempfile

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def rows(text):
    out = {}
    for m in re.finditer(r"^  ((?:trunk |spread )[^\n]*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s",
                         text, re.M):
        out[m.group(1).strip()] = [float(x) for x in m.groups()[1:]]
    return out


def replay(path, a, tmp):
    d = json.load(open(path))
    model = d["model"]
    if "k3-scale" in model or "k3scale" in model:
        model = a.k3_scale
    elif "tiny-k3" in model:
        model = os.path.join(SRC, "tests", "models", "tiny-k3")
    names = [w["name"] for w in d["doctor"]["workers"]]
    cluster = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
               "hosts": [{"name": "c", "address": "10.0.0.1", "ssh_user": "u", "cpus": 1, "expert_ram": 0}] +
               [{"name": n, "address": f"10.0.0.{i + 2}", "ssh_user": "u", "cpus": 1, "expert_ram": "8GiB"}
                for i, n in enumerate(names)]}, open(cluster, "w"))
    doc = os.path.join(tmp, "doctor.json")
    json.dump(d["doctor"], open(doc, "w"))
    extra = ["--overhead-us", str(d.get("overhead_us", 100))]
    if d.get("numerics"):
        extra += ["--numerics", d["numerics"]]
    if "rate_c_mbit" in d:  # the relay bench: the coordinator's link as the shared NIC, the trunk over the 4
        extra += ["--nic-gbps", str(d["rate_c_mbit"] / 1000), "--trunk-servers", str(len(names))]
        if a.peer:  # the workers' own ports as shaped (doctor measures no worker-to-worker link)
            extra += ["--peer-gbps", str(d["rate_w_mbit"] / 1000)]
        labels = {"0": f"trunk spread over {len(names)}", "2": f"spread over {len(names)}, relay F=2",
                  "3": f"spread over {len(names)}, relay F=3"}
        meas = {labels[k]: (v["median_s"], d["predicted_s_per_token"].get(k)) for k, v in d["summary"].items()}
    else:
        meas = {k: (v["median"], v["predicted"]["s_per_token"]) for k, v in d["placements"].items()}
    r = subprocess.run([a.bin, "plan", "--model", model, "--cluster", cluster, "--measured", doc, "-o",
                        os.path.join(tmp, "plan.json")] + extra, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{path}: {r.stderr}")
    now = rows(r.stdout)
    res = {"file": os.path.basename(path), "options": extra, "placements": {}}
    for label, (m, then) in meas.items():
        p = now.get(label)
        res["placements"][label] = {"measured_s": m, "predicted_then_s": then, "predicted_now_s": p[4] if p else None,
                                    "terms_now": p[:4] if p else None}
    if not meas:  # a run of the wire comparison only (no placements timed)
        res["fastest_measured"] = res["chosen_among_measured"] = None
        return res
    fastest = min(meas, key=lambda k: meas[k][0])
    pick = min((k for k in meas if now.get(k)), key=lambda k: now[k][4])
    res["fastest_measured"], res["chosen_among_measured"] = fastest, pick
    res["chosen_over_fastest"] = meas[pick][0] / meas[fastest][0]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(SRC, "build", "bin", "shoal"))
    ap.add_argument("--k3-scale", default=os.path.join(SRC, "build", "k3-scale"))
    ap.add_argument("--json", default="")
    ap.add_argument("--peer", action="store_true", help="relay runs: pass the workers' shaped rate as --peer-gbps")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory(prefix="shoal-replay-") as tmp:
        for f in a.files:
            res = replay(f, a, tmp)
            out.append(res)
            print(f"{res['file']} ({' '.join(res['options'])})")
            for k, v in res["placements"].items():
                now = v["predicted_now_s"]
                print(f"  {k:26s} measured {v['measured_s']:.4f}  predicted then {v['predicted_then_s']:.4f} "
                      f"({v['predicted_then_s'] / v['measured_s']:.2f}x)  now {now:.4f} ({now / v['measured_s']:.2f}x)")
            if res["fastest_measured"] is None:
                print("  (no placement timed in this run)")
                continue
            print(f"  fastest measured: {res['fastest_measured']}; chosen among these: {res['chosen_among_measured']} "
                  f"({res['chosen_over_fastest']:.3f}x the fastest)")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
