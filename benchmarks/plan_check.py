#!/usr/bin/env python
"""`posttrain plan` against XLA's own memory accounting of the compiled train step.

For the anchor model (full fine-tune, AdamW, batch x seq) on one device: the plan's total
against the compiled step's peak = arguments (parameters, optimizer state, batch) + temporaries
(activations, gradients, workspace) + outputs not aliased to donated arguments, as reported by
`compiled.memory_analysis()`. Writes `plan_total_bytes`, `xla_peak_bytes` and their ratio.

Usage: .venv/bin/python benchmarks/plan_check.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, parse_args, write  # noqa: E402

args = parse_args([(("--remat",), dict(action="store_true"))])

import posttrain  # noqa: E402,F401,I001  (first: CPU XLA defaults before JAX starts)
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402
from posttrain.plan import plan  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402


def main():
    model = from_pretrained(ensure_checkpoint(args))
    if args.remat:
        model.cfg = model.cfg.replace(remat=True)
    B, T = args.batch, args.seq
    opt = optax.adamw(1e-4)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    batch = {"tokens": jnp.ones((B, T), jnp.int32), "targets": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
             "segment_ids": jnp.ones((B, T), jnp.int32), "weights": jnp.ones((B, T), jnp.float32)}
    mem = step.lower(state, batch).compile().memory_analysis()
    xla_peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes \
        - mem.alias_size_in_bytes
    d = plan(model.cfg, batch=B, seq_len=T, mesh_shape={"data": 1}, preset="dp", remat=args.remat)
    res = {"shape": dict(batch=B, seq=T, remat=args.remat), "plan": {k: v for k, v in d.items()
                                                                     if isinstance(v, int)},
           "plan_total_bytes": d["total"], "xla_peak_bytes": xla_peak,
           "xla": {"arguments": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
                   "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes},
           "plan_over_measured": d["total"] / xla_peak}
    print(f"[plan] {d['total'] / 2**20:.1f} MiB planned vs {xla_peak / 2**20:.1f} MiB XLA peak "
          f"(ratio {res['plan_over_measured']:.2f})", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()
