#!/usr/bin/env python3
"""Structured outputs enforced while sampling (issue 36), against `shoal serve`.

The oracle is Python's `jsonschema` (Draft 2020-12, with its format checker)
and `re`, never shoal's code. Cases:
  property/<model>/*  generated schemas (every supported keyword, nested,
                 recursive through $defs) sampled at temperature 1.5 through
                 response_format json_schema: a finished output parses and
                 validates; an output cut by max_tokens is a prefix of JSON
                 text (checked by a scanner written here). SHOAL_CONSTRAIN_SCHEMAS
                 sets the count per model (default 24). Models: k3-nano (its own
                 4,096-id vocabulary) and, when K3's real vocabulary is beside the
                 checkout, the tiny K3 with 163,840 logits and the real
                 tiktoken.model (tools/make_tiny_k3.py --preset tiny-k3-vocab).
  json_object    response_format json_object: an object.
  regex, choice  guided_regex / guided_choice: re.fullmatch / membership, on
                 chat and completions.
  gbnf           llama.cpp's published arithmetic.gbnf (chat, `grammar` and
                 `guided_grammar`) and list.gbnf (completions): finished outputs
                 parse with parsers written here from the grammars.
  sdk_parse      the official openai SDK's chat.completions.parse with a
                 Pydantic model (nested model, enum, Optional, list): the parsed
                 object comes back.
  tool_args      tool_choice naming a function: the reply is one call of it
                 whose arguments parse and validate against its parameters.
  isolation      an unconstrained greedy request gives the same text alone and
                 next to a constrained one (a mask never leaks to another slot).
  same_ids       constrained requests run together on a batched, drafting
                 (ngram), 2-worker server give the texts of the reference path
                 (--slots 1 --draft off) alone.
  anthropic      the anthropic SDK on /v1/messages: tool_choice {type: tool}
                 gives one tool_use whose input validates against input_schema;
                 output_config.format json_schema is enforced.
  tool_round_trip a forced call through both agent APIs: Anthropic
                 input_json_delta pieces join to the non-streamed input (same
                 seed), the tool_use goes back with a tool_result; a Responses
                 function_call whose argument deltas join to its arguments,
                 continued by a function_call_output.
  tool_auto      tool_choice auto (the model opens calls itself; steered to
                 the markers by logit_bias at temperature 1): every call it
                 returns on chat completions, /v1/messages and /v1/responses,
                 streamed or not, has arguments that validate against its
                 function's schema; parallel_tool_calls false / Anthropic
                 disable_parallel_tool_use allow one call; a streamed call joins
                 to the non-streamed one; the texts are the same on the
                 batched 2-worker server as on the reference path alone.
  refusals       an unsupported keyword is a 400 naming it (param + message).
  mask_metrics   the reference path computes its masks after the forward
                 (--mask-thread off: same_ids and tool_auto then compare the
                 overlapped masks with those), the server under test on its
                 mask thread during the forward (--mask-thread on): /metrics
                 shows both counted, the server's mostly overlapped, the
                 reference's none (and it waited for all its mask time).
  verify_rows    on K3's real vocabulary, drafting (ngram) with the masks of
                 the drafted verify rows computed during the verify forward
                 (--mask-thread on) against no drafting and masks after the
                 forward (--draft off --mask-thread off): constrained requests
                 whose outputs repeat (so drafts hit), greedy and at
                 temperature 1.3 with seeds, give the same texts, and /metrics shows verify-row masks
                 used (a wrong row mask changes a draw or lets a banned token
                 through).
  verify_tools   the same for tool-call constraints (tool_choice auto and
                 required with two tools, and a named function), with an
                 earlier call of the tool in the history so drafts hit inside
                 the call: the same sampled ids (return_token_ids) as the
                 reference, greedy and seeded, and verify-row masks used by
                 the tool constraints on /metrics.
"""
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

SRC = os.environ.get("SHOAL_SRC", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
import harness  # noqa: E402

R = harness.Recorder("test_constrain")
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
WORK = os.path.join(BUILD, "constrain")
N_SCHEMAS = int(os.environ.get("SHOAL_CONSTRAIN_SCHEMAS", "24"))

try:
    import jsonschema
except ImportError:
    jsonschema = None


class Server(harness.Serve):
    def __init__(self, model, name, *args, env=None):
        super().__init__([BIN, "serve", "--model", model, "--port", "0", "--model-name", name, "--threads", "1",
                          "--memo", "0", *args], ready=60, env=env)
        self.name = name
        import openai
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# ------------------------------------------------------------ generator --

PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,8}$", "^\\d{3}-\\d{4}$", "ab", "^(cat|dog)s?$", "^[a-f0-9]+$"]
FORMATS = ["date", "uuid", "email", "time", "date-time"]
WORDS = ["alpha", "beta", "gamma", "delta", "x", "y", "id", "name", "count", "tags", "é", "日本"]


def gen_leaf(r):
    k = r.choice(["string", "string", "integer", "number", "boolean", "null", "enum", "const", "typelist"])
    if k == "string":
        s = {"type": "string"}
        v = r.random()
        if v < 0.3:
            lo = r.randint(0, 3)
            s["minLength"] = lo
            s["maxLength"] = lo + r.randint(0, 8)
        elif v < 0.5:
            s["pattern"] = r.choice(PATTERNS)
        elif v < 0.7:
            s["format"] = r.choice(FORMATS)
        return s
    if k in ("integer", "number", "boolean", "null"):
        return {"type": k}
    if k == "enum":
        pool = ["red", "green", "blue", 1, 2.5, None, True, "日本", {"a": 1}, [1, "x"]]
        return {"enum": r.sample(pool, r.randint(1, 4))}
    if k == "const":
        return {"const": r.choice(["fixed", 42, {"k": [True, None]}])}
    return {"type": r.sample(["string", "integer", "boolean", "null"], r.randint(2, 3))}


def gen_schema(r, depth=0):
    if depth >= 3 or r.random() < 0.35:
        return gen_leaf(r)
    k = r.choice(["object", "object", "array", "anyOf", "oneOf"])
    if k == "object":
        names = r.sample(WORDS, r.randint(1, 4))
        props = {n: gen_schema(r, depth + 1) for n in names}
        s = {"type": "object", "properties": props, "required": [n for n in names if r.random() < 0.6]}
        v = r.random()
        if v < 0.6:
            s["additionalProperties"] = False
        elif v < 0.8:
            s["additionalProperties"] = {"type": "integer"}
        return s
    if k == "array":
        s = {"type": "array"}
        if r.random() < 0.3:
            s["prefixItems"] = [gen_schema(r, depth + 1) for _ in range(r.randint(1, 2))]
            s["items"] = False if r.random() < 0.5 else gen_schema(r, depth + 1)
        else:
            s["items"] = gen_schema(r, depth + 1)
        lo = r.randint(0, 2)
        s["minItems"] = min(lo, len(s.get("prefixItems", []))) if s.get("items") is False else lo
        s["maxItems"] = s["minItems"] + r.randint(0, 3)
        return s
    # anyOf: anything; oneOf: alternatives of distinct JSON types so exactly one matches
    if k == "anyOf":
        return {"anyOf": [gen_schema(r, depth + 1) for _ in range(r.randint(2, 3))]}
    types = r.sample(["string", "integer", "boolean", "null", "object", "array"], 2)
    alts = []
    for t in types:
        if t == "object":
            alts.append({"type": "object", "properties": {"v": gen_leaf(r)}, "required": ["v"],
                         "additionalProperties": False})
        elif t == "array":
            alts.append({"type": "array", "items": gen_leaf(r), "maxItems": 2})
        else:
            alts.append({"type": t})
    return {"oneOf": alts}


def gen_recursive(r):
    node = {"type": "object", "properties": {"label": gen_leaf(r),
                                             "children": {"type": "array", "maxItems": 2,
                                                          "items": {"$ref": "#/$defs/node"}}},
            "required": ["label"], "additionalProperties": False}
    return {"$defs": {"node": node}, "$ref": "#/$defs/node"}


# ------------------------------------------------------------ oracles --

def json_prefix_ok(text):
    """Is text a prefix of some JSON text? A scanner written from RFC 8259."""
    stack = []  # 'o' object, 'a' array
    i, n = 0, len(text)
    state = "value"  # value | after | key | colon
    while i < n:
        c = text[i]
        if c in " \t\n\r":
            i += 1
            continue
        if state in ("value", "key"):
            if state == "key" and c == "}" and stack and stack[-1] == "o":
                stack.pop()
                state = "after"
                i += 1
                continue
            if state == "value" and c == "]" and stack and stack[-1] == "a":
                stack.pop()
                state = "after"
                i += 1
                continue
            if c == '"':
                j = i + 1
                while j < n and text[j] != '"':
                    if text[j] == "\\":
                        j += 1
                    j += 1
                if j >= n:
                    return True  # an open string
                i = j + 1
                state = "colon" if state == "key" else "after"
                continue
            if state == "key":
                return False
            if c == "{":
                stack.append("o")
                state = "key"
                i += 1
                continue
            if c == "[":
                stack.append("a")
                state = "value"
                i += 1
                continue
            m = re.match(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?", text[i:])
            lit = next((w for w in ("true", "false", "null") if text[i:].startswith(w[:max(1, min(len(w), n - i))])), None)
            if lit and text[i:i + len(lit)] == lit:
                i += len(lit)
                state = "after"
                continue
            if lit and i + len(lit) > n:
                return True
            if m and m.end() > 0:
                i += m.end()
                state = "after"
                continue
            return False
        if state == "colon":
            if c != ":":
                return False
            state = "value"
            i += 1
            continue
        if state == "after":
            if not stack:
                return False
            if c == ",":
                state = "key" if stack[-1] == "o" else "value"
                i += 1
                continue
            if (c == "}" and stack[-1] == "o") or (c == "]" and stack[-1] == "a"):
                stack.pop()
                i += 1
                continue
            return False
    return True


def validate(schema, obj):
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errs = list(v.iter_errors(obj))
    return "; ".join(e.message for e in errs[:2])


# ------------------------------------------------------------ cases --

def chat(srv, messages, max_tokens, **kw):
    return srv.client.chat.completions.create(model=srv.name, messages=messages, max_tokens=max_tokens, **kw)


def t_property(srv, label, count, seed):
    r = random.Random(seed)
    stats = {"stop": 0, "length": 0}
    for k in range(count):
        schema = gen_recursive(r) if k % 5 == 4 else gen_schema(r)
        case = f"property/{label}/{k}"
        try:
            resp = chat(srv, [{"role": "user", "content": "Give me JSON."}], 60, temperature=1.5, seed=k,
                        response_format={"type": "json_schema",
                                         "json_schema": {"name": "s", "strict": True, "schema": schema}})
        except Exception as e:  # noqa: BLE001
            R.record("FAIL", case, f"{json.dumps(schema)}: {e}"[:600])
            continue
        ch = resp.choices[0]
        text = ch.message.content or ""
        stats[ch.finish_reason] = stats.get(ch.finish_reason, 0) + 1
        if ch.finish_reason == "stop":
            try:
                obj = json.loads(text)
            except ValueError as e:
                R.record("FAIL", case, f"not JSON: {text!r} ({e}) schema {json.dumps(schema)}"[:600])
                continue
            why = validate(schema, obj)
            R.check(case, not why, f"{why}: {text!r} schema {json.dumps(schema)}"[:600])
        elif ch.finish_reason == "length":
            R.check(case, json_prefix_ok(text), f"cut output is no JSON prefix: {text!r}"[:600])
        else:
            R.record("FAIL", case, f"finish_reason {ch.finish_reason}: {text!r}")
    print(f"  {label}: finish reasons {stats}", flush=True)
    R.check(f"property/{label}/finished_some", stats["stop"] >= count // 4,
            f"too few outputs finished to test the oracle: {stats}")


def t_json_object(srv, label):
    ok = 0
    for seed in range(4):
        resp = chat(srv, [{"role": "user", "content": "JSON please"}], 80, temperature=1.2, seed=seed,
                    response_format={"type": "json_object"})
        ch = resp.choices[0]
        text = ch.message.content or ""
        if ch.finish_reason == "stop":
            try:
                good = isinstance(json.loads(text), dict)
            except ValueError:
                good = False
            ok += 1
            R.check(f"json_object/{label}/{seed}", good, repr(text)[:300])
        else:
            R.check(f"json_object/{label}/{seed}", ch.finish_reason == "length" and json_prefix_ok(text),
                    f"{ch.finish_reason} {text!r}"[:300])


# llama.cpp's grammars/arithmetic.gbnf and grammars/list.gbnf, as published
ARITH_GBNF = r"""root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"""
LIST_GBNF = r"""root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""


def arith_ok(s):
    """An independent parser of arithmetic.gbnf: every end position each rule
    can reach from i (the grammar is ambiguous around white space)."""
    import functools

    @functools.lru_cache(maxsize=None)
    def ws(i):
        out = {i}
        while i < len(s) and s[i] in " \t\n":
            i += 1
            out.add(i)
        return frozenset(out)

    @functools.lru_cache(maxsize=None)
    def term(i):
        out = set()
        if i < len(s) and "a" <= s[i] <= "z":
            j = i + 1
            ends = {j}
            while j < len(s) and (s[j].islower() and s[j].isascii() or s[j].isdigit() and s[j].isascii() or s[j] == "_"):
                j += 1
                ends.add(j)
            for e in ends:
                out |= ws(e)
        if i < len(s) and s[i].isdigit() and s[i].isascii():
            j = i
            ends = set()
            while j < len(s) and s[j].isdigit() and s[j].isascii():
                j += 1
                ends.add(j)
            for e in ends:
                out |= ws(e)
        if i < len(s) and s[i] == "(":
            for a in ws(i + 1):
                for b in expr(a):
                    if b < len(s) and s[b] == ")":
                        out |= ws(b + 1)
        return frozenset(out)

    @functools.lru_cache(maxsize=None)
    def expr(i):
        out = set(term(i))
        frontier = set(out)
        while frontier:
            nxt = set()
            for e in frontier:
                if e < len(s) and s[e] in "-+*/":
                    nxt |= term(e + 1)
            frontier = nxt - out
            out |= nxt
        return frozenset(out)

    def line(i):
        out = set()
        for a in expr(i):
            if a < len(s) and s[a] == "=":
                for b in ws(a + 1):
                    for c in term(b):
                        if c < len(s) and s[c] == "\n":
                            out.add(c + 1)
        return out

    reach, frontier = set(), {0}
    while frontier:
        nxt = set()
        for i in frontier:
            nxt |= line(i)
        frontier = nxt - reach
        reach |= nxt
    return len(s) in reach


def end_bias(model):
    """logit_bias favouring the ids that end a reply ([EOS], <|end_of_msg|>,
    <|close|>): the mask offers them only once the grammar accepts, so a
    grammar of repeated lines (root ::= item+) ends at its first complete
    point instead of running to max_tokens"""
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        dec = json.load(f)["added_tokens_decoder"]
    return {k: 8 for k, v in dec.items() if v["content"] in ("[EOS]", "<|end_of_msg|>", "<|close|>")}


def t_gbnf(srv, label):
    bias = end_bias(NANO)
    done = 0
    for seed in range(4):
        for key in ("grammar", "guided_grammar"):
            resp = chat(srv, [{"role": "user", "content": "Some equations"}], 60, temperature=1.0, seed=seed,
                        logit_bias=bias, extra_body={key: ARITH_GBNF})
            ch = resp.choices[0]
            if ch.finish_reason == "stop":
                done += 1
                R.check(f"gbnf/{label}/arithmetic/{key}/{seed}", arith_ok(ch.message.content), repr(ch.message.content))
        c = srv.client.completions.create(model=srv.name, prompt="Shopping list:\n", max_tokens=60, temperature=1.0,
                                          seed=seed, logit_bias=bias, extra_body={"grammar": LIST_GBNF})
        t = c.choices[0].text
        if c.choices[0].finish_reason == "stop":
            done += 1
            R.check(f"gbnf/{label}/list/{seed}",
                    re.fullmatch(r"(- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+", t) is not None, repr(t))
    R.check(f"gbnf/{label}/some_finished", done >= 3, f"only {done} grammar outputs finished")
    R.check(f"gbnf/{label}/oracle_refuses", not arith_ok("a+=1\n") and not arith_ok("x + 2=1\n") and
            arith_ok("x +2 *(y -3)= 4\nb=c\n"), "the test's parser is wrong")


def t_n_choices(srv, label):
    """n = 3: every choice (forked jobs) carries its own matcher"""
    resp = chat(srv, [{"role": "user", "content": "JSON"}], 60, temperature=1.3, seed=11, n=3,
                response_format={"type": "json_object"})
    for ch in resp.choices:
        text = ch.message.content or ""
        if ch.finish_reason == "stop":
            try:
                good = isinstance(json.loads(text), dict)
            except ValueError:
                good = False
        else:
            good = ch.finish_reason == "length" and json_prefix_ok(text)
        R.check(f"n_choices/{label}/{ch.index}", good, f"{ch.finish_reason} {text!r}"[:300])
    R.check(f"n_choices/{label}/distinct", len({c.message.content for c in resp.choices}) > 1,
            "three seeded choices gave one text")


def t_regex_choice(srv, label):
    pat = r"(yes|no), [0-9]{2,4} (apples|pears)"
    for seed in range(3):
        resp = chat(srv, [{"role": "user", "content": "Answer"}], 40, temperature=1.5, seed=seed,
                    extra_body={"guided_regex": pat})
        text = resp.choices[0].message.content
        R.check(f"regex/{label}/chat/{seed}", resp.choices[0].finish_reason == "stop" and re.fullmatch(pat, text),
                f"{resp.choices[0].finish_reason} {text!r}")
        c = srv.client.completions.create(model=srv.name, prompt="The answer is", max_tokens=40, temperature=1.5,
                                          seed=seed, extra_body={"guided_regex": pat})
        R.check(f"regex/{label}/completion/{seed}", c.choices[0].finish_reason == "stop" and
                re.fullmatch(pat, c.choices[0].text), f"{c.choices[0].finish_reason} {c.choices[0].text!r}")
    choices = ["Paris", "Lyon", "Marseille", "日本語"]
    for seed in range(3):
        resp = chat(srv, [{"role": "user", "content": "Pick"}], 20, temperature=2.0, seed=seed,
                    extra_body={"guided_choice": choices})
        R.check(f"choice/{label}/{seed}", resp.choices[0].message.content in choices,
                repr(resp.choices[0].message.content))


def t_sdk_parse(srv, label):
    import enum
    from typing import List, Optional

    import pydantic

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Item(pydantic.BaseModel):
        name: str
        qty: int

    class Order(pydantic.BaseModel):
        customer: str
        color: Color
        note: Optional[str]
        items: List[Item]

    parse = getattr(srv.client.chat.completions, "parse", None) or srv.client.beta.chat.completions.parse
    got = 0
    for seed in range(3):
        try:
            resp = parse(model=srv.name, messages=[{"role": "user", "content": "An order"}], response_format=Order,
                         max_tokens=200, temperature=0.8, seed=seed)
        except Exception as e:  # noqa: BLE001  (a length cut raises LengthFinishReasonError)
            if type(e).__name__ == "LengthFinishReasonError":
                continue
            R.record("FAIL", f"sdk_parse/{label}/{seed}", repr(e)[:400])
            continue
        p = resp.choices[0].message.parsed
        got += 1
        R.check(f"sdk_parse/{label}/{seed}", isinstance(p, Order), repr(resp.choices[0].message.content)[:300])
    R.check(f"sdk_parse/{label}/some_parsed", got >= 1, "every try was cut by max_tokens")


def t_tool_args(srv, label):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "days": {"type": "integer"},
                                               "unit": {"enum": ["celsius", "fahrenheit"]},
                                               "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
              "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    done = 0
    for seed in range(4):
        for choice in ({"type": "function", "function": {"name": "get_weather"}},):
            resp = chat(srv, [{"role": "user", "content": "Weather in Paris?"}], 300, temperature=1.0, seed=seed,
                        tools=tools, tool_choice=choice)
            ch = resp.choices[0]
            case = f"tool_args/{label}/{seed}"
            if ch.finish_reason == "length":
                R.check(case, not ch.message.tool_calls, "a cut call returned as a tool call")
                continue
            calls = ch.message.tool_calls or []
            if not R.check(case + "/one_call", len(calls) == 1 and calls[0].function.name == "get_weather" and
                           ch.finish_reason == "tool_calls", f"{ch.finish_reason} {ch.message}"[:400]):
                continue
            try:
                args = json.loads(calls[0].function.arguments)
            except ValueError as e:
                R.record("FAIL", case, f"arguments do not parse: {calls[0].function.arguments!r} {e}")
                continue
            why = validate(params, args)
            done += 1
            R.check(case, not why, f"{why}: {calls[0].function.arguments!r}")
    R.check(f"tool_args/{label}/some_finished", done >= 1, "every call was cut by max_tokens")


AUTO_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer"},
                                         "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 12},
                                         "exact": {"type": "boolean"},
                                         "where": {"type": "object", "properties": {"lang": {"const": "en"}},
                                                   "required": ["lang"], "additionalProperties": False}},
        "required": ["q", "where"], "additionalProperties": False}}},
]
AUTO_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in AUTO_TOOLS}


def marker_bias(model_dir, open_v, close_v):
    """logit_bias pushing the structural markers <|open|> and <|close|>:
    the content closes at once and, where K3's format offers them, the model
    picks between opening a tools section / a call and closing it (the
    constraint decides what may follow each)"""
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        dec = json.load(f)["added_tokens_decoder"]
    want = {"<|open|>": open_v, "<|close|>": close_v}
    return {k: want[v["content"]] for k, v in dec.items() if v["content"] in want}


def auto_check(case, name, args_text):
    """one returned call: a declared tool, arguments that parse and validate"""
    if not R.check(case + "/name", name in AUTO_SCHEMAS, f"undeclared tool {name!r}"):
        return False
    try:
        args = json.loads(args_text) if isinstance(args_text, str) else args_text
    except ValueError as e:
        R.record("FAIL", case, f"arguments do not parse: {args_text!r} {e}")
        return False
    why = validate(AUTO_SCHEMAS[name], args)
    return R.check(case, not why, f"{why}: {args_text!r}"[:400])


def t_tool_auto(srv, ref, label, tok_dir, seeds):
    """tool_choice auto: calls the model opens itself are constrained"""
    bias = marker_bias(tok_dir, 100, 85)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]

    def kw(seed):
        k = dict(temperature=1.0, seed=seed, logit_bias=bias, tools=AUTO_TOOLS, tool_choice="auto")
        if seed % 2:
            k["parallel_tool_calls"] = False
        return k

    def shape(resp):
        ch = resp.choices[0]
        return (ch.finish_reason, ch.message.content,
                [(c.function.name, c.function.arguments) for c in (ch.message.tool_calls or [])])

    alone = {sd: shape(chat(ref, msgs, 160, **kw(sd))) for sd in seeds} if ref else None
    got = {}

    def run(sd):
        got[sd] = shape(chat(srv, msgs, 160, **kw(sd)))

    ths = [threading.Thread(target=run, args=(sd,)) for sd in seeds]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    ncalls = nocall = 0
    stream_seed = None
    for sd in seeds:
        fin, content, calls = got[sd]
        case = f"tool_auto/{label}/chat/{sd}"
        if alone is not None:
            R.check(case + "/same_as_alone", got[sd] == alone[sd], f"{alone[sd]!r} vs {got[sd]!r}"[:500])
        for i, (name, args) in enumerate(calls):
            auto_check(f"{case}/{i}", name, args)
        if sd % 2:
            R.check(case + "/one_call_at_most", len(calls) <= 1, f"{len(calls)} calls with parallel_tool_calls false")
        if fin == "tool_calls":
            R.check(case + "/finish", len(calls) >= 1, "finish_reason tool_calls without a call")
            ncalls += len(calls)
            stream_seed = sd if stream_seed is None else stream_seed
        elif fin == "stop":
            nocall += 1
    print(f"  tool_auto {label}: {ncalls} calls, {nocall} replies without one, over {len(seeds)} seeds", flush=True)
    R.check(f"tool_auto/{label}/chat/some_calls", ncalls >= 1, "no call was opened: the test steers nothing")
    if stream_seed is not None:
        names, args = {}, {}
        for ev in srv.client.chat.completions.create(model=srv.name, messages=msgs, max_tokens=160, stream=True,
                                                     **kw(stream_seed)):
            for tc in (ev.choices[0].delta.tool_calls or []) if ev.choices else []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        joined = [(names.get(i), args.get(i, "")) for i in sorted(set(names) | set(args))]
        R.check(f"tool_auto/{label}/chat_stream", joined == got[stream_seed][2],
                f"{joined!r} vs {got[stream_seed][2]!r}"[:500])
    try:
        import anthropic
    except ImportError:
        R.record("SKIP", f"tool_auto/{label}/anthropic", "anthropic SDK missing (tools/requirements.txt)")
        return
    ac = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    atools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in AUTO_TOOLS]
    uses_n = 0
    for sd in seeds:
        tc = {"type": "auto", "disable_parallel_tool_use": True} if sd % 2 else {"type": "auto"}
        akw = dict(model=srv.name, max_tokens=160, tools=atools, tool_choice=tc, messages=msgs,
                   extra_body={"temperature": 1.0, "seed": sd, "logit_bias": bias})
        m = ac.messages.create(**akw)
        uses = [b for b in m.content if b.type == "tool_use"]
        for i, u in enumerate(uses):
            auto_check(f"tool_auto/{label}/anthropic/{sd}/{i}", u.name, u.input)
        if sd % 2:
            R.check(f"tool_auto/{label}/anthropic/{sd}/one_at_most", len(uses) <= 1, f"{len(uses)} tool_use blocks")
        uses_n += len(uses)
        if uses and m.stop_reason == "tool_use":
            parts = {}
            for ev in ac.messages.create(stream=True, **akw):
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    parts[ev.index] = parts.get(ev.index, "") + ev.delta.partial_json
            joined = [json.loads(v) for _, v in sorted(parts.items())]
            R.check(f"tool_auto/{label}/anthropic/{sd}/stream", joined == [u.input for u in uses],
                    f"{joined!r} vs {[u.input for u in uses]!r}"[:400])
    R.check(f"tool_auto/{label}/anthropic/some_calls", uses_n >= 1, "no tool_use over the seeds")
    import openai
    oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    rtools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
              for t in AUTO_TOOLS]
    fc_n = 0
    for sd in seeds:
        rkw = dict(model=srv.name, input="What is the weather in Paris?", max_output_tokens=160, temperature=1.0,
                   tools=rtools, tool_choice="auto", extra_body={"seed": sd, "logit_bias": bias})
        r = oc.responses.create(**rkw)
        calls = [o for o in r.output if o.type == "function_call"]
        for i, c in enumerate(calls):
            auto_check(f"tool_auto/{label}/responses/{sd}/{i}", c.name, c.arguments)
        fc_n += len(calls)
        if calls:
            parts = {}
            for ev in oc.responses.create(stream=True, **rkw):
                if ev.type == "response.function_call_arguments.done":
                    parts[ev.output_index] = ev.arguments
            R.check(f"tool_auto/{label}/responses/{sd}/stream", list(parts.values()) == [c.arguments for c in calls],
                    f"{parts!r} vs {[c.arguments for c in calls]!r}"[:400])
    R.check(f"tool_auto/{label}/responses/some_calls", fc_n >= 1, "no function_call over the seeds")


def t_isolation(srv, label):
    kw = dict(messages=[{"role": "user", "content": "Tell me about the sea."}], temperature=0)
    alone = chat(srv, max_tokens=24, **kw).choices[0].message.content
    out = {}

    def constrained():
        out["c"] = chat(srv, [{"role": "user", "content": "x"}], 40, temperature=1.0, seed=3,
                        response_format={"type": "json_object"})

    th = threading.Thread(target=constrained)
    th.start()
    together = chat(srv, max_tokens=24, **kw).choices[0].message.content
    th.join()
    R.check(f"isolation/{label}", together == alone, f"{alone!r} vs {together!r}")


def t_same_ids(srv, ref, label):
    """The same constrained requests on the batched, drafting, 2-worker server
    (concurrently) and on the reference path (--slots 1 --draft off, alone):
    the same text (a mask is per request; drafts are checked like any other)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30},
                                               "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    reqs = [dict(temperature=0, response_format={"type": "json_object"}),
            dict(temperature=1.2, seed=5, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "s", "schema": schema}}),
            dict(temperature=0, extra_body={"guided_regex": r"[a-z]+( [a-z]+){2,5}\."})]
    alone = [chat(ref, [{"role": "user", "content": "Describe the sea"}], 40, **kw).choices[0].message.content
             for kw in reqs]
    got = [None] * len(reqs)

    def run(i):
        got[i] = chat(srv, [{"role": "user", "content": "Describe the sea"}], 40, **reqs[i]).choices[0].message.content

    ths = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for i in range(len(reqs)):
        R.check(f"same_ids/{label}/{i}", got[i] == alone[i], f"{alone[i]!r} vs {got[i]!r}")


def t_verify_rows(srv, ref, label):
    """Drafting with the verify rows' masks computed during the verify
    forward (srv: ngram drafts, --mask-thread on) against no drafting and
    every mask after the forward (ref): the same texts, greedy and at
    temperature 1.3 with seeds. The constraints make the output repeat itself (an array of
    one const string, a regex of a repeated word), so the n-gram drafter's
    drafts hit and the rows' masks are used -- checked on /metrics, else the
    identity would prove nothing."""
    arr = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["sea shell", "sea salt"]},
                                                   "minItems": 6, "maxItems": 12}},
           "required": ["xs"], "additionalProperties": False}
    reqs = [dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": arr}}),
            dict(extra_body={"guided_regex": r"(wave (one|two) ){5,9}end"}),
            dict(response_format={"type": "json_object"})]
    before = mask_metrics(srv).get("shoal_constrain_masks_verify_total", 0)
    msgs = [{"role": "user", "content": "sea shell sea salt wave one wave two sea shell sea salt wave one"}]
    # greedy (the random model loops inside the constraint: long drafts hit)
    # and temperature 1.3 with seeds (any wrong row mask moves a draw)
    for i, kw in enumerate(reqs):
        for temp, seed in ((0, 0), (1.3, 0), (1.3, 1), (1.3, 2)):
            a = chat(ref, msgs, 60, temperature=temp, seed=seed, **kw).choices[0].message.content
            b = chat(srv, msgs, 60, temperature=temp, seed=seed, **kw).choices[0].message.content
            R.check(f"verify_rows/{label}/{i}/{temp}/{seed}", a == b, f"{a!r} vs {b!r}")
    used = mask_metrics(srv).get("shoal_constrain_masks_verify_total", 0) - before
    R.check(f"verify_rows/{label}/rows_used", used >= 10, f"{used} verify-row masks used")


VT_ARR = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["sea shell", "sea salt"]},
                                                "minItems": 6, "maxItems": 12}},
          "required": ["xs"], "additionalProperties": False}
VT_TOOLS = [{"type": "function", "function": {"name": "collect", "parameters": VT_ARR}},
            {"type": "function", "function": {"name": "wave", "parameters": {
                "type": "object", "properties": {"n": {"enum": ["one", "two"]}}, "required": ["n"],
                "additionalProperties": False}}}]


def t_verify_tools(srv, ref, label, tok_dir):
    """t_verify_rows for tool-call constraints: tool_choice auto and
    required (two tools: the model opens its calls, coordinator/api/toolcons.c)
    and a named function (a forced call), drafting with the verify rows'
    masks computed during the verify forward (srv) against no drafting and
    every mask after the forward (ref): the same sampled ids
    (return_token_ids), greedy and at temperature 1.3 with seeds. The history
    holds an earlier call of the same tool, so the n-gram drafter drafts the
    call's markup, header and arguments; logit_bias on K3's markers leaves the
    reasoning at once (<|open|> alone: the reasoning stays free but for the
    <|open|> it bans -- a verify row that forgets the ban lets it through).
    /metrics must show verify-row masks used by the auto and required
    requests, else the identity would prove nothing."""
    prior = json.dumps({"xs": ["sea shell", "sea salt"] * 3})
    msgs = [{"role": "user", "content": "Collect sea shell sea salt"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "collect", "arguments": prior}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "Again: collect sea shell sea salt"}]
    both, open_only = marker_bias(tok_dir, 100, 85), marker_bias(tok_dir, 100, -100)
    open_only = {k: v for k, v in open_only.items() if v > 0}
    named = {"type": "function", "function": {"name": "collect"}}
    cases = [("auto", both, 0, 0), ("auto", both, 1.3, 0), ("auto", both, 1.3, 1), ("auto", open_only, 0, 0),
             ("required", both, 0, 0), ("required", both, 1.3, 1), ("named", both, 0, 0), ("named", both, 1.3, 0)]

    def ids(server, choice, bias, temp, seed):
        r = chat(server, msgs, 80, temperature=temp, seed=seed, tools=VT_TOOLS, logit_bias=bias,
                 tool_choice=named if choice == "named" else choice, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra.get("token_ids")

    used = 0
    for choice, bias, temp, seed in cases:
        before = mask_metrics(srv).get("shoal_constrain_masks_verify_total", 0)
        a, b = ids(ref, choice, bias, temp, seed), ids(srv, choice, bias, temp, seed)
        if choice != "named":
            used += mask_metrics(srv).get("shoal_constrain_masks_verify_total", 0) - before
        case = f"verify_tools/{label}/{choice}/{'open' if bias is open_only else 'markers'}/{temp}/{seed}"
        R.check(case, a == b and a, f"{a} vs {b}"[:600])
    R.check(f"verify_tools/{label}/rows_used", used >= 10, f"{used} verify-row masks used by tool constraints")


def mask_metrics(srv):
    import urllib.request
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("shoal_constrain_mask"):
            got[parts[0]] = float(parts[1])
    return got


def t_mask_metrics(srv, ref, label):
    """Both servers counted masks; the one with the mask thread on at every
    step computed most of them during a forward (a slot's first mask is
    computed at sampling time), the reference (--mask-thread off) none,
    and it waited for all of its mask time. (Whether waiting is shorter than
    computing is a timing matter: tests/bench/constrain_bench.py.)"""
    a, b = mask_metrics(srv), mask_metrics(ref)
    n_a, n_b = a.get("shoal_constrain_masks_total", 0), b.get("shoal_constrain_masks_total", 0)
    o_a, o_b = a.get("shoal_constrain_masks_overlapped_total", -1), b.get("shoal_constrain_masks_overlapped_total", -1)
    R.check(f"mask_metrics/{label}/counted", n_a > 10 and n_b > 10, f"{a} {b}")
    cb, wb = b.get("shoal_constrain_mask_seconds_total", 0), b.get("shoal_constrain_mask_wait_seconds_total", -1)
    R.check(f"mask_metrics/{label}/reference_after_forward", o_b == 0 and cb > 0 and
            abs(wb - cb) <= 1e-6 * max(1.0, n_b), f"{b}")
    R.check(f"mask_metrics/{label}/overlap_during_forward", n_a / 2 < o_a <= n_a, f"{a}")


def t_anthropic(srv, label):
    """anthropic SDK on /v1/messages: a forced tool_use whose input validates
    against input_schema, and output_config.format enforced"""
    try:
        import anthropic
    except ImportError:
        R.record("SKIP", f"anthropic/{label}", "anthropic SDK missing (tools/requirements.txt)")
        return
    cl = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                               "limit": {"type": "integer"}},
              "required": ["query", "limit"], "additionalProperties": False}
    for seed in range(4):
        m = cl.messages.create(model=srv.name, max_tokens=200, extra_body={"temperature": 1.0, "seed": seed},
                               tools=[{"name": "search", "input_schema": schema}],
                               tool_choice={"type": "tool", "name": "search"},
                               messages=[{"role": "user", "content": "find cats"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        if m.stop_reason == "max_tokens":
            R.check(f"anthropic/{label}/tool/{seed}", not uses, "a cut call returned as tool_use")
            continue
        ok = m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "search"
        why = validate(schema, uses[0].input) if ok else f"{m.stop_reason} {m.content}"
        R.check(f"anthropic/{label}/tool/{seed}", ok and not why, str(why)[:300])
    m = cl.messages.create(model=srv.name, max_tokens=120, extra_body={"temperature": 1.0},
                           output_config={"format": {"type": "json_schema", "schema": schema}},
                           messages=[{"role": "user", "content": "a query"}])
    text = "".join(b.text for b in m.content if b.type == "text")
    if m.stop_reason == "end_turn":
        R.check(f"anthropic/{label}/output_config", not validate(schema, json.loads(text)), text[:300])
    else:
        R.check(f"anthropic/{label}/output_config", json_prefix_ok(text), f"{m.stop_reason} {text!r}"[:300])


def t_tool_round_trip(srv, label):
    """a forced call end to end through both agent APIs (issue 31): streamed
    Anthropic input_json_delta pieces join to the non-streamed input, the
    tool_use goes back with a tool_result and is answered; Responses gives a
    function_call item whose streamed argument deltas join to its arguments,
    and a function_call_output continues the conversation"""
    try:
        import anthropic
        import openai
    except ImportError:
        R.record("SKIP", f"tool_round_trip/{label}", "anthropic or openai SDK missing (tools/requirements.txt)")
        return
    schema = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                               "limit": {"type": "integer"}},
              "required": ["query", "limit"], "additionalProperties": False}
    ac = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = dict(model=srv.name, max_tokens=200, extra_body={"temperature": 1.0, "seed": 7},
              tools=[{"name": "search", "input_schema": schema}], tool_choice={"type": "tool", "name": "search"},
              messages=[{"role": "user", "content": "find cats"}])
    m = ac.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    ok = m.stop_reason == "tool_use" and len(uses) == 1 and not validate(schema, uses[0].input)
    R.check(f"tool_round_trip/{label}/anthropic_forced", ok, f"{m.stop_reason} {m.content}"[:300])
    if ok:
        parts, kinds, stop = [], [], None
        for ev in ac.messages.create(stream=True, **kw):
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                parts.append(ev.delta.partial_json)
            if ev.type == "message_delta":
                stop = ev.delta.stop_reason
        R.check(f"tool_round_trip/{label}/anthropic_stream", stop == "tool_use" and parts and
                json.loads("".join(parts)) == uses[0].input and kinds[-1] == "message_stop",
                f"{stop} {''.join(parts)!r} vs {uses[0].input!r}"[:300])
        m2 = ac.messages.create(model=srv.name, max_tokens=8, extra_body={"seed": 1}, tools=kw["tools"], messages=[
            {"role": "user", "content": "find cats"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "search",
                                               "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "3 cats found"}]}])
        # Anthropic's input_tokens leaves out what was read from the prompt cache (on by
        # default): the whole prompt is the sum
        def prompt_len(u):
            return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        R.check(f"tool_round_trip/{label}/anthropic_result", m2.stop_reason in ("end_turn", "max_tokens") and
                prompt_len(m2.usage) > prompt_len(m.usage), f"{m2.stop_reason} {m2.usage} after {m.usage}")
    oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    rkw = dict(model=srv.name, input="find cats", max_output_tokens=200, temperature=1.0, extra_body={"seed": 7},
               tools=[{"type": "function", "name": "search", "parameters": schema, "strict": True}],
               tool_choice={"type": "function", "name": "search"})
    r = oc.responses.create(**rkw)
    calls = [o for o in r.output if o.type == "function_call"]
    ok = len(calls) == 1 and calls[0].name == "search" and not validate(schema, json.loads(calls[0].arguments))
    R.check(f"tool_round_trip/{label}/responses_forced", ok, str(r.output)[:300])
    if ok:
        parts, done_args = [], None
        for ev in oc.responses.create(stream=True, **rkw):
            if ev.type == "response.function_call_arguments.delta":
                parts.append(ev.delta)
            elif ev.type == "response.function_call_arguments.done":
                done_args = ev.arguments
        R.check(f"tool_round_trip/{label}/responses_stream", "".join(parts) == calls[0].arguments == done_args,
                f"{''.join(parts)!r} {done_args!r} vs {calls[0].arguments!r}"[:300])
        r2 = oc.responses.create(model=srv.name, max_output_tokens=8, extra_body={"seed": 1}, tools=rkw["tools"],
                                 input=[{"role": "user", "content": "find cats"},
                                        {"type": "function_call", "call_id": calls[0].call_id, "name": "search",
                                         "arguments": calls[0].arguments},
                                        {"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "3 cats found"}])
        R.check(f"tool_round_trip/{label}/responses_output", r2.status in ("completed", "incomplete") and
                r2.usage.input_tokens > r.usage.input_tokens, f"{r2.status} {r2.usage}")


def t_refusals(srv, label):
    import openai
    cases = [
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "/properties/n/minimum"),
        ({"type": "string", "pattern": "^(a|b)*a(a|b){24}$"}, "too many"),
        ({"type": "object", "patternProperties": {"a": {}}}, "patternProperties"),
    ]
    for schema, needle in cases:
        try:
            chat(srv, [{"role": "user", "content": "x"}], 5,
                 response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            R.record("FAIL", f"refusals/{label}/{needle}", "accepted")
        except openai.BadRequestError as e:
            b = e.body or {}
            R.check(f"refusals/{label}/{needle}", b.get("param") == "response_format.json_schema.schema" and
                    needle in (b.get("message") or ""), json.dumps(b)[:300])


def real_dir():
    d = os.environ.get("SHOAL_K3_TOKENIZER_DIR") or os.path.join(SRC, "..", "shared", "k3")
    return d if os.path.exists(os.path.join(d, "tiktoken.model")) else None


def real_vocab_model(real):
    gen = os.path.join(WORK, "tiny-k3-vocab")
    if not os.path.exists(os.path.join(gen, "model.safetensors.index.json")):
        subprocess.run([sys.executable, os.path.join(SRC, "tools", "make_tiny_k3.py"), "--preset", "tiny-k3-vocab",
                        "--out", gen], check=True, capture_output=True, timeout=600)
    return gen


def main():
    if jsonschema is None:
        R.record("SKIP", "all", "python jsonschema missing (tools/requirements.txt; scripts/deps.sh installs it)")
        return 77
    os.makedirs(WORK, exist_ok=True)
    t0 = time.time()
    # the server under test computes its masks on the mask thread during the
    # forward at every step (--mask-thread on: k3-nano's forward is too
    # short for the default to hand over), the reference after the forward
    # (--mask-thread off)
    srv = Server(NANO, "nano", "--slots", "4", "--workers", "2", "--worker-threads", "1", "--mask-thread", "on")
    ref = Server(NANO, "nano", "--slots", "1", "--draft", "off", "--mask-thread", "off")
    try:
        t_same_ids(srv, ref, "nano")
        t_tool_auto(srv, ref, "nano", NANO, range(8))
        t_mask_metrics(srv, ref, "nano")
    finally:
        ref.stop()
    try:
        t_refusals(srv, "nano")
        t_anthropic(srv, "nano")
        t_tool_round_trip(srv, "nano")
        t_json_object(srv, "nano")
        t_n_choices(srv, "nano")
        t_gbnf(srv, "nano")
        t_regex_choice(srv, "nano")
        t_sdk_parse(srv, "nano")
        t_isolation(srv, "nano")
        t_tool_args(srv, "nano")
        t_property(srv, "nano", N_SCHEMAS, 36)
    finally:
        srv.stop()
    print(f"  nano: {time.time() - t0:.1f} s", flush=True)
    real = real_dir()
    if not real:
        R.record("SKIP", "property/real_vocab", "K3's real vocabulary is not beside the checkout "
                 "(../shared/k3/tiktoken.model; SHOAL_K3_TOKENIZER_DIR)")
    else:
        t1 = time.time()
        srv = Server(real_vocab_model(real), "k3v", "--tokenizer", real, "--mask-thread", "on")
        ref = Server(real_vocab_model(real), "k3v", "--tokenizer", real, "--slots", "1", "--draft", "off",
                     "--mask-thread", "off")
        try:
            t_verify_rows(srv, ref, "real_vocab")
            t_verify_tools(srv, ref, "real_vocab", real)
        finally:
            ref.stop()
        try:
            t_json_object(srv, "real_vocab")
            t_tool_args(srv, "real_vocab")
            t_tool_auto(srv, None, "real_vocab", real, range(3))
            t_property(srv, "real_vocab", max(4, N_SCHEMAS // 2), 3636)
        finally:
            srv.stop()
        print(f"  real vocabulary: {time.time() - t1:.1f} s", flush=True)
    if R.counts["FAIL"]:
        return 1
    return 77 if not R.counts["PASS"] else 0


if __name__ == "__main__":
    sys.exit(main())
