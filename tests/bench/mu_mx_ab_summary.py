"""Summary of tests/bench/mu_mx_ab.sh: per ISA, shape, T and threads, the
median [min, max] over rounds of GMAC/s by the calling thread's CPU time
(bench_gemm gmacs_cpu; on 2 threads by wall clock, gmacs, as the other
thread's time is not the caller's) per configuration, and of the per-round ratios config / portable
and config / first config; for `shoal bench kernels` rows, GB/s and the ratio
to the read pass measured in the same run.

    mu_mx_ab_summary.py FILE.jsonl
"""
import json
import statistics as st
import sys
from collections import defaultdict


def fmt(v):
    return '%.2f [%.2f, %.2f]' % (st.median(v), min(v), max(v))


rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
loads = [float(r['load'].split()[0]) for r in rows]
print('rows %d, rounds %d, 1-min load %.1f-%.1f' % (len(rows), max(r['round'] for r in rows), min(loads), max(loads)))
g = defaultdict(dict)  # (isa, what) -> {(config, round): value}
order = []
for r in rows:
    if 'gmacs_cpu' in r:
        what = '%s %s T=%d threads=%d%s%s' % (r['kind'].replace('mu', ''), r['shape'], r['T'], r['threads'],
                                            ' in-cache' if r.get('in_cache') else '',
                                            ' (wall)' if r['threads'] > 1 else '')
        v = r['gmacs_cpu'] if r['threads'] == 1 else r['gmacs']
    elif r.get('op') == 'gemv_mxfp4':
        what = 'bench kernels %s, fraction of the read pass' % r['layer']
        v = r['ratio']
    else:
        continue
    key = (r['isa_env'], what)
    if key not in order:
        order.append(key)
    g[key][(r['config'], r['round'])] = v
configs = []
for r in rows:
    if r['config'] not in configs:
        configs.append(r['config'])
mu = [c for c in configs if c != 'portable']
for key in order:
    d = g[key]
    rounds = sorted({k[1] for k in d})
    line = ['%-7s %-55s' % key]
    for c in configs:
        v = [d[(c, r)] for r in rounds if (c, r) in d]
        if v:
            line.append('%s %s' % (c, fmt(v)))
    for c in mu:
        v = [d[(c, r)] / d[('portable', r)] for r in rounds if (c, r) in d and ('portable', r) in d]
        if v:
            line.append('%s/portable %s' % (c, fmt(v)))
    if len(mu) > 1:
        for c in mu[1:]:
            v = [d[(c, r)] / d[(mu[0], r)] for r in rounds if (c, r) in d and (mu[0], r) in d]
            if v:
                line.append('%s/%s %s' % (c, mu[0], fmt(v)))
    print(' | '.join(line))
