#!/usr/bin/env python3
"""An independent Python oracle of K3's tokenizer and chat format, written from
/work/shared/k3/SPEC.md §5 (not from shoal's C code), for the parity tests
(tests/e2e/test_tokenizer_oracle.py, tests/e2e/test_k3_real_vocab.py) and the
benchmarks (tests/bench/tok_bench.py).

Moonshot's own tokenization_kimi.py and encoding_k3.py are not available
offline, so their behaviour is reproduced here from the SPEC:

  KimiTokenizer   tokenization_kimi.py's TikTokenTokenizer: a tiktoken 0.14
                  Encoding with the K3 pattern (SPEC §5.2, in tiktoken's own
                  fancy-regex syntax with `&&`), the ranks of tiktoken.model and
                  the special tokens of tokenizer_config.json plus
                  "<|reserved_token_ID|>" for the unnamed reserved ids (§5.1,
                  §5.3); encode() cuts the text every 400,000 characters and
                  before runs of more than 25,000 consecutive white-space / non-
                  white-space characters (str.isspace), and encodes each part with
                  allowed_special="all" (allow_special_tokens=True) or
                  disallowed_special=() (False) -- special-token strings are then
                  ordinary text, never an error (§5.2 "extra behaviour").
  xtml_segments   encoding_k3.py's segment list (text, allow_special) for chat
                  messages (§5.4): elements <|open|> TAG [ key="value"]* <|sep|>
                  ... <|close|> TAG <|sep|>, each attribute as the segments
                  " key", '="', value, '"'; messages end with <|end_of_msg|>.
                  Checked against the official encoder's segments
                  (tests/fixtures/tokenizer/xtml_official.json) by the tests.
  xtml_encode     each segment encoded on its own (§5.4 "Segmentation matters"):
                  special segments as their one id, text with specials off.

Open point: a whitespace-only reasoning_content renders as an empty think
element (see xtml_segments); the SPEC says only "possibly empty".

Partial mode (continue_final) is modelled as vLLM's continue_final_message (the final
assistant message rendered, its closing cut off).

Not covered (the SPEC leaves them open or they are not needed here): content
given as a list of parts, thinking_effort, tool_choice "none",
response_format, tool messages that do not match the last assistant's calls.
"""
import base64
import json
import os

K3_SIZE = 2795286
K3_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# SPEC §5.2, in the syntax tiktoken (fancy-regex) accepts, as tokenization_kimi.py writes it
K3_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def split_runs(s, limit=MAX_RUN_CHARS):
    """tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces: a cut before
    the character that would make a run of one kind (str.isspace or not) longer
    than `limit`."""
    run = 0
    cur = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if cur ^ sp:
            run = 1
            cur = sp
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start = i
                run = 1
    yield s[start:]


def kimi_parts(text):
    """The parts tokenization_kimi.py hands to tiktoken, in order."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        yield from split_runs(text[i:i + MAX_ENCODE_CHARS])


class KimiTokenizer:
    def __init__(self, model_dir):
        import tiktoken
        self.ranks = load_ranks(os.path.join(model_dir, "tiktoken.model"))
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        self.names = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        n = len(self.ranks)
        self.special = {self.names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
        self.enc = tiktoken.Encoding(name="k3-oracle", pat_str=K3_PAT_STR, mergeable_ranks=self.ranks,
                                     special_tokens=self.special)
        self.n_vocab = n + 256

    def encode(self, text, allow_special_tokens=True):
        out = []
        for part in kimi_parts(text):
            if allow_special_tokens:
                out += self.enc.encode(part, allowed_special="all")
            else:
                out += self.enc.encode(part, disallowed_special=())
        return out

    def encode_bytes(self, data, allow_special_tokens=True):
        """Bytes that are not UTF-8 are replaced first (U+FFFD per maximal
        invalid subpart, Python's decoder: shoal's defined behaviour)."""
        return self.encode(data.decode("utf-8", errors="replace"), allow_special_tokens)

    def decode(self, ids):
        return self.enc.decode(ids, errors="replace")


# --------------------------------------------------------------- XTML --

SPECIAL_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
TOOL_CHOICE_REQUIRED = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."


def _esc(v):
    return v.replace("&", "&amp;").replace('"', "&quot;")


class _Segs:
    def __init__(self):
        self.v = []

    def sp(self, s):
        self.v.append((s, True))

    def tx(self, s):
        if s:  # empty texts have no ids; the official lists hold none
            self.v.append((s, False))

    def open(self, tag, attrs=()):
        self.sp("<|open|>")
        self.tx(tag)
        for k, val in attrs:
            self.tx(" " + k)
            self.tx('="')
            self.tx(_esc(val))
            self.tx('"')
        self.sp("<|sep|>")

    def close(self, tag):
        self.sp("<|close|>")
        self.tx(tag)
        self.sp("<|sep|>")

    def element(self, tag, attrs, body):
        self.open(tag, attrs)
        self.tx(body)
        self.close(tag)

    def message(self, attrs, body_fn):
        self.open("message", attrs)
        body_fn()
        self.close("message")
        self.sp("<|end_of_msg|>")


def _plain(v):
    if isinstance(v, _Num):
        return json.loads(v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _compact(v):
    return json.dumps(_plain(v), separators=(",", ":"), ensure_ascii=False)


class _Num(str):
    """A JSON number kept as its text (the official output shows "1e2" verbatim)."""


def _loads_keep_numbers(s):
    return json.loads(s, parse_int=_Num, parse_float=_Num)


def _arg(segs, key, val):
    if isinstance(val, _Num) or (isinstance(val, (int, float)) and not isinstance(val, bool)):
        typ, text = "number", str(val)
    elif isinstance(val, str):
        typ, text = "string", val
    elif isinstance(val, bool):
        typ, text = "boolean", "true" if val else "false"
    elif val is None:
        typ, text = "null", "null"
    elif isinstance(val, list):
        typ, text = "array", _compact(val)
    else:
        typ, text = "object", _compact(val)
    segs.element("argument", [("key", key), ("type", typ)], text)


def _content(m):
    c = m.get("content")
    if c is None:
        return ""
    if not isinstance(c, str):
        raise ValueError("k3_oracle: only string content is modelled")
    return c


def xtml_segments(messages, thinking=True, add_generation_prompt=True, tools=None, tool_choice=None,
                  continue_final=False):
    """continue_final: Moonshot's partial mode, modelled as vLLM's continue_final_message: the
    conversation is rendered without a generation prompt and the closing of the final
    (assistant) message -- the response element's close, the message's close and its
    <|end_of_msg|> -- is cut off, so the model continues its content."""
    if continue_final:
        if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
            raise ValueError("k3_oracle: continue_final needs a final assistant message without tool calls")
        if tool_choice:
            raise ValueError("k3_oracle: continue_final with tool_choice is not modelled")
        segs = xtml_segments(messages, thinking=thinking, add_generation_prompt=False, tools=tools)
        tail = [("<|close|>", True), ("response", False), ("<|sep|>", True), ("<|close|>", True),
                ("message", False), ("<|sep|>", True), ("<|end_of_msg|>", True)]
        if segs[-len(tail):] != tail:
            raise ValueError("k3_oracle: the final message does not end as an assistant message")
        return segs[:-len(tail)]
    s = _Segs()
    if tools:
        body = TOOL_DECLARE_HEAD + json.dumps(tools, separators=(",", ":"), sort_keys=True,
                                              ensure_ascii=False) + "\n```"
        s.message([("role", "system"), ("type", "tool-declare")], lambda: s.tx(body))
    last_calls = []
    i = 0
    while i < len(messages):
        m = messages[i]
        role = m["role"]
        if role in ("user", "system"):
            attrs = [("role", role)] + ([("name", m["name"])] if "name" in m else [])
            s.message(attrs, lambda: s.tx(_content(m)))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            last_calls = calls

            def body():
                if thinking:
                    # SPEC §5.4: present, possibly empty, on every assistant turn. A
                    # reasoning that str.strip() leaves empty is rendered empty: the
                    # SPEC does not say; this follows WASTE's port of encoding_k3.py
                    # (the SPEC's named source for §5.4), as chat.h records it
                    r = m.get("reasoning_content") or m.get("reasoning") or ""
                    s.element("think", [], r if r.strip() else "")
                s.element("response", [], _content(m))
                if calls:
                    s.open("tools")
                    for k, c in enumerate(calls):
                        fn = c["function"]
                        s.open("call", [("tool", fn["name"]), ("index", str(k + 1))])
                        a = fn.get("arguments", {})
                        if isinstance(a, str):
                            try:
                                a = _loads_keep_numbers(a)
                            except ValueError:
                                s.element("json", [("type", "object")], fn["arguments"])
                                a = None
                        if a is not None:
                            for key, val in a.items():
                                _arg(s, key, val)
                        s.close("call")
                    s.close("tools")
            s.message([("role", "assistant")], body)
        elif role == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            group = messages[i:j]
            order = {c.get("id"): k for k, c in enumerate(last_calls)}
            if not all(t.get("tool_call_id") in order for t in group):
                raise ValueError("k3_oracle: unmatched tool results are not modelled")
            for t in sorted(group, key=lambda t: order[t["tool_call_id"]]):
                k = order[t["tool_call_id"]]
                name = last_calls[k]["function"]["name"]
                s.message([("role", "tool"), ("tool", name), ("index", str(k + 1))], lambda: s.tx(_content(t)))
            i = j
            continue
        else:
            raise ValueError(f"k3_oracle: role {role!r}")
        i += 1
    if tool_choice == "required":
        s.message([("role", "system"), ("type", "tool-choice")], lambda: s.tx(TOOL_CHOICE_REQUIRED))
    if add_generation_prompt:
        s.open("message", [("role", "assistant")])
        s.open("think" if thinking else "response")
    return s.v


def xtml_encode_segments(tok, segs):
    ids = []
    for text, special in segs:
        if special:
            ids.append(tok.special[text])
        else:
            ids += tok.encode(text, allow_special_tokens=False)
    return ids


def xtml_encode(tok, messages, **kw):
    return xtml_encode_segments(tok, xtml_segments(messages, **kw))
