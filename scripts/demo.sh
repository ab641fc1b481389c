#!/usr/bin/env bash
# The README's first command: installs what is missing (scripts/deps.sh),
# builds shoal, and runs the main job on the bundled tiny model
# tests/models/tiny-k3 (the real K3 layout at toy widths). Today the main job
# is `shoal inspect`: the config summary, the layer schedule and the inventory
# check of every tensor the engine needs. Safe to rerun.
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
