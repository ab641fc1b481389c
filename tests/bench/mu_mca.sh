#!/usr/bin/env bash
# Issue 33: uops per port of the mu-class MXFP4 GEMV's inner loop (the
# 16-row, 1-token tile of gemm_avx512.c or the 8-row one of gemm_avx2.c), by
# llvm-mca. The loop is cut from the kernel as built: in the tile function,
# the smallest loop (backward conditional branch to its head) holding at
# least MINFMA FMAs (default 32: one 32-column block of 16 rows, T = 1), the
# branches inside kept as not taken; written to a .s file and simulated for
# each -mcpu. The summary line gives cycles and uops per iteration and per 32
# weights of one row (an iteration covers ROWS rows x 32 x BLOCKS columns).
# Not a test: counts for docs/PERFORMANCE.md.
# usage: tests/bench/mu_mca.sh [OBJ] [FN] [OUTDIR]
#   OBJ default build's gemm_avx512.c.o, FN default mu_tile_1.constprop.0
#   MCA (default llvm-mca-19), CPUS (default "znver4 sapphirerapids skylake-avx512"),
#   MINFMA (default 32), WEIGHTS (weights per iteration, default 512: 16 rows x 32)
set -euo pipefail
obj="${1:-build/CMakeFiles/shoal_kernels.dir/kernels/gemm_avx512.c.o}"
fn="${2:-mu_tile_1.constprop.0}"
out="${3:-/tmp/mu_mca}"
mca="${MCA:-llvm-mca-19}"
mkdir -p "$out"
objdump -d --no-show-raw-insn "$obj" > "$out/all.dis"
awk -v f="<$fn>:" 'index($0, f) { on = 1 } on && /^$/ { on = 0 } on' "$out/all.dis" > "$out/$fn.dis"
python3 - "$out/$fn.dis" "$out/$fn.s" "${MINFMA:-32}" <<'PY'
import re, sys
ins = []
for l in open(sys.argv[1]):
    m = re.match(r'\s*([0-9a-f]+):\s+(.*)$', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).split('#')[0].strip()))
best = None
for i, (a, t) in enumerate(ins):
    m = re.match(r'(j\w+)\s+([0-9a-f]+)\s+<', t)
    if m and m.group(1) != 'jmp' and int(m.group(2), 16) < a:
        body = [(b, u) for b, u in ins if int(m.group(2), 16) <= b <= a]
        nf = sum(1 for _, u in body if u.startswith('vfmadd'))
        if nf >= int(sys.argv[3]) and (best is None or len(body) < len(best)):
            best = body
if best is None:
    sys.exit('no loop found')
with open(sys.argv[2], 'w') as f:
    f.write('.Lhead:\n')
    for b, u in best:
        m = re.match(r'(j\w+)\s+[0-9a-f]+\s+<.*>', u)
        if m and b != best[-1][0]:
            f.write('\t%s .Lnot\n' % m.group(1))  # inner branches: not taken
        elif m:
            f.write('\t%s .Lhead\n' % m.group(1))
        else:
            f.write('\t%s\n' % re.sub(r'<[^>]*>', '', u))
    f.write('.Lnot:\n')
PY
w="${WEIGHTS:-512}"
for cpu in ${CPUS:-znver4 sapphirerapids skylake-avx512}; do
    "$mca" -mtriple=x86_64 -mcpu="$cpu" -iterations=200 "$out/$fn.s" > "$out/$fn.$cpu.txt" 2>&1 || true
    it=$(awk '/^Iterations:/ {print $2}' "$out/$fn.$cpu.txt")
    cyc=$(awk '/^Total Cycles:/ {print $3}' "$out/$fn.$cpu.txt")
    uops=$(awk '/^Total uOps:/ {print $3}' "$out/$fn.$cpu.txt")
    rt=$(awk '/^Block RThroughput:/ {print $3}' "$out/$fn.$cpu.txt")
    n=$(grep -c '^\s' "$out/$fn.s")
    nf=$(grep -c 'vfmadd' "$out/$fn.s")
    python3 -c "
it, cyc, uops, w = $it, $cyc, $uops, $w
print('%-16s %s: %d instructions (%d FMA), %.1f cycles and %.1f uops per iteration, block rthroughput %s; per 32 weights of a row: %.2f cycles, %.2f uops' % ('$cpu', '$fn', $n, $nf, cyc / it, uops / it, '$rt', cyc / it * 32 / w, uops / it * 32 / w))"
done
