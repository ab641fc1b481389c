#!/usr/bin/env python3
"""Prefix cache TTFT on a real-width model (issue 32, docs/PERFORMANCE.md "Prefix cache"): a second
request sharing a system prompt, cold vs warm (memory tier) vs warm (disk tier, after a restart).

Per repetition r (interleaved: each rep measures all three, in this order):
  cold  -- a new system prompt S_r (a slice of English prose from docs/, ~PREFIX tokens of the real
           vocabulary) + user message 1, on a server with the cache: nothing of S_r is cached;
  mem   -- S_r + user message 2 on the same server: resumes from the capture at S_r's end (memory);
  disk  -- the server is restarted on the same --prefix-cache-dir; S_r + user message 3: resumes from
           the file (read, verified, imported).
TTFT is the wall time of a non-streamed request with max_tokens 1 (prefill + one sampled token), from
the client. --keep 0 and --memo 0 so that only the prefix cache can reuse anything; every request
reports usage.prompt_tokens_details.cached_tokens, checked against the rendered system message length.
Usage: pcache_ttft_bench.py --model DIR [--prefix 300] [--reps 3] [--threads 2] --out FILE.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def prose():
    out = []
    for f in ("README.md", "docs/ARCHITECTURE.md", "docs/API.md"):
        for para in open(os.path.join(SRC, f), encoding="utf-8").read().split("\n\n"):
            p = " ".join(para.split())
            if len(p) > 200 and not p.startswith(("|", "```", "#")):
                out.append(p)
    return out


class Server:
    def __init__(self, model, threads, cdir, log):
        cmd = [BIN, "serve", "--model", model, "--port", "0", "--threads", str(threads), "--memo", "0", "--keep", "0",
               "--slots", "1", "--prefix-cache-gb", "1", "--prefix-cache-dir", cdir, "--prefix-cache-stride", "0",
               "--model-name", "m"]
        t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        self.url = line.strip().split("listening on ")[1]
        deadline = time.monotonic() + 600  # ready: /health 200 (503 while starting)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001 -- 503 while starting
                if time.monotonic() > deadline:
                    raise RuntimeError("server not ready within 600 s")
                time.sleep(0.5)
        self.start_s = time.monotonic() - t0

    def ttft(self, system, user):
        body = {"model": "m", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=7200) as r:
            j = json.loads(r.read())
        dt = time.monotonic() - t0
        u = j["usage"]
        return {"s": dt, "prompt_tokens": u["prompt_tokens"],
                "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in r.read().decode().splitlines()
                    if ln.startswith("shoal_prefix_cache") or ln.startswith("shoal_prefilled")}

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix", type=int, default=300, help="system prompt length, tokens (approximately)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    paras = prose()
    cdir = tempfile.mkdtemp(prefix="shoal-ttft-")
    log = tempfile.NamedTemporaryFile(prefix="shoal-ttft-", suffix=".log", delete=False)
    rows = []
    srv = Server(a.model, a.threads, cdir, log)
    starts = [srv.start_s]
    try:
        for r in range(a.reps):
            # a system prompt no earlier rep used: prose from paragraph 7r on, ~4 characters a token
            text, k = f"Rep {r}. You answer questions about shoal.", 7 * r
            while len(text) < 4 * a.prefix:
                text += " " + paras[k % len(paras)]
                k += 1
            system = text[:4 * a.prefix]
            row = {"rep": r, "load1_before": os.getloadavg()[0]}
            row["cold"] = srv.ttft(system, f"Question one of rep {r}: what is a worker?")
            row["mem"] = srv.ttft(system, f"Question two of rep {r}: what is the trunk?")
            row["metrics_before_restart"] = srv.metrics()
            srv.stop()
            srv = Server(a.model, a.threads, cdir, log)
            starts.append(srv.start_s)
            row["disk"] = srv.ttft(system, f"Question three of rep {r}: what is a shard?")
            row["metrics_after_disk"] = srv.metrics()
            row["load1_after"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("rep", "cold", "mem", "disk", "load1_before", "load1_after")}),
                  flush=True)
            with open(a.out, "w") as f:
                json.dump({"model": a.model, "prefix_tokens_asked": a.prefix, "threads": a.threads,
                           "server_start_s": starts, "rows": rows}, f, indent=1)
    finally:
        srv.stop()
        subprocess.run(["rm", "-rf", cdir])
    print("log:", log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
