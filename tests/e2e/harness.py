"""Shared helpers of the Python end-to-end tests.

Recorder appends one `PASS|FAIL|SKIP<TAB>test<TAB>case[: why]` line per case
to $SHOAL_TEST_RESULTS (scripts/test.sh counts them) and echoes it; a test
exits 1 when any case failed and 77 when everything was skipped.
free_port() asks the kernel for a TCP port that is free on 127.0.0.1 now;
terminate(p) ends a process started by a test: SIGTERM, SIGKILL after a grace.
logfile() is a child's stderr file that the test may reread at any time.
health(url) is (status, body) of a server's GET /health; worker_metric(url,
family, wid) the value of a per-worker sample on its /metrics (None: absent);
metrics(url) all its samples.
Serve(cmd) starts `shoal serve` and waits for it; k3_encoder(dir) is the
tiktoken reference of a K3 model's tokenizer.
sh(cmd) runs a command and returns its CompletedProcess (raises on rc != 0
unless check_rc=False). Netns(prefix, subnet) is the hosts of the *_netns
tests: network namespaces on one bridge, tc shaping, delay relays, teardown.
"""
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


class Recorder:
    def __init__(self, test):
        self.test = test
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.path = os.environ.get("SHOAL_TEST_RESULTS")

    def record(self, status, case, why=""):
        self.counts[status] += 1
        line = f"{status}\t{self.test}\t{case}" + (f": {why}" if why else "")
        print(line.replace("\t", " "), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def check(self, case, cond, why=""):
        self.record("PASS" if cond else "FAIL", case, "" if cond else why)
        return cond


def sh(cmd, check_rc=True, **kw):
    """subprocess.run with output captured as text (a str cmd goes through the
    shell); RuntimeError naming rc and stderr's tail when check_rc and rc != 0"""
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)
    if check_rc and r.returncode:
        raise RuntimeError(f"{cmd}: rc {r.returncode}: {r.stderr[-500:]}")
    return r


class Netns:
    """Hosts played by network namespaces joined by one bridge (the *_netns
    tests; needs root and iproute2). Host h lives in namespace
    PREFIX+h+TAG with the address 10.SUBNET.X.(10+i)/24 (i: its place in
    hosts) on veth pHTAG, whose other end vHTAG is a bridge port; the bridge
    is PREFIX+br+TAG, with NET.1/24 in the root namespace when bridge_ip.
    TAG (pid % 10000) and X (from the pid) keep runs in parallel apart.
    setup() raises (after tearing down what it made) when this host cannot;
    teardown() ends every process left in the namespaces and removes them."""

    def __init__(self, prefix, subnet, hosts=("c", "w0", "w1", "w2"), bridge_ip=False):
        self.tag = f"{os.getpid() % 10000}"
        self.hosts = tuple(hosts)
        self.ns = {h: f"{prefix}{h}{self.tag}" for h in self.hosts}
        self.net = f"10.{subnet}.{os.getpid() % 250 + 1}"
        self.ip = {h: f"{self.net}.{10 + i}" for i, h in enumerate(self.hosts)}
        self.br = f"{prefix}br{self.tag}"
        self.bridge_ip = bridge_ip

    def veth(self, h):
        """(the bridge's end, the namespace's end) of h's link"""
        return f"v{h}{self.tag}", f"p{h}{self.tag}"

    def prefix(self, h):
        """argv prefix that runs a command in h's namespace"""
        return ["ip", "netns", "exec", self.ns[h]]

    def exec(self, h, cmd, **kw):
        return sh(self.prefix(h) + list(cmd), **kw)

    def popen(self, h, cmd, **kw):
        return subprocess.Popen(self.prefix(h) + list(cmd), **kw)

    def setup(self):
        try:
            sh(["ip", "link", "add", self.br, "type", "bridge"])
            if self.bridge_ip:
                sh(["ip", "addr", "add", f"{self.net}.1/24", "dev", self.br])
            sh(["ip", "link", "set", self.br, "up"])
            for h in self.hosts:
                sh(["ip", "netns", "add", self.ns[h]])
                a, b = self.veth(h)
                sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
                sh(["ip", "link", "set", a, "master", self.br])
                sh(["ip", "link", "set", a, "up"])
                sh(["ip", "link", "set", b, "netns", self.ns[h]])
                self.exec(h, ["ip", "addr", "add", self.ip[h] + "/24", "dev", b])
                self.exec(h, ["ip", "link", "set", b, "up"])
                self.exec(h, ["ip", "link", "set", "lo", "up"])
        except Exception:
            self.teardown()
            raise

    def setup_or_skip(self, recorder):
        """setup(); False, with the reason recorded as SKIP "all", when this host cannot"""
        try:
            self.setup()
            return True
        except Exception as e:  # noqa: BLE001
            recorder.record("SKIP", "all", f"cannot create namespaces/bridge here: {e}")
            return False

    def link(self, h, up):
        """h's link up or down (down: its packets go nowhere, as when a machine loses power)"""
        self.exec(h, ["ip", "link", "set", self.veth(h)[1], "up" if up else "down"])

    def shape(self, h, mbit, burst, latency="100ms"):
        """a tc tbf qdisc at mbit on both ends of h's link: its egress in its
        namespace, and the bridge port's egress (towards it)"""
        q = ["tbf", "rate", f"{mbit}mbit", "burst", burst, "latency", latency]
        a, b = self.veth(h)
        self.exec(h, ["tc", "qdisc", "add", "dev", b, "root", *q])
        sh(["tc", "qdisc", "add", "dev", a, "root", *q])

    def relay(self, h, listen, target, delay_ms, python=None):
        """tests/e2e/relay.py in h's namespace: listen ("127.0.0.1:PORT") -> target
        ("HOST:PORT"), delay_ms added each way"""
        return self.popen(h, [python or sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                      "relay.py"), listen, target, "--delay-ms",
                              str(delay_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pids(self, h):
        return [int(x) for x in sh(["ip", "netns", "pids", self.ns[h]], check_rc=False).stdout.split()
                if x.isdigit()]

    def kill(self, h, sig=signal.SIGKILL):
        """sig to every process in h's namespace"""
        for pid in self.pids(h):
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def teardown(self, sigs=(signal.SIGTERM, signal.SIGKILL), grace=0.3):
        """every process still in a namespace (sshd sessions, services, workers)
        gets each of sigs in turn, up to grace s apart, until none is left; then
        the namespaces, the bridge ports and the bridge go"""
        for sig in sigs:
            left = [h for h in self.hosts if self.pids(h)]
            if not left:
                break
            for h in left:
                self.kill(h, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(self.pids(h) for h in left):
                time.sleep(0.02)
        for h in self.hosts:
            sh(["ip", "netns", "del", self.ns[h]], check_rc=False)
            sh(["ip", "link", "del", self.veth(h)[0]], check_rc=False)
        sh(["ip", "link", "del", self.br], check_rc=False)


def poll(fn, secs=60, every=0.1):
    """fn() until it returns something true or secs pass: its last value"""
    end = time.monotonic() + secs
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(every)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def terminate(p, timeout=10):
    """SIGTERM p if it still runs, SIGKILL it after timeout s; its exit code"""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def logfile():
    """An anonymous temporary file for a child's stdout/stderr, opened O_APPEND.
    The child shares this open file (and its offset): without O_APPEND a test
    that seeks to 0 to reread the log makes the child's next line overwrite the
    start of it (a lost log line, seen as a flaky check under load)."""
    f = tempfile.TemporaryFile()
    fl = fcntl.fcntl(f.fileno(), fcntl.F_GETFL)
    fcntl.fcntl(f.fileno(), fcntl.F_SETFL, fl | os.O_APPEND)
    return f


def health(url):
    """(status code, parsed body) of GET url/health; a 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def worker_metric(url, family, wid):
    """The value of `family{...worker="wid"...}` on url/metrics, or None."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(family + "{") and f'worker="{wid}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def metrics(url, key=None):
    """{sample (name with labels): value} of GET url/metrics (key: the API key)."""
    req = urllib.request.Request(url + "/metrics")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for l in text.splitlines():
        if l and not l.startswith("#"):
            k, v = l.rsplit(" ", 1)
            out[k] = float(v)
    return out


class Serve:
    """A `shoal serve` process: cmd is its whole argv (with --port 0). Once it
    has printed "listening on URL": .p, .log (logfile()), .url, .port. With
    ready (seconds), waits up to that long for /health to answer 200; past it,
    raises RuntimeError when strict, else leaves the server to the test (its
    first request then fails with the reason). Raises RuntimeError naming the
    first stdout line and the log's tail when the server does not start.
    env: variables added to this process's environment for the server."""

    def __init__(self, cmd, ready=60, strict=False, env=None):
        self.log = logfile()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=dict(os.environ, **env) if env else None)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            terminate(self.p)
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-2000:]!r}")
        self.url = line.strip().split("listening on ")[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        deadline = time.time() + (ready or 0)
        while ready and health(self.url)[0] != 200:
            if time.time() > deadline:
                if strict:
                    raise RuntimeError("server not ready")
                break
            time.sleep(0.1)

    def openai(self, key="unused"):
        """An official OpenAI SDK client of this server (no retries)."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self):
        return metrics(self.url)

    def stop(self):
        return terminate(self.p, 30)


def st_headers(model_dir):
    """(tensor name, header entry) of every tensor of a model directory's
    .safetensors files, files in name order, read from the headers (8-byte
    little-endian length, then JSON; the format itself, not shoal's reader)."""
    import struct
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(model_dir, fn), "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                h = json.loads(f.read(n))
            for k, v in h.items():
                if k != "__metadata__":
                    yield k, v


def moe_split(model_dir, n):
    """n --experts specs splitting every MoE layer's experts into n equal runs"""
    c = json.load(open(os.path.join(model_dir, "config.json")))
    c = c.get("text_config", c)
    L0, L, E = c["first_k_dense_replace"], c["num_hidden_layers"], c["num_experts"]
    return [f"{L0}-{L - 1}:{i * E // n}-{(i + 1) * E // n - 1}" for i in range(n)]


def plan_row(text, label):
    """the five figures of a `shoal plan --measured` table row (reads, coordinator,
    round trips, wire, s/token), or None when no row has that label"""
    m = re.search(r"^  " + re.escape(label) + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
    return [float(x) for x in m.groups()] if m else None


def k3_encoder(model_dir):
    """(tiktoken Encoding, {special token: id}) of a K3 model directory's
    tokenizer (tiktoken.model, tokenizer_config.json) with the K3
    pre-tokenizer pattern (SPEC §5.2) from tools/train_vocab.py: the
    independent reference the tests compare shoal's tokens with."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from train_vocab import K3_PAT_STR
    ranks = load_tiktoken_bpe(os.path.join(model_dir, "tiktoken.model"))
    tc = json.load(open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8"))
    specials = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    name = os.path.basename(os.path.normpath(model_dir))
    return tiktoken.Encoding(name, pat_str=K3_PAT_STR, mergeable_ranks=ranks, special_tokens=specials), specials


def k3_answer_marks(enc, specials):
    """(head, tail): the ids around an answer's content in K3's XTML
    (SPEC §5.4): [thinking] head CONTENT tail, head = </think> <response>,
    tail = </response> </message> <|end_of_msg|>."""
    def t(s):
        return enc.encode(s, disallowed_special=())
    sp = specials
    head = [sp["<|close|>"]] + t("think") + [sp["<|sep|>"], sp["<|open|>"]] + t("response") + [sp["<|sep|>"]]
    tail = ([sp["<|close|>"]] + t("response") + [sp["<|sep|>"], sp["<|close|>"]] + t("message") +
            [sp["<|sep|>"], sp["<|end_of_msg|>"]])
    return head, tail


def k3_answer(enc, specials, ids, thinking):
    """The reference's answer ids with the XTML structure removed: (reasoning,
    content, index of the first content id, whether the tail ended it), or
    None when ids have another structure (no head with thinking on, or a
    special token left in the content)."""
    head, tail = k3_answer_marks(enc, specials)
    body, start, reasoning = list(ids), 0, ""
    if thinking:
        for i in range(len(body) - len(head) + 1):
            if body[i:i + len(head)] == head:
                reasoning, body, start = enc.decode(body[:i]), body[i + len(head):], i + len(head)
                break
        else:
            return None
    ended = body[-len(tail):] == tail
    if ended:
        body = body[:-len(tail)]
    if any(x in specials.values() for x in body):
        return None
    return reasoning, enc.decode(body), start, ended


def children(pid):
    """{pid: (state, argv)} of the direct children of pid (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            rest = st[st.rindex(")") + 2:].split()
            if int(rest[1]) != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            out[int(d)] = (rest[0], [a.decode(errors="replace") for a in argv if a])
        except (OSError, ValueError):
            continue
    return out


def worker_pid(srv, wid):
    """(pid, argv) of the live `shoal expert` child of srv (a Popen) named
    wid ("w0", ...), or (None, None)."""
    for pid, (state, argv) in children(srv.pid).items():
        if "expert" in argv and wid in argv and state != "Z":
            return pid, argv
    return None, None
