"""The optax chain from an OptimSection: clipping, AdamW with masked weight decay, LR schedules.

Exact recipe: optax.clip_by_global_norm(max_grad_norm) (skipped when None), then
optax.adamw(schedule, b1, b2, eps, weight_decay) with decay masked off norms and biases (any
parameter whose path names a norm or a bias), as transformers' Trainer does. The schedule is a
linear warm-up from 0 to lr over warmup_steps, then constant, linear or cosine decay to
lr * min_lr_ratio at total_steps.

The schedule's numbers (peak and floor LR, warm-up and decay steps) are arrays, not constants of
the compiled step: `schedule(cfg, total_steps)` is a `Schedule` pytree (its kind is the program's
shape, its numbers are leaves) computing the value optax's schedule (`optax.join_schedules` of
`linear_schedule` and `cosine_decay_schedule` / `linear_schedule` / `constant_schedule`) has in
a compiled step with its numbers as constants, bitwise (see `Schedule`),
and `make_optimizer(cfg, Schedule)` an `Optimizer`: the chain rebuilt inside the train step from
the numbers the step takes as arguments (`make_train_step`). Two runs that differ only in
train.steps, the warm-up or the LR then compile one program. The optimizer state is optax's
(the same pytree as `optax.adamw(<a schedule function>)`), so checkpoints are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Warm-up then constant / linear / cosine decay; `sched(count)` is the value optax's schedule has in a compiled
    program at `count`.

    XLA compiles optax's schedule with its numbers as constants into a folded form: `x / n` becomes `x * (1 / n)`,
    `pi * x / n` becomes `x * (pi * (1 / n))` and the cosine's `peak * ((1 - alpha) * 0.5 * (1 + cos) + alpha)`
    becomes `((cos + 1) * (0.5 * (1 - alpha)) + alpha) * peak`, each constant rounded to float32. This is that form
    with the folded constants as leaves (computed here in float32 as XLA folds them, from the float64 numbers optax
    gets), so a run's learning rates are bitwise those of the constant-number step (tests/test_schedule.py), and
    within 1 ulp of optax's formula evaluated op by op. `kind` is static."""

    kind: str
    peak: Any  # lr
    floor: Any  # lr * min_lr_ratio
    span: Any  # peak - floor
    alpha: Any  # min_lr_ratio
    half_keep: Any  # 0.5 * (1 - min_lr_ratio)
    inv_warmup: Any  # 1 / warmup_steps
    inv_decay: Any  # 1 / decay steps
    rad: Any  # pi / decay steps
    warmup: Any  # int32 warm-up steps
    decay: Any  # int32 decay steps

    def __call__(self, count):
        count = jnp.asarray(count)
        return jnp.where(count < self.warmup, self._warm(count), self._main(count - self.warmup))

    def _warm(self, count):  # optax.linear_schedule(0.0, peak, warmup); warmup 0: never selected
        frac = 1 - jnp.clip(count, 0, self.warmup).astype(jnp.float32) * self.inv_warmup
        return frac * -self.peak + self.peak

    def _main(self, count):
        if self.kind == "constant":  # optax.constant_schedule(peak)
            return self.peak
        if self.kind == "linear":  # optax.linear_schedule(peak, floor, decay)
            frac = 1 - jnp.clip(count, 0, self.decay).astype(jnp.float32) * self.inv_decay
            return frac * self.span + self.floor
        # optax.cosine_decay_schedule(peak, decay, alpha)
        count = jnp.minimum(count.astype(jnp.float32), self.decay.astype(jnp.float32))
        return ((jnp.cos(count * self.rad) + 1) * self.half_keep + self.alpha) * self.peak


jax.tree_util.register_dataclass(
    Schedule, data_fields=["peak", "floor", "span", "alpha", "half_keep", "inv_warmup", "inv_decay", "rad", "warmup",
                           "decay"], meta_fields=["kind"])


def schedule(cfg, total_steps: int) -> Schedule:
    """The LR schedule of an OptimSection over `total_steps` optimizer steps (numbers as NumPy scalars)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup, decay = max(cfg.warmup_steps, 0), max(1, total_steps - cfg.warmup_steps)
    f32, one = np.float32, np.float32(1)
    inv_decay = one / f32(decay)
    return Schedule(cfg.schedule, peak=f32(peak), floor=f32(floor), span=f32(peak - floor), alpha=f32(cfg.min_lr_ratio),
                    half_keep=f32(0.5) * f32(1 - cfg.min_lr_ratio), inv_warmup=one / f32(max(warmup, 1)),
                    inv_decay=inv_decay, rad=f32(np.pi) * inv_decay, warmup=np.int32(warmup), decay=np.int32(decay))


def optax_schedule(cfg, total_steps: int) -> optax.Schedule:
    """The same schedule built from optax's functions with Python numbers (constants of a compiled program)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "constant":
        main = optax.constant_schedule(peak)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(peak, floor, decay_steps)
    else:
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, cfg.warmup_steps), main], [cfg.warmup_steps])


def decay_mask(params):
    """True for weights that get weight decay: not norms, not biases."""

    def keep(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any("norm" in n or "bias" in n for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax chain built from schedule numbers: `build(numbers)` is the GradientTransformation; `numbers` (a
    pytree of `Schedule`s) are arguments of the train step, which builds the chain inside its trace. `init` /
    `update` build it from `numbers` as constants, for use outside a step."""

    build: Callable[[Any], optax.GradientTransformation]
    numbers: Any

    def init(self, params):
        return self.build(self.numbers).init(params)

    def update(self, updates, state, params=None, **extra):
        return self.build(self.numbers).update(updates, state, params, **extra)


def adamw_chain(cfg, lr) -> optax.GradientTransformation:
    """AdamW (decay masked off norms and biases) at the learning rate `lr` (a number or a schedule), after
    global-norm clipping."""
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def make_optimizer(cfg, lr):
    """`adamw_chain(cfg, lr)`; with a `Schedule` an `Optimizer` whose schedule numbers the train step takes as
    arguments (one compiled step for runs that differ only in their length or LR)."""
    if isinstance(lr, Schedule):
        return Optimizer(lambda s: adamw_chain(cfg, s), lr)
    return adamw_chain(cfg, lr)
