#!/usr/bin/env python3
"""`shoal pull` end to end against tests/e2e/hubserver.py, a real HTTP server
speaking the Hugging Face hub's layout (resolve URLs redirected to a "CDN" on
a second port, Range/206/416, ETag, bearer-token auth), serving
tests/models/tiny-k3 (issue 22):

- every worker of a 3-worker plan pulls its pack: byte for byte the pack
  `shoal pack` writes from the local model; every range the worker asked
  for lies inside its own experts' tensors (or a shard header), checked by
  parsing the shards here; the token never reached the CDN;
- 3 workers serving the pulled packs (--verify) and a coordinator on the
  pulled trunk pack generate the in-process ids;
- a rerun downloads only headers and keeps every file; a pull whose server
  is killed mid-file fails, and the rerun (fresh server) fetches only what is
  missing and ends identical;
- faults: flipped bytes (caught by the response's Content-Digest), truncated
  bodies, 503/429, a wrong Content-Range, a 403 from a remembered CDN URL
  (an expired signature) are retried and the pack ends
  identical; a server ignoring Range is refused naming it, as is a flip
  with retries exhausted (no manifest written);
- a wrong or missing token is a clear 401 message (the token not printed);
  pins refuse a config.json whose sha256 differs; the shipped K3 pin file
  equals the sha256 of ../shared/k3's official files; --config-only gives a
  header-only model from which `shoal plan` makes the same plan; --dry-run
  counts exactly the bytes the real pull downloads.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_pull"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
PY = sys.executable
HUB = os.path.join(SRC, "tests", "e2e", "hubserver.py")
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
K3 = os.path.join(SRC, "..", "shared", "k3")
PROMPT = "3,17,250,1001,42,7,99,512,4000,1"
REPO, REV, TOKEN = "acme/tiny-k3", "0123456789abcdef0123456789abcdef01234567", "hf_testtoken_5f3a9c"

R = harness.Recorder(T)
record, check = R.record, R.check


def sh(*args, env=None, timeout=120):
    e = dict(os.environ)
    e.pop("HF_TOKEN", None)
    e.update(env or {})
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout, env=e)


class Hub:
    def __init__(self, tmp, *extra):
        pf = os.path.join(tmp, f"hub-{time.monotonic_ns()}.json")
        self.log = harness.logfile()
        self.p = subprocess.Popen([PY, HUB, "--repo", REPO, "--revision", REV, "--root", TINY, "--cdn-port", "0",
                                   "--token", TOKEN, "--port-file", pf, *extra], stdout=self.log, stderr=self.log)
        for _ in range(200):
            if os.path.exists(pf):
                break
            time.sleep(0.05)
        ports = json.load(open(pf))
        self.url = f"http://127.0.0.1:{ports['port']}"

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def fault(self, mode, count=1, **kw):
        q = "&".join([f"mode={mode}", f"count={count}"] + [f"{k}={v}" for k, v in kw.items()])
        self.get("/_control?" + q)

    def stop(self, sig=signal.SIGTERM):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            self.p.wait(10)


def pull(hub, *args, token=TOKEN, timeout=120):
    env = {"HF_TOKEN": token} if token else {}
    return sh("pull", "--repo", REPO, "--revision", REV, "--endpoint", hub.url, *args, env=env, timeout=timeout)


def summary(r):
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:
        return None


def same_tree(a, b):
    """Both directories hold the same files with the same bytes (the pull's
    work directory, if left, does not count)."""
    fa = sorted(f for f in os.listdir(a) if not f.startswith("."))
    fb = sorted(f for f in os.listdir(b) if not f.startswith("."))
    if fa != fb:
        return False, f"files differ: {sorted(set(fa) ^ set(fb))}"
    for f in fa:
        if open(os.path.join(a, f), "rb").read() != open(os.path.join(b, f), "rb").read():
            return False, f"{f} differs"
    return True, ""


def shard_layout(model):
    """file -> (header end, {tensor: (start, end)}) with absolute offsets, parsed here"""
    idx = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        with open(os.path.join(model, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        out[fn] = (8 + n, {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                           for k, v in h.items() if k != "__metadata__"})
    return out


def parse_ranges(s):
    cells = set()
    for g in s.split(","):
        ls, es = g.split(":")
        la, lb = ls.split("-") if "-" in ls else (ls, ls)
        ea, eb = es.split("-") if "-" in es else (es, es)
        for l in range(int(la), int(lb) + 1):
            for e in range(int(ea), int(eb) + 1):
                cells.add((l, e))
    return cells


def run_ids(*args, model=TINY):
    r = subprocess.run([BIN, "run", "--model", model, "--json", "--ids", PROMPT, "--gen", "6", *args],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["generated_ids"], r
    except Exception:
        return None, r


def hostile_hub(hub, tmp, plan, w, ref):
    """issue 30 items 8, 9, 11: a hub that lies about lengths and ranges, redirects to ftp://, is slow"""
    cfg = open(os.path.join(TINY, "config.json"), "rb").read()
    # a small file shorter than its Content-Length (a chunked body, properly ended, overriding it):
    # retried; on every try: refused naming the file, nothing kept
    d = os.path.join(tmp, "hostile-short-once")
    hub.get("/_reset")
    hub.fault("chunked_short", 1, target="hub", file="config.json")
    r = pull(hub, "--config-only", "--to", d, "--retries", "2", "--backoff", "0.05")
    check("hostile hub: config.json shorter than its Content-Length is retried, the file kept is whole",
          r.returncode == 0 and "config.json: the body is" in r.stderr and "Content-Length" in r.stderr and
          open(os.path.join(d, "config.json"), "rb").read() == cfg, f"rc {r.returncode}: {r.stderr[-300:]}")
    for f in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        d = os.path.join(tmp, "hostile-short-" + f)
        hub.get("/_reset")
        hub.fault("chunked_short", -1, target="hub", file=f)
        r = pull(hub, "--config-only", "--to", d, "--retries", "1", "--backoff", "0.05")
        check(f"hostile hub: {f} always short: exit 4 naming it and its Content-Length, no {f} kept",
              r.returncode == 4 and f + ": the body is" in r.stderr and "Content-Length says" in r.stderr and
              not os.path.exists(os.path.join(d, f)), f"rc {r.returncode}: {r.stderr[-300:]}")
    # a well-formed response shorter than the file (both lengths agree): only a pin can tell
    d = os.path.join(tmp, "hostile-short-pinned")
    pin = os.path.join(tmp, "hostile-pin.json")
    json.dump({"format": "shoal-pin", "repo": REPO, "revision": REV,
               "files": {"config.json": {"bytes": len(cfg), "sha256": hashlib.sha256(cfg).hexdigest()}}},
              open(pin, "w"))
    hub.get("/_reset")
    hub.fault("short_length", -1, target="hub", file="config.json")
    r = pull(hub, "--config-only", "--to", d, "--pin", pin)
    check("hostile hub: a consistently short config.json is refused by its pin (exit 3), not kept",
          r.returncode == 3 and "the pin says" in r.stderr and not os.path.exists(os.path.join(d, "config.json")),
          f"rc {r.returncode}: {r.stderr[-300:]}")
    # redirects to another protocol: refused at once, never followed, never retried
    for target, what in (("hub", "config.json"), ("cdn", "a shard range")):
        d = os.path.join(tmp, "hostile-ftp-" + target)
        hub.get("/_reset")
        hub.fault("redirect", -1, target=target, location="ftp://127.0.0.1:1/x")
        t0 = time.monotonic()
        args = ("--config-only",) if target == "hub" else ("--plan", plan, "--worker", w)
        r = pull(hub, *args, "--to", d)
        dt = time.monotonic() - t0
        check(f"hostile hub: a redirect of {what} to ftp:// is refused at once (exit 4 in {dt:.1f} s, no retry)",
              r.returncode == 4 and "ftp://127.0.0.1:1/x" in r.stderr and "not http:// or https://" in r.stderr
              and "retry" not in r.stderr and dt < 10, f"rc {r.returncode} in {dt:.1f} s: {r.stderr[-300:]}")
    # lying ranges: a 206 whose Content-Length (and body) is short of the Content-Range it names
    d = os.path.join(tmp, "hostile-range-short")
    hub.get("/_reset")
    hub.fault("short_length", 2)
    r = pull(hub, "--plan", plan, "--worker", w, "--to", d, "--retries", "4", "--backoff", "0.05")
    same, why = same_tree(d, ref) if r.returncode == 0 else (False, "")
    check("hostile hub: a range body short of its Content-Range is retried, the pack identical",
          r.returncode == 0 and same and r.stderr.count("pull: retry ") >= 2, f"{why} rc {r.returncode}: "
          f"{r.stderr[-300:]}")
    # a slow small file (2 KB/s): waited for, whole
    d = os.path.join(tmp, "hostile-slow")
    hub.get("/_reset")
    hub.fault("slow", 1, target="hub", file="config.json", rate=4000)
    t0 = time.monotonic()
    r = pull(hub, "--config-only", "--to", d)
    check(f"hostile hub: a slow config.json (4 KB/s) is waited for and kept whole ({time.monotonic() - t0:.1f} s)",
          r.returncode == 0 and open(os.path.join(d, "config.json"), "rb").read() == cfg,
          f"rc {r.returncode}: {r.stderr[-300:]}")
    hub.get("/_reset")
    r = sh("pull", "--repo", REPO, "--revision", REV, "--endpoint", "ftp://x", "--config-only", "--to",
           os.path.join(tmp, "hostile-ftp-endpoint"))
    check("--endpoint ftp://x is a usage error (exit 2) naming it", r.returncode == 2 and "ftp://x" in r.stderr,
          f"rc {r.returncode}: {r.stderr[-300:]}")


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-pull-")
    hosts = [{"name": "head", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1, "expert_ram": 0}]
    for i in range(3):
        hosts.append({"name": f"w{i}", "address": "127.0.0.1", "ssh_user": "root", "cpus": 1,
                      "expert_ram": "1MiB", "port": harness.free_port()})
    cl = os.path.join(tmp, "cluster.json")
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "head", "worker_port": 5555,
               "hosts": hosts}, open(cl, "w"))
    plan = os.path.join(tmp, "plan.json")
    r = sh("plan", "--model", TINY, "--cluster", cl, "-o", plan)
    if not check("plan", r.returncode == 0, r.stderr[-400:]):
        return 1
    workers = [w["name"] for w in json.load(open(plan))["workers"]]
    experts = {w["name"]: w["experts"] for w in json.load(open(plan))["workers"]}
    hub = Hub(tmp, "--digest")
    procs = []
    try:
        layout = shard_layout(TINY)
        packs, ref_packs, fresh = {}, {}, {}
        meta = sum(h for h, _ in layout.values()) + sum(os.path.getsize(os.path.join(TINY, f)) for f in
                                                        ("config.json", "model.safetensors.index.json"))
        for w in workers:
            ref = os.path.join(tmp, "pack-" + w)
            r = sh("pack", "--model", TINY, "--plan", plan, "--worker", w, "-o", ref, "--quiet")
            check(f"reference pack {w}", r.returncode == 0, r.stderr[-300:])
            ref_packs[w] = ref
            hub.get("/_reset")
            d = os.path.join(tmp, "pull-" + w)
            r = pull(hub, "--plan", plan, "--worker", w, "--to", d, *(["--json"] if w != workers[0] else []))
            ok = check(f"pull {w}: exit 0", r.returncode == 0, r.stderr[-500:])
            if w != workers[0]:
                fresh[w] = (summary(r) or {}).get("downloaded")
            if ok and w == workers[0]:
                check(f"pull {w}: progress lines with bytes, rate and ETA (not a terminal)",
                      "GiB" in r.stderr and "MiB/s" in r.stderr and "ETA" in r.stderr, r.stderr[-300:])
            same, why = same_tree(d, ref)
            check(f"pull {w}: the pack is byte for byte `shoal pack`'s", ok and same, why)
            check(f"pull {w}: no work files left", ok and not any(f.startswith(".") or f.endswith((".part", ".log"))
                                                                  for f in os.listdir(d)), str(os.listdir(d)))
            st = hub.get("/_stats")
            own = parse_ranges(experts[w])
            bad = []
            for fn, a, n in st["ranges"]:
                hend, tens = layout[fn]
                if a + n <= hend:
                    continue  # a header read
                inside = [k for k, (s, e) in tens.items() if s <= a and a + n <= e or (a <= s and e <= a + n)]
                if not inside:
                    bad.append((fn, a, n))
                for k in inside:
                    if not any(k.startswith(f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.")
                               for (l, e) in own):
                        bad.append((fn, a, n, k))
            check(f"pull {w}: every range asked for is a header or one of its own experts' tensors",
                  ok and not bad and st["range_requests"] > 0, str(bad[:3]))
            check(f"pull {w}: the token never went to the CDN (a redirect to another host:port)",
                  st["cdn_auth"] == 0 and st["cdn_requests"] > 0, json.dumps({k: st[k] for k in st if k != "ranges"}))
            packs[w] = d
        d = os.path.join(tmp, "pull-dry")
        r = pull(hub, "--plan", plan, "--worker", workers[2], "--to", d, "--dry-run")
        s = summary(r)
        check("--dry-run: exactly the bytes the real pull downloaded (headers + ranges), nothing written",
              r.returncode == 0 and s and s["meta_bytes"] == meta and s["meta_bytes"] + s["range_bytes"] ==
              fresh[workers[2]] and not os.listdir(d), f"{s} vs {fresh[workers[2]]}: {r.stderr[-300:]}")
        trunk_ref = os.path.join(tmp, "pack-trunk")
        sh("pack", "--model", TINY, "--trunk", "--plan", plan, "-o", trunk_ref, "--quiet")
        trunk = os.path.join(tmp, "pull-trunk")
        r = pull(hub, "--trunk", "--plan", plan, "--to", trunk, "--json")
        same, why = same_tree(trunk, trunk_ref)
        check("pull --trunk: byte for byte `shoal pack --trunk`'s (tokenizer files included)",
              r.returncode == 0 and same and os.path.exists(os.path.join(trunk, "tiktoken.model")),
              why + r.stderr[-300:])

        # the cluster on pulled packs
        ref, rr = run_ids()
        keys = os.path.join(tmp, "keys")
        os.mkdir(keys)
        for n in ["coordinator"] + workers:
            sh("keygen", "-o", os.path.join(keys, n))
        if check("in-process reference", ref is not None, rr.stderr[-400:]):
            for w in workers:
                log = harness.logfile()
                p = subprocess.Popen([BIN, "expert", "--model", packs[w], "--verify", "--plan", plan, "--name", w,
                                      "--threads", "1", "--curve-secret", os.path.join(keys, w + ".key"),
                                      "--curve-allow", os.path.join(keys, "coordinator.pub")],
                                     stdout=subprocess.DEVNULL, stderr=log)
                p.log = log
                procs.append(p)
            got, rr = run_ids("--plan", plan, "--curve-secret", os.path.join(keys, "coordinator.key"),
                              "--curve-keys", keys, model=trunk)
            check("3 workers on pulled packs (--verify) + coordinator on the pulled trunk: ids identical to "
                  "in-process", got == ref, f"got {got} want {ref}: {rr.stderr[-600:]}")
            for p in procs:
                rc = harness.terminate(p)
                p.log.seek(0)
                check("pulled-pack worker exits 0 on SIGTERM", rc == 0, p.log.read().decode()[-300:])
            procs.clear()

        # rerun: headers only, every file kept
        w0 = workers[0]
        d = packs[w0]
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        mt = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in files}
        hub.get("/_reset")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d, "--json")
        s = summary(r)
        check("rerun: nothing but the index, config and shard headers downloaded; every file kept",
              r.returncode == 0 and s and s["downloaded"] == meta and s["kept"] > 0 and
              all(os.stat(os.path.join(d, f)).st_mtime_ns == mt[f] for f in files), r.stdout + r.stderr[-300:])

        # interrupted: the server is killed mid-file; the rerun fetches only the rest
        w1 = workers[1]
        d = os.path.join(tmp, "pull-killed")
        hub.fault("slow", -1, rate=100000)
        p = subprocess.Popen([BIN, "pull", "--repo", REPO, "--revision", REV, "--endpoint", hub.url, "--plan", plan,
                              "--worker", w1, "--to", d, "--retries", "1", "--backoff", "0.1", "--parallel", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, HF_TOKEN=TOKEN))
        def mid_file():  # pieces of a layer file verified and logged, the rest still coming (100 kB/s)
            if not os.path.isdir(d):
                return False
            for f in os.listdir(d):  # the log's first line names the source; each further line is a piece
                if f.endswith(".part.log"):
                    with open(os.path.join(d, f)) as lf:
                        if len(lf.read().splitlines()) >= 2:
                            return True
            return False
        check("server killed mid-file: pieces of a layer file were logged first", harness.poll(mid_file, 60, 0.02))
        hub.stop(signal.SIGKILL)
        out, errs = p.communicate(timeout=60)
        check("server killed mid-file: the pull fails (exit 4) naming the transfer error",
              p.returncode == 4 and "giving up" in errs and not os.path.exists(os.path.join(d, "shoal-pack.json")),
              f"rc {p.returncode}: {errs[-400:]}")
        parts = [f for f in os.listdir(d) if f.endswith(".part.log")] if os.path.isdir(d) else []
        hub = Hub(tmp, "--digest")
        r = pull(hub, "--plan", plan, "--worker", w1, "--to", d, "--json")
        s = summary(r)
        same, why = same_tree(d, ref_packs[w1])
        check("resumed pull: the logged pieces verified and kept, exactly the rest downloaded, pack identical",
              r.returncode == 0 and same and s and s["kept"] > 0 and s["downloaded"] + s["kept"] == fresh[w1] and
              parts,
              f"{why} {s} logs {parts}: {r.stderr[-300:]}")

        # faults that are retried: the pack still ends identical
        w2 = workers[2]
        for mode, kw, n in [("flip", {}, 3), ("truncate", {}, 3), ("error", {"code": 503}, 3),
                            ("error", {"code": 429}, 2), ("bad_range", {}, 2),
                            # an expired CDN URL (past the 2 header reads per shard): asked of the hub again
                            ("error", {"code": 403, "skip": 2 * len(layout)}, 1)]:
            d = os.path.join(tmp, f"pull-{mode}-{kw.get('code', '')}")
            hub.get("/_reset")
            hub.fault(mode, n, **kw)
            r = pull(hub, "--plan", plan, "--worker", w2, "--to", d, "--json", "--retries", "4", "--backoff", "0.05")
            s = summary(r)
            same, why = same_tree(d, ref_packs[w2]) if r.returncode == 0 else (False, "")
            st = hub.get("/_stats")
            check(f"fault {mode}{kw.get('code', '')} x{n}: caught, re-fetched (a line per retry), pack identical",
                  r.returncode == 0 and same and s and s["retried"] >= n and st["faults"] == n and
                  r.stderr.count("pull: retry ") == s["retried"],
                  f"{why} {s} faults {st['faults']}: {r.stderr[-300:]}")
        d = os.path.join(tmp, "pull-flip-fatal")
        hub.fault("flip", -1)
        r = pull(hub, "--plan", plan, "--worker", w2, "--to", d, "--retries", "1", "--backoff", "0.05")
        check("flipped bytes on every try: refused (exit 4, Content-Digest named), no manifest written",
              r.returncode == 4 and "Content-Digest" in r.stderr and
              not os.path.exists(os.path.join(d, "shoal-pack.json")), f"rc {r.returncode}: {r.stderr[-300:]}")
        d = os.path.join(tmp, "pull-norange")
        hub.get("/_reset")
        hub.fault("ignore_range", -1)
        r = pull(hub, "--plan", plan, "--worker", w2, "--to", d)
        check("a server ignoring Range (200, whole file) is refused naming it, no manifest",
              r.returncode == 4 and "ignores HTTP Range" in r.stderr and
              not os.path.exists(os.path.join(d, "shoal-pack.json")), f"rc {r.returncode}: {r.stderr[-300:]}")
        hub.get("/_reset")

        # auth
        d = os.path.join(tmp, "pull-auth")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d, token="hf_wrong_token_123")
        check("wrong token: exit 4, a clear 401 message, the token not printed",
              r.returncode == 4 and "401 Unauthorized" in r.stderr and "refused the token" in r.stderr and
              "hf_wrong_token_123" not in r.stderr + r.stdout, f"rc {r.returncode}: {r.stderr[-300:]}")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d, token=None)
        check("no token: the 401 says to set HF_TOKEN or --token-file",
              r.returncode == 4 and "401" in r.stderr and "HF_TOKEN" in r.stderr, f"rc {r.returncode}: {r.stderr[-300:]}")
        tf = os.path.join(tmp, "token")
        open(tf, "w").write(TOKEN + "\n")
        d2 = os.path.join(tmp, "pull-tokfile")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d2, "--token-file", tf, token=None)
        check("--token-file works", r.returncode == 0 and same_tree(d2, ref_packs[w0])[0], r.stderr[-300:])
        r = sh("pull", "--repo", REPO, "--revision", "nosuchrev", "--endpoint", hub.url, "--plan", plan,
               "--worker", w0, "--to", d, env={"HF_TOKEN": TOKEN})
        check("unknown revision: 404 naming the URL", r.returncode == 4 and "404 Not Found" in r.stderr and
              "nosuchrev" in r.stderr, f"rc {r.returncode}: {r.stderr[-300:]}")

        # pins
        cfg = open(os.path.join(TINY, "config.json"), "rb").read()
        good = {"format": "shoal-pin", "version": 1, "repo": REPO, "revision": REV,
                "files": {"config.json": {"bytes": len(cfg), "sha256": hashlib.sha256(cfg).hexdigest()}}}
        pin = os.path.join(tmp, "pin.json")
        json.dump(good, open(pin, "w"))
        d = os.path.join(tmp, "pull-pin")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d, "--pin", pin)
        check("--pin with the right sha256: pulled", r.returncode == 0, r.stderr[-300:])
        good["files"]["config.json"]["sha256"] = "0" * 64
        json.dump(good, open(pin, "w"))
        d = os.path.join(tmp, "pull-badpin")
        r = pull(hub, "--plan", plan, "--worker", w0, "--to", d, "--pin", pin)
        check("--pin with another sha256: refused (exit 3), both digests named",
              r.returncode == 3 and "the pin says" in r.stderr and hashlib.sha256(cfg).hexdigest() in r.stderr,
              f"rc {r.returncode}: {r.stderr[-300:]}")
        k3pin = json.load(open(os.path.join(SRC, "deploy", "pins", "kimi-k3.json")))
        if os.path.isdir(K3):
            ok = k3pin["repo"] == "moonshotai/Kimi-K3" and all(
                hashlib.sha256(open(os.path.join(K3, f), "rb").read()).hexdigest() == v["sha256"] and
                os.path.getsize(os.path.join(K3, f)) == v["bytes"] for f, v in k3pin["files"].items())
            check("deploy/pins/kimi-k3.json equals the official files in ../shared/k3 (sha256, size)",
                  ok and len(k3pin["files"]) >= 3, json.dumps(k3pin)[:300])
        else:
            record("SKIP", "deploy/pins/kimi-k3.json vs ../shared/k3", "no ../shared/k3 in this checkout")

        # a plan with trunk rows on the workers (--trunk spread): the pulled pack holds them too
        plan_t = os.path.join(tmp, "plan-trunk.json")
        cl_t = os.path.join(tmp, "cluster-trunk.json")
        big = json.load(open(cl))
        for h in big["hosts"][1:]:
            h["expert_ram"] = 1 << 30
        json.dump(big, open(cl_t, "w"))
        r = sh("plan", "--model", TINY, "--cluster", cl_t, "--trunk", "spread", "-o", plan_t)
        ref = os.path.join(tmp, "pack-trows")
        r2 = sh("pack", "--model", TINY, "--plan", plan_t, "--worker", w1, "-o", ref, "--quiet")
        d = os.path.join(tmp, "pull-trows")
        r3 = pull(hub, "--plan", plan_t, "--worker", w1, "--to", d)
        same, why = same_tree(d, ref) if r3.returncode == 0 else (False, r3.stderr[-300:])
        check("--trunk spread plan: the pulled worker pack (trunk rows included) is byte for byte `shoal pack`'s",
              r.returncode == 0 and r2.returncode == 0 and same and
              any(f.startswith("trunk-rows-") for f in os.listdir(d)), why + r.stderr[-200:] + r2.stderr[-200:])

        # free space: a 600 KiB tmpfs (room for the header-only copy, ~370 KiB, not for the 830 KiB pack)
        small = os.path.join(tmp, "small")
        os.mkdir(small)
        if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", small],
                                                capture_output=True).returncode == 0:
            try:
                hub.get("/_reset")
                r = pull(hub, "--plan", plan, "--worker", w0, "--to", os.path.join(small, "p"))
                st = hub.get("/_stats")
                data = [x for x in st["ranges"] if x[1] >= layout[x[0]][0]]
                check("too little free space: refused before any data is fetched, naming the numbers",
                      r.returncode == 4 and "GiB free" in r.stderr and "needs" in r.stderr and not data,
                      f"rc {r.returncode}, {len(data)} data ranges: {r.stderr[-300:]}")
            finally:
                subprocess.run(["umount", small], capture_output=True)
        else:
            record("SKIP", "too little free space refused", "cannot mount a small tmpfs (not root)")

        # a terminal: the bar is redrawn in place
        import pty
        mfd, sfd = pty.openpty()
        e = dict(os.environ, HF_TOKEN=TOKEN)
        p = subprocess.Popen([BIN, "pull", "--repo", REPO, "--revision", REV, "--endpoint", hub.url, "--plan", plan,
                              "--worker", w0, "--to", os.path.join(tmp, "pull-tty")], stdout=subprocess.DEVNULL,
                             stderr=sfd, env=e)
        os.close(sfd)
        buf = b""
        while True:
            try:
                chunk = os.read(mfd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
        p.wait(60)
        os.close(mfd)
        txt = buf.decode(errors="replace")
        check("on a terminal: a progress bar redrawn in place (\\r, bar, GiB, MiB/s, ETA)",
              p.returncode == 0 and "\rpull [" in txt and "#" in txt and "MiB/s" in txt and "ETA" in txt, txt[-300:])

        # --config-only: a header-only model that shoal plan accepts, giving the same plan
        d = os.path.join(tmp, "headers")
        r = pull(hub, "--config-only", "--to", d)
        plan2 = os.path.join(tmp, "plan2.json")
        r2 = sh("plan", "--model", d, "--cluster", cl, "-o", plan2)
        check("--config-only: `shoal plan` on the header-only model writes the same plan (fingerprint included)",
              r.returncode == 0 and r2.returncode == 0 and open(plan).read() == open(plan2).read(),
              r.stderr[-300:] + r2.stderr[-300:])
        du = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in os.listdir(d))
        check("--config-only: the shards are sparse (headers only on disk)",
              du < sum(os.path.getsize(os.path.join(TINY, f)) for f in os.listdir(TINY)) // 2, f"{du} bytes")
        hostile_hub(hub, tmp, plan, w2, ref_packs[w2])
    finally:
        for p in procs:
            harness.terminate(p)
        hub.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
