"""The reward-model loss per pair: `per_pair_loss(chosen, rejected, margin, center_coefficient)`.

Variant (TRL 1.16 `RewardTrainer.compute_loss`, as `losses.preference.reward_loss`): with r_c, r_r
the scalar scores of the chosen and rejected sequences and m the row's "margin" column,
    loss = mean_P[ -logσ(r_c - r_r - m) + center_coefficient · (r_c + r_r)² ]
(Bradley–Terry / InstructGPT eq. 1; Llama 2's margin; reward centering, Eisenstein et al. 2023,
arXiv 2312.09244 eq. 2). The centering term is TRL's coefficient times the batch mean of
(r_c + r_r)², which is the mean of per-pair terms, so the per-pair form above sums exactly:
the recipe's `loss_fn` (`make_reward_loss(scores)`, `scores` the model's pair scorer,
`models.heads.pair_scores`: losses/ imports nothing from models/) returns
the SUM over the batch's real pairs and `denom` = their count (the loss convention,
`losses/__init__.py`), and micro-batching gives the full-batch value.

Scores: one forward over each row [prompt | chosen | rejected] (branch 1 = chosen, 2 = rejected,
`data/branches.py`); the attention rule makes the final hidden state at each branch's slots
equal to that of the unshared row [prompt | answer], and `models.heads.score_index` picks the
slot HF's sequence classifier scores (the rightmost non-pad token of prompt + that branch).

Metrics (sums, divided by denom in the step): loss, accuracy (r_c > r_r), margin (r_c - r_r),
rewards/chosen, rewards/rejected — TRL's names.

What it is not: the trainer (`trainers/reward_model.py`) or the score head (`models/heads.py`).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp


def per_pair_loss(chosen, rejected, margin=None, center_coefficient: Optional[float] = None):
    """[P] terms whose mean is `losses.preference.reward_loss(chosen, rejected, margin=..., ...)`."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -jax.nn.log_sigmoid(diff)
    if center_coefficient is not None:
        loss = loss + center_coefficient * (chosen + rejected) ** 2
    return loss


def make_reward_loss(scores: Callable, *, use_margin: bool = True, center_coefficient: Optional[float] = None):
    """`loss_fn(policy, batch, *, frozen=None, rng=None) -> (sum over pairs, metric sums)` of a reward model.

    `scores(model, batch) -> (chosen [B], rejected [B])`: the model's scores of the pair rows
    (`functools.partial(models.heads.pair_scores, pad_id=tok.pad_id)`: the slot transformers scores);
    `use_margin`: subtract the row's "margin"."""

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        del frozen, rng
        chosen, rejected = scores(policy, batch)
        real = jnp.any(batch["branch_ids"] == 2, axis=-1).astype(jnp.float32)  # padding rows have no answer
        margin = batch["margin"].astype(jnp.float32) if use_margin and "margin" in batch else None
        total = jnp.sum(real * per_pair_loss(chosen, rejected, margin, center_coefficient))
        sg = jax.lax.stop_gradient
        c, r = sg(chosen), sg(rejected)
        metrics = {"loss": sg(total), "denom": jnp.sum(real),
                   "accuracy": jnp.sum(real * (c > r).astype(jnp.float32)), "margin": jnp.sum(real * (c - r)),
                   "rewards/chosen": jnp.sum(real * c), "rewards/rejected": jnp.sum(real * r)}
        return total, metrics

    return loss_fn
