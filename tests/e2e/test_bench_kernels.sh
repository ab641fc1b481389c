#!/usr/bin/env bash
# `shoal bench kernels --json` smoke test: every row is one JSON object with the
# fields docs/PERFORMANCE.md relies on, ISA and threads included; then the rows of
# `shoal bench peak --json`. Checks the
# format only; figures are never asserted (STYLE habit 9).
set -uo pipefail
bin="${SHOAL_BIN:?}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
py="${SHOAL_PYTHON:-python3}"
[ -x "$py" ] || py=python3
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
if ! "$bin" bench kernels --quick --only router --threads 2 --json > "$out"; then
    printf 'FAIL\ttest_bench_kernels\trun: shoal bench kernels exited non-zero\n' >> "$res"; exit 1
fi
"$py" - "$out" "$res" <<'PY'
import json, sys
path, res = sys.argv[1:3]
rows = [json.loads(l) for l in open(path) if l.strip()]
need = {"op", "shape", "tokens", "threads", "isa", "gbps", "gbps_min", "gbps_max", "read_gbps", "ratio", "reps"}
ok = bool(rows) and all(need <= set(r) for r in rows)
ops = {r.get("op") for r in rows}
ok = ok and {"read_bw", "gemv_bf16"} <= ops and all(r["threads"] in (1, 2) for r in rows)
ok = ok and all(r["reps"] >= 5 and r["gbps_min"] <= r["gbps"] <= r["gbps_max"] for r in rows)
line = "PASS\ttest_bench_kernels\tjson_rows\n" if ok else "FAIL\ttest_bench_kernels\tjson_rows: %r\n" % rows[:3]
open(res, "a").write(line)
print(line.strip())
sys.exit(0 if ok else 1)
PY
rc1=$?
# `shoal bench peak --json`: one row per ceiling (available or not, AMX included)
# and the read pass on 1 thread; the format only, never the figures.
if ! "$bin" bench peak --json --reps 3 > "$out"; then
    printf 'FAIL\ttest_bench_kernels\tpeak: shoal bench peak exited non-zero\n' >> "$res"; exit 1
fi
"$py" - "$out" "$res" <<'PY'
import json, sys
path, res = sys.argv[1:3]
rows = [json.loads(l) for l in open(path) if l.strip()]
whats = [r.get("what") for r in rows]
ok = whats[:4] == ["fp32_fma", "bf16_dot", "int8_vnni", "amx_bf16"] and "read_pass" in whats
for r in rows[:4]:
    if r.get("available"):
        ok = ok and r["gmacs_min"] <= r["gmacs"] <= r["gmacs_max"] and r["gmacs"] > 0 and r["instr"] != "none"
    else:
        ok = ok and r.get("instr") == "none"
ok = ok and all(r["gbps"] > 0 for r in rows if r.get("what") == "read_pass")
line = "PASS\ttest_bench_kernels\tpeak_rows\n" if ok else "FAIL\ttest_bench_kernels\tpeak_rows: %r\n" % rows
open(res, "a").write(line)
print(line.strip())
sys.exit(0 if ok else 1)
PY
rc2=$?
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
