#!/usr/bin/env python
"""Generation speed on the anchor checkpoint: new tokens/s, greedy, batch x (prompt + new).

Writes `gen_tok_s` (the anchors' key: batch * new / median call time, no early stop) for
--batch, `gen_tok_s_b32` for batch 32, and the cost of n = 8 group sampling of one prompt
against 8 independent prompts (`group8_vs_independent`, time ratio; < 1 means sharing helps).

Usage: .venv/bin/python benchmarks/generate.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, med, parse_args, write  # noqa: E402

args = parse_args([(("--only-batch",), dict(action="store_true", help="only --batch (no batch 32, no groups)"))])

import jax  # noqa: E402
import numpy as np  # noqa: E402

import posttrain  # noqa: E402,F401  (first: sets the CPU XLA defaults before JAX starts)
from posttrain.generate import Sampler, SamplingParams  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402


def timed(sampler, prompts, params, reps):
    t0 = time.perf_counter()
    out = sampler.generate(prompts, params, key=jax.random.key(0))
    first = time.perf_counter() - t0
    ts = []
    for r in range(reps):
        t0 = time.perf_counter()
        out = sampler.generate(prompts, params, key=jax.random.key(r + 1))
        ts.append(time.perf_counter() - t0)
    return out, first, med(ts)


def main():
    ckpt = ensure_checkpoint(args)
    model = from_pretrained(ckpt)
    sampler = Sampler(model, max_len=args.prompt + args.new)
    rng = np.random.default_rng(0)
    res = {"lib": "posttrain", "jax": jax.__version__, "threads": args.threads, "ckpt": ckpt,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "shape": dict(batch=args.batch, prompt=args.prompt, new=args.new)}
    greedy = SamplingParams(max_new_tokens=args.new, temperature=0.0)
    for b, key in ((args.batch, ""),) + (() if args.only_batch else ((32, "_b32"),)):
        prompts = [[1] + rng.integers(3, args.vocab, args.prompt - 1).tolist() for _ in range(b)]
        out, first, s = timed(sampler, prompts, greedy, args.reps)
        assert (out.lengths == args.new).all()
        res[f"gen_call_s{key}"] = s
        res[f"gen_first_call_s{key}"] = first
        res[f"gen_tok_s{key}"] = b * args.new / s["median"]
        print(f"[posttrain generate] {b}x({args.prompt}+{args.new}) {s['median']:.3f} s -> "
              f"{b * args.new / s['median']:.0f} new tok/s (first call {first:.2f} s)", flush=True)
    if args.only_batch:
        return write(res, args.json)
    # group sampling: one prompt x 8 samples vs 8 different prompts, temperature 1
    one = [[1] + rng.integers(3, args.vocab, args.prompt - 1).tolist()]
    eight = [[1] + rng.integers(3, args.vocab, args.prompt - 1).tolist() for _ in range(8)]
    _, _, g = timed(sampler, one, SamplingParams(max_new_tokens=args.new, temperature=1.0, n=8), args.reps)
    _, _, ind = timed(sampler, eight, SamplingParams(max_new_tokens=args.new, temperature=1.0), args.reps)
    res["group8_call_s"], res["independent8_call_s"] = g, ind
    res["group8_vs_independent"] = g["median"] / ind["median"]
    print(f"[posttrain group n=8] {g['median']:.3f} s vs 8 prompts {ind['median']:.3f} s", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()
