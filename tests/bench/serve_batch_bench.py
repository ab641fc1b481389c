"""Continuous batching benchmark of `shoal serve` (issue 17).

For each server configuration (--slots S, in process or --workers W) and each
number of concurrent streaming clients C, C clients each stream one
completion at once (distinct short prompts of PROMPT ids, greedy, max_tokens
TOKENS, ignore nothing: a stream that ends early is counted with the tokens
it got). Recorded per point: wall from the first request to the last answer,
generated tokens (usage), aggregate tokens/s, per-stream inter-token gaps
(client-side chunk arrival times) p50/p99, time to first token p50/max,
and the load average before/after. Optionally (--long N) one more point: 4
streams decoding when an N-token prompt arrives: the streams' largest gap
while it is prefilled and its time to first token.

Usage: serve_batch_bench.py --model DIR --out FILE.json [--slots 1,16]
       [--clients 1,2,4,8,16] [--clients-slots1 LIST] [--tokens 16] [--prompt 16] [--workers 0]
       [--threads 2] [--step-tokens 256] [--long 0] [--draft off] [--url URL --vocab N]
Speed is reported, never asserted."""
import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
import harness  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "..")
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def start(model, slots, workers, threads, step_tokens, draft):
    log = harness.logfile()
    cmd = [BIN, "serve", "--model", model, "--port", "0", "--model-name", "m", "--threads", str(threads),
           "--slots", str(slots), "--step-tokens", str(step_tokens), "--memo", "0", "--keep", "0",
           "--max-context", "4096", "--draft", draft]
    if workers:
        cmd += ["--workers", str(workers), "--worker-threads", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        harness.terminate(p)
        log.seek(0)
        raise RuntimeError(f"server did not start: {log.read()[-2000:]!r}")
    url = line.strip().split("listening on ")[1]
    import openai
    return p, log, url, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)


EXTRA = {}  # request fields for a foreign server (--url): llama-server's ignore_eos


def stream(client, prompt, tokens, out, delay=0.0):
    time.sleep(delay)
    t0 = time.time()
    times, usage = [], None
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body=EXTRA):
        if ch.usage:
            usage = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].text:
            times.append(time.time())
    # a server that reports no usage: count the chunks that carried text
    out.append({"t0": t0, "t_end": time.time(), "times": times,
                "tokens": usage if usage is not None else len(times), "usage_reported": usage is not None})


def point(client, c, tokens, plen, base, vocab):
    res, ts = [], []
    for i in range(c):
        prompt = [(base + 37 * i + 11 * k) % (vocab - 1000) + 1000 for k in range(plen)]
        ts.append(threading.Thread(target=stream, args=(client, prompt, tokens, res)))
    la0 = os.getloadavg()
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    gaps, ttft = [], []
    for r in res:
        if r["times"]:
            ttft.append(r["times"][0] - r["t0"])
            gaps += [b - a for a, b in zip(r["times"], r["times"][1:])]
    gen = sum(r["tokens"] for r in res)
    return {"clients": c, "wall_s": round(wall, 3), "generated_tokens": gen,
            "aggregate_tokens_per_s": round(gen / wall, 4),
            "inter_token_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "n": len(gaps)},
            "ttft_s": {"p50": pct(ttft, 50), "max": max(ttft) if ttft else None},
            "loadavg_before": la0, "loadavg_after": os.getloadavg()}


def long_point(client, n_long, tokens):
    """4 streams decode; an n_long-token prompt arrives after their first tokens."""
    res, lres = [], []
    ts = [threading.Thread(target=stream, args=(client, [2000 + 13 * i + k for k in range(16)], tokens * 2, res))
          for i in range(4)]
    for t in ts:
        t.start()
    lt = threading.Thread(target=stream, args=(client, [1000 + k % 3000 for k in range(n_long)], 4, lres, 2.0))
    lt.start()
    for t in ts + [lt]:
        t.join()
    arr = lres[0]["t0"] if lres else None
    first = lres[0]["times"][0] if lres and lres[0]["times"] else None
    gaps_during = []
    for r in res:
        for a, b in zip(r["times"], r["times"][1:]):
            if arr and first and b > arr and a < first:
                gaps_during.append(b - a)
    gaps_all = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    return {"long_prompt_tokens": n_long, "long_ttft_s": (first - arr) if arr and first else None,
            "streams_gap_p50_s": pct(gaps_all, 50), "streams_max_gap_during_long_prefill_s":
            max(gaps_during) if gaps_during else None, "loadavg_after": os.getloadavg()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", default="1,16")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--clients-slots1", default=None, help="clients for --slots 1 (default: --clients)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--long", type=int, default=0)
    ap.add_argument("--draft", default="off", help="serve --draft mode (default off)")
    ap.add_argument("--url", default=None,
                    help="measure a running OpenAI-compatible server at URL instead (e.g. llama-server, the anchor); "
                         "--slots then only labels the run")
    ap.add_argument("--vocab", type=int, default=150000, help="prompt ids are drawn below this")
    a = ap.parse_args()
    out = {"what": "serve_batch_bench (issue 17)", "model": a.model, "workers": a.workers, "threads": a.threads,
           "tokens_per_stream": a.tokens, "prompt_tokens": a.prompt, "step_tokens": a.step_tokens, "draft": a.draft, "url": a.url,
           "machine": platform.node(), "nproc": os.cpu_count(),
           "commit": subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for s in [int(x) for x in a.slots.split(",")]:
        if a.url:
            import openai
            EXTRA["ignore_eos"] = True
            p, url = None, a.url
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)
        else:
            p, log, url, client = start(a.model, s, a.workers, a.threads, a.step_tokens, a.draft)
        try:
            stream(client, [5, 6, 7, 8], 2, [])  # warm the page cache and the workers
            run = {"slots": s, "points": []}
            cl = a.clients_slots1 if s == 1 and a.clients_slots1 else a.clients
            for i, c in enumerate(int(x) for x in cl.split(",") if x):
                pt = point(client, c, a.tokens, a.prompt, 1000 * (i + 1), a.vocab)
                print(json.dumps({"slots": s, **pt}), flush=True)
                run["points"].append(pt)
            if a.long:
                run["long"] = long_point(client, a.long, a.tokens)
                print(json.dumps({"slots": s, **run["long"]}), flush=True)
            if p:
                with urllib_metrics(url) as m:
                    run["metrics"] = m
            out["runs"].append(run)
        finally:
            if p:
                harness.terminate(p, 60)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


class urllib_metrics:
    """The scheduler's step counters from /metrics, as a dict."""
    def __init__(self, url):
        self.url = url

    def __enter__(self):
        import urllib.request
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        keep = ("shoal_sched_", "shoal_request_", "shoal_forward_")
        m = {}
        for l in text.splitlines():
            if l and not l.startswith("#") and l.startswith(keep) and "_bucket" not in l:
                k, v = l.rsplit(" ", 1)
                m[k] = float(v)
        return m

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()
