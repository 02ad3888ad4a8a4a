#!/usr/bin/env python3
"""Runs one benchmark script and adds its process's peak resident memory to the JSON it wrote.

`make bench` gives this file to ../shared/anchors/run_all.sh as both interpreters (PY and
PROJECT_PY), so every script, the anchors' and posttrain's alike, is measured the same way:
the anchors' scripts (in the anchors folder) run with the reference venv's python
($ANCHOR_VENV, default /tmp/anchor-venv), posttrain's with $PROJECT_PY_REAL (default
.venv/bin/python). The child's own peak RSS comes from os.wait4 (ru_maxrss) and goes into the
script's --json file as "peak_rss_bytes".

Usage (as run_all.sh calls it): benchmarks/with_rss.py SCRIPT --threads N --json PATH [...]
"""

import json
import os
import subprocess
import sys


def main() -> int:
    script, rest = sys.argv[1], sys.argv[2:]
    anchors = os.path.basename(os.path.dirname(os.path.abspath(script))) == "anchors"
    py = (os.path.join(os.environ.get("ANCHOR_VENV", "/tmp/anchor-venv"), "bin", "python") if anchors
          else os.environ.get("PROJECT_PY_REAL", ".venv/bin/python"))
    proc = subprocess.Popen([py, script, *rest])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    path = rest[rest.index("--json") + 1] if "--json" in rest else None
    if proc.returncode == 0 and path and os.path.isfile(path):
        with open(path) as fh:
            res = json.load(fh)
        res["peak_rss_bytes"] = usage.ru_maxrss * 1024  # KiB on Linux
        with open(path, "w") as fh:
            json.dump(res, fh, indent=2)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
