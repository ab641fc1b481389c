"""Every client works unmodified (issue 31, the new endpoints): the official
`anthropic` SDK against POST /v1/messages and /v1/messages/count_tokens, the
official `openai` SDK's client.responses against POST /v1/responses, the OpenAI
Agents SDK (`openai-agents`) running one agent with one function tool, and
LiteLLM with its OpenAI and Anthropic providers pointed at shoal. One server
for every case: `shoal serve --model tests/models/k3-nano --workers 2
--api-key KEY --memo 0` (memo off, so a streamed request is generated again,
not replayed from the full one).

Expected values come from outside the code under test where they can:
 - answers: tests/fixtures/k3-nano/chat.json, the fp32 reference's prompt ids
   and greedy answer for one user message (thinking on and off), decoded here
   with tiktoken from the model's tiktoken.model; the Anthropic and Responses
   answers must be those texts, and count_tokens / input_tokens the length of
   the reference's prompt ids;
 - a prefill (trailing assistant message): the reference's thinking-off
   prompt ids plus the prefill's text encoded by tiktoken;
 - conversations the reference fixtures do not cover (system prompt,
   multi-turn, tool_use / tool_result, thinking switch): the prompt length of
   the same conversation written by hand in OpenAI's chat format and sent to
   /v1/chat/completions (return_token_ids), i.e. the translation must render
   exactly what the documented OpenAI-to-K3 mapping renders;
 - stream == full: the concatenated deltas of a second, independent
   generation equal the non-streaming text (greedy);
 - shapes: what the SDKs parse (their pydantic models, their stream
   accumulators) and Anthropic's documented event order.
k3-nano is a 5M-parameter toy that does not call tools by itself: tool cases
check that tools / tool_choice are accepted and rendered, and that tool_use /
tool_result / function_call / function_call_output history round-trips into
the prompt; a tool call the model does emit is checked for shape. It also
closes its think element at once; with <|open|> and <|close|> biased away
(logit_bias) it keeps thinking, which exercises thinking blocks and reasoning
items with text (= the chat endpoint's reasoning_content, streamed = full).
"""
import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
FIX = os.path.join(SRC, "tests", "fixtures", "k3-nano")
KEY = "sk-shoal-test"
R = harness.Recorder("test_clients")
sys.path.insert(0, os.path.join(SRC, "tools"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import


ENC, SP = harness.k3_encoder(NANO)


def t(s):
    return ENC.encode(s, disallowed_special=())


def expected_answer(ids, thinking):
    """(reasoning, content, ended) of the reference's answer ids: the XTML structure removed"""
    a = harness.k3_answer(ENC, SP, ids, thinking)
    return a and (a[0], a[1], a[3])


class Server(harness.Serve):
    def __init__(self, *args):
        super().__init__([BIN, "serve", "--model", NANO, "--port", "0", "--model-name", "nano", "--threads", "1",
                          "--memo", "0", "--api-key", KEY, *args])


def post(url, path, body, headers=None):
    """(status, headers, parsed body) of a raw POST"""
    h = {"Content-Type": "application/json", "x-api-key": KEY}
    h.update(headers or {})
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def chat_prompt(srv, messages, thinking, **extra):
    """the prompt ids /v1/chat/completions renders for an OpenAI-format conversation"""
    body = {"model": "nano", "messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    if not thinking:
        body["reasoning_effort"] = "none"
    body.update(extra)
    st, _, r = post(srv.url, "/v1/chat/completions", body)
    if st != 200:
        raise RuntimeError(f"chat/completions {st}: {r}")
    return r["choices"][0]["prompt_token_ids"]


# greedy (anthropic >= 2 no longer has temperature among create()'s arguments;
# the Messages API still takes it, so it goes in the body)
G = {"temperature": 0}


def check_block_shapes(tag, msg):
    kinds = [b.type for b in msg.content]
    ok = all(k in ("thinking", "text", "tool_use") for k in kinds)
    for b in msg.content:
        if b.type == "tool_use":
            ok &= b.id.startswith("toolu_") and isinstance(b.input, dict) and bool(b.name)
    R.check(f"{tag}: content blocks are thinking / text / tool_use with ids and object inputs", ok, repr(msg.content))


# ---- Anthropic ---------------------------------------------------------------------


def anthropic_cases(srv, chats):
    import anthropic
    cl = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
    for c in chats:
        exp = expected_answer(c["generated_ids"], c["thinking"])
        tag = f"anthropic '{c['question']}' thinking {'on' if c['thinking'] else 'off'}"
        if exp is None:
            R.record("SKIP", tag, "the reference answer has no plain structure")
            continue
        reasoning, content, ended = exp
        n = len(c["generated_ids"])
        kw = dict(model="nano", max_tokens=n, extra_body=G, messages=[{"role": "user", "content": c["question"]}],
                  thinking={"type": "enabled", "budget_tokens": 1024} if c["thinking"] else {"type": "disabled"})
        m = cl.messages.create(**kw)
        text = "".join(b.text for b in m.content if b.type == "text")
        think = "".join(b.thinking for b in m.content if b.type == "thinking")
        R.check(f"{tag}: text is the reference's answer", text == content, f"{text!r} != {content!r}")
        R.check(f"{tag}: thinking is the reference's reasoning", think == reasoning, f"{think!r} != {reasoning!r}")
        R.check(f"{tag}: stop_reason", m.stop_reason == ("end_turn" if ended else "max_tokens"), m.stop_reason)
        R.check(f"{tag}: usage = the reference's prompt and answer lengths",
                m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(c["prompt_ids"])
                and m.usage.output_tokens == n, repr(m.usage))
        R.check(f"{tag}: message shape", m.type == "message" and m.role == "assistant" and m.model == "nano"
                and m.id.startswith("msg_") and m.stop_sequence is None, repr(m))
        check_block_shapes(tag, m)
        ct = cl.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "extra_body")})
        R.check(f"{tag}: count_tokens = the reference's prompt length", ct.input_tokens == len(c["prompt_ids"]),
                f"{ct.input_tokens} != {len(c['prompt_ids'])}")
        # streaming: a second generation, deltas concatenated, events in Anthropic's order
        types, deltas = [], {"text": "", "thinking": ""}
        with cl.messages.stream(**kw) as s:
            for ev in s:
                types.append(ev.type)
                if ev.type == "content_block_delta":
                    if ev.delta.type == "text_delta":
                        deltas["text"] += ev.delta.text
                    elif ev.delta.type == "thinking_delta":
                        deltas["thinking"] += ev.delta.thinking
            final = s.get_final_message()
        raw = [x for x in types if x in ("message_start", "content_block_start", "content_block_delta",
                                         "content_block_stop", "message_delta", "message_stop")]
        order_ok = raw[:1] == ["message_start"] and raw[-2:] == ["message_delta", "message_stop"]
        depth = 0
        for x in raw[1:-2]:
            depth += {"content_block_start": 1, "content_block_stop": -1}.get(x, 0)
            order_ok &= depth in (0, 1) and not (x == "content_block_delta" and depth != 1)
        R.check(f"{tag}: stream events in order (message_start, blocks start/delta/stop, message_delta, message_stop)",
                order_ok and depth == 0, repr(raw[:6]) + "..." + repr(raw[-4:]))
        R.check(f"{tag}: streamed text == full text", deltas["text"] == text, f"{deltas['text']!r} != {text!r}")
        R.check(f"{tag}: streamed thinking == full thinking", deltas["thinking"] == think)
        R.check(f"{tag}: stream's final message", final.stop_reason == m.stop_reason
                and final.usage.output_tokens == m.usage.output_tokens
                and [b.type for b in final.content] == [b.type for b in m.content], repr(final))
    c = next(c for c in chats if not c["thinking"])
    q = c["question"]
    off = {"type": "disabled"}
    # system prompt, multi-turn, thinking switch: the same prompt as the chat endpoint's OpenAI conversation
    sysm = "You are a terse assistant."
    ct = cl.messages.count_tokens(model="nano", system=[{"type": "text", "text": sysm}], thinking=off,
                                  messages=[{"role": "user", "content": q}]).input_tokens
    ref = chat_prompt(srv, [{"role": "system", "content": sysm}, {"role": "user", "content": q}], False)
    R.check("anthropic: system prompt renders as the chat endpoint's system message", ct == len(ref),
            f"{ct} != {len(ref)}")
    m = cl.messages.create(model="nano", max_tokens=8, extra_body=G, system=sysm, thinking=off,
                           messages=[{"role": "user", "content": q}])
    R.check("anthropic: system prompt: input_tokens", m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
            == len(ref), repr(m.usage))
    first = cl.messages.create(model="nano", max_tokens=12, extra_body=G, thinking=off,
                               messages=[{"role": "user", "content": q}])
    a1 = "".join(b.text for b in first.content if b.type == "text")
    turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a1},
             {"role": "user", "content": "And in one sentence?"}]
    m = cl.messages.create(model="nano", max_tokens=8, extra_body=G, thinking=off, messages=turns)
    ref = chat_prompt(srv, turns, False)
    R.check("anthropic: multi-turn renders as the chat endpoint's conversation",
            m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ref), f"{m.usage} vs {len(ref)}")
    R.check("anthropic: multi-turn: the first turn's state is reused (cache_read_input_tokens > 0)",
            (m.usage.cache_read_input_tokens or 0) > 0, repr(m.usage))
    on = cl.messages.count_tokens(model="nano", thinking={"type": "enabled", "budget_tokens": 2048},
                                  messages=[{"role": "user", "content": q}]).input_tokens
    offn = cl.messages.count_tokens(model="nano", thinking=off, messages=[{"role": "user", "content": q}]).input_tokens
    R.check("anthropic: thinking enabled/disabled = the chat endpoint's thinking on/off",
            on == len(chat_prompt(srv, [{"role": "user", "content": q}], True))
            and offn == len(chat_prompt(srv, [{"role": "user", "content": q}], False)), f"{on} {offn}")
    # stop sequences: a word of the greedy answer
    exp = expected_answer(c["generated_ids"], False)[1]
    words = [w for w in exp.split() if len(w) >= 4 and exp.index(w) > 0]
    stop = words[0]
    m = cl.messages.create(model="nano", max_tokens=len(c["generated_ids"]), extra_body=G, thinking=off,
                           stop_sequences=["@@never@@", stop], messages=[{"role": "user", "content": q}])
    text = "".join(b.text for b in m.content if b.type == "text")
    R.check("anthropic: stop_sequences: stop_reason stop_sequence, names it, text ends before it",
            m.stop_reason == "stop_sequence" and m.stop_sequence == stop and text == exp[:exp.index(stop)],
            f"{m.stop_reason} {m.stop_sequence!r} {text!r}")
    m = cl.messages.create(model="nano", max_tokens=5, extra_body=G, thinking=off,
                           messages=[{"role": "user", "content": q}])
    R.check("anthropic: max_tokens stop", m.stop_reason == "max_tokens" and m.usage.output_tokens == 5, repr(m))
    # prefill: the reference's prompt + the prefill's tokens; the answer continues it
    pre = "In short,"
    ct = cl.messages.count_tokens(model="nano", messages=[{"role": "user", "content": q},
                                                           {"role": "assistant", "content": pre}]).input_tokens
    R.check("anthropic: prefill: prompt = reference prompt (thinking off) + the prefill's tokens",
            ct == len(c["prompt_ids"]) + len(t(pre)), f"{ct} != {len(c['prompt_ids'])} + {len(t(pre))}")
    m = cl.messages.create(model="nano", max_tokens=6, extra_body=G, messages=[
        {"role": "user", "content": q}, {"role": "assistant", "content": pre}])
    R.check("anthropic: prefill: answered (continuation only, no thinking block)",
            m.content and all(b.type == "text" for b in m.content) and not m.content[0].text.startswith(pre),
            repr(m.content))
    # tools: declared, forced by tool_choice, rendered; history with tool_use / tool_result
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    oa_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                  "parameters": tools[0]["input_schema"]}}]
    for choice, oa in (({"type": "any"}, "required"), ({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        ct = cl.messages.count_tokens(model="nano", tools=tools, tool_choice=choice, thinking=off,
                                      messages=[{"role": "user", "content": q}]).input_tokens
        ref = chat_prompt(srv, [{"role": "user", "content": q}], False, tools=oa_tools, tool_choice=oa)
        R.check(f"anthropic: tools + tool_choice {choice['type']} render as the chat endpoint's", ct == len(ref),
                f"{ct} != {len(ref)}")
    m = cl.messages.create(model="nano", max_tokens=16, extra_body=G, thinking=off, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": q}])
    R.check("anthropic: tool_choice {type: tool} accepted", m.stop_reason in ("end_turn", "max_tokens", "tool_use"),
            repr(m))
    check_block_shapes("anthropic: tool_choice tool", m)
    hist = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}]
    oa_hist = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
                "tool_calls": [{"id": "toolu_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
               {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}]
    for think in (False, True):
        th = {"type": "enabled", "budget_tokens": 1024} if think else off
        m = cl.messages.create(model="nano", max_tokens=8, extra_body=G, thinking=th, tools=tools, messages=hist)
        ref = chat_prompt(srv, oa_hist, think, tools=oa_tools)
        R.check(f"anthropic: tool_use / tool_result round trip renders as the chat endpoint's (thinking {think})",
                m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ref),
                f"{m.usage} vs {len(ref)}")
    err_hist = json.loads(json.dumps(hist))
    err_hist[2]["content"][0]["is_error"] = True
    oa_err = json.loads(json.dumps(oa_hist))
    oa_err[2]["content"] = "Error: sunny, 21 C"
    ct = cl.messages.count_tokens(model="nano", thinking=off, tools=tools, messages=err_hist).input_tokens
    R.check("anthropic: tool_result is_error renders as an 'Error: ' result",
            ct == len(chat_prompt(srv, oa_err, False, tools=oa_tools)))
    # errors in Anthropic's shape
    def err_case(name, fn, status, etype):
        try:
            fn()
            R.check(f"anthropic error: {name}", False, "no error")
        except anthropic.APIStatusError as e:
            body = e.response.json()
            R.check(f"anthropic error: {name}: {status} {etype}",
                    e.status_code == status and body.get("type") == "error"
                    and body["error"]["type"] == etype and bool(body["error"]["message"]), f"{e.status_code} {body}")
    err_case("missing max_tokens", lambda: post_raise(srv, {"model": "nano", "messages": [{"role": "user", "content": "hi"}]}),
             400, "invalid_request_error")
    err_case("bad role", lambda: cl.messages.create(model="nano", max_tokens=4,
                                                    messages=[{"role": "system", "content": "hi"}]),
             400, "invalid_request_error")
    err_case("wrong key", lambda: anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
        model="nano", max_tokens=4, messages=[{"role": "user", "content": "hi"}]), 401, "authentication_error")
    err_case("unknown model", lambda: cl.messages.create(model="claude-x", max_tokens=4,
                                                         messages=[{"role": "user", "content": "hi"}]),
             404, "not_found_error")
    err_case("image block (text-only model)", lambda: cl.messages.create(model="nano", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": "AAAA"}}]}]), 400, "invalid_request_error")
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token=KEY, max_retries=0, timeout=120)
    m = bearer.messages.create(model="nano", max_tokens=3, extra_body=G, thinking=off,
                               messages=[{"role": "user", "content": q}])
    R.check("anthropic: Authorization: Bearer also authenticates", m.usage.output_tokens == 3)
    st, hd, body = post(srv.url, "/v1/messages", {"model": "nano", "max_tokens": 2, "service_tier": "auto",
                                                  "x_vendor": 1, "messages": [{"role": "user", "content": q}]},
                        {"anthropic-version": "2023-06-01"})
    R.check("anthropic: fields not implemented (documented or unknown) are accepted and named in x-shoal-ignored",
            st == 200 and hd.get("x-shoal-ignored", "").split(",") == ["service_tier", "x_vendor"], f"{st} {hd}")


# k3-nano closes its think element at once: with <|open|> and <|close|>
# biased away (logit_bias, a shoal extension on every endpoint) it can only
# keep thinking, so the reasoning channel carries real generated text
NO_CLOSE = {str(SP["<|open|>"]): -100, str(SP["<|close|>"]): -100}


def chat_reasoning(srv, q, n):
    st, _, r = post(srv.url, "/v1/chat/completions", {"model": "nano", "messages": [{"role": "user", "content": q}],
                                                      "max_tokens": n, "temperature": 0, "logit_bias": NO_CLOSE})
    if st != 200:
        raise RuntimeError(f"chat/completions {st}: {r}")
    return r["choices"][0]["message"].get("reasoning_content") or ""


def anthropic_thinking_cases(srv, q):
    import anthropic
    cl = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)
    ref = chat_reasoning(srv, q, 16)
    kw = dict(model="nano", max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": q}], extra_body={"temperature": 0, "logit_bias": NO_CLOSE})
    m = cl.messages.create(**kw)
    think = [b for b in m.content if b.type == "thinking"]
    R.check("anthropic: a thinking block carries K3's reasoning (= the chat endpoint's reasoning_content)",
            len(ref) > 0 and len(think) == 1 and think[0].thinking == ref and m.content[0].type == "thinking"
            and m.stop_reason == "max_tokens", f"{m.content!r} vs {ref!r}")
    starts, deltas = [], ""
    with cl.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_start":
                starts.append(ev.content_block.type)
            elif ev.type == "content_block_delta" and ev.delta.type == "thinking_delta":
                deltas += ev.delta.thinking
        final = s.get_final_message()
    R.check("anthropic: streamed thinking block (thinking_delta) == the full one",
            starts[:1] == ["thinking"] and deltas == ref and final.content[0].thinking == ref,
            f"{starts} {deltas!r}")


def responses_reasoning_cases(srv, q):
    import openai
    cl = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ref = chat_reasoning(srv, q, 16)
    kw = dict(model="nano", input=q, max_output_tokens=16, temperature=0, extra_body={"logit_bias": NO_CLOSE})
    r = cl.responses.create(**kw)
    rs = [it for it in r.output if it.type == "reasoning"]
    R.check("responses: a reasoning item carries K3's reasoning (= the chat endpoint's reasoning_content)",
            len(ref) > 0 and len(rs) == 1 and "".join(p.text for p in rs[0].content) == ref
            and r.usage.output_tokens_details.reasoning_tokens == 16, f"{r.output!r} vs {ref!r}")
    types, text, final = [], "", None
    for ev in cl.responses.create(stream=True, **kw):
        types.append(ev.type)
        if ev.type == "response.reasoning_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    need = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    R.check("responses: streamed reasoning (reasoning_text events) == the full item",
            text == ref and all(x in types for x in need) and final is not None
            and "".join(p.text for it in final.output if it.type == "reasoning" for p in it.content) == ref,
            f"{types[:8]} {text!r}")


def post_raise(srv, body):
    import anthropic
    import httpx
    r = httpx.post(srv.url + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    if r.status_code != 200:
        raise anthropic.APIStatusError("error", response=r, body=r.json())
    return r


# ---- OpenAI Responses, Agents SDK ----------------------------------------------------


def responses_cases(srv, chats):
    import openai
    cl = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    for c in chats:
        exp = expected_answer(c["generated_ids"], c["thinking"])
        tag = f"responses '{c['question']}' thinking {'on' if c['thinking'] else 'off'}"
        if exp is None:
            R.record("SKIP", tag, "the reference answer has no plain structure")
            continue
        reasoning, content, ended = exp
        n = len(c["generated_ids"])
        kw = dict(model="nano", input=c["question"], max_output_tokens=n, temperature=0)
        if not c["thinking"]:
            kw["reasoning"] = {"effort": "none"}
        r = cl.responses.create(**kw)
        rs = "".join(p.text for it in r.output if it.type == "reasoning" for p in (it.content or []))
        R.check(f"{tag}: output_text is the reference's answer", r.output_text == content,
                f"{r.output_text!r} != {content!r}")
        R.check(f"{tag}: reasoning item is the reference's reasoning", rs == reasoning, f"{rs!r}")
        R.check(f"{tag}: status", r.status == ("completed" if ended else "incomplete"), r.status)
        R.check(f"{tag}: usage = the reference's prompt and answer lengths",
                r.usage.input_tokens == len(c["prompt_ids"]) and r.usage.output_tokens == n, repr(r.usage))
        types, text, final = [], "", None
        for ev in cl.responses.create(stream=True, **kw):  # the SDK's typed events
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        need = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"]
        last = "response.completed" if ended else "response.incomplete"
        R.check(f"{tag}: stream has the typed events in order", types[:2] == need[:2] and types[-1] == last and
                all(x in types for x in need), repr(types[:4]) + "..." + repr(types[-3:]))
        R.check(f"{tag}: streamed text == full text", text == r.output_text, f"{text!r} != {r.output_text!r}")
        R.check(f"{tag}: stream's final response", final.output_text == r.output_text
                and final.usage.output_tokens == r.usage.output_tokens, repr(final.usage))
    c = next(c for c in chats if not c["thinking"])
    q = c["question"]
    none = {"effort": "none"}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    oa_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    r = cl.responses.create(model="nano", input=q, instructions="Be terse.", tools=tools, tool_choice="required",
                            max_output_tokens=8, temperature=0, reasoning=none)
    ref = chat_prompt(srv, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": q}], False,
                      tools=oa_tools, tool_choice="required")
    R.check("responses: instructions + function tools render as the chat endpoint's", r.usage.input_tokens == len(ref),
            f"{r.usage.input_tokens} != {len(ref)}")
    ok = all(it.type in ("message", "reasoning", "function_call") for it in r.output)
    for it in r.output:
        if it.type == "function_call":
            ok &= it.call_id.startswith("call_") and it.name == "get_weather" and isinstance(it.arguments, str)
    R.check("responses: output items are message / reasoning / function_call", ok, repr(r.output))
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    oa = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
              "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = cl.responses.create(model="nano", input=items, tools=tools, max_output_tokens=8, temperature=0, reasoning=none)
    R.check("responses: function_call / function_call_output round trip renders as the chat endpoint's",
            r.usage.input_tokens == len(chat_prompt(srv, oa, False, tools=oa_tools)), repr(r.usage))
    # previous_response_id: the stored conversation continues; its state is reused
    r1 = cl.responses.create(model="nano", input=q, max_output_tokens=10, temperature=0, reasoning=none)
    r2 = cl.responses.create(model="nano", previous_response_id=r1.id, input="And in one sentence?",
                             max_output_tokens=6, temperature=0, reasoning=none)
    conv = [{"role": "user", "content": q}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "And in one sentence?"}]
    R.check("responses: previous_response_id continues the stored conversation",
            r2.usage.input_tokens == len(chat_prompt(srv, conv, False)), repr(r2.usage))
    R.check("responses: previous_response_id: the kept state is reused (cached_tokens > 0)",
            r2.usage.input_tokens_details.cached_tokens > 0, repr(r2.usage))
    try:
        cl.responses.create(model="nano", previous_response_id="resp_gone", input="hi", max_output_tokens=2)
        R.check("responses: unknown previous_response_id is a 400", False, "no error")
    except openai.BadRequestError as e:
        R.check("responses: unknown previous_response_id is a 400 previous_response_not_found",
                e.code == "previous_response_not_found" and e.param == "previous_response_id", repr(e.body))
    r = cl.responses.create(model="nano", input=q, store=False, max_output_tokens=2, temperature=0, reasoning=none)
    try:
        cl.responses.create(model="nano", previous_response_id=r.id, input="hi", max_output_tokens=2)
        R.check("responses: store=false is not kept", False, "continued")
    except openai.BadRequestError as e:
        R.check("responses: store=false is not kept (400 previous_response_not_found)",
                e.code == "previous_response_not_found")
    st, hd, body = post(srv.url, "/v1/responses", {"model": "nano", "input": q, "max_output_tokens": 2,
                                                   "truncation": "auto", "x_vendor": 1})
    R.check("responses: fields not implemented (documented or unknown) are accepted and named in x-shoal-ignored",
            st == 200 and hd.get("x-shoal-ignored", "").split(",") == ["truncation", "x_vendor"], f"{st} {hd}")
    try:
        cl.responses.create(model="nano", input=q, tools=[{"type": "web_search"}], max_output_tokens=2)
        R.check("responses: hosted tools are refused", False, "accepted")
    except openai.BadRequestError as e:
        R.check("responses: hosted tools are refused naming the tool", e.param == "tools[0]", repr(e.body))


def agents_case(srv):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    import openai
    set_tracing_disabled(True)  # never reach out to a tracing endpoint
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    from openai.types.shared import Reasoning
    # long enough for the toy's answer to end by itself: the SDK treats a
    # response cut at max_output_tokens as a failure
    agent = Agent(name="assistant", tools=[get_weather], model=OpenAIResponsesModel(model="nano", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=200, reasoning=Reasoning(effort="none")))
    res = asyncio.run(Runner.run(agent, "What does json.dumps do?", max_turns=3))
    R.check("agents SDK: one agent with one function tool runs to a final output",
            isinstance(res.final_output, str) and len(res.raw_responses) >= 1, repr(res.final_output)[:200])
    u = res.raw_responses[-1].usage
    R.check("agents SDK: usage reported", u.input_tokens > 0 and u.output_tokens > 0, repr(u))


def litellm_cases(srv, chats):
    import litellm
    litellm.telemetry = False
    litellm.suppress_debug_info = True
    c = next(c for c in chats if not c["thinking"])
    reasoning, content, ended = expected_answer(c["generated_ids"], False)
    n = len(c["generated_ids"])
    msgs = [{"role": "user", "content": c["question"]}]
    r = litellm.completion(model="openai/nano", api_base=srv.url + "/v1", api_key=KEY, messages=msgs, max_tokens=n,
                           temperature=0, reasoning_effort="none")
    R.check("litellm openai provider: chat is the reference's answer", r.choices[0].message.content == content,
            repr(r.choices[0].message.content))
    r = litellm.completion(model="anthropic/nano", api_base=srv.url, api_key=KEY, messages=msgs, max_tokens=n,
                           temperature=0)
    got = r.choices[0].message.content or ""
    exp_on = next((expected_answer(x["generated_ids"], True) for x in chats
                   if x["thinking"] and x["question"] == c["question"]), None)
    R.check("litellm anthropic provider: chat completes with the reference's answer (thinking on by default)",
            exp_on is not None and got == exp_on[1][:len(got)] and len(got) > 0, repr(got))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    hist = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}]
    for prov, base in (("openai", srv.url + "/v1"), ("anthropic", srv.url)):
        r = litellm.completion(model=f"{prov}/nano", api_base=base, api_key=KEY, messages=hist, tools=tools,
                               tool_choice="required", max_tokens=8, temperature=0)
        ok = r.choices[0].finish_reason in ("stop", "length", "tool_calls") and r.usage.prompt_tokens > 0
        for tc in r.choices[0].message.tool_calls or []:
            ok &= tc.function.name == "get_weather"
        R.check(f"litellm {prov} provider: a tool call round trip (tools, tool_choice, tool result) completes", ok,
                repr(r)[:400])
    # a call the model writes itself: tool_choice naming the function forces
    # K3's call section with arguments held to its parameters (issue 36);
    # greedy and a bounded string, so the call always ends within max_tokens
    forced = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object", "required": ["city"],
                                                               "properties": {"city": {"type": "string",
                                                                                       "maxLength": 16}}}}}]
    for prov, base in (("openai", srv.url + "/v1"), ("anthropic", srv.url)):
        r = litellm.completion(model=f"{prov}/nano", api_base=base, api_key=KEY, max_tokens=200, temperature=0,
                               messages=[{"role": "user", "content": "Weather in Paris?"}], tools=forced,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
        tcs = r.choices[0].message.tool_calls or []
        ok = r.choices[0].finish_reason == "tool_calls" and len(tcs) == 1 and tcs[0].function.name == "get_weather"
        if ok:
            args = json.loads(tcs[0].function.arguments)
            ok = isinstance(args, dict) and set(args) == {"city"} and isinstance(args["city"], str) and \
                len(args["city"]) <= 16
        R.check(f"litellm {prov} provider: a forced tool call comes back as one tool call with parsed arguments", ok,
                repr(r)[:400])


def metric(srv, name, labels=""):
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    tot = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and all(l in line for l in labels.split(",") if l):
            tot += float(line.rsplit(" ", 1)[1])
    return tot


def shared_path_cases(srv):
    """the new endpoints run on the chat path: Claude Code's ?beta=true form,
    cancellation on disconnect, the HTTP and scheduler metrics"""
    import socket
    st, _, body = post(srv.url, "/v1/messages?beta=true", {"model": "nano", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}, {"anthropic-beta": "interleaved-thinking-2025-05-14"})
    R.check("anthropic: /v1/messages?beta=true (Claude Code's form) and anthropic-beta accepted", st == 200, repr(body))
    for path, body in (("/v1/messages", {"model": "nano", "max_tokens": 4000, "stream": True, "temperature": 0,
                                         "thinking": {"type": "disabled"},
                                         "messages": [{"role": "user", "content": "Tell me everything."}]}),
                       ("/v1/responses", {"model": "nano", "max_output_tokens": 4000, "stream": True,
                                          "input": "Tell me everything.", "reasoning": {"effort": "none"}})):
        before = metric(srv, "shoal_sched_canceled_total")
        host, port = srv.url.split("//")[1].split(":")
        data = json.dumps(body).encode()
        sk = socket.create_connection((host, int(port)), timeout=30)
        # Connection: close, so an error reply ends the read instead of waiting on a kept-alive socket
        sk.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
                   f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        got, t_send = b"", time.time()
        try:
            while b"delta" not in got:  # generation has begun
                chunk = sk.recv(4096)
                if not chunk:
                    break
                got += chunk
        except socket.timeout:
            pass
        sk.close()
        if not R.check(f"{path}: the stream's first delta arrives", b"delta" in got,
                       f"after {time.time() - t_send:.1f} s, received {got[:600]!r}"):
            continue
        deadline, after = time.time() + 30, before
        while time.time() < deadline and after <= before:
            time.sleep(0.05)
            after = metric(srv, "shoal_sched_canceled_total")
        R.check(f"{path}: a client that goes away cancels its generation (shoal_sched_canceled_total)",
                after > before, f"{before} -> {after}")
    for ep in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        R.check(f"metrics: shoal_http_responses_total counts {ep}",
                metric(srv, "shoal_http_responses_total", f'endpoint="{ep}",status="200"') > 0)
    R.check("metrics: shoal_api_ignored_fields_total counts ignored fields",
            metric(srv, "shoal_api_ignored_fields_total") > 0)


def main():
    if not os.path.exists(BIN):
        R.record("SKIP", "all", f"{BIN} not built")
        return 77
    missing = []
    for mod in ("anthropic", "openai", "agents", "litellm"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    chats = [c for c in json.load(open(os.path.join(FIX, "chat.json")))["chats"] if c["robust"]]
    t0 = time.time()
    srv = None
    try:
        srv = Server("--workers", "2", "--worker-threads", "1")
        for name, fn, mods in (("anthropic", lambda: anthropic_cases(srv, chats), ["anthropic"]),
                               ("responses", lambda: responses_cases(srv, chats), ["openai"]),
                               ("agents", lambda: agents_case(srv), ["agents", "openai"]),
                               ("litellm", lambda: litellm_cases(srv, chats), ["litellm"]),
                               ("shared path", lambda: shared_path_cases(srv), []),
                               ("anthropic thinking", lambda: anthropic_thinking_cases(srv, chats[0]["question"]),
                                ["anthropic"]),
                               ("responses reasoning", lambda: responses_reasoning_cases(srv, chats[0]["question"]),
                                ["openai"])):
            if any(m in missing for m in mods):
                R.record("SKIP", name, f"not installed: {', '.join(m for m in mods if m in missing)}")
                continue
            t1 = time.time()
            try:
                fn()
            except Exception as e:  # a failed request or an SDK that could not parse a response
                import traceback
                traceback.print_exc()
                R.check(f"{name}: cases ran", False, repr(e)[-600:])
            print(f"{name}: {time.time() - t1:.1f} s", flush=True)
    except Exception as e:
        R.check("server started", False, repr(e)[-600:])
    finally:
        if srv:
            rc = srv.stop()
            R.check("clean shutdown", rc == 0, f"exit code {rc}")
            if R.counts["FAIL"]:  # the server's side of a failure, for the CI log
                srv.log.seek(0)
                print("---- server log (tail) ----\n" + srv.log.read()[-6000:], flush=True)
    print(f"total: {time.time() - t0:.1f} s", flush=True)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
