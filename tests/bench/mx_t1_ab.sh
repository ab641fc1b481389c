#!/usr/bin/env bash
# Issue 33, "MXFP4 T = 1 on Intel AVX-512": interleaved rounds of the expert
# GEMV against the read pass (`shoal bench kernels --only expert --tokens 1
# --threads 1`), of the in-cache GEMV (`--only in_cache`: ns per 32 weights and
# GMAC/s by thread CPU time, one thread, an L2-resident matrix) and of `bench_gemm mxfp4 3072 3584 1,2,4,8` (gmacs_cpu), for
# several configurations. Each round runs every configuration once, alternating
# the order, so load drift hits all of them; every row carries its round, its
# configuration and the load average before it. Not a test: figures for
# docs/PERFORMANCE.md. Summary: tests/bench/mx_t1_ab_summary.py FILE
#
# usage: tests/bench/mx_t1_ab.sh OUT.jsonl ROUNDS NAME=BINDIR[:ENV=VAL] ...
#   BINDIR holds shoal and bench_gemm (e.g. build/bin and build/tests in one
#   folder of links); ENV=VAL is set for that configuration's runs (e.g.
#   SHOAL_MX_DECODE=vpmovzx). THREADS (default 1): the expert rows' --threads
#   (the in-cache rows are one thread by construction). SHOAL_ISA from the
#   caller's environment plays another ISA class (e.g. SHOAL_ISA=avx2).
set -uo pipefail
out="${1:?usage: mx_t1_ab.sh OUT.jsonl ROUNDS NAME=BINDIR[:ENV=VAL] ...}"
rounds="${2:?rounds}"
shift 2
: > "$out"
tag() { sed "s/^{/{\"round\":$1,\"config\":\"$2\",\"load\":\"$3\",/"; }
for r in $(seq 1 "$rounds"); do
    cfgs=("$@")
    if [ $((r % 2)) -eq 0 ]; then # reverse the order every other round
        rev=()
        for ((i = ${#cfgs[@]} - 1; i >= 0; i--)); do rev+=("${cfgs[i]}"); done
        cfgs=("${rev[@]}")
    fi
    for c in "${cfgs[@]}"; do
        name="${c%%=*}" rest="${c#*=}"
        dir="${rest%%:*}" envs=()
        [ "$dir" != "$rest" ] && envs=("${rest#*:}")
        load="$(cut -d' ' -f1-3 /proc/loadavg)"
        env "${envs[@]}" "$dir/shoal" bench kernels --only expert --tokens 1 --threads "${THREADS:-1}" --json 2>/dev/null |
            grep '^{' | tag "$r" "$name" "$load" >> "$out"
        env "${envs[@]}" "$dir/shoal" bench kernels --only in_cache --tokens 1 --threads 1 --json 2>/dev/null |
            grep '"gemv_mxfp4"' | tag "$r" "$name" "$load" >> "$out"
        env "${envs[@]}" "$dir/bench_gemm" mxfp4 3072 3584 1,2,4,8 --reps 5 2>/dev/null |
            grep '^{' | tag "$r" "$name" "$load" >> "$out"
    done
    echo "round $r done: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
