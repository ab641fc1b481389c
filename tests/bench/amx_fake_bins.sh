#!/usr/bin/env bash
# Binaries for a rehearsal of tests/bench/amx_machine.sh on a CPU without AMX:
# the release build's programs relinked with kernels/gemm_amx.c compiled
# against the emulated tiles (tests/e2e/kernels_amx_emul_shim.h) and a
# shoal__kernels_amx_usable that answers 1, so every AMX branch of the script
# runs (the per-variant checks, the variants' GEMMs, the ranking, prefill per
# variant). Their speeds mean nothing: the tiles are software. Needs AVX-512F/BW.
#
# usage: tests/bench/amx_fake_bins.sh DEST      (after a release build in build/)
# then:  QUICK=1 BIN=DEST LLAMA=... bash tests/bench/amx_machine.sh OUT
set -euo pipefail
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="$(mkdir -p "${1:?usage: amx_fake_bins.sh DEST}" && cd "$1" && pwd)"
sed -e 's|^#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)$|#if 1|' \
    -e 's|#include <immintrin.h>|#include <immintrin.h>\n#include "tests/e2e/kernels_amx_emul_shim.h"|' \
    "$src/kernels/gemm_amx.c" > "$dest/amx_emul.c"
printf 'int shoal__kernels_amx_usable(void);\nint shoal__kernels_amx_usable(void) { return 1; }\n' > "$dest/usable.c"
cc -std=c11 -O2 -D_GNU_SOURCE -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -fopenmp -I"$src" \
    -Dshoal__kernels_amx_usable=emul_amx_usable -c "$dest/amx_emul.c" -o "$dest/amx_emul.o"
cc -c "$dest/usable.c" -o "$dest/usable.o"
# each program's own link line (CMake's link.txt), with the two objects ahead of the libraries
cd "$src/build/tests"
for t in bench_gemm bench_engine kernels_amx_real test_kernels test_engine test_engine_ref; do
    eval "$(sed "s| -o $t | -o $dest/$t $dest/amx_emul.o $dest/usable.o |" "CMakeFiles/$t.dir/link.txt")"
done
cd "$src/build"
eval "$(sed "s| -o bin/shoal | -o $dest/shoal $dest/amx_emul.o $dest/usable.o |" CMakeFiles/shoal.dir/link.txt)"
"$dest/shoal" version | grep mu-order
