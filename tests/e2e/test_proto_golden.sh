#!/usr/bin/env bash
# The protocol golden bytes are reproducible from the spec: regenerate
# tests/fixtures/proto/golden.json (tools/proto_golden.py, Python msgpack) and the
# fuzz seed corpus, and compare with the committed files.
set -uo pipefail
src="${SHOAL_SRC:?}"; py="${SHOAL_PYTHON:-python3}"
res="${SHOAL_TEST_RESULTS:-/dev/null}"
t=test_proto_golden
if ! "$py" -c 'import msgpack, numpy' 2>/dev/null; then
    printf 'SKIP\t%s\tregenerate: python msgpack/numpy not installed in %s\n' "$t" "$py" >> "$res"; exit 77
fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
fail=0
if "$py" "$src/tools/proto_golden.py" "$tmp/golden.json" && cmp -s "$tmp/golden.json" "$src/tests/fixtures/proto/golden.json"; then
    printf 'PASS\t%s\tgolden.json regenerates byte-identical\n' "$t" >> "$res"
else
    printf 'FAIL\t%s\tgolden.json differs from tools/proto_golden.py output\n' "$t" >> "$res"; fail=1
fi
exit $fail
