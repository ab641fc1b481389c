#!/usr/bin/env bash
# The AMX matrix-unit-order kernels (kernels/gemm_amx.c) with the tile
# intrinsics emulated in software from the measured AMX model
# (kernels_amx_emul_shim.h), compared with the scalar specification. Runs on
# any x86-64 with AVX-512F/BW (the file's activation rounding uses them);
# SKIPPED elsewhere. Every variant of the AMX GEMM (SHOAL_AMX_VARIANT: all 32
# flag combinations) over every shape. Checks the tile layout logic, not an
# AMX unit: on an AMX machine test_kernels (t_mu_isa, t_mu_amx) and
# test_kernels_amx_real (the same program on the real tiles) run the unit.
set -uo pipefail
src="${SHOAL_SRC:?}"
build="${SHOAL_BUILD:?}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
skip() { echo "SKIP: $1"; printf 'SKIP\tkernels_amx_emul\tall: %s\n' "$1" >> "$res"; exit 77; }
grep -q -w avx512f /proc/cpuinfo && grep -q -w avx512bw /proc/cpuinfo || skip "CPU lacks AVX-512F/BW for the AMX file's host code"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sed -e 's|^#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)$|#if 1|' \
    -e 's|#include <immintrin.h>|#include <immintrin.h>\n#include "tests/e2e/kernels_amx_emul_shim.h"|' \
    "$src/kernels/gemm_amx.c" > "$work/amx_emul.c"
grep -q '^#if 1' "$work/amx_emul.c" || { printf 'FAIL\tkernels_amx_emul\tguard: cannot open the AMX guard\n' >> "$res"; exit 1; }
cc="${CC:-cc}"
# AddressSanitizer: a read or write past the test's buffers (rows or tokens past a tail) fails it
flags=(-std=c11 -O1 -g -fsanitize=address -fno-omit-frame-pointer -D_GNU_SOURCE -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -fopenmp -I"$src")
"$cc" "${flags[@]}" -Dshoal__kernels_gemm_bf16_mu_amx=emul_bf16_mu_amx -Dshoal__kernels_gemm_mxfp4_mu_amx=emul_mxfp4_mu_amx \
    -Dshoal__kernels_amx_usable=emul_amx_usable -Dshoal__kernels_peak_amx_bf16=emul_peak_amx_bf16 \
    -Dshoal__kernels_amx_set_variant=emul_amx_set_variant \
    -c "$work/amx_emul.c" -o "$work/a.o" \
    || { printf 'FAIL\tkernels_amx_emul\tcompile: gemm_amx.c does not build with the emulated tiles\n' >> "$res"; exit 1; }
"$cc" "${flags[@]}" "$src/tests/e2e/kernels_amx_emul.c" "$work/a.o" "$build/libshoal_kernels.a" \
    "$build/libshoal_common.a" -lm -o "$work/check" \
    || { printf 'FAIL\tkernels_amx_emul\tlink\n' >> "$res"; exit 1; }
ASAN_OPTIONS="exitcode=86:${ASAN_OPTIONS:-}" SHOAL_TEST_RESULTS="$res" "$work/check"
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then
    why="killed by a signal"; [ "$rc" -eq 86 ] && why="AddressSanitizer: an access outside the buffers (above)"
    printf 'FAIL\tkernels_amx_emul\tcheck stopped (rc %d): %s\n' "$rc" "$why" >> "$res"
fi
[ "$rc" -eq 0 ] || exit "$rc"

# Stage 2: test_kernels itself with the emulated tiles standing in for AMX
# (shoal__kernels_amx_usable answers 1; the library's self-test, dispatch,
# threshold and OpenMP row split run as on an AMX machine): t_mu_isa's tile
# pass at every T with 1 and 3 threads, t_mu_amx and t_amx_variants_tiles,
# which otherwise run only on AMX machines (they SKIP here), under the variant
# with every flag (the swapped arrangement for T <= 32, k256+once+pf+pipe
# above; stage 1 has every combination's values). One result line, the
# failing cases named.
sed -e 's|^#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)$|#if 1|' \
    -e 's|#include <immintrin.h>|#include <immintrin.h>\n#include "tests/e2e/kernels_amx_emul_shim.h"|' \
    "$src/kernels/gemm_amx.c" > "$work/amx_lib.c"
printf 'int shoal__kernels_amx_usable(void);\nint shoal__kernels_amx_usable(void) { return 1; }\n' > "$work/usable.c"
flags2=(-std=c11 -O1 -D_GNU_SOURCE -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -fopenmp -I"$src" -I"$src/tests/unit")
"$cc" "${flags2[@]}" -Dshoal__kernels_amx_usable=emul_amx_usable -c "$work/amx_lib.c" -o "$work/amx_lib.o" &&
    "$cc" "${flags2[@]}" "$src/tests/unit/test_kernels.c" "$work/amx_lib.o" "$work/usable.c" "$build/libshoal_kernels.a" \
        "$build/libshoal_common.a" -lm -o "$work/test_kernels_tiles" \
    || { printf 'FAIL\tkernels_amx_emul\ttest_kernels on emulated tiles: build\n' >> "$res"; exit 1; }
for v in k256+once+pf+pipe+swap; do
    SHOAL_AMX_VARIANT="$v" SHOAL_TEST_RESULTS="$work/tk_$v.txt" "$work/test_kernels_tiles" > "$work/tk_$v.out" 2>&1
    r=$?
    path="$(grep -c -E '^PASS.*t_mu_amx$' "$work/tk_$v.txt" 2>/dev/null)"
    if [ "$r" -eq 0 ] && [ "$path" = 1 ] && grep -q -E '^PASS.*t_amx_variants_tiles$' "$work/tk_$v.txt"; then
        printf 'PASS\tkernels_amx_emul\ttest_kernels on emulated tiles, variant %s\n' "$v" >> "$res"
        echo "PASS test_kernels on emulated tiles, variant $v ($(tail -1 "$work/tk_$v.out"))"
    else
        why="$(grep -E '^(FAIL|SKIP)' "$work/tk_$v.txt" | cut -f3 | tr '\n' ';' | head -c 300)"
        printf 'FAIL\tkernels_amx_emul\ttest_kernels on emulated tiles, variant %s: rc %d; %s\n' "$v" "$r" "$why" >> "$res"
        echo "FAIL test_kernels on emulated tiles, variant $v: rc $r; $why"; tail -20 "$work/tk_$v.out"
        rc=1
    fi
done
exit "$rc"
