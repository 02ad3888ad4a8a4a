"""GRPO-family advantages: parity with TRL 1.16's own trainer code (float64), and invariants.

TRL references are TRL's real code paths, driven through the stand-ins of tests/trl_stand_ins.py (no model, no
generation, no accelerator, no trainer __init__):
  GRPO advantages  `GRPOTrainer._generate_and_score_completions(self, inputs)` unbound: `self` a
                   SimpleNamespace with the attributes it reads, `_generate` returning fixed token ids
                   and `_calculate_rewards` returning the fixed [N, F] reward table (NaN = a reward
                   function that returned None). The advantages are read from its output.
  RLOO advantages  `RLOOTrainer._generate_and_score_completions` the same way; with beta ≠ 0 its
                   `_get_per_token_logps_and_entropies` returns fixed old / reference log-probs, so
                   the in-reward KL penalty goes through TRL's own code too.
Grid: scale (group, batch, none) x multi_objective_aggregation x group size (1, 2, 4) x with / without unscorable
rows; RLOO: normalize x beta x reward_clip_range x group size. Differences are float64 round-off (~1e-16) except
where TRL itself rounds to float32 (~1e-8: `nanstd` computes its Bessel factor count/(count-1) as int/int ->
float32). REINFORCE++ has no TRL implementation: it is checked against a token-level transcription of OpenRLHF's
`compute_advantages_and_returns` (outcome reward at the last token, γ = 1 returns, whitening over the action mask)
and against its invariants. The policy loss: tests/test_policy_losses.py.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trl_stand_ins import NG, WEIGHTS, G, _close, _completion_lists, _generation_self, _reward_table

from posttrain.losses import group_advantages, reinforce_pp_advantages, rloo_advantages, weighted_rewards

N = 8  # samples of the RLOO log-prob tables (2 prompts x 4)

pytestmark = pytest.mark.usefixtures("x64")  # float64 in these tests only (conftest)


def _trl_grpo_advantages(trl, rewards, group_size, scale, aggregation):
    prompt_ids, completion_ids, _ = _completion_lists(len(rewards))
    completions = ["c"] * len(rewards)
    self = _generation_self(
        trl, rewards, group_size, environment_factories=None, tools=None, environments=[], num_iterations=1,
        use_vllm=False, vllm_importance_sampling_correction=False, beta=0.0, ref_model=None,
        multi_objective_aggregation=aggregation, scale_rewards=scale,
        _generate=lambda prompts: (prompt_ids, completion_ids, None, completions, None, {}, None, None))
    inputs = [{"prompt": f"prompt {i // group_size}"} for i in range(len(rewards))]
    out = trl.GRPOTrainer._generate_and_score_completions(self, inputs)
    assert out["advantages"].dtype == trl.torch.float64
    return out["advantages"].numpy(), self._metrics["train"]


SCALES, AGGREGATIONS = ("group", "batch", "none"), ("sum_then_normalize", "normalize_then_sum")
GROUP_SIZES = (1, 2, 4)


@functools.lru_cache(maxsize=None)
def _ours_grpo_grid():
    """Our advantages for the whole grid in ONE jit: one compile instead of one per jnp reduction, shape
    and option (eager jnp.nan* ops each compile on first use), which keeps the grid fast."""
    def grid(tables, w):
        return {f"{n}/{s}/{a}/{nans}": group_advantages(tables[nans], w, n, scale=s, aggregation=a)
                for n in GROUP_SIZES for s in SCALES for a in AGGREGATIONS for nans in (False, True)}

    tables = {nans: jnp.asarray(_reward_table(nans)) for nans in (False, True)}
    return jax.jit(grid)(tables, jnp.asarray(WEIGHTS))


@pytest.mark.parity
@pytest.mark.parametrize("with_nans", [False, True])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_group_advantages_match_trl(trl, group_size, scale, aggregation, with_nans):
    rewards = _reward_table(with_nans)
    ref, trl_metrics = _trl_grpo_advantages(trl, rewards, group_size, scale, aggregation)
    ours = _ours_grpo_grid()[f"{group_size}/{scale}/{aggregation}/{with_nans}"]
    assert ours.dtype == jnp.float64 and ours.shape == (len(rewards),)
    _close(ours, ref, f"GRPO advantages (n={group_size}, scale={scale}, {aggregation})")
    # The logged reward statistics come from the same weighted reward.
    w = weighted_rewards(rewards, WEIGHTS)
    _close([np.nanmean(np.asarray(w))], trl_metrics["reward"], "mean weighted reward")


RLOO_BETAS, RLOO_CLIPS = (0.0, 0.05), (None, (-1.0, 1.5))


def _rloo_logps():
    """Fixed old and reference per-token log-probs ([16, 6]) and the completion mask TRL builds."""
    rng = np.random.default_rng(3)
    old = -rng.uniform(0.05, 3.0, size=(G * NG, 6))
    ref = old + rng.normal(0.0, 0.5, size=old.shape)
    _, _, lengths = _completion_lists(G * NG)
    return old, ref, (np.arange(old.shape[1])[None] < lengths[:, None]).astype(np.float64)


@functools.lru_cache(maxsize=None)
def _ours_rloo_grid():
    """Our RLOO advantages for the whole grid in one jit (see _ours_grpo_grid)."""
    old, ref, mask = _rloo_logps()
    seq_kl = ((old - ref) * mask).sum(-1)  # Σ_t mask·(old - ref): TRL RLOO's k1 sequence KL

    def grid(tables, w, seq_kl):
        return {f"{n}/{norm}/{beta}/{clip}/{nans}": rloo_advantages(
                    tables[nans], w, n, normalize=norm, reward_clip=clip,
                    kl_penalty=None if beta == 0.0 else beta * seq_kl)
                for n in (2, 4) for norm in (False, True) for beta in RLOO_BETAS for clip in RLOO_CLIPS
                for nans in (False, True)}

    tables = {nans: jnp.asarray(_reward_table(nans, seed=2)) for nans in (False, True)}
    return jax.jit(grid)(tables, jnp.asarray(WEIGHTS), jnp.asarray(seq_kl))


@pytest.mark.parity
@pytest.mark.parametrize("with_nans", [False, True])
@pytest.mark.parametrize("clip", RLOO_CLIPS)
@pytest.mark.parametrize("beta", RLOO_BETAS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo_advantages_match_trl(trl, group_size, normalize, beta, clip, with_nans):
    rewards = _reward_table(with_nans, seed=2)
    old, ref, _ = _rloo_logps()
    want = _trl_rloo_advantages(trl, rewards, group_size, normalize, beta, clip, old, ref)
    ours = _ours_rloo_grid()[f"{group_size}/{normalize}/{beta}/{clip}/{with_nans}"]
    assert ours.dtype == jnp.float64
    _close(ours, want, f"RLOO advantages (n={group_size}, normalize={normalize}, beta={beta}, clip={clip})")


def _trl_rloo_advantages(trl, rewards, group_size, normalize, beta, clip, old, ref):
    torch = trl.torch
    prompt_ids, completion_ids, _ = _completion_lists(len(rewards))
    width = max(len(c) for c in completion_ids)
    policy = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    reference = types.SimpleNamespace(training=False, is_gradient_checkpointing=False)

    def logps(model, *args, **kwargs):
        return torch.from_numpy((old if model is policy else ref)[:, :width].copy()), None, None

    self = _generation_self(
        trl, rewards, group_size, model_wrapped=None, beta=beta, ref_model=reference, reward_clip_range=clip,
        normalize_advantages=normalize, _generate=lambda prompts: (prompt_ids, completion_ids, ["c"] * len(rewards)),
        _get_per_token_logps_and_entropies=logps)
    self.model = policy
    out = trl.RLOOTrainer._generate_and_score_completions(self, [{"prompt": "p"}] * len(rewards))
    assert out["advantages"].dtype == torch.float64
    return out["advantages"].numpy()


def test_rloo_is_scaled_group_centering():
    """Without NaNs, RLOO = k/(k-1) · (r - group mean) (Kool et al. 2019)."""
    rewards = _reward_table(False, seed=4)
    w = rewards @ WEIGHTS
    centred = (w.reshape(-1, NG) - w.reshape(-1, NG).mean(1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(rloo_advantages(rewards, WEIGHTS, NG), NG / (NG - 1) * centred, rtol=0, atol=1e-12)


def _openrlhf_token_level(rewards, group_size, baseline, lengths):
    """OpenRLHF `compute_advantages_and_returns` (reinforce / reinforce_baseline), transcribed at token
    level with NumPy: group-mean shaping, the reward at each sample's last action token, γ = 1 returns,
    then whitening over every action token of the batch (var clamped at 1e-8)."""
    r = rewards.reshape(-1, group_size)
    if baseline:
        r = r - r.mean(-1, keepdims=True)
    r = r.reshape(-1)
    width = int(lengths.max())
    action_mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float64)
    token_rewards = np.zeros_like(action_mask)
    token_rewards[np.arange(len(r)), lengths - 1] = r
    returns = np.flip(np.cumsum(np.flip(token_rewards * action_mask, 1), 1), 1)
    mean = (returns * action_mask).sum() / action_mask.sum()
    var = (((returns - mean) ** 2) * action_mask).sum() / action_mask.sum()
    adv = (returns - mean) / np.sqrt(max(var, 1e-8))
    return adv[:, 0]  # the advantage is the same on every token of a sample: read the first


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_openrlhf_token_whitening(baseline):
    rng = np.random.default_rng(5)
    rewards = rng.normal(size=G * NG)
    lengths = rng.integers(1, 9, size=G * NG)
    want = _openrlhf_token_level(rewards, NG, baseline, lengths)
    ours = reinforce_pp_advantages(jnp.asarray(rewards), None, NG, baseline=baseline, lengths=jnp.asarray(lengths))
    _close(ours, want, "REINFORCE++ (token-weighted whitening)")
    # Per-sample weighting: zero mean and unit (population) std over the samples.
    plain = np.asarray(reinforce_pp_advantages(jnp.asarray(rewards), None, NG, baseline=baseline))
    np.testing.assert_allclose([plain.mean(), plain.std()], [0.0, 1.0], atol=1e-12)
    if baseline:  # whitening (r - group mean) over the batch
        c = (rewards.reshape(-1, NG) - rewards.reshape(-1, NG).mean(1, keepdims=True)).reshape(-1)
        np.testing.assert_allclose(plain, c / c.std(), atol=1e-12)


def test_reinforce_pp_unscorable_rows():
    rewards = _reward_table(True, seed=6)
    adv = np.asarray(reinforce_pp_advantages(jnp.asarray(rewards), jnp.asarray(WEIGHTS), NG))
    unscorable = np.isnan(rewards).all(1)
    assert np.all(np.isfinite(adv)) and np.all(adv[unscorable] == 0)
    np.testing.assert_allclose([adv[~unscorable].mean(), adv[~unscorable].std()], [0.0, 1.0], atol=1e-12)


def test_advantages_jit_and_errors():
    rewards = jnp.asarray(_reward_table(True), jnp.float32)

    @jax.jit
    def every_estimator(r):
        return (group_advantages(r, WEIGHTS, NG, scale="batch"), rloo_advantages(r, WEIGHTS, NG),
                reinforce_pp_advantages(r, WEIGHTS, NG),
                group_advantages(r[:, 0], None, NG), group_advantages(r[:, :1], [1.0], NG))

    *outs, one_func, one_column = every_estimator(rewards)
    for out in outs:
        assert out.dtype == jnp.float32 and out.shape == (G * NG,) and np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(one_func, one_column)  # [N] is one reward function
    with pytest.raises(ValueError, match="scale"):
        group_advantages(rewards, WEIGHTS, NG, scale="global")
    with pytest.raises(ValueError, match="groups of group_size=3"):
        group_advantages(rewards, WEIGHTS, 3)
    with pytest.raises(ValueError, match="weights"):
        rloo_advantages(rewards, [1.0, 2.0, 3.0], NG)
