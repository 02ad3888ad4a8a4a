"""The fault tests' launcher: imports posttrain once, then forks one fresh process per command.

Every `posttrain` process pays ~8 s importing JAX, transformers and torch before it trains; the
fault tests start about ten processes per trainer. This script imports all of that once (JAX is
imported but never started: no backend, no thread pool, so forking is safe) and then, for each
JSON line on stdin, forks a child that runs `posttrain.cli.main(argv)` as the command line would,
its stdout and stderr going through a pipe into the line's "log" file. The child is a real separate process: a
SIGKILL ends it as it would end `posttrain` itself, with an asynchronous checkpoint save in flight.
The answer on stdout is the child's exit code (negative: killed by that signal).

A line: {"argv": [...], "log": path, "signal": [step, name], "fsize": [step, bytes]}, the last two
optional. After that step's own hooks (so after its checkpoint save has started):
  signal: the child sends itself SIGKILL, SIGTERM or SIGINT;
  fsize:  the child may no longer write a file past `bytes` (RLIMIT_FSIZE, SIGXFSZ ignored): every
          write past it fails with EFBIG, as on a full disk, in Python and in Orbax's C++ alike.
"""

import gc
import json
import os
import resource
import shutil
import signal
import sys

import jaxlib.mlir.dialects.mhlo  # noqa: F401  (what a run imports lazily: lowering, checkpoints, metrics)
import psutil  # noqa: F401
import pydantic  # noqa: F401
import transformers.tokenization_utils_tokenizers  # noqa: F401  (and torch, which it imports)
from jax._src import xla_bridge

import posttrain.cli
import posttrain.config
import posttrain.report
import posttrain.train.trainer as engine
import posttrain.trainers
from posttrain.train.loop import Hook

for _trainer in posttrain.trainers.TRAINERS:
    posttrain.trainers.recipe_class(_trainer)  # the trainers' modules
posttrain.report._plot({"loss": ([1, 2], [1.0, 0.5])}, ["loss"], [], "warm-up", "loss")  # matplotlib and its fonts
for _trainer in ("sft", "ppo"):  # a config read: pydantic's lazily imported validators
    _recipe = posttrain.trainers.recipe_class(_trainer)
    posttrain.config.load(_recipe.config_class, f"configs/{_trainer}_tiny.yaml", [])
assert not xla_bridge.backends_are_initialized(), "a JAX backend started before fork: the children would share it"


def child(argv, out_fd, signal_at=None, fsize_at=None):
    os.dup2(out_fd, 1)  # a pipe, as to a terminal: the file-size limit is for the run's own files
    os.dup2(out_fd, 2)
    real_loop = engine.train_loop

    def fault(step, state, metrics):
        if fsize_at and step == fsize_at[0]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_at[1], fsize_at[1]))
        if signal_at and step == signal_at[0]:
            os.kill(os.getpid(), getattr(signal, signal_at[1]))

    def loop_with_faults(*args, hooks=(), **kw):
        return real_loop(*args, hooks=list(hooks) + [Hook(fault, 1)], **kw)

    engine.train_loop = loop_with_faults
    try:
        rc = posttrain.cli.main(argv)
    except BaseException:  # a bug: the traceback goes to the log, the exit code says so
        import traceback

        traceback.print_exc()
        rc = 70
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# What is imported is never garbage: frozen out of the collector, a child's full collections (~0.5 CPU s
# of a 10-step PPO run) no longer walk the ~390,000 objects of JAX, torch and transformers.
gc.collect()
gc.freeze()
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            child(job["argv"], write_end, job.get("signal"), job.get("fsize"))
        finally:
            os._exit(70)
    os.close(write_end)
    with open(job["log"], "wb") as log, os.fdopen(read_end, "rb") as pipe:
        shutil.copyfileobj(pipe, log)  # until the child (and its threads) are gone
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
