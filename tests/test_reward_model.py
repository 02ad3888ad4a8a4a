"""Reward model: score head, Bradley–Terry trainer, HF sequence-classifier export, RewardModel.

One module-scoped run (demo-tiny + byte tokenizer, the synthetic rule of tests/pref_data.py:
the preferred review has more positive words) is shared by the learning, export, parity and
loss tests. References are transformers (`AutoModelForSequenceClassification`, torch CPU) and
TRL (`RewardTrainer.compute_loss`), never posttrain's own output:
  - learning: held-out pair accuracy of the random head ~50 %, after 20 steps >= 90 %;
  - export: transformers loads the exported folder and scores the unshared rows [prompt | answer]
    as posttrain scores the prefix-shared rows [prompt | chosen | rejected] (|Δ| <= 1e-4);
    `RewardModel` (unshared rows) equals both, and the prefix-shared score to 1e-5;
  - loss: the trainer's loss_fn (margin + reward centering) equals TRL's compute_loss on the
    exported model, and its accuracy / margin metrics equal TRL's;
  - a random HF causal LM (gemma2: tied embeddings, soft-capping, sandwich norms) + a score head
    round-trips to transformers; a transformers LlamaForSequenceClassification (pad = eos, so
    the rightmost-non-pad rule matters) is scored by RewardModel as transformers scores it.
"""

from __future__ import annotations

import functools
import json
import time
import types
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from pref_data import make_rows, write_jsonl

from posttrain import config as C
from posttrain.data.preference import load_pairs, pair_arrays, pair_shapes, tokenize_pair
from posttrain.errors import PosttrainError
from posttrain.losses.reward import make_reward_loss
from posttrain.models import from_pretrained, save_pretrained
from posttrain.models.heads import ScoreParam, attach_score_head, last_token_scores, pair_scores, score_index
from posttrain.models.lora import LoraParam
from posttrain.rewards import RewardModel, tokenize_completion
from posttrain.runs import export_run
from posttrain.tokenizer import byte_tokenizer
from posttrain.train.serialize import save_state
from posttrain.train.trainer import WEIGHTS
from posttrain.trainers.reward_model import RMConfig, RMTrainer, build_reward_model, trainable_filter

REPO = Path(__file__).resolve().parent.parent
STEPS, EVAL_EVERY = 20, 10


def _config(tmp, **over) -> RMConfig:
    base = C.load(RMConfig, REPO / "configs" / "rm_tiny.yaml")
    d = C.to_dict(base)
    d["data"].update(train=str(tmp / "train.jsonl"), eval=str(tmp / "eval.jsonl"))
    d["train"].update(steps=STEPS, eval_every=EVAL_EVERY, log_every=10)
    d["optim"].update(lr=2e-3)
    d["metrics"]["sinks"] = ["jsonl"]
    d["run_dir"] = str(tmp / over.pop("run_name", "run"))
    for section, values in over.items():
        d[section].update(values)
    return C.from_dict(RMConfig, d)


def _jit_scores(model, pad_id):
    """Jitted prefix-shared (chosen, rejected) scores of pair rows, for any weights of this graph."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, b: pair_scores(nnx.merge(graphdef, st), b, pad_id=pad_id))
    return lambda m, b: tuple(np.asarray(x) for x in fn(nnx.state(m), b))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    write_jsonl(make_rows(128, seed=10), tmp / "train.jsonl")
    write_jsonl(make_rows(48, seed=11), tmp / "eval.jsonl")
    t0 = time.perf_counter()
    trainer = RMTrainer(_config(tmp), progress=False)
    tok = trainer.tokenizer
    arrays = pair_arrays(trainer.eval_pairs, trainer.length, trainer.score_length, tok.pad_id)
    scores = _jit_scores(trainer.model, tok.pad_id)
    c0, r0 = scores(trainer.model, arrays)
    result = trainer.train()
    c1, r1 = scores(trainer.model, arrays)
    export = export_run(str(tmp / "run"), str(tmp / "export"))
    curve = [(0, float(np.mean(c0 > r0)))] + [
        (m["step"], m["eval_accuracy"]) for m in map(json.loads, open(tmp / "run" / "metrics.jsonl"))
        if "eval_accuracy" in m]
    print(f"\n[rm] held-out accuracy by step: {curve}; train {time.perf_counter() - t0:.1f} s")
    return types.SimpleNamespace(tmp=tmp, trainer=trainer, tok=tok, arrays=arrays, result=result, export=export,
                                 before=(c0, r0), after=(c1, r1), curve=curve)


def _hf_scores(hf_model, rows, pad_id):
    """transformers' scores of token-id rows, right-padded with pad_id."""
    import torch

    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=mask).logits[:, 0].double().numpy()


def _load_hf_classifier(path):
    import torch
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()  # sdpa: no soft-cap


# ------------------------------------------------------------------------------------------ learning


def test_learns_the_hidden_rule(run):
    acc0, acc = run.curve[0][1], run.curve[-1][1]
    assert [s for s, _ in run.curve] == [0, 10, 20]
    assert 0.2 <= acc0 <= 0.8, f"an untrained head should rank about half the pairs right, got {acc0}"
    assert acc >= 0.9, f"held-out accuracy after {STEPS} steps: {run.curve}"
    c1, r1 = run.after
    assert np.mean(c1 > r1) == pytest.approx(acc), "eval_accuracy must be the accuracy of the final model"
    r = run.result
    assert r["eval_loss"] < 0.5 * np.log(2) and r["eval_margin"] > 0
    assert r["eval_rewards/chosen"] > r["eval_rewards/rejected"]


def test_lora_trains_adapters_and_head_and_export_merges(run):
    """Under LoRA the trainable state is the adapters and the score head; export_run of such a
    run merges the adapters, and transformers scores the export as posttrain scores the unmerged model."""
    cfg = _config(run.tmp, lora={"enabled": True, "rank": 4}, run_name="lora_run")
    model = build_reward_model(cfg, run.tok)
    assert model.lm_head is None  # a sequence classifier has no LM head
    params = nnx.state(model, trainable_filter(cfg))
    flat = dict(nnx.to_flat_state(params))
    assert {type(v) for v in flat.values()} == {LoraParam, ScoreParam} and ("score",) in flat
    # Stand in for training: random adapters (B is zero at init) and head, saved as a run would be.
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32), params))
    C.save(cfg, Path(cfg.run_dir) / "config.yaml")
    save_state(nnx.state(model, trainable_filter(cfg)), str(Path(cfg.run_dir) / WEIGHTS))
    out = export_run(cfg.run_dir, str(run.tmp / "lora_export"))
    pairs = run.trainer.eval_pairs[:8]
    ours_c, ours_r = _jit_scores(model, run.tok.pad_id)(model, {k: v[:8] for k, v in run.arrays.items()})
    hf = _load_hf_classifier(out)
    ref_c = _hf_scores(hf, [list(p.prompt) + list(p.chosen) for p in pairs], run.tok.pad_id)
    ref_r = _hf_scores(hf, [list(p.prompt) + list(p.rejected) for p in pairs], run.tok.pad_id)
    err = max(np.abs(ours_c - ref_c).max(), np.abs(ours_r - ref_r).max())
    print(f"\n[rm] LoRA (unmerged, prefix-shared) vs merged export in transformers: max |Δ| = {err:.2e} "
          f"(scores ~{np.abs(ref_c).mean():.2f})")
    assert err <= 1e-4 and np.abs(ref_c).max() > 0.1


# ------------------------------------------------------------------------------------------ export + parity


def test_export_is_a_transformers_sequence_classifier(run):
    cfg = json.load(open(Path(run.export) / "config.json"))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    assert cfg["pad_token_id"] == run.tok.pad_id and len(cfg["id2label"]) == 1
    from safetensors import safe_open

    with safe_open(str(Path(run.export) / "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
    assert "score.weight" in keys and not any(k.startswith("lm_head") for k in keys)
    with pytest.raises(PosttrainError, match="head='score'"):  # read as a causal LM: no lm_head, a clear error
        from_pretrained(run.export)


def test_exported_scores_equal_transformers_and_prefix_sharing(run):
    pairs = run.trainer.eval_pairs
    hf = _load_hf_classifier(run.export)
    assert hf.config.num_labels == 1
    chosen_rows = [list(p.prompt) + list(p.chosen) for p in pairs]
    rejected_rows = [list(p.prompt) + list(p.rejected) for p in pairs]
    ref_c, ref_r = _hf_scores(hf, chosen_rows, run.tok.pad_id), _hf_scores(hf, rejected_rows, run.tok.pad_id)
    shared_c, shared_r = run.after
    err = max(np.abs(shared_c - ref_c).max(), np.abs(shared_r - ref_r).max())
    print(f"\n[rm] prefix-shared (posttrain) vs transformers: max |Δ| = {err:.2e} (scores ~{np.abs(ref_c).mean():.2f})")
    assert err <= 1e-4

    rm = RewardModel(run.export, batch_size=16)
    rows = make_rows(48, seed=11)  # the eval file's text
    unshared_c = rm.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    unshared_r = rm.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert unshared_c.dtype == np.float32 and unshared_c.shape == (48,)
    assert np.abs(unshared_c - ref_c).max() <= 1e-4 and np.abs(unshared_r - ref_r).max() <= 1e-4
    err_shared = max(np.abs(unshared_c - shared_c).max(), np.abs(unshared_r - shared_r).max())
    print(f"[rm] prefix-shared vs unshared rows: max |Δ| = {err_shared:.2e}")
    assert err_shared <= 1e-5
    assert np.mean(unshared_c > unshared_r) >= 0.9


def test_loss_and_metrics_equal_trl(run):
    """Our loss_fn on prefix-shared rows == TRL RewardTrainer.compute_loss on the exported transformers model."""
    import torch
    from trl.trainer.reward_trainer import RewardTrainer

    pairs, tok = run.trainer.eval_pairs[:12], run.tok
    hf = _load_hf_classifier(run.export)
    rows = [list(p.prompt) + list(p.chosen) for p in pairs] + [list(p.prompt) + list(p.rejected) for p in pairs]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    margin = np.array([p.margin for p in pairs], np.float32)
    assert len(set(margin)) > 1  # the margin column varies, so dropping it would show
    batch = {k: v[:12] for k, v in run.arrays.items()}
    variants = [dict(use_margin=True, center_coefficient=None), dict(use_margin=True, center_coefficient=0.05),
                dict(use_margin=False, center_coefficient=None)]
    graphdef, state = nnx.split(run.trainer.model)
    scores = functools.partial(pair_scores, pad_id=tok.pad_id)
    ours = jax.jit(lambda st, b: [make_reward_loss(scores, **v)(nnx.merge(graphdef, st), b)
                                  for v in variants])(state, batch)  # one compile for the three
    for (total, m), v in zip(ours[:2], variants):
        coef = v["center_coefficient"]
        metrics = defaultdict(lambda: defaultdict(list))
        acc = types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
        self = types.SimpleNamespace(model=types.SimpleNamespace(training=True), accelerator=acc, _metrics=metrics,
                                     args=types.SimpleNamespace(center_rewards_coefficient=coef),
                                     _total_train_tokens=0, _tp_size=1)
        model = lambda margin=None, **kw: hf(**kw)  # noqa: E731  (TRL passes the margin column along)
        with torch.no_grad():
            ref = RewardTrainer.compute_loss(self, model, {"input_ids": ids, "attention_mask": mask,
                                                           "margin": torch.from_numpy(margin)}).item()
        assert float(m["denom"]) == 12
        assert float(total) / 12 == pytest.approx(ref, abs=2e-5), coef
        assert float(m["accuracy"]) / 12 == pytest.approx(metrics["train"]["accuracy"][-1], abs=1e-6)
        assert float(m["margin"]) / 12 == pytest.approx(metrics["train"]["margin"][-1], abs=2e-5)
    assert abs(float(ours[2][0]) - float(ours[0][0])) > 1e-3  # use_margin=False drops the margin


# ------------------------------------------------------------------------------------------ HF folders


def test_random_gemma2_score_head_round_trips_to_transformers(tmp_path):
    from hf_models import make_checkpoint

    src = make_checkpoint("gemma2", tmp_path / "lm")
    model = attach_score_head(from_pretrained(src), seed=3)
    save_pretrained(model, str(tmp_path / "cls"), pad_token_id=0)
    hf = _load_hf_classifier(str(tmp_path / "cls"))
    assert type(hf).__name__ == "Gemma2ForSequenceClassification"
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(3, 97, n)) for n in (5, 11, 8, 3)]  # lengths > the sliding window (4)
    ref = _hf_scores(hf, rows, 0)
    T = 12
    tokens = np.zeros((4, T), np.int32)
    seg = np.zeros((4, T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], seg[i, :len(r)] = r, 1
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(st):
        m = nnx.merge(graphdef, st)
        out = m(tokens, np.broadcast_to(np.arange(T), (4, T)), segment_ids=seg, return_hidden=True,
                return_logits=False)
        return last_token_scores(m, out.hidden[-1], score_index(tokens, seg, pad_id=0))[:, 0]

    ours = np.asarray(forward(state))
    print(f"\n[rm] gemma2 score head vs transformers: max |Δ| = {np.abs(ours - ref).max():.2e}")
    assert np.abs(ours - ref).max() <= 1e-4
    back = dict(nnx.to_flat_state(nnx.state(from_pretrained(str(tmp_path / "cls"), head="score"), nnx.Param)))
    want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert back.keys() == want.keys() and ("score",) in back  # read back: every tensor, the head included
    assert all(np.array_equal(back[k][...], want[k][...]) for k in want)


def test_reward_model_scores_a_transformers_classifier(tmp_path):
    """A LlamaForSequenceClassification saved by transformers (pad_token_id = eos, as many Llama
    checkpoints), scored by RewardModel as transformers scores the same ids."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                      pad_token_id=tok.eos_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    hf = LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)  # a head large enough that the scored slot matters
    hf.save_pretrained(tmp_path / "cls")
    tok.save_pretrained(tmp_path / "cls")
    prompts = ["Review the soup:", "Q: 2+2?", "Hi", "Review the film:"]
    completions = [" great, kind, warm.", " 4", " there, friend", [{"role": "assistant", "content": "x"}]]
    prompts[3] = [{"role": "user", "content": prompts[3]}]
    rm = RewardModel(str(tmp_path / "cls"), batch_size=2)  # one 32-token bucket
    ours = rm.score(prompts, completions)
    rows = [tokenize_completion(tok, p, c) for p, c in zip(prompts, completions)]
    assert rows[0][-1] == tok.eos_id  # eos appended to plain strings
    ref = _hf_scores(hf, rows, tok.eos_id)
    print(f"\n[rm] RewardModel vs transformers LlamaForSequenceClassification: max |Δ| = "
          f"{np.abs(ours - ref).max():.2e}")
    assert np.abs(ours - ref).max() <= 1e-4
    # Scored before the trailing eos (pad = eos): appending more eos changes nothing, as in transformers.
    again = rm.score(prompts[:1], [completions[0] + "<eos><eos>"])
    assert again[0] == pytest.approx(ours[0], abs=1e-5)
    assert rm.score([], []).shape == (0,)
    with pytest.raises(PosttrainError, match="completions"):
        rm.score(prompts, completions[:2])


def test_tokenize_completion_matches_the_trainer_rows():
    tok = byte_tokenizer()
    rows = make_rows(4, seed=5) + [{"prompt": [{"role": "user", "content": "hi"}],
                                    "chosen": [{"role": "assistant", "content": "hello"}],
                                    "rejected": [{"role": "assistant", "content": "go away"}]}]
    for row in rows:
        p, c, r, _ = tokenize_pair(row, "row", tok)
        assert tokenize_completion(tok, row["prompt"], row["chosen"]) == p + c
        assert tokenize_completion(tok, row["prompt"], row["rejected"]) == p + r


def test_pair_shapes_of_the_shipped_tiny_data():
    pairs, counts = load_pairs(REPO / "tests" / "data" / "pref_tiny.jsonl", byte_tokenizer(), max_length=64)
    assert counts["rows"] == 40 and len(pairs) == 40 and counts["skipped"] == 0
    assert pair_shapes(pairs)[0] <= 64 + 32
