#!/bin/bash
# Tokenizer encode under cachegrind, two builds on the same corpora (issue 24):
# instructions, D1 and LL misses and mispredicted branches of one shoal_tok_encode
# of each corpus, as (load + 1 encode) - (load only). Deterministic, so it
# decides where the shared machine's wall clock cannot. LL is modelled as the
# 1 MiB per-core L2 of the project machine (cachegrind's default would model the
# 32 MiB L3, where the 4 MiB rank table fits and no miss would show).
#   tests/bench/tok_cachegrind.sh BEFORE_BIN AFTER_BIN [CORPUS_DIR [VOCAB]] > raw.txt
# BIN: a bench_tokenizer; CORPUS_DIR: build/tok_bench (tok_bench.py writes the
# corpora there); VOCAB: ../shared/k3. About 3 minutes.
set -euo pipefail
before=$1 after=$2 dir=${3:-build/tok_bench} vocab=${4:-../shared/k3}
err=$(mktemp)
trap 'rm -f "$err"' EXIT
echo "# tokenizer encode under cachegrind (valgrind $(valgrind --version | cut -d- -f2)), vocabulary $vocab"
echo "# command: tests/bench/tok_cachegrind.sh $*"
echo "#   each: valgrind --tool=cachegrind --cache-sim=yes --LL=1048576,16,64 BIN VOCAB CORPUS REPS, REPS = 1 and 0;"
echo "#   encode_* = the difference (one encode of the whole corpus); mispredicts from a --branch-sim=yes run"
echo "# before: $before; after: $after; commit $(git rev-parse --short HEAD)"
for c in stdlib mixed spec cjk; do
    for b in before after; do
        bin=$([ $b = before ] && echo "$before" || echo "$after")
        for r in 1 0; do
            valgrind --tool=cachegrind --cache-sim=yes --LL=1048576,16,64 --cachegrind-out-file=/dev/null \
                "$bin" "$vocab" "$dir/$c.txt" $r 2>"$err" >/dev/null
            i=$(awk '/I   refs/ {print $4}' "$err" | tr -d ,)
            d1=$(awk '/D1  misses/ {print $4}' "$err" | tr -d ,)
            ll=$(awk '/LLd misses/ {print $4}' "$err" | tr -d ,)
            valgrind --tool=cachegrind --cache-sim=no --branch-sim=yes --cachegrind-out-file=/dev/null \
                "$bin" "$vocab" "$dir/$c.txt" $r 2>"$err" >/dev/null
            mp=$(awk '/Mispredicts/ {print $3}' "$err" | tr -d ,)
            eval "v$r=\"$i $d1 $ll $mp\""
        done
        read -r i1 d11 ll1 mp1 <<<"$v1"
        read -r i0 d10 ll0 mp0 <<<"$v0"
        echo "corpus=$c build=$b encode_instructions=$((i1 - i0)) encode_D1_misses=$((d11 - d10))" \
             "encode_LL_misses=$((ll1 - ll0)) encode_branch_mispredicts=$((mp1 - mp0)) load_instructions=$i0"
    done
done
