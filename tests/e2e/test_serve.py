"""`shoal serve` end to end with the official `openai` Python client.

Runs the real engine on tests/models/tiny-k3 (random weights: its text is
gibberish, so the checks are on protocol shapes and invariants, never on
prose), with the routed experts on two local expert servers (--workers 2,
ZeroMQ over ipc://). Each case appends PASS/FAIL/SKIP lines to
$SHOAL_TEST_RESULTS.

Servers: A (memo off, reuse on), B (memo on, reuse off, API key), both with
two workers. Comparing A and B gives the conversation-reuse identity check;
B gives the memo and authentication checks. C (two workers, one of which the
test kills) gives the worker-down checks.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
RESULTS = os.environ.get("SHOAL_TEST_RESULTS")
NAME = "test_serve"
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def record(status, case, why=""):
    counts[status] += 1
    line = f"{status}\t{NAME}\t{case}" + (f": {why}" if why else "")
    print(line.replace("\t", " "), flush=True)
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(line + "\n")


class Server:
    def __init__(self, *args, key=None):
        cmd = [BIN, "serve", "--model", MODEL, "--port", "0", "--model-name", "tiny", "--threads", "1",
               "--workers", "2", "--worker-threads", "1", *args]
        if key:
            cmd += ["--api-key", key]
        self.key = key
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"shoal-serve-{os.getpid()}-{id(self)}.log"), "w+")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            self.p.kill()
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-2000:]}")
        self.url = line.strip().split("listening on ")[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.1)
        import openai
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=key or "unused", max_retries=0, timeout=120)

    def metrics(self):
        return harness.metrics(self.url, self.key)

    def stop(self):
        self.p.terminate()
        try:
            rc = self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = -9
        self.log.close()
        return rc


def user(text):
    return [{"role": "user", "content": text}]


def run(case, fn, *a):
    t0 = time.time()
    try:
        fn(*a)
        record("PASS", case, f"{time.time() - t0:.1f} s")
    except Exception as e:  # a failed check or an unexpected exception
        traceback.print_exc()
        record("FAIL", case, f"{type(e).__name__}: {str(e)[:300]}")


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def usage_ok(u, max_completion):
    check(u.prompt_tokens > 0, f"prompt_tokens {u.prompt_tokens}")
    check(0 < u.completion_tokens <= max_completion, f"completion_tokens {u.completion_tokens}")
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens, "total_tokens is the sum")


# ---- cases ------------------------------------------------------------------


def t_models(A):
    ms = A.client.models.list()
    ids = [m.id for m in ms.data]
    check(ids == ["tiny"], f"models {ids}")
    check(A.client.models.retrieve("tiny").id == "tiny", "retrieve")


def t_chat_full_thinking(A):
    r = A.client.chat.completions.create(model="tiny", messages=user("hello there"), max_tokens=12, temperature=0)
    check(r.object == "chat.completion" and r.id.startswith("chatcmpl-"), "envelope")
    c = r.choices[0]
    check(len(r.choices) == 1 and c.index == 0, "one choice")
    check(c.message.role == "assistant", "role")
    check(c.finish_reason in ("stop", "length", "tool_calls"), f"finish_reason {c.finish_reason}")
    usage_ok(r.usage, 12)
    # thinking on (the default): the model writes inside <think> first, so its
    # text is reasoning until it closes the think element
    rc = getattr(c.message, "reasoning_content", None)
    check(isinstance(rc, str) and rc, f"reasoning_content {rc!r}")
    check(r.usage.completion_tokens_details.reasoning_tokens > 0, "reasoning_tokens counted")


def t_chat_full_no_thinking(A):
    for extra in ({"reasoning_effort": "none"}, {"extra_body": {"thinking": {"type": "disabled"}}}):
        r = A.client.chat.completions.create(model="tiny", messages=user("hello without thinking"), max_tokens=10,
                                             temperature=0, **extra)
        m = r.choices[0].message
        check(getattr(m, "reasoning_content", None) in (None, ""), f"no reasoning with {extra}: {m}")
        check(isinstance(m.content, str) and m.content, f"content {m.content!r}")
        check(r.usage.completion_tokens_details.reasoning_tokens == 0, "no reasoning tokens")


def stream_collect(stream):
    chunks = list(stream)
    return chunks


def t_chat_stream(A):
    for thinking in (True, False):
        kw = {} if thinking else {"reasoning_effort": "none"}
        msgs = user(f"stream me {'with' if thinking else 'without'} thinking")
        s = A.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, **kw)
        chunks = stream_collect(s)
        check(len(chunks) >= 3, f"{len(chunks)} chunks")
        first = chunks[0]
        check(first.choices[0].delta.role == "assistant", "first chunk carries the role")
        check(len({c.id for c in chunks}) == 1, "one id for every chunk")
        check(all(c.object == "chat.completion.chunk" for c in chunks), "chunk object")
        reasoning, content, finish = "", "", []
        for c in chunks[:-1]:
            check(c.usage is None, "usage only in the last chunk")
            d = c.choices[0].delta
            rc = getattr(d, "reasoning_content", None)
            check(not (rc and d.content), "a delta is reasoning or content, never both")
            reasoning += rc or ""
            content += d.content or ""
            if c.choices[0].finish_reason:
                finish.append(c.choices[0].finish_reason)
        check(len(finish) == 1, f"exactly one finish_reason: {finish}")
        last = chunks[-1]
        check(last.choices == [] and last.usage is not None, "usage chunk last, no choices")
        usage_ok(last.usage, 12)
        if thinking:
            check(reasoning and last.usage.completion_tokens_details.reasoning_tokens > 0, "reasoning streamed")
        else:
            check(not reasoning and content, "content only")
        # the same request unstreamed (server A has no memo: generated again) gives the same text
        r = A.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, **kw)
        m = r.choices[0].message
        check((getattr(m, "reasoning_content", None) or "") == reasoning, "streamed reasoning == full reasoning")
        check((m.content or "") == content, "streamed content == full content")
        check(r.choices[0].finish_reason == finish[0], "same finish_reason")
        check(r.usage.completion_tokens == last.usage.completion_tokens, "same usage")


def t_stream_utf8_and_done(A):
    """Raw SSE: every event is a complete JSON line, the stream ends with [DONE],
    and each delta decodes as UTF-8 on its own (no split code points)."""
    body = json.dumps({"model": "tiny", "messages": user("utf8 héllo 🦉"), "max_tokens": 40, "temperature": 0.9,
                       "seed": 11, "stream": True}).encode()
    req = urllib.request.Request(A.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        check(r.headers["Content-Type"].startswith("text/event-stream"), "content type")
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    check(events[-1] == b"data: [DONE]", f"ends with [DONE]: {events[-1][:80]!r}")
    for e in events[:-1]:
        check(e.startswith(b"data: "), "data lines")
        obj = json.loads(e[6:].decode("utf-8"))  # strict: raises on a split sequence
        for ch in obj["choices"]:
            for k in ("content", "reasoning_content"):
                v = ch["delta"].get(k)
                if v:
                    v.encode("utf-8")


def t_completions(A):
    r = A.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    check(r.object == "text_completion" and r.id.startswith("cmpl-"), "envelope")
    check(isinstance(r.choices[0].text, str), "text")
    check(r.choices[0].finish_reason in ("stop", "length"), "finish_reason")
    usage_ok(r.usage, 6)
    # prompt as token ids, and the shoal extension that returns ids
    ids = [5, 17, 300, 42]
    r2 = A.client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                     extra_body={"return_token_ids": True})
    ch = r2.choices[0].model_dump()
    check(ch["prompt_token_ids"] == ids, f"prompt ids echoed {ch.get('prompt_token_ids')}")
    check(len(ch["token_ids"]) == r2.usage.completion_tokens, "one id per completion token")
    check(r2.usage.prompt_tokens == len(ids), "prompt_tokens == len(ids)")
    # default max_tokens is 16 (OpenAI's default for completions)
    r3 = A.client.completions.create(model="tiny", prompt=[7, 8, 9], temperature=0)
    check(r3.usage.completion_tokens <= 16, "default max_tokens 16")
    # streamed completion == full completion
    s = list(A.client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in s if c.choices)
    check(text == r2.choices[0].text, "streamed text == full text")
    check(s[-1].usage.completion_tokens == r2.usage.completion_tokens, "usage in the stream")


def t_stop_strings(A):
    base = A.client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=30, temperature=0)
    text = base.choices[0].text
    check(len(text) >= 6, f"need some text to cut: {text!r}")
    # a stop string taken from the middle of the unconstrained output
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    first = text.find(stop)
    r = A.client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=30, temperature=0, stop=[stop])
    check(r.choices[0].text == text[:first], f"text cut before the stop string: {r.choices[0].text!r} vs {text[:first]!r}")
    check(r.choices[0].finish_reason == "stop", "finish_reason stop")
    # streamed: the held-back text never leaks the stop string
    s = list(A.client.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=30, temperature=0,
                                         stop=stop, stream=True))
    check("".join(c.choices[0].text for c in s if c.choices) == text[:first], "streamed cut")
    # chat: the stop string applies to reasoning and content
    full = A.client.chat.completions.create(model="tiny", messages=user("stop test"), max_tokens=20, temperature=0)
    rtext = full.choices[0].message.reasoning_content or ""
    if len(rtext) >= 6:
        stop2 = rtext[len(rtext) // 2:len(rtext) // 2 + 2]
        r2 = A.client.chat.completions.create(model="tiny", messages=user("stop test"), max_tokens=20, temperature=0,
                                              stop=stop2)
        check((r2.choices[0].message.reasoning_content or "") == rtext[:rtext.find(stop2)], "chat reasoning cut")
        check(r2.choices[0].finish_reason == "stop", "chat finish stop")


def t_sampling_seed(A):
    kw = dict(model="tiny", prompt=[3, 4, 5], max_tokens=12, temperature=1.0, top_p=0.9,
              extra_body={"return_token_ids": True})
    a = A.client.completions.create(seed=7, **kw).choices[0].model_dump()["token_ids"]
    b = A.client.completions.create(seed=7, **kw).choices[0].model_dump()["token_ids"]
    c = A.client.completions.create(seed=8, **kw).choices[0].model_dump()["token_ids"]
    check(a == b, "same seed, same ids")
    check(a != c, "another seed, other ids (12 sampled tokens)")
    g1 = A.client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    g2 = A.client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=8, temperature=0, seed=99,
                                     extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    check(g1 == g2, "greedy ignores the seed")


def t_tool_round_trip(A):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = user("What is the weather in Paris?")
    r = A.client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=8, temperature=0)
    c = r.choices[0]
    check(c.finish_reason in ("stop", "length", "tool_calls"), "finish_reason")
    for tc in c.message.tool_calls or []:  # the random model rarely writes a call; if it does, it is well formed
        check(tc.type == "function" and tc.id and tc.function.name, "tool call shape")
        json.loads(tc.function.arguments)
    # declarations are part of the prompt
    bare = A.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    check(r.usage.prompt_tokens > bare.usage.prompt_tokens + 20, "tool declarations rendered into the prompt")
    # the client sends the call and its result back: accepted, rendered, answered
    msgs2 = msgs + [
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 21})},
    ]
    r2 = A.client.chat.completions.create(model="tiny", messages=msgs2, tools=tools, max_tokens=8, temperature=0)
    check(r2.choices[0].message.role == "assistant", "answer after the tool result")
    check(r2.usage.prompt_tokens > r.usage.prompt_tokens, "the call and the result are in the prompt")
    # tool_choice "required" adds the tool-choice message; a named function must be declared
    r3 = A.client.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice="required",
                                          max_tokens=2, temperature=0)
    check(r3.usage.prompt_tokens > r.usage.prompt_tokens, "tool_choice required rendered")


def t_errors(A, B):
    import openai
    c = A.client
    cases = [
        ("malformed JSON", None, "", 400),
        ("unknown model", dict(model="gpt-4o", messages=user("x")), "model", 400),
        ("n over the bound", dict(model="tiny", messages=user("x"), n=9), "n", 400),
        ("wrong type", dict(model="tiny", messages=user("x"), temperature="hot"), "temperature", 400),
        ("messages not a list", dict(model="tiny", messages="hello"), "messages", 400),
        ("bad role", dict(model="tiny", messages=[{"role": "robot", "content": "x"}]), "messages[0].role", 400),
        ("out of range", dict(model="tiny", messages=user("x"), logprobs=True, top_logprobs=21), "top_logprobs", 400),
        ("output-changing field not implemented", dict(model="tiny", messages=user("x"),
                                                       extra_body={"structured_outputs": {"json": {}}}),
         "structured_outputs", 400),
        ("stream_options without stream", dict(model="tiny", messages=user("x"), stream_options={"include_usage": True}),
         "stream_options", 400),
        ("max_tokens over the context", dict(model="tiny", messages=user("x"), max_tokens=10 ** 7), "max_tokens", 400),
    ]
    for what, kw, param, status in cases:
        try:
            if kw is None:
                req = urllib.request.Request(A.url + "/v1/chat/completions", data=b'{"model": "tiny", "messages": [',
                                             headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=30)
                    raise AssertionError("malformed JSON accepted")
                except urllib.error.HTTPError as e:
                    check(e.code == 400, f"{what}: {e.code}")
                    body = json.loads(e.read())
                    check(body["error"]["type"] == "invalid_request_error" and body["error"]["message"], what)
                continue
            c.chat.completions.create(**kw)
            raise AssertionError(f"{what}: accepted")
        except openai.APIStatusError as e:
            check(e.status_code == status, f"{what}: status {e.status_code}")
            check(e.param == param, f"{what}: param {e.param!r} != {param!r}")
            check(isinstance(e.message, str) and e.message, f"{what}: message")
    # prompt longer than the context: counted after rendering, 400 naming messages
    ctx = A.client.models.retrieve("tiny").model_dump().get("max_model_len")
    check(isinstance(ctx, int) and ctx > 0, "max_model_len listed")
    try:
        A.client.completions.create(model="tiny", prompt=[1] * (ctx + 1), max_tokens=1)
        raise AssertionError("over-long prompt accepted")
    except openai.BadRequestError as e:
        check(e.param == "prompt" and e.code == "context_length_exceeded", f"ids over the context: {e.param} {e.code}")
    long_text = "lorem ipsum dolor sit amet " * (ctx // 2)
    try:
        A.client.chat.completions.create(model="tiny", messages=user(long_text), max_tokens=1)
        raise AssertionError("over-long chat accepted")
    except openai.BadRequestError as e:
        check(e.param == "messages" and e.code == "context_length_exceeded", f"chat over the context: {e.param} {e.code}")
    try:
        A.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=ctx - 1)
        raise AssertionError("prompt + max_tokens over the context accepted")
    except openai.BadRequestError as e:
        check(e.code == "context_length_exceeded", "prompt + max_tokens")
    # authentication on B
    import openai as o
    for key, what in ((None, "missing"), ("wrong-key", "wrong")):
        cl = o.OpenAI(base_url=B.url + "/v1", api_key=key or "x", max_retries=0,
                      default_headers={} if key else {"Authorization": ""})
        try:
            cl.models.list()
            raise AssertionError(f"{what} key accepted")
        except o.AuthenticationError as e:
            check(e.status_code == 401, f"{what} key: {e.status_code}")
    check(B.client.models.list().data[0].id == "tiny", "right key accepted")
    with urllib.request.urlopen(B.url + "/health", timeout=10) as r:  # health needs no key
        check(r.status == 200, "health without a key")
    # unknown endpoint, wrong method
    for url, method, code in ((A.url + "/v2/nothing", "GET", 404), (A.url + "/v1/chat/completions", "GET", 405)):
        try:
            urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10)
            raise AssertionError(f"{url} answered")
        except urllib.error.HTTPError as e:
            check(e.code == code, f"{method} {url}: {e.code}")
            check("error" in json.loads(e.read()), "error object")


def t_memo(B):
    kw = dict(model="tiny", messages=user("memo me"), max_tokens=8, temperature=0)
    raw1 = B.client.chat.completions.with_raw_response.create(**kw)
    r1 = raw1.parse()
    check(raw1.headers.get("x-shoal-memo") == "miss", f"first: {raw1.headers.get('x-shoal-memo')}")
    raw2 = B.client.chat.completions.with_raw_response.create(**kw)
    r2 = raw2.parse()
    check(raw2.headers.get("x-shoal-memo") == "hit", f"second: {raw2.headers.get('x-shoal-memo')}")
    check(r1.choices[0].message.model_dump() == r2.choices[0].message.model_dump(), "same message")
    check(r1.usage.completion_tokens == r2.usage.completion_tokens, "same usage")
    check(r1.id != r2.id, "a new response id")
    # streamed from the memo: same text, still ends properly
    raw3 = B.client.chat.completions.with_raw_response.create(stream=True, **kw)
    check(raw3.headers.get("x-shoal-memo") == "hit", "stream hit")
    text = "".join((getattr(c.choices[0].delta, "reasoning_content", None) or "") for c in raw3.parse() if c.choices)
    check(text == (r1.choices[0].message.reasoning_content or ""), "streamed memo text")
    # fixed seed: memoised; no seed with sampling: never
    s1 = B.client.chat.completions.with_raw_response.create(model="tiny", messages=user("seeded"), max_tokens=4,
                                                            temperature=0.8, seed=3)
    s2 = B.client.chat.completions.with_raw_response.create(model="tiny", messages=user("seeded"), max_tokens=4,
                                                            temperature=0.8, seed=3)
    check(s2.headers.get("x-shoal-memo") == "hit", "seeded request memoised")
    n1 = B.client.chat.completions.with_raw_response.create(model="tiny", messages=user("seeded"), max_tokens=4,
                                                            temperature=0.8)
    check(n1.headers.get("x-shoal-memo") is None, "unseeded sampling is not memoised")
    m = B.metrics()
    check(m.get("shoal_memo_hits_total", 0) >= 3, "memo hits counted")
    check(m.get("shoal_memo_entries", 0) >= 2, "memo entries")


def t_reuse(A, B):
    """Turn 2 of a conversation continues from turn 1's kept state on A; B (reuse
    off) prefills everything. The generated ids must be identical."""
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "first question"}]
    kw = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    t1 = A.client.chat.completions.with_raw_response.create(messages=msgs, **kw)
    r1 = t1.parse()
    m1 = r1.choices[0].message
    msgs2 = msgs + [{"role": "assistant", "content": m1.content or "", "reasoning_content": m1.reasoning_content or ""},
                    {"role": "user", "content": "second question"}]
    t2 = A.client.chat.completions.with_raw_response.create(messages=msgs2, **kw)
    r2 = t2.parse()
    reused = int(t2.headers.get("x-shoal-reused-tokens", "-1"))
    check(reused >= r1.usage.prompt_tokens, f"turn 2 continued from turn 1's prompt: reused {reused}, "
                                            f"turn-1 prompt {r1.usage.prompt_tokens}")
    check(r2.usage.prompt_tokens_details.cached_tokens == reused, "cached_tokens reports the reuse")
    fresh = B.client.chat.completions.with_raw_response.create(messages=msgs2, **kw)
    check(int(fresh.headers.get("x-shoal-reused-tokens", "-1")) == 0, "B does not reuse")
    rf = fresh.parse()
    a, b = r2.choices[0].model_dump(), rf.choices[0].model_dump()
    check(a["prompt_token_ids"] == b["prompt_token_ids"], "same prompt ids")
    check(a["token_ids"] == b["token_ids"], f"same generated ids with and without reuse: {a['token_ids']} vs {b['token_ids']}")
    # completions: a prompt extending a finished sequence continues from its end
    p = [21, 22, 23, 24]
    c1 = A.client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].model_dump()
    ext = p + c1["token_ids"][:-1] + [99, 100]
    c2 = A.client.completions.with_raw_response.create(model="tiny", prompt=ext, max_tokens=6, temperature=0,
                                                       extra_body={"return_token_ids": True})
    check(int(c2.headers.get("x-shoal-reused-tokens", "-1")) >= len(p) + len(c1["token_ids"]) - 1,
          f"continued from the generated state: {c2.headers.get('x-shoal-reused-tokens')}")
    c3 = B.client.completions.create(model="tiny", prompt=ext, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].model_dump()
    check(c2.parse().choices[0].model_dump()["token_ids"] == c3["token_ids"], "same ids either way (completions)")


def t_health_metrics(A):
    with urllib.request.urlopen(A.url + "/health", timeout=10) as r:
        h = json.loads(r.read())
    check(h["ready"] is True and h["status"] == "ok" and h["model"] == "tiny", f"health {h}")
    check(isinstance(h["workers"], list), "workers listed")
    m = A.metrics()
    check(m.get('shoal_http_responses_total{endpoint="/v1/chat/completions",status="200"}', 0) > 0, "chat 200s counted")
    check(m.get('shoal_http_responses_total{endpoint="/v1/chat/completions",status="400"}', 0) > 0, "400s counted")
    check(m.get("shoal_completion_tokens_total", 0) > 0, "tokens counted")
    check(m.get("shoal_ready") == 1, "ready gauge")
    # the coordinator's families are there too: one up-gauge per worker
    check(len([k for k in m if k.startswith("shoal_worker_up{")]) == 2, "shoal_worker_up per worker")
    # the whole exposition passes the official parser and the format rules
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import promcheck
    with urllib.request.urlopen(A.url + "/metrics", timeout=10) as r:
        check(r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), "exposition content type")
        fams = promcheck.parse(r.read().decode())
    check("shoal_http_responses" in fams or "shoal_http_responses_total" in fams, "families parsed")


def t_disconnect_frees(A):
    """A streaming client that goes away stops its generation: the canceled
    counter moves, and the next request does not wait for the abandoned one."""
    before = A.metrics().get("shoal_sched_canceled_total", 0)
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3000, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", A.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    s.close()
    t0 = time.time()
    r = A.client.completions.create(model="tiny", prompt=[4, 5], max_tokens=2, temperature=0)
    dt = time.time() - t0
    check(r.usage.completion_tokens >= 1, "served")
    check(dt < 20, f"the next request waited {dt:.1f} s")  # 3000 tokens would take ~40 s here
    deadline = time.time() + 10
    while time.time() < deadline and A.metrics().get("shoal_sched_canceled_total", 0) <= before:
        time.sleep(0.1)
    check(A.metrics().get("shoal_sched_canceled_total", 0) > before, "generation canceled")


def t_queue_full(A):
    """--queue 2: with one generation running and two waiting, the next is 429."""
    import openai
    holders = []
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3000, "temperature": 0,
                       "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body) + body)
    def wait_for(what, cond, timeout=30):
        # the state the next step needs, polled (never a sleep that hopes the
        # server has read the request by then: on a busy machine it may not)
        deadline = time.time() + timeout
        while True:
            m = A.metrics()
            if cond(m):
                return
            check(time.time() < deadline, f"{what} within {timeout} s: {m.get('shoal_sched_running')} running, "
                                          f"{m.get('shoal_sched_queued')} queued")
            time.sleep(0.05)
    try:
        base = A.metrics().get("shoal_sched_submitted_total", 0)
        for i in range(3):
            s = socket.create_connection(("127.0.0.1", A.port))
            s.sendall(req)
            holders.append(s)
            wait_for(f"holder {i + 1} accepted", lambda m: m.get("shoal_sched_submitted_total", 0) >= base + i + 1)
        wait_for("one running, two queued",
                 lambda m: m.get("shoal_sched_running", 0) == 1 and m.get("shoal_sched_queued", 0) == 2)
        try:
            A.client.completions.create(model="tiny", prompt=[1], max_tokens=1)
            raise AssertionError("not refused")
        except openai.RateLimitError as e:
            check(e.status_code == 429 and e.code == "queue_full", f"429 queue_full: {e.code}")
    finally:
        for s in holders:
            s.close()
    # the places are free again
    deadline = time.time() + 20
    while True:
        try:
            A.client.completions.create(model="tiny", prompt=[1], max_tokens=1)
            break
        except openai.RateLimitError:
            check(time.time() < deadline, "queue never drained after the clients left")
            time.sleep(0.2)


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                if int(st.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def t_worker_down():
    """Stop one of two expert servers (SIGSTOP: it stays a process, so the
    supervisor does not restart it, and the outcome does not race a restart):
    a request fails within --expert-timeout-ms with 503 naming it, /health
    turns 503 listing it down; after SIGCONT it rejoins and requests succeed
    again; the server still exits cleanly. (A killed worker's restart is
    test_supervise's.)"""
    import openai
    import signal
    C = Server("--memo", "0", "--expert-timeout-ms", "1500")
    stopped = None
    try:
        with urllib.request.urlopen(C.url + "/health", timeout=10) as r:
            h = json.loads(r.read())
        check(len(h["workers"]) == 2 and all(w["up"] for w in h["workers"]), f"two workers up: {h}")
        r = C.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, temperature=0)
        check(r.usage.completion_tokens == 2, "served by the workers")
        kids = children(C.p.pid)
        check(len(kids) == 2, f"two worker processes: {kids}")
        with open(f"/proc/{kids[0]}/cmdline") as f:
            argv = f.read().split("\0")
        wid = argv[argv.index("--id") + 1]
        os.kill(kids[0], signal.SIGSTOP)
        stopped = kids[0]
        t0 = time.time()
        try:
            C.client.completions.create(model="tiny", prompt=[1, 2, 4], max_tokens=2, temperature=0)
            raise AssertionError("served with a worker down")
        except openai.APIStatusError as e:
            check(e.status_code == 503 and e.code == "worker_unavailable", f"503 worker_unavailable: {e.status_code} {e.code}")
            check(wid in e.message, f"the message names worker {wid}: {e.message}")
        check(time.time() - t0 < 10, f"the 503 came within the deadline: {time.time() - t0:.1f} s")
        try:
            urllib.request.urlopen(C.url + "/health", timeout=10)
            raise AssertionError("healthy with a worker down")
        except urllib.error.HTTPError as e:
            check(e.code == 503, f"health {e.code}")
            h = json.loads(e.read())
            down = [w for w in h["workers"] if not w["up"]]
            check(h["ready"] is False and len(down) == 1 and wid in down[0]["endpoint"], f"health lists {wid} down: {h}")
        m = C.metrics()
        check(m.get("shoal_ready") == 1, "the model itself stays loaded")
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        ok, last = False, None
        deadline = time.time() + 30
        while time.time() < deadline and not ok:
            try:
                r = C.client.completions.create(model="tiny", prompt=[1, 2, 5], max_tokens=2, temperature=0)
                ok = r.usage.completion_tokens == 2
            except openai.APIStatusError as e:
                last = e
                time.sleep(0.3)
        check(ok, f"served again after the worker returned: {last}")
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        rc = C.stop()
    check(rc == 0, f"exit code {rc}")
    check(not children(C.p.pid), "no worker left behind")


def t_security_flags(A):
    # a non-loopback address without a key is refused before anything is bound
    p = subprocess.run([BIN, "serve", "--model", MODEL, "--port", "0", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "--api-key" in p.stderr, f"rc {p.returncode} {p.stderr[-200:]}")
    # the default bind is loopback only
    check(A.url.startswith("http://127.0.0.1:"), A.url)


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    try:
        import openai  # noqa: F401
    except ImportError:
        record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    A = Server("--memo", "0", "--queue", "2", "--slots", "1")  # queue_full counts on one slot; B batches
    B = Server("--keep", "0", "--prefix-cache-gb", "0", key="sekret")  # no reuse of any kind (t_reuse)
    try:
        run("models", t_models, A)
        run("chat_full_thinking", t_chat_full_thinking, A)
        run("chat_full_no_thinking", t_chat_full_no_thinking, A)
        run("chat_stream", t_chat_stream, A)
        run("stream_utf8_done", t_stream_utf8_and_done, A)
        run("completions", t_completions, A)
        run("stop_strings", t_stop_strings, A)
        run("sampling_seed", t_sampling_seed, A)
        run("tool_round_trip", t_tool_round_trip, A)
        run("errors", t_errors, A, B)
        run("memo", t_memo, B)
        run("reuse", t_reuse, A, B)
        run("disconnect_frees", t_disconnect_frees, A)
        run("queue_full", t_queue_full, A)
        run("health_metrics", t_health_metrics, A)
        run("security_flags", t_security_flags, A)
    finally:
        rca, rcb = A.stop(), B.stop()
    run("clean_shutdown", lambda: check(rca == 0 and rcb == 0, f"exit codes {rca} {rcb}"))
    run("worker_down", t_worker_down)
    if counts["FAIL"]:
        return 1
    if counts["PASS"] == 0:
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
