"""Shared helpers of the Python end-to-end tests.

Recorder appends one `PASS|FAIL|SKIP<TAB>test<TAB>case[: why]` line per case
to $SHOAL_TEST_RESULTS (scripts/test.sh counts them) and echoes it; a test
exits 1 when any case failed and 77 when everything was skipped.
free_port() asks the kernel for a TCP port that is free on 127.0.0.1 now;
terminate(p) ends a process started by a test: SIGTERM, SIGKILL after a grace.
logfile() is a child's stderr file that the test may reread at any time.
health(url) is (status, body) of a server's GET /health; worker_metric(url,
family, wid) the value of a per-worker sample on its /metrics (None: absent).
"""
import fcntl
import json
import os
import signal
import socket
import subprocess
import tempfile
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
