"""Supervised fine-tuning recipe: data + `sft_loss` over the shared train step and lifecycle.

`SFTTrainer(config).train()` (or `posttrain sft --config ...`): loads the tokenizer, data and
model (every user error is raised before the run folder is created, so a bad config leaves
nothing half-written), optionally attaches LoRA adapters (then only they train), builds the
train state and step, and hands them with the batch iterator and the eval loss to
`train.lifecycle.run_trainer`, which writes `run_dir` (config.yaml, metrics.jsonl,
`trainable.safetensors`: the adapters only with LoRA, Orbax checkpoints under `checkpoints/`),
resumes a re-run of the same command exactly, and splits the work over processes
(`posttrain sft --distributed`: a mesh preset required; process 0 writes and prints).
`export_run(run_dir, out)` turns a run into a Hugging Face folder (LoRA merged).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.data import batches, load_examples, to_arrays
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.models import Transformer, count_params, from_pretrained, load_config, preset, save_pretrained
from posttrain.models.lora import LoraParam, apply_lora, merge_lora, trainable_fraction
from posttrain.plan import format_plan, plan
from posttrain.tokenizer import Tokenizer, byte_tokenizer
from posttrain.train import make_train_step, merge
from posttrain.train.lifecycle import WEIGHTS, check_processes, make_eval, run_trainer, training_state
from posttrain.train.metrics import model_flops_per_token
from posttrain.train.serialize import load_state


def build_tokenizer(mc) -> Tokenizer:
    if mc.path:  # the model folder first: a missing folder or a broken config.json is named as such
        load_config(mc.path, mc.text_only)
    if mc.tokenizer:
        return Tokenizer.from_pretrained(mc.tokenizer)
    if mc.path:
        return Tokenizer.from_pretrained(mc.path)
    return byte_tokenizer()


def build_mesh(sc):
    """(mesh, rules) of a ShardingSection, or (None, None) for one device."""
    if sc.preset is None:
        return None, None
    return sh.make_mesh(sc.preset, shape=sc.mesh_shape), sh.preset_rules(sc.preset)


def preset_config(mc, tok: Tokenizer):
    """The ModelConfig of a preset model section: vocabulary sized to the tokenizer, dtypes, remat."""
    return preset(mc.preset, vocab_size=tok.vocab_size, param_dtype=mc.dtype,
                  dtype=mc.compute_dtype or mc.dtype, remat=mc.remat)


def memory_plan(c, model_cfg, mesh_shape: dict) -> dict:
    """`plan.plan` for a training config: one micro-batch, the config's preset, LoRA and remat."""
    kv = 0  # KV-cache tokens: only RL samples while training
    if hasattr(c, "grpo") or hasattr(c, "ppo"):  # an RL row: the prompt once, then its n completions
        rl = c.grpo if hasattr(c, "grpo") else c.ppo  # (PPO's critic, a second model, is not counted)
        env = getattr(c, "env", None)  # an agentic episode takes up to env.max_tokens slots of its row
        width = env.max_tokens if env is not None and env.enabled else rl.max_new_tokens
        seq = c.data.max_prompt_length + rl.num_generations * width
        kv = c.train.batch_size * rl.num_generations * (c.data.max_prompt_length + width)  # the sampler's cache
    elif hasattr(c, "dpo") or hasattr(c, "rm"):  # a pair row [prompt | chosen | rejected]: at most
        seq = 2 * c.data.max_length - 1  # prompt + the longer answer, plus the other answer
    else:
        seq = c.data.max_length
    return plan(model_cfg, batch=c.train.micro_batch_size or c.train.batch_size, seq_len=seq, kv_cache_tokens=kv,
                mesh_shape=mesh_shape, preset=c.sharding.preset or "dp",
                trainable="lora" if c.lora.enabled else "full", remat=c.model.remat, lora_rank=c.lora.rank,
                lora_targets=c.lora.targets)


def build_model(mc, tok: Tokenizer, lora=None, mesh=None, rules=None) -> nnx.Module:
    """The policy: a HF folder or a randomly initialised preset, with LoRA adapters if enabled.

    With a mesh the weights are created / loaded directly sharded."""
    if mc.path:
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules,
                                text_only=mc.text_only)
        model.cfg = model.cfg.replace(remat=mc.remat)
    else:
        cfg = preset_config(mc, tok)
        if mesh is None:
            model = Transformer(cfg, rngs=nnx.Rngs(mc.seed))
        else:
            model = sh.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(mc.seed)), mesh, rules)
    if tok.vocab_size > model.cfg.vocab_size:
        raise PosttrainError(f"model.tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                             f"{model.cfg.vocab_size}; use the model's own tokenizer")
    if lora is not None and lora.enabled:
        apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets,
                   seed=mc.seed)
    return model


class SFTTrainer:
    def __init__(self, config: "C.SFTConfig", *, progress: bool = True):
        self.config = config
        self.progress = progress
        c = config
        # Everything a user can get wrong is checked here, before the run folder exists.
        check_processes(c)
        self.tokenizer = build_tokenizer(c.model)
        fmt = dict(completion_only_loss=c.data.completion_only_loss, assistant_only_loss=c.data.assistant_only_loss)
        self.train_examples, self.data_stats = load_examples(
            c.data.train, self.tokenizer, max_length=c.data.max_length, truncation=c.data.truncation,
            skip_bad_rows=c.data.skip_bad_rows, **fmt)
        self.eval_examples = None
        if c.data.eval:
            self.eval_examples, _ = load_examples(c.data.eval, self.tokenizer, max_length=c.data.max_length,
                                                  truncation=c.data.truncation, skip_bad_rows=c.data.skip_bad_rows,
                                                  **fmt)
        if c.train.eval_every and not c.data.eval:
            raise PosttrainError("train.eval_every is set but data.eval is not; give data.eval=FILE or set "
                                 "train.eval_every=0")
        self.mesh, self.rules = build_mesh(c.sharding)
        self.model = build_model(c.model, self.tokenizer, c.lora, self.mesh, self.rules)
        if c.data.max_length > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_length={c.data.max_length} exceeds the model's maximum position "
                                 f"{self.model.cfg.max_position}; lower data.max_length")
        self.trainable = LoraParam if c.lora.enabled else nnx.Param
        self.loss_fn = sft_loss

    def train(self) -> dict:
        """Train (or resume) in run_dir, see `run_trainer`; afterwards `self.model` holds the trained weights."""
        c, tok = self.config, self.tokenizer
        n_params = count_params(self.model)
        frac = trainable_fraction(self.model) if c.lora.enabled else 1.0
        graphdef, state, optimizer, lr = training_state(c, self.model, trainable=self.trainable, mesh=self.mesh,
                                                        rules=self.rules)
        micro = c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size)
        step = make_train_step(self.loss_fn, optimizer, graphdef, micro_batches=micro,
                               schedule=lr, trainable=self.trainable,
                               mesh=self.mesh, rules=self.rules)
        data = iter(batches(self.train_examples, batch_size=c.train.batch_size, seq_len=c.data.max_length,
                            pad_id=tok.pad_id, packing=c.data.packing, seed=c.data.seed, shuffle=c.data.shuffle))
        evaluate = None
        if self.eval_examples is not None:
            evaluate = make_eval(self.loss_fn, graphdef,
                                 to_arrays(self.eval_examples, c.data.max_length, tok.pad_id, c.data.packing),
                                 batch_size=c.train.batch_size, mesh=self.mesh, rules=self.rules)

        mesh_shape = dict(self.mesh.shape) if self.mesh is not None else {}
        summary = (f"[sft] {len(self.train_examples)} examples ({self.data_stats}), {n_params:,} parameters, "
                   f"trainable {frac:.2%}\n[sft] memory estimate (as `posttrain plan`):\n"
                   + format_plan(memory_plan(c, self.model.cfg, mesh_shape)))
        state, result = run_trainer(c, state, step, data, name="sft", evaluate=evaluate, mesh=self.mesh,
                                    rules=self.rules, summary=summary, progress=self.progress,
                                    flops_per_token=model_flops_per_token(self.model.cfg, c.data.max_length))
        self.model = merge(graphdef, state)
        return result


def run_config_class(cfg_file: str):
    """The config class of a run's config.yaml, by its trainer's section (ppo, dpo, grpo, distill, rm; else SFT)."""
    import yaml

    try:
        with open(cfg_file) as fh:
            raw = yaml.safe_load(fh) or {}
        keys = set(raw)
        data = raw.get("data") or {}
    except (OSError, yaml.YAMLError, TypeError, AttributeError):
        return C.SFTConfig  # C.load reports the unreadable file with its location
    if "ppo" in keys:  # before the GRPO guess below: a PPO config has the same data section
        from posttrain.trainers.ppo import PPOConfig

        return PPOConfig
    if "grpo" not in keys and isinstance(data, dict) and "max_prompt_length" in data and "max_length" not in data:
        keys.add("grpo")  # a GRPO config that keeps every grpo default
    if "dpo" in keys:
        from posttrain.trainers.dpo import DPOConfig

        return DPOConfig
    if "grpo" in keys:
        from posttrain.trainers.grpo import GRPOConfig

        return GRPOConfig
    if "teacher" in keys or "distill" in keys:
        from posttrain.trainers.distill import DistillConfig

        return DistillConfig
    if "rm" in keys:
        from posttrain.trainers.reward_model import RMConfig

        return RMConfig
    return C.SFTConfig


def load_run(run_dir: str):
    """(config, tokenizer, trained model) of a finished run (LoRA adapters still separate)."""
    cfg_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; --run must be a folder written by a posttrain trainer")
    config = C.load(run_config_class(cfg_file), cfg_file)
    tok = build_tokenizer(config.model)
    model = build_model(config.model, tok, config.lora)
    trainable = LoraParam if config.lora.enabled else nnx.Param
    if hasattr(config, "ppo"):  # the weights file holds the policy and its critic (or value head)
        from posttrain.trainers.ppo import ppo_model

        model, trainable = ppo_model(config, tok, model)
    if getattr(getattr(config, "distill", None), "projection", False):  # trained with the student, not exported
        from posttrain.models import load_config
        from posttrain.trainers.distill import ProjectionParam, attach_projection

        t = config.teacher
        attach_projection(model, (load_config(t.path, t.text_only) if t.path else preset_config(t, tok)).embed_dim)
        trainable = nnx.Any(trainable, ProjectionParam)
    graphdef, params, rest = nnx.split(model, trainable, ...)
    params = load_state(os.path.join(run_dir, WEIGHTS), params)
    return config, tok, nnx.merge(graphdef, params, rest)


def export_run(run_dir: str, out: str, dtype: Optional[str] = None, overwrite: bool = False) -> str:
    """Write a finished run as a Hugging Face folder (LoRA merged into the base weights); a reward
    model as a `*ForSequenceClassification` folder. `out` may not be the run folder (nor hold it, nor be
    inside its own files such as checkpoints/); an existing `out` is replaced only when it is empty or a
    previous export, or with `overwrite` (`models.hf.check_export_target`). Both are checked, and
    `dtype` read (fp16, bf16, ... accepted), before the run is loaded."""
    from posttrain.models.hf import canonical_dtype, check_export_target

    dtype = canonical_dtype(dtype, "--dtype")
    check_export_target(out, overwrite, run_dir=run_dir)
    cfg_file = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(cfg_file) and run_config_class(cfg_file).__name__ == "RMConfig":
        from posttrain.trainers.reward_model import export_rm_run

        return export_rm_run(run_dir, out, dtype, overwrite=overwrite)
    config, tok, model = load_run(run_dir)
    if hasattr(config, "ppo"):  # the policy alone, as a causal LM (a shared value head is dropped)
        model = model.policy
        model.score = nnx.data(None)
    if config.lora.enabled:
        merge_lora(model)
    return save_pretrained(model, out, tokenizer=tok, dtype=dtype, overwrite=overwrite)


def export_run_gguf(run_dir: str, path: str, gguf_type: str = "f32") -> str:
    """Write a finished run as one GGUF file (LoRA merged, as export_run does); a reward model is refused."""
    from posttrain.models.gguf import GGUF_TYPES, export_gguf

    if gguf_type not in GGUF_TYPES:
        raise PosttrainError(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")
    cfg_file = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(cfg_file) and run_config_class(cfg_file).__name__ == "RMConfig":
        raise PosttrainError(f"{run_dir}: a reward model run has a score head, which GGUF cannot hold; export it as "
                             "a Hugging Face folder with --out")
    config, tok, model = load_run(run_dir)
    if hasattr(config, "ppo"):  # the policy alone, as a causal LM
        model = model.policy
        model.score = nnx.data(None)
    if config.lora.enabled:
        merge_lora(model)
    return export_gguf(model, tok, path, gguf_type, name=os.path.basename(os.path.abspath(run_dir)))


def accuracy(model, tok: Tokenizer, pairs, max_new_tokens: int = 8) -> float:
    """Greedy exact-match accuracy of completions for (prompt, answer) string pairs."""
    from posttrain.generate import Sampler, SamplingParams

    prompts = [tok.encode(p) for p, _ in pairs]
    sampler = Sampler(model, max_len=max(len(p) for p in prompts) + max_new_tokens + 16)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                   stop_ids=tok.eos_ids))
    texts = out.texts(tok)
    return float(np.mean([t.strip() == a for t, (_, a) in zip(texts, pairs)]))
