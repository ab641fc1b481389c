#!/usr/bin/env python3
"""Writes tests/fixtures/MANIFEST.json: how the fixtures were made, the sha256 of
every committed model and fixture file, and the tolerances per quantity.

Tolerances are derived from measurements, not guessed: TOL_FACTOR x the largest
difference measured between conforming fp32 computations of the contract,
rounded up to two significant digits. Two sources, the larger counts:
  * the reference's own computation variants (full sequence on 1 and 2
    threads, incremental, chunked prefill; robustness.json of each model);
  * the summation-order family of tools/measure_tolerances.py (tolerance.json:
    the reference with every matrix product's reduction in ORDERS random
    orders, and the plain reference on the machine that ran it), which samples
    the bf16 rounding flips of the expert outputs (SPEC §3.9) far better, since
    the variants share torch's GEMM orders.
Refused (exit 1): a family member that disagrees with a fixture's argmax or
routing (the fixture is not robust for the contract), or a tolerance that does
not separate the F32-tensors-in-bf16 sensitivity variant. Recorded: every
fixture's smallest argmax margin against 2 x logits_abs (two logits each off
by the tolerance could swap a pair closer than that; the family's agreement is
then the evidence).
"""
import hashlib
import json
import math
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["tiny-k3", "tiny-k3-plain", "k3-nano"]
TOL_FACTOR = 4.0


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def up2(x):
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return float("%.2g" % (math.ceil(x / 10 ** e) * 10 ** e))


def versions():
    out = {"python": platform.python_version()}
    for mod in ("torch", "numpy", "safetensors", "tiktoken", "regex"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def derive(sub, problems):
    """tolerances and the measurements behind them for the fixtures in
    tests/fixtures/<model>/<sub>; appends to problems"""
    tol = {}
    measured = {}
    for m in MODELS:
        fxd = os.path.join(ROOT, f"tests/fixtures/{m}/{sub}")
        r = json.load(open(os.path.join(fxd, "robustness.json")))
        g = [x for x in r["greedy_prompts_tried"] if x["ok"]][-1]
        lg = max(r["teacher_forced"]["logit_max_abs_diff"], g["logit_max_abs_diff"])
        hid = r["hidden_summary_rel_max_diff_full_vs_incremental"]
        measured[m] = {"logit_max_abs_diff": lg, "hidden_summary_rel_max_diff": hid,
                       "min_argmax_margin_teacher_forced": r["teacher_forced"]["min_argmax_margin"],
                       "min_argmax_margin_greedy": g["min_argmax_margin"]}
        tp = os.path.join(fxd, "tolerance.json")
        fam = json.load(open(tp)) if os.path.exists(tp) else None
        held = None
        if fam:
            pool = fam["per_order"] + [fam["base"]]
            flg = max(o["logit_max_abs"] for o in pool)
            fhid = max(o["hidden_rel"] for o in pool)
            measured[m].update({"orders": fam["orders"], "orders_logit_max_abs_diff": flg,
                                "orders_hidden_summary_rel_max_diff": fhid})
            for o in pool:
                if o["argmax_disagreements"] or o["routing_disagreements"]:
                    problems.append(f"{sub}{m}: a summation order disagrees with the fixture: {o}")
            lg, hid = max(lg, flg), max(hid, fhid)
            if "heldout_nll" in fam["base"]:
                held = max(o["heldout_nll"] for o in pool)
                measured[m]["orders_heldout_nll_max_abs_diff"] = held
        tol[m] = {
            "teacher_forced_argmax": "exact",
            "greedy_generated_ids": "exact",
            "sampled_generated_ids": "exact (sampler.h contract; see sampled.json min_mass_margin)",
            "logits_abs": up2(TOL_FACTOR * lg),
            "hidden_summary_rel": up2(TOL_FACTOR * hid),
        }
        if held is not None:
            tol[m]["heldout_nll_abs"] = up2(TOL_FACTOR * held)
        margin = min(r["teacher_forced"]["min_argmax_margin"], g["min_argmax_margin"])
        measured[m]["min_argmax_margin_over_2_logits_abs"] = margin / (2 * tol[m]["logits_abs"])
        if fam:
            sens = fam["sensitivity"]
            measured[m]["sensitivity"] = {k: {"logit_max_abs_over_tolerance": v["logit_max_abs"] / tol[m]["logits_abs"],
                                              "hidden_rel_over_tolerance": v["hidden_rel"] / tol[m]["hidden_summary_rel"]}
                                          for k, v in sens.items()}
            if sens["f32_tensors_rounded_to_bf16"]["logit_max_abs"] <= tol[m]["logits_abs"]:
                problems.append(f"{sub}{m}: logits_abs {tol[m]['logits_abs']} does not catch the F32 tensors in bf16")
    return tol, measured


def derive_mu():
    """The mu numerics class (issue 33; tools/reference.py set_numerics): how
    far the reference in that class -- bf16 inputs to every bf16/MXFP4 matrix
    product, the summation order free -- lies from the fp32 fixtures, over
    the orders of tolerance_mu.json (tools/measure_tolerances.py --numerics
    mu). The engine in the mu class must lie within TOL_FACTOR x that spread,
    the same rule as for portable. A model whose family does not keep every
    teacher-forced argmax of the fixture is not robust for the class: it gets
    no tolerances (recorded, and test_engine_ref --numerics mu skips it by
    name). Routing decisions are counted, not exact: the family itself
    differs from the fixture in some."""
    tol, measured = {}, {}
    for m in MODELS:
        tp = os.path.join(ROOT, f"tests/fixtures/{m}/tolerance_mu.json")
        if not os.path.exists(tp):
            continue
        fam = json.load(open(tp))
        pool = fam["per_order"] + [fam["base"]]
        mx = {k: max(o[k] for o in pool) for k in pool[0] if k != "vs_exact_logit_max_abs"}
        measured[m] = {"orders": fam["orders"], **{f"orders_{k}_max": v for k, v in mx.items()},
                       "base_vs_exact_logit_max_abs": fam["base_vs_exact_logit_max_abs"],
                       "sensitivity": fam["sensitivity"]}
        if mx["argmax_disagreements"]:
            measured[m]["robust"] = False
            continue
        measured[m]["robust"] = True
        tol[m] = {"teacher_forced_argmax": "exact",
                  "logits_abs": up2(TOL_FACTOR * mx["logit_max_abs"]),
                  "hidden_summary_rel": up2(TOL_FACTOR * mx["hidden_rel"]),
                  "routing_disagreements": math.ceil(TOL_FACTOR * mx["routing_disagreements"])}
        if "heldout_nll" in mx:
            tol[m]["heldout_nll_abs"] = up2(TOL_FACTOR * mx["heldout_nll"])
    return tol, measured


def main():
    files = {}
    for d in [f"tests/models/{m}" for m in MODELS] + [f"tests/fixtures/{m}" for m in MODELS] + \
            [f"tests/fixtures/{m}/mu" for m in MODELS] + ["tests/fixtures/k3-scale", "tools/vocab"]:
        full = os.path.join(ROOT, d)
        if not os.path.isdir(full):
            continue
        for fn in sorted(os.listdir(full)):
            if not os.path.isdir(os.path.join(full, fn)):  # mu/: listed on its own
                files[f"{d}/{fn}"] = sha256(os.path.join(full, fn))
    problems = []
    tol, measured = derive("", problems)
    # the mu numerics class (issue 33): the same fp32 fixtures, with the spread
    # of the reference in that class (tolerance_mu.json)
    tol_mu, measured_mu = derive_mu()
    ks = os.path.join(ROOT, "tests/fixtures/k3-scale/robustness.json")
    if os.path.exists(ks):
        r = json.load(open(ks))
        hid = r["hidden_summary_rel_max_diff_full_vs_incremental"]
        measured["k3-scale"] = {"logit_max_abs_diff": r["logit_max_abs_diff"], "hidden_summary_rel_max_diff": hid,
                                "min_argmax_margin": r["min_argmax_margin"]}
        tol["k3-scale"] = {"argmax": "exact", "generated_ids": "exact",
                           "logits_abs": up2(TOL_FACTOR * r["logit_max_abs_diff"]),
                           "hidden_summary_rel": up2(TOL_FACTOR * hid)}
    man = {
        "about": "Golden fixtures of the fp32 reference (tools/reference.py); docs/TESTING.md explains every field.",
        "generator": {
            "models": "tools/regen_models.sh  (python3 tools/make_tiny_k3.py --preset MODEL --seed 1 --out tests/models/MODEL)",
            "k3-nano": "trained: tools/train_nano.py (recipe, seed and data list in tests/models/k3-nano/README.md)",
            "fixtures": "tools/regen_fixtures.sh  (python3 tools/make_fixtures.py --model tests/models/MODEL --out tests/fixtures/MODEL [--nano for k3-nano]; torch single-threaded)",
            "tolerances": "tools/regen_fixtures.sh  (python3 tools/measure_tolerances.py --model tests/models/MODEL --fixtures tests/fixtures/MODEL: tolerance.json)",
            "scale": "tools/regen_fixtures.sh --scale  (python3 tools/make_tiny_k3.py --preset k3-scale --seed 1 --out DIR; python3 tools/make_scale_fixture.py --model DIR --out tests/fixtures/k3-scale)",
            "seed": 1,
            "torch_threads": 1,
        },
        "versions": versions(),
        "tolerance_factor": TOL_FACTOR,
        "measured": measured,
        "tolerances": tol,
        "measured_mu": measured_mu,
        "tolerances_mu": tol_mu,
        "sha256": files,
    }
    if problems:
        for p in problems:
            print("make_manifest: " + p, file=sys.stderr)
        return 1
    for m in MODELS:
        if measured[m]["min_argmax_margin_over_2_logits_abs"] < 1:
            print(f"make_manifest: note: {m}: smallest argmax margin is "
                  f"{measured[m]['min_argmax_margin_over_2_logits_abs']:.2f} x 2 logits_abs "
                  "(exactness rests on every measured order agreeing)", file=sys.stderr)
    with open(os.path.join(ROOT, "tests/fixtures/MANIFEST.json"), "w") as f:
        f.write(json.dumps(man, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
