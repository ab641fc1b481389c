#!/usr/bin/env python3
"""The Debian packages deploy/site.yml installs on every host (its apt task,
docs/DEPLOY.md) against what the built binary needs (issue 10):

- every shared library the binary links (its ELF NEEDED entries, read with
  readelf) resolves, through the dynamic loader's cache, to a file that a
  package owns (dpkg -S), and that package is in the apt task's list or among
  those lists' dependencies (apt-cache depends --recurse), or comes with every
  Debian system (the closure of the Essential packages): so a fresh Debian 12
  host that ran site.yml can start the binary;
- every package of the list is known to apt here (a misspelt name would make
  the apt task fail on every host).

The list is read from deploy/site.yml with PyYAML (Ansible's own dependency,
through the system python3). SKIPs (counted) without dpkg, apt-cache,
readelf, ldconfig or PyYAML. Each case appends PASS/FAIL/SKIP lines to
$SHOAL_TEST_RESULTS.
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

T = "test_deploy_packages"
SRC = os.path.abspath(os.environ.get("SHOAL_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")))
BIN = os.path.abspath(os.environ.get("SHOAL_BIN", os.path.join(SRC, "build", "bin", "shoal")))
DEP_OPTS = ["--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces",
            "--no-enhances", "--installed"]


R = harness.Recorder(T)
counts, record, check = R.counts, R.record, R.check


def out(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def apt_list():
    """the `name` list of site.yml's ansible.builtin.apt task, via a python3 with PyYAML"""
    code = ("import json,sys,yaml\n"
            "doc=yaml.safe_load(open(sys.argv[1]))\n"
            "print(json.dumps([t['ansible.builtin.apt']['name'] for p in doc for t in p.get('tasks',[])"
            " if 'ansible.builtin.apt' in t]))\n")
    for py in (sys.executable, "/usr/bin/python3"):
        r = out([py, "-c", code, os.path.join(SRC, "deploy", "site.yml")])
        if r.returncode == 0:
            return json.loads(r.stdout)
    return None


def closure(pkgs):
    """pkgs and everything they depend on, recursively (one apt-cache call)"""
    r = out(["apt-cache", "depends", *DEP_OPTS, *pkgs])
    return {ln.strip().split(":")[0] for ln in r.stdout.splitlines() if ln and not ln[0].isspace()} | set(pkgs)


def candidates(pkgs):
    """{package: candidate version or None} (one apt-cache policy call)"""
    r = out(["apt-cache", "policy", *pkgs])
    res, cur = {}, None
    for ln in r.stdout.splitlines():
        if ln and not ln[0].isspace() and ln.endswith(":"):
            cur = ln[:-1]
        elif cur and ln.strip().startswith("Candidate:"):
            v = ln.split(":", 1)[1].strip()
            res[cur] = None if v == "(none)" else v
    return res


def main():
    missing = [t for t in ("dpkg", "dpkg-query", "apt-cache", "readelf") if not shutil.which(t)]
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if missing or not ldconfig:
        record("SKIP", "all", "missing " + ", ".join(missing + ([] if ldconfig else ["ldconfig"])))
        return 77
    if not os.path.exists(BIN):
        record("SKIP", "all", f"no binary {BIN}")
        return 77
    lists = apt_list()
    if lists is None:
        record("SKIP", "all", "no python3 with PyYAML to read deploy/site.yml")
        return 77
    if not check("site.yml has exactly one apt task, a list of names", len(lists) == 1 and
                 isinstance(lists[0], list) and all(isinstance(x, str) for x in lists[0]), str(lists)):
        return 1
    pkgs = lists[0]
    cand = candidates(pkgs)
    unknown = [p for p in pkgs if not cand.get(p)]
    check(f"every package of the apt task ({len(pkgs)}) is known to apt", not unknown, f"unknown: {unknown}")

    needed = [ln.split("[", 1)[1].rstrip("]") for ln in out(["readelf", "-d", BIN]).stdout.splitlines()
              if "(NEEDED)" in ln]
    if not check("readelf finds the binary's NEEDED libraries", len(needed) > 3, str(needed)):
        return 1
    cache = {}
    for ln in out([ldconfig, "-p"]).stdout.splitlines()[1:]:
        name, _, path = ln.strip().partition(" => ")
        cache.setdefault(name.split(" ")[0], path)
    # the file as the loader finds it, its target, and both with /usr merged
    # or not (dpkg records the path its package shipped)
    paths = {}
    for lib in needed:
        p = cache.get(lib)
        if not p:
            continue
        for q in (p, os.path.realpath(p)):
            for v in (q, q[4:] if q.startswith("/usr/") else "/usr" + q):
                paths.setdefault(v, lib)
    by_path = {}
    for ln in out(["dpkg", "-S", *paths]).stdout.splitlines():
        pk, _, path = ln.partition(": ")
        if path in paths and "," not in pk:
            by_path[path] = pk.split(":")[0]
    owner = {}
    for path, lib in paths.items():
        if path in by_path:
            owner.setdefault(lib, by_path[path])
    unresolved = [f"{lib} ({cache.get(lib)})" for lib in needed if lib not in owner]
    check("every NEEDED library is a file a Debian package owns", not unresolved, str(unresolved))
    essential = [ln.split()[0] for ln in out(["dpkg-query", "-W", "-f=${Package} ${Essential}\\n"]).stdout.splitlines()
                 if ln.endswith(" yes")]
    have = closure(pkgs + essential)
    lacking = sorted(f"{lib} ({p})" for lib, p in owner.items() if p not in have)
    check("every NEEDED library comes from the apt task's packages (or their dependencies) or Debian's "
          "Essential set", not lacking, f"a fresh host would lack: {lacking}; the binary needs {owner}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
