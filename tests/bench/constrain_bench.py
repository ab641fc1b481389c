#!/usr/bin/env python3
"""Decode step time with and without a structured-output constraint (issue 36).

  constrain_bench.py [--servers overlap,after] MODEL_DIR NAME ROUNDS STEPS [serve args...] > docs/data/constrain_decode_<name>.txt
  constrain_bench.py --summarize FILE [SKIP_ROUNDS]   (the summary of a cut run's rows)

Two `shoal serve --threads 1` on MODEL_DIR (the same mapped files): "overlap",
the default (--mask-thread auto: the next mask computed on the mask thread while
the forward runs), and "after" (--mask-thread off: the mask computed at sampling
time, after the forward: the behaviour before the overlap); --servers picks
one or both. Only one of them works at a time.
ROUNDS rounds; in each, every kind on both servers in turn (interleaved, the
server order alternating per round, so load drifts hit all alike):
  free          no constraint
  json_object   response_format json_object
  schema_20     json_schema: 20 required fields (the 20-field schema of
                tests/bench/bench_constrain.c)
  recursive     json_schema: a tree via $ref/$defs (same file)
  gbnf          grammar: llama.cpp's arithmetic GBNF (same file)
temperature 1.0, max_tokens STEPS, seed = round, thinking off for all.

The measure is the server's own: the per-step decode time is the mean of the
request's inter-token intervals, taken from /metrics before and after the request
(shoal_request_inter_token_seconds sum / count: one interval per generated
token after the first, i.e. per decode step actually run; prefill, the first
token and the HTTP ending are out), so requests that end early (a constraint
that completes) are compared per step, not per request. The mask time per step
is shoal_constrain_mask_seconds_total / shoal_constrain_masks_total over the
same request, and the exposed part shoal_constrain_mask_wait_seconds_total.
Rows: "req server= kind= round= steps= step_ms= mask_us= wait_us= masks=",
then per (server, kind) "summary ..." with the median step time [min, max],
the ratio of medians to free on the same server, and the mask fraction of the
step; the load average before and after.

Process CPU time per decode step (cpu_ms): the request is streamed, and the
server process's CPU time (utime + stime of all its threads, mask thread
included, /proc/PID/stat, 10 ms ticks) is read at the first streamed chunk and
after the last ([DONE]); the difference over the decode steps between the two
reads (the inter-token count scraped at the first chunk and at the end: a
first token that ends inside a UTF-8 character sends no chunk) is the CPU a
step costs. Other processes on the
machine slow the wall-clock step but add nothing to this server's CPU time, so
on a loaded box cpu_ms resolves what step_ms cannot. sched_ms is the same from
/proc/PID/task/*/schedstat (ns, the threads alive at both reads).
"""
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))


def f20_schema():
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"enum": ["low", "mid", "high"]},
             {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
             {"type": "string", "format": "date"},
             {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": ["integer", "null"]}},
              "required": ["a", "b"], "additionalProperties": False}]
    props = {f"field_{i:02d}": kinds[i % 8] for i in range(20)}
    return {"type": "object", "additionalProperties": False, "properties": props, "required": list(props)}


REC = {"$ref": "#/$defs/n", "$defs": {"n": {
    "type": "object",
    "properties": {"name": {"type": "string"},
                   "value": {"anyOf": [{"type": "number"}, {"type": "string"}, {"type": "null"}]},
                   "children": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
    "required": ["name", "children"], "additionalProperties": False}}}

GBNF = ('root  ::= (expr "=" ws term "\\n")+\nexpr  ::= term ([-+*/] term)*\n'
        'term  ::= ident | num | "(" ws expr ")" ws\nident ::= [a-z] [a-z0-9_]* ws\n'
        'num   ::= [0-9]+ ws\nws    ::= [ \\t\\n]*\n')

KINDS = {
    "free": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "schema_20": {"response_format": {"type": "json_schema", "json_schema": {"name": "f20", "schema": f20_schema()}}},
    "recursive": {"response_format": {"type": "json_schema", "json_schema": {"name": "tree", "schema": REC}}},
    "gbnf": {"grammar": GBNF},
}

WANT = ("shoal_request_inter_token_seconds_sum", "shoal_request_inter_token_seconds_count",
        "shoal_constrain_mask_seconds_total", "shoal_constrain_masks_total",
        "shoal_constrain_mask_wait_seconds_total")


def scrape(url, want=WANT):
    """the unlabelled metrics named in want, from the server's /metrics"""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    got = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in want:
            got[parts[0]] = float(parts[1])
    return got


def start(model, name, extra, env_add):
    env = dict(os.environ, **env_add)
    p = subprocess.Popen([BIN, "serve", "--model", model, "--port", "0", "--model-name", name, "--threads", "1",
                          "--memo", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env)
    line = p.stdout.readline()
    if "listening on " not in line:
        p.kill()
        sys.exit(f"serve did not start: {line!r}")
    return p, line.strip().split("listening on ")[1], p.pid


TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """(utime + stime of every thread of pid, seconds; the sum of the
    schedstat run times of its live threads, seconds)"""
    with open(f"/proc/{pid}/stat") as f:
        st = f.read()
    fields = st[st.rindex(")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    ns = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                ns += int(f.read().split()[0])
        except OSError:
            pass
    return cpu, ns / 1e9


def one(url, name, kw, steps, seed, pid):
    """Streams the request; returns (tokens, finish, cpu s, schedstat s) with
    the CPU times from the first chunk to the end of the stream."""
    body = {"model": name, "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": steps,
            "temperature": 1.0, "seed": seed, "chat_template_kwargs": {"thinking": False}, "stream": True,
            "stream_options": {"include_usage": True}, **kw}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    c0 = None
    first = {}
    n, fin = 0, None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                if c0 is None and (d.get("content") or d.get("reasoning_content")):
                    c0 = proc_cpu(pid)
                    first = scrape(url)
                if ch.get("finish_reason"):
                    fin = ch["finish_reason"]
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
    c1 = proc_cpu(pid)
    if c0 is None:
        c0 = c1
    return n, fin, c1[0] - c0[0], c1[1] - c0[1], first.get("shoal_request_inter_token_seconds_count")


def summarize(rows):
    cpu_summary(rows)
    for sv in ("overlap", "after"):
        free = rows.get((sv, "free"))
        if not free:
            continue
        fm = statistics.median(x[0] for x in free) if free else float("nan")
        for k in KINDS:
            v = rows.get((sv, k))
            if not v:
                continue
            st = [x[0] for x in v]
            m = statistics.median(st)
            mk = statistics.median(x[1] for x in v)
            wt = statistics.median(x[2] for x in v)
            print(f"summary server={sv} kind={k} n={len(v)} step_ms_median={m:.1f} min={min(st):.1f} "
                  f"max={max(st):.1f} ratio_to_free={m / fm:.3f} tok_s_ratio={fm / m:.3f} mask_us_median={mk:.1f} "
                  f"mask_frac={mk / 1e3 / m:.5f} wait_us_median={wt:.1f} wait_frac={wt / 1e3 / m:.5f}")
    # paired per round: constrained / free on the same server and round
    for sv in ("overlap", "after"):
        for k in KINDS:
            if k == "free" or (sv, k) not in rows or (sv, "free") not in rows:
                continue
            pr = [a[0] / b[0] for a, b in zip(rows[(sv, k)], rows[(sv, "free")])]
            print(f"paired server={sv} kind={k} ratio_median={statistics.median(pr):.3f} min={min(pr):.3f} "
                  f"max={max(pr):.3f} n={len(pr)}")
    # overlap vs after, per kind and round (the same constraint and seed)
    for k in KINDS:
        a, b = rows.get(("overlap", k), []), rows.get(("after", k), [])
        pr = [x[0] / y[0] for x, y in zip(a, b)]
        if pr:
            print(f"overlap_vs_after kind={k} ratio_median={statistics.median(pr):.3f} min={min(pr):.3f} "
                  f"max={max(pr):.3f} n={len(pr)}")


def cpu_summary(rows):
    """process CPU per decode step: median [min, max] per kind, the ratio of
    medians to free and the paired per-round ratios (same server, round)"""
    for sv in ("overlap", "after"):
        free = [x[3] for x in rows.get((sv, "free"), []) if len(x) > 3 and x[3] == x[3]]
        if not free:
            continue
        fm = statistics.median(free)
        for k in KINDS:
            v = [x for x in rows.get((sv, k), []) if len(x) > 3 and x[3] == x[3]]
            if not v:
                continue
            c = [x[3] for x in v]
            sc = [x[4] for x in v]
            m = statistics.median(c)
            line = (f"cpu server={sv} kind={k} n={len(v)} cpu_ms_median={m:.1f} min={min(c):.1f} max={max(c):.1f} "
                    f"ratio_to_free={m / fm:.4f} sched_ms_median={statistics.median(sc):.1f}")
            if k != "free":
                fr = {x[5]: x[3] for x in rows.get((sv, "free"), []) if len(x) > 5}
                pr = sorted(x[3] / fr[x[5]] for x in v if x[5] in fr)
                if pr:
                    line += (f" paired_median={statistics.median(pr):.4f} paired_min={pr[0]:.4f} "
                             f"paired_max={pr[-1]:.4f}")
            print(line)


def from_file(path, skip_rounds):
    """The summary of the req rows of an earlier (possibly cut) run, without
    its first skip_rounds rounds (the first requests fault the model's pages in)."""
    rows = {}
    for line in open(path):
        if not line.startswith("req ") or "step_ms=" not in line:
            continue
        f = dict(x.split("=", 1) for x in line.split()[1:])
        if int(f["round"]) < skip_rounds:
            continue
        row = (float(f["step_ms"]), float(f["mask_us"]), float(f["wait_us"]))
        if "cpu_ms" in f:
            row += (float(f["cpu_ms"]), float(f["sched_ms"]), int(f["round"]))
        rows.setdefault((f["server"], f["kind"]), []).append(row)
    print(f"# summary of {path} without round(s) < {skip_rounds}")
    summarize(rows)


def main():
    if sys.argv[1] == "--summarize":
        from_file(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
        return
    args = sys.argv[1:]
    which = ["overlap", "after"]
    if args[0] == "--servers":
        which = args[1].split(",")
        args = args[2:]
    model, name, rounds, steps = args[0], args[1], int(args[2]), int(args[3])
    extra = args[4:]
    servers = {}
    print(f"# {name} {model} rounds={rounds} max_tokens={steps} threads=1 load_before={os.getloadavg()}", flush=True)
    rows = {}
    try:
        flag = {"overlap": ["--mask-thread", "auto"], "after": ["--mask-thread", "off"]}
        for sv in which:
            servers[sv] = start(model, name, extra + flag[sv], {})
        order = which
        for r in range(rounds):
            kinds = list(KINDS.items())
            for k, kw in (kinds if r % 2 == 0 else kinds[::-1]):  # the kind order alternates too
                for sv in (order if r % 2 == 0 else order[::-1]):
                    url, pid = servers[sv][1], servers[sv][2]
                    m0 = scrape(url)
                    n, fin, cpu, sch, at_first = one(url, name, kw, steps, r, pid)
                    m1 = scrape(url)
                    d = {w: m1.get(w, 0.0) - m0.get(w, 0.0) for w in WANT}
                    cnt = d["shoal_request_inter_token_seconds_count"]
                    if cnt < 1:
                        print(f"req server={sv} kind={k} round={r} tokens={n} finish={fin} steps=0 (skipped)",
                              flush=True)
                        continue
                    step_ms = d["shoal_request_inter_token_seconds_sum"] / cnt * 1e3
                    masks = d["shoal_constrain_masks_total"]
                    mask_us = d["shoal_constrain_mask_seconds_total"] / masks * 1e6 if masks else 0.0
                    wait_us = d["shoal_constrain_mask_wait_seconds_total"] / masks * 1e6 if masks else 0.0
                    # the steps between the CPU reads: the inter-token count at the
                    # first chunk (a first token that ends inside a UTF-8
                    # character sends no chunk: the first chunk may come after
                    # several steps) to the end
                    csteps = m1.get("shoal_request_inter_token_seconds_count", 0.0) - (at_first or 0.0)
                    if at_first is None or csteps < 1:
                        csteps = float("nan")
                    cpu_ms, sched_ms = cpu / csteps * 1e3, sch / csteps * 1e3
                    rows.setdefault((sv, k), []).append((step_ms, mask_us, wait_us, cpu_ms, sched_ms, r))
                    print(f"req server={sv} kind={k} round={r} tokens={n} finish={fin} steps={int(cnt)} "
                          f"cpu_steps={csteps:.0f} "
                          f"step_ms={step_ms:.1f} cpu_ms={cpu_ms:.2f} sched_ms={sched_ms:.2f} masks={int(masks)} "
                          f"mask_us={mask_us:.1f} wait_us={wait_us:.1f} "
                          f"load1={os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for p, _, _ in servers.values():
            p.terminate()
        for p, _, _ in servers.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    summarize(rows)
    print(f"# load_after={os.getloadavg()}")


if __name__ == "__main__":
    main()
