#!/usr/bin/env bash
# Rebuilds every committed fixture from the fp32 reference, bit-identically on the
# same torch version and CPU (torch single-threaded, deterministic algorithms):
#   tests/fixtures/tiny-k3/, tests/fixtures/tiny-k3-plain/, tests/fixtures/k3-nano/  (tools/make_fixtures.py,
#     then tools/measure_tolerances.py: tolerance.json)
#   tests/fixtures/k3-scale/   with --scale (regenerates the ~2 GB k3-scale model in a temp dir)
#   tests/fixtures/MANIFEST.json  (tools/make_manifest.py)
# Usage: tools/regen_fixtures.sh [--check] [--scale]
#   --check: write into a temporary copy and compare every byte with the committed files.
# Python: $SHOAL_REF_PYTHON (needs tools/requirements-ref.txt), else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${SHOAL_REF_PYTHON:-python3}"
check=0; scale=0
for a in "$@"; do
    case "$a" in --check) check=1 ;; --scale) scale=1 ;; *) echo "usage: $0 [--check] [--scale]" >&2; exit 2 ;; esac
done
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
if [ $check -eq 1 ]; then
    work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/tests" "$work/tools"
    cp -r "$here/tests/models" "$work/tests/"
    mkdir -p "$work/tests/fixtures"
    [ -d "$here/tests/fixtures/k3-scale" ] && cp -r "$here/tests/fixtures/k3-scale" "$work/tests/fixtures/"
    cp -r "$here/tools/." "$work/tools/"
    root="$work"
else
    root="$here"
fi
for m in tiny-k3 tiny-k3-plain; do
    "$py" "$root/tools/make_fixtures.py" --model "$root/tests/models/$m" --out "$root/tests/fixtures/$m"
done
# the trained model (tools/train_nano.py): held-out text, real prompts, heldout.json, chat.json
"$py" "$root/tools/make_fixtures.py" --model "$root/tests/models/k3-nano" --out "$root/tests/fixtures/k3-nano" --nano
# the summation-order family the tolerances are derived from (tolerance.json; make_manifest.py)
for m in tiny-k3 tiny-k3-plain k3-nano; do
    "$py" "$root/tools/measure_tolerances.py" --model "$root/tests/models/$m" --fixtures "$root/tests/fixtures/$m"
    # the mu numerics class's spread around the same fixtures (tolerance_mu.json; issue 33)
    "$py" "$root/tools/measure_tolerances.py" --model "$root/tests/models/$m" --fixtures "$root/tests/fixtures/$m" \
        --numerics mu
done
if [ $scale -eq 1 ]; then
    tmp="$(mktemp -d)"
    "$py" "$root/tools/make_tiny_k3.py" --preset k3-scale --seed 1 --out "$tmp/k3-scale"
    "$py" "$root/tools/make_scale_fixture.py" --model "$tmp/k3-scale" --out "$root/tests/fixtures/k3-scale"
    rm -rf "$tmp"
fi
"$py" "$root/tools/make_manifest.py"
if [ $check -eq 1 ]; then
    status=0
    dirs="tests/fixtures/tiny-k3 tests/fixtures/tiny-k3-plain tests/fixtures/k3-nano"
    [ $scale -eq 1 ] && dirs="$dirs tests/fixtures/k3-scale"
    for d in $dirs; do
        for f in "$here/$d"/*; do
            b="$d/$(basename "$f")"
            if cmp -s "$f" "$work/$b"; then echo "regen_fixtures: identical: $b"; else echo "regen_fixtures: DIFFERS: $b"; status=1; fi
        done
    done
    if cmp -s "$here/tests/fixtures/MANIFEST.json" "$work/tests/fixtures/MANIFEST.json"; then
        echo "regen_fixtures: identical: tests/fixtures/MANIFEST.json"
    else
        echo "regen_fixtures: DIFFERS: tests/fixtures/MANIFEST.json"; status=1
    fi
    exit $status
fi
