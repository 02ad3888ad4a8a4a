#!/usr/bin/env python
"""DPO step time on the anchor checkpoint, same shapes as ../shared/anchors/trl_bench.py.

--batch pairs of (--prompt prompt tokens, --dpo-completion chosen, --dpo-completion rejected),
random ids; full fine-tune, AdamW 1e-5, sigmoid DPO with beta 0.1. Writes `dpo_step_s` (median
step with a reference forward every step, first step dropped; the anchors' key), and the same for
precomputed reference log-probs (`dpo_precomputed_ref_step_s`) and for the unshared layout
(`dpo_unshared_step_s`: chosen and rejected as two rows, the prompt paid twice).
A step = host batch -> device, policy forward + backward, reference forward, AdamW update.

Usage: .venv/bin/python benchmarks/dpo.py --threads 2 --json out.json [--ckpt /tmp/tiny-llama]
       [--variants shared unshared]   (a subset of shared, precomputed, unshared)
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, med, parse_args, write  # noqa: E402

VARIANTS = {"shared": ("dpo_step_s", "shared", False), "precomputed": ("dpo_precomputed_ref_step_s", "shared", True),
            "unshared": ("dpo_unshared_step_s", "unshared", False)}
args = parse_args([(("--dpo-completion",), dict(type=int, default=64)), (("--steps",), dict(type=int, default=6)),
                   (("--variants",), dict(nargs="*", choices=list(VARIANTS), default=list(VARIANTS)))])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain.data.branches import pad_rows, shared_row, unshared_rows  # noqa: E402
from posttrain.losses import dpo_loss  # noqa: E402
from posttrain.losses.dpo import make_dpo_loss  # noqa: E402
from posttrain.losses.logps import branch_logps  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402


def host_batch(rng, layout):
    """One step's host batch of random pairs: shared (one row a pair) or unshared (chosen row, rejected row)."""
    P, C = args.prompt, args.dpo_completion
    pairs = [([1] + rng.integers(3, args.vocab, P - 1).tolist(),
              [rng.integers(3, args.vocab, C).tolist(), rng.integers(3, args.vocab, C).tolist()])
             for _ in range(args.batch)]
    if layout == "shared":
        return pad_rows([shared_row(p, c) for p, c in pairs], P + 2 * C, 2 * C)
    return pad_rows([r for p, c in pairs for r in unshared_rows(p, c)], P + C, C)


def unshared_dpo_loss(policy, batch, *, frozen=None, rng=None):
    """Sigmoid DPO on unshared rows (2i chosen, 2i + 1 rejected): the layout prefix sharing replaces."""
    pair = lambda m: branch_logps(m, batch, 1)[1].reshape(-1, 2)  # noqa: E731
    logps, ref = pair(policy), jax.lax.stop_gradient(pair(frozen))
    losses, _, _ = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.1)
    return jnp.sum(losses), {"denom": jnp.float32(losses.shape[0]), "loss": jnp.sum(losses)}


def run(layout, precompute):
    ckpt = ensure_checkpoint(args)
    opt = optax.adamw(1e-5)
    graphdef, state = init_state(from_pretrained(ckpt), opt)
    ref_graphdef, ref_state = nnx.split(from_pretrained(ckpt))
    loss = make_dpo_loss(beta=0.1) if layout == "shared" else unshared_dpo_loss
    step = make_train_step(loss, opt, graphdef, frozen_graphdef=ref_graphdef)
    ref_fn = jax.jit(lambda s, b: branch_logps(nnx.merge(ref_graphdef, s), b, 2)[1])
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(args.steps):
        host = host_batch(rng, layout)
        t0 = time.perf_counter()
        b = {k: jnp.asarray(v) for k, v in host.items()}
        if precompute:  # a real run computes these once before training and caches them: not timed
            ref = jax.block_until_ready(ref_fn(ref_state, b))
            t0 = time.perf_counter()
            b = dict({k: jnp.asarray(v) for k, v in host.items()}, ref_logps=ref)
            state, m = step(state, b)
        else:
            state, m = step(state, b, ref_state)
        jax.block_until_ready(m)
        ts.append(time.perf_counter() - t0)
    s = med(ts[1:])
    s["first_step_s"] = ts[0]
    return s, float(m["loss"])


def main():
    res = {"lib": "posttrain", "jax": jax.__version__, "threads": args.threads,
           "shape": dict(batch=args.batch, prompt=args.prompt, completion=args.dpo_completion)}
    for key, layout, pre in (VARIANTS[v] for v in args.variants):
        s, loss = run(layout, pre)
        res[key] = s
        print(f"[posttrain dpo] {key} median {s['median']:.3f} s/step (first {s['first_step_s']:.2f} s, "
              f"loss {loss:.4f})", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()
