"""The engine's run: the train step stepped through `train_loop` with hooks, resume, checkpoints and sinks.

What it is: `Trainer(config, step, batches, name=...)` trains a `TrainState` with the jitted `step(state,
batch)` up to `config.train.steps` in `config.run_dir` (a folder the caller has checked and holds:
`posttrain.recipes.lifecycle`). `run(state)` restores the newest readable checkpoint (train state + the
batch source's position), drops metrics logged after that checkpoint, builds the metric sinks and the
profiler, steps `train_loop` with the hooks, checkpoints on SIGTERM / Ctrl-C, and writes the final trainable
weights (`trainable.safetensors`). Process 0 alone prints and writes files; every process joins checkpoint
saves / restores and the final gather.

Hooks are passed in, levanter's `Trainer.add_hook(fn, every=N)` style:
  - `add_hook(fn, every)`: `fn(step, state, metrics)` after every `every`-th step and after the last one;
    a dict it returns (an evaluation's metrics) goes to the sinks and the result, and is what
    `checkpoint.best_metric` reads (a new best between regular saves is saved at once);
  - `add_metrics(fn)`: `fn(record) -> dict` merged into every logged record (an RL rollout's statistics);
  - the checkpoint hook (every `checkpoint.every` steps and after the last) and the MFU / memory metrics are
    the engine's own, added last.

`batches` is where each step's host batch comes from, with a checkpointable position (`get_state()` -> a
JSON-able dict, `set_state(dict)`) so a resumed run continues exactly:
  - an iterator of batches (SFT, DPO, reward model: `iter(grain_dataset)`), or
  - a callable `batches(state) -> batch`, called before every step with the current TrainState
    (RL: sample rollouts with the current weights, score them, return the rows to train on).

Also here: `training_state` (the model's train state and optimizer under the config), `frozen_copy` (a
reference / teacher copy the donated train state cannot overwrite), `place_batch` (a host batch on the
devices), `make_eval` (the denom-weighted metrics over a fixed eval set) and `SignalStop`.

What it is not: the loop (`train.loop`), the checkpoint format (`train.checkpoint`), the run folder's
checks and lock or a recipe (`posttrain.recipes`). The engine knows no recipe, reward, evaluator or data
format.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import sharding as sh
from posttrain.errors import PosttrainError, RunStopped
from posttrain.train.checkpoint import Checkpointer
from posttrain.train.loop import Hook, MetricsHook, Stopped, train_loop
from posttrain.train.metrics import MemoryWarning, Profiler, make_sinks, memory_stats, mfu, peak_flops
from posttrain.train.optim import make_optimizer, schedule
from posttrain.train.serialize import save_state
from posttrain.train.step import TrainState, init_state, merge

WEIGHTS = "trainable.safetensors"


class Trainer:
    """One training run of `step` over `batches` under `config` (see the module docstring)."""

    def __init__(self, config, step: Callable, batches, *, name: str, flops_per_token: float = 0.0, mesh=None,
                 rules=None, progress: bool = True):
        self.config, self.step, self.batches, self.name = config, step, batches, name
        self.flops_per_token, self.mesh, self.rules, self.progress = flops_per_token, mesh, rules, progress
        self.hooks: list = []
        self.result: dict = {}
        self.sinks: list = []
        self.evaluated: dict = {}  # step -> the best_metric value of the evaluation at that step
        self.ckpt: Optional[Checkpointer] = None

    def add_hook(self, fn: Callable, every: int) -> None:
        """`fn(step, state, metrics)` after every `every`-th step and after the last (every=0: the last only);
        a dict it returns is logged (sinks, result) and read by checkpoint.best_metric."""
        self.hooks.append(Hook(functools.partial(self._hooked, fn), every))

    def add_metrics(self, fn: Callable[[dict], dict]) -> None:
        """`fn(record) -> dict` merged into every logged record."""
        self.hooks.append(MetricsHook(fn))

    def add(self, hook) -> None:
        """A `Hook` (see `add_hook`) or a `MetricsHook` (see `add_metrics`)."""
        if isinstance(hook, MetricsHook):
            self.add_metrics(hook.fn)
        else:
            self.add_hook(hook.fn, hook.every)

    # ---------------------------------------------------------------- the engine's own hooks
    def _hooked(self, fn, step_no, state, metrics):
        logged = fn(step_no, state, metrics)
        if not logged:
            return
        c, best = self.config, self.config.checkpoint.best_metric
        self.result.update(logged)
        for sink in self.sinks:
            sink.write(step_no, logged)
        if best:
            if best not in logged:
                raise PosttrainError(f"checkpoint.best_metric={best!r} is not an evaluation metric of this run (it "
                                     f"logs {', '.join(sorted(logged))}); name one of them")
            self.evaluated[step_no] = logged[best]
            every = c.checkpoint.every
            regular = (every and step_no % every == 0) or step_no == c.train.steps
            if not regular and self.ckpt.improves(logged[best]):  # a new best between regular saves
                self.save(step_no, state, None)

    def save(self, step_no, state, _metrics=None) -> None:
        """The checkpoint hook: state + the batch source's position (+ the step's best_metric value)."""
        if int(sh.to_host(state.nonfinite)) == 0 and step_no not in self.ckpt.steps():  # never mid-run of skipped
            meta = {"best_metric": self.evaluated[step_no]} if step_no in self.evaluated else None
            self.ckpt.save(step_no, state, {"iterator": self.batches.get_state()}, meta)

    # ---------------------------------------------------------------- the run
    def run(self, state: TrainState, *, summary: str = "") -> tuple[TrainState, dict]:
        """Train (or resume) up to config.train.steps; (state, result).

        `summary` is printed once the run is resumed or started. `result`: each metric's last logged value (an RL
        reward from its rollout's step, when later steps reuse that rollout) plus
        `first_loss`, `seconds` and the last hook-logged metrics (evaluation), or `{"step", "finished": True,
        "seconds"}` when the folder already holds a finished run (the state is then the restored one)."""
        c, name, batches = self.config, self.name, self.batches
        t0 = time.perf_counter()
        main = sh.is_main_process()
        self.ckpt = ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), keep=c.checkpoint.keep,
                                        async_save=c.checkpoint.async_save, best_metric=c.checkpoint.best_metric,
                                        best_mode=c.checkpoint.best_mode)
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

        self.sinks = sinks = make_sinks(c.metrics, c.run_dir, is_main_process=main)
        peak = peak_flops(c.metrics)
        n_dev = 1 if self.mesh is None else self.mesh.devices.size
        high_memory = MemoryWarning()

        def device_figures(m):
            out = {"mfu": mfu(m["tokens_per_s"], self.flops_per_token, peak, n_dev), **memory_stats()}
            high_memory(out)
            return out

        # the caller's hooks first (an evaluation decides the checkpoint's best_metric), then the checkpoint hook
        # (also after the last step); process 0 alone logs, so only it asks the metrics hooks
        plain = [h for h in self.hooks if not isinstance(h, MetricsHook)]
        logged = [MetricsHook(device_figures), *(h for h in self.hooks if isinstance(h, MetricsHook))]
        hooks = [*plain, Hook(self.save, c.checkpoint.every), *(logged if main else ())]
        profiler = None
        if c.profile.start_step:
            profiler = Profiler(c.profile.start_step, c.profile.num_steps, os.path.join(c.run_dir, "profile"))
        signals = SignalStop() if jax.process_count() == 1 else None  # multi-process: the default handlers
        try:
            state, history = train_loop(self.step, state, batches, steps=c.train.steps, start_step=start,
                                        log_every=c.train.log_every, sinks=sinks, hooks=hooks,
                                        progress=main and self.progress and "console" in c.metrics.sinks,
                                        max_nonfinite=c.train.max_nonfinite, profiler=profiler,
                                        place_batch=functools.partial(place_batch, mesh=self.mesh, rules=self.rules),
                                        stop=signals.received if signals is not None else None)
        except Stopped as stopped:
            if stopped.step not in ckpt.steps():  # its checkpoint hook may have saved this step already
                self.save(stopped.step, stopped.state, None)
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
        result = self.result
        for logged in history:  # each metric's last logged value: an RL rollout's reward is on its rollout's step
            result.update(logged)
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
    else:  # committed to its device (no copy), as a restored state is: a fresh and a resumed run lower the same
        # programs (an uncommitted argument lowers without a sharding: another program, compiled again on resume)
        state = jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state)
    return graphdef, state, optimizer, lr


def frozen_copy(model):
    """(graphdef, a copy of its state): a frozen reference (full fine-tuning) that the donated train
    state, which starts from the same buffers, cannot overwrite."""
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(jnp.copy, state)


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
