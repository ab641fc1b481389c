"""Live HTTP fuzzer (issue 20): structure-aware mutations of valid requests of
every endpoint against a RUNNING `shoal serve --model tests/models/tiny-k3
--workers 2`, checking after every case that the process is alive (and
every few cases that /health answers 200).

Mutations: JSON fields (types, UTF-8 and invalid bytes, numbers at and past
2^63, NaN/Infinity literals, deep nesting, odd keys, duplicates, truncation,
byte flips), headers (Host twice or missing, obs-fold, Content-Length vs
chunked, Expect, Authorization, Connection, HTTP/1.0, absolute-form, odd and
unknown methods, HEAD), paths (long, UTF-8, invalid, control bytes),
chunked bodies (random splits, bad and huge sizes, extensions, trailers),
pipelining, slow (byte-at-a-time) and half-closed or abandoned connections,
streams closed early.

Two engines (SHOAL_FUZZ_HTTP_MODE):
- fast (default): SHOAL_FUZZ_HTTP_CONNS (48) connections at once (asyncio),
  most pipelining 1-32 requests whose framing is valid and whose content is
  hostile (mutated JSON, invalid UTF-8, numbers past 2^63, nesting, auth
  failures, odd paths, methods and headers, valid chunked bodies), every
  answer parsed, a case counted only when answered; a bounded share of real
  generations (SHOAL_FUZZ_HTTP_GEN_SHARE, 1% of the pipelined requests, plus
  the mutants that stay valid); the rest of the jobs
  (SHOAL_FUZZ_HTTP_SINGLE_SHARE, 12%) are the single-connection cases below,
  run concurrently. The process checked after every job, /health every
  SHOAL_FUZZ_HTTP_HEALTH_EVERY (1000) cases; a framing-valid request
  unanswered for SHOAL_FUZZ_HTTP_STALL_S (30 s) fails `no_stall`. A crash
  saves the last 256 jobs. ~2,300-4,600 cases/s on the 2-core test VM.
- serial: one case at a time (~15-20 cases/s), the run of the first 10^4.

Budget: SHOAL_FUZZ_HTTP_S seconds (default 30) or SHOAL_FUZZ_HTTP_CASES cases,
whichever ends first; SHOAL_FUZZ_SEED fixes the seed (printed either way; in
fast mode the jobs' order is the seed's, their interleaving is not);
SHOAL_FUZZ_HTTP_OUT=path writes the figures as JSON; SHOAL_BIN picks the
binary (e.g. build-asan/bin/shoal). Long run (docs/TESTING.md, ~7.5 min):
  SHOAL_FUZZ_SEED=20 SHOAL_FUZZ_HTTP_S=3600 SHOAL_FUZZ_HTTP_CASES=1000000 .venv/bin/python3 tests/e2e/test_fuzz_http_live.py
Figures: cases run, crashes found (0 to pass), server VmRSS/VmHWM and open
fds before any case, after a warm-up (SHOAL_FUZZ_HTTP_WARM, 3000 cases; serial:
300), after 10^4 and at the end (no growth allowed beyond a margin).
Appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS."""
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from harness import Recorder, terminate  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
BUDGET_S = float(os.environ.get("SHOAL_FUZZ_HTTP_S", "30"))
MAX_CASES = int(os.environ.get("SHOAL_FUZZ_HTTP_CASES", "0")) or None
MODE = os.environ.get("SHOAL_FUZZ_HTTP_MODE", "fast")  # fast (default) | serial (one case at a time)
WARM_CASES = int(os.environ.get("SHOAL_FUZZ_HTTP_WARM", "3000"))
SEED = int(os.environ.get("SHOAL_FUZZ_SEED", str(int(time.time() * 1000) % 1000000007)))
KEY = "fuzz-key"
R = Recorder("test_fuzz_http_live")
rng = random.Random(SEED)

# ---- valid requests (the seeds) -------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "max_tokens": 2, "temperature": 0}
CHAT_FULL = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                           {"role": "assistant", "content": "b", "tool_calls": [
                                               {"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]},
                                           {"role": "tool", "tool_call_id": "c1", "content": "r"}],
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "tool_choice": "auto", "response_format": {"type": "json_object"}, "max_tokens": 2, "seed": 1,
             "top_p": 0.9, "stop": ["x"], "stream": False, "user": "u", "reasoning_effort": "low"}
COMP = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
COMP_STR = {"model": "tiny", "prompt": "hello", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
# the Anthropic Messages and OpenAI Responses translations (issue 31)
MSG = {"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
       "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"},
                                                      {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r",
                                                  "is_error": True}]}],
       "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
       "stop_sequences": ["x"], "temperature": 0, "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"}}
MSG_PREFILL = {"model": "tiny", "max_tokens": 1, "stream": True,
               "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
COUNT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled",
                                                                                        "budget_tokens": 1024}}
RESP = {"model": "tiny", "instructions": "s", "max_output_tokens": 2, "temperature": 0, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                  {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "r"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto"}
RESP_STREAM = {"model": "tiny", "input": "hello", "max_output_tokens": 1, "stream": True,
               "reasoning": {"effort": "none"}, "previous_response_id": "resp_x"}
POSTS = [("/v1/chat/completions", CHAT), ("/v1/chat/completions", CHAT_FULL), ("/v1/completions", COMP),
         ("/v1/completions", COMP_STR), ("/v1/messages", MSG), ("/v1/messages", MSG_PREFILL),
         ("/v1/messages/count_tokens", COUNT), ("/v1/responses", RESP), ("/v1/responses", RESP_STREAM)]
GETS = ["/health", "/metrics", "/v1/models", "/v1/models/tiny"]

ODD_STRINGS = ["", "a" * 63 + "é", "é" * 40, "\u0000", "\ud7ff\ue000", "\U0010ffff", "\u202e", "\x1b[31m",
               "a" * 5000, "tiny ", "system", "text", "json_schema", "function", "\n", "%s%n"]
ODD_NUMBERS = [0, -1, 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 1e308, -1e-308, 0.5, 128, 129, 16385]
RAW_NUMBERS = [b"9223372036854775808", b"-9223372036854775809", b"1e999", b"NaN", b"Infinity", b"-0",
               b"00", b"1.", b".5", b"0x10", b"123456789012345678901234567890"]
INVALID_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"]


def rand_value(depth=0):
    k = rng.randrange(9 if depth < 4 else 6)
    if k == 0:
        return rng.choice(ODD_STRINGS)
    if k == 1:
        return rng.choice(ODD_NUMBERS)
    if k == 2:
        return rng.choice([None, True, False])
    if k == 3:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800),
                                       rng.randrange(0x800, 0xd800), rng.randrange(0x10000, 0x110000)]))
                       for _ in range(rng.randrange(1, 70)))
    if k == 4:
        return rng.randrange(-10, 300)
    if k == 5:
        return rng.random() * rng.choice([1, 100, 1e9])
    if k == 6:
        return [rand_value(depth + 1) for _ in range(rng.randrange(4))]
    if k == 7:
        return {rng.choice(["type", "text", "role", "content", "name", "x", "a" * 63 + "é"]): rand_value(depth + 1)
                for _ in range(rng.randrange(4))}
    return "[" * 40 + "]" * 40


def mutate_tree(v, depth=0):
    """One structural mutation somewhere in v (a copy)."""
    v = json.loads(json.dumps(v))
    if isinstance(v, dict) and v and rng.random() < 0.7:
        key = rng.choice(list(v))
        r = rng.random()
        if r < 0.35:
            v[key] = mutate_tree(v[key], depth + 1)
        elif r < 0.6:
            v[key] = rand_value()
        elif r < 0.75:
            del v[key]
        else:
            v[rng.choice(["a" * 63 + "é", "max_completion_tokens", "n", "logprobs", "stream", "tools",
                          "x" * rng.randrange(1, 200), "é", "thinking", "logit_bias"])] = rand_value()
        return v
    if isinstance(v, list) and v and rng.random() < 0.7:
        i = rng.randrange(len(v))
        r = rng.random()
        if r < 0.5:
            v[i] = mutate_tree(v[i], depth + 1)
        elif r < 0.7:
            v.insert(i, rand_value())
        elif r < 0.85:
            del v[i]
        else:
            v = v * rng.randrange(2, 50)
        return v
    return rand_value()


def to_bytes(obj):
    b = json.dumps(obj, ensure_ascii=rng.random() < 0.3).encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.08:  # a raw number JSON cannot carry through Python
        b = b.replace(b"2", rng.choice(RAW_NUMBERS), 1)
    elif r < 0.16:  # invalid UTF-8 inside a string
        i = b.find(b'"', rng.randrange(len(b)))
        if i > 0:
            b = b[:i + 1] + rng.choice(INVALID_UTF8) + b[i + 1:]
    elif r < 0.22:  # truncated
        b = b[:rng.randrange(len(b))]
    elif r < 0.28:  # byte flips
        ba = bytearray(b)
        for _ in range(rng.randrange(1, 4)):
            ba[rng.randrange(len(ba))] = rng.randrange(256)
        b = bytes(ba)
    elif r < 0.32:  # a duplicated key
        b = b.replace(b'{"model": "tiny"', b'{"model": "tiny", "model": "tiny"', 1)
    elif r < 0.35:  # deep nesting
        b = b'{"model":"tiny","prompt":' + b"[" * rng.randrange(100, 3000) + b"]" * rng.randrange(100, 3000) + b"}"
    return b


def rand_path():
    r = rng.random()
    if r < 0.5:
        return rng.choice(GETS + [p for p, _ in POSTS]).encode()
    if r < 0.6:
        return b"/" + b"a" * rng.randrange(0, 200) + "é".encode()
    if r < 0.7:
        return b"/v1/models/" + rng.choice([b"a" * 63 + "é".encode(), b"\xff\xfe", b"tiny%00", b"..%2f..", b""])
    if r < 0.8:
        return b"http://127.0.0.1" + rng.choice(GETS).encode() + rng.choice([b"", b"?x=\xff", b"#f"])
    if r < 0.9:
        return bytes(rng.randrange(0x21, 256) for _ in range(rng.randrange(1, 300)))
    return rng.choice([b"*", b"/health?" + b"x" * 3000, b"//health", b"/health/", b"/HEALTH", b"/%ff"])


def build(method, path, body, headers, chunked=False, version=b"HTTP/1.1"):
    h = method + b" " + path + b" " + version + b"\r\n" + b"".join(headers)
    if body is not None:
        if chunked:
            h += b"Transfer-Encoding: chunked\r\n\r\n"
            out, i = b"", 0
            while i < len(body):
                n = rng.randrange(1, max(2, len(body) - i + 1))
                out += b"%x" % n + (b";ext=1" if rng.random() < 0.1 else b"") + b"\r\n" + body[i:i + n] + b"\r\n"
                i += n
            tail = rng.choice([b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n", b"ffffffffffffffffffff\r\n",
                               b"-1\r\n", b"zz\r\n", b"0\r\n"])
            return h + out + tail
        cl = len(body)
        if rng.random() < 0.05:
            cl = rng.choice([cl + 5, max(0, cl - 3), 2 ** 64, -1])
        h += b"Content-Length: %d\r\n" % cl if isinstance(cl, int) and cl >= 0 else b"Content-Length: x\r\n"
    return h + b"\r\n" + (body or b"")


def rand_headers(auth):
    hs = []
    r = rng.random()
    if r < 0.9:
        hs.append(b"Host: x\r\n")
    if r < 0.05:
        hs.append(b"Host: y\r\n")
    if auth:
        hs.append(b"Authorization: Bearer " + rng.choice([KEY.encode(), b" " + KEY.encode(), b"x" * 600, b"\xff",
                                                          KEY.encode(), KEY.encode()]) + b"\r\n")
    for _ in range(rng.randrange(3)):
        hs.append(rng.choice([b"Connection: close\r\n", b"Connection: keep-alive\r\n", b"Expect: 100-continue\r\n",
                              b"Expect: weird\r\n", b"X-Fold: a\r\n b\r\n", b"X-Big: " + b"a" * 20000 + b"\r\n",
                              b"Content-Type: text/plain\r\n", b"X-U: \xff\xfe\r\n", b"Upgrade: h2c\r\n",
                              b"Transfer-Encoding: gzip\r\n", b"Content-Length: 1\r\n", b"X:\r\n"]))
    if rng.random() < 0.9:
        hs.append(b"Connection: close\r\n")
    return hs


def gen_case():
    """(kind, bytes, mode): mode is 'normal', 'slow', 'half', 'abandon'."""
    auth = rng.random() < 0.85
    k = rng.random()
    mode = rng.choices(["normal", "slow", "half", "abandon"], [0.8, 0.04, 0.08, 0.08])[0]
    if k < 0.55:
        path, seed = rng.choice(POSTS)
        obj = seed
        for _ in range(rng.randrange(1, 4)):
            obj = mutate_tree(obj)
        if isinstance(obj, dict) and "max_tokens" in obj and not isinstance(obj.get("max_tokens"), (int, float)):
            pass
        body = to_bytes(obj)
        return "json", build(b"POST", path.encode() if rng.random() < 0.9 else rand_path(), body,
                             rand_headers(auth), chunked=rng.random() < 0.2), mode
    if k < 0.75:
        m = rng.choice([b"GET", b"GET", b"HEAD", b"POST", b"DELETE", b"OPTIONS", b"BREW", b"PROPFIND", b"get",
                        b"G\xffT", b"CONNECT"])
        ver = rng.choice([b"HTTP/1.1"] * 8 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.9", b"FTP/1.1"])
        return "headers", build(m, rand_path(), None if rng.random() < 0.8 else b"{}", rand_headers(auth),
                                version=ver), mode
    if k < 0.85:  # pipelining
        reqs = []
        for _ in range(rng.randrange(2, 30)):
            if rng.random() < 0.7:
                reqs.append(build(b"GET", rng.choice(GETS).encode(), None, [b"Host: x\r\n"] + (
                    [b"Authorization: Bearer " + KEY.encode() + b"\r\n"] if auth else [])))
            else:
                p, s = rng.choice(POSTS[:3])
                reqs.append(build(b"POST", p.encode(), to_bytes(mutate_tree(s)), [b"Host: x\r\n"]))
        reqs.append(build(b"GET", b"/v1/models", None, [b"Host: x\r\n", b"Connection: close\r\n"] + (
            [b"Authorization: Bearer " + KEY.encode() + b"\r\n"] if auth else [])))
        return "pipeline", b"".join(reqs), mode
    if k < 0.92:  # raw byte mutation of a whole valid request
        p, s = rng.choice(POSTS)
        ba = bytearray(build(b"POST", p.encode(), json.dumps(s).encode(), [b"Host: x\r\n", b"Connection: close\r\n"]))
        for _ in range(rng.randrange(1, 6)):
            op = rng.randrange(3)
            i = rng.randrange(len(ba))
            if op == 0:
                ba[i] = rng.randrange(256)
            elif op == 1:
                del ba[i]
            else:
                ba.insert(i, rng.randrange(256))
        return "bytes", bytes(ba), mode
    # streaming generation, possibly abandoned early
    body = json.dumps({"model": "tiny", "prompt": [1, 2], "max_tokens": rng.randrange(1, 40), "stream": True,
                       "temperature": rng.choice([0, 1])}).encode()
    return "stream", build(b"POST", b"/v1/completions", body, [b"Host: x\r\n", b"Connection: close\r\n"]), \
        rng.choice(["normal", "abandon", "abandon"])


def run_case(port, data, mode):
    s = socket.socket()
    s.settimeout(2.0)
    try:
        s.connect(("127.0.0.1", port))
        if mode == "slow":
            for i in range(0, min(len(data), 40)):
                s.send(data[i:i + 1])
                time.sleep(0.002)
            s.sendall(data[40:])
        else:
            s.sendall(data)
        if mode == "half":
            s.shutdown(socket.SHUT_WR)
        if mode == "abandon":
            if rng.random() < 0.5:
                s.recv(256)
            return
        # until the server closes; once answers came, a 0.2 s lull ends it
        # (a kept-alive connection), 1.5 s at most
        t0, got = time.time(), False
        while time.time() - t0 < 1.5:
            s.settimeout(0.2 if got else 1.5)
            b = s.recv(65536)
            if not b:
                break
            got = True
    except (OSError, socket.timeout):
        pass
    finally:
        s.close()


def proc_figures(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None


# ---- the high-rate engine (default) ----------------------------------------
#
# Many connections at once (asyncio, one process), most of them pipelining a
# batch of requests whose framing is valid (Content-Length right, or a valid
# chunked body) but whose content is hostile: mutated JSON of every endpoint,
# invalid UTF-8, raw numbers past 2^63, deep nesting, auth failures, odd
# paths and headers. Each answer is parsed (status line, headers, body by
# Content-Length or chunks), so a case counts only when the server answered
# it. The rest of the jobs are gen_case()'s single-connection cases (framing
# that breaks: byte mutations, bad chunk sizes, wrong Content-Length, slow,
# half-closed and abandoned connections, streams closed early), run
# concurrently with short waits. Every HEALTH_EVERY cases: the process alive
# and /health 200 within 5 s; every job: the process alive.

import asyncio  # noqa: E402
import collections  # noqa: E402

CONNS = int(os.environ.get("SHOAL_FUZZ_HTTP_CONNS", "48"))
HEALTH_EVERY = int(os.environ.get("SHOAL_FUZZ_HTTP_HEALTH_EVERY", "1000"))
STALL_S = float(os.environ.get("SHOAL_FUZZ_HTTP_STALL_S", "30"))
GEN_SHARE = float(os.environ.get("SHOAL_FUZZ_HTTP_GEN_SHARE", "0.01"))
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
SAFE_HEADERS = [b"Content-Type: application/json\r\n", b"Content-Type: text/plain\r\n", b"X-U: \xff\xfe\r\n",
                b"X-Big: " + b"a" * 9000 + b"\r\n", b"Upgrade: h2c\r\n", b"Expect: 100-continue\r\n",
                b"Accept: */*\r\n", b"X-Ctl: \x01\x7f\r\n", b"User-Agent: " + "é".encode() * 100 + b"\r\n",
                b"Connection: keep-alive\r\n", b"Cookie: " + b"c=" * 500 + b"\r\n", b"X-Empty:\r\n",
                b"Accept-Encoding: gzip\r\n", b"X-Request-Id: " + b"\xc3" * 40 + b"\r\n"]
BAD_AUTH = [b"", b"Authorization: Bearer wrong\r\n", b"Authorization: Bearer  " + KEY.encode() + b"\r\n",
            b"Authorization: Basic " + KEY.encode() + b"\r\n", b"Authorization: Bearer " + b"k" * 700 + b"\r\n",
            b"Authorization: Bearer \xff\xc3\r\n",
            b"Authorization: Bearer " + KEY.encode()[:-1] + b"\r\n", b"Authorization:\r\n"]
# valid requests that generate (a bounded share: GEN_SHARE of the pipelined ones)
GEN_BODIES = [json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 1}).encode(),
              json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                          "temperature": 0.7, "seed": 3}).encode(),
              json.dumps({"model": "tiny", "prompt": "é", "max_tokens": 2, "stream": True}).encode()]
# whole-body hostile JSON (cheap to answer, each hits the parser or validator)
HOSTILE_BODIES = [b"", b"{", b"[]", b"null", b"\xff\xfe", b"{\"model\":\"tiny\",\"prompt\":\"\xc3\"}",
                  b"{\"model\":\"tiny\",\"prompt\":[9223372036854775808]}",
                  b"{\"model\":\"tiny\",\"prompt\":[1],\"max_tokens\":1e999}",
                  b"{\"model\":\"tiny\",\"prompt\":[1],\"max_tokens\":-9223372036854775809}",
                  b"{\"model\":\"tiny\",\"prompt\":[1],\"temperature\":NaN}",
                  b"{\"model\":\"" + b"a" * 63 + "é".encode() + b"\",\"prompt\":[1]}",
                  b"{\"" + b"a" * 63 + "é".encode() + b"\":1}", b"{\"model\":\"tiny\",\"prompt\":[1],\"\xed\xa0\x80\":1}",
                  b"{\"model\":\"tiny\",\"messages\":[{\"role\":\"" + b"r" * 63 + "é".encode() + b"\",\"content\":\"x\"}]}",
                  b"{\"a\":" * 5000 + b"1" + b"}" * 5000, b"[" * 100000 + b"]" * 100000,
                  b"{\"model\":\"tiny\",\"prompt\":\"" + b"\\ud800" * 50 + b"\"}",
                  b"{\"model\":\"tiny\",\"prompt\":[" + b"1," * 20000 + b"1]}",
                  b"{\"model\":\"tiny\",\"prompt\":\"\x00\x01\x1b\"}", b"\"" + b"\\u0000" * 1000 + b"\""]


def fast_request(auth_ok):
    """one request whose framing is valid: (bytes, category)"""
    r = rng.random()
    hs = [b"Host: x\r\n"]
    # the scheme is case-insensitive (RFC 9110 §11.1): "bearer" is a valid key too
    hs.append((AUTH if rng.random() < 0.9 else b"Authorization: bearer " + KEY.encode() + b"\r\n") if auth_ok
              else rng.choice(BAD_AUTH))
    for _ in range(rng.randrange(3) if rng.random() < 0.3 else 0):
        hs.append(rng.choice(SAFE_HEADERS))
    cat = "mutated"
    if r < 0.45:  # a mutated body of a real endpoint
        path, seed = rng.choice(POSTS)
        obj = seed
        for _ in range(rng.randrange(1, 4)):
            obj = mutate_tree(obj)
        if isinstance(obj, dict) and rng.random() < 0.97:
            # keep generation rare: most mutants also get one field the server refuses
            obj[rng.choice(["max_tokens", "temperature", "n", "model", "messages" if "messages" in seed else "prompt",
                            "top_p", "stop", "seed"])] = rng.choice(
                [-1, "x", [None], {"a": 1}, 1e300, "a" * 63 + "é", -2 ** 63, 2 ** 64, [[]], "é" * 300, 99])
        body = to_bytes(obj)
    elif r < 0.6:
        path, body, cat = rng.choice(POSTS)[0], rng.choice(HOSTILE_BODIES), "hostile_body"
    elif r < 0.6 + GEN_SHARE:
        path, body, cat = None, rng.choice(GEN_BODIES), "generate"
        if b"messages" in body:
            path = "/v1/chat/completions"
        else:
            path = "/v1/completions"
    else:  # GET (or another method) on an odd path
        m = rng.choice([b"GET"] * 6 + [b"DELETE", b"OPTIONS", b"PUT", b"PATCH", b"BREW"])
        p = rng.choice(GETS).encode() if rng.random() < 0.5 else rng.choice(
            [b"/" + b"a" * rng.randrange(200) + "é".encode(), b"/v1/models/" + b"a" * 63 + "é".encode(),
             b"/v1/models/\xff\xfe", b"/%ff%00", b"/health?" + b"q" * rng.randrange(4000), b"//v1//models",
             b"/v1/models/" + bytes(rng.randrange(0x21, 0x7f) for _ in range(rng.randrange(1, 80))),
             b"http://x/v1/models", b"*", b"/metrics?x=\xc3", b"/v1/completions/"])
        return m + b" " + p + b" HTTP/1.1\r\n" + b"".join(hs) + b"\r\n", "get"
    path = path.encode()
    if rng.random() < 0.15:  # a valid chunked body, random splits
        out, i = b"", 0
        while i < len(body):
            n = rng.randrange(1, max(2, len(body) - i + 1))
            out += b"%x" % n + (b";e=1" if rng.random() < 0.1 else b"") + b"\r\n" + body[i:i + n] + b"\r\n"
            i += n
        return (b"POST " + path + b" HTTP/1.1\r\n" + b"".join(hs) + b"Transfer-Encoding: chunked\r\n\r\n" + out +
                b"0\r\n\r\n"), cat
    return b"POST " + path + b" HTTP/1.1\r\n" + b"".join(hs) + b"Content-Length: %d\r\n\r\n" % len(body) + body, cat


class Stats:
    def __init__(self):
        self.cases = 0          # answered pipelined requests + single-connection jobs
        self.requests = 0       # requests written
        self.answers = 0        # responses parsed
        self.status = collections.Counter()
        self.by_cat = collections.Counter()  # (category, status, closed) of the pipelined answers
        self.kinds = collections.Counter()
        self.stalls = []        # a valid request with no answer within STALL_S
        self.recent = collections.deque(maxlen=256)
        self.crash = None


async def read_response(r):
    """(status, close) of one response; 1xx interim answers skipped"""
    while True:
        head = await r.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        cl, chunked, close = None, False, lines[0].startswith(b"HTTP/1.0")
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            k, v = k.strip().lower(), v.strip().lower()
            if k == b"content-length":
                cl = int(v)
            elif k == b"transfer-encoding" and b"chunked" in v:
                chunked = True
            elif k == b"connection":
                close = v == b"close"
        if 100 <= status < 200:
            continue
        if chunked:
            while True:
                n = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                if n == 0:
                    while (await r.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    break
                await r.readexactly(n + 2)
        elif cl is not None:
            await r.readexactly(cl)
        elif close:
            await r.read()
        return status, close


async def pipelined_job(port, st):
    auth_ok = rng.random() < 0.8
    k = rng.randrange(1, 33)
    reqs = [fast_request(auth_ok) for _ in range(k)]
    data = b"".join(r[0] for r in reqs)
    st.recent.append(("pipeline", data))
    rd, wr = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    got = 0
    try:
        wr.write(data)
        while got < k:
            status, close = await asyncio.wait_for(read_response(rd), STALL_S)
            st.status[status] += 1
            st.by_cat[(reqs[got][1] if auth_ok else "no_key/" + reqs[got][1], status, close)] += 1
            got += 1
            if close:
                break
    except asyncio.TimeoutError:
        st.stalls.append(data[:2000])
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
        pass
    finally:
        wr.close()
    st.requests += k
    st.answers += got
    st.cases += got
    st.kinds["pipelined"] += got


async def single_job(port, st):
    kind, data, mode = gen_case()
    st.recent.append((kind + "/" + mode, data))
    try:
        rd, wr = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    except OSError:
        return
    try:
        if mode == "slow":
            for i in range(0, min(len(data), 40)):
                wr.write(data[i:i + 1])
                await wr.drain()
                await asyncio.sleep(0.01)
            data = data[40:]
        wr.write(data)
        await wr.drain()
        if mode == "half":
            wr.write_eof()
        if mode == "abandon":
            if rng.random() < 0.5:
                await asyncio.wait_for(rd.read(256), 1.0)
            return
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # until the server closes (kept alive: 0.3 s after the last bytes)
            b = await asyncio.wait_for(rd.read(65536), 0.3 if kind != "stream" else 1.5)
            if not b:
                break
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        wr.close()
        st.cases += 1
        st.requests += max(1, data.count(b" HTTP/"))
        st.kinds[kind] += 1


async def health_async(port):
    try:
        rd, wr = await asyncio.open_connection("127.0.0.1", port)
        wr.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _ = await asyncio.wait_for(read_response(rd), 5.0)
        wr.close()
        return status
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
        return None


def run_fast(p, port, t0, figures_at):
    """figures_at(st) is called once when 10^4 cases... (see main); returns Stats"""
    st = Stats()
    single_share = float(os.environ.get("SHOAL_FUZZ_HTTP_SINGLE_SHARE", "0.12"))

    def done():
        return st.crash or time.time() - t0 >= BUDGET_S or (MAX_CASES is not None and st.cases >= MAX_CASES)

    async def worker():
        while not done():
            try:
                if rng.random() < single_share:
                    await single_job(port, st)
                else:
                    await pipelined_job(port, st)
            except OSError:
                await asyncio.sleep(0.05)
            if p.poll() is not None:
                st.crash = f"server exited with {p.returncode}"

    async def monitor():
        next_check = HEALTH_EVERY
        last_print = time.time()
        while not done():
            await asyncio.sleep(0.05)
            figures_at(st)
            if st.cases >= next_check:
                next_check = st.cases + HEALTH_EVERY
                h = await health_async(port)
                if h != 200 and p.poll() is None:
                    h = await health_async(port)  # one retry: a loaded box
                if h != 200:
                    st.crash = f"/health answered {h} after {st.cases} cases (rc {p.poll()})"
            if time.time() - last_print > 60:
                last_print = time.time()
                print(f"  {st.cases} cases, {st.answers} answers, {time.time() - t0:.0f} s, "
                      f"{st.cases / max(1e-9, time.time() - t0):.0f}/s, statuses {dict(st.status.most_common(8))}",
                      flush=True)

    async def all_():
        await asyncio.gather(monitor(), *[worker() for _ in range(CONNS)])

    asyncio.run(all_())
    return st


def main():
    if not os.path.exists(BIN):
        R.record("SKIP", "all", f"{BIN} not built")
        return 77
    sanitized = "asan" in BIN or bool(os.environ.get("SHOAL_FUZZ_SANITIZER"))
    print(f"seed {SEED} (SHOAL_FUZZ_SEED to replay), budget {BUDGET_S:.0f} s, cases {MAX_CASES or 'unbounded'}",
          flush=True)
    log = tempfile.NamedTemporaryFile(prefix="shoal-fuzz-", suffix=".log", delete=False)
    # --api-key: 85% of the cases carry it (so both sides of the check run);
    # --max-context bounds every generation the fuzzer manages to start
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", "0", "--model-name", "tiny", "--threads", "1",
                          "--workers", "2", "--worker-threads", "1", "--api-key", KEY, "--max-context", "64",
                          "--queue", "8", "--header-timeout", "2", "--request-timeout", "3", "--write-timeout", "3",
                          "--max-body-kb", "64",
                          # no prefix cache: the RSS growth check is for leaks (a cache filling its budget is not one)
                          "--prefix-cache-gb", "0"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        R.record("FAIL", "server_starts", f"{line!r}")
        return 1
    url = line.strip().split("listening on ")[1]
    port = int(url.rsplit(":", 1)[1])
    deadline = time.time() + 60
    while time.time() < deadline and health(url) != 200:
        time.sleep(0.2)
    crashes, cases, requests, kinds, last = 0, 0, 0, {}, None
    warm, before, at_10k, st = None, proc_figures(p.pid), None, None
    t0 = time.time()
    try:
        if MODE == "serial":
            while time.time() - t0 < BUDGET_S and (MAX_CASES is None or cases < MAX_CASES):
                kind, data, mode = gen_case()
                last = [(kind + "/" + mode, data)]
                run_case(port, data, mode)
                cases += 1
                requests += max(1, data.count(b" HTTP/"))
                kinds[kind] = kinds.get(kind, 0) + 1
                if p.poll() is not None or (cases % 10 == 0 and health(url) is None):
                    crashes += 1
                    break
                if cases == 300:
                    time.sleep(1.0)
                    warm = proc_figures(p.pid)
        else:
            marks = {}

            def figures_at(s):
                for n in (WARM_CASES, 10000):
                    if s.cases >= n and n not in marks and p.poll() is None:
                        marks[n] = proc_figures(p.pid)

            st = run_fast(p, port, t0, figures_at)
            cases, requests, kinds, last = st.cases, st.requests, dict(st.kinds), list(st.recent)
            crashes += 1 if st.crash else 0
            warm, at_10k = marks.get(WARM_CASES), marks.get(10000)
        time.sleep(4.0)  # let abandoned connections hit their deadlines
        end = proc_figures(p.pid) if p.poll() is None else None
        final_health = health(url)
    finally:
        rc = terminate(p, 30)
    dt = time.time() - t0
    with open(log.name, errors="replace") as f:  # a sanitizer build reports without dying (UBSan)
        sanitizer = [l for l in f if "runtime error:" in l or "AddressSanitizer" in l or "LeakSanitizer" in l]
    if sanitizer:
        print("sanitizer reports:\n" + "".join(sanitizer[:20]), flush=True)
        crashes += 1
    figures = {"seed": SEED, "mode": MODE, "cases": cases, "requests_sent": requests, "seconds": round(dt, 1),
               "cases_per_s": round(cases / max(dt, 1e-9), 1), "crashes": crashes, "kinds": kinds,
               "before": before, f"after_{WARM_CASES if MODE != 'serial' else 300}_cases": warm,
               "after_10000_cases": at_10k, "at_end": end, "exit_code": rc, "binary": BIN,
               "sanitizer_reports": len(sanitizer)}
    if st:
        figures.update({"answers": st.answers, "statuses": {str(k): v for k, v in sorted(st.status.items())},
                        "stalls": len(st.stalls), "connections": CONNS, "crash": st.crash,
                        "pipelined_answers": {f"{c} {s}{' close' if cl else ''}": n
                                              for (c, s, cl), n in sorted(st.by_cat.items())}})
    print(json.dumps(figures), flush=True)
    if os.environ.get("SHOAL_FUZZ_HTTP_OUT"):
        with open(os.environ["SHOAL_FUZZ_HTTP_OUT"], "w") as f:
            json.dump(figures, f, indent=1)
    if crashes and last:  # the last cases (fast mode: the ones in flight or just before, any could be it)
        rep = os.path.join(tempfile.gettempdir(), f"shoal-fuzz-crash-{SEED}.bin")
        with open(rep, "wb") as f:
            for kind, data in last:
                f.write(b"==== %s %d bytes\n" % (kind.encode(), len(data)) + data + b"\n")
        print(f"last {len(last)} case(s) saved to {rep}; server log {log.name}", flush=True)
    if st and st.stalls:
        rep = os.path.join(tempfile.gettempdir(), f"shoal-fuzz-stall-{SEED}.bin")
        with open(rep, "wb") as f:
            f.write(b"\n====\n".join(st.stalls))
        print(f"{len(st.stalls)} stalled pipeline(s) saved to {rep}", flush=True)
    if st:
        R.check("no_stall", not st.stalls, f"{len(st.stalls)} valid request(s) unanswered within {STALL_S:.0f} s")
    R.check("no_crash", crashes == 0 and final_health == 200,
            f"{crashes} crash(es) after {cases} cases; final /health {final_health}; log {log.name}")
    R.check("cases_run", cases >= 100, f"only {cases} cases in {dt:.0f} s")
    if warm and end:
        R.check("no_fd_growth", end["fds"] <= warm["fds"] + 8 and end["fds"] <= before["fds"] + 4,
                f"fds before {before['fds']}, warm {warm['fds']}, end {end['fds']}")
        if sanitized:  # ASan keeps freed memory in its quarantine (256 MB): RSS says nothing there
            R.record("SKIP", "no_rss_growth", "sanitizer build: ASan's quarantine holds freed memory; LSan checks leaks")
        else:
            R.check("no_rss_growth", end["VmRSS"] <= warm["VmRSS"] + 48 * 1024,
                    f"VmRSS {warm['VmRSS']} -> {end['VmRSS']} kB")
    else:
        R.record("SKIP", "no_growth", "too few cases for a warm-up figure")
    R.check("clean_shutdown", rc == 0, f"exit code {rc}")
    if not crashes:
        os.unlink(log.name)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
