"""Raw-socket checks of `shoal serve`'s HTTP handling: malformed and oversized
requests, slow and idle clients, keep-alive, pipelining, a client that stops
reading. The server must answer with the right status (or close), stay
healthy, and never crash. Real engine on tests/models/tiny-k3; short
timeouts are set with flags so the slow-client cases take seconds.
Appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS."""
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")
RESULTS = os.environ.get("SHOAL_TEST_RESULTS")
NAME = "test_http_raw"
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def record(status, case, why=""):
    counts[status] += 1
    line = f"{status}\t{NAME}\t{case}" + (f": {why}" if why else "")
    print(line.replace("\t", " "), flush=True)
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(line + "\n")


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def run(case, fn, *a):
    try:
        fn(*a)
        record("PASS", case)
    except Exception as e:
        traceback.print_exc()
        record("FAIL", case, f"{type(e).__name__}: {str(e)[:300]}")


class Server:
    def __init__(self, *args):
        self.p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", "0", "--model-name", "tiny", "--threads", "1", "--workers", "2", "--worker-threads", "1", *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.p.stdout.readline()
        check("listening on" in line, f"server did not start: {line!r}")
        self.url = line.strip().split("listening on ")[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self):
        self.p.terminate()
        try:
            return self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return -9


def conn(S):
    s = socket.create_connection(("127.0.0.1", S.port), timeout=10)
    return s


def read_all(s, limit=10.0):
    """Reads until the server closes (or the time limit); returns the bytes."""
    s.settimeout(limit)
    out = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except socket.timeout:
        pass
    except ConnectionResetError:
        pass
    return out


def read_response(s, limit=10.0):
    """One Content-Length response; returns (status, headers dict, body)."""
    s.settimeout(limit)
    buf = b""
    while b"\r\n\r\n" not in buf:
        b = s.recv(65536)
        check(b, f"closed before a response: {buf!r}")
        buf += b
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdr = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:]}
    n = int(hdr.get("content-length", "0"))
    while len(rest) < n:
        b = s.recv(65536)
        check(b, "closed inside a body")
        rest += b
    return status, hdr, rest[:n], rest[n:]


def healthy(S):
    with urllib.request.urlopen(S.url + "/health", timeout=10) as r:
        return r.status == 200


def t_malformed(S):
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
        (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 505),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS ClientHello
    ]
    for raw, want in cases:
        s = conn(S)
        s.sendall(raw)
        out = read_all(s, 5)
        s.close()
        check(out.startswith(b"HTTP/1.1 %d " % want), f"{raw[:40]!r}: {out[:60]!r}")
        body = out.split(b"\r\n\r\n", 1)[1]
        check(json.loads(body)["error"]["message"], "an OpenAI error body")
    check(healthy(S), "healthy after malformed requests")


def t_oversized(S):
    # headers over --max-header-kb 4
    s = conn(S)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 6000 + b"\r\n\r\n")
    out = read_all(s, 5)
    s.close()
    check(out.startswith(b"HTTP/1.1 431 "), f"big header: {out[:60]!r}")
    # a body announced over --max-body-kb 8: refused before it is sent
    s = conn(S)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    out = read_all(s, 5)
    s.close()
    check(out.startswith(b"HTTP/1.1 413 "), f"big body: {out[:60]!r}")
    # a chunked body that grows over the limit
    s = conn(S)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        for _ in range(20):
            s.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    out = read_all(s, 5)
    s.close()
    check(out.startswith(b"HTTP/1.1 413 "), f"big chunked body: {out[:60]!r}")
    # many headers
    s = conn(S)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(100)) + b"\r\n")
    out = read_all(s, 5)
    s.close()
    check(out.startswith(b"HTTP/1.1 431 "), f"many headers: {out[:60]!r}")
    # Expect: 100-continue gets the interim response, then the answer
    body = json.dumps({"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "temperature": 0}).encode()
    s = conn(S)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
              % len(body))
    s.settimeout(5)
    interim = s.recv(4096)
    check(interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), f"100-continue: {interim!r}")
    s.sendall(body)
    st, _, b, _ = read_response(s, 30)
    check(st == 200 and json.loads(b)["usage"]["completion_tokens"] == 1, f"after 100-continue: {st}")
    s.close()
    check(healthy(S), "healthy after oversized requests")


def t_keepalive_pipelining(S):
    s = conn(S)
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for _ in range(3):  # sequential on one connection
        s.sendall(req)
        st, hdr, body, _ = read_response(s)
        check(st == 200 and hdr.get("connection") == "keep-alive", f"keep-alive: {st} {hdr}")
    # three pipelined in one write, answered in order
    body = json.dumps({"model": "tiny", "prompt": [9, 9], "max_tokens": 2, "temperature": 0}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    s.sendall(req + post + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = read_all(s, 30)
    s.close()
    parts = out.split(b"HTTP/1.1 ")[1:]
    check(len(parts) == 3, f"three responses, got {len(parts)}")
    check(b'"ready":true' in parts[0] and b'"text_completion"' in parts[1] and b'"object":"list"' in parts[2],
          "in request order")


def t_slow_client(S):
    # --request-timeout 2: a request trickled too slowly is answered 408 and closed
    s = conn(S)
    t0 = time.time()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    got = b""
    try:
        for ch in b"Content-Length: 10\r\n\r\n0123456789":
            s.sendall(bytes([ch]))
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got = read_all(s, 5)
    dt = time.time() - t0
    s.close()
    check(got.startswith(b"HTTP/1.1 408 "), f"slow sender: {got[:60]!r}")
    check(1.5 <= dt <= 8, f"closed after {dt:.1f} s")
    # idle keep-alive connection (--idle-timeout 2) is closed silently
    s = conn(S)
    t0 = time.time()
    out = read_all(s, 10)
    dt = time.time() - t0
    s.close()
    check(out == b"" and 1.5 <= dt <= 8, f"idle close after {dt:.1f} s: {out[:40]!r}")
    # many half-open slow connections do not stop others from being served
    hogs = []
    for _ in range(20):
        h = conn(S)
        h.sendall(b"GET /health HTTP/1.1\r\n")
        hogs.append(h)
    check(healthy(S), "served while slow clients hold connections")
    for h in hogs:
        h.close()


def t_non_reader(S):
    """A streaming client that never reads: the server drops it after
    --write-timeout, and keeps serving others meanwhile."""
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0,
                       "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", S.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    check(healthy(S), "served while a client does not read")
    s.close()


def t_survives(S):
    check(healthy(S), "healthy at the end")
    check(S.p.poll() is None, "still running")


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    S = Server("--max-header-kb", "4", "--max-body-kb", "8", "--request-timeout", "2", "--idle-timeout", "2",
               "--write-timeout", "2", "--memo", "0")
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if healthy(S):
                    break
            except Exception:
                time.sleep(0.1)
        run("malformed", t_malformed, S)
        run("oversized", t_oversized, S)
        run("keepalive_pipelining", t_keepalive_pipelining, S)
        run("slow_client", t_slow_client, S)
        run("non_reader", t_non_reader, S)
        run("survives", t_survives, S)
    finally:
        rc = S.stop()
    run("clean_shutdown", lambda: check(rc == 0, f"exit code {rc}"))
    if counts["FAIL"]:
        return 1
    return 0 if counts["PASS"] else 77


if __name__ == "__main__":
    sys.exit(main())
