#!/usr/bin/env bash
# The real-width scale-test model regenerates bit-identically in this environment
# (project venv numpy, no torch): every file's sha256 equals the one recorded with
# its reference outputs in tests/fixtures/k3-scale/scale.json. The model is kept in
# $SHOAL_BUILD/k3-scale for the engine's scale test (tools/ensure_scale_model.sh).
set -uo pipefail
src="${SHOAL_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
build="${SHOAL_BUILD:-$src/build}"
name=test_scale_model
py="${SHOAL_PYTHON:-python3}"
if ! "$py" -c 'import numpy' 2>/dev/null; then
    printf 'SKIP\t%s\tregenerate k3-scale: numpy not importable by %s\n' "$name" "$py" >> "$res"; exit 77
fi
free_kb=$(df -Pk "$build" | awk 'NR==2{print $4}')
if [ "${free_kb:-0}" -lt 3000000 ]; then
    printf 'SKIP\t%s\tregenerate k3-scale: less than 3 GB free in %s\n' "$name" "$build" >> "$res"; exit 77
fi
if SHOAL_PYTHON="$py" bash "$src/tools/ensure_scale_model.sh" "$build/k3-scale"; then
    printf 'PASS\t%s\tk3-scale regenerated bit-identically\n' "$name" >> "$res"; exit 0
fi
printf 'FAIL\t%s\tk3-scale model bytes differ from tests/fixtures/k3-scale/scale.json\n' "$name" >> "$res"
exit 1
