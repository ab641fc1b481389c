#!/usr/bin/env bash
# The AVX-512 kernels compiled against SIMDe's portable AVX-512 intrinsics and
# compared bit for bit with the scalar specification (kernels_avx512_emul.c).
# Runs on any x86-64 with AVX2+FMA; SKIPPED without the SIMDe headers
# (Debian libsimde-dev, in scripts/deps.sh). Emulation checks the lane logic,
# not the hardware: on an AVX-512 machine test_kernels runs the real thing.
set -uo pipefail
src="${SHOAL_SRC:?}"
build="${SHOAL_BUILD:?}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
skip() { echo "SKIP: $1"; printf 'SKIP\tkernels_avx512_emul\tall: %s\n' "$1" >> "$res"; exit 77; }
[ -f /usr/include/simde/x86/avx512.h ] || skip "SIMDe headers not installed (libsimde-dev)"
grep -q -w avx2 /proc/cpuinfo && grep -q -w fma /proc/cpuinfo || skip "CPU lacks AVX2/FMA for the emulation host code"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# the AVX-512 file with its ISA guard opened and the intrinsics from SIMDe
# (kernels/mu_avx512.h and mu_sse.h, which it includes, inlined first so the renames reach them)
sed -e '/#include "kernels\/mu_avx512.h"/{r '"$src"'/kernels/mu_avx512.h
d}' -e '/#include "kernels\/mu_sse.h"/{r '"$src"'/kernels/mu_sse.h
d}' "$src/kernels/gemm_avx512.c" |
sed -e 's|^#if defined(__x86_64__) && defined(__AVX512F__).*|#if 1|' -e '/^    defined(__AVX512DQ__)$/d' \
    -e 's|#include <immintrin.h>|#include <simde/x86/avx512.h>\n#include "tests/e2e/kernels_avx512_emul_shim.h"|' \
    -e 's/\b_mm/simde_mm/g' -e 's/\b__m\(512\|256\|128\)\(i\|d\)\{0,1\}\b/simde__m\1\2/g' \
    -e 's/_MM_HINT_T0/SIMDE_MM_HINT_T0/g' > "$work/avx512_emul.c"
grep -q '^#if 1' "$work/avx512_emul.c" || { printf 'FAIL\tkernels_avx512_emul\tguard: cannot open the ISA guard\n' >> "$res"; exit 1; }
cc="${CC:-cc}"
flags=(-std=c11 -O1 -D_GNU_SOURCE -ffp-contract=off -mavx2 -mfma -mf16c -fopenmp -I"$src")
"$cc" "${flags[@]}" -Dshoal__kernels_fill_avx512=shoal_test_fill_avx512_emul -Wno-psabi -Werror=implicit-function-declaration -c "$work/avx512_emul.c" -o "$work/a.o" \
    || { printf 'FAIL\tkernels_avx512_emul\tcompile: the AVX-512 file does not build against SIMDe\n' >> "$res"; exit 1; }
"$cc" "${flags[@]}" "$src/tests/e2e/kernels_avx512_emul.c" "$work/a.o" "$build/libshoal_kernels.a" \
    "$build/libshoal_common.a" -lm -o "$work/check" \
    || { printf 'FAIL\tkernels_avx512_emul\tlink\n' >> "$res"; exit 1; }
SHOAL_TEST_RESULTS="$res" "$work/check"
