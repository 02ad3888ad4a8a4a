"""Supervised fine-tuning recipe: data + `sft_loss` over the shared train step and loop.

`SFTTrainer(config).train()` (or `posttrain sft --config ...`): loads the tokenizer, data and
model (every user error is raised before the run folder is created, so a bad config leaves
nothing half-written), optionally attaches LoRA adapters (then only they train), trains, and
writes into `run_dir`: config.yaml, metrics.jsonl, and the trained weights
(`trainable.safetensors`: the adapters only with LoRA). `export_run(run_dir, out)` turns a run
into a Hugging Face folder (LoRA merged).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import config as C
from posttrain.data import batches, load_examples, to_arrays
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.models import Transformer, count_params, from_pretrained, preset, save_pretrained
from posttrain.models.lora import LoraParam, apply_lora, merge_lora, trainable_fraction
from posttrain.tokenizer import Tokenizer, byte_tokenizer
from posttrain.train import init_state, make_optimizer, make_train_step, merge, schedule, train_loop
from posttrain.train.loop import FnHook
from posttrain.train.serialize import load_state, save_state

WEIGHTS = "trainable.safetensors"


def build_tokenizer(mc) -> Tokenizer:
    if mc.tokenizer:
        return Tokenizer.from_pretrained(mc.tokenizer)
    if mc.path:
        return Tokenizer.from_pretrained(mc.path)
    return byte_tokenizer()


def build_model(mc, tok: Tokenizer, lora=None) -> nnx.Module:
    """The policy: a HF folder or a randomly initialised preset, with LoRA adapters if enabled."""
    if mc.path:
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype)
    else:
        cfg = preset(mc.preset, vocab_size=tok.vocab_size, param_dtype=mc.dtype,
                     dtype=mc.compute_dtype or mc.dtype)
        model = Transformer(cfg, rngs=nnx.Rngs(mc.seed))
    if mc.remat:
        model.cfg = model.cfg.replace(remat=True)
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
        self.model = build_model(c.model, self.tokenizer, c.lora)
        if c.data.max_length > self.model.cfg.max_position:
            raise PosttrainError(f"data.max_length={c.data.max_length} exceeds the model's maximum position "
                                 f"{self.model.cfg.max_position}; lower data.max_length")
        self.trainable = LoraParam if c.lora.enabled else nnx.Param
        if os.path.exists(os.path.join(c.run_dir, WEIGHTS)):
            raise PosttrainError(f"run_dir {c.run_dir} already holds a finished run; choose a new run_dir "
                                 "(run_dir=...) or delete the folder")

    def eval_loss(self, graphdef, state) -> float:
        arrays = to_arrays(self.eval_examples, self.config.data.max_length, self.tokenizer.pad_id,
                           self.config.data.packing)
        fn = jax.jit(lambda st, b: sft_loss(merge(graphdef, st), b))
        total = denom = 0.0
        bs = self.config.train.batch_size
        for i in range(0, len(arrays["tokens"]), bs):
            t, m = fn(state, {k: jnp.asarray(v[i:i + bs]) for k, v in arrays.items()})
            total, denom = total + float(t), denom + float(m["denom"])
        return total / max(denom, 1.0)

    def train(self) -> dict:
        c, tok = self.config, self.tokenizer
        t0 = time.perf_counter()
        os.makedirs(c.run_dir, exist_ok=True)
        C.save(c, os.path.join(c.run_dir, "config.yaml"))
        metrics_path = os.path.join(c.run_dir, "metrics.jsonl")
        n_params = count_params(self.model)
        frac = trainable_fraction(self.model) if c.lora.enabled else 1.0
        print(f"[sft] {len(self.train_examples)} examples ({self.data_stats}), {n_params:,} parameters, "
              f"trainable {frac:.2%}")
        optimizer = make_optimizer(c.optim, c.train.steps)
        graphdef, state = init_state(self.model, optimizer, trainable=self.trainable, seed=c.train.seed)
        micro = c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size)
        step = make_train_step(sft_loss, optimizer, graphdef, micro_batches=micro,
                               schedule=schedule(c.optim, c.train.steps), trainable=self.trainable)
        data = batches(self.train_examples, batch_size=c.train.batch_size, seq_len=c.data.max_length,
                       pad_id=tok.pad_id, packing=c.data.packing, seed=c.data.seed, shuffle=c.data.shuffle)
        hooks = []
        result: dict = {}
        if self.eval_examples is not None:
            def evaluate(step_no, st, _m):
                loss = self.eval_loss(graphdef, st)
                result["eval_loss"] = loss
                with open(metrics_path, "a") as fh:
                    fh.write(f'{{"step": {step_no}, "eval_loss": {loss}}}\n')

            hooks.append(FnHook(c.train.eval_every, evaluate))
        if c.train.save_every:
            hooks.append(FnHook(c.train.save_every, lambda s, st, m: save_state(st.params, self._weights())))
        state, history = train_loop(step, state, data, steps=c.train.steps, log_every=c.train.log_every,
                                    metrics_path=metrics_path, hooks=hooks, progress=self.progress)
        save_state(state.params, self._weights())
        self.model = merge(graphdef, state)
        result.update(history[-1] if history else {})
        result.update(first_loss=history[0]["loss"] if history else None, seconds=time.perf_counter() - t0)
        return result

    def _weights(self) -> str:
        return os.path.join(self.config.run_dir, WEIGHTS)


def load_run(run_dir: str):
    """(config, tokenizer, trained model) of a finished run (LoRA adapters still separate)."""
    cfg_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_file):
        raise PosttrainError(f"{cfg_file}: missing; --run must be a folder written by `posttrain sft`")
    config = C.load(C.SFTConfig, cfg_file)
    tok = build_tokenizer(config.model)
    model = build_model(config.model, tok, config.lora)
    trainable = LoraParam if config.lora.enabled else nnx.Param
    graphdef, params, rest = nnx.split(model, trainable, ...)
    params = load_state(os.path.join(run_dir, WEIGHTS), params)
    return config, tok, nnx.merge(graphdef, params, rest)


def export_run(run_dir: str, out: str, dtype: Optional[str] = None) -> str:
    """Write a finished run as a Hugging Face folder (LoRA merged into the base weights)."""
    config, tok, model = load_run(run_dir)
    if config.lora.enabled:
        merge_lora(model)
    return save_pretrained(model, out, tokenizer=tok, dtype=dtype)


def accuracy(model, tok: Tokenizer, pairs, max_new_tokens: int = 8) -> float:
    """Greedy exact-match accuracy of completions for (prompt, answer) string pairs."""
    from posttrain.generate import Sampler, SamplingParams

    prompts = [tok.encode(p) for p, _ in pairs]
    sampler = Sampler(model, max_len=max(len(p) for p in prompts) + max_new_tokens + 16)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                   stop_ids=tok.eos_ids))
    texts = out.texts(tok)
    return float(np.mean([t.strip() == a for t, (_, a) in zip(texts, pairs)]))
