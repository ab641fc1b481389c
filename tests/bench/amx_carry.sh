#!/usr/bin/env bash
# Packs what tests/bench/amx_machine.sh needs on a bare borrowed machine into one
# folder (default .devcarry, untracked: it travels with the working tree to the
# device machine): bin/ the release binaries from build/, lib/ the shared
# libraries they load that a bare machine may lack (from ldd, glibc's own
# left out), and, when given, llama/ (LLAMA_SRC: a folder with llama-bench and
# its .so files) and whl/ (WHEELS_SRC: the gguf wheel). About 35 MB.
#
# usage: tests/bench/amx_carry.sh [DEST]     (after a release build in build/)
# then, on the device:  BIN=DEST/bin LIBS=DEST/lib LLAMA=DEST/llama WHEELS=DEST/whl \
#                       bash tests/bench/amx_machine.sh "$OUT/amx"
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="${1:-$here/.devcarry}"
mkdir -p "$dest/bin" "$dest/lib"
bins=("$here/build/bin/shoal")
for t in test_kernels kernels_amx_real test_engine test_engine_ref bench_gemm bench_engine; do
    bins+=("$here/build/tests/$t")
done
for b in "${bins[@]}"; do
    [ -x "$b" ] || { echo "amx_carry: $b missing (build first)" >&2; exit 1; }
    cp -f "$b" "$dest/bin/"
    strip -g "$dest/bin/$(basename "$b")" 2>/dev/null || true # debug info: 21 MB of the 64 MiB a run may carry
    ldd "$b" | awk '/=> \//{print $3}' | while read -r so; do
        case "$(basename "$so")" in
            libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;
            *) cp -fL "$so" "$dest/lib/" ;;
        esac
    done
done
if [ -n "${LLAMA_SRC:-}" ]; then
    mkdir -p "$dest/llama"
    cp -fL "$LLAMA_SRC"/llama-bench "$LLAMA_SRC"/*.so* "$dest/llama/" 2>/dev/null || cp -fL "$LLAMA_SRC"/llama-bench "$dest/llama/"
fi
if [ -n "${WHEELS_SRC:-}" ]; then
    mkdir -p "$dest/whl"
    cp -f "$WHEELS_SRC"/gguf-*.whl "$dest/whl/"
fi
du -sh "$dest"/* | tr '\n' ' '
echo
