#!/usr/bin/env bash
# Speculative decoding on the k3-slice (real K3 widths and vocabulary): the
# generated ids and every step's logits (--dump-logits, cmp) with drafting equal
# --draft off's, for --draft-ids with an error planted every 3rd token (K 4) and
# with the plain ids (K 8: nearly every draft accepted), greedy; one JSON report
# per run to stdout (decode_s, draft stats). Usage: spec_k3slice_identity.sh MODEL BUILD GEN
set -euo pipefail
model=$1 build=$2 gen=${3:-10}
tmp=$(mktemp -d)
P=1000,7919,2838,10757,3676,11595,4514,12433,5352,13271,6190,14109,7028,14947,7866,15785
run() { nice "$build/bin/shoal" run --model "$model" --ids "$P" --gen "$gen" --threads 2 --json "$@"; }
echo "# commit $(git rev-parse HEAD) $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) $(nproc) cpus"
run --draft off --dump-logits "$tmp/off.f32" > "$tmp/off.json"
cat "$tmp/off.json"
ref=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['generated_ids'])))" "$tmp/off.json")
planted=$(python3 -c "
import sys; r=[int(x) for x in sys.argv[2].split(',')]
print(','.join(sys.argv[1].split(',') + [str((t+1)%3840 if i%3==2 else t) for i,t in enumerate(r)]))" "$P" "$ref")
echo "# load $(cut -d' ' -f1-3 /proc/loadavg)"
run --draft-ids "$planted" --draft-max 4 --dump-logits "$tmp/k4.f32" > "$tmp/k4.json"; cat "$tmp/k4.json"
echo "# load $(cut -d' ' -f1-3 /proc/loadavg)"
run --draft-ids "$P,$ref" --draft-max 8 --dump-logits "$tmp/k8.f32" > "$tmp/k8.json"; cat "$tmp/k8.json"
echo "# load $(cut -d' ' -f1-3 /proc/loadavg)"
for v in k4 k8; do
  same_ids=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['generated_ids']==json.load(open(sys.argv[2]))['generated_ids'])" "$tmp/off.json" "$tmp/$v.json")
  if cmp -s "$tmp/off.f32" "$tmp/$v.f32"; then lg=identical; else lg=DIFFERENT; fi
  echo "# $v: ids identical: $same_ids; logits ($(stat -c %s "$tmp/off.f32") bytes): $lg"
done
rm -rf "$tmp"
