#!/usr/bin/env bash
# Builds shoal and runs the whole test suite:
#   1. release build with -Werror, every CTest test (labels quick and full);
#   2. ASan+UBSan build (gcc, build-asan/), the quick (unit + corpus replay) tests;
#   3. bounded libFuzzer runs of every fuzz target (clang, build-fuzz/;
#      SHOAL_FUZZ_SECONDS per target, default 15, up to nproc targets at once).
# Prints the time of each stage.
# Ends with one line "N passed, N failed, N skipped" (counted per test case)
# and exits non-zero on any failure. Usage: scripts/test.sh [--quick]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
quick=0
[ "${1:-}" = "--quick" ] && quick=1
jobs="$(nproc)"

bash scripts/deps.sh || { echo "test: dependency installation failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }

results="$here/build/test-results.tsv"
mkdir -p build
: > "$results"
export SHOAL_TEST_RESULTS="$results"
status=0

run_suite() { # dir label-args...
    local dir="$1"; shift
    local junit="$here/$dir/junit.xml"   # absolute: ctest runs inside $dir
    (cd "$dir" && ctest --output-on-failure -j"$jobs" --output-junit "$junit" "$@")
    local rc=$?
    # A CTest test that failed without recording a FAIL case (crash, timeout)
    # still counts as one failure.
    python3 - "$junit" "$results" "$dir" <<'PY'
import sys, xml.etree.ElementTree as ET
junit, results, d = sys.argv[1:4]
try:
    root = ET.parse(junit).getroot()
except Exception as e:
    open(results, "a").write(f"FAIL\tctest\t{d}: no junit report ({e})\n"); sys.exit()
lines = open(results).read().splitlines()
for tc in root.iter("testcase"):
    name = tc.get("name")
    st = tc.get("status", "")
    failed = tc.find("failure") is not None or st == "fail"
    short = name[4:] if name.startswith("e2e_") else name
    if failed and not any(l.startswith("FAIL\t") and short in l.split("\t")[1] for l in lines):
        open(results, "a").write(f"FAIL\t{name}\tctest reported failure (crash or timeout) in {d}\n")
PY
    return $rc
}

stage_start=0 # $SECONDS counts from the start of the script
stage_times=()
stage_done() { stage_times+=("$1 $((SECONDS - stage_start)) s"); stage_start=$SECONDS; }
stage_done "deps"

echo "== build (release, -Werror) =="
cmake -S . -B build -DSHOAL_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null \
    && cmake --build build -j"$jobs" || { echo "test: build failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
stage_done "release build"

# The sanitizer and fuzz builds start now at idle priority (SCHED_IDLE where chrt
# has it, else nice 19), in their own process group: they run on what the release
# tests leave idle (servers starting, sockets and timers waited on) and yield at once
# to every test process. When the release tests end they are stopped, not waited
# for: on a machine kept busy by other work an idle-priority build gets almost no
# CPU and would hold the suite for as long as that work runs. The stages below then
# build what is left at normal priority (nothing, when they finished; make deletes a
# target it was stopped in the middle of), so a failure shows up there, as before.
bg_pid=""
if [ $quick -eq 0 ]; then
    idle=(nice -n 19)
    chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0 nice -n 19)
    setsid "${idle[@]}" bash -c 'cmake -S . -B build-asan -DSHOAL_WERROR=ON -DSHOAL_SANITIZE=address,undefined \
        -DCMAKE_BUILD_TYPE=Debug && cmake --build build-asan -j"$1"; bash scripts/fuzz.sh --build-only' \
        _ "$jobs" > build/background-builds.log 2>&1 &
    bg_pid=$!
fi

echo "== tests (release) =="
if [ $quick -eq 1 ]; then run_suite build -L quick || status=1; else run_suite build || status=1; fi
stage_done "release tests"
if [ -n "$bg_pid" ]; then
    kill -TERM -- -"$bg_pid" 2>/dev/null || true
    wait "$bg_pid" 2>/dev/null || true
    stage_done "idle-priority builds stopped"
fi

if [ $quick -eq 0 ]; then
    echo "== build (ASan+UBSan) =="
    if cmake -S . -B build-asan -DSHOAL_WERROR=ON -DSHOAL_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug >/dev/null \
        && cmake --build build-asan -j"$jobs"; then
        stage_done "sanitizer build"
        echo "== tests (ASan+UBSan, quick) =="
        ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
            run_suite build-asan -L quick || status=1
        stage_done "sanitizer tests"
    else
        echo "FAIL	asan-build	sanitizer build failed" >> "$results"; status=1
    fi

    echo "== fuzz (bounded) =="
    bash scripts/fuzz.sh "${SHOAL_FUZZ_SECONDS:-15}" || status=1
    stage_done "fuzz build + runs"
fi

pass=$(grep -c '^PASS' "$results" || true)
fail=$(grep -c '^FAIL' "$results" || true)
skip=$(grep -c '^SKIP' "$results" || true)
if [ "$fail" -gt 0 ]; then
    echo "-- failures --"; grep '^FAIL' "$results"
fi
if [ "$skip" -gt 0 ]; then
    echo "-- skipped --"; grep '^SKIP' "$results"
fi
[ "$fail" -gt 0 ] && status=1
[ "$pass" -eq 0 ] && status=1
echo "stage times: $(IFS=,; echo "${stage_times[*]}" | sed 's/,/, /g'); total $SECONDS s"
echo "$pass passed, $fail failed, $skip skipped"
exit $status
