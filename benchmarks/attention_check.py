#!/usr/bin/env python
"""Check the attention implementation this backend chooses against the dense reference.

Run wherever a GPU / TPU is available (on CPU it checks the blockwise path): for causal, padded,
packed and sliding layouts at --seq tokens, the chosen implementation's output and gradients
(q, k, v) must equal the dense reference's. Prints one line per layout and writes JSON with the
max |difference| and whether each is within --atol.

Usage: python benchmarks/attention_check.py [--seq 1024] [--dtype bfloat16 --atol 3e-2] [--json out.json]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import posttrain  # noqa: F401  (first: CPU XLA defaults before JAX starts)
from posttrain.models import attention as A


def layouts(B, T):
    pos = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    slots = jnp.arange(T, dtype=jnp.int32)
    pad = (np.arange(T)[None] < np.array([T, T // 2 + 3])[:, None]).astype(np.int32)
    half = T // 2
    seg = np.concatenate([np.ones((B, half)), 2 * np.ones((B, T - half))], 1).astype(np.int32)
    seg_pos = np.concatenate([np.arange(half), np.arange(T - half)])[None].repeat(B, 0).astype(np.int32)
    out = {"causal": (A.Layout(jnp.asarray(pos), jnp.asarray(pos), slots, slots, causal_aligned=True), None)}
    p = jnp.asarray(np.where(pad != 0, pos, -1))
    out["padded"] = (A.Layout(p, p, slots, slots, jnp.asarray(pad), jnp.asarray(pad), causal_aligned=True), None)
    sp = jnp.asarray(seg_pos)
    out["packed"] = (A.Layout(sp, sp, slots, slots, jnp.asarray(seg), jnp.asarray(seg), causal_aligned=True), None)
    out["sliding"] = (out["causal"][0], 128)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    B, T, K, G, H = 2, args.seq, 2, 2, 64
    dt = jnp.dtype(args.dtype)
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, T, K, G, H)), dt)
    k = jnp.asarray(r.normal(size=(B, K, T, H)), dt)
    v = jnp.asarray(r.normal(size=(B, K, T, H)), dt)
    ct = jnp.asarray(r.normal(size=q.shape), dt)
    backend = jax.default_backend()
    res = {"backend": backend, "devices": [str(d) for d in jax.devices()], "seq": T, "layouts": {}}
    for name, (lay, window) in layouts(B, T).items():
        impl = A.choose(backend, T=T, S=T, branches=False, softcap=False, cached=False)

        def run(impl, lay=lay, window=window):
            f = jax.jit(lambda q, k, v: A.attention(q, k, v, lay, window=window, scale=H ** -0.5, cap=None,
                                                    impl=impl)[0])
            out, vjp = jax.vjp(f, q, k, v)
            return (out,) + vjp(ct)

        got, ref = run(impl), run("dense")
        diff = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) for a, b in zip(got, ref))
        res["layouts"][name] = dict(impl=impl, max_abs_diff=diff, ok=diff <= args.atol)
        print(f"[attention check] {backend} {name:<8} {impl:<9} max |diff| {diff:.2e} "
              f"{'ok' if diff <= args.atol else 'FAIL'}", flush=True)
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)
    if not all(x["ok"] for x in res["layouts"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
