#!/usr/bin/env python3
"""Summarise a docs/data/dist_exchange_*.txt file (tests/bench/dist_bench.sh
exchange): per configuration, the median over rounds of the per-run medians of
the net exchange time and of the raw round trip, their ratio per round (min /
median / max), and the bytes per layer. Prints a Markdown table. Files of
`dist_bench.sh ab` (rounds tagged "version base|new") get a version column."""
import re
import statistics
import sys
from collections import defaultdict

runs = defaultdict(list)
cur = None
version = ""
for line in open(sys.argv[1]):
    m = re.match(r"## .*version (\w+)", line)
    if m:
        version = m.group(1)
    m = re.match(r"# summary transport=(\w+) workers=(\d+) tokens=(\d+) .*compute=(.*)$", line)
    if m:
        cur = {"key": (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip(), version)}
        runs[cur["key"]].append(cur)
        continue
    if cur is None:
        continue
    m = re.match(r"# bytes per layer: out (\d+) in (\d+)", line)
    if m:
        cur["out"], cur["in"] = int(m.group(1)), int(m.group(2))
    m = re.match(r"# net exchange us: p10 ([\d.]+) median ([\d.]+) p90 ([\d.]+)", line)
    if m:
        cur["net"] = float(m.group(2))
    m = re.match(r"# raw round trip us: p10 ([\d.]+) median ([\d.]+) p90 ([\d.]+)", line)
    if m:
        cur["raw"] = float(m.group(2))
    m = re.match(r"# exchange median ([\d.]+) us \(worker queue\+compute median ([\d.]+)", line)
    if m:
        cur["gross"], cur["proc"] = float(m.group(1)), float(m.group(2))

vcol = any(k[4] for k in runs)
print("| transport | workers | tokens | compute |" + (" version |" if vcol else "") +
      " runs | net exchange µs (median of medians) | raw round trip µs | "
      "ratio net/raw: median (min–max over runs) | bytes out / in per layer |")
print("|---|---|---|---|" + ("---|" if vcol else "") + "---|---|---|---|---|")
for key in sorted(runs, key=lambda k: (k[3] != "skipped", k[0], k[2], k[1], k[4])):
    rs = [r for r in runs[key] if "net" in r and "raw" in r]
    ratios = sorted(r["net"] / r["raw"] for r in rs)
    net = statistics.median(r["net"] for r in rs)
    raw = statistics.median(r["raw"] for r in rs)
    tr, w, t, comp, ver = key
    print(f"| {tr} | {w} | {t} | {comp} |" + (f" {ver} |" if vcol else "") + f" {len(rs)} | {net:.0f} | {raw:.0f} | "
          f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f}) | {rs[0]['out']} / {rs[0]['in']} |")
