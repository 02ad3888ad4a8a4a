"""Supervised fine-tuning recipe: data + `sft_loss` over the shared train step and loop.

`SFTTrainer(config).train()` (or `posttrain sft --config ...`): loads the tokenizer, data and
model (every user error is raised before the run folder is created, so a bad config leaves
nothing half-written), optionally attaches LoRA adapters (then only they train), trains, and
writes into `run_dir`: config.yaml, metrics.jsonl, and the trained weights
(`trainable.safetensors`: the adapters only with LoRA), plus Orbax checkpoints under
`checkpoints/` (every `checkpoint.every` steps and at the end). Re-running the same command
resumes exactly from the newest readable checkpoint (weights, optimizer, PRNG and the data
iterator's position); `checkpoint.resume=false` starts afresh. `export_run(run_dir, out)` turns a
run into a Hugging Face folder (LoRA merged).

Multi-process (`posttrain sft --distributed`, one process per host, a mesh preset required):
every process reads the same global batch stream and feeds its own contiguous rows of each
batch; process 0 alone writes the run folder (config, metrics, weights) and prints, while all
processes join checkpoint saves and restores (Orbax coordinates them).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from posttrain import config as C
from posttrain import sharding as sh
from posttrain.data import batches, load_examples, to_arrays
from posttrain.errors import PosttrainError
from posttrain.losses import sft_loss
from posttrain.models import Transformer, count_params, from_pretrained, preset, save_pretrained
from posttrain.models.lora import LoraParam, apply_lora, merge_lora, trainable_fraction
from posttrain.plan import format_plan, plan
from posttrain.tokenizer import Tokenizer, byte_tokenizer
from posttrain.train import init_state, make_optimizer, make_train_step, merge, schedule, train_loop
from posttrain.train.checkpoint import Checkpointer
from posttrain.train.loop import FnHook
from posttrain.train.metrics import (
    Profiler,
    make_sinks,
    memory_stats,
    mfu,
    model_flops_per_token,
    peak_flops,
)
from posttrain.train.serialize import load_state, save_state

WEIGHTS = "trainable.safetensors"


def build_tokenizer(mc) -> Tokenizer:
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
    return plan(model_cfg, batch=c.train.micro_batch_size or c.train.batch_size, seq_len=c.data.max_length,
                mesh_shape=mesh_shape, preset=c.sharding.preset or "dp",
                trainable="lora" if c.lora.enabled else "full", remat=c.model.remat, lora_rank=c.lora.rank,
                lora_targets=c.lora.targets)


def build_model(mc, tok: Tokenizer, lora=None, mesh=None, rules=None) -> nnx.Module:
    """The policy: a HF folder or a randomly initialised preset, with LoRA adapters if enabled.

    With a mesh the weights are created / loaded directly sharded."""
    if mc.path:
        model = from_pretrained(mc.path, dtype=mc.dtype, compute_dtype=mc.compute_dtype, mesh=mesh, rules=rules)
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
        n_proc = jax.process_count()
        if n_proc > 1 and c.sharding.preset is None:
            raise PosttrainError(f"{n_proc} processes but sharding.preset is not set; a multi-process run needs a "
                                 "mesh over all processes' devices, e.g. sharding.preset=dp")
        if c.train.batch_size % n_proc:
            raise PosttrainError(f"train.batch_size={c.train.batch_size} must be a multiple of the {n_proc} "
                                 "processes (each feeds an equal share of every global batch)")
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

    def eval_loss(self, graphdef, state) -> float:
        """Token-weighted loss over the eval set; its arrays and jitted loss are built once per run."""
        if getattr(self, "_eval", None) is None or self._eval[0] is not graphdef:
            arrays = to_arrays(self.eval_examples, self.config.data.max_length, self.tokenizer.pad_id,
                               self.config.data.packing)

            def loss(st, b):
                with sh.use_mesh(self.mesh, self.rules):
                    return self.loss_fn(merge(graphdef, st), b)

            self._eval = (graphdef, arrays, jax.jit(loss))
        _, arrays, fn = self._eval
        total = denom = 0.0
        bs = self.config.train.batch_size
        for i in range(0, len(arrays["tokens"]), bs):
            t, m = fn(state, self._place({k: v[i:i + bs] for k, v in arrays.items()}))
            total, denom = total + t, denom + m["denom"]  # summed on the device: one host read at the end
        return float(sh.to_host(total)) / max(float(sh.to_host(denom)), 1.0)

    def _prepare_run_dir(self) -> None:
        """Fresh start, or check that the folder holds this same run (to resume it).

        Every process checks (so all raise alike); process 0 alone writes, the others wait for it."""
        c = self.config
        multi = jax.process_count() > 1
        saved = os.path.join(c.run_dir, "config.yaml")
        if os.path.isfile(saved) and c.checkpoint.resume:
            before = C.to_dict(C.load(C.SFTConfig, saved))
            now = C.to_dict(c)
            before.pop("checkpoint", None)
            now.pop("checkpoint", None)
            if before != now:
                diff = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
                raise PosttrainError(f"{saved}: run_dir holds a run with a different config (sections {diff}); "
                                     "use a new run_dir, or checkpoint.resume=false to start this one afresh")
        if multi:  # nobody still reads config.yaml when process 0 rewrites it
            multihost_utils.sync_global_devices("posttrain:run_dir checked")
        if sh.is_main_process():
            if os.path.isdir(c.run_dir) and not c.checkpoint.resume:
                for name in ("checkpoints", "metrics.jsonl", WEIGHTS, "tensorboard", "profile"):
                    path = os.path.join(c.run_dir, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            os.makedirs(c.run_dir, exist_ok=True)
            C.save(c, saved)
        if multi:
            multihost_utils.sync_global_devices("posttrain:run_dir ready")

    def train(self) -> dict:
        c, tok = self.config, self.tokenizer
        t0 = time.perf_counter()
        main = sh.is_main_process()  # the process that writes files and prints
        self._prepare_run_dir()
        metrics_path = os.path.join(c.run_dir, "metrics.jsonl")
        n_params = count_params(self.model)
        frac = trainable_fraction(self.model) if c.lora.enabled else 1.0
        lr = schedule(c.optim, c.train.steps)
        optimizer = make_optimizer(c.optim, lr)
        graphdef, state = init_state(self.model, optimizer, trainable=self.trainable, seed=c.train.seed)
        if self.mesh is not None:  # optimizer state follows the parameters' shardings
            state = sh.shard_state(state, self.mesh, self.rules)
        micro = c.train.batch_size // (c.train.micro_batch_size or c.train.batch_size)
        step = make_train_step(self.loss_fn, optimizer, graphdef, micro_batches=micro,
                               schedule=lr, trainable=self.trainable,
                               mesh=self.mesh, rules=self.rules)
        data = iter(batches(self.train_examples, batch_size=c.train.batch_size, seq_len=c.data.max_length,
                            pad_id=tok.pad_id, packing=c.data.packing, seed=c.data.seed, shuffle=c.data.shuffle))
        ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), keep=c.checkpoint.keep,
                            async_save=c.checkpoint.async_save)
        start = 0
        restored = ckpt.restore_latest(state) if c.checkpoint.resume else None
        if restored is not None:
            start, state, data_state, _ = restored
            data.set_state(data_state["iterator"])
            _print(f"[sft] resuming {c.run_dir} from the checkpoint at step {start}")
        if main:
            _truncate_jsonl(metrics_path, start)  # a killed attempt may have logged past its last checkpoint
        _print(f"[sft] {len(self.train_examples)} examples ({self.data_stats}), {n_params:,} parameters, "
               f"trainable {frac:.2%}")
        mesh_shape = dict(self.mesh.shape) if self.mesh is not None else {}
        estimate = memory_plan(c, self.model.cfg, mesh_shape)
        _print("[sft] memory estimate (as `posttrain plan`):\n" + format_plan(estimate))
        result: dict = {}
        if start >= c.train.steps:
            ckpt.close()
            _print(f"[sft] {c.run_dir} already finished ({start} steps); nothing to do")
            self.model = merge(graphdef, state)
            return {"step": start, "finished": True, "seconds": time.perf_counter() - t0}

        sinks = make_sinks(c.metrics, c.run_dir, is_main_process=main)
        hooks = []
        if self.eval_examples is not None:
            def evaluate(step_no, st, _m):
                loss = self.eval_loss(graphdef, st)
                result["eval_loss"] = loss
                for sink in sinks:
                    sink.write(step_no, {"eval_loss": loss})

            hooks.append(FnHook(c.train.eval_every, evaluate))

        def save(step_no, st, _m):
            if int(sh.to_host(st.nonfinite)) == 0:  # never checkpoint in the middle of a run of skipped (NaN) steps
                ckpt.save(step_no, st, {"iterator": data.get_state()})

        hooks.append(FnHook(c.checkpoint.every, save))  # also after the last step
        flops = model_flops_per_token(self.model.cfg, c.data.max_length)
        peak = peak_flops(c.metrics)

        def extra(m):
            n_dev = 1 if self.mesh is None else self.mesh.devices.size
            return {"mfu": mfu(m["tokens_per_s"], flops, peak, n_dev), **memory_stats()}

        profiler = None
        if c.profile.start_step:
            profiler = Profiler(c.profile.start_step, c.profile.num_steps, os.path.join(c.run_dir, "profile"))
        try:
            state, history = train_loop(step, state, data, steps=c.train.steps, start_step=start,
                                        log_every=c.train.log_every, sinks=sinks, hooks=hooks,
                                        progress=main and self.progress and "console" in c.metrics.sinks,
                                        max_nonfinite=c.train.max_nonfinite, profiler=profiler,
                                        extra_metrics=extra if main else None,
                                        place_batch=self._place)
        finally:
            ckpt.close()  # waits for an asynchronous save in flight
            for sink in sinks:
                sink.close()
            if profiler is not None:
                profiler.close()
        save_state(state.params, self._weights())  # every process joins; process 0 writes
        self.model = merge(graphdef, state)
        result.update(history[-1] if history else {})
        result.update(first_loss=history[0]["loss"] if history else None, seconds=time.perf_counter() - t0)
        return result

    def _place(self, batch: dict) -> dict:
        """A host batch on the devices: sharded over the mesh's batch axes, or on the default device.

        With several processes each holds the same global batch and places its own contiguous rows."""
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        n, i = jax.process_count(), jax.process_index()
        if n == 1:
            return sh.shard_batch(batch, self.mesh, self.rules)
        rows = len(next(iter(batch.values())))
        if rows % n:
            raise PosttrainError(f"a batch of {rows} rows cannot be split evenly over {n} processes; make "
                                 f"train.batch_size (and the eval set's last, partial batch) a multiple of {n}")
        per = rows // n
        return sh.shard_batch({k: v[i * per:(i + 1) * per] for k, v in batch.items()}, self.mesh, self.rules,
                              process_local=True)

    def _weights(self) -> str:
        return os.path.join(self.config.run_dir, WEIGHTS)


def _print(*args) -> None:
    """print on process 0 only (the one that logs)."""
    if sh.is_main_process():
        print(*args)


def _truncate_jsonl(path: str, last_step: int) -> None:
    """Drop records logged after `last_step` (a killed run logged them; the resumed run logs them again)."""
    if not os.path.isfile(path):
        return
    with open(path) as fh:
        keep = [ln for ln in fh if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)


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
