"""Reward-model recipe: a scalar `score` head on the Transformer, trained Bradley–Terry on pairs.

`RMTrainer(config).train()` (or `posttrain rm --config configs/rm_tiny.yaml`): loads the
tokenizer, the preference pairs (`data/preference.py`, TRL's formats, optional "margin"
column) and the model (a HF causal-LM folder or a preset), attaches a score head
(`models/heads.py`, normal(0, initializer_range) from `model.seed`; the LM head is dropped)
and, if enabled, LoRA adapters (then the adapters and the head train: `TRAINABLE_WITH_LORA`).
Each pair is one prefix-shared row [prompt | chosen | rejected] run once (`models.heads.pair_scores`); the
loss is `losses.reward.make_reward_loss` over `per_pair_loss` (TRL's RewardTrainer loss, with the margin
and reward centering options), on the shared driver (`recipes.recipe`: run folder, resume, sinks,
eval, checkpoints, `trainable.safetensors`), as for SFT. Eval metrics: eval_loss, eval_accuracy,
eval_margin, ...

`posttrain export --run` (`runs.export_run`) writes a finished run as a HF
`<Family>ForSequenceClassification` folder (LoRA merged; num_labels 1; pad_token_id set) that
transformers' AutoModelForSequenceClassification and `posttrain.rewards.RewardModel` load with the
same scores.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Optional

from flax import nnx

from posttrain import config as C
from posttrain.data.preference import load_pair_sets, pair_arrays, pair_batches, pair_shapes
from posttrain.errors import PosttrainError
from posttrain.losses.reward import make_reward_loss
from posttrain.models import from_pretrained
from posttrain.models.heads import TRAINABLE_WITH_LORA, attach_score_head, pair_scores
from posttrain.models.lora import apply_lora
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model, is_classifier, numerics
from posttrain.recipes.recipe import Parts, Recipe


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMSection(C.Section):
    key = "rm"

    # weight of TRL's reward centering term coef * mean((r_c + r_r)^2); None = off (e.g. 0.01)
    center_coefficient: Optional[C.NonNegative] = None
    use_margin: bool = True  # subtract the rows' "margin" column inside the sigmoid (TRL: when present)
    # std of the score head's normal init; None = the model folder's initializer_range, else 0.02
    init_std: Optional[C.NonNegative] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMConfig(C.RunConfig):
    model: C.ModelSection  # the backbone: a HF causal-LM folder or a preset (required)
    data: C.PreferenceDataSection  # preference pairs (required)
    rm: RMSection = dataclasses.field(default_factory=RMSection)  # margin, centering, head init
    run_dir: str = "runs/rm"  # folder for checkpoints, logs and the saved config; default runs/rm


def _init_std(c: RMConfig) -> float:
    if c.rm.init_std is not None:
        return c.rm.init_std
    if c.model.path:  # transformers initialises a new score head with the config's initializer_range
        f = os.path.join(c.model.path, "config.json")
        try:
            with open(f) as fh:
                return float(json.load(fh).get("initializer_range", 0.02))
        except (OSError, ValueError) as err:
            raise PosttrainError(f"{f}: cannot read its initializer_range ({err}); model.path must be a HF "
                                 "folder") from None
    return 0.02


def build_reward_model(c: RMConfig, tok, mesh=None, rules=None) -> nnx.Module:
    """The backbone (+ LoRA) with a fresh score head, or a reward-model folder's own head when
    model.path is a `*ForSequenceClassification` folder (training continues from it)."""
    mc = c.model
    if mc.path and is_classifier(mc.path):
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                head="score", text_only=mc.text_only)
        model.cfg = model.cfg.replace(**numerics(mc))
        if c.lora.enabled:
            apply_lora(model, rank=c.lora.rank, alpha=c.lora.alpha, dropout=c.lora.dropout, targets=c.lora.targets,
                       seed=mc.seed)
        return model
    model = build_model(mc, tok, c.lora, mesh, rules)
    return attach_score_head(model, seed=mc.seed, std=_init_std(c))


def trainable_filter(c: RMConfig):
    return TRAINABLE_WITH_LORA if c.lora.enabled else nnx.Param


class RMTrainer(Recipe):
    name = "rm"
    help = "reward model: a score head trained Bradley-Terry"
    config_class = RMConfig
    generates = False  # a score head: no sampled evaluation

    def load(self) -> None:
        c, tok = self.config, self.tokenizer
        self.train_pairs, self.data_stats, self.eval_pairs = load_pair_sets(c.data, tok)
        self.length, self.score_length = pair_shapes(self.train_pairs, *([self.eval_pairs] if self.eval_pairs else []))
        self.model = build_reward_model(c, tok, self.mesh, self.rules)
        if self.length > self.model.cfg.max_position:
            raise PosttrainError(f"pair rows of {self.length} tokens exceed the model's maximum position "
                                 f"{self.model.cfg.max_position}; lower data.max_length")

    def build(self) -> Parts:
        c, tok = self.config, self.tokenizer
        shapes = dict(length=self.length, score_length=self.score_length, pad_id=tok.pad_id)
        return Parts(
            model=self.model, trainable=trainable_filter(c),
            loss_fn=make_reward_loss(functools.partial(pair_scores, pad_id=tok.pad_id),
                                     use_margin=c.rm.use_margin,
                                     center_coefficient=c.rm.center_coefficient),
            batches=lambda graphdef: iter(pair_batches(self.train_pairs, batch_size=c.train.batch_size,
                                                       seed=c.data.seed, shuffle=c.data.shuffle, **shapes)),
            eval_arrays=(lambda: pair_arrays(self.eval_pairs, **shapes)) if self.eval_pairs is not None else None,
            flops_per_token=flops_per_token(self.model.cfg, self.length),
            summary=f"{len(self.train_pairs)} pairs ({self.data_stats}), rows of {self.length} tokens")

    @staticmethod
    def done_line(r: dict) -> str:
        line = f"loss {r['first_loss']:.4f} -> {r['loss']:.4f}"
        return line + (f", held-out accuracy {r['eval_accuracy']:.3f}" if "eval_accuracy" in r else "")

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        return 2 * c.data.max_length - 1, 0  # one row per pair, as DPO's

    @classmethod
    def run_model(cls, config, tok):
        return build_reward_model(config, tok), trainable_filter(config)


RECIPE = RMTrainer
