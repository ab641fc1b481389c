#!/usr/bin/env python3
"""The exit-code table of docs/CONFIG.md ("Exit codes"), walked (issue 20, item 11).

The expected code of every case is read from the documentation table, not from
the code: each backticked case name in a row's last column must have a runner
here, and every runner must be named in the table (so neither can drift). A
case passes when the command exits with its row's code, printed a reason on
stderr (for codes other than 0), and did not hang (every run has a deadline).
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_exit_codes"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
PLAIN = os.path.join(SRC, "tests", "models", "tiny-k3-plain")
R = harness.Recorder(T)
TMP = tempfile.mkdtemp(prefix="shoal-exit-")
os.chmod(TMP, 0o700)
procs = []


def doc_table():
    """{case name: expected exit code} from docs/CONFIG.md's exit-code table"""
    text = open(os.path.join(SRC, "docs", "CONFIG.md")).read()
    sec = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in sec.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|[^|]*\|(.*)\|\s*$", line)
        if m:
            for name in re.findall(r"`([^`]+)`", m.group(2)):
                out[name] = int(m.group(1))
    return out


def sh(*args, timeout=60, env=None):
    try:
        r = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env=None if env is None else {**os.environ, **env})
        return r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else ""


def worker(model, ranges, name):
    ep = f"ipc://{TMP}/{name}.sock"
    log = open(os.path.join(TMP, name + ".log"), "w")
    p = subprocess.Popen([BIN, "expert", "--model", model, "--experts", ranges, "--listen", ep, "--threads", "1"],
                         stdout=subprocess.DEVNULL, stderr=log)
    procs.append(p)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not os.path.exists(f"{TMP}/{name}.sock") and p.poll() is None:
        time.sleep(0.05)
    return ep


def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    procs.append(s)
    return s.getsockname()[1]


def serve(*args, timeout=60):
    return sh("serve", "--model", TINY, "--port", "0", *args, timeout=timeout)


def run(*args, timeout=60):
    return sh("run", "--model", TINY, "--ids", "1,2,3", "--gen", "1", *args, timeout=timeout)


def fifo_model():
    d = os.path.join(TMP, "fifo-model")
    if not os.path.isdir(d):
        os.mkdir(d)
        for f in os.listdir(TINY):
            if f != "model-00002-of-000003.safetensors":
                shutil.copy(os.path.join(TINY, f), d)
        os.mkfifo(os.path.join(d, "model-00002-of-000003.safetensors"))
    return d


def fifo_tokconfig_model():
    """tiny-k3 with tokenizer_config.json a FIFO (issue 30 item 5: it hung run and serve)"""
    d = os.path.join(TMP, "fifo-tokconfig")
    if not os.path.isdir(d):
        os.mkdir(d)
        for f in os.listdir(TINY):
            if f != "tokenizer_config.json":
                shutil.copy(os.path.join(TINY, f), d)
        os.mkfifo(os.path.join(d, "tokenizer_config.json"))
    return d


def nan_model():
    """tiny-k3 with every lm_head weight a bf16 NaN"""
    import json
    import struct
    d = os.path.join(TMP, "nan-model")
    if not os.path.isdir(d):
        shutil.copytree(TINY, d)
        idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
        with open(os.path.join(d, idx["language_model.lm_head.weight"]), "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            a, b = json.loads(f.read(n))["language_model.lm_head.weight"]["data_offsets"]
            f.seek(8 + n + a)
            f.write(b"\xc0\x7f" * ((b - a) // 2))
    return d


def keypair():
    k = os.path.join(TMP, "k")
    if not os.path.exists(k + ".key"):
        subprocess.run([BIN, "keygen", "-o", k], capture_output=True, timeout=30)
    return k


def bad_allow():
    p = os.path.join(TMP, "allow-bad")
    with open(p, "w") as f:
        f.write("public not-a-z85-key\n")
    return p


def silent_router():
    """a ZeroMQ endpoint that accepts connections and never answers (pyzmq)"""
    import zmq
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    ep = f"ipc://{TMP}/silent.sock"
    s.bind(ep)
    procs.append(s)
    return ep


CASES = {
    "shoal --help": lambda: sh("--help"),
    "keygen new prefix": lambda: sh("keygen", "-o", os.path.join(TMP, "new")),
    "inspect tiny model": lambda: sh("inspect", TINY),
    "unknown command": lambda: sh("no-such-command"),
    "serve --host localhost --insecure": lambda: serve("--host", "localhost", "--insecure"),
    "serve --workers 100": lambda: serve("--workers", "100"),
    "run --workers 100": lambda: run("--workers", "100"),
    "serve --worker-key count mismatch": lambda: serve(
        "--worker", "tcp://127.0.0.1:1", "--worker", "tcp://127.0.0.1:2", "--curve-secret", keypair() + ".key",
        "--worker-key", keypair() + ".pub"),
    "expert --curve-allow malformed": lambda: sh(
        "expert", "--model", TINY, "--experts", "1-8:0-23", "--listen", f"tcp://127.0.0.1:{harness.free_port()}",
        "--curve-secret", keypair() + ".key", "--curve-allow", bad_allow()),
    "keygen over an existing key": lambda: sh("keygen", "-o", keypair()),
    "pull --endpoint ftp://x": lambda: sh("pull", "--repo", "a/b", "--revision", "main", "--endpoint", "ftp://x",
                                          "--config-only", "--to", os.path.join(tempfile.gettempdir(), "shoal-x")),
    "expert --experts malformed": lambda: sh("expert", "--model", TINY, "--experts", "1-8:zz",
                                             "--listen", f"ipc://{TMP}/m.sock"),
    "inspect missing model": lambda: sh("inspect", os.path.join(TMP, "no-such-dir")),
    "expert invalid model": lambda: sh("expert", "--model", os.path.join(TMP, "no-such-dir"), "--experts",
                                       "1-8:0-23", "--listen", f"ipc://{TMP}/inv.sock"),
    "serve FIFO tokenizer_config.json": lambda: sh("serve", "--model", fifo_tokconfig_model(), "--port", "0",
                                                  timeout=20),
    "version --bogus": lambda: sh("version", "--bogus"),
    "expert SHOAL_ISA=bogus": lambda: sh("expert", "--model", TINY, "--experts", "1-8:0-23", "--listen",
                                         f"ipc://{TMP}/isa.sock", env={"SHOAL_ISA": "bogus"}),
    "run SHOAL_MX_DECODE=bogus": lambda: sh("run", "--model", TINY, "--ids", "1,2,3", "--gen", "1",
                                            env={"SHOAL_MX_DECODE": "bogus"}),
    "serve SHOAL_AMX_VARIANT=bogus": lambda: sh("serve", "--model", TINY, "--port", "0",
                                                env={"SHOAL_AMX_VARIANT": "bogus"}),
    "expert FIFO shard": lambda: sh("expert", "--model", fifo_model(), "--experts", "1-8:0-23", "--listen",
                                    f"ipc://{TMP}/fifo.sock", timeout=20),
    "run coverage gap": lambda: run("--worker", worker(TINY, "1-8:0-11", "gap-a"), "--hello-timeout-ms", "20000"),
    "serve coverage gap": lambda: serve("--worker", worker(TINY, "1-8:0-11", "gap-b"), "--hello-timeout-ms",
                                        "20000"),
    "run fingerprint mismatch": lambda: run("--worker", worker(PLAIN, "1-4:0-15", "fp-a"), "--hello-timeout-ms",
                                            "20000"),
    "serve fingerprint mismatch": lambda: serve("--worker", worker(PLAIN, "1-4:0-15", "fp-b"),
                                                "--hello-timeout-ms", "20000"),
    "expert --experts beyond the model": lambda: sh("expert", "--model", TINY, "--experts", "1-99:0-23",
                                                    "--listen", f"ipc://{TMP}/beyond.sock"),
    "run NaN lm_head": lambda: sh("run", "--model", nan_model(), "--ids", "1,2,3", "--gen", "2"),
    "serve --port in use": lambda: sh("serve", "--model", TINY, "--port", str(busy_port())),
    "expert --listen in use": lambda: sh("expert", "--model", TINY, "--experts", "1-8:0-23", "--listen",
                                         f"tcp://127.0.0.1:{busy_port()}", "--insecure"),
    "serve worker never answers": lambda: serve("--worker", silent_router(), "--hello-timeout-ms", "1500"),
}


def main():
    if not os.path.exists(BIN) or not os.path.isdir(TINY):
        R.record("SKIP", "all", "build/bin/shoal or tests/models/tiny-k3 missing")
        return 77
    table = doc_table()
    try:
        R.check("the docs table names every case this test runs, and nothing else",
                set(table) == set(CASES) and len(table) >= 20,
                f"only in docs: {sorted(set(table) - set(CASES))}; only here: {sorted(set(CASES) - set(table))}")
        for name, want in table.items():
            if name not in CASES:
                continue
            t0 = time.monotonic()
            rc, err = CASES[name]()
            dt = time.monotonic() - t0
            R.check(f"{name}: exit {want}", rc == want and (want == 0 or err.strip()),
                    f"exit {rc} after {dt:.1f} s; stderr: {err.strip()[-400:]}")
    finally:
        for p in procs:
            if isinstance(p, subprocess.Popen):
                harness.terminate(p)
            else:
                p.close()
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{R.counts['PASS']} passed, {R.counts['FAIL']} failed, {R.counts['SKIP']} skipped")
    return 1 if R.counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
