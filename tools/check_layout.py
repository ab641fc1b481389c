#!/usr/bin/env python3
"""Checks that every #include "..." in shoal's C sources points the way the
layout allows (docs/ARCHITECTURE.md, "Rooms"):

  * a file may include headers of its own room, and of the rooms its room is
    allowed to use (ALLOWED below; the arrows of the picture);
  * from another room, only that room's public header: coordinator/R/R.h for a
    coordinator room (engine/engine.h, api/api.h, ...), kernels/kernels.h for
    the kernels; common/ and proto/ headers are all public;
  * no relative ("../x.h") includes, and every included file exists.

tests/ may include anything (tests look behind the public faces on purpose).
Prints one line per violation, naming file, line and rule; exits 1 if any.
With SHOAL_TEST_RESULTS set (the test suite), appends PASS/FAIL lines there.

Usage: tools/check_layout.py [REPO_ROOT]
       tools/check_layout.py --self-test   (the rules catch planted violations)
"""
import os
import re
import sys

# room -> rooms it may include (besides itself). cli is the executable's
# entry: it may use every room, like cmd.
COORD = ["text", "obs", "engine", "cluster", "api", "hub", "pcache", "cmd"]
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "proto": {"common"},
    "worker": {"common", "kernels", "proto", "cli"},
    "text": {"common"},
    "obs": {"common", "proto"},
    "engine": {"common", "kernels", "obs"},
    "cluster": {"common", "proto", "kernels", "obs", "engine"},
    "api": {"common", "obs", "text", "engine", "pcache"},
    "hub": {"common"},
    "pcache": {"common", "engine"},
    "cmd": {"common", "kernels", "proto", "worker", "cli", *COORD},
    "cli": {"common", "kernels", "proto", "worker", *COORD},
}
# headers of cli/ that commands (in worker/ and cmd/) include to declare themselves
CLI_PUBLIC = {"cli/commands.h", "cli/version.h"}
SCANNED = ["common", "kernels", "proto", "worker", "cli", "coordinator"]
INC = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def room_of(path):
    """Room of a repository-relative path, or None when the path is no room."""
    parts = path.split("/")
    if parts[0] == "coordinator":
        return parts[1] if len(parts) > 2 and parts[1] in COORD else "coordinator"
    return parts[0] if parts[0] in ALLOWED else None


def public(header, room):
    """Whether header (repository-relative) is room's public face."""
    if room in ("common", "proto"):
        return True
    if room == "kernels":
        return header == "kernels/kernels.h"
    if room == "cli":
        return header in CLI_PUBLIC
    if room == "worker":
        return header == "worker/expert_server.h"
    if room in COORD:
        return header == f"coordinator/{room}/{room}.h"
    return False


def check(root):
    problems = []
    nfiles = 0
    for top in SCANNED:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith((".c", ".h")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), root)
                room = room_of(path)
                nfiles += 1
                if room == "coordinator":
                    problems.append(f"{path}: a source file directly in coordinator/ belongs in one of its rooms "
                                    f"({', '.join(COORD)})")
                    continue
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INC.match(line)
                        if not m:
                            continue
                        inc = m.group(1)
                        where = f"{path}:{lineno}: #include \"{inc}\""
                        if inc.startswith(".") or "/" not in inc:
                            problems.append(f"{where}: include by repository path (e.g. \"common/err.h\")")
                            continue
                        if not os.path.exists(os.path.join(root, inc)):
                            problems.append(f"{where}: no such file in the tree")
                            continue
                        target = room_of(inc)
                        if target is None or target == "coordinator":
                            problems.append(f"{where}: not a header of any room")
                        elif target == room:
                            continue
                        elif target not in ALLOWED[room]:
                            problems.append(f"{where}: {room}/ may not use {target}/ "
                                            f"(allowed: {', '.join(sorted(ALLOWED[room])) or 'nothing'})")
                        elif not public(inc, target):
                            problems.append(f"{where}: from outside {target}/ include only its public header"
                                            + (f" (coordinator/{target}/{target}.h)" if target in COORD else ""))
    return nfiles, problems


def self_test():
    """Plants one violation of each rule in a scratch tree and checks that
    each is reported (and that the allowed includes are not)."""
    import tempfile
    files = {
        "common/a.h": '#include "coordinator/engine/engine.h"\n',          # common reaching up
        "kernels/k.c": '#include "kernels/kernels_int.h"\n',               # own room: fine
        "kernels/kernels.h": "", "kernels/kernels_int.h": "",
        "coordinator/engine/engine.h": '#include "coordinator/api/api.h"\n',  # engine -> api
        "coordinator/engine/engine_int.h": "",
        "coordinator/api/api.h": '#include "coordinator/engine/engine.h"\n',  # allowed
        "coordinator/api/x.c": '#include "coordinator/engine/engine_int.h"\n',  # not the public face
        "coordinator/text/t.c": '#include "../api/api.h"\n',              # relative
        "coordinator/cmd/c.c": '#include "coordinator/engine/missing.h"\n',  # no such file
        "coordinator/stray.c": "",                                            # outside any room
        "worker/w.c": '#include "kernels/kernels.h"\n',                    # allowed
    }
    want = ["common/a.h:1", "coordinator/engine/engine.h:1", "coordinator/api/x.c:1",
            "coordinator/text/t.c:1", "coordinator/cmd/c.c:1", "coordinator/stray.c"]
    with tempfile.TemporaryDirectory() as d:
        for rel, text in files.items():
            os.makedirs(os.path.join(d, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        _, problems = check(d)
    missed = [w for w in want if not any(p.startswith(w) for p in problems)]
    extra = [p for p in problems if not any(p.startswith(w) for w in want)]
    for m in missed:
        print(f"self-test: a planted violation was not reported: {m}")
    for e in extra:
        print(f"self-test: an allowed include was reported: {e}")
    ok = not missed and not extra
    results = os.environ.get("SHOAL_TEST_RESULTS")
    if results:
        with open(results, "a") as f:
            f.write(f"{'PASS' if ok else 'FAIL'}\tlayout_includes\tthe checker reports each of "
                    f"{len(want)} planted violations and no allowed include\n")
    return ok


def main():
    if sys.argv[1:] == ["--self-test"]:
        ok = self_test()
        print(f"check_layout self-test: {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    nfiles, problems = check(root)
    for p in problems:
        print(p)
    results = os.environ.get("SHOAL_TEST_RESULTS")
    if results:
        with open(results, "a") as f:
            status = "FAIL" if problems else "PASS"
            f.write(f"{status}\tlayout_includes\tevery #include of {nfiles} files points the allowed way"
                    + (f" ({len(problems)} violations)" if problems else "") + "\n")
    print(f"check_layout: {nfiles} files, {len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
