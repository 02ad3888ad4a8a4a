#!/usr/bin/env python
"""Prefix-shared rows against the unshared layout: one prompt with k continuations.

Shared: ONE row [prompt | c1 | ... | ck] with branch ids (each continuation attends the prompt and
itself). Unshared: k rows [prompt | ci]. Measures, on the anchor checkpoint's attention shape,
(1) attention alone, forward + backward of one layer (`attn_shared_s`, `attn_unshared_s`), and
(2) the whole full fine-tune train step (`step_shared_s`, `step_unshared_s`), medians of --reps.

Usage: .venv/bin/python benchmarks/prefix.py --threads 2 --json out.json [--prompt 256 --completion 512 --k 8]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_checkpoint, med, parse_args, write  # noqa: E402

args = parse_args([(("--completion",), dict(type=int, default=512)), (("--k",), dict(type=int, default=8))])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import posttrain  # noqa: E402,F401  (first: CPU XLA defaults before JAX starts)
from posttrain.losses import sft_loss  # noqa: E402
from posttrain.models import attention as A  # noqa: E402
from posttrain.models import from_pretrained  # noqa: E402
from posttrain.train import init_state, make_train_step  # noqa: E402


def layouts(P, C, k):
    """(shared batch, unshared batch) dicts with tokens/positions/segment_ids/branch_ids/targets/weights."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, args.vocab, P)
    conts = rng.integers(3, args.vocab, (k, C))
    L = P + k * C
    sh = dict(tokens=np.concatenate([prompt, conts.reshape(-1)])[None],
              positions=np.concatenate([np.arange(P)] + [P + np.arange(C)] * k)[None],
              branch_ids=np.concatenate([np.zeros(P)] + [np.full(C, i + 1) for i in range(k)])[None],
              segment_ids=np.ones((1, L)))
    tg = np.zeros(L, np.int64)
    w = np.zeros(L, np.float32)
    for i in range(k):  # within a branch, token j predicts token j + 1 (same work as the unshared rows)
        s = P + i * C
        tg[s:s + C - 1], w[s:s + C - 1] = conts[i, 1:], 1
    sh.update(targets=tg[None], weights=w[None])
    rows = np.concatenate([np.repeat(prompt[None], k, 0), conts], 1)
    un = dict(tokens=rows, positions=np.broadcast_to(np.arange(P + C), rows.shape), segment_ids=np.ones(rows.shape),
              targets=np.concatenate([rows[:, 1:], np.zeros((k, 1), np.int64)], 1),
              weights=np.concatenate([np.zeros((k, P)), np.ones((k, C - 1)), np.zeros((k, 1))], 1))
    cast = lambda d: {n: jnp.asarray(v, jnp.float32 if n == "weights" else jnp.int32) for n, v in d.items()}  # noqa
    return cast(sh), cast(un)


def time_fn(f, *a):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t0)
    return med(ts)


def attention_grad(batch, K, H):
    """jit(grad) of one attention layer on this batch's layout; returns (fn, q, k, v)."""
    B, T = batch["tokens"].shape
    pos = jnp.where(batch["segment_ids"] != 0, batch["positions"], -1)
    slots = jnp.arange(T, dtype=jnp.int32)
    br = batch.get("branch_ids")
    lay = A.Layout(pos, pos, slots, slots, batch["segment_ids"], batch["segment_ids"], br, br, causal_aligned=True)
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(B, T, K, 1, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(A.attention(q, k, v, lay, window=None, scale=H ** -0.5, cap=None)[0] ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v


def main():
    ckpt = ensure_checkpoint(args)
    cfg = from_pretrained(ckpt).cfg
    shared, unshared = layouts(args.prompt, args.completion, args.k)
    res = {"lib": "posttrain", "shape": dict(prompt=args.prompt, completion=args.completion, k=args.k)}
    for name, b in (("shared", shared), ("unshared", unshared)):
        f, q, k, v = attention_grad(b, cfg.num_kv_heads, cfg.head_dim)
        res[f"attn_{name}_s"] = time_fn(f, q, k, v)
    opt = optax.adamw(1e-4)
    for name, b in (("shared", shared), ("unshared", unshared)):
        graphdef, state = init_state(from_pretrained(ckpt), opt)  # the step donates (deletes) its state
        step = make_train_step(sft_loss, opt, graphdef)
        state, m = step(state, b)
        jax.block_until_ready(m)
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m)
            ts.append(time.perf_counter() - t0)
        res[f"step_{name}_s"] = med(ts)
    res["attn_shared_vs_unshared"] = res["attn_shared_s"]["median"] / res["attn_unshared_s"]["median"]
    res["step_shared_vs_unshared"] = res["step_shared_s"]["median"] / res["step_unshared_s"]["median"]
    print(f"[posttrain prefix] {args.prompt} + {args.k} x {args.completion}: attention fwd+bwd shared "
          f"{res['attn_shared_s']['median'] * 1e3:.0f} ms vs unshared {res['attn_unshared_s']['median'] * 1e3:.0f} ms; "
          f"train step {res['step_shared_s']['median']:.2f} s vs {res['step_unshared_s']['median']:.2f} s", flush=True)
    write(res, args.json)


if __name__ == "__main__":
    main()
