#!/usr/bin/env python3
"""A small Hugging Face-style model store for the `shoal pull` tests and
benchmark (stdlib only, threaded HTTP/1.1 with keep-alive).

  GET /OWNER/NAME/resolve/REV/FILE   the hub: small files answered here (ETag,
                                     Range); *.safetensors redirected (302, with
                                     X-Linked-Etag = the file's sha256 and
                                     X-Linked-Size, as the real hub does) to
  GET /cdn/SHA256/FILE               the "CDN" (a second listening port when
                                     --cdn-port is given), which serves Range
                                     requests: 206 + Content-Range, 416 past the
                                     end, an optional RFC 9530 Content-Digest.
  GET /_control?mode=M&count=N&...   set a fault mode for the next N ranged CDN
                                     responses (count=-1: until reset), after
                                     skip=K unharmed ones; with target=hub, for
                                     the next N whole-file hub responses instead
                                     (small files: config.json, the index, the
                                     tokenizer files), file=NAME: only NAME's
  GET /_stats                        counters (JSON); /_reset zeroes them

Fault modes: flip (one byte of the body inverted; the Content-Digest, when on,
still names the true bytes, as if corrupted on the way), truncate (half the
body, then the connection is closed), ignore_range (200 with the whole file),
bad_range (a Content-Range for other bytes), error (HTTP `code`, with
Retry-After: 0), slow (`rate` bytes/s), short_length (a Content-Length 10 bytes
short of the body, whose last 10 bytes are then not sent: a well-formed response
that is a truncated file), chunked_short (Content-Length of the whole file, and
Transfer-Encoding: chunked carrying half of it, properly ended: a lying
Content-Length that HTTP lets the chunking override), redirect (302 to
`location`, e.g. ftp://...).

With --token T every hub request must carry "Authorization: Bearer T" (else
401); the CDN needs none and counts the requests that carried one anyway.

usage: hubserver.py --repo OWNER/NAME --revision REV --root DIR [--port P]
       [--cdn-port P] [--token T] [--digest] [--rate B] [--fast-etag] [--port-file F]
"""
import argparse
import base64
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {"mode": None, "count": 0, "code": 503, "rate": 0, "skip": 0, "target": "cdn", "file": None,
         "location": ""}
STATS = {"requests": 0, "hub_requests": 0, "cdn_requests": 0, "range_requests": 0, "body_bytes": 0,
         "cdn_auth": 0, "unauthorized": 0, "faults": 0, "ranges": [], "clients": []}
SHA = {}


FAST_ETAG = False


def sha256_of(path):
    with LOCK:
        if path in SHA:
            return SHA[path]
    if FAST_ETAG:  # the benchmark's sparse 1.5 TB layout: name, size and mtime stand in for the content
        st = os.stat(path)
        return hashlib.sha256(f"{path} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    with LOCK:
        SHA[path] = h.hexdigest()
    return SHA[path]


def take_fault(target="cdn", name=None):
    """The fault mode for this response (a ranged CDN one, or a whole-file hub
    one), or None (and count it)."""
    with LOCK:
        m = STATE["mode"]
        if not m or STATE["count"] == 0 or STATE["target"] != target:
            return None
        if STATE["file"] and name != STATE["file"]:
            return None
        if STATE["skip"] > 0:
            STATE["skip"] -= 1
            return None
        if STATE["count"] > 0:
            STATE["count"] -= 1
        STATS["faults"] += 1
        return m


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hubserver"

    def log_message(self, *a):
        pass

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_plain(self, code, body, extra=()):
        b = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        cfg = self.server.cfg
        u = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(u.path)
        with LOCK:
            STATS["requests"] += 1
            if not path.startswith("/_") and self.client_address[0] not in STATS["clients"]:
                STATS["clients"].append(self.client_address[0])
        if path == "/_stats":
            with LOCK:
                return self.send_plain(200, json.dumps(STATS))
        if path == "/_reset":
            with LOCK:
                for k in STATS:
                    STATS[k] = [] if k in ("ranges", "clients") else 0
                STATE.update(mode=None, count=0)
            return self.send_plain(200, "{}")
        if path == "/_control":
            q = dict(urllib.parse.parse_qsl(u.query))
            with LOCK:
                STATE["mode"] = q.get("mode") or None
                STATE["count"] = int(q.get("count", "1"))
                STATE["code"] = int(q.get("code", "503"))
                STATE["rate"] = int(q.get("rate", "0"))
                STATE["skip"] = int(q.get("skip", "0"))
                STATE["target"] = q.get("target", "cdn")
                STATE["file"] = q.get("file") or None
                STATE["location"] = q.get("location", "")
            return self.send_plain(200, "{}")
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})/(.+)", path)
        if m:
            with LOCK:
                STATS["cdn_requests"] += 1
                if self.headers.get("Authorization"):
                    STATS["cdn_auth"] += 1
            return self.serve_file(m.group(2), cdn=True, sha=m.group(1))
        prefix = f"/{cfg.repo}/resolve/{cfg.revision}/"
        if not path.startswith(prefix):
            return self.send_plain(404, json.dumps({"error": "Repository or revision not found"}))
        with LOCK:
            STATS["hub_requests"] += 1
        if cfg.token and self.headers.get("Authorization") != f"Bearer {cfg.token}":
            with LOCK:
                STATS["unauthorized"] += 1
            return self.send_plain(401, json.dumps({"error": "Invalid credentials in Authorization header"}))
        name = path[len(prefix):]
        fp = self.local(name)
        if fp is None:
            return self.send_plain(404, json.dumps({"error": "Entry not found"}), [("X-Error-Code", "EntryNotFound")])
        if name.endswith(".safetensors"):
            sha = sha256_of(fp)
            host = self.headers.get("Host", "127.0.0.1").rsplit(":", 1)[0]
            port = cfg.cdn_port or self.server.server_address[1]
            loc = f"http://{host}:{port}/cdn/{sha}/{urllib.parse.quote(name)}?X-Amz-Signature=test"
            self.send_response(302)
            self.send_header("Location", loc)
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(os.path.getsize(fp)))
            self.send_header("ETag", '"%s"' % hashlib.sha1(name.encode()).hexdigest())
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        return self.serve_file(name, cdn=False)

    def local(self, name):
        root = self.server.cfg.root
        fp = os.path.normpath(os.path.join(root, name))
        if not fp.startswith(os.path.abspath(root) + os.sep) or not os.path.isfile(fp):
            return None
        return fp

    def serve_file(self, name, cdn, sha=None):
        fp = self.local(name)
        if fp is None:
            return self.send_plain(404, json.dumps({"error": "Entry not found"}))
        size = os.path.getsize(fp)
        etag = f'"{sha or sha256_of(fp)}"'
        rng = self.headers.get("Range")
        fault = None
        if rng is None:
            a, b, code = 0, size - 1, 200
            fault = take_fault("hub", name) if not cdn else None
            if fault == "error":
                return self.send_plain(STATE["code"], json.dumps({"error": "injected"}), [("Retry-After", "0")])
        else:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m:
                return self.send_plain(400, json.dumps({"error": "bad Range"}))
            a = int(m.group(1))
            b = int(m.group(2)) if m.group(2) else size - 1
            if a >= size or b < a:
                return self.send_plain(416, json.dumps({"error": "Range Not Satisfiable"}),
                                       [("Content-Range", f"bytes */{size}")])
            b = min(b, size - 1)
            code = 206
            with LOCK:
                STATS["range_requests"] += 1
                STATS["ranges"].append([name, a, b - a + 1])
            fault = take_fault() if cdn else None
            if fault == "ignore_range":
                a, b, code = 0, size - 1, 200
            if fault == "error":
                return self.send_plain(STATE["code"], json.dumps({"error": "injected"}), [("Retry-After", "0")])
        if fault == "redirect":
            self.send_response(302)
            self.send_header("Location", STATE["location"])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(fp, "rb") as f:
            f.seek(a)
            body = f.read(b - a + 1)
        if fault == "short_length":
            body = body[:max(0, len(body) - 10)]
        if fault == "chunked_short":
            half = body[:len(body) // 2]
            self.send_response(code)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(b"%x\r\n" % len(half) + half + b"\r\n0\r\n\r\n")
            self.close_connection = True
            return
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        if code == 206:
            ca = a + 1 if fault == "bad_range" else a
            self.send_header("Content-Range", f"bytes {ca}-{ca + len(body) - 1}/{size}")
        if self.server.cfg.digest:
            d = base64.b64encode(hashlib.sha256(body).digest()).decode()
            self.send_header("Content-Digest", f"sha-256=:{d}:")
        self.end_headers()
        if fault == "flip" and body:
            body = bytearray(body)
            body[len(body) // 2] ^= 0xFF
            body = bytes(body)
        try:
            if fault == "truncate":
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                with LOCK:
                    STATS["body_bytes"] += len(body) // 2
                return
            rate = STATE["rate"] if fault == "slow" else self.server.cfg.rate
            step = 1 << 16
            for i in range(0, len(body), step):
                self.wfile.write(body[i:i + step])
                with LOCK:
                    STATS["body_bytes"] += len(body[i:i + step])
                if rate:
                    time.sleep(len(body[i:i + step]) / rate)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--revision", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cdn-port", type=int, default=-1, help="-1: none (the CDN on the hub port); 0: any free port")
    ap.add_argument("--token")
    ap.add_argument("--digest", action="store_true")
    ap.add_argument("--rate", type=int, default=0, help="bytes/s per response (0: unlimited)")
    ap.add_argument("--port-file")
    ap.add_argument("--fast-etag", action="store_true", help="ETag from name, size and mtime, not the sha256")
    cfg = ap.parse_args()
    global FAST_ETAG
    FAST_ETAG = cfg.fast_etag
    cfg.root = os.path.abspath(cfg.root)
    hub = Server((cfg.host, cfg.port), Handler)
    cdn = None
    if cfg.cdn_port >= 0:
        cdn = Server((cfg.host, cfg.cdn_port), Handler)
        cfg.cdn_port = cdn.server_address[1]
        cdn.cfg = cfg
        threading.Thread(target=cdn.serve_forever, daemon=True).start()
    else:
        cfg.cdn_port = 0
    hub.cfg = cfg
    if cfg.port_file:
        tmp = cfg.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": hub.server_address[1], "cdn_port": cfg.cdn_port or hub.server_address[1]}, f)
        os.rename(tmp, cfg.port_file)
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
