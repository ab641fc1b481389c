#!/usr/bin/env bash
# bf16 GEMM at T >= 64 as a fraction of this machine's fp32 FMA peak (issue 33):
# ROUNDS interleaved rounds of `shoal bench peak --json` and tests/bench/bench_gemm
# (bf16, 1 thread: the 12288x7168 KDA projection streamed from DRAM over two
# copies, and a 64x7168 slice kept in cache), so the peak and the kernel share
# the load. JSON lines tagged with the round, plus machine, commit and load.
# Not a test. Usage: tests/bench/peak_fraction.sh OUT [ROUNDS] [T list]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$1" rounds="${2:-3}" ts="${3:-1,16,64,128,256}"
build="${SHOAL_BUILD:-$here/build}"
{
    printf '{"meta":"machine","value":"%s, %s CPUs, flags: %s"}\n' "$(lscpu | sed -n 's/^Model name: *//p')" "$(nproc)" \
        "$(grep -o 'avx512f\|avx512_bf16\|avx512_vnni\|amx_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    printf '{"meta":"commit","value":"%s"}\n' "$(git -C "$here" rev-parse --short HEAD)"
    printf '{"meta":"command","value":"peak_fraction.sh %s %s %s"}\n' "$out" "$rounds" "$ts"
    printf '{"meta":"load_before","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
    for r in $(seq 1 "$rounds"); do
        "$build/bin/shoal" bench peak --json --reps 5 | grep '^{' | sed "s/^{/{\"round\":$r,/"
        "$build/tests/bench_gemm" bf16 12288 7168 "$ts" --reps 3 --copies 2 | grep '^{' |
            sed "s/^{/{\"round\":$r,\"where\":\"stream\",/"
        "$build/tests/bench_gemm" bf16 64 7168 "$ts" --reps 7 --copies 1 | grep '^{' |
            sed "s/^{/{\"round\":$r,\"where\":\"cache\",/"
        printf '{"meta":"load","round":%d,"value":"%s"}\n' "$r" "$(cut -d' ' -f1-3 /proc/loadavg)"
    done
    printf '{"meta":"load_after","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out"
echo "wrote $out"
