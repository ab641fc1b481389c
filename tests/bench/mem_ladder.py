#!/usr/bin/env python3
"""Memory ladder (issue 11): one `shoal expert` owning every routed expert of a
model, serving from its RAM-budgeted expert cache at a series of budgets, each
run inside its own cgroup v1 memory cap (slots x slot bytes + a reserve), and
a coordinator (`shoal run --worker`, not capped) generating the same tokens at
every rung. Per rung: prefill and decode seconds per token, disk bytes read
per processed token, hit rate, the worker's peak RSS and the cgroup's
max_usage_in_bytes; the generated ids must be identical at every rung (the
script says so and exits 1 otherwise). With --prefetch on,off each rung runs
once per setting (a fresh worker each time, so every run starts cold), and the
prefetch counters (hinted reads, prefetch hits, wasted, bytes) and the
coordinator's hint accuracy are recorded.

usage: mem_ladder.py --model DIR --bin SHOAL --slots 16,24,... --out FILE.json
       [--ids 1,2,3] [--gen N] [--threads N] [--policy lfu|lru] [--reserve-mb M] [--prefetch on,off]
Needs root for /sys/fs/cgroup/memory (rungs are run uncapped, and say so,
where no cgroup can be made)."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def metric(text, name):
    m = re.search(r"^%s\{[^}]*\} (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--slots", required=True, help="comma-separated slot counts; 'mapped' for the mapped bank")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ids", default="1000,2000,3000,4000")
    ap.add_argument("--gen", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default="lfu")
    ap.add_argument("--reserve-mb", type=int, default=320)
    ap.add_argument("--prefetch", default="", help="comma-separated on/off: run each rung with each setting")
    a = ap.parse_args()
    c = json.load(open(os.path.join(a.model, "config.json")))
    t = c.get("text_config", c)
    L, E = t["num_hidden_layers"], t["num_experts"]
    moe = [l for l in range(L) if l >= t["first_k_dense_replace"] and l % t["moe_layer_freq"] == 0]
    ranges = f"{moe[0]}-{moe[-1]}:0-{E - 1}"
    rows = []
    ref = None
    ok = True
    runs = [(r, p) for r in a.slots.split(",") for p in (a.prefetch.split(",") if a.prefetch else [""])
            if not (r == "mapped" and p == "on")]
    for rung, pf in runs:
        ep = f"ipc://@shoal-ladder-{os.getpid()}-{rung}-{pf}"
        port = free_port()
        cmd = [a.bin, "expert", "--model", a.model, "--experts", ranges, "--listen", ep, "--threads",
               str(a.threads), "--metrics-port", str(port)]
        if rung != "mapped":
            cmd += ["--cache-slots", rung, "--cache-policy", a.policy]
        cg = None
        cap = None
        log = tempfile.TemporaryFile()
        if rung != "mapped":
            # slot bytes: ask a worker that refuses (0 < minimum would be a usage error; use 1 slot)
            probe = subprocess.run([a.bin, "expert", "--model", a.model, "--experts", ranges, "--listen", ep,
                                    "--cache-slots", "1"], capture_output=True, text=True, timeout=120)
            m = re.search(r"slots of (\d+) bytes", probe.stderr)
            slot_bytes = int(m.group(1)) if m else 0
            cap = int(rung) * slot_bytes + (a.reserve_mb << 20)
            cg = f"/sys/fs/cgroup/memory/shoal-ladder-{os.getpid()}-{rung}-{pf}"
            try:
                os.mkdir(cg)
                with open(f"{cg}/memory.limit_in_bytes", "w") as f:
                    f.write(str(cap))
                cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"'] + cmd
            except OSError as e:
                print(f"rung {rung}: no cgroup ({e}); running uncapped", file=sys.stderr)
                cg, cap = None, None
        w = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        t0 = time.monotonic()
        up = False
        while time.monotonic() - t0 < 120 and w.poll() is None:
            log.seek(0)
            if b"serving " in log.read():
                up = True
                break
            time.sleep(0.1)
        row = {"rung": rung, "cap_bytes": cap, "policy": a.policy if rung != "mapped" else None,
               "prefetch": pf or None, "loadavg_start": open("/proc/loadavg").read().strip()}
        if up:
            r = subprocess.run([a.bin, "run", "--model", a.model, "--worker", ep, "--ids", a.ids, "--gen",
                                str(a.gen), "--threads", str(a.threads), "--json"] + (["--prefetch", pf] if pf else []),
                               capture_output=True, text=True, timeout=3600)
            try:
                doc = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                doc = None
            prom = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            if doc:
                ntok = doc["prefill_tokens"] + doc["decode_tokens"]
                hits = metric(prom, "shoal_expert_server_cache_hits_total") or 0
                miss = metric(prom, "shoal_expert_server_cache_misses_total") or 0
                row.update({
                    "generated_ids": doc["generated_ids"], "prefill_tokens": doc["prefill_tokens"],
                    "decode_tokens": doc["decode_tokens"], "prefill_s": doc["prefill_s"], "decode_s": doc["decode_s"],
                    "decode_s_per_token": doc["decode_s"] / max(1, doc["decode_tokens"]),
                    "decode_step_ms": doc.get("decode_step_ms"),
                    "cache_slots": metric(prom, "shoal_expert_server_cache_slots"),
                    "cache_bytes": metric(prom, "shoal_expert_server_cache_bytes"),
                    "hits": hits, "misses": miss, "hit_rate": hits / (hits + miss) if hits + miss else None,
                    "disk_read_bytes": metric(prom, "shoal_expert_server_disk_read_bytes_total"),
                    "disk_read_s": metric(prom, "shoal_expert_server_disk_read_seconds_total"),
                    "disk_bytes_per_token": (metric(prom, "shoal_expert_server_disk_read_bytes_total") or 0) / ntok,
                    "worker_rss_bytes": metric(prom, "shoal_expert_server_resident_bytes"),
                    "coordinator_peak_rss_bytes": doc.get("peak_rss_bytes"),
                    "prefetch_reads": metric(prom, "shoal_expert_server_prefetch_reads_total"),
                    "prefetch_hits": metric(prom, "shoal_expert_server_prefetch_hits_total"),
                    "prefetch_wasted": metric(prom, "shoal_expert_server_prefetch_wasted_total"),
                    "prefetch_read_bytes": metric(prom, "shoal_expert_server_prefetch_read_bytes_total"),
                    "prefetch_hints_accuracy": doc.get("prefetch_hints"),
                    "decode_phase_ms_per_token": doc.get("decode_phase_ms_per_token"),
                })
                fetches = hits + miss + (row["prefetch_hits"] or 0)
                row["resident_hit_rate"] = hits / fetches if fetches else None
                row["prefetch_hit_rate"] = (row["prefetch_hits"] or 0) / fetches if fetches else None
                row["all_disk_bytes_per_token"] = ((row["disk_read_bytes"] or 0) + (row["prefetch_read_bytes"] or 0)) / ntok
                if cg:
                    try:
                        row["cgroup_max_usage_bytes"] = int(open(f"{cg}/memory.max_usage_in_bytes").read())
                        row["cgroup_failcnt"] = int(open(f"{cg}/memory.failcnt").read())
                    except OSError:
                        pass
                if ref is None:
                    ref = doc["generated_ids"]
                row["ids_match_first_rung"] = doc["generated_ids"] == ref
                row["loadavg_end"] = open("/proc/loadavg").read().strip()
                ok &= row["ids_match_first_rung"]
            else:
                row["error"] = r.stderr[-800:]
                ok = False
        else:
            row["error"] = "worker did not start"
            ok = False
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
        m = re.search(r"peak resident memory ([\d.]+) (GiB|MiB)", text)
        if m:
            row["worker_peak_rss_bytes"] = int(float(m.group(1)) * (1 << (30 if m.group(2) == "GiB" else 20)))
        if "error" in row:
            row["worker_log"] = text[-1500:]
        if cg:
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except OSError:
                    time.sleep(0.2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("generated_ids", "decode_step_ms", "worker_log")}),
              flush=True)
    out = {"model": a.model, "ids": a.ids, "gen": a.gen, "threads": a.threads, "policy": a.policy,
           "reserve_mb": a.reserve_mb, "prefetch": a.prefetch, "rows": rows, "ids_identical": ok,
           "command": " ".join(sys.argv),
           "loadavg_end": open("/proc/loadavg").read().strip()}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("ids identical at every rung" if ok else "MISMATCH or failure", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
