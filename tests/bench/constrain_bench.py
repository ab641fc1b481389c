#!/usr/bin/env python3
"""Decode rate with and without a structured-output constraint (issue 36).

  constrain_bench.py MODEL_DIR NAME ROUNDS [--tokenizer DIR] > docs/data/constrain_decode_<name>.txt

One `shoal serve --threads 1` on MODEL_DIR; ROUNDS rounds, each one request of
every kind in turn (interleaved, so load drifts hit all kinds alike):
  free         no constraint
  json_object  response_format json_object
  schema       response_format json_schema (an object with a long free string,
               an integer and an enum)
temperature 1.0, max_tokens 48 (SHOAL_BENCH_MAX_TOKENS), seed = round, thinking off for all (a
constrained request renders with thinking off). Streamed: the decode rate of a
request is (tokens - 1) / (time of the last chunk - time of the first), so
prefill and queueing are out. Rows: "req kind=<k> round=<r> tokens=<n>
decode_tok_s=<x>", then per kind "summary kind=<k> median_tok_s= min= max=
ratio_to_free=" and the load average.
"""
import os
import statistics
import subprocess
import sys
import time

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MAX_TOKENS = int(os.environ.get("SHOAL_BENCH_MAX_TOKENS", "48"))  # 16 for the k3-slice (~0.4 s a token)


def main():
    model, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = sys.argv[4:]
    p = subprocess.Popen([BIN, "serve", "--model", model, "--port", "0", "--model-name", name, "--threads", "1",
                          "--memo", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    url = line.strip().split("listening on ")[1]
    import openai
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"story": {"type": "string"}, "n": {"type": "integer"},
                                               "mood": {"enum": ["calm", "wild"]}},
              "required": ["story", "n", "mood"], "additionalProperties": False}
    kinds = {"free": {}, "json_object": {"response_format": {"type": "json_object"}},
             "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}}
    rates = {k: [] for k in kinds}
    print(f"# {name} {model} rounds={rounds} load_before={os.getloadavg()}")
    try:
        for r in range(rounds):
            for k, kw in kinds.items():
                times = []
                n = 0
                stream = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Tell a story"}],
                                                   max_tokens=MAX_TOKENS, temperature=1.0, seed=r, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"chat_template_kwargs": {"thinking": False}}, **kw)
                for ch in stream:
                    if ch.choices and (ch.choices[0].delta.content or getattr(ch.choices[0].delta,
                                                                              "reasoning_content", None)):
                        times.append(time.perf_counter())
                    if ch.usage:
                        n = ch.usage.completion_tokens
                if len(times) >= 2 and n >= 4 and times[-1] > times[0]:
                    rate = (n - 1) / (times[-1] - times[0])
                    rates[k].append(rate)
                    print(f"req kind={k} round={r} tokens={n} decode_tok_s={rate:.1f}", flush=True)
    finally:
        p.terminate()
        p.wait(30)
    free = statistics.median(rates["free"]) if rates["free"] else float("nan")
    for k, v in rates.items():
        if v:
            m = statistics.median(v)
            print(f"summary kind={k} n={len(v)} median_tok_s={m:.1f} min={min(v):.1f} max={max(v):.1f} "
                  f"ratio_to_free={m / free:.3f}")
    print(f"# load_after={os.getloadavg()}")


if __name__ == "__main__":
    main()
