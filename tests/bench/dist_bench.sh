#!/usr/bin/env bash
# Distributed-experts benchmarks (docs/PERFORMANCE.md, "Distributed experts").
#   tests/bench/dist_bench.sh exchange [OUT]   per-layer exchange vs raw ZeroMQ round trip
#   tests/bench/dist_bench.sh decode MODEL [OUT]  decode s/token in-process vs 1, 2, 4 local workers
#   tests/bench/dist_bench.sh ab BASE [OUT] [ROUNDS]  the exchange configurations, each run with the
#       client of another commit (BASE/tests/bench_dist, BASE/commit) and with this build's back to
#       back (order alternating by round), so that before/after share the conditions; the expert
#       servers are this build's in both, or BASE's own in its runs when BASE/bin/shoal exists
# Writes the raw output with a header (commit, command, machine, load) to OUT
# (default docs/data/dist_<kind>_<date>.txt). Run without nice; other work on
# the machine is recorded as the load average before and after.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
kind="${1:?usage: dist_bench.sh exchange|decode ...}"
bin="$here/build/bin/shoal"
stamp="$(date -u +%Y%m%d)"
header() {
    echo "# commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!docs' || echo ' (+ uncommitted changes)')"
    echo "# date $(date -u +%FT%TZ)"
    echo "# command $0 $*"
    echo "# machine $(uname -srm); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(nproc) cores; $(free -g | awk '/Mem:/{print $2}') GiB"
    echo "# kernels isa: $("$bin" version 2>/dev/null | tr '\n' ' ')"
    echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
}
case "$kind" in
exchange)
    out="${2:-docs/data/dist_exchange_$stamp.txt}"
    work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
    {
        header "$@"
        for round in 1 2 3; do
            for tr in ipc tcp; do
                for w in 1 2 4; do
                    echo "## round $round transport $tr workers $w tokens 1 (decode), compute skipped"
                    SHOAL_SRC="$here" build/tests/bench_dist "$bin" "$work/m" --transport "$tr" --workers "$w" \
                        --reps 500 --tokens 1 --skip-compute | grep '^#'
                done
                echo "## round $round transport $tr workers 1 tokens 16 (prefill chunk), compute skipped"
                SHOAL_SRC="$here" build/tests/bench_dist "$bin" "$work/m" --transport "$tr" --workers 1 \
                    --reps 200 --tokens 16 --skip-compute | grep '^#'
            done
        done
        echo "## transport ipc workers 1 tokens 1, with the experts computed (width 32)"
        SHOAL_SRC="$here" build/tests/bench_dist "$bin" "$work/m" --transport ipc --workers 1 --reps 300 | grep '^#'
        echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    } | tee "$out"
    ;;
decode)
    model="${2:?usage: dist_bench.sh decode MODEL [OUT]}"
    out="${3:-docs/data/dist_decode_$stamp.txt}"
    ids="1000,2000,3000,4000,5000,6000,7000,8000,9000,10000,11000,12000,13000,14000,15000,16000"
    {
        header "$@"
        echo "# model $model: $(python3 -c "import json,sys;c=json.load(open(sys.argv[1]+'/config.json'));t=c.get('text_config',c);print('layers',t['num_hidden_layers'],'experts',t['num_experts'],'top',t['num_experts_per_token'],'hidden',t['hidden_size'],'latent',t['routed_expert_hidden_size'])" "$model")"
        "$bin" run --model "$model" --ids "$ids" --gen 2 --json >/dev/null 2>&1 # warm the page cache
        for round in 1 2; do
            for w in 0 1 2 4; do
                args=(); [ "$w" -gt 0 ] && args=(--workers "$w")
                echo "## round $round workers $w"
                "$bin" run --model "$model" --ids "$ids" --gen 9 --json "${args[@]}" 2>/dev/null | tail -1
            done
        done
        echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    } | tee "$out"
    ;;
ab)
    base="${2:?usage: dist_bench.sh ab BASE [OUT] [ROUNDS]}"
    out="${3:-docs/data/dist_exchange_ab_$stamp.txt}"
    rounds="${4:-5}"
    work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
    {
        header "$@"
        bbin="$bin"; [ -x "$base/bin/shoal" ] && bbin="$base/bin/shoal"
        echo "# base: $(cat "$base/commit" 2>/dev/null || echo "$base") (its bench_dist, i.e. its expert client; the workers are $([ "$bbin" = "$bin" ] && echo "this build's" || echo "its own, $bbin"))"
        for round in $(seq "$rounds"); do
            for cfg in "ipc 1 1 500" "ipc 2 1 500" "ipc 4 1 500" "tcp 1 1 500" "tcp 2 1 500" "tcp 4 1 500" \
                       "ipc 1 16 200" "tcp 1 16 200"; do
                read -r tr w t reps <<<"$cfg"
                order="base new"; [ $((round % 2)) -eq 0 ] && order="new base"
                for v in $order; do
                    bd="$here/build/tests/bench_dist" sb="$bin"; [ "$v" = base ] && bd="$base/tests/bench_dist" sb="$bbin"
                    echo "## round $round version $v transport $tr workers $w tokens $t, compute skipped"
                    SHOAL_SRC="$here" "$bd" "$sb" "$work/m" --transport "$tr" --workers "$w" --reps "$reps" \
                        --tokens "$t" --skip-compute 2>/dev/null | grep '^#'
                done
            done
            echo "# load after round $round: $(cut -d' ' -f1-3 /proc/loadavg)"
        done
    } | tee "$out"
    ;;
*) echo "usage: dist_bench.sh exchange|decode|ab ..." >&2; exit 2 ;;
esac
