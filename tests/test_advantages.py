"""Advantage estimators by name (`grpo.advantages: group | rloo | reinforce_pp`, `losses.advantages.ESTIMATORS`).

The estimators themselves are checked against TRL 1.16's own code over a grid in tests/test_advantages_trl.py;
here the NAMED estimators, as `rl.GroupRollout` calls them, are:
  rloo          = TRL 1.16 `RLOOTrainer._generate_and_score_completions` (trl/trainer/rloo_trainer.py:1682-1699:
                  leave-one-out baseline over scorable siblings, NaN -> 0) at RLOOConfig's defaults
                  (normalize_advantages=False, no reward_clip_range, beta 0: our beta stays in the loss), driven
                  unbound through the stand-ins of trl_stand_ins; float64, max |Δ| <= 1e-6.
  reinforce_pp  TRL 1.16 has no REINFORCE++ (no advantage estimator of that name in trl/trainer/); it equals a
                token-level transcription of OpenRLHF's `compute_advantages_and_returns` with
                `advantage_estimator="reinforce_baseline"` (openrlhf/trainer/ppo_utils/experience_maker.py:
                group-mean shaping, the reward at the last action token, γ = 1 returns, whitening over the
                action mask; test_advantages_trl._openrlhf_token_level), each sample weighing its completion tokens.
  group         unchanged: the rollout's advantages are bit-identical to `group_advantages` on its rewards.
The rollout checks drive `GroupRollout.rollout` with a stub sampler (fixed completions) and reward functions
that return a fixed reward table (None = unscorable), so what reaches the rows is what TRL computes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_advantages_trl import _openrlhf_token_level, _rloo_logps, _trl_rloo_advantages
from trl_stand_ins import NG, WEIGHTS, _close, _reward_table

from posttrain import config as C
from posttrain.data.prompts import Prompt
from posttrain.errors import PosttrainError
from posttrain.generate import SamplingParams
from posttrain.generate.sampler import Completions
from posttrain.losses.advantages import (
    ESTIMATORS,
    estimate_advantages,
    group_advantages,
    register_advantages,
)
from posttrain.rl import rollout as rollout_module
from posttrain.rl.rollout import GroupRollout
from posttrain.tokenizer import byte_tokenizer
from posttrain.trainers.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("x64")  # float64 here (conftest)

T = 6  # completion slots per sample
LENGTHS = np.array([1, 2, 3, 4, 5, 6, 1, 3, 5, 2, 4, 6, 6, 5, 4, 1])  # completion tokens of the 16 samples


def test_the_three_names_are_registered():
    assert {"group", "rloo", "reinforce_pp"} <= set(ESTIMATORS)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        estimate_advantages("ppo", _reward_table(False), WEIGHTS, NG)


@pytest.mark.parity
@pytest.mark.parametrize("with_nans", [False, True])
@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo_by_name_matches_trl(trl, group_size, with_nans):  # noqa: F811
    rewards = _reward_table(with_nans, seed=2)
    old, ref, _ = _rloo_logps()
    want = _trl_rloo_advantages(trl, rewards, group_size, False, 0.0, None, old, ref)
    ours = estimate_advantages("rloo", jnp.asarray(rewards), jnp.asarray(WEIGHTS), group_size)
    assert ours.dtype == jnp.float64
    err = _close(ours, want, f"rloo by name (n={group_size})")
    print(f"rloo (n={group_size}, NaNs {with_nans}): max |ours - TRL| = {err:.3g}")


@pytest.mark.parametrize("with_nans", [False, True])
def test_reinforce_pp_by_name_matches_openrlhf(with_nans):
    rewards = _reward_table(with_nans, seed=5)
    ours = np.asarray(estimate_advantages("reinforce_pp", jnp.asarray(rewards), jnp.asarray(WEIGHTS), NG,
                                          lengths=jnp.asarray(LENGTHS)))
    total = np.where(np.isnan(rewards).all(1), np.nan, np.nansum(rewards * WEIGHTS, 1))
    scorable = ~np.isnan(total)
    if not with_nans:
        want = _openrlhf_token_level(total, NG, True, LENGTHS)
    else:  # OpenRLHF has no unscorable rows: the scorable ones alone, their group means over scorable siblings
        means = np.repeat(np.nanmean(total.reshape(-1, NG), 1), NG)
        centred = (total - means)[scorable]
        want = np.zeros_like(total)
        want[scorable] = _openrlhf_token_level(centred, 1, False, LENGTHS[scorable])
    err = _close(ours, want, "reinforce_pp by name")
    print(f"reinforce_pp (NaNs {with_nans}): max |ours - OpenRLHF transcription| = {err:.3g}")


# ------------------------------------------------------------------------ through the rollout


class _StubSampler:
    """What GroupRollout.rollout asks of a Sampler: fixed completions of LENGTHS tokens."""

    pad_id, dtype = 0, None

    def update(self, model):
        pass

    def generate(self, prompts, params, key):
        R = len(prompts) * params.n
        live = np.arange(T)[None] < LENGTHS[:R, None]
        return Completions(tokens=np.where(live, ord("7"), 0).astype(np.int32),
                           logprobs=np.where(live, -0.5, 0.0).astype(np.float32), lengths=LENGTHS[:R].copy(),
                           finish_reasons=["stop"] * R, prompt_index=np.repeat(np.arange(len(prompts)), params.n))


def _rollout_advantages(monkeypatch, rewards, advantages):
    """[16] advantages of the rows of one GroupRollout rollout whose two reward functions return `rewards`."""
    monkeypatch.setattr(rollout_module, "merged_state", lambda state: None)
    tok = byte_tokenizer()
    column = lambda f: lambda prompts, completions, **_: [None if np.isnan(v) else float(v)  # noqa: E731
                                                           for v in rewards[:, f]]
    prompts = [Prompt(ids=np.array([5, 6, 7], np.int32), prompt=f"p{i}") for i in range(len(rewards) // NG)]
    params = SamplingParams(max_new_tokens=T, temperature=1.0, n=NG, stop_ids=tok.eos_ids)
    source = GroupRollout(prompts, tok, _StubSampler(), None, batch_size=len(prompts), n=NG, params=params,
                          reward_funcs=[column(0), column(1)], reward_weights=WEIGHTS, length=3 + NG * T,
                          shuffle=False, advantages=advantages)
    batch = source(state=None)
    assert batch["advantages"].shape == (len(prompts), NG) and batch["advantages"].dtype == np.float32
    return batch["advantages"].reshape(-1)


@pytest.mark.parity
def test_the_rollout_uses_the_named_estimator(trl, monkeypatch):  # noqa: F811
    """`GroupRollout(advantages=...)`: rloo rows carry TRL's RLOO advantages (float32 rows: ≤ 1e-6),
    reinforce_pp the token-weighted ones, and group exactly today's `group_advantages`."""
    rewards = _reward_table(True, seed=2)
    old, ref, _ = _rloo_logps()
    want = _trl_rloo_advantages(trl, rewards, NG, False, 0.0, None, old, ref)
    err = _close(_rollout_advantages(monkeypatch, rewards, "rloo"), want, "rollout rows, rloo")
    print(f"rollout rows (float32), rloo: max |rows - TRL| = {err:.3g}")
    total = np.where(np.isnan(rewards).all(1), np.nan, np.nansum(rewards * WEIGHTS, 1))
    rpp = estimate_advantages("reinforce_pp", total, None, NG, lengths=LENGTHS)
    _close(_rollout_advantages(monkeypatch, rewards, "reinforce_pp"), rpp, "rollout rows, reinforce_pp")
    group = np.asarray(group_advantages(total.reshape(-1, 1), None, NG), np.float64).astype(np.float32)
    np.testing.assert_array_equal(_rollout_advantages(monkeypatch, rewards, "group"), group)


def test_a_registered_estimator_is_a_setting(monkeypatch):
    """A new variant is one registered function: the config accepts its name and the rollout calls it."""
    seen = []
    monkeypatch.setitem(ESTIMATORS, "test_sign", None)  # so the name is gone again after the test

    @register_advantages("test_sign")
    def sign(rewards_per_func, weights, group_size, *, scale, lengths):
        seen.append((group_size, scale, None if lengths is None else list(lengths)))
        return jnp.sign(jnp.nan_to_num(jnp.asarray(rewards_per_func)[:, 0]))

    cfg = C.from_dict(GRPOConfig, {"model": {"preset": "demo-tiny"}, "data": {"train": "x.jsonl"},
                                   "grpo": {"advantages": "test_sign"}})
    rewards = _reward_table(False, seed=7)
    adv = _rollout_advantages(monkeypatch, rewards, cfg.grpo.advantages)
    np.testing.assert_array_equal(adv, np.sign(rewards @ WEIGHTS))
    assert seen == [(NG, "group", LENGTHS.tolist())]


def test_the_config_names_the_estimator():
    base = {"model": {"preset": "demo-tiny"}, "data": {"train": "x.jsonl"}}
    assert C.from_dict(GRPOConfig, base).grpo.advantages == "group"  # today's behaviour by default
    for name in ("rloo", "reinforce_pp"):
        assert C.from_dict(GRPOConfig, {**base, "grpo": {"advantages": name}}).grpo.advantages == name
    with pytest.raises(PosttrainError, match="grpo.advantages must be one of group, reinforce_pp, rloo"):
        C.from_dict(GRPOConfig, {**base, "grpo": {"advantages": "rlo"}})
    with pytest.raises(PosttrainError, match="grpo.scale_rewards=batch scales the group estimator only"):
        C.from_dict(GRPOConfig, {**base, "grpo": {"advantages": "rloo", "scale_rewards": "batch"}})

