"""The DPO loss functions over prefix-shared pair rows: offline DPO's and online DPO's.

What it is: `make_dpo_loss(...)` returns `loss_fn(policy, batch, *, frozen, rng) -> (total, metrics)`
(the convention of `posttrain.losses`). A batch holds one pair per row, laid out by
`posttrain.data.branches` as [prompt | chosen | rejected] with branch 1 = chosen, 2 = rejected,
so the policy forward pays for the prompt once. The reference log-probabilities come from
`batch["ref_logps"]` [P, 2] when they were precomputed, else from a forward of `frozen` (the
reference model) on the same rows, without gradient. The per-pair loss is `dpo_loss`
(losses/preference.py, every TRL 1.16 type); the total is the sum over pairs, denom the pair
count, and the metrics (sums, divided by denom in the step) are TRL's: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies.
`make_pair_loss(beta=..., loss_type=...)` is TRL 1.16 OnlineDPOTrainer's loss over the same rows, sampled
and judged by the policy (`rl.pairs.PairRollout`): unit lengths (IPO squares the summed log-ratio margin)
and TRL's objective/* metrics.

What it is not: the data pipeline or the trainer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses.logps import branch_logps
from posttrain.losses.preference import dpo_loss


def make_dpo_loss(*, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                  reference: str | None = "frozen", forward=None):
    """`reference`: "frozen" (the reference log-probs are a forward of the `frozen` model when the
    batch has no "ref_logps"; a LoRA recipe passes the policy with its adapters off, see
    `recipes.recipe.lora_reference`) or None (precomputed: always batch["ref_logps"]).
    `forward`: the models' forward on the rows when not the plain one (image pairs: `vision.batched.forward_rows`,
    for the policy and the reference alike)."""
    if reference not in (None, "frozen"):
        raise ValueError(f"reference={reference!r}: use 'frozen' or None (precomputed)")

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        _, logps, counts = branch_logps(policy, batch, 2, forward=forward)
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
        elif frozen is not None:
            ref = jax.lax.stop_gradient(branch_logps(frozen, batch, 2, forward=forward)[1])
        else:
            raise ValueError("the DPO loss needs batch['ref_logps'] or a reference model (frozen=...)")
        real = (counts[:, 0] > 0).astype(jnp.float32)  # padding rows (no pair) count nothing
        losses, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], loss_type=loss_type, beta=beta,
                                  label_smoothing=label_smoothing, chosen_lengths=counts[:, 0],
                                  rejected_lengths=counts[:, 1])
        total = jnp.sum(losses * real)
        metrics = {"denom": jnp.sum(real), "loss": total, "rewards/chosen": jnp.sum(rc * real),
                   "rewards/rejected": jnp.sum(rr * real), "rewards/margins": jnp.sum((rc - rr) * real),
                   "rewards/accuracies": jnp.sum((rc > rr) * real),
                   "logps/chosen": jnp.sum(logps[:, 0] * real), "logps/rejected": jnp.sum(logps[:, 1] * real)}
        return total, metrics

    return loss_fn


def make_pair_loss(*, beta: float, loss_type: str):
    """loss_fn(policy, batch, *, frozen, rng) over [prompt | chosen | rejected] rows, `frozen` the reference:
    `dpo_loss` summed over the pairs, the metrics of `losses.dpo.make_dpo_loss` and TRL's objective/*.
    IPO gets unit lengths: TRL's OnlineDPOTrainer squares the summed log-ratio margin."""

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        _, logps, counts = branch_logps(policy, batch, 2)
        ref = jax.lax.stop_gradient(branch_logps(frozen, batch, 2)[1])
        real = (counts[:, 0] > 0).astype(jnp.float32)  # padding rows and dropped pairs count nothing
        one = jnp.ones_like(real)
        losses, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], loss_type=loss_type, beta=beta,
                                  chosen_lengths=one, rejected_lengths=one)
        s = lambda x: jnp.sum(x * real)  # noqa: E731
        kl = s((logps - ref).sum(1)) / 2  # per sample: the sum over its tokens of log pi - log pi_ref
        return s(losses), {"denom": jnp.sum(real), "loss": s(losses), "rewards/chosen": s(rc),
                           "rewards/rejected": s(rr), "rewards/margins": s(rc - rr), "rewards/accuracies": s(rc > rr),
                           "logps/chosen": s(logps[:, 0]), "logps/rejected": s(logps[:, 1]), "objective/kl": kl,
                           "objective/non_score_reward": -beta * kl, "objective/entropy": -s(logps.sum(1)) / 2}

    return loss_fn
