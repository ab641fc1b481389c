#!/usr/bin/env python3
"""Tables of one tests/bench/amx_machine.sh run (issue 33), for docs/PERFORMANCE.md.

usage: amx_summary.py OUTDIR   (reads gemm.jsonl, peak.jsonl, threads.jsonl, pairs.jsonl, prefill.json, log.txt)
       amx_summary.py --rank OUTDIR N   (base and the N fastest variants for prefill, see rank())

- the AMX GEMM's variants: GMAC/s (median of the reps [min, max], wall clock,
  1 thread) by T, each variant's ratio to base in the same process, the best
  T = 256 as a fraction of the measured AMX bf16 peak;
- one call at T = 8 on the tiles against the AVX-512 emulation's T = 1 (the
  goal: <= 1.3x the time);
- two threads: GMAC/s and the speed-up over one thread, pinned to two cores,
  to one core's siblings, unpinned, and the emulation; prefill the same ways;
- prefill against llama-bench per variant (prefill_anchor.py's summary rows).
Prints Markdown; figures only (nothing here is a test)."""
import json
import os
import re
import sys


def rows(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def rank(d, n):
    """base, then the n variants fastest in the GEMMs a 256-token prefill calls most (the
    geometric mean of bf16 at T = 256 and MXFP4 at T = 64, each over base), comma-separated"""
    var = [r for r in rows(os.path.join(d, "gemm.jsonl")) if r.get("run") == "variants" and "gmacs" in r]
    def g(kind, t, v):
        return next((r["gmacs"] for r in var if r["kind"] == kind and r["T"] == t and r["amx_variant"] == v), None)
    score = {}
    for v in {r["amx_variant"] for r in var} - {"base", "-"}:
        a, b = g("bf16mu", 256, v), g("mxfp4mu", 64, v)
        a0, b0 = g("bf16mu", 256, "base"), g("mxfp4mu", 64, "base")
        if a and b and a0 and b0:
            score[v] = (a / a0 * b / b0) ** 0.5
    best = sorted(score, key=lambda v: -score[v])[:n]
    print(",".join(["base"] + best))
    return 0


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        return rank(sys.argv[2], int(sys.argv[3]))
    d = sys.argv[1]
    gemm = rows(os.path.join(d, "gemm.jsonl"))
    peaks = {r["what"]: r for r in rows(os.path.join(d, "peak.jsonl")) if r.get("op") == "peak" and r.get("available")}
    amx_peak = peaks["amx_bf16"]["gmacs"] if "amx_bf16" in peaks else None
    print(f"# amx_machine.sh run: {d}\n")
    log = os.path.join(d, "log.txt")
    if os.path.exists(log):
        for line in open(log):
            if re.search(r"facts:|shoal version:|variants measured|FAILED|SKIPPED|tests:", line):
                print("    " + line.rstrip())
        print()
    if peaks:
        print("peaks (shoal bench peak, GMAC/s per core): " +
              ", ".join(f"{k} {v['gmacs']:.1f}" for k, v in peaks.items()) + "\n")
    var = [r for r in gemm if r.get("run") == "variants" and "gmacs" in r]
    for r in gemm:
        if "error" in r:
            print(f"- variant {r.get('amx_variant')}: **{r['error']}** ({r.get('mu_path')}): left out")
    if var and not all(str(r.get("mu_path", "")).startswith("amx") for r in var):
        print("**These mu rows did not run on AMX** (mu path: " +
              ", ".join(sorted({str(r.get("mu_path")) for r in var})) + "): the AVX-512 emulation, variants not applied.\n")
    if var:
        kinds = sorted({r["kind"] for r in var})
        names = []
        for r in var:
            if r["amx_variant"] not in names:
                names.append(r["amx_variant"])
        Ts = sorted({r["T"] for r in var})
        for kind in kinds:
            shape = next(r["shape"] for r in var if r["kind"] == kind)
            print(f"\n## {kind} {shape}, 1 thread, GMAC/s median [min, max] (x base, same process)\n")
            print("| variant | " + " | ".join(f"T = {t}" for t in Ts) + " |")
            print("|---|" + "---|" * len(Ts))
            base = {r["T"]: r["gmacs"] for r in var if r["kind"] == kind and r["amx_variant"] in ("base", "-")}
            for n in names:
                cells = []
                for t in Ts:
                    r = next((x for x in var if x["kind"] == kind and x["amx_variant"] == n and x["T"] == t), None)
                    if not r:
                        cells.append("-")
                        continue
                    c = f"{r['gmacs']:.1f} [{r['gmacs_min']:.1f}, {r['gmacs_max']:.1f}]"
                    if t in base and base[t] > 0:
                        c += f" ({r['gmacs'] / base[t]:.2f}x)"
                    cells.append(c)
                print(f"| {n} | " + " | ".join(cells) + " |")
            top = [r for r in var if r["kind"] == kind and r["T"] == max(Ts)]
            best = max(top, key=lambda r: r["gmacs"]) if top else None
            if amx_peak and best:
                print(f"\nbest at T = {max(Ts)}: {best['amx_variant']} {best['gmacs']:.1f} GMAC/s = "
                      f"{best['gmacs'] / amx_peak:.2f} of the AMX peak")
    emu = [r for r in gemm if r.get("run") == "emulation" and "gmacs" in r]
    for kind in sorted({r["kind"] for r in emu}):
        e1 = next((r for r in emu if r["kind"] == kind and r["T"] == 1), None)
        e8 = next((r for r in emu if r["kind"] == kind and r["T"] == 8), None)
        t8 = [r for r in var if r["kind"] == kind and r["T"] == 8]
        if e1:
            line = f"\n{kind}: AVX-512 emulation T = 1 {e1['gmacs']:.2f} GMAC/s"
            if e8:
                line += f", T = 8 {e8['gmacs']:.2f} (one call T=8 / T=1 = {8 * e1['gmacs'] / e8['gmacs']:.2f}x)"
            if t8:
                b = max(t8, key=lambda r: r["gmacs"])
                where = "tiles" if str(b.get("mu_path", "")).startswith("amx") else "NOT on tiles"
                line += (f"; {where} T = 8 best {b['amx_variant']} {b['gmacs']:.2f}: one call at T = 8 = "
                         f"{8 * e1['gmacs'] / b['gmacs']:.2f}x the emulation's T = 1 (goal <= 1.3)")
            print(line)
    thr = [r for r in gemm if str(r.get("run", "")).startswith(("t1", "t2")) and "gmacs" in r]
    if thr:
        print("\n## two threads, bf16 mu 12288x7168 T = 256 (base variant, OMP_WAIT_POLICY=passive)\n")
        print("| run | vCPUs | GMAC/s [min, max] | x 1 thread | GMAC per CPU-s of the calling thread |")
        print("|---|---|---|---|---|")
        one = {("emulation" in r["run"]): r["gmacs"] for r in thr if r["run"].startswith("t1")}
        for r in thr:
            ref = one.get("emulation" in r["run"])
            x = f"{r['gmacs'] / ref:.2f}" if ref else "-"
            print(f"| {r['run']} | {r.get('cpus')} | {r['gmacs']:.1f} [{r['gmacs_min']:.1f}, {r['gmacs_max']:.1f}] | "
                  f"{x} | {r['gmacs_cpu']:.1f} |")
    pairs = rows(os.path.join(d, "pairs.jsonl"))
    solo = next((r["a"]["gmacs"] for r in pairs if r.get("pair") == "solo" and isinstance(r.get("a"), dict)), None)
    if solo:
        print(f"\n## vCPU pairs: AMX GEMM in cache (bf16mu 256x2048, T = 256) on two vCPUs at once; alone "
              f"{solo:.1f} GMAC/s\n")
        print("| vCPUs | first GMAC/s | second GMAC/s | first / alone | sum / alone |")
        print("|---|---|---|---|---|")
        for r in pairs:
            if r.get("pair") != "solo" and isinstance(r.get("a"), dict) and isinstance(r.get("b"), dict):
                a, b = r["a"]["gmacs"], r["b"]["gmacs"]
                print(f"| {r['pair']} | {a:.1f} | {b:.1f} | {a / solo:.2f} | {(a + b) / solo:.2f} |")
    eng = rows(os.path.join(d, "threads.jsonl"))
    if eng:
        print("\n## prefill, mu, 256 tokens (bench_engine)\n")
        print("| run | vCPUs | threads | env | tok/s | CPU s | x 1 thread |")
        print("|---|---|---|---|---|---|---|")
        p1 = None
        for r in eng:
            m = re.search(r"tokens_per_s=([0-9.]+)", r["rows"])
            c = re.search(r"cpu_seconds=([0-9.]+)", r["rows"])
            tps = float(m.group(1)) if m else None
            if r["run"] == "p1":
                p1 = tps
            print(f"| {r['run']} | {r['cpus']} | {r['threads']} | {r['env'] or '-'} | {tps or '-'} | "
                  f"{c.group(1) if c else '-'} | {f'{tps / p1:.2f}' if tps and p1 else '-'} |")
    pf = os.path.join(d, "prefill.json")
    if os.path.exists(pf):
        out = json.load(open(pf))
        print("\n## prefill vs llama-bench, equal work, 256 tokens\n")
        print("| shoal | threads | tok/s | llama.cpp tok/s | shoal/llama (work-adjusted) | by CPU time |")
        print("|---|---|---|---|---|---|")
        for r in out.get("summary", []):
            cpu = r.get("ratio_equal_work_cpu")
            c = f"{cpu[0]:.2f}" if cpu else "-"
            print(f"| {r['shoal']} | {r['threads']} | {r['shoal_tok_s'][0]:.2f} | {r['llama_tok_s'][0]:.2f} | "
                  f"{r['ratio_equal_work'][0]:.2f} | {c} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
