#!/usr/bin/env bash
# Every issue-33 check and figure that needs a machine with AMX, in one
# prepared run (a borrowed machine's time is short): the facts of the CPU,
# the matrix-unit-order kernels against the scalar specification and the
# start-up self-test, the engine against the reference in the mu class, the
# instruction peaks, the bf16 and MXFP4 GEMMs at T = 1, 8, 64, 256 in both
# numerics classes, the expert GEMV against the read pass (and the two AVX-512
# MXFP4 decodes against each other, tests/bench/mx_t1_ab.sh), and prefill on equal
# work against llama-bench (tests/bench/prefill_anchor.py), portable and mu.
# Runs on any x86-64 (without AMX the mu rows are the exact emulation, and say
# so). Not a test: figures, for docs/PERFORMANCE.md.
#
# usage: tests/bench/amx_machine.sh OUTDIR
#   BIN      folder with shoal, test_kernels, test_engine, test_engine_ref,
#            bench_gemm, bench_engine (default: links into build/)
#   LIBS     extra library folder for those (LD_LIBRARY_PATH), optional
#   LLAMA    folder with llama-bench and its libraries (optional: no anchor)
#   WHEELS   folder with the gguf wheel if python3 lacks gguf (optional)
#   WORK     scratch for the two models, ~10 GB (default /tmp/amxw)
#   ROUNDS   prefill rounds (default 2), THREADS prefill threads (default 1,2)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:?usage: amx_machine.sh OUTDIR}"
mkdir -p "$out"
work="${WORK:-/tmp/amxw}"
mkdir -p "$work"
if [ -z "${BIN:-}" ]; then
    BIN="$work/bin"
    mkdir -p "$BIN"
    ln -sf "$here/build/bin/shoal" "$BIN/shoal"
    for t in test_kernels test_engine test_engine_ref bench_gemm bench_engine; do ln -sf "$here/build/tests/$t" "$BIN/$t"; done
fi
export LD_LIBRARY_PATH="${LIBS:-}${LIBS:+:}${LD_LIBRARY_PATH:-}"
cd "$here"
log="$out/log.txt"
say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$log"; }
t0=$(date +%s)

# 0. the machine
{
    echo "== date"; date -u
    echo "== lscpu"; lscpu
    echo "== lscpu -e (which vCPUs share a core: siblings share its AMX unit)"; lscpu -e
    echo "== flags (avx512*, amx*)"; grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512|amx|avx2|fma)' | tr '\n' ' '; echo
    echo "== memory"; free -g
    echo "== loadavg"; cat /proc/loadavg
    echo "== shoal version"; "$BIN/shoal" version
} > "$out/facts.txt" 2>&1
say "facts: $(grep -m1 'Model name' "$out/facts.txt" | sed 's/.*: *//'); $(nproc) CPUs; amx: $(grep -c -m1 -w amx_tile /proc/cpuinfo)"
say "shoal version: $("$BIN/shoal" version 2>&1 | grep mu-order)"

# 1. the models, in the background while the correctness checks run
py=python3
gguf_env=()
if ! $py -c 'import gguf' 2>/dev/null && [ -n "${WHEELS:-}" ]; then
    $py -m pip install -q --no-index --no-deps --target "$work/site" "$WHEELS"/gguf-*.whl >> "$log" 2>&1
    gguf_env=(env "PYTHONPATH=$work/site")
fi
( [ -f "$work/k3s4/config.json" ] || $py tools/make_tiny_k3.py --preset k3-scale --layers 4 --experts-per-layer 16 \
      --out "$work/k3s4" > "$work/k3s4.log" 2>&1; echo "k3s4 rc=$?" >> "$log" ) &
gen1=$!
( [ -f "$work/anchor.gguf" ] || "${gguf_env[@]}" $py tests/bench/make_anchor_gguf.py --hidden 4096 --ffn 10656 \
      --layers 13 --dtype bf16 --out "$work/anchor.gguf" > "$work/anchor.log" 2>&1; echo "anchor rc=$?" >> "$log" ) &
gen2=$!

# 2. correctness: the kernels against the scalar spec (t_mu_isa, t_mu_amx, the
#    self-test), the engine in the mu class, the engine against the reference
{
    echo "== test_kernels"; timeout 120 "$BIN/test_kernels"; echo "rc=$?"
    echo "== test_engine --numerics mu"; timeout 120 "$BIN/test_engine" --numerics mu; echo "rc=$?"
    echo "== test_engine_ref --numerics mu"; timeout 120 "$BIN/test_engine_ref" --numerics mu; echo "rc=$?"
    echo "== test_engine_ref"; timeout 120 "$BIN/test_engine_ref"; echo "rc=$?"
} > "$out/tests.txt" 2>&1
say "tests: $(grep -E '^[0-9]+ passed' "$out/tests.txt" | tr '\n' ';') rc: $(grep '^rc=' "$out/tests.txt" | tr '\n' ' ')"
grep -E 'FAIL|SKIP.*amx|t_mu_amx|t_peak' "$out/tests.txt" | head -20 | tee -a "$log"

# 3. peaks and GEMMs (1 thread), GEMM_ROUNDS rounds interleaved; the mu kinds
#    with AMX at every T (SHOAL_AMX_MIN_T=1) and with its AVX-512 emulation
#    (SHOAL_AMX_MIN_T=0), to place the threshold between them. QUICK=1: the
#    mu kinds only.
g="$out/gemm.jsonl"
: > "$g"
ts=1,2,4,8,16,64,256
for r in $(seq 1 "${GEMM_ROUNDS:-2}"); do
    "$BIN/shoal" bench peak --json --reps 5 2>/dev/null | grep '^{' | sed "s/^{/{\"round\":$r,/" >> "$g"
    for k in bf16 bf16mu mxfp4 mxfp4mu; do
        case "$k" in *mu) modes="1 0" ;; *) [ -n "${QUICK:-}" ] && continue; modes="-" ;; esac
        for m in $modes; do
            if [ "${k#bf16}" != "$k" ]; then shape="12288 7168" extra="--copies 2"; else shape="3072 3584" extra=""; fi
            env SHOAL_AMX_MIN_T="${m/-/}" timeout 150 "$BIN/bench_gemm" $k $shape $ts --reps 3 $extra |
                grep '^{' | sed "s/^{/{\"round\":$r,\"where\":\"stream\",\"amx_min_t\":\"$m\",/" >> "$g"
        done
    done
    printf '{"meta":"load","round":%d,"value":"%s"}\n' "$r" "$(cut -d' ' -f1-3 /proc/loadavg)" >> "$g"
    say "gemm round $r done ($(( $(date +%s) - t0 )) s)"
done

# 4. the expert GEMV against the read pass, both classes
[ -n "${QUICK:-}" ] || for nc in portable mu; do
    timeout 150 "$BIN/shoal" bench kernels --only expert --tokens 1,8 --json --threads 1 --numerics $nc 2>/dev/null |
        grep '^{' > "$out/kernels_expert_$nc.jsonl"
done
say "expert rows: $(cat "$out"/kernels_expert_*.jsonl | wc -l) ($(( $(date +%s) - t0 )) s)"

# 4b. the two AVX-512 MXFP4 decodes of the portable class (shift: two shuffles
#     per 32 weights, opt-in; vpmovzx: three, the default), interleaved rounds
#     of the expert GEMV against the read pass, the in-cache GEMV (ns per 32
#     weights, thread CPU time) and bench_gemm mxfp4 T = 1..8 (~25 s a
#     configuration a round). MX_ROUNDS=0 skips it.
if [ "${MX_ROUNDS:-3}" -gt 0 ] && "$BIN/shoal" version 2>/dev/null | grep -q '^mxfp4 decode'; then
    tests/bench/mx_t1_ab.sh "$out/mx_decode.jsonl" "${MX_ROUNDS:-3}" shift="$BIN:SHOAL_MX_DECODE=shift" \
        vpmovzx="$BIN:SHOAL_MX_DECODE=vpmovzx" 2>> "$log"
    python3 tests/bench/mx_t1_ab_summary.py "$out/mx_decode.jsonl" > "$out/mx_decode.txt" 2>&1
    say "mxfp4 decodes: $(grep -A3 'in-cache ns/32w 256x3584' "$out/mx_decode.txt" | tr -s ' ' | tr '\n' ';') ($(( $(date +%s) - t0 )) s)"
fi

# 5. prefill on equal work against llama-bench
wait $gen1 $gen2
say "models: $(du -sh "$work/k3s4" "$work/anchor.gguf" 2>/dev/null | tr '\n' ' ')"
if [ -n "${LLAMA:-}" ] && [ -x "$LLAMA/llama-bench" ] && [ -f "$work/anchor.gguf" ] && [ -f "$work/k3s4/config.json" ]; then
    LD_LIBRARY_PATH="$LLAMA:$LD_LIBRARY_PATH" PYTHONUNBUFFERED=1 $py tests/bench/prefill_anchor.py \
        --model "$work/k3s4" --gguf "$work/anchor.gguf" --llama-bench "$LLAMA/llama-bench" \
        --bench-engine "$BIN/bench_engine" --rounds "${ROUNDS:-2}" --reps 1 --prompts 256 \
        --threads "${THREADS:-1,2}" --numerics portable,mu --out "$out/prefill.json" 2>&1 | tee -a "$log"
else
    say "prefill: skipped (no llama-bench or models)"
fi
say "done in $(( $(date +%s) - t0 )) s"
