#!/usr/bin/env bash
# Runs build/tests/bench_engine on a model and writes its raw rows, with the
# evidence docs/PERFORMANCE.md needs (commit, command, machine, load), to OUT:
#   tests/bench/engine_bench.sh MODEL OUT [bench_engine options...]
# The benchmark model is a k3-slice generated outside the tree, e.g.
#   python3 tools/make_tiny_k3.py --preset k3-slice --layers 4 --experts-per-layer 32 --out /tmp/k3slice
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ $# -ge 2 ] || { echo "usage: $0 MODEL OUT [bench_engine options...]" >&2; exit 2; }
model="$1"
out="$2"
shift 2
bin="${SHOAL_BUILD:-$here/build}/tests/bench_engine"
{
    echo "# bench_engine raw rows (docs/PERFORMANCE.md, engine section)"
    echo "# commit $(git -C "$here" rev-parse HEAD)$(git -C "$here" diff --quiet HEAD -- coordinator kernels common tests/bench || echo ' (dirty)')"
    echo "# build $bin"
    echo "# command $bin $model $*"
    echo "# date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cpus online"
    echo "# memory $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
    echo "# model $(du -sb "$model" | cut -f1) bytes on disk; config $(sha256sum "$model/config.json" | cut -c1-16)"
    echo "# env OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset} OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} SHOAL_ISA=${SHOAL_ISA:-unset}"
    echo "# load before: $(cat /proc/loadavg)"
} > "$out"
"$bin" "$model" "$@" >> "$out"
echo "# load after: $(cat /proc/loadavg)" >> "$out"
cat "$out"
