#!/usr/bin/env bash
# Issue 33: uops and cycles per 32 weights of one row for the MXFP4 GEMV's
# inner loops at T = 1, by llvm-mca: the mu class's fold path (AVX-512: four
# 32-column blocks of 16 rows per region; AVX2: four blocks of 8 rows) and
# the portable kernel's four-group step (AVX-512 4-row tile: four groups of 4
# rows). The kernel files are compiled to assembly with -DSHOAL_MCA, which
# turns the SHOAL__MCA_BEGIN/END marks (kernels_int.h) into llvm-mca regions;
# the T = 1 instance of each region is picked by its FMA count. Not a test:
# counts for docs/PERFORMANCE.md.
# usage: tests/bench/mu_mca.sh [OUTDIR]   (MCA: llvm-mca, default llvm-mca-19;
#        CPUS: default "znver4 sapphirerapids skylake-avx512 znver3")
set -euo pipefail
out="${1:-/tmp/mu_mca}"
mca="${MCA:-llvm-mca-19}"
mkdir -p "$out"
flags="-O3 -ffp-contract=off -fopenmp -std=c11 -D_GNU_SOURCE -I. -DSHOAL_MCA -S"
gcc $flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma -mf16c \
    -o "$out/gemm_avx512.s" kernels/gemm_avx512.c
gcc $flags -mavx2 -mfma -mf16c -o "$out/gemm_avx2.s" kernels/gemm_avx2.c
# region NAME of FILE whose FMA count is NFMA -> OUT.s ; rows*groups per region -> per 32 weights
cut_region() {
    python3 - "$1" "$2" "$3" "$4" <<'PY'
import re, sys
src, name, nfma, dst = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
regs, cur = [], None
for l in open(src):
    if 'LLVM-MCA-BEGIN ' + name in l:
        cur = []
    elif 'LLVM-MCA-END' in l and cur is not None:
        regs.append(cur)
        cur = None
    elif cur is not None and l.startswith('\t') and not l.lstrip().startswith('.'):
        cur.append(l)
pick = [r for r in regs if sum(1 for x in r if 'vfmadd' in x) == nfma]
if not pick:
    sys.exit('no region %s with %d FMAs (have %s)' % (name, nfma, [sum(1 for x in r if 'vfmadd' in x) for r in regs]))
open(dst, 'w').writelines(pick[0])
PY
}
cut_region "$out/gemm_avx512.s" fold4 132 "$out/mu_fold4_avx512.s"   # 4 blocks x 16 rows: 128 + 4 FMAs
cut_region "$out/gemm_avx512.s" mx4 32 "$out/portable_mx4_avx512.s"  # 4 groups x 4 rows x 2 FMAs
cut_region "$out/gemm_avx2.s" fold4 132 "$out/mu_fold4_avx2.s"       # 4 blocks x 8 rows: 128 + 4 FMAs
for f in mu_fold4_avx512:64 portable_mx4_avx512:16 mu_fold4_avx2:32; do
    n="${f%%:*}" rg="${f#*:}"
    for cpu in ${CPUS:-znver4 sapphirerapids skylake-avx512 znver3}; do
        case "$n:$cpu" in *avx512:znver3) continue ;; esac
        "$mca" -mtriple=x86_64 -mcpu="$cpu" -iterations=200 "$out/$n.s" > "$out/$n.$cpu.txt" 2>&1 || continue
        python3 - "$out/$n.$cpu.txt" "$n" "$cpu" "$rg" "$out/$n.s" <<'PY'
import re, sys
txt, n, cpu, rg, s = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
it = int(re.search(r'Iterations:\s+(\d+)', txt).group(1))
cyc = int(re.search(r'Total Cycles:\s+(\d+)', txt).group(1))
uops = int(re.search(r'Total uOps:\s+(\d+)', txt).group(1))
rt = float(re.search(r'Block RThroughput:\s+([\d.]+)', txt).group(1))
ins = [l.split()[0] for l in open(s) if l.strip()]
kinds = {}
for i in ins:
    k = 'fma' if i.startswith('vfmadd') else 'shuffle' if re.match(r'v(perm|pshuf|shuf|insert|unpck|punpck|broadcast[if]32x4|pmovzx|pmovsx)', i) else 'shift' if re.match(r'vps[rl]l', i) else 'other'
    kinds[k] = kinds.get(k, 0) + 1
print('%-22s %-16s %4d instructions (%s); per 32 weights of a row: %.2f cycles simulated, %.2f block rthroughput, %.2f uops'
      % (n, cpu, len(ins), ' '.join('%s %d' % kv for kv in sorted(kinds.items())), cyc / it / rg, rt / rg, uops / it / rg))
PY
    done
done
