#!/usr/bin/env python3
"""Multi-host deployment on one machine (issue 10, docs/DEPLOY.md): network
namespaces joined by a bridge play one coordinator host and three worker
hosts, each running its own sshd; the root namespace is the Ansible
controller. plan -> pack -> deploy/site.yml over SSH -> start.yml -> generate:
the ids equal the single-process run's, and with the trunk remote (the plan
made with --trunk spread, each worker's pack holding its trunk rows, one run
with --trunk auto) ids and logits too, the plan relaying the trunk inputs
(relay_fanout 2: site.yml gives each worker the others' keys, allow.pub and
--relay-keys) with requests relayed and none resent directly; the coordinator reaches the workers
through delay-injecting relays (0.25 ms each way; what they add is measured
and recorded); a coordinator key the workers do not list is refused; a second
site.yml run changes nothing; rolling-restart.yml, status.yml and stop.yml work.
Pull mode (issue 22): site.yml with shoal_pull_repo against tests/e2e/hubserver.py
on the bridge (token, CDN port, pin): no pack made on the controller, each host
runs `shoal pull` (the server sees every host's address; the token never reaches
the CDN) and holds byte for byte the pack `shoal pack` made; the cluster on the
pulled packs generates the single-process ids.
Then the systemd units: site.yml --tags units in systemd mode renders each host's
unit and shoalctl (into the test's directories, not /etc/systemd/system);
`systemd-analyze verify` (systemd's own unit parser; it runs without systemd as
PID 1) must accept each without an error or a warning; then each host's
shoalctl, in systemd mode, starts, reports and stops its unit through a
stand-in systemctl (tests/e2e/fake_systemctl.py) that runs the unit's ExecStart
as written, as its User, and stops it with its KillSignal within its
TimeoutStopSec: the coordinator service must generate the single-process ids,
status must name the service's PID, and every service must end with exit 0.
Not exercised: systemd itself (its systemctl, daemon-reload, Restart=,
ordering, the journal): there is no systemd as PID 1 here.
site.yml's apt task runs for real on every host: the runtime packages being
installed (scripts/deps.sh), it must report ok without downloading anything.
Needs root, iproute2, sshd, ansible-playbook, rsync (scripts/deps.sh): SKIPs
otherwise, counted as skipped. Each case appends PASS/FAIL/SKIP lines to
$SHOAL_TEST_RESULTS.
"""
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_cluster_netns"
SRC = os.path.abspath(os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
PY = os.environ.get("SHOAL_PYTHON", sys.executable)
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PROMPT = "3,17,250,1001,42,7,99,512,4000,1"
DELAY_MS = 0.25
# a /24 of its own per run (from the pid), so runs in parallel do not answer each other's addresses;
# the bridge's NET.1 in the root namespace serves the hub (pull mode)
N = harness.Netns("sh", 77, ("c", "w0", "w1", "w2"), bridge_ip=True)
NS, IP, NET = N.ns, N.ip, N.net


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


sh = harness.sh


def start_sshd(tmp, host, pubkey):
    d = os.path.join(tmp, "sshd", host)
    os.makedirs(d)
    hk = os.path.join(d, "hostkey")
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hk])
    ak = os.path.join(d, "authorized_keys")
    shutil.copy(pubkey, ak)
    os.chmod(ak, 0o600)
    cfg = os.path.join(d, "sshd_config")
    open(cfg, "w").write(f"ListenAddress {IP[host]}\nPort 22\nHostKey {hk}\nPidFile {d}/sshd.pid\n"
                         f"AuthorizedKeysFile {ak}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                         "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
                         "Subsystem sftp internal-sftp\n")
    os.makedirs("/run/sshd", exist_ok=True)
    return subprocess.Popen([*N.prefix(host), "/usr/sbin/sshd", "-D", "-e", "-f", cfg],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "log"), "w"))


def recap(out):
    """{host: changed} from an ansible-playbook PLAY RECAP"""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", out, re.M)}


def serve_ids(nsc, tries=50):
    """token ids from the coordinator service on 127.0.0.1:8000 in namespace nsc"""
    q = ("import json,urllib.request as u;"
         "r=u.urlopen(u.Request('http://127.0.0.1:8000/v1/completions',data=json.dumps({'prompt':[" + PROMPT +
         "],'model':'model','max_tokens':6,'temperature':0,'return_token_ids':True}).encode(),"
         "headers={'Content-Type':'application/json'}),timeout=60);print(json.dumps(json.load(r)))")
    rr = None
    for _ in range(tries):
        rr = sh([*nsc, PY, "-c", q], check_rc=False, timeout=90)
        if rr.returncode == 0:
            return json.loads(rr.stdout)["choices"][0].get("token_ids"), rr
        time.sleep(0.3)
    return None, rr


def run_ids(prefix, *args):
    r = sh([*prefix, BIN, "run", "--json", "--ids", PROMPT, "--gen", "6", *args], check_rc=False, timeout=180)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["generated_ids"], r
    except Exception:
        return None, r


def main():
    if os.geteuid() != 0:
        record("SKIP", "all", "needs root (network namespaces)")
        return 77
    missing = [t for t in ("ip", "ssh", "ssh-keygen", "ansible-playbook", "rsync", "start-stop-daemon")
               if not shutil.which(t)] + ([] if os.path.exists("/usr/sbin/sshd") else ["sshd"])
    if missing:
        record("SKIP", "all", "missing " + ", ".join(missing) + " (scripts/deps.sh)")
        return 77
    if not N.setup_or_skip(R):
        return 77
    tmp = tempfile.mkdtemp(prefix="shoal-netns-")
    procs = []
    try:
        ref, r = run_ids([], "--model", TINY, "--dump-logits", os.path.join(tmp, "ref-logits.bin"))
        check("single-process reference", ref is not None, r.stderr[-300:])
        # the controller's SSH key, an sshd per host
        ck = os.path.join(tmp, "id_ed25519")
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", ck])
        for h in NS:
            procs.append(start_sshd(tmp, h, ck + ".pub"))
        sshopt = f"-i {ck} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        ok = False
        for _ in range(50):
            ok = all(sh(f"ssh {sshopt} -o ConnectTimeout=2 root@{IP[h]} true", check_rc=False).returncode == 0
                     for h in NS)
            if ok:
                break
            time.sleep(0.2)
        if not check("sshd reachable in every namespace", ok):
            return 1
        # the apt task runs only where Ansible's apt module can (python3-apt): else it
        # would try to download python3-apt, and this test must not depend on the network
        have_apt = sh(["/usr/bin/python3", "-c", "import apt"], check_rc=False).returncode == 0
        # relays in the coordinator's namespace: measured first
        m = sh([PY, os.path.join(SRC, "tests", "e2e", "relay.py"), "--measure", str(DELAY_MS)])
        added = float(re.search(r"added_us ([\d.-]+)", m.stdout).group(1))
        noise = float(re.search(r"noise_us ([\d.]+)", m.stdout).group(1))
        # the difference of two medians is known to about the measured noise
        # (the IQR half-widths, at least 20 us): a bound with no room below
        # 2·D failed at 499.5 us on a busy machine (issue 30 item 12)
        margin = max(20.0, noise)
        check(f"relay adds the round trip it claims ({2 * DELAY_MS} ms): {added:.0f} us (noise {noise:.0f} us)",
              2000 * DELAY_MS - margin <= added <= 2000 * DELAY_MS + 400 + margin, m.stdout)
        # plan, with the coordinator reaching each worker through its relay
        cluster = {"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
                   "hosts": [{"name": "c", "address": IP["c"], "ssh_user": "root", "cpus": 1, "expert_ram": 0}] +
                   [{"name": w, "address": IP[w], "ssh_user": "root", "cpus": 1, "expert_ram": "2MiB"}
                    for w in ("w0", "w1", "w2")]}
        json.dump(cluster, open(os.path.join(tmp, "cluster.json"), "w"))
        plan, inv = os.path.join(tmp, "plan.json"), os.path.join(tmp, "hosts.yml")
        # --trunk spread: each worker's pack also holds its trunk rows (issue 16); the
        # coordinator keeps the trunk local unless a run says --trunk auto|remote
        r = sh([BIN, "plan", "--model", TINY, "--cluster", os.path.join(tmp, "cluster.json"), "-o", plan,
                "--inventory", inv, "--trunk", "spread"], check_rc=False)
        if not check("shoal plan --trunk spread with --inventory", r.returncode == 0, r.stderr[-300:]):
            return 1
        pl = json.load(open(plan))
        # the delay relays listen on the coordinator's bridge address: the workers reach each other
        # through them too, at the plan's endpoints, as the relay tree's links (PROTOCOL.md 3.9)
        for i, w in enumerate(pl["workers"]):
            port = 17000 + i
            procs.append(N.relay("c", f"{IP['c']}:{port}", f"{IP[w['name']]}:5555", DELAY_MS, python=PY))
            w["endpoint"] = f"tcp://{IP['c']}:{port}"
        # the trunk inputs relayed (fan-out 2 over the 3 trunk workers): site.yml must give every worker
        # the others' keys (allow.pub, --relay-keys) or the relay links are refused
        pl["relay_fanout"] = 2
        json.dump(pl, open(plan, "w"), indent=2)
        ev = {"shoal_binary": BIN, "shoal_model": TINY, "shoal_plan_file": plan,
              "shoal_keys_dir": os.path.join(tmp, "keys"), "shoal_packs_dir": os.path.join(tmp, "packs"),
              "shoal_root": os.path.join(tmp, "hosts", "{{ inventory_hostname }}"),
              # the apt task runs for real: the runtime packages are installed here already
              # (scripts/deps.sh), so it must report ok without a download; become goes
              # through su (no sudo here; the login is root already)
              "shoal_install_packages": have_apt, "ansible_become_method": "su",
              "shoal_service_manager": "direct", "shoal_verify_pack": True,
              "shoal_http_host": "127.0.0.1", "shoal_http_port": 8000, "shoal_api_key_file": "",
              "shoal_ssh_opts": sshopt, "ansible_ssh_private_key_file": ck,
              "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
              "ansible_python_interpreter": "/usr/bin/python3"}
        if not have_apt:
            record("SKIP", "site.yml's apt task", "no python3-apt for Ansible's apt module (scripts/deps.sh)")
        evf = os.path.join(tmp, "vars.json")
        json.dump(ev, open(evf, "w"))
        env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(SRC, "deploy", "ansible.cfg"),
                   ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_LOCAL_TEMP=os.path.join(tmp, "ansible-local"),
                   ANSIBLE_REMOTE_TEMP=os.path.join(tmp, "ansible-remote"))

        def play(book):
            return sh(["ansible-playbook", "-i", inv, os.path.join(SRC, "deploy", book), "-e", "@" + evf],
                      check_rc=False, env=env, cwd=tmp, timeout=300)

        t0 = time.monotonic()
        r = play("site.yml")
        rc1 = recap(r.stdout)
        if not check("site.yml deploys over SSH", r.returncode == 0 and rc1.get("w0", 0) > 0,
                     (r.stdout + r.stderr)[-1500:]):
            return 1
        apt = have_apt and re.search(r"TASK \[runtime libraries \(Debian 12\)\][^\n]*\n(.*?)\n\s*\n", r.stdout, re.S)
        apt_hosts = re.findall(r"^(ok|changed|skipping|failed|fatal): \[(\S+)\]", apt.group(1), re.M) if apt else []
        if have_apt:
            check("site.yml's apt task ran on every host and found the runtime packages installed (ok, not changed)",
                  sorted(apt_hosts) == sorted(("ok", h) for h in NS), f"{apt_hosts}: {apt.group(0)[-600:] if apt else ''}")
        t1 = time.monotonic()
        r = play("site.yml")
        rc2 = recap(r.stdout)
        check("site.yml run twice: the second run changes nothing", r.returncode == 0 and rc2 and
              all(v == 0 for v in rc2.values()), f"{rc2}: {(r.stdout)[-1500:]}")
        check("each worker host holds only its pack (not the model)",
              all(os.path.exists(os.path.join(tmp, "hosts", w, "pack", "shoal-pack.json")) and
                  not os.path.exists(os.path.join(tmp, "hosts", w, "model")) for w in ("w0", "w1", "w2")))
        r = play("start.yml")
        check("start.yml starts workers and coordinator", r.returncode == 0, (r.stdout + r.stderr)[-1500:])
        root_c = os.path.join(tmp, "hosts", "c")
        args = ["--model", os.path.join(root_c, "model"), "--plan", os.path.join(root_c, "etc", "plan.json"),
                "--curve-secret", os.path.join(root_c, "keys", "self.key"), "--curve-keys",
                os.path.join(root_c, "keys")]
        nsc = N.prefix("c")
        got, r = run_ids(nsc, *args)
        check("generate on the deployed cluster (3 worker hosts, CURVE, relayed 0.5 ms RTT): ids identical",
              got == ref, f"got {got} want {ref}: {r.stderr[-600:]}")
        # the trunk remote: every row-shardable matrix on the worker hosts, from their packs
        lg = os.path.join(tmp, "trunk-logits.bin")
        got, r = run_ids(nsc, *args, "--trunk", "auto", "--dump-logits", lg)
        try:
            jr = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception:
            jr = {}
        nrem = jr.get("trunk_remote_matrices", 0)
        same_lg = os.path.exists(lg) and open(lg, "rb").read() == open(os.path.join(tmp, "ref-logits.bin"), "rb").read()
        check("the trunk remote on the deployed cluster (--trunk auto, rows from the worker packs): ids and logits "
              "identical", got == ref and nrem > 0 and same_lg,
              f"got {got} want {ref}, {nrem} remote matrices, logits identical {same_lg}: {r.stderr[-600:]}")
        check("the plan's relay tree (relay_fanout 2) on the deployed CURVE cluster: trunk inputs relayed between "
              "workers, none resent directly", jr.get("trunk_relayed_requests", 0) > 0 and
              jr.get("trunk_relay_fallbacks", -1) == 0,
              f"relayed {jr.get('trunk_relayed_requests')}, fallbacks {jr.get('trunk_relay_fallbacks')}: "
              f"{r.stderr[-600:]}")
        # the deployed coordinator service answers too
        ids, rr = serve_ids(nsc)
        check("the deployed coordinator service (shoal serve) generates the same ids",
              ids is not None and ids[:len(ref)] == ref, f"{ids} vs {ref}: {rr.stderr[-300:]}")
        evil = os.path.join(tmp, "evil")
        sh([BIN, "keygen", "-o", evil])
        got, r = run_ids(nsc, *args[:4], "--curve-secret", evil + ".key", "--curve-keys", os.path.join(root_c, "keys"),
                         "--hello-timeout-ms", "3000")
        wlog = open(os.path.join(tmp, "hosts", "w0", "log", "shoal-expert.log")).read()
        check("a coordinator key the workers do not list is refused", got is None and
              "client key not allowed" in wlog, r.stderr[-300:])
        r = play("rolling-restart.yml")
        got, rr = run_ids(nsc, *args)
        check("rolling-restart.yml (one worker at a time, then the coordinator), then the same ids",
              r.returncode == 0 and got == ref, f"{got}: {(r.stdout + r.stderr)[-800:]} {rr.stderr[-300:]}")
        r = play("status.yml")
        check("status.yml reports every host running", r.returncode == 0 and r.stdout.count(": running") >= 4,
              r.stdout[-800:])
        r = play("stop.yml")
        check("stop.yml stops everything", r.returncode == 0 and "running" not in play("status.yml").stdout
              .replace("not running", ""), r.stdout[-800:])
        print(f"# site.yml first run {t1 - t0:.1f} s, second {time.monotonic() - t1:.1f} s", flush=True)

        # pull mode (issue 22): no pack made or copied; each host runs `shoal pull` against
        # a hub-layout server (tests/e2e/hubserver.py, token, CDN on a second port) on the
        # bridge, and downloads its own pack
        tp = time.monotonic()
        pf = os.path.join(tmp, "hub-port.json")
        hub_log = harness.logfile()
        procs.append(subprocess.Popen([PY, os.path.join(SRC, "tests", "e2e", "hubserver.py"), "--repo", "acme/tiny-k3",
                                       "--revision", "r1", "--root", TINY, "--host", f"{NET}.1", "--cdn-port", "0",
                                       "--token", "hf_netns_token", "--digest", "--port-file", pf],
                                      stdout=hub_log, stderr=hub_log))
        for _ in range(200):
            if os.path.exists(pf):
                break
            time.sleep(0.05)
        hub_url = f"http://{NET}.1:{json.load(open(pf))['port']}"
        tok = os.path.join(tmp, "hf-token")
        with open(tok, "w") as f:
            f.write("hf_netns_token\n")
        cfgb = open(os.path.join(TINY, "config.json"), "rb").read()
        pin = os.path.join(tmp, "pin.json")
        json.dump({"format": "shoal-pin", "version": 1, "repo": "acme/tiny-k3", "revision": "r1",
                   "files": {"config.json": {"bytes": len(cfgb), "sha256": hashlib.sha256(cfgb).hexdigest()}}},
                  open(pin, "w"))
        evp = dict(ev, shoal_root=os.path.join(tmp, "hosts-pull", "{{ inventory_hostname }}"),
                   shoal_packs_dir=os.path.join(tmp, "packs-unused"), shoal_pull_repo="acme/tiny-k3",
                   shoal_pull_revision="r1", shoal_pull_endpoint=hub_url, shoal_pull_token_file=tok,
                   shoal_pull_pin=pin)
        json.dump(evp, open(evf, "w"))
        r = play("site.yml")
        with urllib.request.urlopen(hub_url + "/_stats", timeout=10) as u:
            hst = json.load(u)
        pulled = {w: os.path.join(tmp, "hosts-pull", w, "pack") for w in ("w0", "w1", "w2")}
        same = all(sorted(os.listdir(pulled[w])) == sorted(os.listdir(os.path.join(tmp, "packs", w))) and
                   all(open(os.path.join(pulled[w], f), "rb").read() ==
                       open(os.path.join(tmp, "packs", w, f), "rb").read() for f in os.listdir(pulled[w]))
                   for w in ("w0", "w1", "w2"))
        check("site.yml with shoal_pull_repo: every host pulled its own pack from the hub (requests from each "
              "host's address), byte for byte the packs shoal pack made; none made on the controller",
              r.returncode == 0 and same and not os.path.exists(evp["shoal_packs_dir"]) and
              os.path.exists(os.path.join(tmp, "hosts-pull", "c", "model", "shoal-pack.json")) and
              set(IP.values()) <= set(hst["clients"]) and hst["cdn_auth"] == 0,
              f"rc {r.returncode}, identical {same}, controller packs dir made "
              f"{os.path.exists(evp['shoal_packs_dir'])}, clients {hst['clients']}, cdn_auth {hst['cdn_auth']}: "
              f"{(r.stdout + r.stderr)[-1200:]}")
        r = play("start.yml")
        root_p = os.path.join(tmp, "hosts-pull", "c")
        argsp = ["--model", os.path.join(root_p, "model"), "--plan", os.path.join(root_p, "etc", "plan.json"),
                 "--curve-secret", os.path.join(root_p, "keys", "self.key"), "--curve-keys",
                 os.path.join(root_p, "keys")]
        got, rr = run_ids(nsc, *argsp)
        check("pull mode: generate on the cluster whose hosts pulled their packs: ids identical",
              r.returncode == 0 and got == ref, f"got {got} want {ref}: {(r.stdout + r.stderr)[-600:]} "
              f"{rr.stderr[-400:]}")
        r = play("stop.yml")
        check("pull mode: stop.yml", r.returncode == 0, r.stdout[-600:])
        json.dump(ev, open(evf, "w"))
        print(f"# pull mode {time.monotonic() - tp:.1f} s", flush=True)

        # systemd mode: the units as site.yml renders them for each host (into the test's
        # directories; every "host" shares this file system, so the rendering runs over a
        # local connection -- SSH was exercised above)
        t2 = time.monotonic()
        ev2 = dict(ev, shoal_service_manager="systemd", ansible_connection="local",
                   shoal_systemd_dir=os.path.join(tmp, "hosts", "{{ inventory_hostname }}", "systemd"))
        json.dump(ev2, open(evf, "w"))
        r = sh(["ansible-playbook", "-i", inv, os.path.join(SRC, "deploy", "site.yml"), "-e", "@" + evf, "--tags",
                "units"], check_rc=False, env=env, cwd=tmp, timeout=300)
        units = {h: os.path.join(tmp, "hosts", h, "systemd",
                                 "shoal-coordinator.service" if h == "c" else "shoal-expert.service") for h in NS}
        if not check("site.yml --tags units (systemd mode) renders every host's unit",
                     r.returncode == 0 and all(os.path.exists(u) for u in units.values()),
                     (r.stdout + r.stderr)[-1500:]):
            return 1
        print(f"# site.yml --tags units {time.monotonic() - t2:.1f} s", flush=True)
        if shutil.which("systemd-analyze"):
            for h, u in units.items():
                v = sh(["systemd-analyze", "verify", u], check_rc=False, timeout=60)
                out = (v.stdout + v.stderr).strip()
                check(f"systemd-analyze verify {os.path.basename(u)} of {h}: accepted, no warning",
                      v.returncode == 0 and not out, f"rc {v.returncode}: {out[-800:]}")
        else:
            record("SKIP", "systemd-analyze verify of the rendered units", "no systemd-analyze (scripts/deps.sh)")
        # each host's shoalctl, in systemd mode, drives its unit through a stand-in
        # systemctl (tests/e2e/fake_systemctl.py: runs the unit's ExecStart as written, as
        # its User, stops with its KillSignal within TimeoutStopSec; it is not systemd)
        fake = os.path.join(tmp, "fakebin")
        os.makedirs(fake)
        with open(os.path.join(fake, "systemctl"), "w") as f:
            f.write(f"#!/bin/sh\nexec {PY} {os.path.join(SRC, 'tests', 'e2e', 'fake_systemctl.py')} \"$@\"\n")
        os.chmod(os.path.join(fake, "systemctl"), 0o755)

        def ctl(h, cmd):
            st = os.path.join(tmp, "hosts", h, "systemd-state")
            os.makedirs(st, exist_ok=True)
            e = dict(os.environ, PATH=fake + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
                     FAKE_SYSTEMD_UNITS=os.path.dirname(units[h]), FAKE_SYSTEMD_STATE=st)
            r = sh([*N.prefix(h), os.path.join(tmp, "hosts", h, "bin", "shoalctl"), cmd],
                   check_rc=False, env=e, timeout=120)
            return r.returncode, r.stdout.strip(), r.stderr.strip()

        def unit_log(h):
            lf = os.path.join(tmp, "hosts", h, "systemd-state", os.path.basename(units[h])[:-8] + ".log")
            return open(lf).read()[-400:] if os.path.exists(lf) else "(no log)"

        hosts = ("w0", "w1", "w2", "c")  # start.yml's order: the workers, then the coordinator
        got = {h: ctl(h, "start") for h in hosts}
        check("shoalctl start (systemd mode) on every host starts its unit: 'started'",
              all(v[0] == 0 and v[1] == "started" for v in got.values()), str(got))
        ids, rr = serve_ids(nsc, tries=100)
        check("the units' ExecStart as rendered (3 workers, then the coordinator): the service generates the same ids",
              ids is not None and ids[:len(ref)] == ref, f"{ids} vs {ref}: {''.join(unit_log(h) for h in hosts)}")
        st = {h: ctl(h, "status") for h in hosts}
        ok = True
        for h, (rc, o, _) in st.items():
            m = re.fullmatch(r"running (\d+)", o)
            cmdline = open(f"/proc/{m.group(1)}/cmdline").read().split("\0") if m and os.path.exists(
                f"/proc/{m.group(1)}") else []
            ok &= rc == 0 and bool(cmdline) and cmdline[1:2] == ["serve" if h == "c" else "expert"]
        check("shoalctl status: 'running PID', PID being the shoal serve/expert process the unit started", ok, str(st))
        print("# LimitNOFILE=65536 applied as min(65536, hard limit "
              f"{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}) by the stand-in", flush=True)
        for h in ("c", "w0", "w1", "w2"):  # stop.yml's order: the coordinator first
            t3 = time.monotonic()
            rc, o, e = ctl(h, "stop")
            xf = os.path.join(tmp, "hosts", h, "systemd-state", os.path.basename(units[h])[:-8] + ".exit")
            xs = open(xf).read() if os.path.exists(xf) else None
            check(f"{h}: shoalctl stop: 'stopped'; the unit's KillSignal ended it with exit 0 within TimeoutStopSec",
                  rc == 0 and o == "stopped" and xs == "0",
                  f"rc {rc} '{o}' {e[-200:]}; exit status {xs} after {time.monotonic() - t3:.1f} s: {unit_log(h)}")
        st = {h: ctl(h, "status") for h in hosts}
        check("shoalctl status after stop: 'not running' everywhere", all(v[1] == "not running" for v in st.values()),
              str(st))
        print(f"# systemd part {time.monotonic() - t2:.1f} s", flush=True)
    finally:
        for p in procs:
            harness.terminate(p, 5)
        # processes started by the playbooks, by their pid files
        for h in NS:
            for u in ("shoal-expert", "shoal-coordinator"):
                pf = os.path.join(tmp, "hosts", h, "run", u + ".pid")
                if os.path.exists(pf):
                    try:
                        os.kill(int(open(pf).read()), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass
        # every process still in a namespace was started by this test (sshd sessions kept
        # open by Ansible's ControlPersist, services): end them, or they outlive it
        N.teardown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
