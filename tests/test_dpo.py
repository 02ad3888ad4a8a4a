"""The DPO trainer: TRL's preference formats, bad rows, reference modes, invariants, learning, resume."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested
from flax import nnx

from posttrain import cli
from posttrain import config as C
from posttrain.data.preference import load_pairs, pair_arrays, pair_shapes, tokenize_pair
from posttrain.errors import PosttrainError
from posttrain.losses.logps import branch_logps
from posttrain.models.lora import adapters_off
from posttrain.tasks import addition, parity
from posttrain.tokenizer import byte_tokenizer
from posttrain.trainers.dpo import REF_FILE, DPOConfig, DPOTrainer

ROWS = [  # one of each TRL preference format
    {"prompt": "12+3=", "chosen": "15", "rejected": "16"},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
     "rejected": [{"role": "assistant", "content": "go away"}]},
    {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]},
]


def config(tmp_path, data, **over) -> DPOConfig:
    d = {"model": {"preset": "demo-tiny"},
         "data": {"train": data, "max_length": 32},
         # eps 1e-5: with 1e-8 Adam's sign-like update of near-zero gradients amplifies the reduction
         # order of sharded sums (see test_sharded_sft.py)
         "optim": {"lr": 1e-3, "schedule": "constant", "eps": 1e-5},
         "train": {"steps": 4, "batch_size": 8, "log_every": 1},
         "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(tmp_path / "run")}
    nested(d, over)
    return C.from_dict(DPOConfig, d)


@pytest.fixture(scope="module")
def parity_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    train, evals = parity.make_pairs(n_train=256, n_eval=64, seed=0)
    return addition.write_jsonl(train, str(d / "train.jsonl")), addition.write_jsonl(evals, str(d / "eval.jsonl"))


@pytest.mark.parity
def test_pair_tokens_equal_trl_dpo_trainer(tmp_path):
    """Every TRL preference format gives TRL 1.16 DPOTrainer's own prompt / chosen / rejected ids."""
    import transformers
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer as TRLTrainer

    tok = byte_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    for i, row in enumerate(ROWS):
        args = TRLConfig(output_dir=str(tmp_path / f"o{i}"), report_to=[], max_length=None, use_cpu=True, bf16=False)
        ref = TRLTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list([row]),
                         processing_class=tok.hf).train_dataset[0]
        p, c, r, _ = tokenize_pair(row, f"row {i}", tok)
        assert (p, c, r) == (ref["prompt_ids"], ref["chosen_ids"], ref["rejected_ids"]), i


BAD = [  # (row, words the error must contain)
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "identical"),
    ({"prompt": "1+1=", "chosen": "2"}, "no 'rejected' column"),
    ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, "'chosen' answer is empty"),
    ({"prompt": "x" * 40, "chosen": "2", "rejected": "3"}, "leaves no room for an answer"),
]


@pytest.mark.parametrize("k", range(len(BAD)))
def test_bad_row_names_file_line_and_exits_2(tmp_path, capsys, k):
    good = [{"prompt": f"{i}?", "chosen": " a", "rejected": " b"} for i in range(3)]
    path = addition.write_jsonl(good + [BAD[k][0]], str(tmp_path / "pairs.jsonl"))
    run = tmp_path / "run"
    rc = cli.main(["dpo", "--config", "configs/dpo_tiny.yaml", f"data.train={path}", "data.eval=null",
                   "train.eval_every=0", f"run_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:4:" in err and BAD[k][1] in err, err
    assert not run.exists()  # nothing half-written


def test_skip_bad_rows_counts_them(tmp_path):
    good = [{"prompt": f"{i}?", "chosen": " a", "rejected": " b"} for i in range(3)]
    path = addition.write_jsonl(good + [row for row, _ in BAD], str(tmp_path / "pairs.jsonl"))
    with pytest.warns(UserWarning, match="skipped 4 of 7 rows"):
        pairs, counts = load_pairs(path, byte_tokenizer(), max_length=32, skip_bad_rows=True)
    assert len(pairs) == 3 and counts["skipped"] == 4


def test_truncate_keeps_prompt_end_and_answer_start(tmp_path):
    row = {"prompt": "abcdefgh", "chosen": "123456", "rejected": "xy"}
    path = addition.write_jsonl([row], str(tmp_path / "p.jsonl"))
    tok = byte_tokenizer()
    (pair,), counts = load_pairs(path, tok, max_length=8, max_prompt_length=4, truncation="truncate")
    assert tok.decode(pair.prompt) == "efgh" and tok.decode(pair.chosen) == "1234"
    assert tok.decode(pair.rejected) == "xy" and counts["truncated"] == 1
    with pytest.raises(PosttrainError, match="dropped=1"):
        load_pairs(path, tok, max_length=8, truncation="drop")


def _pair_batch(trainer, n=8):
    arrays = pair_arrays(trainer.train_pairs[:n], trainer.length, trainer.score_length, trainer.tokenizer.pad_id)
    return {k: jnp.asarray(v) for k, v in arrays.items()}


def test_lora_reference_is_the_base_without_a_copy(tmp_path, parity_files):
    """Policy = reference at the start: loss log 2, zero rewards. The LoRA step's arguments hold the
    base weights once (no reference copy); its reference log-probs are the base model's."""
    base = DPOTrainer(config(tmp_path, parity_files[0]), progress=False)
    lora = DPOTrainer(config(tmp_path, parity_files[0], **{"lora.enabled": True}), progress=False)
    parts = lora.setup()
    assert parts.frozen is None
    state, batch = parts.state, _pair_batch(lora)
    compiled = parts.raw_step.lower(state, batch, None).compile()
    args = compiled.memory_analysis().argument_size_in_bytes
    # Train the adapters a little so the policy differs from the reference, then compare the reference.
    for i in range(3):
        state, metrics = compiled(state, batch, None)
        if i == 0:
            assert abs(float(metrics["loss"]) - math.log(2)) < 1e-6
            assert abs(float(metrics["rewards/chosen"])) < 1e-6 and abs(float(metrics["rewards/margins"])) < 1e-6
    policy = nnx.merge(parts.graphdef, state.params, state.rest)
    ref = branch_logps(adapters_off(policy), batch, 2)[1]
    assert float(jnp.abs(branch_logps(policy, batch, 2)[1] - ref).max()) > 1e-3  # the adapters trained
    np.testing.assert_allclose(ref, branch_logps(base.model, batch, 2)[1], atol=1e-5)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(base.model, nnx.Param)))
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    adapters = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # base once + adapters with their two Adam moments + the batch; a second base copy would double it
    assert args <= base_bytes + 4 * adapters + batch_bytes + 4096, (args, base_bytes)


def _held_out_accuracy(trainer, model, ref_model, pairs):
    """Implicit-reward preference accuracy on held-out pairs (a tie counts as a coin flip: 1/2)."""
    length, score_length = pair_shapes(pairs)
    b = {k: jnp.asarray(v) for k, v in pair_arrays(pairs, length, score_length, trainer.tokenizer.pad_id).items()}
    margin = np.asarray(branch_logps(model, b, 2)[1] - branch_logps(ref_model, b, 2)[1])
    d = margin[:, 0] - margin[:, 1]
    return float(np.mean((d > 0) + 0.5 * (d == 0)))


def test_dpo_learns_a_hidden_rule_from_preferences(tmp_path, parity_files):
    """Held-out implicit-reward accuracy: ~50 % before (policy = reference), >= 90 % after."""
    train, evals = parity_files
    cfg = config(tmp_path, train, **{"data.eval": evals, "train.steps": 60, "train.batch_size": 16,
                                     "train.log_every": 20, "train.eval_every": 20, "optim.lr": 1e-3})
    trainer = DPOTrainer(cfg, progress=False)
    start = jax.tree.map(jnp.copy, trainer.model)
    held = load_pairs(evals, trainer.tokenizer, max_length=32)[0]
    before = _held_out_accuracy(trainer, trainer.model, start, held)
    result = trainer.train()
    after = _held_out_accuracy(trainer, trainer.model, start, held)
    curve = [(r["step"], round(r["eval_rewards/accuracies"], 3)) for r in map(json.loads, open(tmp_path / "run" /
             "metrics.jsonl")) if "eval_rewards/accuracies" in r]
    print(f"held-out implicit-reward accuracy {before:.3f} -> {after:.3f}; eval curve {curve}")
    assert before == 0.5 and after >= 0.9, (before, after, curve)
    assert result["eval_rewards/accuracies"] == pytest.approx(curve[-1][1], abs=1e-3)


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory, parity_files):
    """4 steps with the frozen-copy reference: (trainer, logged metrics)."""
    tmp = tmp_path_factory.mktemp("frozen")
    trainer = DPOTrainer(config(tmp, parity_files[0]), progress=False)
    assert trainer.setup().frozen is not None
    trainer.train()
    return trainer, [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl")]


def test_sharded_dpo_matches_one_device(frozen_run, parity_files, tmp_path):
    single, logged = frozen_run
    trainer = DPOTrainer(config(tmp_path, parity_files[0], **{"sharding.preset": "dp"}), progress=False)
    trainer.train()
    assert trainer.mesh.devices.size == 8
    again = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(again) == len(logged)
    for a, b in zip(logged, again):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5) and b["step"] == a["step"]
    for x, y in zip(jax.tree.leaves(nnx.state(single.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(trainer.model, nnx.Param))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_precomputed_reference_matches_frozen_copy_and_resumes(tmp_path, parity_files, frozen_run):
    """Frozen-copy reference: step 1 has loss log 2 and zero rewards (policy = reference).
    precompute_ref: the same losses; cached in run_dir and reused; a run resumed from its step-2
    checkpoint ends with the same weights as the uninterrupted run."""
    train, logged = parity_files[0], frozen_run[1]
    assert abs(logged[0]["loss"] - math.log(2)) < 1e-6 and abs(logged[0]["rewards/margins"]) < 1e-6
    cfg = config(tmp_path / "b", train, **{"dpo.precompute_ref": True, "checkpoint.every": 2,
                                           "checkpoint.async_save": False})
    first = DPOTrainer(cfg, progress=False)
    first.train()
    again = [json.loads(line) for line in open(tmp_path / "b" / "run" / "metrics.jsonl")]
    assert len(again) == len(logged) == 4
    for a, b in zip(logged, again):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-5), (a, b)
    cache = tmp_path / "b" / "run" / REF_FILE
    stamp = os.stat(cache).st_mtime_ns
    shutil.rmtree(tmp_path / "b" / "run" / "checkpoints" / "4")  # as if killed after the step-2 checkpoint
    resumed = DPOTrainer(cfg, progress=False)
    assert resumed.train()["step"] == 4
    assert os.stat(cache).st_mtime_ns == stamp  # read back, not recomputed
    for x, y in zip(jax.tree.leaves(nnx.state(first.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(resumed.model, nnx.Param))):
        np.testing.assert_array_equal(x, y)


def test_cli_lora_dpo_then_export(tmp_path):
    import torch
    import transformers

    run, out = tmp_path / "run", tmp_path / "hf"
    rc = cli.main(["dpo", "--config", "configs/dpo_tiny.yaml", f"run_dir={run}", "train.steps=3",
                   "train.eval_every=3", "lora.enabled=true", "metrics.sinks=[jsonl]"])
    assert rc == 0
    evals = [json.loads(line) for line in open(run / "metrics.jsonl") if "eval_loss" in line]
    assert len(evals) == 1 and evals[0]["step"] == 3 and "eval_rewards/accuracies" in evals[0]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if "rewards/margins" in line]
    assert rows and all(k in rows[0] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"))
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    # the export (read by transformers, LoRA merged) holds the trainer's policy: the run resumed from its last
    # checkpoint, adapters on, gives the same logits
    trained = DPOTrainer(C.load(DPOConfig, str(run / "config.yaml")), progress=False)
    assert trained.train()["step"] == 3
    ids = np.array([[1, 50, 60, 70, 80, 90]])
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(trained.model(jnp.asarray(ids), jnp.arange(ids.shape[1])[None]).logits)
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    base = np.asarray(adapters_off(trained.model)(jnp.asarray(ids), jnp.arange(ids.shape[1])[None]).logits)
    assert np.abs(ours - base).max() > 1e-4  # the 3 LoRA steps moved the policy: the export is not the base model
