#!/usr/bin/env bash
# bf16 GEMM against ggml per CPU class, played on this machine (issue 33): ROUNDS
# rounds; each runs, for every class LABEL=ISA:BIN in turn (the order alternating by
# round), `shoal bench peak` with SHOAL_ISA=ISA (the class's fp32 FMA peak: ymm
# under avx2) and BIN, tests/bench/ggml_anchor_gemm.c built against that class's
# restricted ggml (GGML_NATIVE=OFF), with SHOAL_ISA=ISA: shoal_gemm_bf16 and
# ggml_mul_mat alternated in one process, 1 thread, thread CPU time. JSON lines
# tagged with class and round, plus machine, commit and load. Not a test.
# Usage: tests/bench/gemm_class_anchor.sh OUT ROUNDS ROWS COLS TLIST LABEL=ISA:BIN...
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$1" rounds="$2" rows="$3" cols="$4" ts="$5"
shift 5
build="${SHOAL_BUILD:-$here/build}"
{
    printf '{"meta":"machine","value":"%s, %s CPUs, flags: %s"}\n' "$(lscpu | sed -n 's/^Model name: *//p')" "$(nproc)" \
        "$(grep -o 'avx512f\|avx512_bf16\|avx512_vnni\|amx_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    printf '{"meta":"commit","value":"%s"}\n' "$(git -C "$here" rev-parse --short HEAD)"
    printf '{"meta":"command","value":"gemm_class_anchor.sh %s"}\n' "$out $rounds $rows $cols $ts $*"
    for r in $(seq 1 "$rounds"); do
        if (( r % 2 )); then order=("$@"); else order=(); for ((i = $#; i >= 1; i--)); do order+=("${!i}"); done; fi
        for c in "${order[@]}"; do
            label="${c%%=*}" rest="${c#*=}"
            isa="${rest%%:*}" bin="${rest#*:}"
            printf '{"class":"%s","class_round":%d,"meta":"load","value":"%s"}\n' "$label" "$r" "$(cut -d' ' -f1-3 /proc/loadavg)"
            SHOAL_ISA="$isa" "$build/bin/shoal" bench peak --json --reps 5 | grep '"fp32_fma"' |
                sed "s/^{/{\"class\":\"$label\",\"class_round\":$r,/"
            SHOAL_ISA="$isa" "$bin" "$rows" "$cols" "$ts" 1 | grep '^{' | sed "s/^{/{\"class\":\"$label\",\"class_round\":$r,/"
        done
    done
    printf '{"meta":"load_after","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out"
echo "wrote $out"
