"""A headless Chromium driven over the DevTools protocol with the standard
library only (a minimal RFC 6455 WebSocket client): launch, navigate,
evaluate JavaScript, take a screenshot. For the cluster page's test
(tests/e2e/test_webui.py); Debian's `chromium` (scripts/deps.sh)."""
import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


class WS:
    def __init__(self, url, timeout=30):
        m = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
        self.s = socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.s.sendall((f"GET {m.group(3)} HTTP/1.1\r\nHost: {m.group(1)}:{m.group(2)}\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                       .encode())
        resp = b""
        while b"\r\n\r\n" not in resp:
            c = self.s.recv(4096)
            if not c:
                raise ConnectionError("websocket handshake: connection closed")
            resp += c
        head, self.buf = resp.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket handshake: {head[:100]!r}")

    def _read(self, n):
        while len(self.buf) < n:
            c = self.s.recv(1 << 16)
            if not c:
                raise ConnectionError("websocket closed")
            self.buf += c
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text):
        data = text.encode()
        hdr = bytes([0x81])
        n = len(data)
        if n < 126:
            hdr += bytes([0x80 | n])
        elif n < 1 << 16:
            hdr += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            hdr += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.s.sendall(hdr + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self):
        msg = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            op = b0 & 0x0F
            if op == 8:
                raise ConnectionError("websocket closed by the browser")
            if op in (9, 10):  # ping / pong: not expected from DevTools
                continue
            msg += data
            if b0 & 0x80:
                return msg.decode()


class Browser:
    def __init__(self, exe=None, width=1400, height=1000):
        exe = exe or find_chromium()
        self.dir = tempfile.mkdtemp(prefix="shoal_cdp_")
        self.p = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                   "--disable-dev-shm-usage", "--remote-debugging-port=0", "--hide-scrollbars",
                                   f"--user-data-dir={self.dir}", f"--window-size={width},{height}", "about:blank"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.p.stderr.readline()
            if not line and self.p.poll() is not None:
                break
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                port = int(m.group(1))
                break
        if not port:
            self.close()
            raise RuntimeError("chromium did not start (no DevTools port)")
        pages = []
        while time.monotonic() < deadline and not pages:
            pages = [t for t in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
                     if t.get("type") == "page"]
            if not pages:
                time.sleep(0.1)
        self.ws = WS(pages[0]["webSocketDebuggerUrl"])
        self.n = 0

    def call(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv())
            if m.get("id") == self.n:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})

    def navigate(self, url, timeout=30):
        """load url and wait until the new document is complete"""
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        want = url.split("#")[0]
        self.wait(f"document.readyState === 'complete' && location.href.split('#')[0] === {json.dumps(want)}",
                  f"{url} loaded", timeout=timeout)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS: {r['exceptionDetails'].get('text')} {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, what, timeout=15, poll=0.05):
        deadline = time.monotonic() + timeout
        v = None
        while time.monotonic() < deadline:
            try:
                v = self.eval(expr)
            except RuntimeError as e:  # e.g. the element is not there yet
                v = e
            if v and not isinstance(v, RuntimeError):
                return v
            time.sleep(poll)
        raise AssertionError(f"timed out waiting for {what} (last {v!r})")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
