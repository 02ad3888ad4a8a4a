"""The GRPO trainer: exactly on-policy rollouts from the train state's weights, no recompiles, no
base copy under LoRA, exact resume mid-rollout, failing reward functions (learning: test_rl_learning.py)."""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested
from flax import nnx

from posttrain import cli
from posttrain import config as C
from posttrain.data.branches import pad_rows, shared_row
from posttrain.losses.logps import branch_logps
from posttrain.tasks import addition
from posttrain.train.step import merge
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "grpo_addition.jsonl")


def config(tmp_path, **over) -> GRPOConfig:
    d = {"model": {"preset": "demo-tiny"},
         "data": {"train": PROMPTS, "max_prompt_length": 8},
         "grpo": {"num_generations": 4, "max_new_tokens": 4, "rewards": {"last_number": 1.0}},
         "lora": {"enabled": True, "rank": 4},
         "optim": {"lr": 1e-3, "schedule": "constant"},
         "train": {"steps": 3, "batch_size": 4, "log_every": 1},
         "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(tmp_path / "run")}
    nested(d, over)
    return C.from_dict(GRPOConfig, d)


def test_rollouts_are_on_policy_from_the_state_buffers_without_recompiling(tmp_path):
    """At the first of μ iterations the trainer's log-probs equal the sampler's (max |ratio - 1| <=
    1e-6), with prefix-shared group rows and with one row per sample; the sampler reads the train
    state's own buffers; three steps compile the prefill and the decode loop once each; LoRA
    trains <= 5 % of the weights and, with a KL term, keeps no second copy of the base."""
    trainer = GRPOTrainer(config(tmp_path, **{"grpo.beta": 0.04}), progress=False)
    from posttrain.models.lora import trainable_fraction

    assert trainable_fraction(trainer.model) <= 0.05
    parts = trainer.setup()
    assert parts.frozen is None  # beta > 0 with LoRA: the reference is the base with adapters off
    state, rollout, sampler = parts.state, parts.batches, parts.batches.sampler
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(state.rest))
    for step in range(3):
        batch = rollout(state)
        if step == 0:
            used = {id(x) for x in jax.tree.leaves(sampler.state)}
            assert all(id(x) in used for x in jax.tree.leaves((state.params, state.rest)))  # no copy
            device_batch = {k: jnp.asarray(v) for k, v in batch.items()}
            compiled = parts.raw_step.lower(state, device_batch, None).compile()
            args = compiled.memory_analysis().argument_size_in_bytes
            small = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state, device_batch)))
            assert args <= base_bytes + small + 4096, (args, base_bytes)  # the base once
            policy = merge(parts.graphdef, state)
            n, T = trainer.config.grpo.num_generations, trainer.config.grpo.max_new_tokens
            shared = np.asarray(branch_logps(policy, device_batch, n)[0])
            mask = batch["score_w"] != 0
            assert np.abs(shared - batch["old_logps"])[mask].max() <= 1e-6
            # one row per sample, [prompt | completion]: the same log-probs
            ids = batch["tokens"][0][(batch["branch_ids"][0] == 0) & (batch["segment_ids"][0] != 0)]
            conts = [batch["score_tgt"][0].reshape(n, T)[j][mask[0].reshape(n, T)[j]] for j in range(n)]
            rows = pad_rows([shared_row(ids, [c]) for c in conts], 16, T)
            alone = np.asarray(branch_logps(policy, {k: jnp.asarray(v) for k, v in rows.items()}, 1)[0])
            for j, c in enumerate(conts):
                np.testing.assert_allclose(alone[j, :len(c)], batch["old_logps"][0].reshape(n, T)[j, :len(c)],
                                           atol=1e-6, rtol=0)
        state, metrics = compiled(state, {k: jnp.asarray(v) for k, v in batch.items()}, None)
        if step == 0:
            assert float(metrics["logp_mismatch_max"]) <= 1e-6 and float(metrics["kl"]) <= 1e-6
    assert sampler.traces["prefill"] == 1 and sampler.traces["decode"] == 1, sampler.traces


def flaky_reward(prompts, completions, answer, **_):
    """Raises on its first call, hangs on its second, then returns NaN for the first sample."""
    flaky_reward.calls = getattr(flaky_reward, "calls", 0) + 1
    if flaky_reward.calls == 1:
        raise RuntimeError("reward server down")
    if flaky_reward.calls == 2:
        time.sleep(3)
    return [float("nan")] + [1.0] * (len(completions) - 1)


def test_failing_reward_functions_are_counted_never_fatal(tmp_path):
    flaky_reward.calls = 0
    cfg = config(tmp_path, **{"grpo.rewards": {"test_grpo:flaky_reward": 1.0, "last_number": 1.0},
                              "grpo.reward_timeout_s": 0.5, "train.steps": 3})
    t0 = time.perf_counter()
    GRPOTrainer(cfg, progress=False).train()
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    name = "rewards/flaky_reward"
    assert [m[f"{name}/errors"] for m in logged] == [1, 0, 0]
    assert [m[f"{name}/timeouts"] for m in logged] == [0, 1, 0]
    assert [m[f"{name}/nonfinite"] for m in logged] == [0, 0, 1]
    assert time.perf_counter() - t0 < 120


def split_reward(prompts, completions, **_):
    """No signal for prompts starting with "8" (every sample scores 0); otherwise the completion's parity."""
    return [0.0 if p.startswith("8") else float(len(c) % 2) for p, c in zip(prompts, completions)]


def test_dynamic_sampling_replaces_groups_without_signal(tmp_path):
    """DAPO dynamic sampling: groups whose rewards all agree are replaced from further prompts."""
    rows = [{"prompt": f"{8 if i % 2 else 1}{i}+1=", "answer": "0"} for i in range(40)]
    path = addition.write_jsonl(rows, str(tmp_path / "p.jsonl"))
    cfg = config(tmp_path, **{"data.train": path, "grpo.rewards": {"test_grpo:split_reward": 1.0},
                              "grpo.dynamic_sampling": True, "grpo.max_refills": 4, "grpo.max_new_tokens": 6,
                              "train.steps": 2})
    parts = GRPOTrainer(cfg, progress=False).setup()
    batch = parts.batches(parts.state)
    stats = parts.batches.metrics()
    assert stats["dynamic_sampling/refills"] >= 1 and stats["dynamic_sampling/no_signal_groups"] == 0, stats
    adv = batch["advantages"]
    assert (np.abs(adv).sum(axis=1) > 0).all()  # every group in the batch carries a signal


@pytest.mark.parametrize("bad, words", [
    ({"prompt": "1" * 20, "answer": "1"}, "leaves no room|more than data.max_prompt_length"),
    ({"answer": "3"}, "no 'prompt' column"),
])
def test_bad_prompt_rows_exit_2_naming_the_line(tmp_path, capsys, bad, words):
    import re

    path = addition.write_jsonl([{"prompt": "1+2=", "answer": "3"}, bad], str(tmp_path / "p.jsonl"))
    rc = cli.main(["grpo", "--config", "configs/grpo_tiny.yaml", f"data.train={path}", f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:2:" in err and re.search(words, err), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("over, words", [
    ({"grpo.rewards": {"last_number": float("nan")}}, "grpo.rewards.last_number: the weight must be a finite"),
    ({"grpo.overlong_cache": 9}, "grpo.overlong_cache must be in"),
    ({"grpo.num_generations": 1}, "grpo.num_generations must be >= 2"),
])
def test_bad_grpo_settings_name_the_key(tmp_path, over, words):
    from posttrain.errors import PosttrainError

    with pytest.raises(PosttrainError, match=words):
        config(tmp_path, **over)


def test_lora_dropout_and_reserved_columns_are_refused(tmp_path):
    from posttrain.errors import PosttrainError

    with pytest.raises(PosttrainError, match="lora.dropout must be 0 for grpo"):
        GRPOTrainer(config(tmp_path, **{"lora.dropout": 0.1}), progress=False)
    path = addition.write_jsonl([{"prompt": "1+2=", "completions": "x"}], str(tmp_path / "p.jsonl"))
    with pytest.raises(PosttrainError, match=f"{path}:1: column 'completions' is reserved"):
        GRPOTrainer(config(tmp_path, **{"data.train": path}), progress=False)


def test_unknown_reward_is_a_config_error(tmp_path, capsys):
    rc = cli.main(["grpo", "--config", "configs/grpo_tiny.yaml", "grpo.rewards={nope: 1.0}",
                   f"run_dir={tmp_path / 'r'}"])
    assert rc == 2 and "unknown reward 'nope'" in capsys.readouterr().err


def test_resume_in_the_middle_of_a_rollout_is_exact(tmp_path):
    """μ = 2: the checkpoint after step 3 holds the rollout that step 4 reuses; a run resumed from
    it ends with the same weights as the uninterrupted run."""
    cfg = config(tmp_path, **{"grpo.num_iterations": 2, "train.steps": 4, "checkpoint.every": 1,
                              "checkpoint.keep": 4, "checkpoint.async_save": False})
    first = GRPOTrainer(cfg, progress=False)
    first.train()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    resumed = GRPOTrainer(cfg, progress=False)
    assert resumed.train()["step"] == 4
    for x, y in zip(jax.tree.leaves(nnx.state(first.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(resumed.model, nnx.Param))):
        np.testing.assert_array_equal(x, y)


def parity_reward(prompts, completions, **_):
    return [float(len(c) % 2 == 0) for c in completions]


def test_a_bfloat16_sampler_is_corrected_and_its_mismatch_logged(tmp_path):
    """rollout.dtype=bfloat16: the sampler casts the float32 training weights (its cache is bfloat16 too), its
    log-probs differ from the trainer's by bfloat16 round-off (logged as TRL's sampling/* metrics and the
    mismatch KL), and with rollout.is_mode the truncated IS weights scale the loss (a loss that differs from
    the uncorrected one on the same rollouts)."""
    from posttrain.generate import Sampler, SamplingParams
    from posttrain.losses.grpo import make_grpo_loss

    cfg = config(tmp_path, **{"rollout.dtype": "bfloat16", "rollout.is_mode": "token_truncate",
                              "grpo.rewards": {"test_grpo:parity_reward": 1.0}, "train.steps": 2})
    trainer = GRPOTrainer(cfg, progress=False)
    parts = trainer.setup()
    sampler = parts.batches.sampler
    assert {x.dtype for x in jax.tree.leaves(sampler.state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.bfloat16)}
    batch = parts.batches(parts.state)
    assert "sampler_logps" in batch and "old_logps" not in batch
    model = merge(parts.graphdef, parts.state)
    f32 = Sampler(model, max_len=16).generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=1.0))
    b16 = Sampler(model, max_len=16, dtype="bfloat16").generate([[5, 6, 7]], SamplingParams(max_new_tokens=4,
                                                                                            temperature=1.0))
    assert np.array_equal(f32.tokens, b16.tokens)  # same key, nearly the same distribution
    gap = np.abs(f32.logprobs - b16.logprobs).max()
    assert 0 < gap < 0.05
    kw = dict(num_generations=4, max_new_tokens=4)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    corrected = make_grpo_loss(**kw, is_mode="token_truncate", is_clip_max=1.0)(model, b)
    plain = make_grpo_loss(**kw)(model, b)
    assert corrected[1]["sampling/sampling_logp_difference/max"] > 0
    assert float(corrected[0]) != float(plain[0]) and "sampling/mismatch_kl" in plain[1]
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for m in logged:
        assert 0 < m["sampling/sampling_logp_difference/mean"] < 0.05 and 0 <= m["sampling/mismatch_kl"] < 1e-3
        assert 0.9 < m["sampling/importance_sampling_ratio/min"] <= m["sampling/importance_sampling_ratio/max"] < 1.1


@pytest.mark.parametrize("over, words", [
    ({"rollout.dtype": "bfloat16", "grpo.num_iterations": 2}, "needs grpo.num_iterations=1"),
    ({"rollout.is_mode": "token_mask"}, "corrects a sampler in another precision")])
def test_rollout_settings_are_checked(tmp_path, over, words):
    with pytest.raises(Exception, match=words):
        config(tmp_path, **over)
