#!/usr/bin/env python
"""Decode-step KV cache layouts on the chip: which one lets a step write its token in place and read the cache at
the bandwidth limit. A stand-alone model of the sampler's decode loop (no posttrain import): L layers, each step
writes one token's keys and values into every layer's cache (dynamic_update_slice), attends the whole cache
(dense, float32 scores) and feeds the result to the next step, for N steps in one while loop.

Layouts (K key/value heads of H dims, G query heads per key head, S slots):
  bksh    [B, K, S, H]        posttrain's cache until now
  bskh    [B, S, K, H]
  packed  [B, K/P, S, P*H]    P = 128 / H heads side by side in the 128 lanes; the queries of the P heads of a row
                              are spread over zero-padded lanes, so one [.., P*G, 128] x [.., S, 128] product gives
                              each head's scores exactly
  padded  [B, K, S, 128]      H zero-padded to 128
Each line: the layout, the step time, the bytes a step must read (the whole cache, unpadded) over the HBM bandwidth,
and the layout XLA gave the loop's cache (from the compiled HLO).

Usage: python benchmarks/kv_layout.py [--batch 64 256] [--slots 640] [--steps 128] [--json out.json]
"""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--groups", type=int, default=4)
ap.add_argument("--head-dim", type=int, default=64)
ap.add_argument("--slots", type=int, default=640)
ap.add_argument("--steps", type=int, default=128)
ap.add_argument("--layouts", nargs="+", default=["bksh", "bskh", "packed", "padded"])
ap.add_argument("--hbm-gbs", type=float, default=819.0)
ap.add_argument("--json", default=None)
args = ap.parse_args()
L, K, G, H, S, N = args.layers, args.kv_heads, args.groups, args.head_dim, args.slots, args.steps
P = max(1, 128 // H)
D = K * G * H


def shapes(layout, B):
    return {"bksh": (B, K, S, H), "bskh": (B, S, K, H), "packed": (B, K // P, S, P * H),
            "padded": (B, K, S, 128)}[layout]


def write(layout, cache, new, i):  # new [B, K, H]
    z = jnp.zeros((), jnp.int32)
    if layout == "bksh":
        return jax.lax.dynamic_update_slice(cache, new[:, :, None], (z, z, i, z))
    if layout == "bskh":
        return jax.lax.dynamic_update_slice(cache, new[:, None], (z, i, z, z))
    if layout == "packed":
        return jax.lax.dynamic_update_slice(cache, new.reshape(new.shape[0], K // P, 1, P * H), (z, z, i, z))
    pad = jnp.pad(new, ((0, 0), (0, 0), (0, 128 - H)))
    return jax.lax.dynamic_update_slice(cache, pad[:, :, None], (z, z, i, z))


def attend(layout, q, kc, vc, valid):  # q [B, K, G, H] -> [B, K, G, H]; valid [S]
    neg = jnp.float32(-1e30)
    if layout in ("bksh", "bskh"):
        spec = "bksh" if layout == "bksh" else "bskh"
        s = jnp.einsum(f"bkgh,{spec}->bkgs", q, kc).astype(jnp.float32) / np.sqrt(H)
        p = jax.nn.softmax(jnp.where(valid, s, neg), axis=-1).astype(q.dtype)
        return jnp.einsum(f"bkgs,{spec}->bkgh", p, vc)
    if layout == "padded":
        qp = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, 128 - H)))
        s = jnp.einsum("bkgd,bksd->bkgs", qp, kc).astype(jnp.float32) / np.sqrt(H)
        p = jax.nn.softmax(jnp.where(valid, s, neg), axis=-1).astype(q.dtype)
        return jnp.einsum("bkgs,bksd->bkgd", p, vc)[..., :H]
    B = q.shape[0]
    eye = jnp.eye(P, dtype=q.dtype)
    q5 = q.reshape(B, K // P, P, G, H)
    q2 = (q5[:, :, :, :, None, :] * eye[None, None, :, None, :, None]).reshape(B, K // P, P * G, P * H)
    s = jnp.einsum("bcqd,bcsd->bcqs", q2, kc).astype(jnp.float32) / np.sqrt(H)
    p = jax.nn.softmax(jnp.where(valid, s, neg), axis=-1).astype(q.dtype)
    o = jnp.einsum("bcqs,bcsd->bcqd", p, vc).reshape(B, K // P, P, G, P, H)
    return (o * eye[None, None, :, None, :, None]).sum(axis=4).reshape(B, K, G, H)


def run(layout, B):
    key = jax.random.key(0)
    wq = jax.random.normal(key, (L, D, D), jnp.bfloat16) * 0.02
    wkv = jax.random.normal(jax.random.fold_in(key, 1), (L, D, 2 * K * H), jnp.bfloat16) * 0.02
    caches = tuple(jnp.zeros(shapes(layout, B), jnp.bfloat16) for _ in range(2 * L))
    x0 = jax.random.normal(jax.random.fold_in(key, 2), (B, D), jnp.bfloat16)

    def body(i, c):
        x, caches = c
        out = []
        valid = jnp.arange(S) <= i
        for layer in range(L):
            q = (x @ wq[layer]).reshape(B, K, G, H)
            k, v = jnp.split((x @ wkv[layer]).reshape(B, 2 * K, H), 2, axis=1)
            kc = write(layout, caches[2 * layer], k, i)
            vc = write(layout, caches[2 * layer + 1], v, i)
            out += [kc, vc]
            x = x + attend(layout, q, kc, vc, valid).reshape(B, D)
        return x, tuple(out)

    f = jax.jit(lambda x, c: jax.lax.fori_loop(0, N, body, (x, c)), donate_argnums=1)
    compiled = f.lower(x0, caches).compile()
    text = compiled.as_text()
    dims = ",".join(map(str, shapes(layout, B)))
    m = re.search(r"bf16\[" + re.escape(dims) + r"\]\{[^}]*\}", text)
    x, caches = compiled(x0, caches)
    jax.block_until_ready(x)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        x, caches = compiled(x, caches)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - t) / N)
    step = min(times)
    need = (2 * L * B * S * K * H * 2 + L * D * (D + 2 * K * H) * 2) / (args.hbm_gbs * 1e9)
    return {"layout": layout, "batch": B, "step_ms": step * 1e3, "bandwidth_ms": need * 1e3,
            "bandwidth_fraction": need / step, "xla_cache_layout": m.group(0) if m else None,
            "device": jax.devices()[0].device_kind}


def check():  # every layout gives the same attention as bksh (one step, random cache)
    rng = np.random.default_rng(0)
    B = 2
    q = jnp.asarray(rng.normal(size=(B, K, G, H)), jnp.float32)
    kc = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    vc = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    valid = jnp.arange(S) < S // 2
    ref = attend("bksh", q, kc, vc, valid)
    conv = {"bskh": lambda c: c.transpose(0, 2, 1, 3),
            "packed": lambda c: c.reshape(B, K // P, P, S, H).transpose(0, 1, 3, 2, 4).reshape(B, K // P, S, P * H),
            "padded": lambda c: jnp.pad(c, ((0, 0), (0, 0), (0, 0), (0, 128 - H)))}
    for name, f in conv.items():
        got = attend(name, q, f(kc), f(vc), valid)
        assert np.allclose(got, ref, atol=1e-4), (name, float(jnp.abs(got - ref).max()))


check()
rows = []
for B in args.batch:
    for layout in args.layouts:
        try:
            r = run(layout, B)
        except Exception as e:  # noqa: BLE001 - an out-of-memory layout is a result too
            r = {"layout": layout, "batch": B, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(r)
        print(json.dumps(r), flush=True)
if args.json:
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)
