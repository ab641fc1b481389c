#!/usr/bin/env python3
"""Draws K3-nano's training loss curve as an SVG from the raw training log
(tools/train_nano.py --log; committed as docs/data/nano_train_log.tsv).

    python3 tools/plot_nano.py docs/data/nano_train_log.tsv docs/nano_loss.svg

Standard library only. x: training step (top axis labels: wall time); y: the
cross-entropy of each step's batch (nats/token, thin) and its 20-step moving
average (thick); the MXFP4 fake-quantization (decay) phase is shaded.
"""
import sys


def main():
    src, dst = sys.argv[1], sys.argv[2]
    rows = []
    for line in open(src):
        if line.startswith("#") or line.startswith("step"):
            continue
        f = line.split("\t")
        rows.append((int(f[0]), float(f[1]), float(f[3]), int(f[5])))
    W, H, L, R, T, B = 720, 400, 60, 20, 40, 50
    n = rows[-1][0] + 1
    ymax = max(r[2] for r in rows[: max(1, n // 50)]) if rows else 1
    ymin = min(r[2] for r in rows)
    ylo, yhi = max(0, int(ymin) - 1), int(ymax) + 1

    def x(s):
        return L + (W - L - R) * s / max(1, n - 1)

    def y(v):
        return T + (H - T - B) * (yhi - v) / (yhi - ylo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>']
    q = [r[0] for r in rows if r[3]]
    if q:
        out.append(f'<rect x="{x(q[0]):.1f}" y="{T}" width="{x(q[-1]) - x(q[0]):.1f}" height="{H - T - B}" '
                   f'fill="#eef3ff"/>')
        out.append(f'<text x="{x(q[0]) + 4:.1f}" y="{T + 14}" fill="#557">decay + MXFP4 QAT</text>')
    v = ylo
    while v <= yhi + 1e-9:
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v += 1
    for k in range(6):
        s = round((n - 1) * k / 5)
        t = rows[min(s, len(rows) - 1)][1]
        out.append(f'<text x="{x(s):.1f}" y="{H - B + 16}" text-anchor="middle">{s}</text>')
        out.append(f'<text x="{x(s):.1f}" y="{T - 6}" text-anchor="middle" fill="#777">{t / 60:.0f} min</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">training step '
               f'(top: wall time)</text>')
    out.append(f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" '
               f'text-anchor="middle">loss (nats/token)</text>')
    pts = " ".join(f"{x(r[0]):.1f},{y(min(max(r[2], ylo), yhi)):.1f}" for r in rows)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#9bb" stroke-width="1"/>')
    avg, acc = [], []
    for r in rows:
        acc.append(r[2])
        acc = acc[-20:]
        avg.append((r[0], sum(acc) / len(acc)))
    pts = " ".join(f"{x(s):.1f},{y(min(max(a, ylo), yhi)):.1f}" for s, a in avg)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#146" stroke-width="2"/>')
    out.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" stroke="black"/>')
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" stroke="black"/>')
    out.append(f'<text x="{W - R}" y="{T + 14}" text-anchor="end">K3-nano: final 20-step mean '
               f'{avg[-1][1]:.3f} after {rows[-1][1] / 60:.1f} min</text>')
    out.append("</svg>")
    open(dst, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
