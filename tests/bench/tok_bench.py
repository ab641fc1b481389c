#!/usr/bin/env python3
"""Tokenizer encode throughput, shoal against tiktoken (issues 6, 24). Not a
test: it writes a raw data file that docs/PERFORMANCE.md transcribes.

    .venv/bin/python tests/bench/tok_bench.py [REPS] [OUT_RAW] [--vocab DIR] [--before BIN]

Both sides encode the same bytes with the same vocabulary (K3's real one,
../shared/k3, 163,584 ranks, by default; --vocab tests/models/tiny-k3 for the
project's 3,840-rank one) and the same K3 pattern, single thread, REPS rounds
with the implementations interleaved, vocabulary loading timed apart (load rows:
wall, CPU and VmRSS growth of a fresh process, shoal_tok_open vs building the
tiktoken Encoding as tokenization_kimi.py does); then the chat templating of a
1,000-turn conversation, shoal_chat_encode vs tools/k3_oracle.py (same ids
checked). Encoders:
  shoal           build/tests/bench_tokenizer (shoal_tok_encode, special tokens off)
  shoal-before    --before BIN: another bench_tokenizer (built from an earlier commit,
                  same flags), in the same rotation: before/after in one run
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
  cjk     the oracle test's generator, 2 MB of Han runs with Latin, kana, Hangul, seed 98
"""
import argparse
import glob
import hashlib
import json
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
sys.path.insert(0, os.path.join(ROOT, "tools"))
import k3_oracle  # noqa: E402

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
    r = oracle.random.Random(98)
    out["cjk"] = oracle.document(r, "cjk", names, 2_000_000)
    return out


def field(row, k):
    return float(row.split(f" {k}=")[1].split()[0])


def tiktoken_load(vocab):
    """tiktoken's vocabulary load (ranks file -> Encoding) in a fresh interpreter:
    seconds and the growth of the peak RSS, as bench_tokenizer's load row."""
    code = ("import sys,time;sys.path.insert(0,%r);import tiktoken,k3_oracle\n"
            "def rss(): return int([l for l in open('/proc/self/status') if l.startswith('VmRSS:')][0].split()[1])\n"
            "r0=rss();t0=time.perf_counter();c0=time.process_time();"
            "k=k3_oracle.KimiTokenizer(%r);t1=time.perf_counter();c1=time.process_time();"
            "print('load seconds=%%.4f cpu_seconds=%%.4f rss_kb=%%d'%%(t1-t0,c1-c0,rss()-r0))") % (
                os.path.join(ROOT, "tools"), vocab)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def chat_body(turns):
    import test_k3_real_vocab as rv
    r = oracle.random.Random(1000)
    msgs = []
    for _ in range(turns // 2):
        msgs.append({"role": "user", "content": rv.rtext(r)})
        msgs.append({"role": "assistant", "content": rv.rtext(r), "reasoning_content": rv.rtext(r)})
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reps", nargs="?", type=int, default=5)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--vocab", help="tokenizer directory (default: ../shared/k3 when present, else tiny-k3)")
    ap.add_argument("--before", help="a bench_tokenizer built from an earlier commit, timed as shoal-before")
    args = ap.parse_args()
    reps = args.reps
    real = os.path.join(ROOT, "..", "shared", "k3")
    model = args.vocab or (real if os.path.exists(os.path.join(real, "tiktoken.model"))
                           else os.path.join(ROOT, "tests", "models", "tiny-k3"))
    model = os.path.abspath(model)
    out_path = args.out or os.path.join(
        ROOT, "docs", "data", time.strftime("tokenizer_bench_%Y%m%d.txt", time.gmtime()))
    bench = os.path.join(ROOT, "build", "tests", "bench_tokenizer")
    subprocess.run(["cmake", "--build", os.path.join(ROOT, "build"), "--target", "bench_tokenizer"],
                   check=True, stdout=subprocess.DEVNULL)
    tok = k3_oracle.KimiTokenizer(model)
    enc, names = tok.enc, sorted(tok.names.values())
    docs = corpora(names)
    tmp = os.path.join(ROOT, "build", "tok_bench")
    os.makedirs(tmp, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "coordinator", "tests/bench"], cwd=ROOT).returncode
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = [
        f"# tok_bench: encode throughput, shoal_tok_encode vs tiktoken, same bytes, same vocabulary ({model}, "
        f"{len(tok.ranks)} ranks)",
        f"# commit: {commit}{' (+ uncommitted changes)' if dirty else ''}",
        f"# command: .venv/bin/python tests/bench/tok_bench.py {reps}" + (f" --vocab {args.vocab}" if args.vocab else "")
        + (f" --before {args.before}" if args.before else ""),
        f"# date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        f"# machine: {cpu}, {os.cpu_count()} cores; python {platform.python_version()}, tiktoken {tiktoken.__version__}",
        "# threads: 1 (shoal encodes on the calling thread; tiktoken encode_ordinary is single-threaded)",
        "# shoal build: build/ (RelWithDebInfo, -O2 -g), PCRE2 JIT",
        "# order: REPS rounds; in each round every corpus, and for it shoal, tiktoken, tiktoken+kimi in a",
        "#        rotating order (interleaved, so a burst of load from other builds hits all three)",
    ]
    if args.before:
        lines.append(f"# shoal-before: {os.path.abspath(args.before)} (in the rotation after shoal)")
    for name, data in docs.items():
        lines.append(f"# corpus {name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    print("\n".join(lines), flush=True)
    rows = []
    texts = {}
    for name, data in docs.items():
        with open(os.path.join(tmp, name + ".txt"), "wb") as f:
            f.write(data)
        texts[name] = data.decode("utf-8", errors="replace")
    impls = ["shoal", "tiktoken", "tiktoken+kimi"] + (["shoal-before"] if args.before else [])
    for rnd in range(reps):
        load = open("/proc/loadavg").read().split()[:3]
        rows.append(f"# round {rnd} load {load}")
        print(rows[-1], flush=True)
        for name, data in docs.items():
            k = rnd % len(impls)
            order = impls[k:] + impls[:k]
            for impl in order:
                if impl in ("shoal", "shoal-before"):
                    p = subprocess.run([bench if impl == "shoal" else args.before, model,
                                        os.path.join(tmp, name + ".txt"), "1"], capture_output=True,
                                       text=True, check=True)
                    out = p.stdout.splitlines()
                    rows.append(f"impl={impl}-load corpus={name} {out[0][5:]}")
                    rows.append(f"impl={impl} corpus={name} {out[1].replace('run=0', f'run={rnd}')}")
                else:
                    t0, c0 = time.perf_counter(), time.process_time()
                    ids = enc.encode_ordinary(texts[name]) if impl == "tiktoken" else oracle.oracle_encode(enc, data, 0)
                    t1, c1 = time.perf_counter(), time.process_time()
                    rows.append(f"impl={impl} corpus={name} run={rnd} bytes={len(data)} ids={len(ids)} "
                                f"seconds={t1 - t0:.4f} cpu_seconds={c1 - c0:.4f} mb_per_s={len(data) / (t1 - t0) / 1e6:.2f}")
                print(rows[-1], flush=True)
    # vocabulary load: shoal (from the encode runs above) and tiktoken, fresh processes
    for i in range(reps):
        rows.append(f"impl=tiktoken-load run={i} {tiktoken_load(model)[5:]}")
        print(rows[-1], flush=True)
    # chat templating of a 1,000-turn conversation: shoal_chat_encode vs the oracle encoder
    msgs = chat_body(1000)
    bpath = os.path.join(tmp, "chat_1000_turns.json")
    with open(bpath, "w", encoding="utf-8") as f:
        json.dump({"messages": msgs}, f, ensure_ascii=False)
    want = k3_oracle.xtml_encode(tok, msgs)
    p = subprocess.run([bench, "--chat", model, bpath, str(reps)], capture_output=True, text=True, check=True)
    for l in p.stdout.splitlines()[1:]:
        rows.append(f"impl=shoal-chat turns=1000 {l} same_ids={int(int(l.split(' ids=')[1].split()[0]) == len(want))}")
        print(rows[-1], flush=True)
    for i in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = k3_oracle.xtml_encode(tok, msgs)
        t1, c1 = time.perf_counter(), time.process_time()
        rows.append(f"impl=oracle-chat turns=1000 run={i} ids={len(ids)} seconds={t1 - t0:.4f} cpu_seconds={c1 - c0:.4f}")
        print(rows[-1], flush=True)
    lines += rows
    lines.append(f"# load after: {open('/proc/loadavg').read().split()[:3]}")
    summary = ["# summary: median MB/s by wall time and by CPU time (min-max), per implementation and corpus;",
               "#          ratio = shoal / tiktoken of the medians (the machine is shared: CPU time is the steadier)"]
    for name in docs:
        med = {}
        for impl in impls:
            sel = [r for r in rows if r.startswith(f"impl={impl} corpus={name} ")]
            w = [field(r, "mb_per_s") for r in sel]
            c = [field(r, "bytes") / field(r, "cpu_seconds") / 1e6 for r in sel]
            med[impl] = (statistics.median(w), statistics.median(c))
            summary.append(f"#   {name:7s} {impl:14s} wall {med[impl][0]:7.2f} MB/s ({min(w):.2f}-{max(w):.2f})  "
                           f"cpu {med[impl][1]:7.2f} MB/s ({min(c):.2f}-{max(c):.2f})  runs {len(sel)}")
        summary.append(f"#   {name:7s} ratio shoal/tiktoken wall {med['shoal'][0] / med['tiktoken'][0]:.2f} "
                       f"cpu {med['shoal'][1] / med['tiktoken'][1]:.2f}; shoal/tiktoken+kimi wall "
                       f"{med['shoal'][0] / med['tiktoken+kimi'][0]:.2f} cpu {med['shoal'][1] / med['tiktoken+kimi'][1]:.2f}")
        if args.before:
            summary.append(f"#   {name:7s} ratio shoal-before/tiktoken wall "
                           f"{med['shoal-before'][0] / med['tiktoken'][0]:.2f} cpu "
                           f"{med['shoal-before'][1] / med['tiktoken'][1]:.2f}; shoal/shoal-before wall "
                           f"{med['shoal'][0] / med['shoal-before'][0]:.2f} cpu {med['shoal'][1] / med['shoal-before'][1]:.2f}")
    for impl in ("shoal-load", "shoal-before-load", "tiktoken-load"):
        sel = [r for r in rows if r.startswith(f"impl={impl} ")]
        if not sel:
            continue
        sec = [field(r, "seconds") for r in sel]
        kb = [field(r, "rss_kb") for r in sel]
        summary.append(f"#   vocabulary load {impl:14s} median {statistics.median(sec) * 1e3:.1f} ms "
                       f"({min(sec) * 1e3:.1f}-{max(sec) * 1e3:.1f}), RSS growth median "
                       f"{statistics.median(kb) / 1024:.1f} MiB, runs {len(sel)}")
    for impl in ("shoal-chat", "oracle-chat"):
        sel = [r for r in rows if r.startswith(f"impl={impl} ")]
        sec = [field(r, "seconds") for r in sel]
        summary.append(f"#   chat 1000 turns {impl:12s} median {statistics.median(sec) * 1e3:.1f} ms "
                       f"({min(sec) * 1e3:.1f}-{max(sec) * 1e3:.1f}), {len(want)} ids, runs {len(sel)}")
    lines += summary
    print("\n".join(summary))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", out_path)


if __name__ == "__main__":
    main()
