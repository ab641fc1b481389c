#!/usr/bin/env bash
# Issue 33: the mu class's MXFP4 GEMV/GEMM against the portable kernel and
# against another build of itself, interleaved. Each round runs, for each
# ISA (SHOAL_ISA=avx512, avx2) and each configuration NAME=BINDIR (BINDIR
# holds shoal and bench_gemm): bench_gemm mxfp4mu at the expert shapes
# (3072x3584 at T 1,2,4,8; 3584x3072 at T 1; 3072x3584 at T 1 on 2
# threads; an L2-resident 512x1024 at T 1), and `shoal bench kernels --only
# expert --tokens 1 --numerics mu` (GB/s and the ratio to the read pass
# measured in the same run); the portable kernel (bench_gemm mxfp4, --numerics
# portable) with the first configuration's binaries. The order of the
# configurations alternates every round. Every row carries its round, config,
# ISA and the load average before it. Summary: tests/bench/mu_mx_ab_summary.py.
# Not a test: figures for docs/PERFORMANCE.md.
# usage: tests/bench/mu_mx_ab.sh OUT.jsonl ROUNDS NAME=BINDIR ...
set -uo pipefail
out="${1:?usage: mu_mx_ab.sh OUT.jsonl ROUNDS NAME=BINDIR ...}"
rounds="${2:?rounds}"
shift 2
: > "$out"
tag() { sed "s/^{/{\"round\":$1,\"config\":\"$2\",\"isa_env\":\"$3\",\"load\":\"$4\",/"; }
run() { # round config isa dir kind numerics
    local r="$1" c="$2" isa="$3" d="$4" k="$5" n="$6" load
    load="$(cut -d' ' -f1-3 /proc/loadavg)"
    { SHOAL_ISA="$isa" "$d/bench_gemm" "$k" 3072 3584 1,2,4,8 --reps 5
      SHOAL_ISA="$isa" "$d/bench_gemm" "$k" 3584 3072 1 --reps 5
      SHOAL_ISA="$isa" "$d/bench_gemm" "$k" 3072 3584 1 --reps 5 --threads 2
      SHOAL_ISA="$isa" "$d/bench_gemm" "$k" 512 1024 1 --reps 9 --copies 1 | sed 's/^{/{"in_cache":1,/'
      SHOAL_ISA="$isa" "$d/shoal" bench kernels --only expert --tokens 1 --threads 1 --numerics "$n" --json 2>/dev/null
    } | grep '^{' | tag "$r" "$c" "$isa" "$load" >> "$out"
}
for r in $(seq 1 "$rounds"); do
    cfgs=("$@")
    if [ $((r % 2)) -eq 0 ]; then
        rev=()
        for ((i = ${#cfgs[@]} - 1; i >= 0; i--)); do rev+=("${cfgs[i]}"); done
        cfgs=("${rev[@]}")
    fi
    for isa in avx512 avx2; do
        run "$r" portable "$isa" "${1#*=}" mxfp4 portable
        for c in "${cfgs[@]}"; do
            run "$r" "${c%%=*}" "$isa" "${c#*=}" mxfp4mu mu
        done
    done
    echo "round $r done: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
