"""The PPO trainer: on-policy first update, KL 0 at the start, mini-batches that partition each rollout,
exact resume mid-rollout (weights, critic, KL controller), both critic layouts, clear errors for a
mismatched critic or a reward-model folder without a score head (learning: test_rl_learning.py)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested
from flax import nnx

from posttrain import config as C
from posttrain.errors import PosttrainError
from posttrain.models import Transformer, preset, save_pretrained
from posttrain.models.heads import ScoreParam, attach_score_head
from posttrain.rl.critic import critic_values
from posttrain.tokenizer import byte_tokenizer
from posttrain.train.step import merge
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "grpo_addition.jsonl")


def config(tmp_path, **over) -> PPOConfig:
    d = {"model": {"preset": "tiny-student"},
         "data": {"train": PROMPTS, "max_prompt_length": 8},
         "ppo": {"num_generations": 2, "max_new_tokens": 4, "num_iterations": 2, "mini_batch_size": 2,
                 "beta": 0.05, "kl_target": 0.02, "kl_horizon": 100, "rewards": {"last_number": 1.0}},
         "lora": {"enabled": True, "rank": 4},
         "optim": {"lr": 1e-3, "schedule": "constant"},
         "train": {"steps": 4, "batch_size": 4, "log_every": 1},
         "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(tmp_path / "run")}
    nested(d, over)
    return C.from_dict(PPOConfig, d)


def test_first_update_is_on_policy_and_mini_batches_partition_the_rollout(tmp_path):
    """LoRA + separate critic: at the start the reference (adapters off) is the policy (KL 0), the stored
    values are the critic's, the first update sees ratio 1 (|Δ log p| <= 1e-5, nothing clipped); each
    epoch's mini-batches are a permutation of the rollout's rows; a second rollout compiles nothing new;
    both models and the KL controller move."""
    trainer = PPOTrainer(config(tmp_path), progress=False)
    parts = trainer.setup()
    state, rollout, sampler = parts.state, parts.batches, parts.batches.sampler
    assert (parts.frozen is None) == trainer.config.lora.enabled
    assert rollout.mu == 4 and rollout.per_epoch == 2
    seen, first = [], None
    start = jax.tree.map(np.asarray, state.params)
    for k in range(8):
        batch = rollout(state)
        if k == 0:
            full = rollout.cached
            stats = rollout.metrics()
            assert abs(stats["kl"]) <= 1e-6 and stats["kl_coef"] == 0.05, stats
            values = critic_values(merge(parts.graphdef, state), {f: jnp.asarray(v) for f, v in full.items()})
            mask = full["score_w"] != 0
            np.testing.assert_allclose(np.asarray(values)[mask], full["old_values"][mask], atol=1e-5)
            assert not full["old_values"][~mask].any() and abs(full["advantages"][mask].mean()) < 1e-5
        if k < 4:
            seen.append(batch["tokens"])
        state, metrics = parts.step(state, {f: jnp.asarray(v) for f, v in batch.items()})
        if k == 0:
            first = metrics
    assert float(first["logp_mismatch_max"]) <= 1e-5 and float(first["clip_region_mean"]) == 0
    for epoch in (seen[:2], seen[2:]):
        rows = sorted(map(bytes, np.concatenate(epoch)))
        assert rows == sorted(map(bytes, full["tokens"]))
    assert rollout.kl.value < 0.05  # KL below target at the start: β decreases (adaptive)
    assert sampler.traces["prefill"] == 1 and sampler.traces["decode"] == 1, sampler.traces
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, start)
    assert max(jax.tree.leaves(moved["policy"])) > 0
    assert max(jax.tree.leaves(moved["critic"])) > 0


def test_resume_in_the_middle_of_a_rollout_is_exact(tmp_path):
    """Full fine-tuning with the shared value head (a frozen reference copy), 2 epochs x 2 mini-batches
    per rollout: a run killed after step 5 (inside the second rollout) resumes to the same policy, value
    head and KL coefficient as the uninterrupted run; the first rollout's KL to the reference is 0; the
    run exports as a causal LM with the trained policy's logits."""
    cfg = config(tmp_path, **{"train.steps": 6, "checkpoint.every": 1, "checkpoint.keep": 6,
                              "checkpoint.async_save": False, "lora.enabled": False, "ppo.critic": "shared"})
    first = PPOTrainer(cfg, progress=False)
    assert first.model.critic is None and isinstance(first.model.policy.score, ScoreParam)
    assert first.model.policy.lm_head is not None
    done = first.train()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    resumed = PPOTrainer(cfg, progress=False)
    assert resumed.train()["step"] == 6
    for x, y in zip(jax.tree.leaves(nnx.state(first.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(resumed.model, nnx.Param))):
        np.testing.assert_array_equal(x, y)
    # `posttrain export --run`: the policy alone, a causal LM (the shared value head left out)
    from posttrain import cli
    from posttrain.models import from_pretrained

    assert cli.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = from_pretrained(str(tmp_path / "hf"))
    assert getattr(exported, "score", None) is None
    ids = jnp.asarray([resumed.tokenizer.encode("12+34=")])
    pos = jnp.arange(ids.shape[1])[None]
    np.testing.assert_allclose(exported(ids, pos).logits, resumed.model.policy(ids, pos).logits, atol=1e-5)
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5, 6]
    coefs = [m["kl_coef"] for m in logged if "kl_coef" in m]
    assert len(coefs) == 2 and coefs[1] != coefs[0]  # the controller state carried over
    assert abs(logged[0]["kl"]) <= 1e-6 and logged[0]["logp_mismatch_max"] <= 1e-5
    assert logged[-1]["value_mean"] != logged[0]["value_mean"]
    # the result (the CLI's `done:` line) carries the last rollout's reward and KL: step 6 reuses step 5's rollout
    last = [m for m in logged if "reward/mean" in m][-1]
    assert last["step"] == 5 and "reward/mean" not in logged[-1]
    assert done["reward/mean"] == last["reward/mean"] and np.isfinite(done["reward/mean"]) and done["kl"] == last["kl"]


def _folder(tmp_path, name, preset_name, tok, *, score=False):
    model = Transformer(preset(preset_name, vocab_size=tok.vocab_size), rngs=nnx.Rngs(3))
    if score:
        attach_score_head(model, seed=3, std=0.5)
    return save_pretrained(model, str(tmp_path / name), tokenizer=tok)


def test_bad_critic_and_reward_model_folders_name_the_key(tmp_path):
    tok = byte_tokenizer()
    wide = _folder(tmp_path, "wide", "demo-tiny", tok)
    with pytest.raises(PosttrainError, match="ppo.critic_path: .* hidden size 128 but the policy has 64"):
        PPOTrainer(config(tmp_path, **{"ppo.critic_path": wide}), progress=False)
    other = byte_tokenizer()
    other.hf.add_tokens(["<tool>"])
    wrong_tok = _folder(tmp_path, "wrong_tok", "tiny-student", other)
    with pytest.raises(PosttrainError, match="ppo.critic_path: the tokenizer of .* differs from the policy"):
        PPOTrainer(config(tmp_path, **{"ppo.critic_path": wrong_tok}), progress=False)
    causal = _folder(tmp_path, "causal", "tiny-student", tok)
    with pytest.raises(PosttrainError, match="ppo.reward_model: .* has no score head"):
        PPOTrainer(config(tmp_path, **{"ppo.rewards": {"reward_model": 1.0}, "ppo.reward_model": causal}),
                   progress=False)
    with pytest.raises(PosttrainError, match="ppo.rewards names 'reward_model' but ppo.reward_model"):
        PPOTrainer(config(tmp_path, **{"ppo.rewards": {"reward_model": 1.0}}), progress=False)
    with pytest.raises(PosttrainError, match="ppo.dual_clip must be > 1 \\+ ppo.epsilon_high"):
        config(tmp_path, **{"ppo.dual_clip": 1.1})
    with pytest.raises(PosttrainError, match="ppo.mini_batch_size=3 must divide train.batch_size=4"):
        PPOTrainer(config(tmp_path, **{"ppo.mini_batch_size": 3}), progress=False)
    # a reward-model folder is a good critic start: its score head becomes the value head
    rm = _folder(tmp_path, "rm", "tiny-student", tok, score=True)
    trainer = PPOTrainer(config(tmp_path, **{"ppo.critic_path": rm, "ppo.rewards": {"reward_model": 1.0},
                                             "ppo.reward_model": rm}), progress=False)
    from posttrain.models import from_pretrained

    head = from_pretrained(rm, head="score").score[...]
    np.testing.assert_array_equal(np.asarray(trainer.model.critic.score[...]), np.asarray(head))
    assert not os.path.exists(tmp_path / "run")


def test_the_sampler_on_its_own_devices_and_the_rollout_options_ppo_refuses(tmp_path):
    """rollout.devices (the RL base's, as GRPO's): the training mesh on the first two of the 8 virtual devices,
    the sampler's weights on the last two, pushed there; two steps train. rollout.dtype, is_mode and
    max_staleness are refused by name (the loss takes the sampler's log-probs as the old policy's)."""
    split = {"sharding.preset": "dp", "sharding.mesh_shape": {"data": 2}, "rollout.devices": 2, "train.steps": 2}
    trainer = PPOTrainer(config(tmp_path, **split), progress=False)
    every = jax.devices()
    assert set(trainer.mesh.devices.flat) == set(every[:2])
    parts = trainer.setup()
    parts.batches(parts.state)
    assert {d for x in jax.tree.leaves(parts.batches.sampler.state) for d in x.devices()} == set(every[-2:])
    result = trainer.train()
    assert result["step"] == 2 and np.isfinite(result["loss"])
    for key, value in (("dtype", "bfloat16"), ("is_mode", "token_mask"), ("max_staleness", 1)):
        with pytest.raises(PosttrainError, match=f"rollout.{key} is not supported by ppo"):
            PPOTrainer(config(tmp_path / key, **{f"rollout.{key}": value}), progress=False)
