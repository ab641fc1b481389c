#!/usr/bin/env python3
"""Builds the real-text cases for bench_draft_replay (docs/PERFORMANCE.md,
issue 21), tokenized with the project's tokenizer (`shoal tokenize --model
DIR --file F`, K3's tiktoken.model in DIR):

  edit       a Python standard-library file in the prompt with an instruction;
             the output is the whole file with the edit applied (one function
             renamed everywhere, one comment line inserted mid-file, one
             numeric literal changed), in a fenced block as a model writes it;
  summarise  a commit's diff of this repository in the prompt; the output is
             the commit message its author wrote for it;
  free       a one-line request; the output is a real document (Debian
             README files on this machine), nothing of it in the prompt.

Usage: draft_corpus.py --bin build/bin/shoal --model /work/k3slice --out CASES.json
       [--py /usr/lib/python3.11] [--repo .] [--n 8]"""
import argparse
import glob
import gzip
import json
import os
import re
import subprocess
import tempfile

EDIT_FILES = ["textwrap", "shlex", "fnmatch", "bisect", "heapq", "glob", "colorsys", "netrc", "sched", "graphlib",
              "keyword", "numbers", "queue", "stringprep", "tabnanny", "token"]
FREE_DOCS = ["/usr/share/doc/apt/README.md.gz", "/usr/share/doc/base-files/README.FHS",
             "/usr/share/doc/bash/README.abs-guide", "/usr/share/doc/adduser/README.gz",
             "/usr/share/doc/ansible/README.rst.gz", "/usr/share/doc/at-spi2-core/README.md.gz",
             "/usr/share/doc/base-passwd/README", "/usr/share/doc/bash/README.commands.gz"]


def tok(a, text):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        r = subprocess.run([a.bin, "tokenize", "--model", a.model, "--file", path], capture_output=True, text=True,
                           check=True)
    finally:
        os.unlink(path)
    line = r.stdout.strip()
    return [int(x) for x in line.split(",")] if line else []


def edit(src):
    """the file with the first top-level function renamed everywhere, a comment
    line inserted mid-file and the first integer literal > 1 changed"""
    out = src
    m = re.search(r"^def ([a-z_][a-z0-9_]*)\(", src, re.M)
    what = []
    if m:
        old = m.group(1)
        new = old + "_checked"
        out = re.sub(r"\b%s\b" % re.escape(old), new, out)
        what.append(f"rename the function `{old}` to `{new}` everywhere")
    lines = out.split("\n")
    mid = len(lines) // 2
    while mid < len(lines) and not lines[mid].strip():
        mid += 1
    indent = re.match(r"\s*", lines[mid]).group(0) if mid < len(lines) else ""
    lines.insert(mid, indent + "# NOTE: reviewed for the 3.11 release")
    what.append(f"add the comment `# NOTE: reviewed for the 3.11 release` before line {mid + 1}")
    out = "\n".join(lines)
    m = re.search(r"(?<![\w.])([2-9]|[1-9][0-9]+)(?![\w.])", out)
    if m:
        out = out[:m.start()] + str(int(m.group(1)) + 1) + out[m.end():]
        what.append(f"change the first literal {m.group(1)} to {int(m.group(1)) + 1}")
    return out, "; ".join(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--py", default="/usr/lib/python3.11")
    ap.add_argument("--repo", default=".")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-chars", type=int, default=12000)
    a = ap.parse_args()
    cases = []
    for name in EDIT_FILES[:a.n]:
        path = os.path.join(a.py, name + ".py")
        if not os.path.exists(path):
            continue
        src = open(path).read()[:a.max_chars]
        src = src[:src.rfind("\n") + 1]
        new, what = edit(src)
        prompt = f"Here is `{name}.py`:\n\n```python\n{src}```\n\nPlease {what}. Reply with the whole edited file.\n"
        cases.append({"name": f"edit {name}.py", "kind": "edit", "prompt": tok(a, prompt),
                      "output": tok(a, f"```python\n{new}```\n")})
    log = subprocess.run(["git", "-C", a.repo, "log", "--no-merges", "--format=%H", "-n", "200"], capture_output=True,
                         text=True, check=True).stdout.split()
    n = 0
    for h in log:
        msg = subprocess.run(["git", "-C", a.repo, "log", "-1", "--format=%B", h], capture_output=True, text=True,
                             check=True).stdout.strip()
        diff = subprocess.run(["git", "-C", a.repo, "show", "--format=", "--unified=2", h], capture_output=True,
                              text=True, check=True).stdout
        if len(msg) < 200 or len(diff) < 2000 or len(diff) > a.max_chars:
            continue  # a real summary of a diff that fits
        prompt = f"Summarise this change as a commit message:\n\n```diff\n{diff}```\n"
        cases.append({"name": f"summarise {h[:8]}", "kind": "summarise", "prompt": tok(a, prompt),
                      "output": tok(a, msg + "\n")})
        n += 1
        if n >= a.n:
            break
    for path in FREE_DOCS[:a.n]:
        if not os.path.exists(path):
            continue
        text = (gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")).read()
        text = text[:a.max_chars // 2]
        title = os.path.basename(os.path.dirname(path))
        cases.append({"name": f"free {title}/{os.path.basename(path)}", "kind": "free",
                      "prompt": tok(a, f"Write the README of the Debian package {title}.\n"),
                      "output": tok(a, text)})
    json.dump(cases, open(a.out, "w"))
    for c in cases:
        print(f"{c['kind']:10s} {c['name']:40s} prompt {len(c['prompt']):6d} output {len(c['output']):6d} tokens")


if __name__ == "__main__":
    main()
