#!/usr/bin/env python
"""The decode step's attention alone on the chip: 16 layers' caches read one after another in one program, the
Pallas decode kernel (models/attention_tpu.decode, at several (rows, slots) blocks) against the dense XLA path,
against the bytes the filled part of the cache holds at the HBM bandwidth.

Each line: rows B, cache slots S, filled slots F (the query's slot + 1), the cache dtype, the implementation and
block, microseconds a layer (median of --reps calls of the 16-layer program), and the filled bytes over the
bandwidth / that time. llama3-1b's attention shape by default (8 kv heads of 64, 4 query heads each: a TPU cache
holds 2 heads a row, [B, 4, S, 128]).

Usage: python benchmarks/decode_attention.py [--batch 64 256] [--slots 640] [--fill 384] [--json out.jsonl]
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import attention as A
from posttrain.models.attention_tpu import decode, decode_blocks

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
ap.add_argument("--slots", type=int, default=640)
ap.add_argument("--fill", type=int, nargs="+", default=[384])
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--groups", type=int, default=4)
ap.add_argument("--head-dim", type=int, default=64)
ap.add_argument("--kv-dtype", nargs="+", default=["bfloat16", "float8_e4m3fn"])
ap.add_argument("--blocks", nargs="+", default=["auto", "8:128", "16:128", "32:128", "8:256", "16:256", "4:512",
                                                 "8:512", "64:128"],
                help="ROWS:SLOTS a grid step, or auto (decode_blocks)")
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--hbm-gbs", type=float, default=819.0)
ap.add_argument("--interpret", action="store_true", help="the kernel interpreted (a CPU check of the script)")
ap.add_argument("--json", default=None)
args = ap.parse_args()
L, K, G, H, S = args.layers, args.kv_heads, args.groups, args.head_dim, args.slots
P = A.kv_pack(H, K, "tpu")


def program(impl, blocks):
    def f(q, ks, vs, pos, slot):
        lay = A.Layout(pos[:, :1], pos, slot, jnp.arange(S, dtype=jnp.int32))
        for k, v in zip(ks, vs):  # each layer's output feeds the next layer's query (no reordering)
            if impl == "dense":
                out, _ = A.attention(q, k, v, lay, window=None, scale=H ** -0.5, cap=None, impl="dense")
            else:
                out = decode(q, k, v, lay, scale=H ** -0.5, cap=None, interpret=args.interpret, blocks=blocks)
            q = (q + out).astype(q.dtype)
        return q
    return jax.jit(f)


def main():
    lines = []
    for B in args.batch:
        for kv_name in args.kv_dtype:
            kv_dt = jnp.dtype(kv_name)
            r = np.random.default_rng(0)
            q = jnp.asarray(r.normal(size=(B, 1, K, G, H)), jnp.bfloat16)
            ks = [jnp.asarray(r.normal(size=(B, K // P, S, P * H)), jnp.bfloat16).astype(kv_dt) for _ in range(L)]
            vs = [jnp.asarray(r.normal(size=(B, K // P, S, P * H)), jnp.bfloat16).astype(kv_dt) for _ in range(L)]
            for F in args.fill:
                pos = jnp.asarray(np.where(np.arange(S) < F, np.arange(S), -1)[None].repeat(B, 0), jnp.int32)
                slot = jnp.asarray([F - 1], jnp.int32)
                need = L * 2 * B * (K // P) * F * P * H * kv_dt.itemsize / (args.hbm_gbs * 1e9)
                for spec in ["dense"] + args.blocks:
                    blocks = None if spec in ("dense", "auto") else tuple(map(int, spec.split(":")))
                    if blocks and B % blocks[0]:
                        continue
                    used = blocks or decode_blocks(B, K // P, S, P * H, kv_dt.itemsize)
                    fn = program("dense" if spec == "dense" else "kernel", blocks)
                    try:
                        t0 = time.perf_counter()
                        fn(q, ks, vs, pos, slot).block_until_ready()
                        first = time.perf_counter() - t0
                        times = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            fn(q, ks, vs, pos, slot).block_until_ready()
                            times.append(time.perf_counter() - t0)
                    except Exception as e:  # a block that does not fit: say so, go on
                        line = {"batch": B, "kv_dtype": kv_name, "fill": F, "impl": spec, "error": repr(e)[:300]}
                        print(json.dumps(line), flush=True)
                        lines.append(line)
                        continue
                    t = statistics.median(times)
                    line = {"bench": "decode_attention", "batch": B, "slots": S, "fill": F, "kv_dtype": kv_name,
                            "impl": "dense" if spec == "dense" else "kernel",
                            "blocks": None if spec == "dense" else list(used), "us_a_layer": t / L * 1e6,
                            "bandwidth_us_a_layer": need / L * 1e6, "bandwidth_fraction": need / t,
                            "first_s": first, "backend": jax.default_backend()}
                    print(json.dumps(line), flush=True)
                    lines.append(line)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)


main()
