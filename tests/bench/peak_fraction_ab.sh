#!/usr/bin/env bash
# peak_fraction.sh for two builds, interleaved (issue 33): ROUNDS rounds, each
# running one round of tests/bench/peak_fraction.sh with build A then build B
# (the order alternating by round), every JSON line tagged with the build's
# label. Not a test. Usage: tests/bench/peak_fraction_ab.sh OUT ROUNDS LABEL_A=DIR_A LABEL_B=DIR_B [T list]
# (a DIR holds bin/shoal and tests/bench_gemm, as a build directory does).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$1" rounds="$2" a="$3" b="$4" ts="${5:-1,16,64,128,256}"
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
: > "$out"
for r in $(seq 1 "$rounds"); do
    if (( r % 2 )); then order="$a $b"; else order="$b $a"; fi
    for lb in $order; do
        label="${lb%%=*}" dir="${lb#*=}"
        SHOAL_BUILD="$dir" "$here/tests/bench/peak_fraction.sh" "$tmp" 1 "$ts" > /dev/null
        sed "s/^{/{\"build\":\"$label\",\"ab_round\":$r,/" "$tmp" >> "$out"
    done
done
echo "wrote $out"
