#!/usr/bin/env python
"""Where the first call's time goes: trace, lower and XLA compile of the sampler's programs and the train step.

Nothing runs: the model and train state are abstract (`nnx.eval_shape` / `jax.eval_shape`), and each jitted
program is taken through `jit(...).trace(args)`, `.lower()` and `.compile()`, timed apart. That makes the real
llama3-1b shape feasible on a CPU (no weights allocated), and the same line runs on a TPU.

Programs: the sampler's prefill and decode (the decode loop: the n-sample repeat, then one `lax.while_loop` a cache
phase, as `Sampler.generate` runs them; benchmarks/tpu.py's `sample:B:P:N` section) and the train step
(`make_train_step(sft_loss)`, benchmarks/tpu.py's `sft:B:T:M:REMAT`).

Usage:
  python benchmarks/compile_time.py                                   # llama3-1b, bfloat16, scan as configured
  python benchmarks/compile_time.py --no-scan --layers 16 --shape embed_dim=256,num_heads=4,num_kv_heads=2,\\
      head_dim=64,mlp_dim=1024,vocab_size=32768                         # small widths, llama3-1b's structure
  python benchmarks/compile_time.py --scan --only train --train 16:2048:16:full
One JSON line per program on stdout (and appended to --jsonl): preset, layers, scan, program, trace_s, lower_s,
compile_s (wall seconds each), total_s, compile_cpu_s (the process's CPU seconds in XLA's compile: steadier than wall
time on a shared machine), hlo_lines (the lowered StableHLO), xla_lines (the optimised HLO), backend.
"""

import argparse
import json
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--preset", default="llama3-1b")
ap.add_argument("--shape", default="", help="ModelConfig fields replaced, e.g. embed_dim=256,vocab_size=32768")
ap.add_argument("--layers", type=int, default=None, help="num_layers (default: the preset's)")
ap.add_argument("--scan", default=None, action=argparse.BooleanOptionalAction,
                help="ModelConfig.scan_layers: --scan forces it on, --no-scan off; default: the config's (off)")
ap.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype")
ap.add_argument("--sample", default="64:128:512", help="B:P:N prompts, prompt bucket, new tokens")
ap.add_argument("--train", default="16:2048:16:none", help="B:T:M:REMAT rows, tokens, micro-batches, remat")
ap.add_argument("--only", default="sample,train", help="sample, train or both")
ap.add_argument("--jsonl", default=None, help="also append the lines here")
ap.add_argument("--target", default=None, help="a TPU topology to compile for ahead of time, e.g. v5e:1x1 "
                "(needs libtpu importable; see above)")
ap.add_argument("--programs", action="store_true", help="sample: the accelerator's program split "
                "(generate/programs.py) instead of the one-program decode")
ap.add_argument("--compiler-options", default="", help="XLA build options for every compile, e.g. "
                "exec_time_optimization_effort=-1.0 (jax's lowered.compile(compiler_options=...))")
ap.add_argument("--decode-kernel", default=None, action=argparse.BooleanOptionalAction,
                help="sample: a TPU's decode steps through the Pallas kernel (attention.DECODE_KERNEL, "
                     "off by default) or the dense XLA path (--no-decode-kernel)")
ap.add_argument("--kv-dtype", default=None, help="sample: the cache's storage dtype, e.g. float8_e4m3fn")
args = ap.parse_args()
if args.decode_kernel is not None:
    import posttrain.models.attention as _attention

    _attention.DECODE_KERNEL = args.decode_kernel

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from aot import memory, placed, tpu_device  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.generate import Sampler  # noqa: E402
from posttrain.generate.programs import Programs  # noqa: E402
from posttrain.generate.sampler import phase_sizes  # noqa: E402
from posttrain.generate.sampling import SamplingParams  # noqa: E402
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import Transformer, preset  # noqa: E402
from posttrain.train import make_train_step  # noqa: E402
from posttrain.train.step import TrainState  # noqa: E402

OPTIONS = {k: float(v) if v.lstrip("-").replace(".", "", 1).isdigit() else v
           for k, v in (kv.split("=") for kv in args.compiler_options.split(",") if kv)}
DEVICE = None
if args.target:  # ahead-of-time for a TPU topology: no chip needed, libtpu is
    from unittest import mock

    DEVICE = tpu_device(args.target)
    mock.patch("jax.default_backend", lambda: "tpu").start()  # the model's TPU paths while tracing


def _value(v: str):
    return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)


def config(**kw):
    shape = {k: _value(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)}
    if args.layers:
        shape["num_layers"] = args.layers
    if args.scan is not None:
        shape["scan_layers"] = args.scan
    return preset(args.preset, param_dtype=args.dtype, dtype=args.dtype, **shape, **kw)


def abstract_model(cfg):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def timed(name, jitted, *a, **kw):
    """Trace, lower and compile `jitted` at these (abstract) arguments; one JSON line."""
    a = a if DEVICE is None else placed(a, DEVICE)
    t0 = time.perf_counter()
    traced = jitted.trace(*a, **kw)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2, c2 = time.perf_counter(), time.process_time()
    compiled = lowered.compile(compiler_options=OPTIONS or None)
    t3, c3 = time.perf_counter(), time.process_time()
    line = {"bench": "compile_time", "program": name, "preset": args.preset, "layers": CFG.num_layers,
            "scan": getattr(CFG, "scan_layers", None), "shape": args.shape, "dtype": args.dtype,
            "trace_s": round(t1 - t0, 3), "lower_s": round(t2 - t1, 3), "compile_s": round(t3 - t2, 3),
            "total_s": round(t3 - t0, 3), "compile_cpu_s": round(c3 - c2, 3),
            "hlo_lines": len(lowered.as_text().splitlines()), "xla_lines": len(compiled.as_text().splitlines()),
            "backend": args.target or jax.default_backend(), "options": OPTIONS, "memory": memory(compiled)}
    print(json.dumps(line), flush=True)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(line) + "\n")
    return traced


class AbstractSampler(Sampler):
    """A Sampler over abstract weights: its transposed head (CPU, tied embeddings) is a shape, not an array."""

    def _set(self, state):
        self._state = state
        self._weights = (state, None if self._head_t is None else jax.eval_shape(self._head_t, state))

    state = property(Sampler.state.fget, _set)


def sample(B, P, N):
    sampler = AbstractSampler(abstract_model(CFG), max_len=P + N, kv_dtype=args.kv_dtype)
    S = jax.ShapeDtypeStruct
    toks = S((B, P), jnp.int32)
    traced = timed("prefill", sampler._prefill, sampler._weights, toks, toks, toks)
    logits, cache = traced.out_info[:2]
    params = SamplingParams(max_new_tokens=N, temperature=0.0)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rest = (S((B,), jnp.int32), key, S((B, 1), jnp.int32), S((B,), jnp.int32))  # next_pos, key, stop, max_new_row
    if not args.programs:
        timed(f"decode ({len(phase_sizes(P, N))} phases)", sampler._decode, sampler._weights, logits, cache, *rest,
              params=params, max_new=N)
        return
    progs = Programs(sampler)  # generate/programs.py's split, each program compiled after the last
    carry, start, leaves = timed("decode first phase", progs.first, sampler._weights, logits, cache, *rest,
                                 params=params, max_new=N).out_info
    _, key, stop, max_new_row = rest
    for size in phase_sizes(P, N)[1:]:
        carry = timed(f"decode phase to {size}", progs.phase, sampler._weights, carry[:3] + carry[4:], carry[3],
                      start, leaves, key, stop, max_new_row, params=params, max_new=N, prompt=P, size=size).out_info


def train(B, T, M, remat):
    cfg = CFG.replace(remat=remat != "none", remat_policy="full" if remat == "none" else remat)
    model = abstract_model(cfg)
    opt = optax.adamw(1e-5)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = jax.eval_shape(lambda p, r: TrainState(jnp.zeros((), jnp.int32), p, r, opt.init(p), jax.random.key(0),
                                                   jnp.zeros((), jnp.int32)), params, rest)
    step = make_train_step(sft_loss, opt, graphdef, micro_batches=M)
    S = jax.ShapeDtypeStruct
    batch = {"tokens": S((B, T), jnp.int32), "targets": S((B, T), jnp.int32), "positions": S((B, T), jnp.int32),
             "segment_ids": S((B, T), jnp.int32), "weights": S((B, T), jnp.float32)}
    timed(f"train_step (M={M}, remat {remat})", step, state, batch)


CFG = config()
for what in args.only.split(","):
    if what == "sample":
        sample(*map(int, args.sample.split(":")))
    elif what == "train":
        B, T, M, remat = args.train.split(":")
        train(int(B), int(T), int(M), remat)
    else:
        raise SystemExit(f"--only: unknown program {what!r} (sample, train)")
