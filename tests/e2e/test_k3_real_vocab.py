#!/usr/bin/env python3
"""K3's real vocabulary end to end (issue 24): the chat format on real ids, the
served prompt counts, and `--tokenizer DIR` with its refusals.

Expected ids come from tools/k3_oracle.py, an independent Python oracle written
from SPEC §5 (tiktoken 0.14 + tokenization_kimi.py's splitting; encoding_k3.py's
segments), never from shoal's C code. The vocabulary is ../shared/k3 beside the
checkout (SHOAL_K3_TOKENIZER_DIR overrides), checked against SPEC §5.1's size and
sha256; without it every case is SKIPPED with the reason.

Cases:
  official/*     the official encoder's published cases (tests/fixtures/tokenizer/
                 xtml_official.json, segments from encoding_k3.py at HF rev
                 f831ab66): the oracle renders the same segments (a check of the
                 oracle), the segments encoded by tiktoken are the official ids,
                 and `shoal tokenize --chat` gives exactly those ids; the five
                 counts of SPEC §5.5 (22, 22, 32, 32, 26).
  random/*       seeded conversations (CJK, emoji ZWJ, combining marks, literal
                 markers, long white-space runs, tool declarations, typed tool
                 calls, tool results out of order, thinking on/off, generation
                 prompt on/off): oracle ids == shoal ids. SHOAL_K3_CHAT_CASES sets
                 the count (default 40).
  long/1000_turns a 1,000-turn conversation: ids identical.
  serve/*        `shoal serve` on a generated model with 163,840 logits
                 (tools/make_tiny_k3.py --preset tiny-k3-vocab, toy widths) whose
                 folder holds the real tokenizer files: no other step is needed,
                 and `usage.prompt_tokens` (official `openai` client) equals the
                 oracle's count for the same messages; the same model with its own
                 (padded) vocabulary replaced by `--tokenizer ../shared/k3`.
  refuse/*       a vocabulary of the wrong size (tiny-k3's 4,096 ids for a
                 163,840-logit model) and one with K3's size but not K3's sha256
                 for K3's published config.json are refused, naming the file.
"""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

SRC = os.environ.get("SHOAL_SRC", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tools"))
sys.path.insert(0, os.path.join(SRC, "tests", "e2e"))
import k3_oracle as K  # noqa: E402
from harness import Recorder, terminate  # noqa: E402

rec = Recorder("test_k3_real_vocab")
WORK = os.path.join(BUILD, "k3_real_vocab")


def real_dir():
    d = os.environ.get("SHOAL_K3_TOKENIZER_DIR") or os.path.join(SRC, "..", "shared", "k3")
    return d if os.path.exists(os.path.join(d, "tiktoken.model")) else None


def shoal_chat_ids(model, body, name):
    path = os.path.join(WORK, name.replace("/", "_") + ".json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, ensure_ascii=False)
    p = subprocess.run([BIN, "tokenize", "--model", model, "--chat", path], capture_output=True, timeout=120)
    if p.returncode:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr.decode(errors='replace')[:300]}")
    out = p.stdout.decode().strip()
    return [int(x) for x in out.split(",")] if out else []


def body_of(messages, thinking=True, add_generation_prompt=True, tools=None, tool_choice=None):
    b = {"messages": messages, "chat_template_kwargs": {"thinking": thinking}}
    if not add_generation_prompt:
        b["add_generation_prompt"] = False
    if tools:
        b["tools"] = tools
    if tool_choice:
        b["tool_choice"] = tool_choice
    return b


def compare(case, want, got, extra=""):
    if got == want:
        rec.record("PASS", case, f"{len(got)} ids{extra}")
        return True
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    rec.record("FAIL", case, f"first difference at id {i}: shoal {got[i:i + 6]} oracle {want[i:i + 6]} "
                             f"(lengths {len(got)}, {len(want)})")
    return False


# ------------------------------------------------------------- official --

SPEC_COUNTS = {"plain": 22, "thinking": 22, "literal_markers": 32, "attribute_escape": 32, "unicode": 26}


def t_official(tok, real):
    fx = json.load(open(os.path.join(SRC, "tests", "fixtures", "tokenizer", "xtml_official.json"), encoding="utf-8"))
    for c in fx["cases"]:
        name = c["name"]
        kw = c["kwargs"]
        want_segs = [tuple(s) for s in c["segments"]]
        rec.check(f"official/{name}/oracle_segments", K.xtml_segments(c["messages"], **kw) == want_segs,
                  "tools/k3_oracle.py renders other segments than the official encoder")
        want = K.xtml_encode_segments(tok, want_segs)
        try:
            got = shoal_chat_ids(real, body_of(c["messages"], **kw), f"official_{name}")
        except Exception as e:  # noqa: BLE001
            rec.record("FAIL", f"official/{name}/ids", str(e))
            continue
        compare(f"official/{name}/ids", want, got)
        if name in SPEC_COUNTS:
            rec.check(f"official/{name}/spec_count", len(want) == SPEC_COUNTS[name] == len(got),
                      f"oracle {len(want)}, shoal {len(got)}, SPEC §5.5 {SPEC_COUNTS[name]}")


# --------------------------------------------------------------- random --

TEXTS = ["Hello", "你好，世界", "naïve café", "e\u0301\u0301", "👨‍👩‍👧‍👦 family", "🏳️‍🌈", "한국어 텍스트",
         "हिन्दी", "العَرَبِيَّة", "<|open|>tools<|sep|>", "<|end_of_msg|>", "[EOS]", "<|reserved_token_163700|>",
         "a\"b&c", "  leading", "trailing   ", "\n\n\n", "\t\tcode()\n    return 1\n", "1234567890123",
         "I'M SURE it's fine", "x" * 300, " " * 200 + "y", "line\r\nline\r\n", "𝟘𝟙𝟚 ①②③", "\u3000\u3000全角",
         "def f(x):\n    return {'a': [1, 2.5]}\n", "mixed 中文 and English 混合 text."]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather — 天气",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]


def rtext(r):
    k = r.randint(1, 3)
    return " ".join(r.choice(TEXTS) for _ in range(k))


def rargs(r):
    a = {}
    for _ in range(r.randint(0, 4)):
        kind = r.randrange(7)
        key = r.choice(["city", "days", "ok", "note", "xs", "opt", "q"]) + str(r.randrange(10))
        a[key] = [rtext(r), r.randint(-5, 10 ** 6), r.random() < .5, None, [1, 2, r.randint(0, 9)],
                  {"a": 1, "b": "x"}, "北京"][kind]
    return a


def rconversation(r, turns):
    msgs = []
    if r.random() < 0.3:
        msgs.append({"role": "system", "content": rtext(r)})
    for t in range(turns):
        u = {"role": "user", "content": rtext(r)}
        if r.random() < 0.1:
            u["name"] = r.choice(["A&B\"C", "bob", "用户"])
        msgs.append(u)
        a = {"role": "assistant", "content": rtext(r) if r.random() < 0.9 else None}
        if r.random() < 0.6:
            a["reasoning_content"] = rtext(r)
        if r.random() < 0.3:
            calls = []
            for j in range(r.randint(1, 3)):
                args = rargs(r)
                fa = json.dumps(args, ensure_ascii=r.random() < 0.5) if r.random() < 0.8 else "{\"broken\":"
                calls.append({"id": f"call-{t}-{j}", "type": "function",
                              "function": {"name": r.choice(["weather", "clock", "search"]), "arguments": fa}})
            a["tool_calls"] = calls
            msgs.append(a)
            res = [{"role": "tool", "tool_call_id": c["id"], "content": rtext(r)} for c in calls]
            r.shuffle(res)
            msgs += res
        else:
            msgs.append(a)
    if r.random() < 0.5:
        msgs.append({"role": "user", "content": rtext(r)})
    return msgs


def rbody(r, turns):
    kw = dict(thinking=r.random() < 0.7, add_generation_prompt=r.random() < 0.85,
              tools=TOOLS if r.random() < 0.3 else None,
              tool_choice="required" if r.random() < 0.15 else None)
    return rconversation(r, turns), kw


def t_random(tok, real, n):
    r = random.Random(20260524)
    for i in range(n):
        msgs, kw = rbody(r, r.randint(1, 6))
        case = f"random/{i:03d}"
        try:
            want = K.xtml_encode(tok, msgs, **kw)
            got = shoal_chat_ids(real, body_of(msgs, **kw), case)
        except Exception as e:  # noqa: BLE001
            rec.record("FAIL", case, str(e))
            continue
        compare(case, want, got)


def t_long(tok, real):
    r = random.Random(1000)
    msgs = []
    for t in range(500):  # 1,000 turns: 500 user + 500 assistant messages
        msgs.append({"role": "user", "content": rtext(r)})
        msgs.append({"role": "assistant", "content": rtext(r), "reasoning_content": rtext(r)})
    t0 = time.perf_counter()
    want = K.xtml_encode(tok, msgs)
    t1 = time.perf_counter()
    got = shoal_chat_ids(real, body_of(msgs), "long_1000_turns")
    t2 = time.perf_counter()
    compare("long/1000_turns", want, got, f", oracle {t1 - t0:.2f} s, shoal tokenize --chat process "
                                          f"{t2 - t1:.2f} s incl. vocabulary load")


# ---------------------------------------------------------------- serve --

def make_model():
    gen = os.path.join(WORK, "tiny-k3-vocab")
    if not os.path.exists(os.path.join(gen, "model.safetensors.index.json")):
        subprocess.run([sys.executable, os.path.join(SRC, "tools", "make_tiny_k3.py"), "--preset", "tiny-k3-vocab",
                        "--out", gen], check=True, capture_output=True, timeout=300)
    return gen


def with_real_tokenizer(gen, real):
    """A model folder as a user would have it: the weights and the real files."""
    d = os.path.join(WORK, "tiny-k3-realtok")
    os.makedirs(d, exist_ok=True)
    for fn in os.listdir(gen):
        if fn in ("tiktoken.model", "tokenizer_config.json"):
            continue
        dst = os.path.join(d, fn)
        if not os.path.lexists(dst):
            os.symlink(os.path.abspath(os.path.join(gen, fn)), dst)
    for fn in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(real, fn), os.path.join(d, fn))
    return d


class Server:
    def __init__(self, model, *extra):
        self.log = open(os.path.join(WORK, f"serve-{len(os.listdir(WORK))}.log"), "w+")
        self.p = subprocess.Popen([BIN, "serve", "--model", model, "--port", "0", "--model-name", "k3v",
                                   "--threads", "1", "--memo", "0", *extra],
                                  stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            terminate(self.p)
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-1500:]}")
        self.url = line.strip().split("listening on ")[1]
        import openai
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        terminate(self.p)
        self.log.close()


def served_cases():
    r = random.Random(77)
    out = [("hello", [{"role": "user", "content": "Hello"}], {}),
           ("thinking_off", [{"role": "user", "content": "你好 café 🦉"}], {"thinking": False}),
           ("literal_markers", [{"role": "user", "content": "<|open|>tools<|sep|> [EOS] <|end_of_msg|>"}], {})]
    tool_conv = rconversation(random.Random(5), 3)
    out.append(("tools", tool_conv, {"tools": TOOLS}))
    for i in range(3):
        out.append((f"random{i}", rconversation(r, r.randint(1, 4)), {}))
    return out


def t_serve(srv, label, tok):
    for name, msgs, kw in served_cases():
        case = f"serve/{label}/{name}"
        try:
            args = dict(model="k3v", messages=msgs, max_tokens=1, temperature=0)
            if kw.get("tools"):
                args["tools"] = kw["tools"]
            if "thinking" in kw:
                args["extra_body"] = {"thinking": {"type": "enabled" if kw["thinking"] else "disabled"}}
            resp = srv.client.chat.completions.create(**args)
            want = len(K.xtml_encode(tok, msgs, thinking=kw.get("thinking", True), tools=kw.get("tools")))
            rec.check(case, resp.usage.prompt_tokens == want,
                      f"usage.prompt_tokens {resp.usage.prompt_tokens}, official count {want}")
        except Exception as e:  # noqa: BLE001
            rec.record("FAIL", case, f"{type(e).__name__}: {str(e)[:300]}")


def refused(case, cmd, must):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    ok = p.returncode != 0 and all(m in p.stderr for m in must)
    rec.check(case, ok, f"exit {p.returncode}, stderr {p.stderr[-400:]!r}, wanted {must}")


def t_refuse(gen, real):
    tiny = os.path.join(SRC, "tests", "models", "tiny-k3")
    for cmd in ("serve", "run"):
        extra = ["--port", "0"] if cmd == "serve" else ["--prompt", "hi", "--gen", "1"]
        refused(f"refuse/{cmd}/size", [BIN, cmd, "--model", gen, "--tokenizer", tiny, *extra],
                [f"{tiny}/tiktoken.model", "4096 ids", "vocab_size 163840"])
    # K3's published config.json wants K3's own tiktoken.model: one with two ranks swapped is refused
    d = os.path.join(WORK, "k3-config-wrong-vocab")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(os.path.join(real, "config.json"), os.path.join(d, "config.json"))
    shutil.copyfile(os.path.join(real, "tokenizer_config.json"), os.path.join(d, "tokenizer_config.json"))
    lines = open(os.path.join(real, "tiktoken.model"), "rb").read().splitlines(keepends=True)
    a, b = lines[1000].split(), lines[1001].split()
    lines[1000], lines[1001] = b[0] + b" " + a[1] + b"\n", a[0] + b" " + b[1] + b"\n"
    data = b"".join(lines)
    with open(os.path.join(d, "tiktoken.model"), "wb") as f:
        f.write(data)
    digest = hashlib.sha256(data).hexdigest()
    for cmd in ("serve", "run"):
        extra = ["--port", "0"] if cmd == "serve" else ["--prompt", "hi", "--gen", "1"]
        refused(f"refuse/{cmd}/sha256", [BIN, cmd, "--model", d, *extra],
                [f"{d}/tiktoken.model", digest, K.K3_SHA256, "config.json"])
    # and K3's config with K3's vocabulary passes the tokenizer check (it then stops at the missing weights)
    p = subprocess.run([BIN, "run", "--model", d, "--tokenizer", real, "--prompt", "hi", "--gen", "1"],
                       capture_output=True, text=True, timeout=120)
    rec.check("refuse/run/k3_config_k3_vocab_passes", p.returncode != 0 and "tokenizer" not in p.stderr
              and "safetensors" in p.stderr, f"exit {p.returncode}: {p.stderr[-300:]!r}")


def main():
    os.makedirs(WORK, exist_ok=True)
    real = real_dir()
    if not real:
        rec.record("SKIP", "all", "no ../shared/k3/tiktoken.model beside the checkout; set SHOAL_K3_TOKENIZER_DIR "
                                  "to a directory with K3's tiktoken.model and tokenizer_config.json")
        return 77
    data = open(os.path.join(real, "tiktoken.model"), "rb").read()
    if not rec.check("identity", len(data) == K.K3_SIZE and hashlib.sha256(data).hexdigest() == K.K3_SHA256,
                     f"{real}/tiktoken.model is not SPEC §5.1's file"):
        return 1
    tok = K.KimiTokenizer(real)
    t_official(tok, real)
    t_random(tok, real, int(os.environ.get("SHOAL_K3_CHAT_CASES", "40")))
    t_long(tok, real)
    gen = make_model()
    t_refuse(gen, real)
    for label, model, extra in (("model_folder", with_real_tokenizer(gen, real), ()),
                                ("tokenizer_flag", gen, ("--tokenizer", real))):
        try:
            srv = Server(model, *extra)
        except Exception as e:  # noqa: BLE001
            rec.record("FAIL", f"serve/{label}/start", str(e)[:400])
            continue
        try:
            t_serve(srv, label, tok)
        finally:
            srv.stop()
    c = rec.counts
    print(f"{c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped")
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
