#!/usr/bin/env python3
"""The latency-aware relay schedule (coordinator/cluster/relaytree.h,
`--relay-fanout greedy`, PROTOCOL.md §3.9) against its Python statement
(tests/bench/k3_projection.py greedy_schedule, written from the rule as
docs/PERFORMANCE.md and relaytree.h document it, not from the C): over a grid
of server counts, x sizes, NIC and peer rates, hop latencies and subtree caps,
the C schedule (`test_relaytree --dump`) gives every server the same parent,
the same position among its parent's sends, the same root and the same
arrival time (within 1e-12 relative). Plus the cases that decide the VPS and
cloud classes of the projection. ~1 s."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import harness  # noqa: E402
from k3_projection import greedy_schedule, tree_arrival  # noqa: E402

T = "test_relaytree"
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build"))
EXE = os.path.join(BUILD, "tests", "test_relaytree")


def c_schedules(cases):
    """the C schedules of cases [(G, xb, nic, peer, hop, max_sub)], one run of `test_relaytree --dump`"""
    inp = "".join(f"{G} {xb!r} {nic!r} {peer!r} {hop!r} {cap}\n" for G, xb, nic, peer, hop, cap in cases)
    r = subprocess.run([EXE, "--dump"], input=inp, capture_output=True, text=True, timeout=60)
    out, cur = [], []
    for line in r.stdout.split("\n"):
        if line == "end":
            out.append(cur)
            cur = []
        elif line == "refused":
            cur = None
        elif line.strip():
            p, o, rt, a = line.split()
            cur.append((int(p), int(o), int(rt), float(a)))
    return out


def same(a, b):
    return len(a) == len(b) and all(x[:3] == y[:3] and abs(x[3] - y[3]) <= 1e-12 * max(abs(y[3]), 1e-30)
                                    for x, y in zip(a, b))


def main():
    if not os.path.exists(EXE):
        record("SKIP", "all", f"{EXE} not built")
        return 77
    cases = [(G, xb, nic, peer, hop, cap) for G in (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100)
             for xb in (80.0, 2320.0, 17.4e3, 6.9e6 / 397) for nic in (50e6 / 8, 1e9 / 8, 10e9 / 8)
             for peer in (100e6 / 8, 1e9 / 8, 25e9 / 8) for hop in (0.0, 20e-6, 0.35e-3) for cap in (64, 3)]
    got_all = c_schedules(cases)
    n, bad, trees, first_bad = len(cases), 0, 0, ""
    if len(got_all) != n:
        bad = n
        first_bad = f"{len(got_all)} schedules for {n} cases"
    for case, got in zip(cases, got_all):
        want = greedy_schedule(*case)
        trees += any(p >= 0 for p, _, _, _ in want)
        if got is None or not same(got, want):
            bad += 1
            first_bad = first_bad or f"{case}: C {got} vs Python {want}"
    check(f"the C schedule equals the Python statement of the rule in {n} cases ({trees} with a tree)",
          bad == 0 and trees > n // 4, f"{bad} differ; first: {first_bad[:1500]}")
    # the classes of tests/bench/k3_projection.py (mu: 6.9 MB of trunk inputs over 397 steps, hop = RTT/2 + 0.1 ms)
    xb = 6.9e6 / 397
    vps = greedy_schedule(16, xb, 1e9 / 8, 1e9 / 8, 0.35e-3)
    f4, _, _ = tree_arrival(16, 4, xb, 1e9 / 8, 1e9 / 8, lat=0.35e-3)
    last = max(a for _, _, _, a in vps)
    check(f"VPS class (1 Gb/s, hop 0.35 ms, G 16): the last server holds x at {last * 1e3:.3f} ms, before F = 4's "
          f"{max(f4) * 1e3:.3f} ms and all-direct's {16 * xb / (1e9 / 8) * 1e3:.3f} ms; the coordinator keeps "
          f"{sum(p < 0 for p, _, _, _ in vps)} direct sends",
          last < max(f4) and last < 16 * xb / (1e9 / 8) and 1 < sum(p < 0 for p, _, _, _ in vps) < 16)
    cloud = greedy_schedule(16, xb, 10e9 / 8, 10e9 / 8, 0.3e-3)
    check("cloud class (10 Gb/s, hop 0.3 ms, G 16): all direct", all(p < 0 for p, _, _, _ in cloud))
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
