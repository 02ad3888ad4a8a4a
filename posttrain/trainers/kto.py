"""Kahneman-Tversky optimisation recipe: unpaired desirable / undesirable completions over the shared lifecycle.

`KTOTrainer(config).train()` (or `posttrain kto --config ...`) trains the policy with
`losses/kto.make_kto_loss` (TRL 1.16 KTOTrainer's "kto" and "apo_zero_unpaired") on TRL's unpaired
rows {"prompt", "completion", "label": true | false} (strings, or lists of messages: the chat
template), or on paired preference rows (`data/preference.py`), unpaired as TRL does (chosen: true,
rejected: false), tokenised as TRL's KTOTrainer (`data/unpaired.py`). A batch row is prefix-shared,
[prompt_i | completion_i | completion_j], j the row before i in its group (train.micro_batch_size rows,
else the batch; the first takes the last's): TRL's mismatched (x, y') pairs for the KL estimate. The
reference is the policy with its LoRA adapters off, else a frozen copy. Metrics: loss, kl and the sums /
counts of `losses/kto.py` (TRL's rewards/chosen = rewards/chosen_sum / count/chosen; the done line prints
the margin); eval_* on data.eval.

What it is not: paired DPO (`trainers/dpo.py`) or BCO (a classifier on the rewards).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import grain
import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain.data.unpaired import kto_rows, load_unpaired
from posttrain.errors import PosttrainError
from posttrain.losses.kto import KTO_LOSS_TYPES, kto_means, make_kto_loss
from posttrain.models.lora import LoraParam
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model
from posttrain.recipes.recipe import Parts, Recipe, lora_reference
from posttrain.train.trainer import frozen_copy


@dataclasses.dataclass(frozen=True, kw_only=True)
class KTODataSection(C.Section):
    key = "data"

    train: str  # unpaired rows {"prompt", "completion", "label"} or preference pairs (.jsonl, .parquet, folder)
    eval: str | None = None  # held-out rows in the same formats; None = no evaluation set
    max_length: C.AtLeast1 = 512  # tokens of prompt + completion (TRL's meaning); default 512
    # rows longer than max_length: raise naming the row, truncate the completion's end (TRL), or drop the row
    truncation: Literal["error", "truncate", "drop"] = "error"
    skip_bad_rows: bool = False  # skip malformed rows (counted, one warning) instead of raising
    shuffle: bool = True  # shuffle rows every epoch; default true
    seed: C.Seed = 0  # shuffle seed; default 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KTOSection(C.Section):
    key = "kto"

    beta: C.Positive = 0.1  # strength of the implicit KL to the reference; default 0.1
    desirable_weight: C.Positive = 1.0  # weight of a desirable row's loss (lambda_D); default 1.0
    undesirable_weight: C.Positive = 1.0  # weight of an undesirable row's loss (lambda_U); default 1.0
    loss_type: Literal[KTO_LOSS_TYPES] = "kto"  # kto | apo_zero_unpaired (TRL 1.16); default kto


@dataclasses.dataclass(frozen=True, kw_only=True)
class KTOConfig(C.RunConfig):
    model: C.ModelSection  # the policy to train (also the reference's initial weights; required)
    data: KTODataSection  # unpaired (or paired) preference rows (required)
    kto: KTOSection = dataclasses.field(default_factory=KTOSection)  # loss type, beta, class weights
    run_dir: str = "runs/kto"  # folder for checkpoints, logs and the saved config


class KTOTrainer(Recipe):
    name = "kto"
    help = "Kahneman-Tversky optimisation (KTO) on unpaired desirable / undesirable completions"
    config_class = KTOConfig

    def check(self) -> None:
        c = self.config
        if c.kto.loss_type == "kto" and (c.train.micro_batch_size or c.train.batch_size) < 2:
            raise PosttrainError("kto.loss_type=kto estimates its KL term from the other rows of a (micro-)batch, so "
                                 "train.batch_size (and train.micro_batch_size) must be at least 2")

    def load(self) -> None:
        c, tok = self.config, self.tokenizer
        rules = dict(max_length=c.data.max_length, truncation=c.data.truncation, skip_bad_rows=c.data.skip_bad_rows)
        self.train_rows, self.data_stats = load_unpaired(c.data.train, tok, **rules)
        self.eval_rows = load_unpaired(c.data.eval, tok, **rules)[0] if c.data.eval else None
        if len(self.train_rows) < c.train.batch_size:
            raise PosttrainError(f"{c.data.train}: {len(self.train_rows)} usable rows are fewer than "
                                 f"train.batch_size={c.train.batch_size}; lower the batch size or add rows")
        every = self.train_rows + (self.eval_rows or [])
        up = lambda n: -(-n // 8) * 8  # noqa: E731
        longest = max(len(x[1]) for x in every)
        kl = c.kto.loss_type == "kto"
        self.shape = dict(length=up(max(len(p) + len(x) for p, x, _ in every) + kl * longest),
                          score_length=up((1 + kl) * longest), pad_id=tok.pad_id, kl=kl)
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules)
        if self.shape["length"] > self.model.cfg.max_position:
            raise PosttrainError(f"a KTO row is {self.shape['length']} tokens (prompt + completion + a KL completion), "
                                 f"more than the model's maximum position {self.model.cfg.max_position}; lower "
                                 "data.max_length")
        self.loss_fn = make_kto_loss(**C.to_dict(c.kto))
        if c.lora.enabled:
            self.loss_fn = lora_reference(self.loss_fn)

    def build(self) -> Parts:
        c, k = self.config, self.config.kto
        group = c.train.micro_batch_size or c.train.batch_size
        ds = grain.MapDataset.range(len(self.train_rows))
        if c.data.shuffle:
            ds = ds.shuffle(seed=c.data.seed)
        ds = ds.repeat(None).batch(c.train.batch_size, drop_remainder=True).map(
            functools.partial(kto_rows, examples=self.train_rows, group=group, **self.shape))
        return Parts(
            model=self.model, loss_fn=self.loss_fn, trainable=LoraParam if c.lora.enabled else nnx.Param,
            frozen=None if c.lora.enabled else frozen_copy(self.model),
            batches=lambda graphdef: iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))),
            eval_arrays=(lambda: kto_rows(np.arange(len(self.eval_rows)), self.eval_rows, group=c.train.batch_size,
                                          **self.shape)) if self.eval_rows else None,
            # the reference forward adds one forward (a third of a training step)
            flops_per_token=flops_per_token(self.model.cfg, self.shape["length"]) * 4 / 3,
            summary=(f"{len(self.train_rows)} rows ({sum(x[2] for x in self.train_rows)} desirable; "
                     f"{self.data_stats}), rows of "
                     f"{self.shape['length']} tokens, loss {k.loss_type} beta {k.beta}, weights "
                     f"{k.desirable_weight}/{k.undesirable_weight}, reference: "
                     f"{'adapters off' if c.lora.enabled else 'frozen copy'}"))

    @staticmethod
    def done_line(r: dict) -> str:
        means = kto_means(r)
        margin = f", reward margin {means['rewards/margins']:.4f}" if "rewards/margins" in means else ""
        return f"loss {r['first_loss']:.4f} -> {r['loss']:.4f}, kl {r.get('kl', 0.0):.4f}{margin}"

    @classmethod
    def plan_rows(cls, c) -> tuple[int, int]:
        return 2 * c.data.max_length - 1, 0  # [prompt | completion | KL completion]


RECIPE = KTOTrainer
