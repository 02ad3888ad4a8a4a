"""Reward-model recipe: a scalar `score` head on the Transformer, trained Bradley–Terry on pairs.

`RMTrainer(config).train()` (or `posttrain rm --config configs/rm_tiny.yaml`): loads the
tokenizer, the preference pairs (`data/preference.py`, TRL's formats, optional "margin"
column) and the model (a HF causal-LM folder or a preset), attaches a score head
(`models/heads.py`, normal(0, initializer_range) from `model.seed`; the LM head is dropped)
and, if enabled, LoRA adapters (then the adapters and the head train: `TRAINABLE_WITH_LORA`).
Each pair is one prefix-shared row [prompt | chosen | rejected] run once; the loss is
`losses/reward.py` (TRL's RewardTrainer loss, with the margin and reward centering options),
and `train.lifecycle.run_trainer` does the rest (run folder, resume, sinks, eval, checkpoints,
`trainable.safetensors`), as for SFT. Eval metrics: eval_loss, eval_accuracy, eval_margin, ...

`export_rm_run(run_dir, out)` writes a finished run as a HF `<Family>ForSequenceClassification`
folder (LoRA merged; num_labels 1; pad_token_id set) that transformers' AutoModelForSequence-
Classification and `posttrain.rewards.RewardModel` load with the same scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from flax import nnx

from posttrain import config as C
from posttrain.data.preference import load_pairs, pair_arrays, pair_batches, pair_shapes
from posttrain.errors import PosttrainError
from posttrain.losses.reward import make_reward_loss
from posttrain.models import count_params, from_pretrained, save_pretrained
from posttrain.models.heads import TRAINABLE_WITH_LORA, attach_score_head
from posttrain.models.lora import apply_lora, merge_lora
from posttrain.plan import format_plan
from posttrain.train import make_train_step, merge
from posttrain.train.lifecycle import WEIGHTS, check_processes, make_eval, run_trainer, training_state
from posttrain.train.metrics import model_flops_per_token
from posttrain.train.serialize import load_state
from posttrain.trainers.sft import build_mesh, build_model, build_tokenizer, memory_plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMSection:
    # weight of TRL's reward centering term coef * mean((r_c + r_r)^2); None = off (e.g. 0.01)
    center_coefficient: Optional[float] = None
    use_margin: bool = True  # subtract the rows' "margin" column inside the sigmoid (TRL: when present)
    # std of the score head's normal init; None = the model folder's initializer_range, else 0.02
    init_std: Optional[float] = None

    def __post_init__(self):
        if self.center_coefficient is not None and not self.center_coefficient >= 0:
            raise PosttrainError(f"rm.center_coefficient must be >= 0 or null (off), got {self.center_coefficient}")
        if self.init_std is not None and not self.init_std >= 0:
            raise PosttrainError(f"rm.init_std must be >= 0 or null, got {self.init_std}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMConfig:
    model: C.ModelSection  # the backbone: a HF causal-LM folder or a preset (required)
    data: C.PreferenceDataSection  # preference pairs (required)
    rm: RMSection = dataclasses.field(default_factory=RMSection)  # margin, centering, head init
    optim: C.OptimSection = dataclasses.field(default_factory=C.OptimSection)  # AdamW + lr schedule
    lora: C.LoraSection = dataclasses.field(default_factory=C.LoraSection)  # adapters (+ the head train)
    train: C.TrainSection = dataclasses.field(default_factory=C.TrainSection)  # steps, batch (pairs), logging
    checkpoint: C.CheckpointSection = dataclasses.field(default_factory=C.CheckpointSection)  # save / resume
    metrics: C.MetricsSection = dataclasses.field(default_factory=C.MetricsSection)  # metric sinks, MFU
    profile: C.ProfileSection = dataclasses.field(default_factory=C.ProfileSection)  # JAX profiler window
    sharding: C.ShardingSection = dataclasses.field(default_factory=C.ShardingSection)  # device mesh
    run_dir: str = "runs/rm"  # folder for checkpoints, logs and the saved config; default runs/rm


def _config_json(path: str) -> dict:
    f = os.path.join(path, "config.json")
    try:
        with open(f) as fh:
            return json.load(fh)
    except OSError as err:
        raise PosttrainError(f"{f}: cannot read it ({err.strerror}); model.path must be a HF folder") from None
    except json.JSONDecodeError as err:
        raise PosttrainError(f"{f}:{err.lineno}: not valid JSON ({err.msg}); fix or re-export the folder") from None


def _init_std(c: RMConfig) -> float:
    if c.rm.init_std is not None:
        return c.rm.init_std
    if c.model.path:  # transformers initialises a new score head with the config's initializer_range
        return float(_config_json(c.model.path).get("initializer_range", 0.02))
    return 0.02


def _is_classifier(path: str) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in _config_json(path).get("architectures") or ())


def build_reward_model(c: RMConfig, tok, mesh=None, rules=None) -> nnx.Module:
    """The backbone (+ LoRA) with a fresh score head, or a reward-model folder's own head when
    model.path is a `*ForSequenceClassification` folder (training continues from it)."""
    mc = c.model
    if mc.path and _is_classifier(mc.path):
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                head="score", text_only=mc.text_only)
        model.cfg = model.cfg.replace(remat=mc.remat)
        if c.lora.enabled:
            apply_lora(model, rank=c.lora.rank, alpha=c.lora.alpha, dropout=c.lora.dropout, targets=c.lora.targets,
                       seed=mc.seed)
        return model
    model = build_model(mc, tok, c.lora, mesh, rules)
    return attach_score_head(model, seed=mc.seed, std=_init_std(c))


def trainable_filter(c: RMConfig):
    return TRAINABLE_WITH_LORA if c.lora.enabled else nnx.Param


class RMTrainer:
    def __init__(self, config: RMConfig, *, progress: bool = True):
        self.config = c = config
        self.progress = progress
        check_processes(c)  # every user error is raised before the run folder exists
        self.tokenizer = tok = build_tokenizer(c.model)
        kw = dict(max_length=c.data.max_length, max_prompt_length=c.data.max_prompt_length,
                  truncation=c.data.truncation, skip_bad_rows=c.data.skip_bad_rows)
        self.train_pairs, self.data_stats = load_pairs(c.data.train, tok, **kw)
        self.eval_pairs = load_pairs(c.data.eval, tok, **kw)[0] if c.data.eval else None
        if c.train.eval_every and not c.data.eval:
            raise PosttrainError("train.eval_every is set but data.eval is not; give data.eval=FILE or set "
                                 "train.eval_every=0")
        self.length, self.score_length = pair_shapes(self.train_pairs, *([self.eval_pairs] if self.eval_pairs else []))
        self.mesh, self.rules = build_mesh(c.sharding)
        self.model = build_reward_model(c, tok, self.mesh, self.rules)
        if self.length > self.model.cfg.max_position:
            raise PosttrainError(f"pair rows of {self.length} tokens exceed the model's maximum position "
                                 f"{self.model.cfg.max_position}; lower data.max_length")
        self.trainable = trainable_filter(c)
        self.loss_fn = make_reward_loss(pad_id=tok.pad_id, use_margin=c.rm.use_margin,
                                        center_coefficient=c.rm.center_coefficient)

    def train(self) -> dict:
        """Train (or resume) in run_dir, see `run_trainer`; afterwards `self.model` holds the trained weights."""
        c, tok = self.config, self.tokenizer
        n_params = count_params(self.model)
        frac = count_params(nnx.state(self.model, self.trainable)) / n_params if c.lora.enabled else 1.0
        graphdef, state, optimizer, lr = training_state(c, self.model, trainable=self.trainable, mesh=self.mesh,
                                                        rules=self.rules)
        micro = c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size)
        step = make_train_step(self.loss_fn, optimizer, graphdef, micro_batches=micro, schedule=lr,
                               trainable=self.trainable, mesh=self.mesh, rules=self.rules)
        shapes = dict(length=self.length, score_length=self.score_length, pad_id=tok.pad_id)
        data = iter(pair_batches(self.train_pairs, batch_size=c.train.batch_size, seed=c.data.seed,
                                 shuffle=c.data.shuffle, **shapes))
        evaluate = None
        if self.eval_pairs is not None:
            evaluate = make_eval(self.loss_fn, graphdef, pair_arrays(self.eval_pairs, **shapes),
                                 batch_size=c.train.batch_size, mesh=self.mesh, rules=self.rules)
        mesh_shape = dict(self.mesh.shape) if self.mesh is not None else {}
        summary = (f"[rm] {len(self.train_pairs)} pairs ({self.data_stats}), rows of {self.length} tokens, "
                   f"{n_params:,} parameters, trainable {frac:.2%}\n[rm] memory estimate (as `posttrain plan`, "
                   f"one row per pair):\n" + format_plan(memory_plan(c, self.model.cfg, mesh_shape)))
        state, result = run_trainer(c, state, step, data, name="rm", evaluate=evaluate, mesh=self.mesh,
                                    rules=self.rules, summary=summary, progress=self.progress,
                                    flops_per_token=model_flops_per_token(self.model.cfg, self.length))
        self.model = merge(graphdef, state)
        return result


def load_rm_run(run_dir: str):
    """(config, tokenizer, trained reward model) of a finished run (LoRA adapters still separate)."""
    cfg_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; --run must be a folder written by `posttrain rm`")
    config = C.load(RMConfig, cfg_file)
    tok = build_tokenizer(config.model)
    model = build_reward_model(config, tok)
    graphdef, params, rest = nnx.split(model, trainable_filter(config), ...)
    params = load_state(os.path.join(run_dir, WEIGHTS), params)
    return config, tok, nnx.merge(graphdef, params, rest)


def export_rm_run(run_dir: str, out: str, dtype: Optional[str] = None, overwrite: bool = False) -> str:
    """Write a finished reward-model run as a HF `*ForSequenceClassification` folder (LoRA merged); `out` is
    checked as by `sft.export_run` (never the run folder; an existing folder only if a previous export)."""
    from posttrain.models.hf import canonical_dtype, check_export_target

    dtype = canonical_dtype(dtype, "--dtype")
    check_export_target(out, overwrite, run_dir=run_dir)
    config, tok, model = load_rm_run(run_dir)
    if config.lora.enabled:
        merge_lora(model)
    return save_pretrained(model, out, tokenizer=tok, dtype=dtype, overwrite=overwrite)

