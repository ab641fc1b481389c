#!/usr/bin/env bash
# Makes sure DIR holds the k3-scale model (real K3 widths, ~2.1 GB, never committed)
# byte for byte as recorded in tests/fixtures/k3-scale/scale.json ("model_files"):
# reuses DIR when every file's size and sha256 match, else regenerates it with the
# numpy-only generator (tools/make_tiny_k3.py --preset k3-scale --seed 1; ~30 s of
# CPU and ~200 MB of memory here) and checks again. No torch needed.
# Usage: tools/ensure_scale_model.sh DIR      Python: $SHOAL_PYTHON, else python3.
# Exit: 0 ready, 1 generation failed or bytes differ, 2 usage. Serialised by flock on DIR.lock.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${SHOAL_PYTHON:-python3}"
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
dir="$1"
fixture="$here/tests/fixtures/k3-scale/scale.json"
verify() {
    "$py" - "$fixture" "$dir" <<'PY'
import hashlib, json, os, sys
want = json.load(open(sys.argv[1]))["model_files"]
d = sys.argv[2]
bad = []
for fn, w in sorted(want.items()):
    p = os.path.join(d, fn)
    if not os.path.isfile(p) or os.path.getsize(p) != w["bytes"]:
        bad.append(fn); continue
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    if h.hexdigest() != w["sha256"]:
        bad.append(fn)
extra = sorted(set(os.listdir(d)) - set(want)) if os.path.isdir(d) else []
if bad or extra:
    print("ensure_scale_model: differs:", " ".join(bad + extra))
    sys.exit(1)
PY
}
# one generator at a time (the e2e test and the engine's scale test may run in parallel)
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -d "$dir" ] && verify >/dev/null 2>&1; then
    echo "ensure_scale_model: $dir verified"
    exit 0
fi
rm -rf "$dir" "$dir.tmp"
"$py" "$here/tools/make_tiny_k3.py" --preset k3-scale --seed 1 --out "$dir.tmp" \
    || { echo "ensure_scale_model: generation failed"; rm -rf "$dir.tmp"; exit 1; }
mv "$dir.tmp" "$dir"
verify || exit 1
echo "ensure_scale_model: $dir generated and verified"
