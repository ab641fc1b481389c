#!/usr/bin/env bash
# Rebuilds the committed tiny models bit-identically:
#   tools/vocab/shoal-tiny.tiktoken   (tools/train_vocab.py; needs the `regex` package)
#   tests/models/tiny-k3/, tests/models/tiny-k3-plain/   (tools/make_tiny_k3.py; numpy only)
# Usage: tools/regen_models.sh [--check]
#   --check: regenerate into a temporary directory and compare byte for byte with
#            the committed files (exit 1 on any difference); the vocabulary is
#            compared only when `regex` is importable, and says so otherwise.
# Python: $SHOAL_REF_PYTHON, else python3 (tools/requirements-ref.txt lists the versions used).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${SHOAL_REF_PYTHON:-python3}"
check=0
[ "${1:-}" = "--check" ] && check=1
seed=1
if [ $check -eq 1 ]; then
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
else
    out="$here"
fi
status=0
if "$py" -c 'import regex' 2>/dev/null; then
    mkdir -p "$out/tools/vocab"
    "$py" "$here/tools/train_vocab.py" "$out/tools/vocab/shoal-tiny.tiktoken" --ranks 3840 --seed $seed
    if [ $check -eq 1 ]; then
        if cmp "$here/tools/vocab/shoal-tiny.tiktoken" "$out/tools/vocab/shoal-tiny.tiktoken"; then
            echo "regen_models: identical: tools/vocab/shoal-tiny.tiktoken"
        else
            echo "regen_models: DIFFERS: tools/vocab/shoal-tiny.tiktoken"; status=1
        fi
    fi
else
    echo "regen_models: SKIPPED vocabulary training (python module 'regex' not installed); using the committed tools/vocab/shoal-tiny.tiktoken"
fi
for m in tiny-k3 tiny-k3-plain; do
    "$py" "$here/tools/make_tiny_k3.py" --preset $m --seed $seed --out "$out/tests/models/$m"
    if [ $check -eq 1 ]; then
        for f in "$here/tests/models/$m"/*; do
            b="$(basename "$f")"
            if cmp -s "$f" "$out/tests/models/$m/$b"; then
                echo "regen_models: identical: tests/models/$m/$b"
            else
                echo "regen_models: DIFFERS: tests/models/$m/$b"; status=1
            fi
        done
        if [ "$(ls "$here/tests/models/$m" | sort)" != "$(ls "$out/tests/models/$m" | sort)" ]; then
            echo "regen_models: DIFFERS: file list of tests/models/$m"; status=1
        fi
    fi
done
exit $status
