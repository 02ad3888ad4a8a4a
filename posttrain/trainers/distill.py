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
the mesh are `run_trainer`'s; `posttrain export --run` writes the student as a HF folder.

What it is not: multi-teacher distillation, or distillation across tokenizers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain.data import batches, load_examples, to_arrays
from posttrain.data.pipeline import Example
from posttrain.data.prompts import load_prompts
from posttrain.errors import PosttrainError
from posttrain.generate import Sampler, SamplingParams
from posttrain.losses.distill import LOGIT_KINDS, check_layer_map, check_pool_size
from posttrain.losses.distill_step import make_distill_loss
from posttrain.models import count_params
from posttrain.models.lora import LoraParam, trainable_fraction
from posttrain.rl.distill import OnPolicyBatches, teacher_samples
from posttrain.tokenizer import check_same_tokenizer
from posttrain.train import make_train_step, merge
from posttrain.train.lifecycle import check_processes, make_eval, prepare_run_dir, run_trainer, training_state
from posttrain.train.metrics import model_flops_per_token
from posttrain.trainers.dpo import _weights_stamp
from posttrain.trainers.sft import build_mesh, build_model, build_tokenizer

SAMPLES_FILE = "teacher_samples.npz"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSection:
    strategy: tuple[Literal["logit", "attention", "feature"], ...] = ("logit",)  # losses summed; default logit
    temperature: float = 2.0  # τ of the logit loss (τ² scaling); default 2.0
    alpha: float = 0.5  # weight of the distillation term; 1 - alpha goes to CE on the labels; default 0.5
    kind: Literal[LOGIT_KINDS] = "forward_kl"  # forward_kl = KL(teacher‖student), reverse_kl, or jsd
    beta: float = 0.5  # jsd's β (GKD); 0 = forward KL, 1 = reverse KL
    top_k: Optional[int] = None  # restrict the logit loss to the teacher's k largest logits; None = all
    layer_map: dict[int, int] = dataclasses.field(default_factory=dict)  # attention: student -> teacher layer
    attention_kind: Literal["mse", "kl"] = "mse"  # attention-probability loss per query row
    attention_weight: float = 1.0  # weight of the attention loss
    feature_layer_map: dict[int, int] = dataclasses.field(default_factory=dict)  # hidden states (0 = embeddings,
    # L = final, normed) student -> teacher; empty = the final hidden states
    pool_size: Optional[int] = None  # feature: teacher features averaged per pool; None = teacher / student width
    projection: bool = False  # feature: a learned [teacher width, student width] projection instead of pooling
    feature_kind: Literal["l2", "cosine"] = "l2"  # feature loss per token
    feature_weight: float = 1.0  # weight of the feature loss
    chunk_size: int = 256  # positions whose logits are formed at once (memory vs speed); 0 = all at once
    mode: Literal["offline", "teacher_generated", "on_policy"] = "offline"  # where the sequences come from
    lmbda: float = 0.5  # on_policy: fraction of steps on the student's own samples (GKD's λ)
    max_new_tokens: int = 32  # teacher_generated / on_policy: completion budget
    sample_temperature: float = 1.0  # teacher_generated / on_policy sampling temperature; 0 = greedy

    def __post_init__(self):
        if not self.strategy:
            raise PosttrainError("distill.strategy is empty; name at least one of logit, attention, feature")
        if not self.temperature > 0 or not 0 <= self.alpha <= 1 or not 0 <= self.beta <= 1:
            raise PosttrainError("distill.temperature must be > 0, distill.alpha and distill.beta in [0, 1]")
        if "attention" in self.strategy and not self.layer_map:
            raise PosttrainError("distill.strategy has 'attention' but distill.layer_map is empty; map student "
                                 "layers to teacher layers, e.g. {0: 1, 1: 3}")
        if self.projection and self.pool_size is not None:
            raise PosttrainError("distill.projection and distill.pool_size exclude each other; set one")
        if not 0 <= self.lmbda <= 1 or self.chunk_size < 0 or self.max_new_tokens < 1 or self.sample_temperature < 0:
            raise PosttrainError("distill.lmbda must be in [0, 1], distill.chunk_size >= 0, distill.max_new_tokens "
                                 ">= 1 and distill.sample_temperature >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    model: C.ModelSection  # the student (required)
    teacher: C.ModelSection  # the frozen teacher: path or preset; the same tokenizer as the student (required)
    data: C.DataSection  # SFT rows (offline), or prompts (teacher_generated / on_policy) (required)
    distill: DistillSection = dataclasses.field(default_factory=DistillSection)  # losses and data mode
    optim: C.OptimSection = dataclasses.field(default_factory=C.OptimSection)  # AdamW + lr schedule
    lora: C.LoraSection = dataclasses.field(default_factory=C.LoraSection)  # student adapters; off by default
    train: C.TrainSection = dataclasses.field(default_factory=C.TrainSection)  # steps, batch, logging
    checkpoint: C.CheckpointSection = dataclasses.field(default_factory=C.CheckpointSection)  # save / resume
    metrics: C.MetricsSection = dataclasses.field(default_factory=C.MetricsSection)  # metric sinks, MFU
    profile: C.ProfileSection = dataclasses.field(default_factory=C.ProfileSection)  # JAX profiler window
    sharding: C.ShardingSection = dataclasses.field(default_factory=C.ShardingSection)  # device mesh
    run_dir: str = "runs/distill"  # folder for checkpoints, logs, the config and teacher samples


class ProjectionParam(nnx.Param):
    """distill.projection's [teacher width, student width] matrix; trained with the student (also under LoRA)."""


def attach_projection(model, teacher_width: int, seed: int = 0):
    w = 0.02 * jax.random.normal(jax.random.key(seed), (teacher_width, model.cfg.embed_dim), jnp.float32)
    model.distill_projection = ProjectionParam(w, out_sharding=(None, "embed"), eager_sharding=False)
    return model


class DistillTrainer:
    def __init__(self, config: DistillConfig, *, progress: bool = True):
        self.config = c = config
        self.progress = progress
        d = c.distill
        check_processes(c)
        if jax.process_count() > 1 and d.mode != "offline":
            raise PosttrainError(f"distill.mode={d.mode} samples, which runs in one process for now; use "
                                 "mode=offline with --distributed")
        if d.mode == "on_policy" and c.lora.enabled and c.lora.dropout > 0:
            raise PosttrainError("lora.dropout must be 0 with distill.mode=on_policy (the student samples)")
        if c.train.eval_every and not c.data.eval:
            raise PosttrainError("train.eval_every is set but data.eval is not; give data.eval=FILE or set "
                                 "train.eval_every=0")
        self.tokenizer = tok = build_tokenizer(c.model)
        check_same_tokenizer(tok, build_tokenizer(c.teacher), "model.tokenizer and teacher.tokenizer differ: "
                             "distillation compares the models token by token (model.tokenizer=<teacher folder>)")
        self.mesh, self.rules = build_mesh(c.sharding)
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

    def _sampling(self) -> SamplingParams:
        d = self.config.distill
        return SamplingParams(max_new_tokens=d.max_new_tokens, temperature=d.sample_temperature,
                              stop_ids=self.tokenizer.eos_ids)

    def teacher_examples(self) -> list[Example]:
        """The teacher's completions of the prompts: read from run_dir when cached for these prompts,
        this teacher and these sampling settings, else sampled and written (atomically)."""
        c, d = self.config, self.config.distill
        path = os.path.join(c.run_dir, SAMPLES_FILE)
        digest = hashlib.sha256(repr((C.to_dict(c.teacher), _weights_stamp(c.teacher.path), d.max_new_tokens,
                                      d.sample_temperature, c.train.seed)).encode())
        for p in self.prompts:
            digest.update(np.int64(len(p.ids)).tobytes() + p.ids.tobytes())
        key = digest.hexdigest()
        if c.checkpoint.resume and os.path.isfile(path):
            with np.load(path, allow_pickle=False) as f:
                if str(f["key"]) == key:
                    ends = np.cumsum(f["lengths"])
                    return [Example(ids, mask, p.where) for ids, mask, p in
                            zip(np.split(f["ids"], ends[:-1]), np.split(f["mask"], ends[:-1]), self.prompts)]
        out = teacher_samples(self.teacher, self.tokenizer, self.prompts, max_new_tokens=d.max_new_tokens,
                              temperature=d.sample_temperature, seed=c.train.seed)
        tmp = path + ".tmp.npz"
        np.savez(tmp, key=key, ids=np.concatenate([e.ids for e in out]),
                 mask=np.concatenate([e.loss_mask for e in out]), lengths=np.asarray([len(e.ids) for e in out]))
        with open(os.path.join(c.run_dir, "teacher_data.jsonl.tmp"), "w") as fh:  # for people to read
            for p, e in zip(self.prompts, out):
                fh.write(json.dumps({"prompt": p.prompt, "completion": self.tokenizer.decode(
                    e.ids[len(p.ids):], skip_special_tokens=False)}) + "\n")
        os.replace(os.path.join(c.run_dir, "teacher_data.jsonl.tmp"), os.path.join(c.run_dir, "teacher_data.jsonl"))
        os.replace(tmp, path)
        return out

    def setup(self) -> dict:
        c, d, tok = self.config, self.config.distill, self.tokenizer
        if d.mode == "teacher_generated":
            prepare_run_dir(c)  # the samples go into a checked run folder
            self.train_examples = self.teacher_examples()
        frozen_graphdef, frozen = nnx.split(self.teacher)
        graphdef, state, optimizer, lr = training_state(c, self.model, trainable=self.trainable, mesh=self.mesh,
                                                        rules=self.rules)
        micro = c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size)
        raw = make_train_step(self.loss_fn, optimizer, graphdef, micro_batches=micro, schedule=lr,
                              frozen_graphdef=frozen_graphdef, trainable=self.trainable, mesh=self.mesh,
                              rules=self.rules)
        offline = None
        if self.train_examples is not None:
            offline = iter(batches(self.train_examples, batch_size=c.train.batch_size, seq_len=c.data.max_length,
                                   pad_id=tok.pad_id, packing=c.data.packing and d.mode != "on_policy",
                                   seed=c.data.seed, shuffle=c.data.shuffle))
        data = offline
        if d.mode == "on_policy":
            longest = max(len(p.ids) for p in self.prompts)
            sampler = Sampler(self.model, max_len=longest + d.max_new_tokens, pad_id=tok.pad_id, mesh=self.mesh,
                              rules=self.rules, buckets=(longest,))
            data = OnPolicyBatches(offline, self.prompts, sampler, graphdef, batch_size=c.train.batch_size,
                                   seq_len=c.data.max_length, pad_id=tok.pad_id, lmbda=d.lmbda,
                                   params=self._sampling(), seed=c.data.seed, shuffle=c.data.shuffle)
        evaluate = None
        if self.eval_examples:
            arrays = to_arrays(self.eval_examples, c.data.max_length, tok.pad_id, c.data.packing)
            evaluate = make_eval(self.eval_loss_fn, graphdef, arrays,
                                 batch_size=c.train.batch_size, mesh=self.mesh, rules=self.rules, frozen=frozen,
                                 frozen_graphdef=frozen_graphdef)
        return dict(graphdef=graphdef, state=state, raw_step=raw, step=lambda s, b: raw(s, b, frozen), frozen=frozen,
                    batches=data, evaluate=evaluate)

    def train(self) -> dict:
        """Train (or resume) in run_dir, see `run_trainer`; afterwards `self.model` holds the student."""
        c, d = self.config, self.config.distill
        frac = trainable_fraction(self.model) if c.lora.enabled else 1.0
        parts = self.setup()
        n_examples = len(self.train_examples or self.prompts)
        summary = (f"[distill] {n_examples} {'prompts' if self.train_examples is None else 'examples'}, mode "
                   f"{d.mode}, strategy {'+'.join(d.strategy)}; student {count_params(self.model):,} parameters "
                   f"(trainable {frac:.2%}), teacher {count_params(self.teacher):,}")
        L = c.data.max_length  # a step: the student's training FLOPs and the teacher's forward (a third of its)
        flops = model_flops_per_token(self.model.cfg, L) + model_flops_per_token(self.teacher.cfg, L) / 3
        host = getattr(parts["batches"], "metrics", None)
        state, result = run_trainer(c, parts["state"], parts["step"], parts["batches"], name="distill",
                                    evaluate=parts["evaluate"], mesh=self.mesh, rules=self.rules, summary=summary,
                                    progress=self.progress, flops_per_token=flops, host_metrics=host)
        self.model = merge(parts["graphdef"], state)
        return result
