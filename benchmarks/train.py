#!/usr/bin/env python
"""Training speed on the anchor checkpoint: full fine-tune, AdamW, batch x seq random tokens.

Same work as the anchors' tunix_bench / hf_bench train step (loss on every next token of
random ids, AdamW lr 1e-4, no clipping), through posttrain's own train step. Writes
`train_tok_s` (the anchors' key), `train_step_s`, model FLOPs per step, the float32 matmul peak
measured in this same process, and `mfu` = achieved FLOP/s / that peak.
Optionally `--profile DIR` writes a jax.profiler trace of 3 steps.

Usage: .venv/bin/python benchmarks/train.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, med, parse_args, write  # noqa: E402

args = parse_args([(("--steps",), dict(type=int, default=5)), (("--profile",), dict(default=None)),
                   (("--micro",), dict(type=int, default=1))])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import count_params, from_pretrained  # noqa: E402
from posttrain.plan import flops_per_token  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402
from posttrain.train.metrics import measure_peak_flops  # noqa: E402


def main():
    ckpt = ensure_checkpoint(args)
    model = from_pretrained(ckpt)
    B, T = args.batch, args.seq
    opt = optax.adamw(1e-4)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef, micro_batches=args.micro)
    rng = np.random.default_rng(0)

    def batch():
        ids = rng.integers(3, args.vocab, (B, T + 1)).astype(np.int32)
        return {"tokens": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
                "positions": jnp.asarray(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))),
                "segment_ids": jnp.ones((B, T), jnp.int32), "weights": jnp.ones((B, T), jnp.float32)}

    t0 = time.perf_counter()
    state, m = step(state, batch())
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    state, m = step(state, batch())
    jax.block_until_ready(m)
    ts = []
    for _ in range(args.reps):
        bs = [batch() for _ in range(args.steps)]
        t0 = time.perf_counter()
        for b in bs:
            state, m = step(state, b)
        jax.block_until_ready(m)
        ts.append((time.perf_counter() - t0) / args.steps)
    s = med(ts)
    peak = measure_peak_flops()
    flops = flops_per_token(model.cfg, T) * B * T
    res = {"lib": "posttrain", "jax": jax.__version__, "threads": args.threads, "ckpt": ckpt,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "n_params": count_params(model),
           "shape": dict(batch=B, seq=T), "train_first_step_s_incl_compile": first, "train_step_s": s,
           "train_tok_s": B * T / s["median"], "train_final_loss": float(m["loss"]),
           "flops_per_step": flops, "matmul_peak_flops": peak, "mfu": flops / s["median"] / peak}
    print(f"[posttrain train] step {s['median'] * 1e3:.1f} ms -> {B * T / s['median']:.0f} tok/s, "
          f"MFU {res['mfu']:.1%} of {peak / 1e9:.0f} GFLOP/s (loss {res['train_final_loss']:.3f})", flush=True)
    if args.profile:
        jax.profiler.start_trace(args.profile)
        for _ in range(3):
            state, m = step(state, batch())
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
    write(res, args.json)


if __name__ == "__main__":
    main()
