#!/usr/bin/env bash
# Builds every tests/fuzz/fuzz_*.c target with clang + libFuzzer + ASan/UBSan and
# runs each for a bounded time (default 20 s) from its committed seed corpus,
# up to $(nproc) targets at a time. Records one PASS/FAIL line per target in
# $SHOAL_TEST_RESULTS. A crash leaves its reproducer in build-fuzz/work/<target>/
# (crash-*, see build-fuzz/<target>.log); add it to the corpus with the fix.
#
# The clang build is not -Werror: the warning gate is the gcc -Werror build of
# scripts/test.sh, and a clang-only warning elsewhere in the tree must not stop
# the fuzzing. Clang's warnings are printed (deduplicated) so they are seen.
# --build-only: the build and nothing else, no result line (scripts/test.sh runs
# it at idle priority during the release tests; the fuzzing run then finds it built).
# Usage: scripts/fuzz.sh [--build-only] [SECONDS]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
build_only=0
[ "${1:-}" = "--build-only" ] && { build_only=1; shift; }
secs="${1:-20}"
results="${SHOAL_TEST_RESULTS:-/dev/null}"
[ $build_only -eq 1 ] && results=/dev/null
targets=$(ls tests/fuzz/fuzz_*.c 2>/dev/null | xargs -r -n1 basename | sed 's/\.c$//')
[ -z "$targets" ] && { echo "fuzz: no targets"; exit 0; }
command -v clang >/dev/null || { echo "fuzz: clang not installed (scripts/deps.sh)"; printf 'FAIL\tfuzz\tclang not installed\n' >> "$results"; exit 1; }

mkdir -p build-fuzz
log=build-fuzz/build.log
if ! { CC=clang cmake -S . -B build-fuzz -DSHOAL_FUZZ=ON -DSHOAL_WERROR=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DSHOAL_SANITIZE=address,undefined && cmake --build build-fuzz -j"$(nproc)" --target $targets; } > "$log" 2>&1; then
    echo "fuzz: clang build failed (build-fuzz/build.log):"; grep -E "error|Error" "$log" | head -20
    printf 'FAIL\tfuzz\tclang build failed, see build-fuzz/build.log\n' >> "$results"
    exit 1
fi
nwarn=$(grep -E "warning:" "$log" | sort -u | wc -l)
if [ "$nwarn" -gt 0 ]; then
    echo "fuzz: clang reported $nwarn distinct warning(s) (not fatal here; gcc -Werror is the gate):"
    grep -E "warning:" "$log" | sort -u | head -20
fi
[ $build_only -eq 1 ] && exit 0

run_one() { # target -> 0/1, writes build-fuzz/<t>.status
    local t="$1" work="build-fuzz/work/$1"
    rm -rf "$work"; mkdir -p "$work" build-fuzz/artifacts
    cp -r "tests/fuzz/corpus/$t/." "$work/" 2>/dev/null || true
    # -artifact_prefix keeps crash reproducers out of the source tree
    if build-fuzz/fuzz/"$t" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 \
        -artifact_prefix="build-fuzz/artifacts/$t-" "$work" > "build-fuzz/$t.log" 2>&1; then
        echo ok > "build-fuzz/$t.status"
    else
        echo fail > "build-fuzz/$t.status"
    fi
}

status=0
running=0
for t in $targets; do
    run_one "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$(nproc)" ]; then wait -n; running=$((running - 1)); fi
done
wait
for t in $targets; do
    if [ "$(cat "build-fuzz/$t.status" 2>/dev/null)" = ok ]; then
        printf 'PASS\t%s\tfuzz %ss (%s)\n' "$t" "$secs" "$(grep -o 'Done [0-9]* runs' "build-fuzz/$t.log" | tail -1)" >> "$results"
        echo "fuzz: $t ok ($secs s, $(grep -o 'Done [0-9]* runs' "build-fuzz/$t.log" | tail -1))"
    else
        printf 'FAIL\t%s\tfuzz crash, see build-fuzz/%s.log\n' "$t" "$t" >> "$results"
        echo "fuzz: $t FAILED"; tail -30 "build-fuzz/$t.log"; status=1
    fi
done
exit $status
