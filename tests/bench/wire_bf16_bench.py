#!/usr/bin/env python3
"""bf16 activations on the wire (issue 34, PROTOCOL.md 1.7): bytes per decoded
token and decode step time with `--wire-act auto` against `--wire-act f32`,
both numerics classes, the trunk and the experts on `--workers N` local
workers (ipc://), rounds interleaved (in-process, auto, f32 per class per
round), ids compared with the class's in-process run.

The byte counts are exact counts of the coordinator's sent frames (the run's
JSON: decode_wire_bytes_out_per_token, decode_trunk_wire_bytes_out_per_token);
the times are wall clock on whatever machine runs it (over ipc:// the wire
costs little: this measures the bytes, and that the time does not get worse).

Usage: wire_bf16_bench.py --model DIR [--workers 2] [--rounds 5] [--gen 8] [--out FILE.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def run(model, gen, extra):
    args = [BIN, "run", "--model", model, "--ids", "1,5,17,3,99,42,7,8", "--gen", str(gen), "--json", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(f"{' '.join(args)}: exit {r.returncode}: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cfgs = []
    for cls in ("portable", "mu"):
        cfgs.append((cls, "in-process", ["--numerics", cls]))
        for mode in ("auto", "f32"):
            cfgs.append((cls, mode, ["--numerics", cls, "--workers", str(a.workers), "--trunk", "remote",
                                     "--wire-act", mode]))
    rows = []
    for rnd in range(a.rounds):
        for cls, mode, extra in cfgs:
            load = os.getloadavg()[0]
            t0 = time.time()
            j = run(a.model, a.gen, extra)
            rows.append({"round": rnd, "numerics": cls, "wire": mode, "load1": load, "t": t0,
                         "ids": j["generated_ids"], "decode_step_ms": j["decode_step_ms"],
                         **{k: v for k, v in j.items() if "wire" in k or "round_trips" in k}})
    summary = {}
    for cls, mode, _ in cfgs:
        rs = [r for r in rows if r["numerics"] == cls and r["wire"] == mode]
        ref = [r for r in rows if r["numerics"] == cls and r["wire"] == "in-process"][0]["ids"]
        med = [statistics.median(r["decode_step_ms"]) for r in rs]
        s = {"ids_as_in_process": all(r["ids"] == ref for r in rs),
             "decode_step_ms_median_of_medians": statistics.median(med), "decode_step_ms_range": [min(med), max(med)]}
        if mode != "in-process":
            for k in ("decode_wire_bytes_out_per_token", "decode_trunk_wire_bytes_out_per_token",
                      "decode_wire_bytes_per_token", "prefill_wire_bytes_out_per_token"):
                vals = sorted({r.get(k) for r in rs})
                s[k] = vals[0] if len(vals) == 1 else vals
        summary[f"{cls} {mode}"] = s
        print(f"{cls:8s} {mode:10s} ids {'=' if s['ids_as_in_process'] else 'DIFFER'}  step "
              f"{s['decode_step_ms_median_of_medians']:.1f} ms [{s['decode_step_ms_range'][0]:.1f}, "
              f"{s['decode_step_ms_range'][1]:.1f}]" +
              (f"  sent/token {s['decode_wire_bytes_out_per_token']} (trunk {s['decode_trunk_wire_bytes_out_per_token']})"
               if mode != "in-process" else ""), flush=True)
    doc = {"bench": "tests/bench/wire_bf16_bench.py", "model": os.path.basename(os.path.normpath(a.model)),
           "workers": a.workers, "rounds": a.rounds, "gen": a.gen, "cpu": cpu(), "summary": summary, "runs": rows}
    if a.out:
        json.dump(doc, open(a.out, "w"), indent=1)


def cpu():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
