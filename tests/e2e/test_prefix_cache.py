#!/usr/bin/env python3
"""The prefix cache (issue 32), end to end on tests/models/tiny-k3 with real
processes and the official `openai` client. Random weights: the checks are on
ids, logits bytes and counts, never on prose. The reference everywhere is the
same model without any cache (a server with --keep 0, or `shoal run` without
--load-state), and sampled requests (temperature 1, seeded) are used next to
greedy ones, so a logit that moved would show as other ids.

run_*: bit identity of the logits (`shoal run --dump-logits`, every
  generated step) when a prompt resumes from a state file
  (--save-state/--load-state, the prefix cache's format) against prefilling
  it whole: in process with drafting off and on, with --workers 2, with the
  trunk remote (two trunk servers + an expert server), a state saved with
  workers loaded in process, and a state holding the whole prompt (its stored
  logits). A state of another prompt is refused.
file_format: a capture file checked by an independent reader written here
  from the documented layout (docs/ARCHITECTURE.md "prefix cache"): magic,
  sizes, the ids, their hash and both checksums.
system / tools / turn / stride: the capture kinds on one server with
  --prefix-cache-gb and --prefix-cache-dir: a second request sharing a system
  prompt reports usage.prompt_tokens_details.cached_tokens and
  x-shoal-reused-tokens = the rendered system message's length (the position
  after the first <|end_of_msg|> of its prompt ids); the tool declarations'
  end; the end of a previous turn; a stride position for completions.
concurrent: 6 requests sharing a long system prompt submitted together
  (--slots 4): the prompt is prefilled once (the followers wait for the
  first one's capture: shoal_prefix_cache_waits_total, and the prefilled
  token count equals the prompt tokens less one system prompt per follower).
restart: a new server on the same directory resumes the first request from
  the disk capture (disk reads counted); damaged: a truncated file, a file of
  another model (fingerprint changed, header checksum recomputed here) and a
  file with a flipped payload byte are refused by name and recomputed, the
  answers still equal the reference.
disk_hygiene: --prefix-cache-disk-gb of ~3 files, disk tier only: 5 system prompts leave at most the
  budget on disk (bytes = the files' sizes, evictions counted), the last one resumes from disk and
  the first (least recently used) is recomputed, answers equal the reference; a second server on the
  directory exits 4 naming it (lock); a file truncated after it was indexed is refused by name and
  removed when read; a stale pc-*.shst.tmp is removed at start-up and named (another *.tmp is left);
  a lower budget at start-up removes the oldest files. The damaged case above also checks that the
  truncated file is removed at open and another model's file is left in place.
eviction: a memory budget of ~3 captures, 5 system prompts cycled twice, with
  --workers 2 and drafting: evictions counted, every answer equal.
trunk_remote: `serve --trunk remote` (an expert server, two trunk servers)
  with the cache: the second user turn resumes from the system prompt's
  capture, ids equal an in-process server's.
(Drafting is `shoal serve`'s default, so every serve case runs with it.)
Time: ~50-60 s on the 2-core VM at load 12-14 (disk_hygiene: ~10 s of it).
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder("test_prefix_cache")
check = R.check
procs = []
EOM = "<|end_of_msg|>"

# ---- the documented file format, read independently -------------------------------

M64 = (1 << 64) - 1
P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def rnd(acc, w):
    return rotl((acc + w * P2) & M64, 31) * P1 & M64


def pcsum(seed, b):
    """docs/ARCHITECTURE.md: the 64-bit checksum of the state files."""
    n, i = len(b), 0
    a = [(seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64]
    while i + 32 <= n:
        for k in range(4):
            a[k] = rnd(a[k], int.from_bytes(b[i + 8 * k:i + 8 * k + 8], "little"))
        i += 32
    h = (rotl(a[0], 1) + rotl(a[1], 7) + rotl(a[2], 12) + rotl(a[3], 18) + n) & M64
    while i + 8 <= n:
        h = (rotl(h ^ rnd(0, int.from_bytes(b[i:i + 8], "little")), 27) * P1 + P3) & M64
        i += 8
    while i < n:
        h = rotl(h ^ (b[i] * P3 & M64), 11) * P1 & M64
        i += 1
    h ^= h >> 33
    h = h * P2 & M64
    h ^= h >> 29
    h = h * P3 & M64
    h ^= h >> 32
    return h


def ids_hash(ids):
    h = 0
    for t in ids:
        h = (h * 0x100000001B3 + t + 1) & M64
    return h


def parse_file(b):
    """(header dict, ids) of a state file, every documented check applied; raises on a mismatch."""
    assert b[:8] == b"SHOALST\x1a", "magic"
    u32 = lambda o: int.from_bytes(b[o:o + 4], "little")  # noqa: E731
    u64 = lambda o: int.from_bytes(b[o:o + 8], "little")  # noqa: E731
    assert u32(8) == 1 and u32(12) == 96, "version / header size"
    assert u64(80) == pcsum(0, b[:80]), "header checksum"
    n, nl, sb = u32(48), u32(52), u64(56)
    assert len(b) == 96 + 4 * n + sb + 4 * nl, "size"
    ids = [u32(96 + 4 * i) for i in range(n)]
    assert u64(64) == ids_hash(ids), "ids hash"
    p0, p1 = 96 + 4 * n, 96 + 4 * n + sb
    s = pcsum(pcsum(pcsum(0, b[96:p0]), b[p0:p1]), b[p1:])
    assert u64(72) == s, "payload checksum"
    return {"n": n, "n_logits": nl, "state_bytes": sb, "fp": b[16:48]}, ids


def refingerprint(b):
    """The same file claiming another model: fingerprint changed, header checksum recomputed."""
    b = bytearray(b)
    b[16] ^= 0xFF
    b[80:88] = pcsum(0, bytes(b[:80])).to_bytes(8, "little")
    return bytes(b)


# ---- processes ------------------------------------------------------------------------


def sh(args, timeout=120):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=timeout)


class Server:
    def __init__(self, *args):
        import openai
        self.log = harness.logfile()
        cmd = [BIN, "serve", "--model", TINY, "--port", "0", "--model-name", "tiny", "--threads", "1", "--memo", "0",
               "--keep", "0", *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        procs.append(self.p)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            harness.terminate(self.p)
            raise RuntimeError(f"server did not start: {line!r} {self.logtext()[-2000:]!r}")
        self.url = line.strip().split("listening on ")[1]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def logtext(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def chat(self, messages, tools=None, sample=False, max_tokens=6):
        kw = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
              "extra_body": {"return_token_ids": True}}
        kw.update(temperature=1.0, seed=7) if sample else kw.update(temperature=0)
        if tools:
            kw["tools"] = tools
        raw = self.client.chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        c = r.choices[0].model_dump()
        d = r.usage.prompt_tokens_details
        return {"ids": c.get("token_ids"), "prompt_ids": c.get("prompt_token_ids"),
                "cached": d.cached_tokens if d else None,
                "header": int(raw.headers.get("x-shoal-reused-tokens", "-1"))}

    def complete(self, ids, sample=False, max_tokens=6):
        kw = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "extra_body": {"return_token_ids": True}}
        kw.update(temperature=1.0, seed=11) if sample else kw.update(temperature=0)
        r = self.client.completions.create(**kw)
        c = r.choices[0].model_dump()
        d = r.usage.prompt_tokens_details
        return {"ids": c.get("token_ids"), "cached": d.cached_tokens if d else None}

    def stop(self):
        return harness.terminate(self.p, 30)


def words(rng, n):
    return " ".join(f"w{rng.randrange(10000)}" for _ in range(n))


def eom_positions(srv, prompt_ids):
    return [i + 1 for i, t in enumerate(prompt_ids) if t == srv.eom]


def same(a, b):
    return a["ids"] == b["ids"] and a["ids"]


# ---- the cases ---------------------------------------------------------------------------


def trunk_workers():
    """An expert server and two trunk servers of tiny-k3 over ipc://: (processes, coordinator flags)."""
    tag = f"{os.getpid()}-{random.randrange(1 << 30):x}"
    eps = [f"ipc://@shoal-pc-{tag}-{i}" for i in range(3)]
    ws = []
    for i, extra in enumerate([["--experts", "1-8:0-23"], ["--trunk", "*:0/3"], ["--trunk", "*:1/3,*:2/3"]]):
        p = subprocess.Popen([BIN, "expert", "--model", TINY, "--listen", eps[i], "--threads", "1", "--id", f"pc{i}"]
                             + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        ws.append(p)
    remote = ["--trunk", "remote", "--hello-timeout-ms", "20000"]
    for e in eps:
        remote += ["--worker", e]
    return ws, remote


def trunk_remote_serve():
    """The cache with the trunk remote in `shoal serve` (the state stays on the coordinator): a
    second user turn after a shared system prompt resumes from its capture, ids equal in process."""
    rng = random.Random(21)
    ws, remote = trunk_workers()
    ref = Server("--slots", "1", "--prefix-cache-gb", "0")  # the reference: no cache
    srv = None
    try:
        srv = Server("--slots", "2", "--prefix-cache-gb", "0.1", *remote)
        check("trunk_remote_really_remote", "matrices on the workers" in srv.logtext(), srv.logtext()[-600:])
        S = {"role": "system", "content": "remote system " + words(rng, 40)}
        out = []
        for u in ("first " + words(rng, 4), "second " + words(rng, 5)):
            m = [S, {"role": "user", "content": u}]
            out.append((ref.chat(m, sample=True), srv.chat(m, sample=True)))
        a, b = out[1]
        eom = int(sh(["tokenize", "--model", TINY, "--allow-special", EOM]).stdout.strip())
        L = [i + 1 for i, t in enumerate(a["prompt_ids"]) if t == eom][0]
        check("trunk_remote_cached_tokens", b["cached"] == L, f"cached {b['cached']}, want {L}")
        check("trunk_remote_same_ids", all(same(x, y) for x, y in out), str(out))
    finally:
        ref.stop()
        if srv:
            srv.stop()
        for p in ws:
            harness.terminate(p)


def run_identity(tmp):
    rng = random.Random(5)
    prefix = [rng.randrange(1, 3800) for _ in range(70)]
    full = prefix + [rng.randrange(1, 3800) for _ in range(23)]
    ids = lambda v: ",".join(map(str, v))  # noqa: E731
    base = ["run", "--model", TINY, "--threads", "1", "--gen", "8", "--temperature", "1", "--seed", "3", "--json"]
    ref = sh(base + ["--ids", ids(full), "--draft", "off", "--dump-logits", f"{tmp}/ref.bin"])
    if not check("run_reference", ref.returncode == 0, ref.stderr[-500:]):
        return
    refb = open(f"{tmp}/ref.bin", "rb").read()
    refj = json.loads(ref.stdout)
    sv = sh(base + ["--ids", ids(prefix), "--gen", "1", "--save-state", f"{tmp}/p.shst"])
    if not check("run_save_state", sv.returncode == 0 and os.path.exists(f"{tmp}/p.shst"), sv.stderr[-500:]):
        return
    h, fids = parse_file(open(f"{tmp}/p.shst", "rb").read())
    check("run_save_state_format", fids == prefix and h["n_logits"] > 0, f"{h} {fids[:5]}")

    def load(case, extra, state=f"{tmp}/p.shst", prompt=full, want=refb, wantj=refj):
        r = sh(base + ["--ids", ids(prompt), "--load-state", state, "--dump-logits", f"{tmp}/{case}.bin"] + extra)
        if r.returncode:
            return check(case, False, r.stderr[-800:])
        j = json.loads(r.stdout)
        got = open(f"{tmp}/{case}.bin", "rb").read()
        return check(case, got == want and j["generated_ids"] == wantj["generated_ids"]
                     and j["state_loaded_tokens"] == len(fids) and j["prefill_tokens"] == len(prompt) - len(fids),
                     f"logits equal {got == want}, ids {j['generated_ids']} vs {wantj['generated_ids']}, "
                     f"loaded {j['state_loaded_tokens']}")

    load("run_inprocess_draft_off", ["--draft", "off"])
    load("run_inprocess_draft_ngram", ["--draft", "ngram"])
    load("run_workers2", ["--workers", "2", "--worker-threads", "1"])
    # the trunk remote: experts on one server, the trunk rows over two
    ws, remote = trunk_workers()
    load("run_trunk_remote", remote)
    # saved with workers, loaded in process: the state is the coordinator's either way
    sv2 = sh(base + ["--ids", ids(prefix), "--gen", "1", "--save-state", f"{tmp}/pw.shst"] + remote)
    check("run_save_trunk_remote", sv2.returncode == 0, sv2.stderr[-500:])
    for p in ws:
        harness.terminate(p)
    if sv2.returncode == 0:
        check("run_saved_remote_same_bytes", open(f"{tmp}/pw.shst", "rb").read() == open(f"{tmp}/p.shst", "rb").read(),
              "the state file differs between in-process and trunk-remote prefills")
        load("run_saved_remote_loaded_inprocess", ["--draft", "off"], state=f"{tmp}/pw.shst")
    # the whole prompt in the state: its stored logits start the generation
    r0 = sh(base + ["--ids", ids(prefix), "--draft", "off", "--dump-logits", f"{tmp}/ref0.bin"])
    load("run_whole_prompt_state", [], prompt=prefix, want=open(f"{tmp}/ref0.bin", "rb").read(),
         wantj=json.loads(r0.stdout))
    # a state that is not a prefix of the prompt is refused
    other = [7] + full[1:]
    r = sh(base + ["--ids", ids(other), "--load-state", f"{tmp}/p.shst"])
    check("run_not_a_prefix_refused", r.returncode == 2 and "not a prefix" in r.stderr, f"{r.returncode} {r.stderr}")
    # a damaged state file is refused by name (exit 3), never used
    b = bytearray(open(f"{tmp}/p.shst", "rb").read())
    b[len(b) // 2] ^= 1
    open(f"{tmp}/bad.shst", "wb").write(bytes(b))
    r = sh(base + ["--ids", ids(full), "--load-state", f"{tmp}/bad.shst"])
    check("run_damaged_state_refused", r.returncode == 3 and "bad.shst refused" in r.stderr and "checksum" in r.stderr,
          f"{r.returncode} {r.stderr[-300:]}")
    r = sh(base + ["--ids", ids(full), "--load-state", f"{tmp}/p.shst", "--model", os.path.join(SRC, "tests", "models",
                                                                                               "tiny-k3-plain")])
    check("run_other_model_state_refused", r.returncode == 3 and "another model" in r.stderr,
          f"{r.returncode} {r.stderr[-300:]}")


def serve_cases(tmp):
    rng = random.Random(9)
    cdir = f"{tmp}/cache"
    ref = Server("--slots", "2", "--prefix-cache-gb", "0")  # the reference: no cache
    srv = Server("--slots", "4", "--step-tokens", "8", "--prefix-cache-gb", "0.25", "--prefix-cache-dir", cdir,
                 "--prefix-cache-stride", "0")
    try:
        # the <|end_of_msg|> id, from the tokenizer (shoal tokenize)
        t = sh(["tokenize", "--model", TINY, "--allow-special", EOM])
        eom = [int(x) for x in t.stdout.strip().split(",")] if t.returncode == 0 else None
        if not check("eom_id", eom and len(eom) == 1, t.stdout + t.stderr):
            return
        srv.eom = ref.eom = eom[0]
        S = "You are a careful assistant. " + words(rng, 50)
        sysmsg = {"role": "system", "content": S}
        # system: a second user turn after the same system prompt
        answers = {}
        for i, u in enumerate(["first question " + words(rng, 5), "second question " + words(rng, 7)]):
            for sample in (False, True):
                msgs = [sysmsg, {"role": "user", "content": u}]
                a, b = ref.chat(msgs, sample=sample), srv.chat(msgs, sample=sample)
                answers[(i, sample)] = (a, b)
        a, b = answers[(1, False)]
        L = eom_positions(ref, a["prompt_ids"])[0]
        check("system_cached_tokens", b["cached"] == L and b["header"] == L,
              f"cached {b['cached']}, header {b['header']}, the system message is {L} tokens")
        check("system_first_request_uncached", answers[(0, False)][1]["cached"] == 0, str(answers[(0, False)][1]))
        bad = [k for k, (x, y) in answers.items() if not same(x, y)]
        check("system_same_ids", not bad, f"differ: {bad} {[answers[k] for k in bad][:1]}")
        # tools: the same tool declarations, different system prompts
        tools = [{"type": "function", "function": {"name": "get_weather", "description": words(rng, 30),
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}}}}]
        outs = []
        for j in range(2):
            msgs = [{"role": "system", "content": f"system {j} " + words(rng, 10)},
                    {"role": "user", "content": "weather?"}]
            outs.append((ref.chat(msgs, tools=tools, sample=True), srv.chat(msgs, tools=tools, sample=True)))
        a, b = outs[1]
        L = eom_positions(ref, a["prompt_ids"])[0]
        check("tools_cached_tokens", b["cached"] == L, f"cached {b['cached']}, the tool declarations end at {L}")
        check("tools_same_ids", all(same(x, y) for x, y in outs), str(outs))
        # turn: a follow-up turn resumes from the end of the previous user message
        u1 = {"role": "user", "content": "turn one " + words(rng, 6)}
        m1 = [{"role": "system", "content": "short system"}, u1]
        a1, b1 = ref.chat(m1), srv.chat(m1)
        m2 = m1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "turn two"}]
        a2, b2 = ref.chat(m2, sample=True), srv.chat(m2, sample=True)
        L = eom_positions(ref, a2["prompt_ids"])[1]
        check("turn_cached_tokens", b2["cached"] == L, f"cached {b2['cached']}, the first user turn ends at {L}")
        check("turn_same_ids", same(a1, b1) and same(a2, b2), f"{a2} {b2}")
        # concurrent: 6 requests sharing a long new system prompt, sent together
        S2 = "Shared concurrent system prompt. " + words(rng, 150)
        m0 = srv.metrics()
        res = [None] * 6

        def go(i):
            try:
                res[i] = srv.chat([{"role": "system", "content": S2}, {"role": "user", "content": f"user {i}"}],
                                  sample=True)
            except Exception as e:  # noqa: BLE001 -- recorded below
                res[i] = {"error": repr(e)}

        ths = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        m1_ = srv.metrics()
        if not check("concurrent_answered", all(r and "ids" in r for r in res), str(res)):
            return
        L2 = eom_positions(ref, res[0]["prompt_ids"])[0]
        cached = sorted(r["cached"] for r in res)
        pre = m1_["shoal_prefilled_tokens_total"] - m0["shoal_prefilled_tokens_total"]
        total = sum(len(r["prompt_ids"]) for r in res)
        waits = m1_["shoal_prefix_cache_waits_total"] - m0["shoal_prefix_cache_waits_total"]
        check("concurrent_prefilled_once", cached == [0] + [L2] * 5 and pre == total - 5 * L2 and waits >= 1,
              f"cached {cached} (system prompt {L2}), prefilled {pre} of {total} (want {total - 5 * L2}), "
              f"waits {waits}")
        refs = [ref.chat([{"role": "system", "content": S2}, {"role": "user", "content": f"user {i}"}], sample=True)
                for i in range(6)]
        check("concurrent_same_ids", all(same(x, y) for x, y in zip(refs, res)), "")
        m = srv.metrics()
        check("metrics_counted", m["shoal_prefix_cache_hits_total"] >= 9 and m["shoal_prefix_cache_captures_total"] > 0
              and 1 <= m["shoal_prefix_cache_disk_writes_total"] <= m["shoal_prefix_cache_captures_total"]
              and m["shoal_prefix_cache_saved_tokens_total"] > 0 and m["shoal_prefix_cache_bytes"] > 0, str(
                  {k: v for k, v in m.items() if "prefix" in k}))
        tp = sh(["top", "--coordinator", srv.url, "--once"])
        check("top_shows_prefix_cache", f"prefix cache: {m['shoal_prefix_cache_hits_total']:.0f} hits of "
              f"{m['shoal_prefix_cache_lookups_total']:.0f} prompts" in tp.stdout, tp.stdout[-800:] + tp.stderr[-300:])
        srv.stop()
        # every file in the directory reads back with the documented layout
        files = sorted(os.listdir(cdir))
        bad = []
        for f in files:
            try:
                parse_file(open(os.path.join(cdir, f), "rb").read())
            except AssertionError as e:
                bad.append(f"{f}: {e}")
        check("file_format", len(files) == m["shoal_prefix_cache_captures_total"] and not bad and all(re.fullmatch(r"pc-[0-9a-f]{16}-\d+\.shst", f) for f in files),
              f"{len(files)} files for {m['shoal_prefix_cache_captures_total']} captures, {bad[:3]}")

        # restart: the same directory, a new user turn after S
        srv = Server("--slots", "2", "--prefix-cache-gb", "0.25", "--prefix-cache-dir", cdir, "--prefix-cache-stride",
                     "16")
        msgs = [sysmsg, {"role": "user", "content": "third question " + words(rng, 4)}]
        a, b = ref.chat(msgs, sample=True), srv.chat(msgs, sample=True)
        L = eom_positions(ref, a["prompt_ids"])[0]
        m = srv.metrics()
        check("restart_cached_tokens", b["cached"] == L and m["shoal_prefix_cache_disk_reads_total"] >= 1,
              f"cached {b['cached']} (want {L}), disk reads {m['shoal_prefix_cache_disk_reads_total']}")
        check("restart_same_ids", same(a, b), f"{a} {b}")
        # stride: completions of token ids (no message ends), captured every 16 tokens (this server's stride)
        X = [rng.randrange(1, 3800) for _ in range(40)]
        c = [(ref.complete(X + [5, 6, 7, 8, 9]), srv.complete(X + [5, 6, 7, 8, 9])),
             (ref.complete(X + [9, 8, 7], sample=True), srv.complete(X + [9, 8, 7], sample=True))]
        check("stride_cached_tokens", c[1][1]["cached"] == 32, f"cached {c[1][1]['cached']}, want 32 (2 x 16 of the "
              f"40 shared)")
        check("stride_same_ids", all(same(x, y) for x, y in c), str(c))
        srv.stop()

        # damaged files: the capture a new request would resume from gets a
        # flipped payload byte; two captures it would not use are truncated
        # and made "another model's". Which capture is used is worked out here
        # from the files (the longest intact one whose ids start the prompt).
        def files():
            out = {}
            for f in sorted(os.listdir(cdir)):
                try:
                    out[os.path.join(cdir, f)] = parse_file(open(os.path.join(cdir, f), "rb").read())[1]
                except AssertionError:
                    pass
            return out

        def longest(fl, prompt, skip=()):
            c = [len(v) for k, v in fl.items() if k not in skip and len(v) < len(prompt) and prompt[:len(v)] == v]
            return max(c, default=0)

        msgs = [sysmsg, {"role": "user", "content": "fourth question " + words(rng, 4)}]
        a = ref.chat(msgs, sample=True)
        fl = files()
        n_fs = longest(fl, a["prompt_ids"])
        fs = next((k for k, v in fl.items() if len(v) == n_fs and a["prompt_ids"][:n_fs] == v), None)
        others = [k for k, v in fl.items() if a["prompt_ids"][:len(v)] != v]
        if not check("damaged_setup", fs and len(others) >= 2, f"{fs} {len(others)}"):
            return
        b0 = bytearray(open(fs, "rb").read())  # read before the write below truncates it
        b0[len(b0) // 2] ^= 0x40
        open(fs, "wb").write(bytes(b0))
        ft, fw = others[0], others[1]
        os.truncate(ft, os.path.getsize(ft) - 100)
        wb = refingerprint(open(fw, "rb").read())
        open(fw, "wb").write(wb)
        want1 = longest(fl, a["prompt_ids"], skip=(fs, ft, fw))
        srv = Server("--slots", "2", "--prefix-cache-gb", "0.25", "--prefix-cache-dir", cdir, "--prefix-cache-stride",
                     "16")
        b = srv.chat(msgs, sample=True)
        b2 = srv.chat(msgs, sample=True)  # again: the damaged capture was recomputed and written anew
        log = srv.logtext()
        m = srv.metrics()
        named = [os.path.basename(f) in log for f in (fs, ft, fw)]
        check("damaged_refused_by_name", all(named) and m["shoal_prefix_cache_refused_total"] >= 3
              and "checksum" in log and "truncated" in log and "another model" in log,
              f"named {named}, refused {m['shoal_prefix_cache_refused_total']}: "
              f"{[l for l in log.splitlines() if 'refused' in l][:4]}")
        # the first request captured every message end and 16th position past its resume point
        P = a["prompt_ids"]
        want2 = max(p for p in range(1, len(P)) if p % 16 == 0 or P[p - 1] == ref.eom)
        check("damaged_recomputed", b["cached"] == want1 < n_fs and b2["cached"] == want2,
              f"first {b['cached']} (want {want1}: the capture at {n_fs} is damaged), then {b2['cached']} "
              f"(want {want2}: recaptured)")
        check("damaged_same_ids", same(a, b) and same(a, b2), f"{a} {b} {b2}")
        srv.stop()  # the writer finishes what is queued before the server exits
        try:
            parse_file(open(fs, "rb").read())
            ok = True
        except AssertionError:
            ok = False
        check("damaged_file_rewritten", ok, "the recomputed capture did not replace the damaged file")
        # the truncated file is this cache's own and damaged: removed at open;
        # another model's file is not this server's to delete: left in place
        check("damaged_truncated_removed_other_model_left", not os.path.exists(ft) and os.path.exists(fw),
              f"truncated {ft} exists: {os.path.exists(ft)}; other model's {fw} exists: {os.path.exists(fw)}")
    finally:
        ref.stop()
        srv.stop()


def own_files(d):
    return {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if re.fullmatch(r"pc-[0-9a-f]{16}-\d+\.shst", f)}


poll = harness.poll


def disk_hygiene(tmp):
    """The disk tier's size cap (LRU files removed, counted), its lock, stale .tmp files removed at
    start-up by name, and a file truncated after it was indexed refused by name and removed."""
    rng = random.Random(17)
    cdir = f"{tmp}/hygiene"
    ref = Server("--slots", "1", "--prefix-cache-gb", "0")  # the reference: no cache
    srv = None
    try:
        t = sh(["tokenize", "--model", TINY, "--allow-special", EOM])
        ref.eom = int(t.stdout.strip())
        systems = [f"hygiene system {k} " + words(rng, 12) for k in range(5)]
        msgs = [[{"role": "system", "content": S}, {"role": "user", "content": f"first {k}"}]
                for k, S in enumerate(systems)]
        refs = [ref.chat(m, sample=True) for m in msgs]
        # tiny-k3: a capture at p tokens is a file of 96 + 125952 + p x (1152 + 4) bytes; each request
        # captures its system message and its user message (two files): the budget holds 3 of the longest
        P = max(len(a["prompt_ids"]) for a in refs)
        cap = 3 * (96 + 125952 + P * 1156)
        flags = ["--slots", "1", "--prefix-cache-gb", "0", "--prefix-cache-dir", cdir, "--prefix-cache-stride", "0",
                 "--prefix-cache-disk-gb", repr(cap / 2 ** 30)]
        srv = Server(*flags)
        srv.eom = ref.eom
        ok = True
        for a, m in zip(refs, msgs):
            ok = ok and same(a, srv.chat(m, sample=True))
        check("disk_cap_same_ids", ok, "")

        def settled():
            m = srv.metrics()
            f = own_files(cdir)
            return (m, f) if m["shoal_prefix_cache_disk_bytes"] == sum(f.values()) else None

        got = poll(settled)
        m, f = got if got else (srv.metrics(), own_files(cdir))
        check("disk_cap_kept", got and 0 < sum(f.values()) <= cap and m["shoal_prefix_cache_disk_evictions_total"] > 0
              and m["shoal_prefix_cache_disk_budget_bytes"] == int(cap / 2 ** 30 * 2 ** 30),
              f"files {f} (sum {sum(f.values())}, cap {cap}), metrics "
              f"{ {k: v for k, v in m.items() if 'disk' in k} }")
        # least recently used out first: the last system prompt is still on disk, the first is not
        outs = []
        for k in (4, 0):
            msg = [{"role": "system", "content": systems[k]}, {"role": "user", "content": f"again {k}"}]
            outs.append((ref.chat(msg, sample=True), srv.chat(msg, sample=True)))
        L4 = eom_positions(ref, outs[0][0]["prompt_ids"])[0]
        check("disk_cap_lru", outs[0][1]["cached"] == L4 and outs[1][1]["cached"] == 0,
              f"last system cached {outs[0][1]['cached']} (want {L4}), first {outs[1][1]['cached']} (want 0: evicted)")
        check("disk_cap_lru_same_ids", all(same(x, y) for x, y in outs), str(outs))
        # one server per directory: a second one on it is refused by name
        p = subprocess.run([BIN, "serve", "--model", TINY, "--port", "0", "--threads", "1", "--prefix-cache-dir",
                            cdir], capture_output=True, text=True, timeout=120)
        check("disk_lock_refused", p.returncode == 4 and "in use by another process" in p.stderr and cdir in p.stderr,
              f"rc {p.returncode}: {p.stderr[-400:]}")
        # a file truncated after it was indexed (the system prompt's capture a new turn resumes from)
        # (the first system prompt's, captured again just now: the most recent)
        L4 = eom_positions(ref, outs[1][0]["prompt_ids"])[0]
        msg = [{"role": "system", "content": systems[0]}, {"role": "user", "content": "a third turn"}]
        a = ref.chat(msg, sample=True)
        victim = next((x for x in own_files(cdir) if x.endswith(f"-{L4}.shst")), None)
        if check("truncated_setup", victim, str(own_files(cdir))):
            vp = os.path.join(cdir, victim)
            os.truncate(vp, os.path.getsize(vp) // 2)
            b = srv.chat(msg, sample=True)
            log = srv.logtext()
            check("truncated_in_use_refused_removed", b["cached"] < L4 and same(a, b) and
                  any(victim in ln and "refused" in ln and "removed" in ln for ln in log.splitlines())
                  and srv.metrics()["shoal_prefix_cache_removed_files_total"] >= 1,
                  f"cached {b['cached']}, {[ln for ln in log.splitlines() if victim in ln][:3]}")
        srv.stop()
        # a crash during a write leaves pc-*.shst.tmp: removed at start-up and named; other files stay
        stale = os.path.join(cdir, "pc-00000000deadbeef-12.shst.tmp")
        other = os.path.join(cdir, "notes.tmp")
        open(stale, "wb").write(b"\0" * 1000)
        open(other, "w").write("not the cache's")
        srv = Server(*flags)
        log = srv.logtext()
        check("stale_tmp_removed", not os.path.exists(stale) and os.path.exists(other)
              and any("removed" in ln and stale in ln for ln in log.splitlines())
              and srv.metrics()["shoal_prefix_cache_removed_files_total"] == 1,
              f"stale exists {os.path.exists(stale)}, other {os.path.exists(other)}, "
              f"{[ln for ln in log.splitlines() if 'tmp' in ln][:3]}")
        # a lower budget at start-up: the oldest files go until the rest fit
        srv.stop()
        before = own_files(cdir)
        small = max(before.values())
        srv = Server("--slots", "1", "--prefix-cache-gb", "0", "--prefix-cache-dir", cdir, "--prefix-cache-disk-gb",
                     repr(small / 2 ** 30))
        after = own_files(cdir)
        m = srv.metrics()
        check("disk_cap_at_start", sum(after.values()) <= small and len(after) < len(before)
              and m["shoal_prefix_cache_disk_evictions_total"] == len(before) - len(after)
              and m["shoal_prefix_cache_disk_bytes"] == sum(after.values()),
              f"before {before}, after {after}, budget {small}")
    finally:
        ref.stop()
        if srv:
            srv.stop()


def eviction_case():
    rng = random.Random(13)
    # ~3 captures of a ~60-token system message of tiny-k3 fit in this budget
    ref = Server("--slots", "1", "--prefix-cache-gb", "0")  # the reference: no cache
    srv = Server("--slots", "2", "--prefix-cache-gb", "0.0005", "--prefix-cache-stride", "0", "--workers", "2",
                 "--worker-threads", "1", "--draft", "ngram")
    try:
        systems = ["system " + str(k) + " " + words(rng, 40) for k in range(5)]
        ok, why, hits = True, "", 0
        for rnd_ in range(2):
            for k, S in enumerate(systems):
                msgs = [{"role": "system", "content": S}, {"role": "user", "content": f"q {rnd_} {k}"}]
                a, b = ref.chat(msgs, sample=True), srv.chat(msgs, sample=True)
                hits += b["cached"] > 0
                if not same(a, b):
                    ok, why = False, f"round {rnd_} system {k}: {a} vs {b}"
        m = srv.metrics()
        check("eviction_same_ids", ok, why)
        check("eviction_counted", m["shoal_prefix_cache_evictions_total"] > 0
              and m["shoal_prefix_cache_bytes"] <= 0.0005 * 2 ** 30,
              str({k: v for k, v in m.items() if "prefix" in k}))
    finally:
        ref.stop()
        srv.stop()


def main():
    if not os.path.exists(BIN):
        R.record("SKIP", "all", f"{BIN} not built")
        return 77
    if not os.path.exists(os.path.join(TINY, "config.json")):
        R.record("SKIP", "all", "tests/models/tiny-k3 not present")
        return 77
    try:
        import openai  # noqa: F401
    except ImportError:
        R.record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-pcache-")
    try:
        for f in (run_identity, serve_cases, disk_hygiene):
            try:
                f(tmp) if f is not eviction_case else f()
            except Exception as e:  # noqa: BLE001 -- a crash of the case is its failure
                import traceback
                traceback.print_exc()
                check(f.__name__, False, f"{type(e).__name__}: {e}")
        for f in (eviction_case, trunk_remote_serve):
            try:
                f()
            except Exception as e:  # noqa: BLE001 -- a crash of the case is its failure
                check(f.__name__, False, f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            harness.terminate(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
