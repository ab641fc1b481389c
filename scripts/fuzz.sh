#!/usr/bin/env bash
# Builds every tests/fuzz/fuzz_*.c target with clang + libFuzzer + ASan/UBSan and
# runs each for a bounded time (default 20 s) from its committed seed corpus.
# Records one PASS/FAIL line per target in $SHOAL_TEST_RESULTS.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
secs="${1:-20}"
results="${SHOAL_TEST_RESULTS:-/dev/null}"
targets=$(ls tests/fuzz/fuzz_*.c 2>/dev/null | xargs -r -n1 basename | sed 's/\.c$//')
[ -z "$targets" ] && { echo "fuzz: no targets"; exit 0; }
CC=clang cmake -S . -B build-fuzz -DSHOAL_FUZZ=ON -DSHOAL_WERROR=ON -DCMAKE_BUILD_TYPE=Debug \
    -DSHOAL_SANITIZE=address,undefined >/dev/null && cmake --build build-fuzz -j"$(nproc)" >/dev/null \
    || { echo "fuzz: clang build failed"; printf 'FAIL\tfuzz\tclang build failed\n' >> "$results"; exit 1; }
status=0
for t in $targets; do
    work="build-fuzz/work/$t"; rm -rf "$work"; mkdir -p "$work"
    cp -r "tests/fuzz/corpus/$t/." "$work/" 2>/dev/null || true
    if build-fuzz/fuzz/"$t" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 "$work" \
        >"build-fuzz/$t.log" 2>&1; then
        printf 'PASS\t%s\tfuzz %ss (%s)\n' "$t" "$secs" "$(grep -o 'Done [0-9]* runs' "build-fuzz/$t.log" | tail -1)" >> "$results"
        echo "fuzz: $t ok ($secs s)"
    else
        printf 'FAIL\t%s\tfuzz crash, see build-fuzz/%s.log\n' "$t" "$t" >> "$results"
        echo "fuzz: $t FAILED"; tail -30 "build-fuzz/$t.log"; status=1
    fi
done
exit $status
