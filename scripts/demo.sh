#!/usr/bin/env bash
# The README's first command: installs what is missing (scripts/deps.sh),
# builds shoal, and runs the main job on the bundled tiny model
# tests/models/tiny-k3 (the real K3 layout at toy widths): `shoal inspect` (the
# config summary, the layer schedule and the inventory check of every tensor
# the engine needs), then two expert servers (`shoal expert`, each owning half
# of every MoE layer's routed experts) and a coordinator (`shoal run --worker
# ... --worker ...`) generating a continuation. Safe to rerun.
# Usage: scripts/demo.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
model=tests/models/tiny-k3

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
build/bin/shoal expert --model "$model" --experts 1-8:0-11 --listen "$ep0" --id w0 --threads 1 & w0=$!
build/bin/shoal expert --model "$model" --experts 1-8:12-23 --listen "$ep1" --id w1 --threads 1 & w1=$!
trap 'kill "$w0" "$w1" 2>/dev/null; wait "$w0" "$w1" 2>/dev/null || true' EXIT
build/bin/shoal run --model "$model" --prompt "The shoal of fish" --gen 24 --worker "$ep0" --worker "$ep1"
