"""Prefill tokens/s against the chunk size (issue 33): the engine's max_batch,
which `shoal serve --step-tokens` and `shoal run --batch` set, swept on one
model in interleaved rounds (the order of the sizes rotates every round), each
run its own build/tests/bench_engine process (--prefill P --max-batch B).
Recorded per run: wall and process CPU seconds of the prefill (the engine's own
timer around shoal_seq_prefill), chunks, weight bytes per prompt token, load
average before and after.

Usage: prefill_chunk.py --model DIR --out FILE.json [--sizes 32,64,128,256,512]
       [--prompt 512] [--threads 2] [--rounds 3] [--bench-engine BIN]
Speed is reported, never asserted."""
import argparse
import json
import os
import platform
import subprocess
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def caches():
    out = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    for d in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if not d.startswith("index"):
            continue
        rd = lambda f: open(os.path.join(base, d, f)).read().strip()  # noqa: E731
        out[f"L{rd('level')}{rd('type')[0].lower()}"] = rd("size")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="32,64,128,256,512")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench-engine", default=os.path.join(SRC, "build", "tests", "bench_engine"))
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    out = {"what": "prefill_chunk (issue 33): prefill tok/s vs the engine chunk size", "model": a.model,
           "prompt": a.prompt, "threads": a.threads, "machine": platform.node(), "nproc": os.cpu_count(),
           "caches_cpu0": caches(),
           "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
           "commit": subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for r in range(a.rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        for b in order:
            cmd = [a.bench_engine, a.model, "--threads", str(a.threads), "--steps", "1", "--reps", "1",
                   "--prefill", str(a.prompt), "--prefill-reps", "1", "--max-batch", str(b)]
            la0 = os.getloadavg()
            p = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = next(l for l in p.stdout.splitlines() if l.startswith("row=prefill "))
            kv = dict(x.split("=", 1) for x in row.split()[1:])
            run = {"round": r, "max_batch": b, "seconds": float(kv["seconds"]), "cpu_seconds": float(kv["cpu_seconds"]),
                   "chunks": int(kv["chunks"]), "bytes_per_token": float(kv["bytes_per_token"]),
                   "experts_seconds": float(kv["experts_seconds"]), "loadavg_before": la0,
                   "loadavg_after": os.getloadavg(), "command": cmd}
            out["runs"].append(run)
            print(f"round {r} max_batch {b:4d}: {a.prompt / run['seconds']:7.2f} tok/s wall, "
                  f"{a.prompt / run['cpu_seconds']:7.2f} tok/CPU-s, {run['chunks']} chunks, load "
                  f"{la0[0]:.1f}", flush=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    summ = []
    for b in sizes:
        w = [a.prompt / x["seconds"] for x in out["runs"] if x["max_batch"] == b]
        c = [a.prompt / x["cpu_seconds"] for x in out["runs"] if x["max_batch"] == b]
        summ.append({"max_batch": b, "tok_s_wall": [med(w), min(w), max(w)], "tok_per_cpu_s": [med(c), min(c), max(c)]})
        print(f"max_batch {b:4d}: wall {med(w):.2f} [{min(w):.2f}, {max(w):.2f}] tok/s; "
              f"CPU {med(c):.2f} [{min(c):.2f}, {max(c):.2f}] tok/CPU-s", flush=True)
    out["summary"] = summ
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
