"""Off-policy GRPO rollouts (`rollout.max_staleness`, rl/offpolicy.py): the schedule's version lags, exact
resume with batches sampled ahead, and max_staleness 0 as the on-policy trainer."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import nested
from safetensors.numpy import load_file

from posttrain import config as C
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 8


def parity_reward(prompts, completions, **_):
    return [float(len(c) % 2 == 0) for c in completions]


def config(run_dir, **over) -> GRPOConfig:
    d = {"model": {"preset": "demo-tiny"},
         "data": {"train": os.path.join(HERE, "data", "grpo_addition.jsonl"), "max_prompt_length": 8},
         "grpo": {"num_generations": 4, "max_new_tokens": 4, "rewards": {"test_offpolicy:parity_reward": 1.0}},
         "lora": {"enabled": True, "rank": 4}, "optim": {"lr": 1e-2, "schedule": "constant"},
         "train": {"steps": STEPS, "batch_size": 4, "log_every": 1},
         "checkpoint": {"every": 1, "keep": STEPS, "async_save": False},
         "metrics": {"sinks": ["jsonl"]}, "run_dir": str(run_dir)}
    nested(d, over)
    return C.from_dict(GRPOConfig, d)


def weights(run_dir) -> dict:
    return load_file(os.path.join(run_dir, "trainable.safetensors"))


def test_stale_rollouts_lag_as_scheduled_and_resume_exactly(tmp_path):
    """max_staleness 2: step r trains on a batch of the weights of step r - 2 (lag 0, 1, 2, 2, ...), sampled in
    the background; stopped and restarted after step 2 (the first lag-2 batch next), 4 (the steady lag) and 7 (one
    step left), the run ends with the uninterrupted run's weights bitwise; the off-policy run differs from the
    on-policy one. (Five random stops before, [4, 5, 2, 7, 3]: 3 and 5 resumed the same steady lag as 4, two more
    restarts of the run for nothing new.)"""
    GRPOTrainer(config(tmp_path / "whole", **{"rollout.max_staleness": 2}), progress=False).train()
    logged = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    assert [m["rollout/version_lag"] for m in logged] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert all(m["rollout/dropped_stale"] == 0 for m in logged)
    whole = weights(tmp_path / "whole")
    stops = [2, 4, 7]
    for stop in stops:  # a run killed after step `stop`: its later checkpoints and final weights never written
        for name in os.listdir(tmp_path / "whole" / "checkpoints"):
            if name.isdigit() and int(name) > stop:
                shutil.rmtree(tmp_path / "whole" / "checkpoints" / name)
        os.remove(tmp_path / "whole" / "trainable.safetensors")
        assert GRPOTrainer(config(tmp_path / "whole", **{"rollout.max_staleness": 2}), progress=False).train()["step"] \
            == STEPS
        again = weights(tmp_path / "whole")
        assert all(np.array_equal(whole[k], again[k]) for k in whole), (stop, stops)
    # 0 is today's on-policy trainer: the default config is the one with max_staleness 0 (equal configs, so one run
    # of it instead of two runs of the same config compared bitwise)
    on_cfg = config(tmp_path / "on", **{"rollout.max_staleness": 0})
    assert config(tmp_path / "on") == on_cfg and on_cfg.rollout.max_staleness == 0
    GRPOTrainer(on_cfg, progress=False).train()
    on = weights(tmp_path / "on")
    assert not all(np.array_equal(on[k], whole[k]) for k in on)


@pytest.mark.parametrize("over", [{"grpo.num_iterations": 2}, {"rollout.dtype": "bfloat16"}])
def test_stale_rollouts_refuse_what_they_cannot_do(tmp_path, over):
    with pytest.raises(Exception, match="rollout.max_staleness needs"):
        config(tmp_path / "x", **{"rollout.max_staleness": 1, **over})


def test_the_sampler_on_its_own_devices_samples_stale_batches_from_pushed_weights(tmp_path, capsys):
    """rollout.devices=2 beside a 2-device data-parallel training mesh (4 of the 8 virtual CPU devices): the
    sampler's weights live on the last two devices only, pushed there after every update; one step stale, every
    step's version lag is <= 1; stopped and restarted after step 1 (the first lag-1 batch next) and 3 (the steady
    lag) the run ends with its uninterrupted weights bitwise, and with the weights (to float round-off) of the same
    schedule on one device. (Five random stops before, [3, 1, 4, 6, 2]: 2, 4 and 6 resumed the same steady lag as
    3, restarts for nothing new; the test above resumes with one step left.)"""
    import jax

    over = {"rollout.max_staleness": 1, "sharding.preset": "dp", "sharding.mesh_shape": {"data": 2}}
    split = {**over, "rollout.devices": 2}
    trainer = GRPOTrainer(config(tmp_path / "split", **split), progress=False)
    every = jax.devices()
    assert set(trainer.mesh.devices.flat) == set(every[:2])
    parts = trainer.setup()
    parts.batches(parts.state)  # the first batches, sampled from the pushed weights
    placed = {d for x in jax.tree.leaves(parts.batches.sampler.state) for d in x.devices()}
    assert placed == set(every[-2:])
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "split" / "metrics.jsonl")]
    assert [m["rollout/version_lag_max"] for m in logged] == [0] + [1] * (STEPS - 1)
    assert all(np.isfinite(m["loss"]) for m in logged)
    whole = weights(tmp_path / "split")
    for stop in [1, 3]:
        for name in os.listdir(tmp_path / "split" / "checkpoints"):
            if name.isdigit() and int(name) > stop:
                shutil.rmtree(tmp_path / "split" / "checkpoints" / name)
        os.remove(tmp_path / "split" / "trainable.safetensors")
        capsys.readouterr()
        GRPOTrainer(config(tmp_path / "split", **split), progress=False).train()
        assert f"from the checkpoint at step {stop}" in capsys.readouterr().out
        again = weights(tmp_path / "split")
        assert all(np.array_equal(whole[k], again[k]) for k in whole), stop
    one = {k: v for k, v in over.items() if not k.startswith("sharding")}
    GRPOTrainer(config(tmp_path / "shared", **one), progress=False).train()  # one device samples and trains
    shared = weights(tmp_path / "shared")
    assert all(np.allclose(whole[k], shared[k], atol=5e-4) for k in whole)  # Adam amplifies round-off
    rewards = [[m["reward/mean"] for m in map(json.loads, open(tmp_path / run / "metrics.jsonl"))][:STEPS]
               for run in ("split", "shared")]
    assert rewards[0] == rewards[1]  # the same samples, each logged with the step that trained on it
