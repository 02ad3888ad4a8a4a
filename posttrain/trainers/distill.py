"""Knowledge-distillation recipe: a frozen teacher, a smaller student, one jitted step for both.

`DistillTrainer(config).train()` (or `posttrain distill --config ...`): loads the student
(`model`, full or LoRA) and the teacher (`teacher`, a HF folder or a preset; they may differ in
depth, width and heads but must share the tokenizer, which is checked), and trains the student
with `losses/distill_step.make_distill_loss`: the teacher's forward runs inside the same jitted
step under stop_gradient (no gradient, no second program), logits are formed in chunks.
Strategies (`distill.strategy`, any combination): logit (τ, α, forward / reverse KL or JSD,
teacher top-k), attention (a student → teacher layer map), feature (hidden states pooled to the
student's width, or a learned projection `distill.projection` trained with the student).
Data modes (`distill.mode`):
  offline            any SFT dataset (`data.train`), distilled on its target tokens;
  teacher_generated  the teacher completes `data.train`'s prompts once (cached in
                     `<run_dir>/teacher_samples.npz`, readable copy `teacher_data.jsonl`), then offline;
  on_policy          GKD: each step, with probability `distill.lmbda`, the student's own samples
                     for the next prompts (from the train state's weights), else the offline batch.
Evaluation on `data.eval`: eval_teacher_kl (KL(teacher‖student) at τ = 1), eval_top1_agreement,
eval_logit_cosine, eval_hidden_cosine (see losses/distill_step.py). Run folder, resume, sinks and
the mesh are the shared driver's (`recipes.recipe`); `posttrain export --run` writes the student as a HF folder.

What it is not: multi-teacher distillation, or distillation across tokenizers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional

import jax
from flax import nnx

from posttrain import config as C
from posttrain.data import batches, load_examples, to_arrays
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.distill import LOGIT_KINDS, check_layer_map, check_pool_size
from posttrain.losses.distill_step import make_distill_loss
from posttrain.models import count_params, load_config
from posttrain.models.lora import LoraParam
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model, build_tokenizer, preset_config, weights_stamp
from posttrain.recipes.recipe import Parts, Recipe
from posttrain.rl.distill import OnPolicyBatches, ProjectionParam, attach_projection, cached_teacher_samples
from posttrain.tokenizer import check_same_tokenizer

SAMPLES_FILE = "teacher_samples.npz"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSection(C.Section):
    key = "distill"

    strategy: tuple[Literal["logit", "attention", "feature"], ...] = ("logit",)  # losses summed; default logit
    temperature: C.Positive = 2.0  # τ of the logit loss (τ² scaling); default 2.0
    alpha: C.Probability = 0.5  # weight of the distillation term; 1 - alpha goes to CE on the labels; default 0.5
    kind: Literal[LOGIT_KINDS] = "forward_kl"  # forward_kl = KL(teacher‖student), reverse_kl, or jsd
    beta: C.Probability = 0.5  # jsd's β (GKD); 0 = forward KL, 1 = reverse KL
    top_k: Optional[C.AtLeast1] = None  # restrict the logit loss to the teacher's k largest logits; None = all
    layer_map: dict[int, int] = dataclasses.field(default_factory=dict)  # attention: student -> teacher layer
    attention_kind: Literal["mse", "kl"] = "mse"  # attention-probability loss per query row
    attention_weight: C.NonNegative = 1.0  # weight of the attention loss
    # feature: hidden states (0 = embeddings, L = final, normed) student -> teacher; empty = the final ones
    feature_layer_map: dict[int, int] = dataclasses.field(default_factory=dict)
    pool_size: Optional[C.AtLeast1] = None  # feature: teacher features averaged per pool; None = width ratio
    projection: bool = False  # feature: a learned [teacher width, student width] projection instead of pooling
    feature_kind: Literal["l2", "cosine"] = "l2"  # feature loss per token
    feature_weight: C.NonNegative = 1.0  # weight of the feature loss
    chunk_size: C.Count = 256  # positions whose logits are formed at once (memory vs speed); 0 = all at once
    mode: Literal["offline", "teacher_generated", "on_policy"] = "offline"  # where the sequences come from
    lmbda: C.Probability = 0.5  # on_policy: fraction of steps on the student's own samples (GKD's λ)
    max_new_tokens: C.AtLeast1 = 32  # teacher_generated / on_policy: completion budget
    sample_temperature: C.NonNegative = 1.0  # teacher_generated / on_policy sampling temperature; 0 = greedy

    def __post_init__(self):
        super().__post_init__()
        if not self.strategy:
            raise PosttrainError("distill.strategy is empty; name at least one of logit, attention, feature")
        if "attention" in self.strategy and not self.layer_map:
            raise PosttrainError("distill.strategy has 'attention' but distill.layer_map is empty; map student "
                                 "layers to teacher layers, e.g. {0: 1, 1: 3}")
        if self.projection and self.pool_size is not None:
            raise PosttrainError("distill.projection and distill.pool_size exclude each other; set one")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig(C.RunConfig):
    model: C.ModelSection  # the student (required)
    teacher: C.ModelSection  # the frozen teacher: path or preset; the same tokenizer as the student (required)
    data: C.DataSection  # SFT rows (offline), or prompts (teacher_generated / on_policy) (required)
    distill: DistillSection = dataclasses.field(default_factory=DistillSection)  # losses and data mode
    run_dir: str = "runs/distill"  # folder for checkpoints, logs, the config and teacher samples


class DistillTrainer(Recipe):
    name = "distill"
    help = "knowledge distillation of a teacher into a student"
    config_class = DistillConfig

    def check(self) -> None:
        c, d = self.config, self.config.distill
        if jax.process_count() > 1 and d.mode != "offline":
            raise PosttrainError(f"distill.mode={d.mode} samples, which runs in one process for now; use "
                                 "mode=offline with --distributed")
        if d.mode == "on_policy" and c.lora.enabled and c.lora.dropout > 0:
            raise PosttrainError("lora.dropout must be 0 with distill.mode=on_policy (the student samples)")

    def load(self) -> None:
        c, d, tok = self.config, self.config.distill, self.tokenizer
        check_same_tokenizer(tok, build_tokenizer(c.teacher), "model.tokenizer and teacher.tokenizer differ: "
                             "distillation compares the models token by token (model.tokenizer=<teacher folder>)")
        self.model = build_model(c.model, tok, c.lora, self.mesh, self.rules)
        self.teacher = build_model(c.teacher, tok, None, self.mesh, self.rules)
        s, t = self.model.cfg, self.teacher.cfg
        if c.data.max_length > min(s.max_position, t.max_position):
            raise PosttrainError(f"data.max_length={c.data.max_length} exceeds a model's maximum position "
                                 f"(student {s.max_position}, teacher {t.max_position}); lower data.max_length")
        if "attention" in d.strategy:
            check_layer_map(d.layer_map, s.num_layers, t.num_layers, key="distill.layer_map")
        if d.feature_layer_map:  # hidden states: 0 = embeddings .. L = final
            check_layer_map(d.feature_layer_map, s.num_layers + 1, t.num_layers + 1, key="distill.feature_layer_map")
        if "feature" in d.strategy and not d.projection:
            check_pool_size(d.pool_size, s.embed_dim, t.embed_dim, key="distill.pool_size")
        if d.projection:
            attach_projection(self.model, t.embed_dim, seed=c.model.seed)
        self.trainable = nnx.Any(LoraParam, ProjectionParam) if c.lora.enabled else nnx.Param
        fmt = dict(max_length=c.data.max_length, truncation=c.data.truncation, skip_bad_rows=c.data.skip_bad_rows,
                   completion_only_loss=c.data.completion_only_loss, assistant_only_loss=c.data.assistant_only_loss)
        self.prompts = self.train_examples = None
        if d.mode != "offline":
            self.prompts, self.data_stats = load_prompts(c.data.train, tok,
                                                         max_prompt_length=c.data.max_length - d.max_new_tokens,
                                                         skip_bad_rows=c.data.skip_bad_rows)
        if d.mode == "offline" or (d.mode == "on_policy" and d.lmbda < 1):
            self.train_examples, self.data_stats = load_examples(c.data.train, tok, **fmt)
        self.eval_examples = load_examples(c.data.eval, tok, **fmt)[0] if c.data.eval else None
        kw = dict(strategies=d.strategy, temperature=d.temperature, alpha=d.alpha, kind=d.kind, beta=d.beta,
                  top_k=d.top_k, layer_map=d.layer_map, attention_kind=d.attention_kind,
                  attention_weight=d.attention_weight, feature_layer_map=d.feature_layer_map, pool_size=d.pool_size,
                  projection=d.projection, feature_kind=d.feature_kind, feature_weight=d.feature_weight,
                  chunk_size=d.chunk_size)
        # The step skips the held-out metrics' extra passes over the logits; the eval set computes them.
        self.loss_fn = make_distill_loss(**kw, eval_metrics=False)
        self.eval_loss_fn = make_distill_loss(**kw, eval_metrics=True)

    def build(self) -> Parts:
        c, d, tok = self.config, self.config.distill, self.tokenizer
        if d.mode == "teacher_generated":
            self.prepare_run_dir()  # the samples go into a checked run folder
            self.train_examples = cached_teacher_samples(
                os.path.join(c.run_dir, SAMPLES_FILE), (C.to_dict(c.teacher), weights_stamp(c.teacher.path),
                                                        d.max_new_tokens, d.sample_temperature, c.train.seed),
                self.teacher, tok, self.prompts, max_new_tokens=d.max_new_tokens, temperature=d.sample_temperature,
                seed=c.train.seed, reuse=c.checkpoint.resume)

        def data(graphdef):
            offline = None
            if self.train_examples is not None:
                offline = iter(batches(self.train_examples, batch_size=c.train.batch_size, seq_len=c.data.max_length,
                                       pad_id=tok.pad_id, packing=c.data.packing and d.mode != "on_policy",
                                       seed=c.data.seed, shuffle=c.data.shuffle))
            if d.mode != "on_policy":
                return offline
            longest = max(len(p.ids) for p in self.prompts)
            sampler = Sampler(self.model, max_len=longest + d.max_new_tokens, pad_id=tok.pad_id, mesh=self.mesh,
                              rules=self.rules, buckets=(longest,))
            params = SamplingParams(max_new_tokens=d.max_new_tokens, temperature=d.sample_temperature,
                                    stop_ids=tok.eos_ids)
            return OnPolicyBatches(offline, self.prompts, sampler, graphdef, batch_size=c.train.batch_size,
                                   seq_len=c.data.max_length, pad_id=tok.pad_id, lmbda=d.lmbda, params=params,
                                   seed=c.data.seed, shuffle=c.data.shuffle)

        evals = None
        if self.eval_examples:
            evals = lambda: to_arrays(self.eval_examples, c.data.max_length, tok.pad_id, c.data.packing)  # noqa: E731
        L = c.data.max_length  # a step: the student's training FLOPs and the teacher's forward (a third of its)
        n_examples = len(self.train_examples or self.prompts)
        return Parts(
            model=self.model, loss_fn=self.loss_fn, eval_loss_fn=self.eval_loss_fn, trainable=self.trainable,
            frozen=nnx.split(self.teacher), batches=data, eval_arrays=evals,
            flops_per_token=flops_per_token(self.model.cfg, L) + flops_per_token(self.teacher.cfg, L) / 3,
            summary=(f"{n_examples} {'prompts' if self.train_examples is None else 'examples'}, mode {d.mode}, "
                     f"strategy {'+'.join(d.strategy)}; teacher {count_params(self.teacher):,} parameters"))

    @staticmethod
    def done_line(r: dict) -> str:
        line = f"loss {r['first_loss']:.4f} -> {r['loss']:.4f}"
        if "eval_teacher_kl" in r:
            line += (f", held-out KL(teacher||student) {r['eval_teacher_kl']:.4f}, top-1 agreement "
                     f"{r['eval_top1_agreement']:.1%}")
        return line

    @classmethod
    def run_model(cls, config, tok):
        """The student; with distill.projection, the projection it trained with (not exported)."""
        model, trainable = super().run_model(config, tok)
        if config.distill.projection:
            t = config.teacher
            attach_projection(model, (load_config(t.path, t.text_only) if t.path else preset_config(t, tok)).embed_dim)
            trainable = nnx.Any(trainable, ProjectionParam)
        return model, trainable


RECIPE = DistillTrainer
