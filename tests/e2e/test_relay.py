#!/usr/bin/env python3
"""The relay tree for trunk inputs (PROTOCOL.md §3.9, proto 1.8), with real
`shoal expert` processes over ipc://.

Worker cases (a raw pyzmq DEALER plays the coordinator, so every byte it
sends is written here from the spec, not by shoal's client):
- HELLO announces the relay peers in `--relay-peers` order;
- a tree w0 -> w1 -> w2 (w0 the root with x and `fwd`, w1 and w2 only the
  header with `xid`): every worker's TRUNK_RESULT equals, bit for bit, its
  answer to the same rows sent directly with x -- with the headers sent
  before the root's request (requests parked, waiting for their input) and
  after it (inputs parked, waiting for their request);
- a TRUNK_X from a connection whose HELLO did not say `relay` is refused with
  ERROR UNKNOWN_TYPE;
- bounds: 8 relayed requests without input are parked, a 9th is answered
  ERROR INTERNAL "relay queue full", the 8 expire after their wait_ms with
  ERROR INTERNAL naming their xid; as a relay parent the raw client sends 9
  inputs without requests: 8 parked, the 9th dropped, all counted on the
  worker's /metrics (shoal_expert_server_relay_*);
- a root whose `fwd` names a peer it does not have: ERROR BAD_SHAPE.
Coordinator cases: `shoal run --relay-fanout 0/2/3/greedy` against the
in-process run (ids, logits, the tree's TRUNK_X counts per worker, the
coordinator's trunk bytes exactly); a stopped relay parent; a plan's relay
(greedy, with its relay_rates) honoured; CURVE relay links.
Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from k3_projection import greedy_schedule  # noqa: E402

try:
    import msgpack
    import zmq
    IMPORT_ERR = None
except ImportError as e:  # pragma: no cover
    msgpack = zmq = None
    IMPORT_ERR = str(e)

T = "test_relay"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
TINY = os.path.join(SRC, "tests", "models", "tiny-k3")
R = harness.Recorder(T)
check, record, counts = R.check, R.record, R.counts
tmp = tempfile.mkdtemp(prefix="shoal-relay-")
procs = []

HELLO, ERROR, PING, TBATCH, TRESULT, TRUNK_X = 1, 2, 3, 12, 13, 16
F32 = 1
MALFORMED, UNKNOWN_TYPE, BAD_SHAPE, INTERNAL = 1, 5, 6, 11
GATE = "language_model.model.layers.0.mlp.gate_proj.weight"  # [192, 96] BF16 in tiny-k3
WIDTH = 96


def fingerprint(model):
    r = subprocess.run([BIN, "expert", "--model", model, "--print-fingerprint"], capture_output=True, text=True,
                       timeout=60)
    return bytes.fromhex(r.stdout.strip())


def start_workers(n, peers=True, trunk=lambda i, n: f"*:{i}/{n}"):
    """n trunk workers, worker i owning the rows trunk(i, n) names (default
    rows i/n of every matrix), all given the same --relay-peers list
    (themselves included); (endpoints, metrics urls)"""
    start_workers.k += 1
    eps = [f"ipc://{tmp}/s{start_workers.k}w{i}" for i in range(n)]
    urls = []
    for i, ep in enumerate(eps):
        port = harness.free_port()
        urls.append(f"http://127.0.0.1:{port}")
        args = [BIN, "expert", "--model", TINY, "--listen", ep, "--id", f"w{i}", "--threads", "1",
                "--trunk", trunk(i, n), "--metrics-port", str(port)]
        if peers:
            args += ["--relay-peers", ",".join(eps)]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                      stderr=open(f"{tmp}/s{start_workers.k}w{i}.log", "w")))
    return eps, urls


def start_expert_worker():
    """the routed experts on one more worker (no trunk rows); its endpoint"""
    eex = f"ipc://{tmp}/wex{start_workers.k}"
    procs.append(subprocess.Popen([BIN, "expert", "--model", TINY, "--listen", eex, "--id", "wex", "--threads", "1",
                                   "--experts", moe_range(TINY)], stdout=subprocess.DEVNULL,
                                  stderr=open(f"{tmp}/wex{start_workers.k}.log", "w")))
    return eex


start_workers.k = 0


def wait_linked(n):
    """the last start_workers(n) are up: each HELLOed by its n - 1 peers as their relay parent"""
    def linked():
        k = 0
        for i in range(n):
            with open(f"{tmp}/s{start_workers.k}w{i}.log") as f:
                k += f.read().count("as a relay parent")
        return k == n * (n - 1)
    return harness.poll(linked, 60)


def relay_metric(url, wid, what):
    v = harness.worker_metric(url, f"shoal_expert_server_relay_{what}_total", wid)
    return int(v) if v is not None else None


class Raw:
    """A raw DEALER to one worker: HELLO on connect (relay_parent: `relay: true`)."""

    def __init__(self, ctx, ep, fp, relay_parent=False):
        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.setsockopt(zmq.RCVTIMEO, 20000)
        self.s.connect(ep)
        body = {"proto": [1, 8], "fingerprint": fp, "peer": "raw"}
        if relay_parent:
            body["relay"] = True
        self.send([HELLO, 1, body])
        self.hello = self.recv()[0]

    def send(self, ctl, *frames):
        self.s.send_multipart([msgpack.packb(ctl, use_bin_type=True)] + list(frames))

    def recv(self):
        fr = self.s.recv_multipart()
        return [msgpack.unpackb(fr[0], raw=False)] + fr[1:]


def xframe(T, seed):
    vals = [((seed * 7 + i * 13) % 29 - 14) / 8.0 for i in range(T * WIDTH)]
    return b"SHTF" + bytes([F32, 0, 0, 0]) + struct.pack("<II", T, WIDTH) + struct.pack(f"<{T * WIDTH}f", *vals)


def mats(i, n):
    lo, hi = i * 192 // n, (i + 1) * 192 // n - 1
    return [[GATE, lo, hi]]


def case_worker(fp):
    eps, urls = start_workers(3)
    ctx = zmq.Context()
    try:
        if not check("workers up, each linked to by its 2 peers (HELLO relay: true)", wait_linked(3)):
            return
        c = [Raw(ctx, e, fp) for e in eps]
        check("HELLO reply lists the relay peers in --relay-peers order (1.8)",
              all(h[2].get("relay") == eps and h[2]["proto"] == [1, 8] for h in (x.hello for x in c)),
              f"{[x.hello[2].get('relay') for x in c]}")
        T = 3
        x = xframe(T, 1)
        # direct answers: the reference bits
        ref = []
        for i in range(3):
            c[i].send([TBATCH, 10 + i, {"layer": 0, "mats": mats(i, 3)}], x)
        for i in range(3):
            r = c[i].recv()
            ref.append(r[1] if r[0][0] == TRESULT and r[0][1] == 10 + i else None)
        if not check("direct TRUNK_BATCH answered by every worker", all(ref), f"{ref}"):
            return
        # relayed: w0 root, w1 its child, w2 w1's child; headers before and after the root
        for order, xid, rid0 in (("headers first (requests parked)", 1001, 20), ("root first (inputs parked)", 1002, 30)):
            parked0 = [relay_metric(u, f"w{i}", "parked") or 0 for i, u in enumerate(urls)]
            def headers():
                for i in (1, 2):
                    c[i].send([TBATCH, rid0 + i, {"layer": 0, "mats": mats(i, 3), "xid": xid, "wait_ms": 10000}])
            if order.startswith("headers"):
                headers()
            c[0].send([TBATCH, rid0, {"layer": 0, "mats": mats(0, 3), "xid": xid, "wait_ms": 10000,
                                      "fwd": [[1, 0], [2, 1]]}], x)
            if not order.startswith("headers"):
                # the case's premise: w1 and w2 hold the input parked before their requests come
                check(f"{order}: w1 and w2 parked the input before their requests were sent",
                      harness.poll(lambda: [relay_metric(urls[i], f"w{i}", "parked") for i in (1, 2)] ==
                                   [parked0[1] + 1, parked0[2] + 1], 20),
                      f"parked {[relay_metric(urls[i], f'w{i}', 'parked') for i in (1, 2)]}, before {parked0}")
                headers()
            got = []
            for i in range(3):
                r = c[i].recv()
                got.append((r[0][0], r[0][1], r[1] if len(r) > 1 else r[0][2]))
            same = all(g[0] == TRESULT and g[1] == rid0 + i and g[2] == ref[i] for i, g in enumerate(got))
            check(f"tree w0 -> w1 -> w2, {order}: every TRUNK_RESULT bit-identical to the direct one", same,
                  f"{[(g[0], g[1], g[2] if g[0] == ERROR else len(g[2])) for g in got]}")
        ins = [relay_metric(u, f"w{i}", "in") for i, u in enumerate(urls)]
        outs = [relay_metric(u, f"w{i}", "out") for i, u in enumerate(urls)]
        check("relay counters: w0 forwarded 2, w1 took 2 and forwarded 2, w2 took 2", ins == [0, 2, 2] and
              outs == [2, 2, 0], f"in {ins} out {outs}")

        # TRUNK_X from a connection that is not a relay parent: refused
        c[2].send([TRUNK_X, 0, {"xid": 5, "wait_ms": 1000}], x)
        r = c[2].recv()[0]
        check("TRUNK_X from a non-parent connection refused with ERROR UNKNOWN_TYPE",
              r[0] == ERROR and r[2]["code"] == UNKNOWN_TYPE and "relay parent" in r[2]["message"], f"{r}")
        check("... and counted", relay_metric(urls[2], "w2", "refused") == 1)

        # a root naming a peer it does not have (index 3 of 3; index 0 is itself)
        for bad in (3, 0):
            c[0].send([TBATCH, 40 + bad, {"layer": 0, "mats": mats(0, 3), "xid": 2000 + bad, "wait_ms": 1000,
                                          "fwd": [[bad, 0]]}], x)
            r = c[0].recv()[0]
            check(f"root whose fwd names peer {bad} ({'not in the list' if bad else 'itself'}): ERROR BAD_SHAPE",
                  r[0] == ERROR and r[2]["code"] == BAD_SHAPE, f"{r}")

        # bounds: 9 requests without input on w2, short wait
        t0 = time.monotonic()
        for k in range(9):
            c[2].send([TBATCH, 100 + k, {"layer": 0, "mats": mats(2, 3), "xid": 3000 + k, "wait_ms": 400}])
        replies = [c[2].recv()[0] for _ in range(9)]
        dt = time.monotonic() - t0
        full = [r for r in replies if r[0] == ERROR and r[2]["code"] == INTERNAL and "queue full" in r[2]["message"]]
        exp = [r for r in replies if r[0] == ERROR and r[2]["code"] == INTERNAL and "xid 30" in r[2]["message"]]
        check("9 relayed requests without input: the 9th answered 'relay queue full' at once",
              len(full) == 1 and full[0][1] == 108 and replies[0][1] == 108, f"{[(r[1], r[2]) for r in replies]}")
        check("... the 8 parked expire after their wait_ms (ERROR INTERNAL naming the xid)",
              len(exp) == 8 and sorted(r[1] for r in exp) == list(range(100, 108)) and dt >= 0.35,
              f"{len(exp)} expired, {dt:.2f} s")
        # as a relay parent: 9 inputs without requests on w1
        p = Raw(ctx, eps[1], fp, relay_parent=True)
        base = {k: relay_metric(urls[1], "w1", k) for k in ("in", "parked", "dropped", "expired")}
        for k in range(9):
            p.send([TRUNK_X, 0, {"xid": 4000 + k, "wait_ms": 300}], x)
        p.send([PING, 2, {}])  # in order after the 9 notices: when PONG is here, they were taken
        pong = p.recv()[0]
        now = {k: relay_metric(urls[1], "w1", k) for k in ("in", "parked", "dropped")}
        check("9 inputs without requests from a relay parent: never answered, 8 parked, the 9th dropped",
              pong[0] == 4 and pong[1] == 2 and now["in"] - base["in"] == 9 and now["parked"] - base["parked"] == 8
              and now["dropped"] - base["dropped"] == 1, f"{pong} {base} {now}")
        ok = harness.poll(lambda: relay_metric(urls[1], "w1", "expired") - base["expired"] == 8, 10)
        check("... and the 8 expire after their wait_ms", ok)
        # a request for an input that expired waits for a new one (then expires itself)
        c[1].send([TBATCH, 200, {"layer": 0, "mats": mats(1, 3), "xid": 4000, "wait_ms": 200}])
        r = c[1].recv()[0]
        check("a request whose input already expired is not paired with it (expires: ERROR INTERNAL)",
              r[0] == ERROR and r[1] == 200 and r[2]["code"] == INTERNAL, f"{r}")
    finally:
        ctx.destroy(linger=0)
        for p_ in procs:
            harness.terminate(p_, 5)
        procs.clear()


def moe_range(model):
    c = json.load(open(os.path.join(model, "config.json")))
    c = c.get("text_config", c)
    return f"{c['first_k_dense_replace']}-{c['num_hidden_layers'] - 1}:0-{c['num_experts'] - 1}"


def run(args, gen=6, timeout=120):
    out = f"{tmp}/logits{time.monotonic_ns()}.bin"
    r = subprocess.run([BIN, "run", "--model", TINY, "--ids", "5,17,3,99,42,7", "--gen", str(gen), "--json",
                        "--dump-logits", out, "--hello-timeout-ms", "20000"] + args,
                       capture_output=True, text=True, timeout=timeout)
    j = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    lg = open(out, "rb").read() if os.path.exists(out) else b""
    return r.returncode, j, lg, r.stderr


def sum_metric(urls, what):
    return sum(relay_metric(u, f"w{i}", what) or 0 for i, u in enumerate(urls))


def case_coordinator():
    """4 trunk workers (rows i/4, relay peers of each other) and an expert
    worker; `shoal run --trunk remote --relay-fanout F` for F = 0, 2, 3 and
    greedy (rates forcing a depth-3 unbalanced tree) against the in-process run; then the same with --workers 4 (local workers given
    each other as peers)."""
    rc, ref, ref_lg, err = run([])
    if not check("coordinator: in-process reference run", rc == 0 and ref and ref_lg, err[-300:]):
        return
    eps, urls = start_workers(4)
    eex = start_expert_worker()
    if not check("coordinator: 4 trunk workers up and linked to each other", wait_linked(4)):
        return
    base = ["--trunk", "remote"] + sum((["--worker", e] for e in [eex] + eps), [])
    sent = {}
    # greedy (relaytree.h): rates that make the coordinator 1000x slower than the peers and a 1 us hop, so
    # that for every x size of the run (80 B .. 2.3 kB) the schedule of 4 members is w0 <- coordinator, w1 and
    # w2 <- w0, w3 <- w1 (depth 3, children 2/1/0/0), and of 3 or 2 the first two places of it
    rates = "0.000001,0.001,1"
    sched = {n: [s[:2] for s in greedy_schedule(n, 2320.0, 1e-6 * 1e9 / 8, 1e-3 * 1e9 / 8, 1e-6)] for n in (2, 3, 4)}
    check("greedy: the Python statement of the schedule for these rates: w0 <- C; w1, w2 <- w0; w3 <- w1",
          sched[4] == [(-1, 1), (0, 1), (0, 2), (1, 1)] and sched[3] == sched[4][:3], f"{sched}")
    for F in (0, 2, 3, "greedy"):
        b_in, b_bytes = sum_metric(urls, "in"), sum_metric(urls, "in_bytes")
        b_out = [relay_metric(u, f"w{i}", "out") for i, u in enumerate(urls)]
        b_ins = [relay_metric(u, f"w{i}", "in") for i, u in enumerate(urls)]
        rc, j, lg, err = run(base + ["--relay-fanout", str(F)] + (["--relay-rates", rates] if F == "greedy" else []))
        if not check(f"relay F={F}: run ok", rc == 0 and j, err[-400:]):
            continue
        check(f"relay F={F}: ids and logits identical to the in-process run",
              j["generated_ids"] == ref["generated_ids"] and lg == ref_lg,
              f"{j['generated_ids']} vs {ref['generated_ids']}")
        n_in, n_bytes = sum_metric(urls, "in") - b_in, sum_metric(urls, "in_bytes") - b_bytes
        relayed = j.get("trunk_relayed_requests", -1)
        check(f"relay F={F}: {'no request' if F == 0 else 'requests'} relayed, no fallback; the workers took as many "
              f"inputs through the tree ({n_in})",
              (relayed == 0 if F == 0 else relayed > 0) and relayed == n_in and j.get("trunk_relay_fallbacks") == 0,
              f"{relayed} relayed, {j.get('trunk_relay_fallbacks')} fallbacks, workers took {n_in}")
        sent[F] = (j["trunk_wire_bytes_out"], n_in, n_bytes)
        outs = [relay_metric(u, f"w{i}", "out") - b_out[i] for i, u in enumerate(urls)]
        if F == "greedy":
            ins = [relay_metric(u, f"w{i}", "in") - b_ins[i] for i, u in enumerate(urls)]
            s = ins[3]  # every step with 4 members gives w3 one input (through w1)
            check("relay greedy: TRUNK_X per worker as the schedule says, every step: w0 sent 2 (to w1, w2), w1 "
                  "took 1 and sent 1 (to w3), w2 and w3 took 1 each and sent none; all relayed by the tree",
                  s > 0 and outs == [2 * s, s, 0, 0] and ins == [0, s, s, s] and relayed == 3 * s and
                  j.get("trunk_relay_fanout") == "greedy", f"out {outs} in {ins} relayed {relayed}")
            continue
        # the tree (PROTOCOL.md §3.9): F roots in worker order, then each level round the previous one's members;
        # with 4 workers F=2: w0 -> w2, w1 -> w3; F=3: w0 -> w3, w1 and w2 plain (steps with fewer workers
        # involved: F=2 with 3, w0 -> w2 only; F=3 with 3 or fewer, no tree)
        want_shape = {0: lambda o: o == [0, 0, 0, 0], 2: lambda o: o[0] >= o[1] > 0 and o[2] == o[3] == 0,
                      3: lambda o: o[0] > 0 and o[1] == o[2] == o[3] == 0}[F]
        check(f"relay F={F}: the roots forward as the tree says (TRUNK_X sent per worker {outs}), as many as "
              "were taken", want_shape(outs) and sum(outs) == n_in, f"{outs}, taken {n_in}")
    if 0 in sent and "greedy" in sent:
        # per step w1, w2, w3 get the header with 'xid' and 'wait_ms' (24 bytes more each, as below) and no x;
        # w0, the root, x and the header with 'xid', 'wait_ms' and 'fwd' [[1, 0], [2, 0], [3, 1]]: 24 + 5 + 3 x 3
        out0, (out, n_in, n_bytes) = sent[0][0], sent["greedy"]
        want = out0 - n_bytes + 24 * n_in + 38 * (n_in // 3)
        check(f"relay greedy: coordinator trunk bytes sent {out0} -> {out} = {out0} - {n_bytes} (x frames the "
              f"workers took via TRUNK_X) + 24 x {n_in} (relay keys) + 38 x {n_in // 3} (the root's keys and fwd)",
              out == want, f"got {out}, formula {want}")
    if 0 in sent:
        for F in (2, 3):
            if F not in sent:
                continue
            # every relayed request leaves its x frame off the coordinator's link; each tree member's header
            # gains 'xid' (a 62-bit random start: 9 bytes) and 'wait_ms' (1000: 3 bytes) with their keys = 24
            # bytes, a root's also 'fwd' [[peer, up]] = 5 + 3 per child. With 4 workers every root with a
            # child has exactly one (F=2: 2 roots x 1 child; F=3: 1 root with 1 child, 2 plain): per relayed
            # request 24 + (24 + 5 + 3) = 56 bytes of headers.
            out0, (out, n_in, n_bytes) = sent[0][0], sent[F]
            want = out0 - n_bytes + 56 * n_in
            check(f"relay F={F}: coordinator trunk bytes sent {out0} -> {out} = {out0} - {n_bytes} (x frames the "
                  f"workers took via TRUNK_X) + 56 x {n_in} (relay keys)", out == want, f"got {out}, formula {want}")
    rc, j, lg, err = run(["--workers", "2", "--relay-fanout", "2"])
    check("--relay-fanout without --trunk remote: refused (exit 2 or 3) naming the need",
          rc != 0 and "--trunk remote" in err, f"rc {rc} {err[-300:]}")
    rc, j, lg, err = run(["--workers", "2", "--trunk", "remote", "--relay-fanout", "1"])
    check("--relay-fanout 1: refused as a usage error (a chain relays nothing)", rc == 2 and "relay" in err,
          f"rc {rc} {err[-300:]}")
    rc, j, lg, err = run(["--workers", "2", "--trunk", "remote", "--relay-fanout", "greedy"])
    check("--relay-fanout greedy without rates (no --relay-rates, no plan): refused naming --relay-rates",
          rc != 0 and "--relay-rates" in err, f"rc {rc} {err[-300:]}")
    for bad in ("1,1", "0,1,5", "1,1,-2", "1,x,3"):
        rc, j, lg, err = run(["--workers", "2", "--trunk", "remote", "--relay-fanout", "greedy", "--relay-rates", bad])
        check(f"--relay-rates {bad}: refused as a usage error", rc == 2 and "--relay-rates" in err,
              f"rc {rc} {err[-300:]}")
    # local workers (--workers 4 --trunk remote): each other's relay peers
    rc, j, lg, err = run(["--workers", "4", "--trunk", "remote", "--relay-fanout", "2"])
    check("--workers 4 --trunk remote --relay-fanout 2: ids and logits identical to the in-process run, "
          "requests relayed", rc == 0 and j and j["generated_ids"] == ref["generated_ids"] and lg == ref_lg
          and j.get("trunk_relayed_requests", 0) > 0, err[-400:])


def case_stopped_parent():
    """Rows replicated on two of 4 trunk workers (worker i: parts i and i+1 of
    4), F = 2 and then greedy (the depth-3 rates of case_coordinator),
    --failover-ms 300: w0, a root of every tree it is in, is SIGSTOPped once
    it has forwarded some inputs mid-stream; its children's requests (and
    under greedy its grandchildren's) get no input, are resent directly, and
    w0's own rows go to their other owners: the stream completes with the
    in-process ids and logits."""
    rc, ref, ref_lg, err = run([], gen=24)
    if not check("stopped parent: in-process reference run", rc == 0 and ref and ref_lg, err[-300:]):
        return
    eps, urls = start_workers(4, trunk=lambda i, n: f"*:{i}/{n},*:{(i + 1) % n}/{n}")
    w0 = procs[-4]
    eex = start_expert_worker()
    if not check("stopped parent: 4 replicated trunk workers up and linked", wait_linked(4)):
        return
    for mode, extra in (("2", []), ("greedy", ["--relay-rates", "0.000001,0.001,1"])):
        stopped = []
        out0 = relay_metric(urls[0], "w0", "out") or 0

        def stopper():
            if harness.poll(lambda: (relay_metric(urls[0], "w0", "out") or 0) >= out0 + 40, 60):
                w0.send_signal(signal.SIGSTOP)
                stopped.append(time.monotonic())
        th = threading.Thread(target=stopper)
        th.start()
        try:
            rc, j, lg, err = run(["--trunk", "remote", "--relay-fanout", mode, "--failover-ms", "300",
                                  "--expert-timeout-ms", "20000"] + extra +
                                 sum((["--worker", e] for e in [eex] + eps), []), gen=24)
        finally:
            th.join()
            w0.send_signal(signal.SIGCONT)
        tag = f"stopped parent (F={mode})"
        check(f"{tag}: w0 was SIGSTOPped mid-stream (after forwarding 40 inputs)", stopped != [])
        check(f"{tag}: the stream completes with the in-process ids and logits",
              rc == 0 and j and j["generated_ids"] == ref["generated_ids"] and lg == ref_lg,
              f"rc {rc} {err[-400:]}")
        check(f"{tag}: its children's requests were resent directly (trunk_relay_fallbacks >= 1)",
              j is not None and j.get("trunk_relay_fallbacks", 0) >= 1 and j.get("trunk_relayed_requests", 0) > 0,
              f"{j and {k_: v for k_, v in j.items() if 'relay' in k_}}")
        # w0 answers again (SIGCONT) before the next run: its backlog of late replies is dropped by the next
        # coordinator (a new process, new connections)


def case_plan():
    """plan.json's relay_fanout (`shoal plan --measured`, chosen behind a slow
    shared NIC: the greedy schedule, with its relay_rates) is honoured: 4
    workers started with `shoal expert --plan P --name wI` take every trunk
    worker of the plan as relay peers, `shoal run --plan P --trunk remote`
    relays with the plan's schedule; ids and logits identical to the
    in-process run."""
    rc, ref, ref_lg, err = run([])
    d = os.path.join(tmp, "plan")
    os.makedirs(d, exist_ok=True)
    json.dump({"format": "shoal-cluster", "version": 1, "coordinator": "c", "worker_port": 5555,
               "hosts": [{"name": "c", "address": "10.0.0.1", "ssh_user": "u", "cpus": 1, "expert_ram": 0}] +
               [{"name": f"w{i}", "address": f"10.0.0.{i + 2}", "ssh_user": "u", "cpus": 1, "expert_ram": "64MiB"}
                for i in range(4)]}, open(f"{d}/cluster.json", "w"))
    json.dump({"format": "shoal-doctor", "version": 1, "coordinator": {"read_bw_all": 1e6}, "workers": [
        {"name": f"w{i}", "ok": True, "host": {"read_bw_all": 1e7}, "rtt_p50_us": 100, "rtt_p99_us": 100,
         "out_bytes_per_s": 1e9, "in_bytes_per_s": 1e9} for i in range(4)]}, open(f"{d}/doctor.json", "w"))
    r = subprocess.run([BIN, "plan", "--model", TINY, "--cluster", f"{d}/cluster.json", "--measured",
                        f"{d}/doctor.json", "--nic-gbps", "0.008", "-o", f"{d}/plan.json"], capture_output=True,
                       text=True, timeout=60)
    pl = json.load(open(f"{d}/plan.json")) if r.returncode == 0 else None
    # the greedy schedule (w0 feeding w1..w3 behind the 1 MB/s NIC) is the fastest here; plan.json carries the
    # rates it was priced with, which run --plan takes
    if not check("plan: shoal plan --measured writes relay_fanout greedy with its relay_rates",
                 pl and pl.get("relay_fanout") == "greedy" and pl.get("relay_rates", {}).get("nic_gbps") == 0.008,
                 r.stdout[-800:] + r.stderr[-300:]):
        return
    for i, w in enumerate(pl["workers"]):  # the same plan on one host: ipc endpoints
        w["endpoint"] = w["listen"] = f"ipc://{d}/w{i}"
    json.dump(pl, open(f"{d}/plan.json", "w"))
    for i in range(4):
        procs.append(subprocess.Popen([BIN, "expert", "--model", TINY, "--plan", f"{d}/plan.json", "--name", f"w{i}",
                                       "--threads", "1"], stdout=subprocess.DEVNULL,
                                      stderr=open(f"{d}/w{i}.log", "w")))

    def linked():
        k = 0
        for i in range(4):
            with open(f"{d}/w{i}.log") as f:
                k += f.read().count("as a relay parent")
        return k == 12
    if not check("plan: 4 workers from the plan, each other's relay peers", harness.poll(linked, 60)):
        return
    rc, j, lg, err = run(["--plan", f"{d}/plan.json", "--trunk", "remote"])
    check("plan: run --plan relays with the plan's schedule (greedy, its rates); ids and logits identical to the "
          "in-process run",
          rc == 0 and j and j.get("trunk_relay_fanout") == "greedy" and j.get("trunk_relayed_requests", 0) > 0 and
          j["generated_ids"] == ref["generated_ids"] and lg == ref_lg, f"rc {rc} {err[-400:]}")


def case_curve():
    """tcp:// with CURVE (PROTOCOL.md §9, §3.9): 3 workers, each with its key
    pair; a parent connects to its children as a CURVE client with its own key
    and each child's --curve-allow lists the coordinator's and the other
    workers' public keys; F = 2 (w0 and w1 roots, w2 under w0): relayed, ids
    identical. Then w2 allows only the coordinator: w0's relay link to it is
    refused in the handshake, w2's requests get no input and are resent
    directly after --failover-ms: the same ids, fallbacks counted."""
    d = tempfile.mkdtemp(prefix="curve", dir=tmp)
    for n in ("coord", "w0", "w1", "w2"):
        r = subprocess.run([BIN, "keygen", "-o", f"{d}/{n}"], capture_output=True, text=True)
        if r.returncode:
            record("SKIP", "curve", f"keygen: {r.stderr.strip()[-200:]}")
            return
    pub = lambda n: open(f"{d}/{n}.pub").read()
    open(f"{d}/allow_all", "w").write("".join(pub(n) for n in ("coord", "w0", "w1", "w2")))
    open(f"{d}/allow_coord", "w").write(pub("coord"))
    rc, ref, ref_lg, err = run([])
    ports = [harness.free_port() for _ in range(3)]
    eps = [f"tcp://127.0.0.1:{p}" for p in ports]
    peers = ",".join(f"{e}@{d}/w{i}.pub" for i, e in enumerate(eps))
    for label, allow2 in (("every worker allows the others", "allow_all"),
                          ("w2 does not allow w0 (relay link refused)", "allow_coord")):
        mine = []
        for i in range(3):
            ex = f"1-8:{8 * i}-{8 * i + 7}"
            mine.append(subprocess.Popen(
                [BIN, "expert", "--model", TINY, "--listen", eps[i], "--id", f"w{i}", "--threads", "1", "--experts", ex,
                 "--trunk", f"*:{i}/3", "--curve-secret", f"{d}/w{i}.key",
                 "--curve-allow", f"{d}/{allow2 if i == 2 else 'allow_all'}", "--relay-peers", peers],
                stdout=subprocess.DEVNULL, stderr=open(f"{d}/w{i}.{allow2}.log", "w")))
        procs.extend(mine)
        try:
            def up():
                txt = [open(f"{d}/w{i}.{allow2}.log").read() for i in range(3)]
                if allow2 == "allow_all":  # every link up: each worker HELLOed by its 2 peers
                    return all(t.count("as a relay parent") == 2 for t in txt)
                return all("serving" in t for t in txt) and "refused" in txt[2] and \
                    txt[0].count("as a relay parent") == 2
            harness.poll(up, 60)
            args = ["--trunk", "remote", "--relay-fanout", "2", "--curve-secret", f"{d}/coord.key",
                    "--failover-ms", "300"]
            for i, e in enumerate(eps):
                args += ["--worker", e, "--worker-key", f"{d}/w{i}.pub"]
            rc, j, lg, err = run(args)
            ok = rc == 0 and j and j["generated_ids"] == ref["generated_ids"] and lg == ref_lg
            if allow2 == "allow_all":
                check(f"curve: {label}: relayed over CURVE links, ids and logits identical, no fallback",
                      ok and j.get("trunk_relayed_requests", 0) > 0 and j.get("trunk_relay_fallbacks") == 0,
                      f"rc {rc} {j and {k: v for k, v in j.items() if 'relay' in k}} {err[-300:]}")
            else:
                w2log = open(f"{d}/w2.{allow2}.log").read()
                check(f"curve: {label}: w2 refused w0's key in the handshake; requests resent directly, ids and "
                      "logits identical", ok and j.get("trunk_relay_fallbacks", 0) >= 1 and "refused" in w2log,
                      f"rc {rc} {j and {k: v for k, v in j.items() if 'relay' in k}} {err[-300:]}")
        finally:
            for p in mine:
                harness.terminate(p, 5)


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    if zmq is None:
        record("SKIP", "relay", f"python zmq/msgpack missing: {IMPORT_ERR}")
        return 77
    try:
        fp = fingerprint(TINY)
        case_worker(fp)
        case_coordinator()
        case_stopped_parent()
        case_plan()
        case_curve()
    finally:
        for p in procs:
            harness.terminate(p, 5)
        if not counts["FAIL"]:  # kept for a look when something failed
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
