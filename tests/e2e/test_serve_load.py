"""Bounded loopback load test of `shoal serve` (real engine, tiny-k3):
32 concurrent clients send 200 requests in all (mixed: completions and chat,
streamed and not, short generations), twice: with a queue of 16 (so some are
refused) and with a queue of 64 (none may be refused), both with the default
slots (continuous batching); then 64 concurrent streaming clients, 200
streamed requests, against --slots 8 and a queue of 64 (issue 17). Every request must end
in a complete 200 answer or a clean 429 (queue full) -- none lost, none
malformed -- and the server must be healthy and idle afterwards. Latencies are reported (printed and
written to $SHOAL_BUILD/serve_load.json), not asserted: timing on a shared
machine is evidence, not a pass criterion. Appends PASS/FAIL/SKIP lines to
$SHOAL_TEST_RESULTS."""
import concurrent.futures as cf
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import urllib.request

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
RESULTS = os.environ.get("SHOAL_TEST_RESULTS")
NAME = "test_serve_load"
CLIENTS, REQUESTS, QUEUE = 32, 200, 16
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def record(status, case, why=""):
    counts[status] += 1
    line = f"{status}\t{NAME}\t{case}" + (f": {why}" if why else "")
    print(line.replace("\t", " "), flush=True)
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(line + "\n")


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rnd(x):
    return None if x is None else round(x, 4)


def one(url, i, stream_only=False):
    """Returns (kind, status, seconds, problem or '')."""
    kind = ("completion", "chat", "completion-stream", "chat-stream")[i % 4 if not stream_only else 2 + i % 2]
    stream = kind.endswith("stream")
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 3,
                "temperature": 0, "reasoning_effort": "none"}
    else:
        path = "/v1/completions"
        body = {"model": "tiny", "prompt": [1 + i % 50, 2, 3], "max_tokens": 3, "temperature": 0}
    if stream:
        body["stream"] = True
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            data = r.read()
            dt = time.time() - t0
            if stream:
                events = [e for e in data.split(b"\n\n") if e]
                if not events or events[-1] != b"data: [DONE]":
                    return kind, r.status, dt, "stream without [DONE]"
                finals = [json.loads(e[6:]) for e in events[:-1]]
                if not any(c["choices"] and c["choices"][0].get("finish_reason") for c in finals):
                    return kind, r.status, dt, "stream without finish_reason"
            else:
                obj = json.loads(data)
                if obj["usage"]["completion_tokens"] < 1 or not obj["choices"][0]["finish_reason"]:
                    return kind, r.status, dt, "incomplete answer"
            return kind, r.status, dt, ""
    except urllib.error.HTTPError as e:
        dt = time.time() - t0
        try:
            err = json.loads(e.read())["error"]
        except Exception:
            return kind, e.code, dt, "error without an OpenAI error body"
        if e.code == 429 and err.get("code") == "queue_full":
            return kind, 429, dt, ""
        return kind, e.code, dt, f"unexpected {e.code}: {err.get('message')}"
    except Exception as e:
        return kind, 0, time.time() - t0, f"{type(e).__name__}: {e}"


def phase(name, queue, clients=CLIENTS, slots=None, stream_only=False):
    """One server, `clients` clients, 200 requests. Returns the report dict."""
    extra = ["--slots", str(slots)] if slots else []
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", "0", "--model-name", "tiny", "--threads", "1",
                          "--workers", "2", "--worker-threads", "1", "--queue", str(queue), "--memo", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        record("FAIL", f"{name}_start", line)
        p.kill()
        return None
    url = line.strip().split("listening on ")[1]
    report = None
    try:
        t0 = time.time()
        with cf.ThreadPoolExecutor(clients) as ex:
            res = list(ex.map(lambda i: one(url, i, stream_only), range(REQUESTS)))
        wall = time.time() - t0
        problems = [r for r in res if r[3]]
        ok = [r for r in res if r[1] == 200 and not r[3]]
        refused = [r for r in res if r[1] == 429 and not r[3]]
        if len(res) == REQUESTS and not problems and len(ok) + len(refused) == REQUESTS and ok:
            record("PASS", f"{name}_all_answered_or_429", f"{len(ok)} answered, {len(refused)} refused (429)")
        else:
            record("FAIL", f"{name}_all_answered_or_429", f"{len(ok)} ok, {len(refused)} 429, problems: {problems[:5]}")
        if queue >= clients and refused:
            record("FAIL", f"{name}_no_refusal", f"{len(refused)} refused with a queue of {queue}")
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            h = json.loads(r.read())
        if r.status == 200 and h["ready"] and h["queue"]["queued"] == 0 and h["queue"]["running"] == 0:
            record("PASS", f"{name}_healthy_after")
        else:
            record("FAIL", f"{name}_healthy_after", str(h))
        lat = [r[2] for r in ok]
        rej = [r[2] for r in refused]
        report = {
            "phase": name, "clients": clients, "slots": slots or "default", "streaming_only": stream_only, "requests": REQUESTS, "queue": queue, "answered": len(ok),
            "refused_429": len(refused), "wall_s": round(wall, 3),
            "answered_per_s": round(len(ok) / wall, 2),
            "answered_latency_s": {
                "p50": rnd(pct(lat, 50)), "p90": rnd(pct(lat, 90)), "p99": rnd(pct(lat, 99)),
                "max": round(max(lat), 4) if lat else None},
            "refused_latency_s": {"p50": rnd(pct(rej, 50)), "max": round(max(rej), 4) if rej else None},
            "server": "shoal serve --threads 1 --workers 2 --worker-threads 1 --queue %d --memo 0%s (tiny-k3)" % (
                queue, " --slots %d" % slots if slots else ""),
        }
    except Exception as e:
        traceback.print_exc()
        record("FAIL", name, str(e))
    finally:
        p.terminate()
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = -9
    record("PASS" if rc == 0 else "FAIL", f"{name}_clean_shutdown", f"exit code {rc}")
    return report


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    reports = [phase("small_queue", QUEUE), phase("queue_fits_clients", 2 * CLIENTS),
               phase("slots8_64_streaming", 64, clients=64, slots=8, stream_only=True)]
    out = {
        "phases": [r for r in reports if r],
        "request_mix": "1/4 each: completion, chat (thinking off), streamed completion, streamed chat; "
                       "max_tokens 3, temperature 0",
        "machine": platform.node(), "nproc": os.cpu_count(), "loadavg_1_5_15_at_end": os.getloadavg(),
        "commit": subprocess.run(["git", "-C", SRC, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() or None,
    }
    print(json.dumps(out, indent=1))
    if os.environ.get("SHOAL_BUILD"):
        with open(os.path.join(os.environ["SHOAL_BUILD"], "serve_load.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
