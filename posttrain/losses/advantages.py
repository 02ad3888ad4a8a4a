"""Advantage estimators for group-sampled RL: GRPO, RLOO and REINFORCE++ (outcome rewards), by name.

What this is: pure `jnp` functions from per-sample rewards to one advantage per sample, written to
agree with TRL 1.16 to float64 round-off (the parity tests drive TRL's own
`_generate_and_score_completions` with stand-ins for generation and reward calls). What it is not:
calling reward functions, nor token-level returns (GAE, discounted returns with a per-token KL in the
reward: those need a value model or per-token rewards and belong to PPO).

Inputs shared by every function (N = number of samples, F = number of reward functions):
  `rewards_per_func`  [N, F] (or [N] for one function) the raw reward of each function for each
                      sample. Rows are grouped CONSECUTIVELY: prompt i's `group_size` samples are
                      rows i·n .. i·n + n - 1 (TRL's RepeatSampler layout). NaN marks a reward function
                      that could not score that sample (TRL's `None`); a row that is NaN for EVERY
                      function is "unscorable": it is left out of every mean and std and its advantage
                      is 0 (TRL 1.16 semantics).
  `weights`           [F] reward-function weights (None → all 1; TRL's `reward_weights`).
  `group_size`        n, samples per prompt (TRL's `num_generations`); N must be a multiple of it.
The weighted reward of a sample is r = Σ_f w_f · r_f over its non-NaN functions (TRL: `nansum`).
Everything is computed in the dtype of `rewards_per_func` (float64 with `jax_enable_x64`).

By name (`grpo.advantages`): `ESTIMATORS` maps a name to a function with one signature,
`fn(rewards_per_func, weights, group_size, *, scale, lengths) -> [N]` (`scale`: `grpo.scale_rewards`;
`lengths` [N]: each sample's completion tokens), and `estimate_advantages(name, ...)` calls it. A new
variant is one function under `@register_advantages("name")` (plus its test against TRL where TRL has it).

References: GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, §4.1.2); Dr. GRPO (Liu et al.
2025, arXiv 2503.20783: no std scaling); batch std scaling (PPO Lite, Liu et al. 2025, arXiv
2508.08221); GDPO (arXiv 2601.05242: normalise each reward then sum); RLOO (Kool et al. 2019,
"Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024, arXiv 2402.14740);
REINFORCE++ (Hu et al. 2025, arXiv 2501.03262). TRL 1.16: `trl/trainer/grpo_trainer.py::
GRPOTrainer._generate_and_score_completions`, `trl/trainer/rloo_trainer.py::
RLOOTrainer._generate_and_score_completions`, `trl/trainer/utils.py::nanstd`. OpenRLHF:
`openrlhf/trainer/ppo_utils/experience_maker.py::compute_advantages_and_returns`.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

SCALE_OPTIONS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _nanstd(x, axis=None, keepdims=False):
    """Standard deviation ignoring NaNs, Bessel-corrected (n - 1); NaN where fewer than 2 values.

    As TRL's `trl.trainer.utils.nanstd` (and `torch.std`'s default `correction=1`).
    """
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    var = jnp.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True).astype(x.dtype)
    var = var * jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
    std = jnp.sqrt(var)
    return std if keepdims else jnp.squeeze(std, axis=axis)


def _prepare(rewards_per_func, weights, group_size, fn):
    """(rewards_per_func [N, F], weights [F], unscorable [N] bool) with shape checks."""
    r = jnp.asarray(rewards_per_func)
    if not jnp.issubdtype(r.dtype, jnp.floating):
        r = r.astype(jnp.result_type(float))
    if r.ndim == 1:
        r = r[:, None]
    if r.ndim != 2:
        raise ValueError(f"{fn}: rewards_per_func must be [N] or [N, F], got shape {r.shape}")
    n_rows, n_funcs = r.shape
    if group_size < 1 or n_rows % group_size:
        raise ValueError(f"{fn}: {n_rows} rows do not split into groups of group_size={group_size}; rows must "
                         "be grouped consecutively, group_size samples per prompt")
    w = jnp.ones((n_funcs,), r.dtype) if weights is None else jnp.asarray(weights, r.dtype).reshape(-1)
    if w.shape != (n_funcs,):
        raise ValueError(f"{fn}: {w.shape[0]} weights for {n_funcs} reward functions")
    return r, w, jnp.all(jnp.isnan(r), axis=1)


def _weighted_reward(r, w, unscorable):
    """Σ_f w_f·r_f over non-NaN functions; NaN for unscorable rows (TRL: nansum, then re-mark NaN)."""
    return jnp.where(unscorable, jnp.nan, jnp.nansum(r * w[None, :], axis=1))


def weighted_rewards(rewards_per_func, weights=None):
    """[N] weighted reward per sample, NaN where every function failed (for logging `reward`)."""
    r, w, unscorable = _prepare(rewards_per_func, weights, 1, "weighted_rewards")
    return _weighted_reward(r, w, unscorable)


def group_advantages(rewards_per_func, weights, group_size, *, scale="group", eps=1e-4,
                     aggregation="sum_then_normalize"):
    """[N] GRPO advantages, exactly as TRL 1.16's GRPOTrainer (`_generate_and_score_completions`).

    aggregation="sum_then_normalize" (TRL's default `multi_objective_aggregation`):
        r_i   = Σ_f w_f·r_{i,f}                        (weighted reward, NaN functions skipped)
        μ_g   = mean of r over the group g of i        (unscorable rows excluded)
        A_i   = (r_i - μ_g) / (σ + eps)   with σ per `scale`:
          "group"  σ = std of r over the group (n - 1 denominator)       GRPO eq. (outcome supervision)
          "batch"  σ = std of r over all N rows (n - 1), μ still per group    PPO Lite
          "none"   A_i = r_i - μ_g, no division                               Dr. GRPO
    aggregation="normalize_then_sum" (GDPO; TRL ignores `scale` there, and so does this):
        ř_{i,f} = (r_{i,f} - μ_{g,f}) / (σ_{g,f} + eps)  per function over the group,
        r_i = Σ_f w_f·ř_{i,f},  A_i = (r_i - mean_N r) / (std_N r + eps)   (batch whitening).
    The std is Bessel-corrected (TRL's `nanstd`); a group (or batch) with one scorable row has an
    undefined std, which makes its advantages NaN → 0, as TRL. `group_size == 1` gives σ = 0 (TRL's
    eval-time special case). `eps` = 1e-4 is TRL's constant. Unscorable rows get 0. A group whose
    rewards are all equal gets 0 under every scale.
    """
    if scale not in SCALE_OPTIONS:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; expected one of {list(SCALE_OPTIONS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"group_advantages: unknown aggregation {aggregation!r}; expected one of "
                         f"{list(AGGREGATIONS)}")
    r, w, unscorable = _prepare(rewards_per_func, weights, group_size, "group_advantages")
    n = group_size

    if aggregation == "sum_then_normalize":
        rewards = _weighted_reward(r, w, unscorable)
        grouped = rewards.reshape(-1, n)
        mean = jnp.repeat(jnp.nanmean(grouped, axis=1), n)
        if scale == "batch":
            std = jnp.broadcast_to(_nanstd(rewards), rewards.shape) if rewards.size > 1 else jnp.zeros_like(rewards)
        else:
            std = jnp.repeat(_nanstd(grouped, axis=1), n) if n > 1 else jnp.zeros_like(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + eps)
    else:
        grouped = r.reshape(-1, n, r.shape[1])
        mean_k = jnp.nanmean(grouped, axis=1, keepdims=True)
        std_k = _nanstd(grouped, axis=1, keepdims=True) if n > 1 else jnp.zeros_like(mean_k)
        per_func = ((grouped - mean_k) / (std_k + eps)).reshape(r.shape)
        rewards = _weighted_reward(per_func, w, unscorable)
        std = _nanstd(rewards) if rewards.size > 1 else jnp.zeros((), rewards.dtype)
        adv = (rewards - jnp.nanmean(rewards)) / (std + eps)
    return jnp.nan_to_num(adv, nan=0.0)


def rloo_advantages(rewards_per_func, weights, group_size, *, normalize=False, eps=1e-4, kl_penalty=None,
                    reward_clip=None):
    """[N] RLOO advantages (leave-one-out baseline), exactly as TRL 1.16's RLOOTrainer.

        r_i = clip(Σ_f w_f·r_{i,f}, reward_clip) - kl_penalty_i
        A_i = r_i - (Σ_{j∈g, j≠i} r_j) / (k_g - 1)          k_g = scorable rows of the group
            = k_g/(k_g - 1) · (r_i - mean_g r)              (Kool et al. 2019; Ahmadian et al. 2024 eq. 6)
        normalize=True: A ← (A - mean_N A) / (std_N A + eps)   (std with n - 1; TRL `normalize_advantages`)
    Unscorable rows are excluded from their group's baseline (the divisor is k_g - 1) and get 0; a
    group with a single scorable row has no baseline and gets 0 (TRL: 0/0 → NaN → 0); group_size 1
    gives 0. `reward_clip` = (low, high) is TRL's `reward_clip_range`. `kl_penalty` [N] is TRL's
    in-reward KL term with beta ≠ 0: beta · Σ_t mask·(old_logps - ref_logps), the sequence sum of the
    k1 estimator on the sampling policy's log-probs (TRL's RLOO puts the KL in the reward, not in the
    loss); None = beta 0.
    """
    r, w, unscorable = _prepare(rewards_per_func, weights, group_size, "rloo_advantages")
    n = group_size
    rewards = _weighted_reward(r, w, unscorable)
    if reward_clip is not None:
        rewards = jnp.clip(rewards, reward_clip[0], reward_clip[1])
    if kl_penalty is not None:
        rewards = rewards - jnp.asarray(kl_penalty, rewards.dtype)
    if n > 1:
        grouped = rewards.reshape(-1, n)
        count = jnp.sum(~jnp.isnan(grouped), axis=1, keepdims=True).astype(rewards.dtype)
        baselines = (jnp.nansum(grouped, axis=1, keepdims=True) - grouped) / (count - 1)
        adv = rewards - baselines.reshape(-1)
    else:
        adv = jnp.zeros_like(rewards)
    if normalize:
        adv = (adv - jnp.nanmean(adv)) / (_nanstd(adv) + eps)
    return jnp.nan_to_num(adv, nan=0.0)


def reinforce_pp_advantages(rewards_per_func, weights, group_size, *, baseline=True, lengths=None,
                            std_norm=True):
    """[N] REINFORCE++ advantages (global whitening), as OpenRLHF's `compute_advantages_and_returns`.

        baseline=True  ("reinforce_baseline", REINFORCE++-baseline):  a_i = r_i - mean_g r
        baseline=False ("reinforce", REINFORCE++):                    a_i = r_i
        A_i = (a_i - m) / sqrt(max(v, 1e-8)),  m = Σ_i L_i a_i / Σ_i L_i,  v = Σ_i L_i (a_i - m)² / Σ_i L_i
    (Hu et al. 2025, arXiv 2501.03262, §3: global advantage normalisation over the batch; the group
    mean is the "-baseline" variant; no per-group std, which it argues biases toward easy prompts.)
    OpenRLHF whitens per TOKEN over the action mask: an outcome reward with γ = 1 gives every token of
    sample i the return a_i, so each sample weighs L_i = its number of completion tokens. Pass
    `lengths` [N] (mask.sum(-1)) to reproduce that exactly; None weighs every sample once. The
    variance is the biased (population) one and the std is floored at 1e-4 (rsqrt of var clamped at
    1e-8), as OpenRLHF. `std_norm=False` only centres (OpenRLHF `--no_advantage_std_norm`).
    Not here: OpenRLHF's per-token KL in the reward (`use_kl_loss=False`), which makes advantages vary
    along the sequence; use the policy loss's beta term (OpenRLHF `use_kl_loss=True`) instead.
    Unscorable rows are left out of the mean and the statistics and get 0 (the TRL convention above).
    """
    r, w, unscorable = _prepare(rewards_per_func, weights, group_size, "reinforce_pp_advantages")
    rewards = _weighted_reward(r, w, unscorable)
    if baseline:
        rewards = rewards - jnp.repeat(jnp.nanmean(rewards.reshape(-1, group_size), axis=1), group_size)
    weight = jnp.ones_like(rewards) if lengths is None else jnp.asarray(lengths).astype(rewards.dtype)
    weight = jnp.where(jnp.isnan(rewards), 0.0, weight)
    a = jnp.nan_to_num(rewards, nan=0.0)
    total = jnp.maximum(jnp.sum(weight), jnp.finfo(rewards.dtype).tiny)
    mean = jnp.sum(weight * a) / total
    adv = a - mean
    if std_norm:
        var = jnp.sum(weight * adv**2) / total
        adv = adv / jnp.sqrt(jnp.maximum(var, 1e-8))
    return jnp.where(jnp.isnan(rewards), 0.0, adv)


# ------------------------------------------------------------------------------------ by name

ESTIMATORS: dict[str, Callable] = {}  # grpo.advantages name -> fn(rewards_per_func, weights, n, *, scale, lengths)


def register_advantages(name: str):
    """Decorator: `fn(rewards_per_func, weights, group_size, *, scale, lengths) -> [N]` becomes the estimator
    `name` (`grpo.advantages: name`). `scale` is `grpo.scale_rewards` (only "group" may read it: the config
    refuses another scale with another estimator); `lengths` [N] holds each sample's completion tokens."""
    def register(fn: Callable) -> Callable:
        ESTIMATORS[name] = fn
        return fn
    return register


def estimate_advantages(name: str, rewards_per_func, weights, group_size, *, scale="group", lengths=None):
    """[N] advantages of the estimator registered as `name` (see `ESTIMATORS`)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](rewards_per_func, weights, group_size, scale=scale, lengths=lengths)


@register_advantages("group")
def grpo_estimator(rewards_per_func, weights, group_size, *, scale, lengths):
    """GRPO: (r - group mean) / (std + eps), std per `scale` (TRL's GRPOTrainer, `scale_rewards`)."""
    return group_advantages(rewards_per_func, weights, group_size, scale=scale)


@register_advantages("rloo")
def rloo_estimator(rewards_per_func, weights, group_size, *, scale, lengths):
    """RLOO with TRL's RLOOTrainer defaults (normalize_advantages=False, no reward_clip_range). TRL's RLOO puts
    its beta KL in the reward; here `grpo.beta` stays in the loss, so TRL's advantages are met at beta 0."""
    return rloo_advantages(rewards_per_func, weights, group_size)


@register_advantages("reinforce_pp")
def reinforce_pp_estimator(rewards_per_func, weights, group_size, *, scale, lengths):
    """REINFORCE++-baseline (OpenRLHF `reinforce_baseline`, the group-sampling form): r - group mean, whitened
    over every completion token of the batch (each sample weighs its `lengths`)."""
    return reinforce_pp_advantages(rewards_per_func, weights, group_size, baseline=True, lengths=lengths)
