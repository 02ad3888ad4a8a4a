"""KTO: the loss against TRL 1.16's own KTOTrainer code (float64), the loss function on a model, the data
(TRL's token ids and KL rotation, bad rows) and the CLI end to end.

TRL reference: `trl/trainer/kto_trainer.py::KTOTrainer._compute_loss(self, model, inputs, return_outputs)`
unbound, `self` a SimpleNamespace with the attributes it reads (its `_compute_kl_logps` bound to it),
`model` a callable returning fixed per-token log-probabilities (what TRL's fused LM head returns: 0 off
the completion), one set for the matched rows and one for the KL rows; the reference log-probabilities
precomputed in `inputs` ("ref_logps", "ref_KL_logps"), as TRL's precompute_ref_log_probs path reads them.
"""

from __future__ import annotations

import json
import math
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import cli
from posttrain.data.unpaired import kto_rows, tokenize_unpaired
from posttrain.losses.kto import KTO_LOSS_TYPES, kto_loss, kto_means, make_kto_loss
from posttrain.models import Transformer, preset
from posttrain.tasks import addition
from posttrain.tokenizer import byte_tokenizer

N, L = 8, 12  # rows, sequence length of the TRL-side token arrays
TOL = 1e-6


@pytest.fixture(scope="module")
def trl():
    import torch  # test dependencies: a missing one is an error, never a silent skip
    from trl.trainer.kto_trainer import KTOTrainer

    return types.SimpleNamespace(torch=torch, KTOTrainer=KTOTrainer)


def _inputs(seed, labels, kl_shift):
    """Per-token log-probs (0 off the completion) of N matched and N KL rows, their sums, reference sums."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in ("", "KL_"):
        lengths = rng.integers(1, L - 3, size=N)
        pos = np.arange(L)[None]
        completion = ((pos >= 3) & (pos < 3 + lengths[:, None])).astype(np.int64)
        tok = -rng.uniform(0.01, 3.0, size=(N, L - 1)) * completion[:, 1:]
        out[key] = dict(tok=tok, logps=tok.sum(1), completion=completion,
                        attention=(pos < 3 + lengths[:, None]).astype(np.int64))
    out[""]["ref"] = out[""]["logps"] + rng.normal(0.0, 4.0, size=N)
    # the KL rows' reference: their mean log-ratio is about kl_shift (> 0: a KL term; < 0: clamped to 0)
    out["KL_"]["ref"] = out["KL_"]["logps"] - kl_shift + rng.normal(0.0, 0.5, size=N)
    out["label"] = np.asarray(labels, bool)
    return out


def _trl_kto(trl, x, *, loss_type, beta, dw, uw):
    """(loss, TRL's logged metrics) from KTOTrainer._compute_loss."""
    torch = trl.torch
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    ids, kl_ids = torch.zeros((N, L), dtype=torch.long), torch.ones((N, L), dtype=torch.long)

    def model(input_ids, **kw):  # TRL calls model(**kwargs, labels=..., fused_lm_head=True)
        tok = t(x["KL_" if input_ids is kl_ids else ""]["tok"])
        return types.SimpleNamespace(log_probs=tok, entropy=torch.zeros_like(tok), mean_logits=torch.zeros_like(tok),
                                     aux_loss=None)

    accel = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda v: v, unwrap_model=lambda m: m)
    self = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=accel, calculate_KL=loss_type == "kto",
        aux_loss_enabled=False, precompute_ref_logps=True, loss_type=loss_type, beta=beta, desirable_weight=dw,
        undesirable_weight=uw, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    self._compute_kl_logps = types.MethodType(trl.KTOTrainer._compute_kl_logps, self)
    inputs = {"input_ids": ids, "attention_mask": t(x[""]["attention"]), "completion_mask": t(x[""]["completion"]),
              "label": t(x["label"]), "ref_logps": t(x[""]["ref"])}
    if loss_type == "kto":
        inputs.update(KL_input_ids=kl_ids, KL_attention_mask=t(x["KL_"]["attention"]),
                      KL_completion_mask=t(x["KL_"]["completion"]), ref_KL_logps=t(x["KL_"]["ref"]))
    loss = trl.KTOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    assert loss.dtype == torch.float64
    return loss.item(), {k: v[-1] for k, v in self._metrics["train"].items()}


def _ours(x, **kw):
    """(loss, metrics as the step logs them: sums / denom, plus kto_means') of the pure function."""
    total, m = kto_loss(*(jnp.asarray(a) for a in (x[""]["logps"], x[""]["ref"], x["label"], x["KL_"]["logps"],
                                                   x["KL_"]["ref"])), **kw)
    assert total.dtype == jnp.float64
    logged = {k: float(v) / float(m["denom"]) for k, v in m.items() if k != "denom"}
    return float(total) / float(m["denom"]), {**logged, **kto_means(logged)}


def _close(a, b, what) -> float:
    err = abs(a - b)
    assert err <= TOL, f"{what}: ours {a!r} TRL {b!r} (|Δ| = {err:.3g})"
    return err


LABELS = {"mixed": [1, 0, 0, 1, 1, 0, 1, 0], "desirable_only": [1] * N, "undesirable_only": [0] * N}


@pytest.mark.parity
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("labels", list(LABELS))
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("beta,kl_shift", [(0.1, 2.0), (0.5, -1.5)])  # a KL term, and one clamped to 0
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_kto_matches_trl(trl, loss_type, beta, kl_shift, weights, labels):
    x = _inputs(seed=int(beta * 10) + 3 * len(labels), labels=LABELS[labels], kl_shift=kl_shift)
    kw = dict(loss_type=loss_type, beta=beta, dw=weights[0], uw=weights[1])
    t_loss, t_metrics = _trl_kto(trl, x, **kw)
    loss, metrics = _ours(x, loss_type=loss_type, beta=beta, desirable_weight=weights[0],
                          undesirable_weight=weights[1])
    errs = [_close(loss, t_loss, "loss")]
    if loss_type == "kto":
        assert (t_metrics["kl"] > 0) == (kl_shift > 0)  # both branches of the clamp are exercised
    names = ["kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"]
    assert set(names) - {"kl"} & set(metrics) == set(names) - {"kl"} & set(t_metrics)  # present for the same classes
    errs += [_close(metrics[name], t_metrics[name], name) for name in names if name in t_metrics]
    print(f"KTO vs TRL 1.16 KTOTrainer._compute_loss: max |Δ| = {max(errs):.3g}")  # float64 round-off, ~1e-15


def test_policy_equals_reference_and_padding_rows():
    """π = π_ref: every row's loss is 1 - σ(0) = 1/2 (times its class weight), the KL and rewards are 0;
    a padding row (mask 0) counts in nothing, the KL mean included."""
    lp = jnp.asarray(np.random.default_rng(0).uniform(-30, -1, size=N))
    labels = jnp.asarray(LABELS["mixed"])
    total, m = kto_loss(lp, lp, labels, lp, lp, desirable_weight=2.0, undesirable_weight=0.5)
    assert float(total) == pytest.approx(0.5 * (2.0 * 4 + 0.5 * 4)) and float(m["kl"]) == 0.0
    mask = jnp.arange(N) < 6
    kl_pol = lp.at[6:].add(100.0)  # a huge log-ratio on the padding rows must not reach the KL
    total2, m2 = kto_loss(lp, lp, labels, kl_pol, lp, mask=mask)
    assert float(m2["denom"]) == 6 and float(m2["kl"]) == 0.0 and float(total2) == pytest.approx(3.0)


def _model(seed):
    tok = byte_tokenizer()
    return Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(seed)), tok


_forward = nnx.jit(lambda model, ids: model(ids, jnp.arange(ids.shape[1])[None]).logits)  # one compile per length


def _completion_logp(model, prompt, completion):
    """Σ log p(completion | prompt) from a plain forward over [prompt | completion] (no branches)."""
    ids = jnp.asarray(np.concatenate([prompt, completion]))[None]
    logits = _forward(model, ids)[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1)
    return float(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(completion)[:, None], axis=-1)))


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_loss_fn_on_a_model_equals_the_pure_function(loss_type):
    """make_kto_loss over prefix-shared rows [prompt | completion | KL completion] equals kto_loss on
    log-probs from plain forwards of the unshared sequences; its gradient is finite and not zero."""
    policy, tok = _model(0)
    ref = _model(1)[0]
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b + (i % 3 == 0)), "label": i % 3 != 0}
            for i, (a, b) in enumerate([(12, 5), (3, 40), (7, 7), (21, 9), (30, 33), (8, 1)])]
    ex = [(np.asarray(p, np.int32), np.asarray(c, np.int32), lab) for r in rows
          for p, c, lab in tokenize_unpaired(r, "row", tok)]
    kl = loss_type == "kto"
    batch = {k: jnp.asarray(v) for k, v in kto_rows(np.arange(6), ex, group=3, length=32, score_length=16,
                                                  pad_id=tok.pad_id, kl=kl).items()}
    loss_fn = make_kto_loss(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8, loss_type=loss_type)
    total, metrics = nnx.jit(lambda m, r, b: loss_fn(m, b, frozen=r))(policy, ref, batch)
    other = [2, 0, 1, 5, 3, 4]  # the KL completion of row i: the previous row of its group of 3, cyclically
    logps = {m: np.array([[_completion_logp(m, p, c), _completion_logp(m, p, ex[other[i]][1])]
                          for i, (p, c, _) in enumerate(ex)]) for m in (policy, ref)}
    want, want_m = kto_loss(*(jnp.asarray(a) for a in (logps[policy][:, 0], logps[ref][:, 0],
                                                        [e[2] for e in ex], logps[policy][:, 1], logps[ref][:, 1])),
                            beta=0.3, desirable_weight=1.2, undesirable_weight=0.8, loss_type=loss_type)
    assert float(total) == pytest.approx(float(want), abs=1e-5)
    for k in want_m:
        assert float(metrics[k]) == pytest.approx(float(want_m[k]), abs=1e-4), k
    grads = nnx.jit(nnx.grad(lambda m, r, b: loss_fn(m, b, frozen=r)[0]))(policy, ref, batch)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves) and any(float(jnp.abs(g).max()) > 0 for g in leaves)


ROWS = [  # TRL's unpaired formats, and a paired row (unpaired into two)
    {"prompt": "12+3=", "completion": "15", "label": True},
    {"prompt": "12+3=", "completion": " 16", "label": False},
    {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}],
     "label": True},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
]


@pytest.mark.parity
def test_tokens_and_kl_rotation_equal_trl_kto_trainer(tmp_path):
    """Token ids as TRL 1.16 KTOTrainer's dataset (string and chat rows, a pair unpaired), and the KL
    completion of each row (TRL rotates by one within each batch) as kto_rows gives it."""
    import transformers
    from datasets import Dataset
    from trl import KTOConfig as TRLConfig
    from trl import KTOTrainer as TRLTrainer

    tok = byte_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    ours = []
    for i, row in enumerate(ROWS):
        if "chosen" in row:  # TRL does not mix formats in one dataset: the pair alone
            args = TRLConfig(output_dir=str(tmp_path / f"o{i}"), report_to=[], max_length=None, use_cpu=True,
                             bf16=False, per_device_train_batch_size=2)
            ds = TRLTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list([row]),
                            processing_class=tok.hf).train_dataset
            got = tokenize_unpaired(row, "pair", tok)
            assert [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in ds] == got
        else:
            ours += tokenize_unpaired(row, f"row {i}", tok)
    plain = [r for r in ROWS if "chosen" not in r]
    args = TRLConfig(output_dir=str(tmp_path / "o"), report_to=[], max_length=None, use_cpu=True, bf16=False,
                     per_device_train_batch_size=2)
    ds = [  # one dataset per row: TRL takes one format per dataset
        TRLTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list([r]),
                     processing_class=tok.hf).train_dataset[0] for r in plain]
    assert [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in ds] == ours
    # The KL rotation: a dataset of 5 string rows, batches of 2 (the last one alone), as TRL builds it.
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i) * (i + 1), "label": i % 2 == 0} for i in range(5)]
    trl_ds = TRLTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=tok.hf).train_dataset
    ex = [(np.asarray(p, np.int32), np.asarray(c, np.int32), lab) for r in rows
          for p, c, lab in tokenize_unpaired(r, "r", tok)]
    batch = kto_rows(np.arange(5), ex, group=2, length=64, score_length=64, pad_id=tok.pad_id, kl=True)
    for i, r in enumerate(trl_ds):
        second = batch["score_tgt"][i][batch["score_branch"][i] == 2]
        assert list(second) == r["KL_completion_ids"], i


def _write(tmp_path, rows, name="rows.jsonl"):
    return addition.write_jsonl(rows, str(tmp_path / name))


def _unpaired(n=24):
    return [{"prompt": f"{i}?", "completion": [" even", " odd"][(i + j) % 2], "label": j == 0}
            for i in range(n // 2) for j in range(2)]


BAD = [  # (row, words the error must contain)
    ({"prompt": "1+1=", "completion": "2"}, "needs 'prompt', 'completion' and 'label'"),
    ({"prompt": "1+1=", "completion": "2", "label": "yes"}, "'label' must be true"),
    ({"prompt": "1+1=", "completion": " ", "label": True}, "completion is empty"),
    ({"prompt": "1+1=", "completion": [{"role": "assistant", "content": "2"}], "label": True}, "must both be strings"),
    ({"prompt": "x" * 40, "completion": "2", "label": True}, "max_length=32"),
]


@pytest.mark.parametrize("k", range(len(BAD)))
def test_bad_row_names_file_line_and_exits_2(tmp_path, capsys, k):
    path = _write(tmp_path, _unpaired(4)[:3] + [BAD[k][0]])
    run = tmp_path / "run"
    rc = cli.main(["kto", "--config", "/dev/null", "model.preset=demo-tiny", f"data.train={path}",
                   "data.max_length=32", f"run_dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:4:" in err and BAD[k][1] in err, err
    assert not run.exists()  # nothing half-written


def test_cli_kto_three_steps_then_export(tmp_path, capsys):
    """3 steps of `posttrain kto` on unpaired rows (eval on paired rows): finite loss, TRL's metric sums,
    run.json names the recipe, `posttrain export` writes the trained policy (the trainer's logits to 1e-5)."""
    train, evals = _write(tmp_path, _unpaired()), _write(tmp_path, [
        {"prompt": f"{i}?", "chosen": [" even", " odd"][i % 2], "rejected": [" odd", " even"][i % 2]}
        for i in range(4)], "pairs.jsonl")
    run = tmp_path / "run"
    rc = cli.main(["kto", "--config", "/dev/null", "model.preset=demo-tiny", f"data.train={train}",
                   f"data.eval={evals}", "data.max_length=32", "train.steps=3", "train.batch_size=8",
                   "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=3", "optim.lr=1e-3",
                   "kto.desirable_weight=1.5", f"run_dir={run}", "metrics.sinks=[jsonl]"])
    assert rc == 0, capsys.readouterr().err
    assert "[kto] done: loss" in capsys.readouterr().out
    logged = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train_rows = [m for m in logged if "loss" in m]
    assert len(train_rows) == 3 and all(math.isfinite(m["loss"]) for m in train_rows)
    first = train_rows[0]  # π = π_ref at step 1: each row's loss is 1/2 times its class weight
    assert first["count/chosen"] + first["count/rejected"] == pytest.approx(1.0)
    assert first["loss"] == pytest.approx(0.5 * (1.5 * first["count/chosen"] + first["count/rejected"]), abs=1e-6)
    assert any("eval_kl" in m and "eval_rewards/chosen_sum" in m for m in logged)
    assert json.load(open(run / "run.json")) == {"recipe": "kto"}
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    # the export holds the trainer's policy: the run resumed from its last checkpoint gives the same logits
    from posttrain import config as C
    from posttrain.models import from_pretrained
    from posttrain.trainers.kto import KTOConfig, KTOTrainer

    trained = KTOTrainer(C.load(KTOConfig, str(run / "config.yaml")), progress=False)
    assert trained.train()["step"] == 3
    ids = jnp.asarray([trained.tokenizer.encode("12 is even")])
    pos = jnp.arange(ids.shape[1])[None]
    np.testing.assert_allclose(from_pretrained(str(tmp_path / "hf"))(ids, pos).logits,
                               trained.model(ids, pos).logits, atol=1e-5)
