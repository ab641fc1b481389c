"""The chat path end to end on the trained tests/models/k3-nano (issue 23), with
the official `openai` client, in process and with the routed experts on two
local expert servers (--workers 2).

Expected values come from the fp32 reference, never from shoal: chat.json
(tools/make_fixtures.py --nano: the prompt the reference renders from SPEC
§5.4 for one user message, and its greedy answer ids) and greedy.json (a text
prompt and its greedy continuation). Texts are decoded here with tiktoken from
the model's tiktoken.model (an implementation that is not shoal's).

chat_*: for every answer of chat.json that its audit found robust (thinking
on and off), a greedy chat completion: the prompt ids shoal renders equal the
reference's, the answer's ids equal the reference's (and `shoal run` on the
same prompt ids gives them too), finish_reason follows from them (stop on
<|end_of_msg|>, else length), usage counts them (prompt, completion, total,
reasoning = the ids before the answer began), content and reasoning are the
reference ids' text split at the XTML structure, the content is readable
English; streamed the same request gives the same text, ids, finish and usage.

stop_*: stop strings that the model's own greedy text really contains, found
in the reference's decoded text at position p (including strings that start
inside a token and end several tokens later): the answer is the text up to p,
finish_reason "stop", completion_tokens the ids up to the one that completed
the string, streamed the same; a stop string whose beginning appears in the
text but which never completes changes nothing (text held back is released).
The response memo is off (--memo 0), so a streamed request is generated again,
not replayed from the full one.
"""
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
NANO = os.path.join(SRC, "tests", "models", "k3-nano")
FIX = os.path.join(SRC, "tests", "fixtures", "k3-nano")
R = harness.Recorder("test_nano_chat")
# the K3 pre-tokenizer pattern (SPEC §5.2), as tools/train_vocab.py gives it to tiktoken
sys.path.insert(0, os.path.join(SRC, "tools"))


ENC, SP = harness.k3_encoder(NANO)
EOM = SP["<|end_of_msg|>"]


_, TAIL = harness.k3_answer_marks(ENC, SP)  # the XTML around an answer's content (SPEC §5.4)


def expected_answer(ids, thinking):
    """(reasoning, content, index of the first content id) of the reference's ids"""
    a = harness.k3_answer(ENC, SP, ids, thinking)
    return a and a[:3]


def readable(text):
    """English prose: at least 8 words of letters, only printable characters and newlines,
    and mostly letters and spaces"""
    words = re.findall(r"[A-Za-z]{2,}", text)
    ok_chars = all(c.isprintable() or c == "\n" for c in text)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return len(words) >= 8 and ok_chars and letters >= 0.85 * len(text)


class Server(harness.Serve):
    def __init__(self, *args):
        super().__init__([BIN, "serve", "--model", NANO, "--port", "0", "--model-name", "nano", "--threads", "1",
                          "--memo", "0", *args], ready=30)
        self.client = self.openai()


def chat_kw(question, thinking, max_tokens, **extra):
    kw = {"model": "nano", "messages": [{"role": "user", "content": question}], "temperature": 0,
          "max_tokens": max_tokens, "extra_body": {"return_token_ids": True}}
    if not thinking:
        kw["extra_body"]["reasoning_effort"] = "none"
    kw.update(extra)
    return kw


def full(srv, kw):
    r = srv.client.chat.completions.create(**kw)
    c = r.choices[0]
    d = c.model_dump()
    return {"content": c.message.content or "", "reasoning": getattr(c.message, "reasoning_content", None) or "",
            "finish": c.finish_reason, "ids": d.get("token_ids"), "prompt_ids": d.get("prompt_token_ids"),
            "usage": (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens,
                      r.usage.completion_tokens_details.reasoning_tokens)}


def streamed(srv, kw):
    s = srv.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    content, reasoning, finish, ids, prompt_ids, usage, both = "", "", None, None, None, None, False
    for ch in s:
        if ch.usage is not None:
            u = ch.usage
            usage = (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.completion_tokens_details.reasoning_tokens)
        if not ch.choices:
            continue
        c = ch.choices[0]
        dc, dr = c.delta.content, getattr(c.delta, "reasoning_content", None)
        both |= bool(dc) and bool(dr)
        content += dc or ""
        reasoning += dr or ""
        if c.finish_reason:
            finish = c.finish_reason
            d = c.model_dump()
            ids, prompt_ids = d.get("token_ids"), d.get("prompt_token_ids")
    return {"content": content, "reasoning": reasoning, "finish": finish, "ids": ids, "prompt_ids": prompt_ids,
            "usage": usage, "both_in_one_chunk": both}


def shoal_run(prompt_ids, n):
    p = subprocess.run([BIN, "run", "--model", NANO, "--json", "--threads", "1", "--gen", str(n), "--ids",
                        ",".join(map(str, prompt_ids))], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])["generated_ids"]


def chat_cases(tag, srv, chats, run_ids):
    for i, c in enumerate(chats):
        name = f"{tag} chat {i} ({c['question']}, thinking {'on' if c['thinking'] else 'off'})"
        want = c["generated_ids"]
        exp = expected_answer(want, c["thinking"])
        if not R.check(f"{name}: reference answer has the XTML structure", exp is not None, ENC.decode(want)):
            continue
        reasoning, content, start = exp
        stops = want[-1] == EOM
        kw = chat_kw(c["question"], c["thinking"], 64)
        a = full(srv, kw)
        R.check(f"{name}: prompt ids are the reference's rendering", a["prompt_ids"] == c["prompt_ids"],
                f"{a['prompt_ids']} != {c['prompt_ids']}")
        R.check(f"{name}: answer ids equal the reference's greedy ids", a["ids"] == want, f"{a['ids']} != {want}")
        R.check(f"{name}: shoal run on the same prompt ids gives them too", run_ids[i] == want, f"{run_ids[i]}")
        R.check(f"{name}: finish_reason", a["finish"] == ("stop" if stops else "length"), a["finish"])
        np_, nc = len(c["prompt_ids"]), len(want)
        R.check(f"{name}: usage", a["usage"] == (np_, nc, np_ + nc, start if c["thinking"] else 0),
                f"{a['usage']} != {(np_, nc, np_ + nc, start)}")
        R.check(f"{name}: content is the reference ids' text", a["content"] == content,
                f"{a['content']!r} != {content!r}")
        R.check(f"{name}: reasoning is the reference ids' text", a["reasoning"] == reasoning,
                f"{a['reasoning']!r} != {reasoning!r}")
        if "content" in c:
            R.check(f"{name}: content equals chat.json's", a["content"] == c["content"], c["content"])
        R.check(f"{name}: content is readable text", readable(a["content"]), repr(a["content"]))
        s = streamed(srv, kw)
        for k in ("content", "reasoning", "finish", "ids", "prompt_ids", "usage"):
            R.check(f"{name}: streamed {k} equals the full response's", s[k] == a[k], f"{s[k]!r} != {a[k]!r}")
        R.check(f"{name}: no chunk carries both channels", not s["both_in_one_chunk"])


def stop_positions(ids, text, stop):
    """(p, index of the id that completes the stop string, index of the id where it starts)"""
    p = text.find(stop)
    ends, n = [], 0
    for i in range(len(ids)):
        n = len(ENC.decode(ids[:i + 1]))
        ends.append(n)
    first = next(i for i, e in enumerate(ends) if e > p)
    last = next(i for i, e in enumerate(ends) if e >= p + len(stop))
    return p, last, first


def stop_cases(tag, srv, chats, greedy):
    # chat (thinking off): the content channel
    c = next(x for x in chats if not x["thinking"] and x["generated_ids"][-1] == EOM)
    reasoning, content, start = expected_answer(c["generated_ids"], False)
    body = c["generated_ids"][:len(c["generated_ids"]) - len(TAIL)]
    for stop in ("bytes written", "compressed bytes", "platform.\n\nThe"):
        p, last, first = stop_positions(body, content, stop)
        name = f"{tag} stop {stop!r} in a chat answer"
        R.check(f"{name}: the reference's text contains it", p > 0, content)
        kw = chat_kw(c["question"], False, 64, stop=[stop])
        a, s = full(srv, kw), streamed(srv, kw)
        R.check(f"{name}: content is the text before it", a["content"] == content[:p],
                f"{a['content']!r} != {content[:p]!r}")
        R.check(f"{name}: finish_reason stop", a["finish"] == "stop", a["finish"])
        R.check(f"{name}: ids up to the one completing it", a["ids"] == body[:last + 1] and
                a["usage"][1] == last + 1, f"{a['ids']} {a['usage']} vs {body[:last + 1]}")
        R.check(f"{name}: streamed the same", (s["content"], s["finish"], s["ids"]) == (a["content"], a["finish"], a["ids"]),
                f"{s['content']!r} {s['finish']} {s['ids']}")
        if stop == "compressed bytes":
            R.check(f"{name}: it starts inside a token and spans several", last > first and
                    len(ENC.decode(body[:first])) < p, f"first {first} last {last}")
    # a stop string whose beginning the text has ("bytes " then "written") but that never completes
    stop = "bytes read"
    name = f"{tag} stop {stop!r} never completes"
    R.check(f"{name}: its beginning is in the text, all of it is not", "bytes " in content and stop not in content)
    kw = chat_kw(c["question"], False, 64, stop=[stop])
    a, s = full(srv, kw), streamed(srv, kw)
    R.check(f"{name}: answer unchanged", (a["content"], a["finish"], a["ids"]) == (content, "stop", c["generated_ids"]),
            f"{a['content']!r} {a['finish']}")
    R.check(f"{name}: streamed unchanged", (s["content"], s["ids"]) == (content, c["generated_ids"]), repr(s["content"]))

    # completions: greedy.json's text prompt and its continuation
    gen = greedy["generated_ids"]
    text = ENC.decode(gen)
    n = len(gen)
    for stop in ("The result", "list of strings", "exceptions.  The"):
        p, last, first = stop_positions(gen, text, stop)
        name = f"{tag} stop {stop!r} in a completion"
        R.check(f"{name}: the reference's text contains it", p > 0, text)
        kw = {"model": "nano", "prompt": greedy["prompt_text"], "max_tokens": n, "temperature": 0, "stop": stop,
              "extra_body": {"return_token_ids": True}}
        r = srv.client.completions.create(**kw)
        d = r.choices[0].model_dump()
        R.check(f"{name}: prompt ids are the reference's", d.get("prompt_token_ids") == greedy["prompt_ids"])
        R.check(f"{name}: text is the continuation before it", r.choices[0].text == text[:p],
                f"{r.choices[0].text!r} != {text[:p]!r}")
        R.check(f"{name}: finish_reason stop, ids up to the one completing it",
                r.choices[0].finish_reason == "stop" and d.get("token_ids") == gen[:last + 1] and
                r.usage.completion_tokens == last + 1, f"{r.choices[0].finish_reason} {d.get('token_ids')}")
        st = srv.client.completions.create(stream=True, **kw)
        txt, fin = "", None
        for ch in st:
            if ch.choices:
                txt += ch.choices[0].text or ""
                fin = ch.choices[0].finish_reason or fin
        R.check(f"{name}: streamed the same", (txt, fin) == (text[:p], "stop"), f"{txt!r} {fin}")
        if stop == "exceptions.  The":
            R.check(f"{name}: it spans several tokens", last - first >= 3, f"first {first} last {last}")
    r = srv.client.completions.create(model="nano", prompt=greedy["prompt_text"], max_tokens=n, temperature=0,
                                      extra_body={"return_token_ids": True})
    R.check(f"{tag} completion without stop: the reference's continuation",
            r.choices[0].model_dump().get("token_ids") == gen and r.choices[0].text == text and
            r.choices[0].finish_reason == "length", repr(r.choices[0].text))


def main():
    if not os.path.exists(BIN):
        R.record("SKIP", "all", f"{BIN} not built")
        return 77
    try:
        import openai  # noqa: F401
    except ImportError:
        R.record("SKIP", "all", "the openai package is not installed")
        return 77
    chats = [c for c in json.load(open(os.path.join(FIX, "chat.json")))["chats"] if c["robust"]]
    greedy = json.load(open(os.path.join(FIX, "greedy.json")))
    R.check("chat.json has robust answers, thinking on and off",
            {c["thinking"] for c in chats} == {True, False}, f"{len(chats)} robust")
    run_ids = [shoal_run(c["prompt_ids"], 64) for c in chats]
    for tag, args in (("in process", []), ("2 workers", ["--workers", "2", "--worker-threads", "1"])):
        t0 = time.time()
        srv = None
        try:
            srv = Server(*args)
            chat_cases(tag, srv, chats, run_ids)
            stop_cases(tag, srv, chats, greedy)
        except Exception as e:  # a server that did not start, a failed request
            R.check(f"{tag}: cases ran", False, repr(e)[-600:])
        finally:
            if srv:
                rc = srv.stop()
                R.check(f"{tag}: clean shutdown", rc == 0, f"exit code {rc}")
        print(f"{tag}: {time.time() - t0:.1f} s", flush=True)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
