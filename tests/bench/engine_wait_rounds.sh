#!/usr/bin/env bash
# Interleaved rounds of tests/bench/engine_bench.sh (decode only) under several
# OpenMP waiting policies and thread counts, the order rotated every round
# (docs/PERFORMANCE.md, "Decode and waiting, re-measured"):
#   tests/bench/engine_wait_rounds.sh MODEL OUTDIR ROUNDS STEPS [CONFIG...]
# CONFIG is tN:passive (shoal's default), tN:active (OMP_WAIT_POLICY=active)
# or tN:spinK (GOMP_SPINCOUNT=K); default: t2:passive t2:active t1:passive t2:spin1000.
# One file per run: OUTDIR/r<round>_t<N>_<policy>.txt; one summary line per run on stdout.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
[ $# -ge 4 ] || { echo "usage: $0 MODEL OUTDIR ROUNDS STEPS [tN:passive|tN:active|tN:spinK ...]" >&2; exit 2; }
model=$1 outdir=$2 rounds=$3 steps=$4
shift 4
cfgs=("$@")
[ ${#cfgs[@]} -gt 0 ] || cfgs=(t2:passive t2:active t1:passive t2:spin1000)
mkdir -p "$outdir"
n=${#cfgs[@]}
for r in $(seq 0 $((rounds - 1))); do
    for k in $(seq 0 $((n - 1))); do
        c=${cfgs[$(((k + r) % n))]}
        t=${c%%:*} w=${c#*:}
        t=${t#t}
        envs=()
        case $w in
        passive) ;;
        active) envs=(OMP_WAIT_POLICY=active) ;;
        spin*) envs=(GOMP_SPINCOUNT=${w#spin}) ;;
        *) echo "unknown policy $w" >&2; exit 2 ;;
        esac
        f="$outdir/r${r}_t${t}_${w}.txt"
        env "${envs[@]}" OMP_NUM_THREADS="$t" bash "$here/tests/bench/engine_bench.sh" "$model" "$f" \
            --threads "$t" --steps "$steps" --prefill 8 --prefill-reps 0 --reps 2 >/dev/null 2>"$f.err"
        echo "round $r t$t $w rc=$? $(grep decode_summary "$f" | grep -o 'median_seconds=[0-9.]*\|median_ratio=[0-9.]*' | tr '\n' ' ')load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
