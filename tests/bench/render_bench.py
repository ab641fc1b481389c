#!/usr/bin/env python3
"""Request rendering against its size (issue 30): for each request shape of
tests/e2e/test_fuzz_http_shapes.py that costs the most per byte (tool-call
arguments with many keys, tool calls with their results, many messages, many
content parts), bodies from 0.25 MB to the 4 MiB body limit, each rendered
(chat template + tokenizer: shoal_chat_encode, what a render thread runs) REPS
times by build/tests/bench_tokenizer --chat, the sizes interleaved; median,
min and max seconds per size. Then the worst shape end to end against a
running `shoal serve` (HTTP + parse + render, answered 400
context_length_exceeded after the whole prompt was counted), REPS times.

    .venv/bin/python tests/bench/render_bench.py [OUT.json] [REPS]

Writes OUT (default docs/data/render_scaling.json) with the machine, the load
average before and after, the commit and every run."""
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
import test_fuzz_http_shapes as shapes  # noqa: E402

BENCH = os.path.join(SRC, "build", "tests", "bench_tokenizer")
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
SIZES = [250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 4_000_000]
SHAPES = [shapes.shape_argument_keys, shapes.shape_tool_calls, shapes.shape_messages, shapes.shape_content_parts]


def render_s(path):
    out = subprocess.run([BENCH, "--chat", MODEL, path, "1"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"run=0 bytes=(\d+) ids=(\d+) seconds=([\d.]+) cpu_seconds=([\d.]+)", out)
    return int(m.group(2)), float(m.group(3)), float(m.group(4))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(SRC, "docs", "data", "render_scaling.json")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    load0 = os.getloadavg()
    cpu = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][0]
    commit = subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    tmp = "/tmp/shoal-render-bench-%d" % os.getpid()
    os.makedirs(tmp, exist_ok=True)
    bodies = {}
    for sh in SHAPES:
        for size in SIZES:
            shapes.rng.seed(30)  # the same random structure at every size of a shape
            b = shapes.body_of(sh, size)
            p = os.path.join(tmp, f"{sh.__name__}-{size}.json")
            open(p, "wb").write(b)
            bodies[(sh.__name__, size)] = (p, len(b))
    runs = []
    keys = list(bodies)
    for r in range(reps):
        random.Random(r).shuffle(keys)  # interleaved: every size sees the same load
        for k in keys:
            p, n = bodies[k]
            ids, wall, cpus = render_s(p)
            runs.append({"shape": k[0][len("shape_"):], "bytes": n, "ids": ids, "seconds": wall, "cpu_seconds": cpus})
    summary = []
    for sh in SHAPES:
        name = sh.__name__[len("shape_"):]
        for size in SIZES:
            rs = [x for x in runs if x["shape"] == name and x["bytes"] == bodies[(sh.__name__, size)][1]]
            w = [x["seconds"] for x in rs]
            c = [x["cpu_seconds"] for x in rs]
            summary.append({"shape": name, "bytes": rs[0]["bytes"], "ids": rs[0]["ids"],
                            "median_s": statistics.median(w), "min_s": min(w), "max_s": max(w),
                            "median_cpu_s": statistics.median(c),
                            "ms_per_mb": round(statistics.median(w) / (rs[0]["bytes"] / 1e6) * 1e3, 1)})
            print(f"{name:14s} {rs[0]['bytes']:8d} B {statistics.median(w):.3f} s "
                  f"[{min(w):.3f}, {max(w):.3f}] cpu {statistics.median(c):.3f} s", flush=True)
    # the worst shape end to end through a server
    worst = max((x for x in summary), key=lambda x: x["median_s"] / x["bytes"])["shape"]
    S = shapes.Server()
    e2e = []
    try:
        for r in range(reps):
            for size in SIZES:
                p, n = bodies[("shape_" + worst, size)]
                st, t, lat = shapes.timed(S, open(p, "rb").read(), side=True)
                e2e.append({"bytes": n, "status": st, "seconds": round(t, 4), "side_s": round(lat, 4)})
                print(f"e2e {worst} {n} B {t:.3f} s ({st}), 3-token completion beside it {lat:.3f} s", flush=True)
    finally:
        shapes.terminate(S.p, 20)
    res = {"what": "chat render (template + tokenizer) time against request size, tiny-k3 vocabulary",
           "command": "tests/bench/render_bench.py", "commit": commit, "machine": cpu,
           "note": "AMD EPYC, AVX-512F + AVX512-BF16, no AMX; 2 cores shared with other jobs",
           "threads": 1, "reps": reps, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "python": platform.python_version(), "summary": summary, "runs": runs, "worst_shape": worst,
           "e2e": e2e}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for p, _ in bodies.values():
        os.unlink(p)
    os.rmdir(tmp)
    print("wrote", out)


if __name__ == "__main__":
    main()
