#!/usr/bin/env python3
"""Tokenizer encode throughput, shoal against tiktoken (issue 6). Not a test: it
writes a raw data file that docs/PERFORMANCE.md transcribes.

    .venv/bin/python tests/bench/tok_bench.py [REPS] [OUT_RAW]

Both sides encode the same bytes with the same vocabulary (tests/models/tiny-k3)
and the same K3 pattern, single thread, REPS runs each, vocabulary loading not
timed:
  shoal           build/tests/bench_tokenizer (shoal_tok_encode, special tokens off)
  tiktoken        Encoding.encode_ordinary(text): tiktoken's Rust core alone, the
                  strongest baseline (no 400k/25k splitting, no specials)
  tiktoken+kimi   tokenization_kimi.py's encode with allow_special_tokens=False:
                  the Python-side splitting plus encode(disallowed_special=()) per
                  part, i.e. what the K3 reference tokenizer actually runs
Corpora (sizes and sha256 recorded in the output):
  stdlib  the Python standard library sources in /usr/lib/python3.11 (sorted,
          first files up to 4 MB): English docstrings and code
  mixed   the oracle test's generator (tests/e2e/test_tokenizer_oracle.py), 2 MB of
          mixed Latin/CJK/emoji/marks/digits/white space/punctuation, seed 99
  spec    ../shared/k3/SPEC.md repeated to 2 MB: English technical prose with tables
"""
import glob
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_tokenizer_oracle as oracle  # noqa: E402

import tiktoken  # noqa: E402


def corpora(names):
    out = {}
    buf = bytearray()
    for p in sorted(glob.glob("/usr/lib/python3.11/*.py")):
        buf += open(p, "rb").read()
        if len(buf) >= 4_000_000:
            break
    out["stdlib"] = bytes(buf)
    r = oracle.random.Random(99)
    out["mixed"] = oracle.document(r, "mixed", names, 2_000_000)
    spec = open(os.path.join(ROOT, "..", "shared", "k3", "SPEC.md"), "rb").read() \
        if os.path.exists(os.path.join(ROOT, "..", "shared", "k3", "SPEC.md")) \
        else open("/work/shared/k3/SPEC.md", "rb").read()
    out["spec"] = spec * (2_000_000 // len(spec) + 1)
    return out


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    out_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        ROOT, "docs", "data", time.strftime("tokenizer_bench_%Y%m%d.txt", time.gmtime()))
    model = os.path.join(ROOT, "tests", "models", "tiny-k3")
    bench = os.path.join(ROOT, "build", "tests", "bench_tokenizer")
    subprocess.run(["cmake", "--build", os.path.join(ROOT, "build"), "--target", "bench_tokenizer"],
                   check=True, stdout=subprocess.DEVNULL)
    enc, names = oracle.load_oracle(model)
    docs = corpora(names)
    tmp = os.path.join(ROOT, "build", "tok_bench")
    os.makedirs(tmp, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "coordinator", "tests/bench"], cwd=ROOT).returncode
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = [
        "# tok_bench: encode throughput, shoal_tok_encode vs tiktoken, same bytes, same vocabulary (tests/models/tiny-k3)",
        f"# commit: {commit}{' (+ uncommitted changes)' if dirty else ''}",
        f"# command: .venv/bin/python tests/bench/tok_bench.py {reps}",
        f"# date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        f"# machine: {cpu}, {os.cpu_count()} cores; python {platform.python_version()}, tiktoken {tiktoken.__version__}",
        "# threads: 1 (shoal encodes on the calling thread; tiktoken encode_ordinary is single-threaded)",
        "# shoal build: build/ (RelWithDebInfo, -O2 -g), PCRE2 JIT",
        f"# load before: {open('/proc/loadavg').read().split()[:3]}",
    ]
    for name, data in docs.items():
        lines.append(f"# corpus {name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    print("\n".join(lines), flush=True)
    rows = []
    for name, data in docs.items():
        path = os.path.join(tmp, name + ".txt")
        with open(path, "wb") as f:
            f.write(data)
        text = data.decode("utf-8", errors="replace")
        p = subprocess.run([bench, model, path, str(reps)], capture_output=True, text=True, check=True)
        for l in p.stdout.splitlines():
            rows.append(f"impl=shoal corpus={name} {l}")
            print(rows[-1], flush=True)
        for impl in ("tiktoken", "tiktoken+kimi"):
            for i in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                ids = enc.encode_ordinary(text) if impl == "tiktoken" else oracle.oracle_encode(enc, data, 0)
                t1, c1 = time.perf_counter(), time.process_time()
                rows.append(f"impl={impl} corpus={name} run={i} bytes={len(data)} ids={len(ids)} "
                            f"seconds={t1 - t0:.4f} cpu_seconds={c1 - c0:.4f} mb_per_s={len(data) / (t1 - t0) / 1e6:.2f}")
                print(rows[-1], flush=True)
    lines += rows
    lines.append(f"# load after: {open('/proc/loadavg').read().split()[:3]}")
    # summary (medians), also written to the raw file
    def field(row, k):
        return float(row.split(f" {k}=")[1].split()[0])
    summary = ["# summary: median MB/s by wall time and by CPU time (min-max), per implementation and corpus;",
               "#          ratio = shoal / tiktoken of the medians (the machine is shared: CPU time is the steadier)"]
    for name in docs:
        med = {}
        for impl in ("shoal", "tiktoken", "tiktoken+kimi"):
            sel = [r for r in rows if r.startswith(f"impl={impl} corpus={name} ")]
            w = [field(r, "mb_per_s") for r in sel]
            c = [field(r, "bytes") / field(r, "cpu_seconds") / 1e6 for r in sel]
            med[impl] = (statistics.median(w), statistics.median(c))
            summary.append(f"#   {name:7s} {impl:14s} wall {med[impl][0]:7.2f} MB/s ({min(w):.2f}-{max(w):.2f})  "
                           f"cpu {med[impl][1]:7.2f} MB/s ({min(c):.2f}-{max(c):.2f})  runs {len(sel)}")
        summary.append(f"#   {name:7s} ratio shoal/tiktoken wall {med['shoal'][0] / med['tiktoken'][0]:.2f} "
                       f"cpu {med['shoal'][1] / med['tiktoken'][1]:.2f}; shoal/tiktoken+kimi wall "
                       f"{med['shoal'][0] / med['tiktoken+kimi'][0]:.2f} cpu {med['shoal'][1] / med['tiktoken+kimi'][1]:.2f}")
    lines += summary
    print("\n".join(summary))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", out_path)


if __name__ == "__main__":
    main()
