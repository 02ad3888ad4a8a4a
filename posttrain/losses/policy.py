"""Clipped policy-gradient losses of the GRPO family (GRPO, BNPO, Dr. GRPO, DAPO, GSPO, CISPO, SAPO,
LUSPO, VESPO), with an optional KL penalty to a frozen reference.

What this is: one pure `jnp` function from per-token log-probabilities and per-sample advantages to
(loss, metrics), written to agree with TRL 1.16's `GRPOTrainer._compute_loss` to float64 round-off,
gradients included (the parity tests call that method with a stand-in trainer). What it is not: the
forwards that produce the log-probabilities (policy, and the reference only when beta ≠ 0), the
rollout, or gradient accumulation (TRL divides grpo/bnpo/dr_grpo by the accumulation steps and dapo by
a rescaled global token count; here one call is one batch, see `num_tokens`).

Inputs (N samples, T completion positions):
  `new_logps`   [N, T] log π_θ(y_t | x, y_<t) of the policy being trained (gradients flow here only);
  `old_logps`   [N, T] log π_old of the policy that sampled (the sampler's log-probs). None means
                on-policy (μ = 1): π_old = stop_gradient(π_θ), so every ratio is 1 (TRL's default
                path, no extra forward);
  `advantages`  [N] one advantage per sample (or [N, T] per token);
  `mask`        [N, T] 1 on completion tokens that count, 0 on padding (float or bool);
  `ref_logps`   [N, T] log π_ref, needed only when beta ≠ 0.
All inputs except `new_logps` are constants (`stop_gradient`). Positions where mask = 0 must hold
finite numbers (they are multiplied by 0, as in TRL).

Notation: ρ_t = π_θ/π_old per token = exp(new - old); with importance_sampling_level="sequence"
(GSPO, Zheng et al. 2025, arXiv 2507.18071, eq. 7) one ratio per sample
s_i = exp(Σ_t m_t·(new - old) / max(L_i, 1)) replaces every ρ_t of sample i. L_i = Σ_t m_t.

References: PPO (Schulman et al. 2017, arXiv 1707.06347); GRPO (Shao et al. 2024, arXiv 2402.03300,
eq. 3); DAPO (Yu et al. 2025, arXiv 2503.14476: clip-higher ε_high, token-level mean); Dr. GRPO (Liu
et al. 2025, arXiv 2503.20783); two-sided clip δ (INTELLECT-2, arXiv 2505.07291); CISPO (MiniMax-M1,
arXiv 2506.13585); SAPO (arXiv 2511.20347); LUSPO (arXiv 2602.05261); VESPO (arXiv 2602.10693); KL
estimators k1/k2/k3 (Schulman 2020, "Approximating KL divergence", joschu.net/blog/kl-approx.html);
KL bias correction (DeepSeek-V3.2, arXiv 2512.02556). TRL 1.16: `trl/trainer/grpo_trainer.py::
GRPOTrainer._compute_loss`, `GRPOTrainer.get_gamma_weights`; options in `trl/trainer/grpo_config.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
# Sampler/trainer mismatch correction (TRL 1.16's vllm_importance_sampling_mode).
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction(old_logps, sampler_logps, mask, *, is_mode="sequence_mask", is_clip_max=3.0, is_clip_min=None):
    """(weights, metrics) correcting for a sampler whose log-probs differ from the trainer's own (another
    precision, another engine): TRL 1.16's `vllm_importance_sampling_*` computation.

    d = (old - sampler)·m, NaN sampler log-probs giving d = 0 (no correction); token modes: w = exp(d) per
    token [N, T]; sequence modes: w = exp(Σ_t d) per sample [N, 1]. *_truncate clips w to [is_clip_min,
    is_clip_max] (None: no bound); *_mask sets w = 0 outside it. The weights are constants (no gradient).
    Metrics (TRL's names): sampling/sampling_logp_difference/{mean,max} of |old - sampler| over the tokens
    (NaN ones left out), sampling/importance_sampling_ratio/{min,mean,max} of w (over the tokens at token
    level, over every sample at sequence level; 0 when there are none), and sampling/mismatch_kl: the
    k3 estimate of KL(π_sampler ‖ π_old) per token from the sampler's own samples, r - 1 - log r with
    r = exp(old - sampler), averaged over the tokens."""
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {is_mode!r}; expected one of {list(IS_MODES)}")
    old = jax.lax.stop_gradient(jnp.asarray(old_logps))
    sampler = jnp.asarray(sampler_logps, old.dtype)
    m = jnp.asarray(mask).astype(old.dtype)
    diff = jnp.nan_to_num((old - sampler) * m, nan=0.0)
    seq = is_mode.startswith("sequence")
    w = jnp.exp(diff.sum(-1, keepdims=True) if seq else diff)
    lo = -jnp.inf if is_clip_min is None else is_clip_min
    hi = jnp.inf if is_clip_max is None else is_clip_max
    if is_mode.endswith("truncate"):
        w = jnp.clip(w, lo, hi)
    else:
        w = jnp.where((w < lo) | (w > hi), 0.0, w)
    w = jax.lax.stop_gradient(w)
    tokens = (m > 0) & ~jnp.isnan(sampler)
    n_tok = tokens.sum()
    delta = jnp.where(tokens, jnp.abs(old - jnp.nan_to_num(sampler)), 0.0)
    r = jnp.where(tokens, old - jnp.nan_to_num(sampler), 0.0)
    where = jnp.ones(w.shape, bool) if seq else m > 0
    count = where.sum()
    metrics = {
        "sampling/sampling_logp_difference/mean": jnp.where(n_tok > 0, delta.sum() / jnp.maximum(n_tok, 1), 0.0),
        "sampling/sampling_logp_difference/max": jnp.where(n_tok > 0, jnp.max(delta), 0.0),
        "sampling/importance_sampling_ratio/min": jnp.where(count > 0, jnp.min(jnp.where(where, w, jnp.inf)), 0.0),
        "sampling/importance_sampling_ratio/mean": jnp.where(count > 0, jnp.sum(jnp.where(where, w, 0.0))
                                                             / jnp.maximum(count, 1), 0.0),
        "sampling/importance_sampling_ratio/max": jnp.where(count > 0, jnp.max(jnp.where(where, w, -jnp.inf)), 0.0),
        "sampling/mismatch_kl": jnp.sum(jnp.where(tokens, jnp.exp(r) - 1 - r, 0.0)) / jnp.maximum(n_tok, 1)}
    return w, {k: v.astype(old.dtype) for k, v in metrics.items()}


def token_kl(new_logps, ref_logps, estimator="k3"):
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ, with d = ref - new = log(π_ref/π_θ):

        k1 = -d                   unbiased, can be negative
        k2 = d² / 2               biased, its gradient is the true reverse-KL gradient on-policy
        k3 = exp(d) - d - 1       unbiased and ≥ 0: TRL's GRPO `per_token_kl` (Schulman 2020)
    """
    d = ref_logps - new_logps
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {list(KL_ESTIMATORS)}")


@dataclasses.dataclass(frozen=True)
class Terms:
    """What every policy-loss variant reads, computed once by `policy_loss` (all [N, T] unless noted).

    `new` (log π_θ, the one input with a gradient), `log_ratio` = new - old, `ratio` (ρ_t, or GSPO's s_i as
    [N, 1]), `adv` ([N, 1] or [N, T]), `m` the mask, `lengths` [N] = Σ_t m, `n_active` = Σ m, `seq_level`,
    `is_w` (the sampler correction's weights or None) and `opts` (policy_loss's keyword options:
    epsilon_low, epsilon_high, delta, sapo_*, vespo_*, max_completion_length, num_tokens)."""

    new: jax.Array
    log_ratio: jax.Array
    ratio: jax.Array
    adv: jax.Array
    m: jax.Array
    lengths: jax.Array
    n_active: jax.Array
    seq_level: bool
    is_w: Optional[jax.Array]
    opts: dict

    def global_mean(self, x):
        """TRL's `global_masked_mean`: over tokens, or over samples for a per-sample [N, 1] value."""
        x = x.astype(self.new.dtype)
        if x.shape[1] == 1 and self.seq_level:
            return x.sum() / max(self.new.shape[0], 1)
        return (x * self.m).sum() / jnp.maximum(self.n_active, 1.0)

    def per_sample(self, x):
        """TRL's `masked_seq_mean`: NaN for a sample without tokens (dropped by nanmin/nanmax)."""
        x = x.astype(self.new.dtype)
        if x.shape[1] == 1 and self.seq_level:
            return x[:, 0]
        return (x * self.m).sum(-1) / self.lengths


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered variant: `per_token(terms) -> (ℓ_t before the correction and the KL term, metrics_fn)`, where
    `metrics_fn(terms)` gives its own metrics (computed last, from stop-gradient ratios); `normaliser` names the
    aggregation in `NORMALISERS`; `corrected`: the sampler correction's weights multiply ℓ_t (vespo folds them
    into φ instead)."""

    name: str
    per_token: Callable
    normaliser: str
    corrected: bool = True


POLICY_LOSSES: dict[str, PolicyLoss] = {}

# Σ_t m·ℓ -> the loss (TRL 1.16's normalisers for one process, one micro-batch)
NORMALISERS: dict[str, Callable] = {
    "sample_mean": lambda masked, t: jnp.mean(masked.sum(-1) / jnp.maximum(t.lengths, 1.0)),  # grpo, sapo
    "batch_tokens": lambda masked, t: masked.sum() / jnp.maximum(t.n_active, 1.0),  # bnpo
    "fixed_tokens": lambda masked, t: masked.sum() / (  # dr_grpo: N · max_completion_length (None -> T)
        masked.shape[0] * (t.m.shape[1] if t.opts["max_completion_length"] is None
                           else t.opts["max_completion_length"])),
    "num_tokens": lambda masked, t: masked.sum() / jnp.maximum(  # dapo, cispo, vespo
        t.n_active if t.opts["num_tokens"] is None else jnp.asarray(t.opts["num_tokens"], t.new.dtype), 1.0),
    "sample_sum": lambda masked, t: jnp.mean(masked.sum(-1)),  # luspo
}


def register_policy_loss(*names: str, normaliser: str, corrected: bool = True):
    """Decorator: `fn(terms) -> (per_token, metrics_fn)` becomes the policy loss `name` (each of `names`)."""
    if normaliser not in NORMALISERS:
        raise ValueError(f"unknown normaliser {normaliser!r}; expected one of {list(NORMALISERS)}")

    def register(fn):
        for name in names:
            POLICY_LOSSES[name] = PolicyLoss(name, fn, normaliser, corrected)
        return fn

    return register


def _clip_metrics(ratio, t: Terms) -> dict:
    eps_low, eps_high = t.opts["epsilon_low"], t.opts["epsilon_high"]
    low = (ratio < 1 - eps_low) & (t.adv < 0)
    high = (ratio > 1 + eps_high) & (t.adv > 0)
    return {"clip_low_mean": t.global_mean(low), "clip_high_mean": t.global_mean(high),
            "clip_region_mean": t.global_mean(low | high), "clip_low_min": jnp.nanmin(t.per_sample(low)),
            "clip_high_max": jnp.nanmax(t.per_sample(high))}


@register_policy_loss("grpo", normaliser="sample_mean")
@register_policy_loss("bnpo", normaliser="batch_tokens")
@register_policy_loss("dr_grpo", normaliser="fixed_tokens")
@register_policy_loss("dapo", normaliser="num_tokens")
@register_policy_loss("luspo", normaliser="sample_sum")
def _ppo_clip(t: Terms):
    """PPO clip: -min(ρ̃·A, clip(ρ, 1 - ε_l, 1 + ε_h)·A), ρ̃ = min(ρ, δ) with `delta` (INTELLECT-2)."""
    coef_1, adv = t.ratio, t.adv
    coef_2 = jnp.clip(coef_1, 1 - t.opts["epsilon_low"], 1 + t.opts["epsilon_high"])
    if t.opts["delta"] is not None:
        coef_1 = jnp.minimum(coef_1, t.opts["delta"])  # two-sided clip; the clip metrics see the cap too (TRL)
    per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    return per_token, lambda t: _clip_metrics(jax.lax.stop_gradient(coef_1), t)


@register_policy_loss("cispo", normaliser="num_tokens")
def _cispo(t: Terms):
    """CISPO: -sg(min(ρ, ε_h))·A·log π_θ."""
    eps_high = t.opts["epsilon_high"]
    clamped = jax.lax.stop_gradient(jnp.minimum(t.ratio, eps_high))
    per_token = -clamped * t.adv * t.new
    return per_token, lambda t: {"cispo_clip_ratio": t.global_mean((jax.lax.stop_gradient(t.ratio) > eps_high)
                                                                   & (t.adv > 0))}


@register_policy_loss("sapo", normaliser="sample_mean")
def _sapo(t: Terms):
    """SAPO: -(4/τ)·σ(τ·(ρ - 1))·A, τ by the sign of A."""
    temps = jnp.where(t.adv > 0, t.opts["sapo_temperature_pos"], t.opts["sapo_temperature_neg"]).astype(t.new.dtype)
    return -(jax.nn.sigmoid(temps * (t.ratio - 1)) * 4 / temps) * t.adv, lambda t: {}


@register_policy_loss("vespo", normaliser="num_tokens", corrected=False)
def _vespo(t: Terms):
    """VESPO: a stop-gradient Gamma weight of the sequence ratio times the REINFORCE term."""
    o = t.opts
    phi = _vespo_weights(t.log_ratio, t.m, t.adv, o["vespo_k_pos"], o["vespo_lambda_pos"], o["vespo_k_neg"],
                         o["vespo_lambda_neg"], t.is_w)
    return -phi * t.adv * t.new, lambda t: {"vespo_phi_seq_mean": jnp.mean(phi) if phi.shape[1] == 1
                                            else t.global_mean(phi)}


def policy_loss(
    new_logps,
    old_logps,
    advantages,
    mask,
    *,
    loss_type="dapo",
    epsilon_low=0.2,
    epsilon_high=0.2,
    beta=0.0,
    ref_logps=None,
    importance_sampling_level="token",
    max_completion_length=None,
    kl_bias_correction=True,
    kl_estimator="k3",
    delta=None,
    num_tokens=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    sampler_logps=None,
    is_mode="sequence_mask",
    is_clip_max=3.0,
    is_clip_min=None,
):
    """(loss scalar, metrics dict of scalars) of one GRPO-family policy loss, as TRL 1.16.

    Per-token loss ℓ_t (ρ_t, A broadcast over the sample's tokens; ε_l = `epsilon_low`, ε_h =
    `epsilon_high`; defaults and names follow GRPOConfig: epsilon, epsilon_high, delta, beta, ...):
      grpo, bnpo, dr_grpo, dapo, luspo (PPO clip):
          ℓ_t = -min(ρ̃_t·A, clip(ρ_t, 1 - ε_l, 1 + ε_h)·A),  ρ̃_t = min(ρ_t, δ) when `delta` is set
          (two-sided clip, INTELLECT-2: caps the ratio also where A < 0), else ρ̃_t = ρ_t.
      cispo:  ℓ_t = -sg(min(ρ_t, ε_h))·A·log π_θ   (ε_h is CISPO's ε_max; the paper uses 5.0)
      sapo:   ℓ_t = -(4/τ)·σ(τ·(ρ_t - 1))·A,  τ = `sapo_temperature_pos` if A > 0 else `_neg`
      vespo:  ℓ_t = -sg(φ_i)·A·log π_θ,  φ_i = exp(λ + k·log w - λ·w),
              log w = clip(Σ_t m_t·clip(new - old, ±20), log 1e-8, 20); (k, λ) = (`vespo_k_pos`,
              `vespo_lambda_pos`) if A ≥ 0 else the `_neg` pair, λ ≥ 1e-4; φ = 0 where non-finite.
    KL penalty (beta ≠ 0): ℓ_t += beta · κ_t, κ_t = `token_kl(new, ref, kl_estimator)` (TRL: k3),
      times the ratio ρ_t (or s_i at sequence level) when `kl_bias_correction` (TRL's
      `use_bias_correction_kl`, default True: the KL gradient becomes the unbiased reverse-KL one).
      beta = 0 needs no `ref_logps`; given anyway, only the `kl` metric uses it.
    Aggregation (`loss_type`, exactly TRL 1.16's normalisers for one process, one micro-batch):
      grpo, sapo        mean_i( Σ_t m·ℓ / max(L_i, 1) )          per-sample mean, then mean
      bnpo              Σ m·ℓ / max(Σ m, 1)                      tokens of this batch
      dr_grpo           Σ m·ℓ / (N · max_completion_length)      (None → T)
      dapo, cispo, vespo Σ m·ℓ / max(num_tokens, 1)               num_tokens None → Σ m. TRL divides by
                        the active tokens of the whole generation batch (`num_items_in_batch`): pass that
                        count when this call sees only a slice of it (micro-batch, data shard).
      luspo             mean_i( Σ_t m·ℓ )                         per-sample sum, then mean
    Metrics (jnp scalars; names follow TRL's logged keys):
      kl                 Σ m·κ' / max(Σ m, 1), κ' = the penalty term as added (bias-corrected when
                         so); present iff `ref_logps` is given (TRL logs it iff beta ≠ 0).
      clip_low_mean, clip_high_mean, clip_region_mean   (PPO-clip types) fraction of tokens with
                         ρ̃ < 1 - ε_l and A < 0 / ρ̃ > 1 + ε_h and A > 0 / either; at sequence
                         level, of samples (TRL counts every row there, empty ones included).
      clip_low_min, clip_high_max   min / max over samples of the per-sample fraction (at token
                         level, samples with no token are ignored).
    (TRL picks the per-sample path of its means by shape, `x.shape[1] == 1`, so with T = 1 at token
    level it ignores the mask; this function decides by `importance_sampling_level` instead.)
      cispo_clip_ratio   (cispo) fraction of tokens with ρ > ε_h and A > 0.
      vespo_phi_seq_mean (vespo) mean of φ over samples.
    Sampler/trainer mismatch correction (`sampler_logps` [N, T]: the log-probs the sampler computed for its
      own tokens, when they are not the trainer's, e.g. a bfloat16 sampler): the weights of
      `sampler_correction` (is_mode, is_clip_max, is_clip_min: TRL's vllm_importance_sampling_mode /
      _clip_max / _clip_min) multiply ℓ_t before the KL term (vespo: log w joins the sequence log-ratio of
      φ, token modes only, as TRL); masked tokens still count in the normalisers; its metrics are added.
      None (default): no correction; sampler_logps == old_logps gives the uncorrected loss.
    The variants are registered by name (`POLICY_LOSSES`, `register_policy_loss`): a new one is one function
    of the shared `Terms` plus the name of its normaliser (`NORMALISERS`).
    Not here (TRL options that need other inputs): off-policy sequence masking, top-entropy token
    masking, the entropy bonus, MoE aux loss.
    """
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss_type {loss_type!r}; expected one of {list(POLICY_LOSSES)}")
    variant = POLICY_LOSSES[loss_type]
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; expected one of "
                         f"{list(IMPORTANCE_SAMPLING_LEVELS)}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; expected one of {list(KL_ESTIMATORS)}")
    if sampler_logps is not None and not variant.corrected and not is_mode.startswith("token"):
        raise ValueError(f"policy_loss: {loss_type} takes token-level sampler corrections only (is_mode "
                         f"token_truncate or token_mask), got {is_mode!r}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"policy_loss(beta={beta}) needs ref_logps (the reference model's per-token log-probs); "
                         "set beta=0.0 to train without a reference")

    new = jnp.asarray(new_logps)
    dtype = new.dtype
    if new.ndim != 2:
        raise ValueError(f"policy_loss: new_logps must be [N, T], got shape {new.shape}")
    m = jnp.asarray(mask).astype(dtype)
    old = jax.lax.stop_gradient(new if old_logps is None else jnp.asarray(old_logps, dtype))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages).astype(dtype))
    if adv.ndim == 1:
        adv = adv[:, None]
    for name, x in (("mask", m), ("old_logps", old), ("ref_logps", ref_logps)):
        if x is not None and jnp.shape(x) != new.shape:
            raise ValueError(f"policy_loss: {name} has shape {jnp.shape(x)}, new_logps {new.shape}")
    if adv.shape[0] != new.shape[0] or adv.shape[1] not in (1, new.shape[1]):
        raise ValueError(f"policy_loss: advantages of shape {jnp.shape(advantages)} for log-probs {new.shape}")
    seq_level = importance_sampling_level == "sequence"
    lengths = m.sum(-1)

    log_ratio = new - old
    if seq_level:  # GSPO: one length-normalised ratio per sample, [N, 1]
        log_w = ((log_ratio * m).sum(-1) / jnp.maximum(lengths, 1.0))[:, None]
    else:
        log_w = log_ratio
    coef_1 = jnp.exp(log_w)

    if ref_logps is not None:
        kl = token_kl(new, jax.lax.stop_gradient(jnp.asarray(ref_logps, dtype)), kl_estimator)
        if kl_bias_correction:
            kl = kl * coef_1

    metrics, is_w = {}, None
    if sampler_logps is not None:
        if jnp.shape(sampler_logps) != new.shape:
            raise ValueError(f"policy_loss: sampler_logps has shape {jnp.shape(sampler_logps)}, new_logps {new.shape}")
        is_w, is_metrics = sampler_correction(old, sampler_logps, m, is_mode=is_mode, is_clip_max=is_clip_max,
                                              is_clip_min=is_clip_min)
        metrics.update(is_metrics)
    opts = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, num_tokens=num_tokens,
                max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
                sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
                vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
    terms = Terms(new=new, log_ratio=log_ratio, ratio=coef_1, adv=adv, m=m, lengths=lengths, n_active=m.sum(),
                  seq_level=seq_level, is_w=is_w, opts=opts)
    per_token, variant_metrics = variant.per_token(terms)

    if is_w is not None and variant.corrected:
        per_token = per_token * is_w
    if beta != 0.0:
        per_token = per_token + beta * kl
    masked = per_token * m  # broadcasts [N, 1] (sequence level, no KL) to [N, T]
    loss = NORMALISERS[variant.normaliser](masked, terms)

    if ref_logps is not None:
        metrics["kl"] = terms.global_mean(jax.lax.stop_gradient(kl))
    terms = dataclasses.replace(terms, ratio=jax.lax.stop_gradient(coef_1))
    metrics.update(variant_metrics(terms))
    return loss, metrics


def _vespo_weights(log_ratio, m, adv, k_pos, lambda_pos, k_neg, lambda_neg, is_w=None):
    """VESPO's φ per sample ([N, 1], no gradient), TRL 1.16 `GRPOTrainer.get_gamma_weights`: φ(w) =
    e^λ·w^k·e^(-λw) computed in log space, φ(1) = 1; a sampler correction `is_w` adds Σ_t clip(log w_t)."""
    log_ratio = jax.lax.stop_gradient(log_ratio)
    seq_log_ratio = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * m, axis=-1, keepdims=True)
    if is_w is not None:
        seq_log_ratio = seq_log_ratio + jnp.sum(jnp.clip(jnp.log(is_w), math.log(1e-8), 20.0), -1, keepdims=True)
    log_w = jnp.clip(seq_log_ratio, math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k = jnp.where(nonneg, k_pos, k_neg).astype(log_w.dtype)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4).astype(log_w.dtype)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


# Every loss_type TRL 1.16's GRPOTrainer accepts (GRPOConfig.loss_type), registered above.
POLICY_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
