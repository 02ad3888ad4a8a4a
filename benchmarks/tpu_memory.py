#!/usr/bin/env python
"""Where a training step's temporary memory goes as the row grows (issue #51: tests/test_attention.py's
test_train_step_memory_grows_linearly fails on a TPU chip: 19.4x the temporaries for 4x the tokens).

For each attention implementation (the backend's own choice, and the blockwise path forced) and each row length,
compiles the full fine-tune step of the test's small model (or --head-dim 128: the same width with 128-wide heads)
and prints XLA's temporary bytes, then the largest arrays of the optimized HLO of the longest row: the quadratic
part shows as an array whose size grows with T^2.

Usage: python benchmarks/tpu_memory.py [--lengths 1024 2048 4096 8192] [--head-dim 16] [--json out.json]
"""

import argparse
import json
import re

import jax
import jax.numpy as jnp

import posttrain  # noqa: F401  (first: CPU XLA defaults before JAX starts)
from posttrain.models import attention as A

ITEM = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f16": 2, "s16": 2}


def step_and_batch(T, head_dim):
    import optax
    from flax import nnx

    from posttrain.losses import sft_loss
    from posttrain.models import ModelConfig, Transformer
    from posttrain.train import init_state, make_train_step

    heads, kv = (4, 2) if head_dim == 16 else (2, 1)  # the test's model; else two heads of head_dim
    cfg = ModelConfig(vocab_size=97, embed_dim=64, num_layers=2, num_heads=heads, num_kv_heads=kv,
                      head_dim=head_dim, mlp_dim=96)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-4)
    graphdef, state = init_state(model, opt)
    step = make_train_step(sft_loss, opt, graphdef)
    i32 = jax.ShapeDtypeStruct((1, T), jnp.int32)
    batch = dict(tokens=i32, positions=i32, segment_ids=i32, targets=i32,
                 weights=jax.ShapeDtypeStruct((1, T), jnp.float32))
    return step, state, batch


def biggest(hlo: str, n=12):
    """The n largest array shapes named in the optimized HLO text, with their bytes and one line that makes each."""
    seen = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\w+)\[([\d,]+)\]", line)
        if not m or m.group(1) not in ITEM:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = ITEM[m.group(1)]
        for d in dims:
            size *= d
        key = f"{m.group(1)}[{m.group(2)}]"
        if key not in seen:
            seen[key] = (size, line.strip()[:220])
    return sorted(((s, k, ln) for k, (s, ln) in seen.items()), reverse=True)[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--impls", nargs="+", default=["auto", "blockwise"])
    ap.add_argument("--long", type=int, default=None, help="attention_tpu.LONG: rows of this many slots or more "
                    "take LONG_BLOCK tiles (a huge value: every row keeps BLOCKS)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.long is not None:
        from posttrain.models import attention_tpu

        attention_tpu.LONG = args.long
    real_choose = A.choose
    rows = []
    for impl in args.impls:
        A.choose = real_choose if impl == "auto" else (lambda *a, _i=impl, **k: _i)
        for T in args.lengths:
            step, state, batch = step_and_batch(T, args.head_dim)
            compiled = step.lower(state, batch).compile()
            mem = compiled.memory_analysis()
            row = dict(impl=impl, T=T, head_dim=args.head_dim, long=args.long, backend=jax.default_backend(),
                       chosen=real_choose(jax.default_backend(), T=T, S=T, branches=False, softcap=False,
                                          cached=False) if impl == "auto" else impl,
                       temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes)
            print(json.dumps(row), flush=True)
            if T == max(args.lengths):
                row["largest"] = [dict(bytes=s, shape=k, line=ln) for s, k, ln in biggest(compiled.as_text())]
                for s, k, ln in biggest(compiled.as_text()):
                    print(f"   {s / 1e6:9.2f} MB  {k:28s} {ln}", flush=True)
            rows.append(row)
    A.choose = real_choose
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
