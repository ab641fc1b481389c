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
"""
import fcntl
import json
import os
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
    first stdout line and the log's tail when the server does not start."""

    def __init__(self, cmd, ready=60, strict=False):
        self.log = logfile()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
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
