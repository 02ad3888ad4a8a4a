"""The online DPO trainer: TRL's pairing of two sampled completions (ties keep the first), its row is the DPO
recipe's pair row and its loss the DPO recipe's (sigmoid) or TRL's online IPO, the CLI end to end, exact
resume, config errors. Learning from an SFT start: tests/test_rl_learning.py."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested
from flax import nnx

from posttrain import cli
from posttrain import config as C
from posttrain.data.preference import Pair, pair_arrays, pair_shapes
from posttrain.losses.dpo import make_dpo_loss, make_pair_loss
from posttrain.losses.logps import branch_logps
from posttrain.models import Transformer
from posttrain.rl.pairs import pair_order
from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "grpo_addition.jsonl")
SEEN: list = []  # the completion ids the judge saw, in sampling order


def id_sum_reward(prompts, completions, completion_ids, **_):
    """A judge with frequent ties: the sum of the completion's ids modulo 3."""
    SEEN.append([list(c) for c in completion_ids])
    return [float(sum(c) % 3) for c in completion_ids]


def config(tmp_path, **over) -> OnlineDPOConfig:
    d = {"model": {"preset": "demo-tiny"},
         "data": {"train": PROMPTS, "max_prompt_length": 8},
         "online_dpo": {"max_new_tokens": 5, "temperature": 1.0, "rewards": {"test_online_dpo:id_sum_reward": 1.0}},
         "optim": {"lr": 1e-3, "schedule": "constant"},
         "train": {"steps": 3, "batch_size": 8, "log_every": 1},
         "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(tmp_path / "run")}
    nested(d, over)
    return C.from_dict(OnlineDPOConfig, d)


def test_pair_order_is_trls_chosen_is_the_higher_score_ties_keep_the_first():
    # pairs: second higher, first higher, tie, tie at -inf-ish, negative scores
    scores = [0.0, 1.0, 2.0, -1.0, 0.5, 0.5, -3.0, -3.0, -2.0, -1.0]
    assert pair_order(scores).tolist() == [1, 0, 2, 3, 4, 5, 6, 7, 9, 8]


@pytest.fixture(scope="module")
def rollout_batch(tmp_path_factory):
    """(trainer, the first rollout's batch, the completion ids its judge saw) of a full fine-tuning run."""
    SEEN.clear()
    trainer = OnlineDPOTrainer(config(tmp_path_factory.mktemp("od")), progress=False)
    setup = trainer.setup()
    batch = setup.batches(setup.state)
    return trainer, batch, SEEN[0], setup.batches.metrics()


def _branches(batch, i):
    """(prompt, branch 1, branch 2) token ids of row i."""
    t, b, s = batch["tokens"][i], batch["branch_ids"][i], batch["segment_ids"][i]
    return t[(b == 0) & (s == 1)], t[b == 1], t[b == 2]


def test_the_row_is_chosen_then_rejected_by_the_judges_score(rollout_batch):
    trainer, batch, seen, stats = rollout_batch
    B = trainer.config.train.batch_size
    assert len(seen) == 2 * B and batch["tokens"].shape[0] == B
    ties = 0
    for i in range(B):
        first, second = seen[2 * i], seen[2 * i + 1]
        s1, s2 = sum(first) % 3, sum(second) % 3
        ties += s1 == s2
        chosen, rejected = (second, first) if s2 > s1 else (first, second)  # TRL: first >= second -> first
        _, c, r = _branches(batch, i)
        assert c.tolist() == chosen and r.tolist() == rejected, (i, s1, s2)
    assert "old_logps" not in batch and "advantages" not in batch
    assert stats["objective/scores_margin"] >= 0 and 0 <= stats["val/contain_eos_token"] <= 1
    assert math.isfinite(stats["objective/scores"]), stats
    print(f"{ties} ties of {B}")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_loss_on_a_built_row_is_the_dpo_recipes(rollout_batch, loss_type):
    """Sigmoid: the loss and metrics of a rollout's rows equal `make_dpo_loss` (the offline DPO recipe's, checked
    against TRL) on the same (prompt, chosen, rejected) pairs in DPO's own pair rows. IPO: TRL OnlineDPOTrainer's
    (Δ − 1/(2β))² on the summed log-ratios (the offline recipe averages them per token)."""
    trainer, batch, _, _ = rollout_batch
    policy = trainer.model
    ref = Transformer(policy.cfg, rngs=nnx.Rngs(7))  # a different reference: non-zero log-ratios
    beta = 0.3
    online = make_pair_loss(beta=beta, loss_type=loss_type)(policy, {k: jnp.asarray(v) for k, v in batch.items()},
                                                             frozen=ref)
    pairs = [Pair(*_branches(batch, i), where=f"row {i}") for i in range(len(batch["tokens"]))]
    length, score_length = pair_shapes(pairs)
    dpo_rows = {k: jnp.asarray(v) for k, v in pair_arrays(pairs, length, score_length, 0).items()}
    pi, r = branch_logps(policy, dpo_rows, 2)[1], branch_logps(ref, dpo_rows, 2)[1]
    if loss_type == "sigmoid":
        offline = make_dpo_loss(beta=beta, loss_type="sigmoid")(policy, dpo_rows, frozen=ref)
        np.testing.assert_allclose(float(online[0]), float(offline[0]), rtol=1e-5)
        for k, v in offline[1].items():
            np.testing.assert_allclose(float(online[1][k]), float(v), rtol=1e-5, atol=1e-5, err_msg=k)
    else:
        margin = (pi[:, 0] - r[:, 0]) - (pi[:, 1] - r[:, 1])
        want = float(jnp.sum((margin - 1 / (2 * beta)) ** 2))
        np.testing.assert_allclose(float(online[0]), want, rtol=1e-5)
        per_token = float(make_dpo_loss(beta=beta, loss_type="ipo")(policy, dpo_rows, frozen=ref)[0])
        assert abs(per_token - want) > 1e-3 * abs(want)  # not the offline (length-averaged) IPO
    kl = float(jnp.sum(pi - r)) / 2  # TRL: each sample's summed log-ratio, the mean over both samples of a pair
    np.testing.assert_allclose(float(online[1]["objective/kl"]), kl, rtol=1e-4, atol=1e-4)


def _yaml(path, run_dir, **over) -> str:
    d = {"model": {"preset": "demo-tiny"}, "data": {"train": PROMPTS, "max_prompt_length": 8},
         "online_dpo": {"max_new_tokens": 4, "rewards": {"last_number": 1.0}},
         "lora": {"enabled": True, "rank": 4}, "optim": {"lr": 1e-3, "schedule": "constant"},
         "train": {"steps": 3, "batch_size": 4, "log_every": 1}, "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(run_dir)}
    nested(d, over)
    path.write_text(json.dumps(d))  # JSON is YAML
    return str(path)


TRL_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected", "objective/kl", "objective/entropy", "objective/non_score_reward",
               "objective/scores", "objective/scores_margin", "val/contain_eos_token")


def test_cli_full_fine_tuning_ipo_three_steps_metrics_finite(tmp_path, capsys):
    cfg = _yaml(tmp_path / "c.yaml", tmp_path / "run", **{"lora.enabled": False, "online_dpo.loss_type": "ipo",
                                                          "online_dpo.missing_eos_penalty": 1.0})
    assert cli.main(["online_dpo", "--config", cfg]) == 0
    assert "[online_dpo] done: 3 steps" in capsys.readouterr().out
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [1, 2, 3]
    for m in logged:
        for k in TRL_METRICS:
            assert math.isfinite(m[k]), (k, m)
    assert json.load(open(tmp_path / "run" / "run.json")) == {"recipe": "online_dpo"}
    first = logged[0]  # step 1: the policy is the reference (frozen copy) -> log-ratios 0
    assert abs(first["objective/kl"]) < 1e-4 and abs(first["rewards/margins"]) < 1e-5


def test_cli_lora_resume_is_exact_and_bad_keys_exit_2(tmp_path, capsys):
    """4 steps (a checkpoint each) equal 2 steps resumed to 4: the same final adapters, bitwise."""
    run = tmp_path / "run"
    cfg = _yaml(tmp_path / "c.yaml", run, **{"train.steps": 4, "checkpoint.every": 1, "checkpoint.keep": 4,
                                             "checkpoint.async_save": False})
    assert cli.main(["online_dpo", "--config", cfg]) == 0
    final = (run / "trainable.safetensors").read_bytes()
    for step in ("3", "4"):
        shutil.rmtree(run / "checkpoints" / step)
    (run / "trainable.safetensors").unlink()
    assert cli.main(["online_dpo", "--config", cfg]) == 0
    assert "resum" in capsys.readouterr().out.lower()
    assert (run / "trainable.safetensors").read_bytes() == final
    rc = cli.main(["online_dpo", "--config", cfg, "online_dpo.bta=0.2", f"run_dir={tmp_path / 'other'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "online_dpo.bta" in err, err
    rc = cli.main(["online_dpo", "--config", cfg, "online_dpo.loss_type=hinge", f"run_dir={tmp_path / 'other'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "online_dpo.loss_type" in err, err


def test_the_sampler_on_its_own_devices_in_bfloat16(tmp_path):
    """rollout.devices and rollout.dtype (the RL base's): the sampler's weights on the last two of the 8 virtual
    devices in bfloat16, the training mesh on the first two; two steps train (the loss recomputes both
    log-probs, so another sampling precision needs no correction). is_mode and max_staleness are refused."""
    import jax

    from posttrain.errors import PosttrainError

    split = {"sharding.preset": "dp", "sharding.mesh_shape": {"data": 2}, "rollout.devices": 2,
             "rollout.dtype": "bfloat16", "train.steps": 2}
    trainer = OnlineDPOTrainer(config(tmp_path, **split), progress=False)
    every = jax.devices()
    assert set(trainer.mesh.devices.flat) == set(every[:2])
    parts = trainer.setup()
    parts.batches(parts.state)
    leaves = jax.tree.leaves(parts.batches.sampler.state)
    assert {d for x in leaves for d in x.devices()} == set(every[-2:])
    assert any(x.dtype == np.dtype("bfloat16") for x in leaves)
    result = trainer.train()
    assert result["step"] == 2 and np.isfinite(result["loss"])
    for key, value in (("is_mode", "token_mask"), ("max_staleness", 1)):
        with pytest.raises(PosttrainError, match=f"rollout.{key} is not supported by online_dpo"):
            OnlineDPOTrainer(config(tmp_path / key, **{f"rollout.{key}": value}), progress=False)
