"""shoal chooses how its OpenMP threads wait (cli/omp_wait.c): passive unless
the user's environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT. The evidence is
libgomp's own report of the settings it initialised with (OMP_DISPLAY_ENV=
verbose prints them to stderr at library start, once per process image), not
shoal's word for it:
  - `shoal version`: the re-executed image runs with GOMP_SPINCOUNT '0'
    (passive) and says "openmp wait passive (shoal's default)";
  - a user's OMP_WAIT_POLICY=active / GOMP_SPINCOUNT=1234 is what libgomp uses;
  - `shoal run --workers 2`: the coordinator and both spawned `shoal expert`
    processes run passive (three images with spin count 0; the one 300000
    block is the coordinator's first image, before its re-exec), and the
    generated ids equal those of a run with OMP_WAIT_POLICY=active (waiting
    never changes a result)."""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Recorder  # noqa: E402

SRC = os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal"))
MODEL = os.path.join(SRC, "tests", "models", "tiny-k3")


def env_with(**kv):
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SHOAL_OMP_WAIT")}
    e["OMP_DISPLAY_ENV"] = "verbose"
    e.update(kv)
    return e


def spins(stderr):
    """GOMP_SPINCOUNT of every libgomp start, in order"""
    return [int(v) for v in re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)]


def main():
    rec = Recorder("omp_wait")
    p = subprocess.run([BIN, "version"], env=env_with(), capture_output=True, text=True, timeout=30)
    s = spins(p.stderr)
    rec.check("version: the last libgomp start is passive (spin 0)", p.returncode == 0 and s and s[-1] == 0,
              f"rc {p.returncode}, spin counts {s}")
    rec.check("version reports the policy", "openmp wait passive (shoal's default)" in p.stdout, p.stdout)

    p = subprocess.run([BIN, "version"], env=env_with(OMP_WAIT_POLICY="active"), capture_output=True, text=True,
                       timeout=30)
    s = spins(p.stderr)
    rec.check("user OMP_WAIT_POLICY=active respected (one start, active spin count)",
              p.returncode == 0 and len(s) == 1 and s[0] > 10**9 and "openmp wait active (from the environment)"
              in p.stdout, f"spin counts {s}, stdout {p.stdout!r}")
    p = subprocess.run([BIN, "version"], env=env_with(GOMP_SPINCOUNT="1234"), capture_output=True, text=True,
                       timeout=30)
    s = spins(p.stderr)
    rec.check("user GOMP_SPINCOUNT respected", p.returncode == 0 and s == [1234], f"spin counts {s}")

    args = [BIN, "run", "--model", MODEL, "--ids", "1,2,3,4", "--gen", "6", "--workers", "2", "--threads", "2",
            "--json"]
    p = subprocess.run(args, env=env_with(), capture_output=True, text=True, timeout=120)
    s = spins(p.stderr)
    ok = p.returncode == 0 and s.count(0) == 3 and len(s) == 4 and s[0] == 300000
    rec.check("run --workers 2: coordinator and both expert servers passive", ok,
              f"rc {p.returncode}, spin counts {s}, stderr tail {p.stderr[-600:]!r}")
    q = subprocess.run(args, env=env_with(OMP_WAIT_POLICY="active"), capture_output=True, text=True, timeout=120)
    sq = spins(q.stderr)
    rec.check("run --workers 2 with OMP_WAIT_POLICY=active: all three processes active",
              q.returncode == 0 and len(sq) == 3 and all(v > 10**9 for v in sq), f"spin counts {sq}")
    if p.returncode == 0 and q.returncode == 0:
        a, b = json.loads(p.stdout)["generated_ids"], json.loads(q.stdout)["generated_ids"]
        rec.check("same ids passive and active", a == b and len(a) == 6, f"{a} vs {b}")
    c = rec.counts
    print(f"{c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped")
    sys.exit(1 if c["FAIL"] else 0)


if __name__ == "__main__":
    main()
