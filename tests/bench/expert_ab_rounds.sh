#!/usr/bin/env bash
# Interleaved rounds of tests/bench/engine_bench.sh (decode only, waiting
# passively as `shoal` does) with two builds, e.g. before and after a kernel
# change, at 1 and 2 threads, the order rotated every round
# (docs/PERFORMANCE.md, "Routed experts: one parallel region per expert"):
#   tests/bench/expert_ab_rounds.sh MODEL OUTDIR ROUNDS STEPS OLD_BUILD [NEW_BUILD]
# NEW_BUILD defaults to this tree's build/. One file per run:
# OUTDIR/r<round>_t<N>_<old|new>.txt; one summary line per run on stdout
# (median step seconds and the median of the routed experts' phase).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ $# -ge 5 ] || { echo "usage: $0 MODEL OUTDIR ROUNDS STEPS OLD_BUILD [NEW_BUILD]" >&2; exit 2; }
model=$1 outdir=$2 rounds=$3 steps=$4 old=$5 new=${6:-$here/build}
mkdir -p "$outdir"
cfgs=(t2:new t2:old t1:new t1:old)
n=${#cfgs[@]}
for r in $(seq 0 $((rounds - 1))); do
    for k in $(seq 0 $((n - 1))); do
        c=${cfgs[$(((k + r) % n))]}
        t=${c%%:*} b=${c#*:}
        t=${t#t}
        dir=$new
        [ "$b" = old ] && dir=$old
        f="$outdir/r${r}_t${t}_${b}.txt"
        SHOAL_BUILD="$dir" OMP_NUM_THREADS="$t" bash "$here/tests/bench/engine_bench.sh" "$model" "$f" \
            --threads "$t" --steps "$steps" --prefill 8 --prefill-reps 0 --reps 1 >/dev/null 2>"$f.err"
        rc=$?
        ex=$(grep '^row=decode ' "$f" | grep -o 'phase_experts_seconds=[0-9.]*' | cut -d= -f2 | sort -n |
            awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}')
        echo "round $r t$t $b rc=$rc $(grep decode_summary "$f" | grep -o 'median_seconds=[0-9.]*' | tr '\n' ' ')experts_median=$ex load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
