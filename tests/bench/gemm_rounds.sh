#!/usr/bin/env bash
# Interleaved rounds of tests/bench/bench_gemm for two builds (A, B) of the
# kernels: A, B, A, B, ... in one run, so both see the same machine load.
# Writes JSON lines (each tagged with the build and round) plus a header with
# the machine, the commits and the load average before and after. Not a test.
# Usage: tests/bench/gemm_rounds.sh OUT ROUNDS BIN_A TAG_A BIN_B TAG_B -- bench_gemm args...
# (BIN_A / BIN_B are split on spaces: "build/tests/bench_gemm bf16" runs one
# kind; "env SHOAL_ISA=avx2 ..." picks the ISA.)
set -euo pipefail
out="$1" rounds="$2" a="$3" ta="$4" b="$5" tb="$6"
shift 6
[ "${1:-}" = "--" ] && shift
{
    printf '{"meta":"machine","value":"%s, %s CPUs, flags: %s"}\n' "$(lscpu | sed -n 's/^Model name: *//p')" "$(nproc)" \
        "$(grep -o 'avx512f\|avx512_bf16\|avx512_vnni\|amx_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    printf '{"meta":"command","value":"bench_gemm %s; %s rounds %s/%s"}\n' "$*" "$rounds" "$ta" "$tb"
    printf '{"meta":"load_before","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
    for r in $(seq 1 "$rounds"); do
        for pair in "$a|$ta" "$b|$tb"; do
            bin="${pair%%|*}" tag="${pair##*|}"
            $bin "$@" | grep '^{' | sed "s/^{/{\"build\":\"$tag\",\"round\":$r,/"
        done
    done
    printf '{"meta":"load_after","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out"
echo "wrote $out"
