#!/usr/bin/env python3
"""Prefix cache benchmark (issue 32; docs/PERFORMANCE.md "Prefix cache").

1. TTFT of a request whose long system prompt (~N tokens as rendered) was
   sent before with another user turn: cold (no cache server, and the cache
   server's first request, which also captures), warm from memory (the same
   cache server, second request), warm from disk (a new server on the same
   --prefix-cache-dir with --prefix-cache-gb 0: every hit is read from the
   directory and verified). A fresh system prompt per repetition, the
   requests of one repetition back to back on idle servers (only one server
   works at a time), repetitions interleaved. TTFT = the time of a
   max_tokens=1 request as the client sees it (render + prefill + one
   sample + HTTP on loopback).
2. Capture size and time, from the servers' /metrics (bytes, copy seconds,
   write seconds, read seconds).
3. Agent-like replay: U users share one system prompt (with tool
   definitions); each runs T turns, each turn re-sending the whole
   conversation (assistant tool calls and tool results appended). Prefilled
   tokens (shoal_prefilled_tokens_total) without any reuse (--keep 0), with
   kept sequences only (--keep 8, the default), and with kept sequences +
   the prefix cache; the users' turns are interleaved (user 1 turn 1, user 2
   turn 1, ...).

Writes one JSON object (raw timings, metrics deltas, machine, load) to
--out. Usage:
  .venv/bin/python tests/bench/pcache_bench.py --model tests/models/k3-nano \
      --tokens 3500 --reps 5 --out docs/data/pcache_k3nano.json
"""
import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.path.join(SRC, "build", "bin", "shoal")


class Server:
    def __init__(self, model, threads, *args):
        import openai
        self.log = tempfile.TemporaryFile()
        cmd = [BIN, "serve", "--model", model, "--port", "0", "--model-name", "m", "--threads", str(threads),
               "--memo", "0", "--draft", "off", "--max-context", "4096", *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-2000:]!r}")
        self.url = line.strip().split("listening on ")[1]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
            return out

    def ask(self, messages, tools=None, max_tokens=1):
        kw = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
              "extra_body": {"return_token_ids": True}}
        if tools:
            kw["tools"] = tools
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(**kw)
        dt = time.perf_counter() - t0
        c = r.choices[0].model_dump()
        d = r.usage.prompt_tokens_details
        return dt, r.usage.prompt_tokens, (d.cached_tokens if d else 0), c.get("token_ids")

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


WORDS = ("the of and to in is that for it as with was on be by this are or from at which an have not they "
         "file function return value error test build server request token model cache state prefix").split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pdelta(a, b):
    return {k: b[k] - a.get(k, 0) for k in b if "prefix_cache" in k or k in (
        "shoal_prefilled_tokens_total", "shoal_reused_tokens_total", "shoal_prompt_tokens_total")}


def ttft(args, tmp):
    rng = random.Random(1)
    cdir = os.path.join(tmp, "cache")
    nocache = Server(args.model, args.threads, "--keep", "0")
    cache = Server(args.model, args.threads, "--keep", "0", "--prefix-cache-gb", "2", "--prefix-cache-dir", cdir,
                   "--prefix-cache-stride", "0")
    rows = []
    systems = []
    m0 = cache.metrics()
    try:
        for r in range(args.reps):
            S = f"System prompt {r}. " + text(rng, int(args.tokens * 0.95))
            systems.append(S)
            u = [{"role": "user", "content": f"question {k} of rep {r}: " + text(rng, 12)} for k in range(3)]
            sysm = {"role": "system", "content": S}
            if r == 0:  # one warm-up request per server (first-request effects), not recorded
                w = [{"role": "system", "content": "warm up"}, {"role": "user", "content": "hello"}]
                nocache.ask(w)
                cache.ask(w)
            if r % 2 == 0:  # alternate which server goes first
                a = nocache.ask([sysm, u[0]])
                b = cache.ask([sysm, u[0]])
            else:
                b = cache.ask([sysm, u[0]])
                a = nocache.ask([sysm, u[0]])
            c = cache.ask([sysm, u[1]])
            rows.append({"rep": r, "prompt_tokens": a[1], "cold_nocache_s": a[0], "cold_capture_s": b[0],
                         "warm_mem_s": c[0], "warm_mem_cached": c[2], "ids_equal_warm": None,
                         "load1": os.getloadavg()[0]})
            print(f"rep {r}: prompt {a[1]}, cold {a[0]:.3f} s, cold+capture {b[0]:.3f} s, warm mem {c[0]:.3f} s "
                  f"(cached {c[2]})", flush=True)
        m1 = cache.metrics()
    finally:
        nocache.stop()
        cache.stop()
    disk = Server(args.model, args.threads, "--keep", "0", "--prefix-cache-gb", "0", "--prefix-cache-dir", cdir,
                  "--prefix-cache-stride", "0")
    ref = Server(args.model, args.threads, "--keep", "0")
    d0 = disk.metrics()
    try:
        rng2 = random.Random(2)
        for r, S in enumerate(systems):
            u = {"role": "user", "content": f"another question of rep {r}: " + text(rng2, 12)}
            u2 = {"role": "user", "content": f"a last question of rep {r}: " + text(rng2, 12)}
            sysm = {"role": "system", "content": S}
            e = disk.ask([sysm, u], max_tokens=1)  # TTFT: the system prompt's capture read from disk
            c = ref.ask([sysm, u2], max_tokens=4)
            d = disk.ask([sysm, u2], max_tokens=4)  # read from disk again (no memory tier): same ids
            rows[r].update(warm_disk_s=e[0], warm_disk_cached=e[2], disk_ids_equal=c[3] == d[3])
            print(f"rep {r}: warm disk {e[0]:.3f} s (cached {e[2]}), ids equal to no cache: {c[3] == d[3]}",
                  flush=True)
        d1 = disk.metrics()
    finally:
        disk.stop()
        ref.stop()
    files = sorted(os.listdir(cdir))
    sizes = [os.path.getsize(os.path.join(cdir, f)) for f in files]
    return {"rows": rows, "cache_metrics": pdelta(m0, m1), "disk_metrics": pdelta(d0, d1), "files": len(files),
            "file_bytes": sizes}


def replay(args, tmp):
    rng = random.Random(3)
    S = "You are a coding agent. " + text(rng, args.replay_system)
    seed = rng.randrange(1 << 30)
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": text(rng, 40),
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}, "query": {"type": "string"}}}}}
             for k in range(4)]
    out = {}
    for label, extra in (("no_reuse", ["--keep", "0"]), ("kept_only", ["--keep", "8"]),
                         ("kept_and_prefix_cache", ["--keep", "8", "--prefix-cache-gb", "2"])):
        srv = Server(args.model, args.threads, *extra)
        rng = random.Random(seed)  # the same conversations for every configuration
        convs = [[{"role": "system", "content": S}, {"role": "user", "content": f"user {u}: " + text(rng, 20)}]
                 for u in range(args.users)]
        m0 = srv.metrics()
        t0 = time.perf_counter()
        for t in range(args.turns):
            for u in range(args.users):
                srv.ask(convs[u], tools=tools, max_tokens=2)
                call = {"id": f"call_{u}_{t}", "type": "function",
                        "function": {"name": f"tool_{t % 4}", "arguments": json.dumps({"path": f"src/f{u}{t}.c"})}}
                convs[u] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": text(rng, 60)}]
        wall = time.perf_counter() - t0
        m1 = srv.metrics()
        srv.stop()
        d = pdelta(m0, m1)
        out[label] = {"prompt_tokens": d["shoal_prompt_tokens_total"], "prefilled": d["shoal_prefilled_tokens_total"],
                      "reused": d["shoal_reused_tokens_total"], "wall_s": wall, "metrics": d}
        print(f"replay {label}: prompt {d['shoal_prompt_tokens_total']:.0f}, prefilled "
              f"{d['shoal_prefilled_tokens_total']:.0f}, wall {wall:.1f} s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(SRC, "tests", "models", "k3-nano"))
    ap.add_argument("--tokens", type=int, default=3500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--replay-system", type=int, default=600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="shoal-pcbench-")
    commit = subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res = {"command": " ".join(sys.argv), "commit": commit, "machine": platform.processor() or platform.machine(),
           "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
           "nproc": os.cpu_count(), "load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                               time.gmtime())}
    try:
        res["ttft"] = ttft(args, tmp)
        res["replay"] = replay(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_end"] = os.getloadavg()
    rows = res["ttft"]["rows"]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    res["summary"] = {k: med(k) for k in ("cold_nocache_s", "cold_capture_s", "warm_mem_s", "warm_disk_s")}
    res["summary"]["warm_mem_over_cold"] = med("warm_mem_s") / med("cold_nocache_s")
    res["summary"]["warm_disk_over_cold"] = med("warm_disk_s") / med("cold_nocache_s")
    res["summary"]["capture_overhead"] = statistics.median(r["cold_capture_s"] / r["cold_nocache_s"] for r in rows) - 1
    print(json.dumps(res["summary"], indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
