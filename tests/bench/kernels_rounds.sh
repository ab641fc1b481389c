#!/bin/bash
# (the final run used: "fin avx512 1" "fin avx512 2" "fin avx2 1")
# Interleaved rounds of `shoal bench kernels --only expert --tokens 1,2,4,8,16`
# for several binaries / ISAs / thread counts (issue 19, docs/PERFORMANCE.md):
# each round runs every configuration once, so load drift hits all of them;
# each row carries the round, the load average before/after and the process's
# user/sys/wall seconds (/usr/bin/time). Binaries: /tmp/shoal_<name> (copy
# build/bin/shoal there per commit). Not a test: figures only.
# Summary: tests/bench/kernels_rounds_summary.py FILE
mkdir -p /tmp/k19b_data
out=${OUT:-/tmp/k19b_data/rounds.jsonl}
: > $out
for round in 1 2 3 4 5; do
  for cfg in "new avx512 1" "new avx512 2" "new avx2 1" "new avx2 2" "base avx512 1" "base avx512 2"; do  # edit to choose
    set -- $cfg
    bin=/tmp/shoal_$1
    t0=$(date +%s.%N); l0=$(cut -d' ' -f1 /proc/loadavg)
    res=$( { /usr/bin/time -f "%U %S %e" env SHOAL_ISA=$2 $bin bench kernels --only expert --tokens 1,2,4,8,16 --threads $3 --json > /tmp/k19b_data/cur.jsonl; } 2>&1 | tail -1)
    l1=$(cut -d' ' -f1 /proc/loadavg)
    python3 - "$round" "$1" "$2" "$3" "$l0" "$l1" "$res" >> $out <<'PY'
import sys,json
r,b,isa,th,l0,l1,res=sys.argv[1:]
u,s,e=res.split()
for l in open('/tmp/k19b_data/cur.jsonl'):
    d=json.loads(l); d.update(round=int(r),binary=b,load_before=float(l0),load_after=float(l1),proc_user_s=float(u),proc_sys_s=float(s),proc_wall_s=float(e))
    print(json.dumps(d))
PY
  done
done
echo done > /tmp/k19b_data/done
