#!/usr/bin/env python
"""The memory plan against XLA's own account of the compiled step, for a TPU topology, ahead of time (no chip).

The programs benchmarks/tpu.py measures on the chip, compiled here for `--target` (default v5e:1x1) with libtpu
importable on any host: nothing is allocated or run. The model, its train state and the batch are abstract
(`nnx.eval_shape` / `jax.eval_shape` / `jax.ShapeDtypeStruct` placed on the topology's device), the model traces
its TPU paths (`jax.default_backend` reads "tpu" while tracing, as in benchmarks/compile_time.py --target).

Sections (--only, comma-separated, compiled one after the other):
  sft:B:T:M:REMAT      `make_train_step(sft_loss)` with the trainer's default optimizer (global-norm clipping at 1.0,
                       then AdamW, constant lr), B rows x T tokens in M micro-batches; REMAT none | full | dots
  lora:B:T:M:REMAT     the same with LoRA rank 16 on every projection (base frozen)
  grpo:P:G:L:N:REMAT   the GRPO update `raw_step` as the trainer's setup() builds it (its loss from the trainer
                       itself, built on a tiny stand-in model: the batch's shapes do not depend on the model's width),
                       P prefix-shared rows of L + G x N tokens (rounded up to 8), beta 0, clipping 1.0 + AdamW
Each line: the section, the plan's parts and total (`posttrain.plan.plan` called as tpu.py calls it), XLA's
argument / output / alias / temp bytes and peak (argument + output - alias + temp), plan_over_xla, compile_s.

Usage (libtpu in /tmp/aot/site here):
  PYTHONPATH=/tmp/aot/site:. TPU_SKIP_MDS_QUERY=1 python benchmarks/plan_tpu.py --only grpo:8:8:128:128:none
  XLA_FLAGS="--xla_dump_to=/tmp/d --xla_dump_hlo_as_text" ...   (XLA's buffer assignment: *buffer-assignment.txt)
"""

import argparse
import json
import os
import tempfile
import time
from unittest import mock

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--only", required=True, help="sections, e.g. sft:1:2048:1:none,grpo:8:8:128:128:full")
ap.add_argument("--preset", default="llama3-1b")
ap.add_argument("--shape", default="", help="ModelConfig fields replaced, e.g. num_layers=4,vocab_size=32768,"
                "tie_embeddings=false")
ap.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype: bfloat16 | float32")
ap.add_argument("--target", default="v5e:1x1", help="the TPU topology to compile for")
ap.add_argument("--device-gib", type=float, default=15.75, help="the device's memory the plan fits to "
                "(`plan(device_bytes=...)`; a v5e chip's bytes_limit: 15.75 GiB)")
ap.add_argument("--jsonl", default=None, help="also append the lines here")
ap.add_argument("--compiler-options", default="", help="XLA build options for every compile, e.g. "
                "xla_tpu_max_hbm_size_mib=65536 (jax's lowered.compile(compiler_options=...))")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from aot import memory, placed, tpu_device  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.config import OptimSection  # noqa: E402
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import Transformer, preset  # noqa: E402
from posttrain.models.lora import LoraParam, apply_lora  # noqa: E402
from posttrain.plan import KEYS, plan  # noqa: E402
from posttrain.train import make_train_step  # noqa: E402
from posttrain.train.optim import make_optimizer  # noqa: E402
from posttrain.train.step import TrainState  # noqa: E402

DEVICE = tpu_device(args.target)
S = jax.ShapeDtypeStruct
DEVICE_BYTES = int(args.device_gib * (1 << 30))


def _value(v: str):
    return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)


SHAPE = {k: _value(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)}
OPTIONS = {k: _value(v) for k, v in (kv.split("=") for kv in args.compiler_options.split(",") if kv)}


def model_config(**kw):
    return preset(args.preset, **{"param_dtype": args.dtype, "dtype": args.dtype, **SHAPE}, **kw)


def remat_kw(remat: str) -> dict:
    return dict(remat=remat != "none", remat_policy="full" if remat == "none" else remat)


def abstract_state(model, opt, trainable):
    """The TrainState of `init_state(model, opt, trainable=...)`, abstract."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    state = jax.eval_shape(lambda p, r: TrainState(jnp.zeros((), jnp.int32), p, r, opt.init(p), jax.random.key(0),
                                                   jnp.zeros((), jnp.int32)), params, rest)
    return graphdef, state


def compile_memory(step, state, batch):
    """Lower `step` (a TrainStep) at abstract, placed arguments with the model's TPU paths; XLA's memory account."""
    t = time.perf_counter()
    with mock.patch("jax.default_backend", lambda: "tpu"):
        if hasattr(step, "stage"):  # a TrainStep: its schedule numbers are arguments too, placed as the rest
            lowered = step.stage.lower(placed(state, DEVICE), placed(batch, DEVICE), None,
                                       placed(step.numbers, DEVICE))
        else:  # a plain jitted step (commits before train/step.TrainStep)
            lowered = step.lower(placed(state, DEVICE), placed(batch, DEVICE), None)
    return memory(lowered.compile(compiler_options=OPTIONS or None)), time.perf_counter() - t


def train(kind, B, T, M, remat):
    cfg = model_config(**remat_kw(remat))
    trainable = nnx.Param
    if kind == "lora":
        model = nnx.eval_shape(lambda: apply_lora(Transformer(cfg, rngs=nnx.Rngs(0)), rank=16, alpha=32.0))
        trainable = LoraParam
    else:
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    opt = make_optimizer(OptimSection(schedule="constant"), 1e-5)  # tpu.py's: clipping 1.0, then AdamW
    graphdef, state = abstract_state(model, opt, trainable)
    step = make_train_step(sft_loss, opt, graphdef, micro_batches=M, trainable=trainable)
    batch = {"tokens": S((B, T), jnp.int32), "targets": S((B, T), jnp.int32), "positions": S((B, T), jnp.int32),
             "segment_ids": S((B, T), jnp.int32), "weights": S((B, T), jnp.float32)}
    mem, secs = compile_memory(step, state, batch)
    p = plan(cfg, batch=B // M, seq_len=T, mesh_shape={"data": 1}, preset="dp", remat=cfg.remat,
             trainable="lora" if kind == "lora" else "full", lora_rank=16, micro_batches=M, device_bytes=DEVICE_BYTES)
    return p, mem, secs, {"batch": B, "seq": T, "micro_batches": M, "remat": remat}


def grpo(P, G, L, N, remat):
    from posttrain import config as C
    from posttrain.data.branches import ROW_FIELDS, SCORE_FIELDS
    from posttrain.train.optim import schedule
    from posttrain.trainers import grpo as gm

    cfg = model_config(**remat_kw(remat))
    tmp = tempfile.mkdtemp(prefix="plan-tpu-")
    with open(os.path.join(tmp, "p.jsonl"), "w") as fh:
        fh.write('{"prompt": "hello"}\n')
    # tpu.py's GRPO config (its steps: --steps 5 + 1; a constant schedule, so the count does not matter)
    gcfg = C.from_dict(gm.GRPOConfig, {
        "model": {"preset": args.preset, "dtype": args.dtype, **remat_kw(remat)},
        "data": {"train": os.path.join(tmp, "p.jsonl"), "max_prompt_length": L},
        "grpo": {"num_generations": G, "max_new_tokens": N, "temperature": 1.0, "beta": 0.0,
                 "rewards": {"last_number": 1.0}},
        "optim": {"lr": 1e-6, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"steps": 6, "batch_size": P}, "run_dir": os.path.join(tmp, "run")})
    # the trainer on a tiny stand-in policy: its loss, trainable filter and rollout do not depend on the width
    tiny = Transformer(cfg.replace(num_layers=1, embed_dim=64, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
                                   vocab_size=512, tie_embeddings=True), rngs=nnx.Rngs(0))
    with mock.patch("posttrain.recipes.rl.build_model", lambda *a, **k: tiny):
        trainer = gm.GRPOTrainer(gcfg, progress=False)
    trainer.longest, trainer.length = L, -(-(L + G * N) // 8) * 8  # tpu.py's prompt bucket and row
    parts = trainer.build()
    c = trainer.config
    assert parts.frozen is None and c.train.micro_batch_size in (None, c.train.batch_size)
    lr = schedule(c.optim, c.train.steps)  # training_state's optimizer, as setup() builds it
    opt = make_optimizer(c.optim, lr)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = abstract_state(model, opt, parts.trainable)
    step = make_train_step(parts.loss_fn, opt, graphdef, micro_batches=1, schedule=lr, trainable=parts.trainable,
                           mesh=trainer.mesh, rules=trainer.rules)
    # the rollout's batch (rl/rollout.py GroupRollout.rows): [P, row] row fields, [P, G N] score fields
    Lr, M = trainer.length, G * N
    batch = {f: S((P, Lr), jnp.int32) for f in ROW_FIELDS}
    batch.update({f: S((P, M), jnp.float32 if f == "score_w" else jnp.int32) for f in SCORE_FIELDS})
    batch["old_logps"] = S((P, M), jnp.float32)
    batch["advantages"] = S((P, G), jnp.float32)
    mem, secs = compile_memory(step, state, batch)
    p = plan(cfg, batch=P, seq_len=Lr, mesh_shape={"data": 1}, preset="dp", remat=cfg.remat,  # tpu.py's call
             device_bytes=DEVICE_BYTES)
    return p, mem, secs, {"prompts": P, "generations": G, "prompt_len": L, "new": N, "remat": remat,
                          "row_tokens": Lr}


def main():
    for section in args.only.split(","):
        name, *rest = section.split(":")
        conv = [int(x) if x.isdigit() else x for x in rest]
        if name in ("sft", "lora"):
            p, mem, secs, info = train(name, *conv)
        elif name == "grpo":
            p, mem, secs, info = grpo(*conv)
        else:
            raise SystemExit(f"unknown section {name!r}")
        line = {"bench": "plan_tpu", "section": section, "target": args.target, "preset": args.preset,
                "shape": SHAPE, "dtype": args.dtype, "jax": jax.__version__, **info,
                "plan": {k: p[k] for k in (*KEYS, "demand", "total", "fitted")}, "xla_memory": mem,
                "plan_over_xla": round(p["total"] / mem["peak"], 4), "compile_s": round(secs, 1),
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "options": OPTIONS}
        print(json.dumps(line), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as fh:
                fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
