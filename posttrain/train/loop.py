"""The one training loop: steps the jitted train step and fires hooks every N steps.

What it is: the only place that iterates training. Logging (console progress bar + JSONL
metrics), evaluation and checkpointing are hooks `(step, state, metrics) -> None` that run
outside the jitted step, every `hook.every` steps and at the last step. Device metrics are
fetched only on logging steps, so ordinary steps never wait for the host.
What it is not: a trainer recipe (see `posttrain.trainers`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterable, Optional, Sequence

import jax
import numpy as np
from tqdm import tqdm


class Hook:
    """Something to run every `every` steps (and after the last step)."""

    every: int = 0

    def __call__(self, step: int, state, metrics: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class FnHook(Hook):
    def __init__(self, every: int, fn: Callable):
        self.every, self.fn = every, fn

    def __call__(self, step, state, metrics):
        self.fn(step, state, metrics)


def train_loop(step_fn, state, batches: Iterable[dict], *, steps: int, start_step: int = 0,
               log_every: int = 10, metrics_path: Optional[str] = None, hooks: Sequence[Hook] = (),
               progress: bool = True, frozen=None):
    """Run steps start_step+1 .. steps; returns (state, history of logged metric dicts)."""
    it = iter(batches)
    history = []
    bar = tqdm(total=steps, initial=start_step, disable=not progress, dynamic_ncols=True, unit="step")
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    for step in range(start_step + 1, steps + 1):
        batch = next(it)
        window_tokens += int(np.count_nonzero(batch["segment_ids"])) if "segment_ids" in batch else 0
        state, metrics = step_fn(state, batch) if frozen is None else step_fn(state, batch, frozen)
        window_steps += 1
        last = step == steps
        if (log_every and step % log_every == 0) or last:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            elapsed = time.perf_counter() - window_start
            m.update(step=step, tokens_per_s=window_tokens / elapsed, step_time_s=elapsed / window_steps)
            history.append(m)
            if metrics_path:
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(m) + "\n")
            bar.set_postfix(loss=f"{m.get('loss', float('nan')):.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
            window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        for h in hooks:
            if (h.every and step % h.every == 0) or last:
                h(step, state, history[-1] if history else {})
        bar.update(1)
    bar.close()
    return state, history


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
