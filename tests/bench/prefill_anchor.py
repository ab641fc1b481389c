"""Prefill tokens/s on equal work: shoal against llama.cpp's llama-bench (issue 33).

One script, interleaved rounds: for every round, thread count and prompt length
it runs shoal's in-process prefill (build/tests/bench_engine --prefill P on a
K3-architecture model) and `llama-bench -p P -n 0` on a random llama GGUF of
matched multiply-adds per token (tests/bench/make_anchor_gguf.py), one right
after the other, the order alternating, each in its own process. Recorded per
run: every repetition's seconds (the tool's own timer around the prompt only;
shoal also gives the process CPU seconds of the prefill), the process's wall and
CPU (rusage, model loading included), and the load average before and after.

Equal work is counted from the files, not from either program: multiply-adds
per prompt token of the weight matmuls (the vector-matrix products every token
passes through; the output head is excluded since a prefill computes the last
token's logits only, as does the embedding lookup). shoal: every 2-D bf16
tensor of the decoder layers, plus, per MoE layer, top-k / n_experts of the
routed experts' MXFP4 weights (rows x 2 x packed bytes); read from the
safetensors headers and config.json. llama: every 2-D tensor named blk.*,
read from the GGUF header. Attention over the context and the KDA recurrence
are not counted (a few % at these lengths; stated in PERFORMANCE.md).

Usage: prefill_anchor.py --model DIR --gguf FILE (--llama-bench BIN | --ggml-prefill BIN) --out FILE.json
       [--rounds 3] [--prompts 256,1024] [--threads 1,2] [--reps 2] [--max-batch 256]
       [--bench-engine BIN] [--numerics portable,mu] [--class LABEL=ISA:LLAMA_BENCH ...]
The first repetition of each run warms its caches; the figure is the last one
(all are kept). --numerics lists shoal's numerics classes to run in every
round (each its own process, named "shoal" for portable and "shoal-mu" for the
matrix-unit order: AMX where the CPU has it and it passed its self-test;
"mu@k256+once" runs it with SHOAL_AMX_VARIANT=k256+once, named "shoal-mu@k256+once").
llama-bench reports wall time only: its CPU seconds are the
process's less those of the same command with a 1-token prompt (load and first
touch), shared over the repetitions. --class (repeatable; replaces --llama-bench)
plays a CPU class on this machine: in every round each class runs shoal with
SHOAL_ISA=ISA (the kernels of that class; the run fails if bench_engine's config
row names another) and that class's llama-bench build (e.g. GGML_NATIVE=OFF with
AVX2 only); runs are named "shoal@LABEL" / "llama.cpp@LABEL" and paired by label.
--ggml-prefill runs tests/bench/ggml_anchor_prefill.c (a llama
prefill graph on ggml's CPU backend, ubatches of 512, f16 KV cache) in place of
llama-bench where llama-bench is not built. Speed is reported, never asserted."""
import argparse
import glob
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def safetensors_macs(model):
    """Multiply-adds per token of the weight matmuls of a K3-layout checkpoint."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    tc = cfg.get("text_config", cfg)
    topk, nexp = tc["num_experts_per_token"], tc["num_experts"]
    dense, routed = 0, 0
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            hdr = json.loads(f.read(n))
        for name, t in hdr.items():
            if name == "__metadata__" or ".layers." not in name or not name.startswith("language_model.model."):
                continue
            shape = t["shape"]
            if ".experts." in name:
                if name.endswith(".weight_packed"):  # MXFP4: two 4-bit weights per byte
                    routed += shape[0] * shape[1] * 2
                elif name.endswith(".weight") and len(shape) == 2:  # unquantized experts
                    routed += shape[0] * shape[1]
            elif len(shape) == 2 and t["dtype"] in ("BF16", "F32", "F16"):
                dense += shape[0] * shape[1]
    return {"dense_macs": dense, "routed_macs_all_experts": routed, "topk": topk, "experts": nexp,
            "macs_per_token": dense + routed * topk / nexp}


def gguf_tensors(path):
    """(name, dims) of every tensor in a GGUF v2/v3 file, from its header."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        magic, ver, nt, nkv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF" or ver < 2:
            raise SystemExit(f"{path}: not a GGUF v2+ file")

        def string():
            n = struct.unpack("<Q", f.read(8))[0]
            return f.read(n).decode("utf-8", "replace")

        def skip(vt):
            if vt == 8:
                string()
            elif vt == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et == 8:
                    for _ in range(n):
                        string()
                else:
                    f.seek(sizes[et] * n, 1)
            else:
                f.seek(sizes[vt], 1)

        for _ in range(nkv):
            string()
            skip(struct.unpack("<I", f.read(4))[0])
        out = []
        for _ in range(nt):
            name = string()
            nd = struct.unpack("<I", f.read(4))[0]
            dims = struct.unpack(f"<{nd}Q", f.read(8 * nd))
            f.read(12)  # type, offset
            out.append((name, dims))
    return out


def gguf_macs(path):
    m = sum(d[0] * d[1] for name, d in gguf_tensors(path) if name.startswith("blk.") and len(d) == 2)
    return {"macs_per_token": m}


def commit_id():
    """The source commit: SHOAL_COMMIT when set (a copy of the tree without git), else git's."""
    if os.environ.get("SHOAL_COMMIT"):
        return os.environ["SHOAL_COMMIT"]
    try:
        return subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


def run(cmd, env=None):
    la0 = os.getloadavg()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-3000:]}")
    return p.stdout, {"process_wall_s": round(wall, 3),
                      "process_cpu_s": round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 3),
                      "loadavg_before": la0, "loadavg_after": os.getloadavg()}


def run_shoal(a, threads, plen, numerics="portable", cls=None):
    """numerics: a class, or "mu@VARIANT": the mu class with SHOAL_AMX_VARIANT=VARIANT (the AMX
    GEMM's variant, kernels/README.md), reported as "shoal-mu@VARIANT". cls: a played CPU
    class (--class): SHOAL_ISA=cls["isa"], reported with "@LABEL" appended."""
    label = numerics
    numerics, _, variant = numerics.partition("@")
    cmd = [a.bench_engine, a.model, "--threads", str(threads), "--steps", "1", "--reps", "1",
           "--prefill", str(plen), "--prefill-reps", str(a.reps), "--max-batch", str(a.max_batch)]
    if numerics != "portable":
        cmd += ["--numerics", numerics]
    env = dict(os.environ, SHOAL_AMX_VARIANT=variant) if variant else None
    if cls and cls["isa"]:
        env = dict(env or os.environ, SHOAL_ISA=cls["isa"])
    out, info = run(cmd, env)
    if variant:
        info["amx_variant"] = variant
    reps = []
    for line in out.splitlines():
        if line.startswith("row=prefill "):
            kv = dict(x.split("=", 1) for x in line.split()[1:])
            reps.append({"seconds": float(kv["seconds"]), "cpu_seconds": float(kv["cpu_seconds"]),
                         "chunks": int(kv["chunks"])})
        elif line.startswith("row=config "):
            info["config"] = line
    who = "shoal" if label == "portable" else "shoal-" + label
    if cls:
        who += "@" + cls["label"]
        if cls["isa"] and f" isa={cls['isa']} " not in info.get("config", ""):
            raise SystemExit(f"bench_engine ran other kernels than SHOAL_ISA={cls['isa']}: {info.get('config')}")
        info["env"] = {"SHOAL_ISA": cls["isa"]} if cls["isa"] else {}
        info["class"] = cls["label"]
    return {"who": who, "numerics": numerics, "threads": threads, "tokens": plen, "reps": reps, "command": cmd,
            **info}


def run_llama(a, threads, plen, cls=None):
    cmd = [cls["llama_bench"] if cls else a.llama_bench, "-m", a.gguf, "-p", str(plen), "-n", "0", "-t", str(threads), "-r", str(a.reps),
           "--no-warmup", "-o", "jsonl"]
    out, info = run(cmd)
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    if len(rows) != 1:
        raise SystemExit(f"llama-bench: expected one result row, got {out[-2000:]!r}")
    r = rows[0]
    # llama-bench times the prompt by wall clock only. Its CPU seconds: the process's
    # CPU (rusage) less that of the same command with a 1-token prompt (model load,
    # first touch of every weight page, thread start; 1 token is 1/P of the work),
    # shared evenly over the repetitions.
    base_cmd = cmd[:]
    base_cmd[base_cmd.index("-p") + 1] = "1"
    base_cmd[base_cmd.index("-r") + 1] = "1"
    _, base = run(base_cmd)
    cpu = max(0.0, info["process_cpu_s"] - base["process_cpu_s"]) / len(r["samples_ns"])
    reps = [{"seconds": ns / 1e9, "cpu_seconds": cpu} for ns in r["samples_ns"]]
    info["cpu_method"] = "process CPU less a -p 1 -r 1 run's, over the repetitions"
    info["baseline"] = {"command": base_cmd, **base}
    meta = {k: r.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
                                  "model_n_params", "n_batch", "n_ubatch", "type_k", "flash_attn", "n_threads",
                                  "poll", "use_mmap")}
    return {"who": "llama.cpp" + ("@" + cls["label"] if cls else ""), "threads": threads, "tokens": plen, "reps": reps, "command": cmd, "llama": meta,
            **info}


def run_ggml(a, threads, plen):
    cmd = [a.ggml_prefill, a.gguf, str(plen), str(threads), str(a.reps), "512"]
    out, info = run(cmd)
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    reps = [{"seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"]} for r in rows if "tokens" in r]
    meta = [r["value"] for r in rows if r.get("meta") == "model"]
    return {"who": "ggml", "threads": threads, "tokens": plen, "reps": reps, "command": cmd, "ggml": meta, **info}


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def summarize(out, threads, prompts, aname):
    out["summary"] = []
    anchors = {x["who"] for x in out["runs"] if not x["who"].startswith("shoal")}
    for who in sorted({x["who"] for x in out["runs"] if x["who"].startswith("shoal")}):
        # a played class's runs pair with that class's anchor ("shoal@avx2", "shoal-mu@VARIANT@avx2"
        # with "llama.cpp@avx2"); an AMX variant's suffix alone has no anchor of its own
        sfx = "@" + who.rsplit("@", 1)[1] if "@" in who else ""
        anchor = aname + sfx if aname + sfx in anchors else aname
        out["summary"] += summarize_one(out, threads, prompts, anchor, who)


def summarize_one(out, threads, prompts, aname, who):
    """Per (threads, prompt): tok/s of the last repetition, median [min, max] over the rounds,
    and shoal/anchor paired within each round, scaled by the work ratio. Also usable on a
    partial file: prefill_anchor.py --summarize FILE.json"""
    sm, lm = out["shoal_work"], out["llama_work"]
    summ = []
    for t in threads:
        for p in prompts:
            s = {x["round"]: p / x["reps"][-1]["seconds"] for x in out["runs"]
                 if x["who"] == who and x["threads"] == t and x["tokens"] == p}
            l = {x["round"]: p / x["reps"][-1]["seconds"] for x in out["runs"]
                 if x["who"] == aname and x["threads"] == t and x["tokens"] == p}
            if not s or not l:
                continue
            ratios = [s[r] / l[r] for r in s if r in l]
            # the same by process CPU seconds of the prompt (both report it; with 2 threads it
            # includes what the threads burn waiting at barriers)
            sc = {x["round"]: p / x["reps"][-1]["cpu_seconds"] for x in out["runs"]
                  if x["who"] == who and x["threads"] == t and x["tokens"] == p}
            lc = {x["round"]: p / x["reps"][-1]["cpu_seconds"] for x in out["runs"]
                  if x["who"] == aname and x["threads"] == t and x["tokens"] == p and "cpu_seconds" in x["reps"][-1]}
            rc = [sc[r] / lc[r] / out["work_ratio_llama_over_shoal"] for r in sc if r in lc]
            row = {"shoal": who, "threads": t, "tokens": p,
                   "shoal_tok_s": [med(s.values()), min(s.values()), max(s.values())],
                   "llama_tok_s": [med(l.values()), min(l.values()), max(l.values())],
                   "shoal_gmac_s": med(s.values()) * sm["macs_per_token"] / 1e9,
                   "llama_gmac_s": med(l.values()) * lm["macs_per_token"] / 1e9,
                   "ratio_equal_work": [med(ratios) / out["work_ratio_llama_over_shoal"],
                                        min(ratios) / out["work_ratio_llama_over_shoal"],
                                        max(ratios) / out["work_ratio_llama_over_shoal"]],
                   "shoal_tok_per_cpu_s": [med(sc.values()), min(sc.values()), max(sc.values())],
                   "anchor_tok_per_cpu_s": [med(lc.values()), min(lc.values()), max(lc.values())] if lc else None,
                   "ratio_equal_work_cpu": [med(rc), min(rc), max(rc)] if rc else None}
            summ.append(row)
            print(f"{who} t={t} p={p}: shoal {row['shoal_tok_s'][0]:.2f} tok/s [{row['shoal_tok_s'][1]:.2f}, "
                  f"{row['shoal_tok_s'][2]:.2f}] = {row['shoal_gmac_s']:.1f} GMAC/s; {aname} "
                  f"{row['llama_tok_s'][0]:.2f} [{row['llama_tok_s'][1]:.2f}, {row['llama_tok_s'][2]:.2f}] = "
                  f"{row['llama_gmac_s']:.1f} GMAC/s; shoal/anchor (work-adjusted, paired) "
                  f"{row['ratio_equal_work'][0]:.2f} [{row['ratio_equal_work'][1]:.2f}, "
                  f"{row['ratio_equal_work'][2]:.2f}]" +
                  (f"; by CPU time {med(rc):.2f} [{min(rc):.2f}, {max(rc):.2f}]" if rc else ""), flush=True)
    return summ


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        with open(sys.argv[2]) as f:
            out = json.load(f)
        threads = sorted({x["threads"] for x in out["runs"]})
        prompts = sorted({x["tokens"] for x in out["runs"]})
        summarize(out, threads, prompts, out["anchor"])
        with open(sys.argv[2], "w") as f:
            json.dump(out, f, indent=1)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--ggml-prefill", default=None, help="tests/bench/ggml_anchor_prefill binary (instead of llama-bench)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default="256,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=256, help="shoal's chunk size (the engine's default is 256)")
    ap.add_argument("--numerics", default="portable",
                    help="shoal's classes to run, e.g. portable,mu; mu@k256+once: the mu class with that AMX variant")
    ap.add_argument("--bench-engine", default=os.path.join(SRC, "build", "tests", "bench_engine"))
    ap.add_argument("--class", dest="classes", action="append", default=[],
                    help="LABEL=ISA:LLAMA_BENCH: shoal with SHOAL_ISA=ISA against that llama-bench (repeatable)")
    a = ap.parse_args()
    classes = []
    for c in a.classes:
        label, rest = c.split("=", 1)
        isa, bench = rest.split(":", 1)
        classes.append({"label": label, "isa": isa, "llama_bench": bench})
    if len([x for x in (a.llama_bench, a.ggml_prefill, classes) if x]) != 1:
        raise SystemExit("prefill_anchor: give one of --llama-bench, --ggml-prefill and --class")
    anchor = run_llama if a.llama_bench or classes else run_ggml
    aname = "ggml" if a.ggml_prefill else "llama.cpp"
    prompts = [int(x) for x in a.prompts.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    sm, lm = safetensors_macs(a.model), gguf_macs(a.gguf)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
    out = {"what": f"prefill_anchor (issue 33): shoal bench_engine prefill vs {aname}, equal work", "anchor": aname,
           "model": a.model, "gguf": a.gguf, "shoal_work": sm, "llama_work": lm,
           "work_ratio_llama_over_shoal": lm["macs_per_token"] / sm["macs_per_token"],
           "rounds": a.rounds, "reps": a.reps, "max_batch": a.max_batch, "numerics": a.numerics,
           "classes": classes, "argv": sys.argv, "machine": platform.node(), "cpu": cpu,
           "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx"))), "nproc": os.cpu_count(),
           "commit": commit_id(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    print(f"work: shoal {sm['macs_per_token'] / 1e9:.4f} GMAC/token, llama {lm['macs_per_token'] / 1e9:.4f} "
          f"(ratio {out['work_ratio_llama_over_shoal']:.4f})", flush=True)
    k = 0
    for r in range(a.rounds):
        for t in threads:
            for p in prompts:
                order = []
                for cls in classes or [None]:
                    shoals = [lambda a, t, p, nc=nc, cls=cls: run_shoal(a, t, p, nc, cls)
                              for nc in a.numerics.split(",")]
                    anc = [lambda a, t, p, cls=cls: anchor(a, t, p, cls)] if cls else [anchor]
                    order += shoals + anc if k % 2 == 0 else anc + shoals[::-1]
                k += 1
                for fn in order:
                    res = fn(a, t, p)
                    res["round"] = r
                    out["runs"].append(res)
                    last = res["reps"][-1]["seconds"]
                    print(f"round {r} {res['who']:16s} t={t} p={p}: {p / last:8.2f} tok/s (last rep; reps "
                          f"{[round(p / x['seconds'], 2) for x in res['reps']]}) load "
                          f"{res['loadavg_before'][0]:.1f}->{res['loadavg_after'][0]:.1f}", flush=True)
                    with open(a.out, "w") as f:
                        json.dump(out, f, indent=1)
    summarize(out, threads, prompts, aname)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
