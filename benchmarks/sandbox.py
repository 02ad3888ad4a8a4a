#!/usr/bin/env python
"""What the OS sandbox costs an agentic episode or a code reward: python-tool calls per second and
code_tests rewards per second, bubblewrap (the default) against the Python-guard-only child that
posttrain used before it (`unsafe_inprocess_guard`), interleaved rounds, medians. JSON out.

Usage: .venv/bin/python benchmarks/sandbox.py [--rounds 5] [--calls 20] [--json runs/sandbox.json]
"""

import argparse
import json
import platform
import statistics
import subprocess
import time
import warnings

from posttrain.agentic.tools import PythonTool
from posttrain.rewards.functions import code_tests_reward

PROGRAM = "import math\nprint(sum(math.isqrt(i) for i in range(20000)))\n"  # a tool call's typical small program
CODE, TESTS = "def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    modes = ("bwrap", "unsafe_inprocess_guard")
    tools = {m: PythonTool(sandbox=m) for m in modes}
    rewards = {m: code_tests_reward(sandbox=m, workers=2) for m in modes}
    rate = {(kind, m): [] for kind in ("tool_calls_per_s", "rewards_per_s") for m in modes}
    for _ in range(args.rounds):
        for m in modes:  # interleaved: the machine's drift hits both sides alike
            start = time.perf_counter()
            for _ in range(args.calls):
                assert tools[m].run(PROGRAM).status == "ok"
            rate[("tool_calls_per_s", m)].append(args.calls / (time.perf_counter() - start))
            start = time.perf_counter()
            out = rewards[m](prompts=["p"] * args.calls, completions=[CODE] * args.calls, tests=[TESTS] * args.calls)
            assert out == [1.0] * args.calls
            rate[("rewards_per_s", m)].append(args.calls / (time.perf_counter() - start))
    med = {f"{kind}/{m}": round(statistics.median(v), 2) for (kind, m), v in rate.items()}
    res = {"benchmark": "sandbox", "rounds": args.rounds, "calls": args.calls, **med,
           "tool_rate_bwrap_over_guard": round(med["tool_calls_per_s/bwrap"]
                                               / med["tool_calls_per_s/unsafe_inprocess_guard"], 3),
           "reward_rate_bwrap_over_guard": round(med["rewards_per_s/bwrap"]
                                                 / med["rewards_per_s/unsafe_inprocess_guard"], 3),
           "cpu": _cpu(), "python": platform.python_version()}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


if __name__ == "__main__":
    main()
