"""Runs `posttrain sft` and SIGKILLs itself right after step K (test helper for exact resume).

Usage: python tests/kill_worker.py K [posttrain sft arguments...]
KILL_SIGNAL=SIGTERM (or SIGINT) in the environment sends that signal instead of SIGKILL.
The kill hook runs after the step's other hooks, so when K is a checkpoint step its asynchronous
save has just been started: the kill then also exercises a crash in the middle of a save.
K = 0 means never kill.
"""

import os
import signal
import sys

import posttrain.train.lifecycle as lifecycle
from posttrain.cli import main
from posttrain.train.loop import FnHook

kill_at = int(sys.argv[1])
real_loop = lifecycle.train_loop


def loop_with_kill(*args, hooks=(), **kw):
    def kill(step, state, metrics):
        if step == kill_at:
            os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))

    return real_loop(*args, hooks=list(hooks) + [FnHook(1, kill)], **kw)


lifecycle.train_loop = loop_with_kill
sys.exit(main(["sft"] + sys.argv[2:]))
