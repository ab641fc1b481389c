#!/usr/bin/env bash
# Every issue-33 check and figure that needs a machine with AMX, in one
# prepared run (a borrowed machine's time is short), in this order:
#   0. the CPU: lscpu, which vCPUs are siblings of one core, the affinity and
#      OpenMP settings this run gets;
#   1. correctness first: every AMX GEMM variant (SHOAL_AMX_VARIANT, all 32
#      flag combinations, then each variant to be measured in its own process)
#      against the scalar specification on the real tiles
#      (build/tests/kernels_amx_real), test_kernels (every variant's start-up
#      self-test; t_mu_isa on the tiles at every T, default and the all-flags
#      variant), the engine in the mu class and against the reference. A
#      variant that fails is reported and left out of every figure;
#   2. the instruction peaks (shoal bench peak);
#   3. the mu GEMMs on the tiles for every variant, interleaved rep by rep in
#      one process (bench_gemm --amx-variants) at T = 1, 4, 8, 16, 64, 256: bf16
#      12288 x 7168 and MXFP4 3072 x 3584 (expert shape); and the AVX-512
#      emulation (SHOAL_AMX_MIN_T=0) at T = 1, 8 for the T = 8 / T = 1 goal;
#   4. why mu did not scale to 2 threads (issue 33, fourth session): the AMX
#      GEMM at T = 256 on 1 thread, 2 threads on two different cores, 2 on the
#      two siblings of one core, 2 unpinned, and the AVX-512 emulation on two
#      cores; then prefill (bench_engine, mu, 256 tokens) the same ways, and
#      unpinned with spinning OpenMP waits (OMP_WAIT_POLICY=active) against
#      shoal's passive default; and which vCPU pairs share a matrix unit
#      (the AMX GEMM in cache on two vCPUs at once against alone);
#   5. prefill on equal work against llama-bench (tests/bench/prefill_anchor.py),
#      1 thread, 256 tokens: base and the 3 variants (QUICK: 1) fastest in step
#      3's GEMMs (bf16 T = 256, MXFP4 T = 64), interleaved with the anchor;
#   4c. the mu class's MXFP4 fold path on and off (SHOAL_MU_FOLD), bench_gemm
#      mxfp4mu T = 1, 2, 4 on the AVX-512 emulation, 3 interleaved rounds;
#   4b (run last). the two AVX-512 MXFP4 decodes of the portable class against
#      each other (tests/bench/mx_t1_ab.sh: expert GEMV vs the read pass,
#      in-cache GEMV, bench_gemm mxfp4 T = 1..8), as many interleaved rounds as
#      the time left allows (about 55 s each; MX_ROUNDS=N forces N, 0 skips).
# Then tests/bench/amx_summary.py OUTDIR prints the tables for
# docs/PERFORMANCE.md. Runs on any x86-64 (without AMX: step 1 SKIPs, the
# mu rows are the AVX-512 emulation and say so). Not a test: figures.
# About 5 minutes on the Xeon of issue 33 (QUICK=1: under 3).
#
# usage: tests/bench/amx_machine.sh OUTDIR
#   BIN      folder with shoal, test_kernels, kernels_amx_real, test_engine,
#            test_engine_ref, bench_gemm, bench_engine (default: links into build/)
#   LIBS     extra library folder for those (LD_LIBRARY_PATH), optional
#   LLAMA    folder with llama-bench and its libraries (optional: no anchor)
#   WHEELS   folder with the gguf wheel if python3 lacks gguf (optional)
#   WORK     scratch for the two models, ~10 GB (default /tmp/amxw)
#   VARIANTS the AMX variants to measure, names in canonical order (as
#            `kernels_amx_real` prints them), comma-separated
#   QUICK=1  4 variants, 2 reps, fewer diagnosis runs (under 3 minutes)
#   BUDGET   seconds after which the remaining steps are skipped, each saying
#            so (default 330; QUICK 170)
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
    for t in test_kernels kernels_amx_real test_engine test_engine_ref bench_gemm bench_engine; do
        ln -sf "$here/build/tests/$t" "$BIN/$t"
    done
fi
export LD_LIBRARY_PATH="${LIBS:-}${LIBS:+:}${LD_LIBRARY_PATH:-}"
cd "$here"
log="$out/log.txt"
say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$log"; }
t0=$(date +%s)
quick="${QUICK:-}"
budget="${BUDGET:-$([ -n "$quick" ] && echo 170 || echo 330)}"
elapsed() { echo $(( $(date +%s) - t0 )); }
over() { # over STEP: 1 (and says so) when the budget is spent
    if [ "$(elapsed)" -ge "$budget" ]; then say "SKIPPED $1: budget of $budget s spent ($(elapsed) s)"; return 0; fi
    return 1
}
if [ -n "${VARIANTS:-}" ]; then
    variants="$VARIANTS"
elif [ -n "$quick" ]; then
    variants="base,k256+once,k256+once+pipe,k256+once+pf+pipe+swap"
else
    variants="base,k256,once,pf,pipe,swap,k256+once,k256+once+pipe,k256+once+pf+pipe+swap"
fi
reps=$([ -n "$quick" ] && echo 2 || echo 3)

# 0. the machine, and which vCPUs to pin to: A, a vCPU on another core (D),
#    A's sibling on the same core (S), all within this process's affinity
allowed="$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//')"
cpus=()
for c in $(python3 -c "import os; print(' '.join(map(str, sorted(os.sched_getaffinity(0)))))"); do cpus+=("$c"); done
core_of() { echo "$(cat /sys/devices/system/cpu/cpu$1/topology/physical_package_id 2>/dev/null):$(cat /sys/devices/system/cpu/cpu$1/topology/core_id 2>/dev/null)"; }
A="${cpus[0]}"; D=""; S=""
for c in "${cpus[@]:1}"; do
    if [ "$(core_of "$c")" = "$(core_of "$A")" ]; then [ -z "$S" ] && S="$c"; else [ -z "$D" ] && D="$c"; fi
done
if ! command -v taskset > /dev/null; then # no pinning possible: those runs are left out, and said so
    A="-"; D=""; S=""
    cpus=("-")
fi
{
    echo "== date"; date -u
    echo "== lscpu"; lscpu
    echo "== lscpu -e (which vCPUs share a core: siblings share its AMX unit)"; lscpu -e
    echo "== topology (cpu: package:core, thread siblings)"
    for c in /sys/devices/system/cpu/cpu[0-9]*; do
        n="${c##*cpu}"
        echo "cpu$n $(core_of "$n") siblings $(cat "$c/topology/thread_siblings_list" 2>/dev/null)"
    done | sort -V
    echo "== affinity of this run: $allowed; pinning: A=$A D=${D:-none} (another core) S=${S:-none} (A's sibling)"
    echo "== cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo '?')"
    echo "== OpenMP environment: $(env | grep -E '^(OMP_|GOMP_|KMP_)' | tr '\n' ' ')"
    echo "== flags (avx512*, amx*)"; grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512|amx|avx2|fma)' | tr '\n' ' '; echo
    echo "== memory"; free -g
    echo "== loadavg"; cat /proc/loadavg
    echo "== shoal version"; "$BIN/shoal" version
} > "$out/facts.txt" 2>&1
say "facts: $(grep -m1 'Model name' "$out/facts.txt" | sed 's/.*: *//'); $(nproc) CPUs; amx: $(grep -c -m1 -w amx_tile /proc/cpuinfo); pin A=$A D=${D:-none} S=${S:-none}"
say "shoal version: $("$BIN/shoal" version 2>&1 | grep mu-order)"

# models, in the background while the correctness checks and GEMMs run
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

# 1. correctness on the tiles, every variant first: all 32 in one process for
#    the record, then each variant to be measured in its own process (a crash
#    then costs only that variant); a variant is measured only if its own run
#    passed (or, without AMX, SKIPPED: the rows then say they are the emulation)
{
    echo "== kernels_amx_real (all 32 variants on the tiles)"; timeout 120 "$BIN/kernels_amx_real"; echo "rc=$?"
    echo "== test_kernels"; timeout 120 "$BIN/test_kernels"; echo "rc=$?"
    if [ -z "$quick" ]; then
        echo "== test_kernels, SHOAL_AMX_VARIANT=k256+once+pf+pipe+swap"
        SHOAL_AMX_VARIANT=k256+once+pf+pipe+swap timeout 120 "$BIN/test_kernels"; echo "rc=$?"
    fi
    echo "== test_engine --numerics mu"; timeout 120 "$BIN/test_engine" --numerics mu; echo "rc=$?"
    echo "== test_engine_ref --numerics mu"; timeout 120 "$BIN/test_engine_ref" --numerics mu; echo "rc=$?"
} > "$out/tests.txt" 2>&1
say "tests: $(grep -E '^[0-9]+ passed' "$out/tests.txt" | tr '\n' ';') rc: $(grep '^rc=' "$out/tests.txt" | tr '\n' ' ')"
grep -E '^(FAIL|SKIP)|t_mu_amx|t_amx_variants_tiles|t_peak' "$out/tests.txt" | sort | uniq -c | head -40 | tee -a "$log"
ok=""
amx=1
for v in ${variants//,/ }; do
    timeout 60 "$BIN/kernels_amx_real" "$v" > "$out/tiles_$v.txt" 2>&1
    rc=$?
    if [ $rc = 77 ]; then
        amx=0
        ok="$ok${ok:+,}$v"
    elif [ $rc = 0 ] && grep -q "^PASS variant $v\$" "$out/tiles_$v.txt"; then
        ok="$ok${ok:+,}$v"
    else
        say "variant $v FAILED on the tiles (rc $rc: $(grep -m1 -E 'FAIL|unknown|Segm' "$out/tiles_$v.txt")): left out"
    fi
done
say "variants measured: ${ok:-none}$([ $amx = 0 ] && echo ' (no AMX here: the mu rows are the AVX-512 emulation, variants not applied)')"

# 2. peaks
"$BIN/shoal" bench peak --json --reps 5 2>/dev/null | grep '^{' > "$out/peak.jsonl"
say "peaks: $(tr '\n' ' ' < "$out/peak.jsonl" | head -c 400)"

# 3. the mu GEMMs, every variant interleaved in one process per kind
g="$out/gemm.jsonl"
: > "$g"
gemm() { # gemm LABEL CPUS|- ENV... -- bench_gemm args...
    local label="$1" cpus="$2"; shift 2
    local envs=() pin=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    [ "$cpus" != "-" ] && pin=(taskset -c "$cpus")
    env "${envs[@]}" "${pin[@]}" timeout 150 "$BIN/bench_gemm" "$@" 2>>"$log" |
        grep '^{' | sed "s/^{/{\"run\":\"$label\",\"cpus\":\"$cpus\",\"load\":\"$(cut -d' ' -f1 /proc/loadavg)\",/" >> "$g"
}
vflag=()
[ $amx = 1 ] && [ -n "$ok" ] && vflag=(--amx-variants "$ok")
if ! over "gemm"; then
    gemm variants - SHOAL_AMX_MIN_T=1 -- bf16mu 12288 7168 1,4,8,16,64,256 --reps "$reps" --copies 2 "${vflag[@]}"
    say "gemm bf16 variants done ($(elapsed) s)"
    gemm variants - SHOAL_AMX_MIN_T=1 -- mxfp4mu 3072 3584 1,4,8,16,64,256 --reps "$reps" --copies 16 "${vflag[@]}"
    say "gemm mxfp4 variants done ($(elapsed) s)"
    gemm emulation - SHOAL_AMX_MIN_T=0 -- bf16mu 12288 7168 1,8 --reps "$reps" --copies 2
    gemm emulation - SHOAL_AMX_MIN_T=0 -- mxfp4mu 3072 3584 1,8 --reps "$reps" --copies 16
    say "gemm emulation rows done ($(elapsed) s)"
fi

# 4. two threads (base variant, passive OpenMP waits): the AMX GEMM at T = 256
#    on one vCPU, on two cores, on one core's two siblings, unpinned; the
#    AVX-512 emulation on two cores; then prefill the same ways
diag="$out/threads.jsonl"
: > "$diag"
if ! over "2-thread gemm"; then
    w=(OMP_WAIT_POLICY=passive)
    gemm t1 "$A" "${w[@]}" SHOAL_AMX_MIN_T=1 -- bf16mu 12288 7168 256 --reps "$reps" --copies 2 --threads 1
    [ -n "$D" ] && gemm t2_cores "$A,$D" "${w[@]}" SHOAL_AMX_MIN_T=1 -- bf16mu 12288 7168 256 --reps "$reps" --copies 2 --threads 2
    [ -n "$S" ] && gemm t2_siblings "$A,$S" "${w[@]}" SHOAL_AMX_MIN_T=1 -- bf16mu 12288 7168 256 --reps "$reps" --copies 2 --threads 2
    gemm t2_unpinned - "${w[@]}" SHOAL_AMX_MIN_T=1 -- bf16mu 12288 7168 256 --reps "$reps" --copies 2 --threads 2
    if [ -z "$quick" ]; then
        gemm t1_emulation "$A" "${w[@]}" SHOAL_AMX_MIN_T=0 -- bf16mu 12288 7168 256 --reps "$reps" --copies 2 --threads 1
        [ -n "$D" ] && gemm t2_cores_emulation "$A,$D" "${w[@]}" SHOAL_AMX_MIN_T=0 -- bf16mu 12288 7168 256 --reps "$reps" \
            --copies 2 --threads 2
    fi
    say "2-thread gemm rows done ($(elapsed) s): $(grep -E '"run":"t[12]' "$g" | sed -E 's/.*"run":"([^"]*)".*"gmacs":([0-9.]+).*"gmacs_cpu":([0-9.]+).*/\1 \2 GMAC\/s (cpu \3)/' | tr '\n' ';')"
fi

# which vCPUs share a matrix unit, measured (a VM may show every vCPU as its own
# core while the host runs two on one core's hyperthreads): the AMX GEMM in
# cache (bf16mu 256 x 2048, T = 256) alone on A, then on A and on vCPU c at
# once, for every other allowed vCPU (QUICK: 3): a pair whose rates drop to
# about half shares one unit
pairs="$out/pairs.jsonl"
: > "$pairs"
probe() { SHOAL_AMX_MIN_T=1 ${1:+taskset -c "$1"} timeout 60 "$BIN/bench_gemm" bf16mu 256 2048 256 --reps 500 --copies 1 2>/dev/null | grep '^{"kind"'; }
if [ "$A" = "-" ]; then
    say "vCPU pairs: skipped (no taskset)"
elif ! over "vCPU pairs"; then
    printf '{"pair":"solo","a":%s}\n' "$(probe "$A")" >> "$pairs"
    n=0
    for c in "${cpus[@]:1}"; do
        [ -n "$quick" ] && [ $n -ge 3 ] && break
        n=$((n + 1))
        probe "$A" > "$work/pa.txt" &
        pa=$!
        rb="$(probe "$c")"
        wait $pa
        printf '{"pair":"%s,%s","a":%s,"b":%s}\n' "$A" "$c" "$(cat "$work/pa.txt")" "$rb" >> "$pairs"
    done
    say "vCPU pairs done ($(elapsed) s): $(sed -E 's/.*"pair":"([^"]*)".*"gmacs":([0-9.]+).*/\1 \2/' "$pairs" | tr '\n' ';')"
fi

wait $gen1 $gen2
say "models: $(du -sh "$work/k3s4" "$work/anchor.gguf" 2>/dev/null | tr '\n' ' ') ($(elapsed) s)"
eng() { # eng LABEL CPUS|- THREADS ENV...: one mu prefill of 256 tokens
    local label="$1" cpus="$2" th="$3"; shift 3
    local pin=()
    [ "$cpus" != "-" ] && pin=(taskset -c "$cpus")
    local t1 r
    t1=$(date +%s%N)
    r="$(env "$@" "${pin[@]}" timeout 120 "$BIN/bench_engine" "$work/k3s4" --threads "$th" --steps 1 --reps 1 \
        --prefill 256 --prefill-reps 1 --max-batch 256 --numerics mu 2>>"$log" | grep -E '^row=(prefill|config)' | tr '\n' ' ')"
    printf '{"run":"%s","cpus":"%s","threads":%d,"env":"%s","load":"%s","wall_s":%s,"rows":"%s"}\n' "$label" "$cpus" \
        "$th" "$*" "$(cut -d' ' -f1 /proc/loadavg)" "$(( ($(date +%s%N) - t1) / 1000000 ))e-3" "$r" >> "$diag"
    say "prefill $label: $(echo "$r" | grep -o 'tokens_per_s=[0-9.]*' | head -1) $(echo "$r" | grep -o 'cpu_seconds=[0-9.]*' | head -1)"
}
if [ -f "$work/k3s4/config.json" ] && ! over "2-thread prefill"; then
    eng p1 "$A" 1
    [ -n "$D" ] && eng p2_cores "$A,$D" 2
    if [ -z "$quick" ]; then
        [ -n "$S" ] && eng p2_siblings "$A,$S" 2
        eng p2_unpinned - 2
        eng p2_unpinned_spin - 2 OMP_WAIT_POLICY=active
    fi
fi

# 5. prefill on equal work against llama-bench: base and the fastest variants, 1 thread
if [ -n "${LLAMA:-}" ] && [ -x "$LLAMA/llama-bench" ] && [ -f "$work/anchor.gguf" ] && [ -f "$work/k3s4/config.json" ]; then
    if ! over "prefill vs llama-bench"; then
        nc="mu"
        if [ $amx = 1 ] && [ -n "$ok" ]; then # base and the 3 (QUICK 1) fastest by the GEMMs: the step fits the budget
            pv="$($py tests/bench/amx_summary.py --rank "$out" "$([ -n "$quick" ] && echo 1 || echo 3)" 2>>"$log")"
            say "prefill variants (base and the fastest by bf16 T = 256 and MXFP4 T = 64): ${pv:-base}"
            nc="$(echo "${pv:-base}" | tr ',' '\n' | sed 's/^/mu@/' | paste -sd,)"
        fi
        LD_LIBRARY_PATH="$LLAMA:$LD_LIBRARY_PATH" PYTHONUNBUFFERED=1 $py tests/bench/prefill_anchor.py \
            --model "$work/k3s4" --gguf "$work/anchor.gguf" --llama-bench "$LLAMA/llama-bench" \
            --bench-engine "$BIN/bench_engine" --rounds 1 --reps 1 --prompts 256 \
            --threads 1 --numerics "$nc" --out "$out/prefill.json" 2>&1 | tee -a "$log"
    fi
else
    say "prefill vs llama-bench: skipped (no llama-bench or models)"
fi
# 4c. the mu class's MXFP4 fold path against its table path (SHOAL_MU_FOLD=on/off,
#     the same bits) on this CPU's AVX-512 emulation, which decode (T < 8) runs on an
#     AMX machine: bench_gemm mxfp4mu, expert shape, T = 1, 2, 4, 3 interleaved rounds
#     (~30 s); on Intel llvm-mca scores the fold step worse than the old block (issue 33,
#     eighth session), so this decides whether it stays the default there.
if [ "$(( budget + 30 - $(elapsed) ))" -gt 40 ] || [ -n "${MX_ROUNDS:-}" ]; then
    : > "$out/mu_fold.jsonl"
    for r in 1 2 3; do
        for f in $([ $((r % 2)) = 1 ] && echo "on off" || echo "off on"); do
            SHOAL_MU_FOLD=$f SHOAL_ISA=avx512 "$BIN/bench_gemm" mxfp4mu 3072 3584 1,2,4 --reps 5 2>>"$log" |
                grep '^{' | sed "s/^{/{\"round\":$r,\"fold\":\"$f\",/" >> "$out/mu_fold.jsonl"
        done
    done
    say "mu MXFP4 fold on/off (gmacs_cpu by T, 3 rounds): $($py - "$out/mu_fold.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = []
for T in sorted({r.get("T") for r in rows if r.get("T") is not None}):
    med = {f: statistics.median(r["gmacs_cpu"] for r in rows if r.get("T") == T and r["fold"] == f) for f in ("on", "off")}
    out.append(f"T={T} on {med['on']:.1f} off {med['off']:.1f} ({med['on'] / med['off']:.2f}x)")
print("; ".join(out))
PYEOF
) ($(elapsed) s)"
else
    say "SKIPPED mu fold on/off: no time left in the budget of $budget s ($(elapsed) s)"
fi
# 4b. the two AVX-512 MXFP4 decodes of the portable class (shift: two shuffles
#     per 32 weights, opt-in; vpmovzx: three, the default), interleaved rounds
#     of the expert GEMV against the read pass, the in-cache GEMV (ns per 32
#     weights, thread CPU time) and bench_gemm mxfp4 T = 1..8 (~25 s a
#     configuration a round): last, in the time the budget leaves (+30 s), at
#     most 3 rounds; MX_ROUNDS=N runs N whatever the time, 0 skips it.
mxr="${MX_ROUNDS:-}"
[ -z "$mxr" ] && mxr=$(( (budget + 30 - $(elapsed)) / 55 )) && [ "$mxr" -gt 3 ] && mxr=3
if [ "$mxr" -gt 0 ] && "$BIN/shoal" version 2>/dev/null | grep -q '^mxfp4 decode'; then
    tests/bench/mx_t1_ab.sh "$out/mx_decode.jsonl" "$mxr" shift="$BIN:SHOAL_MX_DECODE=shift" \
        vpmovzx="$BIN:SHOAL_MX_DECODE=vpmovzx" 2>> "$log"
    python3 tests/bench/mx_t1_ab_summary.py "$out/mx_decode.jsonl" > "$out/mx_decode.txt" 2>&1
    say "mxfp4 decodes, $mxr rounds: $(grep -A3 'in-cache ns/32w 256x3584' "$out/mx_decode.txt" | tr -s ' ' | tr '\n' ';') ($(elapsed) s)"
else
    say "SKIPPED mxfp4 decodes A/B: $([ "$mxr" -gt 0 ] && echo 'this shoal has one decode' || echo "no time left in the budget of $budget s (MX_ROUNDS=N forces it)") ($(elapsed) s)"
fi
$py tests/bench/amx_summary.py "$out" > "$out/summary.md" 2>>"$log" && cat "$out/summary.md" | tee -a "$log"
say "done in $(elapsed) s"
