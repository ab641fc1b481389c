#!/usr/bin/env bash
# The README's first command: installs what is missing (scripts/deps.sh),
# builds shoal, and runs the main job on the bundled model tests/models/k3-nano
# (a small K3 trained on the Python documentation, in the real K3 layout at toy
# widths, so the answers are readable text): `shoal inspect` (the
# config summary, the layer schedule and the inventory check of every tensor
# the engine needs), then two expert servers (`shoal expert`, each owning half
# of every MoE layer's routed experts) and a coordinator (`shoal run --worker
# ... --worker ...`) generating a continuation; last, `shoal serve` on the same
# two workers answers one chat request from the official `openai` client
# (docs/API.md). Safe to rerun.
# Usage: scripts/demo.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
model=tests/models/k3-nano

bash scripts/deps.sh || { echo "demo: dependency installation failed (see above)" >&2; exit 1; }
echo "== build (build/bin/shoal) ==" >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null \
    || { echo "demo: cmake configure failed" >&2; exit 1; }
cmake --build build -j"$(nproc)" >/dev/null || { echo "demo: build failed (rerun: cmake --build build)" >&2; exit 1; }
[ -f "$model/config.json" ] || { echo "demo: $model is missing from this checkout" >&2; exit 1; }

echo "== shoal inspect $model ==" >&2
build/bin/shoal inspect "$model"

echo "== two expert servers and a coordinator ==" >&2
# abstract-namespace ipc endpoints: nothing left on disk; tcp://HOST:PORT works the same
ep0="ipc://@shoal-demo-$$-w0" ep1="ipc://@shoal-demo-$$-w1"
build/bin/shoal expert --model "$model" --experts 1-5:0-15 --listen "$ep0" --id w0 --threads 1 & w0=$!
build/bin/shoal expert --model "$model" --experts 1-5:16-31 --listen "$ep1" --id w1 --threads 1 & w1=$!
srv=""
trap 'kill $srv "$w0" "$w1" 2>/dev/null; wait $srv "$w0" "$w1" 2>/dev/null || true' EXIT
build/bin/shoal run --model "$model" --prompt "The \"assert\" statement" --gen 40 --worker "$ep0" --worker "$ep1"

echo "== shoal serve (OpenAI-compatible API) on the same workers, one chat request ==" >&2
out="$(mktemp)"
build/bin/shoal serve --model "$model" --model-name k3-nano --port 0 --threads 1 \
    --worker "$ep0" --worker "$ep1" >"$out" & srv=$!
for _ in $(seq 600); do grep -q "listening on" "$out" && break; kill -0 "$srv" || break; sleep 0.1; done
url="$(sed -n 's/.*listening on //p' "$out")"; rm -f "$out"
[ -n "$url" ] || { echo "demo: shoal serve did not start (see above)" >&2; exit 1; }
SHOAL_URL="$url" .venv/bin/python3 - <<'PY'
import os
from openai import OpenAI
client = OpenAI(base_url=os.environ["SHOAL_URL"] + "/v1", api_key="none")
r = client.chat.completions.create(model="k3-nano",
                                   messages=[{"role": "user", "content": "Explain the assert statement."}],
                                   max_tokens=80, temperature=0)
m = r.choices[0].message
print("reasoning_content:", repr(getattr(m, "reasoning_content", None)))
print("content:          ", repr(m.content))
print("finish_reason:", r.choices[0].finish_reason, "| prompt_tokens:", r.usage.prompt_tokens,
      "completion_tokens:", r.usage.completion_tokens)
print("(k3-nano: 5 M parameters trained for 40 min on CPU; it has read the Python docs, nothing else)")
PY
