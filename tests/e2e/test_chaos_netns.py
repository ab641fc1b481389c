#!/usr/bin/env python3
"""A worker host taken down mid-generation, with replicas (issue 18): network
namespaces joined by a bridge play one coordinator host and three worker
hosts (as tests/e2e/test_cluster_netns.py, without the Ansible deployment);
`shoal plan --replicas 1` on the three puts every routed expert of
tests/models/tiny-k3 on two of them; each worker host runs `shoal expert`
on tcp:// (plain: --insecure on the private bridge), the coordinator host
`shoal serve --plan` with --failover-ms 300. Driven with the official
`openai` client from the coordinator's namespace:

- fault-free: greedy completions of 12 prompts, their ids;
- host down: while the same completions run, one worker host's link is cut
  (its veth set down: its packets go nowhere, as when a machine loses power)
  and every process in its namespace is SIGKILLed, in the middle of a
  generation; 0 failed requests and the same ids; /health lists that worker
  down; the completions after it go on with the same ids;
- host back: the link up and its worker restarted: /health lists all up again
  and the ids are the same.

Needs root and iproute2: SKIPs otherwise, counted as skipped. Each case
appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_chaos_netns"
SRC = os.path.abspath(os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
PY = os.environ.get("SHOAL_PYTHON", sys.executable)
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
HOSTS = ("c", "w0", "w1", "w2")
N = harness.Netns("sf", 79, HOSTS)
NS, IP = N.ns, N.ip

R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


sh = harness.sh


def main():
    if os.geteuid() != 0:
        record("SKIP", "all", "needs root (network namespaces)")
        return 77
    if not os.path.exists(BIN) or not os.path.exists(os.path.join(TINY, "config.json")):
        record("SKIP", "all", "shoal or tests/models/tiny-k3 missing")
        return 77
    try:
        import openai  # noqa: F401 -- the client runs in the coordinator's namespace, below
    except ImportError:
        record("SKIP", "all", "the openai package is not installed (scripts/deps.sh)")
        return 77
    if not N.setup_or_skip(R):
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-chaos-netns-")
    procs = []
    try:
        cl = {"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
              "hosts": [{"name": "c", "address": IP["c"], "ssh_user": "root", "cpus": 1, "expert_ram": 0}] +
              [{"name": w, "address": IP[w], "ssh_user": "root", "cpus": 1, "expert_ram": "2MiB"}
               for w in ("w0", "w1", "w2")]}
        json.dump(cl, open(os.path.join(tmp, "cluster.json"), "w"))
        plan = os.path.join(tmp, "plan.json")
        r = sh([BIN, "plan", "--model", TINY, "--cluster", os.path.join(tmp, "cluster.json"), "--replicas", "1",
                "-o", plan], check_rc=False)
        if not check("plan --replicas 1 on 3 worker hosts", r.returncode == 0, r.stderr[-300:]):
            return 1
        pl = json.load(open(plan))

        def start_worker(w):
            log = harness.logfile()
            p = subprocess.Popen([*N.prefix(w), BIN, "expert", "--model", TINY, "--plan", plan,
                                  "--name", w, "--insecure", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=log)
            p.log = log
            procs.append(p)
            return p
        for w in pl["workers"]:
            start_worker(w["name"])
        slog = harness.logfile()
        srv = subprocess.Popen([*N.prefix("c"), BIN, "serve", "--model", TINY, "--plan", plan,
                                "--insecure-workers", "--port", "8000", "--host", "127.0.0.1", "--model-name", "tiny",
                                "--threads", "1", "--expert-timeout-ms", "8000", "--failover-ms", "300", "--memo",
                                "0"], stdout=subprocess.PIPE, stderr=slog, text=True)
        procs.append(srv)
        line = srv.stdout.readline()
        if not check("serve starts in the coordinator namespace", "listening on" in line,
                     f"{line!r} {(slog.seek(0), slog.read()[-1500:])[1]!r}"):
            return 1
        # the client runs in the coordinator's namespace (the HTTP port is its loopback)
        client_py = os.path.join(tmp, "client.py")
        open(client_py, "w").write(r'''
import json, sys, time, openai, urllib.request
c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0, timeout=120)
n, reps, mark = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = []
for r in range(reps):
    for i in range(n):
        if r == 0 and i == 2:
            open(mark, "w").write("go")  # the driver takes the host down now, mid-generation
        try:
            x = c.completions.create(model="tiny", prompt=[1 + 7 * i % 50, 9, 4, 2], max_tokens=24, temperature=0,
                                     extra_body={"return_token_ids": True})
            out.append((x.choices[0].model_extra or {}).get("token_ids"))
        except openai.APIError as e:
            out.append("ERROR " + repr(e)[:300])
print(json.dumps(out))
''')

        def client(n, reps, mark):
            rr = sh([*N.prefix("c"), PY, client_py, str(n), str(reps), mark], check_rc=False,
                    timeout=300)
            try:
                return json.loads(rr.stdout.strip().splitlines()[-1]), rr
            except Exception:  # noqa: BLE001
                return None, rr

        def health():
            q = ("import json,urllib.request as u,urllib.error as e\n"
                 "try:\n r=u.urlopen('http://127.0.0.1:8000/health',timeout=10);print(r.status,r.read().decode())\n"
                 "except e.HTTPError as x:\n print(x.code,x.read().decode())")
            rr = sh([*N.prefix("c"), PY, "-c", q], check_rc=False, timeout=30)
            code, body = rr.stdout.split(" ", 1)
            return int(code), json.loads(body)

        def wait_up(n_up, secs):
            t0 = time.time()
            while time.time() - t0 < secs:
                code, h = health()
                if sum(1 for x in h["workers"] if x["up"]) == n_up:
                    return True, h
                time.sleep(0.2)
            return False, health()[1]

        ok, h = wait_up(3, 30)
        check("all 3 workers up at start", ok, str(h))
        base, rr = client(12, 1, os.path.join(tmp, "mark0"))
        check("fault-free completions", base is not None and all(isinstance(x, list) and len(x) == 24 for x in base),
              f"{base} {rr.stderr[-500:]}")
        # ---- host w1 down in the middle of a generation
        mark = os.path.join(tmp, "mark1")
        victim = "w1"
        done = {}

        def driver():
            t_end = time.time() + 60
            while not os.path.exists(mark) and time.time() < t_end:
                time.sleep(0.005)
            time.sleep(0.05)  # into the generation
            N.link(victim, False)
            N.kill(victim)
            done["t"] = time.time()
        th = threading.Thread(target=driver)
        th.start()
        got, rr = client(12, 2, mark)
        th.join()
        errs = [x for x in (got or []) if isinstance(x, str)]
        check("host down mid-generation: 0 failed requests", got is not None and not errs,
              f"{errs[:2]} {rr.stderr[-400:]}")
        check("host down mid-generation: every id sequence identical to the fault-free run",
              got is not None and got == base + base, f"{got} vs {base}")
        code, h = health()
        down = [x for x in h["workers"] if not x["up"]]
        check("host down: /health lists its worker down (and only it)",
              len(down) == 1 and IP[victim] in down[0]["endpoint"], str(h))
        # ---- host back
        N.link(victim, True)
        start_worker(victim)
        ok, h = wait_up(3, 30)
        check("host back: its worker rejoins (all 3 up)", ok, str(h))
        again, rr = client(12, 1, os.path.join(tmp, "mark2"))
        check("host back: the same ids", again == base, f"{again} {rr.stderr[-300:]}")
        slog.seek(0)
        text = slog.read().decode(errors="replace")
        check("the coordinator logged the failover naming the host's worker",
              "resent to other owners" in text and IP[victim] in text, text[-1500:])
    finally:
        N.teardown((signal.SIGCONT, signal.SIGTERM, signal.SIGKILL))
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
