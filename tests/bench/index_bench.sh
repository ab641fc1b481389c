#!/usr/bin/env bash
# Indexing benchmark for the safetensors store (issue 2): open and index a
# synthetic model with the real K3 layout (497,220 tensors over 96 shards,
# tests/bench/gen_k3_layout.py, sparse zero data), REPS times with map=0
# (headers only) and map=1 (read-only mappings). Not a test: the figures are
# recorded in docs/PERFORMANCE.md from the raw file this writes.
#   tests/bench/index_bench.sh [REPS] [OUT_RAW]
# Env: SHOAL_SYNTH_DIR (default /tmp/shoal-k3-synth), BUILD (default build),
#      NICE (e.g. -20, as root: run the timed process at that priority so that
#      concurrent nice-15 builds on a shared machine do not preempt it; recorded).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
reps="${1:-7}"
out="${2:-docs/data/st_index_$(date -u +%Y%m%d).txt}"
synth="${SHOAL_SYNTH_DIR:-/tmp/shoal-k3-synth}"
build="${BUILD:-build}"
cmake --build "$build" --target bench_st_index >/dev/null
if [ ! -f "$synth/model.safetensors.index.json" ]; then
    python3 tests/bench/gen_k3_layout.py tests/fixtures/official/config.json "$synth" --shards 96 --vision
fi
mkdir -p "$(dirname "$out")"
bt="$(grep -m1 '^CMAKE_BUILD_TYPE:' "$build/CMakeCache.txt" | cut -d= -f2)"
{
    echo "# bench_st_index: shoal_st_open on the synthetic K3 layout (497,220 tensors, 96 shards)"
    echo "# commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- common tests/bench || echo ' (+ uncommitted changes)')"
    echo "# command: tests/bench/index_bench.sh $reps  ($build/tests/bench_st_index $synth $reps)"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores, $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    echo "# compiler: $(${CC:-cc} --version | head -1); build type: ${bt:-RelWithDebInfo, the project default} (-O2 -g)"
    echo "# threads: 1 (the store indexes on the calling thread)"
    echo "# headers on disk: $(du -sh "$synth" | cut -f1) in $(ls "$synth"/*.safetensors | wc -l) shards; page cache warm after run 0"
    echo "# priority: nice ${NICE:-0} (other work on the machine: $(ps -eo ni= | awk '$1>=10' | wc -l) processes at nice >= 10, $(ps -eo ni=,stat= | awk '$1<10 && $2 ~ /R/' | wc -l) running at nice < 10)"
    echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    nice -n "${NICE:-0}" "$build/tests/bench_st_index" "$synth" "$reps"
    echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"
python3 - "$out" <<'PY'
import re, statistics, sys
rows = [l for l in open(sys.argv[1]) if l.startswith("map=")]
for m in ("0", "1"):
    for k in ("seconds", "cpu_seconds"):
        t = sorted(float(re.search(rf" {k}=([0-9.]+)", l).group(1)) for l in rows if l.startswith(f"map={m} "))
        print(f"map={m} {k}: n={len(t)} median={statistics.median(t):.3f} min={t[0]:.3f} max={t[-1]:.3f}")
PY
