#!/usr/bin/env bash
# `shoal inspect` against models written by an independent Python listing of
# SPEC §2 (tests/bench/gen_k3_layout.py, stdlib only, sparse zero data):
#   - the tiny nested (MXFP4) and flat (unquantized F32) fixture configs: inventory
#     OK, and the bytes per class equal the generator's own manifest;
#   - the full official K3 layout (497,220 tensors over 96 shards, ~130 MB of
#     headers on disk): inventory OK, 168 vision tensors counted and ignored;
#   - a model with one tensor dropped, one retyped and one reshaped: exit 3 and
#     all three listed.
set -uo pipefail
src="${SHOAL_SRC:?}"; bin="${SHOAL_BIN:?}"
py="${SHOAL_PYTHON:-python3}"; [ -x "$py" ] || py=python3
res="${SHOAL_TEST_RESULTS:-/dev/null}"
t=test_inspect_layout
gen="$src/tests/bench/gen_k3_layout.py"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
fail=0
pass() { printf 'PASS\t%s\t%s\n' "$t" "$1" >> "$res"; echo "PASS $1"; }
failc() { printf 'FAIL\t%s\t%s\n' "$t" "$1" >> "$res"; echo "FAIL $1"; fail=1; }

# compare inspect --json with manifest.json: inventory ok, class bytes, vision
check_manifest() { # name dir
    "$bin" inspect "$2" --json > "$tmp/$1.json" 2> "$tmp/$1.err"
    local rc=$?
    if [ $rc -ne 0 ]; then failc "$1: exit $rc: $(head -c 300 "$tmp/$1.err")"; return; fi
    if "$py" - "$tmp/$1.json" "$2/manifest.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); m = json.load(open(sys.argv[2]))
inv, b = r["inventory"], r["bytes"]
want_trunk = m["bytes"].get("trunk", 0) + m["bytes"].get("layer", 0)
errs = []
if not inv["ok"]: errs.append("inventory not ok: %s" % inv["problems"][:3])
if b["global"] != m["bytes"].get("trunk", 0): errs.append("global %d != %d" % (b["global"], m["bytes"].get("trunk", 0)))
if b["layers"] != m["bytes"].get("layer", 0): errs.append("layers %d != %d" % (b["layers"], m["bytes"].get("layer", 0)))
if b["trunk"] != want_trunk: errs.append("trunk")
if b["routed_experts"] != m["bytes"].get("expert", 0): errs.append("experts %d != %d" % (b["routed_experts"], m["bytes"].get("expert", 0)))
if inv["vision_tensors"] != m["count"].get("vision", 0): errs.append("vision count")
if inv["vision_bytes"] != m["bytes"].get("vision", 0): errs.append("vision bytes")
if inv["present"] != m["tensors"] - m["count"].get("vision", 0): errs.append("present")
if errs:
    print("; ".join(errs)); sys.exit(1)
PY
    then pass "$1: inventory ok, bytes per class match the generator's manifest"
    else failc "$1: inspect disagrees with the generator's manifest"; fi
}

"$py" "$gen" "$src/tests/fixtures/configs/tiny-nested.json" "$tmp/nested" --shards 2 --vision 2>/dev/null \
    && check_manifest tiny-nested "$tmp/nested" || failc "tiny-nested: generator failed"
"$py" "$gen" "$src/tests/fixtures/configs/tiny-flat.json" "$tmp/flat" --shards 1 2>/dev/null \
    && check_manifest tiny-flat "$tmp/flat" || failc "tiny-flat: generator failed"
"$py" "$gen" "$src/tests/fixtures/official/config.json" "$tmp/k3" --shards 96 --vision 2>/dev/null \
    && check_manifest official-k3-full-layout "$tmp/k3" || failc "official layout: generator failed"
rm -rf "$tmp/k3"

# every problem listed, exit 3
d=language_model.model.layers.
drop=${d}2.block_sparse_moe.experts.3.w3.weight_scale
retype=${d}0.self_attn.dt_bias
reshape=${d}4.self_attn.kv_b_proj.weight
if "$py" "$gen" "$src/tests/fixtures/configs/tiny-nested.json" "$tmp/bad" --shards 2 \
    --drop "$drop" --retype "$retype=BF16" --reshape "$reshape=64,31" 2>/dev/null; then
    "$bin" inspect "$tmp/bad" > "$tmp/bad.out" 2> "$tmp/bad.err"; rc=$?
    if [ $rc -eq 3 ] \
        && grep -qF "missing $drop (want U8 [64, 1])" "$tmp/bad.out" \
        && grep -qF "mismatch $retype: want F32 [32], have BF16 [32]" "$tmp/bad.out" \
        && grep -qF "mismatch $reshape: want BF16 [64, 32], have BF16 [64, 31]" "$tmp/bad.out" \
        && grep -qF "1 missing, 2 mismatched, 0 unexpected" "$tmp/bad.err"; then
        pass "mutated model: exit 3, dropped/retyped/reshaped tensors all listed"
    else
        failc "mutated model: exit $rc; $(head -c 400 "$tmp/bad.err")"
    fi
else
    failc "mutated: generator failed"
fi
exit $fail
