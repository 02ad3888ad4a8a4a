"""The optax chain from an OptimSection: clipping, AdamW with masked weight decay, LR schedules.

Exact recipe: optax.clip_by_global_norm(max_grad_norm) (skipped when None), then
optax.adamw(schedule, b1, b2, eps, weight_decay) with decay masked off norms and biases (any
parameter whose path names a norm or a bias), as transformers' Trainer does. The schedule is a
linear warm-up from 0 to lr over warmup_steps, then constant, linear or cosine decay to
lr * min_lr_ratio at total_steps.
"""

from __future__ import annotations

import jax
import optax


def schedule(cfg, total_steps: int) -> optax.Schedule:
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


def make_optimizer(cfg, lr: optax.Schedule) -> optax.GradientTransformation:
    """AdamW (decay masked off norms and biases) at the schedule `lr`, after global-norm clipping."""
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
