"""The one trainer lifecycle: everything around the train step that every trainer shares.

What it is: `run_trainer(config, state, step, batches, ...)` runs one training run in
`config.run_dir`. It checks the folder (a fresh start, or the same config so it can resume;
process 0 writes config.yaml), holds the folder's lock for the run (`RunLock`: a second process
on the same run_dir is refused; a killed run leaves no stale lock), restores the newest readable
checkpoint (train state + the batch source's position), drops metrics logged after that
checkpoint, builds the metric sinks and the profiler, steps `train_loop` with an evaluation hook
and a checkpoint hook, and writes the final trainable weights (`trainable.safetensors`) and, with
the JSONL sink, the run report (`report/`: PNG curves and one HTML page, `posttrain.report`).
Process 0 alone prints and writes files; every process joins checkpoint saves / restores and the
final gather. Also here: `check_processes` (the config fits the processes; call it before
anything is written), `training_state` (the model's train state and optimizer under the config),
`frozen_copy` (a reference / teacher copy the donated train state cannot overwrite),
`place_batch` (a host batch on the devices) and `make_eval` (the denom-weighted metrics over a
fixed eval set).

The recipes (`posttrain.trainers`) reach it through the one driver, `train.recipe.Recipe.train`.

`batches` is where each step's host batch comes from, with a checkpointable position
(`get_state()` -> a JSON-able dict, `set_state(dict)`) so a resumed run continues exactly:
  - an iterator of batches (SFT, DPO, reward model: `iter(grain_dataset)`), or
  - a callable `batches(state) -> batch`, called before every step with the current TrainState
    (RL: sample rollouts with the current weights, score them, return the rows to train on);
    its get_state / set_state save and restore the prompt stream's position.
A frozen model (DPO reference, distillation teacher) is bound into the step
(`train.recipe.Setup.step`).

What it is not: the loop (`train.loop`), the checkpoint format (`train.checkpoint`), or a recipe
(`posttrain.trainers`, `train.recipe`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.errors import PosttrainError, RunStopped
from posttrain.train.checkpoint import Checkpointer
from posttrain.train.loop import FnHook, Stopped, train_loop
from posttrain.train.metrics import MemoryWarning, Profiler, check_prometheus, make_sinks, memory_stats, mfu, peak_flops
from posttrain.train.optim import make_optimizer, schedule
from posttrain.train.serialize import save_state
from posttrain.train.step import TrainState, init_state, merge

WEIGHTS = "trainable.safetensors"


def run_trainer(config, state: TrainState, step: Callable, batches, *, name: str, flops_per_token: float,
                evaluate: Optional[Callable[[TrainState], dict]] = None, mesh=None, rules=None,
                summary: str = "", progress: bool = True,
                host_metrics: Optional[Callable[[], dict]] = None) -> tuple[TrainState, dict]:
    """Train `state` with the jitted `step(state, batch)` up to `config.train.steps`; (state, result).

    `name` prefixes printed lines (`[sft] ...`); `summary` is printed once the run is resumed or
    started; `flops_per_token` (training FLOPs per token) gives the logged MFU; `evaluate(state)
    -> metrics` runs every `train.eval_every` steps and after the last one, and its metrics go to
    the sinks and the result. `result`: the last logged metrics plus `first_loss`, `seconds` and
    the last evaluation, or `{"step", "finished": True, "seconds"}` when the run folder already
    holds a finished run (the returned state is then the restored one). `host_metrics()` (e.g.
    RL rollout statistics since its last call) is merged into every logged record.
    """
    try:
        return _run(config, state, step, batches, name=name, flops_per_token=flops_per_token, evaluate=evaluate,
                    mesh=mesh, rules=rules, summary=summary, progress=progress, host_metrics=host_metrics)
    finally:
        release_run_dir(config.run_dir)  # the lock prepare_run_dir took


def _run(config, state, step, batches, *, name, flops_per_token, evaluate, mesh, rules, summary, progress,
         host_metrics):
    c = config
    t0 = time.perf_counter()
    main = sh.is_main_process()
    prepare_run_dir(c, recipe=name)
    best_metric = c.checkpoint.best_metric
    ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), keep=c.checkpoint.keep,
                        async_save=c.checkpoint.async_save, best_metric=best_metric, best_mode=c.checkpoint.best_mode)
    start = 0
    restored = ckpt.restore_latest(state) if c.checkpoint.resume else None
    if restored is not None:
        start, state, data_state, _ = restored
        batches.set_state(data_state["iterator"])
        _print(f"[{name}] resuming {c.run_dir} from the checkpoint at step {start}")
    if main:  # a killed attempt may have logged past its last checkpoint
        _truncate_jsonl(os.path.join(c.run_dir, "metrics.jsonl"), start)
    if summary:
        _print(summary)
    if start >= c.train.steps:
        ckpt.close()
        if not os.path.isfile(os.path.join(c.run_dir, WEIGHTS)):  # the last run stopped while writing them
            save_state(state.params, os.path.join(c.run_dir, WEIGHTS))
            _print(f"[{name}] wrote {WEIGHTS} from the checkpoint at step {start}")
        _print(f"[{name}] {c.run_dir} already finished ({start} steps); nothing to do")
        return state, {"step": start, "finished": True, "seconds": time.perf_counter() - t0}

    sinks = make_sinks(c.metrics, c.run_dir, is_main_process=main)
    result: dict = {}
    hooks = []
    evaluated: dict = {}  # step -> the best_metric value of the evaluation at that step

    def save(step_no, st, _m):
        if int(sh.to_host(st.nonfinite)) == 0 and step_no not in ckpt.steps():  # never mid-run of skipped steps
            meta = {"best_metric": evaluated[step_no]} if step_no in evaluated else None
            ckpt.save(step_no, st, {"iterator": batches.get_state()}, meta)

    if evaluate is not None:
        every = c.checkpoint.every

        def run_eval(step_no, st, _m):
            metrics = evaluate(st)
            result.update(metrics)
            for sink in sinks:
                sink.write(step_no, metrics)
            if best_metric:
                if best_metric not in metrics:
                    raise PosttrainError(f"checkpoint.best_metric={best_metric!r} is not an evaluation metric of "
                                         f"this run (it logs {', '.join(sorted(metrics))}); name one of them")
                evaluated[step_no] = metrics[best_metric]
                regular = (every and step_no % every == 0) or step_no == c.train.steps
                if not regular and ckpt.improves(metrics[best_metric]):  # a new best between regular saves
                    save(step_no, st, None)

        hooks.append(FnHook(c.train.eval_every, run_eval))

    hooks.append(FnHook(c.checkpoint.every, save))  # also after the last step
    peak = peak_flops(c.metrics)
    n_dev = 1 if mesh is None else mesh.devices.size

    high_memory = MemoryWarning()

    def extra(m):
        host = host_metrics() if host_metrics is not None else {}
        out = {"mfu": mfu(m["tokens_per_s"], flops_per_token, peak, n_dev), **memory_stats(), **host}
        high_memory(out)
        return out

    profiler = None
    if c.profile.start_step:
        profiler = Profiler(c.profile.start_step, c.profile.num_steps, os.path.join(c.run_dir, "profile"))
    signals = SignalStop() if jax.process_count() == 1 else None  # multi-process: the default handlers
    try:
        state, history = train_loop(step, state, batches, steps=c.train.steps, start_step=start,
                                    log_every=c.train.log_every, sinks=sinks, hooks=hooks,
                                    progress=main and progress and "console" in c.metrics.sinks,
                                    max_nonfinite=c.train.max_nonfinite, profiler=profiler,
                                    extra_metrics=extra if main else None,
                                    place_batch=functools.partial(place_batch, mesh=mesh, rules=rules),
                                    stop=signals.received if signals is not None else None)
    except Stopped as stopped:
        if stopped.step not in ckpt.steps():  # its checkpoint hook may have saved this step already
            save(stopped.step, stopped.state, None)
        # the `finally` below waits for that save, so it is on disk before the CLI prints this message
        raise RunStopped(f"[{name}] {stopped.why}: stopped after step {stopped.step} with its checkpoint in "
                         f"{c.run_dir}/checkpoints; run the same command again to resume", stopped.why) from None
    finally:
        if signals is not None:
            signals.restore()
        ckpt.close()  # waits for an asynchronous save in flight
        for sink in sinks:
            sink.close()
        if profiler is not None:
            profiler.close()
    save_state(state.params, os.path.join(c.run_dir, WEIGHTS))  # every process joins; process 0 writes
    if main and "jsonl" in c.metrics.sinks:  # report/: the run's curves as PNGs and one HTML page
        from posttrain.report import write_report

        write_report(c.run_dir)
    result.update(history[-1] if history else {})
    result.update(first_loss=history[0]["loss"] if history else None, seconds=time.perf_counter() - t0)
    return state, result


def training_state(config, model, *, trainable, mesh=None, rules=None, optimizer=None):
    """(graphdef, state, optimizer, lr schedule) of `model` under config.optim / config.train: the
    trainable filter's parameters with AdamW state (or `optimizer`'s, e.g. PPO's two chains), placed
    on the mesh when there is one."""
    lr = schedule(config.optim, config.train.steps)
    optimizer = optimizer or make_optimizer(config.optim, lr)
    graphdef, state = init_state(model, optimizer, trainable=trainable, seed=config.train.seed)
    if mesh is not None:  # optimizer state follows the parameters' shardings
        state = sh.shard_state(state, mesh, rules)
    return graphdef, state, optimizer, lr


def frozen_copy(model):
    """(graphdef, a copy of its state): a frozen reference (full fine-tuning) that the donated train
    state, which starts from the same buffers, cannot overwrite."""
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(jnp.copy, state)


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


def place_batch(batch: dict, mesh=None, rules=None) -> dict:
    """A host batch on the devices: sharded over the mesh's batch axes, or on the default device.

    With several processes each holds the same global batch and places its own contiguous rows."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    n, i = jax.process_count(), jax.process_index()
    if n == 1:
        return sh.shard_batch(batch, mesh, rules)
    rows = len(next(iter(batch.values())))
    if rows % n:
        raise PosttrainError(f"a batch of {rows} rows cannot be split evenly over {n} processes; make "
                             f"train.batch_size (and the eval set's last, partial batch) a multiple of {n}")
    per = rows // n
    return sh.shard_batch({k: v[i * per:(i + 1) * per] for k, v in batch.items()}, mesh, rules,
                          process_local=True)


def make_eval(loss_fn: Callable, graphdef, arrays: dict, *, batch_size: int, mesh=None,
              rules=None, frozen=None, frozen_graphdef=None) -> Callable[[TrainState], dict]:
    """`evaluate(state) -> {"eval_<metric>": value}` over host `arrays` ([N, ...] each) in batches of
    `batch_size` rows: every metric of `loss_fn` summed over the set and divided by the summed
    `denom` (the loss convention), so "eval_loss" is the set's loss; jitted once. `frozen` (a
    state, with `frozen_graphdef`) is the reference / teacher handed to the loss."""

    def loss(st, b, fz):
        with sh.use_mesh(mesh, rules):
            fm = None if fz is None else nnx.merge(frozen_graphdef, fz)
            return loss_fn(merge(graphdef, st), b, frozen=fm)[1]

    fn = jax.jit(loss)
    rows = len(next(iter(arrays.values())))

    def evaluate(state) -> dict:
        totals = None
        for i in range(0, rows, batch_size):
            m = fn(state, place_batch({k: v[i:i + batch_size] for k, v in arrays.items()}, mesh, rules), frozen)
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)  # summed on the device
        host = {k: float(sh.to_host(v)) for k, v in totals.items()}
        denom = max(host.pop("denom"), 1.0)
        return {f"eval_{k}": v / denom for k, v in host.items()}

    return evaluate


class SignalStop:
    """While it lives, SIGTERM and SIGINT (Ctrl-C) are noted instead of ending the process; `received()`
    names the first one (the loop then checkpoints and stops). A second Ctrl-C interrupts at once.
    Only in the main thread (Python delivers signals there); elsewhere it notes nothing."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self):
        import signal
        import threading

        self.got: Optional[str] = None
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            num = getattr(signal, name)
            self.previous[num] = signal.signal(num, self._note)

    def _note(self, num, frame):
        import signal

        if self.got is not None and num == signal.SIGINT:
            raise KeyboardInterrupt
        self.got = self.got or signal.Signals(num).name

    def received(self) -> Optional[str]:
        return self.got

    def restore(self) -> None:
        import signal

        for num, handler in self.previous.items():
            signal.signal(num, handler)
        self.previous = {}


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


def _print(*args) -> None:
    """print on process 0 only (the one that logs)."""
    if sh.is_main_process():
        print(*args)


def _truncate_jsonl(path: str, last_step: int) -> None:
    """Drop records logged after `last_step` (a killed run logged them; the resumed run logs them again).

    A cut last line (what a full disk or a kill mid-write leaves: no newline, not JSON) is dropped with
    a warning; a bad line anywhere else is the user's to look at, so it raises naming FILE:LINE."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    # a complete file ends with a newline: the last piece is b""; otherwise it is the cut line
    cut, lines = lines[-1], lines[:-1]
    if cut.strip():
        try:
            record = json.loads(cut)
        except ValueError:
            record = None
        if isinstance(record, dict):
            lines.append(cut)  # a whole record that only lacks its newline
        else:
            import warnings

            warnings.warn(f"{path}:{len(lines) + 1}: the last line is cut off ({len(cut)} bytes, not JSON: a full disk "
                          "or a kill while it was written); dropped it", stacklevel=2)
    last = max((i for i, ln in enumerate(lines, 1) if ln.strip()), default=0)
    keep = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            step = record.get("step", 0)
        except (ValueError, AttributeError):
            if number == last:
                import warnings

                warnings.warn(f"{path}:{number}: the last line is not a JSON record (a full disk or a kill while it "
                              "was written); dropped it", stacklevel=2)
                continue
            raise PosttrainError(f"{path}:{number}: not a JSON record ({raw[:60]!r}); fix or delete that line, then "
                                 "run the same command again to resume") from None
        if step <= last_step:
            keep.append(raw + b"\n")
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)
