"""Continuous batching in `shoal serve` (issue 17), end to end with the
official `openai` client on tests/models/tiny-k3 (random weights: the checks
are on ids and invariants, never on prose).

identity_*: 16 different requests (completions and chats, prompts of 3 to
~300 tokens, greedy, seeded temperature/top_p and seeded top_k sampling,
streamed and not, different max_tokens) arrive staggered at a server with
--slots 8 and a small --step-tokens (so long prompts are prefilled in chunks
between decode steps); each is also run alone, one after another, on a
server with --slots 1. The reference is that one-at-a-time path (the
scheduler before batching: one sequence, prompt and decode alone). Ids
(`return_token_ids`), text, reasoning, finish reason and usage must be equal,
and the batched server's /metrics must show that sequences really were
decoded together (else the case proves nothing and fails). In process here;
with --workers 2 (the routed experts of the whole batch in one EXPERT_BATCH
per worker per layer) in test_batching_workers.py, which runs this file's
identity case. The batched server keeps conversation reuse and the
memo on: a follow-up turn continues a kept state, a repeated request is
answered from the memo, both equal to the reference.

disconnect: two streams fill --slots 2 and their clients vanish mid-stream;
both slots are freed (canceled counted, nothing running) and the next
requests are served.

state_budget: --slots 8 with a --state-gb that holds three requests' states:
8 concurrent requests all complete (queued for state, never refused or
killed), the waits are counted, ids equal to the one-at-a-time reference, and
the state in use returns to 0.

drafted: --draft ngram with --slots 8 on tests/models/k3-nano (a trained
model, so drafts hit): a request decoding alone drafts and verifies,
requests decoding together settle their drafts and share one batch; ids
equal to one at a time with --draft off, drafting seen in /metrics.

metrics: batch size, per-request queue time, time to first token and
inter-token latency families are exposed with the counts the run implies.
"""
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
WORKERS = os.environ.get("SHOAL_BATCHING_WORKERS") == "1"
rec = harness.Recorder("test_batching_workers" if WORKERS else "test_batching")


class Server:
    def __init__(self, *args, model=MODEL):
        self.log = harness.logfile()
        cmd = [BIN, "serve", "--model", model, "--port", "0", "--model-name", "tiny", "--threads", "1", *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            harness.terminate(self.p)
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-2000:]!r}")
        self.url = line.strip().split("listening on ")[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        import openai
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for l in text.splitlines():
            if l and not l.startswith("#"):
                k, v = l.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self):
        return harness.terminate(self.p, 30)


def requests16():
    """16 different requests: (kind, kwargs)."""
    rng = random.Random(17)
    out = []
    lengths = [3, 200, 17, 120, 40, 7, 180, 60, 90, 5, 150, 33, 100, 11, 75, 160]
    for i, L in enumerate(lengths):
        kw = {"model": "tiny", "max_tokens": 4 + (i * 7) % 24, "extra_body": {"return_token_ids": True}}
        mode = i % 3
        if mode == 0:
            kw["temperature"] = 0
        elif mode == 1:
            kw.update(temperature=0.9, top_p=0.9, seed=1000 + i)
        else:
            kw.update(temperature=0.7, seed=2000 + i)
            kw["extra_body"]["top_k"] = 20
        if i % 4 == 3:
            kw["stream"] = True
        if i % 2 == 0:
            kw["prompt"] = [rng.randrange(1, 4000) for _ in range(L)]
            out.append(("completion", kw))
        else:
            words = " ".join(f"w{rng.randrange(1000)}" for _ in range(max(1, L // 3)))
            kw["messages"] = [{"role": "user", "content": f"request {i}: {words}"}]
            if i % 8 == 1:
                kw["extra_body"]["reasoning_effort"] = "none"
            out.append(("chat", kw))
    return out


def run_one(srv, kind, kw):
    """A comparable summary of one answer: ids, texts, finish, usage."""
    kw = json.loads(json.dumps(kw))
    stream = kw.pop("stream", False)
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    fn = srv.client.chat.completions.create if kind == "chat" else srv.client.completions.create
    if not stream:
        r = fn(**kw)
        c = r.choices[0].model_dump()
        if kind == "chat":
            text, reasoning = c["message"].get("content") or "", c["message"].get("reasoning_content") or ""
        else:
            text, reasoning = c["text"], ""
        return {"ids": c.get("token_ids"), "prompt_ids": c.get("prompt_token_ids"), "text": text,
                "reasoning": reasoning, "finish": c["finish_reason"],
                "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)}
    text, reasoning, ids, pids, finish, usage = "", "", None, None, None, None
    for ch in fn(**kw):
        if ch.usage:
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
        if not ch.choices:
            continue
        c = ch.choices[0].model_dump()
        if kind == "chat":
            d = c.get("delta") or {}
            text += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
        else:
            text += c.get("text") or ""
        if c.get("finish_reason"):
            finish = c["finish_reason"]
        if c.get("token_ids") is not None:
            ids, pids = c["token_ids"], c.get("prompt_token_ids")
    return {"ids": ids, "prompt_ids": pids, "text": text, "reasoning": reasoning, "finish": finish, "usage": usage}


def alone(srv, reqs):
    return [run_one(srv, k, kw) for k, kw in reqs]


def together(srv, reqs, gap):
    """Every request on its own thread, the i-th starting i*gap s after the first."""
    res = [None] * len(reqs)

    def go(i):
        time.sleep(i * gap)
        try:
            res[i] = run_one(srv, *reqs[i])
        except Exception as e:  # recorded as a mismatch below
            res[i] = {"error": f"{type(e).__name__}: {e}"}

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return res


def compare(case, ref, got):
    bad = [i for i in range(len(ref)) if ref[i] != got[i]]
    ok = not bad and all(r["ids"] for r in ref)
    why = ""
    if bad:
        i = bad[0]
        why = f"{len(bad)} differ; first #{i}: alone {ref[i]} vs batched {got[i]}"
    elif not ok:
        why = "an answer carried no token ids"
    return rec.check(case, ok, why)


def identity(label, extra):
    reqs = requests16()
    S1 = Server("--slots", "1", "--memo", "0", *extra)
    S8 = Server("--slots", "8", "--step-tokens", "32", "--keep", "64", *extra)
    try:
        t0 = time.time()
        ref = alone(S1, reqs)
        t1 = time.time()
        got = together(S8, reqs, 0.03)
        print(f"  alone {t1 - t0:.1f} s, batched {time.time() - t1:.1f} s", flush=True)
        compare(f"identity_{label}", ref, got)
        m = S8.metrics()
        steps = m.get("shoal_sched_decode_steps_total", 0)
        seqs = m.get("shoal_sched_decode_sequences_total", 0)
        rec.check(f"identity_{label}_batched", m.get("shoal_sched_batch_size_max", 0) >= 2 and seqs > steps,
                  f"no step decoded two sequences: max {m.get('shoal_sched_batch_size_max')}, {seqs} over {steps}")
        rec.check(f"identity_{label}_prompts_chunked", m.get("shoal_sched_step_prompt_tokens_total", 0) > 0,
                  "no prompt tokens counted by the step loop")
        if label == "inprocess":
            n = len(reqs)
            gen = sum(r["usage"][1] for r in ref)
            rec.check("metrics_request_latencies",
                      m.get("shoal_request_queue_seconds_count", 0) >= n and
                      m.get("shoal_request_ttft_seconds_count", 0) >= n and
                      m.get("shoal_request_inter_token_seconds_count", 0) >= gen - n and
                      "shoal_request_ttft_quantile_seconds{quantile=\"0.5\"}" not in m and
                      m.get("shoal_sched_slots") == 8 and "shoal_sched_batch_size" in m,
                      f"counts: queue {m.get('shoal_request_queue_seconds_count')}, ttft "
                      f"{m.get('shoal_request_ttft_seconds_count')}, itl "
                      f"{m.get('shoal_request_inter_token_seconds_count')} (expected >= {n}, {n}, {gen - n})")
        # conversation reuse: a prompt that extends #0's (its prompt and answer, then more) continues
        # from a kept state
        follow = json.loads(json.dumps(reqs[0][1]))
        follow["prompt"] = ref[0]["prompt_ids"] + ref[0]["ids"] + [5, 6, 7]
        a = run_one(S1, "completion", follow)
        before = S8.metrics().get("shoal_reused_tokens_total", 0)
        b = run_one(S8, "completion", follow)
        reused = S8.metrics().get("shoal_reused_tokens_total", 0) - before
        rec.check(f"reuse_{label}", a == b and reused > 0, f"reused {reused}; alone {a} vs batched server {b}")
        # the memo: a repeat of a deterministic request is answered from it, unchanged
        hits = S8.metrics().get("shoal_memo_hits_total", 0)
        again = run_one(S8, *reqs[0])
        rec.check(f"memo_{label}", again == ref[0] and S8.metrics().get("shoal_memo_hits_total", 0) == hits + 1,
                  f"memo hits {hits} -> {S8.metrics().get('shoal_memo_hits_total')}; {again} vs {ref[0]}")
        h = harness.health(S8.url)[1]
        rec.check(f"identity_{label}_idle_after", h["queue"]["queued"] == 0 and h["queue"]["running"] == 0 and
                  S8.metrics().get("shoal_sched_state_bytes") == 0, f"{h['queue']}")
    finally:
        rc1, rc8 = S1.stop(), S8.stop()
    rec.check(f"identity_{label}_clean_shutdown", rc1 == 0 and rc8 == 0, f"exit codes {rc1} {rc8}")


def t_drafted():
    """Drafting and batching together, on tests/models/k3-nano (trained: it continues text it has
    seen, so the prompt lookup drafts and hits): a slot that decodes alone drafts and verifies,
    slots that decode together settle their drafts and share one batch, in turns as requests join
    and leave. Reference: each request alone, --draft off."""
    lines = ["The list append method adds an item to the end of the list.",
             "The list extend method adds all items of an iterable to the end of the list.",
             "A dictionary maps keys to values.",
             "The with statement calls the exit method of the context manager.",
             "A generator function returns an iterator."]
    reqs = []
    for i in range(8):
        kw = {"model": "tiny", "prompt": (lines[i % 5] + " " + lines[(i + 1) % 5] + " ") * 3,
              "max_tokens": 400 if i == 0 else 20 + 2 * i, "extra_body": {"return_token_ids": True}}
        if i % 2:
            kw.update(temperature=0.8, seed=300 + i)
        else:
            kw["temperature"] = 0
        reqs.append(("completion", kw))
    S1 = Server("--slots", "1", "--memo", "0", "--draft", "off", model=NANO)
    S = Server("--slots", "8", "--memo", "0", "--draft", "ngram", model=NANO)
    try:
        ref = alone(S1, reqs)
        # staggered: #0 decodes alone (drafting) when the next ones join it, and again between them
        got = together(S, reqs, 0.05)
        compare("drafted_identical", ref, got)
        m = S.metrics()
        rec.check("drafted_both_paths", m.get("shoal_draft_accepted_total", 0) > 0 and
                  m.get("shoal_sched_batch_size_max", 0) >= 2,
                  f"accepted {m.get('shoal_draft_accepted_total')}, max batch {m.get('shoal_sched_batch_size_max')}")
        fed, passes, acc = (m.get(k, 0) for k in ("shoal_decode_fed_tokens_total", "shoal_decode_passes_total",
                                                   "shoal_draft_accepted_total"))
        rec.check("drafted_passes_account", fed > 0 and passes + acc == fed, f"fed {fed} passes {passes} accepted {acc}")
    finally:
        rc1, rc = S1.stop(), S.stop()
    rec.check("drafted_clean_shutdown", rc1 == 0 and rc == 0, f"exit codes {rc1} {rc}")


def t_disconnect():
    S = Server("--slots", "2", "--memo", "0")
    try:
        body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0,
                           "stream": True}).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", S.port))
            s.sendall(req)
            socks.append(s)
        for s in socks:  # both are streaming: each holds a slot
            got = b""
            while got.count(b"data: ") < 3:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        m = S.metrics()
        rec.check("disconnect_both_running", m.get("shoal_sched_running") == 2, f"running {m.get('shoal_sched_running')}")
        for s in socks:
            s.close()
        r1 = S.client.completions.create(model="tiny", prompt=[4, 5], max_tokens=3, temperature=0)
        r2 = S.client.completions.create(model="tiny", prompt=[6, 7], max_tokens=3, temperature=0)
        deadline = time.time() + 20
        while time.time() < deadline:
            m = S.metrics()
            if m.get("shoal_sched_canceled_total", 0) >= 2 and m.get("shoal_sched_running") == 0:
                break
            time.sleep(0.1)
        rec.check("disconnect_slots_freed",
                  r1.usage.completion_tokens == 3 and r2.usage.completion_tokens == 3 and
                  m.get("shoal_sched_canceled_total", 0) >= 2 and m.get("shoal_sched_running") == 0 and
                  m.get("shoal_sched_state_bytes") == 0,
                  f"canceled {m.get('shoal_sched_canceled_total')}, running {m.get('shoal_sched_running')}, "
                  f"state {m.get('shoal_sched_state_bytes')}")
    finally:
        rc = S.stop()
    rec.check("disconnect_clean_shutdown", rc == 0, f"exit code {rc}")


def t_state_budget():
    # tiny-k3: 125952 B fixed + 1152 B per token of capacity; --max-context 256 -> one full sequence is
    # 420864 B. Each request below holds 20 + 60 tokens = 218112 B: a budget of two full sequences
    # (841728 B) holds three of them at once, not four.
    # Drafting is off here: its rewind room and verify logits (serve's memory plan line) would add to
    # every sequence.
    budget_gib = 841728 / (1 << 30)
    rng = random.Random(5)
    reqs = [("completion", {"model": "tiny", "prompt": [rng.randrange(1, 4000) for _ in range(20)],
                            "max_tokens": 60, "temperature": 0 if i % 2 else 0.8, "seed": 50 + i,
                            "extra_body": {"return_token_ids": True}}) for i in range(8)]
    S1 = Server("--slots", "1", "--memo", "0", "--max-context", "256", "--draft", "off")
    S = Server("--slots", "8", "--memo", "0", "--max-context", "256", "--draft", "off", "--state-gb",
               repr(budget_gib))
    try:
        ref = alone(S1, reqs)
        got = together(S, reqs, 0)
        compare("state_budget_all_complete_identical", ref, got)
        m = S.metrics()
        rec.check("state_budget_waited", m.get("shoal_sched_state_waits_total", 0) >= 1 and
                  m.get("shoal_sched_refused_total", 0) == 0 and m.get("shoal_sched_failed_total", 0) == 0 and
                  m.get("shoal_sched_completed_total", 0) == 8,
                  f"waits {m.get('shoal_sched_state_waits_total')}, refused {m.get('shoal_sched_refused_total')}, "
                  f"failed {m.get('shoal_sched_failed_total')}, completed {m.get('shoal_sched_completed_total')}")
        rec.check("state_budget_never_over", m.get("shoal_sched_batch_size_max", 9) <= 3 and
                  m.get("shoal_sched_state_bytes") == 0 and m.get("shoal_sched_state_budget_bytes") == int(budget_gib * (1 << 30)),
                  f"max batch {m.get('shoal_sched_batch_size_max')} (3 fit), state now {m.get('shoal_sched_state_bytes')}")
    finally:
        rc1, rc = S1.stop(), S.stop()
    rec.check("state_budget_clean_shutdown", rc1 == 0 and rc == 0, f"exit codes {rc1} {rc}")
    # a budget below one full-context sequence is refused at start, naming the minimum
    p = subprocess.run([BIN, "serve", "--model", MODEL, "--port", "0", "--max-context", "256", "--draft", "off",
                        "--state-gb", "0.0001"],
                       capture_output=True, text=True, timeout=60)
    rec.check("state_budget_too_small_refused", p.returncode == 2 and "--state-gb" in p.stderr and "0.4 MiB" in p.stderr,
              f"rc {p.returncode}: {p.stderr[-300:]}")


def run(case, fn, *a):
    t0 = time.time()
    try:
        fn(*a)
    except Exception as e:
        traceback.print_exc()
        rec.record("FAIL", case, f"{type(e).__name__}: {e}")
    print(f"  {case}: {time.time() - t0:.1f} s", flush=True)


def main():
    if not os.path.exists(BIN):
        rec.record("SKIP", "all", f"{BIN} not built")
        return 77
    try:
        import openai  # noqa: F401
    except ImportError:
        rec.record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    if WORKERS:  # tests/e2e/test_batching_workers.py: the identity case with --workers 2
        run("identity_workers2", identity, "workers2", ["--workers", "2", "--worker-threads", "1"])
    else:
        run("identity_inprocess", identity, "inprocess", [])
        run("drafted", t_drafted)
        run("disconnect", t_disconnect)
        run("state_budget", t_state_budget)
    return 1 if rec.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
