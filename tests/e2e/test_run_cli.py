"""`shoal run` end to end on both tiny models: the CLI's greedy and sampled
continuations equal the reference fixtures (tests/fixtures/<model>/greedy.json,
sampled.json), a text prompt tokenizes to the fixture's prompt ids, results do
not depend on threads or prefill chunking (ids and dumped logits bytes), the
dumped logits have the documented layout, generation stops on a config EOS id,
and the documented exit codes (2 usage, 3 invalid model)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback


class Results:
    """PASS/FAIL lines on stdout and in $SHOAL_TEST_RESULTS; exit 1 on a failure."""

    def __init__(self, test):
        self.test, self.path, self.n = test, os.environ.get("SHOAL_TEST_RESULTS"), {"PASS": 0, "FAIL": 0}

    def check(self, case, fn):
        try:
            fn()
            status, why = "PASS", None
        except Exception as e:  # noqa: BLE001 - every failure is reported
            tb = traceback.extract_tb(e.__traceback__)[-1]
            status, why = "FAIL", f"{type(e).__name__} at line {tb.lineno}: {e}"
        self.n[status] += 1
        line = f"{status}\t{self.test}\t{case}" + (f": {why}" if why else "")
        print(line.replace("\t", " "), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def finish(self):
        print(f"{self.n['PASS']} passed, {self.n['FAIL']} failed, 0 skipped")
        sys.exit(1 if self.n["FAIL"] else 0)


R = Results("test_run_cli")
src = os.environ.get("SHOAL_SRC", ".")
shoal = os.environ.get("SHOAL_BIN", "build/bin/shoal")
tmp = tempfile.mkdtemp(prefix="shoal_run_cli_")
MODELS = ["tiny-k3", "tiny-k3-plain"]


def mdir(name):
    return os.path.join(src, "tests", "models", name)


def fixture(name, f):
    return json.load(open(os.path.join(src, "tests", "fixtures", name, f), encoding="utf-8"))


def run(*args, ok=True):
    if "--threads" not in args and "--help" not in args:
        args = (*args, "--threads", "1")  # OpenMP spin-waits are slow on a loaded CI machine
    p = subprocess.run([shoal, "run", *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    return p


def run_json(*args):
    return json.loads(run(*args, "--json").stdout)


def ids_arg(ids):
    return ",".join(map(str, ids))


def greedy_matches_fixture():
    for name in MODELS:
        g = fixture(name, "greedy.json")
        j = run_json("--model", mdir(name), "--ids", ids_arg(g["prompt_ids"]), "--gen", str(len(g["generated_ids"])))
        assert j["prompt_ids"] == g["prompt_ids"]
        assert j["generated_ids"] == g["generated_ids"], f"{name}: {j['generated_ids']} != {g['generated_ids']}"
        for k in ("text", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes", "stop_reason"):
            assert k in j, f"{name}: no {k} in the JSON"
        assert isinstance(j["text"], str) and j["stop_reason"] == "length"
        assert j["peak_rss_bytes"] > 0 and j["prefill_tokens_per_s"] > 0 and j["decode_tokens_per_s"] > 0


def sampled_matches_fixture():
    for name in MODELS:
        s = fixture(name, "sampled.json")
        j = run_json("--model", mdir(name), "--ids", ids_arg(s["prompt_ids"]), "--gen", str(len(s["generated_ids"])),
                     "--temperature", repr(s["temperature"]), "--top-p", repr(s["top_p"]), "--top-k", str(s["top_k"]),
                     "--seed", str(s["seed"]))
        assert j["generated_ids"] == s["generated_ids"], f"{name}: {j['generated_ids']} != {s['generated_ids']}"


def text_prompt_tokenizes_like_fixture():
    for name in MODELS:
        g = fixture(name, "greedy.json")
        pf = os.path.join(tmp, f"{name}.prompt.txt")
        open(pf, "w", encoding="utf-8").write(g["prompt_text"])
        j = run_json("--model", mdir(name), "--prompt-file", pf, "--gen", "4")
        assert j["prompt_ids"] == g["prompt_ids"], f"{name}: prompt ids {j['prompt_ids']}"
        assert j["generated_ids"] == g["generated_ids"][:4]
        j2 = run_json("--model", mdir(name), "--prompt", g["prompt_text"], "--gen", "4")
        assert j2["prompt_ids"] == g["prompt_ids"]


def threads_and_chunking_do_not_matter():
    for name in MODELS:
        g = fixture(name, "greedy.json")
        outs = []
        for extra in (["--threads", "1"], ["--threads", "2"], ["--threads", "2", "--batch", "3"]):
            d = os.path.join(tmp, f"{name}.{len(outs)}.logits")
            j = run_json("--model", mdir(name), "--ids", ids_arg(g["prompt_ids"]), "--gen", "8", "--dump-logits", d,
                         *extra)
            outs.append((j["generated_ids"], open(d, "rb").read()))
        assert outs[0] == outs[1] == outs[2], f"{name}: results depend on threads or chunking"


def dump_logits_layout():
    name = "tiny-k3"
    g = fixture(name, "greedy.json")
    cfg = json.load(open(os.path.join(mdir(name), "config.json")))
    V = cfg.get("text_config", cfg)["vocab_size"]
    d = os.path.join(tmp, "layout.logits")
    j = run_json("--model", mdir(name), "--ids", ids_arg(g["prompt_ids"]), "--gen", "5", "--dump-logits", d)
    b = open(d, "rb").read()
    assert len(b) == 5 * V * 4, len(b)
    for i in range(5):
        row = struct.unpack_from(f"<{V}f", b, i * V * 4)
        assert max(range(V), key=lambda v: (row[v], -v)) == j["generated_ids"][i]


def stops_on_config_eos():
    name = "tiny-k3"
    g = fixture(name, "greedy.json")
    stop_id = g["generated_ids"][2]
    assert stop_id not in g["generated_ids"][:2]
    d = os.path.join(tmp, "eos-model")
    os.makedirs(d)
    for f in os.listdir(mdir(name)):
        if f != "config.json":
            os.symlink(os.path.join(mdir(name), f), os.path.join(d, f))
    cfg = json.load(open(os.path.join(mdir(name), "config.json")))
    for c in (cfg, cfg.get("text_config", {})):
        if "eos_token_id" in c:
            c["eos_token_id"] = stop_id
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    j = run_json("--model", d, "--ids", ids_arg(g["prompt_ids"]), "--gen", "20")
    assert j["generated_ids"] == g["generated_ids"][:3], j["generated_ids"]
    assert j["stop_reason"] == "eos"


def exit_codes():
    m = mdir("tiny-k3")
    h = run("--help")
    for code in ("0  ok", "2  usage", "3  invalid model", "4  the run failed"):
        assert code in h.stdout, code
    for args in ([], ["--model", m], ["--model", m, "--ids", "1,x"], ["--model", m, "--ids", "1", "--top-p", "2"],
                 ["--model", m, "--ids", "1", "--bogus"], ["--model", m, "--ids", "1", "--prompt", "a"],
                 ["--model", m, "--ids", "99999"]):
        p = run(*args, ok=False)
        assert p.returncode == 2, f"{args}: exit {p.returncode}"
    assert run("--model", os.path.join(tmp, "nonexistent"), "--ids", "1", ok=False).returncode == 3
    # a model directory without one of its shards
    d = os.path.join(tmp, "broken-model")
    os.makedirs(d)
    for f in os.listdir(m):
        if "00002" not in f:
            os.symlink(os.path.join(m, f), os.path.join(d, f))
    p = run("--model", d, "--ids", "1", ok=False)
    assert p.returncode == 3, f"exit {p.returncode}"


for fn in (greedy_matches_fixture, sampled_matches_fixture, text_prompt_tokenizes_like_fixture,
           threads_and_chunking_do_not_matter, dump_logits_layout, stops_on_config_eos, exit_codes):
    R.check(fn.__name__, fn)
shutil.rmtree(tmp, ignore_errors=True)
R.finish()
