#!/usr/bin/env python3
"""Paired per-round ratios of bench_expert output files (docs/PERFORMANCE.md,
"Routed experts: one parallel region per expert"): for each file, the time of
the matrix-at-a-time form / the time of ffn and of many in the same round
(> 1: faster than the old form), median [min, max], and each row's GB/s and
ratio to the same round's sweep. usage: bench_expert_summary.py FILE..."""
import re
import statistics
import sys


def main():
    for path in sys.argv[1:]:
        rows = {}
        for line in open(path):
            m = re.match(r"round=(\d+) row=(\w+) s=([\d.]+) gbps=([\d.]+)$", line.strip())
            if m:
                rows.setdefault(m.group(2), {})[int(m.group(1))] = (float(m.group(3)), float(m.group(4)))
        rounds = sorted(rows.get("matrix", {}))
        print(path)
        for name in ("ffn", "many"):
            r = [rows["matrix"][i][0] / rows[name][i][0] for i in rounds if i in rows.get(name, {})]
            if r:
                print("  matrix/%s time ratio: median %.3f [%.3f, %.3f] over %d rounds" % (
                    name, statistics.median(r), min(r), max(r), len(r)))
        for name in ("matrix", "ffn", "many", "sweep", "read"):
            if name not in rows:
                continue
            g = [rows[name][i][1] for i in rounds if i in rows[name]]
            line = "  %-6s GB/s median %.2f [%.2f, %.2f]" % (name, statistics.median(g), min(g), max(g))
            if name in ("matrix", "ffn", "many"):
                q = [rows["sweep"][i][0] / rows[name][i][0] for i in rounds if i in rows[name]]
                line += "  / sweep %.3f [%.3f, %.3f]" % (statistics.median(q), min(q), max(q))
            print(line)


if __name__ == "__main__":
    main()
