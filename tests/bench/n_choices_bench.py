"""`n` choices against separate requests (issue 31), on `shoal serve`.

One server (`--slots 8 --keep 0 --memo 0`: no conversation reuse and no memo, so
every prompt state is either prefilled or forked by `n`). Per repetition, in an
interleaved order that alternates which goes first:
  n8      one chat request with n = 8 and seed s (choice i samples with seed s + i);
  sep8    8 requests with n = 1 and seeds s .. s + 7, sent at once from 8 threads
          (they batch in the step loop, each prefills its own prompt);
The two produce the same ids choice for choice (checked every repetition), so
they do the same decode work; the difference is the prompt (prefilled once and
copied, against 8 prefills) and the request overhead. Wall time per repetition;
the load average is recorded before and after.

usage: n_choices_bench.py [--model DIR] [--reps N] [--max-tokens N] [--repeat N] [--out FILE] [serve flags...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(SRC, "tests", "models", "k3-nano"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=4, help="copies of the 3-sentence preamble in the prompt")
    a, extra = ap.parse_known_args()
    cmd = [BIN, "serve", "--model", a.model, "--port", "0", "--model-name", "m", "--slots", "8", "--keep", "0",
           "--memo", "0", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = p.stdout.readline().strip().split("listening on ")[1]
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except Exception:
            time.sleep(0.2)
    text = ("The list append method adds an item to the end of the list. The list extend method adds all "
            "items of an iterable to the end of the list. A dictionary maps keys to values. ") * a.repeat
    base = {"model": "m", "messages": [{"role": "user", "content": text + "Explain the list methods."}],
            "max_tokens": a.max_tokens, "temperature": 0.9, "return_token_ids": True, "reasoning_effort": "none"}
    rows = []
    try:
        post(url, {**base, "seed": 1, "max_tokens": 4})  # warm-up
        for rep in range(a.reps):
            seed = 1000 * (rep + 1)
            res = {}
            order = ["n8", "sep8"] if rep % 2 == 0 else ["sep8", "n8"]
            for kind in order:
                load0 = os.getloadavg()[0]
                t0 = time.perf_counter()
                if kind == "n8":
                    r = post(url, {**base, "seed": seed, "n": 8})
                    ids = [c["token_ids"] for c in r["choices"]]
                    ptok = r["usage"]["prompt_tokens"]
                else:
                    out = [None] * 8

                    def go(i):
                        out[i] = post(url, {**base, "seed": seed + i})

                    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    ids = [o["choices"][0]["token_ids"] for o in out]
                    ptok = out[0]["usage"]["prompt_tokens"]
                dt = time.perf_counter() - t0
                res[kind] = {"s": dt, "ids": ids, "tokens": sum(len(x) for x in ids), "prompt_tokens": ptok,
                             "load": [load0, os.getloadavg()[0]]}
            same = res["n8"]["ids"] == res["sep8"]["ids"]
            row = {"rep": rep, "order": order, "same_ids": same,
                   **{k: {kk: v for kk, v in res[k].items() if kk != "ids"} for k in res}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not same:
                print("IDS DIFFER", file=sys.stderr)
    finally:
        p.terminate()
        p.wait(30)
    ratio = [r["sep8"]["s"] / r["n8"]["s"] for r in rows]
    summ = {
        "n8_s": {"median": statistics.median(r["n8"]["s"] for r in rows), "min": min(r["n8"]["s"] for r in rows),
                 "max": max(r["n8"]["s"] for r in rows)},
        "sep8_s": {"median": statistics.median(r["sep8"]["s"] for r in rows),
                   "min": min(r["sep8"]["s"] for r in rows), "max": max(r["sep8"]["s"] for r in rows)},
        "sep8_over_n8": {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio)},
        "all_same_ids": all(r["same_ids"] for r in rows),
        "tokens_per_rep": rows[0]["n8"]["tokens"], "prompt_tokens": rows[0]["n8"]["prompt_tokens"],
        "load": [min(min(r[k]["load"]) for r in rows for k in ("n8", "sep8")),
                 max(max(r[k]["load"]) for r in rows for k in ("n8", "sep8"))],
        "cmd": " ".join(cmd), "reps": a.reps, "max_tokens": a.max_tokens, "repeat": a.repeat,
    }
    print(json.dumps(summ, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summ, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
