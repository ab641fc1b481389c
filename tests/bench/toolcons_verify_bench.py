#!/usr/bin/env python3
"""Mask wait per decode pass for tool-call constraints with drafting, before
and after their verify rows' masks moved onto the mask thread (issue 36).

  toolcons_verify_bench.py BASE_BIN NEW_BIN MODEL_DIR TOKENIZER_DIR ROUNDS > docs/data/toolcons_verify_<date>.txt

Two `shoal serve --threads 1 --slots 1 --mask-thread on` (drafting: the
default ngram) on the same mapped model, one from BASE_BIN (tool-call
constraints' verify rows masked at sampling time) and one from NEW_BIN (the
rows' masks computed on the mask thread during the verify forward). ROUNDS
rounds; in each, every case on both servers in turn (server order alternating
per round). The cases are test_constrain.py's verify_tools requests
(tool_choice auto and required with two tools, K3's markers biased, an earlier
call of the tool in the history so the n-gram drafts hit inside calls), 160
tokens, greedy and at temperature 1.3 with seeds; both servers must return the
same ids (checked, counted in the summary).

Per request, from /metrics before and after: decode passes (plain steps and
verify chunks), masks, verify-row masks, masks computed at sampling time
(after_fwd = masks - overlapped: a slot's first, and before the change every
tool-constrained row served from a verify chunk), mask seconds and mask wait seconds
(the join wait plus masks computed at sampling time: the mask time the
forwards did not hide), and the server's process CPU time (utime + stime, all
threads, 10 ms ticks). Rows "req ...", then per server the medians per
request and the sums, and the load average before and after.
"""
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import constrain_bench  # noqa: E402  (its /metrics scrape)

WANT = ("shoal_constrain_masks_total", "shoal_constrain_masks_overlapped_total", "shoal_constrain_masks_verify_total", "shoal_constrain_mask_seconds_total",
        "shoal_constrain_mask_wait_seconds_total", "shoal_decode_passes_total", "shoal_decode_fed_tokens_total")
TICK = os.sysconf("SC_CLK_TCK")


def scrape(url):
    return constrain_bench.scrape(url, WANT)


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        st = f.read()
    fields = st[st.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start(binary, model, tok):
    p = subprocess.Popen([binary, "serve", "--model", model, "--tokenizer", tok, "--port", "0", "--model-name", "m",
                          "--threads", "1", "--slots", "1", "--memo", "0", "--mask-thread", "on"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "listening on " not in line:
        p.kill()
        sys.exit(f"serve did not start: {line!r}")
    return p, line.strip().split("listening on ")[1]


def marker_bias(tok_dir):
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        dec = json.load(f)["added_tokens_decoder"]
    want = {"<|open|>": 100, "<|close|>": 85}
    return {k: want[v["content"]] for k, v in dec.items() if v["content"] in want}


ARR = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["sea shell", "sea salt"]},
                                               "minItems": 6, "maxItems": 12}},
       "required": ["xs"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "collect", "parameters": ARR}},
         {"type": "function", "function": {"name": "wave", "parameters": {
             "type": "object", "properties": {"n": {"enum": ["one", "two"]}}, "required": ["n"],
             "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "Collect sea shell sea salt"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "collect", "arguments": json.dumps({"xs": ["sea shell", "sea salt"] * 3})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "Again: collect sea shell sea salt"}]
CASES = [("auto", 0, 0), ("auto", 1.3, 0), ("auto", 1.3, 1), ("required", 0, 0), ("required", 1.3, 1)]


def one(url, pid, choice, temp, seed, bias):
    body = {"model": "m", "messages": MSGS, "max_tokens": 160, "temperature": temp, "seed": seed, "tools": TOOLS,
            "tool_choice": choice, "logit_bias": bias, "return_token_ids": True}
    m0, c0 = scrape(url), proc_cpu(pid)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        resp = json.loads(r.read())
    c1, m1 = proc_cpu(pid), scrape(url)
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in WANT}
    d["cpu"] = c1 - c0
    return d, resp["choices"][0].get("token_ids")


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    base_bin, new_bin, model, tok, rounds = sys.argv[1:5] + [int(sys.argv[5])]
    bias = marker_bias(tok)
    srv = {"base": start(base_bin, model, tok), "new": start(new_bin, model, tok)}
    print(f"# toolcons_verify_bench: base={base_bin} new={new_bin} model={model} rounds={rounds}")
    print(f"# load before: {os.getloadavg()}")
    rows = {"base": [], "new": []}
    same = diff = 0
    try:
        for rnd in range(rounds):
            order = ("base", "new") if rnd % 2 == 0 else ("new", "base")
            for choice, temp, seed in CASES:
                ids = {}
                for name in order:
                    p, url = srv[name]
                    d, ids[name] = one(url, p.pid, choice, temp, seed, bias)
                    rows[name].append(d)
                    passes = max(d["shoal_decode_passes_total"], 1)
                    print(f"req server={name} round={rnd} case={choice}/{temp}/{seed} tokens={len(ids[name] or [])} "
                          f"passes={d['shoal_decode_passes_total']:.0f} masks={d['shoal_constrain_masks_total']:.0f} "
                          f"verify_masks={d['shoal_constrain_masks_verify_total']:.0f} "
                          f"after_fwd={d['shoal_constrain_masks_total'] - d['shoal_constrain_masks_overlapped_total']:.0f} "
                          f"mask_ms={d['shoal_constrain_mask_seconds_total'] * 1e3:.3f} "
                          f"wait_ms={d['shoal_constrain_mask_wait_seconds_total'] * 1e3:.3f} "
                          f"wait_us_per_pass={d['shoal_constrain_mask_wait_seconds_total'] * 1e6 / passes:.1f} "
                          f"cpu_s={d['cpu']:.2f}", flush=True)
                if ids["base"] == ids["new"]:
                    same += 1
                else:
                    diff += 1
    finally:
        for p, _ in srv.values():
            p.terminate()
            p.wait(timeout=30)
    print(f"# load after: {os.getloadavg()}")
    print(f"# same ids base vs new: {same} of {same + diff}")
    for name in ("base", "new"):
        rs = rows[name]
        tot = {k: sum(r[k] for r in rs) for k in rs[0]}
        wpp = [r["shoal_constrain_mask_wait_seconds_total"] * 1e6 / max(r["shoal_decode_passes_total"], 1) for r in rs]
        print(f"summary server={name} requests={len(rs)} passes={tot['shoal_decode_passes_total']:.0f} "
              f"masks={tot['shoal_constrain_masks_total']:.0f} verify_masks={tot['shoal_constrain_masks_verify_total']:.0f} "
              f"after_fwd={tot['shoal_constrain_masks_total'] - tot['shoal_constrain_masks_overlapped_total']:.0f} "
              f"mask_s={tot['shoal_constrain_mask_seconds_total']:.4f} wait_s={tot['shoal_constrain_mask_wait_seconds_total']:.4f} "
              f"wait_us_per_pass_total={tot['shoal_constrain_mask_wait_seconds_total'] * 1e6 / max(tot['shoal_decode_passes_total'], 1):.1f} "
              f"wait_us_per_pass_median={statistics.median(wpp):.1f} [min {min(wpp):.1f}, max {max(wpp):.1f}] "
              f"cpu_s={tot['cpu']:.2f}")


if __name__ == "__main__":
    main()
