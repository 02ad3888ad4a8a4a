"""The one training loop: steps the jitted train step and fires hooks every N steps.

What it is: the only place that iterates training. Logging (progress bar + metric sinks such
as JSONL, TensorBoard, Prometheus), evaluation, checkpointing and profiling run outside the
jitted step. Device metrics are fetched only on logging steps; the non-finite counter of step
k - 1 is read after step k is dispatched, so the device never waits for the host.
What it is not: a trainer recipe (see `posttrain.trainers`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from posttrain.errors import PosttrainError
from posttrain.sharding import to_host


@dataclasses.dataclass
class Hook:
    """`fn(step, state, metrics)` run after every `every`-th step and after the last step (every=0: after the
    last one only); `metrics` is the last logged record."""

    fn: Callable
    every: int = 0

    def __call__(self, step: int, state, metrics: dict):
        return self.fn(step, state, metrics)


@dataclasses.dataclass
class MetricsHook:
    """`fn(record) -> dict` merged into every logged record before the sinks see it (host-side figures: MFU,
    memory, an RL rollout's statistics)."""

    fn: Callable[[dict], dict]


class Stopped(Exception):
    """Raised by `train_loop` when its `stop()` said so after a step: `state` is the state after `step`
    (that step's hooks have run); `why` is what `stop()` returned (e.g. "SIGTERM")."""

    def __init__(self, step: int, state, why: str):
        super().__init__(f"stopped by {why} after step {step}")
        self.step, self.state, self.why = step, state, why


def _check_finite(metrics, step: int, max_nonfinite: int) -> None:
    run = int(to_host(metrics["nonfinite_run"])) if "nonfinite_run" in metrics else 0
    if run >= max_nonfinite:
        raise PosttrainError(
            f"training halted at step {step}: loss or gradient was NaN/Inf in {run} consecutive steps (each "
            "update was skipped, so the weights and the last checkpoint are intact). Lower optim.lr, check the "
            "data, or raise train.max_nonfinite")


def train_loop(step_fn, state, batches: Iterable[dict] | Callable[..., dict], *, steps: int, start_step: int = 0,
               log_every: int = 10, sinks: Sequence = (), hooks: Sequence[Hook | MetricsHook] = (),
               progress: bool = True, max_nonfinite: int = 3, profiler=None, place_batch: Optional[Callable] = None,
               stop: Optional[Callable[[], Optional[str]]] = None):
    """Run steps start_step+1 .. steps; returns (state, history of logged metric dicts).

    hooks: `Hook`s fire after their steps (in order), `MetricsHook`s add host-side figures to each logged record;
    place_batch(batch) puts a host batch on the devices (sharded over the mesh's batch axes; in a
    multi-process run it keeps this process's rows). stop() -> a reason or None is asked after each
    step (its hooks run first); a reason ends the loop with `Stopped` (not after the last step).
    `batches` gives global batches (tokens/s
    counts the global batch's tokens): an iterable, or a callable `batches(state) -> batch` called
    before each step with the current state (RL: rollouts sampled with the current weights).
    """
    if callable(batches):
        next_batch = batches
    else:
        it = iter(batches)

        def next_batch(_state):
            return next(it)

    metric_hooks = [h for h in hooks if isinstance(h, MetricsHook)]
    hooks = [h for h in hooks if not isinstance(h, MetricsHook)]
    history = []
    bar = tqdm(total=steps, initial=start_step, disable=not progress, dynamic_ncols=True, unit="step")
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    prev = None
    for step in range(start_step + 1, steps + 1):
        batch = next_batch(state)
        window_tokens += int(np.count_nonzero(batch["segment_ids"])) if "segment_ids" in batch else 0
        if place_batch is not None:
            batch = place_batch(batch)
        if profiler is not None:
            profiler.before_step(step)
        state, metrics = step_fn(state, batch)
        if profiler is not None:
            profiler.after_step(step, metrics)
        if prev is not None:
            _check_finite(prev, step - 1, max_nonfinite)
        prev = metrics
        window_steps += 1
        last = step == steps
        if (log_every and step % log_every == 0) or last:
            m = {k: float(to_host(v)) for k, v in metrics.items()}
            elapsed = time.perf_counter() - window_start
            m.update(step=step, tokens_per_s=window_tokens / elapsed, step_time_s=elapsed / window_steps)
            for h in metric_hooks:
                m.update(h.fn(m))
            history.append(m)
            for sink in sinks:
                sink.write(step, {k: v for k, v in m.items() if k != "step"})
            bar.set_postfix(loss=f"{m.get('loss', float('nan')):.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
            window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        if last:
            _check_finite(metrics, step, max_nonfinite)
        for h in hooks:
            if (h.every and step % h.every == 0) or last:
                h(step, state, history[-1] if history else {})
        bar.update(1)
        if stop is not None and not last and (why := stop()):
            bar.close()
            raise Stopped(step, state, why)
    bar.close()
    return state, history
