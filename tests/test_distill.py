"""The distillation trainer: chunked logits and packing change nothing, student == teacher gives a zero
loss and gradient, the teacher stays frozen, the data modes (teacher-generated, on-policy) and their
resume, bad input, export, and learning (a trained 4-layer teacher into a 2-layer half-width student)."""

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
from posttrain.data import to_arrays
from posttrain.tasks import addition
from posttrain.trainers.distill import DistillConfig, DistillTrainer


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """(train file, eval file, eval rows): two-digit addition as prompt/completion rows."""
    train, evals = addition.make_pairs(digits=2, seed=0, n_eval=200)
    d = tmp_path_factory.mktemp("distill_data")
    return (addition.write_jsonl(train, str(d / "train.jsonl")),
            addition.write_jsonl(evals[:64], str(d / "eval.jsonl")), evals)


def config(tmp_path, rows, **over) -> DistillConfig:
    d = {"model": {"preset": "tiny-student"}, "teacher": {"preset": "tiny-teacher", "seed": 1},
         "data": {"train": rows[0], "max_length": 16},
         "optim": {"lr": 1e-3, "schedule": "constant"},
         "train": {"steps": 3, "batch_size": 4, "log_every": 1},
         "metrics": {"sinks": ["jsonl"]}, "run_dir": str(tmp_path / "run")}
    nested(d, over)
    return C.from_dict(DistillConfig, d)


ALL = {"distill.strategy": ["logit", "attention", "feature"], "distill.layer_map": {0: 1, 1: 3},
       "distill.feature_layer_map": {1: 2, 2: 4}}


def _loss_and_grads(trainer, batch):
    loss_fn = trainer.eval_loss_fn  # the training step's loss with the held-out metrics too
    graphdef, params, rest = nnx.split(trainer.model, trainer.trainable, ...)

    def f(p):
        return loss_fn(nnx.merge(graphdef, p, rest), batch, frozen=trainer.teacher)

    (total, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return total, metrics, grads


def _close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_chunked_logits_and_packing_change_nothing(tmp_path, rows):
    """The loss, every metric and every gradient are the same with the logits formed 5 positions at a
    time (a scan over chunks, the last one padded) as all at once, and with the examples packed
    several to a row as one per row (logit + attention + feature through a learned projection)."""
    over = {**ALL, "data.max_length": 48, "distill.projection": True}
    whole = DistillTrainer(config(tmp_path, rows, **{**over, "distill.chunk_size": 0}), progress=False)
    chunked = DistillTrainer(config(tmp_path, rows, **{**over, "distill.chunk_size": 5}), progress=False)
    ex = whole.train_examples[:6]
    one_per_row = {k: jnp.asarray(v) for k, v in to_arrays(ex, 48, whole.tokenizer.pad_id, False).items()}
    packed = {k: jnp.asarray(v) for k, v in to_arrays(ex, 48, whole.tokenizer.pad_id, True).items()}
    assert packed["tokens"].shape[0] < one_per_row["tokens"].shape[0]
    ref = _loss_and_grads(whole, one_per_row)
    assert float(ref[0]) > 0 and all(float(v) != 0 for k, v in ref[1].items() if k.endswith("_loss"))
    for trainer, batch in ((chunked, one_per_row), (whole, packed)):
        _close(_loss_and_grads(trainer, batch), ref, 2e-5)


def test_student_equal_to_teacher_gives_zero_loss_and_gradient(tmp_path, rows):
    """A student that is the teacher (same preset and seed): every distillation loss is 0 and so is
    the gradient; agreement and both cosines are 1; the teacher receives no gradient at all."""
    over = {**ALL, "model.preset": "tiny-teacher", "model.seed": 1, "distill.alpha": 1.0,
            "distill.layer_map": {0: 0, 3: 3}, "distill.feature_layer_map": {2: 2, 4: 4}}
    trainer = DistillTrainer(config(tmp_path, rows, **over), progress=False)
    batch = {k: jnp.asarray(v) for k, v in to_arrays(trainer.train_examples[:4], 16, 0, False).items()}
    total, metrics, grads = _loss_and_grads(trainer, batch)
    n = float(metrics["denom"])
    assert abs(float(total)) / n < 1e-6
    for k in ("kl", "teacher_kl", "attn_loss", "feature_loss"):
        assert abs(float(metrics[k])) / n < 1e-6, k
    for k in ("top1_agreement", "logit_cosine", "hidden_cosine"):
        assert float(metrics[k]) / n == pytest.approx(1.0, abs=1e-5), k
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) / n < 1e-6  # the step divides by n
    # The teacher is a constant of the loss (stop_gradient): no gradient reaches it.
    tg, tp = nnx.split(trainer.teacher)
    g = jax.jit(jax.grad(lambda p: trainer.loss_fn(trainer.model, batch, frozen=nnx.merge(tg, p))[0]))(tp)
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(g))


def test_teacher_generated_data_is_sampled_once_and_cached(tmp_path, rows, monkeypatch):
    """mode=teacher_generated: the teacher's greedy completions of the prompts become the training
    examples (the loss on the completion only), written to run_dir; a rerun reads them back."""
    cfg = config(tmp_path, rows, **{"distill.mode": "teacher_generated", "distill.sample_temperature": 0.0,
                                    "distill.max_new_tokens": 4, "data.train": rows[1], "train.steps": 2})
    trainer = DistillTrainer(cfg, progress=False)
    trainer.train()
    ex = trainer.train_examples
    assert len(ex) == 64 and os.path.isfile(tmp_path / "run" / "teacher_data.jsonl")
    from posttrain.generate import Sampler, SamplingParams

    p = trainer.prompts[5]
    out = Sampler(trainer.teacher, max_len=32).generate([p.ids], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                                stop_ids=trainer.tokenizer.eos_ids))
    np.testing.assert_array_equal(ex[5].ids, np.concatenate([p.ids, out.tokens[0, :out.lengths[0]]]))
    assert ex[5].loss_mask[:len(p.ids)].sum() == 0 and ex[5].loss_mask[len(p.ids):].all()
    shutil.rmtree(tmp_path / "run" / "checkpoints")

    def no_sampling(*a, **k):
        raise AssertionError("the cached teacher samples were not reused")

    monkeypatch.setattr("posttrain.rl.distill.teacher_samples", no_sampling)
    again = DistillTrainer(cfg, progress=False)
    again.train()
    assert all(np.array_equal(a.ids, b.ids) for a, b in zip(ex, again.train_examples))


def test_on_policy_mixes_student_samples_and_resumes_exactly(tmp_path, rows):
    """mode=on_policy (GKD, λ = 0.5, JSD): the steps drawn on-policy train on the student's own samples,
    the others on the dataset (the logged on_policy flags); the teacher is unchanged by the steps; a
    run resumed from the checkpoint after step 4 ends with the same weights as the uninterrupted one."""
    cfg = config(tmp_path, rows, **{"distill.mode": "on_policy", "distill.lmbda": 0.5, "distill.max_new_tokens": 4,
                                    "distill.kind": "jsd", "train.steps": 5, "checkpoint.every": 1,
                                    "checkpoint.keep": 5, "checkpoint.async_save": False})
    from posttrain.rl.distill import on_policy_step

    kinds = [on_policy_step(0, s, 0.5) for s in range(5)]
    assert any(kinds) and not all(kinds)
    first = DistillTrainer(cfg, progress=False)
    built = [np.array(x) for x in jax.tree.leaves(nnx.state(first.teacher))]  # a copy of the teacher as built
    first.train()
    teacher = jax.tree.leaves(nnx.state(first.teacher))  # it stayed frozen through the steps
    assert len(teacher) == len(built)
    for x, y in zip(teacher, built):
        np.testing.assert_array_equal(x, y)
    logged = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["on_policy"] for m in logged] == [float(k) for k in kinds]
    assert all(("completion/length" in m) == k for m, k in zip(logged, kinds))  # sampled on those steps only
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "5")
    resumed = DistillTrainer(cfg, progress=False)
    assert resumed.train()["step"] == 5
    for x, y in zip(jax.tree.leaves(nnx.state(first.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(resumed.model, nnx.Param))):
        np.testing.assert_array_equal(x, y)


def _teacher_folder_with_other_tokenizer(tmp_path) -> str:
    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok.hf.add_tokens(["<extra>"])
    model = Transformer(preset("tiny-teacher", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
    return save_pretrained(model, str(tmp_path / "other_teacher"), tokenizer=tok)


@pytest.mark.parametrize("over, words", [
    ({"teacher": "OTHER"}, ["model.tokenizer and teacher.tokenizer differ", "'<extra>'"]),
    ({"distill.strategy": ["logit", "attention"], "distill.layer_map": {0: 4}},
     ["distill.layer_map", "teacher layer 4"]),
    ({"distill.strategy": ["attention"]}, ["distill.layer_map is empty"]),
    ({"distill.strategy": ["feature"], "distill.pool_size": 3}, ["distill.pool_size", "does not divide"]),
    ({"distill.feature_layer_map": {3: 1}}, ["distill.feature_layer_map", "student layer 3"]),
    ({"distill.mode": "nearline"}, ["distill.mode"]),
])
def test_bad_input_names_the_key(tmp_path, rows, capsys, over, words):
    if over.get("teacher") == "OTHER":
        over = {"teacher": {"path": _teacher_folder_with_other_tokenizer(tmp_path)}}
    d = {"model": {"preset": "tiny-student"}, "teacher": {"preset": "tiny-teacher"},
         "data": {"train": rows[0], "max_length": 16}, "run_dir": str(tmp_path / "run")}
    nested(d, over)
    path = tmp_path / "cfg.yaml"
    import yaml

    path.write_text(yaml.safe_dump(d))
    assert cli.main(["distill", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not os.path.exists(tmp_path / "run")  # nothing written


def test_cli_distill_with_a_learned_projection_then_export(tmp_path, rows, capsys):
    """`posttrain distill` (feature loss through a learned projection, trained with the student),
    then `posttrain export --run`: transformers-loadable student whose logits equal the trainer's."""
    d = {"model": {"preset": "tiny-student"}, "teacher": {"preset": "tiny-teacher"},
         "data": {"train": rows[0], "eval": rows[1], "max_length": 16},
         "distill": {"strategy": ["logit", "feature"], "projection": True},
         "train": {"steps": 2, "batch_size": 4, "log_every": 1}, "metrics": {"sinks": ["jsonl"]},
         "run_dir": str(tmp_path / "run")}
    import yaml

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(d))
    assert cli.main(["distill", "--config", str(tmp_path / "cfg.yaml")]) == 0
    assert "held-out KL(teacher||student)" in capsys.readouterr().out
    assert cli.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    from posttrain.models import from_pretrained
    from posttrain.runs import load_run

    _, tok, model = load_run(str(tmp_path / "run"))
    ids = jnp.asarray([tok.encode("12+34=46")])
    pos = jnp.arange(ids.shape[1])[None]
    np.testing.assert_allclose(from_pretrained(str(tmp_path / "hf"))(ids, pos).logits, model(ids, pos).logits,
                               atol=1e-5)
    proj = np.asarray(model.distill_projection[...])
    assert proj.shape == (128, 64) and not np.allclose(proj, DistillTrainer(
        C.load(DistillConfig, str(tmp_path / "cfg.yaml")), progress=False).model.distill_projection[...])


def test_distilling_a_trained_teacher_into_a_half_width_student(tmp_path, rows):
    """A 4-layer teacher SFT-ed on addition, distilled into a 2-layer student of half its width at equal
    steps three ways: logit only cuts held-out KL(teacher‖student) by >= 50 %, raises top-1 agreement
    and reaches a logit cosine >= 0.95; adding attention transfer or feature pooling lowers that
    loss too, without a held-out KL more than 5 % above logit-only's."""
    from posttrain.runs import export_run
    from posttrain.trainers.sft import SFTTrainer

    sft = C.from_dict(C.SFTConfig, {
        "model": {"preset": "tiny-teacher"}, "data": {"train": rows[0], "max_length": 16},
        "optim": {"lr": 1.5e-3, "warmup_steps": 20, "schedule": "constant"},
        "train": {"steps": 120, "batch_size": 32, "log_every": 40}, "metrics": {"sinks": ["jsonl"]},
        "run_dir": str(tmp_path / "teacher")})
    SFTTrainer(sft, progress=False).train()
    teacher = export_run(str(tmp_path / "teacher"), str(tmp_path / "teacher_hf"))
    base = {"model.tokenizer": teacher, "teacher": {"path": teacher}, "data.eval": rows[1],
            "optim": {"lr": 2e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1},
            "train": {"steps": 80, "batch_size": 32, "log_every": 10}}
    runs = {"logit": {}, "attention": {"distill.strategy": ["logit", "attention"], "distill.layer_map": {0: 1, 1: 3}},
            "feature": {"distill.strategy": ["logit", "feature"]}}
    out = {}
    for name, over in runs.items():
        trainer = DistillTrainer(config(tmp_path / name, rows, **{**base, **over}), progress=False)
        if name == "logit":  # the three students start from the same weights
            parts = trainer.setup()
            before = parts.evaluate(parts.state)
        t0 = time.perf_counter()
        after = trainer.train()
        logged = [m for m in map(json.loads, open(tmp_path / name / "run" / "metrics.jsonl")) if "grad_norm" in m]
        out[name] = (after, logged)
        print(name, f"{time.perf_counter() - t0:.1f} s", {k: round(v, 4) for k, v in after.items() if "eval" in k})
    print("before", {k: round(v, 4) for k, v in before.items()})
    after = out["logit"][0]
    assert after["eval_teacher_kl"] <= 0.5 * before["eval_teacher_kl"]
    assert after["eval_top1_agreement"] > before["eval_top1_agreement"] + 0.2
    assert after["eval_logit_cosine"] >= 0.95
    for name, key in (("attention", "attn_loss"), ("feature", "feature_loss")):
        a, logged = out[name]
        assert a[f"eval_{key}"] < 0.7 * logged[0][key] and logged[-1][key] < logged[0][key], name
        assert a["eval_teacher_kl"] <= 1.05 * after["eval_teacher_kl"], name
