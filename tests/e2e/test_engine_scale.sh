#!/usr/bin/env bash
# The engine at real K3 widths: the k3-scale model (one KDA + dense layer, one
# MLA + MoE layer with MXFP4 experts, hidden 7168; ~2.1 GB, never committed) is
# regenerated bit-identically by tools/ensure_scale_model.sh into
# $SHOAL_BUILD/k3-scale (shared with test_scale_model.sh, serialised by flock),
# then test_engine_ref --scale compares the engine with
# tests/fixtures/k3-scale/scale.json: teacher-forced argmax at every position,
# logits (top-32 and the full last row) and per-layer hidden summaries within
# MANIFEST.json's tolerances.k3-scale, routed experts and greedy ids exactly.
set -uo pipefail
src="${SHOAL_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}"
build="${SHOAL_BUILD:-$src/build}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
py="${SHOAL_PYTHON:-python3}"
name=test_engine_scale
skip() {
    printf 'SKIP\t%s\tscale test: %s\n' "$name" "$1" >> "$res"
    echo "SKIP $name: $1"
    exit 77
}
[ -f "$src/tests/fixtures/k3-scale/scale.json" ] || skip "no tests/fixtures/k3-scale/scale.json"
[ -x "$src/tools/ensure_scale_model.sh" ] || [ -f "$src/tools/ensure_scale_model.sh" ] || skip "no tools/ensure_scale_model.sh"
"$py" -c 'import numpy' 2>/dev/null || skip "numpy not importable by $py (the generator needs it)"
free_kb=$(df -Pk "$build" | awk 'NR==2{print $4}')
[ "${free_kb:-0}" -ge 3000000 ] || [ -d "$build/k3-scale" ] || skip "less than 3 GB free in $build"
if ! SHOAL_PYTHON="$py" bash "$src/tools/ensure_scale_model.sh" "$build/k3-scale"; then
    printf 'FAIL\t%s\tk3-scale model could not be regenerated bit-identically\n' "$name" >> "$res"
    exit 1
fi
bin="$build/tests/test_engine_ref"
[ -x "$bin" ] || { printf 'FAIL\t%s\tno %s\n' "$name" "$bin" >> "$res"; exit 1; }
# one thread: the engine's thread-count invariance is tested on the tiny models
OMP_NUM_THREADS=1 SHOAL_SRC="$src" "$bin" --scale "$build/k3-scale"
