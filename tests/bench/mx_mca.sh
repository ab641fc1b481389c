#!/usr/bin/env bash
# Issue 33: uops per port of the MXFP4 GEMV's inner loop (AVX-512: the 4-row,
# 1-token tile, both decodes; AVX2: the 2-row tile, OBJ = gemm_avx2.c.o and
# FNS=mx_tile_2x1, MCPUS="znver3 haswell skylake"), by llvm-mca. The loop is cut from the kernel as
# built (objdump of gemm_avx512.c.o: from the loop head to its backward
# branch, the in-line prefetch branches kept as not taken, so the 4 row
# prefetches issued every fourth group are counted every group), written to
# a .s file and simulated for each -mcpu. One iteration = one group of 32
# weights in each of 4 rows: divide the port columns by 4 for "per 32 weights".
# Not a test: counts for docs/PERFORMANCE.md.
# usage: tests/bench/mx_mca.sh [OBJ] [OUTDIR]   (OBJ default: build's gemm_avx512.c.o)
#   FNS: the tile functions (default mx_tile_4x1 mx_tile_zx_4x1: the shift and vpmovzx decodes)
#   MCPUS: the -mcpu models (default icelake-server sapphirerapids skylake-avx512)
set -euo pipefail
obj="${1:-build/CMakeFiles/shoal_kernels.dir/kernels/gemm_avx512.c.o}"
out="${2:-/tmp/mx_mca}"
mca="${MCA:-llvm-mca-14}"
mkdir -p "$out"
for fn in ${FNS:-mx_tile_4x1 mx_tile_zx_4x1}; do
    objdump -d --no-show-raw-insn "$obj" | awk "/<$fn>:/,/^\$/" > "$out/$fn.dis"
    python3 - "$out/$fn.dis" "$out/$fn.s" <<'PY'
import re, sys
ins = []
for l in open(sys.argv[1]):
    m = re.match(r'\s*([0-9a-f]+):\s+(.*)$', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).split('#')[0].strip()))
# the loop: the first conditional branch that jumps backwards, from its target to it
for i, (a, t) in enumerate(ins):
    m = re.match(r'(j\w+)\s+([0-9a-f]+)\s+<', t)
    if m and m.group(1) != 'jmp' and int(m.group(2), 16) < a:
        head = int(m.group(2), 16)
        body = [(b, u) for b, u in ins if head <= b <= a]
        break
else:
    sys.exit('no loop found')
with open(sys.argv[2], 'w') as f:
    f.write('.Lhead:\n')
    for b, u in body:
        m = re.match(r'(j\w+)\s+[0-9a-f]+\s+<.*>', u)
        f.write('\t%s\n' % ('%s .Lhead' % m.group(1) if m else re.sub(r'<[^>]*>', '', u)))
PY
    for cpu in ${MCPUS:-icelake-server sapphirerapids skylake-avx512}; do
        echo "== $fn -mcpu=$cpu ($(grep -c . "$out/$fn.s") lines)"
        "$mca" -mtriple=x86_64 -mcpu="$cpu" -iterations=400 "$out/$fn.s" > "$out/$fn.$cpu.txt" 2>&1 || true
        sed -n '/^Total Cycles/p;/^Total uOps/p;/^Block RThroughput/p' "$out/$fn.$cpu.txt"
        sed -n '/^Resources:/,/^$/p' "$out/$fn.$cpu.txt" | grep -E 'Port(0|1|5)\b|Zn3FPP[0-3]\b' | tr '\n' ' '; echo
        sed -n '/^Resource pressure per iteration:/,/^$/p' "$out/$fn.$cpu.txt" | tail -n +2
        # vector ops by kind, per iteration (= per 4 row-groups)
        grep -oE '^\s*(vpermps|vpmovzxbd|vpsrlvq|vpsrlq|vpsrld|vpslld|vbroadcasti32x4|vbroadcasti128|vpshufb|vpunpck[lh]bw|vpand|vfmadd[0-9]+ps)' "$out/$fn.s" | sort | uniq -c | tr '\n' ' '; echo
    done
done
