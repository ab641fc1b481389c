#!/usr/bin/env python3
"""A stand-in for `systemctl`, for tests on machines without systemd as PID 1
(tests/e2e/test_cluster_netns.py). It is NOT systemd: it implements only what
deploy/templates/shoalctl.j2 calls, on the units of one directory, with the
unit-file syntax that deploy/templates/shoal.service.j2 uses (anything else is
refused, not guessed):

  systemctl is-active [-q] UNIT      "active"/"inactive", exit 0/3
  systemctl start|stop|restart UNIT  unknown unit: "Unit UNIT.service not found.", exit 5
  systemctl show -p MainPID --value UNIT
  systemctl daemon-reload            no-op

start runs the unit's ExecStart, as written, as its User with its
LimitNOFILE (up to this process's hard limit), through a small supervisor that
records the main PID and, when the service ends, its exit status
(STATE/UNIT.exit: the test reads it; systemd would show it as the unit's
result). stop sends the unit's KillSignal and waits up to TimeoutStopSec, then
SIGKILL, as systemd does. Not emulated: Restart=, dependencies and ordering,
the journal, cgroups (only the main process is signalled).

Environment: FAKE_SYSTEMD_UNITS (the directory of UNIT.service files),
FAKE_SYSTEMD_STATE (a writable directory for pids, exit statuses and logs).
"""
import os
import resource
import shlex
import signal
import subprocess
import sys
import time


def parse_unit(path):
    """{(section, key): [values]}; continuation lines are refused, not misread"""
    sec, out = None, {}
    for n, line in enumerate(open(path), 1):
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        if s.endswith("\\"):
            raise ValueError(f"{path}:{n}: continuation lines are not emulated")
        if s.startswith("[") and s.endswith("]"):
            sec = s[1:-1]
            continue
        if "=" not in s:
            raise ValueError(f"{path}:{n}: not KEY=VALUE: {s}")
        k, v = s.split("=", 1)
        out.setdefault((sec, k.strip()), []).append(v.strip())
    return out


def exec_argv(u, path):
    ex = u.get(("Service", "ExecStart"), [])
    if len(ex) != 1:
        raise ValueError(f"{path}: {len(ex)} ExecStart lines")
    cmd = ex[0]
    if cmd[:1] in "-@+!:|" or any(c in cmd for c in "%$;"):
        raise ValueError(f"{path}: ExecStart '{cmd}' uses syntax this stand-in does not emulate")
    argv = shlex.split(cmd)
    if not os.path.isabs(argv[0]):
        raise ValueError(f"{path}: ExecStart '{argv[0]}' is not an absolute path")
    return argv


def one(u, key, default):
    return u.get(("Service", key), [default])[-1]


UNITS, STATE = os.environ.get("FAKE_SYSTEMD_UNITS", ""), os.environ.get("FAKE_SYSTEMD_STATE", "")


def unit_path(name):
    return os.path.join(UNITS, name if name.endswith(".service") else name + ".service")


def base(name):
    return name[:-len(".service")] if name.endswith(".service") else name


def main_pid(name):
    try:
        pid = int(open(os.path.join(STATE, base(name) + ".pid")).read())
        st = open(f"/proc/{pid}/stat").read()
        return pid if st.rsplit(")", 1)[1].split()[0] != "Z" else 0
    except (OSError, ValueError, IndexError):
        return 0


def supervise(name):
    """the detached supervisor: run ExecStart, record the main pid and the exit status"""
    path = unit_path(name)
    u = parse_unit(path)
    argv = exec_argv(u, path)
    user = one(u, "User", "root")
    nofile = int(one(u, "LimitNOFILE", "0"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    n = min(nofile, hard) if hard != resource.RLIM_INFINITY else nofile
    pre = [] if user == "root" else ["runuser", "-u", user, "--"]
    log = open(os.path.join(STATE, base(name) + ".log"), "a")
    p = subprocess.Popen(pre + argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))) if n else None)
    open(os.path.join(STATE, base(name) + ".pid"), "w").write(str(p.pid))
    rc = p.wait()
    open(os.path.join(STATE, base(name) + ".exit"), "w").write(str(rc))
    return 0


def start(name):
    path = unit_path(name)
    if not os.path.exists(path):
        print(f"Failed to start {base(name)}.service: Unit {base(name)}.service not found.", file=sys.stderr)
        return 5
    if main_pid(name):
        return 0
    try:
        exec_argv(parse_unit(path), path)
    except ValueError as e:
        print(f"fake systemctl: {e}", file=sys.stderr)
        return 1
    for ext in (".exit", ".pid"):
        try:
            os.unlink(os.path.join(STATE, base(name) + ext))
        except FileNotFoundError:
            pass
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "__supervise", name], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while not main_pid(name) and time.monotonic() < end:
        time.sleep(0.02)
    return 0 if main_pid(name) or os.path.exists(os.path.join(STATE, base(name) + ".exit")) else 1


def stop(name):
    path = unit_path(name)
    if not os.path.exists(path):
        print(f"Failed to stop {base(name)}.service: Unit {base(name)}.service not found.", file=sys.stderr)
        return 5
    pid = main_pid(name)
    if not pid:
        return 0
    u = parse_unit(path)
    sig = signal.Signals[one(u, "KillSignal", "SIGTERM")]
    tmo = float(one(u, "TimeoutStopSec", "90"))
    os.kill(pid, sig)
    exitf = os.path.join(STATE, base(name) + ".exit")
    end = time.monotonic() + tmo
    while not os.path.exists(exitf) and time.monotonic() < end:
        time.sleep(0.05)
    if not os.path.exists(exitf):
        os.kill(pid, signal.SIGKILL)
        while not os.path.exists(exitf):
            time.sleep(0.05)
    return 0


def main(a):
    if len(a) >= 2 and a[0] == "__supervise":
        return supervise(a[1])
    if not UNITS or not STATE:
        print("fake systemctl: set FAKE_SYSTEMD_UNITS and FAKE_SYSTEMD_STATE", file=sys.stderr)
        return 2
    if a == ["daemon-reload"]:
        return 0
    if len(a) in (2, 3) and a[0] == "is-active" and (len(a) == 2 or a[1] == "-q"):
        active = bool(main_pid(a[-1]))
        if len(a) == 2:
            print("active" if active else "inactive")
        return 0 if active else 3
    if len(a) == 2 and a[0] in ("start", "stop", "restart"):
        if a[0] == "start":
            return start(a[1])
        if a[0] == "stop":
            return stop(a[1])
        return stop(a[1]) or start(a[1])
    if len(a) == 5 and a[:4] == ["show", "-p", "MainPID", "--value"]:
        print(main_pid(a[4]))
        return 0
    print(f"fake systemctl: unsupported: {' '.join(a)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
