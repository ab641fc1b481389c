#!/usr/bin/env python3
"""Service start of `shoal serve` (issue 35), measured from exec:
- port: the first moment a TCP connect to --port succeeds (/health answers 503
  `starting` until the model is loaded and the workers answer);
- ready: /health answers 200;
- busy: with the port already taken by another socket, the time until serve
  exits (it must refuse before loading anything: exit 4).

Usage: serve_start.py [--model DIR] [--runs N] [--out FILE.json]
Prints a table (ms, median first) and writes the raw runs with the load average.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

SRC = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
from harness import free_port  # noqa: E402


def health(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def one_start(model, deadline_s=60.0):
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.Popen([BIN, "serve", "--model", model, "--threads", "1", "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_port = t_ready = None
    try:
        while time.monotonic() - t0 < deadline_s and p.poll() is None:
            if t_port is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    t_port = time.monotonic() - t0
                except OSError:
                    time.sleep(0.001)
                    continue
            if health(port) == 200:
                t_ready = time.monotonic() - t0
                break
            time.sleep(0.001)
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if t_port is None or t_ready is None:
        raise RuntimeError(f"serve did not become ready within {deadline_s} s (rc {p.returncode})")
    return t_port * 1e3, t_ready * 1e3


def one_busy(model):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    t0 = time.monotonic()
    try:
        r = subprocess.run([BIN, "serve", "--model", model, "--threads", "1", "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    finally:
        s.close()
    if r.returncode != 4:
        raise RuntimeError(f"a busy port gave exit {r.returncode}, not 4")
    return (time.monotonic() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(SRC, "tests", "models", "tiny-k3"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = {"port": [], "ready": [], "busy": []}
    for _ in range(a.runs):  # interleaved: one of each per round
        tp, tr = one_start(a.model)
        rows["port"].append(tp)
        rows["ready"].append(tr)
        rows["busy"].append(one_busy(a.model))
    load = os.getloadavg()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu {cpu}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; model {a.model}; {a.runs} runs (ms)")
    for k, label in (("port", "port accepting"), ("ready", "ready (/health 200)"), ("busy", "busy port refused")):
        v = rows[k]
        print(f"{label:22s} median {statistics.median(v):7.1f}  runs {', '.join(f'{x:.1f}' for x in v)}")
    if a.out:
        json.dump({"cpu": cpu, "loadavg": load, "model": a.model, "runs_ms": rows,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
