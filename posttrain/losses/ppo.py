"""PPO with a critic: GAE, advantage whitening, the clipped value loss, KL-shaped rewards.

What it is: pure `jnp` functions over per-token [N, T] arrays (N completions, T completion
positions; `mask` is 1 on the tokens that count, 0 on padding):
  gae(rewards, values, mask, *, gamma, lam) -> (advantages, returns)
      Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16) exactly as
      verl's `compute_gae_advantage_return` (token-level rewards), one reverse `lax.scan` over T:
        δ_t = r_t + γ·V_next − V_t,   A_t = δ_t + γλ·A_next,   R_t = A_t + V_t,
      where V_next / A_next are the value / advantage of the next position that is in the mask
      (0 after the last one). Masked positions carry nothing: they add no TD error, pass the
      recursion through unchanged, and their outputs are 0.
  masked_whiten(x, mask, *, shift_mean=True) -> (x − μ) / sqrt(σ² + 1e-8) over the masked tokens
      (σ² with Bessel's correction, as TRL's / verl's `masked_whiten`); 0 off the mask.
  value_loss(values, old_values, returns, mask, *, clip=0.2) -> (loss, metrics)
      PPO's clipped value loss (as verl's `compute_value_loss`, TRL's PPOTrainer):
        V̂ = old + clip(V − old, −clip, clip),  loss = 0.5 · mean_m( max((V − R)², (V̂ − R)²) )
      (masked token mean); clip=None is the plain 0.5 · squared error. Metrics: value_clipfrac
      (tokens where the clipped error is the larger), value_mean.
  token_rewards(scores, kl, mask, kl_coef) -> [N, T]: −kl_coef · kl on every token, plus the
      sequence score at the last masked token (TRL's / verl's KL-shaped rewards).
The clipped policy loss is `losses.policy.policy_loss` (token-mean "bnpo" aggregation, per-token
advantages); dual-clip (Ye et al. 2020, arXiv 1912.09729: for A < 0 the loss is capped at
−c·A) is its `delta = c` cap, which equals verl's `clip_ratio_c` rule whenever c > 1 + ε_high.

The PPO trainer's loss_fn over the policy and its critic (`make_ppo_loss`) runs the model and
lives with the recipe's rollout in `rl/ppo.py`.

What it is not: the rollout (`posttrain/rl/ppo.py`), the KL controllers, or the trainer.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from posttrain.losses.policy import token_kl


def gae(rewards, values, mask, *, gamma: float = 1.0, lam: float = 0.95):
    """(advantages, returns), both [N, T]; see the module docstring."""
    r = jnp.asarray(rewards)
    dtype = r.dtype if jnp.issubdtype(r.dtype, jnp.floating) else jnp.float32
    r, v = r.astype(dtype), jnp.asarray(values).astype(dtype)
    m = jnp.asarray(mask) != 0

    def body(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, carry[1]

    zero = jnp.zeros(r.shape[0], dtype)
    _, adv = jax.lax.scan(body, (zero, zero), (r.T, v.T, m.T), reverse=True)
    adv = jnp.where(m, adv.T, 0.0)
    return adv, jnp.where(m, adv + v, 0.0)


def masked_whiten(x, mask, *, shift_mean: bool = True, eps: float = 1e-8):
    """Whitened `x` over the tokens where mask != 0 (unbiased variance); 0 elsewhere."""
    x = jnp.asarray(x)
    m = (jnp.asarray(mask) != 0).astype(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / jnp.maximum(n, 1.0)
    var = (jnp.square(x - mean) * m).sum() / jnp.maximum(n - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def value_loss(values, old_values, returns, mask, *, clip: Optional[float] = 0.2):
    """(0.5 · masked token mean of the clipped squared error, metrics); see the module docstring."""
    v = jnp.asarray(values)
    old = jax.lax.stop_gradient(jnp.asarray(old_values, v.dtype))
    ret = jax.lax.stop_gradient(jnp.asarray(returns, v.dtype))
    m = (jnp.asarray(mask) != 0).astype(v.dtype)
    n = jnp.maximum(m.sum(), 1.0)
    err = jnp.square(v - ret)
    if clip is None:
        worst, clipped = err, jnp.zeros_like(err, bool)
    else:
        err_clipped = jnp.square(old + jnp.clip(v - old, -clip, clip) - ret)
        worst, clipped = jnp.maximum(err, err_clipped), err_clipped > err
    loss = 0.5 * (worst * m).sum() / n
    metrics = {"value_clipfrac": (clipped * m).sum() / n,
               "value_mean": (jax.lax.stop_gradient(v) * m).sum() / n}
    return loss, metrics


def token_rewards(scores, kl, mask, kl_coef):
    """Per-token rewards [N, T]: −kl_coef · kl on the masked tokens, + scores [N] at each row's last one."""
    m = jnp.asarray(mask) != 0
    kl = jnp.asarray(kl)
    T = kl.shape[1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=1)  # the last masked position (rows with none: ignored)
    at_end = (jnp.arange(T)[None, :] == last[:, None]) & m
    return jnp.where(m, -kl_coef * kl, 0.0) + jnp.where(at_end, jnp.asarray(scores, kl.dtype)[:, None], 0.0)


def reference_kl(logps, ref_logps, estimator: str = "k1"):
    """Per-token KL(π ‖ π_ref) estimate from the sampled tokens (`policy.token_kl`: k1 = logp − ref)."""
    return token_kl(logps, ref_logps, estimator)
