"""Overhead of /v1/messages and /v1/responses against /v1/chat/completions for
the same conversation (issue 31): time to first byte and total, streamed and
not, on `shoal serve --model tests/models/k3-nano --workers 2`, the three
endpoints interleaved request by request (a round = one request to each, in
a rotating order), memo and conversation reuse off so every request prefills
and generates the same tokens. Raw HTTP/1.1 over one keep-alive connection
per endpoint (no SDK in the timing), greedy, thinking off, max tokens N.

Writes a JSON record (commit, command, machine, load, every sample) to the
path given, and prints the summary: per endpoint and mode the median TTFB and
total, and the median over rounds of the per-round ratio to chat with its
interquartile range.

    .venv/bin/python tests/bench/endpoint_overhead.py docs/data/endpoint_overhead_YYYYMMDD.json [rounds]
"""
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.path.join(SRC, "build", "bin", "shoal")
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
Q = "What does json.dumps do?"
N = 32


def bodies(stream):
    chat = {"model": "nano", "messages": [{"role": "user", "content": Q}], "max_tokens": N, "temperature": 0,
            "reasoning_effort": "none", "stream": stream}
    msgs = {"model": "nano", "messages": [{"role": "user", "content": Q}], "max_tokens": N, "temperature": 0,
            "thinking": {"type": "disabled"}, "stream": stream}
    resp = {"model": "nano", "input": Q, "max_output_tokens": N, "temperature": 0, "reasoning": {"effort": "none"},
            "stream": stream}
    return {"chat": ("/v1/chat/completions", chat), "messages": ("/v1/messages", msgs),
            "responses": ("/v1/responses", resp)}


def one(conn, path, body):
    """(ttfb s, total s, bytes): first byte of the response head, last byte of the body"""
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()  # returns once the status line and headers are in
    t1 = time.perf_counter()
    n = len(r.read())
    t2 = time.perf_counter()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status}")
    return t1 - t0, t2 - t0, n


def quart(v):
    q = statistics.quantiles(v, n=4)
    return q[0], q[2]


def main():
    out = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    p = subprocess.Popen([BIN, "serve", "--model", NANO, "--port", "0", "--model-name", "nano", "--threads", "1",
                          "--memo", "0", "--keep", "0", "--workers", "2", "--worker-threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = p.stdout.readline().strip().split("listening on ")[1]
    host, port = url.split("//")[1].split(":")
    conns = {k: http.client.HTTPConnection(host, int(port), timeout=120) for k in ("chat", "messages", "responses")}
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    load0 = os.getloadavg()
    samples = []
    names = ["chat", "messages", "responses"]
    for stream in (False, True):
        b = bodies(stream)
        for k in names:  # warm-up, not recorded
            one(conns[k], *b[k])
        for i in range(rounds):
            order = names[i % 3:] + names[:i % 3]
            for k in order:
                ttfb, total, nb = one(conns[k], *b[k])
                samples.append({"round": i, "stream": stream, "endpoint": k, "ttfb_s": ttfb, "total_s": total,
                                "bytes": nb})
    load1 = os.getloadavg()
    p.terminate()
    p.wait(30)
    summary = {}
    for stream in (False, True):
        mode = "stream" if stream else "full"
        by = {(s["endpoint"], s["round"]): s for s in samples if s["stream"] == stream}
        for k in names:
            row = {}
            for m in ("ttfb_s", "total_s"):
                v = [by[(k, i)][m] for i in range(rounds)]
                ratio = [by[(k, i)][m] / by[("chat", i)][m] for i in range(rounds)]
                row[m] = {"median": statistics.median(v), "iqr": quart(v), "ratio_median": statistics.median(ratio),
                          "ratio_iqr": quart(ratio)}
            summary[f"{mode}/{k}"] = row
    commit = subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    rec = {"what": "endpoint overhead vs /v1/chat/completions, same conversation (issue 31)", "commit": commit,
           "command": " ".join(["tests/bench/endpoint_overhead.py"] + sys.argv[1:]),
           "server": "shoal serve --model tests/models/k3-nano --threads 1 --memo 0 --keep 0 --workers 2 "
                     "--worker-threads 1", "prompt": Q, "max_tokens": N, "rounds": rounds,
           "machine": f"{platform.node()} {cpu}, {os.cpu_count()} cpus", "load_before": load0, "load_after": load1,
           "summary": summary, "samples": samples}
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"commit {commit}, {rounds} rounds, load {load0[0]:.1f} -> {load1[0]:.1f}")
    for key, row in summary.items():
        print(f"{key:20s} ttfb {row['ttfb_s']['median'] * 1e3:7.1f} ms  ratio {row['ttfb_s']['ratio_median']:.3f} "
              f"[{row['ttfb_s']['ratio_iqr'][0]:.3f}, {row['ttfb_s']['ratio_iqr'][1]:.3f}]   "
              f"total {row['total_s']['median'] * 1e3:7.1f} ms  ratio {row['total_s']['ratio_median']:.3f} "
              f"[{row['total_s']['ratio_iqr'][0]:.3f}, {row['total_s']['ratio_iqr'][1]:.3f}]")


if __name__ == "__main__":
    main()
