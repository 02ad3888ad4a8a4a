"""The GRPO trainer's loss function over prefix-shared group rows.

What it is: `make_grpo_loss(...)` returns `loss_fn(policy, batch, *, frozen, rng) -> (loss, metrics)`
(the convention of `posttrain.losses`, with denom = 1: `policy_loss` already normalises over the
batch as TRL's loss_type says, so the step must see the whole batch at once, no micro-batches).
A batch row is one prompt with its n sampled completions as branches (`data.branches.group_row`,
slot width T = max_new_tokens), so the policy forward pays for the prompt once; the per-token
log-probs [B, n·T] reshape to the sampler's [B·n, T] layout and go to `policy_loss` with
  old_logps   batch["old_logps"]  [B, n·T]  the sampler's log-probs (the "old" policy; no forward), or
  sampler_logps                    [B, n·T]  those of a sampler in another precision (rollout.dtype): the old
                                             policy is then the trainer's own (μ = 1) and `is_mode` corrects
                                             the mismatch (`policy_loss`'s sampler_logps; sampling/* metrics)
  advantages  batch["advantages"] [B, n]
  mask        batch["score_w"]    [B, n·T]  1 on sampled tokens (up to and including a stop token)
and, when beta > 0, reference log-probs from `frozen`, the reference model (a frozen copy, or the
policy with its LoRA adapters off: `recipes.recipe.lora_reference`). Metrics: loss, policy_loss's
(kl, clip_region_mean, ...), entropy (masked
token mean) and logp_mismatch_max = max |trainer − sampler| log-prob over the batch's tokens
(exactly on-policy at the first of μ iterations: ~1e-6 in float32). `forward` (image rows:
`vision.batched.forward_rows`) replaces the plain forward of the rows.

What it is not: the rollout (`posttrain/rl/`) or the advantage estimator (`losses/advantages.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses.logps import branch_logps
from posttrain.losses.policy import policy_loss, sampler_correction


def make_grpo_loss(*, num_generations: int, max_new_tokens: int, temperature: float = 1.0, loss_type: str = "dapo",
                   epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                   importance_sampling_level: str = "token", delta=None, is_mode=None, is_clip_max=3.0,
                   is_clip_min=None, forward=None):
    n, T = num_generations, max_new_tokens

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        tok, _, _, ent = branch_logps(policy, batch, n, temperature=temperature, with_entropy=True, forward=forward)
        N = tok.shape[0] * n
        new = tok.reshape(N, T)
        mask = batch["score_w"].reshape(N, T).astype(jnp.float32)
        # A sampler in another precision (batch["sampler_logps"]): the old policy is the trainer's own (on-policy,
        # μ = 1), the sampler's log-probs feed the mismatch correction (is_mode) or only its metrics.
        sampled = batch["sampler_logps"].reshape(N, T) if "sampler_logps" in batch else None
        old = batch["old_logps"].reshape(N, T) if sampled is None else jax.lax.stop_gradient(new)
        ref = None
        if beta:
            ref = jax.lax.stop_gradient(branch_logps(frozen, batch, n, temperature=temperature,
                                                     forward=forward)[0].reshape(N, T))
        loss, metrics = policy_loss(new, old, batch["advantages"].reshape(N), mask, loss_type=loss_type,
                                    epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, ref_logps=ref,
                                    importance_sampling_level=importance_sampling_level, max_completion_length=T,
                                    delta=delta, sampler_logps=sampled if is_mode else None,
                                    is_mode=is_mode or "sequence_mask", is_clip_max=is_clip_max,
                                    is_clip_min=is_clip_min)
        if sampled is not None and not is_mode:
            metrics.update(sampler_correction(old, sampled, mask, is_mode="token_truncate", is_clip_max=None)[1])
        tokens = jnp.maximum(mask.sum(), 1.0)
        metrics = {**metrics, "loss": loss, "denom": jnp.float32(1.0),
                   "entropy": jnp.sum(ent.reshape(N, T) * mask) / tokens,
                   "logp_mismatch_max": jnp.max(jnp.abs(jax.lax.stop_gradient(new) - (old if sampled is None else
                                                                                     sampled)) * mask)}
        return loss, metrics

    return loss_fn
