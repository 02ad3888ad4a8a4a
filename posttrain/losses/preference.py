"""Preference losses: the DPO family, SimPO, ORPO and the Bradley–Terry reward-model loss.

What this is: pure `jnp` functions from per-sequence log-probabilities (or scalar rewards) to
per-pair losses, written to agree with TRL 1.16 to float64 round-off (the parity tests call TRL's
own trainer code). What it is not: the `loss_fn(policy, batch, ...)` of a trainer. Producing
the log-probabilities (a policy and a frozen reference forward over prefix-shared rows) and
summing pairs into `(total, metrics)` is the DPO / reward-model trainer's job.

Inputs shared by every function (P = number of pairs):
  `*_logps`    [P] sum over the completion tokens of log pi(y_t | x, y_<t) (not averaged);
  `*_lengths`  [P] number of completion tokens of that sequence (the types that length-normalise
               divide by max(length, 1), as TRL clamps);
  `*_rewards`  [P] returned for logging, always under `stop_gradient` (TRL detaches them).
Everything is computed in the dtype of the log-probabilities (float64 when given float64 with
`jax_enable_x64`); integer lengths are cast to it.

Notation: beta = `beta`, eps = `label_smoothing`, logσ = log-sigmoid,
  c = chosen_logps - ref_chosen_logps, r = rejected_logps - ref_rejected_logps (log-ratios),
  Δ = c - r,  c̄ = c / chosen_len, r̄ = r / rejected_len.

References: DPO (Rafailov et al. 2023, arXiv 2305.18290); IPO (Azar et al. 2023, 2310.12036);
robust/cDPO (Chowdhury et al. 2024, 2403.00409); EXO (Ji et al. 2024, 2402.00856); NCA (Chen et
al. 2024, 2402.05369); BCO (Jung et al. 2024, 2404.04656); SPPO (Wu et al. 2024, 2405.00675);
AOT (Melnyk et al. 2024, 2406.05882); APO (D'Oosterlinck et al. 2024, 2408.06266); DiscoPOP (Chris
Lu et al. 2024, 2406.08414); SimPO (Meng et al. 2024, 2405.14734); ORPO (Hong et al. 2024,
2403.07691); reward centering (Eisenstein et al. 2023, 2312.09244). TRL 1.16:
`trl/trainer/dpo_trainer.py::DPOTrainer._compute_loss`, `trl/experimental/cpo/cpo_trainer.py::
CPOTrainer.cpo_loss`, `trl/experimental/orpo/orpo_trainer.py::ORPOTrainer.odds_ratio_loss`,
`trl/trainer/reward_trainer.py::RewardTrainer.compute_loss`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Every loss_type TRL 1.16's DPOTrainer accepts (DPOConfig.loss_type), in its order.
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)
_NEEDS_LENGTHS = {"ipo": "both", "sigmoid_norm": "both", "sft": "chosen"}

_log_sigmoid = jax.nn.log_sigmoid


def _per_token(x, lengths):
    """x / max(lengths, 1) in x's dtype (TRL: `mask.sum(dim=1).clamp(min=1.0)`)."""
    return x / jnp.maximum(jnp.asarray(lengths).astype(x.dtype), 1)


def _smoothed_sigmoid(logits, eps):
    """-(1 - eps)·logσ(logits) - eps·logσ(-logits): cDPO / SimPO's conservative label smoothing."""
    return -(1 - eps) * _log_sigmoid(logits) - eps * _log_sigmoid(-logits)


def dpo_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    loss_type="sigmoid",
    beta=0.1,
    label_smoothing=0.0,
    chosen_lengths=None,
    rejected_lengths=None,
    discopop_tau=0.05,
    bco_running_mean=None,
):
    """(losses [P], chosen_rewards [P], rejected_rewards [P]) of one DPO-family loss, as TRL 1.16.

    The batch loss is `losses.mean()`. The rewards are beta·c and beta·r for EVERY type (TRL 1.16
    logs `self.beta * chosen_logratios` whatever the loss). Formulas (DPOTrainer._compute_loss):

      sigmoid       -logσ(beta·Δ)                                  DPO eq. 7. TRL 1.16 ignores
                    `label_smoothing` here (cDPO lives in "robust" / "aot"); so does this.
      hinge         relu(1 - beta·Δ)                               SLiC (Zhao et al. 2023)
      ipo           (c̄ - r̄ - 1/(2·beta))²                          IPO eq. 17, beta = τ; length-
                    averaged log-ratios (TRL's choice, confirmed with the IPO authors).
      exo_pair      q·(logσ(beta·Δ) - log(1-eps)) + (1-q)·(logσ(-beta·Δ) - log eps), q = σ(beta·Δ)
                    EXO eq. 16 (reverse KL to the smoothed label); needs 0 < eps < 1.
      nca_pair      -logσ(beta·c) - ½·logσ(-beta·c) - ½·logσ(-beta·r)
      robust        (-(1-eps)·logσ(beta·Δ) + eps·logσ(-beta·Δ)) / (1 - 2·eps)
                    Robust DPO's unbiased loss; eps = flip rate in [0, 0.5).
      bco_pair      -logσ(beta·c - δ) - logσ(-(beta·r - δ)), δ = `bco_running_mean` (None → 0).
                    TRL 1.16 uses δ = 0 (no state); the BCO paper and older TRL (RunningMoments)
                    shift by a running mean of the rewards: keep it with `bco_update_running_mean`
                    and pass it here (explicit state, nothing hidden in this module).
      sppo_hard     (c - 1/(2·beta))² + (r + 1/(2·beta))²          SPPO eq. 4.7 with P ∈ {1, 0}
      aot           sort_P(chosen_logps - rejected_logps) - sort_P(ref_chosen - ref_rejected) = d,
                    loss = -(1-eps)·logσ(beta·d) - eps·logσ(-beta·d)
      aot_unpaired  d = sort_P(c) - sort_P(r), same loss. (Both AOT losses are per SORTED rank,
                    not per input pair: losses[i] belongs to the i-th smallest, and they couple
                    the batch, so micro-batching changes them.)
      apo_zero      (1 - σ(beta·c)) + σ(beta·r)                    APO eq. 7
      apo_down      σ(beta·c) + (1 - σ(beta·Δ))                    APO eq. 8
      discopop      (1-m)·(-logσ(beta·Δ)) + m·exp(-beta·Δ), m = σ(beta·Δ / discopop_tau)
                    DiscoPOP eq. 5 (log-ratio modulated loss)
      sft           -Σ_P chosen_logps / Σ_P max(chosen_lengths, 1), the same for every pair:
                    TRL's token-mean NLL of the batch's chosen completions (couples the batch).
      sigmoid_norm  -logσ(beta·(c̄ - r̄))                            length-normalised DPO

    `chosen_lengths`/`rejected_lengths` are required by ipo, sigmoid_norm (both) and sft
    (chosen). TRL's other options (loss_weights mixing, ld_alpha, f_divergence_type, WPO
    weighting) are not here: mix losses by adding weighted calls; ld_alpha changes the logps.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {list(DPO_LOSS_TYPES)}")
    need = _NEEDS_LENGTHS.get(loss_type)
    if need and (chosen_lengths is None or (need == "both" and rejected_lengths is None)):
        raise ValueError(f"dpo_loss(loss_type={loss_type!r}) needs chosen_lengths"
                         + (" and rejected_lengths" if need == "both" else ""))
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"dpo_loss(loss_type='exo_pair') needs 0 < label_smoothing < 1 (EXO's epsilon; the "
                         f"paper uses 1e-3), got {label_smoothing}")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss(loss_type='robust') needs 0 <= label_smoothing < 0.5 (a flip rate), "
                         f"got {label_smoothing}")

    chosen_logps = jnp.asarray(chosen_logps)
    rejected_logps = jnp.asarray(rejected_logps)
    c = chosen_logps - ref_chosen_logps
    r = rejected_logps - ref_rejected_logps
    delta = c - r
    eps = label_smoothing

    if loss_type == "sigmoid":
        losses = -_log_sigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * delta)
    elif loss_type == "ipo":
        losses = (_per_token(c, chosen_lengths) - _per_token(r, rejected_lengths) - 1 / (2 * beta)) ** 2
    elif loss_type == "exo_pair":
        x = beta * delta
        losses = (jax.nn.sigmoid(x) * (_log_sigmoid(x) - math.log1p(-eps))
                  + jax.nn.sigmoid(-x) * (_log_sigmoid(-x) - math.log(eps)))
    elif loss_type == "nca_pair":
        losses = -_log_sigmoid(beta * c) - 0.5 * _log_sigmoid(-beta * c) - 0.5 * _log_sigmoid(-beta * r)
    elif loss_type == "robust":
        x = beta * delta
        losses = (-(1 - eps) * _log_sigmoid(x) + eps * _log_sigmoid(-x)) / (1 - 2 * eps)
    elif loss_type == "bco_pair":
        shift = 0.0 if bco_running_mean is None else jax.lax.stop_gradient(bco_running_mean)
        losses = -_log_sigmoid(beta * c - shift) - _log_sigmoid(-(beta * r - shift))
    elif loss_type == "sppo_hard":
        losses = (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    elif loss_type == "aot":
        d = jnp.sort(chosen_logps - rejected_logps, axis=0) - jnp.sort(
            ref_chosen_logps - jnp.asarray(ref_rejected_logps), axis=0)
        losses = _smoothed_sigmoid(beta * d, eps)
    elif loss_type == "aot_unpaired":
        losses = _smoothed_sigmoid(beta * (jnp.sort(c, axis=0) - jnp.sort(r, axis=0)), eps)
    elif loss_type == "apo_zero":
        losses = (1 - jax.nn.sigmoid(beta * c)) + jax.nn.sigmoid(beta * r)
    elif loss_type == "apo_down":
        losses = jax.nn.sigmoid(beta * c) + (1 - jax.nn.sigmoid(beta * delta))
    elif loss_type == "discopop":
        x = beta * delta
        m = jax.nn.sigmoid(x / discopop_tau)
        losses = -_log_sigmoid(x) * (1 - m) + jnp.exp(-x) * m
    elif loss_type == "sft":
        n = jnp.sum(jnp.maximum(jnp.asarray(chosen_lengths).astype(chosen_logps.dtype), 1))
        losses = jnp.broadcast_to(-jnp.sum(chosen_logps) / n, chosen_logps.shape)
    else:  # sigmoid_norm
        losses = -_log_sigmoid(beta * (_per_token(c, chosen_lengths) - _per_token(r, rejected_lengths)))

    return losses, jax.lax.stop_gradient(beta * c), jax.lax.stop_gradient(beta * r)


def bco_update_running_mean(mean, count, chosen_rewards, rejected_rewards):
    """(new_mean, new_count): the running mean δ of BCO's rewards after one batch.

    As BCO in TRL before 1.x (`RunningMoments.update` on the batch's mean reward, then read):
    each batch contributes ONE sample, its mean over chosen and rejected rewards, so δ is the
    mean of the per-batch mean rewards. Start from (0.0, 0); update first, then pass the new
    mean as `dpo_loss(..., loss_type="bco_pair", bco_running_mean=new_mean)`. Keep (mean,
    count) in the train state (and all-reduce the batch mean across data shards first when the
    batch is sharded: TRL gathers it across processes).
    """
    batch_mean = jax.lax.stop_gradient(jnp.mean(jnp.concatenate([chosen_rewards, rejected_rewards])))
    new_count = count + 1
    return mean + (batch_mean - mean) / new_count, new_count


def simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, *, beta=2.0, gamma=0.5,
               label_smoothing=0.0):
    """(losses [P], chosen_rewards [P], rejected_rewards [P]) of SimPO: reference-free, length-averaged.

    With a_c = chosen_logps / chosen_len, a_r = rejected_logps / rejected_len (average
    per-token log-probabilities) and u = beta·(a_c - a_r) - gamma:
        loss = -(1 - eps)·logσ(u) - eps·logσ(-u),   rewards = beta·a_c, beta·a_r.
    SimPO eq. 6 (Meng et al. 2024, arXiv 2405.14734; beta = 2.0 is the paper's usual value),
    with CPO's conservative label smoothing eps. TRL 1.16: `CPOTrainer.cpo_loss` with
    loss_type="simpo" (inputs averaged by `get_batch_logps(average_log_prob=True)`), which
    writes the margin as logits - gamma/beta inside beta·(...): the same u. gamma defaults to
    CPOConfig.simpo_gamma (0.5). CPO-SimPO (cpo_alpha > 0) adds cpo_alpha x the chosen NLL;
    AlphaPO (CPOConfig.alpha != 0) reshapes the rewards: neither is here.
    """
    a_c = _per_token(jnp.asarray(chosen_logps), chosen_lengths)
    a_r = _per_token(jnp.asarray(rejected_logps), rejected_lengths)
    losses = _smoothed_sigmoid(beta * (a_c - a_r) - gamma, label_smoothing)
    return losses, jax.lax.stop_gradient(beta * a_c), jax.lax.stop_gradient(beta * a_r)


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (Mächler 2012)."""
    return jnp.where(x < -math.log(2), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, *, beta=0.1, chosen_nll=None):
    """(losses [P], chosen_rewards [P], rejected_rewards [P]) of ORPO: NLL + odds-ratio penalty.

    Inputs are SUMMED completion log-probs and completion lengths like the other functions;
    ORPO uses the averages a = logps / len (TRL: `get_batch_logps(average_log_prob=True)`).
        log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))     (log odds(y_c) / odds(y_r))
        loss     = chosen_nll - beta·logσ(log_odds)                       ORPO eq. 6–7, beta = λ
        rewards  = beta·a_c, beta·a_r
    `chosen_nll` (scalar or [P], default 0) is the SFT term. TRL 1.16 (`ORPOTrainer.
    get_batch_loss_metrics`: loss = policy_nll_loss - mean(odds_ratio_loss(...)[0])) uses ONE
    scalar for it: the token-mean cross-entropy over the chosen sequences' prompt AND completion
    tokens of the whole batch (every non-padding token after the first); pass that scalar and
    `losses.mean()` equals TRL's loss. Note TRL's `odds_ratio_loss` casts its inputs to float32
    (`.float()`); this function keeps the input dtype.
    """
    a_c = _per_token(jnp.asarray(chosen_logps), chosen_lengths)
    a_r = _per_token(jnp.asarray(rejected_logps), rejected_lengths)
    log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
    losses = -beta * _log_sigmoid(log_odds)
    if chosen_nll is not None:
        losses = losses + chosen_nll
    return losses, jax.lax.stop_gradient(beta * a_c), jax.lax.stop_gradient(beta * a_r)


def reward_loss(chosen_rewards, rejected_rewards, *, margin=None, center_coefficient=None):
    """Scalar Bradley–Terry loss of a reward model over P pairs of scalar rewards.

        loss = mean_P(-logσ(r_c - r_r - margin)) + center_coefficient · mean_P((r_c + r_r)²)
    Bradley & Terry 1952 / InstructGPT (Ouyang et al. 2022) eq. 1; the optional per-pair
    `margin` [P] is Llama 2's (Touvron et al. 2023, eq. 2); reward centering is Eisenstein et
    al. 2023 (arXiv 2312.09244) eq. 2. TRL 1.16: `RewardTrainer.compute_loss` (the dataset's
    "margin" column; RewardConfig.center_rewards_coefficient, None = off).
    """
    diff = jnp.asarray(chosen_rewards) - rejected_rewards
    if margin is not None:
        diff = diff - margin
    loss = -jnp.mean(_log_sigmoid(diff))
    if center_coefficient is not None:
        loss = loss + center_coefficient * jnp.mean((jnp.asarray(chosen_rewards) + rejected_rewards) ** 2)
    return loss
