#!/usr/bin/env bash
# Records one round of `shoal bench kernels --json` at 1 and 2 threads into
# docs/data/kernels-<stamp>-t<N>.jsonl, each file headed by the commit, the
# machine (lscpu model), the command and the load average before and after.
# Not a test: figures go to docs/PERFORMANCE.md, never into assertions.
# Usage: tests/bench/kernels_bench.sh [STAMP] [extra bench args...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
stamp="${1:-$(date -u +%Y%m%dT%H%M%SZ)}"
shift || true
bin="$here/build/bin/shoal"
[ -x "$bin" ] || { echo "kernels_bench: build first ($bin missing)" >&2; exit 2; }
mkdir -p "$here/docs/data"
for t in 1 2; do
    out="$here/docs/data/kernels-$stamp-t$t.jsonl"
    {
        printf '{"meta":"commit","value":"%s"}\n' "$(git -C "$here" rev-parse HEAD)$(git -C "$here" diff --quiet || echo -dirty)"
        printf '{"meta":"machine","value":"%s, %s CPUs"}\n' "$(lscpu | sed -n 's/^Model name: *//p')" "$(nproc)"
        printf '{"meta":"command","value":"shoal bench kernels --threads %s --json %s"}\n' "$t" "$*"
        printf '{"meta":"load_before","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
        "$bin" bench kernels --threads "$t" --json "$@"
        printf '{"meta":"load_after","value":"%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
    } > "$out"
    echo "wrote $out"
done
