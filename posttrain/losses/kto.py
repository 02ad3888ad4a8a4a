"""KTO: Kahneman-Tversky optimisation from unpaired (prompt, completion, desirable?) rows.

What it is: `kto_loss(...)`, a pure function from summed completion log-probabilities to
`(total, metrics)` in the convention of `posttrain.losses` (sums, `metrics["denom"]` = rows), and
`make_kto_loss(...)`, the trainer's `loss_fn(policy, batch, *, frozen, rng)` over prefix-shared
rows [prompt | completion | KL completion] (`data/branches.py`: branch 1 = the row's completion,
branch 2 = the mismatched completion of another row of the batch), so the prompt is computed once
for both log-probabilities and the KL rows cost no second forward.

The loss, as TRL 1.16 `trl/trainer/kto_trainer.py::KTOTrainer._compute_loss` (N rows, beta = `beta`,
r_i = log pi(y_i|x_i) - log pi_ref(y_i|x_i), σ = sigmoid):
  z0     = max(0, mean_N(log pi(y'_i|x_i) - log pi_ref(y'_i|x_i))), under stop_gradient: the KL
           estimate from the mismatched pairs (x_i, y'_i), y'_i the completion of another row (TRL
           rotates the completions by one within each per-device batch; `data` does the same).
  "kto"                desirable   1 - σ(beta·(r_i - z0))       KTO eq. 7 (Ethayarajh et al. 2024,
                       undesirable 1 - σ(beta·(z0 - r_i))       arXiv 2402.01306), lambda_D = lambda_U = 1
  "apo_zero_unpaired"  desirable   1 - σ(beta·r_i)              APO-zero unpaired (D'Oosterlinck et al.
                       undesirable σ(beta·r_i)                  2024, arXiv 2408.06266); no KL term (z0 = 0)
  loss = (desirable_weight·Σ_D l_i + undesirable_weight·Σ_U l_i) / N     (TRL: cat(...).nanmean())
Rewards beta·r_i are logged detached, as TRL. Metrics (all sums; the step divides them by denom):
  loss, kl (z0 per row: the step's mean is TRL's "kl"), rewards/chosen_sum, rewards/rejected_sum,
  logps/chosen_sum, logps/rejected_sum, count/chosen, count/rejected. TRL's rewards/chosen is
  rewards/chosen_sum / count/chosen (likewise logps/*, and rewards/margins their difference):
  `kto_means(metrics)` derives them. TRL's entropy and logits/* need the logits: not logged here.
The KL estimate couples the rows of a batch: under micro-batching each micro-batch has its own
(TRL's per-device batch under gradient accumulation does the same).

What it is not: the data pipeline (`trainers/kto.py`) or paired preference losses (`preference.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses.logps import branch_logps

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_loss(policy_logps, ref_logps, labels, kl_policy_logps=None, kl_ref_logps=None, *, beta=0.1,
             desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto", mask=None):
    """(total, metrics) of a KTO-family loss over N rows; see the module docstring.

    `policy_logps`, `ref_logps` [N]: summed completion log-probs of (x_i, y_i); `labels` [N] true for a
    desirable completion; `kl_*_logps` [N]: the same for the mismatched (x_i, y'_i) (required by "kto",
    unused by "apo_zero_unpaired"); `mask` [N] (optional) 1 on real rows, 0 on padding rows (they count
    in nothing, the KL mean included). Computed in the log-probabilities' dtype."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {list(KTO_LOSS_TYPES)}")
    logps = jnp.asarray(policy_logps)
    dt = logps.dtype
    w = jnp.ones(logps.shape, dt) if mask is None else jnp.asarray(mask).astype(dt)
    n = jnp.sum(w)
    if loss_type == "kto":
        if kl_policy_logps is None or kl_ref_logps is None:
            raise ValueError("kto_loss(loss_type='kto') needs kl_policy_logps and kl_ref_logps (the mismatched rows)")
        kl = jnp.sum((jnp.asarray(kl_policy_logps) - kl_ref_logps) * w) / jnp.maximum(n, 1)
        kl = jax.lax.stop_gradient(jnp.maximum(kl, 0))
    else:
        kl = jnp.zeros((), dt)
    r = logps - ref_logps
    if loss_type == "kto":
        chosen_l, rejected_l = 1 - jax.nn.sigmoid(beta * (r - kl)), 1 - jax.nn.sigmoid(beta * (kl - r))
    else:
        chosen_l, rejected_l = 1 - jax.nn.sigmoid(beta * r), jax.nn.sigmoid(beta * r)
    chosen = jnp.asarray(labels).astype(bool)
    losses = jnp.where(chosen, desirable_weight * chosen_l, undesirable_weight * rejected_l)
    rewards = jax.lax.stop_gradient(beta * r)
    c, u = chosen.astype(dt) * w, (~chosen).astype(dt) * w
    total = jnp.sum(losses * w)
    lp = jax.lax.stop_gradient(logps)
    return total, {"denom": n, "loss": total, "kl": kl * n,
                   "rewards/chosen_sum": jnp.sum(rewards * c), "rewards/rejected_sum": jnp.sum(rewards * u),
                   "logps/chosen_sum": jnp.sum(lp * c), "logps/rejected_sum": jnp.sum(lp * u),
                   "count/chosen": jnp.sum(c), "count/rejected": jnp.sum(u)}


def kto_means(metrics: dict, prefix: str = "") -> dict:
    """TRL's logged means from (step- or eval-averaged) KTO metrics: rewards/chosen, rewards/rejected,
    logps/chosen, logps/rejected (sum / count, left out when a class has no rows, as TRL does) and
    rewards/margins (when both classes have rows). Host floats in, host floats out; `prefix` e.g. "eval_"."""
    out = {}
    for side in ("chosen", "rejected"):
        count = metrics.get(f"{prefix}count/{side}", 0.0)
        if count > 0:
            for what in ("rewards", "logps"):
                out[f"{prefix}{what}/{side}"] = metrics[f"{prefix}{what}/{side}_sum"] / count
    if f"{prefix}rewards/chosen" in out and f"{prefix}rewards/rejected" in out:
        out[f"{prefix}rewards/margins"] = out[f"{prefix}rewards/chosen"] - out[f"{prefix}rewards/rejected"]
    return out


def make_kto_loss(*, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                  loss_type: str = "kto"):
    """`loss_fn(policy, batch, *, frozen, rng) -> (total, metrics)` over KTO rows: prefix-shared rows
    (branch 1 the completion, branch 2 the mismatched KL completion; no branch 2 for
    "apo_zero_unpaired") and `batch["label"]` [B] (1 desirable, 0 undesirable). The reference
    log-probabilities are a forward of `frozen` on the same rows, without gradient (a LoRA recipe
    passes the policy with its adapters off, `recipes.recipe.lora_reference`). A row with no completion
    token is padding and counts in nothing."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {list(KTO_LOSS_TYPES)}")

    def loss_fn(policy, batch, *, frozen=None, rng=None):
        if frozen is None:
            raise ValueError("the KTO loss needs a reference model (frozen=...)")
        _, logps, counts = branch_logps(policy, batch, 2)
        ref = jax.lax.stop_gradient(branch_logps(frozen, batch, 2)[1])
        return kto_loss(logps[:, 0], ref[:, 0], batch["label"], logps[:, 1], ref[:, 1], beta=beta,
                        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                        loss_type=loss_type, mask=counts[:, 0] > 0)

    return loss_fn
