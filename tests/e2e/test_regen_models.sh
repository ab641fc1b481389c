#!/usr/bin/env bash
# The committed tiny models are exactly what tools/make_tiny_k3.py writes: regenerate
# both with the project venv's numpy (no torch) and compare every byte. This is also
# the check that the generator the scale test relies on is bit-reproducible on this
# machine and numpy version.
set -uo pipefail
src="${SHOAL_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}"
py="${SHOAL_PYTHON:-python3}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
name=test_regen_models
if ! "$py" -c 'import numpy' 2>/dev/null; then
    printf 'SKIP\t%s\tregenerate: numpy not importable by %s\n' "$name" "$py" >> "$res"
    echo "SKIP: numpy missing"; exit 77
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
fail=0
for m in tiny-k3 tiny-k3-plain; do
    if ! "$py" "$src/tools/make_tiny_k3.py" --preset $m --seed 1 --out "$out/$m" 2>"$out/$m.log"; then
        printf 'FAIL\t%s\t%s: generator failed: %s\n' "$name" "$m" "$(tail -1 "$out/$m.log")" >> "$res"
        fail=1; continue
    fi
    bad=""
    for f in "$src/tests/models/$m"/*; do
        cmp -s "$f" "$out/$m/$(basename "$f")" || bad="$bad $(basename "$f")"
    done
    [ "$(ls "$src/tests/models/$m")" = "$(ls "$out/$m" | grep -v '\.log$')" ] || bad="$bad (file list)"
    if [ -z "$bad" ]; then
        printf 'PASS\t%s\t%s bit-identical\n' "$name" "$m" >> "$res"; echo "PASS $m"
    else
        printf 'FAIL\t%s\t%s differs:%s\n' "$name" "$m" "$bad" >> "$res"; echo "FAIL $m:$bad"; fail=1
    fi
done
exit $fail
