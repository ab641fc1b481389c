#!/usr/bin/env python3
"""Trunk memory ladder (issue 11; the coordinator's half of the memory ladder,
mem_ladder.py is the expert server's): one `shoal expert` owning every routed
expert (uncapped; its mapped bank, or --worker-slots N for its RAM-budgeted
cache), and `shoal run --worker --trunk-gb RUNG` at a series of trunk budgets,
each coordinator run inside its own cgroup v1 memory cap (the budget plus a
reserve for scratch, sequence state, libraries and page cache). Per rung:
prefill and decode seconds per token (with the per-step min/median/max),
trunk bytes read from disk per decoded token, seconds the forward waited for
reads, peak RSS (ru_maxrss and VmHWM) and the cgroup's max_usage_in_bytes;
the generated ids must be identical at every rung (exit 1 otherwise).

usage: trunk_ladder.py --model DIR --bin SHOAL --rungs small,5,6,large,mapped --out FILE.json
       [--ids 1,2,3] [--gen N] [--threads N] [--batch N] [--reserve-mb M] [--worker-slots N]
Rungs: small|medium|large|auto, a size in GiB, or 'mapped' (no --trunk-gb:
the mapped trunk, run uncapped). Needs root for /sys/fs/cgroup/memory (rungs
run uncapped, and say so, where no cgroup can be made)."""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def probe_plan(a):
    """minimum and fully resident trunk bytes, from the refusal of a tiny budget"""
    r = subprocess.run([a.bin, "run", "--model", a.model, "--ids", "1", "--gen", "1", "--batch", str(a.batch),
                        "--trunk-gb", "0.000000001"], capture_output=True, text=True, timeout=600)
    mn = re.search(r"needs at least (\d+) bytes", r.stderr)
    fu = re.search(r"fully resident needs (\d+) bytes", r.stderr)
    if not mn or not fu:
        sys.exit("cannot read the trunk plan from a refused run: " + r.stderr[-800:])
    return int(mn.group(1)), int(fu.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--rungs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ids", default="1000,2000,3000,4000")
    ap.add_argument("--gen", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reserve-mb", type=int, default=512)
    ap.add_argument("--worker-slots", type=int, default=0)
    a = ap.parse_args()
    c = json.load(open(os.path.join(a.model, "config.json")))
    t = c.get("text_config", c)
    L, E = t["num_hidden_layers"], t["num_experts"]
    moe = [l for l in range(L) if l >= t["first_k_dense_replace"] and l % t["moe_layer_freq"] == 0]
    tmin, tfull = probe_plan(a)
    print(f"trunk: minimum {tmin} bytes, fully resident {tfull} bytes", file=sys.stderr)

    ep = f"ipc://@shoal-trunk-ladder-{os.getpid()}"
    wlog = tempfile.TemporaryFile()
    wcmd = [a.bin, "expert", "--model", a.model, "--experts", f"{moe[0]}-{moe[-1]}:0-{E - 1}", "--listen", ep,
            "--threads", str(a.threads)]
    if a.worker_slots:
        wcmd += ["--cache-slots", str(a.worker_slots)]
    w = subprocess.Popen(wcmd, stdout=subprocess.DEVNULL, stderr=wlog)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300 and w.poll() is None:
        wlog.seek(0)
        if b"serving " in wlog.read():
            break
        time.sleep(0.2)
    else:
        wlog.seek(0)
        sys.exit("worker did not start: " + wlog.read().decode(errors="replace")[-800:])

    rows, ref, ok = [], None, True
    try:
        for rung in a.rungs.split(","):
            if rung == "mapped":
                budget = None
            elif rung == "small":
                budget = tmin
            elif rung == "medium":
                budget = tmin + (tfull - tmin) // 2
            elif rung == "large":
                budget = tfull
            elif rung == "auto":
                budget = None
            else:
                budget = min(int(float(rung) * 2**30), tfull)
            cmd = [a.bin, "run", "--model", a.model, "--worker", ep, "--ids", a.ids, "--gen", str(a.gen),
                   "--threads", str(a.threads), "--batch", str(a.batch), "--json"]
            if rung != "mapped":
                cmd += ["--trunk-gb", rung]
            cg, cap = None, None
            if budget is not None:
                cap = budget + (a.reserve_mb << 20)
                cg = f"/sys/fs/cgroup/memory/shoal-trunk-ladder-{os.getpid()}-{rung}"
                try:
                    os.mkdir(cg)
                    with open(f"{cg}/memory.limit_in_bytes", "w") as f:
                        f.write(str(cap))
                    cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'] + cmd
                except OSError as e:
                    print(f"rung {rung}: no cgroup ({e}); running uncapped", file=sys.stderr)
                    cg, cap = None, None
            row = {"rung": rung, "budget_bytes": budget, "cap_bytes": cap,
                   "loadavg_start": open("/proc/loadavg").read().strip()}
            t1 = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            row["wall_s"] = time.monotonic() - t1
            try:
                doc = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                doc = None
            if doc:
                steps = doc.get("decode_step_ms") or []
                tr = doc.get("trunk", {})
                row.update({
                    "generated_ids": doc["generated_ids"], "prefill_tokens": doc["prefill_tokens"],
                    "decode_tokens": doc["decode_tokens"], "prefill_s": doc["prefill_s"], "decode_s": doc["decode_s"],
                    "decode_s_per_token": doc["decode_s"] / max(1, doc["decode_tokens"]),
                    "decode_step_ms": steps,
                    "decode_step_ms_min": min(steps) if steps else None,
                    "decode_step_ms_median": statistics.median(steps) if steps else None,
                    "decode_step_ms_max": max(steps) if steps else None,
                    "trunk": tr,
                    "trunk_read_bytes_per_decoded_token": tr.get("decode_read_bytes_per_token"),
                    "trunk_stall_s_per_decoded_token": (tr.get("decode_stall_s", 0) / max(1, doc["decode_tokens"])
                                                        if tr else None),
                    "peak_rss_bytes": doc.get("peak_rss_bytes"), "peak_vmhwm_bytes": doc.get("peak_vmhwm_bytes"),
                })
                if cg:
                    try:
                        row["cgroup_max_usage_bytes"] = int(open(f"{cg}/memory.max_usage_in_bytes").read())
                        row["cgroup_failcnt"] = int(open(f"{cg}/memory.failcnt").read())
                    except OSError:
                        pass
                if ref is None:
                    ref = doc["generated_ids"]
                row["ids_match_first_rung"] = doc["generated_ids"] == ref
                ok &= row["ids_match_first_rung"]
            else:
                row["error"] = f"rc {r.returncode}: " + r.stderr[-1200:]
                ok = False
            m = re.search(r"trunk plan: .*", r.stderr)
            if m:
                row["plan_line"] = m.group(0)
            if cg:
                for _ in range(50):
                    try:
                        os.rmdir(cg)
                        break
                    except OSError:
                        time.sleep(0.2)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("generated_ids", "decode_step_ms", "trunk",
                                                                         "plan_line")}), flush=True)
    finally:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    out = {"model": a.model, "ids": a.ids, "gen": a.gen, "threads": a.threads, "batch": a.batch,
           "reserve_mb": a.reserve_mb, "worker_slots": a.worker_slots, "trunk_min_bytes": tmin,
           "trunk_full_bytes": tfull, "rows": rows, "ids_identical": ok,
           "loadavg_end": open("/proc/loadavg").read().strip()}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("ids identical at every rung" if ok else "MISMATCH or failure", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
