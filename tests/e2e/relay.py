#!/usr/bin/env python3
"""A TCP relay for the tests and benchmarks (issue 10): listens on a port,
forwards every connection to a target, optionally records every byte in each
direction (to show what an observer of the link sees) and optionally delays
each chunk by a fixed one-way delay (this kernel has no netem qdisc), keeping
order. Usable as a module (Relay) or a program:

    relay.py LISTEN_HOST:PORT TARGET_HOST:PORT [--delay-ms D] [--record FILE]

The delay is applied per direction, so a round trip through the relay gains
2·D plus the relay's own forwarding cost; `measure()` measures what it
actually adds (a ping-pong of small messages with and without the relay).
"""
import heapq
import socket
import sys
import threading
import time


class Relay:
    def __init__(self, target, listen=("127.0.0.1", 0), delay_ms=0.0, record=False):
        self.target = target
        self.delay = delay_ms / 1000.0
        self.record = record
        self.up = bytearray()    # client -> target
        self.down = bytearray()  # target -> client
        self.lock = threading.Lock()
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(listen)
        self.srv.listen(64)
        self.port = self.srv.getsockname()[1]
        self.stopped = False
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                t = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            t.settimeout(None)
            for s in (c, t):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns += [c, t]
            threading.Thread(target=self._pump, args=(c, t, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(t, c, self.down), daemon=True).start()

    def _pump(self, src, dst, log):
        if self.delay <= 0:
            while True:
                try:
                    b = src.recv(65536)
                except OSError:
                    b = b""
                if not b:
                    break
                if self.record:
                    with self.lock:
                        log.extend(b)
                try:
                    dst.sendall(b)
                except OSError:
                    break
        else:  # reader stamps chunks, writer sends each at stamp + delay, in order
            q, cv, done = [], threading.Condition(), [False]

            def writer():
                seq = 0
                while True:
                    with cv:
                        while not q and not done[0]:
                            cv.wait()
                        if not q:
                            break
                        due, _, b = heapq.heappop(q)
                    wait = due - time.monotonic()
                    if wait > 0.0003:  # sleep overshoots by ~0.1 ms: sleep most, spin the rest
                        time.sleep(wait - 0.0003)
                    while time.monotonic() < due:
                        pass
                    try:
                        dst.sendall(b)
                    except OSError:
                        break
                    seq += 1
            wt = threading.Thread(target=writer, daemon=True)
            wt.start()
            n = 0
            while True:
                try:
                    b = src.recv(65536)
                except OSError:
                    b = b""
                if not b:
                    break
                if self.record:
                    with self.lock:
                        log.extend(b)
                with cv:
                    heapq.heappush(q, (time.monotonic() + self.delay, n, b))
                    n += 1
                    cv.notify()
            with cv:
                done[0] = True
                cv.notify()
            wt.join()
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.stopped = True
        self.srv.close()
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def run():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def serve(c=c):
                while True:
                    b = c.recv(65536)
                    if not b:
                        return
                    c.sendall(b)
            threading.Thread(target=serve, daemon=True).start()
    threading.Thread(target=run, daemon=True).start()
    return srv


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _rtt(s, msg):
    t0 = time.perf_counter()
    s.sendall(msg)
    got = 0
    while got < len(msg):
        got += len(s.recv(65536))
    return time.perf_counter() - t0


def measure(delay_ms, n=200, size=64, spread=None):
    """Median round trip of a 64-byte ping-pong: direct, and through a relay
    with delay_ms each way, the two alternating so that both see the same
    machine load. Returns (direct_s, relayed_s). With a list as spread, appends
    the noise of their difference: the half-width of the interquartile range
    of the direct round trips plus that of the relayed ones (a difference of
    two medians is only known to about that)."""
    echo = _echo_server()
    port = echo.getsockname()[1]
    r = Relay(("127.0.0.1", port), delay_ms=delay_ms)
    d, rl = _connect(port), _connect(r.port)
    msg = b"x" * size
    direct, relayed = [], []
    for _ in range(n):
        direct.append(_rtt(d, msg))
        relayed.append(_rtt(rl, msg))
    d.close()
    rl.close()
    r.close()
    echo.close()
    direct.sort()
    relayed.sort()
    if spread is not None:
        q = lambda v: (v[(3 * n) // 4] - v[n // 4]) / 2  # noqa: E731
        spread.append(q(direct) + q(relayed))
    return direct[n // 2], relayed[n // 2]


def main():
    sys.setswitchinterval(0.0002)  # threads waiting for the GIL would otherwise wait up to 5 ms
    if len(sys.argv) >= 2 and sys.argv[1] == "--measure":
        d = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
        spread = []
        a, b = measure(d, spread=spread)
        print(f"delay_ms_each_way {d} direct_rtt_us {a * 1e6:.1f} relayed_rtt_us {b * 1e6:.1f} "
              f"added_us {(b - a) * 1e6:.1f} noise_us {spread[0] * 1e6:.1f}")
        return 0
    lh, lp = sys.argv[1].rsplit(":", 1)
    th, tp = sys.argv[2].rsplit(":", 1)
    delay = 0.0
    rec = None
    args = sys.argv[3:]
    while args:
        if args[0] == "--delay-ms":
            delay = float(args[1])
        elif args[0] == "--record":
            rec = args[1]
        args = args[2:]
    r = Relay((th, int(tp)), listen=(lh, int(lp)), delay_ms=delay, record=rec is not None)
    print(f"relay {lh}:{r.port} -> {th}:{tp}, delay {delay} ms each way", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    if rec:
        open(rec + ".up", "wb").write(r.up)
        open(rec + ".down", "wb").write(r.down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
