#!/usr/bin/env python3
"""The coordinator's memory with `--trunk remote` (issue 16): it holds none of
the remote rows, and of the embedding table only the rows it reads.

On the k3-scale model (real K3 widths: the same trunk matrices per layer as
the k3-slice, 2 layers, a 4096-token vocabulary; ~2.1 GB, regenerated
bit-identically into $SHOAL_BUILD/k3-scale by tools/ensure_scale_model.sh
and kept there for the scale tests), one worker owns the routed experts and
every row of every row-shardable matrix (`--trunk '*:all'`). `shoal run`
prefills 200 distinct token ids spread over the vocabulary and decodes 8.
Its peak resident set (ru_maxrss of the child, measured here; the run's own
peak_vmhwm_bytes must agree) must stay below

    bound = scratch + sequence state (fixed + per token x max_context)
          + the trunk tensors that stay local (every tensor of the checkpoint
            that is neither a routed expert, nor the embedding table, nor
            row-shardable by PROTOCOL.md §7.1 -- worked out here from the
            safetensors headers, not asked of the code)
          + the embedding rows read (prompt + generated) and the row buffer
            (max_batch rows)
          + 64 MiB for code, libraries, heap, thread stacks, ZeroMQ and the
            tokenizer;

the same run with the trunk in-process (the control) must exceed it (so the
bound measures something: the trunk is ~1.8 GB), and both must give the same
token ids. The same bound holds for `--workers 2 --trunk remote` (issue 34:
the two local workers spawned by the run take the routed experts and half of
every row-shardable matrix each), measured as the coordinator's own VmHWM
(the workers are its children, so ru_maxrss would count them), plus the
request buffers of its second worker link (PROTOCOL.md section 8 sizes, on
both clients), with the same ids. Each case appends PASS/FAIL/SKIP lines to $SHOAL_TEST_RESULTS.
Time: ~20 s with the model in place (first generation ~40 s more).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_trunk_memory"
SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
BUILD = os.environ.get("SHOAL_BUILD", os.path.join(SRC, "build"))
MODEL = os.path.join(BUILD, "k3-scale")
ALLOW = 64 << 20
R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check

# ru_maxrss of one child, in a fresh interpreter so no earlier child counts
MEASURE = ("import json,resource,subprocess,sys\n"
           "r=subprocess.run(sys.argv[1:],capture_output=True,text=True)\n"
           "print(json.dumps({'rc':r.returncode,'out':r.stdout,'err':r.stderr[-3000:],"
           "'maxrss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024}))\n")


def tensors(d):
    """name -> (shape, nbytes) over the model's safetensors files."""
    out = {}
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(d, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        for k, v in h.items():
            if k != "__metadata__":
                out[k] = (v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
    return out


def local_bytes(ts):
    """Bytes of the trunk tensors a coordinator with every shardable matrix
    remote still reads: PROTOCOL.md §7.1's rule, applied by hand."""
    tot = 0
    for k, (shape, nb) in ts.items():
        if not k.startswith("language_model."):
            continue  # the vision tower and projector: not the text model's
        if ".experts." in k and "shared_experts" not in k:
            continue  # routed experts (remote experts: not bound at all)
        if k.endswith("embed_tokens.weight"):
            continue  # counted as rows read
        shardable = len(shape) == 2 and shape[0] >= 2 and not k.endswith("kv_b_proj.weight")
        if not shardable:
            tot += nb
    return tot


def run(args, timeout=180):
    r = subprocess.run([sys.executable, "-c", MEASURE] + args, capture_output=True, text=True, timeout=timeout)
    m = json.loads(r.stdout)
    j = json.loads(m["out"]) if m["rc"] == 0 and m["out"].strip() else None
    return m["rc"], j, m["maxrss"], m["err"]


def main():
    if not os.path.exists(BIN):
        record("SKIP", "all", f"{BIN} not built")
        return 77
    py = os.environ.get("SHOAL_PYTHON", sys.executable)
    free = os.statvfs(BUILD)
    if not os.path.isdir(MODEL) and free.f_bavail * free.f_frsize < 3_000_000_000:
        record("SKIP", "all", f"k3-scale: less than 3 GB free in {BUILD}")
        return 77
    t0 = time.monotonic()
    g = subprocess.run(["bash", os.path.join(SRC, "tools", "ensure_scale_model.sh"), MODEL],
                       env=dict(os.environ, SHOAL_PYTHON=py), capture_output=True, text=True)
    if g.returncode != 0:
        record("SKIP" if "numpy" in g.stderr + g.stdout else "FAIL", "k3-scale model",
               (g.stdout + g.stderr)[-400:])
        return 77 if "numpy" in g.stderr + g.stdout else 1
    print(f"model ready in {time.monotonic() - t0:.1f} s", flush=True)
    ts = tensors(MODEL)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    cfg = cfg.get("text_config", cfg)
    d, V, L0 = cfg["hidden_size"], cfg["vocab_size"], cfg["first_k_dense_replace"]
    moe = f"{L0}-{cfg['num_hidden_layers'] - 1}:0-{cfg['num_experts'] - 1}"
    prompt = sorted({(i * 2011 + 7) % V for i in range(200)})
    gen = 8
    tmp = tempfile.mkdtemp(prefix="shoal-tmem-")
    ep = f"ipc://{tmp}/w"
    w = subprocess.Popen([BIN, "expert", "--model", MODEL, "--listen", ep, "--threads", "2", "--experts", moe,
                          "--trunk", "*:all"], stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/w.log", "w"))
    base = [BIN, "run", "--model", MODEL, "--ids", ",".join(map(str, prompt)), "--gen", str(gen), "--json",
            "--threads", "2", "--hello-timeout-ms", "60000", "--expert-timeout-ms", "60000", "--worker", ep]
    try:
        rc, j, rss, err = run(base + ["--trunk", "remote"])
        if not check("--trunk remote run", rc == 0 and j is not None, err[-600:]):
            return 1
        check("--trunk remote: really remote", j.get("trunk_remote_matrices", 0) > 0 and
              j.get("decode_trunk_round_trips_per_token", 0) > 0, str(j.get("trunk_remote_matrices")))
        state = j["seq_state_fixed_bytes"] + j["seq_state_bytes_per_token"] * j["max_context"]
        emb = (len(prompt) + gen) * d * 2 + j["max_batch"] * d * 2
        loc = local_bytes(ts)
        bound = j["scratch_bytes"] + state + loc + emb + ALLOW
        trunk_all = sum(nb for k, (s, nb) in ts.items() if not (".experts." in k and "shared_experts" not in k))
        detail = (f"peak {rss / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB = scratch "
                  f"{j['scratch_bytes'] / 2**20:.1f} + state {state / 2**20:.1f} + local trunk {loc / 2**20:.1f} + "
                  f"embedding rows {emb / 2**20:.1f} + {ALLOW >> 20} allowance; whole trunk {trunk_all / 2**20:.1f} MiB")
        print(detail, flush=True)
        check("--trunk remote: peak RSS below the bound", rss < bound, detail)
        check("--trunk remote: the run's own VmHWM agrees (within 8 MiB)",
              abs(j.get("peak_vmhwm_bytes", 0) - rss) < (8 << 20), f"{j.get('peak_vmhwm_bytes')} vs {rss}")
        rc2, j2, rss2, err2 = run(base)
        if check("control: the trunk in-process", rc2 == 0 and j2 is not None, err2[-600:]):
            check("control: its peak RSS is above the bound (the bound is meaningful)", rss2 > bound,
                  f"peak {rss2 / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB")
            check("same token ids with the trunk remote and in-process", j["generated_ids"] == j2["generated_ids"],
                  f"{j['generated_ids']} vs {j2['generated_ids']}")
        # issue 34: the trunk on the run's own local workers
        lw = [a for a in base if a != ep]
        lw = lw[:lw.index("--worker")] + lw[lw.index("--worker") + 1:]
        rc3, j3, _, err3 = run(lw + ["--workers", "2", "--worker-threads", "1", "--trunk", "remote"])
        if check("--workers 2 --trunk remote run", rc3 == 0 and j3 is not None, err3[-600:]):
            vm = j3.get("peak_vmhwm_bytes", 0)
            check("--workers 2 --trunk remote: really remote", j3.get("trunk_remote_matrices", 0) > 0,
                  str(j3.get("trunk_remote_matrices")))
            state3 = j3["seq_state_fixed_bytes"] + j3["seq_state_bytes_per_token"] * j3["max_context"]
            # one worker more than the control's: the links' per-worker request buffers (PROTOCOL.md
            # section 8: act 16 + 4 T latent, route 16 + 8 n with n = T k pairs), on each of the
            # coordinator's two clients (experts, trunk rows)
            kk = cfg["num_experts_per_token"]
            T3 = j3["max_batch"]
            per_worker = 2 * (16 + 4 * T3 * cfg["routed_expert_hidden_size"] + 16 + 8 * T3 * kk)
            bound3 = j3["scratch_bytes"] + state3 + loc + emb + ALLOW + per_worker
            d3 = (f"coordinator VmHWM {vm / 2**20:.1f} MiB, bound {bound3 / 2**20:.1f} MiB (the bound above + "
                  f"{per_worker / 2**20:.1f} MiB of request buffers for the second worker)")
            print(d3, flush=True)
            check("--workers 2 --trunk remote: the coordinator's peak RSS below the bound", 0 < vm < bound3, d3)
            check("--workers 2 --trunk remote: the same ids as in-process", j3["generated_ids"] == j2["generated_ids"]
                  if j2 else False, f"{j3['generated_ids']}")
    finally:
        harness.terminate(w, 5)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
