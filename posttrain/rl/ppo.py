"""PPO rollouts: samples -> rewards -> KL-shaped per-token rewards -> GAE -> shuffled mini-batches.

What it is: `PPORollout`, the PPO trainer's batch source, a `GroupRollout` (same prompt stream,
sampling on the train state's own buffers with the key fold_in(key(seed), r), reward runner,
prefix-shared group rows with the sampler's log-probs as the old log-probs) that adds:
  1. one jitted forward `prepare(state, batch) -> (ref_logps, values)` before the PPO epochs
     (the reference's log-probs and the critic's values V(s_t) of the rollout's tokens);
  2. per-token rewards (`losses.ppo.token_rewards`): −β·KL(π_old ‖ π_ref) per token (k1 or k3),
     plus the sequence reward (minus `missing_eos_penalty` for a completion cut at the length
     limit) at its last token; β from a `FixedKL` or `AdaptiveKL` controller (Ziegler et al.
     2019, arXiv 1909.08593, §2.2; verl's / TRL's AdaptiveKLController), updated after each
     rollout with the rollout's mean per-token KL;
  3. `losses.ppo.gae` and, optionally, `masked_whiten` of the advantages over the batch's tokens;
  4. `num_iterations` passes over the rollout in shuffled mini-batches of `mini_batch_size` rows
     (rollout r, epoch e: permutation np.random.default_rng((seed, r, e))), one train step each.
The rollout in use and the KL coefficient are saved in the checkpoint (`get_state`), so a killed
run resumes exactly. `metrics()` adds reward/score, kl, kl_coef, returns/mean, values/mean,
explained_variance (of the old values for the returns, over the tokens) and time/prepare_s.

Also here, the PPO recipe's loss over the model (the critic is `rl/critic.py`): `make_ppo_loss(...)`,
the trainer's `loss_fn(model, batch, *, frozen, rng)` (the `posttrain.losses` convention with
denom = 1: the loss already normalises over the mini-batch). `model` has `.policy` (a
Transformer) and `.critic` (a Transformer with a `score` head), or critic None and the head on
the policy (shared backbone). Total:
    policy_loss + vf_coef · value_loss − entropy_coef · entropy
with the entropy (masked token mean, under softmax(logits / temperature)) carrying its gradient.

What it is not: the array functions of the loss (`losses/ppo.py`) or the trainer (`trainers/ppo.py`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.losses.logps import token_logps
from posttrain.losses.policy import policy_loss
from posttrain.losses.ppo import gae, masked_whiten, reference_kl, token_rewards, value_loss
from posttrain.rl.critic import critic_values
from posttrain.rl.rollout import GroupRollout
from posttrain.train.step import merge


class FixedKL:
    """A constant KL coefficient."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKL(FixedKL):
    """β ← β·(1 + clip(KL / target − 1, −0.2, 0.2)·n_steps / horizon) (Ziegler et al. 2019)."""

    def __init__(self, value: float, target: float, horizon: int):
        super().__init__(value)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


class PPORollout(GroupRollout):
    def __init__(self, *args, prepare: Callable, kl_controller: FixedKL, kl_estimator: str = "k1",
                 gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, num_iterations: int = 1,
                 mini_batch_size: Optional[int] = None, missing_eos_penalty: Optional[float] = None, **kwargs):
        super().__init__(*args, scale="none", **kwargs)
        self.prepare, self.kl, self.estimator = prepare, kl_controller, kl_estimator
        self.gamma, self.lam, self.whiten, self.eos_penalty = gamma, lam, whiten, missing_eos_penalty
        self.epochs, self.mini = num_iterations, mini_batch_size or self.batch_size
        self.per_epoch = self.batch_size // self.mini
        self.mu = self.epochs * self.per_epoch  # train steps served by one rollout
        self._gae = jax.jit(self._advantages)

    def __call__(self, state) -> dict:
        k, r = self.calls % self.mu, self.calls // self.mu
        if k == 0 or self.cached is None:
            self.cached = self.rollout(state, r)
        self.calls += 1
        epoch, j = divmod(k, self.per_epoch)
        order = np.random.default_rng((self.seed, r, epoch)).permutation(self.batch_size)
        rows = np.sort(order[j * self.mini:(j + 1) * self.mini])
        return {f: v[rows] for f, v in self.cached.items()}

    def get_state(self) -> dict:
        return {**super().get_state(), "kl_coef": self.kl.value}

    def set_state(self, st: dict) -> None:
        super().set_state(st)
        self.kl.value = float(st["kl_coef"])

    def _advantages(self, old_logps, ref_logps, values, scores, mask, kl_coef):
        kl = reference_kl(old_logps, ref_logps, self.estimator) * mask
        rewards = token_rewards(scores, kl, mask, kl_coef)
        adv, ret = gae(rewards, values, mask, gamma=self.gamma, lam=self.lam)
        return kl, (masked_whiten(adv, mask) if self.whiten else adv), ret

    def rollout(self, state, r: int) -> dict:
        self.sampler.update(merge(self.graphdef, state).policy)
        key = jax.random.fold_in(jax.random.key(self.seed), r)
        group, out, _, keep, total = self._sample(jax.random.fold_in(key, 0), self.batch_size)
        batch = self.rows(group, out, np.zeros((self.batch_size, self.n)), keep)
        t0 = time.perf_counter()
        ref_logps, values = jax.device_get(self.prepare(state, {k: jnp.asarray(v) for k, v in batch.items()}))
        self._stats["time/prepare_s"].append(time.perf_counter() - t0)
        N, T = self.batch_size * self.n, self.params.max_new_tokens
        mask = (batch["score_w"] != 0).reshape(N, T).astype(np.float32)
        scores = np.nan_to_num(total.reshape(N).astype(np.float32))
        if self.eos_penalty:
            scores -= self.eos_penalty * np.asarray([f == "length" for f in out.finish_reasons], np.float32)
        values = np.asarray(values, np.float32).reshape(N, T) * mask
        kl, adv, ret = jax.device_get(self._gae(batch["old_logps"].reshape(N, T), np.asarray(ref_logps).reshape(N, T),
                                                values, scores, mask, np.float32(self.kl.value)))
        tokens = max(mask.sum(), 1.0)
        per_seq_kl = kl.sum(1) / np.maximum(mask.sum(1), 1.0)
        stats = {"reward/mean": float(np.nanmean(total)) if np.isfinite(total).any() else float("nan"),
                 "reward/std": float(np.nanstd(total)) if np.isfinite(total).any() else float("nan"),
                 "reward/score": float(scores.mean()), "kl": float(per_seq_kl.mean()), "kl_coef": self.kl.value,
                 "returns/mean": float(ret.sum() / tokens), "values/mean": float(values.sum() / tokens),
                 "explained_variance": explained_variance(values, ret, mask),
                 "completion/length": float(out.lengths.mean()),
                 "completion/truncated": float(np.mean([f == "length" for f in out.finish_reasons]))}
        for k, v in stats.items():
            self._stats[k].append(v)
        self.kl.update(stats["kl"], N)  # verl: the batch's mean per-token KL, n_steps = its sequences
        shape = (self.batch_size, self.n * T)
        batch.update(advantages=adv.reshape(shape).astype(np.float32), returns=ret.reshape(shape).astype(np.float32),
                     old_values=values.reshape(shape))
        return batch


def explained_variance(values, returns, mask) -> float:
    """1 − Var(returns − values) / Var(returns) over the masked tokens (verl's critic/vf_explained_var)."""
    m = mask != 0
    if m.sum() < 2:
        return float("nan")
    ret, v = returns[m].astype(np.float64), values[m].astype(np.float64)
    var = ret.var()
    return float(1.0 - (ret - v).var() / var) if var > 0 else float("nan")


def make_ppo_loss(*, num_generations: int, max_new_tokens: int, temperature: float = 1.0,
                  epsilon_low: float = 0.2, epsilon_high: float = 0.2, dual_clip: Optional[float] = None,
                  value_clip: Optional[float] = 0.2, vf_coef: float = 0.1, entropy_coef: float = 0.0):
    """The PPO trainer's loss_fn over group rows with `old_logps`, `old_values`, `advantages`, `returns`
    (all [B, n·T]) besides the row and score fields; see the module docstring."""
    n, T = num_generations, max_new_tokens

    def loss_fn(model, batch, *, frozen=None, rng=None):
        policy = model.policy
        out = policy(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                     branch_ids=batch["branch_ids"], return_hidden=True, return_logits=False)
        h = jnp.take_along_axis(out.hidden[-1], batch["score_src"][..., None], axis=1)  # [B, M, D]
        new, ent = token_logps(policy, h, batch["score_tgt"], temperature=temperature, with_entropy=True)
        values = critic_values(model, batch, out.hidden[-1])
        N = new.shape[0] * n
        mask = (batch["score_w"] != 0).reshape(N, T).astype(jnp.float32)
        new = jnp.where(mask != 0, new.reshape(N, T), 0.0)
        old = batch["old_logps"].reshape(N, T)
        pg, metrics = policy_loss(new, old, batch["advantages"].reshape(N, T), mask, loss_type="bnpo",
                                  epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=dual_clip)
        vl, vmetrics = value_loss(values.reshape(N, T), batch["old_values"].reshape(N, T),
                                  batch["returns"].reshape(N, T), mask, clip=value_clip)
        tokens = jnp.maximum(mask.sum(), 1.0)
        entropy = jnp.sum(ent.reshape(N, T) * mask) / tokens
        loss = pg + vf_coef * vl - entropy_coef * entropy
        diff = (jax.lax.stop_gradient(new) - old) * mask
        metrics = {**metrics, **vmetrics, "loss": loss, "denom": jnp.float32(1.0), "policy_loss": pg,
                   "value_loss": vl, "entropy": jax.lax.stop_gradient(entropy),
                   "approx_kl": 0.5 * jnp.sum(diff * diff) / tokens,  # to the sampling policy (TRL's)
                   "logp_mismatch_max": jnp.max(jnp.abs(diff))}
        return loss, metrics

    return loss_fn
