"""Chat Completions and Completions fields (issue 31), end to end with the official
`openai` Python SDK on the trained tests/models/k3-nano.

Two servers for the whole file:
  R  the reference path: --slots 1 --draft off, experts in process, no memo, no reuse;
  S  --slots 8 --workers 2 (routed experts on two local expert servers), --draft ngram,
     no memo, no reuse (so a prompt state shared between choices can only come from the
     fork of `n`).

Cases (expected values never come from shoal's own code):
  logprobs_*     chat and completions log-probabilities equal the log-softmax (numpy,
                 float64 over the float32 row) of the rows `shoal run --dump-logits`
                 writes for the same prompt, to 1e-5, and its top alternatives; a stream
                 carries the same entries;
  penalties_*    greedy decoding with presence / frequency / repetition penalties and
                 logit_bias equals a reference written here from the documented formulas,
                 applied to raw logits rows of `shoal run --dump-logits` (teacher forced:
                 one run per step on the prompt and the reference's ids so far);
  min_p_one      min_p = 1 at temperature 1 is greedy;
  n_*            n = 4 with a seed gives, per choice, the ids of a single request with
                 seed + i (streamed and not); the prompt is prefilled once (reused tokens
                 on a server without conversation reuse);
  thinking_*     chat_template_kwargs.thinking = false renders the ids of
                 reasoning_effort "none"; thinking_effort = reasoning_effort;
  partial_*      Moonshot's partial mode renders the ids of the Python reference renderer
                 (tools/k3_oracle.py, continue_final: vLLM's continue_final_message);
  policy_*       ignored fields listed in x-shoal-ignored and counted in /metrics;
                 output-changing fields not implemented refused naming them;
  determinism    requests with penalties, logprobs, n and seeds, concurrently on S
                 (batched, drafting, two workers) give the ids and log-probabilities they
                 give alone on R.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
sys.path.insert(0, os.path.join(SRC, "tools"))
import k3_oracle  # noqa: E402

rec = harness.Recorder("test_api_fields")
TMP = tempfile.mkdtemp(prefix="shoal-api-fields-")
PROMPT = ("The list append method adds an item to the end of the list. "
          "The list extend method adds all items of an iterable to the end of the list. The list")


class Server(harness.Serve):
    def __init__(self, *args):
        super().__init__([BIN, "serve", "--model", NANO, "--port", "0", "--model-name", "nano", "--threads", "1",
                          "--memo", "0", "--keep", "0", *args], strict=True)
        self.client = self.openai()


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def case(name, fn, *a):
    t0 = time.time()
    try:
        fn(*a)
        rec.record("PASS", name, f"{time.time() - t0:.1f} s")
    except Exception as e:
        traceback.print_exc()
        rec.record("FAIL", name, f"{type(e).__name__}: {str(e)[:400]}")


# ---- the independent references -------------------------------------------

_rows_cache = {}


def dump_rows(ids, gen):
    """(generated ids, float32 logits rows [gen, vocab]) of `shoal run --dump-logits` on ids."""
    key = (tuple(ids), gen)
    if key in _rows_cache:
        return _rows_cache[key]
    out = os.path.join(TMP, "rows.bin")
    r = subprocess.run([BIN, "run", "--model", NANO, "--ids", ",".join(map(str, ids)), "--gen", str(gen),
                        "--draft", "off", "--threads", "1", "--json", "--dump-logits", out],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, f"shoal run failed: {r.stderr[-500:]}")
    got = json.loads(r.stdout)["generated_ids"]
    rows = np.fromfile(out, dtype="<f4").reshape(len(got), -1)
    _rows_cache[key] = (got, rows)
    return got, rows


def log_softmax(row):
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_k(row, k):
    """ids of the k largest, larger first, ties to the lower id"""
    order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))
    return order[:k]


# ---- cases ----------------------------------------------------------------------


def t_logprobs_completions(R):
    r = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=5,
                                    extra_body={"return_token_ids": True})
    c = r.choices[0]
    d = c.model_dump()
    ids, pids = d["token_ids"], d["prompt_token_ids"]
    got, rows = dump_rows(pids, len(ids))
    check(got[:len(ids)] == ids, f"greedy ids differ from shoal run: {ids} vs {got}")
    lp = c.logprobs
    check(len(lp.token_logprobs) == len(ids) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset),
          "one entry per generated id")
    worst = 0.0
    for i, tid in enumerate(ids):
        ref = log_softmax(rows[i])
        worst = max(worst, abs(lp.token_logprobs[i] - ref[tid]))
        want = sorted((ref[j] for j in top_k(rows[i], 5)), reverse=True)
        have = sorted(lp.top_logprobs[i].values(), reverse=True)
        # alternatives are keyed by token text: distinct texts, so 5 entries
        check(len(have) == 5 and max(abs(a - b) for a, b in zip(have, want)) < 1e-5,
              f"token {i}: top {have} vs {want}")
    check(worst < 1e-5, f"largest logprob error {worst}")
    check(lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:])),
          f"text_offset {lp.text_offset}")


def t_logprobs_chat(R):
    kw = dict(model="nano", messages=[{"role": "user", "content": "What does the list append method do?"}],
              max_tokens=14, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"return_token_ids": True, "reasoning_effort": "none"})
    r = R.client.chat.completions.create(**kw)
    d = r.choices[0].model_dump()
    ids, pids = d["token_ids"], d["prompt_token_ids"]
    got, rows = dump_rows(pids, len(ids))
    check(got[:len(ids)] == ids, f"greedy ids differ from shoal run: {ids} vs {got}")
    entries = r.choices[0].logprobs.content
    check(len(entries) == len(ids), f"{len(entries)} entries for {len(ids)} ids")
    tok = k3_oracle.KimiTokenizer(NANO)
    for i, (e, tid) in enumerate(zip(entries, ids)):
        ref = log_softmax(rows[i])
        check(abs(e.logprob - ref[tid]) < 1e-5, f"token {i}: {e.logprob} vs {ref[tid]}")
        tops = top_k(rows[i], 3)
        check([abs(t.logprob - ref[j]) < 1e-5 for t, j in zip(e.top_logprobs, tops)] == [True] * 3,
              f"token {i}: top {[t.logprob for t in e.top_logprobs]} vs {[ref[j] for j in tops]}")
        check(bytes(e.bytes) == tok.enc.decode_single_token_bytes(tid), f"token {i}: bytes {e.bytes}")
    # streamed: the chunks carry the same entries, in order
    s = R.client.chat.completions.create(stream=True, **kw)
    streamed = []
    for ch in s:
        for c in ch.choices:
            if c.logprobs and c.logprobs.content:
                streamed += [(x.token, x.logprob, [t.logprob for t in x.top_logprobs]) for x in c.logprobs.content]
    want = [(x.token, x.logprob, [t.logprob for t in x.top_logprobs]) for x in entries]
    check(streamed == want, f"streamed logprobs differ: {streamed[:3]} vs {want[:3]}")


def penalised(row, prompt, gen, rep, freq, pres, bias):
    """sampler.h a-c (docs/API.md), written from the formulas: float32 like the row."""
    a = row.astype(np.float32).copy()
    for j, b in bias.items():
        a[j] += np.float32(b)
    seen = set(prompt) | set(gen)
    for j in seen:
        c = gen.count(j)
        if rep != 1.0:
            a[j] = a[j] / np.float32(rep) if a[j] > 0 else a[j] * np.float32(rep)
        if c:
            a[j] -= np.float32(c) * np.float32(freq) + np.float32(pres)
    return int(np.argmax(a))  # ties: numpy's argmax takes the first, the lowest id


def t_penalties(R):
    n = 16
    plain = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=n, temperature=0,
                                        extra_body={"return_token_ids": True}).choices[0].model_dump()
    pids = plain["prompt_token_ids"]
    # the model is confident (top log-probabilities near 0, the next ~-7): strong penalties
    configs = [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
               dict(repetition_penalty=4.0), dict(presence_penalty=0.5, frequency_penalty=0.4,
                                                  repetition_penalty=1.3, bias={plain["token_ids"][1]: -9.5, 42: 1.0})]
    changed = 0
    for cfg in configs:
        cfg = dict(cfg)
        bias = cfg.pop("bias", {})
        extra = {"return_token_ids": True}
        if "repetition_penalty" in cfg:
            extra["repetition_penalty"] = cfg.pop("repetition_penalty")
        r = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=n, temperature=0,
                                        logit_bias={str(k): v for k, v in bias.items()} or None,
                                        extra_body=extra, **cfg)
        ids = r.choices[0].model_dump()["token_ids"]
        ref = []
        for t in range(len(ids)):
            _, rows = dump_rows(pids + ref, 1)
            ref.append(penalised(rows[0], pids, ref, extra.get("repetition_penalty", 1.0),
                                 cfg.get("frequency_penalty", 0.0), cfg.get("presence_penalty", 0.0), bias))
        check(ids == ref, f"{cfg} {extra} bias {bias}: {ids} vs reference {ref}")
        changed += ids != plain["token_ids"][:len(ids)]
    check(changed >= 3, f"only {changed} of {len(configs)} configurations changed the greedy ids")


def t_min_p_one(R):
    g = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    s = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3,
                                    extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    m = R.client.completions.create(model="nano", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3,
                                    extra_body={"return_token_ids": True, "min_p": 1.0}).choices[0].model_dump()
    check(m["token_ids"] == g, f"min_p 1: {m['token_ids']} vs greedy {g}")
    check(s != g, "temperature 1.5 alone gave the greedy ids: the case proves nothing")


def ids_of(choice):
    return choice.model_dump()["token_ids"]


def t_n_choices(S, R):
    msgs = [{"role": "user", "content": "What does the list extend method do?"}]
    kw = dict(model="nano", messages=msgs, max_tokens=16, temperature=0.9, top_p=0.95,
              extra_body={"return_token_ids": True})
    before = S.metrics().get("shoal_reused_tokens_total", 0)
    r = S.client.chat.completions.create(n=4, seed=11, **kw)
    reused = S.metrics().get("shoal_reused_tokens_total", 0) - before
    check([c.index for c in r.choices] == [0, 1, 2, 3], f"indices {[c.index for c in r.choices]}")
    singles = [ids_of(R.client.chat.completions.create(seed=11 + i, **kw).choices[0]) for i in range(4)]
    got = [ids_of(c) for c in r.choices]
    check(got == singles, f"n=4 vs singles with seed+i: {got} vs {singles}")
    check(len({tuple(x) for x in got}) > 1, "the four choices are all equal: seeds not derived")
    check(reused >= 3 * r.usage.prompt_tokens, f"the prompt was not shared: {reused} reused tokens for "
                                                 f"{r.usage.prompt_tokens} prompt tokens")
    check(r.usage.completion_tokens == sum(len(x) for x in got), "usage sums the choices")
    # completions, streamed, n = 3
    ck = dict(model="nano", prompt=PROMPT, max_tokens=10, temperature=1.0, logprobs=2,
              extra_body={"return_token_ids": True})
    texts, ids, lps = ["", "", ""], [None] * 3, [[], [], []]
    for ch in S.client.completions.create(n=3, seed=5, stream=True, **ck):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.logprobs:
                lps[c.index] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
            d = c.model_dump()
            if d.get("token_ids") is not None:
                ids[c.index] = d["token_ids"]
    for i in range(3):
        one = R.client.completions.create(seed=5 + i, **ck).choices[0]
        check(ids[i] == ids_of(one) and texts[i] == one.text, f"choice {i}: {ids[i]} {texts[i]!r} vs "
                                                               f"{ids_of(one)} {one.text!r}")
        want = list(zip(one.logprobs.tokens, one.logprobs.token_logprobs))
        check(lps[i] == want and len(want) == len(ids[i]), f"choice {i} streamed logprobs {lps[i][:3]} vs {want[:3]}")


def prompt_ids(srv, **kw):
    r = srv.client.chat.completions.create(model="nano", max_tokens=1, temperature=0,
                                           extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
    return r.choices[0].model_dump()["prompt_token_ids"]


def t_thinking_switches(R):
    msgs = [{"role": "user", "content": "Hello"}]
    off_kwargs = prompt_ids(R, messages=msgs, extra={"chat_template_kwargs": {"thinking": False}})
    off_effort = prompt_ids(R, messages=msgs, extra={"reasoning_effort": "none"})
    on = prompt_ids(R, messages=msgs)
    check(off_kwargs == off_effort, f"chat_template_kwargs.thinking=false {off_kwargs} vs effort none {off_effort}")
    check(off_kwargs != on, "thinking off renders like thinking on")
    tok = k3_oracle.KimiTokenizer(NANO)
    check(off_kwargs == k3_oracle.xtml_encode(tok, msgs, thinking=False), "thinking off vs the reference")
    hi1 = prompt_ids(R, messages=msgs, extra={"thinking_effort": "high"})
    hi2 = prompt_ids(R, messages=msgs, extra={"chat_template_kwargs": {"thinking_effort": "high"}})
    hi3 = prompt_ids(R, messages=msgs, extra={"reasoning_effort": "high"})
    check(hi1 == hi2 == hi3 and hi1 != on, "thinking_effort high (top level, kwargs) = reasoning_effort high")


def t_partial(R):
    tok = k3_oracle.KimiTokenizer(NANO)
    msgs = [{"role": "user", "content": "What does the list append method do?"},
            {"role": "assistant", "content": "The list append method", "partial": True}]
    for thinking in (True, False):
        extra = {} if thinking else {"chat_template_kwargs": {"thinking": False}}
        r = R.client.chat.completions.create(model="nano", messages=msgs, max_tokens=12, temperature=0,
                                             extra_body={"return_token_ids": True, **extra})
        d = r.choices[0].model_dump()
        want = k3_oracle.xtml_encode(tok, [{k: v for k, v in m.items() if k != "partial"} for m in msgs],
                                     thinking=thinking, continue_final=True)
        check(d["prompt_token_ids"] == want, f"thinking {thinking}: {d['prompt_token_ids']} vs reference {want}")
        check(not d["message"].get("reasoning_content") and d["message"]["content"],
              f"the continuation is content: {d['message']}")
    # DeepSeek's "prefix": true is the same switch
    m2 = [msgs[0], {"role": "assistant", "content": "The list append method", "prefix": True}]
    a = prompt_ids(R, messages=msgs)
    b = prompt_ids(R, messages=m2)
    check(a == b, "prefix: true renders like partial: true")


def t_policy(S):
    raw = S.client.chat.completions.with_raw_response.create(
        model="nano", messages=[{"role": "user", "content": "Hi", "cache_control": {"type": "ephemeral"}}],
        max_tokens=2, temperature=0, store=True,
        extra_body={"cache_prompt": True, "frobnicate": 1, "ignore_eos": False, "top_k": -1})
    ign = raw.headers.get("x-shoal-ignored")
    check(ign == "store,cache_prompt,frobnicate,ignore_eos,messages[].cache_control", f"x-shoal-ignored {ign!r}")
    raw.parse()
    m = S.metrics()
    for f in ("store", "cache_prompt", "ignore_eos", "messages[].cache_control", "other"):
        check(m.get(f'shoal_api_ignored_fields_total{{field="{f}"}}', 0) >= 1, f"metric for {f}: {m.get(f)}")
    check('shoal_api_ignored_fields_total{field="frobnicate"}' not in m, "an unknown field got its own label")
    import openai
    for extra, param in [({"structured_outputs": {"json": {}}}, "structured_outputs"), ({"grammar": "root ::= x"}, "grammar"),
                         ({"ignore_eos": True}, "ignore_eos"), ({"n": 9}, "n"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        try:
            S.client.chat.completions.create(model="nano", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             extra_body=extra)
            raise AssertionError(f"{extra} accepted")
        except openai.BadRequestError as e:
            check(e.body and e.body.get("param") == param, f"{extra}: {e.body}")


def summary(srv, kind, kw):
    """ids and log-probabilities of every choice of one request"""
    kw = json.loads(json.dumps(kw))
    fn = srv.client.chat.completions.create if kind == "chat" else srv.client.completions.create
    r = fn(**kw)
    out = []
    for c in r.choices:
        d = c.model_dump()
        lp = d.get("logprobs")
        if lp and kind == "chat":
            lp = [(x["token"], x["logprob"], [t["logprob"] for t in x["top_logprobs"]]) for x in lp["content"]]
        elif lp:
            lp = (lp["tokens"], lp["token_logprobs"])
        out.append((d["token_ids"], lp, d["finish_reason"]))
    return out


def t_determinism(S, R):
    base = {"return_token_ids": True}
    reqs = [
        ("completion", dict(model="nano", prompt=PROMPT, max_tokens=40, temperature=0, presence_penalty=0.6,
                            frequency_penalty=0.3, logprobs=3, extra_body={**base, "repetition_penalty": 1.2})),
        ("completion", dict(model="nano", prompt=PROMPT, max_tokens=30, temperature=0.8, seed=21, n=3, logprobs=2,
                            extra_body={**base, "min_p": 0.05, "top_k": 40})),
        ("chat", dict(model="nano", messages=[{"role": "user", "content": "What does the list append method do?"}],
                      max_tokens=30, temperature=0.7, seed=9, n=2, logprobs=True, top_logprobs=2,
                      frequency_penalty=0.5, extra_body={**base, "reasoning_effort": "none"})),
        ("chat", dict(model="nano", messages=[{"role": "user", "content": "A dictionary maps keys to values. Why?"}],
                      max_tokens=25, temperature=0, logit_bias={"42": 5}, presence_penalty=1.0,
                      extra_body={**base, "repetition_penalty": 1.1})),
        ("completion", dict(model="nano", prompt="A generator function returns an iterator. " * 3, max_tokens=40,
                            temperature=0.9, seed=4, presence_penalty=-0.5, extra_body=base)),
    ]
    ref = [summary(R, k, kw) for k, kw in reqs]
    got = [None] * len(reqs)

    def go(i):
        time.sleep(0.05 * i)
        try:
            got[i] = summary(S, *reqs[i])
        except Exception as e:
            got[i] = f"{type(e).__name__}: {e}"

    before = S.metrics()
    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    bad = [i for i in range(len(reqs)) if got[i] != ref[i]]
    check(not bad, f"{len(bad)} differ; first #{bad[0] if bad else 0}: "
                   f"{str(got[bad[0]])[:300] if bad else ''} vs {str(ref[bad[0]])[:300] if bad else ''}")
    m = S.metrics()
    check(m.get("shoal_sched_batch_size_max", 0) >= 2, "no step decoded two sequences")
    # alone on S, a request drafts (the scheduler drafts for a slot decoding alone); the
    # repetitive prompt makes the drafts hit, whatever the machine's load
    for i in (4, 5):
        if i == 5:
            reqs.append(("completion", dict(model="nano", prompt="A generator function returns an iterator. " * 3,
                                            max_tokens=30, temperature=0, logprobs=2, presence_penalty=-0.2,
                                            extra_body=base)))
            ref.append(summary(R, *reqs[5]))
        alone = summary(S, *reqs[i])
        check(alone == ref[i], f"#{i} alone on S (drafting): {str(alone)[:300]} vs {str(ref[i])[:300]}")
    check(S.metrics().get("shoal_draft_accepted_total", 0) > before.get("shoal_draft_accepted_total", 0),
          "no drafted token was accepted: the drafting path was not exercised")


def main():
    R = Server("--slots", "1", "--draft", "off")
    S = Server("--slots", "8", "--workers", "2", "--worker-threads", "1", "--draft", "ngram")
    try:
        case("logprobs_completions", t_logprobs_completions, R)
        case("logprobs_chat", t_logprobs_chat, R)
        case("penalties_reference", t_penalties, R)
        case("min_p_one", t_min_p_one, R)
        case("n_choices", t_n_choices, S, R)
        case("thinking_switches", t_thinking_switches, R)
        case("partial_mode", t_partial, R)
        case("policy", t_policy, S)
        case("determinism_batched_drafted", t_determinism, S, R)
    finally:
        rr, rs = R.stop(), S.stop()
    rec.check("clean_shutdown", rr == 0 and rs == 0, f"exit codes {rr} {rs}")
    sys.exit(1 if rec.counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
