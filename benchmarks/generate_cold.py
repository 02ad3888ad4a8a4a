#!/usr/bin/env python
"""The first `Sampler.generate` call of a shape, split or not: its programs compiled (nothing run), or the call.

--split 0: the one-program decode (prefill, then the whole decode, traced, lowered and compiled in turn: what the
first call does on a CPU by default); --split 1: generate/programs.py (prefill and one program a decode phase,
compiled in a thread pool). Run each in a fresh process with the persistent cache off (JAX_ENABLE_COMPILATION_CACHE=
false; pin cores with taskset). One JSON line: compile_s (wall) and compile_cpu_s (the process's CPU seconds, all
threads); with --call instead first_call_s (compile + run) and call_s (a second call: runs only).

Usage: python benchmarks/generate_cold.py --split 1                       # llama3-1b, bfloat16, 64 x 128 + 512
       python benchmarks/generate_cold.py --split 0 --dtype float32 --shape num_layers=16,embed_dim=256,\\
           num_heads=4,num_kv_heads=2,head_dim=64,mlp_dim=1024,vocab_size=8192   (docs/perf_notes.md's CPU figures)
"""

import argparse
import json
import os
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--split", type=int, required=True, help="1: programs.py's concurrent programs, 0: one decode program")
ap.add_argument("--preset", default="llama3-1b")
ap.add_argument("--shape", default="", help="ModelConfig fields replaced, e.g. num_layers=16,embed_dim=256")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--sample", default="64:128:512", help="B:P:N prompts, prompt bucket, new tokens (greedy)")
ap.add_argument("--call", action="store_true", help="time generate's first and second call, not the compile alone "
                "(a CPU takes minutes to run 64 x 512 steps)")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.generate import Sampler, SamplingParams  # noqa: E402
from posttrain.models import Transformer, preset  # noqa: E402

shape = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)}
cfg = preset(args.preset, dtype=args.dtype, param_dtype=args.dtype, **shape)
B, P, N = map(int, args.sample.split(":"))
sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)), max_len=P + N)
sampler.concurrent_compile = bool(args.split)
params = SamplingParams(max_new_tokens=N, temperature=0.0)
toks = jnp.zeros((B, P), jnp.int32)
rest = (jnp.zeros((B,), jnp.int32), jax.random.key(0), jnp.zeros((B, 1), jnp.int32), jnp.full((B,), N, jnp.int32))
line = {"bench": "generate_cold", "split": args.split, "preset": args.preset, "shape": args.shape, "dtype": args.dtype,
        "sample": args.sample, "backend": jax.default_backend(), "cores": len(os.sched_getaffinity(0))}
t, c = time.perf_counter(), time.process_time()
if args.call:
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, P).tolist() for i in range(B)]
    for name in ("first_call_s", "call_s"):
        t = time.perf_counter()
        sampler.generate(prompts, params, key=jax.random.key(0))
        line[name] = round(time.perf_counter() - t, 2)
else:
    if args.split:
        sampler._programs._build((sampler._weights, toks, toks, toks) + rest, params, N, False)
    else:
        traced = sampler._prefill.trace(sampler._weights, toks, toks, toks)
        traced.lower().compile()
        sampler._decode.trace(sampler._weights, *traced.out_info, *rest, params=params, max_new=N).lower().compile()
    line.update(compile_s=round(time.perf_counter() - t, 2), compile_cpu_s=round(time.process_time() - c, 2))
print(json.dumps(line), flush=True)
