#!/usr/bin/env python3
"""Benchmarks of `shoal pull` (issue 22; results in docs/PERFORMANCE.md, raw
data in docs/data/). Two parts:

  bytes   BYTES DOWNLOADED PER HOST for a 16-worker plan of the full Kimi K3
          layout (tests/bench/gen_k3_layout.py, sparse): tests/e2e/hubserver.py
          serves the layout, and `shoal pull --dry-run` on each worker (and the
          trunk) reads the real index and headers and counts the bytes it would
          download (the e2e test checks that --dry-run's count equals a real
          pull's). Compared with pack + copy: the whole checkpoint downloaded
          to one machine, then every pack copied out.
  speed   PULL THROUGHPUT against plain curl of the same ranges from the same
          local server: one worker's pack of MODEL pulled RUNS times (fresh
          directory each run), then the exact ranges it requested (read back
          from the server's /_stats) fetched by curl, in parallel (-Z, the same
          number in flight; also once with `sync -f` inside the timing, as
          durable as pull's fsynced pack) and one at a time, each range to a file.

usage: pull_bench.py bytes K3_LAYOUT_DIR OUT.json [--workers 16]
       pull_bench.py speed MODEL_DIR OUT.json [--workers 4] [--runs 3] [--parallel 8]

Each timed command's CPU (user + system of the child) is recorded with its wall time
and the load average around it: on a shared machine pull's hashing (BLAKE2b of every
piece for the resume log, then of every finished file for the manifest) competes for
the cores, curl's writes do not hash at all.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
HUB = os.path.join(SRC, "tests", "e2e", "hubserver.py")
REPO, REV = "bench/k3", "0" * 40


def loadavg():
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def child_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Hub:
    def __init__(self, root, tmp, *extra):
        pf = os.path.join(tmp, "hub.json")
        self.p = subprocess.Popen([sys.executable, HUB, "--repo", REPO, "--revision", REV, "--root", root,
                                   "--port-file", pf, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(400):
            if os.path.exists(pf):
                break
            time.sleep(0.05)
        j = json.load(open(pf))
        self.url = f"http://127.0.0.1:{j['port']}"
        self.cdn = f"http://127.0.0.1:{j['cdn_port']}"

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def stop(self):
        self.p.terminate()
        self.p.wait(10)


def cluster(tmp, n, ram):
    hosts = [{"name": "head", "address": "10.0.0.1", "ssh_user": "root", "cpus": 8, "expert_ram": 0}]
    for i in range(n):
        hosts.append({"name": f"w{i:02d}", "address": f"10.0.1.{i + 1}", "ssh_user": "root", "cpus": 16,
                      "expert_ram": ram})
    p = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(p, "w"))
    return p


def make_plan(model, tmp, n, ram):
    plan = os.path.join(tmp, "plan.json")
    subprocess.run([BIN, "plan", "--model", model, "--cluster", cluster(tmp, n, ram), "-o", plan], check=True,
                   capture_output=True)
    return plan, [w["name"] for w in json.load(open(plan))["workers"]]


def pull(hub, *args):
    r = subprocess.run([BIN, "pull", "--repo", REPO, "--revision", REV, "--endpoint", hub.url, *args, "--json"],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"pull failed: {r.stderr[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def part_bytes(a):
    tmp = tempfile.mkdtemp(prefix="pullbench-")
    try:
        plan, workers = make_plan(a.model, tmp, a.workers, "128GiB")
        hub = Hub(a.model, tmp, "--fast-etag")
        rows = []
        try:
            for w in workers + ["trunk"]:
                t0 = time.time()
                args = ["--trunk", "--plan", plan] if w == "trunk" else ["--plan", plan, "--worker", w]
                s = pull(hub, *args, "--to", os.path.join(tmp, "out-" + w), "--dry-run")
                s["wall_s"] = round(time.time() - t0, 2)
                rows.append(s)
                print(f"{w}: pack {s['pack_bytes'] / 2**30:.2f} GiB, download {(s['meta_bytes'] + s['range_bytes']) / 2**30:.2f} GiB"
                      f" in {s['range_requests']} ranges", file=sys.stderr)
        finally:
            hub.stop()
        idx = json.load(open(os.path.join(a.model, "model.safetensors.index.json")))["weight_map"]
        ckpt = sum(os.path.getsize(os.path.join(a.model, f)) for f in set(idx.values())) + sum(
            os.path.getsize(os.path.join(a.model, f)) for f in ("config.json", "model.safetensors.index.json"))
        packs = sum(r["pack_bytes"] for r in rows)
        pulled = sum(r["meta_bytes"] + r["range_bytes"] for r in rows)
        out = {"what": "bytes downloaded per host: shoal pull --dry-run per worker vs pack + copy",
               "model": os.path.abspath(a.model), "workers": a.workers, "checkpoint_bytes": ckpt,
               "packs_bytes": packs, "pack_and_copy": {"download_to_pack_host": ckpt, "copied_to_hosts": packs,
                                                       "network_total": ckpt + packs,
                                                       "pack_host_disk": ckpt + packs},
               "pull": {"network_total": pulled, "largest_host": max(r["meta_bytes"] + r["range_bytes"]
                                                                     for r in rows)},
               "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        json.dump(out, open(a.out, "w"), indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def part_speed(a):
    tmp = tempfile.mkdtemp(prefix="pullbench-", dir=a.tmp)
    try:
        plan, workers = make_plan(a.model, tmp, a.workers, "64GiB")
        w = workers[0]
        hub = Hub(a.model, tmp)
        res = {"pull": [], "curl_parallel": [], "curl_parallel_sync": [], "curl_serial": []}
        ranges = None
        try:
            # warm-up, untimed: the test server hashes each shard once for its X-Linked-Etag
            pull(hub, "--plan", plan, "--worker", w, "--to", os.path.join(tmp, "warm"), "--dry-run")
            for run in range(a.runs):
                d = os.path.join(tmp, f"pull-{run}")
                hub.get("/_reset")
                la = loadavg()
                c0 = child_cpu()
                t0 = time.time()
                s = pull(hub, "--plan", plan, "--worker", w, "--to", d, "--parallel", str(a.parallel))
                dt = time.time() - t0
                cpu = child_cpu() - c0
                st = hub.get("/_stats")
                ranges = st["ranges"]
                res["pull"].append({"seconds": dt, "cpu_s": cpu, "bytes": s["downloaded"], "requests": s["requests"],
                                    "load_before": la, "load_after": loadavg()})
                shutil.rmtree(d)
                # the same ranges with curl: from the CDN URLs pull went to (no redirect, as pull after its first)
                for mode in ("curl_parallel", "curl_parallel_sync", "curl_serial"):
                    cd = os.path.join(tmp, "curl")
                    os.makedirs(cd, exist_ok=True)
                    cfg = os.path.join(tmp, "curl.cfg")
                    with open(cfg, "w") as f:
                        for i, (fn, off, n) in enumerate(ranges):
                            sha = "0" * 64  # the test CDN serves any digest path; the ETag is not checked here
                            f.write(f'url = "{hub.cdn}/cdn/{sha}/{fn}"\nrange = "{off}-{off + n - 1}"\n'
                                    f'output = "{cd}/{i}"\n')
                            if i + 1 < len(ranges):
                                f.write("next\n")
                    la = loadavg()
                    c0 = child_cpu()
                    t0 = time.time()
                    cmd = ["curl", "-s", "-f", "-K", cfg]
                    if mode != "curl_serial":
                        cmd[1:1] = ["-Z", "--parallel-max", str(a.parallel)]
                    subprocess.run(cmd, check=True)
                    if mode == "curl_parallel_sync":  # as durable as pull's pack: flushed to the disk
                        subprocess.run(["sync", "-f", cd], check=True)
                    dt = time.time() - t0
                    cpu = child_cpu() - c0
                    got = sum(os.path.getsize(os.path.join(cd, x)) for x in os.listdir(cd))
                    res[mode].append({"seconds": dt, "cpu_s": cpu, "bytes": got, "requests": len(ranges),
                                      "load_before": la, "load_after": loadavg()})
                    shutil.rmtree(cd)
                print(f"run {run}: " + ", ".join(f"{k} {v[-1]['bytes'] / v[-1]['seconds'] / 2**20:.0f} MiB/s"
                                                 for k, v in res.items()), file=sys.stderr)
        finally:
            hub.stop()
        summ = {}
        for k, v in res.items():
            rates = [x["bytes"] / x["seconds"] / 2**20 for x in v]
            cpu = [x["cpu_s"] / (x["bytes"] / 2**30) for x in v]
            summ[k] = {"median_MiB_s": statistics.median(rates), "min_MiB_s": min(rates), "max_MiB_s": max(rates),
                       "median_cpu_s_per_GiB": statistics.median(cpu)}
        out = {"what": "pull throughput vs curl of the same ranges, local hubserver.py", "model": a.model,
               "worker": w, "workers_in_plan": a.workers, "parallel": a.parallel, 
               "runs": res, "summary": summ,
               "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "curl": subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.splitlines()[0]}
        json.dump(out, open(a.out, "w"), indent=1)
        print(json.dumps(summ, indent=1), file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["bytes", "speed"])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--tmp", default=None)
    a = ap.parse_args()
    if a.part == "bytes":
        a.workers = a.workers or 16
        part_bytes(a)
    else:
        a.workers = a.workers or 4
        part_speed(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
