"""The run folder and the driver's run: what every recipe's training run shares around the engine.

What it is: `run_trainer(config, state, step, batches, name=..., hooks=...)` runs one training run in
`config.run_dir`: it checks the folder (a fresh start, or the same config so it can resume; process 0
writes config.yaml and run.json), holds the folder's lock for the run (`RunLock`: a second process on the
same run_dir is refused; a killed run leaves no stale lock), hands the step, the batch source and the
recipe's hooks (an evaluation every train.eval_every steps, a rollout's statistics) to the engine
(`train.trainer.Trainer`: resume, checkpoints, sinks, the loop) and, with the JSONL sink, writes the run
report (`report/`: PNG curves and one HTML page, `posttrain.report`). Also here: `check_processes` (the
config fits the processes and its outputs can be written; call it before anything is written),
`prepare_run_dir` / `release_run_dir` and `check_same_run` (a pipeline's stage check).

The recipes (`posttrain.trainers`) reach it through the one driver, `recipes.recipe.Recipe.train`.

What it is not: the engine (`posttrain.train`: the step, the loop with its hooks, checkpoints, sinks) or a
recipe (`posttrain.trainers`, `recipes.recipe`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Sequence

import jax
from jax.experimental import multihost_utils

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.errors import PosttrainError
from posttrain.train.loop import Hook, MetricsHook
from posttrain.train.metrics import check_prometheus
from posttrain.train.step import TrainState
from posttrain.train.trainer import WEIGHTS, Trainer


def run_trainer(config, state: TrainState, step: Callable, batches, *, name: str, flops_per_token: float,
                hooks: Sequence[Hook | MetricsHook] = (), mesh=None, rules=None, summary: str = "",
                progress: bool = True) -> tuple[TrainState, dict]:
    """Train `state` with the jitted `step(state, batch)` up to `config.train.steps`; (state, result).

    `name` prefixes printed lines (`[sft] ...`) and is written into run.json; `summary` is printed once the
    run is resumed or started; `flops_per_token` (training FLOPs per token) gives the logged MFU; `hooks`
    go to the engine (`train.trainer.Trainer.add`: a Hook's returned metrics are logged, e.g. an evaluation
    every train.eval_every steps; a MetricsHook's are merged into every logged record). `result`: see
    `Trainer.run`."""
    try:
        prepare_run_dir(config, recipe=name)
        trainer = Trainer(config, step, batches, name=name, flops_per_token=flops_per_token, mesh=mesh,
                          rules=rules, progress=progress)
        for hook in hooks:
            trainer.add(hook)
        state, result = trainer.run(state, summary=summary)
        if not result.get("finished") and sh.is_main_process() and "jsonl" in config.metrics.sinks:
            from posttrain.report import write_report  # report/: the run's curves as PNGs and one HTML page

            write_report(config.run_dir)
        return state, result
    finally:
        release_run_dir(config.run_dir)  # the lock prepare_run_dir took


def check_processes(config) -> None:
    """Raise unless the run can be split over the processes and its outputs can be written (call it
    before anything is written and before the model loads): run_dir can be created (`check_run_dir`) and
    the Prometheus exporter's port is free (`metrics.check_prometheus`)."""
    check_run_dir(config.run_dir)
    if sh.is_main_process():  # the one process that serves metrics
        if "prometheus" in config.metrics.sinks:
            check_prometheus(config.metrics.prometheus_host, config.metrics.prometheus_port)
    n_proc = jax.process_count()
    if n_proc > 1 and config.sharding.preset is None:
        raise PosttrainError(f"{n_proc} processes but sharding.preset is not set; a multi-process run needs a "
                             "mesh over all processes' devices, e.g. sharding.preset=dp")
    if config.train.batch_size % n_proc:
        raise PosttrainError(f"train.batch_size={config.train.batch_size} must be a multiple of the {n_proc} "
                             "processes (each feeds an equal share of every global batch)")


def check_run_dir(run_dir: str) -> None:
    """Raise a PosttrainError unless `run_dir` is a writable folder or can be created (nothing is created)."""
    fix = "set run_dir to a folder you can write"
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise PosttrainError(f"run_dir {run_dir} is an existing file, not a folder; {fix}")
    probe = os.path.abspath(run_dir)
    while not os.path.exists(probe):  # the nearest existing folder: run_dir is created in it
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise PosttrainError(f"run_dir {run_dir} cannot be created: {probe} is a file, not a folder; {fix}")
    import tempfile

    try:  # really create (and remove) an entry: permission bits, read-only mounts and root alike
        os.rmdir(tempfile.mkdtemp(prefix=".posttrain-probe-", dir=probe))
    except OSError as e:
        what = "cannot be written" if probe == os.path.abspath(run_dir) else f"cannot be created in {probe}"
        raise PosttrainError(f"run_dir {run_dir} {what} ({e.strerror}); {fix}") from None


class RunLock:
    """One training process per run folder: an exclusive `flock` on `run_dir/.lock`, held until
    `release()`. The kernel drops it when the process dies (SIGKILL included), so a killed run never
    leaves the folder locked; the file itself stays (it only names the last holder's pid)."""

    def __init__(self, run_dir: str):
        import fcntl

        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, ".lock")
        self.fh = open(path, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.seek(0)
            holder = self.fh.read().strip() or "?"
            self.fh.close()
            raise PosttrainError(f"{run_dir}: another posttrain process (pid {holder}) is training in this run folder; "
                                 "wait for it to finish (or stop it), or give this run another run_dir") from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(f"{os.getpid()}\n")
        self.fh.flush()

    def release(self) -> None:
        import fcntl

        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


_HELD: dict[str, RunLock] = {}  # run folders this process holds (prepare_run_dir may run twice for one run)


def release_run_dir(run_dir: str) -> None:
    """Drop this process's lock on `run_dir`, if it holds one."""
    lock = _HELD.pop(os.path.realpath(run_dir), None)
    if lock is not None:
        lock.release()


RUN_FILE = "run.json"  # {"recipe": name}: which trainer wrote the folder (posttrain.runs reads it)


def prepare_run_dir(c, recipe: str) -> None:
    """Fresh start, or check that the folder holds this same run (to resume it); writes config.yaml
    and `run.json` (the recipe's name).

    Every process checks (so all raise alike); process 0 alone writes, the others wait for it.
    Process 0 takes the folder's `RunLock` after the check and before its first write, and keeps it
    until `release_run_dir` (run_trainer's end): DPO's reference cache and distillation's samples,
    written into the folder before run_trainer starts, are under it too."""
    multi = jax.process_count() > 1
    saved = os.path.join(c.run_dir, "config.yaml")
    if c.checkpoint.resume:
        check_same_run(c)
    if multi:  # nobody still reads config.yaml when process 0 rewrites it
        multihost_utils.sync_global_devices("posttrain:run_dir checked")
    refused = None
    key = os.path.realpath(c.run_dir)
    if sh.is_main_process() and key not in _HELD:
        try:
            _HELD[key] = RunLock(c.run_dir)
        except PosttrainError as e:
            refused = e
    if multi:  # every process learns whether process 0 got the lock, so none waits at a barrier for nothing
        import numpy as np

        if int(multihost_utils.broadcast_one_to_all(np.int32(refused is not None))) and refused is None:
            refused = PosttrainError(f"{c.run_dir}: process 0 could not lock this run folder (another posttrain "
                                     "process is training in it; process 0 says which); wait for it to finish, or "
                                     "give this run another run_dir")
    if refused is not None:
        raise refused
    if sh.is_main_process():
        if os.path.isdir(c.run_dir) and not c.checkpoint.resume:
            for name in ("checkpoints", "metrics.jsonl", WEIGHTS, "tensorboard", "profile"):
                path = os.path.join(c.run_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(c.run_dir, exist_ok=True)
        C.save(c, saved)
        tmp = os.path.join(c.run_dir, RUN_FILE + ".tmp")
        with open(tmp, "w") as fh:
            json.dump({"recipe": recipe}, fh)
        os.replace(tmp, os.path.join(c.run_dir, RUN_FILE))
    if multi:
        multihost_utils.sync_global_devices("posttrain:run_dir ready")


def check_same_run(c) -> None:
    """Raise unless `c.run_dir` is empty or holds a run of this same config (the checkpoint section aside)."""
    saved = os.path.join(c.run_dir, "config.yaml")
    if not os.path.isfile(saved):
        return
    before = C.to_dict(C.load(type(c), saved))
    now = C.to_dict(c)
    before.pop("checkpoint", None)
    now.pop("checkpoint", None)
    if before != now:
        diff = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        raise PosttrainError(f"{saved}: run_dir holds a run with a different config (sections {diff}); "
                             "use a new run_dir, or checkpoint.resume=false to start this one afresh")
